/* fuse.c — the fusion passes: matmul + GELU (epilogue), matmul + residual add (matmul_res), matmul_bwd +
 * gelu_bwd (matmul_bwd_dgelu), crossentropy + its backward (crossentropy_fused), and the GELU recompute.
 * Each fused op is an ordinary entry of the op registry (ops.c); whether a backend can run it is the
 * registry's dg_op_missing_kernel, which the pipeline that schedules these passes asks first.
 */
#include <stdio.h>
#include <string.h>

#include "graph.h"

dg_status_t dg_pass_fuse_gelu(dg_graph_t *g, void *ctx) {
    (void)ctx;
    for (int i = 0; i < g->n; i++) {
        dg_node_t *ge = g->nodes[i];
        if (ge->op != DG_OP_GELU || ge->phase != DG_PHASE_FWD) continue;
        dg_node_t *mm = ge->src[0];
        if (mm->op != DG_OP_MATMUL || mm->attr[DG_A_EPI] != DG_EPI_NONE || mm->view_src ||
            (mm->flags & DG_NF_OUTPUT) || dg_graph_n_consumers(g, mm) != 1)
            continue; /* the pre-activation is needed elsewhere: keep the two ops */
        int64_t attr[2] = {0, DG_EPI_GELU};
        dg_phase_t saved = g->cur_phase;
        g->cur_phase = DG_PHASE_FWD;
        dg_node_t *f = dg_graph_add_op(g, DG_OP_MATMUL, mm->name, mm->n_src, mm->src, 0, NULL, attr, 2);
        g->cur_phase = saved;
        if (!f) return dg_graph_error(g);
        f->flags = ge->flags;
        dg_graph_move(g, f, mm->id); /* where the matmul was: after its inputs, before every use */
        dg_graph_replace_uses(g, ge, f);
        dg_graph_remove(g, ge);
        dg_graph_remove(g, mm);
        i = f->id; /* continue after the fused op */
    }
    return DG_OK;
}

/* The graph's backend has a kernel for the fused op (none when the graph has no backend). */
static int has_kernel(const dg_graph_t *g, dg_op_kind_t op) {
    return g->be && !dg_op_missing_kernel(g->be, op);
}

/* 1 if matmul mm and the add `ad` that reads its output can become one MATMUL_RES with residual r (the
 * add's other operand): see graph.h */
static int res_fusable(const dg_graph_t *g, const dg_node_t *mm, const dg_node_t *ad, const dg_node_t *r) {
    if (mm->op != DG_OP_MATMUL || mm->phase != DG_PHASE_FWD || mm->attr[DG_A_EPI] != DG_EPI_NONE ||
        mm->stream != ad->stream || r == mm)
        return 0;
    /* the product is never materialised: nothing else may read, alias or keep it */
    if (mm->storage != DG_STORE_ARENA || mm->view_src || (mm->flags & DG_NF_OUTPUT) ||
        dg_graph_n_consumers(g, mm) != 1)
        return 0;
    /* the output may be laid over the residual (inplace): it must not share storage with the GEMM's
     * operands, which the kernel reads while it writes */
    const dg_node_t *rr = dg_node_root_c(r);
    for (int k = 0; k < mm->n_src; k++)
        if (dg_node_root_c(mm->src[k]) == rr) return 0;
    for (int j = 0; j < g->n; j++)
        if (g->nodes[j]->view_src == mm) return 0;
    return 1;
}

dg_status_t dg_pass_fuse_residual(dg_graph_t *g, void *ctx) {
    dg_fuse_res_t *fr = ctx;
    if (fr) fr->n_fused = 0;
    if (!has_kernel(g, DG_OP_MATMUL_RES)) return DG_OK; /* keep the pair */
    for (int i = 0; i < g->n; i++) {
        dg_node_t *ad = g->nodes[i];
        if (ad->op != DG_OP_ADD || ad->phase != DG_PHASE_FWD || ad->view_src) continue;
        int k = 0;
        while (k < 2 && !res_fusable(g, ad->src[k], ad, ad->src[1 - k]))
            k++;
        if (k == 2) continue;
        dg_node_t *mm = ad->src[k], *r = ad->src[1 - k];
        dg_phase_t saved = g->cur_phase;
        g->cur_phase = DG_PHASE_FWD;
        dg_node_t *f =
            dg_op_matmul_res(g, ad->name, mm->src[0], mm->src[1], mm->n_src == 3 ? mm->src[2] : NULL, r);
        g->cur_phase = saved;
        if (!f) return dg_graph_error(g);
        f->flags = ad->flags;
        f->stream = ad->stream;
        /* where the add was: after every input (the matmul's and the residual), before every reader */
        dg_graph_move(g, f, ad->id);
        dg_graph_replace_uses(g, ad, f);
        dg_graph_remove(g, ad);
        dg_graph_remove(g, mm);
        if (fr) fr->n_fused++;
        i = f->id;
    }
    return DG_OK;
}

/* the GELU whose output is `act`, given its input `pre`: a matmul with the GELU epilogue (pre is its side
 * output) or a standalone gelu */
static int is_gelu_of(const dg_node_t *act, const dg_node_t *pre) {
    if (act->op == DG_OP_MATMUL && act->attr[DG_A_EPI] == DG_EPI_GELU)
        return act->n_side >= 1 && act->side[0] == pre;
    return act->op == DG_OP_GELU && act->src[0] == pre;
}

dg_status_t dg_pass_fuse_gelu_bwd(dg_graph_t *g, void *ctx) {
    (void)ctx;
    for (int i = 0; i < g->n; i++) {
        dg_node_t *gb = g->nodes[i];
        if (gb->op != DG_OP_GELU_BWD || gb->phase != DG_PHASE_BWD) continue;
        dg_node_t *pre = gb->src[0], *mb = gb->src[1];
        /* the gelu_bwd's dout must be a matmul's input gradient that nothing else reads or keeps */
        if (mb->op != DG_OP_MATMUL_BWD || mb->attr[DG_A_NO_DINP] || mb->attr[DG_A_ACC] || mb->view_src ||
            (mb->flags & DG_NF_OUTPUT) || dg_graph_n_consumers(g, mb) != 1)
            continue;
        dg_node_t *act = mb->src[1]; /* that matmul's input: must be this GELU's output */
        if (!is_gelu_of(act, pre)) continue;
        int acc = gb->attr[DG_A_ACC] != 0;
        dg_node_t *src[5] = {mb->src[0], act, mb->src[2], pre, acc ? gb->src[2] : NULL};
        int64_t attr[1] = {acc};
        char nm[96];
        dg_fmt(nm, sizeof nm, "%.80s_dgelu", mb->name);
        dg_phase_t saved = g->cur_phase;
        g->cur_phase = DG_PHASE_BWD;
        dg_node_t *f =
            dg_graph_add_op(g, DG_OP_MATMUL_BWD_DGELU, nm, acc ? 5 : 4, src, mb->n_upd, mb->upd, attr, 1);
        g->cur_phase = saved;
        if (!f) return dg_graph_error(g);
        f->flags = gb->flags;
        /* where the gelu_bwd was: after every input (mb's come earlier still), before every reader */
        dg_graph_move(g, f, gb->id);
        dg_graph_replace_uses(g, gb, f);
        /* gradient bookkeeping (read back for DG_NF_WANT_GRAD inputs): the GELU input's gradient is now
         * f; the GELU output's gradient is no longer materialised */
        for (int j = 0; j < g->n; j++) {
            if (g->nodes[j]->grad == gb) g->nodes[j]->grad = f;
            if (g->nodes[j]->grad == mb) g->nodes[j]->grad = NULL;
        }
        dg_graph_remove(g, gb);
        dg_graph_remove(g, mb);
        i = f->id;
    }
    return DG_OK;
}

/* The CROSSENTROPY_BWD of loss `ce` (reads its lse), if there is exactly one. */
static dg_node_t *ce_backward_of(dg_graph_t *g, const dg_node_t *ce) {
    dg_node_t *bw = NULL;
    for (int j = ce->id + 1; j < g->n; j++) {
        dg_node_t *x = g->nodes[j];
        if (x->op != DG_OP_CROSSENTROPY_BWD || x->src[1] != ce->side[0]) continue;
        if (bw) return NULL;
        bw = x;
    }
    return bw;
}

/* 1 if the pair (ce, bw) can become one op at ce's place: see graph.h */
static int ce_fusable(const dg_graph_t *g, const dg_node_t *ce, const dg_node_t *bw) {
    const dg_node_t *lg = ce->src[0], *tg = ce->src[1], *lse = ce->side[0];
    if (!(ce->flags & DG_NF_LOSS) || bw->phase != DG_PHASE_BWD || bw->src[0] != lg || bw->src[2] != tg ||
        bw->attr[DG_A_V] != ce->attr[DG_A_V] || bw->view_src || ce->stream != bw->stream)
        return 0;
    /* the fused op overwrites the logits (inplace) as soon as the loss is known: nobody else may read,
     * alias or keep them */
    if (lg->storage != DG_STORE_ARENA || lg->view_src || (lg->flags & DG_NF_OUTPUT) ||
        dg_graph_n_consumers(g, lg) != 2 || (lse->flags & DG_NF_OUTPUT) || dg_graph_n_consumers(g, lse) != 1)
        return 0;
    for (int j = 0; j < g->n; j++) {
        const dg_node_t *x = g->nodes[j];
        if (x->view_src == lg) return 0;
        /* the backward would read the targets as they are when it runs; the fused op reads them earlier */
        if (j > ce->id && j < bw->id)
            for (int u = 0; u < x->n_upd; u++)
                if (dg_node_root_c(x->upd[u]) == dg_node_root_c(tg)) return 0;
    }
    return 1;
}

dg_status_t dg_pass_fuse_crossentropy(dg_graph_t *g, void *ctx) {
    dg_fuse_ce_t *fc = ctx;
    if (fc) fc->n_fused = 0;
    if (!has_kernel(g, DG_OP_CROSSENTROPY_FUSED)) return DG_OK; /* keep the pair */
    for (int i = 0; i < g->n; i++) {
        dg_node_t *ce = g->nodes[i];
        if (ce->op != DG_OP_CROSSENTROPY || ce->phase != DG_PHASE_FWD) continue;
        dg_node_t *bw = ce_backward_of(g, ce);
        if (!bw || !ce_fusable(g, ce, bw)) continue;
        dg_node_t *src[2] = {ce->src[0], ce->src[1]};
        int64_t attr[2] = {0, ce->attr[DG_A_V]};
        char nm[96];
        dg_fmt(nm, sizeof nm, "%.80s.fused", ce->name);
        dg_phase_t saved = g->cur_phase;
        g->cur_phase = DG_PHASE_FWD;
        dg_node_t *f = dg_graph_add_op(g, DG_OP_CROSSENTROPY_FUSED, nm, 2, src, 0, NULL, attr, 2);
        g->cur_phase = saved;
        if (!f) return dg_graph_error(g);
        f->flags = bw->flags;
        f->stream = ce->stream;
        f->side[0]->flags = ce->flags; /* the losses: OUTPUT, LOSS */
        dg_graph_move(g, f, ce->id);   /* where the loss was: after the logits, before every reader */
        dg_graph_replace_uses(g, bw, f);
        dg_graph_replace_uses(g, ce, f->side[0]);
        for (int j = 0; j < g->n; j++) /* gradient bookkeeping: the logits' gradient is now f */
            if (g->nodes[j]->grad == bw) g->nodes[j]->grad = f;
        if (fc) {
            if (fc->loss == ce) fc->loss = f->side[0];
            fc->n_fused++;
        }
        dg_graph_remove(g, bw);
        dg_graph_remove(g, ce);
        i = f->id;
    }
    return DG_OK;
}

dg_status_t dg_pass_recompute_gelu(dg_graph_t *g, void *ctx) {
    (void)ctx;
    for (int i = 0; i < g->n; i++) {
        dg_node_t *f = g->nodes[i];
        if (f->op != DG_OP_MATMUL || f->phase != DG_PHASE_FWD || f->attr[DG_A_EPI] != DG_EPI_GELU ||
            (f->flags & DG_NF_OUTPUT))
            continue;
        int first = -1, aliased = 0;
        for (int j = i + 1; j < g->n; j++) {
            const dg_node_t *x = g->nodes[j];
            if (x->view_src == f) aliased = 1;
            if (x->phase != DG_PHASE_BWD || x->op == DG_OP_SIDE || first >= 0) continue;
            for (int k = 0; k < x->n_src; k++)
                if (x->src[k] == f) first = j;
        }
        if (first < 0 || aliased) continue; /* not read by the backward, or its storage is shared */
        char nm[96];
        dg_fmt(nm, sizeof nm, "%.80s.recompute", f->name);
        dg_phase_t saved = g->cur_phase;
        g->cur_phase = DG_PHASE_BWD;
        dg_node_t *r = dg_op_gelu(g, nm, f->side[0]);
        g->cur_phase = saved;
        if (!r) return dg_graph_error(g);
        dg_graph_move(g, r, first);
        for (int j = r->id + 1; j < g->n; j++) {
            dg_node_t *x = g->nodes[j];
            if (x->phase != DG_PHASE_BWD || x->op == DG_OP_SIDE) continue;
            for (int k = 0; k < x->n_src; k++)
                if (x->src[k] == f) x->src[k] = r;
        }
        dg_graph_touch(g);
    }
    return DG_OK;
}
