/* health.c — the per-rank watchdog thread: progress timer, star heartbeats to/from rank 0, abort notices.
 *
 * Why a star and not a ring: rank 0 then sees every rank's progress and can tell all ranks which rank
 * has been stuck the longest, so a rank that only waits in a collective blames the rank it waits for.
 * Rank 0 drains heartbeats with a single ANY_SOURCE receive; per heartbeat period it sends world-1
 * small messages, which is negligible next to training traffic even at thousands of ranks.
 *
 * All MPI traffic here runs on a private MPI_Comm_dup with MPI_ERRORS_RETURN, on the health thread only
 * (plus the abort notices, which may be sent from the thread calling dg_health_abort).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dg_json.h"
#include "dg_mpi.h"
#include "health.h"
#include "dg_env.h"

enum { TAG_HB = 7101, TAG_ABORT = 7102 };
enum { MSG_HB = 1, MSG_BYE = 2 };
#define WHAT_CAP 64
#define WHAT_WORDS (WHAT_CAP / 8)
#define HOST_CAP 64
#define MAX_POLLS 8
#define ABORT_TEXT_CAP 448

/* Rank 0's view of the job, sent back with every heartbeat: the rank that has made no progress for the
 * longest, and the rank whose heartbeat has been missing for the longest (-1: none). */
typedef struct {
    int32_t worst_rank, silent_rank;
    int64_t worst_step, silent_step;
    double worst_age, silent_for;
    char worst_what[WHAT_CAP], silent_what[WHAT_CAP];
    double best_age; /* the smallest no-progress age of any rank: how long ago the job last moved forward */
    int32_t worst_waiting; /* the worst rank was waiting in a collective of its I/O activity */
} summary_t;

/* One heartbeat. Homogeneous clusters only (sent as bytes): every rank runs the same binary. */
typedef struct {
    int32_t kind, rank;
    int64_t step;
    double age;      /* seconds since the sender's activity last changed, at send time */
    int32_t waiting; /* the sender waits in a collective of its I/O activity (progress source) */
    char what[WHAT_CAP];
    summary_t sum; /* meaningful from rank 0 only */
} hb_msg_t;

typedef struct {
    int32_t culprit, from;
    char text[ABORT_TEXT_CAP];
} abort_msg_t;

/* What this rank knows about one peer (rank 0: every rank; others: rank 0 only). */
typedef struct {
    double last_seen;   /* local monotonic time of its last heartbeat (creation time before the first) */
    double age_at_recv; /* its activity age as reported in that heartbeat */
    int waiting;        /* ... and whether it waited in a collective of an I/O activity */
    int64_t step;
    char what[WHAT_CAP];
    int bye;
} peer_t;

struct dg_health {
    MPI_Comm comm;
    int rank, size;
    char host[HOST_CAP];
    char (*hosts)[HOST_CAP];
    double hb_s, timeout_s, poll_s, late_s;

    /* Activity, written by the loop: a seqlock over the label so the loop never blocks. */
    _Atomic uint64_t act_seq;
    _Atomic uint32_t act_ver;
    _Atomic int64_t act_step;
    _Atomic uint64_t act_words[WHAT_WORDS];
    _Atomic int64_t act_budget_us; /* dg_health_expect: longer stall allowed for this activity (0 = none) */
    atomic_int act_io;             /* dg_health_set_io_activity: progress-judged I/O (0 = no) */
    atomic_flag act_lock;

    /* The health thread's view of its own activity. */
    uint64_t seen_seq;
    double seen_at;
    uint64_t seen_progress; /* the progress source's value at the last change seen */

    uint64_t (*progress)(void *, int *); /* dg_health_set_progress_source */
    int self_waiting;                    /* the progress source's last answer (health thread) */
    void *progress_ctx;
    void (*on_abort)(void *); /* dg_health_set_abort_hook */
    void *abort_ctx;

    peer_t *peers; /* indexed by rank */
    hb_msg_t rbuf;
    MPI_Request rreq;
    hb_msg_t *sbuf; /* rank 0: one per destination rank; others: [0] for rank 0 */
    MPI_Request *sreq;
    int *bye_sent_to;
    int nbye_in;
    int bye_sent;
    double last_sent;

    /* Rank 0's summary (at rank 0 computed, elsewhere as last received) and when it was made. */
    summary_t sum;
    double sum_at;

    abort_msg_t abuf;
    MPI_Request areq;

    pthread_t thr;
    int thr_started;
    atomic_int stopping;
    atomic_int aborting;

    pthread_mutex_t mu; /* sink and poll hooks */
    void (*sink)(void *, const char *);
    void *sink_ctx;
    int (*poll[MAX_POLLS])(void *, char *, size_t);
    void *poll_ctx[MAX_POLLS];
    int npoll;

    int stall_rank;
    int64_t stall_step;
};

/* ---------------------------------------------------------------- helpers */

static void sleep_s(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* The body of a JSON string (without its quotes, which the callers' formats add) by the tree's one
 * escaper (dg_json.h), so health events stay valid JSON whatever a host name or message holds. */
static void json_escape(char *out, size_t cap, const char *s) {
    dg_json_quote(out, cap, s);
    size_t len = strlen(out);
    if (len >= 2) {
        memmove(out, out + 1, len - 2);
        out[len - 2] = 0;
    } else {
        out[0] = 0;
    }
}

static void copy_label(char dst[WHAT_CAP], const char *src) {
    snprintf(dst, WHAT_CAP, "%s", src ? src : "");
}

static const char *host_of(const dg_health_t *h, int r) {
    return (r >= 0 && r < h->size) ? h->hosts[r] : "?";
}

static void read_activity(dg_health_t *h, int64_t *step, char what[WHAT_CAP]) {
    uint64_t words[WHAT_WORDS];
    int64_t st = 0;
    for (int tries = 0; tries < 1000; tries++) {
        uint32_t v1 = atomic_load_explicit(&h->act_ver, memory_order_acquire);
        if (v1 & 1u) continue;
        for (int i = 0; i < WHAT_WORDS; i++)
            words[i] = atomic_load_explicit(&h->act_words[i], memory_order_relaxed);
        st = atomic_load_explicit(&h->act_step, memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&h->act_ver, memory_order_relaxed) == v1) break;
    }
    memcpy(what, words, WHAT_CAP);
    what[WHAT_CAP - 1] = 0;
    *step = st;
}

/* Seconds since this rank's activity last changed (as seen by the health thread's polling); during an
 * I/O activity, a change of the progress source counts as a change too. */
static double own_age(dg_health_t *h, double now) {
    uint64_t seq = atomic_load_explicit(&h->act_seq, memory_order_acquire);
    if (seq != h->seen_seq) {
        h->seen_seq = seq;
        h->seen_at = now;
    }
    pthread_mutex_lock(&h->mu);
    h->self_waiting = 0;
    if (h->progress) {
        int w = 0;
        uint64_t p = h->progress(h->progress_ctx, &w);
        h->self_waiting = atomic_load_explicit(&h->act_io, memory_order_relaxed) && w;
        if (p != h->seen_progress) {
            h->seen_progress = p;
            if (atomic_load_explicit(&h->act_io, memory_order_relaxed)) h->seen_at = now;
        }
    }
    pthread_mutex_unlock(&h->mu);
    return now - h->seen_at;
}

static void emit(dg_health_t *h, const char *fields) {
    pthread_mutex_lock(&h->mu);
    void (*fn)(void *, const char *) = h->sink;
    void *ctx = h->sink_ctx;
    pthread_mutex_unlock(&h->mu);
    if (fn) fn(ctx, fields);
}

/* ---------------------------------------------------------------- abort paths */

static void run_abort_hook(dg_health_t *h) {
    pthread_mutex_lock(&h->mu);
    void (*fn)(void *) = h->on_abort;
    void *ctx = h->abort_ctx;
    pthread_mutex_unlock(&h->mu);
    if (fn) fn(ctx);
}

/* Tell everybody, then bring the job down with exit code 3. Never returns. */
/* How long a rank that sent or received an abort notice waits before it leaves: the launcher ends the
 * whole job as soon as one rank exits, so every rank's health thread (polling every poll_s) must have had
 * time to take its notice, log it and leave with exit code 3 on its own. */
static double notice_grace_s(const dg_health_t *h) {
    return fmin(1.0, fmax(0.3, 3 * h->poll_s));
}

static void __attribute__((noreturn)) abort_job(dg_health_t *h, int culprit, const char *text) {
    if (atomic_exchange(&h->aborting, 1)) {
        /* Another thread of this rank is already taking the job down; let it finish. */
        for (;;)
            sleep_s(1.0);
    }
    DG_LOG_ERROR("%s", text);
    char esc[2 * ABORT_TEXT_CAP];
    json_escape(esc, sizeof esc, text);
    char hesc[2 * HOST_CAP];
    json_escape(hesc, sizeof hesc, host_of(h, culprit));
    char fields[3 * ABORT_TEXT_CAP];
    snprintf(fields, sizeof fields,
             "\"kind\":\"watchdog\",\"culprit_rank\":%d,\"culprit_host\":\"%s\",\"reporter_rank\":%d,"
             "\"exit_code\":3,\"message\":\"%s\"",
             culprit, hesc, h->rank, esc);
    emit(h, fields);
    run_abort_hook(h);

    /* Notices are best effort: a stopped or dead peer never takes its message, and MPI_Abort below
     * kills whatever is left anyway. */
    int n = h->size - 1;
    if (n > 0) {
        abort_msg_t *m = dg_xcalloc(1, sizeof *m);
        m->culprit = culprit;
        m->from = h->rank;
        snprintf(m->text, sizeof m->text, "%s", text);
        MPI_Request *reqs = dg_xcalloc((size_t)n, sizeof *reqs);
        int k = 0;
        for (int r = 0; r < h->size; r++) {
            if (r == h->rank) continue;
            if (MPI_Isend(m, (int)sizeof *m, MPI_BYTE, r, TAG_ABORT, h->comm, &reqs[k]) != MPI_SUCCESS)
                reqs[k] = MPI_REQUEST_NULL;
            k++;
        }
        double t0 = dg_now_s();
        int done = 0;
        while (!done && dg_now_s() - t0 < 1.0) {
            if (MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS) break;
            if (!done) sleep_s(0.01);
        }
        /* Give receivers a moment to log and exit 3 themselves before the launcher starts killing. */
        sleep_s(notice_grace_s(h));
    }
    fflush(stdout);
    fflush(stderr);
    MPI_Abort(h->comm, DG_ERR_PEER);
    _exit(DG_ERR_PEER);
}

/* Another rank is aborting the job: log it and leave with exit code 3 right away. */
static void __attribute__((noreturn)) notified(dg_health_t *h, const abort_msg_t *m) {
    if (atomic_exchange(&h->aborting, 1)) {
        for (;;)
            sleep_s(1.0);
    }
    char text[ABORT_TEXT_CAP];
    snprintf(text, sizeof text, "%s", m->text);
    /* Rank 0 says it on stderr whatever the log level; the others only write their log file, or a big
     * job would print one line per rank. */
    dg_log(h->rank == 0 ? DG_LOG_WARN : DG_LOG_INFO,
           "job aborted by the watchdog on rank %d (%s): %s; exiting with code 3", (int)m->from,
           host_of(h, m->from), text);
    if (h->rank == 0) {
        char esc[2 * ABORT_TEXT_CAP];
        json_escape(esc, sizeof esc, text);
        char hesc[2 * HOST_CAP];
        json_escape(hesc, sizeof hesc, host_of(h, m->culprit));
        char fields[3 * ABORT_TEXT_CAP];
        snprintf(fields, sizeof fields,
                 "\"kind\":\"watchdog\",\"culprit_rank\":%d,\"culprit_host\":\"%s\",\"reporter_rank\":%d,"
                 "\"exit_code\":3,\"message\":\"%s\"",
                 (int)m->culprit, hesc, (int)m->from, esc);
        emit(h, fields);
    }
    run_abort_hook(h);
    fflush(stdout);
    fflush(stderr);
    sleep_s(notice_grace_s(h)); /* the other ranks take their notices before the launcher kills them */
    _exit(DG_ERR_PEER);
}

static void __attribute__((noreturn)) mpi_failed(dg_health_t *h, const char *call, int rc, int peer) {
    char es[MPI_MAX_ERROR_STRING];
    int n = 0;
    MPI_Error_string(rc, es, &n);
    char text[ABORT_TEXT_CAP];
    snprintf(text, sizeof text,
             "health monitor on rank %d (%s): MPI call %s (peer rank %d) failed: %s; the peer is probably "
             "dead; aborting the job with exit code 3",
             h->rank, h->host, call, peer, es);
    abort_job(h, peer, text);
}

void dg_health_abort(dg_health_t *h, const char *reason) {
    if (!h) {
        DG_LOG_ERROR("%s", reason ? reason : "fatal error");
        fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, DG_ERR_PEER);
        _exit(DG_ERR_PEER);
    }
    char text[ABORT_TEXT_CAP];
    snprintf(text, sizeof text, "rank %d (%s): %s; aborting the job with exit code 3", h->rank, h->host,
             reason ? reason : "fatal error");
    abort_job(h, h->rank, text);
}

/* ---------------------------------------------------------------- heartbeats */

static void fill_hb(dg_health_t *h, hb_msg_t *m, int kind, double now) {
    memset(m, 0, sizeof *m);
    m->kind = kind;
    m->rank = h->rank;
    read_activity(h, &m->step, m->what);
    m->age = own_age(h, now);
    m->waiting = h->self_waiting;
    m->sum = h->sum;
}

/* Post (or re-post) the heartbeat receive. Rank 0 hears from anybody; the others only from rank 0. */
static void post_recv(dg_health_t *h) {
    int src = h->rank == 0 ? MPI_ANY_SOURCE : 0;
    int rc = MPI_Irecv(&h->rbuf, (int)sizeof h->rbuf, MPI_BYTE, src, TAG_HB, h->comm, &h->rreq);
    if (rc != MPI_SUCCESS) mpi_failed(h, "MPI_Irecv(heartbeat)", rc, src == MPI_ANY_SOURCE ? -1 : src);
}

/* Rank 0: recompute the summary (who made no progress for the longest, itself included; who has been
 * silent for the longest). */
static void update_summary(dg_health_t *h, double now) {
    summary_t *S = &h->sum;
    S->worst_rank = 0;
    S->worst_age = own_age(h, now);
    S->best_age = S->worst_age;
    S->worst_waiting = h->self_waiting;
    read_activity(h, &S->worst_step, S->worst_what);
    S->silent_rank = -1;
    S->silent_for = 0;
    for (int r = 1; r < h->size; r++) {
        peer_t *p = &h->peers[r];
        if (p->bye) continue;
        double silent = now - p->last_seen;
        double a = p->age_at_recv + silent;
        if (a < S->best_age) S->best_age = a;
        /* during I/O a rank that is not waiting in a collective is the likelier culprit than one that is,
         * whatever their ages (the waiter may have arrived before the other stopped) */
        int better = p->waiting == S->worst_waiting ? a > S->worst_age : S->worst_waiting;
        if (better) {
            S->worst_age = a;
            S->worst_waiting = p->waiting;
            S->worst_rank = r;
            S->worst_step = p->step;
            copy_label(S->worst_what, p->what);
        }
        if (silent > S->silent_for) {
            S->silent_for = silent;
            S->silent_rank = r;
            S->silent_step = p->step;
            copy_label(S->silent_what, p->what);
        }
    }
    h->sum_at = now;
}

static bool drain_heartbeats(dg_health_t *h, double now) {
    bool progressed = false;
    for (;;) {
        if (h->rreq == MPI_REQUEST_NULL) return progressed;
        int flag = 0;
        MPI_Status st;
        int rc = MPI_Test(&h->rreq, &flag, &st);
        if (rc != MPI_SUCCESS) mpi_failed(h, "MPI_Test(heartbeat)", rc, h->rank == 0 ? -1 : 0);
        if (!flag) return progressed;
        progressed = true;
        int src = st.MPI_SOURCE;
        DG_ASSERTF(src >= 0 && src < h->size && src != h->rank, "heartbeat from bad source %d", src);
        peer_t *p = &h->peers[src];
        p->last_seen = now;
        p->age_at_recv = h->rbuf.age;
        p->waiting = h->rbuf.waiting;
        p->step = h->rbuf.step;
        copy_label(p->what, h->rbuf.what);
        if (h->rank != 0) {
            h->sum = h->rbuf.sum;
            h->sum.worst_what[WHAT_CAP - 1] = 0;
            h->sum.silent_what[WHAT_CAP - 1] = 0;
            h->sum_at = now;
        }
        bool more = true;
        if (h->rbuf.kind == MSG_BYE) {
            p->bye = 1;
            if (h->rank == 0) {
                h->nbye_in++;
                more = h->nbye_in < h->size - 1;
            } else {
                more = false;
            }
        }
        h->rreq = MPI_REQUEST_NULL;
        if (more) post_recv(h);
    }
}

static bool send_done(dg_health_t *h, int i) {
    if (h->sreq[i] == MPI_REQUEST_NULL) return true;
    int flag = 0;
    int rc = MPI_Test(&h->sreq[i], &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) mpi_failed(h, "MPI_Test(heartbeat send)", rc, h->rank == 0 ? i : 0);
    return flag != 0;
}

static void send_one(dg_health_t *h, int i, int dest, int kind, double now) {
    fill_hb(h, &h->sbuf[i], kind, now);
    int rc = MPI_Isend(&h->sbuf[i], (int)sizeof h->sbuf[i], MPI_BYTE, dest, TAG_HB, h->comm, &h->sreq[i]);
    if (rc != MPI_SUCCESS) mpi_failed(h, "MPI_Isend(heartbeat)", rc, dest);
}

/* Send heartbeats when due, and the final byes once stopping. Returns true when this rank has nothing
 * left to send or receive (only possible after dg_health_free asked it to stop). */
static bool heartbeat_io(dg_health_t *h, double now, bool stopping) {
    if (h->size == 1) return stopping;
    bool due = now - h->last_sent >= h->hb_s;
    if (h->rank == 0) {
        if (due) update_summary(h, now);
        bool all_in = h->nbye_in == h->size - 1;
        bool all_out = true;
        for (int r = 1; r < h->size; r++) {
            if (h->bye_sent_to[r]) {
                if (!send_done(h, r)) all_out = false;
                continue;
            }
            all_out = false;
            if (stopping && all_in) {
                /* Everyone said bye: our bye is the last message each of them waits for. */
                if (send_done(h, r)) {
                    send_one(h, r, r, MSG_BYE, now);
                    h->bye_sent_to[r] = 1;
                }
            } else if (due && send_done(h, r)) {
                /* A send still pending means that rank is not draining (stopped?): skip it this round
                 * rather than pile messages on it; the others must keep hearing from us. */
                send_one(h, r, r, MSG_HB, now);
            }
        }
        if (due) h->last_sent = now;
        return stopping && all_in && all_out;
    }
    if (!h->bye_sent) {
        if (stopping) {
            if (send_done(h, 0)) {
                send_one(h, 0, 0, MSG_BYE, now);
                h->bye_sent = 1;
            }
        } else if (due && send_done(h, 0)) {
            send_one(h, 0, 0, MSG_HB, now);
            h->last_sent = now;
        }
        return false;
    }
    return send_done(h, 0) && h->peers[0].bye;
}

/* ---------------------------------------------------------------- watchdog checks */

static void check_peers(dg_health_t *h, double now) {
    for (int r = 0; r < h->size; r++) {
        if (r == h->rank) continue;
        if (h->rank != 0 && r != 0) continue;
        peer_t *p = &h->peers[r];
        if (p->bye) continue;
        double silent = now - p->last_seen;
        if (silent <= h->timeout_s) continue;
        char text[ABORT_TEXT_CAP];
        snprintf(
            text, sizeof text,
            "watchdog: no heartbeat from rank %d (host %s) for %.1f s (health.timeout_s=%g); it was last "
            "seen in step %lld doing '%s'; it is stopped, hung or dead; aborting the job with exit code 3",
            r, host_of(h, r), silent, h->timeout_s, (long long)p->step, p->what);
        abort_job(h, r, text);
    }
}

/* How long ago any rank of the job last made progress, as far as this rank knows (rank 0's summary,
 * aged by the time since it was made); `age` is this rank's own. */
static double job_age(dg_health_t *h, double now, double age) {
    if (h->size == 1) return age;
    if (h->rank == 0) {
        update_summary(h, now);
        return h->sum.best_age;
    }
    if (h->sum_at <= 0) return age; /* no summary yet */
    double b = h->sum.best_age + (now - h->sum_at);
    return b < age ? b : age;
}

static void check_self(dg_health_t *h, double now) {
    double age = own_age(h, now);
    double budget = 1e-6 * (double)atomic_load_explicit(&h->act_budget_us, memory_order_relaxed);
    if (age <= h->timeout_s || age <= budget) return;
    /* I/O activity (a checkpoint): waiting in one of its collectives for a rank that is still writing is
     * no stall; only a job in which no rank has moved forward for timeout_s is stuck */
    if (atomic_load_explicit(&h->act_io, memory_order_relaxed) && job_age(h, now, age) <= h->timeout_s)
        return;
    int64_t step;
    char what[WHAT_CAP];
    read_activity(h, &step, what);
    char text[ABORT_TEXT_CAP];
    const char *io_note = atomic_load_explicit(&h->act_io, memory_order_relaxed)
                              ? "; checkpoint I/O: no rank wrote, read or reached a collective meanwhile"
                              : "";

    /* A peer that has gone quiet is the likelier cause of our wait than we are. */
    int late = -1;
    double late_for = 0;
    for (int r = 0; r < h->size; r++) {
        if (r == h->rank || (h->rank != 0 && r != 0) || h->peers[r].bye) continue;
        double silent = now - h->peers[r].last_seen;
        if (silent > h->late_s && silent > late_for) {
            late = r;
            late_for = silent;
        }
    }
    if (late >= 0) {
        snprintf(
            text, sizeof text,
            "watchdog: no heartbeat from rank %d (host %s) for %.1f s, last seen in step %lld doing '%s'; "
            "rank %d waited %.1f s in step %lld doing '%s' (health.timeout_s=%g); aborting the job with "
            "exit code 3",
            late, host_of(h, late), late_for, (long long)h->peers[late].step, h->peers[late].what, h->rank,
            age, (long long)step, what, h->timeout_s);
        abort_job(h, late, text);
    }
    if (h->rank == 0 && h->size > 1) update_summary(h, now);
    const summary_t *S = &h->sum;
    double since = now - h->sum_at;
    if (h->rank != 0 && S->silent_rank > 0 && S->silent_rank != h->rank &&
        S->silent_for + since > h->late_s) {
        snprintf(
            text, sizeof text,
            "watchdog: rank 0 has had no heartbeat from rank %d (host %s) for %.1f s, last seen in step %lld "
            "doing '%s'; rank %d waited %.1f s in step %lld doing '%s' (health.timeout_s=%g); aborting the "
            "job with exit code 3",
            S->silent_rank, host_of(h, S->silent_rank), S->silent_for + since, (long long)S->silent_step,
            S->silent_what, h->rank, age, (long long)step, what, h->timeout_s);
        abort_job(h, S->silent_rank, text);
    }
    if (S->worst_rank >= 0 && S->worst_rank != h->rank && h->sum_at > 0) {
        double wage = S->worst_age + since;
        /* A rank that has been stuck longer in another step or activity is the one we wait for, however
         * small the difference (the waiters entered their collective only after it stopped, and every
         * rank's check may fire on the same poll tick). Among ranks stuck in the same place, blame
         * another only when it has clearly been stuck longer (beyond the summary's poll granularity). */
        double margin = (S->worst_step != step || strcmp(S->worst_what, what) != 0) ? 0.0 : h->poll_s;
        if (wage > age + margin || (h->self_waiting && !S->worst_waiting)) {
            snprintf(
                text, sizeof text,
                "watchdog: rank %d (host %s) has made no progress for %.1f s in step %lld doing '%s'; rank "
                "%d waited %.1f s for it in step %lld doing '%s' (health.timeout_s=%g%s); aborting the job "
                "with exit code 3",
                S->worst_rank, host_of(h, S->worst_rank), wage, (long long)S->worst_step, S->worst_what,
                h->rank, age, (long long)step, what, h->timeout_s, io_note);
            abort_job(h, S->worst_rank, text);
        }
    }
    snprintf(text, sizeof text,
             "watchdog: rank %d (host %s) has made no progress for %.1f s in step %lld doing '%s' "
             "(health.timeout_s=%g%s); aborting the job with exit code 3",
             h->rank, h->host, age, (long long)step, what, h->timeout_s, io_note);
    abort_job(h, h->rank, text);
}

static void run_polls(dg_health_t *h) {
    pthread_mutex_lock(&h->mu);
    int n = h->npoll;
    int (*fns[MAX_POLLS])(void *, char *, size_t);
    void *ctxs[MAX_POLLS];
    memcpy(fns, h->poll, sizeof fns);
    memcpy(ctxs, h->poll_ctx, sizeof ctxs);
    pthread_mutex_unlock(&h->mu);
    for (int i = 0; i < n; i++) {
        char msg[ABORT_TEXT_CAP - 128] = "";
        if (fns[i](ctxs[i], msg, sizeof msg) == 0) continue;
        char text[ABORT_TEXT_CAP];
        /* a long host name or reason is cut: the start of the line says what happened */
        int len = snprintf(text, sizeof text,
                           "health check failed on rank %d (host %s): %s; aborting the job with exit code 3",
                           h->rank, h->host, msg[0] ? msg : "(no reason given)");
        (void)len;
        abort_job(h, h->rank, text);
    }
}

static void *health_main(void *arg) {
    dg_health_t *h = arg;
    for (;;) {
        double now = dg_now_s();
        int flag = 0;
        MPI_Status st;
        int rc = MPI_Test(&h->areq, &flag, &st);
        if (rc != MPI_SUCCESS) mpi_failed(h, "MPI_Test(abort notice)", rc, -1);
        if (flag) notified(h, &h->abuf);

        bool stopping = atomic_load(&h->stopping) != 0;
        drain_heartbeats(h, now);
        if (!stopping) check_self(h, now);
        check_peers(h, now);
        run_polls(h);
        if (heartbeat_io(h, now, stopping)) break;
        sleep_s(h->poll_s);
    }
    return NULL;
}

/* ---------------------------------------------------------------- public API */

/* Cancel what is still posted and free everything (the thread is not running). */
static void release(dg_health_t *h) {
    if (h->rreq != MPI_REQUEST_NULL) {
        MPI_Cancel(&h->rreq);
        MPI_Wait(&h->rreq, MPI_STATUS_IGNORE);
    }
    if (h->areq != MPI_REQUEST_NULL) {
        MPI_Cancel(&h->areq);
        MPI_Wait(&h->areq, MPI_STATUS_IGNORE);
    }
    if (h->comm != MPI_COMM_NULL) MPI_Comm_free(&h->comm);
    pthread_mutex_destroy(&h->mu);
    free(h->bye_sent_to);
    free(h->sreq);
    free(h->sbuf);
    free(h->peers);
    free(h->hosts);
    free(h);
}

dg_status_t dg_health_create(MPI_Comm world, int rank, const char *host, double heartbeat_s, double timeout_s,
                             dg_health_t **out) {
    *out = NULL;
    if (!(heartbeat_s > 0) || !isfinite(heartbeat_s))
        return DG_ERR(DG_ERR_USAGE, "health.heartbeat_s must be a positive number of seconds (got %g)",
                      heartbeat_s);
    if (!(timeout_s >= 3 * heartbeat_s) || !isfinite(timeout_s))
        return DG_ERR(DG_ERR_USAGE,
                      "health.timeout_s (%g) must be at least 3 x health.heartbeat_s (%g), so that a late "
                      "heartbeat is not taken for a dead peer",
                      timeout_s, heartbeat_s);
    int level = 0;
    DG_MPI_CHECK(MPI_Query_thread(&level));
    if (level != MPI_THREAD_MULTIPLE)
        return DG_ERR(DG_ERR_RUNTIME,
                      "the health monitor needs MPI initialised with MPI_THREAD_MULTIPLE (got level %d); "
                      "hint: MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...)",
                      level);
    int wrank = -1, wsize = 0;
    DG_MPI_CHECK(MPI_Comm_rank(world, &wrank));
    DG_MPI_CHECK(MPI_Comm_size(world, &wsize));
    DG_ASSERTF(wrank == rank, "dg_health_create: rank %d given but MPI says %d", rank, wrank);

    dg_health_t *h = dg_xcalloc(1, sizeof *h);
    h->rank = rank;
    h->size = wsize;
    snprintf(h->host, sizeof h->host, "%s", host && *host ? host : "?");
    h->hb_s = heartbeat_s;
    h->timeout_s = timeout_s;
    h->poll_s = fmin(fmax(heartbeat_s / 4, 0.005), 0.1);
    h->late_s = fmin(2 * heartbeat_s + 0.25, 0.75 * timeout_s);
    atomic_flag_clear(&h->act_lock);
    pthread_mutex_init(&h->mu, NULL);
    h->sum.worst_rank = -1;
    h->sum.silent_rank = -1;
    h->stall_rank = -1;
    h->stall_step = -1;
    /* Until the loop says otherwise, whatever comes after creation (resume, data setup) is "startup". */
    dg_health_set_activity(h, 0, "startup");
    int64_t sr = dg_env_int("DG_TEST_STALL_RANK"), ss = dg_env_int("DG_TEST_STALL_STEP");
    if (sr >= 0 && ss >= 0) {
        h->stall_rank = (int)sr;
        h->stall_step = ss;
    }

    h->comm = MPI_COMM_NULL;
    h->rreq = MPI_REQUEST_NULL;
    h->areq = MPI_REQUEST_NULL;
    int rc = MPI_Comm_dup(world, &h->comm);
    if (rc != MPI_SUCCESS) {
        h->comm = MPI_COMM_NULL;
        release(h);
        DG_MPI_CHECK(rc);
    }
    MPI_Comm_set_errhandler(h->comm, MPI_ERRORS_RETURN);
    h->hosts = dg_xcalloc((size_t)wsize, sizeof *h->hosts);
    rc = MPI_Allgather(h->host, HOST_CAP, MPI_CHAR, h->hosts, HOST_CAP, MPI_CHAR, h->comm);
    if (rc != MPI_SUCCESS) {
        release(h);
        DG_MPI_CHECK(rc);
    }
    for (int r = 0; r < wsize; r++)
        h->hosts[r][HOST_CAP - 1] = 0;

    double now = dg_now_s();
    h->seen_at = now;
    h->last_sent = -1e30;
    h->peers = dg_xcalloc((size_t)wsize, sizeof *h->peers);
    for (int r = 0; r < wsize; r++)
        h->peers[r].last_seen = now;
    int nsend = rank == 0 ? wsize : 1;
    h->sbuf = dg_xcalloc((size_t)nsend, sizeof *h->sbuf);
    h->sreq = dg_xcalloc((size_t)nsend, sizeof *h->sreq);
    for (int i = 0; i < nsend; i++)
        h->sreq[i] = MPI_REQUEST_NULL;
    h->bye_sent_to = dg_xcalloc((size_t)wsize, sizeof *h->bye_sent_to);
    if (wsize > 1) post_recv(h);
    rc = MPI_Irecv(&h->abuf, (int)sizeof h->abuf, MPI_BYTE, MPI_ANY_SOURCE, TAG_ABORT, h->comm, &h->areq);
    if (rc != MPI_SUCCESS) {
        char es[MPI_MAX_ERROR_STRING];
        int n = 0;
        MPI_Error_string(rc, es, &n);
        h->areq = MPI_REQUEST_NULL;
        release(h);
        return DG_ERR(DG_ERR_RUNTIME, "health monitor: MPI_Irecv(abort notice) failed: %s", es);
    }

    /* Keep the signals for the loop's threads: the health thread never needs to be interrupted. */
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGUSR1);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGINT);
    pthread_sigmask(SIG_BLOCK, &block, &old);
    int e = pthread_create(&h->thr, NULL, health_main, h);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e != 0) {
        release(h);
        return DG_ERR(DG_ERR_RUNTIME, "cannot start the health thread: %s", strerror(e));
    }
    h->thr_started = 1;
    DG_LOG_DEBUG("health monitor started: heartbeat %.3g s, timeout %.3g s, %d ranks", heartbeat_s, timeout_s,
                 wsize);
    *out = h;
    return DG_OK;
}

void dg_health_free(dg_health_t *h) {
    if (!h) return;
    if (h->thr_started) {
        atomic_store(&h->stopping, 1);
        pthread_join(h->thr, NULL);
    }
    release(h);
}

void dg_health_set_activity(dg_health_t *h, int64_t step, const char *what) {
    if (!h) return;
    uint64_t words[WHAT_WORDS] = {0};
    if (what) {
        size_t n = strnlen(what, WHAT_CAP - 1);
        memcpy(words, what, n);
    }
    while (atomic_flag_test_and_set_explicit(&h->act_lock, memory_order_acquire)) {
    }
    uint32_t v = atomic_load_explicit(&h->act_ver, memory_order_relaxed);
    atomic_store_explicit(&h->act_ver, v + 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    for (int i = 0; i < WHAT_WORDS; i++)
        atomic_store_explicit(&h->act_words[i], words[i], memory_order_relaxed);
    atomic_store_explicit(&h->act_step, step, memory_order_relaxed);
    atomic_store_explicit(&h->act_budget_us, 0, memory_order_relaxed);
    atomic_store_explicit(&h->act_io, 0, memory_order_relaxed);
    atomic_store_explicit(&h->act_ver, v + 2, memory_order_release);
    atomic_fetch_add_explicit(&h->act_seq, 1, memory_order_release);
    atomic_flag_clear_explicit(&h->act_lock, memory_order_release);
    if (step == h->stall_step && h->rank == h->stall_rank) {
        DG_LOG_WARN("test hook DG_TEST_STALL_RANK=%d DG_TEST_STALL_STEP=%lld: rank %d hangs here forever",
                    h->stall_rank, (long long)h->stall_step, h->rank);
        for (;;)
            sleep_s(1.0);
    }
}

void dg_health_set_io_activity(dg_health_t *h, int64_t step, const char *what) {
    if (!h) return;
    dg_health_set_activity(h, step, what);
    atomic_store_explicit(&h->act_io, 1, memory_order_relaxed);
}

void dg_health_set_progress_source(dg_health_t *h, uint64_t (*fn)(void *ctx, int *waiting), void *ctx) {
    if (!h) return;
    pthread_mutex_lock(&h->mu);
    h->progress = fn;
    h->progress_ctx = ctx;
    int w = 0;
    h->seen_progress = fn ? fn(ctx, &w) : 0;
    pthread_mutex_unlock(&h->mu);
}

void dg_health_set_abort_hook(dg_health_t *h, void (*fn)(void *ctx), void *ctx) {
    if (!h) return;
    pthread_mutex_lock(&h->mu);
    h->on_abort = fn;
    h->abort_ctx = ctx;
    pthread_mutex_unlock(&h->mu);
}

void dg_health_expect(dg_health_t *h, double seconds) {
    if (!h || !(seconds > 0)) return;
    double us = fmin(seconds, 1e9) * 1e6;
    atomic_store_explicit(&h->act_budget_us, (int64_t)us, memory_order_relaxed);
}

void dg_health_set_event_sink(dg_health_t *h, void (*fn)(void *ctx, const char *json_fields), void *ctx) {
    if (!h) return;
    pthread_mutex_lock(&h->mu);
    h->sink = fn;
    h->sink_ctx = ctx;
    pthread_mutex_unlock(&h->mu);
}

dg_status_t dg_health_add_poll(dg_health_t *h, int (*poll)(void *ctx, char *msg, size_t cap), void *ctx) {
    DG_ASSERT(h && poll);
    pthread_mutex_lock(&h->mu);
    if (h->npoll == MAX_POLLS) {
        pthread_mutex_unlock(&h->mu);
        return DG_ERR(DG_ERR_RUNTIME, "health monitor: no room for another poll hook (max %d)", MAX_POLLS);
    }
    h->poll[h->npoll] = poll;
    h->poll_ctx[h->npoll] = ctx;
    h->npoll++;
    pthread_mutex_unlock(&h->mu);
    return DG_OK;
}

dg_status_t dg_health_agree_stop(dg_health_t *h, MPI_Comm comm, int *stop_out) {
    int local = dg_signals_pending(), global = 0;
    *stop_out = 0;
    DG_MPI_CHECK(MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MAX, comm));
    *stop_out = global;
    if (global && h) {
        int64_t step;
        char what[WHAT_CAP];
        read_activity(h, &step, what);
        char fields[256];
        snprintf(fields, sizeof fields,
                 "\"kind\":\"signal_stop\",\"signal\":\"%s\",\"step\":%lld,\"local\":%s",
                 dg_signal_name(global), (long long)step, local ? "true" : "false");
        emit(h, fields);
    }
    return DG_OK;
}
