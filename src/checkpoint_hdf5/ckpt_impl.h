/* ckpt_impl.h — private plumbing of the checkpoint module: the HDF5 check macro and error conversion,
 * the process-wide HDF5 lock, handle cleanup, attribute helpers, the tensor table shared by save and
 * load, rank agreement, the decomposition-independent content hash, and link-following file sets. */
#ifndef DG_CKPT_IMPL_H
#define DG_CKPT_IMPL_H

#include <hdf5.h>
#include <mpi.h>
#include <stdint.h>

#include "checkpoint.h"

/* ---------------- HDF5 errors ---------------- */

/* The status a failing HDF5 call turns into. A translation unit that reads files (where a failure
 * means a damaged or foreign file) defines it as DG_ERR_USAGE before including this header. */
#ifndef DG_H5_FAIL_CODE
#define DG_H5_FAIL_CODE DG_ERR_RUNTIME
#endif

/* Record "<context>: <HDF5's innermost message> (HDF5 `call`)" from the HDF5 error stack (which is
 * then cleared) and return `code`. */
dg_status_t ckpt_h5_fail(dg_status_t code, const char *src, int line, const char *call, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* The one HDF5 check macro: evaluates `call` once; a negative result (hid_t, herr_t, htri_t) returns
 * DG_H5_FAIL_CODE with the context printf-formatted from the remaining arguments (name the file and
 * dataset). Release handles through a ckpt_hbag_t so that an early return leaks nothing. */
#define DG_H5_CHECK(call, ...)                                                                               \
    do {                                                                                                     \
        if ((call) < 0) return ckpt_h5_fail(DG_H5_FAIL_CODE, __FILE__, __LINE__, #call, __VA_ARGS__);        \
    } while (0)

/* HDF5's error stack as one line (innermost message first); clears the stack. */
void ckpt_h5_error_text(char *buf, size_t cap);

/* ---------------- the process-wide HDF5 lock ---------------- */

/* Debian's HDF5 is not thread-safe: every HDF5 call of this module happens between lock/unlock.
 * ckpt_lock also silences HDF5's automatic error printing once. */
void ckpt_lock(void);
void ckpt_unlock(void);
/* Background writes in flight in this process; a synchronous save waits for them so that commits
 * (and LATEST) stay in submission order. */
void ckpt_inflight_add(int delta);
void ckpt_inflight_wait_zero(void);

/* ---------------- progress and saves in flight ---------------- */

/* Add to dg_ckpt_progress(): bytes written, read, hashed or flushed, or 1 per agreement point. */
void ckpt_progress_add(uint64_t n);
/* +1 when a thread starts waiting in a collective of a save or load, -1 when it is done (dg_ckpt_waiting). */
void ckpt_waiting(int delta);
/* Remember (on = 1) or forget (on = 0) the .partial file of a save in flight, for dg_ckpt_abort_cleanup. */
void ckpt_partial_register(const char *path, int on);

/* ---------------- worker threads ---------------- */

/* Run fn(ctx, i) for every i in [0, n) on up to `threads` threads, the caller being one of them; items
 * are taken in order from a shared counter. Threads are started per call (a call does tens of
 * milliseconds of work or more); if one cannot be started the others do its share. fn must not call
 * HDF5 or MPI. */
void ckpt_parallel_for(int threads, size_t n, void (*fn)(void *ctx, size_t i), void *ctx);
/* Collective over comm: the worker threads per rank. requested > 0 is taken as is; else
 * the CPUs this rank may run on, divided by the ranks of comm on this node when
 * the rank is not bound to a subset; 1..16. */
int ckpt_threads(MPI_Comm comm, int requested);
/* CPU seconds used by this process so far (user + system, all threads). */
double ckpt_cpu_seconds(void);

/* ---------------- handle bag ---------------- */

typedef struct ckpt_hbag {
    hid_t h[32];
    int n;
} ckpt_hbag_t;
/* Remember `id` (if valid) for closing; returns it unchanged. */
hid_t ckpt_hbag_add(ckpt_hbag_t *b, hid_t id);
/* Close every handle, newest first, each with the close call of its kind. */
void ckpt_hbag_close(ckpt_hbag_t *b);

/* ---------------- property lists ---------------- */

/* File access: MPI-IO on comm with collective metadata (comm != MPI_COMM_NULL) or the serial POSIX
 * driver; file locking off (the commit protocol makes final files immutable, and locks break on NFS
 * and Lustre); alignment of large objects (align <= 0: none). */
hid_t ckpt_fapl(MPI_Comm comm, int64_t align);
/* Link access that refuses every automatic external-link traversal: links are followed explicitly. */
hid_t ckpt_lapl_noext(void);

/* ---------------- attributes ---------------- */

dg_status_t ckpt_attr_put_str(hid_t obj, const char *name, const char *value, const char *where);
dg_status_t ckpt_attr_put_i64(hid_t obj, const char *name, int64_t v, const char *where);
dg_status_t ckpt_attr_put_u64(hid_t obj, const char *name, uint64_t v, const char *where);
dg_status_t ckpt_attr_put_f64(hid_t obj, const char *name, double v, const char *where);
dg_status_t ckpt_attr_put_u64v(hid_t obj, const char *name, const uint64_t *v, int n, const char *where);
/* Readers: DG_ERR_USAGE naming `where` and the attribute when missing or of the wrong kind. */
dg_status_t ckpt_attr_get_str(hid_t obj, const char *name, char *buf, size_t cap, const char *where);
dg_status_t ckpt_attr_get_str_alloc(hid_t obj, const char *name, char **out, const char *where);
dg_status_t ckpt_attr_get_i64(hid_t obj, const char *name, int64_t *v, const char *where);
dg_status_t ckpt_attr_get_u64(hid_t obj, const char *name, uint64_t *v, const char *where);
dg_status_t ckpt_attr_get_f64(hid_t obj, const char *name, double *v, const char *where);
dg_status_t ckpt_attr_get_u64v(hid_t obj, const char *name, uint64_t *v, int cap, int *n, const char *where);
int ckpt_attr_exists(hid_t obj, const char *name);

/* ---------------- meta <-> file ---------------- */

#define CKPT_HASH_ALGO "xxh3-tile1024-sum-v1"
/* Write / read the root attributes and the /state group. `file` names the file in messages. */
dg_status_t ckpt_meta_write(hid_t fid, const dg_ckpt_meta_t *m, int world, const char *base,
                            const char *bases, const char *file);
dg_status_t ckpt_meta_read(hid_t fid, dg_ckpt_meta_t *m, char *base, size_t base_cap, char *bases,
                           size_t bases_cap, const char *file);
/* Pack rank 0's meta and broadcast it (config text included) so every rank writes the same bytes. */
dg_status_t ckpt_meta_bcast(MPI_Comm comm, const dg_ckpt_meta_t *in, dg_ckpt_meta_t *out);

#define CKPT_MAX_VIOLATIONS DG_CKPT_MAX_VIOLATIONS

/* ---------------- manifest ---------------- */

typedef struct ckpt_mrow {
    char path[DG_CKPT_MAX_PATH + 1];
    int32_t ndim;
    int64_t shape[DG_CKPT_MAX_NDIM];
    uint64_t hash;
    char origin[256];
} ckpt_mrow_t;
hid_t ckpt_mrow_type(void); /* the compound type (memory and file) */
/* Read /manifest of an open file (any driver; independent read). *rows is malloc'd. */
dg_status_t ckpt_manifest_read(hid_t fid, ckpt_mrow_t **rows, int *n, const char *file);

/* ---------------- tensor table ---------------- */

typedef struct ckpt_tdesc {
    const char *path;
    int ndim;
    int64_t gshape[DG_CKPT_MAX_NDIM];
    int64_t numel;
    int npieces;   /* this rank's pieces */
    int *pieces;   /* indices into the caller's array */
    int maxpieces; /* max over ranks (after agree) */
    uint64_t hash; /* content hash (after hashing) */
} ckpt_tdesc_t;

typedef struct ckpt_table {
    int n;
    ckpt_tdesc_t *t;
    int *piece_idx; /* storage for every tdesc's pieces */
} ckpt_table_t;

/* Validate the pieces locally and group them by path in order of first appearance.
 * for_load: data must be non-NULL for every non-empty piece (save: only for owned ones). */
dg_status_t ckpt_table_build(const dg_ckpt_tensor_t *t, int n, int for_load, ckpt_table_t *tab);
/* Collective: all ranks list the same tensors; owned pieces cover each tensor exactly once by count;
 * fills maxpieces. Agreed status. */
dg_status_t ckpt_table_agree(MPI_Comm comm, const dg_ckpt_tensor_t *t, ckpt_table_t *tab);
void ckpt_table_free(ckpt_table_t *tab);
int64_t ckpt_numel(int ndim, const int64_t *shape);
/* Collective: content hash of every tensor from the owned pieces -> tab->t[i].hash, the local part on
 * `threads` threads (same result for any count). Agreed status. */
dg_status_t ckpt_table_hash(MPI_Comm comm, const dg_ckpt_tensor_t *t, ckpt_table_t *tab, int threads);

/* ---------------- content hash ----------------
 * A tensor is seen as rows of its last dimension (C elements; one row for 1-D). Each row is cut into
 * tiles of CKH_TILE elements (the last may be shorter); tile t of row r hashes as
 * XXH3_64bits_withSeed(bytes, 4*len, r*T + t) with T = ceil(C / CKH_TILE). The tile hashes are summed
 * (mod 2^64), and the final value is XXH3_64bits_withSeed(le64[ndim, dims...], sum). Because the sum is
 * order-free, any decomposition gives the same value: tiles wholly inside one piece are hashed there;
 * tiles split between pieces are assembled from their fragments first. */
#define CKH_TILE 1024
typedef struct ckh {
    int n;
    uint64_t *sum;
    char *frag;
    size_t frag_len, frag_cap;
} ckh_t;
void ckh_init(ckh_t *h, int ntensors);
void ckh_free(ckh_t *h);
void ckh_add(ckh_t *h, int ti, int ndim, const int64_t *gshape, const int64_t *start, const int64_t *count,
             const float *data);
/* Add ckh_t `src` (same tensor count) into `dst`: sums and fragments; src is left empty. */
void ckh_merge(ckh_t *dst, ckh_t *src);
/* Assemble the fragments (after exchanging them over comm when comm != MPI_COMM_NULL) and write each
 * tensor's final hash to out[i]. `tab` gives the shapes and names. Agreed status when comm given. */
dg_status_t ckh_finish(ckh_t *h, MPI_Comm comm, const ckpt_table_t *tab, uint64_t *out);
uint64_t ckh_final(uint64_t sum, int ndim, const int64_t *gshape);

/* ---------------- agreement ---------------- */

/* Collective: every rank passes its local status (message in dg_last_error()); returns on every rank
 * the status and message of the lowest failing rank ("rank R: " prefixed when size > 1). */
dg_status_t ckpt_agree(MPI_Comm comm, dg_status_t local);
/* Broadcast a status + message decided on `root` (e.g. after a rank-0-only commit). */
dg_status_t ckpt_bcast_status(MPI_Comm comm, int root, dg_status_t s);

/* ---------------- files and links ---------------- */

#define CKPT_MAX_FILES 64
/* The files opened while reading one checkpoint: the main one and the bases its links lead to. All
 * live in `dir`; further files are opened with `fapl` (MPI-IO for a collective load). */
typedef struct ckpt_files {
    char dir[4096];     /* directory of the main file, as given */
    char realdir[4096]; /* its realpath */
    hid_t fapl, lapl;
    int n;
    char name[CKPT_MAX_FILES][256];
    hid_t fid[CKPT_MAX_FILES];
} ckpt_files_t;
/* Open `path` read-only as the main file (index 0). Checks existence, HDF5-ness and format attributes
 * with clear messages. */
dg_status_t ckpt_files_open(ckpt_files_t *fs, const char *path, MPI_Comm comm);
void ckpt_files_close(ckpt_files_t *fs);
/* Find dataset `dpath` starting in the main file, following external links (only to files of the same
 * directory, at most 16 hops, no loops). *dset is an open dataset; *file_idx the file holding it. */
dg_status_t ckpt_resolve(ckpt_files_t *fs, const char *dpath, hid_t *dset, int *file_idx);
/* Check the dataset is fp32 with shape (ndim, shape). */
dg_status_t ckpt_check_dataset(hid_t dset, int ndim, const int64_t *shape, const char *where);
/* A manifest row's dataset, as every reader checks it: ckpt_resolve (the dataset kept in b, *fidx the file
 * holding it), stored where the row's origin says ("" = the main file), fp32 of shape (ndim, shape).
 * where (cap bytes) names it, "FILE:/PATH" or "FILE:/PATH (linked from MAIN)", for later messages. */
dg_status_t ckpt_open_row(ckpt_files_t *fs, const char *dpath, const char *origin, int ndim,
                          const int64_t *shape, ckpt_hbag_t *b, hid_t *dset, int *fidx, char *where,
                          size_t cap);

/* ---------------- names, directories ---------------- */

void ckpt_step_name(int64_t step, char *buf, size_t cap); /* "step_00000042.h5" */
/* Parse "step_<digits>.h5" (partial = 0) or "step_<digits>.h5.partial" (partial = 1); -1 if neither. */
int64_t ckpt_parse_name(const char *name, int *partial);
dg_status_t ckpt_fsync_dir(const char *dir);
/* Atomically replace dir/LATEST with "name\n" (temp file, fsync, rename, fsync dir). */
dg_status_t ckpt_write_latest(const char *dir, const char *name);
/* LATEST in two halves, so that a commit can write and fsync the new LATEST before it renames the step
 * file: prepare writes LATEST.tmp.<pid> (cap >= 4200), publish renames it over LATEST and fsyncs dir. */
dg_status_t ckpt_latest_prepare(const char *dir, const char *name, char *tmp, size_t cap);
dg_status_t ckpt_latest_publish(const char *dir, const char *tmp);
/* What dir/LATEST names: DG_OK with name ("" when LATEST is absent), DG_ERR_USAGE when unreadable or
 * not a plain step file name. */
dg_status_t ckpt_read_latest(const char *dir, char *name, size_t cap);
/* The directory part of a path ("." when none). */
void ckpt_dirname(const char *path, char *buf, size_t cap);
const char *ckpt_basename(const char *path);

/* ---------------- internal entry points (lock held) ---------------- */

dg_status_t ckpt_save_locked(MPI_Comm comm, const char *dir, const dg_ckpt_meta_t *meta,
                             const dg_ckpt_tensor_t *t, int n, const dg_ckpt_save_opts_t *o,
                             dg_ckpt_save_result_t *res);
dg_status_t ckpt_check_locked(const char *path);
dg_status_t ckpt_load_locked(MPI_Comm comm, const char *path, dg_ckpt_meta_t *meta_out, dg_ckpt_tensor_t *t,
                             int n, dg_ckpt_meta_check_fn check, void *ctx);
dg_status_t ckpt_verify_locked(const char *path, FILE *report, int *n_bad, int rank, int nranks);
dg_status_t ckpt_info_read_locked(const char *path, dg_ckpt_info_t *info);

/* Test hook (documented in docs/checkpoints.md): DG_TEST_CKPT_FAIL="<phase>[@rank]" makes that rank
 * fail at `phase` (create, write, close, commit). Returns DG_ERR_RUNTIME with a message when it fires. */
dg_status_t ckpt_test_fail(const char *phase, int rank);
/* Test hook: DG_TEST_CKPT_STALL="<phase>[@rank][:N]" makes that rank hang forever the N-th time (default:
 * the first) it reaches `phase` (write: after a tensor; close: after H5Fclose) (as a rank
 * stuck in a collective would: its other threads, e.g. the health monitor's, keep running). */
void ckpt_test_stall(const char *phase, int rank);
/* Test hook: DG_TEST_CKPT_THROTTLE_MS="<ms>[@rank]" (every rank when @rank is left out): that rank
 * sleeps `ms` before each write of a save (a chunk, an MPI-IO call): a slow file system that keeps
 * writing. 0 when not set for this rank. */
int ckpt_test_throttle_ms(int rank);

/* ---- the save's MPI-IO interposition (mpiio.c) ---- */
#include <stdatomic.h>
typedef struct ckpt_io {
    MPI_Comm comm; /* the save's communicator (every rank of the file) */
    int rank;
    const char *path; /* the partial file, for messages */
    int failed;       /* this rank: a write failed (msg says which) */
    int failed_all;   /* agreed: every rank has stopped writing */
    int nospace;      /* this rank saw ENOSPC or EDQUOT (or MPI's NO_SPACE / QUOTA classes) */
    int throttle_ms;
    char msg[600];
} ckpt_io_t;
extern __thread ckpt_io_t *ckpt_tl_io; /* the save running on this thread (HDF5 is called from it only) */
void ckpt_io_fail(ckpt_io_t *io, int nospace, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void ckpt_io_fail_mpi(ckpt_io_t *io, int rc, const char *call, MPI_Offset off);
void ckpt_io_throttle(const ckpt_io_t *io);         /* DG_TEST_ checkpoint throttle: sleep per write */
dg_status_t ckpt_io_status(const ckpt_io_t *io);    /* the local failure flag as a status */
extern __thread int ckpt_tl_fill_skip;              /* set around H5Dcreate2 of a wholly direct dataset */
extern __thread int64_t ckpt_tl_fill_skipped_bytes; /* bytes of fill this thread did not write */
extern atomic_int ckpt_fill_skip_off;               /* a redone save turned the skip off for this process */

#endif
