/* governor.c — the training SLA objectives: windows, hysteresis, Level-1/Level-2 (sla.h). */
#define _GNU_SOURCE
#include "sla.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define GOV_MAX_WINDOW 1024
#define GOV_MAX_BUDGET 1024

typedef struct {
    const char *name;
    dg_dim_t dim;
    int is_event;
    const char *ref; /* default target ("off" = off until set) */
    int window;
    const char *doc;
} obj_info_t;

/* Defaults (docs/sla.md "The protocol"): on and quiet for a healthy run, timing objectives Level-1 only. */
static const obj_info_t k_obj[DG_SLA_N] = {
    {"step_time", DG_DIM_RATIO, 0, "1, none, 0.3, x", 5, "step time / adaptive budget"},
    {"tokens_per_s", DG_DIM_TOKRATE, 0, "off", 10, "tokens per second, all ranks"},
    {"exposed_comm", DG_DIM_RATIO, 0, "0.5, none, 0, frac", 10, "communication not hidden by compute"},
    {"grad_sync_latency", DG_DIM_TIME, 0, "2, none, 0, s", 10, "gradient all-reduce/reduce-scatter latency"},
    {"overflow_rate", DG_DIM_RATIO, 0, "0.008, none, 0, frac", 10, "gradients with inf/NaN, fraction"},
    {"loss_spike", DG_DIM_ZSCORE, 1, "6, none, 0, z", 1, "loss z-score against its moving average"},
    {"heartbeat_rtt", DG_DIM_TIME, 0, "1, none, 0, s", 10, "heartbeat round trip"},
    {"checkpoint_stall", DG_DIM_TIME, 1, "120, none, 0, s", 1, "seconds the loop was blocked by a save"},
    {"checkpoint_success", DG_DIM_RATIO, 1, "1, -0.5, none, frac", 2, "fraction of saves that completed"},
    {"recovery_time", DG_DIM_TIME, 1, "600, none, 0, s", 1, "job start to first step after resume"},
    {"memory_plan", DG_DIM_RATIO, 1, "1, -0.05, 0.05, x", 1, "a step's peak device memory / the plan"},
};

static const char *const k_act[] = {"none", "checkpoint", "rollback", "requeue", "pause"};

const char *dg_sla_obj_name(dg_sla_obj_t o) {
    return (unsigned)o < DG_SLA_N ? k_obj[o].name : NULL;
}
int dg_sla_obj_find(const char *name) {
    for (int i = 0; i < DG_SLA_N; i++)
        if (strcmp(k_obj[i].name, name) == 0) return i;
    return -1;
}
dg_dim_t dg_sla_obj_dim(dg_sla_obj_t o) {
    return k_obj[o].dim;
}
int dg_sla_obj_is_event(dg_sla_obj_t o) {
    return k_obj[o].is_event;
}
const char *dg_sla_action_name(dg_sla_action_t a) {
    return (unsigned)a < sizeof k_act / sizeof *k_act ? k_act[a] : "?";
}
int dg_sla_action_parse(const char *t) {
    for (int i = 0; i < (int)(sizeof k_act / sizeof *k_act); i++)
        if (strcmp(k_act[i], t) == 0) return i;
    return -1;
}

dg_status_t dg_sla_cfg_set(dg_sla_cfg_t *c, dg_sla_obj_t o, const char *where, const char *ref_text,
                           int window, const char *action_text) {
    dg_sla_obj_cfg_t *oc = &c->obj[o];
    char key[64];
    dg_fmt(key, sizeof key, "sla.%s", k_obj[o].name);
    if (window < 1 || window > GOV_MAX_WINDOW)
        return DG_ERR(DG_ERR_USAGE, "%s: %s_window = %d: expected 1..%d samples", where, key, window,
                      GOV_MAX_WINDOW);
    int a = dg_sla_action_parse(action_text);
    if (a < 0)
        return DG_ERR(DG_ERR_USAGE, "%s: %s_action = '%s': expected none|checkpoint|rollback|requeue|pause",
                      where, key, action_text);
    oc->window = window;
    oc->l2 = (dg_sla_action_t)a;
    if (strcasecmp(ref_text, "off") == 0) {
        oc->enabled = 0;
        memset(&oc->ref, 0, sizeof oc->ref);
        return DG_OK;
    }
    DG_TRY(dg_sla_ref_parse(where, key, ref_text, k_obj[o].dim, &oc->ref));
    snprintf(oc->ref.source, sizeof oc->ref.source, "%s", where);
    oc->enabled = 1;
    return DG_OK;
}

void dg_sla_cfg_defaults(dg_sla_cfg_t *c) {
    memset(c, 0, sizeof *c);
    c->enabled = 1;
    c->fire_after = 2;
    c->clear_after = 2;
    c->level2_after = 4;
    c->warn_interval_s = 60;
    c->warmup_steps = 5;
    c->budget_steps = 20;
    c->budget_floor_s = 0.1;
    for (int o = 0; o < DG_SLA_N; o++) {
        dg_status_t s = dg_sla_cfg_set(c, (dg_sla_obj_t)o, "default", k_obj[o].ref, k_obj[o].window, "none");
        DG_ASSERTF(s == DG_OK, "built-in default of sla.%s: %s", k_obj[o].name, dg_last_error());
    }
}

typedef struct {
    double win[GOV_MAX_WINDOW];
    int n;                 /* samples in the current window */
    int bad_run, good_run; /* violating / clean windows in a row */
    int firing;            /* Level-1 state */
    double last_log;       /* rate limit of the Level-1 log line */
    int64_t samples, windows, violating, level1, level2;
} obj_state_t;

struct dg_gov {
    dg_sla_cfg_t cfg;
    obj_state_t st[DG_SLA_N];
    dg_gov_event_fn fn;
    void *ctx;
    double (*now)(void);
    /* step_time budget: ring of accepted step times */
    double budget[GOV_MAX_BUDGET];
    int nb, bhead;
    int64_t seen_steps;
};

dg_gov_t *dg_gov_create(const dg_sla_cfg_t *cfg, dg_gov_event_fn fn, void *ctx) {
    dg_gov_t *g = dg_xcalloc(1, sizeof *g);
    g->cfg = *cfg;
    if (g->cfg.budget_steps < 1) g->cfg.budget_steps = 1;
    if (g->cfg.budget_steps > GOV_MAX_BUDGET) g->cfg.budget_steps = GOV_MAX_BUDGET;
    g->fn = fn;
    g->ctx = ctx;
    g->now = dg_now_s;
    for (int o = 0; o < DG_SLA_N; o++)
        g->st[o].last_log = -INFINITY;
    return g;
}

void dg_gov_free(dg_gov_t *g) {
    free(g);
}
void dg_gov_set_clock(dg_gov_t *g, double (*now)(void)) {
    g->now = now ? now : dg_now_s;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(const double *v, int n) {
    double tmp[GOV_MAX_BUDGET > GOV_MAX_WINDOW ? GOV_MAX_BUDGET : GOV_MAX_WINDOW];
    memcpy(tmp, v, (size_t)n * sizeof *v);
    qsort(tmp, (size_t)n, sizeof *tmp, cmp_double);
    return n % 2 ? tmp[n / 2] : 0.5 * (tmp[n / 2 - 1] + tmp[n / 2]);
}

static void emit(dg_gov_t *g, dg_sla_obj_t o, int level, double value, dg_sla_action_t a, int64_t step) {
    dg_gov_event_t ev = {.objective = o,
                         .level = level,
                         .value = value,
                         .target = dg_sla_ref_limit(&g->cfg.obj[o].ref),
                         .action = a,
                         .step = step};
    if (g->fn) g->fn(g->ctx, &ev);
}

/* A full window of objective o: judge it, move the hysteresis, emit events; the Level-2 action or NONE. */
static dg_sla_action_t judge(dg_gov_t *g, dg_sla_obj_t o, int64_t step, double value) {
    obj_state_t *s = &g->st[o];
    const dg_sla_obj_cfg_t *oc = &g->cfg.obj[o];
    int ev = k_obj[o].is_event;
    int fire_after = ev ? 1 : g->cfg.fire_after, clear_after = ev ? 1 : g->cfg.clear_after;
    int l2_after = ev ? 1 : g->cfg.level2_after;
    char ref[128];
    s->windows++;
    if (dg_sla_ref_ok(&oc->ref, value)) {
        s->bad_run = 0;
        if (s->firing && ++s->good_run >= clear_after) {
            s->firing = 0;
            s->good_run = 0;
            emit(g, o, 0, value, DG_SLA_ACT_NONE, step);
            DG_LOG_INFO("sla %s cleared at step %lld (%.4g)", k_obj[o].name, (long long)step, value);
        }
        return DG_SLA_ACT_NONE;
    }
    s->violating++;
    s->good_run = 0;
    s->bad_run++;
    dg_sla_ref_format(&oc->ref, ref, sizeof ref);
    if (!s->firing && s->bad_run >= fire_after) {
        s->firing = 1;
        s->level1++;
        emit(g, o, 1, value, DG_SLA_ACT_NONE, step);
        double t = g->now();
        if (t - s->last_log >= g->cfg.warn_interval_s) {
            s->last_log = t;
            DG_LOG_WARN("sla level 1: %s = %.4g at step %lld violates %s (%d window(s) of %d in a row)",
                        k_obj[o].name, value, (long long)step, ref, s->bad_run, oc->window);
        }
    }
    if (oc->l2 != DG_SLA_ACT_NONE && s->bad_run >= l2_after) {
        s->level2++;
        s->bad_run = 0;
        emit(g, o, 2, value, oc->l2, step);
        DG_LOG_WARN("sla level 2: %s = %.4g at step %lld violates %s: action %s", k_obj[o].name, value,
                    (long long)step, ref, dg_sla_action_name(oc->l2));
        return oc->l2;
    }
    return DG_SLA_ACT_NONE;
}

dg_sla_action_t dg_gov_sample(dg_gov_t *g, dg_sla_obj_t o, int64_t step, double value) {
    DG_ASSERT((unsigned)o < DG_SLA_N);
    const dg_sla_obj_cfg_t *oc = &g->cfg.obj[o];
    if (!g->cfg.enabled || !oc->enabled || isnan(value)) return DG_SLA_ACT_NONE;
    obj_state_t *s = &g->st[o];
    s->samples++;
    s->win[s->n++] = value;
    if (s->n < oc->window) return DG_SLA_ACT_NONE;
    double v;
    if (o == DG_SLA_STEP_TIME) {
        v = median(s->win, s->n);
    } else {
        v = 0;
        for (int i = 0; i < s->n; i++)
            v += s->win[i];
        v /= s->n;
    }
    s->n = 0;
    return judge(g, o, step, v);
}

double dg_gov_budget(const dg_gov_t *g) {
    int need = g->cfg.budget_steps < 5 ? g->cfg.budget_steps : 5;
    return g->nb >= need ? median(g->budget, g->nb) : NAN;
}

dg_sla_action_t dg_gov_step_time(dg_gov_t *g, int64_t step, double seconds, int excluded) {
    g->seen_steps++;
    if (excluded || g->seen_steps <= g->cfg.warmup_steps || !(seconds > 0)) return DG_SLA_ACT_NONE;
    double b = dg_gov_budget(g);
    double ratio = b > 0 ? seconds / fmax(b, g->cfg.budget_floor_s) : NAN;
    const dg_sla_obj_cfg_t *oc = &g->cfg.obj[DG_SLA_STEP_TIME];
    /* a step over the bound does not teach the budget: a node that stays slow keeps violating */
    if (isnan(ratio) || !oc->enabled || dg_sla_ref_ok(&oc->ref, ratio)) {
        g->budget[g->bhead] = seconds;
        g->bhead = (g->bhead + 1) % g->cfg.budget_steps;
        if (g->nb < g->cfg.budget_steps) g->nb++;
    }
    return dg_gov_sample(g, DG_SLA_STEP_TIME, step, ratio);
}

void dg_gov_stats(const dg_gov_t *g, dg_sla_obj_t o, dg_gov_stats_t *out) {
    const obj_state_t *s = &g->st[o];
    *out = (dg_gov_stats_t){.samples = s->samples,
                            .windows = s->windows,
                            .violating_windows = s->violating,
                            .level1 = s->level1,
                            .level2 = s->level2,
                            .firing = s->firing};
}
