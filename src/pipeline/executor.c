/* executor.c — the pipeline executor (pp_exec.h, docs/parallelism.md "The executor"): this rank's chunk
 * models, the schedule's action list replayed every step (a group's sends and receives posted together
 * as non-blocking operations and completed together, activations on one channel and gradients on the
 * other), activation slots assigned per (chunk, micro-batch), the tied wte's gradient sum, and the
 * optimizer step with the norm summed over the pp line.
 */
#include "pp_exec.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dg_mpi.h"
#include "graph.h" /* dg_err_prefix */

#define MAX_LOCAL 64             /* chunks per rank (parallel.pp_virtual <= 64) */
#define MAX_GROUP 16             /* operations of one group (1F1B: 2, interleaved: 4) */
#define MAX_PEND (4 * MAX_GROUP) /* messages in flight (overlap: two groups of sends and two of receives) */

typedef struct {
    const dg_pp_action_t *a;
    void *dev;  /* the device buffer sent or received into */
    void *host; /* its staging copy (staged only) */
    dg_comm_req_t *req;
    int k, s;  /* overlap: the local chunk and slot whose buffer it reads (send) or fills (receive) */
    int group; /* overlap: the index of the group that posted it (sends are waited two groups later) */
} msg_t;

struct dg_pp_exec {
    dg_pp_exec_opts_t o;
    dg_pp_split_t split;
    dg_pp_schedule_t sched;
    int n_local;
    dg_model_t *model[MAX_LOCAL];
    int *slot_of[MAX_LOCAL]; /* per local chunk and micro-batch: its slot, -1 when none */
    unsigned char *busy[MAX_LOCAL];
    int n_slots[MAX_LOCAL];
    int bwd_done[MAX_LOCAL];
    MPI_Comm line; /* the pp line, for host scalars (rank = stage) */
    int staged;    /* device memory over the mpi comm: messages go through host buffers */
    size_t act_bytes;
    int overlap;          /* messages in flight across compute (the mpi comm; see "overlap" below) */
    void *host[MAX_PEND]; /* staging buffers, act_bytes each, made on first need */
    unsigned char host_busy[MAX_PEND];
    int n_host;
    msg_t pend[MAX_PEND]; /* overlap: messages in flight, in posting order */
    int n_pend, group_no;
    unsigned char *posted; /* per action of this rank: its message has been posted this step */
    double compute_s, wall_s;
    int overlapped; /* compute actions of the last step that began with a message in flight */
};

static int local_of(const dg_pp_exec_t *e, int chunk) {
    return chunk / e->o.pp;
}

/* ---------------- slots ---------------- */

/* The slot of (local chunk k, mb), taken from the free ones when it has none yet. dry: only counting
 * (e->n_slots grows to what the schedule needs). */
static int slot_take(dg_pp_exec_t *e, int k, int mb, int dry) {
    if (e->slot_of[k][mb] >= 0) return e->slot_of[k][mb];
    int s = 0;
    while (s < e->n_slots[k] && e->busy[k][s])
        s++;
    if (s == e->n_slots[k]) {
        DG_ASSERT(dry);
        e->n_slots[k]++;
    }
    e->busy[k][s] = 1;
    e->slot_of[k][mb] = s;
    return s;
}

static void slot_give(dg_pp_exec_t *e, int k, int mb) {
    int s = e->slot_of[k][mb];
    if (s < 0) return;
    e->busy[k][s] = 0;
    e->slot_of[k][mb] = -1;
}

static void slots_reset(dg_pp_exec_t *e) {
    for (int k = 0; k < e->n_local; k++) {
        for (int mb = 0; mb < e->o.m; mb++)
            e->slot_of[k][mb] = -1;
        memset(e->busy[k], 0, (size_t)e->o.m);
        e->bwd_done[k] = 0;
    }
}

/* ---------------- messages ---------------- */

static dg_comm_t *channel(const dg_pp_exec_t *e, int op) {
    return op == DG_PP_SEND_ACT || op == DG_PP_RECV_ACT ? e->o.act : e->o.grad;
}

static int is_send(int op) {
    return op == DG_PP_SEND_ACT || op == DG_PP_SEND_GRAD;
}

/* A staging buffer of act_bytes from the pool (made on first need, kept for the executor's life). */
static dg_status_t host_take(dg_pp_exec_t *e, void **out) {
    int i = 0;
    while (i < e->n_host && e->host_busy[i])
        i++;
    if (i == MAX_PEND) return DG_ERR(DG_ERR_RUNTIME, "pipeline: more than %d messages in flight", MAX_PEND);
    if (i == e->n_host) {
        DG_TRY(e->o.be->ops->host_alloc(e->o.be, e->act_bytes, &e->host[i]));
        e->n_host++;
    }
    e->host_busy[i] = 1;
    *out = e->host[i];
    return DG_OK;
}

static void host_give(dg_pp_exec_t *e, void *h) {
    for (int i = 0; h && i < e->n_host; i++)
        if (e->host[i] == h) e->host_busy[i] = 0;
}

/* The buffer of one message action in its slot s of local chunk k. */
static void *msg_buffer(dg_pp_exec_t *e, int op, int k, int s) {
    dg_model_t *mk = e->model[k];
    return op == DG_PP_SEND_ACT    ? dg_model_stage_output(mk, s)
           : op == DG_PP_RECV_ACT  ? dg_model_stage_input(mk, s)
           : op == DG_PP_SEND_GRAD ? dg_model_stage_input_grad(mk, s)
                                   : dg_model_stage_seed(mk, s);
}

/* A staged receive's host copy onto the device. The staging buffers are pinned, so the backend's copy is
 * asynchronous: it is waited for here, before the caller gives the buffer back to the pool, where the next
 * receive posted into it could overwrite the bytes the copy has not read yet (seen on the GPU as
 * interleaved runs drifting from the 1-rank run: tests/pipeline, gpu_pipeline_*). */
static dg_status_t staged_to_device(dg_backend_t *be, void *dev, const void *host, size_t bytes) {
    DG_TRY(be->ops->to_device(be, dev, host, bytes));
    return be->ops->sync(be);
}

/* Starts one message (a send's data is final on the device: every compute action ends in a sync). */
static dg_status_t msg_post(dg_pp_exec_t *e, msg_t *g) {
    dg_backend_t *be = e->o.be;
    const dg_pp_action_t *a = g->a;
    int send = is_send(a->op);
    void *buf = g->dev;
    g->req = NULL;
    g->host = NULL;
    if (e->staged) {
        DG_TRY(host_take(e, &g->host));
        if (send) DG_TRY(be->ops->to_host(be, g->host, g->dev, e->act_bytes));
        buf = g->host;
    }
    if (send) return dg_comm_isend(channel(e, a->op), buf, e->act_bytes / 2, DG_U16, a->peer, 0, &g->req);
    return dg_comm_irecv(channel(e, a->op), buf, e->act_bytes / 2, DG_U16, a->peer, 0, &g->req);
}

/* Completes a posted message (a staged receive is copied to the device) and gives its staging buffer
 * back. */
static dg_status_t msg_complete(dg_pp_exec_t *e, msg_t *g) {
    const dg_pp_action_t *a = g->a;
    dg_status_t st = g->req ? dg_comm_wait(channel(e, a->op), g->req) : DG_OK;
    g->req = NULL;
    if (st != DG_OK)
        st = dg_err_prefix(st, "pipeline: %s of micro-batch %d, chunk %d with stage %d", dg_pp_op_name(a->op),
                           a->mb, a->chunk, a->peer);
    if (st == DG_OK && e->staged && !is_send(a->op))
        st = staged_to_device(e->o.be, g->dev, g->host, e->act_bytes);
    host_give(e, g->host);
    g->host = NULL;
    return st;
}

/* Without overlap (NCCL, or opts.no_overlap): posts the group's operations, then completes them in
 * posting order. */
static dg_status_t run_group(dg_pp_exec_t *e, msg_t *g, int n) {
    dg_status_t st = DG_OK;
    int posted = 0;
#ifdef DG_HAVE_CUDA
    if (!e->staged && dg_comm_kind(e->o.act) == DG_COMM_NCCL) {
        void *cs = dg_backend_cuda_stream(e->o.be);
        DG_TRY(dg_comm_begin_after(e->o.act, cs));
        DG_TRY(dg_comm_begin_after(e->o.grad, cs));
    }
#endif
    for (int i = 0; i < n && st == DG_OK; i++) {
        st = msg_post(e, &g[i]);
        if (st == DG_OK) posted = i + 1;
    }
    for (int i = 0; i < posted; i++) {
        dg_status_t sw = msg_complete(e, &g[i]);
        if (st == DG_OK) st = sw;
    }
    for (int i = posted; i < n; i++) /* a failed post may hold a staging buffer */
        host_give(e, g[i].host);
    return st;
}

/* ---------------- overlap: messages in flight across compute ---------------- */

/* The messages in flight, in posting order. A send stays in flight while compute goes on; it is completed
 * before the next compute action on the slot whose buffer it reads (that compute may overwrite the
 * buffer), two groups after the one that posted it at the latest (so that few are in flight), and at the
 * end of the step. A receive is posted one group ahead where its slot is known (the next group's
 * receives are posted before the compute between the two groups), and completed in its own group. The
 * order of the posts on each channel and peer is the schedule's, so every message meets the same
 * partner as without overlap, and the numbers are the same bits. */
static dg_status_t pend_push(dg_pp_exec_t *e, const msg_t *g) {
    if (e->n_pend == MAX_PEND)
        return DG_ERR(DG_ERR_RUNTIME, "pipeline: more than %d messages in flight", MAX_PEND);
    e->pend[e->n_pend++] = *g;
    return DG_OK;
}

/* Completes (in posting order) the messages in flight that `match` selects, and drops them from the list.
 * kind: 0 sends reading slot (k, s); 1 sends of groups <= group; 2 receives of action indices [lo, hi);
 * 3 every message. Every selected message is completed even after a failure; the first failure returns. */
enum { PEND_SLOT, PEND_OLD, PEND_RECV, PEND_ALL };

static int pend_match(const dg_pp_exec_t *e, const msg_t *g, int kind, int x, int y) {
    int send = is_send(g->a->op);
    long idx = g->a - e->sched.act[e->o.stage];
    switch (kind) {
    case PEND_SLOT:
        return send && g->k == x && g->s == y;
    case PEND_OLD:
        return send && g->group <= x;
    case PEND_RECV:
        return !send && idx >= x && idx < y;
    default:
        return 1;
    }
}

static dg_status_t pend_complete(dg_pp_exec_t *e, int kind, int x, int y) {
    dg_status_t st = DG_OK;
    int keep = 0;
    for (int i = 0; i < e->n_pend; i++) {
        if (!pend_match(e, &e->pend[i], kind, x, y)) {
            e->pend[keep++] = e->pend[i];
            continue;
        }
        dg_status_t sw = msg_complete(e, &e->pend[i]);
        if (st == DG_OK) st = sw;
    }
    e->n_pend = keep;
    return st;
}

/* The message of action `idx` in its slot: a receive of an activation takes the (k, mb) slot; every other
 * message uses the slot the micro-batch already has (-1: not yet). */
static int msg_slot(dg_pp_exec_t *e, const dg_pp_action_t *b, int dry, int may_take) {
    int kb = local_of(e, b->chunk);
    if (b->op == DG_PP_RECV_ACT && may_take) return slot_take(e, kb, b->mb, dry);
    return e->slot_of[kb][b->mb];
}

/* Posts the receives of the group starting at action j (if any) whose slots are known now, marking them
 * posted. dry: the slots only. */
static dg_status_t prefetch(dg_pp_exec_t *e, int j, int dry) {
    const int stage = e->o.stage, n = e->sched.n[stage];
    const dg_pp_action_t *act = e->sched.act[stage];
    while (j < n && (act[j].op == DG_PP_FWD || act[j].op == DG_PP_BWD))
        j++;
    for (int q = j; q < n && act[q].op != DG_PP_FWD && act[q].op != DG_PP_BWD && act[q].group == act[j].group;
         q++) {
        const dg_pp_action_t *b = &act[q];
        if (is_send(b->op) || e->posted[q]) continue;
        int s = msg_slot(e, b, dry, 1);
        if (s < 0) continue; /* its forward has not run yet: posted in its own group */
        e->posted[q] = 1;
        if (dry) continue;
        msg_t g = {.a = b, .k = local_of(e, b->chunk), .s = s, .group = e->group_no + 1};
        g.dev = msg_buffer(e, b->op, g.k, s);
        DG_ASSERT(g.dev);
        dg_status_t st = msg_post(e, &g);
        if (st == DG_OK) st = pend_push(e, &g);
        if (st != DG_OK) {
            if (g.req) (void)dg_comm_wait(channel(e, b->op), g.req);
            host_give(e, g.host);
            return st;
        }
    }
    return DG_OK;
}

/* The group of actions [i, j) with overlap: sends of two groups ago completed, this group's remaining
 * operations posted, its receives completed, the next group's receives posted. */
static dg_status_t overlap_group(dg_pp_exec_t *e, int i, int j, int dry) {
    const dg_pp_action_t *act = e->sched.act[e->o.stage];
    dg_status_t st = dry ? DG_OK : pend_complete(e, PEND_OLD, e->group_no - 2, 0);
    for (int q = i; q < j && st == DG_OK; q++) {
        const dg_pp_action_t *b = &act[q];
        if (e->posted[q]) continue;
        int s = msg_slot(e, b, dry, 1);
        DG_ASSERT(s >= 0);
        e->posted[q] = 1;
        if (dry) continue;
        msg_t g = {.a = b, .k = local_of(e, b->chunk), .s = s, .group = e->group_no};
        g.dev = msg_buffer(e, b->op, g.k, s);
        DG_ASSERT(g.dev);
        st = msg_post(e, &g);
        if (st == DG_OK && is_send(b->op)) dg_comm_wait_started(channel(e, b->op), g.req);
        if (st == DG_OK) st = pend_push(e, &g);
        if (st != DG_OK && g.req) (void)dg_comm_wait(channel(e, b->op), g.req);
        if (st != DG_OK) host_give(e, g.host);
    }
    if (!dry) {
        dg_status_t sw = pend_complete(e, PEND_RECV, i, j);
        if (st == DG_OK) st = sw;
    }
    if (st == DG_OK) st = prefetch(e, j, dry);
    e->group_no++;
    return st;
}

/* ---------------- the replay ---------------- */

/* Replays this rank's action list once. dry: slots only (no compute, no messages), to size them. */
static dg_status_t replay(dg_pp_exec_t *e, const int32_t *tok, const int32_t *tgt, float dloss, int dry,
                          double *loss_sum) {
    const int stage = e->o.stage, n = e->sched.n[stage];
    const dg_pp_action_t *act = e->sched.act[stage];
    const size_t per = (size_t)e->o.micro_batch * (size_t)e->o.desc->seq_len;
    const int last_chunk = e->split.n_chunks - 1;
    slots_reset(e);
    memset(e->posted, 0, (size_t)n);
    e->group_no = 0;
    e->n_pend = 0;
    e->overlapped = 0;
    dg_status_t st = DG_OK;
    for (int i = 0; i < n && st == DG_OK;) {
        const dg_pp_action_t *a = &act[i];
        int k = local_of(e, a->chunk);
        if (!dry && e->o.on_action)
            e->o.on_action(e->o.on_action_ctx, a->op == DG_PP_FWD   ? "pipeline forward"
                                               : a->op == DG_PP_BWD ? "pipeline backward"
                                                                    : "pipeline send/recv");
        if (a->op == DG_PP_FWD) {
            int s = slot_take(e, k, a->mb, dry);
            if (!dry) {
                float l = 0;
                if (e->overlap) st = pend_complete(e, PEND_SLOT, k, s);
                e->overlapped += e->n_pend > 0;
                double t0 = dg_now_s();
                if (st == DG_OK)
                    st = dg_model_stage_forward(e->model[k], s, tok + (size_t)a->mb * per,
                                                tgt + (size_t)a->mb * per, dloss, 0,
                                                a->chunk == last_chunk ? &l : NULL);
                e->compute_s += dg_now_s() - t0;
                if (a->chunk == last_chunk) *loss_sum += l;
            }
            i++;
            continue;
        }
        if (a->op == DG_PP_BWD) {
            int s = e->slot_of[k][a->mb];
            DG_ASSERT(s >= 0);
            int sync = ++e->bwd_done[k] == e->o.m; /* this chunk's last backward of the step */
            if (!dry) {
                if (e->overlap) st = pend_complete(e, PEND_SLOT, k, s);
                e->overlapped += e->n_pend > 0;
                double t0 = dg_now_s();
                if (st == DG_OK) st = dg_model_stage_backward(e->model[k], s, sync);
                e->compute_s += dg_now_s() - t0;
            }
            if (a->chunk == 0) slot_give(e, k, a->mb); /* nothing to send: free at once */
            i++;
            continue;
        }
        /* a group of sends and receives */
        int j = i;
        while (j < n && act[j].op != DG_PP_FWD && act[j].op != DG_PP_BWD && act[j].group == a->group)
            j++;
        DG_ASSERT(j - i <= MAX_GROUP);
        if (e->overlap) {
            st = overlap_group(e, i, j, dry);
        } else {
            msg_t g[MAX_GROUP];
            for (int q = i; q < j; q++) {
                const dg_pp_action_t *b = &act[q];
                int s = msg_slot(e, b, dry, 1);
                DG_ASSERT(s >= 0);
                g[q - i] = (msg_t){.a = b, .k = local_of(e, b->chunk), .s = s};
                g[q - i].dev = msg_buffer(e, b->op, g[q - i].k, s);
                DG_ASSERT(dry || g[q - i].dev);
            }
            if (!dry) st = run_group(e, g, j - i);
        }
        for (int q = i; q < j; q++) /* a slot whose input gradient went out is free again */
            if (act[q].op == DG_PP_SEND_GRAD) slot_give(e, local_of(e, act[q].chunk), act[q].mb);
        i = j;
    }
    if (!dry) { /* nothing stays in flight past the step (after a failure too) */
        dg_status_t sw = pend_complete(e, PEND_ALL, 0, 0);
        if (st == DG_OK) st = sw;
    }
    return st;
}

/* ---------------- create / free ---------------- */

dg_pp_exec_opts_t dg_pp_exec_opts_for(const dg_model_desc_t *d, dg_backend_t *be, int micro_batch,
                                      uint64_t seed, const dg_model_parallel_t *par, dg_comm_t *act,
                                      dg_comm_t *grad, MPI_Comm world) {
    int rank = 0;
    MPI_Comm_rank(world, &rank);
    dg_pp_exec_opts_t o = {.kind = DG_PP_1F1B, .virt = 1, .desc = d, .be = be, .micro_batch = micro_batch};
    o.pp = dg_mesh_pp(&par->mesh);
    o.stage = dg_mesh_stage(&par->mesh, rank);
    o.m = o.pp;
    o.seed = seed;
    o.par = *par;
    o.act = act;
    o.grad = grad;
    o.world = world;
    return o;
}

dg_status_t dg_pp_exec_create(const dg_pp_exec_opts_t *o, dg_pp_exec_t **out) {
    *out = NULL;
    if (o->pp < 2 || o->stage < 0 || o->stage >= o->pp || !o->act || !o->grad)
        return DG_ERR(DG_ERR_USAGE, "pipeline: %d stages, stage %d, channels %s", o->pp, o->stage,
                      o->act && o->grad ? "given" : "missing");
    if (o->virt > MAX_LOCAL)
        return DG_ERR(DG_ERR_USAGE, "pipeline: %d chunks per rank (at most %d)", o->virt, MAX_LOCAL);
    dg_pp_exec_t *e = dg_xcalloc(1, sizeof *e);
    e->o = *o;
    e->line = MPI_COMM_NULL;
    const dg_model_desc_t *d = o->desc;
    const int tp = o->par.mesh.size[DG_MESH_TP], S = o->par.mesh.size[DG_MESH_DP_SHARD];
    dg_pp_model_t pm = {.n_layer = d->n_layer,
                        .n_head = d->n_head,
                        .d_model = d->d_model,
                        .seq_len = d->seq_len,
                        .vocab = d->padded_vocab,
                        .micro_batch = o->micro_batch,
                        .act_bytes = 4, /* the split balances FLOPs; activation bytes only bound memory */
                        .tp = tp,
                        .state_bytes_per_param = 16.0 / S};
    dg_status_t st = dg_pp_split(&pm, o->kind, o->pp, o->virt, o->mem_budget, &e->split);
    if (st == DG_OK) st = dg_pp_schedule_build(o->kind, o->pp, o->virt, o->m, &e->sched);
    if (st == DG_OK) st = dg_pp_validate(&e->sched);
    if (st == DG_OK) {
        int rank = 0;
        MPI_Comm_rank(o->world, &rank);
        int W = dg_mesh_stage_world(&o->par.mesh);
        if (MPI_Comm_split(o->world, rank % W, o->stage, &e->line) != MPI_SUCCESS)
            st = DG_ERR(DG_ERR_RUNTIME, "pipeline: splitting the pp line's communicator failed");
    }
    e->n_local = o->virt;
    for (int k = 0; k < e->n_local && st == DG_OK; k++) {
        int c = o->stage + k * o->pp;
        dg_model_parallel_t par = o->par;
        par.pp_first_unit = e->split.first_unit[c];
        par.pp_n_units = e->split.n_units[c];
        st = dg_model_create_parallel(d, o->be, o->micro_batch, o->seed, o->flags, &par, &e->model[k]);
        e->slot_of[k] = dg_xmalloc((size_t)o->m * sizeof(int));
        e->busy[k] = dg_xcalloc((size_t)o->m, 1);
    }
    if (st == DG_OK) {
        e->act_bytes = dg_model_stage_act_bytes(e->model[0]);
        e->staged = strcmp(o->be->ops->name, "cpu") != 0 && dg_comm_kind(o->act) == DG_COMM_MPI;
        /* nccl holds point-to-point back until the next wait anyway and runs it on the comm stream */
        e->overlap = !o->no_overlap && dg_comm_kind(o->act) == DG_COMM_MPI;
        e->posted = dg_xcalloc((size_t)e->sched.n[o->stage] + 1, 1);
        double dummy = 0;
        st = replay(e, NULL, NULL, 0, 1, &dummy); /* sizes the slots */
    }
    for (int k = 0; k < e->n_local && st == DG_OK; k++)
        st = dg_model_stage_slots(e->model[k], e->n_slots[k]);
    if (st == DG_OK && o->stage == 0) {
        char buf[256] = "";
        size_t len = 0;
        for (int c = 0; c < e->split.n_chunks && len < sizeof buf; c++)
            len += (size_t)snprintf(buf + len, sizeof buf - len, "%s[%d,%d)", c ? " " : "",
                                    e->split.first_unit[c], e->split.first_unit[c] + e->split.n_units[c]);
        DG_LOG_INFO("pipeline: %s, %d stages x %d chunks, %d micro-batches; chunk units %s; stage 0 keeps "
                    "%d activation slot(s)",
                    dg_pp_kind_name(o->kind), o->pp, o->virt, o->m, buf, e->n_slots[0]);
    }
    if (st != DG_OK) {
        dg_pp_exec_free(e);
        return st;
    }
    *out = e;
    return DG_OK;
}

void dg_pp_exec_free(dg_pp_exec_t *e) {
    if (!e) return;
    for (int k = 0; k < e->n_local; k++) {
        dg_model_free(e->model[k]);
        free(e->slot_of[k]);
        free(e->busy[k]);
    }
    for (int i = 0; i < e->n_host; i++)
        e->o.be->ops->host_free(e->o.be, e->host[i]);
    free(e->posted);
    if (e->line != MPI_COMM_NULL) MPI_Comm_free(&e->line);
    dg_pp_schedule_free(&e->sched);
    free(e);
}

int dg_pp_exec_n_models(const dg_pp_exec_t *e) {
    return e->n_local;
}

dg_model_t *dg_pp_exec_model(dg_pp_exec_t *e, int k) {
    return k >= 0 && k < e->n_local ? e->model[k] : NULL;
}

size_t dg_pp_exec_planned_bytes(const dg_pp_exec_t *e) {
    size_t total = 0;
    for (int k = 0; k < e->n_local; k++)
        total += dg_model_stage_planned_bytes(e->model[k]);
    const int pp = e->o.pp, stage = e->o.stage;
    if (stage == 0 || stage == pp - 1) { /* tied_sum's device temporary */
        const dg_model_t *m = e->model[stage == 0 ? 0 : e->n_local - 1];
        int i = dg_model_find_param(m, "wte");
        if (i >= 0) total += dg_model_local_numel(m, i) * sizeof(float);
    }
    return total;
}

int dg_pp_exec_has_loss(const dg_pp_exec_t *e) {
    return e->o.stage == e->o.pp - 1;
}

const dg_pp_split_t *dg_pp_exec_split(const dg_pp_exec_t *e) {
    return &e->split;
}

const dg_pp_schedule_t *dg_pp_exec_schedule(const dg_pp_exec_t *e) {
    return &e->sched;
}

void dg_pp_exec_times(const dg_pp_exec_t *e, double *compute_s, double *wall_s) {
    if (compute_s) *compute_s = e->compute_s;
    if (wall_s) *wall_s = e->wall_s;
}

int dg_pp_exec_overlapped(const dg_pp_exec_t *e) {
    return e->overlapped;
}

/* ---------------- running ---------------- */

void dg_pp_exec_set_step(dg_pp_exec_t *e, int64_t step) {
    for (int k = 0; k < e->n_local; k++)
        dg_model_set_step(e->model[k], step);
    dg_comm_set_step(e->o.act, step);
    dg_comm_set_step(e->o.grad, step);
}

dg_status_t dg_pp_exec_zero_grad(dg_pp_exec_t *e) {
    for (int k = 0; k < e->n_local; k++)
        DG_TRY(dg_model_zero_grad(e->model[k]));
    return DG_OK;
}

dg_status_t dg_pp_exec_step(dg_pp_exec_t *e, const int32_t *tokens, const int32_t *targets, float dloss,
                            double *loss_sum) {
    *loss_sum = 0;
    e->compute_s = 0;
    double t0 = dg_now_s();
    dg_status_t st = replay(e, tokens, targets, dloss, 0, loss_sum);
    e->wall_s = dg_now_s() - t0;
    return st;
}

/* One blocking message of the evaluation chain (staged through host memory where needed). */
static dg_status_t chain_msg(dg_pp_exec_t *e, int send, void *dev, int peer) {
    dg_backend_t *be = e->o.be;
    void *h = NULL;
    if (e->staged) DG_TRY(host_take(e, &h));
    void *buf = e->staged ? h : dev;
    dg_status_t st = DG_OK;
#ifdef DG_HAVE_CUDA
    if (!e->staged && dg_comm_kind(e->o.act) == DG_COMM_NCCL)
        st = dg_comm_begin_after(e->o.act, dg_backend_cuda_stream(be));
#endif
    if (st == DG_OK && send) {
        if (e->staged) st = be->ops->to_host(be, buf, dev, e->act_bytes);
        if (st == DG_OK) st = dg_comm_send(e->o.act, buf, e->act_bytes / 2, DG_U16, peer, 0);
    } else if (st == DG_OK) {
        st = dg_comm_recv(e->o.act, buf, e->act_bytes / 2, DG_U16, peer, 0);
        if (st == DG_OK && e->staged) st = staged_to_device(be, dev, buf, e->act_bytes);
    }
    host_give(e, h);
    return st;
}

dg_status_t dg_pp_exec_forward(dg_pp_exec_t *e, const int32_t *tokens, const int32_t *targets, float *loss) {
    *loss = 0;
    const int C = e->split.n_chunks, pp = e->o.pp;
    for (int c = 0; c < C; c++) {
        if (c % pp != e->o.stage) continue;
        dg_model_t *m = e->model[local_of(e, c)];
        if (c > 0) DG_TRY(chain_msg(e, 0, dg_model_stage_input(m, 0), (c - 1) % pp));
        DG_TRY(dg_model_stage_forward(m, 0, tokens, targets, 1.0f, 1, c == C - 1 ? loss : NULL));
        if (c < C - 1) DG_TRY(chain_msg(e, 1, dg_model_stage_output(m, 0), (c + 1) % pp));
    }
    return DG_OK;
}

/* The tied embedding: stage 0's wte gradient and the last stage's (its head's copy) summed on both, so
 * that both copies take the same update (a + b on one side, b + a on the other: the same bits). */
static dg_status_t tied_sum(dg_pp_exec_t *e) {
    const int pp = e->o.pp, stage = e->o.stage;
    if (stage != 0 && stage != pp - 1) return DG_OK;
    dg_model_t *m = e->model[stage == 0 ? 0 : e->n_local - 1];
    int i = dg_model_find_param(m, "wte");
    if (i < 0) return DG_ERR(DG_ERR_RUNTIME, "pipeline: stage %d holds no wte", stage);
    size_t n = dg_model_local_numel(m, i), bytes = n * sizeof(float);
    if (!n) return DG_OK;
    dg_backend_t *be = e->o.be;
    float *g = dg_model_grad_dev(m, i);
    void *tmp = NULL, *hs = NULL, *hr = NULL;
    DG_TRY(be->ops->alloc(be, bytes, &tmp));
    dg_status_t st = DG_OK;
    int peer = stage == 0 ? pp - 1 : 0;
    if (e->staged) {
        st = be->ops->host_alloc(be, bytes, &hs);
        if (st == DG_OK) st = be->ops->host_alloc(be, bytes, &hr);
        if (st == DG_OK) st = be->ops->to_host(be, hs, g, bytes);
    }
#ifdef DG_HAVE_CUDA
    if (st == DG_OK && !e->staged && dg_comm_kind(e->o.grad) == DG_COMM_NCCL)
        st = dg_comm_begin_after(e->o.grad, dg_backend_cuda_stream(be));
#endif
    if (st == DG_OK) st = be->ops->sync(be);
    dg_comm_req_t *rs = NULL, *rr = NULL;
    if (st == DG_OK) st = dg_comm_isend(e->o.grad, e->staged ? hs : (void *)g, n, DG_F32, peer, 1, &rs);
    if (st == DG_OK) st = dg_comm_irecv(e->o.grad, e->staged ? hr : tmp, n, DG_F32, peer, 1, &rr);
    if (rs) {
        dg_status_t sw = dg_comm_wait(e->o.grad, rs);
        if (st == DG_OK) st = sw;
    }
    if (rr) {
        dg_status_t sw = dg_comm_wait(e->o.grad, rr);
        if (st == DG_OK) st = sw;
    }
    if (st == DG_OK && e->staged) st = be->ops->to_device(be, tmp, hr, bytes);
    if (st == DG_OK) st = be->ops->add_f32(be, g, tmp, n);
    if (st == DG_OK) st = be->ops->sync(be);
    if (hs) be->ops->host_free(be, hs);
    if (hr) be->ops->host_free(be, hr);
    be->ops->free(be, tmp);
    return st == DG_OK ? DG_OK : dg_err_prefix(st, "pipeline: summing the tied wte's gradients");
}

dg_status_t dg_pp_exec_optimizer(dg_pp_exec_t *e, const dg_optim_hparams_t *h, float *grad_norm) {
    DG_TRY(tied_sum(e));
    double local = 0, global = 0;
    for (int k = 0; k < e->n_local; k++) {
        double s = 0;
        DG_TRY(dg_model_opt_sumsq(e->model[k], h, &s));
        local += s;
    }
    DG_MPI_CHECK(MPI_Allreduce(&local, &global, 1, MPI_DOUBLE, MPI_SUM, e->line));
    float norm = NAN;
    for (int k = 0; k < e->n_local; k++)
        DG_TRY(dg_model_opt_finish(e->model[k], global, &norm));
    *grad_norm = norm;
    return DG_OK;
}
