/* cpu_gemm.c — the linear layer of the CPU backend (matmul_fwd with its bias/GELU epilogue, matmul_bwd, and
 * matmul_bwd_dgelu: matmul_bwd with the GELU derivative applied to the input gradient tile by tile)
 * as GEMMs cut into tiles, each tile one single-threaded OpenBLAS sgemm call, the tiles run as tasks
 * on the backend's worker pool.
 *
 * Why tiles of a fixed, shape-only size: OpenBLAS results for an output element depend on how the call
 * that produced it was shaped (its small-matrix kernels and edge kernels round differently), so
 * splitting a GEMM by thread count would make results depend on the thread count. Each tile is one
 * sgemm call with arguments that depend only on (M, N, K); threads just pick tiles.
 */
#include <cblas.h>

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
 * there are `min_tiles` of them: rows first while they stay >= 128, then columns while they stay >= 256,
 * then rows down to 64 and columns down to 128. A GEMM thus keeps at most that many threads busy when it
 * is small; large ones (many rows, or a wide vocabulary) have many more tiles. */
#define DG_CPU_GEMM_MIN_TILES 4
static void gemm_tiles(int M, int N, int min_tiles, int *tm, int *tn) {
    int nm = cdiv(M, 512), nn = cdiv(N, 2048);
    while ((long long)nm * nn < min_tiles) {
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

/* One GEMM cut into tiles. `pro` (may be NULL) fills a tile of C before its sgemm (then beta must be
 * 1); `epi` (may be NULL) runs on the tile right after it, while the tile is still in cache. */
typedef struct {
    int trans_a, trans_b, M, N, K;
    float alpha;
    const float *A;
    int lda;
    const float *B;
    int ldb;
    float beta;
    float *C;
    int ldc;
    int tm, tn, tiles_n, ntiles;
    dg_cpu_tile_fn pro, epi;
    void *arg;
} gemm_job_t;

static void gemm_job_init(gemm_job_t *g, int min_tiles, int trans_a, int trans_b, int M, int N, int K,
                          float alpha, const float *A, int lda, const float *B, int ldb, float beta, float *C,
                          int ldc, dg_cpu_tile_fn pro, dg_cpu_tile_fn epi, void *arg) {
    *g = (gemm_job_t){trans_a, trans_b, M,   N, K, alpha, A, lda, B,   ldb,
                      beta,    C,       ldc, 0, 0, 0,     0, pro, epi, arg};
    gemm_tiles(M, N, min_tiles, &g->tm, &g->tn);
    g->tiles_n = cdiv(N, g->tn);
    g->ntiles = cdiv(M, g->tm) * g->tiles_n;
}

static void gemm_tile(const gemm_job_t *g, int t) {
    int m0 = (t / g->tiles_n) * g->tm, n0 = (t % g->tiles_n) * g->tn;
    int m1 = m0 + g->tm < g->M ? m0 + g->tm : g->M, n1 = n0 + g->tn < g->N ? n0 + g->tn : g->N;
    /* op(A) rows m0.. : stored [M,K] (offset by rows) or, transposed, [K,M] (offset by columns). */
    const float *a = g->trans_a ? g->A + m0 : g->A + (size_t)m0 * g->lda;
    const float *b = g->trans_b ? g->B + (size_t)n0 * g->ldb : g->B + n0;
    if (g->pro) g->pro(g->arg, m0, m1, n0, n1);
    cblas_sgemm(CblasRowMajor, g->trans_a ? CblasTrans : CblasNoTrans, g->trans_b ? CblasTrans : CblasNoTrans,
                m1 - m0, n1 - n0, g->K, g->alpha, a, g->lda, b, g->ldb, g->beta,
                g->C + (size_t)m0 * g->ldc + n0, g->ldc);
    if (g->epi) g->epi(g->arg, m0, m1, n0, n1);
}

static void gemm_task(void *argp, int t, int worker) {
    (void)worker;
    gemm_tile(argp, t);
}

/* ---------------- matmul_fwd ---------------- */

typedef struct {
    float *out;        /* [N, OC] */
    float *pre;        /* [N, OC] when GELU, else NULL */
    const float *bias; /* [OC] or NULL */
    int OC;
} fwd_epi_t;

/* o[0..n) += b[0..n) */
DG_CPU_VEC static void add_row(float *o, const float *b, int n) {
#pragma omp simd
    for (int c = 0; c < n; c++)
        o[c] += b[c];
}

/* Before the tile's GEMM: its rows of the GEMM's destination (`pre` with GELU, else `out`) start as the
 * bias, and the GEMM adds into them (beta = 1). That saves OpenBLAS's zeroing of the tile for beta = 0
 * and a separate pass adding the bias. */
DG_CPU_VEC static void copy_row(float *o, const float *b, int n) {
#pragma omp simd
    for (int c = 0; c < n; c++)
        o[c] = b[c];
}
DG_CPU_VEC static void gelu_row(float *o, const float *p, int n) {
#pragma omp simd
    for (int c = 0; c < n; c++)
        o[c] = dg_cpu_gelu(p[c]);
}

static void fwd_prologue(void *argp, int m0, int m1, int n0, int n1) {
    const fwd_epi_t *e = argp;
    float *dst = e->pre ? e->pre : e->out;
    for (int r = m0; r < m1; r++)
        copy_row(dst + (size_t)r * e->OC + n0, e->bias + n0, n1 - n0);
}

/* After the tile's GEMM, while the tile is in cache: out = gelu(pre). */
static void fwd_epilogue(void *argp, int m0, int m1, int n0, int n1) {
    const fwd_epi_t *e = argp;
    for (int r = m0; r < m1; r++) {
        size_t at = (size_t)r * e->OC + n0;
        gelu_row(e->out + at, e->pre + at, n1 - n0);
    }
}

dg_status_t dg_cpu_matmul_fwd(dg_backend_t *be, void *out, void *pre, const void *inp, const void *w,
                              const void *bias, int N, int C, int OC, dg_epilogue_t epi) {
    const char *op = "matmul_fwd";
    DG_CPU_NONNULLS(op, out, inp, w);
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
    dg_cpu_t *cpu = dg_cpu_of(be);
    dg_cpu_blas_single_thread();
    /* out[N,OC] = inp[N,C] · w[OC,C]ᵀ: the transposed view comes from the BLAS flag, not a copy. */
    gemm_job_t g;
    gemm_job_init(&g, DG_CPU_GEMM_MIN_TILES, 0, 1, N, OC, C, 1.0f, inp, C, w, C, bias ? 1.0f : 0.0f, dst, OC,
                  bias ? fwd_prologue : NULL, e.pre ? fwd_epilogue : NULL, &e);
    dg_cpu_run(cpu, g.ntiles, gemm_task, &g);
    return DG_OK;
}

/* ---------------- matmul_fwd_res (contract v1.11) ---------------- */

/* 1 if [a, a + na) and [b, b + nb) intersect */
static int ranges_overlap(const void *a, size_t na, const void *b, size_t nb) {
    const char *pa = a, *pb = b;
    return pa < pb + nb && pb < pa + na;
}
static int overlaps(const void *a, const void *b, size_t bytes) {
    return ranges_overlap(a, bytes, b, bytes);
}

typedef struct {
    fwd_epi_t fwd;    /* the product's destination and bias: matmul_fwd's prologue runs on it */
    float *out;       /* [N, OC] */
    const float *res; /* [N, OC]; may be `out` itself */
    int OC;
} res_epi_t;

/* o = p + r elementwise: the add entry's operation, so the pair (matmul_fwd, add) is matched bit for bit
 * (float addition is commutative, so the operand order of the graph's add does not matter). o may be p. */
DG_CPU_VEC static void add_rows(float *o, const float *p, const float *r, int n) {
#pragma omp simd
    for (int c = 0; c < n; c++)
        o[c] = p[c] + r[c];
}

static void res_prologue(void *argp, int m0, int m1, int n0, int n1) {
    fwd_prologue(&((res_epi_t *)argp)->fwd, m0, m1, n0, n1);
}

/* After the tile's GEMM, while its product is in cache: out = product + res. */
static void res_epilogue(void *argp, int m0, int m1, int n0, int n1) {
    const res_epi_t *e = argp;
    for (int r = m0; r < m1; r++) {
        size_t at = (size_t)r * e->OC + n0;
        add_rows(e->out + at, e->fwd.out + at, e->res + at, n1 - n0);
    }
}

dg_status_t dg_cpu_matmul_fwd_res(dg_backend_t *be, void *out, const void *inp, const void *w,
                                  const void *bias, const void *res, int N, int C, int OC) {
    const char *op = "matmul_fwd_res";
    DG_CPU_NONNULLS(op, out, inp, w, res);
    DG_CPU_POSITIVE(op, N);
    DG_CPU_POSITIVE(op, C);
    DG_CPU_POSITIVE(op, OC);
    const size_t ob = (size_t)N * OC * sizeof(float);
    if (out != res && overlaps(out, res, ob))
        return DG_ERR(DG_ERR_USAGE,
                      "cpu backend: %s: out overlaps res partially (it may only alias it exactly, in place)",
                      op);
    if (ranges_overlap(out, ob, inp, (size_t)N * C * sizeof(float)) ||
        ranges_overlap(out, ob, w, (size_t)OC * C * sizeof(float)) ||
        (bias && ranges_overlap(out, ob, bias, (size_t)OC * sizeof(float))))
        return DG_ERR(DG_ERR_USAGE, "cpu backend: %s: out must not overlap inp, w or bias", op);
    dg_cpu_t *cpu = dg_cpu_of(be);
    /* The product goes where matmul_fwd would put it: into out, unless out is res (in place), whose
     * values the epilogue still needs: then into scratch. Same tiles, same prologue, same sgemm calls as
     * matmul_fwd, so the product has its bits; the epilogue then does the add's one float add. */
    float *prod = out;
    if (out == res) {
        prod = dg_cpu_scratch(cpu, ob);
        if (!prod) return dg_last_error_code();
    }
    res_epi_t e = {{prod, NULL, bias, OC}, out, res, OC};
    dg_cpu_blas_single_thread();
    gemm_job_t g;
    gemm_job_init(&g, DG_CPU_GEMM_MIN_TILES, 0, 1, N, OC, C, 1.0f, inp, C, w, C, bias ? 1.0f : 0.0f, prod, OC,
                  bias ? res_prologue : NULL, res_epilogue, &e);
    dg_cpu_run(cpu, g.ntiles, gemm_task, &g);
    return DG_OK;
}

/* ---------------- matmul_bwd ---------------- */

typedef struct {
    gemm_job_t dw, dinp; /* dinp.ntiles == 0 when there is no input gradient */
    float *dbias, *accum;
    const float *dout;
    int N, OC, nbias; /* nbias: tasks for the bias gradient (0 without one) */
} bwd_job_t;

/* Tasks: the dw tiles, then the bias-gradient column blocks, then the dinp tiles. The dw and dinp
 * products are the same number of FLOPs (2 N C OC each), and the pool's calling thread claims from the
 * back while the workers claim from the front (cpu_pool.c), so on two threads one runs the weight
 * gradient and the other the input gradient, whatever their tile counts, and the bias sums go to whoever
 * reaches them first. */
static void bwd_task(void *argp, int t, int worker) {
    (void)worker;
    const bwd_job_t *j = argp;
    if (t < j->dw.ntiles) {
        gemm_tile(&j->dw, t);
        return;
    }
    t -= j->dw.ntiles;
    if (t >= j->nbias) {
        gemm_tile(&j->dinp, t - j->nbias);
        return;
    }
    /* Column sums: each task owns whole columns and walks the rows in order, so every sum has the same
     * order whatever the split. Sums start from 0 in scratch, then add into dbias once. */
    int lo, hi;
    dg_cpu_split(j->OC, j->nbias, t, 16, &lo, &hi);
    float *a = j->accum;
    for (int c = lo; c < hi; c++)
        a[c] = 0.0f;
    for (int r = 0; r < j->N; r++)
        add_row(a + lo, j->dout + (size_t)r * j->OC + lo, hi - lo);
    for (int c = lo; c < hi; c++)
        j->dbias[c] += a[c];
}

dg_status_t dg_cpu_matmul_bwd(dg_backend_t *be, void *dinp, float *dw, float *dbias, const void *dout,
                              const void *inp, const void *w, int N, int C, int OC, int acc) {
    const char *op = "matmul_bwd";
    DG_CPU_NONNULLS(op, dw, dout, inp);
    DG_CPU_POSITIVE(op, N);
    DG_CPU_POSITIVE(op, C);
    DG_CPU_POSITIVE(op, OC);
    dg_cpu_t *cpu = dg_cpu_of(be);
    if (dinp) DG_CPU_NONNULL(op, w);
    bwd_job_t j = {0};
    j.dbias = dbias;
    j.dout = dout;
    j.N = N;
    j.OC = OC;
    if (dbias) {
        j.accum = dg_cpu_scratch(cpu, (size_t)OC * sizeof(float));
        if (!j.accum) return dg_last_error_code();
        j.nbias = cpu->nt < cdiv(OC, 16) ? cpu->nt : cdiv(OC, 16);
    }
    /* dw[OC,C] += dout[N,OC]ᵀ · inp[N,C]: each dw element is one dot product over N inside one tile.
     * Its tiles are as large as gemm_tiles allows (no minimum count): OpenBLAS packs all N rows of dout
     * and inp again for every tile, so each extra tile costs another pass over both, while parallelism
     * comes from running this product beside the dinp tiles in the same job. (Tiny preset: 5-8% less
     * CPU time per training step than with four dw tiles.) */
    gemm_job_init(&j.dw, 1, 1, 0, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dw, C, NULL, NULL, NULL);
    /* dinp[N,C] (=|+=) dout[N,OC] · w[OC,C]; beta = 0 never reads dinp, so poison there is harmless. */
    if (dinp)
        gemm_job_init(&j.dinp, DG_CPU_GEMM_MIN_TILES, 0, 0, N, C, OC, 1.0f, dout, OC, w, C, acc ? 1.0f : 0.0f,
                      dinp, C, NULL, NULL, NULL);
    /* One job for the three independent products: one wake-up of the workers instead of three. */
    dg_cpu_blas_single_thread();
    dg_cpu_run(cpu, j.dw.ntiles + j.dinp.ntiles + j.nbias, bwd_task, &j);
    return DG_OK;
}

/* ---------------- matmul_bwd_dgelu ---------------- */

/* The input-gradient GEMM of matmul_bwd with gelu_bwd as its tile epilogue: each tile of dout · w is
 * multiplied by gelu'(pre) while it is still in cache. acc = 0: the GEMM writes dpre and the epilogue
 * scales it in place; acc = 1: the GEMM writes scratch and the epilogue adds the scaled tile into dpre.
 * The per-element arithmetic is gelu_bwd's (one function, dg_cpu_gelu_bwd_range), and the tiles are
 * matmul_bwd's, so the result is bitwise that of matmul_bwd followed by gelu_bwd. */
typedef struct {
    float *dpre;
    const float *prod; /* the GEMM's output: dpre itself (acc = 0) or scratch (acc = 1) */
    const float *pre;
    int C, acc;
} dgelu_epi_t;

static void dgelu_epilogue(void *argp, int m0, int m1, int n0, int n1) {
    const dgelu_epi_t *e = argp;
    for (int r = m0; r < m1; r++) {
        size_t at = (size_t)r * e->C + n0;
        dg_cpu_gelu_bwd_range(e->dpre + at, e->pre + at, e->prod + at, (size_t)(n1 - n0), e->acc);
    }
}

dg_status_t dg_cpu_matmul_bwd_dgelu(dg_backend_t *be, void *dpre, float *dw, float *dbias, const void *dout,
                                    const void *inp, const void *w, const void *pre, int N, int C, int OC,
                                    int acc) {
    const char *op = "matmul_bwd_dgelu";
    DG_CPU_NONNULLS(op, dpre, dw, dout, inp, w, pre);
    DG_CPU_POSITIVE(op, N);
    DG_CPU_POSITIVE(op, C);
    DG_CPU_POSITIVE(op, OC);
    const size_t nbytes = (size_t)N * C * sizeof(float);
    if (overlaps(dpre, pre, nbytes) || overlaps(dpre, dout, (size_t)N * OC * sizeof(float)))
        return DG_ERR(DG_ERR_USAGE, "cpu backend: %s: dpre must not overlap pre or dout", op);
    const int aliased = overlaps(dpre, inp, nbytes);
    if (aliased && acc)
        return DG_ERR(DG_ERR_USAGE, "cpu backend: %s: dpre may alias inp only with acc = 0", op);
    dg_cpu_t *cpu = dg_cpu_of(be);
    /* one scratch block: the bias column sums, then (acc = 1) the product before the GELU derivative */
    const size_t bias_bytes = dbias ? ((size_t)OC * sizeof(float) + 255) / 256 * 256 : 0;
    char *scr = NULL;
    if (dbias || acc) {
        scr = dg_cpu_scratch(cpu, bias_bytes + (acc ? nbytes : 0));
        if (!scr) return dg_last_error_code();
    }
    bwd_job_t j = {0};
    j.dbias = dbias;
    j.accum = dbias ? (float *)scr : NULL;
    j.dout = dout;
    j.N = N;
    j.OC = OC;
    if (dbias) j.nbias = cpu->nt < cdiv(OC, 16) ? cpu->nt : cdiv(OC, 16);
    dgelu_epi_t e = {dpre, acc ? (const float *)(scr + bias_bytes) : dpre, pre, C, acc};
    /* the same tiles as matmul_bwd */
    gemm_job_init(&j.dw, 1, 1, 0, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dw, C, NULL, NULL, NULL);
    gemm_job_init(&j.dinp, DG_CPU_GEMM_MIN_TILES, 0, 0, N, C, OC, 1.0f, dout, OC, w, C, 0.0f, (float *)e.prod,
                  C, NULL, dgelu_epilogue, &e);
    dg_cpu_blas_single_thread();
    if (!aliased) {
        dg_cpu_run(cpu, j.dw.ntiles + j.dinp.ntiles + j.nbias, bwd_task, &j);
        return DG_OK;
    }
    /* dpre overwrites inp: every read of inp (the weight gradient) finishes before the first write */
    bwd_job_t first = j, second = j;
    first.dinp.ntiles = 0;
    second.dw.ntiles = 0;
    second.nbias = 0;
    dg_cpu_run(cpu, first.dw.ntiles + first.nbias, bwd_task, &first);
    dg_cpu_run(cpu, second.dinp.ntiles, bwd_task, &second);
    return DG_OK;
}
