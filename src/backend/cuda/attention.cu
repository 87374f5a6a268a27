/* attention.cu — causal multi-head self-attention that never materialises the T x T matrix.
 *
 * aux holds one f32 per (b, h, t): the row's logsumexp (natural log), written by the forward and used by
 * the backward to recompute the probabilities. The backward first computes delta = rowsum(dO ∘ O) into
 * scratch, then runs two kernels with no atomics (bitwise reproducible):
 *   - the key/value pass: one block per block of keys loops over the query blocks that see it and
 *     accumulates dK, dV in registers;
 *   - the query pass: one block per block of queries loops over its key blocks and accumulates dQ.
 *
 * Two implementations of the same arithmetic:
 *   - tensor-core kernels (bf16/f16, head size 32 or 64, 16-byte aligned buffers): flash-attention style,
 *     mma.sync m16n8k16 with f32 accumulators, one warp per 16 rows, 64 x 64 tiles double-buffered in
 *     shared memory with cp.async, online softmax in registers (probabilities are rounded to the
 *     activation dtype before the P·V product, as every flash kernel does);
 *   - generic kernels (any dtype, head size <= 256; f32 mode, odd shapes): one warp per row, 32 keys (or
 *     queries) at a time, all arithmetic in f32.
 */
#include "cuda_impl.cuh"

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

template <typename T>
__global__ void __launch_bounds__(32 * GEN_WARPS)
    attn_fwd_generic(T *out, float *lse, const T *qkv, int Tn, int C, int NH, float scale) {
    __shared__ float qs[GEN_WARPS][32 * GEN_MAXD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH, HS = C / NH;
    const int t = blockIdx.x * GEN_WARPS + warp;
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
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH, HS = C / NH;
    const int t = blockIdx.x * GEN_WARPS + warp;
    if (t >= Tn) return;
    const size_t off = ((size_t)b * Tn + t) * C + h * HS;
    float s = 0.f;
    for (int d = lane; d < HS; d += 32)
        s += dg_to_f(dout[off + d]) * dg_to_f(out[off + d]);
    s = dg_warp_sum(s);
    if (lane == 0) delta[(size_t)bh * Tn + t] = s;
}

/* dQ: one warp per query row. */
template <typename T>
__global__ void __launch_bounds__(32 * GEN_WARPS)
    attn_bwd_q_generic(T *dqkv, const T *dout, const T *qkv, const float *lse, const float *delta, int Tn,
                       int C, int NH, float scale) {
    __shared__ float qs[GEN_WARPS][32 * GEN_MAXD], dos[GEN_WARPS][32 * GEN_MAXD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH, HS = C / NH;
    const int t = blockIdx.x * GEN_WARPS + warp;
    if (t >= Tn) return;
    const size_t C3 = 3 * (size_t)C;
    const T *base = qkv + (size_t)b * Tn * C3 + h * HS;
    const T *dob = dout + ((size_t)b * Tn + t) * C + h * HS;
    float *q = qs[warp], *dov = dos[warp];
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
}

/* dK, dV: one warp per key row, looping over the queries t >= j. */
template <typename T>
__global__ void __launch_bounds__(32 * GEN_WARPS)
    attn_bwd_kv_generic(T *dqkv, const T *dout, const T *qkv, const float *lse, const float *delta, int Tn,
                        int C, int NH, float scale) {
    __shared__ float ks[GEN_WARPS][32 * GEN_MAXD], vs[GEN_WARPS][32 * GEN_MAXD];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH, HS = C / NH;
    const int j = blockIdx.x * GEN_WARPS + warp;
    if (j >= Tn) return;
    const size_t C3 = 3 * (size_t)C;
    const T *base = qkv + (size_t)b * Tn * C3 + h * HS;
    const T *dob = dout + (size_t)b * Tn * C + h * HS;
    float *k = ks[warp], *v = vs[warp];
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

/* ======================= tensor-core kernels ======================= */

/* A block owns BR = 16 x NW rows (queries, or keys in the key/value pass; NW = 4 or 8 warps, one warp
 * per 16 rows) and streams the other side in tiles of MMA_BC rows. 128-row blocks (NW = 8) load each
 * K/V (or Q/dO) tile into shared memory once for twice the rows; per-row arithmetic and its order are
 * the same for both, so the two give the same bits (DG_CUDA_ATTN_ROWS picks; see dg_cuda_t). */
#define MMA_BC 64 /* rows per streamed tile */

template <typename T> struct MmaOp;
template <> struct MmaOp<dg_bf16> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
};
template <> struct MmaOp<dg_f16> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
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
static __device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t *p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}
static __device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const uint16_t *p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

/* 2^x as one MUFU.EX2 (ex2.approx.ftz: results below 2^-126 flush to zero); exp2f adds a range check and
 * two multiplies around the same instruction for denormal results. Used by implementation 3. */
static __device__ __forceinline__ float ex2_approx_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* Copy rows [0, 64) of a tile (rows >= `valid` zero-filled) of HS 16-bit elements, global row stride
 * `gstride` elements, into shared memory rows of HS + 8 elements. All NT threads of the block take part. */
template <int HS, int NT>
static __device__ __forceinline__ void tile_load(uint16_t *sm, const uint16_t *g, size_t gstride, int valid) {
    constexpr int CH = HS / 8, LDS = HS + 8;
    for (int i = threadIdx.x; i < MMA_BC * CH; i += NT) {
        const int r = i / CH, ch = i % CH;
        const bool ok = r < valid;
        cp_async16(sm + r * LDS + ch * 8, ok ? g + (size_t)r * gstride + ch * 8 : g, ok);
    }
}

static __device__ __forceinline__ uint32_t ld32(const uint16_t *p) {
    return *reinterpret_cast<const uint32_t *>(p);
}
/* two 16-bit elements one row apart, packed as (lo = p[0], hi = p[ld]) */
static __device__ __forceinline__ uint32_t ld_pair_rows(const uint16_t *p, int ld) {
    return (uint32_t)p[0] | ((uint32_t)p[ld] << 16);
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

/* acc[16 x 64] = A[16 x HS] · tileᵀ, tile = 64 rows x HS in shared memory (B[k][n] = tile[n][k]).
 * LDM: B fragments through ldmatrix (one instruction per two n-tiles) instead of 32-bit loads. */
template <typename T, int HS, bool LDM>
static __device__ __forceinline__ void mma_abt(float (&acc)[8][4], const uint32_t (&a)[HS / 16][4],
                                               const uint16_t *tile) {
    constexpr int LDS = HS + 8;
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
        acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    if constexpr (LDM) {
        const int mi = lane >> 3, mr = lane & 7;
#pragma unroll
        for (int nt = 0; nt < 8; nt += 2)
#pragma unroll
            for (int kk = 0; kk < HS / 16; kk++) {
                uint32_t r[4];
                ldsm_x4(r, tile + ((nt + (mi >> 1)) * 8 + mr) * LDS + kk * 16 + (mi & 1) * 8);
                MmaOp<T>::run(acc[nt], a[kk], r[0], r[1]);
                MmaOp<T>::run(acc[nt + 1], a[kk], r[2], r[3]);
            }
    } else {
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int kk = 0; kk < HS / 16; kk++) {
                const uint16_t *p = tile + (nt * 8 + gq) * LDS + kk * 16 + 2 * tq;
                MmaOp<T>::run(acc[nt], a[kk], ld32(p), ld32(p + 8));
            }
    }
}

/* acc[16 x HS] += P[16 x 64] · tile, P given as f32 accumulator fragments, tile = 64 rows x HS in shared
 * memory (B[k][n] = tile[k][n]: pairs along k are a row apart, hence ldmatrix.trans or two 16-bit loads). */
template <typename T, int HS, bool LDM>
static __device__ __forceinline__ void mma_pv(float (&acc)[HS / 8][4], const float (&p)[8][4],
                                              const uint16_t *tile) {
    constexpr int LDS = HS + 8;
    const int lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        uint32_t a[4];
        a[0] = MmaOp<T>::pack(p[2 * kk][0], p[2 * kk][1]);
        a[1] = MmaOp<T>::pack(p[2 * kk][2], p[2 * kk][3]);
        a[2] = MmaOp<T>::pack(p[2 * kk + 1][0], p[2 * kk + 1][1]);
        a[3] = MmaOp<T>::pack(p[2 * kk + 1][2], p[2 * kk + 1][3]);
        if constexpr (LDM) {
            const int mi = lane >> 3, mr = lane & 7;
#pragma unroll
            for (int dt = 0; dt < HS / 8; dt += 2) {
                uint32_t r[4];
                ldsm_x4_t(r, tile + (kk * 16 + (mi & 1) * 8 + mr) * LDS + (dt + (mi >> 1)) * 8);
                MmaOp<T>::run(acc[dt], a, r[0], r[1]);
                MmaOp<T>::run(acc[dt + 1], a, r[2], r[3]);
            }
        } else {
#pragma unroll
            for (int dt = 0; dt < HS / 8; dt++) {
                const uint16_t *q = tile + (kk * 16 + 2 * tq) * LDS + dt * 8 + gq;
                MmaOp<T>::run(acc[dt], a, ld_pair_rows(q, LDS), ld_pair_rows(q + 8 * LDS, LDS));
            }
        }
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

template <typename T, int HS, bool LDM, int NW>
__global__ void __launch_bounds__(32 * NW)
    attn_fwd_mma(T *out, float *lse, const T *qkv, int Tn, int C, int NH, float sl2) {
    constexpr int LDS = HS + 8, BR = 16 * NW, NT = 32 * NW;
    __shared__ __align__(16) uint16_t ks[2][MMA_BC * LDS];
    __shared__ __align__(16) uint16_t vs[2][MMA_BC * LDS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    const int qb = gridDim.x - 1 - blockIdx.x; /* the longest rows first */
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const size_t C3 = 3 * (size_t)C;
    const uint16_t *base = reinterpret_cast<const uint16_t *>(qkv) + (size_t)b * Tn * C3 + h * HS;
    const uint16_t *kg = base + C, *vg = base + 2 * C;
    const int q0 = qb * BR, qw = q0 + warp * 16;

    uint32_t qa[HS / 16][4];
    load_a_frags<HS>(qa, base, C3, qw, Tn);
    float o[HS / 8][4];
#pragma unroll
    for (int dt = 0; dt < HS / 8; dt++)
        o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    const int row0 = qw + gq, row1 = qw + gq + 8;

    const int nkb = min(q0 + BR - 1, Tn - 1) / MMA_BC + 1;
    tile_load<HS, NT>(ks[0], kg, C3, Tn);
    tile_load<HS, NT>(vs[0], vg, C3, Tn);
    cp_async_commit();
    for (int kb = 0; kb < nkb; kb++) {
        const int buf = kb & 1;
        if (kb + 1 < nkb) {
            const int k1 = (kb + 1) * MMA_BC;
            tile_load<HS, NT>(ks[buf ^ 1], kg + (size_t)k1 * C3, C3, Tn - k1);
            tile_load<HS, NT>(vs[buf ^ 1], vg + (size_t)k1 * C3, C3, Tn - k1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int kbase = kb * MMA_BC;
        /* a tile wholly after this warp's last row adds nothing (every score masked: scale 1, p = 0); the
         * barriers stay outside the branch, which differs between warps */
        if (kbase <= qw + 15) {
            float s[8][4];
            mma_abt<T, HS, LDM>(s, qa, ks[buf]);
            /* only the diagonal tile and the tile past the end need the causal / length mask */
            const bool masked = kbase + MMA_BC > q0 || kbase + MMA_BC > Tn;
            float mx0 = m0, mx1 = m1;
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float v = s[nt][e] * sl2;
                    if (masked) {
                        const int key = kbase + nt * 8 + 2 * tq + (e & 1);
                        if (key > (e < 2 ? row0 : row1) || key >= Tn) v = -INFINITY;
                    }
                    s[nt][e] = v;
                    if (e < 2)
                        mx0 = fmaxf(mx0, v);
                    else
                        mx1 = fmaxf(mx1, v);
                }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            /* a row with no visible key yet keeps max -inf: use 0 as its base so nothing becomes NaN */
            const float b0 = mx0 == -INFINITY ? 0.f : mx0, b1 = mx1 == -INFINITY ? 0.f : mx1;
            const float c0 = exp2f(m0 - b0), c1 = exp2f(m1 - b1);
            m0 = mx0;
            m1 = mx1;
            l0 *= c0;
            l1 *= c1;
#pragma unroll
            for (int dt = 0; dt < HS / 8; dt++) {
                o[dt][0] *= c0;
                o[dt][1] *= c0;
                o[dt][2] *= c1;
                o[dt][3] *= c1;
            }
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                s[nt][0] = exp2f(s[nt][0] - b0);
                s[nt][1] = exp2f(s[nt][1] - b0);
                s[nt][2] = exp2f(s[nt][2] - b1);
                s[nt][3] = exp2f(s[nt][3] - b1);
                l0 += s[nt][0] + s[nt][1];
                l1 += s[nt][2] + s[nt][3];
            }
            mma_pv<T, HS, LDM>(o, s, vs[buf]);
        }
        __syncthreads(); /* the next iteration refills the other buffer; the one after, this one */
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    store_rows<T, HS>(out + (size_t)b * Tn * C + h * HS, C, qw, Tn, o, 1.f / l0, 1.f / l1);
    if (tq == 0) {
        float *L = lse + (size_t)bh * Tn;
        if (row0 < Tn) L[row0] = (m0 + log2f(l0)) * ATT_LN2;
        if (row1 < Tn) L[row1] = (m1 + log2f(l1)) * ATT_LN2;
    }
}

/* Key/value pass: the block owns keys [kb*64, kb*64+64); warp w owns 16 of them and computes
 * Sᵀ = K·Qᵀ, Pᵀ, dPᵀ = V·dOᵀ and dSᵀ for every query block at or after its keys. */
template <typename T, int HS, bool LDM, int NW>
__global__ void __launch_bounds__(32 * NW)
    attn_bwd_kv_mma(T *dqkv, const T *dout, const T *qkv, const float *lse, const float *delta, int Tn, int C,
                    int NH, float sl2, float scale) {
    constexpr int LDS = HS + 8, BR = 16 * NW, NT = 32 * NW;
    __shared__ __align__(16) uint16_t qs[2][MMA_BC * LDS];
    __shared__ __align__(16) uint16_t ds_[2][MMA_BC * LDS];
    __shared__ float ls[2][MMA_BC], dl[2][MMA_BC];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    const int kb = blockIdx.x; /* low key blocks see the most queries: they start first */
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const size_t C3 = 3 * (size_t)C;
    const uint16_t *base = reinterpret_cast<const uint16_t *>(qkv) + (size_t)b * Tn * C3 + h * HS;
    const uint16_t *dob = reinterpret_cast<const uint16_t *>(dout) + (size_t)b * Tn * C + h * HS;
    const float *L = lse + (size_t)bh * Tn, *D = delta + (size_t)bh * Tn;
    const int k0 = kb * BR, kw = k0 + warp * 16;
    const int key0 = kw + gq, key1 = kw + gq + 8;

    uint32_t ka[HS / 16][4], va[HS / 16][4];
    load_a_frags<HS>(ka, base + C, C3, kw, Tn);
    load_a_frags<HS>(va, base + 2 * C, C3, kw, Tn);
    float dk[HS / 8][4], dv[HS / 8][4];
#pragma unroll
    for (int dt = 0; dt < HS / 8; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            dk[dt][e] = dv[dt][e] = 0.f;

    /* query tiles from the one holding this block's first key (earlier queries see none of its keys) */
    const int nqb = (Tn + MMA_BC - 1) / MMA_BC;
    tile_load<HS, NT>(qs[0], base + (size_t)k0 * C3, C3, Tn - k0);
    tile_load<HS, NT>(ds_[0], dob + (size_t)k0 * C, C, Tn - k0);
    cp_async_commit();
    if (threadIdx.x < MMA_BC) {
        const int q = k0 + threadIdx.x;
        ls[0][threadIdx.x] = q < Tn ? L[q] * ATT_LOG2E : 0.f;
        dl[0][threadIdx.x] = q < Tn ? D[q] : 0.f;
    }
    for (int qb = k0 / MMA_BC, it = 0; qb < nqb; qb++, it++) {
        const int buf = it & 1;
        if (qb + 1 < nqb) {
            const int q1 = (qb + 1) * MMA_BC;
            tile_load<HS, NT>(qs[buf ^ 1], base + (size_t)q1 * C3, C3, Tn - q1);
            tile_load<HS, NT>(ds_[buf ^ 1], dob + (size_t)q1 * C, C, Tn - q1);
            cp_async_commit();
            if (threadIdx.x < MMA_BC) {
                const int q = q1 + threadIdx.x;
                ls[buf ^ 1][threadIdx.x] = q < Tn ? L[q] * ATT_LOG2E : 0.f;
                dl[buf ^ 1][threadIdx.x] = q < Tn ? D[q] : 0.f;
            }
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint16_t *Q = qs[buf], *DO = ds_[buf];
        const float *Ls = ls[buf], *Ds = dl[buf];
        const int qbase = qb * MMA_BC;
        /* a tile wholly before this warp's first key sees none of them: p = 0, nothing to add */
        if (kw <= qbase + MMA_BC - 1) {
            const bool masked = qbase < k0 + BR || qbase + MMA_BC > Tn || k0 + BR > Tn;
            float p[8][4];
            mma_abt<T, HS, LDM>(p, ka, Q);
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int qi = nt * 8 + 2 * tq + (e & 1);
                    float v = exp2f(fmaf(p[nt][e], sl2, -Ls[qi]));
                    if (masked) {
                        const int q = qbase + qi, key = e < 2 ? key0 : key1;
                        if (!(q >= key && q < Tn && key < Tn)) v = 0.f;
                    }
                    p[nt][e] = v;
                }
            mma_pv<T, HS, LDM>(dv, p, DO);
            float dp[8][4];
            mma_abt<T, HS, LDM>(dp, va, DO);
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int qi = nt * 8 + 2 * tq + (e & 1);
                    dp[nt][e] = p[nt][e] * (dp[nt][e] - Ds[qi]);
                }
            mma_pv<T, HS, LDM>(dk, dp, Q);
        }
        __syncthreads();
    }
    T *dst = dqkv + (size_t)b * Tn * C3 + h * HS;
    store_rows<T, HS>(dst + C, C3, kw, Tn, dk, scale, scale);
    store_rows<T, HS>(dst + 2 * C, C3, kw, Tn, dv, 1.f, 1.f);
}

/* Query pass: the block owns 64 queries; warp w owns 16 and accumulates dQ = dS·K over its key blocks. */
template <typename T, int HS, bool LDM, int NW>
__global__ void __launch_bounds__(32 * NW)
    attn_bwd_q_mma(T *dqkv, const T *dout, const T *qkv, const float *lse, const float *delta, int Tn, int C,
                   int NH, float sl2, float scale) {
    constexpr int LDS = HS + 8, BR = 16 * NW, NT = 32 * NW;
    __shared__ __align__(16) uint16_t ks[2][MMA_BC * LDS];
    __shared__ __align__(16) uint16_t vs[2][MMA_BC * LDS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    const int qb = gridDim.x - 1 - blockIdx.x;
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const size_t C3 = 3 * (size_t)C;
    const uint16_t *base = reinterpret_cast<const uint16_t *>(qkv) + (size_t)b * Tn * C3 + h * HS;
    const uint16_t *dob = reinterpret_cast<const uint16_t *>(dout) + (size_t)b * Tn * C + h * HS;
    const uint16_t *kg = base + C, *vg = base + 2 * C;
    const int q0 = qb * BR, qw = q0 + warp * 16;
    const int row0 = qw + gq, row1 = qw + gq + 8;

    uint32_t qa[HS / 16][4], da[HS / 16][4];
    load_a_frags<HS>(qa, base, C3, qw, Tn);
    load_a_frags<HS>(da, dob, C, qw, Tn);
    const float *L = lse + (size_t)bh * Tn, *D = delta + (size_t)bh * Tn;
    const float L0 = row0 < Tn ? L[row0] * ATT_LOG2E : 0.f, L1 = row1 < Tn ? L[row1] * ATT_LOG2E : 0.f;
    const float D0 = row0 < Tn ? D[row0] : 0.f, D1 = row1 < Tn ? D[row1] : 0.f;
    float dq[HS / 8][4];
#pragma unroll
    for (int dt = 0; dt < HS / 8; dt++)
        dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.f;

    const int nkb = min(q0 + BR - 1, Tn - 1) / MMA_BC + 1;
    tile_load<HS, NT>(ks[0], kg, C3, Tn);
    tile_load<HS, NT>(vs[0], vg, C3, Tn);
    cp_async_commit();
    for (int kb = 0; kb < nkb; kb++) {
        const int buf = kb & 1;
        if (kb + 1 < nkb) {
            const int k1 = (kb + 1) * MMA_BC;
            tile_load<HS, NT>(ks[buf ^ 1], kg + (size_t)k1 * C3, C3, Tn - k1);
            tile_load<HS, NT>(vs[buf ^ 1], vg + (size_t)k1 * C3, C3, Tn - k1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int kbase = kb * MMA_BC;
        if (kbase <= qw + 15) { /* else every key of the tile is after this warp's rows: dS = 0 */
            /* rows past Tn are never stored, so only the diagonal tile and the last key tile need masks */
            const bool masked = kbase + MMA_BC > q0 || kbase + MMA_BC > Tn;
            float p[8][4], dp[8][4];
            mma_abt<T, HS, LDM>(p, qa, ks[buf]);
            mma_abt<T, HS, LDM>(dp, da, vs[buf]);
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float pe = exp2f(fmaf(p[nt][e], sl2, -(e < 2 ? L0 : L1)));
                    if (masked) {
                        const int key = kbase + nt * 8 + 2 * tq + (e & 1);
                        const int row = e < 2 ? row0 : row1;
                        if (!(key <= row && key < Tn && row < Tn)) pe = 0.f;
                    }
                    dp[nt][e] = pe * (dp[nt][e] - (e < 2 ? D0 : D1));
                }
            mma_pv<T, HS, LDM>(dq, dp, ks[buf]);
        }
        __syncthreads();
    }
    store_rows<T, HS>(dqkv + (size_t)b * Tn * C3 + h * HS, C3, qw, Tn, dq, scale, scale);
}

/* ======================= tensor-core kernels, implementation 2 ======================= */

/* DG_CUDA_ATTN_IMPL=2. Same arithmetic as above (fp32 accumulators, exp2 with log2(e) folded into the
 * scale, probabilities rounded to the activation dtype before they enter an MMA, P kept in registers as
 * the A operand of the next MMA), but each warp owns A2_MT = 2 m-tiles (32 rows), so every fragment read
 * from shared memory with ldmatrix feeds two MMAs instead of one: half the shared-memory traffic per MMA.
 * Blocks are 4 warps = 128 rows; streamed tiles are 64 rows (cp.async, double-buffered).
 *   forward: Q fragments in registers (32 regs at head size 64), O 64, S of a 32 x 64 tile 64;
 *   backward: one launch runs both passes (alternate blocks), 73 KiB of dynamic shared memory each:
 *     key/value pass: the block's 128 K and V rows stay in shared memory (A operands via ldmatrix);
 *       registers hold dK, dV (128) and Sᵀ, dPᵀ of half a query tile (32 x 32: 64);
 *     query pass: Q fragments (32) in registers, the block's 128 dO rows in shared memory; registers
 *       also hold dQ (64) and S, dP of half a key tile (64).
 * Causal load balance: within each head the heaviest blocks have the lowest blockIdx.x (they start
 * first). No atomics; every sum has a fixed order, so results are bitwise reproducible. */
#define A2_MT 2                    /* m-tiles (of 16 rows) per warp */
#define A2_NW 4                    /* warps per block */
#define A2_BR (16 * A2_MT * A2_NW) /* 128 rows per block */
#define A2_BC 64                   /* rows per streamed tile */

/* Implementation 3 (DG_CUDA_ATTN_IMPL=3) is the same kernels instantiated with V = 3: the V template
 * parameter below selects (a) 2^x as a single ex2.approx.ftz instead of exp2f (which wraps the same
 * instruction in a denormal-range fix-up: 3 more instructions per score), and (b) separate code for tiles
 * that cross the diagonal and tiles that do not, the former testing the causal condition only (one
 * compare per score instead of three, and none at all elsewhere: with V = 2 the mask tests stay in every
 * tile's code as predicated instructions). Keys or queries past Tn need no test of their own: a valid
 * row never sees a key past Tn (it is after the row), rows past Tn are never stored, and a query past Tn
 * adds exactly zero to dK and dV (its Q and dO rows are zero-filled, its logsumexp and delta read as 0,
 * so P = 1 and dS = 0 for it). */
template <bool B> struct A2Bool { static constexpr bool value = B; };
template <int V> static __device__ __forceinline__ float a2_exp2(float x) {
    if constexpr (V >= 3)
        return ex2_approx_ftz(x);
    else
        return exp2f(x);
}

/* Copy rows [0, ROWS) of a tile (rows >= `valid` zero-filled) of HS 16-bit elements, global row stride
 * `gstride`, into shared memory rows of HS + 8 elements. All NT threads take part. */
template <int HS, int NT, int ROWS>
static __device__ __forceinline__ void tile_load_rows(uint16_t *sm, const uint16_t *g, size_t gstride,
                                                      int valid) {
    constexpr int CH = HS / 8, LDS = HS + 8;
    for (int i = threadIdx.x; i < ROWS * CH; i += NT) {
        const int r = i / CH, ch = i % CH;
        const bool ok = r < valid;
        cp_async16(sm + r * LDS + ch * 8, ok ? g + (size_t)r * gstride + ch * 8 : g, ok);
    }
}

/* The same for implementation 3: thread t always copies chunk t % (HS / 8) of rows t / (HS / 8) + k NT /
 * (HS / 8), so the loop is unrolled and the addresses advance by a constant (no division, no 64-bit
 * multiply per chunk). */
template <int V, int HS, int NT, int ROWS>
static __device__ __forceinline__ void a2_tile_load(uint16_t *sm, const uint16_t *g, size_t gstride,
                                                    int valid) {
    if constexpr (V >= 3) {
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
    } else {
        tile_load_rows<HS, NT, ROWS>(sm, g, gstride, valid);
    }
}

/* acc[m][n] (16 x 8 each) = A_m · Bᵀ over k in [0, HS): A_m = a[m] (register fragments of 16 rows),
 * B = shared-memory rows [0, 8 NN) of `tile` (row stride HS + 8). One ldmatrix.x4 gives the fragments of
 * two n-tiles and feeds 2 MT MMAs. */
template <typename T, int HS, int MT, int NN>
static __device__ __forceinline__ void mma2_abt_r(float (&acc)[MT][NN][4],
                                                  const uint32_t (&a)[MT][HS / 16][4], const uint16_t *tile) {
    static_assert(NN % 2 == 0, "n-tiles come in pairs");
    constexpr int LDS = HS + 8;
    const int lane = threadIdx.x & 31, mi = lane >> 3, mr = lane & 7;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NN; n++)
            acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HS / 16; kk++)
#pragma unroll
        for (int n = 0; n < NN; n += 2) {
            uint32_t r[4];
            ldsm_x4(r, tile + ((n + (mi >> 1)) * 8 + mr) * LDS + kk * 16 + (mi & 1) * 8);
#pragma unroll
            for (int m = 0; m < MT; m++) {
                MmaOp<T>::run(acc[m][n], a[m][kk], r[0], r[1]);
                MmaOp<T>::run(acc[m][n + 1], a[m][kk], r[2], r[3]);
            }
        }
}

/* The same with A read from shared memory too: A_m = rows [16 m, 16 m + 16) of `atile` (row stride
 * HS + 8), loaded one k-step at a time with ldmatrix (matrices: rows 0-7 / 8-15 x columns 0-7 / 8-15 of
 * the k-step give a0 / a1 / a2 / a3). */
template <typename T, int HS, int MT, int NN>
static __device__ __forceinline__ void mma2_abt_s(float (&acc)[MT][NN][4], const uint16_t *atile,
                                                  const uint16_t *tile) {
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
#pragma unroll
        for (int m = 0; m < MT; m++)
            ldsm_x4(a[m], atile + (m * 16 + (mi & 1) * 8 + mr) * LDS + kk * 16 + (mi >> 1) * 8);
#pragma unroll
        for (int n = 0; n < NN; n += 2) {
            uint32_t r[4];
            ldsm_x4(r, tile + ((n + (mi >> 1)) * 8 + mr) * LDS + kk * 16 + (mi & 1) * 8);
#pragma unroll
            for (int m = 0; m < MT; m++) {
                MmaOp<T>::run(acc[m][n], a[m], r[0], r[1]);
                MmaOp<T>::run(acc[m][n + 1], a[m], r[2], r[3]);
            }
        }
    }
}

/* acc[m] (16 x HS) += P_m · tile rows [0, 16 NK): P_m given as f32 accumulator fragments p[m][2 NK] (16 x
 * 16 NK), reused as A fragments after rounding; B pairs along k are a row apart: ldmatrix.trans. */
template <typename T, int HS, int MT, int NK>
static __device__ __forceinline__ void mma2_pv(float (&acc)[MT][HS / 8][4], const float (&p)[MT][2 * NK][4],
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

template <typename T, int HS, int V>
__global__ void __launch_bounds__(32 * A2_NW)
    attn2_fwd(T *out, float *lse, const T *qkv, int Tn, int C, int NH, float sl2) {
    constexpr int LDS = HS + 8, NT = 32 * A2_NW, MT = A2_MT;
    __shared__ __align__(16) uint16_t ks[2][A2_BC * LDS];
    __shared__ __align__(16) uint16_t vs[2][A2_BC * LDS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    /* grid = (query blocks, B * NH): the blocks of one head run together (they share its K/V tiles in
     * L2), the longest rows first */
    const int qb = gridDim.x - 1 - blockIdx.x;
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
    const size_t C3 = 3 * (size_t)C;
    const uint16_t *base = reinterpret_cast<const uint16_t *>(qkv) + (size_t)b * Tn * C3 + h * HS;
    const uint16_t *kg = base + C, *vg = base + 2 * C;
    const int q0 = qb * A2_BR, qw = q0 + warp * 16 * MT; /* this warp: rows [qw, qw + 32) */

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

    const int nkb = min(q0 + A2_BR - 1, Tn - 1) / A2_BC + 1;
    a2_tile_load<V, HS, NT, A2_BC>(ks[0], kg, C3, Tn);
    a2_tile_load<V, HS, NT, A2_BC>(vs[0], vg, C3, Tn);
    cp_async_commit();
    for (int kb = 0; kb < nkb; kb++) {
        const int buf = kb & 1;
        if (kb + 1 < nkb) {
            const int k1 = (kb + 1) * A2_BC;
            a2_tile_load<V, HS, NT, A2_BC>(ks[buf ^ 1], kg + (size_t)k1 * C3, C3, Tn - k1);
            a2_tile_load<V, HS, NT, A2_BC>(vs[buf ^ 1], vg + (size_t)k1 * C3, C3, Tn - k1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int kbase = kb * A2_BC;
        /* a tile wholly after this warp's last row adds nothing; the barriers stay outside the branch */
        if (kbase <= qw + 16 * MT - 1) {
            float s[MT][A2_BC / 8][4];
            mma2_abt_r<T, HS, MT, A2_BC / 8>(s, qa, ks[buf]);
            /* masks: some key of the tile after this warp's first row, or (V = 2) keys past the end */
            const bool masked =
                V >= 3 ? kbase + A2_BC - 1 > qw : (kbase + A2_BC - 1 > qw || kbase + A2_BC > Tn);
            const int dkr = kbase + 2 * tq - qw - gq; /* key - row of element (m, nt, e) = dkr + const */
            auto softmax = [&](auto mk) {
#pragma unroll
                for (int m = 0; m < MT; m++) {
                    /* V >= 3: the tile's maximum of the raw scores, scaled afterwards (the scale is positive:
                     * the same value), and the scale folded into the exponent's FFMA: one FMUL less per score
                     */
                    float m0 = V >= 3 ? -INFINITY : mx[m][0], m1 = V >= 3 ? -INFINITY : mx[m][1];
#pragma unroll
                    for (int nt = 0; nt < A2_BC / 8; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            float v = V >= 3 ? s[m][nt][e] : s[m][nt][e] * sl2;
                            if constexpr (V >= 3) {
                                if (decltype(mk)::value && dkr + nt * 8 + (e & 1) - 16 * m - 8 * (e >> 1) > 0)
                                    v = -INFINITY;
                            } else if (masked) {
                                const int key = kbase + nt * 8 + 2 * tq + (e & 1);
                                const int row = qw + 16 * m + gq + 8 * (e >> 1);
                                if (key > row || key >= Tn) v = -INFINITY;
                            }
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
                    if constexpr (V >= 3) {
                        m0 = fmaxf(mx[m][0], m0 * sl2);
                        m1 = fmaxf(mx[m][1], m1 * sl2);
                    }
                    /* a row with no visible key yet keeps max -inf: base 0 so nothing becomes NaN */
                    const float b0 = m0 == -INFINITY ? 0.f : m0, b1 = m1 == -INFINITY ? 0.f : m1;
                    const float c0 = a2_exp2<V>(mx[m][0] - b0), c1 = a2_exp2<V>(mx[m][1] - b1);
                    mx[m][0] = m0;
                    mx[m][1] = m1;
                    float l0 = l[m][0] * c0, l1 = l[m][1] * c1;
                    /* V >= 3: skipped when no row of the m-tile has a new maximum (every factor is exactly 1,
                     * the products would be the same bits); after the first tiles that is the common case */
                    if (V < 3 || __any_sync(0xffffffffu, c0 != 1.f || c1 != 1.f)) {
#pragma unroll
                        for (int dt = 0; dt < HS / 8; dt++) {
                            o[m][dt][0] *= c0;
                            o[m][dt][1] *= c0;
                            o[m][dt][2] *= c1;
                            o[m][dt][3] *= c1;
                        }
                    }
#pragma unroll
                    for (int nt = 0; nt < A2_BC / 8; nt++) {
                        if constexpr (V >= 3) {
                            s[m][nt][0] = a2_exp2<V>(fmaf(s[m][nt][0], sl2, -b0));
                            s[m][nt][1] = a2_exp2<V>(fmaf(s[m][nt][1], sl2, -b0));
                            s[m][nt][2] = a2_exp2<V>(fmaf(s[m][nt][2], sl2, -b1));
                            s[m][nt][3] = a2_exp2<V>(fmaf(s[m][nt][3], sl2, -b1));
                        } else {
                            s[m][nt][0] = a2_exp2<V>(s[m][nt][0] - b0);
                            s[m][nt][1] = a2_exp2<V>(s[m][nt][1] - b0);
                            s[m][nt][2] = a2_exp2<V>(s[m][nt][2] - b1);
                            s[m][nt][3] = a2_exp2<V>(s[m][nt][3] - b1);
                        }
                        l0 += s[m][nt][0] + s[m][nt][1];
                        l1 += s[m][nt][2] + s[m][nt][3];
                    }
                    l[m][0] = l0;
                    l[m][1] = l1;
                }
            };
            if (V >= 3 && masked)
                softmax(A2Bool<true>());
            else
                softmax(A2Bool<false>());
            mma2_pv<T, HS, MT, A2_BC / 16>(o, s, vs[buf]);
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
template <int HS> struct Attn2Smem {
    static constexpr int LDS = HS + 8;
    static constexpr size_t kv =
        (size_t)A2_BR * LDS; /* elements of the block's 128 rows of K (or V, Q, dO) */
    static constexpr size_t tile = (size_t)A2_BC * LDS; /* elements of one streamed tile */
    static constexpr size_t bytes = (2 * kv + 4 * tile) * sizeof(uint16_t) + 4 * A2_BC * sizeof(float);
};

/* Query pass: the block owns 128 queries, warp w 32 of them; dQ = dS·K accumulates over the key tiles,
 * each processed as two halves of 32 keys (to bound the registers S and dP take). Q fragments stay in
 * registers; the block's dO rows stay in shared memory (the A operand of dP, read with ldmatrix); the
 * first 128-row region of the shared layout (Qb) is left unused. */
template <typename T, int HS, int V>
static __device__ __forceinline__ void
attn2_bwd_q(unsigned char *a2_smem, int qb, int bh, T *dqkv, const T *dout, const T *qkv, const float *lse,
            const float *delta, int Tn, int C, int NH, float sl2, float scale) {
    using SM = Attn2Smem<HS>;
    constexpr int LDS = HS + 8, NT = 32 * A2_NW, MT = A2_MT, HB = A2_BC / 2;
    uint16_t *Qb = reinterpret_cast<uint16_t *>(a2_smem), *Ob = Qb + SM::kv; /* the block's Q, dO rows */
    uint16_t *Ks = Ob + SM::kv;                                              /* [2][tile]: K tiles */
    uint16_t *Vs = Ob + SM::kv + 2 * SM::tile;                               /* [2][tile]: V tiles */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    const int b = bh / NH, h = bh % NH;
    const size_t C3 = 3 * (size_t)C;
    const uint16_t *base = reinterpret_cast<const uint16_t *>(qkv) + (size_t)b * Tn * C3 + h * HS;
    const uint16_t *dob = reinterpret_cast<const uint16_t *>(dout) + (size_t)b * Tn * C + h * HS;
    const uint16_t *kg = base + C, *vg = base + 2 * C;
    const int q0 = qb * A2_BR, qw = q0 + warp * 16 * MT; /* this warp: rows [qw, qw + 32) */
    const uint16_t *Ow = Ob + (size_t)(qw - q0) * LDS;

    uint32_t qa[MT][HS / 16][4];
    /* V >= 5: the warp's dO rows as register fragments too (no ldmatrix of them per half tile) */
    uint32_t oa[V >= 5 ? MT : 1][HS / 16][4];
    float Lr[MT][2], Dr[MT][2], dq[MT][HS / 8][4];
    const float *L = lse + (size_t)bh * Tn, *D = delta + (size_t)bh * Tn;
#pragma unroll
    for (int m = 0; m < MT; m++) {
        load_a_frags<HS>(qa[m], base, C3, qw + 16 * m, Tn);
        if constexpr (V >= 5) load_a_frags<HS>(oa[m], dob, C, qw + 16 * m, Tn);
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
    const int nkb = min(q0 + A2_BR - 1, Tn - 1) / A2_BC + 1;
    if constexpr (V < 5) a2_tile_load<V, HS, NT, A2_BR>(Ob, dob + (size_t)q0 * C, C, Tn - q0);
    a2_tile_load<V, HS, NT, A2_BC>(Ks, kg, C3, Tn);
    a2_tile_load<V, HS, NT, A2_BC>(Vs, vg, C3, Tn);
    cp_async_commit();
    for (int kb = 0; kb < nkb; kb++) {
        const int buf = kb & 1;
        if (kb + 1 < nkb) {
            const int k1 = (kb + 1) * A2_BC;
            a2_tile_load<V, HS, NT, A2_BC>(Ks + (buf ^ 1) * SM::tile, kg + (size_t)k1 * C3, C3, Tn - k1);
            a2_tile_load<V, HS, NT, A2_BC>(Vs + (buf ^ 1) * SM::tile, vg + (size_t)k1 * C3, C3, Tn - k1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
#pragma unroll(V == 4 ? 2 : 1)
        for (int hf = 0; hf < 2; hf++) {
            const int kbase = kb * A2_BC + hf * HB;
            if (kbase <= qw + 16 * MT - 1) { /* else every key of the half is after this warp's rows */
                const bool masked = V >= 3 ? kbase + HB - 1 > qw : (kbase + HB - 1 > qw || kbase + HB > Tn);
                const uint16_t *K = Ks + buf * SM::tile + hf * HB * LDS,
                               *Vt = Vs + buf * SM::tile + hf * HB * LDS;
                float p[MT][HB / 8][4], dp[MT][HB / 8][4];
                mma2_abt_r<T, HS, MT, HB / 8>(p, qa, K);
                if constexpr (V >= 5)
                    mma2_abt_r<T, HS, MT, HB / 8>(dp, oa, Vt);
                else
                    mma2_abt_s<T, HS, MT, HB / 8>(dp, Ow, Vt);
                const int dkr = kbase + 2 * tq - qw - gq; /* key - row of element (m, nt, e) = dkr + const */
                auto ds = [&](auto mk) {
#pragma unroll
                    for (int m = 0; m < MT; m++)
#pragma unroll
                        for (int nt = 0; nt < HB / 8; nt++)
#pragma unroll
                            for (int e = 0; e < 4; e++) {
                                float pe = a2_exp2<V>(fmaf(p[m][nt][e], sl2, -Lr[m][e >> 1]));
                                if constexpr (V >= 3) {
                                    if (decltype(mk)::value &&
                                        dkr + nt * 8 + (e & 1) - 16 * m - 8 * (e >> 1) > 0)
                                        pe = 0.f;
                                } else if (masked) {
                                    const int key = kbase + nt * 8 + 2 * tq + (e & 1);
                                    const int row = qw + 16 * m + gq + 8 * (e >> 1);
                                    if (!(key <= row && key < Tn && row < Tn)) pe = 0.f;
                                }
                                dp[m][nt][e] = pe * (dp[m][nt][e] - Dr[m][e >> 1]);
                            }
                };
                if (V >= 3 && masked)
                    ds(A2Bool<true>());
                else
                    ds(A2Bool<false>());
                mma2_pv<T, HS, MT, HB / 16>(dq, dp, K);
            }
        }
        __syncthreads();
    }
    T *dst = dqkv + (size_t)b * Tn * C3 + h * HS;
#pragma unroll
    for (int m = 0; m < MT; m++)
        store_rows<T, HS>(dst, C3, qw + 16 * m, Tn, dq[m], scale, scale);
}

/* The key/value pass's per-query f32 values of one streamed tile (queries q1 + [0, 64)): logsumexp and
 * delta, 0 past Tn. V = 2: plain loads, the logsumexp stored times log2(e) (the threads wait for the
 * loads before the barrier); V >= 3: cp.async into the tile's group (no wait), the logsumexp stored as is
 * and multiplied by log2(e) where it is read (the same product). */
template <int V>
static __device__ __forceinline__ void a2_rows_f32(float *lsb, float *dlb, const float *L, const float *D,
                                                   int q1, int Tn) {
    if (threadIdx.x < A2_BC) {
        const int q = q1 + threadIdx.x;
        if constexpr (V >= 3) {
            const bool ok = q < Tn;
            cp_async4(lsb + threadIdx.x, ok ? L + q : L, ok);
            cp_async4(dlb + threadIdx.x, ok ? D + q : D, ok);
        } else {
            lsb[threadIdx.x] = q < Tn ? L[q] * ATT_LOG2E : 0.f;
            dlb[threadIdx.x] = q < Tn ? D[q] : 0.f;
        }
    }
}

/* Key/value pass: the block owns keys [kb*128, kb*128+128) (kept in shared memory: K and V are the A
 * operands), warp w 32 of them; it computes Sᵀ = K·Qᵀ, Pᵀ, dPᵀ = V·dOᵀ and dSᵀ for every query tile at or
 * after its keys, half a tile (32 queries) at a time, and accumulates dV += Pᵀ·dO, dK += dSᵀ·Q. */

template <typename T, int HS, int V>
static __device__ __forceinline__ void
attn2_bwd_kv(unsigned char *a2_smem, int kb, int bh, T *dqkv, const T *dout, const T *qkv, const float *lse,
             const float *delta, int Tn, int C, int NH, float sl2, float scale) {
    using SM = Attn2Smem<HS>;
    constexpr int LDS = HS + 8, NT = 32 * A2_NW, MT = A2_MT, HB = A2_BC / 2;
    uint16_t *Ks = reinterpret_cast<uint16_t *>(a2_smem), *Vs = Ks + SM::kv;
    uint16_t *Qs = Vs + SM::kv;                /* [2][tile]: Q tiles, double-buffered */
    uint16_t *Os = Vs + SM::kv + 2 * SM::tile; /* [2][tile]: dO tiles */
    float *lsb = reinterpret_cast<float *>(Vs + SM::kv + 4 * SM::tile); /* [2][A2_BC] */
    float *dlb = lsb + 2 * A2_BC;                                       /* [2][A2_BC] */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
    const int b = bh / NH, h = bh % NH;
    const size_t C3 = 3 * (size_t)C;
    const uint16_t *base = reinterpret_cast<const uint16_t *>(qkv) + (size_t)b * Tn * C3 + h * HS;
    const uint16_t *dob = reinterpret_cast<const uint16_t *>(dout) + (size_t)b * Tn * C + h * HS;
    const float *L = lse + (size_t)bh * Tn, *D = delta + (size_t)bh * Tn;
    const int k0 = kb * A2_BR, kw = k0 + warp * 16 * MT; /* this warp: keys [kw, kw + 32) */
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
    const int nqb = (Tn + A2_BC - 1) / A2_BC, qb0 = k0 / A2_BC;
    a2_tile_load<V, HS, NT, A2_BR>(Ks, base + C + (size_t)k0 * C3, C3, Tn - k0);
    a2_tile_load<V, HS, NT, A2_BR>(Vs, base + 2 * C + (size_t)k0 * C3, C3, Tn - k0);
    {
        const int q1 = qb0 * A2_BC;
        a2_tile_load<V, HS, NT, A2_BC>(Qs, base + (size_t)q1 * C3, C3, Tn - q1);
        a2_tile_load<V, HS, NT, A2_BC>(Os, dob + (size_t)q1 * C, C, Tn - q1);
        if (V >= 3) a2_rows_f32<V>(lsb, dlb, L, D, q1, Tn);
        cp_async_commit();
        if (V < 3) a2_rows_f32<V>(lsb, dlb, L, D, q1, Tn);
    }
    for (int qb = qb0, it = 0; qb < nqb; qb++, it++) {
        const int buf = it & 1;
        if (qb + 1 < nqb) {
            const int q1 = (qb + 1) * A2_BC;
            a2_tile_load<V, HS, NT, A2_BC>(Qs + (buf ^ 1) * SM::tile, base + (size_t)q1 * C3, C3, Tn - q1);
            a2_tile_load<V, HS, NT, A2_BC>(Os + (buf ^ 1) * SM::tile, dob + (size_t)q1 * C, C, Tn - q1);
            if (V >= 3) a2_rows_f32<V>(lsb + (buf ^ 1) * A2_BC, dlb + (buf ^ 1) * A2_BC, L, D, q1, Tn);
            cp_async_commit();
            if (V < 3) a2_rows_f32<V>(lsb + (buf ^ 1) * A2_BC, dlb + (buf ^ 1) * A2_BC, L, D, q1, Tn);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const float *Ls = lsb + buf * A2_BC, *Ds = dlb + buf * A2_BC;
#pragma unroll(V == 4 ? 2 : 1)
        for (int hf = 0; hf < 2; hf++) {
            const int qbase = qb * A2_BC + hf * HB;
            /* a half wholly before this warp's first key sees none of its keys: nothing to add */
            if (qbase + HB - 1 >= kw) {
                const bool masked = V >= 3
                                        ? qbase < kw + 16 * MT - 1
                                        : (qbase < kw + 16 * MT - 1 || qbase + HB > Tn || kw + 16 * MT > Tn);
                const uint16_t *Q = Qs + buf * SM::tile + hf * HB * LDS,
                               *DO = Os + buf * SM::tile + hf * HB * LDS;
                float p[MT][HB / 8][4];
                mma2_abt_s<T, HS, MT, HB / 8>(p, Kw, Q);
                /* V >= 3: dPᵀ's MMAs issue before the exponentials, so the tensor cores work during them */
                float dp[MT][HB / 8][4];
                if constexpr (V >= 3) mma2_abt_s<T, HS, MT, HB / 8>(dp, Vw, DO);
                const int dqk =
                    qbase + 2 * tq - kw - gq; /* query - key of element (m, nt, e) = dqk + const */
                auto probs = [&](auto mk) {
#pragma unroll
                    for (int m = 0; m < MT; m++)
#pragma unroll
                        for (int nt = 0; nt < HB / 8; nt++)
#pragma unroll
                            for (int e = 0; e < 4; e++) {
                                const int qi =
                                    hf * HB + nt * 8 + 2 * tq + (e & 1); /* query within the tile */
                                const float lq = V >= 3 ? Ls[qi] * ATT_LOG2E : Ls[qi];
                                float v = a2_exp2<V>(fmaf(p[m][nt][e], sl2, -lq));
                                if constexpr (V >= 3) {
                                    if (decltype(mk)::value &&
                                        dqk + nt * 8 + (e & 1) - 16 * m - 8 * (e >> 1) < 0)
                                        v = 0.f;
                                } else if (masked) {
                                    const int q = qb * A2_BC + qi, key = kw + 16 * m + gq + 8 * (e >> 1);
                                    if (!(q >= key && q < Tn && key < Tn)) v = 0.f;
                                }
                                p[m][nt][e] = v;
                            }
                };
                if (V >= 3 && masked)
                    probs(A2Bool<true>());
                else
                    probs(A2Bool<false>());
                mma2_pv<T, HS, MT, HB / 16>(dv, p, DO);
                if constexpr (V < 3) mma2_abt_s<T, HS, MT, HB / 8>(dp, Vw, DO);
#pragma unroll
                for (int m = 0; m < MT; m++)
#pragma unroll
                    for (int nt = 0; nt < HB / 8; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int qi = hf * HB + nt * 8 + 2 * tq + (e & 1);
                            dp[m][nt][e] = p[m][nt][e] * (dp[m][nt][e] - Ds[qi]);
                        }
                mma2_pv<T, HS, MT, HB / 16>(dk, dp, Q);
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

/* Both backward passes in one launch (they are independent: dK, dV and dQ are disjoint parts of dqkv), so
 * neither waits for the other's tail. grid = (2 * nb, B * NH): the blocks of one head run together (they
 * share its tiles in L2), heaviest first, alternating a key/value block (key block j: the most queries
 * for j = 0) and a query block (query block nb - 1 - j: the most keys). */
template <typename T, int HS, int V>
__global__ void __launch_bounds__(32 * A2_NW)
    attn2_bwd(T *dqkv, const T *dout, const T *qkv, const float *lse, const float *delta, int Tn, int C,
              int NH, float sl2, float scale) {
    extern __shared__ __align__(16) unsigned char a2_smem[];
    const int bh = blockIdx.y, j = blockIdx.x >> 1, nb = gridDim.x >> 1;
    if ((blockIdx.x & 1) == 0)
        attn2_bwd_kv<T, HS, V>(a2_smem, j, bh, dqkv, dout, qkv, lse, delta, Tn, C, NH, sl2, scale);
    else
        attn2_bwd_q<T, HS, V>(a2_smem, nb - 1 - j, bh, dqkv, dout, qkv, lse, delta, Tn, C, NH, sl2, scale);
}

/* delta[bh, t] = rowsum(dO ∘ O) for implementation 2: HS / 8 lanes per (b, t, h) row (rows in memory
 * order), one 16-byte load of each operand per lane, then a fixed shuffle tree. */
template <typename T, int HS>
__global__ void __launch_bounds__(256)
    attn2_delta(float *delta, const T *dout, const T *out, int Tn, int NH, size_t nrows) {
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
static dg_status_t delta2_launch(dg_cuda_t *c, float *delta, const void *dout, const void *out, int B, int Tn,
                                 int NH) {
    const size_t nrows = (size_t)B * Tn * NH, nthreads = nrows * (HS / 8);
    attn2_delta<T, HS><<<(unsigned)((nthreads + 255) / 256), 256, 0, c->stream>>>(
        delta, (const T *)dout, (const T *)out, Tn, NH, nrows);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

template <typename T, int HS, int V>
static dg_status_t fwd2_launch(dg_cuda_t *c, void *out, float *lse, const void *qkv, int B, int Tn, int C,
                               int NH, float sl2) {
    dim3 grid((Tn + A2_BR - 1) / A2_BR, B * NH);
    attn2_fwd<T, HS, V><<<grid, 32 * A2_NW, 0, c->stream>>>((T *)out, lse, (const T *)qkv, Tn, C, NH, sl2);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

template <typename T, int HS, int V>
static dg_status_t bwd2_launch(dg_cuda_t *c, void *dqkv, const void *dout, const void *qkv, const float *lse,
                               const float *delta, int B, int Tn, int C, int NH, float sl2, float scale) {
    dim3 grid(2 * ((Tn + A2_BR - 1) / A2_BR), B * NH);
    const size_t smem = Attn2Smem<HS>::bytes;
    /* more than the 48 KiB default: opt in (every call: cheap, and right for any device of the process) */
    DG_CUDA_CHECK(
        cudaFuncSetAttribute(attn2_bwd<T, HS, V>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    attn2_bwd<T, HS, V><<<grid, 32 * A2_NW, smem, c->stream>>>((T *)dqkv, (const T *)dout, (const T *)qkv,
                                                               lse, delta, Tn, C, NH, sl2, scale);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

/* ======================= dispatch ======================= */

static bool use_mma(const dg_cuda_t *c, int HS) {
    return c->fast_attention && c->act != DG_F32 && (HS == 64 || HS == 32);
}

template <typename T, int HS, bool LDM, int NW>
static dg_status_t fwd_mma_nw(dg_cuda_t *c, void *out, float *lse, const void *qkv, int B, int Tn, int C,
                              int NH, float sl2) {
    dim3 grid((Tn + 16 * NW - 1) / (16 * NW), B * NH);
    attn_fwd_mma<T, HS, LDM, NW>
        <<<grid, 32 * NW, 0, c->stream>>>((T *)out, lse, (const T *)qkv, Tn, C, NH, sl2);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

template <typename T, int HS, bool LDM>
static dg_status_t fwd_mma_launch(dg_cuda_t *c, void *out, float *lse, const void *qkv, int B, int Tn, int C,
                                  int NH, float sl2) {
    return c->attn_rows == 128 ? fwd_mma_nw<T, HS, LDM, 8>(c, out, lse, qkv, B, Tn, C, NH, sl2)
                               : fwd_mma_nw<T, HS, LDM, 4>(c, out, lse, qkv, B, Tn, C, NH, sl2);
}

template <typename T, int HS, bool LDM, int NW>
static dg_status_t bwd_mma_nw(dg_cuda_t *c, void *dqkv, const void *dout, const void *qkv, const float *lse,
                              const float *delta, int B, int Tn, int C, int NH, float sl2, float scale) {
    dim3 grid((Tn + 16 * NW - 1) / (16 * NW), B * NH);
    attn_bwd_kv_mma<T, HS, LDM, NW><<<grid, 32 * NW, 0, c->stream>>>(
        (T *)dqkv, (const T *)dout, (const T *)qkv, lse, delta, Tn, C, NH, sl2, scale);
    DG_CUDA_LAUNCH_CHECK();
    attn_bwd_q_mma<T, HS, LDM, NW><<<grid, 32 * NW, 0, c->stream>>>(
        (T *)dqkv, (const T *)dout, (const T *)qkv, lse, delta, Tn, C, NH, sl2, scale);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

template <typename T, int HS, bool LDM>
static dg_status_t bwd_mma_launch(dg_cuda_t *c, void *dqkv, const void *dout, const void *qkv,
                                  const float *lse, const float *delta, int B, int Tn, int C, int NH,
                                  float sl2, float scale) {
    return c->attn_rows == 128
               ? bwd_mma_nw<T, HS, LDM, 8>(c, dqkv, dout, qkv, lse, delta, B, Tn, C, NH, sl2, scale)
               : bwd_mma_nw<T, HS, LDM, 4>(c, dqkv, dout, qkv, lse, delta, B, Tn, C, NH, sl2, scale);
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
            if (c->attn_impl >= 3) /* implementation 4 differs in the backward only */
                return HS == 64 ? fwd2_launch<T, 64, 3>(c, out, lse, qkv, B, Tn, C, NH, sl2)
                                : fwd2_launch<T, 32, 3>(c, out, lse, qkv, B, Tn, C, NH, sl2);
            if (c->attn_impl == 2)
                return HS == 64 ? fwd2_launch<T, 64, 2>(c, out, lse, qkv, B, Tn, C, NH, sl2)
                                : fwd2_launch<T, 32, 2>(c, out, lse, qkv, B, Tn, C, NH, sl2);
            if (HS == 64)
                return c->attn_ldmatrix ? fwd_mma_launch<T, 64, true>(c, out, lse, qkv, B, Tn, C, NH, sl2)
                                        : fwd_mma_launch<T, 64, false>(c, out, lse, qkv, B, Tn, C, NH, sl2);
            return c->attn_ldmatrix ? fwd_mma_launch<T, 32, true>(c, out, lse, qkv, B, Tn, C, NH, sl2)
                                    : fwd_mma_launch<T, 32, false>(c, out, lse, qkv, B, Tn, C, NH, sl2);
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
    dim3 ggrid((Tn + GEN_WARPS - 1) / GEN_WARPS, B * NH);
    if constexpr (sizeof(T) == 2) {
        if (use_mma(c, HS) && c->attn_impl >= 2 && dg_ptr_aligned(qkv, 16) && dg_ptr_aligned(dout, 16) &&
            dg_ptr_aligned(dqkv, 16) && dg_ptr_aligned(out, 16)) {
            const float sl2 = scale * ATT_LOG2E;
            const dg_status_t ds = HS == 64 ? delta2_launch<T, 64>(c, delta, dout, out, B, Tn, NH)
                                            : delta2_launch<T, 32>(c, delta, dout, out, B, Tn, NH);
            if (ds != DG_OK) return ds;
            if (c->attn_impl == 5)
                return HS == 64
                           ? bwd2_launch<T, 64, 5>(c, dqkv, dout, qkv, lse, delta, B, Tn, C, NH, sl2, scale)
                           : bwd2_launch<T, 32, 5>(c, dqkv, dout, qkv, lse, delta, B, Tn, C, NH, sl2, scale);
            if (c->attn_impl == 4)
                return HS == 64
                           ? bwd2_launch<T, 64, 4>(c, dqkv, dout, qkv, lse, delta, B, Tn, C, NH, sl2, scale)
                           : bwd2_launch<T, 32, 4>(c, dqkv, dout, qkv, lse, delta, B, Tn, C, NH, sl2, scale);
            if (c->attn_impl == 3)
                return HS == 64
                           ? bwd2_launch<T, 64, 3>(c, dqkv, dout, qkv, lse, delta, B, Tn, C, NH, sl2, scale)
                           : bwd2_launch<T, 32, 3>(c, dqkv, dout, qkv, lse, delta, B, Tn, C, NH, sl2, scale);
            return HS == 64 ? bwd2_launch<T, 64, 2>(c, dqkv, dout, qkv, lse, delta, B, Tn, C, NH, sl2, scale)
                            : bwd2_launch<T, 32, 2>(c, dqkv, dout, qkv, lse, delta, B, Tn, C, NH, sl2, scale);
        }
    }
    attn_delta_kernel<T>
        <<<ggrid, 32 * GEN_WARPS, 0, c->stream>>>(delta, (const T *)dout, (const T *)out, Tn, C, NH);
    DG_CUDA_LAUNCH_CHECK();
    if constexpr (sizeof(T) == 2) {
        if (use_mma(c, HS) && dg_ptr_aligned(qkv, 16) && dg_ptr_aligned(dout, 16) &&
            dg_ptr_aligned(dqkv, 16)) {
            const float sl2 = scale * ATT_LOG2E;
            if (HS == 64)
                return c->attn_ldmatrix ? bwd_mma_launch<T, 64, true>(c, dqkv, dout, qkv, lse, delta, B, Tn,
                                                                      C, NH, sl2, scale)
                                        : bwd_mma_launch<T, 64, false>(c, dqkv, dout, qkv, lse, delta, B, Tn,
                                                                       C, NH, sl2, scale);
            return c->attn_ldmatrix
                       ? bwd_mma_launch<T, 32, true>(c, dqkv, dout, qkv, lse, delta, B, Tn, C, NH, sl2, scale)
                       : bwd_mma_launch<T, 32, false>(c, dqkv, dout, qkv, lse, delta, B, Tn, C, NH, sl2,
                                                      scale);
        }
    }
    attn_bwd_kv_generic<T><<<ggrid, 32 * GEN_WARPS, 0, c->stream>>>(
        (T *)dqkv, (const T *)dout, (const T *)qkv, lse, delta, Tn, C, NH, scale);
    DG_CUDA_LAUNCH_CHECK();
    attn_bwd_q_generic<T><<<ggrid, 32 * GEN_WARPS, 0, c->stream>>>((T *)dqkv, (const T *)dout, (const T *)qkv,
                                                                   lse, delta, Tn, C, NH, scale);
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
