/* gmodel.h — what the graph tests that train a small model share, beside gtest.h's checks: their AdamW
 * settings, random token ids (an LCG), reading a model's flat state back to the host and the end of a
 * training run. */
#ifndef DG_TESTS_GRAPH_GMODEL_H
#define DG_TESTS_GRAPH_GMODEL_H
#include <stdint.h>
#include <stdlib.h>

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
#endif
