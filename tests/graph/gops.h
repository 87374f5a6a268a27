/* gops.h — the harness test_graph_ops shares across its files (gops_harness.c): one small test graph on a
 * backend (leaves filled with seeded random data, autodiff + in-place pass + checked plan + executor),
 * float64 comparisons (check_close, central finite differences, micro-batch accumulation), and the op
 * cases each file defines. A case runs its graph, checks it with EXPECT/OK (tests/lib/dg_check.h, the
 * counters shared by all files of the executable: DG_CHECK_SHARED) and calls tg_cover when its checks
 * passed; main (test_graph_ops.c) fails the run if a registered op kind was never covered. */
#ifndef DG_TESTS_GRAPH_GOPS_H
#define DG_TESTS_GRAPH_GOPS_H
#include <stddef.h>
#include <stdint.h>

#include "graph.h"
#include "gtest.h"
#include "ref64.h"

/* bit per op kind executed in a case that passed its checks */
extern uint64_t covered;

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

/* A fresh graph on `be`; leaves drawn from the generator seeded with `seed`. */
void tg_init(tg_t *t, dg_backend_t *be, uint64_t seed);
/* An f32 leaf (a parameter when flags has DG_NF_PARAM) filled uniformly in [lo, hi); exits on error. */
dg_node_t *tg_f(tg_t *t, const char *name, int ndim, const int64_t *shape, unsigned flags, double lo,
                double hi);
/* An i32 input leaf filled with values in [0, maxv). */
dg_node_t *tg_i(tg_t *t, const char *name, int ndim, const int64_t *shape, int maxv);
/* The host data of leaf n (NULL if n is no leaf of t). */
leaf_t *tg_leaf(tg_t *t, const dg_node_t *n);
/* A malloc'd float64 copy of f[0..n). */
double *to_f64(const float *f, size_t n);
/* A malloc'd float64 copy of leaf n's host data. */
double *tg_d(tg_t *t, const dg_node_t *n);
/* autodiff (when outs given) + in-place pass, plan (checked), persistent memory, uploads, executor */
void tg_finish(tg_t *t, int nout, dg_node_t **outs, dg_node_t **seeds);
/* Run one phase and sync. */
void tg_run(tg_t *t, dg_phase_t ph);
/* A malloc'd host copy of n's device data; exits when n is NULL (a missing gradient). */
float *tg_get(tg_t *t, const dg_node_t *n);
/* Mark every op kind of t's graph covered, if no check failed since failures_before (dg_fails). */
void tg_cover(tg_t *t, int failures_before);
/* How many nodes of kind k (with attr ACC == acc, unless acc < 0) t's graph has. */
int tg_count(tg_t *t, dg_op_kind_t k, int acc);
/* Free the executor, plan, persistent memory, graph and leaves' host data. */
void tg_free(tg_t *t);

/* max|got - ref| <= rtol * max|ref| + 1e-6 over n elements, and ref not all zero. */
void check_close(const char *what, const float *got, const double *ref, size_t n, double rtol);
typedef double (*objective_fn)(void *ctx);
/* Gradient `g` of obj w.r.t. the double array x[0..n) (which obj reads) against central differences. */
void check_fd(const char *what, double *x, size_t n, const float *g, objective_fn obj, void *ctx);
/* sum of a[i] * b[i] */
double dot(const double *a, const double *b, size_t n);
/* sum of dout[i] * gelu(v[i]) */
double dot_gelu(const double *v, const double *dout, size_t n);
/* After a second forward+backward on the same data, parameter grads must be doubled (kernels accumulate
 * +=; an overwrite would leave them unchanged) up to the rounding of the extra additions, and activation
 * grads unchanged bitwise (overwritten, not accumulated). g1 / a1: the first run's gradients. */
void check_accumulation(tg_t *t, int n_par, dg_node_t **par, float **g1, int n_act, dg_node_t **act,
                        float **a1);

/* what a case's objective reads: inputs, tokens, the seed gradient, dimensions, the loss seed */
typedef struct {
    double *in[8];
    const int32_t *tok;
    double *dout;
    int d[6];
    float dloss;
} ctx_t;

/* sum(dout * gelu(in[0])) over d[0] elements: the objective of cases whose output is one GELU */
double obj_gelu(void *p);

/* The backward of a case over k <= 8 leaves lv[0..k) (lv[0] the input x, the rest parameters) whose data
 * obj reads as c->in[0..k) and that took f0 = dg_fails at its start: runs the backward, checks each leaf's
 * gradient (named "<what> <wrt[i]>", n[i] elements) against central differences of obj; with n_par >= 0,
 * then the accumulation over a second micro-batch (parameters lv[1..1+n_par) accumulate, x is
 * overwritten); covers the graph; frees the gradients and c's in[0..k) and dout. */
void tg_check_grads(tg_t *t, int f0, const char *what, int k, dg_node_t *const *lv, const char *const *wrt,
                    const size_t *n, ctx_t *c, objective_fn obj, int n_par);

/* The backward of a case y = op(x, w, b) that took f0 = dg_fails at its start: runs the backward, checks
 * d/dx, d/dw and d/db (named "<what> d/dx", "<what> d/dw", "<what> <bname>") against central differences
 * of obj over c->in[0], in[1], in[2] (n[0], n[1], n[2] elements); with acc, then the accumulation over a
 * second micro-batch (w, b accumulate, x is overwritten); covers the graph; frees the three gradients and
 * c's in[0..2] and dout. */
void tg_check_xwb(tg_t *t, int f0, const char *what, const char *bname, dg_node_t *x, dg_node_t *w,
                  dg_node_t *b, ctx_t *c, const size_t n[3], objective_fn obj, int acc);

/* The cases, by file, listed once: GOPS_CASE(name, seed) is a case on one graph, void case_NAME(tg_t *t,
 * int f0), run on t fresh from tg_init(seed) with f0 = dg_fails before it (main frees t after it);
 * GOPS_CASE_BE(name) builds several graphs itself, void case_NAME(dg_backend_t *be). In the order they
 * run: dense ops (gops_dense.c); the loss, the residual fusions and fan-out (gops_fuse.c); collectives,
 * shards, casts, the optimizer and the norm (gops_optim.c). */
#define GOPS_CASES(GOPS_CASE, GOPS_CASE_BE)                                                                  \
    GOPS_CASE(encoder, 11)                                                                                   \
    GOPS_CASE(layernorm, 12)                                                                                 \
    GOPS_CASE(matmul, 13)                                                                                    \
    GOPS_CASE(matmul_nobias, 14)                                                                             \
    GOPS_CASE(matmul_gelu, 25)                                                                               \
    GOPS_CASE(gelu, 15)                                                                                      \
    GOPS_CASE(mlp_saved, 40)                                                                                 \
    GOPS_CASE(mlp_recompute, 41)                                                                             \
    GOPS_CASE(gelu_acc, 42)                                                                                  \
    GOPS_CASE(attention, 16)                                                                                 \
    GOPS_CASE(add, 17)                                                                                       \
    GOPS_CASE(crossentropy, 18)                                                                              \
    GOPS_CASE_BE(crossentropy_fused)                                                                         \
    GOPS_CASE_BE(matmul_res)                                                                                 \
    GOPS_CASE_BE(fuse_residual)                                                                              \
    GOPS_CASE(fanout1, 19)                                                                                   \
    GOPS_CASE(fanout2, 20)                                                                                   \
    GOPS_CASE_BE(collectives)                                                                                \
    GOPS_CASE_BE(shard_ops)                                                                                  \
    GOPS_CASE_BE(cast)                                                                                       \
    GOPS_CASE_BE(optimizer)                                                                                  \
    GOPS_CASE_BE(optimizer_fused)                                                                            \
    GOPS_CASE_BE(norm_fused)
#define GOPS_DECLARE(name, seed) void case_##name(tg_t *t, int f0);
#define GOPS_DECLARE_BE(name) void case_##name(dg_backend_t *be);
GOPS_CASES(GOPS_DECLARE, GOPS_DECLARE_BE)
#undef GOPS_DECLARE
#undef GOPS_DECLARE_BE

#endif
