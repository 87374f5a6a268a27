/* gmodel.h — what the graph tests that train a small model share, beside gtest.h's checks: reading a
 * model's flat state back to the host. */
#ifndef DG_TESTS_GRAPH_GMODEL_H
#define DG_TESTS_GRAPH_GMODEL_H
#include <stdlib.h>

#include "dg_model.h"
#include "gtest.h"

/* A malloc'ed copy of m's flat state `which` (DG_STATE_PARAM, DG_STATE_ADAM_M, ...): dg_model_flat_numel(m)
 * floats. An error status stops the test (OK). */
static inline float *gmodel_flat(dg_model_t *m, int which) {
    float *p = malloc(dg_model_flat_numel(m) * sizeof(float));
    OK(dg_model_get_flat(m, which, p));
    return p;
}
#endif
