/* save.c — writing a checkpoint: validation and agreement, content hashes, the incremental decision,
 * the collective parallel-HDF5 write (each rank its hyperslabs, empty selections for the rest; chunks a
 * rank holds whole are checksummed and written by the rank itself, see "direct chunk writes"), and
 * the atomic commit (partial file, close, fsync on every rank, rename, directory fsync, LATEST),
 * followed by retention. Every phase ends in an agreement so that no rank is left in a collective. */
#define _GNU_SOURCE
#include "ckpt_impl.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "dg_mpi.h"
#include "dg_env.h"

/* Objects of 64 KiB or more (in practice: chunks) start on 64 KiB boundaries: aligned for the page cache
 * and for stripes that are multiples of it, while wasting at most 1.6% of a 4 MiB chunk (a Fletcher32
 * chunk is 4 bytes longer than its data, so 1 MiB alignment would waste up to 20%). No alignment and
 * 1 MiB were both slower in bench/checkpoint (bench/RESULTS.md). */
#define CKPT_DEFAULT_ALIGN (64 << 10)

void dg_ckpt_save_opts_default(dg_ckpt_save_opts_t *o) {
    memset(o, 0, sizeof *o);
    o->keep = 3;
    o->chunk_bytes = DG_CKPT_DEFAULT_CHUNK_BYTES;
    o->space_check = 1;
}

typedef struct save_ctx {
    MPI_Comm comm;
    int rank, size;
    char dir[4096];
    char final_name[64], partial_path[4200], final_path[4200];
    dg_ckpt_meta_t meta;
    const dg_ckpt_tensor_t *t;
    ckpt_table_t tab;
    char (*origin)[256]; /* per tensor: "" = write the data, else the file to link to */
    char base[256], bases[4096];
    dg_ckpt_save_opts_t o;
    hid_t fid, dxpl, lcpl;
    dg_ckpt_phases_t ph;
    /* direct chunk writes (see direct_plan): the jobs collected while the datasets are created */
    int direct;
    int wfd; /* the partial file, opened for writing by this rank */
    struct dchunk *dj;
    size_t ndj, capdj;
    int64_t *rows;   /* per tensor: dim-0 chunk rows aligned to the ranks' pieces; 0 = chunk_dims' choice */
    int skip_fill;   /* agreed: datasets written wholly by direct chunks skip HDF5's fill (see fill_skip) */
    int fill_broken; /* a skipped fill whose chunks then did not look as expected: retry without skipping */
    ckpt_io_t io;
    int64_t needed; /* estimated size of the file (rank 0 computes it, then every rank knows it) */
} save_ctx_t;

/* One chunk this rank writes itself: rows [row0, row1) of dim 0 (the chunk's part inside the extent),
 * taken from `src` (contiguous), stored at file offset `addr` as `nbytes` bytes of data (padded with
 * zeros past the extent) followed by the 4-byte Fletcher32 checksum. */
typedef struct dchunk {
    const float *src;
    size_t data_bytes; /* bytes of src */
    size_t nbytes;     /* stored data bytes (the full chunk) */
    haddr_t addr;
    int ti;
} dchunk_t;

/* Chunk shape: whole trailing dimensions, as many leading slices as fit in the target, with the
 * leading dimension split into equal chunks (so no mostly-empty edge chunk is stored). */
static void chunk_dims(int nd, const int64_t *g, int64_t target_bytes, hsize_t *ch) {
    int64_t target = target_bytes / 4;
    if (target < 1) target = 1;
    for (int d = 0; d < nd; d++)
        ch[d] = (hsize_t)g[d];
    for (int d = 0; d < nd; d++) {
        int64_t inner = 1;
        for (int k = d + 1; k < nd; k++)
            inner *= g[k];
        if (inner >= target && d < nd - 1) {
            ch[d] = 1;
            continue;
        }
        int64_t rows = target / inner;
        if (rows < 1) rows = 1;
        if (rows < g[d]) {
            int64_t nchunks = (g[d] + rows - 1) / rows;
            ch[d] = (hsize_t)((g[d] + nchunks - 1) / nchunks);
        }
        break;
    }
}

/* ---------------- chunks aligned to the pieces ----------------
 * Only chunks wholly inside one rank's piece can be written directly (below). With the default equal
 * chunks, FSDP pieces of a gpt2-124m layer ([768, 2304] cut in 4 = 192 rows; chunks of 384 rows) hold no
 * whole chunk from 4 ranks on. When every rank's owned pieces of a tensor cut it along dim 0 only, the
 * chunk rows are instead the largest divisor of the gcd of the interior cut rows that fits the target
 * chunk size, provided that chunk is still at least a sixteenth of the target, 256 KiB by default (so a
 * tiny piece never makes tiny chunks; a quarter left the [768, 768] projections of gpt2-124m at 4 ranks,
 * 590 KB a piece, to HDF5's collective write): every piece then holds whole chunks only. The file records the
 * chunk shape, so readers need nothing; what changes with the world size is only the chunking. */

static int64_t gcd64(int64_t a, int64_t b) {
    while (b) {
        int64_t t = a % b;
        a = b, b = t;
    }
    return a;
}

/* The largest divisor of g that is <= cap (g, cap >= 1). */
static int64_t divisor_le(int64_t g, int64_t cap) {
    int64_t best = 1;
    for (int64_t d = 1; d * d <= g; d++)
        if (g % d == 0) {
            if (d <= cap && d > best) best = d;
            if (g / d <= cap && g / d > best) best = g / d;
        }
    return best;
}

/* Collective: fill c->rows. */
static dg_status_t align_rows(save_ctx_t *c) {
    int n = c->tab.n;
    c->rows = dg_xcalloc((size_t)(n > 0 ? n : 1), sizeof(int64_t));
    if (!c->direct || n == 0) return DG_OK;
    /* per tensor: gcd of this rank's interior cut rows (0 = none yet), or -1 when a piece is not a
     * dim-0 cut; then combined over ranks */
    int64_t *g = dg_xcalloc((size_t)n, sizeof(int64_t)), *bad = dg_xcalloc((size_t)n, sizeof(int64_t));
    for (int i = 0; i < n; i++) {
        const ckpt_tdesc_t *td = &c->tab.t[i];
        for (int k = 0; k < td->npieces; k++) {
            const dg_ckpt_tensor_t *p = &c->t[td->pieces[k]];
            if (!p->owner || ckpt_numel(p->ndim, p->count) <= 0) continue;
            for (int d = 1; d < td->ndim; d++)
                if (p->count[d] != td->gshape[d]) bad[i] = 1;
            int64_t cut[2] = {p->start[0], p->start[0] + p->count[0]};
            for (int e = 0; e < 2; e++)
                if (cut[e] > 0 && cut[e] < td->gshape[0]) g[i] = gcd64(g[i], cut[e]);
        }
    }
    int64_t *gall = dg_xcalloc((size_t)n, sizeof(int64_t)), *badall = dg_xcalloc((size_t)n, sizeof(int64_t));
    int size = c->size;
    int64_t *every = dg_xmalloc((size_t)n * (size_t)size * sizeof(int64_t));
    int rc = MPI_Allgather(g, n, MPI_INT64_T, every, n, MPI_INT64_T, c->comm);
    rc |= MPI_Allreduce(bad, badall, n, MPI_INT64_T, MPI_MAX, c->comm);
    dg_status_t s = rc == MPI_SUCCESS ? DG_OK : DG_ERR(DG_ERR_RUNTIME, "MPI_Allgather failed (chunk rows)");
    for (int i = 0; i < n && !s; i++) {
        const ckpt_tdesc_t *td = &c->tab.t[i];
        for (int r = 0; r < size; r++)
            gall[i] = gcd64(gall[i], every[(size_t)r * (size_t)n + (size_t)i]);
        if (badall[i] || gall[i] <= 0) continue; /* not dim-0 cuts, or one piece: the default */
        int64_t inner = ckpt_numel(td->ndim - 1, td->gshape + 1);
        if (td->ndim == 1) inner = 1;
        int64_t cap = c->o.chunk_bytes / 4 / inner;
        if (cap < 1) continue; /* a slice is larger than a chunk: chunk_dims cuts further dims */
        int64_t R = divisor_le(gall[i], cap);
        if (R * inner * 4 * 16 >= c->o.chunk_bytes) c->rows[i] = R;
    }
    free(g), free(bad), free(gall), free(badall), free(every);
    return s;
}

/* ---------------- incremental decision (rank 0) ---------------- */

static int entry_cmp(const void *a, const void *b) {
    return strcmp(((const dg_ckpt_entry_t *)a)->path, ((const dg_ckpt_entry_t *)b)->path);
}

static dg_status_t decide_links(save_ctx_t *c) {
    char base_path[4400] = "";
    if (c->o.base && *c->o.base) {
        char bdir[4096], r1[PATH_MAX], r2[PATH_MAX];
        ckpt_dirname(c->o.base, bdir, sizeof bdir);
        if (!realpath(bdir, r1) || !realpath(c->dir, r2) || strcmp(r1, r2) != 0)
            return DG_ERR(
                DG_ERR_USAGE,
                "incremental base %s is not in the checkpoint directory %s (links must stay inside it)",
                c->o.base, c->dir);
        snprintf(base_path, sizeof base_path, "%s", c->o.base);
    } else {
        char latest[256];
        if (ckpt_read_latest(c->dir, latest, sizeof latest) != DG_OK || !latest[0]) {
            if (latest[0] == 0) dg_clear_error();
            return DG_OK; /* nothing to be incremental against: a full checkpoint */
        }
        snprintf(base_path, sizeof base_path, "%s/%s", c->dir, latest);
    }
    const char *bname = ckpt_basename(base_path);
    if (strcmp(bname, c->final_name) == 0) {
        DG_LOG_INFO("checkpoint: %s replaces its own incremental base; writing it in full", c->final_name);
        return DG_OK;
    }
    dg_ckpt_info_t info;
    dg_status_t s = ckpt_info_read_locked(base_path, &info);
    if (s) {
        DG_LOG_WARN("checkpoint: incremental base %s is unusable (%s); writing %s in full", base_path,
                    dg_last_error(), c->final_name);
        dg_clear_error();
        return DG_OK;
    }
    qsort(info.entries, (size_t)info.n_entries, sizeof *info.entries, entry_cmp);
    int nb = 0;
    for (int i = 0; i < c->tab.n; i++) {
        const ckpt_tdesc_t *td = &c->tab.t[i];
        dg_ckpt_entry_t key;
        snprintf(key.path, sizeof key.path, "%s", td->path);
        const dg_ckpt_entry_t *e = bsearch(&key, info.entries, (size_t)info.n_entries, sizeof key, entry_cmp);
        if (!e || e->ndim != td->ndim || e->hash != td->hash) continue;
        int same = 1;
        for (int d = 0; d < td->ndim; d++)
            same &= e->shape[d] == td->gshape[d];
        if (!same) continue;
        const char *org = e->origin[0] ? e->origin : bname;
        if (strcmp(org, c->final_name) == 0) continue; /* would point at the file being replaced */
        char op[4400];
        struct stat st;
        snprintf(op, sizeof op, "%s/%s", c->dir, org);
        if (stat(op, &st) != 0) continue;
        snprintf(c->origin[i], 256, "%s", org);
        nb++;
    }
    if (nb) {
        snprintf(c->base, sizeof c->base, "%s", bname);
        /* the distinct files linked to, in first-use order */
        size_t len = 0;
        for (int i = 0; i < c->tab.n; i++) {
            if (!c->origin[i][0]) continue;
            int dup = 0;
            for (int k = 0; k < i && !dup; k++)
                dup = strcmp(c->origin[k], c->origin[i]) == 0;
            if (dup) continue;
            if (len + strlen(c->origin[i]) + 2 >= sizeof c->bases) {
                dg_ckpt_info_destroy(&info);
                return DG_ERR(DG_ERR_USAGE, "checkpoint %s would link to too many base files", c->final_name);
            }
            len +=
                (size_t)snprintf(c->bases + len, sizeof c->bases - len, "%s%s", len ? " " : "", c->origin[i]);
        }
    }
    dg_ckpt_info_destroy(&info);
    return DG_OK;
}

/* ---------------- the HDF5 write ---------------- */

/* Data written between two writeback kicks. */
#define CKPT_WRITEBACK_BYTES ((int64_t)128 << 20)

static void kick_writeback(int fd) {
#ifdef __linux__
    sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE); /* asynchronous: starts I/O, does not wait */
#else
    (void)fd;
#endif
}

/* ---------------- direct chunk writes ----------------
 * HDF5 1.10's collective filtered write copies every chunk three times in user space (gathers the
 * caller's data, scatters it into a chunk buffer, and the Fletcher32 filter copies it once more to
 * append the checksum) on one thread, between the collective steps. But in parallel HDF5 every chunk
 * of a dataset is allocated when the dataset is created (early allocation), at its filtered size: for
 * Fletcher32, the chunk's bytes + 4. So a chunk that lies wholly inside one rank's piece can be written
 * by that rank itself, outside HDF5: the bytes HDF5 would have stored (the data, zero padding past the
 * extent, then the checksum, little-endian, as H5Z_filter_fletcher32 appends it) at the address HDF5
 * allocated, and nothing in the file's metadata changes. The chunks are written after all datasets
 * exist, by `threads` threads that checksum and pwrite in parallel (checksums overlap the page-cache
 * copy). Chunks shared by several ranks' pieces still go through HDF5's collective write, as does any
 * tensor whose layout does not qualify (chunks or pieces not cut along dim 0 only) or whose chunk
 * index does not look exactly as expected. Readers see a standard file: the same layout, sizes and
 * checksums a fully HDF5-written file has. DG_CKPT_DIRECT_CHUNKS=0 turns this off. */

/* The chunks (of R rows along dim 0) that lie wholly inside piece p: [*k0, *k1) (empty when k1 == k0). */
static void whole_chunks(const dg_ckpt_tensor_t *p, int64_t R, int64_t *k0, int64_t *k1) {
    int64_t s = p->start[0], e = s + p->count[0], g = p->gshape[0];
    *k0 = (s + R - 1) / R;
    *k1 = *k0;
    while (*k1 * R < g && ((*k1 + 1) * R < g ? (*k1 + 1) * R : g) <= e)
        (*k1)++;
}

/* Rows of piece p outside its whole chunks: rem[0] = [start, first whole chunk), rem[1] = [end of the
 * last whole chunk, end); the whole piece in rem[0] when it holds no whole chunk. */
static void direct_remainder(const dg_ckpt_tensor_t *p, int64_t R, int64_t rem[2][2]) {
    int64_t k0, k1, s = p->start[0], e = s + p->count[0], g = p->gshape[0];
    whole_chunks(p, R, &k0, &k1);
    if (k1 == k0) {
        rem[0][0] = s, rem[0][1] = e, rem[1][0] = rem[1][1] = 0;
        return;
    }
    rem[0][0] = s, rem[0][1] = k0 * R;
    rem[1][0] = k1 * R < g ? k1 * R : g, rem[1][1] = e;
}

static dg_status_t direct_push(save_ctx_t *c, dchunk_t j) {
    if (c->ndj == c->capdj) {
        c->capdj = c->capdj ? 2 * c->capdj : 1024;
        c->dj = realloc(c->dj, c->capdj * sizeof *c->dj);
        if (!c->dj) return DG_ERR(DG_ERR_RUNTIME, "out of memory for the chunk write list");
    }
    c->dj[c->ndj++] = j;
    return DG_OK;
}

/* Collective (every rank queries the same chunks in the same order: metadata reads are collective).
 * Sets *direct when tensor i qualifies, and queues this rank's whole chunks. */
static dg_status_t direct_plan(save_ctx_t *c, int i, hid_t dset, const hsize_t *ch, int *direct) {
    const ckpt_tdesc_t *td = &c->tab.t[i];
    *direct = 0;
    if (!c->direct) return DG_OK;
    int64_t inner = 1;
    for (int d = 1; d < td->ndim; d++) {
        if ((int64_t)ch[d] != td->gshape[d]) return DG_OK;
        inner *= td->gshape[d];
    }
    /* (the checks above depend only on the shape, the same on every rank; from here every rank takes
     * part in the queries and the agreement, whatever its own pieces look like) */
    int good = 1, all = 0;
    for (int k = 0; k < td->npieces; k++) {
        const dg_ckpt_tensor_t *p = &c->t[td->pieces[k]];
        for (int d = 1; d < td->ndim; d++)
            if (p->owner && ckpt_numel(p->ndim, p->count) > 0 && p->count[d] != td->gshape[d]) good = 0;
    }
    const int64_t R = (int64_t)ch[0], nchunks = (td->gshape[0] + R - 1) / R;
    const size_t nbytes = (size_t)(R * inner) * sizeof(float);
    haddr_t *addr = dg_xmalloc((size_t)nchunks * sizeof *addr);
    for (int64_t k = 0; k < nchunks; k++) {
        hsize_t off[DG_CKPT_MAX_NDIM] = {0}, size = 0;
        unsigned mask = 1;
        haddr_t a = HADDR_UNDEF;
        off[0] = (hsize_t)(k * R);
        /* the same answers on every rank (collective metadata reads), so every rank stops at the same k */
        if (H5Dget_chunk_info_by_coord(dset, off, &mask, &a, &size) < 0) {
            H5Eclear2(H5E_DEFAULT);
            good = 0;
            break;
        }
        if (mask != 0 || a == HADDR_UNDEF || size != nbytes + 4 || ckpt_test_fail("chunkindex", c->rank)) {
            dg_clear_error(); /* (the test hook: as if this rank found the index unexpected) */
            good = 0;
            break;
        }
        addr[k] = a;
    }
    /* the chunk index is the same on every rank; the layout check above may differ: agree */
    int mine = good;
    if (MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, c->comm) != MPI_SUCCESS) {
        free(addr);
        return DG_ERR(DG_ERR_RUNTIME, "MPI_Allreduce failed (chunk plan)");
    }
    dg_status_t s = DG_OK;
    if (all) {
        *direct = 1;
        for (int q = 0; q < td->npieces && !s; q++) {
            const dg_ckpt_tensor_t *p = &c->t[td->pieces[q]];
            if (!p->owner || ckpt_numel(p->ndim, p->count) <= 0) continue;
            int64_t k0, k1;
            whole_chunks(p, R, &k0, &k1);
            for (int64_t k = k0; k < k1 && !s; k++) {
                int64_t r0 = k * R, r1 = r0 + R < td->gshape[0] ? r0 + R : td->gshape[0];
                dchunk_t j = {p->data + (r0 - p->start[0]) * inner,
                              (size_t)((r1 - r0) * inner) * sizeof(float), nbytes, addr[k], i};
                s = direct_push(c, j);
            }
        }
    }
    free(addr);
    return s;
}

uint32_t H5_checksum_fletcher32(const void *data, size_t len);

typedef struct direct_job {
    save_ctx_t *c;
    pthread_mutex_t mu;
    int err, nospace;
    char msg[512];
    atomic_llong since_kick;
    atomic_int stop; /* a chunk failed: the others are not attempted */
} direct_job_t;

static int pwrite_all(int fd, struct iovec *iov, int n, off_t off) {
    while (n > 0) {
        ssize_t w = pwritev(fd, iov, n, off);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        off += w;
        while (n > 0 && (size_t)w >= iov->iov_len)
            w -= (ssize_t)iov->iov_len, iov++, n--;
        if (n > 0) iov->iov_base = (char *)iov->iov_base + w, iov->iov_len -= (size_t)w;
    }
    return 0;
}

static void direct_write_one(void *ctx, size_t idx) {
    direct_job_t *J = ctx;
    save_ctx_t *c = J->c;
    const dchunk_t *j = &c->dj[idx];
    if (atomic_load_explicit(&J->stop, memory_order_relaxed)) return;
    ckpt_io_throttle(&c->io);
    const void *data = j->src;
    void *pad = NULL;
    if (j->data_bytes < j->nbytes) { /* the edge chunk: HDF5 stores it whole */
        pad = malloc(j->nbytes);
        if (!pad) {
            pthread_mutex_lock(&J->mu);
            if (!J->err) J->err = 1, snprintf(J->msg, sizeof J->msg, "out of memory for an edge chunk");
            pthread_mutex_unlock(&J->mu);
            return;
        }
        memcpy(pad, j->src, j->data_bytes);
        memset((char *)pad + j->data_bytes, 0, j->nbytes - j->data_bytes);
        data = pad;
    }
    uint32_t f = H5_checksum_fletcher32(data, j->nbytes);
    uint8_t le[4] = {(uint8_t)f, (uint8_t)(f >> 8), (uint8_t)(f >> 16), (uint8_t)(f >> 24)};
    struct iovec iov[2] = {{(void *)data, j->nbytes}, {le, 4}};
    if (pwrite_all(c->wfd, iov, 2, (off_t)j->addr) != 0) {
        int e = errno;
        atomic_store(&J->stop, 1);
        pthread_mutex_lock(&J->mu);
        if (e == ENOSPC || e == EDQUOT) J->nospace = 1;
        if (!J->err)
            J->err = 1,
            snprintf(J->msg, sizeof J->msg, "%.200s:/%.200s: writing a chunk at offset %llu: %.60s",
                     c->partial_path, c->tab.t[j->ti].path, (unsigned long long)j->addr, strerror(e));
        pthread_mutex_unlock(&J->mu);
    } else {
        ckpt_progress_add((uint64_t)j->nbytes + 4);
    }
    free(pad);
    if (atomic_fetch_add(&J->since_kick, (long long)j->nbytes) + (long long)j->nbytes >=
        CKPT_WRITEBACK_BYTES) {
        atomic_store(&J->since_kick, 0);
        kick_writeback(c->wfd);
    }
}

/* Local: write every queued chunk (checksum + pwrite) on c->ph.threads threads. */
static dg_status_t direct_write_all(save_ctx_t *c) {
    if (!c->ndj) return DG_OK;
    direct_job_t J;
    memset(&J, 0, sizeof J);
    J.c = c;
    pthread_mutex_init(&J.mu, NULL);
    atomic_init(&J.since_kick, 0);
    atomic_init(&J.stop, 0);
    ckpt_parallel_for(c->ph.threads, c->ndj, direct_write_one, &J);
    for (size_t k = 0; k < c->ndj; k++)
        c->ph.direct_bytes += (int64_t)c->dj[k].nbytes + 4;
    pthread_mutex_destroy(&J.mu);
    if (J.nospace) c->io.nospace = 1;
    if (J.err) return DG_ERR(DG_ERR_RUNTIME, "%s", J.msg);
    return DG_OK;
}

/* Collective: may tensor i's fill be skipped? Every owned piece, on every rank, is a dim-0 cut that holds
 * whole chunks only (so the direct writer writes every chunk and HDF5's collective write, which reads a
 * chunk back before updating it, touches none). The chunk index itself is checked after creation. */
static dg_status_t fill_skip_ok(save_ctx_t *c, int i, const hsize_t *ch, int *ok) {
    const ckpt_tdesc_t *td = &c->tab.t[i];
    *ok = 0;
    if (!c->direct || !c->skip_fill || atomic_load(&ckpt_fill_skip_off)) return DG_OK;
    for (int d = 1; d < td->ndim; d++)
        if ((int64_t)ch[d] != td->gshape[d]) return DG_OK; /* the same on every rank: no agreement needed */
    int mine = 1, all = 0;
    for (int k = 0; k < td->npieces && mine; k++) {
        const dg_ckpt_tensor_t *p = &c->t[td->pieces[k]];
        if (!p->owner || ckpt_numel(p->ndim, p->count) <= 0) continue;
        for (int d = 1; d < td->ndim; d++)
            if (p->count[d] != td->gshape[d]) mine = 0;
        int64_t rem[2][2];
        direct_remainder(p, (int64_t)ch[0], rem);
        if (rem[0][1] > rem[0][0] || rem[1][1] > rem[1][0]) mine = 0;
    }
    if (MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, c->comm) != MPI_SUCCESS)
        return DG_ERR(DG_ERR_RUNTIME, "MPI_Allreduce failed (fill plan)");
    *ok = all;
    return DG_OK;
}

static dg_status_t write_tensor(save_ctx_t *c, int i, ckpt_hbag_t *b) {
    const ckpt_tdesc_t *td = &c->tab.t[i];
    if (c->origin[i][0]) {
        char obj[DG_CKPT_MAX_PATH + 2];
        snprintf(obj, sizeof obj, "/%s", td->path);
        DG_H5_CHECK(H5Lcreate_external(c->origin[i], obj, c->fid, td->path, c->lcpl, H5P_DEFAULT),
                    "%s: cannot link /%s to %s", c->partial_path, td->path, c->origin[i]);
        return DG_OK;
    }
    hsize_t dims[DG_CKPT_MAX_NDIM], ch[DG_CKPT_MAX_NDIM];
    for (int d = 0; d < td->ndim; d++)
        dims[d] = (hsize_t)td->gshape[d];
    chunk_dims(td->ndim, td->gshape, c->o.chunk_bytes, ch);
    if (c->rows && c->rows[i] > 0) { /* aligned to the pieces (align_rows): whole trailing dims */
        ch[0] = (hsize_t)c->rows[i];
        for (int d = 1; d < td->ndim; d++)
            ch[d] = (hsize_t)td->gshape[d];
    }
    hid_t space = ckpt_hbag_add(b, H5Screate_simple(td->ndim, dims, NULL));
    DG_H5_CHECK(space, "%s:/%s: dataspace", c->partial_path, td->path);
    hid_t dcpl = ckpt_hbag_add(b, H5Pcreate(H5P_DATASET_CREATE));
    DG_H5_CHECK(dcpl, "%s:/%s", c->partial_path, td->path);
    DG_H5_CHECK(H5Pset_chunk(dcpl, td->ndim, ch), "%s:/%s: chunking", c->partial_path, td->path);
    DG_H5_CHECK(H5Pset_fletcher32(dcpl), "%s:/%s: Fletcher32 filter", c->partial_path, td->path);
    /* every byte gets written: filling first would write the file twice */
    DG_H5_CHECK(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER), "%s:/%s", c->partial_path, td->path);
    int skip = 0;
    DG_TRY(fill_skip_ok(c, i, ch, &skip));
    ckpt_tl_fill_skip = skip;
    hid_t dset =
        ckpt_hbag_add(b, H5Dcreate2(c->fid, td->path, H5T_IEEE_F32LE, space, c->lcpl, dcpl, H5P_DEFAULT));
    ckpt_tl_fill_skip = 0;
    DG_H5_CHECK(dset, "%s: cannot create dataset /%s", c->partial_path, td->path);
    int direct = 0;
    DG_TRY(direct_plan(c, i, dset, ch, &direct));
    if (skip && !direct) { /* the same on every rank: both were agreed */
        c->fill_broken = 1;
        return DG_ERR(DG_ERR_RUNTIME,
                      "%s:/%s: its fill was skipped, but HDF5 did not allocate its chunks as the "
                      "direct chunk writer expects",
                      c->partial_path, td->path);
    }
    float dummy = 0;
    for (int k = 0; k < td->maxpieces; k++) {
        const dg_ckpt_tensor_t *p = k < td->npieces ? &c->t[td->pieces[k]] : NULL;
        int mine = p && p->owner && ckpt_numel(p->ndim, p->count) > 0;
        /* with direct chunks, HDF5 writes only the rows outside this piece's whole chunks */
        int64_t rem[2][2] = {{0, 0}, {0, 0}};
        if (mine && direct) {
            direct_remainder(p, (int64_t)ch[0], rem);
            if (rem[0][1] <= rem[0][0] && rem[1][1] <= rem[1][0]) mine = 0;
        }
        hid_t fs = ckpt_hbag_add(b, H5Scopy(space));
        DG_H5_CHECK(fs, "%s:/%s", c->partial_path, td->path);
        hid_t ms;
        if (mine && direct) {
            hsize_t cn[DG_CKPT_MAX_NDIM];
            for (int d = 0; d < td->ndim; d++)
                cn[d] = (hsize_t)p->count[d];
            ms = ckpt_hbag_add(b, H5Screate_simple(td->ndim, cn, NULL));
            DG_H5_CHECK(ms, "%s:/%s: memory dataspace", c->partial_path, td->path);
            DG_H5_CHECK(H5Sselect_none(fs), "%s:/%s", c->partial_path, td->path);
            DG_H5_CHECK(H5Sselect_none(ms), "%s:/%s", c->partial_path, td->path);
            for (int r = 0; r < 2; r++) {
                if (rem[r][1] <= rem[r][0]) continue;
                hsize_t st[DG_CKPT_MAX_NDIM] = {0}, mst[DG_CKPT_MAX_NDIM] = {0}, rc[DG_CKPT_MAX_NDIM];
                for (int d = 0; d < td->ndim; d++)
                    rc[d] = cn[d];
                st[0] = (hsize_t)rem[r][0];
                mst[0] = (hsize_t)(rem[r][0] - p->start[0]);
                rc[0] = (hsize_t)(rem[r][1] - rem[r][0]);
                DG_H5_CHECK(H5Sselect_hyperslab(fs, H5S_SELECT_OR, st, NULL, rc, NULL), "%s:/%s: selection",
                            c->partial_path, td->path);
                DG_H5_CHECK(H5Sselect_hyperslab(ms, H5S_SELECT_OR, mst, NULL, rc, NULL), "%s:/%s: selection",
                            c->partial_path, td->path);
            }
        } else if (mine) {
            hsize_t st[DG_CKPT_MAX_NDIM], cn[DG_CKPT_MAX_NDIM];
            for (int d = 0; d < td->ndim; d++)
                st[d] = (hsize_t)p->start[d], cn[d] = (hsize_t)p->count[d];
            DG_H5_CHECK(H5Sselect_hyperslab(fs, H5S_SELECT_SET, st, NULL, cn, NULL), "%s:/%s: selection",
                        c->partial_path, td->path);
            ms = ckpt_hbag_add(b, H5Screate_simple(td->ndim, cn, NULL));
        } else {
            /* no piece here: still part of the collective write, with nothing selected */
            DG_H5_CHECK(H5Sselect_none(fs), "%s:/%s", c->partial_path, td->path);
            hsize_t one = 1;
            ms = ckpt_hbag_add(b, H5Screate_simple(1, &one, NULL));
            if (ms >= 0) DG_H5_CHECK(H5Sselect_none(ms), "%s:/%s", c->partial_path, td->path);
        }
        DG_H5_CHECK(ms, "%s:/%s: memory dataspace", c->partial_path, td->path);
        DG_H5_CHECK(H5Dwrite(dset, H5T_NATIVE_FLOAT, ms, fs, c->dxpl, mine ? (const void *)p->data : &dummy),
                    "%s: writing dataset /%s", c->partial_path, td->path);
        H5Sclose(ms);
        H5Sclose(fs);
        b->n -= 2; /* both were the last two handles added */
    }
    DG_TRY(ckpt_attr_put_u64(dset, "xxh3", td->hash, c->partial_path));
    return DG_OK;
}

static dg_status_t write_manifest(save_ctx_t *c, ckpt_hbag_t *b) {
    int n = c->tab.n;
    ckpt_mrow_t *rows = dg_xcalloc((size_t)(n > 0 ? n : 1), sizeof *rows);
    for (int i = 0; i < n; i++) {
        const ckpt_tdesc_t *td = &c->tab.t[i];
        snprintf(rows[i].path, sizeof rows[i].path, "%s", td->path);
        rows[i].ndim = td->ndim;
        for (int d = 0; d < DG_CKPT_MAX_NDIM; d++)
            rows[i].shape[d] = d < td->ndim ? td->gshape[d] : 0;
        rows[i].hash = td->hash;
        snprintf(rows[i].origin, sizeof rows[i].origin, "%s", c->origin[i]);
    }
    dg_status_t s = DG_OK;
    hsize_t dims = (hsize_t)n, ch = (hsize_t)(n < 4096 ? (n > 0 ? n : 1) : 4096);
    hid_t mt = ckpt_hbag_add(b, ckpt_mrow_type());
    hid_t space = ckpt_hbag_add(b, H5Screate_simple(1, &dims, NULL));
    hid_t dcpl = ckpt_hbag_add(b, H5Pcreate(H5P_DATASET_CREATE));
    if (mt < 0 || space < 0 || dcpl < 0)
        s = ckpt_h5_fail(DG_ERR_RUNTIME, __FILE__, __LINE__, "H5Tcreate()", "%s:/manifest", c->partial_path);
    if (!s && n > 0 && (H5Pset_chunk(dcpl, 1, &ch) < 0 || H5Pset_fletcher32(dcpl) < 0))
        s = ckpt_h5_fail(DG_ERR_RUNTIME, __FILE__, __LINE__, "H5Pset_chunk()", "%s:/manifest",
                         c->partial_path);
    hid_t d = -1;
    if (!s) {
        d = ckpt_hbag_add(b, H5Dcreate2(c->fid, "manifest", mt, space, H5P_DEFAULT, dcpl, H5P_DEFAULT));
        if (d < 0)
            s = ckpt_h5_fail(DG_ERR_RUNTIME, __FILE__, __LINE__, "H5Dcreate2()", "%s:/manifest",
                             c->partial_path);
    }
    if (!s && n > 0) {
        hid_t fs = ckpt_hbag_add(b, H5Scopy(space));
        hsize_t one = 1;
        hid_t ms = ckpt_hbag_add(b, c->rank == 0 ? H5Scopy(space) : H5Screate_simple(1, &one, NULL));
        if (c->rank != 0) H5Sselect_none(fs), H5Sselect_none(ms);
        if (fs < 0 || ms < 0 || H5Dwrite(d, mt, ms, fs, c->dxpl, rows) < 0)
            s = ckpt_h5_fail(DG_ERR_RUNTIME, __FILE__, __LINE__, "H5Dwrite()", "%s: writing /manifest",
                             c->partial_path);
    }
    free(rows);
    return s;
}

/* ---------------- retention (rank 0, after the commit) ---------------- */

static int has_name(char (*set)[256], int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (strcmp(set[i], name) == 0) return 1;
    return 0;
}

/* The files `name` links to, from its "bases" attribute. */
static dg_status_t read_bases(const char *dir, const char *name, char *out, size_t cap) {
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    hid_t fapl = ckpt_fapl(MPI_COMM_NULL, 0);
    hid_t fid = fapl >= 0 ? H5Fopen(path, H5F_ACC_RDONLY, fapl) : -1;
    if (fapl >= 0) H5Pclose(fapl);
    if (fid < 0) return ckpt_h5_fail(DG_ERR_USAGE, __FILE__, __LINE__, "H5Fopen()", "%s", path);
    dg_status_t s = ckpt_attr_get_str(fid, "bases", out, cap, path);
    H5Fclose(fid);
    return s;
}

static void retention(const char *dir, int keep) {
    dg_ckpt_dir_entry_t *e = NULL;
    int n = 0;
    char latest[256] = "";
    if (dg_ckpt_list_dir(dir, &e, &n, latest) != DG_OK) {
        DG_LOG_WARN("checkpoint retention: %s", dg_last_error());
        return;
    }
    /* stale pieces of interrupted saves: nothing else writes into this directory right now */
    for (int i = 0; i < n; i++)
        if (e[i].partial) {
            char p[4400];
            snprintf(p, sizeof p, "%s/%s", dir, e[i].name);
            if (unlink(p) == 0) DG_LOG_INFO("checkpoint retention: removed interrupted save %s", p);
        }
    DIR *dd = opendir(dir);
    if (dd) {
        struct dirent *de;
        while ((de = readdir(dd)))
            if (!strncmp(de->d_name, "LATEST.tmp.", 11)) {
                char p[4400];
                snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
                unlink(p);
            }
        closedir(dd);
    }
    if (keep <= 0) {
        free(e);
        return;
    }
    /* keep: the newest `keep` complete files and LATEST's target; protect what they link to (closure) */
    char(*live)[256] = dg_xcalloc((size_t)n + 1, 256);
    int nlive = 0, kept = 0;
    for (int i = 0; i < n; i++)
        if (!e[i].partial && (kept < keep || strcmp(e[i].name, latest) == 0)) {
            if (kept < keep) kept++;
            snprintf(live[nlive++], 256, "%s", e[i].name);
        }
    if (latest[0] && !has_name(live, nlive, latest) && nlive <= n) snprintf(live[nlive++], 256, "%s", latest);
    for (int q = 0; q < nlive; q++) {
        char bases[4096];
        if (read_bases(dir, live[q], bases, sizeof bases) != DG_OK) {
            DG_LOG_WARN("checkpoint retention: cannot tell what %s/%s links to (%s); deleting nothing", dir,
                        live[q], dg_last_error());
            free(live), free(e);
            return;
        }
        for (char *tok = strtok(bases, " "); tok; tok = strtok(NULL, " "))
            if (!has_name(live, nlive, tok) && nlive <= n) snprintf(live[nlive++], 256, "%s", tok);
    }
    int removed = 0;
    for (int i = 0; i < n; i++) {
        if (e[i].partial || has_name(live, nlive, e[i].name)) continue;
        char p[4400];
        snprintf(p, sizeof p, "%s/%s", dir, e[i].name);
        if (unlink(p) == 0) {
            removed++;
            DG_LOG_INFO("checkpoint retention: removed %s", p);
        } else {
            DG_LOG_WARN("checkpoint retention: cannot remove %s: %s", p, strerror(errno));
        }
    }
    if (removed) ckpt_fsync_dir(dir);
    free(live), free(e);
}

/* ---------------- phases ---------------- */

static dg_status_t prepare_rank0(save_ctx_t *c) {
    DG_TRY(dg_mkdir_p(c->dir));
    /* Whatever is at the partial name goes first (a leftover, or a symlink planted to redirect the write
     * elsewhere: unlink removes the link, never its target), and the file is then created exclusively
     * (H5F_ACC_EXCL: O_CREAT | O_EXCL, which refuses to follow a symlink that appears in between). */
    if (unlink(c->partial_path) != 0 && errno != ENOENT) {
        /* e.g. a directory of that name: H5Fcreate would fail less clearly */
        struct stat st;
        if (stat(c->partial_path, &st) == 0 && S_ISDIR(st.st_mode))
            return DG_ERR(DG_ERR_RUNTIME, "cannot write checkpoint: %s exists and is a directory",
                          c->partial_path);
    }
    if (c->o.incremental) DG_TRY(decide_links(c));
    return DG_OK;
}

/* Window of the flush below: each one that completes is progress for the watchdog. */
#define CKPT_SYNC_WINDOW ((off_t)64 << 20)

/* fsync, preceded by a windowed flush (start writeback, wait for it) so that a slow device shows
 * progress while it drains the page cache instead of one fsync that is silent for minutes. */
static dg_status_t fsync_file(const char *path) {
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return DG_ERR(DG_ERR_RUNTIME, "cannot open %s to fsync it: %s", path, strerror(errno));
#ifdef __linux__
    struct stat st;
    if (fstat(fd, &st) == 0)
        for (off_t off = 0; off < st.st_size; off += CKPT_SYNC_WINDOW) {
            off_t len = st.st_size - off < CKPT_SYNC_WINDOW ? st.st_size - off : CKPT_SYNC_WINDOW;
            /* errors (unsupported here, or an I/O error) are left to the fsync below to report */
            if (sync_file_range(fd, off, len,
                                SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                                    SYNC_FILE_RANGE_WAIT_AFTER) != 0)
                break;
            ckpt_progress_add((uint64_t)len);
        }
#endif
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    if (rc != 0) return DG_ERR(DG_ERR_RUNTIME, "fsync %s: %s", path, strerror(e));
    return DG_OK;
}

/* ---------------- space ---------------- */

/* An estimate of the file's size on disk: every stored chunk at its filtered size (edge chunks are
 * stored whole; the alignment gaps are holes, never written), and metadata: object headers, chunk
 * indexes, attributes, the config text (stored twice at most: dense attribute storage), the manifest. */
static int64_t estimate_bytes(const save_ctx_t *c) {
    int64_t total = 256 << 10;
    total += (int64_t)c->tab.n * (6 << 10);
    if (c->meta.config_text) total += 2 * (int64_t)strlen(c->meta.config_text);
    for (int i = 0; i < c->tab.n; i++) {
        const ckpt_tdesc_t *td = &c->tab.t[i];
        if (c->origin[i][0]) continue; /* a link: a few bytes of metadata */
        hsize_t ch[DG_CKPT_MAX_NDIM];
        chunk_dims(td->ndim, td->gshape, c->o.chunk_bytes, ch);
        if (c->rows && c->rows[i] > 0) {
            ch[0] = (hsize_t)c->rows[i];
            for (int d = 1; d < td->ndim; d++)
                ch[d] = (hsize_t)td->gshape[d];
        }
        int64_t nchunks = 1, cbytes = 4;
        for (int d = 0; d < td->ndim; d++) {
            nchunks *= (td->gshape[d] + (int64_t)ch[d] - 1) / (int64_t)ch[d];
            cbytes *= (int64_t)ch[d];
        }
        total += nchunks * (cbytes + 4);
    }
    return total;
}

/* Space available to us in `dir` (statvfs: blocks available to unprivileged users), or -1 when the file
 * system does not say (statvfs fails or reports no blocks at all, as some network and FUSE ones do). */
static int64_t free_bytes(const char *dir) {
    struct statvfs sv;
    if (statvfs(dir, &sv) != 0 || sv.f_blocks == 0) return -1;
    return (int64_t)sv.f_bavail * (int64_t)(sv.f_frsize ? sv.f_frsize : sv.f_bsize);
}

/* Rank 0, before anything is written: refuse a save that cannot fit. */
static dg_status_t space_check_rank0(save_ctx_t *c) {
    if (!c->o.space_check) return DG_OK;
    int64_t avail = free_bytes(c->dir);
    if (avail < 0 || avail >= c->needed) return DG_OK;
    c->io.nospace = 1;
    return DG_ERR(DG_ERR_RUNTIME,
                  "%s has %.1f MB free, less than the %.1f MB this checkpoint needs; nothing was written",
                  c->dir, (double)avail / 1e6, (double)c->needed / 1e6);
}

static dg_status_t commit_rank0(save_ctx_t *c) {
    DG_TRY(ckpt_test_fail("commit", c->rank));
    struct stat st;
    if (stat(c->partial_path, &st) != 0)
        return DG_ERR(DG_ERR_RUNTIME, "checkpoint %s vanished before its commit: %s", c->partial_path,
                      strerror(errno));
    /* the umask decides the mode; we only ever take world-write away */
    if ((st.st_mode & S_IWOTH) && chmod(c->partial_path, st.st_mode & 07775) != 0)
        return DG_ERR(DG_ERR_RUNTIME, "chmod %s: %s", c->partial_path, strerror(errno));
    /* LATEST's new content is written and flushed first, so that between the step file's rename and
     * LATEST's only a directory fsync remains: a kill inside that window leaves a complete step file
     * newer than LATEST, which resume ignores (LATEST decides) and the next save of that step replaces. */
    char tmp[4200];
    DG_TRY(ckpt_latest_prepare(c->dir, c->final_name, tmp, sizeof tmp));
    if (rename(c->partial_path, c->final_path) != 0) {
        int e = errno;
        unlink(tmp);
        return DG_ERR(DG_ERR_RUNTIME, "cannot rename %s to %s: %s", c->partial_path, c->final_path,
                      strerror(e));
    }
    dg_status_t s = ckpt_fsync_dir(c->dir); /* the step file's name is durable before LATEST names it */
    if (!s) s = ckpt_test_fail("renamed", c->rank);
    if (s) {
        unlink(tmp);
        return s;
    }
    return ckpt_latest_publish(c->dir, tmp);
}

/* Create, fill and close the partial file. Every step is agreed. */
/* Every rank must reach the directory rank 0 prepared: a checkpoint.dir on a node-local file system
 * fails here with a clear message, not inside the collective open (where a rank that cannot open the
 * file leaves the others waiting in MPI-IO). */
static dg_status_t check_dir_visible(const save_ctx_t *c) {
    struct stat st;
    if (stat(c->dir, &st) != 0)
        return DG_ERR(DG_ERR_RUNTIME,
                      "checkpoint directory %s does not exist on this node (%s): checkpoint.dir must be on a "
                      "file system that every node shares",
                      c->dir, strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return DG_ERR(DG_ERR_RUNTIME, "checkpoint directory %s is not a directory", c->dir);
    if (access(c->dir, W_OK | X_OK) != 0)
        return DG_ERR(DG_ERR_RUNTIME, "cannot write into the checkpoint directory %s: %s", c->dir,
                      strerror(errno));
    return DG_OK;
}

/* An agreement point of the write phase: this rank's recorded write failure counts as a failure, and
 * once any rank failed every rank stops writing (HDF5 then closes the file without touching the disk). */
static dg_status_t agree_io(save_ctx_t *c, dg_status_t s) {
    if (!s) s = ckpt_io_status(&c->io);
    s = ckpt_agree(c->comm, s);
    if (s) c->io.failed_all = 1;
    return s;
}

static dg_status_t write_file(save_ctx_t *c) {
    double t_create = dg_now_s();
    dg_status_t s = check_dir_visible(c);
    if (!s) s = ckpt_test_fail("create", c->rank);
    hid_t fapl = -1;
    if (!s) {
        fapl = ckpt_fapl(c->comm, c->o.align_bytes == 0 ? CKPT_DEFAULT_ALIGN : c->o.align_bytes);
        if (fapl < 0)
            s = ckpt_h5_fail(DG_ERR_RUNTIME, __FILE__, __LINE__, "H5Pset_fapl_mpio()", "%s", c->partial_path);
    }
    s = ckpt_agree(c->comm, s);
    if (s) {
        if (fapl >= 0) H5Pclose(fapl);
        return s;
    }
    c->fid = H5Fcreate(c->partial_path, H5F_ACC_EXCL, H5P_DEFAULT, fapl);
    H5Pclose(fapl);
    if (c->fid < 0)
        s = ckpt_h5_fail(DG_ERR_RUNTIME, __FILE__, __LINE__, "H5Fcreate()", "cannot create checkpoint %s",
                         c->partial_path);
    s = ckpt_agree(c->comm, s);
    if (s) {
        if (c->fid >= 0) { /* created on some ranks only: close it without writing anything */
            c->io.comm = c->comm;
            c->io.failed_all = 1;
            ckpt_tl_io = &c->io;
            H5Fclose(c->fid);
            ckpt_tl_io = NULL;
        }
        c->fid = -1;
        return s;
    }
    /* from here on, HDF5's writes go through the guard above */
    c->io.comm = c->comm;
    c->io.rank = c->rank;
    c->io.path = c->partial_path;
    c->io.throttle_ms = ckpt_test_throttle_ms(c->rank);
    ckpt_tl_io = &c->io;
    c->dxpl = H5Pcreate(H5P_DATASET_XFER);
    c->lcpl = H5Pcreate(H5P_LINK_CREATE);
    if (c->dxpl < 0 || c->lcpl < 0 || H5Pset_dxpl_mpio(c->dxpl, H5FD_MPIO_COLLECTIVE) < 0 ||
        H5Pset_create_intermediate_group(c->lcpl, 1) < 0)
        s = ckpt_h5_fail(DG_ERR_RUNTIME, __FILE__, __LINE__, "H5Pcreate()", "%s: transfer properties",
                         c->partial_path);
    if (!s) s = ckpt_meta_write(c->fid, &c->meta, c->size, c->base, c->bases, c->partial_path);
    if (!s && c->direct) {
        c->wfd = open(c->partial_path, O_WRONLY | O_NOFOLLOW | O_CLOEXEC);
        if (c->wfd < 0)
            s = DG_ERR(DG_ERR_RUNTIME, "cannot open %s for writing chunks: %s", c->partial_path,
                       strerror(errno));
    }
    s = agree_io(c, s);
    double t_data = dg_now_s();
    c->ph.create = t_data - t_create;
    /* Start writeback while we keep writing: the kernel would otherwise hold everything dirty (below
     * its background threshold) until the final fsync, which then waits for the whole file. */
    int wb_fd = open(c->partial_path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    int64_t since_kick = 0;
    for (int i = 0; i < c->tab.n && !s; i++) {
        ckpt_hbag_t b = {0};
        s = write_tensor(c, i, &b);
        ckpt_hbag_close(&b);
        if (!s) s = ckpt_test_fail("write", c->rank);
        if (!s && i == 0) ckpt_test_stall("write", c->rank); /* once a save: ":N" counts saves */
        s = agree_io(c, s);
        /* Parallel HDF5 1.10 writes every chunk of a Fletcher32 dataset at creation (the filtered fill
         * value, whatever the fill time: seen with strace), before the data. With direct chunk writes
         * the data comes after all datasets exist: writeback started now would send those zeros to the
         * disk only for them to be overwritten, so only the direct writer kicks it then. */
        since_kick += c->origin[i][0] || c->direct ? 0 : c->tab.t[i].numel * 4;
        if (wb_fd >= 0 && since_kick >= CKPT_WRITEBACK_BYTES) {
            kick_writeback(wb_fd);
            since_kick = 0;
        }
    }
    if (wb_fd >= 0) close(wb_fd);
    if (!s) {
        ckpt_hbag_t b = {0};
        s = write_manifest(c, &b);
        ckpt_hbag_close(&b);
        s = agree_io(c, s);
    }
    /* the chunks this rank writes itself, all at once over the worker threads */
    double t_direct = dg_now_s();
    if (!s && c->ndj) s = direct_write_all(c);
    if (c->direct) s = agree_io(c, s);
    c->ph.direct = dg_now_s() - t_direct;
    if (c->wfd >= 0) close(c->wfd);
    c->wfd = -1;
    if (c->dxpl >= 0) H5Pclose(c->dxpl);
    if (c->lcpl >= 0) H5Pclose(c->lcpl);
    c->dxpl = c->lcpl = -1;
    double t_close = dg_now_s();
    c->ph.write = t_close - t_data;
    herr_t cr = H5Fclose(c->fid);
    c->fid = -1;
    if (!s && cr < 0)
        s = ckpt_h5_fail(DG_ERR_RUNTIME, __FILE__, __LINE__, "H5Fclose()", "closing checkpoint %s",
                         c->partial_path);
    if (!s) s = ckpt_test_fail("close", c->rank);
    if (!s) ckpt_test_stall("close", c->rank);
    s = agree_io(c, s); /* (a write HDF5 made while closing counts: the guard recorded it) */
    ckpt_tl_io = NULL;
    /* each rank flushes what it wrote (on parallel file systems one client's fsync is not enough) */
    double t_sync = dg_now_s();
    c->ph.close = t_sync - t_close;
    if (!s) s = ckpt_agree(c->comm, fsync_file(c->partial_path));
    c->ph.fsync = dg_now_s() - t_sync;
    DG_LOG_DEBUG("checkpoint %s: create %.3f s, write %.3f s (of which direct chunks %.3f s, %zu chunks), "
                 "close %.3f s, fsync %.3f s (Fletcher32: %s)",
                 c->final_name, c->ph.create, c->ph.write, c->ph.direct, c->ndj, c->ph.close, c->ph.fsync,
                 dg_ckpt_fletcher32_interposed() ? "dgtrain's" : "HDF5's");
    return s;
}

static dg_status_t save_attempt(MPI_Comm comm, const char *dir, const dg_ckpt_meta_t *meta,
                                const dg_ckpt_tensor_t *t, int n, const dg_ckpt_save_opts_t *opts,
                                dg_ckpt_save_result_t *res, int allow_skip_fill, int *fill_broken) {
    double t0 = dg_now_s(), cpu0 = ckpt_cpu_seconds();
    ckpt_tl_fill_skipped_bytes = 0;
    if (res) {
        memset(res, 0, sizeof *res);
        res->free_bytes = -1;
    }
    save_ctx_t c;
    memset(&c, 0, sizeof c);
    c.comm = comm;
    c.fid = c.dxpl = c.lcpl = -1;
    c.wfd = -1;
    {
        c.direct = dg_env_bool("DG_CKPT_DIRECT_CHUNKS");
        c.skip_fill = allow_skip_fill && dg_env_bool("DG_CKPT_SKIP_FILL");
    }
    DG_MPI_CHECK(MPI_Comm_rank(comm, &c.rank));
    DG_MPI_CHECK(MPI_Comm_size(comm, &c.size));
    if (opts)
        c.o = *opts;
    else
        dg_ckpt_save_opts_default(&c.o);
    if (c.o.chunk_bytes <= 0) c.o.chunk_bytes = DG_CKPT_DEFAULT_CHUNK_BYTES;
    if (c.o.chunk_bytes > ((int64_t)1 << 30)) c.o.chunk_bytes = (int64_t)1 << 30;
    dg_status_t s = DG_OK;
    if (!dir || !*dir || strlen(dir) >= sizeof c.dir - 64)
        s = DG_ERR(DG_ERR_USAGE, "checkpoint directory is empty or too long");
    else if (!meta)
        s = DG_ERR(DG_ERR_USAGE, "checkpoint save: meta is NULL");
    else if (meta->step < 0)
        s = DG_ERR(DG_ERR_USAGE, "checkpoint save: step %lld is negative", (long long)meta->step);
    if (!s) {
        snprintf(c.dir, sizeof c.dir, "%s", dir);
        s = ckpt_table_build(t, n, 0, &c.tab);
    }
    s = ckpt_agree(comm, s);
    if (!s) s = ckpt_table_agree(comm, t, &c.tab);
    c.t = t;
    /* rank 0's meta, stamped with version and time, is what every rank writes */
    dg_ckpt_meta_t local;
    if (!s) {
        local = *meta;
        snprintf(local.version, sizeof local.version, "%s", DG_VERSION_STRING);
        local.created_unix = (int64_t)time(NULL);
        struct tm tm;
        time_t now = (time_t)local.created_unix;
        gmtime_r(&now, &tm);
        strftime(local.created, sizeof local.created, "%Y-%m-%dT%H:%M:%SZ", &tm);
        local.world_size = c.size;
        local.format_version = DG_CKPT_FORMAT_VERSION;
        s = ckpt_meta_bcast(comm, &local, &c.meta);
        if (!s && c.meta.step != meta->step)
            s = DG_ERR(DG_ERR_USAGE, "checkpoint save: this rank is at step %lld but rank 0 at step %lld",
                       (long long)meta->step, (long long)c.meta.step);
        s = ckpt_agree(comm, s);
    }
    c.ph.threads = ckpt_threads(comm, c.o.threads); /* collective: called on every path */
    {
        int d[2] = {c.direct, c.skip_fill}, a[2]; /* every rank must take the same path: the environment
                                                     could differ */
        if (MPI_Allreduce(d, a, 2, MPI_INT, MPI_MIN, comm) != MPI_SUCCESS) a[0] = a[1] = 0;
        c.direct = a[0], c.skip_fill = a[1];
    }
    double t_hash = dg_now_s();
    if (!s) s = ckpt_table_hash(comm, t, &c.tab, c.ph.threads);
    double t_prep = dg_now_s();
    if (!s) {
        ckpt_step_name(c.meta.step, c.final_name, sizeof c.final_name);
        snprintf(c.final_path, sizeof c.final_path, "%s/%s", c.dir, c.final_name);
        snprintf(c.partial_path, sizeof c.partial_path, "%.4100s.partial", c.final_path);
        c.origin = dg_xcalloc((size_t)(c.tab.n > 0 ? c.tab.n : 1), 256);
        s = ckpt_bcast_status(comm, 0, c.rank == 0 ? prepare_rank0(&c) : DG_OK);
    }
    if (!s && c.o.incremental) {
        int rc = MPI_Bcast(c.origin, c.tab.n * 256, MPI_CHAR, 0, comm);
        rc |= MPI_Bcast(c.base, sizeof c.base, MPI_CHAR, 0, comm);
        rc |= MPI_Bcast(c.bases, sizeof c.bases, MPI_CHAR, 0, comm);
        if (rc != MPI_SUCCESS) s = DG_ERR(DG_ERR_RUNTIME, "MPI_Bcast of the incremental plan failed");
    }
    if (!s) s = ckpt_agree(comm, align_rows(&c));
    int sized = 0; /* c.needed is known on every rank */
    if (!s) {
        if (c.rank == 0) c.needed = estimate_bytes(&c);
        s = MPI_Bcast(&c.needed, 1, MPI_INT64_T, 0, comm) == MPI_SUCCESS
                ? DG_OK
                : DG_ERR(DG_ERR_RUNTIME, "MPI_Bcast of the checkpoint size failed");
        sized = !s;
    }
    if (!s) s = ckpt_bcast_status(comm, 0, c.rank == 0 ? space_check_rank0(&c) : DG_OK);
    int wrote = 0;
    double t_write = dg_now_s();
    if (!s) {
        ckpt_partial_register(c.partial_path, 1);
        s = write_file(&c);
        wrote = 1;
    }
    double t_commit = dg_now_s();
    if (!s) s = ckpt_bcast_status(comm, 0, c.rank == 0 ? commit_rank0(&c) : DG_OK);
    if (s && wrote && c.rank == 0) unlink(c.partial_path); /* best effort: retention also sweeps these */
    if (wrote) ckpt_partial_register(c.partial_path, 0);
    /* a failed save: did it run out of space? (every rank reaches this with the same status) */
    int no_space = 0;
    int64_t avail = -1;
    if (s && sized) {
        int64_t v[2] = {c.io.nospace, -1}; /* [any rank saw ENOSPC, rank 0's free space after the unlink] */
        int64_t any = 0;
        if (MPI_Allreduce(&v[0], &any, 1, MPI_INT64_T, MPI_MAX, comm) == MPI_SUCCESS) {
            if (c.rank == 0) v[1] = free_bytes(c.dir);
            if (MPI_Bcast(&v[1], 1, MPI_INT64_T, 0, comm) == MPI_SUCCESS) avail = v[1];
        }
        no_space = any || (avail >= 0 && avail < c.needed);
        if (no_space) {
            char first[1400];
            snprintf(first, sizeof first, "%s", dg_last_error());
            char freetxt[64] = "unknown";
            if (avail >= 0) snprintf(freetxt, sizeof freetxt, "%.1f MB", (double)avail / 1e6);
            s = DG_ERR(s, "not enough space for checkpoint %s in %s: it needs about %.1f MB, %s free (%s)",
                       c.final_name, c.dir, (double)c.needed / 1e6, freetxt, first);
        }
    } else if (!s) {
        if (c.rank == 0) avail = free_bytes(c.dir);
        MPI_Bcast(&avail, 1, MPI_INT64_T, 0, comm);
    }
    if (res) {
        res->no_space = no_space;
        res->needed_bytes = c.needed;
        res->free_bytes = avail;
    }
    double t_ret = dg_now_s();
    if (!s && c.rank == 0) retention(c.dir, c.o.keep);
    double t_end = dg_now_s();
    int64_t bytes = 0;
    if (!s && c.rank == 0) {
        struct stat st;
        if (stat(c.final_path, &st) == 0) bytes = (int64_t)st.st_size;
    }
    if (!s) {
        if (MPI_Bcast(&bytes, 1, MPI_INT64_T, 0, comm) != MPI_SUCCESS)
            s = DG_ERR(DG_ERR_RUNTIME, "MPI_Bcast failed after the checkpoint commit");
    }
    if (!s && res) {
        int64_t needed = res->needed_bytes, fb = res->free_bytes;
        memset(res, 0, sizeof *res);
        res->needed_bytes = needed;
        res->free_bytes = fb;
        snprintf(res->path, sizeof res->path, "%.4000s", c.final_path);
        res->step = c.meta.step;
        res->bytes = bytes;
        res->n_tensors = c.tab.n;
        for (int i = 0; i < c.tab.n; i++) {
            res->logical_bytes += c.tab.t[i].numel * 4;
            if (c.origin[i][0]) {
                res->linked_bytes += c.tab.t[i].numel * 4;
                res->n_linked++;
            }
        }
        res->seconds = dg_now_s() - t0;
        res->stall_ms = res->seconds * 1e3;
        snprintf(res->base, sizeof res->base, "%s", c.base);
        c.ph.validate = t_hash - t0;
        c.ph.hash = t_prep - t_hash;
        c.ph.plan = t_write - t_prep;
        c.ph.commit = t_ret - t_commit;
        c.ph.retention = t_end - t_ret;
        c.ph.cpu = ckpt_cpu_seconds() - cpu0;
        c.ph.fill_skipped_bytes = ckpt_tl_fill_skipped_bytes;
        res->phases = c.ph;
    }
    if (!s)
        DG_LOG_DEBUG("checkpoint %s phases: validate %.3f s, hash %.3f s (%d threads), plan %.3f s, create "
                     "%.3f s, write %.3f s, close %.3f s, fsync %.3f s, commit %.3f s, retention %.3f s",
                     c.final_name, t_hash - t0, t_prep - t_hash, c.ph.threads, t_write - t_prep, c.ph.create,
                     c.ph.write, c.ph.close, c.ph.fsync, t_ret - t_commit, t_end - t_ret);
    if (!s)
        DG_LOG_INFO("checkpoint: wrote %s (%.1f MB, %d of %d tensors linked to older checkpoints) in %.2f s",
                    c.final_path, (double)bytes / 1e6, res ? res->n_linked : 0, c.tab.n, dg_now_s() - t0);
    free(c.origin);
    free(c.dj);
    free(c.rows);
    dg_ckpt_meta_destroy(&c.meta);
    ckpt_table_free(&c.tab);
    *fill_broken = s && c.fill_broken;
    return s;
}

dg_status_t ckpt_save_locked(MPI_Comm comm, const char *dir, const dg_ckpt_meta_t *meta,
                             const dg_ckpt_tensor_t *t, int n, const dg_ckpt_save_opts_t *opts,
                             dg_ckpt_save_result_t *res) {
    int broken = 0;
    dg_status_t s = save_attempt(comm, dir, meta, t, n, opts, res, 1, &broken);
    if (s && broken) { /* agreed: every rank saw the same chunk index */
        DG_LOG_WARN("checkpoint: %s; writing it again with HDF5's fill, and filling from now on",
                    dg_last_error());
        atomic_store(&ckpt_fill_skip_off, 1);
        dg_clear_error();
        s = save_attempt(comm, dir, meta, t, n, opts, res, 0, &broken);
    }
    return s;
}

dg_status_t dg_ckpt_save(MPI_Comm comm, const char *ckpt_dir, const dg_ckpt_meta_t *meta,
                         const dg_ckpt_tensor_t *t, int n, const dg_ckpt_save_opts_t *opts,
                         dg_ckpt_save_result_t *res) {
    /* background writes submitted earlier commit first, so LATEST follows submission order */
    ckpt_inflight_wait_zero();
    ckpt_lock();
    dg_status_t s = ckpt_save_locked(comm, ckpt_dir, meta, t, n, opts, res);
    ckpt_unlock();
    return s;
}
