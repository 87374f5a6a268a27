/* backend_cpu_impl.h — private to the CPU backend: its state, the scratch arena, the fixed work
 * decompositions that keep results independent of the thread count, and the small inline math
 * (exp, GELU, fp16/bf16 conversion) shared by its translation units. Not part of any public API.
 *
 * Threading model (see README.md in this folder): every kernel runs as one job of independent tasks on
 * the backend's own worker pool (cpu_pool.c), nt threads including the caller; OpenBLAS is forced to
 * one thread and called from inside tasks on work tiles whose shapes depend only on the problem shape,
 * never on nt. OpenMP is used only for `omp simd` loops and for its default thread count.
 */
#ifndef DG_BACKEND_CPU_IMPL_H
#define DG_BACKEND_CPU_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "backend.h"

/* The worker pool (cpu_pool.c): a job is `ntasks` independent tasks; the calling thread and the pool's
 * workers claim them one at a time, and the call returns when all have run. `worker` is 0 for the
 * calling thread and 1..threads-1 for the others (an index for per-thread scratch). Tasks must not
 * start jobs themselves. */
typedef struct dg_cpu_pool dg_cpu_pool_t;
typedef void (*dg_cpu_task_fn)(void *arg, int task, int worker);
dg_status_t dg_cpu_pool_create(int nthreads, dg_cpu_pool_t **out);
void dg_cpu_pool_free(dg_cpu_pool_t *pool);
void dg_cpu_pool_run(dg_cpu_pool_t *pool, int ntasks, dg_cpu_task_fn fn, void *arg);
int dg_cpu_pool_threads(const dg_cpu_pool_t *pool);

typedef struct dg_cpu {
    int nt;               /* threads (the caller plus nt - 1 pool workers) */
    dg_cpu_pool_t *pool;  /* started by the first job with more than one task; NULL before, or when nt == 1 */
    int pool_failed;      /* the workers could not be started: every job runs on the calling thread */
    void *scratch;        /* grow-only arena for partial sums and per-thread buffers */
    size_t scratch_bytes; /* capacity of `scratch` */
    /* bytes of alloc's blocks and the scratch now, and their peak since the last mem_usage reset (atomic:
     * kernels may grow the scratch from a pool thread) */
    size_t mem_now, mem_win_peak;
} dg_cpu_t;

/* Run fn over tasks [0, ntasks) on the backend's threads. The workers start on first use (a backend that
 * only plans runs no threads); if they cannot start, jobs run on the calling thread with the same
 * results, after one warning. */
void dg_cpu_run(dg_cpu_t *cpu, int ntasks, dg_cpu_task_fn fn, void *arg);

static inline dg_cpu_t *dg_cpu_of(dg_backend_t *be) {
    return (dg_cpu_t *)be->impl;
}

/* Scratch of at least `bytes` (256-byte aligned), or NULL after setting DG_ERR when memory runs out.
 * The same arena is reused by every call, so one backend object must not run two kernels at once. */
void *dg_cpu_scratch(dg_cpu_t *cpu, size_t bytes);

/* Make sure OpenBLAS runs single-threaded (cheap when it already does): something else in the process
 * may have changed the process-wide setting after the backend was created, and an OpenBLAS that threads
 * inside our parallel regions would oversubscribe the cores and split GEMMs by its thread count. */
void dg_cpu_blas_single_thread(void);

/* A function run on one tile [m0, m1) x [n0, n1) of a GEMM's output, before or after its sgemm call. */
typedef void (*dg_cpu_tile_fn)(void *arg, int m0, int m1, int n0, int n1);

/* Kernels living in other translation units (signatures as in dg_backend_ops_t). */
dg_status_t dg_cpu_matmul_fwd(dg_backend_t *be, void *out, void *pre, const void *inp, const void *w,
                              const void *bias, int N, int C, int OC, dg_epilogue_t epi);
dg_status_t dg_cpu_matmul_fwd_res(dg_backend_t *be, void *out, const void *inp, const void *w,
                                  const void *bias, const void *res, int N, int C, int OC);
dg_status_t dg_cpu_matmul_bwd(dg_backend_t *be, void *dinp, float *dw, float *dbias, const void *dout,
                              const void *inp, const void *w, int N, int C, int OC, int acc);
dg_status_t dg_cpu_matmul_bwd_dgelu(dg_backend_t *be, void *dpre, float *dw, float *dbias, const void *dout,
                                    const void *inp, const void *w, const void *pre, int N, int C, int OC,
                                    int acc);
size_t dg_cpu_attention_aux_bytes(dg_backend_t *be, int B, int T, int C, int NH);
/* cpu_attention_kv.c: backend.h's attention_kv_fwd (v1.12). */
dg_status_t dg_cpu_attention_kv_fwd(dg_backend_t *be, void *out, void *kcache, void *vcache, const void *qkv,
                                    int p0, int n, int cap, int C, int NH);
dg_status_t dg_cpu_attention_fwd(dg_backend_t *be, void *out, void *aux, const void *qkv, int B, int T, int C,
                                 int NH);
dg_status_t dg_cpu_attention_bwd(dg_backend_t *be, void *dqkv, const void *dout, const void *qkv,
                                 const void *out, const void *aux, int B, int T, int C, int NH);
dg_status_t dg_cpu_encoder_fwd(dg_backend_t *be, void *out, const int32_t *tokens, const void *wte,
                               const void *wpe, int B, int T, int C);
dg_status_t dg_cpu_encoder_bwd(dg_backend_t *be, float *dwte, float *dwpe, const void *dout,
                               const int32_t *tokens, int B, int T, int C);
dg_status_t dg_cpu_layernorm_fwd(dg_backend_t *be, void *out, float *mean, float *rstd, const void *inp,
                                 const void *w, const void *b, int N, int C);
dg_status_t dg_cpu_layernorm_bwd(dg_backend_t *be, void *dinp, float *dw, float *db, const void *dout,
                                 const void *inp, const void *w, const float *mean, const float *rstd, int N,
                                 int C, int acc);
dg_status_t dg_cpu_gelu_fwd(dg_backend_t *be, void *out, const void *inp, size_t n);
dg_status_t dg_cpu_gelu_bwd(dg_backend_t *be, void *dinp, const void *inp, const void *dout, size_t n,
                            int acc);
dg_status_t dg_cpu_crossentropy_fwd(dg_backend_t *be, float *losses, float *lse, const void *logits,
                                    const int32_t *targets, int N, int V, int Vp);
dg_status_t dg_cpu_crossentropy_bwd(dg_backend_t *be, void *dlogits, const void *logits, const float *lse,
                                    const int32_t *targets, int N, int V, int Vp, float dloss);
dg_status_t dg_cpu_crossentropy_fused(dg_backend_t *be, float *losses, float *lse, void *dlogits,
                                      const void *logits, const int32_t *targets, int N, int V, int Vp,
                                      float dloss);

/* ---- shared argument checks: one-line DG_ERR_USAGE messages naming the kernel and argument ---- */
#define DG_CPU_NONNULL(op, p)                                                                                \
    do {                                                                                                     \
        if (!(p)) return DG_ERR(DG_ERR_USAGE, "cpu backend: %s: argument `%s` is NULL", (op), #p);           \
    } while (0)
/* DG_CPU_NONNULLS(op, a, b, ...): DG_CPU_NONNULL of each argument in order (plain names only: the
 * message names the first NULL one by its spelling in the list). */
dg_status_t dg_cpu_nonnulls(const char *op, const char *names, const void *const *ptrs, int n);
#define DG_CPU_NONNULLS(op, ...)                                                                             \
    DG_TRY(dg_cpu_nonnulls((op), #__VA_ARGS__, (const void *const[]){__VA_ARGS__},                           \
                           (int)(sizeof((const void *const[]){__VA_ARGS__}) / sizeof(const void *))))
#define DG_CPU_POSITIVE(op, v)                                                                               \
    do {                                                                                                     \
        if ((v) <= 0)                                                                                        \
            return DG_ERR(DG_ERR_USAGE, "cpu backend: %s: `%s` must be positive, got %lld", (op), #v,        \
                          (long long)(v));                                                                   \
    } while (0)

/* Split [0, n) into `parts` near-equal contiguous ranges whose inner bounds are multiples of `align`;
 * range i is [*lo, *hi). Used where each thread owns whole output columns, so the split may follow the
 * thread count without changing any result. */
static inline void dg_cpu_split(int n, int parts, int i, int align, int *lo, int *hi) {
    int units = (n + align - 1) / align;
    int a = (int)((long long)units * i / parts), b = (int)((long long)units * (i + 1) / parts);
    *lo = a * align < n ? a * align : n;
    *hi = b * align < n ? b * align : n;
}

/* Hot loops are compiled for three x86-64 levels (SSE4.2, the build's baseline; AVX2; AVX-512) and the
 * best one the CPU has is picked once, at load time (GCC target_clones). Element-wise results are the
 * same bits on every level (same operations, no FMA contraction); sums vectorised along a row
 * (layernorm, softmax, cross-entropy) follow the vector width, so they can differ between machines of
 * different levels, as OpenBLAS's kernels do, but never between runs or thread counts on one machine.
 * OpenMP-outlined loop bodies do not inherit the attribute, so parallel loops call such functions. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define DG_CPU_VEC __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DG_CPU_VEC
#endif

/* Loops over fewer elements than this run on one thread: waking the team costs more than it saves. */
#define DG_CPU_PAR_MIN 16384

/* Tasks for an element-wise kernel over n elements (any split gives the same bits there): one below
 * DG_CPU_PAR_MIN, else up to 4 per thread for balance, none under DG_CPU_PAR_MIN / 2 elements. */
static inline int dg_cpu_ew_tasks(const dg_cpu_t *cpu, size_t n) {
    if (cpu->nt == 1 || n < DG_CPU_PAR_MIN) return 1;
    size_t t = n / (DG_CPU_PAR_MIN / 2), cap = 4 * (size_t)cpu->nt;
    return (int)(t < cap ? t : cap);
}

/* Part i of [0, n) cut into `parts` near-equal ranges [*lo, *hi) whose inner bounds are multiples of 16
 * (whole 64-byte lines of floats for each task). */
static inline void dg_cpu_range(size_t n, int parts, int i, size_t *lo, size_t *hi) {
    *lo = i == 0 ? 0 : (n * (size_t)i / (size_t)parts) & ~(size_t)15;
    *hi = i == parts - 1 ? n : (n * (size_t)(i + 1) / (size_t)parts) & ~(size_t)15;
}

/* A range job: fn(arg, lo, hi) runs once per task on that task's part [lo, hi) of [0, n), the parts cut by
 * dg_cpu_range into `tasks` (so they depend on n and tasks only, never on the thread count). */
typedef void (*dg_cpu_range_fn)(const void *arg, size_t lo, size_t hi);
void dg_cpu_run_range(dg_cpu_t *cpu, size_t n, int tasks, dg_cpu_range_fn fn, const void *arg);
/* A column job: fn(arg, lo, hi) runs once per part on the columns [lo, hi) of [0, C), cut by dg_cpu_split
 * at multiples of 16: one part when `work` (the elements the job touches) is under DG_CPU_PAR_MIN, else
 * min(threads, C / 16 rounded up). Each part owns whole columns, so any cut gives the same bits. */
void dg_cpu_run_cols(dg_cpu_t *cpu, int C, size_t work, dg_cpu_range_fn fn, const void *arg);

/* ---- bit casts ---- */
static inline uint32_t dg_cpu_f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float dg_cpu_u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* exp(x) in float to about 1 ulp, written with plain arithmetic so loops calling it vectorise (libm's
 * expf does not without -ffast-math) and give the same bits in the vector body and the scalar tail.
 * Inputs are clamped to [-87, 87] (results stay normal, so no slow denormals); NaN propagates.
 * Cephes-style: x = n ln2 + r, |r| <= ln2/2, e^r by a degree-6 polynomial, then scale by 2^n. */
static inline float dg_cpu_select(int take_b, float a, float b) {
    uint32_t m = 0u - (uint32_t)take_b; /* a bit-mask select, not a branch: see dg_cpu_expf */
    return dg_cpu_u2f((dg_cpu_f2u(a) & ~m) | (dg_cpu_f2u(b) & m));
}
static inline float dg_cpu_expf(float x) {
    /* Clamp with masks rather than `?:`: GCC turns a ternary clamp into a branch, duplicates the rest of
     * the caller's expression into it with the bound constant-folded, and evaluates that copy for every
     * vector lane; in GELU that copy underflows to denormals and ran 6x slower. Comparisons are false
     * for NaN, which thus flows through. */
    float xc = dg_cpu_select(x < -87.0f, x, -87.0f);
    xc = dg_cpu_select(xc > 87.0f, xc, 87.0f);
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer held in the low bits */
    float t = xc * 1.44269504088896341f + magic;
    float n = t - magic;
    float r = xc - n * 0.693359375f; /* ln2 split hi/lo so r is exact enough */
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t e = (dg_cpu_f2u(t) - 0x4B400000u + 127u) << 23; /* unsigned: no UB even for NaN bits */
    return p * dg_cpu_u2f(e);
}

/* GELU (tanh form). 0.5 (1 + tanh(u)) == sigmoid(2u), which needs one exp and has no cancellation for
 * large |x|: gelu(x) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3). */
#define DG_CPU_GELU_K0 0.7978845608028654f /* sqrt(2/pi) */
#define DG_CPU_GELU_K1 0.044715f
static inline float dg_cpu_gelu(float x) {
    float u = DG_CPU_GELU_K0 * (x + DG_CPU_GELU_K1 * x * x * x);
    return x / (1.0f + dg_cpu_expf(-2.0f * u));
}
/* d gelu / dx = s + x s (1 - s) 2 u'(x), s = sigmoid(2u). */
static inline float dg_cpu_gelu_grad(float x) {
    float x2 = x * x;
    float u = DG_CPU_GELU_K0 * (x + DG_CPU_GELU_K1 * x2 * x);
    float du = DG_CPU_GELU_K0 * (1.0f + 3.0f * DG_CPU_GELU_K1 * x2);
    float s = 1.0f / (1.0f + dg_cpu_expf(-2.0f * u));
    return s + x * s * (1.0f - s) * 2.0f * du;
}
/* dx[i] = dy[i] * gelu'(x[i]), or += with acc = 1: the one GELU backward loop, shared by gelu_bwd and
 * matmul_bwd_dgelu's epilogue so that the two give the same bits (cpu_kernels.c). */
void dg_cpu_gelu_bwd_range(float *dx, const float *x, const float *dy, size_t n, int acc);

/* ---- fp16 / bf16 (round to nearest even; NaN stays NaN, quiet) ---- */
static inline uint16_t dg_cpu_f32_to_bf16(float f) {
    uint32_t u = dg_cpu_f2u(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float dg_cpu_bf16_to_f32(uint16_t h) {
    return dg_cpu_u2f((uint32_t)h << 16);
}
static inline uint16_t dg_cpu_f32_to_f16(float f) {
    uint32_t x = dg_cpu_f2u(f);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) /* inf, or NaN with its top payload bits kept and forced quiet */
        return (uint16_t)(sign | (ax > 0x7F800000u ? 0x7E00u | ((ax >> 13) & 0x3FFu) : 0x7C00u));
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* >= 65520 rounds to inf */
    if (ax < 0x38800000u) {                                   /* below 2^-14: fp16 subnormal or zero */
        if (ax < 0x33000000u) return (uint16_t)sign;          /* below 2^-25: rounds to zero */
        uint32_t e = ax >> 23, m = (ax & 0x7FFFFFu) | 0x800000u, sh = 126u - e;
        uint32_t r = m >> sh, rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1u);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t v = ax - 0x38000000u; /* rebias the exponent from 127 to 15 */
    uint32_t r = v >> 13, rem = v & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++; /* a carry into the exponent is correct */
    return (uint16_t)(sign | r);
}
static inline float dg_cpu_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1Fu) return dg_cpu_u2f(sign | 0x7F800000u | (m << 13));
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
        return dg_cpu_u2f(sign | dg_cpu_f2u(v));
    }
    return dg_cpu_u2f(sign | ((e + 112u) << 23) | (m << 13));
}

#endif
