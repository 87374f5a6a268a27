/* comm.h — the communication backend: collectives and point-to-point transfers over one group of
 * ranks (a mesh dimension's group, or the world), behind one vtable with two implementations:
 *   mpi  — host memory, Open MPI underneath (any compute backend can use it through host staging);
 *   nccl — device memory, NCCL on a CUDA stream (built when DG_HAVE_CUDA; one rank per GPU).
 * The graph executor runs collective ops through this header and knows nothing else about either.
 *
 * Model
 *   - Every operation has a blocking form (dg_comm_allreduce, ...) and a non-blocking form
 *     (dg_comm_iallreduce, ...) that returns a request; dg_comm_wait / dg_comm_test complete it. A request
 *     is released by the wait or test that reports it finished (successfully or not); never reuse it.
 *   - Ordering: all ranks of a group must post the group's collectives in the same order (as in MPI).
 *     The mpi backend executes them strictly in posting order (FIFO) on a communication thread, so a
 *     collective never overtakes an earlier one; point-to-point operations START in posting order and
 *     complete independently (a send may be posted before the matching receive of an exchange).
 *   - Overlap: with the mpi backend's communication thread (DG_COMM_PROGRESS_THREAD, the default when
 *     MPI grants MPI_THREAD_MULTIPLE) operations progress while the caller computes and makes no MPI
 *     call at all; dg_comm_test then only reads a flag. DG_COMM_PROGRESS_NONBLOCKING issues MPI's
 *     non-blocking collectives instead, which (Open MPI) advance only inside dg_comm calls: use it only
 *     where threads are not allowed. The nccl backend runs on its CUDA stream; the schedule's explicit
 *     wait edges are dg_comm_begin_after (comm waits for compute) and dg_comm_stream_wait (compute waits
 *     for comm).
 *   - Timeouts: every wait has one (opts.timeout_s, normally health.timeout_s). A wait fails when the
 *     operation it depends on (itself, or the earlier collective the FIFO is stuck in) has made no
 *     progress for timeout_s since the later of its start and the wait's start. The error is
 *     DG_ERR_PEER with a one-line message naming the collective, the group, its size, the step
 *     (dg_comm_set_step) and, when it can be learned, the ranks that did not arrive: the waiting rank
 *     asks every group member over a side channel which collective it has reached (a small reply from a
 *     per-process responder thread), and lists those that are behind or did not answer. After a failure
 *     the comm is unusable (later posts fail at once): the caller must end the job with
 *     dg_comm_abort(c, DG_ERR_PEER), which makes every rank exit 3.
 *     One exception: a blocking collective run inline (opts.inline_blocking, the default in thread
 *     mode) sits inside an MPI call that nothing can interrupt, so when it times out the comm thread
 *     writes the same message (log, ERROR) and ends the job itself with exit 3 — the end the caller
 *     would choose anyway. Use the non-blocking form + dg_comm_wait, or inline_blocking = 0, to get
 *     the error returned instead.
 *   - Dtypes: all operations move any dg_dtype_t. Reductions take DG_F32, DG_BF16, DG_F64, and DG_I32
 *     (SUM only). bf16 sums (mpi backend) use a user MPI_Op that adds in f32 and rounds the result to
 *     bf16 (nearest-even) at every combining step: an element of an n-rank reduction is rounded n-1
 *     times, so its error is bounded by about (n-1) bf16 ulps of the partial sums (NCCL behaves alike).
 *     AVG is the SUM followed by one division by the group size (f32: x / n; bf16: bf16(f32(x) / n)).
 *   - Determinism: the mpi backend's result depends only on the inputs, the group size, the message
 *     size (Open MPI picks its algorithm from those) and the progress mode (NONBLOCKING runs MPI's
 *     non-blocking algorithms, which may add in another order than the blocking ones that the thread
 *     mode and inline calls use; the reduce-scatter in thread mode is dg_comm's ring unless
 *     opts.rs_mpi, which adds each block in ring order). Repeated runs are bitwise identical and every rank
 * of an all-reduce receives the same bits (tests/comm verifies both, and that the result equals a raw
 * MPI_Allreduce of the same data bit for bit). NCCL is deterministic for a fixed topology and
 *     NCCL_ALGO/NCCL_PROTO; its AVG may pre-scale, so mpi and nccl AVG can differ in the last bit.
 *   - Buffers: counts are elements (at most INT_MAX per call and per rank). In-place forms:
 *       allreduce        send == recv;
 *       allgather        send == recv + rank * count_per_rank (this rank's block already in place);
 *       reduce_scatter   recv == send + rank * count_per_rank (the result lands on this rank's block;
 *                        the other blocks of send are clobbered).
 *     Any other overlap of send and receive buffers is rejected. Buffers must stay valid and untouched
 *     (receive buffers unread) until the request completes.
 *   - Threads: one thread issues the operations of a given comm (posts, waits, tests, split, free).
 *     dg_comm_poll, dg_comm_state, dg_comm_abort and dg_comm_set_step may be called from any thread
 *     (the watchdog). Free every comm before MPI_Finalize.
 */
#ifndef DG_COMM_H
#define DG_COMM_H

#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

#include "dg_common.h"
#include "dg_mesh.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dg_comm dg_comm_t;
typedef struct dg_comm_req dg_comm_req_t;

typedef enum { DG_RED_SUM = 0, DG_RED_AVG = 1 } dg_redop_t;

typedef enum { DG_COMM_MPI = 0, DG_COMM_NCCL = 1 } dg_comm_kind_t;

typedef enum {
    DG_COMM_PROGRESS_AUTO = 0,        /* the thread when MPI_THREAD_MULTIPLE is granted, else nonblocking */
    DG_COMM_PROGRESS_THREAD = 1,      /* a communication thread per comm runs the FIFO (needs MULTIPLE) */
    DG_COMM_PROGRESS_NONBLOCKING = 2, /* MPI non-blocking calls progressed only inside dg_comm calls */
} dg_comm_progress_t;

typedef struct dg_comm_opts {
    const char *name;            /* group name used in messages, e.g. "dp_shard" (copied); NULL: "comm" */
    double timeout_s;            /* > 0: every wait's timeout (health.timeout_s) */
    dg_comm_progress_t progress; /* mpi backend only */
    int arrival_probe;           /* 1: on a timeout, ask the group who did not arrive (needs MULTIPLE) */
    double spin_us;              /* mpi thread mode: how long the comm thread and a waiter poll before
                                    sleeping (low latency for back-to-back small ops); < 0: default 50 */
    int inline_blocking;         /* mpi thread mode: a BLOCKING collective posted while nothing else is
                                    outstanding runs on the caller's thread (the same MPI call, so the
                                    same bits; no hand-off latency). See "Timeouts" above. */
    int rs_mpi;                  /* mpi thread mode: 1 = reduce-scatter through MPI_Reduce_scatter_block;
                                    0 (default) = dg_comm's own ring (n-1 exchanges of one block with
                                    the neighbours, each followed by an add; sums in a fixed ring order,
                                    so results repeat bit for bit but may differ from MPI's in the last
                                    bit). The ring moves (n-1)/n of the data, the minimum, and was 2-9x
                                    faster than Open MPI 4.1's tuned reduce_scatter_block at 1-64 MB. */
    int nccl_nonblocking;        /* nccl backend: 1 = non-blocking communicators (ncclConfig_t.blocking =
                                    0; every call settled by polling); 0 (default) = blocking. A split
                                    takes its parent's mode. */
} dg_comm_opts_t;

/* Defaults: name "comm", timeout 120 s, progress AUTO, arrival probe on, spin 50 us, inline on, ring
 * reduce-scatter, blocking NCCL communicators. */
void dg_comm_opts_default(dg_comm_opts_t *o);

/* ---- creation ---- */

/* Collective over `group`, which is duplicated internally (the caller keeps and frees its own).
 * o may be NULL (defaults). Fails with DG_ERR_USAGE on bad options, DG_ERR_RUNTIME on MPI errors or
 * when the thread mode is requested without MPI_THREAD_MULTIPLE. */
dg_status_t dg_comm_create_mpi(MPI_Comm group, const dg_comm_opts_t *o, dg_comm_t **out);

/* Collective over `group`: NCCL communicator on CUDA device `cuda_device` (made current), its unique id
 * broadcast over `group`, initialised non-blocking and polled against opts.timeout_s. Collectives are
 * enqueued on `cuda_stream` (a cudaStream_t), or on a stream the comm creates and owns when NULL.
 * Buffers are device pointers. Without CUDA support in the build: DG_ERR_USAGE. */
dg_status_t dg_comm_create_nccl(MPI_Comm group, int cuda_device, void *cuda_stream, const dg_comm_opts_t *o,
                                dg_comm_t **out);

/* Collective over `parent`: the ranks passing the same color >= 0 form a new comm of the same kind
 * (MPI_Comm_split / ncclCommSplit), ordered by key then parent rank. color < 0: *out = NULL. Options
 * other than the name are inherited when o is NULL. Waits for the parent's outstanding operations. */
dg_status_t dg_comm_split(dg_comm_t *parent, int color, int key, const dg_comm_opts_t *o, dg_comm_t **out);

/* Frees the comm. Waits (up to the timeout) for operations still queued. After a failure (timeout or
 * peer error) the communication thread may be stuck inside MPI: the comm's resources are then leaked
 * rather than freed under it — abort the job instead (dg_comm_abort). NULL is a no-op. */
void dg_comm_free(dg_comm_t *c);

/* ---- mesh: one comm per mesh dimension ---- */
typedef struct dg_comm_mesh {
    dg_mesh_shape_t shape;
    int coord[DG_MESH_NDIM];      /* this rank's coordinates */
    dg_comm_t *world;             /* every rank of `world`, name "world" */
    dg_comm_t *dim[DG_MESH_NDIM]; /* ranks differing only in that coordinate; group rank = coordinate;
                                     named by dg_mesh_dim_name() */
    dg_comm_t *dp;                /* ranks with the same tp coordinate (dp_replicate x dp_shard), "dp";
                                     group rank = dp_replicate coord * dp_shard size + dp_shard coord */
    dg_comm_t *pp_act, *pp_grad;  /* pp > 1: the ranks with these coordinates in every pipeline stage, group
                                     rank = stage, "pp.act" and "pp.grad" (the executor's two channels,
                                     docs/parallelism.md); NULL without a pipeline. Every other group lies
                                     within one stage. */
} dg_comm_mesh_t;

/* Collective over `world` (whose size must equal the mesh's product: DG_ERR_USAGE otherwise). Creates
 * the world comm of the given kind (cuda_device/cuda_stream as in dg_comm_create_nccl; ignored for
 * mpi), then splits it per dimension. */
dg_status_t dg_comm_mesh_create(MPI_Comm world, const dg_mesh_shape_t *shape, dg_comm_kind_t kind,
                                int cuda_device, void *cuda_stream, const dg_comm_opts_t *o,
                                dg_comm_mesh_t **out);
void dg_comm_mesh_free(dg_comm_mesh_t *m);

/* ---- queries ---- */
int dg_comm_rank(const dg_comm_t *c);
int dg_comm_size(const dg_comm_t *c);
const char *dg_comm_name(const dg_comm_t *c);
dg_comm_kind_t dg_comm_kind(const dg_comm_t *c);
const char *dg_comm_backend_name(const dg_comm_t *c);          /* "mpi" | "nccl" */
int dg_comm_world_rank_of(const dg_comm_t *c, int group_rank); /* MPI_COMM_WORLD rank */
double dg_comm_timeout(const dg_comm_t *c);

/* The training step named by later timeout messages (any thread). */
void dg_comm_set_step(dg_comm_t *c, int64_t step);

/* ---- collectives (group of n ranks, this rank r) ---- */

/* recv[n * count_per_rank] = the send blocks of ranks 0..n-1 concatenated in group-rank order. */
dg_status_t dg_comm_allgather(dg_comm_t *c, const void *send, void *recv, size_t count_per_rank,
                              dg_dtype_t dt);
dg_status_t dg_comm_iallgather(dg_comm_t *c, const void *send, void *recv, size_t count_per_rank,
                               dg_dtype_t dt, dg_comm_req_t **req);

/* send holds n blocks of count_per_rank; recv[count_per_rank] = reduction over ranks of block r. */
dg_status_t dg_comm_reduce_scatter(dg_comm_t *c, const void *send, void *recv, size_t count_per_rank,
                                   dg_dtype_t dt, dg_redop_t op);
dg_status_t dg_comm_ireduce_scatter(dg_comm_t *c, const void *send, void *recv, size_t count_per_rank,
                                    dg_dtype_t dt, dg_redop_t op, dg_comm_req_t **req);

/* recv[count] = reduction over ranks of send[count]; recv may equal send. */
dg_status_t dg_comm_allreduce(dg_comm_t *c, const void *send, void *recv, size_t count, dg_dtype_t dt,
                              dg_redop_t op);
dg_status_t dg_comm_iallreduce(dg_comm_t *c, const void *send, void *recv, size_t count, dg_dtype_t dt,
                               dg_redop_t op, dg_comm_req_t **req);

/* buf[count] of group rank `root` copied to every rank. */
dg_status_t dg_comm_broadcast(dg_comm_t *c, void *buf, size_t count, dg_dtype_t dt, int root);
dg_status_t dg_comm_ibroadcast(dg_comm_t *c, void *buf, size_t count, dg_dtype_t dt, int root,
                               dg_comm_req_t **req);

/* Every rank has arrived (blocking only). */
dg_status_t dg_comm_barrier(dg_comm_t *c);

/* ---- point-to-point (peer is a group rank != own rank; tag >= 0; nccl ignores tags and matches in
 * posting order per peer). nccl holds posted sends and receives back and enqueues them together, as one
 * NCCL group, at the next collective post, wait, test, flush, stream_wait or begin_after on the comm,
 * so the sends and receives of an exchange may be posted in any order without deadlock. ---- */
dg_status_t dg_comm_send(dg_comm_t *c, const void *buf, size_t count, dg_dtype_t dt, int peer, int tag);
dg_status_t dg_comm_isend(dg_comm_t *c, const void *buf, size_t count, dg_dtype_t dt, int peer, int tag,
                          dg_comm_req_t **req);
dg_status_t dg_comm_recv(dg_comm_t *c, void *buf, size_t count, dg_dtype_t dt, int peer, int tag);
dg_status_t dg_comm_irecv(dg_comm_t *c, void *buf, size_t count, dg_dtype_t dt, int peer, int tag,
                          dg_comm_req_t **req);

/* ---- completion ---- */

/* Blocks until *req completes, fails, or times out; releases it in every case. */
dg_status_t dg_comm_wait(dg_comm_t *c, dg_comm_req_t *req);
/* *done = 1 (and the request released) when it has completed or failed; never blocks, never times
 * out. With the mpi thread mode it makes no MPI call. */
dg_status_t dg_comm_test(dg_comm_t *c, dg_comm_req_t *req, int *done);
/* mpi thread mode: yields the caller's core until the communication thread has started *req (its
 * MPI_Isend / MPI_Irecv issued: a send's data is then on its way without the comm thread having to be
 * scheduled again), at most 10 ms; returns at once on other comms. For a caller that goes on computing
 * with the request in flight on a machine whose cores the computing threads fill. req stays valid. */
void dg_comm_wait_started(dg_comm_t *c, dg_comm_req_t *req);
/* Waits for every operation posted so far on c (requests still held stay valid for wait/test). */
dg_status_t dg_comm_flush(dg_comm_t *c);

/* ---- explicit wait edges with a device stream (cudaStream_t as void*) ---- */

/* Operations posted after this call start only after the work already enqueued on `stream`
 * (nccl: event + cudaStreamWaitEvent on the comm stream; mpi: no-op, host data is ready when posted). */
dg_status_t dg_comm_begin_after(dg_comm_t *c, void *stream);
/* Makes `stream` wait for *req without blocking the host, and releases req (nccl: cudaStreamWaitEvent;
 * mpi: same as dg_comm_wait, since the data is on the host). */
dg_status_t dg_comm_stream_wait(dg_comm_t *c, dg_comm_req_t *req, void *stream);

/* ---- health ---- */

/* DG_OK, or the failure that made the comm unusable (NCCL async error via ncclCommGetAsyncError, an
 * MPI error in the communication thread, an earlier timeout), as DG_ERR_PEER with its message. Cheap;
 * any thread (the watchdog polls it). */
dg_status_t dg_comm_poll(dg_comm_t *c);
/* A health poll hook (dg_health_add_poll's signature, ctx = the dg_comm_t *): 0 while dg_comm_poll is
 * DG_OK (on nccl: ncclCommGetAsyncError says all is well); otherwise it marks the comm failed, writes
 * "communicator NAME (BACKEND) failed: REASON" into msg, aborts the backend (ncclCommAbort: a collective
 * stuck on it returns) and returns 1, and the watchdog ends the job with exit 3 on every rank naming this
 * rank and the reason. Any thread; cheap. */
int dg_comm_health_poll(void *ctx, char *msg, size_t cap);
/* One line about what the comm is doing, e.g. "dp_shard: allreduce #12 (4096 f32) running for 3.2 s,
 * 2 queued" or "dp_shard: idle after collective #12". Any thread. */
void dg_comm_state(dg_comm_t *c, char *buf, size_t cap); /* nccl: "NAME (nccl[, non-blocking]): ..." */
/* Ends the whole job: ncclCommAbort first (nccl), then MPI_Abort(MPI_COMM_WORLD, code), so every rank
 * exits with `code` (3 for a timeout or a failed peer). Log the reason before calling. Any thread. */
void dg_comm_abort(dg_comm_t *c, int code) __attribute__((noreturn));

#ifdef __cplusplus
}
#endif
#endif /* DG_COMM_H */
