/* sample_run.c — `dgtrain sample` behind the flags (sample_impl.h): which checkpoint, which tokenizer, the
 * backend and the engine (the warm-up), then one request or a --bench series. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <mpi.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "checkpoint.h"
#include "config.h"
#include "dg_json.h"
#include "sample_impl.h"

/* ---------------- checkpoint ---------------- */

/* A file is taken as it is (it must pass the structural check); a directory holding checkpoints (or LATEST)
 * is a checkpoint directory, any other directory a run directory whose checkpoints are in checkpoints/. */
static dg_status_t find_checkpoint(const char *src, char *out, size_t cap) {
    struct stat st;
    if (stat(src, &st) != 0) return DG_ERR(DG_ERR_USAGE, "no checkpoint: '%s' does not exist", src);
    if (!S_ISDIR(st.st_mode)) return dg_ckpt_resolve_resume(MPI_COMM_SELF, NULL, src, 0, out, cap);
    dg_ckpt_dir_entry_t *ents = NULL;
    int n = 0;
    char latest[256] = "";
    DG_TRY(dg_ckpt_list_dir(src, &ents, &n, latest));
    free(ents);
    char dir[4096];
    if (n > 0 || latest[0])
        snprintf(dir, sizeof dir, "%s", src);
    else
        snprintf(dir, sizeof dir, "%s/checkpoints", src);
    DG_TRY(dg_ckpt_resolve_resume(MPI_COMM_SELF, dir, "auto", 0, out, cap));
    if (!out[0])
        return DG_ERR(DG_ERR_USAGE,
                      "no checkpoint in '%s' (looked for step_*.h5 in %s); train with "
                      "checkpoint.every or let a run finish first",
                      src, dir);
    return DG_OK;
}

static dg_status_t read_config(const char *path, const dg_ckpt_info_t *info, dg_config_t *cfg,
                               dg_model_desc_t *d) {
    const char *text = info->meta.config_text;
    if (!text || !*text)
        return DG_ERR(DG_ERR_USAGE, "checkpoint %s stores no config: cannot tell the model", path);
    DG_TRY(dg_config_load_buffer(cfg, path, text, strlen(text), 0, NULL));
    dg_model_spec_t sp = {cfg->model.preset,  cfg->model.n_layer, cfg->model.n_head,
                          cfg->model.d_model, cfg->model.seq_len, cfg->model.vocab_size};
    return dg_model_desc_resolve(&sp, d);
}

static const dg_ckpt_entry_t *find_entry(const dg_ckpt_info_t *info, const char *path) {
    for (int i = 0; i < info->n_entries; i++)
        if (strcmp(info->entries[i].path, path) == 0) return &info->entries[i];
    return NULL;
}

/* Read every model/ tensor the engine has, as full fp32 tensors (any world size wrote them), and upload. */
static dg_status_t load_weights(dg_infer_t *e, const char *path, const dg_ckpt_info_t *info) {
    const int n = dg_infer_n_tensors(e);
    dg_ckpt_tensor_t *t = dg_xcalloc((size_t)n, sizeof *t);
    char **paths = dg_xcalloc((size_t)n, sizeof *paths);
    dg_status_t s = DG_OK;
    for (int i = 0; i < n && s == DG_OK; i++) {
        char p[512];
        dg_fmt(p, sizeof p, "model/%s", dg_infer_tensor_name(e, i));
        paths[i] = dg_xstrdup(p);
        const dg_ckpt_entry_t *en = find_entry(info, p);
        size_t numel = 1;
        for (int k = 0; en && k < en->ndim; k++)
            numel *= (size_t)en->shape[k];
        if (!en)
            s = DG_ERR(DG_ERR_USAGE, "checkpoint %s has no tensor %s", path, p);
        else if (numel != dg_infer_tensor_numel(e, i))
            s = DG_ERR(DG_ERR_USAGE, "checkpoint %s: %s has %zu elements; its stored config gives %zu", path,
                       p, numel, dg_infer_tensor_numel(e, i));
        if (s != DG_OK) break;
        t[i].path = paths[i];
        t[i].ndim = en->ndim;
        for (int k = 0; k < en->ndim; k++)
            t[i].gshape[k] = t[i].count[k] = en->shape[k];
        t[i].owner = 1;
        t[i].data = dg_xmalloc(numel * sizeof(float));
    }
    if (s == DG_OK) s = dg_ckpt_load(MPI_COMM_SELF, path, NULL, t, n);
    for (int i = 0; i < n && s == DG_OK; i++)
        s = dg_infer_set_tensor(e, i, t[i].data);
    for (int i = 0; i < n; i++) {
        free(t[i].data);
        free(paths[i]);
    }
    free(t);
    free(paths);
    return s;
}

/* ---------------- backend and tokenizer ---------------- */

static dg_status_t make_backend(const sample_opts_t *o, const dg_config_t *cfg, sample_ctx_t *c) {
    dg_backend_config_t bc = {0};
    cpu_set_t set;
    bc.threads = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
    if (bc.threads < 1) bc.threads = 1;
    bc.seed = (uint64_t)cfg->run.seed;
    const char *want = o->device ? o->device : cfg->parallel.backend;
#ifdef DG_HAVE_CUDA
    if (strcmp(want, "cuda") == 0 || strcmp(want, "auto") == 0) {
        /* fp8 trains its GEMMs in FP8; sampling runs its bf16 activations in bf16 */
        const dg_precision_t pr = cfg->train.precision_id;
        bc.act_dtype = pr == DG_PREC_BF16 || pr == DG_PREC_FP8 ? DG_BF16
                       : pr == DG_PREC_FP16                    ? DG_F16
                                                               : DG_F32;
        dg_status_t s = dg_backend_cuda_create(&bc, &c->be);
        if (s == DG_OK) {
            snprintf(c->device, sizeof c->device, "cuda");
            return DG_OK;
        }
        if (strcmp(want, "cuda") == 0) return s;
        dg_clear_error();
        bc.act_dtype = DG_F32;
    }
#else
    if (strcmp(want, "cuda") == 0)
        return DG_ERR(DG_ERR_USAGE,
                      "%s cuda, but this dgtrain was built without CUDA (configure with -DDGT_CUDA=ON)",
                      o->device ? "--device" : "the run's parallel.backend is");
#endif
    snprintf(c->device, sizeof c->device, "cpu");
    return dg_backend_cpu_create(&bc, &c->be); /* fp32 whatever train.precision was */
}

/* `recorded` is the checkpoint's DG_TRAIN_KV_TOKENIZER (NULL for checkpoints of data that records none):
 * what the run's shards say beats the vocab_size guess. */
static dg_status_t pick_tokenizer(const sample_opts_t *o, const dg_config_t *cfg, int V, const char *recorded,
                                  sample_ctx_t *c) {
    const char *name = o->tokenizer, *why = "--tokenizer";
    if (strcmp(name, "auto") == 0) {
        if (recorded && strcmp(recorded, "bytes") == 0)
            name = "byte", why = "the run's data records a byte-level tokenizer";
        else if (recorded && strncmp(recorded, "bpe:", 4) == 0)
            name = "gpt2", why = "the run's data records a BPE tokenizer";
        else if (!cfg->data.train[0])
            name = "byte", why = "the run trained on the embedded default data, byte-level";
        else if (V == 256)
            name = "byte", why = "the run's vocab_size is 256: byte-level data";
        else if (V >= DG_TOKENIZER_GPT2_VOCAB)
            name = "gpt2", why = "the run's vocab_size is >= 50257: data of dgprep --tokenizer gpt2";
        else
            return DG_ERR(DG_ERR_USAGE,
                          "cannot tell the tokenizer of the run's data (%s) from its vocab_size %d; "
                          "pass --tokenizer byte or --tokenizer gpt2",
                          cfg->data.train, V);
    }
    c->tok.eot = -1;
    if (strcmp(name, "byte") == 0) {
        if (V < 256)
            return DG_ERR(DG_ERR_USAGE, "--tokenizer byte needs vocab_size >= 256; the model has %d", V);
        c->tok.name = "byte";
    } else {
        if (V < DG_TOKENIZER_GPT2_VOCAB)
            return DG_ERR(DG_ERR_USAGE, "--tokenizer gpt2 needs vocab_size >= %d; the model has %d",
                          DG_TOKENIZER_GPT2_VOCAB, V);
        char p[4096];
        DG_TRY(dg_tokenizer_find_gpt2(NULL, p, sizeof p));
        DG_TRY(dg_tokenizer_load_tiktoken(p, &c->tok.bpe));
        unsigned long long fp = 0;
        if (recorded && sscanf(recorded, "bpe:%16llx", &fp) == 1 &&
            fp != dg_tokenizer_fingerprint(c->tok.bpe))
            DG_LOG_WARN(
                "the run's data was made with the BPE tokenizer %s, not GPT-2's ranks in %s (bpe:%016llx): "
                "the text may not decode as trained",
                recorded, p, (unsigned long long)dg_tokenizer_fingerprint(c->tok.bpe));
        c->tok.name = "gpt2";
        c->tok.eot = dg_tokenizer_eot(c->tok.bpe);
    }
    snprintf(c->tok_why, sizeof c->tok_why, "%s (%s)", c->tok.name, why);
    return DG_OK;
}

dg_status_t dg_sample_setup(const sample_opts_t *o, sample_ctx_t *c) {
    memset(c, 0, sizeof *c);
    const double t0 = dg_now_s();
    dg_ckpt_info_t info;
    memset(&info, 0, sizeof info);
    dg_config_t *cfg = dg_xcalloc(1, sizeof *cfg);
    dg_model_desc_t d;
    dg_status_t s = find_checkpoint(o->src, c->ckpt, sizeof c->ckpt);
    if (s == DG_OK) s = dg_ckpt_info_read(c->ckpt, &info);
    if (s == DG_OK) s = read_config(c->ckpt, &info, cfg, &d);
    if (s == DG_OK) s = pick_tokenizer(o, cfg, d.vocab_size, dg_ckpt_meta_get_kv(&info.meta, "tokenizer"), c);
    if (s == DG_OK) s = make_backend(o, cfg, c);
    if (s == DG_OK) s = dg_infer_create(&d, c->be, 0, &c->eng);
    if (s == DG_OK) s = load_weights(c->eng, c->ckpt, &info);
    dg_sampler_opts_t so = {o->temperature, o->top_k, o->top_p, o->seed};
    if (s == DG_OK) s = dg_sampler_create(&so, d.vocab_size, &c->smp);
    if (s == DG_OK && c->be->ops->sync) s = c->be->ops->sync(c->be);
    c->step = info.meta.step;
    c->logits = dg_xmalloc((size_t)d.vocab_size * sizeof(float));
    c->warm_ms = (dg_now_s() - t0) * 1e3;
    dg_ckpt_info_destroy(&info);
    free(cfg);
    if (s != DG_OK) dg_sample_teardown(c);
    return s;
}

void dg_sample_teardown(sample_ctx_t *c) {
    dg_sampler_free(c->smp);
    dg_infer_free(c->eng);
    dg_backend_free(c->be);
    dg_tokenizer_free(c->tok.bpe);
    free(c->logits);
    memset(c, 0, sizeof *c);
}

/* ---------------- generation ---------------- */

dg_status_t dg_sample_read_file(const char *path, char **out, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return DG_ERR(DG_ERR_USAGE, "--prompt-file %s: cannot open it: %s", path, strerror(errno));
    int e = dg_read_stream(f, SIZE_MAX, out, len);
    fclose(f);
    return e ? DG_ERR(DG_ERR_USAGE, "--prompt-file %s: read error", path) : DG_OK;
}

static dg_status_t encode(const sample_tok_t *t, const char *text, size_t len, dg_tok_ids_t *ids) {
    if (t->bpe) return dg_tokenizer_encode(t->bpe, text, len, ids, NULL);
    ids->v = dg_xmalloc((len ? len : 1) * sizeof *ids->v);
    ids->n = ids->cap = len;
    for (size_t i = 0; i < len; i++)
        ids->v[i] = (uint8_t)text[i];
    return DG_OK;
}

static void emit(const sample_ctx_t *c, sample_gen_t *g, int32_t id, int stream) {
    uint8_t byte = (uint8_t)id;
    size_t n = 1;
    const uint8_t *b = &byte;
    if (c->tok.bpe) b = dg_tokenizer_token_bytes(c->tok.bpe, id, &n);
    if (!b) n = 0; /* an id of the padded-out model vocabulary that the tokenizer lacks */
    if (g->tlen + n + 1 > g->tcap) {
        g->tcap = (g->tlen + n + 1) * 2;
        g->text = realloc(g->text, g->tcap);
        DG_ASSERT(g->text);
    }
    memcpy(g->text + g->tlen, b, n);
    g->tlen += n;
    g->text[g->tlen] = 0;
    if (stream && n) {
        fwrite(b, 1, n, stdout);
        fflush(stdout);
    }
}

void dg_sample_gen_free(sample_gen_t *g) {
    free(g->ids);
    free(g->text);
    memset(g, 0, sizeof *g);
}

static dg_status_t prefill(sample_ctx_t *c, const char *text, size_t len, sample_gen_t *g) {
    const int S = dg_infer_desc(c->eng)->seq_len;
    dg_tok_ids_t ids = {0};
    dg_status_t s = encode(&c->tok, text, len, &ids);
    if (s == DG_OK && ids.n == 0)
        s = DG_ERR(DG_ERR_USAGE, "the prompt is empty (0 tokens); expected at least one token");
    if (s == DG_OK && ids.n > (size_t)S)
        s = DG_ERR(DG_ERR_USAGE,
                   "the prompt is %zu tokens (%s tokenizer); the model's context holds seq_len = %d", ids.n,
                   c->tok.name, S);
    if (s == DG_OK) {
        g->prompt_n = (int)ids.n;
        dg_infer_reset(c->eng);
        s = dg_infer_feed(c->eng, ids.v, (int)ids.n, 0, c->logits);
    }
    dg_tok_ids_free(&ids);
    return s;
}

dg_status_t dg_sample_generate(sample_ctx_t *c, const sample_opts_t *o, const char *text, size_t len,
                               int stream, sample_gen_t *g) {
    memset(g, 0, sizeof *g);
    const double t0 = dg_now_s();
    DG_TRY(prefill(c, text, len, g));
    const int S = dg_infer_desc(c->eng)->seq_len;
    g->ids = dg_xmalloc((size_t)o->tokens * sizeof *g->ids);
    dg_sampler_reseed(c->smp, o->seed);
    double t_first = t0;
    for (;;) {
        const int32_t t = dg_sampler_next(c->smp, c->logits);
        if (g->n == 0) {
            t_first = dg_now_s();
            g->first_ms = (t_first - t0) * 1e3;
        }
        if (t == c->tok.eot && !o->ignore_eos) {
            g->stop = "eos";
            break;
        }
        g->ids[g->n++] = t;
        emit(c, g, t, stream);
        if (g->n >= o->tokens) {
            g->stop = "tokens";
            break;
        }
        if (dg_infer_pos(c->eng) >= S) {
            snprintf(g->stop_buf, sizeof g->stop_buf, "context full (seq_len %d)", S);
            g->stop = g->stop_buf;
            break;
        }
        DG_TRY(dg_infer_feed(c->eng, &t, 1, 0, c->logits));
    }
    g->rest_s = dg_now_s() - t_first;
    g->tps = g->n > 1 && g->rest_s > 0 ? (g->n - 1) / g->rest_s : 0;
    return DG_OK;
}

/* ---------------- --bench ---------------- */

static const char k_bench_text[] =
    "The quick brown fox jumps over the lazy dog. Training a transformer on many machines needs care with "
    "checkpoints, communication and memory; sampling from it needs only a cache of keys and values. ";

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(const double *sorted, int n, double p) { /* nearest rank */
    int k = (int)ceil(p * n) - 1;
    return sorted[k < 0 ? 0 : k >= n ? n - 1 : k];
}

/* The i-th built-in prompt: 8, 16, 32, 64, 128 bytes of k_bench_text (repeated), at most seq_len - 1. */
static size_t bench_prompt(int i, int S, char *buf, size_t cap) {
    size_t len = (size_t)8 << (i % 5), tl = sizeof k_bench_text - 1;
    if (len > (size_t)S - 1 && S > 1) len = (size_t)S - 1;
    if (len >= cap) len = cap - 1;
    for (size_t k = 0; k < len; k++)
        buf[k] = k_bench_text[k % tl];
    buf[len] = 0;
    return len;
}

static void bench_report(const sample_ctx_t *c, const sample_opts_t *o, const double *lat, const int *plen,
                         double tps) {
    const int N = o->bench;
    double *sorted = dg_xmalloc((size_t)N * sizeof *sorted);
    memcpy(sorted, lat, (size_t)N * sizeof *sorted);
    qsort(sorted, (size_t)N, sizeof *sorted, cmp_double);
    const double p50 = pct(sorted, N, 0.50), p99 = pct(sorted, N, 0.99);
    free(sorted);
    if (o->json) {
        printf("{\"checkpoint\":");
        dg_json_fputs(stdout, c->ckpt);
        printf(",\"device\":\"%s\",\"dtype\":\"%s\",\"tokenizer\":\"%s\",\"bench\":%d,\"prompt_tokens\":[",
               c->device, dg_dtype_name(c->be->act_dtype), c->tok.name, N);
        for (int i = 0; i < N; i++)
            printf("%s%d", i ? "," : "", plen[i]);
        printf("],\"first_token_ms\":[");
        for (int i = 0; i < N; i++)
            printf("%s%.3f", i ? "," : "", lat[i]);
        printf("],\"first_token_ms_p50\":%.3f,\"first_token_ms_p99\":%.3f,\"tokens_per_s\":%.3f,\"warmup_"
               "ms\":%.3f}\n",
               p50, p99, tps, c->warm_ms);
    } else {
        printf("bench: %d prompts on %s (%s), up to %d tokens each, warm-up %.1f ms\n", N, c->device,
               dg_dtype_name(c->be->act_dtype), o->tokens, c->warm_ms);
        printf("bench: first-token latency p50 %.2f ms, p99 %.2f ms; %.1f tokens/s after the first\n", p50,
               p99, tps);
    }
    fflush(stdout);
}

dg_status_t dg_sample_bench(sample_ctx_t *c, const sample_opts_t *o) {
    char *given = NULL;
    size_t glen = 0;
    if (o->prompt) given = dg_xstrdup(o->prompt), glen = strlen(o->prompt);
    dg_status_t s = DG_OK;
    if (o->prompt_file) s = dg_sample_read_file(o->prompt_file, &given, &glen);
    if (s != DG_OK) return s;
    const int N = o->bench, S = dg_infer_desc(c->eng)->seq_len;
    double *lat = dg_xcalloc((size_t)N, sizeof *lat), rest_s = 0;
    int *plen = dg_xcalloc((size_t)N, sizeof *plen);
    long rest_tokens = 0;
    char buf[256];
    sample_opts_t oi = *o;
    for (int i = 0; i < N && s == DG_OK; i++) {
        const char *text = given ? given : buf;
        size_t len = given ? glen : bench_prompt(i, S, buf, sizeof buf);
        sample_gen_t g;
        oi.seed = o->seed + (uint64_t)i;
        s = dg_sample_generate(c, &oi, text, len, 0, &g);
        lat[i] = g.first_ms;
        plen[i] = g.prompt_n;
        rest_tokens += g.n > 1 ? g.n - 1 : 0;
        rest_s += g.n > 1 ? g.rest_s : 0;
        dg_sample_gen_free(&g);
    }
    if (s == DG_OK) bench_report(c, o, lat, plen, rest_s > 0 ? rest_tokens / rest_s : 0);
    free(lat);
    free(plen);
    free(given);
    return s;
}
