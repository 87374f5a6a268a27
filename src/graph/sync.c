/* sync.c — the gradient-sync pass over dp_replicate (HSDP / DDP): per bucket of a shard plan, an all-reduce
 * of its gradients on the communication stream as soon as they are final, and its wait.
 */
#include <stdlib.h>

#include "graph.h"

/* Schedule position right after node x (x's side outputs included), for a node n placed there. */
static void move_after(dg_graph_t *g, dg_node_t *n, const dg_node_t *x) {
    dg_graph_move(g, n, x->id + 1 + x->n_side - (n->id < x->id ? 1 + n->n_side : 0));
}

/* The last op of the backward other than `except` (which may not be in place yet). */
static const dg_node_t *last_bwd_op(const dg_graph_t *g, const dg_node_t *except) {
    const dg_node_t *l = NULL;
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *x = g->nodes[i];
        if (x->phase == DG_PHASE_BWD && x != except && x->op != DG_OP_LEAF && x->op != DG_OP_SIDE) l = x;
    }
    return l;
}

/* The dp_replicate gradient sum (HSDP / DDP), in the backward: per bucket an in-place all-reduce of its
 * flat gradient (shard) on the communication stream, posted as soon as the bucket's gradients are final
 * (after the last backward kernel that accumulates into one of them; with dp_shard > 1 after the wait of
 * the bucket's reduce-scatter, whose accumulate into the shard runs there), so it overlaps the rest of
 * the backward. Waited for at the end of the backward (at once with parallel.overlap = false). Flagged
 * DG_NF_GRAD_SYNC: skipped on the micro-batches of an accumulation that are not the step's last.
 * Reduction dtype and overlap are the shard plan's (reduce_dtype, overlap). */
dg_status_t dg_pass_replicate_sync(dg_graph_t *g, const dg_shard_plan_t *sp) {
    int nb = sp->n_buckets, nar = 0;
    dg_node_t **ars = dg_xcalloc((size_t)nb + 1, sizeof *ars);
    char nm[96];
    dg_phase_t saved = g->cur_phase;
    g->cur_phase = DG_PHASE_BWD;
    for (int j = 0; j < nb && !g->err; j++) {
        const dg_bucket_t *b = &sp->buckets[j];
        dg_node_t *after = NULL;
        for (int i = 0; i < g->n; i++) {
            dg_node_t *x = g->nodes[i];
            if (x->phase != DG_PHASE_BWD || x->op == DG_OP_LEAF || x->op == DG_OP_SIDE) continue;
            if (sp->k > 1) { /* the wait of the reduce-scatter into this bucket's shard */
                if (x->op == DG_OP_WAIT && x->n_wait == 1 && x->wait[0]->op == DG_OP_REDUCE_SCATTER &&
                    x->wait[0]->n_upd == 1 && x->wait[0]->upd[0] == b->gleaf)
                    after = x;
                /* reduce_dtype bf16: the cast that adds the bf16 result into the shard, after that wait */
                if (x->op == DG_OP_CAST && x->n_upd == 1 && x->upd[0] == b->gleaf) after = x;
                continue;
            }
            for (int u = 0; u < x->n_upd; u++)
                for (int p = b->first; p <= b->last; p++)
                    if (x->upd[u] == sp->params[p].p->grad) after = x;
        }
        /* no backward kernel touches this bucket (e.g. tp-rank-0-only biases on another tp rank): the
         * sum still runs, at the end, so that every rank of the group posts the same collectives */
        const dg_node_t *x = after ? after : last_bwd_op(g, NULL);
        DG_ASSERT(x);
        int64_t a[4] = {0, DG_MESH_DP_REPLICATE, DG_AR_SUM, 0};
        dg_node_t *t = b->gleaf, *cast = NULL;
        if (sp->reduce_dtype != DG_F32) {
            /* reduce in bf16: the bucket's f32 gradients are cast into a bf16 arena temporary, which the
             * all-reduce sums in place; the cast back into the f32 bucket follows the wait (the planner
             * keeps the temporary live from the cast to there) */
            int64_t ca[2] = {0, sp->reduce_dtype};
            dg_fmt(nm, sizeof nm, "ar.cast.%.80s", b->gleaf->name);
            cast = dg_graph_add_op(g, DG_OP_CAST, nm, 1, &t, 0, NULL, ca, 2);
            if (!cast) break;
            cast->flags |= DG_NF_GRAD_SYNC;
            move_after(g, cast, x);
            x = t = cast;
        }
        dg_fmt(nm, sizeof nm, "ar.grad.%.80s", b->gleaf->name);
        dg_node_t *ar = dg_graph_add_op(g, DG_OP_ALL_REDUCE, nm, 0, NULL, 1, &t, a, 4);
        if (!ar) break;
        ar->stream = DG_STREAM_COMM;
        ar->flags |= DG_NF_GRAD_SYNC;
        if (cast) ar->wait[ar->n_wait++] = cast; /* the comm stream starts once the send buffer is cast */
        move_after(g, ar, x);
        ars[nar++] = ar;
    }
    for (int j = 0; j < nar && !g->err; j++) {
        dg_fmt(nm, sizeof nm, "wait.%.80s", ars[j]->name);
        dg_node_t *w = dg_graph_add_op(g, DG_OP_WAIT, nm, 0, NULL, 0, NULL, NULL, 0);
        if (!w) break;
        w->flags |= DG_NF_GRAD_SYNC;
        w->wait[w->n_wait++] = ars[j];
        move_after(g, w, sp->overlap ? last_bwd_op(g, w) : ars[j]);
        if (ars[j]->upd[0]->op != DG_OP_CAST) continue;
        /* the bf16 sum back into the f32 bucket: on the compute stream after the wait (which joins the comm
         * stream); flagged like the all-reduce, so accumulation micro-batches skip all four */
        dg_node_t *bf = ars[j]->upd[0], *gl = bf->src[0];
        int64_t ua[2] = {0, DG_F32};
        dg_fmt(nm, sizeof nm, "ar.uncast.%.80s", gl->name);
        dg_node_t *u = dg_graph_add_op(g, DG_OP_CAST, nm, 1, &bf, 1, &gl, ua, 2);
        if (!u) break;
        u->flags |= DG_NF_GRAD_SYNC;
        u->wait[u->n_wait++] = ars[j]; /* reads the collective's result */
        move_after(g, u, w);
    }
    free(ars);
    g->cur_phase = saved;
    return g->err;
}
