/* ref64.c — float64 references for the graph tests: straightforward loops, no shared code with the
 * backends, so that agreement means something. */
#include "ref64.h"

#include "dg_ref_attn.h"
#include "dg_ref_dense.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void ref_encoder(double *out, const int32_t *tok, const double *wte, const double *wpe, int B, int T, int C) {
    dg_ref_encoder(out, tok, wte, wpe, B, T, C);
}

void ref_layernorm(double *out, const double *x, const double *w, const double *b, int N, int C) {
    for (int i = 0; i < N; i++) {
        const double *r = x + (size_t)i * C;
        double rstd, mean = dg_ref_row_mean_rstd(r, C, &rstd);
        for (int c = 0; c < C; c++)
            out[(size_t)i * C + c] = (r[c] - mean) * rstd * w[c] + b[c];
    }
}

void ref_matmul(double *out, const double *x, const double *w, const double *bias, int N, int C, int OC) {
    for (int i = 0; i < N; i++)
        for (int o = 0; o < OC; o++) {
            double s = bias ? bias[o] : 0.0;
            for (int c = 0; c < C; c++)
                s += x[(size_t)i * C + c] * w[(size_t)o * C + c];
            out[(size_t)i * OC + o] = s;
        }
}

void ref_gelu(double *out, const double *x, size_t n) {
    const double k = sqrt(2.0 / M_PI);
    for (size_t i = 0; i < n; i++)
        out[i] = 0.5 * x[i] * (1.0 + tanh(k * (x[i] + 0.044715 * x[i] * x[i] * x[i])));
}

void ref_attention(double *out, const double *qkv, int B, int T, int C, int NH) {
    double *p = malloc((size_t)T * sizeof *p);
    dg_ref_attention(out, qkv, B, T, C, NH, p);
    free(p);
}

void ref_crossentropy(double *losses, const double *logits, const int32_t *targets, int N, int V, int Vp) {
    for (int i = 0; i < N; i++) {
        const double *r = logits + (size_t)i * Vp;
        double mx = -INFINITY, z = 0;
        for (int j = 0; j < V; j++)
            if (r[j] > mx) mx = r[j];
        for (int j = 0; j < V; j++)
            z += exp(r[j] - mx);
        losses[i] = mx + log(z) - r[targets[i]];
    }
}

double ref_gpt_loss_sum(const ref_gpt_t *m, double *const *P, const int32_t *tokens, const int32_t *targets,
                        double *logits_out) {
    int B = m->B, T = m->T, C = m->C, N = B * T;
    size_t nc = (size_t)N * C;
    double *x = malloc(nc * sizeof *x), *h = malloc(nc * sizeof *h), *qkv = malloc(3 * nc * sizeof *qkv);
    double *a = malloc(nc * sizeof *a), *pr = malloc(nc * sizeof *pr), *f = malloc(4 * nc * sizeof *f);
    double *ge = malloc(4 * nc * sizeof *ge), *lg = calloc((size_t)N * m->Vp, sizeof *lg);
    double *ls = malloc((size_t)N * sizeof *ls);
    ref_encoder(x, tokens, P[0], P[1], B, T, C);
    for (int l = 0; l < m->L; l++) {
        double *const *q = P + 2 + 12 * l;
        ref_layernorm(h, x, q[0], q[1], N, C);
        ref_matmul(qkv, h, q[2], q[3], N, C, 3 * C);
        ref_attention(a, qkv, B, T, C, m->NH);
        ref_matmul(pr, a, q[4], q[5], N, C, C);
        for (size_t i = 0; i < nc; i++)
            x[i] += pr[i];
        ref_layernorm(h, x, q[6], q[7], N, C);
        ref_matmul(f, h, q[8], q[9], N, C, 4 * C);
        ref_gelu(ge, f, 4 * nc);
        ref_matmul(pr, ge, q[10], q[11], N, 4 * C, C);
        for (size_t i = 0; i < nc; i++)
            x[i] += pr[i];
    }
    ref_layernorm(h, x, P[2 + 12 * m->L], P[3 + 12 * m->L], N, C);
    ref_matmul(lg, h, P[0], NULL, N, C, m->Vp);
    ref_crossentropy(ls, lg, targets, N, m->V, m->Vp);
    double s = 0;
    for (int i = 0; i < N; i++)
        s += ls[i];
    if (logits_out) memcpy(logits_out, lg, (size_t)N * m->Vp * sizeof *lg);
    free(x), free(h), free(qkv), free(a), free(pr), free(f), free(ge), free(lg), free(ls);
    return s;
}

uint64_t ref_rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

double ref_rng_uniform(uint64_t *s) {
    return (double)(ref_rng_next(s) >> 11) * (1.0 / 9007199254740992.0);
}

void ref_fill(float *x, size_t n, double lo, double hi, uint64_t *s) {
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(lo + (hi - lo) * ref_rng_uniform(s));
}
