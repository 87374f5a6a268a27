/* inspect.c — serial access to checkpoints, without MPI: structural check, full verification (every
 * chunk read and checksummed, every content hash recomputed, links followed and confined), the info
 * used by `dgckpt show`, whole-dataset reads for `dgckpt diff`, safetensors export, and directory
 * listing. resolve_resume splits a full verification over ranks through ckpt_verify_locked. */
#define _GNU_SOURCE
#define DG_H5_FAIL_CODE DG_ERR_USAGE
#include "ckpt_impl.h"
#include "dg_fs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---------------- hashing a whole dataset in blocks ---------------- */

/* Read `dset` in blocks of at most ~64 MiB aligned to its chunks (each chunk is read and checksummed
 * once) and compute its content hash. */
static dg_status_t hash_dataset(hid_t dset, const char *where, const char *path, int ndim,
                                const int64_t *shape, uint64_t *hash_out, ckpt_hbag_t *b) {
    const int64_t budget = 16 << 20; /* elements */
    int k = 0;
    for (; k < ndim - 1; k++) {
        int64_t inner = 1;
        for (int d = k + 1; d < ndim; d++)
            inner *= shape[d];
        if (inner <= budget) break;
    }
    int64_t inner = 1;
    for (int d = k + 1; d < ndim; d++)
        inner *= shape[d];
    int64_t B = budget / inner;
    if (B < 1) B = 1;
    hid_t dcpl = ckpt_hbag_add(b, H5Dget_create_plist(dset));
    DG_H5_CHECK(dcpl, "%s", where);
    hsize_t ch[H5S_MAX_RANK];
    if (H5Pget_layout(dcpl) == H5D_CHUNKED && H5Pget_chunk(dcpl, ndim, ch) == ndim && (int64_t)ch[k] <= B)
        B = B / (int64_t)ch[k] * (int64_t)ch[k];
    if (B > shape[k]) B = shape[k];
    float *buf = dg_xmalloc((size_t)(B * inner) * sizeof(float));
    ckpt_table_t tab = {0};
    ckpt_tdesc_t td;
    memset(&td, 0, sizeof td);
    td.path = path;
    td.ndim = ndim;
    memcpy(td.gshape, shape, sizeof(int64_t) * (size_t)ndim);
    tab.n = 1;
    tab.t = &td;
    ckh_t h;
    ckh_init(&h, 1);
    int64_t idx[DG_CKPT_MAX_NDIM] = {0};
    dg_status_t s = DG_OK;
    hid_t fsp = ckpt_hbag_add(b, H5Dget_space(dset));
    if (fsp < 0) s = ckpt_h5_fail(DG_ERR_USAGE, __FILE__, __LINE__, "H5Dget_space()", "%s", where);
    while (!s) {
        for (int64_t b0 = 0; b0 < shape[k] && !s; b0 += B) {
            int64_t st[DG_CKPT_MAX_NDIM], cn[DG_CKPT_MAX_NDIM];
            hsize_t hst[DG_CKPT_MAX_NDIM], hcn[DG_CKPT_MAX_NDIM];
            for (int d = 0; d < ndim; d++) {
                st[d] = d < k ? idx[d] : d == k ? b0 : 0;
                cn[d] = d < k ? 1 : d == k ? (b0 + B <= shape[k] ? B : shape[k] - b0) : shape[d];
                hst[d] = (hsize_t)st[d], hcn[d] = (hsize_t)cn[d];
            }
            hid_t ms = H5Screate_simple(ndim, hcn, NULL);
            herr_t rc = ms < 0 ? -1 : H5Sselect_hyperslab(fsp, H5S_SELECT_SET, hst, NULL, hcn, NULL);
            if (rc >= 0) rc = H5Dread(dset, H5T_NATIVE_FLOAT, ms, fsp, H5P_DEFAULT, buf);
            char h5[1024] = "";
            if (rc < 0) ckpt_h5_error_text(h5, sizeof h5); /* before H5Sclose clears the error stack */
            if (ms >= 0) H5Sclose(ms);
            if (rc < 0) {
                if (strstr(h5, "Fletcher32") || strstr(h5, "checksum"))
                    s = DG_ERR(
                        DG_ERR_USAGE,
                        "%s: checksum mismatch (Fletcher32) in the block at index %lld of dim %d: the file "
                        "is damaged [%s]",
                        where, (long long)b0, k, h5);
                else
                    s = DG_ERR(DG_ERR_USAGE, "%s: cannot read: %s", where, h5);
                break;
            }
            ckh_add(&h, 0, ndim, shape, st, cn, buf);
        }
        int d = k - 1;
        for (; d >= 0; d--) {
            if (++idx[d] < shape[d]) break;
            idx[d] = 0;
        }
        if (d < 0) break;
    }
    if (!s) s = ckh_finish(&h, MPI_COMM_NULL, &tab, hash_out);
    ckh_free(&h);
    free(buf);
    return s;
}

static int row_cmp(const void *a, const void *b) {
    return strcmp(((const ckpt_mrow_t *)a)->path, ((const ckpt_mrow_t *)b)->path);
}

/* Check one manifest row: resolution, origin, shape, stored hash attribute; with `full`, read and rehash. */
static dg_status_t check_row(ckpt_files_t *fs, const ckpt_mrow_t *r, int full, int *linked, ckpt_hbag_t *b) {
    hid_t dset = -1;
    int fidx = 0;
    char where[1100];
    DG_TRY(ckpt_open_row(fs, r->path, r->origin, r->ndim, r->shape, b, &dset, &fidx, where, sizeof where));
    uint64_t h = 0;
    DG_TRY(ckpt_attr_get_u64(dset, "xxh3", &h, where));
    if (h != r->hash)
        return DG_ERR(DG_ERR_USAGE, "%s: hash attribute %016llx differs from the manifest's %016llx", where,
                      (unsigned long long)h, (unsigned long long)r->hash);
    *linked = fidx != 0;
    if (!full) return DG_OK;
    uint64_t got = 0;
    DG_TRY(hash_dataset(dset, where, r->path, r->ndim, r->shape, &got, b));
    if (got != r->hash)
        return DG_ERR(DG_ERR_USAGE,
                      "%s: content hash mismatch (stored %016llx, data gives %016llx): the data changed",
                      where, (unsigned long long)r->hash, (unsigned long long)got);
    return DG_OK;
}

typedef struct {
    const ckpt_mrow_t *rows;
    int n;
    char bad[512];
    const char *file;
} visit_t;

static herr_t visit_cb(hid_t g, const char *name, const H5L_info_t *li, void *data) {
    visit_t *v = data;
    if (!strcmp(name, "manifest") || !strcmp(name, "state") || !strncmp(name, "state/", 6)) return 0;
    int is_data = li->type == H5L_TYPE_EXTERNAL || li->type == H5L_TYPE_SOFT;
    if (li->type == H5L_TYPE_HARD) {
        H5O_info_t oi;
        if (H5Oget_info_by_name2(g, name, &oi, H5O_INFO_BASIC, H5P_DEFAULT) < 0) {
            H5Eclear2(H5E_DEFAULT);
            return 0;
        }
        is_data = oi.type != H5O_TYPE_GROUP;
    }
    if (!is_data) return 0;
    ckpt_mrow_t key;
    snprintf(key.path, sizeof key.path, "%s", name);
    if (!bsearch(&key, v->rows, (size_t)v->n, sizeof key, row_cmp)) {
        snprintf(v->bad, sizeof v->bad, "%s: /%s is not listed in the manifest", v->file, name);
        return 1;
    }
    return 0;
}

static dg_status_t verify_impl(const char *path, FILE *report, int *n_bad, int rank, int nranks, int full) {
    ckpt_files_t fs;
    int bad = 0;
    if (n_bad) *n_bad = 0;
    dg_status_t s = ckpt_files_open(&fs, path, MPI_COMM_NULL);
    if (s) {
        if (report) fprintf(report, "BAD   %s\n", dg_last_error());
        if (n_bad) *n_bad = 1;
        if (fs.lapl >= 0) H5Pclose(fs.lapl);
        if (fs.fapl >= 0) H5Pclose(fs.fapl);
        return s;
    }
    dg_ckpt_meta_t meta;
    dg_ckpt_meta_init(&meta);
    ckpt_mrow_t *rows = NULL;
    int nrows = 0;
    s = ckpt_meta_read(fs.fid[0], &meta, NULL, 0, NULL, 0, path);
    /* impossible values in the state: reported, and the datasets are still checked */
    dg_ckpt_violation_t viol[CKPT_MAX_VIOLATIONS];
    int nviol = s ? 0 : dg_ckpt_meta_check(&meta, viol, CKPT_MAX_VIOLATIONS);
    char viol_msg[2048] = "";
    if (nviol) {
        dg_ckpt_violations_error(path, viol, nviol);
        snprintf(viol_msg, sizeof viol_msg, "%s", dg_last_error());
        dg_clear_error();
        for (int i = 0; report && i < nviol && i < CKPT_MAX_VIOLATIONS; i++)
            fprintf(report, "BAD   %s: state: %s = %s (allowed: %s)\n", path, viol[i].field, viol[i].value,
                    viol[i].allowed);
    }
    if (!s) s = ckpt_manifest_read(fs.fid[0], &rows, &nrows, path);
    dg_ckpt_meta_destroy(&meta);
    if (!s) {
        ckpt_mrow_t *sorted = dg_xmalloc((size_t)(nrows > 0 ? nrows : 1) * sizeof *sorted);
        memcpy(sorted, rows, (size_t)nrows * sizeof *rows);
        qsort(sorted, (size_t)nrows, sizeof *sorted, row_cmp);
        for (int i = 1; i < nrows && !s; i++)
            if (!strcmp(sorted[i].path, sorted[i - 1].path))
                s = DG_ERR(DG_ERR_USAGE, "%s: /manifest lists /%s twice", path, sorted[i].path);
        if (!s && rank == 0) {
            visit_t v = {sorted, nrows, "", path};
            H5Lvisit(fs.fid[0], H5_INDEX_NAME, H5_ITER_INC, visit_cb, &v);
            H5Eclear2(H5E_DEFAULT);
            if (v.bad[0]) s = DG_ERR(DG_ERR_USAGE, "%s", v.bad);
        }
        free(sorted);
    }
    if (s) {
        if (report) fprintf(report, "BAD   %s\n", dg_last_error());
        bad = 1;
    }
    dg_status_t first = s;
    char first_msg[2048];
    snprintf(first_msg, sizeof first_msg, "%s", s ? dg_last_error() : "");
    if (!first && nviol) {
        first = DG_ERR_USAGE;
        snprintf(first_msg, sizeof first_msg, "%s", viol_msg);
    }
    bad += nviol;
    double t0 = dg_now_s();
    int64_t bytes = 0;
    int nchecked = 0;
    for (int i = 0; !s && i < nrows; i++) {
        if (i % nranks != rank) continue;
        ckpt_hbag_t b = {0};
        int linked = 0;
        dg_status_t rs = check_row(&fs, &rows[i], full, &linked, &b);
        ckpt_hbag_close(&b);
        nchecked++;
        int64_t nb = ckpt_numel(rows[i].ndim, rows[i].shape) * 4;
        if (rs) {
            bad++;
            if (report) fprintf(report, "BAD   %s\n", dg_last_error());
            if (!first) {
                first = rs;
                snprintf(first_msg, sizeof first_msg, "%s", dg_last_error());
            }
        } else {
            bytes += nb;
            if (report) {
                char shp[200];
                size_t o = 0;
                shp[0] = 0;
                for (int d = 0; d < rows[i].ndim; d++)
                    o += (size_t)snprintf(shp + o, sizeof shp - o, "%s%lld", d ? ", " : "",
                                          (long long)rows[i].shape[d]);
                fprintf(report, "ok    /%-48s [%s] %lld bytes%s%s\n", rows[i].path, shp, (long long)nb,
                        linked ? ", linked -> " : "", linked ? rows[i].origin : "");
            }
        }
    }
    if (report)
        fprintf(report, "%s: %d datasets checked, %d bad%s, %.1f MB %s in %.2f s\n", path, nchecked, bad,
                bad ? "" : " (checksums and content hashes match)", (double)bytes / 1e6,
                full ? "read" : "checked", dg_now_s() - t0);
    free(rows);
    ckpt_files_close(&fs);
    if (n_bad) *n_bad = bad;
    if (first) return DG_ERR(first, "%s", first_msg);
    return DG_OK;
}

dg_status_t ckpt_verify_locked(const char *path, FILE *report, int *n_bad, int rank, int nranks) {
    return verify_impl(path, report, n_bad, rank, nranks, 1);
}

dg_status_t ckpt_check_locked(const char *path) {
    return verify_impl(path, NULL, NULL, 0, 1, 0);
}

dg_status_t dg_ckpt_verify(const char *path, FILE *report, int *n_bad) {
    ckpt_lock();
    dg_status_t s = ckpt_verify_locked(path, report, n_bad, 0, 1);
    ckpt_unlock();
    return s;
}

dg_status_t dg_ckpt_check(const char *path) {
    ckpt_lock();
    dg_status_t s = ckpt_check_locked(path);
    ckpt_unlock();
    return s;
}

/* ---------------- info ---------------- */

dg_status_t ckpt_info_read_locked(const char *path, dg_ckpt_info_t *info) {
    memset(info, 0, sizeof *info);
    dg_ckpt_meta_init(&info->meta);
    ckpt_files_t fs;
    dg_status_t s = ckpt_files_open(&fs, path, MPI_COMM_NULL);
    if (s) {
        if (fs.lapl >= 0) H5Pclose(fs.lapl);
        if (fs.fapl >= 0) H5Pclose(fs.fapl);
        return s;
    }
    s = ckpt_meta_read(fs.fid[0], &info->meta, info->base, sizeof info->base, info->bases, sizeof info->bases,
                       path);
    ckpt_mrow_t *rows = NULL;
    int n = 0;
    if (!s) s = ckpt_manifest_read(fs.fid[0], &rows, &n, path);
    if (!s) {
        info->entries = dg_xcalloc((size_t)(n > 0 ? n : 1), sizeof *info->entries);
        info->n_entries = n;
        for (int i = 0; i < n; i++) {
            dg_ckpt_entry_t *e = &info->entries[i];
            snprintf(e->path, sizeof e->path, "%s", rows[i].path);
            e->ndim = rows[i].ndim;
            memcpy(e->shape, rows[i].shape, sizeof e->shape);
            e->hash = rows[i].hash;
            snprintf(e->origin, sizeof e->origin, "%s", rows[i].origin);
        }
        struct stat st;
        if (stat(path, &st) == 0) info->file_bytes = (int64_t)st.st_size;
    }
    free(rows);
    ckpt_files_close(&fs);
    if (s) dg_ckpt_info_destroy(info);
    return s;
}

dg_status_t dg_ckpt_info_read(const char *path, dg_ckpt_info_t *info) {
    ckpt_lock();
    dg_status_t s = ckpt_info_read_locked(path, info);
    ckpt_unlock();
    return s;
}

void dg_ckpt_info_destroy(dg_ckpt_info_t *info) {
    dg_ckpt_meta_destroy(&info->meta);
    free(info->entries);
    info->entries = NULL;
    info->n_entries = 0;
}

/* ---------------- whole datasets ---------------- */

static dg_status_t read_whole(ckpt_files_t *fs, const char *dset_path, float **data, int64_t *numel,
                              ckpt_hbag_t *b) {
    while (*dset_path == '/')
        dset_path++;
    hid_t d = -1;
    int fidx = 0;
    DG_TRY(ckpt_resolve(fs, dset_path, &d, &fidx));
    ckpt_hbag_add(b, d);
    char where[1100];
    snprintf(where, sizeof where, "%s:/%s", fs->name[fidx], dset_path);
    hid_t t = ckpt_hbag_add(b, H5Dget_type(d));
    hid_t sp = ckpt_hbag_add(b, H5Dget_space(d));
    DG_H5_CHECK(t, "%s", where);
    DG_H5_CHECK(sp, "%s", where);
    if (H5Tget_class(t) != H5T_FLOAT || H5Tget_size(t) != 4)
        return DG_ERR(DG_ERR_USAGE, "%s is not a float32 dataset", where);
    hssize_t n = H5Sget_simple_extent_npoints(sp);
    DG_H5_CHECK(n, "%s", where);
    float *buf = dg_xmalloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (n > 0 && H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) < 0) {
        free(buf);
        char h5[1024];
        ckpt_h5_error_text(h5, sizeof h5);
        if (strstr(h5, "Fletcher32") || strstr(h5, "checksum"))
            return DG_ERR(DG_ERR_USAGE, "%s: checksum mismatch (Fletcher32): the file is damaged [%s]", where,
                          h5);
        return DG_ERR(DG_ERR_USAGE, "%s: cannot read: %s", where, h5);
    }
    *data = buf;
    *numel = (int64_t)n;
    return DG_OK;
}

dg_status_t dg_ckpt_read_dataset(const char *path, const char *dset, float **data, int64_t *numel) {
    ckpt_lock();
    ckpt_files_t fs;
    *data = NULL;
    *numel = 0;
    dg_status_t s = ckpt_files_open(&fs, path, MPI_COMM_NULL);
    if (!s) {
        ckpt_hbag_t b = {0};
        s = read_whole(&fs, dset, data, numel, &b);
        ckpt_hbag_close(&b);
        ckpt_files_close(&fs);
    } else {
        if (fs.lapl >= 0) H5Pclose(fs.lapl);
        if (fs.fapl >= 0) H5Pclose(fs.fapl);
    }
    ckpt_unlock();
    return s;
}

/* ---------------- safetensors ---------------- */

typedef struct {
    const dg_ckpt_entry_t *e;
    const char *name;
} st_item_t;

static int st_cmp(const void *a, const void *b) {
    return strcmp(((const st_item_t *)a)->name, ((const st_item_t *)b)->name);
}

static dg_status_t export_impl(const char *path, const char *out, int all, ckpt_files_t *fs,
                               dg_ckpt_info_t *info, const char *tmp, int fd) {
    st_item_t *it = dg_xcalloc((size_t)(info->n_entries > 0 ? info->n_entries : 1), sizeof *it);
    int n = 0;
    for (int i = 0; i < info->n_entries; i++) {
        const char *p = info->entries[i].path;
        if (all)
            it[n++] = (st_item_t){&info->entries[i], p};
        else if (!strncmp(p, "model/", 6))
            it[n++] = (st_item_t){&info->entries[i], p + 6};
    }
    if (n == 0) {
        free(it);
        return DG_ERR(DG_ERR_USAGE, "%s has no model/ tensors to export (use --all to export every tensor)",
                      path);
    }
    qsort(it, (size_t)n, sizeof *it, st_cmp);
    /* header: JSON with dtype, shape and [begin, end) byte offsets into the data block */
    size_t cap = 256 + (size_t)n * 400, len = 0;
    char *h = dg_xmalloc(cap);
    len +=
        (size_t)snprintf(h + len, cap - len,
                         "{\"__metadata__\":{\"format\":\"pt\",\"producer\":\"dgtrain %s\",\"step\":\"%lld\","
                         "\"checkpoint\":\"%s\"}",
                         DG_VERSION_STRING, (long long)info->meta.step, ckpt_basename(path));
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        const dg_ckpt_entry_t *e = it[i].e;
        uint64_t nb = (uint64_t)ckpt_numel(e->ndim, e->shape) * 4;
        len += (size_t)snprintf(h + len, cap - len, ",\"%s\":{\"dtype\":\"F32\",\"shape\":[", it[i].name);
        for (int d = 0; d < e->ndim; d++)
            len += (size_t)snprintf(h + len, cap - len, "%s%lld", d ? "," : "", (long long)e->shape[d]);
        len += (size_t)snprintf(h + len, cap - len, "],\"data_offsets\":[%llu,%llu]}",
                                (unsigned long long)off, (unsigned long long)(off + nb));
        off += nb;
    }
    len += (size_t)snprintf(h + len, cap - len, "}");
    DG_ASSERT(len + 8 < cap);
    while (len % 8)
        h[len++] = ' '; /* the data block starts 8-byte aligned */
    uint8_t le[8];
    for (int i = 0; i < 8; i++)
        le[i] = (uint8_t)((uint64_t)len >> (8 * i));
    dg_status_t s = dg_fs_write_all(fd, le, 8, tmp);
    if (!s) s = dg_fs_write_all(fd, h, len, tmp);
    free(h);
    for (int i = 0; i < n && !s; i++) {
        float *data = NULL;
        int64_t ne = 0;
        ckpt_hbag_t b = {0};
        s = read_whole(fs, it[i].e->path, &data, &ne, &b);
        ckpt_hbag_close(&b);
        if (!s && ne != ckpt_numel(it[i].e->ndim, it[i].e->shape))
            s = DG_ERR(DG_ERR_USAGE, "%s:/%s does not match its manifest shape", path, it[i].e->path);
        if (!s)
            s = dg_fs_write_all(fd, data, (size_t)ne * 4,
                                tmp); /* x86 is little-endian, as safetensors wants */
        free(data);
    }
    free(it);
    if (!s && fsync(fd) != 0) s = DG_ERR(DG_ERR_RUNTIME, "fsync %s: %s", tmp, strerror(errno));
    (void)out;
    return s;
}

dg_status_t dg_ckpt_export_safetensors(const char *path, const char *out, int all_tensors) {
    ckpt_lock();
    dg_ckpt_info_t info;
    dg_status_t s = ckpt_info_read_locked(path, &info);
    if (s) {
        ckpt_unlock();
        return s;
    }
    ckpt_files_t fs;
    s = ckpt_files_open(&fs, path, MPI_COMM_NULL);
    if (s) {
        dg_ckpt_info_destroy(&info);
        ckpt_unlock();
        return s;
    }
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", out, (int)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0666);
    if (fd < 0) {
        s = DG_ERR(DG_ERR_RUNTIME, "cannot create %s: %s", tmp, strerror(errno));
    } else {
        s = export_impl(path, out, all_tensors, &fs, &info, tmp, fd);
        close(fd);
        if (!s && rename(tmp, out) != 0)
            s = DG_ERR(DG_ERR_RUNTIME, "cannot rename %s to %s: %s", tmp, out, strerror(errno));
        if (s) unlink(tmp);
    }
    ckpt_files_close(&fs);
    dg_ckpt_info_destroy(&info);
    ckpt_unlock();
    return s;
}

/* ---------------- directory listing ---------------- */

static int dent_cmp(const void *a, const void *b) {
    const dg_ckpt_dir_entry_t *x = a, *y = b;
    if (x->step != y->step) return x->step > y->step ? -1 : 1;
    return x->partial - y->partial;
}

dg_status_t dg_ckpt_list_dir(const char *dir, dg_ckpt_dir_entry_t **entries, int *n_out, char *latest) {
    *entries = NULL;
    *n_out = 0;
    if (latest) {
        latest[0] = 0;
        if (ckpt_read_latest(dir, latest, 256) != DG_OK) latest[0] = 0;
        dg_clear_error();
    }
    DIR *d = opendir(dir);
    if (!d) {
        if (errno == ENOENT) return DG_OK;
        return DG_ERR(DG_ERR_USAGE, "cannot list checkpoint directory %s: %s", dir, strerror(errno));
    }
    int cap = 16, n = 0;
    dg_ckpt_dir_entry_t *e = dg_xmalloc((size_t)cap * sizeof *e);
    struct dirent *de;
    while ((de = readdir(d))) {
        int partial = 0;
        int64_t step = ckpt_parse_name(de->d_name, &partial);
        if (step < 0 || strlen(de->d_name) >= sizeof e[0].name) continue;
        char p[4400];
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        struct stat st;
        if (stat(p, &st) != 0 || !S_ISREG(st.st_mode)) continue;
        if (n == cap) {
            cap *= 2;
            e = realloc(e, (size_t)cap * sizeof *e);
            DG_ASSERTF(e != NULL, "out of memory");
        }
        snprintf(e[n].name, sizeof e[n].name, "%s", de->d_name);
        e[n].step = step;
        e[n].partial = partial;
        e[n].bytes = (int64_t)st.st_size;
        n++;
    }
    closedir(d);
    qsort(e, (size_t)n, sizeof *e, dent_cmp);
    *entries = e;
    *n_out = n;
    return DG_OK;
}
