/* test_fp8.c — train.precision=fp8 on the CUDA backend (docs/cuda.md, "FP8"): the E4M3 quantization and
 * the FP8 GEMMs of the linear layers. Exit 77 (ctest SKIP) without a GPU.
 *
 *   test_fp8            quantization bitwise against a host E4M3 reference (round to nearest even,
 *                       saturating; q and its transpose; aligned and ragged shapes); the scale follows the
 *                       operand (current scaling: 10x the input gives a 10x inverse scale); an inf in the
 *                       operand becomes NaN instead of a finite 448; matmul_fwd (bias, bias + GELU),
 *                       matmul_fwd_res, matmul_bwd and matmul_bwd_dgelu with fp8 against a float64 host
 *                       reference within FP8 tolerance (and the bf16 backend within bf16's), the weight
 *                       gradient (bf16 in fp8 mode) bitwise the bf16 backend's, FP8 GEMMs counted as run
 *                       and none refused; fp8 with f32 activations refused at creation.
 * The speed of the FP8 GEMMs: bench/gpu/bench_fp8.c.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "backend.h"
#include "dg_test_skip.h"

static int g_checks, g_fails;

static void check(int ok, const char *what, double got, double lim) {
    g_checks++;
    if (!ok) g_fails++;
    printf("%s %s (%.4g, limit %.4g)\n", ok ? "ok  " : "FAIL", what, got, lim);
}

#define MUST(call)                                                                                           \
    do {                                                                                                     \
        dg_status_t must_s_ = (call);                                                                        \
        if (must_s_ != DG_OK) {                                                                              \
            printf("FAIL %s: %s (%s)\n", #call, dg_last_error(), dg_last_error_where());                     \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

/* ---- host number formats ---- */
static uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even (finite inputs only here) */
    return (uint16_t)(u >> 16);
}
static float f_of_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* E4M3 (bias 7, no infinities, 0x7f/0xff NaN, largest finite 448) */
static double e4m3_value(int code) {
    const int e = (code >> 3) & 15, m = code & 7;
    const double v = e == 0 ? ldexp(m / 8.0, -6) : ldexp(1.0 + m / 8.0, e - 7);
    return (code & 0x80) ? -v : v;
}
static uint8_t e4m3_of(float x) {
    if (isnan(x)) return 0x7f;
    const uint8_t sign = signbit(x) ? 0x80 : 0;
    double a = fabs((double)x);
    if (a >= 448.0) return sign | 0x7e; /* satfinite */
    int best = 0;
    double bd = a;
    for (int c = 1; c <= 0x7e; c++) {
        const double d = fabs(e4m3_value(c) - a);
        if (d < bd || (d == bd && (c & 1) == 0 && (best & 1) == 1)) {
            bd = d;
            best = c;
        }
    }
    return (uint8_t)(sign | best);
}

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static float frand(void) { /* uniform in (-1, 1) */
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (float)((double)(g_rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

typedef struct {
    dg_backend_t *be;
    const dg_backend_ops_t *o;
} bk_t;

static void *dev(bk_t *b, size_t bytes) {
    void *p = NULL;
    MUST(b->o->alloc(b->be, bytes, &p));
    return p;
}
static void *dev_bf16(bk_t *b, const float *h, size_t n) {
    uint16_t *t = malloc(n * 2);
    for (size_t i = 0; i < n; i++)
        t[i] = bf16_of(h[i]);
    void *d = dev(b, n * 2);
    MUST(b->o->to_device(b->be, d, t, n * 2));
    free(t);
    return d;
}
static void host_f(bk_t *b, float *h, const void *d, size_t n, int bf16) {
    if (!bf16) {
        MUST(b->o->to_host(b->be, h, d, n * 4));
        return;
    }
    uint16_t *t = malloc(n * 2);
    MUST(b->o->to_host(b->be, t, d, n * 2));
    for (size_t i = 0; i < n; i++)
        h[i] = f_of_bf16(t[i]);
    free(t);
}
/* rounds host data as the device holds it (bf16) */
static void round_bf16(float *h, size_t n) {
    for (size_t i = 0; i < n; i++)
        h[i] = f_of_bf16(bf16_of(h[i]));
}

static int make(int fp8, dg_dtype_t act, bk_t *b) {
    dg_backend_config_t cfg = {0};
    cfg.act_dtype = act;
    cfg.fp8 = fp8;
    b->be = NULL;
    dg_status_t s = dg_backend_cuda_create(&cfg, &b->be);
    if (s != DG_OK) return 0;
    b->o = b->be->ops;
    return 1;
}

/* ---- quantization ---- */
static void test_quantize(bk_t *b, int rows, int cols, float mag) {
    const size_t n = (size_t)rows * cols;
    float *x = malloc(n * 4);
    for (size_t i = 0; i < n; i++)
        x[i] = mag * frand() * frand() * frand(); /* a spread of magnitudes, subnormal E4M3 included */
    round_bf16(x, n);
    void *dx = dev_bf16(b, x, n);
    uint8_t *dq = dev(b, n), *dqt = dev(b, n);
    float *slot = dev(b, 16);
    MUST(dg_backend_cuda_fp8_quantize(b->be, dq, dqt, dx, rows, cols, slot));
    uint8_t *q = malloc(n), *qt = malloc(n);
    float hs[4];
    MUST(b->o->to_host(b->be, q, dq, n));
    MUST(b->o->to_host(b->be, qt, dqt, n));
    MUST(b->o->to_host(b->be, hs, slot, 16));
    double amax = 0;
    for (size_t i = 0; i < n; i++)
        amax = fmax(amax, fabs((double)x[i]));
    const float scale = 448.f / (float)amax; /* in float, as the device computes it */
    const float damax = hs[2];               /* amax's bits: the float itself */
    size_t bad = 0, badt = 0;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            const uint8_t want = e4m3_of(x[(size_t)r * cols + c] * scale);
            bad += q[(size_t)r * cols + c] != want;
            badt += qt[(size_t)c * rows + r] != want;
        }
    char what[160];
    snprintf(what, sizeof what, "quantize %dx%d: amax %g", rows, cols, (double)damax);
    check(damax == (float)amax, what, damax, amax);
    snprintf(what, sizeof what, "quantize %dx%d: inverse scale = amax / 448", rows, cols);
    check(fabs(hs[0] - 1.0 / scale) <= 1e-6 * fabs(1.0 / scale), what, hs[0], 1.0 / scale);
    snprintf(what, sizeof what, "quantize %dx%d: E4M3 codes differing from the host reference", rows, cols);
    check(bad == 0, what, (double)bad, 0);
    snprintf(what, sizeof what, "quantize %dx%d: transposed codes differing", rows, cols);
    check(badt == 0, what, (double)badt, 0);

    /* current scaling: 10x the operand, 10x the inverse scale, the same codes */
    for (size_t i = 0; i < n; i++)
        x[i] *= 8.0f; /* a power of two: exact in bf16 */
    b->o->free(b->be, dx);
    dx = dev_bf16(b, x, n);
    float hs2[4];
    MUST(dg_backend_cuda_fp8_quantize(b->be, dq, NULL, dx, rows, cols, slot));
    MUST(b->o->to_host(b->be, hs2, slot, 16));
    uint8_t *q2 = malloc(n);
    MUST(b->o->to_host(b->be, q2, dq, n));
    snprintf(what, sizeof what, "quantize %dx%d: 8x the operand gives 8x the inverse scale", rows, cols);
    check(fabs(hs2[0] / hs[0] - 8.0) < 1e-5, what, hs2[0] / hs[0], 8.0);
    snprintf(what, sizeof what, "quantize %dx%d: and the same codes (q only)", rows, cols);
    check(memcmp(q, q2, n) == 0, what, (double)(memcmp(q, q2, n) != 0), 0);

    /* an inf in the operand: NaN codes where it was (not a finite 448) */
    x[n / 2] = INFINITY;
    b->o->free(b->be, dx);
    uint16_t *t = malloc(n * 2);
    for (size_t i = 0; i < n; i++)
        t[i] = i == n / 2 ? 0x7f80 : bf16_of(x[i]);
    dx = dev(b, n * 2);
    MUST(b->o->to_device(b->be, dx, t, n * 2));
    MUST(dg_backend_cuda_fp8_quantize(b->be, dq, NULL, dx, rows, cols, slot));
    MUST(b->o->to_host(b->be, q2, dq, n));
    snprintf(what, sizeof what, "quantize %dx%d: an inf element becomes NaN (code 0x%02x)", rows, cols,
             q2[n / 2]);
    check((q2[n / 2] & 0x7f) == 0x7f, what, q2[n / 2], 0x7f);
    free(t);
    free(q2);
    free(x);
    free(q);
    free(qt);
    b->o->free(b->be, dx);
    b->o->free(b->be, dq);
    b->o->free(b->be, dqt);
    b->o->free(b->be, slot);
}

/* ---- GEMMs against a float64 reference ---- */
static double gelu(double x) {
    return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}
static double dgelu(double x) {
    const double u = 0.7978845608028654 * (x + 0.044715 * x * x * x), t = tanh(u);
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3 * 0.044715 * x * x);
}

/* relative Frobenius error of got against ref */
static double rel_err(const float *got, const double *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = (double)got[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

typedef struct {
    int N, C, OC;
    float *inp, *w, *bias, *dout, *res, *pre; /* host, bf16-rounded */
} case_t;

static void case_make(case_t *k, int N, int C, int OC) {
    k->N = N;
    k->C = C;
    k->OC = OC;
    const size_t ni = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
    k->inp = malloc(ni * 4);
    k->w = malloc(nw * 4);
    k->bias = malloc((size_t)OC * 4);
    k->dout = malloc(no * 4);
    k->res = malloc(no * 4);
    k->pre = malloc(ni * 4);
    for (size_t i = 0; i < ni; i++)
        k->inp[i] = 2.f * frand();
    for (size_t i = 0; i < nw; i++)
        k->w[i] = 0.05f * frand();
    for (int i = 0; i < OC; i++)
        k->bias[i] = 0.1f * frand();
    for (size_t i = 0; i < no; i++) {
        k->dout[i] = 1e-3f * frand() * (1.f + 3.f * (i % 97 == 0)); /* gradient-sized, a few outliers */
        k->res[i] = frand();
    }
    for (size_t i = 0; i < ni; i++)
        k->pre[i] = 2.f * frand();
    round_bf16(k->inp, ni);
    round_bf16(k->w, nw);
    round_bf16(k->bias, (size_t)OC);
    round_bf16(k->dout, no);
    round_bf16(k->res, no);
    round_bf16(k->pre, ni);
}

typedef struct {
    float *fwd, *fwd_gelu, *fwd_res, *dinp, *dpre, *dw;
} outs_t;

/* runs the five calls on backend b; results to host floats */
static void run_case(bk_t *b, const case_t *k, outs_t *r) {
    const int N = k->N, C = k->C, OC = k->OC;
    const size_t ni = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
    void *inp = dev_bf16(b, k->inp, ni), *w = dev_bf16(b, k->w, nw), *bias = dev_bf16(b, k->bias, OC);
    void *dout = dev_bf16(b, k->dout, no), *res = dev_bf16(b, k->res, no), *pre = dev_bf16(b, k->pre, ni);
    void *out = dev(b, no * 2), *opre = dev(b, no * 2), *dinp = dev(b, ni * 2);
    float *dw = dev(b, nw * 4), *dbias = dev(b, (size_t)OC * 4);
    r->fwd = malloc(no * 4);
    r->fwd_gelu = malloc(no * 4);
    r->fwd_res = malloc(no * 4);
    r->dinp = malloc(ni * 4);
    r->dpre = malloc(ni * 4);
    r->dw = malloc(nw * 4);
    MUST(b->o->matmul_fwd(b->be, out, NULL, inp, w, bias, N, C, OC, DG_EPI_NONE));
    host_f(b, r->fwd, out, no, 1);
    MUST(b->o->matmul_fwd(b->be, out, opre, inp, w, bias, N, C, OC, DG_EPI_GELU));
    host_f(b, r->fwd_gelu, out, no, 1);
    MUST(b->o->matmul_fwd_res(b->be, res, inp, w, bias, res, N, C, OC)); /* in place, as GPT-2 runs it */
    host_f(b, r->fwd_res, res, no, 1);
    MUST(b->o->memset0(b->be, dw, nw * 4));
    MUST(b->o->memset0(b->be, dbias, (size_t)OC * 4));
    MUST(b->o->matmul_bwd(b->be, dinp, dw, dbias, dout, inp, w, N, C, OC, 0));
    host_f(b, r->dinp, dinp, ni, 1);
    host_f(b, r->dw, dw, nw, 0);
    MUST(b->o->matmul_bwd_dgelu(b->be, dinp, dw, dbias, dout, inp, w, pre, N, C, OC, 0));
    host_f(b, r->dpre, dinp, ni, 1);
    MUST(b->o->sync(b->be));
    void *all[] = {inp, w, bias, dout, res, pre, out, opre, dinp, dw, dbias};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        b->o->free(b->be, all[i]);
}

static void outs_free(outs_t *r) {
    DG_FREE_ALL(r->fwd, r->fwd_gelu, r->fwd_res, r->dinp, r->dpre, r->dw);
}

static void test_gemms(bk_t *b8, bk_t *b16, int N, int C, int OC) {
    case_t k;
    case_make(&k, N, C, OC);
    const size_t ni = (size_t)N * C, no = (size_t)N * OC;
    double *fwd = malloc(no * 8), *fg = malloc(no * 8), *fr = malloc(no * 8), *di = malloc(ni * 8),
           *dp = malloc(ni * 8);
    for (int i = 0; i < N; i++)
        for (int o = 0; o < OC; o++) {
            double s = 0;
            for (int c = 0; c < C; c++)
                s += (double)k.inp[(size_t)i * C + c] * k.w[(size_t)o * C + c];
            s += k.bias[o];
            fwd[(size_t)i * OC + o] = s;
            fg[(size_t)i * OC + o] = gelu(s);
            fr[(size_t)i * OC + o] = s + k.res[(size_t)i * OC + o];
        }
    for (int i = 0; i < N; i++)
        for (int c = 0; c < C; c++) {
            double s = 0;
            for (int o = 0; o < OC; o++)
                s += (double)k.dout[(size_t)i * OC + o] * k.w[(size_t)o * C + c];
            di[(size_t)i * C + c] = s;
            dp[(size_t)i * C + c] = s * dgelu(k.pre[(size_t)i * C + c]);
        }
    long long ran0 = 0, ref0 = 0, ran1 = 0, ref1 = 0;
    dg_backend_cuda_fp8_stats(b8->be, &ran0, &ref0);
    outs_t r8, r16;
    run_case(b8, &k, &r8);
    run_case(b16, &k, &r16);
    dg_backend_cuda_fp8_stats(b8->be, &ran1, &ref1);
    const struct {
        const char *name;
        const float *g8, *g16;
        const double *ref;
        size_t n;
    } v[] = {{"matmul_fwd + bias", r8.fwd, r16.fwd, fwd, no},
             {"matmul_fwd + bias + GELU", r8.fwd_gelu, r16.fwd_gelu, fg, no},
             {"matmul_fwd_res (in place)", r8.fwd_res, r16.fwd_res, fr, no},
             {"matmul_bwd input gradient", r8.dinp, r16.dinp, di, ni},
             {"matmul_bwd_dgelu input gradient", r8.dpre, r16.dpre, dp, ni}};
    char what[200];
    /* E4M3 keeps 3 mantissa bits (relative step 1/16 at worst, ~1/40 rms over a spread of values); the
     * dot products average independent rounding errors, so the product's rms error stays near that */
    const double tol8 = 0.05, tol16 = 0.01;
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        const double e8 = rel_err(v[i].g8, v[i].ref, v[i].n), e16 = rel_err(v[i].g16, v[i].ref, v[i].n);
        snprintf(what, sizeof what, "N=%d C=%d OC=%d %s: fp8 relative error", N, C, OC, v[i].name);
        check(e8 < tol8, what, e8, tol8);
        snprintf(what, sizeof what, "N=%d C=%d OC=%d %s: bf16 relative error", N, C, OC, v[i].name);
        check(e16 < tol16, what, e16, tol16);
        /* the FP8 path really ran: its error is well above bf16's */
        snprintf(what, sizeof what, "N=%d C=%d OC=%d %s: fp8 error above bf16's (FP8 ran)", N, C, OC,
                 v[i].name);
        check(e8 > 2 * e16, what, e8 / (e16 > 0 ? e16 : 1e-30), 2);
    }
    const size_t nw = (size_t)OC * C;
    snprintf(what, sizeof what, "N=%d C=%d OC=%d weight gradient (bf16 in fp8 mode) bitwise bf16's", N, C,
             OC);
    check(memcmp(r8.dw, r16.dw, nw * 4) == 0, what, (double)(memcmp(r8.dw, r16.dw, nw * 4) != 0), 0);
    snprintf(what, sizeof what, "N=%d C=%d OC=%d FP8 GEMMs run (5 calls, refused %lld)", N, C, OC,
             ref1 - ref0);
    check(ran1 - ran0 >= 5 && ref1 == ref0, what, (double)(ran1 - ran0), 5);
    outs_free(&r8);
    outs_free(&r16);
    free(fwd);
    free(fg);
    free(fr);
    free(di);
    free(dp);
    free(k.inp);
    free(k.w);
    free(k.bias);
    free(k.dout);
    free(k.res);
    free(k.pre);
}

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    bk_t b8, b16;
    if (!make(0, DG_BF16, &b16)) return dg_test_skip(1, "no CUDA device: %s", dg_last_error());
    if (!make(1, DG_BF16, &b8)) {
        printf("FAIL: fp8 backend refused: %s\n", dg_last_error());
        return 1;
    }
    bk_t bf;
    const int refused = !make(1, DG_F32, &bf);
    check(refused && strstr(dg_last_error(), "bf16") != NULL, "fp8 with f32 activations refused at creation",
          refused, 1);
    test_quantize(&b8, 256, 512, 3.f);
    test_quantize(&b8, 77, 45, 1e-3f); /* ragged: the tiled kernel's edges, no vector path */
    test_quantize(&b8, 64, 4096, 300.f);
    test_gemms(&b8, &b16, 256, 384, 512);
    test_gemms(&b8, &b16, 128, 768, 2304);
    b8.be->ops->destroy(b8.be);
    b16.be->ops->destroy(b16.be);
    printf("%d checks, %d failed\n", g_checks, g_fails);
    return g_fails ? 1 : 0;
}
