/* train_sla.c — the trainer's side of the SLA governor (train_sla.h). */
#define _GNU_SOURCE
#include "train_sla.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dg_env.h"
#include "dg_json_read.h"
#include "train_impl.h"
#include "train_util.h"

double trn_sla_process_age_s(void) {
    FILE *f = fopen("/proc/self/stat", "r");
    if (!f) return NAN;
    char buf[2048];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces */
    if (!p) return NAN;
    unsigned long long start = 0;
    /* fields after ")": state(3) ... starttime is field 22 */
    int field = 2;
    for (char *t = p + 1; *t && field < 22; t++)
        if (*t == ' ') {
            field++;
            if (field == 22) start = strtoull(t + 1, NULL, 10);
        }
    double up = NAN;
    FILE *u = fopen("/proc/uptime", "r");
    if (u) {
        if (fscanf(u, "%lf", &up) != 1) up = NAN;
        fclose(u);
    }
    long hz = sysconf(_SC_CLK_TCK);
    if (!start || !(up > 0) || hz <= 0) return NAN;
    double age = up - (double)start / (double)hz;
    return age >= 0 ? age : NAN;
}

/* The governor's event callback runs on every rank; only rank 0's metrics object writes. Level-2
 * verdicts of every rank reach `pending` (action * 16 + objective), agreed by max at the step agreement. */
static void sla_event(void *ctx, const dg_gov_event_t *ev) {
    trainer_t *tr = ctx;
    const char *obj = dg_sla_obj_name(ev->objective);
    if (ev->level == 0) {
        DG_METRICS_EVENT(tr->metrics, "sla_clear", DG_JS("objective", obj), DG_JF("value", ev->value),
                         DG_JF("target", ev->target), DG_JI("step", ev->step));
        return;
    }
    DG_METRICS_EVENT(tr->metrics, "sla", DG_JS("objective", obj), DG_JI("level", ev->level),
                     DG_JF("value", ev->value), DG_JF("target", ev->target),
                     DG_JS("action", ev->level == 1 ? "warn" : dg_sla_action_name(ev->action)),
                     DG_JI("step", ev->step));
    if (ev->level == 2) {
        int code = (int)ev->action * 16 + (int)ev->objective; /* agreed by max: the most severe action */
        if (code > tr->sla.pending) tr->sla.pending = code;
    }
}

dg_status_t trn_sla_setup(trainer_t *tr) {
    const dg_config_t *c = tr->cfg;
    dg_sla_cfg_t sc;
    dg_sla_cfg_defaults(&sc);
    sc.enabled = c->sla.enabled;
    sc.fire_after = (int)c->sla.fire_after;
    sc.clear_after = (int)c->sla.clear_after;
    sc.level2_after = (int)c->sla.level2_after;
    sc.warn_interval_s = c->sla.warn_interval_s;
    sc.warmup_steps = (int)c->sla.warmup_steps;
    sc.budget_steps = (int)c->sla.budget_steps;
    sc.budget_floor_s = c->sla.budget_floor_s;
    const struct {
        const char *ref;
        int64_t window;
        const char *action;
    } o[DG_SLA_N] = {
        {c->sla.step_time, c->sla.step_time_window, c->sla.step_time_action},
        {c->sla.tokens_per_s, c->sla.tokens_per_s_window, c->sla.tokens_per_s_action},
        {c->sla.exposed_comm, c->sla.exposed_comm_window, c->sla.exposed_comm_action},
        {c->sla.grad_sync_latency, c->sla.grad_sync_latency_window, c->sla.grad_sync_latency_action},
        {c->sla.overflow_rate, c->sla.overflow_rate_window, c->sla.overflow_rate_action},
        {c->sla.loss_spike, c->sla.loss_spike_window, c->sla.loss_spike_action},
        {c->sla.heartbeat_rtt, c->sla.heartbeat_rtt_window, c->sla.heartbeat_rtt_action},
        {c->sla.checkpoint_stall, c->sla.checkpoint_stall_window, c->sla.checkpoint_stall_action},
        {c->sla.checkpoint_success, c->sla.checkpoint_success_window, c->sla.checkpoint_success_action},
        {c->sla.recovery_time, c->sla.recovery_time_window, c->sla.recovery_time_action},
        {c->sla.memory_plan, c->sla.memory_plan_window, c->sla.memory_plan_action},
    };
    for (int i = 0; i < DG_SLA_N; i++) {
        char key[64];
        dg_fmt(key, sizeof key, "sla.%s", dg_sla_obj_name((dg_sla_obj_t)i));
        const char *src = dg_config_source(c, key);
        DG_TRY(dg_sla_cfg_set(&sc, (dg_sla_obj_t)i, src ? src : "config", o[i].ref, (int)o[i].window,
                              o[i].action));
    }
    tr->sla.gov = dg_gov_create(&sc, sla_event, tr);
    tr->sla.exclude_next = 1;
    tr->sla.lost_steps = tr->sla.lost_tokens = tr->sla.prev_step = -1;
    return DG_OK;
}

void trn_sla_free(trainer_t *tr) {
    dg_gov_free(tr->sla.gov);
    tr->sla.gov = NULL;
    for (int i = 0; i < tr->sla.n_leak; i++)
        tr->be->ops->free(tr->be, tr->sla.leak[i]);
    free(tr->sla.leak);
    tr->sla.leak = NULL;
    tr->sla.n_leak = 0;
}

void trn_sla_mem_begin(trainer_t *tr) {
    if (tr->be->ops->mem_usage) tr->be->ops->mem_usage(tr->be, NULL, NULL, 1);
}

/* DG_TEST_MEM_LEAK_MB from step DG_TEST_MEM_LEAK_STEP: a block of backend memory kept to the end. */
static void test_leak(trainer_t *tr) {
    double mb = dg_env_double("DG_TEST_MEM_LEAK_MB");
    int64_t from = dg_env_int("DG_TEST_MEM_LEAK_STEP");
    if (!(mb > 0) || from < 1 || tr->step < from) return;
    void *p = NULL;
    if (tr->be->ops->alloc(tr->be, (size_t)(mb * 1048576.0), &p) != DG_OK) {
        dg_clear_error();
        return;
    }
    if (tr->step == from)
        DG_LOG_WARN("test hook DG_TEST_MEM_LEAK_MB=%g: every step from %lld keeps %g MB of backend memory",
                    mb, (long long)from, mb);
    void **l = realloc(tr->sla.leak, (size_t)(tr->sla.n_leak + 1) * sizeof *l);
    if (!l) {
        tr->be->ops->free(tr->be, p);
        return;
    }
    tr->sla.leak = l;
    tr->sla.leak[tr->sla.n_leak++] = p;
}

void trn_sla_mem_end(trainer_t *tr) {
    test_leak(tr);
    size_t peak = 0;
    if (!tr->be->ops->mem_usage || !(tr->sla.mem_planned > 0)) return;
    tr->be->ops->mem_usage(tr->be, NULL, &peak, 0);
    double r = (double)peak / tr->sla.mem_planned;
    if (r > tr->sla.mem_ratio_max) tr->sla.mem_ratio_max = r;
    trn_sla_feed(tr, DG_SLA_MEMORY_PLAN, r);
}

void trn_sla_feed(trainer_t *tr, dg_sla_obj_t o, double value) {
    if (tr->sla.gov) dg_gov_sample(tr->sla.gov, o, tr->step, value);
}

void trn_sla_feed_step_health(trainer_t *tr, double overflow_rate, int spike) {
    trn_sla_feed(tr, DG_SLA_OVERFLOW_RATE, overflow_rate);
    if (!spike) trn_sla_feed(tr, DG_SLA_LOSS_SPIKE, tr->stab.loss_z);
    if (tr->health) {
        dg_health_stats_t hs;
        dg_health_get_stats(tr->health, &hs);
        if (hs.rtt_s > 0) trn_sla_feed(tr, DG_SLA_HEARTBEAT_RTT, hs.rtt_s);
    }
}

void trn_sla_after_step(trainer_t *tr, double dt, double tok_per_s) {
    if (!tr->sla.gov) return;
    dg_gov_step_time(tr->sla.gov, tr->step, dt, tr->sla.exclude_next);
    tr->sla.exclude_next = 0;
    dg_gov_sample(tr->sla.gov, DG_SLA_TOKENS_PER_S, tr->step, tok_per_s);
    if (tr->sla.resumed && !tr->sla.recovery_done) {
        tr->sla.recovery_done = 1;
        double total = tr->sla.boot_s + (dg_now_s() - tr->sla.t_entry);
        DG_METRICS_EVENT(tr->metrics, "recovery", DG_JI("step", tr->step), DG_JF("recovery_time_s", total),
                         DG_JF("boot_s", tr->sla.boot_s), DG_JF("checkpoint_read_s", tr->sla.read_s),
                         DG_JF("plan_build_s", tr->sla.plan_s), DG_JI("lost_steps", tr->sla.lost_steps),
                         DG_JI("lost_tokens", tr->sla.lost_tokens));
        DG_LOG_INFO("recovery: %.2f s from process start to step %lld (boot %.2f s, plan build %.2f s, "
                    "checkpoint read %.2f s); work lost: %lld step(s)",
                    total, (long long)tr->step, tr->sla.boot_s, tr->sla.plan_s, tr->sla.read_s,
                    (long long)tr->sla.lost_steps);
        dg_gov_sample(tr->sla.gov, DG_SLA_RECOVERY_TIME, tr->step, total);
    }
}

void trn_sla_note_save(trainer_t *tr, double blocked_s, int ok) {
    if (!tr->sla.gov) return;
    dg_gov_sample(tr->sla.gov, DG_SLA_CHECKPOINT_STALL, tr->step, blocked_s);
    dg_gov_sample(tr->sla.gov, DG_SLA_CHECKPOINT_SUCCESS, tr->step, ok ? 1.0 : 0.0);
    tr->sla.exclude_next = 1;
}

int trn_sla_act(trainer_t *tr, int *st) {
    int a = tr->sla.agreed / 16;
    const char *obj = dg_sla_obj_name((dg_sla_obj_t)(tr->sla.agreed % 16));
    tr->sla.agreed = 0;
    if (!a) return 0;
    DG_METRICS_EVENT(tr->metrics, "sla_action", DG_JS("objective", obj ? obj : "?"),
                     DG_JS("action", dg_sla_action_name((dg_sla_action_t)a)), DG_JI("step", tr->step));
    DG_LOG_WARN("sla: the ranks agreed on Level-2 action %s (objective %s) at step %lld",
                dg_sla_action_name((dg_sla_action_t)a), obj ? obj : "?", (long long)tr->step);
    tr->sla.exclude_next = 1;
    switch ((dg_sla_action_t)a) {
    case DG_SLA_ACT_CHECKPOINT:
        *st = trn_save_checkpoint(tr, 0);
        return 0;
    case DG_SLA_ACT_ROLLBACK:
        *st = trn_rollback(tr);
        return 0;
    case DG_SLA_ACT_REQUEUE:
    case DG_SLA_ACT_PAUSE:
        tr->sla.stop = a;
        return 1;
    case DG_SLA_ACT_NONE:
        break;
    }
    return 0;
}

void trn_sla_prev_attempt(const char *run_dir, int64_t *step, int64_t *tokens) {
    *step = *tokens = -1;
    char path[DG_CFG_STR + 32];
    snprintf(path, sizeof path, "%s/metrics.jsonl", run_dir);
    FILE *f = fopen(path, "r");
    if (!f) return;
    char *line = NULL;
    size_t cap = 0;
    dg_jl_obj *o = dg_xmalloc(sizeof *o);
    while (getline(&line, &cap, f) > 0) {
        if (dg_jl_parse(line, o) != 0) continue;
        const dg_jl_field *ev = dg_jl_get(o, "event"), *s = dg_jl_get(o, "step"), *t = dg_jl_get(o, "tokens");
        if (!ev || !ev->is_str || strcmp(ev->str, "step") != 0 || !s || s->is_str) continue;
        *step = (int64_t)s->num;
        *tokens = t && !t->is_str ? (int64_t)t->num : -1;
    }
    free(o);
    free(line);
    fclose(f);
}

void trn_sla_test_slow(trainer_t *tr, int64_t step) {
    int64_t r = dg_env_int("DG_TEST_SLOW_RANK"), from = dg_env_int("DG_TEST_SLOW_STEP");
    double ms = dg_env_double("DG_TEST_SLOW_MS");
    if (r != tr->rank || from < 0 || step + 1 < from || !(ms > 0)) return;
    if (step + 1 == from)
        DG_LOG_WARN("test hook DG_TEST_SLOW_RANK=%lld: rank %d sleeps %.0f ms per step from step %lld",
                    (long long)r, tr->rank, ms, (long long)from);
    usleep((useconds_t)(ms * 1e3));
}

void trn_sla_resumed(trainer_t *tr, double read_s) {
    if (tr->step <= 0) return; /* a fresh run */
    tr->sla.resumed = 1;
    tr->sla.read_s = read_s;
    tr->sla.exclude_next = 1;
    if (!isfinite(tr->sla.boot_s)) tr->sla.boot_s = 0;
    if (tr->rank != 0) return;
    int64_t ps, pt;
    trn_sla_prev_attempt(tr->cfg->run.dir, &ps, &pt);
    tr->sla.prev_step = ps;
    if (ps >= 0) {
        tr->sla.lost_steps = ps > tr->step ? ps - tr->step : 0;
        tr->sla.lost_tokens = pt > tr->tokens ? pt - tr->tokens : 0;
    }
}
