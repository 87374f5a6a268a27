/* crossentropy.cu — fused classifier loss: the forward reads each row of logits once (online max and
 * sum of exponentials) and saves the row's logsumexp; the backward turns logits into dlogits in place
 * (it may alias them), so logits are never materialised twice nor in f32.
 *
 * One block per row; reductions go lane -> warp -> block in a fixed order (deterministic). A target
 * outside [0, V) gives loss NaN for that row and raises a flag that sync() reports.
 */
#include "cuda_impl.cuh"
#include "cuda_vec.cuh"

#define CE_THREADS 512

static __device__ __forceinline__ void lse_combine(float &m, float &s, float m2, float s2) {
    const float M = fmaxf(m, m2);
    if (M == -INFINITY) return; /* both empty */
    s = s * expf(m - M) + s2 * expf(m2 - M);
    m = M;
}

template <typename T, int V>
__global__ void __launch_bounds__(CE_THREADS)
    ce_fwd_kernel(float *losses, float *lse_out, const T *logits, const int32_t *targets, int Vv, int Vp,
                  int *err) {
    __shared__ float shm[32], shs[32];
    const int row = blockIdx.x;
    const T *x = logits + (size_t)row * Vp;
    float m = -INFINITY, s = 0.f;
    for (int c = threadIdx.x * V; c < Vv; c += blockDim.x * V) {
        float f[V];
        dg_ldv<V>(f, x + c);
        /* one rescale per vector, then V independent exponentials */
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
    if (wid == 0) {
        const int nw = blockDim.x >> 5;
        m = lane < nw ? shm[lane] : -INFINITY;
        s = lane < nw ? shs[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) {
            float m2 = __shfl_down_sync(0xffffffffu, m, o), s2 = __shfl_down_sync(0xffffffffu, s, o);
            lse_combine(m, s, m2, s2);
        }
        if (lane == 0) {
            const float l = m + logf(s);
            lse_out[row] = l;
            const int t = targets[row];
            if (t < 0 || t >= Vv) {
                atomicOr(err, DG_CUDA_EF_TARGET);
                losses[row] = __int_as_float(0x7fc00000);
            } else {
                losses[row] = l - dg_to_f(x[t]);
            }
        }
    }
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
        for (int j = 0; j < V; j++) {
            const int col = c + j;
            f[j] = col < Vv ? (expf(f[j] - l) - (col == t ? 1.f : 0.f)) * dloss : 0.f;
        }
        dg_stv<V>(d + c, f);
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

dg_status_t dg_cuda_crossentropy_fwd(dg_cuda_t *c, float *losses, float *lse, const void *logits,
                                     const int32_t *targets, int N, int V, int Vp) {
    return DG_CUDA_DISPATCH_ACT(c->act, ce_fwd_t, c, losses, lse, logits, targets, N, V, Vp);
}

dg_status_t dg_cuda_crossentropy_bwd(dg_cuda_t *c, void *dlogits, const void *logits, const float *lse,
                                     const int32_t *targets, int N, int V, int Vp, float dloss) {
    return DG_CUDA_DISPATCH_ACT(c->act, ce_bwd_t, c, dlogits, logits, lse, targets, N, V, Vp, dloss);
}
