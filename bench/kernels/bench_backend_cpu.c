/* bench_backend_cpu.c — micro-benchmark of the CPU backend's kernels at one GPT shape, with a reference
 * measured in the same run: each GEMM is also timed as one whole-matrix OpenBLAS call using OpenBLAS's
 * own threads (the fastest way to run that GEMM with this library), and the ratio is printed. It also
 * adds the kernels up into an estimate of one training step of an L-layer model (kernel time only: no
 * graph executor, no data loading), to see where the time goes.
 *
 *   bench_backend_cpu [--B 8] [--T 256] [--C 384] [--NH 6] [--L 6] [--V 256] [--threads 0] [--reps 5]
 *                     [--min-gemm-ratio R]   exit 1 if the tiled GEMMs reach less than R x the reference
 *                     [--cpu-clock 1]        time with process CPU time instead of wall time: with
 *                                            --threads 1 this ignores other load on shared cores
 */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../lib/bench_args.h"
#include "backend.h"

static dg_backend_t *g_be;
static int g_reps = 5;
static void *g_bufs[64];
static int g_nbufs;
static int g_cpu_clock; /* 1: process CPU time (meaningful with --threads 1 on a busy machine) */

static double clock_s(void) {
    if (!g_cpu_clock) return dg_now_s();
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

#define CHECK(call)                                                                                          \
    do {                                                                                                     \
        dg_status_t s_ = (call);                                                                             \
        if (s_ != DG_OK) {                                                                                   \
            fprintf(stderr, "bench: %s failed: %s\n", #call, dg_last_error());                               \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

static float *fbuf(size_t n, float scale) {
    float *p = NULL;
    CHECK(g_be->ops->alloc(g_be, n * sizeof(float), (void **)&p));
    g_bufs[g_nbufs++] = p;
    uint64_t x = 0x9E3779B97F4A7C15ull ^ n;
    for (size_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        p[i] = scale * ((float)(x >> 40) / 16777216.0f * 2.0f - 1.0f + 1e-3f);
    }
    return p;
}

/* Minimum over reps of one call, in ms (minimum: the least disturbed by other load on shared cores). */
#define TIME_MS(out, stmt)                                                                                   \
    do {                                                                                                     \
        stmt;                                                                                                \
        double best_ = 1e30;                                                                                 \
        for (int r_ = 0; r_ < g_reps; r_++) {                                                                \
            double t0_ = clock_s();                                                                          \
            stmt;                                                                                            \
            double dt_ = (clock_s() - t0_) * 1e3;                                                            \
            if (dt_ < best_) best_ = dt_;                                                                    \
        }                                                                                                    \
        (out) = best_;                                                                                       \
    } while (0)

static void row(const char *name, const char *shape, double ms, double flops, double per_step) {
    if (flops > 0)
        printf("%-18s %-22s %9.3f ms %7.1f GF/s  x%-3.0f\n", name, shape, ms, flops / ms * 1e-6, per_step);
    else
        printf("%-18s %-22s %9.3f ms %13s  x%-3.0f\n", name, shape, ms, "", per_step);
}

int main(int argc, char **argv) {
    int B = 8, T = 256, C = 384, NH = 6, L = 6, V = 256, threads = 0;
    double min_ratio = 0;
    void *const dst[] = {&B, &T, &C, &NH, &L, &V, &threads, &g_reps, &min_ratio, &g_cpu_clock};
    const char *spec = "--B=intf --T=intf --C=intf --NH=intf --L=intf --V=intf --threads=intf --reps=intf "
                       "--min-gemm-ratio=real --cpu-clock=intf";
    const int bad = bench_args(argc, argv, 1, spec, dst); /* pairs; a lone last argument is ignored */
    if (bad + 1 < argc) {
        fprintf(stderr, "bench: unknown option %s\n", argv[bad]);
        return 1;
    }
    const int Vp = (V + 63) / 64 * 64, N = B * T;
    dg_backend_config_t cfg = {.act_dtype = DG_F32, .threads = threads};
    CHECK(dg_backend_cpu_create(&cfg, &g_be));
    const dg_backend_ops_t *op = g_be->ops;
    printf("cpu backend bench: B=%d T=%d C=%d NH=%d L=%d V=%d (Vp=%d), N=%d rows, %d reps (min)\n", B, T, C,
           NH, L, V, Vp, N, g_reps);

    float *x = fbuf((size_t)N * 4 * C, 1.0f), *y = fbuf((size_t)N * 4 * C, 1.0f),
          *z = fbuf((size_t)N * 4 * C, 1.0f);
    float *w = fbuf((size_t)4 * C * C, 0.05f), *dw = fbuf((size_t)4 * C * C, 0.0f), *bias = fbuf(4 * C, 0.1f);
    float *db = fbuf(4 * C, 0.0f), *mean = fbuf(N, 0), *rstd = fbuf(N, 0),
          *qkv = fbuf((size_t)N * 3 * C, 1.0f);
    float *dqkv = fbuf((size_t)N * 3 * C, 0), *logits = fbuf((size_t)N * Vp, 2.0f),
          *wte = fbuf((size_t)Vp * C, 0.1f);
    float *dwte = fbuf((size_t)Vp * C, 0), *losses = fbuf(N, 0), *lse = fbuf(N, 0), *gs = fbuf(1, 0);
    void *aux = NULL;
    CHECK(op->alloc(g_be, op->attention_aux_bytes(g_be, B, T, C, NH), &aux));
    g_bufs[g_nbufs++] = aux;
    int32_t *tok = NULL;
    CHECK(op->alloc(g_be, (size_t)N * 4, (void **)&tok));
    g_bufs[g_nbufs++] = tok;
    for (int i = 0; i < N; i++)
        tok[i] = (i * 7919) % V;
    gs[0] = 1.0f;

    /* GEMMs of one block: {name, OC, IC, gelu} */
    struct {
        const char *name;
        int oc, ic, gelu;
    } mm[] = {
        {"qkv", 3 * C, C, 0}, {"attn_proj", C, C, 0}, {"fc (+gelu)", 4 * C, C, 1}, {"fc_proj", C, 4 * C, 0}};
    double layer_ms = 0, head_ms = 0, t, gemm_ours = 0, gemm_ref = 0;
    const int blas_threads = threads > 0 ? threads : openblas_get_num_procs();
    char shape[64];
    printf("%-18s %-22s %12s %12s  per step\n", "kernel", "shape", "time", "rate");
    for (int k = 0; k < 4; k++) {
        const int OC = mm[k].oc, IC = mm[k].ic;
        const double fl = 2.0 * N * OC * IC;
        snprintf(shape, sizeof shape, "%dx%d -> %d", N, IC, OC);
        TIME_MS(t, CHECK(op->matmul_fwd(g_be, y, mm[k].gelu ? z : NULL, x, w, bias, N, IC, OC,
                                        mm[k].gelu ? DG_EPI_GELU : DG_EPI_NONE)));
        row(mm[k].name, shape, t, fl, L);
        layer_ms += t;
        double ours = t, ref;
        /* reference: the same GEMM as one call with OpenBLAS's own threads */
        openblas_set_num_threads(blas_threads);
        TIME_MS(ref, cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, IC, 1.0f, x, IC, w, IC, 0.0f,
                                 y, OC));
        openblas_set_num_threads(1);
        gemm_ours += ours;
        gemm_ref += ref;
        TIME_MS(t, CHECK(op->matmul_bwd(g_be, y, dw, db, z, x, w, N, IC, OC, 0)));
        row("  bwd", shape, t, 2 * fl, L);
        layer_ms += t;
        /* reference for the backward: dinp and dw as two whole-matrix calls */
        openblas_set_num_threads(blas_threads);
        TIME_MS(ref, {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, IC, OC, 1.0f, z, OC, w, IC, 0.0f, y,
                        IC);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, IC, N, 1.0f, z, OC, x, IC, 1.0f, dw, IC);
        });
        openblas_set_num_threads(1);
        gemm_ours += t;
        gemm_ref += ref;
    }
    const double att_fl = 4.0 * B * NH * (double)T * T * (C / NH) / 2; /* causal half of QKᵀ and PV */
    snprintf(shape, sizeof shape, "B%d T%d NH%d hs%d", B, T, NH, C / NH);
    TIME_MS(t, CHECK(op->attention_fwd(g_be, y, aux, qkv, B, T, C, NH)));
    row("attention", shape, t, att_fl, L);
    layer_ms += t;
    TIME_MS(t, CHECK(op->attention_bwd(g_be, dqkv, x, qkv, y, aux, B, T, C, NH)));
    row("  bwd", shape, t, 2 * att_fl, L);
    layer_ms += t;
    snprintf(shape, sizeof shape, "%dx%d", N, C);
    TIME_MS(t, CHECK(op->layernorm_fwd(g_be, y, mean, rstd, x, w, bias, N, C)));
    row("layernorm", shape, t, 0, 2 * L + 1);
    layer_ms += 2 * t;
    head_ms += t;
    TIME_MS(t, CHECK(op->layernorm_bwd(g_be, z, dw, db, x, y, w, mean, rstd, N, C, 1)));
    row("  bwd", shape, t, 0, 2 * L + 1);
    layer_ms += 2 * t;
    head_ms += t;
    TIME_MS(t, CHECK(op->add(g_be, y, x, z, (size_t)N * C)));
    row("residual add", shape, t, 0, 2 * L);
    layer_ms += 2 * t;
    TIME_MS(t, CHECK(op->accumulate(g_be, y, x, (size_t)N * C, 1)));
    row("  grad accumulate", shape, t, 0, 2 * L);
    layer_ms += 2 * t;
    snprintf(shape, sizeof shape, "%d", N * 4 * C);
    TIME_MS(t, CHECK(op->gelu_bwd(g_be, y, x, z, (size_t)N * 4 * C, 0)));
    row("gelu bwd", shape, t, 0, L);
    layer_ms += t;

    snprintf(shape, sizeof shape, "%dx%d -> %d", N, C, Vp);
    const double head_fl = 2.0 * N * C * Vp;
    TIME_MS(t, CHECK(op->matmul_fwd(g_be, logits, NULL, x, wte, NULL, N, C, Vp, DG_EPI_NONE)));
    row("lm_head", shape, t, head_fl, 1);
    head_ms += t;
    TIME_MS(t, CHECK(op->matmul_bwd(g_be, y, dwte, NULL, logits, x, wte, N, C, Vp, 0)));
    row("  bwd", shape, t, 2 * head_fl, 1);
    head_ms += t;
    snprintf(shape, sizeof shape, "%dx%d", N, Vp);
    TIME_MS(t, CHECK(op->crossentropy_fwd(g_be, losses, lse, logits, tok, N, V, Vp)));
    row("crossentropy", shape, t, 0, 1);
    head_ms += t;
    TIME_MS(t, CHECK(op->crossentropy_bwd(g_be, y, logits, lse, tok, N, V, Vp, 1.0f / N)));
    row("  bwd", shape, t, 0, 1);
    head_ms += t;
    snprintf(shape, sizeof shape, "B%d T%d C%d", B, T, C);
    TIME_MS(t, CHECK(op->encoder_fwd(g_be, y, tok, wte, x, B, T, C)));
    row("encoder", shape, t, 0, 1);
    head_ms += t;
    TIME_MS(t, CHECK(op->encoder_bwd(g_be, dwte, dw, x, tok, B, T, C)));
    row("  bwd", shape, t, 0, 1);
    head_ms += t;
    const size_t nparam = (size_t)L * 12 * C * C + (size_t)Vp * C + (size_t)T * C;
    float *pm = fbuf(nparam, 0.1f), *pg = fbuf(nparam, 0.01f), *m1 = fbuf(nparam, 0), *m2 = fbuf(nparam, 0);
    snprintf(shape, sizeof shape, "%zu params", nparam);
    TIME_MS(t, CHECK(op->adamw(g_be, pm, NULL, pg, m1, m2, nparam, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, gs)));
    row("adamw", shape, t, 0, 1);
    head_ms += t;
    TIME_MS(t, CHECK(op->sumsq_f32(g_be, gs + 0, pg, nparam)));
    row("grad sumsq", shape, t, 0, 1);
    head_ms += t;
    gs[0] = 1.0f;

    const double step_ms = L * layer_ms + head_ms;
    printf(
        "\nlinear layers (fwd+bwd of one block, epilogues included): %.2f ms; the same GEMMs as whole-matrix "
        "OpenBLAS calls on %d OpenBLAS threads: %.2f ms; ratio %.2f\n",
        gemm_ours, blas_threads, gemm_ref, gemm_ref / gemm_ours);
    printf(
        "kernel-only step estimate: %.1f ms (%d layers x %.2f ms + head/optimizer %.2f ms) = %.0f tokens/s\n",
        step_ms, L, layer_ms, head_ms, N / step_ms * 1e3);
    for (int i = 0; i < g_nbufs; i++)
        op->free(g_be, g_bufs[i]);
    dg_backend_free(g_be);
    if (min_ratio > 0 && gemm_ref / gemm_ours < min_ratio) {
        printf("FAIL: the linear layers reach %.2f x the OpenBLAS reference, below the required %.2f\n",
               gemm_ref / gemm_ours, min_ratio);
        return 1;
    }
    return 0;
}
