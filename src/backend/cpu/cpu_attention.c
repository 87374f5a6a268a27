/* cpu_attention.c — causal multi-head self-attention on the CPU backend.
 *
 * One (batch, head) pair is one task, done by one thread; pairs are independent, so results do not
 * depend on the thread count. The softmax probabilities P [B, NH, T, T] are saved in aux (upper
 * triangle written as 0) and reused by the backward pass.
 *
 * Why not sgemm: with GPT head sizes (32-64) every product here is a small matrix, where OpenBLAS's
 * call, packing and edge overheads cost more than the arithmetic. The products are written instead as
 * two register-blocked kernels over blocks of 8 rows: "scores" (rows of X times a transposed operand
 * packed once per pair, e.g. Q·Kᵀ) and "weighted sums" (rows of weights times rows of Z, e.g. P·V).
 * Every output element is one fused multiply-add chain over its reduction index in increasing order,
 * starting from 0, so the result does not depend on the blocking, and the AVX-512 kernels give the same
 * bits as the portable ones (used where AVX-512 is absent).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "backend_cpu_impl.h"
#include "dg_env.h"

/* Rows per block: queries in the forward pass and for dQ, keys for dK and dV. */
#define DG_CPU_ATT_RB 8

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

/* ---------------- the two product kernels ----------------
 * scores: out[r*ldo + j] = scale * sum_{d < K} X[r*ldx + d] * Yt[d*ldy + j]       r < rows, j < ncols
 * wsum:   out[r*ldo + c] = sum_{i0 <= i < i1} W[r*wrs + i*wis] * Z[i*ldz + c]       r < rows, c < width
 * rows <= DG_CPU_ATT_RB. Rows past `rows` are computed from a copy of the last row and not stored, so the
 * kernels never read outside the operands. */

DG_CPU_VEC static void scores_portable(float *out, int ldo, const float *X, int ldx, int rows,
                                       const float *Yt, int ldy, int ncols, int K, float scale) {
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < ncols; j++) {
            float acc = 0.0f;
            for (int d = 0; d < K; d++)
                acc = fmaf(X[(size_t)r * ldx + d], Yt[(size_t)d * ldy + j], acc);
            out[(size_t)r * ldo + j] = acc * scale;
        }
}

DG_CPU_VEC static void wsum_portable(float *out, int ldo, const float *W, size_t wrs, size_t wis, int rows,
                                     int i0, int i1, const float *Z, int ldz, int width) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < width; c++) {
            float acc = 0.0f;
            for (int i = i0; i < i1; i++)
                acc = fmaf(W[r * wrs + i * wis], Z[(size_t)i * ldz + c], acc);
            out[(size_t)r * ldo + c] = acc;
        }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define DG_CPU_HAVE_AVX512_ATT 1
#define DG_AVX512 __attribute__((target("avx512f")))

DG_AVX512 static inline __mmask16 lane_mask(int n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

/* out[r][c] = sum over k in [k0, k1) of X[r * xrs + k * xks] * Y[k * ldy + c] (times `scale` when
 * `scaled`), for r < rows and c < width: 32 columns at a time in DG_CPU_ATT_RB x 2 registers. Always inlined,
 * so that each caller's constant stride and `scaled` fold away. */
DG_AVX512 static inline __attribute__((always_inline)) void
rowblock_avx512(float *out, int ldo, const float *X, size_t xrs, size_t xks, int rows, int k0, int k1,
                const float *Y, int ldy, int width, int scaled, float scale) {
    const float *x[DG_CPU_ATT_RB];
    for (int r = 0; r < DG_CPU_ATT_RB; r++)
        x[r] = X + (size_t)(r < rows ? r : rows - 1) * xrs;
    const __m512 vs = _mm512_set1_ps(scale);
    for (int c0 = 0; c0 < width; c0 += 32) {
        const __mmask16 m0 = lane_mask(width - c0), m1 = lane_mask(width - c0 - 16);
        __m512 a[DG_CPU_ATT_RB][2];
#pragma GCC unroll 8
        for (int r = 0; r < DG_CPU_ATT_RB; r++)
            a[r][0] = a[r][1] = _mm512_setzero_ps();
        for (int k = k0; k < k1; k++) {
            const float *y = Y + (size_t)k * ldy + c0;
            const __m512 y0 = _mm512_maskz_loadu_ps(m0, y), y1 = _mm512_maskz_loadu_ps(m1, y + 16);
#pragma GCC unroll 8
            for (int r = 0; r < DG_CPU_ATT_RB; r++) {
                const __m512 b = _mm512_set1_ps(x[r][k * xks]);
                a[r][0] = _mm512_fmadd_ps(b, y0, a[r][0]);
                a[r][1] = _mm512_fmadd_ps(b, y1, a[r][1]);
            }
        }
        /* every loop over `a` is unrolled (stores guarded, not bounded) so it stays in registers */
#pragma GCC unroll 8
        for (int r = 0; r < DG_CPU_ATT_RB; r++) {
            if (r >= rows) break;
            float *o = out + (size_t)r * ldo + c0;
            _mm512_mask_storeu_ps(o, m0, scaled ? _mm512_mul_ps(a[r][0], vs) : a[r][0]);
            _mm512_mask_storeu_ps(o + 16, m1, scaled ? _mm512_mul_ps(a[r][1], vs) : a[r][1]);
        }
    }
}

DG_AVX512 static void scores_avx512(float *out, int ldo, const float *X, int ldx, int rows, const float *Yt,
                                    int ldy, int ncols, int K, float scale) {
    rowblock_avx512(out, ldo, X, (size_t)ldx, 1, rows, 0, K, Yt, ldy, ncols, 1, scale);
}

DG_AVX512 static void wsum_avx512(float *out, int ldo, const float *W, size_t wrs, size_t wis, int rows,
                                  int i0, int i1, const float *Z, int ldz, int width) {
    rowblock_avx512(out, ldo, W, wrs, wis, rows, i0, i1, Z, ldz, width, 0, 1.0f);
}
#endif

/* 1 when the AVX-512 kernels may run here (both kinds give the same bits). DG_CPU_NO_AVX512=1 in the
 * environment forces the portable ones, so that a test can compare the two on an AVX-512 machine. */
static int have_avx512(void) {
#ifdef DG_CPU_HAVE_AVX512_ATT
    if (dg_env_bool("DG_CPU_NO_AVX512")) return 0;
    return __builtin_cpu_supports("avx512f") ? 1 : 0;
#else
    return 0;
#endif
}

static void scores(int avx512, float *out, int ldo, const float *X, int ldx, int rows, const float *Yt,
                   int ldy, int ncols, int K, float scale) {
#ifdef DG_CPU_HAVE_AVX512_ATT
    if (avx512) {
        scores_avx512(out, ldo, X, ldx, rows, Yt, ldy, ncols, K, scale);
        return;
    }
#endif
    (void)avx512;
    scores_portable(out, ldo, X, ldx, rows, Yt, ldy, ncols, K, scale);
}

static void wsum(int avx512, float *out, int ldo, const float *W, size_t wrs, size_t wis, int rows, int i0,
                 int i1, const float *Z, int ldz, int width) {
#ifdef DG_CPU_HAVE_AVX512_ATT
    if (avx512) {
        wsum_avx512(out, ldo, W, wrs, wis, rows, i0, i1, Z, ldz, width);
        return;
    }
#endif
    (void)avx512;
    wsum_portable(out, ldo, W, wrs, wis, rows, i0, i1, Z, ldz, width);
}

/* Yt[d*ldy + j] = Y[j*ld + d] for j < T, d < hs: the keys (or values) of one head, transposed so that the
 * scores kernel reads 16 consecutive keys per vector. */
static void transpose_head(float *Yt, int ldy, const float *Y, int ld, int T, int hs) {
    for (int j0 = 0; j0 < T; j0 += 16) {
        const int j1 = j0 + 16 < T ? j0 + 16 : T;
        for (int d = 0; d < hs; d++)
            for (int j = j0; j < j1; j++)
                Yt[(size_t)d * ldy + j] = Y[(size_t)j * ld + d];
    }
}

/* Row sums in 16 interleaved lanes (lane l adds the elements j = l mod 16 in order) and then a fixed
 * pairwise tree: the same order whatever vector width the compiler picks (one AVX-512 register, two
 * AVX2 ones, four SSE ones), so these rows give the same bits on every x86-64 level. */
#define DG_CPU_LANES 16
static inline float lanes_total(float *acc) {
    for (int w = DG_CPU_LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++)
            acc[l] += acc[l + w];
    return acc[0];
}

/* In place over row[0..t]: softmax; row[t+1..edge) := 0 (the rest of the block, which the block
 * products read; entries past the block are never read). */
DG_CPU_VEC static void causal_softmax_row(float *row, int t, int edge) {
    const int n = t + 1;
    float mx = row[0];
#pragma omp simd reduction(max : mx)
    for (int j = 0; j < n; j++)
        mx = row[j] > mx ? row[j] : mx;
    float acc[DG_CPU_LANES] = {0};
    int j0 = 0;
    for (; j0 + DG_CPU_LANES <= n; j0 += DG_CPU_LANES)
        for (int l = 0; l < DG_CPU_LANES; l++) {
            float e = dg_cpu_expf(row[j0 + l] - mx);
            row[j0 + l] = e;
            acc[l] += e;
        }
    for (int l = 0; l < n - j0; l++) {
        float e = dg_cpu_expf(row[j0 + l] - mx);
        row[j0 + l] = e;
        acc[l] += e;
    }
    const float inv = 1.0f / lanes_total(acc);
#pragma omp simd
    for (int j = 0; j < n; j++)
        row[j] *= inv;
    for (int j = n; j < edge; j++)
        row[j] = 0.0f;
}

/* Softmax backward of one row, with the score scale folded in: dS = scale · P ∘ (dP - rowsum(P ∘ dP)),
 * in place over drow (which holds dP for keys 0..t). Keys past the diagonal up to `edge` are zeroed
 * because the key-block products read them. */
DG_CPU_VEC static void softmax_bwd_row(float *drow, const float *prow, int t, int edge, float scale) {
    const int n = t + 1;
    float acc[DG_CPU_LANES] = {0};
    int j0 = 0;
    for (; j0 + DG_CPU_LANES <= n; j0 += DG_CPU_LANES)
        for (int l = 0; l < DG_CPU_LANES; l++)
            acc[l] += prow[j0 + l] * drow[j0 + l];
    for (int l = 0; l < n - j0; l++)
        acc[l] += prow[j0 + l] * drow[j0 + l];
    const float dot = lanes_total(acc);
#pragma omp simd
    for (int j = 0; j < n; j++)
        drow[j] = scale * prow[j] * (drow[j] - dot);
    for (int j = n; j < edge; j++)
        drow[j] = 0.0f;
}

#ifdef DG_CPU_HAVE_AVX512_ATT
/* The two rows above with AVX-512 intrinsics: the same operations in the same order (dg_cpu_expf step
 * by step, no fused multiply-adds, the lane sums and tree of lanes_total), so the same bits; the last
 * partial chunk runs masked instead of as a scalar loop. */
DG_AVX512 static inline __m512 expf_avx512(__m512 x) {
    /* max/min return their second operand when one is NaN: NaN flows through as in dg_cpu_expf */
    __m512 xc = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
    xc = _mm512_min_ps(_mm512_set1_ps(87.0f), xc);
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    __m512 t = _mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)), magic);
    __m512 n = _mm512_sub_ps(t, magic);
    __m512 r = _mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B400000)),
                         _mm512_set1_epi32(127)),
        23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* lanes_total on a register: lane l + lane l+8, then l+4, l+2, l+1. */
DG_AVX512 static inline float lanes_total_avx512(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));
    return _mm_cvtss_f32(b);
}

DG_AVX512 static void causal_softmax_row_avx512(float *row, int t, int edge) {
    const int n = t + 1;
    __m512 vmx = _mm512_set1_ps(row[0]);
    for (int j0 = 0; j0 < n; j0 += 16) {
        const __mmask16 m = lane_mask(n - j0);
        vmx = _mm512_mask_max_ps(vmx, m, vmx, _mm512_maskz_loadu_ps(m, row + j0));
    }
    const float mx = _mm512_reduce_max_ps(vmx);
    const __m512 vm = _mm512_set1_ps(mx);
    __m512 acc = _mm512_setzero_ps();
    for (int j0 = 0; j0 < n; j0 += 16) {
        const __mmask16 m = lane_mask(n - j0);
        const __m512 e =
            _mm512_maskz_mov_ps(m, expf_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j0), vm)));
        _mm512_mask_storeu_ps(row + j0, m, e);
        acc = _mm512_add_ps(acc, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / lanes_total_avx512(acc));
    for (int j0 = 0; j0 < n; j0 += 16) {
        const __mmask16 m = lane_mask(n - j0);
        _mm512_mask_storeu_ps(row + j0, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + j0), inv));
    }
    for (int j = n; j < edge; j++)
        row[j] = 0.0f;
}

DG_AVX512 static void softmax_bwd_row_avx512(float *drow, const float *prow, int t, int edge, float scale) {
    const int n = t + 1;
    __m512 acc = _mm512_setzero_ps();
    for (int j0 = 0; j0 < n; j0 += 16) {
        const __mmask16 m = lane_mask(n - j0);
        acc = _mm512_add_ps(
            acc, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, prow + j0), _mm512_maskz_loadu_ps(m, drow + j0)));
    }
    const __m512 dot = _mm512_set1_ps(lanes_total_avx512(acc)), vs = _mm512_set1_ps(scale);
    for (int j0 = 0; j0 < n; j0 += 16) {
        const __mmask16 m = lane_mask(n - j0);
        const __m512 p = _mm512_maskz_loadu_ps(m, prow + j0), d = _mm512_maskz_loadu_ps(m, drow + j0);
        _mm512_mask_storeu_ps(drow + j0, m, _mm512_mul_ps(_mm512_mul_ps(vs, p), _mm512_sub_ps(d, dot)));
    }
    for (int j = n; j < edge; j++)
        drow[j] = 0.0f;
}
#endif

static void softmax_row(int avx512, float *row, int t, int edge) {
#ifdef DG_CPU_HAVE_AVX512_ATT
    if (avx512) {
        causal_softmax_row_avx512(row, t, edge);
        return;
    }
#endif
    (void)avx512;
    causal_softmax_row(row, t, edge);
}

static void softmax_bwd(int avx512, float *drow, const float *prow, int t, int edge, float scale) {
#ifdef DG_CPU_HAVE_AVX512_ATT
    if (avx512) {
        softmax_bwd_row_avx512(drow, prow, t, edge, scale);
        return;
    }
#endif
    (void)avx512;
    softmax_bwd_row(drow, prow, t, edge, scale);
}

typedef struct {
    float *out, *p_all, *dqkv;
    const float *qkv, *dout;
    int B, T, C, NH, Tp; /* Tp: T rounded up to 16, the row length of a transposed head */
    int avx512;
    float *scratch; /* per thread: see att_fwd_scratch and att_bwd_scratch */
    size_t scratch_per_thread;
} att_arg_t;

/* Both passes: a's per-thread scratch (per_fn floats: see att_fwd_scratch, att_bwd_scratch), then fn over
 * the B x NH heads. */
static dg_status_t att_run(dg_cpu_t *cpu, att_arg_t a, size_t (*per_fn)(int T, int Tp, int hs),
                           dg_cpu_task_fn fn) {
    a.Tp = (a.T + 15) / 16 * 16;
    a.scratch_per_thread = per_fn(a.T, a.Tp, a.C / a.NH);
    a.scratch = dg_cpu_scratch(cpu, (size_t)cpu->nt * a.scratch_per_thread * sizeof(float));
    if (!a.scratch) return dg_last_error_code();
    a.avx512 = have_avx512();
    dg_cpu_run(cpu, a.B * a.NH, fn, &a);
    return DG_OK;
}

/* One (batch, head) pair. */
static void att_fwd_task(void *argp, int bh, int worker) {
    const att_arg_t *a = argp;
    const int T = a->T, C = a->C, hs = C / a->NH, ld = 3 * C;
    const int b = bh / a->NH, h = bh % a->NH;
    const float scale = 1.0f / sqrtf((float)hs);
    const float *Q = a->qkv + (size_t)b * T * ld + (size_t)h * hs, *K = Q + C, *V = Q + 2 * C;
    float *P = a->p_all + (size_t)bh * T * T;
    float *O = a->out + (size_t)b * T * C + (size_t)h * hs;
    float *Kt = a->scratch + (size_t)worker * a->scratch_per_thread;
    transpose_head(Kt, a->Tp, K, ld, T, hs);
    for (int r0 = 0; r0 < T; r0 += DG_CPU_ATT_RB) {
        const int r1 = r0 + DG_CPU_ATT_RB < T ? r0 + DG_CPU_ATT_RB : T;
        /* S[r0:r1, 0:r1] = scale · Q[r0:r1] · K[0:r1]ᵀ; keys past r1 are masked for every row here */
        scores(a->avx512, P + (size_t)r0 * T, T, Q + (size_t)r0 * ld, ld, r1 - r0, Kt, a->Tp, r1, hs, scale);
        for (int t = r0; t < r1; t++)
            softmax_row(a->avx512, P + (size_t)t * T, t, r1);
        /* O[r0:r1] = P[r0:r1, 0:r1] · V[0:r1] (P is 0 past the diagonal) */
        wsum(a->avx512, O + (size_t)r0 * C, C, P + (size_t)r0 * T, T, 1, r1 - r0, 0, r1, V, ld, hs);
    }
}

/* Floats of per-thread scratch: K transposed [hs, Tp], rounded to whole 64-byte lines. */
static size_t att_fwd_scratch(int T, int Tp, int hs) {
    (void)T;
    return ((size_t)hs * Tp + 15) / 16 * 16;
}

dg_status_t dg_cpu_attention_fwd(dg_backend_t *be, void *out, void *aux, const void *qkv, int B, int T, int C,
                                 int NH) {
    const char *op = "attention_fwd";
    DG_CPU_NONNULLS(op, out, aux, qkv);
    DG_TRY(check_shape(op, B, T, C, NH));
    att_arg_t a = {.out = out, .p_all = aux, .qkv = qkv, .B = B, .T = T, .C = C, .NH = NH};
    return att_run(dg_cpu_of(be), a, att_fwd_scratch, att_fwd_task);
}

static void att_bwd_task(void *argp, int bh, int worker) {
    const att_arg_t *a = argp;
    const int T = a->T, C = a->C, hs = C / a->NH, ld = 3 * C;
    const int b = bh / a->NH, h = bh % a->NH;
    const float scale = 1.0f / sqrtf((float)hs);
    /* this thread's scratch: V transposed [hs, Tp], then dP turned into dS in place [T, T] */
    float *Vt = a->scratch + (size_t)worker * a->scratch_per_thread;
    float *dS = Vt + ((size_t)hs * a->Tp + 15) / 16 * 16;
    const size_t qoff = (size_t)b * T * ld + (size_t)h * hs;
    const float *Q = a->qkv + qoff, *K = Q + C, *V = Q + 2 * C;
    float *dQ = a->dqkv + qoff, *dK = dQ + C, *dV = dQ + 2 * C;
    const float *P = a->p_all + (size_t)bh * T * T;
    const float *dO = a->dout + (size_t)b * T * C + (size_t)h * hs;
    transpose_head(Vt, a->Tp, V, ld, T, hs);
    for (int r0 = 0; r0 < T; r0 += DG_CPU_ATT_RB) {
        const int r1 = r0 + DG_CPU_ATT_RB < T ? r0 + DG_CPU_ATT_RB : T;
        /* dP[r0:r1, 0:r1] = dO[r0:r1] · V[0:r1]ᵀ, then dS in place (zero past the diagonal up to r1) */
        scores(a->avx512, dS + (size_t)r0 * T, T, dO + (size_t)r0 * C, C, r1 - r0, Vt, a->Tp, r1, hs, 1.0f);
        for (int t = r0; t < r1; t++)
            softmax_bwd(a->avx512, dS + (size_t)t * T, P + (size_t)t * T, t, r1, scale);
        /* dQ[r0:r1] = dS[r0:r1, 0:r1] · K[0:r1] */
        wsum(a->avx512, dQ + (size_t)r0 * ld, ld, dS + (size_t)r0 * T, T, 1, r1 - r0, 0, r1, K, ld, hs);
    }
    /* Keys j in [j0, j1) are seen by queries t >= j0 only (dS and P are 0 above the diagonal there):
     * dK[j0:j1] = dS[j0:T, j0:j1]ᵀ · Q[j0:T],  dV[j0:j1] = P[j0:T, j0:j1]ᵀ · dO[j0:T] */
    for (int j0 = 0; j0 < T; j0 += DG_CPU_ATT_RB) {
        const int j1 = j0 + DG_CPU_ATT_RB < T ? j0 + DG_CPU_ATT_RB : T;
        wsum(a->avx512, dK + (size_t)j0 * ld, ld, dS + j0, 1, (size_t)T, j1 - j0, j0, T, Q, ld, hs);
        wsum(a->avx512, dV + (size_t)j0 * ld, ld, P + j0, 1, (size_t)T, j1 - j0, j0, T, dO, C, hs);
    }
}

/* Floats of per-thread scratch: V transposed [hs, Tp] (rounded to whole 64-byte lines), then dS [T, T]. */
static size_t att_bwd_scratch(int T, int Tp, int hs) {
    return ((size_t)hs * Tp + 15) / 16 * 16 + ((size_t)T * T + 15) / 16 * 16;
}

dg_status_t dg_cpu_attention_bwd(dg_backend_t *be, void *dqkv, const void *dout, const void *qkv,
                                 const void *out, const void *aux, int B, int T, int C, int NH) {
    const char *op = "attention_bwd";
    (void)out; /* P in aux carries everything the backward pass needs */
    DG_CPU_NONNULLS(op, dqkv, dout, qkv, aux);
    DG_TRY(check_shape(op, B, T, C, NH));
    att_arg_t a = {
        .p_all = (float *)aux, .dqkv = dqkv, .qkv = qkv, .dout = dout, .B = B, .T = T, .C = C, .NH = NH};
    return att_run(dg_cpu_of(be), a, att_bwd_scratch, att_bwd_task);
}
