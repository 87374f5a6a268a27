/* test_graph_model.c — the GPT model API of graph.h on the CPU backend.
 *  - descriptions: presets, parameter counts, FLOPs, config overrides and their errors;
 *  - gradients of a small GPT (2 layers, d=32, 4 heads, T=16, V=67 padded to 72, micro-batch 2) against
 *    float64 central differences of an independent float64 GPT forward (ref64.c), on sampled elements of
 *    every parameter tensor; the loss and the logits against the same reference;
 *  - gradient accumulation: two micro-batches of 2 == one micro-batch of 4 (same init);
 *  - 50 AdamW steps on one fixed batch drive the loss below 0.1;
 *  - determinism: two runs give bitwise-equal losses and weights, and so does a run without arena reuse
 *    (which also checks the memory planner end to end);
 *  - the GELU backward variants (fused matmul_bwd_dgelu, unfused, GELU recomputed): schedules, arena
 *    sizes, and bitwise-equal training;
 *  - the classifier loss fused with its backward (crossentropy_fused) against the unfused pair (model
 *    flag, environment hook): bitwise-equal training with gradient accumulation, evaluation forwards,
 *    a loss-scale change, logits and gradients;
 *  - the residual adds fused into the linear layers before them (matmul_res): 2 * n_layer of them, the
 *    arena not larger, and the same bitwise-equal training against the matmul + add pairs;
 *  - non-finite gradients skip the whole update; frozen tensors are not updated and not in the norm;
 *  - the --plan-only printer (text and JSON) and one-line errors for bad input;
 *  - kernel launches per step (dg_model_kernels_per_step, with and without the fusion passes) against
 *    the executor's count of the launches one real step makes, and the unfused model's identical losses.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dg_model.h"
#include "graph.h"
#include "ref64.h"
#include "gmodel.h"

static dg_backend_t *be;

static const dg_model_desc_t small = {
    .n_layer = 2, .n_head = 4, .d_model = 32, .seq_len = 16, .vocab_size = 67, .padded_vocab = 72};

static void random_ids(int32_t *x, size_t n, int v, uint64_t *s) {
    for (size_t i = 0; i < n; i++)
        x[i] = (int32_t)(ref_rng_next(s) % (uint64_t)v);
}

/* ---------------- descriptions ---------------- */

static void test_desc(void) {
    dg_model_desc_t d;
    OK(dg_model_desc_preset("gpt2-124m", &d));
    EXPECT(d.n_layer == 12 && d.n_head == 12 && d.d_model == 768 && d.seq_len == 1024 &&
               d.vocab_size == 50257 && d.padded_vocab == 50304,
           "gpt2-124m preset sizes");
    EXPECT(dg_model_n_params(&d) == 124439808ull, "gpt2-124m has 124,439,808 parameters, got %llu",
           (unsigned long long)dg_model_n_params(&d));
    /* 6N + 12LCT with N = 124,439,808 - 1024*768 (wpe) + 47*768 (padded wte rows) */
    double N = 124439808.0 - 1024.0 * 768 + 47.0 * 768;
    EXPECT(fabs(dg_model_flops_per_token(&d) - (6 * N + 12.0 * 12 * 768 * 1024)) < 1.0, "flops per token");
    const char *names[] = {"gpt2-350m", "gpt2-774m", "gpt2-1558m"};
    int layers[] = {24, 36, 48}, heads[] = {16, 20, 25}, dm[] = {1024, 1280, 1600};
    for (int i = 0; i < 3; i++) {
        OK(dg_model_desc_preset(names[i], &d));
        EXPECT(d.n_layer == layers[i] && d.n_head == heads[i] && d.d_model == dm[i], "%s sizes", names[i]);
    }
    OK(dg_model_desc_preset("gpt2-1558m", &d));
    EXPECT(llabs((long long)dg_model_n_params(&d) - 1557611200ll) == 0, "gpt2-1558m params %llu",
           (unsigned long long)dg_model_n_params(&d));

    dg_model_spec_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.preset = "tiny";
    OK(dg_model_desc_resolve(&cfg, &d));
    EXPECT(d.n_layer == 4 && d.n_head == 4 && d.d_model == 128 && d.seq_len == 128 && d.vocab_size == 256 &&
               d.padded_vocab == 256,
           "tiny preset sizes");
    cfg.n_layer = 2;
    cfg.vocab_size = 300;
    OK(dg_model_desc_resolve(&cfg, &d));
    EXPECT(d.n_layer == 2 && d.vocab_size == 300 && d.padded_vocab == 320 && d.d_model == 128,
           "overrides: n_layer 2, vocab 300 padded to 320");
    cfg.n_head = 5;
    EXPECT(dg_model_desc_resolve(&cfg, &d) == DG_ERR_USAGE && strstr(dg_last_error(), "divisible"),
           "d_model 128 with 5 heads must be refused: %s", dg_last_error());
    memset(&cfg, 0, sizeof cfg);
    cfg.preset = "custom";
    cfg.n_layer = 3;
    cfg.n_head = 2;
    EXPECT(dg_model_desc_resolve(&cfg, &d) == DG_ERR_USAGE && strstr(dg_last_error(), "d_model") &&
               strstr(dg_last_error(), "seq_len") && strstr(dg_last_error(), "vocab_size"),
           "custom with missing sizes must name them: %s", dg_last_error());
    cfg.preset = "gpt5";
    EXPECT(dg_model_desc_resolve(&cfg, &d) == DG_ERR_USAGE && strstr(dg_last_error(), "gpt5"),
           "unknown preset must be named: %s", dg_last_error());
    dg_model_desc_t bad = small;
    bad.padded_vocab = 60;
    EXPECT(dg_model_desc_validate(&bad) == DG_ERR_USAGE, "padded vocab below vocab must be refused");
}

/* ---------------- gradients against float64 finite differences ---------------- */

typedef struct {
    ref_gpt_t r;
    double **P;
    const int32_t *tok, *tgt;
} gctx_t;

static double mean_loss(gctx_t *c) {
    return ref_gpt_loss_sum(&c->r, c->P, c->tok, c->tgt, NULL) / (double)(c->r.B * c->r.T);
}

static void test_gradients(int flags) {
    const int B = 2;
    dg_model_t *m;
    OK(dg_model_create_ex(&small, be, B, 42, flags, &m));
    int nt = dg_model_n_tensors(m);
    EXPECT(nt == 2 + 12 * small.n_layer + 2, "tensor count %d", nt);
    /* move every tensor away from its structured init (zero biases, unit gains) so that each gradient
     * entry is generic; keep padded wte rows at zero as the model requires */
    uint64_t rs = 3;
    double **P = calloc((size_t)nt, sizeof *P);
    for (int i = 0; i < nt; i++) {
        const dg_param_info_t *pi = dg_model_param(m, i);
        float *h = malloc(pi->numel * sizeof *h);
        OK(dg_model_get_tensor(m, i, DG_STATE_PARAM, h));
        size_t valid = strcmp(pi->name, "wte") == 0 ? (size_t)small.vocab_size * small.d_model : pi->numel;
        double amp = strstr(pi->name, "ln_") ? 0.2 : (pi->ndim == 1 ? 0.05 : 0.1);
        for (size_t e = 0; e < valid; e++)
            h[e] += (float)(amp * (2 * ref_rng_uniform(&rs) - 1));
        OK(dg_model_set_tensor(m, i, DG_STATE_PARAM, h));
        P[i] = malloc(pi->numel * sizeof **P);
        for (size_t e = 0; e < pi->numel; e++)
            P[i][e] = h[e];
        free(h);
    }
    size_t n = (size_t)B * small.seq_len;
    int32_t tok[64], tgt[64];
    uint64_t s = 77;
    random_ids(tok, n, small.vocab_size, &s);
    random_ids(tgt, n, small.vocab_size, &s);
    float loss;
    OK(dg_model_zero_grad(m));
    OK(dg_model_forward_backward(m, tok, tgt, 1.0f / (float)n, &loss));
    gctx_t c = {
        {small.n_layer, small.n_head, small.d_model, small.seq_len, small.vocab_size, small.padded_vocab, B},
        P,
        tok,
        tgt};
    double ref = mean_loss(&c);
    EXPECT(fabs(loss - ref) <= 1e-5 * ref, "loss %.8f vs float64 reference %.8f", (double)loss, ref);

    /* logits at a position against the reference logits */
    double *lg = malloc(n * small.padded_vocab * sizeof *lg);
    ref_gpt_loss_sum(&c.r, P, tok, tgt, lg);
    float lgot[2 * 67];
    OK(dg_model_logits(m, tok, 9, lgot));
    double maxe = 0, maxr = 0;
    for (int b = 0; b < B; b++)
        for (int v = 0; v < small.vocab_size; v++) {
            double r = lg[((size_t)b * small.seq_len + 9) * small.padded_vocab + v];
            maxe = fmax(maxe, fabs(lgot[b * small.vocab_size + v] - r));
            maxr = fmax(maxr, fabs(r));
        }
    EXPECT(maxe <= 1e-5 * maxr, "logits at position 9: max error %.3g of max %.3g", maxe, maxr);
    free(lg);

    /* Sampled elements of every tensor. The fp32 model's gradient carries rounding of ~1e-6 relative per
     * op over a few dozen ops; the central difference of the float64 reference at h = 1e-5 is accurate to
     * ~1e-9. Tolerance: |g - fd| <= 1e-4 * max|fd| over the tensor's samples + 1e-8 (observed: ~1e-6). Wiring
     * mistakes (wrong transpose, missing accumulation, wrong tie) give errors of the order of the gradient.
     */
    double worst = 0;
    int checked = 0;
    for (int i = 0; i < nt; i++) {
        const dg_param_info_t *pi = dg_model_param(m, i);
        float *g = malloc(pi->numel * sizeof *g);
        OK(dg_model_get_tensor(m, i, DG_STATE_GRAD, g));
        size_t idx[10];
        int ns = 0;
        if (strcmp(pi->name, "wte") == 0) {
            idx[ns++] = (size_t)tok[0] * small.d_model + 3;  /* a looked-up row (embedding + head) */
            idx[ns++] = (size_t)tgt[5] * small.d_model + 17; /* a target row */
            size_t nz = 0;
            for (size_t e = (size_t)small.vocab_size * small.d_model; e < pi->numel; e++)
                nz += g[e] != 0.0f;
            EXPECT(nz == 0, "wte: %zu padded-row gradient entries are not zero", nz);
        }
        while (ns < 8) {
            size_t e = (size_t)(ref_rng_next(&s) % pi->numel);
            if (strcmp(pi->name, "wte") == 0 && e >= (size_t)small.vocab_size * small.d_model) continue;
            idx[ns++] = e;
        }
        double fd[10], maxfd = 0, maxerr = 0;
        for (int k = 0; k < ns; k++) {
            double save = P[i][idx[k]], h = 1e-5;
            P[i][idx[k]] = save + h;
            double lp = mean_loss(&c);
            P[i][idx[k]] = save - h;
            double lm = mean_loss(&c);
            P[i][idx[k]] = save;
            fd[k] = (lp - lm) / (2 * h);
            maxfd = fmax(maxfd, fabs(fd[k]));
        }
        for (int k = 0; k < ns; k++)
            maxerr = fmax(maxerr, fabs(fd[k] - g[idx[k]]));
        EXPECT(maxerr <= 1e-4 * maxfd + 1e-8, "%s: gradient error %.3g vs max |fd| %.3g", pi->name, maxerr,
               maxfd);
        EXPECT(maxfd > 0, "%s: sampled gradients all zero", pi->name);
        if (maxfd > 0 && maxerr / maxfd > worst) worst = maxerr / maxfd;
        checked += ns;
        free(g);
    }
    printf("gradients (%s): %d sampled entries of %d tensors vs float64 finite differences, worst error "
           "%.2e of the tensor's max; loss %.6f (ref %.6f)\n",
           flags & DG_MODEL_UNFUSED_GELU_BWD ? "matmul_bwd + gelu_bwd"
           : flags & DG_MODEL_RECOMPUTE_GELU ? "fused GELU backward, GELU recomputed"
                                             : "fused GELU backward",
           checked, nt, worst, (double)loss, ref);
    for (int i = 0; i < nt; i++)
        free(P[i]);
    free(P);
    dg_model_free(m);
}

/* ---------------- accumulation over micro-batches ---------------- */

static void test_accumulation(void) {
    dg_model_t *m2, *m4;
    OK(dg_model_create(&small, be, 2, 9, &m2));
    OK(dg_model_create(&small, be, 4, 9, &m4));
    size_t T = (size_t)small.seq_len;
    int32_t tok[64], tgt[64];
    uint64_t s = 5;
    random_ids(tok, 4 * T, small.vocab_size, &s);
    random_ids(tgt, 4 * T, small.vocab_size, &s);
    float l1, l2, l4;
    float dl = 1.0f / (float)(4 * T);
    OK(dg_model_zero_grad(m2));
    OK(dg_model_forward_backward(m2, tok, tgt, dl, &l1));
    OK(dg_model_forward_backward(m2, tok + 2 * T, tgt + 2 * T, dl, &l2));
    OK(dg_model_zero_grad(m4));
    OK(dg_model_forward_backward(m4, tok, tgt, dl, &l4));
    EXPECT(fabs((l1 + l2) / 2 - l4) <= 1e-5 * l4, "mean loss of two halves %.7f vs whole %.7f",
           (double)(l1 + l2) / 2, (double)l4);
    double worst = 0;
    for (int i = 0; i < dg_model_n_tensors(m2); i++) {
        size_t ne = dg_model_param(m2, i)->numel;
        float *a = malloc(ne * sizeof *a), *b = malloc(ne * sizeof *b);
        OK(dg_model_get_tensor(m2, i, DG_STATE_GRAD, a));
        OK(dg_model_get_tensor(m4, i, DG_STATE_GRAD, b));
        double mx = 0, err = 0;
        for (size_t e = 0; e < ne; e++) {
            mx = fmax(mx, fabs(b[e]));
            err = fmax(err, fabs(a[e] - b[e]));
        }
        EXPECT(err <= 1e-4 * mx + 1e-9, "%s: accumulated gradient differs from the big batch (%.3g of %.3g)",
               dg_model_param(m2, i)->name, err, mx);
        if (mx > 0) worst = fmax(worst, err / mx);
        free(a), free(b);
    }
    printf("accumulation: 2 micro-batches of 2 == 1 of 4 (worst relative difference %.2e)\n", worst);
    dg_model_free(m2);
    dg_model_free(m4);
}

/* ---------------- training: overfit, determinism ---------------- */

/* Runs `steps` AdamW steps on one fixed batch; returns the final mean loss; losses[] gets each step's
 * loss; weights (if non-NULL) receives a copy of all parameters. */
static float train_fixed(const dg_model_desc_t *d, int B, int flags, int steps, float lr, float *losses,
                         float **weights, size_t *nweights) {
    dg_model_t *m;
    OK(dg_model_create_ex(d, be, B, 1234, flags, &m));
    size_t n = (size_t)B * d->seq_len;
    int32_t *tok = malloc(n * sizeof *tok), *tgt = malloc(n * sizeof *tgt);
    uint64_t s = 8;
    random_ids(tok, n, d->vocab_size, &s);
    random_ids(tgt, n, d->vocab_size, &s);
    float loss = 0;
    for (int st = 1; st <= steps; st++) {
        OK(dg_model_zero_grad(m));
        OK(dg_model_forward_backward(m, tok, tgt, 1.0f / (float)n, &loss));
        if (losses) losses[st - 1] = loss;
        dg_optim_hparams_t h = gmodel_adamw(lr, 0.0f, 1.0f, st);
        float norm;
        OK(dg_model_optimizer_step(m, &h, &norm));
        EXPECT(isfinite(norm) && norm > 0, "step %d: gradient norm %g", st, (double)norm);
    }
    OK(dg_model_forward(m, tok, tgt, &loss));
    if (weights) {
        size_t tot = 0;
        for (int i = 0; i < dg_model_n_tensors(m); i++)
            tot += dg_model_param(m, i)->numel;
        *weights = malloc(tot * sizeof **weights);
        *nweights = tot;
        size_t o = 0;
        for (int i = 0; i < dg_model_n_tensors(m); i++) {
            OK(dg_model_get_tensor(m, i, DG_STATE_PARAM, *weights + o));
            o += dg_model_param(m, i)->numel;
        }
    }
    free(tok);
    free(tgt);
    dg_model_free(m);
    return loss;
}

/* `steps` steps of the small model (micro-batch 2) with each of variants[1..nv-1] give bitwise the losses
 * and final weights of variants[0] (flags 0). */
static void expect_variants_bitwise(const int *variants, const char *const *names, int nv, int steps) {
    float lf[8], l[8];
    float *wf, *w;
    size_t nf, n;
    train_fixed(&small, 2, 0, steps, 3e-3f, lf, &wf, &nf);
    for (int v = 1; v < nv; v++) {
        train_fixed(&small, 2, variants[v], steps, 3e-3f, l, &w, &n);
        EXPECT(memcmp(lf, l, (size_t)steps * sizeof *l) == 0,
               "%s vs %s: losses differ (step %d: %.9g vs %.9g)", names[v], names[0], steps,
               (double)l[steps - 1], (double)lf[steps - 1]);
        EXPECT(n == nf && memcmp(w, wf, n * sizeof *w) == 0, "%s vs %s: final weights differ", names[v],
               names[0]);
        free(w);
    }
    free(wf);
}

static void test_overfit(void) {
    /* 4 sequences x 32 random byte tokens; 50 steps at lr 1e-2 memorize them */
    dg_model_desc_t d = {
        .n_layer = 2, .n_head = 4, .d_model = 64, .seq_len = 32, .vocab_size = 256, .padded_vocab = 256};
    float losses[50];
    double t0 = dg_now_s();
    float final = train_fixed(&d, 4, 0, 50, 1e-2f, losses, NULL, NULL);
    printf("overfit: loss %.4f -> %.4f (step 25 %.4f) after 50 steps, final eval %.4f, %.1f s\n",
           (double)losses[0], (double)losses[49], (double)losses[24], (double) final, dg_now_s() - t0);
    EXPECT(fabs(losses[0] - logf(256.0f)) < 0.3f, "initial loss %.3f should be near ln(256) = 5.545",
           (double)losses[0]);
    EXPECT(final < 0.1f, "50 steps on one batch should drive the loss below 0.1, got %.4f", (double) final);
}

static void test_determinism(void) {
    float la[6], lb[6], lc[6];
    float *wa, *wb, *wc;
    size_t na, nb, nc;
    train_fixed(&small, 2, 0, 6, 3e-3f, la, &wa, &na);
    train_fixed(&small, 2, 0, 6, 3e-3f, lb, &wb, &nb);
    train_fixed(&small, 2, DG_MODEL_NO_ARENA_REUSE, 6, 3e-3f, lc, &wc, &nc);
    EXPECT(memcmp(la, lb, sizeof la) == 0, "two runs: losses differ");
    EXPECT(na == nb && memcmp(wa, wb, na * sizeof *wa) == 0, "two runs: final weights differ");
    EXPECT(memcmp(la, lc, sizeof la) == 0, "planned arena vs no reuse: losses differ");
    EXPECT(na == nc && memcmp(wa, wc, na * sizeof *wa) == 0, "planned arena vs no reuse: weights differ");
    EXPECT(la[5] < la[0], "loss should fall over 6 steps (%.4f -> %.4f)", (double)la[0], (double)la[5]);
    printf("determinism: 3 runs x 6 steps bitwise equal (losses %.6f .. %.6f, %zu weights)\n", (double)la[0],
           (double)la[5], na);
    free(wa), free(wb), free(wc);
}

/* ---------------- GELU backward fusion and recompute ---------------- */

static int count_ops(const dg_model_t *m, dg_op_kind_t k, int phase) {
    const dg_graph_t *g = dg_model_graph(m);
    int c = 0;
    for (int i = 0; i < g->n; i++)
        if (g->nodes[i]->op == k && (phase < 0 || (int)g->nodes[i]->phase == phase)) c++;
    return c;
}

/* The schedule of each variant, and its numbers: on the CPU backend the fused op computes exactly what
 * matmul_bwd + gelu_bwd compute (same GEMM tiles, same elementwise code), and the recomputed GELU is the
 * forward epilogue's GELU of the same pre-activation, so all four variants give bitwise-equal losses and
 * weights (with and without arena reuse). */
static void test_gelu_variants(void) {
    const int L = small.n_layer;
    const int variants[] = {0, DG_MODEL_RECOMPUTE_GELU, DG_MODEL_UNFUSED_GELU_BWD,
                            DG_MODEL_UNFUSED_GELU_BWD | DG_MODEL_RECOMPUTE_GELU,
                            DG_MODEL_RECOMPUTE_GELU | DG_MODEL_NO_ARENA_REUSE};
    const char *names[] = {"fused", "fused+recompute", "unfused", "unfused+recompute", "recompute, no reuse"};
    size_t arena[5] = {0};
    for (int v = 0; v < 5; v++) {
        int f = variants[v];
        dg_model_t *m;
        OK(dg_model_create_ex(&small, be, 2, 1, f | DG_MODEL_PLAN_ONLY, &m));
        int fused = !(f & DG_MODEL_UNFUSED_GELU_BWD), rec = (f & DG_MODEL_RECOMPUTE_GELU) != 0;
        EXPECT(count_ops(m, DG_OP_MATMUL_BWD_DGELU, DG_PHASE_BWD) == (fused ? L : 0),
               "%s: %d matmul_bwd_dgelu ops", names[v], count_ops(m, DG_OP_MATMUL_BWD_DGELU, -1));
        EXPECT(count_ops(m, DG_OP_GELU_BWD, -1) == (fused ? 0 : L), "%s: %d gelu_bwd ops", names[v],
               count_ops(m, DG_OP_GELU_BWD, -1));
        EXPECT(count_ops(m, DG_OP_GELU, DG_PHASE_BWD) == (rec ? L : 0), "%s: %d recompute gelu ops", names[v],
               count_ops(m, DG_OP_GELU, DG_PHASE_BWD));
        /* with recompute, no backward op reads a forward GELU output any more */
        const dg_graph_t *g = dg_model_graph(m);
        int late = 0;
        for (int i = 0; i < g->n; i++) {
            const dg_node_t *x = g->nodes[i];
            if (x->phase != DG_PHASE_BWD || x->op == DG_OP_SIDE || x->op == DG_OP_LEAF) continue;
            for (int k = 0; k < x->n_src; k++)
                late += x->src[k]->op == DG_OP_MATMUL && x->src[k]->attr[DG_A_EPI] == DG_EPI_GELU;
        }
        EXPECT(late == (rec ? 0 : L), "%s: %d backward reads of forward GELU outputs", names[v], late);
        EXPECT(dg_plan_check(dg_model_plan(m), g) == DG_OK, "%s: plan check: %s", names[v], dg_last_error());
        arena[v] = dg_model_arena_bytes(m);
        dg_model_free(m);
    }
    EXPECT(arena[1] < arena[0] && arena[0] <= arena[2], "arena: recompute %zu < fused %zu <= unfused %zu",
           arena[1], arena[0], arena[2]);

    expect_variants_bitwise(variants, names, 5, 6);
    printf("gelu variants: fused / recompute / unfused / unfused+recompute / recompute without reuse: 6 "
           "steps bitwise equal; arena (micro-batch 2) %zu / %zu / %zu bytes\n",
           arena[0], arena[1], arena[2]);
}

/* train.recompute levels (graph pass recompute): what the backward reads from the forward, the plan, and
 * the numbers. selective: no backward op reads a forward layer norm or attention (nor their statistics
 * and aux); full: none reads a layer's forward op but its output res_2. The arena shrinks at each level
 * and every level trains bitwise like the plain graph (CPU backend: a recomputed op computes what the
 * original did), also with the residual unfused and without arena reuse. */
static int late_reads(const dg_graph_t *g, int full) {
    int late = 0;
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *x = g->nodes[i];
        if (x->phase != DG_PHASE_BWD || x->op == DG_OP_SIDE || x->op == DG_OP_LEAF) continue;
        for (int k = 0; k < x->n_src; k++) {
            const dg_node_t *s = x->src[k]->op == DG_OP_SIDE ? x->src[k]->src[0] : x->src[k];
            if (s->phase != DG_PHASE_FWD || s->op == DG_OP_LEAF || strncmp(s->name, "h.", 2) != 0) continue;
            const char *dot = strrchr(s->name, '.');
            if (full ? strcmp(dot, ".res_2") != 0 : s->op == DG_OP_LAYERNORM || s->op == DG_OP_ATTENTION)
                late++;
        }
    }
    return late;
}

static void test_recompute_levels(void) {
    const int L = small.n_layer;
    const int variants[] = {0,
                            DG_MODEL_RECOMPUTE_GELU,
                            DG_MODEL_RECOMPUTE_SELECTIVE,
                            DG_MODEL_RECOMPUTE_FULL,
                            DG_MODEL_RECOMPUTE_SELECTIVE | DG_MODEL_UNFUSED_RESID,
                            DG_MODEL_RECOMPUTE_FULL | DG_MODEL_UNFUSED_RESID,
                            DG_MODEL_RECOMPUTE_FULL | DG_MODEL_NO_ARENA_REUSE};
    const char *names[] = {
        "none",          "gelu", "selective", "full", "selective, unfused residual", "full, unfused residual",
        "full, no reuse"};
    const int nv = (int)(sizeof variants / sizeof variants[0]);
    size_t arena[7] = {0};
    for (int v = 0; v < nv; v++) {
        int f = variants[v], sel = (f & DG_MODEL_RECOMPUTE_SELECTIVE) != 0,
            full = (f & DG_MODEL_RECOMPUTE_FULL) != 0;
        dg_model_t *m;
        OK(dg_model_create_ex(&small, be, 2, 1, f | DG_MODEL_PLAN_ONLY, &m));
        const dg_graph_t *g = dg_model_graph(m);
        int ln = count_ops(m, DG_OP_LAYERNORM, DG_PHASE_BWD),
            att = count_ops(m, DG_OP_ATTENTION, DG_PHASE_BWD);
        int mm = count_ops(m, DG_OP_MATMUL, DG_PHASE_BWD), ge = count_ops(m, DG_OP_GELU, DG_PHASE_BWD);
        EXPECT(ln == (sel || full ? 2 * L : 0) && att == (sel || full ? L : 0),
               "%s: %d layernorm, %d attention "
               "ops in the backward",
               names[v], ln, att);
        /* full: qkv and mlp.fc (its GELU epilogue: no separate gelu), with the residual unfused also the
         * attention projection (res_1's matmul); selective and gelu: one gelu per layer */
        int want_mm = full ? ((f & DG_MODEL_UNFUSED_RESID) ? 3 : 2) * L : 0;
        EXPECT(mm == want_mm, "%s: %d matmul ops in the backward, want %d", names[v], mm, want_mm);
        EXPECT(ge == ((f & DG_MODEL_RECOMPUTE_GELU) || sel ? L : 0), "%s: %d gelu ops in the backward",
               names[v], ge);
        if (sel || full)
            EXPECT(late_reads(g, full) == 0, "%s: %d backward reads of forward tensors that are recomputed",
                   names[v], late_reads(g, full));
        EXPECT(dg_plan_check(dg_model_plan(m), g) == DG_OK, "%s: plan check: %s", names[v], dg_last_error());
        arena[v] = dg_model_arena_bytes(m);
        dg_model_free(m);
    }
    EXPECT(arena[0] > arena[1] && arena[1] > arena[2] && arena[2] > arena[3],
           "arena: none %zu > gelu %zu > selective %zu > full %zu", arena[0], arena[1], arena[2], arena[3]);
    expect_variants_bitwise(variants, names, nv, 4);
    printf(
        "recompute levels none / gelu / selective / full: arena (micro-batch 2) %zu / %zu / %zu / %zu bytes; "
        "4 steps bitwise equal (also unfused residual, no reuse)\n",
        arena[0], arena[1], arena[2], arena[3]);
}

/* ---------------- plan printing ---------------- */

static int count(const char *s, const char *needle) {
    int c = 0;
    for (const char *p = s; (p = strstr(p, needle)); p++)
        c++;
    return c;
}

static void test_print(void) {
    dg_model_t *m;
    OK(dg_model_create_ex(&small, be, 2, 1, DG_MODEL_PLAN_ONLY, &m));
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    OK(dg_model_print_plan(m, f, 0));
    fclose(f);
    int nops = dg_model_n_ops(m);
    /* one row per op and per side output, a header and 4 summary lines */
    int side = 0;
    const dg_graph_t *g = dg_model_graph(m);
    for (int i = 0; i < g->n; i++)
        side += g->nodes[i]->op == DG_OP_SIDE;
    EXPECT(count(buf, "\n") == nops + side + 2 + 3, "text plan: %d lines for %d ops + %d side outputs",
           count(buf, "\n"), nops, side);
    EXPECT(count(buf, " adamw_all ") == 1 && count(buf, " adamw ") == 0, "text plan: one fused adamw_all");
    EXPECT(count(buf, " sumsq_all ") == 1 && count(buf, " sumsq ") == 0, "text plan: one fused sumsq_all");
    char segs[64];
    snprintf(segs, sizeof segs, " over %d tensors", dg_model_n_tensors(m));
    EXPECT(count(buf, segs) == 2, "text plan: adamw_all and sumsq_all should each say '%s'", segs);
    EXPECT(strstr(buf, "lm_head") && strstr(buf, "encoder_bwd") && strstr(buf, "crossentropy_fused") &&
               strstr(buf, "arena@") && strstr(buf, "activation arena:"),
           "text plan misses expected entries");
    char want[128];
    snprintf(want, sizeof want, "activation arena: %zu bytes", dg_model_arena_bytes(m));
    EXPECT(strstr(buf, want), "text plan should report '%s'", want);
    free(buf);
    f = open_memstream(&buf, &len);
    OK(dg_model_print_plan(m, f, 1));
    fclose(f);
    int depth = 0, bad = 0;
    for (char *p = buf; *p; p++) {
        if (*p == '{' || *p == '[') depth++;
        if (*p == '}' || *p == ']') bad |= --depth < 0;
    }
    EXPECT(!bad && depth == 0 && buf[0] == '{', "JSON plan brackets unbalanced");
    EXPECT(count(buf, "\"id\":") == nops + side, "JSON plan: %d entries for %d ops + %d sides",
           count(buf, "\"id\":"), nops, side);
    snprintf(want, sizeof want, "\"arena_bytes\":%zu", dg_model_arena_bytes(m));
    EXPECT(strstr(buf, want) != NULL, "JSON plan should contain %s", want);
    snprintf(want, sizeof want, "\"segments\":%d", dg_model_n_tensors(m));
    EXPECT(count(buf, want) == 2 && strstr(buf, "\"op\":\"sumsq_all\""),
           "JSON plan: adamw_all and sumsq_all should carry %s", want);
    free(buf);
    /* a plan-only model cannot run */
    int32_t tok[32] = {0};
    EXPECT(dg_model_forward(m, tok, tok, NULL) == DG_ERR_USAGE, "plan-only model must refuse to run");
    dg_model_free(m);
}

/* ---------------- bad input ---------------- */

static void test_errors(void) {
    dg_model_t *m;
    EXPECT(dg_model_create(&small, be, 0, 1, &m) == DG_ERR_USAGE, "micro_batch 0 must be refused");
    OK(dg_model_create(&small, be, 2, 1, &m));
    int32_t tok[32], tgt[32];
    uint64_t s = 1;
    random_ids(tok, 32, small.vocab_size, &s);
    random_ids(tgt, 32, small.vocab_size, &s);
    tok[17] = 67; /* == vocab_size: a padded row, never valid input */
    EXPECT(dg_model_forward_backward(m, tok, tgt, 1.0f, NULL) == DG_ERR_USAGE &&
               strstr(dg_last_error(), "tokens[17]") && strstr(dg_last_error(), "sequence 1, position 1"),
           "out-of-range token: %s", dg_last_error());
    tok[17] = 1;
    tgt[3] = -2;
    EXPECT(dg_model_forward(m, tok, tgt, NULL) == DG_ERR_USAGE && strstr(dg_last_error(), "targets[3]"),
           "negative target: %s", dg_last_error());
    dg_optim_hparams_t h = {.lr = 1e-3f, .beta1 = 1.0f, .beta2 = 0.95f, .eps = 1e-8f, .t = 1};
    EXPECT(dg_model_optimizer_step(m, &h, NULL) == DG_ERR_USAGE, "beta1 = 1 must be refused");
    h.beta1 = 0.9f;
    h.t = 0;
    EXPECT(dg_model_optimizer_step(m, &h, NULL) == DG_ERR_USAGE, "t = 0 must be refused");
    float x[4];
    EXPECT(dg_model_get_tensor(m, 99, DG_STATE_PARAM, x) == DG_ERR_USAGE, "bad tensor index must be refused");
    EXPECT(dg_model_get_tensor(m, 0, 7, x) == DG_ERR_USAGE, "bad state must be refused");
    EXPECT(dg_model_logits(m, tok, 16, x) == DG_ERR_USAGE, "logits position out of range must be refused");
    EXPECT(dg_model_find_param(m, "h.1.mlp.fc.weight") == 2 + 12 + 8, "find_param");
    const dg_param_info_t *pi = dg_model_param(m, 2 + 12 + 8);
    EXPECT(pi && pi->decay == 1 && pi->shape[0] == 128 && pi->shape[1] == 32 && pi->numel == 4096,
           "mlp.fc.weight info");
    pi = dg_model_param(m, 0);
    EXPECT(pi->decay == 0 && pi->shape[0] == 72 && pi->numel == 72 * 32, "wte info (padded, no decay)");
    /* state round trip */
    size_t ne = dg_model_param(m, 4)->numel;
    float *a = malloc(ne * sizeof *a), *b = malloc(ne * sizeof *b);
    for (size_t e = 0; e < ne; e++)
        a[e] = (float)e * 0.5f;
    OK(dg_model_set_tensor(m, 4, DG_STATE_ADAM_V, a));
    OK(dg_model_get_tensor(m, 4, DG_STATE_ADAM_V, b));
    EXPECT(memcmp(a, b, ne * sizeof *a) == 0, "set/get round trip of adam_v");
    free(a), free(b);
    dg_model_free(m);
}

/* Non-finite gradients skip the update entirely; frozen tensors are not updated and not in the norm. */
static float *snapshot(dg_model_t *m, int which) {
    size_t tot = 0;
    for (int i = 0; i < dg_model_n_tensors(m); i++)
        tot += dg_model_param(m, i)->numel;
    float *h = malloc(tot * sizeof *h);
    size_t o = 0;
    for (int i = 0; i < dg_model_n_tensors(m); i++) {
        OK(dg_model_get_tensor(m, i, which, h + o));
        o += dg_model_param(m, i)->numel;
    }
    return h;
}

static void test_skip_and_freeze(void) {
    dg_model_t *m;
    OK(dg_model_create(&small, be, 2, 3, &m));
    size_t n = 2 * (size_t)small.seq_len, tot = 0;
    for (int i = 0; i < dg_model_n_tensors(m); i++)
        tot += dg_model_param(m, i)->numel;
    int32_t tok[32], tgt[32];
    uint64_t s = 4;
    random_ids(tok, n, small.vocab_size, &s);
    random_ids(tgt, n, small.vocab_size, &s);
    dg_optim_hparams_t h = gmodel_adamw(1e-2f, 0.1f, 1.0f, 1);
    float loss, norm;
    /* one normal step so that the moments are non-zero */
    OK(dg_model_zero_grad(m));
    OK(dg_model_forward_backward(m, tok, tgt, 1.0f / (float)n, &loss));
    OK(dg_model_optimizer_step(m, &h, &norm));
    float bad[2] = {INFINITY, NAN};
    for (int k = 0; k < 2; k++) {
        OK(dg_model_zero_grad(m));
        OK(dg_model_forward_backward(m, tok, tgt, 1.0f / (float)n, &loss));
        size_t ne = dg_model_param(m, 5)->numel;
        float *g = malloc(ne * sizeof *g);
        OK(dg_model_get_tensor(m, 5, DG_STATE_GRAD, g));
        g[ne / 2] = bad[k];
        OK(dg_model_set_tensor(m, 5, DG_STATE_GRAD, g));
        free(g);
        float *p0 = snapshot(m, DG_STATE_PARAM), *m0 = snapshot(m, DG_STATE_ADAM_M),
              *v0 = snapshot(m, DG_STATE_ADAM_V);
        h.t++;
        dg_status_t st = dg_model_optimizer_step(m, &h, &norm);
        float *p1 = snapshot(m, DG_STATE_PARAM), *m1 = snapshot(m, DG_STATE_ADAM_M),
              *v1 = snapshot(m, DG_STATE_ADAM_V);
        EXPECT(st == DG_OK && !isfinite(norm),
               "%s gradient: step should succeed and report a non-finite norm (%g)", k ? "NaN" : "inf",
               (double)norm);
        EXPECT(!memcmp(p0, p1, tot * 4) && !memcmp(m0, m1, tot * 4) && !memcmp(v0, v1, tot * 4),
               "%s gradient: parameters or moments changed although the update must be skipped",
               k ? "NaN" : "inf");
        free(p0), free(m0), free(v0), free(p1), free(m1), free(v1);
    }
    /* freeze wte and h.0.attn.proj.weight */
    int fz[2] = {0, dg_model_find_param(m, "h.0.attn.proj.weight")};
    for (int k = 0; k < 2; k++)
        OK(dg_model_set_frozen(m, fz[k], 1));
    EXPECT(dg_model_set_frozen(m, 99, 1) == DG_ERR_USAGE, "freezing a bad index must be refused");
    OK(dg_model_zero_grad(m));
    OK(dg_model_forward_backward(m, tok, tgt, 1.0f / (float)n, &loss));
    double ss = 0;
    for (int i = 0; i < dg_model_n_tensors(m); i++) {
        if (i == fz[0] || i == fz[1]) continue;
        size_t ne = dg_model_param(m, i)->numel;
        float *g = malloc(ne * sizeof *g);
        OK(dg_model_get_tensor(m, i, DG_STATE_GRAD, g));
        for (size_t e = 0; e < ne; e++)
            ss += (double)g[e] * g[e];
        free(g);
    }
    float *p0 = snapshot(m, DG_STATE_PARAM);
    h.t++;
    OK(dg_model_optimizer_step(m, &h, &norm));
    float *p1 = snapshot(m, DG_STATE_PARAM);
    EXPECT(fabs(norm - sqrt(ss)) <= 1e-5 * sqrt(ss),
           "frozen: norm %.7g should cover only trainable tensors (%.7g)", (double)norm, sqrt(ss));
    size_t o = 0;
    for (int i = 0; i < dg_model_n_tensors(m); i++) {
        size_t ne = dg_model_param(m, i)->numel;
        int same = !memcmp(p0 + o, p1 + o, ne * 4);
        int is_frozen = i == fz[0] || i == fz[1];
        EXPECT(same == is_frozen, "%s: %s", dg_model_param(m, i)->name,
               is_frozen ? "frozen tensor was updated" : "trainable tensor was not updated");
        o += ne;
    }
    free(p0), free(p1);
    dg_model_free(m);
}

/* ---------------- fused AdamW ---------------- */

enum { FZ_STEPS = 5, FZ_ACCUM = 2 };
typedef struct {
    float loss[FZ_STEPS * FZ_ACCUM], norm[FZ_STEPS];
    float *w, *m, *v; /* flat buffers, gaps included */
    size_t n;
    int n_adamw, n_adamw_all, n_sumsq, n_sumsq_all;
    /* the gradients summed into the norm, in order: the SUMSQ ops' (per parameter) or the SUMSQ_ALL
     * node's segments (fused) as parameter index, offset in the flat buffer and size */
    int nseg, seg_pi[64];
    size_t seg_off[64], seg_n[64];
} fz_run_t;

/* Steps of 2 micro-batches with weight decay and clipping; h.1.mlp.fc.weight frozen at steps 2..3 and
 * ln_f.bias from step 2 on; an infinite gradient at step 4 (the update is skipped). per_param: 0 the
 * default (fused), 1 the model flag, 2 the environment hook. */
static void fz_train(int per_param, fz_run_t *r) {
    memset(r, 0, sizeof *r);
    if (per_param == 2) setenv("DG_TEST_ADAMW_PER_PARAM", "1", 1);
    dg_model_t *m;
    OK(dg_model_create_ex(&small, be, 2, 99, per_param == 1 ? DG_MODEL_ADAMW_PER_PARAM : 0, &m));
    unsetenv("DG_TEST_ADAMW_PER_PARAM");
    r->n_adamw = count_ops(m, DG_OP_ADAMW, DG_PHASE_OPT);
    r->n_adamw_all = count_ops(m, DG_OP_ADAMW_ALL, DG_PHASE_OPT);
    r->n_sumsq = count_ops(m, DG_OP_SUMSQ, DG_PHASE_OPT);
    r->n_sumsq_all = count_ops(m, DG_OP_SUMSQ_ALL, DG_PHASE_OPT);
    const dg_graph_t *g = dg_model_graph(m);
    const float *gbase = NULL; /* the flat gradient buffer: where parameter 0's gradient starts */
    for (int i = 0; i < g->n && !gbase; i++)
        if ((g->nodes[i]->flags & DG_NF_PARAM) && g->nodes[i]->param_index == 0)
            gbase = g->nodes[i]->grad->data;
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *x = g->nodes[i];
        if (x->op == DG_OP_SUMSQ && r->nseg < 64) {
            r->seg_pi[r->nseg] = x->src[0]->param_index;
            r->seg_off[r->nseg] = (size_t)((const float *)x->src[0]->data - gbase);
            r->seg_n[r->nseg++] = dg_node_numel(x->src[0]);
        }
        if (x->op == DG_OP_SUMSQ_ALL)
            for (int k = 0; k < g->n_norm_segs && r->nseg < 64; k++) {
                r->seg_pi[r->nseg] = g->norm_segs[k].param_index;
                r->seg_off[r->nseg] = g->norm_segs[k].off;
                r->seg_n[r->nseg++] = g->norm_segs[k].count;
            }
    }
    OK(dg_model_set_grad_accum(m, FZ_ACCUM));
    int fc = dg_model_find_param(m, "h.1.mlp.fc.weight"), lnfb = dg_model_find_param(m, "ln_f.bias");
    EXPECT(fc >= 0 && lnfb >= 0, "fused adamw test: parameters not found");
    size_t n = 2 * (size_t)small.seq_len;
    int32_t *tok = malloc(n * sizeof *tok), *tgt = malloc(n * sizeof *tgt);
    uint64_t s = 17;
    for (int st = 1; st <= FZ_STEPS; st++) {
        OK(dg_model_set_frozen(m, fc, st == 2 || st == 3));
        OK(dg_model_set_frozen(m, lnfb, st >= 2));
        OK(dg_model_zero_grad(m));
        for (int k = 0; k < FZ_ACCUM; k++) {
            random_ids(tok, n, small.vocab_size, &s);
            random_ids(tgt, n, small.vocab_size, &s);
            OK(dg_model_forward_backward(m, tok, tgt, 1.0f / (float)(FZ_ACCUM * n),
                                         &r->loss[(st - 1) * FZ_ACCUM + k]));
        }
        if (st == 4) { /* a non-finite gradient: the whole update is skipped */
            size_t ne = dg_model_param(m, 5)->numel;
            float *g = malloc(ne * sizeof *g);
            OK(dg_model_get_tensor(m, 5, DG_STATE_GRAD, g));
            g[ne / 3] = INFINITY;
            OK(dg_model_set_tensor(m, 5, DG_STATE_GRAD, g));
            free(g);
        }
        dg_optim_hparams_t h = gmodel_adamw(3e-3f, 0.1f, 0.5f, st);
        OK(dg_model_optimizer_step(m, &h, &r->norm[st - 1]));
    }
    gmodel_finish(m, tok, tgt, &r->n, &r->w, &r->m, &r->v);
}

/* One adamw_all op over the flat buffers against one adamw op per tensor (model flag, environment hook):
 * bitwise the same losses, gradient norms, weights and moments, gaps included. The gradient norm follows
 * the AdamW choice: one sumsq_all over the SUMSQ ops' gradients, in their order, or one sumsq per tensor. */
static void test_adamw_fused(void) {
    fz_run_t r[3];
    const char *names[3] = {"fused", "DG_MODEL_ADAMW_PER_PARAM", "DG_TEST_ADAMW_PER_PARAM=1"};
    for (int k = 0; k < 3; k++)
        fz_train(k, &r[k]);
    int np = 0;
    {
        dg_model_t *m;
        OK(dg_model_create_ex(&small, be, 2, 1, DG_MODEL_PLAN_ONLY, &m));
        np = dg_model_n_tensors(m);
        dg_model_free(m);
    }
    EXPECT(r[0].n_adamw == 0 && r[0].n_adamw_all == 1, "fused: %d adamw, %d adamw_all ops", r[0].n_adamw,
           r[0].n_adamw_all);
    /* the gradient norm follows: one sumsq_all with the fused AdamW, one sumsq per tensor without */
    EXPECT(r[0].n_sumsq == 0 && r[0].n_sumsq_all == 1 && r[0].nseg == np,
           "fused: %d sumsq, %d sumsq_all ops, %d segments", r[0].n_sumsq, r[0].n_sumsq_all, r[0].nseg);
    for (int k = 1; k < 3; k++) {
        EXPECT(r[k].n_adamw == np && r[k].n_adamw_all == 0, "%s: %d adamw (want %d), %d adamw_all ops",
               names[k], r[k].n_adamw, np, r[k].n_adamw_all);
        EXPECT(r[k].n_sumsq == np && r[k].n_sumsq_all == 0, "%s: %d sumsq (want %d), %d sumsq_all ops",
               names[k], r[k].n_sumsq, np, r[k].n_sumsq_all);
        /* the fused op's segments are the SUMSQ ops' gradients, in their order */
        int same = r[k].nseg == r[0].nseg;
        for (int i = 0; same && i < r[0].nseg; i++)
            same = r[k].seg_pi[i] == r[0].seg_pi[i] && r[k].seg_off[i] == r[0].seg_off[i] &&
                   r[k].seg_n[i] == r[0].seg_n[i];
        EXPECT(same, "%s: the %d SUMSQ ops do not read the %d segments of the fused sumsq_all, in order",
               names[k], r[k].nseg, r[0].nseg);
        EXPECT(memcmp(r[k].loss, r[0].loss, sizeof r[0].loss) == 0, "%s: losses differ from fused", names[k]);
        EXPECT(memcmp(r[k].norm, r[0].norm, sizeof r[0].norm) == 0, "%s: gradient norms differ from fused",
               names[k]);
        EXPECT(r[k].n == r[0].n && memcmp(r[k].w, r[0].w, r[0].n * sizeof(float)) == 0 &&
                   memcmp(r[k].m, r[0].m, r[0].n * sizeof(float)) == 0 &&
                   memcmp(r[k].v, r[0].v, r[0].n * sizeof(float)) == 0,
               "%s: weights or moments differ from fused", names[k]);
    }
    EXPECT(!isfinite(r[0].norm[3]) && isfinite(r[0].norm[4]), "step 4 should have a non-finite norm");
    printf(
        "fused adamw and norm: %d steps x %d micro-batches with frozen tensors and a skipped step, bitwise "
        "equal to %d per-tensor adamw and sumsq ops (losses %.6f .. %.6f)\n",
        FZ_STEPS, FZ_ACCUM, np, (double)r[0].loss[0], (double)r[0].loss[FZ_STEPS * FZ_ACCUM - 1]);
    for (int k = 0; k < 3; k++)
        free(r[k].w), free(r[k].m), free(r[k].v);
}

/* ---------------- fused classifier loss ---------------- */

enum { CE_STEPS = 4, CE_ACCUM = 2 };
typedef struct {
    float loss[CE_STEPS * CE_ACCUM], eval[CE_STEPS], norm[CE_STEPS];
    float *logits, *w, *m, *g; /* logits at one position; flat weights, moments, last gradients */
    size_t n;
    int n_fused, n_ce, n_ce_bwd;
    int n_res, n_fwd_add, n_ops; /* matmul_res and add ops in the forward; ops in all */
    size_t arena;
} ce_run_t;

/* Steps of CE_ACCUM micro-batches, an evaluation forward after each step (other ids), the loss scale
 * doubled at step 3 (another dloss), then a logits call and one more forward_backward whose gradients
 * are read. With `env` (may be NULL) set to 1 in the environment while the model is created. */
static void train_env(const char *env, int flags, ce_run_t *r) {
    memset(r, 0, sizeof *r);
    if (env) setenv(env, "1", 1);
    dg_model_t *m;
    OK(dg_model_create_ex(&small, be, 2, 4242, flags, &m));
    if (env) unsetenv(env);
    r->n_fused = count_ops(m, DG_OP_CROSSENTROPY_FUSED, DG_PHASE_FWD);
    r->n_ce = count_ops(m, DG_OP_CROSSENTROPY, DG_PHASE_FWD);
    r->n_ce_bwd = count_ops(m, DG_OP_CROSSENTROPY_BWD, DG_PHASE_BWD);
    r->n_res = count_ops(m, DG_OP_MATMUL_RES, DG_PHASE_FWD);
    r->n_fwd_add = count_ops(m, DG_OP_ADD, DG_PHASE_FWD);
    r->n_ops = dg_model_graph(m)->n;
    r->arena = dg_model_arena_bytes(m);
    EXPECT(dg_plan_check(dg_model_plan(m), dg_model_graph(m)) == DG_OK, "%s %d: plan check: %s",
           env ? env : "-", flags, dg_last_error());
    OK(dg_model_set_grad_accum(m, CE_ACCUM));
    size_t n = 2 * (size_t)small.seq_len;
    int32_t *tok = malloc(n * sizeof *tok), *tgt = malloc(n * sizeof *tgt);
    uint64_t s = 23;
    for (int st = 1; st <= CE_STEPS; st++) {
        const float scale = st == 3 ? 2.0f : 1.0f;
        OK(dg_model_zero_grad(m));
        for (int k = 0; k < CE_ACCUM; k++) {
            random_ids(tok, n, small.vocab_size, &s);
            random_ids(tgt, n, small.vocab_size, &s);
            OK(dg_model_forward_backward(m, tok, tgt, scale / (float)(CE_ACCUM * n),
                                         &r->loss[(st - 1) * CE_ACCUM + k]));
        }
        dg_optim_hparams_t h = gmodel_adamw(3e-3f, 0.1f, 1.0f, st);
        h.inv_loss_scale = 1.0f / scale;
        OK(dg_model_optimizer_step(m, &h, &r->norm[st - 1]));
        random_ids(tok, n, small.vocab_size, &s);
        random_ids(tgt, n, small.vocab_size, &s);
        OK(dg_model_forward(m, tok, tgt, &r->eval[st - 1])); /* validation: no backward follows */
    }
    r->logits = malloc(2 * (size_t)small.vocab_size * sizeof(float));
    OK(dg_model_logits(m, tok, small.seq_len - 1, r->logits));
    r->n = dg_model_flat_numel(m);
    r->w = gmodel_flat(m, DG_STATE_PARAM);
    r->m = gmodel_flat(m, DG_STATE_ADAM_M);
    r->g = malloc(r->n * sizeof(float));
    OK(dg_model_zero_grad(m));
    OK(dg_model_set_grad_accum(m, 1));
    float l;
    OK(dg_model_forward_backward(m, tok, tgt, 1.0f / (float)n, &l));
    OK(dg_model_get_flat(m, DG_STATE_GRAD, r->g));
    free(tok);
    free(tgt);
    dg_model_free(m);
}

/* how: 0 the default (fused), 1 DG_MODEL_UNFUSED_CE, 2 DG_TEST_UNFUSED_CE=1. */
static void ce_train(int how, int flags, ce_run_t *r) {
    train_env(how == 2 ? "DG_TEST_UNFUSED_CE" : NULL, flags | (how == 1 ? DG_MODEL_UNFUSED_CE : 0), r);
}

static void ce_free(ce_run_t *r) {
    free(r->logits), free(r->w), free(r->m), free(r->g);
}

/* crossentropy_fused (one op in the forward, over the logits) against the crossentropy + crossentropy_bwd
 * pair (model flag, environment hook), also with the GELU recomputed and without arena reuse: bitwise the
 * same micro-batch losses, evaluation losses, gradient norms, logits, weights, moments and gradients. */
static void test_ce_fused(void) {
    const int variants[][2] = {{0, 0},
                               {1, 0},
                               {2, 0},
                               {0, DG_MODEL_RECOMPUTE_GELU | DG_MODEL_NO_ARENA_REUSE},
                               {1, DG_MODEL_RECOMPUTE_GELU | DG_MODEL_NO_ARENA_REUSE}};
    const char *names[] = {"fused", "DG_MODEL_UNFUSED_CE", "DG_TEST_UNFUSED_CE=1",
                           "fused, recompute, no reuse", "unfused, recompute, no reuse"};
    ce_run_t ref, r;
    ce_train(0, 0, &ref);
    EXPECT(ref.n_fused == 1 && ref.n_ce == 0 && ref.n_ce_bwd == 0,
           "fused: %d crossentropy_fused, %d "
           "crossentropy, %d crossentropy_bwd ops",
           ref.n_fused, ref.n_ce, ref.n_ce_bwd);
    for (int v = 1; v < 5; v++) {
        ce_train(variants[v][0], variants[v][1], &r);
        int fused = variants[v][0] == 0;
        EXPECT(r.n_fused == fused && r.n_ce == !fused && r.n_ce_bwd == !fused,
               "%s: %d crossentropy_fused, %d crossentropy, %d crossentropy_bwd ops", names[v], r.n_fused,
               r.n_ce, r.n_ce_bwd);
        if (v <= 2)
            EXPECT(ref.arena <= r.arena, "%s: the fused loss needs more arena (%zu) than the pair (%zu)",
                   names[v], ref.arena, r.arena);
        EXPECT(memcmp(r.loss, ref.loss, sizeof ref.loss) == 0, "%s: micro-batch losses differ from fused",
               names[v]);
        EXPECT(memcmp(r.eval, ref.eval, sizeof ref.eval) == 0, "%s: evaluation losses differ from fused",
               names[v]);
        EXPECT(memcmp(r.norm, ref.norm, sizeof ref.norm) == 0, "%s: gradient norms differ from fused",
               names[v]);
        EXPECT(memcmp(r.logits, ref.logits, 2 * (size_t)small.vocab_size * sizeof(float)) == 0,
               "%s: logits differ from fused", names[v]);
        EXPECT(r.n == ref.n && memcmp(r.w, ref.w, ref.n * sizeof(float)) == 0 &&
                   memcmp(r.m, ref.m, ref.n * sizeof(float)) == 0,
               "%s: weights or moments differ from fused", names[v]);
        EXPECT(r.n == ref.n && memcmp(r.g, ref.g, ref.n * sizeof(float)) == 0,
               "%s: gradients differ from fused", names[v]);
        ce_free(&r);
    }
    EXPECT(ref.loss[CE_STEPS * CE_ACCUM - 1] < ref.loss[0] || ref.eval[CE_STEPS - 1] < ref.eval[0],
           "fused: the loss should fall");
    printf(
        "fused cross-entropy: %d steps x %d micro-batches with evaluations, a loss-scale change and logits, "
        "bitwise equal to the unfused pair (losses %.6f .. %.6f; arena %zu bytes)\n",
        CE_STEPS, CE_ACCUM, (double)ref.loss[0], (double)ref.loss[CE_STEPS * CE_ACCUM - 1], ref.arena);
    ce_free(&ref);
}

/* Bitwise the same training as `ref` (micro-batch and evaluation losses, gradient norms, logits, weights,
 * moments, gradients). */
static void expect_same_run(const ce_run_t *ref, const ce_run_t *r, const char *what) {
    EXPECT(memcmp(r->loss, ref->loss, sizeof ref->loss) == 0, "%s: micro-batch losses differ", what);
    EXPECT(memcmp(r->eval, ref->eval, sizeof ref->eval) == 0, "%s: evaluation losses differ", what);
    EXPECT(memcmp(r->norm, ref->norm, sizeof ref->norm) == 0, "%s: gradient norms differ", what);
    EXPECT(memcmp(r->logits, ref->logits, 2 * (size_t)small.vocab_size * sizeof(float)) == 0,
           "%s: logits differ", what);
    EXPECT(r->n == ref->n && memcmp(r->w, ref->w, ref->n * sizeof(float)) == 0 &&
               memcmp(r->m, ref->m, ref->n * sizeof(float)) == 0,
           "%s: weights or moments differ", what);
    EXPECT(r->n == ref->n && memcmp(r->g, ref->g, ref->n * sizeof(float)) == 0, "%s: gradients differ", what);
}

/* The residual adds fused into the linear layers before them (matmul_res, pass fuse_residual) against the
 * matmul + add pairs (model flag, environment hook), also with the other fusions off, the GELU recomputed
 * and no arena reuse: exactly the 2 * n_layer residual adds are fused, the arena does not grow, and the
 * training is bitwise the same (losses, evaluation losses, gradient norms, logits, weights, moments,
 * gradients). */
static void test_res_fused(void) {
    const struct {
        const char *env;
        int flags, fused;
        const char *name;
    } v[] = {
        {NULL, DG_MODEL_UNFUSED_RESID, 0, "DG_MODEL_UNFUSED_RESID"},
        {"DG_TEST_UNFUSED_RESID", 0, 0, "DG_TEST_UNFUSED_RESID=1"},
        {NULL, DG_MODEL_UNFUSED_CE | DG_MODEL_UNFUSED_GELU_BWD, 1, "fused, the other fusions off"},
        {NULL, DG_MODEL_UNFUSED_RESID | DG_MODEL_UNFUSED_CE | DG_MODEL_UNFUSED_GELU_BWD, 0,
         "unfused, the other fusions off"},
        {NULL, DG_MODEL_RECOMPUTE_GELU | DG_MODEL_NO_ARENA_REUSE, 1, "fused, recompute, no reuse"},
        {NULL, DG_MODEL_UNFUSED_RESID | DG_MODEL_RECOMPUTE_GELU | DG_MODEL_NO_ARENA_REUSE, 0,
         "unfused, recompute, no reuse"},
    };
    const int L = small.n_layer;
    ce_run_t ref, r;
    train_env(NULL, 0, &ref);
    EXPECT(ref.n_res == 2 * L && ref.n_fwd_add == 0,
           "fused: %d matmul_res, %d add ops in the forward (want %d, 0)", ref.n_res, ref.n_fwd_add, 2 * L);
    for (size_t k = 0; k < sizeof v / sizeof v[0]; k++) {
        train_env(v[k].env, v[k].flags, &r);
        EXPECT(r.n_res == (v[k].fused ? 2 * L : 0) && r.n_fwd_add == (v[k].fused ? 0 : 2 * L),
               "%s: %d matmul_res, %d add ops in the forward", v[k].name, r.n_res, r.n_fwd_add);
        if (k < 2) {
            EXPECT(r.n_ops == ref.n_ops + 2 * L, "%s: %d ops, the fused graph %d: expected %d more",
                   v[k].name, r.n_ops, ref.n_ops, 2 * L);
            EXPECT(ref.arena <= r.arena, "%s: the fused graph needs more arena (%zu) than the pairs (%zu)",
                   v[k].name, ref.arena, r.arena);
        }
        expect_same_run(&ref, &r, v[k].name);
        ce_free(&r);
    }
    printf(
        "fused residual adds: %d of them, training bitwise equal to the matmul + add pairs (losses %.6f .. "
        "%.6f; arena %zu bytes)\n",
        ref.n_res, (double)ref.loss[0], (double)ref.loss[CE_STEPS * CE_ACCUM - 1], ref.arena);
    ce_free(&ref);
}

/* Initialisation: GPT-2 statistics, padded rows zero, and independence of the micro-batch. */
static void test_init(void) {
    dg_model_desc_t d = {
        .n_layer = 4, .n_head = 4, .d_model = 64, .seq_len = 32, .vocab_size = 250, .padded_vocab = 256};
    dg_model_t *m, *m2;
    OK(dg_model_create(&d, be, 1, 7, &m));
    OK(dg_model_create(&d, be, 3, 7, &m2));
    for (int i = 0; i < dg_model_n_tensors(m); i++) {
        const dg_param_info_t *pi = dg_model_param(m, i);
        float *h = malloc(pi->numel * sizeof *h), *h2 = malloc(pi->numel * sizeof *h);
        OK(dg_model_get_tensor(m, i, DG_STATE_PARAM, h));
        OK(dg_model_get_tensor(m2, i, DG_STATE_PARAM, h2));
        EXPECT(memcmp(h, h2, pi->numel * sizeof *h) == 0, "%s: init depends on micro_batch", pi->name);
        size_t n = pi->numel;
        if (!strcmp(pi->name, "wte")) {
            size_t nz = 0;
            for (size_t e = 250 * 64; e < n; e++)
                nz += h[e] != 0;
            EXPECT(nz == 0, "wte padded rows must start at zero");
            n = 250 * 64;
        }
        double s1 = 0, s2 = 0;
        for (size_t e = 0; e < n; e++)
            s1 += h[e], s2 += (double)h[e] * h[e];
        double mean = s1 / (double)n, sd = sqrt(s2 / (double)n - mean * mean);
        double want = -1;
        if (strstr(pi->name, "proj.weight"))
            want = 0.02 / sqrt(8.0);
        else if (pi->ndim == 2)
            want = 0.02;
        if (want > 0)
            EXPECT(fabs(sd - want) < 0.1 * want && fabs(mean) < 0.1 * want,
                   "%s: std %.5f (want %.5f), mean %.2g", pi->name, sd, want, mean);
        else if (strstr(pi->name, "ln_") && strstr(pi->name, ".weight"))
            EXPECT(mean == 1.0 && sd == 0.0, "%s: layernorm gains start at 1", pi->name);
        else
            EXPECT(mean == 0.0 && sd == 0.0, "%s: biases start at 0", pi->name);
        free(h), free(h2);
    }
    dg_model_free(m);
    dg_model_free(m2);
}

/* ---------------- kernel launches per step ---------------- */

/* One real step (zero_grad, accum micro-batches, AdamW) of a fresh model: the executor's launches, and the
 * losses of the micro-batches. */
static uint64_t step_launches(dg_model_t *m, int accum, float *loss) {
    size_t T = (size_t)small.seq_len;
    int32_t tok[3 * 2 * 16], tgt[3 * 2 * 16];
    uint64_t s = 77;
    random_ids(tok, (size_t)accum * 2 * T, small.vocab_size, &s);
    random_ids(tgt, (size_t)accum * 2 * T, small.vocab_size, &s);
    OK(dg_model_set_grad_accum(m, accum));
    uint64_t k0 = dg_model_exec(m)->kernels_run;
    OK(dg_model_zero_grad(m));
    for (int j = 0; j < accum; j++)
        OK(dg_model_forward_backward(m, tok + (size_t)j * 2 * T, tgt + (size_t)j * 2 * T,
                                     1.0f / (float)(accum * 2 * T), &loss[j]));
    dg_optim_hparams_t h = gmodel_adamw(1e-3f, 0.0f, 1.0f, 1);
    float norm;
    OK(dg_model_optimizer_step(m, &h, &norm));
    return dg_model_exec(m)->kernels_run - k0;
}

static void test_kernel_counts(void) {
    const int flags[2] = {0, DG_MODEL_RECOMPUTE_SELECTIVE};
    for (int fi = 0; fi < 2; fi++) {
        for (int accum = 1; accum <= 3; accum += 2) {
            dg_model_t *m, *u;
            OK(dg_model_create_ex(&small, be, 2, 5, flags[fi], &m));
            OK(dg_model_create_ex(&small, be, 2, 5, flags[fi] | DG_MODEL_NO_FUSION, &u));
            float lm[3], lu[3];
            uint64_t run_m = step_launches(m, accum, lm), run_u = step_launches(u, accum, lu);
            int64_t est_u = 0, est_uu = 0;
            OK(dg_model_unfused_kernels_per_step(m, 0, &est_u));
            OK(dg_model_unfused_kernels_per_step(u, 0, &est_uu));
            EXPECT((int64_t)run_m == dg_model_kernels_per_step(m, 0),
                   "flags %d accum %d: the step launched %llu kernels, kernels_per_step says %lld", flags[fi],
                   accum, (unsigned long long)run_m, (long long)dg_model_kernels_per_step(m, 0));
            EXPECT((int64_t)run_u == dg_model_kernels_per_step(u, 0) && est_u == (int64_t)run_u &&
                       est_uu == est_u,
                   "flags %d accum %d: the unfused step launched %llu kernels; counted %lld, estimated %lld "
                   "from the fused model",
                   flags[fi], accum, (unsigned long long)run_u, (long long)dg_model_kernels_per_step(u, 0),
                   (long long)est_u);
            EXPECT(run_u > run_m, "flags %d: the fusions saved no launch (%llu vs %llu)", flags[fi],
                   (unsigned long long)run_u, (unsigned long long)run_m);
            for (int j = 0; j < accum; j++)
                EXPECT(lm[j] == lu[j], "micro-batch %d: unfused loss %.9g != fused %.9g", j, (double)lu[j],
                       (double)lm[j]);
            if (accum == 3)
                printf("kernels per step (flags %d, accum 3): %llu fused, %llu unfused (ratio %.2f)\n",
                       flags[fi], (unsigned long long)run_m, (unsigned long long)run_u,
                       (double)run_u / (double)run_m);
            dg_model_free(m);
            dg_model_free(u);
        }
    }
}

int main(void) {
    dg_backend_config_t bc = {.act_dtype = DG_F32};
    OK(dg_backend_cpu_create(&bc, &be));
    double t0 = dg_now_s();
    test_desc();
    test_init();
    test_gradients(0);
    test_gradients(DG_MODEL_RECOMPUTE_GELU);
    test_gradients(DG_MODEL_UNFUSED_GELU_BWD);
    test_accumulation();
    test_overfit();
    test_determinism();
    test_gelu_variants();
    test_recompute_levels();
    test_print();
    test_errors();
    test_skip_and_freeze();
    test_adamw_fused();
    test_ce_fused();
    test_res_fused();
    test_kernel_counts();
    dg_backend_free(be);
    printf("model tests took %.1f s\n", dg_now_s() - t0);
    return dg_check_done("model");
}
