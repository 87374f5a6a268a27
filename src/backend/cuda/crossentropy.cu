/* crossentropy.cu — the classifier loss: the forward reads each row of logits once (online max and
 * sum of exponentials) and saves the row's logsumexp; the backward turns logits into dlogits in place
 * (it may alias them), so logits are never materialised twice nor in f32. The fused op (contract v1.10,
 * graph op crossentropy_fused) does both for a row in one block, reading the row from DRAM once.
 *
 * One block of CE_THREADS per row; reductions go lane -> warp -> block in a fixed order (deterministic).
 * A target outside [0, V) gives loss NaN for that row and raises a flag that sync() reports.
 *
 * Arithmetic. bf16/f16 take e^(x - m) as ex2.approx.ftz(x * log2e - m * log2e): one FFMA and one MUFU
 * instruction, against ~10 for an accurate expf (the kernels were issue-bound on those, 2.76 ms for a
 * 6.6 GB op at gpt2-124m B=32). Its error: ex2.approx is within 2^-22 relative; the argument
 * t = fma(x, log2e, -m log2e) carries the rounding of m log2e and of t, ~2^-24 |m log2e| + 2^-24 |t|
 * absolute (|t| <= ~40 here: ~5e-6 absolute, 4e-6 relative after ex2), as large as the rounding of
 * x - m in the accurate expf(x - m). Both are far below a bf16 (2^-9) or f16 (2^-12) half-ulp of the
 * stored dlogits and the 2e-2 / 5e-3 (bf16 / f16) bounds of the harness; the flush of results below
 * 2^-126 to 0 only touches gradients that round to (near) zero anyway. f32, the exact reference mode
 * compared tightly with the CPU backend, keeps expf. The block-level combine and log(sum) stay accurate
 * (a few per row).
 *
 * Bitwise contract of the fused op: its losses, lse and dlogits are those of the forward kernel followed
 * by the backward kernel (the pair, which is also the reference the tests hold it to). All kernels give
 * thread tid the vectors k = 0, 1, ... at columns tid*V + k*CE_THREADS*V (V = 16 bytes of elements where
 * Vp is a multiple of it and the logits are 16-byte aligned, else V = 1), update the running (max, sum)
 * once per vector in k order with the same code (ce_upd), reduce with ce_block_lse, and compute each
 * element's gradient with ce_grad (the vector form skips the target and padding tests only where they
 * are known false, which gives the same bits). The fused kernels differ only in where a thread keeps its
 * vectors between the two passes, so they all give the same bits. The gradient is elementwise: the store
 * width (dlogits' alignment) does not matter for the values.
 *
 * The fused kernels (ce_fused16; the measurements that chose them: docs/cuda.md, "Why these
 * implementations"):
 *   hybrid   bf16/f16: 4 vectors per thread in registers, the rest of the row staged in shared memory:
 *            the whole row on chip at 3 blocks per SM (gpt2's rows), one DRAM read and one write;
 *   twopass  f32, and bf16/f16 rows beyond the opt-in shared memory (the same bits): the block re-reads
 *            its row from global memory for the gradient (L1/L2 hits while it stays there);
 *   V = 1    (logits not 16-byte aligned, Vp not a multiple of 16 bytes): the scalar two-pass kernel.
 */
#include <string.h>

#include "cuda_impl.cuh"
#include "cuda_vec.cuh"

#define CE_THREADS 512
/* shared memory the fused kernel keeps for itself besides the staged row (its static arrays), and the
 * margin below the opt-in limit it leaves for the runtime's own reservation */
#define CE_SMEM_SLACK 1024
/* vectors a thread loads from global memory before it uses the first: loads in flight per thread */
#define CE_U 2
/* vectors per thread the hybrid kernel holds in registers */
#define CE_KR_HYB 4
#define CE_LOG2E 1.4426950408889634f

static __device__ __forceinline__ float ce_ex2(float t) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(t));
    return y;
}

static __device__ __forceinline__ void lse_combine(float &m, float &s, float m2, float s2) {
    const float M = fmaxf(m, m2);
    if (M == -INFINITY) return; /* both empty */
    s = s * expf(m - M) + s2 * expf(m2 - M);
    m = M;
}

/* A thread's running max m, sum s of e^(x - m), and mL = m * log2e (FAST only). The updates use
 * explicit roundings (__fadd_rn, __fmul_rn) so no kernel's context can contract them differently. */
struct ce_acc {
    float m, s, mL;
};
static __device__ __forceinline__ void ce_acc_init(ce_acc &a) {
    a.m = -INFINITY;
    a.s = 0.f;
    a.mL = -INFINITY;
}

/* One vector (the first nv of its V elements): one rescale where its max is new, then V exponentials. */
template <bool FAST, int V>
static __device__ __forceinline__ void ce_upd(ce_acc &a, const float (&f)[V], int nv) {
    float vm = -INFINITY;
#pragma unroll
    for (int j = 0; j < V; j++)
        if (j < nv) vm = fmaxf(vm, f[j]);
    if (vm > a.m) {
        if (FAST) {
            const float vL = __fmul_rn(vm, CE_LOG2E);
            a.s = __fmul_rn(a.s, ce_ex2(__fsub_rn(a.mL, vL)));
            a.mL = vL;
        } else {
            a.s = __fmul_rn(a.s, expf(a.m - vm));
        }
        a.m = vm;
    }
#pragma unroll
    for (int j = 0; j < V; j++)
        if (j < nv) a.s = __fadd_rn(a.s, FAST ? ce_ex2(fmaf(f[j], CE_LOG2E, -a.mL)) : expf(f[j] - a.m));
}

/* softmax of x given the row's logsumexp l (lL = l * log2e) */
template <bool FAST> static __device__ __forceinline__ float ce_p(float x, float l, float lL) {
    return FAST ? ce_ex2(fmaf(x, CE_LOG2E, -lL)) : expf(x - l);
}
/* d loss / d logit of column col: (softmax - onehot) * dloss inside the vocabulary, 0 in the padding. A
 * target outside [0, Vv) matches no column. */
template <bool FAST>
static __device__ __forceinline__ float ce_grad(float x, int col, int Vv, int t, float l, float lL,
                                                float dloss) {
    return col < Vv ? __fmul_rn(__fsub_rn(ce_p<FAST>(x, l, lL), col == t ? 1.f : 0.f), dloss) : 0.f;
}

/* ---- 16-byte vectors kept packed (V = 8 bf16/f16 or 4 f32) ---- */
template <typename T> struct ce_v { static constexpr int V = 16 / (int)sizeof(T); };
static __device__ __forceinline__ void ce_unpack(float (&f)[8], const uint4 &u, dg_bf16 *) {
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) { /* bf16 -> f32 is the high half of the word: a shift or a mask */
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
static __device__ __forceinline__ void ce_unpack(float (&f)[8], const uint4 &u, dg_f16 *) {
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        __half2 h;
        memcpy(&h, &w[i], 4);
        const float2 p = __half22float2(h);
        f[2 * i] = p.x;
        f[2 * i + 1] = p.y;
    }
}
static __device__ __forceinline__ void ce_unpack(float (&f)[4], const uint4 &u, float *) {
    f[0] = __uint_as_float(u.x);
    f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z);
    f[3] = __uint_as_float(u.w);
}
/* round to nearest even, as dg_from_f (the scalar path's stores) */
template <typename T> static __device__ __forceinline__ uint4 ce_pack(const float (&f)[8], T *) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        w[i] = dg_pack2(f[2 * i], f[2 * i + 1], (T *)nullptr);
    return make_uint4(w[0], w[1], w[2], w[3]);
}
static __device__ __forceinline__ uint4 ce_pack(const float (&f)[4], float *) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
}

template <typename T> static __device__ __forceinline__ uint4 ce_ld(const T *p) {
    return *reinterpret_cast<const uint4 *>(p);
}
/* 16-byte store where dlogits is 16-byte aligned (wvec), else element by element */
template <typename T> static __device__ __forceinline__ void ce_st(T *p, const uint4 &o, int wvec) {
    if (wvec) {
        *reinterpret_cast<uint4 *>(p) = o;
    } else {
        const unsigned w[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
        for (int j = 0; j < ce_v<T>::V; j++)
            memcpy(p + j, reinterpret_cast<const unsigned char *>(w) + j * sizeof(T), sizeof(T));
    }
}

/* the vector at column c in the running (max, sum): no per-element tests unless it holds Vv */
template <typename T, bool FAST>
static __device__ __forceinline__ void ce_upd16(ce_acc &a, const uint4 &u, int c, int Vv) {
    constexpr int V = ce_v<T>::V;
    float f[V];
    ce_unpack(f, u, (T *)nullptr);
    if (c + V <= Vv)
        ce_upd<FAST, V>(a, f, V);
    else
        ce_upd<FAST, V>(a, f, Vv - c);
}
/* the gradient of the vector at column c (c < Vv): the target and padding tests only in the vector that
 * holds the target or Vv (elsewhere (p - 0) * dloss == p * dloss: the same bits as ce_grad) */
template <typename T, bool FAST>
static __device__ __forceinline__ uint4 ce_grad16(const uint4 &u, int c, int Vv, int t, float l, float lL,
                                                  float dloss) {
    constexpr int V = ce_v<T>::V;
    float f[V];
    ce_unpack(f, u, (T *)nullptr);
    if (c + V <= Vv && (unsigned)t - (unsigned)c >= (unsigned)V) {
#pragma unroll
        for (int j = 0; j < V; j++)
            f[j] = __fmul_rn(ce_p<FAST>(f[j], l, lL), dloss);
    } else {
#pragma unroll
        for (int j = 0; j < V; j++)
            f[j] = ce_grad<FAST>(f[j], c + j, Vv, t, l, lL, dloss);
    }
    return ce_pack(f, (T *)nullptr);
}

/* the CE_U vectors k .. k + CE_U - 1 (those below n) of this thread (from column c0, stride S) into b */
template <typename T>
static __device__ __forceinline__ void ce_load_u(uint4 (&b)[CE_U], const T *g, int c0, int k, int n) {
    constexpr int S = CE_THREADS * ce_v<T>::V;
#pragma unroll
    for (int i = 0; i < CE_U; i++)
        if (k + i < n) b[i] = ce_ld(g + c0 + (k + i) * S);
}

/* how many of a thread's vectors (from column c0, stride S) start below n */
static __device__ __forceinline__ int ce_nvec(int c0, int n, int S) {
    return c0 < n ? (n - c0 + S - 1) / S : 0;
}

/* vectors k0 .. n-1 of this thread from global memory into the running (max, sum), CE_U loads at a time */
template <typename T, bool FAST>
static __device__ __forceinline__ void ce_lse_global(ce_acc &a, const T *g, int c0, int k0, int n, int Vv) {
    constexpr int S = CE_THREADS * ce_v<T>::V;
#pragma unroll 1
    for (int k = k0; k < n; k += CE_U) {
        uint4 b[CE_U];
        ce_load_u(b, g, c0, k, n);
#pragma unroll
        for (int i = 0; i < CE_U; i++)
            if (k + i < n) ce_upd16<T, FAST>(a, b[i], c0 + (k + i) * S, Vv);
    }
}
/* the gradient of vectors k0 .. ns-1 (those from nr on are padding: 0, not read), re-read from g */
template <typename T, bool FAST>
static __device__ __forceinline__ void ce_grad_global(T *d, const T *g, int c0, int k0, int nr, int ns,
                                                      int Vv, int t, float l, float lL, float dloss,
                                                      int wvec) {
    constexpr int S = CE_THREADS * ce_v<T>::V;
#pragma unroll 1
    for (int k = k0; k < ns; k += CE_U) {
        uint4 b[CE_U];
        ce_load_u(b, g, c0, k, nr);
#pragma unroll
        for (int i = 0; i < CE_U; i++) {
            const int c = c0 + (k + i) * S;
            if (k + i < ns)
                ce_st(d + c,
                      k + i < nr ? ce_grad16<T, FAST>(b[i], c, Vv, t, l, lL, dloss) : make_uint4(0, 0, 0, 0),
                      wvec);
        }
    }
}

/* The block's (max, sum): shuffle tree within each warp, then warp 0 over the warps' partials (shm, shs:
 * 32 floats each). The result is valid in lane 0 of warp 0 only; returns 1 there. */
static __device__ __forceinline__ int ce_block_lse(float &m, float &s, float *shm, float *shs) {
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_down_sync(0xffffffffu, m, o), s2 = __shfl_down_sync(0xffffffffu, s, o);
        lse_combine(m, s, m2, s2);
    }
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    if (lane == 0) {
        shm[wid] = m;
        shs[wid] = s;
    }
    __syncthreads();
    if (wid != 0) return 0;
    const int nw = blockDim.x >> 5;
    m = lane < nw ? shm[lane] : -INFINITY;
    s = lane < nw ? shs[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_down_sync(0xffffffffu, m, o), s2 = __shfl_down_sync(0xffffffffu, s, o);
        lse_combine(m, s, m2, s2);
    }
    return lane == 0;
}

/* lse and loss of a row, given its logsumexp l, its target logit read through x (lane 0 of warp 0) */
template <typename T>
static __device__ __forceinline__ void ce_row_out(float *losses, float *lse_out, int row, float l, const T *x,
                                                  const int32_t *targets, int Vv, int *err) {
    lse_out[row] = l;
    const int t = targets[row];
    if (t < 0 || t >= Vv) {
        atomicOr(err, DG_CUDA_EF_TARGET);
        losses[row] = __int_as_float(0x7fc00000);
    } else {
        losses[row] = l - dg_to_f(x[t]);
    }
}

/* ce_row_out of the block's logsumexp (thread 0, reading the target logit before any store), then that
 * logsumexp for every thread of the block, through the shared shl */
template <typename T>
static __device__ __forceinline__ float ce_row_lse_shared(ce_acc &a, float *shm, float *shs, float &shl,
                                                          float *losses, float *lse_out, int row, const T *x,
                                                          const int32_t *targets, int Vv, int *err) {
    if (ce_block_lse(a.m, a.s, shm, shs)) {
        const float l = a.m + logf(a.s);
        ce_row_out(losses, lse_out, row, l, x, targets, Vv, err);
        shl = l;
    }
    __syncthreads();
    return shl;
}

/* ---- V = 1 (logits not 16-byte aligned, or Vp not a multiple of 16 bytes): element by element ---- */
template <typename T, bool FAST>
static __device__ __forceinline__ void ce_lse1(ce_acc &a, const T *x, int Vv) {
    for (int c = threadIdx.x; c < Vv; c += CE_THREADS) {
        const float f[1] = {dg_to_f(x[c])};
        ce_upd<FAST, 1>(a, f, 1);
    }
}

template <typename T, bool FAST>
__global__ void __launch_bounds__(CE_THREADS)
    ce_fwd1_kernel(float *losses, float *lse_out, const T *logits, const int32_t *targets, int Vv, int Vp,
                   int *err) {
    __shared__ float shm[32], shs[32];
    const int row = blockIdx.x;
    const T *x = logits + (size_t)row * Vp;
    ce_acc a;
    ce_acc_init(a);
    ce_lse1<T, FAST>(a, x, Vv);
    if (ce_block_lse(a.m, a.s, shm, shs))
        ce_row_out(losses, lse_out, row, a.m + logf(a.s), x, targets, Vv, err);
}

template <typename T, bool FAST>
__global__ void __launch_bounds__(CE_THREADS)
    ce_bwd1_kernel(T *dlogits, const T *logits, const float *lse, const int32_t *targets, int Vv, int Vp,
                   float dloss) {
    const int row = blockIdx.x;
    const T *x = logits + (size_t)row * Vp;
    T *d = dlogits + (size_t)row * Vp;
    const float l = lse[row], lL = __fmul_rn(l, CE_LOG2E);
    const int t = targets[row];
    for (int c = threadIdx.x; c < Vp; c += CE_THREADS)
        d[c] = dg_from_f<T>(c < Vv ? ce_grad<FAST>(dg_to_f(x[c]), c, Vv, t, l, lL, dloss) : 0.f);
}

/* fused, V = 1: the two-pass form (the row re-read from global memory) */
template <typename T, bool FAST>
__global__ void __launch_bounds__(CE_THREADS)
    ce_fused1_kernel(float *losses, float *lse_out, T *dlogits, const T *logits, const int32_t *targets,
                     int N, int Vv, int Vp, float dloss, int *err) {
    __shared__ float shm[32], shs[32], shl;
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        const T *x = logits + (size_t)row * Vp;
        T *d = dlogits + (size_t)row * Vp;
        ce_acc a;
        ce_acc_init(a);
        ce_lse1<T, FAST>(a, x, Vv);
        const int t = targets[row];
        const float l = ce_row_lse_shared(a, shm, shs, shl, losses, lse_out, row, x, targets, Vv, err),
                    lL = __fmul_rn(l, CE_LOG2E);
        for (int c = threadIdx.x; c < Vp; c += CE_THREADS)
            d[c] = dg_from_f<T>(c < Vv ? ce_grad<FAST>(dg_to_f(x[c]), c, Vv, t, l, lL, dloss) : 0.f);
    }
}

/* ---- 16-byte vectors ---- */
template <typename T, bool FAST>
__global__ void __launch_bounds__(CE_THREADS, 4)
    ce_fwd16_kernel(float *losses, float *lse_out, const T *logits, const int32_t *targets, int Vv, int Vp,
                    int *err) {
    __shared__ float shm[32], shs[32];
    constexpr int V = ce_v<T>::V;
    const int row = blockIdx.x, c0 = threadIdx.x * V;
    const T *g = logits + (size_t)row * Vp;
    ce_acc a;
    ce_acc_init(a);
    ce_lse_global<T, FAST>(a, g, c0, 0, ce_nvec(c0, Vv, CE_THREADS * V), Vv);
    if (ce_block_lse(a.m, a.s, shm, shs))
        ce_row_out(losses, lse_out, row, a.m + logf(a.s), g, targets, Vv, err);
}

/* logits 16-byte aligned (the forward's vector columns); dlogits stored 16 bytes at a time if aligned */
template <typename T, bool FAST>
__global__ void __launch_bounds__(CE_THREADS, 4)
    ce_bwd16_kernel(T *dlogits, const T *logits, const float *lse, const int32_t *targets, int Vv, int Vp,
                    float dloss, int wvec) {
    constexpr int V = ce_v<T>::V, S = CE_THREADS * V;
    const int row = blockIdx.x, c0 = threadIdx.x * V;
    const float l = lse[row], lL = __fmul_rn(l, CE_LOG2E);
    ce_grad_global<T, FAST>(dlogits + (size_t)row * Vp, logits + (size_t)row * Vp, c0, 0, ce_nvec(c0, Vv, S),
                            ce_nvec(c0, Vp, S), Vv, targets[row], l, lL, dloss, wvec);
}

/* ---- the fused forward + backward (contract v1.10), 16-byte vectors ----
 *
 * A thread's vectors k < KR live in registers (packed, 4 registers each), loaded all at once before the
 * reduction; with STAGE the others are copied into shared memory with cp.async (16 bytes per instruction,
 * all in flight at once, no registers held); without, they are read from global memory for the reduction
 * and again for the gradient (CE_U loads in flight per thread). Each thread reads back only what it loaded
 * itself, so the copy needs a cp.async wait but no barrier. Either way one DRAM read and one write of the
 * row where the re-reads hit L1/L2.
 *
 * Two instantiations run: hybrid (KR = 4 plus the staged rest, STAGE, 3 blocks per SM: gpt2's whole bf16/f16
 * row on chip at 66 KB of shared memory per block) and twopass (KR = 0, no STAGE, 4 blocks per SM: the
 * re-read hits L1, which its carveout prefers, or L2).
 *
 * The launch gives one block per row; the kernels keep the grid-stride loop over rows they were measured
 * with (it runs once). Across the barrier the row's lse travels in shl; a next row's first write of shl
 * would come after a barrier that every thread reaches only after reading it. */
template <typename T, bool FAST, int KR, bool STAGE, int MINB>
__global__ void __launch_bounds__(CE_THREADS, MINB)
    ce_fused16_kernel(float *losses, float *lse_out, T *dlogits, const T *logits, const int32_t *targets,
                      int N, int Vv, int Vp, float dloss, int wvec, int *err) {
    extern __shared__ __align__(16) unsigned char ce_stage[];
    __shared__ float shm[32], shs[32], shl;
    constexpr int V = ce_v<T>::V, S = CE_THREADS * V;
    const int tid = threadIdx.x, c0 = tid * V;
    const int nr = ce_nvec(c0, Vv, S), ns = ce_nvec(c0, Vp, S); /* vectors read; vectors stored */
    uint4 *sx = reinterpret_cast<uint4 *>(ce_stage) + tid;      /* slot of vector k: sx[(k - KR) * THREADS] */
#pragma unroll 1
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        const T *g = logits + (size_t)row * Vp;
        T *d = dlogits + (size_t)row * Vp;
        uint4 r[KR > 0 ? KR : 1];
#pragma unroll
        for (int k = 0; k < KR; k++)
            if (k < nr) r[k] = ce_ld(g + c0 + k * S);
        if constexpr (STAGE) {
#pragma unroll 1
            for (int k = KR; k < nr; k++) {
                const unsigned sa = (unsigned)__cvta_generic_to_shared(sx + (k - KR) * CE_THREADS);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa),
                             "l"(__cvta_generic_to_global(g + c0 + k * S)));
            }
        }
        ce_acc a;
        ce_acc_init(a);
#pragma unroll
        for (int k = 0; k < KR; k++)
            if (k < nr) ce_upd16<T, FAST>(a, r[k], c0 + k * S, Vv);
        if constexpr (STAGE) {
            asm volatile("cp.async.wait_all;\n" ::: "memory");
#pragma unroll 1
            for (int k = KR; k < nr; k++)
                ce_upd16<T, FAST>(a, sx[(k - KR) * CE_THREADS], c0 + k * S, Vv);
        } else {
            ce_lse_global<T, FAST>(a, g, c0, KR, nr, Vv);
        }
        const float l = ce_row_lse_shared(a, shm, shs, shl, losses, lse_out, row, g, targets, Vv, err),
                    lL = __fmul_rn(l, CE_LOG2E);
        const int t = targets[row];
#pragma unroll
        for (int k = 0; k < KR; k++) {
            const int c = c0 + k * S;
            if (k < ns)
                ce_st(d + c,
                      k < nr ? ce_grad16<T, FAST>(r[k], c, Vv, t, l, lL, dloss) : make_uint4(0, 0, 0, 0),
                      wvec);
        }
        if constexpr (STAGE) {
#pragma unroll 1
            for (int k = KR; k < ns; k++) {
                const int c = c0 + k * S;
                ce_st(d + c,
                      k < nr ? ce_grad16<T, FAST>(sx[(k - KR) * CE_THREADS], c, Vv, t, l, lL, dloss)
                             : make_uint4(0, 0, 0, 0),
                      wvec);
            }
        } else {
            ce_grad_global<T, FAST>(d, g, c0, KR, nr, ns, Vv, t, l, lL, dloss, wvec);
        }
    }
}

/* ---- host side ---- */

template <typename T, bool FAST>
static dg_status_t ce_fwd_launch(dg_cuda_t *c, float *losses, float *lse, const void *logits,
                                 const int32_t *targets, int N, int V, int Vp) {
    if (Vp % ce_v<T>::V == 0 && dg_ptr_aligned(logits, 16))
        ce_fwd16_kernel<T, FAST>
            <<<N, CE_THREADS, 0, c->stream>>>(losses, lse, (const T *)logits, targets, V, Vp, c->err_dev);
    else
        ce_fwd1_kernel<T, FAST>
            <<<N, CE_THREADS, 0, c->stream>>>(losses, lse, (const T *)logits, targets, V, Vp, c->err_dev);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

/* The cheap exponential for bf16/f16, expf for f32 (see the header). */
template <typename T> struct ce_fast { static constexpr bool value = sizeof(T) == 2; };

template <typename T>
static dg_status_t ce_fwd_t(dg_cuda_t *c, float *losses, float *lse, const void *logits,
                            const int32_t *targets, int N, int V, int Vp) {
    return ce_fwd_launch<T, ce_fast<T>::value>(c, losses, lse, logits, targets, N, V, Vp);
}

template <typename T, bool FAST>
static dg_status_t ce_bwd_launch(dg_cuda_t *c, void *dlogits, const void *logits, const float *lse,
                                 const int32_t *targets, int N, int V, int Vp, float dloss) {
    if (Vp % ce_v<T>::V == 0 && dg_ptr_aligned(logits, 16))
        ce_bwd16_kernel<T, FAST><<<N, CE_THREADS, 0, c->stream>>>(
            (T *)dlogits, (const T *)logits, lse, targets, V, Vp, dloss, dg_ptr_aligned(dlogits, 16));
    else
        ce_bwd1_kernel<T, FAST>
            <<<N, CE_THREADS, 0, c->stream>>>((T *)dlogits, (const T *)logits, lse, targets, V, Vp, dloss);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

template <typename T>
static dg_status_t ce_bwd_t(dg_cuda_t *c, void *dlogits, const void *logits, const float *lse,
                            const int32_t *targets, int N, int V, int Vp, float dloss) {
    return ce_bwd_launch<T, ce_fast<T>::value>(c, dlogits, logits, lse, targets, N, V, Vp, dloss);
}

template <typename T, bool FAST, int KR, bool STAGE, int MINB>
static dg_status_t ce_fused16_go(dg_cuda_t *c, size_t smem, float *losses, float *lse, void *dlogits,
                                 const void *logits, const int32_t *targets, int N, int Vv, int Vp,
                                 float dloss) {
    auto *fn = ce_fused16_kernel<T, FAST, KR, STAGE, MINB>;
    /* Function attributes once per kernel and device (the first, eager launch; not again while a graph
     * is being captured): a staged kernel may take up to the opt-in limit and wants the largest
     * shared-memory carveout (blocks per SM); a kernel without a staged row re-reads it and wants as much
     * L1 as possible for those hits. */
    static unsigned done; /* bit d: device d */
    const unsigned bit = c->device < 32 ? 1u << c->device : 0u;
    if (!(done & bit)) {
        if (STAGE) {
            DG_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)(c->smem_optin - CE_SMEM_SLACK)));
            DG_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                                               (int)cudaSharedmemCarveoutMaxShared));
        } else {
            DG_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                                               (int)cudaSharedmemCarveoutMaxL1));
        }
        done |= bit;
    }
    fn<<<(unsigned)N, CE_THREADS, smem, c->stream>>>(losses, lse, (T *)dlogits, (const T *)logits, targets, N,
                                                     Vv, Vp, dloss, dg_ptr_aligned(dlogits, 16), c->err_dev);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

template <typename T, bool FAST>
static dg_status_t ce_fused_launch(dg_cuda_t *c, float *losses, float *lse, void *dlogits, const void *logits,
                                   const int32_t *targets, int N, int Vv, int Vp, float dloss) {
    constexpr int V = ce_v<T>::V;
    /* the forward's vector width (the reduction order depends on it), not the backward's */
    if (Vp % V != 0 || !dg_ptr_aligned(logits, 16)) {
        ce_fused1_kernel<T, FAST><<<(unsigned)N, CE_THREADS, 0, c->stream>>>(
            losses, lse, (T *)dlogits, (const T *)logits, targets, N, Vv, Vp, dloss, c->err_dev);
        DG_CUDA_LAUNCH_CHECK();
        return DG_OK;
    }
    if constexpr (sizeof(T) == 2) {
        /* staged bytes: the vectors that start below Vv, less the CE_KR_HYB per thread kept in registers */
        const long nvec = (Vv + V - 1) / V;
        const size_t stage =
            nvec > (long)CE_KR_HYB * CE_THREADS ? (size_t)(nvec - (long)CE_KR_HYB * CE_THREADS) * 16 : 0;
        if (stage + CE_SMEM_SLACK <= c->smem_optin) /* else twopass: the same bits */
            return ce_fused16_go<T, FAST, CE_KR_HYB, true, 3>(c, stage, losses, lse, dlogits, logits, targets,
                                                              N, Vv, Vp, dloss);
    }
    return ce_fused16_go<T, FAST, 0, false, 4>(c, 0, losses, lse, dlogits, logits, targets, N, Vv, Vp, dloss);
}

template <typename T>
static dg_status_t ce_fused_t(dg_cuda_t *c, float *losses, float *lse, void *dlogits, const void *logits,
                              const int32_t *targets, int N, int V, int Vp, float dloss) {
    return ce_fused_launch<T, ce_fast<T>::value>(c, losses, lse, dlogits, logits, targets, N, V, Vp, dloss);
}

dg_status_t dg_cuda_crossentropy_fwd(dg_cuda_t *c, float *losses, float *lse, const void *logits,
                                     const int32_t *targets, int N, int V, int Vp) {
    return DG_CUDA_DISPATCH_ACT(c->act, ce_fwd_t, c, losses, lse, logits, targets, N, V, Vp);
}

dg_status_t dg_cuda_crossentropy_bwd(dg_cuda_t *c, void *dlogits, const void *logits, const float *lse,
                                     const int32_t *targets, int N, int V, int Vp, float dloss) {
    return DG_CUDA_DISPATCH_ACT(c->act, ce_bwd_t, c, dlogits, logits, lse, targets, N, V, Vp, dloss);
}

dg_status_t dg_cuda_crossentropy_fused(dg_cuda_t *c, float *losses, float *lse, void *dlogits,
                                       const void *logits, const int32_t *targets, int N, int V, int Vp,
                                       float dloss) {
    return DG_CUDA_DISPATCH_ACT(c->act, ce_fused_t, c, losses, lse, dlogits, logits, targets, N, V, Vp,
                                dloss);
}
