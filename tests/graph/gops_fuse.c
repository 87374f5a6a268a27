/* gops_fuse.c — test_graph_ops cases of the loss and the fusions: cross-entropy (plain and fused into the
 * head), matmul + residual (out of place and in place), the residual-fusion pass, and fan-out. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gops.h"

/* The unfused and the fused graph, one phase each. */
static void tg_run2(tg_t *u, tg_t *f, dg_phase_t ph) {
    tg_run(u, ph);
    tg_run(f, ph);
}

/* cross-entropy as the loss: seed = runtime dloss; padded logit columns get exactly zero gradient */

static double obj_ce(void *p) {
    ctx_t *c = p;
    int N = c->d[0], V = c->d[1], Vp = c->d[2];
    double *l = malloc((size_t)N * sizeof *l);
    ref_crossentropy(l, c->in[0], c->tok, N, V, Vp);
    double s = 0;
    for (int i = 0; i < N; i++)
        s += l[i];
    free(l);
    return (double)c->dloss * s;
}

void case_crossentropy(tg_t *t, int f0) {
    int N = 6, V = 7, Vp = 9;
    int64_t sl[3] = {2, 3, Vp}, st[2] = {2, 3};
    dg_node_t *lg = tg_f(t, "logits", 3, sl, DG_NF_INPUT | DG_NF_WANT_GRAD, -3, 3);
    dg_node_t *tg = tg_i(t, "targets", 2, st, V);
    dg_node_t *loss = dg_op_crossentropy(t->g, "ce", lg, tg, V);
    tg_finish(t, 1, &loss, NULL);
    t->ex->rt.dloss = 0.37f;
    tg_run(t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(t, lg)}, .tok = tg_leaf(t, tg)->i, .d = {N, V, Vp}, .dloss = 0.37f};
    double lr[6];
    ref_crossentropy(lr, c.in[0], c.tok, N, V, Vp);
    float *lgot = tg_get(t, loss);
    check_close("crossentropy forward (per-token losses)", lgot, lr, 6, 1e-5);
    tg_run(t, DG_PHASE_BWD);
    float *gl = tg_get(t, dg_node_grad_of(lg));
    check_fd("crossentropy d/dlogits", c.in[0], (size_t)N * Vp, gl, obj_ce, &c);
    int pad_nonzero = 0;
    for (int i = 0; i < N; i++)
        for (int j = V; j < Vp; j++)
            pad_nonzero += gl[i * Vp + j] != 0.0f;
    EXPECT(pad_nonzero == 0, "crossentropy: %d padded logit gradients are not exactly zero", pad_nonzero);
    tg_cover(t, f0);
    free(lgot), free(gl), free(c.in[0]);
}

/* sum over rows of dloss * crossentropy(x . w^T) */
static double obj_head_ce(void *p) {
    ctx_t *c = p;
    int N = c->d[0], C = c->d[1], Vp = c->d[2];
    double *z = malloc((size_t)N * Vp * sizeof *z), *l = malloc((size_t)N * sizeof *l);
    ref_matmul(z, c->in[0], c->in[1], NULL, N, C, Vp);
    ref_crossentropy(l, z, c->tok, N, 7, Vp);
    double s = 0;
    for (int i = 0; i < N; i++)
        s += l[i];
    free(z);
    free(l);
    return (double)c->dloss * s;
}

/* The classifier loss fused with its backward (pass fuse_crossentropy, op crossentropy_fused): a linear
 * head then the loss, built twice from the same data, the pair kept in one graph and fused in the other.
 * The fused graph has one op in the forward whose output (dlogits) lies over the logits; the losses, the
 * input gradient and the accumulated weight gradient are bitwise those of the pair over two micro-batches
 * with different dloss values; a forward-only run leaves the logits as the pair's forward does. The pass
 * refuses when the logits have another reader or are an output, and with a backend without the entry. */
typedef struct {
    tg_t t;
    dg_node_t *x, *w, *logits, *loss;
    dg_fuse_ce_t fc;
} ce_graph_t;

enum { CEF_FUSE = 1, CEF_LOGITS_OUT = 2, CEF_SECOND_READER = 4 };

static void ce_build(ce_graph_t *c, dg_backend_t *be, int how) {
    memset(c, 0, sizeof *c);
    tg_init(&c->t, be, 31);
    const int C = 8, V = 7, Vp = 12;
    int64_t sx[3] = {2, 3, C}, sw[2] = {Vp, C}, st[2] = {2, 3};
    c->x = tg_f(&c->t, "x", 3, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    c->w = tg_f(&c->t, "w", 2, sw, DG_NF_PARAM, -1, 1);
    dg_node_t *tg = tg_i(&c->t, "targets", 2, st, V);
    c->logits = dg_op_matmul(c->t.g, "head", c->x, c->w, NULL);
    if (how & CEF_LOGITS_OUT) c->logits->flags |= DG_NF_OUTPUT;
    c->loss = dg_op_crossentropy(c->t.g, "ce", c->logits, tg, V);
    dg_node_t *outs[2] = {c->loss, NULL}, *seeds[2] = {NULL, NULL};
    int nout = 1;
    if (how & CEF_SECOND_READER) { /* the logits also feed a GELU whose output is wanted too */
        outs[1] = dg_op_gelu(c->t.g, "act", c->logits);
        int64_t sy[3] = {2, 3, Vp};
        seeds[1] = tg_f(&c->t, "dact", 3, sy, DG_NF_INPUT, -1, 1);
        nout = 2;
    }
    OK(dg_graph_error(c->t.g));
    OK(dg_autodiff(c->t.g, nout, outs, seeds));
    c->fc.loss = c->loss;
    dg_pass_t passes[2] = {{"fuse_crossentropy", dg_pass_fuse_crossentropy, &c->fc},
                           {"inplace", dg_pass_inplace, NULL}};
    int first = (how & CEF_FUSE) ? 0 : 1;
    OK(dg_graph_run_passes(c->t.g, passes + first, 2 - first));
    c->loss = c->fc.loss;
    OK(dg_plan_create(c->t.g, 0, &c->t.plan));
    OK(dg_plan_check(c->t.plan, c->t.g));
    OK(dg_graph_alloc_persistent(c->t.g, be, &c->t.al));
    for (int k = 0; k < c->t.nl; k++) {
        leaf_t *l = &c->t.leaves[k];
        OK(be->ops->to_device(be, l->n->data, l->f ? (void *)l->f : (void *)l->i, l->n->nbytes));
    }
    OK(dg_exec_create(be, c->t.g, c->t.plan, &c->t.ex));
}

/* 1 when node na of graph a holds the same bytes as nb of graph b (the unfused pair's); else an EXPECT
 * failure "PASS: WHAT differs from the unfused pair's" and 0 */
static int same_bits(const char *pass, tg_t *a, tg_t *b, const dg_node_t *na, const dg_node_t *nb,
                     const char *what) {
    float *x = tg_get(a, na), *y = tg_get(b, nb);
    int same = na->nbytes == nb->nbytes && memcmp(x, y, na->nbytes) == 0;
    EXPECT(same, "%s: %s differs from the unfused pair's", pass, what);
    free(x);
    free(y);
    return same;
}

static int ce_same(ce_graph_t *a, ce_graph_t *b, const dg_node_t *na, const dg_node_t *nb, const char *what) {
    return same_bits("crossentropy_fused", &a->t, &b->t, na, nb, what);
}

void case_crossentropy_fused(dg_backend_t *be) {
    int f0 = dg_fails;
    ce_graph_t u, f;
    ce_build(&u, be, 0);
    ce_build(&f, be, CEF_FUSE);
    EXPECT(f.fc.n_fused == 1 && tg_count(&f.t, DG_OP_CROSSENTROPY_FUSED, -1) == 1 &&
               tg_count(&f.t, DG_OP_CROSSENTROPY, -1) == 0 && tg_count(&f.t, DG_OP_CROSSENTROPY_BWD, -1) == 0,
           "fuse_crossentropy: %d fused, %d crossentropy_fused / %d crossentropy / %d crossentropy_bwd ops",
           f.fc.n_fused, tg_count(&f.t, DG_OP_CROSSENTROPY_FUSED, -1), tg_count(&f.t, DG_OP_CROSSENTROPY, -1),
           tg_count(&f.t, DG_OP_CROSSENTROPY_BWD, -1));
    const dg_node_t *fo = dg_node_grad_of(f.logits);
    EXPECT(fo && fo->op == DG_OP_CROSSENTROPY_FUSED && fo->phase == DG_PHASE_FWD &&
               fo->view_src == f.logits && f.loss == fo->side[0] && (f.loss->flags & DG_NF_LOSS) &&
               (f.loss->flags & DG_NF_OUTPUT),
           "fuse_crossentropy: the logits' gradient must be the forward fused op, over the logits, and the "
           "tracked loss its losses output");
    /* the logits' storage (now dlogits too) stays live until the head's backward reads it */
    int mb = -1;
    for (int i = 0; i < f.t.g->n; i++)
        if (f.t.g->nodes[i]->op == DG_OP_MATMUL_BWD) mb = i;
    EXPECT(mb >= 0 && f.t.plan->live_end[f.logits->id] >= mb,
           "the logits/dlogits storage dies at %d, before %d", f.t.plan->live_end[f.logits->id], mb);
    const float dl[2] = {0.37f, 0.5f};
    for (int r = 0; r < 2; r++) { /* two micro-batches: the weight gradient accumulates */
        u.t.ex->rt.dloss = f.t.ex->rt.dloss = dl[r];
        tg_run2(&u.t, &f.t, DG_PHASE_FWD);
        ce_same(&u, &f, u.loss, f.loss, "losses");
        tg_run2(&u.t, &f.t, DG_PHASE_BWD);
        ce_same(&u, &f, dg_node_grad_of(u.x), dg_node_grad_of(f.x), "the input gradient");
        ce_same(&u, &f, u.w->grad, f.w->grad, "the accumulated weight gradient");
    }
    /* a forward with no backward: the fused op computes the losses and leaves the logits */
    f.t.ex->rt.forward_only = 1;
    tg_run2(&u.t, &f.t, DG_PHASE_FWD);
    f.t.ex->rt.forward_only = 0;
    ce_same(&u, &f, u.loss, f.loss, "forward-only losses");
    ce_same(&u, &f, u.logits, f.logits, "the logits after a forward-only run");
    /* the gradient against finite differences, through the fused graph */
    ctx_t cx = {.in = {tg_d(&f.t, f.x), tg_d(&f.t, f.w)}, .d = {6, 8, 12}, .dloss = 0.37f};
    f.t.ex->rt.dloss = 0.37f;
    tg_run(&f.t, DG_PHASE_FWD);
    tg_run(&f.t, DG_PHASE_BWD);
    float *gx = tg_get(&f.t, dg_node_grad_of(f.x));
    cx.tok = tg_leaf(&f.t, f.loss->src[0]->src[1])->i;
    check_fd("crossentropy_fused d/dx", cx.in[0], 48, gx, obj_head_ce, &cx);
    free(gx), free(cx.in[0]), free(cx.in[1]);
    tg_cover(&f.t, f0);
    tg_free(&u.t);
    tg_free(&f.t);

    /* refusals: logits read elsewhere, or kept as an output; a backend without the entry */
    const int refuse[2] = {CEF_FUSE | CEF_SECOND_READER, CEF_FUSE | CEF_LOGITS_OUT};
    for (int k = 0; k < 2; k++) {
        ce_build(&f, be, refuse[k]);
        EXPECT(f.fc.n_fused == 0 && tg_count(&f.t, DG_OP_CROSSENTROPY_FUSED, -1) == 0 &&
                   tg_count(&f.t, DG_OP_CROSSENTROPY_BWD, -1) == 1,
               "fuse_crossentropy must keep the pair when %s",
               k == 0 ? "the logits have another reader" : "the logits are an output");
        tg_free(&f.t);
    }
    dg_backend_ops_t ops = *be->ops;
    ops.crossentropy_fused = NULL;
    dg_backend_t nofuse = *be;
    nofuse.ops = &ops;
    ce_build(&f, &nofuse, CEF_FUSE);
    EXPECT(f.fc.n_fused == 0 && tg_count(&f.t, DG_OP_CROSSENTROPY_BWD, -1) == 1,
           "fuse_crossentropy must keep the pair on a backend without crossentropy_fused");
    tg_free(&f.t);
}

/* matmul_res: x·wᵀ + b + r in one op (what fuse_residual makes of a matmul and the residual add after
 * it). d[3] = 1: the residual is gelu(in[3]) (an arena tensor dying at the op, so the inplace pass lays the
 * output over it), else in[3] itself; d[4] = 1: no bias. */
static double obj_matmul_res(void *p) {
    ctx_t *c = p;
    int N = c->d[0], C = c->d[1], OC = c->d[2];
    size_t n = (size_t)N * OC;
    double *y = malloc(n * sizeof *y), *r = malloc(n * sizeof *r);
    ref_matmul(y, c->in[0], c->in[1], c->d[4] ? NULL : c->in[2], N, C, OC);
    if (c->d[3])
        ref_gelu(r, c->in[3], n);
    else
        memcpy(r, c->in[3], n * sizeof *r);
    for (size_t i = 0; i < n; i++)
        y[i] += r[i];
    double s = dot(y, c->dout, n);
    free(y), free(r);
    return s;
}

static void case_matmul_res_run(dg_backend_t *be, int inplace) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 41 + (uint64_t)inplace);
    int N = 6, C = 8, OC = 5;
    int64_t sx[3] = {2, 3, C}, sw[2] = {OC, C}, sb[1] = {OC}, sy[3] = {2, 3, OC};
    dg_node_t *x = tg_f(&t, "x", 3, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    dg_node_t *w = tg_f(&t, "w", 2, sw, DG_NF_PARAM, -1, 1);
    dg_node_t *b = tg_f(&t, "b", 1, sb, DG_NF_PARAM, -1, 1);
    dg_node_t *z = tg_f(&t, "z", 3, sy, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    dg_node_t *r = inplace ? dg_op_gelu(t.g, "r", z) : z;
    dg_node_t *y = dg_op_matmul_res(t.g, "fc_res", x, w, inplace ? NULL : b, r);
    dg_node_t *dout = tg_f(&t, "dout", 3, sy, DG_NF_INPUT, -1, 1);
    tg_finish(&t, 1, &y, &dout);
    EXPECT(inplace ? y->view_src == r : y->view_src == NULL,
           "matmul_res: the output should %s the residual's storage", inplace ? "take over" : "not share");
    tg_run(&t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(&t, x), tg_d(&t, w), tg_d(&t, b), tg_d(&t, z)},
               .dout = tg_d(&t, dout),
               .d = {N, C, OC, inplace, inplace}};
    double yr[30], rr[30];
    ref_matmul(yr, c.in[0], c.in[1], inplace ? NULL : c.in[2], N, C, OC);
    if (inplace)
        ref_gelu(rr, c.in[3], 30);
    else
        memcpy(rr, c.in[3], sizeof rr);
    for (int i = 0; i < 30; i++)
        yr[i] += rr[i];
    float *yg = tg_get(&t, y);
    check_close(inplace ? "matmul_res (in place, no bias) forward" : "matmul_res forward", yg, yr, 30, 1e-5);
    tg_run(&t, DG_PHASE_BWD);
    float *gx = tg_get(&t, dg_node_grad_of(x)), *gw = tg_get(&t, w->grad),
          *gz = tg_get(&t, dg_node_grad_of(z));
    float *gb = inplace ? NULL : tg_get(&t, b->grad);
    check_fd("matmul_res d/dx", c.in[0], 48, gx, obj_matmul_res, &c);
    check_fd("matmul_res d/dw", c.in[1], 40, gw, obj_matmul_res, &c);
    if (!inplace) check_fd("matmul_res d/dbias", c.in[2], 5, gb, obj_matmul_res, &c);
    check_fd(inplace ? "matmul_res d/dz through r = gelu(z)" : "matmul_res d/dresidual", c.in[3], 30, gz,
             obj_matmul_res, &c);
    dg_node_t *par[2] = {w, b}, *act[2] = {x, z};
    float *g1[2] = {gw, gb}, *a1[2] = {gx, gz};
    check_accumulation(&t, inplace ? 1 : 2, par, g1, 2, act, a1);
    tg_cover(&t, f0);
    free(yg), free(gx), free(gw), free(gz), free(gb);
    for (int k = 0; k < 4; k++)
        free(c.in[k]);
    free(c.dout);
    tg_free(&t);
}

void case_matmul_res(dg_backend_t *be) {
    case_matmul_res_run(be, 0);
    case_matmul_res_run(be, 1);
}

/* The residual fusion pass (fuse_residual, before autodiff): a linear layer and the residual add reading
 * its output, built twice from the same data, the pair kept in one graph and fused in the other. The
 * fused graph has one matmul_res at the add's place under its name, laid over the residual (which dies
 * there), and a backward of the same op kinds in the same order; the output, the input and residual
 * gradients and the accumulated weight gradients are bitwise the pair's over two runs. The pass refuses
 * when the product has another reader or is an output, when it reaches the add through an all-reduce
 * (tensor parallelism's row-parallel products), when the residual is the matmul's own input, and on a
 * backend without the entry. */
typedef struct {
    tg_t t;
    dg_node_t *x, *w, *b, *z, *r, *y;
    dg_fuse_res_t fr;
} res_graph_t;

enum { RF_FUSE = 1, RF_SECOND_READER = 2, RF_ALLREDUCE = 4, RF_SWAP = 8, RF_MM_OUT = 16, RF_SELF = 32 };

static void res_build(res_graph_t *c, dg_backend_t *be, int how) {
    memset(c, 0, sizeof *c);
    tg_init(&c->t, be, 43);
    const int C = 8, OC = 8; /* OC = C: the residual may be the matmul's input (RF_SELF) */
    int64_t sx[3] = {2, 3, C}, sw[2] = {OC, C}, sb[1] = {OC};
    c->x = tg_f(&c->t, "x", 3, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    c->w = tg_f(&c->t, "w", 2, sw, DG_NF_PARAM, -1, 1);
    c->b = tg_f(&c->t, "b", 1, sb, DG_NF_PARAM, -1, 1);
    c->z = tg_f(&c->t, "z", 3, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    /* an arena residual whose storage dies at the add: the inplace pass may reuse it */
    c->r = (how & RF_SELF) ? c->x : dg_op_gelu(c->t.g, "r", c->z);
    dg_node_t *mm = dg_op_matmul(c->t.g, "proj", c->x, c->w, c->b), *p = mm;
    if (how & RF_MM_OUT) mm->flags |= DG_NF_OUTPUT;
    if (how & RF_ALLREDUCE) p = dg_op_all_reduce_mode(c->t.g, "tp_out", mm, DG_MESH_TP, DG_AR_TO_REPLICATE);
    dg_node_t *y = (how & RF_SWAP) ? dg_op_add(c->t.g, "res", p, c->r) : dg_op_add(c->t.g, "res", c->r, p);
    dg_node_t *act = (how & RF_SECOND_READER) ? dg_op_gelu(c->t.g, "act", mm) : NULL;
    OK(dg_graph_error(c->t.g));
    (void)y;
    if (how & RF_FUSE) {
        dg_pass_t fuse[] = {{"fuse_residual", dg_pass_fuse_residual, &c->fr}};
        OK(dg_graph_run_passes(c->t.g, fuse, 1));
    }
    for (int i = 0; i < c->t.g->n; i++) /* the add, or the op that took its place and name */
        if (strcmp(c->t.g->nodes[i]->name, "res") == 0) c->y = c->t.g->nodes[i];
    int64_t sy[3] = {2, 3, OC};
    dg_node_t *outs[2] = {c->y, act};
    dg_node_t *seeds[2] = {tg_f(&c->t, "dy", 3, sy, DG_NF_INPUT, -1, 1),
                           act ? tg_f(&c->t, "dact", 3, sy, DG_NF_INPUT, -1, 1) : NULL};
    tg_finish(&c->t, act ? 2 : 1, outs, seeds);
}

static int res_same(res_graph_t *a, res_graph_t *b, const dg_node_t *na, const dg_node_t *nb,
                    const char *what) {
    return same_bits("fuse_residual", &a->t, &b->t, na, nb, what);
}

static int fwd_count(tg_t *t, dg_op_kind_t k) {
    int c = 0;
    for (int i = 0; i < t->g->n; i++)
        c += t->g->nodes[i]->op == k && t->g->nodes[i]->phase == DG_PHASE_FWD;
    return c;
}

void case_fuse_residual(dg_backend_t *be) {
    int f0 = dg_fails;
    for (int swap = 0; swap < 2; swap++) {
        res_graph_t u, f;
        res_build(&u, be, swap ? RF_SWAP : 0);
        res_build(&f, be, RF_FUSE | (swap ? RF_SWAP : 0));
        EXPECT(f.fr.n_fused == 1 && fwd_count(&f.t, DG_OP_MATMUL_RES) == 1 &&
                   fwd_count(&f.t, DG_OP_MATMUL) == 0 && fwd_count(&f.t, DG_OP_ADD) == 0 &&
                   fwd_count(&u.t, DG_OP_ADD) == 1,
               "fuse_residual (%s): %d fused, %d matmul_res / %d matmul / %d add in the forward",
               swap ? "add(p, r)" : "add(r, p)", f.fr.n_fused, fwd_count(&f.t, DG_OP_MATMUL_RES),
               fwd_count(&f.t, DG_OP_MATMUL), fwd_count(&f.t, DG_OP_ADD));
        EXPECT(
            f.y && f.y->op == DG_OP_MATMUL_RES && f.y->src[2] == f.r && f.y->view_src == f.r &&
                (f.y->flags & DG_NF_OUTPUT),
            "fuse_residual: the add's name must be the fused op's, an output, over the residual's storage");
        /* the backward: the same op kinds in the same order */
        int ub, ue, fb, fe;
        dg_graph_phase_range(u.t.g, DG_PHASE_BWD, &ub, &ue);
        dg_graph_phase_range(f.t.g, DG_PHASE_BWD, &fb, &fe);
        int same_bwd = ue - ub == fe - fb && ue > ub;
        for (int i = 0; same_bwd && i < ue - ub; i++)
            same_bwd = u.t.g->nodes[ub + i]->op == f.t.g->nodes[fb + i]->op;
        EXPECT(same_bwd, "fuse_residual: the backward differs from the unfused pair's (%d vs %d ops)",
               fe - fb, ue - ub);
        for (int run = 0; run < 2; run++) { /* two runs: the weight gradients accumulate */
            tg_run2(&u.t, &f.t, DG_PHASE_FWD);
            res_same(&u, &f, u.y, f.y, "the output");
            tg_run2(&u.t, &f.t, DG_PHASE_BWD);
            res_same(&u, &f, dg_node_grad_of(u.x), dg_node_grad_of(f.x), "the input gradient");
            res_same(&u, &f, dg_node_grad_of(u.z), dg_node_grad_of(f.z),
                     "the residual's (gelu input's) gradient");
            res_same(&u, &f, u.w->grad, f.w->grad, "the accumulated weight gradient");
            res_same(&u, &f, u.b->grad, f.b->grad, "the accumulated bias gradient");
        }
        tg_cover(&f.t, f0);
        tg_free(&u.t);
        tg_free(&f.t);
    }

    /* refusals */
    const int refuse[4] = {RF_FUSE | RF_SECOND_READER, RF_FUSE | RF_MM_OUT, RF_FUSE | RF_ALLREDUCE,
                           RF_FUSE | RF_SELF};
    const char *why[4] = {"the product has another reader", "the product is an output",
                          "an all-reduce sits between the matmul and the add",
                          "the residual is the matmul's input"};
    for (int k = 0; k < 4; k++) {
        res_graph_t f;
        res_build(&f, be, refuse[k]);
        EXPECT(f.fr.n_fused == 0 && fwd_count(&f.t, DG_OP_MATMUL_RES) == 0 &&
                   fwd_count(&f.t, DG_OP_MATMUL) == 1 && fwd_count(&f.t, DG_OP_ADD) == 1,
               "fuse_residual must keep the pair when %s", why[k]);
        tg_free(&f.t);
    }
    dg_backend_ops_t ops = *be->ops;
    ops.matmul_fwd_res = NULL;
    dg_backend_t nofuse = *be;
    nofuse.ops = &ops;
    res_graph_t f;
    res_build(&f, &nofuse, RF_FUSE);
    EXPECT(f.fr.n_fused == 0 && fwd_count(&f.t, DG_OP_MATMUL_RES) == 0 && fwd_count(&f.t, DG_OP_ADD) == 1,
           "fuse_residual must keep the pair on a backend without matmul_fwd_res");
    tg_free(&f.t);
}

/* The end of a fan-out objective: sum(dout * gelu(s)) over the branches' sum s[0..n) (malloc'd, freed) */
static double fanout_obj_end(double *s, const ctx_t *c, size_t n) {
    double v = dot_gelu(s, c->dout, n);
    free(s);
    return v;
}

/* A tensor with many consumers (I): later contributions accumulate in place (acc = 1 kernels) and
 * through ACCUMULATE when the first gradient storage is still needed. */
static double obj_fanout1(void *p) {
    ctx_t *c = p;
    int N = c->d[0], C = c->d[1];
    size_t n = (size_t)N * C;
    double *a = malloc(3 * n * sizeof *a), *b = a + n, *m = b + n; /* one block: fanout_obj_end frees it */
    ref_gelu(a, c->in[0], n);
    ref_layernorm(b, c->in[0], c->in[2], c->in[3], N, C);
    ref_matmul(m, c->in[0], c->in[1], NULL, N, C, C);
    for (size_t i = 0; i < n; i++)
        a[i] = a[i] + b[i] + m[i] + c->in[0][i];
    return fanout_obj_end(a, c, n);
}

/* The fan-out cases' output: y = gelu(s), seeded by a dout leaf shaped like x (ndim, sx); then the graph
 * is finished. Returns dout. */
static dg_node_t *fanout_out(tg_t *t, dg_node_t *s, int ndim, const int64_t *sx) {
    dg_node_t *y = dg_op_gelu(t->g, "y", s);
    dg_node_t *dout = tg_f(t, "dout", ndim, sx, DG_NF_INPUT, -1, 1);
    tg_finish(t, 1, &y, &dout);
    return dout;
}

void case_fanout1(tg_t *t, int f0) {
    int N = 8, C = 8;
    int64_t sx[3] = {2, 4, C}, sw[2] = {C, C}, sc[1] = {C};
    dg_node_t *x = tg_f(t, "x", 3, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    dg_node_t *w = tg_f(t, "w", 2, sw, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *lw = tg_f(t, "lnw", 1, sc, DG_NF_PARAM, 0.5, 1.5);
    dg_node_t *lb = tg_f(t, "lnb", 1, sc, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *a = dg_op_gelu(t->g, "a", x);
    dg_node_t *b = dg_op_layernorm(t->g, "b", x, lw, lb);
    dg_node_t *m = dg_op_matmul(t->g, "m", x, w, NULL);
    dg_node_t *s1 = dg_op_add(t->g, "s1", a, b);
    dg_node_t *s2 = dg_op_add(t->g, "s2", s1, m);
    dg_node_t *dout = fanout_out(t, dg_op_add(t->g, "s3", s2, x), 3, sx);
    EXPECT(tg_count(t, DG_OP_ACCUMULATE, -1) >= 1, "fanout1: expected an ACCUMULATE in the backward");
    EXPECT(tg_count(t, DG_OP_LAYERNORM_BWD, 1) == 1 && tg_count(t, DG_OP_GELU_BWD, 1) == 1,
           "fanout1: expected in-place (acc=1) layernorm_bwd and gelu_bwd");
    tg_run(t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(t, x), tg_d(t, w), tg_d(t, lw), tg_d(t, lb)}, .dout = tg_d(t, dout), .d = {N, C}};
    tg_check_grads(t, f0, "fanout1", 4, (dg_node_t *[4]){x, w, lw, lb},
                   (const char *[4]){"d/dx", "d/dw", "d/dlnw", "d/dlnb"}, (const size_t[4]){64, 64, 8, 8}, &c,
                   obj_fanout1, 0);
}

/* A tensor with many consumers (II): x + x (gradient storage shared, so the sum needs an extra add),
 * then matmul backward accumulating in place. */
static double obj_fanout2(void *p) {
    ctx_t *c = p;
    int N = c->d[0], C = c->d[1];
    size_t n = (size_t)N * C;
    double *m1 = malloc(n * sizeof *m1), *m2 = malloc(n * sizeof *m2);
    ref_matmul(m1, c->in[0], c->in[1], c->in[2], N, C, C);
    ref_matmul(m2, c->in[0], c->in[3], NULL, N, C, C);
    for (size_t i = 0; i < n; i++)
        m1[i] = m1[i] + m2[i] + 2.0 * c->in[0][i];
    free(m2);
    return fanout_obj_end(m1, c, n);
}

void case_fanout2(tg_t *t, int f0) {
    int N = 6, C = 8;
    int64_t sx[2] = {N, C}, sw[2] = {C, C}, sc[1] = {C};
    dg_node_t *x = tg_f(t, "x", 2, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    dg_node_t *w1 = tg_f(t, "w1", 2, sw, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *b1 = tg_f(t, "b1", 1, sc, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *w2 = tg_f(t, "w2", 2, sw, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *m1 = dg_op_matmul(t->g, "m1", x, w1, b1);
    dg_node_t *m2 = dg_op_matmul(t->g, "m2", x, w2, NULL);
    dg_node_t *e = dg_op_add(t->g, "e", x, x);
    dg_node_t *s1 = dg_op_add(t->g, "s1", m1, m2);
    dg_node_t *dout = fanout_out(t, dg_op_add(t->g, "s2", s1, e), 2, sx);
    int bwd_adds = 0;
    for (int i = 0; i < t->g->n; i++)
        bwd_adds += t->g->nodes[i]->op == DG_OP_ADD && t->g->nodes[i]->phase == DG_PHASE_BWD;
    EXPECT(bwd_adds == 1, "fanout2: expected one gradient-sum add in the backward, found %d", bwd_adds);
    EXPECT(tg_count(t, DG_OP_MATMUL_BWD, 1) == 2, "fanout2: expected both matmul_bwd to accumulate in place");
    tg_run(t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(t, x), tg_d(t, w1), tg_d(t, b1), tg_d(t, w2)}, .dout = tg_d(t, dout), .d = {N, C}};
    tg_check_grads(t, f0, "fanout2", 4, (dg_node_t *[4]){x, w1, b1, w2},
                   (const char *[4]){"d/dx", "d/dw1", "d/db1", "d/dw2"}, (const size_t[4]){48, 64, 8, 64}, &c,
                   obj_fanout2, 3);
}
