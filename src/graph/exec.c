/* exec.c — the executor: phase 2 of the memory plan (one arena of the reserved size) and the replay of
 * the schedule, dispatching each node through its registry entry into the backend vtable, and
 * collectives through the comm backend (comm.h), one comm per mesh dimension.
 *
 * Streams: a collective on DG_STREAM_COMM is posted non-blocking where it stands in the schedule (the
 * comm layer's thread runs it while the following compute ops execute) and completes at the first node
 * that carries a wait edge to it; the time spent blocked there is the exposed communication
 * (wait_s). A collective on the compute stream runs to completion where it stands. Whatever is still in
 * flight when a run ends is completed then, so a phase never leaks requests into the next.
 */
#include <stdlib.h>
#include <string.h>

#include "comm.h"
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
    ex->req = dg_xcalloc((size_t)g->n + 1, sizeof *ex->req);
    *out = ex;
    return DG_OK;
}

void dg_exec_free(dg_exec_t *ex) {
    if (!ex) return;
    /* requests still in flight belong to a failed run: the comm is unusable then and the job is being
     * ended; waiting here could block for the whole timeout */
    if (ex->arena) ex->be->ops->free(ex->be, ex->arena);
    free(ex->req);
    free(ex);
}

dg_status_t dg_exec_attach_comm(dg_exec_t *ex, int dim, struct dg_comm *c) {
    DG_ASSERT(dim >= 0 && dim < DG_MESH_NDIM);
    if (!c) {
        ex->comm[dim] = NULL;
        return DG_OK;
    }
    if (dg_comm_size(c) != ex->graph->mesh.size[dim])
        return DG_ERR(DG_ERR_USAGE, "executor: the %s comm '%s' has %d ranks but the graph was built for %d",
                      dg_mesh_dim_name(dim), dg_comm_name(c), dg_comm_size(c), ex->graph->mesh.size[dim]);
    if (dg_comm_kind(c) == DG_COMM_MPI && strcmp(ex->be->ops->name, "cpu") != 0)
        return DG_ERR(DG_ERR_USAGE,
                      "executor: the mpi comm backend works on host memory but the %s backend keeps tensors "
                      "on the device; use parallel.comm=nccl with it",
                      ex->be->ops->name);
    ex->comm[dim] = c;
    return DG_OK;
}

/* After the request of n completed: the accumulate of a reduce-scatter into a persistent shard. */
static dg_status_t finish(dg_exec_t *ex, const dg_node_t *n, struct dg_comm_req *req, dg_comm_t *c) {
    DG_TRY(dg_comm_wait(c, req));
    if (n->op == DG_OP_REDUCE_SCATTER && n->attr[DG_A_ACC]) {
        size_t S = dg_node_numel(n->upd[0]);
        char *blk = (char *)dg_exec_ptr(ex, n->src[0]) + (size_t)dg_comm_rank(c) * S * sizeof(float);
        DG_TRY(ex->be->ops->accumulate(ex->be, dg_exec_ptr(ex, n->upd[0]), blk, S, 1));
    }
    return DG_OK;
}

static dg_comm_t *comm_of(const dg_exec_t *ex, const dg_node_t *n) {
    return ex->comm[n->attr[DG_A_MESHDIM]];
}

dg_status_t dg_exec_collective(dg_exec_t *ex, const dg_node_t *n) {
    dg_backend_t *be = ex->be;
    int d = (int)n->attr[DG_A_MESHDIM];
    DG_ASSERT(d >= 0 && d < DG_MESH_NDIM);
    int k = ex->graph->mesh.size[d];
    int acc_rs = n->op == DG_OP_REDUCE_SCATTER && n->attr[DG_A_ACC];
    int inplace_ar = n->op == DG_OP_ALL_REDUCE && n->n_src == 0;
    if (n->op == DG_OP_ALL_REDUCE && n->attr[DG_A_ARMODE] == DG_AR_FROM_REPLICATE)
        return DG_OK; /* identity forward: the output is a view of the input */
    if (k == 1) {     /* every collective over one rank is the identity */
        if (inplace_ar) return DG_OK;
        if (acc_rs)
            return be->ops->accumulate(be, dg_exec_ptr(ex, n->upd[0]), dg_exec_ptr(ex, n->src[0]),
                                       dg_node_numel(n->upd[0]), 1);
        void *dst = dg_exec_ptr(ex, n), *src = dg_exec_ptr(ex, n->src[0]);
        return dst == src ? DG_OK : be->ops->copy(be, dst, src, n->nbytes);
    }
    dg_comm_t *c = ex->comm[d];
    if (!c)
        return DG_ERR(DG_ERR_RUNTIME,
                      "graph: %s '%s' over mesh dimension %s of size %d needs a comm backend, and none is "
                      "attached to this executor",
                      dg_op_name(n->op), n->name, dg_mesh_dim_name(d), k);
    if (acc_rs && be->act_dtype != DG_F32)
        return DG_ERR(DG_ERR_USAGE,
                      "graph: '%s' accumulates an f32 gradient shard, which the backend's accumulate (act "
                      "dtype %s) cannot do; sharded training needs fp32 activations on this backend",
                      n->name, dg_dtype_name(be->act_dtype));
    struct dg_comm_req *req = NULL;
    if (n->op == DG_OP_ALL_GATHER) {
        DG_TRY(dg_comm_iallgather(c, dg_exec_ptr(ex, n->src[0]), dg_exec_ptr(ex, n), dg_node_numel(n->src[0]),
                                  n->dtype, &req));
    } else if (acc_rs) {
        char *send = dg_exec_ptr(ex, n->src[0]);
        size_t S = dg_node_numel(n->upd[0]);
        DG_TRY(dg_comm_ireduce_scatter(c, send, send + (size_t)dg_comm_rank(c) * S * sizeof(float), S, DG_F32,
                                       DG_RED_SUM, &req));
    } else if (n->op == DG_OP_REDUCE_SCATTER) {
        DG_TRY(dg_comm_ireduce_scatter(c, dg_exec_ptr(ex, n->src[0]), dg_exec_ptr(ex, n), dg_node_numel(n),
                                       n->dtype, DG_RED_SUM, &req));
    } else if (inplace_ar) {
        const dg_node_t *t = n->upd[0];
        void *p = dg_exec_ptr(ex, t);
        size_t cnt = n->attr[DG_A_COUNT] ? (size_t)n->attr[DG_A_COUNT] : dg_node_numel(t);
        DG_TRY(dg_comm_iallreduce(c, p, p, cnt, t->dtype, DG_RED_SUM, &req));
    } else {
        DG_ASSERT(n->op == DG_OP_ALL_REDUCE);
        DG_TRY(dg_comm_iallreduce(c, dg_exec_ptr(ex, n->src[0]), dg_exec_ptr(ex, n), dg_node_numel(n),
                                  n->dtype, DG_RED_SUM, &req));
    }
    ex->n_coll++;
    if (n->stream == DG_STREAM_COMM) {
        DG_ASSERT(ex->req[n->id] == NULL);
        ex->req[n->id] = req;
        ex->n_pending++;
        return DG_OK;
    }
    double t0 = dg_now_s();
    dg_status_t st = finish(ex, n, req, c);
    ex->blocking_s += dg_now_s() - t0;
    return st;
}

/* Completes the request of comm-stream node w if it is in flight. */
static dg_status_t complete(dg_exec_t *ex, const dg_node_t *w) {
    struct dg_comm_req *req = ex->req[w->id];
    if (!req) return DG_OK;
    ex->req[w->id] = NULL;
    ex->n_pending--;
    double t0 = dg_now_s();
    dg_status_t st = finish(ex, w, req, comm_of(ex, w));
    ex->wait_s += dg_now_s() - t0;
    if (st != DG_OK) return dg_err_prefix(st, "waiting for %s '%s'", dg_op_name(w->op), w->name);
    return DG_OK;
}

dg_status_t dg_exec_drain(dg_exec_t *ex) {
    dg_status_t first = DG_OK;
    for (int i = 0; i < ex->graph->n && ex->n_pending > 0; i++) {
        dg_status_t st = complete(ex, ex->graph->nodes[i]);
        if (st != DG_OK && first == DG_OK) first = st;
        if (st != DG_OK) break; /* the comm is unusable after a failure: do not wait on the rest */
    }
    return first;
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
        dg_status_t st = DG_OK;
        for (int w = 0; w < n->n_wait && st == DG_OK; w++)
            st = complete(ex, n->wait[w]);
        if (st == DG_OK) st = dg_op_def(n->op)->exec(ex, n);
        if (st == DG_OK && ex->profile) {
            st = ex->be->ops->sync(ex->be);
            ex->prof_s[n->op] += dg_now_s() - t0;
            ex->prof_n[n->op]++;
        }
        if (st != DG_OK) return dg_err_prefix(st, "op #%d %s '%s'", n->id, dg_op_name(n->op), n->name);
        ex->ops_run++;
    }
    return dg_exec_drain(ex);
}

dg_status_t dg_exec_run_phase(dg_exec_t *ex, dg_phase_t phase) {
    int first, end;
    dg_graph_phase_range(ex->graph, phase, &first, &end);
    return dg_exec_run(ex, first, end);
}
