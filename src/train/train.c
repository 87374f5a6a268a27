/* train.c — the training loop (see train.h for the step anatomy).
 *
 * Everything that may fail on one rank only (opening data, reading a checkpoint, a non-finite loss) is
 * agreed on by all ranks before anyone enters the next collective, so a failure never leaves a peer
 * waiting: setup steps end in dg_boot_agree, and every step starts with one small all-reduce that
 * carries both the stop-signal flag and any local error.
 */
#define _GNU_SOURCE
#include "train.h"

#include <errno.h>
#include <fnmatch.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "checkpoint.h"
#include "ckpt_state.h"
#include "data.h"
#include "dg_mesh.h"
#include "dg_mpi.h"
#include "fsdp.h"
#include "dg_model.h"
#include "health.h"
#include "memfit.h"
#include "planner.h"
#include "plot.h"
#include "stability.h"
#include "train_impl.h"

/* ------------------------------------------------------------------------------------------------ */
/* Setup helpers                                                                                     */
/* ------------------------------------------------------------------------------------------------ */

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
static dg_status_t run_planner(dg_boot_t *boot, const dg_config_t *c, const dg_model_desc_t *d, int max_tp,
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

/* Largest tensor parallelism the planner may choose (one node's GPUs; n_head must divide by it). */
#define DG_TRAIN_MAX_TP 8

/* The mesh: given by parallel.mesh, or chosen by the topology-SLA planner (mesh = auto). FSDP shards over
 * dp_shard, HSDP replicates over dp_replicate, tensor parallelism splits heads / MLP over tp (fsdp.h). */
static dg_status_t pick_mesh(trainer_t *tr) {
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
            DG_TRY(run_planner(tr->boot, tr->cfg, &d, DG_TRAIN_MAX_TP, &cl, &pr));
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

static dg_status_t batch_arithmetic(trainer_t *tr) {
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

/* The globs of the training and validation shards ("" val: none). */
static dg_status_t data_globs(const dg_config_t *c, char *train_glob, char *val_glob, size_t cap) {
    snprintf(train_glob, cap, "%s", c->data.train);
    snprintf(val_glob, cap, "%s", c->data.val);
    if (!c->data.train[0]) {
        char dir[DG_CFG_STR + 16];
        snprintf(dir, sizeof dir, "%s/data", c->run.dir);
        /* every rank may call it: the builder serialises on a lock file and renames atomically */
        DG_TRY(dg_data_default_paths(dir, train_glob, val_glob, cap));
        /* keep the embedded val split only when no val glob was given */
        if (c->data.val[0]) snprintf(val_glob, cap, "%s", c->data.val);
    }
    return DG_OK;
}

/* One step reads global_batch consecutive positions of the sample order; more than the data set holds
 * would read samples twice within a step (train.global_batch = 1e9 on the default data planned a
 * 192-day step). Validation must fit one batch; val_batches batches are cut to what the set holds, so
 * an evaluation never counts a sample twice. n_val < 0: no validation. */
static dg_status_t check_data_fits(const dg_config_t *c, int64_t global_batch, int seq_len, int64_t n_train,
                                   int64_t n_val, int64_t *val_batches) {
    const char *tname = c->data.train[0] ? c->data.train : "the embedded default data";
    if (global_batch > n_train)
        return DG_ERR(DG_ERR_USAGE,
                      "train.global_batch = %lld is larger than the training data: data.train (%s) yields "
                      "%lld samples of seq_len+1 = %d tokens, so one step would read every sample %.1f "
                      "times; use train.global_batch <= %lld, more data, or a smaller model.seq_len",
                      (long long)global_batch, tname, (long long)n_train, seq_len + 1,
                      (double)global_batch / (double)n_train, (long long)n_train);
    *val_batches = c->data.val_batches;
    if (n_val < 0) return DG_OK;
    const char *vname = c->data.val[0] ? c->data.val : "the embedded default data";
    if (global_batch > n_val)
        return DG_ERR(DG_ERR_USAGE,
                      "train.global_batch = %lld is larger than the validation data: data.val (%s) yields "
                      "%lld samples of seq_len+1 = %d tokens, so one validation batch would count samples "
                      "twice; use train.global_batch <= %lld, more validation data, or data.val_every = 0",
                      (long long)global_batch, vname, (long long)n_val, seq_len + 1, (long long)n_val);
    if (c->data.val_batches * global_batch > n_val) *val_batches = n_val / global_batch;
    return DG_OK;
}

static dg_status_t open_data(trainer_t *tr) {
    const dg_config_t *c = tr->cfg;
    char train_glob[4096], val_glob[4096];
    DG_TRY(data_globs(c, train_glob, val_glob, sizeof train_glob));
    snprintf(tr->train_glob, sizeof tr->train_glob, "%s", train_glob);
    DG_TRY(dg_dataset_open(train_glob, tr->desc.seq_len, tr->desc.vocab_size, &tr->train_ds));
    DG_TRY(dg_loader_create(tr->train_ds, (uint64_t)c->run.seed, c->data.shuffle, &tr->train_ld));
    if (val_glob[0] && c->data.val_every > 0) {
        DG_TRY(dg_dataset_open(val_glob, tr->desc.seq_len, tr->desc.vocab_size, &tr->val_ds));
        DG_TRY(dg_loader_create(tr->val_ds, (uint64_t)c->run.seed, 0, &tr->val_ld));
    }
    DG_TRY(check_data_fits(c, tr->global_batch, tr->desc.seq_len, dg_dataset_n_samples(tr->train_ds),
                           tr->val_ds ? dg_dataset_n_samples(tr->val_ds) : -1, &tr->val_batches));
    if (!val_glob[0] && c->data.val_every > 0) {
        /* data.train without data.val: no held-out data, so say so loudly instead of skipping silently */
        if (tr->rank == 0)
            DG_LOG_WARN(
                "no validation: data.train is set but data.val is empty, so no val_loss is reported; "
                "set data.val to a glob of held-out shards (dgprep writes them) or data.val_every = 0 "
                "to silence this");
        DG_METRICS_EVENT(tr->metrics, "health", DG_JS("kind", "no_validation"),
                         DG_JS("detail", "data.val is empty; set data.val to held-out shards"));
    }
    if (tr->val_batches < c->data.val_batches && tr->rank == 0)
        DG_LOG_WARN(
            "data.val_batches = %lld x train.global_batch = %lld needs %lld validation samples but the "
            "validation data has %lld: each evaluation reads %lld batch%s (every sample at most once)",
            (long long)c->data.val_batches, (long long)tr->global_batch,
            (long long)(c->data.val_batches * tr->global_batch), (long long)dg_dataset_n_samples(tr->val_ds),
            (long long)tr->val_batches, tr->val_batches == 1 ? "" : "es");
    return DG_OK;
}

/* Micro-steps [j0, j0+n) of the current step into tok/tgt ([n][micro_batch][seq_len] each). The data of
 * a step is read before the collectives that use it (dg_loader_fill can fail on one rank only: a shard
 * truncated under the run), and the caller agrees on the result first, so no rank is left waiting in a
 * model collective for one that stopped. */
static dg_status_t fill_micro_steps(trainer_t *tr, const dg_loader_t *ld, int j0, int n, int32_t *tok,
                                    int32_t *tgt) {
    size_t per = (size_t)tr->micro_batch * tr->desc.seq_len;
    for (int k = 0; k < n; k++)
        DG_TRY(dg_loader_fill(ld, j0 + k, tr->dp_rank, tr->dp_size, tr->micro_batch, tok + k * per,
                              tgt + k * per));
    return DG_OK;
}

/* How many micro-steps of data are read ahead at once: the whole step, up to 64 MiB of tokens and
 * targets per rank (beyond that, one extra agreement per chunk of micro-steps). */
static int data_chunk(const trainer_t *tr) {
    size_t per = (size_t)tr->micro_batch * tr->desc.seq_len * 2 * sizeof(int32_t);
    size_t n = ((size_t)64 << 20) / (per ? per : 1);
    if (n < 1) n = 1;
    return n < (size_t)tr->accum ? (int)n : tr->accum;
}

/* Agreement on a data read that happened outside the step agreement (later chunks, validation): every
 * rank learns whether any rank failed, before any of them enters the model's collectives. */
static dg_status_t agree_data(trainer_t *tr, dg_status_t st) {
    int local = st, global = 0;
    if (MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MAX, tr->comm) != MPI_SUCCESS)
        return DG_ERR(DG_ERR_PEER, "data agreement all-reduce failed at step %lld", (long long)tr->step);
    if (st) return st;
    if (global)
        return DG_ERR(DG_ERR_PEER, "another rank failed reading its data at step %lld (see its log)",
                      (long long)tr->step);
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
            if (fnmatch(pat, dg_model_param(tr->model, i)->name, 0) == 0) tr->frozen[i] = 1, hits++;
        if (!hits)
            return DG_ERR(DG_ERR_USAGE,
                          "train.freeze: pattern '%s' matches no parameter (names look like "
                          "'h.0.attn.qkv.weight', 'wte', 'ln_f.bias')",
                          pat);
    }
    for (int i = 0; i < tr->n_params; i++)
        if (tr->frozen[i]) DG_TRY(dg_model_set_frozen(tr->model, i, 1));
    return DG_OK;
}

/* Mean validation loss over val_batches global batches (the same samples at any world size). */
dg_status_t trn_run_validation(trainer_t *tr, double *loss_out) {
    dg_health_set_activity(tr->health, tr->step, "validation");
    dg_loader_reset(tr->val_ld);
    size_t per = (size_t)tr->micro_batch * tr->desc.seq_len;
    int chunk = data_chunk(tr);
    int32_t *tok = dg_xmalloc((size_t)chunk * per * sizeof(int32_t));
    int32_t *tgt = dg_xmalloc((size_t)chunk * per * sizeof(int32_t));
    double sum = 0;
    int count = 0;
    dg_status_t s = DG_OK;
    for (int64_t b = 0; b < tr->val_batches && s == DG_OK; b++) {
        for (int j = 0; j < tr->accum && s == DG_OK; j++) {
            if (j % chunk == 0) { /* read, and agree on the read, before the forward's collectives */
                int n = tr->accum - j < chunk ? tr->accum - j : chunk;
                s = agree_data(tr, fill_micro_steps(tr, tr->val_ld, j, n, tok, tgt));
                if (s) break;
            }
            float l = 0;
            size_t at = (size_t)(j % chunk) * per;
            s = dg_model_forward(tr->model, tok + at, tgt + at, &l);
            sum += l;
            count++;
        }
        dg_loader_advance(tr->val_ld, tr->global_batch);
    }
    free(tok);
    free(tgt);
    if (s) return s;
    double local[2] = {sum, (double)count}, global[2];
    DG_MPI_CHECK(MPI_Allreduce(local, global, 2, MPI_DOUBLE, MPI_SUM, tr->comm));
    *loss_out = global[0] / global[1];
    return DG_OK;
}

static void trainer_free(trainer_t *tr) {
    trn_trace_free(tr);
    trn_sla_free(tr);
    if (tr->writer) dg_ckpt_writer_free(tr->writer);
    dg_health_free(tr->health);
#ifdef DG_HAVE_CUDA
    dg_cuda_probe_free(tr->cuda_probe); /* after the monitor: no poll runs any more */
#endif
    if (tr->progress) dg_progress_free(tr->progress);
    if (tr->metrics) dg_metrics_close(tr->metrics);
    for (int k = 0; tr->ckpt_paths && k < tr->n_params * 3; k++)
        free(tr->ckpt_paths[k]);
    for (int w = 0; w < 3; w++)
        if (tr->host_flat[w]) tr->be->ops->host_free(tr->be, tr->host_flat[w]);
    free(tr->ckpt_paths);
    free(tr->ckpt_t);
    free(tr->ckpt_off);
    free(tr->frozen);
    dg_stab_free(&tr->stab);
    if (tr->val_ld) dg_loader_free(tr->val_ld);
    if (tr->train_ld) dg_loader_free(tr->train_ld);
    if (tr->val_ds) dg_dataset_free(tr->val_ds);
    if (tr->train_ds) dg_dataset_free(tr->train_ds);
    if (tr->model) dg_model_free(tr->model);
    dg_fsdp_free(tr->fsdp); /* after the model: its executor holds the comms */
    dg_backend_free(tr->be);
}

/* A collective that failed or timed out inside the model (DG_ERR_PEER, naming the collective, the
 * group, the step and the ranks that did not arrive) leaves its communicator unusable and peers possibly
 * stuck inside it: no agreement can follow, so the job ends here on every rank with exit code 3. */
static void comm_failure(trainer_t *tr, dg_status_t st) {
    if (st != DG_ERR_PEER) return;
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", dg_last_error());
    DG_LOG_ERROR("%s; ending the job on every rank (exit 3)", msg);
    DG_METRICS_EVENT(tr->metrics, "done", DG_JI("step", tr->step), DG_JS("reason", "error"),
                     DG_JS("error", msg), DG_JI("exit_code", DG_ERR_PEER));
    dg_metrics_close(tr->metrics);
    tr->metrics = NULL;
    dg_fsdp_abort(tr->fsdp, DG_ERR_PEER);
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
        dg_comm_t *cs[2 + DG_MESH_NDIM] = {cm->world, cm->dp};
        int n = 2;
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

/* ------------------------------------------------------------------------------------------------ */
/* The loop                                                                                          */
/* ------------------------------------------------------------------------------------------------ */

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
    if (strcmp(v, "auto") == 0)
        snprintf(tr->plan_cache_dir, sizeof tr->plan_cache_dir, "%s/plan_cache", c->run.dir);
    else if (v[0] == '/')
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

static dg_status_t setup(trainer_t *tr) {
    const dg_config_t *c = tr->cfg;
    DG_TRY(pick_mesh(tr));
    DG_TRY(dg_train_model_desc(c, &tr->desc));
    DG_TRY(batch_arithmetic(tr));
    if (tr->desc.n_head % tr->mesh.size[DG_MESH_TP] != 0)
        return DG_ERR(DG_ERR_USAGE, "parallel.mesh=%s: tp = %d must divide model.n_head = %d", tr->mesh_str,
                      tr->mesh.size[DG_MESH_TP], tr->desc.n_head);
    /* the backend first (parallel.comm = auto picks nccl only when every rank got a GPU of its own);
     * creating it can fail on one rank only, so the ranks agree before the collective comm setup */
    tr->cuda_device = -1;
    double t0 = dg_now_s();
    DG_TRY(dg_boot_agree(tr->boot, pick_backend(tr)));
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
    DG_TRY(open_data(tr));
    double t_data = dg_now_s();
    compile_opts(tr);
    DG_TRY(dg_fsdp_model_create(tr->fsdp, &tr->desc, tr->be, tr->micro_batch, (uint64_t)c->run.seed, 0,
                                &tr->model));
    DG_TRY(dg_model_set_grad_accum(tr->model, tr->accum));
    DG_LOG_INFO("setup: backend %.2f s, memory fit %.2f s, communicators %.2f s, run dir and data %.2f s, "
                "model %.2f s",
                t_backend - t0, t_fit - t_backend, t_comm - t_fit, t_data - t_comm, dg_now_s() - t_data);
    tr->n_params = dg_model_n_tensors(tr->model);
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

/* The one agreement per step, [local error, pending signal], before any model collective. Returns 1 when
 * the loop must stop: an error anywhere (*st set; DG_ERR_PEER on the ranks that did not fail themselves)
 * or a signal (*stop_sig). */
static int step_agreement(trainer_t *tr, dg_status_t *st, int *stop_sig) {
    int local[3] = {*st, dg_signals_pending(), tr->sla.pending}, agreed[3];
    dg_health_set_activity(tr->health, tr->step, "step agreement");
    if (MPI_Allreduce(local, agreed, 3, MPI_INT, MPI_MAX, tr->comm) != MPI_SUCCESS) {
        *st = DG_ERR(DG_ERR_PEER, "step agreement all-reduce failed at step %lld", (long long)tr->step);
        return 1;
    }
    if (agreed[0]) {
        if (!*st)
            /* DG_ERR_PEER: the failing rank's own error (of higher severity) is the one dg_boot_agree
             * reports, with its exit code */
            *st = DG_ERR(DG_ERR_PEER, "another rank failed at step %lld (see its log)", (long long)tr->step);
        return 1;
    }
    if (agreed[1]) {
        *stop_sig = agreed[1];
        return 1;
    }
    tr->sla.pending = 0;
    tr->sla.agreed = agreed[2]; /* the SLA Level-2 action every rank takes now (train_sla.h) */
    return 0;
}

/* After a step: validation every data.val_every steps (and at the last), a periodic checkpoint, and the
 * asynchronous writer's report. An error is agreed at the top of the next iteration. */
static dg_status_t after_step(trainer_t *tr) {
    const dg_config_t *c = tr->cfg;
    dg_status_t st;
    if (dg_stab_pausing(&tr->stab)) return DG_OK; /* a confirmed spike: nothing saved until the rollback */
    if (tr->val_ld && c->data.val_every > 0 &&
        (tr->step % c->data.val_every == 0 || tr->step == c->train.steps)) {
        double vl = 0;
        DG_TRY(trn_run_validation(tr, &vl));
        dg_stab_note_val(&tr->stab, vl);
        DG_METRICS_EVENT(tr->metrics, "val", DG_JI("step", tr->step), DG_JF("loss", vl),
                         DG_JI("batches", tr->val_batches));
        dg_progress_note(tr->progress, "step %lld: val loss %.4f", (long long)tr->step, vl);
        tr->sla.exclude_next = 1;
    }
    if (c->checkpoint.every > 0 && tr->step % c->checkpoint.every == 0 && tr->step < c->train.steps) {
        double t0 = dg_now_s();
        st = trn_save_checkpoint(tr, 0);
        trn_sla_note_save(tr, dg_now_s() - t0, st == DG_OK && tr->ckpt_failures == 0);
        if (st) return st;
    }
    if (tr->writer) {
        dg_ckpt_async_result_t ar = {0};
        if (dg_ckpt_writer_poll(tr->writer, &ar) == 1) trn_report_async(tr, &ar);
    }
    return DG_OK;
}

/* The forward and backward of every micro-batch of step `step` (0-based; the first `chunk` are in tok/tgt,
 * later chunks are read and agreed here); *loss_sum: the sum of the micro-batches' mean losses. */
static dg_status_t forward_backward_all(trainer_t *tr, int64_t step, int chunk, int32_t *tok, int32_t *tgt,
                                        float dloss, double *loss_sum) {
    size_t n_tok = (size_t)tr->micro_batch * tr->desc.seq_len;
    dg_status_t st = DG_OK;
    for (int j = 0; j < tr->accum && !st; j++) {
        if (j > 0 && j % chunk == 0) {
            dg_health_set_activity(tr->health, step, "reading data");
            int n = tr->accum - j < chunk ? tr->accum - j : chunk;
            st = agree_data(tr, fill_micro_steps(tr, tr->train_ld, j, n, tok, tgt));
            if (st) break;
        }
        float l = 0;
        size_t at = (size_t)(j % chunk) * n_tok;
        dg_health_set_activity(tr->health, step, "forward_backward");
        st = dg_model_forward_backward(tr->model, tok + at, tgt + at, dloss, &l);
        *loss_sum += l;
    }
    return st;
}

/* The AdamW update of step `step` (0-based) at learning rate lr; *gnorm: the gradient norm (non-finite:
 * the model skipped the update). */
static dg_status_t optimizer_step(trainer_t *tr, int64_t step, double lr, float *gnorm) {
    const dg_config_t *c = tr->cfg;
    dg_optim_hparams_t h = {.lr = (float)lr,
                            .beta1 = (float)c->train.beta1,
                            .beta2 = (float)c->train.beta2,
                            .eps = (float)c->train.eps,
                            .weight_decay = (float)c->train.weight_decay,
                            .grad_clip = (float)c->train.grad_clip,
                            .t = step + 1,
                            .inv_loss_scale = (float)(1.0 / tr->stab.loss_scale)};
    dg_health_set_activity(tr->health, step, "optimizer");
    return dg_model_optimizer_step(tr->model, &h, gnorm);
}

/* The end of the loop: the final agreement, then the final (or signal-driven) checkpoint; exit 75 after a
 * signal promises a complete checkpoint. */
static dg_status_t finish_loop(trainer_t *tr, dg_status_t st, int stop_sig) {
    /* an error after the last step's agreement (validation, checkpoint) must be agreed before the final
     * collective save, or the failing rank would leave the others waiting in it */
    int lerr = st, gerr = 0;
    if (MPI_Allreduce(&lerr, &gerr, 1, MPI_INT, MPI_MAX, tr->comm) != MPI_SUCCESS)
        return DG_ERR(DG_ERR_PEER, "final agreement all-reduce failed");
    if (st) return st;
    if (gerr)
        return DG_ERR(DG_ERR_PEER, "another rank failed at step %lld (see its log)", (long long)tr->step);

    /* final (or signal-driven) checkpoint, synchronous; exit 75 promises it, so its failure is exit 4 */
    dg_status_t s = trn_save_checkpoint(tr, 1);
    if (s == DG_ERR_STORAGE && (stop_sig || tr->sla.stop)) {
        char why[1400];
        snprintf(why, sizeof why, "%s", dg_last_error());
        return DG_ERR(DG_ERR_STORAGE,
                      "stopped on %s at step %lld without a complete checkpoint (so not exit 75): %s",
                      stop_sig ? dg_signal_name(stop_sig) : "an SLA action", (long long)tr->step, why);
    }
    if (s) return s;
    if (stop_sig) {
        DG_METRICS_EVENT(tr->metrics, "done", DG_JI("step", tr->step), DG_JS("reason", "signal"),
                         DG_JS("signal", dg_signal_name(stop_sig)), DG_JI("exit_code", DG_ERR_SIGNAL));
        DG_LOG_WARN("stopped on %s at step %lld after a complete checkpoint; exit 75 asks for a requeue",
                    dg_signal_name(stop_sig), (long long)tr->step);
        return DG_ERR(DG_ERR_SIGNAL, "stopped on %s after checkpointing step %lld", dg_signal_name(stop_sig),
                      (long long)tr->step);
    }
    if (tr->sla.stop) {
        int pause = tr->sla.stop == DG_SLA_ACT_PAUSE, code = pause ? DG_ERR_PAUSE : DG_ERR_SIGNAL;
        DG_METRICS_EVENT(tr->metrics, "done", DG_JI("step", tr->step), DG_JS("reason", "sla"),
                         DG_JS("action", dg_sla_action_name((dg_sla_action_t)tr->sla.stop)),
                         DG_JI("exit_code", code));
        return DG_ERR(code, "SLA Level-2 %s at step %lld after a complete checkpoint: exit %d %s",
                      dg_sla_action_name((dg_sla_action_t)tr->sla.stop), (long long)tr->step, code,
                      pause ? "(paused for an operator; not requeued)" : "(asks for a requeue)");
    }
    return DG_OK;
}

static dg_status_t train_loop(trainer_t *tr) {
    const dg_config_t *c = tr->cfg;
    const int T = tr->desc.seq_len;
    size_t n_tok = (size_t)tr->micro_batch * T;
    const int chunk = data_chunk(tr);
    int32_t *tok = dg_xmalloc((size_t)chunk * n_tok * sizeof(int32_t));
    int32_t *tgt = dg_xmalloc((size_t)chunk * n_tok * sizeof(int32_t));
    const double dloss_base = 1.0 / ((double)tr->global_batch * T);
    dg_status_t st = DG_OK;
    int stop_sig = 0;

    while (tr->step < c->train.steps) {
        /* this step's data (its first chunk: all of it unless the step is huge) is read before the step
         * agreement, so a failed read stops every rank there, before any model collective */
        if (!st) {
            dg_health_set_activity(tr->health, tr->step, "reading data");
            st = fill_micro_steps(tr, tr->train_ld, 0, chunk, tok, tgt);
        }
        if (step_agreement(tr, &st, &stop_sig)) break;
        if (tr->sla.agreed && trn_sla_act(tr, &st)) break;
        if (st) continue; /* a failed SLA checkpoint or rollback: agreed at the top of the next iteration */
        if (tr->trace && (st = trn_trace_boundary(tr)) != DG_OK) continue;

        dg_model_comm_stats_t cs;
        dg_model_comm_stats(tr->model, &cs, 1); /* this step's gradient-sync latency from here */
        double t0 = dg_now_s();
        int64_t step = tr->step;                /* 0-based index of the step being taken */
        dg_model_set_step(tr->model, step + 1); /* named by collective timeouts */
        dg_health_set_activity(tr->health, step, "zero_grad");
        st = dg_model_zero_grad(tr->model);
        double loss_sum = 0;
        if (!st)
            st = forward_backward_all(tr, step, chunk, tok, tgt, (float)(dloss_base * tr->stab.loss_scale),
                                      &loss_sum);
        comm_failure(tr, st);
        if (st) continue; /* agreed at the top of the next iteration */
        trn_sla_test_slow(tr, step);

        double loss_pair[1] = {loss_sum / tr->accum}, loss_glob[1];
        dg_health_set_activity(tr->health, step, "all-reduce loss");
        if (MPI_Allreduce(loss_pair, loss_glob, 1, MPI_DOUBLE, MPI_SUM, tr->comm) != MPI_SUCCESS) {
            st = DG_ERR(DG_ERR_PEER, "loss all-reduce failed at step %lld", (long long)step);
            break;
        }
        double loss = trn_hook_loss(step + 1, loss_glob[0] / tr->world);
        tr->iters++;

        dg_stab_verdict_t v = dg_stab_judge(&tr->stab, step + 1, loss);
        if (v.spike && (st = trn_spike_check(tr, step + 1))) continue; /* validation; agreed at the top */
        double lr = dg_lr_at(step, c->train.steps, c->train.lr, c->train.warmup_steps, c->train.min_lr_ratio);
        float gnorm = NAN;
        double overflow = NAN;
        if (!v.skip) {
            st = trn_hook_grad(tr, step + 1);
            if (!st) st = optimizer_step(tr, step, lr, &gnorm);
            st = trn_overflow_rate(tr, st, gnorm, &overflow); /* every rank: agrees on st and the norm */
            comm_failure(tr, st);
            if (st) continue;
        }
        dg_stab_account(&tr->stab, step + 1, loss, gnorm, overflow, &v);

        dg_loader_advance(tr->train_ld, tr->global_batch);
        tr->step++;
        tr->tokens += tr->global_batch * T;
        double dt = dg_now_s() - t0;
        double tps = (double)(tr->global_batch * T) / dt;
        dg_step_metrics_t sm = {.step = tr->step,
                                .loss = loss,
                                .lr = lr,
                                .grad_norm = gnorm,
                                .tokens = tr->tokens,
                                .tok_per_s = tps,
                                .step_ms = dt * 1e3,
                                .mfu = dg_mfu(tps / tr->world, tr->flops_per_token, tr->peak_flops),
                                .overflow_rate = isnan(overflow) ? NAN : tr->stab.overflow_rate,
                                .overflow_rate_mean = tr->stab.overflow_mean};
        dg_model_comm_stats(tr->model, &cs, 0);
        sm.grad_sync_ms = 1e3 * cs.grad_sync_s;
        dg_metrics_step(tr->metrics, &sm);
        trn_trace_step_mark(tr, tr->step, t0, t0 + dt);
        dg_metrics_set_step(tr->metrics, tr->step);
        dg_log_set_step(tr->step);
        trn_maybe_write_prom(tr, &sm);
        dg_progress_step(tr->progress, tr->step, loss, tps, dt);
        trn_sla_after_step(tr, dt, tps);
        /* the communication objectives (docs/sla.md): judged on steps above the step-time floor, where a
         * fraction of the step is not scheduling noise of a loaded host */
        if (dt >= c->sla.budget_floor_s) {
            trn_sla_feed(tr, DG_SLA_GRAD_SYNC_LATENCY, cs.grad_sync_s);
            trn_sla_feed(tr, DG_SLA_EXPOSED_COMM, (cs.wait_s + cs.blocking_s) / dt);
        }
        trn_sla_feed_step_health(tr, isnan(overflow) ? NAN : tr->stab.overflow_rate, v.spike);

        if (dg_stab_rollback_due(&tr->stab) || (dg_stab_pausing(&tr->stab) && tr->step >= c->train.steps)) {
            st = trn_stab_rollback(tr, tr->iters); /* no after_step: the checkpoint's step was done */
            continue;
        }
        st = after_step(tr);
    }
    free(tok);
    free(tgt);
    if (!st && tr->trace) trn_trace_step_end(tr, tr->step, 1); /* every rank left the loop in agreement */
    dg_progress_finish(tr->progress);
    return finish_loop(tr, st, stop_sig);
}

/* RUN_DIR/plots/ after the final metrics line of a finished run or of a stop on a signal after a complete
 * checkpoint (rank 0); a failure is a warning, never a failed run. */
static void end_of_run_plots(const char *run_dir) {
    char out[DG_CFG_STR + 8];
    snprintf(out, sizeof out, "%s/plots", run_dir);
    const char *dirs[1] = {run_dir};
    if (dg_plot_dirs(1, dirs, out, NULL) != DG_OK)
        DG_LOG_WARN("plots not written: %s", dg_last_error());
    else
        DG_LOG_INFO("plots written to %s", out);
}

dg_status_t dg_train_run(dg_boot_t *boot, const dg_config_t *cfg) {
    trainer_t tr = {0};
    tr.boot = boot;
    tr.cfg = cfg;
    tr.comm = boot->world;
    tr.rank = boot->world_rank;
    tr.world = boot->world_size;
    dg_signals_install();
    tr.sla.t_entry = dg_now_s();
    tr.sla.boot_s = trn_sla_process_age_s();

    dg_status_t s = setup(&tr);
    tr.sla.plan_s = dg_now_s() - tr.sla.t_entry;
    if (s == DG_OK) s = trn_sla_setup(&tr);
    s = dg_boot_agree(boot, s);
    if (s) {
        trainer_free(&tr);
        return s;
    }
    dg_health_opts_t hopts;
    health_opts(cfg, tr.rank, &hopts);
    s = dg_health_create_opts(tr.comm, tr.rank, boot->host, &hopts, &tr.health);
    if (s == DG_OK) {
        dg_health_set_event_sink(tr.health, health_sink, tr.metrics);
        dg_health_set_sla_sink(tr.health, health_sla_sink, tr.metrics);
        /* checkpoint I/O is judged by its progress; an aborted job leaves no half-written file */
        dg_health_set_progress_source(tr.health, trn_ckpt_progress_source, NULL);
        dg_health_set_abort_hook(tr.health, trn_ckpt_abort_hook, NULL);
        s = health_polls(&tr);
    }
    if (s == DG_OK && cfg->checkpoint.async) {
        dg_ckpt_save_opts_t o;
        trn_ckpt_save_opts(cfg, &o);
        s = dg_ckpt_writer_create(tr.comm, tr.ckpt_dir, &o, &tr.writer);
    }
    s = dg_boot_agree(boot, s);
    double t_read = dg_now_s();
    if (s == DG_OK) s = dg_boot_agree(boot, trn_maybe_resume(&tr));
    if (s == DG_OK) trn_sla_resumed(&tr, dg_now_s() - t_read);
    if (s) {
        trainer_free(&tr);
        return s;
    }

    char cfg_hash[32];
    snprintf(cfg_hash, sizeof cfg_hash, "%016llx", (unsigned long long)dg_config_hash(cfg));
    DG_METRICS_EVENT(
        tr.metrics, "start", DG_JI("world_size", tr.world), DG_JS("mesh", tr.mesh_str),
        DG_JS("backend", tr.backend_name), DG_JS("comm", tr.fsdp ? tr.fsdp->comm_backend : "none"),
        DG_JS("config_hash", cfg_hash), DG_JS("precision", cfg->train.precision),
        DG_JI("n_params", (int64_t)dg_model_n_params(&tr.desc)), DG_JI("n_layer", tr.desc.n_layer),
        DG_JI("d_model", tr.desc.d_model), DG_JI("seq_len", tr.desc.seq_len),
        DG_JI("global_batch", tr.global_batch), DG_JI("micro_batch", tr.micro_batch),
        DG_JI("grad_accum", tr.accum), DG_JI("state_bytes_per_rank", (int64_t)dg_model_state_bytes(tr.model)),
        DG_JI("arena_bytes", (int64_t)dg_model_arena_bytes(tr.model)),
        DG_JI("arena_live_peak_bytes", (int64_t)dg_model_arena_live_peak_bytes(tr.model)),
        DG_JF("arena_fragmentation", dg_model_arena_bytes(tr.model)
                                         ? 1.0 - (double)dg_model_arena_live_peak_bytes(tr.model) /
                                                     (double)dg_model_arena_bytes(tr.model)
                                         : 0.0),
        DG_JI("ops_per_step", dg_model_n_ops(tr.model)), DG_JI("start_step", tr.step),
        DG_JI("steps", cfg->train.steps), DG_JS("version", DG_VERSION_STRING),
        DG_JS("plan", tr.plan_reason[0] ? tr.plan_reason : "mesh given by parallel.mesh"),
        DG_JS("plan_cache", dg_model_build_info(tr.model)->cache),
        DG_JS("plan_cache_reason", dg_model_build_info(tr.model)->reason),
        DG_JF("plan_build_s", dg_model_build_info(tr.model)->build_s),
        DG_JF("plan_probe_s", dg_model_build_info(tr.model)->probe_s),
        DG_JF("plan_key_s", dg_model_build_info(tr.model)->key_s),
        DG_JF("graph_freeze_s", dg_now_s() - dg_model_build_info(tr.model)->frozen_at),
        DG_JS("plan_fallback", dg_model_build_info(tr.model)->fallback));
    DG_LOG_INFO(
        "training %s (%.2fM params) on %d rank(s), mesh %s, backend %s, %lld steps of %lld x %d tokens",
        cfg->model.preset, dg_model_n_params(&tr.desc) / 1e6, tr.world, tr.mesh_str, tr.backend_name,
        (long long)cfg->train.steps, (long long)tr.global_batch, tr.desc.seq_len);
    tr.progress =
        dg_progress_create(stderr, tr.rank, cfg->train.steps, cfg->train.log_every, DG_PROGRESS_AUTO);

    double t_start = dg_now_s();
    int64_t step0 = tr.step;
    s = train_loop(&tr);
    if (tr.writer) {
        dg_ckpt_async_result_t ar = {0};
        dg_status_t ws = dg_ckpt_writer_wait(tr.writer, &ar);
        trn_report_async(&tr, &ar);
        (void)ws; /* a failed background write is reported; the final synchronous save already succeeded */
    }
    s = dg_boot_agree(boot, s);
    if (s == DG_OK) {
        double el = dg_now_s() - t_start;
        /* GPU memory of this rank (rank 0 writes the line): the backend's peak allocation, comparable to
         * PyTorch's max_memory_allocated, and the device's use now; null on the CPU backend */
        double gpu_peak = NAN, gpu_used = NAN;
        /* host memory: the largest growth of any rank's resident set from the memory-fit check to its
         * peak (what the estimator predicts on CPU ranks, docs/planning.md "Memory"); collective */
        double peak = dg_mem_rss_peak(), growth = tr.rss_at_fit > 0 && peak > 0 ? peak - tr.rss_at_fit : NAN;
        double gmax = NAN;
        if (MPI_Allreduce(&growth, &gmax, 1, MPI_DOUBLE, MPI_MAX, tr.comm) != MPI_SUCCESS) gmax = NAN;
#ifdef DG_HAVE_CUDA
        dg_cuda_mem_stats_t ms;
        if (strcmp(tr.backend_name, "cuda") == 0 && dg_backend_cuda_mem_stats(tr.be, &ms) == DG_OK) {
            gpu_peak = (double)ms.peak_alloc_bytes;
            gpu_used = (double)ms.device_used_bytes;
            DG_LOG_INFO("GPU memory: peak allocated %.2f GiB, device in use %.2f of %.2f GiB",
                        gpu_peak / 1073741824.0, gpu_used / 1073741824.0,
                        ms.device_total_bytes / 1073741824.0);
        }
#endif
        DG_METRICS_EVENT(
            tr.metrics, "done", DG_JI("step", tr.step), DG_JS("reason", "finished"),
            DG_JI("tokens", tr.tokens), DG_JF("seconds", el),
            DG_JF("tok_per_s",
                  el > 0 ? (double)(tr.step - step0) * tr.global_batch * tr.desc.seq_len / el : 0),
            DG_JF("gpu_peak_alloc_bytes", gpu_peak), DG_JF("gpu_used_bytes", gpu_used),
            DG_JF("host_rss_growth_bytes", gmax), DG_JI("exit_code", 0));
    } else if (s != DG_ERR_SIGNAL && s != DG_ERR_PAUSE) { /* a pause wrote its own done event */
        DG_METRICS_EVENT(tr.metrics, "done", DG_JI("step", tr.step), DG_JS("reason", "error"),
                         DG_JS("error", dg_last_error()), DG_JI("exit_code", s));
    }
    if (tr.rank == 0 && (s == DG_OK || s == DG_ERR_SIGNAL || s == DG_ERR_PAUSE))
        end_of_run_plots(cfg->run.dir); /* also a stop */
    trainer_free(&tr);
    return s;
}

/* ------------------------------------------------------------------------------------------------ */
/* --plan-only and --dry-run                                                                         */
/* ------------------------------------------------------------------------------------------------ */

/* The planner's table (or JSON object) for --plan-only / --dry-run, rendered by rank 0 into a malloc'd
 * string; "" on other ranks. Planning for a described cluster (topology.cluster) needs no real ranks. */
static dg_status_t planner_text(dg_boot_t *boot, const dg_config_t *cfg, int json, char **text_out) {
    *text_out = dg_xstrdup("");
    if (boot->world_rank != 0) return DG_OK;
    dg_model_desc_t d;
    DG_TRY(dg_train_model_desc(cfg, &d));
    dg_cluster_t cl;
    dg_plan_result_t pr;
    DG_TRY(run_planner(boot, cfg, &d, DG_TRAIN_MAX_TP, &cl, &pr));
    char *buf = NULL;
    size_t cap = 0;
    FILE *mem = open_memstream(&buf, &cap);
    DG_ASSERT(mem != NULL);
    dg_plan_print(&pr, &cl, mem, json, json ? 0 : 12);
    fclose(mem);
    free(*text_out);
    *text_out = buf;
    dg_plan_result_free(&pr);
    dg_cluster_free(&cl);
    return DG_OK;
}

/* Each rank renders its text; rank 0 prints them in rank order, after `head` (JSON: the planner object). */
static dg_status_t gather_print(dg_boot_t *boot, const char *head, const char *text, FILE *out, int json) {
    int len = (int)strlen(text) + 1;
    int *lens = NULL, *displs = NULL;
    char *all = NULL;
    if (boot->world_rank == 0) {
        lens = dg_xcalloc((size_t)boot->world_size, sizeof(int));
        displs = dg_xcalloc((size_t)boot->world_size, sizeof(int));
    }
    DG_MPI_CHECK(MPI_Gather(&len, 1, MPI_INT, lens, 1, MPI_INT, 0, boot->world));
    if (boot->world_rank == 0) {
        int tot = 0;
        for (int r = 0; r < boot->world_size; r++)
            displs[r] = tot, tot += lens[r];
        all = dg_xmalloc((size_t)tot);
    }
    DG_MPI_CHECK(MPI_Gatherv(text, len, MPI_CHAR, all, lens, displs, MPI_CHAR, 0, boot->world));
    if (boot->world_rank == 0) {
        if (json)
            fprintf(out, "{\"planner\":%s,\"ranks\":[", head && head[0] ? head : "null");
        else if (head)
            fputs(head, out);
        for (int r = 0; r < boot->world_size; r++) {
            if (json)
                fprintf(out, "%s{\"rank\":%d,\"plan\":%s}", r ? "," : "", r, all + displs[r]);
            else
                fprintf(out, "==== rank %d ====\n%s", r, all + displs[r]);
        }
        if (json) fprintf(out, "]}\n");
        fflush(out);
    }
    free(lens);
    free(displs);
    free(all);
    return DG_OK;
}

/* What plan_model made (any part of it, after a failure). */
static void plan_free(trainer_t *tr, dg_backend_t *be) {
    if (tr->model) dg_model_free(tr->model);
    dg_fsdp_free(tr->fsdp);
    dg_backend_free(be);
}

static dg_status_t plan_model(dg_boot_t *boot, const dg_config_t *cfg, trainer_t *tr, dg_backend_t **be) {
    tr->boot = boot;
    tr->cfg = cfg;
    tr->comm = boot->world;
    tr->rank = boot->world_rank;
    tr->world = boot->world_size;
    DG_TRY(pick_mesh(tr));
    DG_TRY(dg_train_model_desc(cfg, &tr->desc));
    DG_TRY(batch_arithmetic(tr));
    dg_backend_config_t bc = {0};
    bc.act_dtype = DG_F32;
    DG_TRY(dg_backend_cpu_create(&bc, be));
    /* this rank's graph on the mesh (collectives, waits, local shard sizes), without communicators */
    dg_fsdp_opts_t fo;
    dg_fsdp_opts_from_config(cfg, &fo);
    fo.plan_only = 1;
    DG_TRY(dg_fsdp_create(tr->comm, &tr->mesh, &fo, &tr->fsdp));
    return dg_fsdp_model_create(tr->fsdp, &tr->desc, *be, tr->micro_batch, (uint64_t)cfg->run.seed,
                                DG_MODEL_PLAN_ONLY, &tr->model);
}

/* The planned activation arena of this rank's graph at every train.recompute level (plan-only models,
 * DG_RECOMPUTE_NONE .. DG_RECOMPUTE_FULL), for --dry-run. */
static dg_status_t arena_per_recompute(dg_boot_t *boot, const dg_config_t *cfg, size_t arena[4]) {
    static const char *const names[4] = {"none", "gelu", "selective", "full"};
    dg_config_t *c = dg_xmalloc(sizeof *c);
    dg_status_t s = DG_OK;
    for (int r = 0; r < 4 && s == DG_OK; r++) {
        *c = *cfg;
        c->train.recompute_id = (dg_recompute_t)r;
        snprintf(c->train.recompute, sizeof c->train.recompute, "%s", names[r]);
        trainer_t t = {0};
        dg_backend_t *be = NULL;
        s = plan_model(boot, c, &t, &be);
        if (s == DG_OK) arena[r] = dg_model_arena_bytes(t.model);
        plan_free(&t, be);
    }
    free(c);
    return s;
}

/* plan_model, agreed by all ranks; with by_rc also the arena of each train.recompute choice */
static dg_status_t plan_agreed(dg_boot_t *boot, const dg_config_t *cfg, trainer_t *tr, dg_backend_t **be,
                               size_t by_rc[4]) {
    dg_status_t s = dg_boot_agree(boot, plan_model(boot, cfg, tr, be));
    if (s == DG_OK && by_rc) s = dg_boot_agree(boot, arena_per_recompute(boot, cfg, by_rc));
    return s;
}

dg_status_t dg_train_plan_only(dg_boot_t *boot, const dg_config_t *cfg, int json, FILE *out) {
    trainer_t tr = {0};
    dg_backend_t *be = NULL;
    size_t by_rc[4] = {0};
    dg_status_t s = plan_agreed(boot, cfg, &tr, &be, json ? NULL : by_rc);
    char *buf = NULL;
    size_t cap = 0;
    if (s == DG_OK) {
        FILE *mem = open_memstream(&buf, &cap);
        DG_ASSERT(mem != NULL);
        if (!json)
            fprintf(mem,
                    "mesh %s, coordinates dp_replicate %d, dp_shard %d, tp %d; data-parallel rank %d of %d, "
                    "micro_batch %d x %d accumulation steps\n",
                    tr.mesh_str, tr.fsdp->coord[DG_MESH_DP_REPLICATE], tr.fsdp->coord[DG_MESH_DP_SHARD],
                    tr.fsdp->coord[DG_MESH_TP], tr.dp_rank, tr.dp_size, tr.micro_batch, tr.accum);
        if (!json)
            fprintf(
                mem,
                "activation arena by train.recompute (this is %s): none %zu, gelu %zu, selective %zu, full "
                "%zu bytes\n",
                cfg->train.recompute, by_rc[0], by_rc[1], by_rc[2], by_rc[3]);
        s = dg_model_print_plan(tr.model, mem, json);
        if (s == DG_OK && !json) {
            fprintf(mem, "placements (global shape; dp_replicate, dp_shard, tp; local elements; this rank's "
                         "pieces of the global tensor):\n");
            s = dg_fsdp_print_placements(tr.model, mem, 0);
        }
        fclose(mem);
    }
    s = dg_boot_agree(boot, s);
    char *head = NULL;
    if (s == DG_OK) s = dg_boot_agree(boot, planner_text(boot, cfg, json, &head));
    if (s == DG_OK) s = gather_print(boot, head, buf, out, json);
    free(head);
    free(buf);
    plan_free(&tr, be);
    return s;
}

/* --dry-run's memory-fit verdict (memfit.h), computed for host ranks (the dry run binds no GPU); JSON:
 * a "memory" object. A plan that does not fit is reported, not refused. */
static dg_status_t dg_train_dry_run_memfit(dg_boot_t *boot, const dg_config_t *cfg, trainer_t *tr, int json,
                                           FILE *out) {
    dg_mem_in_t mi;
    dg_memfit_input(cfg, &tr->desc, &tr->mesh, tr->micro_batch, 0, &mi);
    char line[1400];
    dg_status_t v = dg_memfit_check(boot->world, boot->local_size, cfg, &mi, tr->mesh_str, line, sizeof line);
    if (v != DG_OK && v != DG_ERR_USAGE) return v;
    if (boot->world_rank != 0) return DG_OK;
    dg_mem_est_t e;
    dg_mem_estimate(&mi, &e);
    if (json)
        fprintf(out,
                ",\"memory\":{\"fits\":%s,\"estimate_bytes\":%.0f,\"state\":%.0f,\"gathered\":%.0f,"
                "\"activations\":%.0f,\"logits\":%.0f,\"buckets\":%.0f}",
                v == DG_OK ? "true" : "false", e.total, e.state, e.gathered, e.activations, e.logits,
                e.buckets);
    else
        fprintf(out, "  %s\n", line);
    return DG_OK;
}

dg_status_t dg_train_dry_run_report(dg_boot_t *boot, const dg_config_t *cfg, int json, FILE *out) {
    trainer_t tr = {0};
    dg_backend_t *be = NULL;
    size_t by_rc[4] = {0};
    dg_status_t s = plan_agreed(boot, cfg, &tr, &be, by_rc);
    if (s == DG_OK && boot->world_rank == 0) {
        size_t state = dg_model_state_bytes(tr.model), arena = dg_model_arena_bytes(tr.model);
        size_t act = dg_model_activation_bytes_sum(tr.model);
        size_t whole = 0; /* the same state unsharded: f32 master, grad, m, v of every global tensor */
        for (int i = 0; i < dg_model_n_tensors(tr.model); i++)
            whole += 16 * dg_model_param(tr.model, i)->numel;
        if (json) {
            fprintf(
                out,
                "{\"model\":{\"preset\":\"%s\",\"n_layer\":%d,\"n_head\":%d,\"d_model\":%d,\"seq_len\":%d,"
                "\"vocab_size\":%d,\"padded_vocab\":%d,\"n_params\":%llu,\"flops_per_token\":%.6g},"
                "\"mesh\":\"%s\",\"global_batch\":%lld,\"micro_batch\":%d,\"grad_accum\":%d,"
                "\"per_rank_bytes\":{\"params_grads_optimizer\":%zu,\"activation_arena\":%zu,"
                "\"activations_unplanned\":%zu,\"params_grads_optimizer_unsharded\":%zu},"
                "\"activation_arena_by_recompute\":{\"none\":%zu,\"gelu\":%zu,\"selective\":%zu,\"full\":%"
                "zu}",
                cfg->model.preset, tr.desc.n_layer, tr.desc.n_head, tr.desc.d_model, tr.desc.seq_len,
                tr.desc.vocab_size, tr.desc.padded_vocab, (unsigned long long)dg_model_n_params(&tr.desc),
                dg_model_flops_per_token(&tr.desc), tr.mesh_str, (long long)tr.global_batch, tr.micro_batch,
                tr.accum, state, arena, act, whole, by_rc[0], by_rc[1], by_rc[2], by_rc[3]);
        } else {
            fprintf(out, "\nModel and memory plan\n");
            fprintf(out,
                    "  model        %s: %d layers, %d heads, d_model %d, seq_len %d, vocab %d (padded %d)\n",
                    cfg->model.preset, tr.desc.n_layer, tr.desc.n_head, tr.desc.d_model, tr.desc.seq_len,
                    tr.desc.vocab_size, tr.desc.padded_vocab);
            fprintf(out, "  parameters   %.3fM (%.3g GFLOP per token for training)\n",
                    dg_model_n_params(&tr.desc) / 1e6, dg_model_flops_per_token(&tr.desc) / 1e9);
            fprintf(out,
                    "  mesh         %s; global batch %lld = micro_batch %d x %d ranks x %d accumulation\n",
                    tr.mesh_str, (long long)tr.global_batch, tr.micro_batch, tr.dp_size, tr.accum);
            fprintf(out,
                    "  per rank     params+grads+AdamW %.2f MB (unsharded %.2f MB); activation arena %.2f MB "
                    "(%.2f MB unplanned)\n",
                    state / 1e6, whole / 1e6, arena / 1e6, act / 1e6);
            fprintf(out,
                    "  activation arena by train.recompute (this is %s): none %.2f MB, gelu %.2f MB, "
                    "selective %.2f MB, full %.2f MB\n",
                    cfg->train.recompute, by_rc[0] / 1e6, by_rc[1] / 1e6, by_rc[2] / 1e6, by_rc[3] / 1e6);
        }
    }
    char *head = NULL;
    s = dg_boot_agree(boot, s);
    if (s == DG_OK) s = dg_train_dry_run_memfit(boot, cfg, &tr, json, out);
    if (s == DG_OK) s = dg_boot_agree(boot, planner_text(boot, cfg, json, &head));
    if (boot->world_rank == 0 && tr.model) {
        if (json)
            fprintf(out, ",\"planner\":%s}\n", s == DG_OK ? head : "null");
        else if (s == DG_OK)
            fputs(head, out);
        fflush(out);
    }
    free(head);
    plan_free(&tr, be);
    return s;
}

dg_status_t dg_train_dry_run_check(dg_boot_t *boot, const dg_config_t *cfg) {
    if (boot->world_rank != 0) return DG_OK;
    dg_model_desc_t d;
    DG_TRY(dg_train_model_desc(cfg, &d));
    char train_glob[4096], val_glob[4096];
    DG_TRY(data_globs(cfg, train_glob, val_glob, sizeof train_glob));
    int64_t n_train = 0, n_val = -1, val_batches = 0;
    DG_TRY(dg_dataset_probe(train_glob, d.seq_len, &n_train));
    if (val_glob[0] && cfg->data.val_every > 0) DG_TRY(dg_dataset_probe(val_glob, d.seq_len, &n_val));
    return check_data_fits(cfg, cfg->train.global_batch, d.seq_len, n_train, n_val, &val_batches);
}
