/* test_governor.c — the training SLA governor (src/sla/sla.h, docs/sla.md) on synthetic sample streams:
 * windows and their reduction, hysteresis (fire/clear), Level-2 after level2_after windows, the adaptive
 * step-time budget (learned from accepted steps only, its floor, warm-up and excluded steps), event
 * objectives, disabled objectives and NaN samples, and the config errors. Every event the governor emits
 * is recorded and checked; the log rate limit runs on a fake clock. */
#include <math.h>

#include "dg_check.h"
#include "sla.h"

#define MAX_EV 256
static dg_gov_event_t g_ev[MAX_EV];
static int g_nev;
static double g_clock;

static void on_event(void *ctx, const dg_gov_event_t *ev) {
    (void)ctx;
    if (g_nev < MAX_EV) g_ev[g_nev++] = *ev;
}
static double fake_now(void) {
    return g_clock;
}

static dg_gov_t *make(const dg_sla_cfg_t *c) {
    g_nev = 0;
    g_clock = 1000;
    dg_gov_t *g = dg_gov_create(c, on_event, NULL);
    dg_gov_set_clock(g, fake_now);
    return g;
}

/* make() on the defaults, which *c keeps */
static dg_gov_t *make_defaults(dg_sla_cfg_t *c) {
    dg_sla_cfg_defaults(c);
    return make(c);
}

/* make() on the defaults with objective o set from config text (dg_sla_cfg_set), which *c keeps */
static dg_gov_t *make_with(dg_sla_cfg_t *c, dg_sla_obj_t o, const char *ref, int window, const char *action) {
    dg_sla_cfg_defaults(c);
    OK(dg_sla_cfg_set(c, o, "test", ref, window, action));
    return make(c);
}

/* Events of objective o at `level` seen so far. */
static int count(dg_sla_obj_t o, int level) {
    int n = 0;
    for (int i = 0; i < g_nev; i++)
        n += g_ev[i].objective == o && g_ev[i].level == level;
    return n;
}

/* A deterministic +-2 % jitter around `base` (no randomness: the test must fail the same way each time). */
static double jitter(double base, int i) {
    return base * (1.0 + 0.02 * sin(1.7 * i));
}

/* 200 steps of ~0.2 s with jitter, checkpoint stalls of 1 s, no overflow: no event at all with the
 * defaults (issue 21: a healthy default run emits no Level-1 event). */
static void case_healthy(void) {
    dg_sla_cfg_t c;
    dg_gov_t *g = make_defaults(&c);
    for (int s = 1; s <= 200; s++) {
        CHECK(dg_gov_step_time(g, s, jitter(0.2, s), 0) == DG_SLA_ACT_NONE);
        dg_gov_sample(g, DG_SLA_EXPOSED_COMM, s, 0.05);
        dg_gov_sample(g, DG_SLA_OVERFLOW_RATE, s, 0.0);
        dg_gov_sample(g, DG_SLA_HEARTBEAT_RTT, s, 0.001);
        if (s % 50 == 0) {
            dg_gov_sample(g, DG_SLA_CHECKPOINT_STALL, s, 1.0);
            dg_gov_sample(g, DG_SLA_CHECKPOINT_SUCCESS, s, 1.0);
        }
    }
    CHECK(g_nev == 0, "%d events on a healthy stream (first: objective %d level %d value %g)", g_nev,
          g_nev ? (int)g_ev[0].objective : -1, g_nev ? g_ev[0].level : -1, g_nev ? g_ev[0].value : 0);
    double b = dg_gov_budget(g);
    CHECK(fabs(b - 0.2) < 0.005, "budget %g, expected ~0.2", b);
    dg_gov_stats_t st;
    dg_gov_stats(g, DG_SLA_STEP_TIME, &st);
    /* warm-up 5 steps, 5 more to learn the budget (not judged), then 190 samples in windows of 5 */
    CHECK(st.samples == 190 && st.windows == 38 && st.violating_windows == 0, "samples %lld windows %lld",
          (long long)st.samples, (long long)st.windows);
    dg_gov_free(g);
}

/* A node that becomes 2x slower at step 60: Level-1 step_time after fire_after (2) windows of 5 steps, once,
 * with value ~2 (the ratio to the budget, which the slow steps do not teach); timing objectives default to
 * Level-1 only, so no Level-2 and no action. */
static void case_slow_rank(void) {
    dg_sla_cfg_t c;
    dg_gov_t *g = make_defaults(&c);
    int first_l1 = -1;
    for (int s = 1; s <= 140; s++) {
        double t = jitter(0.2, s) * (s >= 61 ? 2.0 : 1.0);
        CHECK(dg_gov_step_time(g, s, t, 0) == DG_SLA_ACT_NONE, "action at step %d", s);
        if (first_l1 < 0 && count(DG_SLA_STEP_TIME, 1)) first_l1 = s;
    }
    CHECK(count(DG_SLA_STEP_TIME, 1) == 1, "%d Level-1 events", count(DG_SLA_STEP_TIME, 1));
    CHECK(count(DG_SLA_STEP_TIME, 2) == 0, "a Level-2 event from a timing objective by default");
    /* windows end at steps 10, 15, ... (5 warm-up steps): the slow windows are 61-65 (ends 65) and 66-70 */
    CHECK(first_l1 == 70, "Level-1 at step %d, expected 70 (two violating windows)", first_l1);
    for (int i = 0; i < g_nev; i++)
        if (g_ev[i].level == 1) {
            CHECK(fabs(g_ev[i].value - 2.0) < 0.1, "value %g, expected ~2 (ratio to the budget)",
                  g_ev[i].value);
            CHECK(fabs(g_ev[i].target - 1.3) < 1e-9, "target %g, expected 1.3", g_ev[i].target);
            CHECK(g_ev[i].action == DG_SLA_ACT_NONE && g_ev[i].step == 70);
        }
    /* the budget stayed that of the healthy steps */
    CHECK(fabs(dg_gov_budget(g) - 0.2) < 0.01, "budget %g learned the slow steps", dg_gov_budget(g));
    dg_gov_free(g);
}

/* step_time with action requeue: Level-2 after level2_after (4) violating windows in a row, returned to
 * the caller, then the count restarts (the next Level-2 four windows later). */
static void case_level2(void) {
    dg_sla_cfg_t c;
    dg_gov_t *g = make_with(&c, DG_SLA_STEP_TIME, "1, none, 0.3, x", 5, "requeue");
    int acts[200] = {0}, n_act = 0;
    for (int s = 1; s <= 120; s++) {
        double t = jitter(0.2, s) * (s >= 41 ? 3.0 : 1.0);
        dg_sla_action_t a = dg_gov_step_time(g, s, t, 0);
        if (a != DG_SLA_ACT_NONE) {
            CHECK(a == DG_SLA_ACT_REQUEUE, "action %d", (int)a);
            acts[n_act++] = s;
        }
    }
    /* violating windows end at 45, 50, 55, 60 (Level-2), 65, 70, 75, 80 (Level-2), ... */
    CHECK(n_act >= 2 && acts[0] == 60 && acts[1] == 80, "Level-2 at steps %d, %d", n_act ? acts[0] : -1,
          n_act > 1 ? acts[1] : -1);
    CHECK(count(DG_SLA_STEP_TIME, 2) == n_act);
    CHECK(count(DG_SLA_STEP_TIME, 1) == 1, "Level-1 once while firing, got %d", count(DG_SLA_STEP_TIME, 1));
    for (int i = 0; i < g_nev; i++)
        if (g_ev[i].level == 2) CHECK(g_ev[i].action == DG_SLA_ACT_REQUEUE);
    dg_gov_free(g);
}

/* exposed_comm (mean over windows of 10): fires after 2 violating windows, clears after 2 clean ones with
 * a level-0 event, fires again on a new episode; a single violating window does not fire. */
static void case_hysteresis(void) {
    dg_sla_cfg_t c;
    dg_gov_t *g = make_defaults(&c);
    int s = 0;
    /* windows: clean, bad, clean (no fire: one bad window), bad, bad (fire), clean (still firing),
     * clean (clear), bad, bad (fire again) */
    const double win[] = {0.1, 0.9, 0.1, 0.9, 0.9, 0.1, 0.1, 0.9, 0.9};
    int fired_at[9];
    for (int w = 0; w < 9; w++) {
        for (int k = 0; k < 10; k++)
            dg_gov_sample(g, DG_SLA_EXPOSED_COMM, ++s, win[w]);
        fired_at[w] = count(DG_SLA_EXPOSED_COMM, 1) * 10 + count(DG_SLA_EXPOSED_COMM, 0);
    }
    CHECK(fired_at[2] == 0, "fired after one violating window");
    CHECK(fired_at[4] == 10, "not fired after two violating windows (%d)", fired_at[4]);
    CHECK(fired_at[5] == 10, "cleared after one clean window");
    CHECK(fired_at[6] == 11, "not cleared after two clean windows (%d)", fired_at[6]);
    CHECK(fired_at[8] == 21, "the second episode: %d", fired_at[8]);
    dg_gov_stats_t st;
    dg_gov_stats(g, DG_SLA_EXPOSED_COMM, &st);
    CHECK(st.windows == 9 && st.violating_windows == 5 && st.level1 == 2 && st.firing == 1);
    /* a NaN sample is ignored (no window advance) */
    dg_gov_sample(g, DG_SLA_EXPOSED_COMM, ++s, NAN);
    dg_gov_stats(g, DG_SLA_EXPOSED_COMM, &st);
    CHECK(st.samples == 90, "NaN counted: %lld samples", (long long)st.samples);
    dg_gov_free(g);
}

/* Steps of milliseconds that double are judged against the floor (budget_floor_s 0.1 s): no event. The
 * same doubling above the floor fires. */
static void case_floor(void) {
    dg_sla_cfg_t c;
    dg_gov_t *g = make_defaults(&c);
    for (int s = 1; s <= 100; s++)
        dg_gov_step_time(g, s, jitter(0.004, s) * (s > 30 ? 2 : 1), 0);
    CHECK(g_nev == 0, "%d events for ms steps under the floor", g_nev);
    dg_gov_free(g);
    c.budget_floor_s = 0.001;
    g = make(&c);
    for (int s = 1; s <= 100; s++)
        dg_gov_step_time(g, s, jitter(0.004, s) * (s > 30 ? 2 : 1), 0);
    CHECK(count(DG_SLA_STEP_TIME, 1) == 1, "a 1 ms floor: %d Level-1 events", count(DG_SLA_STEP_TIME, 1));
    dg_gov_free(g);
}

/* Event objectives fire on their first violating window and clear on the first clean one; with an action,
 * Level-2 comes with the Level-1. The Level-1 log line is rate-limited, the events are not. */
static void case_event_objectives(void) {
    dg_sla_cfg_t c;
    dg_gov_t *g = make_with(&c, DG_SLA_CHECKPOINT_STALL, "10, none, 0, s", 1, "checkpoint");
    CHECK(dg_gov_sample(g, DG_SLA_CHECKPOINT_STALL, 10, 2.0) == DG_SLA_ACT_NONE);
    CHECK(dg_gov_sample(g, DG_SLA_CHECKPOINT_STALL, 20, 30.0) == DG_SLA_ACT_CHECKPOINT, "no Level-2");
    CHECK(count(DG_SLA_CHECKPOINT_STALL, 1) == 1 && count(DG_SLA_CHECKPOINT_STALL, 2) == 1);
    CHECK(dg_gov_sample(g, DG_SLA_CHECKPOINT_STALL, 30, 1.0) == DG_SLA_ACT_NONE);
    CHECK(count(DG_SLA_CHECKPOINT_STALL, 0) == 1, "not cleared by one clean save");
    g_clock += 1; /* within warn_interval_s: the events still come */
    CHECK(dg_gov_sample(g, DG_SLA_CHECKPOINT_STALL, 40, 50.0) == DG_SLA_ACT_CHECKPOINT);
    CHECK(count(DG_SLA_CHECKPOINT_STALL, 1) == 2);
    /* checkpoint_success: window 2, lower bound 0.5: one failed save of two is not below it, two are */
    dg_gov_sample(g, DG_SLA_CHECKPOINT_SUCCESS, 50, 1.0);
    dg_gov_sample(g, DG_SLA_CHECKPOINT_SUCCESS, 60, 0.0);
    CHECK(count(DG_SLA_CHECKPOINT_SUCCESS, 1) == 0, "one failure of two fired");
    dg_gov_sample(g, DG_SLA_CHECKPOINT_SUCCESS, 70, 0.0);
    dg_gov_sample(g, DG_SLA_CHECKPOINT_SUCCESS, 80, 0.0);
    CHECK(count(DG_SLA_CHECKPOINT_SUCCESS, 1) == 1, "two failures of two did not fire");
    /* recovery_time: 600 s default */
    dg_gov_sample(g, DG_SLA_RECOVERY_TIME, 81, 12.0);
    CHECK(count(DG_SLA_RECOVERY_TIME, 1) == 0);
    dg_gov_sample(g, DG_SLA_RECOVERY_TIME, 82, 900.0);
    CHECK(count(DG_SLA_RECOVERY_TIME, 1) == 1);
    dg_gov_free(g);
}

/* Excluded steps (after a checkpoint, validation, resume) and the warm-up are neither judged nor taught. */
static void case_excluded(void) {
    dg_sla_cfg_t c;
    dg_gov_t *g = make_defaults(&c);
    for (int s = 1; s <= 5; s++) /* warm-up: a slow first step (compile, tuning) */
        dg_gov_step_time(g, s, 5.0, 0);
    CHECK(isnan(dg_gov_budget(g)), "the warm-up taught the budget");
    for (int s = 6; s <= 60; s++)
        dg_gov_step_time(g, s, s % 10 == 0 ? 4.0 : jitter(0.2, s), s % 10 == 0);
    CHECK(g_nev == 0, "excluded slow steps fired (%d events)", g_nev);
    CHECK(fabs(dg_gov_budget(g) - 0.2) < 0.01, "budget %g", dg_gov_budget(g));
    dg_gov_stats_t st;
    dg_gov_stats(g, DG_SLA_STEP_TIME, &st);
    /* steps 6..60: 6 excluded, 5 more learn the budget before any is judged */
    CHECK(st.samples == 44, "%lld samples, expected 44 (55 steps, 6 excluded, 5 learning)",
          (long long)st.samples);
    dg_gov_free(g);
}

/* "off" and sla.enabled = 0: nothing judged; tokens_per_s is off until set, and judged once set. */
static void case_disabled(void) {
    dg_sla_cfg_t c;
    dg_sla_cfg_defaults(&c);
    CHECK(!c.obj[DG_SLA_TOKENS_PER_S].enabled, "tokens_per_s on by default");
    dg_gov_t *g = make(&c);
    for (int s = 1; s <= 40; s++)
        dg_gov_sample(g, DG_SLA_TOKENS_PER_S, s, 10.0);
    CHECK(g_nev == 0);
    dg_gov_free(g);
    OK(dg_sla_cfg_set(&c, DG_SLA_TOKENS_PER_S, "test", "1000, -0.1, none, tok/s", 10, "none"));
    g = make(&c);
    for (int s = 1; s <= 40; s++)
        dg_gov_sample(g, DG_SLA_TOKENS_PER_S, s, 500.0);
    CHECK(count(DG_SLA_TOKENS_PER_S, 1) == 1, "a floor of 900 tok/s against 500: %d events",
          count(DG_SLA_TOKENS_PER_S, 1));
    dg_gov_free(g);
    c.enabled = 0;
    g = make(&c);
    for (int s = 1; s <= 100; s++) {
        dg_gov_sample(g, DG_SLA_TOKENS_PER_S, s, 500.0);
        dg_gov_step_time(g, s, s > 30 ? 9.0 : 0.2, 0);
    }
    CHECK(g_nev == 0, "sla.enabled = 0 emitted %d events", g_nev);
    dg_gov_free(g);
}

static void case_config_errors(void) {
    dg_sla_cfg_t c;
    dg_sla_cfg_defaults(&c);
    CHECK(dg_sla_cfg_set(&c, DG_SLA_STEP_TIME, "f.ini:3", "1, none, 0.3, x", 0, "none") == DG_ERR_USAGE);
    CHECK(strstr(dg_last_error(), "sla.step_time_window = 0") != NULL, "%s", dg_last_error());
    CHECK(dg_sla_cfg_set(&c, DG_SLA_STEP_TIME, "f.ini:3", "1, none, 0.3, x", 5, "explode") == DG_ERR_USAGE);
    CHECK(strstr(dg_last_error(), "'explode'") && strstr(dg_last_error(), "requeue"), "%s", dg_last_error());
    CHECK(dg_sla_cfg_set(&c, DG_SLA_GRAD_SYNC_LATENCY, "f.ini:4", "2, none, 0, tok/s", 5, "none") ==
              DG_ERR_USAGE,
          "a rate accepted for a time objective");
    CHECK(dg_sla_obj_find("loss_spike") == DG_SLA_LOSS_SPIKE && dg_sla_obj_find("nope") == -1);
    CHECK(dg_sla_action_parse("pause") == DG_SLA_ACT_PAUSE && dg_sla_action_parse("x") == -1);
    CHECK_STR(dg_sla_obj_name(DG_SLA_RECOVERY_TIME), "recovery_time");
    CHECK(dg_sla_obj_name(DG_SLA_N) == NULL);
}

int main(int argc, char **argv) {
    static const dg_check_case_t cases[] = {
        DG_CASE(healthy),    DG_CASE(slow_rank), DG_CASE(level2),
        DG_CASE(hysteresis), DG_CASE(floor),     DG_CASE(event_objectives),
        DG_CASE(excluded),   DG_CASE(disabled),  DG_CASE(config_errors)};
    return DG_CHECK_CASES(argc, argv, cases, "CASE|all", NULL, 0, NULL);
}
