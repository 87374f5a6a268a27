/* dg_ref_dense.h — the float64 reference loops of the dense ops that the backend tests (tests/backend,
 * oph_ref.c) and the graph tests (tests/graph, ref64.c) both compare kernels with, written once. Plain
 * loops, header-only (static inline), sharing no code with any backend; on every test target's include
 * path (tests/lib).
 *
 *   dg_ref_encoder(out, tok, wte, wpe, B, T, C)   out[b, t, :] = wte[tok[b, t], :] + wpe[t, :]
 *   dg_ref_row_mean_rstd(xr, C, &rstd)            the mean of xr[0..C), returned, and
 *                                                 1 / sqrt(variance + 1e-5) (layernorm's) into rstd */
#ifndef DG_REF_DENSE_H
#define DG_REF_DENSE_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>

static inline void dg_ref_encoder(double *out, const int32_t *tok, const double *wte, const double *wpe, int B,
                                  int T, int C) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int c = 0; c < C; c++)
                out[((size_t)b * T + t) * C + c] =
                    wte[(size_t)tok[b * T + t] * C + c] + wpe[(size_t)t * C + c];
}

static inline double dg_ref_row_mean_rstd(const double *xr, int C, double *rstd) {
    double m = 0, v = 0;
    for (int c = 0; c < C; c++)
        m += xr[c];
    m /= C;
    for (int c = 0; c < C; c++)
        v += (xr[c] - m) * (xr[c] - m);
    *rstd = 1.0 / sqrt(v / C + 1e-5);
    return m;
}

#endif
