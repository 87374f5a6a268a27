/* pipeline.h — pipeline parallelism without the executor: the stage split, the schedules as fixed
 * per-rank action lists, their validator and a simulator that replays them with per-action costs
 * (docs/parallelism.md). Pure computation: no MPI, no allocation beyond what the functions return, the
 * same inputs give the same outputs on every rank (the "built once, replayed" rule).
 *
 * Units of the model: unit 0 is the embedding (wte + wpe), units 1..L the transformer blocks, unit L+1
 * the head (ln_f, the lm_head and the loss). A stage is a contiguous run of units; the embedding always
 * belongs to the first stage and the head to the last. A chunk (virtual stage) is one contiguous piece;
 * with v virtual stages per rank there are pp x v chunks and chunk c lives on rank c % pp.
 */
#ifndef DG_PIPELINE_H
#define DG_PIPELINE_H

#include <stdint.h>
#include <stdio.h>

#include "dg_common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DG_PP_MAX_CHUNKS 256 /* pp x virtual stages */
#define DG_PP_MAX_MICRO (1 << 20) /* micro-batches per step (parallel.pp_microbatches' range) */

typedef enum { DG_PP_1F1B = 0, DG_PP_INTERLEAVED = 1 } dg_pp_kind_t;
/* "1f1b" | "interleaved" (parallel.pp_schedule) -> kind; -1 for anything else */
int dg_pp_kind_parse(const char *name);
const char *dg_pp_kind_name(int kind);

/* ---------------- the per-block cost model ---------------- */

typedef struct dg_pp_model {
    int n_layer, n_head, d_model, seq_len, vocab;
    int micro_batch;              /* sequences per micro-batch */
    int act_bytes;                /* bytes per activation element (4 f32, 2 bf16/fp16) */
    int tp;                       /* tensor parallelism inside a stage (>= 1) */
    double state_bytes_per_param; /* optimizer state + weights + grads per parameter on one rank */
} dg_pp_model_t;

typedef struct dg_pp_cost {
    double fwd_flops, bwd_flops; /* one micro-batch on one rank (divided by tp) */
    double params;               /* parameters held (the tied lm_head is a copy of wte on the last stage) */
    double act_bytes;            /* activation bytes kept per micro-batch from its forward to its backward */
    double transient_bytes;      /* bytes alive only inside one forward+backward (the head's logits) */
} dg_pp_cost_t;

/* Costs of the L + 2 units (units[0] embedding, units[1..L] blocks, units[L+1] head). */
void dg_pp_unit_costs(const dg_pp_model_t *m, dg_pp_cost_t *units);
/* Bytes of one activation (or activation gradient) message between stages: micro_batch x seq x d_model. */
double dg_pp_message_bytes(const dg_pp_model_t *m);

/* ---------------- the stage split ---------------- */

typedef struct dg_pp_split {
    int pp, virt, n_chunks;
    int first_unit[DG_PP_MAX_CHUNKS], n_units[DG_PP_MAX_CHUNKS]; /* chunk c: units [first, first + n) */
    dg_pp_cost_t chunk[DG_PP_MAX_CHUNKS];                        /* summed unit costs of chunk c */
    double stage_flops[DG_PP_MAX_CHUNKS]; /* per rank: forward + backward FLOPs of its chunks */
    double imbalance;                     /* max stage FLOPs / mean stage FLOPs (1 = perfect) */
} dg_pp_split_t;

/* Splits the model for `pp` ranks x `virt` chunks each. 1F1B (virt 1): the contiguous split that
 * minimises the largest stage's forward + backward FLOPs (exact, by dynamic programming), subject to
 * each stage's memory (state of its parameters + act_bytes x its in-flight micro-batches, p - s for
 * stage s) within mem_budget (<= 0: no limit). Interleaved: every chunk gets n_layer / (pp x virt)
 * blocks. DG_ERR_USAGE naming the rule when the model cannot be split so (pp > n_layer, layers not
 * divisible by pp x virt, no split within the budget). */
dg_status_t dg_pp_split(const dg_pp_model_t *m, int kind, int pp, int virt, double mem_budget,
                        dg_pp_split_t *out);

/* ---------------- schedules ---------------- */

typedef enum {
    DG_PP_FWD = 0,       /* forward of micro-batch mb through chunk */
    DG_PP_BWD = 1,       /* backward of micro-batch mb through chunk */
    DG_PP_SEND_ACT = 2,  /* chunk's output activation of mb to the rank of chunk + 1 */
    DG_PP_RECV_ACT = 3,  /* chunk's input activation of mb from the rank of chunk - 1 */
    DG_PP_SEND_GRAD = 4, /* the gradient of chunk's input, of mb, to the rank of chunk - 1 */
    DG_PP_RECV_GRAD = 5  /* the gradient of chunk's output, of mb, from the rank of chunk + 1 */
} dg_pp_op_t;
const char *dg_pp_op_name(int op);

typedef struct dg_pp_action {
    int op;    /* dg_pp_op_t */
    int mb;    /* micro-batch 0 .. m-1 */
    int chunk; /* global chunk index 0 .. pp x virt - 1 (lives on this rank) */
    int peer;  /* send/recv: the other rank; -1 for compute */
    int group; /* send/recv: consecutive actions with the same group id are posted together (one batch of
                * non-blocking sends and receives, completed together); 0 for compute */
} dg_pp_action_t;

typedef struct dg_pp_schedule {
    int kind, pp, virt, m;
    int n[DG_PP_MAX_CHUNKS];               /* actions per rank */
    dg_pp_action_t *act[DG_PP_MAX_CHUNKS]; /* per rank, owned */
} dg_pp_schedule_t;

/* The fixed action list of every rank for m micro-batches. 1F1B: warm-up of min(p - s - 1, m) forwards
 * on stage s, then one forward / one backward, then the cool-down backwards. Interleaved: micro-batches
 * in groups of p, each group through every local chunk in turn (forward in chunk order, backward in
 * reverse; the remainder of m / p joins the first group), warm-up of 2 (p - s - 1) + (v - 1) g chunk
 * forwards (g the first group's length). Between two slots (1F1B: each compute action; interleaved: each
 * warm-up forward, each steady forward + backward pair, each cool-down backward) the sends of the first
 * and the receives of the second form one group. DG_ERR_USAGE for m < pp, virt < 1,
 * interleaved with virt < 2, 1f1b with virt != 1, pp x virt > DG_PP_MAX_CHUNKS, m > DG_PP_MAX_MICRO. */
dg_status_t dg_pp_schedule_build(int kind, int pp, int virt, int64_t m, dg_pp_schedule_t *out);
void dg_pp_schedule_free(dg_pp_schedule_t *s);

/* Checks a schedule (DG_ERR_RUNTIME with the first violation): on each rank every (mb, local chunk)
 * has one forward and one backward, the forward first; a forward of chunk c > 0 is preceded by the
 * receive of its input and followed by the send of its output (c < last), a backward likewise for
 * gradients; on each channel (activations, gradients: the executor keeps them apart, e.g. two
 * communicators, because NCCL matches by order and has no tags) the messages from rank a to rank b are
 * sent in the order b receives them; and the lists replay to the end under blocking (rendezvous)
 * point-to-point, where a group completes when each of its sends and receives meets the peer's matching
 * operation in the group the peer is blocked in. */
dg_status_t dg_pp_validate(const dg_pp_schedule_t *s);

/* ---------------- the simulator ---------------- */

typedef struct dg_pp_costs {
    double fwd_s[DG_PP_MAX_CHUNKS], bwd_s[DG_PP_MAX_CHUNKS]; /* per chunk */
    double act_bytes[DG_PP_MAX_CHUNKS];                      /* kept per in-flight micro-batch, per chunk */
    const double *p2p_s; /* pp x pp seconds of one message from rank a to b ([a * pp + b]); NULL = 0 */
} dg_pp_costs_t;

/* The compute part of the costs from a split: each chunk's forward and backward FLOPs at flops_per_s
 * (0 or less: zero times) and its activation bytes; p2p_s NULL (the caller's link figures). */
void dg_pp_costs_from_split(const dg_pp_split_t *sp, double flops_per_s, dg_pp_costs_t *out);

typedef struct dg_pp_event {
    int rank, op, mb, chunk;
    double t0, t1;
} dg_pp_event_t;

typedef struct dg_pp_sim {
    double makespan;                    /* seconds of the step's pipeline part */
    double busy[DG_PP_MAX_CHUNKS];      /* compute seconds per rank */
    double bubble;                      /* 1 - sum(busy) / (pp x makespan) */
    int max_inflight[DG_PP_MAX_CHUNKS]; /* per rank: most chunk forwards done whose backward is not */
    double peak_act[DG_PP_MAX_CHUNKS];  /* per rank: most activation bytes held by in-flight work */
    int n_events;
    dg_pp_event_t *events; /* compute actions, in replay order (owned; NULL when not asked for) */
} dg_pp_sim_t;

/* Replays the schedule: compute takes its cost; a send is posted on the communication stream without
 * blocking compute and its message arrives p2p_s after the later of its posting and the link's previous
 * message (one link per direction); a group's receives wait for their messages. keep_events: fill
 * events. DG_ERR_RUNTIME when the lists cannot complete. */
dg_status_t dg_pp_simulate(const dg_pp_schedule_t *s, const dg_pp_costs_t *c, int keep_events,
                           dg_pp_sim_t *out);
void dg_pp_sim_free(dg_pp_sim_t *r);

/* Theory: 1F1B (p - 1) / (m + p - 1); interleaved (p - 1) / (v m + p - 1). */
double dg_pp_bubble_theory(int kind, int pp, int virt, int m);

/* The simulated timeline as an SVG picture: one row per rank, a box per forward / backward labelled
 * with its micro-batch (chunk shades for interleaved), a time axis. */
void dg_pp_timeline_svg(const dg_pp_schedule_t *s, const dg_pp_sim_t *r, const char *title, FILE *out);

#ifdef __cplusplus
}
#endif
#endif
