/* exec.c — the executor: phase 2 of the memory plan (one arena of the reserved size) and the replay of
 * the schedule, dispatching each node through its registry entry into the backend vtable. It knows
 * nothing about devices beyond the vtable, so the CUDA backend (and later a comm backend for
 * collectives) plugs in without changes here.
 */
#include <stdlib.h>
#include <string.h>

#include "graph_impl.h"

dg_status_t dg_exec_create(dg_backend_t *be, const dg_graph_t *g, const dg_plan_t *plan, dg_exec_t **out) {
    *out = NULL;
    DG_ASSERTF(dg_plan_matches(plan, g), "executor: the plan was made for another graph or an older version");
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *x = g->nodes[i];
        if (x->storage == DG_STORE_PERSISTENT && !x->view_src && !x->data)
            return DG_ERR(DG_ERR_RUNTIME, "executor: persistent tensor '%s' has no memory bound", x->name);
    }
    dg_exec_t *ex = dg_xcalloc(1, sizeof *ex);
    ex->be = be;
    ex->graph = g;
    ex->plan = plan;
    if (plan->arena_bytes) {
        dg_status_t st = be->ops->alloc(be, plan->arena_bytes, &ex->arena);
        if (st != DG_OK) {
            free(ex);
            return dg_err_prefix(st, "executor: cannot allocate the %zu-byte activation arena",
                                 plan->arena_bytes);
        }
    }
    ex->rt.dloss = 1.0f;
    ex->rt.grad_extra = 1.0f;
    *out = ex;
    return DG_OK;
}

void dg_exec_free(dg_exec_t *ex) {
    if (!ex) return;
    if (ex->arena) ex->be->ops->free(ex->be, ex->arena);
    free(ex);
}

void *dg_exec_ptr(const dg_exec_t *ex, const dg_node_t *n) {
    size_t offs = 0;
    const dg_node_t *r = n;
    while (r->view_src) {
        offs += r->view_offs;
        r = r->view_src;
    }
    if (r->storage == DG_STORE_PERSISTENT) {
        DG_ASSERTF(r->data != NULL, "persistent tensor '%s' is not bound", r->name);
        return (char *)r->data + offs;
    }
    DG_ASSERTF(r->storage == DG_STORE_ARENA && ex->plan->offset[r->id] != SIZE_MAX,
               "tensor '%s' has no storage", r->name);
    return (char *)ex->arena + ex->plan->offset[r->id] + offs;
}

dg_status_t dg_exec_run(dg_exec_t *ex, int first, int end) {
    const dg_graph_t *g = ex->graph;
    DG_ASSERTF(dg_plan_matches(ex->plan, g),
               "executor: stale plan (graph generation %llu, plan made at %llu)",
               (unsigned long long)g->generation, (unsigned long long)ex->plan->generation);
    DG_ASSERT(first >= 0 && end <= g->n && first <= end);
    for (int i = first; i < end; i++) {
        const dg_node_t *n = g->nodes[i];
        if (n->op == DG_OP_LEAF || n->op == DG_OP_SIDE) continue;
        double t0 = ex->profile ? dg_now_s() : 0;
        dg_status_t st = dg_op_def(n->op)->exec(ex, n);
        if (st == DG_OK && ex->profile) {
            st = ex->be->ops->sync(ex->be);
            ex->prof_s[n->op] += dg_now_s() - t0;
            ex->prof_n[n->op]++;
        }
        if (st != DG_OK) return dg_err_prefix(st, "op #%d %s '%s'", n->id, dg_op_name(n->op), n->name);
        ex->ops_run++;
    }
    return DG_OK;
}

dg_status_t dg_exec_run_phase(dg_exec_t *ex, dg_phase_t phase) {
    int first, end;
    dg_graph_phase_range(ex->graph, phase, &first, &end);
    return dg_exec_run(ex, first, end);
}
