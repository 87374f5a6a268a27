/* test_stability.c — tests of stability.c without MPI or a model: the adaptive loss-scale growth window
 * (shrinks on a noisy gradient-norm stream, grows on a stable one), halving after train.overflow_steps
 * steps above train.overflow_threshold (and not before; a non-finite norm skips without halving at once),
 * the fixed-interval mode, the overflow rate's windowed mean, the ratio and z-score spike tests, the
 * confirmation rules and the pause, and K rollbacks within M iterations. argv[1] names the case. */
#define _GNU_SOURCE
#include "stability.h"
#include "dg_check.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The defaults of the schema (fp16 on), with overrides done by the cases. */
static dg_stab_opts_t defaults(void) {
    return (dg_stab_opts_t){.spike_window = 50,
                            .spike_factor = 2.0,
                            .spike_mode = DG_SPIKE_RATIO,
                            .spike_zscore = 6,
                            .spike_max_consecutive = 3,
                            .spike_val_factor = 1.05,
                            .spike_pause_steps = 5,
                            .rollback_max = 3,
                            .rollback_window = 1000,
                            .fp16 = 1,
                            .loss_scale_init = 65536,
                            .adaptive_growth = 1,
                            .growth_interval = 1000,
                            .window_min = 20,
                            .window_max = 500,
                            .overflow_threshold = 0.008,
                            .overflow_steps = 3,
                            .overflow_window = 10};
}

/* The cases' trackers: fresh(o) makes one with options o; main frees them all (free_all) after the cases */
static dg_stability_t g_trk[16];
static int g_ntrk;

static dg_stability_t *fresh(const dg_stab_opts_t *o) {
    DG_ASSERT(g_ntrk < 16);
    dg_stability_t *s = &g_trk[g_ntrk++];
    dg_stab_init(s, o, NULL);
    return s;
}

static void free_all(void) {
    while (g_ntrk)
        dg_stab_free(&g_trk[--g_ntrk]);
}

/* One accepted step with gradient norm g and overflow rate ov. */
static void step(dg_stability_t *s, int64_t k, double loss, float g, double ov) {
    dg_stab_verdict_t v = dg_stab_judge(s, k, loss);
    dg_stab_account(s, k, loss, v.skip ? NAN : g, v.skip ? NAN : ov, &v);
}

/* A deterministic pseudo-random stream in [-1, 1). */
static double noise(uint64_t *x) {
    *x = *x * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(*x >> 11) / (double)(1ull << 53) * 2 - 1;
}

static void case_window(void) {
    dg_stab_opts_t o = defaults();
    dg_stability_t *s = fresh(&o);
    CHECK(dg_stab_growth_window(s) == 500, "no norms yet: the widest window, got %lld",
          (long long)dg_stab_growth_window(s));
    uint64_t x = 1;
    for (int k = 1; k <= 40; k++) /* stable: 1 +- 0.1 % */
        step(s, k, 3.0, (float)(1.0 + 0.001 * noise(&x)), 0);
    int64_t stable = dg_stab_growth_window(s);
    double cv_stable = dg_stab_norm_cv(s);
    for (int k = 41; k <= 80; k++) /* noisy: 1 +- 80 % */
        step(s, k, 3.0, (float)(1.0 + 0.8 * noise(&x)), 0);
    int64_t noisy = dg_stab_growth_window(s);
    double cv_noisy = dg_stab_norm_cv(s);
    CHECK(stable >= 490 && stable <= 500, "stable stream (cv %.4g): window %lld, expected near 500",
          cv_stable, (long long)stable);
    CHECK(noisy >= 20 && noisy <= 60, "noisy stream (cv %.4g): window %lld, expected near 20", cv_noisy,
          (long long)noisy);
    for (int k = 81; k <= 120; k++) /* stable again: the window grows back */
        step(s, k, 3.0, (float)(2.0 + 0.002 * noise(&x)), 0);
    int64_t again = dg_stab_growth_window(s);
    CHECK(again > 400, "stable again: window %lld, expected it to grow back", (long long)again);
    /* the formula at cv = 0.1 exactly is half-way: 20 + 480 / 2 = 260 */
    dg_stability_t *h = fresh(&o);
    for (int k = 0; k < DG_STAB_CV_N; k++) /* alternating 0.9, 1.1: mean 1, sd 0.1 x sqrt(n / (n - 1)) */
        step(h, k + 1, 3.0, k % 2 ? 1.1f : 0.9f, 0);
    double cv = dg_stab_norm_cv(h), want = 20 + 480 / (1 + (cv / 0.1) * (cv / 0.1));
    CHECK(llabs(dg_stab_growth_window(h) - llround(want)) <= 0, "cv %.6g: window %lld, formula %.3f", cv,
          (long long)dg_stab_growth_window(h), want);
    /* the scale grows after the window: a stable stream doubles it after ~500 good steps, not before */
    dg_stability_t *g = fresh(&o);
    int64_t grew = 0;
    for (int k = 1; k <= 1200 && !grew; k++) {
        step(g, k, 3.0, 1.0f, 0);
        if (g->loss_scale > 65536) grew = k;
    }
    CHECK(grew == 500, "stable norms: the scale doubled at step %lld, expected 500", (long long)grew);
}

static void case_halve(void) {
    dg_stab_opts_t o = defaults();
    dg_stability_t *s = fresh(&o);
    for (int k = 1; k <= 10; k++)
        step(s, k, 3.0, 1.0f, 0);
    /* above the threshold for 2 steps, one below, 2 above: no halving */
    step(s, 11, 3.0, 1.0f, 0.02);
    step(s, 12, 3.0, 1.0f, 0.02);
    step(s, 13, 3.0, 1.0f, 0.005); /* 0.5 % <= 0.8 %: resets the run */
    step(s, 14, 3.0, 1.0f, 0.02);
    step(s, 15, 3.0, 1.0f, 0.02);
    CHECK(s->loss_scale == 65536, "no 3 in a row yet: scale %g", s->loss_scale);
    step(s, 16, 3.0, 1.0f, 0.02);
    CHECK(s->loss_scale == 32768, "3 steps above 0.8 %%: halved, scale %g", s->loss_scale);
    CHECK(s->good_steps == 0, "good steps reset: %lld", (long long)s->good_steps);
    /* a non-finite norm: the update is skipped (verdict), the scale halves only on the third */
    for (int k = 17; k <= 18; k++) {
        dg_stab_verdict_t v = dg_stab_judge(s, k, 3.0);
        dg_stab_account(s, k, 3.0, INFINITY, 0.5, &v);
        CHECK(v.skip == 1, "non-finite norm at step %d must skip", k);
    }
    CHECK(s->loss_scale == 32768, "two overflowing steps: scale %g", s->loss_scale);
    dg_stab_verdict_t v = dg_stab_judge(s, 19, 3.0);
    dg_stab_account(s, 19, 3.0, NAN, 1.0, &v);
    CHECK(v.skip && s->loss_scale == 16384, "third: halved again, scale %g", s->loss_scale);
    CHECK(fabs(s->overflow_rate - 1.0) < 1e-12, "rate of the step: %g", s->overflow_rate);
    /* windowed mean over the last 10 steps: 10..19 = 0, .02 x 5, .005, .5, .5, 1 */
    double want = (0 + 0.02 * 5 + 0.005 + 0.5 + 0.5 + 1.0) / 10;
    CHECK(fabs(s->overflow_mean - want) < 1e-12, "windowed mean %.17g, expected %.17g", s->overflow_mean,
          want);
    /* a fixed threshold of 0.8 % and 3 steps are config keys: 0.05 and 1 step halve at once */
    o.overflow_threshold = 0.05;
    o.overflow_steps = 1;
    dg_stability_t *t = fresh(&o);
    step(t, 1, 3.0, 1.0f, 0.04);
    CHECK(t->loss_scale == 65536, "0.04 <= 0.05: scale %g", t->loss_scale);
    step(t, 2, 3.0, 1.0f, 0.06);
    CHECK(t->loss_scale == 32768, "0.06 > 0.05, 1 step: scale %g", t->loss_scale);
    /* bf16 / fp32: the rate is reported, no scale */
    o.fp16 = 0;
    dg_stability_t *b = fresh(&o);
    step(b, 1, 3.0, 1.0f, 0.5);
    CHECK(b->loss_scale == 1.0 && b->overflow_rate == 0.5, "no scale without fp16: %g %g", b->loss_scale,
          b->overflow_rate);
}

static void case_fixed(void) {
    dg_stab_opts_t o = defaults();
    o.adaptive_growth = 0;
    o.growth_interval = 7;
    dg_stability_t *s = fresh(&o);
    uint64_t x = 5;
    for (int k = 1; k <= 14; k++)
        step(s, k, 3.0, (float)(1 + 0.9 * noise(&x)), 0);
    CHECK(dg_stab_growth_window(s) == 7, "fixed mode ignores the norms: window %lld",
          (long long)dg_stab_growth_window(s));
    CHECK(s->loss_scale == 65536 * 4.0, "two doublings in 14 steps: %g", s->loss_scale);
}

static void case_spike(void) {
    dg_stab_opts_t o = defaults();
    o.fp16 = 0;
    dg_stability_t *s = fresh(&o);
    for (int k = 1; k <= 10; k++)
        step(s, k, 3.0 - 0.05 * k, 1.0f, 0);
    dg_stab_verdict_t v = dg_stab_judge(s, 11, 5.0); /* 5 < 2 x ~2.7: no spike */
    CHECK(!v.spike && !v.skip, "5.0 against a mean of ~2.7 is no ratio-2 spike");
    dg_stab_account(s, 11, 5.0, 1.0f, 0, &v);
    v = dg_stab_judge(s, 12, 8.0);
    CHECK(v.spike && v.skip, "8.0 is a spike");
    /* first validation: no reference yet, so not confirmed; it becomes the reference */
    CHECK(dg_stab_confirm(s, 12, 2.5) == 0 && s->last_val == 2.5, "first measurement is the reference");
    dg_stab_account(s, 12, 8.0, NAN, NAN, &v);
    v = dg_stab_judge(s, 13, 8.0);
    CHECK(v.spike, "again a spike");
    CHECK(dg_stab_confirm(s, 13, 2.6) == 0, "2.6 <= 1.05 x 2.5: held");
    dg_stab_account(s, 13, 8.0, NAN, NAN, &v);
    v = dg_stab_judge(s, 14, 8.0);
    CHECK(v.spike && s->consecutive_spikes == 3, "third spike in a row: %lld",
          (long long)s->consecutive_spikes);
    CHECK(dg_stab_confirm(s, 14, 2.4) == 1, "3 in a row confirm without the validation");
    dg_stab_account(s, 14, 8.0, NAN, NAN, &v);
    /* the pause: 5 skipped steps with no detection, then the rollback is due */
    for (int k = 15; k <= 19; k++) {
        CHECK(!dg_stab_rollback_due(s) && dg_stab_pausing(s), "step %d: pausing", k);
        v = dg_stab_judge(s, k, 100.0);
        CHECK(v.paused && v.skip && !v.spike, "paused step %d", k);
        dg_stab_account(s, k, 100.0, NAN, NAN, &v);
    }
    CHECK(dg_stab_rollback_due(s), "the pause is over: roll back");
    CHECK(dg_stab_note_rollback(s, 19) == 0 && !dg_stab_pausing(s), "first rollback: go on");
    /* a rise of the validation loss confirms */
    dg_stab_note_val(s, 2.0);
    v = dg_stab_judge(s, 20, 50.0);
    CHECK(v.spike && dg_stab_confirm(s, 20, 2.2) == 1, "2.2 > 1.05 x 2.0 confirms");
    /* no validation data: a skipped update only, until spike_max_consecutive in a row */
    dg_stability_t *n = fresh(&o);
    for (int k = 1; k <= 6; k++)
        step(n, k, 3.0, 1.0f, 0);
    v = dg_stab_judge(n, 7, 7.0);
    CHECK(v.spike && dg_stab_confirm(n, 7, NAN) == 0, "no validation data: not confirmed by one spike");
    dg_stab_account(n, 7, 7.0, NAN, NAN, &v);
    v = dg_stab_judge(n, 8, 7.0);
    CHECK(v.spike && dg_stab_confirm(n, 8, NAN) == 0, "nor by two");
    dg_stab_account(n, 8, 7.0, NAN, NAN, &v);
    v = dg_stab_judge(n, 9, 7.0);
    CHECK(v.spike && dg_stab_confirm(n, 9, NAN) == 1, "the third in a row confirms");
    /* z-score mode: a small but far-off value is a spike, a large ratio in a noisy window is not */
    o.spike_mode = DG_SPIKE_ZSCORE;
    o.spike_zscore = 6;
    dg_stability_t *z = fresh(&o);
    uint64_t x = 3;
    for (int k = 1; k <= 40; k++)
        step(z, k, 3.0 + 0.01 * noise(&x), 1.0f, 0);
    v = dg_stab_judge(z, 41, 3.2); /* ~35 sd above */
    CHECK(v.spike, "z-score: 3.2 against 3 +- 0.006 is a spike");
}

static void case_rollbacks(void) {
    dg_stab_opts_t o = defaults();
    o.rollback_max = 3;
    o.rollback_window = 100;
    dg_stability_t *s = fresh(&o);
    CHECK(dg_stab_note_rollback(s, 10) == 0 && dg_stab_note_rollback(s, 50) == 0, "two rollbacks");
    CHECK(dg_stab_note_rollback(s, 120) == 0, "third 110 iterations after the first: outside the window");
    CHECK(dg_stab_note_rollback(s, 140) == 1, "50, 120, 140: three within 100 -> pause");
    o.rollback_max = 0;
    dg_stability_t *n = fresh(&o);
    for (int k = 0; k < 10; k++)
        CHECK(dg_stab_note_rollback(n, k) == 0, "rollback_max = 0 never pauses");
}

int main(int argc, char **argv) {
    static const dg_check_case_t cases[] = {DG_CASE(window), DG_CASE(halve), DG_CASE(fixed), DG_CASE(spike),
                                            DG_CASE(rollbacks)};
    int rc = DG_CHECK_CASES(argc, argv, cases, "CASE", NULL, 0, NULL);
    free_all();
    return rc;
}
