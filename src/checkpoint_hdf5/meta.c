/* meta.c — the scalar part of a checkpoint: dg_ckpt_meta_t helpers, the root attributes and the
 * /state group (writing and validated reading), its broadcast from rank 0, and the /manifest table. */
#include "ckpt_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "dg_mpi.h"

void dg_ckpt_meta_init(dg_ckpt_meta_t *m) {
    memset(m, 0, sizeof *m);
    m->scaler.scale = 1.0;
}

void dg_ckpt_meta_destroy(dg_ckpt_meta_t *m) {
    free(m->config_text);
    m->config_text = NULL;
}

void dg_ckpt_meta_set_config(dg_ckpt_meta_t *m, const char *text) {
    free(m->config_text);
    m->config_text = text ? dg_xstrdup(text) : NULL;
}

static int key_ok(const char *k) {
    if (!k || !*k || strlen(k) >= sizeof(((dg_ckpt_kv_t *)0)->key)) return 0;
    for (; *k; k++)
        if (!((*k >= 'a' && *k <= 'z') || (*k >= 'A' && *k <= 'Z') || (*k >= '0' && *k <= '9') || *k == '.' ||
              *k == '_' || *k == '-'))
            return 0;
    return 1;
}

dg_status_t dg_ckpt_meta_set_kv(dg_ckpt_meta_t *m, const char *key, const char *value) {
    if (!key_ok(key))
        return DG_ERR(DG_ERR_USAGE, "checkpoint meta key '%s': expected 1-63 characters of A-Z a-z 0-9 . _ -",
                      key ? key : "(null)");
    if (!value || strlen(value) >= sizeof(m->kv[0].value))
        return DG_ERR(DG_ERR_USAGE, "checkpoint meta value for '%s' is missing or longer than %zu bytes", key,
                      sizeof(m->kv[0].value) - 1);
    int i = 0;
    while (i < m->n_kv && strcmp(m->kv[i].key, key) != 0)
        i++;
    if (i == m->n_kv) {
        if (m->n_kv >= DG_CKPT_MAX_KV)
            return DG_ERR(DG_ERR_USAGE, "checkpoint meta: more than %d key/value pairs", DG_CKPT_MAX_KV);
        m->n_kv++;
    }
    snprintf(m->kv[i].key, sizeof m->kv[i].key, "%s", key);
    snprintf(m->kv[i].value, sizeof m->kv[i].value, "%s", value);
    return DG_OK;
}

const char *dg_ckpt_meta_get_kv(const dg_ckpt_meta_t *m, const char *key) {
    for (int i = 0; i < m->n_kv; i++)
        if (strcmp(m->kv[i].key, key) == 0) return m->kv[i].value;
    return NULL;
}

/* ---------------- impossible contents ---------------- */

void dg_ckpt_violation_add(dg_ckpt_violation_t *v, int cap, int *n, const char *field, const char *allowed,
                           const char *value_fmt, ...) {
    if (*n < cap) {
        dg_ckpt_violation_t *x = &v[*n];
        snprintf(x->field, sizeof x->field, "%s", field);
        snprintf(x->allowed, sizeof x->allowed, "%s", allowed);
        va_list ap;
        va_start(ap, value_fmt);
        vsnprintf(x->value, sizeof x->value, value_fmt, ap);
        va_end(ap);
    }
    (*n)++;
}

int dg_ckpt_meta_check(const dg_ckpt_meta_t *m, dg_ckpt_violation_t *v, int cap) {
    int n = 0;
    if (m->step < 0) dg_ckpt_violation_add(v, cap, &n, "step", ">= 0", "%lld", (long long)m->step);
    if (m->tokens < 0) dg_ckpt_violation_add(v, cap, &n, "tokens", ">= 0", "%lld", (long long)m->tokens);
    if (m->loader.epoch < 0)
        dg_ckpt_violation_add(v, cap, &n, "loader_epoch", ">= 0", "%lld", (long long)m->loader.epoch);
    if (m->loader.cursor < 0)
        dg_ckpt_violation_add(v, cap, &n, "loader_cursor", ">= 0", "%lld", (long long)m->loader.cursor);
    uint64_t seen = m->loader.samples_seen;
    if (seen > (uint64_t)INT64_MAX) {
        dg_ckpt_violation_add(v, cap, &n, "loader_samples_seen", "0 .. 2^63-1", "%lld (as a signed value)",
                              (long long)(int64_t)seen);
    } else {
        /* the loader adds every sample it hands out to samples_seen and moves the cursor (wrapping into the
         * next epoch) by the same count, so neither can be ahead of it */
        char why[160];
        if (m->loader.cursor > 0 && (uint64_t)m->loader.cursor > seen) {
            snprintf(why, sizeof why,
                     "0 .. loader_samples_seen = %llu (the cursor never runs ahead of the samples seen)",
                     (unsigned long long)seen);
            dg_ckpt_violation_add(v, cap, &n, "loader_cursor", why, "%lld", (long long)m->loader.cursor);
        }
        if (m->loader.epoch > 0 && (uint64_t)m->loader.epoch > seen) {
            snprintf(why, sizeof why,
                     "0 .. loader_samples_seen = %llu (an epoch ends only after one sample or more)",
                     (unsigned long long)seen);
            dg_ckpt_violation_add(v, cap, &n, "loader_epoch", why, "%lld", (long long)m->loader.epoch);
        }
    }
    if (!isfinite(m->scaler.scale) || !(m->scaler.scale > 0))
        dg_ckpt_violation_add(v, cap, &n, "scaler_scale", "a finite number > 0", "%g", m->scaler.scale);
    if (m->scaler.good_steps < 0)
        dg_ckpt_violation_add(v, cap, &n, "scaler_good_steps", ">= 0", "%lld",
                              (long long)m->scaler.good_steps);
    if (m->world_size < 1) dg_ckpt_violation_add(v, cap, &n, "world_size", ">= 1", "%d", m->world_size);
    if (m->n_rng < 0 || m->n_rng > DG_CKPT_MAX_RNG)
        dg_ckpt_violation_add(v, cap, &n, "rng", "0 .. 64 words", "%d words", m->n_rng);
    return n;
}

dg_status_t dg_ckpt_violations_error(const char *path, const dg_ckpt_violation_t *v, int n) {
    char buf[1800];
    size_t o = 0;
    int shown = n < CKPT_MAX_VIOLATIONS ? n : CKPT_MAX_VIOLATIONS;
    for (int i = 0; i < shown && o < sizeof buf; i++)
        o += (size_t)snprintf(buf + o, sizeof buf - o, "%s%s = %s (allowed: %s)", i ? "; " : "", v[i].field,
                              v[i].value, v[i].allowed);
    if (n > shown && o < sizeof buf) snprintf(buf + o, sizeof buf - o, "; and %d more", n - shown);
    return DG_ERR(DG_ERR_USAGE,
                  "%s: impossible training state (its checksums pass, its values cannot be right): %s", path,
                  buf);
}

/* ---------------- writing ---------------- */

static dg_status_t meta_write(hid_t fid, const dg_ckpt_meta_t *m, int world, const char *base,
                              const char *bases, const char *file, ckpt_hbag_t *b) {
    char where[4200];
    snprintf(where, sizeof where, "%s:/", file);
    DG_TRY(ckpt_attr_put_str(fid, "format", DG_CKPT_FORMAT_NAME, where));
    DG_TRY(ckpt_attr_put_i64(fid, "format_version", DG_CKPT_FORMAT_VERSION, where));
    DG_TRY(ckpt_attr_put_i64(fid, "step", m->step, where));
    DG_TRY(ckpt_attr_put_i64(fid, "tokens", m->tokens, where));
    DG_TRY(ckpt_attr_put_i64(fid, "world_size", world, where));
    DG_TRY(ckpt_attr_put_str(fid, "mesh", m->mesh, where));
    DG_TRY(ckpt_attr_put_str(fid, "config", m->config_text ? m->config_text : "", where));
    DG_TRY(ckpt_attr_put_str(fid, "dgtrain_version", m->version, where));
    DG_TRY(ckpt_attr_put_str(fid, "created", m->created, where));
    DG_TRY(ckpt_attr_put_i64(fid, "created_unix", m->created_unix, where));
    DG_TRY(ckpt_attr_put_str(fid, "hash_algo", CKPT_HASH_ALGO, where));
    DG_TRY(ckpt_attr_put_str(fid, "base", base ? base : "", where));
    DG_TRY(ckpt_attr_put_str(fid, "bases", bases ? bases : "", where));

    snprintf(where, sizeof where, "%s:/state", file);
    hid_t g = ckpt_hbag_add(b, H5Gcreate2(fid, "state", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    DG_H5_CHECK(g, "%s: cannot create the group", where);
    DG_TRY(ckpt_attr_put_i64(g, "loader_epoch", m->loader.epoch, where));
    DG_TRY(ckpt_attr_put_i64(g, "loader_cursor", m->loader.cursor, where));
    DG_TRY(ckpt_attr_put_u64(g, "loader_samples_seen", m->loader.samples_seen, where));
    DG_TRY(ckpt_attr_put_f64(g, "scaler_scale", m->scaler.scale, where));
    DG_TRY(ckpt_attr_put_i64(g, "scaler_good_steps", m->scaler.good_steps, where));
    if (m->n_rng > 0) DG_TRY(ckpt_attr_put_u64v(g, "rng", m->rng, m->n_rng, where));
    snprintf(where, sizeof where, "%s:/state/kv", file);
    hid_t kv = ckpt_hbag_add(b, H5Gcreate2(g, "kv", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    DG_H5_CHECK(kv, "%s: cannot create the group", where);
    for (int i = 0; i < m->n_kv; i++)
        DG_TRY(ckpt_attr_put_str(kv, m->kv[i].key, m->kv[i].value, where));
    return DG_OK;
}

dg_status_t ckpt_meta_write(hid_t fid, const dg_ckpt_meta_t *m, int world, const char *base,
                            const char *bases, const char *file) {
    ckpt_hbag_t b = {0};
    dg_status_t s = meta_write(fid, m, world, base, bases, file, &b);
    ckpt_hbag_close(&b);
    return s;
}

/* ---------------- reading ---------------- */

/* From here on an HDF5 failure means a damaged or foreign file. */
#undef DG_H5_FAIL_CODE
#define DG_H5_FAIL_CODE DG_ERR_USAGE

typedef struct {
    dg_ckpt_meta_t *m;
    const char *where;
    dg_status_t s;
} kv_iter_t;

static herr_t kv_cb(hid_t loc, const char *name, const H5A_info_t *info, void *data) {
    kv_iter_t *it = data;
    (void)info;
    char *v = NULL;
    dg_status_t s = ckpt_attr_get_str_alloc(loc, name, &v, it->where);
    if (!s) {
        s = dg_ckpt_meta_set_kv(it->m, name, v);
        free(v);
    }
    if (s) {
        it->s = s;
        return 1;
    }
    return 0;
}

static dg_status_t meta_read(hid_t fid, dg_ckpt_meta_t *m, char *base, size_t base_cap, char *bases,
                             size_t bases_cap, const char *file, ckpt_hbag_t *b) {
    char where[4200];
    snprintf(where, sizeof where, "%s", file);
    char fmt[64] = "";
    if (!ckpt_attr_exists(fid, "format"))
        return DG_ERR(DG_ERR_USAGE, "%s is an HDF5 file but not a dgtrain checkpoint (no 'format' attribute)",
                      file);
    DG_TRY(ckpt_attr_get_str(fid, "format", fmt, sizeof fmt, where));
    if (strcmp(fmt, DG_CKPT_FORMAT_NAME) != 0)
        return DG_ERR(DG_ERR_USAGE, "%s is not a dgtrain checkpoint (format '%s', expected '%s')", file, fmt,
                      DG_CKPT_FORMAT_NAME);
    int64_t v = 0;
    DG_TRY(ckpt_attr_get_i64(fid, "format_version", &v, where));
    if (v < 1 || v > DG_CKPT_FORMAT_VERSION)
        return DG_ERR(DG_ERR_USAGE,
                      "%s has checkpoint format version %lld; this dgtrain reads versions 1..%d", file,
                      (long long)v, DG_CKPT_FORMAT_VERSION);
    m->format_version = (int)v;
    DG_TRY(ckpt_attr_get_i64(fid, "step", &m->step, where));
    DG_TRY(ckpt_attr_get_i64(fid, "tokens", &m->tokens, where));
    DG_TRY(ckpt_attr_get_i64(fid, "world_size", &v, where));
    m->world_size = (int)v;
    DG_TRY(ckpt_attr_get_str(fid, "mesh", m->mesh, sizeof m->mesh, where));
    char *cfg = NULL;
    DG_TRY(ckpt_attr_get_str_alloc(fid, "config", &cfg, where));
    free(m->config_text);
    m->config_text = cfg;
    DG_TRY(ckpt_attr_get_str(fid, "dgtrain_version", m->version, sizeof m->version, where));
    DG_TRY(ckpt_attr_get_str(fid, "created", m->created, sizeof m->created, where));
    DG_TRY(ckpt_attr_get_i64(fid, "created_unix", &m->created_unix, where));
    char algo[64];
    DG_TRY(ckpt_attr_get_str(fid, "hash_algo", algo, sizeof algo, where));
    if (strcmp(algo, CKPT_HASH_ALGO) != 0)
        return DG_ERR(DG_ERR_USAGE, "%s: unknown content hash '%s' (expected %s)", file, algo,
                      CKPT_HASH_ALGO);
    if (base) DG_TRY(ckpt_attr_get_str(fid, "base", base, base_cap, where));
    if (bases) DG_TRY(ckpt_attr_get_str(fid, "bases", bases, bases_cap, where));

    snprintf(where, sizeof where, "%s:/state", file);
    htri_t e = H5Lexists(fid, "state", H5P_DEFAULT);
    if (e <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return DG_ERR(DG_ERR_USAGE, "%s: group /state is missing", file);
    }
    hid_t g = ckpt_hbag_add(b, H5Gopen2(fid, "state", H5P_DEFAULT));
    DG_H5_CHECK(g, "%s: cannot open", where);
    DG_TRY(ckpt_attr_get_i64(g, "loader_epoch", &m->loader.epoch, where));
    DG_TRY(ckpt_attr_get_i64(g, "loader_cursor", &m->loader.cursor, where));
    DG_TRY(ckpt_attr_get_u64(g, "loader_samples_seen", &m->loader.samples_seen, where));
    DG_TRY(ckpt_attr_get_f64(g, "scaler_scale", &m->scaler.scale, where));
    DG_TRY(ckpt_attr_get_i64(g, "scaler_good_steps", &m->scaler.good_steps, where));
    m->n_rng = 0;
    if (ckpt_attr_exists(g, "rng"))
        DG_TRY(ckpt_attr_get_u64v(g, "rng", m->rng, DG_CKPT_MAX_RNG, &m->n_rng, where));
    m->n_kv = 0;
    snprintf(where, sizeof where, "%s:/state/kv", file);
    e = H5Lexists(g, "kv", H5P_DEFAULT);
    if (e <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return DG_ERR(DG_ERR_USAGE, "%s: group is missing", where);
    }
    hid_t kv = ckpt_hbag_add(b, H5Gopen2(g, "kv", H5P_DEFAULT));
    DG_H5_CHECK(kv, "%s: cannot open", where);
    kv_iter_t it = {m, where, DG_OK};
    hsize_t idx = 0;
    herr_t rc = H5Aiterate2(kv, H5_INDEX_NAME, H5_ITER_INC, &idx, kv_cb, &it);
    if (it.s) return it.s;
    DG_H5_CHECK(rc, "%s: cannot list the attributes", where);
    return DG_OK;
}

dg_status_t ckpt_meta_read(hid_t fid, dg_ckpt_meta_t *m, char *base, size_t base_cap, char *bases,
                           size_t bases_cap, const char *file) {
    ckpt_hbag_t b = {0};
    dg_status_t s = meta_read(fid, m, base, base_cap, bases, bases_cap, file, &b);
    ckpt_hbag_close(&b);
    return s;
}

dg_status_t ckpt_meta_bcast(MPI_Comm comm, const dg_ckpt_meta_t *in, dg_ckpt_meta_t *out) {
    int rank;
    DG_MPI_CHECK(MPI_Comm_rank(comm, &rank));
    dg_ckpt_meta_t tmp = *in;
    tmp.config_text = NULL;
    int64_t clen = in->config_text ? (int64_t)strlen(in->config_text) : -1;
    DG_MPI_CHECK(MPI_Bcast(&tmp, (int)sizeof tmp, MPI_BYTE, 0, comm));
    DG_MPI_CHECK(MPI_Bcast(&clen, 1, MPI_INT64_T, 0, comm));
    if (clen > INT32_MAX - 1) return DG_ERR(DG_ERR_USAGE, "checkpoint config text larger than 2 GiB");
    char *cfg = NULL;
    if (clen >= 0) {
        cfg = dg_xmalloc((size_t)clen + 1);
        if (rank == 0) memcpy(cfg, in->config_text, (size_t)clen);
        int rc = MPI_Bcast(cfg, (int)clen, MPI_BYTE, 0, comm);
        if (rc != MPI_SUCCESS) {
            free(cfg);
            return DG_ERR(DG_ERR_RUNTIME, "MPI_Bcast of the config text failed");
        }
        cfg[clen] = 0;
    }
    tmp.config_text = cfg;
    *out = tmp;
    return DG_OK;
}

/* ---------------- manifest ---------------- */

hid_t ckpt_mrow_type(void) {
    hid_t t = H5Tcreate(H5T_COMPOUND, sizeof(ckpt_mrow_t));
    if (t < 0) return t;
    hid_t s1 = H5Tcopy(H5T_C_S1), s2 = H5Tcopy(H5T_C_S1);
    H5Tset_size(s1, DG_CKPT_MAX_PATH + 1);
    H5Tset_size(s2, 256);
    hsize_t four = DG_CKPT_MAX_NDIM;
    hid_t arr = H5Tarray_create2(H5T_NATIVE_INT64, 1, &four);
    herr_t e = 0;
    e |= H5Tinsert(t, "path", HOFFSET(ckpt_mrow_t, path), s1);
    e |= H5Tinsert(t, "ndim", HOFFSET(ckpt_mrow_t, ndim), H5T_NATIVE_INT32);
    e |= H5Tinsert(t, "shape", HOFFSET(ckpt_mrow_t, shape), arr);
    e |= H5Tinsert(t, "xxh3", HOFFSET(ckpt_mrow_t, hash), H5T_NATIVE_UINT64);
    e |= H5Tinsert(t, "origin", HOFFSET(ckpt_mrow_t, origin), s2);
    H5Tclose(s1), H5Tclose(s2), H5Tclose(arr);
    if (e < 0) {
        H5Tclose(t);
        return -1;
    }
    return t;
}

static dg_status_t manifest_read(hid_t fid, ckpt_mrow_t **rows, int *n, const char *file, ckpt_hbag_t *b) {
    htri_t e = H5Lexists(fid, "manifest", H5P_DEFAULT);
    if (e <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return DG_ERR(DG_ERR_USAGE, "%s: dataset /manifest is missing (not a complete dgtrain checkpoint)",
                      file);
    }
    hid_t d = ckpt_hbag_add(b, H5Dopen2(fid, "manifest", H5P_DEFAULT));
    DG_H5_CHECK(d, "%s:/manifest: cannot open", file);
    hid_t sp = ckpt_hbag_add(b, H5Dget_space(d));
    DG_H5_CHECK(sp, "%s:/manifest", file);
    hssize_t cnt = H5Sget_simple_extent_npoints(sp);
    if (cnt < 0 || cnt > 10000000 || H5Sget_simple_extent_ndims(sp) != 1)
        return DG_ERR(DG_ERR_USAGE, "%s:/manifest has an unexpected shape", file);
    hid_t mt = ckpt_hbag_add(b, ckpt_mrow_type());
    DG_H5_CHECK(mt, "%s:/manifest: type", file);
    ckpt_mrow_t *r = dg_xcalloc((size_t)(cnt > 0 ? cnt : 1), sizeof *r);
    if (cnt > 0 && H5Dread(d, mt, H5S_ALL, H5S_ALL, H5P_DEFAULT, r) < 0) {
        free(r);
        return ckpt_h5_fail(DG_ERR_USAGE, __FILE__, __LINE__, "H5Dread()", "%s:/manifest: cannot read", file);
    }
    for (hssize_t i = 0; i < cnt; i++) {
        r[i].path[DG_CKPT_MAX_PATH] = 0;
        r[i].origin[255] = 0;
        int ok = r[i].ndim >= 1 && r[i].ndim <= DG_CKPT_MAX_NDIM && r[i].path[0];
        for (int k = 0; ok && k < r[i].ndim; k++)
            ok = r[i].shape[k] >= 1;
        if (!ok) {
            free(r);
            return DG_ERR(DG_ERR_USAGE, "%s:/manifest row %lld is malformed", file, (long long)i);
        }
    }
    *rows = r;
    *n = (int)cnt;
    return DG_OK;
}

dg_status_t ckpt_manifest_read(hid_t fid, ckpt_mrow_t **rows, int *n, const char *file) {
    ckpt_hbag_t b = {0};
    *rows = NULL;
    *n = 0;
    dg_status_t s = manifest_read(fid, rows, n, file, &b);
    ckpt_hbag_close(&b);
    return s;
}
