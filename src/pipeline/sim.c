/* sim.c — replays a schedule with per-action costs (makespan, bubble, in-flight activations) and draws
 * the timeline as SVG (pipeline.h, docs/parallelism.md §Simulator). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline.h"

double dg_pp_bubble_theory(int kind, int pp, int virt, int m) {
    int v = kind == DG_PP_INTERLEAVED ? virt : 1;
    return (double)(pp - 1) / ((double)v * m + pp - 1);
}

static int is_comm(int op) {
    return op >= DG_PP_SEND_ACT;
}

/* arrival slot of a message: (gradient?, mb, producing chunk) */
static size_t arrival_slot(const dg_pp_action_t *a, int nc) {
    int grad = a->op == DG_PP_SEND_GRAD || a->op == DG_PP_RECV_GRAD;
    int prod = a->op == DG_PP_RECV_ACT ? a->chunk - 1 : a->op == DG_PP_RECV_GRAD ? a->chunk + 1 : a->chunk;
    return ((size_t)a->mb * nc + (size_t)prod) * 2 + (size_t)grad;
}

void dg_pp_costs_from_split(const dg_pp_split_t *sp, double flops_per_s, dg_pp_costs_t *out) {
    memset(out, 0, sizeof *out);
    for (int c = 0; c < sp->n_chunks; c++) {
        out->fwd_s[c] = flops_per_s > 0 ? sp->chunk[c].fwd_flops / flops_per_s : 0;
        out->bwd_s[c] = flops_per_s > 0 ? sp->chunk[c].bwd_flops / flops_per_s : 0;
        out->act_bytes[c] = sp->chunk[c].act_bytes;
    }
}

dg_status_t dg_pp_simulate(const dg_pp_schedule_t *s, const dg_pp_costs_t *c, int keep_events,
                           dg_pp_sim_t *o) {
    const int p = s->pp, nc = p * s->virt;
    memset(o, 0, sizeof *o);
    size_t nslots = (size_t)s->m * nc * 2;
    double *arrive = dg_xmalloc(nslots * sizeof(double));
    for (size_t i = 0; i < nslots; i++)
        arrive[i] = -1;
    double *link = dg_xcalloc((size_t)p * p, sizeof(double));
    double t[DG_PP_MAX_CHUNKS] = {0}, act[DG_PP_MAX_CHUNKS] = {0};
    int ip[DG_PP_MAX_CHUNKS] = {0}, posted[DG_PP_MAX_CHUNKS] = {0}, inflight[DG_PP_MAX_CHUNKS] = {0};
    int total = 0, cap = 0;
    for (int r = 0; r < p; r++)
        total += s->n[r];
    if (keep_events) {
        cap = total;
        o->events = dg_xmalloc((size_t)(cap > 0 ? cap : 1) * sizeof *o->events);
    }
    dg_status_t st = DG_OK;
    for (;;) {
        int progress = 0, done = 0;
        for (int r = 0; r < p; r++) {
            while (ip[r] < s->n[r]) {
                const dg_pp_action_t *a = &s->act[r][ip[r]];
                if (!is_comm(a->op)) {
                    double d = a->op == DG_PP_FWD ? c->fwd_s[a->chunk] : c->bwd_s[a->chunk];
                    if (keep_events)
                        o->events[o->n_events++] = (dg_pp_event_t){r, a->op, a->mb, a->chunk, t[r], t[r] + d};
                    t[r] += d;
                    o->busy[r] += d;
                    if (a->op == DG_PP_FWD) {
                        inflight[r]++;
                        act[r] += c->act_bytes[a->chunk];
                        if (inflight[r] > o->max_inflight[r]) o->max_inflight[r] = inflight[r];
                        if (act[r] > o->peak_act[r]) o->peak_act[r] = act[r];
                    } else {
                        inflight[r]--;
                        act[r] -= c->act_bytes[a->chunk];
                    }
                    ip[r]++;
                    progress = 1;
                    continue;
                }
                int g = a->group, end = ip[r];
                while (end < s->n[r] && s->act[r][end].group == g && is_comm(s->act[r][end].op))
                    end++;
                if (!posted[r]) { /* the group's sends leave now, on the communication stream */
                    for (int i = ip[r]; i < end; i++) {
                        const dg_pp_action_t *x = &s->act[r][i];
                        if (x->op != DG_PP_SEND_ACT && x->op != DG_PP_SEND_GRAD) continue;
                        double *lf = &link[(size_t)r * p + x->peer];
                        double msg = c->p2p_s ? c->p2p_s[(size_t)r * p + x->peer] : 0;
                        double start = t[r] > *lf ? t[r] : *lf;
                        *lf = start + msg;
                        arrive[arrival_slot(x, nc)] = start + msg;
                    }
                    posted[r] = 1;
                    progress = 1;
                }
                double ready = t[r];
                int waiting = 0;
                for (int i = ip[r]; i < end; i++) {
                    const dg_pp_action_t *x = &s->act[r][i];
                    if (x->op != DG_PP_RECV_ACT && x->op != DG_PP_RECV_GRAD) continue;
                    double at = arrive[arrival_slot(x, nc)];
                    if (at < 0)
                        waiting = 1;
                    else if (at > ready)
                        ready = at;
                }
                if (waiting) break;
                t[r] = ready;
                ip[r] = end;
                posted[r] = 0;
                progress = 1;
            }
            if (ip[r] >= s->n[r]) done++;
        }
        if (done == p) break;
        if (!progress) {
            st = DG_ERR(DG_ERR_RUNTIME,
                        "pipeline simulator: the action lists cannot complete (a receive whose "
                        "message is never sent)");
            break;
        }
    }
    double sum = 0;
    for (int r = 0; r < p; r++) {
        if (t[r] > o->makespan) o->makespan = t[r];
        sum += o->busy[r];
    }
    o->bubble = o->makespan > 0 ? 1.0 - sum / (p * o->makespan) : 0;
    free(arrive);
    free(link);
    if (st) dg_pp_sim_free(o);
    return st;
}

void dg_pp_sim_free(dg_pp_sim_t *r) {
    free(r->events);
    r->events = NULL;
    r->n_events = 0;
}

/* ---------------- the SVG timeline ---------------- */

static void xml_text(FILE *out, const char *s) {
    for (; *s; s++) {
        if (*s == '<')
            fputs("&lt;", out);
        else if (*s == '>')
            fputs("&gt;", out);
        else if (*s == '&')
            fputs("&amp;", out);
        else
            fputc(*s, out);
    }
}

void dg_pp_timeline_svg(const dg_pp_schedule_t *s, const dg_pp_sim_t *r, const char *title, FILE *out) {
    /* forward: blues, backward: oranges; a darker shade per further local chunk */
    static const char *fcol[4] = {"#4c78a8", "#72b7b2", "#2a4d7a", "#9ecae9"};
    static const char *bcol[4] = {"#f58518", "#e45756", "#b85a0d", "#ffbf79"};
    const int W = 960, left = 70, row = 30, top = 40, p = s->pp;
    const double span = r->makespan > 0 ? r->makespan : 1, sx = (W - left - 20) / span;
    int H = top + p * row + 50;
    fprintf(out,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
            "font-family=\"sans-serif\" font-size=\"11\">\n",
            W, H, W, H);
    fprintf(out,
            "<rect width=\"%d\" height=\"%d\" fill=\"white\"/>\n<text x=\"%d\" y=\"20\" font-size=\"13\">", W,
            H, left);
    xml_text(out, title ? title : "");
    fprintf(out, "</text>\n");
    for (int k = 0; k < p; k++) {
        int y = top + k * row;
        fprintf(out, "<text x=\"8\" y=\"%d\">rank %d</text>\n", y + row / 2 + 4, k);
        fprintf(out, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#ddd\"/>\n", left, y + row - 2,
                W - 20, y + row - 2);
    }
    for (int i = 0; i < r->n_events; i++) {
        const dg_pp_event_t *e = &r->events[i];
        int lc = (e->chunk / p) % 4;
        double x = left + e->t0 * sx, w = (e->t1 - e->t0) * sx;
        int y = top + e->rank * row + 3;
        fprintf(out,
                "<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" fill=\"%s\" stroke=\"white\" "
                "stroke-width=\"0.5\"><title>rank %d %s mb %d chunk %d: %.4g..%.4g</title></rect>\n",
                x, y, w > 0.5 ? w : 0.5, row - 8, e->op == DG_PP_FWD ? fcol[lc] : bcol[lc], e->rank,
                e->op == DG_PP_FWD ? "forward" : "backward", e->mb, e->chunk, e->t0, e->t1);
        if (w >= 12)
            fprintf(out, "<text x=\"%.2f\" y=\"%d\" fill=\"white\" text-anchor=\"middle\">%d</text>\n",
                    x + w / 2, y + row / 2 + 1, e->mb);
    }
    int ya = top + p * row + 8;
    fprintf(out, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"black\"/>\n", left, ya, W - 20, ya);
    double step = pow(10, floor(log10(span / 5)));
    if (span / step > 10) step *= 2;
    if (span / step > 10) step *= 2.5;
    for (double x = 0; x <= span * 1.0001; x += step) {
        double px = left + x * sx;
        fprintf(
            out,
            "<line x1=\"%.2f\" y1=\"%d\" x2=\"%.2f\" y2=\"%d\" stroke=\"black\"/><text x=\"%.2f\" y=\"%d\" "
            "text-anchor=\"middle\">%.3g</text>\n",
            px, ya, px, ya + 4, px, ya + 16, x);
    }
    fprintf(
        out,
        "<text x=\"%d\" y=\"%d\">forward (blue), backward (orange), other shades: the rank's later chunks; "
        "number: micro-batch; makespan %.4g, bubble %.1f%%</text>\n",
        left, ya + 34, r->makespan, 100 * r->bubble);
    fprintf(out, "</svg>\n");
}
