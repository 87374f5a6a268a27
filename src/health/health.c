/* health.c — the per-rank watchdog thread: progress timer, tree heartbeats with an adaptive period,
 * round-trip measurement, abort notices.
 *
 * Topology: a binary tree over the ranks (parent (r-1)/2, children 2r+1 and 2r+2). Every period each rank
 * sends one heartbeat to each tree neighbour (at most 3): upwards it carries the summary of its subtree
 * (the rank that has made no progress for the longest, the rank whose heartbeat has been missing for the
 * longest and who noticed it, the smallest no-progress age), downwards the job-wide summary made by rank
 * 0 from its children's subtree summaries. So every rank learns which rank has been stuck the longest
 * (a rank that only waits in a collective blames the rank it waits for) with O(1) messages per rank per
 * period, and a silent rank is noticed by its tree neighbours. Each heartbeat echoes the send time of
 * the last one received from its destination, which gives each rank the round trip to each neighbour.
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
#define MAX_NB 3 /* tree neighbours: parent, two children */
#define RTT_MIN_SAMPLES 3

/* A view of (part of) the job: the rank that has made no progress for the longest, and the rank whose
 * heartbeat has been missing for the longest (-1: none) with the rank that noticed it. Upwards: of the
 * sender's subtree; downwards: of the whole job, as rank 0 made it. Ages are at send time. */
typedef struct {
    int32_t worst_rank, silent_rank, silent_reporter;
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
    double period;    /* the sender's probe period now (the receiver judges lateness by it) */
    double sent_at;   /* the sender's clock at send time */
    double echo_at;   /* sent_at of the last heartbeat the sender had from the destination (0: none) */
    double echo_hold; /* how long the sender held that one before this send */
    summary_t sum;    /* to a parent: the sender's subtree; to a child: the whole job */
} hb_msg_t;

typedef struct {
    int32_t culprit, from;
    char text[ABORT_TEXT_CAP];
} abort_msg_t;

/* What this rank knows about one tree neighbour. */
typedef struct {
    int rank;
    double last_seen;   /* local monotonic time of its last heartbeat (creation time before the first) */
    double age_at_recv; /* its activity age as reported in that heartbeat */
    int waiting;        /* ... and whether it waited in a collective of an I/O activity */
    int64_t step;
    char what[WHAT_CAP];
    double period;           /* its probe period as last reported */
    double their_sent_at;    /* sent_at of its last heartbeat (echoed back to it) */
    double last_echo;        /* the last echo_at of ours that it returned (one RTT sample per echo) */
    double rtt_ewma, rtt_hi; /* measured round trips: moving mean and a slowly decaying maximum */
    int rtt_n;
    int late_flagged; /* an anomaly was raised for its current silence */
    summary_t sum;    /* its last summary (subtree or job) */
    int bye;          /* it said bye (no more messages from it) */
    int bye_sent;     /* we said bye to it */
    hb_msg_t rbuf, sbuf;
    MPI_Request rreq, sreq;
} peer_t;

struct dg_health {
    MPI_Comm comm;
    int rank, size;
    char host[HOST_CAP];
    char (*hosts)[HOST_CAP];
    dg_health_opts_t o;
    double poll_s, late_s;
    double period; /* the probe period now: o.start_s, o.steady_s or o.alert_s */
    int good;      /* good probes in a row since the last anomaly */
    double last_alert_at;

    /* Activity, written by the loop: a seqlock over the label so the loop never blocks. */
    _Atomic uint64_t act_seq;
    _Atomic uint32_t act_ver;
    _Atomic int64_t act_step;
    _Atomic uint64_t act_words[WHAT_WORDS];
    _Atomic int64_t act_budget_us; /* dg_health_expect: longer stall allowed for this activity (0 = none) */
    atomic_int act_io;             /* dg_health_set_io_activity: progress-judged I/O (0 = no) */
    atomic_int act_wait;           /* dg_health_set_wait_activity: waiting in a collective (0 = no) */
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

    peer_t nb[MAX_NB]; /* [0] the parent when rank > 0, then the children */
    int nnb, parent;   /* parent: index of the parent in nb, -1 on rank 0 */
    double last_sent;

    /* The job-wide summary (rank 0: computed; elsewhere: as last received from the parent). */
    summary_t sum;
    double sum_at;

    abort_msg_t abuf;
    MPI_Request areq;

    pthread_t thr;
    int thr_started;
    atomic_int stopping;
    atomic_int aborting;
    _Atomic uint64_t st_probes, st_sent, st_recv, st_alerts, st_period_us, st_rtt_us, st_live_us;

    pthread_mutex_t mu; /* sinks and poll hooks */
    void (*sink)(void *, const char *);
    void *sink_ctx;
    void (*sla_sink)(void *, const char *);
    void *sla_ctx;
    int (*poll[MAX_POLLS])(void *, char *, size_t);
    void *poll_ctx[MAX_POLLS];
    int npoll;

    int stall_rank;
    int64_t stall_step;
    int probe_kill_rank; /* test hook DG_TEST_PROBE_KILL_RANK/_STEP: this rank's health thread dies */
    int64_t probe_kill_step;
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
    h->self_waiting = atomic_load_explicit(&h->act_wait, memory_order_relaxed) != 0;
    if (h->progress) {
        int w = 0;
        uint64_t p = h->progress(h->progress_ctx, &w);
        if (atomic_load_explicit(&h->act_io, memory_order_relaxed) && w) h->self_waiting = 1;
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

/* ---------------------------------------------------------------- adaptive period, anomalies */

static void set_period(dg_health_t *h, double p) {
    h->period = p;
    h->poll_s = fmin(fmax(p / 4, 0.002), 0.1);
    atomic_store_explicit(&h->st_period_us, (uint64_t)(p * 1e6), memory_order_relaxed);
}

/* How long a neighbour may stay silent before it is taken for stopped, hung or dead: multiplier x (its
 * period + the highest recent round trip), never below the floor, never above timeout_s. */
static double liveness_s(const dg_health_t *h, const peer_t *p) {
    double per = fmax(p->period, h->period);
    double t = h->o.liveness_mult * (per + p->rtt_hi);
    return fmin(fmax(t, h->o.liveness_floor_s), h->o.timeout_s);
}

/* An anomaly (a late heartbeat, a round trip far above the measured ones): probe fast (alert period),
 * count it, and tell the SLA sink (objective heartbeat_rtt, Level 1) and the event sink, at most once
 * per second per rank. */
static void anomaly(dg_health_t *h, double now, int peer, const char *what, double value_s, double target_s) {
    h->good = 0;
    if (h->period != h->o.alert_s) set_period(h, h->o.alert_s);
    atomic_fetch_add_explicit(&h->st_alerts, 1, memory_order_relaxed);
    if (now - h->last_alert_at < 1.0) return;
    h->last_alert_at = now;
    int64_t step;
    char label[WHAT_CAP];
    read_activity(h, &step, label);
    DG_LOG_WARN("heartbeat: %s from rank %d (host %s): %.1f ms (threshold %.1f ms); probing every %.0f ms",
                what, peer, host_of(h, peer), 1e3 * value_s, 1e3 * target_s, 1e3 * h->period);
    char fields[384];
    snprintf(fields, sizeof fields,
             "\"objective\":\"heartbeat_rtt\",\"level\":1,\"value\":%.3f,\"target\":%.3f,\"action\":\"warn\","
             "\"step\":%lld,\"rank\":%d,\"peer_rank\":%d,\"reason\":\"%s\"",
             1e3 * value_s, 1e3 * target_s, (long long)step, h->rank, peer, what);
    pthread_mutex_lock(&h->mu);
    void (*fn)(void *, const char *) = h->sla_sink;
    void *ctx = h->sla_ctx;
    pthread_mutex_unlock(&h->mu);
    if (fn) fn(ctx, fields);
    snprintf(fields, sizeof fields,
             "\"kind\":\"heartbeat_alert\",\"rank\":%d,\"peer_rank\":%d,\"reason\":\"%s\",\"value_ms\":%.3f,"
             "\"target_ms\":%.3f,\"period_ms\":%.1f",
             h->rank, peer, what, 1e3 * value_s, 1e3 * target_s, 1e3 * h->period);
    emit(h, fields);
}

/* A good probe (a round trip within bounds): after o.good_probes in a row, the steady period. */
static void good_probe(dg_health_t *h) {
    if (++h->good >= h->o.good_probes && h->period != h->o.steady_s) {
        set_period(h, h->o.steady_s);
        DG_LOG_DEBUG("heartbeat: %d good probes, period now %.0f ms", h->good, 1e3 * h->period);
    }
}

static void rtt_sample(dg_health_t *h, peer_t *p, double rtt, double now) {
    if (rtt < 0) rtt = 0;
    /* both ends poll: up to one poll interval of each side is part of any sample */
    double lim = fmax(h->o.rtt_alert_factor * p->rtt_ewma, h->o.rtt_alert_min_s) + 2 * h->poll_s +
                 fmin(fmax(p->period, 0) / 2, 0.2);
    bool bad = p->rtt_n >= RTT_MIN_SAMPLES && rtt > lim;
    p->rtt_ewma = p->rtt_n == 0 ? rtt : 0.8 * p->rtt_ewma + 0.2 * rtt;
    p->rtt_hi = fmax(rtt, 0.95 * p->rtt_hi);
    p->rtt_n++;
    atomic_store_explicit(&h->st_rtt_us, (uint64_t)(p->rtt_ewma * 1e6), memory_order_relaxed);
    if (bad)
        anomaly(h, now, p->rank, "round trip far above the measured ones", rtt, lim);
    else
        good_probe(h);
}

/* A neighbour is late when silent for 4 of its periods plus the anomaly floor (but not yet dead). */
static void check_late(dg_health_t *h, peer_t *p, double now) {
    if (p->bye) return;
    double silent = now - p->last_seen;
    double lim = 4 * fmax(p->period, h->period) + h->o.rtt_alert_min_s;
    if (silent <= lim) {
        p->late_flagged = 0;
        return;
    }
    if (p->late_flagged) return;
    p->late_flagged = 1;
    anomaly(h, now, p->rank, "late heartbeat", silent, lim);
}

/* ---------------------------------------------------------------- heartbeats */

static void age_summary(summary_t *S, double dt) {
    S->worst_age += dt;
    S->best_age += dt;
    if (S->silent_rank >= 0) S->silent_for += dt;
}

/* The summary this rank sends to its parent (its subtree) or, on rank 0, the job's: itself, then each
 * child's subtree summary aged by the time since it came, then each child's own silence. */
static void subtree_summary(dg_health_t *h, double now, summary_t *S) {
    memset(S, 0, sizeof *S);
    S->worst_rank = h->rank;
    S->worst_age = own_age(h, now);
    S->best_age = S->worst_age;
    S->worst_waiting = h->self_waiting;
    read_activity(h, &S->worst_step, S->worst_what);
    S->silent_rank = -1;
    S->silent_reporter = -1;
    for (int i = h->parent + 1; i < h->nnb; i++) {
        peer_t *p = &h->nb[i];
        if (p->bye) continue;
        double silent = now - p->last_seen;
        summary_t c = p->sum;
        if (c.worst_rank < 0) { /* nothing heard yet: the child itself, as of creation */
            c.worst_rank = p->rank;
            c.worst_age = c.best_age = 0;
            c.silent_rank = -1;
            snprintf(c.worst_what, WHAT_CAP, "%s", "startup");
        }
        age_summary(&c, silent);
        if (c.best_age < S->best_age) S->best_age = c.best_age;
        /* a rank that is not waiting in a collective is the likelier culprit than one that is, whatever
         * their ages (the waiter may have arrived before the other stopped, e.g. when the other was
         * descheduled on a loaded node) */
        int better = c.worst_waiting == S->worst_waiting ? c.worst_age > S->worst_age : S->worst_waiting;
        if (better) {
            S->worst_age = c.worst_age;
            S->worst_waiting = c.worst_waiting;
            S->worst_rank = c.worst_rank;
            S->worst_step = c.worst_step;
            copy_label(S->worst_what, c.worst_what);
        }
        if (c.silent_rank >= 0 && c.silent_for > S->silent_for) {
            S->silent_for = c.silent_for;
            S->silent_rank = c.silent_rank;
            S->silent_reporter = c.silent_reporter;
            S->silent_step = c.silent_step;
            copy_label(S->silent_what, c.silent_what);
        }
        if (silent > S->silent_for) {
            S->silent_for = silent;
            S->silent_rank = p->rank;
            S->silent_reporter = h->rank;
            S->silent_step = p->step;
            copy_label(S->silent_what, p->what);
        }
    }
}

/* Rank 0: the job summary is its subtree summary. */
static void update_summary(dg_health_t *h, double now) {
    subtree_summary(h, now, &h->sum);
    h->sum_at = now;
}

static void post_recv(dg_health_t *h, peer_t *p) {
    int rc = MPI_Irecv(&p->rbuf, (int)sizeof p->rbuf, MPI_BYTE, p->rank, TAG_HB, h->comm, &p->rreq);
    if (rc != MPI_SUCCESS) mpi_failed(h, "MPI_Irecv(heartbeat)", rc, p->rank);
}

static void take(dg_health_t *h, peer_t *p, bool is_parent, double now) {
    const hb_msg_t *m = &p->rbuf;
    atomic_fetch_add_explicit(&h->st_recv, 1, memory_order_relaxed);
    p->last_seen = now;
    p->age_at_recv = m->age;
    p->waiting = m->waiting;
    p->step = m->step;
    copy_label(p->what, m->what);
    if (m->period > 0) p->period = m->period;
    p->their_sent_at = m->sent_at;
    p->sum = m->sum;
    p->sum.worst_what[WHAT_CAP - 1] = 0;
    p->sum.silent_what[WHAT_CAP - 1] = 0;
    if (is_parent) {
        h->sum = p->sum;
        h->sum_at = now;
    }
    if (m->echo_at > 0 && m->echo_at != p->last_echo) {
        p->last_echo = m->echo_at;
        rtt_sample(h, p, now - m->echo_at - m->echo_hold, now);
    }
    if (m->kind == MSG_BYE) p->bye = 1;
}

static void drain_heartbeats(dg_health_t *h, double now) {
    for (int i = 0; i < h->nnb; i++) {
        peer_t *p = &h->nb[i];
        while (p->rreq != MPI_REQUEST_NULL) {
            int flag = 0;
            int rc = MPI_Test(&p->rreq, &flag, MPI_STATUS_IGNORE);
            if (rc != MPI_SUCCESS) mpi_failed(h, "MPI_Test(heartbeat)", rc, p->rank);
            if (!flag) break;
            p->rreq = MPI_REQUEST_NULL;
            take(h, p, i == h->parent, now);
            if (!p->bye) post_recv(h, p);
        }
    }
}

static bool send_done(dg_health_t *h, peer_t *p) {
    if (p->sreq == MPI_REQUEST_NULL) return true;
    int flag = 0;
    int rc = MPI_Test(&p->sreq, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) mpi_failed(h, "MPI_Test(heartbeat send)", rc, p->rank);
    return flag != 0;
}

static void send_one(dg_health_t *h, peer_t *p, bool to_parent, int kind, double now) {
    hb_msg_t *m = &p->sbuf;
    memset(m, 0, sizeof *m);
    m->kind = kind;
    m->rank = h->rank;
    read_activity(h, &m->step, m->what);
    m->age = own_age(h, now);
    m->waiting = h->self_waiting;
    m->period = h->period;
    m->sent_at = now;
    if (p->their_sent_at > 0) {
        m->echo_at = p->their_sent_at;
        m->echo_hold = now - p->last_seen;
    }
    if (to_parent) {
        subtree_summary(h, now, &m->sum);
    } else {
        if (h->rank == 0) update_summary(h, now);
        m->sum = h->sum;
        if (h->rank != 0 && h->sum_at > 0) age_summary(&m->sum, now - h->sum_at);
    }
    int rc = MPI_Isend(m, (int)sizeof *m, MPI_BYTE, p->rank, TAG_HB, h->comm, &p->sreq);
    if (rc != MPI_SUCCESS) mpi_failed(h, "MPI_Isend(heartbeat)", rc, p->rank);
    atomic_fetch_add_explicit(&h->st_sent, 1, memory_order_relaxed);
    if (kind == MSG_BYE) p->bye_sent = 1;
}

/* Send heartbeats when due, and the byes once stopping: a rank says bye to its parent once it is
 * stopping and all its children said bye; rank 0 then says bye to its children, and every rank passes
 * its parent's bye on to its children. Returns true when this rank has nothing left to send or receive
 * (only possible after dg_health_free asked it to stop). A send still pending means that neighbour is
 * not draining (stopped?): it is skipped this round rather than piled on. */
static bool heartbeat_io(dg_health_t *h, double now, bool stopping) {
    if (h->size == 1) return stopping;
    bool due = now - h->last_sent >= h->period;
    bool kids_done = true;
    for (int i = h->parent + 1; i < h->nnb; i++)
        if (!h->nb[i].bye) kids_done = false;
    bool up_done = h->parent < 0 || h->nb[h->parent].bye; /* rank 0, or the parent said bye */
    bool all_out = true;
    for (int i = 0; i < h->nnb; i++) {
        peer_t *p = &h->nb[i];
        bool is_parent = i == h->parent;
        if (p->bye_sent) {
            if (!send_done(h, p)) all_out = false;
            continue;
        }
        all_out = false;
        bool say_bye = stopping && kids_done && (is_parent || up_done);
        if (!send_done(h, p)) continue;
        if (say_bye)
            send_one(h, p, is_parent, MSG_BYE, now);
        else if (due && !(is_parent && p->bye))
            send_one(h, p, is_parent, MSG_HB, now);
    }
    if (due) {
        h->last_sent = now;
        atomic_fetch_add_explicit(&h->st_probes, 1, memory_order_relaxed);
    }
    return stopping && kids_done && up_done && all_out;
}

/* ---------------------------------------------------------------- watchdog checks */

static void check_peers(dg_health_t *h, double now) {
    double live_max = 0;
    for (int i = 0; i < h->nnb; i++) {
        peer_t *p = &h->nb[i];
        if (p->bye) continue;
        double live = liveness_s(h, p);
        if (live > live_max) live_max = live;
        check_late(h, p, now);
        double silent = now - p->last_seen;
        if (silent <= live) continue;
        char text[ABORT_TEXT_CAP];
        snprintf(text, sizeof text,
                 "watchdog: no heartbeat from rank %d (host %s) for %.1f s (liveness timeout %.2f s = "
                 "max(health.liveness_floor_s=%g, health.liveness_mult=%g x (period + round trip))); it was "
                 "last seen in step %lld doing '%s'; it (or its health thread) is stopped, hung or dead; "
                 "aborting the job with exit "
                 "code 3",
                 p->rank, host_of(h, p->rank), silent, live, h->o.liveness_floor_s, h->o.liveness_mult,
                 (long long)p->step, p->what);
        abort_job(h, p->rank, text);
    }
    atomic_store_explicit(&h->st_live_us, (uint64_t)(live_max * 1e6), memory_order_relaxed);
}

/* How long ago any rank of the job last made progress, as far as this rank knows (the job summary,
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
    if (age <= h->o.timeout_s || age <= budget) return;
    /* I/O activity (a checkpoint): waiting in one of its collectives for a rank that is still writing is
     * no stall; only a job in which no rank has moved forward for timeout_s is stuck */
    if (atomic_load_explicit(&h->act_io, memory_order_relaxed) && job_age(h, now, age) <= h->o.timeout_s)
        return;
    int64_t step;
    char what[WHAT_CAP];
    read_activity(h, &step, what);
    char text[ABORT_TEXT_CAP];
    const char *io_note = atomic_load_explicit(&h->act_io, memory_order_relaxed)
                              ? "; checkpoint I/O: no rank wrote, read or reached a collective meanwhile"
                              : "";

    /* A neighbour that has gone quiet is the likelier cause of our wait than we are. */
    int late = -1;
    double late_for = 0;
    for (int i = 0; i < h->nnb; i++) {
        const peer_t *p = &h->nb[i];
        if (p->bye) continue;
        double silent = now - p->last_seen;
        if (silent > h->late_s && silent > late_for) {
            late = i;
            late_for = silent;
        }
    }
    if (late >= 0) {
        const peer_t *p = &h->nb[late];
        snprintf(
            text, sizeof text,
            "watchdog: no heartbeat from rank %d (host %s) for %.1f s, last seen in step %lld doing '%s'; "
            "rank %d waited %.1f s in step %lld doing '%s' (health.timeout_s=%g); aborting the job with "
            "exit code 3",
            p->rank, host_of(h, p->rank), late_for, (long long)p->step, p->what, h->rank, age,
            (long long)step, what, h->o.timeout_s);
        abort_job(h, p->rank, text);
    }
    if (h->rank == 0 && h->size > 1) update_summary(h, now);
    const summary_t *S = &h->sum;
    double since = now - h->sum_at;
    if (S->silent_rank >= 0 && S->silent_rank != h->rank && S->silent_reporter != h->rank &&
        S->silent_for + since > h->late_s) {
        snprintf(
            text, sizeof text,
            "watchdog: rank %d has had no heartbeat from rank %d (host %s) for %.1f s, last seen in step "
            "%lld "
            "doing '%s'; rank %d waited %.1f s in step %lld doing '%s' (health.timeout_s=%g); aborting the "
            "job with exit code 3",
            S->silent_reporter, S->silent_rank, host_of(h, S->silent_rank), S->silent_for + since,
            (long long)S->silent_step, S->silent_what, h->rank, age, (long long)step, what, h->o.timeout_s);
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
                h->rank, age, (long long)step, what, h->o.timeout_s, io_note);
            abort_job(h, S->worst_rank, text);
        }
    }
    snprintf(text, sizeof text,
             "watchdog: rank %d (host %s) has made no progress for %.1f s in step %lld doing '%s' "
             "(health.timeout_s=%g%s); aborting the job with exit code 3",
             h->rank, h->host, age, (long long)step, what, h->o.timeout_s, io_note);
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

/* Test hook DG_TEST_PROBE_KILL_RANK/_STEP: 1 when this rank's health thread is to die now, as a probe
 * thread that crashed or wedged would: no bye, no more heartbeats, the training thread runs on. */
static bool probe_killed(dg_health_t *h) {
    if (h->probe_kill_rank != h->rank) return false;
    int64_t step;
    char what[WHAT_CAP];
    read_activity(h, &step, what);
    if (step < h->probe_kill_step) return false;
    DG_LOG_WARN("test hook DG_TEST_PROBE_KILL_RANK=%d: rank %d's health thread exits at step %lld without a "
                "word to its neighbours",
                h->probe_kill_rank, h->rank, (long long)step);
    return true;
}

static void *health_main(void *arg) {
    dg_health_t *h = arg;
    for (;;) {
        double now = dg_now_s();
        if (probe_killed(h)) return NULL;
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
    for (int i = 0; i < h->nnb; i++) {
        peer_t *p = &h->nb[i];
        if (p->rreq != MPI_REQUEST_NULL) {
            MPI_Cancel(&p->rreq);
            MPI_Wait(&p->rreq, MPI_STATUS_IGNORE);
        }
        if (p->sreq != MPI_REQUEST_NULL) {
            MPI_Cancel(&p->sreq);
            MPI_Wait(&p->sreq, MPI_STATUS_IGNORE);
        }
    }
    if (h->areq != MPI_REQUEST_NULL) {
        MPI_Cancel(&h->areq);
        MPI_Wait(&h->areq, MPI_STATUS_IGNORE);
    }
    if (h->comm != MPI_COMM_NULL) MPI_Comm_free(&h->comm);
    pthread_mutex_destroy(&h->mu);
    free(h->hosts);
    free(h);
}

void dg_health_opts_default(dg_health_opts_t *o) {
    *o = (dg_health_opts_t){.start_s = 0.05,
                            .steady_s = 0.2,
                            .alert_s = 0.01,
                            .good_probes = 3,
                            .rtt_alert_factor = 8,
                            .rtt_alert_min_s = 0.25,
                            .liveness_floor_s = 5,
                            .liveness_mult = 10,
                            .timeout_s = 120};
}

static dg_status_t check_opts(const dg_health_opts_t *o) {
    const struct {
        const char *key;
        double v;
    } pos[] = {
        {"health.probe_start_ms", o->start_s * 1e3},      {"health.probe_steady_ms", o->steady_s * 1e3},
        {"health.probe_alert_ms", o->alert_s * 1e3},      {"health.rtt_alert_factor", o->rtt_alert_factor},
        {"health.liveness_floor_s", o->liveness_floor_s}, {"health.liveness_mult", o->liveness_mult}};
    for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
        if (!(pos[i].v > 0) || !isfinite(pos[i].v))
            return DG_ERR(DG_ERR_USAGE, "%s must be a positive number (got %g)", pos[i].key, pos[i].v);
    if (!(o->rtt_alert_min_s >= 0) || !isfinite(o->rtt_alert_min_s))
        return DG_ERR(DG_ERR_USAGE, "health.rtt_alert_min_ms must be >= 0 (got %g)",
                      o->rtt_alert_min_s * 1e3);
    if (o->good_probes < 1)
        return DG_ERR(DG_ERR_USAGE, "health.probe_good must be at least 1 (got %d)", o->good_probes);
    double pmax = fmax(o->steady_s, fmax(o->start_s, o->alert_s));
    if (!(o->timeout_s >= 3 * pmax) || !isfinite(o->timeout_s))
        return DG_ERR(DG_ERR_USAGE,
                      "health.timeout_s (%g) must be at least 3 x the longest probe period (%g s), so that a "
                      "late heartbeat is not taken for a dead peer",
                      o->timeout_s, pmax);
    return DG_OK;
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
    dg_health_opts_t o;
    dg_health_opts_default(&o);
    o.steady_s = heartbeat_s;
    o.start_s = fmin(o.start_s, heartbeat_s);
    o.alert_s = fmin(o.alert_s, heartbeat_s);
    o.timeout_s = timeout_s;
    o.liveness_floor_s = fmin(o.liveness_floor_s, 0.75 * timeout_s);
    return dg_health_create_opts(world, rank, host, &o, out);
}

dg_status_t dg_health_create_opts(MPI_Comm world, int rank, const char *host, const dg_health_opts_t *opts,
                                  dg_health_t **out) {
    *out = NULL;
    DG_TRY(check_opts(opts));
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
    h->o = *opts;
    set_period(h, opts->start_s);
    h->late_s = fmin(2 * opts->steady_s + 0.25, 0.75 * opts->timeout_s);
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
    int64_t kr = dg_env_int("DG_TEST_PROBE_KILL_RANK"), ks = dg_env_int("DG_TEST_PROBE_KILL_STEP");
    h->probe_kill_rank = kr >= 0 && ks >= 0 ? (int)kr : -1;
    h->probe_kill_step = ks;

    h->comm = MPI_COMM_NULL;
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
    h->parent = -1;
    int nbr[MAX_NB], k = 0;
    if (rank > 0) {
        h->parent = 0;
        nbr[k++] = (rank - 1) / 2;
    }
    for (int c = 2 * rank + 1; c <= 2 * rank + 2 && c < wsize; c++)
        nbr[k++] = c;
    h->nnb = k;
    for (int i = 0; i < k; i++) {
        peer_t *p = &h->nb[i];
        p->rank = nbr[i];
        p->last_seen = now;
        p->period = opts->start_s;
        p->sum.worst_rank = -1;
        p->sum.silent_rank = -1;
        p->rreq = MPI_REQUEST_NULL;
        p->sreq = MPI_REQUEST_NULL;
    }
    for (int i = 0; i < k; i++)
        post_recv(h, &h->nb[i]);
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
    DG_LOG_DEBUG(
        "health monitor started: probes every %.0f/%.0f/%.0f ms (start/steady/alert), timeout %.3g s, "
        "%d ranks, %d tree neighbours",
        1e3 * opts->start_s, 1e3 * opts->steady_s, 1e3 * opts->alert_s, opts->timeout_s, wsize, k);
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

static void set_activity(dg_health_t *h, int64_t step, const char *what, int io, int wait) {
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
    atomic_store_explicit(&h->act_io, io, memory_order_relaxed);
    atomic_store_explicit(&h->act_wait, wait, memory_order_relaxed);
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

void dg_health_set_activity(dg_health_t *h, int64_t step, const char *what) {
    set_activity(h, step, what, 0, 0);
}

void dg_health_set_io_activity(dg_health_t *h, int64_t step, const char *what) {
    set_activity(h, step, what, 1, 0);
}

void dg_health_set_wait_activity(dg_health_t *h, int64_t step, const char *what) {
    set_activity(h, step, what, 0, 1);
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

typedef void (*sink_fn_t)(void *ctx, const char *json_fields);

static void set_sink(dg_health_t *h, sink_fn_t *slot, void **slot_ctx, sink_fn_t fn, void *ctx) {
    pthread_mutex_lock(&h->mu);
    *slot = fn;
    *slot_ctx = ctx;
    pthread_mutex_unlock(&h->mu);
}

void dg_health_set_event_sink(dg_health_t *h, sink_fn_t fn, void *ctx) {
    if (h) set_sink(h, &h->sink, &h->sink_ctx, fn, ctx);
}

void dg_health_set_sla_sink(dg_health_t *h, sink_fn_t fn, void *ctx) {
    if (h) set_sink(h, &h->sla_sink, &h->sla_ctx, fn, ctx);
}

void dg_health_get_stats(const dg_health_t *h, dg_health_stats_t *st) {
    memset(st, 0, sizeof *st);
    if (!h) return;
    dg_health_t *m = (dg_health_t *)h;
    st->probes = atomic_load(&m->st_probes);
    st->msgs_sent = atomic_load(&m->st_sent);
    st->msgs_recv = atomic_load(&m->st_recv);
    st->alerts = atomic_load(&m->st_alerts);
    st->period_s = 1e-6 * (double)atomic_load(&m->st_period_us);
    st->rtt_s = 1e-6 * (double)atomic_load(&m->st_rtt_us);
    st->liveness_s = 1e-6 * (double)atomic_load(&m->st_live_us);
    st->neighbours = h->nnb;
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
