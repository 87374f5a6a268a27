/* stage.c — running a pipeline chunk (dg_model.h "pipeline chunks"): activation slots (one executor and
 * one set of input buffers per in-flight micro-batch over the same graph, plan and parameter storage),
 * the forward and the backward of one micro-batch in a slot, and the optimizer step cut at the clip
 * factor so that the pipeline executor can sum the squared gradient norms of all chunks first.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model_impl.h"

struct dg_stage_slot {
    dg_exec_t *ex;      /* slot 0: the model's own executor (not owned here) */
    int32_t *tok, *tgt; /* device ids (slot 0: the model's tokens_dev / targets_dev) */
    void *x_in, *dx;    /* device: the input activation, the output's gradient (NULL where absent) */
};

static dg_status_t alloc_zero(dg_backend_t *be, size_t bytes, void **out) {
    DG_TRY(be->ops->alloc(be, bytes, out));
    return be->ops->memset0(be, *out, bytes);
}

static dg_status_t slot_buffers(dg_model_t *m, struct dg_stage_slot *sl) {
    if (m->x_in) DG_TRY(alloc_zero(m->be, m->x_in->nbytes, &sl->x_in));
    if (m->dx_out) DG_TRY(alloc_zero(m->be, m->dx_out->nbytes, &sl->dx));
    return DG_OK;
}

/* Points the graph's persistent inputs at slot s's buffers (the executor reads node->data at run time). */
static void bind_slot(dg_model_t *m, int s) {
    struct dg_stage_slot *sl = &m->slots[s];
    m->tokens->data = sl->tok;
    m->targets->data = sl->tgt;
    if (m->x_in) m->x_in->data = sl->x_in;
    if (m->dx_out) m->dx_out->data = sl->dx;
}

dg_status_t dg_stage_bind0(dg_model_t *m) {
    m->slots = dg_xcalloc(1, sizeof *m->slots);
    m->n_slots = 1;
    m->slots[0].tok = m->tokens_dev;
    m->slots[0].tgt = m->targets_dev;
    DG_TRY(slot_buffers(m, &m->slots[0]));
    bind_slot(m, 0);
    return DG_OK;
}

void dg_stage_free(dg_model_t *m) {
    if (!m->slots) return;
    dg_backend_t *be = m->be;
    for (int s = 0; s < m->n_slots; s++) {
        struct dg_stage_slot *sl = &m->slots[s];
        if (s > 0) {
            dg_exec_free(sl->ex);
            if (sl->tok) be->ops->free(be, sl->tok);
            if (sl->tgt) be->ops->free(be, sl->tgt);
        }
        if (sl->x_in) be->ops->free(be, sl->x_in);
        if (sl->dx) be->ops->free(be, sl->dx);
    }
    free(m->slots);
    m->slots = NULL;
    m->n_slots = 0;
}

static dg_status_t check_slot(const dg_model_t *m, int s, const char *what) {
    DG_TRY(dg_model_need_memory(m, what));
    if (!m->pp_chunk) return DG_ERR(DG_ERR_USAGE, "model: %s: not a pipeline chunk", what);
    if (s < 0 || s >= m->n_slots)
        return DG_ERR(DG_ERR_USAGE, "model: %s: slot %d of %d", what, s, m->n_slots);
    return DG_OK;
}

dg_status_t dg_model_stage_slots(dg_model_t *m, int n) {
    DG_TRY(check_slot(m, 0, "stage_slots"));
    if (n <= m->n_slots) return DG_OK;
    size_t ntok = (size_t)m->B * (size_t)m->T;
    struct dg_stage_slot *grown = dg_xcalloc((size_t)n, sizeof *grown);
    memcpy(grown, m->slots, (size_t)m->n_slots * sizeof *grown);
    free(m->slots);
    m->slots = grown;
    m->slots[0].ex = m->ex;
    for (int s = m->n_slots; s < n; s++) {
        struct dg_stage_slot *sl = &m->slots[s];
        m->n_slots = s + 1; /* so that dg_stage_free releases what was made of it */
        DG_TRY(alloc_zero(m->be, ntok * sizeof(int32_t), (void **)&sl->tok));
        DG_TRY(alloc_zero(m->be, ntok * sizeof(int32_t), (void **)&sl->tgt));
        DG_TRY(slot_buffers(m, sl));
        bind_slot(m, s);
        DG_TRY(dg_exec_create_ex(m->be, m->g, m->plan, m->conservative ? DG_EXEC_EAGER : 0, &sl->ex));
        for (int d = 0; d < DG_MESH_NDIM; d++)
            if (m->par.mesh.size[d] > 1) DG_TRY(dg_exec_attach_comm(sl->ex, d, m->par.comm[d]));
        sl->ex->rt.frozen = m->frozen;
        sl->ex->rt.n_frozen_slots = m->np;
    }
    bind_slot(m, 0);
    return DG_OK;
}

int dg_model_stage_n_slots(const dg_model_t *m) {
    return m->n_slots;
}

int dg_model_stage_has_input(const dg_model_t *m) {
    return m->x_in != NULL;
}

int dg_model_stage_has_loss(const dg_model_t *m) {
    return m->losses != NULL;
}

size_t dg_model_stage_act_bytes(const dg_model_t *m) {
    return (size_t)m->B * (size_t)m->T * (size_t)m->d.d_model * dg_dtype_size(m->g->act_dtype);
}

static dg_exec_t *slot_ex(dg_model_t *m, int s) {
    return s == 0 ? m->ex : m->slots[s].ex;
}

void *dg_model_stage_input(dg_model_t *m, int s) {
    return s >= 0 && s < m->n_slots ? m->slots[s].x_in : NULL;
}

void *dg_model_stage_seed(dg_model_t *m, int s) {
    return s >= 0 && s < m->n_slots ? m->slots[s].dx : NULL;
}

void *dg_model_stage_output(dg_model_t *m, int s) {
    if (!m->x_out || s < 0 || s >= m->n_slots) return NULL;
    return dg_exec_ptr(slot_ex(m, s), m->x_out);
}

void *dg_model_stage_input_grad(dg_model_t *m, int s) {
    if (!m->x_in || s < 0 || s >= m->n_slots) return NULL;
    const dg_node_t *g = dg_node_grad_of(m->x_in);
    return g ? dg_exec_ptr(slot_ex(m, s), g) : NULL;
}

dg_status_t dg_model_stage_forward(dg_model_t *m, int s, const int32_t *tokens, const int32_t *targets,
                                   float dloss, int eval, float *mean_loss_out) {
    DG_TRY(check_slot(m, s, "stage_forward"));
    dg_model_maybe_stall(m);
    if (!isfinite(dloss)) return DG_ERR(DG_ERR_USAGE, "model: dloss = %g is not finite", (double)dloss);
    dg_backend_t *be = m->be;
    struct dg_stage_slot *sl = &m->slots[s];
    size_t bytes = (size_t)m->B * (size_t)m->T * sizeof(int32_t);
    if (!m->x_in) {
        DG_TRY(dg_model_check_ids(m, tokens, "tokens"));
        DG_TRY(be->ops->to_device(be, sl->tok, tokens, bytes));
    }
    if (m->losses) {
        DG_TRY(dg_model_check_ids(m, targets, "targets"));
        DG_TRY(be->ops->to_device(be, sl->tgt, targets, bytes));
    }
    bind_slot(m, s);
    dg_exec_t *ex = slot_ex(m, s);
    ex->rt.dloss = dloss;
    ex->rt.forward_only = eval != 0;
    dg_status_t st = dg_exec_run_phase(ex, DG_PHASE_FWD);
    ex->rt.forward_only = 0;
    if (st == DG_OK) st = be->ops->sync(be);
    bind_slot(m, 0);
    DG_TRY(st);
    if (m->losses && mean_loss_out) {
        size_t n = (size_t)m->B * (size_t)m->T;
        DG_TRY(be->ops->to_host(be, m->host_losses, dg_exec_ptr(ex, m->losses), n * sizeof(float)));
        *mean_loss_out = dg_model_mean_losses(m);
    }
    return DG_OK;
}

dg_status_t dg_model_stage_backward(dg_model_t *m, int s, int grad_sync) {
    DG_TRY(check_slot(m, s, "stage_backward"));
    bind_slot(m, s);
    dg_exec_t *ex = slot_ex(m, s);
    ex->rt.skip_grad_sync = !grad_sync;
    dg_status_t st = dg_exec_run_phase(ex, DG_PHASE_BWD);
    ex->rt.skip_grad_sync = 0;
    if (st == DG_OK) st = m->be->ops->sync(m->be);
    bind_slot(m, 0);
    return st;
}

/* The OPT phase's CLIP_SCALE: the sum of squares is complete before it. */
static int clip_id(const dg_model_t *m) {
    int first, end;
    dg_graph_phase_range(m->g, DG_PHASE_OPT, &first, &end);
    for (int i = first; i < end; i++)
        if (m->g->nodes[i]->op == DG_OP_CLIP_SCALE) return i;
    return -1;
}

dg_status_t dg_model_opt_sumsq(dg_model_t *m, const dg_optim_hparams_t *h, double *sumsq_out) {
    DG_TRY(check_slot(m, 0, "opt_sumsq"));
    DG_TRY(dg_model_opt_prepare(m, h));
    int first, end, at = clip_id(m);
    dg_graph_phase_range(m->g, DG_PHASE_OPT, &first, &end);
    DG_ASSERT(at >= first);
    DG_TRY(dg_exec_run(m->ex, first, at));
    DG_TRY(m->be->ops->sync(m->be));
    float v = 0;
    DG_TRY(m->be->ops->to_host(m->be, &v, m->scalars_dev + DG_SCALAR_SUMSQ, sizeof v));
    *sumsq_out = v;
    return DG_OK;
}

dg_status_t dg_model_opt_finish(dg_model_t *m, double sumsq, float *grad_norm_out) {
    DG_TRY(check_slot(m, 0, "opt_finish"));
    int first, end, at = clip_id(m);
    dg_graph_phase_range(m->g, DG_PHASE_OPT, &first, &end);
    DG_ASSERT(at >= first);
    float v = (float)sumsq, norm = NAN;
    DG_TRY(m->be->ops->to_device(m->be, m->scalars_dev + DG_SCALAR_SUMSQ, &v, sizeof v));
    DG_TRY(dg_exec_run(m->ex, at, end));
    DG_TRY(m->be->ops->sync(m->be));
    DG_TRY(m->be->ops->to_host(m->be, &norm, m->scalars_dev + DG_SCALAR_NORM, sizeof norm));
    if (grad_norm_out) *grad_norm_out = norm * m->ex->rt.grad_extra;
    return DG_OK;
}

float *dg_model_grad_dev(dg_model_t *m, int i) {
    if (i < 0 || i >= m->np || !m->grad) return NULL;
    return m->grad + m->off[i];
}
