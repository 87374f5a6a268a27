/* files.c — opening a checkpoint for reading and finding its datasets, following incremental external
 * links by hand: only to files in the same directory (after resolving symlinks), never through an
 * intermediate group, at most 16 hops, and never around a loop. HDF5's own link traversal is disabled
 * (ckpt_lapl_noext) so that nothing is opened behind our back. */
#define _GNU_SOURCE
#define DG_H5_FAIL_CODE DG_ERR_USAGE
#include "ckpt_impl.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

dg_status_t ckpt_files_open(ckpt_files_t *fs, const char *path, MPI_Comm comm) {
    memset(fs, 0, sizeof *fs);
    fs->fapl = fs->lapl = -1;
    struct stat st;
    if (stat(path, &st) != 0) return DG_ERR(DG_ERR_USAGE, "checkpoint %s: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return DG_ERR(DG_ERR_USAGE, "checkpoint %s is not a regular file", path);
    ckpt_dirname(path, fs->dir, sizeof fs->dir);
    if (!realpath(fs->dir, fs->realdir))
        return DG_ERR(DG_ERR_USAGE, "checkpoint %s: cannot resolve its directory: %s", path, strerror(errno));
    fs->fapl = ckpt_fapl(comm, 0);
    DG_H5_CHECK(fs->fapl, "%s: file access properties", path);
    fs->lapl = ckpt_lapl_noext();
    DG_H5_CHECK(fs->lapl, "%s: link access properties", path);
    hid_t fid = H5Fopen(path, H5F_ACC_RDONLY, fs->fapl);
    if (fid < 0) {
        char h5[1024];
        ckpt_h5_error_text(h5, sizeof h5);
        return DG_ERR(DG_ERR_USAGE,
                      "checkpoint %s cannot be opened as HDF5 (truncated, damaged or not HDF5): %s", path,
                      h5);
    }
    snprintf(fs->name[0], sizeof fs->name[0], "%s", path);
    fs->fid[0] = fid;
    fs->n = 1;
    return DG_OK;
}

void ckpt_files_close(ckpt_files_t *fs) {
    for (int i = fs->n - 1; i >= 0; i--)
        H5Fclose(fs->fid[i]);
    fs->n = 0;
    if (fs->lapl >= 0) H5Pclose(fs->lapl);
    if (fs->fapl >= 0) H5Pclose(fs->fapl);
    fs->lapl = fs->fapl = -1;
}

/* A link target must be a plain file name that, after resolving symlinks, lives in our directory. */
static dg_status_t check_target(ckpt_files_t *fs, const char *tfile, const char *where) {
    int plain = tfile[0] && !strchr(tfile, '/') && strcmp(tfile, ".") != 0 && strcmp(tfile, "..") != 0 &&
                strlen(tfile) < 256;
    if (!plain)
        return DG_ERR(
            DG_ERR_USAGE,
            "%s is an external link to '%s', outside the checkpoint directory %s; refused (links must name "
            "a file in the same directory)",
            where, tfile, fs->dir);
    char full[PATH_MAX + 300], real[PATH_MAX], rdir[PATH_MAX];
    snprintf(full, sizeof full, "%s/%s", fs->dir, tfile);
    if (!realpath(full, real))
        return DG_ERR(DG_ERR_USAGE,
                      "%s links to %s, which cannot be opened: %s (the base checkpoint is missing)", where,
                      full, strerror(errno));
    ckpt_dirname(real, rdir, sizeof rdir);
    if (strcmp(rdir, fs->realdir) != 0)
        return DG_ERR(
            DG_ERR_USAGE,
            "%s is an external link to %s, which resolves to %s outside the checkpoint directory %s; "
            "refused",
            where, tfile, real, fs->realdir);
    return DG_OK;
}

static dg_status_t open_target(ckpt_files_t *fs, const char *tfile, int *idx, const char *where) {
    for (int i = 1; i < fs->n; i++)
        if (strcmp(fs->name[i], tfile) == 0) {
            *idx = i;
            return DG_OK;
        }
    /* The main file may be reached again by name (a loop through it). */
    if (strcmp(ckpt_basename(fs->name[0]), tfile) == 0) {
        *idx = 0;
        return DG_OK;
    }
    if (fs->n >= CKPT_MAX_FILES)
        return DG_ERR(DG_ERR_USAGE, "%s: links lead to more than %d files", where, CKPT_MAX_FILES);
    char full[PATH_MAX + 300];
    snprintf(full, sizeof full, "%s/%s", fs->dir, tfile);
    hid_t fid = H5Fopen(full, H5F_ACC_RDONLY, fs->fapl);
    if (fid < 0) {
        char h5[1024];
        ckpt_h5_error_text(h5, sizeof h5);
        return DG_ERR(DG_ERR_USAGE, "%s links to %s, which cannot be opened as HDF5: %s", where, full, h5);
    }
    snprintf(fs->name[fs->n], sizeof fs->name[0], "%s", tfile);
    fs->fid[fs->n] = fid;
    *idx = fs->n++;
    return DG_OK;
}

dg_status_t ckpt_resolve(ckpt_files_t *fs, const char *dpath, hid_t *dset, int *file_idx) {
    enum { MAX_HOPS = 16 };
    char trail[2048];
    int cur = 0;
    char path[DG_CKPT_MAX_PATH + 2];
    char seen_file[MAX_HOPS + 1][256], seen_path[MAX_HOPS + 1][DG_CKPT_MAX_PATH + 2];
    int nseen = 0;
    snprintf(path, sizeof path, "%s", dpath);
    snprintf(trail, sizeof trail, "%s:/%s", fs->name[0], dpath);
    for (int hop = 0;; hop++) {
        hid_t fid = fs->fid[cur];
        const char *fname = cur == 0 ? fs->name[0] : fs->name[cur];
        /* every intermediate component must be a plain (hard-linked) group of this file */
        char pre[DG_CKPT_MAX_PATH + 2];
        for (const char *sl = strchr(path, '/'); sl; sl = strchr(sl + 1, '/')) {
            snprintf(pre, sizeof pre, "%.*s", (int)(sl - path), path);
            htri_t ex = H5Lexists(fid, pre, fs->lapl);
            if (ex <= 0) {
                H5Eclear2(H5E_DEFAULT);
                return DG_ERR(DG_ERR_USAGE, "%s: dataset /%s is missing (no group /%s)", fname, path, pre);
            }
            H5L_info_t li;
            DG_H5_CHECK(H5Lget_info(fid, pre, &li, fs->lapl), "%s:/%s", fname, pre);
            if (li.type != H5L_TYPE_HARD)
                return DG_ERR(DG_ERR_USAGE, "%s:/%s is a %s link where a group is expected; refused", fname,
                              pre, li.type == H5L_TYPE_EXTERNAL ? "external" : "soft");
        }
        htri_t ex = H5Lexists(fid, path, fs->lapl);
        if (ex <= 0) {
            H5Eclear2(H5E_DEFAULT);
            if (hop == 0) return DG_ERR(DG_ERR_USAGE, "%s: dataset /%s is missing", fname, path);
            return DG_ERR(DG_ERR_USAGE, "%s: the link target %s:/%s is missing", trail, fname, path);
        }
        H5L_info_t li;
        DG_H5_CHECK(H5Lget_info(fid, path, &li, fs->lapl), "%s:/%s", fname, path);
        if (li.type == H5L_TYPE_HARD) {
            hid_t d = H5Dopen2(fid, path, H5P_DEFAULT);
            DG_H5_CHECK(d, "%s: cannot open dataset %s:/%s", trail, fname, path);
            *dset = d;
            *file_idx = cur;
            return DG_OK;
        }
        if (li.type != H5L_TYPE_EXTERNAL)
            return DG_ERR(DG_ERR_USAGE, "%s:/%s is a soft link; checkpoints only use external links", fname,
                          path);
        if (li.u.val_size == 0 || li.u.val_size > 8192)
            return DG_ERR(DG_ERR_USAGE, "%s:/%s: malformed external link", fname, path);
        char val[8192];
        DG_H5_CHECK(H5Lget_val(fid, path, val, li.u.val_size, fs->lapl), "%s:/%s: reading the link", fname,
                    path);
        unsigned flags = 0;
        const char *tfile = NULL, *tobj = NULL;
        DG_H5_CHECK(H5Lunpack_elink_val(val, li.u.val_size, &flags, &tfile, &tobj),
                    "%s:/%s: decoding the link", fname, path);
        char where[1100];
        snprintf(where, sizeof where, "%s:/%s", fname, path);
        DG_TRY(check_target(fs, tfile, where));
        while (*tobj == '/')
            tobj++;
        if (!*tobj || strlen(tobj) > DG_CKPT_MAX_PATH)
            return DG_ERR(DG_ERR_USAGE, "%s: external link with a bad object path", where);
        snprintf(seen_file[nseen], sizeof seen_file[0], "%s", ckpt_basename(fname));
        snprintf(seen_path[nseen], sizeof seen_path[0], "%s", path);
        nseen++;
        size_t tl = strlen(trail);
        snprintf(trail + tl, sizeof trail - tl, " -> %s:/%s", tfile, tobj);
        for (int i = 0; i < nseen; i++)
            if (strcmp(seen_file[i], tfile) == 0 && strcmp(seen_path[i], tobj) == 0)
                return DG_ERR(DG_ERR_USAGE, "external links loop: %s; refused", trail);
        if (nseen >= MAX_HOPS)
            return DG_ERR(DG_ERR_USAGE, "external link chain longer than %d hops: %s; refused", MAX_HOPS,
                          trail);
        DG_TRY(open_target(fs, tfile, &cur, where));
        snprintf(path, sizeof path, "%s", tobj);
    }
}

dg_status_t ckpt_check_dataset(hid_t dset, int ndim, const int64_t *shape, const char *where) {
    ckpt_hbag_t b = {0};
    dg_status_t s = DG_OK;
    hid_t t = ckpt_hbag_add(&b, H5Dget_type(dset));
    hid_t sp = ckpt_hbag_add(&b, H5Dget_space(dset));
    if (t < 0 || sp < 0) {
        s = ckpt_h5_fail(DG_ERR_USAGE, __FILE__, __LINE__, "H5Dget_type()", "%s", where);
    } else if (H5Tget_class(t) != H5T_FLOAT || H5Tget_size(t) != 4) {
        s = DG_ERR(DG_ERR_USAGE, "%s is not a float32 dataset", where);
    } else {
        hsize_t dims[H5S_MAX_RANK];
        int nd = H5Sget_simple_extent_dims(sp, dims, NULL);
        int same = nd == ndim;
        for (int d = 0; same && d < nd; d++)
            same = (int64_t)dims[d] == shape[d];
        if (!same) {
            char got[256] = "", want[256] = "";
            size_t o = 0;
            for (int d = 0; d < nd && d < H5S_MAX_RANK && o < sizeof got; d++)
                o += (size_t)snprintf(got + o, sizeof got - o, "%s%llu", d ? ", " : "",
                                      (unsigned long long)dims[d]);
            o = 0;
            for (int d = 0; d < ndim && o < sizeof want; d++)
                o +=
                    (size_t)snprintf(want + o, sizeof want - o, "%s%lld", d ? ", " : "", (long long)shape[d]);
            s = DG_ERR(DG_ERR_USAGE, "%s has shape [%s], expected [%s]", where, got, want);
        }
    }
    ckpt_hbag_close(&b);
    return s;
}

dg_status_t ckpt_open_row(ckpt_files_t *fs, const char *dpath, const char *origin, int ndim,
                          const int64_t *shape, ckpt_hbag_t *b, hid_t *dset, int *fidx, char *where,
                          size_t cap) {
    DG_TRY(ckpt_resolve(fs, dpath, dset, fidx));
    ckpt_hbag_add(b, *dset);
    if (*fidx == 0)
        snprintf(where, cap, "%s:/%s", fs->name[0], dpath);
    else
        snprintf(where, cap, "%s:/%s (linked from %s)", fs->name[*fidx], dpath, fs->name[0]);
    const char *actual = *fidx == 0 ? "" : fs->name[*fidx];
    if (strcmp(actual, origin) != 0)
        return DG_ERR(DG_ERR_USAGE, "%s:/%s is stored in %s but the manifest says %s; refused", fs->name[0],
                      dpath, actual[0] ? actual : "this file", origin[0] ? origin : "this file");
    return ckpt_check_dataset(*dset, ndim, shape, where);
}
