/* test_backend_cuda.c — GPU tests of the CUDA backend. Exits 77 (ctest SKIP) with a message when there is
 * no GPU, except in --mode errors, which also checks that creation then fails cleanly.
 *
 *   test_backend_cuda --mode harness     [--dtype f32|bf16|f16] [--only S] [--verbose] [--no-fd]
 *       every op against the float64 references of tests/backend/op_harness (odd shapes, poison,
 *       accumulation, aliasing, finite differences, repeat-bitwise), the large shapes included
 *       (layernorm at N = 32768, C = 768, ...);
 *   test_backend_cuda --mode cpu         [--dtype ...] [--only S] [--small]
 *       every op against the CPU backend at GPT-2-like shapes (head size 64 and 32, which take the
 *       tensor-core attention path; C = 768 and 1600; V = 50257 padded to 50304; multiples of 8 that take
 *       the fused GEMM epilogues, the DGELU one of matmul_bwd_dgelu included), then a 3-step one-block
 *       training run on both backends;
 *   test_backend_cuda --mode determinism [--dtype ...] [--small]
 *       the same training run twice: losses, gradient norms and all parameters bitwise equal;
 *   test_backend_cuda --mode errors
 *       bad input gives clear errors (never a crash); no GPU gives "no CUDA device".
 *   --under-test-cpu runs the CPU backend in place of the CUDA one (f32): a check of this program on
 *   machines without a GPU.
 *   test_backend_cuda --mode probe
 *       exit 0 when a GPU is usable, 77 otherwise (for the compute-sanitizer wrappers).
 *   test_backend_cuda --mode attn-builtin [--dtype bf16|f16] [--small] [--verbose]
 *       the built-in attention (DG_CUDA_ATTN_CUDNN=0): the tensor-core kernels against the generic ones
 *       (DG_CUDA_FAST_ATTENTION=0, the reference) on the same random inputs ((B,T) in (2,1024) (2,200)
 *       (3,13) (1,333) (2,129), head sizes 64 and 32): out, logsumexp and dqkv within the vs-CPU
 *       tolerances, every element written by both (outputs poisoned with NaN first), the tensor-core ones
 *       bitwise reproducible run to run and not bitwise the generic ones everywhere (else they did not
 *       run); without --small, a timing line of both at B=32 T=1024 C=768 NH=12.
 *   test_backend_cuda --mode attn-cudnn  [--dtype bf16|f16] [--small]
 *       cuDNN's fused attention (the bf16/f16 default) against the built-in kernels (DG_CUDA_ATTN_CUDNN=0)
 *       on the same inputs: out, logsumexp, dqkv within the vs-CPU tolerances, bitwise reproducible, the
 *       GPT-2 shape served by cuDNN where cuDNN loads; then a timing line of both at B=32 T=1024 C=768
 *       NH=12.
 * Exit status: 0 all passed, 1 a check failed, 77 skipped (no GPU).
 */
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

int g_checks, g_fails, g_verbose;
const char *g_only;

void check(int ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    g_checks++;
    if (!ok) g_fails++;
    if (!ok || g_verbose) {
        printf("%s ", ok ? "ok  " : "FAIL");
        vprintf(fmt, ap);
        printf("\n");
        fflush(stdout);
    }
    va_end(ap);
}

static dg_dtype_t parse_dtype(const char *s) {
    if (!strcmp(s, "f32") || !strcmp(s, "fp32")) return DG_F32;
    if (!strcmp(s, "bf16")) return DG_BF16;
    if (!strcmp(s, "f16") || !strcmp(s, "fp16")) return DG_F16;
    fprintf(stderr, "test_backend_cuda: --dtype %s: expected f32, bf16 or f16\n", s);
    exit(2);
}

/* NULL and *skip = 1 when there is no GPU; exits on any other failure, and under CI=true also when the
 * machine has a GPU that CUDA cannot use (tests/lib/dg_test_skip.h). */
dg_backend_t *make_cuda(dg_dtype_t act, int *skip) {
    dg_backend_config_t cfg = {.act_dtype = act, .device = 0, .threads = 0, .seed = 1};
    dg_backend_t *be = NULL;
    *skip = 0;
    dg_status_t s = dg_backend_cuda_create(&cfg, &be);
    if (s == DG_OK) return be;
    if (strstr(dg_last_error(), "no CUDA device")) {
        int rc = dg_test_skip(1, "%s", dg_last_error());
        if (rc != SKIP) exit(rc);
        *skip = 1;
        return NULL;
    }
    fprintf(stderr, "cannot create the cuda backend: %s (%s)\n", dg_last_error(), dg_last_error_where());
    exit(1);
}

/* ======================= determinism ======================= */

static void run_determinism(dg_backend_t *g, int small) {
    ministep_cfg_t cfg = {.B = small ? 2 : 4,
                          .T = small ? 64 : 256,
                          .C = small ? 128 : 256,
                          .NH = small ? 2 : 4,
                          .V = 1000,
                          .Vp = 1024,
                          .lr = 3e-3f,
                          .clip = 1.0f,
                          .seed = 11};
    const int steps = small ? 2 : 4;
    double loss[2][8];
    float norm[2][8];
    float *params[2] = {NULL, NULL};
    size_t np = 0;
    for (int run = 0; run < 2; run++) {
        ministep_t *ms = NULL;
        MUST(ministep_create(g, &cfg, &ms));
        for (int t = 1; t <= steps; t++) {
            MUST(ministep_step(ms, t, &loss[run][t - 1]));
            MUST(ministep_grad_norm(ms, &norm[run][t - 1]));
        }
        params[run] = dg_xmalloc(ministep_nparams(ms) * sizeof(float));
        MUST(ministep_params(ms, params[run], &np));
        ministep_free(ms);
    }
    for (int t = 0; t < steps; t++) {
        check(memcmp(&loss[0][t], &loss[1][t], sizeof(double)) == 0 && isfinite(loss[0][t]),
              "determinism step %d: loss %.10f vs %.10f", t + 1, loss[0][t], loss[1][t]);
        check(memcmp(&norm[0][t], &norm[1][t], sizeof(float)) == 0,
              "determinism step %d: grad norm %.9g vs %.9g", t + 1, norm[0][t], norm[1][t]);
    }
    size_t diff = 0;
    for (size_t i = 0; i < np; i++)
        diff += memcmp(&params[0][i], &params[1][i], 4) != 0;
    check(diff == 0, "determinism: %zu of %zu parameters differ after %d steps", diff, np, steps);
    check(loss[0][steps - 1] < loss[0][0], "determinism run trains: loss %.6f -> %.6f", loss[0][0],
          loss[0][steps - 1]);
    printf("determinism [%s]: %d steps, losses %.6f .. %.6f, %zu parameters bitwise equal: %s\n",
           dg_dtype_name(g->act_dtype), steps, loss[0][0], loss[0][steps - 1], np, diff ? "NO" : "yes");
    free(params[0]);
    free(params[1]);
}

/* ======================= errors ======================= */

static void expect_err(dg_status_t s, const char *needle, const char *what) {
    check(s != DG_OK && strstr(dg_last_error(), needle) != NULL,
          "errors: %s -> status %d \"%s\" (want \"%s\")", what, s, dg_last_error(), needle);
    dg_clear_error();
}

static int run_errors(void) {
    dg_backend_t *be = NULL;
    dg_backend_config_t cfg = {.act_dtype = DG_I32, .device = 0};
    expect_err(dg_backend_cuda_create(&cfg, &be), "not supported", "create with act dtype i32");
    check(be == NULL, "errors: failed create leaves *out NULL");
    cfg.act_dtype = DG_BF16;
    cfg.device = 4096;
    expect_err(dg_backend_cuda_create(&cfg, &be), "no CUDA device", "create on device 4096");
    cfg.device = 0;
    dg_status_t s = dg_backend_cuda_create(&cfg, &be);
    if (s != DG_OK) {
        /* no GPU here: the failure itself must be clean and say so */
        check(s == DG_ERR_RUNTIME && strstr(dg_last_error(), "no CUDA device") != NULL,
              "errors: create without a GPU -> status %d \"%s\"", s, dg_last_error());
        printf("no GPU: checked that creation fails cleanly (\"%s\")\n", dg_last_error());
        return g_fails ? 1 : 0;
    }
    const dg_backend_ops_t *op = be->ops;
    {
        /* a knob's bad value is refused by the switch registry's start-up check (dg_env.h: every program
         * calls dg_env_check before anything reads a switch), naming it (2 was cuDNN's atomic mode) */
        const char *prev = getenv("DG_CUDA_ATTN_CUDNN");
        char *keep = prev ? strdup(prev) : NULL;
        setenv("DG_CUDA_ATTN_CUDNN", "2", 1);
        expect_err(dg_env_check(NULL), "DG_CUDA_ATTN_CUDNN", "dg_env_check with DG_CUDA_ATTN_CUDNN=2");
        if (keep)
            setenv("DG_CUDA_ATTN_CUDNN", keep, 1);
        else
            unsetenv("DG_CUDA_ATTN_CUDNN");
        free(keep);
    }
    void *buf = NULL;
    MUST(op->alloc(be, 1 << 20, &buf));
    MUST(op->memset0(be, buf, 1 << 20));
    expect_err(op->attention_fwd(be, buf, buf, buf, 1, 4, 10, 3), "multiple", "attention C % NH != 0");
    expect_err(op->attention_bwd(be, buf, buf, buf, buf, buf, 1, 0, 12, 3), "T = 0", "attention T = 0");
    expect_err(op->matmul_fwd(be, buf, NULL, buf, NULL, NULL, 4, 4, 4, DG_EPI_NONE), "NULL",
               "matmul_fwd w NULL");
    expect_err(op->matmul_fwd(be, buf, buf, buf, buf, NULL, 4, 4, 4, DG_EPI_GELU), "different",
               "matmul_fwd GELU pre == out");
    expect_err(op->matmul_bwd(be, buf, buf, NULL, buf, buf, buf, -1, 4, 4, 0), "N = -1", "matmul_bwd N = -1");
    {
        char *b = (char *)buf;
        expect_err(op->matmul_fwd_res(be, b, b + 4096, b + 8192, NULL, NULL, 4, 4, 4), "`res` is NULL",
                   "matmul_fwd_res res NULL");
        expect_err(op->matmul_fwd_res(be, b, b + 4096, b + 8192, NULL, b, 4, 0, 4), "C = 0",
                   "matmul_fwd_res C = 0");
        expect_err(op->matmul_fwd_res(be, b, b + 4096, b + 8192, NULL, b + 8, 4, 4, 4), "partially",
                   "matmul_fwd_res out over half of res");
        expect_err(op->matmul_fwd_res(be, b, b + 16, b + 8192, NULL, b + 12288, 4, 4, 4), "inp, w or bias",
                   "matmul_fwd_res out over inp");
    }
    expect_err(op->matmul_bwd_dgelu(be, buf, buf, NULL, buf, buf, buf, NULL, 4, 4, 4, 0), "`pre` is NULL",
               "matmul_bwd_dgelu pre NULL");
    expect_err(op->matmul_bwd_dgelu(be, buf, buf, NULL, buf, buf, buf, buf, 4, 4, 4, 0), "overlap",
               "matmul_bwd_dgelu dpre == pre");
    expect_err(op->cast(be, buf, DG_I32, buf, DG_F32, 4), "not supported", "cast to i32");
    expect_err(op->adamw(be, buf, NULL, buf, buf, buf, 4, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.f, 0, NULL), "t = 0",
               "adamw t = 0");
    expect_err(op->crossentropy_fwd(be, buf, buf, buf, buf, 2, 9, 8), "Vp = 8 < V = 9",
               "crossentropy Vp < V");
    expect_err(op->crossentropy_fused(be, buf, buf, buf, buf, buf, 2, 9, 8, 1.0f), "Vp = 8 < V = 9",
               "crossentropy_fused Vp < V");
    expect_err(op->crossentropy_fused(be, buf, buf, NULL, buf, buf, 2, 9, 10, 1.0f), "NULL",
               "crossentropy_fused dlogits NULL");
    /* device-resident bad data: flagged by the kernel, reported by the next sync, no fault */
    int32_t bad_tg[2] = {3, 9};
    int32_t *dtg = (int32_t *)((char *)buf + 4096);
    float *logits = (float *)((char *)buf + 8192);
    MUST(op->to_device(be, dtg, bad_tg, sizeof bad_tg));
    MUST(op->crossentropy_fwd(be, (float *)buf, (float *)buf + 16, logits, dtg, 2, 9, 10));
    expect_err(op->sync(be), "target outside [0, V)", "crossentropy target == V (reported at sync)");
    check(op->sync(be) == DG_OK, "errors: the flag is cleared after it was reported");
    /* the fused op: the same flag, the row's loss NaN, the other row's finite */
    MUST(op->crossentropy_fused(be, (float *)buf, (float *)buf + 16, logits, logits, dtg, 2, 9, 10, 0.5f));
    expect_err(op->sync(be), "target outside [0, V)", "crossentropy_fused target == V (reported at sync)");
    float fl[2];
    MUST(op->to_host(be, fl, buf, sizeof fl));
    check(isfinite(fl[0]) && isnan(fl[1]),
          "errors: crossentropy_fused bad target: losses %g (finite), %g (NaN)", fl[0], fl[1]);
    int32_t neg[4] = {0, 1, -5, 2};
    MUST(op->to_device(be, dtg, neg, sizeof neg));
    MUST(op->encoder_fwd(be, logits, dtg, buf, buf, 2, 2, 4));
    expect_err(op->sync(be), "negative token", "encoder_fwd negative token (reported at sync)");
    MUST(op->encoder_bwd(be, (float *)logits, (float *)logits + 64, buf, dtg, 2, 2, 4));
    expect_err(op->sync(be), "negative token", "encoder_bwd negative token (reported at sync)");
    /* v1.8: a fence reports the flags raised by the work before it, as sync does, and only once; a
     * download into pageable memory is refused by name */
    void *fence = NULL;
    float *pinned = NULL;
    MUST(op->fence_create(be, &fence));
    MUST(op->host_alloc(be, 64, (void **)&pinned));
    MUST(op->to_device(be, dtg, bad_tg, sizeof bad_tg));
    MUST(op->crossentropy_fwd(be, (float *)buf, (float *)buf + 16, logits, dtg, 2, 9, 10));
    MUST(op->download_async(be, pinned, buf, 2 * sizeof(float)));
    MUST(op->fence_record(be, fence));
    expect_err(op->fence_wait(be, fence), "target outside [0, V)", "crossentropy target == V (fence_wait)");
    check(op->fence_wait(be, fence) == DG_OK && op->sync(be) == DG_OK,
          "errors: the flag is cleared after fence_wait reported it");
    float pageable[2];
    expect_err(op->download_async(be, pageable, buf, sizeof pageable), "page-locked",
               "download_async into pageable memory");
    op->host_free(be, pinned);
    op->fence_destroy(be, fence);
    /* NaN gradient norm: the clip factor is NaN too, not hidden by min() */
    const float nan = NAN;
    MUST(op->to_device(be, buf, &nan, 4));
    MUST(op->clip_scale(be, (float *)buf + 1, (float *)buf + 2, (float *)buf, 1.0f, 1.0f));
    float got[3];
    MUST(op->to_host(be, got, buf, sizeof got));
    check(isnan(got[1]) && isnan(got[2]), "errors: clip_scale of NaN sumsq -> scale %g norm %g", got[1],
          got[2]);
    /* a huge allocation fails with a message, not a crash */
    void *huge = NULL;
    expect_err(op->alloc(be, (size_t)1 << 50, &huge), "cudaMalloc", "alloc of 1 PiB");
    check(huge == NULL, "errors: failed alloc leaves *out NULL");
    check(dg_backend_cuda_stream(be) != NULL, "errors: dg_backend_cuda_stream returns the stream");
    op->free(be, buf);
    dg_backend_free(be);
    return g_fails ? 1 : 0;
}

/* ======================= main ======================= */

int main(int argc, char **argv) {
    const char *mode = "harness";
    dg_dtype_t act = DG_F32;
    int small = 0, no_fd = 0, under_test_cpu = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mode") && i + 1 < argc)
            mode = argv[++i];
        else if (!strcmp(argv[i], "--dtype") && i + 1 < argc)
            act = parse_dtype(argv[++i]);
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            g_only = argv[++i];
        else if (!strcmp(argv[i], "--small"))
            small = 1;
        else if (!strcmp(argv[i], "--no-fd"))
            no_fd = 1;
        else if (!strcmp(argv[i], "--verbose"))
            g_verbose = 1;
        else if (!strcmp(argv[i], "--under-test-cpu"))
            under_test_cpu = 1;
        else {
            fprintf(stderr,
                    "usage: %s --mode harness|cpu|determinism|errors|attn-builtin|attn-cudnn|probe "
                    "[--dtype f32|bf16|f16] [--only S] [--small] [--no-fd] [--verbose]\n",
                    argv[0]);
            return 2;
        }
    }
    if (!strcmp(mode, "probe")) { /* for wrappers (compute-sanitizer tests): 0 = a GPU is usable, 77 = none */
        int skip = 0;
        dg_backend_t *be = make_cuda(act, &skip);
        dg_backend_free(be);
        return skip ? SKIP : 0;
    }
    if (!strcmp(mode, "attn-builtin")) return run_attn_builtin(act, small);
    if (!strcmp(mode, "attn-cudnn")) return run_attn_cudnn(act, small);
    if (!strcmp(mode, "errors")) {
        int rc = run_errors();
        printf("cuda backend errors: %d checks, %d failed\n", g_checks, g_fails);
        return rc;
    }
    int skip = 0;
    dg_backend_t *be = NULL;
    if (under_test_cpu) {
#ifdef DG_TEST_HAVE_CPU
        /* the CPU backend as the backend under test: checks this program itself where there is no GPU */
        dg_backend_config_t cc = {.act_dtype = DG_F32, .threads = 0, .seed = 1};
        MUST(dg_backend_cpu_create(&cc, &be));
#else
        fprintf(stderr, "test_backend_cuda: --under-test-cpu needs the CPU backend\n");
        return 2;
#endif
    } else {
        be = make_cuda(act, &skip);
        if (skip) return SKIP;
    }
    int rc = 0;
    if (!strcmp(mode, "harness")) {
        dg_harness_opts_t o;
        dg_harness_opts_init(&o);
        o.only = g_only;
        o.verbose = g_verbose;
        o.skip_fd = no_fd;
        o.large = 1; /* many-row shapes: the row partitions and partial-row reductions of the kernels */
        rc = dg_op_harness_run(be, &o) ? 1 : 0;
    } else if (!strcmp(mode, "cpu")) {
        rc = run_cpu_compare(be, small);
        printf("cuda vs cpu [%s]: %d checks, %d failed\n", dg_dtype_name(act), g_checks, g_fails);
        if (rc == 0 && g_fails) rc = 1;
    } else if (!strcmp(mode, "determinism")) {
        run_determinism(be, small);
        rc = g_fails ? 1 : 0;
    } else {
        fprintf(stderr, "test_backend_cuda: unknown --mode %s\n", mode);
        rc = 2;
    }
    dg_backend_free(be);
    return rc;
}
