/* checkpoint.h — parallel-HDF5 checkpoints of generic distributed state (docs/checkpoints.md).
 *
 * The module knows nothing about models: the caller describes its state as a list of fp32 pieces
 * ("this rank holds the hyperslab start/count of the global tensor PATH of shape gshape") plus a few
 * scalars (dg_ckpt_meta_t). A save writes ONE HDF5 file in which every tensor is one chunked,
 * Fletcher32-checksummed dataset with its full global shape; each rank writes its own hyperslab with
 * collective I/O (chunks a rank holds whole it checksums and writes itself at the place HDF5 allocated
 * for them: the same bytes, see save.c and docs/checkpoints.md). A load reads any decomposition of the same
 * tensors, so a checkpoint written by one world size or mesh loads into any other. The file layout is
 * documented in docs/checkpoint-format.md, the user-facing behaviour (resume, retention, incremental, dgckpt)
 * in docs/checkpoints.md.
 *
 * Guarantees:
 *  - Atomic commit: data goes to step_N.h5.partial; after close + fsync on every rank, rank 0 renames it
 *    to step_N.h5, fsyncs the directory and replaces LATEST (temp file, fsync, rename). A crash at any
 *    moment leaves LATEST naming the previous complete checkpoint and no half file under a final name.
 *  - Agreement: every collective function returns the same status and message on every rank of the
 *    communicator (the first failing rank's message, prefixed "rank R: "), never leaving a peer waiting.
 *  - Content hash: every dataset carries an xxh3-based hash (attribute "xxh3") that is independent of
 *    the decomposition that wrote it; loads and verify recompute and compare it.
 *  - Incremental: with opts.incremental, a tensor whose hash equals the base checkpoint's is stored as an
 *    HDF5 external link to the file that holds the data. Loads follow such links only to files in the
 *    same directory, refuse loops, and verify the hash.
 *
 * Threads and HDF5: Debian's HDF5 is not thread-safe. Every function here takes one process-wide lock
 * around its HDF5 work, so they may be called from any thread, but a call made while an asynchronous
 * write is in flight waits for it. Nothing else in the process may call HDF5 directly.
 * MPI: communicators must allow MPI_ERRORS_RETURN semantics for clean errors; the async writer needs
 * MPI_THREAD_MULTIPLE.
 * Process-wide effect: the first use sets glibc's malloc mmap/trim thresholds (32 MiB / 512 MiB) so that
 * HDF5's per-chunk buffers are reused instead of faulted in afresh; DG_CKPT_NO_MALLOPT=1 opts out.
 * Environment: DG_CKPT_MPIIO_HINTS="key=value,..." adds MPI-IO hints; DG_TEST_CKPT_FAIL, _KILL, _STALL
 * and _THROTTLE_MS are test hooks (docs/checkpoints.md). Worker threads and the free-space check are
 * save options (dg_ckpt_save_opts_t; dgtrain: checkpoint.threads, checkpoint.space_check).
 */
#ifndef DG_CHECKPOINT_H
#define DG_CHECKPOINT_H

#include <mpi.h>
#include <stdint.h>
#include <stdio.h>

#include "dg_common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DG_CKPT_FORMAT_NAME "dgtrain-checkpoint"
#define DG_CKPT_FORMAT_VERSION 1
#define DG_CKPT_MAX_NDIM 4
#define DG_CKPT_MAX_PATH 255 /* longest tensor path (bytes) */
#define DG_CKPT_MAX_RNG 64   /* RNG state words stored in the meta */
#define DG_CKPT_MAX_KV 32    /* free-form key/value pairs stored in the meta */
#define DG_CKPT_DEFAULT_CHUNK_BYTES (4 << 20)

/* One piece of one global fp32 tensor held by this rank.
 * path: dataset path inside the file, '/'-separated, e.g. "model/h.0.attn.qkv.weight" or
 *   "optim/h.0.attn.qkv.weight/m". Characters [A-Za-z0-9._-] and '/'; no empty, "." or ".." components;
 *   the top-level names "state" and "manifest" are reserved. A path may not be both a dataset and a
 *   group (e.g. "a/b" and "a/b/c").
 * gshape[0..ndim): the full global shape (1 <= ndim <= 4, every dim >= 1).
 * start/count: this rank's hyperslab (count[d] may be 0 for an empty piece). data holds prod(count)
 *   floats in row-major order: read by save, filled by load.
 * owner: 1 when this rank is the one that writes this piece. Replicated pieces must have exactly one
 *   owner; the owned pieces of a tensor must cover it exactly once (checked by element count and by the
 *   hash assembly). Load reads every piece, owned or not, and uses the owned ones to check the hash.
 * Every rank must list the same tensors (path, ndim, gshape) in the same order of first appearance;
 * a rank may hold several pieces of one tensor (repeat the path) or none (omit it, or count 0). */
typedef struct dg_ckpt_tensor {
    const char *path;
    int ndim;
    int64_t gshape[DG_CKPT_MAX_NDIM];
    int64_t start[DG_CKPT_MAX_NDIM];
    int64_t count[DG_CKPT_MAX_NDIM];
    int owner;
    float *data;
} dg_ckpt_tensor_t;

typedef struct dg_ckpt_kv {
    char key[64]; /* [A-Za-z0-9._-] */
    char value[448];
} dg_ckpt_kv_t;

/* The scalar state of a checkpoint. The whole struct is taken from rank 0 on save (other ranks must
 * pass the same step; the rest of theirs is ignored). Fields marked (load) are filled from the file
 * by load and ignored by save, which stamps its own. Initialise with dg_ckpt_meta_init, release with
 * dg_ckpt_meta_destroy. */
typedef struct dg_ckpt_meta {
    int64_t step;      /* optimizer steps completed */
    int64_t tokens;    /* global tokens consumed */
    char mesh[128];    /* e.g. "dp_replicate=1,dp_shard=4,tp=1" */
    char *config_text; /* effective config (INI text); owned: set with dg_ckpt_meta_set_config */
    struct {
        int64_t epoch, cursor; /* world-size-independent data-loader position */
        uint64_t samples_seen;
    } loader;
    struct {
        double scale; /* fp16 dynamic loss scale (1 when unused) */
        int64_t good_steps;
    } scaler;
    int n_rng;                     /* RNG state words in use */
    uint64_t rng[DG_CKPT_MAX_RNG]; /* RNG states where randomness exists */
    int n_kv;
    dg_ckpt_kv_t kv[DG_CKPT_MAX_KV];
    /* (load) */
    int world_size;       /* ranks that wrote it */
    char version[32];     /* dgtrain version that wrote it */
    char created[32];     /* creation time, ISO 8601 UTC */
    int64_t created_unix; /* creation time, seconds since the epoch */
    int format_version;   /* DG_CKPT_FORMAT_VERSION of the writer */
} dg_ckpt_meta_t;

/* A tensor shape as text, "[d0, d1, ...]" (cut at cap), and whether two shapes differ (rank or a dim). */
void dg_ckpt_shape_str(int ndim, const int64_t *shape, char *buf, size_t cap);
int dg_ckpt_shape_differs(int na, const int64_t *a, int nb, const int64_t *b);

void dg_ckpt_meta_init(dg_ckpt_meta_t *m);
void dg_ckpt_meta_destroy(dg_ckpt_meta_t *m);
void dg_ckpt_meta_set_config(dg_ckpt_meta_t *m, const char *text); /* copies; NULL clears */
/* Add or replace a key/value pair; DG_ERR_USAGE for a bad key, a too long value or a full table. */
dg_status_t dg_ckpt_meta_set_kv(dg_ckpt_meta_t *m, const char *key, const char *value);
const char *dg_ckpt_meta_get_kv(const dg_ckpt_meta_t *m, const char *key); /* NULL when absent */

typedef struct dg_ckpt_save_opts {
    int keep;            /* retention: keep the newest `keep` checkpoints (0 = keep all) */
    int incremental;     /* link tensors unchanged since the base checkpoint instead of writing them */
    const char *base;    /* incremental base: a file path; NULL or "" = the checkpoint LATEST names */
    int64_t chunk_bytes; /* target HDF5 chunk size; 0 = DG_CKPT_DEFAULT_CHUNK_BYTES */
    int64_t align_bytes; /* file-space alignment of chunks >= this size; 0 = default (see docs); -1 = off */
    int threads;         /* worker threads per rank for content hashing and the async snapshot copy;
                            0 = auto (this rank's share of the node's cores); at most 16 are used */
    int space_check;     /* 1 (default): refuse a save the free space cannot hold, before writing it */
} dg_ckpt_save_opts_t;
void dg_ckpt_save_opts_default(dg_ckpt_save_opts_t *o);

/* Where one save's time went on this rank (seconds, wall clock; each phase ends in an agreement, so a
 * phase includes waiting for the slowest rank). */
typedef struct dg_ckpt_phases {
    double validate; /* tensor table checks and agreement, meta broadcast */
    double hash;     /* content hashes (threads: `threads`) incl. the fragment exchange */
    double plan;     /* rank 0: directory, stale partial file, incremental decision */
    double create;   /* H5Fcreate + root attributes and /state */
    double write;    /* dataset creation, collective H5Dwrite of every tensor, xxh3 attributes, manifest,
                        and the direct chunk writes */
    double direct;   /* of which: the chunks this rank checksummed and wrote itself (`threads` threads) */
    int64_t direct_bytes;       /* bytes this rank wrote as direct chunks */
    int64_t fill_skipped_bytes; /* bytes of HDF5's dataset-creation fill this rank did not write (their
                                   chunks were all written directly) */
    double close;               /* H5Fclose (metadata flush) */
    double fsync;               /* fsync of the file on every rank */
    double commit;              /* rank 0: rename, directory fsync, LATEST */
    double retention;
    double cpu;  /* CPU seconds of this process during the save (all its threads; getrusage) */
    int threads; /* hashing threads used */
} dg_ckpt_phases_t;

typedef struct dg_ckpt_save_result {
    char path[4096]; /* the committed file */
    int64_t step;
    int64_t bytes;         /* size of the file on disk */
    int64_t logical_bytes; /* bytes of all tensors (what a full checkpoint stores) */
    int64_t linked_bytes;  /* tensor bytes stored as links to older checkpoints */
    int n_tensors, n_linked;
    double seconds;          /* wall time of the write and commit */
    double stall_ms;         /* time the caller was blocked: the whole save when synchronous, the
                                snapshot copy (plus any wait for the previous write) when async */
    char base[256];          /* incremental base file name ("" for a full checkpoint) */
    dg_ckpt_phases_t phases; /* this rank's breakdown of `seconds` */
    double snapshot_ms;      /* async: the snapshot copy alone (stall_ms adds the wait for the previous
                                write); 0 for a synchronous save */
    /* Filled on failure too (the same on every rank): */
    int no_space;         /* the save failed for lack of space (ENOSPC/EDQUOT on some rank, the space
                             check before writing, or less free space than needed afterwards) */
    int64_t needed_bytes; /* estimated size of the new file (0 when the save failed before knowing) */
    int64_t free_bytes;   /* space available in the checkpoint directory after the save (-1: unknown) */
} dg_ckpt_save_result_t;

/* Collective over `comm`. Write a checkpoint of step meta->step into ckpt_dir (created if needed) as
 * step_<step, 8 digits>.h5, commit it atomically, update LATEST, then apply retention. `res` may be
 * NULL. On failure nothing under a final name changes, LATEST is untouched, the .partial file is
 * removed, and res says whether space ran out (no_space, needed_bytes, free_bytes).
 * Space: before writing, rank 0 compares the estimated file size with the space statvfs reports
 * (opts.space_check = 0 skips this). A write that fails anyway (ENOSPC from below HDF5, EIO...) never
 * reaches HDF5 as an error: the failure is recorded, every rank stops writing at the next collective
 * write or agreement, HDF5 closes the file as if all went well, and the save reports the failure. So
 * HDF5 never takes an error path on some ranks only (which deadlocks its collective close) and never
 * leaves a file open behind a failed close (which crashes MPI_Finalize). */
dg_status_t dg_ckpt_save(MPI_Comm comm, const char *ckpt_dir, const dg_ckpt_meta_t *meta,
                         const dg_ckpt_tensor_t *t, int n, const dg_ckpt_save_opts_t *opts,
                         dg_ckpt_save_result_t *res);

/* Collective. Read `path`: meta_out (may be NULL; overwritten, so pass a fresh struct, and
 * dg_ckpt_meta_destroy it afterwards) and, for every piece in t,
 * its hyperslab of the named dataset. Checks the format, that every tensor exists with the expected
 * shape, the per-chunk checksums, and the content hashes; follows incremental links (same directory
 * only, no loops). Damage gives DG_ERR_USAGE with a message naming the file and the dataset. */
dg_status_t dg_ckpt_load(MPI_Comm comm, const char *path, dg_ckpt_meta_t *meta_out, dg_ckpt_tensor_t *t,
                         int n);

/* Collective. Decide which checkpoint to resume from; all ranks get the same answer.
 * mode "never": "" (fresh start). "auto": the file LATEST names in ckpt_dir when it passes the check,
 * else the newest complete step_*.h5 that passes (a warning names each rejected file and why);
 * "" when the directory holds no checkpoint; DG_ERR_USAGE when it holds some but none passes.
 * Any other mode is a path: a file (must pass, no fallback) or a directory (treated as auto there).
 * full_verify = 0 checks structure only (opens, format, every tensor present with its shape, links
 * valid); 1 also reads all data, checking checksums and hashes (the work is split over the ranks). */
dg_status_t dg_ckpt_resolve_resume(MPI_Comm comm, const char *ckpt_dir, const char *mode, int full_verify,
                                   char *path_out, size_t cap);

/* Collective. resolve_resume(full_verify = 0) followed by load, falling back to the next older
 * candidate when a load finds damage (auto mode only). path_out = "" and DG_OK when there is nothing
 * to resume from (then neither meta_out nor t are touched). */
dg_status_t dg_ckpt_resume(MPI_Comm comm, const char *ckpt_dir, const char *mode, dg_ckpt_meta_t *meta_out,
                           dg_ckpt_tensor_t *t, int n, char *path_out, size_t cap);

/* A caller's check of a checkpoint's scalar state (step, tokens, loader, scaler, key/value pairs) against
 * what it knows (its model, data, schedule): DG_OK, or DG_ERR_USAGE with a message naming the field, its
 * value and the allowed range. Called on every rank with the same meta; must not call HDF5. */
typedef dg_status_t (*dg_ckpt_meta_check_fn)(void *ctx, const char *path, const dg_ckpt_meta_t *meta);
/* dg_ckpt_resume with `check` (may be NULL) run on each candidate's meta before its tensors are read: a
 * rejected candidate is treated like a damaged one (a warning, then the next older one in auto mode; an
 * error for an explicit file). */
dg_status_t dg_ckpt_resume_checked(MPI_Comm comm, const char *ckpt_dir, const char *mode,
                                   dg_ckpt_meta_check_fn check, void *ctx, dg_ckpt_meta_t *meta_out,
                                   dg_ckpt_tensor_t *t, int n, char *path_out, size_t cap);

/* ---- impossible contents ---- */

/* One value of a checkpoint's scalar state outside what any run can produce. */
typedef struct dg_ckpt_violation {
    char field[64];    /* e.g. "step", "loader_cursor", "kv spike_state" */
    char value[128];   /* the value found */
    char allowed[320]; /* the allowed values and why, e.g. ">= 0" or "0 .. 299 (the data has 300 samples)" */
} dg_ckpt_violation_t;
/* Append a violation to v[*n] (ignored past cap; *n still counts it). */
void dg_ckpt_violation_add(dg_ckpt_violation_t *v, int cap, int *n, const char *field, const char *allowed,
                           const char *value_fmt, ...) __attribute__((format(printf, 6, 7)));
/* The checks that hold for every checkpoint this module writes, whatever wrote it: step >= 0,
 * tokens >= 0, loader epoch >= 0 and cursor >= 0 (and cursor <= samples_seen, epoch <= samples_seen),
 * samples_seen <= 2^63 - 1, scaler scale finite and > 0, good_steps >= 0, world_size >= 1, n_rng in
 * [0, DG_CKPT_MAX_RNG]. Returns the number of violations (the first `cap` in v). Loads (and so resume,
 * which falls back past such a file), the structural check and dg_ckpt_verify apply them. */
int dg_ckpt_meta_check(const dg_ckpt_meta_t *m, dg_ckpt_violation_t *v, int cap);
/* The first DG_CKPT_MAX_VIOLATIONS of n violations as one DG_ERR_USAGE message naming `path`, each field,
 * its value and the allowed range (returns DG_ERR_USAGE). */
#define DG_CKPT_MAX_VIOLATIONS 16
dg_status_t dg_ckpt_violations_error(const char *path, const dg_ckpt_violation_t *v, int n);

/* ---- progress and aborts ---- */

/* A process-wide counter that grows while checkpoint work moves forward: bytes this process wrote, read,
 * hashed or flushed for a save or load, plus one for every agreement point a save or load reaches. A
 * watchdog tells a slow file system (the counter moves) from a stuck rank (it does not) with it; see
 * docs/checkpoints.md, "Stalls during checkpoints". Any thread. */
uint64_t dg_ckpt_progress(void);
/* 1 while a thread of this process waits in one of the collectives of a save or load (an agreement, a
 * collective MPI-IO call), 0 otherwise: a rank that waits there is not the one the job waits for. */
int dg_ckpt_waiting(void);
/* Best effort, from any thread of a process about to end (a watchdog abort): remove the .partial file of
 * every save in flight in this process, so that an aborted save leaves nothing half-written behind. */
void dg_ckpt_abort_cleanup(void);

/* ---- serial inspection (no MPI needed; used by dgckpt) ---- */

/* Read everything in `path` (following links), checking chunk checksums, content hashes, shapes and
 * the manifest. `report` (may be NULL) gets one line per dataset and a summary. DG_OK when intact;
 * DG_ERR_USAGE with the first problem otherwise (n_bad, if not NULL, counts the bad datasets). */
dg_status_t dg_ckpt_verify(const char *path, FILE *report, int *n_bad);

/* Structural check only: format, manifest, every tensor present with its shape, links valid. */
dg_status_t dg_ckpt_check(const char *path);

/* One dataset as the manifest describes it. */
typedef struct dg_ckpt_entry {
    char path[DG_CKPT_MAX_PATH + 1];
    int ndim;
    int64_t shape[DG_CKPT_MAX_NDIM];
    uint64_t hash;
    char origin[256]; /* "" when stored in this file, else the file (same directory) holding the data */
} dg_ckpt_entry_t;

typedef struct dg_ckpt_info {
    dg_ckpt_meta_t meta;
    int n_entries;
    dg_ckpt_entry_t *entries; /* in file order */
    char base[256];           /* incremental base ("" = full) */
    char bases[4096];         /* every file this one links to, ' '-separated */
    int64_t file_bytes;
} dg_ckpt_info_t;
dg_status_t dg_ckpt_info_read(const char *path, dg_ckpt_info_t *info);
void dg_ckpt_info_destroy(dg_ckpt_info_t *info);

/* Read a whole dataset of `path` (following a link) into a malloc'd buffer of *numel floats. */
dg_status_t dg_ckpt_read_dataset(const char *path, const char *dset, float **data, int64_t *numel);

/* Write the model/ tensors of `path` (all tensors with all_tensors = 1, named by their full path) as
 * a safetensors file (F32, full shapes, names without the "model/" prefix), atomically. */
dg_status_t dg_ckpt_export_safetensors(const char *path, const char *out, int all_tensors);

/* The checkpoints in a directory, newest step first. */
typedef struct dg_ckpt_dir_entry {
    char name[256];
    int64_t step;
    int partial; /* a .partial left by an interrupted save */
    int64_t bytes;
} dg_ckpt_dir_entry_t;
/* *n_out = 0 for a missing directory. `latest` (may be NULL, cap 256) gets what LATEST names ("" if
 * none or unreadable). */
dg_status_t dg_ckpt_list_dir(const char *dir, dg_ckpt_dir_entry_t **entries, int *n_out, char *latest);

/* ---- asynchronous writes ---- */

typedef struct dg_ckpt_writer dg_ckpt_writer_t;

/* The outcome of one background write. valid = 0: there was nothing to report. */
typedef struct dg_ckpt_async_result {
    int valid;
    dg_status_t status; /* agreed over the writer's communicator: the same on every rank */
    char error[1024];   /* the message when status != DG_OK */
    dg_ckpt_save_result_t res;
} dg_ckpt_async_result_t;

/* Collective. A background thread that writes into ckpt_dir with `opts` over its own MPI_Comm_dup of
 * comm. Needs MPI_THREAD_MULTIPLE (DG_ERR_RUNTIME otherwise). */
dg_status_t dg_ckpt_writer_create(MPI_Comm comm, const char *ckpt_dir, const dg_ckpt_save_opts_t *opts,
                                  dg_ckpt_writer_t **out);
/* Local. Allocate the snapshot buffer for `bytes` of owned tensor data and fault it in now (in
 * parallel), so that the first submit() pays only the copy. Optional: submit grows the buffer itself
 * when needed (and that first copy then also pays the page faults). */
dg_status_t dg_ckpt_writer_reserve(dg_ckpt_writer_t *w, size_t bytes);
/* Every rank calls it at the same step. Waits for the previous write, copies the owned pieces into a
 * host snapshot (that copy, plus the wait, is the stall: *stall_ms) and returns; the write happens in
 * the background. If the previous write finished but was not yet collected, it is returned in `prev`
 * (may be NULL: then it is only logged). The caller may change its tensors as soon as this returns. */
dg_status_t dg_ckpt_writer_submit(dg_ckpt_writer_t *w, const dg_ckpt_meta_t *meta, const dg_ckpt_tensor_t *t,
                                  int n, double *stall_ms, dg_ckpt_async_result_t *prev);
/* As submit, without the snapshot copy: the background write reads the owned pieces where t points, so
 * the caller must leave that memory unchanged until the write has finished (the next submit, wait, or a
 * poll that returns 1). For a caller that already copies its state into a buffer of its own (a GPU's
 * state into page-locked memory), after waiting for the previous write. The stall (*stall_ms and the
 * result's stall_ms) is counted from t_start (dg_now_s() when the caller began its wait and copy; 0 =
 * now). */
dg_status_t dg_ckpt_writer_submit_borrowed(dg_ckpt_writer_t *w, const dg_ckpt_meta_t *meta,
                                           const dg_ckpt_tensor_t *t, int n, double t_start, double *stall_ms,
                                           dg_ckpt_async_result_t *prev);
/* Local, non-blocking: 1 and `out` filled when the last write finished and had not been collected;
 * 0 while one is in flight; -1 when there is nothing to collect. Ranks may see completion at slightly
 * different times: use it for reporting, and wait() for decisions that must agree. */
int dg_ckpt_writer_poll(dg_ckpt_writer_t *w, dg_ckpt_async_result_t *out);
/* Block until the last write finished; fill `out` (valid = 0 when nothing was pending) and return its
 * status (DG_OK when nothing was pending). The status is the same on every rank. */
dg_status_t dg_ckpt_writer_wait(dg_ckpt_writer_t *w, dg_ckpt_async_result_t *out);
/* Collective. Waits for a pending write (logging its outcome if uncollected) and frees the writer. */
void dg_ckpt_writer_free(dg_ckpt_writer_t *w);

/* Fletcher32 (fletcher32.c): this library defines HDF5's H5_checksum_fletcher32 with a faster,
 * bit-identical implementation that the Fletcher32 filter then calls (executables linking this library
 * export the symbol). 1 when HDF5's calls really reach it (and its self-test against HDF5's own passed);
 * 0 when HDF5's version runs. */
int dg_ckpt_fletcher32_interposed(void);
/* How many checksums this implementation has computed in this process (for tests). */
uint64_t dg_ckpt_fletcher32_calls(void);
/* The checksum computed without the vectorised path (for tests). */
uint32_t dg_ckpt_fletcher32_portable(const void *data, size_t len);

#ifdef __cplusplus
}
#endif
#endif /* DG_CHECKPOINT_H */
