/* model.c — the model layer's compiled model: the fixed pass pipeline (fusions -> autodiff -> FSDP ->
 * optimizer -> gradient sync -> in-place -> plan), the flat storage of parameters, gradients and AdamW
 * moments, create/free and accessors of dg_model.h.
 */
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model_impl.h"

/* The output node of a pipeline chunk without the head, by name (a fusion pass may replace the node). */
static dg_status_t find_chunk_output(dg_model_t *m) {
    m->x_out = NULL;
    for (int i = 0; i < m->g->n && !m->x_out; i++)
        if (strcmp(m->g->nodes[i]->name, m->x_out_name) == 0 && m->g->nodes[i]->phase == DG_PHASE_FWD)
            m->x_out = m->g->nodes[i];
    if (!m->x_out)
        return DG_ERR(DG_ERR_RUNTIME, "model: the pipeline chunk's output '%s' is not in the graph",
                      m->x_out_name);
    return DG_OK;
}

static dg_status_t pass_autodiff(dg_graph_t *g, void *ctx) {
    dg_model_t *m = ctx;
    if (!m->losses) { /* a pipeline chunk without the head: its output, which fuse_residual may have replaced
                       */
        DG_TRY(find_chunk_output(m));
        return dg_autodiff(g, 1, &m->x_out, &m->dx_out);
    }
    return dg_autodiff(g, 1, &m->losses, NULL);
}

static dg_status_t pass_optimizer(dg_graph_t *g, void *ctx) {
    dg_model_t *m = ctx;
    return dg_graph_add_optimizer(g, dg_gpt2_decay_of, m, &m->scalars);
}

/* One AdamW op over the flat buffers (backend adamw_multi_dev), unless the backend has none or the
 * per-parameter ops are asked for (DG_MODEL_ADAMW_PER_PARAM, or the test hook DG_TEST_ADAMW_PER_PARAM=1). */
static int adamw_fused(const dg_model_t *m) {
    if (dg_env_bool("DG_TEST_ADAMW_PER_PARAM")) return 0;
    return !(m->flags & DG_MODEL_ADAMW_PER_PARAM) && !dg_op_missing_kernel(m->be, DG_OP_ADAMW_ALL);
}

/* With the fused AdamW (whose flat gradient leaf it reads), the gradient norm is one op too (backend
 * sumsq_multi), unless the backend has none. */
static int sumsq_fused(const dg_model_t *m) {
    return adamw_fused(m) && !dg_op_missing_kernel(m->be, DG_OP_SUMSQ_ALL);
}

/* The classifier loss and its backward as one op (backend crossentropy_fused, pass fuse_crossentropy),
 * unless the two ops are asked for (DG_MODEL_UNFUSED_CE, or the test hook DG_TEST_UNFUSED_CE=1) or the
 * backend has none. */
static int ce_fused(const dg_model_t *m) {
    if (dg_env_bool("DG_TEST_UNFUSED_CE")) return 0;
    return !(m->flags & DG_MODEL_UNFUSED_CE) && !dg_op_missing_kernel(m->be, DG_OP_CROSSENTROPY_FUSED);
}

/* Each residual add and the linear layer before it as one op (backend matmul_fwd_res, pass fuse_residual),
 * unless the pair is asked for (DG_MODEL_UNFUSED_RESID, or the test hook DG_TEST_UNFUSED_RESID=1) or the
 * backend has none. */
static int res_fused(const dg_model_t *m) {
    if (dg_env_bool("DG_TEST_UNFUSED_RESID")) return 0;
    return !(m->flags & DG_MODEL_UNFUSED_RESID) && !dg_op_missing_kernel(m->be, DG_OP_MATMUL_RES);
}

/* train.recompute = selective / full: the layer (segment) of a forward op to recompute, or -1. Layer ops
 * are named "h.<l>.<what>" (gpt2.c). selective: the layer norms (and tensor parallelism's identity view
 * of their output) and the attention core from the saved qkv; full: every op of the layer but its output
 * res_2 (the next layer's input), so only each layer's input is kept. */
static int recompute_layer(const dg_node_t *n, int full) {
    int l = -1, len = 0;
    if (sscanf(n->name, "h.%d.%n", &l, &len) != 1 || len == 0 || l < 0) return -1;
    const char *what = n->name + len;
    if (full) return strcmp(what, "res_2") == 0 ? -1 : l;
    if (n->op == DG_OP_LAYERNORM || n->op == DG_OP_ATTENTION) return l;
    if (n->op == DG_OP_ALL_REDUCE && n->attr[DG_A_ARMODE] == DG_AR_FROM_REPLICATE) return l;
    return -1;
}
static int recompute_selective(const dg_node_t *n, void *user) {
    (void)user;
    return recompute_layer(n, 0);
}
static int recompute_full(const dg_node_t *n, void *user) {
    (void)user;
    return recompute_layer(n, 1);
}

/* Optimizer-phase collectives, run to completion on the compute stream (a few per step):
 * tp-rank-0-only gradients summed over tp, before the norm; the local sum of squares summed over
 * dp_shard and tp, before the clip factor. The dp_replicate sum runs in the backward
 * (dg_pass_replicate_sync in src/graph/sync.c). */
static dg_status_t pass_grad_sync(dg_graph_t *g, void *ctx) {
    dg_model_t *m = ctx;
    if (m->rep > 1 && m->shard) DG_TRY(dg_pass_replicate_sync(g, m->shard));
    dg_node_t *zs = NULL, *clip = NULL;
    for (int i = 0; i < g->n; i++) {
        dg_node_t *x = g->nodes[i];
        if (x->phase != DG_PHASE_OPT || x->op == DG_OP_LEAF) continue;
        if (x->op == DG_OP_ZERO && x->upd[0] == m->scalars) zs = x;
        if (x->op == DG_OP_CLIP_SCALE) clip = x;
    }
    DG_ASSERT(zs && clip);
    dg_phase_t saved = g->cur_phase;
    g->cur_phase = DG_PHASE_OPT;
    char nm[96];
    dg_node_t *after = zs;
#define INPLACE_AR(name, target, dim, count)                                                                 \
    do {                                                                                                     \
        int64_t a_[4] = {0, (dim), DG_AR_SUM, (count)};                                                      \
        dg_node_t *t_ = (target);                                                                            \
        dg_node_t *n_ = dg_graph_add_op(g, DG_OP_ALL_REDUCE, (name), 0, NULL, 1, &t_, a_, 4);                \
        if (!n_) break;                                                                                      \
        dg_graph_move(g, n_, after->id + 1 + after->n_side);                                                 \
        after = n_;                                                                                          \
    } while (0)
    for (int i = 0; i < m->np && !g->err; i++)
        if (m->place[i].tp_rank0_only) {
            dg_fmt(nm, sizeof nm, "ar.tp.%.80s", m->pnode[i]->grad->name);
            INPLACE_AR(nm, m->pnode[i]->grad, DG_MESH_TP, 0);
        }
    after = g->nodes[clip->id - 1];
    if (m->k > 1 && !g->err) INPLACE_AR("ar.sumsq.dp_shard", m->scalars, DG_MESH_DP_SHARD, 1);
    if (m->tp > 1 && !g->err) INPLACE_AR("ar.sumsq.tp", m->scalars, DG_MESH_TP, 1);
#undef INPLACE_AR
    g->cur_phase = saved;
    return g->err;
}

/* Flat-buffer layout of the local shards (parameter order, so a bucket's shards are contiguous) and the
 * shard plan for the FSDP pass. */
static void layout(dg_model_t *m) {
    size_t t = 0;
    for (int i = 0; i < m->np; i++) {
        m->off[i] = t;
        t += (m->place[i].local_numel + PARAM_ALIGN_ELEMS - 1) / PARAM_ALIGN_ELEMS * PARAM_ALIGN_ELEMS;
    }
    m->total = t;
    if (m->k == 1 && m->rep == 1) return;
    dg_shard_plan_t *sp = dg_xmalloc(sizeof *sp);
    *sp = (dg_shard_plan_t){.n = m->np,
                            .k = m->k,
                            .bucket_bytes = m->par.bucket_bytes,
                            .prefetch_bytes = m->par.prefetch_bytes,
                            .overlap = m->par.overlap,
                            .reshard = m->par.reshard_after_forward,
                            .reduce_dtype = m->par.reduce_dtype};
    sp->params = dg_xcalloc((size_t)m->np, sizeof *sp->params);
    for (int i = 0; i < m->np; i++) {
        int group = dg_gpt2_param_group(m, m->info[i].name);
        const place_t *pl = &m->place[i];
        sp->params[i] =
            (dg_shard_param_t){m->pnode[i], group, pl->lrows, pl->lcols, pl->Rs, pl->row0, m->off[i]};
    }
    m->shard = sp;
}

/* ---------------- create / free ---------------- */

static dg_status_t alloc_zero(dg_backend_t *be, size_t bytes, void **out) {
    DG_TRY(be->ops->alloc(be, bytes, out));
    return be->ops->memset0(be, *out, bytes);
}

/* The loss and norm go through download_async + fences when the backend has all five v1.8 entries,
 * unless DG_SYNC_HOST_READS=1 asks for the old sync + to_host reads (A/B timing; same numbers). */
static int want_async_reads(const dg_backend_t *be) {
    const dg_backend_ops_t *o = be->ops;
    if (!o->download_async || !o->fence_create || !o->fence_destroy || !o->fence_record || !o->fence_wait)
        return 0;
    return !dg_env_bool("DG_SYNC_HOST_READS");
}

static dg_status_t bind_and_alloc(dg_model_t *m) {
    dg_backend_t *be = m->be;
    size_t fb = m->total * sizeof(float);
    DG_TRY(alloc_zero(be, fb, (void **)&m->master));
    DG_TRY(alloc_zero(be, fb, (void **)&m->grad));
    DG_TRY(alloc_zero(be, fb, (void **)&m->adam_m));
    DG_TRY(alloc_zero(be, fb, (void **)&m->adam_v));
    size_t as = dg_dtype_size(m->g->act_dtype);
    if (m->g->act_dtype != DG_F32) DG_TRY(alloc_zero(be, m->total * as, &m->compute));
    size_t ntok = (size_t)m->B * (size_t)m->T;
    DG_TRY(alloc_zero(be, ntok * sizeof(int32_t), (void **)&m->tokens_dev));
    DG_TRY(alloc_zero(be, ntok * sizeof(int32_t), (void **)&m->targets_dev));
    DG_TRY(alloc_zero(be, DG_SCALAR_COUNT * sizeof(float), (void **)&m->scalars_dev));
    DG_TRY(be->ops->host_alloc(be, ntok * sizeof(int32_t), (void **)&m->tok_host));
    DG_TRY(be->ops->host_alloc(be, ntok * sizeof(int32_t), (void **)&m->tgt_host));
    DG_TRY(be->ops->host_alloc(be, ntok * sizeof(float), (void **)&m->host_losses));
    if (m->async_reads) {
        DG_TRY(be->ops->host_alloc(be, sizeof(float), (void **)&m->host_norm));
        *m->host_norm = NAN;
        DG_TRY(be->ops->fence_create(be, &m->loss_fence));
        DG_TRY(be->ops->fence_create(be, &m->norm_fence));
        /* the node after which DG_DS_NORM holds the step's norm; a pass that replaced CLIP_SCALE by
         * another op writing the norm would have to be found here too (none: the norm is read after a
         * sync, correct but with the old wait) */
        for (int i = 0; i < m->g->n; i++)
            if (m->g->nodes[i]->op == DG_OP_CLIP_SCALE && m->g->nodes[i]->phase == DG_PHASE_OPT)
                m->clip = m->g->nodes[i];
    }
    m->tokens->data = m->tokens_dev;
    m->targets->data = m->targets_dev;
    if (m->pp_chunk) DG_TRY(dg_stage_bind0(m));
    m->scalars->data = m->scalars_dev;
    for (int i = 0; i < m->np; i++) {
        dg_node_t *p = m->pnode[i];
        p->master->data = m->master + m->off[i];
        if (p->master != p) p->data = (char *)m->compute + m->off[i] * as;
        p->grad->data = m->grad + m->off[i];
    }
    for (int j = 0; m->shard && j < m->shard->n_buckets; j++) { /* views over the flat buffers */
        dg_bucket_t *b = &m->shard->buckets[j];
        size_t o = m->off[b->first];
        b->pleaf->data = m->compute ? (void *)((char *)m->compute + o * as) : (void *)(m->master + o);
        b->gleaf->data = m->grad + o;
    }
    if (m->fuse.master) { /* the fused AdamW's leaves span the flat buffers */
        m->fuse.master->data = m->master;
        m->fuse.grad->data = m->grad;
        m->fuse.m->data = m->adam_m;
        m->fuse.v->data = m->adam_v;
        if (m->fuse.param != m->fuse.master) m->fuse.param->data = m->compute;
        DG_TRY(alloc_zero(be, m->fuse.segs->nbytes, &m->segs_dev));
        m->fuse.segs->data = m->segs_dev;
        for (int i = 0; i < m->g->n_opt_segs; i++) { /* the segments are the tensors bound above */
            const dg_opt_seg_t *sg = &m->g->opt_segs[i];
            DG_ASSERT(sg->param_index >= 0 && sg->param_index < m->np);
            const dg_node_t *p = m->pnode[sg->param_index];
            DG_ASSERT(p->master->data == (void *)(m->master + sg->off) &&
                      p->grad->data == (void *)(m->grad + sg->off));
            DG_ASSERT(sg->count == m->place[sg->param_index].local_numel);
        }
    }
    if (m->fuse.norm_segs) { /* the fused norm reads the same flat gradient leaf */
        DG_TRY(alloc_zero(be, m->fuse.norm_segs->nbytes, &m->norm_segs_dev));
        m->fuse.norm_segs->data = m->norm_segs_dev;
        for (int i = 0; i < m->g->n_norm_segs; i++) {
            const dg_opt_seg_t *sg = &m->g->norm_segs[i];
            DG_ASSERT(sg->param_index >= 0 && sg->param_index < m->np);
            DG_ASSERT(m->pnode[sg->param_index]->grad->data == (void *)(m->grad + sg->off));
            DG_ASSERT(sg->count == m->place[sg->param_index].local_numel);
        }
    }
    for (int j = 0; j < m->g->n; j++) {
        dg_node_t *x = m->g->nodes[j];
        if (!(x->flags & DG_NF_OPTSTATE)) continue;
        DG_ASSERT(x->param_index >= 0 && x->param_index < m->np);
        float *base = strncmp(x->name, "adam_m.", 7) == 0 ? m->adam_m : m->adam_v;
        x->data = base + m->off[x->param_index];
    }
    DG_TRY(dg_exec_create_ex(be, m->g, m->plan, m->conservative ? DG_EXEC_EAGER : 0, &m->ex));
    for (int d = 0; d < DG_MESH_NDIM; d++) {
        if (m->par.mesh.size[d] == 1) continue;
        if (!m->par.comm[d])
            return DG_ERR(DG_ERR_USAGE, "model: mesh dimension %s has %d ranks but no comm was given",
                          dg_mesh_dim_name(d), m->par.mesh.size[d]);
        DG_TRY(dg_exec_attach_comm(m->ex, d, m->par.comm[d]));
    }
    return DG_OK;
}

static dg_status_t init_weights(dg_model_t *m) {
    size_t maxn = 1;
    for (int i = 0; i < m->np; i++)
        if (m->place[i].local_numel > maxn) maxn = m->place[i].local_numel;
    float *h = dg_xmalloc(maxn * sizeof(float));
    dg_status_t st = DG_OK;
    for (int i = 0; i < m->np && st == DG_OK; i++) {
        dg_gpt2_init_tensor(m, i, h);
        st = dg_model_set_local(m, i, DG_STATE_PARAM, h);
    }
    free(h);
    return st;
}

dg_status_t dg_model_create(const dg_model_desc_t *d, dg_backend_t *be, int micro_batch, uint64_t seed,
                            dg_model_t **out) {
    return dg_model_create_ex(d, be, micro_batch, seed, 0, out);
}

dg_status_t dg_model_create_ex(const dg_model_desc_t *d, dg_backend_t *be, int micro_batch, uint64_t seed,
                               int flags, dg_model_t **out) {
    return dg_model_create_parallel(d, be, micro_batch, seed, flags, NULL, out);
}

void dg_model_parallel_default(dg_model_parallel_t *p) {
    memset(p, 0, sizeof *p);
    for (int d = 0; d < DG_MESH_NDIM; d++) {
        p->mesh.size[d] = 1;
        p->mesh.order[d] = d;
    }
    p->bucket_bytes = (size_t)25 << 20;
    p->prefetch_bytes = (size_t)256 << 20;
    p->overlap = 1;
    p->reshard_after_forward = 1;
}

static dg_status_t check_parallel(const dg_model_desc_t *d, const dg_model_parallel_t *p) {
    for (int k = 0; k < DG_MESH_NDIM; k++) {
        if (p->mesh.size[k] < 1 || p->coord[k] < 0 || p->coord[k] >= p->mesh.size[k])
            return DG_ERR(DG_ERR_USAGE, "model: mesh dimension %s: size %d, coordinate %d is out of range",
                          dg_mesh_dim_name(k), p->mesh.size[k], p->coord[k]);
    }
    if (p->reduce_dtype != DG_F32 && p->reduce_dtype != DG_BF16)
        return DG_ERR(DG_ERR_USAGE, "model: gradient reduction dtype %s: expected f32 or bf16",
                      dg_dtype_name(p->reduce_dtype));
    int tp = p->mesh.size[DG_MESH_TP];
    if (d->n_head % tp != 0)
        return DG_ERR(
            DG_ERR_USAGE,
            "parallel.mesh: tp = %d must divide model.n_head = %d (attention heads are split over tp)", tp,
            d->n_head);
    if (p->pp_n_units > 0) {
        int u0 = p->pp_first_unit, u1 = u0 + p->pp_n_units, L = d->n_layer;
        int blocks = (u1 < L + 1 ? u1 : L + 1) - (u0 > 1 ? u0 : 1);
        if (u0 < 0 || u1 > L + 2 || blocks < 1)
            return DG_ERR(DG_ERR_USAGE,
                          "model: pipeline chunk of units [%d, %d) out of the %d units (0 embedding, 1..%d "
                          "blocks, %d head) holds no block",
                          u0, u1, L + 2, L, L + 1);
    }
    return DG_OK;
}

/* One build of the model: the forward graph, then either the cached plan (pc with try_load: the entry's
 * graph and memory plan replace the forward graph) or the pass pipeline and the memory plan, then memory
 * and weights. The circuit breaker (par->compile) stops a build that is not conservative: after a pass
 * once the build has taken more than timeout_s, or after the plan when its peak is over mem_budget; the
 * model then comes back with want_fb set and no memory (the caller rebuilds it conservatively). */
static dg_status_t build_once(const dg_model_desc_t *d, dg_backend_t *be, int micro_batch, uint64_t seed,
                              int flags, const dg_model_parallel_t *par, dg_pc_t *pc, int try_load,
                              int conservative, int defer_init, dg_model_t **out) {
    *out = NULL;
    const dg_model_compile_t *cc = par->compile;
    dg_model_t *m = dg_xcalloc(1, sizeof *m);
    m->d = *d;
    m->be = be;
    m->B = micro_batch;
    m->T = d->seq_len;
    m->conservative = conservative;
    if (conservative) flags |= DG_MODEL_NO_FUSION;
    if (flags & DG_MODEL_NO_FUSION)
        flags |= DG_MODEL_UNFUSED_CE | DG_MODEL_UNFUSED_RESID | DG_MODEL_UNFUSED_GELU_BWD |
                 DG_MODEL_ADAMW_PER_PARAM;
    m->flags = flags;
    m->seed = seed;
    m->par = *par;
    m->tp = par->mesh.size[DG_MESH_TP];
    m->tp_rank = par->coord[DG_MESH_TP];
    m->k = par->mesh.size[DG_MESH_DP_SHARD];
    m->shard_rank = par->coord[DG_MESH_DP_SHARD];
    m->rep = par->mesh.size[DG_MESH_DP_REPLICATE];
    m->accum = 1;
    m->rep_rank = par->coord[DG_MESH_DP_REPLICATE];
    snprintf(m->binfo.cache, sizeof m->binfo.cache, "off");
    snprintf(m->binfo.reason, sizeof m->binfo.reason, "no plan cache directory");
    int cap = 4 + 12 * d->n_layer;
    m->u0 = par->pp_n_units > 0 ? par->pp_first_unit : 0;
    m->u1 = par->pp_n_units > 0 ? par->pp_first_unit + par->pp_n_units : d->n_layer + 2;
    m->pp_chunk = par->pp_n_units > 0;
    m->gidx = dg_xcalloc((size_t)cap, sizeof *m->gidx);
    m->info = dg_xcalloc((size_t)cap, sizeof *m->info);
    m->names = dg_xcalloc((size_t)cap, sizeof *m->names);
    m->pnode = dg_xcalloc((size_t)cap, sizeof *m->pnode);
    m->off = dg_xcalloc((size_t)cap + 1, sizeof *m->off);
    m->place = dg_xcalloc((size_t)cap, sizeof *m->place);
    m->g = dg_graph_create(be);
    m->g->mesh = par->mesh;

    double t0 = dg_now_s(), t_passes = 0, t_plan = 0, t_alloc = 0, t_init = 0;
    double limit = (cc && !conservative) ? cc->timeout_s : 0;
    int loaded = 0, stopped = 0;
    dg_status_t st = dg_gpt2_build_forward(m);
    if (st == DG_OK) {
        layout(m);
        if (m->losses) m->losses->flags |= DG_NF_OUTPUT;
    }
    if (st == DG_OK && pc && try_load) {
        double tk = dg_now_s();
        dg_status_t sk = dg_pc_key(pc, m);
        m->binfo.key_s = dg_now_s() - tk;
        if (sk != DG_OK) {
            snprintf(pc->outcome, sizeof pc->outcome, "off");
            snprintf(pc->reason, sizeof pc->reason, "%s", dg_last_error());
            DG_LOG_WARN("plan cache off: %s", pc->reason);
            free(pc->key);
            pc->key = NULL;
            dg_clear_error();
        } else {
            dg_pc_lookup(pc);
            if (strcmp(pc->outcome, "corrupt") == 0)
                DG_LOG_WARN("plan cache: ignoring a corrupt entry (rebuilding, it will be rewritten): %s",
                            pc->reason);
            if (pc->have) {
                if (dg_pc_apply(pc, m) == DG_OK) {
                    loaded = 1;
                } else {
                    pc->have = 0;
                    snprintf(pc->outcome, sizeof pc->outcome, "corrupt");
                    snprintf(pc->reason, sizeof pc->reason, "%s", dg_last_error());
                    dg_clear_error();
                    DG_LOG_WARN("plan cache: ignoring a corrupt entry (rebuilding, it will be rewritten): %s",
                                pc->reason);
                }
            }
        }
    }
    /* the build-time limit counts the passes and the plan, not the key (first hashes of the libraries) */
    double t_lim0 = dg_now_s();
    if (st == DG_OK && !loaded) {
        dg_pass_t pipeline[16];
        int np = 0;
        /* the conservative plan (circuit breaker) runs no fusion pass */
        if (!(flags & DG_MODEL_NO_FUSION)) pipeline[np++] = (dg_pass_t){"fuse_gelu", dg_pass_fuse_gelu, NULL};
        /* before autodiff, which then emits the fused op's backward (the residual's gradient shared, the
         * matmul's MATMUL_BWD): with tp > 1 the row-parallel products reach their add through an
         * all-reduce, and stay unfused */
        if (res_fused(m)) pipeline[np++] = (dg_pass_t){"fuse_residual", dg_pass_fuse_residual, NULL};
        pipeline[np++] = (dg_pass_t){"autodiff", pass_autodiff, m};
        if (!(flags & DG_MODEL_UNFUSED_GELU_BWD))
            pipeline[np++] = (dg_pass_t){"fuse_gelu_bwd", dg_pass_fuse_gelu_bwd, NULL};
        dg_recompute_pass_t rc = {.segment = (flags & DG_MODEL_RECOMPUTE_FULL) ? recompute_full
                                                                               : recompute_selective};
        if ((flags & (DG_MODEL_RECOMPUTE_GELU | DG_MODEL_RECOMPUTE_SELECTIVE)) &&
            !(flags & DG_MODEL_RECOMPUTE_FULL))
            pipeline[np++] = (dg_pass_t){"recompute_gelu", dg_pass_recompute_gelu, NULL};
        if (flags & (DG_MODEL_RECOMPUTE_SELECTIVE | DG_MODEL_RECOMPUTE_FULL))
            pipeline[np++] = (dg_pass_t){"recompute", dg_pass_recompute, &rc};
        /* the loss becomes one op that also writes the logits' gradient, in the forward: every run of the
         * forward that a backward follows must have the step's dloss set (dg_model_forward_backward), and
         * a forward alone runs with rt.forward_only (dg_model_forward, dg_model_logits) */
        dg_fuse_ce_t fce = {.loss = m->losses};
        if (ce_fused(m)) pipeline[np++] = (dg_pass_t){"fuse_crossentropy", dg_pass_fuse_crossentropy, &fce};
        if (m->shard) /* a data-parallel mesh: buckets (one data-parallel rank: none) */
            pipeline[np++] = (dg_pass_t){"fsdp", dg_pass_fsdp, m->shard};
        pipeline[np++] = (dg_pass_t){"optimizer", pass_optimizer, m};
        if (adamw_fused(m)) {
            m->fuse = (dg_fuse_adamw_t){.off = m->off, .n = m->np, .span = m->total};
            pipeline[np++] = (dg_pass_t){"fuse_adamw", dg_pass_fuse_adamw, &m->fuse};
            /* before grad_sync: the optimizer-phase all-reduces it inserts (tp-rank-0 gradients after
             * the accumulator's ZERO, the sum's over dp_shard and tp before CLIP_SCALE) then surround the
             * fused op as they would the SUMSQ ops */
            if (sumsq_fused(m)) pipeline[np++] = (dg_pass_t){"fuse_sumsq", dg_pass_fuse_sumsq, &m->fuse};
        }
        pipeline[np++] = (dg_pass_t){"grad_sync", pass_grad_sync, m};
        pipeline[np++] = (dg_pass_t){"inplace", dg_pass_inplace, NULL};
        /* one pass at a time, so that the build-time limit is checked between passes (the test hook
         * DG_TEST_SLOW_BUILD_MS slows each pass of a build that is not conservative) */
        int64_t slow_ms = conservative ? 0 : dg_env_int("DG_TEST_SLOW_BUILD_MS");
        for (int i = 0; i < np && st == DG_OK; i++) {
            if (slow_ms > 0) usleep((useconds_t)(slow_ms * 1000));
            st = dg_graph_run_passes(m->g, &pipeline[i], 1);
            double el = dg_now_s() - t_lim0;
            if (st == DG_OK && limit > 0 && el > limit && i + 1 < np) {
                snprintf(m->want_fb, sizeof m->want_fb, "compile_timeout");
                dg_fmt(m->want_fb_reason, sizeof m->want_fb_reason,
                       "the plan build took %.2f s by pass '%s' (%d of %d), over the %.3g s limit "
                       "(run.compile_timeout_s); building the conservative plan (no fusions, per-op "
                       "allocation, no graph replay)",
                       el, pipeline[i].name, i + 1, np, limit);
                stopped = 1;
                break;
            }
        }
        if (!stopped) m->losses = fce.loss; /* the fused op's losses when the pass fused the loss */
        if (!stopped && st == DG_OK && m->x_out) st = find_chunk_output(m); /* after the passes, again */
    }
    t_passes = dg_now_s();
    if (st == DG_OK && !loaded && !stopped)
        st = dg_plan_create(m->g, (flags & DG_MODEL_NO_ARENA_REUSE) ? DG_PLAN_NO_REUSE : 0, &m->plan);
    t_plan = t_alloc = t_init = dg_now_s();
    if (st == DG_OK && !stopped && limit > 0 && t_plan - t_lim0 > limit && !loaded) {
        snprintf(m->want_fb, sizeof m->want_fb, "compile_timeout");
        dg_fmt(
            m->want_fb_reason, sizeof m->want_fb_reason,
            "the plan build took %.2f s with the memory plan, over the %.3g s limit (run.compile_timeout_s); "
            "building the conservative plan (no fusions, per-op allocation, no graph replay)",
            t_plan - t_lim0, limit);
        stopped = 1;
    }
    if (st == DG_OK && !stopped && cc && cc->mem_budget && !conservative) {
        size_t peak = dg_model_planned_bytes(m);
        if (peak > cc->mem_budget) {
            snprintf(m->want_fb, sizeof m->want_fb, "compile_oom");
            dg_fmt(m->want_fb_reason, sizeof m->want_fb_reason,
                   "the plan's peak of %zu bytes (arena %zu + model state %zu + ids) is over this rank's "
                   "budget of %zu bytes (run.compile_mem_budget_mb); building the conservative plan (per-op "
                   "allocation: peak %zu bytes of activations live at once, no fusions, no graph replay)",
                   peak, m->plan->arena_bytes, dg_model_state_bytes(m), cc->mem_budget,
                   m->plan->live_peak_bytes);
            stopped = 1;
        }
    }
    m->binfo.build_s = t_plan - t0 - m->binfo.key_s;
    m->binfo.frozen_at = t_plan;
    if (st == DG_OK && !stopped) m->frozen = dg_xcalloc((size_t)m->np + 1, 1);
    m->stall_rank = -1;
    int64_t sr = dg_env_int("DG_TEST_STALL_COLLECTIVE_RANK"),
            ss = dg_env_int("DG_TEST_STALL_COLLECTIVE_STEP");
    if (sr >= 0 && ss >= 0) {
        m->stall_rank = (int)sr;
        m->stall_step = ss;
    }
    if (st == DG_OK && !stopped && !(flags & DG_MODEL_PLAN_ONLY)) {
        m->async_reads = want_async_reads(be);
        st = bind_and_alloc(m);
        if (st == DG_OK) {
            m->ex->rt.frozen = m->frozen;
            m->ex->rt.n_frozen_slots = m->np;
        }
        t_alloc = dg_now_s();
        if (st == DG_OK && defer_init)
            m->init_pending = 1; /* after the plan-cache probe, which runs on its own weights */
        else if (st == DG_OK)
            st = init_weights(m);
        t_init = dg_now_s();
    }
    /* where the time to the first step goes (docs/cuda.md "Time to the first step") */
    DG_LOG_DEBUG("model build: graph and passes %.3f s%s, memory plan %.3f s, bind and allocate %.3f s, "
                 "weights %.3f s",
                 t_passes - t0, loaded ? " (plan cache hit)" : "", t_plan - t_passes, t_alloc - t_plan,
                 t_init - t_alloc);
    if (st != DG_OK) {
        dg_model_free(m);
        return st;
    }
    *out = m;
    return DG_OK;
}

/* 1 on every rank of the mesh when `flag` is set on any of them (the sum over each mesh dimension in
 * turn); collective over the model's comms, called by all ranks in the same order. The mpi comm backend
 * reduces host memory (it is not CUDA-aware: a device pointer would fault), nccl device memory. */
static dg_status_t agree_any(dg_model_t *m, int flag, int *any) {
    *any = flag;
    dg_backend_t *be = m->be;
    float v = flag ? 1.0f : 0.0f;
    void *dev = NULL;
    dg_status_t st = DG_OK;
    for (int d = 0; d < DG_MESH_NDIM && st == DG_OK; d++) {
        dg_comm_t *c = m->par.comm[d];
        if (m->par.mesh.size[d] <= 1 || !c) continue;
        if (dg_comm_kind(c) == DG_COMM_MPI) {
            st = dg_comm_allreduce(c, &v, &v, 1, DG_F32, DG_RED_SUM);
            continue;
        }
        if (!dev) st = be->ops->alloc(be, 256, &dev);
        if (st == DG_OK) st = be->ops->to_device(be, dev, &v, sizeof v);
        if (st == DG_OK) st = be->ops->sync(be);
        if (st == DG_OK) st = dg_comm_allreduce(c, dev, dev, 1, DG_F32, DG_RED_SUM);
        if (st == DG_OK) st = be->ops->to_host(be, &v, dev, sizeof v);
    }
    if (dev) be->ops->free(be, dev);
    if (st != DG_OK) return dg_err_prefix(st, "model: agreeing on the plan over the mesh");
    *any = v > 0.5f;
    return DG_OK;
}

/* The plan-cache probe: one forward of a fixed batch (logits at the last position of every sequence, the
 * token losses against target 0) under fixed pattern weights, cheap to make (no random draws: an index
 * hash over the flat parameter buffer). The caller initialises the real weights afterwards. out = mean
 * loss, sum, position-weighted sum and absolute sum of the logits. */
static void probe_fill(float *dst, size_t start, size_t n, void *ctx) {
    (void)ctx;
    /* in parallel: the same values for any thread count (gpt2-124m: 0.7-0.8 s of a plan-cache hit's
     * probe on the GPU host when one thread filled a host copy of the whole state) */
#pragma omp parallel for schedule(static) if (n >= 65536)
    for (size_t k = 0; k < n; k++) {
        uint32_t h = (uint32_t)(start + k) * 2654435761u;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        dst[k] = ((float)(h >> 8) * (1.0f / 16777216.0f) - 0.5f) * 0.08f;
    }
}

static dg_status_t run_probe(dg_model_t *m, double out[4]) {
    size_t ntok = (size_t)m->B * (size_t)m->T, V = (size_t)m->d.vocab_size;
    dg_status_t st = dg_model_set_flat_fill(m, DG_STATE_PARAM, probe_fill, NULL);
    int32_t *tok = dg_xmalloc(ntok * sizeof *tok);
    for (size_t i = 0; i < ntok; i++)
        tok[i] = (int32_t)((i * 7919u + 13u) % V);
    float *lg = dg_xmalloc((size_t)m->B * V * sizeof *lg);
    if (st == DG_OK) st = dg_model_logits(m, tok, m->T - 1, lg);
    if (st == DG_OK)
        st = m->be->ops->to_host(m->be, m->host_losses, dg_exec_ptr(m->ex, m->losses), ntok * sizeof(float));
    double l = 0, s = 0, ws = 0, a = 0;
    for (size_t i = 0; st == DG_OK && i < ntok; i++)
        l += m->host_losses[i];
    for (size_t i = 0; st == DG_OK && i < (size_t)m->B * V; i++) {
        s += lg[i];
        ws += lg[i] * (double)(1 + i % 7);
        a += fabs(lg[i]);
    }
    out[0] = l / (double)ntok;
    out[1] = s;
    out[2] = ws;
    out[3] = a;
    free(tok);
    free(lg);
    return st;
}

static int probe_matches(const dg_model_t *m, const double now[4], const double was[4], char *why,
                         size_t cap) {
    /* fp32: the same kernels give the same bits, 1e-5 is slack; bf16/fp16 activations: a GEMM algorithm
     * tuned again may round differently */
    double rel = m->g->act_dtype == DG_F32 ? 1e-5 : 2e-3;
    double tl = rel * fmax(1.0, fabs(was[0])), ts = rel * fmax(was[3], 1e-30);
    static const char *const nm[4] = {"loss", "logits sum", "logits weighted sum", "logits absolute sum"};
    for (int i = 0; i < 4; i++) {
        double tol = i == 0 ? tl : ts * (i == 2 ? 7.0 : 1.0);
        if (!(fabs(now[i] - was[i]) <= tol)) {
            snprintf(why, cap, "probe check failed: %s %.9g, the entry has %.9g (tolerance %.3g)", nm[i],
                     now[i], was[i], tol);
            return 0;
        }
    }
    return 1;
}

const char *dg_model_fallback_id(const char *kind) {
    if (!kind) return "FALLBACK_OTHER";
    if (strcmp(kind, "kernel") == 0) return "FALLBACK_UNSUPPORTED_OP";
    if (strcmp(kind, "memory") == 0) return "FALLBACK_ARENA_ALLOC";
    if (strcmp(kind, "compile_timeout") == 0) return "FALLBACK_COMPILE_TIMEOUT";
    if (strcmp(kind, "compile_oom") == 0) return "FALLBACK_COMPILE_OOM";
    return "FALLBACK_OTHER";
}

const dg_model_build_info_t *dg_model_build_info(const dg_model_t *m) {
    return &m->binfo;
}

dg_status_t dg_model_create_parallel(const dg_model_desc_t *d, dg_backend_t *be, int micro_batch,
                                     uint64_t seed, int flags, const dg_model_parallel_t *par,
                                     dg_model_t **out) {
    *out = NULL;
    DG_TRY(dg_model_desc_validate(d));
    if (!be) return DG_ERR(DG_ERR_USAGE, "model: no compute backend given");
    if (micro_batch < 1 || (int64_t)micro_batch * d->seq_len > INT_MAX / 4)
        return DG_ERR(DG_ERR_USAGE, "train.micro_batch = %d is out of range for seq_len %d", micro_batch,
                      d->seq_len);
    dg_model_parallel_t one;
    if (!par) {
        dg_model_parallel_default(&one);
        par = &one;
    }
    DG_TRY(check_parallel(d, par));
    const dg_model_compile_t *cc = par->compile;
    /* pipeline chunks have no plan cache (their probe would need the other chunks) */
    int use_pc = cc && cc->cache_dir && cc->cache_dir[0] && !(flags & DG_MODEL_PLAN_ONLY) && !par->pp_n_units;
    dg_pc_t pc;
    if (use_pc) dg_pc_init(&pc, cc->cache_dir);
    dg_model_t *m = NULL;
    dg_status_t st = DG_OK;
    int try_load = 1, conservative = 0;
    char fb_kind[16] = "", fb_reason[512] = "";
    double probe_s = 0, key_s = 0;
    for (int attempt = 0; attempt < 4; attempt++) {
        st = build_once(d, be, micro_batch, seed, flags, par, use_pc ? &pc : NULL, try_load, conservative,
                        use_pc && !conservative, &m);
        if (st != DG_OK) break;
        if (m->binfo.key_s > 0) key_s = m->binfo.key_s;
        int any = 0;
        if (!conservative) {
            st = agree_any(m, m->want_fb[0] != 0, &any);
            if (st != DG_OK) break;
        }
        if (any) { /* the breaker stopped the build here or on another rank: all ranks take the same plan */
            if (m->want_fb[0]) {
                snprintf(fb_kind, sizeof fb_kind, "%s", m->want_fb);
                snprintf(fb_reason, sizeof fb_reason, "%s", m->want_fb_reason);
            } else {
                snprintf(fb_kind, sizeof fb_kind, "compile_timeout");
                snprintf(
                    fb_reason, sizeof fb_reason,
                    "another rank's build was stopped by the circuit breaker (see its log); building the "
                    "conservative plan with it");
            }
            dg_model_free(m);
            m = NULL;
            conservative = 1;
            continue;
        }
        if (!use_pc || conservative || !pc.key) break;
        double t_pr = dg_now_s(), probe[4];
        st = run_probe(m, probe);
        probe_s += dg_now_s() - t_pr;
        if (st != DG_OK) break;
        char why[320] = "";
        int bad = pc.have && !probe_matches(m, probe, pc.probe, why, sizeof why);
        st = agree_any(m, bad, &any);
        if (st != DG_OK) break;
        if (any) { /* a hit that does not reproduce its probe: rebuilt, on every rank */
            snprintf(pc.outcome, sizeof pc.outcome, "stale");
            snprintf(pc.reason, sizeof pc.reason, "%s", bad ? why : "another rank's probe check failed");
            DG_LOG_WARN("plan cache: %s: rebuilding the plan", pc.reason);
            dg_model_free(m);
            m = NULL;
            pc.have = 0;
            try_load = 0;
            continue;
        }
        dg_model_comm_stats_t cs; /* the probe's collectives are not the run's */
        dg_model_comm_stats(m, &cs, 1);
        if (!pc.have) {
            dg_status_t sw = dg_pc_store(&pc, m, probe);
            if (sw != DG_OK) {
                DG_LOG_WARN("plan cache: entry not written: %s", dg_last_error());
                dg_clear_error();
            }
        }
        break;
    }
    if (st != DG_OK && m) { /* an agreement or the probe failed */
        dg_model_free(m);
        m = NULL;
    }
    if (st == DG_OK && !m) st = DG_ERR(DG_ERR_RUNTIME, "model: the plan could not be settled in 4 builds");
    if (st == DG_OK && m->init_pending) { /* the weights, after the probe */
        m->init_pending = 0;
        st = init_weights(m);
        if (st != DG_OK) {
            dg_model_free(m);
            m = NULL;
        }
    }
    if (st == DG_OK) {
        if (use_pc) {
            snprintf(m->binfo.cache, sizeof m->binfo.cache, "%s", pc.key ? pc.outcome : "off");
            snprintf(m->binfo.reason, sizeof m->binfo.reason, "%s", pc.reason);
            if (conservative) {
                snprintf(m->binfo.cache, sizeof m->binfo.cache, "miss");
                snprintf(m->binfo.reason, sizeof m->binfo.reason, "the conservative plan is not cached");
            }
        }
        m->binfo.probe_s = probe_s;
        m->binfo.key_s = key_s;
        if (conservative) {
            const char *id = dg_model_fallback_id(fb_kind);
            snprintf(m->binfo.fallback, sizeof m->binfo.fallback, "%s", id);
            struct dg_exec_fallback *f = &m->mfb[m->n_mfb++];
            snprintf(f->kind, sizeof f->kind, "%s", fb_kind);
            snprintf(f->reason, sizeof f->reason, "%s", fb_reason);
            DG_LOG_WARN("%s: %s", id, fb_reason);
        }
        if (use_pc)
            DG_LOG_INFO("plan cache: %s (%s); key %.3f s, plan ready in %.3f s, probe %.3f s", m->binfo.cache,
                        m->binfo.reason, key_s, m->binfo.build_s, probe_s);
        *out = m;
    }
    if (use_pc) dg_pc_free(&pc);
    return st;
}

void dg_model_free(dg_model_t *m) {
    if (!m) return;
    dg_backend_t *be = m->be;
    /* with async_reads a step may return with its backward or AdamW still queued, and that work uses
     * the buffers freed below (errors were reported, or the model is being torn down after one) */
    if (m->ex && m->async_reads) (void)be->ops->sync(be);
    dg_stage_free(m);
    dg_model_replay_drop(m); /* the recordings hold the fences and the page-locked buffers: before those go */
    if (m->loss_fence) be->ops->fence_destroy(be, m->loss_fence);
    if (m->norm_fence) be->ops->fence_destroy(be, m->norm_fence);
    if (m->tok_host) be->ops->host_free(be, m->tok_host);
    if (m->tgt_host) be->ops->host_free(be, m->tgt_host);
    if (m->host_losses) be->ops->host_free(be, m->host_losses);
    if (m->host_norm) be->ops->host_free(be, m->host_norm);
    dg_exec_free(m->ex);
    void *bufs[] = {m->master,       m->grad,       m->adam_m,       m->adam_v,
                    m->compute,      m->tokens_dev, m->targets_dev,  m->scalars_dev,
                    m->gr_agree_dev, m->segs_dev,   m->norm_segs_dev};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->ops->free(be, bufs[i]);
    dg_plan_free(m->plan);
    dg_graph_free(m->g);
    dg_shard_plan_free(m->shard);
    DG_FREE_ALL(m->place, m->gidx, m->info, m->names, m->pnode, m->off, m->frozen, m);
}

/* ---------------- accessors ---------------- */

const dg_model_desc_t *dg_model_desc(const dg_model_t *m) {
    return &m->d;
}

int dg_model_micro_batch(const dg_model_t *m) {
    return m->B;
}

int dg_model_n_tensors(const dg_model_t *m) {
    return m->np;
}

const dg_param_info_t *dg_model_param(const dg_model_t *m, int i) {
    return (i >= 0 && i < m->np) ? &m->info[i] : NULL;
}

int dg_model_find_param(const dg_model_t *m, const char *name) {
    for (int i = 0; i < m->np; i++)
        if (strcmp(m->info[i].name, name) == 0) return i;
    return -1;
}

size_t dg_model_arena_bytes(const dg_model_t *m) {
    return m->plan->arena_bytes;
}

size_t dg_model_arena_live_peak_bytes(const dg_model_t *m) {
    return m->plan->live_peak_bytes;
}

size_t dg_model_activation_bytes_sum(const dg_model_t *m) {
    return m->plan->act_bytes_sum;
}

size_t dg_model_state_bytes(const dg_model_t *m) {
    size_t b = 4 * m->total * sizeof(float);
    if (m->g->act_dtype != DG_F32) b += m->total * dg_dtype_size(m->g->act_dtype);
    return b;
}

static size_t planned_act_bytes(const dg_model_t *m) {
    int eager = m->conservative || (m->ex && m->ex->eager);
    return eager ? m->plan->live_peak_bytes : m->plan->arena_bytes;
}

size_t dg_model_planned_bytes(const dg_model_t *m) {
    size_t ntok = (size_t)m->B * (size_t)m->T;
    return planned_act_bytes(m) + dg_model_state_bytes(m) + 2 * ntok * sizeof(int32_t);
}

size_t dg_model_stage_planned_bytes(const dg_model_t *m) {
    size_t total = dg_model_planned_bytes(m);
    if (!m->pp_chunk || m->n_slots < 1) return total;
    size_t ntok = (size_t)m->B * (size_t)m->T;
    size_t io = (m->x_in ? m->x_in->nbytes : 0) + (m->dx_out ? m->dx_out->nbytes : 0);
    return total + (size_t)(m->n_slots - 1) * (planned_act_bytes(m) + 2 * ntok * sizeof(int32_t)) +
           (size_t)m->n_slots * io;
}

int dg_model_n_ops(const dg_model_t *m) {
    int k = 0;
    for (int i = 0; i < m->g->n; i++)
        if (m->g->nodes[i]->op != DG_OP_LEAF && m->g->nodes[i]->op != DG_OP_SIDE) k++;
    return k;
}

/* Kernel launches of one step of g's schedule at `accum` micro-batches (dg_model_kernels_per_step). */
static int64_t kernels_per_step(const dg_graph_t *g, int accum) {
    int64_t once = 0, per_micro = 0, sync = 0;
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *n = g->nodes[i];
        const dg_op_def_t *d = dg_op_def(n->op);
        if (!d->kernels[0].name || d->is_collective) continue;
        if (n->phase == DG_PHASE_FWD || n->phase == DG_PHASE_BWD) {
            per_micro++;
            if (n->flags & DG_NF_GRAD_SYNC) sync++;
        } else {
            once++;
        }
    }
    return once + (int64_t)accum * per_micro - (int64_t)(accum - 1) * sync;
}

int64_t dg_model_kernels_per_step(const dg_model_t *m, int micro_batches) {
    return kernels_per_step(m->g, micro_batches > 0 ? micro_batches : m->accum);
}

dg_status_t dg_model_unfused_kernels_per_step(const dg_model_t *m, int micro_batches, int64_t *out) {
    *out = dg_model_kernels_per_step(m, micro_batches);
    if (m->flags & DG_MODEL_NO_FUSION) return DG_OK; /* the conservative plan: nothing was fused */
    dg_model_parallel_t par = m->par;
    par.compile = NULL; /* no circuit breaker for a graph that is only counted */
    int flags = (m->flags & ~(DG_MODEL_NO_ARENA_REUSE)) | DG_MODEL_PLAN_ONLY | DG_MODEL_NO_FUSION;
    dg_model_t *u = NULL;
    DG_TRY(build_once(&m->d, m->be, m->B, m->seed, flags, &par, NULL, 0, 0, 0, &u));
    *out = kernels_per_step(u->g, micro_batches > 0 ? micro_batches : m->accum);
    dg_model_free(u);
    return DG_OK;
}

dg_graph_t *dg_model_graph(const dg_model_t *m) {
    return m->g;
}

dg_exec_t *dg_model_exec(const dg_model_t *m) {
    return m->ex;
}

void dg_model_fb_flush(dg_model_t *m) {
    if (!m->fb_cb) return;
    for (; m->mfb_sent < m->n_mfb; m->mfb_sent++)
        m->fb_cb(m->fb_ctx, m->mfb[m->mfb_sent].kind, m->mfb[m->mfb_sent].reason);
    if (!m->ex) return;
    for (; m->fb_sent < m->ex->n_fb; m->fb_sent++)
        m->fb_cb(m->fb_ctx, m->ex->fb[m->fb_sent].kind, m->ex->fb[m->fb_sent].reason);
}

void dg_model_set_fallback_cb(dg_model_t *m, dg_model_fallback_cb_t cb, void *ctx) {
    m->fb_cb = cb;
    m->fb_ctx = ctx;
    dg_model_fb_flush(m);
}

const dg_memplan_t *dg_model_plan(const dg_model_t *m) {
    return m->plan;
}
