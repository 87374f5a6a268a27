/* load.c — reading a checkpoint into any decomposition: every rank opens the file (MPI-IO, collective
 * metadata), validates the format, the manifest and each tensor's shape, follows incremental links,
 * reads its own hyperslabs (independent reads, so a checksum failure on one rank cannot strand the
 * others inside HDF5), and finally checks the content hashes of what was read. */
#define DG_H5_FAIL_CODE DG_ERR_USAGE
#include "ckpt_impl.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "dg_mpi.h"

static int row_cmp(const void *a, const void *b) {
    return strcmp(((const ckpt_mrow_t *)a)->path, ((const ckpt_mrow_t *)b)->path);
}

/* Open, validate and read one tensor's pieces. Collective in its metadata calls. */
static dg_status_t load_tensor(ckpt_files_t *fs, const ckpt_mrow_t *rows, int nrows, const ckpt_tdesc_t *td,
                               dg_ckpt_tensor_t *t, ckpt_hbag_t *b) {
    const char *file = fs->name[0];
    ckpt_mrow_t key;
    snprintf(key.path, sizeof key.path, "%s", td->path);
    const ckpt_mrow_t *r = bsearch(&key, rows, (size_t)nrows, sizeof key, row_cmp);
    if (!r) return DG_ERR(DG_ERR_USAGE, "%s: dataset /%s is missing (not in the manifest)", file, td->path);
    if (dg_ckpt_shape_differs(r->ndim, r->shape, td->ndim, td->gshape)) {
        char got[200], want[200];
        dg_ckpt_shape_str(r->ndim, r->shape, got, sizeof got);
        dg_ckpt_shape_str(td->ndim, td->gshape, want, sizeof want);
        return DG_ERR(DG_ERR_USAGE, "%s: dataset /%s has shape %s, expected %s", file, td->path, got, want);
    }
    hid_t dset = -1;
    int fidx = 0;
    char where[1100];
    DG_TRY(
        ckpt_open_row(fs, td->path, r->origin, td->ndim, td->gshape, b, &dset, &fidx, where, sizeof where));
    if (fidx != 0) {
        uint64_t h = 0;
        DG_TRY(ckpt_attr_get_u64(dset, "xxh3", &h, where));
        if (h != r->hash)
            return DG_ERR(
                DG_ERR_USAGE,
                "%s: content hash %016llx differs from the %016llx that %s expects (the base was replaced "
                "or damaged)",
                where, (unsigned long long)h, (unsigned long long)r->hash, file);
    }
    for (int k = 0; k < td->npieces; k++) {
        dg_ckpt_tensor_t *p = &t[td->pieces[k]];
        if (ckpt_numel(p->ndim, p->count) == 0) continue;
        hsize_t st[DG_CKPT_MAX_NDIM], cn[DG_CKPT_MAX_NDIM];
        for (int d = 0; d < td->ndim; d++)
            st[d] = (hsize_t)p->start[d], cn[d] = (hsize_t)p->count[d];
        hid_t fsp = ckpt_hbag_add(b, H5Dget_space(dset));
        DG_H5_CHECK(fsp, "%s", where);
        DG_H5_CHECK(H5Sselect_hyperslab(fsp, H5S_SELECT_SET, st, NULL, cn, NULL), "%s: selection", where);
        hid_t ms = ckpt_hbag_add(b, H5Screate_simple(td->ndim, cn, NULL));
        DG_H5_CHECK(ms, "%s", where);
        if (H5Dread(dset, H5T_NATIVE_FLOAT, ms, fsp, H5P_DEFAULT, p->data) < 0) {
            char h5[1024];
            ckpt_h5_error_text(h5, sizeof h5);
            if (strstr(h5, "Fletcher32") || strstr(h5, "checksum"))
                return DG_ERR(DG_ERR_USAGE, "%s: checksum mismatch (Fletcher32): the file is damaged [%s]",
                              where, h5);
            return DG_ERR(DG_ERR_USAGE, "%s: cannot read: %s", where, h5);
        }
        H5Sclose(ms);
        H5Sclose(fsp);
        b->n -= 2;
    }
    return DG_OK;
}

/* The generic content checks, then the caller's. Local (every rank has the same meta). */
static dg_status_t check_contents(const char *path, const dg_ckpt_meta_t *m, dg_ckpt_meta_check_fn check,
                                  void *ctx) {
    dg_ckpt_violation_t v[CKPT_MAX_VIOLATIONS];
    int n = dg_ckpt_meta_check(m, v, CKPT_MAX_VIOLATIONS);
    if (n) return dg_ckpt_violations_error(path, v, n);
    return check ? check(ctx, path, m) : DG_OK;
}

dg_status_t ckpt_load_locked(MPI_Comm comm, const char *path, dg_ckpt_meta_t *meta_out, dg_ckpt_tensor_t *t,
                             int n, dg_ckpt_meta_check_fn check, void *ctx) {
    int rank;
    DG_MPI_CHECK(MPI_Comm_rank(comm, &rank));
    ckpt_table_t tab;
    dg_status_t s = DG_OK;
    if (!path || !*path) s = DG_ERR(DG_ERR_USAGE, "checkpoint load: empty path");
    if (!s)
        s = ckpt_table_build(t, n, 1, &tab);
    else
        memset(&tab, 0, sizeof tab);
    s = ckpt_agree(comm, s);
    if (!s) s = ckpt_table_agree(comm, t, &tab);
    if (s) {
        ckpt_table_free(&tab);
        return s;
    }
    /* every rank must see the file (a path that only exists on one node is a clear error, not a hang) */
    struct stat st;
    s = stat(path, &st) == 0 ? DG_OK : DG_ERR(DG_ERR_USAGE, "checkpoint %s: no such file on this node", path);
    s = ckpt_agree(comm, s);
    ckpt_files_t fs;
    memset(&fs, 0, sizeof fs);
    fs.fapl = fs.lapl = -1;
    if (!s) s = ckpt_agree(comm, ckpt_files_open(&fs, path, comm));
    dg_ckpt_meta_t meta;
    dg_ckpt_meta_init(&meta);
    ckpt_mrow_t *rows = NULL;
    int nrows = 0;
    if (!s) s = ckpt_agree(comm, ckpt_meta_read(fs.fid[0], &meta, NULL, 0, NULL, 0, path));
    /* before any tensor is read: an impossible state rejects the file like damage does */
    if (!s) s = ckpt_agree(comm, check_contents(path, &meta, check, ctx));
    if (!s) s = ckpt_agree(comm, ckpt_manifest_read(fs.fid[0], &rows, &nrows, path));
    if (!s) qsort(rows, (size_t)nrows, sizeof *rows, row_cmp);
    for (int i = 0; i < tab.n && !s; i++) {
        ckpt_hbag_t b = {0};
        dg_status_t ls = load_tensor(&fs, rows, nrows, &tab.t[i], t, &b);
        ckpt_hbag_close(&b);
        s = ckpt_agree(comm, ls);
    }
    if (!s) s = ckpt_table_hash(comm, t, &tab, ckpt_threads(comm, 0));
    for (int i = 0; i < tab.n && !s; i++) {
        ckpt_mrow_t key;
        snprintf(key.path, sizeof key.path, "%s", tab.t[i].path);
        const ckpt_mrow_t *r = bsearch(&key, rows, (size_t)nrows, sizeof key, row_cmp);
        DG_ASSERT(r != NULL);
        if (r->hash != tab.t[i].hash)
            s = DG_ERR(
                DG_ERR_USAGE,
                "%s:/%s: content hash mismatch (manifest %016llx, data read %016llx): the data or its link "
                "target changed",
                path, tab.t[i].path, (unsigned long long)r->hash, (unsigned long long)tab.t[i].hash);
    }
    if (fs.n > 0)
        ckpt_files_close(&fs);
    else {
        if (fs.lapl >= 0) H5Pclose(fs.lapl);
        if (fs.fapl >= 0) H5Pclose(fs.fapl);
    }
    free(rows);
    ckpt_table_free(&tab);
    if (!s && meta_out) {
        *meta_out = meta; /* overwritten, not freed: the caller may pass an uninitialised struct */
    } else {
        dg_ckpt_meta_destroy(&meta);
    }
    return s;
}

dg_status_t dg_ckpt_load(MPI_Comm comm, const char *path, dg_ckpt_meta_t *meta_out, dg_ckpt_tensor_t *t,
                         int n) {
    ckpt_lock();
    dg_status_t s = ckpt_load_locked(comm, path, meta_out, t, n, NULL, NULL);
    ckpt_unlock();
    return s;
}
