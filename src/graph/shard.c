/* shard.c — the FSDP pass: sharding of every parameter on dim 0 over dp_shard as a rewrite of the
 * differentiated graph (forward + backward), before the optimizer pass creates the (then local) AdamW
 * state.
 *
 * For each bucket (consecutive parameters of one transformer block, up to bucket_bytes unsharded):
 *   forward   all_gather(bucket shard) on the comm stream -> shard_unpack per parameter (waits on it)
 *             -> every forward reader of the parameter reads the unpacked tensor instead;
 *   backward  the same again before the first backward reader when resharding (FSDP2's
 *             reshard_after_forward; the tail of the forward — the bucket used last, the final norm and
 *             the last block, which the backward needs first — keeps its tensors instead);
 *             fill0 of an unsharded f32 gradient buffer before the first kernel that accumulates into
 *             it; after the bucket's last contribution shard_pack (rank-major copy-in, zero padding)
 *             and a reduce_scatter on the comm stream that adds this rank's block into the persistent
 *             gradient shard, waited for just before the next bucket's reduce-scatter is issued.
 *   prefetch  with overlap, the all-gather of the next bucket is moved to where the current bucket's
 *             compute starts, if its gathered buffer fits in prefetch_bytes.
 *   overlap=0 every collective is waited for right after it is issued (no hoisting).
 *   reduce_dtype bf16: the packed buffer is cast to bf16 before the reduce-scatter, which then writes
 *             this rank's bf16 block into a temporary; a cast after its wait adds that into the f32 shard.
 * Unpacking copies (one per parameter) are the price of per-parameter dim-0 shards (FSDP2) with bucketed
 * collectives: the gathered buffer is rank-major, a parameter's rows are spread over the k blocks.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "graph.h"

void dg_shard_plan_free(dg_shard_plan_t *sp) {
    if (!sp) return;
    free(sp->params);
    free(sp->buckets);
    free(sp);
}

/* Schedule position that puts node n (just created, or anywhere) right before x. */
static void place_before(dg_graph_t *g, dg_node_t *n, const dg_node_t *x) {
    int pos = x->id - (n->id < x->id ? 1 + n->n_side : 0);
    dg_graph_move(g, n, pos);
}

static void place_after(dg_graph_t *g, dg_node_t *n, const dg_node_t *x) {
    int pos = x->id + 1 + x->n_side - (n->id < x->id ? 1 + n->n_side : 0);
    dg_graph_move(g, n, pos);
}

static dg_node_t *new_op(dg_graph_t *g, dg_phase_t ph, dg_op_kind_t k, const char *name, int n_src,
                         dg_node_t *const *src, int n_upd, dg_node_t *const *upd, const int64_t *attr,
                         int n_attr) {
    dg_phase_t saved = g->cur_phase;
    g->cur_phase = ph;
    dg_node_t *n = dg_graph_add_op(g, k, name, n_src, src, n_upd, upd, attr, n_attr);
    g->cur_phase = saved;
    return n;
}

static int is_op(const dg_node_t *x) {
    return x->op != DG_OP_LEAF && x->op != DG_OP_SIDE;
}

/* First / last schedule position of a node of phase ph that reads p as an input (or, with `upd`,
 * updates it in place), or -1. */
static void users(const dg_graph_t *g, const dg_node_t *p, dg_phase_t ph, int upd, int *first, int *last) {
    *first = *last = -1;
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *x = g->nodes[i];
        if (!is_op(x) || x->phase != ph) continue;
        int n = upd ? x->n_upd : x->n_src;
        dg_node_t *const *list = upd ? x->upd : x->src;
        for (int k = 0; k < n; k++)
            if (list[k] == p) {
                if (*first < 0) *first = i;
                *last = i;
            }
    }
}

static void readers(const dg_graph_t *g, const dg_node_t *p, dg_phase_t ph, int *first, int *last) {
    users(g, p, ph, 0, first, last);
}

static void updaters(const dg_graph_t *g, const dg_node_t *t, dg_phase_t ph, int *first, int *last) {
    users(g, t, ph, 1, first, last);
}

static void replace_src(dg_graph_t *g, dg_phase_t ph, const dg_node_t *from, dg_node_t *to) {
    for (int i = 0; i < g->n; i++) {
        dg_node_t *x = g->nodes[i];
        if (!is_op(x) || x->phase != ph || x == to) continue;
        for (int k = 0; k < x->n_src; k++)
            if (x->src[k] == from) x->src[k] = to;
    }
    dg_graph_touch(g);
}

static void replace_upd(dg_graph_t *g, dg_phase_t ph, const dg_node_t *from, dg_node_t *to) {
    for (int i = 0; i < g->n; i++) {
        dg_node_t *x = g->nodes[i];
        if (!is_op(x) || x->phase != ph) continue;
        for (int k = 0; k < x->n_upd; k++)
            if (x->upd[k] == from) x->upd[k] = to;
    }
    dg_graph_touch(g);
}

static void add_wait(dg_node_t *n, dg_node_t *on) {
    DG_ASSERT(n->n_wait < DG_MAX_WAIT);
    n->wait[n->n_wait++] = on;
}

static size_t align_elems(size_t n) {
    return (n + 63) / 64 * 64; /* the model's flat-buffer alignment (256 bytes of f32) */
}

static void make_buckets(dg_shard_plan_t *sp) {
    sp->buckets = dg_xcalloc((size_t)sp->n + 1, sizeof *sp->buckets);
    sp->n_buckets = 0;
    size_t cur_bytes = 0;
    for (int i = 0; i < sp->n; i++) {
        const dg_shard_param_t *q = &sp->params[i];
        size_t bytes = (size_t)(q->rows * q->cols) * dg_dtype_size(q->p->dtype);
        dg_bucket_t *b = sp->n_buckets ? &sp->buckets[sp->n_buckets - 1] : NULL;
        if (!b || sp->params[b->first].group != q->group || cur_bytes + bytes > sp->bucket_bytes) {
            b = &sp->buckets[sp->n_buckets++];
            b->first = i;
            cur_bytes = 0;
        }
        b->last = i;
        cur_bytes += bytes;
    }
    for (int j = 0; j < sp->n_buckets; j++) {
        dg_bucket_t *b = &sp->buckets[j];
        const dg_shard_param_t *l = &sp->params[b->last];
        size_t end = l->off + align_elems((size_t)(l->Rs * l->cols));
        b->S = (int64_t)(end - sp->params[b->first].off);
    }
}

static void bucket_name(char *buf, size_t cap, const dg_shard_plan_t *sp, const dg_bucket_t *b) {
    if (b->first == b->last)
        dg_fmt(buf, cap, "%.80s", sp->params[b->first].p->name);
    else
        dg_fmt(buf, cap, "%.38s..%.38s", sp->params[b->first].p->name, sp->params[b->last].p->name);
}

/* all_gather of bucket b + one unpack per parameter read in phase ph, placed before the first reader;
 * the readers of phase ph are redirected to the unpacked tensors (full[i]). Returns the all_gather (NULL
 * when nothing of the bucket is read in ph). */
static dg_node_t *gather(dg_graph_t *g, dg_shard_plan_t *sp, dg_bucket_t *b, dg_phase_t ph,
                         dg_node_t **full) {
    int first = INT_MAX;
    for (int i = b->first; i <= b->last; i++) {
        int f, l;
        readers(g, sp->params[i].p, ph, &f, &l);
        if (f >= 0 && f < first) first = f;
    }
    if (first == INT_MAX) return NULL;
    const dg_node_t *at = g->nodes[first];
    char nm[96], bn[80];
    bucket_name(bn, sizeof bn, sp, b);
    int64_t attr[2] = {0, DG_MESH_DP_SHARD};
    dg_fmt(nm, sizeof nm, "ag.%s.%s", dg_phase_name(ph), bn);
    dg_node_t *ag = new_op(g, ph, DG_OP_ALL_GATHER, nm, 1, &b->pleaf, 0, NULL, attr, 2);
    if (!ag) return NULL;
    ag->stream = DG_STREAM_COMM;
    place_before(g, ag, at);
    for (int i = b->first; i <= b->last; i++) {
        dg_shard_param_t *q = &sp->params[i];
        int f, l;
        readers(g, q->p, ph, &f, &l);
        if (f < 0) continue;
        int64_t ua[7] = {0,
                         sp->k,
                         b->S,
                         (int64_t)(q->off - sp->params[b->first].off),
                         q->Rs,
                         q->rows,
                         q->p->ndim == 2 ? q->cols : 0};
        dg_fmt(nm, sizeof nm, "unshard.%.80s", q->p->name);
        dg_node_t *u = new_op(g, ph, DG_OP_SHARD_UNPACK, nm, 1, &ag, 0, NULL, ua, 7);
        if (!u) return NULL;
        add_wait(u, ag);
        place_before(g, u, at);
        replace_src(g, ph, q->p, u);
        full[i] = u;
    }
    return ag;
}

/* fill0 / pack / reduce_scatter of bucket b's gradients; returns the reduce_scatter (NULL when no
 * gradient of the bucket is produced on this rank, e.g. tp-rank-0-only biases). */
static dg_node_t *scatter_grads(dg_graph_t *g, dg_shard_plan_t *sp, dg_bucket_t *b, dg_node_t **gfull) {
    int last = -1;
    char nm[96], bn[80];
    for (int i = b->first; i <= b->last; i++) {
        dg_shard_param_t *q = &sp->params[i];
        int f, l;
        updaters(g, q->p->grad, DG_PHASE_BWD, &f, &l);
        if (f < 0) continue;
        int64_t fa[4] = {0, q->p->ndim, q->rows, q->cols};
        dg_fmt(nm, sizeof nm, "gradfull.%.80s", q->p->name);
        dg_node_t *z = new_op(g, DG_PHASE_BWD, DG_OP_FILL0, nm, 0, NULL, 0, NULL, fa, 4);
        if (!z) return NULL;
        place_before(g, z, g->nodes[f]);
        replace_upd(g, DG_PHASE_BWD, q->p->grad, z);
        gfull[i] = z;
    }
    for (int i = b->first; i <= b->last; i++) { /* positions are final only once every fill0 is in */
        int f, l;
        if (!gfull[i]) continue;
        updaters(g, gfull[i], DG_PHASE_BWD, &f, &l);
        if (l > last) last = l;
    }
    if (last < 0) return NULL;
    dg_node_t *after = g->nodes[last], *packed = NULL;
    for (int i = b->first; i <= b->last; i++) {
        dg_shard_param_t *q = &sp->params[i];
        if (!gfull[i]) continue;
        int64_t pa[5] = {packed != NULL, sp->k, b->S, (int64_t)(q->off - sp->params[b->first].off), q->Rs};
        dg_node_t *src[2] = {gfull[i], packed};
        dg_fmt(nm, sizeof nm, "pack.%.80s", q->p->name);
        dg_node_t *pk = new_op(g, DG_PHASE_BWD, DG_OP_SHARD_PACK, nm, packed ? 2 : 1, src, 0, NULL, pa, 5);
        if (!pk) return NULL;
        place_after(g, pk, after);
        after = packed = pk;
    }
    bucket_name(bn, sizeof bn, sp, b);
    if (sp->reduce_dtype != DG_F32) {
        /* reduce in bf16: the packed f32 buffer is cast into a bf16 send buffer (the f32 one dies there),
         * the reduce-scatter writes this rank's bf16 block into a temporary of its own, and after its wait
         * a cast adds that block into the f32 shard (placed in dg_pass_fsdp). Half the bytes on the wire; the
         * persistent shard and its accumulation over micro-batches stay f32. */
        int64_t ca[2] = {0, sp->reduce_dtype};
        dg_fmt(nm, sizeof nm, "rs.cast.%s", bn);
        dg_node_t *c = new_op(g, DG_PHASE_BWD, DG_OP_CAST, nm, 1, &packed, 0, NULL, ca, 2);
        if (!c) return NULL;
        place_after(g, c, after);
        dg_fmt(nm, sizeof nm, "rs.%s", bn);
        int64_t ra[2] = {0, DG_MESH_DP_SHARD};
        dg_node_t *rs = new_op(g, DG_PHASE_BWD, DG_OP_REDUCE_SCATTER, nm, 1, &c, 0, NULL, ra, 2);
        if (!rs) return NULL;
        rs->stream = DG_STREAM_COMM;
        add_wait(rs, c); /* the comm stream starts once the send buffer is cast */
        place_after(g, rs, c);
        int64_t aa[2] = {1, DG_F32};
        dg_fmt(nm, sizeof nm, "rs.acc.%s", bn);
        dg_node_t *acc = new_op(g, DG_PHASE_BWD, DG_OP_CAST, nm, 1, &rs, 1, &b->gleaf, aa, 2);
        if (!acc) return NULL;
        add_wait(acc, rs); /* reads the collective's result (placed after its wait node too) */
        place_after(g, acc, rs);
        return rs;
    }
    dg_fmt(nm, sizeof nm, "rs.%s", bn);
    int64_t ra[2] = {1, DG_MESH_DP_SHARD};
    dg_node_t *rs = new_op(g, DG_PHASE_BWD, DG_OP_REDUCE_SCATTER, nm, 1, &packed, 1, &b->gleaf, ra, 2);
    if (!rs) return NULL;
    rs->stream = DG_STREAM_COMM;
    add_wait(rs, packed); /* the comm stream starts once the send buffer is packed */
    place_after(g, rs, after);
    return rs;
}

/* The cast that adds reduce-scatter rs's bf16 result into the f32 shard (reduce_dtype bf16), or NULL. */
static dg_node_t *acc_of(const dg_graph_t *g, const dg_node_t *rs) {
    for (int i = rs->id + 1; i < g->n; i++)
        if (g->nodes[i]->op == DG_OP_CAST && g->nodes[i]->src[0] == rs) return g->nodes[i];
    return NULL;
}

static int by_id(const void *a, const void *b) {
    const dg_node_t *x = *(dg_node_t *const *)a, *y = *(dg_node_t *const *)b;
    return (x->id > y->id) - (x->id < y->id);
}

/* Prefetch in phase ph: the buckets in the order the phase first uses them (a read of one of their
 * unsharded tensors); the all-gather of bucket j is moved to where the compute of the bucket used
 * before it starts (whether that one was gathered or kept), so one bucket is in flight while the
 * previous one computes. Decided on the schedule before any move, so that hoists do not chain. */
static void hoist(dg_graph_t *g, dg_shard_plan_t *sp, dg_phase_t ph, dg_node_t **ags, dg_node_t *const *full,
                  size_t budget) {
    int nb = sp->n_buckets;
    int *first = dg_xcalloc((size_t)nb + 1, sizeof *first),
        *order = dg_xcalloc((size_t)nb + 1, sizeof *order);
    const dg_node_t **at = dg_xcalloc((size_t)nb + 1, sizeof *at);
    int n = 0;
    for (int j = 0; j < nb; j++) {
        first[j] = -1;
        for (int i = sp->buckets[j].first; i <= sp->buckets[j].last; i++) {
            int f, l;
            if (!full[i]) continue;
            readers(g, full[i], ph, &f, &l);
            if (f >= 0 && (first[j] < 0 || f < first[j])) first[j] = f;
        }
        if (first[j] >= 0) order[n++] = j;
    }
    for (int a = 1; a < n; a++) /* insertion sort by first use */
        for (int b = a; b > 0 && first[order[b]] < first[order[b - 1]]; b--) {
            int t = order[b];
            order[b] = order[b - 1];
            order[b - 1] = t;
        }
    for (int a = 0; a < n; a++)
        at[order[a]] = g->nodes[first[order[a]]];
    for (int a = 1; a < n; a++) {
        dg_node_t *ag = ags[order[a]];
        const dg_node_t *t = at[order[a - 1]];
        if (ag && ag->nbytes <= budget && t->id < ag->id) place_before(g, ag, t);
    }
    free(first);
    free(order);
    free(at);
}

/* The last op of phase ph other than x and y (nodes being placed; either may be NULL). */
static const dg_node_t *last_of_phase(const dg_graph_t *g, dg_phase_t ph, const dg_node_t *x,
                                      const dg_node_t *y) {
    const dg_node_t *l = NULL;
    for (int i = 0; i < g->n; i++)
        if (is_op(g->nodes[i]) && g->nodes[i]->phase == ph && g->nodes[i] != x && g->nodes[i] != y)
            l = g->nodes[i];
    return l;
}

dg_status_t dg_pass_fsdp(dg_graph_t *g, void *ctx) {
    dg_shard_plan_t *sp = ctx;
    char nm[96];
    make_buckets(sp);
    for (int j = 0; j < sp->n_buckets; j++) {
        dg_bucket_t *b = &sp->buckets[j];
        int64_t s[1] = {b->S};
        dg_fmt(nm, sizeof nm, "bucket.%d.param", j);
        b->pleaf = dg_graph_leaf(g, nm, g->act_dtype, 1, s, DG_NF_BUCKET);
        dg_fmt(nm, sizeof nm, "bucket.%d.grad", j);
        b->gleaf = dg_graph_leaf(g, nm, DG_F32, 1, s, DG_NF_BUCKET | DG_NF_GRAD);
        if (!b->pleaf || !b->gleaf) return dg_graph_error(g);
        dg_graph_move(g, b->pleaf, 0); /* leaves precede every op that may come to read them */
        dg_graph_move(g, b->gleaf, 0);
    }
    if (sp->k == 1) return DG_OK; /* buckets serve the dp_replicate all-reduce only */

    int n = sp->n, nb = sp->n_buckets;
    dg_node_t **ffull = dg_xcalloc((size_t)n + 1, sizeof *ffull),
              **bfull = dg_xcalloc((size_t)n + 1, sizeof *bfull);
    dg_node_t **gfull = dg_xcalloc((size_t)n + 1, sizeof *gfull);
    /* per bucket: its forward and backward all-gathers (NULL where there is none) */
    dg_node_t **fags = dg_xcalloc((size_t)nb + 1, sizeof *fags),
              **bags = dg_xcalloc((size_t)nb + 1, sizeof *bags);
    dg_node_t **rss = dg_xcalloc((size_t)nb + 1, sizeof *rss);
    int nrs = 0;
    dg_status_t st = DG_OK;

    /* forward gathers; remember which bucket's forward use ends last (it is the backward's first) */
    int last_bucket = -1, last_pos = -1;
    for (int j = 0; j < nb && st == DG_OK; j++) {
        fags[j] = gather(g, sp, &sp->buckets[j], DG_PHASE_FWD, ffull);
        if (!fags[j]) st = dg_graph_error(g);
    }
    for (int j = 0; j < nb && st == DG_OK; j++)
        for (int i = sp->buckets[j].first; i <= sp->buckets[j].last; i++) {
            if (!ffull[i]) continue;
            int f, l;
            readers(g, ffull[i], DG_PHASE_FWD, &f, &l);
            if (l > last_pos) last_pos = l, last_bucket = j;
        }

    /* backward: gather again (reshard) or keep the forward's unsharded tensors. The tail of the forward
     * is needed first by the backward: the bucket used last (the tied embedding / head), the final norm
     * and the last transformer block keep theirs (FSDP2's advice for the last block) */
    int max_group = 0;
    for (int i = 0; i < n; i++)
        if (sp->params[i].group > max_group) max_group = sp->params[i].group;
    for (int j = 0; j < nb && st == DG_OK; j++) {
        dg_bucket_t *b = &sp->buckets[j];
        int tail = j == last_bucket || sp->params[b->first].group >= max_group - 1;
        if (sp->reshard && !tail) {
            bags[j] = gather(g, sp, b, DG_PHASE_BWD, bfull);
            if (!bags[j]) st = dg_graph_error(g);
        } else {
            for (int i = b->first; i <= b->last; i++) {
                int f, l;
                readers(g, sp->params[i].p, DG_PHASE_BWD, &f, &l);
                if (f < 0) continue;
                DG_ASSERTF(ffull[i], "'%s' is read in the backward but not in the forward",
                           sp->params[i].p->name);
                replace_src(g, DG_PHASE_BWD, sp->params[i].p, ffull[i]);
                bfull[i] = ffull[i];
            }
        }
    }

    /* gradients */
    for (int j = 0; j < nb && st == DG_OK; j++) {
        dg_node_t *rs = scatter_grads(g, sp, &sp->buckets[j], gfull);
        if (rs)
            rss[nrs++] = rs;
        else
            st = dg_graph_error(g);
    }

    /* waits for the reduce-scatters: before the next one is issued (overlap), or at once */
    if (st == DG_OK) qsort(rss, (size_t)nrs, sizeof *rss, by_id);
    for (int j = 0; j < nrs && st == DG_OK; j++) {
        dg_fmt(nm, sizeof nm, "wait.%.80s", rss[j]->name);
        dg_node_t *w = new_op(g, DG_PHASE_BWD, DG_OP_WAIT, nm, 0, NULL, 0, NULL, NULL, 0);
        if (!w) {
            st = dg_graph_error(g);
            break;
        }
        add_wait(w, rss[j]);
        dg_node_t *acc = acc_of(g, rss[j]);
        if (!sp->overlap)
            place_after(g, w, rss[j]);
        else if (j + 1 < nrs) {
            /* before the next bucket's pack chain starts reusing memory for its send buffer */
            const dg_node_t *nx = rss[j + 1]->src[0];
            if (nx->op == DG_OP_CAST) nx = nx->src[0]; /* reduce_dtype bf16: the cast of the packed buffer */
            while (nx->op == DG_OP_SHARD_PACK && nx->attr[DG_A_ACC])
                nx = nx->src[1];
            place_before(g, w, nx);
        } else
            place_after(g, w, last_of_phase(g, DG_PHASE_BWD, w, acc));
        /* the bf16 result joins the f32 shard right after the wait, as add_f32 does for the f32 path */
        if (acc) place_after(g, acc, w);
    }

    if (st == DG_OK && sp->overlap && sp->prefetch_bytes > 0) {
        hoist(g, sp, DG_PHASE_FWD, fags, ffull, sp->prefetch_bytes);
        hoist(g, sp, DG_PHASE_BWD, bags, bfull, sp->prefetch_bytes);
    }

    /* the parameters, their masters and gradients become this rank's local shards */
    for (int i = 0; i < n && st == DG_OK; i++) {
        dg_shard_param_t *q = &sp->params[i];
        int64_t shp[2] = {q->Rs, q->cols};
        dg_node_t *p = q->p;
        dg_node_reshape(p, p->ndim, shp);
        if (p->master != p) dg_node_reshape(p->master, p->ndim, shp);
        dg_node_reshape(p->grad, p->ndim, shp);
        p->shard_dim = p->master->shard_dim = p->grad->shard_dim = 0;
        p->shard_off = p->master->shard_off = p->grad->shard_off = q->row0;
    }
    free(ffull);
    free(bfull);
    free(gfull);
    free(fags);
    free(bags);
    free(rss);
    return st;
}
