/* dg_ref_attn.h — causal self-attention in double precision, the reference the backend tests
 * (tests/backend, oph_ref.c) and the graph tests (tests/graph, ref64.c) compare kernels with. qkv is
 * (B, T, 3C) with q, k, v side by side, heads of C / NH channels; out is (B, T, C). */
#ifndef DG_REF_ATTN_H
#define DG_REF_ATTN_H
#include <math.h>
#include <stddef.h>

/* p[0..t]: the softmax over positions 0..t of row t's scaled q.k scores (batch b, head h). */
static inline void dg_ref_att_probs(double *p, const double *qkv, int b, int h, int t, int T, int C, int NH) {
    int hs = C / NH;
    const double scale = 1.0 / sqrt((double)hs);
    const double *q = qkv + ((size_t)b * T + t) * 3 * C + (size_t)h * hs;
    for (int j = 0; j <= t; j++) {
        const double *k = qkv + ((size_t)b * T + j) * 3 * C + C + (size_t)h * hs;
        p[j] = 0;
        for (int d = 0; d < hs; d++)
            p[j] += q[d] * k[d] * scale;
    }
    double mx = p[0], sum = 0; /* the row's maximum: exp() of scores up to 0 */
    for (int j = 1; j <= t; j++)
        mx = fmax(mx, p[j]);
    for (int j = 0; j <= t; j++)
        sum += (p[j] = exp(p[j] - mx));
    for (int j = 0; j <= t; j++)
        p[j] /= sum;
}

/* The forward: out = softmax(q k^T / sqrt(hs), causal) v; p is scratch of T doubles. */
static inline void dg_ref_attention(double *out, const double *qkv, int B, int T, int C, int NH, double *p) {
    int hs = C / NH;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                dg_ref_att_probs(p, qkv, b, h, t, T, C, NH);
                double *o = out + ((size_t)b * T + t) * C + (size_t)h * hs;
                for (int d = 0; d < hs; d++) {
                    double s = 0;
                    for (int j = 0; j <= t; j++)
                        s += p[j] * qkv[((size_t)b * T + j) * 3 * C + 2 * C + (size_t)h * hs + d];
                    o[d] = s;
                }
            }
}
#endif
