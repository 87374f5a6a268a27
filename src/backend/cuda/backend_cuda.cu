/* backend_cuda.cu — the CUDA compute backend: device selection, memory, the stream every kernel runs
 * on, error reporting for the CUDA and cuBLAS libraries, argument checks, and the vtable of backend.h.
 * The kernels themselves live in the other *.cu files of this folder (see cuda_impl.cuh).
 *
 * Environment knobs (read once at creation; for tests and debugging, not for users' configs). Each turns
 * off one fast path, so that the tests reach the path behind it (the fallback, or the reference):
 *   DG_CUDA_FUSED_EPILOGUES=0  GEMMs without cuBLASLt epilogues (bias/GELU as own kernels)
 *   DG_CUDA_FUSED_DGELU=0      matmul_bwd_dgelu as GEMM + gelu_bwd even where the DGELU epilogue applies
 *   DG_CUDA_LN_REG=0           layernorm forward/backward through the generic kernels only, not the
 *                              register kernels (layernorm.cu); same tolerances
 *   DG_CUDA_GEMM_TUNE=0        cuBLASLt's first pick, no timing of candidates (matmul.cu)
 *   DG_CUDA_ATTN_CUDNN=0       bf16/f16 attention through the built-in tensor-core kernels, never cuDNN
 *                              (default 1: cuDNN's deterministic fused engines where it loads and plans the
 *                              shape; attn_cudnn.cu)
 *   DG_CUDA_FAST_ATTENTION=0   attention through the generic kernels only (neither cuDNN nor tensor cores:
 *                              the reference the tests check the other two against; attention.cu)
 * Which implementation runs where, and the measurements that chose it: docs/cuda.md.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_impl.cuh"
#include "dg_env.h"

#define DG_CUDA_LT_WORKSPACE (32u << 20) /* cuBLASLt's recommendation for Hopper */
#define DG_CUDA_SCRATCH_INIT (8u << 20)

/* ---------------- error reporting ---------------- */

static const char *cuda_hint(cudaError_t e) {
    switch (e) {
    case cudaErrorMemoryAllocation:
        return "the GPU is out of memory: lower train.micro_batch or shard more (parallel.mesh)";
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
        return "no usable GPU/driver: check nvidia-smi and CUDA_VISIBLE_DEVICES";
    case cudaErrorInvalidDevice:
        return "the device ordinal is not visible: check CUDA_VISIBLE_DEVICES and the rank-to-GPU binding";
    case cudaErrorNoKernelImageForDevice:
        return "dgtrain was not compiled for this GPU: rebuild with CMAKE_CUDA_ARCHITECTURES set for it";
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
        return "a kernel faulted (the CUDA context is now unusable): rerun under compute-sanitizer";
    case cudaErrorStreamCaptureUnsupported:
    case cudaErrorStreamCaptureInvalidated:
        return "an operation is not allowed during CUDA Graph capture: run eagerly (parallel.cuda_graph=0)";
    default:
        return "rerun with CUDA_LAUNCH_BLOCKING=1 to locate the failing kernel";
    }
}

dg_status_t dg_cuda_fail(cudaError_t e, const char *call, const char *file, int line) {
    return dg_error_at(DG_ERR_RUNTIME, file, line, "CUDA call `%s` failed: %s (%s); hint: %s", call,
                       cudaGetErrorString(e), cudaGetErrorName(e), cuda_hint(e));
}

dg_status_t dg_cublas_fail(cublasStatus_t s, const char *call, const char *file, int line) {
    const char *hint = "check the GEMM shapes and alignment";
    if (s == CUBLAS_STATUS_NOT_SUPPORTED)
        hint = "cuBLASLt has no kernel for this type/layout/epilogue combination";
    if (s == CUBLAS_STATUS_ALLOC_FAILED) hint = "the GPU is out of memory";
    if (s == CUBLAS_STATUS_EXECUTION_FAILED) hint = "a GEMM kernel failed: rerun under compute-sanitizer";
    return dg_error_at(DG_ERR_RUNTIME, file, line, "cuBLASLt call `%s` failed: %s (%s); hint: %s", call,
                       cublasLtGetStatusString(s), cublasLtGetStatusName(s), hint);
}

/* ---------------- memory accounting ---------------- */

void dg_cuda_mem_add(dg_cuda_t *c, size_t bytes) {
    c->mem_now += bytes;
    if (c->mem_now > c->mem_peak) c->mem_peak = c->mem_now;
    if (c->mem_now > c->mem_win_peak) c->mem_win_peak = c->mem_now;
}

static void cu_mem_usage(dg_backend_t *be, size_t *now, size_t *peak, int reset) {
    dg_cuda_t *c = dg_cuda_of(be);
    if (now) *now = c->mem_now;
    if (peak) *peak = c->mem_win_peak;
    if (reset) c->mem_win_peak = c->mem_now;
}

void dg_cuda_mem_sub(dg_cuda_t *c, size_t bytes) {
    c->mem_now = bytes > c->mem_now ? 0 : c->mem_now - bytes;
}

/* The vtable's allocations are few (the model's flat buffers, the arena, a handful of small ones), so a
 * linear table is enough; free() looks the size up to keep the running total exact. */
static void mem_track(dg_cuda_t *c, void *p, size_t bytes) {
    if (c->mem_n == c->mem_cap) {
        int cap = c->mem_cap ? 2 * c->mem_cap : 32;
        void **np = (void **)realloc(c->mem_ptr, (size_t)cap * sizeof *np);
        size_t *ns = (size_t *)realloc(c->mem_size, (size_t)cap * sizeof *ns);
        DG_ASSERT(np != NULL && ns != NULL);
        c->mem_ptr = np;
        c->mem_size = ns;
        c->mem_cap = cap;
    }
    c->mem_ptr[c->mem_n] = p;
    c->mem_size[c->mem_n] = bytes;
    c->mem_n++;
    dg_cuda_mem_add(c, bytes);
}

static void mem_untrack(dg_cuda_t *c, void *p) {
    for (int i = c->mem_n - 1; i >= 0; i--) {
        if (c->mem_ptr[i] != p) continue;
        dg_cuda_mem_sub(c, c->mem_size[i]);
        c->mem_ptr[i] = c->mem_ptr[c->mem_n - 1];
        c->mem_size[i] = c->mem_size[c->mem_n - 1];
        c->mem_n--;
        return;
    }
}

/* ---------------- scratch ---------------- */

/* Grows one of the backend's temporary blocks (*blk of *have bytes) to hold `bytes` (+25 %, whole MiB);
 * `what` names it in the error raised during stream capture, where nothing can be allocated. */
static dg_status_t grow_block(dg_cuda_t *c, void **blk, size_t *have, size_t bytes, const char *what) {
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    DG_CUDA_CHECK(cudaStreamIsCapturing(c->stream, &cap));
    if (cap != cudaStreamCaptureStatusNone)
        return DG_ERR(DG_ERR_RUNTIME,
                      "CUDA backend: an op needs %zu bytes of %s (have %zu) during CUDA Graph capture, where "
                      "memory cannot be allocated; hint: run one eager step before capturing",
                      bytes, what, *have);
    size_t want = bytes + bytes / 4;
    want = (want + (1u << 20) - 1) & ~(size_t)((1u << 20) - 1);
    /* queued kernels may still read the old block: cudaFree waits for them. A recorded graph keeps
     * using the old address, so while graphs exist it stays allocated until the backend is destroyed */
    if (*blk && c->graphs_alive > 0) {
        c->retired = (void **)realloc(c->retired, (size_t)(c->n_retired + 1) * sizeof(void *));
        if (!c->retired) return DG_ERR(DG_ERR_RUNTIME, "cuda backend: out of host memory");
        c->retired[c->n_retired++] = *blk;
    } else if (*blk) {
        DG_CUDA_CHECK(cudaFree(*blk));
        dg_cuda_mem_sub(c, *have); /* a retired block still counts */
    }
    *blk = NULL;
    *have = 0;
    DG_CUDA_CHECK(cudaMalloc(blk, want));
    *have = want;
    dg_cuda_mem_add(c, want);
    return DG_OK;
}

dg_status_t dg_cuda_scratch(dg_cuda_t *c, size_t bytes, void **out) {
    if (bytes > c->scratch_bytes) DG_TRY(grow_block(c, &c->scratch, &c->scratch_bytes, bytes, "scratch"));
    *out = c->scratch;
    return DG_OK;
}

dg_status_t dg_cuda_fp8_scratch(dg_cuda_t *c, size_t bytes, void **out) {
    if (bytes > c->fp8_bytes) DG_TRY(grow_block(c, &c->fp8_buf, &c->fp8_bytes, bytes, "FP8 operand memory"));
    *out = c->fp8_buf;
    return DG_OK;
}

/* ---------------- argument checks ---------------- */

#define REQ(cond, ...)                                                                                       \
    do {                                                                                                     \
        if (!(cond)) return DG_ERR(DG_ERR_USAGE, __VA_ARGS__);                                               \
    } while (0)
#define REQ_PTR(p, op) REQ((p) != NULL, "cuda backend %s: `%s` is NULL", op, #p)
#define REQ_POS(x, op) REQ((x) > 0, "cuda backend %s: %s = %lld, expected > 0", op, #x, (long long)(x))

static int is_float_dtype(dg_dtype_t t) {
    return t == DG_F32 || t == DG_BF16 || t == DG_F16;
}

/* ---------------- lifetime and memory ---------------- */

static void cu_destroy(dg_backend_t *be) {
    if (!be) return;
    dg_cuda_t *c = dg_cuda_of(be);
    if (c) {
        if (c->stream) cudaStreamSynchronize(c->stream);
        dg_cuda_cudnn_free(c);
        dg_cuda_gemm_plans_free(c);
        if (c->lt) cublasLtDestroy(c->lt);
        cudaFree(c->lt_ws);
        cudaFree(c->scratch);
        cudaFree(c->fp8_buf);
        for (int i = 0; i < c->n_retired; i++)
            cudaFree(c->retired[i]);
        free(c->retired);
        cudaFree(c->err_dev);
        if (c->stream) cudaStreamDestroy(c->stream);
        free(c->mem_ptr);
        free(c->mem_size);
        free(c);
    }
    free(be);
}

static dg_status_t cu_alloc(dg_backend_t *be, size_t bytes, void **out) {
    REQ_PTR(out, "alloc");
    *out = NULL;
    if (bytes == 0) return DG_OK;
    cudaError_t e = cudaMalloc(out, bytes);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        size_t fr = 0, tot = 0;
        cudaMemGetInfo(&fr, &tot);
        *out = NULL;
        return DG_ERR(
            DG_ERR_RUNTIME,
            "cuda backend: cudaMalloc of %.1f MiB on device %d failed: %s (%.1f of %.1f MiB free); hint: "
            "lower train.micro_batch or shard more (parallel.mesh)",
            bytes / 1048576.0, dg_cuda_of(be)->device, cudaGetErrorString(e), fr / 1048576.0,
            tot / 1048576.0);
    }
    mem_track(dg_cuda_of(be), *out, bytes);
    return DG_OK;
}

static void cu_free(dg_backend_t *be, void *p) {
    if (!p) return;
    mem_untrack(dg_cuda_of(be), p);
    cudaError_t e = cudaFree(p);
    if (e != cudaSuccess) DG_LOG_WARN("cuda backend: cudaFree failed: %s", cudaGetErrorString(e));
}

/* The one-line error for raised device error flags (nonzero), after queueing their reset. */
static dg_status_t flags_error(dg_cuda_t *c, int flags) {
    DG_CUDA_CHECK(cudaMemsetAsync(c->err_dev, 0, sizeof(int), c->stream));
    if (flags & DG_CUDA_EF_TARGET)
        return DG_ERR(DG_ERR_RUNTIME,
                      "cuda backend: crossentropy saw a target outside [0, V) (those rows got "
                      "loss NaN); hint: the token shards hold ids >= model.vocab_size");
    return DG_ERR(DG_ERR_RUNTIME, "cuda backend: encoder saw a negative token id (those rows were skipped); "
                                  "hint: the token shards are corrupt");
}

/* Reads (and clears) the device error flags; everything queued before is complete when it returns. */
static dg_status_t check_flags(dg_cuda_t *c) {
    int flags = 0;
    DG_CUDA_CHECK(cudaMemcpyAsync(&flags, c->err_dev, sizeof flags, cudaMemcpyDeviceToHost, c->stream));
    DG_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return flags ? flags_error(c, flags) : DG_OK;
}

static dg_status_t cu_sync(dg_backend_t *be) {
    dg_cuda_t *c = dg_cuda_of(be);
    DG_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return check_flags(c);
}

static dg_status_t cu_to_device(dg_backend_t *be, void *dst, const void *src, size_t bytes) {
    if (bytes == 0) return DG_OK;
    REQ_PTR(dst, "to_device");
    REQ_PTR(src, "to_device");
    /* pageable sources are staged before the call returns, so the caller may reuse `src` at once */
    DG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, dg_cuda_of(be)->stream));
    return DG_OK;
}

static dg_status_t cu_to_host(dg_backend_t *be, void *dst, const void *src, size_t bytes) {
    if (bytes == 0) return DG_OK;
    REQ_PTR(dst, "to_host");
    REQ_PTR(src, "to_host");
    dg_cuda_t *c = dg_cuda_of(be);
    DG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    DG_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return check_flags(c);
}

static dg_status_t cu_copy(dg_backend_t *be, void *dst, const void *src, size_t bytes) {
    if (bytes == 0 || dst == src) return DG_OK;
    REQ_PTR(dst, "copy");
    REQ_PTR(src, "copy");
    DG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, dg_cuda_of(be)->stream));
    return DG_OK;
}

static dg_status_t cu_memset0(dg_backend_t *be, void *p, size_t bytes) {
    if (bytes == 0) return DG_OK;
    REQ_PTR(p, "memset0");
    DG_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, dg_cuda_of(be)->stream));
    return DG_OK;
}

/* ---------------- elementwise / utility ---------------- */

static dg_status_t cu_cast(dg_backend_t *be, void *dst, dg_dtype_t dt, const void *src, dg_dtype_t st,
                           size_t n) {
    REQ(is_float_dtype(dt) && is_float_dtype(st),
        "cuda backend cast: %s -> %s is not supported (f32/bf16/f16 only)", dg_dtype_name(st),
        dg_dtype_name(dt));
    if (n == 0) return DG_OK;
    REQ_PTR(dst, "cast");
    REQ_PTR(src, "cast");
    return dg_cuda_cast(dg_cuda_of(be), dst, dt, src, st, n);
}

static dg_status_t cu_add(dg_backend_t *be, void *out, const void *a, const void *b, size_t n) {
    if (n == 0) return DG_OK;
    REQ_PTR(out, "add");
    REQ_PTR(a, "add");
    REQ_PTR(b, "add");
    return dg_cuda_add(dg_cuda_of(be), out, a, b, n);
}

static dg_status_t cu_accumulate(dg_backend_t *be, void *dst, const void *src, size_t n, int acc) {
    if (n == 0) return DG_OK;
    REQ_PTR(dst, "accumulate");
    REQ_PTR(src, "accumulate");
    return dg_cuda_accumulate(dg_cuda_of(be), dst, src, n, acc);
}

static dg_status_t cu_add_f32(dg_backend_t *be, float *dst, const float *src, size_t n) {
    if (n == 0) return DG_OK;
    REQ_PTR(dst, "add_f32");
    REQ_PTR(src, "add_f32");
    return dg_cuda_add_f32(dg_cuda_of(be), dst, src, n);
}

static dg_status_t cu_sumsq(dg_backend_t *be, float *out, const float *x, size_t n) {
    REQ_PTR(out, "sumsq_f32");
    if (n == 0) return DG_OK;
    REQ_PTR(x, "sumsq_f32");
    return dg_cuda_sumsq_f32(dg_cuda_of(be), out, x, n);
}

/* The host table is readable here: its rules are checked (the device table must hold the same entries,
 * which only the CPU backend can afford to compare) */
static dg_status_t cu_sumsq_multi(dg_backend_t *be, float *out, const float *base, size_t span,
                                  const dg_sumsq_seg_t *segs, const dg_sumsq_seg_t *segs_dev, int nseg) {
    REQ(nseg >= 0, "cuda backend sumsq_multi: nseg = %d < 0", nseg);
    if (nseg == 0) return DG_OK;
    REQ_PTR(out, "sumsq_multi");
    REQ_PTR(base, "sumsq_multi");
    REQ_PTR(segs, "sumsq_multi");
    REQ_PTR(segs_dev, "sumsq_multi");
    for (int i = 0; i < nseg; i++)
        REQ(segs[i].count >= 1 && segs[i].off <= span && segs[i].count <= span - segs[i].off,
            "cuda backend sumsq_multi: segment %d (off %llu, count %u) breaks the table rules; hint: count "
            ">= 1, inside the %zu-element buffer",
            i, (unsigned long long)segs[i].off, (unsigned)segs[i].count, span);
    return dg_cuda_sumsq_multi(dg_cuda_of(be), out, base, segs, segs_dev, nseg);
}

static dg_status_t cu_scale(dg_backend_t *be, float *x, size_t n, float s) {
    if (n == 0) return DG_OK;
    REQ_PTR(x, "scale_f32");
    return dg_cuda_scale_f32(dg_cuda_of(be), x, n, s);
}

/* ---------------- model kernels ---------------- */

static dg_status_t cu_encoder_fwd(dg_backend_t *be, void *out, const int32_t *tokens, const void *wte,
                                  const void *wpe, int B, int T, int C) {
    REQ_POS(B, "encoder_fwd");
    REQ_POS(T, "encoder_fwd");
    REQ_POS(C, "encoder_fwd");
    REQ_PTR(out, "encoder_fwd");
    REQ_PTR(tokens, "encoder_fwd");
    REQ_PTR(wte, "encoder_fwd");
    REQ_PTR(wpe, "encoder_fwd");
    return dg_cuda_encoder_fwd(dg_cuda_of(be), out, tokens, wte, wpe, B, T, C);
}

static dg_status_t cu_encoder_bwd(dg_backend_t *be, float *dwte, float *dwpe, const void *dout,
                                  const int32_t *tokens, int B, int T, int C) {
    REQ_POS(B, "encoder_bwd");
    REQ_POS(T, "encoder_bwd");
    REQ_POS(C, "encoder_bwd");
    REQ_PTR(dout, "encoder_bwd");
    REQ_PTR(tokens, "encoder_bwd");
    REQ(dwte || dwpe, "cuda backend encoder_bwd: both dwte and dwpe are NULL");
    return dg_cuda_encoder_bwd(dg_cuda_of(be), dwte, dwpe, dout, tokens, B, T, C);
}

static dg_status_t cu_layernorm_fwd(dg_backend_t *be, void *out, float *mean, float *rstd, const void *inp,
                                    const void *w, const void *b, int N, int C) {
    REQ_POS(N, "layernorm_fwd");
    REQ_POS(C, "layernorm_fwd");
    REQ_PTR(out, "layernorm_fwd");
    REQ_PTR(inp, "layernorm_fwd");
    REQ_PTR(w, "layernorm_fwd");
    REQ_PTR(b, "layernorm_fwd");
    return dg_cuda_layernorm_fwd(dg_cuda_of(be), out, mean, rstd, inp, w, b, N, C);
}

static dg_status_t cu_layernorm_bwd(dg_backend_t *be, void *dinp, float *dw, float *db, const void *dout,
                                    const void *inp, const void *w, const float *mean, const float *rstd,
                                    int N, int C, int acc) {
    REQ_POS(N, "layernorm_bwd");
    REQ_POS(C, "layernorm_bwd");
    REQ_PTR(dout, "layernorm_bwd");
    REQ_PTR(inp, "layernorm_bwd");
    REQ_PTR(w, "layernorm_bwd");
    REQ_PTR(mean, "layernorm_bwd");
    REQ_PTR(rstd, "layernorm_bwd");
    return dg_cuda_layernorm_bwd(dg_cuda_of(be), dinp, dw, db, dout, inp, w, mean, rstd, N, C, acc);
}

static dg_status_t cu_matmul_fwd(dg_backend_t *be, void *out, void *pre, const void *inp, const void *w,
                                 const void *bias, int N, int C, int OC, dg_epilogue_t epi) {
    REQ_POS(N, "matmul_fwd");
    REQ_POS(C, "matmul_fwd");
    REQ_POS(OC, "matmul_fwd");
    REQ_PTR(out, "matmul_fwd");
    REQ_PTR(inp, "matmul_fwd");
    REQ_PTR(w, "matmul_fwd");
    REQ(epi == DG_EPI_NONE || epi == DG_EPI_GELU, "cuda backend matmul_fwd: unknown epilogue %d", (int)epi);
    REQ(epi != DG_EPI_GELU || pre != NULL, "cuda backend matmul_fwd: the GELU epilogue needs `pre`");
    REQ(epi != DG_EPI_GELU || pre != out,
        "cuda backend matmul_fwd: `pre` and `out` must be different buffers");
    return dg_cuda_matmul_fwd(dg_cuda_of(be), out, pre, inp, w, bias, N, C, OC, epi);
}

static dg_status_t cu_matmul_bwd(dg_backend_t *be, void *dinp, float *dw, float *dbias, const void *dout,
                                 const void *inp, const void *w, int N, int C, int OC, int acc) {
    REQ_POS(N, "matmul_bwd");
    REQ_POS(C, "matmul_bwd");
    REQ_POS(OC, "matmul_bwd");
    REQ_PTR(dout, "matmul_bwd");
    REQ(!dinp || w, "cuda backend matmul_bwd: dinp needs w");
    REQ(!dw || inp, "cuda backend matmul_bwd: dw needs inp");
    return dg_cuda_matmul_bwd(dg_cuda_of(be), dinp, dw, dbias, dout, inp, w, N, C, OC, acc);
}

static int ranges_overlap(const void *a, size_t na, const void *b, size_t nb) {
    const char *pa = (const char *)a, *pb = (const char *)b;
    return pa < pb + nb && pb < pa + na;
}

static dg_status_t cu_matmul_fwd_res(dg_backend_t *be, void *out, const void *inp, const void *w,
                                     const void *bias, const void *res, int N, int C, int OC) {
    REQ_POS(N, "matmul_fwd_res");
    REQ_POS(C, "matmul_fwd_res");
    REQ_POS(OC, "matmul_fwd_res");
    REQ_PTR(out, "matmul_fwd_res");
    REQ_PTR(inp, "matmul_fwd_res");
    REQ_PTR(w, "matmul_fwd_res");
    REQ_PTR(res, "matmul_fwd_res");
    const size_t es = dg_dtype_size(be->act_dtype), no = (size_t)N * OC * es;
    REQ(out == res || !ranges_overlap(out, no, res, no),
        "cuda backend matmul_fwd_res: out overlaps res partially (it may only alias it exactly, in place)");
    REQ(!ranges_overlap(out, no, inp, (size_t)N * C * es) &&
            !ranges_overlap(out, no, w, (size_t)OC * C * es) &&
            (!bias || !ranges_overlap(out, no, bias, (size_t)OC * es)),
        "cuda backend matmul_fwd_res: out must not overlap inp, w or bias");
    return dg_cuda_matmul_fwd_res(dg_cuda_of(be), out, inp, w, bias, res, N, C, OC);
}

static dg_status_t cu_matmul_bwd_dgelu(dg_backend_t *be, void *dpre, float *dw, float *dbias,
                                       const void *dout, const void *inp, const void *w, const void *pre,
                                       int N, int C, int OC, int acc) {
    REQ_POS(N, "matmul_bwd_dgelu");
    REQ_POS(C, "matmul_bwd_dgelu");
    REQ_POS(OC, "matmul_bwd_dgelu");
    REQ_PTR(dpre, "matmul_bwd_dgelu");
    REQ_PTR(dw, "matmul_bwd_dgelu");
    REQ_PTR(dout, "matmul_bwd_dgelu");
    REQ_PTR(inp, "matmul_bwd_dgelu");
    REQ_PTR(w, "matmul_bwd_dgelu");
    REQ_PTR(pre, "matmul_bwd_dgelu");
    const size_t es = dg_dtype_size(be->act_dtype), nin = (size_t)N * C * es;
    REQ(!ranges_overlap(dpre, nin, pre, nin) && !ranges_overlap(dpre, nin, dout, (size_t)N * OC * es),
        "cuda backend matmul_bwd_dgelu: dpre must not overlap pre or dout");
    REQ(!acc || !ranges_overlap(dpre, nin, inp, nin),
        "cuda backend matmul_bwd_dgelu: dpre may alias inp only with acc = 0");
    return dg_cuda_matmul_bwd_dgelu(dg_cuda_of(be), dpre, dw, dbias, dout, inp, w, pre, N, C, OC, acc);
}

static dg_status_t cu_gelu_fwd(dg_backend_t *be, void *out, const void *inp, size_t n) {
    if (n == 0) return DG_OK;
    REQ_PTR(out, "gelu_fwd");
    REQ_PTR(inp, "gelu_fwd");
    return dg_cuda_gelu_fwd(dg_cuda_of(be), out, inp, n);
}

static dg_status_t cu_gelu_bwd(dg_backend_t *be, void *dinp, const void *inp, const void *dout, size_t n,
                               int acc) {
    if (n == 0) return DG_OK;
    REQ_PTR(dinp, "gelu_bwd");
    REQ_PTR(inp, "gelu_bwd");
    REQ_PTR(dout, "gelu_bwd");
    return dg_cuda_gelu_bwd(dg_cuda_of(be), dinp, inp, dout, n, acc);
}

static size_t cu_attention_aux_bytes(dg_backend_t *be, int B, int T, int C, int NH) {
    (void)be;
    return dg_cuda_attention_aux_bytes(B, T, C, NH);
}

#define REQ_ATTN(op)                                                                                         \
    do {                                                                                                     \
        REQ_POS(B, op);                                                                                      \
        REQ_POS(T, op);                                                                                      \
        REQ_POS(C, op);                                                                                      \
        REQ_POS(NH, op);                                                                                     \
        REQ(C % NH == 0, "cuda backend %s: C = %d is not a multiple of NH = %d", op, C, NH);                 \
        REQ(C / NH <= 256, "cuda backend %s: head size %d > 256 is not supported", op, C / NH);              \
    } while (0)

static dg_status_t cu_attention_fwd(dg_backend_t *be, void *out, void *aux, const void *qkv, int B, int T,
                                    int C, int NH) {
    REQ_ATTN("attention_fwd");
    REQ_PTR(out, "attention_fwd");
    REQ_PTR(aux, "attention_fwd");
    REQ_PTR(qkv, "attention_fwd");
    return dg_cuda_attention_fwd(dg_cuda_of(be), out, aux, qkv, B, T, C, NH);
}

static dg_status_t cu_attention_kv_fwd(dg_backend_t *be, void *out, void *kcache, void *vcache,
                                       const void *qkv, int p0, int n, int cap, int C, int NH) {
    const int B = 1, T = n;
    REQ_ATTN("attention_kv_fwd");
    REQ_PTR(out, "attention_kv_fwd");
    REQ_PTR(kcache, "attention_kv_fwd");
    REQ_PTR(vcache, "attention_kv_fwd");
    REQ_PTR(qkv, "attention_kv_fwd");
    REQ(p0 >= 0 && p0 + n <= cap,
        "cuda backend attention_kv_fwd: positions [%d, %d) do not fit a cache of %d rows", p0, p0 + n, cap);
    return dg_cuda_attention_kv_fwd(dg_cuda_of(be), out, kcache, vcache, qkv, p0, n, cap, C, NH);
}

static dg_status_t cu_attention_bwd(dg_backend_t *be, void *dqkv, const void *dout, const void *qkv,
                                    const void *out, const void *aux, int B, int T, int C, int NH) {
    REQ_ATTN("attention_bwd");
    REQ_PTR(dqkv, "attention_bwd");
    REQ_PTR(dout, "attention_bwd");
    REQ_PTR(qkv, "attention_bwd");
    REQ_PTR(out, "attention_bwd");
    REQ_PTR(aux, "attention_bwd");
    return dg_cuda_attention_bwd(dg_cuda_of(be), dqkv, dout, qkv, out, aux, B, T, C, NH);
}

static size_t cu_attention_bwd_ws_bytes(dg_backend_t *be, int B, int T, int C, int NH) {
    if (B <= 0 || T <= 0 || C <= 0 || NH <= 0 || C % NH) return 0;
    return dg_cuda_cudnn_attention_ws_bytes(dg_cuda_of(be), B, T, C, NH);
}

static dg_status_t cu_attention_bwd_ws(dg_backend_t *be, void *dqkv, const void *dout, const void *qkv,
                                       const void *out, const void *aux, void *ws, size_t ws_bytes, int B,
                                       int T, int C, int NH) {
    dg_cuda_t *c = dg_cuda_of(be);
    c->attn_ws = ws;
    c->attn_ws_bytes = ws ? ws_bytes : 0;
    dg_status_t s = cu_attention_bwd(be, dqkv, dout, qkv, out, aux, B, T, C, NH);
    c->attn_ws = NULL;
    c->attn_ws_bytes = 0;
    return s;
}

static dg_status_t cu_ce_fwd(dg_backend_t *be, float *losses, float *lse, const void *logits,
                             const int32_t *targets, int N, int V, int Vp) {
    REQ_POS(N, "crossentropy_fwd");
    REQ_POS(V, "crossentropy_fwd");
    REQ(Vp >= V, "cuda backend crossentropy_fwd: Vp = %d < V = %d", Vp, V);
    REQ_PTR(losses, "crossentropy_fwd");
    REQ_PTR(lse, "crossentropy_fwd");
    REQ_PTR(logits, "crossentropy_fwd");
    REQ_PTR(targets, "crossentropy_fwd");
    return dg_cuda_crossentropy_fwd(dg_cuda_of(be), losses, lse, logits, targets, N, V, Vp);
}

static dg_status_t cu_ce_bwd(dg_backend_t *be, void *dlogits, const void *logits, const float *lse,
                             const int32_t *targets, int N, int V, int Vp, float dloss) {
    REQ_POS(N, "crossentropy_bwd");
    REQ_POS(V, "crossentropy_bwd");
    REQ(Vp >= V, "cuda backend crossentropy_bwd: Vp = %d < V = %d", Vp, V);
    REQ_PTR(dlogits, "crossentropy_bwd");
    REQ_PTR(logits, "crossentropy_bwd");
    REQ_PTR(lse, "crossentropy_bwd");
    REQ_PTR(targets, "crossentropy_bwd");
    return dg_cuda_crossentropy_bwd(dg_cuda_of(be), dlogits, logits, lse, targets, N, V, Vp, dloss);
}

static dg_status_t cu_ce_fused(dg_backend_t *be, float *losses, float *lse, void *dlogits, const void *logits,
                               const int32_t *targets, int N, int V, int Vp, float dloss) {
    REQ_POS(N, "crossentropy_fused");
    REQ_POS(V, "crossentropy_fused");
    REQ(Vp >= V, "cuda backend crossentropy_fused: Vp = %d < V = %d", Vp, V);
    REQ_PTR(losses, "crossentropy_fused");
    REQ_PTR(lse, "crossentropy_fused");
    REQ_PTR(dlogits, "crossentropy_fused");
    REQ_PTR(logits, "crossentropy_fused");
    REQ_PTR(targets, "crossentropy_fused");
    return dg_cuda_crossentropy_fused(dg_cuda_of(be), losses, lse, dlogits, logits, targets, N, V, Vp, dloss);
}

static dg_status_t cu_adamw(dg_backend_t *be, float *master, void *compute, const float *grad, float *m,
                            float *v, size_t n, float lr, float beta1, float beta2, float eps, float wd,
                            int64_t t, const float *gscale_dev) {
    if (n == 0) return DG_OK;
    REQ_PTR(master, "adamw");
    REQ_PTR(grad, "adamw");
    REQ_PTR(m, "adamw");
    REQ_PTR(v, "adamw");
    REQ(t >= 1, "cuda backend adamw: step t = %lld, expected >= 1 (1-based)", (long long)t);
    REQ(beta1 >= 0.f && beta1 < 1.f && beta2 >= 0.f && beta2 < 1.f,
        "cuda backend adamw: betas (%g, %g) must lie in [0, 1)", beta1, beta2);
    return dg_cuda_adamw(dg_cuda_of(be), master, compute, grad, m, v, n, lr, beta1, beta2, eps, wd, t,
                         gscale_dev);
}

static dg_status_t cu_clip_scale(dg_backend_t *be, float *gscale, float *norm, const float *sumsq, float clip,
                                 float extra) {
    REQ_PTR(gscale, "clip_scale");
    REQ_PTR(sumsq, "clip_scale");
    return dg_cuda_clip_scale(dg_cuda_of(be), gscale, norm, sumsq, clip, extra);
}

static dg_status_t cu_adamw_dev(dg_backend_t *be, float *master, void *compute, const float *grad, float *m,
                                float *v, size_t n, float beta1, float beta2, float eps, float wd,
                                const float *sc) {
    if (n == 0) return DG_OK;
    REQ_PTR(master, "adamw_dev");
    REQ_PTR(grad, "adamw_dev");
    REQ_PTR(m, "adamw_dev");
    REQ_PTR(v, "adamw_dev");
    REQ_PTR(sc, "adamw_dev");
    REQ(beta1 >= 0.f && beta1 < 1.f && beta2 >= 0.f && beta2 < 1.f,
        "cuda backend adamw_dev: betas (%g, %g) must lie in [0, 1)", beta1, beta2);
    return dg_cuda_adamw_dev(dg_cuda_of(be), master, compute, grad, m, v, n, beta1, beta2, eps, wd, sc);
}

/* the table lives in device memory: its rules (sorted, offsets multiples of 4, inside span) are the
 * caller's to keep; the CPU backend checks them */
static dg_status_t cu_adamw_multi_dev(dg_backend_t *be, const dg_adamw_seg_t *segs, int nseg, size_t span,
                                      float *master, void *compute, const float *grad, float *m, float *v,
                                      float beta1, float beta2, float eps, float wd, const float *sc) {
    REQ(nseg >= 0, "cuda backend adamw_multi_dev: nseg = %d < 0", nseg);
    if (nseg == 0 || span == 0) return DG_OK;
    REQ_PTR(segs, "adamw_multi_dev");
    REQ_PTR(master, "adamw_multi_dev");
    REQ_PTR(grad, "adamw_multi_dev");
    REQ_PTR(m, "adamw_multi_dev");
    REQ_PTR(v, "adamw_multi_dev");
    REQ_PTR(sc, "adamw_multi_dev");
    REQ(beta1 >= 0.f && beta1 < 1.f && beta2 >= 0.f && beta2 < 1.f,
        "cuda backend adamw_multi_dev: betas (%g, %g) must lie in [0, 1)", beta1, beta2);
    return dg_cuda_adamw_multi_dev(dg_cuda_of(be), segs, nseg, span, master, compute, grad, m, v, beta1,
                                   beta2, eps, wd, sc);
}

/* ---------------- page-locked host memory, capturable uploads, graph replay ---------------- */

static dg_status_t cu_host_alloc(dg_backend_t *be, size_t bytes, void **out) {
    (void)be;
    *out = NULL;
    cudaError_t e = cudaHostAlloc(out, bytes ? bytes : 1, cudaHostAllocDefault);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        *out = NULL;
        return DG_ERR(DG_ERR_RUNTIME, "cuda backend: cudaHostAlloc of %zu bytes failed: %s", bytes,
                      cudaGetErrorString(e));
    }
    return DG_OK;
}

static void cu_host_free(dg_backend_t *be, void *p) {
    (void)be;
    if (p) cudaFreeHost(p);
}

static dg_status_t cu_upload_async(dg_backend_t *be, void *dst, const void *src, size_t bytes) {
    if (bytes == 0) return DG_OK;
    REQ_PTR(dst, "upload_async");
    REQ_PTR(src, "upload_async");
    DG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, dg_cuda_of(be)->stream));
    return DG_OK;
}

static dg_status_t cu_graph_begin(dg_backend_t *be) {
    dg_cuda_t *c = dg_cuda_of(be);
    /* thread-local: another thread's CUDA calls (a checkpoint writer, a comm thread) neither end up in
     * the graph nor break the recording */
    DG_CUDA_CHECK(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
    return DG_OK;
}

static dg_status_t cu_graph_end(dg_backend_t *be, void **out) {
    dg_cuda_t *c = dg_cuda_of(be);
    *out = NULL;
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &g);
    if (e != cudaSuccess || !g) {
        (void)cudaGetLastError(); /* capture errors are not sticky: clear them for the eager path */
        if (g) cudaGraphDestroy(g);
        return DG_ERR(DG_ERR_RUNTIME, "cuda backend: CUDA Graph capture failed: %s",
                      e != cudaSuccess ? cudaGetErrorString(e) : "no graph recorded");
    }
    if (dg_env_bool("DG_TEST_CUDA_GRAPH_FAIL")) {
        cudaGraphDestroy(g);
        return DG_ERR(DG_ERR_RUNTIME, "cuda backend: CUDA Graph capture refused by the test hook "
                                      "DG_TEST_CUDA_GRAPH_FAIL");
    }
    cudaGraphExec_t x = NULL;
    e = cudaGraphInstantiate(&x, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess || !x) {
        (void)cudaGetLastError();
        return DG_ERR(DG_ERR_RUNTIME, "cuda backend: cudaGraphInstantiate failed: %s", cudaGetErrorString(e));
    }
    *out = (void *)x;
    c->graphs_alive++;
    return DG_OK;
}

static dg_status_t cu_graph_launch(dg_backend_t *be, void *graph) {
    REQ_PTR(graph, "graph_launch");
    DG_CUDA_CHECK(cudaGraphLaunch((cudaGraphExec_t)graph, dg_cuda_of(be)->stream));
    return DG_OK;
}

static void cu_graph_free(dg_backend_t *be, void *graph) {
    if (!graph) return;
    cudaGraphExecDestroy((cudaGraphExec_t)graph);
    dg_cuda_of(be)->graphs_alive--;
}

/* ---------------- v1.8: asynchronous read-back and fences ---------------- */

/* A fence is an event plus a page-locked copy of the device error flags taken at the same queue
 * position, so fence_wait reports a bad target or token id of the work before it as sync would, without
 * draining the stream. */
typedef struct cu_fence {
    cudaEvent_t ev;
    int *flags_host; /* page-locked; written by the copy queued in fence_record */
} cu_fence_t;

static dg_status_t cu_download_async(dg_backend_t *be, void *dst, const void *src, size_t bytes) {
    if (bytes == 0) return DG_OK;
    REQ_PTR(dst, "download_async");
    REQ_PTR(src, "download_async");
    dg_cuda_t *c = dg_cuda_of(be);
    /* pageable memory would make the copy synchronous (and break a capture): refuse it by name. Checked
     * on eager calls only (the same call runs eagerly before any recording of it), so that a capture
     * makes no call beyond the copy itself */
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    DG_CUDA_CHECK(cudaStreamIsCapturing(c->stream, &cap));
    if (cap == cudaStreamCaptureStatusNone) {
        cudaPointerAttributes a;
        DG_CUDA_CHECK(cudaPointerGetAttributes(&a, dst));
        REQ(a.type == cudaMemoryTypeHost,
            "cuda backend download_async: the destination %p is not page-locked host memory; hint: allocate "
            "it with host_alloc",
            dst);
    }
    DG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream));
    return DG_OK;
}

static void cu_fence_destroy(dg_backend_t *be, void *fence) {
    (void)be;
    cu_fence_t *f = (cu_fence_t *)fence;
    if (!f) return;
    /* the flag copy queued before the event may still be pending: the page-locked word it writes must
     * outlive it (errors were reported by fence_wait or sync; nothing to do with them here) */
    if (f->ev) {
        (void)cudaEventSynchronize(f->ev);
        cudaEventDestroy(f->ev);
    }
    (void)cudaGetLastError();
    if (f->flags_host) cudaFreeHost(f->flags_host);
    free(f);
}

static dg_status_t cu_fence_create(dg_backend_t *be, void **out) {
    (void)be;
    REQ_PTR(out, "fence_create");
    *out = NULL;
    cu_fence_t *f = (cu_fence_t *)dg_xcalloc(1, sizeof *f);
    cudaError_t e = cudaEventCreateWithFlags(&f->ev, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaHostAlloc((void **)&f->flags_host, sizeof(int), cudaHostAllocDefault);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        if (f->ev) cudaEventDestroy(f->ev);
        free(f);
        return DG_ERR(DG_ERR_RUNTIME, "cuda backend: creating a fence failed: %s", cudaGetErrorString(e));
    }
    *f->flags_host = 0;
    *out = f;
    return DG_OK;
}

static dg_status_t cu_fence_record(dg_backend_t *be, void *fence) {
    REQ_PTR(fence, "fence_record");
    dg_cuda_t *c = dg_cuda_of(be);
    cu_fence_t *f = (cu_fence_t *)fence;
    DG_CUDA_CHECK(cudaMemcpyAsync(f->flags_host, c->err_dev, sizeof(int), cudaMemcpyDeviceToHost, c->stream));
    /* during a capture a plain record would only be an internal dependency of the graph; the external
     * flag makes it an event-record node that fires at every replay, which the host can wait on */
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    DG_CUDA_CHECK(cudaStreamIsCapturing(c->stream, &cap));
    if (cap == cudaStreamCaptureStatusActive)
        DG_CUDA_CHECK(cudaEventRecordWithFlags(f->ev, c->stream, cudaEventRecordExternal));
    else
        DG_CUDA_CHECK(cudaEventRecord(f->ev, c->stream));
    return DG_OK;
}

static dg_status_t cu_fence_wait(dg_backend_t *be, void *fence) {
    REQ_PTR(fence, "fence_wait");
    dg_cuda_t *c = dg_cuda_of(be);
    cu_fence_t *f = (cu_fence_t *)fence;
    cudaError_t e = cudaEventSynchronize(f->ev);
    if (e != cudaSuccess)
        return DG_ERR(DG_ERR_RUNTIME,
                      "cuda backend: waiting for a fence (a host read-back such as the step's losses or "
                      "gradient norm): the work queued before it failed: %s (%s); hint: %s",
                      cudaGetErrorString(e), cudaGetErrorName(e), cuda_hint(e));
    int flags = *f->flags_host;
    if (!flags) return DG_OK;
    *f->flags_host = 0; /* reported once; the next record copies the (reset) flags again */
    return flags_error(c, flags);
}

static const dg_backend_ops_t cuda_ops = {
    "cuda",
    cu_destroy,
    cu_alloc,
    cu_free,
    cu_to_device,
    cu_to_host,
    cu_copy,
    cu_memset0,
    cu_sync,
    cu_cast,
    cu_add,
    cu_accumulate,
    cu_sumsq,
    cu_scale,
    cu_encoder_fwd,
    cu_encoder_bwd,
    cu_layernorm_fwd,
    cu_layernorm_bwd,
    cu_matmul_fwd,
    cu_matmul_bwd,
    cu_gelu_fwd,
    cu_gelu_bwd,
    cu_matmul_bwd_dgelu,
    cu_attention_aux_bytes,
    cu_attention_fwd,
    cu_attention_bwd,
    cu_ce_fwd,
    cu_ce_bwd,
    cu_adamw,
    cu_clip_scale,
    cu_host_alloc,
    cu_host_free,
    cu_upload_async,
    cu_adamw_dev,
    cu_graph_begin,
    cu_graph_end,
    cu_graph_launch,
    cu_graph_free,
    cu_add_f32,
    cu_adamw_multi_dev,
    cu_sumsq_multi,
    cu_download_async,
    cu_fence_create,
    cu_fence_destroy,
    cu_fence_record,
    cu_fence_wait,
    cu_attention_bwd_ws_bytes,
    cu_attention_bwd_ws,
    cu_ce_fused,
    cu_matmul_fwd_res,
    cu_attention_kv_fwd,
    cu_mem_usage,
};

/* ---------------- construction ---------------- */

__global__ void dg_cuda_probe_kernel(int *p) {
    if (p) *p = 0;
}

static dg_status_t cuda_init(dg_cuda_t *c, const dg_backend_config_t *cfg) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        return DG_ERR(DG_ERR_RUNTIME,
                      "no CUDA device: %s; hint: run on a GPU node, check nvidia-smi and "
                      "CUDA_VISIBLE_DEVICES, or set parallel.backend=cpu",
                      e != cudaSuccess ? cudaGetErrorString(e) : "the driver reports 0 devices");
    }
    if (cfg->device < 0 || cfg->device >= n)
        return DG_ERR(DG_ERR_RUNTIME,
                      "no CUDA device: ordinal %d requested, %d visible; hint: check "
                      "CUDA_VISIBLE_DEVICES and the rank-to-GPU binding",
                      cfg->device, n);
    c->device = cfg->device;
    DG_CUDA_CHECK(cudaSetDevice(c->device));
    cudaDeviceProp prop;
    DG_CUDA_CHECK(cudaGetDeviceProperties(&prop, c->device));
    snprintf(c->name, sizeof c->name, "%s", prop.name);
    DG_CUDA_CHECK(cudaDeviceGetAttribute(&c->sm_count, cudaDevAttrMultiProcessorCount, c->device));
    DG_CUDA_CHECK(cudaDeviceGetAttribute(&c->cc_major, cudaDevAttrComputeCapabilityMajor, c->device));
    DG_CUDA_CHECK(cudaDeviceGetAttribute(&c->cc_minor, cudaDevAttrComputeCapabilityMinor, c->device));
    int smem = 0;
    DG_CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, c->device));
    c->smem_optin = (size_t)smem;
    if (c->cc_major < 8)
        return DG_ERR(DG_ERR_RUNTIME,
                      "cuda backend: device %d has compute capability %d.%d; dgtrain needs 8.0 or "
                      "newer (bf16 tensor cores)",
                      c->device, c->cc_major, c->cc_minor);
    /* fail here, with a clear message, rather than at the first kernel when no image fits this GPU */
    cudaFuncAttributes fa;
    e = cudaFuncGetAttributes(&fa, dg_cuda_probe_kernel);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return dg_cuda_fail(e, "cudaFuncGetAttributes(probe kernel)", __FILE__, __LINE__);
    }
    DG_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    DG_CUBLAS_CHECK(cublasLtCreate(&c->lt));
    c->lt_ws_bytes = DG_CUDA_LT_WORKSPACE;
    DG_CUDA_CHECK(cudaMalloc(&c->lt_ws, c->lt_ws_bytes));
    dg_cuda_mem_add(c, c->lt_ws_bytes);
    DG_CUDA_CHECK(cudaMalloc(&c->scratch, DG_CUDA_SCRATCH_INIT));
    c->scratch_bytes = DG_CUDA_SCRATCH_INIT;
    dg_cuda_mem_add(c, c->scratch_bytes);
    DG_CUDA_CHECK(cudaMalloc(&c->err_dev, 4 * sizeof(int)));
    dg_cuda_mem_add(c, 4 * sizeof(int));
    DG_CUDA_CHECK(cudaMemset(c->err_dev, 0, 4 * sizeof(int)));
    DG_CUDA_CHECK(cudaDeviceSynchronize());
    c->fused_epilogues = dg_env_bool("DG_CUDA_FUSED_EPILOGUES");
    c->fused_dgelu = dg_env_bool("DG_CUDA_FUSED_DGELU");
    c->ln_reg = dg_env_bool("DG_CUDA_LN_REG");
    c->gemm_tune = dg_env_bool("DG_CUDA_GEMM_TUNE");
    c->fast_attention = dg_env_bool("DG_CUDA_FAST_ATTENTION");
    c->attn_cudnn = dg_env_bool("DG_CUDA_ATTN_CUDNN");
    if (cfg->fp8) {
        if (c->act != DG_BF16)
            return DG_ERR(DG_ERR_USAGE, "cuda backend: FP8 GEMMs need bf16 activations (act is %s)",
                          dg_dtype_name(c->act));
        /* E4M3 tensor cores: Ada (8.9) and Hopper (9.0) and newer */
        if (c->cc_major * 10 + c->cc_minor < 89)
            return DG_ERR(DG_ERR_USAGE,
                          "train.precision=fp8 needs a GPU with FP8 tensor cores (compute capability 8.9 or "
                          "newer: Ada, Hopper, Blackwell); device %d (%s) has %d.%d; hint: use "
                          "train.precision=bf16",
                          c->device, c->name, c->cc_major, c->cc_minor);
        c->fp8 = 1;
    }
    return DG_OK;
}

extern "C" dg_status_t dg_backend_cuda_create(const dg_backend_config_t *cfg, dg_backend_t **out) {
    if (!out) return DG_ERR(DG_ERR_USAGE, "dg_backend_cuda_create: `out` is NULL");
    *out = NULL;
    if (!cfg) return DG_ERR(DG_ERR_USAGE, "dg_backend_cuda_create: `cfg` is NULL");
    if (!is_float_dtype(cfg->act_dtype))
        return DG_ERR(DG_ERR_USAGE, "cuda backend: activation dtype %s is not supported (f32, bf16 or f16)",
                      dg_dtype_name(cfg->act_dtype));
    dg_backend_t *be = (dg_backend_t *)dg_xcalloc(1, sizeof *be);
    dg_cuda_t *c = (dg_cuda_t *)dg_xcalloc(1, sizeof *c);
    be->ops = &cuda_ops;
    be->act_dtype = cfg->act_dtype;
    be->impl = c;
    c->act = cfg->act_dtype;
    dg_status_t s = cuda_init(c, cfg);
    if (s != DG_OK) {
        cu_destroy(be);
        return s;
    }
    be->fp8 = c->fp8;
    DG_LOG_DEBUG("cuda backend: device %d %s (sm_%d%d, %d SMs), act %s, fused epilogues %s (DGELU %s), "
                 "fast attention %s (cuDNN %s), layernorm register kernels %s, GEMM tuning %s",
                 c->device, c->name, c->cc_major, c->cc_minor, c->sm_count, dg_dtype_name(c->act),
                 c->fused_epilogues ? "on" : "off", c->fused_dgelu ? "on" : "off",
                 c->fast_attention ? "on" : "off", c->attn_cudnn ? "on" : "off", c->ln_reg ? "on" : "off",
                 c->gemm_tune ? "on" : "off");
    *out = be;
    return DG_OK;
}

static int is_cuda(const dg_backend_t *be) {
    return be && be->ops && strcmp(be->ops->name, "cuda") == 0;
}

extern "C" void *dg_backend_cuda_stream(dg_backend_t *be) {
    if (!is_cuda(be)) return NULL;
    return (void *)dg_cuda_of(be)->stream;
}

extern "C" long long dg_backend_cuda_cudnn_attention_calls(dg_backend_t *be) {
    if (!is_cuda(be)) return -1;
    return dg_cuda_cudnn_calls(dg_cuda_of(be));
}

extern "C" int dg_backend_cuda_fp8_stats(dg_backend_t *be, long long *ran, long long *refused) {
    if (!is_cuda(be)) return -1;
    if (ran) *ran = dg_cuda_of(be)->fp8_gemms;
    if (refused) *refused = dg_cuda_of(be)->fp8_refused;
    return 0;
}

extern "C" dg_status_t dg_backend_cuda_fp8_quantize(dg_backend_t *be, void *q, void *qt, const void *x,
                                                    int rows, int cols, float *slot) {
    if (!is_cuda(be)) return DG_ERR(DG_ERR_USAGE, "dg_backend_cuda_fp8_quantize: not a CUDA backend");
    return dg_cuda_fp8_quantize(dg_cuda_of(be), (uint8_t *)q, (uint8_t *)qt, x, rows, cols, slot);
}

extern "C" const char *dg_backend_cuda_device_name(dg_backend_t *be) {
    if (!is_cuda(be)) return NULL;
    return dg_cuda_of(be)->name;
}

extern "C" dg_status_t dg_backend_cuda_mem_stats(dg_backend_t *be, dg_cuda_mem_stats_t *out) {
    if (!out) return DG_ERR(DG_ERR_USAGE, "dg_backend_cuda_mem_stats: `out` is NULL");
    memset(out, 0, sizeof *out);
    if (!is_cuda(be)) return DG_ERR(DG_ERR_USAGE, "dg_backend_cuda_mem_stats: not a CUDA backend");
    dg_cuda_t *c = dg_cuda_of(be);
    out->alloc_bytes = c->mem_now;
    out->peak_alloc_bytes = c->mem_peak;
    size_t fr = 0, tot = 0;
    DG_CUDA_CHECK(cudaMemGetInfo(&fr, &tot));
    out->device_used_bytes = tot - fr;
    out->device_total_bytes = tot;
    return DG_OK;
}
