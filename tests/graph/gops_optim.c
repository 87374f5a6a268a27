/* gops_optim.c — test_graph_ops cases of collectives, shard ops, casts, the optimizer (plain and fused)
 * and the fused gradient norm. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dg_bits.h"
#include "gops.h"

/* Collectives over mesh dimensions of size 1 (identity), their adjoints in the backward, and their
 * shape rules and refusal to run without a comm backend at size 4. */
void case_collectives(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 21);
    int64_t sx[2] = {3, 5};
    dg_node_t *x = tg_f(&t, "x", 2, sx, DG_NF_INPUT | DG_NF_WANT_GRAD, -2, 2);
    dg_node_t *ag = dg_op_all_gather(t.g, "ag", x, DG_MESH_DP_SHARD);
    dg_node_t *rs = dg_op_reduce_scatter(t.g, "rs", ag, DG_MESH_DP_SHARD);
    dg_node_t *ar = dg_op_all_reduce(t.g, "ar", rs, DG_MESH_TP);
    dg_node_t *y = dg_op_gelu(t.g, "y", ar);
    dg_node_t *dout = tg_f(&t, "dout", 2, sx, DG_NF_INPUT, -1, 1);
    tg_finish(&t, 1, &y, &dout);
    EXPECT(tg_count(&t, DG_OP_ALL_GATHER, -1) == 2 && tg_count(&t, DG_OP_REDUCE_SCATTER, -1) == 2 &&
               tg_count(&t, DG_OP_ALL_REDUCE, -1) == 2,
           "collectives: each collective's adjoint should appear once in the backward");
    EXPECT(ar->view_src == rs, "collectives: all_reduce should run in place over its dying input");
    tg_run(&t, DG_PHASE_FWD);
    tg_run(&t, DG_PHASE_BWD);
    ctx_t c = {.in = {tg_d(&t, x)}, .dout = tg_d(&t, dout), .d = {15}};
    double yr[15];
    ref_gelu(yr, c.in[0], 15);
    float *yg = tg_get(&t, y), *gx = tg_get(&t, dg_node_grad_of(x));
    check_close("collectives (size 1) forward", yg, yr, 15, 1e-5);
    check_fd("collectives (size 1) d/dx", c.in[0], 15, gx, obj_gelu, &c);
    tg_cover(&t, f0);
    free(yg), free(gx), free(c.in[0]), free(c.dout);
    tg_free(&t);

    /* size 4 along dp_shard: shapes scale, uneven scatter is refused, running needs a comm backend */
    tg_init(&t, be, 22);
    t.g->mesh.size[DG_MESH_DP_SHARD] = 4;
    int64_t s1[2] = {3, 5}, s2[2] = {10, 5};
    dg_node_t *a = tg_f(&t, "a", 2, s1, DG_NF_INPUT, -1, 1);
    dg_node_t *g4 = dg_op_all_gather(t.g, "ag4", a, DG_MESH_DP_SHARD);
    dg_node_t *r4 = dg_op_reduce_scatter(t.g, "rs4", g4, DG_MESH_DP_SHARD);
    EXPECT(g4 && g4->shape[0] == 12 && g4->shape[1] == 5, "all_gather over 4 ranks: [3,5] -> [12,5]");
    EXPECT(r4 && r4->shape[0] == 3 && r4->shape[1] == 5, "reduce_scatter over 4 ranks: [12,5] -> [3,5]");
    dg_node_t *b = tg_f(&t, "b", 2, s2, DG_NF_INPUT, -1, 1);
    dg_node_t *bad = dg_op_reduce_scatter(t.g, "rs_bad", b, DG_MESH_DP_SHARD);
    EXPECT(bad == NULL && dg_graph_error(t.g) == DG_ERR_USAGE && strstr(dg_last_error(), "not divisible"),
           "reduce_scatter of 10 rows over 4 ranks must fail with a clear message, got: %s", dg_last_error());
    tg_free(&t);

    tg_init(&t, be, 23);
    t.g->mesh.size[DG_MESH_TP] = 2;
    dg_node_t *u = tg_f(&t, "u", 2, s1, DG_NF_INPUT, -1, 1);
    dg_node_t *ur = dg_op_all_reduce(t.g, "ar2", u, DG_MESH_TP);
    dg_node_t *ug = dg_op_gelu(t.g, "g", ur);
    ug->flags |= DG_NF_OUTPUT;
    tg_finish(&t, 0, NULL, NULL);
    dg_status_t st = dg_exec_run_phase(t.ex, DG_PHASE_FWD);
    EXPECT(st == DG_ERR_RUNTIME && strstr(dg_last_error(), "comm backend"),
           "all_reduce over tp=2 without a comm backend must fail clearly, got %d: %s", st, dg_last_error());
    tg_free(&t);
}

/* Sharding support ops on one rank: shard_pack lays a tensor's rows out rank-major (k blocks of S
 * elements, the piece at OFF; rows past the tensor and the gaps zero) and a second pack adds into the
 * same buffer; shard_unpack inverts both; fill0 zeroes (through a poisoned arena); a comm-stream
 * reduce_scatter that accumulates into a persistent tensor completes at its wait (k = 1: q += packed). */
void case_shard_ops(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 31);
    int64_t sx[2] = {5, 4}, sy[1] = {3}, sq[1] = {33};
    dg_node_t *x = tg_f(&t, "x", 2, sx, DG_NF_INPUT, -1, 1);
    dg_node_t *y = tg_f(&t, "y", 1, sy, DG_NF_INPUT, -1, 1);
    dg_node_t *q = tg_f(&t, "q", 1, sq, DG_NF_INPUT, -1, 1);
    enum { K = 3, S = 11 };
    int64_t ax[5] = {0, K, S, 1, 2}; /* x: 2 rows x 4 per rank at offset 1 (rank 2 gets row 4 + padding) */
    int64_t ay[5] = {1, K, S, 9, 1}; /* y: 1 element per rank at offset 9; offset 10 is a gap */
    dg_node_t *p1 = dg_graph_add_op(t.g, DG_OP_SHARD_PACK, "pack.x", 1, &x, 0, NULL, ax, 5);
    dg_node_t *src2[2] = {y, p1};
    dg_node_t *p2 = dg_graph_add_op(t.g, DG_OP_SHARD_PACK, "pack.y", 2, src2, 0, NULL, ay, 5);
    int64_t aux[7] = {0, K, S, 1, 2, 5, 4}, auy[7] = {0, K, S, 9, 1, 3, 0};
    dg_node_t *ux = dg_graph_add_op(t.g, DG_OP_SHARD_UNPACK, "unpack.x", 1, &p2, 0, NULL, aux, 7);
    dg_node_t *uy = dg_graph_add_op(t.g, DG_OP_SHARD_UNPACK, "unpack.y", 1, &p2, 0, NULL, auy, 7);
    int64_t az[4] = {0, 2, 5, 4};
    dg_node_t *z = dg_graph_add_op(t.g, DG_OP_FILL0, "z", 0, NULL, 0, NULL, az, 4);
    dg_node_t *zx = dg_op_add(t.g, "zx", z, x);
    int64_t ar[2] = {1, DG_MESH_DP_SHARD};
    dg_node_t *rs = dg_graph_add_op(t.g, DG_OP_REDUCE_SCATTER, "rs", 1, &p2, 1, &q, ar, 2);
    EXPECT(p1 && p2 && ux && uy && z && zx && rs, "shard ops: construction failed: %s", dg_last_error());
    if (!rs) {
        tg_free(&t);
        return;
    }
    rs->stream = DG_STREAM_COMM;
    rs->wait[rs->n_wait++] = p2;
    dg_node_t *w = dg_graph_add_op(t.g, DG_OP_WAIT, "wait.rs", 0, NULL, 0, NULL, NULL, 0);
    w->wait[w->n_wait++] = rs;
    p2->flags |= DG_NF_OUTPUT;
    ux->flags |= DG_NF_OUTPUT;
    uy->flags |= DG_NF_OUTPUT;
    zx->flags |= DG_NF_OUTPUT;
    dg_graph_touch(t.g);
    tg_finish(&t, 0, NULL, NULL);
    unsigned char *poison = malloc(t.plan->arena_bytes);
    memset(poison, 0xff, t.plan->arena_bytes); /* NaN everywhere: unwritten elements show */
    OK(be->ops->to_device(be, t.ex->arena, poison, t.plan->arena_bytes));
    free(poison);
    tg_run(&t, DG_PHASE_FWD);
    const float *hx = tg_leaf(&t, x)->f, *hy = tg_leaf(&t, y)->f, *hq = tg_leaf(&t, q)->f;
    double pk[K * S], xr[20], yr[3], qr[K * S];
    memset(pk, 0, sizeof pk);
    for (int r = 0; r < K; r++) {
        for (int row = 2 * r; row < 2 * r + 2 && row < 5; row++)
            for (int c = 0; c < 4; c++)
                pk[r * S + 1 + (row - 2 * r) * 4 + c] = hx[row * 4 + c];
        pk[r * S + 9] = hy[r];
    }
    for (int i = 0; i < 20; i++)
        xr[i] = hx[i];
    for (int i = 0; i < 3; i++)
        yr[i] = hy[i];
    for (int i = 0; i < K * S; i++)
        qr[i] = (double)hq[i] + pk[i];
    float *gp = tg_get(&t, p2), *gx = tg_get(&t, ux), *gy = tg_get(&t, uy), *gz = tg_get(&t, zx),
          *gq = tg_get(&t, q);
    check_close("shard_pack (rank-major, zero padding and gaps)", gp, pk, K * S, 0);
    check_close("shard_unpack of a matrix", gx, xr, 20, 0);
    check_close("shard_unpack of a vector", gy, yr, 3, 0);
    check_close("fill0 + x", gz, xr, 20, 0);
    check_close("reduce_scatter (acc, one rank) at its wait", gq, qr, K * S, 1e-6);
    tg_cover(&t, f0);
    free(gp), free(gx), free(gy), free(gz), free(gq);
    tg_free(&t);
}

/* bf16 of an f32 (round to nearest even; no NaN in the test data), as a float */
static float bf16_round(float f) {
    return dg_bits_bf16_to_f32(dg_bits_f32_to_bf16(f));
}

/* CAST (train.reduce_dtype = bf16): f32 -> bf16 into an arena tensor (round to nearest even), that
 * bf16 -> f32 over a persistent tensor, and bf16 -> f32 added into one (acc: the op's own output holds the
 * converted values, then add_f32); all exact. Then the shape rule's refusals. */
void case_cast(dg_backend_t *be) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 41);
    int64_t sx[2] = {7, 9};
    dg_node_t *x = tg_f(&t, "x", 2, sx, DG_NF_INPUT, -3, 3);
    dg_node_t *y = tg_f(&t, "y", 2, sx, DG_NF_INPUT, -1, 1);
    dg_node_t *q = tg_f(&t, "q", 2, sx, DG_NF_INPUT, -1, 1);
    int64_t a16[2] = {0, DG_BF16}, a32[2] = {0, DG_F32}, aacc[2] = {1, DG_F32};
    dg_node_t *h = dg_graph_add_op(t.g, DG_OP_CAST, "x.bf16", 1, &x, 0, NULL, a16, 2);
    dg_node_t *b = h ? dg_graph_add_op(t.g, DG_OP_CAST, "y=x.bf16", 1, &h, 1, &y, a32, 2) : NULL;
    dg_node_t *c = b ? dg_graph_add_op(t.g, DG_OP_CAST, "q+=x.bf16", 1, &h, 1, &q, aacc, 2) : NULL;
    EXPECT(c && h->dtype == DG_BF16 && h->storage == DG_STORE_ARENA && b->storage == DG_STORE_NONE &&
               c->dtype == DG_F32 && c->storage == DG_STORE_ARENA,
           "cast: construction failed or wrong storage: %s", dg_last_error());
    if (!c) {
        tg_free(&t);
        return;
    }
    h->flags |= DG_NF_OUTPUT;
    dg_graph_touch(t.g);
    tg_finish(&t, 0, NULL, NULL);
    unsigned char *poison = malloc(t.plan->arena_bytes);
    memset(poison, 0xff, t.plan->arena_bytes);
    OK(be->ops->to_device(be, t.ex->arena, poison, t.plan->arena_bytes));
    free(poison);
    tg_run(&t, DG_PHASE_FWD);
    size_t n = dg_node_numel(x);
    const float *hx = tg_leaf(&t, x)->f, *hq = tg_leaf(&t, q)->f;
    uint16_t *gh = (uint16_t *)tg_get(&t, h);
    float *gy = tg_get(&t, y), *gq = tg_get(&t, q);
    size_t bad_h = n, bad_y = n, bad_q = n;
    int inexact = 0;
    for (size_t i = n; i-- > 0;) {
        float r = bf16_round(hx[i]);
        uint32_t u;
        memcpy(&u, &r, 4);
        inexact += r != hx[i];
        if (gh[i] != (uint16_t)(u >> 16)) bad_h = i;
        if (gy[i] != r) bad_y = i;
        if (gq[i] != hq[i] + r) bad_q = i;
    }
    EXPECT(bad_h == n, "cast f32 -> bf16: element %zu is 0x%04x, expected bf16(%.9g)", bad_h,
           bad_h < n ? gh[bad_h] : 0, bad_h < n ? (double)hx[bad_h] : 0.0);
    EXPECT(bad_y == n, "cast bf16 -> f32 over a tensor: element %zu is %.9g", bad_y,
           bad_y < n ? (double)gy[bad_y] : 0.0);
    EXPECT(bad_q == n, "cast bf16 -> f32 added into a tensor: element %zu is %.9g", bad_q,
           bad_q < n ? (double)gq[bad_q] : 0.0);
    EXPECT(inexact > (int)n / 2, "cast: only %d of %zu inputs needed rounding (vacuous test)", inexact, n);
    tg_cover(&t, f0);
    free(gh), free(gy), free(gq);
    tg_free(&t);

    /* refusals, each on a fresh graph (builder errors are sticky) */
    for (int k = 0; k < 3; k++) {
        tg_init(&t, be, 42);
        dg_node_t *u = tg_f(&t, "u", 2, sx, DG_NF_INPUT, -1, 1);
        int64_t s1[1] = {5};
        dg_node_t *v = tg_f(&t, "v", 1, s1, DG_NF_INPUT, -1, 1);
        dg_node_t *r = NULL;
        const char *want = "";
        if (k == 0) { /* acc without a target */
            r = dg_graph_add_op(t.g, DG_OP_CAST, "bad", 1, &u, 0, NULL, aacc, 2);
            want = "acc=1 adds into a tensor given in upd";
        } else if (k == 1) { /* a target of another size */
            r = dg_graph_add_op(t.g, DG_OP_CAST, "bad", 1, &u, 1, &v, a32, 2);
            want = "writes exactly one f32 tensor of 63 elements";
        } else { /* to an integer dtype */
            int64_t ai[2] = {0, DG_I32};
            r = dg_graph_add_op(t.g, DG_OP_CAST, "bad", 1, &u, 0, NULL, ai, 2);
            want = "is not f32, bf16 or f16";
        }
        EXPECT(r == NULL && dg_graph_error(t.g) == DG_ERR_USAGE && strstr(dg_last_error(), want),
               "cast refusal %d: expected '%s', got '%s'", k, want, dg_last_error());
        tg_free(&t);
    }
}

/* Optimizer ops: ZERO (grads), ZERO + SUMSQ + CLIP_SCALE + ADAMW (opt phase) against float64 AdamW with
 * global-norm clipping and per-tensor weight decay, over two steps. fused = 1: the ADAMW ops fused into one
 * ADAMW_ALL (pass fuse_adamw) over flat buffers with gaps between the tensors, which must stay as they
 * are, and the SUMSQ ops into one SUMSQ_ALL (pass fuse_sumsq). Either way the norm accumulator must hold
 * bitwise what one sumsq_f32 per gradient gives. */
static int decay_by_name(const dg_node_t *p, void *ctx) {
    (void)ctx;
    return strcmp(p->name, "p1") == 0;
}

static void optimizer_run(dg_backend_t *be, int fused) {
    int f0 = dg_fails;
    tg_t t;
    tg_init(&t, be, 24);
    int64_t s1[2] = {6, 5}, s2[1] = {7};
    dg_node_t *p[2];
    p[0] = tg_f(&t, "p1", 2, s1, DG_NF_PARAM, -1, 1);
    p[1] = tg_f(&t, "p2", 1, s2, DG_NF_PARAM, -1, 1);
    dg_node_t *sc = NULL;
    OK(dg_graph_add_optimizer(t.g, decay_by_name, NULL, &sc));
    dg_node_t *mn[2] = {0}, *vn[2] = {0};
    for (int i = 0; i < t.g->n; i++) {
        dg_node_t *n = t.g->nodes[i];
        if (!(n->flags & DG_NF_OPTSTATE)) continue;
        (strncmp(n->name, "adam_m.", 7) == 0 ? mn : vn)[n->param_index] = n;
    }
    /* fused: p1 at 0 (30 elements, gap 30..31), p2 at 32 (7 elements, gap 39), flat buffers of 40 */
    enum { SPAN = 40 };
    const size_t offs[2] = {0, 32};
    dg_fuse_adamw_t fz = {.off = offs, .n = 2, .span = SPAN};
    float *flat[4] = {0}; /* master (= param: f32), grad, m, v */
    void *tab = NULL;
    if (fused) {
        dg_pass_t fp[] = {{"fuse_adamw", dg_pass_fuse_adamw, &fz}, {"fuse_sumsq", dg_pass_fuse_sumsq, &fz}};
        OK(dg_graph_run_passes(t.g, fp, 2));
        EXPECT(tg_count(&t, DG_OP_ADAMW, -1) == 0 && tg_count(&t, DG_OP_ADAMW_ALL, -1) == 1 &&
                   t.g->n_opt_segs == 2 && fz.param == fz.master,
               "fuse_adamw: %d adamw, %d adamw_all, %d segments", tg_count(&t, DG_OP_ADAMW, -1),
               tg_count(&t, DG_OP_ADAMW_ALL, -1), t.g->n_opt_segs);
        EXPECT(tg_count(&t, DG_OP_SUMSQ, -1) == 0 && tg_count(&t, DG_OP_SUMSQ_ALL, -1) == 1 &&
                   t.g->n_norm_segs == 2 && fz.norm_segs,
               "fuse_sumsq: %d sumsq, %d sumsq_all, %d segments", tg_count(&t, DG_OP_SUMSQ, -1),
               tg_count(&t, DG_OP_SUMSQ_ALL, -1), t.g->n_norm_segs);
    } else {
        EXPECT(tg_count(&t, DG_OP_SUMSQ, -1) == 2 && tg_count(&t, DG_OP_SUMSQ_ALL, -1) == 0,
               "per parameter: %d sumsq, %d sumsq_all", tg_count(&t, DG_OP_SUMSQ, -1),
               tg_count(&t, DG_OP_SUMSQ_ALL, -1));
    }
    if (fused) {
        float poison[SPAN];
        for (int i = 0; i < SPAN; i++)
            poison[i] = -777.0f;
        for (int b = 0; b < 4; b++) {
            OK(be->ops->alloc(be, SPAN * sizeof(float), (void **)&flat[b]));
            OK(be->ops->to_device(be, flat[b], poison, sizeof poison)); /* the gaps keep -777 */
        }
        OK(be->ops->alloc(be, fz.segs->nbytes, &tab));
        fz.master->data = flat[0], fz.grad->data = flat[1], fz.m->data = flat[2], fz.v->data = flat[3];
        fz.segs->data = tab;
        for (int k = 0; k < 2; k++) {
            p[k]->data = flat[0] + offs[k], p[k]->grad->data = flat[1] + offs[k];
            mn[k]->data = flat[2] + offs[k], vn[k]->data = flat[3] + offs[k];
            OK(be->ops->memset0(be, p[k]->grad->data, dg_node_numel(p[k]) * sizeof(float)));
            OK(be->ops->memset0(be, mn[k]->data, dg_node_numel(p[k]) * sizeof(float)));
            OK(be->ops->memset0(be, vn[k]->data, dg_node_numel(p[k]) * sizeof(float)));
        }
    }
    tg_finish(&t, 0, NULL, NULL);
    size_t nel[2] = {30, 7};
    double *P[2], *M[2], *V[2];
    float *G[2];
    for (int k = 0; k < 2; k++) {
        P[k] = tg_d(&t, p[k]);
        M[k] = calloc(nel[k], sizeof(double));
        V[k] = calloc(nel[k], sizeof(double));
        G[k] = malloc(nel[k] * sizeof(float));
        ref_fill(G[k], nel[k], -2, 2, &t.rng);
        OK(be->ops->to_device(be, p[k]->grad->data, G[k], nel[k] * sizeof(float)));
    }
    const double lr = 0.01, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    double clips[2] = {0.5, 0.0}; /* step 1 clips (the norm is ~5), step 2 does not */
    for (int step = 1; step <= 2; step++) {
        dg_runtime_t *rt = &t.ex->rt;
        rt->lr = (float)lr, rt->beta1 = (float)b1, rt->beta2 = (float)b2, rt->eps = (float)eps;
        rt->weight_decay = (float)wd, rt->grad_clip = (float)clips[step - 1], rt->grad_extra = 1.0f,
        rt->t = step;
        tg_run(&t, DG_PHASE_OPT);
        double ss = 0;
        for (int k = 0; k < 2; k++)
            for (size_t i = 0; i < nel[k]; i++)
                ss += (double)G[k][i] * G[k][i];
        double norm = sqrt(ss),
               scale = clips[step - 1] > 0 ? fmin(1.0, clips[step - 1] / (norm + 1e-6)) : 1.0;
        float *scal = tg_get(&t, sc);
        EXPECT(fabs(scal[DG_SCALAR_NORM] - norm) <= 1e-5 * norm, "optimizer: grad norm %.8g, reference %.8g",
               (double)scal[DG_SCALAR_NORM], norm);
        float seq = 0.0f; /* one sumsq_f32 per gradient, in parameter order, from 0 */
        for (int k = 0; k < 2; k++)
            OK(be->ops->sumsq_f32(be, &seq, p[k]->grad->data, nel[k]));
        EXPECT(memcmp(&scal[DG_SCALAR_SUMSQ], &seq, sizeof seq) == 0,
               "optimizer%s: sum of squares %.9g, not bitwise the %.9g of one sumsq_f32 per gradient",
               fused ? " (fused)" : "", (double)scal[DG_SCALAR_SUMSQ], (double)seq);
        free(scal);
        for (int k = 0; k < 2; k++) {
            double decay = k == 0 ? wd : 0.0;
            for (size_t i = 0; i < nel[k]; i++) {
                double g = G[k][i] * scale;
                M[k][i] = b1 * M[k][i] + (1 - b1) * g;
                V[k][i] = b2 * V[k][i] + (1 - b2) * g * g;
                double mh = M[k][i] / (1 - pow(b1, step)), vh = V[k][i] / (1 - pow(b2, step));
                P[k][i] -= lr * (mh / (sqrt(vh) + eps) + decay * P[k][i]);
            }
            float *pg = tg_get(&t, p[k]), *mg = tg_get(&t, mn[k]), *vg = tg_get(&t, vn[k]);
            char what[160];
            snprintf(what, sizeof what, "adamw step %d %s param", step, p[k]->name);
            check_close(what, pg, P[k], nel[k], 1e-5);
            snprintf(what, sizeof what, "adamw step %d %s m", step, p[k]->name);
            check_close(what, mg, M[k], nel[k], 1e-5);
            snprintf(what, sizeof what, "adamw step %d %s v", step, p[k]->name);
            check_close(what, vg, V[k], nel[k], 1e-5);
            free(pg), free(mg), free(vg);
        }
    }
    const int gaps[3] = {30, 31, 39};
    if (fused)
        for (int b = 0; b < 4; b++) {
            float h[SPAN];
            OK(be->ops->to_host(be, h, flat[b], sizeof h));
            for (int j = 0; j < 3; j++)
                EXPECT(h[gaps[j]] == -777.0f, "adamw_all wrote into the gap at %d of flat buffer %d: %g",
                       gaps[j], b, (double)h[gaps[j]]);
        }
    tg_run(&t, DG_PHASE_ZERO);
    for (int k = 0; k < 2; k++) {
        float *gg = tg_get(&t, p[k]->grad);
        size_t nz = 0;
        for (size_t i = 0; i < nel[k]; i++)
            nz += gg[i] != 0.0f;
        EXPECT(nz == 0, "zero phase left %zu non-zero gradient elements in %s", nz, p[k]->name);
        free(gg);
    }
    if (fused) {
        /* fused, the zero phase is one ZERO of the whole flat gradient buffer (buffer 1): its gaps are
         * cleared with it; the other flat buffers' gaps stay untouched */
        int nzero = 0;
        for (int i = 0; i < t.g->n; i++)
            nzero += t.g->nodes[i]->op == DG_OP_ZERO && t.g->nodes[i]->phase == DG_PHASE_ZERO;
        EXPECT(nzero == 1, "fused: %d ZERO ops in the zero phase, expected one over the flat gradient buffer",
               nzero);
        for (int b = 0; b < 4; b++) {
            float h[SPAN];
            OK(be->ops->to_host(be, h, flat[b], sizeof h));
            for (int j = 0; j < 3; j++)
                EXPECT(h[gaps[j]] == (b == 1 ? 0.0f : -777.0f), "zero phase: gap at %d of flat buffer %d: %g",
                       gaps[j], b, (double)h[gaps[j]]);
        }
    }
    tg_cover(&t, f0);
    for (int k = 0; k < 2; k++)
        free(P[k]), free(M[k]), free(V[k]), free(G[k]);
    tg_free(&t);
    for (int b = 0; b < 4; b++)
        if (flat[b]) be->ops->free(be, flat[b]);
    if (tab) be->ops->free(be, tab);
}

void case_optimizer(dg_backend_t *be) {
    optimizer_run(be, 0);
}

void case_optimizer_fused(dg_backend_t *be) {
    optimizer_run(be, 1);
}

/* The fused gradient norm (pass fuse_sumsq after fuse_adamw): four parameters whose flat offsets are not
 * in parameter order, one of them a NORM_SKIP replica. Checked: one SUMSQ_ALL where the SUMSQ ops were
 * (after the accumulator's ZERO, right before CLIP_SCALE) over the flat gradient leaf; its segments are
 * the former SUMSQ ops' gradients in their order (the replica left out); the sum is bitwise the sequence of
 * sumsq_f32 calls over those gradients (the gaps of the flat buffer, filled with large values, never
 * count; the gradients chosen so that another order gives other bits), with a frozen parameter left out at
 * run time; and the pass's refusals. */
static void norm_params(tg_t *t, dg_node_t **p, dg_node_t **sc) {
    int64_t sa[2] = {5, 3}, sb[1] = {7}, sc9[1] = {9}, sd[2] = {2, 2};
    p[0] = tg_f(t, "a", 2, sa, DG_NF_PARAM, -1, 1);
    p[1] = tg_f(t, "b", 1, sb, DG_NF_PARAM, -1, 1);
    p[2] = tg_f(t, "c", 1, sc9, DG_NF_PARAM, -1, 1);
    p[3] = tg_f(t, "d", 2, sd, DG_NF_PARAM, -1, 1);
    p[1]->flags |= DG_NF_NORM_SKIP; /* a replica another rank counts: no SUMSQ */
    OK(dg_graph_add_optimizer(t->g, NULL, NULL, sc));
}

void case_norm_fused(dg_backend_t *be) {
    int f0 = dg_fails;
    enum { NP = 4, SPAN = 40 };
    /* b [0, 7), c [8, 17), a [20, 35), d [36, 40): parameter order is not offset order */
    const size_t offs[NP] = {20, 0, 8, 36}, nel[NP] = {15, 7, 9, 4};
    tg_t t;
    tg_init(&t, be, 77);
    dg_node_t *p[NP], *sc = NULL;
    norm_params(&t, p, &sc);
    dg_fuse_adamw_t fz = {.off = offs, .n = NP, .span = SPAN};
    dg_pass_t fp[] = {{"fuse_adamw", dg_pass_fuse_adamw, &fz}, {"fuse_sumsq", dg_pass_fuse_sumsq, &fz}};
    OK(dg_graph_run_passes(t.g, fp, 2));
    EXPECT(tg_count(&t, DG_OP_SUMSQ, -1) == 0 && tg_count(&t, DG_OP_SUMSQ_ALL, -1) == 1,
           "fuse_sumsq: %d sumsq, %d sumsq_all", tg_count(&t, DG_OP_SUMSQ, -1),
           tg_count(&t, DG_OP_SUMSQ_ALL, -1));
    /* the table: a, c, d (the SUMSQ order), b left out */
    const int want_pi[3] = {0, 2, 3};
    EXPECT(t.g->n_norm_segs == 3, "fuse_sumsq: %d segments, expected 3 (the replica b left out)",
           t.g->n_norm_segs);
    for (int i = 0; i < 3 && i < t.g->n_norm_segs; i++) {
        const dg_opt_seg_t *s = &t.g->norm_segs[i];
        int k = want_pi[i];
        EXPECT(s->param_index == p[k]->param_index && s->off == offs[k] && s->count == nel[k],
               "norm segment %d: parameter %d, %zu elements at %zu; expected %s: %zu at %zu", i,
               s->param_index, s->count, s->off, p[k]->name, nel[k], offs[k]);
    }
    const dg_node_t *op = NULL, *zs = NULL, *clip = NULL;
    for (int i = 0; i < t.g->n; i++) {
        const dg_node_t *x = t.g->nodes[i];
        if (x->op == DG_OP_SUMSQ_ALL) op = x;
        if (x->op == DG_OP_ZERO && x->upd[0] == sc) zs = x;
        if (x->op == DG_OP_CLIP_SCALE) clip = x;
    }
    EXPECT(op && zs && clip && op->src[0] == fz.grad && op->src[1] == fz.norm_segs && op->upd[0] == sc &&
               op->phase == DG_PHASE_OPT && op->attr[DG_A_NSEG] == 3,
           "sumsq_all: wrong sources, target, phase or segment count");
    EXPECT(op && zs && clip && zs->id < fz.norm_segs->id && fz.norm_segs->id + 1 == op->id &&
               op->id + 1 == clip->id,
           "sumsq_all at #%d: expected after the accumulator's ZERO (#%d) and its table (#%d), right before "
           "clip_scale (#%d)",
           op ? op->id : -1, zs ? zs->id : -1, fz.norm_segs ? fz.norm_segs->id : -1, clip ? clip->id : -1);

    /* flat buffers (every flat leaf bound, the parameters' tensors at their offsets); gaps hold 1000 */
    float *flat[4] = {0};
    dg_node_t *mn[NP] = {0}, *vn[NP] = {0};
    for (int i = 0; i < t.g->n; i++) {
        dg_node_t *n = t.g->nodes[i];
        if (n->flags & DG_NF_OPTSTATE) (strncmp(n->name, "adam_m.", 7) == 0 ? mn : vn)[n->param_index] = n;
    }
    float fill[SPAN];
    for (int i = 0; i < SPAN; i++)
        fill[i] = 1000.0f;
    for (int b = 0; b < 4; b++) {
        OK(be->ops->alloc(be, SPAN * sizeof(float), (void **)&flat[b]));
        OK(be->ops->to_device(be, flat[b], fill, sizeof fill));
    }
    fz.master->data = flat[0], fz.grad->data = flat[1], fz.m->data = flat[2], fz.v->data = flat[3];
    for (int k = 0; k < NP; k++) {
        p[k]->data = flat[0] + offs[k], p[k]->grad->data = flat[1] + offs[k];
        mn[k]->data = flat[2] + offs[k], vn[k]->data = flat[3] + offs[k];
        OK(be->ops->memset0(be, mn[k]->data, nel[k] * sizeof(float)));
        OK(be->ops->memset0(be, vn[k]->data, nel[k] * sizeof(float)));
    }
    tg_finish(&t, 0, NULL, NULL);
    /* gradients whose sums of squares add to other bits in another order: a's is 15 x 1100^2 = 18150000
     * (above 2^24 floats are 2 apart), c's ~0.7 and d's 0.49 vanish into it one by one, not together */
    const float mag[NP] = {1100.0f, 1.0f, 0.27f, 0.35f};
    for (int k = 0; k < NP; k++) {
        float g[16];
        for (size_t e = 0; e < nel[k]; e++)
            g[e] = (e % 2 ? -mag[k] : mag[k]) * (k == 0 ? 1.0f : 1.0f + 0.01f * (float)e);
        OK(be->ops->to_device(be, p[k]->grad->data, g, nel[k] * sizeof(float)));
    }
    {
        float fwd = 0.0f, bwd = 0.0f;
        for (int i = 0; i < 3; i++) {
            int kf = (int[3]){0, 2, 3}[i], kb = (int[3]){3, 2, 0}[i];
            OK(be->ops->sumsq_f32(be, &fwd, p[kf]->grad->data, nel[kf]));
            OK(be->ops->sumsq_f32(be, &bwd, p[kb]->grad->data, nel[kb]));
        }
        EXPECT(
            memcmp(&fwd, &bwd, sizeof fwd) != 0,
            "norm_fused: the gradients' sums add to the same bits in reverse (%.9g): the case cannot see the "
            "order",
            (double)fwd);
    }
    unsigned char frozen[NP] = {0};
    dg_runtime_t *rt = &t.ex->rt;
    rt->lr = 0.01f, rt->beta1 = 0.9f, rt->beta2 = 0.95f, rt->eps = 1e-8f, rt->grad_clip = 0.0f;
    rt->grad_extra = 1.0f, rt->t = 1, rt->frozen = frozen, rt->n_frozen_slots = NP;
    for (int run = 0; run < 2; run++) {
        frozen[0] = run == 1; /* a frozen: left out of the norm at run time (the big total: it shows) */
        tg_run(&t, DG_PHASE_OPT);
        float seq = 0.0f;
        double ref = 0;
        for (int i = 0; i < 3; i++) {
            int k = want_pi[i];
            if (frozen[k]) continue;
            OK(be->ops->sumsq_f32(be, &seq, p[k]->grad->data, nel[k]));
            const float *g = p[k]->grad->data;
            for (size_t e = 0; e < nel[k]; e++)
                ref += (double)g[e] * g[e];
        }
        float *scal = tg_get(&t, sc);
        EXPECT(memcmp(&scal[DG_SCALAR_SUMSQ], &seq, sizeof seq) == 0,
               "sumsq_all%s: %.9g, not bitwise the %.9g of sumsq_f32 over a, c, d in order",
               run ? " (a frozen)" : "", (double)scal[DG_SCALAR_SUMSQ], (double)seq);
        EXPECT(fabs(scal[DG_SCALAR_SUMSQ] - ref) <= 1e-6 * ref, "sumsq_all%s: %.9g, float64 reference %.9g",
               run ? " (a frozen)" : "", (double)scal[DG_SCALAR_SUMSQ], ref);
        free(scal);
    }
    rt->frozen = NULL;
    tg_cover(&t, f0);
    tg_free(&t);
    for (int b = 0; b < 4; b++)
        be->ops->free(be, flat[b]);

    /* without a fused AdamW (no flat gradient leaf) the pass leaves the SUMSQ ops alone */
    tg_init(&t, be, 78);
    norm_params(&t, p, &sc);
    dg_fuse_adamw_t none = {.off = offs, .n = NP, .span = SPAN};
    dg_pass_t only[] = {{"fuse_sumsq", dg_pass_fuse_sumsq, &none}};
    OK(dg_graph_run_passes(t.g, only, 1));
    EXPECT(tg_count(&t, DG_OP_SUMSQ, -1) == 3 && tg_count(&t, DG_OP_SUMSQ_ALL, -1) == 0 && !none.norm_segs,
           "fuse_sumsq without fuse_adamw: %d sumsq, %d sumsq_all", tg_count(&t, DG_OP_SUMSQ, -1),
           tg_count(&t, DG_OP_SUMSQ_ALL, -1));
    tg_free(&t);

    /* refusals: an op between two SUMSQ ops; a SUMSQ over a tensor outside the flat gradient buffer */
    for (int bad = 0; bad < 2; bad++) {
        tg_init(&t, be, 79);
        norm_params(&t, p, &sc);
        dg_fuse_adamw_t fb = {.off = offs, .n = NP, .span = SPAN};
        dg_pass_t a1[] = {{"fuse_adamw", dg_pass_fuse_adamw, &fb}};
        OK(dg_graph_run_passes(t.g, a1, 1));
        int first = -1, last = -1;
        for (int i = 0; i < t.g->n; i++)
            if (t.g->nodes[i]->op == DG_OP_SUMSQ) {
                if (first < 0) first = i;
                last = i;
            }
        const char *want = NULL;
        if (bad == 0) {
            dg_graph_move(t.g, t.g->nodes[last + 1], first + 1); /* clip_scale between the first two */
            want = "runs between two SUMSQ ops";
        } else {
            int64_t s3[1] = {3};
            dg_node_t *stray = tg_f(&t, "stray", 1, s3, DG_NF_GRAD, -1, 1);
            dg_node_t *x = dg_graph_add_op(t.g, DG_OP_SUMSQ, "sumsq.stray", 1, &stray, 1, &sc, NULL, 0);
            OK(dg_graph_error(t.g));
            dg_graph_move(t.g, x, last + 1);
            want = "not a tensor of the flat gradient buffer";
        }
        dg_pass_t s1[] = {{"fuse_sumsq", dg_pass_fuse_sumsq, &fb}};
        dg_status_t st = dg_graph_run_passes(t.g, s1, 1);
        EXPECT(st == DG_ERR_USAGE && strstr(dg_last_error(), want) && !strchr(dg_last_error(), '\n'),
               "fuse_sumsq refusal %d: expected a one-line '%s', got %d '%s'", bad, want, st,
               dg_last_error());
        tg_free(&t);
    }
}
