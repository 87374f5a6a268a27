/* score.c — candidate meshes, their cost model (communication, memory, hop variance, recovery) and the
 * topology-SLA score. The formulas are documented in docs/planning.md; keep the two in step. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dg_memory.h"
#include "pipeline.h"
#include "planner.h"

/* A plan meets the step-time SLA when its estimated step is within this fraction of the fastest
 * feasible plan's; the robustness score ranks those plans, the rest rank below them. */
#define DG_PLAN_SLA_SLACK 0.05
/* Keeps 1 / (0.3 hv + 0.7 rc) finite when a plan is perfect on both terms. */
#define DG_PLAN_EPS 0.05
/* Fraction of peak FLOP/s a training step sustains, for the compute part of the step estimate. */
#define DG_PLAN_COMPUTE_EFF 0.45

double dg_plan_collective_s(int kind, double bytes, int n, dg_link_param_t lp) {
    if (n <= 1 || bytes <= 0) return 0;
    double bw = lp.bw_GBps * 1e9, a = lp.lat_us * 1e-6;
    double f = (double)(n - 1) / n;
    if (kind == 0) return 2.0 * (n - 1) * a + 2.0 * f * bytes / bw; /* ring all-reduce */
    return (n - 1) * a + f * bytes / bw;                            /* ring all-gather / reduce-scatter */
}

/* Every group of dimension `dim`: ranks that share all other coordinates (and the pipeline stage), in
 * coordinate order. Fills groups[g * size + i]; returns the number of groups. */
static int mesh_groups(const dg_mesh_shape_t *m, int dim, int *groups) {
    int world = dg_mesh_world(m), W = dg_mesh_stage_world(m), size = m->size[dim], ng = 0;
    int *seen = dg_xcalloc((size_t)world, sizeof(int));
    for (int r = 0; r < world; r++) {
        if (seen[r]) continue;
        int c[DG_MESH_NDIM], base = dg_mesh_stage(m, r) * W;
        dg_mesh_coords(m, r, c);
        for (int i = 0; i < size; i++) {
            c[dim] = i;
            int q = base + dg_mesh_rank(m, c);
            seen[q] = 1;
            groups[ng * size + i] = q;
        }
        ng++;
    }
    free(seen);
    return ng;
}

/* The slowest link around a ring, as parameters (NVLink pairs use their measured bandwidth when known). */
static dg_link_param_t ring_link(const dg_cluster_t *c, const int *ring, int n, int *worst_class) {
    dg_link_param_t lp = {1e30, 0};
    int worst = DG_LINK_SAME_DEVICE;
    for (int i = 0; i < n; i++) {
        int a = ring[i], b = ring[(i + 1) % n];
        int cls = dg_cluster_link(c, a, b);
        dg_link_param_t p = c->link[cls];
        if (cls == DG_LINK_NVLINK && c->nvlink_bw) {
            int ga = c->local_gpu[a % c->ranks_per_node], gb = c->local_gpu[b % c->ranks_per_node];
            double bw = c->nvlink_bw[ga * c->n_gpus + gb];
            if (bw > 0 && bw < p.bw_GBps) p.bw_GBps = bw;
        }
        if (p.bw_GBps < lp.bw_GBps) lp.bw_GBps = p.bw_GBps;
        if (p.lat_us > lp.lat_us) lp.lat_us = p.lat_us;
        if (cls > worst) worst = cls;
    }
    if (n <= 1) lp = c->link[DG_LINK_SAME_DEVICE];
    *worst_class = worst;
    return lp;
}

static void evaluate(const dg_cluster_t *c, const dg_plan_workload_t *w, dg_plan_t *p) {
    const int R = p->mesh.size[DG_MESH_DP_REPLICATE], S = p->mesh.size[DG_MESH_DP_SHARD],
              K = p->mesh.size[DG_MESH_TP], PP = dg_mesh_pp(&p->mesh);
    const int world = c->world;
    const double C = w->d_model, T = w->seq_len, V = w->vocab;
    double P = (double)w->n_params, L = w->n_layer;
    const double pb = w->param_bytes, gb = w->grad_bytes, mb = w->micro_batch;
    p->feasible = 1;
    p->why[0] = 0;
    int64_t per_micro = (int64_t)w->micro_batch * R * S;
    double k = per_micro > 0 ? (double)w->global_batch / (double)per_micro : 0;
    if (w->global_batch % per_micro != 0) {
        p->feasible = 0;
        snprintf(p->why, sizeof p->why, "global batch %lld is not a multiple of micro_batch x dp = %lld",
                 (long long)w->global_batch, (long long)per_micro);
        k = ceil(k);
    }

    /* ---- a pipeline (docs/parallelism.md §Planner): the split, the schedule replayed with this cluster's
     * compute and stage-to-stage link costs; the data-parallel and tp traffic below is then the largest
     * stage's ---- */
    dg_pp_split_t split;
    double pp_inflight = 1, pp_L0 = L, pp_P0 = P;
    if (PP > 1 && p->feasible) {
        int kind = w->pp_schedule == DG_PP_INTERLEAVED ? DG_PP_INTERLEAVED : DG_PP_1F1B;
        int virt = kind == DG_PP_INTERLEAVED ? (w->pp_virtual > 1 ? w->pp_virtual : 2) : 1;
        dg_pp_model_t pm = {.micro_batch = w->micro_batch, /* the workload's micro-batch in its dtype */
                            .act_bytes = w->param_bytes,
                            .tp = K,
                            .n_layer = w->n_layer,
                            .n_head = w->n_head,
                            .d_model = w->d_model,
                            .seq_len = w->seq_len,
                            .vocab = w->vocab,
                            .state_bytes_per_param = (16.0 + (w->param_bytes < 4 ? w->param_bytes : 0)) / S};
        dg_pp_schedule_t sch;
        if (dg_pp_split(&pm, kind, PP, virt, c->mem_per_rank_bytes * 0.9, &split) != DG_OK ||
            dg_pp_schedule_build(kind, PP, virt, (int64_t)k, &sch) != DG_OK) {
            p->feasible = 0;
            snprintf(p->why, sizeof p->why, "%s", dg_last_error());
            dg_clear_error();
        } else {
            double rate = c->peak_flops_per_rank * DG_PLAN_COMPUTE_EFF;
            dg_pp_costs_t pc;
            dg_pp_costs_from_split(&split, rate, &pc);
            /* the pipeline of stage-local rank 0: stage a's rank to stage b's over their link */
            const int W = dg_mesh_stage_world(&p->mesh);
            double *p2p = dg_xcalloc((size_t)PP * PP, sizeof(double));
            double msg = dg_pp_message_bytes(&pm);
            p->pp_hops = 0;
            p->pp_p2p_ms = 0;
            for (int a = 0; a < PP; a++)
                for (int b = 0; b < PP; b++) {
                    if (a == b) continue;
                    int cls = dg_cluster_link(c, a * W, b * W);
                    dg_link_param_t lp = c->link[cls];
                    p2p[a * PP + b] = lp.lat_us * 1e-6 + msg / (lp.bw_GBps * 1e9);
                    if ((b == a + 1 || (kind == DG_PP_INTERLEAVED && a == PP - 1 && b == 0))) {
                        if (cls > p->pp_hops) p->pp_hops = cls;
                        if (p2p[a * PP + b] * 1e3 > p->pp_p2p_ms) p->pp_p2p_ms = p2p[a * PP + b] * 1e3;
                    }
                }
            pc.p2p_s = p2p;
            dg_pp_sim_t sim;
            if (dg_pp_simulate(&sch, &pc, 0, &sim) == DG_OK) {
                p->pp_bubble = sim.bubble;
                p->compute_ms = sim.makespan * 1e3;
                /* the stage with the most in-flight activations (stage 0) and the last (logits) */
                pp_inflight =
                    (double)sim.peak_act[0] / (split.chunk[0].act_bytes > 0 ? split.chunk[0].act_bytes : 1);
            } else {
                p->feasible = 0;
                snprintf(p->why, sizeof p->why, "%s", dg_last_error());
                dg_clear_error();
            }
            p->pp_microbatches = (int)k;
            p->pp_imbalance = split.imbalance;
            p->pp_p2p_bytes = 2.0 * k * virt * msg;
            /* the heaviest stage's parameters and blocks, for its traffic and memory */
            pp_P0 = 0;
            pp_L0 = 0;
            for (int r = 0; r < PP; r++) {
                double pr = 0, lr = 0;
                for (int q = r; q < split.n_chunks; q += PP) {
                    pr += split.chunk[q].params * K; /* unit params are per tp rank */
                    lr += split.n_units[q] - (q == 0) - (q == split.n_chunks - 1);
                }
                if (pr > pp_P0) pp_P0 = pr;
                if (lr > pp_L0) pp_L0 = lr;
            }
            free(p2p);
            dg_pp_schedule_free(&sch);
        }
        P = pp_P0;
        L = pp_L0;
    }

    /* ---- communication per step, per dimension (FSDP2 rules; docs/planning.md §Communication) ---- */
    double shard_params = P / K;
    double bytes[DG_MESH_NDIM] = {0}, count[DG_MESH_NDIM] = {0};
    int kind[DG_MESH_NDIM] = {0, 1, 0};
    /* dp_shard: per micro-batch, all-gather the weights for forward (and again for backward when
     * resharding after forward), reduce-scatter the gradients; a pipeline chunk does the same in each
     * micro-batch's forward and backward (docs/parallelism.md "The executor"), over its stage's weights */
    bytes[DG_MESH_DP_SHARD] = shard_params * pb;
    count[DG_MESH_DP_SHARD] = k * (1 + (w->reshard_after_forward ? 1 : 0));
    double rs_bytes = shard_params * gb, rs_count = k;
    /* dp_replicate: all-reduce of this rank's gradient shard once per step */
    bytes[DG_MESH_DP_REPLICATE] = shard_params / S * gb;
    count[DG_MESH_DP_REPLICATE] = 1;
    /* tp: two all-reduces of [micro_batch, T, C] per layer in forward, two in backward */
    bytes[DG_MESH_TP] = mb * T * C * pb;
    count[DG_MESH_TP] = k * 4 * L;

    int *groups = dg_xmalloc((size_t)world * sizeof(int));
    double hv_sum = 0;
    int active = 0;
    for (int d = 0; d < DG_MESH_NDIM; d++) {
        p->comm_ms[d] = 0;
        p->comm_bytes[d] = 0;
        p->hops[d] = 0;
        int size = p->mesh.size[d];
        if (size <= 1) continue;
        active++;
        int ng = mesh_groups(&p->mesh, d, groups);
        double worst_s = 0, mean_h = 0, sq_h = 0;
        for (int g = 0; g < ng; g++) {
            int cls;
            dg_link_param_t lp = ring_link(c, groups + (size_t)g * size, size, &cls);
            double s = count[d] * dg_plan_collective_s(kind[d], bytes[d], size, lp);
            if (d == DG_MESH_DP_SHARD) s += rs_count * dg_plan_collective_s(2, rs_bytes, size, lp);
            if (s > worst_s) worst_s = s;
            if (cls > p->hops[d]) p->hops[d] = cls;
            mean_h += cls;
            sq_h += (double)cls * cls;
        }
        mean_h /= ng;
        double var = sq_h / ng - mean_h * mean_h;
        hv_sum += var < 0 ? 0 : var;
        p->comm_ms[d] = worst_s * 1e3;
        p->comm_bytes[d] = count[d] * bytes[d] + (d == DG_MESH_DP_SHARD ? rs_count * rs_bytes : 0);
    }
    /* variance of values in [0, 5] is at most 6.25 */
    p->hop_variance = active ? hv_sum / active / 6.25 : 0;
    if (p->hop_variance > 1) p->hop_variance = 1;
    p->comm_total_ms = p->comm_ms[0] + p->comm_ms[1] + p->comm_ms[2];
    double flops = (6.0 * P + 12.0 * L * C * T) * (double)w->global_batch * T / world;
    if (PP == 1)
        p->compute_ms =
            c->peak_flops_per_rank > 0 ? flops / (c->peak_flops_per_rank * DG_PLAN_COMPUTE_EFF) * 1e3 : 0;
    /* dp_shard's re-layout copies on the device (docs/planning.md): per micro-batch each gather is unpacked
     * (read + write of the unsharded weights) and the gradients packed rank-major before the
     * reduce-scatter (read + write), at the same-device copy rate. What separates sharding from
     * replication when both move the same bytes (e.g. 2 GPUs: 2 all-gathers + a reduce-scatter vs one
     * all-reduce). Gradients are packed in f32 whatever the reduce dtype; with bf16 reductions
     * (grad_bytes 2) the packed buffer is then cast to bf16 (read 4 + write 2 bytes an element) */
    p->relayout_ms = 0;
    double pack_b = 4.0 + (gb < 4 ? (4.0 + gb) / 2.0 : 0.0);
    if (S > 1 && c->link[0].bw_GBps > 0)
        p->relayout_ms = k * 2.0 * P / K * ((1 + (w->reshard_after_forward ? 1 : 0)) * pb + pack_b) /
                         (c->link[0].bw_GBps * 1e9) * 1e3;
    p->step_ms = p->compute_ms + p->comm_total_ms + p->relayout_ms;

    /* ---- memory per rank (docs/planning.md §Memory) ---- */
    dg_mem_in_t mi = {.n_params = P,
                      .n_layer = L,
                      .d_model = C,
                      .seq_len = T,
                      .vocab = V,
                      .n_head = w->n_head,
                      .param_bytes = pb,
                      .dp_shard = (int)S,
                      .tp = (int)K,
                      .micro_batch = mb,
                      .gpu = c->gpu_mode,
                      .inflight = pp_inflight};
    dg_mem_est_t me;
    dg_mem_estimate(&mi, &me);
    p->mem_bytes = me.total;
    double budget = c->mem_per_rank_bytes * 0.9;
    if (p->feasible && p->mem_bytes > budget) {
        p->feasible = 0;
        snprintf(p->why, sizeof p->why, "needs %.1f GiB per rank > %.1f GiB budget (90%% of %.1f GiB)",
                 p->mem_bytes / 1073741824.0, budget / 1073741824.0, c->mem_per_rank_bytes / 1073741824.0);
    }

    /* ---- recovery from the loss of one node (node 0; nodes are identical) ---- */
    int rpn = c->ranks_per_node, total_groups = 0, touched = 0;
    for (int d = 0; d < DG_MESH_NDIM; d++) {
        int size = p->mesh.size[d];
        if (size <= 1) continue;
        int ng = mesh_groups(&p->mesh, d, groups);
        total_groups += ng;
        for (int g = 0; g < ng; g++)
            for (int i = 0; i < size; i++)
                if (groups[g * size + i] / rpn == 0) {
                    touched++;
                    break;
                }
    }
    /* The state is S*K distinct shards, each held by the R ranks of one dp_replicate group: a shard must
     * be reloaded from the checkpoint only when every one of its replicas was on the lost node. */
    int lost = 0, shards = 0;
    for (int r = 0; r < world; r++) {
        int co[DG_MESH_NDIM], base = dg_mesh_stage(&p->mesh, r) * dg_mesh_stage_world(&p->mesh);
        dg_mesh_coords(&p->mesh, r, co);
        if (co[DG_MESH_DP_REPLICATE] != 0) continue;
        shards++;
        int all_lost = 1;
        for (int i = 0; i < R && all_lost; i++) {
            co[DG_MESH_DP_REPLICATE] = i;
            if ((base + dg_mesh_rank(&p->mesh, co)) / rpn != 0) all_lost = 0;
        }
        lost += all_lost;
    }
    double touched_frac = total_groups ? (double)touched / total_groups : 1.0;
    p->recovery_cost = 0.5 * touched_frac + 0.5 * (double)lost / shards;
    free(groups);
}

static int cmp_plans(const void *a, const void *b) {
    const dg_plan_t *x = a, *y = b;
    if (x->feasible != y->feasible) return y->feasible - x->feasible;
    if (x->feasible) {
        if (fabs(x->score - y->score) > 1e-9) return x->score > y->score ? -1 : 1;
        if (x->step_ms != y->step_ms) return x->step_ms < y->step_ms ? -1 : 1;
    } else if (x->mem_bytes != y->mem_bytes) {
        return x->mem_bytes < y->mem_bytes ? -1 : 1;
    }
    /* fully deterministic order for equal plans: no pipeline first, fewer dims of size > 1, then shape */
    if (dg_mesh_pp(&x->mesh) != dg_mesh_pp(&y->mesh)) return dg_mesh_pp(&x->mesh) - dg_mesh_pp(&y->mesh);
    for (int d = DG_MESH_NDIM - 1; d >= 0; d--)
        if (x->mesh.size[d] != y->mesh.size[d]) return x->mesh.size[d] - y->mesh.size[d];
    for (int d = 0; d < DG_MESH_NDIM; d++)
        if (x->mesh.order[d] != y->mesh.order[d]) return x->mesh.order[d] - y->mesh.order[d];
    return 0;
}

/* Two orders give the same rank layout when they agree on the dims of size > 1. */
static int same_layout(const dg_mesh_shape_t *a, const dg_mesh_shape_t *b) {
    int da[DG_MESH_NDIM], db[DG_MESH_NDIM], na = 0, nb = 0;
    for (int i = 0; i < DG_MESH_NDIM; i++) {
        if (a->size[a->order[i]] > 1) da[na++] = a->order[i];
        if (b->size[b->order[i]] > 1) db[nb++] = b->order[i];
    }
    if (na != nb) return 0;
    for (int i = 0; i < na; i++)
        if (da[i] != db[i]) return 0;
    return 1;
}

/* Why a pipeline was chosen or rejected: the best plan with pp > 1 against the best without. */
static void pp_explain(dg_plan_result_t *out, const dg_cluster_t *c) {
    const dg_plan_t *bp = NULL, *bn = NULL, *pp_any = NULL;
    for (int i = 0; i < out->n; i++) {
        const dg_plan_t *q = &out->plans[i];
        if (dg_mesh_pp(&q->mesh) > 1 && !pp_any) pp_any = q;
        if (!q->feasible) continue;
        if (dg_mesh_pp(&q->mesh) > 1 && !bp) bp = q;
        if (dg_mesh_pp(&q->mesh) == 1 && !bn) bn = q;
    }
    char a[96] = "", b[96] = "";
    if (bp) dg_mesh_format(&bp->mesh, a, sizeof a);
    if (bn) dg_mesh_format(&bn->mesh, b, sizeof b);
    if (c->max_pp <= 1) {
        snprintf(out->pp_reason, sizeof out->pp_reason,
                 "pipeline: not considered (the cluster allows pp <= 1)");
    } else if (!bp && pp_any) {
        char m[96];
        dg_mesh_format(&pp_any->mesh, m, sizeof m);
        snprintf(out->pp_reason, sizeof out->pp_reason,
                 "pipeline: no feasible pp candidate (the first, %s: %s)", m, pp_any->why);
    } else if (!bp) {
        snprintf(out->pp_reason, sizeof out->pp_reason,
                 "pipeline: no feasible pp candidate (pp must divide the world, be <= n_layer and leave at "
                 "least pp micro-batches per step)");
    } else if (!bn || bp == &out->plans[out->chosen]) {
        snprintf(out->pp_reason, sizeof out->pp_reason,
                 "pipeline chosen: %s estimates %.2f ms per step against %.2f ms for the best plan without "
                 "(%s): data-parallel + tp traffic %.2f ms against %.2f ms (worst dp link %s against %s), "
                 "for a bubble of %.1f%% over %d micro-batches, stage imbalance %.3f, %.3f ms per "
                 "activation message on %s links",
                 a, bp->step_ms, bn ? bn->step_ms : 0, bn ? b : "none feasible", bp->comm_total_ms,
                 bn ? bn->comm_total_ms : 0,
                 dg_link_class_name(bp->hops[DG_MESH_DP_REPLICATE] > bp->hops[DG_MESH_DP_SHARD]
                                        ? bp->hops[DG_MESH_DP_REPLICATE]
                                        : bp->hops[DG_MESH_DP_SHARD]),
                 bn ? dg_link_class_name(bn->hops[DG_MESH_DP_REPLICATE] > bn->hops[DG_MESH_DP_SHARD]
                                             ? bn->hops[DG_MESH_DP_REPLICATE]
                                             : bn->hops[DG_MESH_DP_SHARD])
                    : "-",
                 100 * bp->pp_bubble, bp->pp_microbatches, bp->pp_imbalance, bp->pp_p2p_ms,
                 dg_link_class_name(bp->pp_hops));
    } else {
        snprintf(out->pp_reason, sizeof out->pp_reason,
                 "pipeline rejected: the best pp plan %s estimates %.2f ms per step against %.2f ms for %s: "
                 "its bubble of %.1f%% over %d micro-batches (stage imbalance %.3f) adds %.2f ms of compute "
                 "time against a data-parallel + tp traffic change of %+.2f ms",
                 a, bp->step_ms, bn->step_ms, b, 100 * bp->pp_bubble, bp->pp_microbatches, bp->pp_imbalance,
                 bp->compute_ms - bn->compute_ms, bp->comm_total_ms - bn->comm_total_ms);
    }
}

dg_status_t dg_plan_run(const dg_cluster_t *c, const dg_plan_workload_t *w, dg_plan_result_t *out) {
    static const int perms[6][3] = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
    memset(out, 0, sizeof *out);
    out->chosen = -1;
    int world = c->world, cap = 64;
    dg_plan_t *plans = dg_xmalloc((size_t)cap * sizeof *plans);
    int n = 0;
    /* pipeline candidates: pp divides the world, at most one stage per block, at least pp micro-batches */
    for (int PP = 1; PP <= world; PP++) {
        if (world % PP || (PP > 1 && (PP > c->max_pp || PP > w->n_layer))) continue;
        int Wst = world / PP;
        for (int K = 1; K <= Wst; K++) {
            if (Wst % K || K > c->max_tp || w->n_head % K || w->d_model % K) continue;
            for (int S = 1; S <= Wst / K; S++) {
                if ((Wst / K) % S) continue;
                int R = Wst / K / S;
                if (PP > 1) {
                    int64_t per = (int64_t)w->micro_batch * R * S;
                    if (w->global_batch % per || w->global_batch / per < PP) continue;
                    if (w->pp_schedule == DG_PP_INTERLEAVED &&
                        w->n_layer % (PP * (w->pp_virtual > 1 ? w->pp_virtual : 2)))
                        continue;
                }
                for (int pi = 0; pi < 6; pi++) {
                    dg_plan_t p;
                    memset(&p, 0, sizeof p);
                    p.mesh.size[DG_MESH_DP_REPLICATE] = R;
                    p.mesh.size[DG_MESH_DP_SHARD] = S;
                    p.mesh.size[DG_MESH_TP] = K;
                    p.mesh.size[DG_MESH_PP] = PP;
                    for (int i = 0; i < 3; i++)
                        p.mesh.order[i] = perms[pi][i];
                    int dup = 0;
                    for (int j = 0; j < n && !dup; j++)
                        if (!memcmp(plans[j].mesh.size, p.mesh.size, sizeof p.mesh.size) &&
                            same_layout(&plans[j].mesh, &p.mesh))
                            dup = 1;
                    if (dup) continue;
                    evaluate(c, w, &p);
                    if (n == cap) plans = realloc(plans, (size_t)(cap *= 2) * sizeof *plans);
                    DG_ASSERT(plans != NULL);
                    plans[n++] = p;
                }
            }
        }
    }
    /* the score: 1 / (eps + 0.3 hv + 0.7 rc), normalised over the feasible plans, for plans within the
     * step-time SLA; plans outside it keep half weight scaled by how much slower they are */
    double best_t = INFINITY, best_raw = 0;
    for (int i = 0; i < n; i++)
        if (plans[i].feasible && plans[i].step_ms < best_t) best_t = plans[i].step_ms;
    for (int i = 0; i < n; i++) {
        dg_plan_t *p = &plans[i];
        double raw = 1.0 / (DG_PLAN_EPS + 0.3 * p->hop_variance + 0.7 * p->recovery_cost);
        if (p->feasible && raw > best_raw) best_raw = raw;
        p->score = raw; /* normalised below */
    }
    for (int i = 0; i < n; i++) {
        dg_plan_t *p = &plans[i];
        if (!p->feasible) {
            p->score = 0;
            continue;
        }
        double norm = p->score / best_raw;
        int in_sla = p->step_ms <= best_t * (1 + DG_PLAN_SLA_SLACK) + 1e-12;
        p->score = in_sla ? 0.5 + 0.5 * norm : 0.5 * norm * (best_t / p->step_ms);
    }
    qsort(plans, (size_t)n, sizeof *plans, cmp_plans);
    out->plans = plans;
    out->n = n;
    if (n == 0 || !plans[0].feasible) {
        double need = INFINITY;
        for (int i = 0; i < n; i++)
            if (plans[i].mem_bytes < need) need = plans[i].mem_bytes;
        return DG_ERR(
            DG_ERR_USAGE,
            "no feasible parallel plan for %d ranks: the smallest needs %.1f GiB per rank, the budget is "
            "%.1f GiB (%s)",
            world, need / 1073741824.0, c->mem_per_rank_bytes * 0.9 / 1073741824.0,
            n ? plans[0].why : "no candidate divides the world");
    }
    out->chosen = 0;
    dg_plan_t *ch = &plans[0];
    char ms[96];
    dg_mesh_format(&ch->mesh, ms, sizeof ms);
    int within = 0;
    for (int i = 0; i < n; i++)
        if (plans[i].feasible && plans[i].step_ms <= best_t * (1 + DG_PLAN_SLA_SLACK) + 1e-12) within++;
    pp_explain(out, c);
    snprintf(
        out->reason, sizeof out->reason,
        "%s: best robustness score among the %d feasible plan(s) within %.0f%% of the fastest estimated step "
        "(%.2f ms; this plan %.2f ms): hop variance %.3f, recovery cost %.3f",
        ms, within, DG_PLAN_SLA_SLACK * 100, best_t, ch->step_ms, ch->hop_variance, ch->recovery_cost);
    return DG_OK;
}

void dg_plan_result_free(dg_plan_result_t *r) {
    free(r->plans);
    r->plans = NULL;
    r->n = 0;
}

static void order_str(const dg_mesh_shape_t *m, char *buf, size_t cap) {
    static const char *abbr[DG_MESH_NDIM] = {"R", "S", "T"};
    /* innermost first, e.g. "T<S<R" means tp varies fastest over consecutive ranks */
    snprintf(buf, cap, "%s<%s<%s", abbr[m->order[2]], abbr[m->order[1]], abbr[m->order[0]]);
}

void dg_plan_print(const dg_plan_result_t *r, const dg_cluster_t *c, FILE *out, int json, int max_rows) {
    int rows = max_rows > 0 && max_rows < r->n ? max_rows : r->n;
    if (json) {
        fprintf(out, "{\"world\":%d,\"nodes\":%d,\"ranks_per_node\":%d,\"cluster\":", c->world, c->n_nodes,
                c->ranks_per_node);
        dg_boot_json_string(out, c->node_desc);
        fprintf(out, ",\"chosen\":");
        if (r->chosen >= 0) {
            char ms[96];
            dg_mesh_format(&r->plans[r->chosen].mesh, ms, sizeof ms);
            dg_boot_json_string(out, ms);
        } else {
            fprintf(out, "null");
        }
        fprintf(out, ",\"reason\":");
        dg_boot_json_string(out, r->reason);
        fprintf(out, ",\"pp_reason\":");
        dg_boot_json_string(out, r->pp_reason);
        fprintf(out, ",\"plans\":[");
        for (int i = 0; i < r->n; i++) {
            const dg_plan_t *p = &r->plans[i];
            char ms[96], os[16];
            dg_mesh_format(&p->mesh, ms, sizeof ms);
            order_str(&p->mesh, os, sizeof os);
            fprintf(
                out,
                "%s{\"mesh\":\"%s\",\"order\":\"%s\",\"dp_replicate\":%d,\"dp_shard\":%d,\"tp\":%d,"
                "\"comm_ms\":%.6g,\"comm_ms_dp_replicate\":%.6g,\"comm_ms_dp_shard\":%.6g,\"comm_ms_tp\":"
                "%.6g,"
                "\"step_ms\":%.6g,\"mem_bytes\":%.0f,\"hop_variance\":%.6g,\"recovery_cost\":%.6g,"
                "\"hops\":[%d,%d,%d],\"score\":%.6g,\"pp\":%d,\"pp_bubble\":%.6g,"
                "\"pp_microbatches\":%d,\"pp_imbalance\":%.6g,\"pp_p2p_bytes\":%.0f,\"feasible\":%s,\"why\":",
                i ? "," : "", ms, os, p->mesh.size[0], p->mesh.size[1], p->mesh.size[2], p->comm_total_ms,
                p->comm_ms[0], p->comm_ms[1], p->comm_ms[2], p->step_ms, p->mem_bytes, p->hop_variance,
                p->recovery_cost, p->hops[0], p->hops[1], p->hops[2], p->score, dg_mesh_pp(&p->mesh),
                p->pp_bubble, p->pp_microbatches, p->pp_imbalance, p->pp_p2p_bytes,
                p->feasible ? "true" : "false");
            dg_boot_json_string(out, p->why);
            fprintf(out, "}");
        }
        fprintf(out, "]}\n");
        return;
    }
    fprintf(out, "\nParallel plans for %d rank(s): %s\n", c->world, c->node_desc);
    fprintf(out, "  %-4s %-4s %-5s %-4s %-4s %-7s %10s %10s %11s %7s %8s %6s %6s  %s\n", "rank", "P", "R",
            "S", "T", "order", "comm ms", "step ms", "mem/rank", "hop var", "recovery", "score", "bubble",
            "feasible");
    for (int i = 0; i < rows; i++) {
        const dg_plan_t *p = &r->plans[i];
        char os[16];
        order_str(&p->mesh, os, sizeof os);
        char bub[16] = "-";
        if (dg_mesh_pp(&p->mesh) > 1) snprintf(bub, sizeof bub, "%.3f", p->pp_bubble);
        fprintf(out, "  %-4d %-4d %-5d %-4d %-4d %-7s %10.3f %10.3f %9.2f G %7.3f %8.3f %6.3f %6s  %s\n",
                i + 1, dg_mesh_pp(&p->mesh), p->mesh.size[0], p->mesh.size[1], p->mesh.size[2], os,
                p->comm_total_ms, p->step_ms, p->mem_bytes / 1073741824.0, p->hop_variance, p->recovery_cost,
                p->score, bub, p->feasible ? "yes" : p->why);
    }
    if (rows < r->n) fprintf(out, "  ... %d more (--json lists all)\n", r->n - rows);
    if (r->chosen >= 0) fprintf(out, "  chosen: %s\n", r->reason);
    if (r->pp_reason[0]) fprintf(out, "  %s\n", r->pp_reason);
}
