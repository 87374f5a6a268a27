/* fsdp.h — the parallel plan of a training run (docs/design.md §2 "plan"): the device mesh dp_replicate x
 * dp_shard x tp over the world with one communicator per dimension, the parallel options from the
 * `[parallel]` config section, the model built on that mesh (FSDP / HSDP / tensor parallelism are graph
 * passes in src/graph, graph.h, and builder rules in src/model, dg_model.h), and a DTensor-style view of
 * where every tensor lives: one placement per mesh dimension — Shard(d), Replicate or Partial(sum) —
 * plus the global shape and this rank's local pieces.
 *
 * Typical use (train.c):
 *   dg_fsdp_opts_t o; dg_fsdp_opts_from_config(cfg, &o);
 *   dg_fsdp_create(world, &mesh, &o, &f);                 // collective over world
 *   dg_fsdp_model_create(f, &desc, be, micro_batch, seed, 0, &model);
 *   ... dg_model_forward_backward / dg_model_optimizer_step on every rank ...
 *   dg_model_free(model); dg_fsdp_free(f);                // before MPI_Finalize
 * A collective that times out (0.9 x health.timeout_s) fails the model call with DG_ERR_PEER and a message
 * naming the collective, the group, the step and the ranks that did not arrive; the caller then ends
 * the job on every rank with dg_fsdp_abort (exit code 3).
 */
#ifndef DG_FSDP_H
#define DG_FSDP_H

#include <mpi.h>
#include <stdio.h>

#include "comm.h"
#include "config.h"
#include "dg_common.h"
#include "dg_mesh.h"
#include "dg_model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dg_fsdp_opts {
    double timeout_s;          /* every collective wait (0.9 x health.timeout_s; <= 0: a year) */
    double bucket_mb;          /* parallel.bucket_mb */
    double prefetch_budget_mb; /* parallel.prefetch_budget_mb */
    int overlap;               /* parallel.overlap */
    int reshard_after_forward; /* parallel.reshard_after_forward */
    char comm[8];              /* parallel.comm: auto | mpi | nccl */
    int cuda_device;           /* this rank's CUDA device when the compute backend is cuda, else -1 */
    char gpu_id[64];           /* names this rank's physical GPU on its node (PCI bus id); "" = unknown,
                                  then the device ordinal stands for it */
    int rs_mpi;                /* parallel.reduce_scatter = mpi (else dg_comm's ring) */
    int nccl_nonblocking;      /* parallel.nccl_nonblocking */
    int plan_only;             /* no communicators (--plan-only / --dry-run): the model can only be planned */
    int model_flags;           /* DG_MODEL_* graph options from the config that dg_fsdp_model_create adds
                                  (train.recompute: DG_MODEL_RECOMPUTE_GELU, _SELECTIVE, _FULL) */
    dg_dtype_t reduce_dtype;   /* train.reduce_dtype: DG_F32 (default) or DG_BF16 */
} dg_fsdp_opts_t;

void dg_fsdp_opts_default(dg_fsdp_opts_t *o);
void dg_fsdp_opts_from_config(const dg_config_t *cfg, dg_fsdp_opts_t *o);

typedef struct dg_fsdp {
    dg_mesh_shape_t mesh;
    int rank, world;
    int coord[DG_MESH_NDIM]; /* this rank's mesh coordinates */
    dg_comm_mesh_t *comms;   /* NULL with plan_only */
    dg_model_parallel_t par; /* what dg_fsdp_model_create passes to the model */
    char comm_backend[8];    /* what the comms run on: "mpi" | "nccl" | "none" (one rank, plan only) */
    char comm_why[160];      /* why parallel.comm = auto chose it */
    dg_fsdp_opts_t opts;
} dg_fsdp_t;

/* Collective over `world` (whose size must equal the mesh's product): coordinates, and one comm per mesh
 * dimension. The comm backend: parallel.comm = mpi (host memory; its communication thread gives the
 * overlap), nccl (device memory on a CUDA stream the world comm creates, shared by its per-dimension
 * splits; needs o->cuda_device >= 0 on every rank and no two ranks of a node on one GPU, which NCCL
 * refuses), or auto = nccl when that holds on every rank, else mpi. Every rank reaches the same choice
 * (agreed over `world`). DG_ERR_USAGE for a mesh that does not fit the world or a parallel.comm that
 * cannot run (the same message on every rank). With o->plan_only nothing is collective. */
dg_status_t dg_fsdp_create(MPI_Comm world, const dg_mesh_shape_t *mesh, const dg_fsdp_opts_t *o,
                           dg_fsdp_t **out);
void dg_fsdp_free(dg_fsdp_t *f);

/* dg_model_create_parallel on f's mesh (every rank of the world calls it with the same arguments). */
dg_status_t dg_fsdp_model_create(dg_fsdp_t *f, const dg_model_desc_t *d, dg_backend_t *be, int micro_batch,
                                 uint64_t seed, int flags, dg_model_t **out);

/* Ends the job on every rank with `code` (3 after a collective timed out or a peer failed), through the
 * world communicator. Log the reason first. */
void dg_fsdp_abort(dg_fsdp_t *f, int code) __attribute__((noreturn));

/* ---- DTensor-style placements ---- */
typedef enum { DG_PLACE_REPLICATE = 0, DG_PLACE_SHARD = 1, DG_PLACE_PARTIAL = 2 } dg_place_kind_t;
typedef struct dg_placement {
    dg_place_kind_t kind;
    int dim; /* DG_PLACE_SHARD: the tensor dim split over that mesh dimension */
} dg_placement_t;

/* The placements of parameter i over dp_replicate, dp_shard and tp (indexed by DG_MESH_*). Parameters
 * are Replicate or Shard; Partial(sum) describes row-parallel products before their all-reduce and the
 * unreduced gradients. */
void dg_fsdp_placements(const dg_model_t *m, int i, dg_placement_t out[DG_MESH_NDIM]);
/* "Shard(0)", "Replicate", "Partial(sum)". */
void dg_fsdp_placement_str(const dg_placement_t *p, char *buf, size_t cap);

/* Bytes one rank holds for parameters, gradients and AdamW moments (and the compute copy), the same as
 * dg_model_state_bytes: about 1 / dp_shard of the unsharded model (tp-split tensors also / tp). */
size_t dg_fsdp_state_bytes(const dg_model_t *m);

/* The placement table: one line per parameter with global shape, placements and local pieces
 * (json = 1: a JSON array). */
dg_status_t dg_fsdp_print_placements(const dg_model_t *m, FILE *out, int json);

#ifdef __cplusplus
}
#endif
#endif /* DG_FSDP_H */
