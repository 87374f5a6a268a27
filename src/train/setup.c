/* setup.c — the trainer's setup (train_impl.h): the backend, the mesh (given, or chosen by the planner),
 * the batch arithmetic, the model and its build options (plan cache, circuit breaker, frozen parameters,
 * graph replay and fallback reports), and the health monitor with its polls and the asynchronous
 * checkpoint writer. Every failure here is the same on every rank or is agreed (dg_boot_agree) by the
 * caller before the next collective. */
#define _GNU_SOURCE
#include <fnmatch.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "pp_exec.h"
#include "train_impl.h"

int trn_is_fp16(const dg_config_t *c) {
    return c->train.precision_id == DG_PREC_FP16;
}

static dg_status_t pick_backend(trainer_t *tr) {
    const dg_config_t *c = tr->cfg;
    dg_backend_config_t bc = {0};
    const dg_precision_t pr = c->train.precision_id;
    bc.act_dtype = pr == DG_PREC_BF16 || pr == DG_PREC_FP8 ? DG_BF16 : pr == DG_PREC_FP16 ? DG_F16 : DG_F32;
    bc.fp8 = pr == DG_PREC_FP8;
    bc.threads = (int)c->parallel.threads;
    if (bc.threads == 0) {
        /* the cores this rank is bound to (mpi_boot bound it before we got here); OpenMP's own default
         * was fixed at process start, before the binding, and would oversubscribe */
        cpu_set_t set;
        bc.threads = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
        if (bc.threads < 1) bc.threads = 1;
    }
    bc.seed = (uint64_t)c->run.seed;
    bc.device = tr->boot->gpu >= 0 ? tr->boot->topo.gpus[tr->boot->gpu].cuda_index : 0;
    if (bc.device < 0) bc.device = 0;
    const dg_cfg_backend_t want = c->parallel.backend_id;
#ifdef DG_HAVE_CUDA
    if (want == DG_CFG_BACKEND_CUDA || want == DG_CFG_BACKEND_AUTO) {
        dg_status_t s = dg_backend_cuda_create(&bc, &tr->be);
        if (s == DG_OK) {
            snprintf(tr->backend_name, sizeof tr->backend_name, "cuda");
            tr->cuda_device = bc.device;
            return DG_OK;
        }
        if (want == DG_CFG_BACKEND_CUDA) return s;
        DG_LOG_INFO("parallel.backend=auto: no usable GPU (%s); using the CPU backend", dg_last_error());
        dg_clear_error();
    }
#else
    if (want == DG_CFG_BACKEND_CUDA)
        return DG_ERR(DG_ERR_USAGE, "parallel.backend=cuda, but this dgtrain was built without CUDA "
                                    "(configure with -DDGT_CUDA=ON on a machine with nvcc)");
#endif
    if (bc.act_dtype != DG_F32)
        return DG_ERR(DG_ERR_USAGE, "train.precision=%s needs the CUDA backend; the CPU backend is fp32 only",
                      c->train.precision);
    DG_TRY(dg_backend_cpu_create(&bc, &tr->be));
    snprintf(tr->backend_name, sizeof tr->backend_name, "cpu");
    tr->cuda_device = -1;
    return DG_OK;
}

/* The planner's inputs for this run: the workload from the model and batch config. */
static void plan_workload(const dg_config_t *c, const dg_model_desc_t *d, dg_plan_workload_t *w) {
    memset(w, 0, sizeof *w);
    w->n_layer = d->n_layer;
    w->n_head = d->n_head;
    w->d_model = d->d_model;
    w->seq_len = d->seq_len;
    w->vocab = d->padded_vocab;
    w->n_params = (int64_t)dg_model_n_params(d);
    w->micro_batch = (int)c->train.micro_batch;
    w->global_batch = c->train.global_batch;
    w->param_bytes = c->train.precision_id == DG_PREC_FP32 ? 4 : 2;
    w->grad_bytes = c->train.reduce_dtype_id == DG_REDUCE_BF16 ? 2 : 4;
    w->reshard_after_forward = c->parallel.reshard_after_forward;
}

/* The cluster to plan for: topology.cluster describes one that is not here (planning only); otherwise
 * this job's nodes, as hwloc saw rank 0's node, with world / nodes ranks on each. */
static dg_status_t plan_cluster(dg_boot_t *boot, const dg_config_t *c, dg_cluster_t *cl) {
    if (c->topology.cluster[0]) return dg_cluster_load(c->topology.cluster, (int)c->topology.world, cl);
    if (!boot->have_topo) return DG_ERR(DG_ERR_RUNTIME, "planner: the node topology was not loaded");
    if (boot->world_size % boot->n_nodes)
        return DG_ERR(DG_ERR_USAGE,
                      "parallel.mesh=auto: %d ranks over %d nodes is uneven; give parallel.mesh explicitly",
                      boot->world_size, boot->n_nodes);
    int rpn = boot->world_size / boot->n_nodes;
    dg_node_topo_t t = boot->topo;
    if (t.n_gpus > 0 && rpn > t.n_gpus) t.n_gpus = 0; /* more ranks than GPUs: plan them as CPU ranks */
    return dg_cluster_from_topo(&t, boot->hwtopo, boot->n_nodes, rpn, cl);
}

/* Runs the topology-SLA scorer (collective inputs are identical on every rank, so every rank computes
 * the same answer). max_tp caps tensor parallelism at what this build can run. */
dg_status_t trn_run_planner(dg_boot_t *boot, const dg_config_t *c, const dg_model_desc_t *d, int max_tp,
                            dg_cluster_t *cl, dg_plan_result_t *res) {
    DG_TRY(plan_cluster(boot, c, cl));
    if (max_tp > 0 && cl->max_tp > max_tp) cl->max_tp = max_tp;
    dg_plan_workload_t w;
    plan_workload(c, d, &w);
    dg_status_t s = dg_plan_run(cl, &w, res);
    if (s) {
        dg_plan_result_free(res);
        dg_cluster_free(cl);
    }
    return s;
}

/* The mesh: given by parallel.mesh, or chosen by the topology-SLA planner (mesh = auto). FSDP shards over
 * dp_shard, HSDP replicates over dp_replicate, tensor parallelism splits heads / MLP over tp (fsdp.h). */
dg_status_t trn_pick_mesh(trainer_t *tr) {
    int is_auto = 0;
    DG_TRY(dg_mesh_parse(tr->cfg->parallel.mesh, tr->world, &tr->mesh, &is_auto));
    if (is_auto) {
        dg_cluster_t cl;
        dg_plan_result_t pr;
        dg_model_desc_t d;
        DG_TRY(dg_train_model_desc(tr->cfg, &d));
        if (tr->world == 1 || tr->cfg->topology.cluster[0]) {
            dg_mesh_shape_t s = {{1, tr->world, 1}, {DG_MESH_DP_REPLICATE, DG_MESH_DP_SHARD, DG_MESH_TP}};
            tr->mesh = s;
            snprintf(
                tr->plan_reason, sizeof tr->plan_reason, "%s",
                tr->world == 1
                    ? "one rank: nothing to plan"
                    : "topology.cluster describes another cluster (planning only): all ranks in dp_shard");
        } else {
            DG_TRY(trn_run_planner(tr->boot, tr->cfg, &d, DG_TRAIN_MAX_TP, &cl, &pr));
            tr->mesh = pr.plans[pr.chosen].mesh;
            snprintf(tr->plan_reason, sizeof tr->plan_reason, "%s", pr.reason);
            dg_plan_result_free(&pr);
            dg_cluster_free(&cl);
        }
    }
    tr->dp_size = tr->mesh.size[DG_MESH_DP_REPLICATE] * tr->mesh.size[DG_MESH_DP_SHARD];
    int coord[DG_MESH_NDIM];
    dg_mesh_coords(&tr->mesh, tr->rank, coord);
    tr->dp_rank = coord[DG_MESH_DP_REPLICATE] * tr->mesh.size[DG_MESH_DP_SHARD] + coord[DG_MESH_DP_SHARD];
    dg_mesh_format(&tr->mesh, tr->mesh_str, sizeof tr->mesh_str);
    return DG_OK;
}

dg_status_t trn_batch_arithmetic(trainer_t *tr) {
    const dg_config_t *c = tr->cfg;
    tr->micro_batch = (int)c->train.micro_batch;
    tr->global_batch = c->train.global_batch;
    int64_t per_micro = (int64_t)tr->micro_batch * tr->dp_size;
    if (tr->global_batch % per_micro != 0)
        return DG_ERR(DG_ERR_USAGE,
                      "train.global_batch=%lld must be a multiple of train.micro_batch (%d) x data-parallel "
                      "ranks (%d) = %lld",
                      (long long)tr->global_batch, tr->micro_batch, tr->dp_size, (long long)per_micro);
    tr->accum = (int)(tr->global_batch / per_micro);
    return DG_OK;
}

/* train.freeze: comma-separated fnmatch patterns over parameter names. */
static dg_status_t match_frozen(trainer_t *tr) {
    tr->frozen = dg_xcalloc((size_t)tr->n_params, sizeof(int));
    const char *spec = tr->cfg->train.freeze;
    if (!spec[0]) return DG_OK;
    char buf[DG_CFG_STR];
    snprintf(buf, sizeof buf, "%s", spec);
    char *save = NULL;
    for (char *pat = dg_list_next(buf, &save); pat; pat = dg_list_next(NULL, &save)) {
        if (!*pat) continue;
        int hits = 0;
        for (int i = 0; i < tr->n_params; i++)
            if (fnmatch(pat, trn_param(tr, i)->name, 0) == 0) tr->frozen[i] = 1, hits++;
        if (!hits)
            return DG_ERR(DG_ERR_USAGE,
                          "train.freeze: pattern '%s' matches no parameter (names look like "
                          "'h.0.attn.qkv.weight', 'wte', 'ln_f.bias')",
                          pat);
    }
    for (int i = 0; i < tr->n_params; i++)
        if (tr->frozen[i]) DG_TRY(trn_set_frozen(tr, i, 1));
    return DG_OK;
}

/* Health events go to metrics.jsonl. */
static void health_sink(void *ctx, const char *fields) {
    dg_metrics_event_raw((dg_metrics_t *)ctx, "health", fields);
}

static void health_sla_sink(void *ctx, const char *fields) {
    dg_metrics_event_raw((dg_metrics_t *)ctx, "sla", fields);
}

/* Poll hooks on the health thread: each communicator of the mesh (ncclCommGetAsyncError on nccl; a
 * failed comm is aborted and the job exits 3 naming this rank and the reason) and, on the CUDA backend,
 * the CUDA context liveness probe. */
static dg_status_t health_polls(trainer_t *tr) {
    const dg_comm_mesh_t *cm = tr->fsdp ? tr->fsdp->comms : NULL;
    if (cm) {
        dg_comm_t *cs[4 + DG_MESH_NDIM] = {cm->world, cm->dp, cm->pp_act, cm->pp_grad};
        int n = 4;
        for (int d = 0; d < DG_MESH_NDIM; d++)
            cs[n++] = cm->dim[d];
        for (int i = 0; i < n; i++) {
            int dup = !cs[i];
            for (int j = 0; j < i && !dup; j++)
                dup = cs[j] == cs[i];
            if (!dup) DG_TRY(dg_health_add_poll(tr->health, dg_comm_health_poll, cs[i]));
        }
    }
#ifdef DG_HAVE_CUDA
    if (tr->cuda_device >= 0) {
        dg_cuda_probe_t *p = NULL;
        DG_TRY(dg_cuda_probe_create(tr->cfg->health.timeout_s, &p));
        tr->cuda_probe = p;
        DG_TRY(dg_health_add_poll(tr->health, dg_cuda_probe_poll, p));
    }
#endif
    return DG_OK;
}

/* The [health] figures; a health.heartbeat_s set by the user (deprecated) is the steady period. */
static void health_opts(const dg_config_t *cfg, int rank, dg_health_opts_t *o) {
    const char *src = dg_config_source(cfg, "health.heartbeat_s");
    *o = (dg_health_opts_t){.start_s = cfg->health.probe_start_ms / 1e3,
                            .steady_s = cfg->health.probe_steady_ms / 1e3,
                            .alert_s = cfg->health.probe_alert_ms / 1e3,
                            .good_probes = (int)cfg->health.probe_good,
                            .rtt_alert_factor = cfg->health.rtt_alert_factor,
                            .rtt_alert_min_s = cfg->health.rtt_alert_min_ms / 1e3,
                            .liveness_floor_s = cfg->health.liveness_floor_s,
                            .liveness_mult = cfg->health.liveness_mult,
                            .timeout_s = cfg->health.timeout_s};
    if (src && strcmp(src, "default") != 0) {
        o->steady_s = cfg->health.heartbeat_s;
        if (rank == 0)
            DG_LOG_WARN("health.heartbeat_s = %g (%s) is deprecated: the probe period adapts "
                        "(health.probe_start_ms/probe_steady_ms/probe_alert_ms); using it as "
                        "health.probe_steady_ms = %g",
                        cfg->health.heartbeat_s, src, 1e3 * cfg->health.heartbeat_s);
    }
}

/* Graph replay reports from the model: a recording (log), or the one-time fallback to op-by-op
 * execution (event + warning, which the model logs). */
static void graph_event(void *ctx, const char *what, const char *detail) {
    trainer_t *tr = ctx;
    if (strcmp(what, "fallback") == 0) {
        DG_METRICS_EVENT(tr->metrics, "fallback", DG_JS("kind", "cuda_graph"), DG_JI("step", tr->step + 1),
                         DG_JS("reason", detail));
    } else {
        DG_METRICS_EVENT(tr->metrics, "cuda_graph", DG_JS("status", what), DG_JI("step", tr->step + 1),
                         DG_JS("graph", detail));
        DG_LOG_INFO("step %lld: CUDA Graph recorded: %s", (long long)tr->step + 1, detail);
    }
}

/* Executor fallbacks (memory: no arena; kernel: an op run on the host), reported once each when the
 * model is set up (the executor logged the warning). */
static void exec_fallback_event(void *ctx, const char *kind, const char *reason) {
    trainer_t *tr = ctx;
    DG_METRICS_EVENT(tr->metrics, "fallback", DG_JS("kind", kind), DG_JS("id", dg_model_fallback_id(kind)),
                     DG_JI("step", tr->step + 1), DG_JS("reason", reason));
}

/* The model's plan cache and circuit breaker options (run.plan_cache, run.compile_timeout_s,
 * run.compile_mem_budget_mb; dg_model.h "plan cache and circuit breaker"). */
static void compile_opts(trainer_t *tr) {
    const dg_config_t *c = tr->cfg;
    const char *v = c->run.plan_cache;
    tr->plan_cache_dir[0] = 0;
    if (strcmp(v, "auto") == 0) {
        /* off on the CPU backend: its verification probe costs about 1000 x the build it saves
         * (docs/sla.md "Plan cache default") */
        if (tr->cuda_device >= 0)
            snprintf(tr->plan_cache_dir, sizeof tr->plan_cache_dir, "%s/plan_cache", c->run.dir);
    } else if (v[0] == '/')
        snprintf(tr->plan_cache_dir, sizeof tr->plan_cache_dir, "%s", v);
    else if (strcmp(v, "off") != 0)
        snprintf(tr->plan_cache_dir, sizeof tr->plan_cache_dir, "%s/%s", c->run.dir, v);
    tr->compile.cache_dir = tr->plan_cache_dir;
    tr->compile.timeout_s = c->run.compile_timeout_s;
    double mb = c->run.compile_mem_budget_mb, b = 0;
    if (mb > 0) {
        b = mb * 1048576.0;
    } else if (mb == 0 && c->parallel.memory_limit_mb > 0) {
        b = c->parallel.memory_limit_mb * 1048576.0;
    } else if (mb == 0 && tr->cuda_device >= 0) {
        if (dg_mem_gpu_free(&b) != DG_OK) b = 0;
    } else if (mb == 0) {
        dg_mem_avail_t a;
        int local = tr->boot->local_size > 0 ? tr->boot->local_size : 1;
        if (dg_mem_host_available(&a) == DG_OK) b = a.bytes / local;
    }
    tr->compile.mem_budget = b > 0 ? (size_t)b : 0;
    tr->fsdp->par.compile = &tr->compile;
}

dg_status_t trn_setup(trainer_t *tr) {
    const dg_config_t *c = tr->cfg;
    DG_TRY(trn_pick_mesh(tr));
    DG_TRY(dg_train_model_desc(c, &tr->desc));
    DG_TRY(trn_batch_arithmetic(tr));
    if (tr->desc.n_head % tr->mesh.size[DG_MESH_TP] != 0)
        return DG_ERR(DG_ERR_USAGE, "parallel.mesh=%s: tp = %d must divide model.n_head = %d", tr->mesh_str,
                      tr->mesh.size[DG_MESH_TP], tr->desc.n_head);
    /* the backend first (parallel.comm = auto picks nccl only when every rank got a GPU of its own);
     * creating it can fail on one rank only, so the ranks agree before the collective comm setup */
    tr->cuda_device = -1;
    double t0 = dg_now_s();
    DG_TRY(dg_boot_agree(tr->boot, pick_backend(tr)));
    /* the backend's own reservations before any model memory (CUDA: the cuBLASLt workspace, the initial
     * scratch): part of what the memory_plan objective expects, not a drift from the plan */
    size_t be_base = 0;
    if (tr->be->ops->mem_usage) tr->be->ops->mem_usage(tr->be, &be_base, NULL, 0);
    double t_backend = dg_now_s();
    /* memory fit before the large allocations: the same verdict and line on every rank (memfit.h) */
    dg_mem_in_t mi;
    dg_memfit_input(c, &tr->desc, &tr->mesh, tr->micro_batch, tr->cuda_device >= 0, &mi);
    DG_TRY(dg_memfit_check(tr->comm, tr->boot->local_size, c, &mi, tr->mesh_str, NULL, 0));
    tr->rss_at_fit = dg_mem_rss_mark(); /* the done event reports the growth from here */
    /* collective (communicator splits): before anything that can fail on one rank only, since every
     * failure so far (mesh, model sizes, batch arithmetic, the agreed backend) is the same on every rank */
    dg_fsdp_opts_t fo;
    dg_fsdp_opts_from_config(c, &fo);
    fo.cuda_device = tr->cuda_device;
    if (tr->cuda_device >= 0 && tr->boot->gpu >= 0 &&
        tr->boot->topo.gpus[tr->boot->gpu].cuda_index == tr->cuda_device)
        snprintf(fo.gpu_id, sizeof fo.gpu_id, "%s", tr->boot->topo.gpus[tr->boot->gpu].pci_busid);
    double t_fit = dg_now_s();
    DG_TRY(dg_fsdp_create(tr->comm, &tr->mesh, &fo, &tr->fsdp));
    double t_comm = dg_now_s();
    /* checkpoint.dir: "" is run.dir/checkpoints, a relative path is relative to run.dir (not to the
     * directory dgtrain happens to be started from: a requeued job may start elsewhere) */
    if (!c->checkpoint.dir[0])
        snprintf(tr->ckpt_dir, sizeof tr->ckpt_dir, "%s/checkpoints", c->run.dir);
    else if (c->checkpoint.dir[0] == '/')
        snprintf(tr->ckpt_dir, sizeof tr->ckpt_dir, "%s", c->checkpoint.dir);
    else
        snprintf(tr->ckpt_dir, sizeof tr->ckpt_dir, "%s/%s", c->run.dir, c->checkpoint.dir);
    DG_TRY(dg_metrics_open(c->run.dir, tr->rank, &tr->metrics));
    DG_TRY(trn_run_identity(tr));
    DG_TRY(trn_trace_create(tr));
    DG_TRY(trn_open_data(tr));
    double t_data = dg_now_s();
    compile_opts(tr);
    if (dg_mesh_pp(&tr->mesh) > 1) { /* this rank's chunks of the pipeline (pipeline_train.c) */
        DG_TRY(trn_pp_create(tr));
    } else {
        DG_TRY(dg_fsdp_model_create(tr->fsdp, &tr->desc, tr->be, tr->micro_batch, (uint64_t)c->run.seed, 0,
                                    &tr->model));
        DG_TRY(dg_model_set_grad_accum(tr->model, tr->accum));
    }
    tr->sla.mem_planned =
        (double)(tr->pp ? dg_pp_exec_planned_bytes(tr->pp) : dg_model_planned_bytes(tr->model)) +
        (double)be_base;
    /* a pipeline chunk runs all m = accum micro-batches of the step; a plain model its grad accumulation */
    tr->kernels_fused = tr->kernels_unfused = 0;
    for (int k = 0; k < trn_n_models(tr); k++) {
        const dg_model_t *mk = trn_model_at(tr, k);
        int64_t unfused = 0;
        tr->kernels_fused += dg_model_kernels_per_step(mk, tr->pp ? tr->accum : 0);
        DG_TRY(dg_model_unfused_kernels_per_step(mk, tr->pp ? tr->accum : 0, &unfused));
        tr->kernels_unfused += unfused;
    }
    DG_LOG_INFO("setup: backend %.2f s, memory fit %.2f s, communicators %.2f s, run dir and data %.2f s, "
                "model %.2f s",
                t_backend - t0, t_fit - t_backend, t_comm - t_fit, t_data - t_comm, dg_now_s() - t_data);
    if (!tr->pp) tr->n_params = dg_model_n_tensors(tr->model); /* a pipeline's: the whole model's */
    DG_TRY(match_frozen(tr));
    DG_TRY(trn_build_ckpt_tensors(tr));
    tr->flops_per_token = dg_model_flops_per_token(&tr->desc);
    dg_stab_opts_t so;
    trn_stab_opts(c, &so);
    dg_stab_init(&tr->stab, &so, tr->metrics);
    dg_model_set_fallback_cb(tr->model, exec_fallback_event, tr);
    dg_model_set_graph_replay(tr->model, c->parallel.cuda_graph, graph_event, tr);
    if (strcmp(tr->backend_name, "cpu") == 0) {
        int threads = c->parallel.threads > 0 ? (int)c->parallel.threads : 0;
        if (!threads) {
            cpu_set_t set;
            threads = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
        }
        tr->peak_flops = dg_peak_flops_cpu(threads);
    }
#ifdef DG_HAVE_CUDA
    if (strcmp(tr->backend_name, "cuda") == 0) {
        /* dense peak of this GPU at the run's precision (0, so MFU null, for a GPU not in the table) */
        const char *gpu = dg_backend_cuda_device_name(tr->be);
        tr->peak_flops = dg_peak_flops_gpu(gpu, c->train.precision);
        DG_LOG_INFO("GPU %s: peak %.0f TFLOP/s at %s for MFU", gpu ? gpu : "?", tr->peak_flops / 1e12,
                    c->train.precision);
    }
#endif
    return DG_OK;
}

dg_status_t trn_setup_monitors(trainer_t *tr) {
    const dg_config_t *cfg = tr->cfg;
    dg_health_opts_t hopts;
    health_opts(cfg, tr->rank, &hopts);
    dg_status_t s = dg_health_create_opts(tr->comm, tr->rank, tr->boot->host, &hopts, &tr->health);
    if (s == DG_OK) {
        dg_health_set_event_sink(tr->health, health_sink, tr->metrics);
        dg_health_set_sla_sink(tr->health, health_sla_sink, tr->metrics);
        /* checkpoint I/O is judged by its progress; an aborted job leaves no half-written file */
        dg_health_set_progress_source(tr->health, trn_ckpt_progress_source, NULL);
        dg_health_set_abort_hook(tr->health, trn_ckpt_abort_hook, NULL);
        s = health_polls(tr);
    }
    if (s == DG_OK && cfg->checkpoint.async) {
        dg_ckpt_save_opts_t o;
        trn_ckpt_save_opts(cfg, &o);
        s = dg_ckpt_writer_create(tr->comm, tr->ckpt_dir, &o, &tr->writer);
    }
    return s;
}
