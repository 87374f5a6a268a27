/* cuda_impl.cuh — private to the CUDA backend: its state, the one check macro per library
 * (DG_CUDA_CHECK, DG_CUBLAS_CHECK), device-side dtype helpers, and the entry points each kernel file
 * (*.cu in this folder) offers to backend_cuda.cu, which fills the vtable.
 *
 * Rules every kernel file follows (they are what makes a whole step capturable as one CUDA Graph):
 *   - all work goes on impl->stream; nothing synchronises with the host except sync/to_host/to_device
 *     and fence_wait (which waits for one event, not for the stream);
 *   - nothing allocates during a step: temporary memory comes from dg_cuda_scratch(), which grows only
 *     outside stream capture (the first, eager step sizes it);
 *   - no floating-point atomics: every reduction has a fixed partition and a fixed order;
 *   - bad indices in device data (tokens, targets) never fault: kernels skip them and raise a flag in
 *     impl->err_dev that sync() (or fence_wait(), from a copy taken at the fence) turns into a one-line
 *     error.
 */
#ifndef DG_CUDA_IMPL_CUH
#define DG_CUDA_IMPL_CUH

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "backend.h"
#include "dg_common.h"

/* ---- error reporting ---- */
dg_status_t dg_cuda_fail(cudaError_t e, const char *call, const char *file, int line);
dg_status_t dg_cublas_fail(cublasStatus_t s, const char *call, const char *file, int line);

#define DG_CUDA_CHECK(call)                                                                                  \
    do {                                                                                                     \
        cudaError_t dg_cu_e_ = (call);                                                                       \
        if (dg_cu_e_ != cudaSuccess) return dg_cuda_fail(dg_cu_e_, #call, __FILE__, __LINE__);               \
    } while (0)
#define DG_CUBLAS_CHECK(call)                                                                                \
    do {                                                                                                     \
        cublasStatus_t dg_cb_s_ = (call);                                                                    \
        if (dg_cb_s_ != CUBLAS_STATUS_SUCCESS) return dg_cublas_fail(dg_cb_s_, #call, __FILE__, __LINE__);   \
    } while (0)
/* After every kernel launch: catches bad launch configurations at once (execution errors surface at
 * the next sync, as with any asynchronous work). */
#define DG_CUDA_LAUNCH_CHECK() DG_CUDA_CHECK(cudaGetLastError())

/* Device error flags (bits of impl->err_dev[0]), raised by kernels on bad device-resident input. */
enum { DG_CUDA_EF_TOKEN = 1, DG_CUDA_EF_TARGET = 2 };

/* One cached cuBLASLt plan: descriptors and the algorithm chosen once per shape/type/alignment. */
typedef struct dg_gemm_key {
    int m, n, k, transa, transb, lda, ldb, ldd;
    int atype, ctype, epilogue, beta_nonzero, compute;
    int align_a, align_b, align_c, align_bias, align_aux;
} dg_gemm_key_t;

typedef struct dg_gemm_plan {
    dg_gemm_key_t key;
    int supported; /* 0: cuBLASLt offers no algorithm: the caller takes its unfused path */
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
    size_t ws_bytes;
} dg_gemm_plan_t;

#define DG_GEMM_TUNE_MAX 16 /* candidates timed per shape with DG_CUDA_GEMM_TUNE=1 */

typedef struct dg_cudnn dg_cudnn_t; /* attn_cudnn.cu's state: the loaded library, handle and plans */

typedef struct dg_cuda {
    int device;
    int sm_count;
    int cc_major, cc_minor;
    size_t smem_optin; /* max dynamic shared memory per block after opt-in */
    dg_dtype_t act;
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *lt_ws;
    size_t lt_ws_bytes;
    void *scratch;
    size_t scratch_bytes;
    int *err_dev;        /* device flags, read back in sync() */
    int fused_epilogues; /* 0 when DG_CUDA_FUSED_EPILOGUES=0: GEMM + separate kernels (for testing) */
    int fused_dgelu;     /* 0 when DG_CUDA_FUSED_DGELU=0: matmul_bwd_dgelu as GEMM + gelu_bwd kernel even
                            where the DGELU epilogue applies (A/B timing of the epilogue alone) */
    int gemm_tune;       /* 0 when DG_CUDA_GEMM_TUNE=0: no timing of GEMM algorithms (matmul.cu) */
    int ln_reg;          /* 0 when DG_CUDA_LN_REG=0: layernorm by the generic kernels only (A/B timing) */
    int fast_attention;  /* 0 when DG_CUDA_FAST_ATTENTION=0: the generic attention kernels only (the reference
                            the tests check the others against), neither cuDNN nor the tensor-core kernels */
    int graphs_alive;    /* instantiated graphs not yet freed: they hold the scratch's address */
    void **retired;      /* scratch blocks outgrown while graphs were alive (freed at destroy) */
    int n_retired;
    int attn_cudnn;    /* bf16/f16 attention through cuDNN's fused engines (deterministic ones only) where it
                          plans the shape: 1 (default), 0 never (DG_CUDA_ATTN_CUDNN=0: the built-in kernels) */
    dg_cudnn_t *cudnn; /* loaded on first use; NULL before */
    void *attn_ws;     /* during attention_bwd_ws: the caller's workspace (else NULL: the scratch) */
    size_t attn_ws_bytes;
    dg_gemm_plan_t *plans;
    int n_plans, cap_plans;
    /* train.precision=fp8 (dg_backend_config_t.fp8; fp8.cu, matmul.cu): the linear layers' forward and
     * input-gradient GEMMs on E4M3 operands quantized per call into fp8_buf (a block of its own, since
     * the callers also use the scratch); counters for the tests and the run's log */
    int fp8;
    void *fp8_buf;
    size_t fp8_bytes;
    long long fp8_gemms, fp8_refused;
    /* memory accounting (dg_backend_cuda_mem_stats): every cudaMalloc of the backend, the vtable's
     * alloc, the scratch and the cuBLASLt workspace, so the peak compares with PyTorch's
     * max_memory_allocated; the (pointer, size) table lets free() subtract */
    char name[256];
    char tune_tag[128]; /* the GEMM tuning table's device tag (matmul.cu), built on first use */
    size_t mem_now, mem_peak;
    size_t mem_win_peak; /* the peak since the last mem_usage reset (the SLA memory_plan window) */
    void **mem_ptr;
    size_t *mem_size;
    int mem_n, mem_cap;
} dg_cuda_t;

static inline dg_cuda_t *dg_cuda_of(dg_backend_t *be) {
    return (dg_cuda_t *)be->impl;
}

/* Temporary device memory valid until the next backend call (all work is ordered on one stream).
 * Grows (re-allocates) when too small; refuses to grow during stream capture. */
dg_status_t dg_cuda_scratch(dg_cuda_t *c, size_t bytes, void **out);
/* The FP8 operand block (fp8.cu/matmul.cu): like the scratch, valid until the next backend call. */
dg_status_t dg_cuda_fp8_scratch(dg_cuda_t *c, size_t bytes, void **out);
/* Memory accounting: call after every successful cudaMalloc / before every cudaFree of the backend. */
void dg_cuda_mem_add(dg_cuda_t *c, size_t bytes);
void dg_cuda_mem_sub(dg_cuda_t *c, size_t bytes);

/* ---- entry points implemented in the kernel files ---- */
/* elementwise.cu */
dg_status_t dg_cuda_cast(dg_cuda_t *c, void *dst, dg_dtype_t dt, const void *src, dg_dtype_t st, size_t n);
dg_status_t dg_cuda_add(dg_cuda_t *c, void *out, const void *a, const void *b, size_t n);
dg_status_t dg_cuda_accumulate(dg_cuda_t *c, void *dst, const void *src, size_t n, int acc);
dg_status_t dg_cuda_sumsq_f32(dg_cuda_t *c, float *out, const float *x, size_t n);
dg_status_t dg_cuda_sumsq_multi(dg_cuda_t *c, float *out, const float *base, const dg_sumsq_seg_t *segs,
                                const dg_sumsq_seg_t *segs_dev, int nseg);
dg_status_t dg_cuda_scale_f32(dg_cuda_t *c, float *x, size_t n, float s);
dg_status_t dg_cuda_gelu_fwd(dg_cuda_t *c, void *out, const void *inp, size_t n);
dg_status_t dg_cuda_gelu_bwd(dg_cuda_t *c, void *dinp, const void *inp, const void *dout, size_t n, int acc);
dg_status_t dg_cuda_bias_gelu(dg_cuda_t *c, void *out, void *pre, const void *bias, int N, int OC, int gelu);
/* dst[c] += sum over the N rows of src[N, C] (act dtype): deterministic two-level column sum. */
dg_status_t dg_cuda_colsum_acc(dg_cuda_t *c, float *dst, const void *src, int N, int C);
/* The final level of the column sums: with part an f32 [P, W] matrix of partial rows, lo[c] += sum_p
 * part[p, c] for c < split and hi[c - split] += sum_p part[p, c] for c >= split (lo or hi NULL: those
 * columns are skipped). The order of the additions depends only on P. */
dg_status_t dg_cuda_rowsum_acc(dg_cuda_t *c, float *lo, float *hi, int split, const float *part, int P,
                               int W);
dg_status_t dg_cuda_add_f32(dg_cuda_t *c, float *dst, const float *src, size_t n);
dg_status_t dg_cuda_adamw(dg_cuda_t *c, float *master, void *compute, const float *grad, float *m, float *v,
                          size_t n, float lr, float beta1, float beta2, float eps, float wd, int64_t t,
                          const float *gscale_dev);
dg_status_t dg_cuda_clip_scale(dg_cuda_t *c, float *gscale, float *norm, const float *sumsq, float clip,
                               float extra);
dg_status_t dg_cuda_adamw_dev(dg_cuda_t *c, float *master, void *compute, const float *grad, float *m,
                              float *v, size_t n, float beta1, float beta2, float eps, float wd,
                              const float *sc);
dg_status_t dg_cuda_adamw_multi_dev(dg_cuda_t *c, const dg_adamw_seg_t *segs, int nseg, size_t span,
                                    float *master, void *compute, const float *grad, float *m, float *v,
                                    float beta1, float beta2, float eps, float wd, const float *sc);
/* encoder.cu */
dg_status_t dg_cuda_encoder_fwd(dg_cuda_t *c, void *out, const int32_t *tokens, const void *wte,
                                const void *wpe, int B, int T, int C);
dg_status_t dg_cuda_encoder_bwd(dg_cuda_t *c, float *dwte, float *dwpe, const void *dout,
                                const int32_t *tokens, int B, int T, int C);
/* layernorm.cu */
dg_status_t dg_cuda_layernorm_fwd(dg_cuda_t *c, void *out, float *mean, float *rstd, const void *inp,
                                  const void *w, const void *b, int N, int C);
dg_status_t dg_cuda_layernorm_bwd(dg_cuda_t *c, void *dinp, float *dw, float *db, const void *dout,
                                  const void *inp, const void *w, const float *mean, const float *rstd, int N,
                                  int C, int acc);
/* fp8.cu: x[rows, cols] (act dtype) -> E4M3 with the current per-tensor scale 448 / amax(|x|): q the
 * same layout (or NULL), qt the transpose [cols, rows] (or NULL). `slot` (4 floats, 16-byte aligned, device)
 * receives the inverse scale the GEMM dequantizes with (slot[0]), the scale and amax's bits. */
dg_status_t dg_cuda_fp8_quantize(dg_cuda_t *c, uint8_t *q, uint8_t *qt, const void *x, int rows, int cols,
                                 float *slot);
/* matmul.cu */
dg_status_t dg_cuda_matmul_fwd(dg_cuda_t *c, void *out, void *pre, const void *inp, const void *w,
                               const void *bias, int N, int C, int OC, dg_epilogue_t epi);
dg_status_t dg_cuda_matmul_fwd_res(dg_cuda_t *c, void *out, const void *inp, const void *w, const void *bias,
                                   const void *res, int N, int C, int OC);
dg_status_t dg_cuda_matmul_bwd(dg_cuda_t *c, void *dinp, float *dw, float *dbias, const void *dout,
                               const void *inp, const void *w, int N, int C, int OC, int acc);
dg_status_t dg_cuda_matmul_bwd_dgelu(dg_cuda_t *c, void *dpre, float *dw, float *dbias, const void *dout,
                                     const void *inp, const void *w, const void *pre, int N, int C, int OC,
                                     int acc);
void dg_cuda_gemm_plans_free(dg_cuda_t *c);
/* attention.cu */
size_t dg_cuda_attention_aux_bytes(int B, int T, int C, int NH);
dg_status_t dg_cuda_attention_fwd(dg_cuda_t *c, void *out, void *aux, const void *qkv, int B, int T, int C,
                                  int NH);
dg_status_t dg_cuda_attention_bwd(dg_cuda_t *c, void *dqkv, const void *dout, const void *qkv,
                                  const void *out, const void *aux, int B, int T, int C, int NH);
/* attn_cudnn.cu: *handled = 0 (and DG_OK) when cuDNN cannot serve the call: the caller runs its own
 * kernels. Forward: (out, aux, qkv); backward: (dqkv, dout, qkv, out, aux). */
dg_status_t dg_cuda_cudnn_attention(dg_cuda_t *c, int bwd, void *o_or_dqkv, void *aux_or_dout,
                                    const void *qkv, const void *out, const void *aux, int B, int T, int C,
                                    int NH, int *handled);
void dg_cuda_cudnn_free(dg_cuda_t *c);
/* Workspace bytes cuDNN's backward wants for this shape (plans it on first sight); 0 when cuDNN does not
 * serve it. */
size_t dg_cuda_cudnn_attention_ws_bytes(dg_cuda_t *c, int B, int T, int C, int NH);
long long dg_cuda_cudnn_calls(dg_cuda_t *c);
/* attention_kv.cu: backend.h's attention_kv_fwd (v1.12) */
dg_status_t dg_cuda_attention_kv_fwd(dg_cuda_t *c, void *out, void *kcache, void *vcache, const void *qkv,
                                     int p0, int n, int cap, int C, int NH);
/* crossentropy.cu */
dg_status_t dg_cuda_crossentropy_fwd(dg_cuda_t *c, float *losses, float *lse, const void *logits,
                                     const int32_t *targets, int N, int V, int Vp);
dg_status_t dg_cuda_crossentropy_bwd(dg_cuda_t *c, void *dlogits, const void *logits, const float *lse,
                                     const int32_t *targets, int N, int V, int Vp, float dloss);
dg_status_t dg_cuda_crossentropy_fused(dg_cuda_t *c, float *losses, float *lse, void *dlogits,
                                       const void *logits, const int32_t *targets, int N, int V, int Vp,
                                       float dloss);

/* ---- device helpers shared by the kernel files ---- */
#ifdef __CUDACC__
typedef __nv_bfloat16 dg_bf16;
typedef __half dg_f16;

static __device__ __forceinline__ float dg_to_f(float x) {
    return x;
}
static __device__ __forceinline__ float dg_to_f(dg_bf16 x) {
    return __bfloat162float(x);
}
static __device__ __forceinline__ float dg_to_f(dg_f16 x) {
    return __half2float(x);
}
template <typename T> static __device__ __forceinline__ T dg_from_f(float x);
template <> __device__ __forceinline__ float dg_from_f<float>(float x) {
    return x;
}
template <> __device__ __forceinline__ dg_bf16 dg_from_f<dg_bf16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ dg_f16 dg_from_f<dg_f16>(float x) {
    return __float2half_rn(x);
}

/* Fixed-order reductions: the same butterfly every call, so results are bitwise reproducible. */
static __device__ __forceinline__ float dg_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
static __device__ __forceinline__ float dg_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
/* Sum over a block of blockDim.x (a multiple of 32, at most 1024) threads; every thread gets the total.
 * `sh` holds at least 32 floats. */
static __device__ __forceinline__ float dg_block_sum(float v, float *sh) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = dg_warp_sum(v);
    __syncthreads(); /* sh may still be read by a previous call */
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    float t = lane < nw ? sh[lane] : 0.f;
    return dg_warp_sum(t);
}

/* Dispatch a templated launcher on the activation dtype. */
#define DG_CUDA_DISPATCH_ACT(act, FN, ...)                                                                   \
    ((act) == DG_F32    ? FN<float>(__VA_ARGS__)                                                             \
     : (act) == DG_BF16 ? FN<dg_bf16>(__VA_ARGS__)                                                           \
                        : FN<dg_f16>(__VA_ARGS__))

static inline unsigned dg_cuda_blocks(size_t work, unsigned per_block, unsigned max_blocks) {
    size_t b = (work + per_block - 1) / per_block;
    if (b < 1) b = 1;
    return b > max_blocks ? max_blocks : (unsigned)b;
}
#endif

static inline int dg_ptr_aligned(const void *p, size_t a) {
    return ((uintptr_t)p % a) == 0;
}

#endif /* DG_CUDA_IMPL_CUH */
