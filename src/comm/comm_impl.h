/* comm_impl.h — private to src/comm: the comm-backend vtable, the fields every backend shares (group
 * shape, timeouts, progress counters read by the arrival probe), the operation record behind a
 * dg_comm_req_t, and the helpers comm.c gives the backends (validation is done before a backend sees
 * an operation; timeouts and failures are reported through dg_comm__timeout / dg_comm__fail).
 */
#ifndef DG_COMM_IMPL_H
#define DG_COMM_IMPL_H

#include <pthread.h>
#include <stdatomic.h>

#include "comm.h"
#include "dg_mpi.h"

typedef enum {
    DG_OP_ALLGATHER = 0,
    DG_OP_REDUCE_SCATTER,
    DG_OP_ALLREDUCE,
    DG_OP_BROADCAST,
    DG_OP_BARRIER,
    DG_OP_SEND,
    DG_OP_RECV,
    DG_OP_NKINDS
} dg_op_kind_t;

enum { DG_OPST_QUEUED = 0, DG_OPST_STARTED = 1, DG_OPST_DONE = 2 };

/* The record behind a request. Backends own its life between post and the wait/test that releases it. */
struct dg_comm_req {
    dg_op_kind_t kind;
    const void *send;
    void *recv;   /* allreduce/allgather/reduce_scatter/recv output; broadcast/send buffer */
    size_t count; /* elements: per rank for allgather/reduce_scatter, else total */
    dg_dtype_t dt;
    dg_redop_t red;
    int peer; /* broadcast root, or send/recv peer */
    int tag;
    int inplace;
    int64_t seq;  /* collective sequence number in this group (1, 2, ...), 0 for point-to-point */
    int64_t step; /* dg_comm_set_step value when posted */
    double t_post, t_start;
    _Atomic int state; /* DG_OPST_* */
    int abandoned;     /* the waiter gave up (timeout/failure): whoever finishes the op frees it */
    dg_status_t status;
    char msg[640];
    struct dg_comm_req *next; /* backend queue links */
    struct dg_comm_req *prev;
    /* backend scratch */
    MPI_Request mreq;
    void *event; /* cudaEvent_t (nccl) */
};
typedef struct dg_comm_req dg_comm_op_t;

typedef struct dg_comm_vtbl {
    const char *name;
    /* start or enqueue a validated op (op->seq/step/t_post set); on failure the op is not retained */
    dg_status_t (*post)(dg_comm_t *c, dg_comm_op_t *op);
    dg_status_t (*wait)(dg_comm_t *c, dg_comm_op_t *op); /* releases op */
    /* optional, blocking collectives only: execute the numbered op (a caller-owned copy) right here and
     * set *ran, or leave *ran = 0 to have it posted and waited for */
    dg_status_t (*run_inline)(dg_comm_t *c, dg_comm_op_t *op, int *ran);
    dg_status_t (*test)(dg_comm_t *c, dg_comm_op_t *op, int *done);
    dg_status_t (*flush)(dg_comm_t *c);
    dg_status_t (*split)(dg_comm_t *parent, int color, int key, const dg_comm_opts_t *o, dg_comm_t **out);
    dg_status_t (*begin_after)(dg_comm_t *c, void *stream);
    dg_status_t (*stream_wait)(dg_comm_t *c, dg_comm_op_t *op, void *stream);
    void (*state)(dg_comm_t *c, char *buf, size_t cap); /* backend part of dg_comm_state */
    dg_status_t (*poll)(dg_comm_t *c);                  /* optional: active health check, any thread */
    void (*abort_backend)(dg_comm_t *c);                /* before MPI_Abort (ncclCommAbort) */
    void (*destroy)(dg_comm_t *c);                      /* frees backend and calls dg_comm__base_destroy */
} dg_comm_vtbl_t;

struct dg_comm {
    const dg_comm_vtbl_t *vt;
    dg_comm_kind_t kind;
    char name[64];
    int rank, size;
    int *world_ranks; /* group rank -> MPI_COMM_WORLD rank */
    dg_comm_opts_t opts;
    double spin_s;
    int thread_multiple;
    MPI_Comm ctl;   /* caller-thread control traffic: split, NCCL id broadcast */
    MPI_Comm probe; /* arrival side channel: responder thread + a timed-out waiter */
    int registered; /* with the responder */
    _Atomic int64_t step;
    /* progress, read by the responder and dg_comm_state from other threads */
    int64_t coll_posted;             /* owner thread only */
    _Atomic int64_t coll_started;    /* highest collective seq this rank has entered */
    _Atomic int64_t coll_done;       /* highest collective seq known complete */
    _Atomic int cur_kind;            /* kind of the running collective, -1 idle */
    _Atomic int64_t cur_start_ns;    /* when it started (monotonic ns) */
    _Atomic int queued;              /* posted, not yet started */
    _Atomic int64_t last_posted_seq; /* the newest collective posted here, for mismatch diagnostics */
    _Atomic int last_posted_kind;
    _Atomic int64_t last_posted_count;
    /* failure: set once, then every post fails with this message */
    pthread_mutex_t fail_mu;
    _Atomic int failed;
    char fail_msg[2048];
};

/* ---- helpers from comm.c ---- */
const char *dg_comm__op_name(dg_op_kind_t k);
int dg_comm__is_collective(dg_op_kind_t k);
int dg_comm__is_reduction(dg_op_kind_t k);
/* "allreduce on dp_shard (4096 x f32, collective #7)" */
void dg_comm__describe(const dg_comm_t *c, const dg_comm_op_t *op, char *buf, size_t cap);

/* Fills the shared fields, duplicates `group` into ctl and probe, registers with the responder. */
dg_status_t dg_comm__base_init(dg_comm_t *c, dg_comm_kind_t kind, MPI_Comm group, const dg_comm_opts_t *o);
void dg_comm__base_destroy(dg_comm_t *c); /* unregisters; frees MPI comms unless leak != 0 */
void dg_comm__base_destroy_leak(dg_comm_t *c);

/* Marks the comm failed with `msg` (first failure wins) and returns DG_ERR(code, msg). */
dg_status_t dg_comm__fail(dg_comm_t *c, dg_status_t code, const char *msg);
/* The failure recorded earlier, as a DG_ERR (DG_ERR_PEER). */
dg_status_t dg_comm__failed_error(dg_comm_t *c);
/* Builds the timeout message for `stuck` (the op that made no progress; `waited` is the one the caller
 * waited for, may equal stuck), asks the group who did not arrive, marks the comm failed and returns
 * DG_ERR(DG_ERR_PEER, ...). `stuck` is a copy owned by the caller. */
dg_status_t dg_comm__timeout(dg_comm_t *c, const dg_comm_op_t *stuck, const dg_comm_op_t *waited,
                             double waited_s);

/* bf16 <-> f32 (round to nearest even; NaN stays NaN) */
static inline float dg_comm__bf16_to_f32(uint16_t h) {
    union {
        uint32_t u;
        float f;
    } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}
static inline uint16_t dg_comm__f32_to_bf16(float f) {
    union {
        uint32_t u;
        float f;
    } v;
    v.f = f;
    if ((v.u & 0x7f800000u) == 0x7f800000u && (v.u & 0x007fffffu)) return (uint16_t)((v.u >> 16) | 0x40u);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}
/* A backend's doubly linked list of ops in flight (head, tail; op->prev / op->next): append at the tail,
 * unlink from anywhere (an op not in the list is only cleared). */
void dg_comm__list_append(dg_comm_op_t **head, dg_comm_op_t **tail, dg_comm_op_t *op);
void dg_comm__list_unlink(dg_comm_op_t **head, dg_comm_op_t **tail, dg_comm_op_t *op);
/* The end of a finished op: frees it and returns its status, leaving its message as the last error. */
dg_status_t dg_comm__op_release(dg_comm_op_t *op);
/* strlcpy: copies and truncates, always terminated */
void dg_comm__strlcpy(char *dst, size_t cap, const char *src);
/* In-place AVG epilogue on the host: x[i] /= n for n elements of dt. */
void dg_comm__host_divide(void *x, size_t n, dg_dtype_t dt, int divisor);

static inline int64_t dg_comm__now_ns(void) {
    return (int64_t)(dg_now_s() * 1e9);
}

/* backend constructors (comm_mpi.c, comm_nccl.c) */
dg_status_t dg_comm__mpi_create(MPI_Comm group, const dg_comm_opts_t *o, dg_comm_t **out);
#ifdef DG_HAVE_CUDA
dg_status_t dg_comm__nccl_create(MPI_Comm group, int cuda_device, void *cuda_stream, const dg_comm_opts_t *o,
                                 dg_comm_t **out);
#endif

#endif /* DG_COMM_IMPL_H */
