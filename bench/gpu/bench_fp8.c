/* bench_fp8.c — FP8 against bf16 GEMMs of the linear layers (train.precision=fp8, docs/cuda.md "FP8"):
 * for GPT-2 shapes from 124M to 1558M at 8 to 32 x 1024 tokens, one linear layer's forward and
 * input-gradient GEMMs (the two that run in FP8; the E4M3 quantization of both operands included) on a
 * bf16 backend with fp8 on and one with it off, one after the other in this process: ms per pair, TFLOP/s
 * and the ratio bf16 / fp8. Exit 77 without a GPU, 1 when cuBLASLt refused an FP8 GEMM.
 *   bench_fp8 [--reps N]
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"

#define BENCH_WHO "bench_fp8"
#include "../lib/bench_check.h"

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* device bf16 buffer of n values in (-1, 1) (the bit pattern of a random bf16 with a small exponent) */
static void *dev_rand(dg_backend_t *be, size_t n, uint32_t seed) {
    uint16_t *h = malloc(n * 2);
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        h[i] = (uint16_t)(0x3c00u + ((seed >> 16) & 0x3ffu)) | (uint16_t)((seed & 1u) << 15);
    }
    void *d = NULL;
    MUST(be->ops->alloc(be, n * 2, &d));
    MUST(be->ops->to_device(be, d, h, n * 2));
    free(h);
    return d;
}

static double pair_ms(dg_backend_t *be, int N, int C, int OC, int reps) {
    const size_t ni = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
    void *inp = dev_rand(be, ni, 1), *w = dev_rand(be, nw, 2), *dout = dev_rand(be, no, 3), *out, *dinp;
    MUST(be->ops->alloc(be, no * 2, &out));
    MUST(be->ops->alloc(be, ni * 2, &dinp));
    double best = 1e30;
    for (int round = 0; round < 2; round++) { /* the first round plans, tunes and warms up */
        MUST(be->ops->sync(be));
        const double t0 = now_ms();
        for (int r = 0; r < reps; r++) {
            MUST(be->ops->matmul_fwd(be, out, NULL, inp, w, NULL, N, C, OC, DG_EPI_NONE));
            MUST(be->ops->matmul_bwd(be, dinp, NULL, NULL, dout, inp, w, N, C, OC, 0));
        }
        MUST(be->ops->sync(be));
        const double ms = (now_ms() - t0) / reps;
        if (round > 0 && ms < best) best = ms;
    }
    void *all[] = {inp, w, dout, out, dinp};
    for (int q = 0; q < 5; q++)
        be->ops->free(be, all[q]);
    return best;
}

int main(int argc, char **argv) {
    int reps = 20;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    dg_backend_config_t c16 = {0}, c8 = {0};
    c16.act_dtype = c8.act_dtype = DG_BF16;
    c8.fp8 = 1;
    dg_backend_t *b16 = NULL, *b8 = NULL;
    if (dg_backend_cuda_create(&c16, &b16) != DG_OK) {
        printf("SKIP: %s\n", dg_last_error());
        return 77;
    }
    if (dg_backend_cuda_create(&c8, &b8) != DG_OK) {
        printf("bench_fp8: the fp8 backend was refused: %s\n", dg_last_error());
        return 1;
    }
    /* (N tokens, C in, OC out): GPT-2's QKV, fc and proj layers of 124M, 350M, 774M and 1558M */
    static const int shapes[][3] = {{32768, 768, 2304},  {32768, 768, 3072},  {32768, 3072, 768},
                                    {8192, 1024, 4096},  {16384, 1024, 3072}, {16384, 1280, 5120},
                                    {16384, 5120, 1280}, {8192, 1600, 6400},  {8192, 6400, 1600}};
    printf("%s: forward + input-gradient GEMMs of one linear layer, fp8 (quantization included) vs bf16\n",
           dg_backend_cuda_device_name(b16));
    double s8 = 0, s16 = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const int N = shapes[i][0], C = shapes[i][1], OC = shapes[i][2];
        const double m16 = pair_ms(b16, N, C, OC, reps), m8 = pair_ms(b8, N, C, OC, reps);
        const double tf = 4.0 * N * C * OC / 1e9; /* GFLOP: two GEMMs */
        printf(
            "BENCH fp8 N=%d C=%d OC=%d: fp8 %.3f ms (%.0f TFLOP/s) bf16 %.3f ms (%.0f TFLOP/s) ratio %.3f\n",
            N, C, OC, m8, tf / m8, m16, tf / m16, m16 / m8);
        s8 += m8;
        s16 += m16;
    }
    long long ran = 0, refused = 0;
    dg_backend_cuda_fp8_stats(b8, &ran, &refused);
    printf("BENCH fp8 total: fp8 %.3f ms bf16 %.3f ms ratio %.3f (FP8 GEMMs run %lld, refused %lld)\n", s8,
           s16, s16 / s8, ran, refused);
    b8->ops->destroy(b8);
    b16->ops->destroy(b16);
    return refused == 0 ? 0 : 1;
}
