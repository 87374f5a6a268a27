/* test_graph_ops.c — every op in the graph's registry, exercised THROUGH THE GRAPH on the CPU backend:
 * forward against float64 references (ref64.c), gradients from autodiff against float64 central finite
 * differences of the reference, parameter-gradient accumulation across runs (micro-batches), gradient
 * accumulation across several consumers of a tensor (in place, via ACCUMULATE, via an extra add), the
 * optimizer ops against a float64 AdamW, and collectives' shape rules. Table-driven: the run fails if an
 * op kind of the registry was not executed by a checked case.
 *
 * Tolerances: graph values are fp32; references are float64 evaluated at the same (fp32) inputs.
 * Forward: max|got - ref| <= 1e-5 * max|ref| + 1e-6 (fp32 rounding over <= 100-term sums is ~1e-6
 * relative). Gradients: max|g - fd| <= 1e-3 * max|fd| + 1e-6, with fd the central difference of the
 * float64 objective sum(dout * out) at step 1e-5 (truncation ~1e-10); a wiring mistake gives O(1) errors.
 */
#define DG_CHECK_SHARED_OWNER /* this file defines the check counters all files share */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gops.h"

/* Shape rules reject bad inputs with a one-line DG_ERR_USAGE naming the op, and never crash. */
static void case_shape_errors(dg_backend_t *be) {
    struct {
        const char *what;
        int which;
    } cases[] = {{"layernorm weight size", 0},
                 {"matmul inner dimension", 1},
                 {"attention heads", 2},
                 {"crossentropy vocabulary", 3},
                 {"add shapes", 4},
                 {"encoder sequence length", 5}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        tg_t t;
        tg_init(&t, be, 30 + k);
        int64_t s[3] = {2, 3, 8}, s7[1] = {7}, sw[2] = {4, 7}, sq[3] = {2, 3, 30}, st[2] = {2, 3},
                sv[2] = {9, 8};
        int64_t sp[2] = {2, 8};
        dg_node_t *x = tg_f(&t, "x", 3, s, DG_NF_INPUT, -1, 1), *r = NULL;
        const char *opname = "";
        switch (cases[k].which) {
        case 0:
            r = dg_op_layernorm(t.g, "ln", x, tg_f(&t, "w", 1, s7, DG_NF_PARAM, 0, 1),
                                tg_f(&t, "b", 1, s7, DG_NF_PARAM, 0, 1));
            opname = "layernorm";
            break;
        case 1:
            r = dg_op_matmul(t.g, "mm", x, tg_f(&t, "w", 2, sw, DG_NF_PARAM, 0, 1), NULL);
            opname = "matmul";
            break;
        case 2:
            r = dg_op_attention(t.g, "at", tg_f(&t, "q", 3, sq, DG_NF_INPUT, 0, 1), 4); /* C = 10 */
            opname = "attention";
            break;
        case 3:
            r = dg_op_crossentropy(t.g, "ce", x, tg_i(&t, "t", 2, st, 5), 9); /* V 9 > Vp 8 */
            opname = "crossentropy";
            break;
        case 4:
            r = dg_op_add(t.g, "ad", x, tg_f(&t, "y", 2, sp, DG_NF_INPUT, 0, 1));
            opname = "add";
            break;
        case 5:
            r = dg_op_encoder(t.g, "en", tg_i(&t, "tok", 2, st, 5), tg_f(&t, "wte", 2, sv, DG_NF_PARAM, 0, 1),
                              tg_f(&t, "wpe", 2, sp, DG_NF_PARAM, 0, 1)); /* T 3 > 2 positions */
            opname = "encoder";
            break;
        }
        EXPECT(r == NULL && dg_graph_error(t.g) == DG_ERR_USAGE && strstr(dg_last_error(), opname) &&
                   !strchr(dg_last_error(), '\n'),
               "%s: expected a one-line usage error naming '%s', got '%s'", cases[k].what, opname,
               dg_last_error());
        /* the error is sticky: later constructors return NULL instead of building on a broken graph */
        EXPECT(dg_op_gelu(t.g, "after", x) == NULL, "%s: builder error is not sticky", cases[k].what);
        tg_free(&t);
    }
}

/* A plan made before a mutation is stale and must be refused. */
static void case_stale_plan(dg_backend_t *be) {
    tg_t t;
    tg_init(&t, be, 40);
    int64_t s[2] = {4, 4};
    dg_node_t *x = tg_f(&t, "x", 2, s, DG_NF_INPUT, -1, 1);
    dg_node_t *y = dg_op_gelu(t.g, "y", x);
    y->flags |= DG_NF_OUTPUT;
    tg_finish(&t, 0, NULL, NULL);
    EXPECT(dg_plan_matches(t.plan, t.g), "fresh plan should match");
    dg_op_gelu(t.g, "z", y);
    EXPECT(!dg_plan_matches(t.plan, t.g), "plan must be stale after the graph changed");
    EXPECT(dg_plan_check(t.plan, t.g) != DG_OK, "plan check must refuse a stale plan");
    tg_free(&t);
}

/* one case of the table: on_graph with the graph tg_init made from `seed`, or on_backend */
typedef struct {
    const char *name;
    uint64_t seed;
    void (*on_graph)(tg_t *t, int f0);
    void (*on_backend)(dg_backend_t *be);
} op_case_t;

#define GOPS_ROW(name, seed) {#name, seed, case_##name, NULL},
#define GOPS_ROW_BE(name) {#name, 0, NULL, case_##name},
/* gops.h's cases, then this file's */
static const op_case_t cases[] = {GOPS_CASES(GOPS_ROW, GOPS_ROW_BE) GOPS_ROW_BE(shape_errors)
                                      GOPS_ROW_BE(stale_plan)};

int main(void) {
    dg_backend_config_t bc = {.act_dtype = DG_F32};
    dg_backend_t *be = NULL;
    OK(dg_backend_cpu_create(&bc, &be));
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const op_case_t *c = &cases[i];
        int f0 = dg_fails;
        if (c->on_graph) {
            tg_t t;
            tg_init(&t, be, c->seed);
            c->on_graph(&t, f0);
            tg_free(&t);
        } else {
            c->on_backend(be);
        }
        printf("%-16s %s\n", c->name, dg_fails == f0 ? "ok" : "FAILED");
    }
    /* every registered op must have been executed by a case that passed */
    for (int k = 0; k < DG_OP_COUNT; k++) {
        const dg_op_def_t *d = dg_op_def((dg_op_kind_t)k);
        if (d->grad_kind == DG_GRAD_STRUCTURAL) continue;
        EXPECT(d->shape && d->exec, "op %s lacks a shape rule or an executor", d->name);
        EXPECT(d->grad_kind != DG_GRAD_BUILDER || d->backward, "op %s is differentiable but has no backward",
               d->name);
        EXPECT(covered & (1ull << k), "op %s is registered but no passing test case exercised it", d->name);
    }
    dg_backend_free(be);
    return dg_check_done("graph op");
}
