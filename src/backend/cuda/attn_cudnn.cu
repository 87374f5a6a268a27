/* attn_cudnn.cu — causal attention through cuDNN's fused flash-attention engines (the Hopper wgmma kernels
 * that PyTorch's scaled_dot_product_attention also runs), as an alternative to attention.cu's kernels for
 * bf16 / f16 activations.
 *
 * cuDNN is loaded at run time (dlopen of libcudnn.so.9), so the program builds and runs where cuDNN is
 * absent or too old: every failure to load it, or to build an execution plan for a shape, is logged once
 * and that shape keeps attention.cu's kernels. Both directions of a shape are planned together, so a
 * shape is either entirely cuDNN's or entirely ours.
 *
 * The graphs are cuDNN's "composite" SDPA patterns built with the backend (C) API, the same operation
 * graphs as cudnn-frontend's sdpa / sdpa_backward nodes build for cuDNN 9.x (causal mask from two index
 * generators, a comparison and a select; softmax as max, sub, exp, sum, log, add, div):
 *   forward:  S = Q K^T * scale, masked; Stats = max + log(sum exp); O = softmax(S) V
 *   backward: Dsum = rowsum(dO * O); P = exp(S - Stats); dV = P^T dO; dS = P * (dO V^T - Dsum) * scale;
 *             dK = dS^T Q; dQ = dS K
 * Q, K, V (and dQ, dK, dV) are strided views of the [B, T, 3C] qkv buffer, O and dO of [B, T, C]; Stats is
 * the [B, NH, T] f32 aux buffer. Stats is the natural-log logsumexp of the scaled scores, the same
 * quantity attention.cu keeps there.
 *
 * Determinism: the backward computes dQ without atomics: no dQ accumulator tensor in the graph, which
 * selects cuDNN's dP-workspace decomposition (workspace B * NH * T^2 * 2 bytes: the caller's, see
 * attention_bwd_ws, or the backend's scratch), and engines with the NONDETERMINISTIC numerical note are
 * skipped. Two runs give the same bits, as everywhere else in this backend. (cuDNN's atomic dQ
 * accumulation measured no faster per call: docs/cuda.md, "Why these implementations".)
 * DG_CUDA_ATTN_CUDNN=0: never use cuDNN.
 */
#include "cuda_impl.cuh"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if __has_include(<cudnn_graph.h>)
#include <cudnn_graph.h>
#include <dlfcn.h>
#define DG_CUDNN_HEADERS 1
#endif

#ifndef DG_CUDNN_HEADERS

dg_status_t dg_cuda_cudnn_attention(dg_cuda_t *c, int bwd, void *o_or_dqkv, void *aux_or_dout,
                                    const void *qkv, const void *out, const void *aux, int B, int T, int C,
                                    int NH, int *handled) {
    (void)c, (void)bwd, (void)o_or_dqkv, (void)aux_or_dout, (void)qkv, (void)out, (void)aux;
    (void)B, (void)T, (void)C, (void)NH;
    *handled = 0;
    return DG_OK;
}
void dg_cuda_cudnn_free(dg_cuda_t *c) {
    (void)c;
}
long long dg_cuda_cudnn_calls(dg_cuda_t *c) {
    (void)c;
    return 0;
}
size_t dg_cuda_cudnn_attention_ws_bytes(dg_cuda_t *c, int B, int T, int C, int NH) {
    (void)c, (void)B, (void)T, (void)C, (void)NH;
    return 0;
}

#else

typedef cudnnBackendDescriptor_t desc_t;

static void *cudnn_realloc(void *p, size_t bytes) {
    void *q = realloc(p, bytes);
    if (!q) {
        fprintf(stderr, "dgtrain: out of host memory (%zu bytes)\n", bytes);
        abort();
    }
    return q;
}

/* ---- the library, loaded once per backend ---- */
typedef struct {
    cudnnStatus_t (*create)(cudnnHandle_t *);
    cudnnStatus_t (*destroy)(cudnnHandle_t);
    cudnnStatus_t (*set_stream)(cudnnHandle_t, cudaStream_t);
    size_t (*get_version)(void);
    const char *(*error_string)(cudnnStatus_t);
    void (*last_error)(char *, size_t);
    cudnnStatus_t (*create_desc)(cudnnBackendDescriptorType_t, desc_t *);
    cudnnStatus_t (*destroy_desc)(desc_t);
    cudnnStatus_t (*finalize)(desc_t);
    cudnnStatus_t (*set_attr)(desc_t, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t, int64_t,
                              const void *);
    cudnnStatus_t (*get_attr)(desc_t const, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t, int64_t,
                              int64_t *, void *);
    cudnnStatus_t (*execute)(cudnnHandle_t, desc_t, desc_t);
} cudnn_api_t;

/* One planned shape: both directions, or a record that cuDNN cannot serve it. */
typedef struct {
    int B, T, C, NH;
    dg_dtype_t act;
    int ok;         /* 1: both plans built; 0: use attention.cu for this shape */
    desc_t plan[2]; /* forward, backward */
    int64_t ws[2];  /* workspace bytes of each plan */
    desc_t *keep;   /* every descriptor the plans were built from (destroyed with them) */
    int n_keep, cap_keep;
    int64_t engine[2]; /* the engines' global indices (for the log) */
} cudnn_shape_t;

struct dg_cudnn {
    void *lib;
    cudnn_api_t f;
    cudnnHandle_t h;
    int broken; /* loading or the handle failed: never try again */
    size_t version;
    cudnn_shape_t *shapes;
    int n_shapes, cap_shapes;
    long long calls; /* attention calls served by cuDNN (tests) */
    float one, lowest, scale;
};

/* ---- error handling while building: the first failure is kept, later calls do nothing ---- */
typedef struct {
    dg_cudnn_t *k;
    cudnn_shape_t *s;
    char err[512];
} build_t;

static void fail(build_t *b, const char *what, cudnnStatus_t st) {
    if (b->err[0]) return;
    char last[256] = "";
    if (b->k->f.last_error) b->k->f.last_error(last, sizeof last);
    snprintf(b->err, sizeof b->err, "%s: %s%s%s", what, b->k->f.error_string(st), last[0] ? "; " : "", last);
}

static void keep(build_t *b, desc_t d) {
    cudnn_shape_t *s = b->s;
    if (s->n_keep == s->cap_keep) {
        s->cap_keep = s->cap_keep ? 2 * s->cap_keep : 64;
        s->keep = (desc_t *)cudnn_realloc(s->keep, (size_t)s->cap_keep * sizeof(desc_t));
    }
    s->keep[s->n_keep++] = d;
}

static desc_t mk(build_t *b, cudnnBackendDescriptorType_t t, const char *what) {
    if (b->err[0]) return NULL;
    desc_t d = NULL;
    cudnnStatus_t st = b->k->f.create_desc(t, &d);
    if (st != CUDNN_STATUS_SUCCESS) {
        fail(b, what, st);
        return NULL;
    }
    keep(b, d);
    return d;
}

static void set(build_t *b, desc_t d, cudnnBackendAttributeName_t a, cudnnBackendAttributeType_t t, int64_t n,
                const void *v, const char *what) {
    if (b->err[0] || !d) return;
    cudnnStatus_t st = b->k->f.set_attr(d, a, t, n, v);
    if (st != CUDNN_STATUS_SUCCESS) fail(b, what, st);
}

static void fin(build_t *b, desc_t d, const char *what) {
    if (b->err[0] || !d) return;
    cudnnStatus_t st = b->k->f.finalize(d);
    if (st != CUDNN_STATUS_SUCCESS) fail(b, what, st);
}

static void set_desc(build_t *b, desc_t d, cudnnBackendAttributeName_t a, desc_t v, const char *what) {
    set(b, d, a, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &v, what);
}

/* ---- graph pieces ---- */
enum {
    UID_Q = 1,
    UID_K,
    UID_V,
    UID_O,
    UID_STATS,
    UID_DO,
    UID_DQ,
    UID_DK,
    UID_DV,
    UID_SCALE,
    UID_ONE,
    UID_LOWEST,
    UID_VIRTUAL = 100
};

typedef struct {
    build_t *b;
    int64_t next_uid;
} gb_t;

static desc_t tensor(gb_t *g, int64_t uid, cudnnDataType_t dt, const int64_t dim[4], const int64_t str[4],
                     bool virt, bool by_value) {
    build_t *b = g->b;
    desc_t t = mk(b, CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor descriptor");
    if (uid == 0) uid = g->next_uid++;
    const int64_t align = 16;
    set(b, t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, "tensor data type");
    set(b, t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dim, "tensor dims");
    set(b, t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, str, "tensor strides");
    set(b, t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor uid");
    set(b, t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, "tensor alignment");
    set(b, t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt, "tensor virtual");
    if (by_value)
        set(b, t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, "tensor by value");
    fin(b, t, "tensor finalize");
    return t;
}

static desc_t scalar(gb_t *g, int64_t uid) {
    static const int64_t one4[4] = {1, 1, 1, 1};
    return tensor(g, uid, CUDNN_DATA_FLOAT, one4, one4, false, true);
}

/* A virtual tensor of the given dims, packed row-major strides unless `str` is given. */
static desc_t vt(gb_t *g, cudnnDataType_t dt, int64_t d0, int64_t d1, int64_t d2, int64_t d3,
                 const int64_t *str) {
    const int64_t dim[4] = {d0, d1, d2, d3};
    const int64_t packed[4] = {d1 * d2 * d3, d2 * d3, d3, 1};
    return tensor(g, 0, dt, dim, str ? str : packed, true, false);
}

static desc_t pointwise(gb_t *g, cudnnPointwiseMode_t mode, cudnnDataType_t prec, int64_t axis, desc_t x,
                        desc_t bb, desc_t t, desc_t y) {
    build_t *b = g->b;
    desc_t pd = mk(b, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise descriptor");
    set(b, pd, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
    set(b, pd, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, "pointwise precision");
    if (axis >= 0) set(b, pd, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise axis");
    fin(b, pd, "pointwise finalize");
    desc_t op = mk(b, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise operation");
    set_desc(b, op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pd, "pointwise op descriptor");
    set_desc(b, op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, "pointwise x");
    if (bb) set_desc(b, op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, bb, "pointwise b");
    if (t) set_desc(b, op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t, "pointwise t");
    set_desc(b, op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, "pointwise y");
    fin(b, op, "pointwise operation finalize");
    return op;
}

static desc_t matmul(gb_t *g, desc_t a, desc_t bm, desc_t cm) {
    build_t *b = g->b;
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    desc_t md = mk(b, CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul descriptor");
    set(b, md, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32, "matmul compute type");
    fin(b, md, "matmul finalize");
    desc_t op = mk(b, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul operation");
    set_desc(b, op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a, "matmul a");
    set_desc(b, op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, bm, "matmul b");
    set_desc(b, op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, cm, "matmul c");
    set_desc(b, op, CUDNN_ATTR_OPERATION_MATMUL_DESC, md, "matmul desc");
    fin(b, op, "matmul operation finalize");
    return op;
}

static desc_t reduction(gb_t *g, cudnnReduceTensorOp_t mode, desc_t x, desc_t y) {
    build_t *b = g->b;
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    desc_t rd = mk(b, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction descriptor");
    set(b, rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, "reduction mode");
    set(b, rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32, "reduction compute type");
    fin(b, rd, "reduction finalize");
    desc_t op = mk(b, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction operation");
    set_desc(b, op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x, "reduction x");
    set_desc(b, op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y, "reduction y");
    set_desc(b, op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd, "reduction desc");
    fin(b, op, "reduction operation finalize");
    return op;
}

static desc_t reshape(gb_t *g, desc_t x, desc_t y) {
    build_t *b = g->b;
    desc_t op = mk(b, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape operation");
    set_desc(b, op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x, "reshape x");
    set_desc(b, op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y, "reshape y");
    fin(b, op, "reshape operation finalize");
    return op;
}

/* S (virtual f32 [B, NH, T, T]) -> causal-masked S: keep column <= row, else the lowest float. */
static desc_t causal_mask(gb_t *g, desc_t s, int64_t B, int64_t NH, int64_t T, desc_t lowest, desc_t *ops,
                          int *n) {
    desc_t row = vt(g, CUDNN_DATA_INT32, B, NH, T, T, NULL), col = vt(g, CUDNN_DATA_INT32, B, NH, T, T, NULL);
    desc_t keep_m = vt(g, CUDNN_DATA_BOOLEAN, B, NH, T, T, NULL),
           y = vt(g, CUDNN_DATA_FLOAT, B, NH, T, T, NULL);
    ops[(*n)++] = pointwise(g, CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, 2, s, NULL, NULL, row);
    ops[(*n)++] = pointwise(g, CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, 3, s, NULL, NULL, col);
    ops[(*n)++] = pointwise(g, CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, -1, row, col, NULL, keep_m);
    ops[(*n)++] = pointwise(g, CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, -1, s, lowest, keep_m, y);
    return y;
}

/* The layouts of the caller's buffers as [B, NH, T, hs] views (and K^T / V^T as [B, NH, hs, T]). */
typedef struct {
    int64_t B, NH, T, hs, C;
    cudnnDataType_t io;
} shp_t;

static desc_t qkv_view(gb_t *g, const shp_t *p, int64_t uid, int transposed) {
    const int64_t rs = 3 * p->C; /* row stride of [B, T, 3C] */
    if (transposed) {
        const int64_t dim[4] = {p->B, p->NH, p->hs, p->T}, str[4] = {p->T * rs, p->hs, 1, rs};
        return tensor(g, uid, p->io, dim, str, false, false);
    }
    const int64_t dim[4] = {p->B, p->NH, p->T, p->hs}, str[4] = {p->T * rs, p->hs, rs, 1};
    return tensor(g, uid, p->io, dim, str, false, false);
}

static desc_t out_view(gb_t *g, const shp_t *p, int64_t uid) {
    const int64_t dim[4] = {p->B, p->NH, p->T, p->hs}, str[4] = {p->T * p->C, p->hs, p->C, 1};
    return tensor(g, uid, p->io, dim, str, false, false);
}

static desc_t stats_view(gb_t *g, const shp_t *p) {
    const int64_t dim[4] = {p->B, p->NH, p->T, 1}, str[4] = {p->NH * p->T, p->T, 1, 1};
    return tensor(g, UID_STATS, CUDNN_DATA_FLOAT, dim, str, false, false);
}

static int build_fwd(gb_t *g, const shp_t *p, desc_t *ops) {
    int n = 0;
    const int64_t B = p->B, NH = p->NH, T = p->T;
    desc_t q = qkv_view(g, p, UID_Q, 0), kt = qkv_view(g, p, UID_K, 1), v = qkv_view(g, p, UID_V, 0);
    desc_t o = out_view(g, p, UID_O), stats = stats_view(g, p);
    desc_t scale = scalar(g, UID_SCALE), lowest = scalar(g, UID_LOWEST);
    desc_t s = vt(g, CUDNN_DATA_FLOAT, B, NH, T, T, NULL);
    ops[n++] = matmul(g, q, kt, s);
    desc_t ss = vt(g, CUDNN_DATA_FLOAT, B, NH, T, T, NULL);
    ops[n++] = pointwise(g, CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1, s, scale, NULL, ss);
    desc_t sm = causal_mask(g, ss, B, NH, T, lowest, ops, &n);
    /* softmax with stats */
    desc_t mx = vt(g, CUDNN_DATA_FLOAT, B, NH, T, 1, NULL), sub = vt(g, CUDNN_DATA_FLOAT, B, NH, T, T, NULL);
    desc_t ex = vt(g, CUDNN_DATA_FLOAT, B, NH, T, T, NULL), sum = vt(g, CUDNN_DATA_FLOAT, B, NH, T, 1, NULL);
    desc_t lg = vt(g, CUDNN_DATA_FLOAT, B, NH, T, 1, NULL), pr = vt(g, p->io, B, NH, T, T, NULL);
    ops[n++] = reduction(g, CUDNN_REDUCE_TENSOR_MAX, sm, mx);
    ops[n++] = pointwise(g, CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, -1, sm, mx, NULL, sub);
    ops[n++] = pointwise(g, CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, -1, sub, NULL, NULL, ex);
    ops[n++] = reduction(g, CUDNN_REDUCE_TENSOR_ADD, ex, sum);
    ops[n++] = pointwise(g, CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, -1, sum, NULL, NULL, lg);
    ops[n++] = pointwise(g, CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, -1, mx, lg, NULL, stats);
    ops[n++] = pointwise(g, CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, -1, ex, sum, NULL, pr);
    ops[n++] = matmul(g, pr, v, o);
    return n;
}

static int build_bwd(gb_t *g, const shp_t *p, desc_t *ops) {
    int n = 0;
    const int64_t B = p->B, NH = p->NH, T = p->T, hs = p->hs;
    desc_t q = qkv_view(g, p, UID_Q, 0), kt = qkv_view(g, p, UID_K, 1), vtr = qkv_view(g, p, UID_V, 1);
    desc_t o = out_view(g, p, UID_O), dO = out_view(g, p, UID_DO), stats = stats_view(g, p);
    desc_t dq = qkv_view(g, p, UID_DQ, 0), dk = qkv_view(g, p, UID_DK, 0), dv = qkv_view(g, p, UID_DV, 0);
    desc_t scale = scalar(g, UID_SCALE), one = scalar(g, UID_ONE), lowest = scalar(g, UID_LOWEST);
    /* Dsum = rowsum(dO * O) (cudnn-frontend gives the product these strides; it is never stored) */
    const int64_t pstr[4] = {NH * T * hs, T * hs, NH * hs, 1};
    desc_t pdo = vt(g, CUDNN_DATA_FLOAT, B, NH, T, hs, pstr);
    desc_t dsum0 = vt(g, CUDNN_DATA_FLOAT, B, NH, T, 1, NULL),
           dsum = vt(g, CUDNN_DATA_FLOAT, B, NH, T, 1, NULL);
    ops[n++] = pointwise(g, CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1, dO, o, NULL, pdo);
    ops[n++] = reduction(g, CUDNN_REDUCE_TENSOR_ADD, pdo, dsum0);
    ops[n++] = pointwise(g, CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1, dsum0, one, NULL, dsum);
    /* P = exp(mask(Q K^T * scale) - Stats) */
    desc_t s = vt(g, CUDNN_DATA_FLOAT, B, NH, T, T, NULL), ss = vt(g, CUDNN_DATA_FLOAT, B, NH, T, T, NULL);
    ops[n++] = matmul(g, q, kt, s);
    ops[n++] = pointwise(g, CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1, s, scale, NULL, ss);
    desc_t sm = causal_mask(g, ss, B, NH, T, lowest, ops, &n);
    desc_t sub = vt(g, CUDNN_DATA_FLOAT, B, NH, T, T, NULL), pe = vt(g, CUDNN_DATA_FLOAT, B, NH, T, T, NULL);
    ops[n++] = pointwise(g, CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, -1, sm, stats, NULL, sub);
    ops[n++] = pointwise(g, CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, -1, sub, NULL, NULL, pe);
    /* dV = P^T dO */
    const int64_t tstr[4] = {NH * T * T, T * T, 1, T};
    desc_t pt = vt(g, p->io, B, NH, T, T, tstr);
    ops[n++] = reshape(g, pe, pt);
    ops[n++] = matmul(g, pt, dO, dv);
    /* dS = P * (dO V^T - Dsum) * scale */
    desc_t dp = vt(g, CUDNN_DATA_FLOAT, B, NH, T, T, NULL), d1 = vt(g, CUDNN_DATA_FLOAT, B, NH, T, T, NULL);
    desc_t d2 = vt(g, CUDNN_DATA_FLOAT, B, NH, T, T, NULL), ds = vt(g, CUDNN_DATA_FLOAT, B, NH, T, T, NULL);
    ops[n++] = matmul(g, dO, vtr, dp);
    ops[n++] = pointwise(g, CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, -1, dp, dsum, NULL, d1);
    ops[n++] = pointwise(g, CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1, d1, pe, NULL, d2);
    ops[n++] = pointwise(g, CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, -1, d2, scale, NULL, ds);
    /* dK = dS^T Q */
    desc_t dst = vt(g, p->io, B, NH, T, T, tstr);
    ops[n++] = reshape(g, ds, dst);
    ops[n++] = matmul(g, dst, q, dk);
    /* dQ = dS K (K as [B, NH, T, hs] again, a reshape of K^T) */
    const int64_t rs = 3 * p->C, kstr[4] = {T * rs, hs, rs, 1};
    desc_t k = vt(g, p->io, B, NH, T, hs, kstr);
    ops[n++] = reshape(g, kt, k);
    ops[n++] = matmul(g, ds, k, dq); /* straight into dQ: no accumulator, no atomics */
    return n;
}

/* Heuristics for an operation graph, then the first engine configuration that finalizes into a plan and
 * carries no NONDETERMINISTIC note. */
static desc_t plan_graph(build_t *b, desc_t *ops, int nops, int64_t *ws, int64_t *engine_id) {
    dg_cudnn_t *k = b->k;
    desc_t graph = mk(b, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    set(b, graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, nops, ops, "graph ops");
    set(b, graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &k->h, "graph handle");
    fin(b, graph, "operation graph finalize (cuDNN has no engine for this pattern)");
    desc_t heur = mk(b, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics");
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    set_desc(b, heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph, "heuristics graph");
    set(b, heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
    fin(b, heur, "heuristics finalize");
    if (b->err[0]) return NULL;
    int64_t count = 0;
    cudnnStatus_t st =
        k->f.get_attr(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, NULL);
    if (st != CUDNN_STATUS_SUCCESS || count <= 0) {
        if (st != CUDNN_STATUS_SUCCESS)
            fail(b, "heuristics results", st);
        else
            snprintf(b->err, sizeof b->err, "heuristics offer no engine configuration");
        return NULL;
    }
    if (count > 16) count = 16;
    desc_t cfg[16];
    for (int64_t i = 0; i < count; i++)
        cfg[i] = mk(b, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config");
    if (b->err[0]) return NULL;
    int64_t got = 0;
    st = k->f.get_attr(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, cfg);
    if (st != CUDNN_STATUS_SUCCESS) {
        fail(b, "heuristics results", st);
        return NULL;
    }
    char why[256] = "";
    for (int64_t i = 0; i < got; i++) {
        desc_t eng = mk(b, CUDNN_BACKEND_ENGINE_DESCRIPTOR, "engine");
        if (b->err[0]) return NULL;
        int64_t ne = 0, nn = 0, gid = -1;
        cudnnBackendNumericalNote_t notes[32];
        if (k->f.get_attr(cfg[i], CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &ne, &eng) ==
            CUDNN_STATUS_SUCCESS) {
            k->f.get_attr(eng, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &ne, &gid);
            if (k->f.get_attr(eng, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE, 32, &nn,
                              notes) != CUDNN_STATUS_SUCCESS)
                nn = 0;
        }
        int nondet = 0;
        for (int64_t j = 0; j < nn; j++)
            nondet |= notes[j] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
        if (nondet) {
            snprintf(why, sizeof why, "engine %lld is not deterministic", (long long)gid);
            continue;
        }
        desc_t plan = NULL;
        if (k->f.create_desc(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan) != CUDNN_STATUS_SUCCESS)
            continue;
        int ok = k->f.set_attr(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &k->h) ==
                     CUDNN_STATUS_SUCCESS &&
                 k->f.set_attr(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                               1, &cfg[i]) == CUDNN_STATUS_SUCCESS;
        cudnnStatus_t fs = ok ? k->f.finalize(plan) : CUDNN_STATUS_BAD_PARAM;
        if (fs != CUDNN_STATUS_SUCCESS) {
            char last[160] = "";
            if (k->f.last_error) k->f.last_error(last, sizeof last);
            snprintf(why, sizeof why, "engine %lld: %s %s", (long long)gid, k->f.error_string(fs), last);
            k->f.destroy_desc(plan);
            continue;
        }
        int64_t n1 = 0;
        *ws = 0;
        k->f.get_attr(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n1, ws);
        *engine_id = gid;
        keep(b, plan);
        return plan;
    }
    snprintf(b->err, sizeof b->err, "no engine configuration of %lld finalized (last: %s)", (long long)got,
             why);
    return NULL;
}

/* ---- loading ---- */
static int load(dg_cuda_t *c) {
    dg_cudnn_t *k = c->cudnn;
    if (k) return !k->broken;
    k = c->cudnn = (dg_cudnn_t *)dg_xcalloc(1, sizeof *k);
    k->one = 1.0f;
    k->lowest = -3.402823466e38f; /* the lowest finite float, as cudnn-frontend masks */
    const char *names[] = {"libcudnn.so.9", "libcudnn.so"};
    for (int i = 0; i < 2 && !k->lib; i++)
        k->lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!k->lib) {
        DG_LOG_INFO("cuda backend: cuDNN not loadable (%s): attention uses the built-in kernels", dlerror());
        k->broken = 1;
        return 0;
    }
#define SYM(field, name)                                                                                     \
    do {                                                                                                     \
        *(void **)&k->f.field = dlsym(k->lib, name);                                                         \
        if (!k->f.field && strcmp(name, "cudnnGetLastErrorString") != 0) {                                   \
            DG_LOG_INFO("cuda backend: cuDNN lacks %s: attention uses the built-in kernels", name);          \
            k->broken = 1;                                                                                   \
            return 0;                                                                                        \
        }                                                                                                    \
    } while (0)
    SYM(create, "cudnnCreate");
    SYM(destroy, "cudnnDestroy");
    SYM(set_stream, "cudnnSetStream");
    SYM(get_version, "cudnnGetVersion");
    SYM(error_string, "cudnnGetErrorString");
    SYM(last_error, "cudnnGetLastErrorString");
    SYM(create_desc, "cudnnBackendCreateDescriptor");
    SYM(destroy_desc, "cudnnBackendDestroyDescriptor");
    SYM(finalize, "cudnnBackendFinalize");
    SYM(set_attr, "cudnnBackendSetAttribute");
    SYM(get_attr, "cudnnBackendGetAttribute");
    SYM(execute, "cudnnBackendExecute");
#undef SYM
    k->version = k->f.get_version();
    if (k->version < 90000) {
        DG_LOG_INFO("cuda backend: cuDNN %zu is older than 9.0: attention uses the built-in kernels",
                    k->version);
        k->broken = 1;
        return 0;
    }
    cudnnStatus_t st = k->f.create(&k->h);
    if (st == CUDNN_STATUS_SUCCESS) st = k->f.set_stream(k->h, c->stream);
    if (st != CUDNN_STATUS_SUCCESS) {
        DG_LOG_INFO("cuda backend: cuDNN %zu: no handle (%s): attention uses the built-in kernels",
                    k->version, k->f.error_string(st));
        k->broken = 1;
        return 0;
    }
    return 1;
}

static void shape_free(dg_cudnn_t *k, cudnn_shape_t *s) {
    for (int i = s->n_keep - 1; i >= 0; i--)
        k->f.destroy_desc(s->keep[i]);
    free(s->keep);
    s->keep = NULL;
    s->n_keep = s->cap_keep = 0;
    s->plan[0] = s->plan[1] = NULL;
}

void dg_cuda_cudnn_free(dg_cuda_t *c) {
    dg_cudnn_t *k = c->cudnn;
    if (!k) return;
    for (int i = 0; i < k->n_shapes; i++)
        shape_free(k, &k->shapes[i]);
    free(k->shapes);
    if (k->h) k->f.destroy(k->h);
    if (k->lib) dlclose(k->lib);
    free(k);
    c->cudnn = NULL;
}

long long dg_cuda_cudnn_calls(dg_cuda_t *c) {
    return c->cudnn ? c->cudnn->calls : 0;
}

static cudnn_shape_t *shape_get(dg_cuda_t *c, int B, int T, int C, int NH) {
    dg_cudnn_t *k = c->cudnn;
    for (int i = 0; i < k->n_shapes; i++) {
        cudnn_shape_t *s = &k->shapes[i];
        if (s->B == B && s->T == T && s->C == C && s->NH == NH && s->act == c->act) return s;
    }
    int capturing = 0;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(c->stream, &cs) == cudaSuccess) capturing = cs != cudaStreamCaptureStatusNone;
    if (k->n_shapes == k->cap_shapes) {
        k->cap_shapes = k->cap_shapes ? 2 * k->cap_shapes : 8;
        k->shapes = (cudnn_shape_t *)cudnn_realloc(k->shapes, (size_t)k->cap_shapes * sizeof(cudnn_shape_t));
    }
    cudnn_shape_t *s = &k->shapes[k->n_shapes++];
    memset(s, 0, sizeof *s);
    s->B = B, s->T = T, s->C = C, s->NH = NH, s->act = c->act;
    if (capturing) { /* plans are built outside a recording (the eager first step); keep ours here */
        DG_LOG_DEBUG("cuda backend: attention B=%d T=%d C=%d NH=%d first seen while recording a graph: "
                     "built-in kernels",
                     B, T, C, NH);
        return s;
    }
    shp_t p = {B, NH, T, C / NH, C, c->act == DG_BF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF};
    build_t b = {k, s, ""};
    for (int dir = 0; dir < 2 && !b.err[0]; dir++) {
        gb_t g = {&b, UID_VIRTUAL};
        desc_t ops[48];
        const int nops = dir == 0 ? build_fwd(&g, &p, ops) : build_bwd(&g, &p, ops);
        if (b.err[0]) break;
        s->plan[dir] = plan_graph(&b, ops, nops, &s->ws[dir], &s->engine[dir]);
    }
    if (b.err[0]) {
        DG_LOG_INFO(
            "cuda backend: cuDNN %zu cannot run attention B=%d T=%d C=%d NH=%d (%s): built-in kernels "
            "for this shape",
            k->version, B, T, C, NH, b.err);
        shape_free(k, s);
        return s;
    }
    s->ok = 1;
    DG_LOG_INFO(
        "cuda backend: attention B=%d T=%d C=%d NH=%d through cuDNN %zu (deterministic; engines %lld / "
        "%lld, workspace %.1f / %.1f MiB)",
        B, T, C, NH, k->version, (long long)s->engine[0], (long long)s->engine[1], s->ws[0] / 1048576.0,
        s->ws[1] / 1048576.0);
    return s;
}

static int shape_eligible(const dg_cuda_t *c, int C, int NH) {
    return c->attn_cudnn != 0 && c->fast_attention && c->act != DG_F32 && C % NH == 0 && (C / NH) % 8 == 0 &&
           C / NH <= 128 && ((size_t)C * 2) % 16 == 0;
}

size_t dg_cuda_cudnn_attention_ws_bytes(dg_cuda_t *c, int B, int T, int C, int NH) {
    if (!shape_eligible(c, C, NH) || !load(c)) return 0;
    cudnn_shape_t *s = shape_get(c, B, T, C, NH);
    return s->ok ? (size_t)s->ws[1] : 0;
}

dg_status_t dg_cuda_cudnn_attention(dg_cuda_t *c, int bwd, void *o_or_dqkv, void *aux_or_dout,
                                    const void *qkv, const void *out, const void *aux, int B, int T, int C,
                                    int NH, int *handled) {
    *handled = 0;
    if (!shape_eligible(c, C, NH)) return DG_OK;
    const size_t es = 2;
    if (!dg_ptr_aligned(qkv, 16) || !dg_ptr_aligned(o_or_dqkv, 16) || !dg_ptr_aligned(aux_or_dout, 16) ||
        (out && !dg_ptr_aligned(out, 16)))
        return DG_OK;
    if (!load(c)) return DG_OK;
    cudnn_shape_t *s = shape_get(c, B, T, C, NH);
    if (!s->ok) return DG_OK;
    dg_cudnn_t *k = c->cudnn;
    k->scale = 1.f / sqrtf((float)(C / NH));
    /* the plan's workspace: the caller's (attention_bwd_ws) when it is large enough, else the backend's
     * scratch */
    const size_t need = (size_t)s->ws[bwd];
    void *ws = NULL;
    if (need > 0 && bwd && c->attn_ws && c->attn_ws_bytes >= need && dg_ptr_aligned(c->attn_ws, 256))
        ws = c->attn_ws;
    else if (need > 0)
        DG_TRY(dg_cuda_scratch(c, need, &ws));
    const char *q = (const char *)qkv;
    int64_t uids[16];
    void *ptrs[16];
    int n = 0;
#define BIND(u, p) (uids[n] = (u), ptrs[n] = (void *)(p), n++)
    BIND(UID_Q, q);
    BIND(UID_K, q + (size_t)C * es);
    BIND(UID_SCALE, &k->scale);
    BIND(UID_LOWEST, &k->lowest);
    if (!bwd) {
        BIND(UID_V, q + 2 * (size_t)C * es);
        BIND(UID_O, o_or_dqkv);
        BIND(UID_STATS, aux_or_dout);
    } else {
        char *d = (char *)o_or_dqkv;
        BIND(UID_V, q + 2 * (size_t)C * es);
        BIND(UID_O, out);
        BIND(UID_DO, aux_or_dout);
        BIND(UID_STATS, aux);
        BIND(UID_DQ, d);
        BIND(UID_DK, d + (size_t)C * es);
        BIND(UID_DV, d + 2 * (size_t)C * es);
        BIND(UID_ONE, &k->one);
    }
#undef BIND
    desc_t vp = NULL;
    cudnnStatus_t st = k->f.create_desc(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp);
    if (st == CUDNN_STATUS_SUCCESS)
        st = k->f.set_attr(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids);
    if (st == CUDNN_STATUS_SUCCESS)
        st = k->f.set_attr(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs);
    if (st == CUDNN_STATUS_SUCCESS)
        st = k->f.set_attr(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
    if (st == CUDNN_STATUS_SUCCESS) st = k->f.finalize(vp);
    if (st == CUDNN_STATUS_SUCCESS) st = k->f.execute(k->h, s->plan[bwd], vp);
    if (vp) k->f.destroy_desc(vp);
    if (st != CUDNN_STATUS_SUCCESS) {
        char last[256] = "";
        if (k->f.last_error) k->f.last_error(last, sizeof last);
        return DG_ERR(DG_ERR_RUNTIME, "cuda backend: cuDNN attention %s (B=%d T=%d C=%d NH=%d) failed: %s %s",
                      bwd ? "backward" : "forward", B, T, C, NH, k->f.error_string(st), last);
    }
    k->calls++;
    *handled = 1;
    return DG_OK;
}

#endif
