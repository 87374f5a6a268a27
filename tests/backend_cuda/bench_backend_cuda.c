/* bench_backend_cuda.c — per-kernel timings of the CUDA backend at GPT-2 124M shapes (12 layers, C=768,
 * 12 heads, V=50257 padded to 50304), plus the sum of one training step's kernels (no launch gaps: what
 * a CUDA-Graph replay approaches). Random non-zero inputs; each op warmed up, then timed over --iters
 * back-to-back calls between two syncs.
 *
 *   bench_backend_cuda [--B 8] [--T 1024] [--dtype bf16] [--iters 20] [--json FILE]
 * The JSON file (one object per op: name, ms, flop, bytes) is what tests/backend_cuda/torch_kernels.py
 * reads to print the same ops timed in PyTorch and the ratios. Exit 77 when there is no GPU.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

#define MUST(call)                                                                                           \
    do {                                                                                                     \
        dg_status_t must_s_ = (call);                                                                        \
        if (must_s_ != DG_OK) {                                                                              \
            fprintf(stderr, "bench: %s failed: %s (%s)\n", #call, dg_last_error(), dg_last_error_where());   \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

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

int main(int argc, char **argv) {
    int B = 8, T = 1024;
    dg_dtype_t act = DG_BF16;
    const char *json = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--B") && i + 1 < argc)
            B = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--T") && i + 1 < argc)
            T = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
            g_iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--json") && i + 1 < argc)
            json = argv[++i];
        else if (!strcmp(argv[i], "--dtype") && i + 1 < argc) {
            const char *d = argv[++i];
            act = !strcmp(d, "f32") ? DG_F32 : !strcmp(d, "f16") ? DG_F16 : DG_BF16;
        } else {
            fprintf(stderr,
                    "usage: %s [--B 8] [--T 1024] [--dtype bf16|f16|f32] [--iters 20] [--json FILE]\n",
                    argv[0]);
            return 2;
        }
    }
    if (B < 1 || T < 1 || g_iters < 1) {
        fprintf(stderr, "bench: B, T and --iters must be positive\n");
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

    int32_t *htok = malloc((size_t)N * 4);
    for (int i = 0; i < N; i++)
        htok[i] = (int32_t)((i * 7919u + 13u) % (unsigned)V);
    int32_t *tok = dev((size_t)N * 4);
    MUST(op->to_device(g_be, tok, htok, (size_t)N * 4));
    free(htok);
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
