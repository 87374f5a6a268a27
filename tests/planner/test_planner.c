/* test_planner.c — the topology-SLA scorer on described clusters. The expected choices were written down
 * from first principles before running the planner:
 *   1. One node, 8 NVLink GPUs, GPT-2 124M: no tensor parallelism (a small model only pays TP's
 *      activation all-reduces); any candidate with tp > 1 keeps its tp groups on NVLink.
 *   2. 8 nodes x 8 NVLink GPUs, 8 NDR NICs each, GPT-2 124M: shard within a node over NVLink
 *      (dp_shard = 8), replicate across nodes (dp_replicate = 8), no TP.
 *   3. Two PCIe-only nodes of 4 GPUs, one NIC each: shard within a node, replicate across the network.
 *   4. A 2-socket CPU-only node with 4 ranks: the sharding groups (the most traffic) stay within a socket.
 *   5. GPT-2 1.5B on 8 GPUs of 16 GiB: pure data parallelism (a full replica per rank: 28 GB of state)
 *      is infeasible and says why; the choice shards the state.
 *   6. 24 ranks on nodes of 8 with dp_shard = 3 innermost: a group straddles two nodes, so hop variance
 *      is non-zero and that dimension's worst link is the network.
 * Cases 1-4 and 6 judge the layout of the data-parallel and tp dimensions: they plan without pipeline
 * candidates (max_pp = 1, as for the live cluster). Case 5 counts pipeline stages as a way to split the
 * state. With pipelines:
 *   7. gpt2-1558m on 8 x 8 H100: pp wins (the data-parallel traffic of a plan without crosses the
 *      network); the live cluster (max_pp = 1) gets no pp candidate.
 *   8. gpt2-124m on one NVLink node: pp does not pay, and the explanation says so.
 */
#include <stdlib.h>
#include <string.h>

#include "pipeline.h" /* dg_pp_bubble_theory */
#include "planner.h"
#include "dg_check.h"

static const char *g_dir;

static dg_plan_workload_t gpt2(int64_t n_params, int L, int NH, int C, int mb, int64_t gb) {
    dg_plan_workload_t w = {.n_layer = L,
                            .n_head = NH,
                            .d_model = C,
                            .seq_len = 1024,
                            .vocab = 50304,
                            .n_params = n_params,
                            .micro_batch = mb,
                            .global_batch = gb,
                            .param_bytes = 2,
                            .grad_bytes = 4,
                            .reshard_after_forward = 1};
    return w;
}

static int load(const char *name, int world, dg_cluster_t *c) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    dg_status_t s = dg_cluster_load(path, world, c);
    CHECK(s == DG_OK, "loading %s: %s", path, dg_last_error());
    return s == DG_OK;
}

/* load(name, world) with pipelines off (max_pp 1), then dg_plan_run of w into *r, checked; 1 when loaded */
static int plan_flat(const char *name, int world, const dg_plan_workload_t *w, dg_cluster_t *c,
                     dg_plan_result_t *r) {
    if (!load(name, world, c)) return 0;
    c->max_pp = 1;
    CHECK(dg_plan_run(c, w, r) == DG_OK, "%s", dg_last_error());
    return 1;
}

/* The end of a scenario: its plans and its cluster freed */
static void plan_free(dg_cluster_t *c, dg_plan_result_t *r) {
    dg_plan_result_free(r);
    dg_cluster_free(c);
}

static const dg_plan_t *find(const dg_plan_result_t *r, int R, int S, int T, int inner) {
    for (int i = 0; i < r->n; i++) {
        const dg_plan_t *p = &r->plans[i];
        if (p->mesh.size[0] != R || p->mesh.size[1] != S || p->mesh.size[2] != T) continue;
        int eff = -1; /* innermost dimension of size > 1 */
        for (int k = DG_MESH_NDIM - 1; k >= 0 && eff < 0; k--)
            if (p->mesh.size[p->mesh.order[k]] > 1) eff = p->mesh.order[k];
        if (inner < 0 || eff == inner) return p;
    }
    return NULL;
}

static void show(const char *title, const dg_plan_result_t *r, const dg_cluster_t *c) {
    printf("\n=== %s\n", title);
    dg_plan_print(r, c, stdout, 0, 8);
}

int main(int argc, char **argv) {
    g_dir = argc > 1 ? argv[1] : "tests/planner/data";
    dg_cluster_t c;
    dg_plan_result_t r;

    /* 1 */
    dg_plan_workload_t w1 = gpt2(124439808, 12, 12, 768, 8, 64);
    if (plan_flat("nvlink-1x8.ini", 0, &w1, &c, &r)) {
        show("1 node x 8 NVLink GPUs, gpt2-124m", &r, &c);
        CHECK(r.plans[r.chosen].mesh.size[DG_MESH_TP] == 1, "chose tp=%d", r.plans[r.chosen].mesh.size[2]);
        for (int i = 0; i < r.n; i++)
            if (r.plans[i].mesh.size[DG_MESH_TP] > 1)
                CHECK(r.plans[i].hops[DG_MESH_TP] == DG_LINK_NVLINK, "tp group off NVLink (plan %d)", i);
        plan_free(&c, &r);
    }
    /* 1b: NVLink only within each socket's quad: tp=4 fits a quad when tp is innermost, tp=8 cannot */
    if (load("hybrid-1x8.ini", 0, &c)) {
        c.max_pp = 1;
        CHECK(dg_cluster_link(&c, 0, 1) == DG_LINK_NVLINK &&
                  dg_cluster_link(&c, 0, 5) == DG_LINK_CROSS_SOCKET,
              "link classes %d %d", dg_cluster_link(&c, 0, 1), dg_cluster_link(&c, 0, 5));
        dg_plan_workload_t w = gpt2(124439808, 12, 12, 768, 8, 16);
        CHECK(dg_plan_run(&c, &w, &r) == DG_OK, "%s", dg_last_error());
        const dg_plan_t *t4 = find(&r, 2, 1, 4, DG_MESH_TP), *t4x = find(&r, 2, 1, 4, DG_MESH_DP_REPLICATE);
        CHECK(t4 && t4->hops[DG_MESH_TP] == DG_LINK_NVLINK, "tp=4 innermost should stay on NVLink");
        CHECK(t4x && t4x->hops[DG_MESH_TP] > DG_LINK_NVLINK &&
                  t4x->comm_ms[DG_MESH_TP] > t4->comm_ms[DG_MESH_TP],
              "tp=4 outermost should leave NVLink and be slower");
        const dg_plan_t *p = &r.plans[r.chosen];
        if (p->mesh.size[DG_MESH_TP] > 1)
            CHECK(p->hops[DG_MESH_TP] == DG_LINK_NVLINK, "chosen tp off NVLink");
        plan_free(&c, &r);
    }
    /* 2 */
    dg_plan_workload_t w2 = gpt2(124439808, 12, 12, 768, 8, 512);
    if (plan_flat("dgx-h100-8x8.ini", 0, &w2, &c, &r)) {
        CHECK(c.world == 64, "world %d", c.world);
        show("8 nodes x 8 NVLink GPUs, 8 NDR NICs each, gpt2-124m", &r, &c);
        const dg_plan_t *p = &r.plans[r.chosen];
        CHECK(p->mesh.size[0] == 8 && p->mesh.size[1] == 8 && p->mesh.size[2] == 1, "chose R=%d S=%d T=%d",
              p->mesh.size[0], p->mesh.size[1], p->mesh.size[2]);
        CHECK(p->hops[DG_MESH_DP_SHARD] == DG_LINK_NVLINK, "dp_shard hops %d", p->hops[1]);
        CHECK(p->hops[DG_MESH_DP_REPLICATE] == DG_LINK_NETWORK, "dp_replicate hops %d", p->hops[0]);
        /* the same shape with replication innermost puts sharding traffic on the network: slower */
        const dg_plan_t *bad = find(&r, 8, 8, 1, DG_MESH_DP_REPLICATE);
        CHECK(bad && bad->comm_total_ms > p->comm_total_ms, "replicate-innermost not slower");
        plan_free(&c, &r);
    }
    /* 3 */
    dg_plan_workload_t w3 = gpt2(124439808, 12, 12, 768, 4, 64);
    if (plan_flat("pcie-2x4.ini", 0, &w3, &c, &r)) {
        show("2 PCIe-only nodes x 4 GPUs, 1 NIC each, gpt2-124m", &r, &c);
        const dg_plan_t *p = &r.plans[r.chosen];
        CHECK(p->mesh.size[DG_MESH_DP_REPLICATE] == 2, "chose R=%d", p->mesh.size[0]);
        CHECK(p->mesh.size[DG_MESH_DP_SHARD] == 4 && p->hops[DG_MESH_DP_SHARD] < DG_LINK_NETWORK,
              "dp_shard=%d hops %d", p->mesh.size[1], p->hops[1]);
        CHECK(p->hops[DG_MESH_DP_REPLICATE] == DG_LINK_NETWORK, "replication hops %d", p->hops[0]);
        plan_free(&c, &r);
    }
    /* 4 */
    dg_plan_workload_t w4 = gpt2(826368, 4, 4, 128, 4, 16); /* tiny: seq_len 128, vocab 256, f32 */
    w4.seq_len = 128;
    w4.vocab = 256;
    w4.param_bytes = 4;
    if (plan_flat("cpu-2socket.ini", 0, &w4, &c, &r)) {
        CHECK(!c.gpu_mode && c.world == 4, "gpu_mode %d world %d", c.gpu_mode, c.world);
        show("2-socket CPU node, 4 ranks, tiny", &r, &c);
        const dg_plan_t *p = &r.plans[r.chosen];
        if (p->mesh.size[DG_MESH_DP_SHARD] > 1 && p->mesh.size[DG_MESH_DP_SHARD] < 4)
            CHECK(p->hops[DG_MESH_DP_SHARD] == DG_LINK_SAME_SOCKET, "dp_shard crosses sockets");
        const dg_plan_t *hs = find(&r, 2, 2, 1, DG_MESH_DP_SHARD);
        CHECK(hs && hs->hops[DG_MESH_DP_SHARD] == DG_LINK_SAME_SOCKET &&
                  hs->hops[DG_MESH_DP_REPLICATE] == DG_LINK_CROSS_SOCKET,
              "link classes of R=2,S=2 (S innermost)");
        plan_free(&c, &r);
    }
    /* 5 */
    if (load("nvlink-1x8.ini", 0, &c)) {
        c.mem_per_rank_bytes = 16.0 * 1073741824.0;
        dg_plan_workload_t w = gpt2(1557611200, 48, 25, 1600, 1, 8);
        CHECK(dg_plan_run(&c, &w, &r) == DG_OK, "%s", dg_last_error());
        show("gpt2-1558m on 8 x 16 GiB GPUs", &r, &c);
        const dg_plan_t *ddp = find(&r, 8, 1, 1, -1);
        CHECK(ddp && !ddp->feasible && strstr(ddp->why, "GiB"), "pure DP should be infeasible (%s)",
              ddp ? ddp->why : "missing");
        const dg_plan_t *p = &r.plans[r.chosen];
        CHECK(p->feasible &&
                  p->mesh.size[DG_MESH_DP_SHARD] * p->mesh.size[DG_MESH_TP] * dg_mesh_pp(&p->mesh) >= 2,
              "chose unsharded");
        /* far too small a budget: no plan, and the error says why */
        c.mem_per_rank_bytes = 0.5 * 1073741824.0;
        dg_plan_result_free(&r);
        CHECK(dg_plan_run(&c, &w, &r) == DG_ERR_USAGE && strstr(dg_last_error(), "no feasible"), "%s",
              dg_last_error());
        plan_free(&c, &r);
    }
    /* 6 */
    dg_plan_workload_t w6 = gpt2(124439808, 12, 12, 768, 8, 192);
    if (plan_flat("dgx-h100-8x8.ini", 24, &w6, &c, &r)) {
        const dg_plan_t *p = find(&r, 8, 3, 1, DG_MESH_DP_SHARD);
        CHECK(p && p->hop_variance > 0 && p->hops[DG_MESH_DP_SHARD] == DG_LINK_NETWORK, "straddling groups");
        const dg_plan_t *q = &r.plans[r.chosen];
        CHECK(q->hop_variance == 0, "chosen plan has uneven groups (hop variance %g)", q->hop_variance);
        plan_free(&c, &r);
    }
    /* 7: gpt2-1558m (25 heads: no tp of 2, 4 or 8) on 8 x 8 H100: without a pipeline every gradient of
     * the data-parallel dimension crosses the network (or FSDP's per-micro-batch gathers run 8 times a
     * step); pp = 8 puts one stage per node, its data parallelism (8 ranks) on NVLink, and only the
     * activations of a micro-batch (3.3 MB) cross the network between stages. The bubble is the simulated
     * schedule's (a backward costs 2 forwards, the head's stage is the longest): within 2.5 x the
     * uniform-cost theory */
    if (load("dgx-h100-8x8.ini", 0, &c)) {
        CHECK(c.max_pp == 64, "described clusters score pipelines (max_pp %d)", c.max_pp);
        dg_plan_workload_t w = gpt2(1557611200, 48, 25, 1600, 1, 512);
        CHECK(dg_plan_run(&c, &w, &r) == DG_OK, "%s", dg_last_error());
        show("8 nodes x 8 H100, gpt2-1558m", &r, &c);
        const dg_plan_t *p = &r.plans[r.chosen];
        CHECK(dg_mesh_pp(&p->mesh) > 1, "chose pp=%d", dg_mesh_pp(&p->mesh));
        double th = dg_pp_bubble_theory(DG_PP_1F1B, dg_mesh_pp(&p->mesh), 1, p->pp_microbatches);
        CHECK(p->pp_bubble >= th && p->pp_bubble < 2.5 * th, "bubble %g (theory %g)", p->pp_bubble, th);
        CHECK(p->mesh.size[DG_MESH_TP] == 1, "tp %d with 25 heads", p->mesh.size[DG_MESH_TP]);
        CHECK(strstr(r.pp_reason, "pipeline chosen"), "%s", r.pp_reason);
        /* each stage's data-parallel groups stay on NVLink */
        for (int d = DG_MESH_DP_REPLICATE; d <= DG_MESH_DP_SHARD; d++)
            if (p->mesh.size[d] > 1) CHECK(p->hops[d] <= DG_LINK_NVLINK, "dp hops (dimension %d)", d);
        /* the best plan without a pipeline is slower */
        const dg_plan_t *np = NULL;
        for (int i = 0; i < r.n && !np; i++)
            if (r.plans[i].feasible && dg_mesh_pp(&r.plans[i].mesh) == 1) np = &r.plans[i];
        CHECK(np && np->step_ms > p->step_ms * 1.2, "no-pp %.2f ms vs pp %.2f ms", np ? np->step_ms : 0,
              p->step_ms);
        dg_plan_result_free(&r);
        /* the live cluster (dg_cluster_from_topo) has no executor: no pp candidate */
        c.max_pp = 1;
        CHECK(dg_plan_run(&c, &w, &r) == DG_OK, "%s", dg_last_error());
        for (int i = 0; i < r.n; i++)
            CHECK(dg_mesh_pp(&r.plans[i].mesh) == 1, "pp candidate with max_pp = 1");
        CHECK(strstr(r.pp_reason, "not considered"), "%s", r.pp_reason);
        plan_free(&c, &r);
    }
    /* 8: one node of 8 NVLink GPUs, gpt2-124m: a pipeline does not pay (its bubble over few micro-batches
     * costs more than NVLink's cheap data-parallel traffic) */
    if (load("nvlink-1x8.ini", 0, &c)) {
        dg_plan_workload_t w = gpt2(124439808, 12, 12, 768, 8, 64);
        CHECK(dg_plan_run(&c, &w, &r) == DG_OK, "%s", dg_last_error());
        const dg_plan_t *p = &r.plans[r.chosen];
        CHECK(dg_mesh_pp(&p->mesh) == 1, "chose pp=%d on one node", dg_mesh_pp(&p->mesh));
        CHECK(strstr(r.pp_reason, "pipeline rejected"), "%s", r.pp_reason);
        printf("\n=== 1 node, gpt2-124m: %s\n", r.pp_reason);
        plan_free(&c, &r);
    }
    /* bad description files */
    {
        char path[4096];
        snprintf(path, sizeof path, "%s/../bad-cluster.ini.tmp", g_dir);
        FILE *f = fopen(path, "w");
        fprintf(f, "[cluster]\nnode_xml = data/cpu-2socket.xml\nnodez = 2\n");
        fclose(f);
        CHECK(dg_cluster_load(path, 0, &c) == DG_ERR_USAGE &&
                  strstr(dg_last_error(), "unknown key [cluster] nodez"),
              "%s", dg_last_error());
        f = fopen(path, "w");
        fprintf(f, "[cluster]\nnode_xml = data/cpu-2socket.xml\nranks_per_node = 4\n");
        fclose(f);
        CHECK(dg_cluster_load(path, 6, &c) == DG_ERR_USAGE && strstr(dg_last_error(), "whole nodes"), "%s",
              dg_last_error());
        remove(path);
    }
    printf("\n%s: %d failure(s)\n", dg_fails ? "FAILED" : "OK", dg_fails);
    return dg_fails ? 1 : 0;
}
