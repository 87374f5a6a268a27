/* comm_nccl.c — the nccl comm backend: collectives on device memory, enqueued on a CUDA stream.
 *
 * A communicator is created from a unique id that group rank 0 makes and broadcasts over MPI. Mesh
 * dimensions come from ncclCommSplit of the world comm (an MPI_Comm_split with the same color/key gives
 * each child the MPI group its side channels use). Communicators are blocking (blocking = 1): with the
 * non-blocking configuration NCCL hands every enqueue to a thread of its own, about 60 us per call on
 * an H200 host (bench_comm --backend nccl: a 1 MiB all-reduce took 78 us against NCCL alone's 15 us),
 * which the schedule's host pays for every collective that is not replayed from a CUDA Graph. What
 * the non-blocking mode bought — a missing peer cannot hang creation — comes instead from running the
 * creating calls (ncclCommInitRankConfig, ncclCommSplit, ncclCommFinalize) on a helper thread that
 * the caller waits for against the comm's timeout (timed_call). A peer that dies later is seen by the
 * event polling below, by ncclCommGetAsyncError, or by the health watchdog, whose ncclCommAbort (any
 * thread) also unblocks a call stuck in NCCL.
 *
 * Every operation records a CUDA event on the comm stream after it; that event is the schedule's wait
 * edge: dg_comm_wait polls it (with ncclCommGetAsyncError, and the timeout), dg_comm_stream_wait hands
 * it to a compute stream (cudaStreamWaitEvent, no host block), dg_comm_begin_after makes the comm
 * stream wait for a compute stream. On any failure the comm is marked failed; ncclCommAbort runs in
 * dg_comm_abort and in dg_comm_free of a failed comm (a plain destroy would wait for stuck kernels).
 *
 * Point-to-point: NCCL runs a stream's work in order, so a receive enqueued on its own waits for the
 * matching send, and two ranks that each post irecv then isend would each have their send stuck behind
 * a receive that waits for the other's send (deadlock). So a posted send or receive is not enqueued: it
 * joins the pending point-to-point batch (the tail of the op list, from `pend` on), and the whole batch
 * is enqueued inside one ncclGroupStart/ncclGroupEnd — where NCCL may run its sends and receives
 * concurrently — before anything that needs it: posting a collective, wait / test / flush /
 * stream_wait / begin_after, split (through flush) and free. The group is settled (ncclCommGetAsyncError,
 * against the timeout; immediate on a blocking comm) before one event per op is recorded on the stream,
 * all at the same point after the group. A failure while
 * enqueuing a batch fails the comm (the batch's requests already belong to the caller). dg_comm_abort
 * (any thread) leaves a pending batch alone: it is never enqueued, and the job is ending anyway.
 *
 * Host waits poll the event: sched_yield for the first 200 us (or opts.spin_us, if longer), then
 * 50 us sleeps, so a short op is seen complete within microseconds without a core spinning for long.
 *
 * Buffers are device pointers; the owner thread must have the comm's CUDA device current. NCCL refuses
 * two ranks on one GPU: multi-rank runs on one GPU use the mpi backend with host staging instead.
 */
#define _GNU_SOURCE
#include "comm_impl.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "dg_env.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "dgtrain's nccl comm backend needs NCCL >= 2.18 (ncclCommSplit, non-blocking communicators)"
#endif

/* The one check macro per library (docs/design.md §4), private to this file. */
#define DG_CUDA_CHECK(call)                                                                                  \
    do {                                                                                                     \
        cudaError_t dg_cu_e_ = (call);                                                                       \
        if (dg_cu_e_ != cudaSuccess)                                                                         \
            return DG_ERR(DG_ERR_RUNTIME, "CUDA call `%s` failed: %s; hint: check the device and driver",    \
                          #call, cudaGetErrorString(dg_cu_e_));                                              \
    } while (0)
#define DG_NCCL_CHECK(comm, call)                                                                            \
    do {                                                                                                     \
        ncclResult_t dg_nc_r_ = (call);                                                                      \
        if (dg_nc_r_ != ncclSuccess && dg_nc_r_ != ncclInProgress) return nccl_error(comm, dg_nc_r_, #call); \
    } while (0)

typedef struct {
    dg_comm_t base;
    ncclComm_t nc;
    int device;
    int nonblocking; /* dg_comm_opts_t.nccl_nonblocking at creation: enqueues are settled by polling */
    cudaStream_t stream;
    int own_stream;
    cudaEvent_t dep_ev;
    cudaEvent_t flush_ev;
    float *scratch; /* barrier = all-reduce of one float */
    cudaEvent_t *pool;
    int npool, cappool;
    dg_comm_op_t *head, *tail; /* posted, not yet seen complete, in posting order */
    dg_comm_op_t *pend;        /* first op of the pending point-to-point batch (head..tail's suffix) */
    _Atomic int npend;         /* its length, for dg_comm_state (any thread) */
    _Atomic int aborted;
} cn_t;

static const dg_comm_vtbl_t k_vt_nccl;

static dg_status_t nccl_error(ncclComm_t comm, ncclResult_t r, const char *call) {
    const char *last = comm ? ncclGetLastError(comm) : NULL;
    return DG_ERR(r == ncclRemoteError || r == ncclSystemError ? DG_ERR_PEER : DG_ERR_RUNTIME,
                  "NCCL call `%s` failed: %s%s%s; hint: NCCL_DEBUG=WARN shows details", call,
                  ncclGetErrorString(r), last && *last ? ": " : "", last ? last : "");
}

/* A host wait yields the core for at least this long before sleeping: an op of a few hundred
 * microseconds is then seen complete at once instead of up to a sleep later. */
static const double k_min_spin_s = 200e-6;

static void nap(double elapsed, double spin_s) {
    if (elapsed < (spin_s > k_min_spin_s ? spin_s : k_min_spin_s)) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, 50000L};
    nanosleep(&ts, NULL);
}

/* Polls a non-blocking communicator until its pending call (init, split, enqueue, finalize) is done. */
static dg_status_t settle(cn_t *m, ncclComm_t comm, const char *what) {
    double t0 = dg_now_s();
    for (;;) {
        ncclResult_t st = ncclInProgress;
        ncclResult_t r = ncclCommGetAsyncError(comm, &st);
        if (r != ncclSuccess) return nccl_error(comm, r, "ncclCommGetAsyncError");
        if (st == ncclSuccess) return DG_OK;
        if (st != ncclInProgress) {
            dg_status_t s = nccl_error(comm, st, what);
            char msg[1024];
            dg_comm__strlcpy(msg, sizeof msg, dg_last_error());
            return dg_comm__fail(&m->base, s, msg);
        }
        double el = dg_now_s() - t0;
        if (el > m->base.opts.timeout_s) {
            char msg[512];
            snprintf(msg, sizeof msg,
                     "%s on %s (nccl) did not finish within %.1f s: a peer is missing or stuck", what,
                     m->base.name, el);
            return dg_comm__fail(&m->base, DG_ERR_PEER, msg);
        }
        nap(el, m->base.spin_s);
    }
}

/* A creating call on a helper thread (timed_call): the thread makes the comm's device current (NCCL
 * creates on the current device) and runs the call; the caller polls for it against the timeout. */
typedef struct {
    enum { MK_INIT, MK_SPLIT, MK_FINALIZE } kind;
    int device;
    int nranks, rank; /* MK_INIT */
    ncclUniqueId id;
    ncclComm_t comm; /* MK_SPLIT: the parent; MK_FINALIZE: the comm */
    int color, key;  /* MK_SPLIT */
    ncclConfig_t cfg;
    char name[128]; /* cfg.commName points here */
    ncclComm_t out;
    ncclResult_t r;
    _Atomic int done;
} mk_call_t;

static void *mk_main(void *arg) {
    mk_call_t *c = arg;
    if (cudaSetDevice(c->device) != cudaSuccess)
        c->r = ncclUnhandledCudaError;
    else if (c->kind == MK_INIT)
        c->r = ncclCommInitRankConfig(&c->out, c->nranks, c->id, c->rank, &c->cfg);
    else if (c->kind == MK_SPLIT)
        c->r = ncclCommSplit(c->comm, c->color, c->key, &c->out, &c->cfg);
    else
        c->r = ncclCommFinalize(c->comm);
    atomic_store(&c->done, 1);
    return NULL;
}

/* opts.nccl_nonblocking (dgtrain: parallel.nccl_nonblocking) brings back non-blocking communicators
 * (blocking = 0): every call may return ncclInProgress and is settled by polling. It costs the ~60 us
 * per enqueue described above, but is the mode of dgtrain before 2026-11-29 (docs/cuda.md). */

/* A creating call of `kind` for a comm named `name` on `device`, blocking or not. */
static mk_call_t *new_call(int kind, int device, const char *name, int nonblocking) {
    mk_call_t *c = dg_xcalloc(1, sizeof *c);
    c->kind = kind;
    c->device = device;
    atomic_init(&c->done, 0);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    c->cfg = cfg;
    c->cfg.blocking = nonblocking ? 0 : 1;
    dg_comm__strlcpy(c->name, sizeof c->name, name);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 27, 0)
    c->cfg.commName = c->name;
#endif
    return c;
}

/* Runs c (heap-allocated; taken over) and waits up to the comm's timeout. On a timeout the thread is
 * left blocked in NCCL with c (the job is ending: DG_ERR_PEER); else c is freed and *out (may be NULL)
 * receives the new communicator. */
static dg_status_t timed_call(cn_t *m, mk_call_t *c, const char *what, ncclComm_t *out) {
    if (out) *out = NULL;
    pthread_t th;
    if (pthread_create(&th, NULL, mk_main, c) != 0) {
        free(c);
        return DG_ERR(DG_ERR_RUNTIME, "%s on %s (nccl): cannot start a thread for it", what, m->base.name);
    }
    double t0 = dg_now_s();
    while (!atomic_load(&c->done)) {
        double el = dg_now_s() - t0;
        if (el > m->base.opts.timeout_s) {
            pthread_detach(th);
            return DG_ERR(DG_ERR_PEER,
                          "%s on %s (nccl) did not finish within %.1f s: a peer is missing or stuck; hint: "
                          "check that every rank of the group reached it (their logs), or raise the timeout",
                          what, m->base.name, el);
        }
        nap(el, m->base.spin_s);
    }
    pthread_join(th, NULL);
    ncclResult_t r = c->r;
    /* a non-blocking comm (c->cfg.blocking == 0) may still be working: the parent (split, finalize)
     * and the new comm are polled until done. A non-blocking split stores the child into c->out only
     * when it completes, from NCCL's own thread (the handle is NULL until then, even when the call
     * itself returned ncclSuccess): c stays alive until the parent has settled, and the handle is read
     * after that. */
    int pending = c->cfg.blocking == 0 && (r == ncclInProgress || r == ncclSuccess);
    ncclComm_t parent = c->comm;
    int split = c->kind == MK_SPLIT && c->color != NCCL_SPLIT_NOCOLOR; /* a child is expected */
    if (pending) r = ncclSuccess;
    dg_status_t s = DG_OK;
    if (r != ncclSuccess)
        s = nccl_error(c->out, r, what);
    else if (pending && parent)
        s = settle(m, parent, what);
    ncclComm_t made = s == DG_OK ? __atomic_load_n(&c->out, __ATOMIC_ACQUIRE) : c->out;
    /* the parent may report success before NCCL's job has stored the child: wait for the store */
    for (double t0 = dg_now_s(); s == DG_OK && pending && split && !made;) {
        double el = dg_now_s() - t0;
        if (el > m->base.opts.timeout_s) break;
        nap(el, m->base.spin_s);
        made = __atomic_load_n(&c->out, __ATOMIC_ACQUIRE);
    }
    /* a timeout leaves NCCL's job able to write c->out later: c is not freed then */
    int orphan = pending && (s != DG_OK || (split && !made));
    if (!orphan) free(c);
    if (s == DG_OK && pending && split && !made)
        s = DG_ERR(DG_ERR_PEER, "%s on %s (nccl): no communicator within %.1f s after the parent settled",
                   what, m->base.name, m->base.opts.timeout_s);
    if (s == DG_OK && pending && made) s = settle(m, made, what);
    if (s != DG_OK) {
        if (made) ncclCommAbort(made);
        return s;
    }
    if (out) *out = made;
    return DG_OK;
}

static ncclDataType_t nccl_type(dg_dtype_t dt) {
    switch (dt) {
    case DG_F32:
        return ncclFloat32;
    case DG_BF16:
        return ncclBfloat16;
    case DG_F64:
        return ncclFloat64;
    case DG_I32:
        return ncclInt32;
    case DG_F16:
        return ncclFloat16;
    case DG_U16:
        return ncclUint8; /* never reduced: moved as bytes */
    }
    DG_ASSERTF(0, "dtype %d", (int)dt);
    return ncclUint8;
}

static dg_status_t get_event(cn_t *m, cudaEvent_t *ev) {
    if (m->npool) {
        *ev = m->pool[--m->npool];
        return DG_OK;
    }
    DG_CUDA_CHECK(cudaEventCreateWithFlags(ev, cudaEventDisableTiming));
    return DG_OK;
}

static void put_event(cn_t *m, cudaEvent_t ev) {
    if (m->npool == m->cappool) {
        int cap = m->cappool ? 2 * m->cappool : 16;
        cudaEvent_t *p = realloc(m->pool, (size_t)cap * sizeof *p);
        DG_ASSERT(p);
        m->pool = p;
        m->cappool = cap;
    }
    m->pool[m->npool++] = ev;
}

static void unlink_op(cn_t *m, dg_comm_op_t *op) {
    dg_comm__list_unlink(&m->head, &m->tail, op);
}

static void mark_done(cn_t *m, dg_comm_op_t *op) {
    unlink_op(m, op);
    if (op->event) put_event(m, (cudaEvent_t)op->event);
    op->event = NULL;
    if (op->seq > atomic_load(&m->base.coll_done)) atomic_store(&m->base.coll_done, op->seq);
    atomic_store(&op->state, DG_OPST_DONE);
}

/* NCCL's own asynchronous failure (a peer died, a network error): fatal for the comm. */
static dg_status_t check_async(cn_t *m) {
    ncclResult_t st = ncclSuccess;
    if (ncclCommGetAsyncError(m->nc, &st) != ncclSuccess) st = ncclInternalError;
    if (st == ncclSuccess || st == ncclInProgress) return DG_OK;
    char msg[1024];
    const char *last = ncclGetLastError(m->nc);
    snprintf(msg, sizeof msg, "NCCL reported an asynchronous error on %s: %s%s%.600s", m->base.name,
             ncclGetErrorString(st), last && *last ? ": " : "", last ? last : "");
    return dg_comm__fail(&m->base, DG_ERR_PEER, msg);
}

/* One look at op: done, failed, or still running. */
static dg_status_t query(cn_t *m, dg_comm_op_t *op, int *done) {
    *done = atomic_load(&op->state) == DG_OPST_DONE;
    if (*done) return DG_OK;
    if (!op->event) {
        /* a batched point-to-point op that a failed flush_p2p never enqueued */
        DG_ASSERT(atomic_load(&m->base.failed));
        return dg_comm__failed_error(&m->base);
    }
    cudaError_t e = cudaEventQuery((cudaEvent_t)op->event);
    if (e == cudaSuccess) {
        mark_done(m, op);
        *done = 1;
        return DG_OK;
    }
    if (e != cudaErrorNotReady) {
        char d[256], msg[512];
        dg_comm__describe(&m->base, op, d, sizeof d);
        snprintf(msg, sizeof msg, "%s failed on the device: %s", d, cudaGetErrorString(e));
        return dg_comm__fail(&m->base, DG_ERR_RUNTIME, msg);
    }
    return check_async(m);
}

/* ---------------------------------------------------------------------------------------------- */

static const char *const k_nccl_calls[DG_OP_NKINDS] = {
    "ncclAllGather",           "ncclReduceScatter", "ncclAllReduce", "ncclBroadcast",
    "ncclAllReduce (barrier)", "ncclSend",          "ncclRecv"};

/* The NCCL call of one op, on the comm stream (inside a group for point-to-point). */
static ncclResult_t nccl_call(cn_t *m, const dg_comm_op_t *op) {
    size_t esz = dg_dtype_size(op->dt);
    ncclRedOp_t red = op->red == DG_RED_AVG ? ncclAvg : ncclSum;
    ncclDataType_t T = nccl_type(op->dt);
    ncclComm_t nc = m->nc;
    switch (op->kind) {
    case DG_OP_ALLGATHER:
        /* in place (NCCL's definition matches ours): send == recv + rank * count */
        return ncclAllGather(op->send, op->recv, op->count * esz, ncclUint8, nc, m->stream);
    case DG_OP_REDUCE_SCATTER:
        return ncclReduceScatter(op->send, op->recv, op->count, T, red, nc, m->stream);
    case DG_OP_ALLREDUCE:
        return ncclAllReduce(op->send, op->recv, op->count, T, red, nc, m->stream);
    case DG_OP_BROADCAST:
        return ncclBroadcast(op->recv, op->recv, op->count * esz, ncclUint8, op->peer, nc, m->stream);
    case DG_OP_BARRIER:
        return ncclAllReduce(m->scratch, m->scratch, 1, ncclFloat32, ncclSum, nc, m->stream);
    case DG_OP_SEND:
        return ncclSend(op->send, op->count * esz, ncclUint8, op->peer, nc, m->stream);
    case DG_OP_RECV:
        return ncclRecv(op->recv, op->count * esz, ncclUint8, op->peer, nc, m->stream);
    default:
        DG_ASSERT(0);
    }
    return ncclInternalError;
}

/* Records op's completion event at the current end of the comm stream and marks it started. */
static dg_status_t record(cn_t *m, dg_comm_op_t *op) {
    cudaEvent_t ev;
    DG_TRY(get_event(m, &ev));
    cudaError_t e = cudaEventRecord(ev, m->stream);
    if (e != cudaSuccess) {
        put_event(m, ev);
        return DG_ERR(DG_ERR_RUNTIME, "CUDA call `cudaEventRecord` after %s on %s failed: %s",
                      dg_comm__op_name(op->kind), m->base.name, cudaGetErrorString(e));
    }
    op->event = ev;
    atomic_store(&op->state, DG_OPST_STARTED);
    if (op->seq) atomic_store(&m->base.coll_started, op->seq);
    return DG_OK;
}

static void append(cn_t *m, dg_comm_op_t *op) {
    dg_comm__list_append(&m->head, &m->tail, op);
}

/* Marks the comm failed with the message of status s (already set by the failing call). */
static dg_status_t fail_with(cn_t *m, dg_status_t s) {
    char msg[1024];
    dg_comm__strlcpy(msg, sizeof msg, dg_last_error());
    return dg_comm__fail(&m->base, s, msg);
}

/* Enqueues the pending point-to-point batch (m->pend .. m->tail) as one NCCL group, then records one
 * event per op after it. Any failure fails the comm: the ops stay on the list, their requests are the
 * caller's, and those without an event report the failure when waited for. */
static dg_status_t flush_p2p(cn_t *m) {
    dg_comm_op_t *first = m->pend;
    if (!first) return DG_OK;
    if (atomic_load(&m->base.failed)) return dg_comm__failed_error(&m->base);
    m->pend = NULL;
    atomic_store(&m->npend, 0);
    const char *call = "ncclGroupStart";
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess) {
        for (dg_comm_op_t *p = first; p && (r == ncclSuccess || r == ncclInProgress); p = p->next) {
            r = nccl_call(m, p);
            call = k_nccl_calls[p->kind];
        }
        /* the group must be closed even after a failed call inside it */
        ncclResult_t re = ncclGroupEnd();
        if (r == ncclSuccess || r == ncclInProgress) {
            r = re;
            call = "ncclGroupEnd";
        }
    }
    if (r != ncclSuccess && r != ncclInProgress) return fail_with(m, nccl_error(m->nc, r, call));
    /* non-blocking comm: the group may still be enqueueing; events must come after all of it */
    dg_status_t s = m->nonblocking ? settle(m, m->nc, "point-to-point group") : DG_OK;
    if (s != DG_OK) return fail_with(m, s);
    for (dg_comm_op_t *p = first; p; p = p->next) {
        p->t_start = dg_now_s();
        s = record(m, p);
        if (s != DG_OK) return fail_with(m, s);
    }
    return DG_OK;
}

static dg_status_t nccl_post(dg_comm_t *c, dg_comm_op_t *op) {
    cn_t *m = (cn_t *)c;
    if (!dg_comm__is_collective(op->kind)) {
        /* held back until something needs it (see the file comment); event NULL, state QUEUED */
        append(m, op);
        if (!m->pend) m->pend = op;
        atomic_fetch_add(&m->npend, 1);
        return DG_OK;
    }
    DG_TRY(flush_p2p(m));
    ncclResult_t r = nccl_call(m, op);
    if (r != ncclSuccess && r != ncclInProgress) return nccl_error(m->nc, r, k_nccl_calls[op->kind]);
    /* a non-blocking comm may still be enqueueing: it must settle before the event is recorded */
    if (m->nonblocking) DG_TRY(settle(m, m->nc, dg_comm__op_name(op->kind)));
    DG_TRY(record(m, op));
    op->t_start = op->t_post;
    append(m, op);
    return DG_OK;
}

/* Waits until `op` is done (or `op` == NULL: until the stream has drained up to flush_ev). */
static dg_status_t wait_until(cn_t *m, dg_comm_op_t *op, dg_comm_op_t *waited) {
    double t0 = dg_now_s();
    for (;;) {
        int done = 0;
        if (op) {
            DG_TRY(query(m, op, &done));
        } else {
            cudaError_t e = cudaEventQuery(m->flush_ev);
            if (e == cudaSuccess)
                done = 1;
            else if (e != cudaErrorNotReady)
                return dg_comm__fail(&m->base, DG_ERR_RUNTIME, cudaGetErrorString(e));
            else
                DG_TRY(check_async(m));
        }
        if (done) return DG_OK;
        double el = dg_now_s() - t0;
        if (el >= m->base.opts.timeout_s) {
            /* the stream runs in order: the oldest unfinished op is the one that is stuck */
            dg_comm_op_t *stuck = op ? op : m->head;
            for (dg_comm_op_t *p = m->head; p && p != op; p = p->next) {
                int d = 0;
                if (query(m, p, &d) == DG_OK && !d) {
                    stuck = p;
                    break;
                }
            }
            if (!stuck) {
                char msg[256];
                snprintf(msg, sizeof msg, "flush of %s (nccl) timed out after %.1f s at step %lld",
                         m->base.name, el, (long long)atomic_load(&m->base.step));
                return dg_comm__fail(&m->base, DG_ERR_PEER, msg);
            }
            dg_comm_op_t s_copy = *stuck;
            return dg_comm__timeout(&m->base, &s_copy, waited, el);
        }
        nap(el, m->base.spin_s);
    }
}

static dg_status_t nccl_wait(dg_comm_t *c, dg_comm_op_t *op) {
    cn_t *m = (cn_t *)c;
    dg_status_t s = flush_p2p(m);
    if (s == DG_OK) s = wait_until(m, op, op);
    if (s != DG_OK) return s; /* the op stays on the failed comm's list: NCCL may still touch it */
    return dg_comm__op_release(op);
}

static dg_status_t nccl_test(dg_comm_t *c, dg_comm_op_t *op, int *done) {
    cn_t *m = (cn_t *)c;
    DG_TRY(flush_p2p(m));
    DG_TRY(query(m, op, done));
    if (*done) return dg_comm__op_release(op);
    return DG_OK;
}

static dg_status_t nccl_flush(dg_comm_t *c) {
    cn_t *m = (cn_t *)c;
    DG_TRY(flush_p2p(m));
    DG_CUDA_CHECK(cudaEventRecord(m->flush_ev, m->stream));
    DG_TRY(wait_until(m, NULL, NULL));
    while (m->head)
        mark_done(m, m->head); /* everything before the flush event has finished */
    return DG_OK;
}

static dg_status_t nccl_begin_after(dg_comm_t *c, void *stream) {
    cn_t *m = (cn_t *)c;
    /* ops posted before this call must not wait for `stream`: enqueue the batch first */
    DG_TRY(flush_p2p(m));
    if (!stream || (cudaStream_t)stream == m->stream) return DG_OK;
    DG_CUDA_CHECK(cudaEventRecord(m->dep_ev, (cudaStream_t)stream));
    DG_CUDA_CHECK(cudaStreamWaitEvent(m->stream, m->dep_ev, 0));
    return DG_OK;
}

static dg_status_t nccl_stream_wait(dg_comm_t *c, dg_comm_op_t *op, void *stream) {
    cn_t *m = (cn_t *)c;
    DG_TRY(flush_p2p(m));
    if (atomic_load(&op->state) != DG_OPST_DONE) {
        if (atomic_load(&c->failed)) return dg_comm__failed_error(c);
        /* the stream captures the event's current record: the event may be reused right after */
        DG_CUDA_CHECK(cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)op->event, 0));
        unlink_op(m, op);
        put_event(m, (cudaEvent_t)op->event);
        op->event = NULL;
    }
    return dg_comm__op_release(op);
}

static void nccl_state(dg_comm_t *c, char *buf, size_t cap) {
    cn_t *m = (cn_t *)c;
    int np = atomic_load(&m->npend);
    char extra[96] = "";
    if (np)
        snprintf(extra, sizeof extra, "; %d point-to-point op%s batched, not yet enqueued", np,
                 np == 1 ? "" : "s");
    snprintf(buf, cap, "%s (nccl%s): collectives enqueued up to #%lld, seen complete up to #%lld%s", c->name,
             m->nonblocking ? ", non-blocking" : "", (long long)atomic_load(&c->coll_started),
             (long long)atomic_load(&c->coll_done), extra);
}

static dg_status_t nccl_poll(dg_comm_t *c) {
    cn_t *m = (cn_t *)c;
    if (!m->nc) return DG_OK;
    return check_async(m);
}

static void nccl_abort_backend(dg_comm_t *c) {
    cn_t *m = (cn_t *)c;
    if (m->nc && !atomic_exchange(&m->aborted, 1)) ncclCommAbort(m->nc);
}

static void nccl_destroy(dg_comm_t *c) {
    cn_t *m = (cn_t *)c;
    if (m->nc && !atomic_load(&m->aborted)) {
        int clean = !atomic_load(&c->failed) && nccl_flush(c) == DG_OK;
        if (clean) {
            mk_call_t *k = new_call(MK_FINALIZE, m->device, c->name, m->nonblocking);
            k->comm = m->nc;
            clean = timed_call(m, k, "ncclCommFinalize", NULL) == DG_OK;
        }
        if (clean)
            ncclCommDestroy(m->nc);
        else {
            DG_LOG_WARN("comm %s (nccl): freed after a failure; aborting the NCCL communicator", c->name);
            ncclCommAbort(m->nc);
        }
    }
    m->nc = NULL;
    m->pend = NULL; /* a batch left after a failure was never enqueued */
    for (dg_comm_op_t *p = m->head; p; p = p->next)
        p->event = NULL; /* their events die with the pool */
    for (int i = 0; i < m->npool; i++)
        cudaEventDestroy(m->pool[i]);
    free(m->pool);
    if (m->dep_ev) cudaEventDestroy(m->dep_ev);
    if (m->flush_ev) cudaEventDestroy(m->flush_ev);
    if (m->scratch) cudaFree(m->scratch);
    if (m->own_stream && m->stream) cudaStreamDestroy(m->stream);
    dg_comm__base_destroy(c);
    free(m);
}

static dg_status_t nccl_split(dg_comm_t *parent, int color, int key, const dg_comm_opts_t *o,
                              dg_comm_t **out);

static const dg_comm_vtbl_t k_vt_nccl = {
    .name = "nccl",
    .post = nccl_post,
    .wait = nccl_wait,
    .test = nccl_test,
    .flush = nccl_flush,
    .split = nccl_split,
    .begin_after = nccl_begin_after,
    .stream_wait = nccl_stream_wait,
    .state = nccl_state,
    .poll = nccl_poll,
    .abort_backend = nccl_abort_backend,
    .destroy = nccl_destroy,
};

/* The parts every nccl comm has besides its ncclComm_t. */
static dg_status_t setup_common(cn_t *m, MPI_Comm group, int device, void *stream, const dg_comm_opts_t *o) {
    DG_TRY(dg_comm__base_init(&m->base, DG_COMM_NCCL, group, o));
    m->device = device;
    m->nonblocking = o->nccl_nonblocking;
    DG_CUDA_CHECK(cudaSetDevice(device));
    if (stream) {
        m->stream = (cudaStream_t)stream;
    } else {
        DG_CUDA_CHECK(cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking));
        m->own_stream = 1;
    }
    DG_CUDA_CHECK(cudaEventCreateWithFlags(&m->dep_ev, cudaEventDisableTiming));
    DG_CUDA_CHECK(cudaEventCreateWithFlags(&m->flush_ev, cudaEventDisableTiming));
    DG_CUDA_CHECK(cudaMalloc((void **)&m->scratch, 16));
    DG_CUDA_CHECK(cudaMemset(m->scratch, 0, 16));
    return DG_OK;
}

static dg_status_t create_inner(cn_t *m, MPI_Comm group, int device, void *stream, const dg_comm_opts_t *o) {
    DG_TRY(setup_common(m, group, device, stream, o));
    dg_comm_t *c = &m->base;
    /* rank 0 makes the id; the broadcast also carries whether that worked, so no rank hangs */
    struct {
        int ok;
        ncclUniqueId id;
    } msg;
    memset(&msg, 0, sizeof msg);
    if (c->rank == 0) msg.ok = ncclGetUniqueId(&msg.id) == ncclSuccess;
    DG_MPI_CHECK(MPI_Bcast(&msg, (int)sizeof msg, MPI_BYTE, 0, c->ctl));
    if (!msg.ok)
        return DG_ERR(DG_ERR_RUNTIME, "comm %s: ncclGetUniqueId failed on group rank 0 (world %d)", c->name,
                      c->world_ranks[0]);
    mk_call_t *k = new_call(MK_INIT, device, c->name, m->nonblocking);
    k->nranks = c->size;
    k->rank = c->rank;
    k->id = msg.id;
    return timed_call(m, k, "ncclCommInitRankConfig", &m->nc);
}

dg_status_t dg_comm__nccl_create(MPI_Comm group, int cuda_device, void *cuda_stream, const dg_comm_opts_t *o,
                                 dg_comm_t **out) {
    cn_t *m = dg_xcalloc(1, sizeof *m);
    m->base.vt = &k_vt_nccl;
    m->base.ctl = m->base.probe = MPI_COMM_NULL;
    atomic_init(&m->aborted, 0);
    atomic_init(&m->npend, 0);
    dg_status_t s = create_inner(m, group, cuda_device, cuda_stream, o);
    if (s != DG_OK) {
        char msg[1024];
        dg_comm__strlcpy(msg, sizeof msg, dg_last_error());
        if (m->nc) {
            ncclCommAbort(m->nc);
            m->nc = NULL;
        }
        nccl_destroy(&m->base);
        return DG_ERR(s, "%s", msg);
    }
    DG_LOG_DEBUG("comm %s: nccl backend, %d ranks, device %d, %s communicator", m->base.name, m->base.size,
                 cuda_device, m->nonblocking ? "non-blocking" : "blocking");
    *out = &m->base;
    return DG_OK;
}

static dg_status_t nccl_split(dg_comm_t *pc, int color, int key, const dg_comm_opts_t *o, dg_comm_t **out) {
    cn_t *p = (cn_t *)pc;
    MPI_Comm sub = MPI_COMM_NULL;
    DG_MPI_CHECK(MPI_Comm_split(pc->ctl, color < 0 ? MPI_UNDEFINED : color, key, &sub));
    ncclComm_t child = NULL;
    mk_call_t *k = new_call(MK_SPLIT, p->device, o->name ? o->name : pc->name, p->nonblocking);
    k->comm = p->nc;
    k->color = color < 0 ? NCCL_SPLIT_NOCOLOR : color;
    k->key = key;
    dg_status_t s = timed_call(p, k, "ncclCommSplit", &child);
    if (s != DG_OK || sub == MPI_COMM_NULL) {
        char msg[1024];
        dg_comm__strlcpy(msg, sizeof msg, dg_last_error());
        if (child) ncclCommAbort(child);
        if (sub != MPI_COMM_NULL) MPI_Comm_free(&sub);
        return s == DG_OK ? DG_OK : DG_ERR(s, "%s", msg);
    }
    cn_t *m = dg_xcalloc(1, sizeof *m);
    m->base.vt = &k_vt_nccl;
    m->base.ctl = m->base.probe = MPI_COMM_NULL;
    atomic_init(&m->aborted, 0);
    atomic_init(&m->npend, 0);
    m->nc = child;
    /* children share the parent's stream, so the parent must outlive them (dg_comm_mesh_free does) */
    s = setup_common(m, sub, p->device, p->stream, o);
    m->nonblocking = p->nonblocking; /* the child was made in the parent's mode */
    MPI_Comm_free(&sub);
    int nrank = -1;
    if (s == DG_OK && ncclCommUserRank(child, &nrank) == ncclSuccess && nrank != m->base.rank)
        s = DG_ERR(DG_ERR_RUNTIME, "comm %s: NCCL split rank %d differs from MPI split rank %d", m->base.name,
                   nrank, m->base.rank);
    if (s != DG_OK) {
        char msg[1024];
        dg_comm__strlcpy(msg, sizeof msg, dg_last_error());
        ncclCommAbort(child);
        m->nc = NULL;
        nccl_destroy(&m->base);
        return DG_ERR(s, "%s", msg);
    }
    *out = &m->base;
    return DG_OK;
}
