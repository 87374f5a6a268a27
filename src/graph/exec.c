/* exec.c — the executor: phase 2 of the memory plan (one arena of the reserved size) and the replay of
 * the schedule, dispatching each node through its registry entry into the backend vtable, and
 * collectives through the comm backend (comm.h), one comm per mesh dimension.
 *
 * The mpi comm moves host memory: with a backend whose tensors live on a device, a collective copies its
 * send data to a host buffer when it is posted (to_host is ordered after the work queued before it)
 * and its result back when it completes ("staging"); the sharded-gradient accumulate then runs on the
 * host in f32, so any activation dtype works.
 *
 * Streams: a collective on DG_STREAM_COMM is posted non-blocking where it stands in the schedule (the
 * comm layer's thread runs it while the following compute ops execute) and completes at the first node
 * that carries a wait edge to it; the time spent blocked there is the exposed communication
 * (wait_s). A collective on the compute stream runs to completion where it stands. Whatever is still in
 * flight when a run ends is completed then, so a phase never leaks requests into the next.
 *
 * Device-side waits (the nccl comm; ex->dev_waits): nothing is staged and the host never waits. Every
 * post is preceded by dg_comm_begin_after(c, compute stream), so the collective starts after all the
 * compute work queued before it (its send data is written). "Completing" a request at a wait edge (and
 * at the end of a run, and right after a compute-stream collective) is dg_comm_stream_wait: the compute
 * stream waits for the collective's event, and everything queued on it afterwards runs after the
 * collective. That is the same order the host waits give, stream-side: the memory planner keeps a
 * comm-stream op's send and receive buffers live up to its last waiter (planner.c), every compute op
 * that could reuse that memory is queued after the first waiter's stream wait, and the comm stream only
 * runs collectives posted after the compute work that last used their buffers. The reduce-scatter's
 * accumulate into the f32 gradient shard is add_f32 on the compute stream after the wait. Nothing here
 * records host-side state that a CUDA Graph replay would have to redo: recorded, the begin_after and
 * stream_wait event edges fork the comm stream into the capture and join it back.
 *
 * Fallbacks (docs/cuda.md "Fallbacks"). Memory: when the arena cannot be allocated, every arena
 * root is allocated on its own when its live range starts and freed after it ends (eager allocation,
 * peak = the live set instead of the arena, which fragmentation-free placement can exceed); slower (a
 * cudaMalloc and a device-synchronising cudaFree per tensor and run) and not recordable. Kernel: an op
 * kind the backend has no kernel for runs on a host CPU backend through copies of every tensor it
 * touches (its sources, the tensors it updates, itself and its side outputs); dg_exec_ptr returns the
 * host copies while it runs. Both give the numbers of the planned path: the same kernels on the same
 * values (bitwise on the CPU backend; with a device backend, the host kernel's own rounding).
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "comm.h"
#include "graph.h"
#include "dg_env.h"

/* The stream the backend queues its ops on (NULL on the CPU backend), for the comm's event edges. */
static void *compute_stream(dg_exec_t *ex) {
#ifdef DG_HAVE_CUDA
    return dg_backend_cuda_stream(ex->be);
#else
    (void)ex;
    return NULL;
#endif
}

static void add_fallback(dg_exec_t *ex, const char *kind, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void add_fallback(dg_exec_t *ex, const char *kind, const char *fmt, ...) {
    DG_ASSERT(ex->n_fb < (int)(sizeof ex->fb / sizeof ex->fb[0]));
    struct dg_exec_fallback *f = &ex->fb[ex->n_fb++];
    snprintf(f->kind, sizeof f->kind, "%s", kind);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(f->reason, sizeof f->reason, fmt, ap);
    va_end(ap);
    DG_LOG_WARN("%s: executor fallback (%s): %s",
                strcmp(kind, "kernel") == 0 ? "FALLBACK_UNSUPPORTED_OP" : "FALLBACK_ARENA_ALLOC", f->kind,
                f->reason);
}

/* ---------------- memory fallback: eager allocation ---------------- */

/* Index of the arena roots by the position where their live range starts and ends (counting sort). */
static void eager_setup(dg_exec_t *ex) {
    const dg_graph_t *g = ex->graph;
    const dg_memplan_t *p = ex->plan;
    int n = g->n;
    ex->eager = 1;
    ex->root_ptr = dg_xcalloc((size_t)n + 1, sizeof *ex->root_ptr);
    ex->roots = dg_xmalloc(((size_t)n + 1) * sizeof *ex->roots);
    ex->start_at = dg_xcalloc((size_t)n + 2, sizeof *ex->start_at);
    ex->end_at = dg_xcalloc((size_t)n + 2, sizeof *ex->end_at);
    for (int i = 0; i < n; i++) {
        if (p->offset[i] == SIZE_MAX) continue;
        DG_ASSERT(p->live_start[i] >= 0 && p->live_start[i] < n && p->live_end[i] >= p->live_start[i]);
        ex->roots[ex->n_roots++] = i;
        ex->start_at[p->live_start[i] + 1]++;
        ex->end_at[(p->live_end[i] < n ? p->live_end[i] : n) + 1]++;
    }
    for (int i = 0; i <= n; i++) {
        ex->start_at[i + 1] += ex->start_at[i];
        ex->end_at[i + 1] += ex->end_at[i];
    }
    ex->by_start = dg_xmalloc(((size_t)ex->n_roots + 1) * sizeof *ex->by_start);
    ex->by_end = dg_xmalloc(((size_t)ex->n_roots + 1) * sizeof *ex->by_end);
    int *fs = dg_xmalloc(((size_t)n + 2) * sizeof *fs), *fe = dg_xmalloc(((size_t)n + 2) * sizeof *fe);
    memcpy(fs, ex->start_at, ((size_t)n + 2) * sizeof *fs);
    memcpy(fe, ex->end_at, ((size_t)n + 2) * sizeof *fe);
    for (int k = 0; k < ex->n_roots; k++) {
        int i = ex->roots[k], e = p->live_end[i] < n ? p->live_end[i] : n;
        ex->by_start[fs[p->live_start[i]]++] = i;
        ex->by_end[fe[e]++] = i;
    }
    free(fs);
    free(fe);
}

static void eager_release(dg_exec_t *ex, int id) {
    if (!ex->root_ptr[id]) return;
    /* on CUDA, cudaFree waits for the device: the kernels queued on this tensor have run */
    ex->be->ops->free(ex->be, ex->root_ptr[id]);
    ex->root_ptr[id] = NULL;
    ex->eager_bytes -= ex->graph->nodes[id]->nbytes;
    ex->eager_live--;
}

static dg_status_t eager_acquire(dg_exec_t *ex, int id) {
    if (ex->root_ptr[id]) return DG_OK;
    const dg_node_t *x = ex->graph->nodes[id];
    dg_status_t st = ex->be->ops->alloc(ex->be, x->nbytes ? x->nbytes : 1, &ex->root_ptr[id]);
    if (st != DG_OK || !ex->root_ptr[id]) {
        ex->root_ptr[id] = NULL;
        return dg_err_prefix(
            st != DG_OK ? st : DG_ERR_RUNTIME,
            "executor (eager allocation after the arena fallback): cannot allocate %zu bytes "
            "for '%s' with %zu bytes of activations live",
            x->nbytes, x->name, ex->eager_bytes);
    }
    ex->eager_bytes += x->nbytes;
    ex->eager_live++;
    if (ex->eager_bytes > ex->eager_peak) ex->eager_peak = ex->eager_bytes;
    return DG_OK;
}

/* A run starting at `first`: what is still allocated from a run over the same positions belongs to an
 * older step (or to a forward-only run whose backward never came) and goes first. */
static void eager_begin(dg_exec_t *ex, int first) {
    for (int k = 0; k < ex->n_roots; k++) {
        int i = ex->roots[k];
        if (ex->root_ptr[i] && ex->plan->live_start[i] >= first) eager_release(ex, i);
    }
}

static dg_status_t eager_before(dg_exec_t *ex, int pos) {
    for (int k = ex->start_at[pos]; k < ex->start_at[pos + 1]; k++)
        DG_TRY(eager_acquire(ex, ex->by_start[k]));
    return DG_OK;
}

/* After the node at pos ran: free what dies there. Tensors live to the end of the schedule (outputs
 * the host reads after the run) stay until the next run over their start, or dg_exec_free. */
static void eager_after(dg_exec_t *ex, int pos) {
    if (pos >= ex->graph->n - 1) return;
    for (int k = ex->end_at[pos]; k < ex->end_at[pos + 1]; k++)
        eager_release(ex, ex->by_end[k]);
}

void dg_exec_eager_stats(const dg_exec_t *ex, size_t *bytes, size_t *peak, int *live) {
    if (bytes) *bytes = ex->eager_bytes;
    if (peak) *peak = ex->eager_peak;
    if (live) *live = ex->eager_live;
}

/* ---------------- kernel fallback: ops on the host ---------------- */

static int is_collective_kind(dg_op_kind_t k) {
    return k == DG_OP_ALL_GATHER || k == DG_OP_REDUCE_SCATTER || k == DG_OP_ALL_REDUCE;
}

/* Which op kinds run on the host: the backend lacks their kernel, or DG_TEST_NO_KERNEL names them. */
static dg_status_t host_ops_setup(dg_exec_t *ex) {
    const dg_graph_t *g = ex->graph;
    const char *why[DG_OP_COUNT] = {0};
    int hook[DG_OP_COUNT] = {0};
    for (int k = 0; k < DG_OP_COUNT; k++) {
        why[k] = dg_op_missing_kernel(ex->be, (dg_op_kind_t)k);
        if (why[k]) ex->host_op[k] = 1;
    }
    const char *env = dg_env_str("DG_TEST_NO_KERNEL");
    if (env && *env) {
        char buf[512];
        snprintf(buf, sizeof buf, "%s", env);
        char *save = NULL;
        for (char *t = strtok_r(buf, ", ", &save); t; t = strtok_r(NULL, ", ", &save)) {
            int k = 0;
            while (k < DG_OP_COUNT && strcmp(dg_op_name((dg_op_kind_t)k), t) != 0)
                k++;
            if (k == DG_OP_COUNT || k == DG_OP_LEAF || k == DG_OP_SIDE || k == DG_OP_WAIT ||
                is_collective_kind((dg_op_kind_t)k))
                return DG_ERR(
                    DG_ERR_USAGE,
                    "DG_TEST_NO_KERNEL: '%s' is not an op with a kernel of its own; hint: a comma-separated "
                    "list of op names such as gelu,layernorm,attention,matmul_bwd (collectives, waits "
                    "and structural kinds cannot run on the host)",
                    t);
            ex->host_op[k] = 1;
            hook[k] = 1;
        }
    }
    /* the attention scratch is backend-specific (CPU: the probabilities, CUDA: a logsumexp per row):
     * the forward and the backward must run on the same side */
    if (strcmp(ex->be->ops->name, "cpu") != 0 &&
        (ex->host_op[DG_OP_ATTENTION] || ex->host_op[DG_OP_ATTENTION_BWD]))
        ex->host_op[DG_OP_ATTENTION] = ex->host_op[DG_OP_ATTENTION_BWD] = 1;
    int count[DG_OP_COUNT] = {0}, any = 0;
    for (int i = 0; i < g->n; i++)
        if (ex->host_op[g->nodes[i]->op]) {
            count[g->nodes[i]->op]++;
            any = 1;
        }
    if (!any) return DG_OK;
    if (ex->be->act_dtype != DG_F32)
        for (int k = 0; k < DG_OP_COUNT; k++)
            if (count[k])
                return DG_ERR(
                    DG_ERR_USAGE,
                    "executor: op %s has no kernel on the %s backend%s and the host fallback computes "
                    "in fp32 only, but activations are %s; hint: train.precision=fp32, or a build "
                    "of the backend with that kernel",
                    dg_op_name((dg_op_kind_t)k), ex->be->ops->name,
                    hook[k] ? " (test hook DG_TEST_NO_KERNEL)" : "", dg_dtype_name(ex->be->act_dtype));
    dg_backend_config_t cfg = {.act_dtype = DG_F32, .threads = 0};
    dg_status_t st = dg_backend_cpu_create(&cfg, &ex->host_be);
    if (st != DG_OK)
        return dg_err_prefix(st, "executor: cannot start the host backend for the kernel fallback");
    for (int i = 0; i < g->n; i++) { /* the host kernel's scratch must fit the device's */
        const dg_node_t *x = g->nodes[i];
        if (x->op != DG_OP_ATTENTION || !ex->host_op[x->op]) continue;
        size_t hb = ex->host_be->ops->attention_aux_bytes(ex->host_be, (int)x->shape[0], (int)x->shape[1],
                                                          (int)x->shape[2], (int)x->attr[DG_A_NH]);
        if (hb > x->side[0]->nbytes)
            return DG_ERR(
                DG_ERR_USAGE,
                "executor: attention '%s' cannot run on the host: the cpu kernel needs %zu bytes of "
                "scratch, the %s backend's plan holds %zu; hint: a build of the %s backend with "
                "attention kernels",
                x->name, hb, ex->be->ops->name, x->side[0]->nbytes, ex->be->ops->name);
    }
    for (int k = 0; k < DG_OP_COUNT; k++) {
        if (!count[k]) continue;
        const char *miss = dg_op_missing_kernel(ex->be, (dg_op_kind_t)k);
        char cause[160];
        if (miss)
            snprintf(cause, sizeof cause, "the %s backend has no %s", ex->be->ops->name, miss);
        else if (hook[k])
            snprintf(cause, sizeof cause, "test hook DG_TEST_NO_KERNEL");
        else
            snprintf(cause, sizeof cause, "its %s counterpart runs on the host (backend-specific scratch)",
                     k == DG_OP_ATTENTION ? "backward" : "forward");
        add_fallback(ex, "kernel",
                     "op %s (%d node%s): %s; runs on the host cpu backend, with copies of its tensors to the "
                     "host and back around every call",
                     dg_op_name((dg_op_kind_t)k), count[k], count[k] == 1 ? "" : "s", cause);
    }
    ex->ovr = dg_xcalloc((size_t)g->n + 1, sizeof *ex->ovr);
    return DG_OK;
}

/* One tensor a host-run node touches: its device range, whether the op writes it, and its host copy. */
typedef struct {
    const dg_node_t *node;
    char *dev;
    size_t bytes;
    int write;
    int span; /* index of the merged device range it lies in */
} host_use_t;

static int add_use(dg_exec_t *ex, host_use_t *u, int nu, const dg_node_t *x, int write) {
    if (!x || x->storage == DG_STORE_NONE) return nu;
    u[nu] = (host_use_t){x, dg_exec_ptr(ex, x), x->nbytes, write, -1};
    return nu + 1;
}

static int by_dev(const void *a, const void *b) {
    const host_use_t *x = a, *y = b;
    return x->dev < y->dev ? -1 : x->dev > y->dev;
}

/* Runs node n on the host backend. Overlapping device ranges (in-place views, an accumulation target
 * and the output over it, the same tensor as source and update) share one host buffer, so aliasing
 * behaves as on the device. */
static dg_status_t run_on_host(dg_exec_t *ex, const dg_node_t *n) {
    dg_backend_t *be = ex->be, *hb = ex->host_be;
    host_use_t u[1 + DG_MAX_SIDE + DG_MAX_SRC + DG_MAX_UPD];
    int nu = add_use(ex, u, 0, n, 1);
    for (int k = 0; k < n->n_side; k++)
        nu = add_use(ex, u, nu, n->side[k], 1);
    for (int k = 0; k < n->n_upd; k++)
        nu = add_use(ex, u, nu, n->upd[k], 1);
    for (int k = 0; k < n->n_src; k++)
        nu = add_use(ex, u, nu, n->src[k], 0);
    qsort(u, (size_t)nu, sizeof u[0], by_dev);
    struct {
        char *lo, *hi, *host;
        int write;
    } sp[1 + DG_MAX_SIDE + DG_MAX_SRC + DG_MAX_UPD];
    int ns = 0;
    for (int k = 0; k < nu; k++) {
        char *lo = u[k].dev, *hi = u[k].dev + u[k].bytes;
        if (ns > 0 && lo < sp[ns - 1].hi) {
            if (hi > sp[ns - 1].hi) sp[ns - 1].hi = hi;
            sp[ns - 1].write |= u[k].write;
        } else {
            sp[ns].lo = lo;
            sp[ns].hi = hi;
            sp[ns].host = NULL;
            sp[ns].write = u[k].write;
            ns++;
        }
        u[k].span = ns - 1;
    }
    dg_status_t st = be->ops->sync(be); /* the device work that produced the inputs is done */
    for (int s = 0; s < ns && st == DG_OK; s++) {
        size_t bytes = (size_t)(sp[s].hi - sp[s].lo);
        st = hb->ops->alloc(hb, bytes ? bytes : 1, (void **)&sp[s].host);
        if (st == DG_OK) st = be->ops->to_host(be, sp[s].host, sp[s].lo, bytes);
    }
    if (st == DG_OK) {
        for (int k = 0; k < nu; k++)
            ex->ovr[u[k].node->id] = sp[u[k].span].host + (u[k].dev - sp[u[k].span].lo);
        ex->ovr_on = 1;
        ex->be = hb;
        st = dg_op_def(n->op)->exec(ex, n);
        ex->be = be;
        ex->ovr_on = 0;
        for (int k = 0; k < nu; k++)
            ex->ovr[u[k].node->id] = NULL;
        if (st == DG_OK) st = hb->ops->sync(hb);
        if (st != DG_OK) st = dg_err_prefix(st, "on the host (kernel fallback)");
    }
    for (int s = 0; s < ns && st == DG_OK; s++)
        if (sp[s].write) st = be->ops->to_device(be, sp[s].lo, sp[s].host, (size_t)(sp[s].hi - sp[s].lo));
    /* the copies read the host buffers: done before they are freed */
    if (st == DG_OK) st = be->ops->sync(be);
    for (int s = 0; s < ns; s++)
        if (sp[s].host) hb->ops->free(hb, sp[s].host);
    return st;
}

static int on_host(const dg_exec_t *ex, const dg_node_t *n) {
    return ex->host_be && ex->host_op[n->op] && !is_collective_kind(n->op) && n->op != DG_OP_WAIT;
}

/* ---------------- creation ---------------- */

/* The fused ops' segment tables for this step: the graph's segments, frozen parameters flagged skip. */
void dg_exec_stage_segs(dg_exec_t *ex) {
    const dg_graph_t *g = ex->graph;
    const dg_runtime_t *rt = &ex->rt;
    for (int i = 0; ex->seg_host && i < g->n_opt_segs; i++) {
        const dg_opt_seg_t *s = &g->opt_segs[i];
        int pi = s->param_index;
        int frozen = rt->frozen && pi >= 0 && pi < rt->n_frozen_slots && rt->frozen[pi];
        ex->seg_host[i] =
            (dg_adamw_seg_t){(uint64_t)s->off, (uint32_t)s->count,
                             (s->decay ? DG_ADAMW_SEG_DECAY : 0u) | (frozen ? DG_ADAMW_SEG_SKIP : 0u)};
    }
    for (int i = 0; ex->norm_seg_host && i < g->n_norm_segs; i++) {
        const dg_opt_seg_t *s = &g->norm_segs[i];
        int pi = s->param_index;
        int frozen = rt->frozen && pi >= 0 && pi < rt->n_frozen_slots && rt->frozen[pi];
        ex->norm_seg_host[i] =
            (dg_sumsq_seg_t){(uint64_t)s->off, (uint32_t)s->count, frozen ? DG_SUMSQ_SEG_SKIP : 0u};
    }
}

dg_status_t dg_exec_create(dg_backend_t *be, const dg_graph_t *g, const dg_memplan_t *plan, dg_exec_t **out) {
    return dg_exec_create_ex(be, g, plan, 0, out);
}

dg_status_t dg_exec_create_ex(dg_backend_t *be, const dg_graph_t *g, const dg_memplan_t *plan, int flags,
                              dg_exec_t **out) {
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
    ex->req = dg_xcalloc((size_t)g->n + 1, sizeof *ex->req);
    if (plan->arena_bytes && (flags & DG_EXEC_EAGER)) {
        eager_setup(ex); /* asked for (the conservative plan): the owner reports why */
    } else if (plan->arena_bytes) {
        int hook = dg_env_bool("DG_TEST_ARENA_FAIL");
        dg_status_t st = DG_OK;
        char msg[400] = "";
        if (hook) {
            snprintf(msg, sizeof msg, "the test hook DG_TEST_ARENA_FAIL=1 refused it");
            st = DG_ERR_RUNTIME;
        } else {
            st = be->ops->alloc(be, plan->arena_bytes, &ex->arena);
            if (st != DG_OK) snprintf(msg, sizeof msg, "%s", dg_last_error());
        }
        if (st != DG_OK) {
            ex->arena = NULL;
            eager_setup(ex);
            add_fallback(
                ex, "memory",
                "cannot allocate the %zu-byte activation arena (%s); each activation is allocated on "
                "its own over its live range instead (eager allocation: peak = the live set, one "
                "alloc/free per tensor and run)",
                plan->arena_bytes, msg);
        }
    }
    ex->rt.dloss = 1.0f;
    ex->rt.grad_extra = 1.0f;
    dg_status_t st = host_ops_setup(ex);
    if (st == DG_OK) {
        st = be->ops->host_alloc(be, DG_DS_COUNT * sizeof(float), (void **)&ex->sc_host);
        if (st != DG_OK)
            st = dg_err_prefix(st, "executor: cannot allocate the host mirror of the step scalars");
    }
    if (st == DG_OK && g->n_opt_segs > 0) {
        st = be->ops->host_alloc(be, (size_t)g->n_opt_segs * sizeof(dg_adamw_seg_t), (void **)&ex->seg_host);
        if (st != DG_OK)
            st = dg_err_prefix(
                st, "executor: cannot allocate the host mirror of the fused AdamW's segment table");
    }
    if (st == DG_OK && g->n_norm_segs > 0) {
        st = be->ops->host_alloc(be, (size_t)g->n_norm_segs * sizeof(dg_sumsq_seg_t),
                                 (void **)&ex->norm_seg_host);
        if (st != DG_OK)
            st = dg_err_prefix(st,
                               "executor: cannot allocate the host mirror of the fused norm's segment table");
    }
    if (st != DG_OK) {
        dg_exec_free(ex);
        return st;
    }
    memset(ex->sc_host, 0, DG_DS_COUNT * sizeof(float));
    dg_exec_stage_segs(ex);
    *out = ex;
    return DG_OK;
}

void dg_exec_free(dg_exec_t *ex) {
    if (!ex) return;
    /* requests still in flight belong to a failed run: the comm is unusable then and the job is being
     * ended; waiting here could block for the whole timeout */
    if (ex->arena) ex->be->ops->free(ex->be, ex->arena);
    for (int k = 0; k < ex->n_roots; k++)
        eager_release(ex, ex->roots[k]);
    DG_FREE_ALL(ex->root_ptr, ex->roots, ex->by_start, ex->start_at, ex->by_end, ex->end_at);
    dg_backend_free(ex->host_be);
    free(ex->ovr);
    if (ex->sc_host) ex->be->ops->host_free(ex->be, ex->sc_host);
    if (ex->seg_host) ex->be->ops->host_free(ex->be, ex->seg_host);
    if (ex->norm_seg_host) ex->be->ops->host_free(ex->be, ex->norm_seg_host);
    for (int i = 0; ex->stage && i < ex->graph->n; i++)
        free(ex->stage[i]);
    free(ex->stage);
    free(ex->req);
    free(ex->post_t);
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
    /* the mpi comm moves host memory: with a device backend every collective goes through host copies
     * (DG_TEST_FORCE_STAGING=1 takes that path on the cpu backend too, for the tests). The nccl comm
     * moves device memory on its own stream: device-side waits, no staging. DG_TEST_STREAM_WAITS=1 runs
     * the device-wait bookkeeping with the mpi comm on the cpu backend (begin_after is then a no-op and
     * stream_wait a host wait), so the CPU tests cover that path's order of operations. */
    int force = dg_env_bool("DG_TEST_FORCE_STAGING"), sw = dg_env_bool("DG_TEST_STREAM_WAITS");
    int staged = 0, dev = 0;
    if (dg_comm_kind(c) == DG_COMM_NCCL) {
        ex->cstream = compute_stream(ex);
        if (!ex->cstream)
            return DG_ERR(DG_ERR_USAGE,
                          "executor: the %s comm '%s' is nccl (device memory, CUDA streams) but the compute "
                          "backend is %s; hint: parallel.backend=cuda, or parallel.comm=mpi",
                          dg_mesh_dim_name(dim), dg_comm_name(c), ex->be->ops->name);
        dev = 1;
    } else if (strcmp(ex->be->ops->name, "cpu") != 0 || force) {
        staged = 1;
    } else if (sw) {
        dev = 1;
    }
    if ((staged && ex->dev_waits) || (dev && ex->staged))
        return DG_ERR(DG_ERR_USAGE,
                      "executor: the %s comm '%s' (%s) cannot be mixed with the other dimensions' comms "
                      "(host staging and device-side waits in one executor); give every dimension the same "
                      "comm backend",
                      dg_mesh_dim_name(dim), dg_comm_name(c), dg_comm_backend_name(c));
    ex->staged |= staged;
    ex->dev_waits |= dev;
    ex->comm[dim] = c;
    return DG_OK;
}

/* Host staging buffer of node n (kept for the next runs). */
static char *stage_buf(dg_exec_t *ex, const dg_node_t *n, size_t bytes) {
    if (!ex->stage) ex->stage = dg_xcalloc((size_t)ex->graph->n + 1, sizeof *ex->stage);
    if (!ex->stage[n->id]) ex->stage[n->id] = dg_xmalloc(bytes ? bytes : 1);
    return ex->stage[n->id];
}

/* dst (device, f32) += src (host, f32), n elements: the sharded gradient accumulate on the staged path,
 * where the backend's accumulate (activation dtype) may not be f32. Deterministic. */
static dg_status_t acc_f32_from_host(dg_exec_t *ex, float *dst_dev, const float *src_host, size_t n,
                                     float *tmp) {
    DG_TRY(ex->be->ops->to_host(ex->be, tmp, dst_dev, n * sizeof(float)));
    for (size_t i = 0; i < n; i++)
        tmp[i] += src_host[i];
    return ex->be->ops->to_device(ex->be, dst_dev, tmp, n * sizeof(float));
}

static size_t count_of(const dg_node_t *n) { /* elements an in-place all-reduce covers */
    return n->attr[DG_A_COUNT] ? (size_t)n->attr[DG_A_COUNT] : dg_node_numel(n->upd[0]);
}

/* Completes the request of n: the host waits for it, or (device-side waits) the compute stream does.
 * Then the reduce-scatter's accumulate into the persistent f32 shard (on the compute stream, after the
 * wait) and, when staging, the copy of the result back to the device. */
static dg_status_t finish(dg_exec_t *ex, const dg_node_t *n, struct dg_comm_req *req, dg_comm_t *c) {
    dg_backend_t *be = ex->be;
    if (ex->dev_waits)
        DG_TRY(dg_comm_stream_wait(c, req, ex->cstream));
    else
        DG_TRY(dg_comm_wait(c, req));
    int r = dg_comm_rank(c), k = dg_comm_size(c);
    if (n->op == DG_OP_REDUCE_SCATTER && n->attr[DG_A_ACC]) {
        size_t S = dg_node_numel(n->upd[0]);
        if (ex->staged) {
            float *h = (float *)stage_buf(ex, n, 0); /* [k * S] send/result, then [S] scratch */
            return acc_f32_from_host(ex, dg_exec_ptr(ex, n->upd[0]), h + (size_t)r * S, S, h + (size_t)k * S);
        }
        /* the gradient buckets are f32 whatever the act dtype: add_f32, not accumulate */
        char *blk = (char *)dg_exec_ptr(ex, n->src[0]) + (size_t)r * S * sizeof(float);
        return be->ops->add_f32(be, dg_exec_ptr(ex, n->upd[0]), (const float *)blk, S);
    }
    if (ex->dev_waits) return DG_OK;
    if (!ex->staged) return DG_OK;
    char *h = stage_buf(ex, n, 0);
    if (n->op == DG_OP_ALL_REDUCE && n->n_src == 0)
        return be->ops->to_device(be, dg_exec_ptr(ex, n->upd[0]), h,
                                  count_of(n) * dg_dtype_size(n->upd[0]->dtype));
    if (n->op == DG_OP_REDUCE_SCATTER) h += n->src[0]->nbytes; /* the result follows the send copy */
    return be->ops->to_device(be, dg_exec_ptr(ex, n), h, n->nbytes);
}

static dg_comm_t *comm_of(const dg_exec_t *ex, const dg_node_t *n) {
    return ex->comm[n->attr[DG_A_MESHDIM]];
}

/* The data-parallel gradient reductions: the backward's reduce-scatters and the dp_replicate all-reduces. */
static int is_grad_coll(const dg_node_t *n) {
    return (n->op == DG_OP_REDUCE_SCATTER && n->phase == DG_PHASE_BWD) || (n->flags & DG_NF_GRAD_SYNC);
}

/* Gradient-sync accounting: a reduction posted at t opens an interval when none is in flight (closing
 * the previous one); its wait's return at t extends the interval's end. */
static void gs_posted(dg_exec_t *ex, double t) {
    if (ex->gs_pending == 0) {
        if (ex->gs_start > 0) ex->gs_total += ex->gs_end - ex->gs_start;
        ex->gs_start = ex->gs_end = t;
    }
    ex->gs_pending++;
}

static void gs_done(dg_exec_t *ex, double t) {
    if (ex->gs_pending > 0) ex->gs_pending--;
    if (t > ex->gs_end) ex->gs_end = t;
}

/* Posts n's collective on c: on device memory directly, or through host copies when staging (the
 * send data is copied to the host now; finish() copies the result back). */
static dg_status_t post(dg_exec_t *ex, const dg_node_t *n, dg_comm_t *c, struct dg_comm_req **req) {
    dg_backend_t *be = ex->be;
    int r = dg_comm_rank(c), k = dg_comm_size(c), st = ex->staged;
    /* device-side: the collective starts after the compute work queued so far (its inputs) */
    if (ex->dev_waits) DG_TRY(dg_comm_begin_after(c, ex->cstream));
    if (n->op == DG_OP_ALL_GATHER) {
        size_t cnt = dg_node_numel(n->src[0]), blk = n->src[0]->nbytes;
        if (!st)
            return dg_comm_iallgather(c, dg_exec_ptr(ex, n->src[0]), dg_exec_ptr(ex, n), cnt, n->dtype, req);
        char *h = stage_buf(ex, n, n->nbytes); /* in place: this rank's block already where it belongs */
        DG_TRY(be->ops->to_host(be, h + (size_t)r * blk, dg_exec_ptr(ex, n->src[0]), blk));
        return dg_comm_iallgather(c, h + (size_t)r * blk, h, cnt, n->dtype, req);
    }
    if (n->op == DG_OP_REDUCE_SCATTER && n->attr[DG_A_ACC]) {
        size_t S = dg_node_numel(n->upd[0]);
        char *send = dg_exec_ptr(ex, n->src[0]);
        if (st) {
            send = stage_buf(ex, n, ((size_t)k + 1) * S * sizeof(float));
            DG_TRY(be->ops->to_host(be, send, dg_exec_ptr(ex, n->src[0]), (size_t)k * S * sizeof(float)));
        }
        /* in place: the sum lands on this rank's block of the send buffer */
        return dg_comm_ireduce_scatter(c, send, send + (size_t)r * S * sizeof(float), S, DG_F32, DG_RED_SUM,
                                       req);
    }
    if (n->op == DG_OP_REDUCE_SCATTER) {
        if (!st)
            return dg_comm_ireduce_scatter(c, dg_exec_ptr(ex, n->src[0]), dg_exec_ptr(ex, n),
                                           dg_node_numel(n), n->dtype, DG_RED_SUM, req);
        char *h = stage_buf(ex, n, n->src[0]->nbytes + n->nbytes);
        DG_TRY(be->ops->to_host(be, h, dg_exec_ptr(ex, n->src[0]), n->src[0]->nbytes));
        return dg_comm_ireduce_scatter(c, h, h + n->src[0]->nbytes, dg_node_numel(n), n->dtype, DG_RED_SUM,
                                       req);
    }
    DG_ASSERT(n->op == DG_OP_ALL_REDUCE);
    const dg_node_t *t = n->n_src == 0 ? n->upd[0] : n;
    size_t cnt = n->n_src == 0 ? count_of(n) : dg_node_numel(n);
    void *src = dg_exec_ptr(ex, n->n_src == 0 ? n->upd[0] : n->src[0]), *dst = dg_exec_ptr(ex, t);
    if (!st) return dg_comm_iallreduce(c, src, dst, cnt, t->dtype, DG_RED_SUM, req);
    char *h = stage_buf(ex, n, cnt * dg_dtype_size(t->dtype));
    DG_TRY(be->ops->to_host(be, h, src, cnt * dg_dtype_size(t->dtype)));
    return dg_comm_iallreduce(c, h, h, cnt, t->dtype, DG_RED_SUM, req);
}

dg_status_t dg_exec_collective(dg_exec_t *ex, const dg_node_t *n) {
    dg_backend_t *be = ex->be;
    int d = (int)n->attr[DG_A_MESHDIM];
    DG_ASSERT(d >= 0 && d < DG_MESH_NDIM);
    int k = ex->graph->mesh.size[d];
    int acc_rs = n->op == DG_OP_REDUCE_SCATTER && n->attr[DG_A_ACC];
    if (n->op == DG_OP_ALL_REDUCE && n->attr[DG_A_ARMODE] == DG_AR_FROM_REPLICATE)
        return DG_OK; /* identity forward: the output is a view of the input */
    if (k == 1) {     /* every collective over one rank is the identity */
        if (n->op == DG_OP_ALL_REDUCE && n->n_src == 0) return DG_OK;
        if (acc_rs) /* f32 shard += f32 gradient bucket, on the device whatever the act dtype */
            return be->ops->add_f32(be, dg_exec_ptr(ex, n->upd[0]), dg_exec_ptr(ex, n->src[0]),
                                    dg_node_numel(n->upd[0]));
        void *dst = dg_exec_ptr(ex, n), *src = dg_exec_ptr(ex, n->src[0]);
        return dst == src ? DG_OK : be->ops->copy(be, dst, src, n->nbytes);
    }
    dg_comm_t *c = ex->comm[d];
    if (!c)
        return DG_ERR(DG_ERR_RUNTIME,
                      "graph: %s '%s' over mesh dimension %s of size %d needs a comm backend, and none is "
                      "attached to this executor",
                      dg_op_name(n->op), n->name, dg_mesh_dim_name(d), k);
    struct dg_comm_req *req = NULL;
    double tp = dg_now_s();
    DG_TRY(post(ex, n, c, &req));
    if (is_grad_coll(n)) gs_posted(ex, tp);
    ex->n_coll++;
    /* send bytes: what the reduce dtype halves (the gradient reductions: the backward's reduce-scatters
     * and its dp_replicate all-reduces, flagged DG_NF_GRAD_SYNC) */
    uint64_t bytes = n->op == DG_OP_ALL_REDUCE && n->n_src == 0
                         ? (uint64_t)count_of(n) * dg_dtype_size(n->upd[0]->dtype)
                         : (uint64_t)n->src[0]->nbytes;
    ex->coll_bytes[d] += bytes;
    if (is_grad_coll(n)) ex->grad_coll_bytes += bytes;
    if (n->stream == DG_STREAM_COMM) {
        DG_ASSERT(ex->req[n->id] == NULL);
        ex->req[n->id] = req;
        ex->n_pending++;
        if (ex->trace) ex->post_t[n->id] = tp;
        return DG_OK;
    }
    double t0 = dg_now_s();
    dg_status_t st = finish(ex, n, req, c);
    double t1 = dg_now_s();
    ex->blocking_s += t1 - t0;
    if (ex->trace) ex->trace(ex->trace_ctx, n, 1, tp, t1);
    if (is_grad_coll(n)) gs_done(ex, t1);
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
    double t1 = dg_now_s();
    ex->wait_s += t1 - t0;
    if (ex->trace) ex->trace(ex->trace_ctx, w, 1, ex->post_t[w->id], t1);
    if (is_grad_coll(w)) gs_done(ex, t1);
    if (st != DG_OK) return dg_err_prefix(st, "waiting for %s '%s'", dg_op_name(w->op), w->name);
    return DG_OK;
}

void dg_exec_set_trace(dg_exec_t *ex,
                       void (*fn)(void *ctx, const struct dg_node *n, int comm, double t0, double t1),
                       void *ctx) {
    if (fn && !ex->post_t) ex->post_t = dg_xcalloc((size_t)ex->graph->n + 1, sizeof *ex->post_t);
    ex->trace = fn;
    ex->trace_ctx = ctx;
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
    if (ex->ovr_on) { /* a node running on the host: only the tensors copied for it are reachable */
        DG_ASSERTF(ex->ovr[n->id] != NULL,
                   "host fallback: the op reads '%s', which was not copied to the host", n->name);
        return ex->ovr[n->id];
    }
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
    if (ex->eager) {
        DG_ASSERTF(ex->root_ptr[r->id] != NULL,
                   "eager allocation: '%s' is used outside its live range [%d, %d] (not allocated now)",
                   r->name, ex->plan->live_start[r->id], ex->plan->live_end[r->id]);
        return (char *)ex->root_ptr[r->id] + offs;
    }
    return (char *)ex->arena + ex->plan->offset[r->id] + offs;
}

dg_status_t dg_exec_run(dg_exec_t *ex, int first, int end) {
    return dg_exec_run_hook(ex, first, end, -1, NULL, NULL);
}

dg_status_t dg_exec_run_hook(dg_exec_t *ex, int first, int end, int at, dg_exec_hook_t hook, void *ctx) {
    const dg_graph_t *g = ex->graph;
    DG_ASSERTF(dg_plan_matches(ex->plan, g),
               "executor: stale plan (graph generation %llu, plan made at %llu)",
               (unsigned long long)g->generation, (unsigned long long)ex->plan->generation);
    DG_ASSERT(first >= 0 && end <= g->n && first <= end);
    DG_ASSERT(at < 0 || (hook && at >= first && at < end));
    if (ex->eager) eager_begin(ex, first);
    for (int i = first; i < end; i++) {
        const dg_node_t *n = g->nodes[i];
        if (ex->eager) {
            dg_status_t sa = eager_before(ex, i);
            if (sa != DG_OK) return dg_err_prefix(sa, "op #%d %s '%s'", n->id, dg_op_name(n->op), n->name);
        }
        if (!(n->op == DG_OP_LEAF || n->op == DG_OP_SIDE ||
              ((n->flags & DG_NF_GRAD_SYNC) && ex->rt.skip_grad_sync))) {
            double t0 = ex->profile ? dg_now_s() : 0;
            dg_status_t st = DG_OK;
            for (int w = 0; w < n->n_wait && st == DG_OK; w++)
                st = complete(ex, n->wait[w]);
            double tt = ex->trace ? dg_now_s() : 0;
            if (st == DG_OK) st = on_host(ex, n) ? run_on_host(ex, n) : dg_op_def(n->op)->exec(ex, n);
            if (st == DG_OK && ex->trace && !is_collective_kind(n->op)) {
                st = ex->be->ops->sync(ex->be);
                ex->trace(ex->trace_ctx, n, 0, tt, dg_now_s());
            }
            if (st == DG_OK && ex->profile) {
                st = ex->be->ops->sync(ex->be);
                ex->prof_s[n->op] += dg_now_s() - t0;
                ex->prof_n[n->op]++;
            }
            if (st != DG_OK) return dg_err_prefix(st, "op #%d %s '%s'", n->id, dg_op_name(n->op), n->name);
            ex->ops_run++;
            if (dg_op_def(n->op)->kernels[0].name && !dg_op_def(n->op)->is_collective) ex->kernels_run++;
        }
        if (i == at) { /* before eager_after: what node `at` wrote is still allocated */
            dg_status_t sh = hook(ctx);
            if (sh != DG_OK)
                return dg_err_prefix(sh, "after op #%d %s '%s'", n->id, dg_op_name(n->op), n->name);
        }
        if (ex->eager) eager_after(ex, i);
    }
    return dg_exec_drain(ex);
}

dg_status_t dg_exec_run_phase(dg_exec_t *ex, dg_phase_t phase) {
    int first, end;
    dg_graph_phase_range(ex->graph, phase, &first, &end);
    return dg_exec_run(ex, first, end);
}

dg_status_t dg_exec_stage_scalars(dg_exec_t *ex) {
    const dg_runtime_t *rt = &ex->rt;
    if (rt->t < 1)
        return DG_ERR(DG_ERR_USAGE, "executor: AdamW step t = %lld, expected >= 1 (1-based)",
                      (long long)rt->t);
    if (!(rt->beta1 >= 0.0f && rt->beta1 < 1.0f) || !(rt->beta2 >= 0.0f && rt->beta2 < 1.0f))
        return DG_ERR(DG_ERR_USAGE, "executor: AdamW betas (%g, %g) must lie in [0, 1)", (double)rt->beta1,
                      (double)rt->beta2);
    /* bias corrections once per step in double (pow(beta, t) for large t underflows gracefully to 0),
     * the values both backends' adamw compute from t */
    ex->sc_host[DG_DS_LR] = rt->lr;
    ex->sc_host[DG_DS_INV_BC1] = (float)(1.0 / (1.0 - pow((double)rt->beta1, (double)rt->t)));
    ex->sc_host[DG_DS_INV_BC2] = (float)(1.0 / (1.0 - pow((double)rt->beta2, (double)rt->t)));
    dg_exec_stage_segs(ex); /* the frozen set may have changed since the last step */
    return DG_OK;
}

const char *dg_exec_capture_blocker(dg_exec_t *ex, int first, int end) {
    if (!ex->be->ops->graph_begin) {
        snprintf(ex->why, sizeof ex->why, "the %s backend cannot record graphs", ex->be->ops->name);
        return ex->why;
    }
    if (ex->profile || ex->trace) {
        snprintf(ex->why, sizeof ex->why, "per-op %s synchronises after every op",
                 ex->profile ? "profiling" : "tracing");
        return ex->why;
    }
    if (ex->eager) {
        snprintf(ex->why, sizeof ex->why,
                 "the executor allocates each activation on its own (memory fallback: the %zu-byte arena "
                 "could not be allocated), and allocations cannot be recorded",
                 ex->plan->arena_bytes);
        return ex->why;
    }
    for (int i = first; i < end; i++) {
        const dg_node_t *n = ex->graph->nodes[i];
        if (!on_host(ex, n)) continue;
        snprintf(ex->why, sizeof ex->why,
                 "op %s '%s' runs on the host (kernel fallback), with host copies that cannot be recorded",
                 dg_op_name(n->op), n->name);
        return ex->why;
    }
    for (int i = first; i < end; i++) {
        const dg_node_t *n = ex->graph->nodes[i];
        if (n->op != DG_OP_ALL_GATHER && n->op != DG_OP_REDUCE_SCATTER && n->op != DG_OP_ALL_REDUCE) continue;
        int d = (int)n->attr[DG_A_MESHDIM];
        int k = ex->graph->mesh.size[d];
        if (n->op == DG_OP_ALL_REDUCE && n->attr[DG_A_ARMODE] == DG_AR_FROM_REPLICATE) continue;
        /* over one rank a collective is a device copy or add_f32: capturable. Over several, only the
         * nccl comm's: it enqueues on a CUDA stream that begin_after forks into the capture and
         * stream_wait joins back (every request is completed by a stream wait, within the phase). The
         * mpi comm runs on a host thread, with host staging on a device backend: nothing to record. */
        dg_comm_t *c = ex->comm[d];
        if (k > 1 && !(c && dg_comm_kind(c) == DG_COMM_NCCL && ex->dev_waits && ex->cstream)) {
            snprintf(ex->why, sizeof ex->why,
                     "%s '%s' runs over the %s comm backend (group %s), which the executor drives from the "
                     "host",
                     dg_op_name(n->op), n->name, c ? dg_comm_backend_name(c) : "(none)",
                     c ? dg_comm_name(c) : dg_mesh_dim_name(d));
            return ex->why;
        }
    }
    return NULL;
}
