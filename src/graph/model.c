/* model.c — the GPT-2-family model on top of the IR: presets and size checks, the builder that emits
 * the forward graph, the fixed pass pipeline (autodiff -> optimizer -> in-place -> plan), flat storage
 * for parameters/gradients/AdamW moments, deterministic initialisation, and the model-level API of
 * graph.h that the training loop calls.
 */
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm.h"
#include "graph.h"
#include "graph_impl.h"
#include "dg_env.h"

#define PARAM_ALIGN_ELEMS 64 /* 256 bytes of f32: every tensor starts aligned in the flat buffers */

/* Where this rank's piece of a parameter sits in the global tensor.
 * Tensor parallelism: the tp-local tensor is the concatenation, along tp_dim, of n_seg segments of the
 * global tensor (QKV: its q, k and v rows for this rank's heads); tp_dim = -1 means replicated.
 * FSDP: this rank holds rows [row0, row0 + nrows) of the tp-local tensor, stored as Rs rows (the rest
 * zero padding). */
typedef struct {
    int ndim;
    int64_t gshape[2];
    int tp_dim, n_seg;
    int64_t seg_start[3], seg_len[3];
    int tp_rank0_only;    /* replicated over tp, but only tp rank 0 uses it (row-parallel bias) */
    int64_t lrows, lcols; /* tp-local shape (lcols = 1 for vectors) */
    int64_t Rs, row0, nrows;
    size_t local_numel; /* Rs * lcols */
} place_t;

struct dg_model {
    dg_model_desc_t d;
    dg_backend_t *be;
    int B, T, flags;
    uint64_t seed;

    dg_graph_t *g;
    dg_plan_t *plan;
    dg_exec_t *ex;

    int np;
    dg_param_info_t *info;
    char (*names)[64];
    dg_node_t **pnode;
    size_t *off; /* element offset of each tensor in the flat buffers */
    size_t total;

    float *master, *grad, *adam_m, *adam_v;
    void *compute; /* act-dtype copy of the params; NULL when act is f32 (the master is used) */
    int32_t *tokens_dev, *targets_dev;
    float *scalars_dev;

    dg_node_t *tokens, *targets, *losses, *logits, *scalars;
    float *host_losses; /* page-locked (host_alloc): the micro-batch's token losses, B*T */
    /* Host reads without draining the queue (backend contract v1.8): the forward's losses and the
     * optimizer's gradient norm are copied (download_async) at the point where they are final and the
     * host waits on a fence placed right after the copy, not for the backward or the AdamW behind it.
     * async_reads = 0 (a backend without the ops, or DG_SYNC_HOST_READS=1 when the model was created):
     * sync + to_host after each phase, as before. Both give the same bits. */
    int async_reads;
    void *loss_fence, *norm_fence;
    float *host_norm;      /* page-locked: the gradient norm's copy */
    const dg_node_t *clip; /* the OPT phase's CLIP_SCALE (the norm is final after it); NULL: sync path */
    int opt_pending;       /* an optimizer step returned before its AdamW ran (async_reads): the host mirrors
                              that the AdamW's queued uploads read are not free until a later fence or sync */
    unsigned char *frozen; /* per tensor */

    /* distribution */
    dg_model_parallel_t par;
    int tp, tp_rank, k, shard_rank, rep, rep_rank;
    place_t *place;               /* per tensor */
    dg_shard_plan_t *shard;       /* buckets (NULL on one data-parallel rank) */
    int32_t *tok_host, *tgt_host; /* page-locked staging of the micro-batch's ids (upload_async) */
    /* graph replay (dg_model_set_graph_replay) */
    int gr_on, gr_warm;
    void *gr[4];         /* GR_*: instantiated graphs, NULL until recorded */
    float gr_key[4][8];  /* the values each recording baked in */
    int accum, fb_count; /* dg_model_set_grad_accum; forward_backward calls since zero_grad / the step */
    void *gr_agree_dev;  /* one f32 on the device: the recording agreement over nccl comms */
    dg_model_graph_cb_t gr_cb;
    void *gr_ctx;
    /* executor fallbacks (dg_model_set_fallback_cb): reports delivered so far */
    dg_model_fallback_cb_t fb_cb;
    void *fb_ctx;
    int fb_sent;
    /* fused AdamW (pass fuse_adamw) and fused norm (pass fuse_sumsq): the flat leaves they created, and
     * the device segment tables */
    dg_fuse_adamw_t fuse;
    void *segs_dev, *norm_segs_dev;
    int64_t step;   /* dg_model_set_step */
    int stall_rank; /* test hook DG_TEST_STALL_COLLECTIVE_RANK/_STEP (-1: off) */
    int64_t stall_step;
};

static void gr_drop(dg_model_t *m);

/* ---------------- descriptions ---------------- */

static const struct {
    const char *name;
    int n_layer, n_head, d_model, seq_len, vocab_size;
} presets[] = {
    {"tiny", 4, 4, 128, 128, 256},
    {"gpt2-124m", 12, 12, 768, 1024, 50257},
    {"gpt2-350m", 24, 16, 1024, 1024, 50257},
    {"gpt2-774m", 36, 20, 1280, 1024, 50257},
    {"gpt2-1558m", 48, 25, 1600, 1024, 50257},
};
#define N_PRESETS ((int)(sizeof presets / sizeof presets[0]))

static int pad_vocab(int v) {
    return (int)(((int64_t)v + 63) / 64 * 64);
}

dg_status_t dg_model_desc_preset(const char *name, dg_model_desc_t *out) {
    for (int i = 0; i < N_PRESETS; i++) {
        if (strcmp(name, presets[i].name) != 0) continue;
        *out = (dg_model_desc_t){presets[i].n_layer, presets[i].n_head,     presets[i].d_model,
                                 presets[i].seq_len, presets[i].vocab_size, pad_vocab(presets[i].vocab_size)};
        return DG_OK;
    }
    return DG_ERR(
        DG_ERR_USAGE,
        "model.preset = '%s' is unknown; expected tiny, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1558m "
        "or custom",
        name);
}

dg_status_t dg_model_desc_validate(const dg_model_desc_t *d) {
    struct {
        const char *key;
        int v, lo, hi;
    } r[] = {{"n_layer", d->n_layer, 1, 1024},
             {"n_head", d->n_head, 1, 1024},
             {"d_model", d->d_model, 1, 1 << 16},
             {"seq_len", d->seq_len, 1, 1 << 17},
             {"vocab_size", d->vocab_size, 2, 1 << 24}};
    for (size_t i = 0; i < sizeof r / sizeof r[0]; i++)
        if (r[i].v < r[i].lo || r[i].v > r[i].hi)
            return DG_ERR(DG_ERR_USAGE, "model.%s = %d is out of range (expected %d..%d)", r[i].key, r[i].v,
                          r[i].lo, r[i].hi);
    if (d->d_model % d->n_head != 0)
        return DG_ERR(DG_ERR_USAGE, "model.d_model = %d is not divisible by model.n_head = %d", d->d_model,
                      d->n_head);
    if (d->padded_vocab < d->vocab_size || d->padded_vocab > (1 << 24) + 64)
        return DG_ERR(DG_ERR_USAGE,
                      "padded vocabulary %d must be >= model.vocab_size = %d (and <= 2^24 + 64)",
                      d->padded_vocab, d->vocab_size);
    return DG_OK;
}

dg_status_t dg_model_desc_from_config(const dg_config_t *cfg, dg_model_desc_t *out) {
    dg_model_desc_t d = {0};
    int custom = strcmp(cfg->model.preset, "custom") == 0;
    if (!custom) DG_TRY(dg_model_desc_preset(cfg->model.preset, &d));
    struct {
        const char *key;
        int64_t v;
        int *dst;
    } o[] = {{"n_layer", cfg->model.n_layer, &d.n_layer},
             {"n_head", cfg->model.n_head, &d.n_head},
             {"d_model", cfg->model.d_model, &d.d_model},
             {"seq_len", cfg->model.seq_len, &d.seq_len},
             {"vocab_size", cfg->model.vocab_size, &d.vocab_size}};
    char missing[128] = "";
    for (size_t i = 0; i < sizeof o / sizeof o[0]; i++) {
        if (o[i].v < 0 || o[i].v > INT_MAX)
            return DG_ERR(DG_ERR_USAGE, "model.%s = %" PRId64 " is out of range", o[i].key, o[i].v);
        if (o[i].v > 0)
            *o[i].dst = (int)o[i].v;
        else if (custom) {
            size_t l = strlen(missing);
            snprintf(missing + l, sizeof missing - l, "%s%s", l ? ", " : "", o[i].key);
        }
    }
    if (custom && missing[0])
        return DG_ERR(DG_ERR_USAGE, "model.preset = custom needs every size; missing: %s", missing);
    d.padded_vocab = pad_vocab(d.vocab_size);
    DG_TRY(dg_model_desc_validate(&d));
    *out = d;
    return DG_OK;
}

uint64_t dg_model_n_params(const dg_model_desc_t *d) {
    uint64_t C = (uint64_t)d->d_model, L = (uint64_t)d->n_layer;
    uint64_t per_layer = 12 * C * C + 13 * C; /* qkv 3C^2+3C, proj C^2+C, fc 4C^2+4C, proj 4C^2+C, 2 LN 4C */
    return (uint64_t)d->vocab_size * C + (uint64_t)d->seq_len * C + L * per_layer + 2 * C;
}

double dg_model_flops_per_token(const dg_model_desc_t *d) {
    double C = d->d_model, L = d->n_layer, T = d->seq_len;
    double N = (double)d->padded_vocab * C + L * (12.0 * C * C + 13.0 * C) + 2.0 * C;
    return 6.0 * N + 12.0 * L * C * T;
}

/* ---------------- building ---------------- */

static int decay_of(const dg_node_t *p, void *ctx) {
    const dg_model_t *m = ctx;
    return m->info[p->param_index].decay;
}

/* tp placements of the builder */
enum { TP_REPL = 0, TP_ROWS = 1, TP_COLS = 2, TP_QKV = 3, TP_REPL_RANK0 = 4 };

/* A parameter of global shape [r, c] (c unused for vectors) split over tp as `how`; the graph leaf gets
 * the tp-local shape. */
static dg_node_t *add_param_tp(dg_model_t *m, const char *name, int ndim, int64_t r, int64_t c, int decay,
                               int how) {
    place_t pl = {.ndim = ndim, .gshape = {r, ndim == 2 ? c : 1}, .tp_dim = -1, .n_seg = 0};
    int64_t T = m->tp, t = m->tp_rank;
    if (T > 1 && (how == TP_ROWS || how == TP_QKV)) {
        pl.tp_dim = 0;
        int parts = how == TP_QKV ? 3 : 1;
        int64_t blk = r / parts, len = blk / T;
        for (int s = 0; s < parts; s++) {
            pl.seg_start[s] = s * blk + t * len;
            pl.seg_len[s] = len;
        }
        pl.n_seg = parts;
    } else if (T > 1 && how == TP_COLS) {
        pl.tp_dim = 1;
        pl.n_seg = 1;
        pl.seg_len[0] = c / T;
        pl.seg_start[0] = t * pl.seg_len[0];
    }
    pl.tp_rank0_only = T > 1 && how == TP_REPL_RANK0;
    pl.lrows = pl.tp_dim == 0 ? pl.seg_len[0] * pl.n_seg : r;
    pl.lcols = ndim == 2 ? (pl.tp_dim == 1 ? pl.seg_len[0] : c) : 1;
    int64_t shape[2] = {pl.lrows, pl.lcols};
    dg_node_t *p = dg_graph_param(m->g, name, ndim, shape);
    if (!p) return NULL;
    int i = m->np++;
    DG_ASSERT(p->param_index == i);
    p->gshape[0] = r;
    if (ndim == 2) p->gshape[1] = c;
    p->shard_dim = pl.tp_dim;
    if (m->tp_rank != 0 && pl.tp_dim < 0) p->flags |= DG_NF_NORM_SKIP; /* tp rank 0 counts the replica */
    /* FSDP rows of the tp-local tensor (k = 1: all of them) */
    pl.Rs = (pl.lrows + m->k - 1) / m->k;
    pl.row0 = (int64_t)m->shard_rank * pl.Rs;
    int64_t hi = pl.row0 + pl.Rs < pl.lrows ? pl.row0 + pl.Rs : pl.lrows;
    pl.nrows = hi > pl.row0 ? hi - pl.row0 : 0;
    pl.local_numel = (size_t)(pl.Rs * pl.lcols);
    m->place[i] = pl;
    snprintf(m->names[i], sizeof m->names[i], "%s", name);
    m->pnode[i] = p;
    m->info[i] = (dg_param_info_t){
        m->names[i], ndim, {r, ndim == 2 ? c : 0}, (size_t)r * (size_t)(ndim == 2 ? c : 1), decay, pl.tp_dim};
    return p;
}

static dg_node_t *add_param(dg_model_t *m, const char *name, int ndim, int64_t r, int64_t c, int decay) {
    return add_param_tp(m, name, ndim, r, c, decay, TP_REPL);
}

typedef struct {
    dg_node_t *ln1w, *ln1b, *qkvw, *qkvb, *projw, *projb, *ln2w, *ln2b, *fcw, *fcb, *mprojw, *mprojb;
} layer_params_t;

static dg_status_t build_forward(dg_model_t *m) {
    dg_graph_t *g = m->g;
    const dg_model_desc_t *d = &m->d;
    int64_t C = d->d_model, L = d->n_layer;
    int64_t bt[2] = {m->B, m->T};
    char nm[64];
    m->tokens = dg_graph_leaf(g, "tokens", DG_I32, 2, bt, DG_NF_INPUT);
    m->targets = dg_graph_leaf(g, "targets", DG_I32, 2, bt, DG_NF_INPUT);
    dg_node_t *wte = add_param(m, "wte", 2, d->padded_vocab, C, 0);
    dg_node_t *wpe = add_param(m, "wpe", 2, d->seq_len, C, 0);
    layer_params_t *lp = dg_xcalloc((size_t)L, sizeof *lp);
    for (int l = 0; l < L && !g->err; l++) {
#define PN(suffix) (dg_fmt(nm, sizeof nm, "h.%d.%s", l, suffix), nm)
        lp[l].ln1w = add_param(m, PN("ln_1.weight"), 1, C, 0, 0);
        lp[l].ln1b = add_param(m, PN("ln_1.bias"), 1, C, 0, 0);
        lp[l].qkvw = add_param_tp(m, PN("attn.qkv.weight"), 2, 3 * C, C, 1, TP_QKV);
        lp[l].qkvb = add_param_tp(m, PN("attn.qkv.bias"), 1, 3 * C, 0, 0, TP_QKV);
        lp[l].projw = add_param_tp(m, PN("attn.proj.weight"), 2, C, C, 1, TP_COLS);
        lp[l].projb = add_param_tp(m, PN("attn.proj.bias"), 1, C, 0, 0, TP_REPL_RANK0);
        lp[l].ln2w = add_param(m, PN("ln_2.weight"), 1, C, 0, 0);
        lp[l].ln2b = add_param(m, PN("ln_2.bias"), 1, C, 0, 0);
        lp[l].fcw = add_param_tp(m, PN("mlp.fc.weight"), 2, 4 * C, C, 1, TP_ROWS);
        lp[l].fcb = add_param_tp(m, PN("mlp.fc.bias"), 1, 4 * C, 0, 0, TP_ROWS);
        lp[l].mprojw = add_param_tp(m, PN("mlp.proj.weight"), 2, C, 4 * C, 1, TP_COLS);
        lp[l].mprojb = add_param_tp(m, PN("mlp.proj.bias"), 1, C, 0, 0, TP_REPL_RANK0);
    }
    dg_node_t *lnfw = add_param(m, "ln_f.weight", 1, C, 0, 0);
    dg_node_t *lnfb = add_param(m, "ln_f.bias", 1, C, 0, 0);

    /* tp > 1: column-parallel products read the replicated activation through a "from replicate" op
     * (identity; its backward sums the partial input gradients), row-parallel products' partial sums
     * become replicated through a "to replicate" all-reduce; the row-parallel bias is added once (tp
     * rank 0). With tp = 1 the graph is the plain single-rank one. */
    int tpar = m->tp > 1, r0 = m->tp_rank == 0;
    dg_node_t *x = dg_op_encoder(g, "encoder", m->tokens, wte, wpe);
    for (int l = 0; l < L && !g->err; l++) {
        layer_params_t *p = &lp[l];
        dg_node_t *h = dg_op_layernorm(g, PN("ln_1"), x, p->ln1w, p->ln1b);
        if (tpar) h = dg_op_all_reduce_mode(g, PN("attn.tp_in"), h, DG_MESH_TP, DG_AR_FROM_REPLICATE);
        dg_node_t *qkv = dg_op_matmul(g, PN("attn.qkv"), h, p->qkvw, p->qkvb);
        dg_node_t *a = dg_op_attention(g, PN("attn"), qkv, d->n_head / m->tp);
        dg_node_t *pr = dg_op_matmul(g, PN("attn.proj"), a, p->projw, r0 ? p->projb : NULL);
        if (tpar) pr = dg_op_all_reduce_mode(g, PN("attn.tp_out"), pr, DG_MESH_TP, DG_AR_TO_REPLICATE);
        x = dg_op_add(g, PN("res_1"), x, pr);
        dg_node_t *h2 = dg_op_layernorm(g, PN("ln_2"), x, p->ln2w, p->ln2b);
        if (tpar) h2 = dg_op_all_reduce_mode(g, PN("mlp.tp_in"), h2, DG_MESH_TP, DG_AR_FROM_REPLICATE);
        dg_node_t *f = dg_op_matmul(g, PN("mlp.fc"), h2, p->fcw, p->fcb);
        dg_node_t *ge = dg_op_gelu(g, PN("mlp.gelu"), f);
        dg_node_t *mp = dg_op_matmul(g, PN("mlp.proj"), ge, p->mprojw, r0 ? p->mprojb : NULL);
        if (tpar) mp = dg_op_all_reduce_mode(g, PN("mlp.tp_out"), mp, DG_MESH_TP, DG_AR_TO_REPLICATE);
        x = dg_op_add(g, PN("res_2"), x, mp);
#undef PN
    }
    free(lp);
    dg_node_t *xf = dg_op_layernorm(g, "ln_f", x, lnfw, lnfb);
    m->logits = dg_op_matmul(g, "lm_head", xf, wte, NULL); /* tied: logits = xf . wte^T */
    m->losses = dg_op_crossentropy(g, "loss", m->logits, m->targets, d->vocab_size);
    return g->err;
}

static dg_status_t pass_autodiff(dg_graph_t *g, void *ctx) {
    dg_model_t *m = ctx;
    return dg_autodiff(g, 1, &m->losses, NULL);
}

static dg_status_t pass_optimizer(dg_graph_t *g, void *ctx) {
    dg_model_t *m = ctx;
    return dg_graph_add_optimizer(g, decay_of, m, &m->scalars);
}

/* One AdamW op over the flat buffers (backend adamw_multi_dev), unless the backend has none or the
 * per-parameter ops are asked for (DG_MODEL_ADAMW_PER_PARAM, or the test hook DG_TEST_ADAMW_PER_PARAM=1). */
static int adamw_fused(const dg_model_t *m) {
    if (dg_env_bool("DG_TEST_ADAMW_PER_PARAM")) return 0;
    return !(m->flags & DG_MODEL_ADAMW_PER_PARAM) && m->be->ops->adamw_multi_dev != NULL;
}

/* With the fused AdamW (whose flat gradient leaf it reads), the gradient norm is one op too (backend
 * sumsq_multi), unless the backend has none. */
static int sumsq_fused(const dg_model_t *m) {
    return adamw_fused(m) && m->be->ops->sumsq_multi != NULL;
}

/* The classifier loss and its backward as one op (backend crossentropy_fused, pass fuse_crossentropy),
 * unless the two ops are asked for (DG_MODEL_UNFUSED_CE, or the test hook DG_TEST_UNFUSED_CE=1) or the
 * backend has none. */
static int ce_fused(const dg_model_t *m) {
    if (dg_env_bool("DG_TEST_UNFUSED_CE")) return 0;
    return !(m->flags & DG_MODEL_UNFUSED_CE) && m->be->ops->crossentropy_fused != NULL;
}

/* Each residual add and the linear layer before it as one op (backend matmul_fwd_res, pass fuse_residual),
 * unless the pair is asked for (DG_MODEL_UNFUSED_RESID, or the test hook DG_TEST_UNFUSED_RESID=1) or the
 * backend has none. */
static int res_fused(const dg_model_t *m) {
    if (dg_env_bool("DG_TEST_UNFUSED_RESID")) return 0;
    return !(m->flags & DG_MODEL_UNFUSED_RESID) && m->be->ops->matmul_fwd_res != NULL;
}

/* Schedule position right after node x (x's side outputs included), for a node n placed there. */
static void move_after(dg_graph_t *g, dg_node_t *n, const dg_node_t *x) {
    dg_graph_move(g, n, x->id + 1 + x->n_side - (n->id < x->id ? 1 + n->n_side : 0));
}

/* The last op of the backward other than `except` (which may not be in place yet). */
static const dg_node_t *last_bwd_op(const dg_graph_t *g, const dg_node_t *except) {
    const dg_node_t *l = NULL;
    for (int i = 0; i < g->n; i++) {
        const dg_node_t *x = g->nodes[i];
        if (x->phase == DG_PHASE_BWD && x != except && x->op != DG_OP_LEAF && x->op != DG_OP_SIDE) l = x;
    }
    return l;
}

/* The dp_replicate gradient sum (HSDP / DDP), in the backward: per bucket an in-place all-reduce of its
 * flat gradient (shard) on the communication stream, posted as soon as the bucket's gradients are final
 * (after the last backward kernel that accumulates into one of them; with dp_shard > 1 after the wait of
 * the bucket's reduce-scatter, whose accumulate into the shard runs there), so it overlaps the rest of
 * the backward. Waited for at the end of the backward (at once with parallel.overlap = false). Flagged
 * DG_NF_GRAD_SYNC: skipped on the micro-batches of an accumulation that are not the step's last. */
static dg_status_t add_replicate_sync(dg_graph_t *g, dg_model_t *m) {
    const dg_shard_plan_t *sp = m->shard;
    int nb = sp->n_buckets, nar = 0;
    dg_node_t **ars = dg_xcalloc((size_t)nb + 1, sizeof *ars);
    char nm[96];
    dg_phase_t saved = g->cur_phase;
    g->cur_phase = DG_PHASE_BWD;
    for (int j = 0; j < nb && !g->err; j++) {
        const dg_bucket_t *b = &sp->buckets[j];
        dg_node_t *after = NULL;
        for (int i = 0; i < g->n; i++) {
            dg_node_t *x = g->nodes[i];
            if (x->phase != DG_PHASE_BWD || x->op == DG_OP_LEAF || x->op == DG_OP_SIDE) continue;
            if (sp->k > 1) { /* the wait of the reduce-scatter into this bucket's shard */
                if (x->op == DG_OP_WAIT && x->n_wait == 1 && x->wait[0]->op == DG_OP_REDUCE_SCATTER &&
                    x->wait[0]->n_upd == 1 && x->wait[0]->upd[0] == b->gleaf)
                    after = x;
                /* reduce_dtype bf16: the cast that adds the bf16 result into the shard, after that wait */
                if (x->op == DG_OP_CAST && x->n_upd == 1 && x->upd[0] == b->gleaf) after = x;
                continue;
            }
            for (int u = 0; u < x->n_upd; u++)
                for (int p = b->first; p <= b->last; p++)
                    if (x->upd[u] == sp->params[p].p->grad) after = x;
        }
        /* no backward kernel touches this bucket (e.g. tp-rank-0-only biases on another tp rank): the
         * sum still runs, at the end, so that every rank of the group posts the same collectives */
        const dg_node_t *x = after ? after : last_bwd_op(g, NULL);
        DG_ASSERT(x);
        int64_t a[4] = {0, DG_MESH_DP_REPLICATE, DG_AR_SUM, 0};
        dg_node_t *t = b->gleaf, *cast = NULL;
        if (m->par.reduce_dtype != DG_F32) {
            /* reduce in bf16: the bucket's f32 gradients are cast into a bf16 arena temporary, which the
             * all-reduce sums in place; the cast back into the f32 bucket follows the wait (the planner
             * keeps the temporary live from the cast to there) */
            int64_t ca[2] = {0, m->par.reduce_dtype};
            dg_fmt(nm, sizeof nm, "ar.cast.%.80s", b->gleaf->name);
            cast = dg_graph_add_op(g, DG_OP_CAST, nm, 1, &t, 0, NULL, ca, 2);
            if (!cast) break;
            cast->flags |= DG_NF_GRAD_SYNC;
            move_after(g, cast, x);
            x = t = cast;
        }
        dg_fmt(nm, sizeof nm, "ar.grad.%.80s", b->gleaf->name);
        dg_node_t *ar = dg_graph_add_op(g, DG_OP_ALL_REDUCE, nm, 0, NULL, 1, &t, a, 4);
        if (!ar) break;
        ar->stream = DG_STREAM_COMM;
        ar->flags |= DG_NF_GRAD_SYNC;
        if (cast) ar->wait[ar->n_wait++] = cast; /* the comm stream starts once the send buffer is cast */
        move_after(g, ar, x);
        ars[nar++] = ar;
    }
    for (int j = 0; j < nar && !g->err; j++) {
        dg_fmt(nm, sizeof nm, "wait.%.80s", ars[j]->name);
        dg_node_t *w = dg_graph_add_op(g, DG_OP_WAIT, nm, 0, NULL, 0, NULL, NULL, 0);
        if (!w) break;
        w->flags |= DG_NF_GRAD_SYNC;
        w->wait[w->n_wait++] = ars[j];
        move_after(g, w, m->par.overlap ? last_bwd_op(g, w) : ars[j]);
        if (ars[j]->upd[0]->op != DG_OP_CAST) continue;
        /* the bf16 sum back into the f32 bucket: on the compute stream after the wait (which joins the comm
         * stream); flagged like the all-reduce, so accumulation micro-batches skip all four */
        dg_node_t *bf = ars[j]->upd[0], *gl = bf->src[0];
        int64_t ua[2] = {0, DG_F32};
        dg_fmt(nm, sizeof nm, "ar.uncast.%.80s", gl->name);
        dg_node_t *u = dg_graph_add_op(g, DG_OP_CAST, nm, 1, &bf, 1, &gl, ua, 2);
        if (!u) break;
        u->flags |= DG_NF_GRAD_SYNC;
        u->wait[u->n_wait++] = ars[j]; /* reads the collective's result */
        move_after(g, u, w);
    }
    free(ars);
    g->cur_phase = saved;
    return g->err;
}

/* Optimizer-phase collectives, run to completion on the compute stream (a few per step):
 * tp-rank-0-only gradients summed over tp, before the norm; the local sum of squares summed over
 * dp_shard and tp, before the clip factor. The dp_replicate sum runs in the backward
 * (add_replicate_sync). */
static dg_status_t pass_grad_sync(dg_graph_t *g, void *ctx) {
    dg_model_t *m = ctx;
    if (m->rep > 1 && m->shard) DG_TRY(add_replicate_sync(g, m));
    dg_node_t *zs = NULL, *clip = NULL;
    for (int i = 0; i < g->n; i++) {
        dg_node_t *x = g->nodes[i];
        if (x->phase != DG_PHASE_OPT || x->op == DG_OP_LEAF) continue;
        if (x->op == DG_OP_ZERO && x->upd[0] == m->scalars) zs = x;
        if (x->op == DG_OP_CLIP_SCALE) clip = x;
    }
    DG_ASSERT(zs && clip);
    dg_phase_t saved = g->cur_phase;
    g->cur_phase = DG_PHASE_OPT;
    char nm[96];
    dg_node_t *after = zs;
#define INPLACE_AR(name, target, dim, count)                                                                 \
    do {                                                                                                     \
        int64_t a_[4] = {0, (dim), DG_AR_SUM, (count)};                                                      \
        dg_node_t *t_ = (target);                                                                            \
        dg_node_t *n_ = dg_graph_add_op(g, DG_OP_ALL_REDUCE, (name), 0, NULL, 1, &t_, a_, 4);                \
        if (!n_) break;                                                                                      \
        dg_graph_move(g, n_, after->id + 1 + after->n_side);                                                 \
        after = n_;                                                                                          \
    } while (0)
    for (int i = 0; i < m->np && !g->err; i++)
        if (m->place[i].tp_rank0_only) {
            dg_fmt(nm, sizeof nm, "ar.tp.%.80s", m->pnode[i]->grad->name);
            INPLACE_AR(nm, m->pnode[i]->grad, DG_MESH_TP, 0);
        }
    after = g->nodes[clip->id - 1];
    if (m->k > 1 && !g->err) INPLACE_AR("ar.sumsq.dp_shard", m->scalars, DG_MESH_DP_SHARD, 1);
    if (m->tp > 1 && !g->err) INPLACE_AR("ar.sumsq.tp", m->scalars, DG_MESH_TP, 1);
#undef INPLACE_AR
    g->cur_phase = saved;
    return g->err;
}

/* Flat-buffer layout of the local shards (parameter order, so a bucket's shards are contiguous) and the
 * shard plan for the FSDP pass. */
static void layout(dg_model_t *m) {
    size_t t = 0;
    for (int i = 0; i < m->np; i++) {
        m->off[i] = t;
        t += (m->place[i].local_numel + PARAM_ALIGN_ELEMS - 1) / PARAM_ALIGN_ELEMS * PARAM_ALIGN_ELEMS;
    }
    m->total = t;
    if (m->k == 1 && m->rep == 1) return;
    dg_shard_plan_t *sp = dg_xcalloc(1, sizeof *sp);
    sp->n = m->np;
    sp->params = dg_xcalloc((size_t)m->np, sizeof *sp->params);
    for (int i = 0; i < m->np; i++) {
        const char *nm = m->info[i].name;
        int group = 0;
        if (strncmp(nm, "h.", 2) == 0)
            group = 1 + atoi(nm + 2);
        else if (strncmp(nm, "ln_f.", 5) == 0)
            group = m->d.n_layer + 1;
        const place_t *pl = &m->place[i];
        sp->params[i] =
            (dg_shard_param_t){m->pnode[i], group, pl->lrows, pl->lcols, pl->Rs, pl->row0, m->off[i]};
    }
    sp->k = m->k;
    sp->bucket_bytes = m->par.bucket_bytes;
    sp->prefetch_bytes = m->par.prefetch_bytes;
    sp->overlap = m->par.overlap;
    sp->reshard = m->par.reshard_after_forward;
    sp->reduce_dtype = m->par.reduce_dtype;
    m->shard = sp;
}

/* ---------------- initialisation ---------------- */

static uint64_t mix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform in (0, 1) from a counter: element `idx` of tensor `k` under `seed`, independent of every
 * other element, so any piece of a tensor can be generated alone. */
static double uniform01(uint64_t seed, uint64_t k, uint64_t idx) {
    uint64_t h = mix64(mix64(mix64(seed) + k) + idx);
    return ((double)(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static float normal(uint64_t seed, uint64_t k, uint64_t i) {
    double u1 = uniform01(seed, k, 2 * i), u2 = uniform01(seed, k, 2 * i + 1);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* Global row of row `lr` of this rank's local piece (-1 in the padding). */
static int64_t global_row(const place_t *pl, int64_t lr) {
    if (lr >= pl->nrows) return -1;
    int64_t t = pl->row0 + lr; /* row of the tp-local tensor */
    if (pl->tp_dim != 0) return t;
    for (int s = 0; s < pl->n_seg; s++) {
        if (t < pl->seg_len[s]) return pl->seg_start[s] + t;
        t -= pl->seg_len[s];
    }
    DG_ASSERT(0);
    return -1;
}

/* Fills this rank's local piece of tensor i (local_numel floats, padding rows zero) with the values
 * the whole tensor would have at those global positions. */
static void init_tensor(const dg_model_t *m, int i, float *h) {
    const dg_param_info_t *pi = &m->info[i];
    const place_t *pl = &m->place[i];
    const char *name = pi->name;
    int64_t lc = pl->lcols, gcols = pl->gshape[1], col0 = pl->tp_dim == 1 ? pl->seg_start[0] : 0;
    memset(h, 0, pl->local_numel * sizeof(float));
    int constant = ends_with(name, ".bias") || ends_with(name, "ln_1.weight") ||
                   ends_with(name, "ln_2.weight") || strcmp(name, "ln_f.weight") == 0;
    float cval = ends_with(name, ".weight") ? 1.0f : 0.0f; /* layernorm gain 1, every bias 0 */
    double std = 0.02;
    if (ends_with(name, "attn.proj.weight") || ends_with(name, "mlp.proj.weight"))
        std = 0.02 / sqrt(2.0 * m->d.n_layer); /* residual projections: keep the stream's variance flat */
    int64_t valid_rows = strcmp(name, "wte") == 0 ? m->d.vocab_size : pl->gshape[0]; /* padded rows: 0 */
    for (int64_t lr = 0; lr < pl->nrows; lr++) {
        int64_t gr = global_row(pl, lr);
        float *row = h + lr * lc;
        for (int64_t c = 0; c < lc; c++) {
            if (constant) {
                row[c] = cval;
                continue;
            }
            uint64_t e = (uint64_t)gr * (uint64_t)gcols + (uint64_t)(col0 + c);
            row[c] = gr < valid_rows ? (float)(std * normal(m->seed, (uint64_t)i, e)) : 0.0f;
        }
    }
}

/* ---------------- create / free ---------------- */

static dg_status_t alloc_zero(dg_backend_t *be, size_t bytes, void **out) {
    DG_TRY(be->ops->alloc(be, bytes, out));
    return be->ops->memset0(be, *out, bytes);
}

/* The loss and norm go through download_async + fences when the backend has all five v1.8 entries,
 * unless DG_SYNC_HOST_READS=1 asks for the old sync + to_host reads (A/B timing; same numbers). */
static int want_async_reads(const dg_backend_t *be) {
    const dg_backend_ops_t *o = be->ops;
    if (!o->download_async || !o->fence_create || !o->fence_destroy || !o->fence_record || !o->fence_wait)
        return 0;
    return !dg_env_bool("DG_SYNC_HOST_READS");
}

static dg_status_t bind_and_alloc(dg_model_t *m) {
    dg_backend_t *be = m->be;
    size_t fb = m->total * sizeof(float);
    DG_TRY(alloc_zero(be, fb, (void **)&m->master));
    DG_TRY(alloc_zero(be, fb, (void **)&m->grad));
    DG_TRY(alloc_zero(be, fb, (void **)&m->adam_m));
    DG_TRY(alloc_zero(be, fb, (void **)&m->adam_v));
    size_t as = dg_dtype_size(m->g->act_dtype);
    if (m->g->act_dtype != DG_F32) DG_TRY(alloc_zero(be, m->total * as, &m->compute));
    size_t ntok = (size_t)m->B * (size_t)m->T;
    DG_TRY(alloc_zero(be, ntok * sizeof(int32_t), (void **)&m->tokens_dev));
    DG_TRY(alloc_zero(be, ntok * sizeof(int32_t), (void **)&m->targets_dev));
    DG_TRY(alloc_zero(be, DG_SCALAR_COUNT * sizeof(float), (void **)&m->scalars_dev));
    DG_TRY(be->ops->host_alloc(be, ntok * sizeof(int32_t), (void **)&m->tok_host));
    DG_TRY(be->ops->host_alloc(be, ntok * sizeof(int32_t), (void **)&m->tgt_host));
    DG_TRY(be->ops->host_alloc(be, ntok * sizeof(float), (void **)&m->host_losses));
    if (m->async_reads) {
        DG_TRY(be->ops->host_alloc(be, sizeof(float), (void **)&m->host_norm));
        *m->host_norm = NAN;
        DG_TRY(be->ops->fence_create(be, &m->loss_fence));
        DG_TRY(be->ops->fence_create(be, &m->norm_fence));
        /* the node after which DG_DS_NORM holds the step's norm; a pass that replaced CLIP_SCALE by
         * another op writing the norm would have to be found here too (none: the norm is read after a
         * sync, correct but with the old wait) */
        for (int i = 0; i < m->g->n; i++)
            if (m->g->nodes[i]->op == DG_OP_CLIP_SCALE && m->g->nodes[i]->phase == DG_PHASE_OPT)
                m->clip = m->g->nodes[i];
    }
    m->tokens->data = m->tokens_dev;
    m->targets->data = m->targets_dev;
    m->scalars->data = m->scalars_dev;
    for (int i = 0; i < m->np; i++) {
        dg_node_t *p = m->pnode[i];
        p->master->data = m->master + m->off[i];
        if (p->master != p) p->data = (char *)m->compute + m->off[i] * as;
        p->grad->data = m->grad + m->off[i];
    }
    for (int j = 0; m->shard && j < m->shard->n_buckets; j++) { /* views over the flat buffers */
        dg_bucket_t *b = &m->shard->buckets[j];
        size_t o = m->off[b->first];
        b->pleaf->data = m->compute ? (void *)((char *)m->compute + o * as) : (void *)(m->master + o);
        b->gleaf->data = m->grad + o;
    }
    if (m->fuse.master) { /* the fused AdamW's leaves span the flat buffers */
        m->fuse.master->data = m->master;
        m->fuse.grad->data = m->grad;
        m->fuse.m->data = m->adam_m;
        m->fuse.v->data = m->adam_v;
        if (m->fuse.param != m->fuse.master) m->fuse.param->data = m->compute;
        DG_TRY(alloc_zero(be, m->fuse.segs->nbytes, &m->segs_dev));
        m->fuse.segs->data = m->segs_dev;
        for (int i = 0; i < m->g->n_opt_segs; i++) { /* the segments are the tensors bound above */
            const dg_opt_seg_t *sg = &m->g->opt_segs[i];
            DG_ASSERT(sg->param_index >= 0 && sg->param_index < m->np);
            const dg_node_t *p = m->pnode[sg->param_index];
            DG_ASSERT(p->master->data == (void *)(m->master + sg->off) &&
                      p->grad->data == (void *)(m->grad + sg->off));
            DG_ASSERT(sg->count == m->place[sg->param_index].local_numel);
        }
    }
    if (m->fuse.norm_segs) { /* the fused norm reads the same flat gradient leaf */
        DG_TRY(alloc_zero(be, m->fuse.norm_segs->nbytes, &m->norm_segs_dev));
        m->fuse.norm_segs->data = m->norm_segs_dev;
        for (int i = 0; i < m->g->n_norm_segs; i++) {
            const dg_opt_seg_t *sg = &m->g->norm_segs[i];
            DG_ASSERT(sg->param_index >= 0 && sg->param_index < m->np);
            DG_ASSERT(m->pnode[sg->param_index]->grad->data == (void *)(m->grad + sg->off));
            DG_ASSERT(sg->count == m->place[sg->param_index].local_numel);
        }
    }
    for (int j = 0; j < m->g->n; j++) {
        dg_node_t *x = m->g->nodes[j];
        if (!(x->flags & DG_NF_OPTSTATE)) continue;
        DG_ASSERT(x->param_index >= 0 && x->param_index < m->np);
        float *base = strncmp(x->name, "adam_m.", 7) == 0 ? m->adam_m : m->adam_v;
        x->data = base + m->off[x->param_index];
    }
    DG_TRY(dg_exec_create(be, m->g, m->plan, &m->ex));
    for (int d = 0; d < DG_MESH_NDIM; d++) {
        if (m->par.mesh.size[d] == 1) continue;
        if (!m->par.comm[d])
            return DG_ERR(DG_ERR_USAGE, "model: mesh dimension %s has %d ranks but no comm was given",
                          dg_mesh_dim_name(d), m->par.mesh.size[d]);
        DG_TRY(dg_exec_attach_comm(m->ex, d, m->par.comm[d]));
    }
    return DG_OK;
}

static dg_status_t init_weights(dg_model_t *m) {
    size_t maxn = 1;
    for (int i = 0; i < m->np; i++)
        if (m->place[i].local_numel > maxn) maxn = m->place[i].local_numel;
    float *h = dg_xmalloc(maxn * sizeof(float));
    dg_status_t st = DG_OK;
    for (int i = 0; i < m->np && st == DG_OK; i++) {
        init_tensor(m, i, h);
        st = dg_model_set_local(m, i, DG_STATE_PARAM, h);
    }
    free(h);
    return st;
}

dg_status_t dg_model_create(const dg_model_desc_t *d, dg_backend_t *be, int micro_batch, uint64_t seed,
                            dg_model_t **out) {
    return dg_model_create_ex(d, be, micro_batch, seed, 0, out);
}

dg_status_t dg_model_create_ex(const dg_model_desc_t *d, dg_backend_t *be, int micro_batch, uint64_t seed,
                               int flags, dg_model_t **out) {
    return dg_model_create_parallel(d, be, micro_batch, seed, flags, NULL, out);
}

void dg_model_parallel_default(dg_model_parallel_t *p) {
    memset(p, 0, sizeof *p);
    for (int d = 0; d < DG_MESH_NDIM; d++) {
        p->mesh.size[d] = 1;
        p->mesh.order[d] = d;
    }
    p->bucket_bytes = (size_t)25 << 20;
    p->prefetch_bytes = (size_t)256 << 20;
    p->overlap = 1;
    p->reshard_after_forward = 1;
}

static dg_status_t check_parallel(const dg_model_desc_t *d, const dg_model_parallel_t *p) {
    for (int k = 0; k < DG_MESH_NDIM; k++) {
        if (p->mesh.size[k] < 1 || p->coord[k] < 0 || p->coord[k] >= p->mesh.size[k])
            return DG_ERR(DG_ERR_USAGE, "model: mesh dimension %s: size %d, coordinate %d is out of range",
                          dg_mesh_dim_name(k), p->mesh.size[k], p->coord[k]);
    }
    if (p->reduce_dtype != DG_F32 && p->reduce_dtype != DG_BF16)
        return DG_ERR(DG_ERR_USAGE, "model: gradient reduction dtype %s: expected f32 or bf16",
                      dg_dtype_name(p->reduce_dtype));
    int tp = p->mesh.size[DG_MESH_TP];
    if (d->n_head % tp != 0)
        return DG_ERR(
            DG_ERR_USAGE,
            "parallel.mesh: tp = %d must divide model.n_head = %d (attention heads are split over tp)", tp,
            d->n_head);
    return DG_OK;
}

dg_status_t dg_model_create_parallel(const dg_model_desc_t *d, dg_backend_t *be, int micro_batch,
                                     uint64_t seed, int flags, const dg_model_parallel_t *par,
                                     dg_model_t **out) {
    *out = NULL;
    DG_TRY(dg_model_desc_validate(d));
    if (!be) return DG_ERR(DG_ERR_USAGE, "model: no compute backend given");
    if (micro_batch < 1 || (int64_t)micro_batch * d->seq_len > INT_MAX / 4)
        return DG_ERR(DG_ERR_USAGE, "train.micro_batch = %d is out of range for seq_len %d", micro_batch,
                      d->seq_len);
    dg_model_parallel_t one;
    if (!par) {
        dg_model_parallel_default(&one);
        par = &one;
    }
    DG_TRY(check_parallel(d, par));
    dg_model_t *m = dg_xcalloc(1, sizeof *m);
    m->d = *d;
    m->be = be;
    m->B = micro_batch;
    m->T = d->seq_len;
    m->flags = flags;
    m->seed = seed;
    m->par = *par;
    m->tp = par->mesh.size[DG_MESH_TP];
    m->tp_rank = par->coord[DG_MESH_TP];
    m->k = par->mesh.size[DG_MESH_DP_SHARD];
    m->shard_rank = par->coord[DG_MESH_DP_SHARD];
    m->rep = par->mesh.size[DG_MESH_DP_REPLICATE];
    m->accum = 1;
    m->rep_rank = par->coord[DG_MESH_DP_REPLICATE];
    int cap = 4 + 12 * d->n_layer;
    m->info = dg_xcalloc((size_t)cap, sizeof *m->info);
    m->names = dg_xcalloc((size_t)cap, sizeof *m->names);
    m->pnode = dg_xcalloc((size_t)cap, sizeof *m->pnode);
    m->off = dg_xcalloc((size_t)cap + 1, sizeof *m->off);
    m->place = dg_xcalloc((size_t)cap, sizeof *m->place);
    m->g = dg_graph_create(be);
    m->g->mesh = par->mesh;

    dg_status_t st = build_forward(m);
    if (st == DG_OK) {
        layout(m);
        m->losses->flags |= DG_NF_OUTPUT;
        dg_pass_t pipeline[16];
        int np = 0;
        pipeline[np++] = (dg_pass_t){"fuse_gelu", dg_pass_fuse_gelu, NULL};
        /* before autodiff, which then emits the fused op's backward (the residual's gradient shared, the
         * matmul's MATMUL_BWD): with tp > 1 the row-parallel products reach their add through an
         * all-reduce, and stay unfused */
        if (res_fused(m)) pipeline[np++] = (dg_pass_t){"fuse_residual", dg_pass_fuse_residual, NULL};
        pipeline[np++] = (dg_pass_t){"autodiff", pass_autodiff, m};
        if (!(flags & DG_MODEL_UNFUSED_GELU_BWD))
            pipeline[np++] = (dg_pass_t){"fuse_gelu_bwd", dg_pass_fuse_gelu_bwd, NULL};
        if (flags & DG_MODEL_RECOMPUTE_GELU)
            pipeline[np++] = (dg_pass_t){"recompute_gelu", dg_pass_recompute_gelu, NULL};
        /* the loss becomes one op that also writes the logits' gradient, in the forward: every run of the
         * forward that a backward follows must have the step's dloss set (dg_model_forward_backward), and
         * a forward alone runs with rt.forward_only (dg_model_forward, dg_model_logits) */
        dg_fuse_ce_t fce = {.loss = m->losses};
        if (ce_fused(m)) pipeline[np++] = (dg_pass_t){"fuse_crossentropy", dg_pass_fuse_crossentropy, &fce};
        if (m->shard) /* a data-parallel mesh: buckets (one data-parallel rank: none) */
            pipeline[np++] = (dg_pass_t){"fsdp", dg_pass_fsdp, m->shard};
        pipeline[np++] = (dg_pass_t){"optimizer", pass_optimizer, m};
        if (adamw_fused(m)) {
            m->fuse = (dg_fuse_adamw_t){.off = m->off, .n = m->np, .span = m->total};
            pipeline[np++] = (dg_pass_t){"fuse_adamw", dg_pass_fuse_adamw, &m->fuse};
            /* before grad_sync: the optimizer-phase all-reduces it inserts (tp-rank-0 gradients after
             * the accumulator's ZERO, the sum's over dp_shard and tp before CLIP_SCALE) then surround the
             * fused op as they would the SUMSQ ops */
            if (sumsq_fused(m)) pipeline[np++] = (dg_pass_t){"fuse_sumsq", dg_pass_fuse_sumsq, &m->fuse};
        }
        pipeline[np++] = (dg_pass_t){"grad_sync", pass_grad_sync, m};
        pipeline[np++] = (dg_pass_t){"inplace", dg_pass_inplace, NULL};
        st = dg_graph_run_passes(m->g, pipeline, np);
        m->losses = fce.loss; /* the fused op's losses when the pass fused the loss */
    }
    if (st == DG_OK)
        st = dg_plan_create(m->g, (flags & DG_MODEL_NO_ARENA_REUSE) ? DG_PLAN_NO_REUSE : 0, &m->plan);
    if (st == DG_OK) m->frozen = dg_xcalloc((size_t)m->np + 1, 1);
    m->stall_rank = -1;
    int64_t sr = dg_env_int("DG_TEST_STALL_COLLECTIVE_RANK"), ss = dg_env_int("DG_TEST_STALL_COLLECTIVE_STEP");
    if (sr >= 0 && ss >= 0) {
        m->stall_rank = (int)sr;
        m->stall_step = ss;
    }
    if (st == DG_OK && !(flags & DG_MODEL_PLAN_ONLY)) {
        m->async_reads = want_async_reads(be);
        st = bind_and_alloc(m);
        if (st == DG_OK) {
            m->ex->rt.frozen = m->frozen;
            m->ex->rt.n_frozen_slots = m->np;
        }
        if (st == DG_OK) st = init_weights(m);
    }
    if (st != DG_OK) {
        dg_model_free(m);
        return st;
    }
    *out = m;
    return DG_OK;
}

void dg_model_free(dg_model_t *m) {
    if (!m) return;
    dg_backend_t *be = m->be;
    /* with async_reads a step may return with its backward or AdamW still queued, and that work uses
     * the buffers freed below (errors were reported, or the model is being torn down after one) */
    if (m->ex && m->async_reads) (void)be->ops->sync(be);
    gr_drop(m); /* the recordings hold the fences and the page-locked buffers: before those go */
    if (m->loss_fence) be->ops->fence_destroy(be, m->loss_fence);
    if (m->norm_fence) be->ops->fence_destroy(be, m->norm_fence);
    if (m->tok_host) be->ops->host_free(be, m->tok_host);
    if (m->tgt_host) be->ops->host_free(be, m->tgt_host);
    if (m->host_losses) be->ops->host_free(be, m->host_losses);
    if (m->host_norm) be->ops->host_free(be, m->host_norm);
    dg_exec_free(m->ex);
    void *bufs[] = {m->master,       m->grad,       m->adam_m,       m->adam_v,
                    m->compute,      m->tokens_dev, m->targets_dev,  m->scalars_dev,
                    m->gr_agree_dev, m->segs_dev,   m->norm_segs_dev};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->ops->free(be, bufs[i]);
    dg_plan_free(m->plan);
    dg_graph_free(m->g);
    dg_shard_plan_free(m->shard);
    free(m->place);
    free(m->info);
    free(m->names);
    free(m->pnode);
    free(m->off);
    free(m->frozen);
    free(m);
}

/* ---------------- accessors ---------------- */

const dg_model_desc_t *dg_model_desc(const dg_model_t *m) {
    return &m->d;
}

int dg_model_micro_batch(const dg_model_t *m) {
    return m->B;
}

int dg_model_n_tensors(const dg_model_t *m) {
    return m->np;
}

const dg_param_info_t *dg_model_param(const dg_model_t *m, int i) {
    return (i >= 0 && i < m->np) ? &m->info[i] : NULL;
}

int dg_model_find_param(const dg_model_t *m, const char *name) {
    for (int i = 0; i < m->np; i++)
        if (strcmp(m->info[i].name, name) == 0) return i;
    return -1;
}

size_t dg_model_arena_bytes(const dg_model_t *m) {
    return m->plan->arena_bytes;
}

size_t dg_model_activation_bytes_sum(const dg_model_t *m) {
    return m->plan->act_bytes_sum;
}

size_t dg_model_state_bytes(const dg_model_t *m) {
    size_t b = 4 * m->total * sizeof(float);
    if (m->g->act_dtype != DG_F32) b += m->total * dg_dtype_size(m->g->act_dtype);
    return b;
}

int dg_model_n_ops(const dg_model_t *m) {
    int k = 0;
    for (int i = 0; i < m->g->n; i++)
        if (m->g->nodes[i]->op != DG_OP_LEAF && m->g->nodes[i]->op != DG_OP_SIDE) k++;
    return k;
}

dg_graph_t *dg_model_graph(const dg_model_t *m) {
    return m->g;
}

dg_exec_t *dg_model_exec(const dg_model_t *m) {
    return m->ex;
}

static void fb_flush(dg_model_t *m) {
    if (!m->fb_cb || !m->ex) return;
    for (; m->fb_sent < m->ex->n_fb; m->fb_sent++)
        m->fb_cb(m->fb_ctx, m->ex->fb[m->fb_sent].kind, m->ex->fb[m->fb_sent].reason);
}

void dg_model_set_fallback_cb(dg_model_t *m, dg_model_fallback_cb_t cb, void *ctx) {
    m->fb_cb = cb;
    m->fb_ctx = ctx;
    fb_flush(m);
}

const dg_plan_t *dg_model_plan(const dg_model_t *m) {
    return m->plan;
}

/* ---------------- running ---------------- */

static dg_status_t need_memory(const dg_model_t *m, const char *what) {
    if (m->flags & DG_MODEL_PLAN_ONLY)
        return DG_ERR(DG_ERR_USAGE, "model: %s on a model created plan-only (no memory)", what);
    return DG_OK;
}

static dg_status_t check_ids(const dg_model_t *m, const int32_t *ids, const char *what) {
    if (!ids) return DG_ERR(DG_ERR_USAGE, "model: %s missing", what);
    size_t n = (size_t)m->B * (size_t)m->T;
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->d.vocab_size)
            return DG_ERR(
                DG_ERR_USAGE,
                "model: %s[%zu] (sequence %zu, position %zu) = %d is outside the vocabulary [0, %d)", what, i,
                i / (size_t)m->T, i % (size_t)m->T, (int)ids[i], m->d.vocab_size);
    return DG_OK;
}

/* Checks the ids and puts them in the page-locked staging buffers; upload_ids() queues the copies. The
 * staging is free again once the forward that follows the copies has run: after the sync that ends
 * dg_model_forward (read_mean_loss), and after dg_model_forward_backward's wait, which is either that
 * sync or the loss fence placed after the forward (queue_loss_read), in both cases behind the uploads. */
static dg_status_t stage_ids(dg_model_t *m, const int32_t *tokens, const int32_t *targets) {
    size_t bytes = (size_t)m->B * (size_t)m->T * sizeof(int32_t);
    DG_TRY(check_ids(m, tokens, "tokens"));
    DG_TRY(check_ids(m, targets, "targets"));
    memcpy(m->tok_host, tokens, bytes);
    memcpy(m->tgt_host, targets, bytes);
    return DG_OK;
}

static dg_status_t upload_ids(dg_model_t *m) {
    size_t bytes = (size_t)m->B * (size_t)m->T * sizeof(int32_t);
    DG_TRY(m->be->ops->upload_async(m->be, m->tokens_dev, m->tok_host, bytes));
    return m->be->ops->upload_async(m->be, m->targets_dev, m->tgt_host, bytes);
}

/* ---------------- graph replay ---------------- */

enum { GR_ZERO, GR_FB, GR_FB_NOSYNC, GR_OPT, GR_COUNT };
static const char *const gr_name[GR_COUNT] = {"zero_grad", "forward_backward",
                                              "forward_backward (no gradient sync)", "optimizer"};

static void gr_drop(dg_model_t *m) {
    for (int i = 0; i < GR_COUNT; i++) {
        if (m->gr[i]) m->be->ops->graph_free(m->be, m->gr[i]);
        m->gr[i] = NULL;
    }
}

static void gr_give_up(dg_model_t *m, const char *why) {
    gr_drop(m);
    m->gr_on = 0;
    DG_LOG_WARN("CUDA Graph replay is off for the rest of the run, steps run op by op: %s", why);
    if (m->gr_cb) m->gr_cb(m->gr_ctx, "fallback", why);
}

typedef dg_status_t (*gr_body_t)(dg_model_t *m);

static dg_status_t body_zero(dg_model_t *m) {
    return dg_exec_run_phase(m->ex, DG_PHASE_ZERO);
}

/* The token losses are final once the forward has run (an output: live to the end of the schedule, and
 * nothing in the backward writes them): their copy and the loss fence go right there, so the host can
 * read the loss while the backward runs. Recorded into the forward_backward graphs with the rest. */
static dg_status_t queue_loss_read(dg_model_t *m) {
    size_t n = (size_t)m->B * (size_t)m->T;
    DG_TRY(
        m->be->ops->download_async(m->be, m->host_losses, dg_exec_ptr(m->ex, m->losses), n * sizeof(float)));
    return m->be->ops->fence_record(m->be, m->loss_fence);
}

/* The forward and the backward of one micro-batch. rt.dloss is set before it (a fused classifier loss
 * writes the logits' gradient in the forward), so a recording of it bakes in that dloss, which is the
 * key of the forward_backward recordings (gr_run). */
static dg_status_t body_fb(dg_model_t *m) {
    DG_ASSERT(!m->ex->rt.forward_only);
    DG_TRY(upload_ids(m));
    DG_TRY(dg_exec_run_phase(m->ex, DG_PHASE_FWD));
    if (m->async_reads) DG_TRY(queue_loss_read(m));
    return dg_exec_run_phase(m->ex, DG_PHASE_BWD);
}

/* The gradient norm is final once CLIP_SCALE has run (after the sum of squares and its all-reduces over
 * dp_shard and tp, which pass_grad_sync places before it): its copy and the norm fence go right after
 * that node, inside the one OPT run (and so inside the one optimizer recording), ahead of the AdamW. */
static dg_status_t queue_norm_read(void *ctx) {
    dg_model_t *m = ctx;
    DG_TRY(m->be->ops->download_async(m->be, m->host_norm, m->scalars_dev + DG_SCALAR_NORM, sizeof(float)));
    return m->be->ops->fence_record(m->be, m->norm_fence);
}

static dg_status_t body_opt(dg_model_t *m) {
    if (!m->async_reads || !m->clip) return dg_exec_run_phase(m->ex, DG_PHASE_OPT);
    int first, end;
    dg_graph_phase_range(m->g, DG_PHASE_OPT, &first, &end);
    return dg_exec_run_hook(m->ex, first, end, m->clip->id, queue_norm_read, m);
}

static int gr_active(const dg_model_t *m) {
    return m->gr_on && m->gr_warm && !m->ex->profile;
}

/* The step's collectives run over nccl comms (recorded into the graphs with the compute). */
static int gr_nccl(const dg_model_t *m) {
    for (int d = 0; d < DG_MESH_NDIM; d++)
        if (m->par.mesh.size[d] > 1 && m->par.comm[d] && dg_comm_kind(m->par.comm[d]) == DG_COMM_NCCL)
            return 1;
    return 0;
}

/* NCCL's rule for CUDA Graphs: whether a collective is captured must be the same on every rank of its
 * communicator, and a captured one is launched by every rank's graph. A recording can fail on one rank
 * only (scratch that would have to grow, instantiation), so with nccl collectives the ranks agree on each
 * recording: failures are summed along each mesh dimension in turn (= the sum over the whole mesh); any
 * failure makes every rank drop its recording and run op by op. Runs after the recording, not captured. */
static dg_status_t gr_agree(dg_model_t *m, int failed, int *any_failed) {
    dg_backend_t *be = m->be;
    *any_failed = failed;
    if (!m->gr_agree_dev) DG_TRY(be->ops->alloc(be, 256, &m->gr_agree_dev));
    float v = failed ? 1.0f : 0.0f;
    DG_TRY(be->ops->to_device(be, m->gr_agree_dev, &v, sizeof v));
    DG_TRY(be->ops->sync(be)); /* the blocking collective below is not ordered after the backend's stream */
    for (int d = 0; d < DG_MESH_NDIM; d++)
        if (m->par.mesh.size[d] > 1 && m->par.comm[d])
            DG_TRY(
                dg_comm_allreduce(m->par.comm[d], m->gr_agree_dev, m->gr_agree_dev, 1, DG_F32, DG_RED_SUM));
    DG_TRY(be->ops->to_host(be, &v, m->gr_agree_dev, sizeof v));
    *any_failed = v > 0.5f;
    return DG_OK;
}

/* Runs body eagerly, or replays its recording (recording it first when there is none, or when the
 * values it baked in, key[0..nk), have changed). */
static dg_status_t gr_run(dg_model_t *m, int which, const float *key, int nk, gr_body_t body) {
    if (!gr_active(m)) return body(m);
    dg_backend_t *be = m->be;
    DG_ASSERT(nk <= 8);
    float k8[8] = {0};
    if (nk > 0) memcpy(k8, key, (size_t)nk * sizeof(float)); /* zero_grad passes no key (NULL) */
    int again = m->gr[which] != NULL && memcmp(k8, m->gr_key[which], sizeof k8) != 0;
    if (again) {
        be->ops->graph_free(be, m->gr[which]);
        m->gr[which] = NULL;
    }
    if (!m->gr[which]) {
        const char *why = dg_exec_capture_blocker(m->ex, 0, m->g->n);
        if (why) {
            char reason[320];
            snprintf(reason, sizeof reason, "%s", why);
            gr_give_up(m, reason);
            return body(m);
        }
        double t0 = dg_now_s();
        char reason[600] = "";
        dg_status_t st = be->ops->graph_begin(be);
        if (st != DG_OK) {
            snprintf(reason, sizeof reason, "%s", dg_last_error());
        } else {
            dg_status_t sb = body(m); /* recorded, not run */
            if (sb != DG_OK)
                snprintf(reason, sizeof reason, "recording %s: %s", gr_name[which], dg_last_error());
            void *gx = NULL;
            dg_status_t se = be->ops->graph_end(be, &gx);
            if (se != DG_OK && sb == DG_OK) snprintf(reason, sizeof reason, "%s", dg_last_error());
            if (sb == DG_OK && se == DG_OK) {
                m->gr[which] = gx;
                memcpy(m->gr_key[which], k8, sizeof k8);
            } else if (gx) {
                be->ops->graph_free(be, gx);
            }
        }
        if (gr_nccl(m)) {
            int any = 0;
            dg_status_t sa = gr_agree(m, m->gr[which] == NULL, &any);
            if (sa != DG_OK) {
                if (m->gr[which]) be->ops->graph_free(be, m->gr[which]);
                m->gr[which] = NULL;
                return dg_err_prefix(sa, "agreeing on the recording of %s", gr_name[which]);
            }
            if (any && m->gr[which]) {
                be->ops->graph_free(be, m->gr[which]);
                m->gr[which] = NULL;
                snprintf(reason, sizeof reason,
                         "another rank could not record %s (NCCL needs every rank to capture the same "
                         "collectives; see that rank's log)",
                         gr_name[which]);
            }
        }
        if (!m->gr[which]) {
            gr_give_up(m, reason);
            return body(m); /* recording ran nothing: run the same ops now */
        }
        char what[160];
        snprintf(what, sizeof what, "%s%s in %.1f ms", gr_name[which],
                 again ? " (again: a baked value changed)" : "", (dg_now_s() - t0) * 1e3);
        DG_LOG_DEBUG("CUDA Graph recorded: %s", what);
        if (m->gr_cb) m->gr_cb(m->gr_ctx, "captured", what);
    }
    return be->ops->graph_launch(be, m->gr[which]);
}

void dg_model_set_graph_replay(dg_model_t *m, int on, dg_model_graph_cb_t cb, void *ctx) {
    gr_drop(m);
    m->gr_on = on && m->be->ops->graph_begin != NULL && !(m->flags & DG_MODEL_PLAN_ONLY);
    m->gr_cb = cb;
    m->gr_ctx = ctx;
}

/* The mean of host_losses, summed in double in token order: the same arithmetic whichever way the
 * losses came to the host. */
static float mean_host_losses(const dg_model_t *m) {
    size_t n = (size_t)m->B * (size_t)m->T;
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += m->host_losses[i];
    return (float)(s / (double)n);
}

/* The sync path: waits for everything queued (the whole forward, and backward if any), then copies. */
static dg_status_t read_mean_loss(dg_model_t *m, float *mean_out) {
    size_t n = (size_t)m->B * (size_t)m->T;
    DG_TRY(m->be->ops->sync(m->be));
    m->opt_pending = 0;
    if (!mean_out) return DG_OK;
    DG_TRY(m->be->ops->to_host(m->be, m->host_losses, dg_exec_ptr(m->ex, m->losses), n * sizeof(float)));
    *mean_out = mean_host_losses(m);
    return DG_OK;
}

/* The async path: waits for the loss fence only (queue_loss_read); the backward may still be running.
 * Waited for even when the caller wants no loss: the id staging is free only after it. */
static dg_status_t wait_mean_loss(dg_model_t *m, float *mean_out) {
    dg_status_t st = m->be->ops->fence_wait(m->be, m->loss_fence);
    if (st != DG_OK) return dg_err_prefix(st, "model: reading the micro-batch's token losses");
    m->opt_pending = 0; /* the fence lies behind the previous step's AdamW */
    if (mean_out) *mean_out = mean_host_losses(m);
    return DG_OK;
}

/* Test hook for the collective timeouts: with DG_TEST_STALL_COLLECTIVE_RANK=R and _STEP=S (the value
 * given to dg_model_set_step), world rank R of a distributed model hangs before the forward of step S,
 * so its peers block in their first collective of the step. */
static void maybe_stall(const dg_model_t *m) {
    if (m->stall_rank < 0 || m->step != m->stall_step || (m->tp == 1 && m->k == 1 && m->rep == 1)) return;
    int wr = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &wr);
    if (wr != m->stall_rank) return;
    DG_LOG_WARN("test hook DG_TEST_STALL_COLLECTIVE_RANK=%d _STEP=%lld: rank %d hangs before its collectives",
                m->stall_rank, (long long)m->stall_step, wr);
    for (;;)
        sleep(1);
}

dg_status_t dg_model_forward_backward(dg_model_t *m, const int32_t *tokens_host, const int32_t *targets_host,
                                      float dloss, float *mean_loss_out) {
    DG_TRY(need_memory(m, "forward_backward"));
    maybe_stall(m);
    if (!isfinite(dloss)) return DG_ERR(DG_ERR_USAGE, "model: dloss = %g is not finite", (double)dloss);
    if (m->rep > 1 && m->fb_count >= m->accum)
        return DG_ERR(DG_ERR_USAGE,
                      "model: forward_backward call %d since the last zero_grad / optimizer step, but the "
                      "gradient accumulation is %d micro-batches (dg_model_set_grad_accum): the dp_replicate "
                      "gradient sum already ran",
                      m->fb_count + 1, m->accum);
    DG_TRY(stage_ids(m, tokens_host, targets_host));
    m->ex->rt.dloss = dloss;
    /* the dp_replicate sum runs in the backward of the step's last micro-batch only */
    int sync = m->fb_count + 1 >= m->accum;
    m->ex->rt.skip_grad_sync = !sync;
    dg_status_t st = gr_run(m, sync ? GR_FB : GR_FB_NOSYNC, &dloss, 1, body_fb);
    m->ex->rt.skip_grad_sync = 0;
    DG_TRY(st);
    m->fb_count++;
    return m->async_reads ? wait_mean_loss(m, mean_loss_out) : read_mean_loss(m, mean_loss_out);
}

dg_status_t dg_model_set_grad_accum(dg_model_t *m, int n) {
    if (n < 1)
        return DG_ERR(DG_ERR_USAGE, "model: gradient accumulation of %d micro-batches; expected >= 1", n);
    m->accum = n;
    m->fb_count = 0;
    return DG_OK;
}

/* The FWD phase with no backward to follow: a fused classifier loss computes the losses only, leaving
 * the logits (and whatever the backward of the last forward_backward left) alone. Never recorded. */
static dg_status_t run_forward_only(dg_model_t *m) {
    m->ex->rt.forward_only = 1;
    dg_status_t st = dg_exec_run_phase(m->ex, DG_PHASE_FWD);
    m->ex->rt.forward_only = 0;
    return st;
}

dg_status_t dg_model_forward(dg_model_t *m, const int32_t *tokens_host, const int32_t *targets_host,
                             float *mean_loss_out) {
    DG_TRY(need_memory(m, "forward"));
    DG_TRY(stage_ids(m, tokens_host, targets_host));
    DG_TRY(upload_ids(m));
    DG_TRY(run_forward_only(m));
    return read_mean_loss(m, mean_loss_out);
}

static float half_to_f32(uint16_t h, int bf16) {
    uint32_t u;
    if (bf16) {
        u = (uint32_t)h << 16;
    } else {
        uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1f, f = h & 0x3ff;
        if (e == 0) {
            float v = ldexpf((float)f, -24);
            return s ? -v : v;
        }
        u = s | ((e == 31 ? 255 : e + 112) << 23) | (f << 13);
    }
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

dg_status_t dg_model_logits(dg_model_t *m, const int32_t *tokens_host, int pos, float *host_out) {
    DG_TRY(need_memory(m, "logits"));
    if (pos < 0 || pos >= m->T)
        return DG_ERR(DG_ERR_USAGE, "model: logits position %d outside [0, %d)", pos, m->T);
    DG_TRY(check_ids(m, tokens_host, "tokens"));
    size_t ntok = (size_t)m->B * (size_t)m->T;
    DG_TRY(m->be->ops->to_device(m->be, m->tokens_dev, tokens_host, ntok * sizeof(int32_t)));
    DG_TRY(m->be->ops->memset0(m->be, m->targets_dev, ntok * sizeof(int32_t))); /* loss is ignored */
    DG_TRY(run_forward_only(m));
    DG_TRY(m->be->ops->sync(m->be));
    dg_dtype_t at = m->g->act_dtype;
    size_t as = dg_dtype_size(at), Vp = (size_t)m->d.padded_vocab, V = (size_t)m->d.vocab_size;
    const char *base = dg_exec_ptr(m->ex, m->logits);
    uint16_t *tmp = at == DG_F32 ? NULL : dg_xmalloc(V * sizeof(uint16_t));
    dg_status_t st = DG_OK;
    for (int b = 0; b < m->B && st == DG_OK; b++) {
        const char *row = base + ((size_t)b * (size_t)m->T + (size_t)pos) * Vp * as;
        float *dst = host_out + (size_t)b * V;
        if (at == DG_F32) {
            st = m->be->ops->to_host(m->be, dst, row, V * sizeof(float));
        } else {
            st = m->be->ops->to_host(m->be, tmp, row, V * as);
            for (size_t j = 0; j < V && st == DG_OK; j++)
                dst[j] = half_to_f32(tmp[j], at == DG_BF16);
        }
    }
    free(tmp);
    return st;
}

dg_status_t dg_model_zero_grad(dg_model_t *m) {
    DG_TRY(need_memory(m, "zero_grad"));
    m->fb_count = 0;
    return gr_run(m, GR_ZERO, NULL, 0, body_zero);
}

dg_status_t dg_model_optimizer_step(dg_model_t *m, const dg_optim_hparams_t *h, float *grad_norm_out) {
    DG_TRY(need_memory(m, "optimizer_step"));
    if (!(h->lr >= 0 && isfinite(h->lr)) || !(h->beta1 >= 0 && h->beta1 < 1) ||
        !(h->beta2 >= 0 && h->beta2 < 1) || !(h->eps > 0 && isfinite(h->eps)) ||
        !(h->weight_decay >= 0 && isfinite(h->weight_decay)) || !isfinite(h->grad_clip) || h->t < 1 ||
        !(h->inv_loss_scale >= 0 && isfinite(h->inv_loss_scale)))
        return DG_ERR(
            DG_ERR_USAGE,
            "model: bad AdamW hyper-parameters (lr %g, beta1 %g, beta2 %g, eps %g, weight_decay %g, "
            "grad_clip %g, t %" PRId64 ", inv_loss_scale %g); expected lr >= 0, betas in [0, 1), eps > 0, "
            "t >= 1",
            (double)h->lr, (double)h->beta1, (double)h->beta2, (double)h->eps, (double)h->weight_decay,
            (double)h->grad_clip, h->t, (double)h->inv_loss_scale);
    if (m->rep > 1 && m->fb_count > 0 && m->fb_count < m->accum)
        return DG_ERR(DG_ERR_USAGE,
                      "model: optimizer step after %d of %d micro-batches (dg_model_set_grad_accum): the "
                      "gradients have not been summed over dp_replicate yet",
                      m->fb_count, m->accum);
    m->fb_count = 0;
    /* back to back with the previous step and nothing waited for in between: its AdamW may still have
     * to upload the segment table that dg_exec_stage_scalars is about to rewrite */
    if (m->opt_pending) DG_TRY(m->be->ops->sync(m->be));
    m->opt_pending = 0;
    dg_runtime_t *rt = &m->ex->rt;
    float extra = h->inv_loss_scale > 0 ? h->inv_loss_scale : 1.0f;
    rt->lr = h->lr;
    rt->beta1 = h->beta1;
    rt->beta2 = h->beta2;
    rt->eps = h->eps;
    rt->weight_decay = h->weight_decay;
    rt->t = h->t;
    rt->grad_extra = extra;
    /* the norm is measured on loss-scaled gradients: scale the threshold the same way */
    rt->grad_clip = h->grad_clip > 0 ? h->grad_clip / extra : 0.0f;
    DG_TRY(dg_exec_stage_scalars(m->ex)); /* lr, bias corrections: also what a replay uploads */
    /* the whole phase at once, op by op or replayed: with an inf/NaN norm AdamW (adamw_dev) skips itself
     * on the device, so such gradients never reach the state */
    float key[6] = {rt->grad_clip, rt->grad_extra, rt->beta1, rt->beta2, rt->eps, rt->weight_decay};
    DG_TRY(gr_run(m, GR_OPT, key, 6, body_opt));
    float norm;
    if (m->async_reads && m->clip) { /* the norm fence (queue_norm_read): the AdamW may still run */
        dg_status_t sw = m->be->ops->fence_wait(m->be, m->norm_fence);
        if (sw != DG_OK) return dg_err_prefix(sw, "model: reading the gradient norm");
        norm = *m->host_norm;
        m->opt_pending = 1;
    } else {
        DG_TRY(m->be->ops->sync(m->be));
        DG_TRY(m->be->ops->to_host(m->be, &norm, m->scalars_dev + DG_SCALAR_NORM, sizeof norm));
    }
    if (grad_norm_out) *grad_norm_out = norm * extra;
    m->gr_warm = 1; /* one step has run: scratch sized, plans cached */
    return DG_OK;
}

dg_status_t dg_model_set_frozen(dg_model_t *m, int i, int frozen) {
    if (i < 0 || i >= m->np) return DG_ERR(DG_ERR_USAGE, "model: tensor index %d outside [0, %d)", i, m->np);
    if (m->frozen[i] != (frozen != 0)) gr_drop(m); /* the frozen set is baked into recordings */
    m->frozen[i] = frozen != 0;
    return DG_OK;
}

static dg_status_t state_ptr(dg_model_t *m, int i, int which, float **p) {
    DG_TRY(need_memory(m, "tensor access"));
    if (i < 0 || i >= m->np) return DG_ERR(DG_ERR_USAGE, "model: tensor index %d outside [0, %d)", i, m->np);
    float *base = which == DG_STATE_PARAM    ? m->master
                  : which == DG_STATE_ADAM_M ? m->adam_m
                  : which == DG_STATE_ADAM_V ? m->adam_v
                  : which == DG_STATE_GRAD   ? m->grad
                                             : NULL;
    if (!base) return DG_ERR(DG_ERR_USAGE, "model: unknown tensor state %d", which);
    *p = base + m->off[i];
    return DG_OK;
}

static dg_status_t need_whole(const dg_model_t *m, int i) {
    if (m->tp > 1 || m->k > 1)
        return DG_ERR(
            DG_ERR_USAGE,
            "model: tensor '%s' is distributed over the mesh (this rank holds %zu of %zu elements); "
            "use dg_model_get_local / dg_model_set_local",
            m->info[i].name, m->place[i].local_numel, m->info[i].numel);
    return DG_OK;
}

dg_status_t dg_model_get_tensor(dg_model_t *m, int i, int which, float *host_out) {
    float *p = NULL;
    DG_TRY(state_ptr(m, i, which, &p));
    DG_TRY(need_whole(m, i));
    DG_TRY(m->be->ops->sync(m->be));
    return m->be->ops->to_host(m->be, host_out, p, m->info[i].numel * sizeof(float));
}

dg_status_t dg_model_set_tensor(dg_model_t *m, int i, int which, const float *host_in) {
    float *p = NULL;
    DG_TRY(state_ptr(m, i, which, &p));
    DG_TRY(need_whole(m, i));
    return dg_model_set_local(m, i, which, host_in);
}

size_t dg_model_local_numel(const dg_model_t *m, int i) {
    return (i >= 0 && i < m->np) ? m->place[i].local_numel : 0;
}

dg_status_t dg_model_get_local(dg_model_t *m, int i, int which, float *host_out) {
    float *p = NULL;
    DG_TRY(state_ptr(m, i, which, &p));
    DG_TRY(m->be->ops->sync(m->be));
    return m->be->ops->to_host(m->be, host_out, p, m->place[i].local_numel * sizeof(float));
}

size_t dg_model_flat_numel(const dg_model_t *m) {
    return m->total;
}

size_t dg_model_flat_offset(const dg_model_t *m, int i) {
    DG_ASSERT(i >= 0 && i < m->np);
    return m->off[i];
}

dg_status_t dg_model_get_flat(dg_model_t *m, int which, float *host_out) {
    float *p = NULL;
    if (m->np == 0) return DG_OK;
    DG_TRY(state_ptr(m, 0, which, &p));
    DG_TRY(m->be->ops->sync(m->be));
    return m->be->ops->to_host(m->be, host_out, p - m->off[0], m->total * sizeof(float));
}

dg_status_t dg_model_set_flat(dg_model_t *m, int which, const float *host_in) {
    float *p = NULL;
    if (m->np == 0) return DG_OK;
    DG_TRY(state_ptr(m, 0, which, &p));
    DG_TRY(m->be->ops->sync(m->be));
    DG_TRY(m->be->ops->to_device(m->be, p - m->off[0], host_in, m->total * sizeof(float)));
    if (which == DG_STATE_PARAM && m->compute) /* the act-dtype compute copy follows the master */
        DG_TRY(m->be->ops->cast(m->be, m->compute, m->g->act_dtype, m->master, DG_F32, m->total));
    return m->be->ops->sync(m->be);
}

dg_status_t dg_model_set_local(dg_model_t *m, int i, int which, const float *host_in) {
    float *p = NULL;
    DG_TRY(state_ptr(m, i, which, &p));
    size_t n = m->place[i].local_numel;
    DG_TRY(m->be->ops->to_device(m->be, p, host_in, n * sizeof(float)));
    if (which == DG_STATE_PARAM && m->compute) {
        dg_dtype_t at = m->g->act_dtype;
        DG_TRY(m->be->ops->cast(m->be, (char *)m->compute + m->off[i] * dg_dtype_size(at), at, p, DG_F32, n));
    }
    return DG_OK;
}

int dg_model_local_pieces(const dg_model_t *m, int i, dg_model_piece_t *out) {
    if (i < 0 || i >= m->np) return 0;
    const place_t *pl = &m->place[i];
    int n = 0;
    int64_t lr = 0;
    while (lr < pl->nrows) { /* runs of local rows that are contiguous global rows */
        int64_t gr = global_row(pl, lr), len = 1;
        while (lr + len < pl->nrows && global_row(pl, lr + len) == gr + len)
            len++;
        DG_ASSERT(n < DG_MODEL_MAX_PIECES);
        dg_model_piece_t *p = &out[n++];
        p->start[0] = gr;
        p->count[0] = len;
        p->start[1] = pl->tp_dim == 1 ? pl->seg_start[0] : 0;
        p->count[1] = pl->lcols;
        p->offset = (size_t)(lr * pl->lcols);
        lr += len;
    }
    return n;
}

int dg_model_piece_owner(const dg_model_t *m, int i) {
    if (i < 0 || i >= m->np) return 0;
    return m->rep_rank == 0 && (m->place[i].tp_dim >= 0 || m->tp_rank == 0);
}

const dg_model_parallel_t *dg_model_parallel(const dg_model_t *m) {
    return &m->par;
}

void dg_model_set_step(dg_model_t *m, int64_t step) {
    m->step = step;
    for (int d = 0; d < DG_MESH_NDIM; d++)
        if (m->par.comm[d] && m->par.mesh.size[d] > 1) dg_comm_set_step(m->par.comm[d], step);
}

void dg_model_comm_stats(dg_model_t *m, dg_model_comm_stats_t *out, int reset) {
    memset(out, 0, sizeof *out);
    if (!m->ex) return;
    out->wait_s = m->ex->wait_s;
    out->blocking_s = m->ex->blocking_s;
    out->collectives = m->ex->n_coll;
    memcpy(out->bytes, m->ex->coll_bytes, sizeof out->bytes);
    out->grad_bytes = m->ex->grad_coll_bytes;
    if (reset) {
        m->ex->wait_s = m->ex->blocking_s = 0;
        m->ex->n_coll = 0;
        memset(m->ex->coll_bytes, 0, sizeof m->ex->coll_bytes);
        m->ex->grad_coll_bytes = 0;
    }
}

/* ---------------- profiling ---------------- */

void dg_model_set_profiling(dg_model_t *m, int on) {
    if (m->ex) m->ex->profile = on;
}

void dg_model_print_profile(dg_model_t *m, FILE *out) {
    if (!m->ex) return;
    double total = 0;
    int order[DG_OP_COUNT], n = 0;
    for (int k = 0; k < DG_OP_COUNT; k++) {
        total += m->ex->prof_s[k];
        if (m->ex->prof_n[k]) order[n++] = k;
    }
    for (int i = 1; i < n; i++) /* insertion sort by time, largest first */
        for (int j = i; j > 0 && m->ex->prof_s[order[j]] > m->ex->prof_s[order[j - 1]]; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    for (int i = 0; i < n; i++) {
        int k = order[i];
        fprintf(out, "  %-18s %9.3f s %8llu calls %5.1f%%\n", dg_op_name((dg_op_kind_t)k), m->ex->prof_s[k],
                (unsigned long long)m->ex->prof_n[k], total > 0 ? 100.0 * m->ex->prof_s[k] / total : 0.0);
        m->ex->prof_s[k] = 0;
        m->ex->prof_n[k] = 0;
    }
}

/* ---------------- plan printing ---------------- */

static void human(size_t b, char *buf, size_t cap) {
    const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)b;
    int k = 0;
    while (v >= 1024 && k < 4) {
        v /= 1024;
        k++;
    }
    snprintf(buf, cap, k ? "%.2f %s" : "%.0f %s", v, u[k]);
}

dg_status_t dg_model_print_plan(const dg_model_t *m, FILE *out, int json) {
    const dg_model_desc_t *d = &m->d;
    size_t pbytes = m->total * sizeof(float);
    size_t cbytes = m->g->act_dtype != DG_F32 ? m->total * dg_dtype_size(m->g->act_dtype) : 0;
    size_t arena = m->plan->arena_bytes, sum = m->plan->act_bytes_sum;
    int nops[DG_PHASE_COUNT] = {0};
    for (int i = 0; i < m->g->n; i++)
        if (m->g->nodes[i]->op != DG_OP_LEAF && m->g->nodes[i]->op != DG_OP_SIDE)
            nops[m->g->nodes[i]->phase]++;
    if (json) {
        fprintf(out,
                "{\"model\":{\"n_layer\":%d,\"n_head\":%d,\"d_model\":%d,\"seq_len\":%d,\"vocab_size\":%d,"
                "\"padded_vocab\":%d,\"n_params\":%" PRIu64 ",\"flops_per_token\":%.6g},\"micro_batch\":%d,"
                "\"act_dtype\":\"%s\",\"schedule\":",
                d->n_layer, d->n_head, d->d_model, d->seq_len, d->vocab_size, d->padded_vocab,
                dg_model_n_params(d), dg_model_flops_per_token(d), m->B, dg_dtype_name(m->g->act_dtype));
        dg_graph_print(m->g, m->plan, out, 1);
        fprintf(
            out,
            ",\n\"ops\":{\"fwd\":%d,\"bwd\":%d,\"zero\":%d,\"opt\":%d},\"arena_bytes\":%zu,"
            "\"activation_bytes_sum\":%zu,\"param_bytes\":%zu,\"compute_copy_bytes\":%zu,\"grad_bytes\":%zu,"
            "\"optimizer_bytes\":%zu,",
            nops[DG_PHASE_FWD], nops[DG_PHASE_BWD], nops[DG_PHASE_ZERO], nops[DG_PHASE_OPT], arena, sum,
            pbytes, cbytes, pbytes, 2 * pbytes);
        char mesh[128];
        dg_mesh_format(&m->par.mesh, mesh, sizeof mesh);
        fprintf(out,
                "\"parallel\":{\"mesh\":\"%s\",\"coord\":[%d,%d,%d],\"buckets\":%d,\"bucket_bytes\":%zu,"
                "\"overlap\":%s,\"prefetch_bytes\":%zu,\"reshard_after_forward\":%s}}\n",
                mesh, m->rep_rank, m->shard_rank, m->tp_rank, m->shard ? m->shard->n_buckets : 0,
                m->par.bucket_bytes, m->par.overlap ? "true" : "false", m->par.prefetch_bytes,
                m->par.reshard_after_forward ? "true" : "false");
        return ferror(out) ? DG_ERR(DG_ERR_RUNTIME, "model: writing the plan failed") : DG_OK;
    }
    char a[32], s[32], p[32], c[32], o[32];
    fprintf(
        out,
        "graph schedule: n_layer=%d n_head=%d d_model=%d seq_len=%d vocab=%d (padded %d), micro_batch=%d, "
        "act dtype %s, %" PRIu64 " params, %.3g FLOPs/token\n",
        d->n_layer, d->n_head, d->d_model, d->seq_len, d->vocab_size, d->padded_vocab, m->B,
        dg_dtype_name(m->g->act_dtype), dg_model_n_params(d), dg_model_flops_per_token(d));
    dg_graph_print(m->g, m->plan, out, 0);
    human(arena, a, sizeof a);
    human(sum, s, sizeof s);
    human(pbytes, p, sizeof p);
    human(cbytes, c, sizeof c);
    human(2 * pbytes, o, sizeof o);
    fprintf(out, "ops: %d forward, %d backward, %d zero-grad, %d optimizer\n", nops[DG_PHASE_FWD],
            nops[DG_PHASE_BWD], nops[DG_PHASE_ZERO], nops[DG_PHASE_OPT]);
    fprintf(out, "activation arena: %zu bytes (%s) for %zu bytes (%s) of activations: %.1f%% of the sum\n",
            arena, a, sum, s, sum ? 100.0 * (double)arena / (double)sum : 0.0);
    fprintf(out, "params (f32 master): %s, compute copy: %s, grads (f32): %s, AdamW m+v (f32): %s\n", p, c, p,
            o);
    if (m->tp > 1 || m->k > 1 || m->rep > 1) {
        char mesh[128];
        dg_mesh_format(&m->par.mesh, mesh, sizeof mesh);
        fprintf(out,
                "parallel: mesh %s at (%d, %d, %d); %d buckets of <= %.1f MB; overlap %s; prefetch budget "
                "%.1f MB; "
                "reshard after forward %s; the state above is this rank's shard\n",
                mesh, m->rep_rank, m->shard_rank, m->tp_rank, m->shard ? m->shard->n_buckets : 0,
                m->par.bucket_bytes / 1048576.0, m->par.overlap ? "on" : "off",
                m->par.prefetch_bytes / 1048576.0, m->par.reshard_after_forward ? "on" : "off");
    }
    return ferror(out) ? DG_ERR(DG_ERR_RUNTIME, "model: writing the plan failed") : DG_OK;
}
