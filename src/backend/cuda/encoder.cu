/* encoder.cu — token + position embedding, forward and a deterministic backward.
 *
 * Backward without atomics: the positions are sorted by token id (CUB's stable radix sort: a pure
 * function of the input, so the order is the same every run); then one block per run of equal tokens
 * sums that token's gradient rows in ascending position order and adds the sum to dwte once. dwpe sums
 * over the batch in b order. Both orders are fixed, so results are bitwise reproducible.
 */
#include <cub/device/device_radix_sort.cuh>

#include "cuda_impl.cuh"
#include "cuda_vec.cuh"

template <typename T, int V>
__global__ void encoder_fwd_kernel(T *out, const int32_t *tokens, const T *wte, const T *wpe, int Tn, int C,
                                   int *err) {
    const int row = blockIdx.x;
    const int t = row % Tn;
    const int tok = tokens[row];
    T *o = out + (size_t)row * C;
    if (tok < 0) {
        if (threadIdx.x == 0) atomicOr(err, DG_CUDA_EF_TOKEN);
        for (int c = threadIdx.x; c < C; c += blockDim.x)
            o[c] = dg_from_f<T>(__int_as_float(0x7fc00000));
        return;
    }
    const T *we = wte + (size_t)tok * C, *pe = wpe + (size_t)t * C;
    for (int c = threadIdx.x * V; c < C; c += blockDim.x * V) {
        float a[V], b[V];
        dg_ldv<V>(a, we + c);
        dg_ldv<V>(b, pe + c);
#pragma unroll
        for (int j = 0; j < V; j++)
            a[j] += b[j];
        dg_stv<V>(o + c, a);
    }
}

template <typename T>
static dg_status_t encoder_fwd_t(dg_cuda_t *c, void *out, const int32_t *tokens, const void *wte,
                                 const void *wpe, int B, int Tn, int C) {
    constexpr int V = 16 / sizeof(T);
    const bool vec =
        C % V == 0 && dg_ptr_aligned(out, 16) && dg_ptr_aligned(wte, 16) && dg_ptr_aligned(wpe, 16);
    const int per = vec ? C / V : C;
    const int threads = per >= 256 ? 256 : ((per + 31) / 32) * 32;
    if (vec)
        encoder_fwd_kernel<T, V><<<B * Tn, threads, 0, c->stream>>>((T *)out, tokens, (const T *)wte,
                                                                    (const T *)wpe, Tn, C, c->err_dev);
    else
        encoder_fwd_kernel<T, 1><<<B * Tn, threads, 0, c->stream>>>((T *)out, tokens, (const T *)wte,
                                                                    (const T *)wpe, Tn, C, c->err_dev);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

dg_status_t dg_cuda_encoder_fwd(dg_cuda_t *c, void *out, const int32_t *tokens, const void *wte,
                                const void *wpe, int B, int T, int C) {
    return DG_CUDA_DISPATCH_ACT(c->act, encoder_fwd_t, c, out, tokens, wte, wpe, B, T, C);
}

/* dwpe[t, c] += sum over b (in b order) of dout[b, t, c] */
template <typename T>
__global__ void encoder_bwd_wpe_kernel(float *dwpe, const T *dout, int B, int Tn, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int t = blockIdx.y;
    if (c >= C) return;
    float s = 0.f;
    for (int b = 0; b < B; b++)
        s += dg_to_f(dout[((size_t)b * Tn + t) * C + c]);
    dwpe[(size_t)t * C + c] += s;
}

__global__ void iota_kernel(int32_t *v, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) v[i] = i;
}

/* One block (column slice) per sorted index; only the first index of each run of equal tokens works. */
template <typename T>
__global__ void encoder_bwd_wte_kernel(float *dwte, const T *dout, const int32_t *skeys, const int32_t *spos,
                                       int N, int C, int *err) {
    const int i = blockIdx.x;
    const int tok = skeys[i];
    if (i > 0 && skeys[i - 1] == tok) return;
    if (tok < 0) {
        if (threadIdx.x == 0 && blockIdx.y == 0) atomicOr(err, DG_CUDA_EF_TOKEN);
        return;
    }
    int end = i + 1;
    while (end < N && skeys[end] == tok)
        end++;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float s = 0.f;
#pragma unroll 4
    for (int k = i; k < end; k++)
        s += dg_to_f(dout[(size_t)spos[k] * C + c]);
    dwte[(size_t)tok * C + c] += s;
}

template <typename T>
static dg_status_t encoder_bwd_t(dg_cuda_t *c, float *dwte, float *dwpe, const void *dout,
                                 const int32_t *tokens, int B, int Tn, int C) {
    const T *d = (const T *)dout;
    if (dwpe) {
        dim3 grid((C + 127) / 128, Tn);
        encoder_bwd_wpe_kernel<T><<<grid, 128, 0, c->stream>>>(dwpe, d, B, Tn, C);
        DG_CUDA_LAUNCH_CHECK();
    }
    if (!dwte) return DG_OK;
    const int N = B * Tn;
    size_t temp_bytes = 0;
    DG_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, (const int32_t *)nullptr,
                                                  (int32_t *)nullptr, (const int32_t *)nullptr,
                                                  (int32_t *)nullptr, N, 0, 32, c->stream));
    const size_t arr = (((size_t)N * sizeof(int32_t)) + 255) & ~(size_t)255;
    void *scr = NULL;
    DG_TRY(dg_cuda_scratch(c, 3 * arr + temp_bytes, &scr));
    char *base = (char *)scr;
    int32_t *skeys = (int32_t *)base, *pos = (int32_t *)(base + arr), *spos = (int32_t *)(base + 2 * arr);
    void *temp = base + 3 * arr;
    iota_kernel<<<(N + 255) / 256, 256, 0, c->stream>>>(pos, N);
    DG_CUDA_LAUNCH_CHECK();
    DG_CUDA_CHECK(
        cub::DeviceRadixSort::SortPairs(temp, temp_bytes, tokens, skeys, pos, spos, N, 0, 32, c->stream));
    const int threads = C >= 256 ? 256 : ((C + 31) / 32) * 32;
    dim3 grid(N, (C + threads - 1) / threads);
    encoder_bwd_wte_kernel<T><<<grid, threads, 0, c->stream>>>(dwte, d, skeys, spos, N, C, c->err_dev);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

dg_status_t dg_cuda_encoder_bwd(dg_cuda_t *c, float *dwte, float *dwpe, const void *dout,
                                const int32_t *tokens, int B, int T, int C) {
    return DG_CUDA_DISPATCH_ACT(c->act, encoder_bwd_t, c, dwte, dwpe, dout, tokens, B, T, C);
}
