/* crossentropy.cu — the classifier loss: the forward reads each row of logits once (online max and
 * sum of exponentials) and saves the row's logsumexp; the backward turns logits into dlogits in place
 * (it may alias them), so logits are never materialised twice nor in f32. The fused op (contract v1.10,
 * graph op crossentropy_fused) does both for a row in one block, reading the row from memory once.
 *
 * One block per row; reductions go lane -> warp -> block in a fixed order (deterministic). A target
 * outside [0, V) gives loss NaN for that row and raises a flag that sync() reports.
 *
 * Bitwise contract of the fused op: its losses, lse and dlogits are those of the forward kernel followed
 * by the backward kernel. So the three kernels share their per-thread code (ce_thread_lse: the same
 * columns per thread, the same vector width, the same online update), the block reduction
 * (ce_block_lse), and the per-element gradient (ce_grad), with the same block size (CE_THREADS). The
 * vector width of the reduction is the forward's choice (Vp a multiple of 16 bytes and logits 16-byte
 * aligned), whatever dlogits' alignment; the gradient is elementwise, so its store width does not
 * matter for the values.
 */
#include "cuda_impl.cuh"
#include "cuda_vec.cuh"

#define CE_THREADS 512
/* shared memory the fused kernel keeps for itself besides the staged row (its static arrays), and the
 * margin below the opt-in limit it leaves for the runtime's own reservation */
#define CE_SMEM_SLACK 1024

static __device__ __forceinline__ void lse_combine(float &m, float &s, float m2, float s2) {
    const float M = fmaxf(m, m2);
    if (M == -INFINITY) return; /* both empty */
    s = s * expf(m - M) + s2 * expf(m2 - M);
    m = M;
}

/* This thread's running (max, sum of exp) over its columns c = tid*V, tid*V + blockDim*V, ... < Vv of
 * row x (global or shared memory). One rescale per vector, then V independent exponentials. (The stride
 * is blockDim.x, always CE_THREADS, as the kernels were first written: their code is unchanged.) */
template <typename T, int V>
static __device__ __forceinline__ void ce_thread_lse(float &m, float &s, const T *x, int Vv) {
    m = -INFINITY;
    s = 0.f;
    for (int c = threadIdx.x * V; c < Vv; c += blockDim.x * V) {
        float f[V];
        dg_ldv<V>(f, x + c);
        const int nv = min(V, Vv - c);
        float vm = -INFINITY;
#pragma unroll
        for (int j = 0; j < V; j++)
            if (j < nv) vm = fmaxf(vm, f[j]);
        if (vm > m) {
            s *= expf(m - vm);
            m = vm;
        }
#pragma unroll
        for (int j = 0; j < V; j++)
            if (j < nv) s += expf(f[j] - m);
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

/* d loss / d logit of column col: (softmax - onehot) * dloss inside the vocabulary, 0 in the padding. A
 * target outside [0, Vv) matches no column. */
static __device__ __forceinline__ float ce_grad(float x, int col, int Vv, int t, float l, float dloss) {
    return col < Vv ? (expf(x - l) - (col == t ? 1.f : 0.f)) * dloss : 0.f;
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

template <typename T, int V>
__global__ void __launch_bounds__(CE_THREADS)
    ce_fwd_kernel(float *losses, float *lse_out, const T *logits, const int32_t *targets, int Vv, int Vp,
                  int *err) {
    __shared__ float shm[32], shs[32];
    const int row = blockIdx.x;
    const T *x = logits + (size_t)row * Vp;
    float m, s;
    ce_thread_lse<T, V>(m, s, x, Vv);
    if (ce_block_lse(m, s, shm, shs)) ce_row_out(losses, lse_out, row, m + logf(s), x, targets, Vv, err);
}

template <typename T, int V>
__global__ void __launch_bounds__(CE_THREADS)
    ce_bwd_kernel(T *dlogits, const T *logits, const float *lse, const int32_t *targets, int Vv, int Vp,
                  float dloss) {
    const int row = blockIdx.x;
    const T *x = logits + (size_t)row * Vp;
    T *d = dlogits + (size_t)row * Vp;
    const float l = lse[row];
    const int t = targets[row];
    for (int c = threadIdx.x * V; c < Vp; c += blockDim.x * V) {
        float f[V];
        dg_ldv<V>(f, x + c);
#pragma unroll
        for (int j = 0; j < V; j++)
            f[j] = ce_grad(f[j], c + j, Vv, t, l, dloss);
        dg_stv<V>(d + c, f);
    }
}

/* ---- the fused forward + backward (contract v1.10) ----
 *
 * Why shared memory (STAGE = true, the default wherever the row fits): the row is copied once from DRAM
 * into shared memory with cp.async (16 bytes per instruction, every copy of the thread in flight at once,
 * no registers held), reduced from there, and its gradient computed from there and stored: exactly one
 * DRAM read and one DRAM write of the row, whatever else runs. The alternative, a second pass over
 * global memory right after the first hoping for L2 hits, also needs no extra DRAM traffic while the
 * rows in flight fit in L2, but nothing bounds them: at bf16, GPT-2's 100 KB rows times the blocks that
 * registers alone would let reside (4 of 512 threads per SM, 132 SMs on an H100/H200) is ~53 MB, more
 * than the 50 MB L2 that the dlogits writes also pass through, so re-reads would partly miss and fall
 * back towards the unfused pair's three passes. Staging bounds the rows in flight by construction
 * (100.6 KB per block: 2 blocks of 512 threads per SM at bf16/f16, 1 at f32 for Vp = 50304) and the two
 * blocks on an SM overlap one's copy with the other's stores. Each thread reads back only the columns it
 * copied itself (the forward's column assignment), so the copy needs a cp.async wait but no barrier.
 *
 * Measured on the H200 (gpt2-124m, B = 32, bf16), the reasoning above lost: 3.02 ms staged against 2.76 ms
 * for STAGE = false, which is therefore the default (DG_CUDA_CE_SMEM=1 stages, where a row fits). Rows
 * larger than the opt-in shared memory (c->smem_optin less a small margin: at 227 KB, Vp > ~116k at
 * bf16/f16, ~58k at f32) and the default take STAGE = false: the same block reads
 * the row from global memory twice, back to back, so the second read is an L2 hit when the row is still
 * there (and at worst a DRAM re-read, never more traffic than the unfused pair). Both variants give the
 * same bits. */
template <typename T, int V, bool STAGE>
__global__ void __launch_bounds__(CE_THREADS)
    ce_fused_kernel(float *losses, float *lse_out, T *dlogits, const T *logits, const int32_t *targets,
                    int Vv, int Vp, float dloss, int wvec, int *err) {
    extern __shared__ __align__(16) unsigned char ce_stage[];
    __shared__ float shm[32], shs[32], shl;
    const int row = blockIdx.x;
    const T *g = logits + (size_t)row * Vp;
    T *d = dlogits + (size_t)row * Vp;
    const T *x = g;
    if constexpr (STAGE) {
        T *sx = reinterpret_cast<T *>(ce_stage);
        for (int c = threadIdx.x * V; c < Vv; c += blockDim.x * V) {
            if constexpr (V * sizeof(T) == 16) {
                const unsigned sa = (unsigned)__cvta_generic_to_shared(sx + c);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa),
                             "l"(__cvta_generic_to_global(g + c)));
            } else {
#pragma unroll
                for (int j = 0; j < V; j++)
                    sx[c + j] = g[c + j];
            }
        }
        if constexpr (V * sizeof(T) == 16) asm volatile("cp.async.wait_all;\n" ::: "memory");
        x = sx;
    }
    float m, s;
    ce_thread_lse<T, V>(m, s, x, Vv);
    const int t = targets[row];
    if (ce_block_lse(m, s, shm, shs)) {
        const float l = m + logf(s);
        ce_row_out(losses, lse_out, row, l, x, targets, Vv, err); /* the target logit, before any store */
        shl = l;
    }
    __syncthreads();
    const float l = shl;
    for (int c = threadIdx.x * V; c < Vp; c += blockDim.x * V) {
        float f[V];
        if (STAGE && c >= Vv) { /* padding columns were not staged: their gradient is 0 */
#pragma unroll
            for (int j = 0; j < V; j++)
                f[j] = 0.f;
        } else {
            dg_ldv<V>(f, x + c);
        }
#pragma unroll
        for (int j = 0; j < V; j++)
            f[j] = ce_grad(f[j], c + j, Vv, t, l, dloss);
        if (V == 1 || wvec) {
            dg_stv<V>(d + c, f);
        } else {
#pragma unroll
            for (int j = 0; j < V; j++)
                d[c + j] = dg_from_f<T>(f[j]);
        }
    }
}

template <typename T>
static dg_status_t ce_fwd_t(dg_cuda_t *c, float *losses, float *lse, const void *logits,
                            const int32_t *targets, int N, int V, int Vp) {
    constexpr int VE = 16 / sizeof(T);
    if (Vp % VE == 0 && dg_ptr_aligned(logits, 16))
        ce_fwd_kernel<T, VE>
            <<<N, CE_THREADS, 0, c->stream>>>(losses, lse, (const T *)logits, targets, V, Vp, c->err_dev);
    else
        ce_fwd_kernel<T, 1>
            <<<N, CE_THREADS, 0, c->stream>>>(losses, lse, (const T *)logits, targets, V, Vp, c->err_dev);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

template <typename T>
static dg_status_t ce_bwd_t(dg_cuda_t *c, void *dlogits, const void *logits, const float *lse,
                            const int32_t *targets, int N, int V, int Vp, float dloss) {
    constexpr int VE = 16 / sizeof(T);
    if (Vp % VE == 0 && dg_ptr_aligned(logits, 16) && dg_ptr_aligned(dlogits, 16))
        ce_bwd_kernel<T, VE>
            <<<N, CE_THREADS, 0, c->stream>>>((T *)dlogits, (const T *)logits, lse, targets, V, Vp, dloss);
    else
        ce_bwd_kernel<T, 1>
            <<<N, CE_THREADS, 0, c->stream>>>((T *)dlogits, (const T *)logits, lse, targets, V, Vp, dloss);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

template <typename T, int V>
static dg_status_t ce_fused_launch(dg_cuda_t *c, float *losses, float *lse, void *dlogits, const void *logits,
                                   const int32_t *targets, int N, int Vv, int Vp, float dloss) {
    const int wvec = dg_ptr_aligned(dlogits, 16);
    /* the staged columns: every vector that starts below Vv (the last may reach into the padding) */
    const size_t stage = ((size_t)(Vv + V - 1) / V) * V * sizeof(T);
    const size_t bytes = (stage + 15) / 16 * 16;
    if (c->ce_smem && bytes + CE_SMEM_SLACK <= c->smem_optin) {
        if (bytes > 48 * 1024)
            DG_CUDA_CHECK(cudaFuncSetAttribute(ce_fused_kernel<T, V, true>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
        ce_fused_kernel<T, V, true><<<N, CE_THREADS, bytes, c->stream>>>(
            losses, lse, (T *)dlogits, (const T *)logits, targets, Vv, Vp, dloss, wvec, c->err_dev);
    } else {
        ce_fused_kernel<T, V, false><<<N, CE_THREADS, 0, c->stream>>>(
            losses, lse, (T *)dlogits, (const T *)logits, targets, Vv, Vp, dloss, wvec, c->err_dev);
    }
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

template <typename T>
static dg_status_t ce_fused_t(dg_cuda_t *c, float *losses, float *lse, void *dlogits, const void *logits,
                              const int32_t *targets, int N, int V, int Vp, float dloss) {
    constexpr int VE = 16 / sizeof(T);
    /* the forward's vector width (the reduction order depends on it), not the backward's */
    if (Vp % VE == 0 && dg_ptr_aligned(logits, 16))
        return ce_fused_launch<T, VE>(c, losses, lse, dlogits, logits, targets, N, V, Vp, dloss);
    return ce_fused_launch<T, 1>(c, losses, lse, dlogits, logits, targets, N, V, Vp, dloss);
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
