/* util.c — helpers shared by the validation checks: agreement on local failures, gathers to rank 0,
 * barriers that sleep instead of spinning (so idle ranks leave the cores to the rank being measured),
 * naming ranks and hosts in messages, medians, unit formatting and a small JSON text buffer.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "dg_json.h"
#include "validate_impl.h"

/* ---------------------------------------------------------------- text buffer */

void vbuf_printf(vbuf_t *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    va_list ap2;
    va_copy(ap2, ap);
    int need = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    DG_ASSERT(need >= 0);
    if (b->n + (size_t)need + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + (size_t)need + 1)
            cap *= 2;
        char *s = realloc(b->s, cap);
        DG_ASSERT(s != NULL);
        b->s = s;
        b->cap = cap;
    }
    vsnprintf(b->s + b->n, (size_t)need + 1, fmt, ap2);
    va_end(ap2);
    b->n += (size_t)need;
}

/* Quoted by the tree's one JSON escaper (dg_json.h). Control characters other than \n \r \t are dropped
 * first, as in the JUnit file (XML 1.0 cannot carry them), so both reports say the same thing. */
void vbuf_json_str(vbuf_t *b, const char *s) {
    const char *in = s ? s : "";
    char *kept = dg_xmalloc(strlen(in) + 1);
    size_t n = 0;
    for (const unsigned char *p = (const unsigned char *)in; *p; p++)
        if (*p >= 0x20 || *p == '\n' || *p == '\r' || *p == '\t') kept[n++] = (char)*p;
    kept[n] = 0;
    char *q = dg_json_quote_dup(kept);
    vbuf_printf(b, "%s", q);
    free(q);
    free(kept);
}

void vbuf_json_num(vbuf_t *b, double v) {
    if (isfinite(v))
        vbuf_printf(b, "%.9g", v);
    else
        vbuf_printf(b, "null");
}

void vbuf_free(vbuf_t *b) {
    free(b->s);
    memset(b, 0, sizeof *b);
}

void vc_conclude(dg_vcheck_t *k, vbuf_t *why, vbuf_t *note, vbuf_t *det) {
    if (why->n) {
        k->verdict = DG_VERDICT_FAIL;
        snprintf(k->message, sizeof k->message, "%s", why->s);
    } else if (note && note->n) {
        snprintf(k->message, sizeof k->message, "%s", note->s);
    }
    dg_vcheck_set_details(k, det->s);
    vbuf_free(why);
    if (note) vbuf_free(note);
    vbuf_free(det);
}

/* ---------------------------------------------------------------- files */

dg_status_t dg_validate_read_file(const char *path, char **text, size_t *len, size_t max_bytes) {
    *text = NULL;
    *len = 0;
    struct stat st;
    if (stat(path, &st) != 0) return DG_ERR(DG_ERR_USAGE, "%s: cannot read: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return DG_ERR(DG_ERR_USAGE, "%s: not a regular file", path);
    if ((size_t)st.st_size > max_bytes)
        return DG_ERR(DG_ERR_USAGE, "%s: %lld bytes, more than the %zu expected of this file", path,
                      (long long)st.st_size, max_bytes);
    FILE *f = fopen(path, "rb");
    if (!f) return DG_ERR(DG_ERR_USAGE, "%s: cannot open: %s", path, strerror(errno));
    int e = dg_read_stream(f, max_bytes, text, len);
    fclose(f);
    if (e == EFBIG) return DG_ERR(DG_ERR_USAGE, "%s: grew past %zu bytes while read", path, max_bytes);
    return e ? DG_ERR(DG_ERR_USAGE, "%s: read error", path) : DG_OK;
}

/* ---------------------------------------------------------------- selection and report entries */

/* "comm" selects comm.mpi.allreduce.intra, and a check selects itself. Unless `leaf`, a more specific
 * selection also selects the groups above it ("comm.mpi.allreduce" selects "comm"), so that group
 * runners know to run. */
static int prefix_matches(const char *prefix, const char *name, int leaf) {
    size_t n = strlen(prefix);
    if (strncmp(prefix, name, n) == 0 && (name[n] == 0 || name[n] == '.')) return 1;
    if (leaf) return 0;
    size_t m = strlen(name);
    return m < n && strncmp(prefix, name, m) == 0 && prefix[m] == '.';
}

static int selected(const vctx_t *c, const char *name, int leaf) {
    char copy[512];
    snprintf(copy, sizeof copy, "%s", c->checks);
    char *save = NULL;
    for (char *t = dg_list_next(copy, &save); t; t = dg_list_next(NULL, &save)) {
        if (strcmp(t, "all") == 0 || prefix_matches(t, name, leaf)) return 1;
    }
    return 0;
}

int vc_selected(const vctx_t *c, const char *name) {
    return selected(c, name, 0);
}

int vc_selected_leaf(const vctx_t *c, const char *name) {
    return selected(c, name, 1);
}

dg_vcheck_t *vc_add(vctx_t *c, const char *name) {
    if (!c->rep) return NULL;
    return dg_vreport_add(c->rep, name);
}

void vc_skip(vctx_t *c, const char *name, const char *fmt, ...) {
    if (!c->rep) return;
    dg_vcheck_t *k = dg_vreport_add(c->rep, name);
    k->verdict = DG_VERDICT_SKIP;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(k->message, sizeof k->message, fmt, ap);
    va_end(ap);
    snprintf(k->measured, sizeof k->measured, "-");
    snprintf(k->reference, sizeof k->reference, "-");
}

/* ---------------------------------------------------------------- quiet waits */

dg_status_t vc_quiet_wait(vctx_t *c, MPI_Request *req, const char *what) {
    double t0 = dg_now_s();
    long sleep_ns = 20000;
    for (;;) {
        int done = 0;
        DG_MPI_CHECK(MPI_Test(req, &done, MPI_STATUS_IGNORE));
        if (done) return DG_OK;
        if (c->timeout_s > 0 && dg_now_s() - t0 > c->timeout_s) {
            /* a peer that never arrives would hang the suite forever: end the whole job, as the comm
             * layer and the watchdog do, with the exit code of a peer failure */
            fprintf(stderr,
                    "dgvalidate: error on rank %d (%s): peers did not arrive at '%s' within %.0f s "
                    "(validate.comm_timeout_s); aborting the job\n",
                    c->rank, c->b->host, what, c->timeout_s);
            fflush(stderr);
            MPI_Abort(MPI_COMM_WORLD, DG_ERR_PEER);
        }
        struct timespec ts = {0, sleep_ns};
        nanosleep(&ts, NULL);
        if (sleep_ns < 2000000) sleep_ns *= 2;
    }
}

dg_status_t vc_quiet_barrier(vctx_t *c, MPI_Comm comm, const char *what) {
    MPI_Request req;
    DG_MPI_CHECK(MPI_Ibarrier(comm, &req));
    return vc_quiet_wait(c, &req, what);
}

/* ---------------------------------------------------------------- naming ranks and hosts */

void vc_why_wrong(const vctx_t *c, vbuf_t *why, long long wrong, const char *what, const int *ranks, int n) {
    if (!wrong) return;
    char who[1024];
    vc_fmt_ranks(c, ranks, n, who, sizeof who);
    vbuf_printf(why, "%s%lld %s %s", why->n ? "; " : "", wrong, what, who);
}

void vc_fmt_ranks(const vctx_t *c, const int *ranks, int n, char *buf, size_t cap) {
    size_t o = 0;
    buf[0] = 0;
    const int show = 8;
    for (int i = 0; i < n && i < show; i++) {
        int r = ranks[i];
        int w = snprintf(buf + o, cap - o, "%srank %d (%s)", i ? ", " : "", r, c->b->hosts[r]);
        if (w < 0 || (size_t)w >= cap - o) return;
        o += (size_t)w;
    }
    if (n > show) snprintf(buf + o, cap - o, " and %d more rank%s", n - show, n - show == 1 ? "" : "s");
}

void vc_fmt_nodes(const vctx_t *c, const int *nodes, int n, char *buf, size_t cap) {
    size_t o = 0;
    buf[0] = 0;
    const int show = 8;
    for (int i = 0; i < n && i < show; i++) {
        int lead = c->leader_of_node[nodes[i]];
        int w = snprintf(buf + o, cap - o, "%snode %d (%s, ranks from %d)", i ? ", " : "", nodes[i],
                         c->b->hosts[lead], lead);
        if (w < 0 || (size_t)w >= cap - o) return;
        o += (size_t)w;
    }
    if (n > show) snprintf(buf + o, cap - o, " and %d more node%s", n - show, n - show == 1 ? "" : "s");
}

void vc_fmt_all_nodes(const vctx_t *c, char *buf, size_t cap) {
    int n = c->b->n_nodes;
    int *ids = dg_xmalloc((size_t)n * sizeof(int));
    for (int i = 0; i < n; i++)
        ids[i] = i;
    vc_fmt_nodes(c, ids, n, buf, cap);
    free(ids);
}

/* ---------------------------------------------------------------- agreement */

#define VC_MSG 512

dg_status_t vc_agree(vctx_t *c, dg_status_t local, char *msg, size_t cap) {
    int mine = local != DG_OK ? (local == DG_ERR_USAGE ? 1 : local) : 0, worst = 0;
    DG_MPI_CHECK(MPI_Allreduce(&mine, &worst, 1, MPI_INT, MPI_MAX, c->b->world));
    if (msg && cap) msg[0] = 0;
    if (worst == 0) return DG_OK;
    char mymsg[VC_MSG] = {0};
    if (local != DG_OK) snprintf(mymsg, sizeof mymsg, "%s", dg_last_error());
    char *all = c->rank == 0 ? dg_xmalloc((size_t)c->size * VC_MSG) : NULL;
    int *codes = c->rank == 0 ? dg_xmalloc((size_t)c->size * sizeof(int)) : NULL;
    DG_MPI_CHECK(MPI_Gather(mymsg, VC_MSG, MPI_CHAR, all, VC_MSG, MPI_CHAR, 0, c->b->world));
    DG_MPI_CHECK(MPI_Gather(&mine, 1, MPI_INT, codes, 1, MPI_INT, 0, c->b->world));
    if (c->rank == 0 && msg) {
        /* group identical messages: "rank 1 (h), rank 3 (h): cannot create ..." */
        int *used = dg_xcalloc((size_t)c->size, sizeof(int));
        int *grp = dg_xmalloc((size_t)c->size * sizeof(int));
        size_t o = 0;
        for (int r = 0; r < c->size && o + 1 < cap; r++) {
            if (!codes[r] || used[r]) continue;
            int n = 0;
            for (int q = r; q < c->size; q++)
                if (codes[q] && !used[q] && strcmp(all + (size_t)q * VC_MSG, all + (size_t)r * VC_MSG) == 0) {
                    used[q] = 1;
                    grp[n++] = q;
                }
            char who[512];
            vc_fmt_ranks(c, grp, n, who, sizeof who);
            int w = snprintf(msg + o, cap - o, "%s%s: %s", o ? "; " : "", who, all + (size_t)r * VC_MSG);
            if (w < 0) break;
            o += (size_t)w < cap - o ? (size_t)w : cap - o - 1;
        }
        free(used);
        free(grp);
    }
    free(all);
    free(codes);
    return worst == 1 ? DG_ERR_USAGE : worst;
}

dg_status_t vc_gather_doubles(vctx_t *c, const double *local, int n, double *all) {
    DG_MPI_CHECK(MPI_Gather(local, n, MPI_DOUBLE, all, n, MPI_DOUBLE, 0, c->b->world));
    return DG_OK;
}

const dg_sla_ref_t *vc_group_ref(const vctx_t *c, const char *metric, const int *types, int n) {
    const dg_sla_ref_t *best = NULL;
    double best_lo = INFINITY;
    for (int i = 0; i < n; i++) {
        const dg_sla_ref_t *r = dg_sla_ref(c->sla, types[i], metric);
        if (!r) continue;
        double lo, hi;
        dg_sla_ref_bounds(r, &lo, &hi);
        if (!best || lo < best_lo) best = r, best_lo = lo;
    }
    return best;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double vc_median(double *v, int n) {
    if (n <= 0) return NAN;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void vc_fmt_value(char *buf, size_t cap, double v, dg_dim_t dim) {
    static const char *bw[] = {"B/s", "KB/s", "MB/s", "GB/s", "TB/s"};
    static const char *fl[] = {"FLOP/s", "KFLOP/s", "MFLOP/s", "GFLOP/s", "TFLOP/s", "PFLOP/s"};
    if (!isfinite(v)) {
        snprintf(buf, cap, "n/a");
        return;
    }
    if (dim == DG_DIM_TIME) {
        if (v >= 1)
            snprintf(buf, cap, "%.3g s", v);
        else if (v >= 1e-3)
            snprintf(buf, cap, "%.3g ms", v * 1e3);
        else
            snprintf(buf, cap, "%.3g us", v * 1e6);
        return;
    }
    const char **u = dim == DG_DIM_FLOPS ? fl : bw;
    int nu = dim == DG_DIM_FLOPS ? 6 : 5, k = 0;
    while (k + 1 < nu && fabs(v) >= 1000)
        v /= 1000, k++;
    snprintf(buf, cap, "%.3g %s", v, u[k]);
}
