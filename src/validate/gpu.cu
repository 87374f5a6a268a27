/* gpu.cu — the GPU side of the validation checks (built only with DG_HAVE_CUDA): which device a rank
 * uses, driver/runtime/NCCL versions, a bf16 GEMM through cuBLASLt and a STREAM-like triad in device
 * memory (both timed with CUDA events, both checking their results), and device buffers for the NCCL
 * collectives check. Every CUDA and cuBLASLt call is checked; a failure returns DG_ERR_RUNTIME naming
 * the call, and everything allocated is released on every path.
 */
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <nccl.h>
#include <stdio.h>
#include <string.h>

#include "validate_gpu.h"

#define VG_CUDA(call)                                                                                        \
    do {                                                                                                     \
        cudaError_t e_ = (call);                                                                             \
        if (e_ != cudaSuccess) {                                                                             \
            st = DG_ERR(DG_ERR_RUNTIME, "CUDA call `%s` failed: %s; hint: check the GPU with nvidia-smi",    \
                        #call, cudaGetErrorString(e_));                                                      \
            goto done;                                                                                       \
        }                                                                                                    \
    } while (0)

#define VG_LT(call)                                                                                          \
    do {                                                                                                     \
        cublasStatus_t e_ = (call);                                                                          \
        if (e_ != CUBLAS_STATUS_SUCCESS) {                                                                   \
            st = DG_ERR(DG_ERR_RUNTIME,                                                                      \
                        "cuBLASLt call `%s` failed: status %d; hint: library/driver mismatch?", #call,       \
                        (int)e_);                                                                            \
            goto done;                                                                                       \
        }                                                                                                    \
    } while (0)

extern "C" int dg_vgpu_count(char *err, size_t cap) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        snprintf(err, cap, "CUDA sees no device: %s", cudaGetErrorString(e));
        return 0;
    }
    if (n == 0) snprintf(err, cap, "CUDA sees no device");
    return n;
}

extern "C" int dg_vgpu_device(const char *busid, int fallback) {
    int dev = -1, n = 0;
    if (busid && *busid && cudaDeviceGetByPCIBusId(&dev, busid) == cudaSuccess) return dev;
    cudaGetLastError(); /* clear the sticky-free error of a failed lookup */
    if (cudaGetDeviceCount(&n) != cudaSuccess) return -1;
    return fallback >= 0 && fallback < n ? fallback : -1;
}

extern "C" void dg_vgpu_name(int dev, char *buf, size_t cap) {
    cudaDeviceProp p;
    if (cap) buf[0] = 0;
    if (dev >= 0 && cudaGetDeviceProperties(&p, dev) == cudaSuccess) snprintf(buf, cap, "%s", p.name);
}

extern "C" void dg_vgpu_versions(char *buf, size_t cap) {
    int d = 0, r = 0, v = 0;
    if (cudaDriverGetVersion(&d) != cudaSuccess) d = 0;
    if (cudaRuntimeGetVersion(&r) != cudaSuccess) r = 0;
    if (ncclGetVersion(&v) != ncclSuccess) v = 0;
    snprintf(buf, cap, "cuda_driver=%d;cuda_runtime=%d;nccl=%d", d, r, v);
}

/* ---------------------------------------------------------------- GEMM */

/* Multiples of 1/8 in [-1, 1]: exact in bf16, products exact in fp32, sums exact while |sum| < 2^18. */
__host__ __device__ static inline float patv(uint32_t seed, size_t i) {
    uint32_t x = (uint32_t)i * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 0x2c1b3c6du;
    x ^= x >> 12;
    return (float)((int)(x % 17u) - 8) / 8.0f;
}

__global__ static void fill_bf16(__nv_bfloat16 *p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(patv(seed, i));
}

extern "C" dg_status_t dg_vgpu_gemm_bf16(int dev, int n, int reps, double *times, double *work,
                                         int64_t *wrong) {
    dg_status_t st = DG_OK;
    cublasLtHandle_t lt = NULL;
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    __nv_bfloat16 *A = NULL, *B = NULL, *C = NULL, *hc = NULL;
    void *ws = NULL;
    size_t ws_bytes = 32u << 20;
    cudaStream_t s = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    size_t nn = (size_t)n * n;
    const uint32_t sa = 0x1234u, sb = 0xabcdu;
    float alpha = 1.0f, beta = 0.0f;
    cublasLtMatmulHeuristicResult_t heur;
    int nres = 0;
    *wrong = 0;
    *work = 2.0 * n * (double)n * n;

    VG_CUDA(cudaSetDevice(dev));
    VG_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    VG_CUDA(cudaEventCreate(&e0));
    VG_CUDA(cudaEventCreate(&e1));
    VG_CUDA(cudaMalloc((void **)&A, nn * sizeof *A));
    VG_CUDA(cudaMalloc((void **)&B, nn * sizeof *B));
    VG_CUDA(cudaMalloc((void **)&C, nn * sizeof *C));
    VG_CUDA(cudaMalloc(&ws, ws_bytes));
    fill_bf16<<<1024, 256, 0, s>>>(A, nn, sa);
    fill_bf16<<<1024, 256, 0, s>>>(B, nn, sb);
    VG_CUDA(cudaGetLastError());

    VG_LT(cublasLtCreate(&lt));
    VG_LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    /* A, B and C share one layout: n x n, column-major, bf16 */
    VG_LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, n, n, n));
    VG_LT(cublasLtMatmulPreferenceCreate(&pref));
    VG_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                               sizeof ws_bytes));
    VG_LT(cublasLtMatmulAlgoGetHeuristic(lt, op, la, la, la, la, pref, 1, &heur, &nres));
    if (nres < 1) {
        st = DG_ERR(DG_ERR_RUNTIME, "cuBLASLt has no bf16 GEMM algorithm for n=%d on device %d", n, dev);
        goto done;
    }
    for (int r = -1; r < reps; r++) {
        VG_CUDA(cudaEventRecord(e0, s));
        VG_LT(cublasLtMatmul(lt, op, &alpha, A, la, B, la, &beta, C, la, C, la, &heur.algo, ws, ws_bytes, s));
        VG_CUDA(cudaEventRecord(e1, s));
        VG_CUDA(cudaEventSynchronize(e1));
        float ms = 0;
        VG_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 0) times[r] = ms * 1e-3;
    }
    /* 64 sampled elements against a host reference (C = A B, column-major) */
    VG_CUDA(cudaMallocHost((void **)&hc, nn * sizeof *hc));
    VG_CUDA(cudaMemcpyAsync(hc, C, nn * sizeof *hc, cudaMemcpyDeviceToHost, s));
    VG_CUDA(cudaStreamSynchronize(s));
    for (int k = 0; k < 64; k++) {
        size_t i = (size_t)(k * 7919u) % (size_t)n, j = (size_t)(k * 104729u + 13) % (size_t)n;
        double ref = 0;
        for (size_t q = 0; q < (size_t)n; q++)
            ref += (double)patv(sa, i + q * n) * patv(sb, q + j * n);
        double got = (double)__bfloat162float(hc[i + j * n]);
        if (fabs(got - ref) > fabs(ref) * (1.0 / 128) + 1e-6) (*wrong)++;
    }
done:
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
    if (lt) cublasLtDestroy(lt);
    if (hc) cudaFreeHost(hc);
    cudaFree(A);
    cudaFree(B);
    cudaFree(C);
    cudaFree(ws);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (s) cudaStreamDestroy(s);
    return st;
}

/* ---------------------------------------------------------------- triad */

__global__ static void triad_init(float *b, float *c, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        b[i] = (float)(i % 1000);
        c[i] = (float)(i % 7);
    }
}

__global__ static void triad(float *__restrict__ a, const float *__restrict__ b, const float *__restrict__ c,
                             float s, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        a[i] = b[i] + s * c[i];
}

extern "C" dg_status_t dg_vgpu_stream(int dev, size_t bytes, int reps, double *times, double *work,
                                      int64_t *wrong) {
    dg_status_t st = DG_OK;
    size_t n = bytes / (3 * sizeof(float));
    float *a = NULL, *b = NULL, *c = NULL, *h = NULL;
    cudaStream_t s = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    int sms = 0;
    const size_t check = 1 << 16;
    *wrong = 0;
    if (n < 1024) n = 1024;
    *work = 3.0 * sizeof(float) * (double)n;
    VG_CUDA(cudaSetDevice(dev));
    VG_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    VG_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    VG_CUDA(cudaEventCreate(&e0));
    VG_CUDA(cudaEventCreate(&e1));
    VG_CUDA(cudaMalloc((void **)&a, n * sizeof *a));
    VG_CUDA(cudaMalloc((void **)&b, n * sizeof *b));
    VG_CUDA(cudaMalloc((void **)&c, n * sizeof *c));
    triad_init<<<sms * 8, 256, 0, s>>>(b, c, n);
    VG_CUDA(cudaGetLastError());
    for (int r = -1; r < reps; r++) {
        VG_CUDA(cudaEventRecord(e0, s));
        triad<<<sms * 8, 256, 0, s>>>(a, b, c, 3.0f, n);
        VG_CUDA(cudaGetLastError());
        VG_CUDA(cudaEventRecord(e1, s));
        VG_CUDA(cudaEventSynchronize(e1));
        float ms = 0;
        VG_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 0) times[r] = ms * 1e-3;
    }
    {
        /* the first and the last `check` elements (or all of them) */
        size_t m = n < 2 * check ? n : 2 * check;
        VG_CUDA(cudaMallocHost((void **)&h, m * sizeof *h));
        size_t first = m == n ? n : check;
        VG_CUDA(cudaMemcpyAsync(h, a, first * sizeof *h, cudaMemcpyDeviceToHost, s));
        if (m > first)
            VG_CUDA(cudaMemcpyAsync(h + first, a + n - check, check * sizeof *h, cudaMemcpyDeviceToHost, s));
        VG_CUDA(cudaStreamSynchronize(s));
        for (size_t k = 0; k < m; k++) {
            size_t i = k < first ? k : n - check + (k - first);
            *wrong += h[k] != (float)(i % 1000) + 3.0f * (float)(i % 7);
        }
    }
done:
    if (h) cudaFreeHost(h);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    if (s) cudaStreamDestroy(s);
    return st;
}

/* ---------------------------------------------------------------- buffers */

extern "C" dg_status_t dg_vgpu_alloc(int dev, size_t bytes, void **p) {
    dg_status_t st = DG_OK;
    *p = NULL;
    VG_CUDA(cudaSetDevice(dev));
    VG_CUDA(cudaMalloc(p, bytes));
done:
    return st;
}

extern "C" void dg_vgpu_free(void *p) {
    cudaFree(p);
}

extern "C" dg_status_t dg_vgpu_copy(void *dst, const void *src, size_t bytes, int to_device) {
    dg_status_t st = DG_OK;
    VG_CUDA(cudaMemcpy(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost));
done:
    return st;
}
