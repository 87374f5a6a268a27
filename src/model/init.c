/* init.c — model.init: start a fresh run from Hugging Face or llm.c weights, at any mesh (dg_hf.h). Every
 * rank maps the file, builds each full tensor in dgtrain's layout and sets the pieces it holds. */
#include <stdlib.h>
#include <string.h>

#include "model_io_impl.h"

typedef struct {
    const char *spec;
    int llmc;
    dg_st_file_t st;
    dg_hf_config_t hc;
    dg_llmc_file_t lc;
} src_t;

int dg_model_init_check(const char *spec, char *why, size_t cap) {
    if (!spec[0]) return 0;
    const char *path = NULL;
    if (!strncmp(spec, "hf:", 3)) path = spec + 3;
    if (!strncmp(spec, "llmc:", 5)) path = spec + 5;
    if (!path) {
        snprintf(why, cap,
                 "expected \"\" (random init), hf:DIR (a Hugging Face GPT-2 directory) or llmc:FILE "
                 "(an llm.c checkpoint)");
        return 1;
    }
    if (!path[0]) {
        snprintf(why, cap, "expected a path after '%.*s'", (int)(path - spec), spec);
        return 1;
    }
    return 0;
}

/* One size of the source against the run's model. */
static dg_status_t same(const char *spec, const char *field, int have, const char *key, int want) {
    if (have == want) return DG_OK;
    return DG_ERR(
        DG_ERR_USAGE,
        "model.init=%s: %s differs: the weights have %d, the run's model has %d (set model.%s = %d)", spec,
        field, have, want, key, have);
}

static dg_status_t check_shape(const src_t *s, const dg_model_desc_t *d) {
    int L, H, C, T, V;
    if (s->llmc)
        L = s->lc.n_layer, H = s->lc.n_head, C = s->lc.channels, T = s->lc.max_t, V = s->lc.vocab;
    else
        L = s->hc.n_layer, H = s->hc.n_head, C = s->hc.n_embd, T = s->hc.n_positions, V = s->hc.vocab_size;
    DG_TRY(same(s->spec, "n_layer", L, "n_layer", d->n_layer));
    DG_TRY(same(s->spec, "n_head", H, "n_head", d->n_head));
    DG_TRY(same(s->spec, s->llmc ? "channels (d_model)" : "n_embd (d_model)", C, "d_model", d->d_model));
    DG_TRY(same(s->spec, "vocab_size", V, "vocab_size", d->vocab_size));
    if (T < d->seq_len)
        return DG_ERR(
            DG_ERR_USAGE,
            "model.init=%s: %s differs: the weights have %d positions, fewer than the run's model.seq_len "
            "= %d (set model.seq_len <= %d)",
            s->spec, s->llmc ? "maxT (seq_len)" : "n_positions (seq_len)", T, d->seq_len, T);
    return DG_OK;
}

static dg_status_t src_open(src_t *s, const char *spec, const dg_model_desc_t *d) {
    memset(s, 0, sizeof *s);
    s->spec = spec;
    char why[256];
    if (dg_model_init_check(spec, why, sizeof why))
        return DG_ERR(DG_ERR_USAGE, "model.init = '%s': %s", spec, why);
    if (!strncmp(spec, "llmc:", 5)) {
        s->llmc = 1;
        DG_TRY(dg_llmc_open(spec + 5, &s->lc));
    } else {
        char path[4200];
        DG_TRY(dg_hf_config_read(spec + 3, &s->hc));
        snprintf(path, sizeof path, "%s/model.safetensors", spec + 3);
        DG_TRY(dg_st_open(path, &s->st));
    }
    return check_shape(s, d);
}

static void src_close(src_t *s) {
    if (s->llmc)
        dg_llmc_close(&s->lc);
    else
        dg_st_close(&s->st);
}

static const dg_st_tensor_t *hf_find(const src_t *s, const char *hf) {
    const dg_st_tensor_t *t = dg_st_find(&s->st, hf);
    if (!t && !strncmp(hf, "transformer.", 12)) t = dg_st_find(&s->st, hf + 12); /* a GPT2Model's file */
    return t;
}

/* Parameter `name` of global shape [rows, cols] from the HF file into out (dgtrain layout). */
static dg_status_t hf_get(const src_t *s, const dg_model_desc_t *d, const char *name, int64_t rows,
                          int64_t cols, float *out) {
    char hf[160];
    int layout = dg_hf_name(name, hf, sizeof hf);
    if (layout < 0) return DG_ERR(DG_ERR_RUNTIME, "model.init: no Hugging Face name for parameter %s", name);
    const dg_st_tensor_t *t = hf_find(s, hf);
    if (!t) return DG_ERR(DG_ERR_USAGE, "%s: tensor %s (dgtrain's %s) is missing", s->st.path, hf, name);
    int64_t er = rows, ec = cols, nd = cols ? 2 : 1;
    if (layout == DG_HF_TRANSPOSE) er = cols, ec = rows;
    if (layout == DG_HF_VOCAB) er = d->vocab_size;
    if (layout == DG_HF_POS) er = s->hc.n_positions;
    if (t->ndim != nd || t->shape[0] != er || (nd == 2 && t->shape[1] != ec))
        return DG_ERR(DG_ERR_USAGE, "%s: tensor %s has shape [%lld%s%lld], expected [%lld%s%lld]", s->st.path,
                      hf, (long long)t->shape[0], t->ndim == 2 ? ", " : "",
                      t->ndim == 2 ? (long long)t->shape[1] : 0LL, (long long)er, nd == 2 ? ", " : "",
                      nd == 2 ? (long long)ec : 0LL);
    size_t hn = (size_t)er * (size_t)(nd == 2 ? ec : 1), c = (size_t)(cols ? cols : 1);
    float *tmp = dg_xmalloc(hn * sizeof(float));
    dg_status_t st = dg_st_read_f32(&s->st, t, tmp);
    if (!st) {
        memset(out, 0, (size_t)rows * c * sizeof(float));
        if (layout == DG_HF_TRANSPOSE) {
            for (int64_t r = 0; r < rows; r++)
                for (int64_t k = 0; k < cols; k++)
                    out[r * cols + k] = tmp[k * rows + r];
        } else {
            memcpy(out, tmp,
                   (size_t)(er < rows ? er : rows) * c * sizeof(float)); /* vocab pad / position crop */
        }
    }
    free(tmp);
    return st;
}

/* The same from the llm.c file. */
static dg_status_t llmc_get(const src_t *s, const char *name, int64_t rows, int64_t cols, float *out) {
    static const char *k_names[16] = {"wte",
                                      "wpe",
                                      "ln_1.weight",
                                      "ln_1.bias",
                                      "attn.qkv.weight",
                                      "attn.qkv.bias",
                                      "attn.proj.weight",
                                      "attn.proj.bias",
                                      "ln_2.weight",
                                      "ln_2.bias",
                                      "mlp.fc.weight",
                                      "mlp.fc.bias",
                                      "mlp.proj.weight",
                                      "mlp.proj.bias",
                                      "ln_f.weight",
                                      "ln_f.bias"};
    uint64_t sz[16], base[16], acc = 0;
    dg_llmc_sizes(&s->lc, sz);
    for (int i = 0; i < 16; i++)
        base[i] = acc, acc += sz[i];
    int l = 0, k = 0;
    const char *leaf = name;
    if (sscanf(name, "h.%d.%n", &l, &k) == 1 && k > 0) leaf = name + k;
    int idx = -1;
    for (int i = 0; i < 16; i++)
        if (!strcmp(leaf, k_names[i])) idx = i;
    if (idx < 0 || (leaf != name) != (idx >= 2 && idx < 14) || l < 0 || l >= s->lc.n_layer)
        return DG_ERR(DG_ERR_RUNTIME, "model.init: no llm.c tensor for parameter %s", name);
    size_t c = (size_t)(cols ? cols : 1), n = (size_t)rows * c;
    const float *p = s->lc.params + base[idx];
    memset(out, 0, n * sizeof(float));
    if (idx == 0) /* first vocab rows of llm.c's padded table; dgtrain's own padding rows stay zero */
        memcpy(out, p, (size_t)s->lc.vocab * c * sizeof(float));
    else if (idx == 1) /* the first seq_len positions */
        memcpy(out, p, n * sizeof(float));
    else
        memcpy(out, p + (size_t)l * (sz[idx] / (uint64_t)(idx < 14 ? s->lc.n_layer : 1)), n * sizeof(float));
    return DG_OK;
}

/* GPT2LMHeadModel files may carry the tied head; dgtrain has one matrix for both, so they must agree. */
static dg_status_t check_head(const src_t *s, const dg_model_desc_t *d, const float *wte) {
    const dg_st_tensor_t *t = s->llmc ? NULL : dg_st_find(&s->st, "lm_head.weight");
    if (!t) return DG_OK;
    size_t n = (size_t)d->vocab_size * (size_t)d->d_model;
    if (t->ndim != 2 || t->shape[0] != d->vocab_size || t->shape[1] != d->d_model)
        return DG_ERR(DG_ERR_USAGE, "%s: lm_head.weight does not have the shape of transformer.wte.weight",
                      s->st.path);
    float *h = dg_xmalloc(n * sizeof(float));
    dg_status_t st = dg_st_read_f32(&s->st, t, h);
    if (!st && memcmp(h, wte, n * sizeof(float)) != 0)
        st = DG_ERR(DG_ERR_USAGE,
                    "%s: lm_head.weight differs from transformer.wte.weight (dgtrain ties them)", s->st.path);
    free(h);
    return st;
}

/* Copies this rank's pieces of the full tensor into its local tensor and sets it. */
static dg_status_t set_pieces(dg_model_t *m, int i, const float *full, int64_t cols) {
    size_t ln = dg_model_local_numel(m, i), c = (size_t)(cols ? cols : 1);
    if (ln == 0) return DG_OK;
    float *local = dg_xcalloc(ln, sizeof(float));
    dg_model_piece_t pc[DG_MODEL_MAX_PIECES];
    int np = dg_model_local_pieces(m, i, pc);
    for (int j = 0; j < np; j++)
        for (int64_t r = 0; r < pc[j].count[0]; r++)
            memcpy(local + pc[j].offset + (size_t)r * (size_t)pc[j].count[1],
                   full + (size_t)(pc[j].start[0] + r) * c + (size_t)pc[j].start[1],
                   (size_t)pc[j].count[1] * sizeof(float));
    dg_status_t s = dg_model_set_local(m, i, DG_STATE_PARAM, local);
    free(local);
    return s;
}

dg_status_t dg_model_init_weights(dg_model_t *m, const char *spec) {
    if (!spec || !spec[0]) return DG_OK;
    const dg_model_desc_t *d = dg_model_desc(m);
    src_t s;
    dg_status_t st = src_open(&s, spec, d);
    if (st) {
        src_close(&s);
        return st;
    }
    float *full = NULL;
    for (int i = 0; i < dg_model_n_tensors(m) && !st; i++) {
        const dg_param_info_t *p = dg_model_param(m, i);
        int64_t rows = p->shape[0], cols = p->ndim == 2 ? p->shape[1] : 0;
        full = realloc(full, p->numel * sizeof(float));
        DG_ASSERTF(full, "out of memory");
        st = s.llmc ? llmc_get(&s, p->name, rows, cols, full) : hf_get(&s, d, p->name, rows, cols, full);
        if (!st && i == 0) st = check_head(&s, d, full);
        if (!st) st = set_pieces(m, i, full, cols);
    }
    free(full);
    src_close(&s);
    if (!st) DG_LOG_INFO("init: weights from %s", spec);
    return st;
}
