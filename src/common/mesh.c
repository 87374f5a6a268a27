/* mesh.c — parsing, printing and coordinate arithmetic for dg_mesh_shape_t. */
#include "dg_mesh.h"

#include <stdlib.h>
#include <string.h>

static const char *k_dim_names[DG_MESH_NDIM] = {"dp_replicate", "dp_shard", "tp"};

const char *dg_mesh_dim_name(int dim) {
    DG_ASSERT(dim >= 0 && dim < DG_MESH_NDIM);
    return k_dim_names[dim];
}

static int dim_index(const char *name, size_t len) {
    for (int d = 0; d < DG_MESH_NDIM; d++)
        if (strlen(k_dim_names[d]) == len && strncmp(k_dim_names[d], name, len) == 0) return d;
    return -1;
}

int dg_mesh_world(const dg_mesh_shape_t *s) {
    return s->size[0] * s->size[1] * s->size[2];
}

dg_status_t dg_mesh_parse(const char *text, int world, dg_mesh_shape_t *shape, int *is_auto) {
    *is_auto = 0;
    if (strcmp(text, "auto") == 0) {
        *is_auto = 1;
        return DG_OK;
    }
    dg_mesh_shape_t s = {{1, 1, 1}, {DG_MESH_DP_REPLICATE, DG_MESH_DP_SHARD, DG_MESH_TP}};
    int seen[DG_MESH_NDIM] = {0};
    char buf[256];
    if (strlen(text) >= sizeof buf || !*text)
        return DG_ERR(DG_ERR_USAGE,
                      "parallel.mesh: expected 'auto' or e.g. 'dp_replicate=2,dp_shard=4,tp=2', got '%s'",
                      text);
    strcpy(buf, text);
    /* "order=" takes a comma list, so split on ',' but let order consume following dim names. Split by
     * hand: strtok would skip empty entries and accept ",,," as the 1x1x1 mesh. */
    int in_order = 0, norder = 0, order_inner_first[DG_MESH_NDIM];
    int entry = 0;
    for (char *tok = buf, *next = NULL; tok; tok = next) {
        char *comma = strchr(tok, ',');
        next = comma ? comma + 1 : NULL;
        if (comma) *comma = 0;
        entry++;
        while (*tok == ' ')
            tok++;
        size_t tl = strlen(tok);
        while (tl && tok[tl - 1] == ' ')
            tok[--tl] = 0;
        if (!tl)
            return DG_ERR(DG_ERR_USAGE,
                          "parallel.mesh: entry %d of '%s' is empty (expected 'auto' or name=value entries "
                          "separated by single commas, e.g. 'dp_replicate=2,dp_shard=4,tp=2')",
                          entry, text);
        char *eq = strchr(tok, '=');
        if (!eq && in_order) {
            int d = dim_index(tok, strlen(tok));
            if (d < 0 || norder >= DG_MESH_NDIM)
                return DG_ERR(
                    DG_ERR_USAGE,
                    "parallel.mesh: bad dimension '%s' in order= (expected dp_replicate, dp_shard, tp)", tok);
            order_inner_first[norder++] = d;
            continue;
        }
        if (!eq)
            return DG_ERR(DG_ERR_USAGE, "parallel.mesh: expected name=value, got '%s' in '%s'", tok, text);
        if (strncmp(tok, "order", (size_t)(eq - tok)) == 0 && eq - tok == 5) {
            if (norder) return DG_ERR(DG_ERR_USAGE, "parallel.mesh: order= given twice in '%s'", text);
            in_order = 1;
            int d = dim_index(eq + 1, strlen(eq + 1));
            if (d < 0)
                return DG_ERR(
                    DG_ERR_USAGE,
                    "parallel.mesh: bad dimension '%s' in order= (expected dp_replicate, dp_shard, tp)",
                    eq + 1);
            order_inner_first[norder++] = d;
            continue;
        }
        in_order = 0;
        int d = dim_index(tok, (size_t)(eq - tok));
        if (d < 0)
            return DG_ERR(
                DG_ERR_USAGE,
                "parallel.mesh: unknown dimension '%.*s' in '%s' (expected dp_replicate, dp_shard, tp)",
                (int)(eq - tok), tok, text);
        char *end = NULL;
        long v = strtol(eq + 1, &end, 10);
        if (!*(eq + 1) || *end || v < 1 || v > 1 << 20)
            return DG_ERR(DG_ERR_USAGE, "parallel.mesh: %s must be a positive integer, got '%s'",
                          k_dim_names[d], eq + 1);
        if (seen[d])
            return DG_ERR(DG_ERR_USAGE, "parallel.mesh: %s given twice in '%s'", k_dim_names[d], text);
        seen[d] = 1;
        s.size[d] = (int)v;
    }
    if (norder) {
        if (norder != DG_MESH_NDIM)
            return DG_ERR(DG_ERR_USAGE,
                          "parallel.mesh: order= must list all three dimensions, innermost first");
        for (int i = 0; i < DG_MESH_NDIM; i++)
            for (int j = i + 1; j < DG_MESH_NDIM; j++)
                if (order_inner_first[i] == order_inner_first[j])
                    return DG_ERR(DG_ERR_USAGE, "parallel.mesh: order= lists %s twice",
                                  k_dim_names[order_inner_first[i]]);
        for (int i = 0; i < DG_MESH_NDIM; i++)
            s.order[i] = order_inner_first[DG_MESH_NDIM - 1 - i];
    }
    if (world > 0 && dg_mesh_world(&s) != world)
        return DG_ERR(DG_ERR_USAGE, "parallel.mesh: %s has %d ranks but the world size is %d", text,
                      dg_mesh_world(&s), world);
    *shape = s;
    return DG_OK;
}

void dg_mesh_format(const dg_mesh_shape_t *s, char *buf, size_t cap) {
    snprintf(buf, cap, "dp_replicate=%d,dp_shard=%d,tp=%d", s->size[0], s->size[1], s->size[2]);
}

void dg_mesh_coords(const dg_mesh_shape_t *s, int rank, int coord[DG_MESH_NDIM]) {
    DG_ASSERT(rank >= 0 && rank < dg_mesh_world(s));
    for (int i = DG_MESH_NDIM - 1; i >= 0; i--) { /* innermost first */
        int d = s->order[i];
        coord[d] = rank % s->size[d];
        rank /= s->size[d];
    }
}

int dg_mesh_rank(const dg_mesh_shape_t *s, const int coord[DG_MESH_NDIM]) {
    int r = 0;
    for (int i = 0; i < DG_MESH_NDIM; i++) {
        int d = s->order[i];
        DG_ASSERT(coord[d] >= 0 && coord[d] < s->size[d]);
        r = r * s->size[d] + coord[d];
    }
    return r;
}
