/* pipeline_train.c — the trainer's side of pipeline parallelism (parallel.mesh with pp > 1;
 * docs/parallelism.md "The executor"): the executor (src/pipeline/pp_exec.h) made from the config, and
 * the step's forwards/backwards, optimizer step and evaluation forwards through it. train.c calls these
 * where a one-stage run calls the model directly.
 */
#include <string.h>

#include "pp_exec.h"
#include "train_impl.h"

/* The ranks whose losses count: the last stage's (every rank without a pipeline). */
int trn_loss_ranks(const trainer_t *tr) {
    return tr->pp ? tr->world / dg_mesh_pp(&tr->mesh) : tr->world;
}

int trn_has_loss(const trainer_t *tr) {
    return !tr->pp || dg_pp_exec_has_loss(tr->pp);
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
    dg_pp_exec_opts_t o;
    memset(&o, 0, sizeof o);
    o.kind = c->parallel.pp_schedule_id;
    o.virt = (int)c->parallel.pp_virtual;
    if (o.virt < 1) o.virt = 1;
    o.pp = pp;
    o.stage = dg_mesh_stage(&tr->mesh, tr->rank);
    o.m = tr->accum;
    o.desc = &tr->desc;
    o.be = tr->be;
    o.micro_batch = tr->micro_batch;
    o.seed = (uint64_t)c->run.seed;
    o.flags = tr->fsdp->opts.model_flags;
    o.par = tr->fsdp->par;
    o.act = tr->fsdp->comms->pp_act;
    o.grad = tr->fsdp->comms->pp_grad;
    o.world = tr->comm;
    DG_TRY(dg_pp_exec_create(&o, &tr->pp));
    tr->model = dg_pp_exec_model(tr->pp, 0);
    return DG_OK;
}

void trn_pp_free(trainer_t *tr) {
    if (!tr->pp) return;
    dg_pp_exec_free(tr->pp); /* frees the chunk models, tr->model among them */
    tr->pp = NULL;
    tr->model = NULL;
}

dg_status_t trn_pp_forward_backward(trainer_t *tr, const int32_t *tok, const int32_t *tgt, float dloss,
                                    double *loss_sum) {
    dg_health_set_activity(tr->health, tr->step, "pipeline forward_backward");
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
