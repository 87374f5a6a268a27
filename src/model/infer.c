/* infer.c — the KV-cache GPT-2 decoder of dg_infer.h: parameters, per-layer caches and a forward over a
 * block of positions, written against the backend vtable only (CPU and CUDA run this same code). */
#include "dg_infer.h"

#include <stdlib.h>
#include <string.h>

enum { L_LN1W, L_LN1B, L_QKVW, L_QKVB, L_PROJW, L_PROJB, L_LN2W, L_LN2B, L_FCW, L_FCB, L_MPW, L_MPB, L_N };
static const char *const k_layer_names[L_N] = {
    "ln_1.weight", "ln_1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
    "ln_2.weight", "ln_2.bias", "mlp.fc.weight",   "mlp.fc.bias",   "mlp.proj.weight",  "mlp.proj.bias"};

struct dg_infer {
    dg_backend_t *be;
    dg_model_desc_t d;
    int flags, np, pos;
    size_t es;                                /* bytes per act element */
    char **names;                             /* np parameter names */
    size_t *numel;                            /* np element counts */
    void **w;                                 /* np device tensors (act) */
    void **kc, **vc;                          /* per layer [seq_len, C] (act) */
    void *x, *h, *qkv, *att, *tmp, *pre, *fc; /* activations, seq_len rows */
    void *logits;                             /* act [rows, Vp]; rows = seq_len with ALL_LOGITS, else 1 */
    float *logits32;                          /* f32 copy when act is not f32 (else NULL) */
    float *mean, *rstd;                       /* f32 [seq_len] */
    int32_t *tok;                             /* device [seq_len] */
    void *aux;                                /* attention_fwd's aux for seq_len (recompute only, lazily) */
    float *stage;                             /* device f32 staging of the largest tensor (lazily) */
    float *host_logits;                       /* host [rows, Vp] */
    int rows;
};

static int p_layer(int l, int k) {
    return 2 + l * L_N + k;
}

static dg_status_t dev_alloc(dg_infer_t *e, size_t bytes, void **out) {
    DG_TRY(e->be->ops->alloc(e->be, bytes ? bytes : 1, out));
    return e->be->ops->memset0(e->be, *out, bytes ? bytes : 1);
}

static void add_param(dg_infer_t *e, const char *name, size_t numel) {
    e->names[e->np] = dg_xstrdup(name);
    e->numel[e->np++] = numel;
}

static dg_status_t alloc_params(dg_infer_t *e) {
    const size_t C = (size_t)e->d.d_model;
    const int L = e->d.n_layer;
    const size_t lsz[L_N] = {C, C, 3 * C * C, 3 * C, C * C, C, C, C, 4 * C * C, 4 * C, 4 * C * C, C};
    int n = 2 + L * L_N + 2;
    e->names = dg_xcalloc((size_t)n, sizeof *e->names);
    e->numel = dg_xcalloc((size_t)n, sizeof *e->numel);
    e->w = dg_xcalloc((size_t)n, sizeof *e->w);
    add_param(e, "wte", (size_t)e->d.padded_vocab * C);
    add_param(e, "wpe", (size_t)e->d.seq_len * C);
    char nm[96];
    for (int l = 0; l < L; l++)
        for (int k = 0; k < L_N; k++) {
            dg_fmt(nm, sizeof nm, "h.%d.%s", l, k_layer_names[k]);
            add_param(e, nm, lsz[k]);
        }
    add_param(e, "ln_f.weight", C);
    add_param(e, "ln_f.bias", C);
    for (int i = 0; i < e->np; i++)
        DG_TRY(dev_alloc(e, e->numel[i] * e->es, &e->w[i]));
    return DG_OK;
}

static dg_status_t alloc_buffers(dg_infer_t *e) {
    const size_t C = (size_t)e->d.d_model, S = (size_t)e->d.seq_len, es = e->es;
    const int L = e->d.n_layer;
    e->kc = dg_xcalloc((size_t)L, sizeof *e->kc);
    e->vc = dg_xcalloc((size_t)L, sizeof *e->vc);
    for (int l = 0; l < L; l++) {
        DG_TRY(dev_alloc(e, S * C * es, &e->kc[l]));
        DG_TRY(dev_alloc(e, S * C * es, &e->vc[l]));
    }
    DG_TRY(dev_alloc(e, S * C * es, &e->x));
    DG_TRY(dev_alloc(e, S * C * es, &e->h));
    DG_TRY(dev_alloc(e, S * 3 * C * es, &e->qkv));
    DG_TRY(dev_alloc(e, S * C * es, &e->att));
    DG_TRY(dev_alloc(e, S * C * es, &e->tmp));
    DG_TRY(dev_alloc(e, S * 4 * C * es, &e->pre));
    DG_TRY(dev_alloc(e, S * 4 * C * es, &e->fc));
    e->rows = (e->flags & DG_INFER_ALL_LOGITS) ? (int)S : 1;
    const size_t lg = (size_t)e->rows * (size_t)e->d.padded_vocab;
    DG_TRY(dev_alloc(e, lg * es, &e->logits));
    if (e->be->act_dtype != DG_F32) DG_TRY(dev_alloc(e, lg * sizeof(float), (void **)&e->logits32));
    DG_TRY(dev_alloc(e, S * sizeof(float), (void **)&e->mean));
    DG_TRY(dev_alloc(e, S * sizeof(float), (void **)&e->rstd));
    DG_TRY(dev_alloc(e, S * sizeof(int32_t), (void **)&e->tok));
    e->host_logits = dg_xmalloc(lg * sizeof(float));
    return DG_OK;
}

dg_status_t dg_infer_create(const dg_model_desc_t *d, dg_backend_t *be, int flags, dg_infer_t **out) {
    *out = NULL;
    DG_TRY(dg_model_desc_validate(d));
    if (!be->ops->attention_kv_fwd)
        return DG_ERR(DG_ERR_USAGE,
                      "backend %s has no attention_kv_fwd (contract v1.12): cannot decode with a "
                      "KV cache",
                      be->ops->name);
    dg_infer_t *e = dg_xcalloc(1, sizeof *e);
    e->be = be;
    e->d = *d;
    e->flags = flags;
    e->es = dg_dtype_size(be->act_dtype);
    dg_status_t s = alloc_params(e);
    if (s == DG_OK) s = alloc_buffers(e);
    if (s == DG_OK)
        *out = e;
    else
        dg_infer_free(e);
    return s;
}

void dg_infer_free(dg_infer_t *e) {
    if (!e) return;
    dg_backend_t *be = e->be;
    for (int i = 0; i < e->np; i++) {
        if (e->w[i]) be->ops->free(be, e->w[i]);
        free(e->names[i]);
    }
    for (int l = 0; e->kc && l < e->d.n_layer; l++) {
        if (e->kc[l]) be->ops->free(be, e->kc[l]);
        if (e->vc[l]) be->ops->free(be, e->vc[l]);
    }
    void *bufs[] = {e->x,      e->h,        e->qkv,  e->att,  e->tmp, e->pre, e->fc,
                    e->logits, e->logits32, e->mean, e->rstd, e->tok, e->aux, e->stage};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        if (bufs[i]) be->ops->free(be, bufs[i]);
    DG_FREE_ALL(e->names, e->numel, e->w, e->kc, e->vc, e->host_logits, e);
}

int dg_infer_n_tensors(const dg_infer_t *e) {
    return e->np;
}
const char *dg_infer_tensor_name(const dg_infer_t *e, int i) {
    return i >= 0 && i < e->np ? e->names[i] : NULL;
}
size_t dg_infer_tensor_numel(const dg_infer_t *e, int i) {
    return i >= 0 && i < e->np ? e->numel[i] : 0;
}
const dg_model_desc_t *dg_infer_desc(const dg_infer_t *e) {
    return &e->d;
}
int dg_infer_pos(const dg_infer_t *e) {
    return e->pos;
}
void dg_infer_reset(dg_infer_t *e) {
    e->pos = 0;
}

dg_status_t dg_infer_set_tensor(dg_infer_t *e, int i, const float *host) {
    if (i < 0 || i >= e->np)
        return DG_ERR(DG_ERR_USAGE, "inference tensor index %d out of range [0, %d)", i, e->np);
    dg_backend_t *be = e->be;
    const size_t n = e->numel[i];
    if (be->act_dtype == DG_F32) return be->ops->to_device(be, e->w[i], host, n * sizeof(float));
    if (!e->stage) {
        size_t mx = 0;
        for (int k = 0; k < e->np; k++)
            if (e->numel[k] > mx) mx = e->numel[k];
        DG_TRY(be->ops->alloc(be, mx * sizeof(float), (void **)&e->stage));
    }
    DG_TRY(be->ops->to_device(be, e->stage, host, n * sizeof(float)));
    DG_TRY(be->ops->cast(be, e->w[i], be->act_dtype, e->stage, DG_F32, n));
    return be->ops->sync(be); /* the staging buffer is reused by the next call */
}

static void *rows_at(const dg_infer_t *e, void *base, size_t row, size_t width) {
    return (char *)base + row * width * e->es;
}

/* One transformer block over n rows at positions [p0, p0 + n). */
static dg_status_t block(dg_infer_t *e, int l, int p0, int n, int use_cache) {
    dg_backend_t *be = e->be;
    const dg_backend_ops_t *o = be->ops;
    const int C = e->d.d_model, NH = e->d.n_head, S = e->d.seq_len;
    void *const *w = e->w;
    DG_TRY(o->layernorm_fwd(be, e->h, e->mean, e->rstd, e->x, w[p_layer(l, L_LN1W)], w[p_layer(l, L_LN1B)], n,
                            C));
    DG_TRY(o->matmul_fwd(be, e->qkv, NULL, e->h, w[p_layer(l, L_QKVW)], w[p_layer(l, L_QKVB)], n, C, 3 * C,
                         DG_EPI_NONE));
    if (use_cache)
        DG_TRY(o->attention_kv_fwd(be, e->att, e->kc[l], e->vc[l], e->qkv, p0, n, S, C, NH));
    else
        DG_TRY(o->attention_fwd(be, e->att, e->aux, e->qkv, 1, n, C, NH));
    DG_TRY(o->matmul_fwd(be, e->tmp, NULL, e->att, w[p_layer(l, L_PROJW)], w[p_layer(l, L_PROJB)], n, C, C,
                         DG_EPI_NONE));
    DG_TRY(o->add(be, e->x, e->x, e->tmp, (size_t)n * C));
    DG_TRY(o->layernorm_fwd(be, e->h, e->mean, e->rstd, e->x, w[p_layer(l, L_LN2W)], w[p_layer(l, L_LN2B)], n,
                            C));
    DG_TRY(o->matmul_fwd(be, e->pre, NULL, e->h, w[p_layer(l, L_FCW)], w[p_layer(l, L_FCB)], n, C, 4 * C,
                         DG_EPI_NONE));
    DG_TRY(o->gelu_fwd(be, e->fc, e->pre, (size_t)n * 4 * C));
    DG_TRY(o->matmul_fwd(be, e->tmp, NULL, e->fc, w[p_layer(l, L_MPW)], w[p_layer(l, L_MPB)], n, 4 * C, C,
                         DG_EPI_NONE));
    return o->add(be, e->x, e->x, e->tmp, (size_t)n * C);
}

/* The final layernorm and the tied head over rows [r0, r0 + nr) of x; logits to the host (V of Vp). */
static dg_status_t head(dg_infer_t *e, int r0, int nr, float *out) {
    dg_backend_t *be = e->be;
    const dg_backend_ops_t *o = be->ops;
    const int C = e->d.d_model, V = e->d.vocab_size, Vp = e->d.padded_vocab, L = e->d.n_layer;
    DG_TRY(o->layernorm_fwd(be, e->h, e->mean, e->rstd, rows_at(e, e->x, (size_t)r0, (size_t)C),
                            e->w[p_layer(L, 0)], e->w[p_layer(L, 0) + 1], nr, C));
    DG_TRY(o->matmul_fwd(be, e->logits, NULL, e->h, e->w[0], NULL, nr, C, Vp, DG_EPI_NONE));
    if (!out) return o->sync(be);
    const size_t cnt = (size_t)nr * Vp;
    const void *src = e->logits;
    if (e->logits32) {
        DG_TRY(o->cast(be, e->logits32, DG_F32, e->logits, be->act_dtype, cnt));
        src = e->logits32;
    }
    DG_TRY(o->to_host(be, e->host_logits, src, cnt * sizeof(float)));
    for (int r = 0; r < nr; r++)
        memcpy(out + (size_t)r * V, e->host_logits + (size_t)r * Vp, (size_t)V * sizeof(float));
    return DG_OK;
}

static dg_status_t check_ids(const dg_infer_t *e, const int32_t *ids, int n, int p0) {
    if (n < 1) return DG_ERR(DG_ERR_USAGE, "inference: %d new positions; expected at least 1", n);
    if (p0 + n > e->d.seq_len)
        return DG_ERR(DG_ERR_USAGE, "inference: positions [%d, %d) exceed the context of seq_len = %d", p0,
                      p0 + n, e->d.seq_len);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= e->d.vocab_size)
            return DG_ERR(DG_ERR_USAGE, "inference: token id %d at position %d is not in [0, %d)",
                          (int)ids[i], p0 + i, e->d.vocab_size);
    return DG_OK;
}

static dg_status_t forward(dg_infer_t *e, const int32_t *ids, int n, int p0, int use_cache, int all_rows,
                           float *logits) {
    dg_backend_t *be = e->be;
    const int C = e->d.d_model;
    DG_TRY(be->ops->to_device(be, e->tok, ids, (size_t)n * sizeof(int32_t)));
    DG_TRY(
        be->ops->encoder_fwd(be, e->x, e->tok, e->w[0], rows_at(e, e->w[1], (size_t)p0, (size_t)C), 1, n, C));
    for (int l = 0; l < e->d.n_layer; l++)
        DG_TRY(block(e, l, p0, n, use_cache));
    return all_rows ? head(e, 0, n, logits) : head(e, n - 1, 1, logits);
}

dg_status_t dg_infer_feed(dg_infer_t *e, const int32_t *ids, int n, int all_rows, float *logits) {
    DG_TRY(check_ids(e, ids, n, e->pos));
    if (all_rows && !(e->flags & DG_INFER_ALL_LOGITS))
        return DG_ERR(DG_ERR_USAGE,
                      "inference: logits of every row need an engine made with DG_INFER_ALL_LOGITS");
    DG_TRY(forward(e, ids, n, e->pos, 1, all_rows, logits));
    e->pos += n;
    return DG_OK;
}

dg_status_t dg_infer_recompute(dg_infer_t *e, const int32_t *ids, int n, float *logits) {
    DG_TRY(check_ids(e, ids, n, 0));
    if (!e->aux) {
        size_t b = e->be->ops->attention_aux_bytes(e->be, 1, e->d.seq_len, e->d.d_model, e->d.n_head);
        DG_TRY(dev_alloc(e, b, &e->aux));
    }
    /* the block's rows of x etc. are scratch, the caches are not touched (attention_fwd reads qkv only) */
    return forward(e, ids, n, 0, 0, 0, logits);
}
