/* graph.h — the model-level API of the static training graph (the public header of src/graph/).
 *
 * A dg_model_t is a GPT-2-family decoder built as a static graph: the model builder emits forward ops,
 * autodiff appends the backward ops, the optimizer pass appends global-norm clipping and AdamW, and the
 * memory planner gives every activation an offset in one arena. The training loop, checkpointing and FSDP
 * code against this header; the IR itself (nodes, op registry, passes, planner, executor) is private to
 * the module (graph_impl.h).
 *
 * Storage: parameters (master f32 and, when the backend's activation dtype is not f32, a compute copy),
 * parameter gradients (f32) and AdamW moments (f32) live in four flat device buffers outside the arena;
 * activations, their gradients and all temporaries live in the arena.
 *
 * Determinism: with the same description, micro-batch, seed and backend, every call sequence gives
 * bitwise-identical losses, gradients and weights (the schedule is fixed and the backend is
 * deterministic).
 */
#ifndef DG_GRAPH_H
#define DG_GRAPH_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "dg_common.h"
#include "backend.h"
#include "config.h"

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
dg_status_t dg_model_desc_from_config(const dg_config_t *cfg, dg_model_desc_t *out);
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
    DG_MODEL_NO_ARENA_REUSE = 2
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
void dg_model_free(dg_model_t *m);

const dg_model_desc_t *dg_model_desc(const dg_model_t *m);
int dg_model_micro_batch(const dg_model_t *m);
int dg_model_n_tensors(const dg_model_t *m);
const dg_param_info_t *dg_model_param(const dg_model_t *m, int i); /* NULL if i is out of range */
/* Index of a parameter by name, or -1. */
int dg_model_find_param(const dg_model_t *m, const char *name);

/* Zeroes every parameter gradient (graph ops through the backend). */
dg_status_t dg_model_zero_grad(dg_model_t *m);

/* One micro-batch: tokens and targets are host arrays of micro_batch * seq_len ids in [0, vocab_size).
 * Runs forward and backward; parameter gradients ACCUMULATE. dloss scales the gradient of the SUM of
 * the token losses (pass 1 / (tokens per optimizer step) so that accumulation yields the gradient of
 * the mean). *mean_loss_out (may be NULL) receives the mean token loss of this micro-batch.
 * Out-of-range ids give DG_ERR_USAGE naming the position. */
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
 * corrected) gradients of the trainable parameters, before clipping. The norm is read back to the host
 * between the norm and the update (one small device-to-host copy per step): if it is not finite (fp16
 * overflow, divergence) NO parameter or moment changes, the call returns DG_OK and the non-finite norm
 * tells the caller that the update was skipped. Gradients are not zeroed. */
dg_status_t dg_model_optimizer_step(dg_model_t *m, const dg_optim_hparams_t *h, float *grad_norm_out);

/* Freezes (frozen = 1) or unfreezes parameter i (train.freeze): a frozen tensor gets no AdamW update and
 * does not count in the gradient norm; its gradient is still accumulated (the backward kernels produce
 * it anyway) and zeroed. Takes effect at the next optimizer step; no replanning. DG_ERR_USAGE for a bad
 * index. */
dg_status_t dg_model_set_frozen(dg_model_t *m, int i, int frozen);

/* Full f32 copy of one state of parameter i to/from the host (numel floats). Setting DG_STATE_PARAM
 * also refreshes the compute copy. DG_ERR_USAGE for a bad index or state. */
dg_status_t dg_model_get_tensor(dg_model_t *m, int i, int which, float *host_out);
dg_status_t dg_model_set_tensor(dg_model_t *m, int i, int which, const float *host_in);

/* The --plan-only view: every op in schedule order with phase, stream, inputs, output shape, dtype,
 * bytes and arena offset; then the arena size against the sum of all activation sizes, and parameter,
 * gradient and optimizer bytes. json = 1 writes one JSON object instead of the table. */
dg_status_t dg_model_print_plan(const dg_model_t *m, FILE *out, int json);
size_t dg_model_arena_bytes(const dg_model_t *m);          /* bytes of the activation arena */
size_t dg_model_activation_bytes_sum(const dg_model_t *m); /* sum of every arena tensor's size */
size_t dg_model_state_bytes(const dg_model_t *m); /* params + grads + AdamW moments (+ compute copy) */
int dg_model_n_ops(const dg_model_t *m);          /* ops in the schedule (all phases) */

/* Per-op-kind timing of everything run while on (the backend is synchronised after every op, so this
 * slows GPU runs down). dg_model_print_profile prints seconds, calls and share per op kind, largest
 * first, and resets the counters. */
void dg_model_set_profiling(dg_model_t *m, int on);
void dg_model_print_profile(dg_model_t *m, FILE *out);

#ifdef __cplusplus
}
#endif
#endif /* DG_GRAPH_H */
