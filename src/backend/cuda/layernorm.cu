/* layernorm.cu — fused layernorm forward (one warp per row, statistics in f32, saved for backward) and
 * fused backward (input gradient plus the weight/bias gradients in one pass over the rows).
 *
 * The weight/bias gradients are column sums over all rows. Without atomics: the grid size depends only
 * on N, warp w of block b owns rows b*4+w, b*4+w + 4*grid, ...; partial sums live in shared memory per
 * warp, the block combines its warps in warp order and writes one partial row; a second kernel adds the
 * partial rows in block order into dw/db (+=). The partition depends only on N, so results are bitwise
 * reproducible on any GPU.
 */
#include "cuda_impl.cuh"
#include "cuda_vec.cuh"

#define LN_EPS 1e-5f
#define LNF_WARPS 8
#define LNB_WARPS 4
#define LNB_MIN_ROWS 4 /* rows per warp before the grid stops growing */
#define LNB_MAX_BLOCKS 512

/* The backward's grid, a function of N only (so is the reduction order): enough blocks to fill any GPU,
 * few enough that the partial rows stay small next to the input. */
static int ln_bwd_blocks(int N) {
    const int per = LNB_WARPS * LNB_MIN_ROWS;
    const int b = (N + per - 1) / per;
    return b < LNB_MAX_BLOCKS ? b : LNB_MAX_BLOCKS;
}

template <typename T, int V>
__global__ void ln_fwd_kernel(T *out, float *mean, float *rstd, const T *inp, const T *w, const T *b, int N,
                              int C) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * LNF_WARPS + (threadIdx.x >> 5);
    if (row >= N) return;
    const T *x = inp + (size_t)row * C;
    float s = 0.f;
    for (int c = lane * V; c < C; c += 32 * V) {
        float f[V];
        dg_ldv<V>(f, x + c);
#pragma unroll
        for (int j = 0; j < V; j++)
            s += f[j];
    }
    const float m = dg_warp_sum(s) / C;
    float q = 0.f;
    for (int c = lane * V; c < C; c += 32 * V) {
        float f[V];
        dg_ldv<V>(f, x + c);
#pragma unroll
        for (int j = 0; j < V; j++)
            q += (f[j] - m) * (f[j] - m);
    }
    const float rs = 1.f / sqrtf(dg_warp_sum(q) / C + LN_EPS);
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

template <typename T>
static dg_status_t ln_fwd_t(dg_cuda_t *c, void *out, float *mean, float *rstd, const void *inp, const void *w,
                            const void *b, int N, int C) {
    constexpr int V = 16 / sizeof(T);
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

/* part: [chunks][2][C] (dw partials, then db partials); NULL when neither dw nor db is wanted.
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

__global__ void ln_bwd_final_kernel(float *dw, float *db, const float *part, int chunks, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float sw = 0.f, sb = 0.f;
    for (int k = 0; k < chunks; k++) {
        sw += part[(size_t)k * 2 * C + c];
        sb += part[(size_t)k * 2 * C + C + c];
    }
    if (dw) dw[c] += sw;
    if (db) db[c] += sb;
}

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
    const int chunks = ln_bwd_blocks(N);
    float *part = NULL;
    if (dw || db) {
        void *scr = NULL;
        DG_TRY(dg_cuda_scratch(c, (size_t)chunks * 2 * C * sizeof(float), &scr));
        part = (float *)scr;
    }
    const bool vec = C % V == 0 && dg_ptr_aligned(dinp, 16) && dg_ptr_aligned(dout, 16) &&
                     dg_ptr_aligned(inp, 16) && dg_ptr_aligned(w, 16);
    if (vec)
        DG_TRY((ln_bwd_launch<T, V>(c, dinp, part, dout, inp, w, mean, rstd, N, C, acc, chunks)));
    else
        DG_TRY((ln_bwd_launch<T, 1>(c, dinp, part, dout, inp, w, mean, rstd, N, C, acc, chunks)));
    if (part) {
        ln_bwd_final_kernel<<<(C + 255) / 256, 256, 0, c->stream>>>(dw, db, part, chunks, C);
        DG_CUDA_LAUNCH_CHECK();
    }
    return DG_OK;
}

dg_status_t dg_cuda_layernorm_bwd(dg_cuda_t *c, void *dinp, float *dw, float *db, const void *dout,
                                  const void *inp, const void *w, const float *mean, const float *rstd, int N,
                                  int C, int acc) {
    return DG_CUDA_DISPATCH_ACT(c->act, ln_bwd_t, c, dinp, dw, db, dout, inp, w, mean, rstd, N, C, acc);
}
