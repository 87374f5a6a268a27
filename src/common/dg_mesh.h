/* dg_mesh.h — the shape of a device mesh (docs/design.md §2): named dimensions dp_replicate x dp_shard
 * x tp whose product is the world size, plus the order in which dimensions vary over consecutive ranks.
 * Shared by the planner (which scores shapes) and fsdp (which builds communicators from one). */
#ifndef DG_MESH_H
#define DG_MESH_H
#include "dg_common.h"

enum { DG_MESH_DP_REPLICATE = 0, DG_MESH_DP_SHARD = 1, DG_MESH_TP = 2, DG_MESH_NDIM = 3 };

typedef struct dg_mesh_shape {
    int size[DG_MESH_NDIM]; /* indexed by DG_MESH_*; each >= 1 */
    /* order[0] is the outermost (slowest-varying over ranks) dimension, order[2] the innermost.
     * Default: dp_replicate, dp_shard, tp — tp innermost so TP groups are consecutive ranks (same node). */
    int order[DG_MESH_NDIM];
} dg_mesh_shape_t;

/* Parse "dp_replicate=2,dp_shard=4,tp=2" (any subset, any order; missing dims = 1) or "auto"
 * (returns *is_auto = 1 and leaves shape untouched). An optional "order=tp,dp_shard,dp_replicate"
 * entry lists dims innermost first. world > 0: the product must equal it (DG_ERR_USAGE otherwise). */
dg_status_t dg_mesh_parse(const char *text, int world, dg_mesh_shape_t *shape, int *is_auto);
/* "dp_replicate=1,dp_shard=4,tp=1" into buf. */
void dg_mesh_format(const dg_mesh_shape_t *shape, char *buf, size_t cap);
int dg_mesh_world(const dg_mesh_shape_t *shape);
const char *dg_mesh_dim_name(int dim);
/* Coordinates of `rank` on the mesh (coord[DG_MESH_*]) and back. */
void dg_mesh_coords(const dg_mesh_shape_t *shape, int rank, int coord[DG_MESH_NDIM]);
int dg_mesh_rank(const dg_mesh_shape_t *shape, const int coord[DG_MESH_NDIM]);
#endif
