/* backend_cpu.c — the CPU compute backend: construction, memory (aligned host allocations), the
 * element-wise and optimizer kernels, and the vtable. The model kernels live in cpu_gemm.c,
 * cpu_attention.c and cpu_kernels.c. This backend is the fp32 reference the others are tested against.
 *
 * Determinism: every kernel gives the same bits for the same inputs whatever the thread count. Element-
 * wise kernels compute each element in one task with the same code; reductions (sumsq) sum fixed
 * chunks and then the chunk partials in chunk order. See README.md for the full statement.
 */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <malloc.h>
#include <stdlib.h>
#include <string.h>

#include "backend_cpu_impl.h"

#define DG_CPU_ALIGN 256

/* sumsq partial-sum chunk; a constant so the summation order never depends on the thread count. */
#define DG_CPU_SUMSQ_CHUNK 32768

static size_t round_up(size_t n, size_t a) {
    return (n + a - 1) / a * a;
}

void dg_cpu_blas_single_thread(void) {
    if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
}

dg_status_t dg_cpu_nonnulls(const char *op, const char *names, const void *const *ptrs, int n) {
    for (int i = 0; i < n; i++) {
        const size_t len = strcspn(names, ",");
        if (!ptrs[i])
            return DG_ERR(DG_ERR_USAGE, "cpu backend: %s: argument `%.*s` is NULL", op, (int)len, names);
        names += len + (names[len] == ',');
        names += strspn(names, " ");
    }
    return DG_OK;
}

/* Memory accounting of alloc and the scratch (the vtable's mem_usage). */
static void mem_add(dg_cpu_t *cpu, size_t bytes) {
    size_t now = __atomic_add_fetch(&cpu->mem_now, bytes, __ATOMIC_RELAXED);
    size_t pk = __atomic_load_n(&cpu->mem_win_peak, __ATOMIC_RELAXED);
    while (now > pk && !__atomic_compare_exchange_n(&cpu->mem_win_peak, &pk, now, 1, __ATOMIC_RELAXED,
                                                    __ATOMIC_RELAXED)) {
    }
}

static void mem_sub(dg_cpu_t *cpu, size_t bytes) {
    __atomic_sub_fetch(&cpu->mem_now, bytes, __ATOMIC_RELAXED);
}

static void cpu_mem_usage(dg_backend_t *be, size_t *now, size_t *peak, int reset) {
    dg_cpu_t *cpu = dg_cpu_of(be);
    size_t n = __atomic_load_n(&cpu->mem_now, __ATOMIC_RELAXED);
    if (now) *now = n;
    if (peak) *peak = __atomic_load_n(&cpu->mem_win_peak, __ATOMIC_RELAXED);
    if (reset) __atomic_store_n(&cpu->mem_win_peak, n, __ATOMIC_RELAXED);
}

void *dg_cpu_scratch(dg_cpu_t *cpu, size_t bytes) {
    if (bytes <= cpu->scratch_bytes) return cpu->scratch;
    size_t cap = round_up(bytes + bytes / 4, DG_CPU_ALIGN); /* headroom so slowly growing asks don't churn */
    void *p = aligned_alloc(DG_CPU_ALIGN, cap);
    if (!p) {
        DG_ERR(DG_ERR_RUNTIME,
               "cpu backend: cannot allocate %zu bytes of scratch memory; hint: lower "
               "train.micro_batch or model.seq_len",
               cap);
        return NULL;
    }
    free(cpu->scratch);
    mem_sub(cpu, cpu->scratch_bytes);
    mem_add(cpu, cap);
    cpu->scratch = p;
    cpu->scratch_bytes = cap;
    return p;
}

/* ---------------- lifetime and memory ---------------- */

static void cpu_destroy(dg_backend_t *be) {
    if (!be) return;
    dg_cpu_t *cpu = dg_cpu_of(be);
    if (cpu) {
        dg_cpu_pool_free(cpu->pool);
        free(cpu->scratch);
    }
    free(cpu);
    free(be);
}

/* An aligned block of at least `bytes` (0 bytes still gets a real, freeable block so callers need no
 * special case). */
static dg_status_t block_alloc(size_t bytes, void **out) {
    DG_CPU_NONNULL("alloc", out);
    *out = NULL;
    if (bytes > SIZE_MAX - DG_CPU_ALIGN)
        return DG_ERR(DG_ERR_RUNTIME, "cpu backend: allocation of %zu bytes is too large", bytes);
    void *p = aligned_alloc(DG_CPU_ALIGN, round_up(bytes ? bytes : 1, DG_CPU_ALIGN));
    if (!p)
        return DG_ERR(DG_ERR_RUNTIME,
                      "cpu backend: out of host memory allocating %zu bytes; hint: lower "
                      "train.micro_batch or use more ranks",
                      bytes);
    *out = p;
    return DG_OK;
}

static dg_status_t cpu_alloc(dg_backend_t *be, size_t bytes, void **out) {
    DG_TRY(block_alloc(bytes, out));
    mem_add(dg_cpu_of(be), malloc_usable_size(*out));
    return DG_OK;
}

static void cpu_free(dg_backend_t *be, void *p) {
    if (p) mem_sub(dg_cpu_of(be), malloc_usable_size(p));
    free(p);
}

static dg_status_t cpu_memcpy(const char *op, void *dst, const void *src, size_t bytes) {
    if (bytes == 0) return DG_OK;
    DG_CPU_NONNULLS(op, dst, src);
    memmove(dst, src, bytes);
    return DG_OK;
}
/* Host and "device" memory are one here: every copy op, synchronous or asynchronous, is a memmove done
 * when its call returns (so upload_async and download_async need no fence to wait for). */
#define CPU_COPY_OP(name)                                                                                    \
    static dg_status_t cpu_##name(dg_backend_t *be, void *dst, const void *src, size_t bytes) {              \
        (void)be;                                                                                            \
        return cpu_memcpy(#name, dst, src, bytes);                                                           \
    }
CPU_COPY_OP(to_device)
CPU_COPY_OP(to_host)
CPU_COPY_OP(copy)
CPU_COPY_OP(upload_async)
CPU_COPY_OP(download_async)
static dg_status_t cpu_memset0(dg_backend_t *be, void *p, size_t bytes) {
    (void)be;
    if (bytes == 0) return DG_OK;
    DG_CPU_NONNULL("memset0", p);
    memset(p, 0, bytes);
    return DG_OK;
}
static dg_status_t cpu_sync(dg_backend_t *be) {
    (void)be; /* every kernel has finished when it returns */
    return DG_OK;
}

/* ---------------- element-wise ---------------- */

static int is_float_dtype(dg_dtype_t t) {
    return t == DG_F32 || t == DG_BF16 || t == DG_F16;
}

/* Each element passes through f32, which holds every bf16 and f16 value exactly, so there is one
 * rounding whatever the pair. */
typedef struct {
    void *dst;
    const void *src;
    dg_dtype_t dst_t, src_t;
} cast_arg_t;

static void cast_task(const void *argp, size_t lo, size_t hi) {
    const cast_arg_t *a = argp;
    for (size_t i = lo; i < hi; i++) {
        float v;
        switch (a->src_t) {
        case DG_F32:
            v = ((const float *)a->src)[i];
            break;
        case DG_BF16:
            v = dg_cpu_bf16_to_f32(((const uint16_t *)a->src)[i]);
            break;
        default:
            v = dg_cpu_f16_to_f32(((const uint16_t *)a->src)[i]);
            break;
        }
        switch (a->dst_t) {
        case DG_F32:
            ((float *)a->dst)[i] = v;
            break;
        case DG_BF16:
            ((uint16_t *)a->dst)[i] = dg_cpu_f32_to_bf16(v);
            break;
        default:
            ((uint16_t *)a->dst)[i] = dg_cpu_f32_to_f16(v);
            break;
        }
    }
}

static dg_status_t cpu_cast(dg_backend_t *be, void *dst, dg_dtype_t dst_t, const void *src, dg_dtype_t src_t,
                            size_t n) {
    if (!is_float_dtype(dst_t) || !is_float_dtype(src_t))
        return DG_ERR(DG_ERR_USAGE, "cpu backend: cast supports f32, bf16 and f16; got %s -> %s",
                      dg_dtype_name(src_t), dg_dtype_name(dst_t));
    if (n == 0) return DG_OK;
    DG_CPU_NONNULLS("cast", dst, src);
    if (dst_t == src_t) {
        memmove(dst, src, n * dg_dtype_size(dst_t));
        return DG_OK;
    }
    cast_arg_t a = {dst, src, dst_t, src_t};
    dg_cpu_run_range(dg_cpu_of(be), n, dg_cpu_ew_tasks(dg_cpu_of(be), n), cast_task, &a);
    return DG_OK;
}

/* The element-wise kernels that have no function of their own: one task body, switched on `kind`. */
enum { EW_ADD, EW_ACC, EW_SCALE };
typedef struct {
    int kind;
    float *out;
    const float *a, *b;
    float s;
} ew_arg_t;

DG_CPU_VEC static void ew_range(int kind, float *o, const float *x, const float *y, float s, size_t n) {
    switch (kind) {
    case EW_ADD:
#pragma omp simd
        for (size_t i = 0; i < n; i++)
            o[i] = x[i] + y[i];
        break;
    case EW_ACC:
#pragma omp simd
        for (size_t i = 0; i < n; i++)
            o[i] += x[i];
        break;
    default:
#pragma omp simd
        for (size_t i = 0; i < n; i++)
            o[i] *= s;
        break;
    }
}

static void ew_task(const void *argp, size_t lo, size_t hi) {
    const ew_arg_t *a = argp;
    ew_range(a->kind, a->out + lo, a->a ? a->a + lo : NULL, a->b ? a->b + lo : NULL, a->s, hi - lo);
}

static void ew_run(dg_backend_t *be, int kind, float *out, const float *x, const float *y, float s,
                   size_t n) {
    ew_arg_t a = {kind, out, x, y, s};
    dg_cpu_run_range(dg_cpu_of(be), n, dg_cpu_ew_tasks(dg_cpu_of(be), n), ew_task, &a);
}

static dg_status_t cpu_add(dg_backend_t *be, void *out, const void *a, const void *b, size_t n) {
    if (n == 0) return DG_OK;
    DG_CPU_NONNULLS("add", out, a, b);
    ew_run(be, EW_ADD, out, a, b, 0.0f, n);
    return DG_OK;
}

static dg_status_t cpu_accumulate(dg_backend_t *be, void *dst, const void *src, size_t n, int acc) {
    if (n == 0) return DG_OK;
    DG_CPU_NONNULLS("accumulate", dst, src);
    if (!acc) return cpu_memcpy("accumulate", dst, src, n * sizeof(float));
    ew_run(be, EW_ACC, dst, src, NULL, 0.0f, n);
    return DG_OK;
}

static dg_status_t cpu_add_f32(dg_backend_t *be, float *dst, const float *src, size_t n) {
    if (n == 0) return DG_OK;
    DG_CPU_NONNULLS("add_f32", dst, src);
    ew_run(be, EW_ACC, dst, src, NULL, 0.0f, n);
    return DG_OK;
}

/* Double partials: a gradient norm summed over 10^9 floats must not lose the small ones. */
typedef struct {
    double *part;
    const float *x;
    size_t n;
} sumsq_arg_t;

static double sumsq_range(const float *x, size_t n) {
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (size_t i = 0; i < n; i++)
        s += (double)x[i] * (double)x[i];
    return s;
}

static void sumsq_task(void *argp, int c, int worker) {
    (void)worker;
    const sumsq_arg_t *a = argp;
    size_t lo = (size_t)c * DG_CPU_SUMSQ_CHUNK,
           hi = lo + DG_CPU_SUMSQ_CHUNK < a->n ? lo + DG_CPU_SUMSQ_CHUNK : a->n;
    a->part[c] = sumsq_range(a->x + lo, hi - lo);
}

static dg_status_t cpu_sumsq_f32(dg_backend_t *be, float *out_dev, const float *x, size_t n) {
    DG_CPU_NONNULL("sumsq_f32", out_dev);
    if (n == 0) return DG_OK;
    DG_CPU_NONNULL("sumsq_f32", x);
    dg_cpu_t *cpu = dg_cpu_of(be);
    size_t nchunks = (n + DG_CPU_SUMSQ_CHUNK - 1) / DG_CPU_SUMSQ_CHUNK;
    double *part = dg_cpu_scratch(cpu, nchunks * sizeof(double));
    if (!part) return dg_last_error_code();
    sumsq_arg_t a = {part, x, n};
    dg_cpu_run(cpu, (int)nchunks, sumsq_task, &a);
    double total = 0.0;
    for (size_t c = 0; c < nchunks; c++)
        total += part[c];
    *out_dev = (float)((double)*out_dev + total);
    return DG_OK;
}

/* sumsq_f32 over a segment table (v1.7): each segment goes through cpu_sumsq_f32 itself, in table order,
 * so the chunk partials, their sum and the addition into *out_dev are those of one call per tensor. The
 * host table gives the geometry and the device table (host memory here too) the flags, as on CUDA; they
 * must agree on off and count, which only this backend can afford to check. */
static dg_status_t cpu_sumsq_multi(dg_backend_t *be, float *out_dev, const float *base, size_t span,
                                   const dg_sumsq_seg_t *segs, const dg_sumsq_seg_t *segs_dev, int nseg) {
    if (nseg < 0) return DG_ERR(DG_ERR_USAGE, "cpu backend: sumsq_multi: nseg = %d < 0", nseg);
    if (nseg == 0) return DG_OK;
    DG_CPU_NONNULLS("sumsq_multi", out_dev, base, segs, segs_dev);
    for (int i = 0; i < nseg; i++) {
        const dg_sumsq_seg_t *s = &segs[i], *d = &segs_dev[i];
        if (s->count == 0 || s->off > span || s->count > span - s->off)
            return DG_ERR(DG_ERR_USAGE,
                          "cpu backend: sumsq_multi: segment %d (off %llu, count %u) breaks the table rules; "
                          "hint: count >= 1, inside the %zu-element buffer",
                          i, (unsigned long long)s->off, (unsigned)s->count, span);
        if (d->off != s->off || d->count != s->count)
            return DG_ERR(
                DG_ERR_USAGE,
                "cpu backend: sumsq_multi: segment %d is (off %llu, count %u) in the host table but "
                "(off %llu, count %u) in the device table; hint: upload the host table into the "
                "device one before the call",
                i, (unsigned long long)s->off, (unsigned)s->count, (unsigned long long)d->off,
                (unsigned)d->count);
    }
    for (int i = 0; i < nseg; i++) {
        if (segs_dev[i].flags & DG_SUMSQ_SEG_SKIP) continue;
        DG_TRY(cpu_sumsq_f32(be, out_dev, base + segs[i].off, segs[i].count));
    }
    return DG_OK;
}

static dg_status_t cpu_scale_f32(dg_backend_t *be, float *x, size_t n, float s) {
    if (n == 0) return DG_OK;
    DG_CPU_NONNULL("scale_f32", x);
    ew_run(be, EW_SCALE, x, NULL, NULL, s, n);
    return DG_OK;
}

/* ---------------- optimizer ---------------- */

DG_CPU_VEC static void adamw_range(float *master, float *cw, const float *grad, float *m, float *v, size_t n,
                                   float lr, float b1, float b2, float eps, float wd, float inv_bc1,
                                   float inv_bc2, float gs) {
    const float ob1 = 1.0f - b1, ob2 = 1.0f - b2;
    /* Two copies of the loop so the optional compute-copy store does not stop vectorisation. */
#define DG_CPU_ADAMW_BODY                                                                                    \
    float g = grad[i] * gs;                                                                                  \
    float mi = b1 * m[i] + ob1 * g;                                                                          \
    float vi = b2 * v[i] + ob2 * (g * g);                                                                    \
    m[i] = mi;                                                                                               \
    v[i] = vi;                                                                                               \
    float p = master[i];                                                                                     \
    p -= lr * ((mi * inv_bc1) / (sqrtf(vi * inv_bc2) + eps) + wd * p);                                       \
    master[i] = p;
    if (cw) {
#pragma omp simd
        for (size_t i = 0; i < n; i++) {
            DG_CPU_ADAMW_BODY
            cw[i] = p;
        }
    } else {
#pragma omp simd
        for (size_t i = 0; i < n; i++) {
            DG_CPU_ADAMW_BODY
        }
    }
#undef DG_CPU_ADAMW_BODY
}

typedef struct {
    float *master, *cw;
    const float *grad;
    float *m, *v;
    float lr, b1, b2, eps, wd, inv_bc1, inv_bc2, gs;
} adamw_arg_t;

static void adamw_task(const void *argp, size_t lo, size_t hi) {
    const adamw_arg_t *a = argp;
    adamw_range(a->master + lo, a->cw ? a->cw + lo : NULL, a->grad + lo, a->m + lo, a->v + lo, hi - lo, a->lr,
                a->b1, a->b2, a->eps, a->wd, a->inv_bc1, a->inv_bc2, a->gs);
}

static dg_status_t cpu_adamw(dg_backend_t *be, float *master, void *compute, const float *grad, float *m,
                             float *v, size_t n, float lr, float beta1, float beta2, float eps, float wd,
                             int64_t t, const float *gscale_dev) {
    if (n == 0) return DG_OK;
    DG_CPU_NONNULLS("adamw", master, grad, m, v, gscale_dev);
    if (t < 1) return DG_ERR(DG_ERR_USAGE, "cpu backend: adamw: step t must be >= 1, got %lld", (long long)t);
    if (!(beta1 >= 0.0f && beta1 < 1.0f) || !(beta2 >= 0.0f && beta2 < 1.0f))
        return DG_ERR(DG_ERR_USAGE, "cpu backend: adamw: betas must be in [0, 1), got %g and %g", beta1,
                      beta2);
    /* Bias corrections once per call in double: pow(beta, t) for large t underflows gracefully to 0. */
    const float inv_bc1 = (float)(1.0 / (1.0 - pow((double)beta1, (double)t)));
    const float inv_bc2 = (float)(1.0 / (1.0 - pow((double)beta2, (double)t)));
    const float gs = *gscale_dev;
    adamw_arg_t a = {master, compute, grad, m, v, lr, beta1, beta2, eps, wd, inv_bc1, inv_bc2, gs};
    dg_cpu_run_range(dg_cpu_of(be), n, dg_cpu_ew_tasks(dg_cpu_of(be), n), adamw_task, &a);
    return DG_OK;
}

/* adamw with lr and bias corrections from the scalar block: the same loop with the same float values */
static dg_status_t cpu_adamw_dev(dg_backend_t *be, float *master, void *compute, const float *grad, float *m,
                                 float *v, size_t n, float beta1, float beta2, float eps, float wd,
                                 const float *sc) {
    if (n == 0) return DG_OK;
    DG_CPU_NONNULLS("adamw_dev", master, grad, m, v, sc);
    if (!(beta1 >= 0.0f && beta1 < 1.0f) || !(beta2 >= 0.0f && beta2 < 1.0f))
        return DG_ERR(DG_ERR_USAGE, "cpu backend: adamw_dev: betas must be in [0, 1), got %g and %g", beta1,
                      beta2);
    if (!isfinite(sc[DG_DS_NORM])) return DG_OK; /* skipped step: non-finite gradients */
    adamw_arg_t a = {master,
                     compute,
                     grad,
                     m,
                     v,
                     sc[DG_DS_LR],
                     beta1,
                     beta2,
                     eps,
                     wd,
                     sc[DG_DS_INV_BC1],
                     sc[DG_DS_INV_BC2],
                     sc[DG_DS_GSCALE]};
    dg_cpu_run_range(dg_cpu_of(be), n, dg_cpu_ew_tasks(dg_cpu_of(be), n), adamw_task, &a);
    return DG_OK;
}

/* adamw_dev over a segment table (v1.6): each segment goes through exactly what cpu_adamw_dev does for a
 * tensor of its size (same task split, same loop), so the bits are those of one adamw_dev per tensor */
static dg_status_t cpu_adamw_multi_dev(dg_backend_t *be, const dg_adamw_seg_t *segs, int nseg, size_t span,
                                       float *master, void *compute, const float *grad, float *m, float *v,
                                       float beta1, float beta2, float eps, float wd, const float *sc) {
    if (nseg == 0) return DG_OK;
    if (nseg < 0) return DG_ERR(DG_ERR_USAGE, "cpu backend: adamw_multi_dev: nseg = %d < 0", nseg);
    DG_CPU_NONNULLS("adamw_multi_dev", segs, master, grad, m, v, sc);
    if (!(beta1 >= 0.0f && beta1 < 1.0f) || !(beta2 >= 0.0f && beta2 < 1.0f))
        return DG_ERR(DG_ERR_USAGE, "cpu backend: adamw_multi_dev: betas must be in [0, 1), got %g and %g",
                      beta1, beta2);
    uint64_t end = 0;
    for (int i = 0; i < nseg; i++) { /* the contract, checked where the table is readable */
        const dg_adamw_seg_t *s = &segs[i];
        if (s->count == 0 || s->off % 4 != 0 || s->off < end || s->off + s->count > span)
            return DG_ERR(DG_ERR_USAGE,
                          "cpu backend: adamw_multi_dev: segment %d (off %llu, count %u) breaks the table "
                          "rules; hint: segments sorted by offset, not overlapping, offsets a multiple of 4, "
                          "count >= 1, inside the %zu-element buffers",
                          i, (unsigned long long)s->off, (unsigned)s->count, span);
        end = s->off + s->count;
    }
    if (!isfinite(sc[DG_DS_NORM])) return DG_OK; /* skipped step: non-finite gradients */
    for (int i = 0; i < nseg; i++) {
        const dg_adamw_seg_t *s = &segs[i];
        if (s->flags & DG_ADAMW_SEG_SKIP) continue;
        size_t o = (size_t)s->off, n = s->count;
        DG_TRY(cpu_adamw_dev(be, master + o, compute ? (float *)compute + o : NULL, grad + o, m + o, v + o, n,
                             beta1, beta2, eps, (s->flags & DG_ADAMW_SEG_DECAY) ? wd : 0.0f, sc));
    }
    return DG_OK;
}

/* host memory: not the backend's "device" memory, so not in mem_usage */
static dg_status_t cpu_host_alloc(dg_backend_t *be, size_t bytes, void **out) {
    (void)be;
    return block_alloc(bytes, out);
}
static void cpu_host_free(dg_backend_t *be, void *p) {
    (void)be;
    free(p);
}
/* v1.8: every op has run when its call returns, so a fence has nothing to wait for; it is a real (tiny)
 * allocation so that callers see a non-NULL handle as on any backend */
static dg_status_t cpu_fence_create(dg_backend_t *be, void **fence) {
    (void)be;
    DG_CPU_NONNULL("fence_create", fence);
    *fence = calloc(1, 1);
    if (!*fence) return DG_ERR(DG_ERR_RUNTIME, "cpu backend: out of host memory creating a fence");
    return DG_OK;
}
static void cpu_fence_destroy(dg_backend_t *be, void *fence) {
    (void)be;
    free(fence);
}
static dg_status_t cpu_fence_record(dg_backend_t *be, void *fence) {
    (void)be;
    DG_CPU_NONNULL("fence_record", fence);
    return DG_OK;
}
static dg_status_t cpu_fence_wait(dg_backend_t *be, void *fence) {
    (void)be;
    DG_CPU_NONNULL("fence_wait", fence);
    return DG_OK;
}

static dg_status_t cpu_clip_scale(dg_backend_t *be, float *gscale_dev, float *norm_dev,
                                  const float *sumsq_dev, float clip, float extra) {
    (void)be;
    DG_CPU_NONNULLS("clip_scale", gscale_dev, norm_dev, sumsq_dev);
    double norm = sqrt((double)*sumsq_dev);
    double s = 1.0;
    /* Written so a NaN norm gives a NaN scale (the divergence stays visible) instead of min() hiding it. */
    if (clip > 0.0f) {
        double c = (double)clip / (norm + 1e-6);
        s = c >= 1.0 ? 1.0 : c;
    }
    *norm_dev = (float)norm;
    *gscale_dev = (float)(s * (double)extra);
    return DG_OK;
}

/* ---------------- vtable and constructor ---------------- */

static const dg_backend_ops_t cpu_ops = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .to_device = cpu_to_device,
    .to_host = cpu_to_host,
    .copy = cpu_copy,
    .memset0 = cpu_memset0,
    .sync = cpu_sync,
    .cast = cpu_cast,
    .add = cpu_add,
    .accumulate = cpu_accumulate,
    .sumsq_f32 = cpu_sumsq_f32,
    .scale_f32 = cpu_scale_f32,
    .encoder_fwd = dg_cpu_encoder_fwd,
    .encoder_bwd = dg_cpu_encoder_bwd,
    .layernorm_fwd = dg_cpu_layernorm_fwd,
    .layernorm_bwd = dg_cpu_layernorm_bwd,
    .matmul_fwd = dg_cpu_matmul_fwd,
    .matmul_bwd = dg_cpu_matmul_bwd,
    .gelu_fwd = dg_cpu_gelu_fwd,
    .gelu_bwd = dg_cpu_gelu_bwd,
    .matmul_bwd_dgelu = dg_cpu_matmul_bwd_dgelu,
    .attention_aux_bytes = dg_cpu_attention_aux_bytes,
    .attention_fwd = dg_cpu_attention_fwd,
    .attention_bwd = dg_cpu_attention_bwd,
    .crossentropy_fwd = dg_cpu_crossentropy_fwd,
    .crossentropy_bwd = dg_cpu_crossentropy_bwd,
    .adamw = cpu_adamw,
    .clip_scale = cpu_clip_scale,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_host_free,
    .mem_usage = cpu_mem_usage,
    .upload_async = cpu_upload_async,
    .adamw_dev = cpu_adamw_dev,
    /* graph_*: NULL, the CPU backend cannot record */
    .add_f32 = cpu_add_f32,
    .adamw_multi_dev = cpu_adamw_multi_dev,
    .sumsq_multi = cpu_sumsq_multi,
    .download_async = cpu_download_async,
    .fence_create = cpu_fence_create,
    .fence_destroy = cpu_fence_destroy,
    .fence_record = cpu_fence_record,
    .fence_wait = cpu_fence_wait,
    .crossentropy_fused = dg_cpu_crossentropy_fused,
    .matmul_fwd_res = dg_cpu_matmul_fwd_res,
    .attention_kv_fwd = dg_cpu_attention_kv_fwd,
};

dg_status_t dg_backend_cpu_create(const dg_backend_config_t *cfg, dg_backend_t **out) {
    DG_CPU_NONNULL("create", out);
    *out = NULL;
    DG_CPU_NONNULL("create", cfg);
    if (cfg->act_dtype != DG_F32)
        return DG_ERR(DG_ERR_USAGE,
                      "cpu backend computes in fp32 only, but activation dtype %s was asked for; "
                      "hint: set train.precision=fp32 or parallel.backend=cuda",
                      dg_dtype_name(cfg->act_dtype));
    if (cfg->threads < 0)
        return DG_ERR(DG_ERR_USAGE, "cpu backend: threads must be >= 0 (0 = OpenMP default), got %d",
                      cfg->threads);
    dg_backend_t *be = calloc(1, sizeof *be);
    dg_cpu_t *cpu = calloc(1, sizeof *cpu);
    if (!be || !cpu) {
        free(be);
        free(cpu);
        return DG_ERR(DG_ERR_RUNTIME, "cpu backend: out of host memory creating the backend");
    }
    /* Read OpenMP's default before touching OpenBLAS: an OpenMP-flavoured OpenBLAS implements
     * openblas_set_num_threads with omp_set_num_threads. */
    cpu->nt = cfg->threads > 0 ? cfg->threads : omp_get_max_threads();
    if (cpu->nt < 1) cpu->nt = 1;
    /* One threading model: the backend's pool owns the cores, OpenBLAS runs single-threaded inside its
     * tasks. Two pools (OpenBLAS pthreads spinning after each call, our workers between jobs) would
     * fight over the same cores, and OpenBLAS's own split would tie results to the thread count. The
     * setting is process-wide; nothing else in dgtrain calls BLAS during training. */
    dg_cpu_blas_single_thread();
    be->ops = &cpu_ops;
    be->act_dtype = DG_F32;
    be->impl = cpu;
    *out = be;
    return DG_OK;
}
