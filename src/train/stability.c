/* stability.c — the loss-spike detector and the fp16 dynamic loss scale (stability.h). */
#include "stability.h"

#include <math.h>
#include <stdlib.h>

#include "dg_common.h"

void dg_stab_init(dg_stability_t *s, int64_t spike_window, double spike_factor, int64_t spike_max_consecutive,
                  int fp16, double loss_scale_init, int64_t growth_interval, dg_metrics_t *metrics) {
    *s = (dg_stability_t){0};
    s->cap = spike_window > 0 ? spike_window : 0;
    s->window = dg_xcalloc((size_t)(s->cap > 0 ? s->cap : 1), sizeof(float));
    s->spike_factor = spike_factor;
    s->spike_max_consecutive = spike_max_consecutive;
    s->fp16 = fp16;
    s->loss_scale = fp16 ? loss_scale_init : 1.0;
    s->growth_interval = growth_interval;
    s->metrics = metrics;
}

void dg_stab_free(dg_stability_t *s) {
    free(s->window);
    s->window = NULL;
}

dg_stab_verdict_t dg_stab_judge(dg_stability_t *s, int64_t step, double loss) {
    dg_stab_verdict_t v = {.skip = !isfinite(loss)};
    /* compare with the moving average of accepted losses, once the window holds a few */
    if (!v.skip && s->spike_factor > 0 && s->win_n >= (s->cap < 5 ? s->cap : 5)) {
        double avg = 0; /* summed in double in a fixed order */
        for (int64_t i = 0; i < s->win_n; i++)
            avg += s->window[i];
        avg /= (double)s->win_n;
        if (loss > s->spike_factor * avg) v.spike = v.skip = 1;
        if (v.spike) {
            s->consecutive_spikes++;
            DG_METRICS_EVENT(s->metrics, "health", DG_JS("kind", "loss_spike"), DG_JI("step", step),
                             DG_JF("loss", loss), DG_JF("moving_avg", avg),
                             DG_JI("consecutive", s->consecutive_spikes));
            DG_LOG_WARN("step %lld: loss %.4f > %.2f x moving average %.4f: update skipped", (long long)step,
                        loss, s->spike_factor, avg);
        }
    }
    if (!v.spike) s->consecutive_spikes = 0;
    if (!isfinite(loss)) {
        DG_METRICS_EVENT(s->metrics, "health", DG_JS("kind", "nonfinite_loss"), DG_JI("step", step));
        DG_LOG_WARN("step %lld: non-finite loss; update skipped", (long long)step);
    }
    return v;
}

void dg_stab_account(dg_stability_t *s, int64_t step, double loss, float gnorm, dg_stab_verdict_t *v) {
    if (!v->skip && !isfinite(gnorm)) v->skip = 1; /* the model skipped the update (non-finite gradients) */
    if (s->fp16) {
        if (!isfinite(gnorm)) {
            s->loss_scale = s->loss_scale / 2 < 1 ? 1 : s->loss_scale / 2;
            s->good_steps = 0;
        } else if (++s->good_steps >= s->growth_interval) {
            s->loss_scale *= 2;
            s->good_steps = 0;
        }
    } else if (!isfinite(gnorm) && !v->spike && isfinite(loss)) {
        DG_METRICS_EVENT(s->metrics, "health", DG_JS("kind", "nonfinite_grad"), DG_JI("step", step));
        DG_LOG_WARN("step %lld: non-finite gradient norm; update skipped", (long long)step);
    }
    if (!v->skip && s->cap > 0) {
        s->window[s->win_pos] = (float)loss;
        s->win_pos = (s->win_pos + 1) % s->cap;
        if (s->win_n < s->cap) s->win_n++;
    }
}

int dg_stab_wants_rollback(const dg_stability_t *s, const dg_stab_verdict_t *v) {
    return v->spike && s->spike_max_consecutive > 0 && s->consecutive_spikes >= s->spike_max_consecutive;
}

void dg_stab_after_rollback(dg_stability_t *s) {
    s->consecutive_spikes = 0;
    s->win_n = s->win_pos = 0;
}
