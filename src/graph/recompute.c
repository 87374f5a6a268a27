/* recompute.c — the activation recompute pass (graph.h: dg_pass_recompute): forward nodes the caller
 * selects are re-emitted in the backward, just before the first backward op of their segment that reads
 * one of them, and every later backward reader uses the re-emitted copy. The saved originals then die
 * after their last forward reader, which the memory planner sees from the schedule alone (liveness is
 * first and last access): nothing else is needed to make the plan shorter.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph.h"

/* A forward op that can run a second time from the same inputs with the same result: differentiable,
 * not a collective (except the identity forward of FROM_REPLICATE, a view with no communication), no
 * persistent tensor updated in place, no wait edge, not read back by the host. */
static int clonable(const dg_node_t *n) {
    if (n->phase != DG_PHASE_FWD || n->op == DG_OP_LEAF || n->op == DG_OP_SIDE) return 0;
    if (n->flags & (DG_NF_OUTPUT | DG_NF_LOSS) || n->n_upd || n->n_wait || n->stream != DG_STREAM_COMPUTE)
        return 0;
    const dg_op_def_t *d = dg_op_def(n->op);
    if (d->grad_kind != DG_GRAD_BUILDER) return 0;
    if (d->is_collective) return n->op == DG_OP_ALL_REDUCE && n->attr[DG_A_ARMODE] == DG_AR_FROM_REPLICATE;
    return 1;
}

/* Is x (an op or a side output) n or one of n's side outputs? Which: -1 for n, j for side j. */
static int which_of(const dg_node_t *n, const dg_node_t *x) {
    if (x == n) return -1;
    for (int j = 0; j < n->n_side; j++)
        if (n->side[j] == x) return j;
    return -2;
}

/* The op that produces x (x itself, or the producer of a side output). */
static const dg_node_t *owner(const dg_node_t *x) {
    return x->op == DG_OP_SIDE ? x->src[0] : x;
}

/* seg[id] >= 0: n is selected and clonable; a view whose root is not selected in the same segment, or
 * a node that some unselected node views, is dropped (the storage would be shared with a kept tensor),
 * to a fixed point. */
static void select_nodes(const dg_graph_t *g, const dg_recompute_pass_t *rc, int *seg) {
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *n = g->nodes[i];
        seg[i] = clonable(n) ? rc->segment(n, rc->user) : -1;
    }
    for (int changed = 1; changed;) {
        changed = 0;
        for (int i = 0; i < g->n; i++) {
            const dg_node_t *v = g->nodes[i];
            if (!v->view_src) continue;
            int vo = owner(v)->id, ro = owner(v->view_src)->id;
            if (seg[vo] == seg[ro]) continue;
            if (seg[vo] >= 0) seg[vo] = -1, changed = 1;
            if (seg[ro] >= 0) seg[ro] = -1, changed = 1;
        }
    }
}

/* need[id] = 1: selected, and read (the node or a side output) by a backward op or by a needed node of
 * its segment (reverse schedule order: readers come after their sources). */
static void needed_nodes(const dg_graph_t *g, const int *seg, char *need) {
    memset(need, 0, (size_t)g->n);
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *x = g->nodes[i];
        if (x->phase != DG_PHASE_BWD || x->op == DG_OP_SIDE) continue;
        for (int k = 0; k < x->n_src; k++) {
            const dg_node_t *s = owner(x->src[k]);
            if (seg[s->id] >= 0) need[s->id] = 1;
        }
    }
    for (int i = g->n - 1; i >= 0; i--) {
        const dg_node_t *x = g->nodes[i];
        if (!need[i]) continue;
        for (int k = 0; k < x->n_src; k++) {
            const dg_node_t *s = owner(x->src[k]);
            if (seg[s->id] == seg[i]) need[s->id] = 1;
        }
    }
}

/* Maps src (an original node or side output) to its copy when that copy exists in clones[]. */
static dg_node_t *mapped(dg_node_t *src, dg_node_t *const *orig, dg_node_t *const *copy, int n) {
    const dg_node_t *s = owner(src);
    for (int i = 0; i < n; i++) {
        if (orig[i] != s) continue;
        int w = which_of(orig[i], src);
        return w < 0 ? copy[i] : copy[i]->side[w];
    }
    return src;
}

/* Re-emits the needed nodes of segment s (forward order, in orig[0..n)) before the first backward op
 * that reads one of them; redirects the backward readers after the copies. */
static dg_status_t emit_segment(dg_graph_t *g, dg_node_t **orig, dg_node_t **copy, int n, int *n_cloned) {
    dg_node_t *first = NULL;
    for (int i = 0; i < g->n && !first; i++) {
        dg_node_t *x = g->nodes[i];
        if (x->phase != DG_PHASE_BWD || x->op == DG_OP_SIDE) continue;
        for (int k = 0; k < x->n_src && !first; k++)
            for (int j = 0; j < n && !first; j++)
                if (which_of(orig[j], x->src[k]) > -2) first = x;
    }
    if (!first) return DG_OK;
    for (int j = 0; j < n; j++) {
        dg_node_t *o = orig[j], *src[DG_MAX_SRC];
        for (int k = 0; k < o->n_src; k++)
            src[k] = mapped(o->src[k], orig, copy, j);
        char nm[96];
        dg_fmt(nm, sizeof nm, "%.80s.recompute", o->name);
        dg_phase_t saved = g->cur_phase;
        g->cur_phase = DG_PHASE_BWD;
        dg_node_t *c = dg_graph_add_op(g, o->op, nm, o->n_src, src, 0, NULL, o->attr, DG_MAX_ATTR);
        g->cur_phase = saved;
        if (!c) return dg_graph_error(g);
        c->flags = o->flags;
        c->stream = o->stream;
        dg_graph_move(g, c, first->id);
        copy[j] = c;
        (*n_cloned)++;
    }
    for (int i = first->id; i < g->n; i++) {
        dg_node_t *x = g->nodes[i];
        if (x->phase != DG_PHASE_BWD || x->op == DG_OP_SIDE) continue;
        for (int k = 0; k < x->n_src; k++)
            x->src[k] = mapped(x->src[k], orig, copy, n);
    }
    dg_graph_touch(g);
    return DG_OK;
}

dg_status_t dg_pass_recompute(dg_graph_t *g, void *ctx) {
    dg_recompute_pass_t *rc = ctx;
    DG_ASSERT(rc && rc->segment);
    rc->n_cloned = 0;
    int n0 = g->n, *seg = dg_xcalloc((size_t)n0, sizeof *seg);
    char *need = dg_xcalloc((size_t)n0, 1);
    dg_node_t **orig = dg_xcalloc((size_t)n0, sizeof *orig), **copy = dg_xcalloc((size_t)n0, sizeof *copy);
    dg_node_t **all = dg_xcalloc((size_t)n0, sizeof *all);
    select_nodes(g, rc, seg);
    needed_nodes(g, seg, need);
    int max_seg = -1;
    for (int i = 0; i < n0; i++) {
        all[i] = g->nodes[i];
        if (need[i] && seg[i] > max_seg) max_seg = seg[i];
    }
    dg_status_t st = DG_OK;
    for (int s = 0; s <= max_seg && st == DG_OK; s++) {
        int n = 0;
        for (int i = 0; i < n0; i++) /* `all` keeps the forward order: forward nodes do not move */
            if (need[i] && seg[i] == s) orig[n++] = all[i];
        if (n) st = emit_segment(g, orig, copy, n, &rc->n_cloned);
    }
    free(seg);
    free(need);
    free(orig);
    free(copy);
    free(all);
    return st;
}
