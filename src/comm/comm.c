/* comm.c — the backend-independent half of the comm layer: argument validation (so that no backend
 * sees a bad operation), request bookkeeping, collective sequence numbers, timeout and failure
 * messages, the arrival probe that names the ranks which did not reach a stuck collective, the
 * per-mesh-dimension communicators, and job abort. Backends (comm_mpi.c, comm_nccl.c) plug in through
 * dg_comm_vtbl_t.
 */
#define _GNU_SOURCE
#include "comm_impl.h"

#include <errno.h>
#include <limits.h>
#include <stddef.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "dg_env.h"

/* ---------------------------------------------------------------------------------------------- */
/* names and small helpers                                                                         */

static const char *k_op_names[DG_OP_NKINDS] = {"allgather", "reduce_scatter", "allreduce", "broadcast",
                                               "barrier",   "send",           "recv"};

const char *dg_comm__op_name(dg_op_kind_t k) {
    DG_ASSERT(k >= 0 && k < DG_OP_NKINDS);
    return k_op_names[k];
}

int dg_comm__is_collective(dg_op_kind_t k) {
    return k != DG_OP_SEND && k != DG_OP_RECV;
}

int dg_comm__is_reduction(dg_op_kind_t k) {
    return k == DG_OP_REDUCE_SCATTER || k == DG_OP_ALLREDUCE;
}

void dg_comm__describe(const dg_comm_t *c, const dg_comm_op_t *op, char *buf, size_t cap) {
    const char *on = dg_comm__op_name(op->kind);
    const char *dt = dg_dtype_name(op->dt);
    switch (op->kind) {
    case DG_OP_SEND:
    case DG_OP_RECV:
        snprintf(buf, cap, "%s %s rank %d (world %d) on %s (%zu x %s, tag %d)", on,
                 op->kind == DG_OP_SEND ? "to" : "from", op->peer, c->world_ranks[op->peer], c->name,
                 op->count, dt, op->tag);
        break;
    case DG_OP_BARRIER:
        snprintf(buf, cap, "barrier on %s (collective #%lld)", c->name, (long long)op->seq);
        break;
    case DG_OP_BROADCAST:
        snprintf(buf, cap, "broadcast from rank %d on %s (%zu x %s, collective #%lld)", op->peer, c->name,
                 op->count, dt, (long long)op->seq);
        break;
    default:
        snprintf(buf, cap, "%s on %s (%zu x %s%s, collective #%lld)", on, c->name, op->count, dt,
                 op->kind == DG_OP_ALLREDUCE ? "" : " per rank", (long long)op->seq);
        break;
    }
}

void dg_comm__list_append(dg_comm_op_t **head, dg_comm_op_t **tail, dg_comm_op_t *op) {
    op->prev = *tail;
    op->next = NULL;
    if (*tail)
        (*tail)->next = op;
    else
        *head = op;
    *tail = op;
}

void dg_comm__list_unlink(dg_comm_op_t **head, dg_comm_op_t **tail, dg_comm_op_t *op) {
    if (op->prev)
        op->prev->next = op->next;
    else if (*head == op)
        *head = op->next;
    if (op->next)
        op->next->prev = op->prev;
    else if (*tail == op)
        *tail = op->prev;
    op->next = op->prev = NULL;
}

dg_status_t dg_comm__op_release(dg_comm_op_t *op) {
    dg_status_t s = op->status;
    if (s != DG_OK) DG_ERR(s, "%s", op->msg);
    free(op);
    return s;
}

void dg_comm__strlcpy(char *dst, size_t cap, const char *src) {
    size_t n = strlen(src);
    if (n >= cap) n = cap - 1;
    memcpy(dst, src, n);
    dst[n] = 0;
}

void dg_comm__host_divide(void *x, size_t n, dg_dtype_t dt, int divisor) {
    if (divisor == 1) return;
    if (dt == DG_F32) {
        float *p = x, d = (float)divisor;
        for (size_t i = 0; i < n; i++)
            p[i] = p[i] / d;
    } else if (dt == DG_F64) {
        double *p = x, d = (double)divisor;
        for (size_t i = 0; i < n; i++)
            p[i] = p[i] / d;
    } else if (dt == DG_BF16) {
        uint16_t *p = x;
        float d = (float)divisor;
        for (size_t i = 0; i < n; i++)
            p[i] = dg_comm__f32_to_bf16(dg_comm__bf16_to_f32(p[i]) / d);
    } else {
        DG_ASSERTF(0, "AVG on dtype %s reached a backend", dg_dtype_name(dt));
    }
}

void dg_comm_opts_default(dg_comm_opts_t *o) {
    memset(o, 0, sizeof *o);
    o->name = "comm";
    o->timeout_s = 120.0;
    o->progress = DG_COMM_PROGRESS_AUTO;
    o->arrival_probe = 1;
    o->spin_us = 50.0;
    o->inline_blocking = 1;
}

static dg_status_t check_opts(const dg_comm_opts_t *o) {
    if (!(o->timeout_s > 0) || o->timeout_s > 1e7)
        return DG_ERR(DG_ERR_USAGE, "comm options: timeout_s must be > 0 seconds (health.timeout_s), got %g",
                      o->timeout_s);
    if (o->progress < DG_COMM_PROGRESS_AUTO || o->progress > DG_COMM_PROGRESS_NONBLOCKING)
        return DG_ERR(DG_ERR_USAGE,
                      "comm options: unknown progress mode %d (expected AUTO, THREAD or NONBLOCKING)",
                      (int)o->progress);
    if (o->name && (strlen(o->name) == 0 || strlen(o->name) >= 64))
        return DG_ERR(DG_ERR_USAGE, "comm options: name must be 1..63 characters, got '%s'", o->name);
    if (o->spin_us > 1e6)
        return DG_ERR(DG_ERR_USAGE, "comm options: spin_us must be <= 1e6 (one second), got %g", o->spin_us);
    return DG_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* the arrival responder: one thread per process answers "which collective have you reached?" for   */
/* every registered comm. It sleeps between polls so that it costs nothing measurable.             */

enum { PROBE_TAG_QUERY = 1, PROBE_TAG_REPLY = 2 };
#define PROBE_POLL_NS 5000000L

typedef struct {
    int64_t nonce, need;
} probe_query_t;

typedef struct {
    int64_t nonce, started, done, step, running_ns, posted_seq, posted_count;
    int64_t started_ago_ns; /* since the newest collective started (running or done); -1: not known */
    int32_t cur_kind, queued, posted_kind, pad;
} probe_reply_t;

static struct {
    pthread_mutex_t mu;
    dg_comm_t **list;
    int n, cap;
    uint64_t gen; /* a running responder exits when this no longer equals the value it started with */
    int running;
    pthread_t th;
} g_resp = {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0, 0, 0, 0};

static void fill_reply(dg_comm_t *c, int64_t nonce, probe_reply_t *r) {
    memset(r, 0, sizeof *r);
    r->nonce = nonce;
    r->started = atomic_load(&c->coll_started);
    r->done = atomic_load(&c->coll_done);
    r->step = atomic_load(&c->step);
    r->cur_kind = atomic_load(&c->cur_kind);
    r->queued = atomic_load(&c->queued);
    int64_t t0 = atomic_load(&c->cur_start_ns); /* set by the progress thread and inline runs only */
    r->running_ns = r->cur_kind >= 0 ? dg_comm__now_ns() - t0 : 0;
    r->started_ago_ns = t0 > 0 ? dg_comm__now_ns() - t0 : -1;
    r->posted_seq = atomic_load(&c->last_posted_seq);
    r->posted_kind = atomic_load(&c->last_posted_kind);
    r->posted_count = atomic_load(&c->last_posted_count);
}

static void *responder_main(void *arg) {
    uint64_t my_gen = (uint64_t)(uintptr_t)arg;
    for (;;) {
        pthread_mutex_lock(&g_resp.mu);
        if (g_resp.gen != my_gen) {
            pthread_mutex_unlock(&g_resp.mu);
            break;
        }
        for (int i = 0; i < g_resp.n; i++) {
            dg_comm_t *c = g_resp.list[i];
            for (int guard = 0; guard < 64; guard++) {
                int flag = 0;
                MPI_Status st;
                if (MPI_Iprobe(MPI_ANY_SOURCE, PROBE_TAG_QUERY, c->probe, &flag, &st) != MPI_SUCCESS || !flag)
                    break;
                probe_query_t q;
                if (MPI_Recv(&q, (int)sizeof q, MPI_BYTE, st.MPI_SOURCE, PROBE_TAG_QUERY, c->probe,
                             MPI_STATUS_IGNORE) != MPI_SUCCESS)
                    break;
                probe_reply_t r;
                fill_reply(c, q.nonce, &r);
                /* a few dozen bytes: eager, so this never blocks on the (stuck) asker */
                MPI_Send(&r, (int)sizeof r, MPI_BYTE, st.MPI_SOURCE, PROBE_TAG_REPLY, c->probe);
            }
        }
        pthread_mutex_unlock(&g_resp.mu);
        struct timespec ts = {0, PROBE_POLL_NS};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static dg_status_t responder_register(dg_comm_t *c) {
    pthread_mutex_lock(&g_resp.mu);
    if (g_resp.n == g_resp.cap) {
        int cap = g_resp.cap ? 2 * g_resp.cap : 16;
        dg_comm_t **l = realloc(g_resp.list, (size_t)cap * sizeof *l);
        DG_ASSERT(l);
        g_resp.list = l;
        g_resp.cap = cap;
    }
    g_resp.list[g_resp.n++] = c;
    if (!g_resp.running) {
        g_resp.gen++;
        int rc = pthread_create(&g_resp.th, NULL, responder_main, (void *)(uintptr_t)g_resp.gen);
        if (rc != 0) {
            g_resp.n--;
            pthread_mutex_unlock(&g_resp.mu);
            return DG_ERR(DG_ERR_RUNTIME, "comm %s: cannot start the arrival responder thread: %s", c->name,
                          strerror(rc));
        }
        g_resp.running = 1;
    }
    c->registered = 1;
    pthread_mutex_unlock(&g_resp.mu);
    return DG_OK;
}

static void responder_unregister(dg_comm_t *c) {
    if (!c->registered) return;
    pthread_t join_th;
    int do_join = 0;
    pthread_mutex_lock(&g_resp.mu);
    for (int i = 0; i < g_resp.n; i++)
        if (g_resp.list[i] == c) {
            g_resp.list[i] = g_resp.list[--g_resp.n];
            break;
        }
    c->registered = 0;
    if (g_resp.n == 0 && g_resp.running) {
        g_resp.gen++;
        g_resp.running = 0;
        join_th = g_resp.th;
        do_join = 1;
    }
    pthread_mutex_unlock(&g_resp.mu);
    if (do_join) pthread_join(join_th, NULL);
}

/* Asks every other group member what it has reached; writes a summary for a timeout message. waited_s:
 * how long this rank has been in `stuck` (the deadline was opts.timeout_s into it). */
static void probe_arrivals(dg_comm_t *c, const dg_comm_op_t *stuck, double waited_s, char *out, size_t cap) {
    out[0] = 0;
    int coll = dg_comm__is_collective(stuck->kind);
    if (c->size == 1) return;
    if (!c->opts.arrival_probe || !c->thread_multiple || !c->registered) {
        snprintf(out, cap,
                 coll ? "ranks that did not arrive: unknown (arrival probe %s)" : "peer state: unknown",
                 c->thread_multiple ? "off" : "needs MPI_THREAD_MULTIPLE");
        return;
    }
    int n = c->size;
    probe_reply_t *rep = dg_xcalloc((size_t)n, sizeof *rep);
    MPI_Request *rr = dg_xcalloc((size_t)n, sizeof *rr), *sr = dg_xcalloc((size_t)n, sizeof *sr);
    int *got = dg_xcalloc((size_t)n, sizeof *got);
    /* our own time in the stuck operation when each reply came: a peer that started it less than that
     * minus the timeout ago arrived only after our deadline (durations only: no clocks compared) */
    double *in_op = dg_xcalloc((size_t)n, sizeof *in_op);
    /* test hook: the delay between a deadline and the answers (the responders poll every 5 ms; with a
     * timeout of milliseconds a peer may arrive in between), made long enough to test */
    double d = dg_env_double("DG_TEST_COMM_PROBE_DELAY_S");
    if (d > 0) {
        struct timespec ts = {(time_t)d, (long)((d - (double)(time_t)d) * 1e9)};
        nanosleep(&ts, NULL);
        waited_s += d;
    }
    double op_t0 = dg_now_s() - waited_s;
    static _Atomic int64_t nonce_ctr = 1;
    probe_query_t q = {atomic_fetch_add(&nonce_ctr, 1) + ((int64_t)c->rank << 40), stuck->seq};
    for (int p = 0; p < n; p++) {
        rr[p] = sr[p] = MPI_REQUEST_NULL;
        if (p == c->rank || (!coll && p != stuck->peer)) continue;
        MPI_Irecv(&rep[p], (int)sizeof rep[p], MPI_BYTE, p, PROBE_TAG_REPLY, c->probe, &rr[p]);
        MPI_Isend(&q, (int)sizeof q, MPI_BYTE, p, PROBE_TAG_QUERY, c->probe, &sr[p]);
    }
    /* long enough for a healthy responder (polls every 5 ms) even on an oversubscribed node */
    double grace = c->opts.timeout_s * 0.25;
    if (grace < 1.0) grace = 1.0;
    if (grace > 5.0) grace = 5.0;
    double t0 = dg_now_s();
    for (;;) {
        int pending = 0;
        for (int p = 0; p < n; p++) {
            if (rr[p] == MPI_REQUEST_NULL) continue;
            int flag = 0;
            MPI_Test(&rr[p], &flag, MPI_STATUS_IGNORE);
            if (flag && rep[p].nonce == q.nonce) {
                got[p] = 1;
                in_op[p] = dg_now_s() - op_t0;
            } else if (!flag)
                pending++;
        }
        if (!pending || dg_now_s() - t0 > grace) break;
        struct timespec ts = {0, 1000000L};
        nanosleep(&ts, NULL);
    }
    for (int p = 0; p < n; p++) {
        if (rr[p] != MPI_REQUEST_NULL) {
            MPI_Cancel(&rr[p]);
            MPI_Request_free(&rr[p]);
        }
        if (sr[p] != MPI_REQUEST_NULL) {
            int flag = 0;
            MPI_Test(&sr[p], &flag, MPI_STATUS_IGNORE);
            if (!flag) MPI_Request_free(&sr[p]);
        }
    }
    size_t len = 0;
#define APPEND(...)                                                                                          \
    do {                                                                                                     \
        if (len < cap) {                                                                                     \
            int w_ = snprintf(out + len, cap - len, __VA_ARGS__);                                            \
            if (w_ > 0) len += (size_t)w_;                                                                   \
        }                                                                                                    \
    } while (0)
    if (coll) {
        /* "did not arrive" means: not there when our wait timed out. A peer that reached the collective
         * during the probe (after the deadline) is named as late, not counted as arrived: a timeout shorter
         * than the peers' work before the collective used to print "ranks that did not arrive: none". */
        int nlate = 0;
        for (int p = 0; p < n; p++) {
            if (p == c->rank) continue;
            const char *sep = nlate ? "," : "ranks that did not arrive:";
            if (!got[p]) {
                APPEND("%s %d (world %d, no answer: stopped or dead?)", sep, p, c->world_ranks[p]);
                nlate++;
            } else if (rep[p].started < stuck->seq) {
                APPEND("%s %d (world %d, at collective #%lld, step %lld)", sep, p, c->world_ranks[p],
                       (long long)rep[p].started, (long long)rep[p].step);
                nlate++;
            } else if (rep[p].started == stuck->seq && rep[p].started_ago_ns >= 0 &&
                       in_op[p] - rep[p].started_ago_ns / 1e9 > c->opts.timeout_s) {
                APPEND("%s %d (world %d, arrived %.1f s after the %.1f s timeout: a timeout too short for "
                       "the work before this collective?)",
                       sep, p, c->world_ranks[p], in_op[p] - rep[p].started_ago_ns / 1e9 - c->opts.timeout_s,
                       c->opts.timeout_s);
                nlate++;
            }
        }
        if (!nlate) APPEND("every rank had reached collective #%lld", (long long)stuck->seq);
        /* ranks that arrived with a different operation at the same position: mismatched schedules */
        int nmis = 0;
        for (int p = 0; p < n; p++) {
            if (p == c->rank || !got[p] || rep[p].posted_seq != stuck->seq) continue;
            if (rep[p].posted_kind == (int)stuck->kind && rep[p].posted_count == (int64_t)stuck->count)
                continue;
            if (rep[p].posted_kind < 0 || rep[p].posted_kind >= DG_OP_NKINDS) continue;
            if (!nmis) APPEND("; MISMATCHED collective #%lld (schedules differ):", (long long)stuck->seq);
            APPEND("%s rank %d (world %d) posted %s of %lld elements", nmis ? "," : "", p, c->world_ranks[p],
                   dg_comm__op_name((dg_op_kind_t)rep[p].posted_kind), (long long)rep[p].posted_count);
            nmis++;
        }
        if (!nlate && !nmis) APPEND(" (a peer or the transport is stuck inside it)");
    } else {
        int p = stuck->peer;
        if (!got[p])
            APPEND("peer %d (world %d) did not answer: stopped or dead?", p, c->world_ranks[p]);
        else if (rep[p].cur_kind >= 0 && rep[p].cur_kind < DG_OP_NKINDS)
            APPEND("peer %d (world %d) is in %s #%lld for %.1f s at step %lld", p, c->world_ranks[p],
                   dg_comm__op_name((dg_op_kind_t)rep[p].cur_kind), (long long)rep[p].started,
                   rep[p].running_ns / 1e9, (long long)rep[p].step);
        else
            APPEND("peer %d (world %d) is idle after collective #%lld at step %lld (no matching %s posted?)",
                   p, c->world_ranks[p], (long long)rep[p].done, (long long)rep[p].step,
                   stuck->kind == DG_OP_SEND ? "recv" : "send");
    }
#undef APPEND
    free(rep);
    free(rr);
    free(sr);
    free(got);
    free(in_op);
}

/* ---------------------------------------------------------------------------------------------- */
/* base object                                                                                      */

dg_status_t dg_comm__base_init(dg_comm_t *c, dg_comm_kind_t kind, MPI_Comm group, const dg_comm_opts_t *o) {
    c->kind = kind;
    c->opts = *o;
    snprintf(c->name, sizeof c->name, "%s", o->name ? o->name : "comm");
    c->opts.name = NULL; /* the copy lives in c->name */
    c->spin_s = (o->spin_us < 0 ? 50.0 : o->spin_us) * 1e-6;
    c->ctl = c->probe = MPI_COMM_NULL;
    atomic_init(&c->step, 0);
    atomic_init(&c->coll_started, 0);
    atomic_init(&c->coll_done, 0);
    atomic_init(&c->cur_kind, -1);
    atomic_init(&c->cur_start_ns, 0);
    atomic_init(&c->queued, 0);
    atomic_init(&c->last_posted_seq, 0);
    atomic_init(&c->last_posted_kind, -1);
    atomic_init(&c->last_posted_count, 0);
    atomic_init(&c->failed, 0);
    pthread_mutex_init(&c->fail_mu, NULL);
    int lvl = 0;
    DG_MPI_CHECK(MPI_Query_thread(&lvl));
    c->thread_multiple = lvl >= MPI_THREAD_MULTIPLE;
    DG_MPI_CHECK(MPI_Comm_dup(group, &c->ctl));
    DG_MPI_CHECK(MPI_Comm_set_errhandler(c->ctl, MPI_ERRORS_RETURN));
    DG_MPI_CHECK(MPI_Comm_dup(group, &c->probe));
    DG_MPI_CHECK(MPI_Comm_set_errhandler(c->probe, MPI_ERRORS_RETURN));
    DG_MPI_CHECK(MPI_Comm_rank(c->ctl, &c->rank));
    DG_MPI_CHECK(MPI_Comm_size(c->ctl, &c->size));
    c->world_ranks = dg_xcalloc((size_t)c->size, sizeof(int));
    MPI_Group g, wg;
    DG_MPI_CHECK(MPI_Comm_group(c->ctl, &g));
    DG_MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &wg));
    int *ids = dg_xcalloc((size_t)c->size, sizeof(int));
    for (int i = 0; i < c->size; i++)
        ids[i] = i;
    int rc = MPI_Group_translate_ranks(g, c->size, ids, wg, c->world_ranks);
    free(ids);
    MPI_Group_free(&g);
    MPI_Group_free(&wg);
    DG_MPI_CHECK(rc);
    if (c->size > 1 && c->thread_multiple && c->opts.arrival_probe) DG_TRY(responder_register(c));
    return DG_OK;
}

static void base_release(dg_comm_t *c, int leak) {
    responder_unregister(c);
    if (!leak) {
        if (c->ctl != MPI_COMM_NULL) MPI_Comm_free(&c->ctl);
        if (c->probe != MPI_COMM_NULL) MPI_Comm_free(&c->probe);
        free(c->world_ranks);
        c->world_ranks = NULL;
        pthread_mutex_destroy(&c->fail_mu);
    }
}

void dg_comm__base_destroy(dg_comm_t *c) {
    base_release(c, 0);
}

void dg_comm__base_destroy_leak(dg_comm_t *c) {
    base_release(c, 1);
}

dg_status_t dg_comm__fail(dg_comm_t *c, dg_status_t code, const char *msg) {
    pthread_mutex_lock(&c->fail_mu);
    if (!atomic_load(&c->failed)) {
        dg_comm__strlcpy(c->fail_msg, sizeof c->fail_msg, msg);
        atomic_store(&c->failed, 1);
    }
    pthread_mutex_unlock(&c->fail_mu);
    return DG_ERR(code, "%s", msg);
}

dg_status_t dg_comm__failed_error(dg_comm_t *c) {
    char msg[sizeof c->fail_msg];
    pthread_mutex_lock(&c->fail_mu);
    dg_comm__strlcpy(msg, sizeof msg, c->fail_msg);
    pthread_mutex_unlock(&c->fail_mu);
    return DG_ERR(DG_ERR_PEER, "comm %s is unusable after an earlier failure: %s", c->name, msg);
}

dg_status_t dg_comm__timeout(dg_comm_t *c, const dg_comm_op_t *stuck, const dg_comm_op_t *waited,
                             double waited_s) {
    char what[256], arrivals[1024], extra[300] = "";
    dg_comm__describe(c, stuck, what, sizeof what);
    probe_arrivals(c, stuck, waited_s, arrivals, sizeof arrivals);
    if (waited && waited != stuck && (waited->kind != stuck->kind || waited->seq != stuck->seq)) {
        char w[256];
        dg_comm__describe(c, waited, w, sizeof w);
        snprintf(extra, sizeof extra, " (the wait was for %s, queued behind it)", w);
    }
    char msg[1800];
    snprintf(msg, sizeof msg, "%s timed out after %.1f s at step %lld; %s%s", what, waited_s,
             (long long)stuck->step, arrivals, extra);
    return dg_comm__fail(c, DG_ERR_PEER, msg);
}

/* ---------------------------------------------------------------------------------------------- */
/* creation                                                                                         */

static dg_status_t resolve_opts(const dg_comm_opts_t *o, dg_comm_opts_t *out) {
    if (o)
        *out = *o;
    else
        dg_comm_opts_default(out);
    if (!out->name) out->name = "comm";
    if (out->spin_us < 0) out->spin_us = 50.0;
    return check_opts(out);
}

static dg_status_t check_group(MPI_Comm group, const char *what) {
    int inited = 0, fin = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&fin);
    if (!inited || fin)
        return DG_ERR(DG_ERR_USAGE, "%s: MPI is not initialised (call MPI_Init_thread first)", what);
    if (group == MPI_COMM_NULL) return DG_ERR(DG_ERR_USAGE, "%s: the group is MPI_COMM_NULL", what);
    return DG_OK;
}

dg_status_t dg_comm_create_mpi(MPI_Comm group, const dg_comm_opts_t *o, dg_comm_t **out) {
    if (!out) return DG_ERR(DG_ERR_USAGE, "dg_comm_create_mpi: out is NULL");
    *out = NULL;
    dg_comm_opts_t ro;
    DG_TRY(resolve_opts(o, &ro));
    DG_TRY(check_group(group, "dg_comm_create_mpi"));
    return dg_comm__mpi_create(group, &ro, out);
}

dg_status_t dg_comm_create_nccl(MPI_Comm group, int cuda_device, void *cuda_stream, const dg_comm_opts_t *o,
                                dg_comm_t **out) {
    if (!out) return DG_ERR(DG_ERR_USAGE, "dg_comm_create_nccl: out is NULL");
    *out = NULL;
    dg_comm_opts_t ro;
    DG_TRY(resolve_opts(o, &ro));
    DG_TRY(check_group(group, "dg_comm_create_nccl"));
#ifdef DG_HAVE_CUDA
    if (cuda_device < 0)
        return DG_ERR(DG_ERR_USAGE, "dg_comm_create_nccl: cuda_device must be >= 0, got %d", cuda_device);
    return dg_comm__nccl_create(group, cuda_device, cuda_stream, &ro, out);
#else
    (void)cuda_device;
    (void)cuda_stream;
    return DG_ERR(
        DG_ERR_USAGE,
        "the nccl comm backend is not available: dgtrain was built without CUDA (use parallel.comm=mpi)");
#endif
}

dg_status_t dg_comm_split(dg_comm_t *parent, int color, int key, const dg_comm_opts_t *o, dg_comm_t **out) {
    if (!parent || !out) return DG_ERR(DG_ERR_USAGE, "dg_comm_split: NULL argument");
    *out = NULL;
    if (atomic_load(&parent->failed)) return dg_comm__failed_error(parent);
    dg_comm_opts_t ro;
    if (o) {
        DG_TRY(resolve_opts(o, &ro));
    } else {
        ro = parent->opts;
        ro.name = parent->name;
    }
    DG_TRY(parent->vt->flush(parent));
    return parent->vt->split(parent, color < 0 ? -1 : color, key, &ro, out);
}

void dg_comm_free(dg_comm_t *c) {
    if (!c) return;
    c->vt->destroy(c);
}

/* ---------------------------------------------------------------------------------------------- */
/* mesh                                                                                             */

dg_status_t dg_comm_mesh_create(MPI_Comm world, const dg_mesh_shape_t *shape, dg_comm_kind_t kind,
                                int cuda_device, void *cuda_stream, const dg_comm_opts_t *o,
                                dg_comm_mesh_t **out) {
    if (!shape || !out) return DG_ERR(DG_ERR_USAGE, "dg_comm_mesh_create: NULL argument");
    *out = NULL;
    DG_TRY(check_group(world, "dg_comm_mesh_create"));
    int wsize = 0, wrank = 0;
    DG_MPI_CHECK(MPI_Comm_size(world, &wsize));
    DG_MPI_CHECK(MPI_Comm_rank(world, &wrank));
    for (int d = 0; d < DG_MESH_NDIM; d++)
        if (shape->size[d] < 1)
            return DG_ERR(DG_ERR_USAGE, "mesh: %s must be >= 1, got %d", dg_mesh_dim_name(d), shape->size[d]);
    if (dg_mesh_world(shape) != wsize) {
        char buf[128];
        dg_mesh_format(shape, buf, sizeof buf);
        return DG_ERR(DG_ERR_USAGE, "mesh %s has %d ranks but the job has %d", buf, dg_mesh_world(shape),
                      wsize);
    }
    dg_comm_opts_t ro;
    DG_TRY(resolve_opts(o, &ro));
    dg_comm_mesh_t *m = dg_xcalloc(1, sizeof *m);
    m->shape = *shape;
    dg_mesh_coords(shape, wrank, m->coord);
    dg_status_t s = DG_OK;
    ro.name = "world";
    if (kind == DG_COMM_NCCL)
        s = dg_comm_create_nccl(world, cuda_device, cuda_stream, &ro, &m->world);
    else if (kind == DG_COMM_MPI)
        s = dg_comm_create_mpi(world, &ro, &m->world);
    else
        s = DG_ERR(DG_ERR_USAGE, "dg_comm_mesh_create: unknown comm kind %d", (int)kind);
    /* every group lies within one pipeline stage: the colors count the stage too */
    const int W = dg_mesh_stage_world(shape), stage = dg_mesh_stage(shape, wrank);
    for (int d = 0; d < DG_MESH_NDIM && s == DG_OK; d++) {
        /* the color numbers the other coordinates, so groups are the lines along dimension d */
        int cc[DG_MESH_NDIM];
        memcpy(cc, m->coord, sizeof cc);
        cc[d] = 0;
        ro.name = dg_mesh_dim_name(d);
        s = dg_comm_split(m->world, stage * W + dg_mesh_rank(shape, cc), m->coord[d], &ro, &m->dim[d]);
    }
    if (s == DG_OK) {
        ro.name = "dp";
        s = dg_comm_split(m->world, stage * shape->size[DG_MESH_TP] + m->coord[DG_MESH_TP],
                          m->coord[DG_MESH_DP_REPLICATE] * shape->size[DG_MESH_DP_SHARD] +
                              m->coord[DG_MESH_DP_SHARD],
                          &ro, &m->dp);
    }
    /* pp > 1: the ranks with this rank's coordinates in every stage, group rank = stage; two comms, one
     * per channel (activations, gradients), since nccl matches point-to-point by order only */
    for (int c = 0; c < 2 && s == DG_OK && dg_mesh_pp(shape) > 1; c++) {
        ro.name = c == 0 ? "pp.act" : "pp.grad";
        s = dg_comm_split(m->world, wrank % W, stage, &ro, c == 0 ? &m->pp_act : &m->pp_grad);
    }
    if (s != DG_OK) {
        char msg[1024];
        dg_comm__strlcpy(msg, sizeof msg, dg_last_error());
        dg_comm_mesh_free(m);
        return DG_ERR(s, "%s", msg);
    }
    *out = m;
    return DG_OK;
}

void dg_comm_mesh_free(dg_comm_mesh_t *m) {
    if (!m) return;
    /* children borrow the world comm's stream (nccl): free them first */
    dg_comm_free(m->pp_grad);
    dg_comm_free(m->pp_act);
    dg_comm_free(m->dp);
    for (int d = DG_MESH_NDIM - 1; d >= 0; d--)
        dg_comm_free(m->dim[d]);
    dg_comm_free(m->world);
    free(m);
}

/* ---------------------------------------------------------------------------------------------- */
/* queries                                                                                          */

int dg_comm_rank(const dg_comm_t *c) {
    return c->rank;
}
int dg_comm_size(const dg_comm_t *c) {
    return c->size;
}
const char *dg_comm_name(const dg_comm_t *c) {
    return c->name;
}
dg_comm_kind_t dg_comm_kind(const dg_comm_t *c) {
    return c->kind;
}
const char *dg_comm_backend_name(const dg_comm_t *c) {
    return c->vt->name;
}
int dg_comm_world_rank_of(const dg_comm_t *c, int group_rank) {
    DG_ASSERTF(group_rank >= 0 && group_rank < c->size, "group rank %d of %d", group_rank, c->size);
    return c->world_ranks[group_rank];
}
double dg_comm_timeout(const dg_comm_t *c) {
    return c->opts.timeout_s;
}
void dg_comm_set_step(dg_comm_t *c, int64_t step) {
    atomic_store(&c->step, step);
}

/* ---------------------------------------------------------------------------------------------- */
/* validation and posting                                                                           */

static int ranges_overlap(const void *a, size_t na, const void *b, size_t nb) {
    uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;
    return na && nb && pa < pb + nb && pb < pa + na;
}

static dg_status_t check_common(dg_comm_t *c, dg_op_kind_t k, size_t count, dg_dtype_t dt) {
    if (!c) return DG_ERR(DG_ERR_USAGE, "dg_comm_%s: comm is NULL", dg_comm__op_name(k));
    if (atomic_load_explicit(&c->failed, memory_order_acquire)) return dg_comm__failed_error(c);
    if ((int)dt < DG_F32 || (int)dt > DG_F64)
        return DG_ERR(DG_ERR_USAGE, "%s on %s: unknown dtype %d", dg_comm__op_name(k), c->name, (int)dt);
    if (count > (size_t)INT_MAX)
        return DG_ERR(DG_ERR_USAGE, "%s on %s: count %zu exceeds %d elements per call; split the buffer",
                      dg_comm__op_name(k), c->name, count, INT_MAX);
    return DG_OK;
}

static dg_status_t check_req(dg_comm_t *c, dg_op_kind_t k, dg_comm_req_t **req) {
    if (req) return DG_OK;
    return DG_ERR(DG_ERR_USAGE, "dg_comm_i%s on %s: req is NULL", dg_comm__op_name(k),
                  c ? c->name : "(null)");
}

static dg_status_t check_reduction(dg_comm_t *c, dg_op_kind_t k, dg_dtype_t dt, dg_redop_t red) {
    if (red != DG_RED_SUM && red != DG_RED_AVG)
        return DG_ERR(DG_ERR_USAGE, "%s on %s: unknown reduction %d (expected SUM or AVG)",
                      dg_comm__op_name(k), c->name, (int)red);
    if (dt != DG_F32 && dt != DG_BF16 && dt != DG_F64 && dt != DG_I32)
        return DG_ERR(DG_ERR_USAGE, "%s on %s: reductions support f32, bf16, f64 and i32, not %s",
                      dg_comm__op_name(k), c->name, dg_dtype_name(dt));
    if (dt == DG_I32 && red == DG_RED_AVG)
        return DG_ERR(DG_ERR_USAGE, "%s on %s: AVG of i32 is not defined (use SUM)", dg_comm__op_name(k),
                      c->name);
    return DG_OK;
}

/* Numbers a collective and publishes it for the arrival probe's mismatch check. */
static void number(dg_comm_t *c, dg_comm_op_t *t) {
    t->step = atomic_load_explicit(&c->step, memory_order_relaxed);
    if (!dg_comm__is_collective(t->kind)) return;
    t->seq = ++c->coll_posted;
    atomic_store_explicit(&c->last_posted_count, (int64_t)t->count, memory_order_relaxed);
    atomic_store_explicit(&c->last_posted_kind, (int)t->kind, memory_order_relaxed);
    atomic_store_explicit(&c->last_posted_seq, t->seq, memory_order_release);
}

static void unnumber(dg_comm_t *c, const dg_comm_op_t *t) {
    if (!dg_comm__is_collective(t->kind)) return;
    c->coll_posted--;
    atomic_store(&c->last_posted_seq, c->coll_posted);
}

/* req != NULL: post the validated operation `t` and return its request. req == NULL (a blocking form):
 * let the backend run it inline if it can (no allocation, no hand-off), else post and wait. */
static dg_status_t submit(dg_comm_t *c, dg_comm_op_t *t, dg_comm_req_t **req) {
    number(c, t);
    if (!req && c->vt->run_inline && dg_comm__is_collective(t->kind)) {
        int ran = 0;
        dg_status_t s = c->vt->run_inline(c, t, &ran);
        if (ran) return s;
    }
    dg_comm_op_t *op = dg_xmalloc(sizeof *op);
    memcpy(op, t, offsetof(dg_comm_op_t, msg)); /* the message buffer needs no clearing */
    op->msg[0] = 0;
    op->next = op->prev = NULL;
    op->mreq = MPI_REQUEST_NULL;
    op->event = NULL;
    op->abandoned = 0;
    op->status = DG_OK;
    atomic_init(&op->state, DG_OPST_QUEUED);
    op->t_post = dg_now_s();
    op->t_start = 0;
    dg_status_t s = c->vt->post(c, op);
    if (s != DG_OK) {
        unnumber(c, t);
        free(op);
        return s;
    }
    if (req) {
        *req = op;
        return DG_OK;
    }
    return c->vt->wait(c, op);
}

#define NEED_BUF(p, bytes, what)                                                                             \
    do {                                                                                                     \
        if ((bytes) != 0 && !(p))                                                                            \
            return DG_ERR(DG_ERR_USAGE, "%s on %s: %s buffer is NULL", dg_comm__op_name(t.kind), c->name,    \
                          what);                                                                             \
    } while (0)

static dg_status_t do_allgather(dg_comm_t *c, const void *send, void *recv, size_t count_per_rank,
                                dg_dtype_t dt, dg_comm_req_t **req) {
    DG_TRY(check_common(c, DG_OP_ALLGATHER, count_per_rank, dt));
    dg_comm_op_t t = {.kind = DG_OP_ALLGATHER, .send = send, .recv = recv, .count = count_per_rank, .dt = dt};
    size_t blk = count_per_rank * dg_dtype_size(dt);
    NEED_BUF(send, blk, "send");
    NEED_BUF(recv, blk, "recv");
    if (blk && (const char *)send == (const char *)recv + (size_t)c->rank * blk)
        t.inplace = 1;
    else if (ranges_overlap(send, blk, recv, blk * (size_t)c->size))
        return DG_ERR(
            DG_ERR_USAGE,
            "allgather on %s: send overlaps recv; in place needs send == recv + rank * count_per_rank",
            c->name);
    return submit(c, &t, req);
}

static dg_status_t do_reduce_scatter(dg_comm_t *c, const void *send, void *recv, size_t count_per_rank,
                                     dg_dtype_t dt, dg_redop_t red, dg_comm_req_t **req) {
    DG_TRY(check_common(c, DG_OP_REDUCE_SCATTER, count_per_rank, dt));
    DG_TRY(check_reduction(c, DG_OP_REDUCE_SCATTER, dt, red));
    dg_comm_op_t t = {.kind = DG_OP_REDUCE_SCATTER,
                      .send = send,
                      .recv = recv,
                      .count = count_per_rank,
                      .dt = dt,
                      .red = red};
    size_t blk = count_per_rank * dg_dtype_size(dt);
    NEED_BUF(send, blk, "send");
    NEED_BUF(recv, blk, "recv");
    if (blk && (const char *)recv == (const char *)send + (size_t)c->rank * blk)
        t.inplace = 1;
    else if (ranges_overlap(send, blk * (size_t)c->size, recv, blk))
        return DG_ERR(
            DG_ERR_USAGE,
            "reduce_scatter on %s: recv overlaps send; in place needs recv == send + rank * count_per_rank",
            c->name);
    return submit(c, &t, req);
}

static dg_status_t do_allreduce(dg_comm_t *c, const void *send, void *recv, size_t count, dg_dtype_t dt,
                                dg_redop_t red, dg_comm_req_t **req) {
    DG_TRY(check_common(c, DG_OP_ALLREDUCE, count, dt));
    DG_TRY(check_reduction(c, DG_OP_ALLREDUCE, dt, red));
    dg_comm_op_t t = {
        .kind = DG_OP_ALLREDUCE, .send = send, .recv = recv, .count = count, .dt = dt, .red = red};
    size_t bytes = count * dg_dtype_size(dt);
    NEED_BUF(send, bytes, "send");
    NEED_BUF(recv, bytes, "recv");
    if (send == recv)
        t.inplace = 1;
    else if (ranges_overlap(send, bytes, recv, bytes))
        return DG_ERR(DG_ERR_USAGE,
                      "allreduce on %s: send and recv partly overlap (in place needs send == recv)", c->name);
    return submit(c, &t, req);
}

static dg_status_t do_broadcast(dg_comm_t *c, void *buf, size_t count, dg_dtype_t dt, int root,
                                dg_comm_req_t **req) {
    DG_TRY(check_common(c, DG_OP_BROADCAST, count, dt));
    dg_comm_op_t t = {
        .kind = DG_OP_BROADCAST, .send = buf, .recv = buf, .count = count, .dt = dt, .peer = root};
    NEED_BUF(buf, count * dg_dtype_size(dt), "");
    if (root < 0 || root >= c->size)
        return DG_ERR(DG_ERR_USAGE, "broadcast on %s: root %d is not a rank of this %d-rank group", c->name,
                      root, c->size);
    return submit(c, &t, req);
}

static dg_status_t check_peer(dg_comm_t *c, dg_op_kind_t k, int peer, int tag) {
    if (peer < 0 || peer >= c->size || peer == c->rank)
        return DG_ERR(DG_ERR_USAGE,
                      "%s on %s: peer %d must be another rank of this %d-rank group (own rank %d)",
                      dg_comm__op_name(k), c->name, peer, c->size, c->rank);
    if (tag < 0 || tag > 32767)
        return DG_ERR(DG_ERR_USAGE, "%s on %s: tag %d must be in 0..32767", dg_comm__op_name(k), c->name,
                      tag);
    return DG_OK;
}

static dg_status_t do_p2p(dg_comm_t *c, dg_op_kind_t k, void *buf, size_t count, dg_dtype_t dt, int peer,
                          int tag, dg_comm_req_t **req) {
    DG_TRY(check_common(c, k, count, dt));
    DG_TRY(check_peer(c, k, peer, tag));
    dg_comm_op_t t = {.kind = k, .count = count, .dt = dt, .peer = peer, .tag = tag};
    if (k == DG_OP_SEND)
        t.send = buf;
    else
        t.recv = buf;
    NEED_BUF(buf, count * dg_dtype_size(dt), k == DG_OP_SEND ? "send" : "recv");
    return submit(c, &t, req);
}

/* non-blocking forms */
dg_status_t dg_comm_iallgather(dg_comm_t *c, const void *send, void *recv, size_t count_per_rank,
                               dg_dtype_t dt, dg_comm_req_t **req) {
    DG_TRY(check_req(c, DG_OP_ALLGATHER, req));
    return do_allgather(c, send, recv, count_per_rank, dt, req);
}
dg_status_t dg_comm_ireduce_scatter(dg_comm_t *c, const void *send, void *recv, size_t count_per_rank,
                                    dg_dtype_t dt, dg_redop_t red, dg_comm_req_t **req) {
    DG_TRY(check_req(c, DG_OP_REDUCE_SCATTER, req));
    return do_reduce_scatter(c, send, recv, count_per_rank, dt, red, req);
}
dg_status_t dg_comm_iallreduce(dg_comm_t *c, const void *send, void *recv, size_t count, dg_dtype_t dt,
                               dg_redop_t red, dg_comm_req_t **req) {
    DG_TRY(check_req(c, DG_OP_ALLREDUCE, req));
    return do_allreduce(c, send, recv, count, dt, red, req);
}
dg_status_t dg_comm_ibroadcast(dg_comm_t *c, void *buf, size_t count, dg_dtype_t dt, int root,
                               dg_comm_req_t **req) {
    DG_TRY(check_req(c, DG_OP_BROADCAST, req));
    return do_broadcast(c, buf, count, dt, root, req);
}
dg_status_t dg_comm_isend(dg_comm_t *c, const void *buf, size_t count, dg_dtype_t dt, int peer, int tag,
                          dg_comm_req_t **req) {
    DG_TRY(check_req(c, DG_OP_SEND, req));
    return do_p2p(c, DG_OP_SEND, (void *)buf, count, dt, peer, tag, req);
}
dg_status_t dg_comm_irecv(dg_comm_t *c, void *buf, size_t count, dg_dtype_t dt, int peer, int tag,
                          dg_comm_req_t **req) {
    DG_TRY(check_req(c, DG_OP_RECV, req));
    return do_p2p(c, DG_OP_RECV, buf, count, dt, peer, tag, req);
}

/* Blocking forms: the backend may run a collective inline when nothing else is outstanding; otherwise
 * post + wait, so they share the timeout and the FIFO with the non-blocking ones. */
dg_status_t dg_comm_allgather(dg_comm_t *c, const void *send, void *recv, size_t n, dg_dtype_t dt) {
    return do_allgather(c, send, recv, n, dt, NULL);
}
dg_status_t dg_comm_reduce_scatter(dg_comm_t *c, const void *send, void *recv, size_t n, dg_dtype_t dt,
                                   dg_redop_t op) {
    return do_reduce_scatter(c, send, recv, n, dt, op, NULL);
}
dg_status_t dg_comm_allreduce(dg_comm_t *c, const void *send, void *recv, size_t n, dg_dtype_t dt,
                              dg_redop_t op) {
    return do_allreduce(c, send, recv, n, dt, op, NULL);
}
dg_status_t dg_comm_broadcast(dg_comm_t *c, void *buf, size_t n, dg_dtype_t dt, int root) {
    return do_broadcast(c, buf, n, dt, root, NULL);
}
dg_status_t dg_comm_send(dg_comm_t *c, const void *buf, size_t n, dg_dtype_t dt, int peer, int tag) {
    return do_p2p(c, DG_OP_SEND, (void *)buf, n, dt, peer, tag, NULL);
}
dg_status_t dg_comm_recv(dg_comm_t *c, void *buf, size_t n, dg_dtype_t dt, int peer, int tag) {
    return do_p2p(c, DG_OP_RECV, buf, n, dt, peer, tag, NULL);
}
dg_status_t dg_comm_barrier(dg_comm_t *c) {
    DG_TRY(check_common(c, DG_OP_BARRIER, 0, DG_F32));
    dg_comm_op_t t = {.kind = DG_OP_BARRIER, .dt = DG_F32};
    return submit(c, &t, NULL);
}

dg_status_t dg_comm_wait(dg_comm_t *c, dg_comm_req_t *req) {
    if (!c || !req) return DG_ERR(DG_ERR_USAGE, "dg_comm_wait: NULL argument");
    return c->vt->wait(c, req);
}

dg_status_t dg_comm_test(dg_comm_t *c, dg_comm_req_t *req, int *done) {
    if (!c || !req || !done) return DG_ERR(DG_ERR_USAGE, "dg_comm_test: NULL argument");
    *done = 0;
    return c->vt->test(c, req, done);
}

void dg_comm_wait_started(dg_comm_t *c, dg_comm_req_t *req) {
    if (!c || !req || dg_comm_kind(c) != DG_COMM_MPI) return;
    double t0 = dg_now_s();
    while (atomic_load_explicit(&req->state, memory_order_acquire) == DG_OPST_QUEUED &&
           !atomic_load(&c->failed) && dg_now_s() - t0 < 0.01)
        sched_yield();
}

dg_status_t dg_comm_flush(dg_comm_t *c) {
    if (!c) return DG_ERR(DG_ERR_USAGE, "dg_comm_flush: comm is NULL");
    if (atomic_load(&c->failed)) return dg_comm__failed_error(c);
    return c->vt->flush(c);
}

/* ---------------------------------------------------------------------------------------------- */
/* streams, health, abort                                                                           */

dg_status_t dg_comm_begin_after(dg_comm_t *c, void *stream) {
    if (!c) return DG_ERR(DG_ERR_USAGE, "dg_comm_begin_after: comm is NULL");
    if (atomic_load(&c->failed)) return dg_comm__failed_error(c);
    return c->vt->begin_after(c, stream);
}

dg_status_t dg_comm_stream_wait(dg_comm_t *c, dg_comm_req_t *req, void *stream) {
    if (!c || !req) return DG_ERR(DG_ERR_USAGE, "dg_comm_stream_wait: NULL argument");
    return c->vt->stream_wait(c, req, stream);
}

dg_status_t dg_comm_poll(dg_comm_t *c) {
    if (!c) return DG_ERR(DG_ERR_USAGE, "dg_comm_poll: comm is NULL");
    if (atomic_load(&c->failed)) return dg_comm__failed_error(c);
    if (c->vt->poll) return c->vt->poll(c);
    return DG_OK;
}

/* Test hook (DG_TEST_COMM_FAIL_RANK / _STEP): on that MPI_COMM_WORLD rank, once the comm's step has
 * reached the given one, the communicator fails as a lost peer would make it: marked failed and, on
 * nccl, really aborted (ncclCommAbort), so that a collective in flight on any rank can only end by the
 * watchdog. */
static void test_fail_hook(dg_comm_t *c) {
    int64_t r = dg_env_int("DG_TEST_COMM_FAIL_RANK"), s = dg_env_int("DG_TEST_COMM_FAIL_STEP");
    if (r < 0 || s < 0 || atomic_load(&c->failed)) return;
    int wr = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &wr);
    if (wr != r || atomic_load(&c->step) < s) return;
    char msg[256];
    snprintf(msg, sizeof msg, "test hook DG_TEST_COMM_FAIL_RANK=%lld: communicator %s failed at step %lld",
             (long long)r, c->name, (long long)atomic_load(&c->step));
    DG_LOG_WARN("%s", msg);
    (void)dg_comm__fail(c, DG_ERR_PEER, msg);
    if (c->vt->abort_backend) c->vt->abort_backend(c);
}

int dg_comm_health_poll(void *ctx, char *msg, size_t cap) {
    dg_comm_t *c = ctx;
    test_fail_hook(c);
    if (dg_comm_poll(c) == DG_OK) return 0;
    /* NCCL's async error is only recorded by dg_comm_poll; make sure the comm is marked failed too */
    pthread_mutex_lock(&c->fail_mu);
    if (!atomic_load(&c->failed)) {
        dg_comm__strlcpy(c->fail_msg, sizeof c->fail_msg, dg_last_error());
        atomic_store(&c->failed, 1);
    }
    snprintf(msg, cap, "communicator %s (%s) failed: %s", c->name, dg_comm_backend_name(c), c->fail_msg);
    pthread_mutex_unlock(&c->fail_mu);
    /* unblock whatever waits in the communicator (ncclCommAbort); the watchdog then ends the job */
    if (c->vt->abort_backend) c->vt->abort_backend(c);
    return 1;
}

void dg_comm_state(dg_comm_t *c, char *buf, size_t cap) {
    if (!buf || !cap) return;
    if (!c) {
        snprintf(buf, cap, "(no comm)");
        return;
    }
    if (atomic_load(&c->failed)) {
        pthread_mutex_lock(&c->fail_mu);
        snprintf(buf, cap, "%s: failed: %s", c->name, c->fail_msg);
        pthread_mutex_unlock(&c->fail_mu);
        return;
    }
    c->vt->state(c, buf, cap);
}

void dg_comm_abort(dg_comm_t *c, int code) {
    fflush(stdout);
    fflush(stderr);
    if (c && c->vt->abort_backend) c->vt->abort_backend(c);
    MPI_Abort(MPI_COMM_WORLD, code);
    /* MPI_Abort does not return under Open MPI; if an MPI ever does, still end with the agreed code */
    _exit(code);
}
