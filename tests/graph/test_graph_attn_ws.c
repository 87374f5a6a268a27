/* test_graph_attn_ws.c — the attention backward's workspace in the activation arena (backend contract
 * v1.9: attention_bwd_ws_bytes / attention_bwd_ws), on the CPU backend behind a wrapper that asks for a
 * workspace the size cuDNN's deterministic backward asks for (B * NH * T^2 * 2 bytes) and fills it with
 * NaN bytes before every call. A workspace placed over memory that anything else still needs would
 * therefore change the numbers.
 *
 * Checked, for a small GPT trained three steps of two micro-batches (an evaluation forward and logits
 * between and after):
 *  - every attention backward gets a workspace of at least the asked size, 256-byte aligned, inside the
 *    arena, and a different workspace per call is not needed: one per op;
 *  - losses, gradient norms, evaluation losses, logits, weights and AdamW moments are bitwise those of
 *    the same wrapper without the v1.9 entries (attention_bwd, the backend's own scratch);
 *  - the arena does not grow: the workspace lives only while its op runs, in memory that is free then
 *    (the logits', after the classifier's backward);
 *  - the eager-allocation fallback (no arena) keeps the numbers.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dg_model.h"
#include "graph.h"
#include "gmodel.h"

/* head size 8, T = 64: the workspace (2 * 4 * 64 * 64 * 2 = 64 KiB) is as large as the logits
 * (2 * 64 * 128 * 4 = 64 KiB): it must go where they were */
static const dg_model_desc_t small = {
    .n_layer = 2, .n_head = 4, .d_model = 32, .seq_len = 64, .vocab_size = 120, .padded_vocab = 128};
enum { B = 2 };

static gmodel_wrap_t wr; /* the wrapper around the CPU backend (wr.inner) */
static int n_asked, n_calls, n_bad;
static size_t ws_min = SIZE_MAX;

static size_t want(int Bn, int T, int C, int NH) {
    (void)C;
    return (size_t)Bn * NH * T * T * 2;
}

static size_t w_ws_bytes(dg_backend_t *be, int Bn, int T, int C, int NH) {
    (void)be;
    n_asked++;
    return want(Bn, T, C, NH);
}

static dg_status_t w_bwd_ws(dg_backend_t *be, void *dqkv, const void *dout, const void *qkv, const void *out,
                            const void *aux, void *ws, size_t ws_bytes, int Bn, int T, int C, int NH) {
    (void)be;
    n_calls++;
    const size_t w = want(Bn, T, C, NH);
    if (!ws || ws_bytes < w || (uintptr_t)ws % 256) {
        n_bad++;
        fprintf(stderr, "attention_bwd_ws: workspace %p of %zu bytes for %zu asked\n", ws, ws_bytes, w);
    } else {
        memset(ws, 0xff, w); /* NaN in f32: poisons whatever else lived there */
        if (ws_bytes < ws_min) ws_min = ws_bytes;
    }
    return wr.inner->ops->attention_bwd(wr.inner, dqkv, dout, qkv, out, aux, Bn, T, C, NH);
}

static dg_backend_t *wrapper(int with_ws) {
    dg_backend_ops_t *ops = gmodel_wrap_begin(&wr);
    ops->attention_bwd_ws_bytes = with_ws ? w_ws_bytes : NULL;
    ops->attention_bwd_ws = with_ws ? w_bwd_ws : NULL;
    return &wr.be;
}

static void train(int with_ws, gmodel_run_t *r) {
    memset(r, 0, sizeof *r);
    dg_model_t *m;
    OK(dg_model_create_ex(&small, wrapper(with_ws), B, 11, 0, &m));
    OK(dg_model_set_grad_accum(m, GMODEL_ACCUM));
    r->arena = dg_model_arena_bytes(m);
    size_t n = (size_t)B * small.seq_len;
    int32_t *tok = malloc(n * sizeof *tok), *tgt = malloc(n * sizeof *tgt);
    uint64_t s = 9;
    gmodel_train(m, &small, B, tok, tgt, &s, NULL, r);
    gmodel_logits(m, &small, B, tok, r);
    gmodel_finish(m, tok, tgt, &r->nw, &r->w, &r->m, &r->v);
    for (int i = 0; i < GMODEL_STEPS * GMODEL_ACCUM; i++)
        EXPECT(isfinite(r->loss[i]), "loss %d is %g", i, (double)r->loss[i]);
}

int main(void) {
    dg_backend_config_t bc = {.act_dtype = DG_F32};
    OK(dg_backend_cpu_create(&bc, &wr.inner));
    gmodel_run_t ref, r;
    train(0, &ref);
    EXPECT(n_asked == 0 && n_calls == 0, "without the v1.9 entries nothing may call them (%d, %d)", n_asked,
           n_calls);

    train(1, &r);
    const size_t w = want(B, small.seq_len, small.d_model, small.n_head);
    printf(
        "workspace %zu bytes per attention backward; asked %d times, called %d times; arena %zu bytes with "
        "it, %zu without\n",
        w, n_asked, n_calls, r.arena, ref.arena);
    EXPECT(n_asked >= small.n_layer, "attention_bwd_ws_bytes asked %d times for %d layers", n_asked,
           small.n_layer);
    EXPECT(n_calls == small.n_layer * GMODEL_STEPS * GMODEL_ACCUM,
           "attention_bwd_ws called %d times, expected %d", n_calls,
           small.n_layer * GMODEL_STEPS * GMODEL_ACCUM);
    EXPECT(n_bad == 0, "%d calls got no usable workspace", n_bad);
    EXPECT(ws_min >= w, "a workspace of %zu bytes, %zu asked", ws_min, w);
    EXPECT(r.arena <= ref.arena, "the workspace made the arena grow: %zu bytes vs %zu without", r.arena,
           ref.arena);
    gmodel_expect_same(&ref, &r, "workspace in the arena vs the backend's own");
    gmodel_run_free(&r);

    /* no arena (the executor's eager-allocation fallback): each workspace is its own allocation */
    setenv("DG_TEST_ARENA_FAIL", "1", 1);
    n_calls = n_bad = 0;
    train(1, &r);
    unsetenv("DG_TEST_ARENA_FAIL");
    EXPECT(n_calls == small.n_layer * GMODEL_STEPS * GMODEL_ACCUM && n_bad == 0,
           "eager allocation: %d calls, %d bad", n_calls, n_bad);
    gmodel_expect_same(&ref, &r, "workspace with eager allocation");
    gmodel_run_free(&r);
    gmodel_run_free(&ref);
    dg_backend_free(wr.inner);
    printf("graph attention workspace: %s\n", dg_fails ? "FAILED" : "passed");
    return dg_fails != 0;
}
