/* bench_train.h — what the training-step benches share (header-only; bench/fsdp, bench/pipeline,
 * bench/gpu/bench_step, bench/graph/graph_tokps):
 *   BENCH_GPT_FIELDS  the fields of a byte-level GPT's shape and step counts, for a bench's options struct;
 *                     BENCH_GPT_SPEC and BENCH_GPT_DST(&o) their options for bench_args.h (the spec and the
 *                     destinations, in the same order): --layers --d-model --heads --seq --micro --steps
 *                     --warmup
 *   bench_gpt_desc(&o)  the model description of o's shape (vocabulary 256, padded 256)
 *   bench_adamw(lr, t)  the AdamW step they all take: betas 0.9 / 0.95, eps 1e-8, weight decay 0.1, clip 1.0
 *   bench_lcg(&s)     one step of the 64-bit LCG their random tokens come from; the new state
 *   bench_fill_tokens(v, n, vocab, seed)  n tokens (state >> 33) % vocab, one LCG step each
 *   bench_median(v, n)  the median of n values (the mean of the middle two for even n); v is left as is */
#ifndef DG_BENCH_TRAIN_H
#define DG_BENCH_TRAIN_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bench_args.h"
#include "dg_model.h"

#define BENCH_GPT_FIELDS int layers, d_model, heads, seq, micro, steps, warmup
#define BENCH_GPT_SPEC "--layers=int --d-model=int --heads=int --seq=int --micro=int --steps=int --warmup=int"
#define BENCH_GPT_DST(o)                                                                                     \
    &(o)->layers, &(o)->d_model, &(o)->heads, &(o)->seq, &(o)->micro, &(o)->steps, &(o)->warmup

#define bench_gpt_desc(o) ((dg_model_desc_t){(o)->layers, (o)->heads, (o)->d_model, (o)->seq, 256, 256})

static inline dg_optim_hparams_t bench_adamw(float lr, int64_t t) {
    return (dg_optim_hparams_t){.lr = lr,
                                .beta1 = 0.9f,
                                .beta2 = 0.95f,
                                .eps = 1e-8f,
                                .weight_decay = 0.1f,
                                .grad_clip = 1.0f,
                                .t = t};
}

static inline uint64_t bench_lcg(uint64_t *s) {
    return *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
}

static inline void bench_fill_tokens(int32_t *v, size_t n, int vocab, uint64_t seed) {
    for (size_t i = 0; i < n; i++)
        v[i] = (int32_t)((bench_lcg(&seed) >> 33) % (uint64_t)vocab);
}

static inline int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static inline double bench_median(const double *v, int n) {
    double *c = malloc((size_t)n * sizeof *c);
    memcpy(c, v, (size_t)n * sizeof *c);
    qsort(c, (size_t)n, sizeof *c, bench_cmp_double);
    double r = n % 2 ? c[n / 2] : 0.5 * (c[n / 2 - 1] + c[n / 2]);
    free(c);
    return r;
}

#endif
