/* oph.h — what the files of the op harness (dg_op_harness: op_harness.c and oph_*.c) share; internal,
 * not for drivers (they include op_harness.h). The harness state H of one run, the CALL macro (a backend
 * op call recorded as a check), and by file: oph_core.c the tolerances, the host dtype model, the state's
 * helpers and the check primitives; oph_ref.c the float64 reference of every op; oph_mem_optim.c,
 * oph_matmul.c and oph_layers.c one case function per op. Same contracts as when they were one file. */
#ifndef DG_OPH_H
#define DG_OPH_H
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "op_harness.h"

#define H_MAX_TRACK 256

typedef struct {
    dg_backend_t *be;
    const dg_harness_opts_t *o;
    FILE *log;
    dg_dtype_t act;
    double tol_scale;
    uint64_t rng;
    int checks, failures, cases;
    char cname[192];
    uint64_t digest;
    int bad; /* the current case hit an error that makes its remaining checks meaningless */
    void *dev[H_MAX_TRACK];
    int ndev;
    void *host[H_MAX_TRACK];
    int nhost;
} H;

#define CALL(h, what, ...) oph_call_ok((h), (h)->be->ops->__VA_ARGS__, (what))

typedef double (*objective_fn)(void *ctx);

/* ---- oph_core.c (tolerances, host dtype model, harness state, checks) ---- */
double oph_h_round(double x, dg_dtype_t dt);
size_t oph_dt_size(dg_dtype_t dt);
/* v must already be rounded to dt. */
void oph_h_encode(dg_dtype_t dt, const double *v, void *dst, size_t n);
double oph_h_decode1(dg_dtype_t dt, const void *src, size_t i);
void __attribute__((format(printf, 2, 3))) oph_fail(H *h, const char *fmt, ...);
void __attribute__((format(printf, 2, 3))) oph_pass(H *h, const char *fmt, ...);
/* A backend call: on failure record it with the backend's message and mark the case broken. */
int oph_call_ok(H *h, dg_status_t s, const char *what);
uint64_t oph_rng_next(H *h);
double oph_rng_uniform(H *h);
int oph_rng_int(H *h, int n);
double *oph_hnew(H *h, size_t n);
void *oph_hraw(H *h, size_t bytes);
/* Random values in +-[lo, hi] with random signs: never zero, never tiny. */
double *oph_hrand(H *h, size_t n, double lo, double hi);
void oph_hround(double *v, size_t n, dg_dtype_t dt);
void *oph_dalloc(H *h, dg_dtype_t dt, size_t n);
int oph_upload(H *h, void *dev, dg_dtype_t dt, const double *v, size_t n);
int oph_upload_i32(H *h, void *dev, const int32_t *v, size_t n);
/* Fill with a NaN pattern of the dtype: any element a kernel forgets to write stays NaN. */
int oph_poison(H *h, void *dev, dg_dtype_t dt, size_t n);
/* oph_dalloc, then oph_upload of v / oph_poison: a device buffer with its first contents. */
void *oph_dput(H *h, dg_dtype_t dt, const double *v, size_t n);
void *oph_dpoisoned(H *h, dg_dtype_t dt, size_t n);
void *oph_download_raw(H *h, const void *dev, size_t bytes);
double *oph_download(H *h, const void *dev, dg_dtype_t dt, size_t n);
void oph_digest_add(H *h, const void *bytes, size_t n);
void oph_digest_dev(H *h, const void *dev, size_t bytes);
int oph_case_begin(H *h, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void oph_case_end(H *h);
double oph_tol_of(H *h, const char *op);
/* Elementwise: |got - ref| <= tol * (|ref| + RMS(scale)), scale = `scale` or ref. NaN (a poisoned
 * element never written, or a NaN result) always fails. */
void oph_check_close(H *h, const char *what, const double *got, const double *ref, size_t n, double tol,
                     const double *scale);
/* Scalar version: |got - ref| <= tol * |ref| (ref != 0), or <= tol when ref == 0. */
void oph_check_scalar(H *h, const char *what, double got, double ref, double tol);
void oph_check_bits(H *h, const char *what, const void *a, const void *b, size_t bytes);
/* oph_check_bits of the first `bytes` of two device buffers (downloaded, a first). */
void oph_check_dev_bits(H *h, const char *what, const void *a, const void *b, size_t bytes);
/* Finite differences of a float64 objective f (reading the arrays in ctx, among them x[0..n)) against
 * the backend gradient `got`: a sample of single elements, and directional derivatives along random
 * +-1 vectors, which involve every element. `ref` (the analytic float64 gradient) sets the scale. */
void oph_check_fd(H *h, const char *what, objective_fn f, void *ctx, double *x, size_t n, const double *got,
                  const double *ref, double tol);
double oph_dotd(const double *a, const double *b, size_t n);
double *oph_add_arrays(H *h, const double *a, const double *b, size_t n);
/* ======================= cases ======================= */
void *oph_dalloc_bytes(H *h, size_t bytes);
int oph_poison_bytes(H *h, void *dev, size_t bytes);
/* A device copy of an f32/act buffer, for the aliasing checks. */
void *oph_ddup(H *h, const void *src, size_t bytes);
int32_t *oph_rand_tokens(H *h, size_t n, int V);
/* Random non-zero prior contents of a gradient buffer for an accumulation run (values in +-[0.05, 1],
 * rounded to dt, uploaded to dev); returns the host copy (freed with the case). */
double *oph_prefill(H *h, void *dev, dg_dtype_t dt, size_t n);

/* The three runs of a backward case with an input, a weight and a bias gradient (layernorm, matmul):
 * 1. acc = 0 into poison, weight and bias gradients from zero: close to ref, to finite differences of obj
 *    (when obj is set) and digested; 2. acc = 1 into random prior contents (buffers g2): prior + ref;
 * 3. run 1 again into g2: the same bits. g[0] has dtype dt0, g[1] and g[2] are f32; n[i] elements each.
 * run(h, ctx, g, acc) makes the backend call; the check names are "bwd " + names[i] + what the run says. */
typedef struct {
    const char *names[3];
    void *g1[3], *g2[3];
    dg_dtype_t dt0;
    size_t n[3];
    const double *ref[3];
    double tol;
    void (*run)(H *h, void *ctx, void *const g[3], int acc);
    void *ctx;
    objective_fn obj; /* NULL: no finite-difference check */
    void *obj_ctx;
    double *x[3]; /* the inputs obj reads that the three gradients are of */
} oph_bwd3_t;
void oph_check_bwd3(H *h, const oph_bwd3_t *b);
/* The buffers of b for dt0 and n[0..3) elements: g1[] and g2[] on the device (g[0] of dtype dt0, g[1] and
 * g[2] f32), ref[] on the host (returned in ref, for the caller's float64 reference), and tol = the
 * tolerance of `op`. The caller sets names, run, ctx, obj, obj_ctx and x. */
void oph_bwd3_alloc(H *h, oph_bwd3_t *b, const char *op, dg_dtype_t dt0, const size_t n[3], double *ref[3]);

/* ---- oph_ref.c (float64 references) ---- */
/* ======================= float64 references ======================= */
void oph_ref_encoder(double *out, const int32_t *tok, const double *wte, const double *wpe, int B, int T,
                     int C);
void oph_ref_layernorm(double *out, double *mean, double *rstd, const double *x, const double *w,
                       const double *b, int N, int C);
void oph_ref_layernorm_bwd(double *dx, double *dw, double *db, const double *dy, const double *x,
                           const double *w, int N, int C);
double oph_ref_gelu1(double x);
double oph_ref_gelu_grad1(double x);
/* out = x·wᵀ + bias; with gelu, pre gets the linear part and out its GELU. */
void oph_ref_matmul(double *out, double *pre, const double *x, const double *w, const double *bias, int N,
                    int C, int OC, int gelu);
void oph_ref_matmul_bwd(double *dx, double *dw, double *db, const double *dy, const double *x,
                        const double *w, int N, int C, int OC);
void oph_ref_attention(double *out, const double *qkv, int B, int T, int C, int NH, double *p);
void oph_ref_attention_bwd(double *dqkv, const double *dout, const double *qkv, int B, int T, int C, int NH,
                           double *p, double *dp);
void oph_ref_ce(double *loss, double *lse, const double *z, const int32_t *tg, int N, int V, int Vp);
void oph_ref_ce_bwd(double *dz, const double *z, const int32_t *tg, int N, int V, int Vp, double dloss);

/* ---- oph_mem_optim.c (cases: memory, casts, elementwise, sumsq, clip, adamw, fences) ---- */
void oph_case_memory(H *h);
void oph_case_cast(H *h, dg_dtype_t st, dg_dtype_t dt, size_t n);
void oph_case_elementwise(H *h, size_t n);
void oph_case_sumsq(H *h, size_t n);
void oph_case_sumsq_multi(H *h, int variant);
void oph_case_clip(H *h);
void oph_case_adamw(H *h, size_t n, int64_t t, int with_compute);
void oph_case_adamw_multi(H *h, int with_compute);
void oph_case_download_fence(H *h);

/* ---- oph_matmul.c (cases: matmul, matmul_fwd_res, matmul_bwd_dgelu) ---- */
void oph_case_matmul(H *h, int N, int C, int OC, int has_bias, int gelu, int fd);
void oph_case_matmul_res(H *h, int N, int C, int OC, int has_bias, int off);
void oph_case_matmul_dgelu(H *h, int N, int C, int OC, int has_bias, int fd);

/* ---- oph_layers.c (cases: encoder, layernorm, gelu, attention, cross-entropy) ---- */
void oph_case_encoder(H *h, int B, int T, int C, int V, int Vp, int fd);
void oph_case_layernorm(H *h, int N, int C, double offset, int fd);
void oph_case_gelu(H *h, size_t n, int fd);
void oph_case_attention(H *h, int B, int T, int C, int NH, int fd);
void oph_case_crossentropy(H *h, int N, int V, int Vp, int fd);
void oph_case_crossentropy_fused(H *h, int N, int V, int Vp, int lg_off, int dl_off);
#endif
