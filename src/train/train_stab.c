/* train_stab.c — the trainer's side of stability.h: the stability options from the config, the overflow
 * rate of a step's gradients, a loss spike's confirmation by validation, and the rollback with its
 * K-in-M pause for an operator (exit 5). Every function is collective over tr->comm and returns the
 * same verdict on every rank.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dg_env.h"
#include "train_impl.h"

void trn_stab_opts(const dg_config_t *c, dg_stab_opts_t *o) {
    *o = (dg_stab_opts_t){.spike_window = c->train.spike_window,
                          .spike_factor = c->train.spike_factor,
                          .spike_mode = c->train.spike_mode_id,
                          .spike_zscore = c->train.spike_zscore,
                          .spike_max_consecutive = c->train.spike_max_consecutive,
                          .spike_val_factor = c->train.spike_val_factor,
                          .spike_pause_steps = c->train.spike_pause_steps,
                          .rollback_max = c->train.rollback_max,
                          .rollback_window = c->train.rollback_window,
                          .fp16 = trn_is_fp16(c),
                          .loss_scale_init = c->train.loss_scale_init,
                          .adaptive_growth = c->train.loss_scale_growth_id == 0,
                          .growth_interval = c->train.loss_scale_growth_interval,
                          .window_min = c->train.loss_scale_window_min,
                          .window_max = c->train.loss_scale_window_max,
                          .overflow_threshold = c->train.overflow_threshold,
                          .overflow_steps = c->train.overflow_steps,
                          .overflow_window = c->train.overflow_window};
}

/* 1 when this rank's pieces of parameter i's gradient (in the flat host copy g) hold an inf/NaN. */
static int piece_overflows(const trainer_t *tr, const float *g, int i) {
    dg_model_piece_t pc[DG_MODEL_MAX_PIECES];
    int np = trn_param_pieces(tr, i, pc);
    const float *t = g + trn_param_flat_offset(tr, i);
    for (int j = 0; j < np; j++) {
        size_t n = (size_t)pc[j].count[0] * (size_t)(pc[j].count[1] > 0 ? pc[j].count[1] : 1);
        for (size_t e = 0; e < n; e++)
            if (!isfinite(t[pc[j].offset + e])) return 1;
    }
    return 0;
}

/* The norm pass gives the answer for a finite norm: a finite sum of squares has no inf/NaN term, so
 * the rate is 0. Every rank enters one small agreement first (the optimizer step's outcome and whether its
 * norm is finite, MPI_MAX), so that a rank that failed, or whose norm alone is non-finite, cannot leave
 * the others in a different collective. The norm is global over the ranks that share parameters (the
 * norm pass all-reduces it over shards and tp pieces; dp replicas hold identical gradients), so ranks
 * that disagree on its finiteness mean one replica's gradients were corrupted after the all-reduce: the
 * replicas' weights now differ (AdamW skipped itself on some ranks only), a runtime error on every rank
 * (docs/reliability.md). A non-finite norm everywhere (the model skipped the update) is followed by one
 * pass over this rank's gradient pieces; a tensor overflows when any rank's piece does (MPI_MAX over the
 * per-tensor flags: FSDP shards and tp pieces alike). Frozen tensors are not counted. */
dg_status_t trn_overflow_rate(trainer_t *tr, dg_status_t st, float gnorm, double *rate) {
    *rate = NAN;
    int loc[3] = {st != DG_OK, st == DG_OK && !isfinite(gnorm), st == DG_OK && isfinite(gnorm)}, all[3];
    if (MPI_Allreduce(loc, all, 3, MPI_INT, MPI_MAX, tr->comm) != MPI_SUCCESS)
        return st ? st
                  : DG_ERR(DG_ERR_PEER, "optimizer agreement all-reduce failed at step %lld",
                           (long long)tr->step + 1);
    if (st) return st;
    if (all[0])
        return DG_ERR(DG_ERR_PEER, "another rank failed in its optimizer step at step %lld (see its log)",
                      (long long)tr->step + 1);
    if (all[1] && all[2])
        return DG_ERR(DG_ERR_RUNTIME,
                      "step %lld: the gradient norm is non-finite on some ranks and finite on others after "
                      "the gradient all-reduce (this rank: %g); replicas must hold identical gradients, so "
                      "one rank's were corrupted (memory or device fault?) and the replicas' weights now "
                      "differ: stopping; resume from the last checkpoint",
                      (long long)tr->step + 1, (double)gnorm);
    *rate = 0;
    if (!all[1]) return DG_OK;
    int n = tr->n_params;
    float *g = dg_xmalloc((trn_flat_numel(tr) + 1) * sizeof(float));
    int *flag = dg_xcalloc((size_t)n + 1, sizeof(int)), *any = dg_xcalloc((size_t)n + 1, sizeof(int));
    st = trn_get_flat(tr, DG_STATE_GRAD, g);
    for (int i = 0; i < n && st == DG_OK; i++)
        flag[i] = tr->frozen[i] ? 0 : piece_overflows(tr, g, i);
    /* a failed read on one rank is agreed in the same collective (flag -1) */
    if (st != DG_OK) flag[n] = 1;
    if (MPI_Allreduce(flag, any, n + 1, MPI_INT, MPI_MAX, tr->comm) != MPI_SUCCESS)
        st = DG_ERR(DG_ERR_PEER, "overflow-rate all-reduce failed at step %lld", (long long)tr->step + 1);
    else if (st == DG_OK && any[n])
        st = DG_ERR(DG_ERR_PEER, "another rank failed reading its gradients at step %lld (see its log)",
                    (long long)tr->step + 1);
    int counted = 0, over = 0;
    for (int i = 0; i < n; i++)
        if (!tr->frozen[i]) counted++, over += any[i] != 0;
    *rate = counted ? (double)over / counted : 0;
    free(g);
    free(flag);
    free(any);
    return st;
}

/* 1 on every rank when checkpoint LATEST exists (rank 0 looks; the checkpoint directory is shared). */
static int have_checkpoint(trainer_t *tr) {
    int have = 0;
    if (tr->rank == 0) {
        char lp[sizeof tr->ckpt_dir + 16];
        snprintf(lp, sizeof lp, "%s/LATEST", tr->ckpt_dir);
        have = access(lp, R_OK) == 0;
    }
    if (MPI_Bcast(&have, 1, MPI_INT, 0, tr->comm) != MPI_SUCCESS) return 0;
    return have;
}

/* Test hooks (env.c; compiled in only with DG_TEST_HOOKS): DG_TEST_SPIKE_STEP=S multiplies the loss the
 * detector sees at step S by DG_TEST_SPIKE_LOSS_MULT, once (every time with DG_TEST_SPIKE_REPEAT=1), and
 * the validation loss that checks that spike by DG_TEST_SPIKE_VAL_MULT, as a real divergence raises both.
 * The same on every rank (the loss is the agreed one). */
static int g_hook_armed; /* the hook's spike is being checked */
static int g_hook_fired;

double trn_hook_loss(int64_t step, double loss) {
    int64_t s = dg_env_int("DG_TEST_SPIKE_STEP");
    g_hook_armed = 0;
    if (s < 1 || s != step || (g_hook_fired && !dg_env_bool("DG_TEST_SPIKE_REPEAT"))) return loss;
    g_hook_fired = g_hook_armed = 1;
    DG_LOG_WARN("test hook DG_TEST_SPIKE_STEP=%lld: loss x %lld", (long long)s,
                (long long)dg_env_int("DG_TEST_SPIKE_LOSS_MULT"));
    return loss * (double)dg_env_int("DG_TEST_SPIKE_LOSS_MULT");
}

/* DG_TEST_GRAD_NAN_STEP=S (hook): at steps S .. S + DG_TEST_GRAD_NAN_COUNT - 1 rank 0 alone writes a NaN
 * into the first element of its piece of parameter 0's gradient, after the backward and before the norm
 * pass: the other ranks' pieces stay finite, so the tensor overflows only through the agreement. */
dg_status_t trn_hook_grad(trainer_t *tr, int64_t step) {
    int64_t s = dg_env_int("DG_TEST_GRAD_NAN_STEP"), n = dg_env_int("DG_TEST_GRAD_NAN_COUNT");
    if (s < 1 || step < s || step >= s + n || tr->rank != 0) return DG_OK;
    size_t numel = dg_model_local_numel(tr->model, 0);
    if (numel == 0) return DG_OK;
    float *g = dg_xmalloc(numel * sizeof(float));
    dg_status_t st = dg_model_get_local(tr->model, 0, DG_STATE_GRAD, g);
    g[0] = NAN;
    if (st == DG_OK) st = dg_model_set_local(tr->model, 0, DG_STATE_GRAD, g);
    free(g);
    DG_LOG_WARN("test hook DG_TEST_GRAD_NAN_STEP: a NaN in parameter 0's gradient at step %lld",
                (long long)step);
    return st;
}

static double hook_val(double vl) {
    return g_hook_armed ? vl * (double)dg_env_int("DG_TEST_SPIKE_VAL_MULT") : vl;
}

/* A spike at 1-based step `step`: validation on data.val_batches held-out batches, then the confirmation
 * (stability.h). Without a checkpoint to roll back to, a confirmed spike stays a skipped update. */
dg_status_t trn_spike_check(trainer_t *tr, int64_t step) {
    double vl = NAN;
    if (tr->val_ld) {
        DG_TRY(trn_run_validation(tr, &vl));
        vl = hook_val(vl);
    }
    if (!dg_stab_confirm(&tr->stab, step, vl)) return DG_OK;
    if (!have_checkpoint(tr)) {
        tr->stab.pause_left = 0;
        tr->stab.rollback_due = 0;
        DG_METRICS_EVENT(tr->metrics, "health", DG_JS("kind", "rollback_unavailable"), DG_JI("step", step),
                         DG_JS("reason", "no checkpoint yet (set checkpoint.every)"));
        DG_LOG_WARN(
            "step %lld: confirmed loss spike but no checkpoint to roll back to (set checkpoint.every): "
            "the update is skipped and training goes on",
            (long long)step);
    }
    return DG_OK;
}

/* The rollback of a confirmed spike after its pause; the rollback_max-th within rollback_window loop
 * iterations checkpoints the rolled-back state and stops with DG_ERR_PAUSE (exit 5). */
dg_status_t trn_stab_rollback(trainer_t *tr, int64_t iter) {
    int64_t spike = tr->stab.spike_step;
    DG_TRY(trn_rollback(tr));
    if (!dg_stab_note_rollback(&tr->stab, iter)) return DG_OK;
    DG_TRY(trn_save_checkpoint(tr, 1));
    const dg_config_t *c = tr->cfg;
    DG_METRICS_EVENT(tr->metrics, "sla", DG_JS("objective", "loss_spike"), DG_JI("level", 2),
                     DG_JF("value", (double)c->train.rollback_max),
                     DG_JF("target", (double)c->train.rollback_max), DG_JS("action", "pause"),
                     DG_JI("step", tr->step));
    DG_METRICS_EVENT(tr->metrics, "done", DG_JI("step", tr->step), DG_JS("reason", "pause"),
                     DG_JI("spike_step", spike), DG_JI("exit_code", DG_ERR_PAUSE));
    DG_LOG_WARN("%lld rollbacks within %lld steps (train.rollback_max, train.rollback_window): checkpointed "
                "step %lld and pausing for an operator (exit 5)",
                (long long)c->train.rollback_max, (long long)c->train.rollback_window, (long long)tr->step);
    return DG_ERR(
        DG_ERR_PAUSE,
        "paused for an operator after %lld loss-spike rollbacks within %lld steps; the checkpoint of "
        "step %lld is complete (inspect the data after it, then resume)",
        (long long)c->train.rollback_max, (long long)c->train.rollback_window, (long long)tr->step);
}
