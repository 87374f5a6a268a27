/* bench_backend_cuda.c — per-kernel timings of the CUDA backend at GPT-2 124M shapes (12 layers, C=768,
 * 12 heads, V=50257 padded to 50304), plus the sum of one training step's kernels (no launch gaps: what
 * a CUDA-Graph replay approaches). Random non-zero inputs; each op warmed up, then timed over --iters
 * back-to-back calls between two syncs.
 *
 *   bench_backend_cuda [--B 8] [--T 1024] [--dtype bf16] [--iters 20] [--json FILE]
 * The JSON file (one object per op: name, ms, flop, bytes) is what tests/backend_cuda/torch_kernels.py
 * reads to print the same ops timed in PyTorch and the ratios. Exit 77 when there is no GPU.
 *
 *   bench_backend_cuda --mode lnbgrad [--B 32] [--T 1024] [--dtype bf16] [--iters 50]
 * The layernorm and bias-gradient figures: per-call times from CUDA events (median of 5 runs of --iters
 * back-to-back calls, after warm-up) at C = 768, N = B*T, of layernorm_fwd and layernorm_bwd (acc = 1, dw
 * and db) with the register kernels and with the generic ones (DG_CUDA_LN_REG=0; their dw/db compared,
 * max relative difference), and of matmul_bwd at the four GPT-2 layer shapes with the bias gradient (our
 * column sums) and without it. Ends with one line "LNBGRAD_SUMMARY ..." (the numbers and the per-step
 * costs).
 *
 *   bench_backend_cuda --mode ce [--B 32] [--T 1024] [--dtype bf16] [--iters 20]
 * The classifier loss: at N = B*T, V = 50257, Vp = 50304, logits ~ N(0, 2^2), per-call times (CUDA
 * events, median of 5 runs of --iters calls after warm-up) of crossentropy_fwd + crossentropy_bwd (the
 * pair) and of crossentropy_fused. dlogits go to their own buffer, so every call sees the same logits.
 * GB/s counts one read and one write of the logits. The fused row also says whether its losses, lse and
 * first/last 64 dlogits rows are bitwise the pair's. Ends with "CE_SUMMARY act=... pair=<ms> fused=<ms>".
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "backend.h"

#define BENCH_WHO "bench"
#include "../lib/bench_args.h"
#include "../lib/bench_check.h"

typedef struct {
    const char *name;
    double ms, flop, bytes;
    int per_step; /* how many times one training step runs it */
} row_t;

static dg_backend_t *g_be;
static int g_iters = 20;
static row_t g_rows[64];
static int g_nrows;

static void *dev(size_t bytes) {
    void *p = NULL;
    MUST(g_be->ops->alloc(g_be, bytes, &p));
    return p;
}
/* N int32 token ids (targets) in [0, V), a fixed spread over the vocabulary */
static int32_t *dev_tokens(int N, int V) {
    int32_t *h = malloc((size_t)N * 4);
    for (int i = 0; i < N; i++)
        h[i] = (int32_t)((i * 7919u + 13u) % (unsigned)V);
    int32_t *d = dev((size_t)N * 4);
    MUST(g_be->ops->to_device(g_be, d, h, (size_t)N * 4));
    free(h);
    return d;
}
/* act-dtype (or f32) buffer of random values in +-[lo, hi] */
static void *dev_rand(size_t n, dg_dtype_t dt, float lo, float hi, uint64_t seed) {
    float *h = malloc(n * sizeof(float));
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        float v = lo + (hi - lo) * (float)((s >> 11) * (1.0 / 9007199254740992.0));
        h[i] = (s & 1) ? v : -v;
    }
    float *tmp = dev(n * 4);
    MUST(g_be->ops->to_device(g_be, tmp, h, n * 4));
    void *d = tmp;
    if (dt != DG_F32) {
        d = dev(n * dg_dtype_size(dt));
        MUST(g_be->ops->cast(g_be, d, dt, tmp, DG_F32, n));
    }
    MUST(g_be->ops->sync(g_be));
    if (d != tmp) g_be->ops->free(g_be, tmp);
    free(h);
    return d;
}

#define TIME(NAME, FLOP, BYTES, PER_STEP, CALL)                                                              \
    do {                                                                                                     \
        for (int w_ = 0; w_ < 3; w_++)                                                                       \
            MUST(CALL);                                                                                      \
        MUST(g_be->ops->sync(g_be));                                                                         \
        double t0_ = dg_now_s();                                                                             \
        for (int i_ = 0; i_ < g_iters; i_++)                                                                 \
            MUST(CALL);                                                                                      \
        MUST(g_be->ops->sync(g_be));                                                                         \
        row_t *r_ = &g_rows[g_nrows++];                                                                      \
        r_->name = NAME;                                                                                     \
        r_->ms = (dg_now_s() - t0_) * 1e3 / g_iters;                                                         \
        r_->flop = (FLOP);                                                                                   \
        r_->bytes = (BYTES);                                                                                 \
        r_->per_step = (PER_STEP);                                                                           \
    } while (0)

/* ---------------- --mode lnbgrad ---------------- */

#define LB_REPS 5
static void *g_lb_ptrs[64]; /* this backend's buffers, freed before the next variant's backend */
static int g_lb_n;
static void *lb_track(void *p) {
    g_lb_ptrs[g_lb_n++] = p;
    return p;
}
static void lb_free_all(void) {
    for (int i = 0; i < g_lb_n; i++)
        g_be->ops->free(g_be, g_lb_ptrs[i]);
    g_lb_n = 0;
}
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
/* Median over LB_REPS runs of the per-call time of g_iters back-to-back calls, timed by CUDA events on
 * the backend's stream, after 5 warm-up calls. */
#define EV_TIME(OUT, CALL)                                                                                   \
    do {                                                                                                     \
        cudaStream_t st_ = (cudaStream_t)dg_backend_cuda_stream(g_be);                                       \
        cudaEvent_t e0_, e1_;                                                                                \
        CU(cudaEventCreate(&e0_));                                                                           \
        CU(cudaEventCreate(&e1_));                                                                           \
        for (int w_ = 0; w_ < 5; w_++)                                                                       \
            MUST(CALL);                                                                                      \
        MUST(g_be->ops->sync(g_be));                                                                         \
        double t_[LB_REPS];                                                                                  \
        for (int r_ = 0; r_ < LB_REPS; r_++) {                                                               \
            CU(cudaEventRecord(e0_, st_));                                                                   \
            for (int i_ = 0; i_ < g_iters; i_++)                                                             \
                MUST(CALL);                                                                                  \
            CU(cudaEventRecord(e1_, st_));                                                                   \
            CU(cudaEventSynchronize(e1_));                                                                   \
            float ms_ = 0.f;                                                                                 \
            CU(cudaEventElapsedTime(&ms_, e0_, e1_));                                                        \
            t_[r_] = (double)ms_ / g_iters;                                                                  \
        }                                                                                                    \
        MUST(g_be->ops->sync(g_be));                                                                         \
        qsort(t_, LB_REPS, sizeof t_[0], cmp_double);                                                        \
        (OUT) = t_[LB_REPS / 2];                                                                             \
        cudaEventDestroy(e0_);                                                                               \
        cudaEventDestroy(e1_);                                                                               \
    } while (0)

static float *lb_download(const float *d, size_t n) {
    float *h = malloc(n * sizeof(float));
    MUST(g_be->ops->to_host(g_be, h, d, n * sizeof(float)));
    return h;
}
/* max |a - b| / max(|b|, rms(b)) */
static double lb_maxrel(const float *a, const float *b, size_t n) {
    double ss = 0, worst = 0;
    for (size_t i = 0; i < n; i++)
        ss += (double)b[i] * b[i];
    const double rms = sqrt(ss / (double)n);
    for (size_t i = 0; i < n; i++) {
        double den = fabs(b[i]) > rms ? fabs(b[i]) : rms;
        double e = den > 0 ? fabs((double)a[i] - b[i]) / den : fabs((double)a[i] - b[i]);
        if (!(e <= worst)) worst = e; /* NaN counts as worst */
    }
    return worst;
}

static dg_status_t lb_create(dg_dtype_t act, const char *ln_reg) {
    setenv("DG_CUDA_LN_REG", ln_reg, 1);
    dg_backend_config_t cfg = {.act_dtype = act, .device = 0};
    dg_status_t s = dg_backend_cuda_create(&cfg, &g_be);
    unsetenv("DG_CUDA_LN_REG");
    return s;
}

static int run_lnbgrad(int B, int T, dg_dtype_t act) {
    const int C = 768, N = B * T, L = 12;
    const size_t as = dg_dtype_size(act), nc = (size_t)N * C;
    static const struct {
        const char *name;
        int C, OC;
    } shp[4] = {{"qkv", 768, 2304}, {"attproj", 768, 768}, {"fc", 768, 3072}, {"fcproj", 3072, 768}};
    /* [variant]: 0 = the default (register layernorm kernels), 1 = DG_CUDA_LN_REG=0 (generic kernels) */
    double ln_f[2] = {0}, ln_b[2] = {0}, mm[4] = {0}, nob[4] = {0};
    float *ln_dw[2] = {0};
    for (int v = 0; v < 2; v++) {
        if (lb_create(act, v == 1 ? "0" : "1") != DG_OK) {
            printf("SKIP: %s\n", dg_last_error());
            return strstr(dg_last_error(), "no CUDA device") ? 77 : 1;
        }
        const dg_backend_ops_t *op = g_be->ops;
        void *x = lb_track(dev_rand(nc, act, 0.1f, 1.f, 3)),
             *dy = lb_track(dev_rand(nc, act, 0.01f, 0.1f, 4));
        void *out = lb_track(dev(nc * as)), *dx = lb_track(dev_rand(nc, act, 0.01f, 0.1f, 5));
        void *lnw = lb_track(dev_rand(C, act, 0.8f, 1.2f, 6)),
             *lnb = lb_track(dev_rand(C, act, 0.f, 0.1f, 7));
        float *mean = lb_track(dev((size_t)N * 4)), *rstd = lb_track(dev((size_t)N * 4));
        float *g = lb_track(dev((size_t)2 * C * 4));
        MUST(op->layernorm_fwd(g_be, out, mean, rstd, x, lnw, lnb, N, C));
        MUST(op->memset0(g_be, g, (size_t)2 * C * 4));
        MUST(op->layernorm_bwd(g_be, dx, g, g + C, dy, x, lnw, mean, rstd, N, C, 1));
        ln_dw[v] = lb_download(g, (size_t)2 * C);
        EV_TIME(ln_f[v], op->layernorm_fwd(g_be, out, mean, rstd, x, lnw, lnb, N, C));
        EV_TIME(ln_b[v], op->layernorm_bwd(g_be, dx, g, g + C, dy, x, lnw, mean, rstd, N, C, 1));
        if (v == 0) { /* matmul_bwd at the four shapes, with and without the bias gradient */
            const size_t big = (size_t)N * 3072;
            void *inp = lb_track(dev_rand(big, act, 0.1f, 1.f, 8)),
                 *dout = lb_track(dev_rand(big, act, 0.01f, 0.1f, 9));
            void *dinp = lb_track(dev(big * as)),
                 *w = lb_track(dev_rand((size_t)3072 * 768, act, 0.01f, 0.03f, 10));
            float *dw = lb_track(dev((size_t)3072 * 768 * 4)), *db = lb_track(dev((size_t)3072 * 4));
            MUST(op->memset0(g_be, dw, (size_t)3072 * 768 * 4));
            MUST(op->memset0(g_be, db, (size_t)3072 * 4));
            for (int k = 0; k < 4; k++) {
                const int c = shp[k].C, oc = shp[k].OC;
                EV_TIME(mm[k], op->matmul_bwd(g_be, dinp, dw, db, dout, inp, w, N, c, oc, 0));
                EV_TIME(nob[k], op->matmul_bwd(g_be, dinp, dw, NULL, dout, inp, w, N, c, oc, 0));
            }
        }
        lb_free_all();
        dg_backend_free(g_be);
        g_be = NULL;
    }

    const double lnf_bytes = (double)nc * 2 * as, lnb_bytes = (double)nc * 4 * as;
    printf("\nlayernorm and bias gradients, B=%d T=%d (N=%d) C=%d, act %s; per call, median of %d runs of %d "
           "calls (CUDA events)\n",
           B, T, N, C, dg_dtype_name(act), LB_REPS, g_iters);
    printf("%-34s %10s %8s %12s %8s\n", "op", "register", "GB/s", "generic", "GB/s");
    printf("%-34s %10.4f %8.0f %12.4f %8.0f\n", "layernorm_fwd", ln_f[0], lnf_bytes / (ln_f[0] * 1e6),
           ln_f[1], lnf_bytes / (ln_f[1] * 1e6));
    printf("%-34s %10.4f %8.0f %12.4f %8.0f\n", "layernorm_bwd (acc=1, dw, db)", ln_b[0],
           lnb_bytes / (ln_b[0] * 1e6), ln_b[1], lnb_bytes / (ln_b[1] * 1e6));
    printf("%-34s %10.2g (register vs generic, from zero)\n", "layernorm_bwd dw/db max rel diff",
           lb_maxrel(ln_dw[0], ln_dw[1], (size_t)2 * C));
    printf("\n%-22s %10s %10s %10s %9s\n", "matmul_bwd", "bias grad", "no bias", "colsum", "cs GB/s");
    double tot = 0, tot_n = 0;
    for (int k = 0; k < 4; k++) {
        char nm[64];
        snprintf(nm, sizeof nm, "%s (C=%d, OC=%d)", shp[k].name, shp[k].C, shp[k].OC);
        /* the column sum's bandwidth, from its share of the call (0 when noise hides it) */
        const double cs_ms = mm[k] - nob[k],
                     cs_gbs = cs_ms > 0 ? (double)N * shp[k].OC * as / (cs_ms * 1e6) : 0;
        printf("%-22s %10.4f %10.4f %+10.4f %9.0f\n", nm, mm[k], nob[k], cs_ms, cs_gbs);
        tot += mm[k];
        tot_n += nob[k];
    }
    printf("%-22s %10.4f %10.4f %+10.4f\n", "per layer", tot, tot_n, tot - tot_n);
    const double ln_save = (2 * L + 1) * ((ln_f[1] - ln_f[0]) + (ln_b[1] - ln_b[0]));
    printf("LNBGRAD_SUMMARY act=%s N=%d ln_fwd_ms=%.4f ln_fwd_generic_ms=%.4f ln_bwd_ms=%.4f "
           "ln_bwd_generic_ms=%.4f ln_step_saving_ms=%.3f mm_bwd_layer_ms=%.4f mm_bwd_layer_nobias_ms=%.4f "
           "bgrad_step_ms=%.3f\n",
           dg_dtype_name(act), N, ln_f[0], ln_f[1], ln_b[0], ln_b[1], ln_save, tot, tot_n, L * (tot - tot_n));
    for (int v = 0; v < 2; v++)
        free(ln_dw[v]);
    return 0;
}

/* ---------------- --mode ce ---------------- */

static dg_status_t ce_pair(float *losses, float *lse, void *dl, const void *logits, const int32_t *tg, int N,
                           int V, int Vp, float dloss) {
    dg_status_t s = g_be->ops->crossentropy_fwd(g_be, losses, lse, logits, tg, N, V, Vp);
    if (s != DG_OK) return s;
    return g_be->ops->crossentropy_bwd(g_be, dl, logits, lse, tg, N, V, Vp, dloss);
}

/* losses, lse and the first and last CE_CHECK_ROWS rows of dlogits, as bytes on the host */
#define CE_CHECK_ROWS 64
typedef struct {
    unsigned char *b;
    size_t n;
} ce_snap_t;
static ce_snap_t ce_snap(const float *losses, const float *lse, const unsigned char *dl, int N, int Vp,
                         size_t as) {
    const int r = N < 2 * CE_CHECK_ROWS ? N : CE_CHECK_ROWS;
    const size_t row = (size_t)Vp * as, nl = (size_t)N * 4;
    ce_snap_t s = {malloc(2 * nl + 2 * (size_t)r * row), 2 * nl + 2 * (size_t)r * row};
    MUST(g_be->ops->to_host(g_be, s.b, losses, nl));
    MUST(g_be->ops->to_host(g_be, s.b + nl, lse, nl));
    MUST(g_be->ops->to_host(g_be, s.b + 2 * nl, dl, (size_t)r * row));
    MUST(g_be->ops->to_host(g_be, s.b + 2 * nl + (size_t)r * row, dl + (size_t)(N - r) * row,
                            (size_t)r * row));
    return s;
}

static int run_ce(int B, int T, dg_dtype_t act) {
    dg_backend_config_t cfg = {.act_dtype = act, .device = 0};
    if (dg_backend_cuda_create(&cfg, &g_be) != DG_OK) {
        printf("SKIP: %s\n", dg_last_error());
        return strstr(dg_last_error(), "no CUDA device") ? 77 : 1;
    }
    const dg_backend_ops_t *op = g_be->ops;
    const int V = 50257, Vp = 50304, N = B * T, R = 256;
    const size_t as = dg_dtype_size(act), nz = (size_t)N * Vp;
    const float dloss = 1.0f / (float)N;
    /* logits ~ N(0, 2^2) (Box-Muller over xorshift), padding columns 0; R distinct rows repeated */
    float *h = malloc((size_t)R * Vp * sizeof(float));
    uint64_t x = 0x2545F4914F6CDD1Dull;
    for (int r = 0; r < R; r++)
        for (int c = 0; c < Vp; c++) {
            double u[2];
            for (int k = 0; k < 2; k++) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                u[k] = ((x >> 11) + 0.5) * (1.0 / 9007199254740992.0);
            }
            h[(size_t)r * Vp + c] =
                c < V ? (float)(2.0 * sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1])) : 0.f;
        }
    float *tmp = dev((size_t)R * Vp * 4);
    MUST(op->to_device(g_be, tmp, h, (size_t)R * Vp * 4));
    free(h);
    unsigned char *logits = dev(nz * as), *dl = dev(nz * as);
    for (int r0 = 0; r0 < N; r0 += R) {
        const size_t n = (size_t)(N - r0 < R ? N - r0 : R) * Vp;
        if (act == DG_F32)
            MUST(op->copy(g_be, logits + (size_t)r0 * Vp * as, tmp, n * 4));
        else
            MUST(op->cast(g_be, logits + (size_t)r0 * Vp * as, act, tmp, DG_F32, n));
    }
    int32_t *tg = dev_tokens(N, V);
    float *losses = dev((size_t)N * 4), *lse = dev((size_t)N * 4);
    MUST(op->sync(g_be));
    g_be->ops->free(g_be, tmp);

    const double bytes = 2.0 * (double)nz * as;
    double ms[2];
    printf(
        "\ncrossentropy at N=B*T=%d (B=%d, T=%d), V=%d, Vp=%d, act %s, logits ~ N(0, 4), dlogits out of "
        "place; per call, median of %d runs of %d calls (CUDA events); GB/s counts %.2f GB (one read + one "
        "write of the logits)\n",
        N, B, T, V, Vp, dg_dtype_name(act), LB_REPS, g_iters, bytes / 1e9);
    printf("%-34s %10s %8s  %s\n", "op", "ms/call", "GB/s", "bits (losses, lse, dlogits rows vs the pair)");
    EV_TIME(ms[0], ce_pair(losses, lse, dl, logits, tg, N, V, Vp, dloss));
    ce_snap_t ref = ce_snap(losses, lse, dl, N, Vp, as);
    printf("%-34s %10.4f %8.0f  %s\n", "crossentropy_fwd + _bwd", ms[0], bytes / (ms[0] * 1e6), "reference");
    EV_TIME(ms[1], op->crossentropy_fused(g_be, losses, lse, dl, logits, tg, N, V, Vp, dloss));
    ce_snap_t fs = ce_snap(losses, lse, dl, N, Vp, as);
    printf("%-34s %10.4f %8.0f  %s\n", "crossentropy_fused", ms[1], bytes / (ms[1] * 1e6),
           fs.n == ref.n && memcmp(fs.b, ref.b, fs.n) == 0 ? "same" : "DIFFERENT");
    free(ref.b);
    free(fs.b);
    printf("CE_SUMMARY act=%s N=%d pair=%.4f fused=%.4f\n", dg_dtype_name(act), N, ms[0], ms[1]);
    dg_backend_free(g_be);
    return 0;
}

int main(int argc, char **argv) {
    int B = 0, T = 1024, iters = 0;
    dg_dtype_t act = DG_BF16;
    const char *json = NULL, *mode = "kernels";
    void *const dst[] = {&mode, &B, &T, &iters, &json};
    const char *spec = "--mode=str --B=int --T=int --iters=int --json=str";
    for (int i = 1; (i = bench_args(argc, argv, i, spec, dst)) < argc; i += 2) {
        if (strcmp(argv[i], "--dtype") || i + 1 >= argc) {
            fprintf(stderr,
                    "usage: %s [--mode kernels|lnbgrad|ce] [--B 8] [--T 1024] [--dtype bf16|f16|f32] "
                    "[--iters 20] "
                    "[--json FILE]\n",
                    argv[0]);
            return 2;
        }
        const char *d = argv[i + 1];
        act = !strcmp(d, "f32") ? DG_F32 : !strcmp(d, "f16") ? DG_F16 : DG_BF16;
    }
    const int lnbgrad = !strcmp(mode, "lnbgrad"), ce = !strcmp(mode, "ce");
    if (B == 0) B = lnbgrad || ce ? 32 : 8;
    g_iters = iters ? iters : lnbgrad ? 50 : 20;
    if (B < 1 || T < 1 || g_iters < 1) {
        fprintf(stderr, "bench: B, T and --iters must be positive\n");
        return 2;
    }
    if (lnbgrad) return run_lnbgrad(B, T, act);
    if (ce) return run_ce(B, T, act);
    if (strcmp(mode, "kernels") != 0) {
        fprintf(stderr, "bench: unknown --mode %s (kernels, lnbgrad or ce)\n", mode);
        return 2;
    }
    dg_backend_config_t cfg = {.act_dtype = act, .device = 0};
    if (dg_backend_cuda_create(&cfg, &g_be) != DG_OK) {
        printf("SKIP: %s\n", dg_last_error());
        return strstr(dg_last_error(), "no CUDA device") ? 77 : 1;
    }
    const dg_backend_ops_t *op = g_be->ops;
    const int C = 768, NH = 12, V = 50257, Vp = 50304, L = 12, N = B * T;
    const size_t as = dg_dtype_size(act), nc = (size_t)N * C;
    const double nparam = 124475904.0; /* GPT-2 124M with Vp = 50304 */

    int32_t *tok = dev_tokens(N, V);
    void *wte = dev_rand((size_t)Vp * C, act, 0.01f, 0.05f, 1),
         *wpe = dev_rand((size_t)T * C, act, 0.01f, 0.05f, 2);
    void *x = dev_rand(nc, act, 0.1f, 1.f, 3), *dy = dev_rand(nc, act, 0.01f, 0.1f, 4), *out = dev(nc * as);
    void *dx = dev(nc * as);
    void *lnw = dev_rand(C, act, 0.8f, 1.2f, 5), *lnb = dev_rand(C, act, 0.0f, 0.1f, 6);
    float *mean = dev((size_t)N * 4), *rstd = dev((size_t)N * 4), *gC = dev((size_t)4 * C * 4 * 3);
    void *w3 = dev_rand((size_t)3 * C * C, act, 0.01f, 0.03f, 7),
         *b3 = dev_rand((size_t)3 * C, act, 0.f, 0.02f, 8);
    void *w4 = dev_rand((size_t)4 * C * C, act, 0.01f, 0.03f, 9),
         *b4 = dev_rand((size_t)4 * C, act, 0.f, 0.02f, 10);
    void *wp = dev_rand((size_t)C * 4 * C, act, 0.01f, 0.03f, 11),
         *w1 = dev_rand((size_t)C * C, act, 0.01f, 0.03f, 12);
    float *gw = dev((size_t)4 * C * C * 4), *gte = dev((size_t)Vp * C * 4), *gpe = dev((size_t)T * C * 4);
    void *qkv = dev_rand(nc * 3, act, 0.1f, 1.f, 13), *dqkv = dev(nc * 3 * as);
    void *h4 = dev_rand(nc * 4, act, 0.1f, 1.f, 14), *pre4 = dev(nc * 4 * as),
         *dh4 = dev_rand(nc * 4, act, 0.01f, 0.1f, 15);
    void *aux = dev(op->attention_aux_bytes(g_be, B, T, C, NH));
    void *logits = dev((size_t)N * Vp * as);
    float *losses = dev((size_t)N * 4), *lse = dev((size_t)N * 4);
    MUST(op->memset0(g_be, gw, (size_t)4 * C * C * 4));
    MUST(op->memset0(g_be, gC, (size_t)4 * C * 4 * 3));
    MUST(op->memset0(g_be, gte, (size_t)Vp * C * 4));
    MUST(op->memset0(g_be, gpe, (size_t)T * C * 4));

    const double a2 = 2.0 * as;
    /* embeddings */
    TIME("encoder_fwd", 0, nc * 3 * as, 1, op->encoder_fwd(g_be, out, tok, wte, wpe, B, T, C));
    TIME("encoder_bwd", 0, nc * as + nc * 8.0, 1, op->encoder_bwd(g_be, gte, gpe, dy, tok, B, T, C));
    /* layernorm */
    TIME("layernorm_fwd", 0, nc * a2, 2 * L + 1, op->layernorm_fwd(g_be, out, mean, rstd, x, lnw, lnb, N, C));
    TIME("layernorm_bwd", 0, nc * 3.0 * as, 2 * L + 1,
         op->layernorm_bwd(g_be, dx, gC, gC + C, dy, x, lnw, mean, rstd, N, C, 1));
    /* GEMMs of one block */
    const double f1 = 2.0 * N * C * (double)C;
    TIME("matmul_fwd qkv", 3 * f1, 0, L,
         op->matmul_fwd(g_be, qkv, NULL, x, w3, b3, N, C, 3 * C, DG_EPI_NONE));
    TIME("matmul_bwd qkv", 6 * f1, 0, L, op->matmul_bwd(g_be, dx, gw, gC, qkv, x, w3, N, C, 3 * C, 0));
    TIME("matmul_fwd attproj", f1, 0, L, op->matmul_fwd(g_be, out, NULL, x, w1, b3, N, C, C, DG_EPI_NONE));
    TIME("matmul_bwd attproj", 2 * f1, 0, L, op->matmul_bwd(g_be, dx, gw, gC, dy, x, w1, N, C, C, 0));
    TIME("matmul_fwd fc+gelu", 4 * f1, 0, L,
         op->matmul_fwd(g_be, h4, pre4, x, w4, b4, N, C, 4 * C, DG_EPI_GELU));
    TIME("matmul_bwd fc", 8 * f1, 0, L, op->matmul_bwd(g_be, dx, gw, gC, dh4, x, w4, N, C, 4 * C, 0));
    TIME("matmul_fwd fcproj", 4 * f1, 0, L,
         op->matmul_fwd(g_be, out, NULL, h4, wp, b3, N, 4 * C, C, DG_EPI_NONE));
    TIME("matmul_bwd fcproj", 8 * f1, 0, L, op->matmul_bwd(g_be, dh4, gw, gC, dy, h4, wp, N, 4 * C, C, 0));
    TIME("gelu_bwd", 0, nc * 4 * 3.0 * as, L, op->gelu_bwd(g_be, dh4, pre4, dh4, nc * 4, 0));
    /* what the graph runs instead of the two rows above (fcproj's matmul_bwd + gelu_bwd): one call with
     * the DGELU epilogue (DG_CUDA_FUSED_DGELU=0: the same call as GEMM + gelu_bwd). x/step 0: the step sum
     * keeps the unfused rows, so it stays comparable with earlier runs and with PyTorch's */
    TIME("matmul_bwd_dgelu fcproj", 8 * f1, 0, 0,
         op->matmul_bwd_dgelu(g_be, dh4, gw, gC, dy, h4, wp, pre4, N, 4 * C, C, 0));
    /* train.recompute = gelu: one gelu_fwd of the pre-activation per layer in the backward */
    TIME("gelu_fwd (recompute)", 0, nc * 4 * 2.0 * as, 0, op->gelu_fwd(g_be, h4, pre4, nc * 4));
    TIME("add (residual)", 0, nc * 3.0 * as, 2 * L, op->add(g_be, out, x, dy, nc));
    TIME("accumulate (residual grad)", 0, nc * 3.0 * as, 2 * L, op->accumulate(g_be, dx, dy, nc, 1));
    /* attention: causal, so half the T x T products */
    const double fatt = 4.0 * B * NH * (double)T * T * (C / NH) / 2.0;
    TIME("attention_fwd", fatt, 0, L, op->attention_fwd(g_be, out, aux, qkv, B, T, C, NH));
    TIME("attention_bwd", 2.5 * fatt, 0, L, op->attention_bwd(g_be, dqkv, dy, qkv, out, aux, B, T, C, NH));
    /* classifier */
    const double flm = 2.0 * N * C * (double)Vp;
    TIME("matmul_fwd lm_head", flm, 0, 1,
         op->matmul_fwd(g_be, logits, NULL, x, wte, NULL, N, C, Vp, DG_EPI_NONE));
    TIME("crossentropy_fwd", 0, (double)N * Vp * as, 1,
         op->crossentropy_fwd(g_be, losses, lse, logits, tok, N, V, Vp));
    TIME("crossentropy_bwd", 0, (double)N * Vp * a2, 1,
         op->crossentropy_bwd(g_be, logits, logits, lse, tok, N, V, Vp, 1.0f / N));
    /* what the graph runs instead of the two rows above (pass fuse_crossentropy, contract v1.10): both in
     * one read and one write of the logits, in place. x/step 0, as for matmul_bwd_dgelu: the step sum
     * keeps the pair */
    TIME("crossentropy_fused", 0, (double)N * Vp * a2, 0,
         op->crossentropy_fused(g_be, losses, lse, logits, logits, tok, N, V, Vp, 1.0f / N));
    TIME("matmul_bwd lm_head", 2 * flm, 0, 1,
         op->matmul_bwd(g_be, dx, gte, NULL, logits, x, wte, N, C, Vp, 0));
    /* optimizer over all parameters */
    const size_t np = (size_t)nparam;
    g_be->ops->free(g_be, logits);
    float *pm = dev_rand(np, DG_F32, 0.01f, 0.1f, 20), *pg = dev_rand(np, DG_F32, 0.001f, 0.01f, 21);
    float *pmm = dev(np * 4), *pvv = dev(np * 4), *gs = dev(4);
    void *pc = dev(np * as);
    MUST(op->memset0(g_be, pmm, np * 4));
    MUST(op->memset0(g_be, pvv, np * 4));
    const float one = 1.f;
    MUST(op->to_device(g_be, gs, &one, 4));
    TIME("sumsq_f32 (all grads)", 0, np * 4.0, 1, op->sumsq_f32(g_be, gs + 0, pg, np));
    MUST(op->to_device(g_be, gs, &one, 4));
    TIME("adamw (all params)", 0, np * (4.0 * 7 + as), 1,
         op->adamw(g_be, pm, pc, pg, pmm, pvv, np, 1e-4f, 0.9f, 0.95f, 1e-8f, 0.f, 1, gs));

    double step_ms = 0;
    printf("\nCUDA backend kernels, GPT-2 124M shapes, B=%d T=%d, act %s, %d iterations each\n", B, T,
           dg_dtype_name(act), g_iters);
    printf("%-28s %10s %10s %10s %6s\n", "op", "ms/call", "TFLOP/s", "GB/s", "x/step");
    for (int i = 0; i < g_nrows; i++) {
        row_t *r = &g_rows[i];
        char tf[32] = "-", gb[32] = "-";
        if (r->flop > 0) snprintf(tf, sizeof tf, "%.1f", r->flop / (r->ms * 1e-3) / 1e12);
        if (r->bytes > 0) snprintf(gb, sizeof gb, "%.0f", r->bytes / (r->ms * 1e-3) / 1e9);
        printf("%-28s %10.4f %10s %10s %6d\n", r->name, r->ms, tf, gb, r->per_step);
        step_ms += r->ms * r->per_step;
    }
    printf("sum of one step's kernels: %.2f ms -> %.0f tokens/s (kernel time only, B*T = %d tokens)\n",
           step_ms, N / (step_ms * 1e-3), N);
    if (json) {
        FILE *f = fopen(json, "w");
        if (!f) {
            fprintf(stderr, "bench: cannot write %s\n", json);
            return 1;
        }
        fprintf(f, "{\"B\":%d,\"T\":%d,\"act\":\"%s\",\"step_ms\":%.4f,\"ops\":[", B, T, dg_dtype_name(act),
                step_ms);
        for (int i = 0; i < g_nrows; i++)
            fprintf(f, "%s{\"name\":\"%s\",\"ms\":%.5f,\"flop\":%.6g,\"bytes\":%.6g,\"per_step\":%d}",
                    i ? "," : "", g_rows[i].name, g_rows[i].ms, g_rows[i].flop, g_rows[i].bytes,
                    g_rows[i].per_step);
        fprintf(f, "]}\n");
        fclose(f);
    }
    dg_backend_free(g_be); /* device memory goes with the context at exit */
    return 0;
}
