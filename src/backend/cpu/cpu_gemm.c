/* cpu_gemm.c — GEMMs of the CPU backend: the tiled, OpenMP-parallel wrapper around single-threaded
 * OpenBLAS sgemm, and the linear layer (matmul_fwd with its bias/GELU epilogue, matmul_bwd).
 *
 * Why tiles of a fixed, shape-only size: OpenBLAS results for an output element depend on how the call
 * that produced it was shaped (its small-matrix kernels and edge kernels round differently), so
 * splitting a GEMM by thread count would make results depend on the thread count. Each tile is one
 * sgemm call with arguments that depend only on (M, N, K); threads just pick tiles.
 */
#include <cblas.h>
#include <omp.h>

#include "backend_cpu_impl.h"

static int cdiv(int a, int b) {
    return (a + b - 1) / b;
}
static int round16(int v) {
    return (v + 15) / 16 * 16;
}

/* Tile shape for an [M, N] output, a function of (M, N) only. Measured here (single-thread OpenBLAS
 * 0.3.21, SkylakeX kernels, GPT shapes): 512-row tiles of the full width run at ~95% of one whole-matrix
 * call, 256-row ones at ~91%, 128-row ones at ~83%, and splitting the width costs about as much as
 * halving the rows. So tiles start at up to 512 x 2048 and are split, in near-equal parts, only until
 * there are DG_CPU_GEMM_MIN_TILES of them: rows first while they stay >= 128, then columns while they
 * stay >= 256, then rows down to 64 and columns down to 128. A GEMM thus keeps at most that many threads
 * busy when it is small; large ones (many rows, or a wide vocabulary) have many more tiles. */
#define DG_CPU_GEMM_MIN_TILES 4
static void gemm_tiles(int M, int N, int *tm, int *tn) {
    int nm = cdiv(M, 512), nn = cdiv(N, 2048);
    while ((long long)nm * nn < DG_CPU_GEMM_MIN_TILES) {
        int rows = cdiv(M, nm), cols = cdiv(N, nn);
        if (rows >= 256)
            nm *= 2;
        else if (cols >= 512)
            nn *= 2;
        else if (rows >= 128)
            nm *= 2;
        else if (cols >= 256)
            nn *= 2;
        else
            break;
    }
    *tm = round16(cdiv(M, nm));
    *tn = round16(cdiv(N, nn));
}

void dg_cpu_gemm(dg_cpu_t *cpu, int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A,
                 int lda, const float *B, int ldb, float beta, float *C, int ldc, dg_cpu_tile_fn epi,
                 void *arg) {
    dg_cpu_blas_single_thread();
    int tm, tn;
    gemm_tiles(M, N, &tm, &tn);
    const int tiles_n = cdiv(N, tn), ntiles = cdiv(M, tm) * tiles_n;
    const int nt = cpu->nt < ntiles ? cpu->nt : ntiles;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int t = 0; t < ntiles; t++) {
        int m0 = (t / tiles_n) * tm, n0 = (t % tiles_n) * tn;
        int m1 = m0 + tm < M ? m0 + tm : M, n1 = n0 + tn < N ? n0 + tn : N;
        /* op(A) rows m0.. : stored [M,K] (offset by rows) or, transposed, [K,M] (offset by columns). */
        const float *a = trans_a ? A + m0 : A + (size_t)m0 * lda;
        const float *b = trans_b ? B + (size_t)n0 * ldb : B + n0;
        cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                    m1 - m0, n1 - n0, K, alpha, a, lda, b, ldb, beta, C + (size_t)m0 * ldc + n0, ldc);
        if (epi) epi(arg, m0, m1, n0, n1);
    }
}

/* ---------------- matmul_fwd ---------------- */

typedef struct {
    float *out;        /* [N, OC] */
    float *pre;        /* [N, OC] when GELU, else NULL */
    const float *bias; /* [OC] or NULL */
    int OC;
} fwd_epi_t;

DG_CPU_VEC static void bias_gelu_row(float *p, float *o, const float *bias, int n) {
    if (bias) {
#pragma omp simd
        for (int c = 0; c < n; c++) {
            float v = p[c] + bias[c];
            p[c] = v;
            o[c] = dg_cpu_gelu(v);
        }
    } else {
#pragma omp simd
        for (int c = 0; c < n; c++)
            o[c] = dg_cpu_gelu(p[c]);
    }
}
/* o[0..n) += b[0..n) */
DG_CPU_VEC static void add_row(float *o, const float *b, int n) {
#pragma omp simd
    for (int c = 0; c < n; c++)
        o[c] += b[c];
}

/* GEMM wrote `pre` (GELU) or `out` (no GELU); add the bias and apply GELU on the hot tile. */
static void fwd_epilogue(void *argp, int m0, int m1, int n0, int n1) {
    const fwd_epi_t *e = argp;
    const float *bias = e->bias ? e->bias + n0 : NULL;
    for (int r = m0; r < m1; r++) {
        size_t at = (size_t)r * e->OC + n0;
        if (e->pre)
            bias_gelu_row(e->pre + at, e->out + at, bias, n1 - n0);
        else
            add_row(e->out + at, bias, n1 - n0);
    }
}

dg_status_t dg_cpu_matmul_fwd(dg_backend_t *be, void *out, void *pre, const void *inp, const void *w,
                              const void *bias, int N, int C, int OC, dg_epilogue_t epi) {
    const char *op = "matmul_fwd";
    DG_CPU_NONNULL(op, out);
    DG_CPU_NONNULL(op, inp);
    DG_CPU_NONNULL(op, w);
    DG_CPU_POSITIVE(op, N);
    DG_CPU_POSITIVE(op, C);
    DG_CPU_POSITIVE(op, OC);
    if (epi != DG_EPI_NONE && epi != DG_EPI_GELU)
        return DG_ERR(DG_ERR_USAGE, "cpu backend: matmul_fwd: unknown epilogue %d", (int)epi);
    if (epi == DG_EPI_GELU) {
        DG_CPU_NONNULL(op, pre);
        if (pre == out)
            return DG_ERR(DG_ERR_USAGE, "cpu backend: matmul_fwd: with the GELU epilogue `pre` and `out` "
                                        "must be different buffers");
    }
    fwd_epi_t e = {out, epi == DG_EPI_GELU ? pre : NULL, bias, OC};
    float *dst = e.pre ? e.pre : e.out;
    dg_cpu_tile_fn fn = (e.pre || bias) ? fwd_epilogue : NULL;
    /* out[N,OC] = inp[N,C] · w[OC,C]ᵀ: the transposed view comes from the BLAS flag, not a copy. */
    dg_cpu_gemm(dg_cpu_of(be), 0, 1, N, OC, C, 1.0f, inp, C, w, C, 0.0f, dst, OC, fn, &e);
    return DG_OK;
}

/* ---------------- matmul_bwd ---------------- */

dg_status_t dg_cpu_matmul_bwd(dg_backend_t *be, void *dinp, float *dw, float *dbias, const void *dout,
                              const void *inp, const void *w, int N, int C, int OC, int acc) {
    const char *op = "matmul_bwd";
    DG_CPU_NONNULL(op, dw);
    DG_CPU_NONNULL(op, dout);
    DG_CPU_NONNULL(op, inp);
    DG_CPU_POSITIVE(op, N);
    DG_CPU_POSITIVE(op, C);
    DG_CPU_POSITIVE(op, OC);
    dg_cpu_t *cpu = dg_cpu_of(be);
    if (dinp) {
        DG_CPU_NONNULL(op, w);
        /* dinp[N,C] (=|+=) dout[N,OC] · w[OC,C]; beta = 0 never reads dinp, so poison there is harmless. */
        dg_cpu_gemm(cpu, 0, 0, N, C, OC, 1.0f, dout, OC, w, C, acc ? 1.0f : 0.0f, dinp, C, NULL, NULL);
    }
    /* dw[OC,C] += dout[N,OC]ᵀ · inp[N,C]: each dw element is one dot product over N inside one tile. */
    dg_cpu_gemm(cpu, 1, 0, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dw, C, NULL, NULL);
    if (dbias) {
        /* Column sums: each thread owns whole columns and walks the rows in order, so every sum has the
         * same order whatever the split. Sums start from 0 in scratch, then add into dbias once. */
        float *accum = dg_cpu_scratch(cpu, (size_t)OC * sizeof(float));
        if (!accum) return dg_last_error_code();
        const float *d = dout;
        int parts = cpu->nt < cdiv(OC, 16) ? cpu->nt : cdiv(OC, 16);
#pragma omp parallel num_threads(parts)
        {
            int lo, hi;
            dg_cpu_split(OC, omp_get_num_threads(), omp_get_thread_num(), 16, &lo, &hi);
            float *a = accum;
            for (int c = lo; c < hi; c++)
                a[c] = 0.0f;
            for (int r = 0; r < N; r++)
                add_row(a + lo, d + (size_t)r * OC + lo, hi - lo);
            for (int c = lo; c < hi; c++)
                dbias[c] += a[c];
        }
    }
    return DG_OK;
}
