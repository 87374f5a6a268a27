/* planner.c — the activation memory planner and the in-place pass.
 *
 * Phase 1 (reserve) simulates the schedule: every arena tensor (a storage root plus the nodes that
 * alias it) is live from the position where it is first written to the last position that reads it;
 * side outputs are written at their producer's position; OUTPUT tensors live to the end. Offsets are
 * then assigned greedy-by-size (largest first, lowest offset that clears every buffer whose live range
 * intersects). Phase 2 (run) is the executor allocating one arena of the reserved size and replaying the
 * offsets. Weights, gradients and optimizer state are persistent and never enter the arena.
 *
 * A plan records the graph and its generation; dg_plan_matches() is what the executor asserts before
 * every run, so a plan can never be replayed on a graph that a pass changed since.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "graph.h"

static size_t align_up(size_t x, size_t a) {
    return (x + a - 1) / a * a;
}

/* ---------------- interval allocation ---------------- */

typedef struct {
    const size_t *size;
    const int *start;
} order_ctx_t;
static _Thread_local order_ctx_t order_ctx;

static int by_size_desc(const void *pa, const void *pb) {
    int a = *(const int *)pa, b = *(const int *)pb;
    size_t sa = order_ctx.size[a], sb = order_ctx.size[b];
    if (sa != sb) return sa > sb ? -1 : 1;
    if (order_ctx.start[a] != order_ctx.start[b]) return order_ctx.start[a] < order_ctx.start[b] ? -1 : 1;
    return a < b ? -1 : (a > b);
}

static _Thread_local const size_t *offset_ctx;
static int by_offset(const void *pa, const void *pb) {
    int a = *(const int *)pa, b = *(const int *)pb;
    size_t oa = offset_ctx[a], ob = offset_ctx[b];
    if (oa != ob) return oa < ob ? -1 : 1;
    return a < b ? -1 : (a > b);
}

size_t dg_plan_intervals(int n, const size_t *size, const int *start, const int *end, size_t align,
                         size_t *offset_out) {
    if (n <= 0) return 0;
    int *order = dg_xmalloc((size_t)n * sizeof *order);
    int *conf = dg_xmalloc((size_t)n * sizeof *conf);
    int *placed = dg_xmalloc((size_t)n * sizeof *placed);
    for (int i = 0; i < n; i++)
        order[i] = i;
    order_ctx = (order_ctx_t){size, start};
    qsort(order, (size_t)n, sizeof *order, by_size_desc);
    offset_ctx = offset_out;

    size_t arena = 0;
    int n_placed = 0;
    for (int oi = 0; oi < n; oi++) {
        int i = order[oi];
        size_t sz = align_up(size[i] ? size[i] : 1, align);
        int nc = 0;
        for (int pj = 0; pj < n_placed; pj++) {
            int j = placed[pj];
            if (end[j] < start[i] || end[i] < start[j]) continue;
            conf[nc++] = j;
        }
        qsort(conf, (size_t)nc, sizeof *conf, by_offset);
        size_t off = 0;
        for (int c = 0; c < nc; c++) {
            int j = conf[c];
            if (off + sz <= offset_out[j]) break; /* the gap below j is big enough */
            size_t jend = align_up(offset_out[j] + (size[j] ? size[j] : 1), align);
            if (jend > off) off = jend;
        }
        offset_out[i] = off;
        if (off + sz > arena) arena = off + sz;
        placed[n_placed++] = i;
    }
    free(order);
    free(conf);
    free(placed);
    return arena;
}

/* ---------------- liveness ---------------- */

/* start/end per node id, meaningful for arena roots (start = INT_MAX when never written). */
static void liveness(const dg_graph_t *g, int *start, int *end) {
    int n = g->n;
    for (int i = 0; i < n; i++) {
        start[i] = INT_MAX;
        end[i] = -1;
    }
    for (int i = 0; i < n; i++) {
        const dg_node_t *x = g->nodes[i];
        if (x->op == DG_OP_LEAF) continue;
        int pos = x->op == DG_OP_SIDE ? x->src[0]->id : i; /* written by the producer */
        if (x->storage != DG_STORE_NONE) {
            const dg_node_t *r = dg_node_root_c(x);
            if (r->storage == DG_STORE_ARENA) {
                if (pos < start[r->id]) start[r->id] = pos;
                if (pos > end[r->id]) end[r->id] = pos;
                if (x->flags & DG_NF_OUTPUT) end[r->id] = n;
            }
        }
        if (x->op == DG_OP_SIDE) continue;
        for (int k = 0; k < x->n_src; k++) {
            const dg_node_t *r = dg_node_root_c(x->src[k]);
            if (r->storage == DG_STORE_ARENA && i > end[r->id]) end[r->id] = i;
        }
        for (int k = 0; k < x->n_upd; k++) { /* an arena tensor updated in place is read and written */
            const dg_node_t *r = dg_node_root_c(x->upd[k]);
            if (r->storage == DG_STORE_ARENA && i > end[r->id]) end[r->id] = i;
        }
        /* an asynchronous op reads its inputs and writes its output until it is waited for; so too the
         * arena tensor it updates in place (the bf16 copy of a gradient bucket that a dp_replicate
         * all-reduce sums in place, train.reduce_dtype = bf16) */
        for (int k = 0; k < x->n_wait; k++) {
            const dg_node_t *w = x->wait[k];
            if (w->storage != DG_STORE_NONE) {
                const dg_node_t *r = dg_node_root_c(w);
                if (r->storage == DG_STORE_ARENA && i > end[r->id]) end[r->id] = i;
            }
            for (int j = 0; j < w->n_src; j++) {
                const dg_node_t *r = dg_node_root_c(w->src[j]);
                if (r->storage == DG_STORE_ARENA && i > end[r->id]) end[r->id] = i;
            }
            for (int j = 0; j < w->n_upd; j++) {
                const dg_node_t *r = dg_node_root_c(w->upd[j]);
                if (r->storage == DG_STORE_ARENA && i > end[r->id]) end[r->id] = i;
            }
        }
    }
}

static int is_arena_root(const dg_node_t *x) {
    return x->op != DG_OP_LEAF && x->storage == DG_STORE_ARENA && x->view_src == NULL;
}

/* ---------------- in-place pass ---------------- */

dg_status_t dg_pass_inplace(dg_graph_t *g, void *ctx) {
    (void)ctx;
    int n = g->n;
    int *start = dg_xmalloc((size_t)n * sizeof *start), *end = dg_xmalloc((size_t)n * sizeof *end);
    liveness(g, start, end);
    for (int i = 0; i < n; i++) {
        dg_node_t *x = g->nodes[i];
        if (!is_arena_root(x) || x->op == DG_OP_SIDE) continue;
        unsigned mask = dg_op_def(x->op)->inplace_mask;
        for (int k = 0; k < x->n_src && mask; k++) {
            if (!(mask & (1u << k))) continue;
            dg_node_t *s = x->src[k];
            dg_node_t *r = dg_node_root(s);
            /* the source's storage must die exactly here, hold exactly this tensor, and not be an output */
            if (r->storage != DG_STORE_ARENA || end[r->id] != i || s->nbytes != x->nbytes ||
                r->nbytes != x->nbytes || s->dtype != x->dtype)
                continue;
            int offs = 0;
            for (dg_node_t *v = s; v->view_src; v = v->view_src)
                offs += (int)v->view_offs;
            if (offs) continue;
            x->view_src = s;
            x->view_offs = 0;
            if (end[x->id] > end[r->id]) end[r->id] = end[x->id];
            break;
        }
    }
    free(start);
    free(end);
    return DG_OK;
}

/* ---------------- plans ---------------- */

typedef struct {
    int pos;
    long long delta;
} live_event_t;

static int cmp_event(const void *a, const void *b) {
    const live_event_t *x = a, *y = b;
    if (x->pos != y->pos) return x->pos < y->pos ? -1 : 1;
    return (x->delta > y->delta) - (x->delta < y->delta); /* frees before allocations at one position */
}

/* The most aligned bytes live at once: live ranges are inclusive [st, en]. */
static size_t live_peak(int nr, const size_t *size, const int *st, const int *en) {
    live_event_t *ev = dg_xmalloc(((size_t)nr * 2 + 1) * sizeof *ev);
    for (int k = 0; k < nr; k++) {
        long long b = (long long)align_up(size[k] ? size[k] : 1, DG_ARENA_ALIGN);
        ev[2 * k] = (live_event_t){st[k], b};
        ev[2 * k + 1] = (live_event_t){en[k] + 1, -b};
    }
    qsort(ev, (size_t)nr * 2, sizeof *ev, cmp_event);
    long long cur = 0, peak = 0;
    for (int i = 0; i < 2 * nr; i++) {
        cur += ev[i].delta;
        if (cur > peak) peak = cur;
    }
    free(ev);
    return (size_t)peak;
}

dg_status_t dg_plan_create(const dg_graph_t *g, int flags, dg_memplan_t **out) {
    *out = NULL;
    if (g->err) return g->err;
    int n = g->n;
    dg_memplan_t *p = dg_xcalloc(1, sizeof *p);
    p->graph = g;
    p->generation = g->generation;
    p->n_nodes = n;
    p->offset = dg_xmalloc(((size_t)n + 1) * sizeof *p->offset);
    p->live_start = dg_xmalloc(((size_t)n + 1) * sizeof *p->live_start);
    p->live_end = dg_xmalloc(((size_t)n + 1) * sizeof *p->live_end);
    liveness(g, p->live_start, p->live_end);

    int nr = 0;
    int *ids = dg_xmalloc(((size_t)n + 1) * sizeof *ids);
    for (int i = 0; i < n; i++) {
        p->offset[i] = SIZE_MAX;
        const dg_node_t *x = g->nodes[i];
        if (!is_arena_root(x)) continue;
        DG_ASSERTF(p->live_start[i] != INT_MAX, "arena tensor '%s' is never written", x->name);
        ids[nr++] = i;
    }
    size_t *size = dg_xmalloc(((size_t)nr + 1) * sizeof *size),
           *off = dg_xmalloc(((size_t)nr + 1) * sizeof *off);
    int *st = dg_xmalloc(((size_t)nr + 1) * sizeof *st), *en = dg_xmalloc(((size_t)nr + 1) * sizeof *en);
    for (int k = 0; k < nr; k++) {
        size[k] = g->nodes[ids[k]]->nbytes;
        st[k] = p->live_start[ids[k]];
        en[k] = p->live_end[ids[k]];
        p->act_bytes_sum += size[k];
    }
    p->live_peak_bytes = live_peak(nr, size, st, en);
    if (flags & DG_PLAN_NO_REUSE) {
        size_t a = 0;
        for (int k = 0; k < nr; k++) {
            off[k] = a;
            a += align_up(size[k] ? size[k] : 1, DG_ARENA_ALIGN);
        }
        p->arena_bytes = a;
    } else {
        p->arena_bytes = dg_plan_intervals(nr, size, st, en, DG_ARENA_ALIGN, off);
    }
    for (int k = 0; k < nr; k++)
        p->offset[ids[k]] = off[k];
    free(ids);
    free(size);
    free(off);
    free(st);
    free(en);
    *out = p;
    return DG_OK;
}

void dg_plan_free(dg_memplan_t *p) {
    if (p) DG_FREE_ALL(p->offset, p->live_start, p->live_end, p);
}

int dg_plan_matches(const dg_memplan_t *p, const dg_graph_t *g) {
    return p && p->graph == g && p->generation == g->generation && p->n_nodes == g->n;
}

dg_status_t dg_plan_check(const dg_memplan_t *p, const dg_graph_t *g) {
    if (!dg_plan_matches(p, g)) return DG_ERR(DG_ERR_RUNTIME, "plan check: the plan is stale for this graph");
    int n = g->n;
    /* recompute, touch by touch, the first and last schedule position at which each root is accessed */
    int *lo = dg_xmalloc(((size_t)n + 1) * sizeof *lo), *hi = dg_xmalloc(((size_t)n + 1) * sizeof *hi);
    for (int i = 0; i < n; i++) {
        lo[i] = INT_MAX;
        hi[i] = -1;
    }
#define TOUCH(node, at)                                                                                      \
    do {                                                                                                     \
        const dg_node_t *r_ = dg_node_root_c(node);                                                          \
        if (r_->storage == DG_STORE_ARENA) {                                                                 \
            if ((at) < lo[r_->id]) lo[r_->id] = (at);                                                        \
            if ((at) > hi[r_->id]) hi[r_->id] = (at);                                                        \
        }                                                                                                    \
    } while (0)
    for (int i = 0; i < n; i++) {
        const dg_node_t *x = g->nodes[i];
        if (x->op == DG_OP_LEAF || x->op == DG_OP_SIDE) continue;
        for (int k = 0; k < x->n_src; k++)
            TOUCH(x->src[k], i);
        for (int k = 0; k < x->n_upd; k++)
            TOUCH(x->upd[k], i);
        for (int k = 0; k < x->n_wait; k++) { /* the async op's buffers are in use until here */
            if (x->wait[k]->storage != DG_STORE_NONE) TOUCH(x->wait[k], i);
            for (int j = 0; j < x->wait[k]->n_src; j++)
                TOUCH(x->wait[k]->src[j], i);
            for (int j = 0; j < x->wait[k]->n_upd; j++)
                TOUCH(x->wait[k]->upd[j], i);
        }
        if (x->storage != DG_STORE_NONE) TOUCH(x, i);
        for (int k = 0; k < x->n_side; k++)
            TOUCH(x->side[k], i);
        if ((x->flags & DG_NF_OUTPUT) && x->storage != DG_STORE_NONE) TOUCH(x, n);
        for (int k = 0; k < x->n_side; k++)
            if (x->side[k]->flags & DG_NF_OUTPUT) TOUCH(x->side[k], n);
    }
#undef TOUCH
    dg_status_t st = DG_OK;
    int *roots = dg_xmalloc(((size_t)n + 1) * sizeof *roots), nr = 0;
    for (int i = 0; i < n && st == DG_OK; i++) {
        const dg_node_t *x = g->nodes[i];
        if (!is_arena_root(x)) continue;
        if (lo[i] == INT_MAX) continue; /* never accessed: needs no memory at any time */
        roots[nr++] = i;
        if (p->offset[i] == SIZE_MAX)
            st = DG_ERR(DG_ERR_RUNTIME, "plan check: '%s' has no offset", x->name);
        else if (p->offset[i] % DG_ARENA_ALIGN)
            st = DG_ERR(DG_ERR_RUNTIME, "plan check: '%s' offset %zu not aligned", x->name, p->offset[i]);
        else if (p->offset[i] + x->nbytes > p->arena_bytes)
            st = DG_ERR(DG_ERR_RUNTIME, "plan check: '%s' [%zu, %zu) exceeds the arena (%zu bytes)", x->name,
                        p->offset[i], p->offset[i] + x->nbytes, p->arena_bytes);
        else if (p->live_start[i] > lo[i] || p->live_end[i] < hi[i])
            st = DG_ERR(DG_ERR_RUNTIME,
                        "plan check: '%s' is accessed over [%d, %d] but planned live over [%d, %d]", x->name,
                        lo[i], hi[i], p->live_start[i], p->live_end[i]);
    }
    for (int a = 0; a < nr && st == DG_OK; a++) {
        int i = roots[a];
        for (int b = a + 1; b < nr && st == DG_OK; b++) {
            int j = roots[b];
            if (hi[i] < lo[j] || hi[j] < lo[i]) continue; /* never live at the same time */
            size_t ai = p->offset[i], bi = ai + g->nodes[i]->nbytes;
            size_t aj = p->offset[j], bj = aj + g->nodes[j]->nbytes;
            if (ai < bj && aj < bi)
                st =
                    DG_ERR(DG_ERR_RUNTIME,
                           "plan check: '%s' [%zu, %zu) live [%d, %d] overlaps '%s' [%zu, %zu) live [%d, %d]",
                           g->nodes[i]->name, ai, bi, lo[i], hi[i], g->nodes[j]->name, aj, bj, lo[j], hi[j]);
        }
    }
    if (st == DG_OK && p->arena_bytes > 0) {
        size_t sum = 0;
        for (int a = 0; a < nr; a++)
            sum += align_up(g->nodes[roots[a]]->nbytes, DG_ARENA_ALIGN);
        if (p->arena_bytes > sum)
            st = DG_ERR(DG_ERR_RUNTIME, "plan check: arena %zu bytes exceeds the sum of tensor sizes %zu",
                        p->arena_bytes, sum);
    }
    free(lo);
    free(hi);
    free(roots);
    return st;
}
