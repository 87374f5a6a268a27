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
#include "dg_hf.h"
#include "data.h"
#include "dg_mesh.h"
#include "dg_mpi.h"
#include "fsdp.h"
#include "graph.h"
#include "health.h"
#include "memfit.h"
#include "planner.h"

/* ------------------------------------------------------------------------------------------------ */
/* Setup helpers                                                                                     */
/* ------------------------------------------------------------------------------------------------ */

typedef struct trainer {
    dg_boot_t *boot;
    const dg_config_t *cfg;
    MPI_Comm comm; /* world; the data-parallel group until FSDP/TP meshes arrive */
    int rank, world;
    int dp_rank, dp_size;
    dg_mesh_shape_t mesh;
    char mesh_str[128];
    char plan_reason[512]; /* why mesh = auto chose this mesh ("" when given explicitly) */

    dg_backend_t *be;
    char backend_name[16];
    int cuda_device; /* the backend's CUDA device, -1 on the CPU backend */
    dg_model_desc_t desc;
    dg_fsdp_t *fsdp; /* the mesh's communicators; the model shards itself over them */
    dg_model_t *model;
    int micro_batch, accum;
    int64_t global_batch;
    double flops_per_token, peak_flops;

    char ckpt_dir[2 * DG_CFG_STR + 32];
    int64_t val_batches; /* data.val_batches, or fewer when the validation set is smaller (open_data) */
    dg_dataset_t *train_ds, *val_ds;
    dg_loader_t *train_ld, *val_ld;
    dg_metrics_t *metrics;
    dg_progress_t *progress;
    dg_health_t *health;
    dg_ckpt_writer_t *writer;

    /* checkpoint staging: host copies of this rank's local piece of every parameter's state */
    int n_params;
    float *host_flat[3];      /* param, m, v: the model's flat buffers, page-locked (dg_model_get_flat) */
    dg_ckpt_tensor_t *ckpt_t; /* one entry per hyperslab piece of a global tensor */
    int n_ckpt;
    char **ckpt_paths;
    int *frozen; /* per parameter: matched train.freeze */

    /* loss-spike detector: moving window of accepted losses (float: what the checkpoint stores) */
    float *window;
    int64_t win_n, win_pos, consecutive_spikes;

    int64_t step;   /* optimizer steps completed */
    int64_t tokens; /* global tokens consumed */
    double loss_scale;
    int64_t good_steps;

    /* where this run segment began (a fresh start or the resume): stored with every checkpoint
     * (DG_TRAIN_KV_SEGMENT) so that loads can check tokens and the loader position exactly */
    int64_t seg_step, seg_epoch, seg_cursor;
    uint64_t seg_samples;
    char train_glob[4096]; /* the training data, as messages name it */
    int64_t ckpt_failures; /* checkpoint saves that failed in a row (agreed: every rank counts alike) */
    char ckpt_last_error[1024];
} trainer_t;

static int is_fp16(const dg_config_t *c) {
    return strcmp(c->train.precision, "fp16") == 0;
}

static dg_status_t pick_backend(trainer_t *tr) {
    const dg_config_t *c = tr->cfg;
    dg_backend_config_t bc = {0};
    bc.act_dtype = strcmp(c->train.precision, "bf16") == 0   ? DG_BF16
                   : strcmp(c->train.precision, "fp16") == 0 ? DG_F16
                                                             : DG_F32;
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
    const char *want = c->parallel.backend;
#ifdef DG_HAVE_CUDA
    if (strcmp(want, "cuda") == 0 || strcmp(want, "auto") == 0) {
        dg_status_t s = dg_backend_cuda_create(&bc, &tr->be);
        if (s == DG_OK) {
            snprintf(tr->backend_name, sizeof tr->backend_name, "cuda");
            tr->cuda_device = bc.device;
            return DG_OK;
        }
        if (strcmp(want, "cuda") == 0) return s;
        DG_LOG_INFO("parallel.backend=auto: no usable GPU (%s); using the CPU backend", dg_last_error());
        dg_clear_error();
    }
#else
    if (strcmp(want, "cuda") == 0)
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
    w->param_bytes = strcmp(c->train.precision, "fp32") == 0 ? 4 : 2;
    w->grad_bytes = strcmp(c->train.reduce_dtype, "bf16") == 0 ? 2 : 4;
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
        DG_TRY(dg_model_desc_from_config(tr->cfg, &d));
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
            DG_LOG_WARN("no validation: data.train is set but data.val is empty, so no val_loss is reported; "
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
    for (char *pat = strtok_r(buf, ",", &save); pat; pat = strtok_r(NULL, ",", &save)) {
        while (*pat == ' ')
            pat++;
        size_t L = strlen(pat);
        while (L && pat[L - 1] == ' ')
            pat[--L] = 0;
        if (!L) continue;
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

/* The checkpoint's view of this rank's state: every parameter and both AdamW moments are global
 * datasets; this rank contributes the hyperslab pieces of its local shard (FSDP rows, tp segments), and
 * exactly one rank writes each piece (replicas over dp_replicate and tp-replicated tensors are read by
 * all but written once). A rank with no piece of a tensor lists an empty one, so every rank names the
 * tensors in the same order. Any mesh can load what any other wrote. */
static dg_status_t build_ckpt_tensors(trainer_t *tr) {
    int n = tr->n_params;
    size_t flat = dg_model_flat_numel(tr->model);
    for (int w = 0; w < 3; w++) { /* zeroed: alignment gaps stay zero on a resume, and the pages exist */
        DG_TRY(tr->be->ops->host_alloc(tr->be, (flat + 1) * sizeof(float), (void **)&tr->host_flat[w]));
        memset(tr->host_flat[w], 0, (flat + 1) * sizeof(float));
    }
    tr->ckpt_t = dg_xcalloc((size_t)n * 3 * DG_MODEL_MAX_PIECES, sizeof(dg_ckpt_tensor_t));
    tr->ckpt_paths = dg_xcalloc((size_t)n * 3, sizeof(char *));
    tr->n_ckpt = 0;
    for (int i = 0; i < n; i++) {
        const dg_param_info_t *p = dg_model_param(tr->model, i);
        dg_model_piece_t pc[DG_MODEL_MAX_PIECES];
        int np = dg_model_local_pieces(tr->model, i, pc);
        int owner = dg_model_piece_owner(tr->model, i);
        for (int w = 0; w < 3; w++) {
            int k = i * 3 + w;
            float *local = tr->host_flat[w] + dg_model_flat_offset(tr->model, i); /* this rank's piece */
            char path[512];
            if (w == 0)
                snprintf(path, sizeof path, "model/%s", p->name);
            else
                snprintf(path, sizeof path, "optim/%s/%s", p->name, w == 1 ? "m" : "v");
            tr->ckpt_paths[k] = dg_xstrdup(path);
            for (int j = 0; j < (np ? np : 1); j++) {
                dg_ckpt_tensor_t *t = &tr->ckpt_t[tr->n_ckpt++];
                t->path = tr->ckpt_paths[k];
                t->ndim = p->ndim;
                for (int d = 0; d < p->ndim; d++) {
                    t->gshape[d] = p->shape[d];
                    t->start[d] = np ? pc[j].start[d] : 0;
                    t->count[d] = np ? pc[j].count[d] : 0;
                }
                t->owner = owner && np > 0;
                t->data = local + (np ? pc[j].offset : 0);
            }
        }
    }
    return DG_OK;
}

static const int k_state_of[3] = {DG_STATE_PARAM, DG_STATE_ADAM_M, DG_STATE_ADAM_V};

/* The whole local state in three copies (one per flat buffer) into page-locked memory. */
static dg_status_t pull_state(trainer_t *tr) {
    for (int w = 0; w < 3; w++)
        DG_TRY(dg_model_get_flat(tr->model, k_state_of[w], tr->host_flat[w]));
    return DG_OK;
}

static dg_status_t push_state(trainer_t *tr) {
    for (int w = 0; w < 3; w++)
        DG_TRY(dg_model_set_flat(tr->model, k_state_of[w], tr->host_flat[w]));
    return DG_OK;
}

/* The loss-spike detector's state travels in the checkpoint's key/value table so that a resumed run
 * makes the same skip decisions: "spike_state" = "window n pos consecutive", then the window's float32
 * values as hex words, SPIKE_PER_KV per "spike_window_K" entry. */
#define SPIKE_PER_KV 48
static void save_spike_state(trainer_t *tr, dg_ckpt_meta_t *m) {
    int64_t W = tr->cfg->train.spike_window;
    if (tr->cfg->train.spike_factor <= 0 || W <= 0) return;
    char buf[448];
    snprintf(buf, sizeof buf, "%lld %lld %lld %lld", (long long)W, (long long)tr->win_n,
             (long long)tr->win_pos, (long long)tr->consecutive_spikes);
    if (dg_ckpt_meta_set_kv(m, "spike_state", buf) != DG_OK) return;
    for (int64_t k = 0; k * SPIKE_PER_KV < W; k++) {
        size_t len = 0;
        for (int64_t i = k * SPIKE_PER_KV; i < W && i < (k + 1) * SPIKE_PER_KV; i++) {
            uint32_t u;
            memcpy(&u, &tr->window[i], sizeof u);
            len += (size_t)snprintf(buf + len, sizeof buf - len, "%08x", u);
        }
        char key[32];
        snprintf(key, sizeof key, "spike_window_%lld", (long long)k);
        if (dg_ckpt_meta_set_kv(m, key, buf) != DG_OK) {
            DG_LOG_WARN("checkpoint: loss-spike window too long to store (%s); a resume starts it empty",
                        dg_last_error());
            dg_ckpt_meta_set_kv(m, "spike_state", "");
            return;
        }
    }
}

/* Restores what save_spike_state wrote; a missing or mismatching state leaves the detector empty. */
static void load_spike_state(trainer_t *tr, const dg_ckpt_meta_t *m) {
    int64_t W = tr->cfg->train.spike_window;
    const char *st = dg_ckpt_meta_get_kv(m, "spike_state");
    if (tr->cfg->train.spike_factor <= 0 || W <= 0 || !st || !st[0]) return;
    long long w, n, pos, cons;
    if (sscanf(st, "%lld %lld %lld %lld", &w, &n, &pos, &cons) != 4 || w != W || n < 0 || n > W || pos < 0 ||
        pos >= W) {
        DG_LOG_WARN(
            "checkpoint: loss-spike state '%s' does not fit train.spike_window=%lld; starting it empty", st,
            (long long)W);
        return;
    }
    for (int64_t k = 0; k * SPIKE_PER_KV < W; k++) {
        char key[32];
        snprintf(key, sizeof key, "spike_window_%lld", (long long)k);
        const char *hex = dg_ckpt_meta_get_kv(m, key);
        for (int64_t i = k * SPIKE_PER_KV; i < W && i < (k + 1) * SPIKE_PER_KV; i++) {
            unsigned u = 0;
            size_t at = (size_t)(8 * (i - k * SPIKE_PER_KV));
            if (!hex || strlen(hex) < at + 8 || sscanf(hex + at, "%8x", &u) != 1) {
                DG_LOG_WARN("checkpoint: loss-spike window entry %s is damaged; starting it empty", key);
                tr->win_n = tr->win_pos = tr->consecutive_spikes = 0;
                return;
            }
            uint32_t u32 = u;
            memcpy(&tr->window[i], &u32, sizeof u32);
        }
    }
    tr->win_n = n;
    tr->win_pos = pos;
    tr->consecutive_spikes = cons;
}

static void fill_meta(trainer_t *tr, dg_ckpt_meta_t *m) {
    dg_ckpt_meta_init(m);
    m->step = tr->step;
    m->tokens = tr->tokens;
    snprintf(m->mesh, sizeof m->mesh, "%s", tr->mesh_str);
    char *ini = dg_config_to_ini(tr->cfg);
    dg_ckpt_meta_set_config(m, ini);
    free(ini);
    dg_loader_state_t ls;
    dg_loader_get_state(tr->train_ld, &ls);
    m->loader.epoch = ls.epoch;
    m->loader.cursor = ls.cursor;
    m->loader.samples_seen = ls.samples_seen;
    m->scaler.scale = tr->loss_scale;
    m->scaler.good_steps = tr->good_steps;
    char fp[32];
    snprintf(fp, sizeof fp, "%016llx", (unsigned long long)dg_dataset_fingerprint(tr->train_ds));
    dg_ckpt_meta_set_kv(m, "data_fingerprint", fp);
    dg_ckpt_meta_set_kv(m, "backend", tr->backend_name);
    dg_ckpt_meta_set_kv(m, "precision", tr->cfg->train.precision);
    char seg[128];
    snprintf(seg, sizeof seg, "%lld %llu %lld %lld", (long long)tr->seg_step,
             (unsigned long long)tr->seg_samples, (long long)tr->seg_epoch, (long long)tr->seg_cursor);
    dg_ckpt_meta_set_kv(m, DG_TRAIN_KV_SEGMENT, seg);
    save_spike_state(tr, m);
}

static void emit_ckpt_event(trainer_t *tr, const dg_ckpt_save_result_t *r, double stall_ms, int async) {
    DG_METRICS_EVENT(tr->metrics, "checkpoint", DG_JI("step", r->step), DG_JS("path", r->path),
                     DG_JI("bytes", r->bytes), DG_JF("seconds", r->seconds), DG_JF("stall_ms", stall_ms),
                     DG_JB("async", async), DG_JI("linked_bytes", r->linked_bytes));
    dg_progress_note(tr->progress, "checkpoint step %lld -> %s (%.1f MB, %.2f s, stall %.0f ms)",
                     (long long)r->step, r->path, r->bytes / 1e6, r->seconds, stall_ms);
}

/* A save that failed: counted (checkpoint.max_failures in a row stop the run), logged on every rank,
 * and reported as a `checkpoint` event with ok = false and a `health` event of kind checkpoint_failed
 * that names the space needed when space ran out. LATEST still names the last complete checkpoint. */
static void note_save_failure(trainer_t *tr, int64_t step, const char *err, const dg_ckpt_save_result_t *r,
                              int async) {
    tr->ckpt_failures++;
    snprintf(tr->ckpt_last_error, sizeof tr->ckpt_last_error, "%s", err);
    char latest[256] = "none";
    FILE *f = NULL;
    char lp[sizeof tr->ckpt_dir + 16];
    snprintf(lp, sizeof lp, "%s/LATEST", tr->ckpt_dir);
    if ((f = fopen(lp, "r"))) {
        if (fgets(latest, sizeof latest, f)) latest[strcspn(latest, "\n")] = 0;
        fclose(f);
    }
    const int64_t max = tr->cfg->checkpoint.max_failures;
    /* every rank knows it (its log file says so); rank 0 says it on stderr */
    const dg_log_level_t lv = tr->rank == 0 ? DG_LOG_WARN : DG_LOG_INFO;
    if (r && r->no_space && r->free_bytes < 0)
        dg_log(lv,
               "checkpoint of step %lld not saved: %s ran out of space (%s); it needs about %.1f MB free; "
               "LATEST still names %s; training goes on and the next checkpoint retries (%lld of "
               "checkpoint.max_failures=%lld failed saves in a row)",
               (long long)step, tr->ckpt_dir, err, r->needed_bytes / 1e6, latest,
               (long long)tr->ckpt_failures, (long long)max);
    else if (r && r->no_space)
        dg_log(
            lv,
            "checkpoint of step %lld not saved: %s needs about %.1f MB free, it has %.1f MB; free at least "
            "%.1f MB (or lower checkpoint.keep); LATEST still names %s; training goes on and the next "
            "checkpoint retries (%lld of checkpoint.max_failures=%lld failed saves in a row)",
            (long long)step, tr->ckpt_dir, r->needed_bytes / 1e6, r->free_bytes / 1e6,
            (r->needed_bytes - r->free_bytes) / 1e6, latest, (long long)tr->ckpt_failures, (long long)max);
    else
        dg_log(lv,
               "checkpoint of step %lld not saved (%s); LATEST still names %s; training goes on and the next "
               "checkpoint retries (%lld of checkpoint.max_failures=%lld failed saves in a row)",
               (long long)step, err, latest, (long long)tr->ckpt_failures, (long long)max);
    DG_METRICS_EVENT(tr->metrics, "checkpoint", DG_JI("step", step), DG_JB("ok", 0), DG_JS("error", err),
                     DG_JB("async", async));
    DG_METRICS_EVENT(tr->metrics, "health", DG_JS("kind", "checkpoint_failed"), DG_JI("step", step),
                     DG_JS("reason", r && r->no_space ? "no_space" : "error"), DG_JS("error", err),
                     DG_JI("needed_bytes", r ? r->needed_bytes : 0),
                     DG_JI("free_bytes", r ? r->free_bytes : -1), DG_JS("latest", latest),
                     DG_JI("consecutive", tr->ckpt_failures), DG_JI("max_failures", max));
}

static void report_async(trainer_t *tr, const dg_ckpt_async_result_t *ar) {
    if (!ar->valid) return;
    if (ar->status == DG_OK) {
        tr->ckpt_failures = 0;
        emit_ckpt_event(tr, &ar->res, ar->res.stall_ms, 1);
    } else {
        note_save_failure(tr, ar->res.step, ar->error, &ar->res, 1);
    }
}

/* checkpoint.max_failures saves in a row failed: stop (exit 4; slurm/train.sh does not requeue it). */
static dg_status_t storage_exhausted(trainer_t *tr) {
    return DG_ERR(
        DG_ERR_STORAGE,
        "checkpoints could not be saved %lld times in a row (checkpoint.max_failures=%lld) in %s; the "
        "last failure: %s; stopping with exit code 4 (the newest complete checkpoint, which LATEST "
        "names, is kept: free space there, then run again to resume)",
        (long long)tr->ckpt_failures, (long long)tr->cfg->checkpoint.max_failures, tr->ckpt_dir,
        tr->ckpt_last_error);
}

static uint64_t ckpt_progress_source(void *ctx, int *waiting) {
    (void)ctx;
    *waiting = dg_ckpt_waiting();
    return dg_ckpt_progress();
}

static void ckpt_abort_hook(void *ctx) {
    (void)ctx;
    dg_ckpt_abort_cleanup();
}

/* Save the current state. sync_only forces a synchronous write (signals, the end of the run), whose
 * failure is returned as DG_ERR_STORAGE (the run cannot end with the checkpoint it promises). A periodic
 * save that fails is noted (note_save_failure) and training goes on: DG_OK, unless that was the
 * checkpoint.max_failures-th failure in a row (DG_ERR_STORAGE). A failure that ends the job anyway (a
 * peer lost in a collective: DG_ERR_PEER) is returned as is.
 * The watchdog judges the save by its progress (dg_health_set_io_activity, docs/checkpoints.md): a save
 * that keeps writing may take as long as it needs. */
static dg_status_t save_checkpoint(trainer_t *tr, int sync_only) {
    dg_health_set_io_activity(tr->health, tr->step, "checkpoint");
    double t0 = dg_now_s();
    /* the background write of the previous checkpoint reads host_flat: it must finish before the pull
     * (its failure is counted like a synchronous one) */
    if (tr->writer) {
        dg_ckpt_async_result_t prev = {0};
        dg_ckpt_writer_wait(tr->writer, &prev);
        report_async(tr, &prev);
        if (prev.valid && prev.status == DG_ERR_PEER) return DG_ERR(DG_ERR_PEER, "%s", prev.error);
    }
    if (!sync_only && tr->ckpt_failures >= tr->cfg->checkpoint.max_failures) return storage_exhausted(tr);
    DG_TRY(pull_state(tr));
    dg_ckpt_meta_t meta;
    fill_meta(tr, &meta);
    dg_status_t s = DG_OK;
    if (tr->writer && !sync_only) {
        /* no second copy: the writer reads the page-locked host_flat, which nothing touches until the
         * next save (which waits above), a rollback (waits first) or the end (waits) */
        double stall = 0;
        s = dg_ckpt_writer_submit_borrowed(tr->writer, &meta, tr->ckpt_t, tr->n_ckpt, t0, &stall, NULL);
        dg_ckpt_meta_destroy(&meta);
        return s;
    }
    dg_ckpt_save_opts_t o;
    dg_ckpt_save_opts_default(&o);
    o.keep = (int)tr->cfg->checkpoint.keep;
    o.incremental = tr->cfg->checkpoint.incremental;
    dg_ckpt_save_result_t r;
    s = dg_ckpt_save(tr->comm, tr->ckpt_dir, &meta, tr->ckpt_t, tr->n_ckpt, &o, &r);
    dg_ckpt_meta_destroy(&meta);
    if (s == DG_OK) {
        tr->ckpt_failures = 0;
        emit_ckpt_event(tr, &r, (dg_now_s() - t0) * 1e3, 0);
        return DG_OK;
    }
    if (s == DG_ERR_PEER) return s;
    char err[1024];
    snprintf(err, sizeof err, "%s", dg_last_error()); /* copied: the next DG_ERR writes into that buffer */
    note_save_failure(tr, tr->step, err, &r, 0);
    if (sync_only)
        return DG_ERR(
            DG_ERR_STORAGE,
            "the checkpoint of step %lld could not be saved: %s; stopping with exit code 4 (the newest "
            "complete checkpoint, which LATEST names, is kept)",
            (long long)tr->step, err);
    if (tr->ckpt_failures >= tr->cfg->checkpoint.max_failures) return storage_exhausted(tr);
    return DG_OK;
}

/* Resume per checkpoint.resume. Collective; sets step/tokens/loader/scaler and the model state. Every
 * candidate's scalar state is checked against this run's model and data and against the schedule it was
 * written under (ckpt_state.h) before its tensors are read: an impossible value rejects the file like a
 * checksum failure does (auto: fall back to the previous checkpoint; an explicit file: exit 1). With
 * nothing to resume from, model.init (dg_hf.h) sets the weights of the fresh run; a resume wins over it. */
static dg_status_t maybe_resume(trainer_t *tr) {
    dg_health_set_io_activity(tr->health, tr->step, "resume: reading checkpoint");
    dg_ckpt_meta_t meta;
    dg_ckpt_meta_init(&meta);
    char path[4096] = "";
    dg_train_ckpt_ref_t ref = {tr->desc.seq_len, tr->train_ds, tr->train_glob};
    dg_status_t s =
        dg_ckpt_resume_checked(tr->comm, tr->ckpt_dir, tr->cfg->checkpoint.resume, dg_train_ckpt_check_fn,
                               &ref, &meta, tr->ckpt_t, tr->n_ckpt, path, sizeof path);
    if (s != DG_OK || !path[0]) {
        dg_ckpt_meta_destroy(&meta);
        return s == DG_OK ? dg_model_init_weights(tr->model, tr->cfg->model.init) : s; /* a fresh run */
    }
    if (tr->cfg->model.init[0]) DG_LOG_INFO("init: resuming from %s; model.init ignored", path);
    const char *fp = dg_ckpt_meta_get_kv(&meta, "data_fingerprint");
    char now_fp[32];
    snprintf(now_fp, sizeof now_fp, "%016llx", (unsigned long long)dg_dataset_fingerprint(tr->train_ds));
    if (fp && strcmp(fp, now_fp) != 0)
        DG_LOG_WARN(
            "resuming from %s: the training data changed since it was written (fingerprint %s, now %s); "
            "the sample order continues from the saved cursor",
            path, fp, now_fp);
    s = push_state(tr);
    if (s == DG_OK) {
        tr->step = meta.step;
        tr->tokens = meta.tokens;
        dg_loader_state_t ls = {meta.loader.epoch, meta.loader.cursor, meta.loader.samples_seen};
        s = dg_loader_set_state(tr->train_ld, &ls);
        if (s != DG_OK) {
            /* (checked above; kept for a loader with rules of its own) copied first: DG_ERR writes into
             * the buffer dg_last_error() returns */
            char why[1024];
            snprintf(why, sizeof why, "%s", dg_last_error());
            s = DG_ERR(DG_ERR_USAGE, "checkpoint %s: data-loader state does not fit the data set: %s", path,
                       why);
        }
        /* the loss scaler belongs to fp16 runs: another precision starts without one */
        if (is_fp16(tr->cfg)) {
            tr->loss_scale = meta.scaler.scale > 0 ? meta.scaler.scale : tr->loss_scale;
            tr->good_steps = meta.scaler.good_steps;
        }
        load_spike_state(tr, &meta);
        tr->seg_step = tr->step;
        tr->seg_samples = ls.samples_seen;
        tr->seg_epoch = ls.epoch;
        tr->seg_cursor = ls.cursor;
    }
    if (s == DG_OK) {
        DG_METRICS_EVENT(tr->metrics, "resume", DG_JI("step", tr->step), DG_JS("path", path),
                         DG_JI("from_world_size", meta.world_size), DG_JI("to_world_size", tr->world),
                         DG_JS("from_mesh", meta.mesh), DG_JS("to_mesh", tr->mesh_str),
                         DG_JI("tokens", tr->tokens));
        DG_LOG_INFO("resumed from %s at step %lld (written by %d ranks, now %d)", path, (long long)tr->step,
                    meta.world_size, tr->world);
    }
    dg_ckpt_meta_destroy(&meta);
    return s;
}

/* Rolls back the model and optimizer to the newest checkpoint, keeping the data cursor (so training
 * continues with the next data rather than replaying the batches that spiked). The candidates are
 * checked as on a resume. */
static dg_status_t rollback(trainer_t *tr) {
    dg_health_set_io_activity(tr->health, tr->step, "rollback: reading checkpoint");
    if (tr->writer) {
        dg_ckpt_async_result_t prev = {0};
        dg_ckpt_writer_wait(tr->writer, &prev);
        report_async(tr, &prev);
    }
    dg_ckpt_meta_t meta;
    dg_ckpt_meta_init(&meta);
    char path[4096] = "";
    dg_train_ckpt_ref_t ref = {tr->desc.seq_len, tr->train_ds, tr->train_glob};
    DG_TRY(dg_ckpt_resume_checked(tr->comm, tr->ckpt_dir, "auto", dg_train_ckpt_check_fn, &ref, &meta,
                                  tr->ckpt_t, tr->n_ckpt, path, sizeof path));
    if (!path[0]) {
        dg_ckpt_meta_destroy(&meta);
        return DG_ERR(DG_ERR_RUNTIME,
                      "loss spikes: %lld in a row and no checkpoint to roll back to "
                      "(set checkpoint.every)",
                      (long long)tr->cfg->train.spike_max_consecutive);
    }
    DG_TRY(push_state(tr));
    DG_METRICS_EVENT(tr->metrics, "health", DG_JS("kind", "rollback"), DG_JI("step", tr->step),
                     DG_JS("path", path), DG_JI("to_step", meta.step));
    DG_LOG_WARN("loss spikes: rolled the weights back to %s (step %lld); continuing with the next data", path,
                (long long)meta.step);
    dg_ckpt_meta_destroy(&meta);
    return DG_OK;
}

/* Mean validation loss over val_batches global batches (the same samples at any world size). */
static dg_status_t run_validation(trainer_t *tr, double *loss_out) {
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
    if (tr->writer) dg_ckpt_writer_free(tr->writer);
    dg_health_free(tr->health);
    if (tr->progress) dg_progress_free(tr->progress);
    if (tr->metrics) dg_metrics_close(tr->metrics);
    for (int k = 0; tr->ckpt_paths && k < tr->n_params * 3; k++)
        free(tr->ckpt_paths[k]);
    for (int w = 0; w < 3; w++)
        if (tr->host_flat[w]) tr->be->ops->host_free(tr->be, tr->host_flat[w]);
    free(tr->ckpt_paths);
    free(tr->ckpt_t);
    free(tr->frozen);
    free(tr->window);
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
    DG_METRICS_EVENT(tr->metrics, "fallback", DG_JS("kind", kind), DG_JI("step", tr->step + 1),
                     DG_JS("reason", reason));
}

static dg_status_t setup(trainer_t *tr) {
    const dg_config_t *c = tr->cfg;
    DG_TRY(pick_mesh(tr));
    DG_TRY(dg_model_desc_from_config(c, &tr->desc));
    DG_TRY(batch_arithmetic(tr));
    if (tr->desc.n_head % tr->mesh.size[DG_MESH_TP] != 0)
        return DG_ERR(DG_ERR_USAGE, "parallel.mesh=%s: tp = %d must divide model.n_head = %d", tr->mesh_str,
                      tr->mesh.size[DG_MESH_TP], tr->desc.n_head);
    /* the backend first (parallel.comm = auto picks nccl only when every rank got a GPU of its own);
     * creating it can fail on one rank only, so the ranks agree before the collective comm setup */
    tr->cuda_device = -1;
    DG_TRY(dg_boot_agree(tr->boot, pick_backend(tr)));
    /* memory fit before the large allocations: the same verdict and line on every rank (memfit.h) */
    dg_mem_in_t mi;
    dg_memfit_input(c, &tr->desc, &tr->mesh, tr->micro_batch, tr->cuda_device >= 0, &mi);
    DG_TRY(dg_memfit_check(tr->comm, tr->boot->local_size, c, &mi, tr->mesh_str, NULL, 0));
    /* collective (communicator splits): before anything that can fail on one rank only, since every
     * failure so far (mesh, model sizes, batch arithmetic, the agreed backend) is the same on every rank */
    dg_fsdp_opts_t fo;
    dg_fsdp_opts_from_config(c, &fo);
    fo.cuda_device = tr->cuda_device;
    if (tr->cuda_device >= 0 && tr->boot->gpu >= 0 &&
        tr->boot->topo.gpus[tr->boot->gpu].cuda_index == tr->cuda_device)
        snprintf(fo.gpu_id, sizeof fo.gpu_id, "%s", tr->boot->topo.gpus[tr->boot->gpu].pci_busid);
    DG_TRY(dg_fsdp_create(tr->comm, &tr->mesh, &fo, &tr->fsdp));
    /* checkpoint.dir: "" is run.dir/checkpoints, a relative path is relative to run.dir (not to the
     * directory dgtrain happens to be started from: a requeued job may start elsewhere) */
    if (!c->checkpoint.dir[0])
        snprintf(tr->ckpt_dir, sizeof tr->ckpt_dir, "%s/checkpoints", c->run.dir);
    else if (c->checkpoint.dir[0] == '/')
        snprintf(tr->ckpt_dir, sizeof tr->ckpt_dir, "%s", c->checkpoint.dir);
    else
        snprintf(tr->ckpt_dir, sizeof tr->ckpt_dir, "%s/%s", c->run.dir, c->checkpoint.dir);
    DG_TRY(dg_metrics_open(c->run.dir, tr->rank, &tr->metrics));
    DG_TRY(open_data(tr));
    DG_TRY(dg_fsdp_model_create(tr->fsdp, &tr->desc, tr->be, tr->micro_batch, (uint64_t)c->run.seed, 0,
                                &tr->model));
    DG_TRY(dg_model_set_grad_accum(tr->model, tr->accum));
    tr->n_params = dg_model_n_tensors(tr->model);
    DG_TRY(match_frozen(tr));
    DG_TRY(build_ckpt_tensors(tr));
    tr->flops_per_token = dg_model_flops_per_token(&tr->desc);
    tr->window = dg_xcalloc((size_t)(c->train.spike_window > 0 ? c->train.spike_window : 1), sizeof(float));
    tr->loss_scale = is_fp16(c) ? c->train.loss_scale_init : 1.0;
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
        /* one agreement per step: [local error, pending signal] */
        int local[2] = {st, dg_signals_pending()}, agreed[2];
        dg_health_set_activity(tr->health, tr->step, "step agreement");
        if (MPI_Allreduce(local, agreed, 2, MPI_INT, MPI_MAX, tr->comm) != MPI_SUCCESS) {
            st = DG_ERR(DG_ERR_PEER, "step agreement all-reduce failed at step %lld", (long long)tr->step);
            break;
        }
        if (agreed[0]) {
            if (!st)
                /* DG_ERR_PEER: the failing rank's own error (of higher severity) is the one dg_boot_agree
                 * reports, with its exit code */
                st = DG_ERR(DG_ERR_PEER, "another rank failed at step %lld (see its log)",
                            (long long)tr->step);
            break;
        }
        if (agreed[1]) {
            stop_sig = agreed[1];
            break;
        }

        double t0 = dg_now_s();
        int64_t step = tr->step;                /* 0-based index of the step being taken */
        dg_model_set_step(tr->model, step + 1); /* named by collective timeouts */
        dg_health_set_activity(tr->health, step, "zero_grad");
        st = dg_model_zero_grad(tr->model);
        double loss_sum = 0;
        float dloss = (float)(dloss_base * tr->loss_scale);
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
            loss_sum += l;
        }
        comm_failure(tr, st);
        if (st) continue; /* agreed at the top of the next iteration */

        double loss_pair[1] = {loss_sum / tr->accum}, loss_glob[1];
        dg_health_set_activity(tr->health, step, "all-reduce loss");
        if (MPI_Allreduce(loss_pair, loss_glob, 1, MPI_DOUBLE, MPI_SUM, tr->comm) != MPI_SUCCESS) {
            st = DG_ERR(DG_ERR_PEER, "loss all-reduce failed at step %lld", (long long)step);
            break;
        }
        double loss = loss_glob[0] / tr->world;

        /* spike handling: compare with the moving average of accepted losses */
        int skip = !isfinite(loss);
        int spike = 0;
        if (!skip && c->train.spike_factor > 0 &&
            tr->win_n >= (c->train.spike_window < 5 ? c->train.spike_window : 5)) {
            double avg = 0; /* summed in double in a fixed order */
            for (int64_t i = 0; i < tr->win_n; i++)
                avg += tr->window[i];
            avg /= (double)tr->win_n;
            if (loss > c->train.spike_factor * avg) spike = skip = 1;
            if (spike) {
                tr->consecutive_spikes++;
                DG_METRICS_EVENT(tr->metrics, "health", DG_JS("kind", "loss_spike"), DG_JI("step", step + 1),
                                 DG_JF("loss", loss), DG_JF("moving_avg", avg),
                                 DG_JI("consecutive", tr->consecutive_spikes));
                DG_LOG_WARN("step %lld: loss %.4f > %.2f x moving average %.4f: update skipped",
                            (long long)step + 1, loss, c->train.spike_factor, avg);
            }
        }
        if (!spike) tr->consecutive_spikes = 0;

        double lr = dg_lr_at(step, c->train.steps, c->train.lr, c->train.warmup_steps, c->train.min_lr_ratio);
        float gnorm = NAN;
        if (!skip) {
            dg_optim_hparams_t h = {.lr = (float)lr,
                                    .beta1 = (float)c->train.beta1,
                                    .beta2 = (float)c->train.beta2,
                                    .eps = (float)c->train.eps,
                                    .weight_decay = (float)c->train.weight_decay,
                                    .grad_clip = (float)c->train.grad_clip,
                                    .t = step + 1,
                                    .inv_loss_scale = (float)(1.0 / tr->loss_scale)};
            dg_health_set_activity(tr->health, step, "optimizer");
            st = dg_model_optimizer_step(tr->model, &h, &gnorm);
            comm_failure(tr, st);
            if (st) continue;
            if (!isfinite(gnorm)) skip = 1; /* the model skipped the update (non-finite gradients) */
        } else if (!isfinite(loss)) {
            DG_METRICS_EVENT(tr->metrics, "health", DG_JS("kind", "nonfinite_loss"), DG_JI("step", step + 1));
            DG_LOG_WARN("step %lld: non-finite loss; update skipped", (long long)step + 1);
        }
        if (is_fp16(c)) {
            if (!isfinite(gnorm)) {
                tr->loss_scale = tr->loss_scale / 2 < 1 ? 1 : tr->loss_scale / 2;
                tr->good_steps = 0;
            } else if (++tr->good_steps >= c->train.loss_scale_growth_interval) {
                tr->loss_scale *= 2;
                tr->good_steps = 0;
            }
        } else if (!isfinite(gnorm) && !spike && isfinite(loss)) {
            DG_METRICS_EVENT(tr->metrics, "health", DG_JS("kind", "nonfinite_grad"), DG_JI("step", step + 1));
            DG_LOG_WARN("step %lld: non-finite gradient norm; update skipped", (long long)step + 1);
        }
        if (!skip && c->train.spike_window > 0) {
            tr->window[tr->win_pos] = (float)loss;
            tr->win_pos = (tr->win_pos + 1) % c->train.spike_window;
            if (tr->win_n < c->train.spike_window) tr->win_n++;
        }

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
                                .mfu = dg_mfu(tps / tr->world, tr->flops_per_token, tr->peak_flops)};
        dg_metrics_step(tr->metrics, &sm);
        dg_progress_step(tr->progress, tr->step, loss, tps, dt);

        if (spike && c->train.spike_max_consecutive > 0 &&
            tr->consecutive_spikes >= c->train.spike_max_consecutive) {
            st = rollback(tr);
            tr->consecutive_spikes = 0;
            tr->win_n = tr->win_pos = 0;
            if (st) continue;
        }
        if (tr->val_ld && c->data.val_every > 0 &&
            (tr->step % c->data.val_every == 0 || tr->step == c->train.steps)) {
            double vl = 0;
            st = run_validation(tr, &vl);
            if (st) continue;
            DG_METRICS_EVENT(tr->metrics, "val", DG_JI("step", tr->step), DG_JF("loss", vl),
                             DG_JI("batches", tr->val_batches));
            dg_progress_note(tr->progress, "step %lld: val loss %.4f", (long long)tr->step, vl);
        }
        if (c->checkpoint.every > 0 && tr->step % c->checkpoint.every == 0 && tr->step < c->train.steps) {
            st = save_checkpoint(tr, 0);
            if (st) continue;
        }
        if (tr->writer) {
            dg_ckpt_async_result_t ar = {0};
            if (dg_ckpt_writer_poll(tr->writer, &ar) == 1) report_async(tr, &ar);
        }
    }
    free(tok);
    free(tgt);
    dg_progress_finish(tr->progress);
    /* an error after the last step's agreement (validation, checkpoint) must be agreed before the final
     * collective save, or the failing rank would leave the others waiting in it */
    int lerr = st, gerr = 0;
    if (MPI_Allreduce(&lerr, &gerr, 1, MPI_INT, MPI_MAX, tr->comm) != MPI_SUCCESS)
        return DG_ERR(DG_ERR_PEER, "final agreement all-reduce failed");
    if (st) return st;
    if (gerr)
        return DG_ERR(DG_ERR_PEER, "another rank failed at step %lld (see its log)", (long long)tr->step);

    /* final (or signal-driven) checkpoint, synchronous; exit 75 promises it, so its failure is exit 4 */
    dg_status_t s = save_checkpoint(tr, 1);
    if (s == DG_ERR_STORAGE && stop_sig) {
        char why[1400];
        snprintf(why, sizeof why, "%s", dg_last_error());
        return DG_ERR(DG_ERR_STORAGE,
                      "stopped on %s at step %lld without a complete checkpoint (so not exit 75): %s",
                      dg_signal_name(stop_sig), (long long)tr->step, why);
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
    return DG_OK;
}

dg_status_t dg_train_run(dg_boot_t *boot, const dg_config_t *cfg) {
    trainer_t tr = {0};
    tr.boot = boot;
    tr.cfg = cfg;
    tr.comm = boot->world;
    tr.rank = boot->world_rank;
    tr.world = boot->world_size;
    dg_signals_install();

    dg_status_t s = setup(&tr);
    s = dg_boot_agree(boot, s);
    if (s) {
        trainer_free(&tr);
        return s;
    }
    s = dg_health_create(tr.comm, tr.rank, boot->host, cfg->health.heartbeat_s, cfg->health.timeout_s,
                         &tr.health);
    if (s == DG_OK) {
        dg_health_set_event_sink(tr.health, health_sink, tr.metrics);
        /* checkpoint I/O is judged by its progress; an aborted job leaves no half-written file */
        dg_health_set_progress_source(tr.health, ckpt_progress_source, NULL);
        dg_health_set_abort_hook(tr.health, ckpt_abort_hook, NULL);
    }
    if (s == DG_OK && cfg->checkpoint.async) {
        dg_ckpt_save_opts_t o;
        dg_ckpt_save_opts_default(&o);
        o.keep = (int)cfg->checkpoint.keep;
        o.incremental = cfg->checkpoint.incremental;
        s = dg_ckpt_writer_create(tr.comm, tr.ckpt_dir, &o, &tr.writer);
    }
    s = dg_boot_agree(boot, s);
    if (s == DG_OK) s = dg_boot_agree(boot, maybe_resume(&tr));
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
        DG_JI("arena_bytes", (int64_t)dg_model_arena_bytes(tr.model)), DG_JI("start_step", tr.step),
        DG_JI("steps", cfg->train.steps), DG_JS("version", DG_VERSION_STRING),
        DG_JS("plan", tr.plan_reason[0] ? tr.plan_reason : "mesh given by parallel.mesh"));
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
        report_async(&tr, &ar);
        (void)ws; /* a failed background write is reported; the final synchronous save already succeeded */
    }
    s = dg_boot_agree(boot, s);
    if (s == DG_OK) {
        double el = dg_now_s() - t_start;
        /* GPU memory of this rank (rank 0 writes the line): the backend's peak allocation, comparable to
         * PyTorch's max_memory_allocated, and the device's use now; null on the CPU backend */
        double gpu_peak = NAN, gpu_used = NAN;
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
            DG_JI("exit_code", 0));
    } else if (s != DG_ERR_SIGNAL) {
        DG_METRICS_EVENT(tr.metrics, "done", DG_JI("step", tr.step), DG_JS("reason", "error"),
                         DG_JS("error", dg_last_error()), DG_JI("exit_code", s));
    }
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
    DG_TRY(dg_model_desc_from_config(cfg, &d));
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

static dg_status_t plan_model(dg_boot_t *boot, const dg_config_t *cfg, trainer_t *tr, dg_backend_t **be) {
    tr->boot = boot;
    tr->cfg = cfg;
    tr->comm = boot->world;
    tr->rank = boot->world_rank;
    tr->world = boot->world_size;
    DG_TRY(pick_mesh(tr));
    DG_TRY(dg_model_desc_from_config(cfg, &tr->desc));
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

dg_status_t dg_train_plan_only(dg_boot_t *boot, const dg_config_t *cfg, int json, FILE *out) {
    trainer_t tr = {0};
    dg_backend_t *be = NULL;
    dg_status_t s = dg_boot_agree(boot, plan_model(boot, cfg, &tr, &be));
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
    if (tr.model) dg_model_free(tr.model);
    dg_fsdp_free(tr.fsdp);
    dg_backend_free(be);
    return s;
}

/* --dry-run's memory-fit verdict (memfit.h), computed for host ranks (the dry run binds no GPU); JSON:
 * a "memory" object. A plan that does not fit is reported, not refused. */
static dg_status_t dg_train_dry_run_memfit(dg_boot_t *boot, const dg_config_t *cfg, trainer_t *tr, int json,
                                           FILE *out) {
    dg_mem_in_t mi;
    dg_memfit_input(cfg, &tr->desc, &tr->mesh, tr->micro_batch, 0, &mi);
    char line[1024];
    dg_status_t v = dg_memfit_check(boot->world, boot->local_size, cfg, &mi, tr->mesh_str, line, sizeof line);
    if (v != DG_OK && v != DG_ERR_USAGE) return v;
    if (boot->world_rank != 0) return DG_OK;
    dg_mem_est_t e;
    dg_mem_estimate(&mi, &e);
    if (json)
        fprintf(out,
                ",\"memory\":{\"fits\":%s,\"estimate_bytes\":%.0f,\"state\":%.0f,\"gathered\":%.0f,"
                "\"activations\":%.0f,\"logits\":%.0f,\"buckets\":%.0f}",
                v == DG_OK ? "true" : "false", e.total, e.state, e.gathered, e.activations, e.logits, e.buckets);
    else
        fprintf(out, "  %s\n", line);
    return DG_OK;
}

dg_status_t dg_train_dry_run_report(dg_boot_t *boot, const dg_config_t *cfg, int json, FILE *out) {
    trainer_t tr = {0};
    dg_backend_t *be = NULL;
    dg_status_t s = dg_boot_agree(boot, plan_model(boot, cfg, &tr, &be));
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
                "\"activations_unplanned\":%zu,\"params_grads_optimizer_unsharded\":%zu}",
                cfg->model.preset, tr.desc.n_layer, tr.desc.n_head, tr.desc.d_model, tr.desc.seq_len,
                tr.desc.vocab_size, tr.desc.padded_vocab, (unsigned long long)dg_model_n_params(&tr.desc),
                dg_model_flops_per_token(&tr.desc), tr.mesh_str, (long long)tr.global_batch, tr.micro_batch,
                tr.accum, state, arena, act, whole);
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
    if (tr.model) dg_model_free(tr.model);
    dg_fsdp_free(tr.fsdp);
    dg_backend_free(be);
    return s;
}

dg_status_t dg_train_dry_run_check(dg_boot_t *boot, const dg_config_t *cfg) {
    if (boot->world_rank != 0) return DG_OK;
    dg_model_desc_t d;
    DG_TRY(dg_model_desc_from_config(cfg, &d));
    char train_glob[4096], val_glob[4096];
    DG_TRY(data_globs(cfg, train_glob, val_glob, sizeof train_glob));
    int64_t n_train = 0, n_val = -1, val_batches = 0;
    DG_TRY(dg_dataset_probe(train_glob, d.seq_len, &n_train));
    if (val_glob[0] && cfg->data.val_every > 0) DG_TRY(dg_dataset_probe(val_glob, d.seq_len, &n_val));
    return check_data_fits(cfg, cfg->train.global_batch, d.seq_len, n_train, n_val, &val_batches);
}
