/* oph_ref.c — the op harness's float64 reference of every op (plain C, never another backend's code). */
#include "oph.h"

#include "dg_ref_attn.h"
#include "dg_ref_dense.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

/* ======================= float64 references ======================= */

void oph_ref_encoder(double *out, const int32_t *tok, const double *wte, const double *wpe, int B, int T,
                     int C) {
    dg_ref_encoder(out, tok, wte, wpe, B, T, C);
}

void oph_ref_layernorm(double *out, double *mean, double *rstd, const double *x, const double *w,
                       const double *b, int N, int C) {
    for (int r = 0; r < N; r++) {
        const double *xr = x + (size_t)r * C;
        double rs, m = dg_ref_row_mean_rstd(xr, C, &rs);
        for (int c = 0; c < C; c++)
            out[(size_t)r * C + c] = (xr[c] - m) * rs * w[c] + b[c];
        if (mean) mean[r] = m;
        if (rstd) rstd[r] = rs;
    }
}
void oph_ref_layernorm_bwd(double *dx, double *dw, double *db, const double *dy, const double *x,
                           const double *w, int N, int C) {
    for (int r = 0; r < N; r++) {
        const double *xr = x + (size_t)r * C, *dyr = dy + (size_t)r * C;
        double rs, m = dg_ref_row_mean_rstd(xr, C, &rs);
        double mg = 0, mgx = 0;
        for (int c = 0; c < C; c++) {
            double xh = (xr[c] - m) * rs;
            mg += dyr[c] * w[c];
            mgx += dyr[c] * w[c] * xh;
            dw[c] += dyr[c] * xh;
            db[c] += dyr[c];
        }
        mg /= C;
        mgx /= C;
        for (int c = 0; c < C; c++) {
            double xh = (xr[c] - m) * rs;
            dx[(size_t)r * C + c] = (dyr[c] * w[c] - mg - xh * mgx) * rs;
        }
    }
}

double oph_ref_gelu1(double x) {
    return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}
double oph_ref_gelu_grad1(double x) {
    double k = sqrt(2.0 / M_PI), u = k * (x + 0.044715 * x * x * x), th = tanh(u);
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

/* out = x·wᵀ + bias; with gelu, pre gets the linear part and out its GELU. */
void oph_ref_matmul(double *out, double *pre, const double *x, const double *w, const double *bias, int N,
                    int C, int OC, int gelu) {
    for (int r = 0; r < N; r++)
        for (int o = 0; o < OC; o++) {
            double s = bias ? bias[o] : 0.0;
            for (int c = 0; c < C; c++)
                s += x[(size_t)r * C + c] * w[(size_t)o * C + c];
            if (pre) pre[(size_t)r * OC + o] = s;
            out[(size_t)r * OC + o] = gelu ? oph_ref_gelu1(s) : s;
        }
}
void oph_ref_matmul_bwd(double *dx, double *dw, double *db, const double *dy, const double *x,
                        const double *w, int N, int C, int OC) {
    for (int r = 0; r < N; r++)
        for (int c = 0; c < C; c++) {
            double s = 0;
            for (int o = 0; o < OC; o++)
                s += dy[(size_t)r * OC + o] * w[(size_t)o * C + c];
            dx[(size_t)r * C + c] = s;
        }
    for (int o = 0; o < OC; o++) {
        for (int c = 0; c < C; c++) {
            double s = 0;
            for (int r = 0; r < N; r++)
                s += dy[(size_t)r * OC + o] * x[(size_t)r * C + c];
            dw[(size_t)o * C + c] = s;
        }
        double s = 0;
        for (int r = 0; r < N; r++)
            s += dy[(size_t)r * OC + o];
        db[o] = s;
    }
}

/* Causal attention; probabilities of row (b,h,t) over keys 0..t. */
void oph_ref_attention(double *out, const double *qkv, int B, int T, int C, int NH, double *p) {
    dg_ref_attention(out, qkv, B, T, C, NH, p);
}
void oph_ref_attention_bwd(double *dqkv, const double *dout, const double *qkv, int B, int T, int C, int NH,
                           double *p, double *dp) {
    int hs = C / NH;
    double scale = 1.0 / sqrt((double)hs);
    memset(dqkv, 0, (size_t)B * T * 3 * C * sizeof(double));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                dg_ref_att_probs(p, qkv, b, h, t, T, C, NH);
                const double *dO = dout + ((size_t)b * T + t) * C + (size_t)h * hs;
                const double *q = qkv + ((size_t)b * T + t) * 3 * C + (size_t)h * hs;
                double *dq = dqkv + ((size_t)b * T + t) * 3 * C + (size_t)h * hs;
                double pdp = 0;
                for (int j = 0; j <= t; j++) {
                    const double *v = qkv + ((size_t)b * T + j) * 3 * C + 2 * C + (size_t)h * hs;
                    double *dv = dqkv + ((size_t)b * T + j) * 3 * C + 2 * C + (size_t)h * hs;
                    double s = 0;
                    for (int d = 0; d < hs; d++) {
                        s += dO[d] * v[d];
                        dv[d] += p[j] * dO[d];
                    }
                    dp[j] = s;
                    pdp += p[j] * s;
                }
                for (int j = 0; j <= t; j++) {
                    double ds = p[j] * (dp[j] - pdp) * scale;
                    const double *k = qkv + ((size_t)b * T + j) * 3 * C + C + (size_t)h * hs;
                    double *dk = dqkv + ((size_t)b * T + j) * 3 * C + C + (size_t)h * hs;
                    for (int d = 0; d < hs; d++) {
                        dq[d] += ds * k[d];
                        dk[d] += ds * q[d];
                    }
                }
            }
}

/* The max of row[0..V) into *mx; returns the sum of exp(row[j] - *mx). */
static double row_sumexp(const double *row, int V, double *mx_out) {
    double mx = -INFINITY, s = 0;
    for (int j = 0; j < V; j++)
        mx = row[j] > mx ? row[j] : mx;
    for (int j = 0; j < V; j++)
        s += exp(row[j] - mx);
    *mx_out = mx;
    return s;
}

void oph_ref_ce(double *loss, double *lse, const double *z, const int32_t *tg, int N, int V, int Vp) {
    for (int i = 0; i < N; i++) {
        const double *row = z + (size_t)i * Vp;
        double mx, s = row_sumexp(row, V, &mx);
        double l = mx + log(s);
        if (lse) lse[i] = l;
        loss[i] = l - row[tg[i]];
    }
}
void oph_ref_ce_bwd(double *dz, const double *z, const int32_t *tg, int N, int V, int Vp, double dloss) {
    for (int i = 0; i < N; i++) {
        const double *row = z + (size_t)i * Vp;
        double mx, s = row_sumexp(row, V, &mx);
        for (int j = 0; j < Vp; j++)
            dz[(size_t)i * Vp + j] = j < V ? (exp(row[j] - mx) / s - (j == tg[i] ? 1.0 : 0.0)) * dloss : 0.0;
    }
}
