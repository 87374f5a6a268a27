/* test_graph_planner.c — the activation memory planner.
 *  1. dg_plan_intervals on random interval sets: no two simultaneously-live buffers overlap, offsets
 *     aligned, arena <= sum of sizes and >= the peak of live bytes; plus exact small cases.
 *  2. Random graphs (random ops, several consumers, autodiff): dg_plan_check passes, and running with the
 *     planned arena gives bitwise the same outputs and gradients as running with no reuse at all, both
 *     arenas poisoned with NaN first (a read of memory that was never written shows up).
 *  3. Model graphs (tiny and gpt2-124m, plan only): plan check passes and the arena is well below the
 *     sum of activation sizes.
 *     The fused classifier loss: dlogits over the logits, no more arena than the unfused pair.
 *  4. The executor refuses (aborts on) a plan made before the graph changed.
 */
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dg_model.h"
#include "graph.h"
#include "ref64.h"
#include "gtest.h"

static size_t up(size_t x) {
    return (x + 255) / 256 * 256;
}

/* ---------------- 1. intervals ---------------- */

static void check_intervals(int n, const size_t *size, const int *st, const int *en, const char *what,
                            size_t *arena_out) {
    size_t *off = malloc(((size_t)n + 1) * sizeof *off);
    size_t arena = dg_plan_intervals(n, size, st, en, 256, off);
    size_t sum = 0;
    int maxpos = 0;
    for (int i = 0; i < n; i++) {
        sum += up(size[i] ? size[i] : 1);
        if (en[i] > maxpos) maxpos = en[i];
        EXPECT(off[i] % 256 == 0, "%s: offset %zu of buffer %d not aligned", what, off[i], i);
        EXPECT(off[i] + size[i] <= arena, "%s: buffer %d exceeds the arena", what, i);
        for (int j = 0; j < i; j++) {
            if (en[i] < st[j] || en[j] < st[i]) continue;
            int disjoint = off[i] + size[i] <= off[j] || off[j] + size[j] <= off[i];
            EXPECT(disjoint, "%s: buffers %d [%d,%d] and %d [%d,%d] are live together and overlap", what, i,
                   st[i], en[i], j, st[j], en[j]);
        }
    }
    EXPECT(arena <= sum, "%s: arena %zu exceeds the sum of sizes %zu", what, arena, sum);
    size_t peak = 0;
    for (int p = 0; p <= maxpos; p++) {
        size_t live = 0;
        for (int i = 0; i < n; i++)
            if (st[i] <= p && p <= en[i]) live += size[i];
        if (live > peak) peak = live;
    }
    EXPECT(arena >= peak, "%s: arena %zu below the peak of live bytes %zu (impossible without overlap)", what,
           arena, peak);
    if (arena_out) *arena_out = arena;
    free(off);
}

static void test_intervals(void) {
    size_t a;
    check_intervals(0, NULL, NULL, NULL, "empty", &a);
    EXPECT(a == 0, "empty plan should need no arena");
    /* disjoint in time: everything shares offset 0 */
    size_t s1[4] = {1000, 300, 5000, 256};
    int st1[4] = {0, 2, 4, 6}, en1[4] = {1, 3, 5, 7};
    check_intervals(4, s1, st1, en1, "disjoint", &a);
    EXPECT(a == up(5000), "disjoint lifetimes should need only the largest buffer, got %zu", a);
    /* all live together: the sum */
    int st2[4] = {0, 0, 0, 0}, en2[4] = {5, 5, 5, 5};
    check_intervals(4, s1, st2, en2, "overlapping", &a);
    EXPECT(a == up(1000) + up(300) + up(5000) + up(256), "all-live plan should be the aligned sum, got %zu",
           a);

    uint64_t rng = 7;
    double worst = 0;
    for (int trial = 0; trial < 300; trial++) {
        int n = 1 + (int)(ref_rng_next(&rng) % 80);
        size_t *size = malloc((size_t)n * sizeof *size);
        int *st = malloc((size_t)n * sizeof *st), *en = malloc((size_t)n * sizeof *en);
        for (int i = 0; i < n; i++) {
            size[i] = ref_rng_next(&rng) % 3 == 0 ? (size_t)(ref_rng_next(&rng) % 1000000)
                                                  : (size_t)(ref_rng_next(&rng) % 5000);
            st[i] = (int)(ref_rng_next(&rng) % 60);
            en[i] = st[i] + (int)(ref_rng_next(&rng) % 25);
        }
        char what[32];
        snprintf(what, sizeof what, "random trial %d", trial);
        check_intervals(n, size, st, en, what, &a);
        size_t sum = 0;
        for (int i = 0; i < n; i++)
            sum += up(size[i] ? size[i] : 1);
        if (sum && (double)a / (double)sum > worst) worst = (double)a / (double)sum;
        free(size), free(st), free(en);
    }
    printf("intervals: 300 random sets ok (worst arena/sum %.2f)\n", worst);
}

/* ---------------- 2. random graphs ---------------- */

static void poison(dg_backend_t *be, dg_exec_t *ex) {
    size_t n = ex->plan->arena_bytes;
    if (!n) return;
    unsigned char *h = malloc(n);
    memset(h, 0xff, n); /* every float reads as NaN */
    OK(be->ops->to_device(be, ex->arena, h, n));
    free(h);
}

static void test_random_graphs(dg_backend_t *be) {
    uint64_t rng = 99;
    int total_nodes = 0;
    for (int trial = 0; trial < 25; trial++) {
        dg_graph_t *g = dg_graph_create(be);
        int64_t sx[2] = {4, 8}, sw[2] = {8, 8}, sc[1] = {8};
        dg_node_t *pool[64];
        int np = 0;
        dg_node_t *inputs[2], *params[6];
        uint64_t hr = rng;
        inputs[0] = pool[np++] = dg_graph_leaf(g, "x0", DG_F32, 2, sx, DG_NF_INPUT | DG_NF_WANT_GRAD);
        inputs[1] = pool[np++] = dg_graph_leaf(g, "x1", DG_F32, 2, sx, DG_NF_INPUT | DG_NF_WANT_GRAD);
        char nm[32];
        for (int k = 0; k < 4; k++) {
            snprintf(nm, sizeof nm, "w%d", k);
            params[k] = dg_graph_param(g, nm, 2, sw);
        }
        params[4] = dg_graph_param(g, "lnw", 1, sc);
        params[5] = dg_graph_param(g, "lnb", 1, sc);
        int nops = 6 + (int)(ref_rng_next(&rng) % 20);
        for (int k = 0; k < nops; k++) {
            /* prefer recent tensors but reach back often, so tensors get several consumers */
            dg_node_t *a = pool[np - 1 - (int)(ref_rng_next(&rng) % (uint64_t)(np < 4 ? np : 4))];
            dg_node_t *b = pool[ref_rng_next(&rng) % (uint64_t)np];
            snprintf(nm, sizeof nm, "op%d", k);
            dg_node_t *y = NULL;
            switch (ref_rng_next(&rng) % 5) {
            case 0:
                y = dg_op_gelu(g, nm, a);
                break;
            case 1:
                y = dg_op_add(g, nm, a, b);
                break;
            case 2:
                y = dg_op_matmul(g, nm, a, params[ref_rng_next(&rng) % 4], NULL);
                break;
            case 3:
                y = dg_op_layernorm(g, nm, a, params[4], params[5]);
                break;
            default:
                y = dg_op_matmul(g, nm, b, params[ref_rng_next(&rng) % 4], NULL);
                break;
            }
            OK(dg_graph_error(g));
            pool[np++] = y;
        }
        dg_node_t *outs[2] = {pool[np - 1], pool[np - 2]}, *seeds[2];
        seeds[0] = dg_graph_leaf(g, "seed0", DG_F32, 2, sx, DG_NF_INPUT);
        seeds[1] = dg_graph_leaf(g, "seed1", DG_F32, 2, sx, DG_NF_INPUT);
        int nout = 2;
        OK(dg_autodiff(g, nout, outs, seeds));
        for (int k = 0; k < nout; k++)
            outs[k]->flags |= DG_NF_OUTPUT;
        dg_pass_t passes[] = {{"inplace", dg_pass_inplace, NULL}};
        OK(dg_graph_run_passes(g, passes, 1));
        dg_memplan_t *pa, *pb;
        OK(dg_plan_create(g, 0, &pa));
        OK(dg_plan_create(g, DG_PLAN_NO_REUSE, &pb));
        OK(dg_plan_check(pa, g));
        OK(dg_plan_check(pb, g));
        EXPECT(pa->arena_bytes <= pb->arena_bytes, "trial %d: planned arena %zu > no-reuse %zu", trial,
               pa->arena_bytes, pb->arena_bytes);
        /* the live peak, counted position by position: no arena is smaller, both plans agree on it */
        size_t brute = 0;
        for (int pos = 0; pos < g->n; pos++) {
            size_t live = 0;
            for (int i = 0; i < g->n; i++)
                if (pa->offset[i] != SIZE_MAX && pa->live_start[i] <= pos && pos <= pa->live_end[i]) {
                    size_t b = g->nodes[i]->nbytes ? g->nodes[i]->nbytes : 1;
                    live += (b + DG_ARENA_ALIGN - 1) / DG_ARENA_ALIGN * DG_ARENA_ALIGN;
                }
            if (live > brute) brute = live;
        }
        EXPECT(pa->live_peak_bytes == brute && pb->live_peak_bytes == brute && brute <= pa->arena_bytes,
               "trial %d: live peak %zu / %zu, counted %zu, arena %zu", trial, pa->live_peak_bytes,
               pb->live_peak_bytes, brute, pa->arena_bytes);
        dg_alloc_list_t al = {0};
        OK(dg_graph_alloc_persistent(g, be, &al));
        for (int i = 0; i < g->n; i++) { /* random data in every float leaf */
            dg_node_t *l = g->nodes[i];
            if (l->op != DG_OP_LEAF || l->dtype != DG_F32 || (l->flags & DG_NF_GRAD)) continue;
            float *h = malloc(l->nbytes);
            ref_fill(h, dg_node_numel(l), -1, 1, &hr);
            OK(be->ops->to_device(be, l->data, h, l->nbytes));
            free(h);
        }
        /* results to compare: outputs, input gradients, parameter gradients */
        const dg_node_t *res[16];
        int nres = 0;
        for (int k = 0; k < nout; k++)
            res[nres++] = outs[k];
        for (int k = 0; k < 2; k++)
            if (dg_node_grad_of(inputs[k])) res[nres++] = dg_node_grad_of(inputs[k]);
        for (int k = 0; k < 6; k++)
            res[nres++] = params[k]->grad;
        float *out[2][16];
        dg_memplan_t *plans[2] = {pa, pb};
        for (int v = 0; v < 2; v++) {
            dg_exec_t *ex;
            OK(dg_exec_create(be, g, plans[v], &ex));
            poison(be, ex);
            for (int k = 0; k < 6; k++)
                OK(be->ops->memset0(be, params[k]->grad->data, params[k]->grad->nbytes));
            OK(dg_exec_run_phase(ex, DG_PHASE_FWD));
            OK(dg_exec_run_phase(ex, DG_PHASE_BWD));
            for (int r = 0; r < nres; r++) {
                out[v][r] = malloc(res[r]->nbytes);
                OK(be->ops->to_host(be, out[v][r], dg_exec_ptr(ex, res[r]), res[r]->nbytes));
            }
            dg_exec_free(ex);
        }
        for (int r = 0; r < nres; r++) {
            size_t n = dg_node_numel(res[r]), nonfinite = 0;
            for (size_t i = 0; i < n; i++)
                nonfinite += !isfinite(out[1][r][i]);
            EXPECT(nonfinite == 0, "trial %d: '%s' has %zu non-finite values (read of unwritten memory?)",
                   trial, res[r]->name, nonfinite);
            EXPECT(memcmp(out[0][r], out[1][r], res[r]->nbytes) == 0,
                   "trial %d: '%s' differs between the planned arena and no reuse", trial, res[r]->name);
            free(out[0][r]), free(out[1][r]);
        }
        total_nodes += g->n;
        dg_plan_free(pa);
        dg_plan_free(pb);
        dg_graph_free_persistent(be, &al);
        dg_graph_free(g);
    }
    printf("random graphs: 25 graphs (%d nodes) planned, checked, and bitwise equal to no-reuse runs\n",
           total_nodes);
}

/* ---------------- 3. model graphs ---------------- */

static void test_model_plans(dg_backend_t *be) {
    const char *presets[] = {"tiny", "gpt2-124m"};
    int mbs[] = {8, 4};
    /* the schedule as built (fused GELU backward), and the unfused one: matmul_bwd + gelu_bwd keep one
     * more [N, 4C] gradient per layer in the sum of activations, which the planner must reuse */
    for (int v = 0; v < 4; v++) {
        int k = v / 2, unfused = v % 2;
        int flags = DG_MODEL_PLAN_ONLY | (unfused ? DG_MODEL_UNFUSED_GELU_BWD : 0);
        dg_model_desc_t d;
        OK(dg_model_desc_preset(presets[k], &d));
        dg_model_t *m;
        OK(dg_model_create_ex(&d, be, mbs[k], 1, flags, &m));
        const dg_memplan_t *p = dg_model_plan(m);
        dg_status_t st = dg_plan_check(p, dg_model_graph(m));
        EXPECT(st == DG_OK, "%s: plan check failed: %s", presets[k], dg_last_error());
        size_t arena = dg_model_arena_bytes(m), sum = dg_model_activation_bytes_sum(m);
        /* lower bound: the most bytes live at one schedule position (most activations must survive from
         * the forward to their backward, so the bound itself is a large part of the sum) */
        const dg_graph_t *g = dg_model_graph(m);
        size_t peak = 0;
        for (int pos = 0; pos <= g->n; pos++) {
            size_t live = 0;
            for (int i = 0; i < g->n; i++)
                if (p->offset[i] != SIZE_MAX && p->live_start[i] <= pos && pos <= p->live_end[i])
                    live += g->nodes[i]->nbytes;
            if (live > peak) peak = live;
        }
        EXPECT(arena >= peak && arena <= peak + peak / 20,
               "%s: arena %zu should be within 5%% above the peak of live bytes %zu", presets[k], arena,
               peak);
        /* the fused schedule has fewer, larger-lived tensors: its sum is closer to its peak */
        EXPECT(arena < (unfused ? sum * 3 / 4 : sum * 9 / 10),
               "%s: arena %zu should be well below the activation sum %zu", presets[k], arena, sum);
        printf("%s (micro_batch %d, %s GELU backward): %d ops, arena %.1f MiB = %.1f%% of the %.1f MiB sum "
               "of activations, "
               "%.2fx the peak live %.1f MiB\n",
               presets[k], mbs[k], unfused ? "unfused" : "fused", dg_model_n_ops(m), arena / 1048576.0,
               100.0 * (double)arena / (double)sum, sum / 1048576.0, (double)arena / (double)peak,
               peak / 1048576.0);
        dg_model_free(m);
    }
}

/* ---------------- 3b. what the GELU backward fusion and recompute save ---------------- */

/* The CUDA backend's attention scratch (one f32 logsumexp per row and head); used to plan the model as
 * the GPU would run it, without a GPU. */
static size_t cuda_like_aux_bytes(dg_backend_t *be, int B, int T, int C, int NH) {
    (void)be;
    (void)C;
    return (size_t)B * NH * T * sizeof(float);
}

/* The gpt2-124m plans at micro-batch GPT2_PLAN_B x 1024 are made on two backends: bes[0] the CPU backend
 * (f32; its attention keeps the full probability matrix), bes[1] a bf16 one with the CUDA backend's
 * attention scratch (the GPU's arena); gpt2_plan_what names them. gpt2_plans fills one (it must not move
 * afterwards: bes[1] points into it). */
typedef struct {
    dg_backend_ops_t ops16;
    dg_backend_t be16;
    dg_backend_t *bes[2];
    dg_model_desc_t d;
} gpt2_plans_t;
enum { GPT2_PLAN_B = 32 };
static const char *const gpt2_plan_what[2] = {"cpu f32", "bf16, CUDA attention scratch"};

static void gpt2_plans(gpt2_plans_t *gp, dg_backend_t *cpu) {
    gp->ops16 = *cpu->ops;
    gp->ops16.attention_aux_bytes = cuda_like_aux_bytes;
    gp->be16 = (dg_backend_t){&gp->ops16, DG_BF16, cpu->impl, 0};
    gp->bes[0] = cpu;
    gp->bes[1] = &gp->be16;
    OK(dg_model_desc_preset("gpt2-124m", &gp->d));
}

/* The plan-only model on gp's backend b with `flags`, its plan checked (a failure names `label`) */
static dg_model_t *gpt2_plan(const gpt2_plans_t *gp, int b, int flags, const char *label) {
    dg_model_t *m;
    OK(dg_model_create_ex(&gp->d, gp->bes[b], GPT2_PLAN_B, 1, flags | DG_MODEL_PLAN_ONLY, &m));
    EXPECT(dg_plan_check(dg_model_plan(m), dg_model_graph(m)) == DG_OK, "%s: plan check: %s", label,
           dg_last_error());
    return m;
}

/* gpt2-124m at micro-batch 32 x 1024, plan only: the CPU backend's plan (f32; its attention keeps the
 * full probability matrix) and a bf16 plan with the CUDA backend's attention scratch (the GPU's arena).
 * Recompute must save at least (L - 1) GELU outputs of [B*T, 4C] (the last layer's backward starts while
 * its recomputed copy is live); the fused backward must not need more than the unfused one. */
static void test_gelu_memory(dg_backend_t *cpu) {
    gpt2_plans_t gp;
    gpt2_plans(&gp, cpu);
    const char *const *what = gpt2_plan_what;
    const int flags[3] = {DG_MODEL_UNFUSED_GELU_BWD, 0, DG_MODEL_RECOMPUTE_GELU};
    const char *fname[3] = {"unfused gelu_bwd", "fused matmul_bwd_dgelu", "fused + recompute gelu"};
    const dg_model_desc_t d = gp.d;
    const int B = GPT2_PLAN_B;
    for (int b = 0; b < 2; b++) {
        size_t arena[3];
        for (int f = 0; f < 3; f++) {
            char label[96];
            snprintf(label, sizeof label, "%s %s", what[b], fname[f]);
            dg_model_t *m = gpt2_plan(&gp, b, flags[f], label);
            arena[f] = dg_model_arena_bytes(m);
            printf("gpt2-124m micro_batch %d, %s, %s: arena %zu bytes (%.2f GiB), %d ops\n", B, what[b],
                   fname[f], arena[f], arena[f] / 1073741824.0, dg_model_n_ops(m));
            dg_model_free(m);
        }
        size_t es = b ? 2 : 4, gelu_out = (size_t)B * d.seq_len * 4 * d.d_model * es;
        EXPECT(arena[1] <= arena[0], "%s: the fused backward needs more arena (%zu) than the unfused (%zu)",
               what[b], arena[1], arena[0]);
        EXPECT(arena[1] - arena[2] >= (size_t)(d.n_layer - 1) * gelu_out,
               "%s: recompute saves %zd bytes, expected at least %d GELU outputs of %zu", what[b],
               (ssize_t)(arena[1] - arena[2]), d.n_layer - 1, gelu_out);
        printf("  %s: fused saves %.3f GiB, recompute another %.3f GiB (%.1f GELU outputs of %.3f GiB)\n",
               what[b], (double)(arena[0] - arena[1]) / 1073741824.0,
               (double)(arena[1] - arena[2]) / 1073741824.0, (double)(arena[1] - arena[2]) / (double)gelu_out,
               gelu_out / 1073741824.0);
    }
}

/* ---------------- 3c/3d. fusions that must not grow the arena ---------------- */

/* The graph checks of one fusion: called for the fused (fused = 1) and the unfused model of each backend. */
typedef void (*fuse_check_t)(const char *what, int fused, const dg_model_desc_t *d, const dg_graph_t *g,
                             const dg_memplan_t *p);

/* gpt2-124m at micro-batch 32 x 1024, plan only, on the f32 CPU plan and the bf16 CUDA-like one: the model
 * with the fusion (default) and with `unfused_flag`; each plan checks out, `check` looks at each graph, and
 * the fused arena is no larger than the unfused one. */
static void fused_arena(dg_backend_t *cpu, int unfused_flag, const char *fused_name, const char *pair_name,
                        fuse_check_t check) {
    gpt2_plans_t gp;
    gpt2_plans(&gp, cpu);
    const char *const *what = gpt2_plan_what;
    const dg_model_desc_t d = gp.d;
    const int B = GPT2_PLAN_B;
    for (int b = 0; b < 2; b++) {
        size_t arena[2];
        for (int f = 0; f < 2; f++) {
            dg_model_t *m = gpt2_plan(&gp, b, f ? unfused_flag : 0, what[b]);
            const dg_graph_t *g = dg_model_graph(m);
            const dg_memplan_t *p = dg_model_plan(m);
            arena[f] = dg_model_arena_bytes(m);
            check(what[b], f == 0, &d, g, p);
            dg_model_free(m);
        }
        EXPECT(arena[0] <= arena[1], "%s: %s need more arena (%zu) than %s (%zu)", what[b], fused_name,
               arena[0], pair_name, arena[1]);
        printf("gpt2-124m micro_batch %d, %s: arena %.3f GiB with %s, %.3f GiB with %s\n", B, what[b],
               arena[0] / 1073741824.0, fused_name, arena[1] / 1073741824.0, pair_name);
    }
}

/* The fused classifier loss: its dlogits lies over the logits (one [B*T, Vp] buffer, live from lm_head's
 * forward to its backward), and the arena is no larger than with the crossentropy + crossentropy_bwd
 * pair. */
static void ce_check(const char *what, int fused, const dg_model_desc_t *d, const dg_graph_t *g,
                     const dg_memplan_t *p) {
    (void)d;
    if (!fused) return;
    const dg_node_t *ce = NULL, *head_bwd = NULL;
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *x = g->nodes[i];
        if (x->op == DG_OP_CROSSENTROPY_FUSED) ce = x;
        if (x->op == DG_OP_MATMUL_BWD && !head_bwd) head_bwd = x; /* the first: lm_head's */
    }
    EXPECT(ce && ce->view_src == ce->src[0] && head_bwd && head_bwd->src[0] == ce &&
               p->live_end[ce->src[0]->id] == head_bwd->id,
           "%s: dlogits must lie over the logits and live until lm_head's backward", what);
}

/* The fused residual adds: all 24 go into attn.proj / mlp.proj (matmul_res), and the arena is no larger
 * than with the matmul + add pairs (each pair's [B*T, C] product was dead after its add, which the
 * inplace pass laid over it). */
static void res_check(const char *what, int fused, const dg_model_desc_t *d, const dg_graph_t *g,
                      const dg_memplan_t *p) {
    (void)p;
    int nres = 0, nadd = 0;
    for (int i = 0; i < g->n; i++) {
        nres += g->nodes[i]->op == DG_OP_MATMUL_RES;
        nadd += g->nodes[i]->op == DG_OP_ADD && g->nodes[i]->phase == DG_PHASE_FWD;
    }
    const int want_res = fused ? 2 * d->n_layer : 0, want_add = fused ? 0 : 2 * d->n_layer;
    EXPECT(nres == want_res && nadd == want_add, "%s, %s: %d matmul_res / %d add (want %d / %d)", what,
           fused ? "fused" : "unfused", nres, nadd, want_res, want_add);
}

static void test_ce_memory(dg_backend_t *cpu) {
    fused_arena(cpu, DG_MODEL_UNFUSED_CE, "the fused loss", "the pair", ce_check);
}

static void test_res_memory(dg_backend_t *cpu) {
    fused_arena(cpu, DG_MODEL_UNFUSED_RESID, "the fused residual adds", "the pairs", res_check);
}

/* ---------------- 4. stale plans abort ---------------- */

static void test_stale_abort(dg_backend_t *be) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        dg_graph_t *g = dg_graph_create(be);
        int64_t s[2] = {2, 2};
        dg_node_t *x = dg_graph_leaf(g, "x", DG_F32, 2, s, DG_NF_INPUT);
        dg_node_t *y = dg_op_gelu(g, "y", x);
        y->flags |= DG_NF_OUTPUT;
        dg_memplan_t *p;
        dg_alloc_list_t al = {0};
        dg_exec_t *ex;
        if (dg_plan_create(g, 0, &p) || dg_graph_alloc_persistent(g, be, &al) ||
            dg_exec_create(be, g, p, &ex))
            _exit(3);
        if (dg_exec_run_phase(ex, DG_PHASE_FWD)) _exit(4);
        freopen("/dev/null", "w", stderr); /* the expected assertion message */
        dg_op_gelu(g, "z", y);             /* the graph changes: the plan is stale */
        dg_exec_run_phase(ex, DG_PHASE_FWD);
        _exit(0); /* must not get here */
    }
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT,
           "running a stale plan must abort (assert); child status 0x%x", status);
}

int main(void) {
    dg_backend_config_t bc = {.act_dtype = DG_F32};
    dg_backend_t *be = NULL;
    OK(dg_backend_cpu_create(&bc, &be));
    test_intervals();
    test_random_graphs(be);
    test_model_plans(be);
    test_gelu_memory(be);
    test_ce_memory(be);
    test_res_memory(be);
    test_stale_abort(be);
    dg_backend_free(be);
    return dg_check_done("planner");
}
