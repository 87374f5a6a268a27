/* hash.c — the decomposition-independent content hash of a tensor (definition in ckpt_impl.h and
 * docs/checkpoint-format.md). Whole tiles are hashed where they lie; tiles split between pieces (or
 * ranks) travel as fragments to one rank, chosen by the tile's index, which assembles and hashes them.
 * The per-tensor sums then meet in one all-reduce. */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "ckpt_impl.h"

#include <stdlib.h>
#include <string.h>

#include "dg_mpi.h"

typedef struct frag_hdr {
    int32_t tensor;
    int32_t dest;
    int64_t row, tile, off, len; /* off, len in elements within the tile */
} frag_hdr_t;

/* Bytes of one fragment in the buffers: header plus data padded to 8 so the next header is aligned. */
static size_t frag_size(int64_t len) {
    return sizeof(frag_hdr_t) + (((size_t)len * sizeof(float) + 7) & ~(size_t)7);
}

void ckh_init(ckh_t *h, int ntensors) {
    memset(h, 0, sizeof *h);
    h->n = ntensors;
    h->sum = dg_xcalloc((size_t)(ntensors > 0 ? ntensors : 1), sizeof(uint64_t));
}

void ckh_free(ckh_t *h) {
    free(h->sum);
    free(h->frag);
    memset(h, 0, sizeof *h);
}

static void frag_push(ckh_t *h, int ti, int64_t row, int64_t tile, int64_t off, int64_t len, const float *p) {
    size_t need = frag_size(len);
    if (h->frag_len + need > h->frag_cap) {
        size_t cap = h->frag_cap ? h->frag_cap * 2 : 65536;
        while (cap < h->frag_len + need)
            cap *= 2;
        h->frag = realloc(h->frag, cap);
        DG_ASSERTF(h->frag != NULL, "out of memory for hash fragments");
        h->frag_cap = cap;
    }
    frag_hdr_t hd = {ti, 0, row, tile, off, len};
    memcpy(h->frag + h->frag_len, &hd, sizeof hd);
    memcpy(h->frag + h->frag_len + sizeof hd, p, (size_t)len * sizeof(float));
    h->frag_len += need;
}

static inline uint64_t tile_hash(const float *p, int64_t len, int64_t row, int64_t ntiles, int64_t tile) {
    return XXH3_64bits_withSeed(p, (size_t)len * sizeof(float), (XXH64_hash_t)(row * ntiles + tile));
}

void ckh_add(ckh_t *h, int ti, int ndim, const int64_t *gshape, const int64_t *start, const int64_t *count,
             const float *data) {
    DG_ASSERT(ti >= 0 && ti < h->n && ndim >= 1 && ndim <= DG_CKPT_MAX_NDIM);
    int64_t nrows = 1;
    for (int d = 0; d < ndim; d++)
        if (count[d] <= 0) return;
    for (int d = 0; d < ndim - 1; d++)
        nrows *= count[d];
    const int64_t C = gshape[ndim - 1], c0 = start[ndim - 1], cn = count[ndim - 1], c1 = c0 + cn;
    const int64_t T = (C + CKH_TILE - 1) / CKH_TILE;
    int64_t idx[DG_CKPT_MAX_NDIM] = {0}; /* position among the leading dims of the piece */
    uint64_t sum = 0;
    for (int64_t lr = 0; lr < nrows; lr++) {
        int64_t grow = 0; /* global row index over gshape[0..ndim-2] */
        for (int d = 0; d < ndim - 1; d++)
            grow = grow * gshape[d] + start[d] + idx[d];
        const float *row = data + lr * cn;
        for (int64_t t = c0 / CKH_TILE; t * CKH_TILE < c1; t++) {
            int64_t a = t * CKH_TILE, b = a + CKH_TILE < C ? a + CKH_TILE : C;
            int64_t lo = a > c0 ? a : c0, hi = b < c1 ? b : c1;
            if (lo == a && hi == b)
                sum += tile_hash(row + (a - c0), b - a, grow, T, t);
            else
                frag_push(h, ti, grow, t, lo - a, hi - lo, row + (lo - c0));
        }
        for (int d = ndim - 2; d >= 0; d--) { /* next leading index, row-major */
            if (++idx[d] < count[d]) break;
            idx[d] = 0;
        }
    }
    h->sum[ti] += sum;
}

void ckh_merge(ckh_t *dst, ckh_t *src) {
    DG_ASSERT(dst->n == src->n);
    for (int i = 0; i < dst->n; i++)
        dst->sum[i] += src->sum[i];
    if (src->frag_len) {
        if (dst->frag_len + src->frag_len > dst->frag_cap) {
            size_t cap = dst->frag_len + src->frag_len;
            dst->frag = realloc(dst->frag, cap);
            DG_ASSERTF(dst->frag != NULL, "out of memory for hash fragments");
            dst->frag_cap = cap;
        }
        memcpy(dst->frag + dst->frag_len, src->frag, src->frag_len);
        dst->frag_len += src->frag_len;
    }
    memset(src->sum, 0, (size_t)src->n * sizeof(uint64_t));
    src->frag_len = 0;
}

uint64_t ckh_final(uint64_t sum, int ndim, const int64_t *gshape) {
    uint64_t desc[1 + DG_CKPT_MAX_NDIM];
    desc[0] = (uint64_t)ndim;
    for (int d = 0; d < ndim; d++)
        desc[1 + d] = (uint64_t)gshape[d];
    return XXH3_64bits_withSeed(desc, sizeof(uint64_t) * (size_t)(1 + ndim), sum);
}

static int frag_cmp(const void *a, const void *b) {
    const frag_hdr_t *x = *(const frag_hdr_t *const *)a, *y = *(const frag_hdr_t *const *)b;
    if (x->tensor != y->tensor) return x->tensor < y->tensor ? -1 : 1;
    if (x->row != y->row) return x->row < y->row ? -1 : 1;
    if (x->tile != y->tile) return x->tile < y->tile ? -1 : 1;
    if (x->off != y->off) return x->off < y->off ? -1 : 1;
    return 0;
}

/* Assemble the fragments in buf[0..len) tile by tile and add the tile hashes to sum[]. */
static dg_status_t assemble(const char *buf, size_t len, const ckpt_table_t *tab, uint64_t *sum) {
    size_t nf = 0;
    for (size_t o = 0; o < len; nf++)
        o += frag_size(((const frag_hdr_t *)(buf + o))->len);
    if (!nf) return DG_OK;
    const frag_hdr_t **f = dg_xmalloc(nf * sizeof *f);
    size_t i = 0;
    for (size_t o = 0; o < len; i++) {
        f[i] = (const frag_hdr_t *)(buf + o);
        o += frag_size(f[i]->len);
    }
    qsort(f, nf, sizeof *f, frag_cmp);
    float *tile = dg_xmalloc(CKH_TILE * sizeof(float));
    dg_status_t s = DG_OK;
    for (size_t a = 0; a < nf && !s;) {
        const ckpt_tdesc_t *td = &tab->t[f[a]->tensor];
        const int64_t C = td->gshape[td->ndim - 1], T = (C + CKH_TILE - 1) / CKH_TILE;
        const int64_t tl = (f[a]->tile + 1) * CKH_TILE < C ? CKH_TILE : C - f[a]->tile * CKH_TILE;
        int64_t have = 0;
        size_t b = a;
        for (; b < nf && f[b]->tensor == f[a]->tensor && f[b]->row == f[a]->row && f[b]->tile == f[a]->tile;
             b++) {
            if (f[b]->off != have) {
                s = DG_ERR(DG_ERR_USAGE,
                           "tensor %s: the owned pieces %s at row %lld, columns %lld.. (each element needs "
                           "exactly one owner)",
                           td->path, f[b]->off < have ? "overlap" : "leave a gap", (long long)f[b]->row,
                           (long long)(f[a]->tile * CKH_TILE + (f[b]->off < have ? f[b]->off : have)));
                break;
            }
            memcpy(tile + have, (const char *)f[b] + sizeof(frag_hdr_t), (size_t)f[b]->len * 4);
            have += f[b]->len;
        }
        if (!s && have != tl)
            s = DG_ERR(DG_ERR_USAGE,
                       "tensor %s: the owned pieces leave a gap at row %lld, column %lld (each element needs "
                       "exactly one owner)",
                       td->path, (long long)f[a]->row, (long long)(f[a]->tile * CKH_TILE + have));
        if (!s) sum[f[a]->tensor] += tile_hash(tile, tl, f[a]->row, T, f[a]->tile);
        a = b;
    }
    free(tile);
    free(f);
    return s;
}

static int frag_dest(const frag_hdr_t *h, int size) {
    uint64_t x = (uint64_t)h->tensor * 0x9E3779B97F4A7C15ULL ^ (uint64_t)h->row * 0xC2B2AE3D27D4EB4FULL ^
                 (uint64_t)h->tile * 0x165667B19E3779F9ULL;
    x ^= x >> 31;
    x *= 0xD6E8FEB86659FD93ULL;
    x ^= x >> 29;
    return (int)(x % (uint64_t)size);
}

static dg_status_t exchange(ckh_t *h, MPI_Comm comm, char **rbuf_out, size_t *rlen_out) {
    int size;
    DG_MPI_CHECK(MPI_Comm_size(comm, &size));
    size_t *bytes = dg_xcalloc((size_t)size, sizeof(size_t));
    for (size_t o = 0; o < h->frag_len;) {
        frag_hdr_t *hd = (frag_hdr_t *)(h->frag + o);
        size_t sz = frag_size(hd->len);
        hd->dest = frag_dest(hd, size);
        bytes[hd->dest] += sz;
        o += sz;
    }
    int *scnt = dg_xcalloc((size_t)size, sizeof(int)), *rcnt = dg_xcalloc((size_t)size, sizeof(int));
    int *sdis = dg_xcalloc((size_t)size, sizeof(int)), *rdis = dg_xcalloc((size_t)size, sizeof(int));
    dg_status_t s = DG_OK;
    size_t tot = 0;
    for (int r = 0; r < size; r++) {
        if (tot + bytes[r] > (size_t)INT32_MAX)
            s = DG_ERR(DG_ERR_RUNTIME, "hash fragments exceed 2 GiB per rank");
        sdis[r] = (int)tot;
        scnt[r] = (int)bytes[r];
        tot += bytes[r];
    }
    s = ckpt_agree(comm, s);
    char *sbuf = NULL, *rbuf = NULL;
    if (!s) {
        sbuf = dg_xmalloc(tot ? tot : 1);
        size_t *pos = dg_xcalloc((size_t)size, sizeof(size_t));
        for (size_t o = 0; o < h->frag_len;) {
            const frag_hdr_t *hd = (const frag_hdr_t *)(h->frag + o);
            size_t sz = frag_size(hd->len);
            memcpy(sbuf + sdis[hd->dest] + pos[hd->dest], hd, sz);
            pos[hd->dest] += sz;
            o += sz;
        }
        free(pos);
        int rc = MPI_Alltoall(scnt, 1, MPI_INT, rcnt, 1, MPI_INT, comm);
        size_t rtot = 0;
        dg_status_t ls = DG_OK;
        for (int r = 0; r < size; r++) {
            if (rtot + (size_t)rcnt[r] > (size_t)INT32_MAX)
                ls = DG_ERR(DG_ERR_RUNTIME, "hash fragments exceed 2 GiB");
            rdis[r] = (int)rtot;
            rtot += (size_t)rcnt[r];
        }
        if (rc != MPI_SUCCESS) ls = DG_ERR(DG_ERR_RUNTIME, "MPI_Alltoall of hash fragment sizes failed");
        s = ckpt_agree(comm, ls);
        if (!s) {
            rbuf = dg_xmalloc(rtot ? rtot : 1);
            rc = MPI_Alltoallv(sbuf, scnt, sdis, MPI_BYTE, rbuf, rcnt, rdis, MPI_BYTE, comm);
            if (rc != MPI_SUCCESS) s = DG_ERR(DG_ERR_RUNTIME, "MPI_Alltoallv of hash fragments failed");
            *rlen_out = rtot;
        }
    }
    free(sbuf);
    free(bytes), free(scnt), free(rcnt), free(sdis), free(rdis);
    if (s) {
        free(rbuf);
        return s;
    }
    *rbuf_out = rbuf;
    return DG_OK;
}

dg_status_t ckh_finish(ckh_t *h, MPI_Comm comm, const ckpt_table_t *tab, uint64_t *out) {
    DG_ASSERT(tab->n == h->n);
    uint64_t *sum = dg_xcalloc((size_t)(h->n > 0 ? h->n : 1), sizeof(uint64_t));
    memcpy(sum, h->sum, (size_t)h->n * sizeof(uint64_t));
    dg_status_t s;
    if (comm == MPI_COMM_NULL) {
        s = assemble(h->frag, h->frag_len, tab, sum);
    } else {
        int64_t any = (int64_t)h->frag_len, anyall = 0;
        if (MPI_Allreduce(&any, &anyall, 1, MPI_INT64_T, MPI_MAX, comm) != MPI_SUCCESS) {
            free(sum);
            return DG_ERR(DG_ERR_RUNTIME, "MPI_Allreduce failed while hashing");
        }
        s = DG_OK;
        if (anyall > 0) {
            char *rbuf = NULL;
            size_t rlen = 0;
            s = exchange(h, comm, &rbuf, &rlen);
            if (!s) s = ckpt_agree(comm, assemble(rbuf, rlen, tab, sum));
            free(rbuf);
        }
        if (!s && h->n > 0) {
            uint64_t *tot = dg_xcalloc((size_t)h->n, sizeof(uint64_t));
            if (MPI_Allreduce(sum, tot, h->n, MPI_UINT64_T, MPI_SUM, comm) != MPI_SUCCESS)
                s = DG_ERR(DG_ERR_RUNTIME, "MPI_Allreduce of content hashes failed");
            memcpy(sum, tot, (size_t)h->n * sizeof(uint64_t));
            free(tot);
        }
    }
    if (!s)
        for (int i = 0; i < h->n; i++)
            out[i] = ckh_final(sum[i], tab->t[i].ndim, tab->t[i].gshape);
    free(sum);
    return s;
}
