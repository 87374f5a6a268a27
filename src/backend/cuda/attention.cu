/* attention.cu — causal multi-head self-attention that never materialises the T x T matrix: the built-in
 * kernels (bf16/f16 take cuDNN's fused attention first, attn_cudnn.cu, where it serves the shape).
 *
 * aux holds one f32 per (b, h, t): the row's logsumexp (natural log), written by the forward and used by
 * the backward to recompute the probabilities. The backward first computes delta = rowsum(dO ∘ O) into
 * scratch, then runs two passes with no atomics (bitwise reproducible):
 *   - the key/value pass: one block per block of keys loops over the query blocks that see it and
 *     accumulates dK, dV in registers;
 *   - the query pass: one block per block of queries loops over its key blocks and accumulates dQ.
 *
 * Two implementations of the same arithmetic:
 *   - tensor-core kernels (bf16/f16, head size 32 or 64, 16-byte aligned buffers): flash-attention style,
 *     mma.sync m16n8k16 with f32 accumulators, two m-tiles of 16 rows per warp, 128-row blocks streaming
 *     64-row tiles double-buffered in shared memory with cp.async, online softmax in registers
 *     (probabilities are rounded to the activation dtype before the P·V product, as every flash kernel
 *     does): the fallback where cuDNN is absent or cannot plan the shape;
 *   - generic kernels (any dtype, head size <= 256; f32 mode, other head sizes, DG_CUDA_FAST_ATTENTION=0):
 *     one warp per row, 32 keys (or queries) at a time, all arithmetic in f32. They are also the
 *     reference the tests check the tensor-core kernels and cuDNN against (tests/backend_cuda).
 */
#include <type_traits>

#include "cuda_impl.cuh"
#include "cuda_vec.cuh"

#define ATT_LOG2E 1.4426950408889634f
#define ATT_LN2 0.6931471805599453f

size_t dg_cuda_attention_aux_bytes(int B, int T, int C, int NH) {
    (void)C;
    if (B <= 0 || T <= 0 || NH <= 0) return 0;
    return (size_t)B * NH * T * sizeof(float);
}

/* ======================= generic kernels ======================= */

#define GEN_WARPS 4
#define GEN_MAXD 8 /* head size up to 32 * GEN_MAXD */

/* What a generic kernel's warp works on: its warp and lane, (b, h) of blockIdx.y, the head size and its row
 * (a query or a key) of blockIdx.x */
struct GenRow {
    int warp, lane, bh, b, h, HS, row;
};
static __device__ __forceinline__ GenRow gen_row(int C, int NH) {
    const int warp = threadIdx.x >> 5, bh = blockIdx.y;
    return {
        warp, (int)(threadIdx.x & 31), bh, bh / NH, bh % NH, C / NH, (int)(blockIdx.x * GEN_WARPS + warp)};
}

template <typename T>
__global__ void __launch_bounds__(32 * GEN_WARPS)
    attn_fwd_generic(T *out, float *lse, const T *qkv, int Tn, int C, int NH, float scale) {
    __shared__ float qs[GEN_WARPS][32 * GEN_MAXD];
    const auto [warp, lane, bh, b, h, HS, t] = gen_row(C, NH);
    if (t >= Tn) return;
    const size_t C3 = 3 * (size_t)C;
    const T *base = qkv + (size_t)b * Tn * C3 + h * HS;
    float *q = qs[warp];
    for (int d = lane; d < HS; d += 32)
        q[d] = dg_to_f(base[(size_t)t * C3 + d]) * scale;
    __syncwarp();
    float acc[GEN_MAXD];
#pragma unroll
    for (int i = 0; i < GEN_MAXD; i++)
        acc[i] = 0.f;
    float m = -INFINITY, l = 0.f;
    for (int j0 = 0; j0 <= t; j0 += 32) {
        const int j = j0 + lane;
        float s = -INFINITY;
        if (j <= t) {
            const T *k = base + (size_t)j * C3 + C;
            float dot = 0.f;
            for (int d = 0; d < HS; d++)
                dot += q[d] * dg_to_f(k[d]);
            s = dot;
        }
        const float mn = fmaxf(m, dg_warp_max(s));
        const float p = j <= t ? expf(s - mn) : 0.f;
        const float corr = expf(m - mn);
        l = l * corr + dg_warp_sum(p);
#pragma unroll
        for (int i = 0; i < GEN_MAXD; i++)
            acc[i] *= corr;
        const int jn = min(32, t - j0 + 1);
        for (int jj = 0; jj < jn; jj++) {
            const float pj = __shfl_sync(0xffffffffu, p, jj);
            const T *v = base + (size_t)(j0 + jj) * C3 + 2 * C;
#pragma unroll
            for (int i = 0; i < GEN_MAXD; i++) {
                const int d = lane + 32 * i;
                if (d < HS) acc[i] += pj * dg_to_f(v[d]);
            }
        }
        m = mn;
    }
    T *o = out + ((size_t)b * Tn + t) * C + h * HS;
    const float inv = 1.f / l;
#pragma unroll
    for (int i = 0; i < GEN_MAXD; i++) {
        const int d = lane + 32 * i;
        if (d < HS) o[d] = dg_from_f<T>(acc[i] * inv);
    }
    if (lane == 0) lse[(size_t)bh * Tn + t] = m + logf(l);
}

/* delta[bh, t] = sum_d dO[b,t,h,d] * O[b,t,h,d] */
template <typename T>
__global__ void __launch_bounds__(32 * GEN_WARPS)
    attn_delta_kernel(float *delta, const T *dout, const T *out, int Tn, int C, int NH) {
    const auto [warp, lane, bh, b, h, HS, t] = gen_row(C, NH);
    if (t >= Tn) return;
    const size_t off = ((size_t)b * Tn + t) * C + h * HS;
    float s = 0.f;
    for (int d = lane; d < HS; d += 32)
        s += dg_to_f(dout[off + d]) * dg_to_f(out[off + d]);
    s = dg_warp_sum(s);
    if (lane == 0) delta[(size_t)bh * Tn + t] = s;
}

/* The generic backward, one warp per row: KV = false, dQ (the row a query); KV = true, dK and dV (the row a
 * key, looping over the queries t >= j). */
template <typename T, bool KV>
__global__ void __launch_bounds__(32 * GEN_WARPS)
    attn_bwd_generic(T *dqkv, const T *dout, const T *qkv, const float *lse, const float *delta, int Tn,
                     int C, int NH, float scale) {
    __shared__ float sa[GEN_WARPS][32 * GEN_MAXD], sb[GEN_WARPS][32 * GEN_MAXD];
    const auto [warp, lane, bh, b, h, HS, row] = gen_row(C, NH);
    if (row >= Tn) return;
    const size_t C3 = 3 * (size_t)C;
    const T *base = qkv + (size_t)b * Tn * C3 + h * HS;
    if constexpr (!KV) {
        const int t = row;
        const T *dob = dout + ((size_t)b * Tn + t) * C + h * HS;
        float *q = sa[warp], *dov = sb[warp];
        for (int d = lane; d < HS; d += 32) {
            q[d] = dg_to_f(base[(size_t)t * C3 + d]) * scale;
            dov[d] = dg_to_f(dob[d]);
        }
        __syncwarp();
        const float L = lse[(size_t)bh * Tn + t], D = delta[(size_t)bh * Tn + t];
        float dq[GEN_MAXD];
#pragma unroll
        for (int i = 0; i < GEN_MAXD; i++)
            dq[i] = 0.f;
        for (int j0 = 0; j0 <= t; j0 += 32) {
            const int j = j0 + lane;
            float ds = 0.f;
            if (j <= t) {
                const T *k = base + (size_t)j * C3 + C, *v = base + (size_t)j * C3 + 2 * C;
                float s = 0.f, dp = 0.f;
                for (int d = 0; d < HS; d++) {
                    s += q[d] * dg_to_f(k[d]);
                    dp += dov[d] * dg_to_f(v[d]);
                }
                ds = expf(s - L) * (dp - D);
            }
            const int jn = min(32, t - j0 + 1);
            for (int jj = 0; jj < jn; jj++) {
                const float dsj = __shfl_sync(0xffffffffu, ds, jj);
                const T *k = base + (size_t)(j0 + jj) * C3 + C;
#pragma unroll
                for (int i = 0; i < GEN_MAXD; i++) {
                    const int d = lane + 32 * i;
                    if (d < HS) dq[i] += dsj * dg_to_f(k[d]);
                }
            }
        }
        T *o = dqkv + ((size_t)b * Tn + t) * C3 + h * HS;
#pragma unroll
        for (int i = 0; i < GEN_MAXD; i++) {
            const int d = lane + 32 * i;
            if (d < HS) o[d] = dg_from_f<T>(dq[i] * scale);
        }
    } else {
        const int j = row;
        const T *dob = dout + (size_t)b * Tn * C + h * HS;
        float *k = sa[warp], *v = sb[warp];
        for (int d = lane; d < HS; d += 32) {
            k[d] = dg_to_f(base[(size_t)j * C3 + C + d]) * scale;
            v[d] = dg_to_f(base[(size_t)j * C3 + 2 * C + d]);
        }
        __syncwarp();
        float dk[GEN_MAXD], dv[GEN_MAXD];
#pragma unroll
        for (int i = 0; i < GEN_MAXD; i++)
            dk[i] = dv[i] = 0.f;
        const float *L = lse + (size_t)bh * Tn, *D = delta + (size_t)bh * Tn;
        for (int t0 = j; t0 < Tn; t0 += 32) {
            const int t = t0 + lane;
            float p = 0.f, ds = 0.f;
            if (t < Tn) {
                const T *q = base + (size_t)t * C3, *dov = dob + (size_t)t * C;
                float s = 0.f, dp = 0.f;
                for (int d = 0; d < HS; d++) {
                    s += k[d] * dg_to_f(q[d]);
                    dp += v[d] * dg_to_f(dov[d]);
                }
                p = expf(s - L[t]);
                ds = p * (dp - D[t]);
            }
            const int tn = min(32, Tn - t0);
            for (int tt = 0; tt < tn; tt++) {
                const float pt = __shfl_sync(0xffffffffu, p, tt), dst = __shfl_sync(0xffffffffu, ds, tt);
                const T *q = base + (size_t)(t0 + tt) * C3, *dov = dob + (size_t)(t0 + tt) * C;
#pragma unroll
                for (int i = 0; i < GEN_MAXD; i++) {
                    const int d = lane + 32 * i;
                    if (d < HS) {
                        dv[i] += pt * dg_to_f(dov[d]);
                        dk[i] += dst * dg_to_f(q[d]);
                    }
                }
            }
        }
        T *o = dqkv + ((size_t)b * Tn + j) * C3 + h * HS;
#pragma unroll
        for (int i = 0; i < GEN_MAXD; i++) {
            const int d = lane + 32 * i;
            if (d < HS) {
                o[C + d] = dg_from_f<T>(dk[i] * scale);
                o[2 * C + d] = dg_from_f<T>(dv[i]);
            }
        }
    }
}

/* ======================= tensor-core kernels ======================= */

/* bf16/f16, head size 32 or 64, 16-byte aligned buffers. The arithmetic of the generic kernels in f32
 * accumulators (exp2 with log2(e) folded into the scale; the probabilities rounded to the activation dtype
 * before they enter an MMA, as every flash kernel does; P kept in registers as the A operand of the next
 * MMA), on mma.sync m16n8k16. Each warp owns MMA_MT = 2 m-tiles (32 rows), so every fragment read from
 * shared memory with ldmatrix feeds two MMAs. Blocks are 4 warps = 128 rows; the other side streams in
 * tiles of 64 rows (cp.async, double-buffered).
 *   forward: Q fragments in registers (32 regs at head size 64), O 64, S of a 32 x 64 tile 64;
 *   backward: one launch runs both passes (alternate blocks), 73 KiB of dynamic shared memory each:
 *     key/value pass: the block's 128 K and V rows stay in shared memory (A operands via ldmatrix);
 *       registers hold dK, dV (128) and Sᵀ, dPᵀ of half a query tile (32 x 32: 64);
 *     query pass: Q fragments (32) in registers, the block's 128 dO rows in shared memory; registers
 *       also hold dQ (64) and S, dP of half a key tile (64);
 *     in both passes the two halves of a streamed tile are unrolled (ptxas overlaps one half's MMAs with
 *     the other's exponentials).
 * Causal load balance: within each head the heaviest blocks have the lowest blockIdx.x (they start
 * first). No atomics; every sum has a fixed order, so results are bitwise reproducible.
 *
 * Instructions per score, which bound these kernels more than the MMAs do: 2^x is one ex2.approx.ftz
 * (exp2f wraps the same instruction in a denormal-range fix-up: 3 more instructions); the mask tests are
 * compiled only into a separate copy of the softmax / probability code for tiles that cross the diagonal
 * (MmaMasked<true>) and test the causal condition only. Keys or queries past Tn need no test of their
 * own: a valid row never sees a key past Tn (it is after the row), rows past Tn are never stored, and a
 * query past Tn adds exactly zero to dK and dV (its Q and dO rows are zero-filled, its logsumexp and
 * delta read as 0, so P = 1 and dS = 0 for it). Registers (ptxas, sm_90, head size 64): forward 254,
 * backward 255, no spills. The measurements behind this form: docs/cuda.md, "Why these implementations". */
#define MMA_MT 2                      /* m-tiles (of 16 rows) per warp */
#define MMA_NW 4                      /* warps per block */
#define MMA_BR (16 * MMA_MT * MMA_NW) /* 128 rows per block */
#define MMA_BC 64                     /* rows per streamed tile */

/* d += a * b, one m16n8k16 tensor-core product of T (bf16 or f16) inputs with f32 accumulators. */
#define MMA_SYNC(TY)                                                                                         \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "    \
                 "{%8,%9}, {%0,%1,%2,%3};\n"                                                                 \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                            \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <typename T> struct MmaOp {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
        if constexpr (std::is_same<T, dg_bf16>::value)
            MMA_SYNC("bf16");
        else
            MMA_SYNC("f16");
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        return dg_pack2(lo, hi, (T *)nullptr);
    }
};

static __device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    const int n = valid ? 16 : 0; /* 0 bytes read: the 16 destination bytes are zero-filled */
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s),
                 "l"(__cvta_generic_to_global(gmem)), "r"(n));
}
/* 4 bytes (0 read and zero-filled when !valid) */
static __device__ __forceinline__ void cp_async4(void *smem, const void *gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    const int n = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s),
                 "l"(__cvta_generic_to_global(gmem)), "r"(n));
}
static __device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
template <int N> static __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
/* Four 8x8 tiles of 16-bit elements from shared memory: lanes 8i..8i+7 give the row addresses of tile i;
 * register i receives, in each lane, the pair (row lane/4, columns 2*(lane%4), +1) of tile i; with
 * .trans the pair (rows 2*(lane%4), +1; column lane/4). */
#define LDSM_X4(QUAL)                                                                                        \
    asm volatile("ldmatrix.sync.aligned.m8n8.x4" QUAL ".shared.b16 {%0,%1,%2,%3}, [%4];\n"                   \
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                                            \
                 : "r"((unsigned)__cvta_generic_to_shared(p))                                                \
                 : "memory")
static __device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t *p) {
    LDSM_X4("");
}
static __device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const uint16_t *p) {
    LDSM_X4(".trans");
}
#undef LDSM_X4

/* 2^x as one MUFU.EX2 (ex2.approx.ftz: results below 2^-126 flush to zero); exp2f adds a range check and
 * two multiplies around the same instruction for denormal results. */
static __device__ __forceinline__ float ex2_approx_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

static __device__ __forceinline__ uint32_t ld32(const uint16_t *p) {
    return *reinterpret_cast<const uint32_t *>(p);
}

/* A-operand fragments of 16 rows starting at row r (rows >= Tn are zero) of a row-major global matrix. */
template <int HS>
static __device__ __forceinline__ void load_a_frags(uint32_t (&a)[HS / 16][4], const uint16_t *g,
                                                    size_t stride, int r, int Tn) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    const int r0 = r + gq, r1 = r + gq + 8;
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) {
        const int c0 = kk * 16 + 2 * tq;
        a[kk][0] = r0 < Tn ? ld32(g + (size_t)r0 * stride + c0) : 0u;
        a[kk][1] = r1 < Tn ? ld32(g + (size_t)r1 * stride + c0) : 0u;
        a[kk][2] = r0 < Tn ? ld32(g + (size_t)r0 * stride + c0 + 8) : 0u;
        a[kk][3] = r1 < Tn ? ld32(g + (size_t)r1 * stride + c0 + 8) : 0u;
    }
}

template <typename T, int HS>
static __device__ __forceinline__ void store_rows(T *g, size_t stride, int r, int Tn,
                                                  const float (&acc)[HS / 8][4], float s0, float s1) {
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    const int r0 = r + gq, r1 = r + gq + 8;
#pragma unroll
    for (int dt = 0; dt < HS / 8; dt++) {
        const int col = dt * 8 + 2 * tq;
        if (r0 < Tn)
            *reinterpret_cast<uint32_t *>(g + (size_t)r0 * stride + col) =
                MmaOp<T>::pack(acc[dt][0] * s0, acc[dt][1] * s0);
        if (r1 < Tn)
            *reinterpret_cast<uint32_t *>(g + (size_t)r1 * stride + col) =
                MmaOp<T>::pack(acc[dt][2] * s1, acc[dt][3] * s1);
    }
}

template <bool B> struct MmaMasked { static constexpr bool value = B; };
/* f(m, nt, e) for each element of an [MT][NN][4] fragment array (m-tile, n-tile, element), unrolled */
template <int MT, int NN, typename F> static __device__ __forceinline__ void for_frags(F &&f) {
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int nt = 0; nt < NN; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                f(m, nt, e);
}

/* Copy rows [0, ROWS) of a tile (rows >= `valid` zero-filled) of HS 16-bit elements, global row stride
 * `gstride`, into shared memory rows of HS + 8 elements. Thread t always copies chunk t % (HS / 8) of rows
 * t / (HS / 8) + k NT / (HS / 8), so the loop is unrolled and the addresses advance by a constant (no
 * division, no 64-bit multiply per chunk). All NT threads take part. */
template <int HS, int NT, int ROWS>
static __device__ __forceinline__ void tile_load(uint16_t *sm, const uint16_t *g, size_t gstride, int valid) {
    constexpr int CH = HS / 8, LDS = HS + 8, RPI = NT / CH; /* rows per pass of the block */
    static_assert(NT % CH == 0 && ROWS % RPI == 0, "whole passes");
    const int r0 = threadIdx.x / CH, ch = threadIdx.x % CH;
    uint16_t *s = sm + r0 * LDS + ch * 8;
    const uint16_t *p = g + (size_t)r0 * gstride + ch * 8;
    const size_t step = (size_t)RPI * gstride;
#pragma unroll
    for (int k = 0; k < ROWS / RPI; k++) {
        const bool ok = r0 + k * RPI < valid;
        cp_async16(s + k * RPI * LDS, ok ? p : g, ok);
        p += step;
    }
}

/* acc[m][n] (16 x 8 each) = A_m · Bᵀ over k in [0, HS): A_m = areg[m] (register fragments of 16 rows), or
 * with A_SMEM rows of `atile` (mma_abt_s), B = shared-memory rows [0, 8 NN) of `tile` (row stride HS + 8).
 * One ldmatrix.x4 gives the fragments of two n-tiles and feeds 2 MT MMAs. */
template <typename T, int HS, int MT, int NN, bool A_SMEM>
static __device__ __forceinline__ void mma_abt(float (&acc)[MT][NN][4], const uint32_t (*areg)[HS / 16][4],
                                               const uint16_t *atile, const uint16_t *tile) {
    static_assert(NN % 2 == 0, "n-tiles come in pairs");
    constexpr int LDS = HS + 8;
    const int lane = threadIdx.x & 31, mi = lane >> 3, mr = lane & 7;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NN; n++)
            acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) {
        uint32_t a[MT][4];
        if constexpr (A_SMEM) {
#pragma unroll
            for (int m = 0; m < MT; m++)
                ldsm_x4(a[m], atile + (m * 16 + (mi & 1) * 8 + mr) * LDS + kk * 16 + (mi >> 1) * 8);
        }
#pragma unroll
        for (int n = 0; n < NN; n += 2) {
            uint32_t r[4];
            ldsm_x4(r, tile + ((n + (mi >> 1)) * 8 + mr) * LDS + kk * 16 + (mi & 1) * 8);
#pragma unroll
            for (int m = 0; m < MT; m++) {
                const uint32_t(&am)[4] = [&]() -> const uint32_t(&)[4] {
                    if constexpr (A_SMEM)
                        return a[m];
                    else
                        return areg[m][kk];
                }();
                MmaOp<T>::run(acc[m][n], am, r[0], r[1]);
                MmaOp<T>::run(acc[m][n + 1], am, r[2], r[3]);
            }
        }
    }
}
template <typename T, int HS, int MT, int NN>
static __device__ __forceinline__ void mma_abt_r(float (&acc)[MT][NN][4], const uint32_t (&a)[MT][HS / 16][4],
                                                 const uint16_t *tile) {
    mma_abt<T, HS, MT, NN, false>(acc, a, nullptr, tile);
}

/* The same with A read from shared memory too: A_m = rows [16 m, 16 m + 16) of `atile` (row stride
 * HS + 8), loaded one k-step at a time with ldmatrix (matrices: rows 0-7 / 8-15 x columns 0-7 / 8-15 of
 * the k-step give a0 / a1 / a2 / a3). */
template <typename T, int HS, int MT, int NN>
static __device__ __forceinline__ void mma_abt_s(float (&acc)[MT][NN][4], const uint16_t *atile,
                                                 const uint16_t *tile) {
    mma_abt<T, HS, MT, NN, true>(acc, nullptr, atile, tile);
}

/* acc[m] (16 x HS) += P_m · tile rows [0, 16 NK): P_m given as f32 accumulator fragments p[m][2 NK] (16 x
 * 16 NK), reused as A fragments after rounding; B pairs along k are a row apart: ldmatrix.trans. */
template <typename T, int HS, int MT, int NK>
static __device__ __forceinline__ void mma_pv(float (&acc)[MT][HS / 8][4], const float (&p)[MT][2 * NK][4],
                                              const uint16_t *tile) {
    constexpr int LDS = HS + 8;
    const int lane = threadIdx.x & 31, mi = lane >> 3, mr = lane & 7;
#pragma unroll
    for (int kk = 0; kk < NK; kk++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; m++) {
            a[m][0] = MmaOp<T>::pack(p[m][2 * kk][0], p[m][2 * kk][1]);
            a[m][1] = MmaOp<T>::pack(p[m][2 * kk][2], p[m][2 * kk][3]);
            a[m][2] = MmaOp<T>::pack(p[m][2 * kk + 1][0], p[m][2 * kk + 1][1]);
            a[m][3] = MmaOp<T>::pack(p[m][2 * kk + 1][2], p[m][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dt = 0; dt < HS / 8; dt += 2) {
            uint32_t r[4];
            ldsm_x4_t(r, tile + (kk * 16 + (mi & 1) * 8 + mr) * LDS + (dt + (mi >> 1)) * 8);
#pragma unroll
            for (int m = 0; m < MT; m++) {
                MmaOp<T>::run(acc[m][dt], a[m], r[0], r[1]);
                MmaOp<T>::run(acc[m][dt + 1], a[m], r[2], r[3]);
            }
        }
    }
}

template <typename T, int HS>
__global__ void __launch_bounds__(32 * MMA_NW)
    attn_fwd_mma(T *out, float *lse, const T *qkv, int Tn, int C, int NH, float sl2) {
    constexpr int LDS = HS + 8, NT = 32 * MMA_NW, MT = MMA_MT;
    __shared__ __align__(16) uint16_t ks[2][MMA_BC * LDS];
    __shared__ __align__(16) uint16_t vs[2][MMA_BC * LDS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    /* grid = (query blocks, B * NH): the blocks of one head run together (they share its K/V tiles in
     * L2), the longest rows first */
    const int qb = gridDim.x - 1 - blockIdx.x;
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const size_t C3 = 3 * (size_t)C;
    const uint16_t *base = reinterpret_cast<const uint16_t *>(qkv) + (size_t)b * Tn * C3 + h * HS;
    const uint16_t *kg = base + C, *vg = base + 2 * C;
    const int q0 = qb * MMA_BR, qw = q0 + warp * 16 * MT; /* this warp: rows [qw, qw + 32) */

    uint32_t qa[MT][HS / 16][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
        load_a_frags<HS>(qa[m], base, C3, qw + 16 * m, Tn);
    float o[MT][HS / 8][4];
    float mx[MT][2], l[MT][2];
#pragma unroll
    for (int m = 0; m < MT; m++) {
#pragma unroll
        for (int dt = 0; dt < HS / 8; dt++)
            o[m][dt][0] = o[m][dt][1] = o[m][dt][2] = o[m][dt][3] = 0.f;
        mx[m][0] = mx[m][1] = -INFINITY;
        l[m][0] = l[m][1] = 0.f;
    }

    const int nkb = min(q0 + MMA_BR - 1, Tn - 1) / MMA_BC + 1;
    tile_load<HS, NT, MMA_BC>(ks[0], kg, C3, Tn);
    tile_load<HS, NT, MMA_BC>(vs[0], vg, C3, Tn);
    cp_async_commit();
    for (int kb = 0; kb < nkb; kb++) {
        const int buf = kb & 1;
        if (kb + 1 < nkb) {
            const int k1 = (kb + 1) * MMA_BC;
            tile_load<HS, NT, MMA_BC>(ks[buf ^ 1], kg + (size_t)k1 * C3, C3, Tn - k1);
            tile_load<HS, NT, MMA_BC>(vs[buf ^ 1], vg + (size_t)k1 * C3, C3, Tn - k1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int kbase = kb * MMA_BC;
        /* a tile wholly after this warp's last row adds nothing; the barriers stay outside the branch */
        if (kbase <= qw + 16 * MT - 1) {
            float s[MT][MMA_BC / 8][4];
            mma_abt_r<T, HS, MT, MMA_BC / 8>(s, qa, ks[buf]);
            /* masks: some key of the tile after this warp's first row */
            const bool masked = kbase + MMA_BC - 1 > qw;
            const int dkr = kbase + 2 * tq - qw - gq; /* key - row of element (m, nt, e) = dkr + const */
            auto softmax = [&](auto mk) {
#pragma unroll
                for (int m = 0; m < MT; m++) {
                    /* the tile's maximum of the raw scores, scaled afterwards (the scale is positive: the
                     * same value), and the scale folded into the exponent's FFMA: one FMUL less per score */
                    float m0 = -INFINITY, m1 = -INFINITY;
#pragma unroll
                    for (int nt = 0; nt < MMA_BC / 8; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            float v = s[m][nt][e];
                            if (decltype(mk)::value && dkr + nt * 8 + (e & 1) - 16 * m - 8 * (e >> 1) > 0)
                                v = -INFINITY;
                            s[m][nt][e] = v;
                            if (e < 2)
                                m0 = fmaxf(m0, v);
                            else
                                m1 = fmaxf(m1, v);
                        }
                    m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 1));
                    m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 2));
                    m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 1));
                    m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 2));
                    m0 = fmaxf(mx[m][0], m0 * sl2);
                    m1 = fmaxf(mx[m][1], m1 * sl2);
                    /* a row with no visible key yet keeps max -inf: base 0 so nothing becomes NaN */
                    const float b0 = m0 == -INFINITY ? 0.f : m0, b1 = m1 == -INFINITY ? 0.f : m1;
                    const float c0 = ex2_approx_ftz(mx[m][0] - b0), c1 = ex2_approx_ftz(mx[m][1] - b1);
                    mx[m][0] = m0;
                    mx[m][1] = m1;
                    float l0 = l[m][0] * c0, l1 = l[m][1] * c1;
                    /* skipped when no row of the m-tile has a new maximum (every factor is exactly 1, the
                     * products would be the same bits); after the first tiles that is the common case */
                    if (__any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) {
#pragma unroll
                        for (int dt = 0; dt < HS / 8; dt++) {
                            o[m][dt][0] *= c0;
                            o[m][dt][1] *= c0;
                            o[m][dt][2] *= c1;
                            o[m][dt][3] *= c1;
                        }
                    }
#pragma unroll
                    for (int nt = 0; nt < MMA_BC / 8; nt++) {
                        s[m][nt][0] = ex2_approx_ftz(fmaf(s[m][nt][0], sl2, -b0));
                        s[m][nt][1] = ex2_approx_ftz(fmaf(s[m][nt][1], sl2, -b0));
                        s[m][nt][2] = ex2_approx_ftz(fmaf(s[m][nt][2], sl2, -b1));
                        s[m][nt][3] = ex2_approx_ftz(fmaf(s[m][nt][3], sl2, -b1));
                        l0 += s[m][nt][0] + s[m][nt][1];
                        l1 += s[m][nt][2] + s[m][nt][3];
                    }
                    l[m][0] = l0;
                    l[m][1] = l1;
                }
            };
            if (masked)
                softmax(MmaMasked<true>());
            else
                softmax(MmaMasked<false>());
            mma_pv<T, HS, MT, MMA_BC / 16>(o, s, vs[buf]);
        }
        __syncthreads(); /* the next iteration refills the other buffer; the one after, this one */
    }
    T *og = out + (size_t)b * Tn * C + h * HS;
    float *L = lse + (size_t)bh * Tn;
#pragma unroll
    for (int m = 0; m < MT; m++) {
        float l0 = l[m][0], l1 = l[m][1];
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
        const int r = qw + 16 * m, row0 = r + gq, row1 = row0 + 8;
        store_rows<T, HS>(og, C, r, Tn, o[m], 1.f / l0, 1.f / l1);
        if (tq == 0) {
            if (row0 < Tn) L[row0] = (mx[m][0] + log2f(l0)) * ATT_LN2;
            if (row1 < Tn) L[row1] = (mx[m][1] + log2f(l1)) * ATT_LN2;
        }
    }
}

/* Dynamic shared memory of both backward passes: two 128-row blocks (the block's own rows: K and V, or Q
 * and dO), four 64-row streamed tiles (two operands, double-buffered), and two f32 values per streamed row
 * and buffer (the key/value pass's logsumexp and delta). 73 KiB at head size 64. */
template <int HS> struct MmaSmem {
    static constexpr int LDS = HS + 8;
    static constexpr size_t kv =
        (size_t)MMA_BR * LDS; /* elements of the block's 128 rows of K (or V, Q, dO) */
    static constexpr size_t tile = (size_t)MMA_BC * LDS; /* elements of one streamed tile */
    static constexpr size_t bytes = (2 * kv + 4 * tile) * sizeof(uint16_t) + 4 * MMA_BC * sizeof(float);
};

/* The key/value pass's per-query f32 values of one streamed tile (queries q1 + [0, 64)): logsumexp and
 * delta, 0 past Tn, by 4-byte cp.async into the tile's group (no wait before the barrier); the logsumexp
 * is multiplied by log2(e) where it is read. */
static __device__ __forceinline__ void rows_f32(float *lsb, float *dlb, const float *L, const float *D,
                                                int q1, int Tn) {
    if (threadIdx.x < MMA_BC) {
        const int q = q1 + threadIdx.x;
        const bool ok = q < Tn;
        cp_async4(lsb + threadIdx.x, ok ? L + q : L, ok);
        cp_async4(dlb + threadIdx.x, ok ? D + q : D, ok);
    }
}

/* The tensor-core backward of one (b, h): its arguments and the two passes (kv_pass, q_pass) that
 * attn_bwd_mma's blocks run. */
template <typename T, int HS> struct BwdMma {
    using SM = MmaSmem<HS>;
    static constexpr int LDS = HS + 8, NT = 32 * MMA_NW, MT = MMA_MT, HB = MMA_BC / 2;
    T *dqkv;
    const T *dout, *qkv;
    const float *lse, *delta;
    int Tn, C, NH;
    float sl2, scale;

    /* Query pass: the block owns 128 queries, warp w 32 of them; dQ = dS·K accumulates over the key tiles,
     * each processed as two halves of 32 keys (to bound the registers S and dP take). Q fragments stay in
     * registers; the block's dO rows stay in shared memory (the A operand of dP, read with ldmatrix); the
     * first 128-row region of the shared layout (Qb) is left unused. */
    __device__ __forceinline__ void q_pass(unsigned char *mma_smem, int qb, int bh) const {
        uint16_t *Qb = reinterpret_cast<uint16_t *>(mma_smem), *Ob = Qb + SM::kv; /* the block's Q, dO rows */
        uint16_t *Ks = Ob + SM::kv;                                               /* [2][tile]: K tiles */
        uint16_t *Vs = Ob + SM::kv + 2 * SM::tile;                                /* [2][tile]: V tiles */
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
        const int b = bh / NH, h = bh % NH;
        const size_t C3 = 3 * (size_t)C;
        const uint16_t *base = reinterpret_cast<const uint16_t *>(qkv) + (size_t)b * Tn * C3 + h * HS;
        const uint16_t *dob = reinterpret_cast<const uint16_t *>(dout) + (size_t)b * Tn * C + h * HS;
        const uint16_t *kg = base + C, *vg = base + 2 * C;
        const int q0 = qb * MMA_BR, qw = q0 + warp * 16 * MT; /* this warp: rows [qw, qw + 32) */
        const uint16_t *Ow = Ob + (size_t)(qw - q0) * LDS;

        uint32_t qa[MT][HS / 16][4];
        float Lr[MT][2], Dr[MT][2], dq[MT][HS / 8][4];
        const float *L = lse + (size_t)bh * Tn, *D = delta + (size_t)bh * Tn;
#pragma unroll
        for (int m = 0; m < MT; m++) {
            load_a_frags<HS>(qa[m], base, C3, qw + 16 * m, Tn);
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int row = qw + 16 * m + gq + 8 * i;
                Lr[m][i] = row < Tn ? L[row] * ATT_LOG2E : 0.f;
                Dr[m][i] = row < Tn ? D[row] : 0.f;
            }
#pragma unroll
            for (int dt = 0; dt < HS / 8; dt++)
                dq[m][dt][0] = dq[m][dt][1] = dq[m][dt][2] = dq[m][dt][3] = 0.f;
        }

        /* the first cp.async group carries the block's Q and dO rows with the first K and V tiles */
        const int nkb = min(q0 + MMA_BR - 1, Tn - 1) / MMA_BC + 1;
        tile_load<HS, NT, MMA_BR>(Ob, dob + (size_t)q0 * C, C, Tn - q0);
        tile_load<HS, NT, MMA_BC>(Ks, kg, C3, Tn);
        tile_load<HS, NT, MMA_BC>(Vs, vg, C3, Tn);
        cp_async_commit();
        for (int kb = 0; kb < nkb; kb++) {
            const int buf = kb & 1;
            if (kb + 1 < nkb) {
                const int k1 = (kb + 1) * MMA_BC;
                tile_load<HS, NT, MMA_BC>(Ks + (buf ^ 1) * SM::tile, kg + (size_t)k1 * C3, C3, Tn - k1);
                tile_load<HS, NT, MMA_BC>(Vs + (buf ^ 1) * SM::tile, vg + (size_t)k1 * C3, C3, Tn - k1);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
#pragma unroll 2
            for (int hf = 0; hf < 2; hf++) {
                const int kbase = kb * MMA_BC + hf * HB;
                if (kbase <= qw + 16 * MT - 1) { /* else every key of the half is after this warp's rows */
                    const bool masked = kbase + HB - 1 > qw;
                    const uint16_t *K = Ks + buf * SM::tile + hf * HB * LDS,
                                   *Vt = Vs + buf * SM::tile + hf * HB * LDS;
                    float p[MT][HB / 8][4], dp[MT][HB / 8][4];
                    mma_abt_r<T, HS, MT, HB / 8>(p, qa, K);
                    mma_abt_s<T, HS, MT, HB / 8>(dp, Ow, Vt);
                    const int dkr =
                        kbase + 2 * tq - qw - gq; /* key - row of element (m, nt, e) = dkr + const */
                    auto ds = [&](auto mk) {
                        for_frags<MT, HB / 8>([&](int m, int nt, int e) {
                            float pe = ex2_approx_ftz(fmaf(p[m][nt][e], sl2, -Lr[m][e >> 1]));
                            if (decltype(mk)::value && dkr + nt * 8 + (e & 1) - 16 * m - 8 * (e >> 1) > 0)
                                pe = 0.f;
                            dp[m][nt][e] = pe * (dp[m][nt][e] - Dr[m][e >> 1]);
                        });
                    };
                    if (masked)
                        ds(MmaMasked<true>());
                    else
                        ds(MmaMasked<false>());
                    mma_pv<T, HS, MT, HB / 16>(dq, dp, K);
                }
            }
            __syncthreads();
        }
        T *dst = dqkv + (size_t)b * Tn * C3 + h * HS;
#pragma unroll
        for (int m = 0; m < MT; m++)
            store_rows<T, HS>(dst, C3, qw + 16 * m, Tn, dq[m], scale, scale);
    }

    /* Key/value pass: the block owns keys [kb*128, kb*128+128) (kept in shared memory: K and V are the A
     * operands), warp w 32 of them; it computes Sᵀ = K·Qᵀ, Pᵀ, dPᵀ = V·dOᵀ and dSᵀ for every query tile at or
     * after its keys, half a tile (32 queries) at a time, and accumulates dV += Pᵀ·dO, dK += dSᵀ·Q. */
    __device__ __forceinline__ void kv_pass(unsigned char *mma_smem, int kb, int bh) const {
        uint16_t *Ks = reinterpret_cast<uint16_t *>(mma_smem), *Vs = Ks + SM::kv;
        uint16_t *Qs = Vs + SM::kv;                /* [2][tile]: Q tiles, double-buffered */
        uint16_t *Os = Vs + SM::kv + 2 * SM::tile; /* [2][tile]: dO tiles */
        float *lsb = reinterpret_cast<float *>(Vs + SM::kv + 4 * SM::tile); /* [2][MMA_BC] */
        float *dlb = lsb + 2 * MMA_BC;                                      /* [2][MMA_BC] */
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
        const int b = bh / NH, h = bh % NH;
        const size_t C3 = 3 * (size_t)C;
        const uint16_t *base = reinterpret_cast<const uint16_t *>(qkv) + (size_t)b * Tn * C3 + h * HS;
        const uint16_t *dob = reinterpret_cast<const uint16_t *>(dout) + (size_t)b * Tn * C + h * HS;
        const float *L = lse + (size_t)bh * Tn, *D = delta + (size_t)bh * Tn;
        const int k0 = kb * MMA_BR, kw = k0 + warp * 16 * MT; /* this warp: keys [kw, kw + 32) */
        const uint16_t *Kw = Ks + (size_t)(kw - k0) * LDS, *Vw = Vs + (size_t)(kw - k0) * LDS;

        float dk[MT][HS / 8][4], dv[MT][HS / 8][4];
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int dt = 0; dt < HS / 8; dt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    dk[m][dt][e] = dv[m][dt][e] = 0.f;

        /* query tiles from the one holding this block's first key (earlier queries see none of its keys);
         * the first cp.async group carries the block's K and V with the first Q and dO tiles */
        const int nqb = (Tn + MMA_BC - 1) / MMA_BC, qb0 = k0 / MMA_BC;
        tile_load<HS, NT, MMA_BR>(Ks, base + C + (size_t)k0 * C3, C3, Tn - k0);
        tile_load<HS, NT, MMA_BR>(Vs, base + 2 * C + (size_t)k0 * C3, C3, Tn - k0);
        {
            const int q1 = qb0 * MMA_BC;
            tile_load<HS, NT, MMA_BC>(Qs, base + (size_t)q1 * C3, C3, Tn - q1);
            tile_load<HS, NT, MMA_BC>(Os, dob + (size_t)q1 * C, C, Tn - q1);
            rows_f32(lsb, dlb, L, D, q1, Tn);
            cp_async_commit();
        }
        for (int qb = qb0, it = 0; qb < nqb; qb++, it++) {
            const int buf = it & 1;
            if (qb + 1 < nqb) {
                const int q1 = (qb + 1) * MMA_BC;
                tile_load<HS, NT, MMA_BC>(Qs + (buf ^ 1) * SM::tile, base + (size_t)q1 * C3, C3, Tn - q1);
                tile_load<HS, NT, MMA_BC>(Os + (buf ^ 1) * SM::tile, dob + (size_t)q1 * C, C, Tn - q1);
                rows_f32(lsb + (buf ^ 1) * MMA_BC, dlb + (buf ^ 1) * MMA_BC, L, D, q1, Tn);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
            const float *Ls = lsb + buf * MMA_BC, *Ds = dlb + buf * MMA_BC;
#pragma unroll 2
            for (int hf = 0; hf < 2; hf++) {
                const int qbase = qb * MMA_BC + hf * HB;
                /* a half wholly before this warp's first key sees none of its keys: nothing to add */
                if (qbase + HB - 1 >= kw) {
                    const bool masked = qbase < kw + 16 * MT - 1;
                    const uint16_t *Q = Qs + buf * SM::tile + hf * HB * LDS,
                                   *DO = Os + buf * SM::tile + hf * HB * LDS;
                    float p[MT][HB / 8][4];
                    mma_abt_s<T, HS, MT, HB / 8>(p, Kw, Q);
                    /* dPᵀ's MMAs issue before the exponentials, so the tensor cores work during them */
                    float dp[MT][HB / 8][4];
                    mma_abt_s<T, HS, MT, HB / 8>(dp, Vw, DO);
                    const int dqk =
                        qbase + 2 * tq - kw - gq; /* query - key of element (m, nt, e) = dqk + const */
                    auto probs = [&](auto mk) {
                        for_frags<MT, HB / 8>([&](int m, int nt, int e) {
                            const int qi = hf * HB + nt * 8 + 2 * tq + (e & 1); /* query within the tile */
                            const float lq = Ls[qi] * ATT_LOG2E;
                            float v = ex2_approx_ftz(fmaf(p[m][nt][e], sl2, -lq));
                            if (decltype(mk)::value && dqk + nt * 8 + (e & 1) - 16 * m - 8 * (e >> 1) < 0)
                                v = 0.f;
                            p[m][nt][e] = v;
                        });
                    };
                    if (masked)
                        probs(MmaMasked<true>());
                    else
                        probs(MmaMasked<false>());
                    mma_pv<T, HS, MT, HB / 16>(dv, p, DO);
                    for_frags<MT, HB / 8>([&](int m, int nt, int e) {
                        const int qi = hf * HB + nt * 8 + 2 * tq + (e & 1);
                        dp[m][nt][e] = p[m][nt][e] * (dp[m][nt][e] - Ds[qi]);
                    });
                    mma_pv<T, HS, MT, HB / 16>(dk, dp, Q);
                }
            }
            __syncthreads();
        }
        T *dst = dqkv + (size_t)b * Tn * C3 + h * HS;
#pragma unroll
        for (int m = 0; m < MT; m++) {
            store_rows<T, HS>(dst + C, C3, kw + 16 * m, Tn, dk[m], scale, scale);
            store_rows<T, HS>(dst + 2 * C, C3, kw + 16 * m, Tn, dv[m], 1.f, 1.f);
        }
    }
};

/* Both backward passes in one launch (they are independent: dK, dV and dQ are disjoint parts of dqkv), so
 * neither waits for the other's tail. grid = (2 * nb, B * NH): the blocks of one head run together (they
 * share its tiles in L2), heaviest first, alternating a key/value block (key block j: the most queries
 * for j = 0) and a query block (query block nb - 1 - j: the most keys). */
template <typename T, int HS>
__global__ void __launch_bounds__(32 * MMA_NW)
    attn_bwd_mma(T *dqkv, const T *dout, const T *qkv, const float *lse, const float *delta, int Tn, int C,
                 int NH, float sl2, float scale) {
    extern __shared__ __align__(16) unsigned char mma_smem[];
    const int bh = blockIdx.y, j = blockIdx.x >> 1, nb = gridDim.x >> 1;
    const BwdMma<T, HS> a{dqkv, dout, qkv, lse, delta, Tn, C, NH, sl2, scale};
    if ((blockIdx.x & 1) == 0)
        a.kv_pass(mma_smem, j, bh);
    else
        a.q_pass(mma_smem, nb - 1 - j, bh);
}

/* delta[bh, t] = rowsum(dO ∘ O) for the tensor-core backward: HS / 8 lanes per (b, t, h) row (rows in memory
 * order), one 16-byte load of each operand per lane, then a fixed shuffle tree. */
template <typename T, int HS>
__global__ void __launch_bounds__(256)
    attn_delta_mma(float *delta, const T *dout, const T *out, int Tn, int NH, size_t nrows) {
    constexpr int LPR = HS / 8; /* lanes per row: 8 or 4, aligned groups within the warp */
    const size_t gt = (size_t)blockIdx.x * 256 + threadIdx.x, row = gt / LPR;
    const int part = (int)(gt % LPR);
    float s = 0.f;
    if (row < nrows) {
        const uint4 a = *reinterpret_cast<const uint4 *>(dout + row * HS + part * 8);
        const uint4 o = *reinterpret_cast<const uint4 *>(out + row * HS + part * 8);
        const T *pa = reinterpret_cast<const T *>(&a), *po = reinterpret_cast<const T *>(&o);
#pragma unroll
        for (int i = 0; i < 8; i++)
            s = fmaf(dg_to_f(pa[i]), dg_to_f(po[i]), s);
    }
#pragma unroll
    for (int off = LPR / 2; off > 0; off >>= 1)
        s += __shfl_xor_sync(0xffffffffu, s, off);
    if (row < nrows && part == 0) {
        const size_t bt = row / NH;
        const int h = (int)(row % NH), t = (int)(bt % Tn);
        const size_t b = bt / Tn;
        delta[(b * NH + h) * Tn + t] = s;
    }
}

template <typename T, int HS>
static dg_status_t delta_mma_launch(dg_cuda_t *c, float *delta, const void *dout, const void *out, int B,
                                    int Tn, int NH) {
    const size_t nrows = (size_t)B * Tn * NH, nthreads = nrows * (HS / 8);
    attn_delta_mma<T, HS><<<(unsigned)((nthreads + 255) / 256), 256, 0, c->stream>>>(
        delta, (const T *)dout, (const T *)out, Tn, NH, nrows);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

template <typename T, int HS>
static dg_status_t fwd_mma_launch(dg_cuda_t *c, void *out, float *lse, const void *qkv, int B, int Tn, int C,
                                  int NH, float sl2) {
    dim3 grid((Tn + MMA_BR - 1) / MMA_BR, B * NH);
    attn_fwd_mma<T, HS><<<grid, 32 * MMA_NW, 0, c->stream>>>((T *)out, lse, (const T *)qkv, Tn, C, NH, sl2);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

template <typename T, int HS>
static dg_status_t bwd_mma_launch(dg_cuda_t *c, void *dqkv, const void *dout, const void *qkv,
                                  const float *lse, const float *delta, int B, int Tn, int C, int NH,
                                  float sl2, float scale) {
    dim3 grid(2 * ((Tn + MMA_BR - 1) / MMA_BR), B * NH);
    const size_t smem = MmaSmem<HS>::bytes;
    /* more than the 48 KiB default: opt in (every call: cheap, and right for any device of the process) */
    DG_CUDA_CHECK(
        cudaFuncSetAttribute(attn_bwd_mma<T, HS>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    attn_bwd_mma<T, HS><<<grid, 32 * MMA_NW, smem, c->stream>>>((T *)dqkv, (const T *)dout, (const T *)qkv,
                                                                lse, delta, Tn, C, NH, sl2, scale);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

/* ======================= dispatch ======================= */

/* bf16/f16: cuDNN's fused attention (attn_cudnn.cu) where it loads and plans the shape (both directions
 * of a shape are planned together, so a shape runs on cuDNN in both or in neither); else the tensor-core
 * kernels where the head size and alignment allow; else (f32 always, DG_CUDA_FAST_ATTENTION=0, other head
 * sizes or alignments) the generic kernels. The forward and the backward of a call pair choose alike:
 * both need qkv and out 16-byte aligned, the backward also dout and dqkv, which the graph's arena (256-byte
 * offsets) always gives. */
static bool use_mma(const dg_cuda_t *c, int HS) {
    return c->fast_attention && c->act != DG_F32 && (HS == 64 || HS == 32);
}

template <typename T>
static dg_status_t fwd_t(dg_cuda_t *c, void *out, void *aux, const void *qkv, int B, int Tn, int C, int NH) {
    const int HS = C / NH;
    const float scale = 1.f / sqrtf((float)HS);
    float *lse = (float *)aux;
    if constexpr (sizeof(T) == 2) {
        if (c->fast_attention) {
            int done = 0;
            DG_TRY(dg_cuda_cudnn_attention(c, 0, out, aux, qkv, NULL, NULL, B, Tn, C, NH, &done));
            if (done) return DG_OK;
        }
        if (use_mma(c, HS) && dg_ptr_aligned(qkv, 16) && dg_ptr_aligned(out, 16)) {
            const float sl2 = scale * ATT_LOG2E;
            return HS == 64 ? fwd_mma_launch<T, 64>(c, out, lse, qkv, B, Tn, C, NH, sl2)
                            : fwd_mma_launch<T, 32>(c, out, lse, qkv, B, Tn, C, NH, sl2);
        }
    }
    dim3 grid((Tn + GEN_WARPS - 1) / GEN_WARPS, B * NH);
    attn_fwd_generic<T>
        <<<grid, 32 * GEN_WARPS, 0, c->stream>>>((T *)out, lse, (const T *)qkv, Tn, C, NH, scale);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

template <typename T>
static dg_status_t bwd_t(dg_cuda_t *c, void *dqkv, const void *dout, const void *qkv, const void *out,
                         const void *aux, int B, int Tn, int C, int NH) {
    const int HS = C / NH;
    const float scale = 1.f / sqrtf((float)HS);
    const float *lse = (const float *)aux;
    if constexpr (sizeof(T) == 2) {
        if (c->fast_attention) {
            int done = 0;
            DG_TRY(dg_cuda_cudnn_attention(c, 1, dqkv, (void *)dout, qkv, out, aux, B, Tn, C, NH, &done));
            if (done) return DG_OK;
        }
    }
    void *scr = NULL;
    DG_TRY(dg_cuda_scratch(c, (size_t)B * NH * Tn * sizeof(float), &scr));
    float *delta = (float *)scr;
    if constexpr (sizeof(T) == 2) {
        if (use_mma(c, HS) && dg_ptr_aligned(qkv, 16) && dg_ptr_aligned(dout, 16) &&
            dg_ptr_aligned(dqkv, 16) && dg_ptr_aligned(out, 16)) {
            const float sl2 = scale * ATT_LOG2E;
            DG_TRY((HS == 64 ? delta_mma_launch<T, 64>(c, delta, dout, out, B, Tn, NH)
                             : delta_mma_launch<T, 32>(c, delta, dout, out, B, Tn, NH)));
            return HS == 64 ? bwd_mma_launch<T, 64>(c, dqkv, dout, qkv, lse, delta, B, Tn, C, NH, sl2, scale)
                            : bwd_mma_launch<T, 32>(c, dqkv, dout, qkv, lse, delta, B, Tn, C, NH, sl2, scale);
        }
    }
    dim3 ggrid((Tn + GEN_WARPS - 1) / GEN_WARPS, B * NH);
    attn_delta_kernel<T>
        <<<ggrid, 32 * GEN_WARPS, 0, c->stream>>>(delta, (const T *)dout, (const T *)out, Tn, C, NH);
    DG_CUDA_LAUNCH_CHECK();
    attn_bwd_generic<T, true><<<ggrid, 32 * GEN_WARPS, 0, c->stream>>>(
        (T *)dqkv, (const T *)dout, (const T *)qkv, lse, delta, Tn, C, NH, scale);
    DG_CUDA_LAUNCH_CHECK();
    attn_bwd_generic<T, false><<<ggrid, 32 * GEN_WARPS, 0, c->stream>>>(
        (T *)dqkv, (const T *)dout, (const T *)qkv, lse, delta, Tn, C, NH, scale);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

dg_status_t dg_cuda_attention_fwd(dg_cuda_t *c, void *out, void *aux, const void *qkv, int B, int T, int C,
                                  int NH) {
    return DG_CUDA_DISPATCH_ACT(c->act, fwd_t, c, out, aux, qkv, B, T, C, NH);
}

dg_status_t dg_cuda_attention_bwd(dg_cuda_t *c, void *dqkv, const void *dout, const void *qkv,
                                  const void *out, const void *aux, int B, int T, int C, int NH) {
    return DG_CUDA_DISPATCH_ACT(c->act, bwd_t, c, dqkv, dout, qkv, out, aux, B, T, C, NH);
}
