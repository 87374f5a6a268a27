/* attention_kv.cu — backend.h's attention_kv_fwd (v1.12): a block of new query rows of one sequence
 * against its key/value cache, for the KV-cache decoder (src/model/infer.c).
 *
 * Two kernels on the backend's stream: kv_append copies the k and v blocks of the new qkv rows into the
 * cache rows [p0, p0 + n); kv_attend runs one block per (query row, head): the scaled scores of the row's
 * L = p0 + i + 1 keys go to shared memory, the block reduces their maximum and the sum of exponentials
 * (fixed butterfly order), then each thread forms output dimensions as sums over the keys in increasing
 * order. All arithmetic in f32, the output rounded once to the activation dtype. Deterministic; no
 * atomics, no scratch, capturable. Shared memory: (cap + head size) floats, so cap is bounded by the
 * device's opt-in shared memory per block (about 57,000 rows on an H100/H200).
 */
#include "cuda_impl.cuh"

#define KV_THREADS 128

template <typename T> __global__ void kv_append(T *kc, T *vc, const T *qkv, int p0, int n, int C) {
    const size_t total = (size_t)n * C;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total;
         e += (size_t)gridDim.x * blockDim.x) {
        const size_t i = e / C, c = e % C, dst = (size_t)(p0 + i) * C + c;
        kc[dst] = qkv[i * 3 * C + C + c];
        vc[dst] = qkv[i * 3 * C + 2 * (size_t)C + c];
    }
}

static __device__ __forceinline__ float kv_block_max(float v, float *sh) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = dg_warp_max(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    float t = lane < nw ? sh[lane] : -INFINITY;
    return dg_warp_max(t);
}

template <typename T>
__global__ void __launch_bounds__(KV_THREADS)
    kv_attend(T *out, const T *kc, const T *vc, const T *qkv, int p0, int C, int NH, float scale) {
    extern __shared__ float kv_sm[];
    __shared__ float red[32];
    const int i = blockIdx.x, h = blockIdx.y, HS = C / NH, L = p0 + i + 1;
    float *q = kv_sm, *s = kv_sm + HS;
    const T *qrow = qkv + (size_t)i * 3 * C + (size_t)h * HS;
    for (int d = threadIdx.x; d < HS; d += blockDim.x)
        q[d] = dg_to_f(qrow[d]);
    __syncthreads();
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < L; j += blockDim.x) {
        const T *k = kc + (size_t)j * C + (size_t)h * HS;
        float dot = 0.f;
        for (int d = 0; d < HS; d++)
            dot += q[d] * dg_to_f(k[d]);
        s[j] = dot * scale;
        mx = fmaxf(mx, s[j]);
    }
    mx = kv_block_max(mx, red);
    float part = 0.f;
    for (int j = threadIdx.x; j < L; j += blockDim.x) {
        s[j] = expf(s[j] - mx);
        part += s[j];
    }
    const float inv = 1.f / dg_block_sum(part, red); /* its barriers also publish s[] */
    T *o = out + (size_t)i * C + (size_t)h * HS;
    for (int d = threadIdx.x; d < HS; d += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < L; j++)
            acc += s[j] * dg_to_f(vc[(size_t)j * C + (size_t)h * HS + d]);
        o[d] = dg_from_f<T>(acc * inv);
    }
}

template <typename T>
static dg_status_t kv_fwd_t(dg_cuda_t *c, void *out, void *kcache, void *vcache, const void *qkv, int p0,
                            int n, int cap, int C, int NH) {
    const int HS = C / NH;
    const size_t smem = ((size_t)cap + HS) * sizeof(float);
    if (smem > c->smem_optin)
        return DG_ERR(
            DG_ERR_USAGE,
            "cuda backend attention_kv_fwd: a cache of %d rows needs %zu bytes of shared memory per "
            "block; this device allows %zu",
            cap, smem, c->smem_optin);
    const unsigned ab = dg_cuda_blocks((size_t)n * C, 256, 4 * (unsigned)c->sm_count);
    kv_append<T><<<ab, 256, 0, c->stream>>>((T *)kcache, (T *)vcache, (const T *)qkv, p0, n, C);
    DG_CUDA_LAUNCH_CHECK();
    if (smem > 48 * 1024)
        DG_CUDA_CHECK(
            cudaFuncSetAttribute(kv_attend<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    dim3 grid((unsigned)n, (unsigned)NH);
    kv_attend<T><<<grid, KV_THREADS, smem, c->stream>>>((T *)out, (const T *)kcache, (const T *)vcache,
                                                        (const T *)qkv, p0, C, NH, 1.f / sqrtf((float)HS));
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

dg_status_t dg_cuda_attention_kv_fwd(dg_cuda_t *c, void *out, void *kcache, void *vcache, const void *qkv,
                                     int p0, int n, int cap, int C, int NH) {
    return DG_CUDA_DISPATCH_ACT(c->act, kv_fwd_t, c, out, kcache, vcache, qkv, p0, n, cap, C, NH);
}
