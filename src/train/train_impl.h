/* train_impl.h — private to src/train/: the trainer's state and the functions its files share:
 * train.c (dg_train_run and the step loop), setup.c (backend, mesh, model, health), data.c (data sets,
 * loaders, validation), plan_report.c (--plan-only, --dry-run) and train_ckpt.c (checkpoint tensors,
 * save, resume, rollback).
 */
#ifndef DG_TRAIN_IMPL_H
#define DG_TRAIN_IMPL_H

#include "train.h"

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
#include "stability.h"
#include "train_sla.h"

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
    int64_t kernels_fused, kernels_unfused; /* kernel launches per step, with and without the fusion passes */

    char ckpt_dir[2 * DG_CFG_STR + 32];
    char plan_cache_dir[2 * DG_CFG_STR + 32]; /* run.plan_cache resolved ("" = off) */
    dg_model_compile_t compile;               /* plan cache and circuit breaker options of the model */
    int64_t val_batches; /* data.val_batches, or fewer when the validation set is smaller (trn_open_data) */
    dg_dataset_t *train_ds, *val_ds;
    dg_loader_t *train_ld, *val_ld;
    dg_metrics_t *metrics;
    dg_progress_t *progress;
    dg_health_t *health;
    void *cuda_probe; /* the CUDA context liveness probe (dg_cuda_probe_t; CUDA backend only) */
    dg_ckpt_writer_t *writer;

    /* checkpoint staging: host copies of this rank's local piece of every parameter's state */
    int n_params;
    float *host_flat[3];      /* param, m, v: the model's flat buffers, page-locked (dg_model_get_flat) */
    dg_ckpt_tensor_t *ckpt_t; /* one entry per hyperslab piece of a global tensor */
    size_t *ckpt_off;         /* per entry: buffer index << 60 | float offset into host_flat[buffer] */
    int n_ckpt;
    char **ckpt_paths;
    int *frozen; /* per parameter: matched train.freeze */

    dg_stability_t stab; /* loss-spike detector and fp16 loss scale (stability.h) */
    trn_sla_t sla;       /* the SLA governor's state (train_sla.h) */

    int64_t step;   /* optimizer steps completed */
    int64_t tokens; /* global tokens consumed */
    int64_t iters;  /* loop iterations taken: never rolled back (train.rollback_window counts these) */

    /* where this run segment began (a fresh start or the resume): stored with every checkpoint
     * (DG_TRAIN_KV_SEGMENT) so that loads can check tokens and the loader position exactly */
    int64_t seg_step, seg_epoch, seg_cursor;
    uint64_t seg_samples;
    char train_glob[4096]; /* the training data, as messages name it */
    int64_t ckpt_failures; /* checkpoint saves that failed in a row (agreed: every rank counts alike) */
    char ckpt_last_error[1024];
    double rss_at_fit; /* this rank's resident bytes at the memory-fit check (dg_mem_rss_mark; 0: unknown) */

    /* the run identity (observe.c): every metrics and log line carries it */
    char run_id[40];
    int64_t attempt;         /* 1 at a run's first start, +1 at every later start of it */
    char slurm_job[32];      /* $SLURM_JOB_ID, "" outside Slurm */
    int run_dir_known;       /* RUN_DIR/run.json named the run: a resumed checkpoint does not rename it */
    struct trn_trace *trace; /* --trace A:B (trace.c), NULL when off */
    struct dg_pp_exec *pp;   /* pp > 1: the pipeline executor (pipeline_train.c); tr->model is its chunk 0 */
    /* pp > 1: the parameters in the whole model's order (n_params of them; checkpoints list them all on
     * every rank): per global index its info, this rank's chunk holding it (-1: none) and its index
     * there; per chunk the start of its state in the trainer's flat host copies */
    dg_param_info_t *pp_info;
    char (*pp_names)[64];
    int *pp_chunk_of, *pp_index;
    size_t *pp_flat_base, pp_flat_total;
} trainer_t;

/* train_ckpt.c */
dg_status_t trn_build_ckpt_tensors(trainer_t *tr); /* the checkpoint's view of this rank's state */
dg_status_t trn_host_state(trainer_t *tr);         /* its page-locked buffers, made on first use */
dg_status_t trn_save_checkpoint(trainer_t *tr, int sync_only);
dg_status_t trn_maybe_resume(trainer_t *tr);
/* The save options of the run's config: checkpoint.keep, .incremental, .threads, .space_check. */
void trn_ckpt_save_opts(const dg_config_t *cfg, dg_ckpt_save_opts_t *o);
dg_status_t trn_rollback(trainer_t *tr); /* loss spikes: back to the newest good checkpoint */
void trn_report_async(trainer_t *tr, const dg_ckpt_async_result_t *ar);
uint64_t trn_ckpt_progress_source(void *ctx, int *waiting); /* the health watchdog's view of checkpoint I/O */
void trn_ckpt_abort_hook(void *ctx);                        /* an aborted job leaves no half-written file */
/* Largest tensor parallelism the planner may choose (one node's GPUs; n_head must divide by it). */
#define DG_TRAIN_MAX_TP 8

/* pipeline_train.c (parallel.mesh with pp > 1, docs/parallelism.md "The executor"): the executor and its
 * chunk models (create: collective, after the communicators); the step's forwards/backwards, zero_grad,
 * optimizer step and an evaluation forward through it. trn_loss_ranks: the ranks whose losses count in a
 * mean (the last stage's; all without a pipeline); trn_has_loss: this rank is one of them. */
dg_status_t trn_pp_create(trainer_t *tr);
void trn_pp_free(trainer_t *tr);
int trn_loss_ranks(const trainer_t *tr);
int trn_has_loss(const trainer_t *tr);
/* This rank's models: the pipeline's chunks (k < dg_pp_exec_n_models), or the one model (k = 0). What the
 * start event reports per rank (kernels, ops, model state, arena) is the sum over them. */
int trn_n_models(const trainer_t *tr);
dg_model_t *trn_model_at(const trainer_t *tr, int k);
dg_status_t trn_pp_forward_backward(trainer_t *tr, const int32_t *tok, const int32_t *tgt, float dloss,
                                    double *loss_sum);
dg_status_t trn_pp_zero_grad(trainer_t *tr);
dg_status_t trn_pp_optimizer(trainer_t *tr, const dg_optim_hparams_t *h, float *gnorm);
dg_status_t trn_pp_forward(trainer_t *tr, const int32_t *tok, const int32_t *tgt, float *loss);
/* The parameters as checkpoints, train.freeze and the overflow pass see them: global index g in the whole
 * model's order (tr->n_params of them); without a pipeline simply tr->model's. A tensor of another stage
 * has no pieces here, owner 0. The flat state: this rank's chunks one after the other. */
const dg_param_info_t *trn_param(const trainer_t *tr, int g);
int trn_param_pieces(const trainer_t *tr, int g, dg_model_piece_t *pc);
int trn_param_owner(const trainer_t *tr, int g);
size_t trn_param_flat_offset(const trainer_t *tr, int g);
size_t trn_flat_numel(const trainer_t *tr);
dg_status_t trn_get_flat(trainer_t *tr, int which, float *host);
dg_status_t trn_set_flat(trainer_t *tr, int which, const float *host);
dg_status_t trn_set_frozen(trainer_t *tr, int g, int frozen);
dg_status_t trn_init_weights(trainer_t *tr, const char *spec); /* model.init (dg_hf.h) on every chunk */

/* setup.c */
int trn_is_fp16(const dg_config_t *c); /* train.precision = fp16 */
/* Everything before the monitors: mesh, model sizes, batch arithmetic, the agreed backend, the memory fit,
 * communicators, run dir and metrics, data, the model and its options (collective). */
dg_status_t trn_setup(trainer_t *tr);
/* The health monitor (event sinks, progress source, abort hook, comm and CUDA polls) and, with
 * checkpoint.async, the background checkpoint writer; the caller agrees on the result. */
dg_status_t trn_setup_monitors(trainer_t *tr);
/* The mesh of parallel.mesh, or the planner's (mesh = auto); dp_rank, dp_size and mesh_str with it. */
dg_status_t trn_pick_mesh(trainer_t *tr);
/* micro_batch, global_batch and accum; a global batch that does not divide is DG_ERR_USAGE. */
dg_status_t trn_batch_arithmetic(trainer_t *tr);
/* The topology-SLA planner for this run's workload on its cluster (or topology.cluster's); max_tp caps
 * tensor parallelism. On success the caller frees *res and *cl. */
dg_status_t trn_run_planner(dg_boot_t *boot, const dg_config_t *c, const dg_model_desc_t *d, int max_tp,
                            dg_cluster_t *cl, dg_plan_result_t *res);
/* data.c */
/* The training and validation globs ("" val: none); builds the embedded default data on first use. */
dg_status_t trn_data_globs(const dg_config_t *c, char *train_glob, char *val_glob, size_t cap);
/* One step and one validation batch fit the data (n_val < 0: no validation); *val_batches: what fits. */
dg_status_t trn_check_data_fits(const dg_config_t *c, int64_t global_batch, int seq_len, int64_t n_train,
                                int64_t n_val, int64_t *val_batches);
dg_status_t trn_open_data(trainer_t *tr); /* data sets and loaders; needs tr->metrics */
/* Micro-steps [j0, j0+n) of the current step into tok/tgt ([n][micro_batch][seq_len] each). */
dg_status_t trn_fill_micro_steps(trainer_t *tr, const dg_loader_t *ld, int j0, int n, int32_t *tok,
                                 int32_t *tgt);
int trn_data_chunk(const trainer_t *tr); /* micro-steps of data read ahead at once */
/* Agreement on a data read outside the step agreement: every rank learns whether any rank failed. */
dg_status_t trn_agree_data(trainer_t *tr, dg_status_t st);
/* observe.c: the run identity (collective; right after the metrics file opens) and RUN_DIR/metrics.prom
 * (rank 0, every log interval and at the end). */
dg_status_t trn_run_identity(trainer_t *tr);
/* trace.c: --trace A:B (run.trace). create: parse (no-op when unset). boundary: at a step boundary every
 * rank reached in agreement (collective): writes the trace once step B is done, starts it before step A.
 * mark: the finished step's span. step_end(.., last_step = 1): after the loop, writes what was recorded
 * (collective; call only when every rank ends the loop without an error). */
dg_status_t trn_trace_create(trainer_t *tr);
dg_status_t trn_trace_boundary(trainer_t *tr);
dg_status_t trn_trace_step_begin(trainer_t *tr, int64_t step);
void trn_trace_step_mark(trainer_t *tr, int64_t step, double t0, double t1);
dg_status_t trn_trace_step_end(trainer_t *tr, int64_t step, int last_step);
void trn_trace_free(trainer_t *tr);
dg_status_t trn_adopt_run_identity(trainer_t *tr, const char *ckpt_run_id, int64_t ckpt_attempt);
dg_status_t trn_write_prom(const trainer_t *tr, const dg_step_metrics_t *sm);
/* trn_write_prom at log intervals, at most once a second, and at the last step; a failure warns once. */
dg_status_t trn_maybe_write_prom(const trainer_t *tr, const dg_step_metrics_t *sm);
/* Mean validation loss over val_batches global batches (collective; needs tr->val_ld). */
dg_status_t trn_run_validation(trainer_t *tr, double *loss_out);
/* train_stab.c (stability.h's trainer side; collective) */
void trn_stab_opts(const dg_config_t *c, dg_stab_opts_t *o);
/* Collective on every rank after the optimizer step (st: its outcome here): agrees on failures and on the
 * norm's finiteness; *rate: 0 for a finite norm, NaN when the step failed. */
dg_status_t trn_overflow_rate(trainer_t *tr, dg_status_t st, float gnorm, double *rate);
dg_status_t trn_spike_check(trainer_t *tr, int64_t step);   /* validation and confirmation of a spike */
dg_status_t trn_stab_rollback(trainer_t *tr, int64_t iter); /* rollback; K in M: DG_ERR_PAUSE (exit 5) */
double trn_hook_loss(int64_t step, double loss);            /* test hook DG_TEST_SPIKE_STEP */
dg_status_t trn_hook_grad(trainer_t *tr, int64_t step);     /* test hook DG_TEST_GRAD_NAN_STEP */

#endif /* DG_TRAIN_IMPL_H */
