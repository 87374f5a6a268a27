/* planner.h — the topology-SLA scorer: picks the device mesh (dp_replicate x dp_shard x tp and the
 * rank order) for the hardware at hand, and explains the choice. Pure computation; docs/planning.md
 * explains the model with a worked 64-GPU example.
 *
 * Inputs: a cluster model (nodes of one hwloc topology, ranks per node, the network, link bandwidths and
 * latencies per link class, the memory budget per rank) and a workload (model sizes, batch, precision).
 * For every candidate mesh the planner estimates, per step: the communication volume and time of each
 * mesh dimension (alpha-beta over the slowest link of each group's ring), the memory per rank against
 * the budget (infeasible plans are kept in the table with the reason), the hop variance across the
 * groups of each dimension, and the cost of recovering from one node's failure. See dg_plan_score for
 * the score.
 */
#ifndef DG_PLANNER_H
#define DG_PLANNER_H

#include <stdint.h>
#include <stdio.h>

#include "dg_common.h"
#include "dg_mesh.h"
#include "mpi_boot.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Link classes, from closest to farthest; the index is the "hop" count used for hop variance. */
typedef enum {
    DG_LINK_SAME_DEVICE = 0,
    DG_LINK_NVLINK = 1,
    DG_LINK_PCIE_SWITCH = 2, /* two GPUs under one PCIe switch (a common non-host bridge) */
    DG_LINK_SAME_SOCKET = 3, /* through the host bridge / memory of one socket (NUMA node) */
    DG_LINK_CROSS_SOCKET = 4,
    DG_LINK_NETWORK = 5,
    DG_LINK_NCLASS = 6
} dg_link_class_t;

typedef struct dg_link_param {
    double bw_GBps; /* sustained bandwidth of one rank's stream over this link, GB/s (1e9 bytes) */
    double lat_us;  /* per-message latency (alpha), microseconds */
} dg_link_param_t;

const char *dg_link_class_name(int cls);

#define DG_PLAN_MAX_LOCAL 256

typedef struct dg_cluster {
    int n_nodes, ranks_per_node, world;
    int gpu_mode; /* 1: one rank per GPU; 0: CPU ranks */
    char node_desc[256];
    /* per local rank: GPU index (-1 for CPU ranks), NUMA node, socket, PCIe switch id (-1 none) */
    int local_gpu[DG_PLAN_MAX_LOCAL], local_numa[DG_PLAN_MAX_LOCAL], local_socket[DG_PLAN_MAX_LOCAL];
    int local_switch[DG_PLAN_MAX_LOCAL];
    int n_gpus;        /* GPUs per node */
    double *nvlink_bw; /* n_gpus x n_gpus GB/s or NULL (owned) */
    int nics_per_node;
    double nic_GBps; /* bandwidth of one NIC, GB/s */
    dg_link_param_t link[DG_LINK_NCLASS];
    double mem_per_rank_bytes; /* device memory budget per rank */
    double peak_flops_per_rank;
    int max_tp; /* largest tp considered (default: GPUs per node, or ranks per node for CPU) */
    int max_pp; /* largest pp considered (the world for the live and for described clusters) */
} dg_cluster_t;

/* The defaults table (docs/planning.md lists the numbers and their sources). gpu_mode selects GPU-style
 * or CPU-rank defaults for the intra-node classes. */
void dg_cluster_default_links(dg_link_param_t link[DG_LINK_NCLASS], int gpu_mode);

/* A cluster of n_nodes identical nodes of topology `t` (hwtopo, when not NULL, is used to find PCIe
 * switches), ranks_per_node ranks each (0 = one per GPU, or one per core when there are no GPUs).
 * Budget and peak default to a GPU table by name (H100/H200/A100/V100; 80 GiB otherwise) or, for CPU
 * ranks, node memory / ranks and a nominal core peak. DG_ERR_USAGE for impossible layouts. */
dg_status_t dg_cluster_from_topo(const dg_node_topo_t *t, void *hwtopo, int n_nodes, int ranks_per_node,
                                 dg_cluster_t *out);
/* A cluster description file (INI; docs/planning.md):
 *   [cluster] node_xml = FILE (relative to the description), nodes = N, ranks_per_node = R,
 *             nics_per_node = K, nic_gbps = 400 (per NIC, Gbit/s), nvlink = auto|all|none,
 *             mem_gib = per-rank budget, peak_tflops = per rank
 *   [links]   <class>_gbps / <class>_us for nvlink, pcie_switch, same_socket, cross_socket, network
 * world > 0 overrides nodes (nodes = ceil(world / ranks_per_node)); the world must fill whole nodes. */
dg_status_t dg_cluster_load(const char *path, int world, dg_cluster_t *out);
void dg_cluster_free(dg_cluster_t *c);
/* Link class between two world ranks under the cluster's rank placement (rank r on node r / rpn). */
int dg_cluster_link(const dg_cluster_t *c, int a, int b);

typedef struct dg_plan_workload {
    int n_layer, n_head, d_model, seq_len, vocab;
    int64_t n_params;
    int micro_batch;      /* sequences per rank per micro-step */
    int64_t global_batch; /* sequences per step */
    int param_bytes;      /* bytes per element of compute weights and activations (2 bf16, 4 fp32) */
    int grad_bytes;       /* bytes per element of reduced gradients */
    int reshard_after_forward;
    int pp_schedule; /* dg_pp_kind_t of pipeline candidates (0 1f1b, 1 interleaved) */
    int pp_virtual;  /* chunks per rank with interleaved (<= 1: 2) */
} dg_plan_workload_t;

typedef struct dg_plan {
    dg_mesh_shape_t mesh;
    int feasible;
    char why[160];                /* infeasibility reason, "" when feasible */
    double comm_ms[DG_MESH_NDIM]; /* per step, per dimension */
    double comm_bytes[DG_MESH_NDIM];
    int hops[DG_MESH_NDIM];                                 /* worst link class in the dimension's groups */
    double comm_total_ms, compute_ms, relayout_ms, step_ms; /* step = compute + comm + relayout */
    double mem_bytes;                                       /* per rank */
    double hop_variance;                                    /* normalised to [0, 1] */
    double recovery_cost;                                   /* [0, 1] */
    double score;                                           /* [0, 1], 1 = best; 0 for infeasible plans */
    /* pipeline (mesh.size[DG_MESH_PP] > 1): compute_ms is the simulated makespan of the schedule */
    int pp_microbatches;
    double pp_bubble;    /* simulated bubble fraction */
    double pp_imbalance; /* largest stage's FLOPs / mean */
    double pp_p2p_ms;    /* one micro-batch's activation message on the slowest stage-to-stage link */
    double pp_p2p_bytes; /* per rank per step, activations and gradients sent */
    int pp_hops;         /* worst link class between consecutive stages */
} dg_plan_t;

typedef struct dg_plan_result {
    int n;
    dg_plan_t *plans; /* ranked: feasible by score (ties by step time), then infeasible */
    int chosen;       /* index into plans (0) or -1 when none is feasible */
    char reason[512];
    char pp_reason[768]; /* why pipeline parallelism was chosen or rejected ("" when not considered) */
} dg_plan_result_t;

/* Enumerate and score every candidate. DG_ERR_USAGE when no candidate is feasible (the message
 * names the smallest memory need against the budget). */
dg_status_t dg_plan_run(const dg_cluster_t *c, const dg_plan_workload_t *w, dg_plan_result_t *out);
void dg_plan_result_free(dg_plan_result_t *r);
/* The ranked table (max_rows <= 0: all) and the choice with its reason; or one JSON object. */
void dg_plan_print(const dg_plan_result_t *r, const dg_cluster_t *c, FILE *out, int json, int max_rows);

/* Estimate one collective: ring time in seconds for `bytes` per rank over a group whose slowest link
 * has parameters lp, for `n` ranks. kind: 0 all-reduce, 1 all-gather, 2 reduce-scatter. */
double dg_plan_collective_s(int kind, double bytes, int n, dg_link_param_t lp);

#ifdef __cplusplus
}
#endif
#endif
