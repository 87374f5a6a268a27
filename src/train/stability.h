/* stability.h — the training loop's numerical-stability state: the loss-spike detector (a moving window of
 * accepted losses) and the fp16 dynamic loss scale. One step's flow: dg_stab_judge() on the step's global
 * loss (skip the update? a spike?), the optimizer step unless skipped, then dg_stab_account() with the
 * gradient norm it gave (scaler update, window push, non-finite warnings). Both are deterministic and make
 * the same decisions on every rank (they see the same global loss and norm). The state is checkpointed
 * (train.c save/load_spike_state and the scaler meta) so a resume decides as the run would have.
 * Events go to metrics.jsonl as {"event":"health","kind":...}; see docs/reliability.md.
 */
#ifndef DG_TRAIN_STABILITY_H
#define DG_TRAIN_STABILITY_H

#include <stdint.h>

#include "train_util.h"

typedef struct dg_stability {
    /* loss-spike detector (train.spike_*): window of accepted losses (float: what the checkpoint stores) */
    float *window;
    int64_t cap; /* train.spike_window (0: no window) */
    int64_t win_n, win_pos, consecutive_spikes;
    double spike_factor;           /* train.spike_factor (0: off) */
    int64_t spike_max_consecutive; /* train.spike_max_consecutive (0: never roll back) */
    /* dynamic loss scale (fp16 only; 1 otherwise) */
    int fp16;
    double loss_scale;
    int64_t good_steps, growth_interval; /* train.loss_scale_growth_interval */
    dg_metrics_t *metrics;               /* events; NULL: none */
} dg_stability_t;

/* Verdict on one step's loss: skip = do not apply the update (non-finite loss, or a spike). */
typedef struct dg_stab_verdict {
    int skip, spike;
} dg_stab_verdict_t;

void dg_stab_init(dg_stability_t *s, int64_t spike_window, double spike_factor, int64_t spike_max_consecutive,
                  int fp16, double loss_scale_init, int64_t growth_interval, dg_metrics_t *metrics);
void dg_stab_free(dg_stability_t *s);
/* step is the 1-based number of the step being taken. */
dg_stab_verdict_t dg_stab_judge(dg_stability_t *s, int64_t step, double loss);
/* After the update (or its skip): gnorm is the optimizer's gradient norm (NaN when it did not run or the
 * model skipped a non-finite gradient); v is updated (a non-finite norm is a skip). */
void dg_stab_account(dg_stability_t *s, int64_t step, double loss, float gnorm, dg_stab_verdict_t *v);
/* 1 when this step's spike ends a run of train.spike_max_consecutive spikes: the loop rolls back, then
 * calls dg_stab_after_rollback (window and count start again). */
int dg_stab_wants_rollback(const dg_stability_t *s, const dg_stab_verdict_t *v);
void dg_stab_after_rollback(dg_stability_t *s);

#endif /* DG_TRAIN_STABILITY_H */
