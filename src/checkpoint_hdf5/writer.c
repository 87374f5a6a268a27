/* writer.c — asynchronous checkpoints: submit() copies the owned pieces into a reusable host snapshot
 * (the only time training stalls) and hands them to a background thread, which runs the ordinary
 * collective save on its own duplicate of the communicator. One write is in flight at a time; the
 * outcome is agreed across ranks inside the save, so wait() returns the same status everywhere. */
#include "ckpt_impl.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dg_mpi.h"

#define SNAP_BLOCK ((size_t)1 << 21) /* floats per copy block (8 MiB) */

struct dg_ckpt_writer {
    MPI_Comm comm; /* our own duplicate: the thread's collectives never mix with the caller's */
    int rank;
    char dir[4096];
    dg_ckpt_save_opts_t opts;
    char base[4096];
    pthread_t th;
    int th_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop, pending, ready;
    dg_ckpt_async_result_t result;
    /* the job: a private copy of everything save needs */
    dg_ckpt_meta_t meta;
    dg_ckpt_tensor_t *pieces;
    int n, pieces_cap;
    char *paths;
    size_t paths_cap;
    float *snap;
    size_t snap_cap; /* floats */
    double stall_ms, snapshot_ms;
    int threads; /* copy threads (opts.threads or automatic) */
};

/* ---- the snapshot buffer: allocated once and kept, faulted in ahead by several threads at once
 * (dg_ckpt_writer_reserve): faulting in and zeroing fresh pages cost 3-6x the copy itself on the
 * development VM, so a buffer faulted in during a submit multiplies that checkpoint's stall. Not
 * madvise(MADV_HUGEPAGE): with the usual defrag=madvise setting a fault may compact memory first, which
 * took 0.2-1.9 s for 640 MB there. ---- */

#define SNAP_ALIGN ((size_t)2 << 20)

typedef struct touch_job {
    char *p;
    size_t bytes;
} touch_job_t;

static void touch_block(void *ctx, size_t b) {
    touch_job_t *j = ctx;
    size_t lo = b * SNAP_BLOCK * sizeof(float), hi = lo + SNAP_BLOCK * sizeof(float);
    if (hi > j->bytes) hi = j->bytes;
    size_t page = 4096;
    for (size_t o = lo; o < hi; o += page)
        ((volatile char *)j->p)[o] = 0;
}

static dg_status_t snap_grow(dg_ckpt_writer_t *w, size_t floats, int prefault) {
    if (floats <= w->snap_cap) return DG_OK;
    free(w->snap);
    w->snap = NULL;
    w->snap_cap = 0;
    size_t bytes = (floats * sizeof(float) + SNAP_ALIGN - 1) / SNAP_ALIGN * SNAP_ALIGN;
    void *p = NULL;
    if (posix_memalign(&p, SNAP_ALIGN, bytes) != 0 || !p)
        return DG_ERR(DG_ERR_RUNTIME, "out of memory for the checkpoint snapshot (%.1f MB)",
                      (double)bytes / 1e6);
    w->snap = p;
    w->snap_cap = bytes / sizeof(float);
    if (prefault) {
        touch_job_t j = {p, bytes};
        size_t nb = (bytes + SNAP_BLOCK * sizeof(float) - 1) / (SNAP_BLOCK * sizeof(float));
        ckpt_parallel_for(w->threads, nb, touch_block, &j);
    }
    return DG_OK;
}

struct blk {
    const float *src;
    float *dst;
    size_t n;
};

static void copy_block(void *ctx, size_t b) {
    const struct blk *bl = ctx;
    memcpy(bl[b].dst, bl[b].src, bl[b].n * sizeof(float));
}

static void *writer_main(void *arg) {
    dg_ckpt_writer_t *w = arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->pending && !w->stop)
            pthread_cond_wait(&w->cv, &w->mu);
        if (!w->pending) break;
        pthread_mutex_unlock(&w->mu);
        dg_ckpt_save_result_t res;
        memset(&res, 0, sizeof res);
        ckpt_lock();
        dg_status_t s = ckpt_save_locked(w->comm, w->dir, &w->meta, w->pieces, w->n, &w->opts, &res);
        ckpt_unlock();
        char msg[1024] = "";
        if (s) {
            snprintf(msg, sizeof msg, "%s", dg_last_error());
            if (w->rank == 0)
                DG_LOG_WARN("asynchronous checkpoint of step %lld failed (LATEST unchanged): %s",
                             (long long)w->meta.step, msg);
        }
        pthread_mutex_lock(&w->mu);
        memset(&w->result, 0, sizeof w->result);
        w->result.valid = 1;
        w->result.status = s;
        snprintf(w->result.error, sizeof w->result.error, "%s", msg);
        w->result.res = res;
        w->result.res.step = w->meta.step;
        w->result.res.stall_ms = w->stall_ms;
        w->result.res.snapshot_ms = w->snapshot_ms;
        w->pending = 0;
        w->ready = 1;
        ckpt_inflight_add(-1);
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

dg_status_t dg_ckpt_writer_create(MPI_Comm comm, const char *ckpt_dir, const dg_ckpt_save_opts_t *opts,
                                  dg_ckpt_writer_t **out) {
    *out = NULL;
    int level = MPI_THREAD_SINGLE, inited = 0;
    DG_MPI_CHECK(MPI_Initialized(&inited));
    if (inited) DG_MPI_CHECK(MPI_Query_thread(&level));
    dg_status_t s = DG_OK;
    if (level != MPI_THREAD_MULTIPLE)
        s = DG_ERR(
            DG_ERR_RUNTIME,
            "asynchronous checkpoints need MPI_THREAD_MULTIPLE (MPI granted level %d); hint: initialise MPI "
            "with MPI_Init_thread(MPI_THREAD_MULTIPLE) or set checkpoint.async=false",
            level);
    else if (!ckpt_dir || !*ckpt_dir || strlen(ckpt_dir) >= 4000)
        s = DG_ERR(DG_ERR_USAGE, "checkpoint writer: empty or too long directory");
    DG_TRY(ckpt_agree(comm, s));
    dg_ckpt_writer_t *w = dg_xcalloc(1, sizeof *w);
    snprintf(w->dir, sizeof w->dir, "%s", ckpt_dir);
    if (opts)
        w->opts = *opts;
    else
        dg_ckpt_save_opts_default(&w->opts);
    if (w->opts.base) {
        snprintf(w->base, sizeof w->base, "%s", w->opts.base);
        w->opts.base = w->base;
    }
    dg_ckpt_meta_init(&w->meta);
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    int rc = MPI_Comm_dup(comm, &w->comm);
    if (rc != MPI_SUCCESS) {
        free(w);
        return DG_ERR(DG_ERR_RUNTIME, "MPI_Comm_dup for the checkpoint writer failed");
    }
    MPI_Comm_set_errhandler(w->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(w->comm, &w->rank);
    w->threads = ckpt_threads(w->comm, w->opts.threads);
    s = pthread_create(&w->th, NULL, writer_main, w) == 0
            ? DG_OK
            : DG_ERR(DG_ERR_RUNTIME, "cannot start the checkpoint writer thread");
    w->th_started = s == DG_OK;
    s = ckpt_agree(w->comm, s);
    if (s) {
        dg_ckpt_writer_free(w);
        return s;
    }
    *out = w;
    return DG_OK;
}

static void take_result(dg_ckpt_writer_t *w, dg_ckpt_async_result_t *out, const char *why) {
    if (!w->ready) {
        if (out) memset(out, 0, sizeof *out);
        return;
    }
    if (out)
        *out = w->result;
    else if (w->rank == 0 && w->result.status == DG_OK)
        DG_LOG_INFO("asynchronous checkpoint %s completed (%s)", w->result.res.path, why);
    w->ready = 0;
}

dg_status_t dg_ckpt_writer_reserve(dg_ckpt_writer_t *w, size_t bytes) {
    pthread_mutex_lock(&w->mu);
    while (w->pending) /* the thread reads the buffer while a write is in flight */
        pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
    return snap_grow(w, (bytes + sizeof(float) - 1) / sizeof(float), 1);
}

static dg_status_t submit(dg_ckpt_writer_t *w, const dg_ckpt_meta_t *meta, const dg_ckpt_tensor_t *t, int n,
                          int borrow, double t0, double *stall_ms, dg_ckpt_async_result_t *prev) {
    pthread_mutex_lock(&w->mu);
    while (w->pending)
        pthread_cond_wait(&w->cv, &w->mu);
    take_result(w, prev, "collected at the next submit");
    pthread_mutex_unlock(&w->mu);
    /* The thread is idle now, so this thread may use the writer's communicator. Every rank must submit
     * a valid job or none does: a lone submission would strand the others in the save. */
    ckpt_table_t tab;
    dg_status_t s = DG_OK;
    if (!meta) s = DG_ERR(DG_ERR_USAGE, "checkpoint submit: meta is NULL");
    if (!s)
        s = ckpt_table_build(t, n, 0, &tab);
    else
        memset(&tab, 0, sizeof tab);
    ckpt_table_free(&tab);
    DG_TRY(ckpt_agree(w->comm, s));

    size_t floats = 0, plen = 0;
    for (int i = 0; i < n; i++) {
        if (t[i].owner) floats += (size_t)ckpt_numel(t[i].ndim, t[i].count);
        plen += strlen(t[i].path) + 1;
    }
    /* no prefault here: the copy threads fault the pages in as they write them */
    DG_TRY(ckpt_agree(w->comm, borrow ? DG_OK : snap_grow(w, floats, 0)));
    if (plen > w->paths_cap) {
        free(w->paths);
        w->paths = dg_xmalloc(plen);
        w->paths_cap = plen;
    }
    if (n > w->pieces_cap) {
        free(w->pieces);
        w->pieces = dg_xmalloc((size_t)n * sizeof *w->pieces);
        w->pieces_cap = n;
    }
    size_t fo = 0, po = 0, nblk = 0;
    for (int i = 0; i < n; i++) {
        dg_ckpt_tensor_t *p = &w->pieces[i];
        *p = t[i];
        size_t l = strlen(t[i].path) + 1;
        memcpy(w->paths + po, t[i].path, l);
        p->path = w->paths + po;
        po += l;
        if (t[i].owner && borrow) {
            p->data = t[i].data; /* the caller's buffer: left alone until this write has finished */
        } else if (t[i].owner) {
            size_t k = (size_t)ckpt_numel(t[i].ndim, t[i].count);
            p->data = w->snap + fo;
            fo += k;
            nblk += (k + SNAP_BLOCK - 1) / SNAP_BLOCK;
        } else {
            p->data = NULL; /* replicas are not written */
        }
    }
    /* The copy is the stall: spread it in blocks over `threads` threads of our own (one thread cannot
     * saturate memory bandwidth; a gpt2-124m state is 1.5 GB; OpenMP's pool may be limited to one thread
     * per rank, as OMP_NUM_THREADS=1 runs are). */
    double t_copy = dg_now_s();
    struct blk *bl = dg_xmalloc((nblk ? nblk : 1) * sizeof *bl);
    size_t nb = 0;
    for (int i = 0; i < n && !borrow; i++) {
        if (!t[i].owner) continue;
        size_t k = (size_t)ckpt_numel(t[i].ndim, t[i].count);
        for (size_t o = 0; o < k; o += SNAP_BLOCK)
            bl[nb++] =
                (struct blk){t[i].data + o, w->pieces[i].data + o, k - o < SNAP_BLOCK ? k - o : SNAP_BLOCK};
    }
    ckpt_parallel_for(fo > 4 * SNAP_BLOCK ? w->threads : 1, nb, copy_block, bl);
    free(bl);
    w->snapshot_ms = (dg_now_s() - t_copy) * 1e3;
    w->n = n;
    char *cfg = w->meta.config_text;
    w->meta = *meta;
    w->meta.config_text = cfg;
    dg_ckpt_meta_set_config(&w->meta, meta->config_text);
    w->stall_ms = (dg_now_s() - t0) * 1e3;
    if (stall_ms) *stall_ms = w->stall_ms;
    ckpt_inflight_add(1);
    pthread_mutex_lock(&w->mu);
    w->pending = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return DG_OK;
}

dg_status_t dg_ckpt_writer_submit(dg_ckpt_writer_t *w, const dg_ckpt_meta_t *meta, const dg_ckpt_tensor_t *t,
                                  int n, double *stall_ms, dg_ckpt_async_result_t *prev) {
    return submit(w, meta, t, n, 0, dg_now_s(), stall_ms, prev);
}

dg_status_t dg_ckpt_writer_submit_borrowed(dg_ckpt_writer_t *w, const dg_ckpt_meta_t *meta,
                                           const dg_ckpt_tensor_t *t, int n, double t_start, double *stall_ms,
                                           dg_ckpt_async_result_t *prev) {
    return submit(w, meta, t, n, 1, t_start > 0 ? t_start : dg_now_s(), stall_ms, prev);
}

int dg_ckpt_writer_poll(dg_ckpt_writer_t *w, dg_ckpt_async_result_t *out) {
    pthread_mutex_lock(&w->mu);
    int r;
    if (w->pending)
        r = 0;
    else if (w->ready) {
        take_result(w, out, "polled");
        r = 1;
    } else
        r = -1;
    pthread_mutex_unlock(&w->mu);
    return r;
}

dg_status_t dg_ckpt_writer_wait(dg_ckpt_writer_t *w, dg_ckpt_async_result_t *out) {
    dg_ckpt_async_result_t tmp;
    if (!out) out = &tmp;
    pthread_mutex_lock(&w->mu);
    while (w->pending)
        pthread_cond_wait(&w->cv, &w->mu);
    take_result(w, out, "waited");
    pthread_mutex_unlock(&w->mu);
    if (!out->valid) return DG_OK;
    if (out->status != DG_OK) return DG_ERR(out->status, "%s", out->error);
    return DG_OK;
}

void dg_ckpt_writer_free(dg_ckpt_writer_t *w) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    while (w->pending)
        pthread_cond_wait(&w->cv, &w->mu);
    take_result(w, NULL, "at shutdown");
    w->stop = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    if (w->th_started) pthread_join(w->th, NULL);
    if (w->comm != MPI_COMM_NULL) MPI_Comm_free(&w->comm);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    dg_ckpt_meta_destroy(&w->meta);
    free(w->pieces), free(w->paths), free(w->snap);
    free(w);
}
