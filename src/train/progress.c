/* progress.c — the rank-0 progress display: on a terminal one line redrawn in place
 * ("step 120/300 | loss 2.913 | 41.2k tok/s | ETA 0:51"), elsewhere (a log file, Slurm's output) a
 * plain line every log_every steps, so logs stay readable and free of carriage returns. */
#define _GNU_SOURCE
#include "train_util.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct dg_progress {
    FILE *out;
    dg_progress_mode_t mode; /* resolved: TTY, PLAIN or OFF */
    int64_t total, log_every;
    int64_t first_step; /* step of the first call; -1 before it */
    double t_first;     /* wall time of the first call */
    double first_step_s;
    double last_draw;
    int live;       /* a TTY line is on screen without its newline */
    char line[256]; /* the current TTY line, redrawn after notes */
};

dg_progress_t *dg_progress_create(FILE *out, int rank, int64_t total_steps, int64_t log_every,
                                  dg_progress_mode_t mode) {
    dg_progress_t *p = dg_xcalloc(1, sizeof *p);
    p->out = out ? out : stderr;
    p->total = total_steps;
    p->log_every = log_every >= 1 ? log_every : 1;
    p->first_step = -1;
    p->last_draw = -1e300;
    if (rank != 0) mode = DG_PROGRESS_OFF;
    if (mode == DG_PROGRESS_AUTO) mode = isatty(fileno(p->out)) ? DG_PROGRESS_TTY : DG_PROGRESS_PLAIN;
    p->mode = mode;
    return p;
}

void dg_progress_free(dg_progress_t *p) {
    free(p);
}

void dg_format_eta(double s, char *buf, size_t cap) {
    if (!isfinite(s) || s < 0 || s > 1e9) {
        snprintf(buf, cap, "--:--");
        return;
    }
    long t = lround(s);
    long h = t / 3600, m = (t / 60) % 60, sec = t % 60;
    if (h > 0)
        snprintf(buf, cap, "%ld:%02ld:%02ld", h, m, sec);
    else
        snprintf(buf, cap, "%ld:%02ld", m, sec);
}

void dg_format_si(double v, char *buf, size_t cap) {
    static const char *suffix[] = {"", "k", "M", "G", "T", "P"};
    if (!isfinite(v)) {
        snprintf(buf, cap, "%g", v);
        return;
    }
    int k = 0;
    double a = fabs(v);
    /* Round first, so 999.96 shows as "1.00k", not "1000.0". */
    while (k < 5 && a >= 999.95) {
        a /= 1000;
        v /= 1000;
        k++;
    }
    if (k == 0)
        snprintf(buf, cap, "%.0f", v);
    else
        snprintf(buf, cap, a < 9.995 ? "%.2f%s" : a < 99.95 ? "%.1f%s" : "%.0f%s", v, suffix[k]);
}

void dg_progress_step(dg_progress_t *p, int64_t step, double loss, double tok_per_s, double step_s) {
    if (p->mode == DG_PROGRESS_OFF) return;
    double now = dg_now_s();
    if (p->first_step < 0) {
        p->first_step = step;
        p->t_first = now;
        p->first_step_s = step_s;
    }
    int last = step >= p->total;
    if (p->mode == DG_PROGRESS_PLAIN && !last && step != p->first_step && step % p->log_every != 0) return;
    /* A redraw per step can dominate on tiny, fast models; 10 per second is plenty for a human. */
    if (p->mode == DG_PROGRESS_TTY && !last && now - p->last_draw < 0.1) return;
    p->last_draw = now;

    double per_step =
        step > p->first_step ? (now - p->t_first) / (double)(step - p->first_step) : p->first_step_s;
    char eta[32], rate[32];
    dg_format_eta(per_step * (double)(p->total - step), eta, sizeof eta);
    dg_format_si(tok_per_s, rate, sizeof rate);
    snprintf(p->line, sizeof p->line, "step %lld/%lld | loss %.3f | %s tok/s | ETA %s", (long long)step,
             (long long)p->total, loss, rate, eta);
    if (p->mode == DG_PROGRESS_TTY) {
        /* \033[K clears what a longer previous line left to the right. */
        fprintf(p->out, "\r%s\033[K", p->line);
        p->live = 1;
        if (last) {
            fputc('\n', p->out);
            p->live = 0;
        }
    } else {
        fprintf(p->out, "%s\n", p->line);
    }
    fflush(p->out);
}

void dg_progress_note(dg_progress_t *p, const char *fmt, ...) {
    if (p->mode == DG_PROGRESS_OFF) return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (p->live)
        fprintf(p->out, "\r%s\033[K\n%s", msg, p->line); /* the note above, the live line redrawn below */
    else
        fprintf(p->out, "%s\n", msg);
    fflush(p->out);
}

void dg_progress_finish(dg_progress_t *p) {
    if (p->live) {
        fputc('\n', p->out);
        fflush(p->out);
    }
    p->live = 0;
}
