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

int dg_mesh_pp(const dg_mesh_shape_t *s) {
    return s->size[DG_MESH_PP] > 1 ? s->size[DG_MESH_PP] : 1;
}

int dg_mesh_stage_world(const dg_mesh_shape_t *s) {
    return s->size[0] * s->size[1] * s->size[2];
}

int dg_mesh_world(const dg_mesh_shape_t *s) {
    return dg_mesh_stage_world(s) * dg_mesh_pp(s);
}

int dg_mesh_stage(const dg_mesh_shape_t *s, int rank) {
    DG_ASSERT(rank >= 0 && rank < dg_mesh_world(s));
    return rank / dg_mesh_stage_world(s);
}

dg_status_t dg_mesh_parse(const char *text, int world, dg_mesh_shape_t *shape, int *is_auto) {
    *is_auto = 0;
    if (strcmp(text, "auto") == 0) {
        *is_auto = 1;
        return DG_OK;
    }
    dg_mesh_shape_t s = {{1, 1, 1, 1}, {DG_MESH_DP_REPLICATE, DG_MESH_DP_SHARD, DG_MESH_TP}};
    int seen[DG_MESH_NDIM] = {0}, seen_pp = 0;
    char buf[256];
    if (strlen(text) >= sizeof buf || !*text)
        return DG_ERR(
            DG_ERR_USAGE,
            "parallel.mesh: expected 'auto' or e.g. 'dp_replicate=2,dp_shard=4,tp=2,pp=2', got '%s'", text);
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
        if (!eq && in_order && strcmp(tok, "pp") == 0)
            return DG_ERR(
                DG_ERR_USAGE,
                "parallel.mesh: pp cannot be placed by order= (pipeline stages are always the outermost "
                "dimension); order= lists dp_replicate, dp_shard and tp");
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
            if (strcmp(eq + 1, "pp") == 0)
                return DG_ERR(DG_ERR_USAGE,
                              "parallel.mesh: pp cannot be placed by order= (pipeline stages are always the "
                              "outermost dimension); order= lists dp_replicate, dp_shard and tp");
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
        char *end = NULL;
        if (eq - tok == 2 && strncmp(tok, "pp", 2) == 0) {
            long v = strtol(eq + 1, &end, 10);
            if (!*(eq + 1) || *end || v < 1 || v > 1 << 20)
                return DG_ERR(DG_ERR_USAGE, "parallel.mesh: pp must be a positive integer, got '%s'", eq + 1);
            if (seen_pp) return DG_ERR(DG_ERR_USAGE, "parallel.mesh: pp given twice in '%s'", text);
            seen_pp = 1;
            s.size[DG_MESH_PP] = (int)v;
            continue;
        }
        int d = dim_index(tok, (size_t)(eq - tok));
        if (d < 0)
            return DG_ERR(
                DG_ERR_USAGE,
                "parallel.mesh: unknown dimension '%.*s' in '%s' (expected dp_replicate, dp_shard, tp, pp)",
                (int)(eq - tok), tok, text);
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
    int n = snprintf(buf, cap, "dp_replicate=%d,dp_shard=%d,tp=%d", s->size[0], s->size[1], s->size[2]);
    if (dg_mesh_pp(s) > 1 && n >= 0 && (size_t)n < cap)
        snprintf(buf + n, cap - (size_t)n, ",pp=%d", s->size[DG_MESH_PP]);
}

void dg_mesh_coords(const dg_mesh_shape_t *s, int rank, int coord[DG_MESH_NDIM]) {
    DG_ASSERT(rank >= 0 && rank < dg_mesh_world(s));
    rank %= dg_mesh_stage_world(s);
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
