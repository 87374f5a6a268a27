/* comm_mpi.c — the mpi comm backend: collectives on host memory through Open MPI.
 *
 * Three execution modes, chosen at creation:
 *   thread       a communication thread per comm pops operations from a FIFO and runs MPI's blocking
 *                collectives on a private duplicate of the group (so it picks exactly the algorithms a
 *                raw MPI call of the same size would, and results are the same bits) — except the
 *                reduce-scatter, which is dg_comm's own ring (below) unless opts.rs_mpi. Point-to-point
 *                operations are started (MPI_Isend/Irecv) in FIFO order and then progressed by the same
 *                thread, so an exchange of sends and receives cannot deadlock. Completion is an atomic
 *                flag plus a condition variable; both sides poll briefly (spin_us) before sleeping, which
 *                keeps back-to-back operations cheap. A blocking collective posted while nothing is
 *                outstanding runs inline on the caller's thread (opts.inline_blocking): no hand-off at
 *                all, which is what small latency-bound collectives need; the comm thread then only
 *                watches its deadline (see comm.h, Timeouts).
 *   nonblocking  MPI_I* calls issued by the caller; they advance only inside dg_comm calls (for when
 *                MPI_THREAD_MULTIPLE is not available).
 *   local        a one-rank group: operations are copies done at post time; no thread, no MPI traffic.
 * Reductions: MPI_SUM for f32/f64/i32; bf16 uses a commutative user op that adds in f32 and rounds to
 * bf16 at each combining step. AVG divides by the group size after the sum, on the thread that ran it.
 *
 * Ring reduce-scatter (thread mode): Open MPI 4.1's reduce_scatter_block (every tuned algorithm) moves
 * far more than the (n-1)/n of the buffer a ring needs and allocates its temporaries per call; on one
 * node it ran at a quarter to a ninth of the all-gather's bandwidth for the same bytes. The ring: in
 * exchange s = 0..n-2, rank r sends block (r-s-1) mod n to rank r+1 and receives block (r-s-2) mod n from
 * rank r-1, adding its own contribution to what arrives; after the last exchange it holds block r summed
 * over all ranks. Exchanges go in segments (ring_seg_bytes) with MPI_Sendrecv on a second private
 * duplicate of the group (so user point-to-point tags can never match them), into scratch buffers the
 * comm keeps between calls. The order of the additions for a block is fixed by the ring, so results
 * repeat bit for bit from run to run and agree with a single-rank sum of small integers exactly. On more
 * than 2 ranks, messages under 256 KiB in all still go to MPI_Reduce_scatter_block (latency-bound).
 */
#define _GNU_SOURCE
#include "comm_impl.h"

#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "dg_env.h"

enum { MODE_LOCAL = 0, MODE_THREAD = 1, MODE_NB = 2 };
static const char *k_mode_names[] = {"local", "thread", "nonblocking"};

typedef struct {
    dg_comm_t base;
    int mode;
    MPI_Comm data; /* the collectives' communicator: the comm thread's alone in thread mode */
    MPI_Op op_bf16;
    int op_bf16_made;
    MPI_Comm ring;          /* the ring reduce-scatter's exchanges (thread mode, !opts.rs_mpi) */
    void *ring_part[2];     /* partial sums of one block, alternating between exchanges (n > 2) */
    void *ring_seg;         /* one received segment */
    size_t ring_part_bytes; /* capacity of each ring_part */
    size_t ring_seg_bytes;  /* segment size: the unit of one MPI_Sendrecv */
    /* thread mode; mu guards the queue, cur, counters and the flags below */
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    pthread_t th;
    int th_started;
    int sync_made;
    dg_comm_op_t *qhead, *qtail; /* posted, not started */
    dg_comm_op_t *cur;           /* the collective being executed */
    dg_comm_op_t *p2p;           /* started point-to-point ops: the comm thread's list */
    _Atomic int outstanding;     /* posted and not yet complete (changed under mu, read lock-free) */
    /* a blocking collective running on the caller's thread, published lock-free for the watchdog */
    _Atomic int64_t inline_seq; /* its collective number, 0 when none */
    _Atomic int inl_kind, inl_dt, inl_peer;
    _Atomic int64_t inl_count, inl_step, inl_start_ns;
    int inline_fired;
    int waiters, worker_sleeping, stop;
    _Atomic uint64_t qgen;
    double watch_period_s;
    double p2p_latency_s; /* test hook DG_TEST_P2P_LATENCY_US: a send leaves this long after its post */
    /* nonblocking mode: posted ops in order (the caller's list) */
    dg_comm_op_t *nb_head, *nb_tail;
} cm_t;

static const dg_comm_vtbl_t k_vt_mpi;

/* ---------------------------------------------------------------------------------------------- */

static MPI_Datatype mpi_type(dg_dtype_t dt) {
    switch (dt) {
    case DG_F32:
        return MPI_FLOAT;
    case DG_F64:
        return MPI_DOUBLE;
    case DG_I32:
        return MPI_INT32_T;
    case DG_BF16:
    case DG_F16:
    case DG_U16:
        return MPI_UINT16_T;
    }
    DG_ASSERTF(0, "dtype %d", (int)dt);
    return MPI_DATATYPE_NULL;
}

static MPI_Op mpi_op(cm_t *m, dg_dtype_t dt) {
    return dt == DG_BF16 ? m->op_bf16 : MPI_SUM;
}

/* Work after the data has arrived: move an in-place reduce-scatter result to this rank's block, and
 * divide for AVG. */
static void finish_host(cm_t *m, dg_comm_op_t *op) {
    size_t esz = dg_dtype_size(op->dt);
    if (op->kind == DG_OP_REDUCE_SCATTER && op->inplace && m->base.rank != 0 && op->count)
        memmove(op->recv, op->send, op->count * esz); /* MPI_IN_PLACE leaves it in block 0 */
    if (dg_comm__is_reduction(op->kind) && op->red == DG_RED_AVG)
        dg_comm__host_divide(op->recv, op->count, op->dt, m->base.size);
}

static void set_msg(dg_comm_op_t *op, dg_status_t s) {
    if (s != DG_OK) dg_comm__strlcpy(op->msg, sizeof op->msg, dg_last_error());
}

/* dst[i] = a[i] + b[i] for the reducible dtypes (bf16 summed in f32 and rounded, as bf16_sum_fn). */
static void ring_add(void *dst, const void *a, const void *b, size_t n, dg_dtype_t dt) {
#define RING_ADD(T, sum)                                                                                     \
    do {                                                                                                     \
        T *d = dst;                                                                                          \
        const T *x = a, *y = b;                                                                              \
        for (size_t i = 0; i < n; i++)                                                                       \
            d[i] = (sum);                                                                                    \
    } while (0)
    switch (dt) {
    case DG_F32:
        RING_ADD(float, x[i] + y[i]);
        break;
    case DG_F64:
        RING_ADD(double, x[i] + y[i]);
        break;
    case DG_I32:
        RING_ADD(int32_t, (int32_t)((uint32_t)x[i] + (uint32_t)y[i])); /* wraps like MPI_SUM, no UB */
        break;
    case DG_BF16:
        RING_ADD(uint16_t, dg_comm__f32_to_bf16(dg_comm__bf16_to_f32(x[i]) + dg_comm__bf16_to_f32(y[i])));
        break;
    default:
        DG_ASSERTF(0, "ring reduce-scatter of dtype %d", (int)dt);
    }
#undef RING_ADD
}

/* The user MPI_Op for bf16 sums (MPI_Reduce_scatter_block / MPI_Allreduce): the same add as the ring. */
static void bf16_sum_fn(void *in, void *inout, int *len, MPI_Datatype *dt) {
    (void)dt;
    ring_add(inout, in, inout, (size_t)*len, DG_BF16);
}

/* The ring reduce-scatter (see the header comment). Runs on the comm thread or inline on the caller's
 * thread, never both at once (inline runs only while nothing is outstanding), so the scratch buffers
 * need no lock. */
static dg_status_t ring_reduce_scatter(cm_t *m, dg_comm_op_t *op) {
    int n = m->base.size, r = m->base.rank;
    size_t esz = dg_dtype_size(op->dt), count = op->count, blk = count * esz;
    if (!count) return DG_OK;
    const char *own = op->send;
    char *out = op->recv; /* in place: own + r * blk, whose contribution is read only in the last step */
    int next = (r + 1) % n, prev = (r + n - 1) % n;
    MPI_Datatype T = mpi_type(op->dt);
    size_t seg = m->ring_seg_bytes / esz;
    if (seg > count) seg = count;
    if (seg > (size_t)INT32_MAX / 2) seg = (size_t)INT32_MAX / 2;
    if (n > 2 && m->ring_part_bytes < blk) {
        free(m->ring_part[0]);
        free(m->ring_part[1]);
        m->ring_part[0] = dg_xmalloc(blk);
        m->ring_part[1] = dg_xmalloc(blk);
        m->ring_part_bytes = blk;
    }
    if (!m->ring_seg) m->ring_seg = dg_xmalloc(m->ring_seg_bytes);
    char *tmp = m->ring_seg;
    for (int s = 0; s < n - 1; s++) {
        int sb = ((r - s - 1) % n + n) % n, rb = ((r - s - 2) % n + n) % n;
        int last = s == n - 2;
        const char *send_block = s == 0 ? own + (size_t)sb * blk : (const char *)m->ring_part[(s - 1) & 1];
        char *dst_block = last ? out : (char *)m->ring_part[s & 1];
        const char *mine = own + (size_t)rb * blk;
        for (size_t o = 0; o < count; o += seg) {
            size_t len = count - o < seg ? count - o : seg;
            DG_MPI_CHECK(MPI_Sendrecv(send_block + o * esz, (int)len, T, next, s, tmp, (int)len, T, prev, s,
                                      m->ring, MPI_STATUS_IGNORE));
            ring_add(dst_block + o * esz, tmp, mine + o * esz, len, op->dt);
        }
    }
    return DG_OK;
}

/* The ring's n-1 sequential exchanges cost latency that MPI's algorithms avoid for small messages on
 * more than 2 ranks (bench/comm: 0.77x at 4-64 KB on 4 ranks); there MPI's reduce_scatter_block runs. */
#define RING_MIN_BYTES_NGT2 (256u << 10)
static int use_ring(const cm_t *m, const dg_comm_op_t *op) {
    if (m->ring == MPI_COMM_NULL) return 0;
    size_t total = op->count * dg_dtype_size(op->dt) * (size_t)m->base.size;
    return m->base.size == 2 || total >= RING_MIN_BYTES_NGT2;
}

/* Thread mode: the blocking MPI call for one collective. */
static dg_status_t exec_collective(cm_t *m, dg_comm_op_t *op) {
    MPI_Datatype T = mpi_type(op->dt);
    int n = (int)op->count;
    switch (op->kind) {
    case DG_OP_ALLGATHER:
        DG_MPI_CHECK(MPI_Allgather(op->inplace ? MPI_IN_PLACE : op->send, n, T, op->recv, n, T, m->data));
        break;
    case DG_OP_REDUCE_SCATTER:
        if (use_ring(m, op)) {
            DG_TRY(ring_reduce_scatter(m, op));
            if (op->red == DG_RED_AVG) dg_comm__host_divide(op->recv, op->count, op->dt, m->base.size);
            return DG_OK; /* the result is already in recv: no finish_host move */
        }
        if (op->inplace)
            DG_MPI_CHECK(
                MPI_Reduce_scatter_block(MPI_IN_PLACE, (void *)op->send, n, T, mpi_op(m, op->dt), m->data));
        else
            DG_MPI_CHECK(MPI_Reduce_scatter_block(op->send, op->recv, n, T, mpi_op(m, op->dt), m->data));
        break;
    case DG_OP_ALLREDUCE:
        DG_MPI_CHECK(
            MPI_Allreduce(op->inplace ? MPI_IN_PLACE : op->send, op->recv, n, T, mpi_op(m, op->dt), m->data));
        break;
    case DG_OP_BROADCAST:
        DG_MPI_CHECK(MPI_Bcast(op->recv, n, T, op->peer, m->data));
        break;
    case DG_OP_BARRIER:
        DG_MPI_CHECK(MPI_Barrier(m->data));
        break;
    default:
        DG_ASSERTF(0, "%s is not a collective", dg_comm__op_name(op->kind));
    }
    finish_host(m, op);
    return DG_OK;
}

/* Non-blocking start (nonblocking mode for everything; thread mode for point-to-point). */
static dg_status_t start_nb(cm_t *m, dg_comm_op_t *op) {
    MPI_Datatype T = mpi_type(op->dt);
    int n = (int)op->count;
    switch (op->kind) {
    case DG_OP_ALLGATHER:
        DG_MPI_CHECK(
            MPI_Iallgather(op->inplace ? MPI_IN_PLACE : op->send, n, T, op->recv, n, T, m->data, &op->mreq));
        break;
    case DG_OP_REDUCE_SCATTER:
        if (op->inplace)
            DG_MPI_CHECK(MPI_Ireduce_scatter_block(MPI_IN_PLACE, (void *)op->send, n, T, mpi_op(m, op->dt),
                                                   m->data, &op->mreq));
        else
            DG_MPI_CHECK(
                MPI_Ireduce_scatter_block(op->send, op->recv, n, T, mpi_op(m, op->dt), m->data, &op->mreq));
        break;
    case DG_OP_ALLREDUCE:
        DG_MPI_CHECK(MPI_Iallreduce(op->inplace ? MPI_IN_PLACE : op->send, op->recv, n, T, mpi_op(m, op->dt),
                                    m->data, &op->mreq));
        break;
    case DG_OP_BROADCAST:
        DG_MPI_CHECK(MPI_Ibcast(op->recv, n, T, op->peer, m->data, &op->mreq));
        break;
    case DG_OP_BARRIER:
        DG_MPI_CHECK(MPI_Ibarrier(m->data, &op->mreq));
        break;
    case DG_OP_SEND:
        DG_MPI_CHECK(MPI_Isend(op->send, n, T, op->peer, op->tag, m->data, &op->mreq));
        break;
    case DG_OP_RECV:
        DG_MPI_CHECK(MPI_Irecv(op->recv, n, T, op->peer, op->tag, m->data, &op->mreq));
        break;
    default:
        DG_ASSERT(0);
    }
    return DG_OK;
}

/* Local mode: one rank, so every collective is a copy (or nothing). */
static void exec_local(dg_comm_op_t *op) {
    size_t bytes = op->count * dg_dtype_size(op->dt);
    switch (op->kind) {
    case DG_OP_ALLGATHER:
    case DG_OP_REDUCE_SCATTER:
    case DG_OP_ALLREDUCE:
        if (!op->inplace && bytes) memcpy(op->recv, op->send, bytes);
        break; /* AVG over one rank divides by 1 */
    default:
        break;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* thread mode                                                                                      */

static void progress_mark_start(cm_t *m, dg_comm_op_t *op) {
    atomic_store(&m->base.cur_start_ns, dg_comm__now_ns());
    atomic_store(&m->base.cur_kind, (int)op->kind);
    atomic_store(&m->base.coll_started, op->seq);
}

static void progress_mark_done(cm_t *m, dg_comm_op_t *op) {
    atomic_store(&m->base.cur_kind, -1);
    atomic_store(&m->base.coll_done, op->seq);
}

/* Caller holds mu. Publishes the result; an abandoned op has no owner left, so it is freed here. */
static void complete_locked(cm_t *m, dg_comm_op_t *op, dg_status_t s) {
    op->status = s;
    atomic_fetch_sub_explicit(&m->outstanding, 1, memory_order_release);
    if (op->abandoned)
        free(op);
    else
        atomic_store_explicit(&op->state, DG_OPST_DONE, memory_order_release);
    if (m->waiters) pthread_cond_broadcast(&m->cv_done);
}

/* After an MPI error the group's collectives can no longer be matched: fail everything after it. */
static void fail_from_worker(cm_t *m, const char *msg) {
    dg_comm__fail(&m->base, DG_ERR_PEER, msg);
}

/* Tests the started point-to-point ops; returns how many completed. Called without mu; only the comm
 * thread changes the list. */
static int progress_p2p(cm_t *m) {
    int ncomplete = 0;
    dg_comm_op_t **pp = &m->p2p;
    while (*pp) {
        dg_comm_op_t *op = *pp;
        int flag = 0;
        int rc = MPI_Test(&op->mreq, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS || flag) {
            dg_status_t s = DG_OK;
            if (rc != MPI_SUCCESS) {
                char es[MPI_MAX_ERROR_STRING];
                int len = 0;
                MPI_Error_string(rc, es, &len);
                char d[256];
                dg_comm__describe(&m->base, op, d, sizeof d);
                snprintf(op->msg, sizeof op->msg, "%s failed: %s", d, es);
                s = DG_ERR_PEER;
            }
            /* waiters read the list under mu (stuck_op_locked): unlink under it too */
            pthread_mutex_lock(&m->mu);
            *pp = op->next;
            complete_locked(m, op, s);
            pthread_mutex_unlock(&m->mu);
            ncomplete++;
        } else {
            pp = &op->next;
        }
    }
    return ncomplete;
}

/* condition variables use CLOCK_MONOTONIC, so a wall-clock step cannot stretch a timed wait */
static void abs_deadline(double rel_s, struct timespec *ts) {
    clock_gettime(CLOCK_MONOTONIC, ts);
    double w = (double)ts->tv_sec + ts->tv_nsec * 1e-9 + (rel_s > 0 ? rel_s : 0);
    ts->tv_sec = (time_t)w;
    ts->tv_nsec = (long)((w - (double)ts->tv_sec) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

/* The caller's thread is inside MPI and cannot be handed an error: report as a wait would, then end
 * the job with the exit code the caller would have chosen. */
static void inline_timed_out(cm_t *m, const dg_comm_op_t *op, double el) {
    dg_comm__timeout(&m->base, op, NULL, el);
    DG_LOG_ERROR("%s (a blocking call cannot be interrupted inside MPI: ending the job with exit %d)",
                 dg_last_error(), DG_ERR_PEER);
    dg_comm_abort(&m->base, DG_ERR_PEER);
}

/* Test hook DG_TEST_P2P_LATENCY_US (a slow link between ranks, e.g. to measure what the pipeline's
 * overlap of messages and compute saves on one node): the comm thread starts a send only at its post time
 * plus the latency, so its data reaches the receiver that much later; the sends of one comm leave in
 * posting order, and what is queued behind one waits with it (one link per comm). */
static void link_latency(double until) {
    double d = until - dg_now_s();
    if (d <= 0) return;
    struct timespec ts = {(time_t)d, (long)((d - (double)(time_t)d) * 1e9)};
    nanosleep(&ts, NULL);
}

static void *worker_main(void *arg) {
    cm_t *m = arg;
    double backoff = 0;
    pthread_mutex_lock(&m->mu);
    for (;;) {
        if (m->p2p) {
            pthread_mutex_unlock(&m->mu);
            if (progress_p2p(m)) backoff = 0;
            pthread_mutex_lock(&m->mu);
        }
        if (m->qhead) {
            dg_comm_op_t *op = m->qhead;
            m->qhead = op->next;
            if (!m->qhead) m->qtail = NULL;
            atomic_fetch_sub(&m->base.queued, 1);
            op->next = NULL;
            op->t_start = dg_now_s();
            if (atomic_load(&m->base.failed)) {
                snprintf(op->msg, sizeof op->msg, "%s: not run after an earlier failure: %.400s",
                         m->base.name, m->base.fail_msg);
                complete_locked(m, op, DG_ERR_PEER);
                continue;
            }
            atomic_store(&op->state, DG_OPST_STARTED);
            if (!dg_comm__is_collective(op->kind)) {
                pthread_mutex_unlock(&m->mu);
                if (op->kind == DG_OP_SEND && m->p2p_latency_s > 0)
                    link_latency(op->t_post + m->p2p_latency_s);
                dg_status_t s = start_nb(m, op);
                pthread_mutex_lock(&m->mu);
                if (s != DG_OK) {
                    set_msg(op, s);
                    complete_locked(m, op, DG_ERR_PEER);
                } else {
                    op->next = m->p2p;
                    m->p2p = op;
                }
                backoff = 0;
                continue;
            }
            m->cur = op;
            progress_mark_start(m, op);
            pthread_mutex_unlock(&m->mu);
            dg_status_t s = exec_collective(m, op);
            if (s != DG_OK) {
                set_msg(op, s);
                fail_from_worker(m, op->msg);
                s = DG_ERR_PEER;
            }
            pthread_mutex_lock(&m->mu);
            m->cur = NULL;
            progress_mark_done(m, op);
            complete_locked(m, op, s);
            backoff = 0;
            continue;
        }
        if (m->p2p) {
            /* in-flight transfers with nothing queued: poll with a growing pause, but wake for posts */
            backoff = backoff == 0 ? 2e-6 : (backoff * 2 > 2e-4 ? 2e-4 : backoff * 2);
            struct timespec ts;
            abs_deadline(backoff, &ts);
            m->worker_sleeping = 1;
            pthread_cond_timedwait(&m->cv_work, &m->mu, &ts);
            m->worker_sleeping = 0;
            continue;
        }
        if (m->stop) break;
        /* idle: poll for a moment (the next op of a back-to-back sequence arrives within microseconds),
         * then sleep until a post signals */
        uint64_t gen = atomic_load(&m->qgen);
        if (m->base.spin_s > 0) {
            pthread_mutex_unlock(&m->mu);
            double t0 = dg_now_s();
            while (atomic_load(&m->qgen) == gen && dg_now_s() - t0 < m->base.spin_s)
                sched_yield();
            pthread_mutex_lock(&m->mu);
        }
        if (!m->qhead && !m->stop && !m->p2p) {
            /* sleep, waking now and then to watch the deadline of an inline blocking collective */
            struct timespec ts;
            abs_deadline(m->watch_period_s, &ts);
            m->worker_sleeping = 1;
            pthread_cond_timedwait(&m->cv_work, &m->mu, &ts);
            m->worker_sleeping = 0;
            int64_t seq = atomic_load_explicit(&m->inline_seq, memory_order_acquire);
            if (seq && !m->inline_fired) {
                double el =
                    (dg_comm__now_ns() - atomic_load_explicit(&m->inl_start_ns, memory_order_relaxed)) * 1e-9;
                dg_comm_op_t copy = {
                    .kind = (dg_op_kind_t)atomic_load_explicit(&m->inl_kind, memory_order_relaxed),
                    .count = (size_t)atomic_load_explicit(&m->inl_count, memory_order_relaxed),
                    .dt = (dg_dtype_t)atomic_load_explicit(&m->inl_dt, memory_order_relaxed),
                    .peer = atomic_load_explicit(&m->inl_peer, memory_order_relaxed),
                    .step = atomic_load_explicit(&m->inl_step, memory_order_relaxed),
                    .seq = seq};
                /* the description is consistent only if the same call is still running */
                if (el >= m->base.opts.timeout_s &&
                    atomic_load_explicit(&m->inline_seq, memory_order_acquire) == seq) {
                    m->inline_fired = 1;
                    pthread_mutex_unlock(&m->mu);
                    inline_timed_out(m, &copy, el); /* does not return */
                }
            }
        }
    }
    pthread_mutex_unlock(&m->mu);
    return NULL;
}

/* Which op a waiter is really blocked on, and since when it counts (caller holds mu). */
static dg_comm_op_t *stuck_op_locked(cm_t *m, dg_comm_op_t *op, double t_wait, double *ref) {
    if (op && atomic_load(&op->state) == DG_OPST_STARTED) {
        *ref = op->t_start > t_wait ? op->t_start : t_wait;
        return op;
    }
    if (m->cur) {
        *ref = m->cur->t_start > t_wait ? m->cur->t_start : t_wait;
        return m->cur;
    }
    if (!op && m->p2p) {
        *ref = m->p2p->t_start > t_wait ? m->p2p->t_start : t_wait;
        return m->p2p;
    }
    *ref = t_wait;
    return op ? op : m->qhead;
}

static dg_status_t thread_wait(cm_t *m, dg_comm_op_t *op) {
    double t_wait = dg_now_s();
    if (atomic_load_explicit(&op->state, memory_order_acquire) != DG_OPST_DONE && m->base.spin_s > 0) {
        while (atomic_load_explicit(&op->state, memory_order_acquire) != DG_OPST_DONE &&
               dg_now_s() - t_wait < m->base.spin_s)
            sched_yield();
    }
    if (atomic_load_explicit(&op->state, memory_order_acquire) == DG_OPST_DONE)
        return dg_comm__op_release(op);
    pthread_mutex_lock(&m->mu);
    m->waiters++;
    while (atomic_load_explicit(&op->state, memory_order_acquire) != DG_OPST_DONE) {
        if (atomic_load(&m->base.failed)) {
            op->abandoned = 1; /* the comm thread frees it if it ever gets there */
            m->waiters--;
            pthread_mutex_unlock(&m->mu);
            return dg_comm__failed_error(&m->base);
        }
        double ref, now = dg_now_s();
        dg_comm_op_t *stuck = stuck_op_locked(m, op, t_wait, &ref);
        if (now - ref >= m->base.opts.timeout_s) {
            dg_comm_op_t s_copy = *stuck, w_copy = *op;
            op->abandoned = 1;
            m->waiters--;
            pthread_mutex_unlock(&m->mu);
            return dg_comm__timeout(&m->base, &s_copy, &w_copy, now - ref);
        }
        struct timespec ts;
        abs_deadline(ref + m->base.opts.timeout_s - now, &ts);
        pthread_cond_timedwait(&m->cv_done, &m->mu, &ts);
    }
    m->waiters--;
    pthread_mutex_unlock(&m->mu);
    return dg_comm__op_release(op);
}

static dg_status_t thread_flush(cm_t *m) {
    double t_wait = dg_now_s();
    pthread_mutex_lock(&m->mu);
    m->waiters++;
    while (atomic_load(&m->outstanding) > 0) {
        if (atomic_load(&m->base.failed)) {
            m->waiters--;
            pthread_mutex_unlock(&m->mu);
            return dg_comm__failed_error(&m->base);
        }
        double ref, now = dg_now_s();
        dg_comm_op_t *stuck = stuck_op_locked(m, NULL, t_wait, &ref);
        if (stuck && now - ref >= m->base.opts.timeout_s) {
            dg_comm_op_t s_copy = *stuck;
            m->waiters--;
            pthread_mutex_unlock(&m->mu);
            return dg_comm__timeout(&m->base, &s_copy, NULL, now - ref);
        }
        struct timespec ts;
        abs_deadline(stuck ? ref + m->base.opts.timeout_s - now : 0.01, &ts);
        pthread_cond_timedwait(&m->cv_done, &m->mu, &ts);
    }
    m->waiters--;
    pthread_mutex_unlock(&m->mu);
    return DG_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* nonblocking mode                                                                                 */

static void nb_unlink(cm_t *m, dg_comm_op_t *op) {
    dg_comm__list_unlink(&m->nb_head, &m->nb_tail, op);
}

/* One MPI_Test; on completion finishes the op (still owned by the caller's request). */
static dg_status_t nb_test_one(cm_t *m, dg_comm_op_t *op, int *done) {
    *done = atomic_load(&op->state) == DG_OPST_DONE;
    if (*done) return DG_OK;
    int flag = 0;
    int rc = MPI_Test(&op->mreq, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
        char es[MPI_MAX_ERROR_STRING], d[256];
        int len = 0;
        MPI_Error_string(rc, es, &len);
        dg_comm__describe(&m->base, op, d, sizeof d);
        snprintf(op->msg, sizeof op->msg, "%s failed: %s", d, es);
        op->status = DG_ERR_PEER;
        dg_comm__fail(&m->base, DG_ERR_PEER, op->msg);
        flag = 1;
    }
    if (flag) {
        if (op->status == DG_OK) finish_host(m, op);
        if (op->seq > atomic_load(&m->base.coll_done)) atomic_store(&m->base.coll_done, op->seq);
        nb_unlink(m, op);
        atomic_store(&op->state, DG_OPST_DONE);
        *done = 1;
    }
    return DG_OK;
}

static dg_status_t nb_wait_done(cm_t *m, dg_comm_op_t *op, dg_comm_op_t *waited) {
    double t0 = dg_now_s();
    for (;;) {
        int done = 0;
        nb_test_one(m, op, &done);
        if (done) return DG_OK;
        double el = dg_now_s() - t0;
        if (el >= m->base.opts.timeout_s) {
            dg_comm_op_t s_copy = *op;
            return dg_comm__timeout(&m->base, &s_copy, waited, el);
        }
        if (el > m->base.spin_s) sched_yield();
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* vtable                                                                                           */

static dg_status_t mpi_post(dg_comm_t *c, dg_comm_op_t *op) {
    cm_t *m = (cm_t *)c;
    if (m->mode == MODE_LOCAL) {
        atomic_store(&c->coll_started, op->seq);
        exec_local(op);
        atomic_store(&c->coll_done, op->seq);
        atomic_store(&op->state, DG_OPST_DONE);
        return DG_OK;
    }
    if (m->mode == MODE_NB) {
        DG_TRY(start_nb(m, op));
        atomic_store(&op->state, DG_OPST_STARTED);
        op->t_start = op->t_post;
        if (op->seq) atomic_store(&c->coll_started, op->seq);
        dg_comm__list_append(&m->nb_head, &m->nb_tail, op);
        return DG_OK;
    }
    pthread_mutex_lock(&m->mu);
    op->next = NULL;
    if (m->qtail)
        m->qtail->next = op;
    else
        m->qhead = op;
    m->qtail = op;
    atomic_fetch_add(&m->outstanding, 1);
    atomic_fetch_add(&c->queued, 1);
    atomic_fetch_add(&m->qgen, 1);
    if (m->worker_sleeping) pthread_cond_signal(&m->cv_work);
    pthread_mutex_unlock(&m->mu);
    return DG_OK;
}

/* A blocking collective with nothing ahead of it runs here, on the caller's thread: the same MPI call
 * the comm thread would make (so the same bits), without allocation, locks or a thread hand-off. The
 * comm thread only watches its deadline. Only the owner thread posts, so once `outstanding` reads 0
 * nothing else can start on the data communicator until this call returns. */
static dg_status_t mpi_run_inline(dg_comm_t *c, dg_comm_op_t *op, int *ran) {
    cm_t *m = (cm_t *)c;
    if (m->mode == MODE_LOCAL) {
        exec_local(op);
        atomic_store_explicit(&c->coll_started, op->seq, memory_order_relaxed);
        atomic_store_explicit(&c->coll_done, op->seq, memory_order_relaxed);
        *ran = 1;
        return DG_OK;
    }
    if (m->mode != MODE_THREAD || !c->opts.inline_blocking ||
        atomic_load_explicit(&m->outstanding, memory_order_acquire) != 0)
        return DG_OK;
    *ran = 1;
    int64_t now = dg_comm__now_ns();
    atomic_store_explicit(&m->inl_kind, (int)op->kind, memory_order_relaxed);
    atomic_store_explicit(&m->inl_dt, (int)op->dt, memory_order_relaxed);
    atomic_store_explicit(&m->inl_peer, op->peer, memory_order_relaxed);
    atomic_store_explicit(&m->inl_count, (int64_t)op->count, memory_order_relaxed);
    atomic_store_explicit(&m->inl_step, op->step, memory_order_relaxed);
    atomic_store_explicit(&m->inl_start_ns, now, memory_order_relaxed);
    atomic_store_explicit(&m->inline_seq, op->seq, memory_order_release);
    atomic_store_explicit(&c->cur_start_ns, now, memory_order_relaxed);
    atomic_store_explicit(&c->cur_kind, (int)op->kind, memory_order_relaxed);
    atomic_store_explicit(&c->coll_started, op->seq, memory_order_release);
    dg_status_t s = exec_collective(m, op);
    atomic_store_explicit(&c->cur_kind, -1, memory_order_relaxed);
    atomic_store_explicit(&c->coll_done, op->seq, memory_order_relaxed);
    atomic_store_explicit(&m->inline_seq, 0, memory_order_release);
    if (s != DG_OK) {
        char msg[1024];
        dg_comm__strlcpy(msg, sizeof msg, dg_last_error());
        return dg_comm__fail(c, DG_ERR_PEER, msg);
    }
    return DG_OK;
}

static dg_status_t mpi_wait(dg_comm_t *c, dg_comm_op_t *op) {
    cm_t *m = (cm_t *)c;
    if (m->mode == MODE_THREAD) return thread_wait(m, op);
    if (m->mode == MODE_NB) {
        dg_status_t s = nb_wait_done(m, op, op);
        if (s != DG_OK) {
            /* MPI still owns the buffers of a timed-out request: keep the record alive (leaked) */
            return s;
        }
    }
    return dg_comm__op_release(op);
}

static dg_status_t mpi_test(dg_comm_t *c, dg_comm_op_t *op, int *done) {
    cm_t *m = (cm_t *)c;
    if (m->mode == MODE_NB)
        nb_test_one(m, op, done);
    else
        *done = atomic_load_explicit(&op->state, memory_order_acquire) == DG_OPST_DONE;
    if (*done) return dg_comm__op_release(op);
    return DG_OK;
}

static dg_status_t mpi_flush(dg_comm_t *c) {
    cm_t *m = (cm_t *)c;
    if (m->mode == MODE_THREAD) return thread_flush(m);
    if (m->mode == MODE_NB) {
        while (m->nb_head)
            DG_TRY(nb_wait_done(m, m->nb_head, NULL));
    }
    return DG_OK;
}

static dg_status_t mpi_split(dg_comm_t *parent, int color, int key, const dg_comm_opts_t *o,
                             dg_comm_t **out) {
    MPI_Comm nc = MPI_COMM_NULL;
    DG_MPI_CHECK(MPI_Comm_split(parent->ctl, color < 0 ? MPI_UNDEFINED : color, key, &nc));
    if (nc == MPI_COMM_NULL) return DG_OK;
    dg_status_t s = dg_comm__mpi_create(nc, o, out);
    MPI_Comm_free(&nc);
    return s;
}

static dg_status_t mpi_begin_after(dg_comm_t *c, void *stream) {
    (void)c;
    (void)stream;
    return DG_OK;
}

static dg_status_t mpi_stream_wait(dg_comm_t *c, dg_comm_op_t *op, void *stream) {
    (void)stream;
    return mpi_wait(c, op);
}

static void mpi_state(dg_comm_t *c, char *buf, size_t cap) {
    cm_t *m = (cm_t *)c;
    int kind = atomic_load(&c->cur_kind);
    int queued = atomic_load(&c->queued);
    if (m->mode == MODE_THREAD && kind >= 0 && kind < DG_OP_NKINDS)
        snprintf(buf, cap, "%s (mpi/thread): %s #%lld running for %.1f s, %d queued", c->name,
                 dg_comm__op_name((dg_op_kind_t)kind), (long long)atomic_load(&c->coll_started),
                 (dg_comm__now_ns() - atomic_load(&c->cur_start_ns)) / 1e9, queued);
    else if (m->mode == MODE_THREAD)
        snprintf(buf, cap, "%s (mpi/thread): idle after collective #%lld, %d queued", c->name,
                 (long long)atomic_load(&c->coll_done), queued);
    else
        snprintf(buf, cap, "%s (mpi/%s): collectives posted up to #%lld, complete up to #%lld", c->name,
                 k_mode_names[m->mode], (long long)atomic_load(&c->coll_started),
                 (long long)atomic_load(&c->coll_done));
}

static void mpi_destroy(dg_comm_t *c) {
    cm_t *m = (cm_t *)c;
    if (m->mode == MODE_THREAD && m->th_started) {
        if (!atomic_load(&c->failed)) {
            dg_status_t s = thread_flush(m);
            if (s != DG_OK) DG_LOG_WARN("freeing comm %s: %s", c->name, dg_last_error());
        }
        pthread_mutex_lock(&m->mu);
        int idle = !m->cur && !m->p2p && !m->qhead;
        if (idle || !atomic_load(&c->failed)) {
            m->stop = 1;
            pthread_cond_signal(&m->cv_work);
        }
        pthread_mutex_unlock(&m->mu);
        if (!idle && atomic_load(&c->failed)) {
            /* the comm thread may never come back from MPI: leave everything it can touch alive */
            DG_LOG_WARN("comm %s freed after a failure with its thread still inside MPI: resources leaked",
                        c->name);
            pthread_detach(m->th);
            dg_comm__base_destroy_leak(c);
            return;
        }
        pthread_join(m->th, NULL);
    }
    if (m->mode == MODE_NB && m->nb_head) {
        if (!atomic_load(&c->failed)) mpi_flush(c);
        if (m->nb_head) {
            DG_LOG_WARN("comm %s freed with MPI requests in flight: resources leaked", c->name);
            dg_comm__base_destroy_leak(c);
            return;
        }
    }
    if (m->op_bf16_made) MPI_Op_free(&m->op_bf16);
    if (m->ring != MPI_COMM_NULL) MPI_Comm_free(&m->ring);
    free(m->ring_part[0]);
    free(m->ring_part[1]);
    free(m->ring_seg);
    if (m->data != MPI_COMM_NULL) MPI_Comm_free(&m->data);
    if (m->sync_made) {
        pthread_mutex_destroy(&m->mu);
        pthread_cond_destroy(&m->cv_work);
        pthread_cond_destroy(&m->cv_done);
    }
    dg_comm__base_destroy(c);
    free(m);
}

static const dg_comm_vtbl_t k_vt_mpi = {
    .name = "mpi",
    .post = mpi_post,
    .wait = mpi_wait,
    .run_inline = mpi_run_inline,
    .test = mpi_test,
    .flush = mpi_flush,
    .split = mpi_split,
    .begin_after = mpi_begin_after,
    .stream_wait = mpi_stream_wait,
    .state = mpi_state,
    .abort_backend = NULL,
    .destroy = mpi_destroy,
};

static dg_status_t mpi_create_inner(cm_t *m, MPI_Comm group, const dg_comm_opts_t *o) {
    DG_TRY(dg_comm__base_init(&m->base, DG_COMM_MPI, group, o));
    dg_comm_t *c = &m->base;
    if (c->size == 1)
        m->mode = MODE_LOCAL;
    else if (o->progress == DG_COMM_PROGRESS_NONBLOCKING)
        m->mode = MODE_NB;
    else if (o->progress == DG_COMM_PROGRESS_THREAD && !c->thread_multiple)
        return DG_ERR(DG_ERR_RUNTIME,
                      "comm %s: the communication thread needs MPI_THREAD_MULTIPLE, which MPI did not grant; "
                      "initialise MPI with MPI_Init_thread(MPI_THREAD_MULTIPLE) or use progress=NONBLOCKING",
                      c->name);
    else
        m->mode = c->thread_multiple ? MODE_THREAD : MODE_NB;
    if (m->mode != MODE_LOCAL) {
        DG_MPI_CHECK(MPI_Comm_dup(group, &m->data));
        DG_MPI_CHECK(MPI_Comm_set_errhandler(m->data, MPI_ERRORS_RETURN));
        DG_MPI_CHECK(MPI_Op_create(bf16_sum_fn, 1, &m->op_bf16));
        m->op_bf16_made = 1;
    }
    if (m->mode == MODE_THREAD && !o->rs_mpi) {
        DG_MPI_CHECK(MPI_Comm_dup(group, &m->ring));
        DG_MPI_CHECK(MPI_Comm_set_errhandler(m->ring, MPI_ERRORS_RETURN));
        m->ring_seg_bytes = (size_t)512 << 10;
        int64_t kb = dg_env_int("DG_COMM_RING_SEG_KB"); /* tuning knob for benchmarks */
        if (kb > 0 && kb <= (1 << 20)) m->ring_seg_bytes = (size_t)kb << 10;
    }
    if (m->mode == MODE_THREAD) {
        m->watch_period_s = o->timeout_s / 4 < 1.0 ? o->timeout_s / 4 : 1.0;
        pthread_mutex_init(&m->mu, NULL);
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&m->cv_work, &ca);
        pthread_cond_init(&m->cv_done, &ca);
        pthread_condattr_destroy(&ca);
        m->sync_made = 1;
        int rc = pthread_create(&m->th, NULL, worker_main, m);
        if (rc != 0)
            return DG_ERR(DG_ERR_RUNTIME, "comm %s: cannot start the communication thread: %s", c->name,
                          strerror(rc));
        m->th_started = 1;
    }
    return DG_OK;
}

dg_status_t dg_comm__mpi_create(MPI_Comm group, const dg_comm_opts_t *o, dg_comm_t **out) {
    cm_t *m = dg_xcalloc(1, sizeof *m);
    m->base.vt = &k_vt_mpi;
    m->data = MPI_COMM_NULL;
    m->ring = MPI_COMM_NULL;
    m->base.ctl = m->base.probe = MPI_COMM_NULL;
    m->p2p_latency_s = dg_env_double("DG_TEST_P2P_LATENCY_US") * 1e-6;
    dg_status_t s = mpi_create_inner(m, group, o);
    if (s != DG_OK) {
        char msg[1024];
        dg_comm__strlcpy(msg, sizeof msg, dg_last_error());
        mpi_destroy(&m->base);
        return DG_ERR(s, "%s", msg);
    }
    DG_LOG_DEBUG("comm %s: mpi backend, %d ranks, %s mode, timeout %.1f s", m->base.name, m->base.size,
                 k_mode_names[m->mode], m->base.opts.timeout_s);
    *out = &m->base;
    return DG_OK;
}
