/* pipeline_train.c — the trainer's side of pipeline parallelism (parallel.mesh with pp > 1;
 * docs/parallelism.md "The executor"): the executor (src/pipeline/pp_exec.h) made from the config, and
 * the step's forwards/backwards, optimizer step and evaluation forwards through it. train.c calls these
 * where a one-stage run calls the model directly.
 */
#include <string.h>

#include "dg_hf.h"
#include "pp_exec.h"
#include "train_impl.h"

/* The ranks whose losses count: the last stage's (every rank without a pipeline). */
static dg_status_t trn_pp_params(trainer_t *tr);
static void trn_pp_params_free(trainer_t *tr);

int trn_loss_ranks(const trainer_t *tr) {
    return tr->pp ? tr->world / dg_mesh_pp(&tr->mesh) : tr->world;
}

int trn_has_loss(const trainer_t *tr) {
    return !tr->pp || dg_pp_exec_has_loss(tr->pp);
}

int trn_n_models(const trainer_t *tr) {
    return tr->pp ? dg_pp_exec_n_models(tr->pp) : 1;
}

dg_model_t *trn_model_at(const trainer_t *tr, int k) {
    return tr->pp ? dg_pp_exec_model(tr->pp, k) : tr->model;
}

/* The executor's progress: every action of a step resets this rank's stall timer (as every micro-batch
 * does without a pipeline). */
static void pp_progress(void *ctx, const char *what) {
    trainer_t *tr = ctx;
    dg_health_set_activity(tr->health, tr->step, what);
}

dg_status_t trn_pp_create(trainer_t *tr) {
    const dg_config_t *c = tr->cfg;
    const int pp = dg_mesh_pp(&tr->mesh);
    if (!tr->fsdp->comms || !tr->fsdp->comms->pp_act)
        return DG_ERR(DG_ERR_USAGE, "parallel.mesh = %s: a pipeline needs communicators (pp = %d)",
                      tr->mesh_str, pp);
    if (trn_data_chunk(tr) < tr->accum)
        return DG_ERR(
            DG_ERR_USAGE,
            "parallel.mesh = %s: a pipeline step reads all of its %d micro-batches of %d x %d tokens "
            "ahead, more than the 64 MiB read-ahead; use a smaller train.micro_batch or global_batch",
            tr->mesh_str, tr->accum, tr->micro_batch, tr->desc.seq_len);
    dg_pp_exec_opts_t o =
        dg_pp_exec_opts_for(&tr->desc, tr->be, tr->micro_batch, (uint64_t)c->run.seed, &tr->fsdp->par,
                            tr->fsdp->comms->pp_act, tr->fsdp->comms->pp_grad, tr->comm);
    DG_ASSERT(o.pp == pp && o.stage == dg_mesh_stage(&tr->mesh, tr->rank));
    o.kind = c->parallel.pp_schedule_id;
    o.virt = c->parallel.pp_virtual > 1 ? (int)c->parallel.pp_virtual : 1;
    o.m = tr->accum;
    o.flags = tr->fsdp->opts.model_flags;
    o.on_action = pp_progress;
    o.on_action_ctx = tr;
    DG_TRY(dg_pp_exec_create(&o, &tr->pp));
    tr->model = dg_pp_exec_model(tr->pp, 0);
    return trn_pp_params(tr);
}

void trn_pp_free(trainer_t *tr) {
    if (!tr->pp) return;
    trn_pp_params_free(tr);
    dg_pp_exec_free(tr->pp); /* frees the chunk models, tr->model among them */
    tr->pp = NULL;
    tr->model = NULL;
}

dg_status_t trn_pp_forward_backward(trainer_t *tr, const int32_t *tok, const int32_t *tgt, float dloss,
                                    double *loss_sum) {
    dg_pp_exec_set_step(tr->pp, tr->step + 1); /* named by timeouts, as dg_model_set_step */
    return dg_pp_exec_step(tr->pp, tok, tgt, dloss, loss_sum);
}

dg_status_t trn_pp_zero_grad(trainer_t *tr) {
    return dg_pp_exec_zero_grad(tr->pp);
}

dg_status_t trn_pp_optimizer(trainer_t *tr, const dg_optim_hparams_t *h, float *gnorm) {
    return dg_pp_exec_optimizer(tr->pp, h, gnorm);
}

dg_status_t trn_pp_forward(trainer_t *tr, const int32_t *tok, const int32_t *tgt, float *loss) {
    return dg_pp_exec_forward(tr->pp, tok, tgt, loss);
}

/* ---------------- the parameters in the whole model's order ---------------- */

/* The global tensor table (names and global shapes of a plan-only whole model) and where each tensor is
 * held on this rank. */
static dg_status_t trn_pp_params(trainer_t *tr) {
    dg_model_t *full = NULL;
    DG_TRY(dg_model_create_ex(&tr->desc, tr->be, tr->micro_batch, (uint64_t)tr->cfg->run.seed,
                              DG_MODEL_PLAN_ONLY, &full));
    int n = dg_model_n_tensors(full), nk = dg_pp_exec_n_models(tr->pp);
    tr->n_params = n;
    tr->pp_info = dg_xcalloc((size_t)n, sizeof *tr->pp_info);
    tr->pp_names = dg_xcalloc((size_t)n, sizeof *tr->pp_names);
    tr->pp_chunk_of = dg_xcalloc((size_t)n, sizeof(int));
    tr->pp_index = dg_xcalloc((size_t)n, sizeof(int));
    tr->pp_flat_base = dg_xcalloc((size_t)nk + 1, sizeof(size_t));
    for (int k = 0; k < nk; k++)
        tr->pp_flat_base[k + 1] = tr->pp_flat_base[k] + dg_model_flat_numel(dg_pp_exec_model(tr->pp, k));
    tr->pp_flat_total = tr->pp_flat_base[nk];
    for (int g = 0; g < n; g++) {
        const dg_param_info_t *pi = dg_model_param(full, g);
        snprintf(tr->pp_names[g], sizeof tr->pp_names[g], "%s", pi->name);
        tr->pp_info[g] = *pi;
        tr->pp_info[g].name = tr->pp_names[g];
        tr->pp_chunk_of[g] = -1;
        for (int k = 0; k < nk && tr->pp_chunk_of[g] < 0; k++) {
            dg_model_t *m = dg_pp_exec_model(tr->pp, k);
            int i = dg_model_find_param(m, pi->name);
            if (i < 0) continue;
            tr->pp_chunk_of[g] = k;
            tr->pp_index[g] = i;
            tr->pp_info[g].tp_dim = dg_model_param(m, i)->tp_dim;
        }
    }
    dg_model_free(full);
    return DG_OK;
}

static void trn_pp_params_free(trainer_t *tr) {
    DG_FREE_ALL(tr->pp_info, tr->pp_names, tr->pp_chunk_of, tr->pp_index, tr->pp_flat_base);
}

const dg_param_info_t *trn_param(const trainer_t *tr, int g) {
    if (!tr->pp) return dg_model_param(tr->model, g);
    return g >= 0 && g < tr->n_params ? &tr->pp_info[g] : NULL;
}

int trn_param_pieces(const trainer_t *tr, int g, dg_model_piece_t *pc) {
    if (!tr->pp) return dg_model_local_pieces(tr->model, g, pc);
    int k = tr->pp_chunk_of[g];
    return k < 0 ? 0 : dg_model_local_pieces(dg_pp_exec_model(tr->pp, k), tr->pp_index[g], pc);
}

int trn_param_owner(const trainer_t *tr, int g) {
    if (!tr->pp) return dg_model_piece_owner(tr->model, g);
    int k = tr->pp_chunk_of[g];
    return k < 0 ? 0 : dg_model_piece_owner(dg_pp_exec_model(tr->pp, k), tr->pp_index[g]);
}

size_t trn_param_flat_offset(const trainer_t *tr, int g) {
    if (!tr->pp) return dg_model_flat_offset(tr->model, g);
    int k = tr->pp_chunk_of[g];
    return k < 0 ? 0
                 : tr->pp_flat_base[k] + dg_model_flat_offset(dg_pp_exec_model(tr->pp, k), tr->pp_index[g]);
}

size_t trn_flat_numel(const trainer_t *tr) {
    return tr->pp ? tr->pp_flat_total : dg_model_flat_numel(tr->model);
}

dg_status_t trn_get_flat(trainer_t *tr, int which, float *host) {
    if (!tr->pp) return dg_model_get_flat(tr->model, which, host);
    for (int k = 0; k < dg_pp_exec_n_models(tr->pp); k++)
        DG_TRY(dg_model_get_flat(dg_pp_exec_model(tr->pp, k), which, host + tr->pp_flat_base[k]));
    return DG_OK;
}

dg_status_t trn_set_flat(trainer_t *tr, int which, const float *host) {
    if (!tr->pp) return dg_model_set_flat(tr->model, which, host);
    for (int k = 0; k < dg_pp_exec_n_models(tr->pp); k++)
        DG_TRY(dg_model_set_flat(dg_pp_exec_model(tr->pp, k), which, host + tr->pp_flat_base[k]));
    return DG_OK;
}

dg_status_t trn_set_frozen(trainer_t *tr, int g, int frozen) {
    if (!tr->pp) return dg_model_set_frozen(tr->model, g, frozen);
    const char *name = tr->pp_info[g].name; /* every chunk's copy (the head's wte too) */
    for (int k = 0; k < dg_pp_exec_n_models(tr->pp); k++) {
        dg_model_t *m = dg_pp_exec_model(tr->pp, k);
        int i = dg_model_find_param(m, name);
        if (i >= 0) DG_TRY(dg_model_set_frozen(m, i, frozen));
    }
    return DG_OK;
}

dg_status_t trn_init_weights(trainer_t *tr, const char *spec) {
    if (!tr->pp) return dg_model_init_weights(tr->model, spec);
    for (int k = 0; k < dg_pp_exec_n_models(tr->pp); k++)
        DG_TRY(dg_model_init_weights(dg_pp_exec_model(tr->pp, k), spec));
    return DG_OK;
}
