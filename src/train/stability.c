/* stability.c — the loss-spike detector, its confirmation and pause, the rollback history, the fp16
 * dynamic loss scale with the adaptive growth window, and the overflow rate (stability.h). */
#include "stability.h"

#include <math.h>
#include <stdlib.h>

#include "dg_common.h"

/* The adaptive growth window's CV scale: at cv = DG_STAB_CV_REF the window is half-way between its
 * bounds (docs/sla_stability.md "loss scale"). */
#define DG_STAB_CV_REF 0.1
/* Norms needed before the CV is trusted; until then the window is the widest. */
#define DG_STAB_CV_MIN 8

void dg_stab_init(dg_stability_t *s, const dg_stab_opts_t *o, dg_metrics_t *metrics) {
    *s = (dg_stability_t){0};
    s->o = *o;
    s->cap = o->spike_window > 0 ? o->spike_window : 0;
    s->window = dg_xcalloc((size_t)(s->cap > 0 ? s->cap : 1), sizeof(float));
    s->last_val = NAN;
    s->rb_iter = dg_xcalloc((size_t)(o->rollback_max > 0 ? o->rollback_max : 1), sizeof(int64_t));
    s->loss_scale = o->fp16 ? o->loss_scale_init : 1.0;
    s->overflow_rate = s->overflow_mean = 0;
    s->ov_win = dg_xcalloc((size_t)(o->overflow_window > 0 ? o->overflow_window : 1), sizeof(double));
    s->loss_z = NAN;
    s->metrics = metrics;
}

void dg_stab_free(dg_stability_t *s) {
    free(s->window);
    free(s->rb_iter);
    free(s->ov_win);
    s->window = NULL;
    s->rb_iter = NULL;
    s->ov_win = NULL;
}

/* Mean and standard deviation of the window, summed in double in a fixed order. */
static void window_stats(const dg_stability_t *s, double *mean, double *sd) {
    double sum = 0, sq = 0;
    for (int64_t i = 0; i < s->win_n; i++)
        sum += s->window[i];
    *mean = sum / (double)s->win_n;
    for (int64_t i = 0; i < s->win_n; i++)
        sq += (s->window[i] - *mean) * (s->window[i] - *mean);
    *sd = s->win_n > 1 ? sqrt(sq / (double)(s->win_n - 1)) : 0;
}

/* 1 when loss is a spike against the window (ratio: loss > factor x mean; zscore: (loss - mean) / sd >
 * spike_zscore, with sd floored at 1e-3 x mean so a flat window does not make noise a spike). The
 * z-score is kept in s->loss_z in both modes. */
static int is_spike(dg_stability_t *s, double loss, double *mean, double *score) {
    double sd = 0;
    window_stats(s, mean, &sd);
    double floor = 1e-3 * fabs(*mean);
    s->loss_z = (loss - *mean) / (sd > floor ? sd : floor > 0 ? floor : 1e-12);
    if (s->o.spike_mode == DG_SPIKE_ZSCORE) {
        *score = s->loss_z;
        return *score > s->o.spike_zscore;
    }
    *score = *mean > 0 ? loss / *mean : INFINITY;
    return loss > s->o.spike_factor * *mean;
}

dg_stab_verdict_t dg_stab_judge(dg_stability_t *s, int64_t step, double loss) {
    dg_stab_verdict_t v = {.skip = !isfinite(loss)};
    s->loss_z = NAN;
    if (s->pause_left > 0) { /* a confirmed spike's pause: the loss is logged, the update skipped */
        v.skip = v.paused = 1;
        return v;
    }
    /* compare with the moving average of accepted losses, once the window holds a few */
    if (!v.skip && s->o.spike_factor > 0 && s->win_n >= (s->cap < 5 ? s->cap : 5)) {
        double avg = 0, score = 0;
        if (is_spike(s, loss, &avg, &score)) {
            v.spike = v.skip = 1;
            s->consecutive_spikes++;
            DG_METRICS_EVENT(s->metrics, "health", DG_JS("kind", "loss_spike"), DG_JI("step", step),
                             DG_JF("loss", loss), DG_JF("moving_avg", avg), DG_JF("score", score),
                             DG_JS("mode", s->o.spike_mode == DG_SPIKE_ZSCORE ? "zscore" : "ratio"),
                             DG_JI("consecutive", s->consecutive_spikes));
            DG_LOG_WARN("step %lld: loss %.4f is a spike against the moving average %.4f (%s %.2f): update "
                        "skipped",
                        (long long)step, loss, avg, s->o.spike_mode == DG_SPIKE_ZSCORE ? "z-score" : "ratio",
                        score);
        }
    }
    if (!v.spike) s->consecutive_spikes = 0;
    if (!isfinite(loss)) {
        DG_METRICS_EVENT(s->metrics, "health", DG_JS("kind", "nonfinite_loss"), DG_JI("step", step));
        DG_LOG_WARN("step %lld: non-finite loss; update skipped", (long long)step);
    }
    return v;
}

void dg_stab_note_val(dg_stability_t *s, double val) {
    if (isfinite(val)) s->last_val = val;
}

int dg_stab_confirm(dg_stability_t *s, int64_t step, double val) {
    const char *why = NULL;
    double target = NAN;
    if (s->o.spike_max_consecutive > 0 && s->consecutive_spikes >= s->o.spike_max_consecutive)
        why = "consecutive spikes";
    else if (isfinite(s->last_val) && !(val <= s->o.spike_val_factor * s->last_val))
        why = "validation loss rose";
    if (isfinite(s->last_val)) target = s->o.spike_val_factor * s->last_val;
    DG_METRICS_EVENT(s->metrics, "health", DG_JS("kind", "spike_check"), DG_JI("step", step),
                     DG_JF("val_loss", val), DG_JF("last_val_loss", s->last_val),
                     DG_JB("confirmed", why != NULL),
                     DG_JS("reason", why                     ? why
                                     : isnan(val)            ? "no validation data"
                                     : isfinite(s->last_val) ? "validation loss held"
                                                             : "first reference"));
    if (!why) {
        /* no earlier value: this measurement is the reference for the next spike */
        if (!isfinite(s->last_val)) dg_stab_note_val(s, val);
        DG_LOG_INFO(
            "step %lld: loss spike not confirmed (validation loss %.4f, last %.4f): update skipped only",
            (long long)step, val, s->last_val);
        return 0;
    }
    s->pause_left = s->o.spike_pause_steps;
    s->rollback_due = s->pause_left == 0;
    s->spike_step = step;
    DG_METRICS_EVENT(s->metrics, "sla", DG_JS("objective", "loss_spike"), DG_JI("level", 2),
                     DG_JF("value", isnan(val) ? (double)s->consecutive_spikes : val),
                     DG_JF("target", target), DG_JS("action", "rollback"), DG_JI("step", step));
    DG_LOG_WARN(
        "step %lld: loss spike confirmed (%s): %lld paused step(s), then a rollback to the last stable "
        "checkpoint",
        (long long)step, why, (long long)s->pause_left);
    return 1;
}

/* Adds one finite gradient norm to the CV ring. */
static void push_norm(dg_stability_t *s, float gnorm) {
    s->cv_norm[s->cv_pos] = gnorm;
    s->cv_pos = (s->cv_pos + 1) % DG_STAB_CV_N;
    if (s->cv_n < DG_STAB_CV_N) s->cv_n++;
}

double dg_stab_norm_cv(const dg_stability_t *s) {
    if (s->cv_n < DG_STAB_CV_MIN) return NAN;
    double sum = 0, sq = 0;
    for (int64_t i = 0; i < s->cv_n; i++)
        sum += s->cv_norm[i];
    double mean = sum / (double)s->cv_n;
    for (int64_t i = 0; i < s->cv_n; i++)
        sq += (s->cv_norm[i] - mean) * (s->cv_norm[i] - mean);
    double sd = sqrt(sq / (double)(s->cv_n - 1));
    return mean > 0 ? sd / mean : NAN;
}

/* W = Wmin + (Wmax - Wmin) / (1 + (cv / 0.1)^2): a stable norm (cv -> 0) waits Wmax steps between
 * growths, a noisy one (cv >> 0.1) only Wmin; fewer than 8 recent norms: Wmax. */
int64_t dg_stab_growth_window(const dg_stability_t *s) {
    if (!s->o.adaptive_growth) return s->o.growth_interval;
    double cv = dg_stab_norm_cv(s);
    if (isnan(cv)) return s->o.window_max;
    double r = cv / DG_STAB_CV_REF;
    double w = (double)s->o.window_min + (double)(s->o.window_max - s->o.window_min) / (1.0 + r * r);
    int64_t W = (int64_t)llround(w);
    return W < s->o.window_min ? s->o.window_min : W > s->o.window_max ? s->o.window_max : W;
}

/* The overflow rate of this step into the windowed mean; a run of overflow_steps above the threshold
 * is one Level-1 sla event (fp16: the scale halves too). Returns 1 on that run's last step. */
static int account_overflow(dg_stability_t *s, int64_t step, double rate, int norm_bad) {
    s->overflow_rate = isnan(rate) ? 0 : rate;
    if (s->o.overflow_window > 0) {
        s->ov_win[s->ov_pos] = s->overflow_rate;
        s->ov_pos = (s->ov_pos + 1) % s->o.overflow_window;
        if (s->ov_n < s->o.overflow_window) s->ov_n++;
        double sum = 0;
        for (int64_t i = 0; i < s->ov_n; i++)
            sum += s->ov_win[i];
        s->overflow_mean = sum / (double)s->ov_n;
    }
    /* a non-finite norm of finite gradients (their sum of squares overflowed) counts as above, too */
    if (s->overflow_rate > s->o.overflow_threshold || norm_bad)
        s->over_run++;
    else
        s->over_run = 0;
    if (s->o.overflow_steps <= 0 || s->over_run < s->o.overflow_steps) return 0;
    s->over_run = 0;
    DG_METRICS_EVENT(s->metrics, "sla", DG_JS("objective", "overflow_rate"), DG_JI("level", 1),
                     DG_JF("value", s->overflow_rate), DG_JF("target", s->o.overflow_threshold),
                     DG_JS("action", "warn"), DG_JI("step", step));
    DG_LOG_WARN("step %lld: overflow rate %.4f above %.4f for %lld steps in a row%s", (long long)step,
                s->overflow_rate, s->o.overflow_threshold, (long long)s->o.overflow_steps,
                s->o.fp16 ? "; loss scale halved" : "");
    return 1;
}

void dg_stab_account(dg_stability_t *s, int64_t step, double loss, float gnorm, double overflow,
                     dg_stab_verdict_t *v) {
    const int ran = !(v->skip && isnan(gnorm));    /* the optimizer ran (its norm is this step's) */
    if (!v->skip && !isfinite(gnorm)) v->skip = 1; /* the model skipped the update (non-finite gradients) */
    int halve = ran ? account_overflow(s, step, overflow, !isfinite(gnorm)) : 0;
    if (ran && isfinite(gnorm)) push_norm(s, gnorm);
    if (s->o.fp16 && ran) {
        if (halve) {
            s->loss_scale = s->loss_scale / 2 < 1 ? 1 : s->loss_scale / 2;
            s->good_steps = 0;
        } else if (!isfinite(gnorm)) {
            s->good_steps = 0; /* skipped; not yet a halving */
        } else if (++s->good_steps >= dg_stab_growth_window(s)) {
            s->loss_scale *= 2;
            s->good_steps = 0;
        }
    } else if (!s->o.fp16 && ran && !isfinite(gnorm) && isfinite(loss)) {
        DG_METRICS_EVENT(s->metrics, "health", DG_JS("kind", "nonfinite_grad"), DG_JI("step", step),
                         DG_JF("overflow_rate", s->overflow_rate));
        DG_LOG_WARN("step %lld: non-finite gradient norm; update skipped", (long long)step);
    }
    if (v->paused && s->pause_left > 0 && --s->pause_left == 0) s->rollback_due = 1;
    if (!v->skip && s->cap > 0) {
        s->window[s->win_pos] = (float)loss;
        s->win_pos = (s->win_pos + 1) % s->cap;
        if (s->win_n < s->cap) s->win_n++;
    }
}

int dg_stab_rollback_due(const dg_stability_t *s) {
    return s->rollback_due;
}

int dg_stab_pausing(const dg_stability_t *s) {
    return s->pause_left > 0 || s->rollback_due;
}

int dg_stab_note_rollback(dg_stability_t *s, int64_t iter) {
    s->rollback_due = 0;
    s->pause_left = 0;
    s->consecutive_spikes = 0;
    int64_t K = s->o.rollback_max;
    if (K <= 0) return 0;
    s->rb_iter[s->rb_pos] = iter;
    s->rb_pos = (s->rb_pos + 1) % K;
    if (s->rb_n < K) s->rb_n++;
    if (s->rb_n < K) return 0;
    int64_t oldest = s->rb_iter[s->rb_pos]; /* the ring is full: rb_pos is the oldest entry */
    return iter - oldest < s->o.rollback_window;
}
