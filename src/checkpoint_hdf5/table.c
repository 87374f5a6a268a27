/* table.c — the tensor table: validates the caller's pieces, groups them by tensor, and checks across
 * ranks that everybody describes the same tensors and that the owned pieces cover each exactly once.
 * Save and load both start here, so bad descriptions fail the same way in both. */
#define _GNU_SOURCE
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "ckpt_impl.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "dg_mpi.h"

int64_t ckpt_numel(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= shape[d];
    return n;
}

static int path_char_ok(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-' || c == '/';
}

static dg_status_t check_path(const char *p, int i) {
    if (!p || !*p) return DG_ERR(DG_ERR_USAGE, "checkpoint tensor %d: empty path", i);
    size_t len = strlen(p);
    if (len > DG_CKPT_MAX_PATH)
        return DG_ERR(DG_ERR_USAGE, "checkpoint tensor path '%.40s...' is longer than %d bytes", p,
                      DG_CKPT_MAX_PATH);
    for (size_t k = 0; k < len; k++)
        if (!path_char_ok(p[k]))
            return DG_ERR(DG_ERR_USAGE,
                          "checkpoint tensor path '%s': character '%c' not allowed (use A-Z a-z 0-9 . _ - /)",
                          p, p[k]);
    const char *c = p;
    int first = 1;
    while (1) {
        const char *e = strchr(c, '/');
        size_t n = e ? (size_t)(e - c) : strlen(c);
        if (n == 0 || (n == 1 && c[0] == '.') || (n == 2 && c[0] == '.' && c[1] == '.'))
            return DG_ERR(DG_ERR_USAGE, "checkpoint tensor path '%s': empty, '.' or '..' component", p);
        if (first && ((n == 5 && !strncmp(c, "state", 5)) || (n == 8 && !strncmp(c, "manifest", 8))))
            return DG_ERR(DG_ERR_USAGE, "checkpoint tensor path '%s': top-level name '%.*s' is reserved", p,
                          (int)n, c);
        first = 0;
        if (!e) break;
        c = e + 1;
    }
    return DG_OK;
}

static dg_status_t check_piece(const dg_ckpt_tensor_t *t, int i, int for_load) {
    DG_TRY(check_path(t->path, i));
    if (t->ndim < 1 || t->ndim > DG_CKPT_MAX_NDIM)
        return DG_ERR(DG_ERR_USAGE, "checkpoint tensor %s: ndim %d outside 1..%d", t->path, t->ndim,
                      DG_CKPT_MAX_NDIM);
    if (t->owner != 0 && t->owner != 1)
        return DG_ERR(DG_ERR_USAGE, "checkpoint tensor %s: owner must be 0 or 1, got %d", t->path, t->owner);
    int64_t numel = 1, local = 1;
    for (int d = 0; d < t->ndim; d++) {
        if (t->gshape[d] < 1 || t->gshape[d] > ((int64_t)1 << 40))
            return DG_ERR(DG_ERR_USAGE, "checkpoint tensor %s: global dim %d is %lld (expected 1..2^40)",
                          t->path, d, (long long)t->gshape[d]);
        if (t->start[d] < 0 || t->count[d] < 0 || t->start[d] > t->gshape[d] - t->count[d])
            return DG_ERR(
                DG_ERR_USAGE,
                "checkpoint tensor %s: piece start %lld count %lld on dim %d is outside the global size "
                "%lld",
                t->path, (long long)t->start[d], (long long)t->count[d], d, (long long)t->gshape[d]);
        if (numel > ((int64_t)1 << 50) / t->gshape[d])
            return DG_ERR(DG_ERR_USAGE, "checkpoint tensor %s: more than 2^50 elements", t->path);
        numel *= t->gshape[d];
        local *= t->count[d];
    }
    if (local > 0 && !t->data && (for_load || t->owner))
        return DG_ERR(DG_ERR_USAGE, "checkpoint tensor %s: data is NULL for a piece of %lld elements",
                      t->path, (long long)local);
    return DG_OK;
}

static int idx_cmp(const void *a, const void *b, void *ctx) {
    const dg_ckpt_tensor_t *t = ctx;
    int x = *(const int *)a, y = *(const int *)b;
    int c = strcmp(t[x].path, t[y].path);
    if (c) return c;
    return x < y ? -1 : x > y;
}

typedef struct {
    int first, begin, end; /* first index in caller order; range in the sorted index array */
} group_t;
static int group_cmp(const void *a, const void *b) {
    const group_t *x = a, *y = b;
    return x->first < y->first ? -1 : x->first > y->first;
}

dg_status_t ckpt_table_build(const dg_ckpt_tensor_t *t, int n, int for_load, ckpt_table_t *tab) {
    memset(tab, 0, sizeof *tab);
    if (n < 0 || (n > 0 && !t)) return DG_ERR(DG_ERR_USAGE, "checkpoint: bad tensor list (n = %d)", n);
    for (int i = 0; i < n; i++)
        DG_TRY(check_piece(&t[i], i, for_load));
    int *ord = dg_xmalloc((size_t)(n > 0 ? n : 1) * sizeof(int));
    for (int i = 0; i < n; i++)
        ord[i] = i;
    qsort_r(ord, (size_t)n, sizeof(int), idx_cmp, (void *)t);
    group_t *g = dg_xmalloc((size_t)(n > 0 ? n : 1) * sizeof(group_t));
    int ng = 0;
    dg_status_t s = DG_OK;
    for (int i = 0; i < n && !s;) {
        int j = i;
        while (j < n && strcmp(t[ord[j]].path, t[ord[i]].path) == 0) {
            const dg_ckpt_tensor_t *a = &t[ord[i]], *b = &t[ord[j]];
            int same = a->ndim == b->ndim;
            for (int d = 0; same && d < a->ndim; d++)
                same = a->gshape[d] == b->gshape[d];
            if (!same)
                s = DG_ERR(DG_ERR_USAGE, "checkpoint tensor %s: pieces disagree on the global shape",
                           a->path);
            j++;
        }
        g[ng++] = (group_t){ord[i], i, j};
        /* "a/b" as a dataset and "a/b/c" below it cannot both exist: sorted order puts them next to each
         * other, possibly separated by names like "a/b.x" which sort between; check the next groups too. */
        for (int k = j; k < n && !s; k++) {
            size_t la = strlen(t[ord[i]].path);
            if (strncmp(t[ord[k]].path, t[ord[i]].path, la) != 0) break;
            if (t[ord[k]].path[la] == '/')
                s = DG_ERR(DG_ERR_USAGE, "checkpoint tensor paths '%s' and '%s': one is a group of the other",
                           t[ord[i]].path, t[ord[k]].path);
        }
        i = j;
    }
    if (s) {
        free(ord), free(g);
        return s;
    }
    qsort(g, (size_t)ng, sizeof(group_t), group_cmp);
    tab->n = ng;
    tab->t = dg_xcalloc((size_t)(ng > 0 ? ng : 1), sizeof(ckpt_tdesc_t));
    tab->piece_idx = dg_xmalloc((size_t)(n > 0 ? n : 1) * sizeof(int));
    int pos = 0;
    for (int k = 0; k < ng; k++) {
        ckpt_tdesc_t *d = &tab->t[k];
        const dg_ckpt_tensor_t *f = &t[g[k].first];
        d->path = f->path;
        d->ndim = f->ndim;
        memcpy(d->gshape, f->gshape, sizeof d->gshape);
        for (int x = f->ndim; x < DG_CKPT_MAX_NDIM; x++)
            d->gshape[x] = 0;
        d->numel = ckpt_numel(f->ndim, f->gshape);
        d->pieces = tab->piece_idx + pos;
        /* pieces in caller order: the sorted range holds them ascending by index already */
        for (int r = g[k].begin; r < g[k].end; r++)
            tab->piece_idx[pos++] = ord[r];
        d->npieces = g[k].end - g[k].begin;
        d->maxpieces = d->npieces;
    }
    free(ord), free(g);
    return DG_OK;
}

void ckpt_table_free(ckpt_table_t *tab) {
    free(tab->t);
    free(tab->piece_idx);
    memset(tab, 0, sizeof *tab);
}

static uint64_t table_signature(const ckpt_table_t *tab) {
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    int64_t n = tab->n;
    XXH3_64bits_update(&st, &n, sizeof n);
    for (int i = 0; i < tab->n; i++) {
        XXH3_64bits_update(&st, tab->t[i].path, strlen(tab->t[i].path) + 1);
        int64_t nd = tab->t[i].ndim;
        XXH3_64bits_update(&st, &nd, sizeof nd);
        XXH3_64bits_update(&st, tab->t[i].gshape, sizeof tab->t[i].gshape);
    }
    return XXH3_64bits_digest(&st);
}

dg_status_t ckpt_table_agree(MPI_Comm comm, const dg_ckpt_tensor_t *t, ckpt_table_t *tab) {
    int rank, size;
    DG_MPI_CHECK(MPI_Comm_rank(comm, &rank));
    DG_MPI_CHECK(MPI_Comm_size(comm, &size));
    uint64_t sig = table_signature(tab), lo = 0, hi = 0;
    DG_MPI_CHECK(MPI_Allreduce(&sig, &lo, 1, MPI_UINT64_T, MPI_MIN, comm));
    DG_MPI_CHECK(MPI_Allreduce(&sig, &hi, 1, MPI_UINT64_T, MPI_MAX, comm));
    if (lo != hi) {
        struct {
            uint64_t sig;
            int64_t n;
        } mine = {sig, tab->n}, *all = dg_xmalloc(sizeof mine * (size_t)size);
        int rc = MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, comm);
        int bad = 1;
        while (bad < size && all[bad].sig == all[0].sig)
            bad++;
        dg_status_t s =
            DG_ERR(DG_ERR_USAGE,
                   "checkpoint: ranks disagree on the tensor list (rank %d lists %lld tensors, rank 0 "
                   "lists %lld, or their names or shapes differ)",
                   bad < size ? bad : -1, bad < size ? (long long)all[bad].n : -1LL, (long long)all[0].n);
        free(all);
        if (rc != MPI_SUCCESS) return DG_ERR(DG_ERR_RUNTIME, "MPI_Allgather failed");
        return s;
    }
    if (tab->n == 0) return DG_OK;
    int *mp = dg_xmalloc((size_t)tab->n * sizeof(int)), *mpall = dg_xmalloc((size_t)tab->n * sizeof(int));
    int64_t *own = dg_xcalloc((size_t)tab->n, sizeof(int64_t)),
            *ownall = dg_xcalloc((size_t)tab->n, sizeof(int64_t));
    for (int i = 0; i < tab->n; i++) {
        mp[i] = tab->t[i].npieces;
        for (int k = 0; k < tab->t[i].npieces; k++) {
            const dg_ckpt_tensor_t *p = &t[tab->t[i].pieces[k]];
            if (p->owner) own[i] += ckpt_numel(p->ndim, p->count);
        }
    }
    int rc1 = MPI_Allreduce(mp, mpall, tab->n, MPI_INT, MPI_MAX, comm);
    int rc2 = MPI_Allreduce(own, ownall, tab->n, MPI_INT64_T, MPI_SUM, comm);
    dg_status_t s = DG_OK;
    if (rc1 != MPI_SUCCESS || rc2 != MPI_SUCCESS)
        s = DG_ERR(DG_ERR_RUNTIME, "MPI_Allreduce failed (tensor table)");
    for (int i = 0; i < tab->n && !s; i++) {
        tab->t[i].maxpieces = mpall[i];
        if (ownall[i] != tab->t[i].numel)
            s = DG_ERR(
                DG_ERR_USAGE,
                "checkpoint tensor %s: the owned pieces cover %lld elements, the tensor has %lld (each "
                "element needs exactly one owner)",
                tab->t[i].path, (long long)ownall[i], (long long)tab->t[i].numel);
    }
    free(mp), free(mpall), free(own), free(ownall);
    return s;
}

/* The local part of the hash is cut into items of about HASH_ITEM elements: pieces of 2+ dimensions
 * along dim 0 (whole rows, so no new fragments), 1-D pieces at global multiples of HASH_ITEM (a multiple
 * of the tile, so again no new fragments). Each worker hashes items into its own ckh_t; the sums add
 * (order-free) and the fragments are sorted before assembly, so any thread count gives the same hash. */
#define HASH_ITEM ((int64_t)1 << 20)

typedef struct hash_item {
    int ti;
    int ndim;
    const int64_t *gshape;
    int64_t start[DG_CKPT_MAX_NDIM], count[DG_CKPT_MAX_NDIM];
    const float *data;
} hash_item_t;

typedef struct hash_job {
    hash_item_t *items;
    size_t n;
    atomic_size_t next;
    ckh_t *h; /* one per worker */
} hash_job_t;

static void hash_worker(void *ctx, size_t w) {
    hash_job_t *j = ctx;
    for (size_t i; (i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed)) < j->n;) {
        const hash_item_t *it = &j->items[i];
        ckh_add(&j->h[w], it->ti, it->ndim, it->gshape, it->start, it->count, it->data);
        ckpt_progress_add((uint64_t)ckpt_numel(it->ndim, it->count) * 4); /* hashing is progress too */
    }
}

static size_t add_items(hash_item_t *out, int ti, const dg_ckpt_tensor_t *p) {
    size_t n = 0;
    if (ckpt_numel(p->ndim, p->count) <= 0) return 0;
    hash_item_t base;
    memset(&base, 0, sizeof base);
    base.ti = ti;
    base.ndim = p->ndim;
    base.gshape = p->gshape;
    memcpy(base.start, p->start, sizeof base.start);
    memcpy(base.count, p->count, sizeof base.count);
    if (p->ndim == 1) {
        int64_t s = p->start[0], e = s + p->count[0];
        for (int64_t a = s; a < e;) {
            int64_t b = (a / HASH_ITEM + 1) * HASH_ITEM;
            if (b > e) b = e;
            if (out) {
                out[n] = base;
                out[n].start[0] = a, out[n].count[0] = b - a;
                out[n].data = p->data + (a - s);
            }
            n++;
            a = b;
        }
        return n;
    }
    int64_t inner = ckpt_numel(p->ndim - 1, p->count + 1);
    int64_t rows = HASH_ITEM / inner > 0 ? HASH_ITEM / inner : 1;
    for (int64_t r = 0; r < p->count[0]; r += rows) {
        if (out) {
            out[n] = base;
            out[n].start[0] = p->start[0] + r;
            out[n].count[0] = r + rows < p->count[0] ? rows : p->count[0] - r;
            out[n].data = p->data + r * inner;
        }
        n++;
    }
    return n;
}

dg_status_t ckpt_table_hash(MPI_Comm comm, const dg_ckpt_tensor_t *t, ckpt_table_t *tab, int threads) {
    ckh_t h;
    ckh_init(&h, tab->n);
    size_t nitems = 0;
    for (int pass = 0; pass < 2; pass++) {
        hash_item_t *items = NULL;
        if (pass == 1) items = dg_xmalloc((nitems ? nitems : 1) * sizeof *items);
        size_t k = 0;
        for (int i = 0; i < tab->n; i++)
            for (int q = 0; q < tab->t[i].npieces; q++) {
                const dg_ckpt_tensor_t *p = &t[tab->t[i].pieces[q]];
                if (p->owner) k += add_items(items ? items + k : NULL, i, p);
            }
        if (pass == 0) {
            nitems = k;
            continue;
        }
        if (threads < 1) threads = 1;
        if ((size_t)threads > nitems) threads = nitems > 0 ? (int)nitems : 1;
        hash_job_t job = {items, nitems, 0, NULL};
        job.h = dg_xmalloc((size_t)threads * sizeof *job.h);
        for (int w = 0; w < threads; w++)
            ckh_init(&job.h[w], tab->n);
        ckpt_parallel_for(threads, (size_t)threads, hash_worker, &job);
        for (int w = 0; w < threads; w++) {
            ckh_merge(&h, &job.h[w]);
            ckh_free(&job.h[w]);
        }
        free(job.h);
        free(items);
    }
    uint64_t *out = dg_xcalloc((size_t)(tab->n > 0 ? tab->n : 1), sizeof(uint64_t));
    dg_status_t s = ckh_finish(&h, comm, tab, out);
    if (!s)
        for (int i = 0; i < tab->n; i++)
            tab->t[i].hash = out[i];
    free(out);
    ckh_free(&h);
    return s;
}
