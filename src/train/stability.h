/* stability.h — the training loop's numerical-stability state: the loss-spike detector (a moving window of
 * accepted losses), its confirmation and pause state, the rollback history, the fp16 dynamic loss scale
 * and the overflow rate. One step's flow: dg_stab_judge() on the step's global loss (skip the update? a
 * spike? a paused step?), then for a spike the loop measures validation and calls dg_stab_confirm(), the
 * optimizer step unless skipped, then dg_stab_account() with the gradient norm and the overflow rate it
 * gave (scaler update, window push, warnings); a confirmed spike ends, after train.spike_pause_steps paused
 * steps, in dg_stab_rollback_due() = 1 and a rollback (dg_stab_note_rollback). Everything is deterministic
 * and makes the same decisions on every rank (they see the same global loss, norm and rate). The state is
 * checkpointed (train_ckpt.c: spike window, scaler, last validation loss) so a resume decides as the run
 * would have; the pause and the rollback history are not (a resume never starts inside a pause: no
 * checkpoint is written during one). Events go to metrics.jsonl as {"event":"health","kind":...} and
 * {"event":"sla",...}; see docs/reliability.md and docs/sla_stability.md.
 */
#ifndef DG_TRAIN_STABILITY_H
#define DG_TRAIN_STABILITY_H

#include <stdint.h>

#include "train_util.h"

/* Loss-spike test (train.spike_mode). */
typedef enum { DG_SPIKE_RATIO = 0, DG_SPIKE_ZSCORE = 1 } dg_spike_mode_t;

/* The gradient norms the adaptive growth window looks at (the last DG_STAB_CV_N finite ones). */
#define DG_STAB_CV_N 32

typedef struct dg_stab_opts {
    int64_t spike_window;          /* train.spike_window */
    double spike_factor;           /* train.spike_factor (0: off) */
    int spike_mode;                /* dg_spike_mode_t (train.spike_mode) */
    double spike_zscore;           /* train.spike_zscore: z above it is a spike (zscore mode) */
    int64_t spike_max_consecutive; /* train.spike_max_consecutive: that many spikes in a row confirm */
    double spike_val_factor;       /* train.spike_val_factor: val loss > factor x last val confirms */
    int64_t spike_pause_steps;     /* train.spike_pause_steps */
    int64_t rollback_max;          /* train.rollback_max (K); 0: never pause for an operator */
    int64_t rollback_window;       /* train.rollback_window (M, loop iterations) */
    int fp16;
    double loss_scale_init;
    int adaptive_growth;            /* train.loss_scale_growth = adaptive (else fixed) */
    int64_t growth_interval;        /* train.loss_scale_growth_interval (fixed mode) */
    int64_t window_min, window_max; /* train.loss_scale_window_min/_max (adaptive mode) */
    double overflow_threshold;      /* train.overflow_threshold: a fraction, 0.008 = 0.8 % */
    int64_t overflow_steps;         /* train.overflow_steps: consecutive steps above it halve the scale */
    int64_t overflow_window;        /* train.overflow_window: steps of the windowed mean */
} dg_stab_opts_t;

typedef struct dg_stability {
    dg_stab_opts_t o;
    /* loss-spike detector: window of accepted losses (float: what the checkpoint stores) */
    float *window;
    int64_t cap; /* spike_window (0: no window) */
    int64_t win_n, win_pos, consecutive_spikes;
    double last_val;    /* the newest validation loss (NaN: none yet); checkpointed */
    int64_t pause_left; /* > 0: a confirmed spike; that many paused steps remain before the rollback */
    int rollback_due;   /* the pause is over: roll back now */
    int64_t spike_step; /* the confirmed spike's step (1-based) */
    int64_t *rb_iter;   /* loop iterations of the last rollback_max rollbacks (ring) */
    int64_t rb_n, rb_pos;
    /* dynamic loss scale (fp16 only; 1 otherwise) */
    double loss_scale;
    int64_t good_steps;
    int64_t over_run; /* consecutive steps with the overflow rate above the threshold */
    float cv_norm[DG_STAB_CV_N];
    int64_t cv_n, cv_pos;
    /* overflow rate: this step's and the windowed mean */
    double overflow_rate, overflow_mean;
    double *ov_win;
    int64_t ov_n, ov_pos;
    double loss_z;         /* z-score of the last judged loss against the window (NaN: none): the SLA
                            * objective loss_spike's sample, whatever train.spike_mode is */
    dg_metrics_t *metrics; /* events; NULL: none */
} dg_stability_t;

/* Verdict on one step's loss: skip = do not apply the update (non-finite loss, a spike, a paused step). */
typedef struct dg_stab_verdict {
    int skip, spike, paused;
} dg_stab_verdict_t;

void dg_stab_init(dg_stability_t *s, const dg_stab_opts_t *o, dg_metrics_t *metrics);
void dg_stab_free(dg_stability_t *s);
/* step is the 1-based number of the step being taken. */
dg_stab_verdict_t dg_stab_judge(dg_stability_t *s, int64_t step, double loss);
/* A spike's confirmation, after dg_stab_judge flagged one: val is the validation loss measured now (NaN:
 * no validation data). Confirmed when val > spike_val_factor x the last validation loss, or when the spike
 * ends a run of spike_max_consecutive; with no earlier value the measurement becomes the reference, and
 * without validation data only the run of spikes confirms: otherwise the spike is a skipped update.
 * Confirmed: the pause starts (spike_pause_steps paused steps, then dg_stab_rollback_due). Returns 1 when
 * confirmed. */
int dg_stab_confirm(dg_stability_t *s, int64_t step, double val);
/* A validation loss measured by the periodic validation (the reference for confirmations). */
void dg_stab_note_val(dg_stability_t *s, double val);
/* After the update (or its skip): gnorm is the optimizer's gradient norm (NaN when it did not run or the
 * model skipped a non-finite gradient), overflow the fraction of parameter tensors whose gradients hold
 * an inf/NaN (NaN: not measured, the update did not run); v is updated (a non-finite norm is a skip). */
void dg_stab_account(dg_stability_t *s, int64_t step, double loss, float gnorm, double overflow,
                     dg_stab_verdict_t *v);
/* 1 when the pause of a confirmed spike is over: the loop rolls back now. */
int dg_stab_rollback_due(const dg_stability_t *s);
/* 1 while a confirmed spike's pause runs (no validation, no checkpoint). */
int dg_stab_pausing(const dg_stability_t *s);
/* After a rollback at loop iteration `iter` (monotonic, never rolled back): returns 1 when it is the
 * rollback_max-th within rollback_window iterations (pause the run for an operator). */
int dg_stab_note_rollback(dg_stability_t *s, int64_t iter);
/* The fp16 growth window now: growth_interval (fixed mode), or the adaptive one of the recent norms. */
int64_t dg_stab_growth_window(const dg_stability_t *s);
/* The coefficient of variation (std / mean) of the recent finite gradient norms; NaN with fewer than 8. */
double dg_stab_norm_cv(const dg_stability_t *s);

#endif /* DG_TRAIN_STABILITY_H */
