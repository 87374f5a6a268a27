/* pipeline_report.c — what `dgtrain --plan-only` and `--dry-run` print for a mesh with pp > 1 (the plan
 * of the pipeline, without building the per-rank chunk graphs the executor trains): the stage split, the
 * schedule's simulated makespan and bubble against theory, each stage's in-flight activations and memory, the
 * planner's table and its pipeline verdict, and optionally the timeline as SVG (--pp-timeline FILE).
 * Rank 0 computes and prints; nothing is collective. */
#include <string.h>

#include "cli_hooks.h"
#include "dg_memory.h"
#include "dg_mesh.h"
#include "pipeline.h"
#include "planner.h"
#include "train.h"

#define GIB 1073741824.0
#define DG_CLI_COMPUTE_EFF 0.45 /* the planner's fraction of peak (src/planner/score.c) */

int dg_cli_mesh_pp(const dg_config_t *cfg) {
    dg_mesh_shape_t m;
    int is_auto = 0;
    if (dg_mesh_parse(cfg->parallel.mesh, 0, &m, &is_auto) != DG_OK) {
        dg_clear_error();
        return 1;
    }
    return is_auto ? 1 : dg_mesh_pp(&m);
}

/* the cluster the pipeline runs on: topology.cluster, or this job's nodes */
static dg_status_t report_cluster(dg_boot_t *boot, const dg_config_t *cfg, dg_cluster_t *cl) {
    if (cfg->topology.cluster[0]) return dg_cluster_load(cfg->topology.cluster, (int)cfg->topology.world, cl);
    if (!boot->have_topo) return DG_ERR(DG_ERR_RUNTIME, "pipeline report: the node topology was not loaded");
    int nodes = boot->n_nodes > 0 ? boot->n_nodes : 1;
    if (boot->world_size % nodes)
        return DG_ERR(DG_ERR_USAGE, "pipeline report: %d ranks over %d nodes is uneven", boot->world_size,
                      nodes);
    dg_node_topo_t t = boot->topo;
    int rpn = boot->world_size / nodes;
    if (t.n_gpus > 0 && rpn > t.n_gpus) t.n_gpus = 0;
    return dg_cluster_from_topo(&t, boot->hwtopo, nodes, rpn, cl);
}

static dg_status_t report(dg_boot_t *boot, const dg_config_t *cfg, int json, const char *svg_path,
                          FILE *out) {
    dg_model_desc_t d;
    DG_TRY(dg_train_model_desc(cfg, &d));
    dg_cluster_t cl;
    DG_TRY(report_cluster(boot, cfg, &cl));
    dg_mesh_shape_t mesh;
    int is_auto = 0;
    dg_status_t s = dg_mesh_parse(cfg->parallel.mesh, cl.world, &mesh, &is_auto);
    const int pp = s == DG_OK && !is_auto ? dg_mesh_pp(&mesh) : 1;
    if (s == DG_OK && pp <= 1) s = DG_ERR(DG_ERR_USAGE, "--pp-timeline needs parallel.mesh with pp > 1");
    const int kind = cfg->parallel.pp_schedule_id, virt = (int)cfg->parallel.pp_virtual;
    const int S = mesh.size[DG_MESH_DP_SHARD], K = mesh.size[DG_MESH_TP], W = dg_mesh_stage_world(&mesh);
    const int64_t dp = (int64_t)mesh.size[DG_MESH_DP_REPLICATE] * S;
    const int pb = cl.gpu_mode && cfg->train.precision_id != DG_PREC_FP32 ? 2 : 4;
    int m = 0;
    if (s == DG_OK) m = (int)(cfg->train.global_batch / (cfg->train.micro_batch * dp));
    dg_pp_model_t pm = {.n_layer = d.n_layer,
                        .n_head = d.n_head,
                        .d_model = d.d_model,
                        .seq_len = d.seq_len,
                        .vocab = d.padded_vocab,
                        .micro_batch = (int)cfg->train.micro_batch,
                        .act_bytes = pb,
                        .tp = K,
                        .state_bytes_per_param = (16.0 + (pb < 4 ? pb : 0)) / S};
    dg_pp_split_t sp;
    dg_pp_schedule_t sch = {0};
    dg_pp_sim_t sim = {0};
    double *p2p = NULL;
    if (s == DG_OK) s = dg_pp_split(&pm, kind, pp, virt, 0, &sp);
    if (s == DG_OK) s = dg_pp_schedule_build(kind, pp, virt, m, &sch);
    if (s == DG_OK) s = dg_pp_validate(&sch);
    if (s == DG_OK) {
        double rate = cl.peak_flops_per_rank * DG_CLI_COMPUTE_EFF, msg = dg_pp_message_bytes(&pm);
        dg_pp_costs_t pc;
        dg_pp_costs_from_split(&sp, rate, &pc);
        p2p = dg_xcalloc((size_t)pp * pp, sizeof(double));
        for (int a = 0; a < pp; a++)
            for (int b = 0; b < pp; b++)
                if (a != b) {
                    dg_link_param_t lp = cl.link[dg_cluster_link(&cl, a * W, b * W)];
                    p2p[a * pp + b] = lp.lat_us * 1e-6 + msg / (lp.bw_GBps * 1e9);
                }
        pc.p2p_s = p2p;
        s = dg_pp_simulate(&sch, &pc, svg_path != NULL, &sim);
    }
    if (s == DG_OK) {
        char ms[96];
        dg_mesh_format(&mesh, ms, sizeof ms);
        double theory = dg_pp_bubble_theory(kind, pp, virt, m);
        if (json) {
            fprintf(
                out,
                "{\"mesh\":\"%s\",\"schedule\":\"%s\",\"pp\":%d,\"virtual\":%d,\"microbatches\":%d,"
                "\"makespan_ms\":%.6g,\"bubble\":%.6g,\"bubble_theory\":%.6g,\"imbalance\":%.6g,\"stages\":[",
                ms, dg_pp_kind_name(kind), pp, virt, m, sim.makespan * 1e3, sim.bubble, theory, sp.imbalance);
        } else {
            fprintf(out,
                    "pipeline %s, schedule %s (%d chunk(s) per rank), %d micro-batches of %lld sequences per "
                    "step and pipeline\n",
                    ms, dg_pp_kind_name(kind), virt, m, (long long)cfg->train.micro_batch);
            fprintf(out,
                    "  simulated on %s: makespan %.3f ms, bubble %.4f (theory %.4f), stage imbalance %.3f\n",
                    cl.node_desc, sim.makespan * 1e3, sim.bubble, theory, sp.imbalance);
            fprintf(out, "  %-5s %-14s %7s %12s %9s %9s %9s %12s\n", "rank", "chunks:units", "blocks",
                    "params", "fwd ms", "bwd ms", "inflight", "mem/rank");
        }
        for (int r = 0; r < pp; r++) {
            char units[160] = "";
            double params = 0, fwd = 0, bwd = 0;
            int blocks = 0;
            for (int c = r; c < sp.n_chunks; c += pp) {
                size_t l = strlen(units);
                snprintf(units + l, sizeof units - l, "%s%d-%d", l ? "," : "", sp.first_unit[c],
                         sp.first_unit[c] + sp.n_units[c] - 1);
                params += sp.chunk[c].params * K;
                blocks += sp.n_units[c] - (c == 0) - (c == sp.n_chunks - 1);
                fwd += sp.chunk[c].fwd_flops;
                bwd += sp.chunk[c].bwd_flops;
            }
            double rate = cl.peak_flops_per_rank * DG_CLI_COMPUTE_EFF;
            double per_mb = sp.chunk[r].act_bytes > 0 ? sp.chunk[r].act_bytes : 1;
            dg_mem_in_t mi = {.n_params = params,
                              .n_layer = blocks,
                              .d_model = d.d_model,
                              .seq_len = d.seq_len,
                              .vocab = d.padded_vocab,
                              .n_head = d.n_head,
                              .param_bytes = pb,
                              .dp_shard = S,
                              .tp = K,
                              .micro_batch = (double)cfg->train.micro_batch,
                              .recompute = (int)cfg->train.recompute_id,
                              .gpu = cl.gpu_mode,
                              .bucket_bytes = cfg->parallel.bucket_mb * 1048576.0,
                              .inflight = sim.peak_act[r] / per_mb};
            dg_mem_est_t me;
            dg_mem_estimate(&mi, &me);
            if (json)
                fprintf(out,
                        "%s{\"rank\":%d,\"units\":\"%s\",\"blocks\":%d,\"params\":%.0f,\"fwd_ms\":%.6g,"
                        "\"bwd_ms\":%.6g,\"max_inflight\":%d,\"mem_bytes\":%.0f}",
                        r ? "," : "", r, units, blocks, params, rate > 0 ? fwd / rate * 1e3 : 0,
                        rate > 0 ? bwd / rate * 1e3 : 0, sim.max_inflight[r], me.total);
            else
                fprintf(out, "  %-5d %-14s %7d %12.0f %9.3f %9.3f %9d %10.2f G\n", r, units, blocks, params,
                        rate > 0 ? fwd / rate * 1e3 : 0, rate > 0 ? bwd / rate * 1e3 : 0, sim.max_inflight[r],
                        me.total / GIB);
        }
        if (json) fprintf(out, "]");
        if (svg_path) {
            FILE *f = fopen(svg_path, "w");
            if (!f) {
                s = DG_ERR(DG_ERR_USAGE, "--pp-timeline: cannot write %s", svg_path);
            } else {
                char title[256];
                snprintf(title, sizeof title, "%s, %s, %d micro-batches: simulated step (seconds)", ms,
                         dg_pp_kind_name(kind), m);
                dg_pp_timeline_svg(&sch, &sim, title, f);
                if (fclose(f) != 0) s = DG_ERR(DG_ERR_USAGE, "--pp-timeline: cannot write %s", svg_path);
                if (!json && s == DG_OK) fprintf(out, "  timeline written to %s\n", svg_path);
            }
        }
    }
    /* the planner's view of the same cluster and workload: does a pipeline pay here? */
    if (s == DG_OK) {
        dg_plan_workload_t w = {.n_layer = d.n_layer,
                                .n_head = d.n_head,
                                .d_model = d.d_model,
                                .seq_len = d.seq_len,
                                .vocab = d.padded_vocab,
                                .n_params = (int64_t)dg_model_n_params(&d),
                                .micro_batch = (int)cfg->train.micro_batch,
                                .global_batch = cfg->train.global_batch,
                                .param_bytes = pb,
                                .grad_bytes = cfg->train.reduce_dtype_id == DG_REDUCE_BF16 ? 2 : 4,
                                .reshard_after_forward = cfg->parallel.reshard_after_forward,
                                .pp_schedule = kind,
                                .pp_virtual = virt};
        dg_plan_result_t pr;
        dg_status_t ps = dg_plan_run(&cl, &w, &pr);
        if (json) {
            fprintf(out, ",\"planner\":");
            if (ps == DG_OK)
                dg_plan_print(&pr, &cl, out, 1, 0);
            else
                fprintf(out, "null");
            fprintf(out, "}");
        } else if (ps == DG_OK) {
            dg_plan_print(&pr, &cl, out, 0, 12);
        } else {
            fprintf(out, "  planner: %s\n", dg_last_error());
        }
        dg_clear_error();
        dg_plan_result_free(&pr);
    }
    free(p2p);
    dg_pp_sim_free(&sim);
    dg_pp_schedule_free(&sch);
    dg_cluster_free(&cl);
    return s;
}

dg_status_t dg_cli_pipeline_report(dg_boot_t *boot, const dg_config_t *cfg, int json, const char *svg_path,
                                   FILE *out) {
    if (boot->world_rank != 0) return DG_OK;
    dg_status_t s = report(boot, cfg, json, svg_path, out);
    if (json && s == DG_OK) fprintf(out, "\n");
    fflush(out);
    return s;
}
