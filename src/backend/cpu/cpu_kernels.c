/* cpu_kernels.c — the row-wise and element-wise model kernels of the CPU backend: token/position
 * embedding, layernorm, GELU and cross-entropy, forward and backward.
 *
 * Thread-count independence: each output row or element is computed by one thread with the same code.
 * The reductions over rows (embedding and layernorm parameter gradients) have a summation order fixed by
 * the data alone: either each thread owns whole columns and walks the rows in order, or rows are summed
 * in chunks of a constant size and the chunk partials are added in chunk order.
 */
#include <math.h>

#include "backend_cpu_impl.h"

/* Rows per layernorm-backward partial: a constant, so the dw/db summation order is fixed. */
#define DG_CPU_LN_CHUNK 32

static int min_int(int a, int b) {
    return a < b ? a : b;
}

/* ---------------- encoder ---------------- */

/* The encoder's shape (B, T, C positive) and its B x T tokens (none negative). */
static dg_status_t check_encoder(const char *op, const int32_t *tokens, int B, int T, int C) {
    DG_CPU_POSITIVE(op, B);
    DG_CPU_POSITIVE(op, T);
    DG_CPU_POSITIVE(op, C);
    for (size_t i = 0, n = (size_t)B * T; i < n; i++)
        if (tokens[i] < 0)
            return DG_ERR(DG_ERR_USAGE,
                          "cpu backend: %s: token %d at batch row %zu, position %zu is negative", op,
                          (int)tokens[i], i / (size_t)T, i % (size_t)T);
    return DG_OK;
}

typedef struct {
    float *out;
    const int32_t *tokens;
    const float *wte, *wpe;
    int T, C;
} enc_arg_t;

static void enc_fwd_task(const void *argp, size_t lo, size_t hi) {
    const enc_arg_t *a = argp;
    const int C = a->C;
    for (size_t i = lo; i < hi; i++) {
        float *orow = a->out + i * C;
        const float *te = a->wte + (size_t)a->tokens[i] * C, *pe = a->wpe + (i % (size_t)a->T) * C;
#pragma omp simd
        for (int c = 0; c < C; c++)
            orow[c] = te[c] + pe[c];
    }
}

dg_status_t dg_cpu_encoder_fwd(dg_backend_t *be, void *out, const int32_t *tokens, const void *wte,
                               const void *wpe, int B, int T, int C) {
    const char *op = "encoder_fwd";
    DG_CPU_NONNULLS(op, out, tokens, wte, wpe);
    DG_TRY(check_encoder(op, tokens, B, T, C));
    const size_t N = (size_t)B * T;
    enc_arg_t a = {out, tokens, wte, wpe, T, C};
    dg_cpu_run_range(dg_cpu_of(be), N, dg_cpu_ew_tasks(dg_cpu_of(be), N * C), enc_fwd_task, &a);
    return DG_OK;
}

typedef struct {
    float *dwte, *dwpe;
    const float *dout;
    const int32_t *tokens;
    int T, C;
    size_t N;
} enc_bwd_arg_t;

static void enc_bwd_task(const void *argp, size_t lo, size_t hi) {
    const enc_bwd_arg_t *a = argp;
    const int C = a->C;
    for (size_t i = 0; i < a->N; i++) {
        const float *drow = a->dout + i * C;
        float *te = a->dwte + (size_t)a->tokens[i] * C, *pe = a->dwpe + (i % (size_t)a->T) * C;
#pragma omp simd
        for (size_t c = lo; c < hi; c++) {
            te[c] += drow[c];
            pe[c] += drow[c];
        }
    }
}

dg_status_t dg_cpu_encoder_bwd(dg_backend_t *be, float *dwte, float *dwpe, const void *dout,
                               const int32_t *tokens, int B, int T, int C) {
    const char *op = "encoder_bwd";
    DG_CPU_NONNULLS(op, dwte, dwpe, dout, tokens);
    DG_TRY(check_encoder(op, tokens, B, T, C));
    const size_t N = (size_t)B * T;
    /* Each task owns a column range of dwte and dwpe and visits every position in order: repeated
     * tokens need no atomics and every sum has one fixed order. */
    enc_bwd_arg_t a = {dwte, dwpe, dout, tokens, T, C, N};
    dg_cpu_run_cols(dg_cpu_of(be), C, N * C, enc_bwd_task, &a);
    return DG_OK;
}

/* ---------------- layernorm ---------------- */

DG_CPU_VEC static void ln_fwd_row(float *orow, float *mean, float *rstd, const float *xr, const float *wt,
                                  const float *bs, int C) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int c = 0; c < C; c++)
        s += xr[c];
    const float m = s / (float)C;
    float v = 0.0f; /* two passes: no cancellation when |mean| >> std */
#pragma omp simd reduction(+ : v)
    for (int c = 0; c < C; c++) {
        float dx = xr[c] - m;
        v += dx * dx;
    }
    const float rs = 1.0f / sqrtf(v / (float)C + 1e-5f);
#pragma omp simd
    for (int c = 0; c < C; c++)
        orow[c] = (xr[c] - m) * rs * wt[c] + bs[c];
    *mean = m;
    *rstd = rs;
}

/* One row of the backward pass; adds this row's dw/db terms to the chunk partials pw/pb. Everything
 * reading dout happens before dinp is written, so dinp may alias dout. */
DG_CPU_VEC static void ln_bwd_row(float *dxr, float *pw, float *pb, const float *dyr, const float *xr,
                                  const float *wt, float m, float rs, int C, int acc) {
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma omp simd reduction(+ : sum_g, sum_gx)
    for (int c = 0; c < C; c++) {
        float xhat = (xr[c] - m) * rs;
        float g = dyr[c] * wt[c];
        sum_g += g;
        sum_gx += g * xhat;
        pw[c] += dyr[c] * xhat;
        pb[c] += dyr[c];
    }
    const float mg = sum_g / (float)C, mgx = sum_gx / (float)C;
    if (acc) {
#pragma omp simd
        for (int c = 0; c < C; c++) {
            float xhat = (xr[c] - m) * rs;
            dxr[c] += (dyr[c] * wt[c] - mg - xhat * mgx) * rs;
        }
    } else {
#pragma omp simd
        for (int c = 0; c < C; c++) {
            float xhat = (xr[c] - m) * rs;
            dxr[c] = (dyr[c] * wt[c] - mg - xhat * mgx) * rs;
        }
    }
}

typedef struct {
    float *out, *mean, *rstd;
    const float *x, *w, *b;
    int C;
} ln_fwd_arg_t;

static void ln_fwd_task(const void *argp, size_t lo, size_t hi) {
    const ln_fwd_arg_t *a = argp;
    const int C = a->C;
    for (size_t r = lo; r < hi; r++)
        ln_fwd_row(a->out + r * C, a->mean + r, a->rstd + r, a->x + r * C, a->w, a->b, C);
}

dg_status_t dg_cpu_layernorm_fwd(dg_backend_t *be, void *out, float *mean, float *rstd, const void *inp,
                                 const void *w, const void *b, int N, int C) {
    const char *op = "layernorm_fwd";
    DG_CPU_NONNULLS(op, out, mean, rstd, inp, w, b);
    DG_CPU_POSITIVE(op, N);
    DG_CPU_POSITIVE(op, C);
    ln_fwd_arg_t a = {out, mean, rstd, inp, w, b, C};
    dg_cpu_run_range(dg_cpu_of(be), (size_t)N, dg_cpu_ew_tasks(dg_cpu_of(be), (size_t)N * C), ln_fwd_task,
                     &a);
    return DG_OK;
}

typedef struct {
    float *dx, *dw, *db, *part;
    const float *dy, *x, *w, *mean, *rstd;
    int N, C, acc, nchunks;
} ln_bwd_arg_t;

/* Chunk k: rows [32k, 32k + 32); dw/db partials of the chunk go to part[k]. */
static void ln_bwd_chunk_task(void *argp, int k, int worker) {
    (void)worker;
    const ln_bwd_arg_t *a = argp;
    const int C = a->C;
    float *pw = a->part + (size_t)k * 2 * C, *pb = pw + C;
    for (int c = 0; c < C; c++)
        pw[c] = pb[c] = 0.0f;
    const int r1 = min_int(a->N, (k + 1) * DG_CPU_LN_CHUNK);
    for (int r = k * DG_CPU_LN_CHUNK; r < r1; r++)
        ln_bwd_row(a->dx + (size_t)r * C, pw, pb, a->dy + (size_t)r * C, a->x + (size_t)r * C, a->w,
                   a->mean[r], a->rstd[r], C, a->acc);
}

static void ln_bwd_sum_task(const void *argp, size_t lo, size_t hi) {
    const ln_bwd_arg_t *a = argp;
    const int C = a->C;
    float *sw = a->part + (size_t)a->nchunks * 2 * C, *sb = sw + C;
    for (size_t c = lo; c < hi; c++)
        sw[c] = sb[c] = 0.0f;
    for (int k = 0; k < a->nchunks; k++) {
        const float *pw = a->part + (size_t)k * 2 * C, *pb = pw + C;
#pragma omp simd
        for (size_t c = lo; c < hi; c++) {
            sw[c] += pw[c];
            sb[c] += pb[c];
        }
    }
    for (size_t c = lo; c < hi; c++) {
        a->dw[c] += sw[c];
        a->db[c] += sb[c];
    }
}

dg_status_t dg_cpu_layernorm_bwd(dg_backend_t *be, void *dinp, float *dw, float *db, const void *dout,
                                 const void *inp, const void *w, const float *mean, const float *rstd, int N,
                                 int C, int acc) {
    const char *op = "layernorm_bwd";
    DG_CPU_NONNULLS(op, dinp, dw, db, dout, inp, w, mean, rstd);
    DG_CPU_POSITIVE(op, N);
    DG_CPU_POSITIVE(op, C);
    dg_cpu_t *cpu = dg_cpu_of(be);
    const int nchunks = (N + DG_CPU_LN_CHUNK - 1) / DG_CPU_LN_CHUNK;
    /* Per chunk: dw partial [C] then db partial [C]; one more such pair holds the column sums. */
    float *part = dg_cpu_scratch(cpu, (size_t)(nchunks + 1) * 2 * C * sizeof(float));
    if (!part) return dg_last_error_code();
    ln_bwd_arg_t a = {dinp, dw, db, part, dout, inp, w, mean, rstd, N, C, acc, nchunks};
    dg_cpu_run(cpu, nchunks, ln_bwd_chunk_task, &a);
    /* Column sums of the chunk partials, in chunk order, each column by one task. */
    dg_cpu_run_cols(cpu, C, (size_t)nchunks * C, ln_bwd_sum_task, &a);
    return DG_OK;
}

/* ---------------- GELU ---------------- */

DG_CPU_VEC static void gelu_fwd_range(float *o, const float *x, size_t n) {
#pragma omp simd
    for (size_t i = 0; i < n; i++)
        o[i] = dg_cpu_gelu(x[i]);
}
DG_CPU_VEC void dg_cpu_gelu_bwd_range(float *dx, const float *x, const float *dy, size_t n, int acc) {
    if (acc) {
#pragma omp simd
        for (size_t i = 0; i < n; i++)
            dx[i] += dy[i] * dg_cpu_gelu_grad(x[i]);
    } else {
#pragma omp simd
        for (size_t i = 0; i < n; i++)
            dx[i] = dy[i] * dg_cpu_gelu_grad(x[i]);
    }
}

typedef struct {
    float *out;
    const float *x, *dy;
    int acc;
} gelu_arg_t;

static void gelu_fwd_task(const void *argp, size_t lo, size_t hi) {
    const gelu_arg_t *a = argp;
    gelu_fwd_range(a->out + lo, a->x + lo, hi - lo);
}
static void gelu_bwd_task(const void *argp, size_t lo, size_t hi) {
    const gelu_arg_t *a = argp;
    dg_cpu_gelu_bwd_range(a->out + lo, a->x + lo, a->dy + lo, hi - lo, a->acc);
}

dg_status_t dg_cpu_gelu_fwd(dg_backend_t *be, void *out, const void *inp, size_t n) {
    if (n == 0) return DG_OK;
    DG_CPU_NONNULLS("gelu_fwd", out, inp);
    gelu_arg_t a = {out, inp, NULL, 0};
    dg_cpu_run_range(dg_cpu_of(be), n, dg_cpu_ew_tasks(dg_cpu_of(be), n), gelu_fwd_task, &a);
    return DG_OK;
}

dg_status_t dg_cpu_gelu_bwd(dg_backend_t *be, void *dinp, const void *inp, const void *dout, size_t n,
                            int acc) {
    if (n == 0) return DG_OK;
    DG_CPU_NONNULLS("gelu_bwd", dinp, inp, dout);
    gelu_arg_t a = {dinp, inp, dout, acc};
    dg_cpu_run_range(dg_cpu_of(be), n, dg_cpu_ew_tasks(dg_cpu_of(be), n), gelu_bwd_task, &a);
    return DG_OK;
}

/* ---------------- cross-entropy ---------------- */

DG_CPU_VEC static float ce_lse_row(const float *row, int V) {
    float mx = row[0];
#pragma omp simd reduction(max : mx)
    for (int j = 0; j < V; j++)
        mx = row[j] > mx ? row[j] : mx;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int j = 0; j < V; j++)
        s += dg_cpu_expf(row[j] - mx);
    return mx + logf(s);
}

/* Element by element, read before write: drow may alias row. */
DG_CPU_VEC static void ce_bwd_row(float *drow, const float *row, float l, int tg, int V, int Vp,
                                  float dloss) {
    const float p_t = dg_cpu_expf(row[tg] - l); /* read before the row is overwritten */
#pragma omp simd
    for (int j = 0; j < V; j++)
        drow[j] = dg_cpu_expf(row[j] - l) * dloss;
    for (int j = V; j < Vp; j++)
        drow[j] = 0.0f;
    drow[tg] = (p_t - 1.0f) * dloss;
}

typedef struct {
    float *losses, *lse, *dlogits; /* forward: losses, lse; backward: dlogits; fused: all three */
    const float *lse_in;           /* backward */
    const float *logits;
    const int32_t *targets;
    int N, V, Vp;
    float dloss;
} ce_arg_t;

/* One task for the three ops: forward (losses set) writes lse and losses; backward (dlogits set) writes
 * dlogits from lse_in, or, fused, from the lse just computed while the row is in cache. Each row goes
 * through the same row functions in every mode, so the same bits. The target logit is read before the row
 * may be overwritten (in place). */
static void ce_task(const void *argp, size_t lo, size_t hi) {
    const ce_arg_t *a = argp;
    for (size_t i = lo; i < hi; i++) {
        const float *row = a->logits + i * a->Vp;
        float l = a->losses ? ce_lse_row(row, a->V) : a->lse_in[i];
        if (a->losses) {
            a->lse[i] = l;
            a->losses[i] = l - row[a->targets[i]];
        }
        if (a->dlogits) ce_bwd_row(a->dlogits + i * a->Vp, row, l, a->targets[i], a->V, a->Vp, a->dloss);
    }
}

static dg_status_t check_ce(const char *op, const int32_t *targets, int N, int V, int Vp) {
    DG_CPU_POSITIVE(op, N);
    DG_CPU_POSITIVE(op, V);
    if (Vp < V)
        return DG_ERR(DG_ERR_USAGE, "cpu backend: %s: padded vocab Vp=%d is smaller than V=%d", op, Vp, V);
    for (int i = 0; i < N; i++)
        if (targets[i] < 0 || targets[i] >= V)
            return DG_ERR(DG_ERR_USAGE,
                          "cpu backend: %s: target %d at row %d is outside the vocabulary [0, %d)", op,
                          (int)targets[i], i, V);
    return DG_OK;
}

/* The three cross-entropy entry points: `a` holds the mode's outputs (and lse_in, dloss); check, then run
 * ce_task over the N rows of logits in tasks sized by `work`. */
static dg_status_t ce_run(dg_backend_t *be, const char *op, ce_arg_t a, const void *logits,
                          const int32_t *targets, int N, int V, int Vp, size_t work) {
    DG_TRY(check_ce(op, targets, N, V, Vp));
    a.logits = logits, a.targets = targets, a.N = N, a.V = V, a.Vp = Vp;
    dg_cpu_run_range(dg_cpu_of(be), (size_t)N, dg_cpu_ew_tasks(dg_cpu_of(be), work), ce_task, &a);
    return DG_OK;
}

dg_status_t dg_cpu_crossentropy_fwd(dg_backend_t *be, float *losses, float *lse, const void *logits,
                                    const int32_t *targets, int N, int V, int Vp) {
    const char *op = "crossentropy_fwd";
    DG_CPU_NONNULLS(op, losses, lse, logits, targets);
    ce_arg_t a = {.losses = losses, .lse = lse};
    return ce_run(be, op, a, logits, targets, N, V, Vp, (size_t)N * V);
}

dg_status_t dg_cpu_crossentropy_bwd(dg_backend_t *be, void *dlogits, const void *logits, const float *lse,
                                    const int32_t *targets, int N, int V, int Vp, float dloss) {
    const char *op = "crossentropy_bwd";
    DG_CPU_NONNULLS(op, dlogits, logits, lse, targets);
    ce_arg_t a = {.dlogits = dlogits, .lse_in = lse, .dloss = dloss};
    return ce_run(be, op, a, logits, targets, N, V, Vp, (size_t)N * Vp);
}

dg_status_t dg_cpu_crossentropy_fused(dg_backend_t *be, float *losses, float *lse, void *dlogits,
                                      const void *logits, const int32_t *targets, int N, int V, int Vp,
                                      float dloss) {
    const char *op = "crossentropy_fused";
    DG_CPU_NONNULLS(op, losses, lse, dlogits, logits, targets);
    ce_arg_t a = {.losses = losses, .lse = lse, .dlogits = dlogits, .dloss = dloss};
    return ce_run(be, op, a, logits, targets, N, V, Vp, (size_t)N * Vp);
}
