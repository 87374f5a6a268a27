/* autodiff.c — reverse-mode differentiation over the IR, the optimizer pass, and the passes that fuse
 * its per-parameter ops: the fused AdamW (and zero_grad) and the fused gradient norm.
 *
 * dg_autodiff walks the forward nodes in reverse schedule order and calls each op's backward builder
 * (ops.c), which appends backward ops in phase BWD. The sum over several consumers of a tensor is
 * built here: the first contribution becomes the gradient; later ones accumulate into it IN PLACE
 * (acc = 1 kernels, or an ACCUMULATE op) when nothing else still needs that storage, otherwise into a
 * fresh buffer. Gradients are shared without a copy where the math allows (both inputs of an add get
 * the output's gradient), so "nothing else still needs it" means: no other tensor whose backward has
 * not run yet uses the same storage as its gradient.
 *
 * Parameter gradients never go through this bookkeeping: backward kernels accumulate (+=) straight
 * into the persistent f32 gradient, which is also what makes gradient accumulation over micro-batches
 * free (zeroed once per optimizer step by the ZERO phase).
 */
#include <stdlib.h>
#include <string.h>

#include "graph.h"

struct dg_ad {
    dg_graph_t *g;
    int n_fwd;
    unsigned char *needs; /* per forward node: a gradient can flow into it */
    unsigned char *relevant;
    unsigned char *processed;
    unsigned char *loss_seed;
};

dg_graph_t *dg_ad_graph(dg_ad_t *ad) {
    return ad->g;
}

static int is_fwd(const dg_ad_t *ad, const dg_node_t *x) {
    return x->id < ad->n_fwd && ad->g->nodes[x->id] == x;
}

int dg_ad_wants(const dg_ad_t *ad, const dg_node_t *x) {
    if (!is_fwd(ad, x) || !ad->needs[x->id] || !ad->relevant[x->id]) return 0;
    return !(x->op == DG_OP_LEAF && (x->flags & DG_NF_PARAM));
}

int dg_ad_is_loss_seed(const dg_ad_t *ad, const dg_node_t *n) {
    return is_fwd(ad, n) && ad->loss_seed[n->id] && n->grad == NULL;
}

dg_node_t *dg_ad_param_grad(dg_ad_t *ad, dg_node_t *w, const char *op_name) {
    if (w->op == DG_OP_LEAF && (w->flags & DG_NF_PARAM) && w->grad) return w->grad;
    if (!ad->g->err)
        ad->g->err = DG_ERR(DG_ERR_USAGE,
                            "graph: %s: weight '%s' must be a parameter (gradients of computed weights, e.g. "
                            "gathered shards, are produced by the sharding passes)",
                            op_name, w->name);
    return NULL;
}

dg_node_t *dg_ad_acc_target(dg_ad_t *ad, dg_node_t *x) {
    dg_node_t *cur = x->grad;
    if (!cur) return NULL;
    dg_node_t *r = dg_node_root(cur);
    if (r->storage != DG_STORE_ARENA) return NULL; /* e.g. a caller-provided seed: read-only */
    for (int j = 0; j < ad->n_fwd; j++) {
        dg_node_t *y = ad->g->nodes[j];
        if (y == x || !y->grad || dg_node_root(y->grad) != r) continue;
        /* y still has to read its gradient (its backward has not run, or it is a leaf whose gradient is
         * a result): the storage is not ours to change */
        if (y->op == DG_OP_LEAF || !ad->processed[j]) return NULL;
    }
    /* while x is pending nobody else may have written the storage after cur */
    for (int j = cur->id + 1; j < ad->g->n; j++)
        DG_ASSERTF(ad->g->nodes[j]->storage == DG_STORE_NONE || dg_node_root(ad->g->nodes[j]) != r,
                   "gradient of '%s' is stale: '%s' wrote its storage later", x->name, ad->g->nodes[j]->name);
    return cur;
}

static void gname(char *buf, size_t cap, const dg_node_t *x, const char *what) {
    dg_fmt(buf, cap, "%.40s.%s", x->name, what);
}

void dg_ad_contribute(dg_ad_t *ad, dg_node_t *x, dg_node_t *g, int in_place) {
    if (in_place) {
        DG_ASSERT(g->view_src == x->grad);
        x->grad = g;
        return;
    }
    if (!x->grad) {
        x->grad = g;
        return;
    }
    /* g is a fresh buffer only x refers to: add the earlier gradient into it */
    DG_ASSERT(dg_node_root(g)->storage == DG_STORE_ARENA && g->view_src == NULL);
    char nm[96];
    gname(nm, sizeof nm, x, "grad_acc");
    dg_node_t *src[2] = {g, x->grad};
    dg_node_t *s = dg_graph_add_op(ad->g, DG_OP_ACCUMULATE, nm, 2, src, 0, NULL, NULL, 0);
    if (s) x->grad = s;
}

void dg_ad_contribute_shared(dg_ad_t *ad, dg_node_t *x, dg_node_t *g) {
    if (!x->grad) {
        x->grad = g;
        return;
    }
    char nm[96];
    dg_node_t *t = dg_ad_acc_target(ad, x);
    if (t) {
        gname(nm, sizeof nm, x, "grad_acc");
        dg_node_t *src[2] = {t, g};
        dg_node_t *s = dg_graph_add_op(ad->g, DG_OP_ACCUMULATE, nm, 2, src, 0, NULL, NULL, 0);
        if (s) x->grad = s;
        return;
    }
    gname(nm, sizeof nm, x, "grad_sum");
    dg_node_t *s = dg_op_add(ad->g, nm, x->grad, g);
    if (s) x->grad = s;
}

dg_node_t *dg_node_grad_of(const dg_node_t *x) {
    return x->grad;
}

static int same_shape(const dg_node_t *a, const dg_node_t *b) {
    if (a->ndim != b->ndim) return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return 0;
    return 1;
}

dg_status_t dg_autodiff(dg_graph_t *g, int n_out, dg_node_t *const *outs, dg_node_t *const *seeds) {
    if (g->err) return g->err;
    dg_ad_t ad = {.g = g, .n_fwd = g->n};
    ad.needs = dg_xcalloc((size_t)g->n + 1, 1);
    ad.relevant = dg_xcalloc((size_t)g->n + 1, 1);
    ad.processed = dg_xcalloc((size_t)g->n + 1, 1);
    ad.loss_seed = dg_xcalloc((size_t)g->n + 1, 1);
    dg_status_t st = DG_OK;

    for (int i = 0; i < g->n; i++) {
        dg_node_t *n = g->nodes[i];
        if (n->op == DG_OP_LEAF) {
            ad.needs[i] = (n->flags & DG_NF_PARAM) || (n->flags & DG_NF_WANT_GRAD);
            if (!(n->flags & DG_NF_PARAM)) n->grad = NULL;
            continue;
        }
        n->grad = NULL;
        if (n->op == DG_OP_SIDE || dg_op_def(n->op)->grad_kind != DG_GRAD_BUILDER) continue;
        for (int k = 0; k < n->n_src; k++)
            if (ad.needs[n->src[k]->id]) ad.needs[i] = 1;
    }
    for (int o = 0; o < n_out; o++) {
        dg_node_t *y = outs[o];
        if (!y || !is_fwd(&ad, y)) {
            st = DG_ERR(DG_ERR_USAGE, "autodiff: output %d is not a node of the forward graph", o);
            goto done;
        }
        ad.relevant[y->id] = 1;
        y->flags |= DG_NF_OUTPUT; /* the caller asked for it: keep it readable after the backward */
        if (seeds && seeds[o]) {
            if (!same_shape(seeds[o], y) || seeds[o]->dtype != y->dtype) {
                st = DG_ERR(DG_ERR_USAGE, "autodiff: seed '%s' does not match output '%s'", seeds[o]->name,
                            y->name);
                goto done;
            }
            y->grad = seeds[o];
        } else {
            if (y->op != DG_OP_CROSSENTROPY) {
                st = DG_ERR(DG_ERR_USAGE,
                            "autodiff: output '%s' (%s) has no seed and is not a crossentropy loss", y->name,
                            dg_op_name(y->op));
                goto done;
            }
            ad.loss_seed[y->id] = 1;
            y->flags |= DG_NF_LOSS;
        }
    }
    for (int i = g->n - 1; i >= 0; i--) {
        dg_node_t *n = g->nodes[i];
        if (!ad.relevant[i] || n->op == DG_OP_LEAF || n->op == DG_OP_SIDE) continue;
        for (int k = 0; k < n->n_src; k++)
            ad.relevant[n->src[k]->id] = 1;
    }

    dg_phase_t saved = g->cur_phase;
    g->cur_phase = DG_PHASE_BWD;
    for (int i = ad.n_fwd - 1; i >= 0 && st == DG_OK; i--) {
        dg_node_t *n = g->nodes[i];
        if (n->op == DG_OP_LEAF || n->op == DG_OP_SIDE) continue;
        if (!ad.relevant[i] || !ad.needs[i] || (!n->grad && !ad.loss_seed[i])) {
            ad.processed[i] = 1;
            continue;
        }
        const dg_op_def_t *def = dg_op_def(n->op);
        if (def->grad_kind != DG_GRAD_BUILDER) {
            st = DG_ERR(DG_ERR_USAGE, "autodiff: '%s' (%s) is not differentiable", n->name, def->name);
            break;
        }
        st = def->backward(&ad, n);
        if (st == DG_OK) st = g->err;
        ad.processed[i] = 1;
    }
    g->cur_phase = saved;
    if (st != DG_OK) goto done;

    /* gradients the caller asked for must survive the rest of the schedule */
    for (int i = 0; i < ad.n_fwd; i++) {
        dg_node_t *n = g->nodes[i];
        if (n->op == DG_OP_LEAF && (n->flags & DG_NF_WANT_GRAD) && n->grad) n->grad->flags |= DG_NF_OUTPUT;
    }
done:
    free(ad.needs);
    free(ad.relevant);
    free(ad.processed);
    free(ad.loss_seed);
    if (st != DG_OK && !g->err) g->err = st;
    return st;
}

/* ---------------- optimizer pass ---------------- */

dg_status_t dg_graph_add_optimizer(dg_graph_t *g, int (*decay_of)(const dg_node_t *param, void *ctx),
                                   void *ctx, dg_node_t **scalars_out) {
    if (g->err) return g->err;
    int np = 0;
    for (int i = 0; i < g->n; i++)
        if (g->nodes[i]->flags & DG_NF_PARAM) np++;
    dg_node_t **params = dg_xcalloc((size_t)np + 1, sizeof *params);
    dg_node_t **mv = dg_xcalloc(2 * (size_t)np + 1, sizeof *mv);
    np = 0;
    for (int i = 0; i < g->n; i++)
        if (g->nodes[i]->flags & DG_NF_PARAM) params[np++] = g->nodes[i];

    char nm[96];
    int64_t ns = DG_SCALAR_COUNT;
    dg_node_t *sc = dg_graph_leaf(g, "optim.scalars", DG_F32, 1, &ns, DG_NF_SCALAR);
    for (int i = 0; i < np && sc; i++) {
        dg_node_t *p = params[i];
        dg_fmt(nm, sizeof nm, "adam_m.%.80s", p->name);
        mv[2 * i] = dg_graph_leaf(g, nm, DG_F32, p->ndim, p->shape, DG_NF_OPTSTATE);
        dg_fmt(nm, sizeof nm, "adam_v.%.80s", p->name);
        mv[2 * i + 1] = dg_graph_leaf(g, nm, DG_F32, p->ndim, p->shape, DG_NF_OPTSTATE);
        if (!mv[2 * i] || !mv[2 * i + 1]) break;
        mv[2 * i]->param_index = mv[2 * i + 1]->param_index = p->param_index;
    }
    dg_phase_t saved = g->cur_phase;
    g->cur_phase = DG_PHASE_ZERO;
    for (int i = 0; i < np && !g->err; i++) {
        dg_fmt(nm, sizeof nm, "zero.%.80s", params[i]->grad->name);
        dg_graph_add_op(g, DG_OP_ZERO, nm, 0, NULL, 1, &params[i]->grad, NULL, 0);
    }
    g->cur_phase = DG_PHASE_OPT;
    if (!g->err) dg_graph_add_op(g, DG_OP_ZERO, "zero.optim.scalars", 0, NULL, 1, &sc, NULL, 0);
    for (int i = 0; i < np && !g->err; i++) {
        if (params[i]->flags & DG_NF_NORM_SKIP) continue; /* a replica another rank counts */
        dg_fmt(nm, sizeof nm, "sumsq.%.80s", params[i]->name);
        dg_graph_add_op(g, DG_OP_SUMSQ, nm, 1, &params[i]->grad, 1, &sc, NULL, 0);
    }
    if (!g->err) dg_graph_add_op(g, DG_OP_CLIP_SCALE, "clip_scale", 0, NULL, 1, &sc, NULL, 0);
    for (int i = 0; i < np && !g->err; i++) {
        dg_node_t *p = params[i];
        dg_node_t *src[2] = {p->grad, sc}, *upd[4] = {p->master, mv[2 * i], mv[2 * i + 1], p};
        int64_t attr[2] = {0, decay_of ? decay_of(p, ctx) : 1};
        dg_fmt(nm, sizeof nm, "adamw.%.80s", p->name);
        dg_graph_add_op(g, DG_OP_ADAMW, nm, 2, src, 4, upd, attr, 2);
    }
    g->cur_phase = saved;
    free(params);
    free(mv);
    if (scalars_out) *scalars_out = g->err ? NULL : sc;
    return g->err;
}

/* ---------------- fused AdamW pass ---------------- */

static int seg_by_off(const void *a, const void *b) {
    const dg_opt_seg_t *x = a, *y = b;
    return x->off < y->off ? -1 : x->off > y->off;
}

dg_status_t dg_pass_fuse_adamw(dg_graph_t *g, void *ctx) {
    dg_fuse_adamw_t *f = ctx;
    f->master = f->grad = f->m = f->v = f->param = f->segs = NULL;
    if (g->err) return g->err;
    int na = 0, last = -1;
    for (int i = 0; i < g->n; i++)
        if (g->nodes[i]->op == DG_OP_ADAMW) {
            na++;
            last = i;
        }
    if (na == 0) return DG_OK;
    if (g->opt_segs)
        return DG_ERR(DG_ERR_USAGE,
                      "graph: pass fuse_adamw: the graph has a fused AdamW already; hint: run the "
                      "pass once, after the optimizer pass");
    dg_opt_seg_t *segs = dg_xcalloc((size_t)na, sizeof *segs);
    dg_node_t **ad = dg_xcalloc((size_t)na, sizeof *ad);
    dg_status_t st = DG_OK;
    int k = 0;
    for (int i = 0; i < g->n && st == DG_OK; i++) {
        dg_node_t *a = g->nodes[i];
        if (a->op != DG_OP_ADAMW) continue;
        int pi = a->upd[0]->param_index;
        size_t count = dg_node_numel(a->src[0]);
        if (pi < 0 || pi >= f->n) {
            st = DG_ERR(DG_ERR_USAGE,
                        "graph: pass fuse_adamw: '%s' updates parameter index %d, outside the %d "
                        "offsets given",
                        a->name, pi, f->n);
            break;
        }
        size_t off = f->off[pi];
        if (off % 4 != 0 || off > f->span || count > f->span - off || count > UINT32_MAX)
            st = DG_ERR(
                DG_ERR_USAGE,
                "graph: pass fuse_adamw: '%s' (%zu elements at offset %zu) does not fit a segment of the "
                "%zu-element flat buffers; hint: offsets must be multiples of 4 elements",
                a->name, count, off, f->span);
        segs[k] = (dg_opt_seg_t){pi, a->attr[DG_A_DECAY] != 0, off, count};
        ad[k++] = a;
    }
    if (st == DG_OK) {
        qsort(segs, (size_t)na, sizeof *segs, seg_by_off);
        for (int j = 1; j < na && st == DG_OK; j++)
            if (segs[j].off < segs[j - 1].off + segs[j - 1].count)
                st = DG_ERR(
                    DG_ERR_USAGE,
                    "graph: pass fuse_adamw: parameters %d and %d overlap in the flat buffers (offsets "
                    "%zu and %zu)",
                    segs[j - 1].param_index, segs[j].param_index, segs[j - 1].off, segs[j].off);
    }
    if (st != DG_OK) {
        free(segs);
        free(ad);
        return g->err = st;
    }
    /* the fused op takes the place of the last ADAMW: every input of every ADAMW is ready there */
    int pos = last - (na - 1);
    dg_node_t *sc = ad[0]->src[1];
    /* the gradients the segments cover: their per-parameter ZEROs (phase ZERO) become one ZERO of the
     * flat gradient buffer below (one memset instead of one per parameter) */
    dg_node_t **grads = dg_xcalloc((size_t)na, sizeof *grads);
    for (int j = 0; j < na; j++)
        grads[j] = ad[j]->src[0];
    for (int j = 0; j < na; j++)
        dg_graph_remove(g, ad[j]);
    free(ad);
    int zpos = -1; /* where the first of them was */
    for (int i = 0; i < g->n;) {
        dg_node_t *z = g->nodes[i];
        int hit = 0;
        if (z->op == DG_OP_ZERO && z->phase == DG_PHASE_ZERO && z->n_upd == 1)
            for (int j = 0; j < na && !hit; j++)
                hit = z->upd[0] == grads[j];
        if (!hit) {
            i++;
            continue;
        }
        if (zpos < 0) zpos = i;
        if (i < pos) pos--;
        dg_graph_remove(g, z);
    }
    free(grads);
    g->opt_segs = segs;
    g->n_opt_segs = na;

    int64_t span = (int64_t)f->span, tshape[2] = {na, 4};
    dg_node_t *leaf[6];
    int nl = 0;
    leaf[nl++] = f->master = dg_graph_leaf(g, "flat.master", DG_F32, 1, &span, DG_NF_FLAT);
    leaf[nl++] = f->grad = dg_graph_leaf(g, "flat.grad", DG_F32, 1, &span, DG_NF_FLAT);
    leaf[nl++] = f->m = dg_graph_leaf(g, "flat.adam_m", DG_F32, 1, &span, DG_NF_FLAT);
    leaf[nl++] = f->v = dg_graph_leaf(g, "flat.adam_v", DG_F32, 1, &span, DG_NF_FLAT);
    if (g->act_dtype != DG_F32)
        leaf[nl++] = f->param = dg_graph_leaf(g, "flat.param", g->act_dtype, 1, &span, DG_NF_FLAT);
    else
        f->param = f->master;
    _Static_assert(sizeof(dg_adamw_seg_t) == 4 * sizeof(int32_t), "segment table leaf: [nseg, 4] int32");
    leaf[nl++] = f->segs = dg_graph_leaf(g, "optim.adamw_segs", DG_I32, 2, tshape, DG_NF_FLAT);
    if (g->err) return g->err;
    for (int j = 0; j < nl; j++)
        dg_graph_move(g, leaf[j], pos++);
    dg_phase_t saved = g->cur_phase;
    g->cur_phase = DG_PHASE_OPT;
    dg_node_t *src[3] = {f->grad, sc, f->segs}, *upd[4] = {f->master, f->m, f->v, f->param};
    int64_t attr[2] = {0, na};
    dg_node_t *op = dg_graph_add_op(g, DG_OP_ADAMW_ALL, "adamw.flat", 3, src, 4, upd, attr, 2);
    if (!op) {
        g->cur_phase = saved;
        return g->err;
    }
    dg_graph_move(g, op, pos);
    if (zpos < 0) {
        g->cur_phase = saved;
        return DG_OK;
    }
    /* zero_grad: one ZERO of the whole flat gradient buffer (every covered gradient, and the padding
     * between segments, which nothing writes) where the per-parameter ZEROs were, after the flat leaves
     * (moved there: leaves belong to no phase, and each phase's ops stay contiguous) */
    for (int j = 0; j < nl; j++)
        dg_graph_move(g, leaf[j], zpos + j);
    g->cur_phase = DG_PHASE_ZERO;
    dg_node_t *z = dg_graph_add_op(g, DG_OP_ZERO, "zero.flat.grad", 0, NULL, 1, &f->grad, NULL, 0);
    g->cur_phase = saved;
    if (!z) return g->err;
    dg_graph_move(g, z, zpos + nl);
    return DG_OK;
}

/* ---------------- fused gradient-norm pass ---------------- */

dg_status_t dg_pass_fuse_sumsq(dg_graph_t *g, void *ctx) {
    dg_fuse_adamw_t *f = ctx;
    f->norm_segs = NULL;
    if (g->err) return g->err;
    if (!f->grad) return DG_OK; /* no fused AdamW, hence no flat gradient leaf: the SUMSQ ops stay */
    int ns = 0, first = -1, last = -1;
    for (int i = 0; i < g->n; i++)
        if (g->nodes[i]->op == DG_OP_SUMSQ) {
            ns++;
            if (first < 0) first = i;
            last = i;
        }
    if (ns == 0) return DG_OK;
    if (g->norm_segs)
        return g->err = DG_ERR(DG_ERR_USAGE, "graph: pass fuse_sumsq: the graph has a fused norm already; "
                                             "hint: run the pass once, right after fuse_adamw");
    /* the fused op replaces them where they stand: only valid when nothing runs in between (an op there
     * could write a gradient a later SUMSQ reads, or read the partial sum) */
    for (int i = first; i <= last; i++) {
        const dg_node_t *x = g->nodes[i];
        if (x->op != DG_OP_SUMSQ && x->op != DG_OP_LEAF)
            return g->err = DG_ERR(DG_ERR_USAGE,
                                   "graph: pass fuse_sumsq: %s '%s' runs between two SUMSQ ops; hint: run "
                                   "the pass right after the optimizer pass and fuse_adamw",
                                   dg_op_name(x->op), x->name);
    }
    dg_opt_seg_t *segs = dg_xcalloc((size_t)ns, sizeof *segs);
    dg_node_t **ops = dg_xcalloc((size_t)ns, sizeof *ops);
    dg_node_t *sc = NULL;
    dg_status_t st = DG_OK;
    int k = 0;
    for (int i = first; i <= last && st == DG_OK; i++) {
        dg_node_t *s = g->nodes[i];
        if (s->op != DG_OP_SUMSQ) continue;
        const dg_node_t *gr = s->src[0];
        int pi = gr->param_index;
        size_t count = dg_node_numel(gr);
        if (!sc) sc = s->upd[0];
        /* the gradient must be where the fused AdamW found it: one of its segments, same offset and size
         * (so inside the flat gradient buffer that the leaf spans) */
        const dg_opt_seg_t *a = NULL;
        for (int j = 0; j < g->n_opt_segs && !a; j++)
            if (g->opt_segs[j].param_index == pi) a = &g->opt_segs[j];
        if (s->upd[0] != sc)
            st = DG_ERR(DG_ERR_USAGE,
                        "graph: pass fuse_sumsq: '%s' accumulates into '%s', the others into '%s'", s->name,
                        s->upd[0]->name, sc->name);
        else if (pi < 0 || pi >= f->n || !a || a->off != f->off[pi] || a->count != count)
            st =
                DG_ERR(DG_ERR_USAGE,
                       "graph: pass fuse_sumsq: '%s' reads '%s' (%zu elements, parameter index %d), which is "
                       "not a tensor of the flat gradient buffer; hint: the fused norm covers the gradients "
                       "of the fused AdamW",
                       s->name, gr->name, count, pi);
        else
            segs[k] = (dg_opt_seg_t){pi, 0, a->off, count};
        ops[k++] = s;
    }
    if (st != DG_OK) {
        free(segs);
        free(ops);
        return g->err = st;
    }
    for (int j = 0; j < ns; j++)
        dg_graph_remove(g, ops[j]);
    free(ops);
    g->norm_segs = segs;
    g->n_norm_segs = ns;

    int64_t tshape[2] = {ns, 4};
    _Static_assert(sizeof(dg_sumsq_seg_t) == 4 * sizeof(int32_t), "segment table leaf: [nseg, 4] int32");
    f->norm_segs = dg_graph_leaf(g, "optim.sumsq_segs", DG_I32, 2, tshape, DG_NF_FLAT);
    if (!f->norm_segs) return g->err;
    /* where the first SUMSQ was: after the norm accumulator's ZERO (and whatever the passes put before the
     * SUMSQ ops), before what followed the last one (CLIP_SCALE, and the all-reduces of the sum that the
     * grad_sync pass inserts right before it) */
    dg_graph_move(g, f->norm_segs, first);
    dg_phase_t saved = g->cur_phase;
    g->cur_phase = DG_PHASE_OPT;
    dg_node_t *src[2] = {f->grad, f->norm_segs};
    int64_t attr[2] = {0, ns};
    dg_node_t *op = dg_graph_add_op(g, DG_OP_SUMSQ_ALL, "sumsq.flat", 2, src, 1, &sc, attr, 2);
    g->cur_phase = saved;
    if (!op) return g->err;
    dg_graph_move(g, op, first + 1);
    return DG_OK;
}
