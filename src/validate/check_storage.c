/* check_storage.c — the checkpoint filesystem:
 *   storage.write     a synthetic state of validate.storage_mb MB (one fp32 tensor, one row per rank)
 *                     written through the real checkpoint path (dg_ckpt_save: collective parallel HDF5,
 *                     Fletcher32 chunks, content hashes, close + fsync on every rank, atomic rename);
 *                     bandwidth = bytes / the slowest rank's wall time
 *   storage.read      the same checkpoint read back (dg_ckpt_load: checksums and hashes verified), after
 *                     each node dropped the file from its page cache (posix_fadvise DONTNEED: honoured
 *                     by local file systems and NFS; some parallel file systems ignore it, see docs);
 *                     every element compared with what was written
 *   storage.metadata  per rank, validate.storage_meta_files times: create + 4 KiB write + fsync + close
 *                     ("create"), then rename + directory fsync ("rename") — the steps of an atomic
 *                     commit; the worst rank's median latency of each is compared with
 *                     ref.storage.create / ref.storage.rename
 * Everything goes to a fresh directory <storage_dir>/dgvalidate-<id>/ that is removed afterwards.
 * A directory that cannot be written is a FAIL of these checks (naming the path, ranks and hosts),
 * not an error of the harness: finding that out is what they are for.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "validate_impl.h"

static inline float pat(int r, int64_t i) {
    uint32_t x = (uint32_t)r * 2654435761u ^ (uint32_t)i * 40503u ^ (uint32_t)(i >> 16) * 97u;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    return (float)(x & 0xffffff) / 1024.0f;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *f) {
    (void)sb;
    (void)f;
    if (flag == FTW_DP)
        rmdir(path);
    else
        unlink(path);
    return 0;
}

/* Append " (rank R is on HOST)" to a checkpoint message "rank R: ..." so the host is named too. */
static void name_host(const vctx_t *c, const char *msg, char *out, size_t cap) {
    int r = -1;
    if (sscanf(msg, "rank %d:", &r) == 1 && r >= 0 && r < c->size)
        snprintf(out, cap, "%s (rank %d is on %s)", msg, r, c->b->hosts[r]);
    else
        snprintf(out, cap, "%s", msg);
}

static void fail_check(vctx_t *c, const char *name, dg_verdict_t v, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void fail_check(vctx_t *c, const char *name, dg_verdict_t v, const char *fmt, ...) {
    dg_vcheck_t *k = vc_add(c, name);
    if (!k) return;
    k->verdict = v;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(k->message, sizeof k->message, fmt, ap);
    va_end(ap);
}

/* ---------------------------------------------------------------- write + read */

static void judge_bw(vctx_t *c, const char *name, double bytes, double seconds, long long wrong,
                     const char *extra, const char *details) {
    dg_vcheck_t *k = vc_add(c, name);
    if (!k) return;
    double bw = seconds > 0 ? bytes / seconds : 0;
    char v[32];
    vc_fmt_value(v, sizeof v, bw, DG_DIM_BANDWIDTH);
    snprintf(k->measured, sizeof k->measured, "%s (%.1f MB in %.3f s%s%s)", v, bytes / 1e6, seconds,
             extra ? ", " : "", extra ? extra : "");
    k->has_value = 1;
    k->value = bw;
    snprintf(k->unit, sizeof k->unit, "B/s");
    k->seconds = seconds;
    const dg_sla_ref_t *ref = vc_group_ref(c, name, c->type_of_rank, c->size);
    vbuf_t why = {0};
    if (ref) {
        dg_sla_ref_format(ref, k->reference, sizeof k->reference);
        if (!dg_sla_ref_ok(ref, bw)) {
            char lim[200];
            dg_sla_ref_format(ref, lim, sizeof lim);
            char where[1024];
            vc_fmt_all_nodes(c, where, sizeof where);
            vbuf_printf(&why, "%s aggregate over %d rank%s on %s, want %s", v, c->size,
                        c->size == 1 ? "" : "s", where, lim);
        }
    } else {
        snprintf(k->message, sizeof k->message, "no reference ref.%s in the SLA: measured only", name);
    }
    if (wrong)
        vbuf_printf(&why, "%s%lld elements read back differ from what was written", why.n ? "; " : "", wrong);
    if (why.n) {
        k->verdict = DG_VERDICT_FAIL;
        snprintf(k->message, sizeof k->message, "%s", why.s);
    }
    if (details) dg_vcheck_set_details(k, details);
    vbuf_free(&why);
}

static dg_status_t write_read(vctx_t *c, const char *dir, int want_write, int want_read) {
    MPI_Comm w = c->b->world;
    int64_t per = (int64_t)(c->set->storage_mb * 1e6 / sizeof(float) / c->size);
    if (per < 1) per = 1;
    float *data = dg_xmalloc((size_t)per * sizeof(float));
    for (int64_t i = 0; i < per; i++)
        data[i] = pat(c->rank, i);
    dg_ckpt_tensor_t t = {.path = "validate/data", .ndim = 2, .owner = 1, .data = data};
    t.gshape[0] = c->size;
    t.gshape[1] = per;
    t.start[0] = c->rank;
    t.count[0] = 1;
    t.count[1] = per;
    dg_ckpt_meta_t meta;
    dg_ckpt_meta_init(&meta);
    meta.step = 1;
    snprintf(meta.mesh, sizeof meta.mesh, "validate");
    dg_ckpt_save_opts_t o;
    dg_ckpt_save_opts_default(&o);
    o.keep = 1;
    dg_ckpt_save_result_t res;
    memset(&res, 0, sizeof res);

    DG_TRY(vc_quiet_barrier(c, w, "storage.write"));
    double t0 = dg_now_s();
    dg_status_t s = dg_ckpt_save(w, dir, &meta, &t, 1, &o, &res); /* agreed on every rank */
    double dt = dg_now_s() - t0, wt = 0;
    DG_MPI_CHECK(MPI_Allreduce(&dt, &wt, 1, MPI_DOUBLE, MPI_MAX, w));
    dg_ckpt_meta_destroy(&meta);
    double bytes = (double)per * c->size * sizeof(float);
    char msg[2048];
    if (s != DG_OK) {
        char m[1800];
        name_host(c, dg_last_error(), m, sizeof m);
        if (want_write)
            fail_check(c, "storage.write", DG_VERDICT_FAIL, "checkpoint write to %s failed: %s", dir, m);
        if (want_read)
            vc_skip(c, "storage.read", "nothing to read: the checkpoint write failed (see storage.write)");
        free(data);
        return DG_OK;
    }
    if (want_write && c->rank == 0) {
        vbuf_t det = {0};
        vbuf_printf(&det, "{\"file\": ");
        vbuf_json_str(&det, res.path);
        vbuf_printf(&det,
                    ", \"file_bytes\": %lld, \"logical_bytes\": %.0f, \"seconds\": %.6f, \"ranks\": %d}",
                    (long long)res.bytes, bytes, wt, c->size);
        char extra[64];
        snprintf(extra, sizeof extra, "incl. fsync + commit");
        judge_bw(c, "storage.write", bytes, wt, 0, extra, det.s);
        vbuf_free(&det);
    }
    if (!want_read) {
        free(data);
        return DG_OK;
    }
    /* each node forgets the file's pages, so the read measures the file system, not memory */
    char path[4096];
    snprintf(path, sizeof path, "%s", res.path);
    DG_MPI_CHECK(MPI_Bcast(path, sizeof path, MPI_CHAR, 0, w));
    if (c->b->local_rank == 0) {
        int fd = open(path, O_RDONLY);
        if (fd >= 0) {
            (void)posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
            close(fd);
        }
    }
    memset(data, 0, (size_t)per * sizeof(float));
    DG_TRY(vc_quiet_barrier(c, w, "storage.read"));
    t0 = dg_now_s();
    s = dg_ckpt_load(w, path, NULL, &t, 1);
    dt = dg_now_s() - t0;
    double rt = 0;
    DG_MPI_CHECK(MPI_Allreduce(&dt, &rt, 1, MPI_DOUBLE, MPI_MAX, w));
    long long wrong = 0, total_wrong = 0;
    if (s == DG_OK)
        for (int64_t i = 0; i < per; i++)
            wrong += data[i] != pat(c->rank, i);
    DG_MPI_CHECK(MPI_Reduce(&wrong, &total_wrong, 1, MPI_LONG_LONG, MPI_SUM, 0, w));
    if (s != DG_OK) {
        name_host(c, dg_last_error(), msg, sizeof msg);
        fail_check(c, "storage.read", DG_VERDICT_FAIL, "checkpoint read of %s failed: %s", path, msg);
    } else if (c->rank == 0) {
        judge_bw(c, "storage.read", bytes, rt, total_wrong, "page cache dropped", NULL);
    }
    free(data);
    return DG_OK;
}

/* ---------------------------------------------------------------- metadata */

static dg_status_t meta_local(vctx_t *c, const char *dir, double *create_med, double *rename_med) {
    int n = c->set->storage_meta_files;
    char d[4200];
    snprintf(d, sizeof d, "%s/meta/rank-%d", dir, c->rank);
    DG_TRY(dg_mkdir_p(d));
    int dfd = open(d, O_RDONLY | O_DIRECTORY);
    if (dfd < 0) return DG_ERR(DG_ERR_RUNTIME, "cannot open directory %s: %s", d, strerror(errno));
    double *tc = dg_xmalloc((size_t)n * sizeof(double)), *tr = dg_xmalloc((size_t)n * sizeof(double));
    char block[4096];
    memset(block, 'v', sizeof block);
    dg_status_t s = DG_OK;
    for (int i = 0; i < n && s == DG_OK; i++) {
        char tmp[4300], fin[4300];
        snprintf(tmp, sizeof tmp, "%s/f%06d.tmp", d, i);
        snprintf(fin, sizeof fin, "%s/f%06d", d, i);
        double t0 = dg_now_s();
        int fd = open(tmp, O_CREAT | O_EXCL | O_WRONLY, 0644);
        if (fd < 0) {
            s = DG_ERR(DG_ERR_RUNTIME, "cannot create %s: %s", tmp, strerror(errno));
            break;
        }
        ssize_t wn = write(fd, block, sizeof block);
        int e = wn == (ssize_t)sizeof block ? (fsync(fd) == 0 ? 0 : errno) : (wn < 0 ? errno : EIO);
        close(fd);
        if (e) {
            s = DG_ERR(DG_ERR_RUNTIME, "cannot write + fsync %s: %s", tmp, strerror(e));
            break;
        }
        tc[i] = dg_now_s() - t0;
        t0 = dg_now_s();
        if (rename(tmp, fin) != 0 || fsync(dfd) != 0) {
            s = DG_ERR(DG_ERR_RUNTIME, "cannot rename %s (+ fsync of its directory): %s", tmp,
                       strerror(errno));
            break;
        }
        tr[i] = dg_now_s() - t0;
    }
    close(dfd);
    if (s == DG_OK) {
        *create_med = vc_median(tc, n);
        *rename_med = vc_median(tr, n);
    }
    free(tc);
    free(tr);
    return s;
}

static void judge_latency(vctx_t *c, const char *name, const double *all, int which) {
    dg_vcheck_t *k = vc_add(c, name);
    if (!k) return;
    int worst = 0;
    for (int r = 1; r < c->size; r++)
        if (all[2 * r + which] > all[2 * worst + which]) worst = r;
    double v = all[2 * worst + which];
    char vs[32];
    vc_fmt_value(vs, sizeof vs, v, DG_DIM_TIME);
    snprintf(k->measured, sizeof k->measured, "worst median %s (rank %d, %s), %d files per rank", vs, worst,
             c->b->hosts[worst], c->set->storage_meta_files);
    k->has_value = 1;
    k->value = v;
    snprintf(k->unit, sizeof k->unit, "s");
    int *bad = dg_xmalloc((size_t)c->size * sizeof(int)), nbad = 0, nref = 0;
    const dg_sla_ref_t *shown = NULL;
    vbuf_t det = {0};
    vbuf_printf(&det, "{\"ranks\": [");
    for (int r = 0; r < c->size; r++) {
        vbuf_printf(&det, "%s{\"rank\": %d, \"median_s\": %.9g}", r ? ", " : "", r, all[2 * r + which]);
        const dg_sla_ref_t *ref = dg_sla_ref(c->sla, c->type_of_rank[r], name);
        if (!ref) continue;
        nref++;
        if (!shown) shown = ref;
        if (!dg_sla_ref_ok(ref, all[2 * r + which])) bad[nbad++] = r;
    }
    vbuf_printf(&det, "]}");
    if (shown) dg_sla_ref_format(shown, k->reference, sizeof k->reference);
    if (nbad) {
        char who[1024], lim[200];
        vc_fmt_ranks(c, bad, nbad, who, sizeof who);
        dg_sla_ref_format(dg_sla_ref(c->sla, c->type_of_rank[bad[0]], name), lim, sizeof lim);
        vc_fmt_value(vs, sizeof vs, all[2 * bad[0] + which], DG_DIM_TIME);
        k->verdict = DG_VERDICT_FAIL;
        snprintf(k->message, sizeof k->message, "%s latency too high on %s (e.g. %s, want %s)",
                 which ? "rename" : "create", who, vs, lim);
    } else if (!nref) {
        snprintf(k->message, sizeof k->message, "no reference ref.%s in the SLA: measured only", name);
    }
    dg_vcheck_set_details(k, det.s);
    vbuf_free(&det);
    free(bad);
}

static dg_status_t metadata(vctx_t *c, const char *dir) {
    double t0 = dg_now_s();
    double mine[2] = {NAN, NAN};
    DG_TRY(vc_quiet_barrier(c, c->b->world, "storage.metadata"));
    dg_status_t local = meta_local(c, dir, &mine[0], &mine[1]);
    char msg[2048];
    dg_status_t ag = vc_agree(c, local, msg, sizeof msg);
    double *all = c->rank == 0 ? dg_xmalloc((size_t)c->size * 2 * sizeof(double)) : NULL;
    DG_TRY(vc_gather_doubles(c, mine, 2, all));
    if (c->rank == 0) {
        if (ag != DG_OK) {
            fail_check(c, "storage.create", DG_VERDICT_FAIL, "metadata operations in %s failed: %s", dir,
                       msg);
            fail_check(c, "storage.rename", DG_VERDICT_FAIL, "metadata operations in %s failed: %s", dir,
                       msg);
        } else {
            if (vc_selected_leaf(c, "storage.create")) judge_latency(c, "storage.create", all, 0);
            if (vc_selected_leaf(c, "storage.rename")) judge_latency(c, "storage.rename", all, 1);
        }
        double dt = dg_now_s() - t0;
        for (int i = c->rep->n - 2; i < c->rep->n; i++)
            if (i >= 0 && strncmp(c->rep->checks[i].name, "storage.", 8) == 0) c->rep->checks[i].seconds = dt;
    }
    free(all);
    return DG_OK;
}

dg_status_t vc_check_storage(vctx_t *c) {
    int want_w = vc_selected_leaf(c, "storage.write"), want_r = vc_selected_leaf(c, "storage.read");
    int want_m = vc_selected_leaf(c, "storage.create") || vc_selected_leaf(c, "storage.rename");
    if (!want_w && !want_r && !want_m) return DG_OK;
    char base[1100], dir[1200];
    if (c->set->storage_dir[0])
        snprintf(base, sizeof base, "%s", c->set->storage_dir);
    else
        snprintf(base, sizeof base, "%s/storage", c->run_dir);
    /* a fresh directory per run, so nothing of an earlier run (or of a real job) is touched */
    long long id[2] = {(long long)getpid(), (long long)(dg_now_s() * 1000)};
    DG_MPI_CHECK(MPI_Bcast(id, 2, MPI_LONG_LONG, 0, c->b->world));
    snprintf(dir, sizeof dir, "%s/dgvalidate-%lld-%lld", base, id[0], id[1]);
    dg_status_t s = c->rank == 0 ? dg_mkdir_p(dir) : DG_OK;
    char msg[2048];
    dg_status_t ag = vc_agree(c, s, msg, sizeof msg);
    if (ag != DG_OK) {
        /* every storage check fails the same way: the directory is not usable */
        if (want_w)
            fail_check(c, "storage.write", DG_VERDICT_FAIL, "storage directory not writable: %s", msg);
        if (want_r) fail_check(c, "storage.read", DG_VERDICT_FAIL, "storage directory not writable: %s", msg);
        if (vc_selected_leaf(c, "storage.create"))
            fail_check(c, "storage.create", DG_VERDICT_FAIL, "storage directory not writable: %s", msg);
        if (vc_selected_leaf(c, "storage.rename"))
            fail_check(c, "storage.rename", DG_VERDICT_FAIL, "storage directory not writable: %s", msg);
        return DG_OK;
    }
    char ckdir[1300];
    snprintf(ckdir, sizeof ckdir, "%s/ckpt", dir);
    if (want_w || want_r) DG_TRY(write_read(c, ckdir, want_w, want_r));
    vc_write_reports(c);
    if (want_m) DG_TRY(metadata(c, dir));
    DG_TRY(vc_quiet_barrier(c, c->b->world, "storage cleanup"));
    if (c->rank == 0) nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return DG_OK;
}
