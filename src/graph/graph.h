/* graph.h — the static-graph IR, the public header of src/graph/: nodes and graphs, the op registry,
 * passes, autodiff, the memory planner and the executor. Model-agnostic: the model layer (src/model/,
 * dg_model.h) builds its graphs with it; nothing here knows a config, a training loop or a model family.
 *
 * A tensor is a node: dtype, shape, the op that produces it and its inputs, flags. A graph keeps its
 * nodes in topological (= schedule) order; an op may also produce "side" outputs (layernorm statistics,
 * attention scratch), which are nodes of kind DG_OP_SIDE placed right after their producer, and may
 * update persistent tensors in place (parameter gradients, optimizer state), listed in `upd`.
 * Nodes carry a stream (compute or comm) and explicit wait edges so that later passes (docs/fsdp.md:
 * sharding, bucketing, hoisting, overlap) can move collectives to a communication stream; a collective
 * is just an op kind with a mesh-dimension attribute. Parameters carry their GLOBAL shape and where
 * their local piece sits in it.
 *
 * Storage classes: PERSISTENT nodes (parameters, gradients, optimizer state, inputs, device scalars) get
 * their memory from whoever owns the graph; ARENA nodes are placed by the memory planner; a node with
 * view_src shares its root's storage (in-place ops, gradient accumulation). The planner's output is a
 * dg_memplan_t tied to the graph's generation: any later mutation makes it stale, and the executor refuses
 * (asserts on) a stale plan.
 */
#ifndef DG_GRAPH_H
#define DG_GRAPH_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "dg_common.h"
#include "dg_mesh.h"
#include "backend.h"

#define DG_MAX_DIMS 4
#define DG_MAX_SRC 6
#define DG_MAX_UPD 4
#define DG_MAX_SIDE 2
#define DG_MAX_WAIT 4
#define DG_MAX_ATTR 8
#define DG_ARENA_ALIGN 256

typedef enum dg_op_kind {
    /* structural kinds: not ops, never executed */
    DG_OP_LEAF = 0, /* parameter, input, gradient, optimizer state, device scalar */
    DG_OP_SIDE,     /* extra output of src[0]; attr[0] = which */
    /* forward ops */
    DG_OP_ENCODER,
    DG_OP_LAYERNORM,
    DG_OP_MATMUL,
    DG_OP_GELU,
    DG_OP_ATTENTION,
    DG_OP_ADD,
    DG_OP_CROSSENTROPY,
    DG_OP_MATMUL_RES, /* a matmul (no epilogue) and the residual add of its output, in one backend call
                         (matmul_fwd_res): src {x, w, res[, bias]}, output x·wᵀ + bias + res shaped like res
                         (pass fuse_residual, before autodiff: its backward passes the gradient to res and
                         emits the matmul's MATMUL_BWD) */
    /* backward ops (emitted by autodiff) */
    DG_OP_ENCODER_BWD,
    DG_OP_LAYERNORM_BWD,
    DG_OP_MATMUL_BWD,
    DG_OP_GELU_BWD,
    DG_OP_MATMUL_BWD_DGELU, /* matmul_bwd whose input is gelu(pre), with gelu_bwd fused into the input
                               gradient: src {dout, inp, w, pre[, acc target]}, upd {dw[, db]}, output dpre
                               (pass fuse_gelu_bwd) */
    DG_OP_ATTENTION_BWD,
    DG_OP_CROSSENTROPY_BWD,
    DG_OP_CROSSENTROPY_FUSED, /* CROSSENTROPY and its CROSSENTROPY_BWD in one backend call
                                 (crossentropy_fused) at the loss's place in the forward: src {logits,
                                 targets}, output dlogits (over the logits: inplace), side outputs losses and
                                 lse (pass fuse_crossentropy). A forward-only run (rt.forward_only) computes
                                 the losses alone and leaves the logits as they are */
    DG_OP_ACCUMULATE,
    /* optimizer and utility ops */
    DG_OP_ZERO,
    DG_OP_SUMSQ,
    DG_OP_SUMSQ_ALL, /* the sum of squares of every gradient SUMSQ would read, in one backend call
                        (sumsq_multi) over the flat gradient buffer: src {grad, segment table}, upd
                        {scalars} (pass fuse_sumsq) */
    DG_OP_CLIP_SCALE,
    DG_OP_ADAMW,
    DG_OP_ADAMW_ALL, /* AdamW of every parameter in one backend call (adamw_multi_dev) over the flat buffers:
                        src {grad, scalars, segment table}, upd {master, m, v, param} (pass fuse_adamw) */
    /* collectives: run through the comm backend attached to the executor (dg_exec_attach_comm); over a
     * mesh dimension of size 1 they are local copies. On DG_STREAM_COMM they are posted non-blocking
     * and complete at the first node that waits on them (a wait edge); on the compute stream they block. */
    DG_OP_ALL_GATHER,
    DG_OP_REDUCE_SCATTER,
    DG_OP_ALL_REDUCE,
    /* sharding support (passes of shard.c): a zero-filled arena tensor (unsharded gradient buffers),
     * the copy-in of unsharded gradients into a bucket's rank-major send buffer, the copy-out of one
     * parameter from a bucket's gathered buffer, and an explicit wait point for comm-stream ops */
    DG_OP_FILL0,
    DG_OP_SHARD_PACK,
    DG_OP_SHARD_UNPACK,
    DG_OP_WAIT,
    /* dtype conversion (train.reduce_dtype = bf16: the gradient reductions in bf16). attr[DG_A_DTYPE] is
     * the target dtype (f32 / bf16 / f16). Without upd the output is a new tensor; with upd[0] (same
     * element count, target dtype) the result is written there, or with acc = 1 added to it (f32 only:
     * the converted values land in the op's own output, an f32 temporary, then add_f32 into upd[0]) */
    DG_OP_CAST,
    DG_OP_COUNT
} dg_op_kind_t;

/* node flags */
enum {
    DG_NF_PARAM = 1u << 0,      /* trainable parameter (compute copy; PERSISTENT) */
    DG_NF_INPUT = 1u << 1,      /* fed from the host before a run (PERSISTENT) */
    DG_NF_OUTPUT = 1u << 2,     /* must survive to the end of the schedule (read back by the host) */
    DG_NF_LOSS = 1u << 3,       /* per-token losses whose sum is the objective */
    DG_NF_GRAD = 1u << 4,       /* parameter gradient (f32, PERSISTENT) */
    DG_NF_OPTSTATE = 1u << 5,   /* AdamW moment (f32, PERSISTENT) */
    DG_NF_MASTER = 1u << 6,     /* f32 master copy of a parameter (PERSISTENT) */
    DG_NF_SCALAR = 1u << 7,     /* device scalar (f32, PERSISTENT) */
    DG_NF_WANT_GRAD = 1u << 8,  /* an input whose gradient the caller wants (kept as an OUTPUT) */
    DG_NF_BUCKET = 1u << 9,     /* a bucket's flat local shard (PERSISTENT view over the flat buffers) */
    DG_NF_NORM_SKIP = 1u << 10, /* param: its gradient is a replica counted by another rank in the global
                                   norm (tp-replicated tensors on tp ranks > 0): no SUMSQ here */
    DG_NF_GRAD_SYNC = 1u << 11, /* op: part of the data-parallel gradient sync (the backward's dp_replicate
                                   all-reduces and their waits); skipped while dg_runtime_t.skip_grad_sync */
    DG_NF_FLAT = 1u << 12       /* a whole flat state buffer (master, grad, m, v or compute copy of every
                                   parameter at its offset), or the segment table of a fused op (ADAMW_ALL,
                                   SUMSQ_ALL): PERSISTENT, bound by the owner (passes fuse_adamw and
                                   fuse_sumsq) */
};

typedef enum { DG_STORE_NONE = 0, DG_STORE_ARENA = 1, DG_STORE_PERSISTENT = 2 } dg_storage_t;
typedef enum {
    DG_PHASE_FWD = 0,
    DG_PHASE_BWD = 1,
    DG_PHASE_ZERO = 2,
    DG_PHASE_OPT = 3,
    DG_PHASE_COUNT
} dg_phase_t;
enum { DG_STREAM_COMPUTE = 0, DG_STREAM_COMM = 1 };

/* attribute slots (attr[]) per op kind */
enum {
    DG_A_ACC = 0,      /* *_BWD, ACCUMULATE: 1 = add into the acc target (last src) */
    DG_A_NH = 1,       /* ATTENTION(_BWD): heads */
    DG_A_V = 1,        /* CROSSENTROPY(_BWD, _FUSED): real vocabulary (columns >= V are padding) */
    DG_A_DECAY = 1,    /* ADAMW: 1 = apply weight decay */
    DG_A_NSEG = 1,     /* ADAMW_ALL: segments (= the graph's opt_segs); SUMSQ_ALL: (= its norm_segs) */
    DG_A_MESHDIM = 1,  /* collectives: DG_MESH_* dimension */
    DG_A_NO_DINP = 2,  /* MATMUL_BWD: no input gradient wanted */
    DG_A_EPI = 1,      /* MATMUL: dg_epilogue_t; with DG_EPI_GELU the output is gelu(x.w^T + b) and side 0
                          holds the pre-activation */
    DG_A_SIDE_IDX = 0, /* SIDE: which output of the producer */
    DG_A_ARMODE = 2,   /* ALL_REDUCE: dg_armode_t (how the backward treats it) */
    DG_A_COUNT = 3,    /* ALL_REDUCE over a persistent tensor in place: elements (0 = all) */
    /* SHARD_PACK / SHARD_UNPACK: the bucket geometry (see shard.c) */
    DG_A_K = 1,     /* ranks in the group */
    DG_A_S = 2,     /* elements of one rank's block of the bucket */
    DG_A_OFF = 3,   /* element offset of this parameter inside a rank's block */
    DG_A_RS = 4,    /* rows of this parameter per rank (the padded shard) */
    DG_A_ROWS = 5,  /* SHARD_UNPACK: rows of the unsharded parameter */
    DG_A_COLS = 6,  /* SHARD_UNPACK: columns (0 = a 1-D parameter) */
    DG_A_NDIM0 = 1, /* FILL0: ndim, then the dims in the next slots */
    DG_A_DTYPE = 1, /* CAST: the target dg_dtype_t */
};

/* ALL_REDUCE flavours. SUM: y = sum over ranks of x, adjoint the same (a Partial result of partial
 * inputs). TO_REPLICATE ("g" of Megatron): forward sum of partial sums into a tensor every rank then
 * uses redundantly; its gradient is replicated already, so the backward is the identity. FROM_REPLICATE
 * ("f"): forward identity (the output aliases the input) where a replicated tensor enters rank-local
 * (column-parallel) compute; the backward sums the ranks' partial gradients. */
typedef enum { DG_AR_SUM = 0, DG_AR_TO_REPLICATE = 1, DG_AR_FROM_REPLICATE = 2 } dg_armode_t;

typedef struct dg_node dg_node_t;
struct dg_node {
    int id; /* position in graph->nodes (the schedule) */
    char name[96];
    dg_op_kind_t op;
    dg_phase_t phase;
    unsigned flags;
    dg_storage_t storage;
    int stream;

    dg_dtype_t dtype;
    int ndim;
    int64_t shape[DG_MAX_DIMS];  /* local shape */
    int64_t stride[DG_MAX_DIMS]; /* elements; row-major contiguous today */
    size_t nbytes;

    /* Placement of a parameter-like tensor in its global tensor: global shape, the sharded dim (-1 =
     * replicated, local == global) and the local piece's offset along that dim. */
    int64_t gshape[DG_MAX_DIMS];
    int shard_dim;
    int64_t shard_off;

    int n_src;
    dg_node_t *src[DG_MAX_SRC];
    int n_upd;
    dg_node_t *upd[DG_MAX_UPD]; /* persistent tensors updated in place */
    int n_side;
    dg_node_t *side[DG_MAX_SIDE];
    int n_wait;
    dg_node_t *wait[DG_MAX_WAIT]; /* nodes on another stream that must finish first */
    int64_t attr[DG_MAX_ATTR];

    dg_node_t *view_src; /* shares the storage of this node (byte offset view_offs) */
    size_t view_offs;

    void *data; /* PERSISTENT: device pointer, bound by the owner */

    /* autodiff bookkeeping */
    int needs_grad;
    dg_node_t *grad;   /* gradient of this node: for params the persistent f32 gradient */
    dg_node_t *master; /* params: the f32 master (== this node's storage when act dtype is f32) */
    int param_index;   /* params and their state: index in the owner's table, else -1 */
};

/* One parameter of the fused AdamW (DG_OP_ADAMW_ALL) or of the fused norm (DG_OP_SUMSQ_ALL): where its
 * tensors sit in the flat buffers. */
typedef struct dg_opt_seg {
    int param_index; /* rt.frozen[param_index] skips it */
    int decay;       /* 1 = weight decay (AdamW; 0 in norm segments) */
    size_t off;      /* first element in the flat buffers (a multiple of 4 for AdamW) */
    size_t count;    /* elements (the local tensor) */
} dg_opt_seg_t;

typedef struct dg_graph {
    dg_node_t **nodes;
    int n, cap;
    uint64_t generation; /* bumped by every mutation; plans are tied to it */
    dg_dtype_t act_dtype;
    dg_backend_t *be;
    dg_mesh_shape_t mesh;   /* sizes of the mesh dimensions collectives run over */
    dg_status_t err;        /* sticky builder error (first one wins) */
    dg_phase_t cur_phase;   /* phase given to newly created ops */
    dg_opt_seg_t *opt_segs; /* the ADAMW_ALL node's parameters, sorted by offset (pass fuse_adamw) */
    int n_opt_segs;
    /* the SUMSQ_ALL node's gradients, in the order of the SUMSQ ops it replaced (= the order of the
     * additions into the norm accumulator; pass fuse_sumsq) */
    dg_opt_seg_t *norm_segs;
    int n_norm_segs;
} dg_graph_t;

/* Re-raises the current error with a prefix: "<prefix>: <previous message>" (copies the previous
 * message first: it lives in the buffer DG_ERR writes). */
dg_status_t dg_err_prefix(dg_status_t st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---------------- graph building ---------------- */
/* `be` answers backend-specific sizes (attention scratch) and gives the activation dtype; it is not
 * used for memory. */
dg_graph_t *dg_graph_create(dg_backend_t *be);
void dg_graph_free(dg_graph_t *g);
/* The builder error: DG_OK, or the status of the first failing op constructor (message in
 * dg_last_error()). Op constructors return NULL once the graph is in error. */
dg_status_t dg_graph_error(const dg_graph_t *g);
void dg_graph_touch(dg_graph_t *g); /* bump the generation after a direct field edit */

/* A PERSISTENT leaf (param, input, state, scalar): flags as above. */
dg_node_t *dg_graph_leaf(dg_graph_t *g, const char *name, dg_dtype_t dtype, int ndim, const int64_t *shape,
                         unsigned flags);
/* Trainable parameter leaf in the act dtype, with its f32 master (aliased when act is f32) and f32 grad. */
dg_node_t *dg_graph_param(dg_graph_t *g, const char *name, int ndim, const int64_t *shape);

/* Op constructors: check shapes (DG_ERR_USAGE naming the op and the mismatch), infer the output and
 * side outputs, append in the current phase. NULL on error (sticky). */
dg_node_t *dg_op_encoder(dg_graph_t *g, const char *name, dg_node_t *tokens, dg_node_t *wte, dg_node_t *wpe);
dg_node_t *dg_op_layernorm(dg_graph_t *g, const char *name, dg_node_t *x, dg_node_t *w, dg_node_t *b);
dg_node_t *dg_op_matmul(dg_graph_t *g, const char *name, dg_node_t *x, dg_node_t *w, dg_node_t *bias);
dg_node_t *dg_op_gelu(dg_graph_t *g, const char *name, dg_node_t *x);
dg_node_t *dg_op_attention(dg_graph_t *g, const char *name, dg_node_t *qkv, int n_head);
dg_node_t *dg_op_add(dg_graph_t *g, const char *name, dg_node_t *a, dg_node_t *b);
/* x·wᵀ + bias + res in one op (bias may be NULL); what fuse_residual makes of a matmul and an add. */
dg_node_t *dg_op_matmul_res(dg_graph_t *g, const char *name, dg_node_t *x, dg_node_t *w, dg_node_t *bias,
                            dg_node_t *res);
dg_node_t *dg_op_crossentropy(dg_graph_t *g, const char *name, dg_node_t *logits, dg_node_t *targets, int V);
dg_node_t *dg_op_all_gather(dg_graph_t *g, const char *name, dg_node_t *x, int mesh_dim);
dg_node_t *dg_op_reduce_scatter(dg_graph_t *g, const char *name, dg_node_t *x, int mesh_dim);
dg_node_t *dg_op_all_reduce(dg_graph_t *g, const char *name, dg_node_t *x, int mesh_dim);
/* An all_reduce of a given flavour (dg_armode_t; dg_op_all_reduce is DG_AR_SUM). */
dg_node_t *dg_op_all_reduce_mode(dg_graph_t *g, const char *name, dg_node_t *x, int mesh_dim,
                                 dg_armode_t mode);

/* Generic constructor used by the above, autodiff and passes: fills a node of `kind` with the given
 * sources, persistent tensors it updates in place, and attributes; runs the op's shape rule; appends
 * it (and its side outputs) in the current phase. */
dg_node_t *dg_graph_add_op(dg_graph_t *g, dg_op_kind_t kind, const char *name, int n_src,
                           dg_node_t *const *src, int n_upd, dg_node_t *const *upd, const int64_t *attr,
                           int n_attr);

size_t dg_node_numel(const dg_node_t *n);
int64_t dg_node_rows(const dg_node_t *n); /* product of all dims but the last */
int64_t dg_node_cols(const dg_node_t *n); /* last dim */
dg_node_t *dg_node_root(dg_node_t *n);    /* follows view_src to the storage owner */
const dg_node_t *dg_node_root_c(const dg_node_t *n);
void dg_node_shape_str(const dg_node_t *n, char *buf, size_t cap);

/* Checks the structural invariants: topological order, ids, side outputs after producers, wait edges
 * to earlier nodes on another stream, phases contiguous, shapes consistent with the op's rule.
 * DG_ERR_RUNTIME with a message naming the first bad node (a pass bug). */
dg_status_t dg_graph_verify(const dg_graph_t *g);

/* [first, end) of the nodes in `phase` (empty range = first == end). */
void dg_graph_phase_range(const dg_graph_t *g, dg_phase_t phase, int *first, int *end);
const char *dg_phase_name(dg_phase_t p);

/* ---------------- op registry ---------------- */
typedef struct dg_exec dg_exec_t;
typedef struct dg_ad dg_ad_t;

typedef enum {
    DG_GRAD_BUILDER = 0, /* differentiable: `backward` emits the backward ops */
    DG_GRAD_NONE = 1,    /* a backward/optimizer op: never differentiated (autodiff asserts) */
    DG_GRAD_STRUCTURAL = 2
} dg_grad_kind_t;

#define DG_OP_MAX_KERNELS 2
typedef struct dg_op_def {
    dg_op_kind_t kind;
    const char *name;
    int min_src, max_src;
    /* Validates the sources/attributes and sets dtype/shape (and creates side outputs via
     * dg_node_add_side). DG_ERR_USAGE with a message on a mismatch. */
    dg_status_t (*shape)(dg_graph_t *g, dg_node_t *n);
    dg_grad_kind_t grad_kind;
    /* Emits the backward of n (reads n->grad, contributes to its inputs' grads). */
    dg_status_t (*backward)(dg_ad_t *ad, dg_node_t *n);
    /* Runs n through the backend. NULL only for structural kinds. */
    dg_status_t (*exec)(dg_exec_t *ex, const dg_node_t *n);
    unsigned inplace_mask; /* bit k: the output may share src[k]'s storage (the kernel allows it) */
    int is_collective;
    /* The backend entries exec calls, by offset into dg_backend_ops_t (name NULL ends the list): the
     * kernel requirements that dg_op_missing_kernel checks, for the host fallback and for the fusion
     * passes' eligibility (a fused kind is scheduled only when none of its kernels is missing). */
    struct {
        size_t offset;
        const char *name;
    } kernels[DG_OP_MAX_KERNELS];
} dg_op_def_t;

const dg_op_def_t *dg_op_def(dg_op_kind_t kind);
const char *dg_op_name(dg_op_kind_t kind);
/* For shape rules: add a side output of op n. */
dg_node_t *dg_node_add_side(dg_graph_t *g, dg_node_t *n, const char *suffix, dg_dtype_t dtype, int ndim,
                            const int64_t *shape);

/* ---------------- passes ---------------- */
typedef dg_status_t (*dg_pass_fn_t)(dg_graph_t *g, void *ctx);
typedef struct dg_pass {
    const char *name;
    dg_pass_fn_t fn;
    void *ctx;
} dg_pass_t;
/* Runs the passes in order; verifies the graph after each and bumps the generation. */
dg_status_t dg_graph_run_passes(dg_graph_t *g, const dg_pass_t *passes, int n);

/* Editing helpers for passes (each renumbers ids and bumps the generation). */
/* Moves node n (with its side outputs) to schedule position pos (counted without n). */
void dg_graph_move(dg_graph_t *g, dg_node_t *n, int pos);
/* Redirects every input and wait edge that refers to `from` to `to`. */
void dg_graph_replace_uses(dg_graph_t *g, dg_node_t *from, dg_node_t *to);
/* Removes node n (and its side outputs) and frees it; asserts that nothing refers to it any more. */
void dg_graph_remove(dg_graph_t *g, dg_node_t *n);
/* Number of nodes that read n (as an input). */
int dg_graph_n_consumers(const dg_graph_t *g, const dg_node_t *n);

/* Fusion pass (run before autodiff): a forward matmul whose only consumer is a gelu becomes one matmul
 * with the GELU epilogue (the kernel applies it while the tile is in cache); its side output keeps the
 * pre-activation for the backward. */
dg_status_t dg_pass_fuse_gelu(dg_graph_t *g, void *ctx);

/* Residual fusion pass (before autodiff, after fuse_gelu): a forward ADD one of whose operands is a MATMUL
 * without epilogue becomes ONE MATMUL_RES (backend matmul_fwd_res: the residual read inside the GEMM, no
 * [N, OC] product in memory, no add kernel), at the add's place and under its name, with its flags; the
 * other operand is the residual. Autodiff then differentiates the fused op: the residual receives the
 * output's gradient as the add gave it (shared, no kernel) and the matmul's MATMUL_BWD is the one the
 * matmul would have had (it needs x and w only), so the backward is the unfused one op for op. Only where
 * that is safe: the matmul's output (an arena tensor, not a view, not an output) is read by the add alone,
 * anywhere in the graph, and aliased by nothing; the residual is another tensor than the product and
 * shares no storage with the matmul's inputs (the output may later be laid over the residual in place);
 * both ops run on the same stream. A matmul whose output goes through anything else first (tensor
 * parallelism's all-reduce of the row-parallel partial sums) is left alone. Nothing happens when the
 * graph's backend has no matmul_fwd_res. ctx (may be NULL): a dg_fuse_res_t. */
typedef struct dg_fuse_res {
    int n_fused; /* out: pairs fused */
} dg_fuse_res_t;
dg_status_t dg_pass_fuse_residual(dg_graph_t *g, void *ctx);

/* Fusion pass (after autodiff): a MATMUL_BWD whose input gradient feeds only a GELU_BWD of the GELU that
 * produced the matmul's input (the MLP: mlp.proj's backward, then mlp.fc's GELU epilogue backward)
 * becomes one MATMUL_BWD_DGELU (backend matmul_bwd_dgelu: the derivative applied inside the input-gradient
 * GEMM). The intermediate [N, 4C] gradient and the gelu_bwd node disappear; the inplace pass may then let
 * dpre take over the GELU output's storage, which dies there. */
dg_status_t dg_pass_fuse_gelu_bwd(dg_graph_t *g, void *ctx);

/* Recompute pass (after autodiff and fuse_gelu_bwd, before the sharding passes): the GELU output of every
 * matmul with the GELU epilogue is no longer kept from forward to backward; a GELU op (phase BWD) right
 * before its first backward reader recomputes it from the saved pre-activation into a temporary, which
 * every backward reader then uses. Saves a [N, 4C] activation per layer for one elementwise kernel per
 * layer; the numbers do not change where gelu_fwd and the forward epilogue compute GELU identically (the
 * CPU backend and CUDA f32: bitwise). */
dg_status_t dg_pass_recompute_gelu(dg_graph_t *g, void *ctx);

/* Activation recompute pass (after autodiff and the backward fusions, before the sharding passes; ctx: a
 * dg_recompute_pass_t). segment(n) names the forward ops the caller wants recomputed, grouped in segments
 * (>= 0; -1 = keep n from the forward to the backward). A selected op is re-emitted (phase BWD, same op,
 * attributes and stream, name "<name>.recompute") only where it is needed: when a backward op reads it or
 * one of its side outputs, or a needed op of its segment reads it. The copies of one segment go, in
 * forward order, right before the first backward op that reads one of them; they read each other's
 * copies within the segment and the originals otherwise (saved tensors, parameters); every backward op
 * after them reads the copies. The originals then die at their last forward reader, so the memory plan
 * made afterwards holds the recomputed tensors only in the backward of their segment. Never selected,
 * whatever segment() says: ops outside the forward, collectives (but the identity forward of an
 * all_reduce FROM_REPLICATE, a view), ops that update a persistent tensor or wait on another stream,
 * OUTPUT and LOSS nodes, and an op whose storage a node of another segment shares (a view). The numbers do
 * not change where an op computes the same result from the same inputs (CPU backend: bitwise). */
typedef struct dg_recompute {
    int (*segment)(const dg_node_t *n, void *user);
    void *user;
    int n_cloned; /* out: ops re-emitted */
} dg_recompute_pass_t;
dg_status_t dg_pass_recompute(dg_graph_t *g, void *ctx);

/* Autodiff (reverse mode): appends, in phase BWD, the backward of every node that leads to one of
 * `outs` (which are flagged OUTPUT, so they stay readable after the backward). seeds[i] is the gradient of
 * outs[i] (a node of the same shape), or NULL when outs[i] is a per-token loss (DG_NF_LOSS, from
 * CROSSENTROPY) whose seed is the runtime scalar dloss. Parameters receive their gradient in their persistent
 * f32 grad (accumulated, +=); inputs flagged DG_NF_WANT_GRAD get an arena gradient flagged OUTPUT (read it
 * with dg_node_grad_of). A tensor with several consumers gets the sum of their contributions (accumulated in
 * place when that is safe, else through an extra add). */
dg_status_t dg_autodiff(dg_graph_t *g, int n_out, dg_node_t *const *outs, dg_node_t *const *seeds);
dg_node_t *dg_node_grad_of(const dg_node_t *x);

/* Helpers for the backward builders of the op registry (ops.c). */
dg_graph_t *dg_ad_graph(dg_ad_t *ad);
/* 1 if x should receive a gradient (needs one and is not a parameter: parameters get theirs through
 * the persistent grad listed in the backward op's `upd`). */
int dg_ad_wants(const dg_ad_t *ad, const dg_node_t *x);
/* 1 if n is a loss output whose seed is the runtime dloss. */
int dg_ad_is_loss_seed(const dg_ad_t *ad, const dg_node_t *n);
/* The gradient version of x a kernel may accumulate into in place (acc = 1), or NULL when the kernel
 * must write a fresh buffer (no gradient yet, or its storage is still needed by another tensor). */
dg_node_t *dg_ad_acc_target(dg_ad_t *ad, dg_node_t *x);
/* Records g as x's gradient: `in_place` = g accumulated into the target from dg_ad_acc_target; else
 * g is fresh and is summed with any gradient x already has. */
void dg_ad_contribute(dg_ad_t *ad, dg_node_t *x, dg_node_t *g, int in_place);
/* Records an existing tensor g (also another tensor's gradient) as a contribution to x, without a
 * kernel when x has no gradient yet (e.g. both inputs of an add). */
void dg_ad_contribute_shared(dg_ad_t *ad, dg_node_t *x, dg_node_t *g);
/* The persistent f32 gradient that a backward kernel accumulates into for weight w; sets a builder
 * error and returns NULL if w is not a parameter. */
dg_node_t *dg_ad_param_grad(dg_ad_t *ad, dg_node_t *w, const char *op_name);

/* Optimizer pass: appends ZERO ops for every param grad (phase ZERO) and, in phase OPT, zero the
 * norm accumulator, SUMSQ of every grad, CLIP_SCALE, and one ADAMW per parameter (the creation order of
 * params). decay_of(param, ctx) says whether a param gets weight decay. The scalars node
 * (f32 [DG_SCALAR_COUNT]: the DG_DS_* slots) is created and returned through *scalars_out. */
dg_status_t dg_graph_add_optimizer(dg_graph_t *g, int (*decay_of)(const dg_node_t *param, void *ctx),
                                   void *ctx, dg_node_t **scalars_out);
/* Fused AdamW pass (after the optimizer pass): the per-parameter ADAMW ops become ONE ADAMW_ALL op over
 * leaves that span the whole flat buffers (flagged DG_NF_FLAT, for the owner to bind), where every
 * parameter's master, gradient, m, v and compute copy sit at the same element offset (ctx->off, by
 * param_index). The parameters' offsets, sizes and weight decay go to g->opt_segs; the executor turns them
 * into the backend's segment table at every step (frozen parameters skipped) and uploads it into the
 * table leaf just before the op. The covered gradients' per-parameter ZEROs (phase ZERO) become one ZERO
 * of the flat gradient leaf, which also clears the padding between segments (the owner must keep nothing
 * else there). A graph without ADAMW ops is left alone. DG_ERR_USAGE when the offsets
 * break the table rules (overlap, beyond span, not a multiple of 4). */
typedef struct dg_fuse_adamw {
    const size_t *off; /* per param_index: element offset of its tensors in the flat buffers */
    int n;             /* entries of off */
    size_t span;       /* elements of each flat buffer */
    /* out: leaves to bind (param == master when the act dtype is f32; all NULL when nothing was fused) */
    dg_node_t *master, *grad, *m, *v, *param, *segs;
    /* out of dg_pass_fuse_sumsq: the fused norm's segment table leaf (NULL when nothing was fused) */
    dg_node_t *norm_segs;
} dg_fuse_adamw_t;
dg_status_t dg_pass_fuse_adamw(dg_graph_t *g, void *ctx);
/* Fused gradient-norm pass, run right after fuse_adamw with the same context (whose flat gradient leaf
 * ctx->grad it reads): the per-parameter SUMSQ ops become ONE SUMSQ_ALL op over ctx->grad, in the place of
 * the SUMSQ ops (which must be consecutive: nothing may run between two of them), with a segment table
 * leaf (flagged DG_NF_FLAT, for the owner to bind; i32 [nseg, 4] = dg_sumsq_seg_t). g->norm_segs keeps
 * each gradient's parameter, offset (ctx->off) and size in the order of the SUMSQ ops, which is the order
 * of the float additions into the accumulator, so the sum is bitwise the one of the SUMSQ ops; parameters
 * without a SUMSQ (DG_NF_NORM_SKIP replicas) stay out. The executor stages the table (frozen gradients
 * skipped) and uploads it into the leaf before the op, like ADAMW_ALL's. Nothing happens when fuse_adamw
 * fused nothing (no flat gradient leaf) or there is no SUMSQ. DG_ERR_USAGE when a SUMSQ reads a gradient
 * outside the flat buffer or of another size than its parameter's segment. */
dg_status_t dg_pass_fuse_sumsq(dg_graph_t *g, void *ctx);

/* Fused classifier-loss pass (after autodiff): each forward CROSSENTROPY whose losses are a loss output
 * (DG_NF_LOSS: its gradient seed is the runtime dloss) and its CROSSENTROPY_BWD become ONE
 * CROSSENTROPY_FUSED at the forward op's place (backend crossentropy_fused: the logits are read once).
 * Its output is the logits' gradient (which the inplace pass then lays over the logits) and the lm_head
 * backward reads it; its side outputs are the losses (the forward op's flags: OUTPUT, LOSS) and the lse.
 * Only where that is safe: the logits (an arena tensor, no view, not an output) are read by the two ops
 * and nothing else and aliased by nothing, the lse by the backward only, the backward's gradient is not
 * a view, and nothing between the two ops writes the targets. The executor then uses ex->rt.dloss in the
 * FORWARD phase: the owner sets it before the forward of a step whose backward follows, and runs a
 * forward alone with rt.forward_only = 1 (the op then computes the losses only and leaves the logits).
 * Nothing happens when the graph's backend has no crossentropy_fused. ctx (may be NULL): a
 * dg_fuse_ce_t. */
typedef struct dg_fuse_ce {
    dg_node_t *loss; /* in/out: a CROSSENTROPY node the owner keeps; replaced by the losses side output of
                        its fused op when it is fused */
    int n_fused;     /* out: pairs fused */
} dg_fuse_ce_t;
dg_status_t dg_pass_fuse_crossentropy(dg_graph_t *g, void *ctx);

/* The graph's scalars node is the backend's device scalar block (backend.h DG_DS_*, same indices): OPT
 * zeroes it, SUMSQ accumulates, CLIP_SCALE writes the factor and norm and uploads the step's lr and bias
 * corrections (from ex->sc_host), ADAMW reads them. */
enum {
    DG_SCALAR_SUMSQ = DG_DS_SUMSQ,
    DG_SCALAR_GSCALE = DG_DS_GSCALE,
    DG_SCALAR_NORM = DG_DS_NORM,
    DG_SCALAR_COUNT = DG_DS_COUNT
};

/* ---------------- sharding passes (shard.c) ---------------- */
/* What the FSDP pass needs to know about each parameter (filled by the model builder). */
typedef struct dg_shard_param {
    dg_node_t *p;       /* the parameter leaf (act dtype), built with its unsharded (tp-local) shape */
    int group;          /* buckets never mix groups (0 embeddings, 1 + l layer l, L + 1 final norm) */
    int64_t rows, cols; /* unsharded (tp-local) shape; cols = 1 and ndim 1 for vectors */
    int64_t Rs;         /* rows per dp_shard rank: ceil(rows / k) */
    int64_t row0;       /* this rank's first row (= dp_shard coord * Rs) */
    size_t off;         /* element offset of its local shard in the flat parameter buffers */
} dg_shard_param_t;

/* A bucket: consecutive parameters of one group whose local shards are contiguous in the flat buffers
 * ([off of first, off of first + S)); one all-gather and one reduce-scatter move all of them. */
typedef struct dg_bucket {
    int first, last;  /* parameter indices, inclusive */
    int64_t S;        /* elements of one rank's block (alignment gaps included) */
    dg_node_t *pleaf; /* PERSISTENT [S] act dtype over the parameters' local shards */
    dg_node_t *gleaf; /* PERSISTENT [S] f32 over their gradient shards */
} dg_bucket_t;

typedef struct dg_shard_plan {
    int n;
    dg_shard_param_t *params;
    int k; /* dp_shard size (1: buckets only, for the dp_replicate all-reduce) */
    size_t bucket_bytes, prefetch_bytes;
    int overlap, reshard;
    dg_dtype_t reduce_dtype; /* DG_F32, or DG_BF16: the reduce-scatters move bf16 (cast before, cast and
                                accumulate into the f32 shard after the wait) */
    /* out */
    int n_buckets;
    dg_bucket_t *buckets;
} dg_shard_plan_t;

/* FSDP pass (after autodiff, before the optimizer pass): groups the parameters into buckets and, when
 * k > 1, shards them on dim 0: all-gather + unpack before the first forward use (and again before the
 * first backward use when resharding), unsharded gradient buffers (FILL0) that the backward kernels
 * accumulate into, pack + reduce-scatter into the persistent gradient shards after a bucket's last
 * gradient contribution, waits, prefetch, and the parameter leaves reshaped to their local shards. */
dg_status_t dg_pass_fsdp(dg_graph_t *g, void *ctx);
/* The dp_replicate gradient sum of a shard plan's buckets in the backward (sync.c): per bucket an in-place
 * all-reduce on the comm stream right after the bucket's gradients are final, cast to bf16 and back when
 * sp->reduce_dtype is bf16, its wait at the end of the backward (right after it without sp->overlap); all
 * flagged DG_NF_GRAD_SYNC. Run after the fsdp pass, on a mesh with dp_replicate > 1. */
dg_status_t dg_pass_replicate_sync(dg_graph_t *g, const dg_shard_plan_t *sp);
void dg_shard_plan_free(dg_shard_plan_t *sp);

/* Reshapes a leaf (a sharding pass turning a parameter into its local shard); keeps gshape. */
void dg_node_reshape(dg_node_t *n, int ndim, const int64_t *shape);

/* In-place pass: lets an op's output share the storage of a source whose last use it is, where the
 * kernel allows it (inplace_mask). Saves arena space (e.g. dlogits over logits). */
dg_status_t dg_pass_inplace(dg_graph_t *g, void *ctx);

/* ---------------- memory planner ---------------- */
/* Core of the planner, on abstract buffers: buffer i of size[i] bytes is live over schedule positions
 * [start[i], end[i]] inclusive. Assigns offsets (multiples of align) so that no two buffers whose
 * intervals intersect overlap in memory; greedy by size (largest first, lowest fitting offset,
 * ties by index). Returns the arena size (<= sum of aligned sizes). */
size_t dg_plan_intervals(int n, const size_t *size, const int *start, const int *end, size_t align,
                         size_t *offset_out);

typedef struct dg_memplan {
    const dg_graph_t *graph;
    uint64_t generation;
    int n_nodes;
    size_t arena_bytes;
    size_t act_bytes_sum;
    size_t live_peak_bytes; /* the most bytes (each root aligned) live at one schedule position: the
                               lower bound of any arena; 1 - live_peak/arena is the arena's fragmentation */
    /* per node id: arena offset of its root (SIZE_MAX if not in the arena), and its root's live range */
    size_t *offset;
    int *live_start, *live_end;
} dg_memplan_t;

/* Phase 1 (reserve): liveness over the schedule, offsets for every arena root. flags:
 * DG_PLAN_NO_REUSE gives every tensor its own memory (the reference the planner is tested against). */
enum { DG_PLAN_NO_REUSE = 1 };
dg_status_t dg_plan_create(const dg_graph_t *g, int flags, dg_memplan_t **out);
void dg_plan_free(dg_memplan_t *p);
/* 1 if p was made from g as it is now. */
int dg_plan_matches(const dg_memplan_t *p, const dg_graph_t *g);
/* Independent check of a plan: every pair of arena roots with intersecting live ranges is disjoint in
 * memory, every range fits the arena, every reader sits inside its tensor's live range. DG_ERR_RUNTIME
 * with the first violation. */
dg_status_t dg_plan_check(const dg_memplan_t *p, const dg_graph_t *g);

/* ---------------- executor ---------------- */
/* Values that change between runs without changing the graph. */
typedef struct dg_runtime {
    float dloss; /* seed of every DG_NF_LOSS output: read by CROSSENTROPY_BWD in the backward, and by
                    CROSSENTROPY_FUSED in the forward */
    float lr, beta1, beta2, eps, weight_decay, grad_clip, grad_extra;
    int64_t t;
    /* per param_index, 1 = frozen: its SUMSQ and ADAMW are skipped (NULL = none frozen) */
    const unsigned char *frozen;
    int n_frozen_slots;
    /* 1: ops flagged DG_NF_GRAD_SYNC are skipped (a micro-batch of a gradient accumulation that is not
     * the step's last: its gradients are summed over dp_replicate once, after the last one) */
    int skip_grad_sync;
    /* 1: no backward follows this forward in the step (evaluation, logits): CROSSENTROPY_FUSED computes the
     * losses only (crossentropy_fwd) and leaves the logits intact; with 0 it writes the gradient with
     * dloss over them */
    int forward_only;
} dg_runtime_t;

struct dg_comm;
struct dg_comm_req;

struct dg_exec {
    dg_backend_t *be;
    const dg_graph_t *graph;
    const dg_memplan_t *plan;
    void *arena; /* phase 2 (run): the arena allocated with the plan's size */
    dg_runtime_t rt;
    uint64_t ops_run;
    uint64_t kernels_run; /* ops run that called a backend compute entry (not collectives, waits) */
    /* optional per-op-kind timing (syncs the backend around every op while on) */
    int profile;
    double prof_s[DG_OP_COUNT];
    uint64_t prof_n[DG_OP_COUNT];
    /* optional per-op trace (dg_exec_set_trace): compute ops synchronised and timed one by one; comm-stream
     * collectives from their post (post_t, per node id) to the return of their wait */
    void (*trace)(void *ctx, const struct dg_node *n, int comm, double t0, double t1);
    void *trace_ctx;
    double *post_t;

    /* collectives: one comm per mesh dimension of size > 1 (dg_exec_attach_comm), the request of every
     * comm-stream op in flight (by node id), and time accounting */
    struct dg_comm *comm[DG_MESH_NDIM];
    struct dg_comm_req **req;
    int n_pending;
    int staged;               /* device memory with the mpi comm: collectives copy through host buffers */
    int dev_waits;            /* nccl comm: posts after begin_after(cstream), completion by stream waits */
    void *cstream;            /* the backend's stream (cudaStream_t) for those event edges; NULL on cpu */
    char **stage;             /* per node id: its host staging buffer */
    double wait_s;            /* blocked waiting for comm-stream collectives: the exposed communication */
    double blocking_s;        /* in compute-stream (blocking) collectives */
    uint64_t n_coll;          /* collectives run over a comm */
    float *sc_host;           /* page-locked mirror of the device scalar block's step slots (DG_DS_LR..) */
    dg_adamw_seg_t *seg_host; /* page-locked: the ADAMW_ALL segment table of this step (graph->n_opt_segs) */
    dg_sumsq_seg_t *norm_seg_host; /* page-locked: the SUMSQ_ALL segment table (graph->n_norm_segs) */
    char why[256];                 /* dg_exec_capture_blocker's answer */

    /* send bytes of the collectives run over a comm, per mesh dimension, and of those the data-parallel
     * gradient reductions' (dg_model_comm_stats) */
    uint64_t coll_bytes[DG_MESH_NDIM];
    uint64_t grad_coll_bytes;
    /* gradient-sync latency (wall clock as the host sees it): the time during which at least one
     * gradient reduction was in flight, from its post to the return of its wait (dg_model_comm_stats) */
    double gs_total, gs_start, gs_end; /* closed intervals' sum; the open interval (gs_start > 0) */
    int gs_pending;                    /* gradient reductions posted and not yet waited for */

    /* memory fallback (eager allocation): no arena; every arena root gets its own allocation from the
     * backend over its live range. roots[] lists the arena roots; per schedule position, the roots whose
     * live range starts there (by_start[start_at[i] .. start_at[i + 1])) and ends there (by_end, end_at) */
    int eager;
    void **root_ptr; /* per node id: the root's allocation, NULL while not allocated */
    int *roots, n_roots;
    int *by_start, *start_at, *by_end, *end_at;
    size_t eager_bytes, eager_peak; /* bytes allocated now and at most (dg_exec_eager_stats) */
    int eager_live;                 /* allocations outstanding */

    /* host fallback: op kinds run on a CPU backend instance through host copies of their tensors */
    unsigned char host_op[DG_OP_COUNT];
    dg_backend_t *host_be;
    void **ovr; /* per node id: the host copy dg_exec_ptr returns while a node runs on the host */
    int ovr_on;

    /* fallbacks decided when the executor was made, for the owner to report (dg_model_set_fallback_cb) */
    int n_fb;
    struct dg_exec_fallback {
        char kind[16]; /* "memory" | "kernel" */
        char reason[512];
    } fb[DG_OP_COUNT + 1];
};

/* Allocates the arena for `plan` (phase 2). Persistent nodes must be bound (data != NULL) before runs.
 *
 * Fallbacks (recorded in ex->fb, logged as warnings; both give the same numbers as the planned path):
 *  - memory: when the arena cannot be allocated (or the test hook DG_TEST_ARENA_FAIL=1 is set), every
 *    arena root is allocated on its own at the start of its live range and freed after its end (eager
 *    allocation); the peak is the live set. Per-tensor alloc/free on every run: slow on CUDA
 *    (cudaMalloc/cudaFree synchronise the device), and not recordable as a CUDA Graph.
 *  - kernel: an op kind whose backend entry is NULL (dg_op_missing_kernel), or named in the test hook
 *    DG_TEST_NO_KERNEL=<op>[,<op>...], runs on a host CPU backend: its tensors are copied to the host,
 *    the op runs there, its outputs and updated tensors are copied back. Needs f32 activations. */
dg_status_t dg_exec_create(dg_backend_t *be, const dg_graph_t *g, const dg_memplan_t *plan, dg_exec_t **out);
/* dg_exec_create with flags: DG_EXEC_EAGER allocates every arena root on its own over its live range
 * from the start (the eager allocation of the memory fallback, without a fallback report: the
 * conservative plan of the model's circuit breaker, which reports it itself). */
enum { DG_EXEC_EAGER = 1 };
dg_status_t dg_exec_create_ex(dg_backend_t *be, const dg_graph_t *g, const dg_memplan_t *plan, int flags,
                              dg_exec_t **out);
void dg_exec_free(dg_exec_t *ex);
/* Trace every op of the following runs (NULL fn: off): fn(ctx, node, comm, t0, t1) with wall-clock
 * seconds (dg_now_s). Compute ops (comm = 0) are followed by a backend sync, so [t0, t1] is the op's
 * device time plus a launch; collectives (comm = 1) span their post to the return of their wait (blocking
 * ones: the call). Like per-op profiling it syncs after every op, so traced steps are slower and cannot be
 * replayed as a CUDA Graph (dg_exec_capture_blocker says so). */
void dg_exec_set_trace(dg_exec_t *ex,
                       void (*fn)(void *ctx, const struct dg_node *n, int comm, double t0, double t1),
                       void *ctx);
/* Runs nodes [first, end) of the schedule in order. Asserts that the plan still matches the graph. */
dg_status_t dg_exec_run(dg_exec_t *ex, int first, int end);
dg_status_t dg_exec_run_phase(dg_exec_t *ex, dg_phase_t phase);
/* dg_exec_run with hook(ctx) called once right after node `at` (first <= at < end) has been queued (or
 * skipped, for a skipped node), before the rest: one run, so comm requests in flight across `at` stay in
 * flight and a graph recording of [first, end) holds whatever the hook queues at that position. The
 * hook may read node `at`'s output and anything else live there; it must queue only capturable work.
 * Its error ends the run (prefixed with the node). at < 0: no hook (dg_exec_run). */
typedef dg_status_t (*dg_exec_hook_t)(void *ctx);
dg_status_t dg_exec_run_hook(dg_exec_t *ex, int first, int end, int at, dg_exec_hook_t hook, void *ctx);
/* Device address of a node's storage (arena or persistent). */
void *dg_exec_ptr(const dg_exec_t *ex, const dg_node_t *n);
/* Attaches the comm for mesh dimension `dim` (its size must equal graph->mesh.size[dim]; DG_ERR_USAGE
 * otherwise). The mpi comm works on host memory: with a device backend (anything but cpu) collectives
 * are staged through host copies. The nccl comm (CUDA backend only) works on device memory with
 * device-side waits: event edges between the backend's stream and the comm's, no host blocking. All
 * dimensions of one executor must take the same path (DG_ERR_USAGE otherwise). */
dg_status_t dg_exec_attach_comm(dg_exec_t *ex, int dim, struct dg_comm *c);
/* Runs collective node n: over a size-1 dimension a copy; on DG_STREAM_COMM posted non-blocking (its
 * request completes at the first node that waits on it, or at the end of dg_exec_run); else blocking. */
dg_status_t dg_exec_collective(dg_exec_t *ex, const dg_node_t *n);
/* Completes every request still in flight (in schedule order). */
dg_status_t dg_exec_drain(dg_exec_t *ex);
/* Writes the step's lr and AdamW bias corrections (from ex->rt: lr, beta1, beta2, t) into the host
 * mirror ex->sc_host, which CLIP_SCALE uploads into the device scalar block, and the segment tables with
 * the frozen set of ex->rt (dg_exec_stage_segs). DG_ERR_USAGE for t < 1 or betas outside [0, 1). */
dg_status_t dg_exec_stage_scalars(dg_exec_t *ex);
/* Writes the fused ops' segment tables with the frozen set of ex->rt into their page-locked mirrors:
 * ex->seg_host (ADAMW_ALL) and ex->norm_seg_host (SUMSQ_ALL), which those ops upload before their call. */
void dg_exec_stage_segs(dg_exec_t *ex);
/* Why nodes [first, end) cannot be recorded as a graph and replayed (the backend cannot record,
 * profiling is on, a collective needs the host), or NULL when they can. The answer lives in ex. */
const char *dg_exec_capture_blocker(dg_exec_t *ex, int first, int end);
/* Eager allocation (memory fallback) accounting: bytes allocated now, their peak, and allocations
 * outstanding; all 0 with the arena. */
void dg_exec_eager_stats(const dg_exec_t *ex, size_t *bytes, size_t *peak, int *live);
/* The name of the backend entry op kind `op` needs and `be` lacks (NULL: none missing, or an op that
 * needs no kernel of its own: structural kinds, waits, collectives, which go through the comm layer). */
const char *dg_op_missing_kernel(const dg_backend_t *be, dg_op_kind_t op);

/* Allocates device memory for every PERSISTENT root that has none yet (tests and small graphs); the
 * allocations are recorded in *list (free with dg_graph_free_persistent). */
typedef struct dg_alloc_list {
    void **ptrs;
    int n, cap;
} dg_alloc_list_t;
dg_status_t dg_graph_alloc_persistent(dg_graph_t *g, dg_backend_t *be, dg_alloc_list_t *list);
void dg_graph_free_persistent(dg_backend_t *be, dg_alloc_list_t *list);

/* ---------------- printing ---------------- */
/* The schedule: one line per node (or a JSON array when json = 1) with phase, stream, op, name, shape,
 * dtype, bytes, placement (arena offset / persistent / alias) and inputs. plan may be NULL. */
void dg_graph_print(const dg_graph_t *g, const dg_memplan_t *plan, FILE *out, int json);

#endif /* DG_GRAPH_H */
