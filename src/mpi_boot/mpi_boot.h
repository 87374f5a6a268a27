/* mpi_boot.h — process start-up for dgtrain (docs/design.md §2 "boot"): MPI with MPI_THREAD_MULTIPLE, the
 * world and node-local communicators, every rank's host / node id / local rank, the hwloc topology of
 * this node (live, or an XML description of a machine that is not here), the choice of GPU for each
 * rank, CPU binding near it, the --dry-run/--topology report, and the rank-agreed failure protocol.
 *
 * Topology sources, in order: `[topology] xml` from the config, else $HWLOC_XMLFILE, else the live
 * machine. I/O devices (PCI GPUs and NICs) are kept. An XML topology that does not describe this
 * machine is used for reporting and planning only: the binding is computed but not applied (set
 * HWLOC_THISSYSTEM=1 to assert that the XML is this machine).
 *
 * GPU choice: the GPUs visible to this process (all GPUs of the node, narrowed by CUDA_VISIBLE_DEVICES
 * when it lists indices and the topology is this machine's) in CUDA index order; local rank r takes
 * visible GPU r % n_visible. A rank should open its device with cudaDeviceGetByPCIBusId(gpus[gpu].pci_busid);
 * with CUDA_DEVICE_ORDER=PCI_BUS_ID, cuda_index is the same device.
 *
 * Binding (`[topology] bind = auto`): the local ranks that chose GPUs with the same CPU locality
 * share that locality's cores in equal, contiguous parts (ordered by local rank); with no GPU, the
 * local ranks share all the node's allowed cores the same way. A rank that would get no whole core
 * (more ranks than cores) gets the one core it lands on. `bind = none` leaves the launcher's binding.
 *
 * Failure agreement (dg_boot_agree): every rank calls it at the same point with its local status and
 * every rank gets the same answer. Order of precedence: DG_OK < DG_ERR_SIGNAL (75) < DG_ERR_PEER (3)
 * < DG_ERR_USAGE (1) < DG_ERR_RUNTIME (2). A rank's own definite failure (1, 2) outranks "a peer
 * failed" (3), which is usually a consequence of it; a clean stop after a checkpoint (75) is reported
 * only when nobody failed. Among ranks with the winning code, the lowest rank's message is used.
 */
#ifndef DG_MPI_BOOT_H
#define DG_MPI_BOOT_H

#include <hwloc.h>
#include <mpi.h>
#include <stdio.h>

#include "config.h"
#include "dg_common.h"
#include "dg_mpi.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DG_TOPO_MAX_GPUS 32
#define DG_TOPO_MAX_NICS 32
#define DG_HOST_MAX 256

typedef struct dg_gpu_info {
    char pci_busid[32]; /* "0000:07:00.0" */
    char name[64];      /* model name when the topology knows it, else "PCI vendor:device" */
    int numa;           /* os index of the one NUMA node the GPU is local to, -1 if several/unknown */
    char cpuset[256];   /* os indices of the PUs near the GPU, hwloc list syntax "0-15,32-47" */
    int cuda_index;     /* CUDA device index (see the header comment), -1 when not visible */
} dg_gpu_info_t;

typedef struct dg_nic_info {
    char name[32]; /* "mlx5_0", "ib0", "eth0", or "pci:<busid>" when no OS device is known */
    char pci_busid[32];
    int numa;
    char kind[16]; /* "ib" (OpenFabrics/InfiniBand), "eth", or "net" */
} dg_nic_info_t;

typedef struct dg_node_topo {
    char host[DG_HOST_MAX];
    int n_sockets, n_cores, n_pus, n_numa;
    int n_gpus;
    dg_gpu_info_t gpus[DG_TOPO_MAX_GPUS]; /* PCI bus order */
    int n_nics;
    dg_nic_info_t nics[DG_TOPO_MAX_NICS]; /* PCI bus order */
    /* n_gpus x n_gpus GPU-to-GPU NVLink bandwidth in GB/s (row-major, diagonal 0) from hwloc's
     * "NVLinkBandwidth" distances, or NULL when the topology has none. Direct links count as given;
     * GPUs attached to a connected set of NVSwitches also get min(GPU i to switches, GPU j to
     * switches). */
    double *nvlink_bw;
} dg_node_topo_t;

/* Load a topology with its I/O devices: the XML file `xml_path_or_null`, or when NULL $HWLOC_XMLFILE,
 * or the live machine. Pure local (no MPI): the planner uses it on XML files of other machines.
 * `keep_or_null` receives the loaded hwloc topology (caller destroys it), else it is destroyed.
 * Bad or missing XML: DG_ERR_USAGE naming the file. */
dg_status_t dg_topo_load(const char *xml_path_or_null, dg_node_topo_t *out, hwloc_topology_t *keep_or_null);
void dg_topo_free(dg_node_topo_t *t);

/* Write the topology (XML file or NULL = live/$HWLOC_XMLFILE, as dg_topo_load) as hwloc XML to
 * out_path, atomically. */
dg_status_t dg_topo_export_xml(const char *xml_in_or_null, const char *out_path);

/* The GPU and CPU set local rank `local_rank` of `local_size` gets on this node under the rules of the
 * header comment. `bind_auto` 0 = bind none (cpuset_out gets the whole allowed set). gpu_out: index
 * into t->gpus or -1; numa_out: os index of the one NUMA node the cpuset lies in, or -1. Pure local. */
dg_status_t dg_topo_choose(hwloc_topology_t topo, const dg_node_topo_t *t, int local_rank, int local_size,
                           int bind_auto, int *gpu_out, hwloc_bitmap_t cpuset_out, int *numa_out);

typedef struct dg_boot {
    int world_rank, world_size;
    int local_rank, local_size;
    int node_id, n_nodes; /* nodes numbered by their lowest world rank */
    char host[DG_HOST_MAX];
    MPI_Comm world; /* dup of MPI_COMM_WORLD with MPI_ERRORS_RETURN */
    MPI_Comm node;  /* the ranks of this node, MPI_ERRORS_RETURN */
    int provided_thread_level;
    char mpi_version[256]; /* first line of MPI_Get_library_version */
    int owns_mpi;          /* dg_boot_init called MPI_Init_thread (so finalize calls MPI_Finalize) */

    /* gathered on every rank, indexed by world rank */
    char (*hosts)[DG_HOST_MAX];
    int *node_ids;
    int *local_ranks;

    /* filled by dg_boot_topology */
    int have_topo;
    dg_node_topo_t topo; /* this node */
    hwloc_topology_t hwtopo;
    char topo_source[DG_CFG_STR]; /* "live" or the XML path */
    int gpu;                      /* index into topo.gpus bound to this rank, -1 none */
    int numa;                     /* NUMA node of the bound cpuset, -1 if several */
    char bound_cpuset[256];       /* hwloc list syntax */
    char bind_status[64]; /* "applied", "none (launcher's)", "computed, not applied (XML)", "failed: ..." */

    /* dg_boot_agree aborts the job (exit 3) when peers do not arrive within this many seconds; 0 = wait
     * forever (the default); dgtrain sets it to health.timeout_s */
    double agree_timeout_s;
    dg_status_t agreed_code; /* the last failure dg_boot_agree settled, and its message: passing it on */
    char agreed_msg[2048];   /* again (from an outer caller) is recognised and not reported twice */
} dg_boot_t;

/* MPI_Init_thread(MPI_THREAD_MULTIPLE) (fails with DG_ERR_RUNTIME if not provided), communicators,
 * hosts, node ids and local ranks gathered on all ranks. Collective over MPI_COMM_WORLD. On failure
 * *out may still be set and must be passed to dg_boot_finalize.
 * Testing aid: DG_BOOT_RANKS_PER_NODE=k groups consecutive world ranks k at a time into simulated
 * nodes instead of using shared memory. */
dg_status_t dg_boot_init(int *argc, char ***argv, dg_boot_t **out);

/* Which rank this process will be, from the launcher's environment (Open MPI, PMIx, PMI, Slurm), before
 * MPI is up: a tool's --help and --version print on rank 0 only and never start MPI. 0 when none is set. */
int dg_boot_launcher_rank(void);

/* The start of a command-line tool PROG: the environment switches checked before MPI (the boot reads
 * them too; rank 0 prints the warnings), then dg_boot_init. A failure hits every rank alike, so each
 * prints "PROG: error on rank R[ (HOST)]: MESSAGE" on stderr; everything is released (*out NULL) and
 * the status returned, for the exit code. */
dg_status_t dg_boot_start(const char *prog, int *argc, char ***argv, dg_boot_t **out);

/* Load this node's topology (config xml / $HWLOC_XMLFILE / live), choose this rank's GPU and bind
 * (cfg->topology.bind). Local only (no collective), so its status must go through dg_boot_agree. */
dg_status_t dg_boot_topology(dg_boot_t *b, const dg_config_t *cfg);

/* Collective: agree on one status (precedence in the header comment). A failure is printed once, by
 * rank 0, on stderr as "dgtrain: error on rank R (HOST)[ and N other ranks]: MESSAGE"; every rank
 * returns the agreed code, with "rank R (HOST)[ and N other ranks]: MESSAGE" as dg_last_error().
 * Passing an already agreed failure (code and dg_last_error() unchanged) to a later dg_boot_agree on
 * every rank returns it again without printing it twice, so nested callers may each agree. */
dg_status_t dg_boot_agree(dg_boot_t *b, dg_status_t local);

/* Collective: rank 0 prints the rank table and the per-node topology (json = 0), or the same as one
 * JSON object (json = 1, no trailing newline). Needs dg_boot_topology first. */
dg_status_t dg_boot_report(dg_boot_t *b, int json, FILE *out);

/* Free everything and MPI_Finalize (when dg_boot_init initialized MPI). NULL is fine. */
void dg_boot_finalize(dg_boot_t *b);

/* The thread level as text ("MPI_THREAD_MULTIPLE"). */
const char *dg_boot_thread_level_name(int level);

/* Write `s` as a JSON string literal (quoted, escaped). */
void dg_boot_json_string(FILE *out, const char *s);

#ifdef __cplusplus
}
#endif
#endif
