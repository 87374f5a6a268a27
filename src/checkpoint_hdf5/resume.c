/* resume.c — choosing the checkpoint to resume from (LATEST first, then the newest complete file that
 * passes the check) and loading it with fallback to older ones when the chosen file turns out to be
 * damaged. Rank 0 lists the directory; every decision is broadcast so all ranks resume from the same
 * file. */
#include "ckpt_impl.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "dg_mpi.h"

typedef struct {
    int n;
    char (*name)[256];
    char note[1024]; /* why LATEST was not usable, if it was not */
} cands_t;

static void cands_rank0(const char *dir, cands_t *c) {
    dg_ckpt_dir_entry_t *e = NULL;
    int n = 0;
    char latest[256] = "";
    c->n = 0;
    c->name = NULL;
    c->note[0] = 0;
    dg_status_t s = dg_ckpt_list_dir(dir, &e, &n, NULL);
    if (s) {
        snprintf(c->note, sizeof c->note, "%s", dg_last_error());
        return;
    }
    c->name = dg_xcalloc((size_t)n + 1, 256);
    if (ckpt_read_latest(dir, latest, sizeof latest) != DG_OK) {
        snprintf(c->note, sizeof c->note, "%s", dg_last_error());
        latest[0] = 0;
    } else if (latest[0]) {
        char p[4400];
        struct stat st;
        snprintf(p, sizeof p, "%s/%s", dir, latest);
        if (stat(p, &st) != 0) {
            snprintf(c->note, sizeof c->note, "%s/LATEST names %s, which is missing: %s", dir, latest,
                     strerror(errno));
            latest[0] = 0;
        }
    }
    if (latest[0]) {
        snprintf(c->name[c->n++], 256, "%s", latest);
        int64_t ls = ckpt_parse_name(latest, NULL);
        for (int i = 0; i < n; i++) /* newest first: a kill between the two renames of a commit */
            if (!e[i].partial && e[i].step > ls) {
                DG_LOG_INFO("checkpoint: %s is newer than %s, which LATEST names; resuming from LATEST "
                            "(a save killed between its two renames leaves this; the next save of that "
                            "step replaces the file)",
                            e[i].name, latest);
                break;
            }
    }
    for (int i = 0; i < n; i++)
        if (!e[i].partial && strcmp(e[i].name, latest) != 0) snprintf(c->name[c->n++], 256, "%s", e[i].name);
    free(e);
}

static dg_status_t cands_get(MPI_Comm comm, const char *dir, cands_t *c) {
    int rank;
    DG_MPI_CHECK(MPI_Comm_rank(comm, &rank));
    if (rank == 0) cands_rank0(dir, c);
    DG_MPI_CHECK(MPI_Bcast(&c->n, 1, MPI_INT, 0, comm));
    DG_MPI_CHECK(MPI_Bcast(c->note, sizeof c->note, MPI_CHAR, 0, comm));
    if (rank != 0) c->name = dg_xcalloc((size_t)c->n + 1, 256);
    if (c->n > 0) DG_MPI_CHECK(MPI_Bcast(c->name, c->n * 256, MPI_CHAR, 0, comm));
    if (rank == 0 && c->note[0])
        DG_LOG_WARN("checkpoint: %s; falling back to the newest complete checkpoint", c->note);
    return DG_OK;
}

/* Collective check of one file: structure on rank 0, or a full verification split over the ranks. */
static dg_status_t check_one(MPI_Comm comm, const char *path, int full) {
    int rank, size;
    DG_MPI_CHECK(MPI_Comm_rank(comm, &rank));
    DG_MPI_CHECK(MPI_Comm_size(comm, &size));
    if (!full) {
        dg_status_t s = DG_OK;
        if (rank == 0) {
            ckpt_lock();
            s = ckpt_check_locked(path);
            ckpt_unlock();
        }
        return ckpt_bcast_status(comm, 0, s);
    }
    ckpt_lock();
    dg_status_t s = ckpt_verify_locked(path, NULL, NULL, rank, size);
    ckpt_unlock();
    return ckpt_agree(comm, s);
}

typedef enum { MODE_NEVER, MODE_AUTO, MODE_FILE } mode_t_;

static dg_status_t parse_mode(const char *dir, const char *mode, mode_t_ *m, char *adir, size_t cap) {
    if (!mode || !*mode)
        return DG_ERR(DG_ERR_USAGE, "checkpoint.resume: expected auto, never or a path, got ''");
    if (!strcmp(mode, "never")) {
        *m = MODE_NEVER;
        return DG_OK;
    }
    if (!strcmp(mode, "auto")) {
        if (!dir || !*dir) return DG_ERR(DG_ERR_USAGE, "checkpoint.resume=auto needs a checkpoint directory");
        snprintf(adir, cap, "%s", dir);
        *m = MODE_AUTO;
        return DG_OK;
    }
    struct stat st;
    if (stat(mode, &st) != 0)
        return DG_ERR(DG_ERR_USAGE, "checkpoint.resume=%s: %s (expected auto, never or an existing path)",
                      mode, strerror(errno));
    if (S_ISDIR(st.st_mode)) {
        snprintf(adir, cap, "%s", mode);
        *m = MODE_AUTO;
        return DG_OK;
    }
    *m = MODE_FILE;
    return DG_OK;
}

static dg_status_t set_out(char *out, size_t cap, const char *dir, const char *name) {
    int n = dir ? snprintf(out, cap, "%s/%s", dir, name) : snprintf(out, cap, "%s", name);
    if (n < 0 || (size_t)n >= cap)
        return DG_ERR(DG_ERR_USAGE, "checkpoint path longer than %zu bytes", cap - 1);
    return DG_OK;
}

static dg_status_t load_checked(MPI_Comm comm, const char *path, dg_ckpt_meta_check_fn check, void *ctx,
                                dg_ckpt_meta_t *meta_out, dg_ckpt_tensor_t *t, int n) {
    ckpt_lock();
    dg_status_t s = ckpt_load_locked(comm, path, meta_out, t, n, check, ctx);
    ckpt_unlock();
    return s;
}

/* What a candidate checkpoint file must pass (collective) */
typedef dg_status_t (*try_fn)(MPI_Comm comm, const char *path, void *arg);

/* The candidates of dir, newest first, through fn until one passes (its path into path_out). A
 * DG_ERR_USAGE verdict on a file moves on to an older one (rank 0 warns "checkpoint: SKIP PATH: why"); any
 * other error (MPI, memory: not a verdict on the file) gives up. None passing: one error naming the
 * newest one's reason. */
static dg_status_t first_usable(MPI_Comm comm, int rank, const char *dir, try_fn fn, void *arg,
                                const char *skip, const char *tail, char *path_out, size_t cap) {
    cands_t c;
    DG_TRY(cands_get(comm, dir, &c));
    char first_err[1024] = "";
    dg_status_t s = DG_OK;
    int found = 0;
    for (int i = 0; i < c.n && !found; i++) {
        char p[4400];
        snprintf(p, sizeof p, "%s/%s", dir, c.name[i]);
        s = fn(comm, p, arg);
        if (s == DG_OK) {
            found = 1;
            s = set_out(path_out, cap, dir, c.name[i]);
        } else if (s == DG_ERR_USAGE) {
            if (!first_err[0]) snprintf(first_err, sizeof first_err, "%s", dg_last_error());
            if (rank == 0) DG_LOG_WARN("checkpoint: %s %s: %s%s", skip, p, dg_last_error(), tail);
            s = DG_OK;
        } else {
            break;
        }
    }
    int n = c.n;
    free(c.name);
    if (s) return s;
    if (!found && n > 0)
        return DG_ERR(
            DG_ERR_USAGE,
            "no usable checkpoint in %s: all %d rejected (newest: %s); use checkpoint.resume=never to start "
            "over",
            dir, n, first_err);
    return DG_OK;
}

/* A resume mode resolved to a checkpoint file: never -> none (path_out ""); a file -> on_file must pass;
 * auto or a directory -> its newest candidate that on_cand passes (first_usable). Rank 0 decides what the
 * mode means, so every rank agrees even on a racy file system. */
static dg_status_t resolve(MPI_Comm comm, const char *ckpt_dir, const char *mode, try_fn on_file,
                           try_fn on_cand, void *arg, const char *skip, const char *tail, char *path_out,
                           size_t cap) {
    int rank;
    DG_MPI_CHECK(MPI_Comm_rank(comm, &rank));
    path_out[0] = 0;
    mode_t_ m = MODE_NEVER;
    char dir[4096] = "";
    DG_TRY(ckpt_bcast_status(comm, 0, rank == 0 ? parse_mode(ckpt_dir, mode, &m, dir, sizeof dir) : DG_OK));
    DG_MPI_CHECK(MPI_Bcast(&m, (int)sizeof m, MPI_BYTE, 0, comm));
    DG_MPI_CHECK(MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, comm));
    if (m == MODE_NEVER) return DG_OK;
    if (m == MODE_FILE) {
        DG_TRY(on_file(comm, mode, arg));
        return set_out(path_out, cap, NULL, mode);
    }
    return first_usable(comm, rank, dir, on_cand, arg, skip, tail, path_out, cap);
}

static dg_status_t try_verify(MPI_Comm comm, const char *path, void *arg) {
    return check_one(comm, path, *(const int *)arg);
}

dg_status_t dg_ckpt_resolve_resume(MPI_Comm comm, const char *ckpt_dir, const char *mode, int full_verify,
                                   char *path_out, size_t cap) {
    return resolve(comm, ckpt_dir, mode, try_verify, try_verify, &full_verify, "skipping", "", path_out, cap);
}

dg_status_t dg_ckpt_resume(MPI_Comm comm, const char *ckpt_dir, const char *mode, dg_ckpt_meta_t *meta_out,
                           dg_ckpt_tensor_t *t, int n, char *path_out, size_t cap) {
    return dg_ckpt_resume_checked(comm, ckpt_dir, mode, NULL, NULL, meta_out, t, n, path_out, cap);
}

typedef struct {
    dg_ckpt_meta_check_fn check;
    void *ctx;
    dg_ckpt_meta_t *meta_out;
    dg_ckpt_tensor_t *t;
    int n;
} load_args_t;

/* a file named by the mode passes when it loads; a candidate of a directory when its quick check passes too
 */
static dg_status_t try_load(MPI_Comm comm, const char *path, void *arg) {
    const load_args_t *a = arg;
    return load_checked(comm, path, a->check, a->ctx, a->meta_out, a->t, a->n);
}

static dg_status_t try_check_load(MPI_Comm comm, const char *path, void *arg) {
    DG_TRY(check_one(comm, path, 0));
    return try_load(comm, path, arg);
}

dg_status_t dg_ckpt_resume_checked(MPI_Comm comm, const char *ckpt_dir, const char *mode,
                                   dg_ckpt_meta_check_fn check, void *ctx, dg_ckpt_meta_t *meta_out,
                                   dg_ckpt_tensor_t *t, int n, char *path_out, size_t cap) {
    load_args_t a = {check, ctx, meta_out, t, n};
    return resolve(comm, ckpt_dir, mode, try_load, try_check_load, &a, "cannot resume from",
                   "; trying an older one", path_out, cap);
}
