/* test_graph_ops.c — every op in the graph's registry, exercised THROUGH THE GRAPH on the CPU backend:
 * forward against float64 references (ref64.c), gradients from autodiff against float64 central finite
 * differences of the reference, parameter-gradient accumulation across runs (micro-batches), gradient
 * accumulation across several consumers of a tensor (in place, via ACCUMULATE, via an extra add), the
 * optimizer ops against a float64 AdamW, and collectives' shape rules. Table-driven: the run fails if an
 * op kind of the registry was not executed by a checked case.
 *
 * Tolerances: graph values are fp32; references are float64 evaluated at the same (fp32) inputs.
 * Forward: max|got - ref| <= 1e-5 * max|ref| + 1e-6 (fp32 rounding over <= 100-term sums is ~1e-6
 * relative). Gradients: max|g - fd| <= 1e-3 * max|fd| + 1e-6, with fd the central difference of the
 * float64 objective sum(dout * out) at step 1e-5 (truncation ~1e-10); a wiring mistake gives O(1) errors.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graph.h"
#include "ref64.h"
#include "gtest.h"

static uint64_t covered; /* bit per op kind executed in a case that passed its checks */

/* ---------------- a small harness around one test graph ---------------- */

typedef struct {
    dg_node_t *n;
    float *f;
    int32_t *i;
} leaf_t;

typedef struct {
    dg_backend_t *be;
    dg_graph_t *g;
    dg_memplan_t *plan;
    dg_exec_t *ex;
    dg_alloc_list_t al;
    leaf_t leaves[32];
    int nl;
    uint64_t rng;
} tg_t;

static void tg_init(tg_t *t, dg_backend_t *be, uint64_t seed) {
    memset(t, 0, sizeof *t);
    t->be = be;
    t->g = dg_graph_create(be);
    t->rng = seed;
}

static dg_node_t *tg_f(tg_t *t, const char *name, int ndim, const int64_t *shape, unsigned flags, double lo,
                       double hi) {
    dg_node_t *n = (flags & DG_NF_PARAM) ? dg_graph_param(t->g, name, ndim, shape)
                                         : dg_graph_leaf(t->g, name, DG_F32, ndim, shape, flags);
    if (!n) {
        fprintf(stderr, "FAIL: leaf %s: %s\n", name, dg_last_error());
        exit(1);
    }
    leaf_t *l = &t->leaves[t->nl++];
    l->n = n;
    l->f = malloc(dg_node_numel(n) * sizeof(float));
    ref_fill(l->f, dg_node_numel(n), lo, hi, &t->rng);
    return n;
}

static dg_node_t *tg_i(tg_t *t, const char *name, int ndim, const int64_t *shape, int maxv) {
    dg_node_t *n = dg_graph_leaf(t->g, name, DG_I32, ndim, shape, DG_NF_INPUT);
    leaf_t *l = &t->leaves[t->nl++];
    l->n = n;
    l->i = malloc(dg_node_numel(n) * sizeof(int32_t));
    for (size_t k = 0; k < dg_node_numel(n); k++)
        l->i[k] = (int32_t)(ref_rng_next(&t->rng) % (uint64_t)maxv);
    return n;
}

static leaf_t *tg_leaf(tg_t *t, const dg_node_t *n) {
    for (int k = 0; k < t->nl; k++)
        if (t->leaves[k].n == n) return &t->leaves[k];
    return NULL;
}

static double *to_f64(const float *f, size_t n) {
    double *d = malloc(n * sizeof *d);
    for (size_t i = 0; i < n; i++)
        d[i] = f[i];
    return d;
}

static double *tg_d(tg_t *t, const dg_node_t *n) {
    return to_f64(tg_leaf(t, n)->f, dg_node_numel(n));
}

/* autodiff (when outs given) + in-place pass, plan (checked), persistent memory, uploads, executor */
static void tg_finish(tg_t *t, int nout, dg_node_t **outs, dg_node_t **seeds) {
    OK(dg_graph_error(t->g));
    if (nout) OK(dg_autodiff(t->g, nout, outs, seeds));
    dg_pass_t passes[] = {{"inplace", dg_pass_inplace, NULL}};
    OK(dg_graph_run_passes(t->g, passes, 1));
    OK(dg_plan_create(t->g, 0, &t->plan));
    OK(dg_plan_check(t->plan, t->g));
    OK(dg_graph_alloc_persistent(t->g, t->be, &t->al));
    for (int k = 0; k < t->nl; k++) {
        leaf_t *l = &t->leaves[k];
        OK(t->be->ops->to_device(t->be, l->n->data, l->f ? (void *)l->f : (void *)l->i, l->n->nbytes));
    }
    OK(dg_exec_create(t->be, t->g, t->plan, &t->ex));
}

static void tg_run(tg_t *t, dg_phase_t ph) {
    OK(dg_exec_run_phase(t->ex, ph));
    OK(t->be->ops->sync(t->be));
}

static float *tg_get(tg_t *t, const dg_node_t *n) {
    if (!n) { /* e.g. a gradient autodiff did not produce */
        fprintf(stderr, "FAIL: a tensor the test reads does not exist (missing gradient?)\n");
        exit(1);
    }
    float *h = malloc(n->nbytes);
    OK(t->be->ops->to_host(t->be, h, dg_exec_ptr(t->ex, n), n->nbytes));
    return h;
}

static void tg_cover(tg_t *t, int failures_before) {
    if (dg_fails != failures_before) return;
    for (int i = 0; i < t->g->n; i++)
        covered |= 1ull << t->g->nodes[i]->op;
}

static int tg_count(tg_t *t, dg_op_kind_t k, int acc) {
    int c = 0;
    for (int i = 0; i < t->g->n; i++)
        if (t->g->nodes[i]->op == k && (acc < 0 || t->g->nodes[i]->attr[DG_A_ACC] == acc)) c++;
    return c;
}

static void tg_free(tg_t *t) {
    dg_exec_free(t->ex);
    dg_plan_free(t->plan);
    dg_graph_free_persistent(t->be, &t->al);
    dg_graph_free(t->g);
    for (int k = 0; k < t->nl; k++) {
        free(t->leaves[k].f);
        free(t->leaves[k].i);
    }
}

/* ---------------- comparisons ---------------- */

static void check_close(const char *what, const float *got, const double *ref, size_t n, double rtol) {
    double maxref = 0, maxerr = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        if (fabs(ref[i]) > maxref) maxref = fabs(ref[i]);
        double e = fabs((double)got[i] - ref[i]);
        if (!(e <= maxerr)) { /* NaN counts as an error */
            maxerr = isnan(e) ? INFINITY : e;
            at = i;
        }
    }
    EXPECT(maxerr <= rtol * maxref + 1e-6, "%s: max error %.3g at %zu (got %.8g, ref %.8g), max |ref| %.3g",
           what, maxerr, at, (double)got[at], ref[at], maxref);
    EXPECT(maxref > 0, "%s: reference is all zero (test would be vacuous)", what);
}

typedef double (*objective_fn)(void *ctx);

/* Gradient `g` of obj w.r.t. the double array x[0..n) (which obj reads) against central differences. */
static void check_fd(const char *what, double *x, size_t n, const float *g, objective_fn obj, void *ctx) {
    double maxfd = 0, maxerr = 0;
    size_t at = 0;
    double fd_at = 0;
    for (size_t i = 0; i < n; i++) {
        double save = x[i], h = 1e-5 * fmax(1.0, fabs(save));
        x[i] = save + h;
        double lp = obj(ctx);
        x[i] = save - h;
        double lm = obj(ctx);
        x[i] = save;
        double fd = (lp - lm) / (2 * h);
        if (fabs(fd) > maxfd) maxfd = fabs(fd);
        double e = fabs(fd - (double)g[i]);
        if (!(e <= maxerr)) {
            maxerr = isnan(e) ? INFINITY : e;
            at = i;
            fd_at = fd;
        }
    }
    EXPECT(maxerr <= 1e-3 * maxfd + 1e-6,
           "%s: gradient error %.3g at %zu (graph %.8g, finite difference %.8g), "
           "max |fd| %.3g",
           what, maxerr, at, (double)g[at], fd_at, maxfd);
    EXPECT(maxfd > 0, "%s: finite-difference gradient is all zero (vacuous)", what);
}

static double dot(const double *a, const double *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* After a second forward+backward on the same data, parameter grads must be doubled (kernels accumulate
 * +=; an overwrite would leave them unchanged) up to the rounding of the extra additions, and activation
 * grads unchanged bitwise (overwritten, not accumulated). */
static void check_accumulation(tg_t *t, int n_par, dg_node_t **par, float **g1, int n_act, dg_node_t **act,
                               float **a1) {
    tg_run(t, DG_PHASE_FWD);
    tg_run(t, DG_PHASE_BWD);
    for (int k = 0; k < n_par; k++) {
        float *g2 = tg_get(t, par[k]->grad);
        size_t n = dg_node_numel(par[k]);
        double maxg = 0, maxerr = 0;
        for (size_t i = 0; i < n; i++) {
            maxg = fmax(maxg, fabs(2.0 * g1[k][i]));
            maxerr = fmax(maxerr, fabs((double)g2[i] - 2.0 * g1[k][i]));
        }
        EXPECT(maxerr <= 1e-6 * maxg && maxg > 0,
               "%s: gradient after a second micro-batch is not twice the first (max error %.3g of %.3g)",
               par[k]->name, maxerr, maxg);
        free(g2);
    }
    for (int k = 0; k < n_act; k++) {
        float *a2 = tg_get(t, act[k]->grad);
        EXPECT(memcmp(a2, a1[k], act[k]->grad->nbytes) == 0, "%s: activation gradient changed on a rerun",
               act[k]->name);
        free(a2);
    }
}

/* ---------------- cases ---------------- */

typedef struct {
    double *in[8];
    const int32_t *tok;
    double *dout;
    int d[6];
    float dloss;
} ctx_t;

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

static void case_encoder(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 11);
    int B = 2, T = 5, C = 6, Vp = 11;
    int64_t sbt[2] = {B, T}, swte[2] = {Vp, C}, swpe[2] = {7, C}, sy[3] = {B, T, C};
    dg_node_t *tok = tg_i(&t, "tokens", 2, sbt, 9); /* rows 9, 10 are never looked up */
    dg_node_t *wte = tg_f(&t, "wte", 2, swte, DG_NF_PARAM, -1, 1);
    dg_node_t *wpe = tg_f(&t, "wpe", 2, swpe, DG_NF_PARAM, -1, 1);
    dg_node_t *y = dg_op_encoder(t.g, "enc", tok, wte, wpe);
    dg_node_t *dout = tg_f(&t, "dout", 3, sy, DG_NF_INPUT, -1, 1);
    tg_finish(&t, 1, &y, &dout);
    tg_run(&t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(&t, wte), tg_d(&t, wpe)},
               .tok = tg_leaf(&t, tok)->i,
               .dout = tg_d(&t, dout),
               .d = {B, T, C}};
    size_t n = (size_t)B * T * C;
    double *yr = malloc(n * sizeof *yr);
    ref_encoder(yr, c.tok, c.in[0], c.in[1], B, T, C);
    float *yg = tg_get(&t, y);
    check_close("encoder forward", yg, yr, n, 1e-5);
    tg_run(&t, DG_PHASE_BWD);
    float *gw = tg_get(&t, wte->grad), *gp = tg_get(&t, wpe->grad);
    check_fd("encoder d/dwte", c.in[0], (size_t)Vp * C, gw, obj_encoder, &c);
    check_fd("encoder d/dwpe", c.in[1], (size_t)7 * C, gp, obj_encoder, &c);
    dg_node_t *par[2] = {wte, wpe};
    float *g1[2] = {gw, gp};
    check_accumulation(&t, 2, par, g1, 0, NULL, NULL);
    tg_cover(&t, f0);
    free(yr), free(yg), free(gw), free(gp), free(c.in[0]), free(c.in[1]), free(c.dout);
    tg_free(&t);
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

static void case_layernorm(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 12);
    int64_t sx[3] = {2, 3, 8}, sc[1] = {8};
    dg_node_t *x = tg_f(&t, "x", 3, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -2, 2);
    dg_node_t *w = tg_f(&t, "w", 1, sc, DG_NF_PARAM, 0.5, 1.5);
    dg_node_t *b = tg_f(&t, "b", 1, sc, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *y = dg_op_layernorm(t.g, "ln", x, w, b);
    dg_node_t *dout = tg_f(&t, "dout", 3, sx, DG_NF_INPUT, -1, 1);
    tg_finish(&t, 1, &y, &dout);
    tg_run(&t, DG_PHASE_FWD);
    int N = 6, C = 8;
    ctx_t c = {.in = {tg_d(&t, x), tg_d(&t, w), tg_d(&t, b)}, .dout = tg_d(&t, dout), .d = {N, C}};
    double yr[48];
    ref_layernorm(yr, c.in[0], c.in[1], c.in[2], N, C);
    float *yg = tg_get(&t, y);
    check_close("layernorm forward", yg, yr, 48, 1e-5);
    tg_run(&t, DG_PHASE_BWD);
    float *gx = tg_get(&t, dg_node_grad_of(x)), *gw = tg_get(&t, w->grad), *gb = tg_get(&t, b->grad);
    check_fd("layernorm d/dx", c.in[0], 48, gx, obj_layernorm, &c);
    check_fd("layernorm d/dw", c.in[1], 8, gw, obj_layernorm, &c);
    check_fd("layernorm d/db", c.in[2], 8, gb, obj_layernorm, &c);
    dg_node_t *par[2] = {w, b}, *act[1] = {x};
    float *g1[2] = {gw, gb}, *a1[1] = {gx};
    check_accumulation(&t, 2, par, g1, 1, act, a1);
    tg_cover(&t, f0);
    free(yg), free(gx), free(gw), free(gb), free(c.in[0]), free(c.in[1]), free(c.in[2]), free(c.dout);
    tg_free(&t);
}

/* matmul, with bias and input gradient */
static double obj_matmul(void *p) {
    ctx_t *c = p;
    int N = c->d[0], C = c->d[1], OC = c->d[2];
    double *y = malloc((size_t)N * OC * sizeof *y);
    ref_matmul(y, c->in[0], c->in[1], c->in[2], N, C, OC);
    double s = dot(y, c->dout, (size_t)N * OC);
    free(y);
    return s;
}

static void case_matmul(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 13);
    int N = 6, C = 8, OC = 5;
    int64_t sx[3] = {2, 3, C}, sw[2] = {OC, C}, sb[1] = {OC}, sy[3] = {2, 3, OC};
    dg_node_t *x = tg_f(&t, "x", 3, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    dg_node_t *w = tg_f(&t, "w", 2, sw, DG_NF_PARAM, -1, 1);
    dg_node_t *b = tg_f(&t, "b", 1, sb, DG_NF_PARAM, -1, 1);
    dg_node_t *y = dg_op_matmul(t.g, "fc", x, w, b);
    dg_node_t *dout = tg_f(&t, "dout", 3, sy, DG_NF_INPUT, -1, 1);
    tg_finish(&t, 1, &y, &dout);
    tg_run(&t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(&t, x), tg_d(&t, w), tg_d(&t, b)}, .dout = tg_d(&t, dout), .d = {N, C, OC}};
    double yr[30];
    ref_matmul(yr, c.in[0], c.in[1], c.in[2], N, C, OC);
    float *yg = tg_get(&t, y);
    check_close("matmul forward", yg, yr, 30, 1e-5);
    tg_run(&t, DG_PHASE_BWD);
    float *gx = tg_get(&t, dg_node_grad_of(x)), *gw = tg_get(&t, w->grad), *gb = tg_get(&t, b->grad);
    check_fd("matmul d/dx", c.in[0], 48, gx, obj_matmul, &c);
    check_fd("matmul d/dw", c.in[1], 40, gw, obj_matmul, &c);
    check_fd("matmul d/dbias", c.in[2], 5, gb, obj_matmul, &c);
    dg_node_t *par[2] = {w, b}, *act[1] = {x};
    float *g1[2] = {gw, gb}, *a1[1] = {gx};
    check_accumulation(&t, 2, par, g1, 1, act, a1);
    tg_cover(&t, f0);
    free(yg), free(gx), free(gw), free(gb), free(c.in[0]), free(c.in[1]), free(c.in[2]), free(c.dout);
    tg_free(&t);
}

/* matmul without bias on an input that needs no gradient: the backward computes dW only */
static void case_matmul_nobias(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 14);
    int N = 4, C = 8, OC = 6;
    int64_t sx[2] = {N, C}, sw[2] = {OC, C}, sy[2] = {N, OC};
    dg_node_t *x = tg_f(&t, "x", 2, sx, DG_NF_INPUT, -1, 1);
    dg_node_t *w = tg_f(&t, "w", 2, sw, DG_NF_PARAM, -1, 1);
    dg_node_t *y = dg_op_matmul(t.g, "fc", x, w, NULL);
    dg_node_t *dout = tg_f(&t, "dout", 2, sy, DG_NF_INPUT, -1, 1);
    tg_finish(&t, 1, &y, &dout);
    int nodinp = 0;
    for (int i = 0; i < t.g->n; i++)
        if (t.g->nodes[i]->op == DG_OP_MATMUL_BWD && t.g->nodes[i]->attr[DG_A_NO_DINP] &&
            t.g->nodes[i]->storage == DG_STORE_NONE)
            nodinp++;
    EXPECT(nodinp == 1, "matmul_bwd without input gradient expected, found %d", nodinp);
    tg_run(&t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(&t, x), tg_d(&t, w), NULL}, .dout = tg_d(&t, dout), .d = {N, C, OC}};
    double yr[24];
    ref_matmul(yr, c.in[0], c.in[1], NULL, N, C, OC);
    float *yg = tg_get(&t, y);
    check_close("matmul (no bias) forward", yg, yr, 24, 1e-5);
    tg_run(&t, DG_PHASE_BWD);
    float *gw = tg_get(&t, w->grad);
    check_fd("matmul (no bias) d/dw", c.in[1], 48, gw, obj_matmul, &c);
    EXPECT(dg_node_grad_of(x) == NULL, "an input without DG_NF_WANT_GRAD got a gradient");
    tg_cover(&t, f0);
    free(yg), free(gw), free(c.in[0]), free(c.in[1]), free(c.dout);
    tg_free(&t);
}

/* matmul + gelu fused by the fuse_gelu pass into one matmul with the GELU epilogue */
static double obj_matmul_gelu(void *p) {
    ctx_t *c = p;
    int N = c->d[0], C = c->d[1], OC = c->d[2];
    size_t n = (size_t)N * OC;
    double *y = malloc(n * sizeof *y), *z = malloc(n * sizeof *z);
    ref_matmul(y, c->in[0], c->in[1], c->in[2], N, C, OC);
    ref_gelu(z, y, n);
    double s = dot(z, c->dout, n);
    free(y), free(z);
    return s;
}

static void case_matmul_gelu(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 25);
    int N = 6, C = 8, OC = 12;
    int64_t sx[3] = {2, 3, C}, sw[2] = {OC, C}, sb[1] = {OC}, sy[3] = {2, 3, OC};
    dg_node_t *x = tg_f(&t, "x", 3, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    dg_node_t *w = tg_f(&t, "w", 2, sw, DG_NF_PARAM, -1, 1);
    dg_node_t *b = tg_f(&t, "b", 1, sb, DG_NF_PARAM, -1, 1);
    dg_node_t *m = dg_op_matmul(t.g, "fc", x, w, b);
    dg_node_t *y0 = dg_op_gelu(t.g, "gelu", m);
    (void)y0;
    dg_pass_t fuse[] = {{"fuse_gelu", dg_pass_fuse_gelu, NULL}};
    OK(dg_graph_run_passes(t.g, fuse, 1));
    dg_node_t *y = NULL;
    for (int i = 0; i < t.g->n; i++)
        if (t.g->nodes[i]->op == DG_OP_MATMUL) y = t.g->nodes[i];
    EXPECT(tg_count(&t, DG_OP_GELU, -1) == 0 && y && y->attr[DG_A_EPI] == DG_EPI_GELU && y->n_side == 1,
           "matmul_gelu: the pass should fuse gelu into the matmul");
    if (!y) return;
    dg_node_t *dout = tg_f(&t, "dout", 3, sy, DG_NF_INPUT, -1, 1);
    tg_finish(&t, 1, &y, &dout);
    tg_run(&t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(&t, x), tg_d(&t, w), tg_d(&t, b)}, .dout = tg_d(&t, dout), .d = {N, C, OC}};
    double pre[72], yr[72];
    ref_matmul(pre, c.in[0], c.in[1], c.in[2], N, C, OC);
    ref_gelu(yr, pre, 72);
    float *yg = tg_get(&t, y), *pg = tg_get(&t, y->side[0]);
    check_close("matmul+gelu forward", yg, yr, 72, 1e-5);
    check_close("matmul+gelu pre-activation", pg, pre, 72, 1e-5);
    tg_run(&t, DG_PHASE_BWD);
    float *gx = tg_get(&t, dg_node_grad_of(x)), *gw = tg_get(&t, w->grad), *gb = tg_get(&t, b->grad);
    check_fd("matmul+gelu d/dx", c.in[0], 48, gx, obj_matmul_gelu, &c);
    check_fd("matmul+gelu d/dw", c.in[1], 96, gw, obj_matmul_gelu, &c);
    check_fd("matmul+gelu d/dbias", c.in[2], 12, gb, obj_matmul_gelu, &c);
    tg_cover(&t, f0);
    free(yg), free(pg), free(gx), free(gw), free(gb), free(c.in[0]), free(c.in[1]), free(c.in[2]),
        free(c.dout);
    tg_free(&t);
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

static void case_mlp(dg_backend_t *be, int recompute) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, recompute ? 41 : 40);
    int N = 6, C = 8, H = 16;
    int64_t sx[3] = {2, 3, C}, s1[2] = {H, C}, sb1[1] = {H}, s2[2] = {C, H}, sb2[1] = {C};
    dg_node_t *x = tg_f(&t, "x", 3, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    dg_node_t *w1 = tg_f(&t, "w1", 2, s1, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *b1 = tg_f(&t, "b1", 1, sb1, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *w2 = tg_f(&t, "w2", 2, s2, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *b2 = tg_f(&t, "b2", 1, sb2, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *h = dg_op_gelu(t.g, "gelu", dg_op_matmul(t.g, "fc", x, w1, b1));
    dg_node_t *y = dg_op_matmul(t.g, "proj", h, w2, b2);
    dg_node_t *dout = tg_f(&t, "dout", 3, sx, DG_NF_INPUT, -1, 1);
    OK(dg_graph_error(t.g));
    dg_pass_t fuse[] = {{"fuse_gelu", dg_pass_fuse_gelu, NULL}};
    OK(dg_graph_run_passes(t.g, fuse, 1));
    OK(dg_autodiff(t.g, 1, &y, &dout));
    dg_pass_t post[] = {{"fuse_gelu_bwd", dg_pass_fuse_gelu_bwd, NULL},
                        {"recompute_gelu", dg_pass_recompute_gelu, NULL}};
    OK(dg_graph_run_passes(t.g, post, recompute ? 2 : 1));
    EXPECT(tg_count(&t, DG_OP_MATMUL_BWD_DGELU, 0) == 1 && tg_count(&t, DG_OP_GELU_BWD, -1) == 0,
           "mlp: expected one matmul_bwd_dgelu and no gelu_bwd");
    EXPECT(tg_count(&t, DG_OP_GELU, -1) == (recompute ? 1 : 0), "mlp: %d gelu ops (recompute %d)",
           tg_count(&t, DG_OP_GELU, -1), recompute);
    tg_finish(&t, 0, NULL, NULL);
    /* the inplace pass lets dpre take over the storage of the GELU output (or of its recomputed copy) */
    int aliased = 0;
    for (int i = 0; i < t.g->n; i++)
        if (t.g->nodes[i]->op == DG_OP_MATMUL_BWD_DGELU)
            aliased = t.g->nodes[i]->view_src == t.g->nodes[i]->src[1];
    EXPECT(aliased, "mlp: dpre should alias the GELU output it replaces");
    tg_run(&t, DG_PHASE_FWD);
    tg_run(&t, DG_PHASE_BWD);
    ctx_t c = {.in = {tg_d(&t, x), tg_d(&t, w1), tg_d(&t, b1), tg_d(&t, w2), tg_d(&t, b2)},
               .dout = tg_d(&t, dout),
               .d = {N, C, H}};
    float *g[5] = {tg_get(&t, dg_node_grad_of(x)), tg_get(&t, w1->grad), tg_get(&t, b1->grad),
                   tg_get(&t, w2->grad), tg_get(&t, b2->grad)};
    const char *nm[5] = {"mlp d/dx", "mlp d/dw1", "mlp d/db1", "mlp d/dw2", "mlp d/db2"};
    size_t n[5] = {(size_t)N * C, (size_t)H * C, (size_t)H, (size_t)C * H, (size_t)C};
    for (int k = 0; k < 5; k++)
        check_fd(nm[k], c.in[k], n[k], g[k], obj_mlp, &c);
    dg_node_t *par[4] = {w1, b1, w2, b2}, *act[1] = {x};
    float *a1[1] = {g[0]};
    check_accumulation(&t, 4, par, g + 1, 1, act, a1);
    tg_cover(&t, f0);
    for (int k = 0; k < 5; k++)
        free(g[k]), free(c.in[k]);
    free(c.dout);
    tg_free(&t);
}
static void case_mlp_saved(dg_backend_t *be) {
    case_mlp(be, 0);
}
static void case_mlp_recompute(dg_backend_t *be) {
    case_mlp(be, 1);
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

static void case_gelu_acc(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 42);
    int N = 6, C = 8;
    int64_t sx[2] = {N, C}, sw[2] = {C, C};
    dg_node_t *x = tg_f(&t, "x", 2, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -2, 2);
    dg_node_t *w = tg_f(&t, "w", 2, sw, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *w3 = tg_f(&t, "w3", 2, sw, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *y1 = dg_op_matmul(t.g, "y1", dg_op_gelu(t.g, "gelu", x), w, NULL);
    dg_node_t *y2 = dg_op_matmul(t.g, "y2", x, w3, NULL);
    dg_node_t *y = dg_op_add(t.g, "y", y1, y2);
    dg_node_t *dout = tg_f(&t, "dout", 2, sx, DG_NF_INPUT, -1, 1);
    OK(dg_graph_error(t.g));
    OK(dg_autodiff(t.g, 1, &y, &dout));
    dg_pass_t post[] = {{"fuse_gelu_bwd", dg_pass_fuse_gelu_bwd, NULL}};
    OK(dg_graph_run_passes(t.g, post, 1));
    EXPECT(tg_count(&t, DG_OP_MATMUL_BWD_DGELU, 1) == 1 && tg_count(&t, DG_OP_GELU_BWD, -1) == 0,
           "gelu_acc: expected one matmul_bwd_dgelu with acc = 1");
    EXPECT(dg_node_grad_of(x) && dg_node_grad_of(x)->op == DG_OP_MATMUL_BWD_DGELU,
           "gelu_acc: x's gradient should be the fused op's output");
    tg_finish(&t, 0, NULL, NULL);
    tg_run(&t, DG_PHASE_FWD);
    tg_run(&t, DG_PHASE_BWD);
    ctx_t c = {.in = {tg_d(&t, x), tg_d(&t, w), tg_d(&t, w3)}, .dout = tg_d(&t, dout), .d = {N, C}};
    float *gx = tg_get(&t, dg_node_grad_of(x)), *gw = tg_get(&t, w->grad), *gw3 = tg_get(&t, w3->grad);
    check_fd("gelu_acc d/dx", c.in[0], (size_t)N * C, gx, obj_gelu_acc, &c);
    check_fd("gelu_acc d/dw", c.in[1], (size_t)C * C, gw, obj_gelu_acc, &c);
    check_fd("gelu_acc d/dw3", c.in[2], (size_t)C * C, gw3, obj_gelu_acc, &c);
    tg_cover(&t, f0);
    free(gx), free(gw), free(gw3), free(c.in[0]), free(c.in[1]), free(c.in[2]), free(c.dout);
    tg_free(&t);
}

/* gelu */
static double obj_gelu(void *p) {
    ctx_t *c = p;
    size_t n = (size_t)c->d[0];
    double *y = malloc(n * sizeof *y);
    ref_gelu(y, c->in[0], n);
    double s = dot(y, c->dout, n);
    free(y);
    return s;
}

static void case_gelu(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 15);
    int64_t sx[2] = {3, 7};
    dg_node_t *x = tg_f(&t, "x", 2, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -3, 3);
    dg_node_t *y = dg_op_gelu(t.g, "gelu", x);
    dg_node_t *dout = tg_f(&t, "dout", 2, sx, DG_NF_INPUT, -1, 1);
    tg_finish(&t, 1, &y, &dout);
    tg_run(&t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(&t, x)}, .dout = tg_d(&t, dout), .d = {21}};
    double yr[21];
    ref_gelu(yr, c.in[0], 21);
    float *yg = tg_get(&t, y);
    check_close("gelu forward", yg, yr, 21, 1e-5);
    tg_run(&t, DG_PHASE_BWD);
    float *gx = tg_get(&t, dg_node_grad_of(x));
    check_fd("gelu d/dx", c.in[0], 21, gx, obj_gelu, &c);
    dg_node_t *act[1] = {x};
    float *a1[1] = {gx};
    check_accumulation(&t, 0, NULL, NULL, 1, act, a1);
    tg_cover(&t, f0);
    free(yg), free(gx), free(c.in[0]), free(c.dout);
    tg_free(&t);
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

static void case_attention(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 16);
    int B = 2, T = 5, C = 12, NH = 3;
    int64_t sq[3] = {B, T, 3 * C}, sy[3] = {B, T, C};
    dg_node_t *qkv = tg_f(&t, "qkv", 3, sq, DG_NF_INPUT | DG_NF_WANT_GRAD, -1.5, 1.5);
    dg_node_t *y = dg_op_attention(t.g, "attn", qkv, NH);
    dg_node_t *dout = tg_f(&t, "dout", 3, sy, DG_NF_INPUT, -1, 1);
    tg_finish(&t, 1, &y, &dout);
    tg_run(&t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(&t, qkv)}, .dout = tg_d(&t, dout), .d = {B, T, C, NH}};
    size_t n = (size_t)B * T * C;
    double *yr = malloc(n * sizeof *yr);
    ref_attention(yr, c.in[0], B, T, C, NH);
    float *yg = tg_get(&t, y);
    check_close("attention forward", yg, yr, n, 1e-5);
    tg_run(&t, DG_PHASE_BWD);
    float *gq = tg_get(&t, dg_node_grad_of(qkv));
    check_fd("attention d/dqkv", c.in[0], 3 * n, gq, obj_attention, &c);
    dg_node_t *act[1] = {qkv};
    float *a1[1] = {gq};
    check_accumulation(&t, 0, NULL, NULL, 1, act, a1);
    tg_cover(&t, f0);
    free(yr), free(yg), free(gq), free(c.in[0]), free(c.dout);
    tg_free(&t);
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

static void case_add(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 17);
    int64_t sx[2] = {3, 4};
    dg_node_t *a = tg_f(&t, "a", 2, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    dg_node_t *b = tg_f(&t, "b", 2, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    dg_node_t *y = dg_op_add(t.g, "add", a, b);
    dg_node_t *dout = tg_f(&t, "dout", 2, sx, DG_NF_INPUT, -1, 1);
    tg_finish(&t, 1, &y, &dout);
    tg_run(&t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(&t, a), tg_d(&t, b)}, .dout = tg_d(&t, dout), .d = {12}};
    double yr[12];
    for (int i = 0; i < 12; i++)
        yr[i] = c.in[0][i] + c.in[1][i];
    float *yg = tg_get(&t, y);
    check_close("add forward", yg, yr, 12, 1e-6);
    tg_run(&t, DG_PHASE_BWD);
    float *ga = tg_get(&t, dg_node_grad_of(a)), *gb = tg_get(&t, dg_node_grad_of(b));
    check_fd("add d/da", c.in[0], 12, ga, obj_add, &c);
    check_fd("add d/db", c.in[1], 12, gb, obj_add, &c);
    tg_cover(&t, f0);
    free(yg), free(ga), free(gb), free(c.in[0]), free(c.in[1]), free(c.dout);
    tg_free(&t);
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

static void case_crossentropy(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 18);
    int N = 6, V = 7, Vp = 9;
    int64_t sl[3] = {2, 3, Vp}, st[2] = {2, 3};
    dg_node_t *lg = tg_f(&t, "logits", 3, sl, DG_NF_INPUT | DG_NF_WANT_GRAD, -3, 3);
    dg_node_t *tg = tg_i(&t, "targets", 2, st, V);
    dg_node_t *loss = dg_op_crossentropy(t.g, "ce", lg, tg, V);
    tg_finish(&t, 1, &loss, NULL);
    t.ex->rt.dloss = 0.37f;
    tg_run(&t, DG_PHASE_FWD);
    ctx_t c = {.in = {tg_d(&t, lg)}, .tok = tg_leaf(&t, tg)->i, .d = {N, V, Vp}, .dloss = 0.37f};
    double lr[6];
    ref_crossentropy(lr, c.in[0], c.tok, N, V, Vp);
    float *lgot = tg_get(&t, loss);
    check_close("crossentropy forward (per-token losses)", lgot, lr, 6, 1e-5);
    tg_run(&t, DG_PHASE_BWD);
    float *gl = tg_get(&t, dg_node_grad_of(lg));
    check_fd("crossentropy d/dlogits", c.in[0], (size_t)N * Vp, gl, obj_ce, &c);
    int pad_nonzero = 0;
    for (int i = 0; i < N; i++)
        for (int j = V; j < Vp; j++)
            pad_nonzero += gl[i * Vp + j] != 0.0f;
    EXPECT(pad_nonzero == 0, "crossentropy: %d padded logit gradients are not exactly zero", pad_nonzero);
    tg_cover(&t, f0);
    free(lgot), free(gl), free(c.in[0]);
    tg_free(&t);
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

static int ce_same(ce_graph_t *a, ce_graph_t *b, const dg_node_t *na, const dg_node_t *nb, const char *what) {
    float *x = tg_get(&a->t, na), *y = tg_get(&b->t, nb);
    int same = na->nbytes == nb->nbytes && memcmp(x, y, na->nbytes) == 0;
    EXPECT(same, "crossentropy_fused: %s differs from the unfused pair's", what);
    free(x);
    free(y);
    return same;
}

static void case_crossentropy_fused(dg_backend_t *be) {
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
        tg_run(&u.t, DG_PHASE_FWD);
        tg_run(&f.t, DG_PHASE_FWD);
        ce_same(&u, &f, u.loss, f.loss, "losses");
        tg_run(&u.t, DG_PHASE_BWD);
        tg_run(&f.t, DG_PHASE_BWD);
        ce_same(&u, &f, dg_node_grad_of(u.x), dg_node_grad_of(f.x), "the input gradient");
        ce_same(&u, &f, u.w->grad, f.w->grad, "the accumulated weight gradient");
    }
    /* a forward with no backward: the fused op computes the losses and leaves the logits */
    f.t.ex->rt.forward_only = 1;
    tg_run(&u.t, DG_PHASE_FWD);
    tg_run(&f.t, DG_PHASE_FWD);
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
    dg_backend_t nofuse = {&ops, be->act_dtype, be->impl};
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

static void case_matmul_res(dg_backend_t *be) {
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
    float *x = tg_get(&a->t, na), *y = tg_get(&b->t, nb);
    int same = na->nbytes == nb->nbytes && memcmp(x, y, na->nbytes) == 0;
    EXPECT(same, "fuse_residual: %s differs from the unfused pair's", what);
    free(x);
    free(y);
    return same;
}

static int fwd_count(tg_t *t, dg_op_kind_t k) {
    int c = 0;
    for (int i = 0; i < t->g->n; i++)
        c += t->g->nodes[i]->op == k && t->g->nodes[i]->phase == DG_PHASE_FWD;
    return c;
}

static void case_fuse_residual(dg_backend_t *be) {
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
            tg_run(&u.t, DG_PHASE_FWD);
            tg_run(&f.t, DG_PHASE_FWD);
            res_same(&u, &f, u.y, f.y, "the output");
            tg_run(&u.t, DG_PHASE_BWD);
            tg_run(&f.t, DG_PHASE_BWD);
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
    dg_backend_t nofuse = {&ops, be->act_dtype, be->impl};
    res_graph_t f;
    res_build(&f, &nofuse, RF_FUSE);
    EXPECT(f.fr.n_fused == 0 && fwd_count(&f.t, DG_OP_MATMUL_RES) == 0 && fwd_count(&f.t, DG_OP_ADD) == 1,
           "fuse_residual must keep the pair on a backend without matmul_fwd_res");
    tg_free(&f.t);
}

/* A tensor with many consumers (I): later contributions accumulate in place (acc = 1 kernels) and
 * through ACCUMULATE when the first gradient storage is still needed. */
static double obj_fanout1(void *p) {
    ctx_t *c = p;
    int N = c->d[0], C = c->d[1];
    size_t n = (size_t)N * C;
    double *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b), *m = malloc(n * sizeof *m);
    ref_gelu(a, c->in[0], n);
    ref_layernorm(b, c->in[0], c->in[2], c->in[3], N, C);
    ref_matmul(m, c->in[0], c->in[1], NULL, N, C, C);
    for (size_t i = 0; i < n; i++)
        a[i] = a[i] + b[i] + m[i] + c->in[0][i];
    ref_gelu(b, a, n);
    double s = dot(b, c->dout, n);
    free(a), free(b), free(m);
    return s;
}

static void case_fanout1(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 19);
    int N = 8, C = 8;
    int64_t sx[3] = {2, 4, C}, sw[2] = {C, C}, sc[1] = {C};
    dg_node_t *x = tg_f(&t, "x", 3, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    dg_node_t *w = tg_f(&t, "w", 2, sw, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *lw = tg_f(&t, "lnw", 1, sc, DG_NF_PARAM, 0.5, 1.5);
    dg_node_t *lb = tg_f(&t, "lnb", 1, sc, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *a = dg_op_gelu(t.g, "a", x);
    dg_node_t *b = dg_op_layernorm(t.g, "b", x, lw, lb);
    dg_node_t *m = dg_op_matmul(t.g, "m", x, w, NULL);
    dg_node_t *s1 = dg_op_add(t.g, "s1", a, b);
    dg_node_t *s2 = dg_op_add(t.g, "s2", s1, m);
    dg_node_t *s3 = dg_op_add(t.g, "s3", s2, x);
    dg_node_t *y = dg_op_gelu(t.g, "y", s3);
    dg_node_t *dout = tg_f(&t, "dout", 3, sx, DG_NF_INPUT, -1, 1);
    tg_finish(&t, 1, &y, &dout);
    EXPECT(tg_count(&t, DG_OP_ACCUMULATE, -1) >= 1, "fanout1: expected an ACCUMULATE in the backward");
    EXPECT(tg_count(&t, DG_OP_LAYERNORM_BWD, 1) == 1 && tg_count(&t, DG_OP_GELU_BWD, 1) == 1,
           "fanout1: expected in-place (acc=1) layernorm_bwd and gelu_bwd");
    tg_run(&t, DG_PHASE_FWD);
    tg_run(&t, DG_PHASE_BWD);
    ctx_t c = {
        .in = {tg_d(&t, x), tg_d(&t, w), tg_d(&t, lw), tg_d(&t, lb)}, .dout = tg_d(&t, dout), .d = {N, C}};
    float *gx = tg_get(&t, dg_node_grad_of(x)), *gw = tg_get(&t, w->grad), *glw = tg_get(&t, lw->grad);
    float *glb = tg_get(&t, lb->grad);
    check_fd("fanout1 d/dx", c.in[0], 64, gx, obj_fanout1, &c);
    check_fd("fanout1 d/dw", c.in[1], 64, gw, obj_fanout1, &c);
    check_fd("fanout1 d/dlnw", c.in[2], 8, glw, obj_fanout1, &c);
    check_fd("fanout1 d/dlnb", c.in[3], 8, glb, obj_fanout1, &c);
    dg_node_t *act[1] = {x};
    float *a1[1] = {gx};
    check_accumulation(&t, 0, NULL, NULL, 1, act, a1);
    tg_cover(&t, f0);
    free(gx), free(gw), free(glw), free(glb);
    for (int k = 0; k < 4; k++)
        free(c.in[k]);
    free(c.dout);
    tg_free(&t);
}

/* A tensor with many consumers (II): x + x (gradient storage shared, so the sum needs an extra add),
 * then matmul backward accumulating in place. */
static double obj_fanout2(void *p) {
    ctx_t *c = p;
    int N = c->d[0], C = c->d[1];
    size_t n = (size_t)N * C;
    double *m1 = malloc(n * sizeof *m1), *m2 = malloc(n * sizeof *m2), *y = malloc(n * sizeof *y);
    ref_matmul(m1, c->in[0], c->in[1], c->in[2], N, C, C);
    ref_matmul(m2, c->in[0], c->in[3], NULL, N, C, C);
    for (size_t i = 0; i < n; i++)
        m1[i] = m1[i] + m2[i] + 2.0 * c->in[0][i];
    ref_gelu(y, m1, n);
    double s = dot(y, c->dout, n);
    free(m1), free(m2), free(y);
    return s;
}

static void case_fanout2(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 20);
    int N = 6, C = 8;
    int64_t sx[2] = {N, C}, sw[2] = {C, C}, sc[1] = {C};
    dg_node_t *x = tg_f(&t, "x", 2, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -1, 1);
    dg_node_t *w1 = tg_f(&t, "w1", 2, sw, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *b1 = tg_f(&t, "b1", 1, sc, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *w2 = tg_f(&t, "w2", 2, sw, DG_NF_PARAM, -0.5, 0.5);
    dg_node_t *m1 = dg_op_matmul(t.g, "m1", x, w1, b1);
    dg_node_t *m2 = dg_op_matmul(t.g, "m2", x, w2, NULL);
    dg_node_t *e = dg_op_add(t.g, "e", x, x);
    dg_node_t *s1 = dg_op_add(t.g, "s1", m1, m2);
    dg_node_t *s2 = dg_op_add(t.g, "s2", s1, e);
    dg_node_t *y = dg_op_gelu(t.g, "y", s2);
    dg_node_t *dout = tg_f(&t, "dout", 2, sx, DG_NF_INPUT, -1, 1);
    tg_finish(&t, 1, &y, &dout);
    int bwd_adds = 0;
    for (int i = 0; i < t.g->n; i++)
        bwd_adds += t.g->nodes[i]->op == DG_OP_ADD && t.g->nodes[i]->phase == DG_PHASE_BWD;
    EXPECT(bwd_adds == 1, "fanout2: expected one gradient-sum add in the backward, found %d", bwd_adds);
    EXPECT(tg_count(&t, DG_OP_MATMUL_BWD, 1) == 2,
           "fanout2: expected both matmul_bwd to accumulate in place");
    tg_run(&t, DG_PHASE_FWD);
    tg_run(&t, DG_PHASE_BWD);
    ctx_t c = {
        .in = {tg_d(&t, x), tg_d(&t, w1), tg_d(&t, b1), tg_d(&t, w2)}, .dout = tg_d(&t, dout), .d = {N, C}};
    float *gx = tg_get(&t, dg_node_grad_of(x)), *gw1 = tg_get(&t, w1->grad), *gb1 = tg_get(&t, b1->grad);
    float *gw2 = tg_get(&t, w2->grad);
    check_fd("fanout2 d/dx", c.in[0], 48, gx, obj_fanout2, &c);
    check_fd("fanout2 d/dw1", c.in[1], 64, gw1, obj_fanout2, &c);
    check_fd("fanout2 d/db1", c.in[2], 8, gb1, obj_fanout2, &c);
    check_fd("fanout2 d/dw2", c.in[3], 64, gw2, obj_fanout2, &c);
    dg_node_t *par[3] = {w1, b1, w2}, *act[1] = {x};
    float *g1[3] = {gw1, gb1, gw2}, *a1[1] = {gx};
    check_accumulation(&t, 3, par, g1, 1, act, a1);
    tg_cover(&t, f0);
    free(gx), free(gw1), free(gb1), free(gw2);
    for (int k = 0; k < 4; k++)
        free(c.in[k]);
    free(c.dout);
    tg_free(&t);
}

/* Collectives over mesh dimensions of size 1 (identity), their adjoints in the backward, and their
 * shape rules and refusal to run without a comm backend at size 4. */
static double obj_coll(void *p) {
    ctx_t *c = p;
    size_t n = (size_t)c->d[0];
    double *y = malloc(n * sizeof *y);
    ref_gelu(y, c->in[0], n);
    double s = dot(y, c->dout, n);
    free(y);
    return s;
}

static void case_collectives(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 21);
    int64_t sx[2] = {3, 5};
    dg_node_t *x = tg_f(&t, "x", 2, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -2, 2);
    dg_node_t *ag = dg_op_all_gather(t.g, "ag", x, DG_MESH_DP_SHARD);
    dg_node_t *rs = dg_op_reduce_scatter(t.g, "rs", ag, DG_MESH_DP_SHARD);
    dg_node_t *ar = dg_op_all_reduce(t.g, "ar", rs, DG_MESH_TP);
    dg_node_t *y = dg_op_gelu(t.g, "y", ar);
    dg_node_t *dout = tg_f(&t, "dout", 2, sx, DG_NF_INPUT, -1, 1);
    tg_finish(&t, 1, &y, &dout);
    EXPECT(tg_count(&t, DG_OP_ALL_GATHER, -1) == 2 && tg_count(&t, DG_OP_REDUCE_SCATTER, -1) == 2 &&
               tg_count(&t, DG_OP_ALL_REDUCE, -1) == 2,
           "collectives: each collective's adjoint should appear once in the backward");
    EXPECT(ar->view_src == rs, "collectives: all_reduce should run in place over its dying input");
    tg_run(&t, DG_PHASE_FWD);
    tg_run(&t, DG_PHASE_BWD);
    ctx_t c = {.in = {tg_d(&t, x)}, .dout = tg_d(&t, dout), .d = {15}};
    double yr[15];
    ref_gelu(yr, c.in[0], 15);
    float *yg = tg_get(&t, y), *gx = tg_get(&t, dg_node_grad_of(x));
    check_close("collectives (size 1) forward", yg, yr, 15, 1e-5);
    check_fd("collectives (size 1) d/dx", c.in[0], 15, gx, obj_coll, &c);
    tg_cover(&t, f0);
    free(yg), free(gx), free(c.in[0]), free(c.dout);
    tg_free(&t);

    /* size 4 along dp_shard: shapes scale, uneven scatter is refused, running needs a comm backend */
    tg_init(&t, be, 22);
    t.g->mesh.size[DG_MESH_DP_SHARD] = 4;
    int64_t s1[2] = {3, 5}, s2[2] = {10, 5};
    dg_node_t *a = tg_f(&t, "a", 2, s1, DG_NF_INPUT, -1, 1);
    dg_node_t *g4 = dg_op_all_gather(t.g, "ag4", a, DG_MESH_DP_SHARD);
    dg_node_t *r4 = dg_op_reduce_scatter(t.g, "rs4", g4, DG_MESH_DP_SHARD);
    EXPECT(g4 && g4->shape[0] == 12 && g4->shape[1] == 5, "all_gather over 4 ranks: [3,5] -> [12,5]");
    EXPECT(r4 && r4->shape[0] == 3 && r4->shape[1] == 5, "reduce_scatter over 4 ranks: [12,5] -> [3,5]");
    dg_node_t *b = tg_f(&t, "b", 2, s2, DG_NF_INPUT, -1, 1);
    dg_node_t *bad = dg_op_reduce_scatter(t.g, "rs_bad", b, DG_MESH_DP_SHARD);
    EXPECT(bad == NULL && dg_graph_error(t.g) == DG_ERR_USAGE && strstr(dg_last_error(), "not divisible"),
           "reduce_scatter of 10 rows over 4 ranks must fail with a clear message, got: %s", dg_last_error());
    tg_free(&t);

    tg_init(&t, be, 23);
    t.g->mesh.size[DG_MESH_TP] = 2;
    dg_node_t *u = tg_f(&t, "u", 2, s1, DG_NF_INPUT, -1, 1);
    dg_node_t *ur = dg_op_all_reduce(t.g, "ar2", u, DG_MESH_TP);
    dg_node_t *ug = dg_op_gelu(t.g, "g", ur);
    ug->flags |= DG_NF_OUTPUT;
    tg_finish(&t, 0, NULL, NULL);
    dg_status_t st = dg_exec_run_phase(t.ex, DG_PHASE_FWD);
    EXPECT(st == DG_ERR_RUNTIME && strstr(dg_last_error(), "comm backend"),
           "all_reduce over tp=2 without a comm backend must fail clearly, got %d: %s", st, dg_last_error());
    tg_free(&t);
}

/* Sharding support ops on one rank: shard_pack lays a tensor's rows out rank-major (k blocks of S
 * elements, the piece at OFF; rows past the tensor and the gaps zero) and a second pack adds into the
 * same buffer; shard_unpack inverts both; fill0 zeroes (through a poisoned arena); a comm-stream
 * reduce_scatter that accumulates into a persistent tensor completes at its wait (k = 1: q += packed). */
static void case_shard_ops(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 31);
    int64_t sx[2] = {5, 4}, sy[1] = {3}, sq[1] = {33};
    dg_node_t *x = tg_f(&t, "x", 2, sx, DG_NF_INPUT, -1, 1);
    dg_node_t *y = tg_f(&t, "y", 1, sy, DG_NF_INPUT, -1, 1);
    dg_node_t *q = tg_f(&t, "q", 1, sq, DG_NF_INPUT, -1, 1);
    enum { K = 3, S = 11 };
    int64_t ax[5] = {0, K, S, 1, 2}; /* x: 2 rows x 4 per rank at offset 1 (rank 2 gets row 4 + padding) */
    int64_t ay[5] = {1, K, S, 9, 1}; /* y: 1 element per rank at offset 9; offset 10 is a gap */
    dg_node_t *p1 = dg_graph_add_op(t.g, DG_OP_SHARD_PACK, "pack.x", 1, &x, 0, NULL, ax, 5);
    dg_node_t *src2[2] = {y, p1};
    dg_node_t *p2 = dg_graph_add_op(t.g, DG_OP_SHARD_PACK, "pack.y", 2, src2, 0, NULL, ay, 5);
    int64_t aux[7] = {0, K, S, 1, 2, 5, 4}, auy[7] = {0, K, S, 9, 1, 3, 0};
    dg_node_t *ux = dg_graph_add_op(t.g, DG_OP_SHARD_UNPACK, "unpack.x", 1, &p2, 0, NULL, aux, 7);
    dg_node_t *uy = dg_graph_add_op(t.g, DG_OP_SHARD_UNPACK, "unpack.y", 1, &p2, 0, NULL, auy, 7);
    int64_t az[4] = {0, 2, 5, 4};
    dg_node_t *z = dg_graph_add_op(t.g, DG_OP_FILL0, "z", 0, NULL, 0, NULL, az, 4);
    dg_node_t *zx = dg_op_add(t.g, "zx", z, x);
    int64_t ar[2] = {1, DG_MESH_DP_SHARD};
    dg_node_t *rs = dg_graph_add_op(t.g, DG_OP_REDUCE_SCATTER, "rs", 1, &p2, 1, &q, ar, 2);
    EXPECT(p1 && p2 && ux && uy && z && zx && rs, "shard ops: construction failed: %s", dg_last_error());
    if (!rs) {
        tg_free(&t);
        return;
    }
    rs->stream = DG_STREAM_COMM;
    rs->wait[rs->n_wait++] = p2;
    dg_node_t *w = dg_graph_add_op(t.g, DG_OP_WAIT, "wait.rs", 0, NULL, 0, NULL, NULL, 0);
    w->wait[w->n_wait++] = rs;
    p2->flags |= DG_NF_OUTPUT;
    ux->flags |= DG_NF_OUTPUT;
    uy->flags |= DG_NF_OUTPUT;
    zx->flags |= DG_NF_OUTPUT;
    dg_graph_touch(t.g);
    tg_finish(&t, 0, NULL, NULL);
    unsigned char *poison = malloc(t.plan->arena_bytes);
    memset(poison, 0xff, t.plan->arena_bytes); /* NaN everywhere: unwritten elements show */
    OK(be->ops->to_device(be, t.ex->arena, poison, t.plan->arena_bytes));
    free(poison);
    tg_run(&t, DG_PHASE_FWD);
    const float *hx = tg_leaf(&t, x)->f, *hy = tg_leaf(&t, y)->f, *hq = tg_leaf(&t, q)->f;
    double pk[K * S], xr[20], yr[3], qr[K * S];
    memset(pk, 0, sizeof pk);
    for (int r = 0; r < K; r++) {
        for (int row = 2 * r; row < 2 * r + 2 && row < 5; row++)
            for (int c = 0; c < 4; c++)
                pk[r * S + 1 + (row - 2 * r) * 4 + c] = hx[row * 4 + c];
        pk[r * S + 9] = hy[r];
    }
    for (int i = 0; i < 20; i++)
        xr[i] = hx[i];
    for (int i = 0; i < 3; i++)
        yr[i] = hy[i];
    for (int i = 0; i < K * S; i++)
        qr[i] = (double)hq[i] + pk[i];
    float *gp = tg_get(&t, p2), *gx = tg_get(&t, ux), *gy = tg_get(&t, uy), *gz = tg_get(&t, zx),
          *gq = tg_get(&t, q);
    check_close("shard_pack (rank-major, zero padding and gaps)", gp, pk, K * S, 0);
    check_close("shard_unpack of a matrix", gx, xr, 20, 0);
    check_close("shard_unpack of a vector", gy, yr, 3, 0);
    check_close("fill0 + x", gz, xr, 20, 0);
    check_close("reduce_scatter (acc, one rank) at its wait", gq, qr, K * S, 1e-6);
    tg_cover(&t, f0);
    free(gp), free(gx), free(gy), free(gz), free(gq);
    tg_free(&t);
}

/* bf16 of an f32 (round to nearest even; no NaN in the test data), as a float */
static float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* CAST (train.reduce_dtype = bf16): f32 -> bf16 into an arena tensor (round to nearest even), that
 * bf16 -> f32 over a persistent tensor, and bf16 -> f32 added into one (acc: the op's own output holds the
 * converted values, then add_f32); all exact. Then the shape rule's refusals. */
static void case_cast(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 41);
    int64_t sx[2] = {7, 9};
    dg_node_t *x = tg_f(&t, "x", 2, sx, DG_NF_INPUT, -3, 3);
    dg_node_t *y = tg_f(&t, "y", 2, sx, DG_NF_INPUT, -1, 1);
    dg_node_t *q = tg_f(&t, "q", 2, sx, DG_NF_INPUT, -1, 1);
    int64_t a16[2] = {0, DG_BF16}, a32[2] = {0, DG_F32}, aacc[2] = {1, DG_F32};
    dg_node_t *h = dg_graph_add_op(t.g, DG_OP_CAST, "x.bf16", 1, &x, 0, NULL, a16, 2);
    dg_node_t *b = h ? dg_graph_add_op(t.g, DG_OP_CAST, "y=x.bf16", 1, &h, 1, &y, a32, 2) : NULL;
    dg_node_t *c = b ? dg_graph_add_op(t.g, DG_OP_CAST, "q+=x.bf16", 1, &h, 1, &q, aacc, 2) : NULL;
    EXPECT(c && h->dtype == DG_BF16 && h->storage == DG_STORE_ARENA && b->storage == DG_STORE_NONE &&
               c->dtype == DG_F32 && c->storage == DG_STORE_ARENA,
           "cast: construction failed or wrong storage: %s", dg_last_error());
    if (!c) {
        tg_free(&t);
        return;
    }
    h->flags |= DG_NF_OUTPUT;
    dg_graph_touch(t.g);
    tg_finish(&t, 0, NULL, NULL);
    unsigned char *poison = malloc(t.plan->arena_bytes);
    memset(poison, 0xff, t.plan->arena_bytes);
    OK(be->ops->to_device(be, t.ex->arena, poison, t.plan->arena_bytes));
    free(poison);
    tg_run(&t, DG_PHASE_FWD);
    size_t n = dg_node_numel(x);
    const float *hx = tg_leaf(&t, x)->f, *hq = tg_leaf(&t, q)->f;
    uint16_t *gh = (uint16_t *)tg_get(&t, h);
    float *gy = tg_get(&t, y), *gq = tg_get(&t, q);
    size_t bad_h = n, bad_y = n, bad_q = n;
    int inexact = 0;
    for (size_t i = n; i-- > 0;) {
        float r = bf16_round(hx[i]);
        uint32_t u;
        memcpy(&u, &r, 4);
        inexact += r != hx[i];
        if (gh[i] != (uint16_t)(u >> 16)) bad_h = i;
        if (gy[i] != r) bad_y = i;
        if (gq[i] != hq[i] + r) bad_q = i;
    }
    EXPECT(bad_h == n, "cast f32 -> bf16: element %zu is 0x%04x, expected bf16(%.9g)", bad_h,
           bad_h < n ? gh[bad_h] : 0, bad_h < n ? (double)hx[bad_h] : 0.0);
    EXPECT(bad_y == n, "cast bf16 -> f32 over a tensor: element %zu is %.9g", bad_y,
           bad_y < n ? (double)gy[bad_y] : 0.0);
    EXPECT(bad_q == n, "cast bf16 -> f32 added into a tensor: element %zu is %.9g", bad_q,
           bad_q < n ? (double)gq[bad_q] : 0.0);
    EXPECT(inexact > (int)n / 2, "cast: only %d of %zu inputs needed rounding (vacuous test)", inexact, n);
    tg_cover(&t, f0);
    free(gh), free(gy), free(gq);
    tg_free(&t);

    /* refusals, each on a fresh graph (builder errors are sticky) */
    for (int k = 0; k < 3; k++) {
        tg_init(&t, be, 42);
        dg_node_t *u = tg_f(&t, "u", 2, sx, DG_NF_INPUT, -1, 1);
        int64_t s1[1] = {5};
        dg_node_t *v = tg_f(&t, "v", 1, s1, DG_NF_INPUT, -1, 1);
        dg_node_t *r = NULL;
        const char *want = "";
        if (k == 0) { /* acc without a target */
            r = dg_graph_add_op(t.g, DG_OP_CAST, "bad", 1, &u, 0, NULL, aacc, 2);
            want = "acc=1 adds into a tensor given in upd";
        } else if (k == 1) { /* a target of another size */
            r = dg_graph_add_op(t.g, DG_OP_CAST, "bad", 1, &u, 1, &v, a32, 2);
            want = "writes exactly one f32 tensor of 63 elements";
        } else { /* to an integer dtype */
            int64_t ai[2] = {0, DG_I32};
            r = dg_graph_add_op(t.g, DG_OP_CAST, "bad", 1, &u, 0, NULL, ai, 2);
            want = "is not f32, bf16 or f16";
        }
        EXPECT(r == NULL && dg_graph_error(t.g) == DG_ERR_USAGE && strstr(dg_last_error(), want),
               "cast refusal %d: expected '%s', got '%s'", k, want, dg_last_error());
        tg_free(&t);
    }
}

/* Optimizer ops: ZERO (grads), ZERO + SUMSQ + CLIP_SCALE + ADAMW (opt phase) against float64 AdamW with
 * global-norm clipping and per-tensor weight decay, over two steps. fused = 1: the ADAMW ops fused into one
 * ADAMW_ALL (pass fuse_adamw) over flat buffers with gaps between the tensors, which must stay as they
 * are, and the SUMSQ ops into one SUMSQ_ALL (pass fuse_sumsq). Either way the norm accumulator must hold
 * bitwise what one sumsq_f32 per gradient gives. */
static int decay_by_name(const dg_node_t *p, void *ctx) {
    (void)ctx;
    return strcmp(p->name, "p1") == 0;
}

static void optimizer_run(dg_backend_t *be, int fused) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 24);
    int64_t s1[2] = {6, 5}, s2[1] = {7};
    dg_node_t *p[2];
    p[0] = tg_f(&t, "p1", 2, s1, DG_NF_PARAM, -1, 1);
    p[1] = tg_f(&t, "p2", 1, s2, DG_NF_PARAM, -1, 1);
    dg_node_t *sc = NULL;
    OK(dg_graph_add_optimizer(t.g, decay_by_name, NULL, &sc));
    dg_node_t *mn[2] = {0}, *vn[2] = {0};
    for (int i = 0; i < t.g->n; i++) {
        dg_node_t *n = t.g->nodes[i];
        if (!(n->flags & DG_NF_OPTSTATE)) continue;
        (strncmp(n->name, "adam_m.", 7) == 0 ? mn : vn)[n->param_index] = n;
    }
    /* fused: p1 at 0 (30 elements, gap 30..31), p2 at 32 (7 elements, gap 39), flat buffers of 40 */
    enum { SPAN = 40 };
    const size_t offs[2] = {0, 32};
    dg_fuse_adamw_t fz = {.off = offs, .n = 2, .span = SPAN};
    float *flat[4] = {0}; /* master (= param: f32), grad, m, v */
    void *tab = NULL;
    if (fused) {
        dg_pass_t fp[] = {{"fuse_adamw", dg_pass_fuse_adamw, &fz}, {"fuse_sumsq", dg_pass_fuse_sumsq, &fz}};
        OK(dg_graph_run_passes(t.g, fp, 2));
        EXPECT(tg_count(&t, DG_OP_ADAMW, -1) == 0 && tg_count(&t, DG_OP_ADAMW_ALL, -1) == 1 &&
                   t.g->n_opt_segs == 2 && fz.param == fz.master,
               "fuse_adamw: %d adamw, %d adamw_all, %d segments", tg_count(&t, DG_OP_ADAMW, -1),
               tg_count(&t, DG_OP_ADAMW_ALL, -1), t.g->n_opt_segs);
        EXPECT(tg_count(&t, DG_OP_SUMSQ, -1) == 0 && tg_count(&t, DG_OP_SUMSQ_ALL, -1) == 1 &&
                   t.g->n_norm_segs == 2 && fz.norm_segs,
               "fuse_sumsq: %d sumsq, %d sumsq_all, %d segments", tg_count(&t, DG_OP_SUMSQ, -1),
               tg_count(&t, DG_OP_SUMSQ_ALL, -1), t.g->n_norm_segs);
    } else {
        EXPECT(tg_count(&t, DG_OP_SUMSQ, -1) == 2 && tg_count(&t, DG_OP_SUMSQ_ALL, -1) == 0,
               "per parameter: %d sumsq, %d sumsq_all", tg_count(&t, DG_OP_SUMSQ, -1),
               tg_count(&t, DG_OP_SUMSQ_ALL, -1));
    }
    if (fused) {
        float poison[SPAN];
        for (int i = 0; i < SPAN; i++)
            poison[i] = -777.0f;
        for (int b = 0; b < 4; b++) {
            OK(be->ops->alloc(be, SPAN * sizeof(float), (void **)&flat[b]));
            OK(be->ops->to_device(be, flat[b], poison, sizeof poison)); /* the gaps keep -777 */
        }
        OK(be->ops->alloc(be, fz.segs->nbytes, &tab));
        fz.master->data = flat[0], fz.grad->data = flat[1], fz.m->data = flat[2], fz.v->data = flat[3];
        fz.segs->data = tab;
        for (int k = 0; k < 2; k++) {
            p[k]->data = flat[0] + offs[k], p[k]->grad->data = flat[1] + offs[k];
            mn[k]->data = flat[2] + offs[k], vn[k]->data = flat[3] + offs[k];
            OK(be->ops->memset0(be, p[k]->grad->data, dg_node_numel(p[k]) * sizeof(float)));
            OK(be->ops->memset0(be, mn[k]->data, dg_node_numel(p[k]) * sizeof(float)));
            OK(be->ops->memset0(be, vn[k]->data, dg_node_numel(p[k]) * sizeof(float)));
        }
    }
    tg_finish(&t, 0, NULL, NULL);
    size_t nel[2] = {30, 7};
    double *P[2], *M[2], *V[2];
    float *G[2];
    for (int k = 0; k < 2; k++) {
        P[k] = tg_d(&t, p[k]);
        M[k] = calloc(nel[k], sizeof(double));
        V[k] = calloc(nel[k], sizeof(double));
        G[k] = malloc(nel[k] * sizeof(float));
        ref_fill(G[k], nel[k], -2, 2, &t.rng);
        OK(be->ops->to_device(be, p[k]->grad->data, G[k], nel[k] * sizeof(float)));
    }
    const double lr = 0.01, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    double clips[2] = {0.5, 0.0}; /* step 1 clips (the norm is ~5), step 2 does not */
    for (int step = 1; step <= 2; step++) {
        dg_runtime_t *rt = &t.ex->rt;
        rt->lr = (float)lr, rt->beta1 = (float)b1, rt->beta2 = (float)b2, rt->eps = (float)eps;
        rt->weight_decay = (float)wd, rt->grad_clip = (float)clips[step - 1], rt->grad_extra = 1.0f,
        rt->t = step;
        tg_run(&t, DG_PHASE_OPT);
        double ss = 0;
        for (int k = 0; k < 2; k++)
            for (size_t i = 0; i < nel[k]; i++)
                ss += (double)G[k][i] * G[k][i];
        double norm = sqrt(ss),
               scale = clips[step - 1] > 0 ? fmin(1.0, clips[step - 1] / (norm + 1e-6)) : 1.0;
        float *scal = tg_get(&t, sc);
        EXPECT(fabs(scal[DG_SCALAR_NORM] - norm) <= 1e-5 * norm, "optimizer: grad norm %.8g, reference %.8g",
               (double)scal[DG_SCALAR_NORM], norm);
        float seq = 0.0f; /* one sumsq_f32 per gradient, in parameter order, from 0 */
        for (int k = 0; k < 2; k++)
            OK(be->ops->sumsq_f32(be, &seq, p[k]->grad->data, nel[k]));
        EXPECT(memcmp(&scal[DG_SCALAR_SUMSQ], &seq, sizeof seq) == 0,
               "optimizer%s: sum of squares %.9g, not bitwise the %.9g of one sumsq_f32 per gradient",
               fused ? " (fused)" : "", (double)scal[DG_SCALAR_SUMSQ], (double)seq);
        free(scal);
        for (int k = 0; k < 2; k++) {
            double decay = k == 0 ? wd : 0.0;
            for (size_t i = 0; i < nel[k]; i++) {
                double g = G[k][i] * scale;
                M[k][i] = b1 * M[k][i] + (1 - b1) * g;
                V[k][i] = b2 * V[k][i] + (1 - b2) * g * g;
                double mh = M[k][i] / (1 - pow(b1, step)), vh = V[k][i] / (1 - pow(b2, step));
                P[k][i] -= lr * (mh / (sqrt(vh) + eps) + decay * P[k][i]);
            }
            float *pg = tg_get(&t, p[k]), *mg = tg_get(&t, mn[k]), *vg = tg_get(&t, vn[k]);
            char what[160];
            snprintf(what, sizeof what, "adamw step %d %s param", step, p[k]->name);
            check_close(what, pg, P[k], nel[k], 1e-5);
            snprintf(what, sizeof what, "adamw step %d %s m", step, p[k]->name);
            check_close(what, mg, M[k], nel[k], 1e-5);
            snprintf(what, sizeof what, "adamw step %d %s v", step, p[k]->name);
            check_close(what, vg, V[k], nel[k], 1e-5);
            free(pg), free(mg), free(vg);
        }
    }
    const int gaps[3] = {30, 31, 39};
    if (fused)
        for (int b = 0; b < 4; b++) {
            float h[SPAN];
            OK(be->ops->to_host(be, h, flat[b], sizeof h));
            for (int j = 0; j < 3; j++)
                EXPECT(h[gaps[j]] == -777.0f, "adamw_all wrote into the gap at %d of flat buffer %d: %g",
                       gaps[j], b, (double)h[gaps[j]]);
        }
    tg_run(&t, DG_PHASE_ZERO);
    for (int k = 0; k < 2; k++) {
        float *gg = tg_get(&t, p[k]->grad);
        size_t nz = 0;
        for (size_t i = 0; i < nel[k]; i++)
            nz += gg[i] != 0.0f;
        EXPECT(nz == 0, "zero phase left %zu non-zero gradient elements in %s", nz, p[k]->name);
        free(gg);
    }
    if (fused) {
        /* fused, the zero phase is one ZERO of the whole flat gradient buffer (buffer 1): its gaps are
         * cleared with it; the other flat buffers' gaps stay untouched */
        int nzero = 0;
        for (int i = 0; i < t.g->n; i++)
            nzero += t.g->nodes[i]->op == DG_OP_ZERO && t.g->nodes[i]->phase == DG_PHASE_ZERO;
        EXPECT(nzero == 1, "fused: %d ZERO ops in the zero phase, expected one over the flat gradient buffer",
               nzero);
        for (int b = 0; b < 4; b++) {
            float h[SPAN];
            OK(be->ops->to_host(be, h, flat[b], sizeof h));
            for (int j = 0; j < 3; j++)
                EXPECT(h[gaps[j]] == (b == 1 ? 0.0f : -777.0f), "zero phase: gap at %d of flat buffer %d: %g",
                       gaps[j], b, (double)h[gaps[j]]);
        }
    }
    tg_cover(&t, f0);
    for (int k = 0; k < 2; k++)
        free(P[k]), free(M[k]), free(V[k]), free(G[k]);
    tg_free(&t);
    for (int b = 0; b < 4; b++)
        if (flat[b]) be->ops->free(be, flat[b]);
    if (tab) be->ops->free(be, tab);
}

static void case_optimizer(dg_backend_t *be) {
    optimizer_run(be, 0);
}

static void case_optimizer_fused(dg_backend_t *be) {
    optimizer_run(be, 1);
}

/* The fused gradient norm (pass fuse_sumsq after fuse_adamw): four parameters whose flat offsets are not
 * in parameter order, one of them a NORM_SKIP replica. Checked: one SUMSQ_ALL where the SUMSQ ops were
 * (after the accumulator's ZERO, right before CLIP_SCALE) over the flat gradient leaf; its segments are
 * the former SUMSQ ops' gradients in their order (the replica left out); the sum is bitwise the sequence of
 * sumsq_f32 calls over those gradients (the gaps of the flat buffer, filled with large values, never
 * count; the gradients chosen so that another order gives other bits), with a frozen parameter left out at
 * run time; and the pass's refusals. */
static void norm_params(tg_t *t, dg_node_t **p, dg_node_t **sc) {
    int64_t sa[2] = {5, 3}, sb[1] = {7}, sc9[1] = {9}, sd[2] = {2, 2};
    p[0] = tg_f(t, "a", 2, sa, DG_NF_PARAM, -1, 1);
    p[1] = tg_f(t, "b", 1, sb, DG_NF_PARAM, -1, 1);
    p[2] = tg_f(t, "c", 1, sc9, DG_NF_PARAM, -1, 1);
    p[3] = tg_f(t, "d", 2, sd, DG_NF_PARAM, -1, 1);
    p[1]->flags |= DG_NF_NORM_SKIP; /* a replica another rank counts: no SUMSQ */
    OK(dg_graph_add_optimizer(t->g, NULL, NULL, sc));
}

static void case_norm_fused(dg_backend_t *be) {
    int f0 = dg_fails;
    enum { NP = 4, SPAN = 40 };
    /* b [0, 7), c [8, 17), a [20, 35), d [36, 40): parameter order is not offset order */
    const size_t offs[NP] = {20, 0, 8, 36}, nel[NP] = {15, 7, 9, 4};
    tg_t t;
    tg_init(&t, be, 77);
    dg_node_t *p[NP], *sc = NULL;
    norm_params(&t, p, &sc);
    dg_fuse_adamw_t fz = {.off = offs, .n = NP, .span = SPAN};
    dg_pass_t fp[] = {{"fuse_adamw", dg_pass_fuse_adamw, &fz}, {"fuse_sumsq", dg_pass_fuse_sumsq, &fz}};
    OK(dg_graph_run_passes(t.g, fp, 2));
    EXPECT(tg_count(&t, DG_OP_SUMSQ, -1) == 0 && tg_count(&t, DG_OP_SUMSQ_ALL, -1) == 1,
           "fuse_sumsq: %d sumsq, %d sumsq_all", tg_count(&t, DG_OP_SUMSQ, -1),
           tg_count(&t, DG_OP_SUMSQ_ALL, -1));
    /* the table: a, c, d (the SUMSQ order), b left out */
    const int want_pi[3] = {0, 2, 3};
    EXPECT(t.g->n_norm_segs == 3, "fuse_sumsq: %d segments, expected 3 (the replica b left out)",
           t.g->n_norm_segs);
    for (int i = 0; i < 3 && i < t.g->n_norm_segs; i++) {
        const dg_opt_seg_t *s = &t.g->norm_segs[i];
        int k = want_pi[i];
        EXPECT(s->param_index == p[k]->param_index && s->off == offs[k] && s->count == nel[k],
               "norm segment %d: parameter %d, %zu elements at %zu; expected %s: %zu at %zu", i,
               s->param_index, s->count, s->off, p[k]->name, nel[k], offs[k]);
    }
    const dg_node_t *op = NULL, *zs = NULL, *clip = NULL;
    for (int i = 0; i < t.g->n; i++) {
        const dg_node_t *x = t.g->nodes[i];
        if (x->op == DG_OP_SUMSQ_ALL) op = x;
        if (x->op == DG_OP_ZERO && x->upd[0] == sc) zs = x;
        if (x->op == DG_OP_CLIP_SCALE) clip = x;
    }
    EXPECT(op && zs && clip && op->src[0] == fz.grad && op->src[1] == fz.norm_segs && op->upd[0] == sc &&
               op->phase == DG_PHASE_OPT && op->attr[DG_A_NSEG] == 3,
           "sumsq_all: wrong sources, target, phase or segment count");
    EXPECT(op && zs && clip && zs->id < fz.norm_segs->id && fz.norm_segs->id + 1 == op->id &&
               op->id + 1 == clip->id,
           "sumsq_all at #%d: expected after the accumulator's ZERO (#%d) and its table (#%d), right before "
           "clip_scale (#%d)",
           op ? op->id : -1, zs ? zs->id : -1, fz.norm_segs ? fz.norm_segs->id : -1, clip ? clip->id : -1);

    /* flat buffers (every flat leaf bound, the parameters' tensors at their offsets); gaps hold 1000 */
    float *flat[4] = {0};
    dg_node_t *mn[NP] = {0}, *vn[NP] = {0};
    for (int i = 0; i < t.g->n; i++) {
        dg_node_t *n = t.g->nodes[i];
        if (n->flags & DG_NF_OPTSTATE) (strncmp(n->name, "adam_m.", 7) == 0 ? mn : vn)[n->param_index] = n;
    }
    float fill[SPAN];
    for (int i = 0; i < SPAN; i++)
        fill[i] = 1000.0f;
    for (int b = 0; b < 4; b++) {
        OK(be->ops->alloc(be, SPAN * sizeof(float), (void **)&flat[b]));
        OK(be->ops->to_device(be, flat[b], fill, sizeof fill));
    }
    fz.master->data = flat[0], fz.grad->data = flat[1], fz.m->data = flat[2], fz.v->data = flat[3];
    for (int k = 0; k < NP; k++) {
        p[k]->data = flat[0] + offs[k], p[k]->grad->data = flat[1] + offs[k];
        mn[k]->data = flat[2] + offs[k], vn[k]->data = flat[3] + offs[k];
        OK(be->ops->memset0(be, mn[k]->data, nel[k] * sizeof(float)));
        OK(be->ops->memset0(be, vn[k]->data, nel[k] * sizeof(float)));
    }
    tg_finish(&t, 0, NULL, NULL);
    /* gradients whose sums of squares add to other bits in another order: a's is 15 x 1100^2 = 18150000
     * (above 2^24 floats are 2 apart), c's ~0.7 and d's 0.49 vanish into it one by one, not together */
    const float mag[NP] = {1100.0f, 1.0f, 0.27f, 0.35f};
    for (int k = 0; k < NP; k++) {
        float g[16];
        for (size_t e = 0; e < nel[k]; e++)
            g[e] = (e % 2 ? -mag[k] : mag[k]) * (k == 0 ? 1.0f : 1.0f + 0.01f * (float)e);
        OK(be->ops->to_device(be, p[k]->grad->data, g, nel[k] * sizeof(float)));
    }
    {
        float fwd = 0.0f, bwd = 0.0f;
        for (int i = 0; i < 3; i++) {
            int kf = (int[3]){0, 2, 3}[i], kb = (int[3]){3, 2, 0}[i];
            OK(be->ops->sumsq_f32(be, &fwd, p[kf]->grad->data, nel[kf]));
            OK(be->ops->sumsq_f32(be, &bwd, p[kb]->grad->data, nel[kb]));
        }
        EXPECT(
            memcmp(&fwd, &bwd, sizeof fwd) != 0,
            "norm_fused: the gradients' sums add to the same bits in reverse (%.9g): the case cannot see the "
            "order",
            (double)fwd);
    }
    unsigned char frozen[NP] = {0};
    dg_runtime_t *rt = &t.ex->rt;
    rt->lr = 0.01f, rt->beta1 = 0.9f, rt->beta2 = 0.95f, rt->eps = 1e-8f, rt->grad_clip = 0.0f;
    rt->grad_extra = 1.0f, rt->t = 1, rt->frozen = frozen, rt->n_frozen_slots = NP;
    for (int run = 0; run < 2; run++) {
        frozen[0] = run == 1; /* a frozen: left out of the norm at run time (the big total: it shows) */
        tg_run(&t, DG_PHASE_OPT);
        float seq = 0.0f;
        double ref = 0;
        for (int i = 0; i < 3; i++) {
            int k = want_pi[i];
            if (frozen[k]) continue;
            OK(be->ops->sumsq_f32(be, &seq, p[k]->grad->data, nel[k]));
            const float *g = p[k]->grad->data;
            for (size_t e = 0; e < nel[k]; e++)
                ref += (double)g[e] * g[e];
        }
        float *scal = tg_get(&t, sc);
        EXPECT(memcmp(&scal[DG_SCALAR_SUMSQ], &seq, sizeof seq) == 0,
               "sumsq_all%s: %.9g, not bitwise the %.9g of sumsq_f32 over a, c, d in order",
               run ? " (a frozen)" : "", (double)scal[DG_SCALAR_SUMSQ], (double)seq);
        EXPECT(fabs(scal[DG_SCALAR_SUMSQ] - ref) <= 1e-6 * ref, "sumsq_all%s: %.9g, float64 reference %.9g",
               run ? " (a frozen)" : "", (double)scal[DG_SCALAR_SUMSQ], ref);
        free(scal);
    }
    rt->frozen = NULL;
    tg_cover(&t, f0);
    tg_free(&t);
    for (int b = 0; b < 4; b++)
        be->ops->free(be, flat[b]);

    /* without a fused AdamW (no flat gradient leaf) the pass leaves the SUMSQ ops alone */
    tg_init(&t, be, 78);
    norm_params(&t, p, &sc);
    dg_fuse_adamw_t none = {.off = offs, .n = NP, .span = SPAN};
    dg_pass_t only[] = {{"fuse_sumsq", dg_pass_fuse_sumsq, &none}};
    OK(dg_graph_run_passes(t.g, only, 1));
    EXPECT(tg_count(&t, DG_OP_SUMSQ, -1) == 3 && tg_count(&t, DG_OP_SUMSQ_ALL, -1) == 0 && !none.norm_segs,
           "fuse_sumsq without fuse_adamw: %d sumsq, %d sumsq_all", tg_count(&t, DG_OP_SUMSQ, -1),
           tg_count(&t, DG_OP_SUMSQ_ALL, -1));
    tg_free(&t);

    /* refusals: an op between two SUMSQ ops; a SUMSQ over a tensor outside the flat gradient buffer */
    for (int bad = 0; bad < 2; bad++) {
        tg_init(&t, be, 79);
        norm_params(&t, p, &sc);
        dg_fuse_adamw_t fb = {.off = offs, .n = NP, .span = SPAN};
        dg_pass_t a1[] = {{"fuse_adamw", dg_pass_fuse_adamw, &fb}};
        OK(dg_graph_run_passes(t.g, a1, 1));
        int first = -1, last = -1;
        for (int i = 0; i < t.g->n; i++)
            if (t.g->nodes[i]->op == DG_OP_SUMSQ) {
                if (first < 0) first = i;
                last = i;
            }
        const char *want = NULL;
        if (bad == 0) {
            dg_graph_move(t.g, t.g->nodes[last + 1], first + 1); /* clip_scale between the first two */
            want = "runs between two SUMSQ ops";
        } else {
            int64_t s3[1] = {3};
            dg_node_t *stray = tg_f(&t, "stray", 1, s3, DG_NF_GRAD, -1, 1);
            dg_node_t *x = dg_graph_add_op(t.g, DG_OP_SUMSQ, "sumsq.stray", 1, &stray, 1, &sc, NULL, 0);
            OK(dg_graph_error(t.g));
            dg_graph_move(t.g, x, last + 1);
            want = "not a tensor of the flat gradient buffer";
        }
        dg_pass_t s1[] = {{"fuse_sumsq", dg_pass_fuse_sumsq, &fb}};
        dg_status_t st = dg_graph_run_passes(t.g, s1, 1);
        EXPECT(st == DG_ERR_USAGE && strstr(dg_last_error(), want) && !strchr(dg_last_error(), '\n'),
               "fuse_sumsq refusal %d: expected a one-line '%s', got %d '%s'", bad, want, st,
               dg_last_error());
        tg_free(&t);
    }
}

/* Shape rules reject bad inputs with a one-line DG_ERR_USAGE naming the op, and never crash. */
static void case_shape_errors(dg_backend_t *be) {
    struct {
        const char *what;
        int which;
    } cases[] = {{"layernorm weight size", 0},
                 {"matmul inner dimension", 1},
                 {"attention heads", 2},
                 {"crossentropy vocabulary", 3},
                 {"add shapes", 4},
                 {"encoder sequence length", 5}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        tg_t t;
        tg_init(&t, be, 30 + k);
        int64_t s[3] = {2, 3, 8}, s7[1] = {7}, sw[2] = {4, 7}, sq[3] = {2, 3, 30}, st[2] = {2, 3},
                sv[2] = {9, 8};
        int64_t sp[2] = {2, 8};
        dg_node_t *x = tg_f(&t, "x", 3, s, DG_NF_INPUT, -1, 1), *r = NULL;
        const char *opname = "";
        switch (cases[k].which) {
        case 0:
            r = dg_op_layernorm(t.g, "ln", x, tg_f(&t, "w", 1, s7, DG_NF_PARAM, 0, 1),
                                tg_f(&t, "b", 1, s7, DG_NF_PARAM, 0, 1));
            opname = "layernorm";
            break;
        case 1:
            r = dg_op_matmul(t.g, "mm", x, tg_f(&t, "w", 2, sw, DG_NF_PARAM, 0, 1), NULL);
            opname = "matmul";
            break;
        case 2:
            r = dg_op_attention(t.g, "at", tg_f(&t, "q", 3, sq, DG_NF_INPUT, 0, 1), 4); /* C = 10 */
            opname = "attention";
            break;
        case 3:
            r = dg_op_crossentropy(t.g, "ce", x, tg_i(&t, "t", 2, st, 5), 9); /* V 9 > Vp 8 */
            opname = "crossentropy";
            break;
        case 4:
            r = dg_op_add(t.g, "ad", x, tg_f(&t, "y", 2, sp, DG_NF_INPUT, 0, 1));
            opname = "add";
            break;
        case 5:
            r = dg_op_encoder(t.g, "en", tg_i(&t, "tok", 2, st, 5), tg_f(&t, "wte", 2, sv, DG_NF_PARAM, 0, 1),
                              tg_f(&t, "wpe", 2, sp, DG_NF_PARAM, 0, 1)); /* T 3 > 2 positions */
            opname = "encoder";
            break;
        }
        EXPECT(r == NULL && dg_graph_error(t.g) == DG_ERR_USAGE && strstr(dg_last_error(), opname) &&
                   !strchr(dg_last_error(), '\n'),
               "%s: expected a one-line usage error naming '%s', got '%s'", cases[k].what, opname,
               dg_last_error());
        /* the error is sticky: later constructors return NULL instead of building on a broken graph */
        EXPECT(dg_op_gelu(t.g, "after", x) == NULL, "%s: builder error is not sticky", cases[k].what);
        tg_free(&t);
    }
}

/* A plan made before a mutation is stale and must be refused. */
static void case_stale_plan(dg_backend_t *be) {
    tg_t t;
    tg_init(&t, be, 40);
    int64_t s[2] = {4, 4};
    dg_node_t *x = tg_f(&t, "x", 2, s, DG_NF_INPUT, -1, 1);
    dg_node_t *y = dg_op_gelu(t.g, "y", x);
    y->flags |= DG_NF_OUTPUT;
    tg_finish(&t, 0, NULL, NULL);
    EXPECT(dg_plan_matches(t.plan, t.g), "fresh plan should match");
    dg_op_gelu(t.g, "z", y);
    EXPECT(!dg_plan_matches(t.plan, t.g), "plan must be stale after the graph changed");
    EXPECT(dg_plan_check(t.plan, t.g) != DG_OK, "plan check must refuse a stale plan");
    tg_free(&t);
}

typedef struct {
    const char *name;
    void (*fn)(dg_backend_t *be);
} op_case_t;

static const op_case_t cases[] = {
    {"encoder", case_encoder},
    {"layernorm", case_layernorm},
    {"matmul", case_matmul},
    {"matmul_nobias", case_matmul_nobias},
    {"matmul_gelu", case_matmul_gelu},
    {"gelu", case_gelu},
    {"mlp_saved", case_mlp_saved},
    {"mlp_recompute", case_mlp_recompute},
    {"gelu_acc", case_gelu_acc},
    {"attention", case_attention},
    {"add", case_add},
    {"crossentropy", case_crossentropy},
    {"crossentropy_fused", case_crossentropy_fused},
    {"matmul_res", case_matmul_res},
    {"fuse_residual", case_fuse_residual},
    {"fanout1", case_fanout1},
    {"fanout2", case_fanout2},
    {"collectives", case_collectives},
    {"shard_ops", case_shard_ops},
    {"cast", case_cast},
    {"optimizer", case_optimizer},
    {"optimizer_fused", case_optimizer_fused},
    {"norm_fused", case_norm_fused},
    {"shape_errors", case_shape_errors},
    {"stale_plan", case_stale_plan},
};

int main(void) {
    dg_backend_config_t bc = {.act_dtype = DG_F32};
    dg_backend_t *be = NULL;
    OK(dg_backend_cpu_create(&bc, &be));
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int f0 = dg_fails;
        cases[i].fn(be);
        printf("%-16s %s\n", cases[i].name, dg_fails == f0 ? "ok" : "FAILED");
    }
    /* every registered op must have been executed by a case that passed */
    for (int k = 0; k < DG_OP_COUNT; k++) {
        const dg_op_def_t *d = dg_op_def((dg_op_kind_t)k);
        if (d->grad_kind == DG_GRAD_STRUCTURAL) continue;
        EXPECT(d->shape && d->exec, "op %s lacks a shape rule or an executor", d->name);
        EXPECT(d->grad_kind != DG_GRAD_BUILDER || d->backward, "op %s is differentiable but has no backward",
               d->name);
        EXPECT(covered & (1ull << k), "op %s is registered but no passing test case exercised it", d->name);
    }
    dg_backend_free(be);
    return dg_check_done("graph op");
}
