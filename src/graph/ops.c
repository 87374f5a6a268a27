/* ops.c — the op registry: for every op kind, ONE entry with its shape rule, its backward builder and
 * its executor dispatch into the backend vtable (docs/design.md §4: "each op is registered once"). The tests
 * in tests/graph/ walk this table and fail if a registered op is not exercised.
 *
 * Conventions shared by the entries:
 *  - activations are [..., C] in the graph's act dtype; kernels see N = product of the leading dims;
 *  - a backward op with attr[DG_A_ACC] = 1 takes the gradient version it accumulates into as its last
 *    input and its output aliases it (view_src), so the write-after-read order stays explicit;
 *  - parameter gradients, optimizer state and device scalars are persistent tensors in `upd`.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include "graph.h"

static dg_status_t shape_err(const dg_node_t *n, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static dg_status_t shape_err(const dg_node_t *n, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return DG_ERR(DG_ERR_USAGE, "graph: op %s '%s': %s", dg_op_name(n->op), n->name, msg);
}

#define CHECK(cond, ...)                                                                                     \
    do {                                                                                                     \
        if (!(cond)) return shape_err(n, __VA_ARGS__);                                                       \
    } while (0)

static void set_out(dg_node_t *n, dg_dtype_t dtype, int ndim, const int64_t *shape) {
    n->dtype = dtype;
    n->ndim = ndim;
    for (int d = 0; d < ndim; d++)
        n->shape[d] = shape[d];
}

static void set_like(dg_node_t *n, const dg_node_t *x) {
    set_out(n, x->dtype, x->ndim, x->shape);
}

static int same_shape(const dg_node_t *a, const dg_node_t *b) {
    if (a->ndim != b->ndim) return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return 0;
    return 1;
}

static int is_vec(const dg_node_t *x, int64_t len) {
    return x->ndim == 1 && x->shape[0] == len;
}

static int is_mat(const dg_node_t *x, int64_t r, int64_t c) {
    return x->ndim == 2 && x->shape[0] == r && x->shape[1] == c;
}

/* ACC handling: with attr ACC the op has one extra input (the gradient version it adds into), shaped
 * like the output, whose storage the output takes over. */
static dg_status_t acc_rule(dg_node_t *n, int base_src) {
    if (n->attr[DG_A_ACC]) {
        CHECK(n->n_src == base_src + 1, "acc=1 needs the accumulation target as input %d", base_src);
        const dg_node_t *t = n->src[base_src];
        CHECK(same_shape(t, n) && t->dtype == n->dtype, "accumulation target '%s' has another shape/dtype",
              t->name);
        n->view_src = n->src[base_src];
    } else {
        CHECK(n->n_src == base_src, "takes %d inputs without acc, got %d", base_src, n->n_src);
    }
    return DG_OK;
}

/* ================= shape rules ================= */

static dg_status_t shape_encoder(dg_graph_t *g, dg_node_t *n) {
    const dg_node_t *tok = n->src[0], *wte = n->src[1], *wpe = n->src[2];
    CHECK(tok->dtype == DG_I32 && tok->ndim == 2, "tokens must be int32 [B, T]");
    CHECK(wte->ndim == 2 && wpe->ndim == 2 && wte->shape[1] == wpe->shape[1],
          "wte [Vp, C] and wpe [T, C] must share C");
    CHECK(wte->dtype == g->act_dtype && wpe->dtype == g->act_dtype, "embeddings must be in the act dtype");
    CHECK(tok->shape[1] <= wpe->shape[0],
          "sequence length %" PRId64 " exceeds the %" PRId64 " positions of '%s'", tok->shape[1],
          wpe->shape[0], wpe->name);
    int64_t s[3] = {tok->shape[0], tok->shape[1], wte->shape[1]};
    set_out(n, g->act_dtype, 3, s);
    return DG_OK;
}

static dg_status_t shape_layernorm(dg_graph_t *g, dg_node_t *n) {
    const dg_node_t *x = n->src[0], *w = n->src[1], *b = n->src[2];
    CHECK(x->dtype == g->act_dtype && x->ndim >= 1, "input must be an activation [..., C]");
    int64_t C = dg_node_cols(x), N = dg_node_rows(x);
    CHECK(is_vec(w, C) && is_vec(b, C) && w->dtype == g->act_dtype && b->dtype == g->act_dtype,
          "weight and bias must be [%" PRId64 "] in the act dtype", C);
    set_like(n, x);
    dg_node_add_side(g, n, "mean", DG_F32, 1, &N);
    dg_node_add_side(g, n, "rstd", DG_F32, 1, &N);
    return DG_OK;
}

/* x [..., C] against the weight w [OC, C], and the bias src[bias_at] [OC] when the op has it: the matmul
 * family's operands (their act dtype checked by the caller) */
static dg_status_t check_matmul_operands(const dg_graph_t *g, const dg_node_t *n, int bias_at) {
    const dg_node_t *x = n->src[0], *w = n->src[1];
    CHECK(w->ndim == 2 && x->ndim >= 1 && dg_node_cols(x) == w->shape[1],
          "input [..., %" PRId64 "] does not match weight [OC, C] = [%" PRId64 ", %" PRId64 "]",
          dg_node_cols(x), w->ndim == 2 ? w->shape[0] : -1, w->ndim == 2 ? w->shape[1] : -1);
    if (n->n_src > bias_at)
        CHECK(is_vec(n->src[bias_at], w->shape[0]) && n->src[bias_at]->dtype == g->act_dtype,
              "bias must be [%" PRId64 "]", w->shape[0]);
    return DG_OK;
}

static dg_status_t shape_matmul(dg_graph_t *g, dg_node_t *n) {
    const dg_node_t *x = n->src[0], *w = n->src[1];
    CHECK(x->dtype == g->act_dtype && w->dtype == g->act_dtype, "inputs must be in the act dtype");
    DG_TRY(check_matmul_operands(g, n, 2));
    CHECK(n->attr[DG_A_EPI] == DG_EPI_NONE || n->attr[DG_A_EPI] == DG_EPI_GELU, "unknown epilogue %" PRId64,
          n->attr[DG_A_EPI]);
    set_like(n, x);
    n->shape[n->ndim - 1] = w->shape[0];
    if (n->attr[DG_A_EPI] == DG_EPI_GELU) dg_node_add_side(g, n, "pre", g->act_dtype, n->ndim, n->shape);
    return DG_OK;
}

/* x·wᵀ + bias + res: src {x, w, res[, bias]}; the output has the matmul's shape, which res must have */
static dg_status_t shape_matmul_res(dg_graph_t *g, dg_node_t *n) {
    const dg_node_t *x = n->src[0], *w = n->src[1], *res = n->src[2];
    CHECK(x->dtype == g->act_dtype && w->dtype == g->act_dtype && res->dtype == g->act_dtype,
          "inputs must be in the act dtype");
    DG_TRY(check_matmul_operands(g, n, 3));
    set_like(n, x);
    n->shape[n->ndim - 1] = w->shape[0];
    CHECK(same_shape(res, n), "the residual '%s' must have the product's shape [..., %" PRId64 "]", res->name,
          w->shape[0]);
    return DG_OK;
}

static dg_status_t shape_gelu(dg_graph_t *g, dg_node_t *n) {
    CHECK(n->src[0]->dtype == g->act_dtype, "input must be in the act dtype");
    set_like(n, n->src[0]);
    return DG_OK;
}

static dg_status_t shape_attention(dg_graph_t *g, dg_node_t *n) {
    const dg_node_t *qkv = n->src[0];
    int64_t NH = n->attr[DG_A_NH];
    CHECK(qkv->dtype == g->act_dtype && qkv->ndim == 3 && qkv->shape[2] % 3 == 0, "qkv must be [B, T, 3C]");
    int64_t B = qkv->shape[0], T = qkv->shape[1], C = qkv->shape[2] / 3;
    CHECK(NH >= 1 && C % NH == 0, "C = %" PRId64 " is not divisible by %" PRId64 " heads", C, NH);
    int64_t s[3] = {B, T, C};
    set_out(n, g->act_dtype, 3, s);
    size_t aux = g->be->ops->attention_aux_bytes(g->be, (int)B, (int)T, (int)C, (int)NH);
    int64_t aux_f = (int64_t)((aux + 3) / 4);
    if (aux_f < 1) aux_f = 1;
    dg_node_add_side(g, n, "aux", DG_F32, 1, &aux_f); /* backend scratch, counted in f32 words */
    return DG_OK;
}

static dg_status_t shape_add(dg_graph_t *g, dg_node_t *n) {
    const dg_node_t *a = n->src[0], *b = n->src[1];
    CHECK(a->dtype == g->act_dtype && same_shape(a, b) && a->dtype == b->dtype,
          "inputs must match in shape and dtype");
    set_like(n, a);
    return DG_OK;
}

/* src[0] the logits [..., Vp] in the act dtype, src[1] int32 targets (one per logit row), V in 1..Vp */
static dg_status_t check_ce_inputs(const dg_graph_t *g, const dg_node_t *n) {
    const dg_node_t *lg = n->src[0], *tg = n->src[1];
    int64_t V = n->attr[DG_A_V];
    CHECK(lg->dtype == g->act_dtype && lg->ndim >= 2, "logits must be [..., Vp] in the act dtype");
    CHECK(tg->dtype == DG_I32 && (int64_t)dg_node_numel(tg) == dg_node_rows(lg),
          "targets must be int32 with one id per logit row");
    CHECK(V >= 1 && V <= dg_node_cols(lg), "vocabulary %" PRId64 " outside 1..%" PRId64, V, dg_node_cols(lg));
    return DG_OK;
}

static dg_status_t shape_crossentropy(dg_graph_t *g, dg_node_t *n) {
    DG_TRY(check_ce_inputs(g, n));
    const dg_node_t *lg = n->src[0];
    set_out(n, DG_F32, lg->ndim - 1, lg->shape);
    dg_node_add_side(g, n, "lse", DG_F32, lg->ndim - 1, lg->shape);
    return DG_OK;
}

static dg_status_t shape_encoder_bwd(dg_graph_t *g, dg_node_t *n) {
    const dg_node_t *dout = n->src[0], *tok = n->src[1];
    CHECK(n->n_upd == 2, "needs dwte and dwpe");
    const dg_node_t *dwte = n->upd[0], *dwpe = n->upd[1];
    CHECK(dout->ndim == 3 && dout->dtype == g->act_dtype, "dout must be [B, T, C]");
    CHECK(tok->dtype == DG_I32 && tok->ndim == 2 && tok->shape[0] == dout->shape[0] &&
              tok->shape[1] == dout->shape[1],
          "tokens must be int32 [B, T]");
    CHECK(dwte->dtype == DG_F32 && dwpe->dtype == DG_F32 && dwte->ndim == 2 && dwpe->ndim == 2 &&
              dwte->shape[1] == dout->shape[2] && dwpe->shape[1] == dout->shape[2] &&
              dwpe->shape[0] >= dout->shape[1],
          "dwte/dwpe must be f32 [*, C]");
    n->storage = DG_STORE_NONE;
    return DG_OK;
}

static dg_status_t shape_layernorm_bwd(dg_graph_t *g, dg_node_t *n) {
    const dg_node_t *dout = n->src[0], *x = n->src[1], *w = n->src[2], *mean = n->src[3], *rstd = n->src[4];
    int64_t C = dg_node_cols(x), N = dg_node_rows(x);
    CHECK(same_shape(dout, x) && dout->dtype == g->act_dtype, "dout must match the input");
    CHECK(is_vec(w, C) && is_vec(mean, N) && is_vec(rstd, N) && mean->dtype == DG_F32 &&
              rstd->dtype == DG_F32,
          "weight [C] and f32 statistics [N] expected");
    CHECK(n->n_upd == 2 && is_vec(n->upd[0], C) && is_vec(n->upd[1], C) && n->upd[0]->dtype == DG_F32 &&
              n->upd[1]->dtype == DG_F32,
          "needs f32 dw and db of [%" PRId64 "]", C);
    set_like(n, x);
    return acc_rule(n, 5);
}

static dg_status_t shape_matmul_bwd(dg_graph_t *g, dg_node_t *n) {
    const dg_node_t *dout = n->src[0], *x = n->src[1], *w = n->src[2];
    CHECK(w->ndim == 2, "weight must be [OC, C]");
    int64_t OC = w->shape[0], C = w->shape[1];
    CHECK(dg_node_cols(x) == C && dg_node_cols(dout) == OC && dg_node_rows(x) == dg_node_rows(dout) &&
              dout->dtype == g->act_dtype,
          "dout [..., %" PRId64 "] / input [..., %" PRId64 "] do not match weight [%" PRId64 ", %" PRId64 "]",
          dg_node_cols(dout), dg_node_cols(x), OC, C);
    CHECK(n->n_upd >= 1 && n->n_upd <= 2 && is_mat(n->upd[0], OC, C) && n->upd[0]->dtype == DG_F32,
          "needs an f32 dw of [%" PRId64 ", %" PRId64 "]", OC, C);
    if (n->n_upd == 2)
        CHECK(is_vec(n->upd[1], OC) && n->upd[1]->dtype == DG_F32, "dbias must be f32 [%" PRId64 "]", OC);
    if (n->attr[DG_A_NO_DINP]) {
        CHECK(!n->attr[DG_A_ACC] && n->n_src == 3, "no_dinp excludes acc");
        n->storage = DG_STORE_NONE;
        return DG_OK;
    }
    set_like(n, x);
    return acc_rule(n, 3);
}

static dg_status_t shape_matmul_bwd_dgelu(dg_graph_t *g, dg_node_t *n) {
    const dg_node_t *dout = n->src[0], *x = n->src[1], *w = n->src[2], *pre = n->src[3];
    CHECK(w->ndim == 2, "weight must be [OC, C]");
    int64_t OC = w->shape[0], C = w->shape[1];
    CHECK(dg_node_cols(x) == C && dg_node_cols(dout) == OC && dg_node_rows(x) == dg_node_rows(dout) &&
              dout->dtype == g->act_dtype && x->dtype == g->act_dtype,
          "dout [..., %" PRId64 "] / input [..., %" PRId64 "] do not match weight [%" PRId64 ", %" PRId64 "]",
          dg_node_cols(dout), dg_node_cols(x), OC, C);
    CHECK(same_shape(pre, x) && pre->dtype == g->act_dtype,
          "the pre-activation must have the shape and dtype of the input (its GELU)");
    CHECK(n->n_upd >= 1 && n->n_upd <= 2 && is_mat(n->upd[0], OC, C) && n->upd[0]->dtype == DG_F32,
          "needs an f32 dw of [%" PRId64 ", %" PRId64 "]", OC, C);
    if (n->n_upd == 2)
        CHECK(is_vec(n->upd[1], OC) && n->upd[1]->dtype == DG_F32, "dbias must be f32 [%" PRId64 "]", OC);
    CHECK(!n->attr[DG_A_NO_DINP], "always computes the input gradient");
    set_like(n, x);
    return acc_rule(n, 4);
}

static dg_status_t shape_gelu_bwd(dg_graph_t *g, dg_node_t *n) {
    const dg_node_t *x = n->src[0], *dout = n->src[1];
    CHECK(same_shape(x, dout) && x->dtype == g->act_dtype && dout->dtype == g->act_dtype,
          "input and dout must match");
    set_like(n, x);
    return acc_rule(n, 2);
}

static dg_status_t shape_attention_bwd(dg_graph_t *g, dg_node_t *n) {
    const dg_node_t *dout = n->src[0], *qkv = n->src[1], *out = n->src[2], *aux = n->src[3];
    CHECK(qkv->ndim == 3 && same_shape(dout, out) && out->ndim == 3 && qkv->shape[2] == 3 * out->shape[2] &&
              qkv->shape[0] == out->shape[0] && qkv->shape[1] == out->shape[1] && dout->dtype == g->act_dtype,
          "expects dout/out [B, T, C] and qkv [B, T, 3C]");
    CHECK(aux->op == DG_OP_SIDE && aux->src[0] == out, "aux must be the forward attention's scratch");
    CHECK(out->op != DG_OP_ATTENTION || n->attr[DG_A_NH] == out->attr[DG_A_NH], "head count mismatch");
    set_like(n, qkv);
    /* the backend's workspace (cuDNN's deterministic backward: B * NH * T^2 * 2 bytes), as a side output
     * nobody reads: the planner gives it arena memory that is free while this op runs */
    const dg_backend_ops_t *bo = g->be->ops;
    if (bo->attention_bwd_ws_bytes && bo->attention_bwd_ws) {
        size_t ws = bo->attention_bwd_ws_bytes(g->be, (int)out->shape[0], (int)out->shape[1],
                                               (int)out->shape[2], (int)n->attr[DG_A_NH]);
        if (ws > 0) {
            int64_t ws_f = (int64_t)((ws + 3) / 4);
            dg_node_add_side(g, n, "ws", DG_F32, 1, &ws_f); /* counted in f32 words */
        }
    }
    return DG_OK;
}

static dg_status_t shape_crossentropy_bwd(dg_graph_t *g, dg_node_t *n) {
    const dg_node_t *lg = n->src[0], *lse = n->src[1], *tg = n->src[2];
    int64_t V = n->attr[DG_A_V];
    CHECK(lg->dtype == g->act_dtype && lg->ndim >= 2 && lse->dtype == DG_F32 &&
              (int64_t)dg_node_numel(lse) == dg_node_rows(lg) && tg->dtype == DG_I32 &&
              (int64_t)dg_node_numel(tg) == dg_node_rows(lg),
          "expects logits [..., Vp], f32 lse and int32 targets per row");
    CHECK(V >= 1 && V <= dg_node_cols(lg), "vocabulary %" PRId64 " outside 1..%" PRId64, V, dg_node_cols(lg));
    set_like(n, lg);
    return DG_OK;
}

/* the loss and its gradient in one op: output dlogits like the logits, side outputs losses and lse */
static dg_status_t shape_crossentropy_fused(dg_graph_t *g, dg_node_t *n) {
    DG_TRY(check_ce_inputs(g, n));
    const dg_node_t *lg = n->src[0];
    set_like(n, lg);
    dg_node_add_side(g, n, "losses", DG_F32, lg->ndim - 1, lg->shape);
    dg_node_add_side(g, n, "lse", DG_F32, lg->ndim - 1, lg->shape);
    return DG_OK;
}

static dg_status_t shape_accumulate(dg_graph_t *g, dg_node_t *n) {
    (void)g;
    const dg_node_t *t = n->src[0], *x = n->src[1];
    CHECK(same_shape(t, x) && t->dtype == x->dtype, "target and addend must match");
    set_like(n, t);
    n->attr[DG_A_ACC] = 1;
    n->view_src = n->src[0];
    return DG_OK;
}

static dg_status_t shape_zero(dg_graph_t *g, dg_node_t *n) {
    (void)g;
    CHECK(n->n_upd == 1, "zeroes exactly one persistent tensor");
    n->storage = DG_STORE_NONE;
    return DG_OK;
}

/* The norm and clip ops update one persistent tensor: the f32 scalars block. */
static dg_status_t check_updates_scalars(dg_node_t *n) {
    CHECK(n->n_upd == 1 && n->upd[0]->dtype == DG_F32 && dg_node_numel(n->upd[0]) >= DG_SCALAR_COUNT,
          "needs the f32 scalars block");
    return DG_OK;
}

static dg_status_t shape_sumsq(dg_graph_t *g, dg_node_t *n) {
    (void)g;
    CHECK(n->src[0]->dtype == DG_F32, "sums squares of an f32 tensor");
    DG_TRY(check_updates_scalars(n));
    n->storage = DG_STORE_NONE;
    return DG_OK;
}

/* A fused op's segment table `tab`: i32 [ns, 4] of entry_bytes-sized rows, ns = the op's DG_A_NSEG
 * attribute, the graph describing the same ns segments (n_segs of them at `segs`). */
static dg_status_t check_seg_table(const dg_node_t *n, const dg_node_t *tab, int n_segs, const void *segs,
                                   size_t entry_bytes, int *ns_out) {
    int ns = (int)n->attr[DG_A_NSEG];
    CHECK(ns >= 1 && ns == n_segs && segs, "%d segments, the graph describes %d", ns, n_segs);
    CHECK(tab->dtype == DG_I32 && tab->ndim == 2 && tab->shape[0] == ns && tab->shape[1] == 4 &&
              tab->nbytes == (size_t)ns * entry_bytes,
          "the segment table must be i32 [%d, 4]", ns);
    *ns_out = ns;
    return DG_OK;
}

/* The fused norm: every segment of g->norm_segs inside the flat gradient leaf (any order, as the SUMSQ ops
 * it replaced came), and the scalars block it accumulates into. */
static dg_status_t shape_sumsq_all(dg_graph_t *g, dg_node_t *n) {
    const dg_node_t *grad = n->src[0], *tab = n->src[1];
    size_t span = dg_node_numel(grad);
    CHECK(grad->dtype == DG_F32, "sums squares of the f32 flat gradient");
    DG_TRY(check_updates_scalars(n));
    int ns = 0;
    DG_TRY(check_seg_table(n, tab, g->n_norm_segs, g->norm_segs, sizeof(dg_sumsq_seg_t), &ns));
    for (int i = 0; i < ns; i++) {
        const dg_opt_seg_t *sg = &g->norm_segs[i];
        CHECK(sg->count >= 1 && sg->count <= UINT32_MAX && sg->off <= span && sg->count <= span - sg->off,
              "segment %d (%zu elements at %zu) lies outside the %zu-element flat gradient", i, sg->count,
              sg->off, span);
    }
    n->storage = DG_STORE_NONE;
    return DG_OK;
}

static dg_status_t shape_clip_scale(dg_graph_t *g, dg_node_t *n) {
    (void)g;
    DG_TRY(check_updates_scalars(n));
    n->storage = DG_STORE_NONE;
    return DG_OK;
}

/* AdamW's operands: an f32 gradient (flat: the fused op's flat one) and the scalars block, and four updated
 * states of the gradient's length, master, m and v f32 and the parameter(s) in the act dtype. */
static dg_status_t check_adamw(const dg_graph_t *g, dg_node_t *n, int flat) {
    const dg_node_t *grad = n->src[0], *sc = n->src[1];
    const char *s = flat ? "s" : "", *fl = flat ? "flat " : "";
    CHECK(n->n_upd == 4, "updates master, m, v and the parameter%s", s);
    size_t numel = dg_node_numel(grad);
    CHECK(grad->dtype == DG_F32 && sc->dtype == DG_F32 && dg_node_numel(sc) >= DG_SCALAR_COUNT,
          "needs %s gradient and the scalars block", flat ? "the f32 flat" : "an f32");
    for (int k = 0; k < 4; k++)
        CHECK(dg_node_numel(n->upd[k]) == numel, "%sstate %d has %zu elements, %sgradient %zu", fl, k,
              dg_node_numel(n->upd[k]), flat ? "the flat " : "", numel);
    CHECK(n->upd[0]->dtype == DG_F32 && n->upd[1]->dtype == DG_F32 && n->upd[2]->dtype == DG_F32 &&
              n->upd[3]->dtype == g->act_dtype,
          "master, m, v must be f32 and the parameter%s in the act dtype", s);
    return DG_OK;
}

static dg_status_t shape_adamw(dg_graph_t *g, dg_node_t *n) {
    DG_TRY(check_adamw(g, n, 0));
    n->storage = DG_STORE_NONE;
    return DG_OK;
}

/* The fused AdamW: every segment of g->opt_segs inside the flat leaves, which all have `span` elements. */
static dg_status_t shape_adamw_all(dg_graph_t *g, dg_node_t *n) {
    const dg_node_t *tab = n->src[2];
    DG_TRY(check_adamw(g, n, 1));
    size_t span = dg_node_numel(n->src[0]);
    int ns = 0;
    DG_TRY(check_seg_table(n, tab, g->n_opt_segs, g->opt_segs, sizeof(dg_adamw_seg_t), &ns));
    for (int i = 0; i < ns; i++) {
        const dg_opt_seg_t *sg = &g->opt_segs[i];
        CHECK(sg->off % 4 == 0 && sg->count >= 1 && sg->count <= UINT32_MAX && sg->off <= span &&
                  sg->count <= span - sg->off && (i == 0 || sg->off >= sg[-1].off + sg[-1].count),
              "segment %d (%zu elements at %zu) breaks the table rules", i, sg->count, sg->off);
    }
    n->storage = DG_STORE_NONE;
    return DG_OK;
}

static int64_t mesh_size(const dg_graph_t *g, const dg_node_t *n) {
    int64_t d = n->attr[DG_A_MESHDIM];
    return (d >= 0 && d < DG_MESH_NDIM) ? g->mesh.size[d] : -1;
}

static dg_status_t shape_all_gather(dg_graph_t *g, dg_node_t *n) {
    int64_t k = mesh_size(g, n);
    CHECK(k >= 1, "mesh dimension %" PRId64 " is not one of dp_replicate, dp_shard, tp",
          n->attr[DG_A_MESHDIM]);
    CHECK(n->src[0]->ndim >= 1, "needs at least one dimension to gather along");
    set_like(n, n->src[0]);
    n->shape[0] *= k; /* pieces are concatenated along dim 0 in mesh-coordinate order */
    return DG_OK;
}

static dg_status_t shape_reduce_scatter(dg_graph_t *g, dg_node_t *n) {
    int64_t k = mesh_size(g, n);
    CHECK(k >= 1, "mesh dimension %" PRId64 " is not one of dp_replicate, dp_shard, tp",
          n->attr[DG_A_MESHDIM]);
    if (n->attr[DG_A_ACC]) { /* scatter in place over the input, then add this rank's block into upd[0] */
        CHECK(n->n_upd == 1 && n->upd[0]->dtype == DG_F32 && n->src[0]->dtype == DG_F32,
              "acc=1 adds into exactly one f32 persistent tensor");
        CHECK(dg_node_numel(n->src[0]) == (size_t)k * dg_node_numel(n->upd[0]),
              "input of %zu elements is not %" PRId64 " blocks of '%s' (%zu)", dg_node_numel(n->src[0]), k,
              n->upd[0]->name, dg_node_numel(n->upd[0]));
        n->storage = DG_STORE_NONE;
        return DG_OK;
    }
    CHECK(n->n_upd == 0, "only acc=1 updates a persistent tensor");
    CHECK(n->src[0]->ndim >= 1 && n->src[0]->shape[0] % k == 0,
          "dim 0 (%" PRId64 ") is not divisible by the %" PRId64 " ranks of mesh dimension %s",
          n->src[0]->ndim ? n->src[0]->shape[0] : 0, k, dg_mesh_dim_name((int)n->attr[DG_A_MESHDIM]));
    set_like(n, n->src[0]);
    n->shape[0] /= k;
    return DG_OK;
}

static dg_status_t shape_all_reduce(dg_graph_t *g, dg_node_t *n) {
    int64_t k = mesh_size(g, n);
    CHECK(k >= 1, "mesh dimension %" PRId64 " is not one of dp_replicate, dp_shard, tp",
          n->attr[DG_A_MESHDIM]);
    int64_t mode = n->attr[DG_A_ARMODE];
    CHECK(mode >= DG_AR_SUM && mode <= DG_AR_FROM_REPLICATE, "unknown all_reduce mode %" PRId64, mode);
    if (n->n_src == 0) { /* in place over a persistent tensor (gradient buckets, the norm accumulator) or
                            an arena one (a bucket's bf16 copy, train.reduce_dtype = bf16) */
        CHECK(n->n_upd == 1 && mode == DG_AR_SUM, "an in-place all_reduce updates exactly one tensor (sum)");
        CHECK(n->attr[DG_A_COUNT] >= 0 && (size_t)n->attr[DG_A_COUNT] <= dg_node_numel(n->upd[0]),
              "count %" PRId64 " exceeds the %zu elements of '%s'", n->attr[DG_A_COUNT],
              dg_node_numel(n->upd[0]), n->upd[0]->name);
        n->storage = DG_STORE_NONE;
        return DG_OK;
    }
    CHECK(n->n_upd == 0, "an all_reduce with an input writes its own output");
    set_like(n, n->src[0]);
    if (mode == DG_AR_FROM_REPLICATE) n->view_src = n->src[0]; /* identity forward: no copy */
    return DG_OK;
}

static int64_t rows_of(const dg_node_t *x) {
    return x->ndim ? x->shape[0] : 1;
}

static int64_t cols_of(const dg_node_t *x) {
    return x->ndim >= 2 ? (int64_t)(dg_node_numel(x) / (size_t)x->shape[0]) : 1;
}

/* Geometry shared by pack/unpack: k rank blocks of S elements; this parameter's piece of Rs rows x cols
 * starts at element OFF of each block; rank r holds rows [r*Rs, (r+1)*Rs) of the unsharded tensor. */
static dg_status_t check_bucket_geometry(const dg_node_t *n, int64_t rows, int64_t cols) {
    int64_t k = n->attr[DG_A_K], S = n->attr[DG_A_S], off = n->attr[DG_A_OFF], Rs = n->attr[DG_A_RS];
    CHECK(k >= 1 && S >= 1 && off >= 0 && Rs >= 1 && cols >= 1, "bad bucket geometry");
    CHECK(off + Rs * cols <= S, "piece [%" PRId64 ", %" PRId64 ") exceeds the rank block of %" PRId64, off,
          off + Rs * cols, S);
    CHECK(Rs * k >= rows && Rs * (k - 1) < rows + Rs,
          "%" PRId64 " rows over %" PRId64 " ranks do not fit shards of %" PRId64 " rows", rows, k, Rs);
    return DG_OK;
}

static dg_status_t shape_fill0(dg_graph_t *g, dg_node_t *n) {
    (void)g;
    int64_t nd = n->attr[DG_A_NDIM0];
    CHECK(nd >= 1 && nd <= 4 && DG_A_NDIM0 + nd < DG_MAX_ATTR, "ndim %" PRId64 " outside 1..4", nd);
    int64_t s[DG_MAX_DIMS];
    for (int d = 0; d < nd; d++) {
        s[d] = n->attr[DG_A_NDIM0 + 1 + d];
        CHECK(s[d] >= 1, "dim %d has size %" PRId64, d, s[d]);
    }
    set_out(n, DG_F32, (int)nd, s);
    return DG_OK;
}

static dg_status_t shape_shard_pack(dg_graph_t *g, dg_node_t *n) {
    (void)g;
    const dg_node_t *x = n->src[0];
    CHECK(x->dtype == DG_F32, "packs f32 gradients");
    dg_status_t st = check_bucket_geometry(n, rows_of(x), cols_of(x));
    if (st != DG_OK) return st;
    int64_t s[1] = {n->attr[DG_A_K] * n->attr[DG_A_S]};
    set_out(n, DG_F32, 1, s);
    return acc_rule(n, 1); /* later pieces of the same bucket write into the first one's buffer */
}

static dg_status_t shape_shard_unpack(dg_graph_t *g, dg_node_t *n) {
    (void)g;
    const dg_node_t *x = n->src[0];
    int64_t R = n->attr[DG_A_ROWS], Cc = n->attr[DG_A_COLS];
    CHECK(x->ndim == 1 && x->shape[0] == n->attr[DG_A_K] * n->attr[DG_A_S],
          "the gathered bucket must be [k * S] = [%" PRId64 "]", n->attr[DG_A_K] * n->attr[DG_A_S]);
    CHECK(R >= 1 && Cc >= 0, "bad output shape");
    dg_status_t st = check_bucket_geometry(n, R, Cc ? Cc : 1);
    if (st != DG_OK) return st;
    int64_t s[2] = {R, Cc};
    set_out(n, x->dtype, Cc ? 2 : 1, s);
    return DG_OK;
}

static int is_float(dg_dtype_t t) {
    return t == DG_F32 || t == DG_BF16 || t == DG_F16;
}

/* CAST: x converted to attr[DG_A_DTYPE]; into a new tensor, into upd[0], or added to upd[0] (acc, f32:
 * the op's own output is then the f32 temporary the converted values pass through). */
static dg_status_t shape_cast(dg_graph_t *g, dg_node_t *n) {
    (void)g;
    const dg_node_t *x = n->src[0];
    int64_t dt = n->attr[DG_A_DTYPE];
    CHECK(is_float(x->dtype), "input must be f32, bf16 or f16, not %s", dg_dtype_name(x->dtype));
    CHECK(dt == DG_F32 || dt == DG_BF16 || dt == DG_F16, "target dtype %" PRId64 " is not f32, bf16 or f16",
          dt);
    if (n->n_upd == 0) {
        CHECK(!n->attr[DG_A_ACC], "acc=1 adds into a tensor given in upd");
        set_out(n, (dg_dtype_t)dt, x->ndim, x->shape);
        return DG_OK;
    }
    const dg_node_t *t = n->upd[0];
    CHECK(n->n_upd == 1 && t->dtype == (dg_dtype_t)dt && dg_node_numel(t) == dg_node_numel(x),
          "writes exactly one %s tensor of %zu elements, got '%s' (%s, %zu)", dg_dtype_name((dg_dtype_t)dt),
          dg_node_numel(x), t->name, dg_dtype_name(t->dtype), dg_node_numel(t));
    if (n->attr[DG_A_ACC]) {
        CHECK(dt == DG_F32, "acc=1 adds into an f32 tensor (add_f32)");
        set_out(n, DG_F32, x->ndim, x->shape);
        return DG_OK;
    }
    n->storage = DG_STORE_NONE;
    return DG_OK;
}

static dg_status_t shape_wait(dg_graph_t *g, dg_node_t *n) {
    (void)g;
    n->storage = DG_STORE_NONE; /* the wait edges are added by the pass that creates it */
    return DG_OK;
}

/* ================= backward builders ================= */

static const char *bname(char *buf, size_t cap, const dg_node_t *n, const char *what) {
    dg_fmt(buf, cap, "%.80s.%.12s", n->name, what);
    return buf;
}

/* The weight gradient every backward kernel accumulates into. */
#define PGRAD(var, w)                                                                                        \
    dg_node_t *var = dg_ad_param_grad(ad, (w), dg_op_name(n->op));                                           \
    if (!var) return dg_graph_error(g)

static dg_status_t bwd_encoder(dg_ad_t *ad, dg_node_t *n) {
    dg_graph_t *g = dg_ad_graph(ad);
    char nm[96];
    PGRAD(dwte, n->src[1]);
    PGRAD(dwpe, n->src[2]);
    dg_node_t *src[2] = {n->grad, n->src[0]}, *upd[2] = {dwte, dwpe};
    dg_graph_add_op(g, DG_OP_ENCODER_BWD, bname(nm, sizeof nm, n, "bwd"), 2, src, 2, upd, NULL, 0);
    return dg_graph_error(g);
}

static dg_status_t bwd_layernorm(dg_ad_t *ad, dg_node_t *n) {
    dg_graph_t *g = dg_ad_graph(ad);
    char nm[96];
    dg_node_t *x = n->src[0];
    PGRAD(dw, n->src[1]);
    PGRAD(db, n->src[2]);
    int wants = dg_ad_wants(ad, x);
    dg_node_t *t = wants ? dg_ad_acc_target(ad, x) : NULL;
    dg_node_t *src[6] = {n->grad, x, n->src[1], n->side[0], n->side[1], t}, *upd[2] = {dw, db};
    int64_t attr[1] = {t != NULL};
    /* the kernel always writes dinp; without a consumer it is a dead temporary */
    dg_node_t *dx = dg_graph_add_op(g, DG_OP_LAYERNORM_BWD, bname(nm, sizeof nm, n, "bwd"), t ? 6 : 5, src, 2,
                                    upd, attr, 1);
    if (dx && wants) dg_ad_contribute(ad, x, dx, t != NULL);
    return dg_graph_error(g);
}

/* The backward of the linear part x·wᵀ + bias of op n, given the gradient dout of that part: one
 * MATMUL_BWD (MATMUL and MATMUL_RES share it). */
static dg_status_t matmul_backward(dg_ad_t *ad, dg_node_t *n, dg_node_t *x, dg_node_t *w, dg_node_t *bias,
                                   dg_node_t *dout) {
    dg_graph_t *g = dg_ad_graph(ad);
    char nm[96];
    PGRAD(dw, w);
    dg_node_t *db = NULL;
    if (bias) {
        db = dg_ad_param_grad(ad, bias, dg_op_name(n->op));
        if (!db) return dg_graph_error(g);
    }
    int wants = dg_ad_wants(ad, x);
    dg_node_t *t = wants ? dg_ad_acc_target(ad, x) : NULL;
    dg_node_t *src[4] = {dout, x, w, t}, *upd[2] = {dw, db};
    int64_t attr[3] = {t != NULL, 0, !wants};
    dg_node_t *dx = dg_graph_add_op(g, DG_OP_MATMUL_BWD, bname(nm, sizeof nm, n, "bwd"), t ? 4 : 3, src,
                                    db ? 2 : 1, upd, attr, 3);
    if (dx && wants) dg_ad_contribute(ad, x, dx, t != NULL);
    return dg_graph_error(g);
}

static dg_status_t bwd_matmul(dg_ad_t *ad, dg_node_t *n) {
    dg_graph_t *g = dg_ad_graph(ad);
    char nm[96];
    dg_node_t *dout = n->grad;
    if (n->attr[DG_A_EPI] == DG_EPI_GELU) { /* out = gelu(pre): first back through the GELU */
        dg_node_t *gsrc[2] = {n->side[0], n->grad};
        dout = dg_graph_add_op(g, DG_OP_GELU_BWD, bname(nm, sizeof nm, n, "gelu_bwd"), 2, gsrc, 0, NULL, NULL,
                               0);
        if (!dout) return dg_graph_error(g);
    }
    return matmul_backward(ad, n, n->src[0], n->src[1], n->n_src == 3 ? n->src[2] : NULL, dout);
}

/* out = x·wᵀ + bias + res: the residual receives the output's gradient unchanged (shared, no kernel, as
 * bwd_add gives it), then the linear part's backward reads that same gradient. This is the order in
 * which the unfused pair's backward emits its ops (the add's, then the matmul's), so the backward of a
 * fused graph is the unfused one op for op. */
static dg_status_t bwd_matmul_res(dg_ad_t *ad, dg_node_t *n) {
    dg_graph_t *g = dg_ad_graph(ad);
    if (dg_ad_wants(ad, n->src[2])) dg_ad_contribute_shared(ad, n->src[2], n->grad);
    if (g->err) return g->err;
    return matmul_backward(ad, n, n->src[0], n->src[1], n->n_src == 4 ? n->src[3] : NULL, n->grad);
}

static dg_status_t bwd_gelu(dg_ad_t *ad, dg_node_t *n) {
    dg_graph_t *g = dg_ad_graph(ad);
    char nm[96];
    dg_node_t *x = n->src[0];
    if (!dg_ad_wants(ad, x)) return DG_OK;
    dg_node_t *t = dg_ad_acc_target(ad, x);
    dg_node_t *src[3] = {x, n->grad, t};
    int64_t attr[1] = {t != NULL};
    dg_node_t *dx =
        dg_graph_add_op(g, DG_OP_GELU_BWD, bname(nm, sizeof nm, n, "bwd"), t ? 3 : 2, src, 0, NULL, attr, 1);
    if (dx) dg_ad_contribute(ad, x, dx, t != NULL);
    return dg_graph_error(g);
}

static dg_status_t bwd_attention(dg_ad_t *ad, dg_node_t *n) {
    dg_graph_t *g = dg_ad_graph(ad);
    char nm[96];
    dg_node_t *qkv = n->src[0];
    if (!dg_ad_wants(ad, qkv)) return DG_OK;
    dg_node_t *src[4] = {n->grad, qkv, n, n->side[0]};
    int64_t attr[2] = {0, n->attr[DG_A_NH]};
    /* the kernel overwrites dqkv (no acc), so a second consumer's gradient is summed by contribute */
    dg_node_t *d =
        dg_graph_add_op(g, DG_OP_ATTENTION_BWD, bname(nm, sizeof nm, n, "bwd"), 4, src, 0, NULL, attr, 2);
    if (d) dg_ad_contribute(ad, qkv, d, 0);
    return dg_graph_error(g);
}

static dg_status_t bwd_add(dg_ad_t *ad, dg_node_t *n) {
    /* d(a+b) passes the gradient through unchanged: share it, no kernel */
    if (dg_ad_wants(ad, n->src[0])) dg_ad_contribute_shared(ad, n->src[0], n->grad);
    if (dg_ad_wants(ad, n->src[1])) dg_ad_contribute_shared(ad, n->src[1], n->grad);
    return dg_graph_error(dg_ad_graph(ad));
}

static dg_status_t bwd_crossentropy(dg_ad_t *ad, dg_node_t *n) {
    dg_graph_t *g = dg_ad_graph(ad);
    char nm[96];
    if (!dg_ad_is_loss_seed(ad, n))
        return g->err = DG_ERR(
                   DG_ERR_USAGE,
                   "graph: crossentropy '%s' must be a loss output (its gradient is the runtime dloss); "
                   "using its losses in further ops is not supported",
                   n->name);
    dg_node_t *lg = n->src[0];
    if (!dg_ad_wants(ad, lg)) return DG_OK;
    dg_node_t *src[3] = {lg, n->side[0], n->src[1]};
    int64_t attr[2] = {0, n->attr[DG_A_V]};
    dg_node_t *d =
        dg_graph_add_op(g, DG_OP_CROSSENTROPY_BWD, bname(nm, sizeof nm, n, "bwd"), 3, src, 0, NULL, attr, 2);
    if (d) dg_ad_contribute(ad, lg, d, 0);
    return dg_graph_error(g);
}

static dg_status_t bwd_collective(dg_ad_t *ad, dg_node_t *n, dg_op_kind_t adjoint) {
    dg_graph_t *g = dg_ad_graph(ad);
    char nm[96];
    dg_node_t *x = n->src[0];
    if (!dg_ad_wants(ad, x)) return DG_OK;
    dg_node_t *src[1] = {n->grad};
    int64_t attr[2] = {0, n->attr[DG_A_MESHDIM]};
    dg_node_t *d = dg_graph_add_op(g, adjoint, bname(nm, sizeof nm, n, "bwd"), 1, src, 0, NULL, attr, 2);
    if (d) dg_ad_contribute(ad, x, d, 0);
    return dg_graph_error(g);
}

/* all-gather's adjoint is reduce-scatter and vice versa; a sum all-reduce is its own adjoint */
static dg_status_t bwd_all_gather(dg_ad_t *ad, dg_node_t *n) {
    return bwd_collective(ad, n, DG_OP_REDUCE_SCATTER);
}
static dg_status_t bwd_reduce_scatter(dg_ad_t *ad, dg_node_t *n) {
    return bwd_collective(ad, n, DG_OP_ALL_GATHER);
}
static dg_status_t bwd_all_reduce(dg_ad_t *ad, dg_node_t *n) {
    if (n->attr[DG_A_ARMODE] == DG_AR_TO_REPLICATE) {
        /* every rank computes the same loss from the replicated sum: each partial input's gradient is
         * the output's gradient as it is */
        if (dg_ad_wants(ad, n->src[0])) dg_ad_contribute_shared(ad, n->src[0], n->grad);
        return dg_graph_error(dg_ad_graph(ad));
    }
    /* SUM: adjoint is the sum; FROM_REPLICATE: the ranks' partial gradients of a replicated input add up */
    return bwd_collective(ad, n, DG_OP_ALL_REDUCE);
}

/* ================= executors ================= */

#define BE (ex->be)
#define P(node) dg_exec_ptr(ex, (node))
#define I(x) ((int)(x))

static dg_status_t ex_encoder(dg_exec_t *ex, const dg_node_t *n) {
    const dg_node_t *tok = n->src[0];
    return BE->ops->encoder_fwd(BE, P(n), P(tok), P(n->src[1]), P(n->src[2]), I(tok->shape[0]),
                                I(tok->shape[1]), I(dg_node_cols(n)));
}

static dg_status_t ex_layernorm(dg_exec_t *ex, const dg_node_t *n) {
    const dg_node_t *x = n->src[0];
    return BE->ops->layernorm_fwd(BE, P(n), P(n->side[0]), P(n->side[1]), P(x), P(n->src[1]), P(n->src[2]),
                                  I(dg_node_rows(x)), I(dg_node_cols(x)));
}

static dg_status_t ex_matmul(dg_exec_t *ex, const dg_node_t *n) {
    const dg_node_t *x = n->src[0], *w = n->src[1];
    int gelu = n->attr[DG_A_EPI] == DG_EPI_GELU;
    return BE->ops->matmul_fwd(BE, P(n), gelu ? P(n->side[0]) : NULL, P(x), P(w),
                               n->n_src == 3 ? P(n->src[2]) : NULL, I(dg_node_rows(x)), I(w->shape[1]),
                               I(w->shape[0]), gelu ? DG_EPI_GELU : DG_EPI_NONE);
}

static dg_status_t ex_matmul_res(dg_exec_t *ex, const dg_node_t *n) {
    const dg_node_t *x = n->src[0], *w = n->src[1];
    return BE->ops->matmul_fwd_res(BE, P(n), P(x), P(w), n->n_src == 4 ? P(n->src[3]) : NULL, P(n->src[2]),
                                   I(dg_node_rows(x)), I(w->shape[1]), I(w->shape[0]));
}

static dg_status_t ex_gelu(dg_exec_t *ex, const dg_node_t *n) {
    return BE->ops->gelu_fwd(BE, P(n), P(n->src[0]), dg_node_numel(n));
}

static dg_status_t ex_attention(dg_exec_t *ex, const dg_node_t *n) {
    return BE->ops->attention_fwd(BE, P(n), P(n->side[0]), P(n->src[0]), I(n->shape[0]), I(n->shape[1]),
                                  I(n->shape[2]), I(n->attr[DG_A_NH]));
}

static dg_status_t ex_add(dg_exec_t *ex, const dg_node_t *n) {
    return BE->ops->add(BE, P(n), P(n->src[0]), P(n->src[1]), dg_node_numel(n));
}

static dg_status_t ex_crossentropy(dg_exec_t *ex, const dg_node_t *n) {
    const dg_node_t *lg = n->src[0];
    return BE->ops->crossentropy_fwd(BE, P(n), P(n->side[0]), P(lg), P(n->src[1]), I(dg_node_rows(lg)),
                                     I(n->attr[DG_A_V]), I(dg_node_cols(lg)));
}

/* The forward of a step whose backward follows writes the gradient too, with the step's dloss (set
 * before the forward); a forward alone (rt.forward_only: evaluation, logits) computes the losses only
 * and leaves the logits for the host to read. */
static dg_status_t ex_crossentropy_fused(dg_exec_t *ex, const dg_node_t *n) {
    const dg_node_t *lg = n->src[0];
    const int N = I(dg_node_rows(lg)), V = I(n->attr[DG_A_V]), Vp = I(dg_node_cols(lg));
    if (ex->rt.forward_only)
        return BE->ops->crossentropy_fwd(BE, P(n->side[0]), P(n->side[1]), P(lg), P(n->src[1]), N, V, Vp);
    return BE->ops->crossentropy_fused(BE, P(n->side[0]), P(n->side[1]), P(n), P(lg), P(n->src[1]), N, V, Vp,
                                       ex->rt.dloss);
}

static dg_status_t ex_encoder_bwd(dg_exec_t *ex, const dg_node_t *n) {
    const dg_node_t *dout = n->src[0];
    return BE->ops->encoder_bwd(BE, P(n->upd[0]), P(n->upd[1]), P(dout), P(n->src[1]), I(dout->shape[0]),
                                I(dout->shape[1]), I(dout->shape[2]));
}

static dg_status_t ex_layernorm_bwd(dg_exec_t *ex, const dg_node_t *n) {
    const dg_node_t *x = n->src[1];
    return BE->ops->layernorm_bwd(BE, P(n), P(n->upd[0]), P(n->upd[1]), P(n->src[0]), P(x), P(n->src[2]),
                                  P(n->src[3]), P(n->src[4]), I(dg_node_rows(x)), I(dg_node_cols(x)),
                                  I(n->attr[DG_A_ACC]));
}

static dg_status_t ex_matmul_bwd(dg_exec_t *ex, const dg_node_t *n) {
    const dg_node_t *x = n->src[1], *w = n->src[2];
    void *dinp = n->storage == DG_STORE_NONE ? NULL : P(n);
    return BE->ops->matmul_bwd(BE, dinp, P(n->upd[0]), n->n_upd == 2 ? P(n->upd[1]) : NULL, P(n->src[0]),
                               P(x), P(w), I(dg_node_rows(x)), I(w->shape[1]), I(w->shape[0]),
                               I(n->attr[DG_A_ACC]));
}

static dg_status_t ex_matmul_bwd_dgelu(dg_exec_t *ex, const dg_node_t *n) {
    const dg_node_t *x = n->src[1], *w = n->src[2];
    return BE->ops->matmul_bwd_dgelu(BE, P(n), P(n->upd[0]), n->n_upd == 2 ? P(n->upd[1]) : NULL,
                                     P(n->src[0]), P(x), P(w), P(n->src[3]), I(dg_node_rows(x)),
                                     I(w->shape[1]), I(w->shape[0]), I(n->attr[DG_A_ACC]));
}

static dg_status_t ex_gelu_bwd(dg_exec_t *ex, const dg_node_t *n) {
    return BE->ops->gelu_bwd(BE, P(n), P(n->src[0]), P(n->src[1]), dg_node_numel(n), I(n->attr[DG_A_ACC]));
}

static dg_status_t ex_attention_bwd(dg_exec_t *ex, const dg_node_t *n) {
    const dg_node_t *out = n->src[2];
    if (n->n_side > 0 && BE->ops->attention_bwd_ws)
        return BE->ops->attention_bwd_ws(BE, P(n), P(n->src[0]), P(n->src[1]), P(out), P(n->src[3]),
                                         P(n->side[0]), n->side[0]->nbytes, I(out->shape[0]),
                                         I(out->shape[1]), I(out->shape[2]), I(n->attr[DG_A_NH]));
    return BE->ops->attention_bwd(BE, P(n), P(n->src[0]), P(n->src[1]), P(out), P(n->src[3]),
                                  I(out->shape[0]), I(out->shape[1]), I(out->shape[2]), I(n->attr[DG_A_NH]));
}

static dg_status_t ex_crossentropy_bwd(dg_exec_t *ex, const dg_node_t *n) {
    const dg_node_t *lg = n->src[0];
    return BE->ops->crossentropy_bwd(BE, P(n), P(lg), P(n->src[1]), P(n->src[2]), I(dg_node_rows(lg)),
                                     I(n->attr[DG_A_V]), I(dg_node_cols(lg)), ex->rt.dloss);
}

static dg_status_t ex_accumulate(dg_exec_t *ex, const dg_node_t *n) {
    return BE->ops->accumulate(BE, P(n), P(n->src[1]), dg_node_numel(n), 1);
}

static dg_status_t ex_zero(dg_exec_t *ex, const dg_node_t *n) {
    return BE->ops->memset0(BE, P(n->upd[0]), n->upd[0]->nbytes);
}

static int frozen(const dg_exec_t *ex, const dg_node_t *t) {
    int i = t->param_index;
    return ex->rt.frozen && i >= 0 && i < ex->rt.n_frozen_slots && ex->rt.frozen[i];
}

static dg_status_t ex_sumsq(dg_exec_t *ex, const dg_node_t *n) {
    if (frozen(ex, n->src[0])) return DG_OK;
    return BE->ops->sumsq_f32(BE, (float *)P(n->upd[0]) + DG_SCALAR_SUMSQ, P(n->src[0]),
                              dg_node_numel(n->src[0]));
}

/* The sum of squares of every gradient in one backend call, accumulated as the SUMSQ ops it replaced
 * would (bitwise: the backend contract). The table is staged here with the frozen set of the moment (as
 * ex_sumsq checks it at each call) and uploaded into the leaf on the same queue; recorded in a CUDA Graph,
 * every replay copies what the page-locked mirror holds then, which dg_model_optimizer_step stages
 * before it replays. The flat gradient is read here, in the OPT phase: every gradient collective of the
 * backward has been waited for by then (waits inside BWD, the phase drained), and the optimizer-phase
 * ones (tp-rank-0 gradients over tp) run blocking on the compute stream before this node. */
static dg_status_t ex_sumsq_all(dg_exec_t *ex, const dg_node_t *n) {
    int ns = ex->graph->n_norm_segs;
    void *tab = P(n->src[1]);
    dg_exec_stage_segs(ex);
    DG_TRY(BE->ops->upload_async(BE, tab, ex->norm_seg_host, (size_t)ns * sizeof(dg_sumsq_seg_t)));
    return BE->ops->sumsq_multi(BE, (float *)P(n->upd[0]) + DG_SCALAR_SUMSQ, P(n->src[0]),
                                dg_node_numel(n->src[0]), ex->norm_seg_host, tab, ns);
}

static dg_status_t ex_clip_scale(dg_exec_t *ex, const dg_node_t *n) {
    float *s = P(n->upd[0]);
    DG_TRY(BE->ops->clip_scale(BE, s + DG_SCALAR_GSCALE, s + DG_SCALAR_NORM, s + DG_SCALAR_SUMSQ,
                               ex->rt.grad_clip, ex->rt.grad_extra));
    /* the step's lr and bias corrections into the scalar block, for adamw_dev; recorded in a CUDA
     * Graph, the upload copies whatever the mirror holds at each replay (dg_exec_stage_scalars) */
    DG_TRY(dg_exec_stage_scalars(ex));
    return BE->ops->upload_async(BE, s + DG_DS_LR, ex->sc_host + DG_DS_LR,
                                 (DG_DS_INV_BC2 - DG_DS_LR + 1) * sizeof(float));
}

static dg_status_t ex_adamw(dg_exec_t *ex, const dg_node_t *n) {
    if (frozen(ex, n->upd[0])) return DG_OK;
    float *master = P(n->upd[0]);
    void *param = P(n->upd[3]);
    const float *sc = P(n->src[1]);
    const dg_runtime_t *rt = &ex->rt;
    /* lr and bias corrections from the scalar block (CLIP_SCALE uploaded them): nothing of the step
     * count is baked into the launch, so a recorded graph replays correctly at every step */
    return BE->ops->adamw_dev(BE, master, param == (void *)master ? NULL : param, P(n->src[0]), P(n->upd[1]),
                              P(n->upd[2]), dg_node_numel(n->src[0]), rt->beta1, rt->beta2, rt->eps,
                              n->attr[DG_A_DECAY] ? rt->weight_decay : 0.0f, sc);
}

/* One backend call for every parameter. The segment table with this step's frozen set (staged on the
 * host by dg_exec_stage_scalars) is uploaded into the table leaf first, on the same queue: recorded in a
 * CUDA Graph, every replay copies what the page-locked mirror holds then, like CLIP_SCALE's scalars. */
static dg_status_t ex_adamw_all(dg_exec_t *ex, const dg_node_t *n) {
    const dg_runtime_t *rt = &ex->rt;
    int ns = ex->graph->n_opt_segs;
    void *tab = P(n->src[2]);
    DG_TRY(BE->ops->upload_async(BE, tab, ex->seg_host, (size_t)ns * sizeof(dg_adamw_seg_t)));
    float *master = P(n->upd[0]);
    void *param = P(n->upd[3]);
    return BE->ops->adamw_multi_dev(
        BE, tab, ns, dg_node_numel(n->upd[0]), master, param == (void *)master ? NULL : param, P(n->src[0]),
        P(n->upd[1]), P(n->upd[2]), rt->beta1, rt->beta2, rt->eps, rt->weight_decay, P(n->src[1]));
}

/* Collectives go through the executor's comm layer (exec.c): posted non-blocking on the comm stream,
 * run to completion on the compute stream; copies over a mesh dimension of size 1. */
static dg_status_t ex_collective(dg_exec_t *ex, const dg_node_t *n) {
    return dg_exec_collective(ex, n);
}

static dg_status_t ex_fill0(dg_exec_t *ex, const dg_node_t *n) {
    return BE->ops->memset0(BE, P(n), n->nbytes);
}

/* rows of rank r's piece that exist in the unsharded tensor (the last ranks' may be short or empty) */
static int64_t piece_rows(int64_t R, int64_t Rs, int64_t r) {
    int64_t lo = r * Rs, hi = lo + Rs < R ? lo + Rs : R;
    return hi > lo ? hi - lo : 0;
}

static dg_status_t ex_shard_pack(dg_exec_t *ex, const dg_node_t *n) {
    const dg_node_t *x = n->src[0];
    int64_t k = n->attr[DG_A_K], S = n->attr[DG_A_S], off = n->attr[DG_A_OFF], Rs = n->attr[DG_A_RS];
    int64_t R = rows_of(x), cols = cols_of(x);
    char *out = P(n);
    const char *in = P(x);
    /* the first piece clears the whole buffer: padding rows and alignment gaps must reduce to zeros */
    if (!n->attr[DG_A_ACC]) DG_TRY(BE->ops->memset0(BE, out, n->nbytes));
    for (int64_t r = 0; r < k; r++) {
        int64_t rows = piece_rows(R, Rs, r);
        if (rows)
            DG_TRY(BE->ops->copy(BE, out + (size_t)(r * S + off) * 4, in + (size_t)(r * Rs * cols) * 4,
                                 (size_t)(rows * cols) * 4));
    }
    return DG_OK;
}

static dg_status_t ex_shard_unpack(dg_exec_t *ex, const dg_node_t *n) {
    int64_t k = n->attr[DG_A_K], S = n->attr[DG_A_S], off = n->attr[DG_A_OFF], Rs = n->attr[DG_A_RS];
    int64_t R = n->shape[0], cols = n->attr[DG_A_COLS] ? n->attr[DG_A_COLS] : 1;
    size_t es = dg_dtype_size(n->dtype);
    char *out = P(n);
    const char *in = P(n->src[0]);
    for (int64_t r = 0; r < k; r++) {
        int64_t rows = piece_rows(R, Rs, r);
        if (rows)
            DG_TRY(BE->ops->copy(BE, out + (size_t)(r * Rs * cols) * es, in + (size_t)(r * S + off) * es,
                                 (size_t)(rows * cols) * es));
    }
    return DG_OK;
}

static dg_status_t ex_cast(dg_exec_t *ex, const dg_node_t *n) {
    const dg_node_t *x = n->src[0];
    dg_dtype_t dt = (dg_dtype_t)n->attr[DG_A_DTYPE];
    size_t cnt = dg_node_numel(x);
    if (n->n_upd == 0) return BE->ops->cast(BE, P(n), dt, P(x), x->dtype, cnt);
    if (!n->attr[DG_A_ACC]) return BE->ops->cast(BE, P(n->upd[0]), dt, P(x), x->dtype, cnt);
    DG_TRY(BE->ops->cast(BE, P(n), DG_F32, P(x), x->dtype, cnt));
    return BE->ops->add_f32(BE, P(n->upd[0]), P(n), cnt);
}

/* the executor completes the waited-on requests before running any node with wait edges */
static dg_status_t ex_wait(dg_exec_t *ex, const dg_node_t *n) {
    (void)ex;
    (void)n;
    return DG_OK;
}

/* ================= the table ================= */

/* KERN(e): backend entry e is one that the op's exec function calls (dg_op_missing_kernel: the executor's
 * host fallback runs an op on the host when one is NULL). Collectives list none: they run through the comm
 * layer (exec.c), and over a mesh dimension of size 1 use copy / add_f32, which every backend has. */
/* one row per op kind, kept on as few lines as fit (not clang-format's one field per line) */
/* clang-format off */
#define KERN(e) {offsetof(dg_backend_ops_t, e), #e}
static const dg_op_def_t op_table[DG_OP_COUNT] = {
    [DG_OP_LEAF] = {DG_OP_LEAF, "leaf", 0, 0, NULL, DG_GRAD_STRUCTURAL, NULL, NULL, 0, 0, {}},
    [DG_OP_SIDE] = {DG_OP_SIDE, "side", 1, 1, NULL, DG_GRAD_STRUCTURAL, NULL, NULL, 0, 0, {}},
    [DG_OP_ENCODER] = {DG_OP_ENCODER, "encoder", 3, 3, shape_encoder, DG_GRAD_BUILDER, bwd_encoder,
                       ex_encoder, 0, 0, {KERN(encoder_fwd)}},
    [DG_OP_LAYERNORM] = {DG_OP_LAYERNORM, "layernorm", 3, 3, shape_layernorm, DG_GRAD_BUILDER, bwd_layernorm,
                         ex_layernorm, 0, 0, {KERN(layernorm_fwd)}},
    [DG_OP_MATMUL] = {DG_OP_MATMUL, "matmul", 2, 3, shape_matmul, DG_GRAD_BUILDER, bwd_matmul, ex_matmul, 0,
                      0, {KERN(matmul_fwd)}},
    [DG_OP_GELU] = {DG_OP_GELU, "gelu", 1, 1, shape_gelu, DG_GRAD_BUILDER, bwd_gelu, ex_gelu, 0, 0, {KERN(gelu_fwd)}},
    [DG_OP_ATTENTION] = {DG_OP_ATTENTION, "attention", 1, 1, shape_attention, DG_GRAD_BUILDER, bwd_attention,
                         ex_attention, 0, 0, {KERN(attention_fwd)}},
    [DG_OP_ADD] = {DG_OP_ADD, "add", 2, 2, shape_add, DG_GRAD_BUILDER, bwd_add, ex_add, 0x3, 0, {KERN(add)}},
    [DG_OP_CROSSENTROPY] = {DG_OP_CROSSENTROPY, "crossentropy", 2, 2, shape_crossentropy, DG_GRAD_BUILDER,
                            bwd_crossentropy, ex_crossentropy, 0, 0, {KERN(crossentropy_fwd)}},
    /* the kernel allows the output to overwrite the residual (the residual stream updated in place) */
    [DG_OP_MATMUL_RES] = {DG_OP_MATMUL_RES, "matmul_res", 3, 4, shape_matmul_res, DG_GRAD_BUILDER,
                          bwd_matmul_res, ex_matmul_res, 0x4, 0, {KERN(matmul_fwd_res)}},
    [DG_OP_ENCODER_BWD] = {DG_OP_ENCODER_BWD, "encoder_bwd", 2, 2, shape_encoder_bwd, DG_GRAD_NONE, NULL,
                           ex_encoder_bwd, 0, 0, {KERN(encoder_bwd)}},
    [DG_OP_LAYERNORM_BWD] = {DG_OP_LAYERNORM_BWD, "layernorm_bwd", 5, 6, shape_layernorm_bwd, DG_GRAD_NONE,
                             NULL, ex_layernorm_bwd, 0, 0, {KERN(layernorm_bwd)}},
    [DG_OP_MATMUL_BWD] = {DG_OP_MATMUL_BWD, "matmul_bwd", 3, 4, shape_matmul_bwd, DG_GRAD_NONE, NULL,
                          ex_matmul_bwd, 0, 0, {KERN(matmul_bwd)}},
    [DG_OP_GELU_BWD] = {DG_OP_GELU_BWD, "gelu_bwd", 2, 3, shape_gelu_bwd, DG_GRAD_NONE, NULL, ex_gelu_bwd, 0,
                        0, {KERN(gelu_bwd)}},
    /* the kernel takes the weight gradient before it writes dpre: dpre may take over the GELU output */
    [DG_OP_MATMUL_BWD_DGELU] = {DG_OP_MATMUL_BWD_DGELU, "matmul_bwd_dgelu", 4, 5, shape_matmul_bwd_dgelu,
                                DG_GRAD_NONE, NULL, ex_matmul_bwd_dgelu, 0x2, 0, {KERN(matmul_bwd_dgelu)}},
    [DG_OP_ATTENTION_BWD] = {DG_OP_ATTENTION_BWD, "attention_bwd", 4, 4, shape_attention_bwd, DG_GRAD_NONE,
                             NULL, ex_attention_bwd, 0, 0, {KERN(attention_bwd)}},
    /* the kernel allows dlogits to overwrite logits */
    [DG_OP_CROSSENTROPY_BWD] = {DG_OP_CROSSENTROPY_BWD, "crossentropy_bwd", 3, 3, shape_crossentropy_bwd,
                                DG_GRAD_NONE, NULL, ex_crossentropy_bwd, 0x1, 0, {KERN(crossentropy_bwd)}},
    /* created after autodiff (never differentiated); the kernel allows dlogits to overwrite logits */
    [DG_OP_CROSSENTROPY_FUSED] = {DG_OP_CROSSENTROPY_FUSED, "crossentropy_fused", 2, 2,
                                  shape_crossentropy_fused, DG_GRAD_NONE, NULL, ex_crossentropy_fused, 0x1,
                                  0, {KERN(crossentropy_fused), KERN(crossentropy_fwd)}},
    [DG_OP_ACCUMULATE] = {DG_OP_ACCUMULATE, "accumulate", 2, 2, shape_accumulate, DG_GRAD_NONE, NULL,
                          ex_accumulate, 0, 0, {KERN(accumulate)}},
    [DG_OP_ZERO] = {DG_OP_ZERO, "zero", 0, 0, shape_zero, DG_GRAD_NONE, NULL, ex_zero, 0, 0, {KERN(memset0)}},
    [DG_OP_SUMSQ] = {DG_OP_SUMSQ, "sumsq", 1, 1, shape_sumsq, DG_GRAD_NONE, NULL, ex_sumsq, 0, 0, {KERN(sumsq_f32)}},
    [DG_OP_SUMSQ_ALL] = {DG_OP_SUMSQ_ALL, "sumsq_all", 2, 2, shape_sumsq_all, DG_GRAD_NONE, NULL,
                         ex_sumsq_all, 0, 0, {KERN(sumsq_multi), KERN(upload_async)}},
    [DG_OP_CLIP_SCALE] = {DG_OP_CLIP_SCALE, "clip_scale", 0, 0, shape_clip_scale, DG_GRAD_NONE, NULL,
                          ex_clip_scale, 0, 0, {KERN(clip_scale), KERN(upload_async)}},
    [DG_OP_ADAMW] = {DG_OP_ADAMW, "adamw", 2, 2, shape_adamw, DG_GRAD_NONE, NULL, ex_adamw, 0, 0, {KERN(adamw_dev)}},
    [DG_OP_ADAMW_ALL] = {DG_OP_ADAMW_ALL, "adamw_all", 3, 3, shape_adamw_all, DG_GRAD_NONE, NULL,
                         ex_adamw_all, 0, 0, {KERN(adamw_multi_dev), KERN(upload_async)}},
    [DG_OP_ALL_GATHER] = {DG_OP_ALL_GATHER, "all_gather", 1, 1, shape_all_gather, DG_GRAD_BUILDER,
                          bwd_all_gather, ex_collective, 0, 1, {}},
    [DG_OP_REDUCE_SCATTER] = {DG_OP_REDUCE_SCATTER, "reduce_scatter", 1, 1, shape_reduce_scatter,
                              DG_GRAD_BUILDER, bwd_reduce_scatter, ex_collective, 0, 1, {}},
    [DG_OP_ALL_REDUCE] = {DG_OP_ALL_REDUCE, "all_reduce", 0, 1, shape_all_reduce, DG_GRAD_BUILDER,
                          bwd_all_reduce, ex_collective, 0x1, 1, {}},
    [DG_OP_FILL0] = {DG_OP_FILL0, "fill0", 0, 0, shape_fill0, DG_GRAD_NONE, NULL, ex_fill0, 0, 0, {KERN(memset0)}},
    [DG_OP_SHARD_PACK] = {DG_OP_SHARD_PACK, "shard_pack", 1, 2, shape_shard_pack, DG_GRAD_NONE, NULL,
                          ex_shard_pack, 0, 0, {KERN(memset0), KERN(copy)}},
    [DG_OP_SHARD_UNPACK] = {DG_OP_SHARD_UNPACK, "shard_unpack", 1, 1, shape_shard_unpack, DG_GRAD_NONE, NULL,
                            ex_shard_unpack, 0, 0, {KERN(copy)}},
    [DG_OP_WAIT] = {DG_OP_WAIT, "wait", 0, 0, shape_wait, DG_GRAD_NONE, NULL, ex_wait, 0, 0, {}},
    /* inserted by passes around the gradient reductions only: never differentiated */
    [DG_OP_CAST] = {DG_OP_CAST, "cast", 1, 1, shape_cast, DG_GRAD_NONE, NULL, ex_cast, 0, 0,
                    {KERN(cast), KERN(add_f32)}},
};
/* clang-format on */
#undef KERN

const dg_op_def_t *dg_op_def(dg_op_kind_t kind) {
    DG_ASSERTF(kind >= 0 && kind < DG_OP_COUNT && op_table[kind].name != NULL, "unknown op kind %d",
               (int)kind);
    DG_ASSERT(op_table[kind].kind == kind);
    return &op_table[kind];
}

const char *dg_op_name(dg_op_kind_t kind) {
    return (kind >= 0 && kind < DG_OP_COUNT && op_table[kind].name) ? op_table[kind].name : "?";
}

/* ================= kernels per op kind ================= */

const char *dg_op_missing_kernel(const dg_backend_t *be, dg_op_kind_t op) {
    const dg_op_def_t *d = dg_op_def(op);
    for (int k = 0; k < DG_OP_MAX_KERNELS && d->kernels[k].name; k++) {
        void (*const *entry)(void) = (void (*const *)(void))((const char *)be->ops + d->kernels[k].offset);
        if (*entry == NULL) return d->kernels[k].name;
    }
    return NULL;
}

/* ================= typed constructors ================= */

dg_node_t *dg_op_encoder(dg_graph_t *g, const char *name, dg_node_t *tokens, dg_node_t *wte, dg_node_t *wpe) {
    dg_node_t *src[3] = {tokens, wte, wpe};
    return dg_graph_add_op(g, DG_OP_ENCODER, name, 3, src, 0, NULL, NULL, 0);
}

dg_node_t *dg_op_layernorm(dg_graph_t *g, const char *name, dg_node_t *x, dg_node_t *w, dg_node_t *b) {
    dg_node_t *src[3] = {x, w, b};
    return dg_graph_add_op(g, DG_OP_LAYERNORM, name, 3, src, 0, NULL, NULL, 0);
}

dg_node_t *dg_op_matmul(dg_graph_t *g, const char *name, dg_node_t *x, dg_node_t *w, dg_node_t *bias) {
    dg_node_t *src[3] = {x, w, bias};
    return dg_graph_add_op(g, DG_OP_MATMUL, name, bias ? 3 : 2, src, 0, NULL, NULL, 0);
}

dg_node_t *dg_op_gelu(dg_graph_t *g, const char *name, dg_node_t *x) {
    return dg_graph_add_op(g, DG_OP_GELU, name, 1, &x, 0, NULL, NULL, 0);
}

dg_node_t *dg_op_attention(dg_graph_t *g, const char *name, dg_node_t *qkv, int n_head) {
    int64_t attr[2] = {0, n_head};
    return dg_graph_add_op(g, DG_OP_ATTENTION, name, 1, &qkv, 0, NULL, attr, 2);
}

dg_node_t *dg_op_add(dg_graph_t *g, const char *name, dg_node_t *a, dg_node_t *b) {
    dg_node_t *src[2] = {a, b};
    return dg_graph_add_op(g, DG_OP_ADD, name, 2, src, 0, NULL, NULL, 0);
}

dg_node_t *dg_op_matmul_res(dg_graph_t *g, const char *name, dg_node_t *x, dg_node_t *w, dg_node_t *bias,
                            dg_node_t *res) {
    dg_node_t *src[4] = {x, w, res, bias};
    return dg_graph_add_op(g, DG_OP_MATMUL_RES, name, bias ? 4 : 3, src, 0, NULL, NULL, 0);
}

dg_node_t *dg_op_crossentropy(dg_graph_t *g, const char *name, dg_node_t *logits, dg_node_t *targets, int V) {
    dg_node_t *src[2] = {logits, targets};
    int64_t attr[2] = {0, V};
    return dg_graph_add_op(g, DG_OP_CROSSENTROPY, name, 2, src, 0, NULL, attr, 2);
}

/* Collectives start on the compute stream; the overlap pass (docs/fsdp.md) moves them to the comm stream
 * and adds the wait edges. */
static dg_node_t *collective(dg_graph_t *g, dg_op_kind_t k, const char *name, dg_node_t *x, int mesh_dim) {
    int64_t attr[2] = {0, mesh_dim};
    return dg_graph_add_op(g, k, name, 1, &x, 0, NULL, attr, 2);
}

dg_node_t *dg_op_all_gather(dg_graph_t *g, const char *name, dg_node_t *x, int mesh_dim) {
    return collective(g, DG_OP_ALL_GATHER, name, x, mesh_dim);
}

dg_node_t *dg_op_reduce_scatter(dg_graph_t *g, const char *name, dg_node_t *x, int mesh_dim) {
    return collective(g, DG_OP_REDUCE_SCATTER, name, x, mesh_dim);
}

dg_node_t *dg_op_all_reduce(dg_graph_t *g, const char *name, dg_node_t *x, int mesh_dim) {
    return collective(g, DG_OP_ALL_REDUCE, name, x, mesh_dim);
}

dg_node_t *dg_op_all_reduce_mode(dg_graph_t *g, const char *name, dg_node_t *x, int mesh_dim,
                                 dg_armode_t mode) {
    int64_t attr[3] = {0, mesh_dim, mode};
    return dg_graph_add_op(g, DG_OP_ALL_REDUCE, name, 1, &x, 0, NULL, attr, 3);
}
