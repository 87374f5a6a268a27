/* test_pipeline.c — the pipeline schedules, validator, simulator and stage split (src/pipeline).
 * Cases:
 *   schedules: 1F1B and interleaved (virtual 2) for p in {2, 4, 8}, m in {p, 2p, 3p + 1} validate;
 *     every rank has 2 m v compute actions; the in-flight bound of 1F1B (stage s holds <= p - s
 *     micro-batches) and the simulated bubble with uniform costs against theory: 1F1B exactly
 *     (p - 1) / (m + p - 1); interleaved below 1F1B's for the same p and m.
 *   validator: broken lists are refused with the reason (a missing receive, messages out of order,
 *     a backward before its forward, a deadlock under blocking point-to-point).
 *   split: on a skewed model (the lm_head of a large vocabulary costs several blocks) the last stage
 *     gets fewer blocks than the others and the largest stage is within one block of the best possible;
 *     block count alone would be worse. Interleaved needs layers divisible by pp x virtual; pp > layers
 *     is refused; a memory budget moves blocks off the first stage.
 *   svg: the timeline has one box per compute action.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dg_check.h"
#include "dg_mesh.h"
#include "pipeline.h"

static void uniform_costs(const dg_pp_schedule_t *s, double f, double b, dg_pp_costs_t *c) {
    memset(c, 0, sizeof *c);
    int nc = s->pp * s->virt;
    for (int k = 0; k < nc; k++) {
        c->fwd_s[k] = f / s->virt;
        c->bwd_s[k] = b / s->virt;
        c->act_bytes[k] = 1.0 / s->virt;
    }
}

static void case_schedules(void) {
    const int ps[3] = {2, 4, 8};
    for (int pi = 0; pi < 3; pi++) {
        int p = ps[pi];
        int ms[3] = {p, 2 * p, 3 * p + 1};
        for (int mi = 0; mi < 3; mi++) {
            int m = ms[mi];
            double bub[2] = {0, 0};
            for (int kind = 0; kind < 2; kind++) {
                int v = kind == DG_PP_INTERLEAVED ? 2 : 1;
                dg_pp_schedule_t s;
                dg_status_t st = dg_pp_schedule_build(kind, p, v, m, &s);
                CHECK(st == DG_OK, "build %s p=%d m=%d: %s", dg_pp_kind_name(kind), p, m, dg_last_error());
                if (st) continue;
                st = dg_pp_validate(&s);
                CHECK(st == DG_OK, "validate %s p=%d m=%d: %s", dg_pp_kind_name(kind), p, m, dg_last_error());
                for (int r = 0; r < p; r++) {
                    int nf = 0, nb = 0;
                    for (int i = 0; i < s.n[r]; i++)
                        nf += s.act[r][i].op == DG_PP_FWD, nb += s.act[r][i].op == DG_PP_BWD;
                    CHECK(nf == m * v && nb == m * v, "rank %d: %d forwards, %d backwards", r, nf, nb);
                }
                dg_pp_costs_t c;
                uniform_costs(&s, 1.0, 2.0, &c);
                dg_pp_sim_t sim;
                st = dg_pp_simulate(&s, &c, 0, &sim);
                CHECK(st == DG_OK, "simulate: %s", dg_last_error());
                if (st) {
                    dg_pp_schedule_free(&s);
                    continue;
                }
                bub[kind] = sim.bubble;
                double theory = dg_pp_bubble_theory(kind, p, v, m);
                if (kind == DG_PP_1F1B) {
                    CHECK(fabs(sim.bubble - theory) < 1e-12, "1f1b p=%d m=%d: bubble %.15g, theory %.15g", p,
                          m, sim.bubble, theory);
                    CHECK(fabs(sim.makespan - 3.0 * (m + p - 1)) < 1e-9, "1f1b makespan %g", sim.makespan);
                    for (int r = 0; r < p; r++)
                        CHECK(sim.max_inflight[r] <= p - r && sim.max_inflight[r] >= 1,
                              "1f1b p=%d m=%d: stage %d holds %d micro-batches (bound %d)", p, m, r,
                              sim.max_inflight[r], p - r);
                    CHECK(sim.max_inflight[0] == p, "stage 0 holds %d (expected p = %d)", sim.max_inflight[0],
                          p);
                } else {
                    /* interleaved: stage s holds the chunk activations of its warm-up forwards plus one,
                     * w = 2 (p - s - 1) + (v - 1) g (g: the first group of micro-batches, p + m mod p),
                     * each 1/v of a stage's: (w + 1) / v micro-batches' worth */
                    int g = p + m % p;
                    for (int r = 0; r < p; r++) {
                        int w = 2 * (p - r - 1) + (v - 1) * g;
                        if (w > m * v) w = m * v;
                        double bound = (w + (w < m * v)) / (double)v;
                        CHECK(sim.peak_act[r] <= bound + 1e-12,
                              "interleaved p=%d m=%d stage %d holds %g (bound %g)", p, m, r, sim.peak_act[r],
                              bound);
                    }
                    if (m % p == 0)
                        CHECK(fabs(sim.bubble - theory) < 1e-12,
                              "interleaved p=%d m=%d: bubble %.15g, theory %.15g", p, m, sim.bubble, theory);
                }
                printf("%-11s p=%d m=%-2d v=%d: bubble %.4f (theory %.4f), makespan %.2f\n",
                       dg_pp_kind_name(kind), p, m, v, sim.bubble, theory, sim.makespan);
                dg_pp_schedule_free(&s);
            }
            CHECK(bub[1] < bub[0], "p=%d m=%d: interleaved bubble %.4f not below 1f1b %.4f", p, m, bub[1],
                  bub[0]);
        }
    }
    /* with a real p2p cost the bubble grows, and stays exact for uniform costs plus messages: each of the
     * p - 1 hops of the fill and drain adds two messages (forward and backward) to the makespan */
    dg_pp_schedule_t s;
    OK(dg_pp_schedule_build(DG_PP_1F1B, 4, 1, 8, &s));
    dg_pp_costs_t c;
    uniform_costs(&s, 1.0, 2.0, &c);
    double p2p[16];
    for (int i = 0; i < 16; i++)
        p2p[i] = 0.25;
    c.p2p_s = p2p;
    dg_pp_sim_t sim;
    OK(dg_pp_simulate(&s, &c, 0, &sim));
    CHECK(sim.makespan > 3.0 * 11 && sim.bubble > dg_pp_bubble_theory(DG_PP_1F1B, 4, 1, 8),
          "p2p cost: makespan %g", sim.makespan);
    dg_pp_schedule_free(&s);
    /* shape errors */
    CHECK(dg_pp_schedule_build(DG_PP_1F1B, 4, 1, 3, &s) == DG_ERR_USAGE && strstr(dg_last_error(), ">= pp"),
          "%s", dg_last_error());
    CHECK(dg_pp_schedule_build(DG_PP_INTERLEAVED, 4, 1, 8, &s) == DG_ERR_USAGE &&
              strstr(dg_last_error(), "pp_virtual >= 2"),
          "%s", dg_last_error());
    CHECK(dg_pp_schedule_build(DG_PP_1F1B, 4, 2, 8, &s) == DG_ERR_USAGE, "%s", dg_last_error());
    /* a step of 1e9 micro-batches is refused before its action lists are allocated (40 GB) */
    CHECK(dg_pp_schedule_build(DG_PP_1F1B, 2, 1, 1000000000LL, &s) == DG_ERR_USAGE &&
              strstr(dg_last_error(), "1000000000 micro-batches per step"),
          "%s", dg_last_error());
    OK(dg_pp_schedule_build(DG_PP_1F1B, 2, 1, DG_PP_MAX_MICRO, &s));
    dg_pp_schedule_free(&s);
}

/* one rank's list with action i removed */
static void drop(dg_pp_schedule_t *s, int r, int i) {
    memmove(&s->act[r][i], &s->act[r][i + 1], (size_t)(s->n[r] - i - 1) * sizeof s->act[r][0]);
    s->n[r]--;
}

static int find(const dg_pp_schedule_t *s, int r, int op, int mb) {
    for (int i = 0; i < s->n[r]; i++)
        if (s->act[r][i].op == op && s->act[r][i].mb == mb) return i;
    return -1;
}

static void case_validator(void) {
    dg_pp_schedule_t s;
    /* a missing receive */
    OK(dg_pp_schedule_build(DG_PP_1F1B, 4, 1, 8, &s));
    drop(&s, 2, find(&s, 2, DG_PP_RECV_ACT, 3));
    CHECK(dg_pp_validate(&s) == DG_ERR_RUNTIME && strstr(dg_last_error(), "does not receive its input"), "%s",
          dg_last_error());
    dg_pp_schedule_free(&s);
    /* two sends swapped: rank 1 sends mb 1 before mb 0 (each still after its forward: fine locally) */
    OK(dg_pp_schedule_build(DG_PP_1F1B, 4, 1, 8, &s));
    {
        int a = find(&s, 0, DG_PP_SEND_ACT, 0), b = find(&s, 0, DG_PP_SEND_ACT, 1);
        dg_pp_action_t t = s.act[0][a];
        s.act[0][a] = s.act[0][b];
        s.act[0][b] = t;
        /* keep both after their forwards: move the first forward before both sends */
        int f1 = find(&s, 0, DG_PP_FWD, 1);
        if (f1 > a) {
            dg_pp_action_t x = s.act[0][f1];
            memmove(&s.act[0][a + 1], &s.act[0][a], (size_t)(f1 - a) * sizeof x);
            s.act[0][a] = x;
        }
    }
    CHECK(dg_pp_validate(&s) == DG_ERR_RUNTIME &&
              strstr(dg_last_error(), "activations from rank 0 to rank 1 out of order"),
          "%s", dg_last_error());
    dg_pp_schedule_free(&s);
    /* a backward before its forward */
    OK(dg_pp_schedule_build(DG_PP_1F1B, 2, 1, 2, &s));
    {
        int f = find(&s, 1, DG_PP_FWD, 0), b = find(&s, 1, DG_PP_BWD, 0);
        s.act[1][f].op = DG_PP_BWD;
        s.act[1][b].op = DG_PP_FWD;
    }
    CHECK(dg_pp_validate(&s) == DG_ERR_RUNTIME && strstr(dg_last_error(), "backward before the forward"),
          "%s", dg_last_error());
    dg_pp_schedule_free(&s);
    /* a deadlock under blocking point-to-point: the send of rank 0 and the receive of rank 1 split into
     * separate groups in the wrong order on rank 1 (rank 1 first sends its gradient, which rank 0 only
     * receives after its own blocking send to rank 1 completed) */
    OK(dg_pp_schedule_build(DG_PP_1F1B, 2, 1, 4, &s));
    {
        /* rank 0's group "send act mb 1 + recv grad mb 0": make the send a group of its own, first */
        int i = find(&s, 0, DG_PP_SEND_ACT, 1), j = find(&s, 0, DG_PP_RECV_GRAD, 0);
        CHECK(i >= 0 && j == i + 1, "layout %d %d", i, j);
        /* rank 1's group "send grad mb 0 + recv act mb 1" likewise, the send first */
        int k = find(&s, 1, DG_PP_SEND_GRAD, 0), l = find(&s, 1, DG_PP_RECV_ACT, 1);
        CHECK(k >= 0 && l == k + 1, "layout %d %d", k, l);
        s.act[0][i].group = 1000;
        s.act[1][k].group = 1001;
    }
    CHECK(dg_pp_validate(&s) == DG_ERR_RUNTIME && strstr(dg_last_error(), "deadlock"), "%s", dg_last_error());
    dg_pp_schedule_free(&s);
}

static dg_pp_model_t gpt2(int L, int H, int C, int V, int mb) {
    dg_pp_model_t m = {.n_layer = L,
                       .n_head = H,
                       .d_model = C,
                       .seq_len = 1024,
                       .vocab = V,
                       .micro_batch = mb,
                       .act_bytes = 2,
                       .tp = 1,
                       .state_bytes_per_param = 18};
    return m;
}

static void case_split(void) {
    /* gpt2-124m: the head (2 C V FLOPs per token) costs about 4.5 blocks: with 4 stages of 12 blocks the
     * last stage must hold fewer blocks than the first */
    dg_pp_model_t m = gpt2(12, 12, 768, 50304, 1);
    dg_pp_cost_t u[14];
    dg_pp_unit_costs(&m, u);
    double blk = u[1].fwd_flops + u[1].bwd_flops, head = u[13].fwd_flops + u[13].bwd_flops;
    CHECK(head > 3 * blk, "head %.3g vs block %.3g FLOPs", head, blk);
    dg_pp_split_t sp;
    OK(dg_pp_split(&m, DG_PP_1F1B, 4, 1, 0, &sp));
    int blocks = 0;
    for (int s = 0; s < 4; s++) {
        int nb = sp.n_units[s] - (s == 0) - (s == 3);
        blocks += nb;
        printf("stage %d: units %d..%d (%d blocks), %.3g FLOPs\n", s, sp.first_unit[s],
               sp.first_unit[s] + sp.n_units[s] - 1, nb, sp.stage_flops[s]);
        CHECK(nb >= 1, "stage %d empty", s);
    }
    CHECK(blocks == 12 && sp.first_unit[0] == 0 && sp.first_unit[3] + sp.n_units[3] == 14,
          "units not covered");
    int last = sp.n_units[3] - 1, first = sp.n_units[0] - 1;
    CHECK(last < first, "last stage %d blocks, first %d", last, first);
    /* optimal: every split of the 12 blocks into 4 non-empty runs has a largest stage at least as heavy */
    double tot = 0, mx = 0, opt = INFINITY;
    for (int s = 0; s < 4; s++)
        tot += sp.stage_flops[s], mx = fmax(mx, sp.stage_flops[s]);
    for (int a = 1; a <= 9; a++)
        for (int b = a + 1; b <= 10; b++)
            for (int c = b + 1; c <= 11; c++) {
                double st[4] = {u[0].fwd_flops + u[0].bwd_flops + a * blk, (b - a) * blk, (c - b) * blk,
                                (12 - c) * blk + head};
                double w = fmax(fmax(st[0], st[1]), fmax(st[2], st[3]));
                opt = fmin(opt, w);
            }
    CHECK(fabs(mx - opt) <= 1e-9 * opt, "largest stage %.6g, best possible %.6g", mx, opt);
    /* the equal split by block count (3 each) has a heavier largest stage */
    double eq_last = 3 * blk + head;
    CHECK(mx < eq_last, "balanced %.4g not below equal-count %.4g", mx, eq_last);
    CHECK(sp.imbalance >= 1 && sp.imbalance < eq_last / (tot / 4), "imbalance %g", sp.imbalance);
    /* interleaved: layers divisible by pp x virtual */
    CHECK(dg_pp_split(&m, DG_PP_INTERLEAVED, 4, 2, 0, &sp) == DG_ERR_USAGE &&
              strstr(dg_last_error(), "divisible"),
          "%s", dg_last_error());
    OK(dg_pp_split(&m, DG_PP_INTERLEAVED, 2, 2, 0, &sp));
    CHECK(sp.n_chunks == 4 && sp.n_units[0] == 4 && sp.n_units[1] == 3 && sp.n_units[3] == 4,
          "chunks %d %d %d", sp.n_units[0], sp.n_units[1], sp.n_units[3]);
    CHECK(dg_pp_split(&m, DG_PP_1F1B, 13, 1, 0, &sp) == DG_ERR_USAGE && strstr(dg_last_error(), "n_layer=12"),
          "%s", dg_last_error());
    /* a memory budget: stage 0 holds p micro-batches of activations; with a tight budget it gets fewer
     * blocks than without, or no split fits */
    dg_pp_model_t big = gpt2(48, 25, 1600, 50304, 4);
    dg_pp_split_t free_sp, tight;
    OK(dg_pp_split(&big, DG_PP_1F1B, 8, 1, 0, &free_sp));
    dg_pp_cost_t ub[50];
    dg_pp_unit_costs(&big, ub);
    double mem0 = 0;
    for (int i = 0; i < free_sp.n_units[0]; i++)
        mem0 += ub[i].params * big.state_bytes_per_param + ub[i].act_bytes * 8;
    dg_status_t st = dg_pp_split(&big, DG_PP_1F1B, 8, 1, mem0 * 0.97, &tight);
    CHECK(st == DG_OK && tight.n_units[0] < free_sp.n_units[0], "budget split: %s, stage 0 %d vs %d units",
          st ? dg_last_error() : "ok", tight.n_units[0], free_sp.n_units[0]);
    CHECK(dg_pp_split(&big, DG_PP_1F1B, 8, 1, 1e6, &tight) == DG_ERR_USAGE && strstr(dg_last_error(), "GiB"),
          "%s", dg_last_error());
}

static void case_svg(void) {
    dg_pp_schedule_t s;
    OK(dg_pp_schedule_build(DG_PP_INTERLEAVED, 4, 2, 8, &s));
    dg_pp_costs_t c;
    uniform_costs(&s, 1.0, 2.0, &c);
    dg_pp_sim_t sim;
    OK(dg_pp_simulate(&s, &c, 1, &sim));
    CHECK(sim.n_events == 4 * 2 * 8 * 2, "%d events", sim.n_events);
    char *buf = NULL;
    size_t cap = 0;
    FILE *f = open_memstream(&buf, &cap);
    dg_pp_timeline_svg(&s, &sim, "interleaved p=4 v=2 m=8 <test>", f);
    fclose(f);
    int boxes = 0;
    for (const char *q = buf; (q = strstr(q, "<rect x=")); q++)
        boxes++;
    CHECK(boxes == sim.n_events, "%d boxes for %d events", boxes, sim.n_events);
    CHECK(strstr(buf, "&lt;test&gt;") && strstr(buf, "</svg>"), "title not escaped / not closed");
    free(buf);
    dg_pp_sim_free(&sim);
    dg_pp_schedule_free(&s);
}

/* the pp dimension of the mesh: outermost, stage k = ranks [k W, (k + 1) W) */
static void case_mesh(void) {
    dg_mesh_shape_t m;
    int is_auto = 0;
    OK(dg_mesh_parse("tp=2,pp=4,dp_shard=2", 16, &m, &is_auto));
    CHECK(dg_mesh_pp(&m) == 4 && dg_mesh_stage_world(&m) == 4 && dg_mesh_world(&m) == 16,
          "pp %d W %d world %d", dg_mesh_pp(&m), dg_mesh_stage_world(&m), dg_mesh_world(&m));
    char buf[96];
    dg_mesh_format(&m, buf, sizeof buf);
    CHECK_STR(buf, "dp_replicate=1,dp_shard=2,tp=2,pp=4");
    int c[DG_MESH_NDIM];
    dg_mesh_coords(&m, 13, c); /* stage 3, rank 1 of the stage: tp innermost */
    CHECK(dg_mesh_stage(&m, 13) == 3 && c[DG_MESH_TP] == 1 && c[DG_MESH_DP_SHARD] == 0,
          "stage %d coords %d %d", dg_mesh_stage(&m, 13), c[DG_MESH_TP], c[DG_MESH_DP_SHARD]);
    CHECK(dg_mesh_rank(&m, c) + 3 * dg_mesh_stage_world(&m) == 13, "rank back");
    CHECK(dg_mesh_parse("pp=4,dp_shard=2", 16, &m, &is_auto) == DG_ERR_USAGE &&
              strstr(dg_last_error(), "has 8 ranks but the world size is 16"),
          "%s", dg_last_error());
    /* a shape written without pp, and a one-stage mesh's text, are unchanged */
    dg_mesh_shape_t old = {{1, 4, 1}, {DG_MESH_DP_REPLICATE, DG_MESH_DP_SHARD, DG_MESH_TP}};
    dg_mesh_format(&old, buf, sizeof buf);
    CHECK_STR(buf, "dp_replicate=1,dp_shard=4,tp=1");
    CHECK(dg_mesh_pp(&old) == 1 && dg_mesh_world(&old) == 4, "no pp");
    OK(dg_mesh_parse("dp_shard=2,pp=1", 2, &m, &is_auto));
    dg_mesh_format(&m, buf, sizeof buf);
    CHECK_STR(buf, "dp_replicate=1,dp_shard=2,tp=1");
}

int main(int argc, char **argv) {
    static const dg_check_case_t cases[] = {DG_CASE(schedules), DG_CASE(validator), DG_CASE(split),
                                            DG_CASE(svg), DG_CASE(mesh)};
    return DG_CHECK_CASES(argc, argv, cases, "schedules|validator|split|svg|mesh|all", NULL, 0, NULL);
}
