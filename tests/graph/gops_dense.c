/* gops_dense.c — test_graph_ops cases of the dense ops: encoder, layernorm, matmul (with bias, without,
 * with GELU), GELU, the MLP (saved and recomputed), GELU accumulation, attention and add. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gops.h"

/* encoder */
static double obj_encoder(void *p) {
    ctx_t *c = p;
    int B = c->d[0], T = c->d[1], C = c->d[2];
    size_t n = (size_t)B * T * C;
    double *y = malloc(n * sizeof *y);
    ref_encoder(y, c->tok, c->in[0], c->in[1], B, T, C);
    double s = dot(y, c->dout, n);
    free(y);
    return s;
}

void case_encoder(tg_t *t, int f0) {
    int B = 2, T = 5, C = 6, Vp = 11;
    int64_t sbt[2] = {B, T}, swte[2] = {Vp, C}, swpe[2] = {7, C}, sy[3] = {B, T, C};
    dg_node_t *tok = tg_i(t, "tokens", 2, sbt, 9); /* rows 9, 10 are never looked up */
    dg_node_t *wte = tg_f(t, "wte", 2, swte, DG_NF_PARAM, -1, 1);
    dg_node_t *wpe = tg_f(t, "wpe", 2, swpe, DG_NF_PARAM, -1, 1);
    dg_node_t *y = dg_op_encoder(t->g, "enc", tok, wte, wpe);
    dg_node_t *dout = tg_f(t, "dout", 3, sy, DG_NF_INPUT, -1, 1);
    tg_finish(t, 1, &y, &dout);
    tg_run(t, DG_PHASE_FWD);
    ctx_t c = {
        .in = {tg_d(t, wte), tg_d(t, wpe)}, .tok = tg_leaf(t, tok)->i, .dout = tg_d(t, dout), .d = {B, T, C}};
    size_t n = (size_t)B * T * C;
    double *yr = malloc(n * sizeof *yr);
    ref_encoder(yr, c.tok, c.in[0], c.in[1], B, T, C);
    float *yg = tg_get(t, y);
    check_close("encoder forward", yg, yr, n, 1e-5);
    tg_run(t, DG_PHASE_BWD);
    float *gw = tg_get(t, wte->grad), *gp = tg_get(t, wpe->grad);
    check_fd("encoder d/dwte", c.in[0], (size_t)Vp * C, gw, obj_encoder, &c);
    check_fd("encoder d/dwpe", c.in[1], (size_t)7 * C, gp, obj_encoder, &c);
    dg_node_t *par[2] = {wte, wpe};
    float *g1[2] = {gw, gp};
    check_accumulation(t, 2, par, g1, 0, NULL, NULL);
    tg_cover(t, f0);
    free(yr), free(yg), free(gw), free(gp), free(c.in[0]), free(c.in[1]), free(c.dout);
}

/* layernorm */
static double obj_layernorm(void *p) {
    ctx_t *c = p;
    int N = c->d[0], C = c->d[1];
    double *y = malloc((size_t)N * C * sizeof *y);
    ref_layernorm(y, c->in[0], c->in[1], c->in[2], N, C);
    double s = dot(y, c->dout, (size_t)N * C);
    free(y);
    return s;
}

void case_layernorm(tg_t *t, int f0) {
    int64_t sx[3] = {2, 3, 8}, sc[1] = {8};
    dg_node_t *x = tg_f(t, "x", 3, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -2, 2);
    dg_node_t *w = tg_f(t, "w", 1, sc, DG_NF_PARAM, 0.5, 1.5);
    dg_node_t *b = tg_f(t, "b", 1, sc, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *y = dg_op_layernorm(t->g, "ln", x, w, b);
    dg_node_t *dout = tg_f(t, "dout", 3, sx, DG_NF_INPUT, -1, 1);
    tg_finish(t, 1, &y, &dout);
    tg_run(t, DG_PHASE_FWD);
    int N = 6, C = 8;
    ctx_t c = {.in = {tg_d(t, x), tg_d(t, w), tg_d(t, b)}, .dout = tg_d(t, dout), .d = {N, C}};
    double yr[48];
    ref_layernorm(yr, c.in[0], c.in[1], c.in[2], N, C);
    float *yg = tg_get(t, y);
    check_close("layernorm forward", yg, yr, 48, 1e-5);
    tg_check_xwb(t, f0, "layernorm", "d/db", x, w, b, &c, (const size_t[3]){48, 8, 8}, obj_layernorm, 1);
    free(yg);
}

/* The linear layer's objective: sum(dout * y), y = x . w^T + bias (in[0..2], bias may be NULL) of N x C
 * into OC (d[0..2]); with d[3], y is the GELU of that (the matmul with the GELU epilogue) */
static double obj_matmul(void *p) {
    ctx_t *c = p;
    int N = c->d[0], C = c->d[1], OC = c->d[2];
    size_t n = (size_t)N * OC;
    double *y = malloc(n * sizeof *y);
    ref_matmul(y, c->in[0], c->in[1], c->in[2], N, C, OC);
    double s = c->d[3] ? dot_gelu(y, c->dout, n) : dot(y, c->dout, n);
    free(y);
    return s;
}

/* A linear layer "fc" of x (2, 3, C) into (2, 3, OC), its leaves drawn in [-1, 1) in this order: x (wants
 * a gradient), the weight w (OC, C) and the bias b (OC). Returns the matmul node. */
static dg_node_t *linear_fc(tg_t *t, int C, int OC, dg_node_t **x, dg_node_t **w, dg_node_t **b) {
    int64_t sx[3] = {2, 3, C}, sw[2] = {OC, C}, sb[1] = {OC};
    *x = tg_f(t, "x", 3, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    *w = tg_f(t, "w", 2, sw, DG_NF_PARAM, -1, 1);
    *b = tg_f(t, "b", 1, sb, DG_NF_PARAM, -1, 1);
    return dg_op_matmul(t->g, "fc", *x, *w, *b);
}

/* A seed gradient leaf "dout" shaped like n, in [-1, 1) */
static dg_node_t *dout_like(tg_t *t, const dg_node_t *n) {
    return tg_f(t, "dout", n->ndim, n->shape, DG_NF_INPUT, -1, 1);
}

/* matmul, with bias and input gradient */
void case_matmul(tg_t *t, int f0) {
    int N = 6, C = 8, OC = 5;
    dg_node_t *x, *w, *b, *y = linear_fc(t, C, OC, &x, &w, &b);
    dg_node_t *dout = dout_like(t, y);
    tg_finish(t, 1, &y, &dout);
    tg_run(t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(t, x), tg_d(t, w), tg_d(t, b)}, .dout = tg_d(t, dout), .d = {N, C, OC}};
    double yr[30];
    ref_matmul(yr, c.in[0], c.in[1], c.in[2], N, C, OC);
    float *yg = tg_get(t, y);
    check_close("matmul forward", yg, yr, 30, 1e-5);
    tg_check_xwb(t, f0, "matmul", "d/dbias", x, w, b, &c, (const size_t[3]){48, 40, 5}, obj_matmul, 1);
    free(yg);
}

/* matmul without bias on an input that needs no gradient: the backward computes dW only */
void case_matmul_nobias(tg_t *t, int f0) {
    int N = 4, C = 8, OC = 6;
    int64_t sx[2] = {N, C}, sw[2] = {OC, C}, sy[2] = {N, OC};
    dg_node_t *x = tg_f(t, "x", 2, sx, DG_NF_INPUT, -1, 1);
    dg_node_t *w = tg_f(t, "w", 2, sw, DG_NF_PARAM, -1, 1);
    dg_node_t *y = dg_op_matmul(t->g, "fc", x, w, NULL);
    dg_node_t *dout = tg_f(t, "dout", 2, sy, DG_NF_INPUT, -1, 1);
    tg_finish(t, 1, &y, &dout);
    int nodinp = 0;
    for (int i = 0; i < t->g->n; i++)
        if (t->g->nodes[i]->op == DG_OP_MATMUL_BWD && t->g->nodes[i]->attr[DG_A_NO_DINP] &&
            t->g->nodes[i]->storage == DG_STORE_NONE)
            nodinp++;
    EXPECT(nodinp == 1, "matmul_bwd without input gradient expected, found %d", nodinp);
    tg_run(t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(t, x), tg_d(t, w), NULL}, .dout = tg_d(t, dout), .d = {N, C, OC}};
    double yr[24];
    ref_matmul(yr, c.in[0], c.in[1], NULL, N, C, OC);
    float *yg = tg_get(t, y);
    check_close("matmul (no bias) forward", yg, yr, 24, 1e-5);
    tg_run(t, DG_PHASE_BWD);
    float *gw = tg_get(t, w->grad);
    check_fd("matmul (no bias) d/dw", c.in[1], 48, gw, obj_matmul, &c);
    EXPECT(dg_node_grad_of(x) == NULL, "an input without DG_NF_WANT_GRAD got a gradient");
    tg_cover(t, f0);
    free(yg), free(gw), free(c.in[0]), free(c.in[1]), free(c.dout);
}

/* matmul + gelu fused by the fuse_gelu pass into one matmul with the GELU epilogue */
void case_matmul_gelu(tg_t *t, int f0) {
    int N = 6, C = 8, OC = 12;
    dg_node_t *x, *w, *b;
    dg_op_gelu(t->g, "gelu", linear_fc(t, C, OC, &x, &w, &b));
    dg_pass_t fuse[] = {{"fuse_gelu", dg_pass_fuse_gelu, NULL}};
    OK(dg_graph_run_passes(t->g, fuse, 1));
    dg_node_t *y = NULL;
    for (int i = 0; i < t->g->n; i++)
        if (t->g->nodes[i]->op == DG_OP_MATMUL) y = t->g->nodes[i];
    EXPECT(tg_count(t, DG_OP_GELU, -1) == 0 && y && y->attr[DG_A_EPI] == DG_EPI_GELU && y->n_side == 1,
           "matmul_gelu: the pass should fuse gelu into the matmul");
    if (!y) return;
    dg_node_t *dout = dout_like(t, y);
    tg_finish(t, 1, &y, &dout);
    tg_run(t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(t, x), tg_d(t, w), tg_d(t, b)}, .dout = tg_d(t, dout), .d = {N, C, OC, 1}};
    double pre[72], yr[72];
    ref_matmul(pre, c.in[0], c.in[1], c.in[2], N, C, OC);
    ref_gelu(yr, pre, 72);
    float *yg = tg_get(t, y), *pg = tg_get(t, y->side[0]);
    check_close("matmul+gelu forward", yg, yr, 72, 1e-5);
    check_close("matmul+gelu pre-activation", pg, pre, 72, 1e-5);
    tg_check_xwb(t, f0, "matmul+gelu", "d/dbias", x, w, b, &c, (const size_t[3]){48, 96, 12}, obj_matmul, 0);
    free(yg), free(pg);
}

/* The MLP: fc with the GELU epilogue, then proj. After autodiff, fuse_gelu_bwd turns proj's matmul_bwd +
 * fc's gelu_bwd into one matmul_bwd_dgelu; with `recompute`, recompute_gelu feeds proj's backward from a
 * GELU op in the backward instead of the forward's GELU output. Finite differences through everything. */
static double obj_mlp(void *p) {
    ctx_t *c = p;
    int N = c->d[0], C = c->d[1], H = c->d[2];
    double *a = malloc((size_t)N * H * sizeof *a), *y = malloc((size_t)N * C * sizeof *y);
    ref_matmul(a, c->in[0], c->in[1], c->in[2], N, C, H);
    ref_gelu(a, a, (size_t)N * H);
    ref_matmul(y, a, c->in[3], c->in[4], N, H, C);
    double s = dot(y, c->dout, (size_t)N * C);
    free(a), free(y);
    return s;
}

static void case_mlp(tg_t *t, int f0, int recompute) {
    int N = 6, C = 8, H = 16;
    int64_t sx[3] = {2, 3, C}, s1[2] = {H, C}, sb1[1] = {H}, s2[2] = {C, H}, sb2[1] = {C};
    dg_node_t *x = tg_f(t, "x", 3, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    dg_node_t *w1 = tg_f(t, "w1", 2, s1, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *b1 = tg_f(t, "b1", 1, sb1, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *w2 = tg_f(t, "w2", 2, s2, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *b2 = tg_f(t, "b2", 1, sb2, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *h = dg_op_gelu(t->g, "gelu", dg_op_matmul(t->g, "fc", x, w1, b1));
    dg_node_t *y = dg_op_matmul(t->g, "proj", h, w2, b2);
    dg_node_t *dout = tg_f(t, "dout", 3, sx, DG_NF_INPUT, -1, 1);
    OK(dg_graph_error(t->g));
    dg_pass_t fuse[] = {{"fuse_gelu", dg_pass_fuse_gelu, NULL}};
    OK(dg_graph_run_passes(t->g, fuse, 1));
    OK(dg_autodiff(t->g, 1, &y, &dout));
    dg_pass_t post[] = {{"fuse_gelu_bwd", dg_pass_fuse_gelu_bwd, NULL},
                        {"recompute_gelu", dg_pass_recompute_gelu, NULL}};
    OK(dg_graph_run_passes(t->g, post, recompute ? 2 : 1));
    EXPECT(tg_count(t, DG_OP_MATMUL_BWD_DGELU, 0) == 1 && tg_count(t, DG_OP_GELU_BWD, -1) == 0,
           "mlp: expected one matmul_bwd_dgelu and no gelu_bwd");
    EXPECT(tg_count(t, DG_OP_GELU, -1) == (recompute ? 1 : 0), "mlp: %d gelu ops (recompute %d)",
           tg_count(t, DG_OP_GELU, -1), recompute);
    tg_finish(t, 0, NULL, NULL);
    /* the inplace pass lets dpre take over the storage of the GELU output (or of its recomputed copy) */
    int aliased = 0;
    for (int i = 0; i < t->g->n; i++)
        if (t->g->nodes[i]->op == DG_OP_MATMUL_BWD_DGELU)
            aliased = t->g->nodes[i]->view_src == t->g->nodes[i]->src[1];
    EXPECT(aliased, "mlp: dpre should alias the GELU output it replaces");
    tg_run(t, DG_PHASE_FWD);
    tg_run(t, DG_PHASE_BWD);
    ctx_t c = {.in = {tg_d(t, x), tg_d(t, w1), tg_d(t, b1), tg_d(t, w2), tg_d(t, b2)},
               .dout = tg_d(t, dout),
               .d = {N, C, H}};
    float *g[5] = {tg_get(t, dg_node_grad_of(x)), tg_get(t, w1->grad), tg_get(t, b1->grad),
                   tg_get(t, w2->grad), tg_get(t, b2->grad)};
    const char *nm[5] = {"mlp d/dx", "mlp d/dw1", "mlp d/db1", "mlp d/dw2", "mlp d/db2"};
    size_t n[5] = {(size_t)N * C, (size_t)H * C, (size_t)H, (size_t)C * H, (size_t)C};
    for (int k = 0; k < 5; k++)
        check_fd(nm[k], c.in[k], n[k], g[k], obj_mlp, &c);
    dg_node_t *par[4] = {w1, b1, w2, b2}, *act[1] = {x};
    float *a1[1] = {g[0]};
    check_accumulation(t, 4, par, g + 1, 1, act, a1);
    tg_cover(t, f0);
    for (int k = 0; k < 5; k++)
        free(g[k]), free(c.in[k]);
    free(c.dout);
}
void case_mlp_saved(tg_t *t, int f0) {
    case_mlp(t, f0, 0);
}
void case_mlp_recompute(tg_t *t, int f0) {
    case_mlp(t, f0, 1);
}

/* A standalone gelu of an input whose gradient already has a contribution: the fused op accumulates
 * (acc = 1) into it, and the input's gradient (read back) is the fused op's output. */
static double obj_gelu_acc(void *p) {
    ctx_t *c = p;
    int N = c->d[0], C = c->d[1];
    size_t n = (size_t)N * C;
    double *a = malloc(n * sizeof *a), *y = malloc(n * sizeof *y), *z = malloc(n * sizeof *z);
    ref_gelu(a, c->in[0], n);
    ref_matmul(y, a, c->in[1], NULL, N, C, C);
    ref_matmul(z, c->in[0], c->in[2], NULL, N, C, C);
    double s = dot(y, c->dout, n) + dot(z, c->dout, n);
    free(a), free(y), free(z);
    return s;
}

void case_gelu_acc(tg_t *t, int f0) {
    int N = 6, C = 8;
    int64_t sx[2] = {N, C}, sw[2] = {C, C};
    dg_node_t *x = tg_f(t, "x", 2, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -2, 2);
    dg_node_t *w = tg_f(t, "w", 2, sw, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *w3 = tg_f(t, "w3", 2, sw, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *y1 = dg_op_matmul(t->g, "y1", dg_op_gelu(t->g, "gelu", x), w, NULL);
    dg_node_t *y2 = dg_op_matmul(t->g, "y2", x, w3, NULL);
    dg_node_t *y = dg_op_add(t->g, "y", y1, y2);
    dg_node_t *dout = tg_f(t, "dout", 2, sx, DG_NF_INPUT, -1, 1);
    OK(dg_graph_error(t->g));
    OK(dg_autodiff(t->g, 1, &y, &dout));
    dg_pass_t post[] = {{"fuse_gelu_bwd", dg_pass_fuse_gelu_bwd, NULL}};
    OK(dg_graph_run_passes(t->g, post, 1));
    EXPECT(tg_count(t, DG_OP_MATMUL_BWD_DGELU, 1) == 1 && tg_count(t, DG_OP_GELU_BWD, -1) == 0,
           "gelu_acc: expected one matmul_bwd_dgelu with acc = 1");
    EXPECT(dg_node_grad_of(x) && dg_node_grad_of(x)->op == DG_OP_MATMUL_BWD_DGELU,
           "gelu_acc: x's gradient should be the fused op's output");
    tg_finish(t, 0, NULL, NULL);
    tg_run(t, DG_PHASE_FWD);
    tg_run(t, DG_PHASE_BWD);
    ctx_t c = {.in = {tg_d(t, x), tg_d(t, w), tg_d(t, w3)}, .dout = tg_d(t, dout), .d = {N, C}};
    float *gx = tg_get(t, dg_node_grad_of(x)), *gw = tg_get(t, w->grad), *gw3 = tg_get(t, w3->grad);
    check_fd("gelu_acc d/dx", c.in[0], (size_t)N * C, gx, obj_gelu_acc, &c);
    check_fd("gelu_acc d/dw", c.in[1], (size_t)C * C, gw, obj_gelu_acc, &c);
    check_fd("gelu_acc d/dw3", c.in[2], (size_t)C * C, gw3, obj_gelu_acc, &c);
    tg_cover(t, f0);
    free(gx), free(gw), free(gw3), free(c.in[0]), free(c.in[1]), free(c.in[2]), free(c.dout);
}

/* gelu (objective: obj_gelu, gops_harness.c) */

void case_gelu(tg_t *t, int f0) {
    int64_t sx[2] = {3, 7};
    dg_node_t *x = tg_f(t, "x", 2, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -3, 3);
    dg_node_t *y = dg_op_gelu(t->g, "gelu", x);
    dg_node_t *dout = tg_f(t, "dout", 2, sx, DG_NF_INPUT, -1, 1);
    tg_finish(t, 1, &y, &dout);
    tg_run(t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(t, x)}, .dout = tg_d(t, dout), .d = {21}};
    double yr[21];
    ref_gelu(yr, c.in[0], 21);
    float *yg = tg_get(t, y);
    check_close("gelu forward", yg, yr, 21, 1e-5);
    tg_run(t, DG_PHASE_BWD);
    float *gx = tg_get(t, dg_node_grad_of(x));
    check_fd("gelu d/dx", c.in[0], 21, gx, obj_gelu, &c);
    dg_node_t *act[1] = {x};
    float *a1[1] = {gx};
    check_accumulation(t, 0, NULL, NULL, 1, act, a1);
    tg_cover(t, f0);
    free(yg), free(gx), free(c.in[0]), free(c.dout);
}

/* causal self-attention */
static double obj_attention(void *p) {
    ctx_t *c = p;
    int B = c->d[0], T = c->d[1], C = c->d[2], NH = c->d[3];
    size_t n = (size_t)B * T * C;
    double *y = malloc(n * sizeof *y);
    ref_attention(y, c->in[0], B, T, C, NH);
    double s = dot(y, c->dout, n);
    free(y);
    return s;
}

void case_attention(tg_t *t, int f0) {
    int B = 2, T = 5, C = 12, NH = 3;
    int64_t sq[3] = {B, T, 3 * C}, sy[3] = {B, T, C};
    dg_node_t *qkv = tg_f(t, "qkv", 3, sq, DG_NF_INPUT | DG_NF_WANT_GRAD, -1.5, 1.5);
    dg_node_t *y = dg_op_attention(t->g, "attn", qkv, NH);
    dg_node_t *dout = tg_f(t, "dout", 3, sy, DG_NF_INPUT, -1, 1);
    tg_finish(t, 1, &y, &dout);
    tg_run(t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(t, qkv)}, .dout = tg_d(t, dout), .d = {B, T, C, NH}};
    size_t n = (size_t)B * T * C;
    double *yr = malloc(n * sizeof *yr);
    ref_attention(yr, c.in[0], B, T, C, NH);
    float *yg = tg_get(t, y);
    check_close("attention forward", yg, yr, n, 1e-5);
    tg_run(t, DG_PHASE_BWD);
    float *gq = tg_get(t, dg_node_grad_of(qkv));
    check_fd("attention d/dqkv", c.in[0], 3 * n, gq, obj_attention, &c);
    dg_node_t *act[1] = {qkv};
    float *a1[1] = {gq};
    check_accumulation(t, 0, NULL, NULL, 1, act, a1);
    tg_cover(t, f0);
    free(yr), free(yg), free(gq), free(c.in[0]), free(c.dout);
}

/* residual add: both inputs receive the output gradient */
static double obj_add(void *p) {
    ctx_t *c = p;
    size_t n = (size_t)c->d[0];
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += (c->in[0][i] + c->in[1][i]) * c->dout[i];
    return s;
}

void case_add(tg_t *t, int f0) {
    int64_t sx[2] = {3, 4};
    dg_node_t *a = tg_f(t, "a", 2, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    dg_node_t *b = tg_f(t, "b", 2, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    dg_node_t *y = dg_op_add(t->g, "add", a, b);
    dg_node_t *dout = tg_f(t, "dout", 2, sx, DG_NF_INPUT, -1, 1);
    tg_finish(t, 1, &y, &dout);
    tg_run(t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(t, a), tg_d(t, b)}, .dout = tg_d(t, dout), .d = {12}};
    double yr[12];
    for (int i = 0; i < 12; i++)
        yr[i] = c.in[0][i] + c.in[1][i];
    float *yg = tg_get(t, y);
    check_close("add forward", yg, yr, 12, 1e-6);
    tg_run(t, DG_PHASE_BWD);
    float *ga = tg_get(t, dg_node_grad_of(a)), *gb = tg_get(t, dg_node_grad_of(b));
    check_fd("add d/da", c.in[0], 12, ga, obj_add, &c);
    check_fd("add d/db", c.in[1], 12, gb, obj_add, &c);
    tg_cover(t, f0);
    free(yg), free(ga), free(gb), free(c.in[0]), free(c.in[1]), free(c.dout);
}
