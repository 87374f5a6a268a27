/* gpt2.c — the GPT-2 family on the model layer: presets and size checks, the builder that emits the
 * forward graph (parameter names, tensor-parallel placement), the FSDP grouping of parameters by name,
 * and the deterministic initialisation. The rest of src/model/ knows no GPT-2 specifics but through
 * model_impl.h's dg_gpt2_* functions.
 */
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model_impl.h"

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

dg_status_t dg_model_desc_resolve(const dg_model_spec_t *sp, dg_model_desc_t *out) {
    dg_model_desc_t d = {0};
    const char *preset = sp->preset ? sp->preset : "";
    int custom = strcmp(preset, "custom") == 0;
    if (!custom) DG_TRY(dg_model_desc_preset(preset, &d));
    struct {
        const char *key;
        int64_t v;
        int *dst;
    } o[] = {{"n_layer", sp->n_layer, &d.n_layer},
             {"n_head", sp->n_head, &d.n_head},
             {"d_model", sp->d_model, &d.d_model},
             {"seq_len", sp->seq_len, &d.seq_len},
             {"vocab_size", sp->vocab_size, &d.vocab_size}};
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

int dg_gpt2_decay_of(const dg_node_t *p, void *ctx) {
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
    m->gidx[i] = m->cur_gidx++;
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

dg_status_t dg_gpt2_build_forward(dg_model_t *m) {
    dg_graph_t *g = m->g;
    const dg_model_desc_t *d = &m->d;
    int64_t C = d->d_model, L = d->n_layer;
    int64_t bt[2] = {m->B, m->T};
    char nm[64];
    /* a pipeline chunk holds units [u0, u1): the embedding (unit 0), blocks l0..l1-1 (units 1..L), the
     * head (unit L + 1); the whole model is [0, L + 2) */
    const int has_emb = m->u0 == 0, has_head = m->u1 == L + 2;
    const int l0 = has_emb ? 0 : m->u0 - 1, l1 = has_head ? (int)L : m->u1 - 1;
    m->tokens = dg_graph_leaf(g, "tokens", DG_I32, 2, bt, DG_NF_INPUT);
    m->targets = dg_graph_leaf(g, "targets", DG_I32, 2, bt, DG_NF_INPUT);
    dg_node_t *wte = NULL, *wpe = NULL;
    m->cur_gidx = 0;
    if (has_emb) {
        wte = add_param(m, "wte", 2, d->padded_vocab, C, 0);
        wpe = add_param(m, "wpe", 2, d->seq_len, C, 0);
    }
    layer_params_t *lp = dg_xcalloc((size_t)L, sizeof *lp);
    for (int l = l0; l < l1 && !g->err; l++) {
        m->cur_gidx = 2 + 12 * l;
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
    dg_node_t *lnfw = NULL, *lnfb = NULL;
    if (has_head && !has_emb && !g->err) {
        /* the head's copy of the tied wte: the same initial values (global index 0), its gradient summed
         * with the embedding chunk's by the pipeline executor, counted in the norm by that chunk only */
        m->cur_gidx = 0;
        wte = add_param(m, "wte", 2, d->padded_vocab, C, 0);
        if (wte) wte->flags |= DG_NF_NORM_SKIP;
    }
    if (has_head && !g->err) {
        m->cur_gidx = 2 + 12 * (int)L;
        lnfw = add_param(m, "ln_f.weight", 1, C, 0, 0);
        lnfb = add_param(m, "ln_f.bias", 1, C, 0, 0);
    }

    /* tp > 1: column-parallel products read the replicated activation through a "from replicate" op
     * (identity; its backward sums the partial input gradients), row-parallel products' partial sums
     * become replicated through a "to replicate" all-reduce; the row-parallel bias is added once (tp
     * rank 0). With tp = 1 the graph is the plain single-rank one. */
    int tpar = m->tp > 1, r0 = m->tp_rank == 0;
    dg_node_t *x = NULL;
    if (has_emb) {
        x = dg_op_encoder(g, "encoder", m->tokens, wte, wpe);
    } else {
        int64_t btc[3] = {m->B, m->T, C};
        x = m->x_in = dg_graph_leaf(g, "pp.x_in", g->act_dtype, 3, btc, DG_NF_INPUT | DG_NF_WANT_GRAD);
    }
    for (int l = l0; l < l1 && !g->err; l++) {
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
    if (!has_head) {
        /* the chunk's output (the last block's res_2; found again by name after the passes, which may
         * replace the node) and its gradient, the seed of the backward */
        int64_t btc[3] = {m->B, m->T, C};
        m->x_out = x;
        dg_fmt(m->x_out_name, sizeof m->x_out_name, "h.%d.res_2", l1 - 1);
        m->dx_out = dg_graph_leaf(g, "pp.dx_out", g->act_dtype, 3, btc, DG_NF_INPUT);
        return g->err;
    }
    dg_node_t *xf = dg_op_layernorm(g, "ln_f", x, lnfw, lnfb);
    m->logits = dg_op_matmul(g, "lm_head", xf, wte, NULL); /* tied: logits = xf . wte^T */
    m->losses = dg_op_crossentropy(g, "loss", m->logits, m->targets, d->vocab_size);
    return g->err;
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
int64_t dg_model_global_row(const place_t *pl, int64_t lr) {
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
void dg_gpt2_init_tensor(const dg_model_t *m, int i, float *h) {
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
    /* every element is a function of (seed, tensor, global position) alone, so the rows are filled in
     * parallel with the same values in any thread count (gpt2-124m: ~5 s on one core otherwise) */
#pragma omp parallel for schedule(static) if (!constant && pl->nrows * lc >= 65536)
    for (int64_t lr = 0; lr < pl->nrows; lr++) {
        int64_t gr = dg_model_global_row(pl, lr);
        float *row = h + lr * lc;
        for (int64_t c = 0; c < lc; c++) {
            if (constant) {
                row[c] = cval;
                continue;
            }
            uint64_t e = (uint64_t)gr * (uint64_t)gcols + (uint64_t)(col0 + c);
            row[c] = gr < valid_rows ? (float)(std * normal(m->seed, (uint64_t)m->gidx[i], e)) : 0.0f;
        }
    }
}

int dg_gpt2_param_group(const dg_model_t *m, const char *nm) {
    if (strncmp(nm, "h.", 2) == 0) return 1 + atoi(nm + 2);
    if (strncmp(nm, "ln_f.", 5) == 0) return m->d.n_layer + 1;
    return 0; /* wte, wpe */
}
