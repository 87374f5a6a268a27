/* backend.h — the compute-backend contract: one vtable that the executor calls for memory and for
 * every kernel. Implementations: backend_cpu (C + OpenMP + OpenBLAS, fp32, the reference) and
 * backend_cuda (CUDA C + cuBLASLt/cuDNN). The graph executor knows nothing else about a device.
 *
 * Contract version: v1.12. Changes are additive only (new entries appended at the end of the table,
 * optional ones NULL where a backend has none), because two backends and the executor are written
 * against it; each change, with the version that brought it, is recorded in docs/backend.md (the
 * table's history lives there, not here), which also summarises the table.
 *
 * Dtype classes (fixed when the backend is created, from train.precision):
 *   act   — activations, their gradients, and the compute copy of parameters: be->act_dtype
 *           (DG_F32 on CPU; DG_BF16 / DG_F16 / DG_F32 on CUDA).
 *   f32   — master parameters, parameter gradients, AdamW moments, losses, layernorm statistics,
 *           attention/cross-entropy statistics, device scalars. Always float32.
 *   i32   — token ids and targets.
 * Parameter-gradient outputs (dw, db, dwte, dwpe) are always ACCUMULATED (+=) in f32, so gradient
 * accumulation over micro-batches needs no extra op; the executor zeroes them once per step.
 * Activation-gradient outputs take `acc`: 0 = overwrite, 1 = add into what is there (lets autodiff fuse
 * the sum of gradients of a tensor with several consumers, e.g. the residual stream).
 * In-place: an output may alias an input only where a kernel says so.
 *
 * Layouts (row-major): activations [N, C] with N = B*T rows; linear weights [OC, C] (out = inp·Wᵀ + b,
 * as in PyTorch's nn.Linear); qkv [B, T, 3C] with q, k, v blocks of C each, head h at columns
 * h*C/NH ... ; the token embedding wte [Vp, C] with Vp >= V padded rows (zero, never trained into by
 * targets >= V) and tied to the output head; position embedding wpe [T_max, C].
 *
 * Determinism: every kernel gives bitwise-identical results for identical inputs run after run
 * (no atomics in reductions; fixed reduction orders).
 */
#ifndef DG_BACKEND_H
#define DG_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "dg_common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dg_backend dg_backend_t;

typedef enum { DG_EPI_NONE = 0, DG_EPI_GELU = 1 } dg_epilogue_t;

/* The device scalar block (f32) that adamw_dev and the executor share, index by index. */
enum {
    DG_DS_SUMSQ = 0,   /* sum of squares of all gradients (sumsq_f32 accumulates here) */
    DG_DS_GSCALE = 1,  /* gradient factor: clip factor x loss-scale inverse (clip_scale writes it) */
    DG_DS_NORM = 2,    /* gradient norm (clip_scale writes it); AdamW is skipped when not finite */
    DG_DS_LR = 4,      /* learning rate of this step */
    DG_DS_INV_BC1 = 5, /* 1 / (1 - beta1^t), computed in double on the host */
    DG_DS_INV_BC2 = 6, /* 1 / (1 - beta2^t) */
    DG_DS_COUNT = 8
};

/* One tensor of adamw_multi_dev elements [off, off + count) of each flat buffer. 16 bytes; a table
 * of them lives in device memory (the backend's alloc) and is read by the device when the op runs. */
typedef struct dg_adamw_seg {
    uint64_t off;   /* first element; a multiple of 4 (16 bytes of f32) */
    uint32_t count; /* elements, >= 1 */
    uint32_t flags; /* DG_ADAMW_SEG_* */
} dg_adamw_seg_t;
enum {
    DG_ADAMW_SEG_DECAY = 1u, /* apply the weight decay (else wd = 0 for this tensor) */
    DG_ADAMW_SEG_SKIP = 2u   /* leave this tensor alone (frozen) */
};

/* One tensor of sumsq_multi elements [off, off + count) of the flat buffer. 16 bytes, the layout
 * of dg_adamw_seg_t; unlike AdamW's table the order is free (it is the order of the additions into *out)
 * and offsets need no alignment. */
typedef struct dg_sumsq_seg {
    uint64_t off;   /* first element */
    uint32_t count; /* elements, >= 1 */
    uint32_t flags; /* DG_SUMSQ_SEG_* */
} dg_sumsq_seg_t;
enum {
    DG_SUMSQ_SEG_SKIP =
        1u /* leave this tensor out of the sum (frozen), as if its sumsq_f32 were not called */
};

typedef struct dg_backend_config {
    dg_dtype_t act_dtype; /* DG_F32 | DG_BF16 | DG_F16 */
    int device;           /* CUDA device ordinal; ignored by CPU */
    int threads;          /* CPU threads; 0 = OpenMP default */
    uint64_t seed;        /* for any backend-internal randomness (none today) */
    int fp8; /* CUDA, bf16 only: linear layers' GEMMs on FP8 operands (train.precision=fp8, docs/cuda.md);
                refused at creation on a GPU without FP8 tensor cores; CPU: refused */
} dg_backend_config_t;

typedef struct dg_backend_ops {
    const char *name; /* "cpu" | "cuda" */

    /* ---- lifetime and memory ---- */
    void (*destroy)(dg_backend_t *be);
    dg_status_t (*alloc)(dg_backend_t *be, size_t bytes, void **out); /* device memory, 256-byte aligned */
    void (*free)(dg_backend_t *be, void *p);
    dg_status_t (*to_device)(dg_backend_t *be, void *dst, const void *host_src, size_t bytes);
    dg_status_t (*to_host)(dg_backend_t *be, void *host_dst, const void *src, size_t bytes);
    dg_status_t (*copy)(dg_backend_t *be, void *dst, const void *src, size_t bytes); /* device to device */
    dg_status_t (*memset0)(dg_backend_t *be, void *p, size_t bytes);
    dg_status_t (*sync)(dg_backend_t *be); /* wait for all queued work; reports async kernel errors */

    /* ---- elementwise / utility ---- */
    /* dst[i] = (dst_t) src[i]; any pair of f32/bf16/f16. */
    dg_status_t (*cast)(dg_backend_t *be, void *dst, dg_dtype_t dst_t, const void *src, dg_dtype_t src_t,
                        size_t n);
    /* out = a + b (act). out may alias a or b. */
    dg_status_t (*add)(dg_backend_t *be, void *out, const void *a, const void *b, size_t n);
    /* dst (act) = acc ? dst + src : src. */
    dg_status_t (*accumulate)(dg_backend_t *be, void *dst, const void *src, size_t n, int acc);
    /* *out_f32 (device scalar) += sum(x[i]^2) over n f32 values, deterministic order. */
    dg_status_t (*sumsq_f32)(dg_backend_t *be, float *out_dev, const float *x, size_t n);
    /* x (f32) *= s (host scalar). */
    dg_status_t (*scale_f32)(dg_backend_t *be, float *x, size_t n, float s);

    /* ---- model kernels ---- */
    /* out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:] */
    dg_status_t (*encoder_fwd)(dg_backend_t *be, void *out, const int32_t *tokens, const void *wte,
                               const void *wpe, int B, int T, int C);
    /* dwte[tok,:] += dout[b,t,:], dwpe[t,:] += dout[b,t,:]; deterministic (no atomics). */
    dg_status_t (*encoder_bwd)(dg_backend_t *be, float *dwte, float *dwpe, const void *dout,
                               const int32_t *tokens, int B, int T, int C);
    /* out = (inp - mean) * rstd * w + b per row; mean, rstd saved (f32 [N]). eps = 1e-5. */
    dg_status_t (*layernorm_fwd)(dg_backend_t *be, void *out, float *mean, float *rstd, const void *inp,
                                 const void *w, const void *b, int N, int C);
    dg_status_t (*layernorm_bwd)(dg_backend_t *be, void *dinp, float *dw, float *db, const void *dout,
                                 const void *inp, const void *w, const float *mean, const float *rstd, int N,
                                 int C, int acc);
    /* out[N,OC] = inp[N,C] · w[OC,C]ᵀ + bias[OC] (bias may be NULL). With DG_EPI_GELU, pre (act [N,OC])
     * receives the value before GELU and out receives gelu(pre). */
    dg_status_t (*matmul_fwd)(dg_backend_t *be, void *out, void *pre, const void *inp, const void *w,
                              const void *bias, int N, int C, int OC, dg_epilogue_t epi);
    /* dinp[N,C] (acc) = dout · w; dw[OC,C] += doutᵀ · inp; dbias[OC] += column sums of dout (NULL = none).
     * dinp may be NULL (no input gradient needed, e.g. first layer inputs that are not trainable). */
    dg_status_t (*matmul_bwd)(dg_backend_t *be, void *dinp, float *dw, float *dbias, const void *dout,
                              const void *inp, const void *w, int N, int C, int OC, int acc);
    /* GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
    dg_status_t (*gelu_fwd)(dg_backend_t *be, void *out, const void *inp, size_t n);
    dg_status_t (*gelu_bwd)(dg_backend_t *be, void *dinp, const void *inp, const void *dout, size_t n,
                            int acc);
    /* The backward of out[N,OC] = inp[N,C] · w[OC,C]ᵀ + bias where inp = gelu(pre) (pre, inp: act [N,C];
     * inp is the GELU output, saved or recomputed), through the GELU in one call:
     *   dw[OC,C] += doutᵀ · inp;   dbias[OC] += column sums of dout (NULL = none);
     *   dpre[N,C] (acc) = (dout · w) ⊙ gelu'(pre)
     * i.e. matmul_bwd's input gradient fed through gelu_bwd, without materialising it. With acc = 1 the
     * product is added to dpre AFTER the GELU derivative (dpre += (dout · w) ⊙ gelu'(pre)).
     * In-place: with acc = 0, dpre MAY alias inp (the weight gradient is taken first); it must not alias
     * pre, dout or w. Results equal matmul_bwd followed by gelu_bwd within the matmul_bwd tolerance; on
     * f32 (CPU, and CUDA's exact f32 mode) they are bitwise the same. */
    dg_status_t (*matmul_bwd_dgelu)(dg_backend_t *be, void *dpre, float *dw, float *dbias, const void *dout,
                                    const void *inp, const void *w, const void *pre, int N, int C, int OC,
                                    int acc);
    /* Causal multi-head self-attention, scale 1/sqrt(C/NH). aux is backend scratch saved for backward
     * of attention_aux_bytes() bytes (e.g. the logsumexp per row, or the full probability matrix on CPU). */
    size_t (*attention_aux_bytes)(dg_backend_t *be, int B, int T, int C, int NH);
    dg_status_t (*attention_fwd)(dg_backend_t *be, void *out, void *aux, const void *qkv, int B, int T, int C,
                                 int NH);
    /* dqkv [B,T,3C] is overwritten (acc = 0 semantics). */
    dg_status_t (*attention_bwd)(dg_backend_t *be, void *dqkv, const void *dout, const void *qkv,
                                 const void *out, const void *aux, int B, int T, int C, int NH);
    /* Cross-entropy over the first V of Vp logit columns: losses[i] = lse_i - logits[i, targets[i]];
     * lse (f32 [N]) saved for backward. */
    dg_status_t (*crossentropy_fwd)(dg_backend_t *be, float *losses, float *lse, const void *logits,
                                    const int32_t *targets, int N, int V, int Vp);
    /* dlogits[i,j] = (softmax_ij - [j == target_i]) * dloss for j < V, 0 for V <= j < Vp.
     * dlogits MAY alias logits (in place). dloss is typically loss_scale / (global tokens in the step). */
    dg_status_t (*crossentropy_bwd)(dg_backend_t *be, void *dlogits, const void *logits, const float *lse,
                                    const int32_t *targets, int N, int V, int Vp, float dloss);
    /* AdamW on one f32 tensor: g = grad * (*gscale_dev); m,v updated; master -= lr * (mhat/(sqrt(vhat)+eps)
     * + wd * master); if compute != NULL it receives the new master cast to act dtype.
     * gscale_dev is a device f32 scalar (clip factor x loss-scale inverse), so no host sync is needed.
     * t is the 1-based step for bias correction. */
    dg_status_t (*adamw)(dg_backend_t *be, float *master, void *compute, const float *grad, float *m,
                         float *v, size_t n, float lr, float beta1, float beta2, float eps, float wd,
                         int64_t t, const float *gscale_dev);
    /* *gscale_dev = min(1, clip / (sqrt(*sumsq_dev) + 1e-6)) * extra   (clip <= 0 means no clipping);
     * also writes the norm (sqrt(sumsq)) to *norm_dev. */
    dg_status_t (*clip_scale)(dg_backend_t *be, float *gscale_dev, float *norm_dev, const float *sumsq_dev,
                              float clip, float extra);

    /* ---- device-side step scalars and graph replay ---- */
    /* Host memory the device can copy from asynchronously (page-locked on CUDA; plain malloc on CPU). */
    dg_status_t (*host_alloc)(dg_backend_t *be, size_t bytes, void **out);
    void (*host_free)(dg_backend_t *be, void *p);
    /* dst (device) = host_src[0, bytes), ordered after the work queued before it; host_src comes from
     * host_alloc and must not change until the copy has run (the next sync). The copy reads host_src
     * when it runs: recorded in a graph, every replay copies what host_src holds at that moment. */
    dg_status_t (*upload_async)(dg_backend_t *be, void *dst, const void *host_src, size_t bytes);
    /* adamw with lr = sc[DG_DS_LR], the bias corrections sc[DG_DS_INV_BC1], sc[DG_DS_INV_BC2] and the
     * gradient factor sc[DG_DS_GSCALE] read on the device (sc: device f32[DG_DS_COUNT]); the same
     * arithmetic as adamw given those values, bit for bit. Changes nothing when sc[DG_DS_NORM] is not
     * finite (the step is skipped). */
    dg_status_t (*adamw_dev)(dg_backend_t *be, float *master, void *compute, const float *grad, float *m,
                             float *v, size_t n, float beta1, float beta2, float eps, float wd,
                             const float *sc);
    /* Graph replay (NULL where the backend cannot record): between graph_begin and graph_end the ops
     * are recorded, not run; graph_end returns the instantiated graph in *graph (NULL and an error when
     * recording or instantiation failed; recording is over either way). graph_launch queues one replay. */
    dg_status_t (*graph_begin)(dg_backend_t *be);
    dg_status_t (*graph_end)(dg_backend_t *be, void **graph);
    dg_status_t (*graph_launch)(dg_backend_t *be, void *graph);
    void (*graph_free)(dg_backend_t *be, void *graph);

    /* ---- f32 accumulation (gradient reductions in another dtype) ---- */
    /* dst[i] += src[i], n f32 values (any act dtype), queued in order with every other op: no host sync,
     * capturable. dst and src must not overlap unless equal. Deterministic (one add per element). */
    dg_status_t (*add_f32)(dg_backend_t *be, float *dst, const float *src, size_t n);

    /* ---- AdamW over the flat buffers in one launch (optional: NULL where the backend has none) ---- */
    /* adamw_dev over every segment of a table at once: for each segs[i] without DG_ADAMW_SEG_SKIP, exactly
     *   adamw_dev(master + off, compute ? compute + off : NULL, grad + off, m + off, v + off, count,
     *             beta1, beta2, eps, (flags & DG_ADAMW_SEG_DECAY) ? wd : 0, sc)
     * bit for bit (same float operations per element), in one call (CUDA: one kernel launch, whatever
     * nseg). segs: nseg entries in DEVICE memory (from alloc; upload_async may fill it earlier on the
     * queue: the table is read when the op runs, so a recorded graph replays whatever it holds then),
     * sorted by off, not overlapping, off a multiple of 4, off + count <= span. span: elements of each
     * flat buffer (compute in the act dtype, the others f32) that the segments lie in; elements of no
     * segment (gaps) are not touched. Like adamw_dev, changes nothing when sc[DG_DS_NORM] is not finite. */
    dg_status_t (*adamw_multi_dev)(dg_backend_t *be, const dg_adamw_seg_t *segs, int nseg, size_t span,
                                   float *master, void *compute, const float *grad, float *m, float *v,
                                   float beta1, float beta2, float eps, float wd, const float *sc);

    /* ---- the gradient norm over the flat buffer in one launch (optional: NULL where the backend has none)
     * ---- */
    /* sumsq_f32 over every segment of a table at once: for i = 0 .. nseg-1 in this order, each segment
     * without DG_SUMSQ_SEG_SKIP does exactly
     *   sumsq_f32(out_dev, base + off, count)
     * bit for bit: the same per-segment reduction, and the per-segment totals added into *out_dev one at a
     * time in table order (*out_dev + t_0 + t_1 + ..., left to right), as the sequence of calls would.
     * The table comes twice, with the same entries: `segs` in host memory, read during the call (the
     * backend sizes its launches and scratch from off and count: CUDA launches ONE partial-sum kernel
     * over every segment's blocks, one final reduction per segment, one ordered add, whatever nseg), and
     * `segs_dev` in DEVICE memory (from alloc; upload_async may fill it earlier on the queue), read when
     * the op runs. In a recorded graph the launch geometry is baked in: replays must keep off and count,
     * but see the flags the device table holds then (a segment skipped or not at each replay).
     * Rules: count >= 1, off + count <= span (elements of base); segments may come in any order and may
     * overlap (they are only read); no alignment asked (the vector path is chosen per segment, as
     * sumsq_f32 chooses it per pointer). nseg = 0 does nothing. */
    dg_status_t (*sumsq_multi)(dg_backend_t *be, float *out_dev, const float *base, size_t span,
                               const dg_sumsq_seg_t *segs, const dg_sumsq_seg_t *segs_dev, int nseg);
    /* ---- host reads that do not drain the queue (optional: all NULL, or all set) ---- */
    /* host_dst[0, bytes) = src (device), queued in order with every other op: the copy reads src when
     * the work queued before it has run, and host_dst holds the data only once a fence recorded after
     * this call has been waited on (or after sync). host_dst must come from host_alloc (page-locked:
     * the copy is then asynchronous and capturable) and stay allocated until then. Recorded in a graph,
     * every replay copies again into the same host_dst. CPU: a plain copy, done when it returns. */
    dg_status_t (*download_async)(dg_backend_t *be, void *host_dst, const void *src, size_t bytes);
    /* A fence: a marker in the backend's queue that the host can wait on. fence_create makes one
     * (*fence != NULL; not yet recorded); fence_destroy frees it (NULL is fine) after its latest eager
     * placement has been reached. A fence recorded into a graph must outlive every launch of it. */
    dg_status_t (*fence_create)(dg_backend_t *be, void **fence);
    void (*fence_destroy)(dg_backend_t *be, void *fence);
    /* Places the fence after all the work queued so far (re-recording moves it). Legal during a graph
     * recording: the recorded graph then places it again at its position at every replay (CUDA: an
     * external event-record node). */
    dg_status_t (*fence_record)(dg_backend_t *be, void *fence);
    /* Blocks the host until the work queued before the fence's latest placement (eager, or in the
     * latest replay launched) has run; a fence never recorded returns at once. Reports what sync
     * reports for that work (asynchronous kernel faults, the device error flags: a bad target or token
     * id) with a message naming the fence wait; work queued after the fence may still be running. */
    dg_status_t (*fence_wait)(dg_backend_t *be, void *fence);
    /* ---- attention_bwd with a workspace from the caller (optional: both NULL, or both set) ---- */
    /* Bytes of device memory attention_bwd_ws wants as `ws` for this shape (0: none). May plan the shape
     * (CUDA: builds cuDNN's execution plans), so call it outside a graph recording. The graph gives the
     * workspace a place in the activation arena, live only during the op, so it shares memory that is
     * free at that point of the step (the logits, after the classifier's backward) instead of adding
     * to the peak. */
    size_t (*attention_bwd_ws_bytes)(dg_backend_t *be, int B, int T, int C, int NH);
    /* attention_bwd, with `ws` (ws_bytes >= attention_bwd_ws_bytes of the shape, 256-byte aligned, or
     * NULL / too small: the backend takes its own scratch) as temporary memory. Same results. */
    dg_status_t (*attention_bwd_ws)(dg_backend_t *be, void *dqkv, const void *dout, const void *qkv,
                                    const void *out, const void *aux, void *ws, size_t ws_bytes, int B, int T,
                                    int C, int NH);

    /* ---- the classifier loss and its gradient in one pass (optional: NULL where the backend has none) ----
     */
    /* The classifier loss and its gradient in one call, for a step whose backward follows:
     *   crossentropy_fwd(losses, lse, logits, targets, N, V, Vp);
     *   crossentropy_bwd(dlogits, logits, lse, targets, N, V, Vp, dloss);
     * with the same results bit for bit (losses, lse, dlogits; a target outside [0, V) is handled as
     * those two calls handle it), but each row of logits is read from memory once: its loss and
     * logsumexp are computed, then its gradient is written while the row is still on chip (CUDA: one
     * block per row, the row staged in shared memory when it fits). dlogits MAY alias logits (in place):
     * the logits are then gone after the call. dloss is the backward's, typically loss_scale / (global
     * tokens in the step). */
    dg_status_t (*crossentropy_fused)(dg_backend_t *be, float *losses, float *lse, void *dlogits,
                                      const void *logits, const int32_t *targets, int N, int V, int Vp,
                                      float dloss);

    /* ---- the residual add inside the GEMM (optional: NULL where the backend has none) ---- */
    /* A linear layer followed by the residual add, in one call:
     *   out[N,OC] = inp[N,C] · w[OC,C]ᵀ + bias[OC] + res[N,OC]      (bias may be NULL)
     * i.e. matmul_fwd(tmp, NULL, inp, w, bias, N, C, OC, DG_EPI_NONE) then add(out, tmp, res, N * OC),
     * without the [N, OC] product going through memory (CUDA: one GEMM with beta = 1 and C = res, the
     * bias in the BIAS epilogue; GPT-2's two residual adds per block). CPU: bitwise that pair of calls.
     * CUDA: within matmul_fwd's tolerance (bf16 / f16: the sum rounds once, in f32, rather than after
     * the product and again after the add; cuBLASLt offering no algorithm, or DG_CUDA_FUSED_EPILOGUES=0:
     * the pair of calls itself).
     * In-place: out MAY alias res exactly (out == res: the residual stream updated in place); out must
     * not overlap res partially, and must not overlap inp, w or bias. res is not changed otherwise. */
    dg_status_t (*matmul_fwd_res)(dg_backend_t *be, void *out, const void *inp, const void *w,
                                  const void *bias, const void *res, int N, int C, int OC);

    /* ---- attention over a KV cache (sampling; optional: NULL where the backend has none) ---- */
    /* Attention of a block of new positions against a key/value cache (inference of one sequence; the
     * KV-cache decoder of src/model/dg_infer.h). qkv (act [n, 3C]) holds positions p0 .. p0+n-1 laid out
     * as attention_fwd's qkv for B = 1. First their k and v blocks are written into rows [p0, p0+n) of
     * kcache and vcache (act [cap, C] each, row-major, head h at columns h*C/NH); then for every new row i
     * and head h:  out[i, h] = softmax(q_i · K[0 .. p0+i]ᵀ / sqrt(C/NH)) · V[0 .. p0+i]   (causal; scores,
     * softmax and the weighted sum in f32, out rounded once to act). Rows [0, p0) of the caches must hold
     * what earlier calls wrote there. Rules: n >= 1, p0 >= 0, p0 + n <= cap, C % NH == 0; out must not
     * overlap qkv or the caches. With p0 = 0 and n = T the result equals attention_fwd's (B = 1) within
     * f32 rounding (CPU: 1e-6 relative; tests/sample). Deterministic (fixed reduction order). */
    dg_status_t (*attention_kv_fwd)(dg_backend_t *be, void *out, void *kcache, void *vcache, const void *qkv,
                                    int p0, int n, int cap, int C, int NH);
    /* Device memory this backend holds: *now, the bytes of every allocation it made (alloc, its scratch
     * and workspaces; not host_alloc), and *peak, their most since the last call with reset = 1 (which
     * restarts the window at *now). The SLA objective memory_plan compares a step's peak with the plan
     * (docs/sla.md). Either pointer may be NULL. */
    void (*mem_usage)(dg_backend_t *be, size_t *now, size_t *peak, int reset);
} dg_backend_ops_t;

struct dg_backend {
    const dg_backend_ops_t *ops;
    dg_dtype_t act_dtype;
    void *impl; /* backend-private state */
    int fp8;    /* 1: the linear layers' GEMMs run on FP8 operands (dg_backend_config_t.fp8) */
};

/* Constructors. Each returns DG_ERR_RUNTIME with a message when the backend cannot start
 * (no GPU, driver error). dg_backend_cuda_create exists only when built with CUDA (DG_HAVE_CUDA). */
dg_status_t dg_backend_cpu_create(const dg_backend_config_t *cfg, dg_backend_t **out);
#ifdef DG_HAVE_CUDA
dg_status_t dg_backend_cuda_create(const dg_backend_config_t *cfg, dg_backend_t **out);
/* The cudaStream_t (as void *) on which every call of this CUDA backend is queued; NULL when `be` is not
 * a CUDA backend. Capture it (cudaStreamBeginCapture) to record a step as one CUDA Graph: no backend op
 * synchronises or allocates during a step once one eager step has run (it sizes the backend's scratch). */
void *dg_backend_cuda_stream(dg_backend_t *be);
/* train.precision=fp8 (be->fp8): GEMMs run on FP8 operands so far (*ran) and FP8 calls cuBLASLt
 * refused, which ran in bf16 instead (*refused); -1 when `be` is not a CUDA backend. */
int dg_backend_cuda_fp8_stats(dg_backend_t *be, long long *ran, long long *refused);
/* Quantizes x[rows, cols] (the backend's act dtype, device) to E4M3 as the FP8 GEMMs do (current
 * per-tensor scaling, docs/cuda.md "FP8"): q the same layout and/or qt its transpose (device, either NULL);
 * slot: 4 device floats, 16-byte aligned, receiving the inverse scale, the scale and amax's bits. */
dg_status_t dg_backend_cuda_fp8_quantize(dg_backend_t *be, void *q, void *qt, const void *x, int rows,
                                         int cols, float *slot);
/* The CUDA context liveness probe for the health thread (cuda_probe.c, docs/health.md): create it on a
 * thread whose current device is the backend's (it remembers the device); add dg_cuda_probe_poll with it
 * as a health poll hook (dg_health_add_poll). Each poll queues a 4-byte memset + event on a private
 * non-blocking stream (device memory, never managed) once the previous one completed and only queries
 * (never waits): it fails (exit 3 through the watchdog) when a probe stays incomplete for timeout_s or
 * the context reports an error. Free it after the health monitor (no poll may run any more). */
typedef struct dg_cuda_probe dg_cuda_probe_t;
dg_status_t dg_cuda_probe_create(double timeout_s, dg_cuda_probe_t **out);
int dg_cuda_probe_poll(void *ctx, char *msg, size_t cap);
void dg_cuda_probe_free(dg_cuda_probe_t *p);
/* The device's name as cudaGetDeviceProperties gives it ("NVIDIA H200"); NULL when `be` is not a CUDA
 * backend. Owned by the backend. */
const char *dg_backend_cuda_device_name(dg_backend_t *be);
/* How many attention_fwd / attention_bwd calls of this CUDA backend ran on cuDNN's fused attention engines
 * (attn_cudnn.cu; DG_CUDA_ATTN_CUDNN) rather than its own kernels; -1 when `be` is not a CUDA backend. */
long long dg_backend_cuda_cudnn_attention_calls(dg_backend_t *be);
/* Device memory of a CUDA backend. alloc_bytes / peak_alloc_bytes count every allocation the backend
 * made (the vtable's alloc, its scratch, the cuBLASLt workspace): comparable to PyTorch's
 * torch.cuda.max_memory_allocated(). device_used_bytes = total - free from cudaMemGetInfo now (the CUDA
 * context, library handles and any other process on the GPU included). DG_ERR_USAGE when `be` is not a
 * CUDA backend. */
typedef struct dg_cuda_mem_stats {
    size_t alloc_bytes, peak_alloc_bytes;
    size_t device_used_bytes, device_total_bytes;
} dg_cuda_mem_stats_t;
dg_status_t dg_backend_cuda_mem_stats(dg_backend_t *be, dg_cuda_mem_stats_t *out);
#endif
static inline void dg_backend_free(dg_backend_t *be) {
    if (be) be->ops->destroy(be);
}

#ifdef __cplusplus
}
#endif
#endif
