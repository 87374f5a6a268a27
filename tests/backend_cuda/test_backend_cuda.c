/* test_backend_cuda.c — GPU tests of the CUDA backend. Exits 77 (ctest SKIP) with a message when there is
 * no GPU, except in --mode errors, which also checks that creation then fails cleanly.
 *
 *   test_backend_cuda --mode harness     [--dtype f32|bf16|f16] [--only S] [--verbose] [--no-fd]
 *       every op against the float64 references of tests/backend/op_harness (odd shapes, poison,
 *       accumulation, aliasing, finite differences, repeat-bitwise), the large shapes included
 *       (layernorm at N = 32768, C = 768, ...);
 *   test_backend_cuda --mode cpu         [--dtype ...] [--only S] [--small]
 *       every op against the CPU backend at GPT-2-like shapes (head size 64 and 32, which take the
 *       tensor-core attention path; C = 768 and 1600; V = 50257 padded to 50304; multiples of 8 that take
 *       the fused GEMM epilogues, the DGELU one of matmul_bwd_dgelu included), then a 3-step one-block
 *       training run on both backends;
 *   test_backend_cuda --mode determinism [--dtype ...] [--small]
 *       the same training run twice: losses, gradient norms and all parameters bitwise equal;
 *   test_backend_cuda --mode errors
 *       bad input gives clear errors (never a crash); no GPU gives "no CUDA device".
 *   --under-test-cpu runs the CPU backend in place of the CUDA one (f32): a check of this program on
 *   machines without a GPU.
 *   test_backend_cuda --mode probe
 *       exit 0 when a GPU is usable, 77 otherwise (for the compute-sanitizer wrappers).
 *   test_backend_cuda --mode attn-builtin [--dtype bf16|f16] [--small] [--verbose]
 *       the built-in attention (DG_CUDA_ATTN_CUDNN=0): the tensor-core kernels against the generic ones
 *       (DG_CUDA_FAST_ATTENTION=0, the reference) on the same random inputs ((B,T) in (2,1024) (2,200)
 *       (3,13) (1,333) (2,129), head sizes 64 and 32): out, logsumexp and dqkv within the vs-CPU
 *       tolerances, every element written by both (outputs poisoned with NaN first), the tensor-core ones
 *       bitwise reproducible run to run and not bitwise the generic ones everywhere (else they did not
 *       run); without --small, a timing line of both at B=32 T=1024 C=768 NH=12.
 *   test_backend_cuda --mode attn-cudnn  [--dtype bf16|f16] [--small]
 *       cuDNN's fused attention (the bf16/f16 default) against the built-in kernels (DG_CUDA_ATTN_CUDNN=0)
 *       on the same inputs: out, logsumexp, dqkv within the vs-CPU tolerances, bitwise reproducible, the
 *       GPT-2 shape served by cuDNN where cuDNN loads; then a timing line of both at B=32 T=1024 C=768
 *       NH=12.
 * Exit status: 0 all passed, 1 a check failed, 77 skipped (no GPU).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "backend.h"
#include "dg_env.h"
#include "dg_test_skip.h"
#include "ministep.h"
#include "op_harness.h"

#define SKIP 77

static int g_checks, g_fails, g_verbose;
static const char *g_only;

static void check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void check(int ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    g_checks++;
    if (!ok) g_fails++;
    if (!ok || g_verbose) {
        printf("%s ", ok ? "ok  " : "FAIL");
        vprintf(fmt, ap);
        printf("\n");
        fflush(stdout);
    }
    va_end(ap);
}

static dg_dtype_t parse_dtype(const char *s) {
    if (!strcmp(s, "f32") || !strcmp(s, "fp32")) return DG_F32;
    if (!strcmp(s, "bf16")) return DG_BF16;
    if (!strcmp(s, "f16") || !strcmp(s, "fp16")) return DG_F16;
    fprintf(stderr, "test_backend_cuda: --dtype %s: expected f32, bf16 or f16\n", s);
    exit(2);
}

/* NULL and *skip = 1 when there is no GPU; exits on any other failure, and under CI=true also when the
 * machine has a GPU that CUDA cannot use (tests/lib/dg_test_skip.h). */
static dg_backend_t *make_cuda(dg_dtype_t act, int *skip) {
    dg_backend_config_t cfg = {.act_dtype = act, .device = 0, .threads = 0, .seed = 1};
    dg_backend_t *be = NULL;
    *skip = 0;
    dg_status_t s = dg_backend_cuda_create(&cfg, &be);
    if (s == DG_OK) return be;
    if (strstr(dg_last_error(), "no CUDA device")) {
        int rc = dg_test_skip(1, "%s", dg_last_error());
        if (rc != SKIP) exit(rc);
        *skip = 1;
        return NULL;
    }
    fprintf(stderr, "cannot create the cuda backend: %s (%s)\n", dg_last_error(), dg_last_error_where());
    exit(1);
}

#define MUST(call)                                                                                           \
    do {                                                                                                     \
        dg_status_t must_s_ = (call);                                                                        \
        if (must_s_ != DG_OK) {                                                                              \
            fprintf(stderr, "FAIL %s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call, dg_last_error(),         \
                    dg_last_error_where());                                                                  \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

/* ======================= CUDA vs CPU ======================= */

typedef struct {
    dg_backend_t *g, *c; /* CUDA under test, CPU reference (f32) */
    dg_dtype_t act;
    uint64_t rng;
    void *gb[128], *cb[128];
    int ng, nc;
    float *hb[128];
    int nh;
} cmp_t;

static uint64_t rnext(cmp_t *x) {
    uint64_t z = (x->rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float *hbuf(cmp_t *x, size_t n) {
    DG_ASSERT(x->nh < 128);
    return x->hb[x->nh++] = dg_xcalloc(n ? n : 1, sizeof(float));
}
/* random values of magnitude in [lo, hi] with random signs: never zero */
static float *hrand(cmp_t *x, size_t n, float lo, float hi) {
    float *p = hbuf(x, n);
    for (size_t i = 0; i < n; i++) {
        float v = lo + (hi - lo) * (float)((double)(rnext(x) >> 11) / 9007199254740992.0);
        p[i] = (rnext(x) & 1) ? v : -v;
    }
    return p;
}
static void *galloc(cmp_t *x, size_t bytes) {
    void *p = NULL;
    MUST(x->g->ops->alloc(x->g, bytes, &p));
    DG_ASSERT(x->ng < 128);
    return x->gb[x->ng++] = p;
}
static void *calloc_c(cmp_t *x, size_t bytes) {
    void *p = NULL;
    MUST(x->c->ops->alloc(x->c, bytes, &p));
    DG_ASSERT(x->nc < 128);
    return x->cb[x->nc++] = p;
}
static void cmp_reset(cmp_t *x) {
    for (int i = 0; i < x->ng; i++)
        x->g->ops->free(x->g, x->gb[i]);
    for (int i = 0; i < x->nc; i++)
        x->c->ops->free(x->c, x->cb[i]);
    for (int i = 0; i < x->nh; i++)
        free(x->hb[i]);
    x->ng = x->nc = x->nh = 0;
}

/* A tensor in both backends: act dtype on the GPU, f32 on the CPU holding the same (rounded) values.
 * The rounding goes through the GPU's own cast, which the harness checks bit-exact against RNE. */
typedef struct {
    void *g, *c;
    float *h; /* host copy of the rounded values */
    size_t n;
} pair_t;

static pair_t pair_act(cmp_t *x, const float *h, size_t n) {
    pair_t p = {NULL, NULL, hbuf(x, n), n};
    float *tmp = galloc(x, n * 4);
    p.g = galloc(x, n * dg_dtype_size(x->act));
    MUST(x->g->ops->to_device(x->g, tmp, h, n * 4));
    MUST(x->g->ops->cast(x->g, p.g, x->act, tmp, DG_F32, n));
    MUST(x->g->ops->cast(x->g, tmp, DG_F32, p.g, x->act, n));
    MUST(x->g->ops->to_host(x->g, p.h, tmp, n * 4));
    p.c = calloc_c(x, n * 4);
    MUST(x->c->ops->to_device(x->c, p.c, p.h, n * 4));
    return p;
}
static pair_t pair_f32(cmp_t *x, const float *h, size_t n) {
    pair_t p = {galloc(x, n * 4), calloc_c(x, n * 4), hbuf(x, n), n};
    memcpy(p.h, h, n * 4);
    MUST(x->g->ops->to_device(x->g, p.g, h, n * 4));
    MUST(x->c->ops->to_device(x->c, p.c, h, n * 4));
    return p;
}
static pair_t pair_i32(cmp_t *x, const int32_t *h, size_t n) {
    pair_t p = {galloc(x, n * 4), calloc_c(x, n * 4), NULL, n};
    MUST(x->g->ops->to_device(x->g, p.g, h, n * 4));
    MUST(x->c->ops->to_device(x->c, p.c, h, n * 4));
    return p;
}
/* Output buffers; the GPU one poisoned with NaN (all-ones bytes) so unwritten elements fail. */
static pair_t pair_out(cmp_t *x, size_t n, dg_dtype_t gdt) {
    pair_t p = {galloc(x, n * dg_dtype_size(gdt)), calloc_c(x, n * 4), NULL, n};
    unsigned char *ff = malloc(n * dg_dtype_size(gdt));
    memset(ff, 0xFF, n * dg_dtype_size(gdt));
    MUST(x->g->ops->to_device(x->g, p.g, ff, n * dg_dtype_size(gdt)));
    MUST(x->g->ops->sync(x->g));
    free(ff);
    return p;
}
static float *down_g(cmp_t *x, const void *dev, dg_dtype_t dt, size_t n) {
    float *h = hbuf(x, n);
    if (dt == DG_F32) {
        MUST(x->g->ops->to_host(x->g, h, dev, n * 4));
    } else {
        float *tmp = galloc(x, n * 4);
        MUST(x->g->ops->cast(x->g, tmp, DG_F32, dev, dt, n));
        MUST(x->g->ops->to_host(x->g, h, tmp, n * 4));
    }
    return h;
}
static float *down_c(cmp_t *x, const void *dev, size_t n) {
    float *h = hbuf(x, n);
    MUST(x->c->ops->to_host(x->c, h, dev, n * 4));
    return h;
}

/* Elementwise |g - r| / (|r| + rms(r)) <= tol; NaN/inf fail. */
static void compare(const char *cname, const char *what, const float *g, const float *r, size_t n,
                    double tol) {
    double ss = 0;
    for (size_t i = 0; i < n; i++)
        ss += (double)r[i] * r[i];
    double floor = n ? sqrt(ss / n) : 0;
    if (floor == 0) floor = 1e-30;
    double worst = 0;
    size_t wi = 0, bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(g[i])) {
            if (!bad++) wi = i;
            continue;
        }
        double e = fabs((double)g[i] - r[i]) / (fabs(r[i]) + floor);
        if (!bad && e > worst) {
            worst = e;
            wi = i;
        }
    }
    if (bad)
        check(0, "%s %s: %zu of %zu elements not finite (first [%zu] = %g)", cname, what, bad, n, wi, g[wi]);
    else
        check(worst <= tol, "%s %s: max rel err %.3g (tol %.3g) at [%zu]: cuda %.8g cpu %.8g (n=%zu)", cname,
              what, worst, tol, wi, g[wi], r[wi], n);
}

/* The harness's bound against float64, doubled: CUDA and CPU are each within it of the exact result, so
 * their difference is within twice it (e.g. dwte sums of ~80 rows in f32 come out in different orders). */
static double tol(const char *op, dg_dtype_t act) {
    double t = dg_op_harness_tolerance(op, act);
    DG_ASSERT(t >= 0);
    return 2.0 * t;
}

static int want(const char *name) {
    return !g_only || !*g_only || strstr(name, g_only);
}

static void cmp_matmul(cmp_t *x, int N, int C, int OC, int bias, int gelu) {
    char nm[128];
    snprintf(nm, sizeof nm, "matmul[N=%d,C=%d,OC=%d%s%s]", N, C, OC, bias ? ",bias" : "",
             gelu ? ",gelu" : "");
    if (!want(nm)) return;
    const dg_dtype_t A = x->act;
    const size_t nx = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
    pair_t in = pair_act(x, hrand(x, nx, 0.05f, 1.f), nx), w = pair_act(x, hrand(x, nw, 0.01f, 0.1f), nw);
    pair_t b = pair_act(x, hrand(x, OC, 0.05f, 0.5f), OC), dy = pair_act(x, hrand(x, no, 0.05f, 1.f), no);
    pair_t out = pair_out(x, no, A), pre = pair_out(x, no, A);
    const dg_epilogue_t epi = gelu ? DG_EPI_GELU : DG_EPI_NONE;
    MUST(
        x->g->ops->matmul_fwd(x->g, out.g, gelu ? pre.g : NULL, in.g, w.g, bias ? b.g : NULL, N, C, OC, epi));
    MUST(
        x->c->ops->matmul_fwd(x->c, out.c, gelu ? pre.c : NULL, in.c, w.c, bias ? b.c : NULL, N, C, OC, epi));
    compare(nm, "fwd out", down_g(x, out.g, A, no), down_c(x, out.c, no), no, tol("matmul_fwd", A));
    if (gelu) compare(nm, "fwd pre", down_g(x, pre.g, A, no), down_c(x, pre.c, no), no, tol("matmul_fwd", A));
    /* backward: dinp overwrite, dw and dbias added into non-zero gradients */
    pair_t dx = pair_out(x, nx, A);
    pair_t dw = pair_f32(x, hrand(x, nw, 0.01f, 0.1f), nw), db = pair_f32(x, hrand(x, OC, 0.01f, 0.1f), OC);
    MUST(x->g->ops->matmul_bwd(x->g, dx.g, dw.g, bias ? db.g : NULL, dy.g, in.g, w.g, N, C, OC, 0));
    MUST(x->c->ops->matmul_bwd(x->c, dx.c, dw.c, bias ? db.c : NULL, dy.c, in.c, w.c, N, C, OC, 0));
    compare(nm, "bwd dinp", down_g(x, dx.g, A, nx), down_c(x, dx.c, nx), nx, tol("matmul_bwd", A));
    compare(nm, "bwd dw (+=)", down_g(x, dw.g, DG_F32, nw), down_c(x, dw.c, nw), nw, tol("matmul_bwd", A));
    if (bias)
        compare(nm, "bwd dbias (+=)", down_g(x, db.g, DG_F32, OC), down_c(x, db.c, OC), OC,
                tol("matmul_bwd", A));
    /* acc = 1 on the input gradient (into the dinp just computed) */
    pair_t dw2 = pair_f32(x, hrand(x, nw, 0.01f, 0.1f), nw);
    MUST(x->g->ops->matmul_bwd(x->g, dx.g, dw2.g, NULL, dy.g, in.g, w.g, N, C, OC, 1));
    MUST(x->c->ops->matmul_bwd(x->c, dx.c, dw2.c, NULL, dy.c, in.c, w.c, N, C, OC, 1));
    compare(nm, "bwd dinp (acc=1)", down_g(x, dx.g, A, nx), down_c(x, dx.c, nx), nx, tol("matmul_bwd", A));
    cmp_reset(x);
}

/* matmul_fwd_res (contract v1.11: the residual add in the GEMM, beta = 1 and C = res) against the CPU
 * backend (matmul_fwd + add), out of place (res left as it was) and in place (out == res). */
static void cmp_matmul_res(cmp_t *x, int N, int C, int OC, int bias) {
    char nm[128];
    snprintf(nm, sizeof nm, "matmul_fwd_res[N=%d,C=%d,OC=%d%s]", N, C, OC, bias ? ",bias" : "");
    if (!want(nm)) return;
    const dg_dtype_t A = x->act;
    const size_t nx = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
    pair_t in = pair_act(x, hrand(x, nx, 0.05f, 1.f), nx), w = pair_act(x, hrand(x, nw, 0.01f, 0.1f), nw);
    pair_t b = pair_act(x, hrand(x, OC, 0.05f, 0.5f), OC), r = pair_act(x, hrand(x, no, 0.05f, 2.f), no);
    pair_t out = pair_out(x, no, A);
    MUST(x->g->ops->matmul_fwd_res(x->g, out.g, in.g, w.g, bias ? b.g : NULL, r.g, N, C, OC));
    MUST(x->c->ops->matmul_fwd_res(x->c, out.c, in.c, w.c, bias ? b.c : NULL, r.c, N, C, OC));
    const double t = tol("matmul_fwd_res", A);
    compare(nm, "out", down_g(x, out.g, A, no), down_c(x, out.c, no), no, t);
    compare(nm, "res unchanged (out of place)", down_g(x, r.g, A, no), r.h, no, 0.0);
    MUST(x->g->ops->matmul_fwd_res(x->g, r.g, in.g, w.g, bias ? b.g : NULL, r.g, N, C, OC));
    MUST(x->c->ops->matmul_fwd_res(x->c, r.c, in.c, w.c, bias ? b.c : NULL, r.c, N, C, OC));
    compare(nm, "in place (out == res)", down_g(x, r.g, A, no), down_c(x, r.c, no), no, t);
    cmp_reset(x);
}

/* matmul_bwd_dgelu (mlp.proj's backward through fc's GELU) against the CPU backend: C % 8 == 0 takes
 * cuBLASLt's DGELU epilogue in bf16/f16 (unless DG_CUDA_FUSED_EPILOGUES=0 or DG_CUDA_FUSED_DGELU=0),
 * other C the GEMM + gelu_bwd fallback; then acc = 1 (always the fallback) and dpre in place over inp. */
static void cmp_matmul_dgelu(cmp_t *x, int N, int C, int OC, int bias) {
    char nm[128];
    snprintf(nm, sizeof nm, "matmul_bwd_dgelu[N=%d,C=%d,OC=%d%s]", N, C, OC, bias ? ",bias" : "");
    if (!want(nm)) return;
    const dg_dtype_t A = x->act;
    const size_t nx = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
    pair_t pre = pair_act(x, hrand(x, nx, 0.01f, 4.f), nx), w = pair_act(x, hrand(x, nw, 0.01f, 0.1f), nw);
    pair_t dy = pair_act(x, hrand(x, no, 0.05f, 1.f), no);
    /* the GELU output as each backend computes it (the CUDA one rounded to the act dtype) */
    pair_t in = pair_out(x, nx, A);
    MUST(x->g->ops->gelu_fwd(x->g, in.g, pre.g, nx));
    MUST(x->c->ops->gelu_fwd(x->c, in.c, pre.c, nx));
    pair_t dp = pair_out(x, nx, A);
    pair_t dw = pair_f32(x, hrand(x, nw, 0.01f, 0.1f), nw), db = pair_f32(x, hrand(x, OC, 0.01f, 0.1f), OC);
    MUST(x->g->ops->matmul_bwd_dgelu(x->g, dp.g, dw.g, bias ? db.g : NULL, dy.g, in.g, w.g, pre.g, N, C, OC,
                                     0));
    MUST(x->c->ops->matmul_bwd_dgelu(x->c, dp.c, dw.c, bias ? db.c : NULL, dy.c, in.c, w.c, pre.c, N, C, OC,
                                     0));
    const double t = tol("matmul_bwd_dgelu", A);
    compare(nm, "dpre", down_g(x, dp.g, A, nx), down_c(x, dp.c, nx), nx, t);
    compare(nm, "dw (+=)", down_g(x, dw.g, DG_F32, nw), down_c(x, dw.c, nw), nw, t);
    if (bias) compare(nm, "dbias (+=)", down_g(x, db.g, DG_F32, OC), down_c(x, db.c, OC), OC, t);
    MUST(x->g->ops->matmul_bwd_dgelu(x->g, dp.g, dw.g, NULL, dy.g, in.g, w.g, pre.g, N, C, OC, 1));
    MUST(x->c->ops->matmul_bwd_dgelu(x->c, dp.c, dw.c, NULL, dy.c, in.c, w.c, pre.c, N, C, OC, 1));
    compare(nm, "dpre (acc=1)", down_g(x, dp.g, A, nx), down_c(x, dp.c, nx), nx, t);
    MUST(x->g->ops->matmul_bwd_dgelu(x->g, in.g, dw.g, NULL, dy.g, in.g, w.g, pre.g, N, C, OC, 0));
    MUST(x->c->ops->matmul_bwd_dgelu(x->c, in.c, dw.c, NULL, dy.c, in.c, w.c, pre.c, N, C, OC, 0));
    compare(nm, "dpre in place over inp", down_g(x, in.g, A, nx), down_c(x, in.c, nx), nx, t);
    cmp_reset(x);
}

static void cmp_layernorm(cmp_t *x, int N, int C) {
    char nm[96];
    snprintf(nm, sizeof nm, "layernorm[N=%d,C=%d]", N, C);
    if (!want(nm)) return;
    const dg_dtype_t A = x->act;
    const size_t n = (size_t)N * C;
    float *hx = hrand(x, n, 0.05f, 1.5f);
    for (size_t i = 0; i < n; i++)
        hx[i] += 0.7f; /* non-zero row means */
    pair_t in = pair_act(x, hx, n), w = pair_act(x, hrand(x, C, 0.5f, 1.5f), C);
    pair_t b = pair_act(x, hrand(x, C, 0.05f, 0.5f), C), dy = pair_act(x, hrand(x, n, 0.05f, 1.f), n);
    pair_t out = pair_out(x, n, A), mean = pair_out(x, N, DG_F32), rstd = pair_out(x, N, DG_F32);
    MUST(x->g->ops->layernorm_fwd(x->g, out.g, mean.g, rstd.g, in.g, w.g, b.g, N, C));
    MUST(x->c->ops->layernorm_fwd(x->c, out.c, mean.c, rstd.c, in.c, w.c, b.c, N, C));
    const double tf = tol("layernorm_fwd", A), tb = tol("layernorm_bwd", A);
    compare(nm, "fwd out", down_g(x, out.g, A, n), down_c(x, out.c, n), n, tf);
    compare(nm, "fwd mean", down_g(x, mean.g, DG_F32, N), down_c(x, mean.c, N), N, tf);
    compare(nm, "fwd rstd", down_g(x, rstd.g, DG_F32, N), down_c(x, rstd.c, N), N, tf);
    pair_t dx = pair_out(x, n, A);
    pair_t dw = pair_f32(x, hrand(x, C, 0.01f, 0.1f), C), db = pair_f32(x, hrand(x, C, 0.01f, 0.1f), C);
    /* both backends use the CPU's saved statistics, so only the backward differs */
    pair_t m2 = pair_f32(x, down_c(x, mean.c, N), N), r2 = pair_f32(x, down_c(x, rstd.c, N), N);
    MUST(x->g->ops->layernorm_bwd(x->g, dx.g, dw.g, db.g, dy.g, in.g, w.g, m2.g, r2.g, N, C, 0));
    MUST(x->c->ops->layernorm_bwd(x->c, dx.c, dw.c, db.c, dy.c, in.c, w.c, m2.c, r2.c, N, C, 0));
    compare(nm, "bwd dinp", down_g(x, dx.g, A, n), down_c(x, dx.c, n), n, tb);
    compare(nm, "bwd dw (+=)", down_g(x, dw.g, DG_F32, C), down_c(x, dw.c, C), C, tb);
    compare(nm, "bwd db (+=)", down_g(x, db.g, DG_F32, C), down_c(x, db.c, C), C, tb);
    cmp_reset(x);
}

static void cmp_attention(cmp_t *x, int B, int T, int C, int NH) {
    char nm[96];
    snprintf(nm, sizeof nm, "attention[B=%d,T=%d,C=%d,NH=%d]", B, T, C, NH);
    if (!want(nm)) return;
    const dg_dtype_t A = x->act;
    const size_t nq = (size_t)B * T * 3 * C, no = (size_t)B * T * C;
    pair_t qkv = pair_act(x, hrand(x, nq, 0.05f, 1.5f), nq), dy = pair_act(x, hrand(x, no, 0.05f, 1.f), no);
    pair_t out = pair_out(x, no, A), dq = pair_out(x, nq, A);
    void *gaux = galloc(x, x->g->ops->attention_aux_bytes(x->g, B, T, C, NH));
    void *caux = calloc_c(x, x->c->ops->attention_aux_bytes(x->c, B, T, C, NH));
    MUST(x->g->ops->attention_fwd(x->g, out.g, gaux, qkv.g, B, T, C, NH));
    MUST(x->c->ops->attention_fwd(x->c, out.c, caux, qkv.c, B, T, C, NH));
    compare(nm, "fwd out", down_g(x, out.g, A, no), down_c(x, out.c, no), no, tol("attention_fwd", A));
    MUST(x->g->ops->attention_bwd(x->g, dq.g, dy.g, qkv.g, out.g, gaux, B, T, C, NH));
    MUST(x->c->ops->attention_bwd(x->c, dq.c, dy.c, qkv.c, out.c, caux, B, T, C, NH));
    compare(nm, "bwd dqkv", down_g(x, dq.g, A, nq), down_c(x, dq.c, nq), nq, tol("attention_bwd", A));
    cmp_reset(x);
}

static void cmp_encoder(cmp_t *x, int B, int T, int C, int V) {
    char nm[96];
    snprintf(nm, sizeof nm, "encoder[B=%d,T=%d,C=%d,V=%d]", B, T, C, V);
    if (!want(nm)) return;
    const dg_dtype_t A = x->act;
    const size_t N = (size_t)B * T, nte = (size_t)V * C, npe = (size_t)T * C;
    int32_t *tok = malloc(N * 4);
    for (size_t i = 0; i < N; i++)
        tok[i] = (int32_t)(rnext(x) % (uint64_t)(i % 3 ? V : 17)); /* hot ids */
    pair_t tk = pair_i32(x, tok, N);
    free(tok);
    pair_t wte = pair_act(x, hrand(x, nte, 0.05f, 1.f), nte),
           wpe = pair_act(x, hrand(x, npe, 0.05f, 1.f), npe);
    pair_t dy = pair_act(x, hrand(x, N * C, 0.05f, 1.f), N * C), out = pair_out(x, N * C, A);
    MUST(x->g->ops->encoder_fwd(x->g, out.g, tk.g, wte.g, wpe.g, B, T, C));
    MUST(x->c->ops->encoder_fwd(x->c, out.c, tk.c, wte.c, wpe.c, B, T, C));
    compare(nm, "fwd out", down_g(x, out.g, A, N * C), down_c(x, out.c, N * C), N * C, tol("encoder_fwd", A));
    pair_t dte = pair_f32(x, hrand(x, nte, 0.01f, 0.1f), nte),
           dpe = pair_f32(x, hrand(x, npe, 0.01f, 0.1f), npe);
    MUST(x->g->ops->encoder_bwd(x->g, dte.g, dpe.g, dy.g, tk.g, B, T, C));
    MUST(x->c->ops->encoder_bwd(x->c, dte.c, dpe.c, dy.c, tk.c, B, T, C));
    compare(nm, "bwd dwte (+=)", down_g(x, dte.g, DG_F32, nte), down_c(x, dte.c, nte), nte,
            tol("encoder_bwd", A));
    compare(nm, "bwd dwpe (+=)", down_g(x, dpe.g, DG_F32, npe), down_c(x, dpe.c, npe), npe,
            tol("encoder_bwd", A));
    cmp_reset(x);
}

/* Two GPU buffers hold the same bytes. */
static void same_bits(cmp_t *x, const char *cname, const char *what, const void *a, const void *b,
                      size_t bytes) {
    unsigned char *ha = malloc(bytes), *hb = malloc(bytes);
    MUST(x->g->ops->to_host(x->g, ha, a, bytes));
    MUST(x->g->ops->to_host(x->g, hb, b, bytes));
    size_t i = 0;
    while (i < bytes && ha[i] == hb[i])
        i++;
    check(i == bytes, "%s %s: bitwise equal (%zu bytes; first difference at byte %zu)", cname, what, bytes,
          i);
    free(ha);
    free(hb);
}

static void cmp_ce(cmp_t *x, int N, int V, int Vp) {
    char nm[96];
    snprintf(nm, sizeof nm, "crossentropy[N=%d,V=%d,Vp=%d]", N, V, Vp);
    if (!want(nm)) return;
    const dg_dtype_t A = x->act;
    const size_t nz = (size_t)N * Vp;
    int32_t *tg = malloc(N * 4);
    for (int i = 0; i < N; i++)
        tg[i] = (int32_t)(rnext(x) % (uint64_t)V);
    tg[0] = V - 1;
    pair_t t = pair_i32(x, tg, N);
    free(tg);
    pair_t z = pair_act(x, hrand(x, nz, 0.05f, 6.f), nz);
    pair_t loss = pair_out(x, N, DG_F32), lse = pair_out(x, N, DG_F32), dz = pair_out(x, nz, A);
    MUST(x->g->ops->crossentropy_fwd(x->g, loss.g, lse.g, z.g, t.g, N, V, Vp));
    MUST(x->c->ops->crossentropy_fwd(x->c, loss.c, lse.c, z.c, t.c, N, V, Vp));
    compare(nm, "fwd losses", down_g(x, loss.g, DG_F32, N), down_c(x, loss.c, N), N,
            tol("crossentropy_fwd", A));
    compare(nm, "fwd lse", down_g(x, lse.g, DG_F32, N), down_c(x, lse.c, N), N, tol("crossentropy_fwd", A));
    const float dl = 1.0f / (float)N;
    MUST(x->g->ops->crossentropy_bwd(x->g, dz.g, z.g, lse.g, t.g, N, V, Vp, dl));
    MUST(x->c->ops->crossentropy_bwd(x->c, dz.c, z.c, lse.c, t.c, N, V, Vp, dl));
    float *ref = down_c(x, dz.c, nz);
    compare(nm, "bwd dlogits", down_g(x, dz.g, A, nz), ref, nz, tol("crossentropy_bwd", A));
    /* v1.10: the fused op, bitwise the pair above on the GPU (out of place, then in place over a copy of
     * the logits), and close to the CPU's fused op */
    pair_t loss2 = pair_out(x, N, DG_F32), lse2 = pair_out(x, N, DG_F32), dz2 = pair_out(x, nz, A);
    MUST(x->g->ops->crossentropy_fused(x->g, loss2.g, lse2.g, dz2.g, z.g, t.g, N, V, Vp, dl));
    MUST(x->c->ops->crossentropy_fused(x->c, loss2.c, lse2.c, dz2.c, z.c, t.c, N, V, Vp, dl));
    same_bits(x, nm, "fused losses == crossentropy_fwd's", loss2.g, loss.g, (size_t)N * 4);
    same_bits(x, nm, "fused lse == crossentropy_fwd's", lse2.g, lse.g, (size_t)N * 4);
    same_bits(x, nm, "fused dlogits == crossentropy_bwd's", dz2.g, dz.g, nz * dg_dtype_size(A));
    compare(nm, "fused losses vs cpu", down_g(x, loss2.g, DG_F32, N), down_c(x, loss2.c, N), N,
            tol("crossentropy_fwd", A));
    compare(nm, "fused dlogits vs cpu", down_g(x, dz2.g, A, nz), down_c(x, dz2.c, nz), nz,
            tol("crossentropy_bwd", A));
    void *zc = galloc(x, nz * dg_dtype_size(A));
    MUST(x->g->ops->copy(x->g, zc, z.g, nz * dg_dtype_size(A)));
    pair_t loss3 = pair_out(x, N, DG_F32), lse3 = pair_out(x, N, DG_F32);
    MUST(x->g->ops->crossentropy_fused(x->g, loss3.g, lse3.g, zc, zc, t.g, N, V, Vp, dl));
    same_bits(x, nm, "fused in place: losses", loss3.g, loss.g, (size_t)N * 4);
    same_bits(x, nm, "fused in place: dlogits == crossentropy_bwd's", zc, dz.g, nz * dg_dtype_size(A));
    /* in place */
    MUST(x->g->ops->crossentropy_bwd(x->g, z.g, z.g, lse.g, t.g, N, V, Vp, dl));
    compare(nm, "bwd dlogits in place", down_g(x, z.g, A, nz), ref, nz, tol("crossentropy_bwd", A));
    cmp_reset(x);
}

static void cmp_misc(cmp_t *x, size_t n) {
    char nm[96];
    snprintf(nm, sizeof nm, "gelu/adamw/sumsq[n=%zu]", n);
    if (!want(nm)) return;
    const dg_dtype_t A = x->act;
    pair_t in = pair_act(x, hrand(x, n, 0.01f, 5.f), n), dy = pair_act(x, hrand(x, n, 0.05f, 1.f), n);
    pair_t out = pair_out(x, n, A), dx = pair_out(x, n, A);
    MUST(x->g->ops->gelu_fwd(x->g, out.g, in.g, n));
    MUST(x->c->ops->gelu_fwd(x->c, out.c, in.c, n));
    compare(nm, "gelu fwd", down_g(x, out.g, A, n), down_c(x, out.c, n), n, tol("gelu_fwd", A));
    MUST(x->g->ops->gelu_bwd(x->g, dx.g, in.g, dy.g, n, 0));
    MUST(x->c->ops->gelu_bwd(x->c, dx.c, in.c, dy.c, n, 0));
    compare(nm, "gelu bwd", down_g(x, dx.g, A, n), down_c(x, dx.c, n), n, tol("gelu_bwd", A));
    /* AdamW with a device grad scale, then the gradient norm and clip factor */
    float *hv = hrand(x, n, 0.001f, 0.1f);
    for (size_t i = 0; i < n; i++)
        hv[i] = fabsf(hv[i]);
    pair_t p = pair_f32(x, hrand(x, n, 0.1f, 2.f), n), g = pair_f32(x, hrand(x, n, 0.01f, 1.f), n);
    pair_t m = pair_f32(x, hrand(x, n, 0.001f, 0.1f), n), v = pair_f32(x, hv, n);
    const float gsv = 0.7f;
    pair_t gs = pair_f32(x, &gsv, 1), comp = pair_out(x, n, A);
    MUST(x->g->ops->adamw(x->g, p.g, comp.g, g.g, m.g, v.g, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 5, gs.g));
    MUST(x->c->ops->adamw(x->c, p.c, comp.c, g.c, m.c, v.c, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 5, gs.c));
    compare(nm, "adamw master", down_g(x, p.g, DG_F32, n), down_c(x, p.c, n), n, tol("adamw", A));
    compare(nm, "adamw m", down_g(x, m.g, DG_F32, n), down_c(x, m.c, n), n, tol("adamw", A));
    compare(nm, "adamw v", down_g(x, v.g, DG_F32, n), down_c(x, v.c, n), n, tol("adamw", A));
    compare(nm, "adamw compute copy", down_g(x, comp.g, A, n), down_c(x, comp.c, n), n,
            A == DG_F32    ? tol("adamw", A)
            : A == DG_BF16 ? 8e-3
                           : 1e-3);
    const float zero = 0.f;
    pair_t ss = pair_f32(x, &zero, 1), sc = pair_out(x, 1, DG_F32), nr = pair_out(x, 1, DG_F32);
    MUST(x->g->ops->sumsq_f32(x->g, ss.g, g.g, n));
    MUST(x->c->ops->sumsq_f32(x->c, ss.c, g.c, n));
    compare(nm, "sumsq", down_g(x, ss.g, DG_F32, 1), down_c(x, ss.c, 1), 1, tol("sumsq_f32", A));
    MUST(x->g->ops->clip_scale(x->g, sc.g, nr.g, ss.g, 1.0f, 0.5f));
    MUST(x->c->ops->clip_scale(x->c, sc.c, nr.c, ss.c, 1.0f, 0.5f));
    compare(nm, "clip scale", down_g(x, sc.g, DG_F32, 1), down_c(x, sc.c, 1), 1, tol("clip_scale", A));
    compare(nm, "clip norm", down_g(x, nr.g, DG_F32, 1), down_c(x, nr.c, 1), 1, tol("clip_scale", A));
    cmp_reset(x);
}

/* 3 optimizer steps of the one-block model on both backends: losses and gradient norms close. */
static void cmp_ministep(dg_backend_t *g, dg_backend_t *c, dg_dtype_t act, int small) {
    const char *nm = "train-3-steps";
    if (!want(nm)) return;
    ministep_cfg_t cfg = {.B = 2,
                          .T = small ? 64 : 128,
                          .C = 128,
                          .NH = 2,
                          .V = 500,
                          .Vp = 512,
                          .lr = 3e-3f,
                          .clip = 1.0f,
                          .seed = 7};
    ministep_t *mg = NULL, *mc = NULL;
    MUST(ministep_create(g, &cfg, &mg));
    MUST(ministep_create(c, &cfg, &mc));
    /* fp32 is the exact reference mode: losses within 1e-5 relative, the project's bound (docs/design.md) */
    const double tl = act == DG_F32 ? 1e-5 : act == DG_BF16 ? 2e-2 : 5e-3;
    double l0 = 0;
    for (int t = 1; t <= 3; t++) {
        double lg = 0, lc = 0;
        float ng = 0, nc = 0;
        MUST(ministep_step(mg, t, &lg));
        MUST(ministep_step(mc, t, &lc));
        MUST(ministep_grad_norm(mg, &ng));
        MUST(ministep_grad_norm(mc, &nc));
        if (t == 1) l0 = lc;
        check(isfinite(lg) && fabs(lg - lc) <= tl * fabs(lc),
              "%s step %d: loss cuda %.8f cpu %.8f (rel %.2g, tol %.2g)", nm, t, lg, lc,
              fabs(lg - lc) / fabs(lc), tl);
        check(isfinite(ng) && fabs(ng - nc) <= 10 * tl * fabs(nc) + 1e-6,
              "%s step %d: grad norm cuda %.8g cpu %.8g", nm, t, ng, nc);
        if (t == 3) check(lc < l0, "%s: cpu loss decreases (%.6f -> %.6f)", nm, l0, lc);
    }
    ministep_free(mg);
    ministep_free(mc);
}

static int run_cpu_compare(dg_backend_t *g, int small) {
#ifdef DG_TEST_HAVE_CPU
    dg_backend_config_t cc = {.act_dtype = DG_F32, .threads = 0, .seed = 1};
    dg_backend_t *c = NULL;
    MUST(dg_backend_cpu_create(&cc, &c));
    cmp_t x = {.g = g, .c = c, .act = g->act_dtype, .rng = 0xC0FFEEull};
    if (small) {
        cmp_matmul(&x, 128, 256, 768, 1, 1);
        cmp_matmul(&x, 37, 72, 100, 1, 0);
        cmp_matmul_dgelu(&x, 128, 768, 192, 1);
        cmp_matmul_dgelu(&x, 37, 100, 72, 1);
        cmp_matmul_res(&x, 128, 256, 768, 1);
        cmp_matmul_res(&x, 37, 72, 100, 0);
        cmp_layernorm(&x, 64, 768);
        cmp_attention(&x, 2, 130, 256, 4);
        cmp_attention(&x, 1, 70, 64, 2);
        cmp_encoder(&x, 2, 64, 128, 1000);
        cmp_ce(&x, 8, 50257, 50304);
        cmp_misc(&x, 10007);
    } else {
        cmp_matmul(&x, 1024, 768, 2304, 1, 0);    /* qkv */
        cmp_matmul(&x, 1024, 768, 3072, 1, 1);    /* fc + GELU */
        cmp_matmul(&x, 1024, 3072, 768, 1, 0);    /* fc proj */
        cmp_matmul(&x, 256, 768, 8192, 0, 0);     /* LM-head-like, no bias */
        cmp_matmul(&x, 100, 200, 300, 1, 1);      /* odd sizes: unfused paths */
        cmp_matmul_dgelu(&x, 1024, 3072, 768, 1); /* mlp.proj through fc's GELU: the DGELU epilogue */
        cmp_matmul_dgelu(&x, 100, 300, 200, 1);   /* C % 8 != 0: GEMM + gelu_bwd */
        cmp_matmul_res(&x, 1024, 768, 768, 1);    /* attn.proj + residual */
        cmp_matmul_res(&x, 1024, 3072, 768, 1);   /* mlp.proj + residual */
        cmp_matmul_res(&x, 1024, 768, 768, 0);    /* no bias (tp ranks > 0) */
        cmp_matmul_res(&x, 100, 203, 301, 1);     /* odd sizes: perhaps no algorithm (the unfused path) */
        cmp_layernorm(&x, 1024, 768);
        cmp_layernorm(&x, 300, 1600); /* > 48 KiB of shared memory in the backward */
        cmp_layernorm(&x, 77, 100);
        cmp_layernorm(&x, 32768, 768);      /* GPT-2's B*T rows: many partial rows of dw/db */
        cmp_attention(&x, 2, 256, 768, 12); /* GPT-2 heads (64) */
        cmp_attention(&x, 2, 200, 256, 4);  /* T not a multiple of the 64-row tile */
        cmp_attention(&x, 3, 130, 128, 4);  /* head size 32 */
        cmp_attention(&x, 2, 1, 128, 2);    /* T = 1 */
        cmp_attention(&x, 1, 64, 64, 1);    /* exactly one tile */
        cmp_attention(&x, 2, 100, 96, 2);   /* head size 48: generic kernels */
        cmp_encoder(&x, 4, 256, 768, 8192);
        cmp_ce(&x, 64, 50257, 50304);
        cmp_ce(&x, 16, 1000, 1003);    /* Vp not a multiple of 8: scalar path */
        cmp_ce(&x, 8, 128000, 128256); /* bf16/f16: the hybrid kernel's row near the shared-memory limit */
        cmp_ce(&x, 8, 150000, 150016); /* bf16/f16 rows beyond it (up to 260 KB): two-pass */
        cmp_misc(&x, 1000003);
    }
    cmp_ministep(g, c, g->act_dtype, small);
    dg_backend_free(c);
    return 0;
#else
    (void)g;
    (void)small;
    printf("SKIP: built without the CPU backend (src/backend/cpu), nothing to compare against\n");
    return SKIP;
#endif
}

/* ======================= determinism ======================= */

static void run_determinism(dg_backend_t *g, int small) {
    ministep_cfg_t cfg = {.B = small ? 2 : 4,
                          .T = small ? 64 : 256,
                          .C = small ? 128 : 256,
                          .NH = small ? 2 : 4,
                          .V = 1000,
                          .Vp = 1024,
                          .lr = 3e-3f,
                          .clip = 1.0f,
                          .seed = 11};
    const int steps = small ? 2 : 4;
    double loss[2][8];
    float norm[2][8];
    float *params[2] = {NULL, NULL};
    size_t np = 0;
    for (int run = 0; run < 2; run++) {
        ministep_t *ms = NULL;
        MUST(ministep_create(g, &cfg, &ms));
        for (int t = 1; t <= steps; t++) {
            MUST(ministep_step(ms, t, &loss[run][t - 1]));
            MUST(ministep_grad_norm(ms, &norm[run][t - 1]));
        }
        params[run] = dg_xmalloc(ministep_nparams(ms) * sizeof(float));
        MUST(ministep_params(ms, params[run], &np));
        ministep_free(ms);
    }
    for (int t = 0; t < steps; t++) {
        check(memcmp(&loss[0][t], &loss[1][t], sizeof(double)) == 0 && isfinite(loss[0][t]),
              "determinism step %d: loss %.10f vs %.10f", t + 1, loss[0][t], loss[1][t]);
        check(memcmp(&norm[0][t], &norm[1][t], sizeof(float)) == 0,
              "determinism step %d: grad norm %.9g vs %.9g", t + 1, norm[0][t], norm[1][t]);
    }
    size_t diff = 0;
    for (size_t i = 0; i < np; i++)
        diff += memcmp(&params[0][i], &params[1][i], 4) != 0;
    check(diff == 0, "determinism: %zu of %zu parameters differ after %d steps", diff, np, steps);
    check(loss[0][steps - 1] < loss[0][0], "determinism run trains: loss %.6f -> %.6f", loss[0][0],
          loss[0][steps - 1]);
    printf("determinism [%s]: %d steps, losses %.6f .. %.6f, %zu parameters bitwise equal: %s\n",
           dg_dtype_name(g->act_dtype), steps, loss[0][0], loss[0][steps - 1], np, diff ? "NO" : "yes");
    free(params[0]);
    free(params[1]);
}

/* ======================= errors ======================= */

static void expect_err(dg_status_t s, const char *needle, const char *what) {
    check(s != DG_OK && strstr(dg_last_error(), needle) != NULL,
          "errors: %s -> status %d \"%s\" (want \"%s\")", what, s, dg_last_error(), needle);
    dg_clear_error();
}

static int run_errors(void) {
    dg_backend_t *be = NULL;
    dg_backend_config_t cfg = {.act_dtype = DG_I32, .device = 0};
    expect_err(dg_backend_cuda_create(&cfg, &be), "not supported", "create with act dtype i32");
    check(be == NULL, "errors: failed create leaves *out NULL");
    cfg.act_dtype = DG_BF16;
    cfg.device = 4096;
    expect_err(dg_backend_cuda_create(&cfg, &be), "no CUDA device", "create on device 4096");
    cfg.device = 0;
    dg_status_t s = dg_backend_cuda_create(&cfg, &be);
    if (s != DG_OK) {
        /* no GPU here: the failure itself must be clean and say so */
        check(s == DG_ERR_RUNTIME && strstr(dg_last_error(), "no CUDA device") != NULL,
              "errors: create without a GPU -> status %d \"%s\"", s, dg_last_error());
        printf("no GPU: checked that creation fails cleanly (\"%s\")\n", dg_last_error());
        return g_fails ? 1 : 0;
    }
    const dg_backend_ops_t *op = be->ops;
    {
        /* a knob's bad value is refused by the switch registry's start-up check (dg_env.h: every program
         * calls dg_env_check before anything reads a switch), naming it (2 was cuDNN's atomic mode) */
        const char *prev = getenv("DG_CUDA_ATTN_CUDNN");
        char *keep = prev ? strdup(prev) : NULL;
        setenv("DG_CUDA_ATTN_CUDNN", "2", 1);
        expect_err(dg_env_check(NULL), "DG_CUDA_ATTN_CUDNN", "dg_env_check with DG_CUDA_ATTN_CUDNN=2");
        if (keep)
            setenv("DG_CUDA_ATTN_CUDNN", keep, 1);
        else
            unsetenv("DG_CUDA_ATTN_CUDNN");
        free(keep);
    }
    void *buf = NULL;
    MUST(op->alloc(be, 1 << 20, &buf));
    MUST(op->memset0(be, buf, 1 << 20));
    expect_err(op->attention_fwd(be, buf, buf, buf, 1, 4, 10, 3), "multiple", "attention C % NH != 0");
    expect_err(op->attention_bwd(be, buf, buf, buf, buf, buf, 1, 0, 12, 3), "T = 0", "attention T = 0");
    expect_err(op->matmul_fwd(be, buf, NULL, buf, NULL, NULL, 4, 4, 4, DG_EPI_NONE), "NULL",
               "matmul_fwd w NULL");
    expect_err(op->matmul_fwd(be, buf, buf, buf, buf, NULL, 4, 4, 4, DG_EPI_GELU), "different",
               "matmul_fwd GELU pre == out");
    expect_err(op->matmul_bwd(be, buf, buf, NULL, buf, buf, buf, -1, 4, 4, 0), "N = -1", "matmul_bwd N = -1");
    {
        char *b = (char *)buf;
        expect_err(op->matmul_fwd_res(be, b, b + 4096, b + 8192, NULL, NULL, 4, 4, 4), "`res` is NULL",
                   "matmul_fwd_res res NULL");
        expect_err(op->matmul_fwd_res(be, b, b + 4096, b + 8192, NULL, b, 4, 0, 4), "C = 0",
                   "matmul_fwd_res C = 0");
        expect_err(op->matmul_fwd_res(be, b, b + 4096, b + 8192, NULL, b + 8, 4, 4, 4), "partially",
                   "matmul_fwd_res out over half of res");
        expect_err(op->matmul_fwd_res(be, b, b + 16, b + 8192, NULL, b + 12288, 4, 4, 4), "inp, w or bias",
                   "matmul_fwd_res out over inp");
    }
    expect_err(op->matmul_bwd_dgelu(be, buf, buf, NULL, buf, buf, buf, NULL, 4, 4, 4, 0), "`pre` is NULL",
               "matmul_bwd_dgelu pre NULL");
    expect_err(op->matmul_bwd_dgelu(be, buf, buf, NULL, buf, buf, buf, buf, 4, 4, 4, 0), "overlap",
               "matmul_bwd_dgelu dpre == pre");
    expect_err(op->cast(be, buf, DG_I32, buf, DG_F32, 4), "not supported", "cast to i32");
    expect_err(op->adamw(be, buf, NULL, buf, buf, buf, 4, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.f, 0, NULL), "t = 0",
               "adamw t = 0");
    expect_err(op->crossentropy_fwd(be, buf, buf, buf, buf, 2, 9, 8), "Vp = 8 < V = 9",
               "crossentropy Vp < V");
    expect_err(op->crossentropy_fused(be, buf, buf, buf, buf, buf, 2, 9, 8, 1.0f), "Vp = 8 < V = 9",
               "crossentropy_fused Vp < V");
    expect_err(op->crossentropy_fused(be, buf, buf, NULL, buf, buf, 2, 9, 10, 1.0f), "NULL",
               "crossentropy_fused dlogits NULL");
    /* device-resident bad data: flagged by the kernel, reported by the next sync, no fault */
    int32_t bad_tg[2] = {3, 9};
    int32_t *dtg = (int32_t *)((char *)buf + 4096);
    float *logits = (float *)((char *)buf + 8192);
    MUST(op->to_device(be, dtg, bad_tg, sizeof bad_tg));
    MUST(op->crossentropy_fwd(be, (float *)buf, (float *)buf + 16, logits, dtg, 2, 9, 10));
    expect_err(op->sync(be), "target outside [0, V)", "crossentropy target == V (reported at sync)");
    check(op->sync(be) == DG_OK, "errors: the flag is cleared after it was reported");
    /* the fused op: the same flag, the row's loss NaN, the other row's finite */
    MUST(op->crossentropy_fused(be, (float *)buf, (float *)buf + 16, logits, logits, dtg, 2, 9, 10, 0.5f));
    expect_err(op->sync(be), "target outside [0, V)", "crossentropy_fused target == V (reported at sync)");
    float fl[2];
    MUST(op->to_host(be, fl, buf, sizeof fl));
    check(isfinite(fl[0]) && isnan(fl[1]),
          "errors: crossentropy_fused bad target: losses %g (finite), %g (NaN)", fl[0], fl[1]);
    int32_t neg[4] = {0, 1, -5, 2};
    MUST(op->to_device(be, dtg, neg, sizeof neg));
    MUST(op->encoder_fwd(be, logits, dtg, buf, buf, 2, 2, 4));
    expect_err(op->sync(be), "negative token", "encoder_fwd negative token (reported at sync)");
    MUST(op->encoder_bwd(be, (float *)logits, (float *)logits + 64, buf, dtg, 2, 2, 4));
    expect_err(op->sync(be), "negative token", "encoder_bwd negative token (reported at sync)");
    /* v1.8: a fence reports the flags raised by the work before it, as sync does, and only once; a
     * download into pageable memory is refused by name */
    void *fence = NULL;
    float *pinned = NULL;
    MUST(op->fence_create(be, &fence));
    MUST(op->host_alloc(be, 64, (void **)&pinned));
    MUST(op->to_device(be, dtg, bad_tg, sizeof bad_tg));
    MUST(op->crossentropy_fwd(be, (float *)buf, (float *)buf + 16, logits, dtg, 2, 9, 10));
    MUST(op->download_async(be, pinned, buf, 2 * sizeof(float)));
    MUST(op->fence_record(be, fence));
    expect_err(op->fence_wait(be, fence), "target outside [0, V)", "crossentropy target == V (fence_wait)");
    check(op->fence_wait(be, fence) == DG_OK && op->sync(be) == DG_OK,
          "errors: the flag is cleared after fence_wait reported it");
    float pageable[2];
    expect_err(op->download_async(be, pageable, buf, sizeof pageable), "page-locked",
               "download_async into pageable memory");
    op->host_free(be, pinned);
    op->fence_destroy(be, fence);
    /* NaN gradient norm: the clip factor is NaN too, not hidden by min() */
    const float nan = NAN;
    MUST(op->to_device(be, buf, &nan, 4));
    MUST(op->clip_scale(be, (float *)buf + 1, (float *)buf + 2, (float *)buf, 1.0f, 1.0f));
    float got[3];
    MUST(op->to_host(be, got, buf, sizeof got));
    check(isnan(got[1]) && isnan(got[2]), "errors: clip_scale of NaN sumsq -> scale %g norm %g", got[1],
          got[2]);
    /* a huge allocation fails with a message, not a crash */
    void *huge = NULL;
    expect_err(op->alloc(be, (size_t)1 << 50, &huge), "cudaMalloc", "alloc of 1 PiB");
    check(huge == NULL, "errors: failed alloc leaves *out NULL");
    check(dg_backend_cuda_stream(be) != NULL, "errors: dg_backend_cuda_stream returns the stream");
    op->free(be, buf);
    dg_backend_free(be);
    return g_fails ? 1 : 0;
}

/* ======================= attention: tensor-core vs generic kernels ======================= */

/* The built-in kernels only (DG_CUDA_ATTN_CUDNN=0): the tensor-core ones (fast = 1) or, with
 * DG_CUDA_FAST_ATTENTION=0, the generic ones (the reference). */
static dg_backend_t *make_cuda_builtin(dg_dtype_t act, int fast, int *skip) {
    setenv("DG_CUDA_ATTN_CUDNN", "0", 1);
    setenv("DG_CUDA_FAST_ATTENTION", fast ? "1" : "0", 1);
    dg_backend_t *be = make_cuda(act, skip);
    unsetenv("DG_CUDA_ATTN_CUDNN");
    unsetenv("DG_CUDA_FAST_ATTENTION");
    return be;
}

/* 16-bit activations to f32 on the host (bf16: the high half; f16: IEEE half, subnormals included). */
static float act16_to_f32(uint16_t v, dg_dtype_t t) {
    if (t == DG_BF16) {
        uint32_t u = (uint32_t)v << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    const int e = (v >> 10) & 0x1f, m = v & 0x3ff;
    float f = e == 0    ? ldexpf((float)m, -24)
              : e == 31 ? (m ? NAN : INFINITY)
                        : ldexpf((float)(m | 0x400), e - 25);
    return (v & 0x8000) ? -f : f;
}
static float *act16_array(const uint16_t *a, size_t n, dg_dtype_t t) {
    float *f = dg_xmalloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++)
        f[i] = act16_to_f32(a[i], t);
    return f;
}

typedef struct {
    uint16_t *out, *dq;
    float *lse;
} attn_res_t;

/* One forward + backward on `be` from host inputs (f32, cast on the device), outputs poisoned first. */
static attn_res_t attn_run(dg_backend_t *be, dg_dtype_t act, const float *h, int B, int T, int C, int NH) {
    const dg_backend_ops_t *op = be->ops;
    const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, nl = (size_t)B * NH * T;
    uint16_t *poison = dg_xmalloc(nqkv * sizeof(uint16_t));
    memset(poison, 0xff, nqkv * sizeof(uint16_t)); /* NaN in bf16, f16 and (for aux) f32 */
    void *f = NULL, *qkv = NULL, *dout = NULL, *out = NULL, *dqkv = NULL, *aux = NULL;
    MUST(op->alloc(be, nqkv * sizeof(float), &f));
    MUST(op->alloc(be, nqkv * 2, &qkv));
    MUST(op->alloc(be, nout * 2, &dout));
    MUST(op->alloc(be, nout * 2, &out));
    MUST(op->alloc(be, nqkv * 2, &dqkv));
    MUST(op->alloc(be, op->attention_aux_bytes(be, B, T, C, NH), &aux));
    MUST(op->to_device(be, f, h, nqkv * sizeof(float)));
    MUST(op->cast(be, qkv, act, f, DG_F32, nqkv));
    MUST(op->cast(be, dout, act, (float *)f + nout, DG_F32, nout)); /* other values than q's */
    MUST(op->to_device(be, out, poison, nout * 2));
    MUST(op->to_device(be, dqkv, poison, nqkv * 2));
    MUST(op->to_device(be, aux, poison, nl * sizeof(float)));
    MUST(op->attention_fwd(be, out, aux, qkv, B, T, C, NH));
    MUST(op->attention_bwd(be, dqkv, dout, qkv, out, aux, B, T, C, NH));
    attn_res_t r = {dg_xmalloc(nout * 2), dg_xmalloc(nqkv * 2), dg_xmalloc(nl * sizeof(float))};
    MUST(op->to_host(be, r.out, out, nout * 2));
    MUST(op->to_host(be, r.dq, dqkv, nqkv * 2));
    MUST(op->to_host(be, r.lse, aux, nl * sizeof(float)));
    void *bufs[] = {f, qkv, dout, out, dqkv, aux};
    for (int j = 0; j < 6; j++)
        op->free(be, bufs[j]);
    free(poison);
    return r;
}
static void attn_res_free(attn_res_t *r) {
    free(r->out);
    free(r->dq);
    free(r->lse);
}

/* Times `iters` forward and `iters` backward calls between CUDA events on the backend's stream, after
 * two warm-up calls of each. ms[0] = forward, ms[1] = backward, per call. */
static void attn_time(dg_backend_t *be, dg_dtype_t act, int B, int T, int C, int NH, int iters, uint64_t *rng,
                      double ms[2]) {
    const dg_backend_ops_t *op = be->ops;
    const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C;
    void *f = NULL, *qkv = NULL, *dout = NULL, *out = NULL, *dqkv = NULL, *aux = NULL;
    float *h = dg_xmalloc(nqkv * sizeof(float));
    for (size_t i = 0; i < nqkv; i++) {
        *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
        h[i] = (float)((int64_t)(*rng >> 40) - (1 << 23)) / (float)(1 << 23);
    }
    MUST(op->alloc(be, nqkv * sizeof(float), &f));
    MUST(op->alloc(be, nqkv * 2, &qkv));
    MUST(op->alloc(be, nout * 2, &dout));
    MUST(op->alloc(be, nout * 2, &out));
    MUST(op->alloc(be, nqkv * 2, &dqkv));
    MUST(op->alloc(be, op->attention_aux_bytes(be, B, T, C, NH), &aux));
    MUST(op->to_device(be, f, h, nqkv * sizeof(float)));
    MUST(op->cast(be, qkv, act, f, DG_F32, nqkv));
    MUST(op->cast(be, dout, act, f, DG_F32, nout));
    for (int w = 0; w < 2; w++) {
        MUST(op->attention_fwd(be, out, aux, qkv, B, T, C, NH));
        MUST(op->attention_bwd(be, dqkv, dout, qkv, out, aux, B, T, C, NH));
    }
    MUST(op->sync(be));
    cudaStream_t st = (cudaStream_t)dg_backend_cuda_stream(be);
    cudaEvent_t ev[3];
    for (int i = 0; i < 3; i++)
        if (cudaEventCreate(&ev[i]) != cudaSuccess) {
            fprintf(stderr, "FAIL cudaEventCreate\n");
            exit(1);
        }
    cudaEventRecord(ev[0], st);
    for (int i = 0; i < iters; i++)
        MUST(op->attention_fwd(be, out, aux, qkv, B, T, C, NH));
    cudaEventRecord(ev[1], st);
    for (int i = 0; i < iters; i++)
        MUST(op->attention_bwd(be, dqkv, dout, qkv, out, aux, B, T, C, NH));
    cudaEventRecord(ev[2], st);
    MUST(op->sync(be));
    float e01 = 0.f, e12 = 0.f;
    cudaEventElapsedTime(&e01, ev[0], ev[1]);
    cudaEventElapsedTime(&e12, ev[1], ev[2]);
    ms[0] = e01 / iters;
    ms[1] = e12 / iters;
    for (int i = 0; i < 3; i++)
        cudaEventDestroy(ev[i]);
    void *bufs[] = {f, qkv, dout, out, dqkv, aux};
    for (int j = 0; j < 6; j++)
        op->free(be, bufs[j]);
    free(h);
}

/* Values of a that are non-finite (unwritten: the outputs start as NaN) */
static size_t count_nonfinite(const float *a, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += !isfinite(a[i]);
    return k;
}

static int run_attn_builtin(dg_dtype_t act, int small) {
    if (act == DG_F32) act = DG_BF16; /* the tensor-core kernels are the 16-bit ones */
    int skip = 0;
    dg_backend_t *ref = make_cuda_builtin(act, 0, &skip);
    if (skip) return SKIP;
    dg_backend_t *tc = make_cuda_builtin(act, 1, &skip);
    const struct { int B, T; } bt[] = {{2, 1024}, {2, 200}, {3, 13}, {1, 333}, {2, 129}};
    const double tol_f = tol("attention_fwd", act), tol_b = tol("attention_bwd", act);
    uint64_t rng = 0xa77e;
    size_t same[2] = {0, 0}, total[2] = {0, 0}; /* per head size (64, 32): values bitwise the reference's */
    for (size_t si = small ? 1 : 0; si < sizeof bt / sizeof bt[0]; si++)
        for (int hs = 64; hs >= 32; hs /= 2) {
            const int B = bt[si].B, T = bt[si].T, NH = T >= 1024 ? 12 : 4, C = hs * NH;
            const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, nl = (size_t)B * NH * T;
            float *h = dg_xmalloc(nqkv * sizeof(float));
            for (size_t i = 0; i < nqkv; i++) {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                float v = 0.05f + 0.95f * (float)((rng >> 40) / 16777216.0);
                h[i] = (rng >> 20) & 1 ? v : -v;
            }
            char nm[128];
            snprintf(nm, sizeof nm,
                     "attn-builtin [%s] B=%d T=%d C=%d NH=%d (head %d): tensor-core vs generic",
                     dg_dtype_name(act), B, T, C, NH, hs);
            attn_res_t r0 = attn_run(ref, act, h, B, T, C, NH);
            float *o0 = act16_array(r0.out, nout, act), *d0 = act16_array(r0.dq, nqkv, act);
            const size_t nf0 =
                count_nonfinite(o0, nout) + count_nonfinite(d0, nqkv) + count_nonfinite(r0.lse, nl);
            check(nf0 == 0, "%s: the generic kernels left %zu unwritten or non-finite values", nm, nf0);
            attn_res_t r1 = attn_run(tc, act, h, B, T, C, NH);
            attn_res_t r1b = attn_run(tc, act, h, B, T, C, NH);
            float *o1 = act16_array(r1.out, nout, act), *d1 = act16_array(r1.dq, nqkv, act);
            /* compare() fails on any non-finite value of the tensor-core results: every element written */
            compare(nm, "fwd out", o1, o0, nout, tol_f);
            compare(nm, "fwd logsumexp", r1.lse, r0.lse, nl, tol_f);
            compare(nm, "bwd dqkv", d1, d0, nqkv, tol_b);
            size_t rep = 0, eq = 0;
            for (size_t i = 0; i < nout; i++) {
                rep += r1.out[i] != r1b.out[i];
                eq += r1.out[i] == r0.out[i];
            }
            for (size_t i = 0; i < nqkv; i++) {
                rep += r1.dq[i] != r1b.dq[i];
                eq += r1.dq[i] == r0.dq[i];
            }
            for (size_t i = 0; i < nl; i++) {
                rep += memcmp(&r1.lse[i], &r1b.lse[i], 4) != 0;
                eq += memcmp(&r1.lse[i], &r0.lse[i], 4) == 0;
            }
            check(rep == 0, "%s: run twice differs in %zu of %zu values (must be bitwise reproducible)", nm,
                  rep, nout + nqkv + nl);
            if (g_verbose)
                printf("info %s: %zu of %zu values bitwise equal to the generic kernels'\n", nm, eq,
                       nout + nqkv + nl);
            same[hs == 32] += eq;
            total[hs == 32] += nout + nqkv + nl;
            free(o0);
            free(d0);
            free(o1);
            free(d1);
            attn_res_free(&r0);
            attn_res_free(&r1);
            attn_res_free(&r1b);
            free(h);
        }
    /* the tensor-core kernels round P to the activation dtype before P.V and add in another order: were
     * every value the generic kernels' bit for bit, the tensor-core path would not have run at all */
    for (int k = 0; k < 2; k++)
        check(same[k] < total[k],
              "attn-builtin [%s] head %d: all %zu values bitwise the generic kernels' (did the tensor-core "
              "kernels run?)",
              dg_dtype_name(act), k ? 32 : 64, total[k]);
    if (!small) { /* timing at GPT-2 124M's shape, one micro-batch of 32 x 1024 (not a pass/fail) */
        const int B = 32, T = 1024, C = 768, NH = 12, iters = 20;
        double ms[2][2];
        attn_time(ref, act, B, T, C, NH, iters, &rng, ms[0]);
        attn_time(tc, act, B, T, C, NH, iters, &rng, ms[1]);
        /* causal attention FLOPs: QK^T and PV over half the T x T matrix, forward; backward 2.5 x */
        const double fl = 4.0 * B * NH * (double)T * T * (C / NH) / 2;
        printf("attn-builtin timing [%s] B=%d T=%d C=%d NH=%d: generic fwd %.4f ms bwd %.4f ms; tensor-core "
               "fwd %.4f ms bwd %.4f ms (TFLOP/s fwd / bwd: generic %.0f / %.0f, tensor-core %.0f / %.0f)\n",
               dg_dtype_name(act), B, T, C, NH, ms[0][0], ms[0][1], ms[1][0], ms[1][1], fl / ms[0][0] / 1e9,
               2.5 * fl / ms[0][1] / 1e9, fl / ms[1][0] / 1e9, 2.5 * fl / ms[1][1] / 1e9);
    }
    dg_backend_free(ref);
    dg_backend_free(tc);
    printf("attn-builtin [%s]: %d checks, %d failed\n", dg_dtype_name(act), g_checks, g_fails);
    return g_fails ? 1 : 0;
}

/* ======================= cuDNN's fused attention vs the built-in kernels ======================= */

static dg_backend_t *make_cuda_cudnn(dg_dtype_t act, const char *mode, int *skip) {
    setenv("DG_CUDA_ATTN_CUDNN", mode, 1);
    dg_backend_t *be = make_cuda(act, skip);
    unsetenv("DG_CUDA_ATTN_CUDNN");
    return be;
}

static int run_attn_cudnn(dg_dtype_t act, int small) {
    if (act == DG_F32) act = DG_BF16; /* cuDNN serves the 16-bit activations only */
    int skip = 0;
    dg_backend_t *ref = make_cuda_cudnn(act, "0", &skip);
    if (skip) return SKIP;
    dg_backend_t *det = make_cuda_cudnn(act, "1", &skip);
    const struct {
        int B, T, NH, hs;
    } sh[] = {{2, 1024, 12, 64}, {2, 256, 12, 64}, {2, 200, 4, 64},
              {3, 13, 4, 32},    {1, 333, 4, 64},  {2, 129, 4, 32}};
    const double tol_f = tol("attention_fwd", act), tol_b = tol("attention_bwd", act);
    uint64_t rng = 0xc0d17;
    int any_cudnn = 0;
    for (size_t si = 0; si < sizeof sh / sizeof sh[0]; si++) {
        if (small && sh[si].T >= 1024) continue;
        const int B = sh[si].B, T = sh[si].T, NH = sh[si].NH, C = sh[si].hs * NH;
        const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, nl = (size_t)B * NH * T;
        float *h = dg_xmalloc(nqkv * sizeof(float));
        for (size_t i = 0; i < nqkv; i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            float v = 0.05f + 0.95f * (float)((rng >> 40) / 16777216.0);
            h[i] = (rng >> 20) & 1 ? v : -v;
        }
        attn_res_t r0 = attn_run(ref, act, h, B, T, C, NH);
        float *o0 = act16_array(r0.out, nout, act), *d0 = act16_array(r0.dq, nqkv, act);
        check(dg_backend_cuda_cudnn_attention_calls(ref) == 0, "attn-cudnn: DG_CUDA_ATTN_CUDNN=0 used cuDNN");
        {
            dg_backend_t *be = det;
            const long long c0 = dg_backend_cuda_cudnn_attention_calls(be);
            attn_res_t r1 = attn_run(be, act, h, B, T, C, NH);
            attn_res_t r1b = attn_run(be, act, h, B, T, C, NH);
            const long long used = dg_backend_cuda_cudnn_attention_calls(be) - c0;
            any_cudnn |= used > 0;
            char nm[160];
            snprintf(nm, sizeof nm,
                     "attn-cudnn [%s] B=%d T=%d C=%d NH=%d (head %d): cuDNN (%lld calls) vs built-in",
                     dg_dtype_name(act), B, T, C, NH, sh[si].hs, used);
            float *o1 = act16_array(r1.out, nout, act), *d1 = act16_array(r1.dq, nqkv, act);
            compare(nm, "fwd out", o1, o0, nout, tol_f);
            compare(nm, "fwd logsumexp", r1.lse, r0.lse, nl, tol_f);
            compare(nm, "bwd dqkv", d1, d0, nqkv, tol_b);
            size_t rep = 0;
            for (size_t i = 0; i < nout; i++)
                rep += r1.out[i] != r1b.out[i];
            for (size_t i = 0; i < nqkv; i++)
                rep += r1.dq[i] != r1b.dq[i];
            for (size_t i = 0; i < nl; i++)
                rep += memcmp(&r1.lse[i], &r1b.lse[i], 4) != 0;
            check(rep == 0, "%s: run twice differs in %zu of %zu values (must be bitwise reproducible)", nm,
                  rep, nout + nqkv + nl);
            if (T == 1024 && sh[si].hs == 64)
                check(used == 4, "%s: the GPT-2 shape must run on cuDNN where it loads (4 calls, got %lld)",
                      nm, used);
            free(o1);
            free(d1);
            attn_res_free(&r1);
            attn_res_free(&r1b);
        }
        free(o0);
        free(d0);
        attn_res_free(&r0);
        free(h);
    }
    if (!small && any_cudnn) {
        const int B = 32, T = 1024, C = 768, NH = 12, iters = 20;
        double ms[2][2];
        attn_time(ref, act, B, T, C, NH, iters, &rng, ms[0]);
        attn_time(det, act, B, T, C, NH, iters, &rng, ms[1]);
        const double fl = 4.0 * B * NH * (double)T * T * (C / NH) / 2;
        printf(
            "attn-cudnn timing [%s] B=%d T=%d C=%d NH=%d: built-in fwd %.4f bwd %.4f ms; cuDNN fwd %.4f bwd "
            "%.4f ms (TFLOP/s fwd / bwd: %.0f / %.0f, %.0f / %.0f); per step x12: %.2f / %.2f ms\n",
            dg_dtype_name(act), B, T, C, NH, ms[0][0], ms[0][1], ms[1][0], ms[1][1], fl / ms[0][0] / 1e9,
            2.5 * fl / ms[0][1] / 1e9, fl / ms[1][0] / 1e9, 2.5 * fl / ms[1][1] / 1e9,
            12 * (ms[0][0] + ms[0][1]), 12 * (ms[1][0] + ms[1][1]));
    }
    if (!any_cudnn)
        printf("attn-cudnn [%s]: cuDNN served no shape here (see the INFO lines)\n", dg_dtype_name(act));
    dg_backend_free(ref);
    dg_backend_free(det);
    printf("attn-cudnn [%s]: %d checks, %d failed\n", dg_dtype_name(act), g_checks, g_fails);
    return g_fails ? 1 : 0;
}

/* ======================= main ======================= */

int main(int argc, char **argv) {
    const char *mode = "harness";
    dg_dtype_t act = DG_F32;
    int small = 0, no_fd = 0, under_test_cpu = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mode") && i + 1 < argc)
            mode = argv[++i];
        else if (!strcmp(argv[i], "--dtype") && i + 1 < argc)
            act = parse_dtype(argv[++i]);
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            g_only = argv[++i];
        else if (!strcmp(argv[i], "--small"))
            small = 1;
        else if (!strcmp(argv[i], "--no-fd"))
            no_fd = 1;
        else if (!strcmp(argv[i], "--verbose"))
            g_verbose = 1;
        else if (!strcmp(argv[i], "--under-test-cpu"))
            under_test_cpu = 1;
        else {
            fprintf(stderr,
                    "usage: %s --mode harness|cpu|determinism|errors|attn-builtin|attn-cudnn|probe "
                    "[--dtype f32|bf16|f16] [--only S] [--small] [--no-fd] [--verbose]\n",
                    argv[0]);
            return 2;
        }
    }
    if (!strcmp(mode, "probe")) { /* for wrappers (compute-sanitizer tests): 0 = a GPU is usable, 77 = none */
        int skip = 0;
        dg_backend_t *be = make_cuda(act, &skip);
        dg_backend_free(be);
        return skip ? SKIP : 0;
    }
    if (!strcmp(mode, "attn-builtin")) return run_attn_builtin(act, small);
    if (!strcmp(mode, "attn-cudnn")) return run_attn_cudnn(act, small);
    if (!strcmp(mode, "errors")) {
        int rc = run_errors();
        printf("cuda backend errors: %d checks, %d failed\n", g_checks, g_fails);
        return rc;
    }
    int skip = 0;
    dg_backend_t *be = NULL;
    if (under_test_cpu) {
#ifdef DG_TEST_HAVE_CPU
        /* the CPU backend as the backend under test: checks this program itself where there is no GPU */
        dg_backend_config_t cc = {.act_dtype = DG_F32, .threads = 0, .seed = 1};
        MUST(dg_backend_cpu_create(&cc, &be));
#else
        fprintf(stderr, "test_backend_cuda: --under-test-cpu needs the CPU backend\n");
        return 2;
#endif
    } else {
        be = make_cuda(act, &skip);
        if (skip) return SKIP;
    }
    int rc = 0;
    if (!strcmp(mode, "harness")) {
        dg_harness_opts_t o;
        dg_harness_opts_init(&o);
        o.only = g_only;
        o.verbose = g_verbose;
        o.skip_fd = no_fd;
        o.large = 1; /* many-row shapes: the row partitions and partial-row reductions of the kernels */
        rc = dg_op_harness_run(be, &o) ? 1 : 0;
    } else if (!strcmp(mode, "cpu")) {
        rc = run_cpu_compare(be, small);
        printf("cuda vs cpu [%s]: %d checks, %d failed\n", dg_dtype_name(act), g_checks, g_fails);
        if (rc == 0 && g_fails) rc = 1;
    } else if (!strcmp(mode, "determinism")) {
        run_determinism(be, small);
        rc = g_fails ? 1 : 0;
    } else {
        fprintf(stderr, "test_backend_cuda: unknown --mode %s\n", mode);
        rc = 2;
    }
    dg_backend_free(be);
    return rc;
}
