/* report.c — `dgtrain report RUN_DIR [--json]` (report.h). */
#define _GNU_SOURCE
#include "report.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "config.h"
#include "dg_json.h"
#include "dg_json_read.h"
#include "sla.h"

#define REP_MAX_EV 128
#define REP_MAX_PC 16

typedef struct {
    char kind[DG_JL_STR]; /* sla, sla_action, sla_clear */
    char objective[DG_JL_STR], action[DG_JL_STR];
    int level;
    double value, target;
    long long step;
} rep_event_t;

typedef struct {
    double *step_s, *tps; /* per-step series */
    int n_steps, cap;
    rep_event_t ev[REP_MAX_EV];
    int n_ev, ev_dropped;
    double rec[64][6]; /* step, total, boot, read, plan, lost_steps */
    int n_rec;
    int ck_ok, ck_failed;
    double stall_max_s, stall_sum_s;
    int attempts, bad_lines;
    char last_done[DG_JL_STR + 32];
    /* the plan cache outcome of each start (the last REP_MAX_PC), and the fallback events */
    struct rep_pc {
        char outcome[DG_JL_STR], reason[DG_JL_STR], fallback[DG_JL_STR];
        double build_s, freeze_s;
    } pc[REP_MAX_PC];
    int n_pc;
    struct rep_fb {
        char id[DG_JL_STR], reason[DG_JL_STR];
        long long step;
    } fb[REP_MAX_PC];
    int n_fb;
} rep_t;

static double num(const dg_jl_obj *o, const char *k) {
    const dg_jl_field *f = dg_jl_get(o, k);
    return f && !f->is_str ? f->num : NAN;
}
static const char *str(const dg_jl_obj *o, const char *k) {
    const dg_jl_field *f = dg_jl_get(o, k);
    return f && f->is_str ? f->str : "";
}

static void add_step(rep_t *r, double s, double t) {
    if (r->n_steps == r->cap) {
        r->cap = r->cap ? 2 * r->cap : 256;
        r->step_s = realloc(r->step_s, (size_t)r->cap * sizeof(double));
        r->tps = realloc(r->tps, (size_t)r->cap * sizeof(double));
        DG_ASSERT(r->step_s && r->tps);
    }
    r->step_s[r->n_steps] = s;
    r->tps[r->n_steps++] = t;
}

static void add_line(rep_t *r, const dg_jl_obj *o) {
    const char *ev = str(o, "event");
    if (!strcmp(ev, "step")) {
        add_step(r, num(o, "step_ms") / 1e3, num(o, "tok_per_s"));
    } else if (!strcmp(ev, "sla") || !strcmp(ev, "sla_action") || !strcmp(ev, "sla_clear")) {
        if (r->n_ev == REP_MAX_EV) {
            r->ev_dropped++;
            return;
        }
        rep_event_t *e = &r->ev[r->n_ev++];
        snprintf(e->kind, sizeof e->kind, "%s", ev);
        snprintf(e->objective, sizeof e->objective, "%s", str(o, "objective"));
        snprintf(e->action, sizeof e->action, "%s", !strcmp(ev, "sla_clear") ? "clear" : str(o, "action"));
        e->level = !strcmp(ev, "sla") ? (int)num(o, "level") : !strcmp(ev, "sla_action") ? 2 : 0;
        e->value = num(o, "value");
        e->target = num(o, "target");
        e->step = (long long)num(o, "step");
    } else if (!strcmp(ev, "recovery") && r->n_rec < 64) {
        double *x = r->rec[r->n_rec++];
        x[0] = num(o, "step"), x[1] = num(o, "recovery_time_s"), x[2] = num(o, "boot_s");
        x[3] = num(o, "checkpoint_read_s"), x[4] = num(o, "plan_build_s"), x[5] = num(o, "lost_steps");
    } else if (!strcmp(ev, "checkpoint")) {
        double ok = num(o, "ok");
        if (!isnan(ok) && ok == 0) {
            r->ck_failed++;
        } else {
            double st = num(o, "stall_ms") / 1e3;
            r->ck_ok++;
            if (st > r->stall_max_s) r->stall_max_s = st;
            if (st > 0) r->stall_sum_s += st;
        }
    } else if (!strcmp(ev, "start")) {
        r->attempts++;
        if (dg_jl_get(o, "plan_cache")) {
            if (r->n_pc == REP_MAX_PC) { /* keep the last ones */
                memmove(r->pc, r->pc + 1, (REP_MAX_PC - 1) * sizeof *r->pc);
                r->n_pc--;
            }
            struct rep_pc *c = &r->pc[r->n_pc++];
            snprintf(c->outcome, sizeof c->outcome, "%s", str(o, "plan_cache"));
            snprintf(c->reason, sizeof c->reason, "%s", str(o, "plan_cache_reason"));
            snprintf(c->fallback, sizeof c->fallback, "%s", str(o, "plan_fallback"));
            c->build_s = num(o, "plan_build_s");
            c->freeze_s = num(o, "graph_freeze_s");
        }
    } else if (!strcmp(ev, "fallback") && r->n_fb < REP_MAX_PC) {
        struct rep_fb *f = &r->fb[r->n_fb++];
        snprintf(f->id, sizeof f->id, "%s", dg_jl_get(o, "id") ? str(o, "id") : str(o, "kind"));
        snprintf(f->reason, sizeof f->reason, "%s", str(o, "reason"));
        f->step = (long long)num(o, "step");
    } else if (!strcmp(ev, "done")) {
        snprintf(r->last_done, sizeof r->last_done, "%s (exit %.0f)", str(o, "reason"), num(o, "exit_code"));
    }
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* mean and the q-quantile of the finite values of v */
static void stats(const double *v, int n, double q, double *mean, double *quant) {
    double *t = dg_xmalloc((size_t)(n ? n : 1) * sizeof *t), s = 0;
    int m = 0;
    for (int i = 0; i < n; i++)
        if (isfinite(v[i])) t[m++] = v[i], s += v[i];
    qsort(t, (size_t)m, sizeof *t, cmp_d);
    *mean = m ? s / m : NAN;
    *quant = m ? t[(int)fmin(m - 1, floor(q * m))] : NAN;
    free(t);
}

static int usage(const char *msg) {
    fprintf(stderr, "dgtrain report: %s\nusage: dgtrain report RUN_DIR [--json]\n", msg);
    return 1;
}

typedef struct {
    const char *obj;
    char target[128], measured[128], verdict[16];
} rep_row_t;

/* The objective rows: target from config.ini (or the defaults), measured value, verdict. */
static void rows(const rep_t *r, const dg_config_t *cfg, rep_row_t *row) {
    dg_sla_cfg_t sc;
    dg_sla_cfg_defaults(&sc);
    for (int i = 0; i < DG_SLA_N; i++) {
        rep_row_t *w = &row[i];
        w->obj = dg_sla_obj_name((dg_sla_obj_t)i);
        char key[64], ref[96] = "", win[32] = "", act[32] = "";
        dg_fmt(key, sizeof key, "sla.%s", w->obj);
        dg_config_get(cfg, key, ref, sizeof ref);
        dg_fmt(key, sizeof key, "sla.%s_window", w->obj);
        dg_config_get(cfg, key, win, sizeof win);
        dg_fmt(key, sizeof key, "sla.%s_action", w->obj);
        dg_config_get(cfg, key, act, sizeof act);
        int on = dg_sla_cfg_set(&sc, (dg_sla_obj_t)i, "config.ini", ref, atoi(win), act) == DG_OK &&
                 sc.obj[i].enabled && cfg->sla.enabled;
        dg_clear_error();
        if (on) {
            char f[96];
            dg_sla_ref_format(&sc.obj[i].ref, f, sizeof f);
            snprintf(w->target, sizeof w->target, "%s, window %s, L2 %s", f, win, act);
        } else {
            snprintf(w->target, sizeof w->target, "off");
        }
        double mean = NAN, q = NAN;
        int measured = 0;
        if (i == DG_SLA_STEP_TIME && r->n_steps) {
            stats(r->step_s, r->n_steps, 0.95, &mean, &q);
            snprintf(w->measured, sizeof w->measured, "mean %.4g s, p95 %.4g s", mean, q);
            measured = 1;
        } else if (i == DG_SLA_TOKENS_PER_S && r->n_steps) {
            stats(r->tps, r->n_steps, 0.05, &mean, &q);
            snprintf(w->measured, sizeof w->measured, "mean %.4g tok/s, p5 %.4g tok/s", mean, q);
            measured = 1;
        } else if (i == DG_SLA_CHECKPOINT_STALL && r->ck_ok) {
            snprintf(w->measured, sizeof w->measured, "mean %.3g s, max %.3g s", r->stall_sum_s / r->ck_ok,
                     r->stall_max_s);
            measured = 1;
        } else if (i == DG_SLA_CHECKPOINT_SUCCESS && r->ck_ok + r->ck_failed) {
            snprintf(w->measured, sizeof w->measured, "%d of %d saves", r->ck_ok, r->ck_ok + r->ck_failed);
            measured = 1;
        } else if (i == DG_SLA_RECOVERY_TIME && r->n_rec) {
            double mx = 0;
            for (int k = 0; k < r->n_rec; k++)
                mx = fmax(mx, r->rec[k][1]);
            snprintf(w->measured, sizeof w->measured, "%d resume(s), max %.3g s", r->n_rec, mx);
            measured = 1;
        } else {
            snprintf(w->measured, sizeof w->measured, "-");
        }
        int l1 = 0, l2 = 0;
        for (int k = 0; k < r->n_ev; k++)
            if (!strcmp(r->ev[k].kind, "sla") && !strcmp(r->ev[k].objective, w->obj))
                r->ev[k].level >= 2 ? l2++ : l1++;
        snprintf(w->verdict, sizeof w->verdict, "%s",
                 l2         ? "LEVEL-2"
                 : l1       ? "LEVEL-1"
                 : !on      ? "off"
                 : measured ? "met"
                            : "no data");
    }
}

static void print_text(const char *dir, const rep_t *r, const rep_row_t *row) {
    printf("SLA report: %s (%d attempt(s), %d step line(s), last end: %s)\n\n", dir, r->attempts, r->n_steps,
           r->last_done[0] ? r->last_done : "none");
    printf("%-19s %-8s %-34s %s\n", "objective", "verdict", "measured", "target");
    for (int i = 0; i < DG_SLA_N; i++)
        printf("%-19s %-8s %-34s %s\n", row[i].obj, row[i].verdict, row[i].measured, row[i].target);
    printf("\nevents (%d%s):\n", r->n_ev, r->ev_dropped ? ", more not shown" : "");
    for (int k = 0; k < r->n_ev; k++) {
        const rep_event_t *e = &r->ev[k];
        if (!strcmp(e->kind, "sla_action"))
            printf("  step %-8lld %-18s agreed action %s\n", e->step, e->objective, e->action);
        else
            printf("  step %-8lld %-18s level %d %-10s value %.4g vs %.4g\n", e->step, e->objective, e->level,
                   e->action, e->value, e->target);
    }
    printf("\nrecovery (%d):\n", r->n_rec);
    for (int k = 0; k < r->n_rec; k++) {
        char lost[32];
        if (r->rec[k][5] < 0 || isnan(r->rec[k][5]))
            snprintf(lost, sizeof lost, "unknown");
        else
            snprintf(lost, sizeof lost, "%.0f", r->rec[k][5]);
        printf("  step %-8.0f %.3f s = boot %.3f + plan build %.3f + checkpoint read %.3f (+ first step); "
               "lost %s step(s)\n",
               r->rec[k][0], r->rec[k][1], r->rec[k][2], r->rec[k][4], r->rec[k][3], lost);
    }
    printf("\ncheckpoints: %d complete, %d failed\n", r->ck_ok, r->ck_failed);
    printf("\nplan cache (%d start(s)):\n", r->n_pc);
    for (int k = 0; k < r->n_pc; k++) {
        const struct rep_pc *c = &r->pc[k];
        printf("  %-8s plan build %.3f s, graph freeze %.3f s%s%s: %s\n", c->outcome, c->build_s, c->freeze_s,
               c->fallback[0] ? ", fallback " : "", c->fallback, c->reason);
    }
    printf("\nfallbacks (%d):\n", r->n_fb);
    for (int k = 0; k < r->n_fb; k++)
        printf("  step %-8lld %s: %s\n", r->fb[k].step, r->fb[k].id, r->fb[k].reason);
}

static void json_pc(const struct rep_pc *c) {
    printf("{\"outcome\":");
    dg_json_fputs(stdout, c->outcome);
    printf(",\"reason\":");
    dg_json_fputs(stdout, c->reason);
    printf(",\"fallback\":");
    dg_json_fputs(stdout, c->fallback);
    if (isfinite(c->build_s)) printf(",\"plan_build_s\":%.6g", c->build_s);
    if (isfinite(c->freeze_s)) printf(",\"graph_freeze_s\":%.6g", c->freeze_s);
    printf("}");
}

static void print_json(const char *dir, const rep_t *r, const rep_row_t *row) {
    printf("{\"run_dir\":");
    dg_json_fputs(stdout, dir);
    printf(",\"attempts\":%d,\"steps\":%d,\"objectives\":[", r->attempts, r->n_steps);
    for (int i = 0; i < DG_SLA_N; i++) {
        printf("%s{\"objective\":\"%s\",\"verdict\":\"%s\",\"measured\":", i ? "," : "", row[i].obj,
               row[i].verdict);
        dg_json_fputs(stdout, row[i].measured);
        printf(",\"target\":");
        dg_json_fputs(stdout, row[i].target);
        printf("}");
    }
    printf("],\"events\":[");
    for (int k = 0; k < r->n_ev; k++) {
        const rep_event_t *e = &r->ev[k];
        printf("%s{\"event\":\"%s\",\"objective\":", k ? "," : "", e->kind);
        dg_json_fputs(stdout, e->objective);
        printf(",\"level\":%d,\"action\":", e->level);
        dg_json_fputs(stdout, e->action);
        printf(",\"step\":%lld", e->step);
        if (isfinite(e->value)) printf(",\"value\":%.17g", e->value);
        if (isfinite(e->target)) printf(",\"target\":%.17g", e->target);
        printf("}");
    }
    printf("],\"recovery\":[");
    for (int k = 0; k < r->n_rec; k++)
        printf("%s{\"step\":%.0f,\"recovery_time_s\":%.6g,\"boot_s\":%.6g,\"checkpoint_read_s\":%.6g,"
               "\"plan_build_s\":%.6g,\"lost_steps\":%.0f}",
               k ? "," : "", r->rec[k][0], r->rec[k][1], r->rec[k][2], r->rec[k][3], r->rec[k][4],
               r->rec[k][5]);
    printf("],\"checkpoints\":{\"complete\":%d,\"failed\":%d}", r->ck_ok, r->ck_failed);
    /* the last start's plan cache outcome, every start's, and the fallback events */
    printf(",\"plan_cache\":");
    if (r->n_pc)
        json_pc(&r->pc[r->n_pc - 1]);
    else
        printf("null");
    printf(",\"plan_cache_starts\":[");
    for (int k = 0; k < r->n_pc; k++) {
        if (k) printf(",");
        json_pc(&r->pc[k]);
    }
    printf("],\"fallbacks\":[");
    for (int k = 0; k < r->n_fb; k++) {
        printf("%s{\"id\":", k ? "," : "");
        dg_json_fputs(stdout, r->fb[k].id);
        printf(",\"step\":%lld,\"reason\":", r->fb[k].step);
        dg_json_fputs(stdout, r->fb[k].reason);
        printf("}");
    }
    printf("]}\n");
}

int dg_sla_report_main(int argc, char **argv) {
    const char *dir = NULL;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            json = 1;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: dgtrain report RUN_DIR [--json]\n");
            return 0;
        } else if (argv[i][0] == '-') {
            fprintf(stderr, "dgtrain report: unknown option '%s' (allowed: --json)\n", argv[i]);
            return 1;
        } else if (dir)
            return usage("expected one RUN_DIR");
        else
            dir = argv[i];
    }
    if (!dir) return usage("expected a RUN_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "dgtrain report: cannot read %s: %s (is %s a run directory?)\n", path,
                strerror(errno), dir);
        return 2;
    }
    rep_t *r = dg_xcalloc(1, sizeof *r);
    dg_jl_obj *o = dg_xmalloc(sizeof *o);
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0)
        if (dg_jl_parse(line, o) == 0)
            add_line(r, o);
        else
            r->bad_lines++;
    free(line);
    free(o);
    fclose(f);
    dg_config_t *cfg = dg_xcalloc(1, sizeof *cfg);
    snprintf(path, sizeof path, "%s/config.ini", dir);
    struct stat sb;
    if (stat(path, &sb) != 0 || dg_config_load(cfg, path, 0, NULL) != DG_OK) {
        fprintf(stderr, "dgtrain report: %s not loaded (%s); targets shown are the defaults\n", path,
                dg_last_error()[0] ? dg_last_error() : strerror(errno));
        dg_clear_error();
        dg_config_defaults(cfg);
    }
    rep_row_t row[DG_SLA_N];
    rows(r, cfg, row);
    if (json)
        print_json(dir, r, row);
    else
        print_text(dir, r, row);
    free(cfg);
    free(r->step_s);
    free(r->tps);
    free(r);
    return 0;
}
