/* sample_impl.h — private to `dgtrain sample`: the options, the loaded state and one generation, shared by
 * sample_cli.c (flags, output) and sample_run.c (checkpoint, tokenizer, backend, generation, bench). */
#ifndef DG_SAMPLE_IMPL_H
#define DG_SAMPLE_IMPL_H

#include <stdint.h>

#include "backend.h"
#include "dg_infer.h"
#include "dg_sampler.h"
#include "tokenizer.h"

typedef struct sample_opts {
    const char *src, *prompt, *prompt_file, *device, *tokenizer;
    int tokens, top_k, bench, json, ignore_eos, help;
    double temperature, top_p;
    uint64_t seed;
} sample_opts_t;

typedef struct sample_tok {
    const char *name;    /* "byte" | "gpt2" */
    dg_tokenizer_t *bpe; /* gpt2 only */
    int eot;             /* <|endoftext|> id, -1 when the tokenizer has none */
} sample_tok_t;

typedef struct sample_ctx {
    char ckpt[4096];
    int64_t step;
    char device[8];
    char tok_why[512]; /* "byte (why)" */
    sample_tok_t tok;
    dg_backend_t *be;
    dg_infer_t *eng;
    dg_sampler_t *smp;
    float *logits; /* vocab_size */
    double warm_ms;
} sample_ctx_t;

typedef struct sample_gen {
    int prompt_n;
    int32_t *ids; /* generated ids */
    int n;
    char *text; /* decoded generated text (NUL-terminated) */
    size_t tlen, tcap;
    double first_ms, tps, rest_s;
    const char *stop; /* "tokens" | "eos" | "context full (seq_len N)" */
    char stop_buf[64];
} sample_gen_t;

/* Everything before the first request: checkpoint, config, backend, engine and weights, tokenizer,
 * sampler; c->warm_ms is its wall time. On failure c is torn down already. */
dg_status_t dg_sample_setup(const sample_opts_t *o, sample_ctx_t *c);
void dg_sample_teardown(sample_ctx_t *c);
/* One request: encode text, prefill, then sample token by token; stream = write each token's bytes to stdout
 * and flush. */
dg_status_t dg_sample_generate(sample_ctx_t *c, const sample_opts_t *o, const char *text, size_t len,
                               int stream, sample_gen_t *g);
void dg_sample_gen_free(sample_gen_t *g);
/* The whole of a --prompt-file into a malloc'd, NUL-terminated buffer (*len bytes, NULs included). */
dg_status_t dg_sample_read_file(const char *path, char **out, size_t *len);
/* --bench: o->bench requests, the figures on stdout (JSON with o->json). */
dg_status_t dg_sample_bench(sample_ctx_t *c, const sample_opts_t *o);

#endif
