/* read.c — metrics.jsonl into per-run series (plot.h): last value per step, truncated lines skipped. */
#define _GNU_SOURCE
#include "plot.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dg_json_read.h"

static void push(dg_plot_series_t *s, int64_t step, double v) {
    if (!isfinite(v)) return;
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 256;
        s->step = realloc(s->step, (size_t)s->cap * sizeof *s->step);
        s->v = realloc(s->v, (size_t)s->cap * sizeof *s->v);
        DG_ASSERTF(s->step && s->v, "out of memory (%d points)", s->cap);
    }
    s->step[s->n] = step;
    s->v[s->n] = v;
    s->n++;
}

/* Sorts by step, keeping file order among equal steps, then keeps the last of each step. Insertion
 * sort on mostly sorted data (a rollback only moves back a few checkpoints' worth). */
static void last_per_step(dg_plot_series_t *s) {
    for (int i = 1; i < s->n; i++) {
        int64_t k = s->step[i];
        double v = s->v[i];
        int j = i - 1;
        while (j >= 0 && s->step[j] > k) {
            s->step[j + 1] = s->step[j];
            s->v[j + 1] = s->v[j];
            j--;
        }
        s->step[j + 1] = k;
        s->v[j + 1] = v;
    }
    int w = 0;
    for (int i = 0; i < s->n; i++) {
        if (i + 1 < s->n && s->step[i + 1] == s->step[i]) continue;
        s->step[w] = s->step[i];
        s->v[w] = s->v[i];
        w++;
    }
    s->n = w;
}

static double num(const dg_jl_obj *o, const char *key) {
    const dg_jl_field *f = dg_jl_get(o, key);
    return f && !f->is_str ? f->num : NAN;
}

static void take_line(dg_plot_run_t *run, const dg_jl_obj *o) {
    const dg_jl_field *ev = dg_jl_get(o, "event");
    const dg_jl_field *st = dg_jl_get(o, "step");
    if (!ev || !ev->is_str || !st || st->is_str || !isfinite(st->num)) return;
    int64_t step = (int64_t)st->num;
    if (strcmp(ev->str, "val") == 0) {
        push(&run->s[DG_PLOT_VAL_LOSS], step, num(o, "loss"));
    } else if (strcmp(ev->str, "step") == 0) {
        push(&run->s[DG_PLOT_LOSS], step, num(o, "loss"));
        push(&run->s[DG_PLOT_LR], step, num(o, "lr"));
        push(&run->s[DG_PLOT_TOK_S], step, num(o, "tok_per_s"));
        push(&run->s[DG_PLOT_STEP_MS], step, num(o, "step_ms"));
        push(&run->s[DG_PLOT_GRAD_NORM], step, num(o, "grad_norm"));
        push(&run->s[DG_PLOT_MFU], step, 100.0 * num(o, "mfu")); /* a fraction in the file */
    }
}

static void set_name(dg_plot_run_t *run, const char *dir) {
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/')
        n--;
    size_t b = n;
    while (b > 0 && dir[b - 1] != '/')
        b--;
    snprintf(run->name, sizeof run->name, "%.*s", (int)(n - b), dir + b);
    if (!run->name[0]) snprintf(run->name, sizeof run->name, "%s", dir);
}

dg_status_t dg_plot_read(const char *run_dir, dg_plot_run_t *run) {
    memset(run, 0, sizeof *run);
    set_name(run, run_dir);
    char path[4096];
    if (snprintf(path, sizeof path, "%s/metrics.jsonl", run_dir) >= (int)sizeof path)
        return DG_ERR(DG_ERR_RUNTIME, "plot: run directory path too long: %.80s...", run_dir);
    FILE *f = fopen(path, "r");
    if (!f)
        return DG_ERR(DG_ERR_RUNTIME,
                      "plot: cannot read %s: %s (expected a run directory with a metrics.jsonl)", path,
                      strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    dg_jl_obj *o = dg_xcalloc(1, sizeof *o);
    while ((len = getline(&line, &cap, f)) > 0) {
        if (strspn(line, " \t\r\n") == (size_t)len) continue;
        if (dg_jl_parse(line, o) != 0) {
            run->bad_lines++;
            continue;
        }
        take_line(run, o);
    }
    int rerr = ferror(f);
    fclose(f);
    free(line);
    free(o);
    if (rerr) return DG_ERR(DG_ERR_RUNTIME, "plot: read error on %s", path);
    for (int i = 0; i < DG_PLOT_NSERIES; i++)
        last_per_step(&run->s[i]);
    return DG_OK;
}

void dg_plot_run_free(dg_plot_run_t *run) {
    for (int i = 0; i < DG_PLOT_NSERIES; i++) {
        free(run->s[i].step);
        free(run->s[i].v);
    }
    memset(run, 0, sizeof *run);
}
