/* tbc_attn.c — test_backend_cuda --mode attn-builtin / attn-cudnn: the tensor-core attention kernels
 * against the generic ones, and cuDNN's fused attention against the built-in kernels. */
#define _GNU_SOURCE
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "backend.h"
#include "dg_env.h"
#include "dg_test_skip.h"
#include "ministep.h"
#include "op_harness.h"
#include "tbc.h"

/* ======================= attention: tensor-core vs generic kernels ======================= */

/* The built-in kernels only (DG_CUDA_ATTN_CUDNN=0): the tensor-core ones (fast = 1) or, with
 * DG_CUDA_FAST_ATTENTION=0, the generic ones (the reference). */
static dg_backend_t *make_cuda_builtin(dg_dtype_t act, int fast, int *skip) {
    setenv("DG_CUDA_ATTN_CUDNN", "0", 1);
    setenv("DG_CUDA_FAST_ATTENTION", fast ? "1" : "0", 1);
    dg_backend_t *be = make_cuda(act, skip);
    unsetenv("DG_CUDA_ATTN_CUDNN");
    unsetenv("DG_CUDA_FAST_ATTENTION");
    return be;
}

/* 16-bit activations to f32 on the host (bf16: the high half; f16: IEEE half, subnormals included). */
static float act16_to_f32(uint16_t v, dg_dtype_t t) {
    if (t == DG_BF16) {
        uint32_t u = (uint32_t)v << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    const int e = (v >> 10) & 0x1f, m = v & 0x3ff;
    float f = e == 0    ? ldexpf((float)m, -24)
              : e == 31 ? (m ? NAN : INFINITY)
                        : ldexpf((float)(m | 0x400), e - 25);
    return (v & 0x8000) ? -f : f;
}
static float *act16_array(const uint16_t *a, size_t n, dg_dtype_t t) {
    float *f = dg_xmalloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++)
        f[i] = act16_to_f32(a[i], t);
    return f;
}

typedef struct {
    uint16_t *out, *dq;
    float *lse;
} attn_res_t;

/* The device buffers of one attention run: the f32 inputs f (uploaded from h), qkv and dout cast from
 * them to act (dout from element dout_off on), out, dqkv and aux (not written). */
typedef struct {
    void *f, *qkv, *dout, *out, *dqkv, *aux;
} attn_bufs_t;
static attn_bufs_t attn_bufs(dg_backend_t *be, dg_dtype_t act, const float *h, size_t dout_off, int B, int T,
                             int C, int NH) {
    const dg_backend_ops_t *op = be->ops;
    const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C;
    attn_bufs_t d = {0};
    MUST(op->alloc(be, nqkv * sizeof(float), &d.f));
    MUST(op->alloc(be, nqkv * 2, &d.qkv));
    MUST(op->alloc(be, nout * 2, &d.dout));
    MUST(op->alloc(be, nout * 2, &d.out));
    MUST(op->alloc(be, nqkv * 2, &d.dqkv));
    MUST(op->alloc(be, op->attention_aux_bytes(be, B, T, C, NH), &d.aux));
    MUST(op->to_device(be, d.f, h, nqkv * sizeof(float)));
    MUST(op->cast(be, d.qkv, act, d.f, DG_F32, nqkv));
    MUST(op->cast(be, d.dout, act, (float *)d.f + dout_off, DG_F32, nout));
    return d;
}
static void attn_bufs_free(dg_backend_t *be, const attn_bufs_t *d) {
    void *bufs[] = {d->f, d->qkv, d->dout, d->out, d->dqkv, d->aux};
    for (int j = 0; j < 6; j++)
        be->ops->free(be, bufs[j]);
}

/* One forward + backward on `be` from host inputs (f32, cast on the device), outputs poisoned first. */
/* n malloc'ed qkv values from the LCG state *rng: magnitudes in [0.05, 1), random signs (no value near 0,
 * so that relative errors stay meaningful) */
static float *attn_qkv(size_t n, uint64_t *rng) {
    float *h = dg_xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
        float v = 0.05f + 0.95f * (float)((*rng >> 40) / 16777216.0);
        h[i] = (*rng >> 20) & 1 ? v : -v;
    }
    return h;
}

static attn_res_t attn_run(dg_backend_t *be, dg_dtype_t act, const float *h, int B, int T, int C, int NH) {
    const dg_backend_ops_t *op = be->ops;
    const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, nl = (size_t)B * NH * T;
    uint16_t *poison = dg_xmalloc(nqkv * sizeof(uint16_t));
    memset(poison, 0xff, nqkv * sizeof(uint16_t));            /* NaN in bf16, f16 and (for aux) f32 */
    attn_bufs_t d = attn_bufs(be, act, h, nout, B, T, C, NH); /* dout: other values than q's */
    MUST(op->to_device(be, d.out, poison, nout * 2));
    MUST(op->to_device(be, d.dqkv, poison, nqkv * 2));
    MUST(op->to_device(be, d.aux, poison, nl * sizeof(float)));
    MUST(op->attention_fwd(be, d.out, d.aux, d.qkv, B, T, C, NH));
    MUST(op->attention_bwd(be, d.dqkv, d.dout, d.qkv, d.out, d.aux, B, T, C, NH));
    attn_res_t r = {dg_xmalloc(nout * 2), dg_xmalloc(nqkv * 2), dg_xmalloc(nl * sizeof(float))};
    MUST(op->to_host(be, r.out, d.out, nout * 2));
    MUST(op->to_host(be, r.dq, d.dqkv, nqkv * 2));
    MUST(op->to_host(be, r.lse, d.aux, nl * sizeof(float)));
    attn_bufs_free(be, &d);
    free(poison);
    return r;
}
static void attn_res_free(attn_res_t *r) {
    free(r->out);
    free(r->dq);
    free(r->lse);
}

/* Times `iters` forward and `iters` backward calls between CUDA events on the backend's stream, after
 * two warm-up calls of each. ms[0] = forward, ms[1] = backward, per call. */
static void attn_time(dg_backend_t *be, dg_dtype_t act, int B, int T, int C, int NH, int iters, uint64_t *rng,
                      double ms[2]) {
    const dg_backend_ops_t *op = be->ops;
    const size_t nqkv = (size_t)B * T * 3 * C;
    float *h = dg_xmalloc(nqkv * sizeof(float));
    for (size_t i = 0; i < nqkv; i++) {
        *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
        h[i] = (float)((int64_t)(*rng >> 40) - (1 << 23)) / (float)(1 << 23);
    }
    attn_bufs_t d = attn_bufs(be, act, h, 0, B, T, C, NH);
    for (int w = 0; w < 2; w++) {
        MUST(op->attention_fwd(be, d.out, d.aux, d.qkv, B, T, C, NH));
        MUST(op->attention_bwd(be, d.dqkv, d.dout, d.qkv, d.out, d.aux, B, T, C, NH));
    }
    MUST(op->sync(be));
    cudaStream_t st = (cudaStream_t)dg_backend_cuda_stream(be);
    cudaEvent_t ev[3];
    for (int i = 0; i < 3; i++)
        if (cudaEventCreate(&ev[i]) != cudaSuccess) {
            fprintf(stderr, "FAIL cudaEventCreate\n");
            exit(1);
        }
    cudaEventRecord(ev[0], st);
    for (int i = 0; i < iters; i++)
        MUST(op->attention_fwd(be, d.out, d.aux, d.qkv, B, T, C, NH));
    cudaEventRecord(ev[1], st);
    for (int i = 0; i < iters; i++)
        MUST(op->attention_bwd(be, d.dqkv, d.dout, d.qkv, d.out, d.aux, B, T, C, NH));
    cudaEventRecord(ev[2], st);
    MUST(op->sync(be));
    float e01 = 0.f, e12 = 0.f;
    cudaEventElapsedTime(&e01, ev[0], ev[1]);
    cudaEventElapsedTime(&e12, ev[1], ev[2]);
    ms[0] = e01 / iters;
    ms[1] = e12 / iters;
    for (int i = 0; i < 3; i++)
        cudaEventDestroy(ev[i]);
    attn_bufs_free(be, &d);
    free(h);
}

/* Values of a that are non-finite (unwritten: the outputs start as NaN) */
static size_t count_nonfinite(const float *a, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += !isfinite(a[i]);
    return k;
}

int run_attn_builtin(dg_dtype_t act, int small) {
    if (act == DG_F32) act = DG_BF16; /* the tensor-core kernels are the 16-bit ones */
    int skip = 0;
    dg_backend_t *ref = make_cuda_builtin(act, 0, &skip);
    if (skip) return SKIP;
    dg_backend_t *tc = make_cuda_builtin(act, 1, &skip);
    const struct { int B, T; } bt[] = {{2, 1024}, {2, 200}, {3, 13}, {1, 333}, {2, 129}};
    const double tol_f = tol("attention_fwd", act), tol_b = tol("attention_bwd", act);
    uint64_t rng = 0xa77e;
    size_t same[2] = {0, 0}, total[2] = {0, 0}; /* per head size (64, 32): values bitwise the reference's */
    for (size_t si = small ? 1 : 0; si < sizeof bt / sizeof bt[0]; si++)
        for (int hs = 64; hs >= 32; hs /= 2) {
            const int B = bt[si].B, T = bt[si].T, NH = T >= 1024 ? 12 : 4, C = hs * NH;
            const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, nl = (size_t)B * NH * T;
            float *h = attn_qkv(nqkv, &rng);
            char nm[128];
            snprintf(nm, sizeof nm,
                     "attn-builtin [%s] B=%d T=%d C=%d NH=%d (head %d): tensor-core vs generic",
                     dg_dtype_name(act), B, T, C, NH, hs);
            attn_res_t r0 = attn_run(ref, act, h, B, T, C, NH);
            float *o0 = act16_array(r0.out, nout, act), *d0 = act16_array(r0.dq, nqkv, act);
            const size_t nf0 =
                count_nonfinite(o0, nout) + count_nonfinite(d0, nqkv) + count_nonfinite(r0.lse, nl);
            check(nf0 == 0, "%s: the generic kernels left %zu unwritten or non-finite values", nm, nf0);
            attn_res_t r1 = attn_run(tc, act, h, B, T, C, NH);
            attn_res_t r1b = attn_run(tc, act, h, B, T, C, NH);
            float *o1 = act16_array(r1.out, nout, act), *d1 = act16_array(r1.dq, nqkv, act);
            /* compare() fails on any non-finite value of the tensor-core results: every element written */
            compare(nm, "fwd out", o1, o0, nout, tol_f);
            compare(nm, "fwd logsumexp", r1.lse, r0.lse, nl, tol_f);
            compare(nm, "bwd dqkv", d1, d0, nqkv, tol_b);
            size_t rep = 0, eq = 0;
            for (size_t i = 0; i < nout; i++) {
                rep += r1.out[i] != r1b.out[i];
                eq += r1.out[i] == r0.out[i];
            }
            for (size_t i = 0; i < nqkv; i++) {
                rep += r1.dq[i] != r1b.dq[i];
                eq += r1.dq[i] == r0.dq[i];
            }
            for (size_t i = 0; i < nl; i++) {
                rep += memcmp(&r1.lse[i], &r1b.lse[i], 4) != 0;
                eq += memcmp(&r1.lse[i], &r0.lse[i], 4) == 0;
            }
            check(rep == 0, "%s: run twice differs in %zu of %zu values (must be bitwise reproducible)", nm,
                  rep, nout + nqkv + nl);
            if (g_verbose)
                printf("info %s: %zu of %zu values bitwise equal to the generic kernels'\n", nm, eq,
                       nout + nqkv + nl);
            same[hs == 32] += eq;
            total[hs == 32] += nout + nqkv + nl;
            free(o0);
            free(d0);
            free(o1);
            free(d1);
            attn_res_free(&r0);
            attn_res_free(&r1);
            attn_res_free(&r1b);
            free(h);
        }
    /* the tensor-core kernels round P to the activation dtype before P.V and add in another order: were
     * every value the generic kernels' bit for bit, the tensor-core path would not have run at all */
    for (int k = 0; k < 2; k++)
        check(same[k] < total[k],
              "attn-builtin [%s] head %d: all %zu values bitwise the generic kernels' (did the tensor-core "
              "kernels run?)",
              dg_dtype_name(act), k ? 32 : 64, total[k]);
    if (!small) { /* timing at GPT-2 124M's shape, one micro-batch of 32 x 1024 (not a pass/fail) */
        const int B = 32, T = 1024, C = 768, NH = 12, iters = 20;
        double ms[2][2];
        attn_time(ref, act, B, T, C, NH, iters, &rng, ms[0]);
        attn_time(tc, act, B, T, C, NH, iters, &rng, ms[1]);
        /* causal attention FLOPs: QK^T and PV over half the T x T matrix, forward; backward 2.5 x */
        const double fl = 4.0 * B * NH * (double)T * T * (C / NH) / 2;
        printf("attn-builtin timing [%s] B=%d T=%d C=%d NH=%d: generic fwd %.4f ms bwd %.4f ms; tensor-core "
               "fwd %.4f ms bwd %.4f ms (TFLOP/s fwd / bwd: generic %.0f / %.0f, tensor-core %.0f / %.0f)\n",
               dg_dtype_name(act), B, T, C, NH, ms[0][0], ms[0][1], ms[1][0], ms[1][1], fl / ms[0][0] / 1e9,
               2.5 * fl / ms[0][1] / 1e9, fl / ms[1][0] / 1e9, 2.5 * fl / ms[1][1] / 1e9);
    }
    dg_backend_free(ref);
    dg_backend_free(tc);
    printf("attn-builtin [%s]: %d checks, %d failed\n", dg_dtype_name(act), g_checks, g_fails);
    return g_fails ? 1 : 0;
}

/* ======================= cuDNN's fused attention vs the built-in kernels ======================= */

static dg_backend_t *make_cuda_cudnn(dg_dtype_t act, const char *mode, int *skip) {
    setenv("DG_CUDA_ATTN_CUDNN", mode, 1);
    dg_backend_t *be = make_cuda(act, skip);
    unsetenv("DG_CUDA_ATTN_CUDNN");
    return be;
}

int run_attn_cudnn(dg_dtype_t act, int small) {
    if (act == DG_F32) act = DG_BF16; /* cuDNN serves the 16-bit activations only */
    int skip = 0;
    dg_backend_t *ref = make_cuda_cudnn(act, "0", &skip);
    if (skip) return SKIP;
    dg_backend_t *det = make_cuda_cudnn(act, "1", &skip);
    const struct {
        int B, T, NH, hs;
    } sh[] = {{2, 1024, 12, 64}, {2, 256, 12, 64}, {2, 200, 4, 64},
              {3, 13, 4, 32},    {1, 333, 4, 64},  {2, 129, 4, 32}};
    const double tol_f = tol("attention_fwd", act), tol_b = tol("attention_bwd", act);
    uint64_t rng = 0xc0d17;
    int any_cudnn = 0;
    for (size_t si = 0; si < sizeof sh / sizeof sh[0]; si++) {
        if (small && sh[si].T >= 1024) continue;
        const int B = sh[si].B, T = sh[si].T, NH = sh[si].NH, C = sh[si].hs * NH;
        const size_t nqkv = (size_t)B * T * 3 * C, nout = (size_t)B * T * C, nl = (size_t)B * NH * T;
        float *h = attn_qkv(nqkv, &rng);
        attn_res_t r0 = attn_run(ref, act, h, B, T, C, NH);
        float *o0 = act16_array(r0.out, nout, act), *d0 = act16_array(r0.dq, nqkv, act);
        check(dg_backend_cuda_cudnn_attention_calls(ref) == 0, "attn-cudnn: DG_CUDA_ATTN_CUDNN=0 used cuDNN");
        {
            dg_backend_t *be = det;
            const long long c0 = dg_backend_cuda_cudnn_attention_calls(be);
            attn_res_t r1 = attn_run(be, act, h, B, T, C, NH);
            attn_res_t r1b = attn_run(be, act, h, B, T, C, NH);
            const long long used = dg_backend_cuda_cudnn_attention_calls(be) - c0;
            any_cudnn |= used > 0;
            char nm[160];
            snprintf(nm, sizeof nm,
                     "attn-cudnn [%s] B=%d T=%d C=%d NH=%d (head %d): cuDNN (%lld calls) vs built-in",
                     dg_dtype_name(act), B, T, C, NH, sh[si].hs, used);
            float *o1 = act16_array(r1.out, nout, act), *d1 = act16_array(r1.dq, nqkv, act);
            compare(nm, "fwd out", o1, o0, nout, tol_f);
            compare(nm, "fwd logsumexp", r1.lse, r0.lse, nl, tol_f);
            compare(nm, "bwd dqkv", d1, d0, nqkv, tol_b);
            size_t rep = 0;
            for (size_t i = 0; i < nout; i++)
                rep += r1.out[i] != r1b.out[i];
            for (size_t i = 0; i < nqkv; i++)
                rep += r1.dq[i] != r1b.dq[i];
            for (size_t i = 0; i < nl; i++)
                rep += memcmp(&r1.lse[i], &r1b.lse[i], 4) != 0;
            check(rep == 0, "%s: run twice differs in %zu of %zu values (must be bitwise reproducible)", nm,
                  rep, nout + nqkv + nl);
            if (T == 1024 && sh[si].hs == 64)
                check(used == 4, "%s: the GPT-2 shape must run on cuDNN where it loads (4 calls, got %lld)",
                      nm, used);
            free(o1);
            free(d1);
            attn_res_free(&r1);
            attn_res_free(&r1b);
        }
        free(o0);
        free(d0);
        attn_res_free(&r0);
        free(h);
    }
    if (!small && any_cudnn) {
        const int B = 32, T = 1024, C = 768, NH = 12, iters = 20;
        double ms[2][2];
        attn_time(ref, act, B, T, C, NH, iters, &rng, ms[0]);
        attn_time(det, act, B, T, C, NH, iters, &rng, ms[1]);
        const double fl = 4.0 * B * NH * (double)T * T * (C / NH) / 2;
        printf(
            "attn-cudnn timing [%s] B=%d T=%d C=%d NH=%d: built-in fwd %.4f bwd %.4f ms; cuDNN fwd %.4f bwd "
            "%.4f ms (TFLOP/s fwd / bwd: %.0f / %.0f, %.0f / %.0f); per step x12: %.2f / %.2f ms\n",
            dg_dtype_name(act), B, T, C, NH, ms[0][0], ms[0][1], ms[1][0], ms[1][1], fl / ms[0][0] / 1e9,
            2.5 * fl / ms[0][1] / 1e9, fl / ms[1][0] / 1e9, 2.5 * fl / ms[1][1] / 1e9,
            12 * (ms[0][0] + ms[0][1]), 12 * (ms[1][0] + ms[1][1]));
    }
    if (!any_cudnn)
        printf("attn-cudnn [%s]: cuDNN served no shape here (see the INFO lines)\n", dg_dtype_name(act));
    dg_backend_free(ref);
    dg_backend_free(det);
    printf("attn-cudnn [%s]: %d checks, %d failed\n", dg_dtype_name(act), g_checks, g_fails);
    return g_fails ? 1 : 0;
}
