/* layernorm.cu — fused layernorm forward (one warp per row, statistics in f32, saved for backward) and
 * fused backward (input gradient plus the weight/bias gradients in one pass over the rows).
 *
 * Two implementations of each direction:
 *   - the register kernels (ln_fwd_reg_kernel, ln_bwd_reg_kernel), for rows that split into 16-byte
 *     vectors (C % V == 0, aligned pointers) and C <= 32 * V * ln_reg_nv<T>() (1024 for bf16/f16, 768
 *     for f32): a lane owns the columns (k*32 + lane)*V + j, k < NV, holds its part of a row in registers
 *     (read once from memory) and, in the backward, its dw/db partial sums for those columns too;
 *   - the generic kernels (any C and alignment): the row is re-read per pass and the backward's
 *     per-warp partial sums live in shared memory.
 *
 * The weight/bias gradients are column sums over all rows. Without atomics: the grid depends only on N
 * (and on which kernel runs, a function of C, the dtype and the pointers' alignment), warp w of block b
 * owns rows (b + k*grid)*warps + w for k = 0, 1, ...; its partials accumulate in row order, the block adds
 * its warps in warp order into one partial row, and dg_cuda_rowsum_acc (elementwise.cu) adds the partial
 * rows in a fixed order (a function of their count) into dw/db (+=). So results are bitwise
 * reproducible on any GPU.
 */
#include "cuda_impl.cuh"
#include "cuda_vec.cuh"

#define LN_EPS 1e-5f
#define LNF_WARPS 8
/* generic backward: 4 warps per block, per-warp partials in shared memory */
#define LNB_WARPS 4
#define LNB_MIN_ROWS 4 /* rows per warp before the grid stops growing */
#define LNB_MAX_BLOCKS 512
/* register backward: 8 warps per block (2 blocks per SM at <= 128 registers), at least LNR_MIN_ROWS rows
 * per warp, so at most N / 64 partial rows (512 at N = 32768: 3 MiB of partials for C = 768, written and
 * read back once: 3 % of the 200 MB the kernel must move anyway) */
#define LNR_WARPS 8
#define LNR_MIN_ROWS 8
#define LNR_MAX_BLOCKS 1024

/* Most 16-byte vectors per lane in the register kernels (columns per lane = NV * V): 4 for bf16/f16
 * (C <= 1024: gpt2 124M and 350M), 6 for f32 (C <= 768; f32 is the exact reference mode, where the
 * registers per column are twice as many). Beyond, the generic kernels. */
template <typename T> constexpr int ln_reg_nv() {
    return sizeof(T) == 4 ? 6 : 4;
}

/* Register backward blocks per SM asked of ptxas: 2 (<= 128 registers) while a lane holds at most 3
 * vectors of a row (C <= 768 in bf16/f16: 127-128 registers, no spills); beyond, 1 (up to 255 registers:
 * at 128, 4 vectors spill 100-300 bytes per thread), still 8 warps per SM with 12 or more 16-byte loads
 * per lane in flight. */
constexpr int ln_bwd_reg_min_blocks(int nv) {
    return nv <= 3 ? 2 : 1;
}

/* The backward's grids, functions of N only (so is the reduction order): enough blocks to fill any GPU,
 * few enough that the partial rows stay small next to the input. */
static int ln_bwd_blocks(int N) {
    const int per = LNB_WARPS * LNB_MIN_ROWS;
    const int b = (N + per - 1) / per;
    return b < LNB_MAX_BLOCKS ? b : LNB_MAX_BLOCKS;
}
static int ln_bwd_reg_blocks(int N) {
    const int per = LNR_WARPS * LNR_MIN_ROWS;
    const int b = (N + per - 1) / per;
    return b < LNR_MAX_BLOCKS ? b : LNR_MAX_BLOCKS;
}

/* The warp's sum of g(x[c]) over a row of C (each lane V-element vectors, 32 V apart), in ln_fwd_kernel's
 * order: the mean's and the variance's pass */
template <int V, typename T, typename G>
static __device__ __forceinline__ float ln_row_sum(const T *x, int C, int lane, G g) {
    float s = 0.f;
    for (int c = lane * V; c < C; c += 32 * V) {
        float f[V];
        dg_ldv<V>(f, x + c);
#pragma unroll
        for (int j = 0; j < V; j++)
            s += g(f[j]);
    }
    return dg_warp_sum(s);
}

template <typename T, int V>
__global__ void ln_fwd_kernel(T *out, float *mean, float *rstd, const T *inp, const T *w, const T *b, int N,
                              int C) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * LNF_WARPS + (threadIdx.x >> 5);
    if (row >= N) return;
    const T *x = inp + (size_t)row * C;
    const float m = ln_row_sum<V>(x, C, lane, [](float f) { return f; }) / C;
    const float var = ln_row_sum<V>(x, C, lane, [m](float f) { return (f - m) * (f - m); }) / C;
    const float rs = 1.f / sqrtf(var + LN_EPS);
    T *o = out + (size_t)row * C;
    for (int c = lane * V; c < C; c += 32 * V) {
        float f[V], ww[V], bb[V];
        dg_ldv<V>(f, x + c);
        dg_ldv<V>(ww, w + c);
        dg_ldv<V>(bb, b + c);
#pragma unroll
        for (int j = 0; j < V; j++)
            f[j] = (f[j] - m) * rs * ww[j] + bb[j];
        dg_stv<V>(o + c, f);
    }
    if (lane == 0) {
        if (mean) mean[row] = m;
        if (rstd) rstd[row] = rs;
    }
}

/* The forward with the row read once: each lane loads its NV 16-byte vectors of x (and of w, b) up front,
 * so a warp has 3 NV independent loads in flight once per row instead of NV per pass in three passes (the
 * generic kernel re-reads x from L1/L2 for the variance and the output). The arithmetic and its order are
 * the generic kernel's. Traffic: x read, out written (100 MB at N = 32768, C = 768, bf16). */
template <typename T, int NV>
__global__ void __launch_bounds__(32 * LNF_WARPS)
    ln_fwd_reg_kernel(T *out, float *mean, float *rstd, const T *inp, const T *w, const T *b, int N, int C) {
    constexpr int V = 16 / sizeof(T);
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * LNF_WARPS + (threadIdx.x >> 5);
    if (row >= N) return;
    const T *x = inp + (size_t)row * C;
    uint4 xr[NV], wr[NV], br[NV];
#pragma unroll
    for (int k = 0; k < NV; k++) {
        const int c = (k * 32 + lane) * V;
        if (c < C) {
            xr[k] = dg_ld16(x + c);
            wr[k] = dg_ld16(w + c);
            br[k] = dg_ld16(b + c);
        } else {
            xr[k] = wr[k] = br[k] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < NV; k++)
        if ((k * 32 + lane) * V < C)
#pragma unroll
            for (int j = 0; j < V; j++)
                s += dg_elem16<T>(xr[k], j);
    const float m = dg_warp_sum(s) / C;
    float q = 0.f;
#pragma unroll
    for (int k = 0; k < NV; k++)
        if ((k * 32 + lane) * V < C)
#pragma unroll
            for (int j = 0; j < V; j++) {
                const float d = dg_elem16<T>(xr[k], j) - m;
                q += d * d;
            }
    const float rs = 1.f / sqrtf(dg_warp_sum(q) / C + LN_EPS);
    T *o = out + (size_t)row * C;
#pragma unroll
    for (int k = 0; k < NV; k++) {
        const int c = (k * 32 + lane) * V;
        if (c >= C) continue;
        float f[V];
#pragma unroll
        for (int j = 0; j < V; j++)
            f[j] = (dg_elem16<T>(xr[k], j) - m) * rs * dg_elem16<T>(wr[k], j) + dg_elem16<T>(br[k], j);
        dg_stv<V>(o + c, f);
    }
    if (lane == 0) {
        if (mean) mean[row] = m;
        if (rstd) rstd[row] = rs;
    }
}

/* Calls f.go<NV>() for the runtime nv in [NV, MAX] (one kernel instantiation per NV). */
template <int NV, int MAX> struct ln_nv_switch {
    template <typename F> static dg_status_t run(int nv, const F &f) {
        if (nv == NV) return f.template go<NV>();
        if constexpr (NV < MAX) {
            return ln_nv_switch<NV + 1, MAX>::run(nv, f);
        } else {
            DG_ASSERT(0 && "layernorm: vectors per lane out of range");
            return DG_OK;
        }
    }
};

/* Whether the register kernels serve this row layout; *nv = 16-byte vectors per lane. */
template <typename T> static bool ln_reg_ok(int C, int *nv, const void *const *ptrs, int nptrs) {
    constexpr int V = 16 / sizeof(T);
    if (C % V != 0) return false;
    for (int i = 0; i < nptrs; i++)
        if (ptrs[i] && !dg_ptr_aligned(ptrs[i], 16)) return false;
    *nv = (C + 32 * V - 1) / (32 * V);
    return *nv >= 1 && *nv <= ln_reg_nv<T>();
}

template <typename T> struct ln_fwd_reg_go {
    dg_cuda_t *c;
    T *out;
    float *mean, *rstd;
    const T *inp, *w, *b;
    int N, C;
    template <int NV> dg_status_t go() const {
        const unsigned blocks = (N + LNF_WARPS - 1) / LNF_WARPS;
        ln_fwd_reg_kernel<T, NV><<<blocks, 32 * LNF_WARPS, 0, c->stream>>>(out, mean, rstd, inp, w, b, N, C);
        DG_CUDA_LAUNCH_CHECK();
        return DG_OK;
    }
};

template <typename T>
static dg_status_t ln_fwd_t(dg_cuda_t *c, void *out, float *mean, float *rstd, const void *inp, const void *w,
                            const void *b, int N, int C) {
    constexpr int V = 16 / sizeof(T);
    if (N <= 0) return DG_OK;
    const void *ptrs[] = {out, inp, w, b};
    int nv = 0;
    if (c->ln_reg && ln_reg_ok<T>(C, &nv, ptrs, 4))
        return ln_nv_switch<1, ln_reg_nv<T>()>::run(
            nv, ln_fwd_reg_go<T>{c, (T *)out, mean, rstd, (const T *)inp, (const T *)w, (const T *)b, N, C});
    const bool vec = C % V == 0 && dg_ptr_aligned(out, 16) && dg_ptr_aligned(inp, 16) &&
                     dg_ptr_aligned(w, 16) && dg_ptr_aligned(b, 16);
    const unsigned blocks = (N + LNF_WARPS - 1) / LNF_WARPS;
    if (vec)
        ln_fwd_kernel<T, V><<<blocks, 32 * LNF_WARPS, 0, c->stream>>>((T *)out, mean, rstd, (const T *)inp,
                                                                      (const T *)w, (const T *)b, N, C);
    else
        ln_fwd_kernel<T, 1><<<blocks, 32 * LNF_WARPS, 0, c->stream>>>((T *)out, mean, rstd, (const T *)inp,
                                                                      (const T *)w, (const T *)b, N, C);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

dg_status_t dg_cuda_layernorm_fwd(dg_cuda_t *c, void *out, float *mean, float *rstd, const void *inp,
                                  const void *w, const void *b, int N, int C) {
    return DG_CUDA_DISPATCH_ACT(c->act, ln_fwd_t, c, out, mean, rstd, inp, w, b, N, C);
}

/* The generic backward (any C, any alignment).
 * part: [chunks][2][C] (dw partials, then db partials); NULL when neither dw nor db is wanted.
 * Shared memory per warp: dw and db partials of Cp = C rounded up to 32*V columns, stored so that the
 * 32 lanes of a warp touch 32 consecutive words (column base + lane*V + j lives at base + j*32 + lane). */
template <typename T, int V>
__global__ void ln_bwd_kernel(T *dinp, float *part, const T *dout, const T *inp, const T *w,
                              const float *mean, const float *rstd, int N, int C, int acc) {
    extern __shared__ float sh[]; /* [LNB_WARPS][2][Cp] */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int Cp = ((C + 32 * V - 1) / (32 * V)) * (32 * V);
    float *sdw = sh + (size_t)warp * 2 * Cp, *sdb = sdw + Cp;
    if (part)
        for (int i = lane; i < 2 * Cp; i += 32)
            sdw[i] = 0.f;
    __syncwarp();
    for (int row = blockIdx.x * LNB_WARPS + warp; row < N; row += gridDim.x * LNB_WARPS) {
        const T *x = inp + (size_t)row * C, *dy = dout + (size_t)row * C;
        const float m = mean[row], rs = rstd[row];
        float s1 = 0.f, s2 = 0.f;
        for (int c = lane * V; c < C; c += 32 * V) {
            float xf[V], df[V], wf[V];
            dg_ldv<V>(xf, x + c);
            dg_ldv<V>(df, dy + c);
            dg_ldv<V>(wf, w + c);
#pragma unroll
            for (int j = 0; j < V; j++) {
                float dxh = df[j] * wf[j];
                s1 += dxh;
                s2 += dxh * (xf[j] - m) * rs;
            }
        }
        const float mean1 = dg_warp_sum(s1) / C, mean2 = dg_warp_sum(s2) / C;
        for (int c = lane * V; c < C; c += 32 * V) {
            float xf[V], df[V], wf[V], o[V];
            dg_ldv<V>(xf, x + c);
            dg_ldv<V>(df, dy + c);
            dg_ldv<V>(wf, w + c);
            if (dinp && acc) dg_ldv<V>(o, dinp + (size_t)row * C + c);
            const int sbase = c - lane * V + lane;
#pragma unroll
            for (int j = 0; j < V; j++) {
                float xh = (xf[j] - m) * rs;
                float g = (df[j] * wf[j] - mean1 - xh * mean2) * rs;
                o[j] = (dinp && acc) ? o[j] + g : g;
                if (part) {
                    sdw[sbase + j * 32] += df[j] * xh;
                    sdb[sbase + j * 32] += df[j];
                }
            }
            if (dinp) dg_stv<V>(dinp + (size_t)row * C + c, o);
        }
    }
    if (!part) return;
    __syncthreads();
    float *p = part + (size_t)blockIdx.x * 2 * C;
    for (int i = threadIdx.x; i < 2 * Cp; i += blockDim.x) {
        const int which = i / Cp, r = i % Cp;
        const int base = r / (32 * V) * (32 * V), rr = r % (32 * V);
        const int col = base + (rr % 32) * V + rr / 32;
        if (col >= C) continue;
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < LNB_WARPS; k++)
            s += sh[(size_t)k * 2 * Cp + i];
        p[(size_t)which * C + col] = s;
    }
}

/* An empty asm that "changes" u: values the compiler derived from u before it (the floats of the row
 * sums) cannot be reused after it, so they die there and are converted again from the packed words,
 * which is what keeps the backward within 128 registers (without it ptxas keeps dy*w and x - m of every
 * column live across the warp reductions and spills). */
static __device__ __forceinline__ void ln_opaque(uint4 &u) {
    asm volatile("" : "+r"(u.x), "+r"(u.y), "+r"(u.z), "+r"(u.w));
}

/* The backward with rows and partial sums in registers.
 *
 * What limits the generic kernel (measured 0.091 ms at N = 32768, C = 768, bf16, H200, for ~0.06 ms of
 * memory traffic, plus 23 us for its final reduction over 3 blocks): per row it reads x, dy and w once for
 * the two row sums and again for the output (the second time from L1/L2, but after a full round trip and
 * the warp reductions, so each row costs two dependent memory latencies), and every element does a
 * read-modify-write of dw and db in shared memory (24 KiB per 4-warp block).
 *
 * Here a lane loads its NV 16-byte vectors of x, dy (and of dinp when acc = 1) at the start of a row,
 * 2-3 x NV independent loads in flight per lane, converts them where they are used and never re-reads
 * them; w stays in registers for the whole kernel and the dw/db partials of the lane's NV * V columns are
 * register accumulators (48 floats for C = 768 in bf16). One memory latency per row, no shared memory
 * until the end. At <= 128 registers (launch bounds) two 8-warp blocks fit per SM: 16 warps, each with
 * 6-9 x 16 B per lane in flight, ~70 KiB per SM, several times what Little's law asks for HBM3e (about
 * 20 KiB per SM at 4.8 TB/s and ~0.6 us), so the kernel should run at memory bandwidth: x and dy read,
 * dinp read and written with acc = 1 (200 MB at N = 32768, C = 768, bf16: ~0.06-0.065 ms).
 * The block then adds its 8 warps' partials in warp order through shared memory ([8][C] floats, dw then
 * db) and writes one partial row of dw and one of db; dg_cuda_rowsum_acc adds the partial rows. */
template <typename T, int NV>
__global__ void __launch_bounds__(32 * LNR_WARPS, ln_bwd_reg_min_blocks(NV))
    ln_bwd_reg_kernel(T *dinp, float *part, const T *dout, const T *inp, const T *w, const float *mean,
                      const float *rstd, int N, int C, int acc) {
    constexpr int V = 16 / sizeof(T);
    extern __shared__ float4 sh4[]; /* [LNR_WARPS][C] floats */
    float *sh = reinterpret_cast<float *>(sh4);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool accin = dinp && acc;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    uint4 wr[NV];
    float dw[NV][V], db[NV][V];
#pragma unroll
    for (int k = 0; k < NV; k++) {
        const int c = (k * 32 + lane) * V;
        wr[k] = c < C ? dg_ld16(w + c) : zero;
#pragma unroll
        for (int j = 0; j < V; j++)
            dw[k][j] = db[k][j] = 0.f;
    }
    for (int row = blockIdx.x * LNR_WARPS + warp; row < N; row += gridDim.x * LNR_WARPS) {
        const size_t off = (size_t)row * C;
        uint4 xr[NV], dr[NV], orr[NV];
#pragma unroll
        for (int k = 0; k < NV; k++) {
            const int c = (k * 32 + lane) * V;
            xr[k] = dr[k] = orr[k] = zero; /* lanes past C add exact zeros to the row sums */
            if (c < C) {
                xr[k] = dg_ld16(inp + off + c);
                dr[k] = dg_ld16(dout + off + c);
                if (accin) orr[k] = dg_ld16(dinp + off + c);
            }
        }
        const float m = mean[row], rs = rstd[row];
        float s1 = 0.f, s2 = 0.f;
#pragma unroll
        for (int k = 0; k < NV; k++)
#pragma unroll
            for (int j = 0; j < V; j++) {
                const float dxh = dg_elem16<T>(dr[k], j) * dg_elem16<T>(wr[k], j);
                s1 += dxh;
                s2 += dxh * (dg_elem16<T>(xr[k], j) - m) * rs;
            }
        const float mean1 = dg_warp_sum(s1) / C, mean2 = dg_warp_sum(s2) / C;
#pragma unroll
        for (int k = 0; k < NV; k++) {
            ln_opaque(xr[k]);
            ln_opaque(dr[k]);
            ln_opaque(wr[k]);
        }
#pragma unroll
        for (int k = 0; k < NV; k++) {
            const int c = (k * 32 + lane) * V;
            if (c >= C) continue;
            float o[V];
#pragma unroll
            for (int j = 0; j < V; j++) {
                const float df = dg_elem16<T>(dr[k], j);
                const float xh = (dg_elem16<T>(xr[k], j) - m) * rs;
                const float g = (df * dg_elem16<T>(wr[k], j) - mean1 - xh * mean2) * rs;
                o[j] = accin ? dg_elem16<T>(orr[k], j) + g : g;
                dw[k][j] += df * xh;
                db[k][j] += df;
            }
            if (dinp) dg_stv<V>(dinp + off + c, o);
        }
    }
    if (!part) return; /* the same for the whole block */
    float *p = part + (size_t)blockIdx.x * 2 * C;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        if (half) __syncthreads(); /* the dw sums below are read before db overwrites them */
#pragma unroll
        for (int k = 0; k < NV; k++) {
            const int c = (k * 32 + lane) * V;
            if (c >= C) continue;
            /* C % V == 0 and V % 4 == 0: 16-byte aligned */
            float4 *d = reinterpret_cast<float4 *>(sh + (size_t)warp * C + c);
#pragma unroll
            for (int j = 0; j < V; j += 4)
                d[j / 4] = half ? make_float4(db[k][j], db[k][j + 1], db[k][j + 2], db[k][j + 3])
                                : make_float4(dw[k][j], dw[k][j + 1], dw[k][j + 2], dw[k][j + 3]);
        }
        __syncthreads();
        for (int i = threadIdx.x; i < C; i += blockDim.x) {
            float t = 0.f;
#pragma unroll
            for (int q = 0; q < LNR_WARPS; q++)
                t += sh[(size_t)q * C + i];
            p[(size_t)half * C + i] = t;
        }
    }
}

template <typename T> struct ln_bwd_reg_go {
    dg_cuda_t *c;
    T *dinp;
    float *part;
    const T *dout, *inp, *w;
    const float *mean, *rstd;
    int N, C, acc, blocks;
    template <int NV> dg_status_t go() const {
        const size_t smem = part ? (size_t)LNR_WARPS * C * sizeof(float) : 0; /* <= 32 KiB */
        ln_bwd_reg_kernel<T, NV>
            <<<blocks, 32 * LNR_WARPS, smem, c->stream>>>(dinp, part, dout, inp, w, mean, rstd, N, C, acc);
        DG_CUDA_LAUNCH_CHECK();
        return DG_OK;
    }
};

template <typename T, int V>
static dg_status_t ln_bwd_launch(dg_cuda_t *c, void *dinp, float *part, const void *dout, const void *inp,
                                 const void *w, const float *mean, const float *rstd, int N, int C, int acc,
                                 int chunks) {
    const int Cp = ((C + 32 * V - 1) / (32 * V)) * (32 * V);
    const size_t smem = part ? (size_t)LNB_WARPS * 2 * Cp * sizeof(float) : 0;
    if (smem > c->smem_optin)
        return DG_ERR(DG_ERR_RUNTIME,
                      "cuda backend layernorm_bwd: C = %d needs %zu bytes of shared memory, the GPU "
                      "offers %zu",
                      C, smem, c->smem_optin);
    if (smem > 48 * 1024)
        DG_CUDA_CHECK(cudaFuncSetAttribute(ln_bwd_kernel<T, V>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)smem));
    ln_bwd_kernel<T, V><<<chunks, 32 * LNB_WARPS, smem, c->stream>>>(
        (T *)dinp, part, (const T *)dout, (const T *)inp, (const T *)w, mean, rstd, N, C, acc);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

template <typename T>
static dg_status_t ln_bwd_t(dg_cuda_t *c, void *dinp, float *dw, float *db, const void *dout, const void *inp,
                            const void *w, const float *mean, const float *rstd, int N, int C, int acc) {
    constexpr int V = 16 / sizeof(T);
    if (N <= 0 || C <= 0) return DG_OK;
    const void *ptrs[] = {dinp, dout, inp, w};
    int nv = 0;
    const bool reg = c->ln_reg && ln_reg_ok<T>(C, &nv, ptrs, 4);
    const int chunks = reg ? ln_bwd_reg_blocks(N) : ln_bwd_blocks(N);
    float *part = NULL;
    if (dw || db) {
        void *scr = NULL;
        DG_TRY(dg_cuda_scratch(c, (size_t)chunks * 2 * C * sizeof(float), &scr));
        part = (float *)scr;
    }
    if (reg) {
        DG_TRY((ln_nv_switch<1, ln_reg_nv<T>()>::run(nv, ln_bwd_reg_go<T>{c, (T *)dinp, part, (const T *)dout,
                                                                          (const T *)inp, (const T *)w, mean,
                                                                          rstd, N, C, acc, chunks})));
    } else {
        const bool vec = C % V == 0 && dg_ptr_aligned(dinp, 16) && dg_ptr_aligned(dout, 16) &&
                         dg_ptr_aligned(inp, 16) && dg_ptr_aligned(w, 16);
        if (vec)
            DG_TRY((ln_bwd_launch<T, V>(c, dinp, part, dout, inp, w, mean, rstd, N, C, acc, chunks)));
        else
            DG_TRY((ln_bwd_launch<T, 1>(c, dinp, part, dout, inp, w, mean, rstd, N, C, acc, chunks)));
    }
    /* part is [chunks][2C]: its first C columns go to dw, the others to db */
    if (part) DG_TRY(dg_cuda_rowsum_acc(c, dw, db, C, part, chunks, 2 * C));
    return DG_OK;
}

dg_status_t dg_cuda_layernorm_bwd(dg_cuda_t *c, void *dinp, float *dw, float *db, const void *dout,
                                  const void *inp, const void *w, const float *mean, const float *rstd, int N,
                                  int C, int acc) {
    return DG_CUDA_DISPATCH_ACT(c->act, ln_bwd_t, c, dinp, dw, db, dout, inp, w, mean, rstd, N, C, acc);
}
