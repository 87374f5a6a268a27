/* pp_exec.h — the pipeline executor (docs/parallelism.md "The executor"): this rank's chunks of the
 * model (one dg_model_t per chunk, dg_model.h "pipeline chunks"), the schedule of src/pipeline replayed
 * every step, the activations and their gradients sent and received between stages through the comm
 * vtable (comm.h) on two channels, the tied embedding's two gradient copies summed, and the optimizer
 * step with the gradient norm summed over every chunk of every stage. Library dg_pipeline_exec.
 *
 * Collective over the pp line (the ranks with this rank's coordinates in every stage) and, inside the
 * chunks' graphs, over the stage's mesh groups: every rank calls the same functions in the same order.
 */
#ifndef DG_PP_EXEC_H
#define DG_PP_EXEC_H

#include <mpi.h>
#include <stdint.h>

#include "comm.h"
#include "dg_common.h"
#include "dg_model.h"
#include "pipeline.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dg_pp_exec_opts {
    int kind, virt;              /* schedule (DG_PP_1F1B / DG_PP_INTERLEAVED) and chunks per rank */
    int pp, stage;               /* stages, and this rank's */
    int m;                       /* micro-batches per step (>= pp) */
    const dg_model_desc_t *desc; /* the whole model */
    dg_backend_t *be;
    int micro_batch;
    uint64_t seed;
    int flags;               /* DG_MODEL_* for every chunk */
    dg_model_parallel_t par; /* the stage's mesh, coordinates, comms and options (pp_* set per chunk) */
    dg_comm_t *act, *grad;   /* the pp line's two channels (group rank = stage) */
    MPI_Comm world;          /* for the pp line's host scalars (split here) */
    double mem_budget;       /* per-rank bytes for the split (0: none) */
    /* called before every compute action and message group of a step ("pipeline forward", "... backward",
     * "... send/recv"), e.g. to tell the health watchdog the step makes progress; NULL: none */
    void (*on_action)(void *ctx, const char *what);
    void *on_action_ctx;
    /* 1: each group of sends and receives is completed before the next compute (the messages do not
     * overlap compute; for measuring what overlap gains). 0: on the mpi comm, sends stay in flight while
     * compute goes on and the next group's receives are posted one compute ahead (executor.c, "overlap";
     * the same bits either way). nccl: always as 1 (its point-to-point runs on the comm stream). */
    int no_overlap;
} dg_pp_exec_opts_t;

typedef struct dg_pp_exec dg_pp_exec_t;

/* The options of an executor for model d on backend be over a stage's mesh par (its pp and this rank's
 * stage from par->mesh and world's rank) with the pp line's channels act / grad: 1F1B, one chunk per
 * rank, m = pp micro-batches, overlap on, no flags, no progress callback; a caller changes what differs. */
dg_pp_exec_opts_t dg_pp_exec_opts_for(const dg_model_desc_t *d, dg_backend_t *be, int micro_batch,
                                      uint64_t seed, const dg_model_parallel_t *par, dg_comm_t *act,
                                      dg_comm_t *grad, MPI_Comm world);

/* Splits the model (dg_pp_split with the cost model), builds and validates the schedule, creates this
 * rank's chunk models with as many activation slots as the schedule keeps in flight. Collective. */
dg_status_t dg_pp_exec_create(const dg_pp_exec_opts_t *o, dg_pp_exec_t **out);
void dg_pp_exec_free(dg_pp_exec_t *e);

int dg_pp_exec_n_models(const dg_pp_exec_t *e);       /* this rank's chunks */
dg_model_t *dg_pp_exec_model(dg_pp_exec_t *e, int k); /* local chunk k (global chunk stage + k pp) */
int dg_pp_exec_has_loss(const dg_pp_exec_t *e);       /* the last stage (it holds the head) */
/* The device memory this rank's part of the pipeline plans to hold: every chunk's
 * dg_model_stage_planned_bytes and, on the stages holding the tied wte, the optimizer's temporary for its
 * gradient sum. The SLA objective memory_plan compares a step's peak against it. */
size_t dg_pp_exec_planned_bytes(const dg_pp_exec_t *e);
const dg_pp_split_t *dg_pp_exec_split(const dg_pp_exec_t *e);
const dg_pp_schedule_t *dg_pp_exec_schedule(const dg_pp_exec_t *e);

dg_status_t dg_pp_exec_zero_grad(dg_pp_exec_t *e);
/* The training step named by timeout messages (every chunk's comms and the pp line's channels). */
void dg_pp_exec_set_step(dg_pp_exec_t *e, int64_t step);
/* One step's forwards and backwards: tokens / targets hold the m micro-batches of this rank's data
 * (micro_batch x seq_len ids each). *loss_sum: the sum of the micro-batches' mean losses on the last
 * stage, 0 elsewhere. Busy / idle seconds of this rank's compute go to the step statistics. */
dg_status_t dg_pp_exec_step(dg_pp_exec_t *e, const int32_t *tokens, const int32_t *targets, float dloss,
                            double *loss_sum);
/* Forward only of one micro-batch through every chunk in order (evaluation); *loss: its mean loss on the
 * last stage, 0 elsewhere. */
dg_status_t dg_pp_exec_forward(dg_pp_exec_t *e, const int32_t *tokens, const int32_t *targets, float *loss);
/* The optimizer step of every local chunk: the tied wte's gradients summed between the first and the
 * last stage, the squared norms summed over the chunks and the pp line, then clip and AdamW everywhere.
 * *grad_norm: the global norm (the same on every rank; not finite: every update skipped). */
dg_status_t dg_pp_exec_optimizer(dg_pp_exec_t *e, const dg_optim_hparams_t *h, float *grad_norm);

/* Time accounting of the last step on this rank: compute seconds (forwards + backwards) and the
 * step's wall seconds inside dg_pp_exec_step. */
void dg_pp_exec_times(const dg_pp_exec_t *e, double *compute_s, double *wall_s);
/* How many of the last step's forwards and backwards on this rank began while a message of it was still
 * in flight (0 without overlap). */
int dg_pp_exec_overlapped(const dg_pp_exec_t *e);

#ifdef __cplusplus
}
#endif
#endif
