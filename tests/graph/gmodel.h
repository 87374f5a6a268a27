/* gmodel.h — what the graph tests that train a small model share, beside gtest.h's checks: their AdamW
 * settings and reading a model's flat state back to the host. */
#ifndef DG_TESTS_GRAPH_GMODEL_H
#define DG_TESTS_GRAPH_GMODEL_H
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
#endif
