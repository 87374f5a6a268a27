/* prep.c — text files to llm.c shards of bytes or of GPT-2 ids (the engine of `dgprep` and of the
 * default data).
 *
 * Two passes over each file: the first classifies it (empty, binary, duplicate) and finds where its
 * val tail starts, without writing anything; the second streams its bytes (or, with a tokenizer, the
 * ids of its documents, encoded on several threads) into the train and val shard writers. Shards are written
 * under temporary names and renamed only when every input has been read, so a failure (bad input, full disk)
 * leaves any earlier output untouched. */
#define _GNU_SOURCE
#include "data.h"
#include "data_impl.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <sched.h>
#include <xxhash.h>

#include "tokenizer.h"

#define PREP_DEFAULT_SHARD_TOKENS 100000000LL /* llm.c's shard size */
#define PREP_CHUNK (1 << 20)
#define PREP_PROGRESS_MIN_BYTES (32LL << 20)
#define PREP_PROGRESS_MIN_BYTES_TOK (4LL << 20) /* encoding is ~50x slower than copying bytes */

typedef struct in_file {
    char *path;
    int explicit_; /* named on the command line (errors) vs found in a directory (skipped) */
    int use;
    int64_t size;
    int64_t cut; /* bytes [0,cut) go to train, [cut,size) to val */
    uint64_t hash;
} in_file_t;

typedef struct file_list {
    in_file_t *v;
    int n, cap;
} file_list_t;

static void list_add(file_list_t *l, const char *path, int explicit_) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 16;
        in_file_t *nv = realloc(l->v, (size_t)l->cap * sizeof *nv);
        DG_ASSERTF(nv != NULL, "out of memory");
        l->v = nv;
    }
    l->v[l->n++] = (in_file_t){.path = dg_xstrdup(path), .explicit_ = explicit_};
}

static void list_free(file_list_t *l) {
    for (int i = 0; i < l->n; i++)
        free(l->v[i].path);
    free(l->v);
}

int dg_data_cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int dg_data_dir_names(DIR *d, char ***out) {
    char **names = NULL;
    int n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            char **nv = realloc(names, (size_t)cap * sizeof *nv);
            DG_ASSERTF(nv != NULL, "out of memory");
            names = nv;
        }
        names[n++] = dg_xstrdup(e->d_name);
    }
    closedir(d);
    if (n > 1) qsort(names, (size_t)n, sizeof *names, dg_data_cmp_str); /* names is NULL when n == 0 */
    *out = names;
    return n;
}

/* ---------------- progress for big inputs ---------------- */

typedef struct progress {
    const char *who;
    int on, tty;
    int64_t total, done; /* bytes of both passes (with a tokenizer: of the encoding pass only) */
    int64_t input;       /* bytes of the input files */
    double last;
    int last_decile;
    int tok;   /* tokenizer mode: pass 1 is not counted, and the rate is shown */
    double t0; /* start of the counted work */
} progress_t;

static void progress_tick(progress_t *p, int64_t add) {
    p->done += add;
    if (!p->on) return;
    double pct = p->total > 0 ? 100.0 * (double)p->done / (double)p->total : 100.0;
    if (p->tty) {
        double now = dg_now_s();
        if (now - p->last < 0.5 && p->done < p->total) return;
        p->last = now;
        fprintf(stderr, "\r%s: %5.1f%% of %.1f MB", p->who, pct, p->input / 1e6);
        if (p->tok) fprintf(stderr, ", %.1f MB/s\033[K", (double)p->done / 1e6 / (now - p->t0 + 1e-9));
        if (p->done >= p->total) fputc('\n', stderr);
        fflush(stderr);
    } else {
        int decile = (int)(pct / 10);
        if (decile == p->last_decile) return;
        p->last_decile = decile;
        if (p->tok)
            fprintf(stderr, "%s: %d%% of %.1f MB, %.1f MB/s\n", p->who, decile * 10, p->input / 1e6,
                    (double)p->done / 1e6 / (dg_now_s() - p->t0 + 1e-9));
        else
            fprintf(stderr, "%s: %d%% of %.1f MB\n", p->who, decile * 10, p->input / 1e6);
    }
}

/* ---------------- shard writer ---------------- */

typedef struct writer {
    const char *who, *dir, *name, *split;
    int64_t max_tok;
    int tok_kind;    /* DG_SHARD_TOK_BYTES or _BPE: recorded in every shard's header */
    uint64_t tok_fp; /* the tokenizer's fingerprint (0 for bytes) */
    int fd;
    int64_t cur_tok, total;
    int n_shards;
    char **tmp; /* temporary path of each finished or open shard */
    uint8_t buf[1 << 16];
    size_t nbuf;
} writer_t;

static dg_status_t write_all(const char *who, int fd, const void *p, size_t n, const char *path) {
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return DG_ERR(DG_ERR_RUNTIME, "%s: cannot write %s: %s", who, path, strerror(errno));
        }
        c += w;
        n -= (size_t)w;
    }
    return DG_OK;
}

static void final_path(const writer_t *w, int idx, char *buf, size_t cap) {
    dg_fmt(buf, cap, "%s/%s_%s_%06d.bin", w->dir, w->name, w->split, idx);
}

static dg_status_t writer_open_shard(writer_t *w) {
    if (w->n_shards >= 999999)
        return DG_ERR(DG_ERR_USAGE, "%s: more than 999999 shards; raise the shard size", w->who);
    /* Host and pid in the temporary name: builders on several nodes may share the directory. */
    char path[4096], host[64] = "";
    gethostname(host, sizeof host - 1);
    for (char *c = host; *c; c++)
        if (*c == '/') *c = '_';
    if (snprintf(path, sizeof path, "%s/.%s_%s_%06d.bin.tmp.%s.%d", w->dir, w->name, w->split, w->n_shards,
                 host, (int)getpid()) >= (int)sizeof path)
        return DG_ERR(DG_ERR_USAGE, "%s: output path too long in %s", w->who, w->dir);
    /* a stale temporary (or a link planted at its name) is removed, never followed or truncated */
    unlink(path);
    w->fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (w->fd < 0)
        return DG_ERR(DG_ERR_RUNTIME, "%s: output directory %s is not writable: cannot create %s: %s", w->who,
                      w->dir, path, strerror(errno));
    char **nt = realloc(w->tmp, (size_t)(w->n_shards + 1) * sizeof *nt);
    DG_ASSERTF(nt != NULL, "out of memory");
    w->tmp = nt;
    w->tmp[w->n_shards++] = dg_xstrdup(path);
    w->cur_tok = 0;
    static const uint8_t zero[DG_SHARD_HEADER_BYTES];
    return write_all(w->who, w->fd, zero, sizeof zero, path); /* header is filled in at the end */
}

static dg_status_t writer_flush(writer_t *w) {
    if (!w->nbuf) return DG_OK;
    dg_status_t s = write_all(w->who, w->fd, w->buf, w->nbuf, w->tmp[w->n_shards - 1]);
    w->nbuf = 0;
    return s;
}

static void put_i32le(uint8_t *p, int32_t v) {
    uint32_t u = (uint32_t)v;
    p[0] = (uint8_t)u;
    p[1] = (uint8_t)(u >> 8);
    p[2] = (uint8_t)(u >> 16);
    p[3] = (uint8_t)(u >> 24);
}

static dg_status_t writer_close_shard(writer_t *w) {
    if (w->fd < 0) return DG_OK;
    const char *path = w->tmp[w->n_shards - 1];
    dg_status_t s = writer_flush(w);
    if (s == DG_OK) {
        uint8_t hdr[28];
        put_i32le(hdr, DG_SHARD_MAGIC);
        put_i32le(hdr + 4, DG_SHARD_VERSION);
        put_i32le(hdr + 8, (int32_t)w->cur_tok);
        put_i32le(hdr + 12, DG_SHARD_TOK_TAG);
        put_i32le(hdr + 16, w->tok_kind);
        put_i32le(hdr + 20, (int32_t)(uint32_t)w->tok_fp);
        put_i32le(hdr + 24, (int32_t)(uint32_t)(w->tok_fp >> 32));
        if (pwrite(w->fd, hdr, sizeof hdr, 0) != (ssize_t)sizeof hdr)
            s = DG_ERR(DG_ERR_RUNTIME, "%s: cannot write %s: %s", w->who, path, strerror(errno));
    }
    if (s == DG_OK && fsync(w->fd) != 0)
        s = DG_ERR(DG_ERR_RUNTIME, "%s: fsync %s: %s", w->who, path, strerror(errno));
    if (close(w->fd) != 0 && s == DG_OK)
        s = DG_ERR(DG_ERR_RUNTIME, "%s: cannot write %s: %s", w->who, path, strerror(errno));
    w->fd = -1;
    return s;
}

static dg_status_t writer_put(writer_t *w, const uint8_t *bytes, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (w->fd < 0) DG_TRY(writer_open_shard(w));
        w->buf[w->nbuf++] = bytes[i]; /* uint16 little-endian: the byte, then 0 */
        w->buf[w->nbuf++] = 0;
        w->cur_tok++;
        w->total++;
        if (w->nbuf == sizeof w->buf) DG_TRY(writer_flush(w));
        if (w->cur_tok == w->max_tok) DG_TRY(writer_close_shard(w));
    }
    return DG_OK;
}

static dg_status_t writer_put_ids(writer_t *w, const int32_t *ids, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (w->fd < 0) DG_TRY(writer_open_shard(w));
        DG_ASSERT(ids[i] >= 0 && ids[i] < DG_SHARD_MAX_VOCAB);
        w->buf[w->nbuf++] = (uint8_t)ids[i]; /* uint16 little-endian */
        w->buf[w->nbuf++] = (uint8_t)(ids[i] >> 8);
        w->cur_tok++;
        w->total++;
        if (w->nbuf == sizeof w->buf) DG_TRY(writer_flush(w));
        if (w->cur_tok == w->max_tok) DG_TRY(writer_close_shard(w));
    }
    return DG_OK;
}

static void writer_discard(writer_t *w) {
    if (w->fd >= 0) close(w->fd);
    w->fd = -1;
    for (int i = 0; w->tmp && i < w->n_shards; i++) {
        if (!w->tmp[i]) continue; /* already renamed into place */
        unlink(w->tmp[i]);
        free(w->tmp[i]);
    }
    free(w->tmp);
    w->tmp = NULL;
    w->n_shards = 0;
}

/* Rename the temporaries into place, then drop stale shards of an earlier, larger run so the glob
 * sees exactly this output. */
static dg_status_t writer_commit(writer_t *w) {
    char path[4096];
    for (int i = 0; i < w->n_shards; i++) {
        final_path(w, i, path, sizeof path);
        if (rename(w->tmp[i], path) != 0)
            return DG_ERR(DG_ERR_RUNTIME, "%s: cannot rename %s to %s: %s", w->who, w->tmp[i], path,
                          strerror(errno));
        free(w->tmp[i]);
        w->tmp[i] = NULL;
    }
    for (int i = w->n_shards;; i++) {
        final_path(w, i, path, sizeof path);
        if (unlink(path) != 0) break;
    }
    free(w->tmp);
    w->tmp = NULL;
    return DG_OK;
}

/* ---------------- input collection and classification ---------------- */

static dg_status_t collect(const dg_prep_opts_t *o, const char *who, file_list_t *l, int *n_skipped) {
    for (int i = 0; i < o->n_inputs; i++) {
        const char *in = o->inputs[i];
        struct stat st;
        if (stat(in, &st) != 0)
            return DG_ERR(DG_ERR_USAGE, "%s: cannot read %s: %s", who, in, strerror(errno));
        if (S_ISREG(st.st_mode)) {
            list_add(l, in, 1);
            continue;
        }
        if (!S_ISDIR(st.st_mode))
            return DG_ERR(DG_ERR_USAGE, "%s: %s is not a regular file or directory", who, in);
        DIR *d = opendir(in);
        if (!d) return DG_ERR(DG_ERR_USAGE, "%s: cannot read directory %s: %s", who, in, strerror(errno));
        char **names;
        int nn = dg_data_dir_names(d, &names); /* not ., .. and hidden files (.git, editor swap files) */
        size_t dl = strlen(in);
        int slash = dl > 0 && in[dl - 1] == '/';
        for (int k = 0; k < nn; k++) {
            char path[4096];
            int w = snprintf(path, sizeof path, "%s%s%s", in, slash ? "" : "/", names[k]);
            struct stat ls;
            /* Symlinks are skipped: in practice they alias a file that is already in the set
             * (/usr/share/common-licenses/GPL -> GPL-3). Subdirectories are not descended into. */
            if (w < (int)sizeof path && lstat(path, &ls) == 0 && S_ISREG(ls.st_mode))
                list_add(l, path, 0);
            else if (++*n_skipped && !o->quiet)
                fprintf(stderr, "%s: note: skipping %s (%s)\n", who, path,
                        w >= (int)sizeof path ? "path too long"
                        : S_ISLNK(ls.st_mode) ? "symlink"
                        : S_ISDIR(ls.st_mode) ? "subdirectory; not recursive"
                                              : "not a regular file");
            free(names[k]);
        }
        free(names);
    }
    return DG_OK;
}

static int is_control(uint8_t c) {
    if (c >= 0x20 && c != 0x7f) return 0;
    return !(c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r' || c == 0x1b);
}

static void skip_note(const dg_prep_opts_t *o, const char *who, const char *path, const char *why) {
    if (!o->quiet) fprintf(stderr, "%s: note: skipping %s (%s)\n", who, path, why);
}

/* Pass 1 over one file: size, hash, text check and the val cut. Returns DG_OK with f->use set to
 * whether the file is used; an explicit file that cannot be used is an error. */
static dg_status_t classify(const dg_prep_opts_t *o, const char *who, in_file_t *f, uint8_t *buf,
                            progress_t *pr) {
    int fd = open(f->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return DG_ERR(DG_ERR_USAGE, "%s: cannot read %s: %s", who, f->path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return DG_ERR(DG_ERR_USAGE, "%s: cannot read %s: %s", who, f->path, strerror(e));
    }
    int64_t size = (int64_t)st.st_size;
    int64_t cut0 = size - (int64_t)llround((double)size * o->val_fraction);
    int64_t cut = cut0 == 0 ? 0 : -1;
    int64_t off = 0, controls = 0, first_nul = -1;
    XXH64_state_t *h = XXH64_createState();
    DG_ASSERT(h != NULL);
    XXH64_reset(h, 0);
    dg_status_t s = DG_OK;
    for (;;) {
        ssize_t r = read(fd, buf, PREP_CHUNK);
        if (r < 0) {
            if (errno == EINTR) continue;
            s = DG_ERR(DG_ERR_USAGE, "%s: cannot read %s: %s", who, f->path, strerror(errno));
            break;
        }
        if (r == 0) break;
        XXH64_update(h, buf, (size_t)r);
        for (ssize_t i = 0; i < r; i++) {
            uint8_t c = buf[i];
            if (c == 0 && first_nul < 0) first_nul = off + i;
            controls += is_control(c);
            /* The val part starts at the first line start at or after cut0 (not at the very end). */
            if (cut < 0 && c == '\n' && off + i >= cut0 - 1 && off + i + 1 < size) cut = off + i + 1;
        }
        off += r;
        if (!pr->tok) progress_tick(pr, r);
    }
    close(fd);
    f->hash = XXH64_digest(h);
    XXH64_freeState(h);
    if (s != DG_OK) return s;
    if (off != size) return DG_ERR(DG_ERR_USAGE, "%s: %s changed while being read", who, f->path);
    f->size = size;
    f->cut = cut >= 0 ? cut : cut0;
    if (o->val_fraction == 0) f->cut = size;

    const char *why = NULL;
    char detail[256];
    if (size == 0) {
        why = "empty";
        dg_fmt(detail, sizeof detail, "is empty");
    } else if (first_nul >= 0) {
        why = "binary";
        dg_fmt(detail, sizeof detail, "is not text: NUL byte at offset %lld", (long long)first_nul);
    } else if (controls * 100 > size * DG_PREP_MAX_CONTROL_PERCENT) {
        why = "binary";
        dg_fmt(detail, sizeof detail,
               "is not text: %lld of %lld bytes (%.1f%%) are control characters (at most %d%% allowed)",
               (long long)controls, (long long)size, 100.0 * (double)controls / (double)size,
               DG_PREP_MAX_CONTROL_PERCENT);
    }
    if (why) {
        if (f->explicit_) return DG_ERR(DG_ERR_USAGE, "%s: %s %s", who, f->path, detail);
        skip_note(o, who, f->path, why);
        f->use = 0;
        return DG_OK;
    }
    f->use = 1;
    return DG_OK;
}

/* Pass 2: stream one file into the writers. */
static dg_status_t emit(const char *who, in_file_t *f, writer_t *tr, writer_t *va, uint8_t *buf,
                        XXH64_state_t *all, progress_t *pr) {
    int fd = open(f->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return DG_ERR(DG_ERR_USAGE, "%s: cannot read %s: %s", who, f->path, strerror(errno));
    int64_t off = 0;
    uint8_t last = '\n';
    dg_status_t s = DG_OK;
    while (s == DG_OK && off < f->size) {
        size_t want = f->size - off < PREP_CHUNK ? (size_t)(f->size - off) : PREP_CHUNK;
        ssize_t r = read(fd, buf, want);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            s = r < 0 ? DG_ERR(DG_ERR_USAGE, "%s: cannot read %s: %s", who, f->path, strerror(errno))
                      : DG_ERR(DG_ERR_USAGE, "%s: %s changed while being read", who, f->path);
            break;
        }
        XXH64_update(all, buf, (size_t)r);
        int64_t n_tr = f->cut > off ? (f->cut - off < r ? f->cut - off : r) : 0;
        if (n_tr > 0) s = writer_put(tr, buf, (size_t)n_tr);
        if (s == DG_OK && r > n_tr) s = writer_put(va, buf + n_tr, (size_t)(r - n_tr));
        last = buf[r - 1];
        off += r;
        progress_tick(pr, r);
    }
    close(fd);
    if (s == DG_OK && last != '\n') {
        /* Files are joined line-wise; a file whose last line lacks its newline gets one. */
        static const uint8_t nl = '\n';
        s = writer_put(f->cut < f->size ? va : tr, &nl, 1);
    }
    return s;
}

/* ---------------- pass 2 with a tokenizer ---------------- */

/* Documents and pieces of long ones (cut where dg_tokenizer_next_split says the ids cannot change) are
 * collected from a batch buffer that spans files, encoded in parallel, and written in input order. */

#define PREP_DEFAULT_CHUNK (1 << 20)
#define PREP_BATCH_MIN (16 << 20)

typedef struct tok_unit {
    int file;       /* index in the file list */
    int64_t off;    /* file offset of its first byte */
    size_t at, len; /* in the batch buffer */
    int val;        /* goes to the val split */
    int starts_doc; /* <|endoftext|> first */
    dg_tok_ids_t ids;
    dg_tok_stats_t st;
    dg_status_t rc;
    char err[1024];
} tok_unit_t;

typedef struct tok_pass {
    const dg_prep_opts_t *o;
    const char *who;
    const dg_tokenizer_t *tok;
    int threads;
    size_t chunk;
    uint8_t *buf;
    size_t cap, have;
    tok_unit_t *u;
    int nu, ucap;
    file_list_t *l;
    writer_t *tr, *va;
    XXH64_state_t *all;
    progress_t *pr;
    dg_prep_result_t *res;
} tok_pass_t;

static void tok_add(tok_pass_t *p, int file, int64_t off, size_t at, size_t len, int val, int starts_doc) {
    if (p->nu == p->ucap) {
        int nc = p->ucap ? 2 * p->ucap : 64;
        tok_unit_t *nu = realloc(p->u, (size_t)nc * sizeof *nu);
        DG_ASSERTF(nu != NULL, "out of memory");
        memset(nu + p->ucap, 0, (size_t)(nc - p->ucap) * sizeof *nu);
        p->u = nu;
        p->ucap = nc;
    }
    tok_unit_t *u = &p->u[p->nu++];
    u->file = file, u->off = off, u->at = at, u->len = len, u->val = val, u->starts_doc = starts_doc;
}

static dg_status_t tok_flush(tok_pass_t *p) {
    int nu = p->nu;
#pragma omp parallel for schedule(dynamic, 1) num_threads(p->threads)
    for (int k = 0; k < nu; k++) {
        tok_unit_t *u = &p->u[k];
        u->ids.n = 0;
        u->rc = dg_tokenizer_encode(p->tok, p->buf + u->at, u->len, &u->ids, &u->st);
        if (u->rc != DG_OK) snprintf(u->err, sizeof u->err, "%s", dg_last_error()); /* per-thread message */
#pragma omp critical(dg_prep_progress)
        progress_tick(p->pr, (int64_t)u->len); /* encoding is the slow part: count it as it happens */
    }
    p->nu = 0;
    const int32_t eot = dg_tokenizer_eot(p->tok);
    for (int k = 0; k < nu; k++) {
        tok_unit_t *u = &p->u[k];
        const char *path = p->l->v[u->file].path;
        if (u->rc != DG_OK) return DG_ERR(u->rc, "%s: %s: %s", p->who, path, u->err);
        writer_t *w = u->val ? p->va : p->tr;
        if (u->starts_doc) {
            DG_TRY(writer_put_ids(w, &eot, 1));
            p->res->n_docs++;
        }
        DG_TRY(writer_put_ids(w, u->ids.v, u->ids.n));
        if (u->st.invalid_utf8) {
            if (!p->res->invalid_utf8)
                snprintf(p->res->first_invalid, sizeof p->res->first_invalid, "%s at byte %lld", path,
                         (long long)(u->off + u->st.first_invalid));
            p->res->invalid_utf8 += u->st.invalid_utf8;
        }
    }
    return DG_OK;
}

/* Stream file `fi` into the batch: cut it into units, flushing the batch whenever the buffer fills. */
static dg_status_t tok_file(tok_pass_t *p, int fi) {
    in_file_t *f = &p->l->v[fi];
    int fd = open(f->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return DG_ERR(DG_ERR_USAGE, "%s: cannot read %s: %s", p->who, f->path, strerror(errno));
    const int64_t size = f->size, cut = f->cut;
    int64_t fpos = 0, base = 0; /* bytes read; file offset of buf[reg] */
    size_t reg = p->have, u = p->have;
    int starts = 1;
    dg_status_t s = DG_OK;
    for (;;) {
        while (p->have < p->cap && fpos < size) {
            size_t want = p->cap - p->have;
            if ((int64_t)want > size - fpos) want = (size_t)(size - fpos);
            ssize_t r = read(fd, p->buf + p->have, want);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                s = r < 0 ? DG_ERR(DG_ERR_USAGE, "%s: cannot read %s: %s", p->who, f->path, strerror(errno))
                          : DG_ERR(DG_ERR_USAGE, "%s: %s changed while being read", p->who, f->path);
                break;
            }
            XXH64_update(p->all, p->buf + p->have, (size_t)r);
            p->have += (size_t)r;
            fpos += r;
        }
        if (s != DG_OK) break;
        while (u < p->have) {
            int64_t abs = base + (int64_t)(u - reg);
            int val = abs >= cut;
            int64_t seg_end = val ? size : cut;
            size_t lim = reg + (size_t)(seg_end - base);
            int seg_done = lim <= p->have;
            if (!seg_done) lim = p->have;
            size_t end = SIZE_MAX;
            int doc_end = 0;
            if (p->o->docs == DG_PREP_DOCS_BLANK_LINE) {
                const uint8_t *nn = memmem(p->buf + u, lim - u, "\n\n", 2);
                if (nn) end = (size_t)(nn - p->buf) + 2, doc_end = 1;
            }
            if (!doc_end && seg_done) end = lim, doc_end = 1;
            size_t avail = doc_end ? end : lim;
            if (avail - u > p->chunk) {
                size_t sp = dg_tokenizer_next_split(p->buf + u, avail - u, p->chunk);
                if (sp < avail - u) end = u + sp, doc_end = 0;
            }
            if (end == SIZE_MAX) break; /* the unit goes on past the bytes read so far */
            tok_add(p, fi, abs, u, end - u, val, starts);
            starts = doc_end;
            u = end;
        }
        if (fpos == size && u == p->have) break;
        /* Buffer full: encode what is complete, keep this file's unfinished tail. */
        s = tok_flush(p);
        if (s != DG_OK) break;
        memmove(p->buf, p->buf + u, p->have - u);
        base += (int64_t)(u - reg);
        p->have -= u;
        reg = u = 0;
        if (p->have == p->cap) { /* one unit larger than the buffer: no safe cut in a long document */
            p->cap *= 2;
            uint8_t *nb = realloc(p->buf, p->cap);
            DG_ASSERTF(nb != NULL, "out of memory (%zu bytes for one document piece)", p->cap);
            p->buf = nb;
        }
    }
    close(fd);
    return s;
}

static int cpus_available(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set) > 0 ? CPU_COUNT(&set) : 1;
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static dg_status_t emit_tokens(const dg_prep_opts_t *o, const char *who, file_list_t *l, writer_t *tr,
                               writer_t *va, XXH64_state_t *all, progress_t *pr, dg_prep_result_t *res) {
    tok_pass_t p = {.o = o,
                    .who = who,
                    .tok = o->tokenizer,
                    .l = l,
                    .tr = tr,
                    .va = va,
                    .all = all,
                    .pr = pr,
                    .res = res};
    p.threads = o->threads > 0 ? o->threads : cpus_available();
    p.chunk = o->chunk_bytes > 0 ? (size_t)o->chunk_bytes : PREP_DEFAULT_CHUNK;
    /* Several units per thread so dynamic scheduling evens out documents of different sizes. */
    p.cap = (size_t)p.threads * 4 * p.chunk;
    if (p.cap < PREP_BATCH_MIN) p.cap = PREP_BATCH_MIN;
    p.buf = dg_xmalloc(p.cap);
    dg_status_t s = DG_OK;
    for (int i = 0; s == DG_OK && i < l->n; i++)
        if (l->v[i].use) s = tok_file(&p, i);
    if (s == DG_OK) s = tok_flush(&p);
    for (int k = 0; k < p.ucap; k++)
        dg_tok_ids_free(&p.u[k].ids);
    free(p.u);
    free(p.buf);
    return s;
}

static int valid_name(const char *s) {
    if (!*s || *s == '.') return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || *s == '_' ||
              *s == '-' || *s == '.'))
            return 0;
    return 1;
}

void dg_data_glob_escape(const char *in, char *out, size_t cap) {
    size_t j = 0;
    for (; *in && j + 2 < cap; in++) {
        if (strchr("*?[]\\", *in)) out[j++] = '\\';
        out[j++] = *in;
    }
    out[j] = 0;
}

dg_status_t dg_data_prep(const dg_prep_opts_t *o, dg_prep_result_t *res) {
    const char *who = o->who ? o->who : "dgprep";
    const char *name = o->name ? o->name : "default";
    memset(res, 0, sizeof *res);
    if (!o->out_dir || !*o->out_dir) return DG_ERR(DG_ERR_USAGE, "%s: no output directory given", who);
    if (!valid_name(name))
        return DG_ERR(DG_ERR_USAGE,
                      "%s: bad name '%s' (expected letters, digits, '_', '-', '.'; not starting with '.')",
                      who, name);
    if (!(o->val_fraction >= 0 && o->val_fraction < 1))
        return DG_ERR(DG_ERR_USAGE, "%s: val fraction must be in [0, 1) (got %g)", who, o->val_fraction);
    if (o->n_inputs < 1) return DG_ERR(DG_ERR_USAGE, "%s: no input files given", who);
    int64_t max_tok = o->shard_tokens > 0 ? o->shard_tokens : PREP_DEFAULT_SHARD_TOKENS;
    if (max_tok > INT32_MAX)
        return DG_ERR(DG_ERR_USAGE, "%s: shard size %lld exceeds the format's int32 token count", who,
                      (long long)max_tok);
    if (strlen(o->out_dir) > 1900 || strlen(name) > 200)
        return DG_ERR(DG_ERR_USAGE, "%s: output path too long", who);
    res->vocab_size = 256;
    if (o->tokenizer) {
        if (!dg_tokenizer_can_encode())
            return DG_ERR(DG_ERR_USAGE,
                          "%s: this build cannot encode GPT-2 text: it was built without PCRE2 (install "
                          "libpcre2-dev, e.g. with scripts/setup.sh, and rebuild)",
                          who);
        res->vocab_size = dg_tokenizer_vocab_size(o->tokenizer);
        if (res->vocab_size > DG_SHARD_MAX_VOCAB)
            return DG_ERR(DG_ERR_USAGE,
                          "%s: tokenizer %s has %d tokens; llm.c shards (uint16) hold at most %d", who,
                          dg_tokenizer_source(o->tokenizer), res->vocab_size, DG_SHARD_MAX_VOCAB);
        if (o->docs != DG_PREP_DOCS_FILE && o->docs != DG_PREP_DOCS_BLANK_LINE)
            return DG_ERR(DG_ERR_USAGE, "%s: unknown document rule %d", who, o->docs);
    }

    file_list_t l = {0};
    uint8_t *buf = dg_xmalloc(PREP_CHUNK);
    writer_t *tr = dg_xcalloc(1, sizeof *tr), *va = dg_xcalloc(1, sizeof *va);
    *tr = (writer_t){
        .who = who, .dir = o->out_dir, .name = name, .split = "train", .max_tok = max_tok, .fd = -1};
    *va =
        (writer_t){.who = who, .dir = o->out_dir, .name = name, .split = "val", .max_tok = max_tok, .fd = -1};
    tr->tok_kind = va->tok_kind = o->tokenizer ? DG_SHARD_TOK_BPE : DG_SHARD_TOK_BYTES;
    tr->tok_fp = va->tok_fp = o->tokenizer ? dg_tokenizer_fingerprint(o->tokenizer) : 0;
    XXH64_state_t *all = XXH64_createState();
    DG_ASSERT(all != NULL);
    XXH64_reset(all, 0);
    progress_t pr = {.who = who, .tty = isatty(2), .last_decile = -1, .tok = o->tokenizer != NULL};

    dg_status_t s = collect(o, who, &l, &res->n_skipped);
    int64_t total = 0;
    for (int i = 0; s == DG_OK && i < l.n; i++) {
        struct stat st;
        if (stat(l.v[i].path, &st) == 0) total += (int64_t)st.st_size;
    }
    pr.total = 2 * total; /* both passes */
    pr.input = total;
    pr.on = !o->quiet && total >= PREP_PROGRESS_MIN_BYTES;

    for (int i = 0; s == DG_OK && i < l.n; i++) {
        s = classify(o, who, &l.v[i], buf, &pr);
        if (s != DG_OK || !l.v[i].use) {
            if (s == DG_OK) pr.total -= l.v[i].size; /* its second pass will not happen */
            continue;
        }
        for (int k = 0; k < i && !l.v[i].explicit_; k++) {
            if (l.v[k].use && l.v[k].size == l.v[i].size && l.v[k].hash == l.v[i].hash) {
                char why[4200];
                dg_fmt(why, sizeof why, "same content as %s", l.v[k].path);
                skip_note(o, who, l.v[i].path, why);
                l.v[i].use = 0;
                pr.total -= l.v[i].size;
                break;
            }
        }
    }
    if (s == DG_OK) {
        for (int i = 0; i < l.n; i++) {
            if (!l.v[i].use) {
                res->n_skipped++;
                continue;
            }
            res->n_files++;
            res->in_bytes += l.v[i].size;
        }
        if (res->n_files == 0) s = DG_ERR(DG_ERR_USAGE, "%s: empty input: no text file to read", who);
    }
    if (s == DG_OK) {
        s = dg_mkdir_p(o->out_dir);
        if (s != DG_OK) {
            char why[2048];
            dg_fmt(why, sizeof why, "%s", dg_last_error());
            s = DG_ERR(DG_ERR_RUNTIME, "%s: output directory %s is not usable: %s", who, o->out_dir, why);
        }
    }
    if (s == DG_OK && o->tokenizer) {
        pr.total = res->in_bytes;
        pr.on = !o->quiet && res->in_bytes >= PREP_PROGRESS_MIN_BYTES_TOK;
        pr.t0 = dg_now_s();
        s = emit_tokens(o, who, &l, tr, va, all, &pr, res);
    }
    for (int i = 0; s == DG_OK && !o->tokenizer && i < l.n; i++)
        if (l.v[i].use) s = emit(who, &l.v[i], tr, va, buf, all, &pr);
    if (s == DG_OK) s = writer_close_shard(tr);
    if (s == DG_OK) s = writer_close_shard(va);
    if (s == DG_OK && tr->total == 0)
        s = DG_ERR(DG_ERR_USAGE, "%s: input too small: %lld bytes leave no train tokens at val fraction %g",
                   who, (long long)res->in_bytes, o->val_fraction);
    if (s == DG_OK) s = writer_commit(tr);
    if (s == DG_OK) s = writer_commit(va);
    if (s == DG_OK) {
        res->train_tokens = tr->total;
        res->val_tokens = va->total;
        res->train_shards = tr->n_shards;
        res->val_shards = va->n_shards;
        res->content_hash = XXH64_digest(all);
        char esc[4096 * 2];
        dg_data_glob_escape(o->out_dir, esc, sizeof esc);
        if (snprintf(res->train_glob, sizeof res->train_glob, "%s/%s_train_*.bin", esc, name) >=
            (int)sizeof res->train_glob)
            s = DG_ERR(DG_ERR_USAGE, "%s: output path too long", who);
        if (va->n_shards && snprintf(res->val_glob, sizeof res->val_glob, "%s/%s_val_*.bin", esc, name) >=
                                (int)sizeof res->val_glob)
            s = DG_ERR(DG_ERR_USAGE, "%s: output path too long", who);
        int dfd = open(o->out_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd >= 0) {
            fsync(dfd); /* make the renames durable */
            close(dfd);
        }
    }
    if (pr.on && pr.tty && s != DG_OK) fputc('\n', stderr);
    writer_discard(tr);
    writer_discard(va);
    XXH64_freeState(all);
    free(tr);
    free(va);
    free(buf);
    list_free(&l);
    return s;
}
