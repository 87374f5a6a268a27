/* dg_model.h — the model layer (src/model/): a GPT-2-family decoder compiled to a static training graph.
 *
 * A dg_model_t is a GPT-2-family decoder built as a static graph: the model builder emits forward ops,
 * autodiff appends the backward ops, the optimizer pass appends global-norm clipping and AdamW, and the
 * memory planner gives every activation an offset in one arena. The training loop, checkpointing and FSDP
 * code against this header; the IR itself (nodes, op registry, passes, planner, executor) is private to
 * src/graph/ (graph.h), which knows nothing of models.
 *
 * Storage: parameters (master f32 and, when the backend's activation dtype is not f32, a compute copy),
 * parameter gradients (f32) and AdamW moments (f32) live in four flat device buffers outside the arena;
 * activations, their gradients and all temporaries live in the arena.
 *
 * Determinism: with the same description, micro-batch, seed and backend, every call sequence gives
 * bitwise-identical losses, gradients and weights (the schedule is fixed and the backend is
 * deterministic).
 */
#ifndef DG_MODEL_H
#define DG_MODEL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "dg_common.h"
#include "dg_mesh.h"
#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Sizes of a GPT-2-family model. padded_vocab >= vocab_size is the row count of the token embedding
 * (and of the tied output head); rows >= vocab_size stay zero and are never a target. */
typedef struct dg_model_desc {
    int n_layer, n_head, d_model, seq_len, vocab_size, padded_vocab;
} dg_model_desc_t;

/* Presets (model.preset), as n_layer, n_head, d_model, seq_len, vocab_size:
 *   tiny        4,  4,  128,  128,   256   (byte-level text; the default and the tests)
 *   gpt2-124m  12, 12,  768, 1024, 50257
 *   gpt2-350m  24, 16, 1024, 1024, 50257
 *   gpt2-774m  36, 20, 1280, 1024, 50257
 *   gpt2-1558m 48, 25, 1600, 1024, 50257
 *   custom     no defaults: all five sizes must be given.
 * A non-zero model.<size> overrides the preset. padded_vocab = vocab_size rounded up to a multiple of
 * 64 (50257 -> 50304). Returns DG_ERR_USAGE with a one-line message for an unknown preset or
 * inconsistent sizes (d_model not divisible by n_head, sizes out of range, custom with a size missing). */
typedef struct dg_model_spec {
    const char *preset;                                    /* model.preset */
    int64_t n_layer, n_head, d_model, seq_len, vocab_size; /* model.<size>: 0 = the preset's */
} dg_model_spec_t;
dg_status_t dg_model_desc_resolve(const dg_model_spec_t *spec, dg_model_desc_t *out);
/* Checks a description filled by hand (the same rules); DG_ERR_USAGE with a message if it is bad. */
dg_status_t dg_model_desc_validate(const dg_model_desc_t *d);
/* Looks up a preset by name; DG_ERR_USAGE for an unknown name (the message lists the known ones). */
dg_status_t dg_model_desc_preset(const char *name, dg_model_desc_t *out);

/* Trainable parameter count with the UNPADDED vocabulary (the number papers quote; 124,439,808 for
 * gpt2-124m), position embeddings included. */
uint64_t dg_model_n_params(const dg_model_desc_t *d);
/* Training FLOPs per token: 6*N + 12*L*C*T, where N counts every parameter except the position
 * embeddings (a lookup, no multiply-adds) and counts the tied token embedding with the PADDED vocabulary
 * (the output head multiplies all padded rows), and 12*L*C*T is attention's QK^T and AV products
 * (forward + backward, without causal savings), as in the PaLM/nanoGPT MFU estimate. */
double dg_model_flops_per_token(const dg_model_desc_t *d);

/* One trainable tensor. Order: wte, wpe, then per layer i: h.i.ln_1.weight, h.i.ln_1.bias,
 * h.i.attn.qkv.weight [3C, C], h.i.attn.qkv.bias, h.i.attn.proj.weight [C, C], h.i.attn.proj.bias,
 * h.i.ln_2.weight, h.i.ln_2.bias, h.i.mlp.fc.weight [4C, C], h.i.mlp.fc.bias, h.i.mlp.proj.weight
 * [C, 4C], h.i.mlp.proj.bias; then ln_f.weight, ln_f.bias. Shapes are GLOBAL shapes.
 * decay: 1 for the weights of matmuls (qkv, attn.proj, mlp.fc, mlp.proj), which get AdamW weight decay;
 * 0 for biases, layernorm gains/biases and both embeddings (GPT-2/nanoGPT practice: decaying gains
 * and embeddings hurts; wte is also the output head but is treated as an embedding). */
typedef struct dg_param_info {
    const char *name;
    int ndim;
    int64_t shape[2];
    size_t numel;
    int decay;
    int tp_dim; /* the dim split over tp (heads / MLP columns), -1 when replicated over tp */
} dg_param_info_t;

/* Which state of a parameter dg_model_get_tensor / dg_model_set_tensor move (always full f32). */
enum { DG_STATE_PARAM = 0, DG_STATE_ADAM_M = 1, DG_STATE_ADAM_V = 2, DG_STATE_GRAD = 3 };

/* AdamW hyper-parameters for one optimizer step. */
typedef struct dg_optim_hparams {
    float lr, beta1, beta2, eps, weight_decay;
    float grad_clip;      /* clip the global gradient norm to this; <= 0 disables clipping */
    int64_t t;            /* 1-based step number, for bias correction */
    float inv_loss_scale; /* gradients are multiplied by this before clipping and the update (fp16 loss
                             scaling); 0 means 1 (no loss scaling) */
} dg_optim_hparams_t;

typedef struct dg_model dg_model_t;

/* Flags for dg_model_create_ex. */
enum {
    /* Build the graph and the memory plan only: no device memory, no initialisation. For --plan-only /
     * --dry-run of models larger than this machine. Running such a model returns DG_ERR_USAGE. */
    DG_MODEL_PLAN_ONLY = 1,
    /* Debugging: give every activation its own memory instead of sharing the arena by liveness (the
     * reference the memory planner is tested against; needs the sum of all activation sizes). */
    DG_MODEL_NO_ARENA_REUSE = 2,
    /* Do not keep the MLP's GELU output from the forward to the backward: recompute it from the saved
     * pre-activation just before mlp.proj's backward needs it (train.recompute = gelu). Saves
     * 4 * d_model * micro_batch * seq_len activation elements per layer for one elementwise kernel per
     * layer; the numbers do not change on the CPU backend (bitwise) and on CUDA in fp32. */
    DG_MODEL_RECOMPUTE_GELU = 4,
    /* Tests and A/B timing: keep mlp.proj's backward and GELU's backward as two ops (matmul_bwd, then
     * gelu_bwd over a materialised [N, 4C] gradient) instead of one matmul_bwd_dgelu. */
    DG_MODEL_UNFUSED_GELU_BWD = 8,
    /* Tests and A/B timing: one AdamW op (backend adamw_dev) per parameter instead of one op over all of
     * them (adamw_multi_dev, one kernel launch on CUDA). Same numbers, bit for bit. Also chosen when the
     * backend has no adamw_multi_dev, or with the environment variable DG_TEST_ADAMW_PER_PARAM=1. */
    DG_MODEL_ADAMW_PER_PARAM = 16,
    /* Tests and A/B timing: keep the classifier loss as two ops, crossentropy in the forward and
     * crossentropy_bwd in the backward (each reading the [tokens, Vp] logits), instead of one
     * crossentropy_fused in the forward that reads them once and writes their gradient over them
     * (backend crossentropy_fused). Same numbers, bit for bit. Also chosen when the backend has no
     * crossentropy_fused, or with the environment variable DG_TEST_UNFUSED_CE=1. */
    DG_MODEL_UNFUSED_CE = 32,
    /* Tests and A/B timing: keep each residual add as its own op after the linear layer before it
     * (attn.proj, mlp.proj: a matmul writing its [tokens, C] product, then an add reading it and the
     * residual stream) instead of one matmul_res that adds the residual inside the GEMM (backend
     * matmul_fwd_res). The same numbers on the CPU backend, bit for bit (on CUDA within matmul_fwd's
     * tolerance: the sum rounds once). Also chosen when the backend has no matmul_fwd_res, or with the
     * environment variable DG_TEST_UNFUSED_RESID=1. */
    DG_MODEL_UNFUSED_RESID = 64,
    /* train.recompute = selective: as RECOMPUTE_GELU, and each layer's two layer norms and its attention
     * core (the attention output and its aux, from the saved qkv) are re-run in the layer's backward
     * (graph pass recompute). Same numbers on the CPU backend (bitwise) and on CUDA in fp32. */
    DG_MODEL_RECOMPUTE_SELECTIVE = 128,
    /* train.recompute = full: only each layer's input is kept; the whole layer forward is re-run at the
     * start of its backward (graph pass recompute; with tensor parallelism the row-parallel all-reduce
     * outputs are kept too: collectives are not re-run). Implies the GELU recompute. */
    DG_MODEL_RECOMPUTE_FULL = 256,
    /* No fusion pass at all: the graph of the circuit breaker's conservative plan (the unfused GELU,
     * residual, GELU backward, classifier loss and per-parameter AdamW ops), with the arena. Implies
     * UNFUSED_GELU_BWD, ADAMW_PER_PARAM, UNFUSED_CE and UNFUSED_RESID; the numbers are the fused plan's
     * within matmul_res's rounding (bitwise on the CPU backend). dg_model_unfused_kernels_per_step. */
    DG_MODEL_NO_FUSION = 512
};

/* Builds the graph (forward + backward + optimizer) for micro-batches of [micro_batch, seq_len] tokens,
 * runs the passes, plans the arena, allocates everything on `be` and initialises the weights
 * deterministically from `seed` (GPT-2: N(0, 0.02); attn.proj and mlp.proj weights N(0, 0.02 /
 * sqrt(2 * n_layer)); biases 0; layernorm gains 1; padded wte rows 0). Initial values depend only on
 * (seed, tensor index, element index), so a shard can be initialised without the rest of the tensor.
 * Gradients and moments start at zero. `be` must outlive the model. */
dg_status_t dg_model_create(const dg_model_desc_t *d, dg_backend_t *be, int micro_batch, uint64_t seed,
                            dg_model_t **out);
dg_status_t dg_model_create_ex(const dg_model_desc_t *d, dg_backend_t *be, int micro_batch, uint64_t seed,
                               int flags, dg_model_t **out);

/* ---------------- distributed models (FSDP / HSDP / tensor parallelism) ----------------
 *
 * The same model on a device mesh dp_replicate x dp_shard x tp (dg_mesh.h). Each rank builds ITS graph:
 *  - tp > 1 (Megatron-style): attention heads are split over tp (QKV column-parallel, the output
 *    projection row-parallel), the MLP column- then row-parallel; the partial sums of the row-parallel
 *    products are all-reduced in the forward ("to replicate"), the gradients of the replicated inputs
 *    of column-parallel products in the backward ("from replicate"). Embeddings, the tied output head,
 *    layer norms and the row-parallel biases are replicated over tp (the biases are added by tp rank 0;
 *    their gradients are summed over tp before the update). n_head must be divisible by tp.
 *  - dp_shard > 1 (FSDP2-style): every parameter's tp-local tensor is sharded on dim 0 over dp_shard;
 *    rows that do not divide evenly are padded (each rank holds ceil(rows / dp_shard) rows; padding
 *    rows are zero and never read). Gradients and AdamW moments are sharded with it and AdamW updates
 *    only the local shard. Passes (shard.c) insert the all-gathers before a parameter's use (bucketed
 *    per transformer block up to bucket_bytes; issued one bucket ahead within prefetch_bytes), the
 *    reduce-scatter of its gradient, and explicit wait edges; see docs/fsdp.md.
 *  - dp_replicate > 1 (HSDP, or plain DDP when dp_shard = 1): the gradient shards are all-reduced over
 *    dp_replicate before the update.
 *  - the global gradient norm for clipping sums the local squares over dp_shard and tp (tp-replicated
 *    tensors counted once).
 * Gradients are SUMMED over the data-parallel ranks: pass dloss = 1 / (global tokens per step) so that
 * the sum is the mean over the global batch. All ranks of the mesh must create the model with the
 * same description, micro-batch, seed and options, and run the same calls in the same order. */
struct dg_comm;
struct dg_model_compile;
typedef struct dg_model_parallel {
    dg_mesh_shape_t mesh;               /* sizes of dp_replicate, dp_shard, tp */
    int coord[DG_MESH_NDIM];            /* this rank's coordinates */
    struct dg_comm *comm[DG_MESH_NDIM]; /* the group of each dimension of size > 1 (comm.h; its group rank
                                           = the coordinate); may be NULL with DG_MODEL_PLAN_ONLY */
    size_t bucket_bytes;                /* all-gather / reduce-scatter bucket size (unsharded bytes); 0 = one
                                           parameter per bucket; buckets never span two transformer blocks */
    size_t prefetch_bytes;              /* hoist the next bucket's all-gather while the current one computes
                                           when its gathered buffer fits in this many bytes; 0 = no prefetch */
    int overlap;               /* 1: collectives run on the comm stream and are waited for where their
                                  result is needed; 0: each is waited for right after it is issued */
    int reshard_after_forward; /* 1: free the unsharded parameters after their forward use and gather
                                  them again for the backward (the last block's stay) */
    dg_dtype_t reduce_dtype;   /* train.reduce_dtype: DG_F32, or DG_BF16 to move the data-parallel gradient
                                  reductions (dp_shard reduce-scatters, dp_replicate all-reduces) in bf16:
                                  cast ops around each one, gradients stay f32 (docs/fsdp.md, "Gradient
                                  reduction dtype"). No effect without a data-parallel dimension. */
    const struct dg_model_compile *compile; /* plan cache and circuit breaker; NULL = neither (below) */
    /* Pipeline chunk (docs/parallelism.md "The executor"): this model is units [pp_first_unit,
     * pp_first_unit + pp_n_units) of the L + 2 units (0 the embedding, 1..L the blocks, L + 1 the head,
     * src/pipeline/pipeline.h); pp_n_units = 0 is the whole model. See "pipeline chunks" below. */
    int pp_first_unit, pp_n_units;
} dg_model_parallel_t;

/* Defaults: mesh 1 x 1 x 1, 25 MB buckets, 256 MB prefetch budget, overlap on, reshard on, f32
 * reductions. */
void dg_model_parallel_default(dg_model_parallel_t *p);

/* ---------------- plan cache and circuit breaker (docs/cuda.md "Plan cache") ----------------
 *
 * Plan cache: the compiled plan (the graph after the passes, the memory plan, the model's references
 * into them, the fused-op choices) is kept in cache_dir, one entry per rank ("plan-<coords>-<slot>.bin",
 * slot = the model sizes and the mesh), under a key: dgtrain version and the hash of its binary, the
 * IR hash (the forward graph as built), backend, activation dtype, device name and compute capability,
 * driver / CUDA runtime / cuBLASLt / cuDNN / NCCL versions (CPU: OpenBLAS's configuration string), the
 * loaded runtime libraries by file hash (hashed once per path, size and mtime, remembered in
 * cache_dir/libhash.txt), micro-batch, flags, mesh and coordinates, bucket and prefetch sizes, overlap,
 * reshard, reduce dtype, the test hooks that change the pipeline and the backend's missing kernels.
 * The entry also holds the loss and a logits checksum of a fixed probe batch under fixed pattern weights:
 * every model built with a cache runs that probe (one forward; the real weights are drawn after it); a hit is
 * used only when it reproduces them (loss within 1e-5 relative, logits sums within 1e-5 of their absolute
 * sum; 2e-3 with bf16/fp16 activations), else it is rebuilt ("stale"). A key field that changed makes a
 * rebuild ("stale", naming the field); a truncated or damaged entry is ignored with a warning
 * ("corrupt"); both are rewritten (tmp + rename). The ranks of a mesh agree on every decision.
 *
 * Circuit breaker: the build (passes + memory plan) stops after a pass once it has taken more than
 * timeout_s, or after the plan when the plan's peak (arena + model state + ids) is above mem_budget;
 * either makes the conservative plan (no fusion passes, per-op allocation of activations, no graph
 * replay), reported as a fallback (dg_model_set_fallback_cb) of kind "compile_timeout" / "compile_oom"
 * (event ids FALLBACK_COMPILE_TIMEOUT / FALLBACK_COMPILE_OOM). A conservative plan is never cached. */
typedef struct dg_model_compile {
    const char *cache_dir; /* NULL or "": no plan cache */
    double timeout_s;      /* build-time limit; <= 0: none */
    size_t mem_budget;     /* bytes this rank may use; 0: no check */
} dg_model_compile_t;

/* What the build did: cache = "off" | "hit" | "miss" | "stale" | "corrupt", with a reason; build_s =
 * the graph passes and the memory plan (or loading the entry), probe_s = the probe; frozen_at =
 * dg_now_s() once the graph and plan were final (the start of the graph freeze latency); fallback =
 * "" or the breaker's event id. */
typedef struct dg_model_build_info {
    char cache[16];
    char reason[320];
    double build_s, probe_s, frozen_at;
    double key_s; /* computing the key (library files hashed the first time: libhash.txt) */
    char fallback[32];
} dg_model_build_info_t;
const dg_model_build_info_t *dg_model_build_info(const dg_model_t *m);
/* The stable event id of a fallback kind: "kernel" FALLBACK_UNSUPPORTED_OP, "memory"
 * FALLBACK_ARENA_ALLOC, "compile_timeout" FALLBACK_COMPILE_TIMEOUT, "compile_oom" FALLBACK_COMPILE_OOM,
 * anything else FALLBACK_OTHER. */
const char *dg_model_fallback_id(const char *kind);

/* dg_model_create_ex on a mesh. par = NULL is a single rank. DG_ERR_USAGE for a mesh the model cannot
 * use (n_head not divisible by tp, a missing comm, a comm of the wrong size). */
dg_status_t dg_model_create_parallel(const dg_model_desc_t *d, dg_backend_t *be, int micro_batch,
                                     uint64_t seed, int flags, const dg_model_parallel_t *par,
                                     dg_model_t **out);
void dg_model_free(dg_model_t *m);

/* ---- this rank's piece of each tensor (checkpoints, tests) ----
 * Parameter i's local tensor (the same layout for DG_STATE_PARAM, ADAM_M, ADAM_V and GRAD) holds
 * dg_model_local_numel() floats, row-major: the rows of this rank's dp_shard shard of its tp-local
 * tensor, padding rows (zero) included. It covers up to DG_MODEL_MAX_PIECES hyperslabs of the global
 * tensor (tp splits QKV into its q, k and v rows); piece j's count[0] x count[1] floats start at
 * element `offset` of the local tensor. A rank whose shard lies entirely in the padding has none. */
#define DG_MODEL_MAX_PIECES 4
typedef struct dg_model_piece {
    int64_t start[2], count[2]; /* in the global tensor; count[1] = 1 for 1-D tensors */
    size_t offset;              /* element offset in the local tensor */
} dg_model_piece_t;
size_t dg_model_local_numel(const dg_model_t *m, int i);
/* The pieces (at most DG_MODEL_MAX_PIECES) of parameter i held here; returns how many. */
int dg_model_local_pieces(const dg_model_t *m, int i, dg_model_piece_t *out);
/* 1 when this rank is the one that writes parameter i's pieces (replicas over dp_replicate and over tp
 * for tp-replicated tensors have exactly one writer). */
int dg_model_piece_owner(const dg_model_t *m, int i);
dg_status_t dg_model_get_local(dg_model_t *m, int i, int which, float *host_out);
dg_status_t dg_model_set_local(dg_model_t *m, int i, int which, const float *host_in);
/* All local tensors of one state (DG_STATE_PARAM, ADAM_M, ADAM_V, GRAD) at once: the model's flat
 * buffer of dg_model_flat_numel() floats, in which parameter i's local tensor starts at element
 * dg_model_flat_offset(m, i) (alignment gaps between tensors hold zeros). One copy instead of one per
 * tensor; into page-locked memory (the backend's host_alloc) it runs at the link's full speed. */
size_t dg_model_flat_numel(const dg_model_t *m);
size_t dg_model_flat_offset(const dg_model_t *m, int i);
dg_status_t dg_model_get_flat(dg_model_t *m, int which, float *host_out);
dg_status_t dg_model_set_flat(dg_model_t *m, int which, const float *host_in);
/* The same as set_flat from values made in pieces: fill(dst, start, n, ctx) writes elements
 * [start, start + n) of the flat buffer into dst; no host copy of the whole state is made. */
typedef void (*dg_model_fill_fn)(float *dst, size_t start, size_t n, void *ctx);
dg_status_t dg_model_set_flat_fill(dg_model_t *m, int which, dg_model_fill_fn fill, void *ctx);
/* The mesh the model was built for, and this rank's coordinates. */
const dg_model_parallel_t *dg_model_parallel(const dg_model_t *m);
/* The training step named by collective timeout messages from now on. */
void dg_model_set_step(dg_model_t *m, int64_t step);
/* Graph replay of the training step (parallel.cuda_graph; backends with graph_begin, i.e. CUDA). Once
 * one eager step has run (it sizes the backend's scratch and fills its plan caches), the ZERO phase, the
 * FWD+BWD phases with the micro-batch's token upload, and the OPT phase are each recorded on first use
 * and replayed from then on. What a recording bakes in (dloss; grad_clip, the loss-scale inverse, betas,
 * eps, weight decay; the frozen set) is compared at every call and a change records again. The step's lr
 * and bias corrections travel through the device scalar block, so they need no new recording. When
 * recording is impossible (a collective driven from the host, per-op profiling) or fails (capture or
 * instantiation error), the model runs op by op for the rest of its life, logs a warning and calls
 * cb(ctx, "fallback", reason) once; every recording calls cb(ctx, "captured", which). Both paths queue
 * the same kernels with the same arguments: the numbers are bitwise the same. No effect (and no
 * callback) on a backend that cannot record. cb may be NULL. */
typedef void (*dg_model_graph_cb_t)(void *ctx, const char *what, const char *detail);
void dg_model_set_graph_replay(dg_model_t *m, int on, dg_model_graph_cb_t cb, void *ctx);
/* Executor fallbacks (docs/cuda.md "Fallbacks"): when the activation arena cannot be allocated, activations
 * are allocated one by one over their live ranges (kind "memory"); an op kind the backend has no kernel for
 * runs on the host through copies of its tensors (kind "kernel", one report per op kind). The numbers are
 * those of the planned path. Both are decided when the model is created (the test hooks DG_TEST_ARENA_FAIL=1
 * and DG_TEST_NO_KERNEL=<op>[,<op>...] force them), are logged as warnings then, and block CUDA Graph replay
 * (which reports its own "fallback"). cb(ctx, kind, reason) is called once per report: at once for reports
 * made before it was set, and for any later one. Each rank reports its own. cb may be NULL. */
typedef void (*dg_model_fallback_cb_t)(void *ctx, const char *kind, const char *reason);
void dg_model_set_fallback_cb(dg_model_t *m, dg_model_fallback_cb_t cb, void *ctx);
/* Communication accounting since the last reset: seconds blocked waiting for asynchronous collectives
 * (the exposed communication), seconds in blocking collectives, and collectives run. */
typedef struct dg_model_comm_stats {
    double wait_s, blocking_s;
    uint64_t collectives;
    /* bytes each rank handed to the comm (a collective's send buffer: an all-gather's piece, a
     * reduce-scatter's whole input, an all-reduce's tensor), per mesh dimension, and those of the
     * data-parallel gradient reductions alone (the dp_shard reduce-scatters and the dp_replicate
     * all-reduces of the backward): halved by train.reduce_dtype = bf16 */
    uint64_t bytes[DG_MESH_NDIM];
    uint64_t grad_bytes;
    /* gradient-sync latency: wall seconds during which at least one gradient reduction was in flight,
     * from its post to the return of its wait as the host sees it (docs/health.md; on nccl with device-side
     * waits the wait returns once queued, so this is then the host's part only) */
    double grad_sync_s;
} dg_model_comm_stats_t;
void dg_model_comm_stats(dg_model_t *m, dg_model_comm_stats_t *out, int reset);

const dg_model_desc_t *dg_model_desc(const dg_model_t *m);
int dg_model_micro_batch(const dg_model_t *m);
int dg_model_n_tensors(const dg_model_t *m);
const dg_param_info_t *dg_model_param(const dg_model_t *m, int i); /* NULL if i is out of range */
/* Index of a parameter by name, or -1. */
int dg_model_find_param(const dg_model_t *m, const char *name);

/* Zeroes every parameter gradient (graph ops through the backend). */
dg_status_t dg_model_zero_grad(dg_model_t *m);

/* Micro-batches per optimizer step (gradient accumulation; default 1). With dp_replicate > 1 the
 * gradients are summed over dp_replicate inside the backward of the step's LAST micro-batch (bucket by
 * bucket on the communication stream, overlapped with the rest of that backward), so the model counts
 * forward_backward calls since the last zero_grad / optimizer_step: call n of n syncs, calls 1..n-1 do
 * not. A call beyond n, or an optimizer step after 1..n-1 calls, is DG_ERR_USAGE (the gradients would
 * be summed twice, or not at all). Without dp_replicate the count is not enforced. n >= 1. */
dg_status_t dg_model_set_grad_accum(dg_model_t *m, int n);

/* One micro-batch: tokens and targets are host arrays of micro_batch * seq_len ids in [0, vocab_size).
 * Runs forward and backward; parameter gradients ACCUMULATE. dloss scales the gradient of the SUM of
 * the token losses (pass 1 / (tokens per optimizer step) so that accumulation yields the gradient of
 * the mean). *mean_loss_out (may be NULL) receives the mean token loss of this micro-batch.
 * Out-of-range ids give DG_ERR_USAGE naming the position.
 * Host waits: on a backend with the v1.8 fences (backend.h) the call returns once the FORWARD has run
 * and its token losses are on the host; the backward may still be running on the device (everything
 * queued later runs after it, and every call that reads device state to the host syncs first). Without
 * the fences, or with DG_SYNC_HOST_READS=1 in the environment when the model was created, it returns
 * after the whole backward (a sync), as before. The loss is bitwise the same either way. */
dg_status_t dg_model_forward_backward(dg_model_t *m, const int32_t *tokens_host, const int32_t *targets_host,
                                      float dloss, float *mean_loss_out);
/* Forward only (evaluation); gradients untouched. */
dg_status_t dg_model_forward(dg_model_t *m, const int32_t *tokens_host, const int32_t *targets_host,
                             float *mean_loss_out);
/* Logits at position `pos` (0 <= pos < seq_len) of every sequence, after a forward on tokens_host:
 * host_out receives micro_batch * vocab_size floats (row b = sequence b; padded columns dropped).
 * Positions > pos do not influence the result (causal), so callers sampling may fill them with anything. */
dg_status_t dg_model_logits(dg_model_t *m, const int32_t *tokens_host, int pos, float *host_out);

/* Global-norm clipping then AdamW on every trainable parameter, as graph ops through the backend. t and
 * lr etc. come from h; *grad_norm_out (may be NULL) receives the global L2 norm of the (loss-scale-
 * corrected) gradients of the trainable parameters, before clipping. If it is not finite (fp16
 * overflow, divergence) NO parameter or moment changes (the AdamW skips itself on the device), the call
 * returns DG_OK and the non-finite norm tells the caller that the update was skipped. Gradients are not
 * zeroed. Host waits: with the v1.8 fences the norm is copied to the host right after it is computed and
 * the call returns once that copy has landed, while the AdamW may still run (later calls are queued
 * behind it; dg_model_get_* / _set_flat sync first); otherwise (or DG_SYNC_HOST_READS=1 at creation) it
 * returns after the AdamW (a sync). Same bits either way. */
dg_status_t dg_model_optimizer_step(dg_model_t *m, const dg_optim_hparams_t *h, float *grad_norm_out);

/* Freezes (frozen = 1) or unfreezes parameter i (train.freeze): a frozen tensor gets no AdamW update and
 * does not count in the gradient norm; its gradient is still accumulated (the backward kernels produce
 * it anyway) and zeroed. Takes effect at the next optimizer step; no replanning. DG_ERR_USAGE for a bad
 * index. */
dg_status_t dg_model_set_frozen(dg_model_t *m, int i, int frozen);

/* Full f32 copy of one state of parameter i to/from the host (numel floats). Setting DG_STATE_PARAM
 * also refreshes the compute copy. DG_ERR_USAGE for a bad index or state, or when the model is
 * distributed (tp or dp_shard > 1: use dg_model_get_local / dg_model_set_local). */
dg_status_t dg_model_get_tensor(dg_model_t *m, int i, int which, float *host_out);
dg_status_t dg_model_set_tensor(dg_model_t *m, int i, int which, const float *host_in);

/* The --plan-only view: every op in schedule order with phase, stream, inputs, output shape, dtype,
 * bytes and arena offset; then the arena size against the sum of all activation sizes, and parameter,
 * gradient and optimizer bytes. json = 1 writes one JSON object instead of the table. */
dg_status_t dg_model_print_plan(const dg_model_t *m, FILE *out, int json);
size_t dg_model_arena_bytes(const dg_model_t *m);          /* bytes of the activation arena */
size_t dg_model_activation_bytes_sum(const dg_model_t *m); /* sum of every arena tensor's size */
/* The most arena bytes live at one point of the schedule (the bound no placement can beat); the start
 * event's arena_fragmentation is 1 - this / dg_model_arena_bytes. */
size_t dg_model_arena_live_peak_bytes(const dg_model_t *m);
size_t dg_model_state_bytes(const dg_model_t *m); /* params + grads + AdamW moments (+ compute copy) held by
                                                     THIS rank (sharded: about 1 / dp_shard of the model) */
int dg_model_n_ops(const dg_model_t *m);          /* ops in the schedule (all phases) */
/* The device memory this rank's plan needs: the activations (the arena; with eager allocation the live
 * peak), the model state (dg_model_state_bytes) and the token ids. The circuit breaker's budget check and
 * the SLA objective memory_plan (docs/sla.md) compare against it. */
size_t dg_model_planned_bytes(const dg_model_t *m);
/* A pipeline chunk's: dg_model_planned_bytes plus what its activation slots add (each slot past the first
 * an arena and token ids of its own, every slot its input activation and output gradient buffers). */
size_t dg_model_stage_planned_bytes(const dg_model_t *m);
/* Kernel launches of one optimizer step (zero_grad, `micro_batches` forward_backward calls,
 * optimizer_step): ops that call a backend compute entry (not collectives, waits or structural kinds), the
 * ZERO and OPT phases once, FWD and BWD once per micro-batch (their gradient-sync ops only in the last).
 * micro_batches <= 0: dg_model_set_grad_accum's; a pipeline chunk runs the schedule's m micro-batches
 * (dg_model_stage_forward/_backward, the gradient sync in one backward) and is counted with m. The
 * executor counts the same launches as they run (dg_exec_t.kernels_run). */
int64_t dg_model_kernels_per_step(const dg_model_t *m, int micro_batches);
/* The same count for this model built without any fusion pass (DG_MODEL_NO_FUSION; a plan-only graph of
 * the same mesh, stage, recompute and micro-batch, no memory, no collective): the start event's
 * kernels_per_step_unfused (docs/sla.md "Start-event figures"). */
dg_status_t dg_model_unfused_kernels_per_step(const dg_model_t *m, int micro_batches, int64_t *out);

/* Per-op-kind timing of everything run while on (the backend is synchronised after every op, so this
 * slows GPU runs down). dg_model_print_profile prints seconds, calls and share per op kind, largest
 * first, and resets the counters. */
void dg_model_set_profiling(dg_model_t *m, int on);
/* Trace every op of the following steps (cb NULL: off): cb(ctx, op kind, node name, phase, comm, t0, t1),
 * wall-clock seconds (dg_now_s), on the calling thread; compute ops synchronised one by one, collectives
 * from post to the return of their wait (dg_exec_set_trace). No CUDA Graph replay while on. */
typedef void (*dg_model_trace_cb_t)(void *ctx, const char *op, const char *name, const char *phase, int comm,
                                    double t0, double t1);
void dg_model_set_trace(dg_model_t *m, dg_model_trace_cb_t cb, void *ctx);
void dg_model_print_profile(dg_model_t *m, FILE *out);

/* ---------------- pipeline chunks (docs/parallelism.md "The executor") ----------------
 *
 * A model made with par->pp_n_units > 0 is one chunk of a pipeline: the blocks of its units, the
 * embedding when it holds unit 0 (its input: the token ids), the head when it holds unit L + 1 (ln_f, the
 * lm_head over its own copy of the tied wte, the loss over the targets). A chunk without the embedding
 * reads its input activation [micro_batch, seq_len, d_model] (act dtype) from a device buffer and yields
 * that input's gradient after its backward; a chunk without the head yields its output activation after
 * the forward and takes that output's gradient as the seed of its backward. Parameters keep their global
 * names and their initial values (drawn from the global tensor index); the head's wte copy is not counted
 * in the gradient norm (the embedding's chunk counts wte) and is written by no checkpoint
 * (dg_model_piece_owner is 0): the executor sums the two copies' gradients before the optimizer step, so
 * both copies stay equal. No plan cache and no CUDA Graph replay for chunks.
 *
 * Activation slots: a chunk runs the forwards of several micro-batches before their backwards (1F1B keeps
 * up to p - s in flight), so it has `n` slots (dg_model_stage_slots), each an activation arena of its own
 * with its own token, target, input and seed buffers; parameters, gradients and optimizer state are
 * shared. Slot 0 exists from creation. Forward and backward of one micro-batch use the same slot. */
dg_status_t dg_model_stage_slots(dg_model_t *m, int n);
int dg_model_stage_n_slots(const dg_model_t *m);
int dg_model_stage_has_input(const dg_model_t *m);    /* no embedding: reads an input activation */
int dg_model_stage_has_loss(const dg_model_t *m);     /* the head (and the loss) are here */
size_t dg_model_stage_act_bytes(const dg_model_t *m); /* bytes of one activation message */
/* Device buffers of slot s: the input activation to fill before the forward (NULL without input), the
 * output's gradient to fill before the backward (NULL with the head), the output activation after the
 * forward (NULL with the head), the input's gradient after the backward (NULL without input). */
void *dg_model_stage_input(dg_model_t *m, int s);
void *dg_model_stage_seed(dg_model_t *m, int s);
void *dg_model_stage_output(dg_model_t *m, int s);
void *dg_model_stage_input_grad(dg_model_t *m, int s);
/* The forward of one micro-batch in slot s (tokens used with the embedding, targets with the head; either
 * may be NULL where unused). dloss as in dg_model_forward_backward; *mean_loss_out (head only, may be
 * NULL) the micro-batch's mean token loss. eval = 1: no backward follows (evaluation). Returns after the
 * forward has run (a sync). */
dg_status_t dg_model_stage_forward(dg_model_t *m, int s, const int32_t *tokens, const int32_t *targets,
                                   float dloss, int eval, float *mean_loss_out);
/* The backward of slot s's micro-batch; parameter gradients accumulate. grad_sync = 1 on the step's last
 * backward of this chunk (the dp_replicate sum runs in it). Returns after it has run (a sync). */
dg_status_t dg_model_stage_backward(dg_model_t *m, int s, int grad_sync);
/* The optimizer step in two halves, so that the sum of squares can be summed over the chunks of a
 * pipeline first: _sumsq runs the OPT phase up to the clip factor and returns this chunk's sum of squared
 * gradients (already summed over dp_shard and tp); _finish takes the global sum, computes the clip factor
 * and the norm and runs AdamW (skipped on the device when the norm is not finite). */
dg_status_t dg_model_opt_sumsq(dg_model_t *m, const dg_optim_hparams_t *h, double *sumsq_out);
dg_status_t dg_model_opt_finish(dg_model_t *m, double sumsq, float *grad_norm_out);
/* Parameter i's local gradient on the device (dg_model_local_numel floats). */
float *dg_model_grad_dev(dg_model_t *m, int i);

/* ---- the model's IR (tests, benchmarks, the plan printer): graph.h types ---- */
struct dg_graph;
struct dg_memplan;
struct dg_exec;
struct dg_graph *dg_model_graph(const dg_model_t *m);
const struct dg_memplan *dg_model_plan(const dg_model_t *m);
struct dg_exec *dg_model_exec(const dg_model_t *m); /* NULL for a plan-only model */

#ifdef __cplusplus
}
#endif
#endif /* DG_MODEL_H */
