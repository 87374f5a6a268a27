/* op_harness.c — backend-generic kernel tests against float64 references (see op_harness.h).
 *
 * Layout of this file: host-side dtype rounding and encoding (written independently of any backend,
 * with frexp/ldexp/rint), the check primitives (closeness, poison, bitwise repeat, finite differences),
 * the float64 reference of every op, then one case function per op, and the driver.
 */
#include "op_harness.h"

#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

/* ======================= tolerances ======================= */

typedef struct {
    const char *op;
    double f32, bf16, f16;
} tol_row_t;

/* Elementwise relative error bounds, floored at the RMS of the reference (see check_close). fp32 bounds
 * are a few times the error seen from a careful float32 implementation; bf16/f16 bounds allow for
 * rounding of the outputs and of intermediates kept in the act dtype. */
static const tol_row_t k_tols[] = {
    {"memory", 0, 0, 0},
    {"cast", 0, 0, 0}, /* bit-exact */
    {"add", 2e-7, 5e-3, 1e-3},
    {"accumulate", 2e-7, 5e-3, 1e-3},
    {"scale_f32", 2e-7, 2e-7, 2e-7},
    {"add_f32", 0, 0, 0}, /* one f32 add per element: bit-exact against the double reference rounded */
    {"sumsq_f32", 1e-5, 1e-5, 1e-5},
    {"clip_scale", 1e-6, 1e-6, 1e-6},
    {"adamw", 2e-5, 2e-5, 2e-5},
    {"encoder_fwd", 2e-7, 5e-3, 1e-3},
    {"encoder_bwd", 2e-6, 1e-2, 3e-3},
    {"layernorm_fwd", 2e-5, 2e-2, 5e-3},
    {"layernorm_bwd", 1e-4, 5e-2, 1e-2},
    {"matmul_fwd", 2e-5, 2e-2, 5e-3},
    /* matmul_fwd then add, or one GEMM whose sum rounds once: matmul_fwd's bound */
    {"matmul_fwd_res", 2e-5, 2e-2, 5e-3},
    {"matmul_bwd", 5e-5, 3e-2, 8e-3},
    {"gelu_fwd", 5e-6, 1e-2, 3e-3},
    {"gelu_bwd", 1e-5, 2e-2, 5e-3},
    /* the input gradient is matmul_bwd's times gelu'(pre): its bound plus gelu_bwd's, relative to a result
     * whose RMS is smaller than the product's (|gelu'| < 1.13, often small) */
    {"matmul_bwd_dgelu", 1e-4, 4e-2, 1e-2},
    {"attention_fwd", 5e-5, 3e-2, 8e-3},
    {"attention_bwd", 1e-4, 6e-2, 2e-2},
    {"crossentropy_fwd", 2e-5, 2e-2, 5e-3},
    {"crossentropy_bwd", 5e-5, 3e-2, 8e-3},
};

double dg_op_harness_tolerance(const char *op, dg_dtype_t act) {
    for (size_t i = 0; i < sizeof k_tols / sizeof k_tols[0]; i++)
        if (strcmp(k_tols[i].op, op) == 0)
            return act == DG_BF16 ? k_tols[i].bf16 : act == DG_F16 ? k_tols[i].f16 : k_tols[i].f32;
    return -1.0;
}

/* ======================= host dtype model ======================= */

/* Round x to the nearest value of a binary format with `p` significand bits, minimum normal exponent
 * `emin` and largest finite value `maxv`, ties to even; beyond the overflow threshold -> inf. */
static double round_fmt(double x, int p, int emin, double maxv) {
    if (x == 0.0 || !isfinite(x)) return x;
    int e;
    frexp(x, &e);
    int lead = e - 1;
    if (lead < emin) lead = emin; /* subnormal range: fixed spacing */
    double ulp = ldexp(1.0, lead - (p - 1));
    double r = rint(x / ulp) * ulp; /* default rounding mode: to nearest, ties to even */
    if (fabs(r) > maxv) return copysign(INFINITY, x);
    return r;
}

static double h_round(double x, dg_dtype_t dt) {
    switch (dt) {
    case DG_BF16:
        return round_fmt(x, 8, -126, ldexp(255.0 / 128.0, 127));
    case DG_F16:
        return round_fmt(x, 11, -14, 65504.0);
    case DG_F32:
        return round_fmt(x, 24, -126, FLT_MAX);
    default:
        return x;
    }
}

/* Bits of an already representable value. */
static uint16_t enc_f16(double r) {
    uint16_t s = signbit(r) ? 0x8000 : 0;
    if (isnan(r)) return 0x7E00;
    double a = fabs(r);
    if (isinf(a)) return s | 0x7C00;
    if (a == 0.0) return s;
    int e;
    double m = frexp(a, &e);
    int lead = e - 1;
    if (lead < -14) return (uint16_t)(s | (uint16_t)(a * 16777216.0)); /* subnormal: a / 2^-24 */
    return (uint16_t)(s | (uint16_t)((lead + 15) << 10) | (uint16_t)((m * 2.0 - 1.0) * 1024.0));
}
static double dec_f16(uint16_t b) {
    int e = (b >> 10) & 0x1F, m = b & 0x3FF;
    double s = (b & 0x8000) ? -1.0 : 1.0;
    if (e == 31) return m ? NAN : s * INFINITY;
    if (e == 0) return s * ldexp((double)m, -24);
    return s * ldexp(1.0 + m / 1024.0, e - 15);
}
static uint16_t enc_bf16(double r) {
    if (isnan(r)) return 0x7FC0;
    float f = (float)r;
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}
static double dec_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static size_t dt_size(dg_dtype_t dt) {
    return dt == DG_F32 || dt == DG_I32 ? 4 : 2;
}

/* v must already be rounded to dt. */
static void h_encode(dg_dtype_t dt, const double *v, void *dst, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (dt == DG_F32)
            ((float *)dst)[i] = (float)v[i];
        else if (dt == DG_BF16)
            ((uint16_t *)dst)[i] = enc_bf16(v[i]);
        else
            ((uint16_t *)dst)[i] = enc_f16(v[i]);
    }
}
static double h_decode1(dg_dtype_t dt, const void *src, size_t i) {
    if (dt == DG_F32) return ((const float *)src)[i];
    if (dt == DG_BF16) return dec_bf16(((const uint16_t *)src)[i]);
    return dec_f16(((const uint16_t *)src)[i]);
}

/* ======================= harness state ======================= */

#define H_MAX_TRACK 256

typedef struct {
    dg_backend_t *be;
    const dg_harness_opts_t *o;
    FILE *log;
    dg_dtype_t act;
    double tol_scale;
    uint64_t rng;
    int checks, failures, cases;
    char cname[192];
    uint64_t digest;
    int bad; /* the current case hit an error that makes its remaining checks meaningless */
    void *dev[H_MAX_TRACK];
    int ndev;
    void *host[H_MAX_TRACK];
    int nhost;
} H;

static void h_line(H *h, const char *tag, const char *fmt, va_list ap) {
    fprintf(h->log, "%s %s: ", tag, h->cname);
    vfprintf(h->log, fmt, ap);
    fputc('\n', h->log);
}
static void __attribute__((format(printf, 2, 3))) fail(H *h, const char *fmt, ...) {
    h->checks++;
    h->failures++;
    va_list ap;
    va_start(ap, fmt);
    h_line(h, "FAIL", fmt, ap);
    va_end(ap);
    fflush(h->log);
}
static void __attribute__((format(printf, 2, 3))) pass(H *h, const char *fmt, ...) {
    h->checks++;
    if (!h->o->verbose) return;
    va_list ap;
    va_start(ap, fmt);
    h_line(h, "ok  ", fmt, ap);
    va_end(ap);
}

/* A backend call: on failure record it with the backend's message and mark the case broken. */
static int call_ok(H *h, dg_status_t s, const char *what) {
    if (s == DG_OK) return 1;
    fail(h, "%s returned status %d: %s (%s)", what, s, dg_last_error(), dg_last_error_where());
    h->bad = 1;
    return 0;
}
#define CALL(h, what, ...) call_ok((h), (h)->be->ops->__VA_ARGS__, (what))

static uint64_t rng_next(H *h) { /* splitmix64 */
    uint64_t z = (h->rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rng_uniform(H *h) { /* [0, 1) */
    return (double)(rng_next(h) >> 11) * (1.0 / 9007199254740992.0);
}
static int rng_int(H *h, int n) {
    return (int)(rng_next(h) % (uint64_t)n);
}

static double *hnew(H *h, size_t n) {
    DG_ASSERT(h->nhost < H_MAX_TRACK);
    double *p = dg_xcalloc(n ? n : 1, sizeof(double));
    h->host[h->nhost++] = p;
    return p;
}
static void *hraw(H *h, size_t bytes) {
    DG_ASSERT(h->nhost < H_MAX_TRACK);
    void *p = dg_xcalloc(bytes ? bytes : 1, 1);
    h->host[h->nhost++] = p;
    return p;
}

/* Random values in +-[lo, hi] with random signs: never zero, never tiny. */
static double *hrand(H *h, size_t n, double lo, double hi) {
    double *p = hnew(h, n);
    for (size_t i = 0; i < n; i++) {
        double v = lo + (hi - lo) * rng_uniform(h);
        p[i] = (rng_next(h) & 1) ? v : -v;
    }
    return p;
}
static void hround(double *v, size_t n, dg_dtype_t dt) {
    for (size_t i = 0; i < n; i++)
        v[i] = h_round(v[i], dt);
}

static void *dalloc(H *h, dg_dtype_t dt, size_t n) {
    if (h->bad) return NULL;
    void *p = NULL;
    if (!CALL(h, "alloc", alloc(h->be, n * dt_size(dt), &p))) return NULL;
    DG_ASSERT(h->ndev < H_MAX_TRACK);
    h->dev[h->ndev++] = p;
    if ((uintptr_t)p % 256 != 0) fail(h, "alloc(%zu) returned %p, not 256-byte aligned", n * dt_size(dt), p);
    return p;
}

static int upload(H *h, void *dev, dg_dtype_t dt, const double *v, size_t n) {
    if (h->bad || !dev) return 0;
    void *tmp = hraw(h, n * dt_size(dt));
    h_encode(dt, v, tmp, n);
    return CALL(h, "to_device", to_device(h->be, dev, tmp, n * dt_size(dt)));
}
static int upload_i32(H *h, void *dev, const int32_t *v, size_t n) {
    if (h->bad || !dev) return 0;
    return CALL(h, "to_device", to_device(h->be, dev, v, n * 4));
}
/* Fill with a NaN pattern of the dtype: any element a kernel forgets to write stays NaN. */
static int poison(H *h, void *dev, dg_dtype_t dt, size_t n) {
    if (h->bad || !dev) return 0;
    size_t bytes = n * dt_size(dt);
    unsigned char *tmp = hraw(h, bytes);
    if (dt_size(dt) == 4) {
        uint32_t pat = 0x7FC0DEADu;
        for (size_t i = 0; i < n; i++)
            memcpy(tmp + 4 * i, &pat, 4);
    } else {
        uint16_t pat = dt == DG_BF16 ? 0x7FC1 : 0x7E01;
        for (size_t i = 0; i < n; i++)
            memcpy(tmp + 2 * i, &pat, 2);
    }
    return CALL(h, "to_device", to_device(h->be, dev, tmp, bytes));
}
static void *download_raw(H *h, const void *dev, size_t bytes) {
    if (h->bad || !dev) return NULL;
    void *tmp = hraw(h, bytes);
    if (!CALL(h, "to_host", to_host(h->be, tmp, dev, bytes))) return NULL;
    return tmp;
}
static double *download(H *h, const void *dev, dg_dtype_t dt, size_t n) {
    void *raw = download_raw(h, dev, n * dt_size(dt));
    if (!raw) return NULL;
    double *v = hnew(h, n);
    for (size_t i = 0; i < n; i++)
        v[i] = h_decode1(dt, raw, i);
    return v;
}

static void digest_add(H *h, const void *bytes, size_t n) {
    const unsigned char *p = bytes;
    for (size_t i = 0; i < n; i++) {
        h->digest ^= p[i];
        h->digest *= 0x100000001B3ull;
    }
}
static void digest_dev(H *h, const void *dev, size_t bytes) {
    void *raw = download_raw(h, dev, bytes);
    if (raw) digest_add(h, raw, bytes);
}

static int case_begin(H *h, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int case_begin(H *h, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(h->cname, sizeof h->cname, fmt, ap);
    va_end(ap);
    if (h->o->only && *h->o->only && !strstr(h->cname, h->o->only)) return 0;
    h->cases++;
    h->bad = 0;
    h->digest = 0xCBF29CE484222325ull;
    return 1;
}
static void case_end(H *h) {
    for (int i = 0; i < h->ndev; i++)
        h->be->ops->free(h->be, h->dev[i]);
    for (int i = 0; i < h->nhost; i++)
        free(h->host[i]);
    h->ndev = h->nhost = 0;
    if (h->o->digests) fprintf(h->o->digests, "%s %016llx\n", h->cname, (unsigned long long)h->digest);
}

static double tol_of(H *h, const char *op) {
    double t = dg_op_harness_tolerance(op, h->act);
    DG_ASSERTF(t >= 0, "no tolerance for op %s", op);
    return t * h->tol_scale;
}

/* ======================= checks ======================= */

static double rms(const double *v, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += v[i] * v[i];
    return n ? sqrt(s / (double)n) : 0.0;
}

/* Elementwise: |got - ref| <= tol * (|ref| + RMS(scale)), scale = `scale` or ref. NaN (a poisoned
 * element never written, or a NaN result) always fails. */
static void check_close(H *h, const char *what, const double *got, const double *ref, size_t n, double tol,
                        const double *scale) {
    if (h->bad) return;
    if (!got) return;
    double floor = rms(scale ? scale : ref, n);
    if (floor == 0) floor = 1e-30;
    double worst = 0;
    size_t wi = 0, nan_count = 0, first_nan = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(got[i]) || isinf(got[i])) {
            if (!nan_count) first_nan = i;
            nan_count++;
            continue;
        }
        double e = fabs(got[i] - ref[i]) / (fabs(ref[i]) + floor);
        if (e > worst || isnan(e)) {
            worst = e;
            wi = i;
        }
    }
    if (nan_count) {
        fail(h, "%s: %zu of %zu elements not finite (unwritten poison?), first at [%zu] = %g", what,
             nan_count, n, first_nan, got[first_nan]);
        return;
    }
    if (!(worst <= tol))
        fail(h, "%s: max rel err %.3g > tol %.3g at [%zu]: got %.9g, ref %.9g (n=%zu)", what, worst, tol, wi,
             got[wi], ref[wi], n);
    else
        pass(h, "%s: max rel err %.3g <= tol %.3g (n=%zu)", what, worst, tol, n);
}

/* Scalar version: |got - ref| <= tol * |ref| (ref != 0), or <= tol when ref == 0. */
static void check_scalar(H *h, const char *what, double got, double ref, double tol) {
    if (h->bad) return;
    double e = fabs(got - ref) / (ref != 0 ? fabs(ref) : 1.0);
    if (!(e <= tol))
        fail(h, "%s: got %.9g, ref %.9g, rel err %.3g > tol %.3g", what, got, ref, e, tol);
    else
        pass(h, "%s: got %.9g, ref %.9g (rel err %.3g)", what, got, ref, e);
}

static void check_bits(H *h, const char *what, const void *a, const void *b, size_t bytes) {
    if (h->bad || !a || !b) return;
    if (memcmp(a, b, bytes) != 0) {
        size_t i = 0;
        while (((const unsigned char *)a)[i] == ((const unsigned char *)b)[i])
            i++;
        fail(h, "%s: not bitwise identical (first differing byte %zu of %zu)", what, i, bytes);
    } else {
        pass(h, "%s: bitwise identical (%zu bytes)", what, bytes);
    }
}

/* Finite differences of a float64 objective f (reading the arrays in ctx, among them x[0..n)) against
 * the backend gradient `got`: a sample of single elements, and directional derivatives along random
 * +-1 vectors, which involve every element. `ref` (the analytic float64 gradient) sets the scale. */
typedef double (*objective_fn)(void *ctx);
static void check_fd(H *h, const char *what, objective_fn f, void *ctx, double *x, size_t n,
                     const double *got, const double *ref, double tol) {
    if (h->bad || !got || h->o->skip_fd) return;
    const double floor = rms(ref, n) > 0 ? rms(ref, n) : 1e-30;
    const int samples = n <= 48 ? (int)n : 40;
    double worst = 0;
    size_t wi = 0;
    double wg = 0, wf = 0;
    for (int s = 0; s < samples; s++) {
        size_t i = n <= 48 ? (size_t)s : (s == 0 ? 0 : s == 1 ? n - 1 : (size_t)rng_int(h, (int)n));
        double xi = x[i], step = 1e-5 * (fabs(xi) > 1 ? fabs(xi) : 1.0);
        x[i] = xi + step;
        double fp = f(ctx);
        x[i] = xi - step;
        double fm = f(ctx);
        x[i] = xi;
        double fd = (fp - fm) / (2 * step);
        double e = fabs(got[i] - fd) / (fabs(fd) + floor);
        if (e > worst || isnan(e)) {
            worst = e;
            wi = i;
            wg = got[i];
            wf = fd;
        }
    }
    if (!(worst <= tol))
        fail(h, "%s vs finite differences: rel err %.3g > tol %.3g at [%zu]: got %.9g, fd %.9g", what, worst,
             tol, wi, wg, wf);
    else
        pass(h, "%s vs finite differences: %d elements, max rel err %.3g", what, samples, worst);
    /* Directional derivatives: an error anywhere in the tensor moves the dot product. */
    double *x0 = hnew(h, n), *u = hnew(h, n);
    memcpy(x0, x, n * sizeof(double));
    for (int d = 0; d < 2; d++) {
        double dot = 0;
        for (size_t i = 0; i < n; i++) {
            u[i] = (rng_next(h) & 1) ? 1.0 : -1.0;
            dot += got[i] * u[i];
        }
        const double step = 1e-5;
        for (size_t i = 0; i < n; i++)
            x[i] = x0[i] + step * u[i];
        double fp = f(ctx);
        for (size_t i = 0; i < n; i++)
            x[i] = x0[i] - step * u[i];
        double fm = f(ctx);
        memcpy(x, x0, n * sizeof(double));
        double fd = (fp - fm) / (2 * step);
        double e = fabs(dot - fd) / (fabs(fd) + sqrt((double)n) * floor);
        if (!(e <= tol))
            fail(h, "%s directional derivative %d: got %.9g, fd %.9g, rel err %.3g > tol %.3g", what, d, dot,
                 fd, e, tol);
        else
            pass(h, "%s directional derivative %d: rel err %.3g", what, d, e);
    }
}

static double dotd(const double *a, const double *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}
static double *add_arrays(H *h, const double *a, const double *b, size_t n) {
    double *r = hnew(h, n);
    for (size_t i = 0; i < n; i++)
        r[i] = a[i] + b[i];
    return r;
}

/* ======================= float64 references ======================= */

static void ref_encoder(double *out, const int32_t *tok, const double *wte, const double *wpe, int B, int T,
                        int C) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int c = 0; c < C; c++)
                out[((size_t)b * T + t) * C + c] =
                    wte[(size_t)tok[b * T + t] * C + c] + wpe[(size_t)t * C + c];
}

static void ref_layernorm(double *out, double *mean, double *rstd, const double *x, const double *w,
                          const double *b, int N, int C) {
    for (int r = 0; r < N; r++) {
        const double *xr = x + (size_t)r * C;
        double m = 0, v = 0;
        for (int c = 0; c < C; c++)
            m += xr[c];
        m /= C;
        for (int c = 0; c < C; c++)
            v += (xr[c] - m) * (xr[c] - m);
        v /= C;
        double rs = 1.0 / sqrt(v + 1e-5);
        for (int c = 0; c < C; c++)
            out[(size_t)r * C + c] = (xr[c] - m) * rs * w[c] + b[c];
        if (mean) mean[r] = m;
        if (rstd) rstd[r] = rs;
    }
}
static void ref_layernorm_bwd(double *dx, double *dw, double *db, const double *dy, const double *x,
                              const double *w, int N, int C) {
    for (int r = 0; r < N; r++) {
        const double *xr = x + (size_t)r * C, *dyr = dy + (size_t)r * C;
        double m = 0, v = 0;
        for (int c = 0; c < C; c++)
            m += xr[c];
        m /= C;
        for (int c = 0; c < C; c++)
            v += (xr[c] - m) * (xr[c] - m);
        double rs = 1.0 / sqrt(v / C + 1e-5);
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

static double ref_gelu1(double x) {
    return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}
static double ref_gelu_grad1(double x) {
    double k = sqrt(2.0 / M_PI), u = k * (x + 0.044715 * x * x * x), th = tanh(u);
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

/* out = x·wᵀ + bias; with gelu, pre gets the linear part and out its GELU. */
static void ref_matmul(double *out, double *pre, const double *x, const double *w, const double *bias, int N,
                       int C, int OC, int gelu) {
    for (int r = 0; r < N; r++)
        for (int o = 0; o < OC; o++) {
            double s = bias ? bias[o] : 0.0;
            for (int c = 0; c < C; c++)
                s += x[(size_t)r * C + c] * w[(size_t)o * C + c];
            if (pre) pre[(size_t)r * OC + o] = s;
            out[(size_t)r * OC + o] = gelu ? ref_gelu1(s) : s;
        }
}
static void ref_matmul_bwd(double *dx, double *dw, double *db, const double *dy, const double *x,
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
static void att_probs(double *p, const double *qkv, int b, int h, int t, int T, int C, int NH) {
    int hs = C / NH;
    double scale = 1.0 / sqrt((double)hs), mx = -INFINITY;
    const double *q = qkv + ((size_t)b * T + t) * 3 * C + (size_t)h * hs;
    for (int j = 0; j <= t; j++) {
        const double *k = qkv + ((size_t)b * T + j) * 3 * C + C + (size_t)h * hs;
        double s = 0;
        for (int d = 0; d < hs; d++)
            s += q[d] * k[d];
        p[j] = s * scale;
        if (p[j] > mx) mx = p[j];
    }
    double sum = 0;
    for (int j = 0; j <= t; j++)
        sum += (p[j] = exp(p[j] - mx));
    for (int j = 0; j <= t; j++)
        p[j] /= sum;
}
static void ref_attention(double *out, const double *qkv, int B, int T, int C, int NH, double *p) {
    int hs = C / NH;
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                att_probs(p, qkv, b, h, t, T, C, NH);
                double *o = out + ((size_t)b * T + t) * C + (size_t)h * hs;
                for (int d = 0; d < hs; d++) {
                    double s = 0;
                    for (int j = 0; j <= t; j++)
                        s += p[j] * qkv[((size_t)b * T + j) * 3 * C + 2 * C + (size_t)h * hs + d];
                    o[d] = s;
                }
            }
}
static void ref_attention_bwd(double *dqkv, const double *dout, const double *qkv, int B, int T, int C,
                              int NH, double *p, double *dp) {
    int hs = C / NH;
    double scale = 1.0 / sqrt((double)hs);
    memset(dqkv, 0, (size_t)B * T * 3 * C * sizeof(double));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                att_probs(p, qkv, b, h, t, T, C, NH);
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

static void ref_ce(double *loss, double *lse, const double *z, const int32_t *tg, int N, int V, int Vp) {
    for (int i = 0; i < N; i++) {
        const double *row = z + (size_t)i * Vp;
        double mx = -INFINITY, s = 0;
        for (int j = 0; j < V; j++)
            mx = row[j] > mx ? row[j] : mx;
        for (int j = 0; j < V; j++)
            s += exp(row[j] - mx);
        double l = mx + log(s);
        if (lse) lse[i] = l;
        loss[i] = l - row[tg[i]];
    }
}
static void ref_ce_bwd(double *dz, const double *z, const int32_t *tg, int N, int V, int Vp, double dloss) {
    for (int i = 0; i < N; i++) {
        const double *row = z + (size_t)i * Vp;
        double mx = -INFINITY, s = 0;
        for (int j = 0; j < V; j++)
            mx = row[j] > mx ? row[j] : mx;
        for (int j = 0; j < V; j++)
            s += exp(row[j] - mx);
        for (int j = 0; j < Vp; j++)
            dz[(size_t)i * Vp + j] = j < V ? (exp(row[j] - mx) / s - (j == tg[i] ? 1.0 : 0.0)) * dloss : 0.0;
    }
}

/* ======================= cases ======================= */

static void *dalloc_bytes(H *h, size_t bytes) {
    if (h->bad) return NULL;
    void *p = NULL;
    if (!CALL(h, "alloc", alloc(h->be, bytes, &p))) return NULL;
    DG_ASSERT(h->ndev < H_MAX_TRACK);
    h->dev[h->ndev++] = p;
    if ((uintptr_t)p % 256 != 0) fail(h, "alloc(%zu) returned %p, not 256-byte aligned", bytes, p);
    return p;
}
static int poison_bytes(H *h, void *dev, size_t bytes) {
    if (h->bad || !dev) return 0;
    unsigned char *tmp = hraw(h, bytes);
    memset(tmp, 0xFF, bytes); /* all-ones is NaN in f32, bf16 and f16 */
    return CALL(h, "to_device", to_device(h->be, dev, tmp, bytes));
}
/* A device copy of an f32/act buffer, for the aliasing checks. */
static void *ddup(H *h, const void *src, size_t bytes) {
    void *p = dalloc_bytes(h, bytes);
    if (p) CALL(h, "copy", copy(h->be, p, src, bytes));
    return p;
}
static int32_t *rand_tokens(H *h, size_t n, int V) {
    int32_t *t = hraw(h, n * sizeof(int32_t));
    for (size_t i = 0; i < n; i++)
        t[i] = rng_int(h, V);
    if (n >= 4) t[3] = t[1] = t[0]; /* repeated ids: gradient rows that several positions add into */
    return t;
}

static void case_memory(H *h) {
    if (!case_begin(h, "memory")) return;
    const size_t sizes[] = {0, 1, 3, 256, 1000, (size_t)1 << 20};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0] && !h->bad; k++) {
        size_t n = sizes[k];
        unsigned char *a = dalloc_bytes(h, n), *b = dalloc_bytes(h, n);
        if (h->bad) break;
        if (n == 0) {
            pass(h, "alloc(0) gives a freeable block");
            continue;
        }
        unsigned char *src = hraw(h, n);
        for (size_t i = 0; i < n; i++)
            src[i] = (unsigned char)((i * 131u + 7u) | 1u);
        CALL(h, "to_device", to_device(h->be, a, src, n));
        CALL(h, "copy", copy(h->be, b, a, n));
        unsigned char *back = download_raw(h, b, n);
        char what[64];
        snprintf(what, sizeof what, "to_device/copy/to_host of %zu bytes", n);
        check_bits(h, what, back, src, n);
        digest_add(h, back ? back : src, n);
        CALL(h, "memset0", memset0(h->be, b, n));
        unsigned char *z = download_raw(h, b, n);
        if (z) {
            size_t nz = 0;
            for (size_t i = 0; i < n; i++)
                nz += z[i] != 0;
            if (nz)
                fail(h, "memset0 of %zu bytes left %zu non-zero bytes", n, nz);
            else
                pass(h, "memset0 of %zu bytes", n);
        }
    }
    CALL(h, "sync", sync(h->be));
    case_end(h);
}

static double cast_src_value(H *h, size_t i) {
    static const double edge[] = {1.0,
                                  -1.0,
                                  0.0,
                                  -0.0,
                                  1.0 + 0x1p-8, /* bf16 tie: to even (1) */
                                  1.0 + 3 * 0x1p-8,
                                  1.0 + 0x1p-11, /* f16 tie */
                                  1.0 + 3 * 0x1p-11,
                                  65504.0,
                                  65519.0,
                                  65520.0, /* f16 overflow threshold: rounds to inf */
                                  1e6,
                                  -1e6,
                                  6e-8,
                                  0x1p-25, /* f16 subnormal tie: to 0 */
                                  3 * 0x1p-25,
                                  0x1p-24,
                                  1e-10,
                                  3.4e38,
                                  0x1p-126,
                                  1e-40,
                                  INFINITY,
                                  -INFINITY,
                                  NAN};
    const size_t ne = sizeof edge / sizeof edge[0];
    if (i < ne) return edge[i];
    double mag = ldexp(1.0 + rng_uniform(h), (int)(rng_uniform(h) * 50.0) - 30);
    return (rng_next(h) & 1) ? mag : -mag;
}

static void case_cast(H *h, dg_dtype_t st, dg_dtype_t dt, size_t n) {
    if (!case_begin(h, "cast[%s->%s,n=%zu]", dg_dtype_name(st), dg_dtype_name(dt), n)) return;
    double *v = hnew(h, n);
    for (size_t i = 0; i < n; i++)
        v[i] = h_round(cast_src_value(h, i), st);
    void *src = dalloc(h, st, n), *dst = dalloc(h, dt, n);
    upload(h, src, st, v, n);
    poison(h, dst, dt, n);
    if (!h->bad) CALL(h, "cast", cast(h->be, dst, dt, src, st, n));
    unsigned char *got = download_raw(h, dst, n * dt_size(dt));
    if (got) {
        double *ref = hnew(h, n);
        for (size_t i = 0; i < n; i++)
            ref[i] = h_round(v[i], dt);
        unsigned char *want = hraw(h, n * dt_size(dt));
        h_encode(dt, ref, want, n);
        size_t bad = 0, first = 0;
        for (size_t i = 0; i < n; i++) {
            double g = h_decode1(dt, got, i);
            int same = isnan(ref[i])
                           ? isnan(g)
                           : memcmp(got + i * dt_size(dt), want + i * dt_size(dt), dt_size(dt)) == 0;
            if (!same && !bad++) first = i;
        }
        if (bad)
            fail(h,
                 "%zu of %zu elements differ from round-to-nearest-even; first [%zu]: src %.10g -> got "
                 "%.10g, want %.10g",
                 bad, n, first, v[first], h_decode1(dt, got, first), ref[first]);
        else
            pass(h, "bit-exact round-to-nearest-even (edge values included)");
        digest_add(h, got, n * dt_size(dt));
    }
    case_end(h);
}

static void case_elementwise(H *h, size_t n) {
    if (!case_begin(h, "add/accumulate/scale[n=%zu]", n)) return;
    const dg_dtype_t A = h->act;
    double *a = hrand(h, n, 0.05, 2.0), *b = hrand(h, n, 0.05, 2.0), *d0 = hrand(h, n, 0.05, 2.0);
    hround(a, n, A);
    hround(b, n, A);
    hround(d0, n, A);
    void *da = dalloc(h, A, n), *db = dalloc(h, A, n), *dout = dalloc(h, A, n), *dacc = dalloc(h, A, n);
    upload(h, da, A, a, n);
    upload(h, db, A, b, n);
    poison(h, dout, A, n);
    if (!h->bad) CALL(h, "add", add(h->be, dout, da, db, n));
    double *ref = add_arrays(h, a, b, n);
    void *raw = download_raw(h, dout, n * dt_size(A));
    check_close(h, "add", download(h, dout, A, n), ref, n, tol_of(h, "add"), NULL);
    if (raw) digest_add(h, raw, n * dt_size(A));
    /* out aliasing an input */
    void *alias = ddup(h, da, n * dt_size(A));
    if (!h->bad) CALL(h, "add", add(h->be, alias, alias, db, n));
    check_bits(h, "add with out == a", download_raw(h, alias, n * dt_size(A)), raw, n * dt_size(A));
    /* accumulate: acc=0 copies over poison, acc=1 adds */
    poison(h, dacc, A, n);
    if (!h->bad) CALL(h, "accumulate", accumulate(h->be, dacc, da, n, 0));
    check_bits(h, "accumulate acc=0 overwrites", download_raw(h, dacc, n * dt_size(A)),
               download_raw(h, da, n * dt_size(A)), n * dt_size(A));
    upload(h, dacc, A, d0, n);
    if (!h->bad) CALL(h, "accumulate", accumulate(h->be, dacc, da, n, 1));
    check_close(h, "accumulate acc=1 adds", download(h, dacc, A, n), add_arrays(h, d0, a, n), n,
                tol_of(h, "accumulate"), a);
    /* scale_f32 */
    double *x = hrand(h, n, 0.05, 2.0), *xs = hnew(h, n);
    hround(x, n, DG_F32);
    for (size_t i = 0; i < n; i++)
        xs[i] = x[i] * (double)0.37f;
    void *dx = dalloc(h, DG_F32, n);
    upload(h, dx, DG_F32, x, n);
    if (!h->bad) CALL(h, "scale_f32", scale_f32(h->be, dx, n, 0.37f));
    check_close(h, "scale_f32", download(h, dx, DG_F32, n), xs, n, tol_of(h, "scale_f32"), NULL);
    /* add_f32 (v1.5): f32 whatever the act dtype; one rounding per element, so the result must equal
     * float(x + y) exactly; the source stays untouched */
    double *y = hrand(h, n, 0.05, 2.0), *xy = hnew(h, n);
    hround(y, n, DG_F32);
    for (size_t i = 0; i < n; i++)
        xy[i] = (double)((float)x[i] + (float)y[i]);
    void *dy = dalloc(h, DG_F32, n), *dz = dalloc(h, DG_F32, n);
    upload(h, dy, DG_F32, y, n);
    upload(h, dz, DG_F32, x, n);
    void *yraw = download_raw(h, dy, n * sizeof(float));
    if (!h->bad) CALL(h, "add_f32", add_f32(h->be, (float *)dz, (const float *)dy, n));
    check_close(h, "add_f32", download(h, dz, DG_F32, n), xy, n, tol_of(h, "add_f32"), NULL);
    check_bits(h, "add_f32 leaves src", download_raw(h, dy, n * sizeof(float)), yraw, n * sizeof(float));
    case_end(h);
}

static void case_sumsq(H *h, size_t n) {
    if (!case_begin(h, "sumsq_f32[n=%zu]", n)) return;
    double *x = hrand(h, n, 0.01, 3.0);
    hround(x, n, DG_F32);
    const double pre = 1.5;
    void *dx = dalloc(h, DG_F32, n), *dout = dalloc(h, DG_F32, 1), *dout2 = dalloc(h, DG_F32, 1);
    upload(h, dx, DG_F32, x, n);
    upload(h, dout, DG_F32, &pre, 1);
    upload(h, dout2, DG_F32, &pre, 1);
    if (!h->bad) CALL(h, "sumsq_f32", sumsq_f32(h->be, dout, dx, n));
    if (!h->bad) CALL(h, "sumsq_f32", sumsq_f32(h->be, dout2, dx, n));
    double *got = download(h, dout, DG_F32, 1);
    if (got) check_scalar(h, "*out += sum(x^2)", got[0], pre + dotd(x, x, n), tol_of(h, "sumsq_f32"));
    check_bits(h, "repeat", download_raw(h, dout, 4), download_raw(h, dout2, 4), 4);
    digest_dev(h, dout, 4);
    case_end(h);
}

/* sumsq_multi (contract v1.7): one call over a segment table of one flat buffer against one sumsq_f32 per
 * segment, in table order, into an accumulator that starts non-zero, on the same backend: bitwise the same
 * value. variant 0: hand-picked segments, not in offset order: a big one (more than SUMSQ_MAX_BLOCKS = 512
 * blocks of 4096 elements on CUDA: the block count is capped), misaligned offsets (no 16-byte vector loads
 * on CUDA), a single element, fewer elements than a block has threads, exactly one block, one overlapping
 * another, one ending at the buffer's end, one skipped. variant 1: 600 random segments (more than one
 * 256-segment chunk of the CUDA kernels' scans and of the ordered add), some skipped. variant 2: three
 * segments whose totals add to different bits in the reverse order (one above 2^24, where floats are 2
 * apart, then two below 1 whose sum is above 1), so that the check sees the order of the additions (the
 * case checks that it can: the reversed calls must give other bits). Also: the skip flags
 * are the device table's, a recorded call replays with the flags its table holds then (backends that
 * record graphs), an empty table leaves the accumulator alone, a repeat gives the same bits. */
static void case_sumsq_multi(H *h, int variant) {
    static const char *const names[3] = {"big, misaligned, tiny", "600 random segments", "order"};
    if (!case_begin(h, "sumsq_multi[%s]", names[variant])) return;
    if (!h->be->ops->sumsq_multi) { /* optional entry: the executor falls back to sumsq_f32 */
        pass(h, "sumsq_multi: not provided by the %s backend (optional)", h->be->ops->name);
        case_end(h);
        return;
    }
    enum { NR = 600 };
    const size_t big = 512u * 4096u + 102913u; /* 2200065: capped at 512 blocks, n % 4 == 1 */
    size_t span = variant == 1 ? 1000003 : variant == 2 ? 64 : big + 8 + 11;
    int ns = variant == 1 ? NR : variant == 2 ? 3 : 8;
    dg_sumsq_seg_t *tab = NULL;
    if (!h->bad && !CALL(h, "host_alloc", host_alloc(h->be, (size_t)ns * sizeof *tab, (void **)&tab))) {
        case_end(h);
        return;
    }
    if (variant == 0) {
        const dg_sumsq_seg_t fixed[8] = {{3, 70001, 0},         /* misaligned (12 bytes), 18 blocks on CUDA */
                                         {8, (uint32_t)big, 0}, /* the big one, 16-byte aligned */
                                         {100, 1, 0},           /* one element */
                                         {1001, 255, 0},        /* fewer elements than threads, misaligned */
                                         {12, 4096 * 3 + 7, DG_SUMSQ_SEG_SKIP}, /* skipped */
                                         {2000000, 5000, 0}, /* inside the big one (segments are only read) */
                                         {50, 4096, 0},      /* exactly one block, misaligned (200 bytes) */
                                         {big + 8 + 11 - 37, 37, 0}}; /* up to the buffer's end, misaligned */
        memcpy(tab, fixed, sizeof fixed);
    } else if (variant == 2) {
        const dg_sumsq_seg_t fixed[3] = {{0, 15, 0}, {20, 9, 0}, {41, 4, 0}};
        memcpy(tab, fixed, sizeof fixed);
    } else {
        for (int i = 0; i < ns; i++) {
            uint32_t n = 1 + (uint32_t)rng_int(h, i % 50 == 0 ? 20000 : 3000);
            tab[i].count = n;
            tab[i].off = (uint64_t)rng_int(h, (int)(span - n + 1));
            tab[i].flags = rng_int(h, 10) == 0 ? DG_SUMSQ_SEG_SKIP : 0u;
        }
    }
    double *x = hrand(h, span, 0.01, 2.0);
    if (variant == 2) /* totals: 15 x 1100^2 = 18150000 (exact, even; above 2^24 floats are 2 apart), then
                       * 9 x ~0.27^2 ~ 0.7 and 4 x 0.35^2 = 0.49: forward both vanish into the first total,
                       * backward their sum 1.19 rounds it up to 18150002 */
        for (int i = 0; i < 64; i++) {
            double mag = i < 15                ? 1100.0
                         : (i >= 20 && i < 29) ? 0.25 + 1e-3 * i
                         : (i >= 41 && i < 45) ? 0.35
                                               : 0;
            if (mag > 0) x[i] = (i % 2 ? -mag : mag);
        }
    hround(x, span, DG_F32);
    const double pre = variant == 2 ? 0.0 : 1.5;
    void *dx = dalloc(h, DG_F32, span), *dtab = dalloc_bytes(h, (size_t)ns * sizeof *tab);
    void *dout[5];
    for (int k = 0; k < 5; k++) {
        dout[k] = dalloc(h, DG_F32, 1);
        upload(h, dout[k], DG_F32, &pre, 1);
    }
    upload(h, dx, DG_F32, x, span);
    const float *fx = dx;
    /* [0] one call; [1] one sumsq_f32 per segment in table order; [2] the call repeated */
    if (!h->bad) CALL(h, "upload_async", upload_async(h->be, dtab, tab, (size_t)ns * sizeof *tab));
    if (!h->bad) CALL(h, "sumsq_multi", sumsq_multi(h->be, dout[0], fx, span, tab, dtab, ns));
    if (!h->bad) CALL(h, "sumsq_multi", sumsq_multi(h->be, dout[2], fx, span, tab, dtab, ns));
    double ref = pre;
    int nskip = 0;
    for (int i = 0; i < ns && !h->bad; i++) {
        if (tab[i].flags & DG_SUMSQ_SEG_SKIP) {
            nskip++;
            continue;
        }
        CALL(h, "sumsq_f32", sumsq_f32(h->be, dout[1], fx + tab[i].off, tab[i].count));
        ref += dotd(x + tab[i].off, x + tab[i].off, tab[i].count);
    }
    if (!h->bad) CALL(h, "sync", sync(h->be));
    unsigned char *r0 = download_raw(h, dout[0], 4);
    check_bits(h, "sumsq_multi == sumsq_f32 per segment in table order", r0, download_raw(h, dout[1], 4), 4);
    check_bits(h, "repeat", download_raw(h, dout[2], 4), r0, 4);
    double *got = download(h, dout[0], DG_F32, 1);
    if (got) check_scalar(h, "*out += sum over the segments of x^2", got[0], ref, tol_of(h, "sumsq_f32"));
    if (r0) digest_add(h, r0, 4);
    if (!h->bad && nskip == 0 && variant != 2) fail(h, "sumsq_multi: the table has no skipped segment");
    if (variant == 2 && !h->bad) { /* [4]: the calls in reverse order must give other bits */
        for (int i = ns - 1; i >= 0 && !h->bad; i--)
            CALL(h, "sumsq_f32", sumsq_f32(h->be, dout[4], fx + tab[i].off, tab[i].count));
        unsigned char *rr = download_raw(h, dout[4], 4);
        if (r0 && rr && memcmp(r0, rr, 4) == 0)
            fail(h,
                 "sumsq_multi[order]: the reversed calls give the same bits: the case cannot see the order");
        else
            pass(h, "the reversed calls give other bits: the order of the additions is checked");
    }

    /* the skip flags come from the device table: another skip set uploaded there (the host table, which
     * gives only the geometry, unchanged) changes the sum as the sequence of calls with that set would */
    dg_sumsq_seg_t *tab2 = hraw(h, (size_t)ns * sizeof *tab);
    memcpy(tab2, tab, (size_t)ns * sizeof *tab);
    for (int i = 0; i < ns; i++)
        tab2[i].flags = (i % 3 == 1) ? DG_SUMSQ_SEG_SKIP : 0u;
    void *dout2[2] = {dalloc(h, DG_F32, 1), dalloc(h, DG_F32, 1)};
    for (int k = 0; k < 2; k++)
        upload(h, dout2[k], DG_F32, &pre, 1);
    if (!h->bad) CALL(h, "to_device", to_device(h->be, dtab, tab2, (size_t)ns * sizeof *tab));
    if (!h->bad) CALL(h, "sumsq_multi", sumsq_multi(h->be, dout2[0], fx, span, tab, dtab, ns));
    for (int i = 0; i < ns && !h->bad; i++)
        if (!(tab2[i].flags & DG_SUMSQ_SEG_SKIP))
            CALL(h, "sumsq_f32", sumsq_f32(h->be, dout2[1], fx + tab[i].off, tab[i].count));
    if (!h->bad) CALL(h, "sync", sync(h->be));
    check_bits(h, "sumsq_multi follows the device table's skip flags", download_raw(h, dout2[0], 4),
               download_raw(h, dout2[1], 4), 4);

    /* where the backend records graphs: the upload of the table and the call recorded once, then the
     * page-locked host table's flags changed (its geometry kept, as the contract asks) and the recording
     * replayed: the replay sums with the flags of the moment, bitwise as the sequence of calls does */
    void *dout3 = h->be->ops->graph_begin ? dalloc(h, DG_F32, 1) : NULL;
    if (dout3 && !h->bad && CALL(h, "graph_begin", graph_begin(h->be))) {
        void *gr = NULL;
        dg_status_t su = h->be->ops->upload_async(h->be, dtab, tab, (size_t)ns * sizeof *tab);
        dg_status_t sm = su == DG_OK ? h->be->ops->sumsq_multi(h->be, dout3, fx, span, tab, dtab, ns) : su;
        dg_status_t se = h->be->ops->graph_end(h->be, &gr);
        if (call_ok(h, sm, "sumsq_multi (recorded)") && call_ok(h, se, "graph_end") && gr) {
            for (int i = 0; i < ns; i++)
                tab[i].flags = tab2[i].flags;
            upload(h, dout3, DG_F32, &pre, 1);
            if (!h->bad) CALL(h, "graph_launch", graph_launch(h->be, gr));
            if (!h->bad) CALL(h, "sync", sync(h->be));
            check_bits(h, "recorded sumsq_multi replayed with other skip flags", download_raw(h, dout3, 4),
                       download_raw(h, dout2[1], 4), 4);
        }
        if (gr) h->be->ops->graph_free(h->be, gr);
    }

    /* an empty table: nothing happens */
    if (!h->bad) CALL(h, "sumsq_multi", sumsq_multi(h->be, dout[3], fx, span, tab, dtab, 0));
    if (!h->bad) CALL(h, "sync", sync(h->be));
    float pre_f = (float)pre;
    check_bits(h, "sumsq_multi over no segment leaves *out", download_raw(h, dout[3], 4), &pre_f, 4);
    h->be->ops->host_free(h->be, tab);
    case_end(h);
}

static void case_clip(H *h) {
    if (!case_begin(h, "clip_scale")) return;
    /* {sumsq, clip, extra}: clipping active, inactive, disabled */
    const double cases[][3] = {{16.0, 1.0, 0.25}, {16.0, 5.0, 0.25}, {16.0, 0.0, 0.5}, {2.0e6, 3.0, 1.0}};
    void *ss = dalloc(h, DG_F32, 1), *gs = dalloc(h, DG_F32, 1), *nm = dalloc(h, DG_F32, 1);
    for (size_t k = 0; k < sizeof cases / sizeof cases[0] && !h->bad; k++) {
        double s = cases[k][0], clip = cases[k][1], extra = cases[k][2];
        upload(h, ss, DG_F32, &s, 1);
        poison(h, gs, DG_F32, 1);
        poison(h, nm, DG_F32, 1);
        if (!CALL(h, "clip_scale", clip_scale(h->be, gs, nm, ss, (float)clip, (float)extra))) break;
        double norm = sqrt(s), want = (clip > 0 ? fmin(1.0, clip / (norm + 1e-6)) : 1.0) * extra;
        double *g = download(h, gs, DG_F32, 1), *n = download(h, nm, DG_F32, 1);
        char what[96];
        snprintf(what, sizeof what, "scale (sumsq=%g clip=%g extra=%g)", s, clip, extra);
        if (g) check_scalar(h, what, g[0], want, tol_of(h, "clip_scale"));
        snprintf(what, sizeof what, "norm (sumsq=%g)", s);
        if (n) check_scalar(h, what, n[0], norm, tol_of(h, "clip_scale"));
        digest_dev(h, gs, 4);
        digest_dev(h, nm, 4);
    }
    case_end(h);
}

static void case_adamw(H *h, size_t n, int64_t t, int with_compute) {
    if (!case_begin(h, "adamw[n=%zu,t=%lld%s]", n, (long long)t, with_compute ? ",compute" : "")) return;
    const double lr = 0.05, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1, gsc = 0.8;
    double *p = hrand(h, n, 0.1, 2.0), *g = hrand(h, n, 0.01, 1.0), *m = hrand(h, n, 0.001, 0.2),
           *v = hrand(h, n, 0.001, 0.2);
    for (size_t i = 0; i < n; i++)
        v[i] = fabs(v[i]) * 0.1; /* second moments are non-negative */
    hround(p, n, DG_F32);
    hround(g, n, DG_F32);
    hround(m, n, DG_F32);
    hround(v, n, DG_F32);
    /* float64 reference step, with the float32 hyper-parameters the backend receives */
    double *rp = hnew(h, n), *rm = hnew(h, n), *rv = hnew(h, n), *rdelta = hnew(h, n);
    const double fb1 = (float)b1, fb2 = (float)b2, flr = (float)lr, feps = (float)eps, fwd = (float)wd,
                 fgs = (float)gsc;
    const double bc1 = 1.0 - pow(fb1, (double)t), bc2 = 1.0 - pow(fb2, (double)t);
    for (size_t i = 0; i < n; i++) {
        double gg = g[i] * fgs;
        rm[i] = fb1 * m[i] + (1 - fb1) * gg;
        rv[i] = fb2 * v[i] + (1 - fb2) * gg * gg;
        rdelta[i] = -flr * ((rm[i] / bc1) / (sqrt(rv[i] / bc2) + feps) + fwd * p[i]);
        rp[i] = p[i] + rdelta[i];
    }
    void *dp = dalloc(h, DG_F32, n), *dg = dalloc(h, DG_F32, n), *dm = dalloc(h, DG_F32, n),
         *dv = dalloc(h, DG_F32, n), *dgs = dalloc(h, DG_F32, 1);
    void *dc = with_compute ? dalloc(h, h->act, n) : NULL;
    upload(h, dp, DG_F32, p, n);
    upload(h, dg, DG_F32, g, n);
    upload(h, dm, DG_F32, m, n);
    upload(h, dv, DG_F32, v, n);
    double gsr = fgs;
    upload(h, dgs, DG_F32, &gsr, 1);
    if (dc) poison(h, dc, h->act, n);
    if (!h->bad)
        CALL(h, "adamw",
             adamw(h->be, dp, dc, dg, dm, dv, n, (float)lr, (float)b1, (float)b2, (float)eps, (float)wd, t,
                   dgs));
    const double tol = tol_of(h, "adamw");
    double *gp = download(h, dp, DG_F32, n);
    check_close(h, "m", download(h, dm, DG_F32, n), rm, n, tol, NULL);
    check_close(h, "v", download(h, dv, DG_F32, n), rv, n, tol, NULL);
    if (gp) {
        double *gdelta = hnew(h, n);
        for (size_t i = 0; i < n; i++)
            gdelta[i] = gp[i] - p[i];
        check_close(h, "master update (new - old)", gdelta, rdelta, n, tol, NULL);
        check_close(h, "master", gp, rp, n, tol * 0.1, NULL);
    }
    if (dc && gp) {
        /* compute = the new master rounded to the act dtype, exactly */
        unsigned char *gc = download_raw(h, dc, n * dt_size(h->act));
        double *want = hnew(h, n);
        for (size_t i = 0; i < n; i++)
            want[i] = h_round(gp[i], h->act);
        unsigned char *wb = hraw(h, n * dt_size(h->act));
        h_encode(h->act, want, wb, n);
        check_bits(h, "compute copy == act-dtype cast of new master", gc, wb, n * dt_size(h->act));
        if (gc) digest_add(h, gc, n * dt_size(h->act));
    }
    digest_dev(h, dp, n * 4);
    digest_dev(h, dm, n * 4);
    digest_dev(h, dv, n * 4);
    /* repeat from the same state: same bits */
    void *dp2 = dalloc(h, DG_F32, n), *dm2 = dalloc(h, DG_F32, n), *dv2 = dalloc(h, DG_F32, n);
    upload(h, dp2, DG_F32, p, n);
    upload(h, dm2, DG_F32, m, n);
    upload(h, dv2, DG_F32, v, n);
    if (!h->bad)
        CALL(h, "adamw",
             adamw(h->be, dp2, NULL, dg, dm2, dv2, n, (float)lr, (float)b1, (float)b2, (float)eps, (float)wd,
                   t, dgs));
    check_bits(h, "repeat: master", download_raw(h, dp2, n * 4), download_raw(h, dp, n * 4), n * 4);
    check_bits(h, "repeat: v", download_raw(h, dv2, n * 4), download_raw(h, dv, n * 4), n * 4);
    /* adamw_dev from the same state, lr and bias corrections through the device scalar block (uploaded
     * from page-locked memory with upload_async): the same bits as adamw */
    float *sch = NULL;
    void *dsc = dalloc(h, DG_F32, DG_DS_COUNT);
    if (!h->bad && CALL(h, "host_alloc", host_alloc(h->be, DG_DS_COUNT * sizeof(float), (void **)&sch))) {
        memset(sch, 0, DG_DS_COUNT * sizeof(float));
        sch[DG_DS_GSCALE] = (float)gsc;
        sch[DG_DS_NORM] = 1.5f;
        sch[DG_DS_LR] = (float)lr;
        sch[DG_DS_INV_BC1] = (float)(1.0 / (1.0 - pow((double)(float)b1, (double)t)));
        sch[DG_DS_INV_BC2] = (float)(1.0 / (1.0 - pow((double)(float)b2, (double)t)));
        void *dp3 = dalloc(h, DG_F32, n), *dm3 = dalloc(h, DG_F32, n), *dv3 = dalloc(h, DG_F32, n);
        void *dc3 = with_compute ? dalloc(h, h->act, n) : NULL;
        upload(h, dp3, DG_F32, p, n);
        upload(h, dm3, DG_F32, m, n);
        upload(h, dv3, DG_F32, v, n);
        if (dc3) poison(h, dc3, h->act, n);
        if (!h->bad && CALL(h, "upload_async", upload_async(h->be, dsc, sch, DG_DS_COUNT * sizeof(float))))
            CALL(h, "adamw_dev",
                 adamw_dev(h->be, dp3, dc3, dg, dm3, dv3, n, (float)b1, (float)b2, (float)eps, (float)wd,
                           dsc));
        if (!h->bad) CALL(h, "sync", sync(h->be));
        check_bits(h, "adamw_dev == adamw: master", download_raw(h, dp3, n * 4), download_raw(h, dp, n * 4),
                   n * 4);
        check_bits(h, "adamw_dev == adamw: m", download_raw(h, dm3, n * 4), download_raw(h, dm, n * 4),
                   n * 4);
        check_bits(h, "adamw_dev == adamw: v", download_raw(h, dv3, n * 4), download_raw(h, dv, n * 4),
                   n * 4);
        if (dc3)
            check_bits(h, "adamw_dev == adamw: compute", download_raw(h, dc3, n * dt_size(h->act)),
                       download_raw(h, dc, n * dt_size(h->act)), n * dt_size(h->act));
        /* a non-finite norm in the block skips the step: nothing changes */
        sch[DG_DS_NORM] = NAN;
        if (!h->bad && CALL(h, "upload_async", upload_async(h->be, dsc, sch, DG_DS_COUNT * sizeof(float))))
            CALL(h, "adamw_dev",
                 adamw_dev(h->be, dp3, dc3, dg, dm3, dv3, n, (float)b1, (float)b2, (float)eps, (float)wd,
                           dsc));
        if (!h->bad) CALL(h, "sync", sync(h->be));
        check_bits(h, "adamw_dev with a NaN norm leaves master", download_raw(h, dp3, n * 4),
                   download_raw(h, dp, n * 4), n * 4);
        check_bits(h, "adamw_dev with a NaN norm leaves v", download_raw(h, dv3, n * 4),
                   download_raw(h, dv, n * 4), n * 4);
        h->be->ops->host_free(h->be, sch);
    }
    case_end(h);
}

/* adamw_multi_dev (contract v1.6): one call over a table of segments of flat buffers (gaps between them,
 * weight decay on and off, a skipped segment, counts that are not multiples of 4, an offset that is an odd
 * multiple of 4, two segments with no gap) against one adamw_dev
 * per segment from the same state on the same backend: bitwise the same flat buffers, gaps and skipped
 * segment untouched; a non-finite norm changes nothing. */
static void case_adamw_multi(H *h, int with_compute) {
    if (!case_begin(h, "adamw_multi_dev[%s]", with_compute ? "compute" : "no compute")) return;
    if (!h->be->ops->adamw_multi_dev) { /* optional entry: the executor falls back to adamw_dev */
        pass(h, "adamw_multi_dev: not provided by the %s backend (optional)", h->be->ops->name);
        case_end(h);
        return;
    }
    enum { NS = 5 };
    const size_t counts[NS] = {1000, 7, 70001, 333, 64};
    const uint32_t flags[NS] = {DG_ADAMW_SEG_DECAY, 0, DG_ADAMW_SEG_DECAY,
                                DG_ADAMW_SEG_SKIP | DG_ADAMW_SEG_DECAY, 0};
    dg_adamw_seg_t *tab = hraw(h, NS * sizeof *tab);
    size_t span = 0;
    /* offsets: multiples of 64 with a gap of at least 64 before each, except segment 1 (4 past a multiple
     * of 64: an odd multiple of 4) and segment 4, right after segment 3 (the next multiple of 4: the two
     * share an 8-element group, as kernels working in groups of 8 see them) */
    for (int i = 0; i < NS; i++) {
        tab[i].off = (span + 64 + 63) / 64 * 64;
        if (i == 1) tab[i].off += 4;
        if (i == 4) tab[i].off = (span + 3) / 4 * 4;
        tab[i].count = (uint32_t)counts[i];
        tab[i].flags = flags[i];
        span = tab[i].off + counts[i];
    }
    span += 5; /* a tail after the last segment */
    const double b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    double *p = hrand(h, span, 0.1, 2.0), *g = hrand(h, span, 0.01, 1.0), *m = hrand(h, span, 0.001, 0.2),
           *v = hrand(h, span, 0.001, 0.2);
    for (size_t i = 0; i < span; i++)
        v[i] = fabs(v[i]) * 0.1;
    /* two copies of the state: [0] through adamw_multi_dev, [1] through adamw_dev per segment */
    void *dp[2], *dm[2], *dv[2], *dc[2] = {NULL, NULL};
    void *dg = dalloc(h, DG_F32, span);
    upload(h, dg, DG_F32, g, span);
    for (int k = 0; k < 2; k++) {
        dp[k] = dalloc(h, DG_F32, span);
        dm[k] = dalloc(h, DG_F32, span);
        dv[k] = dalloc(h, DG_F32, span);
        upload(h, dp[k], DG_F32, p, span);
        upload(h, dm[k], DG_F32, m, span);
        upload(h, dv[k], DG_F32, v, span);
        if (with_compute) {
            dc[k] = dalloc(h, h->act, span);
            poison(h, dc[k], h->act, span);
        }
    }
    unsigned char *p0 = download_raw(h, dp[0], span * 4);
    void *dtab = dalloc_bytes(h, NS * sizeof *tab);
    if (!h->bad) CALL(h, "to_device", to_device(h->be, dtab, tab, NS * sizeof *tab));
    float *sch = NULL;
    void *dsc = dalloc(h, DG_F32, DG_DS_COUNT);
    if (!h->bad && CALL(h, "host_alloc", host_alloc(h->be, DG_DS_COUNT * sizeof(float), (void **)&sch))) {
        memset(sch, 0, DG_DS_COUNT * sizeof(float));
        sch[DG_DS_GSCALE] = 0.8f;
        sch[DG_DS_NORM] = 1.5f;
        sch[DG_DS_LR] = 0.05f;
        sch[DG_DS_INV_BC1] = (float)(1.0 / (1.0 - pow((double)(float)b1, 3.0)));
        sch[DG_DS_INV_BC2] = (float)(1.0 / (1.0 - pow((double)(float)b2, 3.0)));
        if (!h->bad && CALL(h, "upload_async", upload_async(h->be, dsc, sch, DG_DS_COUNT * sizeof(float))))
            CALL(h, "adamw_multi_dev",
                 adamw_multi_dev(h->be, dtab, NS, span, dp[0], dc[0], dg, dm[0], dv[0], (float)b1, (float)b2,
                                 (float)eps, (float)wd, dsc));
        for (int i = 0; i < NS && !h->bad; i++) {
            if (tab[i].flags & DG_ADAMW_SEG_SKIP) continue;
            size_t o = tab[i].off;
            char *c1 = dc[1] ? (char *)dc[1] + o * dt_size(h->act) : NULL;
            CALL(h, "adamw_dev",
                 adamw_dev(h->be, (float *)dp[1] + o, c1, (const float *)dg + o, (float *)dm[1] + o,
                           (float *)dv[1] + o, tab[i].count, (float)b1, (float)b2, (float)eps,
                           (tab[i].flags & DG_ADAMW_SEG_DECAY) ? (float)wd : 0.0f, dsc));
        }
        if (!h->bad) CALL(h, "sync", sync(h->be));
        check_bits(h, "adamw_multi_dev == adamw_dev per segment: master", download_raw(h, dp[0], span * 4),
                   download_raw(h, dp[1], span * 4), span * 4);
        check_bits(h, "adamw_multi_dev == adamw_dev per segment: m", download_raw(h, dm[0], span * 4),
                   download_raw(h, dm[1], span * 4), span * 4);
        check_bits(h, "adamw_multi_dev == adamw_dev per segment: v", download_raw(h, dv[0], span * 4),
                   download_raw(h, dv[1], span * 4), span * 4);
        if (with_compute)
            check_bits(h, "adamw_multi_dev == adamw_dev per segment: compute",
                       download_raw(h, dc[0], span * dt_size(h->act)),
                       download_raw(h, dc[1], span * dt_size(h->act)), span * dt_size(h->act));
        /* the gaps and the skipped segment keep their values; the other segments moved */
        unsigned char *p1 = download_raw(h, dp[0], span * 4);
        if (p0 && p1 && !h->bad) {
            size_t changed_gap = 0, unchanged_seg = 0, prev_end = 0;
            for (int i = 0; i <= NS; i++) {
                size_t lo = i < NS ? tab[i].off : span;
                changed_gap += memcmp(p0 + prev_end * 4, p1 + prev_end * 4, (lo - prev_end) * 4) != 0;
                if (i == NS) break;
                int same = memcmp(p0 + lo * 4, p1 + lo * 4, tab[i].count * 4) == 0;
                if (same != ((tab[i].flags & DG_ADAMW_SEG_SKIP) != 0)) unchanged_seg++;
                prev_end = lo + tab[i].count;
            }
            if (changed_gap || unchanged_seg)
                fail(h, "adamw_multi_dev: %zu gaps changed, %zu segments wrongly (un)changed", changed_gap,
                     unchanged_seg);
            else
                pass(h, "adamw_multi_dev: gaps and the skipped segment untouched, %d segments updated",
                     NS - 1);
        }
        if (p1) digest_add(h, p1, span * 4);
        /* a non-finite norm: nothing changes */
        sch[DG_DS_NORM] = INFINITY;
        if (!h->bad && CALL(h, "upload_async", upload_async(h->be, dsc, sch, DG_DS_COUNT * sizeof(float))))
            CALL(h, "adamw_multi_dev",
                 adamw_multi_dev(h->be, dtab, NS, span, dp[0], dc[0], dg, dm[0], dv[0], (float)b1, (float)b2,
                                 (float)eps, (float)wd, dsc));
        if (!h->bad) CALL(h, "sync", sync(h->be));
        check_bits(h, "adamw_multi_dev with an infinite norm leaves master", download_raw(h, dp[0], span * 4),
                   p1, span * 4);
        check_bits(h, "adamw_multi_dev with an infinite norm leaves m", download_raw(h, dm[0], span * 4),
                   download_raw(h, dm[1], span * 4), span * 4);
        h->be->ops->host_free(h->be, sch);
    }
    case_end(h);
}

/* download_async + fences (contract v1.8): a kernel's result copied into page-locked memory and read on
 * the host after fence_wait, with busy work queued before it (so that an unwaited read would still see
 * the poison) and work queued after the fence that changes the source (the copy holds the value at its
 * queue position; the wait does not need that later work). Then, where the backend records graphs, the
 * same sequence recorded once and replayed twice: each replay copies again and fires the fence again. */
static int dl_expect(H *h, const char *what, const float *host, const double *x0, size_t n, double factor) {
    size_t bad = 0, first = n;
    for (size_t i = 0; i < n; i++) {
        float want = (float)(x0[i] * factor); /* exact: x0 is f32-representable, factor a power of two */
        if (memcmp(&host[i], &want, sizeof want) != 0) {
            bad++;
            if (first == n) first = i;
        }
    }
    if (bad)
        fail(h, "%s: %zu of %zu values differ (first at %zu: %g, expected %g)", what, bad, n, first,
             (double)host[first], x0[first] * factor);
    else
        pass(h, "%s: %zu values as expected", what, n);
    return bad == 0;
}

static void host_poison(float *p, size_t n) {
    uint32_t pat = 0x7FC0DEADu;
    for (size_t i = 0; i < n; i++)
        memcpy(&p[i], &pat, 4);
}

static void dl_queue(H *h, void *dx, float *hp, void *f, size_t n, int busy) {
    for (int k = 0; k < busy && !h->bad; k++) /* time on the queue before the copy */
        CALL(h, "scale_f32", scale_f32(h->be, dx, n, 1.0f));
    if (!h->bad) CALL(h, "scale_f32", scale_f32(h->be, dx, n, 2.0f)); /* the value read back */
    if (!h->bad) CALL(h, "download_async", download_async(h->be, hp, dx, n * sizeof(float)));
    if (!h->bad) CALL(h, "fence_record", fence_record(h->be, f));
    if (!h->bad) CALL(h, "scale_f32", scale_f32(h->be, dx, n, 4.0f)); /* behind the fence */
}

static void case_download_fence(H *h) {
    if (!case_begin(h, "download_async+fence")) return;
    const dg_backend_ops_t *o = h->be->ops;
    if (!o->download_async || !o->fence_create || !o->fence_destroy || !o->fence_record || !o->fence_wait) {
        pass(h, "download_async / fences: not provided by the %s backend (optional)", o->name);
        case_end(h);
        return;
    }
    const size_t n = (size_t)1 << 20;
    const int busy = 32;
    double *x0 = hrand(h, n, 0.5, 2.0);
    hround(x0, n, DG_F32);
    void *dx = dalloc(h, DG_F32, n);
    upload(h, dx, DG_F32, x0, n);
    float *hp = NULL;
    void *f = NULL;
    if (!h->bad) CALL(h, "host_alloc", host_alloc(h->be, n * sizeof(float), (void **)&hp));
    if (!h->bad) CALL(h, "fence_create", fence_create(h->be, &f));
    if (!h->bad && !f) fail(h, "fence_create returned DG_OK and a NULL fence");
    if (!h->bad && f) CALL(h, "fence_wait (never recorded)", fence_wait(h->be, f));
    if (!h->bad && hp && f) {
        CALL(h, "sync", sync(h->be));
        host_poison(hp, n);
        dl_queue(h, dx, hp, f, n, busy);
        if (!h->bad && CALL(h, "fence_wait", fence_wait(h->be, f)))
            dl_expect(h, "eager: the copy after fence_wait", hp, x0, n, 2.0);
        if (!h->bad) CALL(h, "sync", sync(h->be));
        float *after = download_raw(h, dx, n * sizeof(float));
        if (after) dl_expect(h, "eager: the source after the work behind the fence", after, x0, n, 8.0);
        digest_add(h, hp, n * sizeof(float));
    }
    if (!h->bad && hp && f && o->graph_begin && o->graph_end && o->graph_launch && o->graph_free) {
        upload(h, dx, DG_F32, x0, n);
        void *g = NULL;
        if (!h->bad) CALL(h, "sync", sync(h->be));
        if (!h->bad && CALL(h, "graph_begin", graph_begin(h->be))) {
            dl_queue(h, dx, hp, f, n, busy); /* recorded, not run */
            int rec_ok = !h->bad;
            h->bad = 0; /* graph_end must run either way */
            if (CALL(h, "graph_end", graph_end(h->be, &g)) && !rec_ok) h->bad = 1;
        }
        double factor = 2.0;
        for (int rep = 1; rep <= 2 && !h->bad && g; rep++) {
            host_poison(hp, n);
            char what[96];
            snprintf(what, sizeof what, "graph replay %d: the copy after fence_wait", rep);
            if (CALL(h, "graph_launch", graph_launch(h->be, g)) &&
                CALL(h, "fence_wait", fence_wait(h->be, f)))
                dl_expect(h, what, hp, x0, n, factor);
            factor *= 8.0; /* each replay scales the source by 2 before its copy and by 4 after */
        }
        if (!h->bad) CALL(h, "sync", sync(h->be));
        float *after = download_raw(h, dx, n * sizeof(float));
        if (after) dl_expect(h, "graph: the source after two replays", after, x0, n, 64.0);
        if (g) o->graph_free(h->be, g);
    } else if (!h->bad) {
        pass(h, "graph recording: not provided by the %s backend", o->name);
    }
    if (f) o->fence_destroy(h->be, f);
    if (hp) o->host_free(h->be, hp);
    case_end(h);
}

/* ---- encoder ---- */

typedef struct {
    const int32_t *tok;
    double *wte, *wpe, *out;
    const double *dout;
    int B, T, C;
} enc_ctx_t;
static double enc_obj(void *p) {
    enc_ctx_t *c = p;
    ref_encoder(c->out, c->tok, c->wte, c->wpe, c->B, c->T, c->C);
    return dotd(c->out, c->dout, (size_t)c->B * c->T * c->C);
}

static void case_encoder(H *h, int B, int T, int C, int V, int Vp, int fd) {
    if (!case_begin(h, "encoder[B=%d,T=%d,C=%d,V=%d,Vp=%d]", B, T, C, V, Vp)) return;
    const dg_dtype_t A = h->act;
    const int Tmax = T + 3; /* position rows past T must stay untouched */
    const size_t N = (size_t)B * T, no = N * C, nte = (size_t)Vp * C, npe = (size_t)Tmax * C;
    int32_t *tok = rand_tokens(h, N, V);
    double *wte = hrand(h, nte, 0.05, 1.0), *wpe = hrand(h, npe, 0.05, 1.0), *dout = hrand(h, no, 0.05, 1.0);
    hround(wte, nte, A);
    hround(wpe, npe, A);
    hround(dout, no, A);
    double *ref = hnew(h, no);
    ref_encoder(ref, tok, wte, wpe, B, T, C);
    void *dtok = dalloc(h, DG_I32, N), *dte = dalloc(h, A, nte), *dpe = dalloc(h, A, npe),
         *dy = dalloc(h, A, no);
    void *o1 = dalloc(h, A, no), *o2 = dalloc(h, A, no);
    upload_i32(h, dtok, tok, N);
    upload(h, dte, A, wte, nte);
    upload(h, dpe, A, wpe, npe);
    upload(h, dy, A, dout, no);
    poison(h, o1, A, no);
    poison(h, o2, A, no);
    if (!h->bad) CALL(h, "encoder_fwd", encoder_fwd(h->be, o1, dtok, dte, dpe, B, T, C));
    if (!h->bad) CALL(h, "encoder_fwd", encoder_fwd(h->be, o2, dtok, dte, dpe, B, T, C));
    check_close(h, "fwd out", download(h, o1, A, no), ref, no, tol_of(h, "encoder_fwd"), NULL);
    check_bits(h, "fwd repeat", download_raw(h, o1, no * dt_size(A)), download_raw(h, o2, no * dt_size(A)),
               no * dt_size(A));
    digest_dev(h, o1, no * dt_size(A));

    /* backward: analytic float64 grads */
    double *gte = hnew(h, nte), *gpe = hnew(h, npe);
    for (size_t i = 0; i < N; i++)
        for (int c = 0; c < C; c++) {
            gte[(size_t)tok[i] * C + c] += dout[i * C + c];
            gpe[(i % T) * C + c] += dout[i * C + c];
        }
    const double tb = tol_of(h, "encoder_bwd");
    void *gte1 = dalloc(h, DG_F32, nte), *gpe1 = dalloc(h, DG_F32, npe), *gte2 = dalloc(h, DG_F32, nte),
         *gpe2 = dalloc(h, DG_F32, npe);
    /* run 1 from zero */
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gte1, nte * 4));
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gpe1, npe * 4));
    if (!h->bad) CALL(h, "encoder_bwd", encoder_bwd(h->be, gte1, gpe1, dy, dtok, B, T, C));
    double *g1 = download(h, gte1, DG_F32, nte), *p1 = download(h, gpe1, DG_F32, npe);
    check_close(h, "bwd dwte", g1, gte, nte, tb, NULL);
    check_close(h, "bwd dwpe", p1, gpe, npe, tb, NULL);
    if (fd) {
        enc_ctx_t cx = {tok, wte, wpe, hnew(h, no), dout, B, T, C};
        check_fd(h, "bwd dwte", enc_obj, &cx, wte, nte, g1, gte, tb);
        check_fd(h, "bwd dwpe", enc_obj, &cx, wpe, npe, p1, gpe, tb);
    }
    digest_dev(h, gte1, nte * 4);
    digest_dev(h, gpe1, npe * 4);
    /* run 2 into non-zero gradients: must add */
    double *pre_te = hrand(h, nte, 0.05, 1.0), *pre_pe = hrand(h, npe, 0.05, 1.0);
    hround(pre_te, nte, DG_F32);
    hround(pre_pe, npe, DG_F32);
    upload(h, gte2, DG_F32, pre_te, nte);
    upload(h, gpe2, DG_F32, pre_pe, npe);
    if (!h->bad) CALL(h, "encoder_bwd", encoder_bwd(h->be, gte2, gpe2, dy, dtok, B, T, C));
    check_close(h, "bwd dwte accumulates (+=)", download(h, gte2, DG_F32, nte),
                add_arrays(h, pre_te, gte, nte), nte, tb, gte);
    check_close(h, "bwd dwpe accumulates (+=)", download(h, gpe2, DG_F32, npe),
                add_arrays(h, pre_pe, gpe, npe), npe, tb, gpe);
    /* run 3 = run 1 */
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gte2, nte * 4));
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gpe2, npe * 4));
    if (!h->bad) CALL(h, "encoder_bwd", encoder_bwd(h->be, gte2, gpe2, dy, dtok, B, T, C));
    check_bits(h, "bwd repeat dwte", download_raw(h, gte2, nte * 4), download_raw(h, gte1, nte * 4), nte * 4);
    check_bits(h, "bwd repeat dwpe", download_raw(h, gpe2, npe * 4), download_raw(h, gpe1, npe * 4), npe * 4);
    case_end(h);
}

/* ---- layernorm ---- */

typedef struct {
    double *x, *w, *b, *out;
    const double *dout;
    int N, C;
} ln_ctx_t;
static double ln_obj(void *p) {
    ln_ctx_t *c = p;
    ref_layernorm(c->out, NULL, NULL, c->x, c->w, c->b, c->N, c->C);
    return dotd(c->out, c->dout, (size_t)c->N * c->C);
}

static void case_layernorm(H *h, int N, int C, double offset, int fd) {
    if (!case_begin(h, "layernorm[N=%d,C=%d,offset=%g]", N, C, offset)) return;
    const dg_dtype_t A = h->act;
    const size_t n = (size_t)N * C;
    double *x = hrand(h, n, 0.05, 1.5), *w = hrand(h, C, 0.2, 1.5), *b = hrand(h, C, 0.05, 1.0);
    double *dout = hrand(h, n, 0.05, 1.0);
    for (size_t i = 0; i < n; i++)
        x[i] += offset; /* rows with |mean| >> std test the variance formula */
    hround(x, n, A);
    hround(w, C, A);
    hround(b, C, A);
    hround(dout, n, A);
    double *ref = hnew(h, n), *rmean = hnew(h, N), *rrstd = hnew(h, N);
    ref_layernorm(ref, rmean, rrstd, x, w, b, N, C);
    void *dx = dalloc(h, A, n), *dw = dalloc(h, A, C), *dbb = dalloc(h, A, C), *dy = dalloc(h, A, n);
    void *o1 = dalloc(h, A, n), *m1 = dalloc(h, DG_F32, N), *r1 = dalloc(h, DG_F32, N);
    void *o2 = dalloc(h, A, n), *m2 = dalloc(h, DG_F32, N), *r2 = dalloc(h, DG_F32, N);
    upload(h, dx, A, x, n);
    upload(h, dw, A, w, C);
    upload(h, dbb, A, b, C);
    upload(h, dy, A, dout, n);
    poison(h, o1, A, n);
    poison(h, m1, DG_F32, N);
    poison(h, r1, DG_F32, N);
    poison(h, o2, A, n);
    poison(h, m2, DG_F32, N);
    poison(h, r2, DG_F32, N);
    if (!h->bad) CALL(h, "layernorm_fwd", layernorm_fwd(h->be, o1, m1, r1, dx, dw, dbb, N, C));
    if (!h->bad) CALL(h, "layernorm_fwd", layernorm_fwd(h->be, o2, m2, r2, dx, dw, dbb, N, C));
    const double tf = tol_of(h, "layernorm_fwd");
    check_close(h, "fwd out", download(h, o1, A, n), ref, n, tf, NULL);
    check_close(h, "fwd mean", download(h, m1, DG_F32, N), rmean, N, tf, NULL);
    check_close(h, "fwd rstd", download(h, r1, DG_F32, N), rrstd, N, tf, NULL);
    check_bits(h, "fwd repeat", download_raw(h, o1, n * dt_size(A)), download_raw(h, o2, n * dt_size(A)),
               n * dt_size(A));
    check_bits(h, "fwd repeat rstd", download_raw(h, r1, N * 4), download_raw(h, r2, N * 4), N * 4);
    digest_dev(h, o1, n * dt_size(A));
    digest_dev(h, m1, N * 4);
    digest_dev(h, r1, N * 4);

    double *rdx = hnew(h, n), *rdw = hnew(h, C), *rdb = hnew(h, C);
    ref_layernorm_bwd(rdx, rdw, rdb, dout, x, w, N, C);
    const double tb = tol_of(h, "layernorm_bwd");
    void *gx1 = dalloc(h, A, n), *gw1 = dalloc(h, DG_F32, C), *gb1 = dalloc(h, DG_F32, C);
    void *gx2 = dalloc(h, A, n), *gw2 = dalloc(h, DG_F32, C), *gb2 = dalloc(h, DG_F32, C);
    /* run 1: acc=0 over poison, parameter grads from zero */
    poison(h, gx1, A, n);
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gw1, C * 4));
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gb1, C * 4));
    if (!h->bad) CALL(h, "layernorm_bwd", layernorm_bwd(h->be, gx1, gw1, gb1, dy, dx, dw, m1, r1, N, C, 0));
    double *ax = download(h, gx1, A, n), *aw = download(h, gw1, DG_F32, C), *ab = download(h, gb1, DG_F32, C);
    check_close(h, "bwd dinp (acc=0)", ax, rdx, n, tb, NULL);
    check_close(h, "bwd dw", aw, rdw, C, tb, NULL);
    check_close(h, "bwd db", ab, rdb, C, tb, NULL);
    if (fd) {
        ln_ctx_t cx = {x, w, b, hnew(h, n), dout, N, C};
        check_fd(h, "bwd dinp", ln_obj, &cx, x, n, ax, rdx, tb);
        check_fd(h, "bwd dw", ln_obj, &cx, w, C, aw, rdw, tb);
        check_fd(h, "bwd db", ln_obj, &cx, b, C, ab, rdb, tb);
    }
    digest_dev(h, gx1, n * dt_size(A));
    digest_dev(h, gw1, C * 4);
    digest_dev(h, gb1, C * 4);
    /* run 2: acc=1 and parameter grads into non-zero buffers */
    double *px = hrand(h, n, 0.05, 1.0), *pw = hrand(h, C, 0.05, 1.0), *pb = hrand(h, C, 0.05, 1.0);
    hround(px, n, A);
    hround(pw, C, DG_F32);
    hround(pb, C, DG_F32);
    upload(h, gx2, A, px, n);
    upload(h, gw2, DG_F32, pw, C);
    upload(h, gb2, DG_F32, pb, C);
    if (!h->bad) CALL(h, "layernorm_bwd", layernorm_bwd(h->be, gx2, gw2, gb2, dy, dx, dw, m1, r1, N, C, 1));
    check_close(h, "bwd dinp (acc=1 adds)", download(h, gx2, A, n), add_arrays(h, px, rdx, n), n, tb, rdx);
    check_close(h, "bwd dw accumulates (+=)", download(h, gw2, DG_F32, C), add_arrays(h, pw, rdw, C), C, tb,
                rdw);
    check_close(h, "bwd db accumulates (+=)", download(h, gb2, DG_F32, C), add_arrays(h, pb, rdb, C), C, tb,
                rdb);
    /* run 3 = run 1 */
    poison(h, gx2, A, n);
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gw2, C * 4));
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gb2, C * 4));
    if (!h->bad) CALL(h, "layernorm_bwd", layernorm_bwd(h->be, gx2, gw2, gb2, dy, dx, dw, m1, r1, N, C, 0));
    check_bits(h, "bwd repeat dinp", download_raw(h, gx2, n * dt_size(A)),
               download_raw(h, gx1, n * dt_size(A)), n * dt_size(A));
    check_bits(h, "bwd repeat dw", download_raw(h, gw2, C * 4), download_raw(h, gw1, C * 4), C * 4);
    check_bits(h, "bwd repeat db", download_raw(h, gb2, C * 4), download_raw(h, gb1, C * 4), C * 4);
    case_end(h);
}

/* ---- matmul ---- */

typedef struct {
    double *x, *w, *bias, *out;
    const double *dout;
    int N, C, OC;
} mm_ctx_t;
static double mm_obj(void *p) { /* objective of the linear part: what matmul_bwd differentiates */
    mm_ctx_t *c = p;
    ref_matmul(c->out, NULL, c->x, c->w, c->bias, c->N, c->C, c->OC, 0);
    return dotd(c->out, c->dout, (size_t)c->N * c->OC);
}

static void case_matmul(H *h, int N, int C, int OC, int has_bias, int gelu, int fd) {
    if (!case_begin(h, "matmul[N=%d,C=%d,OC=%d%s%s]", N, C, OC, has_bias ? ",bias" : "", gelu ? ",gelu" : ""))
        return;
    const dg_dtype_t A = h->act;
    const size_t nx = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
    double *x = hrand(h, nx, 0.05, 1.0), *w = hrand(h, nw, 0.02, 0.3), *bias = hrand(h, OC, 0.05, 0.5),
           *dout = hrand(h, no, 0.05, 1.0);
    hround(x, nx, A);
    hround(w, nw, A);
    hround(bias, OC, A);
    hround(dout, no, A);
    double *ref = hnew(h, no), *rpre = hnew(h, no);
    ref_matmul(ref, rpre, x, w, has_bias ? bias : NULL, N, C, OC, gelu);
    void *dx = dalloc(h, A, nx), *dw = dalloc(h, A, nw), *dbias = has_bias ? dalloc(h, A, OC) : NULL;
    void *dy = dalloc(h, A, no), *o1 = dalloc(h, A, no), *o2 = dalloc(h, A, no);
    void *p1 = gelu ? dalloc(h, A, no) : NULL, *p2 = gelu ? dalloc(h, A, no) : NULL;
    upload(h, dx, A, x, nx);
    upload(h, dw, A, w, nw);
    if (dbias) upload(h, dbias, A, bias, OC);
    upload(h, dy, A, dout, no);
    poison(h, o1, A, no);
    poison(h, o2, A, no);
    if (gelu) {
        poison(h, p1, A, no);
        poison(h, p2, A, no);
    }
    const dg_epilogue_t epi = gelu ? DG_EPI_GELU : DG_EPI_NONE;
    if (!h->bad) CALL(h, "matmul_fwd", matmul_fwd(h->be, o1, p1, dx, dw, dbias, N, C, OC, epi));
    if (!h->bad) CALL(h, "matmul_fwd", matmul_fwd(h->be, o2, p2, dx, dw, dbias, N, C, OC, epi));
    const double tf = tol_of(h, "matmul_fwd");
    check_close(h, gelu ? "fwd out = gelu(pre)" : "fwd out", download(h, o1, A, no), ref, no, tf, NULL);
    if (gelu) check_close(h, "fwd pre", download(h, p1, A, no), rpre, no, tf, NULL);
    check_bits(h, "fwd repeat", download_raw(h, o1, no * dt_size(A)), download_raw(h, o2, no * dt_size(A)),
               no * dt_size(A));
    digest_dev(h, o1, no * dt_size(A));
    if (gelu) digest_dev(h, p1, no * dt_size(A));

    double *rdx = hnew(h, nx), *rdw = hnew(h, nw), *rdb = hnew(h, OC);
    ref_matmul_bwd(rdx, rdw, rdb, dout, x, w, N, C, OC);
    const double tb = tol_of(h, "matmul_bwd");
    void *gx1 = dalloc(h, A, nx), *gw1 = dalloc(h, DG_F32, nw), *gb1 = dalloc(h, DG_F32, OC);
    void *gx2 = dalloc(h, A, nx), *gw2 = dalloc(h, DG_F32, nw), *gb2 = dalloc(h, DG_F32, OC);
    poison(h, gx1, A, nx);
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gw1, nw * 4));
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gb1, OC * 4));
    if (!h->bad) CALL(h, "matmul_bwd", matmul_bwd(h->be, gx1, gw1, gb1, dy, dx, dw, N, C, OC, 0));
    double *ax = download(h, gx1, A, nx), *aw = download(h, gw1, DG_F32, nw),
           *ab = download(h, gb1, DG_F32, OC);
    check_close(h, "bwd dinp (acc=0)", ax, rdx, nx, tb, NULL);
    check_close(h, "bwd dw", aw, rdw, nw, tb, NULL);
    check_close(h, "bwd dbias", ab, rdb, OC, tb, NULL);
    if (fd) {
        mm_ctx_t cx = {x, w, bias, hnew(h, no), dout, N, C, OC};
        check_fd(h, "bwd dinp", mm_obj, &cx, x, nx, ax, rdx, tb);
        check_fd(h, "bwd dw", mm_obj, &cx, w, nw, aw, rdw, tb);
        check_fd(h, "bwd dbias", mm_obj, &cx, bias, OC, ab, rdb, tb);
    }
    digest_dev(h, gx1, nx * dt_size(A));
    digest_dev(h, gw1, nw * 4);
    digest_dev(h, gb1, OC * 4);
    /* run 2: acc=1, grads into non-zero buffers */
    double *px = hrand(h, nx, 0.05, 1.0), *pw = hrand(h, nw, 0.05, 1.0), *pb = hrand(h, OC, 0.05, 1.0);
    hround(px, nx, A);
    hround(pw, nw, DG_F32);
    hround(pb, OC, DG_F32);
    upload(h, gx2, A, px, nx);
    upload(h, gw2, DG_F32, pw, nw);
    upload(h, gb2, DG_F32, pb, OC);
    if (!h->bad) CALL(h, "matmul_bwd", matmul_bwd(h->be, gx2, gw2, gb2, dy, dx, dw, N, C, OC, 1));
    check_close(h, "bwd dinp (acc=1 adds)", download(h, gx2, A, nx), add_arrays(h, px, rdx, nx), nx, tb, rdx);
    check_close(h, "bwd dw accumulates (+=)", download(h, gw2, DG_F32, nw), add_arrays(h, pw, rdw, nw), nw,
                tb, rdw);
    check_close(h, "bwd dbias accumulates (+=)", download(h, gb2, DG_F32, OC), add_arrays(h, pb, rdb, OC), OC,
                tb, rdb);
    /* run 3 = run 1 */
    poison(h, gx2, A, nx);
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gw2, nw * 4));
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gb2, OC * 4));
    if (!h->bad) CALL(h, "matmul_bwd", matmul_bwd(h->be, gx2, gw2, gb2, dy, dx, dw, N, C, OC, 0));
    check_bits(h, "bwd repeat dinp", download_raw(h, gx2, nx * dt_size(A)),
               download_raw(h, gx1, nx * dt_size(A)), nx * dt_size(A));
    check_bits(h, "bwd repeat dw", download_raw(h, gw2, nw * 4), download_raw(h, gw1, nw * 4), nw * 4);
    check_bits(h, "bwd repeat dbias", download_raw(h, gb2, OC * 4), download_raw(h, gb1, OC * 4), OC * 4);
    /* run 4: no input gradient and no bias gradient wanted */
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gw2, nw * 4));
    if (!h->bad) CALL(h, "matmul_bwd", matmul_bwd(h->be, NULL, gw2, NULL, dy, dx, dw, N, C, OC, 0));
    check_close(h, "bwd dw with dinp=NULL, dbias=NULL", download(h, gw2, DG_F32, nw), rdw, nw, tb, NULL);
    case_end(h);
}

/* ---- matmul_fwd_res (contract v1.11): the linear layer and the residual add in one call ---- */

/* out = x·wᵀ + bias + res against float64, out of place (res untouched) and in place (out == res), every
 * output poisoned first, repeated for bits; a residual buffer `off` elements past a 256-byte boundary
 * (CUDA: C's alignment differs from D's). */
static void case_matmul_res(H *h, int N, int C, int OC, int has_bias, int off) {
    if (!case_begin(h, "matmul_fwd_res[N=%d,C=%d,OC=%d%s,off=%d]", N, C, OC, has_bias ? ",bias" : "", off))
        return;
    if (!h->be->ops->matmul_fwd_res) { /* optional entry: the graph keeps the matmul and the add */
        pass(h, "matmul_fwd_res: not provided by the %s backend (optional)", h->be->ops->name);
        case_end(h);
        return;
    }
    const dg_dtype_t A = h->act;
    const size_t nx = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC, ob = no * dt_size(A);
    double *x = hrand(h, nx, 0.05, 1.0), *w = hrand(h, nw, 0.02, 0.3), *bias = hrand(h, OC, 0.05, 0.5),
           *res = hrand(h, no, -1.0, 1.0);
    hround(x, nx, A);
    hround(w, nw, A);
    hround(bias, OC, A);
    hround(res, no, A);
    double *ref = hnew(h, no);
    ref_matmul(ref, NULL, x, w, has_bias ? bias : NULL, N, C, OC, 0);
    for (size_t i = 0; i < no; i++)
        ref[i] += res[i];
    void *dx = dalloc(h, A, nx), *dw = dalloc(h, A, nw), *db = has_bias ? dalloc(h, A, OC) : NULL;
    char *rbase = dalloc_bytes(h, ob + 256);
    void *o1 = dalloc(h, A, no), *o2 = dalloc(h, A, no);
    if (h->bad) {
        case_end(h);
        return;
    }
    void *dr = rbase + (size_t)off * dt_size(A);
    upload(h, dx, A, x, nx);
    upload(h, dw, A, w, nw);
    if (db) upload(h, db, A, bias, OC);
    upload(h, dr, A, res, no);
    void *rraw = download_raw(h, dr, ob);
    poison(h, o1, A, no);
    poison(h, o2, A, no);
    if (!h->bad) CALL(h, "matmul_fwd_res", matmul_fwd_res(h->be, o1, dx, dw, db, dr, N, C, OC));
    if (!h->bad) CALL(h, "matmul_fwd_res", matmul_fwd_res(h->be, o2, dx, dw, db, dr, N, C, OC));
    const double tf = tol_of(h, "matmul_fwd_res");
    check_close(h, "out = x·wᵀ + bias + res", download(h, o1, A, no), ref, no, tf, NULL);
    check_bits(h, "repeat", download_raw(h, o1, ob), download_raw(h, o2, ob), ob);
    check_bits(h, "out of place leaves res", download_raw(h, dr, ob), rraw, ob);
    digest_dev(h, o1, ob);
    /* in place: the residual stream updated where it lies */
    if (!h->bad) CALL(h, "matmul_fwd_res", matmul_fwd_res(h->be, dr, dx, dw, db, dr, N, C, OC));
    check_close(h, "in place (out == res)", download(h, dr, A, no), ref, no, tf, NULL);
    case_end(h);
}

/* ---- matmul_bwd_dgelu: matmul_bwd through a GELU ---- */

typedef struct {
    double *pre, *w, *bias, *act, *out;
    const double *inp, *dout;
    int N, C, OC;
} mmg_ctx_t;
/* through the GELU: sum(dout * (gelu(pre)·wᵀ + b)); what dpre differentiates */
static double mmg_obj_pre(void *p) {
    mmg_ctx_t *c = p;
    for (size_t i = 0; i < (size_t)c->N * c->C; i++)
        c->act[i] = ref_gelu1(c->pre[i]);
    ref_matmul(c->out, NULL, c->act, c->w, c->bias, c->N, c->C, c->OC, 0);
    return dotd(c->out, c->dout, (size_t)c->N * c->OC);
}
/* with the GELU output fixed to the act-dtype values the backend reads (what dw and dbias differentiate) */
static double mmg_obj_w(void *p) {
    mmg_ctx_t *c = p;
    ref_matmul(c->out, NULL, c->inp, c->w, c->bias, c->N, c->C, c->OC, 0);
    return dotd(c->out, c->dout, (size_t)c->N * c->OC);
}

static void case_matmul_dgelu(H *h, int N, int C, int OC, int has_bias, int fd) {
    if (!case_begin(h, "matmul_bwd_dgelu[N=%d,C=%d,OC=%d%s]", N, C, OC, has_bias ? ",bias" : "")) return;
    const dg_dtype_t A = h->act;
    const size_t nx = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
    double *pre = hrand(h, nx, 0.01, 3.0), *w = hrand(h, nw, 0.02, 0.3), *bias = hrand(h, OC, 0.05, 0.5),
           *dout = hrand(h, no, 0.05, 1.0);
    for (size_t i = 0; i < nx; i += 13)
        pre[i] *= 2.5; /* some tails */
    hround(pre, nx, A);
    hround(w, nw, A);
    hround(bias, OC, A);
    hround(dout, no, A);
    double *inp = hnew(h, nx);
    for (size_t i = 0; i < nx; i++)
        inp[i] = h_round(ref_gelu1(pre[i]), A); /* the saved (or recomputed) GELU output */
    /* float64 references: dpre = (dout·w) ⊙ gelu'(pre), dw = doutᵀ·inp, dbias = colsum(dout) */
    double *rdx = hnew(h, nx), *rdw = hnew(h, nw), *rdb = hnew(h, OC);
    ref_matmul_bwd(rdx, rdw, rdb, dout, inp, w, N, C, OC);
    for (size_t i = 0; i < nx; i++)
        rdx[i] *= ref_gelu_grad1(pre[i]);
    const double tb = tol_of(h, "matmul_bwd_dgelu");
    void *dpre_ = dalloc(h, A, nx), *dinp = dalloc(h, A, nx), *dw = dalloc(h, A, nw), *dy = dalloc(h, A, no);
    void *gx1 = dalloc(h, A, nx), *gw1 = dalloc(h, DG_F32, nw), *gb1 = dalloc(h, DG_F32, OC);
    void *gx2 = dalloc(h, A, nx), *gw2 = dalloc(h, DG_F32, nw), *gb2 = dalloc(h, DG_F32, OC);
    upload(h, dpre_, A, pre, nx);
    upload(h, dinp, A, inp, nx);
    upload(h, dw, A, w, nw);
    upload(h, dy, A, dout, no);
    /* run 1: acc = 0 into poison, parameter gradients from zero */
    poison(h, gx1, A, nx);
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gw1, nw * 4));
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gb1, OC * 4));
    if (!h->bad)
        CALL(h, "matmul_bwd_dgelu",
             matmul_bwd_dgelu(h->be, gx1, gw1, has_bias ? gb1 : NULL, dy, dinp, dw, dpre_, N, C, OC, 0));
    double *ax = download(h, gx1, A, nx), *aw = download(h, gw1, DG_F32, nw),
           *ab = download(h, gb1, DG_F32, OC);
    check_close(h, "dpre (acc=0)", ax, rdx, nx, tb, NULL);
    check_close(h, "dw", aw, rdw, nw, tb, NULL);
    if (has_bias) check_close(h, "dbias", ab, rdb, OC, tb, NULL);
    if (fd) {
        mmg_ctx_t cx = {pre, w, bias, hnew(h, nx), hnew(h, no), inp, dout, N, C, OC};
        check_fd(h, "dpre", mmg_obj_pre, &cx, pre, nx, ax, rdx, tb);
        check_fd(h, "dw", mmg_obj_w, &cx, w, nw, aw, rdw, tb);
        if (has_bias) check_fd(h, "dbias", mmg_obj_w, &cx, bias, OC, ab, rdb, tb);
    }
    digest_dev(h, gx1, nx * dt_size(A));
    digest_dev(h, gw1, nw * 4);
    /* the unfused composition on the same backend: matmul_bwd, then gelu_bwd. f32: the same bits (the
     * contract); bf16/f16: within the bound (the fused epilogue rounds once, not twice). */
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gw2, nw * 4));
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gb2, OC * 4));
    if (!h->bad)
        CALL(h, "matmul_bwd", matmul_bwd(h->be, gx2, gw2, has_bias ? gb2 : NULL, dy, dinp, dw, N, C, OC, 0));
    if (!h->bad) CALL(h, "gelu_bwd", gelu_bwd(h->be, gx2, dpre_, gx2, nx, 0));
    if (A == DG_F32) {
        check_bits(h, "dpre == matmul_bwd + gelu_bwd", download_raw(h, gx1, nx * 4),
                   download_raw(h, gx2, nx * 4), nx * 4);
    } else {
        check_close(h, "dpre vs matmul_bwd + gelu_bwd", ax, download(h, gx2, A, nx), nx, 2 * tb, rdx);
    }
    check_bits(h, "dw == matmul_bwd's", download_raw(h, gw1, nw * 4), download_raw(h, gw2, nw * 4), nw * 4);
    /* run 2: acc = 1 adds after the derivative; parameter gradients accumulate */
    double *px = hrand(h, nx, 0.05, 1.0), *pw = hrand(h, nw, 0.05, 1.0), *pb = hrand(h, OC, 0.05, 1.0);
    hround(px, nx, A);
    hround(pw, nw, DG_F32);
    hround(pb, OC, DG_F32);
    upload(h, gx2, A, px, nx);
    upload(h, gw2, DG_F32, pw, nw);
    upload(h, gb2, DG_F32, pb, OC);
    if (!h->bad)
        CALL(h, "matmul_bwd_dgelu",
             matmul_bwd_dgelu(h->be, gx2, gw2, has_bias ? gb2 : NULL, dy, dinp, dw, dpre_, N, C, OC, 1));
    check_close(h, "dpre (acc=1 adds)", download(h, gx2, A, nx), add_arrays(h, px, rdx, nx), nx, tb, rdx);
    check_close(h, "dw accumulates (+=)", download(h, gw2, DG_F32, nw), add_arrays(h, pw, rdw, nw), nw, tb,
                rdw);
    if (has_bias)
        check_close(h, "dbias accumulates (+=)", download(h, gb2, DG_F32, OC), add_arrays(h, pb, rdb, OC), OC,
                    tb, rdb);
    /* run 3: dpre aliasing inp (acc = 0), otherwise run 1's call (with its bias gradient: on CUDA the
     * weight-gradient GEMM with the BGRADB epilogue is another algorithm than without, so dropping it
     * would change dw's bits for a reason other than the aliasing): the same bits as run 1 */
    void *alias = dalloc(h, A, nx);
    void *gb3 = has_bias ? dalloc(h, DG_F32, OC) : NULL;
    upload(h, alias, A, inp, nx);
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gw2, nw * 4));
    if (gb3 && !h->bad) CALL(h, "memset0", memset0(h->be, gb3, OC * 4));
    if (!h->bad)
        CALL(h, "matmul_bwd_dgelu",
             matmul_bwd_dgelu(h->be, alias, gw2, gb3, dy, alias, dw, dpre_, N, C, OC, 0));
    check_bits(h, "dpre in place over inp == run 1", download_raw(h, alias, nx * dt_size(A)),
               download_raw(h, gx1, nx * dt_size(A)), nx * dt_size(A));
    check_bits(h, "dw in place == run 1", download_raw(h, gw2, nw * 4), download_raw(h, gw1, nw * 4), nw * 4);
    if (gb3)
        check_bits(h, "dbias in place == run 1", download_raw(h, gb3, OC * 4), download_raw(h, gb1, OC * 4),
                   OC * 4);
    /* run 4 = run 1, repeated */
    poison(h, gx2, A, nx);
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gw2, nw * 4));
    if (!h->bad) CALL(h, "memset0", memset0(h->be, gb2, OC * 4));
    if (!h->bad)
        CALL(h, "matmul_bwd_dgelu",
             matmul_bwd_dgelu(h->be, gx2, gw2, has_bias ? gb2 : NULL, dy, dinp, dw, dpre_, N, C, OC, 0));
    check_bits(h, "repeat dpre", download_raw(h, gx2, nx * dt_size(A)), download_raw(h, gx1, nx * dt_size(A)),
               nx * dt_size(A));
    check_bits(h, "repeat dw", download_raw(h, gw2, nw * 4), download_raw(h, gw1, nw * 4), nw * 4);
    if (has_bias)
        check_bits(h, "repeat dbias", download_raw(h, gb2, OC * 4), download_raw(h, gb1, OC * 4), OC * 4);
    /* bad aliasing is refused, not computed */
    if (!h->bad) {
        dg_status_t st =
            h->be->ops->matmul_bwd_dgelu(h->be, dpre_, gw2, NULL, dy, dinp, dw, dpre_, N, C, OC, 0);
        if (st == DG_OK)
            fail(h, "dpre aliasing pre was accepted");
        else
            pass(h, "dpre aliasing pre refused: %s", dg_last_error());
    }
    case_end(h);
}

/* ---- gelu ---- */

typedef struct {
    double *x;
    const double *dout;
    size_t n;
} gelu_ctx_t;
static double gelu_obj(void *p) {
    gelu_ctx_t *c = p;
    double s = 0;
    for (size_t i = 0; i < c->n; i++)
        s += c->dout[i] * ref_gelu1(c->x[i]);
    return s;
}

static void case_gelu(H *h, size_t n, int fd) {
    if (!case_begin(h, "gelu[n=%zu]", n)) return;
    const dg_dtype_t A = h->act;
    double *x = hrand(h, n, 0.01, 5.0), *dout = hrand(h, n, 0.05, 1.0);
    for (size_t i = 0; i < n; i += 17)
        x[i] *= 3.0; /* some tails, out to |x| = 15 */
    hround(x, n, A);
    hround(dout, n, A);
    double *ref = hnew(h, n), *rdx = hnew(h, n);
    for (size_t i = 0; i < n; i++) {
        ref[i] = ref_gelu1(x[i]);
        rdx[i] = dout[i] * ref_gelu_grad1(x[i]);
    }
    void *dx = dalloc(h, A, n), *dy = dalloc(h, A, n), *o1 = dalloc(h, A, n), *o2 = dalloc(h, A, n);
    void *g1 = dalloc(h, A, n), *g2 = dalloc(h, A, n);
    upload(h, dx, A, x, n);
    upload(h, dy, A, dout, n);
    poison(h, o1, A, n);
    poison(h, o2, A, n);
    if (!h->bad) CALL(h, "gelu_fwd", gelu_fwd(h->be, o1, dx, n));
    if (!h->bad) CALL(h, "gelu_fwd", gelu_fwd(h->be, o2, dx, n));
    check_close(h, "fwd", download(h, o1, A, n), ref, n, tol_of(h, "gelu_fwd"), NULL);
    check_bits(h, "fwd repeat", download_raw(h, o1, n * dt_size(A)), download_raw(h, o2, n * dt_size(A)),
               n * dt_size(A));
    digest_dev(h, o1, n * dt_size(A));
    const double tb = tol_of(h, "gelu_bwd");
    poison(h, g1, A, n);
    if (!h->bad) CALL(h, "gelu_bwd", gelu_bwd(h->be, g1, dx, dy, n, 0));
    double *a = download(h, g1, A, n);
    check_close(h, "bwd (acc=0)", a, rdx, n, tb, NULL);
    if (fd) {
        gelu_ctx_t cx = {x, dout, n};
        check_fd(h, "bwd dinp", gelu_obj, &cx, x, n, a, rdx, tb);
    }
    digest_dev(h, g1, n * dt_size(A));
    double *pre = hrand(h, n, 0.05, 1.0);
    hround(pre, n, A);
    upload(h, g2, A, pre, n);
    if (!h->bad) CALL(h, "gelu_bwd", gelu_bwd(h->be, g2, dx, dy, n, 1));
    check_close(h, "bwd (acc=1 adds)", download(h, g2, A, n), add_arrays(h, pre, rdx, n), n, tb, rdx);
    poison(h, g2, A, n);
    if (!h->bad) CALL(h, "gelu_bwd", gelu_bwd(h->be, g2, dx, dy, n, 0));
    check_bits(h, "bwd repeat", download_raw(h, g2, n * dt_size(A)), download_raw(h, g1, n * dt_size(A)),
               n * dt_size(A));
    case_end(h);
}

/* ---- attention ---- */

typedef struct {
    double *qkv, *out, *p;
    const double *dout;
    int B, T, C, NH;
} att_ctx_t;
static double att_obj(void *pv) {
    att_ctx_t *c = pv;
    ref_attention(c->out, c->qkv, c->B, c->T, c->C, c->NH, c->p);
    return dotd(c->out, c->dout, (size_t)c->B * c->T * c->C);
}

static void case_attention(H *h, int B, int T, int C, int NH, int fd) {
    if (!case_begin(h, "attention[B=%d,T=%d,C=%d,NH=%d]", B, T, C, NH)) return;
    const dg_dtype_t A = h->act;
    const size_t nq = (size_t)B * T * 3 * C, no = (size_t)B * T * C;
    double *qkv = hrand(h, nq, 0.05, 1.5), *dout = hrand(h, no, 0.05, 1.0);
    hround(qkv, nq, A);
    hround(dout, no, A);
    double *ref = hnew(h, no), *p = hnew(h, T), *dp = hnew(h, T), *rdq = hnew(h, nq);
    ref_attention(ref, qkv, B, T, C, NH, p);
    ref_attention_bwd(rdq, dout, qkv, B, T, C, NH, p, dp);
    const size_t auxb = h->be->ops->attention_aux_bytes(h->be, B, T, C, NH);
    void *dq = dalloc(h, A, nq), *dy = dalloc(h, A, no), *o1 = dalloc(h, A, no), *o2 = dalloc(h, A, no);
    void *aux1 = dalloc_bytes(h, auxb), *aux2 = dalloc_bytes(h, auxb);
    void *g1 = dalloc(h, A, nq), *g2 = dalloc(h, A, nq);
    upload(h, dq, A, qkv, nq);
    upload(h, dy, A, dout, no);
    poison(h, o1, A, no);
    poison(h, o2, A, no);
    poison_bytes(h, aux1, auxb); /* backward reading aux the forward never wrote would produce NaN */
    poison_bytes(h, aux2, auxb);
    if (!h->bad) CALL(h, "attention_fwd", attention_fwd(h->be, o1, aux1, dq, B, T, C, NH));
    if (!h->bad) CALL(h, "attention_fwd", attention_fwd(h->be, o2, aux2, dq, B, T, C, NH));
    check_close(h, "fwd out", download(h, o1, A, no), ref, no, tol_of(h, "attention_fwd"), NULL);
    check_bits(h, "fwd repeat", download_raw(h, o1, no * dt_size(A)), download_raw(h, o2, no * dt_size(A)),
               no * dt_size(A));
    digest_dev(h, o1, no * dt_size(A));
    const double tb = tol_of(h, "attention_bwd");
    poison(h, g1, A, nq);
    poison(h, g2, A, nq);
    if (!h->bad) CALL(h, "attention_bwd", attention_bwd(h->be, g1, dy, dq, o1, aux1, B, T, C, NH));
    if (!h->bad) CALL(h, "attention_bwd", attention_bwd(h->be, g2, dy, dq, o2, aux2, B, T, C, NH));
    double *a = download(h, g1, A, nq);
    check_close(h, "bwd dqkv", a, rdq, nq, tb, NULL);
    if (fd) {
        att_ctx_t cx = {qkv, hnew(h, no), p, dout, B, T, C, NH};
        check_fd(h, "bwd dqkv", att_obj, &cx, qkv, nq, a, rdq, tb);
    }
    check_bits(h, "bwd repeat", download_raw(h, g1, nq * dt_size(A)), download_raw(h, g2, nq * dt_size(A)),
               nq * dt_size(A));
    digest_dev(h, g1, nq * dt_size(A));
    case_end(h);
}

/* ---- cross-entropy ---- */

typedef struct {
    double *z, *loss;
    const int32_t *tg;
    int N, V, Vp;
    double dloss;
} ce_ctx_t;
static double ce_obj(void *p) {
    ce_ctx_t *c = p;
    ref_ce(c->loss, NULL, c->z, c->tg, c->N, c->V, c->Vp);
    double s = 0;
    for (int i = 0; i < c->N; i++)
        s += c->loss[i];
    return s * c->dloss;
}

static void case_crossentropy(H *h, int N, int V, int Vp, int fd) {
    if (!case_begin(h, "crossentropy[N=%d,V=%d,Vp=%d]", N, V, Vp)) return;
    const dg_dtype_t A = h->act;
    const size_t nz = (size_t)N * Vp;
    double *z = hrand(h, nz, 0.05, 4.0); /* padded columns hold garbage too: they must be ignored */
    int32_t *tg = rand_tokens(h, N, V);
    hround(z, nz, A);
    const double dloss = (double)(float)(1.3 / N);
    double *rl = hnew(h, N), *rlse = hnew(h, N), *rdz = hnew(h, nz);
    ref_ce(rl, rlse, z, tg, N, V, Vp);
    ref_ce_bwd(rdz, z, tg, N, V, Vp, dloss);
    void *dz = dalloc(h, A, nz), *dtg = dalloc(h, DG_I32, N);
    void *l1 = dalloc(h, DG_F32, N), *s1 = dalloc(h, DG_F32, N), *l2 = dalloc(h, DG_F32, N),
         *s2 = dalloc(h, DG_F32, N);
    void *g1 = dalloc(h, A, nz), *g2 = dalloc(h, A, nz);
    upload(h, dz, A, z, nz);
    upload_i32(h, dtg, tg, N);
    poison(h, l1, DG_F32, N);
    poison(h, s1, DG_F32, N);
    poison(h, l2, DG_F32, N);
    poison(h, s2, DG_F32, N);
    if (!h->bad) CALL(h, "crossentropy_fwd", crossentropy_fwd(h->be, l1, s1, dz, dtg, N, V, Vp));
    if (!h->bad) CALL(h, "crossentropy_fwd", crossentropy_fwd(h->be, l2, s2, dz, dtg, N, V, Vp));
    const double tf = tol_of(h, "crossentropy_fwd");
    check_close(h, "fwd losses", download(h, l1, DG_F32, N), rl, N, tf, NULL);
    check_close(h, "fwd lse", download(h, s1, DG_F32, N), rlse, N, tf, NULL);
    check_bits(h, "fwd repeat", download_raw(h, l1, N * 4), download_raw(h, l2, N * 4), N * 4);
    digest_dev(h, l1, N * 4);
    digest_dev(h, s1, N * 4);
    const double tb = tol_of(h, "crossentropy_bwd");
    poison(h, g1, A, nz);
    if (!h->bad)
        CALL(h, "crossentropy_bwd", crossentropy_bwd(h->be, g1, dz, s1, dtg, N, V, Vp, (float)dloss));
    double *a = download(h, g1, A, nz);
    check_close(h, "bwd dlogits (padded columns = 0)", a, rdz, nz, tb, NULL);
    if (fd) {
        ce_ctx_t cx = {z, hnew(h, N), tg, N, V, Vp, dloss};
        check_fd(h, "bwd dlogits", ce_obj, &cx, z, nz, a, rdz, tb);
    }
    digest_dev(h, g1, nz * dt_size(A));
    poison(h, g2, A, nz);
    if (!h->bad)
        CALL(h, "crossentropy_bwd", crossentropy_bwd(h->be, g2, dz, s1, dtg, N, V, Vp, (float)dloss));
    check_bits(h, "bwd repeat", download_raw(h, g2, nz * dt_size(A)), download_raw(h, g1, nz * dt_size(A)),
               nz * dt_size(A));
    /* in place: dlogits aliasing logits */
    void *inplace = ddup(h, dz, nz * dt_size(A));
    if (!h->bad)
        CALL(h, "crossentropy_bwd",
             crossentropy_bwd(h->be, inplace, inplace, s1, dtg, N, V, Vp, (float)dloss));
    check_bits(h, "bwd in place (dlogits == logits)", download_raw(h, inplace, nz * dt_size(A)),
               download_raw(h, g1, nz * dt_size(A)), nz * dt_size(A));
    case_end(h);
}

/* crossentropy_fused (contract v1.10): the same bits as crossentropy_fwd followed by crossentropy_bwd on
 * this backend, out of place and in place (dlogits == logits), with every output poisoned first; and
 * within the forward/backward tolerances of the float64 references. lg_off / dl_off shift logits /
 * dlogits by that many elements from a 256-byte boundary (CUDA: misaligned logits take the scalar
 * reduction; misaligned dlogits keep the vector reduction with scalar stores). A large Vp: rows that do
 * not fit in GPU shared memory (CUDA's two-pass kernel). */
static void case_crossentropy_fused(H *h, int N, int V, int Vp, int lg_off, int dl_off) {
    if (!case_begin(h, "crossentropy_fused[N=%d,V=%d,Vp=%d,off=%d/%d]", N, V, Vp, lg_off, dl_off)) return;
    if (!h->be->ops->crossentropy_fused) { /* optional entry: the graph keeps the two ops */
        pass(h, "crossentropy_fused: not provided by the %s backend (optional)", h->be->ops->name);
        case_end(h);
        return;
    }
    const dg_dtype_t A = h->act;
    const size_t es = dt_size(A), nz = (size_t)N * Vp, zb = nz * es;
    double *z = hrand(h, nz, 0.05, 4.0); /* padded columns hold garbage too: they must be ignored */
    int32_t *tg = rand_tokens(h, N, V);
    tg[N - 1] = V - 1; /* the last real column (in a vector that reaches into the padding) */
    hround(z, nz, A);
    const double dloss = (double)(float)(0.7 / N);
    double *rl = hnew(h, N), *rlse = hnew(h, N), *rdz = hnew(h, nz);
    ref_ce(rl, rlse, z, tg, N, V, Vp);
    ref_ce_bwd(rdz, z, tg, N, V, Vp, dloss);
    char *zbase = dalloc_bytes(h, zb + 256), *gbase = dalloc_bytes(h, zb + 256),
         *rbase = dalloc_bytes(h, zb + 256);
    void *dtg = dalloc(h, DG_I32, N);
    void *l1 = dalloc(h, DG_F32, N), *s1 = dalloc(h, DG_F32, N), *l2 = dalloc(h, DG_F32, N),
         *s2 = dalloc(h, DG_F32, N);
    if (h->bad) {
        case_end(h);
        return;
    }
    void *dz = zbase + (size_t)lg_off * es, *g1 = gbase + (size_t)dl_off * es,
         *g0 = rbase + (size_t)dl_off * es;
    upload(h, dz, A, z, nz);
    upload_i32(h, dtg, tg, N);
    void *zraw = download_raw(h, dz, zb);
    /* the unfused pair on this backend: the reference bits */
    poison(h, l1, DG_F32, N);
    poison(h, s1, DG_F32, N);
    poison(h, g0, A, nz);
    if (!h->bad) CALL(h, "crossentropy_fwd", crossentropy_fwd(h->be, l1, s1, dz, dtg, N, V, Vp));
    if (!h->bad)
        CALL(h, "crossentropy_bwd", crossentropy_bwd(h->be, g0, dz, s1, dtg, N, V, Vp, (float)dloss));
    void *rl_bits = download_raw(h, l1, N * 4), *rs_bits = download_raw(h, s1, N * 4);
    void *rg_bits = download_raw(h, g0, zb);
    /* fused, out of place */
    poison(h, l2, DG_F32, N);
    poison(h, s2, DG_F32, N);
    poison(h, g1, A, nz);
    if (!h->bad)
        CALL(h, "crossentropy_fused", crossentropy_fused(h->be, l2, s2, g1, dz, dtg, N, V, Vp, (float)dloss));
    check_close(h, "fused losses", download(h, l2, DG_F32, N), rl, N, tol_of(h, "crossentropy_fwd"), NULL);
    check_close(h, "fused lse", download(h, s2, DG_F32, N), rlse, N, tol_of(h, "crossentropy_fwd"), NULL);
    check_close(h, "fused dlogits (padded columns = 0)", download(h, g1, A, nz), rdz, nz,
                tol_of(h, "crossentropy_bwd"), NULL);
    check_bits(h, "fused losses == crossentropy_fwd's", download_raw(h, l2, N * 4), rl_bits, N * 4);
    check_bits(h, "fused lse == crossentropy_fwd's", download_raw(h, s2, N * 4), rs_bits, N * 4);
    check_bits(h, "fused dlogits == crossentropy_bwd's", download_raw(h, g1, zb), rg_bits, zb);
    check_bits(h, "fused out of place leaves the logits", download_raw(h, dz, zb), zraw, zb);
    digest_dev(h, l2, N * 4);
    digest_dev(h, s2, N * 4);
    digest_dev(h, g1, zb);
    /* fused, in place: dlogits over the logits */
    poison(h, l2, DG_F32, N);
    poison(h, s2, DG_F32, N);
    if (!h->bad)
        CALL(h, "crossentropy_fused", crossentropy_fused(h->be, l2, s2, dz, dz, dtg, N, V, Vp, (float)dloss));
    check_bits(h, "fused in place: losses", download_raw(h, l2, N * 4), rl_bits, N * 4);
    check_bits(h, "fused in place: lse", download_raw(h, s2, N * 4), rs_bits, N * 4);
    check_bits(h, "fused in place: dlogits over the logits == crossentropy_bwd's", download_raw(h, dz, zb),
               rg_bits, zb);
    case_end(h);
}

/* ======================= driver ======================= */

void dg_harness_opts_init(dg_harness_opts_t *o) {
    memset(o, 0, sizeof *o);
    o->tol_scale = 1.0;
}

int dg_op_harness_run(dg_backend_t *be, const dg_harness_opts_t *opts) {
    dg_harness_opts_t defaults;
    dg_harness_opts_init(&defaults);
    const dg_harness_opts_t *o = opts ? opts : &defaults;
    H hs = {0}, *h = &hs;
    h->be = be;
    h->o = o;
    h->log = o->log ? o->log : stdout;
    h->act = be->act_dtype;
    h->tol_scale = o->tol_scale > 0 ? o->tol_scale : 1.0;
    h->rng = o->seed ? o->seed : 0x5EED0DA7A0000001ull;

    /* Shapes: the issue's odd sizes (C=72, T=13, NH=3, V=259, Vp=320), degenerate ones (T=1, one row,
     * C not a multiple of the vector width), T past the CPU attention block (64), and "wide" cases that
     * span many GEMM tiles and exceed every single-thread cutoff, so thread splits are exercised. The
     * wide cases skip finite differences (their analytic float64 gradients are still checked). */
    case_memory(h);
    const dg_dtype_t fl[] = {DG_F32, DG_BF16, DG_F16};
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 3; j++)
            case_cast(h, fl[i], fl[j], 1000);
    case_cast(h, DG_F32, DG_BF16, 50000);
    case_elementwise(h, 1001);
    case_elementwise(h, 70001);
    case_sumsq(h, 1000);
    case_sumsq(h, 100003);
    case_sumsq_multi(h, 0);
    case_sumsq_multi(h, 1);
    case_sumsq_multi(h, 2);
    case_clip(h);
    case_adamw(h, 1000, 1, 1);
    case_adamw(h, 1001, 7, 0);
    case_adamw(h, 70001, 3, 1);
    case_adamw_multi(h, 1);
    case_adamw_multi(h, 0);
    case_download_fence(h);

    case_encoder(h, 2, 13, 72, 259, 320, 1);
    case_encoder(h, 3, 5, 20, 7, 11, 1);
    case_encoder(h, 4, 64, 160, 259, 320, 0);

    case_layernorm(h, 26, 72, 0.0, 1);
    case_layernorm(h, 5, 3, 2.0, 1);
    case_layernorm(h, 97, 40, 30.0, 1);
    case_layernorm(h, 300, 200, 0.5, 0);
    if (o->large) {
        /* GPT-2's rows (N = B*T = 32768, C = 768): hundreds of per-block partial rows of dw/db */
        case_layernorm(h, 32768, 768, 0.5, 0);
        /* more rows than the CUDA backward's grid covers at once (rows per warp > 1 past its block cap),
         * C = 72: most lanes of a warp own no column */
        case_layernorm(h, 70001, 72, 1.0, 0);
        /* C = 1600 (GPT-2 1.5B): the generic kernels there */
        case_layernorm(h, 9001, 1600, 0.5, 0);
    }

    case_matmul(h, 26, 72, 216, 1, 0, 1);
    case_matmul(h, 26, 72, 288, 1, 1, 1);
    case_matmul(h, 13, 37, 19, 0, 0, 1);
    case_matmul(h, 7, 72, 259, 0, 1, 1);
    case_matmul(h, 300, 160, 576, 1, 1, 0);
    case_matmul(h, 520, 96, 300, 1, 0, 0);
    if (o->large) /* bias gradient over many row slabs, a last column tile of 8 columns */
        case_matmul(h, 4099, 16, 2312, 1, 0, 0);

    case_matmul_res(h, 26, 72, 72, 1, 0);
    case_matmul_res(h, 13, 37, 19, 0, 0); /* odd sizes: CUDA may have no algorithm (the unfused fallback) */
    case_matmul_res(h, 7, 288, 72, 1, 1); /* the residual off the output's alignment */
    case_matmul_res(h, 300, 576, 160, 1, 0);
    case_matmul_res(h, 520, 96, 300, 0, 3);

    case_matmul_dgelu(h, 26, 72, 24, 1, 1);
    case_matmul_dgelu(h, 13, 37, 19, 0, 1); /* C not a multiple of 8: no DGELU epilogue on CUDA */
    case_matmul_dgelu(h, 7, 288, 72, 1, 1);
    case_matmul_dgelu(h, 300, 576, 160, 1, 0);

    case_gelu(h, 1000, 1);
    case_gelu(h, 7, 1);
    case_gelu(h, 40001, 0);

    case_attention(h, 2, 13, 72, 3, 1);
    case_attention(h, 1, 1, 8, 2, 1);
    case_attention(h, 2, 70, 48, 4, 1);
    case_attention(h, 3, 130, 96, 2, 0);

    case_crossentropy(h, 26, 259, 320, 1);
    case_crossentropy(h, 3, 5, 5, 1);
    case_crossentropy(h, 40, 1000, 1024, 0);
    case_crossentropy_fused(h, 26, 259, 320, 0, 0);
    case_crossentropy_fused(h, 3, 5, 5, 0, 0);
    case_crossentropy_fused(h, 40, 1000, 1024, 0, 0);
    case_crossentropy_fused(h, 7, 259, 320, 1, 0); /* logits misaligned: the scalar reduction */
    case_crossentropy_fused(h, 7, 259, 320, 0, 3); /* dlogits misaligned: vector reduction, scalar stores */
    case_crossentropy_fused(h, 5, 1003, 1003, 0, 0);
    case_crossentropy_fused(h, 3, 120000, 120064, 0, 0); /* rows beyond shared memory on every GPU */

    fprintf(h->log, "op harness [%s, act %s]: %d cases, %d checks, %d failed\n", be->ops->name,
            dg_dtype_name(h->act), h->cases, h->checks, h->failures);
    fflush(h->log);
    return h->failures;
}
