/* test_graph_fallback.c — the executor's fallbacks (docs/cuda.md "Fallbacks") on the CPU backend:
 *  - memory: the arena cannot be allocated (a real allocation failure from a counting backend, and the
 *    test hook DG_TEST_ARENA_FAIL=1), so activations are allocated one by one over their live ranges;
 *  - kernel: ops the backend has no kernel for (vtable entries set to NULL in a copy of the CPU backend's
 *    table, and the test hook DG_TEST_NO_KERNEL) run on a host CPU backend through copies (among them the
 *    fused classifier loss, whose output lies over its input, and the fused residual adds); a backend
 *    without crossentropy_fused or matmul_fwd_res keeps the unfused pairs;
 *  - both at once.
 * Each trains a small GPT three steps of two micro-batches (with an evaluation forward and a logits call
 * in between) and must give bitwise the losses, gradient norms, logits, weights and AdamW moments of the
 * planned path; the fallback reports must name the right kind; eager allocation must peak below the
 * arena and leave nothing allocated; the capture blocker must name the fallback; bad hook values are
 * one-line errors.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dg_model.h"
#include "dg_ptrtab.h"
#include "graph.h"
#include "gmodel.h"

static const dg_model_desc_t small = {
    .n_layer = 2, .n_head = 4, .d_model = 32, .seq_len = 16, .vocab_size = 67, .padded_vocab = 72};
enum { B = 2 };

/* ---------------- a counting wrapper around the CPU backend ---------------- */

static gmodel_wrap_t wr;  /* the wrapper around the CPU backend (wr.inner) */
static dg_ptrtab_t live;  /* the backend's allocations not yet freed */
static size_t fail_bytes; /* an allocation of exactly this size fails (0: none) */
static int n_failed;

static dg_status_t w_alloc(dg_backend_t *be, size_t bytes, void **out) {
    (void)be;
    if (fail_bytes && bytes == fail_bytes) {
        n_failed++;
        *out = NULL;
        return DG_ERR(DG_ERR_RUNTIME, "test backend: refusing %zu bytes (simulated out of memory)", bytes);
    }
    DG_TRY(wr.inner->ops->alloc(wr.inner, bytes, out));
    dg_ptrtab_add(&live, *out, bytes, "allocation");
    return DG_OK;
}

static void w_free(dg_backend_t *be, void *p) {
    (void)be;
    if (!p) return;
    if (dg_ptrtab_remove(&live, p)) {
        wr.inner->ops->free(wr.inner, p);
        return;
    }
    dg_fails++;
    fprintf(stderr, "FAIL: free of %p, which the backend did not allocate (or freed twice)\n", p);
}

static void w_destroy(dg_backend_t *be) {
    (void)be; /* the inner backend is freed by main */
}

static dg_status_t w_graph_begin(dg_backend_t *be) {
    (void)be;
    return DG_ERR(DG_ERR_RUNTIME, "test backend: no recording");
}

/* The wrapper with the kernels named in `missing` (vtable entry names) set to NULL; graph_begin set so
 * that dg_exec_capture_blocker gets past "the backend cannot record". */
static dg_backend_t *wrapper(const char *missing) {
    dg_backend_ops_t *ops = gmodel_wrap_begin(&wr);
    ops->alloc = w_alloc;
    ops->free = w_free;
    ops->destroy = w_destroy;
    ops->graph_begin = w_graph_begin;
#define DROP(e)                                                                                              \
    if (strstr(missing, #e ",")) ops->e = NULL
    DROP(encoder_fwd);
    DROP(layernorm_fwd);
    DROP(matmul_fwd);
    DROP(gelu_fwd);
    DROP(attention_fwd);
    DROP(add);
    DROP(crossentropy_fwd);
    DROP(encoder_bwd);
    DROP(layernorm_bwd);
    DROP(matmul_bwd);
    DROP(gelu_bwd);
    DROP(matmul_bwd_dgelu);
    DROP(attention_bwd);
    DROP(crossentropy_bwd);
    DROP(accumulate);
    DROP(sumsq_f32);
    DROP(clip_scale);
    DROP(adamw_dev);
    DROP(adamw_multi_dev);
    DROP(sumsq_multi);
    DROP(crossentropy_fused);
    DROP(matmul_fwd_res);
#undef DROP
    return &wr.be;
}

/* ---------------- one training run ---------------- */

typedef struct {
    gmodel_run_t run; /* what gmodel_expect_same compares */
    int n_memory, n_kernel;
    int n_sumsq, n_sumsq_all, n_adamw_all; /* the optimizer's ops in the plan */
    int n_ce_fused, n_ce_bwd;              /* the classifier loss's */
    int n_res;                             /* the fused residual adds (matmul_res) */
    char kernels[8192];                    /* the kernel reports, ';'-separated */
} run_t;

static void on_fallback(void *ctx, const char *kind, const char *reason) {
    run_t *r = ctx;
    if (strcmp(kind, "memory") == 0) r->n_memory++;
    if (strcmp(kind, "kernel") == 0) {
        r->n_kernel++;
        size_t len = strlen(r->kernels);
        snprintf(r->kernels + len, sizeof r->kernels - len, "%s;", reason);
    }
    printf("  fallback %s: %s\n", kind, reason);
}

/* Trains on `be` with the environment as set; checks eager allocation's accounting on the way. */
static void train(dg_backend_t *be, int flags, run_t *r) {
    memset(r, 0, sizeof *r);
    dg_model_t *m;
    OK(dg_model_create_ex(&small, be, B, 77, flags, &m));
    dg_model_set_fallback_cb(m, on_fallback, r);
    OK(dg_model_set_grad_accum(m, GMODEL_ACCUM));
    const dg_graph_t *g = dg_model_graph(m);
    for (int i = 0; i < g->n; i++) {
        r->n_sumsq += g->nodes[i]->op == DG_OP_SUMSQ;
        r->n_sumsq_all += g->nodes[i]->op == DG_OP_SUMSQ_ALL;
        r->n_adamw_all += g->nodes[i]->op == DG_OP_ADAMW_ALL;
        r->n_ce_fused += g->nodes[i]->op == DG_OP_CROSSENTROPY_FUSED;
        r->n_ce_bwd += g->nodes[i]->op == DG_OP_CROSSENTROPY_BWD;
        r->n_res += g->nodes[i]->op == DG_OP_MATMUL_RES;
    }
    size_t n = (size_t)B * small.seq_len;
    int32_t *tok = malloc(n * sizeof *tok), *tgt = malloc(n * sizeof *tgt);
    uint64_t s = 5;
    gmodel_train(m, &small, B, tok, tgt, &s, NULL, &r->run);
    gmodel_logits(m, &small, B, tok, &r->run);
    r->run.nw = dg_model_flat_numel(m);
    r->run.w = gmodel_flat(m, DG_STATE_PARAM);
    r->run.m = gmodel_flat(m, DG_STATE_ADAM_M);
    r->run.v = gmodel_flat(m, DG_STATE_ADAM_V);

    dg_exec_t *ex = dg_model_exec(m);
    size_t bytes, peak;
    int nlive;
    dg_exec_eager_stats(ex, &bytes, &peak, &nlive);
    const char *why = dg_exec_capture_blocker(ex, 0, dg_model_graph(m)->n);
    if (ex->eager) {
        printf("  eager allocation: peak %zu bytes (arena %zu), %d tensors (%zu bytes) still allocated\n",
               peak, dg_model_arena_bytes(m), nlive, bytes);
        EXPECT(peak > 0 && peak <= dg_model_arena_bytes(m), "eager peak %zu bytes vs the arena's %zu", peak,
               dg_model_arena_bytes(m));
        EXPECT(why && strstr(why, "memory fallback"), "capture blocker with eager allocation: %s",
               why ? why : "(none)");
    } else {
        EXPECT(peak == 0 && nlive == 0, "no eager allocation expected");
    }
    if (!ex->eager && r->n_kernel && be == &wr.be)
        EXPECT(why && strstr(why, "runs on the host"), "capture blocker with host ops: %s",
               why ? why : "(none)");
    free(tok);
    free(tgt);
    dg_model_free(m);
}

/* Every allocation of the model (persistent buffers, arena or eager tensors) is returned. */
static void expect_all_freed(const char *what) {
    EXPECT(live.n == 0, "%s: %d allocations (%zu bytes) outstanding after dg_model_free", what, live.n,
           dg_ptrtab_bytes(&live));
}

/* One run with DG_TEST_NO_KERNEL=op: one kernel report, naming `report`, and the planned run's bits. */
static void expect_no_kernel(const run_t *ref, int flags, const char *op, const char *report) {
    run_t r;
    char what[96];
    snprintf(what, sizeof what, "DG_TEST_NO_KERNEL=%s", op);
    setenv("DG_TEST_NO_KERNEL", op, 1);
    train(wrapper(""), flags, &r);
    unsetenv("DG_TEST_NO_KERNEL");
    EXPECT(r.n_kernel == 1 && strstr(r.kernels, report), "%s: reports %s", what, r.kernels);
    gmodel_expect_same(&ref->run, &r.run, what);
    gmodel_run_free(&r.run);
}

static void test_flags(int flags) {
    printf("flags %d\n", flags);
    run_t ref, r;
    unsetenv("DG_TEST_ARENA_FAIL");
    unsetenv("DG_TEST_NO_KERNEL");
    train(wrapper(""), flags, &ref);
    expect_all_freed("planned");
    EXPECT(ref.n_memory == 0 && ref.n_kernel == 0, "planned path: no fallback expected");
    printf("  planned: losses %.4f .. %.4f, norms %.4f .. %.4f\n", (double)ref.run.loss[0],
           (double)ref.run.loss[GMODEL_STEPS * GMODEL_ACCUM - 1], (double)ref.run.norm[0],
           (double)ref.run.norm[GMODEL_STEPS - 1]);
    fail_bytes = 0;

    /* memory: the hook, then a real allocation failure of the arena */
    setenv("DG_TEST_ARENA_FAIL", "1", 1);
    train(wrapper(""), flags, &r);
    unsetenv("DG_TEST_ARENA_FAIL");
    expect_all_freed("DG_TEST_ARENA_FAIL");
    EXPECT(r.n_memory == 1 && r.n_kernel == 0, "DG_TEST_ARENA_FAIL: %d memory, %d kernel reports", r.n_memory,
           r.n_kernel);
    gmodel_expect_same(&ref.run, &r.run, "DG_TEST_ARENA_FAIL=1");
    gmodel_run_free(&r.run);

    dg_model_t *m;
    OK(dg_model_create_ex(&small, wr.inner, B, 77, flags, &m));
    fail_bytes = dg_model_arena_bytes(m);
    dg_model_free(m);
    n_failed = 0;
    train(wrapper(""), flags, &r);
    fail_bytes = 0;
    expect_all_freed("arena allocation failure");
    EXPECT(n_failed >= 1 && r.n_memory == 1, "arena allocation failure: %d refused, %d memory reports",
           n_failed, r.n_memory);
    gmodel_expect_same(&ref.run, &r.run, "arena allocation failure");
    gmodel_run_free(&r.run);

    /* kernel: the hook, then kernels really missing from the vtable (forward, backward, in-place
     * cross-entropy backward, the optimizer's scalar block), then everything at once with eager allocation */
    setenv("DG_TEST_NO_KERNEL", "gelu,layernorm,attention", 1);
    train(wrapper(""), flags, &r);
    unsetenv("DG_TEST_NO_KERNEL");
    EXPECT(r.n_kernel >= 2 && r.n_memory == 0 && strstr(r.kernels, "layernorm") &&
               strstr(r.kernels, "attention") && strstr(r.kernels, "DG_TEST_NO_KERNEL"),
           "DG_TEST_NO_KERNEL: reports %s", r.kernels);
    gmodel_expect_same(&ref.run, &r.run, "DG_TEST_NO_KERNEL=gelu,layernorm,attention");
    gmodel_run_free(&r.run);

    /* the fused AdamW on the host: the flat buffers and the segment table copied there and back */
    expect_no_kernel(&ref, flags, "adamw_all", "op adamw_all (1 node)");

    /* the fused norm on the host: the flat gradient buffer and its segment table copied there */
    EXPECT(ref.n_sumsq_all == 1 && ref.n_sumsq == 0, "planned: %d sumsq_all, %d sumsq", ref.n_sumsq_all,
           ref.n_sumsq);
    expect_no_kernel(&ref, flags, "sumsq_all", "op sumsq_all (1 node)");

    /* the fused classifier loss on the host: the logits copied there, the losses, lse and dlogits (over
     * the logits) back; the evaluation forwards and the logits call take its forward-only path there */
    EXPECT(ref.n_ce_fused == 1 && ref.n_ce_bwd == 0, "planned: %d crossentropy_fused, %d crossentropy_bwd",
           ref.n_ce_fused, ref.n_ce_bwd);
    expect_no_kernel(&ref, flags, "crossentropy_fused", "op crossentropy_fused (1 node)");

    /* a backend without crossentropy_fused: the crossentropy + crossentropy_bwd pair, no fallback, same bits
     */
    train(wrapper("crossentropy_fused,"), flags, &r);
    EXPECT(r.n_kernel == 0 && r.n_ce_fused == 0 && r.n_ce_bwd == 1,
           "no crossentropy_fused: %d kernel reports, %d crossentropy_fused, %d crossentropy_bwd", r.n_kernel,
           r.n_ce_fused, r.n_ce_bwd);
    gmodel_expect_same(&ref.run, &r.run, "no crossentropy_fused");
    gmodel_run_free(&r.run);

    /* the fused residual adds on the host (the residual and the product's operands copied there, the
     * output back), then a backend without matmul_fwd_res: the matmul + add pairs, no fallback, same bits */
    EXPECT(ref.n_res == 2 * small.n_layer, "planned: %d matmul_res", ref.n_res);
    expect_no_kernel(&ref, flags, "matmul_res", "op matmul_res (4 nodes)");
    train(wrapper("matmul_fwd_res,"), flags, &r);
    EXPECT(r.n_kernel == 0 && r.n_res == 0, "no matmul_fwd_res: %d kernel reports, %d matmul_res", r.n_kernel,
           r.n_res);
    gmodel_expect_same(&ref.run, &r.run, "no matmul_fwd_res");
    gmodel_run_free(&r.run);

    /* a backend without sumsq_multi: the fused AdamW with one sumsq per tensor, no fallback, same bits */
    train(wrapper("sumsq_multi,"), flags, &r);
    EXPECT(r.n_kernel == 0 && r.n_adamw_all == 1 && r.n_sumsq_all == 0 && r.n_sumsq > 1,
           "no sumsq_multi: %d kernel reports, %d adamw_all, %d sumsq_all, %d sumsq", r.n_kernel,
           r.n_adamw_all, r.n_sumsq_all, r.n_sumsq);
    gmodel_expect_same(&ref.run, &r.run, "no sumsq_multi");
    gmodel_run_free(&r.run);

    train(wrapper("gelu_fwd,layernorm_bwd,attention_fwd,crossentropy_bwd,matmul_bwd_dgelu,matmul_bwd,"
                  "adamw_multi_dev,adamw_dev,clip_scale,sumsq_f32,accumulate,crossentropy_fused,"),
          flags, &r);
    expect_all_freed("missing kernels");
    EXPECT(r.n_kernel >= 6 && strstr(r.kernels, "has no adamw_dev") &&
               strstr(r.kernels, "has no layernorm_bwd"),
           "missing kernels: reports %s", r.kernels);
    gmodel_expect_same(&ref.run, &r.run, "missing kernels");
    gmodel_run_free(&r.run);

    setenv("DG_TEST_ARENA_FAIL", "1", 1);
    train(
        wrapper(
            "encoder_fwd,layernorm_fwd,matmul_fwd,gelu_fwd,attention_fwd,add,crossentropy_fwd,encoder_bwd,"
            "layernorm_bwd,matmul_bwd,gelu_bwd,matmul_bwd_dgelu,attention_bwd,crossentropy_bwd,accumulate,"
            "sumsq_f32,clip_scale,adamw_multi_dev,adamw_dev,sumsq_multi,crossentropy_fused,matmul_fwd_res,"),
        flags, &r);
    unsetenv("DG_TEST_ARENA_FAIL");
    expect_all_freed("no kernels and no arena");
    EXPECT(r.n_memory == 1 && r.n_kernel >= 10, "no kernels and no arena: %d memory, %d kernel reports",
           r.n_memory, r.n_kernel);
    gmodel_expect_same(&ref.run, &r.run, "no kernels and no arena");
    gmodel_run_free(&r.run);
    gmodel_run_free(&ref.run);
}

static void test_hook_errors(void) {
    const char *bad[] = {"bogus", "all_gather", "gelu,,nope"};
    for (int i = 0; i < 3; i++) {
        setenv("DG_TEST_NO_KERNEL", bad[i], 1);
        dg_model_t *m = NULL;
        dg_status_t st = dg_model_create(&small, wrapper(""), B, 1, &m);
        EXPECT(st == DG_ERR_USAGE && strstr(dg_last_error(), "DG_TEST_NO_KERNEL") &&
                   strstr(dg_last_error(), "hint") && !strchr(dg_last_error(), '\n'),
               "DG_TEST_NO_KERNEL=%s: status %d, %s", bad[i], st, dg_last_error());
        dg_model_free(m);
        expect_all_freed("a failed create");
    }
    unsetenv("DG_TEST_NO_KERNEL");
}

int main(void) {
    dg_backend_config_t bc = {.act_dtype = DG_F32};
    OK(dg_backend_cpu_create(&bc, &wr.inner));
    double t0 = dg_now_s();
    test_flags(0);
    test_flags(DG_MODEL_RECOMPUTE_GELU | DG_MODEL_UNFUSED_GELU_BWD);
    test_hook_errors();
    dg_backend_free(wr.inner);
    printf("fallback tests took %.1f s\n", dg_now_s() - t0);
    return dg_check_done("fallback");
}
