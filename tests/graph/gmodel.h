/* gmodel.h — what the graph tests that train a small model share, beside gtest.h's checks: their AdamW
 * settings, random token ids (an LCG), reading a model's flat state back to the host, the end of a
 * training run, what a run records (gmodel_run_t) with the bitwise comparison of two runs, and a wrapper
 * backend (gmodel_wrap_t). */
#ifndef DG_TESTS_GRAPH_GMODEL_H
#define DG_TESTS_GRAPH_GMODEL_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dg_model.h"
#include "gtest.h"

/* The tests' AdamW step: beta1 0.9, beta2 0.95, eps 1e-8 and the given lr, weight decay, clip and 1-based
 * step t (no loss scaling) */
static inline dg_optim_hparams_t gmodel_adamw(float lr, float weight_decay, float grad_clip, int64_t t) {
    return (dg_optim_hparams_t){.lr = lr,
                                .beta1 = 0.9f,
                                .beta2 = 0.95f,
                                .eps = 1e-8f,
                                .weight_decay = weight_decay,
                                .grad_clip = grad_clip,
                                .t = t};
}

/* A test's backend around another one (a counting or altering wrapper): be is a copy of *inner that calls
 * through ops, a copy of inner's table that the test changes. */
typedef struct {
    dg_backend_t *inner;
    dg_backend_ops_t ops;
    dg_backend_t be;
} gmodel_wrap_t;

/* (Re)starts w over w->inner: ops = inner's table, be = *inner on ops; returns &w->ops for the changes */
static inline dg_backend_ops_t *gmodel_wrap_begin(gmodel_wrap_t *w) {
    w->ops = *w->inner->ops;
    w->be = *w->inner;
    w->be.ops = &w->ops;
    return &w->ops;
}

/* A malloc'ed copy of m's flat state `which` (DG_STATE_PARAM, DG_STATE_ADAM_M, ...): dg_model_flat_numel(m)
 * floats. An error status stops the test (OK). */
static inline float *gmodel_flat(dg_model_t *m, int which) {
    float *p = malloc(dg_model_flat_numel(m) * sizeof(float));
    OK(dg_model_get_flat(m, which, p));
    return p;
}

/* n token ids in [0, v) from the LCG state *s (Knuth's MMIX constants, the high bits) */
static inline void gmodel_lcg_ids(int32_t *x, size_t n, int v, uint64_t *s) {
    for (size_t i = 0; i < n; i++) {
        *s = *s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (int32_t)((*s >> 33) % (uint64_t)v);
    }
}

/* The end of a training run: *n = dg_model_flat_numel(m) and copies of the weights and both AdamW moments
 * (gmodel_flat) in *w, *am, *av; then tok, tgt and m are freed. */
static inline void gmodel_finish(dg_model_t *m, void *tok, void *tgt, size_t *n, float **w, float **am,
                                 float **av) {
    *n = dg_model_flat_numel(m);
    *w = gmodel_flat(m, DG_STATE_PARAM);
    *am = gmodel_flat(m, DG_STATE_ADAM_M);
    *av = gmodel_flat(m, DG_STATE_ADAM_V);
    free(tok);
    free(tgt);
    dg_model_free(m);
}
/* A training run of GMODEL_STEPS optimizer steps of GMODEL_ACCUM micro-batches each, as it is compared:
 * the micro-batch losses, the gradient norms (one spare for a test's extra step), an evaluation loss per
 * step, the nlogits logits at the end and the nw weights and AdamW moments (gmodel_finish). */
enum { GMODEL_STEPS = 3, GMODEL_ACCUM = 2 };
typedef struct {
    float loss[GMODEL_STEPS * GMODEL_ACCUM], norm[GMODEL_STEPS + 1], eval[GMODEL_STEPS];
    float *logits, *w, *m, *v;
    size_t nlogits, nw;
    size_t arena; /* dg_model_arena_bytes, for a test that records it */
} gmodel_run_t;

static inline void gmodel_run_free(gmodel_run_t *r) {
    free(r->logits);
    free(r->w);
    free(r->m);
    free(r->v);
}

/* Two runs must be bitwise the same: every loss, norm and evaluation loss, the logits, weights and both
 * AdamW moments (EXPECT, the message starting with `what`). */
static inline void gmodel_expect_same(const gmodel_run_t *a, const gmodel_run_t *b, const char *what) {
    for (int i = 0; i < GMODEL_STEPS * GMODEL_ACCUM; i++)
        EXPECT(memcmp(&a->loss[i], &b->loss[i], sizeof(float)) == 0, "%s: micro-batch loss %d: %.9g vs %.9g",
               what, i, (double)a->loss[i], (double)b->loss[i]);
    for (int i = 0; i <= GMODEL_STEPS; i++)
        EXPECT(memcmp(&a->norm[i], &b->norm[i], sizeof(float)) == 0, "%s: gradient norm %d: %.9g vs %.9g",
               what, i, (double)a->norm[i], (double)b->norm[i]);
    EXPECT(memcmp(a->eval, b->eval, sizeof a->eval) == 0, "%s: evaluation losses differ", what);
    EXPECT(a->nlogits == b->nlogits && memcmp(a->logits, b->logits, a->nlogits * sizeof(float)) == 0,
           "%s: logits differ", what);
    EXPECT(a->nw == b->nw && memcmp(a->w, b->w, a->nw * sizeof(float)) == 0, "%s: weights differ", what);
    EXPECT(a->nw == b->nw && memcmp(a->m, b->m, a->nw * sizeof(float)) == 0, "%s: AdamW m differs", what);
    EXPECT(a->nw == b->nw && memcmp(a->v, b->v, a->nw * sizeof(float)) == 0, "%s: AdamW v differs", what);
}
/* Per-call hooks of gmodel_train (either may be NULL): before(ctx) ahead of every forward_backward and
 * optimizer step, after(ctx, st, k) after it (k: the micro-batch, -1: step st's optimizer step) */
typedef struct {
    void (*before)(void *ctx);
    void (*after)(void *ctx, int st, int k);
    void *ctx;
} gmodel_hooks_t;

/* Trains m (made for `batch` rows of d->seq_len tokens, grad accumulation GMODEL_ACCUM) GMODEL_STEPS steps:
 * each a zero_grad, GMODEL_ACCUM forward+backward passes on token ids and targets drawn from the LCG
 * state *s, the AdamW step gmodel_adamw(3e-3, 0.1, 1, st) and an evaluation forward, into r's loss, norm
 * and eval. tok and tgt (batch * seq_len ids each) hold the last micro-batch afterwards. */
static inline void gmodel_train(dg_model_t *m, const dg_model_desc_t *d, int batch, int32_t *tok,
                                int32_t *tgt, uint64_t *s, const gmodel_hooks_t *hk, gmodel_run_t *r) {
    size_t n = (size_t)batch * d->seq_len;
    for (int st = 1; st <= GMODEL_STEPS; st++) {
        OK(dg_model_zero_grad(m));
        for (int k = 0; k < GMODEL_ACCUM; k++) {
            gmodel_lcg_ids(tok, n, d->vocab_size, s);
            gmodel_lcg_ids(tgt, n, d->vocab_size, s);
            if (hk && hk->before) hk->before(hk->ctx);
            OK(dg_model_forward_backward(m, tok, tgt, 1.0f / (float)(n * GMODEL_ACCUM),
                                         &r->loss[(st - 1) * GMODEL_ACCUM + k]));
            if (hk && hk->after) hk->after(hk->ctx, st, k);
        }
        dg_optim_hparams_t h = gmodel_adamw(3e-3f, 0.1f, 1.0f, st);
        if (hk && hk->before) hk->before(hk->ctx);
        OK(dg_model_optimizer_step(m, &h, &r->norm[st - 1]));
        if (hk && hk->after) hk->after(hk->ctx, st, -1);
        OK(dg_model_forward(m, tok, tgt, &r->eval[st - 1])); /* an evaluation between steps */
    }
}

/* r's logits: the nlogits = batch * vocab_size logits at position seq_len / 2 of tok */
static inline void gmodel_logits(dg_model_t *m, const dg_model_desc_t *d, int batch, const int32_t *tok,
                                 gmodel_run_t *r) {
    r->nlogits = (size_t)batch * d->vocab_size;
    r->logits = malloc(r->nlogits * sizeof(float));
    OK(dg_model_logits(m, tok, d->seq_len / 2, r->logits));
}
#endif
