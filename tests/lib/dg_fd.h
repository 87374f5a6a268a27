/* dg_fd.h — the central finite difference the gradient tests check backward passes against (header-only;
 * tests/lib is on every test target's include path). */
#ifndef DG_FD_H
#define DG_FD_H
#include <stddef.h>

/* d f / d x[i] by the central difference (f(x + h e_i) - f(x - h e_i)) / 2h with h = 1e-5 * max(1, |x[i]|):
 * f reads x (through ctx); x[i] is restored. In float64 the truncation error is ~h^2 and the rounding
 * ~1e-16 / h, both far below the fp32 errors the tests bound. */
static inline double dg_central_diff(double *x, size_t i, double (*f)(void *ctx), void *ctx) {
    const double xi = x[i], mag = xi < 0 ? -xi : xi, h = 1e-5 * (mag > 1 ? mag : 1.0);
    x[i] = xi + h;
    const double fp = f(ctx);
    x[i] = xi - h;
    const double fm = f(ctx);
    x[i] = xi;
    return (fp - fm) / (2 * h);
}
#endif
