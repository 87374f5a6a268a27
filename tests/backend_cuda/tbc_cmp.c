/* tbc_cmp.c — test_backend_cuda --mode cpu: every op of the CUDA backend against the CPU backend at
 * GPT-2-like shapes, then a 3-step one-block training run on both (see test_backend_cuda.c). */
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
#include "tbc.h"

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
void compare(const char *cname, const char *what, const float *g, const float *r, size_t n, double tol) {
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
double tol(const char *op, dg_dtype_t act) {
    double t = dg_op_harness_tolerance(op, act);
    DG_ASSERT(t >= 0);
    return 2.0 * t;
}

int want(const char *name) {
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

int run_cpu_compare(dg_backend_t *g, int small) {
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
