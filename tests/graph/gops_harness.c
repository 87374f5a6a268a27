/* gops_harness.c — the test graph harness and float64 comparisons of test_graph_ops (contracts in gops.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dg_fd.h"
#include "gops.h"

uint64_t covered;

void tg_init(tg_t *t, dg_backend_t *be, uint64_t seed) {
    memset(t, 0, sizeof *t);
    t->be = be;
    t->g = dg_graph_create(be);
    t->rng = seed;
}

dg_node_t *tg_f(tg_t *t, const char *name, int ndim, const int64_t *shape, unsigned flags, double lo,
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

dg_node_t *tg_i(tg_t *t, const char *name, int ndim, const int64_t *shape, int maxv) {
    dg_node_t *n = dg_graph_leaf(t->g, name, DG_I32, ndim, shape, DG_NF_INPUT);
    leaf_t *l = &t->leaves[t->nl++];
    l->n = n;
    l->i = malloc(dg_node_numel(n) * sizeof(int32_t));
    for (size_t k = 0; k < dg_node_numel(n); k++)
        l->i[k] = (int32_t)(ref_rng_next(&t->rng) % (uint64_t)maxv);
    return n;
}

leaf_t *tg_leaf(tg_t *t, const dg_node_t *n) {
    for (int k = 0; k < t->nl; k++)
        if (t->leaves[k].n == n) return &t->leaves[k];
    return NULL;
}

double *to_f64(const float *f, size_t n) {
    double *d = malloc(n * sizeof *d);
    for (size_t i = 0; i < n; i++)
        d[i] = f[i];
    return d;
}

double *tg_d(tg_t *t, const dg_node_t *n) {
    return to_f64(tg_leaf(t, n)->f, dg_node_numel(n));
}

/* autodiff (when outs given) + in-place pass, plan (checked), persistent memory, uploads, executor */
void tg_finish(tg_t *t, int nout, dg_node_t **outs, dg_node_t **seeds) {
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

void tg_run(tg_t *t, dg_phase_t ph) {
    OK(dg_exec_run_phase(t->ex, ph));
    OK(t->be->ops->sync(t->be));
}

float *tg_get(tg_t *t, const dg_node_t *n) {
    if (!n) { /* e.g. a gradient autodiff did not produce */
        fprintf(stderr, "FAIL: a tensor the test reads does not exist (missing gradient?)\n");
        exit(1);
    }
    float *h = malloc(n->nbytes);
    OK(t->be->ops->to_host(t->be, h, dg_exec_ptr(t->ex, n), n->nbytes));
    return h;
}

void tg_cover(tg_t *t, int failures_before) {
    if (dg_fails != failures_before) return;
    for (int i = 0; i < t->g->n; i++)
        covered |= 1ull << t->g->nodes[i]->op;
}

int tg_count(tg_t *t, dg_op_kind_t k, int acc) {
    int c = 0;
    for (int i = 0; i < t->g->n; i++)
        if (t->g->nodes[i]->op == k && (acc < 0 || t->g->nodes[i]->attr[DG_A_ACC] == acc)) c++;
    return c;
}

void tg_free(tg_t *t) {
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

void check_close(const char *what, const float *got, const double *ref, size_t n, double rtol) {
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
void check_fd(const char *what, double *x, size_t n, const float *g, objective_fn obj, void *ctx) {
    double maxfd = 0, maxerr = 0;
    size_t at = 0;
    double fd_at = 0;
    for (size_t i = 0; i < n; i++) {
        double fd = dg_central_diff(x, i, obj, ctx);
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

double dot(const double *a, const double *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* After a second forward+backward on the same data, parameter grads must be doubled (kernels accumulate
 * +=; an overwrite would leave them unchanged) up to the rounding of the extra additions, and activation
 * grads unchanged bitwise (overwritten, not accumulated). */
void check_accumulation(tg_t *t, int n_par, dg_node_t **par, float **g1, int n_act, dg_node_t **act,
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

double dot_gelu(const double *v, const double *dout, size_t n) {
    double *y = malloc(n * sizeof *y);
    ref_gelu(y, v, n);
    double s = dot(y, dout, n);
    free(y);
    return s;
}

double obj_gelu(void *p) {
    ctx_t *c = p;
    return dot_gelu(c->in[0], c->dout, (size_t)c->d[0]);
}

void tg_check_grads(tg_t *t, int f0, const char *what, int k, dg_node_t *const *lv, const char *const *wrt,
                    const size_t *n, ctx_t *c, objective_fn obj, int n_par) {
    tg_run(t, DG_PHASE_BWD);
    float *g[8];
    for (int i = 0; i < k; i++) {
        g[i] = tg_get(t, i ? lv[i]->grad : dg_node_grad_of(lv[0]));
        char name[96];
        snprintf(name, sizeof name, "%s %s", what, wrt[i]);
        check_fd(name, c->in[i], n[i], g[i], obj, c);
    }
    if (n_par >= 0) {
        dg_node_t *act[1] = {lv[0]};
        float *a1[1] = {g[0]};
        check_accumulation(t, n_par, n_par ? (dg_node_t **)lv + 1 : NULL, n_par ? g + 1 : NULL, 1, act, a1);
    }
    tg_cover(t, f0);
    for (int i = 0; i < k; i++)
        free(g[i]), free(c->in[i]);
    free(c->dout);
}

void tg_check_xwb(tg_t *t, int f0, const char *what, const char *bname, dg_node_t *x, dg_node_t *w,
                  dg_node_t *b, ctx_t *c, const size_t n[3], objective_fn obj, int acc) {
    dg_node_t *lv[3] = {x, w, b};
    const char *wrt[3] = {"d/dx", "d/dw", bname};
    tg_check_grads(t, f0, what, 3, lv, wrt, n, c, obj, acc ? 2 : -1);
}
