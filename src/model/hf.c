/* hf.c — safetensors reader and writer, the dgtrain <-> Hugging Face GPT-2 name map, config.json, and
 * the export of a Hugging Face directory (dg_hf.h). */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model_io_impl.h"
#include "tokenizer.h"

/* ---------------- files ---------------- */

dg_status_t dg_mio_map(const char *path, const char *what, void **map, size_t *len) {
    *map = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return DG_ERR(DG_ERR_USAGE, "cannot open %s (%s): %s", path, what, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return DG_ERR(DG_ERR_USAGE, "%s is not a regular file (expected %s)", path, what);
    }
    if (st.st_size == 0) {
        close(fd);
        return DG_ERR(DG_ERR_USAGE, "%s is empty (expected %s)", path, what);
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return DG_ERR(DG_ERR_RUNTIME, "cannot map %s: %s", path, strerror(errno));
    *map = p;
    *len = (size_t)st.st_size;
    return DG_OK;
}

void dg_mio_unmap(void *map, size_t len) {
    if (map) munmap(map, len);
}

/* ---------------- safetensors ---------------- */

static size_t dtype_bytes(const char *dt) {
    if (!strcmp(dt, "F32")) return 4;
    if (!strcmp(dt, "F16") || !strcmp(dt, "BF16")) return 2;
    return 0;
}

static dg_status_t st_bad(const char *path, const char *why, const char *name) {
    return DG_ERR(DG_ERR_USAGE, "%s: bad safetensors header: %s%s%s", path, why, name ? " of tensor " : "",
                  name ? name : "");
}

static int jt_uint(const dg_jt_t *v, uint64_t *out) {
    if (!v || v->type != DG_JT_NUM || v->num < 0 || v->num > 9007199254740992.0 || v->num != floor(v->num))
        return -1;
    *out = (uint64_t)v->num;
    return 0;
}

/* One header entry into t; checks shape against the byte range. */
static dg_status_t st_entry(const dg_st_file_t *f, const char *name, const dg_jt_t *v, dg_st_tensor_t *t) {
    const dg_jt_t *dt = dg_jt_get(v, "dtype"), *sh = dg_jt_get(v, "shape"),
                  *off = dg_jt_get(v, "data_offsets");
    if (!dt || dt->type != DG_JT_STR || strlen(dt->str) >= sizeof t->dtype)
        return st_bad(f->path, "missing or bad dtype", name);
    if (!sh || sh->type != DG_JT_ARR || sh->n > 4) return st_bad(f->path, "missing or bad shape", name);
    if (!off || off->type != DG_JT_ARR || off->n != 2)
        return st_bad(f->path, "missing or bad data_offsets", name);
    if (strlen(name) >= sizeof t->name) return st_bad(f->path, "name too long", NULL);
    snprintf(t->name, sizeof t->name, "%s", name);
    snprintf(t->dtype, sizeof t->dtype, "%s", dt->str);
    t->ndim = sh->n;
    uint64_t numel = 1;
    for (int d = 0; d < sh->n; d++) {
        uint64_t s;
        if (jt_uint(&sh->items[d], &s) || s > (1ull << 40)) return st_bad(f->path, "bad shape", name);
        t->shape[d] = (int64_t)s;
        numel *= s;
    }
    if (jt_uint(&off->items[0], &t->begin) || jt_uint(&off->items[1], &t->end) || t->end < t->begin ||
        t->end > f->data_len)
        return st_bad(f->path, "data_offsets outside the file", name);
    size_t es = dtype_bytes(t->dtype);
    if (es && t->end - t->begin != numel * es)
        return st_bad(f->path, "data_offsets do not match shape and dtype", name);
    return DG_OK;
}

static dg_status_t st_parse(dg_st_file_t *f, const uint8_t *p, size_t len) {
    if (len < 8) return st_bad(f->path, "file shorter than the 8-byte header length", NULL);
    uint64_t hl = 0;
    for (int i = 0; i < 8; i++)
        hl |= (uint64_t)p[i] << (8 * i);
    if (hl < 2 || hl > len - 8 || hl > (100u << 20))
        return DG_ERR(DG_ERR_USAGE,
                      "%s: bad safetensors header: header length %llu does not fit the %zu-byte file",
                      f->path, (unsigned long long)hl, len);
    f->data = p + 8 + hl;
    f->data_len = len - 8 - hl;
    dg_jt_t root;
    if (dg_jt_parse((const char *)p + 8, (size_t)hl, &root) || root.type != DG_JT_OBJ) {
        if (root.type != DG_JT_OBJ) dg_jt_free(&root);
        return st_bad(f->path, "the header is not a JSON object", NULL);
    }
    f->t = dg_xcalloc((size_t)(root.n ? root.n : 1), sizeof *f->t);
    dg_status_t s = DG_OK;
    for (int i = 0; i < root.n && !s; i++) {
        if (!strcmp(root.keys[i], "__metadata__")) continue;
        if (root.items[i].type != DG_JT_OBJ) {
            s = st_bad(f->path, "entry is not an object", root.keys[i]);
            break;
        }
        s = st_entry(f, root.keys[i], &root.items[i], &f->t[f->n]);
        if (!s) f->n++;
    }
    dg_jt_free(&root);
    return s;
}

dg_status_t dg_st_open(const char *path, dg_st_file_t *out) {
    memset(out, 0, sizeof *out);
    snprintf(out->path, sizeof out->path, "%s", path);
    DG_TRY(dg_mio_map(path, "a safetensors file", &out->map, &out->map_len));
    dg_status_t s = st_parse(out, out->map, out->map_len);
    if (s) dg_st_close(out);
    return s;
}

void dg_st_close(dg_st_file_t *f) {
    dg_mio_unmap(f->map, f->map_len);
    free(f->t);
    f->map = NULL;
    f->t = NULL;
    f->n = 0;
}

const dg_st_tensor_t *dg_st_find(const dg_st_file_t *f, const char *name) {
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->t[i].name, name)) return &f->t[i];
    return NULL;
}

dg_status_t dg_st_read_f32(const dg_st_file_t *f, const dg_st_tensor_t *t, float *out) {
    const uint8_t *p = f->data + t->begin;
    size_t es = dtype_bytes(t->dtype), n = es ? (size_t)(t->end - t->begin) / es : 0;
    if (es == 4) {
        memcpy(out, p, n * 4); /* x86 is little-endian, as safetensors is */
        return DG_OK;
    }
    if (es == 2) {
        int bf = !strcmp(t->dtype, "BF16");
        for (size_t i = 0; i < n; i++)
            out[i] = dg_half_to_f32((uint16_t)(p[2 * i] | (p[2 * i + 1] << 8)), bf);
        return DG_OK;
    }
    return DG_ERR(DG_ERR_USAGE, "%s: tensor %s has dtype %s (allowed: F32, F16, BF16)", f->path, t->name,
                  t->dtype);
}

static dg_status_t write_all(FILE *fp, const void *p, size_t n, const char *path) {
    if (n && fwrite(p, 1, n, fp) != n)
        return DG_ERR(DG_ERR_RUNTIME, "cannot write %s: %s", path, strerror(errno));
    return DG_OK;
}

dg_status_t dg_st_write(const char *path, const dg_st_out_t *t, int n) {
    size_t cap = 64 + (size_t)n * 400, len = 0;
    char *h = dg_xmalloc(cap);
    len += (size_t)snprintf(h, cap, "{\"__metadata__\":{\"format\":\"pt\"}");
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        uint64_t numel = 1;
        len += (size_t)snprintf(h + len, cap - len, ",\"%s\":{\"dtype\":\"F32\",\"shape\":[", t[i].name);
        for (int d = 0; d < t[i].ndim; d++) {
            numel *= (uint64_t)t[i].shape[d];
            len += (size_t)snprintf(h + len, cap - len, "%s%lld", d ? "," : "", (long long)t[i].shape[d]);
        }
        len += (size_t)snprintf(h + len, cap - len, "],\"data_offsets\":[%llu,%llu]}",
                                (unsigned long long)off, (unsigned long long)(off + numel * 4));
        off += numel * 4;
    }
    len += (size_t)snprintf(h + len, cap - len, "}");
    DG_ASSERT(len + 8 < cap);
    while (len % 8)
        h[len++] = ' ';
    uint8_t le[8];
    for (int i = 0; i < 8; i++)
        le[i] = (uint8_t)((uint64_t)len >> (8 * i));
    FILE *fp = fopen(path, "wb");
    if (!fp) {
        free(h);
        return DG_ERR(DG_ERR_RUNTIME, "cannot create %s: %s", path, strerror(errno));
    }
    dg_status_t s = write_all(fp, le, 8, path);
    if (!s) s = write_all(fp, h, len, path);
    free(h);
    for (int i = 0; i < n && !s; i++) {
        size_t numel = (size_t)t[i].shape[0] * (size_t)(t[i].ndim == 2 ? t[i].shape[1] : 1);
        s = write_all(fp, t[i].data, numel * 4, path);
    }
    if (!s && (fflush(fp) != 0 || fsync(fileno(fp)) != 0))
        s = DG_ERR(DG_ERR_RUNTIME, "cannot write %s: %s", path, strerror(errno));
    if (fclose(fp) != 0 && !s) s = DG_ERR(DG_ERR_RUNTIME, "cannot close %s: %s", path, strerror(errno));
    return s;
}

/* ---------------- name map ---------------- */

/* A layer's parameters in pairs: a layer norm's weight and bias keep their names; a linear layer's are
 * renamed, and its weight is transposed (Hugging Face's GPT-2 stores Conv1D weights [in, out]). */
#define ROW(dg, hf, layout)                                                                                  \
    { dg, hf, layout }
#define PAIR(dg, hf, wlayout)                                                                                \
    ROW(dg ".weight", hf ".weight", wlayout), ROW(dg ".bias", hf ".bias", DG_HF_PLAIN)
#define NORM(name) PAIR(name, name, DG_HF_PLAIN)
#define LINEAR(dg, hf) PAIR(dg, hf, DG_HF_TRANSPOSE)
static const struct {
    const char *dg, *hf;
    int layout;
} k_layer_map[] = {
    NORM("ln_1"), LINEAR("attn.qkv", "attn.c_attn"), LINEAR("attn.proj", "attn.c_proj"),
    NORM("ln_2"), LINEAR("mlp.fc", "mlp.c_fc"),      LINEAR("mlp.proj", "mlp.c_proj"),
};
#undef ROW
#undef PAIR
#undef NORM
#undef LINEAR
#define N_LAYER_MAP ((int)(sizeof k_layer_map / sizeof k_layer_map[0]))

int dg_hf_name(const char *name, char *hf, size_t cap) {
    if (!strcmp(name, "wte")) return snprintf(hf, cap, "transformer.wte.weight"), DG_HF_VOCAB;
    if (!strcmp(name, "wpe")) return snprintf(hf, cap, "transformer.wpe.weight"), DG_HF_POS;
    if (!strcmp(name, "ln_f.weight") || !strcmp(name, "ln_f.bias"))
        return snprintf(hf, cap, "transformer.%s", name), DG_HF_PLAIN;
    int l, k = 0;
    if (sscanf(name, "h.%d.%n", &l, &k) != 1 || k == 0 || l < 0) return -1;
    for (int i = 0; i < N_LAYER_MAP; i++)
        if (!strcmp(name + k, k_layer_map[i].dg)) {
            snprintf(hf, cap, "transformer.h.%d.%s", l, k_layer_map[i].hf);
            return k_layer_map[i].layout;
        }
    return -1;
}

int dg_hf_n_params(const dg_model_desc_t *d) {
    return 4 + N_LAYER_MAP * d->n_layer;
}

void dg_hf_param(const dg_model_desc_t *d, int i, char *name, size_t cap, int64_t shape[2], int *ndim) {
    int64_t C = d->d_model;
    int L = d->n_layer;
    DG_ASSERT(i >= 0 && i < dg_hf_n_params(d));
    if (i < 2) {
        snprintf(name, cap, "%s", i ? "wpe" : "wte");
        shape[0] = i ? d->seq_len : d->padded_vocab, shape[1] = C, *ndim = 2;
        return;
    }
    if (i >= 2 + N_LAYER_MAP * L) {
        snprintf(name, cap, "ln_f.%s", i == 2 + N_LAYER_MAP * L ? "weight" : "bias");
        shape[0] = C, shape[1] = 0, *ndim = 1;
        return;
    }
    int l = (i - 2) / N_LAYER_MAP, k = (i - 2) % N_LAYER_MAP;
    snprintf(name, cap, "h.%d.%s", l, k_layer_map[k].dg);
    static const int rows[N_LAYER_MAP] = {1, 1, 3, 3, 1, 1, 1, 1, 4, 4, 1, 1}; /* in units of C */
    static const int cols[N_LAYER_MAP] = {0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 4, 0};
    shape[0] = rows[k] * C;
    shape[1] = cols[k] * C;
    *ndim = cols[k] ? 2 : 1;
}

/* ---------------- config.json ---------------- */

static dg_status_t cfg_int(const dg_jt_t *root, const char *path, const char *key, int *out) {
    const dg_jt_t *v = dg_jt_get(root, key);
    if (!v || v->type != DG_JT_NUM || v->num < 1 || v->num > 1e9 || v->num != floor(v->num))
        return DG_ERR(DG_ERR_USAGE, "%s: \"%s\" is missing or not a positive integer", path, key);
    *out = (int)v->num;
    return DG_OK;
}

static dg_status_t cfg_check(const dg_jt_t *r, const char *path, const dg_hf_config_t *c) {
    const dg_jt_t *v;
    if ((v = dg_jt_get(r, "model_type")) && (v->type != DG_JT_STR || strcmp(v->str, "gpt2")))
        return DG_ERR(DG_ERR_USAGE, "%s: model_type is not \"gpt2\" (dgtrain reads GPT-2 models only)", path);
    if ((v = dg_jt_get(r, "activation_function")) &&
        (v->type != DG_JT_STR || (strcmp(v->str, "gelu_new") && strcmp(v->str, "gelu_pytorch_tanh"))))
        return DG_ERR(DG_ERR_USAGE,
                      "%s: activation_function \"%s\" is not dgtrain's tanh GELU (allowed: gelu_new, "
                      "gelu_pytorch_tanh)",
                      path, v->type == DG_JT_STR ? v->str : "?");
    if ((v = dg_jt_get(r, "layer_norm_epsilon")) && (v->type != DG_JT_NUM || fabs(v->num - 1e-5) > 1e-12))
        return DG_ERR(DG_ERR_USAGE, "%s: layer_norm_epsilon %g is not dgtrain's 1e-05", path,
                      v->type == DG_JT_NUM ? v->num : NAN);
    if ((v = dg_jt_get(r, "n_inner")) && v->type != DG_JT_NULL &&
        (v->type != DG_JT_NUM || v->num != 4.0 * c->n_embd))
        return DG_ERR(DG_ERR_USAGE, "%s: n_inner is not null or 4 * n_embd = %d (dgtrain's MLP width)", path,
                      4 * c->n_embd);
    if ((v = dg_jt_get(r, "tie_word_embeddings")) && v->type == DG_JT_BOOL && !v->num)
        return DG_ERR(DG_ERR_USAGE, "%s: tie_word_embeddings is false (dgtrain ties lm_head to wte)", path);
    if ((v = dg_jt_get(r, "scale_attn_weights")) && v->type == DG_JT_BOOL && !v->num)
        return DG_ERR(DG_ERR_USAGE, "%s: scale_attn_weights is false (dgtrain scales by 1/sqrt(head_dim))",
                      path);
    if ((v = dg_jt_get(r, "scale_attn_by_inverse_layer_idx")) && v->type == DG_JT_BOOL && v->num)
        return DG_ERR(DG_ERR_USAGE, "%s: scale_attn_by_inverse_layer_idx is true (dgtrain does not)", path);
    return DG_OK;
}

dg_status_t dg_hf_config_read(const char *dir, dg_hf_config_t *out) {
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    void *map;
    size_t len;
    DG_TRY(dg_mio_map(path, "a Hugging Face config.json", &map, &len));
    dg_jt_t r;
    int bad = dg_jt_parse(map, len, &r) || r.type != DG_JT_OBJ;
    dg_mio_unmap(map, len);
    if (bad) {
        dg_jt_free(&r);
        return DG_ERR(DG_ERR_USAGE, "%s: not a JSON object", path);
    }
    dg_status_t s = cfg_int(&r, path, "n_layer", &out->n_layer);
    if (!s) s = cfg_int(&r, path, "n_head", &out->n_head);
    if (!s) s = cfg_int(&r, path, "n_embd", &out->n_embd);
    if (!s) s = cfg_int(&r, path, "n_positions", &out->n_positions);
    if (!s) s = cfg_int(&r, path, "vocab_size", &out->vocab_size);
    if (!s) s = cfg_check(&r, path, out);
    dg_jt_free(&r);
    return s;
}

/* ---------------- export ---------------- */

static dg_status_t write_text(const char *dir, const char *name, const char *text) {
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (!f) return DG_ERR(DG_ERR_RUNTIME, "cannot create %s: %s", path, strerror(errno));
    int bad = fputs(text, f) < 0;
    bad |= fflush(f) != 0 || fsync(fileno(f)) != 0;
    bad |= fclose(f) != 0;
    return bad ? DG_ERR(DG_ERR_RUNTIME, "cannot write %s: %s", path, strerror(errno)) : DG_OK;
}

static dg_status_t write_configs(const dg_model_desc_t *d, const char *dir) {
    char tok[64], buf[2048];
    /* GPT-2's <|endoftext|> (50256) exists only in its own vocabulary */
    if (d->vocab_size == 50257)
        snprintf(tok, sizeof tok, "50256");
    else
        snprintf(tok, sizeof tok, "null");
    dg_fmt(buf, sizeof buf,
           "{\n  \"architectures\": [\"GPT2LMHeadModel\"],\n  \"model_type\": \"gpt2\",\n"
           "  \"vocab_size\": %d,\n  \"n_positions\": %d,\n  \"n_ctx\": %d,\n  \"n_embd\": %d,\n"
           "  \"n_layer\": %d,\n  \"n_head\": %d,\n  \"n_inner\": null,\n"
           "  \"activation_function\": \"gelu_new\",\n  \"layer_norm_epsilon\": 1e-05,\n"
           "  \"initializer_range\": 0.02,\n  \"resid_pdrop\": 0.0,\n  \"embd_pdrop\": 0.0,\n"
           "  \"attn_pdrop\": 0.0,\n  \"scale_attn_weights\": true,\n  \"scale_attn_by_inverse_layer_idx\": "
           "false,\n"
           "  \"reorder_and_upcast_attn\": false,\n  \"tie_word_embeddings\": true,\n  \"use_cache\": true,\n"
           "  \"bos_token_id\": %s,\n  \"eos_token_id\": %s,\n  \"torch_dtype\": \"float32\"\n}\n",
           d->vocab_size, d->seq_len, d->seq_len, d->d_model, d->n_layer, d->n_head, tok, tok);
    DG_TRY(write_text(dir, "config.json", buf));
    dg_fmt(buf, sizeof buf, "{\n  \"bos_token_id\": %s,\n  \"eos_token_id\": %s\n}\n", tok, tok);
    return write_text(dir, "generation_config.json", buf);
}

static dg_status_t copy_file(const char *from_dir, const char *to_dir, const char *name, int required) {
    char a[4400], b[4400];
    snprintf(a, sizeof a, "%s/%s", from_dir, name);
    snprintf(b, sizeof b, "%s/%s", to_dir, name);
    void *map;
    size_t len;
    struct stat st;
    if (!required && stat(a, &st) != 0) return DG_OK;
    DG_TRY(dg_mio_map(a, "a tokenizer file", &map, &len));
    FILE *f = fopen(b, "wb");
    dg_status_t s =
        f ? write_all(f, map, len, b) : DG_ERR(DG_ERR_RUNTIME, "cannot create %s: %s", b, strerror(errno));
    if (f && fclose(f) != 0 && !s) s = DG_ERR(DG_ERR_RUNTIME, "cannot write %s: %s", b, strerror(errno));
    dg_mio_unmap(map, len);
    return s;
}

/* dgtrain layout src -> Hugging Face layout dst; returns the HF shape. */
static void to_hf(int layout, const dg_model_desc_t *d, const float *src, const int64_t shape[2], int ndim,
                  float *dst, int64_t hs[2]) {
    hs[0] = shape[0], hs[1] = shape[1];
    size_t cols = ndim == 2 ? (size_t)shape[1] : 1, rows = (size_t)shape[0];
    if (layout == DG_HF_TRANSPOSE) {
        hs[0] = shape[1], hs[1] = shape[0];
        for (size_t r = 0; r < rows; r++)
            for (size_t c = 0; c < cols; c++)
                dst[c * rows + r] = src[r * cols + c];
        return;
    }
    if (layout == DG_HF_VOCAB) hs[0] = rows = (size_t)d->vocab_size;
    memcpy(dst, src, rows * cols * sizeof(float));
}

static dg_status_t export_weights(const dg_model_desc_t *d, dg_hf_get_fn get, void *ctx, const char *tmp) {
    int n = dg_hf_n_params(d);
    dg_st_out_t *t = dg_xcalloc((size_t)n, sizeof *t);
    char(*names)[160] = dg_xcalloc((size_t)n, sizeof *names);
    dg_status_t s = DG_OK;
    float *buf = NULL;
    for (int i = 0; i < n && !s; i++) {
        char name[128];
        int64_t shape[2];
        int ndim;
        dg_hf_param(d, i, name, sizeof name, shape, &ndim);
        int layout = dg_hf_name(name, names[i], sizeof names[i]);
        DG_ASSERT(layout >= 0);
        size_t numel = (size_t)shape[0] * (size_t)(ndim == 2 ? shape[1] : 1);
        buf = realloc(buf, numel * sizeof(float));
        DG_ASSERTF(buf, "out of memory");
        s = get(ctx, name, buf, numel);
        if (s) break;
        float *dst = dg_xmalloc(numel * sizeof(float));
        to_hf(layout, d, buf, shape, ndim, dst, t[i].shape);
        t[i].name = names[i];
        t[i].ndim = ndim;
        t[i].data = dst;
    }
    free(buf);
    if (!s) {
        char path[4400];
        snprintf(path, sizeof path, "%s/model.safetensors", tmp);
        s = dg_st_write(path, t, n);
    }
    for (int i = 0; i < n; i++)
        free((void *)t[i].data);
    free(t);
    free(names);
    return s;
}

static void remove_tree(const char *dir) {
    static const char *files[] = {
        "model.safetensors", "config.json",    "generation_config.json", "vocab.json",
        "merges.txt",        "tokenizer.json", "tokenizer_config.json",  "special_tokens_map.json"};
    char p[4400];
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, files[i]);
        unlink(p);
    }
    rmdir(dir);
}

dg_status_t dg_hf_export(const dg_model_desc_t *d, dg_hf_get_fn get, void *ctx, const char *dir_arg,
                         const char *tok_dir, const struct dg_tokenizer *ranks) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", dir_arg);
    for (size_t n = strlen(dir); n > 1 && dir[n - 1] == '/'; n--) /* "out/" names "out", not "out/.tmp" */
        dir[n - 1] = 0;
    struct stat st;
    if (stat(dir, &st) == 0 && !S_ISDIR(st.st_mode))
        return DG_ERR(DG_ERR_USAGE, "%s already exists and is not a directory; remove it or choose another",
                      dir);
    if (tok_dir && d->vocab_size != 50257)
        return DG_ERR(DG_ERR_USAGE,
                      "--tokenizer %s: the model's vocab_size is %d, not GPT-2's 50257, so GPT-2's tokenizer "
                      "files do not fit it",
                      tok_dir, d->vocab_size);
    if (!tok_dir && ranks && dg_tokenizer_vocab_size(ranks) != d->vocab_size)
        return DG_ERR(DG_ERR_USAGE, "the tokenizer %s has %d tokens but the model's vocab_size is %d",
                      dg_tokenizer_source(ranks), dg_tokenizer_vocab_size(ranks), d->vocab_size);
    if (stat(dir, &st) == 0 && rmdir(dir) != 0)
        return DG_ERR(DG_ERR_USAGE,
                      "%s already exists and is not an empty directory; remove it or choose another", dir);
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", dir, (int)getpid());
    remove_tree(tmp);
    if (mkdir(tmp, 0775) != 0) return DG_ERR(DG_ERR_RUNTIME, "cannot create %s: %s", tmp, strerror(errno));
    dg_status_t s = export_weights(d, get, ctx, tmp);
    if (!s) s = write_configs(d, tmp);
    if (!s && tok_dir) {
        s = copy_file(tok_dir, tmp, "vocab.json", 1);
        if (!s) s = copy_file(tok_dir, tmp, "merges.txt", 1);
        if (!s) s = copy_file(tok_dir, tmp, "tokenizer.json", 0);
        if (!s) s = copy_file(tok_dir, tmp, "tokenizer_config.json", 0);
        if (!s) s = copy_file(tok_dir, tmp, "special_tokens_map.json", 0);
    } else if (!s && ranks) {
        s = dg_tokenizer_write_hf(ranks, tmp, d->seq_len);
    }
    if (!s && rename(tmp, dir) != 0)
        s = DG_ERR(DG_ERR_RUNTIME, "cannot rename %s to %s: %s", tmp, dir, strerror(errno));
    if (s) remove_tree(tmp);
    return s;
}
