/* state.c — tensor state of a model (parameters, gradients, AdamW moments: whole, local piece, flat),
 * this rank's pieces for checkpoints, comm statistics, profiling and the plan printer.
 */
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model_impl.h"

dg_status_t dg_model_set_frozen(dg_model_t *m, int i, int frozen) {
    if (i < 0 || i >= m->np) return DG_ERR(DG_ERR_USAGE, "model: tensor index %d outside [0, %d)", i, m->np);
    if (m->frozen[i] != (frozen != 0)) dg_model_replay_drop(m); /* the frozen set is baked into recordings */
    m->frozen[i] = frozen != 0;
    return DG_OK;
}

static dg_status_t state_ptr(dg_model_t *m, int i, int which, float **p) {
    DG_TRY(dg_model_need_memory(m, "tensor access"));
    if (i < 0 || i >= m->np) return DG_ERR(DG_ERR_USAGE, "model: tensor index %d outside [0, %d)", i, m->np);
    float *base = which == DG_STATE_PARAM    ? m->master
                  : which == DG_STATE_ADAM_M ? m->adam_m
                  : which == DG_STATE_ADAM_V ? m->adam_v
                  : which == DG_STATE_GRAD   ? m->grad
                                             : NULL;
    if (!base) return DG_ERR(DG_ERR_USAGE, "model: unknown tensor state %d", which);
    *p = base + m->off[i];
    return DG_OK;
}

static dg_status_t need_whole(const dg_model_t *m, int i) {
    if (m->tp > 1 || m->k > 1)
        return DG_ERR(
            DG_ERR_USAGE,
            "model: tensor '%s' is distributed over the mesh (this rank holds %zu of %zu elements); "
            "use dg_model_get_local / dg_model_set_local",
            m->info[i].name, m->place[i].local_numel, m->info[i].numel);
    return DG_OK;
}

dg_status_t dg_model_get_tensor(dg_model_t *m, int i, int which, float *host_out) {
    float *p = NULL;
    DG_TRY(state_ptr(m, i, which, &p));
    DG_TRY(need_whole(m, i));
    DG_TRY(m->be->ops->sync(m->be));
    return m->be->ops->to_host(m->be, host_out, p, m->info[i].numel * sizeof(float));
}

dg_status_t dg_model_set_tensor(dg_model_t *m, int i, int which, const float *host_in) {
    float *p = NULL;
    DG_TRY(state_ptr(m, i, which, &p));
    DG_TRY(need_whole(m, i));
    return dg_model_set_local(m, i, which, host_in);
}

size_t dg_model_local_numel(const dg_model_t *m, int i) {
    return (i >= 0 && i < m->np) ? m->place[i].local_numel : 0;
}

dg_status_t dg_model_get_local(dg_model_t *m, int i, int which, float *host_out) {
    float *p = NULL;
    DG_TRY(state_ptr(m, i, which, &p));
    DG_TRY(m->be->ops->sync(m->be));
    return m->be->ops->to_host(m->be, host_out, p, m->place[i].local_numel * sizeof(float));
}

size_t dg_model_flat_numel(const dg_model_t *m) {
    return m->total;
}

size_t dg_model_flat_offset(const dg_model_t *m, int i) {
    DG_ASSERT(i >= 0 && i < m->np);
    return m->off[i];
}

dg_status_t dg_model_get_flat(dg_model_t *m, int which, float *host_out) {
    float *p = NULL;
    if (m->np == 0) return DG_OK;
    DG_TRY(state_ptr(m, 0, which, &p));
    DG_TRY(m->be->ops->sync(m->be));
    return m->be->ops->to_host(m->be, host_out, p - m->off[0], m->total * sizeof(float));
}

dg_status_t dg_model_set_flat(dg_model_t *m, int which, const float *host_in) {
    float *p = NULL;
    if (m->np == 0) return DG_OK;
    DG_TRY(state_ptr(m, 0, which, &p));
    DG_TRY(m->be->ops->sync(m->be));
    DG_TRY(m->be->ops->to_device(m->be, p - m->off[0], host_in, m->total * sizeof(float)));
    if (which == DG_STATE_PARAM && m->compute) /* the act-dtype compute copy follows the master */
        DG_TRY(m->be->ops->cast(m->be, m->compute, m->g->act_dtype, m->master, DG_F32, m->total));
    return m->be->ops->sync(m->be);
}

dg_status_t dg_model_set_flat_fill(dg_model_t *m, int which, dg_model_fill_fn fill, void *ctx) {
    float *p = NULL;
    if (m->np == 0) return DG_OK;
    DG_TRY(state_ptr(m, 0, which, &p));
    float *dst = p - m->off[0];
    const size_t chunk = (size_t)4 << 20; /* 16 MiB of floats per copy: no host buffer of the whole state */
    float *h = dg_xmalloc((m->total < chunk ? m->total : chunk) * sizeof *h);
    dg_status_t st = m->be->ops->sync(m->be);
    for (size_t at = 0; at < m->total && st == DG_OK; at += chunk) {
        size_t n = m->total - at < chunk ? m->total - at : chunk;
        fill(h, at, n, ctx);
        /* h is pageable: the backends copy or stage it before returning (cu_to_device), so it can be refilled
         * at once */
        st = m->be->ops->to_device(m->be, dst + at, h, n * sizeof(float));
    }
    free(h);
    if (st == DG_OK && which == DG_STATE_PARAM && m->compute)
        st = m->be->ops->cast(m->be, m->compute, m->g->act_dtype, m->master, DG_F32, m->total);
    if (st == DG_OK) st = m->be->ops->sync(m->be);
    return st;
}

dg_status_t dg_model_set_local(dg_model_t *m, int i, int which, const float *host_in) {
    float *p = NULL;
    DG_TRY(state_ptr(m, i, which, &p));
    size_t n = m->place[i].local_numel;
    DG_TRY(m->be->ops->to_device(m->be, p, host_in, n * sizeof(float)));
    if (which == DG_STATE_PARAM && m->compute) {
        dg_dtype_t at = m->g->act_dtype;
        DG_TRY(m->be->ops->cast(m->be, (char *)m->compute + m->off[i] * dg_dtype_size(at), at, p, DG_F32, n));
    }
    return DG_OK;
}

int dg_model_local_pieces(const dg_model_t *m, int i, dg_model_piece_t *out) {
    if (i < 0 || i >= m->np) return 0;
    const place_t *pl = &m->place[i];
    int n = 0;
    int64_t lr = 0;
    while (lr < pl->nrows) { /* runs of local rows that are contiguous global rows */
        int64_t gr = dg_model_global_row(pl, lr), len = 1;
        while (lr + len < pl->nrows && dg_model_global_row(pl, lr + len) == gr + len)
            len++;
        DG_ASSERT(n < DG_MODEL_MAX_PIECES);
        dg_model_piece_t *p = &out[n++];
        p->start[0] = gr;
        p->count[0] = len;
        p->start[1] = pl->tp_dim == 1 ? pl->seg_start[0] : 0;
        p->count[1] = pl->lcols;
        p->offset = (size_t)(lr * pl->lcols);
        lr += len;
    }
    return n;
}

int dg_model_piece_owner(const dg_model_t *m, int i) {
    if (i < 0 || i >= m->np) return 0;
    if (m->pp_chunk && m->u0 > 0 && m->gidx[i] == 0) return 0; /* the head's copy of wte */
    return m->rep_rank == 0 && (m->place[i].tp_dim >= 0 || m->tp_rank == 0);
}

const dg_model_parallel_t *dg_model_parallel(const dg_model_t *m) {
    return &m->par;
}

void dg_model_set_step(dg_model_t *m, int64_t step) {
    m->step = step;
    for (int d = 0; d < DG_MESH_NDIM; d++)
        if (m->par.comm[d] && m->par.mesh.size[d] > 1) dg_comm_set_step(m->par.comm[d], step);
}

void dg_model_comm_stats(dg_model_t *m, dg_model_comm_stats_t *out, int reset) {
    memset(out, 0, sizeof *out);
    if (!m->ex) return;
    out->wait_s = m->ex->wait_s;
    out->blocking_s = m->ex->blocking_s;
    out->collectives = m->ex->n_coll;
    memcpy(out->bytes, m->ex->coll_bytes, sizeof out->bytes);
    out->grad_bytes = m->ex->grad_coll_bytes;
    dg_exec_t *ex = m->ex;
    out->grad_sync_s = ex->gs_total + (ex->gs_start > 0 ? ex->gs_end - ex->gs_start : 0);
    if (reset) {
        ex->gs_total = 0;
        ex->gs_start = ex->gs_end = ex->gs_pending > 0 ? dg_now_s() : 0;
        m->ex->wait_s = m->ex->blocking_s = 0;
        m->ex->n_coll = 0;
        memset(m->ex->coll_bytes, 0, sizeof m->ex->coll_bytes);
        m->ex->grad_coll_bytes = 0;
    }
}

/* ---------------- profiling ---------------- */

void dg_model_set_profiling(dg_model_t *m, int on) {
    if (m->ex) m->ex->profile = on;
}

static void trace_node(void *ctx, const dg_node_t *n, int comm, double t0, double t1) {
    dg_model_t *m = ctx;
    m->trace_cb(m->trace_ctx, dg_op_name(n->op), n->name, dg_phase_name(n->phase), comm, t0, t1);
}

void dg_model_set_trace(dg_model_t *m, dg_model_trace_cb_t cb, void *ctx) {
    m->trace_cb = cb;
    m->trace_ctx = ctx;
    if (m->ex) dg_exec_set_trace(m->ex, cb ? trace_node : NULL, m);
}

void dg_model_print_profile(dg_model_t *m, FILE *out) {
    if (!m->ex) return;
    double total = 0;
    int order[DG_OP_COUNT], n = 0;
    for (int k = 0; k < DG_OP_COUNT; k++) {
        total += m->ex->prof_s[k];
        if (m->ex->prof_n[k]) order[n++] = k;
    }
    for (int i = 1; i < n; i++) /* insertion sort by time, largest first */
        for (int j = i; j > 0 && m->ex->prof_s[order[j]] > m->ex->prof_s[order[j - 1]]; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    for (int i = 0; i < n; i++) {
        int k = order[i];
        fprintf(out, "  %-18s %9.3f s %8llu calls %5.1f%%\n", dg_op_name((dg_op_kind_t)k), m->ex->prof_s[k],
                (unsigned long long)m->ex->prof_n[k], total > 0 ? 100.0 * m->ex->prof_s[k] / total : 0.0);
        m->ex->prof_s[k] = 0;
        m->ex->prof_n[k] = 0;
    }
}

/* ---------------- plan printing ---------------- */

static void human(size_t b, char *buf, size_t cap) {
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)b;
    int k = 0;
    while (v >= 1024 && k < 4) {
        v /= 1024;
        k++;
    }
    snprintf(buf, cap, k ? "%.2f %s" : "%.0f %s", v, u[k]);
}

dg_status_t dg_model_print_plan(const dg_model_t *m, FILE *out, int json) {
    const dg_model_desc_t *d = &m->d;
    size_t pbytes = m->total * sizeof(float);
    size_t cbytes = m->g->act_dtype != DG_F32 ? m->total * dg_dtype_size(m->g->act_dtype) : 0;
    size_t arena = m->plan->arena_bytes, sum = m->plan->act_bytes_sum;
    int nops[DG_PHASE_COUNT] = {0};
    for (int i = 0; i < m->g->n; i++)
        if (m->g->nodes[i]->op != DG_OP_LEAF && m->g->nodes[i]->op != DG_OP_SIDE)
            nops[m->g->nodes[i]->phase]++;
    if (json) {
        fprintf(out,
                "{\"model\":{\"n_layer\":%d,\"n_head\":%d,\"d_model\":%d,\"seq_len\":%d,\"vocab_size\":%d,"
                "\"padded_vocab\":%d,\"n_params\":%" PRIu64 ",\"flops_per_token\":%.6g},\"micro_batch\":%d,"
                "\"act_dtype\":\"%s\",\"schedule\":",
                d->n_layer, d->n_head, d->d_model, d->seq_len, d->vocab_size, d->padded_vocab,
                dg_model_n_params(d), dg_model_flops_per_token(d), m->B, dg_dtype_name(m->g->act_dtype));
        dg_graph_print(m->g, m->plan, out, 1);
        fprintf(
            out,
            ",\n\"ops\":{\"fwd\":%d,\"bwd\":%d,\"zero\":%d,\"opt\":%d},\"arena_bytes\":%zu,"
            "\"activation_bytes_sum\":%zu,\"param_bytes\":%zu,\"compute_copy_bytes\":%zu,\"grad_bytes\":%zu,"
            "\"optimizer_bytes\":%zu,",
            nops[DG_PHASE_FWD], nops[DG_PHASE_BWD], nops[DG_PHASE_ZERO], nops[DG_PHASE_OPT], arena, sum,
            pbytes, cbytes, pbytes, 2 * pbytes);
        char mesh[128];
        dg_mesh_format(&m->par.mesh, mesh, sizeof mesh);
        fprintf(out,
                "\"parallel\":{\"mesh\":\"%s\",\"coord\":[%d,%d,%d],\"buckets\":%d,\"bucket_bytes\":%zu,"
                "\"overlap\":%s,\"prefetch_bytes\":%zu,\"reshard_after_forward\":%s}}\n",
                mesh, m->rep_rank, m->shard_rank, m->tp_rank, m->shard ? m->shard->n_buckets : 0,
                m->par.bucket_bytes, m->par.overlap ? "true" : "false", m->par.prefetch_bytes,
                m->par.reshard_after_forward ? "true" : "false");
        return ferror(out) ? DG_ERR(DG_ERR_RUNTIME, "model: writing the plan failed") : DG_OK;
    }
    char a[32], s[32], p[32], c[32], o[32];
    fprintf(
        out,
        "graph schedule: n_layer=%d n_head=%d d_model=%d seq_len=%d vocab=%d (padded %d), micro_batch=%d, "
        "act dtype %s, %" PRIu64 " params, %.3g FLOPs/token\n",
        d->n_layer, d->n_head, d->d_model, d->seq_len, d->vocab_size, d->padded_vocab, m->B,
        dg_dtype_name(m->g->act_dtype), dg_model_n_params(d), dg_model_flops_per_token(d));
    dg_graph_print(m->g, m->plan, out, 0);
    human(arena, a, sizeof a);
    human(sum, s, sizeof s);
    human(pbytes, p, sizeof p);
    human(cbytes, c, sizeof c);
    human(2 * pbytes, o, sizeof o);
    fprintf(out, "ops: %d forward, %d backward, %d zero-grad, %d optimizer\n", nops[DG_PHASE_FWD],
            nops[DG_PHASE_BWD], nops[DG_PHASE_ZERO], nops[DG_PHASE_OPT]);
    fprintf(out, "activation arena: %zu bytes (%s) for %zu bytes (%s) of activations: %.1f%% of the sum\n",
            arena, a, sum, s, sum ? 100.0 * (double)arena / (double)sum : 0.0);
    fprintf(out, "params (f32 master): %s, compute copy: %s, grads (f32): %s, AdamW m+v (f32): %s\n", p, c, p,
            o);
    if (m->tp > 1 || m->k > 1 || m->rep > 1) {
        char mesh[128];
        dg_mesh_format(&m->par.mesh, mesh, sizeof mesh);
        fprintf(out,
                "parallel: mesh %s at (%d, %d, %d); %d buckets of <= %.1f MB; overlap %s; prefetch budget "
                "%.1f MB; "
                "reshard after forward %s; the state above is this rank's shard\n",
                mesh, m->rep_rank, m->shard_rank, m->tp_rank, m->shard ? m->shard->n_buckets : 0,
                m->par.bucket_bytes / 1048576.0, m->par.overlap ? "on" : "off",
                m->par.prefetch_bytes / 1048576.0, m->par.reshard_after_forward ? "on" : "off");
    }
    return ferror(out) ? DG_ERR(DG_ERR_RUNTIME, "model: writing the plan failed") : DG_OK;
}
