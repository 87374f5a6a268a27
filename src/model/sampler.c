/* sampler.c — dg_sampler.h: greedy / temperature / top-k / top-p with splitmix64. */
#include "dg_sampler.h"

#include <math.h>
#include <stdlib.h>

struct dg_sampler {
    dg_sampler_opts_t o;
    int V;
    uint64_t state;
    int32_t *idx; /* V candidate ids */
    double *prob; /* V probabilities, indexed by id */
};

uint64_t dg_splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double uniform01(uint64_t *state) {
    return (double)(dg_splitmix64(state) >> 11) * 0x1.0p-53;
}

dg_status_t dg_sampler_create(const dg_sampler_opts_t *o, int V, dg_sampler_t **out) {
    *out = NULL;
    if (!(o->temperature >= 0) || !isfinite(o->temperature))
        return DG_ERR(DG_ERR_USAGE, "--temperature %g: expected a finite value >= 0 (0 = greedy)",
                      o->temperature);
    if (o->top_k < 0) return DG_ERR(DG_ERR_USAGE, "--top-k %d: expected >= 0 (0 = no limit)", o->top_k);
    if (!(o->top_p > 0 && o->top_p <= 1))
        return DG_ERR(DG_ERR_USAGE, "--top-p %g: expected a value in (0, 1] (1 = no limit)", o->top_p);
    if (V < 1) return DG_ERR(DG_ERR_USAGE, "sampler: vocabulary of %d tokens; expected >= 1", V);
    dg_sampler_t *s = dg_xcalloc(1, sizeof *s);
    s->o = *o;
    s->V = V;
    s->state = o->seed;
    s->idx = dg_xmalloc((size_t)V * sizeof *s->idx);
    s->prob = dg_xmalloc((size_t)V * sizeof *s->prob);
    *out = s;
    return DG_OK;
}

void dg_sampler_free(dg_sampler_t *s) {
    if (!s) return;
    free(s->idx);
    free(s->prob);
    free(s);
}

void dg_sampler_reseed(dg_sampler_t *s, uint64_t seed) {
    s->state = seed;
}

int32_t dg_argmax(const float *x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static const double *g_sort_prob; /* qsort has no context argument; the sampler is single-threaded */

static int by_prob_desc(const void *a, const void *b) {
    const int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    const double pi = g_sort_prob[i], pj = g_sort_prob[j];
    if (pi != pj) return pi > pj ? -1 : 1;
    return i < j ? -1 : (i > j);
}

int32_t dg_sampler_next(dg_sampler_t *s, const float *logits) {
    const int V = s->V;
    if (s->o.temperature == 0) return dg_argmax(logits, V);
    const double mx = logits[dg_argmax(logits, V)], inv_t = 1.0 / s->o.temperature;
    double sum = 0;
    for (int i = 0; i < V; i++) {
        s->prob[i] = exp(((double)logits[i] - mx) * inv_t);
        sum += s->prob[i];
        s->idx[i] = i;
    }
    int n = V;
    if ((s->o.top_k > 0 && s->o.top_k < V) || s->o.top_p < 1) {
        g_sort_prob = s->prob;
        qsort(s->idx, (size_t)V, sizeof *s->idx, by_prob_desc);
        if (s->o.top_k > 0 && s->o.top_k < n) n = s->o.top_k;
        double kept = 0;
        for (int i = 0; i < n; i++)
            kept += s->prob[s->idx[i]];
        if (s->o.top_p < 1) {
            double acc = 0;
            int m = 0;
            while (m < n) {
                acc += s->prob[s->idx[m++]];
                if (acc >= s->o.top_p * kept) break;
            }
            n = m;
            kept = acc;
        }
        sum = kept;
    }
    const double r = uniform01(&s->state) * sum;
    double acc = 0;
    for (int i = 0; i < n; i++) {
        acc += s->prob[s->idx[i]];
        if (r < acc) return s->idx[i];
    }
    return s->idx[n - 1];
}
