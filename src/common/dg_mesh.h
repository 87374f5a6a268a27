/* dg_mesh.h — the shape of a device mesh (docs/design.md §2): named dimensions dp_replicate x dp_shard
 * x tp, plus the order in which dimensions vary over consecutive ranks, and pipeline stages (pp) as the
 * outermost dimension: world = pp x dp_replicate x dp_shard x tp, stage k holding ranks
 * [k W, (k + 1) W) with W = dp_replicate x dp_shard x tp (docs/parallelism.md). Shared by the planner (which
 * scores shapes) and fsdp (which builds communicators from one). */
#ifndef DG_MESH_H
#define DG_MESH_H
#include "dg_common.h"

enum { DG_MESH_DP_REPLICATE = 0, DG_MESH_DP_SHARD = 1, DG_MESH_TP = 2, DG_MESH_NDIM = 3 };
/* size[DG_MESH_PP]: pipeline stages, the outermost dimension; 0 or 1 = none (a shape initialised as
 * {{R, S, T}, {order}} has no pipeline). Not one of the DG_MESH_NDIM collective dimensions. */
enum { DG_MESH_PP = 3 };

typedef struct dg_mesh_shape {
    int size[DG_MESH_NDIM + 1]; /* indexed by DG_MESH_*; each >= 1 (DG_MESH_PP: 0 means 1) */
    /* order[0] is the outermost (slowest-varying over ranks) dimension, order[2] the innermost.
     * Default: dp_replicate, dp_shard, tp — tp innermost so TP groups are consecutive ranks (same node). */
    int order[DG_MESH_NDIM];
} dg_mesh_shape_t;

/* Parse "dp_replicate=2,dp_shard=4,tp=2,pp=2" (any subset, any order; missing dims = 1) or "auto"
 * (returns *is_auto = 1 and leaves shape untouched). An optional "order=tp,dp_shard,dp_replicate"
 * entry lists the three collective dims innermost first (pp is always outermost). world > 0: the
 * product must equal it (DG_ERR_USAGE otherwise). */
dg_status_t dg_mesh_parse(const char *text, int world, dg_mesh_shape_t *shape, int *is_auto);
/* "dp_replicate=1,dp_shard=4,tp=1" into buf (",pp=N" appended when pp > 1). */
void dg_mesh_format(const dg_mesh_shape_t *shape, char *buf, size_t cap);
/* All ranks: pp x dp_replicate x dp_shard x tp. */
int dg_mesh_world(const dg_mesh_shape_t *shape);
/* Pipeline stages (>= 1) and the ranks of one stage (dp_replicate x dp_shard x tp). */
int dg_mesh_pp(const dg_mesh_shape_t *shape);
int dg_mesh_stage_world(const dg_mesh_shape_t *shape);
/* The pipeline stage of a rank: rank / dg_mesh_stage_world. */
int dg_mesh_stage(const dg_mesh_shape_t *shape, int rank);
const char *dg_mesh_dim_name(int dim);
/* Coordinates of `rank` on the mesh (coord[DG_MESH_*], within its stage) and back (the rank in stage 0;
 * add stage x dg_mesh_stage_world for another stage). */
void dg_mesh_coords(const dg_mesh_shape_t *shape, int rank, int coord[DG_MESH_NDIM]);
int dg_mesh_rank(const dg_mesh_shape_t *shape, const int coord[DG_MESH_NDIM]);
#endif
