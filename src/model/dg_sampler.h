/* dg_sampler.h — choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), with a
 * seeded RNG, for `dgtrain sample` (docs/sampling.md).
 *
 * RNG: splitmix64 (Steele, Lea, Flood 2014): state += 0x9E3779B97F4A7C15 per draw, then the mix; a uniform
 * in [0, 1) is the top 53 bits times 2^-53. The state starts at the seed, so a seed fixes every draw.
 * Rules, applied in this order: temperature 0 = greedy (the lowest id among equal maxima; no draw);
 * otherwise logits / temperature, softmax (in double), keep the top_k most likely (0 = all; ties broken by
 * the lower id), then the smallest prefix of those, most likely first, whose probability reaches top_p
 * (1 = all; at least one token), renormalise and draw once. The same logits and seed give the same token
 * on every machine (the sort is a total order; the sums run in a fixed order).
 */
#ifndef DG_SAMPLER_H
#define DG_SAMPLER_H

#include <stdint.h>

#include "dg_common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dg_sampler_opts {
    double temperature; /* >= 0; 0 = greedy */
    int top_k;          /* >= 0; 0 = no limit */
    double top_p;       /* (0, 1] */
    uint64_t seed;
} dg_sampler_opts_t;

typedef struct dg_sampler dg_sampler_t;

/* DG_ERR_USAGE naming the value for temperature < 0 or not finite, top_k < 0, top_p outside (0, 1], V < 1. */
dg_status_t dg_sampler_create(const dg_sampler_opts_t *o, int V, dg_sampler_t **out);
void dg_sampler_free(dg_sampler_t *s);
/* Restart the RNG at `seed`. */
void dg_sampler_reseed(dg_sampler_t *s, uint64_t seed);
/* The next token for logits[0, V). */
int32_t dg_sampler_next(dg_sampler_t *s, const float *logits);
/* Index of the largest of n values (the lowest among equal maxima). */
int32_t dg_argmax(const float *x, int n);
/* splitmix64: advance *state and return the next 64-bit value. */
uint64_t dg_splitmix64(uint64_t *state);

#ifdef __cplusplus
}
#endif
#endif /* DG_SAMPLER_H */
