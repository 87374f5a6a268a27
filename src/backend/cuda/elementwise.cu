/* elementwise.cu — memory-bound kernels of the CUDA backend: cast, add, accumulate, GELU, the unfused
 * GEMM epilogues (bias, bias+GELU, bias gradient), the gradient-norm reduction (one tensor, or every
 * tensor of a segment table in three launches), clip factor and the fused AdamW update.
 *
 * Elementwise kernels move 16 bytes per thread and access when every pointer allows it, with a scalar
 * tail. Reductions (sumsq, column sums) use a partition that depends only on the problem size and a
 * fixed combination order, so their results are bitwise reproducible and independent of the GPU model.
 */
#include <stdlib.h>

#include "cuda_impl.cuh"
#include "cuda_vec.cuh"

/* ---------------- generic elementwise launcher ---------------- */

template <int V, typename Op> __global__ void ew_kernel(Op op, size_t start, size_t nvec) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += stride)
        op.template apply<V>(start + i * V);
}

/* Runs op.apply<V> over [0, n): vector part when `aligned`, then the scalar tail. */
template <int V, typename Op>
static dg_status_t ew_launch(dg_cuda_t *c, const Op &op, size_t n, bool aligned) {
    size_t done = 0;
    if (aligned && n >= (size_t)V) {
        size_t nv = n / V;
        ew_kernel<V, Op><<<dg_cuda_blocks(nv, 256, 65535), 256, 0, c->stream>>>(op, 0, nv);
        DG_CUDA_LAUNCH_CHECK();
        done = nv * V;
    }
    if (done < n) {
        ew_kernel<1, Op><<<dg_cuda_blocks(n - done, 256, 65535), 256, 0, c->stream>>>(op, done, n - done);
        DG_CUDA_LAUNCH_CHECK();
    }
    return DG_OK;
}

static bool al16(const void *a, const void *b = nullptr, const void *d = nullptr, const void *e = nullptr) {
    return dg_ptr_aligned(a, 16) && dg_ptr_aligned(b, 16) && dg_ptr_aligned(d, 16) && dg_ptr_aligned(e, 16);
}

/* ---------------- cast ---------------- */

template <typename D, typename S> struct CastOp {
    D *dst;
    const S *src;
    template <int V> __device__ void apply(size_t i) const {
        float f[V];
        dg_ldv<V>(f, src + i);
        dg_stv<V>(dst + i, f);
    }
};

template <typename D, typename S>
static dg_status_t cast_t(dg_cuda_t *c, void *dst, const void *src, size_t n) {
    CastOp<D, S> op{(D *)dst, (const S *)src};
    return ew_launch<4>(c, op, n, al16(dst, src));
}

template <typename D>
static dg_status_t cast_to(dg_cuda_t *c, void *dst, const void *src, dg_dtype_t st, size_t n) {
    if (st == DG_F32) return cast_t<D, float>(c, dst, src, n);
    if (st == DG_BF16) return cast_t<D, dg_bf16>(c, dst, src, n);
    return cast_t<D, dg_f16>(c, dst, src, n);
}

dg_status_t dg_cuda_cast(dg_cuda_t *c, void *dst, dg_dtype_t dt, const void *src, dg_dtype_t st, size_t n) {
    if (dt == st) {
        if (dst != src)
            DG_CUDA_CHECK(
                cudaMemcpyAsync(dst, src, n * dg_dtype_size(dt), cudaMemcpyDeviceToDevice, c->stream));
        return DG_OK;
    }
    if (dt == DG_F32) return cast_to<float>(c, dst, src, st, n);
    if (dt == DG_BF16) return cast_to<dg_bf16>(c, dst, src, st, n);
    return cast_to<dg_f16>(c, dst, src, st, n);
}

/* ---------------- add / accumulate ---------------- */

template <typename T> struct AddOp {
    T *out;
    const T *a, *b;
    template <int V> __device__ void apply(size_t i) const {
        float x[V], y[V];
        dg_ldv<V>(x, a + i);
        dg_ldv<V>(y, b + i);
        for (int j = 0; j < V; j++)
            x[j] += y[j];
        dg_stv<V>(out + i, x);
    }
};

template <typename T>
static dg_status_t add_t(dg_cuda_t *c, void *out, const void *a, const void *b, size_t n) {
    AddOp<T> op{(T *)out, (const T *)a, (const T *)b};
    return ew_launch<16 / sizeof(T)>(c, op, n, al16(out, a, b));
}

dg_status_t dg_cuda_add(dg_cuda_t *c, void *out, const void *a, const void *b, size_t n) {
    return DG_CUDA_DISPATCH_ACT(c->act, add_t, c, out, a, b, n);
}

dg_status_t dg_cuda_accumulate(dg_cuda_t *c, void *dst, const void *src, size_t n, int acc) {
    if (!acc) {
        if (dst != src)
            DG_CUDA_CHECK(
                cudaMemcpyAsync(dst, src, n * dg_dtype_size(c->act), cudaMemcpyDeviceToDevice, c->stream));
        return DG_OK;
    }
    return dg_cuda_add(c, dst, dst, src, n);
}

dg_status_t dg_cuda_add_f32(dg_cuda_t *c, float *dst, const float *src, size_t n) {
    return ew_launch<4>(c, AddOp<float>{dst, dst, src}, n, al16(dst, src)); /* the f32 dg_cuda_add's kernel */
}

struct ScaleOp {
    float *x;
    float s;
    template <int V> __device__ void apply(size_t i) const {
        float f[V];
        dg_ldv<V>(f, x + i);
        for (int j = 0; j < V; j++)
            f[j] *= s;
        dg_stv<V>(x + i, f);
    }
};

dg_status_t dg_cuda_scale_f32(dg_cuda_t *c, float *x, size_t n, float s) {
    return ew_launch<4>(c, ScaleOp{x, s}, n, al16(x));
}

/* ---------------- GELU (tanh approximation) ---------------- */

#define DG_GELU_K 0.7978845608028654f /* sqrt(2/pi) */

static __device__ __forceinline__ float gelu_f(float x) {
    float u = DG_GELU_K * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.f + tanhf(u));
}
static __device__ __forceinline__ float gelu_grad_f(float x) {
    float x2 = x * x;
    float th = tanhf(DG_GELU_K * (x + 0.044715f * x2 * x));
    return 0.5f * (1.f + th) + 0.5f * x * (1.f - th * th) * DG_GELU_K * (1.f + 3.f * 0.044715f * x2);
}

template <typename T> struct GeluFwdOp {
    T *out;
    const T *inp;
    template <int V> __device__ void apply(size_t i) const {
        float f[V];
        dg_ldv<V>(f, inp + i);
        for (int j = 0; j < V; j++)
            f[j] = gelu_f(f[j]);
        dg_stv<V>(out + i, f);
    }
};

template <typename T> struct GeluBwdOp {
    T *dinp;
    const T *inp, *dout;
    int acc;
    template <int V> __device__ void apply(size_t i) const {
        float x[V], d[V], o[V];
        dg_ldv<V>(x, inp + i);
        dg_ldv<V>(d, dout + i);
        if (acc) dg_ldv<V>(o, dinp + i);
        for (int j = 0; j < V; j++)
            o[j] = (acc ? o[j] : 0.f) + d[j] * gelu_grad_f(x[j]);
        dg_stv<V>(dinp + i, o);
    }
};

template <typename T> static dg_status_t gelu_fwd_t(dg_cuda_t *c, void *out, const void *inp, size_t n) {
    return ew_launch<16 / sizeof(T)>(c, GeluFwdOp<T>{(T *)out, (const T *)inp}, n, al16(out, inp));
}
template <typename T>
static dg_status_t gelu_bwd_t(dg_cuda_t *c, void *dinp, const void *inp, const void *dout, size_t n,
                              int acc) {
    return ew_launch<16 / sizeof(T)>(c, GeluBwdOp<T>{(T *)dinp, (const T *)inp, (const T *)dout, acc}, n,
                                     al16(dinp, inp, dout));
}

dg_status_t dg_cuda_gelu_fwd(dg_cuda_t *c, void *out, const void *inp, size_t n) {
    return DG_CUDA_DISPATCH_ACT(c->act, gelu_fwd_t, c, out, inp, n);
}
dg_status_t dg_cuda_gelu_bwd(dg_cuda_t *c, void *dinp, const void *inp, const void *dout, size_t n, int acc) {
    return DG_CUDA_DISPATCH_ACT(c->act, gelu_bwd_t, c, dinp, inp, dout, n, acc);
}

/* ---------------- unfused GEMM epilogues ---------------- */

/* out[N,OC] += bias (if any); with gelu: pre = that, out = gelu(pre). */
template <typename T>
__global__ void bias_gelu_kernel(T *out, T *pre, const T *bias, size_t total, int OC, int gelu) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        float x = dg_to_f(out[i]);
        if (bias) x += dg_to_f(bias[i % OC]);
        if (gelu) {
            T p = dg_from_f<T>(x);
            pre[i] = p;
            out[i] = dg_from_f<T>(gelu_f(dg_to_f(p)));
        } else {
            out[i] = dg_from_f<T>(x);
        }
    }
}

template <typename T>
static dg_status_t bias_gelu_t(dg_cuda_t *c, void *out, void *pre, const void *bias, int N, int OC,
                               int gelu) {
    size_t total = (size_t)N * OC;
    bias_gelu_kernel<T><<<dg_cuda_blocks(total, 256, 65535), 256, 0, c->stream>>>(
        (T *)out, (T *)pre, (const T *)bias, total, OC, gelu);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

dg_status_t dg_cuda_bias_gelu(dg_cuda_t *c, void *out, void *pre, const void *bias, int N, int OC, int gelu) {
    if (!bias && !gelu) return DG_OK;
    return DG_CUDA_DISPATCH_ACT(c->act, bias_gelu_t, c, out, pre, bias, N, OC, gelu);
}

/* Column sums dst[c] += sum_n src[n, c] (the bias gradient of a linear layer), deterministic, two levels:
 *   1. colsum_partial_kernel, one block per (column tile, slab of CS_ROWS rows): 8 warps; a lane owns V
 *      consecutive columns read as one 16-byte vector (a warp's tile is 32 V columns: 512 B of a bf16
 *      row), warp w adds rows slab + w, slab + w + 8, ... in row order with CS_UNROLL rows' loads in
 *      flight; the block adds its warps in warp order and writes one partial row;
 *   2. dg_cuda_rowsum_acc adds the slabs' partial rows into dst.
 * Every column's additions happen in an order that depends only on N: the vector width (16-byte or
 * element loads, by C and alignment) changes which thread adds, not the order, so the bits are the same
 * either way. Bytes: the source once (452 MB per GPT-2 124M layer at B*T = 32768, bf16: ~0.14 ms at
 * ~3.2 TB/s) plus N/128 partial rows written and read (3 % of the source for bf16). */
#define CS_WARPS 8
#define CS_ROWS 128 /* rows per slab: N = 32768 gives 256 slabs, 768-3072 blocks at C = 768-3072 */
#define CS_UNROLL 4

template <typename T, int V>
__global__ void __launch_bounds__(32 * CS_WARPS)
    colsum_partial_kernel(float *part, const T *src, int N, int C, int slab) {
    __shared__ float sh[CS_WARPS][V][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int col = (blockIdx.x * 32 + lane) * V;
    const int r0 = blockIdx.y * slab, r1 = min(N, r0 + slab);
    float s[V];
#pragma unroll
    for (int j = 0; j < V; j++)
        s[j] = 0.f;
    if (col < C) { /* C % V == 0 when V > 1: the whole vector is in */
        const T *p = src + col;
        int r = r0 + warp;
        for (; r + (CS_UNROLL - 1) * CS_WARPS < r1; r += CS_UNROLL * CS_WARPS) {
            float f[CS_UNROLL][V];
#pragma unroll
            for (int u = 0; u < CS_UNROLL; u++)
                dg_ldv<V>(f[u], p + (size_t)(r + u * CS_WARPS) * C);
#pragma unroll
            for (int u = 0; u < CS_UNROLL; u++)
#pragma unroll
                for (int j = 0; j < V; j++)
                    s[j] += f[u][j];
        }
        for (; r < r1; r += CS_WARPS) {
            float f[V];
            dg_ldv<V>(f, p + (size_t)r * C);
#pragma unroll
            for (int j = 0; j < V; j++)
                s[j] += f[j];
        }
    }
#pragma unroll
    for (int j = 0; j < V; j++)
        sh[warp][j][lane] = s[j];
    __syncthreads();
    for (int t = threadIdx.x; t < 32 * V; t += blockDim.x) { /* column tile + t = (tile + l) V + j */
        const int l = t / V, j = t % V;
        const int cc = blockIdx.x * 32 * V + t;
        if (cc >= C) continue;
        float a = 0.f;
#pragma unroll
        for (int q = 0; q < CS_WARPS; q++)
            a += sh[q][j][l];
        part[(size_t)blockIdx.y * C + cc] = a;
    }
}

template <typename T> static dg_status_t colsum_t(dg_cuda_t *c, float *dst, const void *src, int N, int C) {
    constexpr int V = 16 / sizeof(T);
    if (N <= 0 || C <= 0) return DG_OK;
    int slab = CS_ROWS, slabs = (N + CS_ROWS - 1) / CS_ROWS;
    if (slabs > 65535) { /* grid.y limit: larger slabs (still a function of N only) */
        slab = CS_ROWS * ((slabs + 65534) / 65535);
        slabs = (N + slab - 1) / slab;
    }
    void *scr = NULL;
    DG_TRY(dg_cuda_scratch(c, (size_t)slabs * C * sizeof(float), &scr));
    float *part = (float *)scr;
    if (C % V == 0 && dg_ptr_aligned(src, 16))
        colsum_partial_kernel<T, V>
            <<<dim3((C + 32 * V - 1) / (32 * V), slabs), 32 * CS_WARPS, 0, c->stream>>>(part, (const T *)src,
                                                                                        N, C, slab);
    else
        colsum_partial_kernel<T, 1>
            <<<dim3((C + 31) / 32, slabs), 32 * CS_WARPS, 0, c->stream>>>(part, (const T *)src, N, C, slab);
    DG_CUDA_LAUNCH_CHECK();
    return dg_cuda_rowsum_acc(c, dst, NULL, C, part, slabs, C);
}

dg_status_t dg_cuda_colsum_acc(dg_cuda_t *c, float *dst, const void *src, int N, int C) {
    return DG_CUDA_DISPATCH_ACT(c->act, colsum_t, c, dst, src, N, C);
}

/* The last level of the column sums (layernorm's dw/db, colsum's bias gradients): a block per 32
 * columns of the [P, W] partial matrix, RS_WARPS warps; warp w adds rows w, w + RS_WARPS, ... in row
 * order (RS_UNROLL coalesced 128-byte loads in flight per warp: the partials were just written, so this
 * is mostly L2 traffic), then warp 0 adds the warps' sums in warp order and adds the total to the
 * destination. The order depends only on P. With P = 512, W = 1536 (layernorm at N = 32768, C = 768):
 * 48 blocks of 16 warps reading 3 MiB, where the kernel it replaces ran (W + 255) / 256 = 3 blocks of
 * single-column loops over all 512 rows (23 us). */
#define RS_WARPS 16
#define RS_UNROLL 8

__global__ void __launch_bounds__(32 * RS_WARPS)
    rowsum_acc_kernel(float *lo, float *hi, int split, const float *part, int P, int W) {
    __shared__ float sh[RS_WARPS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int col = blockIdx.x * 32 + lane;
    float s = 0.f;
    if (col < W) {
        const float *p = part + col;
        int r = warp;
        for (; r + (RS_UNROLL - 1) * RS_WARPS < P; r += RS_UNROLL * RS_WARPS) {
            float v[RS_UNROLL];
#pragma unroll
            for (int u = 0; u < RS_UNROLL; u++)
                v[u] = p[(size_t)(r + u * RS_WARPS) * W];
#pragma unroll
            for (int u = 0; u < RS_UNROLL; u++)
                s += v[u];
        }
        for (; r < P; r += RS_WARPS)
            s += p[(size_t)r * W];
    }
    sh[warp][lane] = s;
    __syncthreads();
    if (warp != 0 || col >= W) return;
    float t = 0.f;
#pragma unroll
    for (int q = 0; q < RS_WARPS; q++)
        t += sh[q][lane];
    if (col < split) {
        if (lo) lo[col] += t;
    } else if (hi) {
        hi[col - split] += t;
    }
}

dg_status_t dg_cuda_rowsum_acc(dg_cuda_t *c, float *lo, float *hi, int split, const float *part, int P,
                               int W) {
    if (P <= 0 || W <= 0 || (!lo && !hi)) return DG_OK;
    rowsum_acc_kernel<<<(W + 31) / 32, 32 * RS_WARPS, 0, c->stream>>>(lo, hi, split, part, P, W);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

/* ---------------- gradient norm, clip factor ---------------- */

#define SUMSQ_THREADS 256
#define SUMSQ_MAX_BLOCKS 512

/* The partition of sumsq_f32: blocks of the partial-sum kernel for n elements. One definition for the
 * single-tensor launch (host) and the segment-table kernels (device), which must agree on it exactly. */
static __host__ __device__ __forceinline__ unsigned sumsq_nblocks(size_t n) {
    size_t b = (n + SUMSQ_THREADS * 16 - 1) / (SUMSQ_THREADS * 16);
    if (b < 1) b = 1;
    return b > SUMSQ_MAX_BLOCKS ? SUMSQ_MAX_BLOCKS : (unsigned)b;
}

/* Block `blk` of the `nblocks` blocks that reduce x[0, n): a grid-stride loop as if gridDim.x were
 * nblocks and blockIdx.x were blk, then the block sum (every thread gets it). sumsq_f32's kernel and the
 * segment-table kernel both compute their partials here, so a segment's partials are the very operations
 * of a sumsq_f32 launch over that tensor. */
static __device__ __forceinline__ float sumsq_block_partial(const float *x, size_t n, int vec4,
                                                            unsigned nblocks, unsigned blk, float *sh) {
    float acc = 0.f;
    const size_t stride = (size_t)nblocks * blockDim.x;
    const size_t tid = (size_t)blk * blockDim.x + threadIdx.x;
    if (vec4) {
        const size_t n4 = n / 4;
        const float4 *x4 = (const float4 *)x;
        for (size_t i = tid; i < n4; i += stride) {
            float4 v = x4[i];
            acc += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        for (size_t i = n4 * 4 + tid; i < n; i += stride)
            acc += x[i] * x[i];
    } else {
        for (size_t i = tid; i < n; i += stride)
            acc += x[i] * x[i];
    }
    return dg_block_sum(acc, sh);
}

__global__ void sumsq_partial_kernel(float *part, const float *x, size_t n, int vec4) {
    __shared__ float sh[32];
    float t = sumsq_block_partial(x, n, vec4, gridDim.x, blockIdx.x, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = t;
}

/* One block of SUMSQ_MAX_BLOCKS threads: the sum of a launch's nblocks partials. */
static __device__ __forceinline__ float sumsq_final_sum(const float *part, int nblocks, float *sh) {
    float v = (int)threadIdx.x < nblocks ? part[threadIdx.x] : 0.f;
    return dg_block_sum(v, sh);
}

__global__ void sumsq_final_kernel(float *out, const float *part, int nblocks) {
    __shared__ float sh[32];
    float t = sumsq_final_sum(part, nblocks, sh);
    if (threadIdx.x == 0) *out += t;
}

dg_status_t dg_cuda_sumsq_f32(dg_cuda_t *c, float *out, const float *x, size_t n) {
    const unsigned nb = sumsq_nblocks(n);
    void *scr = NULL;
    DG_TRY(dg_cuda_scratch(c, SUMSQ_MAX_BLOCKS * sizeof(float), &scr));
    sumsq_partial_kernel<<<nb, SUMSQ_THREADS, 0, c->stream>>>((float *)scr, x, n, dg_ptr_aligned(x, 16));
    DG_CUDA_LAUNCH_CHECK();
    sumsq_final_kernel<<<1, SUMSQ_MAX_BLOCKS, 0, c->stream>>>(out, (const float *)scr, (int)nb);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

/* ---------------- gradient norm over a segment table (sumsq_multi) ---------------- */

/* Three launches for any number of segments, each step the same float operations as the two launches of
 * sumsq_f32 per segment:
 *   1. partials: the grid is every segment's sumsq_nblocks(count) blocks one after the other (segments
 *      in table order); a block finds its segment and its index among that segment's blocks, then runs
 *      sumsq_block_partial with that segment's block count and its own pointer alignment (vec4) — the
 *      partial that sumsq_f32's block of the same index computes. Segment i's partials go to slots
 *      [i * SUMSQ_MAX_BLOCKS, ...) of the scratch (a fixed stride: no prefix table to keep).
 *   2. one SUMSQ_MAX_BLOCKS-thread block per segment: sumsq_final_sum of its partials, as
 *      sumsq_final_kernel does, into a per-segment total;
 *   3. one thread adds the totals into *out in table order (o = *out; o += t_0; o += t_1; ...): the
 *      sequence of `*out += t` of the per-segment launches.
 * Skipped segments (flag read from the device table when the kernels run) write nothing and add nothing.
 * The launch geometry comes from the host copy of the table; the block-to-segment map is recomputed on
 * the device from the device table, so nothing but the table has to be uploaded. */

/* Which segment block g of the concatenated grid belongs to, and its index among that segment's blocks:
 * an exclusive scan of the segments' block counts, blockDim.x segments at a time (one chunk for a GPT-2's
 * 148 tensors), until the chunk holding g. *seg = -1 when g lies beyond the table's blocks (a device table
 * that disagrees with the host one: the block then does nothing rather than read out of bounds). Every
 * thread of the block must call it; every thread gets the same answer. */
static __device__ void sumsq_locate(const dg_sumsq_seg_t *segs, int nseg, unsigned g, int *seg,
                                    unsigned *blk) {
    __shared__ unsigned wsum[32];
    __shared__ unsigned s_base, s_blk;
    __shared__ int s_seg;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (threadIdx.x == 0) {
        s_base = 0;
        s_seg = -1;
        s_blk = 0;
    }
    for (int c0 = 0; c0 < nseg; c0 += blockDim.x) {
        const int i = c0 + threadIdx.x;
        const unsigned nb = i < nseg ? sumsq_nblocks(segs[i].count) : 0u;
        unsigned incl = nb; /* inclusive scan within the warp */
        for (int o = 1; o < 32; o <<= 1) {
            unsigned y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
        }
        __syncthreads(); /* s_base of the previous chunk is written; wsum is free again */
        if (lane == 31) wsum[wid] = incl;
        __syncthreads();
        unsigned start = s_base + incl - nb;
        for (int w = 0; w < wid; w++)
            start += wsum[w];
        if (nb > 0 && g >= start && g < start + nb) { /* one thread of one chunk, as nb >= 1 per segment */
            s_seg = i;
            s_blk = g - start;
        }
        __syncthreads();
        if (s_seg >= 0) break; /* the same shared value for every thread: a uniform exit */
        if (threadIdx.x == 0)
            for (int w = 0; w < nw; w++)
                s_base += wsum[w];
    }
    __syncthreads();
    *seg = s_seg;
    *blk = s_blk;
}

__global__ void sumsq_multi_partial_kernel(float *part, const float *base, const dg_sumsq_seg_t *segs,
                                           int nseg) {
    __shared__ float sh[32];
    int s;
    unsigned b;
    sumsq_locate(segs, nseg, blockIdx.x, &s, &b);
    if (s < 0) return;
    const dg_sumsq_seg_t sg = segs[s];
    if (sg.flags & DG_SUMSQ_SEG_SKIP) return; /* the whole block: before any barrier of the reduction */
    const float *x = base + sg.off;
    const int vec4 = ((uintptr_t)x & 15) == 0; /* what dg_ptr_aligned(x, 16) tells sumsq_f32 */
    float t = sumsq_block_partial(x, sg.count, vec4, sumsq_nblocks(sg.count), b, sh);
    if (threadIdx.x == 0) part[(size_t)s * SUMSQ_MAX_BLOCKS + b] = t;
}

__global__ void sumsq_multi_final_kernel(float *tot, const float *part, const dg_sumsq_seg_t *segs) {
    __shared__ float sh[32];
    const dg_sumsq_seg_t sg = segs[blockIdx.x];
    if (sg.flags & DG_SUMSQ_SEG_SKIP) return;
    float t = sumsq_final_sum(part + (size_t)blockIdx.x * SUMSQ_MAX_BLOCKS, (int)sumsq_nblocks(sg.count), sh);
    if (threadIdx.x == 0) tot[blockIdx.x] = t;
}

/* The threads only stage totals and flags in shared memory (coalesced loads instead of one dependent
 * load per segment); thread 0 alone adds them, in order. */
__global__ void sumsq_multi_add_kernel(float *out, const float *tot, const dg_sumsq_seg_t *segs, int nseg) {
    __shared__ float t[SUMSQ_THREADS];
    __shared__ unsigned char skip[SUMSQ_THREADS];
    float o = 0.f;
    if (threadIdx.x == 0) o = *out;
    for (int c0 = 0; c0 < nseg; c0 += SUMSQ_THREADS) {
        const int i = c0 + threadIdx.x;
        if (i < nseg) {
            skip[threadIdx.x] = (segs[i].flags & DG_SUMSQ_SEG_SKIP) != 0;
            t[threadIdx.x] = skip[threadIdx.x] ? 0.f : tot[i];
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            const int m = nseg - c0 < SUMSQ_THREADS ? nseg - c0 : SUMSQ_THREADS;
            for (int k = 0; k < m; k++)
                if (!skip[k]) o += t[k];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = o;
}

dg_status_t dg_cuda_sumsq_multi(dg_cuda_t *c, float *out, const float *base, const dg_sumsq_seg_t *segs,
                                const dg_sumsq_seg_t *segs_dev, int nseg) {
    if (nseg <= 0) return DG_OK;
    uint64_t total = 0;
    for (int i = 0; i < nseg; i++)
        total += sumsq_nblocks(segs[i].count);
    if (total > 0x7fffffffu || (uint64_t)nseg > 0x7fffffffu / (SUMSQ_MAX_BLOCKS + 1))
        return DG_ERR(DG_ERR_USAGE, "cuda backend sumsq_multi: %d segments need %llu blocks, beyond one grid",
                      nseg, (unsigned long long)total);
    void *scr = NULL;
    DG_TRY(dg_cuda_scratch(c, (size_t)nseg * (SUMSQ_MAX_BLOCKS + 1) * sizeof(float), &scr));
    float *part = (float *)scr, *tot = part + (size_t)nseg * SUMSQ_MAX_BLOCKS;
    sumsq_multi_partial_kernel<<<(unsigned)total, SUMSQ_THREADS, 0, c->stream>>>(part, base, segs_dev, nseg);
    DG_CUDA_LAUNCH_CHECK();
    sumsq_multi_final_kernel<<<(unsigned)nseg, SUMSQ_MAX_BLOCKS, 0, c->stream>>>(tot, part, segs_dev);
    DG_CUDA_LAUNCH_CHECK();
    sumsq_multi_add_kernel<<<1, SUMSQ_THREADS, 0, c->stream>>>(out, tot, segs_dev, nseg);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

/* Computed in double like the CPU reference, and written so that a NaN norm gives a NaN scale (the
 * divergence stays visible) instead of min() hiding it. */
__global__ void clip_scale_kernel(float *gscale, float *norm_out, const float *sumsq, float clip,
                                  float extra) {
    const double norm = sqrt((double)*sumsq);
    double f = 1.0;
    if (clip > 0.f) {
        const double q = (double)clip / (norm + 1e-6);
        f = q >= 1.0 ? 1.0 : q;
    }
    *gscale = (float)(f * (double)extra);
    if (norm_out) *norm_out = (float)norm;
}

dg_status_t dg_cuda_clip_scale(dg_cuda_t *c, float *gscale, float *norm, const float *sumsq, float clip,
                               float extra) {
    clip_scale_kernel<<<1, 1, 0, c->stream>>>(gscale, norm, sumsq, clip, extra);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

/* ---------------- AdamW ---------------- */

struct AdamHyper {
    float lr, b1, b2, eps, wd, inv_bc1, inv_bc2;
};

template <typename T> struct AdamOp {
    float *master, *m, *v;
    T *compute;
    const float *grad, *gscale;
    AdamHyper h;
    const float *sc; /* adamw_dev: lr, bias corrections and gradient factor from the device scalar block */
    template <int V> __device__ void apply(size_t i) const {
        AdamHyper h = this->h;
        float gs = gscale ? *gscale : 1.f;
        if (sc) {
            if (!isfinite(sc[DG_DS_NORM])) return; /* skipped step */
            h.lr = sc[DG_DS_LR];
            h.inv_bc1 = sc[DG_DS_INV_BC1];
            h.inv_bc2 = sc[DG_DS_INV_BC2];
            gs = sc[DG_DS_GSCALE];
        }
        float p[V], g[V], mm[V], vv[V];
        dg_ldv<V>(p, master + i);
        dg_ldv<V>(g, grad + i);
        dg_ldv<V>(mm, m + i);
        dg_ldv<V>(vv, v + i);
        for (int j = 0; j < V; j++) {
            float gj = g[j] * gs;
            mm[j] = h.b1 * mm[j] + (1.f - h.b1) * gj;
            vv[j] = h.b2 * vv[j] + (1.f - h.b2) * gj * gj;
            float mhat = mm[j] * h.inv_bc1, vhat = vv[j] * h.inv_bc2;
            p[j] -= h.lr * (mhat / (sqrtf(vhat) + h.eps) + h.wd * p[j]);
        }
        dg_stv<V>(master + i, p);
        dg_stv<V>(m + i, mm);
        dg_stv<V>(v + i, vv);
        if (compute) dg_stv<V>(compute + i, p);
    }
};

template <typename T>
static dg_status_t adamw_t(dg_cuda_t *c, float *master, void *compute, const float *grad, float *m, float *v,
                           size_t n, const AdamHyper &h, const float *gscale, const float *sc) {
    AdamOp<T> op{master, m, v, (T *)compute, grad, gscale, h, sc};
    bool al = al16(master, grad, m, v) && dg_ptr_aligned(compute, 16);
    return ew_launch<4>(c, op, n, al);
}

dg_status_t dg_cuda_adamw(dg_cuda_t *c, float *master, void *compute, const float *grad, float *m, float *v,
                          size_t n, float lr, float beta1, float beta2, float eps, float wd, int64_t t,
                          const float *gscale_dev) {
    /* bias corrections in double on the host: identical for every element and every backend */
    AdamHyper h;
    h.lr = lr;
    h.b1 = beta1;
    h.b2 = beta2;
    h.eps = eps;
    h.wd = wd;
    h.inv_bc1 = (float)(1.0 / (1.0 - pow((double)beta1, (double)t)));
    h.inv_bc2 = (float)(1.0 / (1.0 - pow((double)beta2, (double)t)));
    return DG_CUDA_DISPATCH_ACT(c->act, adamw_t, c, master, compute, grad, m, v, n, h, gscale_dev,
                                (const float *)NULL);
}

dg_status_t dg_cuda_adamw_dev(dg_cuda_t *c, float *master, void *compute, const float *grad, float *m,
                              float *v, size_t n, float beta1, float beta2, float eps, float wd,
                              const float *sc) {
    AdamHyper h;
    h.lr = 0.f; /* read from sc */
    h.b1 = beta1;
    h.b2 = beta2;
    h.eps = eps;
    h.wd = wd;
    h.inv_bc1 = h.inv_bc2 = 0.f;
    return DG_CUDA_DISPATCH_ACT(c->act, adamw_t, c, master, compute, grad, m, v, n, h, (const float *)NULL,
                                sc);
}

/* ---------------- AdamW over a segment table (adamw_multi_dev) ---------------- */

/* One launch for every tensor of the flat buffers. Thread u handles the group of elements [8u, 8u + 8)
 * (grid-stride); it finds the segment holding its first group by binary search over the table, then walks
 * forward (its groups only grow). A group inside one segment takes the vector form (V = 8: two 16-byte
 * loads of each f32 buffer in flight per thread, one 16-byte store of the bf16/f16 copy) when the buffers
 * are 16-byte aligned; a group at a segment's edge (the model's offsets are multiples of 64, the contract's
 * of 4) runs as two halves of 4, each in at most one segment, vector or element by element as before. The
 * arithmetic is AdamOp's, the same code as adamw_dev's, per element, with the segment's weight decay, so the
 * vector width changes no bit (8 was 4 until 2026-11-30: 1.36 ms per step for gpt2-124m on an H200, 2.7
 * TB/s). Groups in the gaps between segments and groups of skipped (frozen) segments are left alone. */
#define ADAMW_GROUP 8
template <typename T>
__global__ void adamw_multi_kernel(AdamOp<T> op, const dg_adamw_seg_t *__restrict__ segs, int nseg,
                                   size_t ngroups, bool vec, float wd) {
    if (!isfinite(op.sc[DG_DS_NORM])) return; /* skipped step (AdamOp checks again, as in adamw_dev) */
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= ngroups) return;
    const uint64_t e0 = ADAMW_GROUP * (uint64_t)u;
    int lo = 0, hi = nseg; /* the first segment that ends after e0 */
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (segs[mid].off + segs[mid].count <= e0)
            lo = mid + 1;
        else
            hi = mid;
    }
    int s = lo;
    for (; u < ngroups; u += stride) {
        const uint64_t e = ADAMW_GROUP * (uint64_t)u;
        while (s < nseg && segs[s].off + segs[s].count <= e)
            s++;
        if (s >= nseg) return;
        {
            const dg_adamw_seg_t sg = segs[s];
            if (vec && e >= sg.off && e + ADAMW_GROUP <= sg.off + sg.count) { /* the common case */
                if (sg.flags & DG_ADAMW_SEG_SKIP) continue;
                AdamOp<T> o = op;
                o.h.wd = (sg.flags & DG_ADAMW_SEG_DECAY) ? wd : 0.f;
                o.template apply<ADAMW_GROUP>((size_t)e);
                continue;
            }
        }
        /* a group at a segment's edge: its two halves of 4 (offsets are multiples of 4, so each half lies
         * in at most one segment), as the 4-element groups before */
        for (uint64_t h = e; h < e + ADAMW_GROUP; h += 4) {
            while (s < nseg && segs[s].off + segs[s].count <= h)
                s++;
            if (s >= nseg) return;
            const dg_adamw_seg_t sg = segs[s];
            if (h < sg.off || (sg.flags & DG_ADAMW_SEG_SKIP)) continue; /* a gap, or a frozen tensor */
            AdamOp<T> o = op;
            o.h.wd = (sg.flags & DG_ADAMW_SEG_DECAY) ? wd : 0.f;
            const uint64_t end = sg.off + sg.count;
            if (vec && h + 4 <= end) {
                o.template apply<4>((size_t)h);
            } else {
                for (uint64_t i = h; i < end && i < h + 4; i++)
                    o.template apply<1>((size_t)i);
            }
        }
    }
}

template <typename T>
static dg_status_t adamw_multi_t(dg_cuda_t *c, const dg_adamw_seg_t *segs, int nseg, size_t span,
                                 float *master, void *compute, const float *grad, float *m, float *v,
                                 const AdamHyper &h, float wd, const float *sc) {
    AdamOp<T> op{master, m, v, (T *)compute, grad, (const float *)NULL, h, sc};
    bool vec = al16(master, grad, m, v) && dg_ptr_aligned(compute, 16);
    size_t ngroups = (span + ADAMW_GROUP - 1) / ADAMW_GROUP;
    adamw_multi_kernel<T>
        <<<dg_cuda_blocks(ngroups, 256, 65535), 256, 0, c->stream>>>(op, segs, nseg, ngroups, vec, wd);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

dg_status_t dg_cuda_adamw_multi_dev(dg_cuda_t *c, const dg_adamw_seg_t *segs, int nseg, size_t span,
                                    float *master, void *compute, const float *grad, float *m, float *v,
                                    float beta1, float beta2, float eps, float wd, const float *sc) {
    AdamHyper h; /* as in dg_cuda_adamw_dev: lr and bias corrections come from sc */
    h.lr = 0.f;
    h.b1 = beta1;
    h.b2 = beta2;
    h.eps = eps;
    h.wd = 0.f; /* per segment */
    h.inv_bc1 = h.inv_bc2 = 0.f;
    return DG_CUDA_DISPATCH_ACT(c->act, adamw_multi_t, c, segs, nseg, span, master, compute, grad, m, v, h,
                                wd, sc);
}
