/* svg.c — the charts (plot.h): one SVG per metric, nice ticks, axis titles with units, a legend, log y
 * for a loss that spans more than a decade; written to a temporary name and renamed into place. */
#define _GNU_SOURCE
#include "plot.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dg_fs.h"

#define W 960
#define H 540
#define PL 90 /* plot area: left, right, top, bottom edges */
#define PR 720
#define PT 50
#define PB 470
#define DENSE 2000 /* more points than this in a series: thinned to what the pixels can show */

typedef struct {
    const char *file, *title, *ytitle;
    int series[2]; /* series shown (second -1: one only); the second is drawn dashed */
    const char *label[2];
    int log_ok; /* log y when max/min > 10 */
} chart_t;

static const chart_t k_charts[] = {
    {"loss.svg", "Loss", "loss (nats/token)", {DG_PLOT_LOSS, DG_PLOT_VAL_LOSS}, {"train", "val"}, 1},
    {"lr.svg", "Learning rate", "learning rate (dimensionless)", {DG_PLOT_LR, -1}, {"", ""}, 0},
    {"tokens_per_s.svg", "Throughput", "throughput (tokens/s)", {DG_PLOT_TOK_S, -1}, {"", ""}, 0},
    {"step_time.svg", "Step time", "step time (ms)", {DG_PLOT_STEP_MS, -1}, {"", ""}, 0},
    {"grad_norm.svg",
     "Gradient norm",
     "grad norm (L2, all parameters)",
     {DG_PLOT_GRAD_NORM, -1},
     {"", ""},
     0},
    {"mfu.svg", "Model FLOPs utilisation", "MFU (% of peak)", {DG_PLOT_MFU, -1}, {"", ""}, 0},
};

static const char *const k_colours[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                        "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
#define NCOLOURS ((int)(sizeof k_colours / sizeof *k_colours))

typedef struct {
    double lo, hi;
    int log;
} axis_t;

/* ---------------- ticks ---------------- */

static double nice_num(double x, int round) {
    double e = floor(log10(x)), f = x / pow(10, e), n;
    if (round)
        n = f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10;
    else
        n = f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10;
    return n * pow(10, e);
}

/* Widens [lo, hi] to nice bounds and returns the tick step (linear axis, about 6 ticks). */
static double lin_ticks(axis_t *a) {
    if (!(a->hi > a->lo)) {
        double d = a->lo != 0 ? fabs(a->lo) * 0.1 : 1;
        a->lo -= d;
        a->hi += d;
    }
    double step = nice_num(nice_num(a->hi - a->lo, 0) / 5, 1);
    a->lo = floor(a->lo / step) * step;
    a->hi = ceil(a->hi / step) * step;
    return step;
}

/* A tick label: plain decimals with as many places as the tick step needs; 10k and up with a k or M
 * suffix (1.25M, 40k) on an axis that reaches 10k; an axis below 0.001 in e-notation. */
static void fmt_num(char *b, size_t cap, double v, double step, double amax) {
    if (fabs(v) < step * 1e-6) {
        snprintf(b, cap, "0");
        return;
    }
    double scale = 1; /* one suffix for the whole axis, from its largest magnitude */
    const char *suffix = "";
    if (amax >= 1e6)
        scale = 1e6, suffix = "M";
    else if (amax >= 1e4)
        scale = 1e3, suffix = "k";
    if (amax < 1e-3) {
        snprintf(b, cap, "%.3g", v);
        return;
    }
    double st = step / scale;
    int dec = st >= 1 ? 0 : (int)ceil(-log10(st) - 1e-9);
    if (dec > 6) dec = 6;
    snprintf(b, cap, "%.*f%s", dec, v / scale, suffix);
}

/* ---------------- coordinates ---------------- */

static double ty(const axis_t *a, double v) {
    double t =
        a->log ? (log10(v) - log10(a->lo)) / (log10(a->hi) - log10(a->lo)) : (v - a->lo) / (a->hi - a->lo);
    return PB - t * (PB - PT);
}

static double tx(const axis_t *a, double v) {
    return PL + (v - a->lo) / (a->hi - a->lo) * (PR - PL);
}

/* ---------------- drawing ---------------- */

static void xml_text(FILE *f, const char *s) {
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '<')
            fputs("&lt;", f);
        else if (c == '>')
            fputs("&gt;", f);
        else if (c == '&')
            fputs("&amp;", f);
        else if (c == '"')
            fputs("&quot;", f);
        else if (c < 0x20)
            fputc('?', f);
        else
            fputc(c, f);
    }
}

static void y_axis(FILE *f, const axis_t *y, double step) {
    char b[32];
    if (y->log) {
        int e0 = (int)floor(log10(y->lo) + 1e-9), e1 = (int)ceil(log10(y->hi) - 1e-9);
        int sub = e1 - e0 <= 2; /* few decades: 2 and 5 too */
        for (int e = e0; e <= e1; e++)
            for (int m = 1; m <= 5; m += (m == 1 ? 1 : 3)) {
                double v = m * pow(10, e);
                if ((m != 1 && !sub) || v < y->lo * 0.999 || v > y->hi * 1.001) continue;
                double py = ty(y, v);
                snprintf(b, sizeof b, "%g", v);
                fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#dddddd\"/>\n", PL, py,
                        PR, py);
                fprintf(
                    f,
                    "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\" dominant-baseline=\"middle\">%s</text>\n",
                    PL - 6, py, b);
            }
        return;
    }
    for (double v = y->lo; v <= y->hi + step * 1e-6; v += step) {
        double py = ty(y, v);
        fmt_num(b, sizeof b, v, step, fmax(fabs(y->lo), fabs(y->hi)));
        fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#dddddd\"/>\n", PL, py, PR,
                py);
        fprintf(f, "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\" dominant-baseline=\"middle\">%s</text>\n",
                PL - 6, py, b);
    }
}

static void x_axis(FILE *f, const axis_t *x, double step) {
    char b[32];
    for (double v = x->lo; v <= x->hi + step * 1e-6; v += step) {
        double px = tx(x, v);
        fmt_num(b, sizeof b, v, step, fmax(fabs(x->lo), fabs(x->hi)));
        fprintf(f, "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#dddddd\"/>\n", px, PT, px,
                PB);
        fprintf(f, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%s</text>\n", px, PB + 20, b);
    }
}

static void series(FILE *f, const dg_plot_series_t *s, const axis_t *x, const axis_t *y, const char *colour,
                   int dashed) {
    fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"%s\"%s points=\"", colour,
            dashed ? "2" : "1.5", dashed ? " stroke-dasharray=\"6,4\"" : "");
    /* Long runs: per pixel column only the first, lowest, highest and last point, in step order, so the
     * file stays small and a one-step spike still shows. */
    int i = 0;
    while (i < s->n) {
        int col = (int)tx(x, (double)s->step[i]), j = i, lo = -1, hi = -1;
        for (; j < s->n && (s->n <= DENSE || (int)tx(x, (double)s->step[j]) == col); j++) {
            if (y->log && !(s->v[j] > 0)) continue;
            if (lo < 0 || s->v[j] < s->v[lo]) lo = j;
            if (hi < 0 || s->v[j] > s->v[hi]) hi = j;
        }
        if (s->n <= DENSE) { /* few points: every one */
            for (int k = i; k < j; k++)
                if (!y->log || s->v[k] > 0)
                    fprintf(f, "%.1f,%.1f ", tx(x, (double)s->step[k]), ty(y, s->v[k]));
        } else if (lo >= 0) {
            int keep[4] = {i, lo < hi ? lo : hi, lo < hi ? hi : lo, j - 1};
            for (int k = 0; k < 4; k++)
                if ((k == 0 || keep[k] != keep[k - 1]) && (!y->log || s->v[keep[k]] > 0))
                    fprintf(f, "%.1f,%.1f ", tx(x, (double)s->step[keep[k]]), ty(y, s->v[keep[k]]));
        }
        i = j;
    }
    fputs("\"/>\n", f);
    if ((dashed && s->n <= DENSE) || s->n == 1) /* val points are few: mark each; so is a lone point */
        for (int i = 0; i < s->n; i++)
            if (!y->log || s->v[i] > 0)
                fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3.5\" fill=\"%s\"/>\n",
                        tx(x, (double)s->step[i]), ty(y, s->v[i]), colour);
}

static void legend(FILE *f, const chart_t *c, const dg_plot_run_t *runs, int nruns) {
    int row = 0;
    for (int r = 0; r < nruns; r++)
        for (int k = 0; k < 2; k++) {
            int si = c->series[k];
            if (si < 0 || runs[r].s[si].n == 0) continue;
            const char *col = k_colours[r % NCOLOURS];
            int y = PT + 10 + 22 * row++;
            fprintf(f,
                    "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"%s\" stroke-width=\"2.5\"%s/>\n",
                    PR + 20, y, PR + 48, y, col, k ? " stroke-dasharray=\"6,4\"" : "");
            fprintf(f, "<text x=\"%d\" y=\"%d\" dominant-baseline=\"middle\">", PR + 56, y);
            /* fits the 180 px beside the plot: long names keep their start and end */
            char nm[40];
            size_t n = strlen(runs[r].name), max = c->series[1] >= 0 ? 16 : 24, head = (max - 3) / 2;
            if (n > max)
                snprintf(nm, sizeof nm, "%.*s...%s", (int)head, runs[r].name,
                         runs[r].name + n - (max - 3 - head));
            else
                snprintf(nm, sizeof nm, "%s", runs[r].name);
            xml_text(f, nm);
            if (c->series[1] >= 0) fprintf(f, " (%s)", c->label[k]);
            fputs("</text>\n", f);
        }
}

/* ---------------- one chart ---------------- */

/* Ranges over every run's shown series; 0 when no point at all. */
static int ranges(const chart_t *c, const dg_plot_run_t *runs, int nruns, axis_t *x, axis_t *y) {
    int any = 0;
    double pos_min = INFINITY;
    for (int r = 0; r < nruns; r++)
        for (int k = 0; k < 2; k++) {
            if (c->series[k] < 0) continue;
            const dg_plot_series_t *s = &runs[r].s[c->series[k]];
            for (int i = 0; i < s->n; i++) {
                double sx = (double)s->step[i], v = s->v[i];
                if (!any) x->lo = x->hi = sx, y->lo = y->hi = v;
                any = 1;
                x->lo = fmin(x->lo, sx), x->hi = fmax(x->hi, sx);
                y->lo = fmin(y->lo, v), y->hi = fmax(y->hi, v);
                if (v > 0) pos_min = fmin(pos_min, v);
            }
        }
    y->log = any && c->log_ok && y->lo > 0 && y->hi / y->lo > 10;
    if (y->log) {
        y->lo = pow(10, floor(log10(pos_min)));
        y->hi = pow(10, ceil(log10(y->hi)));
    }
    return any;
}

static void draw(FILE *f, const chart_t *c, const dg_plot_run_t *runs, int nruns, axis_t x, axis_t y) {
    if (x.lo > 0 && x.lo <= 0.2 * x.hi) x.lo = 0; /* steps start at 1: show the axis from 0 */
    double xs = lin_ticks(&x), ys = y.log ? 0 : lin_ticks(&y);
    fprintf(f,
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
            "font-family=\"DejaVu Sans, Arial, sans-serif\" font-size=\"13\">\n",
            W, H, W, H);
    fprintf(f, "<rect width=\"%d\" height=\"%d\" fill=\"white\"/>\n", W, H);
    fprintf(
        f,
        "<text x=\"%d\" y=\"28\" text-anchor=\"middle\" font-size=\"17\" font-weight=\"bold\">%s%s</text>\n",
        (PL + PR) / 2, c->title, y.log ? " (log scale)" : "");
    y_axis(f, &y, ys);
    x_axis(f, &x, xs);
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#333333\"/>\n", PL,
            PT, PR - PL, PB - PT);
    fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" font-size=\"14\">step</text>\n", (PL + PR) / 2,
            PB + 48);
    fprintf(
        f, "<text x=\"22\" y=\"%d\" text-anchor=\"middle\" font-size=\"14\" transform=\"rotate(-90 22 %d)\">",
        (PT + PB) / 2, (PT + PB) / 2);
    xml_text(f, c->ytitle);
    fputs("</text>\n", f);
    /* clip the lines to the plot area, with room for a marker on its edge */
    fprintf(
        f, "<svg x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" viewBox=\"%d %d %d %d\" overflow=\"hidden\">\n",
        PL - 5, PT - 5, PR - PL + 10, PB - PT + 10, PL - 5, PT - 5, PR - PL + 10, PB - PT + 10);
    for (int r = 0; r < nruns; r++)
        for (int k = 0; k < 2; k++)
            if (c->series[k] >= 0 && runs[r].s[c->series[k]].n > 0)
                series(f, &runs[r].s[c->series[k]], &x, &y, k_colours[r % NCOLOURS], k);
    fputs("</svg>\n", f);
    legend(f, c, runs, nruns);
    fputs("</svg>\n", f);
}

static dg_status_t write_chart(const chart_t *c, const dg_plot_run_t *runs, int nruns, const char *dir,
                               axis_t x, axis_t y) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, c->file);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return DG_ERR(DG_ERR_RUNTIME, "plot: cannot format %s: %s", path, strerror(errno));
    draw(f, c, runs, nruns, x, y);
    fclose(f);
    dg_status_t st = dg_write_file_atomic(path, text, len); /* temp + fsync + rename, no link followed */
    free(text);
    return st;
}

dg_status_t dg_plot_write(const dg_plot_run_t *runs, int nruns, const char *out_dir, FILE *note,
                          int *written) {
    int n = 0;
    if (written) *written = 0;
    dg_status_t s = dg_mkdir_p(out_dir);
    if (s)
        return DG_ERR(DG_ERR_RUNTIME, "plot: cannot create the plots directory %s: %s", out_dir,
                      dg_last_error());
    for (size_t i = 0; i < sizeof k_charts / sizeof *k_charts; i++) {
        axis_t x = {0}, y = {0};
        if (!ranges(&k_charts[i], runs, nruns, &x, &y)) {
            if (note)
                fprintf(note, "plot: no %s in any run; %s not written\n", k_charts[i].ytitle,
                        k_charts[i].file);
            continue;
        }
        DG_TRY(write_chart(&k_charts[i], runs, nruns, out_dir, x, y));
        n++;
    }
    if (written) *written = n;
    if (n == 0)
        return DG_ERR(DG_ERR_RUNTIME, "plot: nothing to plot: no step or val lines in any metrics.jsonl");
    return DG_OK;
}
