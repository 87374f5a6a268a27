/* trace.c — `--trace A:B` (run.trace): a Chrome / Perfetto trace of optimizer steps A..B in
 * RUN_DIR/trace.json (README "Monitoring"). Every rank records its own ops through dg_model_set_trace —
 * compute ops on track "compute", collectives on track "communication", each step on track "steps" — with
 * times relative to a barrier at the start of step A, so the ranks of one node line up (across nodes,
 * to within the barrier's skew and the clocks' offset). After step B (or when the loop ends first) the
 * ranks' events are gathered to rank 0, which writes the file atomically. The traced steps run every op
 * synchronised (no CUDA Graph replay), so they are slower than the others; the step metrics say so. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dg_json.h"
#include "train_impl.h"

struct trn_trace {
    int64_t first, last; /* steps A..B, 1-based */
    int active, done;
    int64_t step; /* the step being recorded */
    double t_ref;
    dg_strbuf_t ev; /* this rank's events, each preceded by a comma */
    int rank;
};

dg_status_t trn_trace_create(trainer_t *tr) {
    const char *v = tr->cfg->run.trace;
    if (!*v) return DG_OK;
    long long a = 0, b = 0;
    if (sscanf(v, "%lld:%lld", &a, &b) != 2) return DG_ERR(DG_ERR_USAGE, "run.trace = '%s': expected A:B", v);
    tr->trace = dg_xcalloc(1, sizeof *tr->trace);
    tr->trace->first = a;
    tr->trace->last = b;
    tr->trace->rank = tr->rank;
    return DG_OK;
}

static void put_event(struct trn_trace *t, const char *name, const char *cat, int tid, double t0, double t1,
                      const char *phase) {
    char *q = dg_json_quote_dup(name);
    const char *fmt =
        ",\n{\"name\":%s,\"cat\":\"%s\",\"ph\":\"X\",\"ts\":%.3f,\"dur\":%.3f,\"pid\":%d,\"tid\":%d,"
        "\"args\":{\"step\":%lld%s%s%s}}";
    double ts = (t0 - t->t_ref) * 1e6, dur = (t1 > t0 ? t1 - t0 : 0) * 1e6;
    const char *p0 = phase ? ",\"phase\":\"" : "", *p1 = phase ? phase : "", *p2 = phase ? "\"" : "";
    /* sized to the event: a long node name must never cut an event (the file would not parse) */
    int n = snprintf(NULL, 0, fmt, q, cat, ts, dur, t->rank, tid, (long long)t->step, p0, p1, p2);
    char *buf = dg_xmalloc((size_t)n + 1);
    snprintf(buf, (size_t)n + 1, fmt, q, cat, ts, dur, t->rank, tid, (long long)t->step, p0, p1, p2);
    dg_strbuf_append(&t->ev, buf, (size_t)n);
    free(buf);
    free(q);
}

static void on_op(void *ctx, const char *op, const char *name, const char *phase, int comm, double t0,
                  double t1) {
    struct trn_trace *t = ctx;
    size_t n = strlen(op) + strlen(name) + 2;
    char *label = dg_xmalloc(n);
    snprintf(label, n, "%s %s", op, name);
    put_event(t, label, comm ? "comm" : "compute", comm ? 1 : 0, t0, t1, phase);
    free(label);
}

dg_status_t trn_trace_step_end(trainer_t *tr, int64_t step, int last_step);

dg_status_t trn_trace_boundary(trainer_t *tr) {
    DG_TRY(trn_trace_step_end(tr, tr->step, 0));
    return trn_trace_step_begin(tr, tr->step + 1);
}

dg_status_t trn_trace_step_begin(trainer_t *tr, int64_t step) {
    struct trn_trace *t = tr->trace;
    if (!t || t->active || t->done || step < t->first || step > t->last) return DG_OK;
    if (MPI_Barrier(tr->comm) != MPI_SUCCESS) return DG_ERR(DG_ERR_PEER, "trace: barrier failed");
    t->t_ref = dg_now_s();
    t->active = 1;
    t->step = step;
    char meta[512], host[200];
    char *h = dg_json_quote_dup(tr->boot && tr->boot->host[0] ? tr->boot->host : "?");
    snprintf(host, sizeof host, "%s", h);
    free(h);
    int n = snprintf(
        meta, sizeof meta,
        ",\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d\",\"host\":%s}}"
        ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":\"compute (%s)\"}}"
        ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":1,\"args\":{\"name\":\"communication\"}"
        "}"
        ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":2,\"args\":{\"name\":\"steps\"}}",
        tr->rank, tr->rank, host, tr->rank, tr->backend_name, tr->rank, tr->rank);
    dg_strbuf_append(&t->ev, meta, (size_t)n);
    dg_model_set_trace(tr->model, on_op, t);
    DG_LOG_INFO("trace: recording steps %lld..%lld (every op synchronised: these steps run slower)",
                (long long)step, (long long)t->last);
    return DG_OK;
}

void trn_trace_step_mark(trainer_t *tr, int64_t step, double t0, double t1) {
    struct trn_trace *t = tr->trace;
    if (!t || !t->active) return;
    t->step = step;
    char label[64];
    snprintf(label, sizeof label, "step %lld", (long long)step);
    put_event(t, label, "step", 2, t0, t1, NULL);
    t->step = step + 1; /* the ops that follow belong to the next step */
}

/* Gathers every rank's events to rank 0, which writes RUN_DIR/trace.json. Collective. */
static dg_status_t write_trace(trainer_t *tr) {
    struct trn_trace *t = tr->trace;
    int len = (int)t->ev.len, *lens = NULL, *displ = NULL, total = 0;
    char *all = NULL;
    if (tr->rank == 0) lens = dg_xcalloc((size_t)tr->world, sizeof *lens);
    if (MPI_Gather(&len, 1, MPI_INT, lens, 1, MPI_INT, 0, tr->comm) != MPI_SUCCESS)
        return DG_ERR(DG_ERR_PEER, "trace: gather failed");
    if (tr->rank == 0) {
        displ = dg_xcalloc((size_t)tr->world, sizeof *displ);
        for (int r = 0; r < tr->world; r++)
            displ[r] = total, total += lens[r];
        all = dg_xmalloc((size_t)total + 64);
    }
    int rc = MPI_Gatherv(t->ev.p ? t->ev.p : "", len, MPI_CHAR, all, lens, displ, MPI_CHAR, 0, tr->comm);
    dg_status_t s = rc == MPI_SUCCESS ? DG_OK : DG_ERR(DG_ERR_PEER, "trace: gather failed");
    if (tr->rank == 0 && !s) {
        dg_strbuf_t out = {0};
        const char *head =
            "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"tool\":\"dgtrain\"},\"traceEvents\":[";
        dg_strbuf_append(&out, head, strlen(head));
        /* every event starts with ",\n": the first one's comma is dropped */
        dg_strbuf_append(&out, total > 0 ? all + 1 : "", total > 0 ? (size_t)total - 1 : 0);
        dg_strbuf_append(&out, "\n]}\n", 4);
        char path[DG_CFG_STR + 16];
        snprintf(path, sizeof path, "%s/trace.json", tr->cfg->run.dir);
        s = dg_write_file_atomic(path, out.p, out.len);
        if (!s)
            DG_LOG_INFO(
                "trace: steps %lld..%lld of %d rank(s) written to %s (%.1f kB; open in ui.perfetto.dev or "
                "chrome://tracing)",
                (long long)t->first, (long long)(t->step - 1 < t->last ? t->step - 1 : t->last), tr->world,
                path, out.len / 1e3);
        dg_strbuf_free(&out);
    }
    free(lens);
    free(displ);
    free(all);
    return s;
}

dg_status_t trn_trace_step_end(trainer_t *tr, int64_t step, int last_step) {
    struct trn_trace *t = tr->trace;
    if (!t || !t->active || (step < t->last && !last_step)) return DG_OK;
    dg_model_set_trace(tr->model, NULL, NULL);
    t->active = 0;
    t->done = 1;
    dg_status_t s = write_trace(tr);
    dg_strbuf_free(&t->ev);
    if (s) {
        DG_LOG_WARN("trace not written: %s", dg_last_error());
        dg_clear_error();
    }
    return DG_OK;
}

void trn_trace_free(trainer_t *tr) {
    if (!tr->trace) return;
    dg_strbuf_free(&tr->trace->ev);
    free(tr->trace);
    tr->trace = NULL;
}
