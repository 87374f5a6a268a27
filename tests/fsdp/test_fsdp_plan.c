/* test_fsdp_plan.c — the parallel plan without communication (plan-only models, one process):
 *   - memory: parameters + gradients + AdamW state per rank scale as 1 / dp_shard (gpt2-124m, k = 1..8);
 *   - placements: on every coordinate of several meshes (uneven sizes included) the owned pieces of
 *     every global tensor cover it exactly once, and each rank's pieces fit its local tensor;
 *   - schedule: the FSDP pass's collectives (one all-gather per bucket and phase, unpacks waiting on
 *     them, one reduce-scatter per bucket with a wait), prefetch (the next block's all-gather issued
 *     before the current block computes) and its absence with overlap = 0; bucket sizes;
 *   - reduce dtype bf16: the cast ops around every gradient reduction (where they sit, their dtypes,
 *     flags and wait edges, the bf16 temporaries' live ranges), none with f32 or without a
 *     data-parallel dimension;
 *   - the fused gradient norm (sumsq_all) on every mesh: the SUMSQ ops' gradients in their order, every
 *     gradient collective (and its wait) before it, the optimizer-phase all-reduces around it as around
 *     the per-parameter SUMSQ ops;
 *   - bad meshes fail with one clear line.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp.h"
#include "graph.h"
#include "../graph/gtest.h"

static dg_backend_t *be;

static dg_model_t *plan_rd(const dg_model_desc_t *d, const char *mesh, const int coord[3],
                           size_t bucket_bytes, int overlap, int reshard, dg_dtype_t reduce_dtype) {
    dg_model_parallel_t p;
    dg_model_parallel_default(&p);
    int is_auto = 0;
    if (dg_mesh_parse(mesh, 0, &p.mesh, &is_auto) != DG_OK) {
        fprintf(stderr, "bad mesh %s: %s\n", mesh, dg_last_error());
        exit(1);
    }
    memcpy(p.coord, coord, sizeof p.coord);
    p.bucket_bytes = bucket_bytes;
    p.overlap = overlap;
    p.reshard_after_forward = reshard;
    p.reduce_dtype = reduce_dtype;
    dg_model_t *m = NULL;
    dg_status_t st = dg_model_create_parallel(d, be, 2, 7, DG_MODEL_PLAN_ONLY, &p, &m);
    if (st != DG_OK) {
        fprintf(stderr, "FAIL: plan %s at (%d,%d,%d): %s\n", mesh, coord[0], coord[1], coord[2],
                dg_last_error());
        exit(1);
    }
    return m;
}

static dg_model_t *plan(const dg_model_desc_t *d, const char *mesh, const int coord[3], size_t bucket_bytes,
                        int overlap, int reshard) {
    return plan_rd(d, mesh, coord, bucket_bytes, overlap, reshard, DG_F32);
}

static void test_memory(void) {
    dg_model_desc_t d;
    if (dg_model_desc_preset("gpt2-124m", &d) != DG_OK) exit(1);
    d.seq_len = 64; /* the state does not depend on it; keeps the plan small */
    int c0[3] = {0, 0, 0};
    dg_model_t *m1 = plan(&d, "dp_shard=1", c0, 25u << 20, 1, 1);
    size_t b1 = dg_model_state_bytes(m1);
    dg_model_free(m1);
    for (int k = 2; k <= 8; k *= 2) {
        char mesh[32];
        snprintf(mesh, sizeof mesh, "dp_shard=%d", k);
        for (int r = 0; r < k; r += k - 1) { /* first and last rank: padding makes them equal */
            int c[3] = {0, r, 0};
            dg_model_t *m = plan(&d, mesh, c, 25u << 20, 1, 1);
            size_t bk = dg_model_state_bytes(m);
            double ratio = (double)bk * k / (double)b1;
            printf("gpt2-124m dp_shard=%d rank %d: %.2f MB per rank (1 rank %.2f MB), x k = %.4f\n", k, r,
                   bk / 1e6, b1 / 1e6, ratio);
            EXPECT(ratio >= 1.0 && ratio <= 1.01,
                   "dp_shard=%d: state bytes x k / unsharded = %.4f, expected 1..1.01", k, ratio);
            dg_model_free(m);
        }
    }
}

/* Every owned piece of every tensor, over all coordinates, covers the tensor exactly once. */
static void test_cover(const dg_model_desc_t *d, const char *mesh) {
    dg_mesh_shape_t s;
    int is_auto = 0;
    if (dg_mesh_parse(mesh, 0, &s, &is_auto) != DG_OK) exit(1);
    int world = dg_mesh_world(&s), nt = 0;
    unsigned char **cnt = NULL;
    size_t *numel = NULL;
    for (int r = 0; r < world; r++) {
        int c[3];
        dg_mesh_coords(&s, r, c);
        dg_model_t *m = plan(d, mesh, c, 25u << 20, 1, 1);
        if (!cnt) {
            nt = dg_model_n_tensors(m);
            cnt = calloc((size_t)nt, sizeof *cnt);
            numel = calloc((size_t)nt, sizeof *numel);
            for (int i = 0; i < nt; i++) {
                numel[i] = dg_model_param(m, i)->numel;
                cnt[i] = calloc(numel[i], 1);
            }
        }
        for (int i = 0; i < nt; i++) {
            const dg_param_info_t *pi = dg_model_param(m, i);
            dg_model_piece_t pc[DG_MODEL_MAX_PIECES];
            int np = dg_model_local_pieces(m, i, pc);
            size_t ln = dg_model_local_numel(m, i), used = 0;
            int64_t gc = pi->ndim == 2 ? pi->shape[1] : 1;
            for (int j = 0; j < np; j++) {
                EXPECT(pc[j].start[0] >= 0 && pc[j].start[0] + pc[j].count[0] <= pi->shape[0] &&
                           pc[j].start[1] >= 0 && pc[j].start[1] + pc[j].count[1] <= gc,
                       "%s rank %d: '%s' piece %d outside the tensor", mesh, r, pi->name, j);
                EXPECT(pc[j].offset + (size_t)(pc[j].count[0] * pc[j].count[1]) <= ln,
                       "%s rank %d: '%s' piece %d outside the local tensor", mesh, r, pi->name, j);
                used += (size_t)(pc[j].count[0] * pc[j].count[1]);
                if (!dg_model_piece_owner(m, i)) continue;
                for (int64_t a = 0; a < pc[j].count[0]; a++)
                    for (int64_t b = 0; b < pc[j].count[1]; b++) {
                        size_t e = (size_t)((pc[j].start[0] + a) * gc + pc[j].start[1] + b);
                        if (e < numel[i] && cnt[i][e] < 255) cnt[i][e]++;
                    }
            }
            EXPECT(used <= ln, "%s rank %d: '%s' pieces hold %zu elements, local tensor %zu", mesh, r,
                   pi->name, used, ln);
        }
        dg_model_free(m);
    }
    int bad = 0;
    for (int i = 0; i < nt; i++) {
        for (size_t e = 0; e < numel[i] && !bad; e++)
            if (cnt[i][e] != 1) {
                EXPECT(0, "%s: element %zu of tensor %d is owned %d times", mesh, e, i, cnt[i][e]);
                bad = 1;
            }
        free(cnt[i]);
    }
    free(cnt);
    free(numel);
    printf("%-28s %d ranks: owned pieces cover all %d tensors exactly once\n", mesh, world, nt);
}

static int count_op(const dg_graph_t *g, dg_op_kind_t k, dg_phase_t ph) {
    int c = 0;
    for (int i = 0; i < g->n; i++)
        c += g->nodes[i]->op == k && g->nodes[i]->phase == ph;
    return c;
}

static const dg_node_t *find(const dg_graph_t *g, const char *name) {
    for (int i = 0; i < g->n; i++)
        if (strcmp(g->nodes[i]->name, name) == 0) return g->nodes[i];
    return NULL;
}

static void test_schedule(void) {
    dg_model_desc_t d = {3, 4, 64, 32, 128, 128};
    int c[3] = {0, 1, 0};
    /* default buckets: one per block + embeddings + final norm */
    dg_model_t *m = plan(&d, "dp_shard=2", c, 25u << 20, 1, 1);
    const dg_graph_t *g = dg_model_graph(m);
    int nb = 1 + d.n_layer + 1;
    EXPECT(count_op(g, DG_OP_ALL_GATHER, DG_PHASE_FWD) == nb, "forward all-gathers: %d, expected %d buckets",
           count_op(g, DG_OP_ALL_GATHER, DG_PHASE_FWD), nb);
    /* reshard: every bucket but the forward's tail (embeddings / tied head used last, final norm, last
     * block) is gathered again */
    EXPECT(count_op(g, DG_OP_ALL_GATHER, DG_PHASE_BWD) == nb - 3, "backward all-gathers: %d, expected %d",
           count_op(g, DG_OP_ALL_GATHER, DG_PHASE_BWD), nb - 3);
    EXPECT(find(g, "ag.bwd.h.1.ln_1.weight..h.1.mlp.proj.bias") &&
               !find(g, "ag.bwd.h.2.ln_1.weight..h.2.mlp.proj.bias"),
           "reshard: block 1 is gathered again for the backward, the last block (2) is kept");
    EXPECT(count_op(g, DG_OP_REDUCE_SCATTER, DG_PHASE_BWD) == nb, "reduce-scatters: %d, expected %d",
           count_op(g, DG_OP_REDUCE_SCATTER, DG_PHASE_BWD), nb);
    EXPECT(count_op(g, DG_OP_WAIT, DG_PHASE_BWD) == nb, "waits for reduce-scatters: %d, expected %d",
           count_op(g, DG_OP_WAIT, DG_PHASE_BWD), nb);
    EXPECT(count_op(g, DG_OP_ALL_REDUCE, DG_PHASE_OPT) == 1,
           "one all-reduce of the sum of squares over dp_shard");
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *x = g->nodes[i];
        if (x->op == DG_OP_ALL_GATHER || x->op == DG_OP_REDUCE_SCATTER)
            EXPECT(x->stream == DG_STREAM_COMM, "'%s' should be on the comm stream", x->name);
        if (x->op == DG_OP_SHARD_UNPACK)
            EXPECT(x->n_wait == 1 && x->wait[0] == x->src[0], "'%s' must wait for its all-gather", x->name);
    }
    /* prefetch: block 1's all-gather is issued before block 0 starts computing */
    const dg_node_t *ag1 = find(g, "ag.fwd.h.1.ln_1.weight..h.1.mlp.proj.bias"), *ln0 = find(g, "h.0.ln_1");
    EXPECT(ag1 && ln0 && ag1->id < ln0->id,
           "prefetch: the all-gather of block 1 (#%d) should precede h.0.ln_1 (#%d)", ag1 ? ag1->id : -1,
           ln0 ? ln0->id : -1);
    char *txt = NULL;
    size_t cap = 0;
    FILE *mem = open_memstream(&txt, &cap);
    dg_model_print_plan(m, mem, 0);
    fclose(mem);
    EXPECT(strstr(txt, "all_gather") && strstr(txt, "over dp_shard") && strstr(txt, " wait#"),
           "the plan printout should show the collectives, their mesh dimension and the wait edges");
    free(txt);
    dg_model_free(m);

    /* overlap off: no prefetch, every reduce-scatter waited for right after it */
    m = plan(&d, "dp_shard=2", c, 25u << 20, 0, 1);
    g = dg_model_graph(m);
    ag1 = find(g, "ag.fwd.h.1.ln_1.weight..h.1.mlp.proj.bias");
    const dg_node_t *res0 = find(g, "h.0.res_2");
    EXPECT(ag1 && res0 && ag1->id > res0->id,
           "overlap=0: block 1's all-gather must follow block 0's compute");
    for (int i = 0; i < g->n; i++)
        if (g->nodes[i]->op == DG_OP_REDUCE_SCATTER)
            EXPECT(i + 1 < g->n && g->nodes[i + 1]->op == DG_OP_WAIT &&
                       g->nodes[i + 1]->wait[0] == g->nodes[i],
                   "overlap=0: '%s' must be waited for at once", g->nodes[i]->name);
    dg_model_free(m);

    /* no buckets (bucket_mb = 0): one all-gather per parameter, no backward re-gather without reshard */
    m = plan(&d, "dp_shard=2", c, 0, 1, 0);
    g = dg_model_graph(m);
    int np = dg_model_n_tensors(m);
    EXPECT(count_op(g, DG_OP_ALL_GATHER, DG_PHASE_FWD) == np,
           "bucket_mb=0: %d forward all-gathers, expected %d", count_op(g, DG_OP_ALL_GATHER, DG_PHASE_FWD),
           np);
    EXPECT(count_op(g, DG_OP_ALL_GATHER, DG_PHASE_BWD) == 0, "reshard=0: no backward all-gather");
    dg_model_free(m);

    /* tp: two all-reduces in the forward per layer (attention and MLP outputs), two in the backward */
    m = plan(&d, "tp=2", (int[3]){0, 0, 1}, 25u << 20, 1, 1);
    g = dg_model_graph(m);
    int arf = 0;
    for (int i = 0; i < g->n; i++)
        arf += g->nodes[i]->op == DG_OP_ALL_REDUCE && g->nodes[i]->phase == DG_PHASE_FWD &&
               g->nodes[i]->attr[DG_A_ARMODE] == DG_AR_TO_REPLICATE;
    EXPECT(arf == 2 * d.n_layer, "tp=2: %d forward all-reduces, expected %d", arf, 2 * d.n_layer);
    EXPECT(count_op(g, DG_OP_ALL_REDUCE, DG_PHASE_BWD) == 2 * d.n_layer,
           "tp=2: %d backward all-reduces, expected %d", count_op(g, DG_OP_ALL_REDUCE, DG_PHASE_BWD),
           2 * d.n_layer);
    const dg_node_t *at = find(g, "h.0.attn");
    EXPECT(at && at->attr[DG_A_NH] == 2 && at->shape[2] == 32,
           "tp=2: attention runs 2 of 4 heads on [.., 32]");
    /* the row-parallel products reach their residual add through the all-reduce: no fused residual add */
    EXPECT(count_op(g, DG_OP_MATMUL_RES, DG_PHASE_FWD) == 0 &&
               count_op(g, DG_OP_ADD, DG_PHASE_FWD) == 2 * d.n_layer,
           "tp=2: %d matmul_res, %d forward adds (want 0, %d)", count_op(g, DG_OP_MATMUL_RES, DG_PHASE_FWD),
           count_op(g, DG_OP_ADD, DG_PHASE_FWD), 2 * d.n_layer);
    dg_model_free(m);

    /* dp_shard only: every residual add fused, its weight and bias read from the gathered parameters */
    m = plan(&d, "dp_shard=2", c, 25u << 20, 1, 1);
    g = dg_model_graph(m);
    int unpacked = 0;
    for (int i = 0; i < g->n; i++)
        if (g->nodes[i]->op == DG_OP_MATMUL_RES) unpacked += g->nodes[i]->src[1]->op == DG_OP_SHARD_UNPACK;
    EXPECT(count_op(g, DG_OP_MATMUL_RES, DG_PHASE_FWD) == 2 * d.n_layer &&
               count_op(g, DG_OP_ADD, DG_PHASE_FWD) == 0 && unpacked == 2 * d.n_layer,
           "dp_shard=2: %d matmul_res (%d on gathered weights), %d forward adds (want %d, %d, 0)",
           count_op(g, DG_OP_MATMUL_RES, DG_PHASE_FWD), unpacked, count_op(g, DG_OP_ADD, DG_PHASE_FWD),
           2 * d.n_layer, 2 * d.n_layer);
    dg_model_free(m);
}

/* The wait node of comm-stream op x, or NULL. */
static const dg_node_t *wait_of(const dg_graph_t *g, const dg_node_t *x) {
    for (int i = 0; i < g->n; i++)
        if (g->nodes[i]->op == DG_OP_WAIT && g->nodes[i]->n_wait == 1 && g->nodes[i]->wait[0] == x)
            return g->nodes[i];
    return NULL;
}

static int waits_on(const dg_node_t *x, const dg_node_t *on) {
    for (int k = 0; k < x->n_wait; k++)
        if (x->wait[k] == on) return 1;
    return 0;
}

/* The cast reading `src` (with acc = 1 when acc), or NULL. */
static const dg_node_t *cast_of(const dg_graph_t *g, const dg_node_t *src, int acc) {
    for (int i = 0; i < g->n; i++)
        if (g->nodes[i]->op == DG_OP_CAST && g->nodes[i]->src[0] == src &&
            (g->nodes[i]->attr[DG_A_ACC] != 0) == acc)
            return g->nodes[i];
    return NULL;
}

/* train.reduce_dtype = bf16 on one coordinate of `mesh`: against the f32-reduction plan, the only new
 * nodes are casts; every dp_replicate all-reduce sums a bf16 cast of its bucket in place and is followed
 * by its wait and then the cast back (all four flagged DG_NF_GRAD_SYNC, so accumulation micro-batches
 * skip them); every reduce-scatter sends a bf16 cast of its packed buffer and its result is added into
 * the f32 shard by a cast after its wait (every micro-batch); bf16 temporaries stay live until their last
 * reader; the plan passes the independent check. Returns the number of casts. */
static int check_bf16_plan(const dg_model_desc_t *d, const char *mesh, const int c[3], int overlap) {
    dg_model_t *m32 = plan_rd(d, mesh, c, 25u << 20, overlap, 1, DG_F32);
    dg_model_t *m16 = plan_rd(d, mesh, c, 25u << 20, overlap, 1, DG_BF16);
    const dg_graph_t *g32 = dg_model_graph(m32), *g = dg_model_graph(m16);
    const dg_memplan_t *pl = dg_model_plan(m16);
    int casts = 0, ars = 0, rss = 0;
    for (int i = 0; i < g->n; i++)
        casts += g->nodes[i]->op == DG_OP_CAST;
    EXPECT(count_op(g32, DG_OP_CAST, DG_PHASE_BWD) == 0, "%s: the f32-reduction plan holds casts", mesh);
    EXPECT(g->n == g32->n + casts, "%s: %d nodes with bf16 reductions (%d casts), %d with f32", mesh, g->n,
           casts, g32->n);
    OK(dg_plan_check(pl, g));
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *x = g->nodes[i];
        if (x->op == DG_OP_ALL_REDUCE && (x->flags & DG_NF_GRAD_SYNC)) {
            ars++;
            const dg_node_t *cs = x->upd[0], *w = wait_of(g, x);
            const dg_node_t *un = cs->op == DG_OP_CAST ? cast_of(g, cs, 0) : NULL;
            EXPECT(cs->op == DG_OP_CAST && cs->dtype == DG_BF16 && cs->storage == DG_STORE_ARENA &&
                       (cs->flags & DG_NF_GRAD_SYNC) && cs->id < x->id && waits_on(x, cs) &&
                       (cs->src[0]->flags & DG_NF_BUCKET) && cs->src[0]->dtype == DG_F32,
                   "%s: '%s' must sum a bf16 arena cast of its f32 bucket, cast before it (GRAD_SYNC)", mesh,
                   x->name);
            EXPECT(w && (w->flags & DG_NF_GRAD_SYNC), "%s: '%s' has no GRAD_SYNC wait", mesh, x->name);
            EXPECT(un && w && un->id > w->id && un->n_upd == 1 && un->upd[0] == cs->src[0] &&
                       un->attr[DG_A_DTYPE] == DG_F32 && (un->flags & DG_NF_GRAD_SYNC) && waits_on(un, x),
                   "%s: '%s' must be cast back into its bucket after its wait (GRAD_SYNC)", mesh, x->name);
            if (un)
                EXPECT(pl->live_start[cs->id] <= cs->id && pl->live_end[cs->id] >= un->id,
                       "%s: '%s' live [%d, %d] must cover its cast #%d to the cast back #%d", mesh, cs->name,
                       pl->live_start[cs->id], pl->live_end[cs->id], cs->id, un->id);
            if (!overlap && w)
                EXPECT(w->id == x->id + 1, "%s: overlap=0: '%s' waited for at once", mesh, x->name);
        }
        if (x->op == DG_OP_REDUCE_SCATTER) {
            rss++;
            const dg_node_t *cs = x->src[0], *w = wait_of(g, x), *acc = cast_of(g, x, 1);
            EXPECT(x->n_upd == 0 && x->dtype == DG_BF16 && cs->op == DG_OP_CAST && cs->dtype == DG_BF16 &&
                       cs->src[0]->op == DG_OP_SHARD_PACK && waits_on(x, cs) &&
                       !(cs->flags & DG_NF_GRAD_SYNC),
                   "%s: '%s' must scatter a bf16 cast of its packed buffer into a bf16 block", mesh, x->name);
            EXPECT(w && acc && acc->id > w->id && acc->n_upd == 1 && (acc->upd[0]->flags & DG_NF_BUCKET) &&
                       acc->upd[0]->dtype == DG_F32 && acc->attr[DG_A_DTYPE] == DG_F32 &&
                       !(acc->flags & DG_NF_GRAD_SYNC) && waits_on(acc, x),
                   "%s: '%s' must be added into its f32 shard by a cast after its wait", mesh, x->name);
            if (w && acc)
                EXPECT(pl->live_end[x->id] >= acc->id && pl->live_end[cs->id] >= w->id,
                       "%s: '%s' buffers must live to their readers (result to #%d, send to #%d)", mesh,
                       x->name, acc->id, w->id);
            /* HSDP: the shard's all-reduce cast comes after the accumulate */
            for (int j = 0; acc && j < g->n; j++)
                if (g->nodes[j]->op == DG_OP_CAST && g->nodes[j]->src[0] == acc->upd[0])
                    EXPECT(g->nodes[j]->id > acc->id, "%s: '%s' cast before the shard is complete", mesh,
                           g->nodes[j]->name);
        }
    }
    EXPECT(casts == 2 * (ars + rss), "%s: %d casts for %d all-reduces and %d reduce-scatters", mesh, casts,
           ars, rss);
    printf("%-28s reduce bf16: %d casts around %d all-reduces and %d reduce-scatters (overlap %d)\n", mesh,
           casts, ars, rss, overlap);
    dg_model_free(m32);
    dg_model_free(m16);
    return casts;
}

static void test_reduce_dtype(void) {
    dg_model_desc_t d = {3, 4, 64, 32, 128, 128};
    int c0[3] = {0, 0, 0}, cr[3] = {1, 0, 0}, cs[3] = {0, 1, 0}, ch[3] = {1, 1, 0}, c3[3] = {1, 1, 1};
    EXPECT(check_bf16_plan(&d, "dp_replicate=2", cr, 1) > 0, "DDP: no casts");
    EXPECT(check_bf16_plan(&d, "dp_replicate=2", cr, 0) > 0, "DDP, overlap=0: no casts");
    EXPECT(check_bf16_plan(&d, "dp_shard=2", cs, 1) > 0, "FSDP: no casts");
    EXPECT(check_bf16_plan(&d, "dp_shard=2", cs, 0) > 0, "FSDP, overlap=0: no casts");
    EXPECT(check_bf16_plan(&d, "dp_replicate=2,dp_shard=2", ch, 1) > 0, "HSDP: no casts");
    EXPECT(check_bf16_plan(&d, "dp_replicate=2,dp_shard=2,tp=2", c3, 1) > 0, "HSDP x TP: no casts");
    /* no data-parallel reduction: nothing changes */
    EXPECT(check_bf16_plan(&d, "tp=2", c0, 1) == 0, "tp only: casts where nothing is reduced over dp");
    EXPECT(check_bf16_plan(&d, "dp_shard=1", c0, 1) == 0, "one rank: casts where nothing is reduced");
    dg_model_parallel_t p;
    dg_model_parallel_default(&p);
    p.reduce_dtype = DG_F16;
    dg_model_t *m = NULL;
    dg_status_t st = dg_model_create_parallel(&d, be, 2, 1, DG_MODEL_PLAN_ONLY, &p, &m);
    EXPECT(st == DG_ERR_USAGE && strstr(dg_last_error(), "expected f32 or bf16"),
           "reduce dtype f16: got %d '%s'", st, dg_last_error());
}

/* The OPT phase's ops between the norm accumulator's ZERO and CLIP_SCALE, as names, with the SUMSQ ops
 * (per parameter) or the SUMSQ_ALL op (fused) written "<norm>" once; and the gradients the norm sums, in
 * order (parameter indices). */
static int norm_window(const dg_graph_t *g, const char **names, int cap, int *pis, int *npi) {
    int n = 0, in = 0, norm_done = 0;
    *npi = 0;
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *x = g->nodes[i];
        if (x->op == DG_OP_LEAF || x->phase != DG_PHASE_OPT) continue;
        if (x->op == DG_OP_ZERO && (x->upd[0]->flags & DG_NF_SCALAR)) in = 1;
        if (!in) continue;
        if (x->op == DG_OP_SUMSQ) pis[(*npi)++] = x->src[0]->param_index;
        if (x->op == DG_OP_SUMSQ_ALL)
            for (int k = 0; k < g->n_norm_segs; k++)
                pis[(*npi)++] = g->norm_segs[k].param_index;
        if (x->op == DG_OP_SUMSQ || x->op == DG_OP_SUMSQ_ALL) {
            if (norm_done++) continue;
            if (n < cap) names[n++] = "<norm>";
            continue;
        }
        if (n < cap) names[n++] = x->name;
        if (x->op == DG_OP_CLIP_SCALE) break;
    }
    return n;
}

static void check_fused_norm(const dg_model_desc_t *d, const char *mesh, const int c[3]) {
    dg_model_t *m = plan(d, mesh, c, 25u << 20, 1, 1);
    setenv("DG_TEST_ADAMW_PER_PARAM", "1", 1);
    dg_model_t *mp = plan(d, mesh, c, 25u << 20, 1, 1);
    unsetenv("DG_TEST_ADAMW_PER_PARAM");
    const dg_graph_t *g = dg_model_graph(m), *gp = dg_model_graph(mp);
    char where[96];
    snprintf(where, sizeof where, "%s at (%d,%d,%d)", mesh, c[0], c[1], c[2]);
    EXPECT(count_op(g, DG_OP_SUMSQ_ALL, DG_PHASE_OPT) == 1 && count_op(g, DG_OP_SUMSQ, DG_PHASE_OPT) == 0,
           "%s: %d sumsq_all, %d sumsq", where, count_op(g, DG_OP_SUMSQ_ALL, DG_PHASE_OPT),
           count_op(g, DG_OP_SUMSQ, DG_PHASE_OPT));
    EXPECT(count_op(gp, DG_OP_SUMSQ_ALL, DG_PHASE_OPT) == 0 && count_op(gp, DG_OP_SUMSQ, DG_PHASE_OPT) > 0,
           "%s, DG_TEST_ADAMW_PER_PARAM=1: %d sumsq_all, %d sumsq", where,
           count_op(gp, DG_OP_SUMSQ_ALL, DG_PHASE_OPT), count_op(gp, DG_OP_SUMSQ, DG_PHASE_OPT));
    /* the same schedule around the norm, the same gradients in the same order */
    const char *wn[256], *wp[256];
    int pn[512], pp[512], npn = 0, npp = 0;
    int nn = norm_window(g, wn, 256, pn, &npn), np_ = norm_window(gp, wp, 256, pp, &npp);
    int same = nn == np_ && npn == npp;
    for (int i = 0; same && i < nn; i++)
        same = strcmp(wn[i], wp[i]) == 0;
    for (int i = 0; same && i < npn; i++)
        same = pn[i] == pp[i];
    EXPECT(same,
           "%s: the fused norm's window (%d ops, %d gradients) differs from the per-parameter one (%d ops, "
           "%d gradients)",
           where, nn, npn, np_, npp);
    int skip = 0;
    for (int i = 0; i < dg_model_n_tensors(m); i++) {
        const dg_node_t *p = NULL;
        for (int j = 0; j < g->n && !p; j++)
            if ((g->nodes[j]->flags & DG_NF_PARAM) && g->nodes[j]->param_index == i) p = g->nodes[j];
        skip += p && (p->flags & DG_NF_NORM_SKIP);
    }
    EXPECT(npn == dg_model_n_tensors(m) - skip,
           "%s: the norm sums %d gradients, expected %d (%d replicas out)", where, npn,
           dg_model_n_tensors(m) - skip, skip);
    /* every gradient collective is complete before the fused op reads the flat gradient: comm-stream ops
     * waited for before it, compute-stream all-reduces of a gradient placed before it; the all-reduces of
     * the sum after it (and before CLIP_SCALE) */
    const dg_node_t *op = NULL, *clip = NULL;
    for (int i = 0; i < g->n; i++) {
        if (g->nodes[i]->op == DG_OP_SUMSQ_ALL) op = g->nodes[i];
        if (g->nodes[i]->op == DG_OP_CLIP_SCALE) clip = g->nodes[i];
    }
    if (!op || !clip) {
        dg_model_free(m);
        dg_model_free(mp);
        return;
    }
    int bad = 0, n_before = 0, n_after = 0;
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *x = g->nodes[i];
        if (x->stream == DG_STREAM_COMM && x->op != DG_OP_LEAF) {
            int waited = 0;
            for (int j = 0; j < op->id; j++)
                for (int w = 0; w < g->nodes[j]->n_wait; w++)
                    waited |= g->nodes[j]->wait[w] == x;
            if (!waited) {
                bad++;
                fprintf(stderr, "  %s: comm-stream '%s' is not waited for before the fused norm\n", where,
                        x->name);
            }
        }
        if (x->op == DG_OP_ALL_REDUCE && x->n_upd == 1 && x->phase == DG_PHASE_OPT) {
            int grad = (x->upd[0]->flags & DG_NF_GRAD) != 0, sum = x->upd[0] == op->upd[0];
            if (grad) n_before++;
            if (sum) n_after++;
            if ((grad && x->id > op->id) || (sum && (x->id < op->id || x->id > clip->id))) {
                bad++;
                fprintf(stderr, "  %s: '%s' (#%d) on the wrong side of the fused norm (#%d)\n", where,
                        x->name, x->id, op->id);
            }
        }
    }
    EXPECT(bad == 0, "%s: %d collectives not complete before the fused norm or misplaced around it", where,
           bad);
    dg_mesh_shape_t ms;
    int is_auto = 0;
    if (dg_mesh_parse(mesh, 0, &ms, &is_auto) != DG_OK) exit(1);
    int want_after =
        (ms.size[DG_MESH_DP_SHARD] > 1) + (ms.size[DG_MESH_TP] > 1); /* ar.sumsq.dp_shard / .tp */
    EXPECT(n_after == want_after,
           "%s: %d all-reduces of the sum of squares after the fused norm, expected %d", where, n_after,
           want_after);
    printf("%-32s fused norm over %d gradients; %d tp gradient all-reduces before it, %d of the sum after\n",
           where, npn, n_before, n_after);
    dg_model_free(m);
    dg_model_free(mp);
}

static void test_fused_norm(void) {
    dg_model_desc_t small = {3, 4, 64, 32, 128, 128}, uneven = {2, 2, 30, 24, 97, 128};
    check_fused_norm(&small, "dp_shard=1", (int[3]){0, 0, 0});
    check_fused_norm(&small, "dp_shard=2", (int[3]){0, 1, 0});
    check_fused_norm(&small, "dp_replicate=2", (int[3]){1, 0, 0});
    check_fused_norm(&uneven, "dp_replicate=2,dp_shard=2", (int[3]){1, 1, 0});
    check_fused_norm(&small, "tp=2", (int[3]){0, 0, 0});
    check_fused_norm(&small, "tp=2", (int[3]){0, 0, 1});
    check_fused_norm(&uneven, "dp_replicate=2,dp_shard=2,tp=2", (int[3]){1, 1, 1});
    check_fused_norm(&uneven, "dp_shard=3,tp=2", (int[3]){0, 2, 0});
}

static void test_errors(void) {
    dg_model_desc_t d = {2, 4, 64, 32, 128, 128};
    dg_model_parallel_t p;
    dg_model_parallel_default(&p);
    p.mesh.size[DG_MESH_TP] = 3;
    dg_model_t *m = NULL;
    dg_status_t st = dg_model_create_parallel(&d, be, 2, 1, DG_MODEL_PLAN_ONLY, &p, &m);
    EXPECT(st == DG_ERR_USAGE && strstr(dg_last_error(), "tp = 3 must divide model.n_head = 4"),
           "tp=3 with 4 heads: got %d '%s'", st, dg_last_error());
    dg_model_parallel_default(&p);
    p.mesh.size[DG_MESH_DP_SHARD] = 2;
    st = dg_model_create_parallel(&d, be, 2, 1, 0, &p, &m);
    EXPECT(st == DG_ERR_USAGE && strstr(dg_last_error(), "no comm was given"),
           "a sharded model without communicators: got %d '%s'", st, dg_last_error());
    p.coord[DG_MESH_DP_SHARD] = 2;
    st = dg_model_create_parallel(&d, be, 2, 1, DG_MODEL_PLAN_ONLY, &p, &m);
    EXPECT(st == DG_ERR_USAGE && strstr(dg_last_error(), "out of range"), "coordinate 2 of 2: got %d '%s'",
           st, dg_last_error());
}

int main(void) {
    dg_backend_config_t bc = {.act_dtype = DG_F32, .threads = 1};
    if (dg_backend_cpu_create(&bc, &be) != DG_OK) return 1;
    test_memory();
    dg_model_desc_t small = {2, 4, 64, 32, 128, 128}, uneven = {2, 2, 30, 24, 97, 128};
    const char *meshes[] = {"dp_shard=4", "dp_replicate=2,dp_shard=2", "tp=2", "dp_shard=2,tp=2",
                            "dp_replicate=2,dp_shard=3,tp=2"};
    for (size_t i = 0; i < sizeof meshes / sizeof meshes[0]; i++) {
        test_cover(&small, meshes[i]);
        test_cover(&uneven, meshes[i]);
    }
    test_schedule();
    test_fused_norm();
    test_reduce_dtype();
    test_errors();
    dg_backend_free(be);
    return dg_check_done("fsdp plan");
}
