/* run.c — running a model: staging token ids, forward/backward, forward-only and logits, the optimizer
 * step, and CUDA Graph replay of the phases (recorded once per set of baked-in values, agreed across
 * ranks that share NCCL communicators).
 */
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model_impl.h"

/* ---------------- running ---------------- */

dg_status_t dg_model_need_memory(const dg_model_t *m, const char *what) {
    if (m->flags & DG_MODEL_PLAN_ONLY)
        return DG_ERR(DG_ERR_USAGE, "model: %s on a model created plan-only (no memory)", what);
    return DG_OK;
}

dg_status_t dg_model_check_ids(const dg_model_t *m, const int32_t *ids, const char *what) {
    if (!ids) return DG_ERR(DG_ERR_USAGE, "model: %s missing", what);
    size_t n = (size_t)m->B * (size_t)m->T;
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->d.vocab_size)
            return DG_ERR(
                DG_ERR_USAGE,
                "model: %s[%zu] (sequence %zu, position %zu) = %d is outside the vocabulary [0, %d)", what, i,
                i / (size_t)m->T, i % (size_t)m->T, (int)ids[i], m->d.vocab_size);
    return DG_OK;
}

/* Checks the ids and puts them in the page-locked staging buffers; upload_ids() queues the copies. The
 * staging is free again once the forward that follows the copies has run: after the sync that ends
 * dg_model_forward (read_mean_loss), and after dg_model_forward_backward's wait, which is either that
 * sync or the loss fence placed after the forward (queue_loss_read), in both cases behind the uploads. */
static dg_status_t stage_ids(dg_model_t *m, const int32_t *tokens, const int32_t *targets) {
    size_t bytes = (size_t)m->B * (size_t)m->T * sizeof(int32_t);
    DG_TRY(dg_model_check_ids(m, tokens, "tokens"));
    DG_TRY(dg_model_check_ids(m, targets, "targets"));
    memcpy(m->tok_host, tokens, bytes);
    memcpy(m->tgt_host, targets, bytes);
    return DG_OK;
}

static dg_status_t upload_ids(dg_model_t *m) {
    size_t bytes = (size_t)m->B * (size_t)m->T * sizeof(int32_t);
    DG_TRY(m->be->ops->upload_async(m->be, m->tokens_dev, m->tok_host, bytes));
    return m->be->ops->upload_async(m->be, m->targets_dev, m->tgt_host, bytes);
}

/* ---------------- graph replay ---------------- */

enum { GR_ZERO, GR_FB, GR_FB_NOSYNC, GR_OPT, GR_COUNT };
static const char *const gr_name[GR_COUNT] = {"zero_grad", "forward_backward",
                                              "forward_backward (no gradient sync)", "optimizer"};

void dg_model_replay_drop(dg_model_t *m) {
    for (int i = 0; i < GR_COUNT; i++) {
        if (m->gr[i]) m->be->ops->graph_free(m->be, m->gr[i]);
        m->gr[i] = NULL;
    }
}

static void gr_give_up(dg_model_t *m, const char *why) {
    dg_model_replay_drop(m);
    m->gr_on = 0;
    DG_LOG_WARN("CUDA Graph replay is off for the rest of the run, steps run op by op: %s", why);
    if (m->gr_cb) m->gr_cb(m->gr_ctx, "fallback", why);
}

typedef dg_status_t (*gr_body_t)(dg_model_t *m);

static dg_status_t body_zero(dg_model_t *m) {
    return dg_exec_run_phase(m->ex, DG_PHASE_ZERO);
}

/* The token losses are final once the forward has run (an output: live to the end of the schedule, and
 * nothing in the backward writes them): their copy and the loss fence go right there, so the host can
 * read the loss while the backward runs. Recorded into the forward_backward graphs with the rest. */
static dg_status_t queue_loss_read(dg_model_t *m) {
    size_t n = (size_t)m->B * (size_t)m->T;
    DG_TRY(
        m->be->ops->download_async(m->be, m->host_losses, dg_exec_ptr(m->ex, m->losses), n * sizeof(float)));
    return m->be->ops->fence_record(m->be, m->loss_fence);
}

/* The forward and the backward of one micro-batch. rt.dloss is set before it (a fused classifier loss
 * writes the logits' gradient in the forward), so a recording of it bakes in that dloss, which is the
 * key of the forward_backward recordings (gr_run). */
static dg_status_t body_fb(dg_model_t *m) {
    DG_ASSERT(!m->ex->rt.forward_only);
    DG_TRY(upload_ids(m));
    DG_TRY(dg_exec_run_phase(m->ex, DG_PHASE_FWD));
    if (m->async_reads) DG_TRY(queue_loss_read(m));
    return dg_exec_run_phase(m->ex, DG_PHASE_BWD);
}

/* The gradient norm is final once CLIP_SCALE has run (after the sum of squares and its all-reduces over
 * dp_shard and tp, which pass_grad_sync places before it): its copy and the norm fence go right after
 * that node, inside the one OPT run (and so inside the one optimizer recording), ahead of the AdamW. */
static dg_status_t queue_norm_read(void *ctx) {
    dg_model_t *m = ctx;
    DG_TRY(m->be->ops->download_async(m->be, m->host_norm, m->scalars_dev + DG_SCALAR_NORM, sizeof(float)));
    return m->be->ops->fence_record(m->be, m->norm_fence);
}

static dg_status_t body_opt(dg_model_t *m) {
    if (!m->async_reads || !m->clip) return dg_exec_run_phase(m->ex, DG_PHASE_OPT);
    int first, end;
    dg_graph_phase_range(m->g, DG_PHASE_OPT, &first, &end);
    return dg_exec_run_hook(m->ex, first, end, m->clip->id, queue_norm_read, m);
}

static int gr_active(const dg_model_t *m) {
    return m->gr_on && m->gr_warm && !m->ex->profile && !m->ex->trace;
}

/* The step's collectives run over nccl comms (recorded into the graphs with the compute). */
static int gr_nccl(const dg_model_t *m) {
    for (int d = 0; d < DG_MESH_NDIM; d++)
        if (m->par.mesh.size[d] > 1 && m->par.comm[d] && dg_comm_kind(m->par.comm[d]) == DG_COMM_NCCL)
            return 1;
    return 0;
}

/* NCCL's rule for CUDA Graphs: whether a collective is captured must be the same on every rank of its
 * communicator, and a captured one is launched by every rank's graph. A recording can fail on one rank
 * only (scratch that would have to grow, instantiation), so with nccl collectives the ranks agree on each
 * recording: failures are summed along each mesh dimension in turn (= the sum over the whole mesh); any
 * failure makes every rank drop its recording and run op by op. Runs after the recording, not captured. */
static dg_status_t gr_agree(dg_model_t *m, int failed, int *any_failed) {
    dg_backend_t *be = m->be;
    *any_failed = failed;
    if (!m->gr_agree_dev) DG_TRY(be->ops->alloc(be, 256, &m->gr_agree_dev));
    float v = failed ? 1.0f : 0.0f;
    DG_TRY(be->ops->to_device(be, m->gr_agree_dev, &v, sizeof v));
    DG_TRY(be->ops->sync(be)); /* the blocking collective below is not ordered after the backend's stream */
    for (int d = 0; d < DG_MESH_NDIM; d++)
        if (m->par.mesh.size[d] > 1 && m->par.comm[d])
            DG_TRY(
                dg_comm_allreduce(m->par.comm[d], m->gr_agree_dev, m->gr_agree_dev, 1, DG_F32, DG_RED_SUM));
    DG_TRY(be->ops->to_host(be, &v, m->gr_agree_dev, sizeof v));
    *any_failed = v > 0.5f;
    return DG_OK;
}

/* Runs body eagerly, or replays its recording (recording it first when there is none, or when the
 * values it baked in, key[0..nk), have changed). */
static dg_status_t gr_run(dg_model_t *m, int which, const float *key, int nk, gr_body_t body) {
    if (!gr_active(m)) return body(m);
    dg_backend_t *be = m->be;
    DG_ASSERT(nk <= 8);
    float k8[8] = {0};
    if (nk > 0) memcpy(k8, key, (size_t)nk * sizeof(float)); /* zero_grad passes no key (NULL) */
    int again = m->gr[which] != NULL && memcmp(k8, m->gr_key[which], sizeof k8) != 0;
    if (again) {
        be->ops->graph_free(be, m->gr[which]);
        m->gr[which] = NULL;
    }
    if (!m->gr[which]) {
        const char *why = dg_exec_capture_blocker(m->ex, 0, m->g->n);
        if (why) {
            char reason[320];
            snprintf(reason, sizeof reason, "%s", why);
            gr_give_up(m, reason);
            return body(m);
        }
        double t0 = dg_now_s();
        char reason[600] = "";
        dg_status_t st = be->ops->graph_begin(be);
        if (st != DG_OK) {
            snprintf(reason, sizeof reason, "%s", dg_last_error());
        } else {
            dg_status_t sb = body(m); /* recorded, not run */
            if (sb != DG_OK)
                snprintf(reason, sizeof reason, "recording %s: %s", gr_name[which], dg_last_error());
            void *gx = NULL;
            dg_status_t se = be->ops->graph_end(be, &gx);
            if (se != DG_OK && sb == DG_OK) snprintf(reason, sizeof reason, "%s", dg_last_error());
            if (sb == DG_OK && se == DG_OK) {
                m->gr[which] = gx;
                memcpy(m->gr_key[which], k8, sizeof k8);
            } else if (gx) {
                be->ops->graph_free(be, gx);
            }
        }
        if (gr_nccl(m)) {
            int any = 0;
            dg_status_t sa = gr_agree(m, m->gr[which] == NULL, &any);
            if (sa != DG_OK) {
                if (m->gr[which]) be->ops->graph_free(be, m->gr[which]);
                m->gr[which] = NULL;
                return dg_err_prefix(sa, "agreeing on the recording of %s", gr_name[which]);
            }
            if (any && m->gr[which]) {
                be->ops->graph_free(be, m->gr[which]);
                m->gr[which] = NULL;
                snprintf(reason, sizeof reason,
                         "another rank could not record %s (NCCL needs every rank to capture the same "
                         "collectives; see that rank's log)",
                         gr_name[which]);
            }
        }
        if (!m->gr[which]) {
            gr_give_up(m, reason);
            return body(m); /* recording ran nothing: run the same ops now */
        }
        char what[160];
        snprintf(what, sizeof what, "%s%s in %.1f ms", gr_name[which],
                 again ? " (again: a baked value changed)" : "", (dg_now_s() - t0) * 1e3);
        DG_LOG_DEBUG("CUDA Graph recorded: %s", what);
        if (m->gr_cb) m->gr_cb(m->gr_ctx, "captured", what);
    }
    return be->ops->graph_launch(be, m->gr[which]);
}

void dg_model_set_graph_replay(dg_model_t *m, int on, dg_model_graph_cb_t cb, void *ctx) {
    dg_model_replay_drop(m);
    m->gr_on = on && m->be->ops->graph_begin != NULL && !(m->flags & DG_MODEL_PLAN_ONLY) &&
               !m->conservative && !m->pp_chunk;
    m->gr_cb = cb;
    m->gr_ctx = ctx;
}

/* The mean of host_losses, summed in double in token order: the same arithmetic whichever way the
 * losses came to the host. */
float dg_model_mean_losses(const dg_model_t *m) {
    size_t n = (size_t)m->B * (size_t)m->T;
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += m->host_losses[i];
    return (float)(s / (double)n);
}

/* The sync path: waits for everything queued (the whole forward, and backward if any), then copies. */
static dg_status_t read_mean_loss(dg_model_t *m, float *mean_out) {
    size_t n = (size_t)m->B * (size_t)m->T;
    DG_TRY(m->be->ops->sync(m->be));
    m->opt_pending = 0;
    if (!mean_out) return DG_OK;
    DG_TRY(m->be->ops->to_host(m->be, m->host_losses, dg_exec_ptr(m->ex, m->losses), n * sizeof(float)));
    *mean_out = dg_model_mean_losses(m);
    return DG_OK;
}

/* The async path: waits for the loss fence only (queue_loss_read); the backward may still be running.
 * Waited for even when the caller wants no loss: the id staging is free only after it. */
static dg_status_t wait_mean_loss(dg_model_t *m, float *mean_out) {
    dg_status_t st = m->be->ops->fence_wait(m->be, m->loss_fence);
    if (st != DG_OK) return dg_err_prefix(st, "model: reading the micro-batch's token losses");
    m->opt_pending = 0; /* the fence lies behind the previous step's AdamW */
    if (mean_out) *mean_out = dg_model_mean_losses(m);
    return DG_OK;
}

/* Test hook for the collective timeouts: with DG_TEST_STALL_COLLECTIVE_RANK=R and _STEP=S (the value
 * given to dg_model_set_step), world rank R of a distributed model hangs before the forward of step S,
 * so its peers block in their first collective of the step (a pipeline chunk's peers: in the step's
 * first message from or to it). */
void dg_model_maybe_stall(const dg_model_t *m) {
    if (m->stall_rank < 0 || m->step != m->stall_step ||
        (m->tp == 1 && m->k == 1 && m->rep == 1 && !m->pp_chunk))
        return;
    int wr = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &wr);
    if (wr != m->stall_rank) return;
    DG_LOG_WARN("test hook DG_TEST_STALL_COLLECTIVE_RANK=%d _STEP=%lld: rank %d hangs before its collectives",
                m->stall_rank, (long long)m->stall_step, wr);
    for (;;)
        sleep(1);
}

/* A pipeline chunk runs through the dg_model_stage_* calls (stage.c) only. */
static dg_status_t not_a_chunk(const dg_model_t *m, const char *what) {
    if (!m->pp_chunk) return DG_OK;
    return DG_ERR(DG_ERR_USAGE, "model: %s on a pipeline chunk (use the dg_model_stage_* calls)", what);
}

dg_status_t dg_model_forward_backward(dg_model_t *m, const int32_t *tokens_host, const int32_t *targets_host,
                                      float dloss, float *mean_loss_out) {
    DG_TRY(dg_model_need_memory(m, "forward_backward"));
    DG_TRY(not_a_chunk(m, "forward_backward"));
    dg_model_maybe_stall(m);
    if (!isfinite(dloss)) return DG_ERR(DG_ERR_USAGE, "model: dloss = %g is not finite", (double)dloss);
    if (m->rep > 1 && m->fb_count >= m->accum)
        return DG_ERR(DG_ERR_USAGE,
                      "model: forward_backward call %d since the last zero_grad / optimizer step, but the "
                      "gradient accumulation is %d micro-batches (dg_model_set_grad_accum): the dp_replicate "
                      "gradient sum already ran",
                      m->fb_count + 1, m->accum);
    DG_TRY(stage_ids(m, tokens_host, targets_host));
    m->ex->rt.dloss = dloss;
    /* the dp_replicate sum runs in the backward of the step's last micro-batch only */
    int sync = m->fb_count + 1 >= m->accum;
    m->ex->rt.skip_grad_sync = !sync;
    dg_status_t st = gr_run(m, sync ? GR_FB : GR_FB_NOSYNC, &dloss, 1, body_fb);
    m->ex->rt.skip_grad_sync = 0;
    DG_TRY(st);
    m->fb_count++;
    return m->async_reads ? wait_mean_loss(m, mean_loss_out) : read_mean_loss(m, mean_loss_out);
}

dg_status_t dg_model_set_grad_accum(dg_model_t *m, int n) {
    if (n < 1)
        return DG_ERR(DG_ERR_USAGE, "model: gradient accumulation of %d micro-batches; expected >= 1", n);
    m->accum = n;
    m->fb_count = 0;
    return DG_OK;
}

/* The FWD phase with no backward to follow: a fused classifier loss computes the losses only, leaving
 * the logits (and whatever the backward of the last forward_backward left) alone. Never recorded. */
static dg_status_t run_forward_only(dg_model_t *m) {
    m->ex->rt.forward_only = 1;
    dg_status_t st = dg_exec_run_phase(m->ex, DG_PHASE_FWD);
    m->ex->rt.forward_only = 0;
    return st;
}

dg_status_t dg_model_forward(dg_model_t *m, const int32_t *tokens_host, const int32_t *targets_host,
                             float *mean_loss_out) {
    DG_TRY(dg_model_need_memory(m, "forward"));
    DG_TRY(not_a_chunk(m, "forward"));
    DG_TRY(stage_ids(m, tokens_host, targets_host));
    DG_TRY(upload_ids(m));
    DG_TRY(run_forward_only(m));
    return read_mean_loss(m, mean_loss_out);
}

dg_status_t dg_model_logits(dg_model_t *m, const int32_t *tokens_host, int pos, float *host_out) {
    DG_TRY(dg_model_need_memory(m, "logits"));
    DG_TRY(not_a_chunk(m, "logits"));
    if (pos < 0 || pos >= m->T)
        return DG_ERR(DG_ERR_USAGE, "model: logits position %d outside [0, %d)", pos, m->T);
    DG_TRY(dg_model_check_ids(m, tokens_host, "tokens"));
    size_t ntok = (size_t)m->B * (size_t)m->T;
    DG_TRY(m->be->ops->to_device(m->be, m->tokens_dev, tokens_host, ntok * sizeof(int32_t)));
    DG_TRY(m->be->ops->memset0(m->be, m->targets_dev, ntok * sizeof(int32_t))); /* loss is ignored */
    DG_TRY(run_forward_only(m));
    DG_TRY(m->be->ops->sync(m->be));
    dg_dtype_t at = m->g->act_dtype;
    size_t as = dg_dtype_size(at), Vp = (size_t)m->d.padded_vocab, V = (size_t)m->d.vocab_size;
    const char *base = dg_exec_ptr(m->ex, m->logits);
    uint16_t *tmp = at == DG_F32 ? NULL : dg_xmalloc(V * sizeof(uint16_t));
    dg_status_t st = DG_OK;
    for (int b = 0; b < m->B && st == DG_OK; b++) {
        const char *row = base + ((size_t)b * (size_t)m->T + (size_t)pos) * Vp * as;
        float *dst = host_out + (size_t)b * V;
        if (at == DG_F32) {
            st = m->be->ops->to_host(m->be, dst, row, V * sizeof(float));
        } else {
            st = m->be->ops->to_host(m->be, tmp, row, V * as);
            for (size_t j = 0; j < V && st == DG_OK; j++)
                dst[j] = dg_half_to_f32(tmp[j], at == DG_BF16);
        }
    }
    free(tmp);
    return st;
}

dg_status_t dg_model_zero_grad(dg_model_t *m) {
    DG_TRY(dg_model_need_memory(m, "zero_grad"));
    m->fb_count = 0;
    return gr_run(m, GR_ZERO, NULL, 0, body_zero);
}

dg_status_t dg_model_opt_prepare(dg_model_t *m, const dg_optim_hparams_t *h) {
    DG_TRY(dg_model_need_memory(m, "optimizer_step"));
    if (!(h->lr >= 0 && isfinite(h->lr)) || !(h->beta1 >= 0 && h->beta1 < 1) ||
        !(h->beta2 >= 0 && h->beta2 < 1) || !(h->eps > 0 && isfinite(h->eps)) ||
        !(h->weight_decay >= 0 && isfinite(h->weight_decay)) || !isfinite(h->grad_clip) || h->t < 1 ||
        !(h->inv_loss_scale >= 0 && isfinite(h->inv_loss_scale)))
        return DG_ERR(
            DG_ERR_USAGE,
            "model: bad AdamW hyper-parameters (lr %g, beta1 %g, beta2 %g, eps %g, weight_decay %g, "
            "grad_clip %g, t %" PRId64 ", inv_loss_scale %g); expected lr >= 0, betas in [0, 1), eps > 0, "
            "t >= 1",
            (double)h->lr, (double)h->beta1, (double)h->beta2, (double)h->eps, (double)h->weight_decay,
            (double)h->grad_clip, h->t, (double)h->inv_loss_scale);
    if (m->rep > 1 && m->fb_count > 0 && m->fb_count < m->accum)
        return DG_ERR(DG_ERR_USAGE,
                      "model: optimizer step after %d of %d micro-batches (dg_model_set_grad_accum): the "
                      "gradients have not been summed over dp_replicate yet",
                      m->fb_count, m->accum);
    m->fb_count = 0;
    /* back to back with the previous step and nothing waited for in between: its AdamW may still have
     * to upload the segment table that dg_exec_stage_scalars is about to rewrite */
    if (m->opt_pending) DG_TRY(m->be->ops->sync(m->be));
    m->opt_pending = 0;
    dg_runtime_t *rt = &m->ex->rt;
    float extra = h->inv_loss_scale > 0 ? h->inv_loss_scale : 1.0f;
    rt->lr = h->lr;
    rt->beta1 = h->beta1;
    rt->beta2 = h->beta2;
    rt->eps = h->eps;
    rt->weight_decay = h->weight_decay;
    rt->t = h->t;
    rt->grad_extra = extra;
    /* the norm is measured on loss-scaled gradients: scale the threshold the same way */
    rt->grad_clip = h->grad_clip > 0 ? h->grad_clip / extra : 0.0f;
    DG_TRY(dg_exec_stage_scalars(m->ex)); /* lr, bias corrections: also what a replay uploads */
    return DG_OK;
}

dg_status_t dg_model_optimizer_step(dg_model_t *m, const dg_optim_hparams_t *h, float *grad_norm_out) {
    DG_TRY(dg_model_opt_prepare(m, h));
    dg_runtime_t *rt = &m->ex->rt;
    float extra = rt->grad_extra;
    /* the whole phase at once, op by op or replayed: with an inf/NaN norm AdamW (adamw_dev) skips itself
     * on the device, so such gradients never reach the state */
    float key[6] = {rt->grad_clip, rt->grad_extra, rt->beta1, rt->beta2, rt->eps, rt->weight_decay};
    DG_TRY(gr_run(m, GR_OPT, key, 6, body_opt));
    float norm;
    if (m->async_reads && m->clip) { /* the norm fence (queue_norm_read): the AdamW may still run */
        dg_status_t sw = m->be->ops->fence_wait(m->be, m->norm_fence);
        if (sw != DG_OK) return dg_err_prefix(sw, "model: reading the gradient norm");
        norm = *m->host_norm;
        m->opt_pending = 1;
    } else {
        DG_TRY(m->be->ops->sync(m->be));
        DG_TRY(m->be->ops->to_host(m->be, &norm, m->scalars_dev + DG_SCALAR_NORM, sizeof norm));
    }
    if (grad_norm_out) *grad_norm_out = norm * extra;
    m->gr_warm = 1; /* one step has run: scratch sized, plans cached */
    return DG_OK;
}
