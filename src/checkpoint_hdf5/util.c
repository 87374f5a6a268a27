/* util.c — checkpoint plumbing: HDF5 error conversion, the process-wide HDF5 lock, handle cleanup,
 * property lists, attribute helpers, rank agreement, and the small file-system pieces of the commit
 * protocol (step names, LATEST, directory fsync). */
#define _GNU_SOURCE
#include "ckpt_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <malloc.h>
#include <pthread.h>
#include <stdarg.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dg_mpi.h"
#include "dg_env.h"

/* ---------------- HDF5 errors ---------------- */

typedef struct {
    char inner[512], outer[512], minor[128];
    int count;
} walk_t;

static herr_t walk_cb(unsigned n, const H5E_error2_t *e, void *data) {
    walk_t *w = data;
    (void)n;
    const char *d = e->desc ? e->desc : "";
    if (w->count == 0) {
        snprintf(w->inner, sizeof w->inner, "%s", d);
        char msg[128] = "";
        if (H5Eget_msg(e->min_num, NULL, msg, sizeof msg) > 0) snprintf(w->minor, sizeof w->minor, "%s", msg);
    }
    snprintf(w->outer, sizeof w->outer, "%s", d);
    w->count++;
    return 0;
}

void ckpt_h5_error_text(char *buf, size_t cap) {
    walk_t w;
    memset(&w, 0, sizeof w);
    H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, walk_cb, &w);
    H5Eclear2(H5E_DEFAULT);
    if (!w.count) {
        snprintf(buf, cap, "HDF5 reported a failure without details");
        return;
    }
    if (w.count > 1 && strcmp(w.inner, w.outer) != 0)
        snprintf(buf, cap, "%s (%s; %s)", w.inner, w.minor[0] ? w.minor : "HDF5", w.outer);
    else
        snprintf(buf, cap, "%s (%s)", w.inner, w.minor[0] ? w.minor : "HDF5");
}

dg_status_t ckpt_h5_fail(dg_status_t code, const char *src, int line, const char *call, const char *fmt,
                         ...) {
    char ctx[1024], h5[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx, sizeof ctx, fmt, ap);
    va_end(ap);
    ckpt_h5_error_text(h5, sizeof h5);
    const char *paren = strchr(call, '(');
    int fn = paren ? (int)(paren - call) : (int)strlen(call);
    return dg_error_at(code, src, line, "%s: %s [HDF5 %.*s]", ctx, h5, fn, call);
}

/* ---------------- lock ---------------- */

static pthread_mutex_t g_h5_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_h5_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_if_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_if_cv = PTHREAD_COND_INITIALIZER;
static int g_inflight;

static void h5_init_once(void) {
    H5open();
    /* Messages are converted into one dg error line each; HDF5's own stack dump would only add noise. */
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
#ifdef __GLIBC__
    /* HDF5 allocates and frees one buffer per chunk (and its Fletcher32 filter another). With glibc's
     * defaults those megabyte buffers are mmapped or trimmed away after every free, so every chunk
     * pays page faults and zeroing of fresh memory: measured at a third of the write time of a
     * gpt2-124m save. Serving them from a heap that keeps up to 512 MiB of freed memory removes that
     * (allocations of 32 MiB and more still use mmap). Process-wide; DG_CKPT_NO_MALLOPT=1 opts out. */
    if (!dg_env_bool("DG_CKPT_NO_MALLOPT")) {
        mallopt(M_MMAP_THRESHOLD, 32 << 20);
        mallopt(M_TRIM_THRESHOLD, 512 << 20);
    }
#endif
}

void ckpt_lock(void) {
    pthread_mutex_lock(&g_h5_mu);
    pthread_once(&g_h5_once, h5_init_once);
    H5Eclear2(H5E_DEFAULT);
}

void ckpt_unlock(void) {
    pthread_mutex_unlock(&g_h5_mu);
}

void ckpt_inflight_add(int delta) {
    pthread_mutex_lock(&g_if_mu);
    g_inflight += delta;
    DG_ASSERT(g_inflight >= 0);
    if (g_inflight == 0) pthread_cond_broadcast(&g_if_cv);
    pthread_mutex_unlock(&g_if_mu);
}

void ckpt_inflight_wait_zero(void) {
    pthread_mutex_lock(&g_if_mu);
    while (g_inflight > 0)
        pthread_cond_wait(&g_if_cv, &g_if_mu);
    pthread_mutex_unlock(&g_if_mu);
}

/* ---------------- progress, and the partial files of saves in flight ---------------- */

static _Atomic uint64_t g_progress;

void ckpt_progress_add(uint64_t n) {
    atomic_fetch_add_explicit(&g_progress, n, memory_order_relaxed);
}

uint64_t dg_ckpt_progress(void) {
    return atomic_load_explicit(&g_progress, memory_order_relaxed);
}

static atomic_int g_waiting;

void ckpt_waiting(int delta) {
    atomic_fetch_add_explicit(&g_waiting, delta, memory_order_relaxed);
}

int dg_ckpt_waiting(void) {
    return atomic_load_explicit(&g_waiting, memory_order_relaxed) > 0;
}

/* At most one synchronous and one background save run at a time (the HDF5 lock serialises them, but a
 * background save that waits for the lock has registered nothing yet): two slots are plenty. */
#define CKPT_PARTIAL_SLOTS 4
static pthread_mutex_t g_partial_mu = PTHREAD_MUTEX_INITIALIZER;
static char g_partial[CKPT_PARTIAL_SLOTS][4200];

void ckpt_partial_register(const char *path, int on) {
    pthread_mutex_lock(&g_partial_mu);
    for (int i = 0; i < CKPT_PARTIAL_SLOTS; i++) {
        if (on && !g_partial[i][0]) {
            snprintf(g_partial[i], sizeof g_partial[i], "%s", path);
            break;
        }
        if (!on && strcmp(g_partial[i], path) == 0) {
            g_partial[i][0] = 0;
            break;
        }
    }
    pthread_mutex_unlock(&g_partial_mu);
}

void dg_ckpt_abort_cleanup(void) {
    /* no lock wait: the caller may be ending the process while a save holds the mutex for a moment */
    if (pthread_mutex_trylock(&g_partial_mu) != 0) return;
    for (int i = 0; i < CKPT_PARTIAL_SLOTS; i++)
        if (g_partial[i][0] && unlink(g_partial[i]) == 0)
            DG_LOG_INFO("checkpoint: removed %s of the save in flight", g_partial[i]);
    pthread_mutex_unlock(&g_partial_mu);
}

/* ---------------- worker threads ---------------- */

typedef struct pfor {
    void (*fn)(void *ctx, size_t i);
    void *ctx;
    size_t n;
    atomic_size_t next;
} pfor_t;

static void *pfor_main(void *arg) {
    pfor_t *p = arg;
    for (size_t i; (i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed)) < p->n;)
        p->fn(p->ctx, i);
    return NULL;
}

void ckpt_parallel_for(int threads, size_t n, void (*fn)(void *ctx, size_t i), void *ctx) {
    pfor_t p = {fn, ctx, n, 0};
    if (threads > (int)n) threads = (int)n;
    if (threads > 64) threads = 64;
    pthread_t th[64];
    int started = 0;
    for (int k = 1; k < threads; k++)
        if (pthread_create(&th[started], NULL, pfor_main, &p) == 0) started++;
    pfor_main(&p);
    for (int k = 0; k < started; k++)
        pthread_join(th[k], NULL);
}

int ckpt_threads(MPI_Comm comm, int requested) {
    /* collective in every case, so that ranks taking different branches never strand each other */
    int local = 1;
    MPI_Comm node = MPI_COMM_NULL;
    if (comm != MPI_COMM_NULL &&
        MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
        MPI_Comm_size(node, &local);
        MPI_Comm_free(&node);
    }
    int n = requested;
    if (n <= 0) {
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        int mine = (int)online;
#ifdef __linux__
        cpu_set_t set;
        if (sched_getaffinity(0, sizeof set, &set) == 0) mine = CPU_COUNT(&set);
#endif
        /* bound to a subset: those cores are this rank's; unbound: share the node with its peers */
        n = mine < online ? mine : (int)(online / (local > 0 ? local : 1));
    }
    return n < 1 ? 1 : n > 16 ? 16 : n;
}

double ckpt_cpu_seconds(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
    return (double)ru.ru_utime.tv_sec + 1e-6 * (double)ru.ru_utime.tv_usec + (double)ru.ru_stime.tv_sec +
           1e-6 * (double)ru.ru_stime.tv_usec;
}

/* ---------------- handle bag ---------------- */

hid_t ckpt_hbag_add(ckpt_hbag_t *b, hid_t id) {
    if (id >= 0) {
        DG_ASSERTF(b->n < (int)(sizeof b->h / sizeof b->h[0]), "handle bag full");
        b->h[b->n++] = id;
    }
    return id;
}

void ckpt_hbag_close(ckpt_hbag_t *b) {
    for (int i = b->n - 1; i >= 0; i--) {
        hid_t id = b->h[i];
        switch (H5Iget_type(id)) {
        case H5I_FILE:
            H5Fclose(id);
            break;
        case H5I_GROUP:
        case H5I_DATASET:
            H5Oclose(id);
            break;
        case H5I_DATATYPE:
            H5Tclose(id);
            break;
        case H5I_DATASPACE:
            H5Sclose(id);
            break;
        case H5I_ATTR:
            H5Aclose(id);
            break;
        case H5I_GENPROP_LST:
            H5Pclose(id);
            break;
        default:
            break;
        }
    }
    b->n = 0;
}

/* ---------------- property lists ---------------- */

hid_t ckpt_fapl(MPI_Comm comm, int64_t align) {
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    if (fapl < 0) return fapl;
    if (comm != MPI_COMM_NULL) {
        /* Site tuning without a rebuild: DG_CKPT_MPIIO_HINTS="key=value,..." become MPI-IO hints (e.g.
         * romio_cb_write=disable, striping_factor=8 on Lustre). Unknown hints are ignored by MPI. */
        MPI_Info info = MPI_INFO_NULL;
        const char *ev = dg_env_str("DG_CKPT_MPIIO_HINTS");
        if (ev && *ev) {
            MPI_Info_create(&info);
            char buf[512];
            snprintf(buf, sizeof buf, "%s", ev);
            for (char *sv = NULL, *kv = strtok_r(buf, ",", &sv); kv; kv = strtok_r(NULL, ",", &sv)) {
                char *eq = strchr(kv, '=');
                if (eq) *eq = 0, MPI_Info_set(info, kv, eq + 1);
            }
        }
        herr_t fr = H5Pset_fapl_mpio(fapl, comm, info);
        if (info != MPI_INFO_NULL) MPI_Info_free(&info);
        if (fr < 0 || H5Pset_all_coll_metadata_ops(fapl, 1) < 0 || H5Pset_coll_metadata_write(fapl, 1) < 0) {
            H5Pclose(fapl);
            return -1;
        }
    }
    /* The 1.8 object header format lets large attributes (the config text) go to dense storage. */
    if (H5Pset_libver_bounds(fapl, H5F_LIBVER_V18, H5F_LIBVER_LATEST) < 0 ||
        H5Pset_file_locking(fapl, 0, 1) < 0) {
        H5Pclose(fapl);
        return -1;
    }
    if (align > 0 && H5Pset_alignment(fapl, (hsize_t)align, (hsize_t)align) < 0) {
        H5Pclose(fapl);
        return -1;
    }
    return fapl;
}

static herr_t deny_elink(const char *parent_file, const char *parent_group, const char *child_file,
                         const char *child_object, unsigned *acc_flags, hid_t fapl, void *op_data) {
    (void)parent_file, (void)parent_group, (void)child_file, (void)child_object, (void)acc_flags, (void)fapl;
    (void)op_data;
    return -1;
}

hid_t ckpt_lapl_noext(void) {
    hid_t lapl = H5Pcreate(H5P_LINK_ACCESS);
    if (lapl < 0) return lapl;
    if (H5Pset_elink_cb(lapl, deny_elink, NULL) < 0) {
        H5Pclose(lapl);
        return -1;
    }
    return lapl;
}

/* ---------------- attributes ---------------- */

static dg_status_t attr_put(hid_t obj, const char *name, hid_t type, hid_t space, const void *buf,
                            const char *where) {
    ckpt_hbag_t b = {0};
    dg_status_t s = DG_OK;
    if (H5Aexists(obj, name) > 0) H5Adelete(obj, name);
    hid_t a = ckpt_hbag_add(&b, H5Acreate2(obj, name, type, space, H5P_DEFAULT, H5P_DEFAULT));
    if (a < 0)
        s = ckpt_h5_fail(DG_ERR_RUNTIME, __FILE__, __LINE__, "H5Acreate2()", "%s: attribute %s", where, name);
    else if (H5Awrite(a, type, buf) < 0)
        s = ckpt_h5_fail(DG_ERR_RUNTIME, __FILE__, __LINE__, "H5Awrite()", "%s: attribute %s", where, name);
    ckpt_hbag_close(&b);
    return s;
}

static dg_status_t attr_put_scalar(hid_t obj, const char *name, hid_t type, const void *v,
                                   const char *where) {
    hid_t sp = H5Screate(H5S_SCALAR);
    if (sp < 0) return ckpt_h5_fail(DG_ERR_RUNTIME, __FILE__, __LINE__, "H5Screate()", "%s", where);
    dg_status_t s = attr_put(obj, name, type, sp, v, where);
    H5Sclose(sp);
    return s;
}

dg_status_t ckpt_attr_put_str(hid_t obj, const char *name, const char *value, const char *where) {
    /* Variable-length UTF-8: h5py returns a str, h5dump prints the text. */
    hid_t t = H5Tcopy(H5T_C_S1);
    if (t < 0) return ckpt_h5_fail(DG_ERR_RUNTIME, __FILE__, __LINE__, "H5Tcopy()", "%s", where);
    H5Tset_size(t, H5T_VARIABLE);
    H5Tset_cset(t, H5T_CSET_UTF8);
    const char *v = value ? value : "";
    dg_status_t s = attr_put_scalar(obj, name, t, &v, where);
    H5Tclose(t);
    return s;
}

dg_status_t ckpt_attr_put_i64(hid_t obj, const char *name, int64_t v, const char *where) {
    return attr_put_scalar(obj, name, H5T_NATIVE_INT64, &v, where);
}
dg_status_t ckpt_attr_put_u64(hid_t obj, const char *name, uint64_t v, const char *where) {
    return attr_put_scalar(obj, name, H5T_NATIVE_UINT64, &v, where);
}
dg_status_t ckpt_attr_put_f64(hid_t obj, const char *name, double v, const char *where) {
    return attr_put_scalar(obj, name, H5T_NATIVE_DOUBLE, &v, where);
}
dg_status_t ckpt_attr_put_u64v(hid_t obj, const char *name, const uint64_t *v, int n, const char *where) {
    hsize_t dims[1] = {(hsize_t)n};
    hid_t sp = H5Screate_simple(1, dims, NULL);
    if (sp < 0) return ckpt_h5_fail(DG_ERR_RUNTIME, __FILE__, __LINE__, "H5Screate_simple()", "%s", where);
    dg_status_t s = attr_put(obj, name, H5T_NATIVE_UINT64, sp, v, where);
    H5Sclose(sp);
    return s;
}

int ckpt_attr_exists(hid_t obj, const char *name) {
    htri_t e = H5Aexists(obj, name);
    if (e < 0) H5Eclear2(H5E_DEFAULT);
    return e > 0;
}

/* Open attribute `name`, check its type class and element count. */
static dg_status_t attr_open(hid_t obj, const char *name, H5T_class_t cls, hssize_t want_n, hid_t *a_out,
                             hssize_t *n_out, const char *where, ckpt_hbag_t *b) {
    if (!ckpt_attr_exists(obj, name))
        return DG_ERR(DG_ERR_USAGE, "%s: attribute '%s' is missing", where, name);
    hid_t a = ckpt_hbag_add(b, H5Aopen(obj, name, H5P_DEFAULT));
    if (a < 0)
        return ckpt_h5_fail(DG_ERR_USAGE, __FILE__, __LINE__, "H5Aopen()", "%s: attribute %s", where, name);
    hid_t t = ckpt_hbag_add(b, H5Aget_type(a));
    hid_t sp = ckpt_hbag_add(b, H5Aget_space(a));
    if (t < 0 || sp < 0)
        return ckpt_h5_fail(DG_ERR_USAGE, __FILE__, __LINE__, "H5Aget_type()", "%s: attribute %s", where,
                            name);
    hssize_t n = H5Sget_simple_extent_npoints(sp);
    if (H5Tget_class(t) != cls || n < 0 || (want_n >= 0 && n != want_n))
        return DG_ERR(DG_ERR_USAGE, "%s: attribute '%s' has an unexpected type or size", where, name);
    *a_out = a;
    if (n_out) *n_out = n;
    return DG_OK;
}

dg_status_t ckpt_attr_get_str_alloc(hid_t obj, const char *name, char **out, const char *where) {
    ckpt_hbag_t b = {0};
    hid_t a = -1;
    *out = NULL;
    dg_status_t s = attr_open(obj, name, H5T_STRING, 1, &a, NULL, where, &b);
    if (s) {
        ckpt_hbag_close(&b);
        return s;
    }
    hid_t ft = ckpt_hbag_add(&b, H5Aget_type(a));
    if (H5Tis_variable_str(ft) > 0) {
        hid_t mt = ckpt_hbag_add(&b, H5Tcopy(H5T_C_S1));
        H5Tset_size(mt, H5T_VARIABLE);
        H5Tset_cset(mt, H5Tget_cset(ft));
        char *v = NULL;
        if (H5Aread(a, mt, &v) < 0) {
            s = ckpt_h5_fail(DG_ERR_USAGE, __FILE__, __LINE__, "H5Aread()", "%s: attribute %s", where, name);
        } else {
            *out = dg_xstrdup(v ? v : "");
            hid_t sp = ckpt_hbag_add(&b, H5Screate(H5S_SCALAR));
            H5Dvlen_reclaim(mt, sp, H5P_DEFAULT, &v);
        }
    } else {
        size_t sz = H5Tget_size(ft);
        char *v = dg_xcalloc(sz + 1, 1);
        hid_t mt = ckpt_hbag_add(&b, H5Tcopy(H5T_C_S1));
        H5Tset_size(mt, sz + 1);
        if (H5Aread(a, mt, v) < 0) {
            free(v);
            s = ckpt_h5_fail(DG_ERR_USAGE, __FILE__, __LINE__, "H5Aread()", "%s: attribute %s", where, name);
        } else {
            *out = v;
        }
    }
    ckpt_hbag_close(&b);
    return s;
}

dg_status_t ckpt_attr_get_str(hid_t obj, const char *name, char *buf, size_t cap, const char *where) {
    char *v = NULL;
    DG_TRY(ckpt_attr_get_str_alloc(obj, name, &v, where));
    if (strlen(v) >= cap) {
        free(v);
        return DG_ERR(DG_ERR_USAGE, "%s: attribute '%s' is longer than %zu bytes", where, name, cap - 1);
    }
    strcpy(buf, v);
    free(v);
    return DG_OK;
}

static dg_status_t attr_get_num(hid_t obj, const char *name, H5T_class_t cls, hid_t mt, void *v,
                                const char *where) {
    ckpt_hbag_t b = {0};
    hid_t a = -1;
    dg_status_t s = attr_open(obj, name, cls, 1, &a, NULL, where, &b);
    if (!s && H5Aread(a, mt, v) < 0)
        s = ckpt_h5_fail(DG_ERR_USAGE, __FILE__, __LINE__, "H5Aread()", "%s: attribute %s", where, name);
    ckpt_hbag_close(&b);
    return s;
}

dg_status_t ckpt_attr_get_i64(hid_t obj, const char *name, int64_t *v, const char *where) {
    return attr_get_num(obj, name, H5T_INTEGER, H5T_NATIVE_INT64, v, where);
}
dg_status_t ckpt_attr_get_u64(hid_t obj, const char *name, uint64_t *v, const char *where) {
    /* A signed attribute (h5py writes Python ints as int64) is read as such, so that a negative value
     * arrives as its two's complement (> 2^63 - 1, which the content checks refuse) instead of being
     * clipped to 0 by HDF5's conversion. */
    ckpt_hbag_t b = {0};
    hid_t a = -1;
    dg_status_t s = attr_open(obj, name, H5T_INTEGER, 1, &a, NULL, where, &b);
    hid_t ft = s ? -1 : ckpt_hbag_add(&b, H5Aget_type(a));
    int is_signed = ft >= 0 && H5Tget_sign(ft) == H5T_SGN_2;
    int64_t sv = 0;
    if (!s && H5Aread(a, is_signed ? H5T_NATIVE_INT64 : H5T_NATIVE_UINT64, is_signed ? (void *)&sv : v) < 0)
        s = ckpt_h5_fail(DG_ERR_USAGE, __FILE__, __LINE__, "H5Aread()", "%s: attribute %s", where, name);
    if (!s && is_signed) *v = (uint64_t)sv;
    ckpt_hbag_close(&b);
    return s;
}
dg_status_t ckpt_attr_get_f64(hid_t obj, const char *name, double *v, const char *where) {
    return attr_get_num(obj, name, H5T_FLOAT, H5T_NATIVE_DOUBLE, v, where);
}

dg_status_t ckpt_attr_get_u64v(hid_t obj, const char *name, uint64_t *v, int cap, int *n, const char *where) {
    ckpt_hbag_t b = {0};
    hid_t a = -1;
    hssize_t cnt = 0;
    dg_status_t s = attr_open(obj, name, H5T_INTEGER, -1, &a, &cnt, where, &b);
    if (!s && cnt > cap)
        s = DG_ERR(DG_ERR_USAGE, "%s: attribute '%s' has %lld values, at most %d expected", where, name,
                   (long long)cnt, cap);
    if (!s && cnt > 0 && H5Aread(a, H5T_NATIVE_UINT64, v) < 0)
        s = ckpt_h5_fail(DG_ERR_USAGE, __FILE__, __LINE__, "H5Aread()", "%s: attribute %s", where, name);
    if (!s) *n = (int)cnt;
    ckpt_hbag_close(&b);
    return s;
}

/* ---------------- agreement ---------------- */

dg_status_t ckpt_agree(MPI_Comm comm, dg_status_t local) {
    ckpt_progress_add(1); /* reaching an agreement point is progress; so is leaving it (below) */
    int rank, size;
    DG_MPI_CHECK(MPI_Comm_rank(comm, &rank));
    DG_MPI_CHECK(MPI_Comm_size(comm, &size));
    int mine = local != DG_OK ? rank : size, first = size;
    ckpt_waiting(1);
    int rc = MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm);
    ckpt_waiting(-1);
    DG_MPI_CHECK(rc);
    ckpt_progress_add(1);
    if (first == size) return DG_OK;
    return ckpt_bcast_status(comm, first, local);
}

dg_status_t ckpt_bcast_status(MPI_Comm comm, int root, dg_status_t s) {
    int rank, size;
    DG_MPI_CHECK(MPI_Comm_rank(comm, &rank));
    DG_MPI_CHECK(MPI_Comm_size(comm, &size));
    struct {
        int code;
        char msg[2000];
    } pkt;
    memset(&pkt, 0, sizeof pkt);
    if (rank == root) {
        pkt.code = s;
        if (s != DG_OK) {
            char pfx[32];
            snprintf(pfx, sizeof pfx, "rank %d: ", root);
            /* a status agreed before and agreed again keeps one prefix */
            if (size > 1 && strncmp(dg_last_error(), pfx, strlen(pfx)) != 0)
                snprintf(pkt.msg, sizeof pkt.msg, "rank %d: %s", root, dg_last_error());
            else
                snprintf(pkt.msg, sizeof pkt.msg, "%s", dg_last_error());
        }
    }
    ckpt_waiting(1);
    int rc = MPI_Bcast(&pkt, (int)sizeof pkt, MPI_BYTE, root, comm);
    ckpt_waiting(-1);
    DG_MPI_CHECK(rc);
    ckpt_progress_add(1);
    if (pkt.code == DG_OK) return DG_OK;
    return DG_ERR(pkt.code, "%s", pkt.msg);
}

/* ---------------- names, directories ---------------- */

void ckpt_step_name(int64_t step, char *buf, size_t cap) {
    dg_fmt(buf, cap, "step_%08lld.h5", (long long)step);
}

int64_t ckpt_parse_name(const char *name, int *partial) {
    if (strncmp(name, "step_", 5) != 0) return -1;
    const char *p = name + 5;
    int64_t v = 0;
    int nd = 0;
    while (*p >= '0' && *p <= '9') {
        if (v > (INT64_MAX - 9) / 10) return -1;
        v = v * 10 + (*p - '0');
        p++;
        nd++;
    }
    if (nd == 0) return -1;
    if (strcmp(p, ".h5") == 0) {
        if (partial) *partial = 0;
        return v;
    }
    if (strcmp(p, ".h5.partial") == 0) {
        if (partial) *partial = 1;
        return v;
    }
    return -1;
}

dg_status_t ckpt_fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0)
        return DG_ERR(DG_ERR_RUNTIME, "cannot open directory %s to fsync it: %s", dir, strerror(errno));
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    /* Some file systems do not support fsync on directories; that is not a failure of ours. */
    if (rc != 0 && e != EINVAL && e != ENOTSUP)
        return DG_ERR(DG_ERR_RUNTIME, "fsync of directory %s: %s", dir, strerror(e));
    return DG_OK;
}

dg_status_t ckpt_latest_prepare(const char *dir, const char *name, char *tmp, size_t cap) {
    char line[300];
    snprintf(tmp, cap, "%s/LATEST.tmp.%d", dir, (int)getpid());
    int len = snprintf(line, sizeof line, "%s\n", name);
    /* 0666 so that the user's umask decides; group/other write is never added by us. O_EXCL|O_NOFOLLOW:
     * a link planted at the temporary name is removed, never followed (docs/reliability.md). */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0666);
    if (fd < 0 && errno == EEXIST && unlink(tmp) == 0)
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0666);
    if (fd < 0) return DG_ERR(DG_ERR_RUNTIME, "cannot create %s: %s", tmp, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) == 0 && (st.st_mode & S_IWOTH)) fchmod(fd, st.st_mode & 07775);
    if (write(fd, line, (size_t)len) != len || fsync(fd) != 0) {
        int e = errno;
        close(fd);
        unlink(tmp);
        return DG_ERR(DG_ERR_RUNTIME, "cannot write %s: %s", tmp, strerror(e));
    }
    close(fd);
    return DG_OK;
}

dg_status_t ckpt_latest_publish(const char *dir, const char *tmp) {
    char dst[4200];
    snprintf(dst, sizeof dst, "%s/LATEST", dir);
    if (rename(tmp, dst) != 0) {
        int e = errno;
        unlink(tmp);
        return DG_ERR(DG_ERR_RUNTIME, "cannot rename %s to %s: %s", tmp, dst, strerror(e));
    }
    return ckpt_fsync_dir(dir);
}

dg_status_t ckpt_write_latest(const char *dir, const char *name) {
    char tmp[4200];
    DG_TRY(ckpt_latest_prepare(dir, name, tmp, sizeof tmp));
    return ckpt_latest_publish(dir, tmp);
}

dg_status_t ckpt_read_latest(const char *dir, char *name, size_t cap) {
    char path[4200];
    snprintf(path, sizeof path, "%s/LATEST", dir);
    name[0] = 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        if (errno == ENOENT) return DG_OK;
        return DG_ERR(DG_ERR_USAGE, "cannot read %s: %s", path, strerror(errno));
    }
    char line[512];
    size_t got = fread(line, 1, sizeof line - 1, f);
    fclose(f);
    line[got] = 0;
    char *nl = strchr(line, '\n');
    if (nl) *nl = 0;
    int partial = 0;
    if (ckpt_parse_name(line, &partial) < 0 || partial || strlen(line) >= cap)
        return DG_ERR(DG_ERR_USAGE,
                      "%s does not name a checkpoint file (expected a line like step_00000100.h5)", path);
    strcpy(name, line);
    return DG_OK;
}

void ckpt_dirname(const char *path, char *buf, size_t cap) {
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(buf, cap, ".");
    else if (slash == path)
        snprintf(buf, cap, "/");
    else
        snprintf(buf, cap, "%.*s", (int)(slash - path), path);
}

const char *ckpt_basename(const char *path) {
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

/* "<phase>[@rank]" (rank 0 when left out) names this phase on this rank */
static int test_hook_hits(const char *v, const char *phase, int rank) {
    if (!v || !*v) return 0;
    char want[64];
    int want_rank = 0;
    const char *at = strchr(v, '@');
    snprintf(want, sizeof want, "%.*s", at ? (int)(at - v) : (int)strlen(v), v);
    if (at) want_rank = atoi(at + 1);
    return strcmp(want, phase) == 0 && rank == want_rank;
}

void ckpt_test_stall(const char *phase, int rank) {
    const char *v = dg_env_str("DG_TEST_CKPT_STALL");
    if (!v || !*v) return;
    /* "<phase>[@rank][:N]": the N-th time (default 1) this process reaches the phase */
    char spec[96];
    snprintf(spec, sizeof spec, "%s", v);
    char *colon = strchr(spec, ':');
    long nth = 1;
    if (colon) *colon = 0, nth = atol(colon + 1);
    if (!test_hook_hits(spec, phase, rank)) return;
    static atomic_long hits;
    if (atomic_fetch_add(&hits, 1) + 1 != nth) return;
    DG_LOG_WARN("test hook DG_TEST_CKPT_STALL=%s: rank %d hangs at checkpoint phase '%s' forever", v, rank,
                phase);
    for (;;)
        sleep(1);
}

int ckpt_test_throttle_ms(int rank) {
    const char *v = dg_env_str("DG_TEST_CKPT_THROTTLE_MS");
    if (!v || !*v) return 0;
    const char *at = strchr(v, '@');
    if (at && atoi(at + 1) != rank) return 0;
    int ms = atoi(v);
    return ms > 0 ? ms : 0;
}

dg_status_t ckpt_test_fail(const char *phase, int rank) {
    if (test_hook_hits(dg_env_str("DG_TEST_CKPT_KILL"), phase, rank)) {
        fprintf(stderr, "DG_TEST_CKPT_KILL: rank %d kills itself at checkpoint phase '%s'\n", rank, phase);
        fflush(stderr);
        raise(SIGKILL);
    }
    const char *v = dg_env_str("DG_TEST_CKPT_FAIL");
    if (!test_hook_hits(v, phase, rank)) return DG_OK;
    return DG_ERR(DG_ERR_RUNTIME, "injected failure at phase '%s' (DG_TEST_CKPT_FAIL=%s)", phase, v);
}

void dg_ckpt_shape_str(int ndim, const int64_t *shape, char *buf, size_t cap) {
    size_t o = 0;
    o += (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && o < cap; d++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
}

int dg_ckpt_shape_differs(int na, const int64_t *a, int nb, const int64_t *b) {
    if (na != nb) return 1;
    for (int d = 0; d < na; d++)
        if (a[d] != b[d]) return 1;
    return 0;
}
