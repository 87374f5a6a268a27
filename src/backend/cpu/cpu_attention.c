/* cpu_attention.c — causal multi-head self-attention on the CPU backend.
 *
 * One (batch, head) pair is one unit of work, done by one thread; pairs are independent, so results do
 * not depend on the thread count. Within a pair the score and value products are OpenBLAS sgemm calls
 * on strided views of qkv (no copies), in query blocks of DG_CPU_ATT_BLOCK rows so that the causal
 * mask skips most of the upper triangle. The softmax probabilities P [B, NH, T, T] are saved in aux
 * (upper triangle written as 0) and reused by the backward pass.
 */
#include <cblas.h>
#include <math.h>

#include "backend_cpu_impl.h"

/* Query/key block: a constant, because the block shape decides how each dot product is summed. */
#define DG_CPU_ATT_BLOCK 64

static dg_status_t check_shape(const char *op, int B, int T, int C, int NH) {
    DG_CPU_POSITIVE(op, B);
    DG_CPU_POSITIVE(op, T);
    DG_CPU_POSITIVE(op, C);
    DG_CPU_POSITIVE(op, NH);
    if (C % NH != 0)
        return DG_ERR(DG_ERR_USAGE, "cpu backend: %s: C=%d is not divisible by NH=%d heads", op, C, NH);
    return DG_OK;
}

size_t dg_cpu_attention_aux_bytes(dg_backend_t *be, int B, int T, int C, int NH) {
    (void)be;
    (void)C;
    if (B <= 0 || T <= 0 || NH <= 0) return 0;
    return (size_t)B * NH * T * T * sizeof(float);
}

/* In place over row[0..t]: softmax; row[t+1..T) := 0. */
DG_CPU_VEC static void causal_softmax_row(float *row, int t, int T) {
    float mx = row[0];
#pragma omp simd reduction(max : mx)
    for (int j = 0; j <= t; j++)
        mx = row[j] > mx ? row[j] : mx;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j <= t; j++) {
        float e = dg_cpu_expf(row[j] - mx);
        row[j] = e;
        sum += e;
    }
    float inv = 1.0f / sum;
#pragma omp simd
    for (int j = 0; j <= t; j++)
        row[j] *= inv;
    for (int j = t + 1; j < T; j++)
        row[j] = 0.0f;
}

/* Softmax backward of one row, with the score scale folded in: dS = scale · P ∘ (dP - rowsum(P ∘ dP)),
 * in place over drow (which holds dP). Entries past the diagonal up to the block edge are zeroed because
 * the block GEMMs read them. */
DG_CPU_VEC static void softmax_bwd_row(float *drow, const float *prow, int t, int T, float scale) {
    int edge = (t / DG_CPU_ATT_BLOCK + 1) * DG_CPU_ATT_BLOCK;
    if (edge > T) edge = T;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int j = 0; j <= t; j++)
        dot += prow[j] * drow[j];
#pragma omp simd
    for (int j = 0; j <= t; j++)
        drow[j] = scale * prow[j] * (drow[j] - dot);
    for (int j = t + 1; j < edge; j++)
        drow[j] = 0.0f;
}

typedef struct {
    float *out, *p_all, *dqkv;
    const float *qkv, *dout;
    int B, T, C, NH;
    float *scratch; /* backward: one T x T buffer per thread */
} att_arg_t;

/* One (batch, head) pair. */
static void att_fwd_task(void *argp, int bh, int worker) {
    (void)worker;
    const att_arg_t *a = argp;
    const int T = a->T, C = a->C, hs = C / a->NH, ld = 3 * C;
    const int b = bh / a->NH, h = bh % a->NH;
    const float scale = 1.0f / sqrtf((float)hs);
    const float *Q = a->qkv + (size_t)b * T * ld + (size_t)h * hs, *K = Q + C, *V = Q + 2 * C;
    float *P = a->p_all + (size_t)bh * T * T;
    float *O = a->out + (size_t)b * T * C + (size_t)h * hs;
    for (int r0 = 0; r0 < T; r0 += DG_CPU_ATT_BLOCK) {
        int r1 = r0 + DG_CPU_ATT_BLOCK < T ? r0 + DG_CPU_ATT_BLOCK : T;
        /* S[r0:r1, 0:r1] = scale · Q[r0:r1] · K[0:r1]ᵀ (keys past r1 are all masked) */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, r1, hs, scale, Q + (size_t)r0 * ld, ld, K,
                    ld, 0.0f, P + (size_t)r0 * T, T);
        for (int t = r0; t < r1; t++)
            causal_softmax_row(P + (size_t)t * T, t, T);
        /* O[r0:r1] = P[r0:r1, 0:r1] · V[0:r1] */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0, hs, r1, 1.0f, P + (size_t)r0 * T, T, V,
                    ld, 0.0f, O + (size_t)r0 * C, C);
    }
}

dg_status_t dg_cpu_attention_fwd(dg_backend_t *be, void *out, void *aux, const void *qkv, int B, int T, int C,
                                 int NH) {
    const char *op = "attention_fwd";
    DG_CPU_NONNULL(op, out);
    DG_CPU_NONNULL(op, aux);
    DG_CPU_NONNULL(op, qkv);
    DG_TRY(check_shape(op, B, T, C, NH));
    att_arg_t a = {out, aux, NULL, qkv, NULL, B, T, C, NH, NULL};
    dg_cpu_blas_single_thread();
    dg_cpu_run(dg_cpu_of(be), B * NH, att_fwd_task, &a);
    return DG_OK;
}

static void att_bwd_task(void *argp, int bh, int worker) {
    const att_arg_t *a = argp;
    const int T = a->T, C = a->C, hs = C / a->NH, ld = 3 * C;
    const int b = bh / a->NH, h = bh % a->NH;
    const float scale = 1.0f / sqrtf((float)hs);
    float *dS = a->scratch + (size_t)worker * T * T;
    const size_t qoff = (size_t)b * T * ld + (size_t)h * hs;
    const float *Q = a->qkv + qoff, *K = Q + C, *V = Q + 2 * C;
    float *dQ = a->dqkv + qoff, *dK = dQ + C, *dV = dQ + 2 * C;
    const float *P = a->p_all + (size_t)bh * T * T;
    const float *dO = a->dout + (size_t)b * T * C + (size_t)h * hs;
    /* dP[r0:r1, 0:r1] = dO[r0:r1] · V[0:r1]ᵀ */
    for (int r0 = 0; r0 < T; r0 += DG_CPU_ATT_BLOCK) {
        int r1 = r0 + DG_CPU_ATT_BLOCK < T ? r0 + DG_CPU_ATT_BLOCK : T;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, r1, hs, 1.0f, dO + (size_t)r0 * C, C, V, ld,
                    0.0f, dS + (size_t)r0 * T, T);
    }
    /* Softmax backward, with the score scale folded in: dS = scale · P ∘ (dP - rowsum(P ∘ dP)).
     * Entries past the diagonal up to the block edge are zeroed because the block GEMMs read them. */
    for (int t = 0; t < T; t++)
        softmax_bwd_row(dS + (size_t)t * T, P + (size_t)t * T, t, T, scale);
    for (int r0 = 0; r0 < T; r0 += DG_CPU_ATT_BLOCK) {
        int r1 = r0 + DG_CPU_ATT_BLOCK < T ? r0 + DG_CPU_ATT_BLOCK : T;
        /* dQ[r0:r1] = dS[r0:r1, 0:r1] · K[0:r1] */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0, hs, r1, 1.0f, dS + (size_t)r0 * T, T, K,
                    ld, 0.0f, dQ + (size_t)r0 * ld, ld);
        /* Keys j in [r0, r1) are seen by queries t >= r0 only:
         * dK[r0:r1] = dS[r0:T, r0:r1]ᵀ · Q[r0:T],  dV[r0:r1] = P[r0:T, r0:r1]ᵀ · dO[r0:T] */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r1 - r0, hs, T - r0, 1.0f, dS + (size_t)r0 * T + r0, T,
                    Q + (size_t)r0 * ld, ld, 0.0f, dK + (size_t)r0 * ld, ld);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r1 - r0, hs, T - r0, 1.0f, P + (size_t)r0 * T + r0, T,
                    dO + (size_t)r0 * C, C, 0.0f, dV + (size_t)r0 * ld, ld);
    }
}

dg_status_t dg_cpu_attention_bwd(dg_backend_t *be, void *dqkv, const void *dout, const void *qkv,
                                 const void *out, const void *aux, int B, int T, int C, int NH) {
    const char *op = "attention_bwd";
    (void)out; /* P in aux carries everything the backward pass needs */
    DG_CPU_NONNULL(op, dqkv);
    DG_CPU_NONNULL(op, dout);
    DG_CPU_NONNULL(op, qkv);
    DG_CPU_NONNULL(op, aux);
    DG_TRY(check_shape(op, B, T, C, NH));
    dg_cpu_t *cpu = dg_cpu_of(be);
    /* One T x T buffer per thread (indexed by the worker running the task) for dP, turned into dS in
     * place. */
    float *scratch = dg_cpu_scratch(cpu, (size_t)cpu->nt * T * T * sizeof(float));
    if (!scratch) return dg_last_error_code();
    att_arg_t a = {NULL, (float *)aux, dqkv, qkv, dout, B, T, C, NH, scratch};
    dg_cpu_blas_single_thread();
    dg_cpu_run(cpu, B * NH, att_bwd_task, &a);
    return DG_OK;
}
