/* test_graph_async_reads.c — where the host waits in a training step (backend contract v1.8), on the
 * CPU backend behind a wrapper that behaves like a device queue for read-backs: download_async takes
 * its snapshot of the source when called (its position in the queue) but delivers it to the host only
 * when a fence recorded after it is waited on, or at a sync; until then the destination holds NaN.
 * A loss or norm read from the wrong place, before its fence, or through the wrong fence is therefore
 * wrong (NaN or stale), as it would be on a GPU.
 *
 * Checked, for a small GPT trained three steps of two micro-batches (an evaluation forward, logits and
 * the weights read between and after), with the fused and the per-tensor AdamW:
 *  - with the fences: forward_backward makes no sync and no to_host; it copies the token losses after
 *    the forward's cross-entropy and before the backward's, records the loss fence right after that
 *    copy, queues the whole backward, then waits on that fence only; optimizer_step makes no sync and
 *    no to_host; it copies the norm after clip_scale, records a second fence right after, queues the
 *    AdamW, then waits on the second fence only; destinations are page-locked (host_alloc) memory;
 *  - the losses, gradient norms, evaluation losses, logits, weights and AdamW moments are bitwise those
 *    of the old path, reached both by DG_SYNC_HOST_READS=1 and by a backend without the v1.8 entries
 *    (which must then make no fence or download call and sync in every forward_backward and
 *    optimizer_step);
 *  - two optimizer steps back to back (nothing waited for in between) sync once, before the second
 *    rewrites the host mirrors the first one's AdamW reads;
 *  - the executor's fallbacks (no arena; cross-entropy and clip_scale on the host) and a graph recording
 *    that fails (op-by-op fallback) keep the same numbers with the fences;
 *  - with the fused classifier loss (the default: crossentropy_fused in the forward), the copy comes after
 *    that op and before the backward's first matmul_bwd; with DG_MODEL_UNFUSED_CE, between the forward's
 *    crossentropy_fwd and the backward's crossentropy_bwd.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
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

/* ---------------- the wrapper: a log of calls and queued read-backs ---------------- */

enum {
    EV_SYNC,
    EV_TO_HOST,
    EV_CE_FWD,
    EV_CE_BWD,
    EV_CE_FUSED,
    EV_MM_BWD,
    EV_CLIP,
    EV_ADAMW,
    EV_DOWNLOAD,
    EV_RECORD,
    EV_WAIT,
    EV_N
};
static const char *const ev_name[EV_N] = {
    "sync", "to_host", "crossentropy_fwd", "crossentropy_bwd", "crossentropy_fused", "matmul_bwd",
    "clip", "adamw",   "download_async",   "fence_record",     "fence_wait"};

typedef struct {
    int kind;
    const void *fence; /* EV_RECORD, EV_WAIT */
    size_t bytes;      /* EV_DOWNLOAD */
} ev_t;
static ev_t evlog[1 << 14];
static int n_ev;

static void log_ev(int kind, const void *fence, size_t bytes) {
    if (n_ev >= (int)(sizeof evlog / sizeof evlog[0])) {
        fprintf(stderr, "FAIL: the test's event log is full\n");
        exit(1);
    }
    evlog[n_ev++] = (ev_t){kind, fence, bytes};
}

typedef struct {
    uint64_t seq; /* downloads queued before the latest record */
    int recorded;
} fence_t;

typedef struct {
    void *dst;
    void *data; /* the source as it was when the copy was queued */
    size_t bytes;
    uint64_t seq;
} pending_t;
static pending_t pend[64];
static int n_pend;
static uint64_t dl_seq; /* downloads queued so far */

static dg_ptrtab_t pinned; /* host_alloc's blocks */

static dg_backend_t *inner;
static dg_backend_ops_t wrap_ops;
static dg_backend_t wrap;

static void deliver(uint64_t upto) {
    int k = 0;
    for (int i = 0; i < n_pend; i++) {
        if (pend[i].seq <= upto) {
            memcpy(pend[i].dst, pend[i].data, pend[i].bytes);
            free(pend[i].data);
        } else {
            pend[k++] = pend[i];
        }
    }
    n_pend = k;
}

static dg_status_t w_sync(dg_backend_t *be) {
    (void)be;
    log_ev(EV_SYNC, NULL, 0);
    deliver(UINT64_MAX);
    return inner->ops->sync(inner);
}
static dg_status_t w_to_host(dg_backend_t *be, void *dst, const void *src, size_t bytes) {
    (void)be;
    log_ev(EV_TO_HOST, NULL, bytes);
    deliver(UINT64_MAX); /* to_host waits for the queue */
    return inner->ops->to_host(inner, dst, src, bytes);
}
static dg_status_t w_ce_fwd(dg_backend_t *be, float *l, float *lse, const void *z, const int32_t *t, int N,
                            int V, int Vp) {
    (void)be;
    log_ev(EV_CE_FWD, NULL, 0);
    return inner->ops->crossentropy_fwd(inner, l, lse, z, t, N, V, Vp);
}
static dg_status_t w_ce_bwd(dg_backend_t *be, void *dz, const void *z, const float *lse, const int32_t *t,
                            int N, int V, int Vp, float dl) {
    (void)be;
    log_ev(EV_CE_BWD, NULL, 0);
    return inner->ops->crossentropy_bwd(inner, dz, z, lse, t, N, V, Vp, dl);
}
static dg_status_t w_ce_fused(dg_backend_t *be, float *l, float *lse, void *dz, const void *z,
                              const int32_t *t, int N, int V, int Vp, float dl) {
    (void)be;
    log_ev(EV_CE_FUSED, NULL, 0);
    return inner->ops->crossentropy_fused(inner, l, lse, dz, z, t, N, V, Vp, dl);
}
static dg_status_t w_mm_bwd(dg_backend_t *be, void *dx, float *dw, float *db, const void *dy, const void *x,
                            const void *w, int N, int C, int OC, int acc) {
    (void)be;
    log_ev(EV_MM_BWD, NULL, 0);
    return inner->ops->matmul_bwd(inner, dx, dw, db, dy, x, w, N, C, OC, acc);
}
static dg_status_t w_clip(dg_backend_t *be, float *g, float *n, const float *s, float clip, float extra) {
    (void)be;
    log_ev(EV_CLIP, NULL, 0);
    return inner->ops->clip_scale(inner, g, n, s, clip, extra);
}
static dg_status_t w_adamw_dev(dg_backend_t *be, float *master, void *compute, const float *grad, float *m,
                               float *v, size_t n, float b1, float b2, float eps, float wd, const float *sc) {
    (void)be;
    log_ev(EV_ADAMW, NULL, 0);
    return inner->ops->adamw_dev(inner, master, compute, grad, m, v, n, b1, b2, eps, wd, sc);
}
static dg_status_t w_adamw_multi(dg_backend_t *be, const dg_adamw_seg_t *segs, int nseg, size_t span,
                                 float *master, void *compute, const float *grad, float *m, float *v,
                                 float b1, float b2, float eps, float wd, const float *sc) {
    (void)be;
    log_ev(EV_ADAMW, NULL, 0);
    return inner->ops->adamw_multi_dev(inner, segs, nseg, span, master, compute, grad, m, v, b1, b2, eps, wd,
                                       sc);
}

static dg_status_t w_host_alloc(dg_backend_t *be, size_t bytes, void **out) {
    (void)be;
    DG_TRY(inner->ops->host_alloc(inner, bytes, out));
    dg_ptrtab_add(&pinned, *out, bytes, "host_alloc");
    return DG_OK;
}
static void w_host_free(dg_backend_t *be, void *p) {
    (void)be;
    dg_ptrtab_remove(&pinned, p);
    inner->ops->host_free(inner, p);
}

static dg_status_t w_download(dg_backend_t *be, void *dst, const void *src, size_t bytes) {
    (void)be;
    log_ev(EV_DOWNLOAD, NULL, bytes);
    EXPECT(dg_ptrtab_holds(&pinned, dst, bytes),
           "download_async into %p (%zu bytes): not memory from host_alloc", dst, bytes);
    if (n_pend >= (int)(sizeof pend / sizeof pend[0])) {
        fprintf(stderr, "FAIL: more than %d downloads outstanding (no fence ever waited on?)\n", n_pend);
        exit(1);
    }
    pending_t *p = &pend[n_pend++];
    p->dst = dst;
    p->data = malloc(bytes ? bytes : 1);
    memcpy(p->data, src, bytes);
    p->bytes = bytes;
    p->seq = ++dl_seq;
    /* what the host sees until the copy has "landed" */
    uint32_t nan = 0x7FC0DEADu;
    for (size_t i = 0; i + 4 <= bytes; i += 4)
        memcpy((char *)dst + i, &nan, 4);
    return DG_OK;
}
static dg_status_t w_fence_create(dg_backend_t *be, void **out) {
    (void)be;
    *out = calloc(1, sizeof(fence_t));
    return *out ? DG_OK : DG_ERR(DG_ERR_RUNTIME, "test backend: out of memory");
}
static void w_fence_destroy(dg_backend_t *be, void *f) {
    (void)be;
    free(f);
}
static dg_status_t w_fence_record(dg_backend_t *be, void *f) {
    (void)be;
    log_ev(EV_RECORD, f, 0);
    ((fence_t *)f)->seq = dl_seq;
    ((fence_t *)f)->recorded = 1;
    return DG_OK;
}
static dg_status_t w_fence_wait(dg_backend_t *be, void *f) {
    (void)be;
    log_ev(EV_WAIT, f, 0);
    if (((fence_t *)f)->recorded) deliver(((fence_t *)f)->seq);
    return DG_OK;
}
static dg_status_t w_graph_begin(dg_backend_t *be) {
    (void)be;
    return DG_ERR(DG_ERR_RUNTIME, "test backend: no recording");
}

/* with_fences = 0: the v1.8 entries NULL (a backend without them) */
static dg_backend_t *wrapper(int with_fences, int can_record) {
    wrap_ops = *inner->ops;
    wrap_ops.sync = w_sync;
    wrap_ops.to_host = w_to_host;
    wrap_ops.crossentropy_fwd = w_ce_fwd;
    wrap_ops.crossentropy_bwd = w_ce_bwd;
    wrap_ops.crossentropy_fused = w_ce_fused;
    wrap_ops.matmul_bwd = w_mm_bwd;
    wrap_ops.clip_scale = w_clip;
    wrap_ops.adamw_dev = w_adamw_dev;
    wrap_ops.adamw_multi_dev = w_adamw_multi;
    wrap_ops.host_alloc = w_host_alloc;
    wrap_ops.host_free = w_host_free;
    wrap_ops.download_async = with_fences ? w_download : NULL;
    wrap_ops.fence_create = with_fences ? w_fence_create : NULL;
    wrap_ops.fence_destroy = with_fences ? w_fence_destroy : NULL;
    wrap_ops.fence_record = with_fences ? w_fence_record : NULL;
    wrap_ops.fence_wait = with_fences ? w_fence_wait : NULL;
    wrap_ops.graph_begin = can_record ? w_graph_begin : NULL; /* fails: the op-by-op fallback */
    wrap = *inner;
    wrap.ops = &wrap_ops;
    return &wrap;
}

/* ---------------- checks on the log of one call ---------------- */

static int count(int kind) {
    int c = 0;
    for (int i = 0; i < n_ev; i++)
        c += evlog[i].kind == kind;
    return c;
}
static int first_of(int kind) {
    for (int i = 0; i < n_ev; i++)
        if (evlog[i].kind == kind) return i;
    return -1;
}
static int last_of(int kind) {
    for (int i = n_ev - 1; i >= 0; i--)
        if (evlog[i].kind == kind) return i;
    return -1;
}
static void dump_log(void) {
    fprintf(stderr, "  log:");
    for (int i = 0; i < n_ev; i++)
        if (i == 0 || evlog[i].kind != evlog[i - 1].kind) fprintf(stderr, " %s", ev_name[evlog[i].kind]);
    fputc('\n', stderr);
}

typedef enum { MODE_FENCES, MODE_ENV_SYNC, MODE_NO_OPS } run_mode_t;
static const char *const mode_name[] = {"fences", "DG_SYNC_HOST_READS=1", "no v1.8 ops"};

/* forward_backward with fences: losses copied between the forward's and the backward's cross-entropy
 * (fused: after the one cross-entropy op of the forward, before the backward's first matmul_bwd, the
 * head's), the fence right after the copy, the backward queued, then the wait on that fence; no sync. */
static void check_fb_log(const char *what, const void **loss_fence, size_t want_bytes) {
    int bad = dg_fails;
    int dl = first_of(EV_DOWNLOAD), rec = first_of(EV_RECORD), wt = first_of(EV_WAIT);
    const int fused = count(EV_CE_FUSED) > 0;
    const int ev_fwd = fused ? EV_CE_FUSED : EV_CE_FWD, ev_bwd = fused ? EV_MM_BWD : EV_CE_BWD;
    EXPECT(fused ? count(EV_CE_FUSED) == 1 && count(EV_CE_FWD) == 0 && count(EV_CE_BWD) == 0
                 : count(EV_CE_FWD) == 1 && count(EV_CE_BWD) == 1,
           "%s: %d crossentropy_fused, %d crossentropy_fwd, %d crossentropy_bwd calls", what,
           count(EV_CE_FUSED), count(EV_CE_FWD), count(EV_CE_BWD));
    EXPECT(count(EV_SYNC) == 0 && count(EV_TO_HOST) == 0, "%s: %d syncs, %d to_host (expected none)", what,
           count(EV_SYNC), count(EV_TO_HOST));
    EXPECT(count(EV_DOWNLOAD) == 1 && count(EV_RECORD) == 1 && count(EV_WAIT) == 1,
           "%s: %d downloads, %d fence records, %d fence waits (expected 1 each)", what, count(EV_DOWNLOAD),
           count(EV_RECORD), count(EV_WAIT));
    if (dl >= 0)
        EXPECT(evlog[dl].bytes == want_bytes, "%s: download of %zu bytes, expected the %zu of the losses",
               what, evlog[dl].bytes, want_bytes);
    EXPECT(last_of(ev_fwd) >= 0 && dl > last_of(ev_fwd) && rec == dl + 1 && first_of(ev_bwd) > rec &&
               wt > last_of(ev_bwd) && wt > last_of(EV_MM_BWD),
           "%s: expected %s < download < fence_record < %s < fence_wait (positions %d %d %d %d %d)", what,
           ev_name[ev_fwd], ev_name[ev_bwd], last_of(ev_fwd), dl, rec, first_of(ev_bwd), wt);
    if (rec >= 0 && wt >= 0)
        EXPECT(evlog[wt].fence == evlog[rec].fence, "%s: waits on another fence than the one recorded", what);
    if (rec >= 0) {
        if (!*loss_fence) *loss_fence = evlog[rec].fence;
        EXPECT(evlog[rec].fence == *loss_fence, "%s: the loss fence changed", what);
    }
    if (dg_fails != bad) dump_log();
}

/* optimizer_step with fences: the norm copied after clip_scale, its fence right after, the AdamW queued,
 * then the wait on that fence (not the loss fence); no sync. */
static void check_opt_log(const char *what, const void *loss_fence, int expect_syncs) {
    int bad = dg_fails;
    int dl = first_of(EV_DOWNLOAD), rec = first_of(EV_RECORD), wt = first_of(EV_WAIT);
    EXPECT(count(EV_SYNC) == expect_syncs && count(EV_TO_HOST) == 0, "%s: %d syncs (expected %d), %d to_host",
           what, count(EV_SYNC), expect_syncs, count(EV_TO_HOST));
    EXPECT(count(EV_DOWNLOAD) == 1 && count(EV_RECORD) == 1 && count(EV_WAIT) == 1,
           "%s: %d downloads, %d fence records, %d fence waits (expected 1 each)", what, count(EV_DOWNLOAD),
           count(EV_RECORD), count(EV_WAIT));
    if (dl >= 0) EXPECT(evlog[dl].bytes == sizeof(float), "%s: download of %zu bytes", what, evlog[dl].bytes);
    EXPECT(
        count(EV_CLIP) == 1 && dl > first_of(EV_CLIP) && rec == dl + 1 && first_of(EV_ADAMW) > rec &&
            wt > last_of(EV_ADAMW),
        "%s: expected clip_scale < download < fence_record < adamw < fence_wait (positions %d %d %d %d %d)",
        what, first_of(EV_CLIP), dl, rec, first_of(EV_ADAMW), wt);
    if (rec >= 0 && wt >= 0) {
        EXPECT(evlog[wt].fence == evlog[rec].fence, "%s: waits on another fence than the one recorded", what);
        EXPECT(evlog[rec].fence != loss_fence, "%s: the norm uses the loss fence", what);
    }
    if (dg_fails != bad) dump_log();
}

/* The old path: no v1.8 call at all, and a sync in every call. */
static void check_sync_log(const char *what) {
    EXPECT(count(EV_DOWNLOAD) == 0 && count(EV_RECORD) == 0 && count(EV_WAIT) == 0,
           "%s: %d downloads, %d fence records, %d waits on the old path", what, count(EV_DOWNLOAD),
           count(EV_RECORD), count(EV_WAIT));
    EXPECT(count(EV_SYNC) >= 1, "%s: no sync on the old path", what);
}

/* ---------------- one training run ---------------- */

/* the checks of the calls' logs during gmodel_train (train below) */
typedef struct {
    run_mode_t mode;
    int flags, check_order;
    size_t batch_bytes;     /* one micro-batch's float losses */
    const void *loss_fence; /* check_fb_log's: the fence of the loss read-back */
} train_ctx_t;

static void before_call(void *ctx) {
    (void)ctx;
    n_ev = 0;
}

static void after_call(void *ctx, int st, int k) {
    train_ctx_t *c = ctx;
    char what[160];
    if (k >= 0)
        snprintf(what, sizeof what, "%s, flags %d: step %d forward_backward %d", mode_name[c->mode], c->flags,
                 st, k + 1);
    else
        snprintf(what, sizeof what, "%s, flags %d: step %d optimizer_step", mode_name[c->mode], c->flags, st);
    if (c->check_order && c->mode == MODE_FENCES) {
        if (k >= 0)
            check_fb_log(what, &c->loss_fence, c->batch_bytes);
        else
            check_opt_log(what, c->loss_fence, 0);
    }
    if (c->mode != MODE_FENCES) check_sync_log(what);
}

/* Trains on the wrapper in `mode`; `check_order`: the plain path (no executor fallback, whose host
 * copies sync on purpose), where the logs must look as described at the top. */
static void train(run_mode_t mode, int flags, int can_record, int check_order, gmodel_run_t *r) {
    memset(r, 0, sizeof *r);
    if (mode == MODE_ENV_SYNC)
        setenv("DG_SYNC_HOST_READS", "1", 1);
    else
        unsetenv("DG_SYNC_HOST_READS");
    dg_model_t *m;
    OK(dg_model_create_ex(&small, wrapper(mode != MODE_NO_OPS, can_record), B, 77, flags, &m));
    unsetenv("DG_SYNC_HOST_READS");
    dg_model_set_graph_replay(m, can_record, NULL, NULL);
    OK(dg_model_set_grad_accum(m, GMODEL_ACCUM));
    size_t n = (size_t)B * small.seq_len;
    int32_t *tok = malloc(n * sizeof *tok), *tgt = malloc(n * sizeof *tgt);
    uint64_t s = 5;
    train_ctx_t c = {
        .mode = mode, .flags = flags, .check_order = check_order, .batch_bytes = n * sizeof(float)};
    const gmodel_hooks_t hooks = {.before = before_call, .after = after_call, .ctx = &c};
    gmodel_train(m, &small, B, tok, tgt, &s, &hooks, r);
    /* a second optimizer step with nothing waited for since the first (the gradients are those of the
     * last micro-batches; grad_clip keeps it a normal update): one sync first, then the fence as usual */
    dg_optim_hparams_t h = gmodel_adamw(3e-3f, 0.1f, 1.0f, GMODEL_STEPS);
    OK(dg_model_optimizer_step(m, &h, NULL));
    h.t = GMODEL_STEPS + 1;
    n_ev = 0;
    OK(dg_model_optimizer_step(m, &h, &r->norm[GMODEL_STEPS]));
    char what[160];
    snprintf(what, sizeof what, "%s, flags %d: back-to-back optimizer_step", mode_name[mode], flags);
    if (check_order && mode == MODE_FENCES) check_opt_log(what, c.loss_fence, 1);
    gmodel_logits(m, &small, B, tok, r);
    gmodel_finish(m, tok, tgt, &r->nw, &r->w, &r->m, &r->v);
    EXPECT(n_pend == 0, "%s: %d downloads never delivered after dg_model_free", mode_name[mode], n_pend);
    EXPECT(pinned.n == 0, "%s: %d host_alloc blocks not freed", mode_name[mode], pinned.n);
    for (int i = 0; i < GMODEL_STEPS * GMODEL_ACCUM; i++)
        EXPECT(isfinite(r->loss[i]), "%s: loss %d is %g", mode_name[mode], i, (double)r->loss[i]);
    for (int i = 0; i <= GMODEL_STEPS; i++)
        EXPECT(isfinite(r->norm[i]) && r->norm[i] > 0, "%s: norm %d is %g", mode_name[mode], i,
               (double)r->norm[i]);
}

static void test_flags(int flags) {
    printf("flags %d\n", flags);
    gmodel_run_t ref, r;
    train(MODE_NO_OPS, flags, 0, 1, &ref);
    printf("  old path: losses %.6f .. %.6f, norms %.6f .. %.6f\n", (double)ref.loss[0],
           (double)ref.loss[GMODEL_STEPS * GMODEL_ACCUM - 1], (double)ref.norm[0],
           (double)ref.norm[GMODEL_STEPS]);

    train(MODE_FENCES, flags, 0, 1, &r);
    gmodel_expect_same(&ref, &r, "fences vs no v1.8 ops");
    gmodel_run_free(&r);

    train(MODE_ENV_SYNC, flags, 0, 1, &r);
    gmodel_expect_same(&ref, &r, "DG_SYNC_HOST_READS=1 vs no v1.8 ops");
    gmodel_run_free(&r);

    /* graph replay asked for, every recording fails: the op-by-op fallback after the first step */
    train(MODE_FENCES, flags, 1, 1, &r);
    gmodel_expect_same(&ref, &r, "fences with a failing graph recording");
    gmodel_run_free(&r);

    /* the executor's fallbacks: eager allocation (losses outside an arena), the cross-entropy and the
     * clip factor on the host (copies and syncs of their own around them) */
    setenv("DG_TEST_ARENA_FAIL", "1", 1);
    train(MODE_FENCES, flags, 0, 0, &r);
    unsetenv("DG_TEST_ARENA_FAIL");
    gmodel_expect_same(&ref, &r, "fences with eager allocation");
    gmodel_run_free(&r);
    setenv("DG_TEST_NO_KERNEL", "crossentropy,crossentropy_fused,clip_scale", 1);
    train(MODE_FENCES, flags, 0, 0, &r);
    unsetenv("DG_TEST_NO_KERNEL");
    gmodel_expect_same(&ref, &r, "fences with crossentropy and clip_scale on the host");
    gmodel_run_free(&r);
    gmodel_run_free(&ref);
}

int main(void) {
    dg_backend_config_t bc = {.act_dtype = DG_F32};
    OK(dg_backend_cpu_create(&bc, &inner));
    double t0 = dg_now_s();
    test_flags(0);
    test_flags(DG_MODEL_ADAMW_PER_PARAM);
    test_flags(DG_MODEL_UNFUSED_CE); /* the loss copy between the two cross-entropy ops */
    dg_backend_free(inner);
    printf("async read tests took %.1f s\n", dg_now_s() - t0);
    return dg_check_done("async read");
}
