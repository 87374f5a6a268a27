/* oph_core.c — the op harness's tolerances, host-side dtype rounding and encoding (written independently of
 * any backend, with frexp/ldexp/rint), its state's helpers and the check primitives (closeness, poison,
 * bitwise repeat, finite differences). See oph.h. */
#include "dg_bits.h"
#include "dg_fd.h"
#include "oph.h"

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

double oph_h_round(double x, dg_dtype_t dt) {
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
    return (uint16_t)(dg_bits_f2u((float)r) >> 16);
}
static double dec_bf16(uint16_t b) {
    return dg_bits_bf16_to_f32(b);
}

size_t oph_dt_size(dg_dtype_t dt) {
    return dt == DG_F32 || dt == DG_I32 ? 4 : 2;
}

/* v must already be rounded to dt. */
void oph_h_encode(dg_dtype_t dt, const double *v, void *dst, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (dt == DG_F32)
            ((float *)dst)[i] = (float)v[i];
        else if (dt == DG_BF16)
            ((uint16_t *)dst)[i] = enc_bf16(v[i]);
        else
            ((uint16_t *)dst)[i] = enc_f16(v[i]);
    }
}
double oph_h_decode1(dg_dtype_t dt, const void *src, size_t i) {
    if (dt == DG_F32) return ((const float *)src)[i];
    if (dt == DG_BF16) return dec_bf16(((const uint16_t *)src)[i]);
    return dec_f16(((const uint16_t *)src)[i]);
}

/* ======================= harness state ======================= */

static void h_line(H *h, const char *tag, const char *fmt, va_list ap) {
    fprintf(h->log, "%s %s: ", tag, h->cname);
    vfprintf(h->log, fmt, ap);
    fputc('\n', h->log);
}
void __attribute__((format(printf, 2, 3))) oph_fail(H *h, const char *fmt, ...) {
    h->checks++;
    h->failures++;
    va_list ap;
    va_start(ap, fmt);
    h_line(h, "FAIL", fmt, ap);
    va_end(ap);
    fflush(h->log);
}
void __attribute__((format(printf, 2, 3))) oph_pass(H *h, const char *fmt, ...) {
    h->checks++;
    if (!h->o->verbose) return;
    va_list ap;
    va_start(ap, fmt);
    h_line(h, "ok  ", fmt, ap);
    va_end(ap);
}

/* A backend call: on failure record it with the backend's message and mark the case broken. */
int oph_call_ok(H *h, dg_status_t s, const char *what) {
    if (s == DG_OK) return 1;
    oph_fail(h, "%s returned status %d: %s (%s)", what, s, dg_last_error(), dg_last_error_where());
    h->bad = 1;
    return 0;
}

uint64_t oph_rng_next(H *h) { /* splitmix64 */
    uint64_t z = (h->rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
double oph_rng_uniform(H *h) { /* [0, 1) */
    return (double)(oph_rng_next(h) >> 11) * (1.0 / 9007199254740992.0);
}
int oph_rng_int(H *h, int n) {
    return (int)(oph_rng_next(h) % (uint64_t)n);
}

double *oph_hnew(H *h, size_t n) {
    DG_ASSERT(h->nhost < H_MAX_TRACK);
    double *p = dg_xcalloc(n ? n : 1, sizeof(double));
    h->host[h->nhost++] = p;
    return p;
}
void *oph_hraw(H *h, size_t bytes) {
    DG_ASSERT(h->nhost < H_MAX_TRACK);
    void *p = dg_xcalloc(bytes ? bytes : 1, 1);
    h->host[h->nhost++] = p;
    return p;
}

/* Random values in +-[lo, hi] with random signs: never zero, never tiny. */
double *oph_hrand(H *h, size_t n, double lo, double hi) {
    double *p = oph_hnew(h, n);
    for (size_t i = 0; i < n; i++) {
        double v = lo + (hi - lo) * oph_rng_uniform(h);
        p[i] = (oph_rng_next(h) & 1) ? v : -v;
    }
    return p;
}
void oph_hround(double *v, size_t n, dg_dtype_t dt) {
    for (size_t i = 0; i < n; i++)
        v[i] = oph_h_round(v[i], dt);
}

void *oph_dalloc(H *h, dg_dtype_t dt, size_t n) {
    if (h->bad) return NULL;
    void *p = NULL;
    if (!CALL(h, "alloc", alloc(h->be, n * oph_dt_size(dt), &p))) return NULL;
    DG_ASSERT(h->ndev < H_MAX_TRACK);
    h->dev[h->ndev++] = p;
    if ((uintptr_t)p % 256 != 0)
        oph_fail(h, "alloc(%zu) returned %p, not 256-byte aligned", n * oph_dt_size(dt), p);
    return p;
}

int oph_upload(H *h, void *dev, dg_dtype_t dt, const double *v, size_t n) {
    if (h->bad || !dev) return 0;
    void *tmp = oph_hraw(h, n * oph_dt_size(dt));
    oph_h_encode(dt, v, tmp, n);
    return CALL(h, "to_device", to_device(h->be, dev, tmp, n * oph_dt_size(dt)));
}
int oph_upload_i32(H *h, void *dev, const int32_t *v, size_t n) {
    if (h->bad || !dev) return 0;
    return CALL(h, "to_device", to_device(h->be, dev, v, n * 4));
}
/* Fill with a NaN pattern of the dtype: any element a kernel forgets to write stays NaN. */
int oph_poison(H *h, void *dev, dg_dtype_t dt, size_t n) {
    if (h->bad || !dev) return 0;
    size_t bytes = n * oph_dt_size(dt);
    unsigned char *tmp = oph_hraw(h, bytes);
    if (oph_dt_size(dt) == 4) {
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
void *oph_dput(H *h, dg_dtype_t dt, const double *v, size_t n) {
    void *p = oph_dalloc(h, dt, n);
    oph_upload(h, p, dt, v, n);
    return p;
}
void *oph_dpoisoned(H *h, dg_dtype_t dt, size_t n) {
    void *p = oph_dalloc(h, dt, n);
    oph_poison(h, p, dt, n);
    return p;
}
void *oph_download_raw(H *h, const void *dev, size_t bytes) {
    if (h->bad || !dev) return NULL;
    void *tmp = oph_hraw(h, bytes);
    if (!CALL(h, "to_host", to_host(h->be, tmp, dev, bytes))) return NULL;
    return tmp;
}
double *oph_download(H *h, const void *dev, dg_dtype_t dt, size_t n) {
    void *raw = oph_download_raw(h, dev, n * oph_dt_size(dt));
    if (!raw) return NULL;
    double *v = oph_hnew(h, n);
    for (size_t i = 0; i < n; i++)
        v[i] = oph_h_decode1(dt, raw, i);
    return v;
}

void oph_digest_add(H *h, const void *bytes, size_t n) {
    const unsigned char *p = bytes;
    for (size_t i = 0; i < n; i++) {
        h->digest ^= p[i];
        h->digest *= 0x100000001B3ull;
    }
}
void oph_digest_dev(H *h, const void *dev, size_t bytes) {
    void *raw = oph_download_raw(h, dev, bytes);
    if (raw) oph_digest_add(h, raw, bytes);
}

int oph_case_begin(H *h, const char *fmt, ...) {
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
void oph_case_end(H *h) {
    for (int i = 0; i < h->ndev; i++)
        h->be->ops->free(h->be, h->dev[i]);
    for (int i = 0; i < h->nhost; i++)
        free(h->host[i]);
    h->ndev = h->nhost = 0;
    if (h->o->digests) fprintf(h->o->digests, "%s %016llx\n", h->cname, (unsigned long long)h->digest);
}

double oph_tol_of(H *h, const char *op) {
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
void oph_check_close(H *h, const char *what, const double *got, const double *ref, size_t n, double tol,
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
        oph_fail(h, "%s: %zu of %zu elements not finite (unwritten poison?), first at [%zu] = %g", what,
                 nan_count, n, first_nan, got[first_nan]);
        return;
    }
    if (!(worst <= tol))
        oph_fail(h, "%s: max rel err %.3g > tol %.3g at [%zu]: got %.9g, ref %.9g (n=%zu)", what, worst, tol,
                 wi, got[wi], ref[wi], n);
    else
        oph_pass(h, "%s: max rel err %.3g <= tol %.3g (n=%zu)", what, worst, tol, n);
}

/* Scalar version: |got - ref| <= tol * |ref| (ref != 0), or <= tol when ref == 0. */
void oph_check_scalar(H *h, const char *what, double got, double ref, double tol) {
    if (h->bad) return;
    double e = fabs(got - ref) / (ref != 0 ? fabs(ref) : 1.0);
    if (!(e <= tol))
        oph_fail(h, "%s: got %.9g, ref %.9g, rel err %.3g > tol %.3g", what, got, ref, e, tol);
    else
        oph_pass(h, "%s: got %.9g, ref %.9g (rel err %.3g)", what, got, ref, e);
}

void oph_check_bits(H *h, const char *what, const void *a, const void *b, size_t bytes) {
    if (h->bad || !a || !b) return;
    if (memcmp(a, b, bytes) != 0) {
        size_t i = 0;
        while (((const unsigned char *)a)[i] == ((const unsigned char *)b)[i])
            i++;
        oph_fail(h, "%s: not bitwise identical (first differing byte %zu of %zu)", what, i, bytes);
    } else {
        oph_pass(h, "%s: bitwise identical (%zu bytes)", what, bytes);
    }
}

void oph_check_dev_bits(H *h, const char *what, const void *a, const void *b, size_t bytes) {
    oph_check_bits(h, what, oph_download_raw(h, a, bytes), oph_download_raw(h, b, bytes), bytes);
}

/* Finite differences of a float64 objective f (reading the arrays in ctx, among them x[0..n)) against
 * the backend gradient `got`: a sample of single elements, and directional derivatives along random
 * +-1 vectors, which involve every element. `ref` (the analytic float64 gradient) sets the scale. */
void oph_check_fd(H *h, const char *what, objective_fn f, void *ctx, double *x, size_t n, const double *got,
                  const double *ref, double tol) {
    if (h->bad || !got || h->o->skip_fd) return;
    const double floor = rms(ref, n) > 0 ? rms(ref, n) : 1e-30;
    const int samples = n <= 48 ? (int)n : 40;
    double worst = 0;
    size_t wi = 0;
    double wg = 0, wf = 0;
    for (int s = 0; s < samples; s++) {
        size_t i = n <= 48 ? (size_t)s : (s == 0 ? 0 : s == 1 ? n - 1 : (size_t)oph_rng_int(h, (int)n));
        double fd = dg_central_diff(x, i, f, ctx);
        double e = fabs(got[i] - fd) / (fabs(fd) + floor);
        if (e > worst || isnan(e)) {
            worst = e;
            wi = i;
            wg = got[i];
            wf = fd;
        }
    }
    if (!(worst <= tol))
        oph_fail(h, "%s vs finite differences: rel err %.3g > tol %.3g at [%zu]: got %.9g, fd %.9g", what,
                 worst, tol, wi, wg, wf);
    else
        oph_pass(h, "%s vs finite differences: %d elements, max rel err %.3g", what, samples, worst);
    /* Directional derivatives: an error anywhere in the tensor moves the dot product. */
    double *x0 = oph_hnew(h, n), *u = oph_hnew(h, n);
    memcpy(x0, x, n * sizeof(double));
    for (int d = 0; d < 2; d++) {
        double dot = 0;
        for (size_t i = 0; i < n; i++) {
            u[i] = (oph_rng_next(h) & 1) ? 1.0 : -1.0;
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
            oph_fail(h, "%s directional derivative %d: got %.9g, fd %.9g, rel err %.3g > tol %.3g", what, d,
                     dot, fd, e, tol);
        else
            oph_pass(h, "%s directional derivative %d: rel err %.3g", what, d, e);
    }
}

double oph_dotd(const double *a, const double *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}
double *oph_add_arrays(H *h, const double *a, const double *b, size_t n) {
    double *r = oph_hnew(h, n);
    for (size_t i = 0; i < n; i++)
        r[i] = a[i] + b[i];
    return r;
}

/* ======================= cases ======================= */

void *oph_dalloc_bytes(H *h, size_t bytes) {
    if (h->bad) return NULL;
    void *p = NULL;
    if (!CALL(h, "alloc", alloc(h->be, bytes, &p))) return NULL;
    DG_ASSERT(h->ndev < H_MAX_TRACK);
    h->dev[h->ndev++] = p;
    if ((uintptr_t)p % 256 != 0) oph_fail(h, "alloc(%zu) returned %p, not 256-byte aligned", bytes, p);
    return p;
}
int oph_poison_bytes(H *h, void *dev, size_t bytes) {
    if (h->bad || !dev) return 0;
    unsigned char *tmp = oph_hraw(h, bytes);
    memset(tmp, 0xFF, bytes); /* all-ones is NaN in f32, bf16 and f16 */
    return CALL(h, "to_device", to_device(h->be, dev, tmp, bytes));
}
/* A device copy of an f32/act buffer, for the aliasing checks. */
void *oph_ddup(H *h, const void *src, size_t bytes) {
    void *p = oph_dalloc_bytes(h, bytes);
    if (p) CALL(h, "copy", copy(h->be, p, src, bytes));
    return p;
}
int32_t *oph_rand_tokens(H *h, size_t n, int V) {
    int32_t *t = oph_hraw(h, n * sizeof(int32_t));
    for (size_t i = 0; i < n; i++)
        t[i] = oph_rng_int(h, V);
    if (n >= 4) t[3] = t[1] = t[0]; /* repeated ids: gradient rows that several positions add into */
    return t;
}

double *oph_prefill(H *h, void *dev, dg_dtype_t dt, size_t n) {
    double *p = oph_hrand(h, n, 0.05, 1.0);
    oph_hround(p, n, dt);
    oph_upload(h, dev, dt, p, n);
    return p;
}

void oph_bwd3_alloc(H *h, oph_bwd3_t *b, const char *op, dg_dtype_t dt0, const size_t n[3], double *ref[3]) {
    b->dt0 = dt0;
    for (int i = 0; i < 3; i++) {
        b->n[i] = n[i];
        b->ref[i] = ref[i] = oph_hnew(h, n[i]);
    }
    b->tol = oph_tol_of(h, op);
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 3; i++)
            (k ? b->g2 : b->g1)[i] = oph_dalloc(h, i ? DG_F32 : dt0, n[i]);
}

static void bwd3_zero(H *h, const oph_bwd3_t *b, void *const g[3]) {
    oph_poison(h, g[0], b->dt0, b->n[0]);
    for (int i = 1; i < 3; i++)
        if (!h->bad) CALL(h, "memset0", memset0(h->be, g[i], b->n[i] * 4));
}

void oph_check_bwd3(H *h, const oph_bwd3_t *b) {
    const dg_dtype_t dt[3] = {b->dt0, DG_F32, DG_F32};
    char what[96];
    double *got[3];
    bwd3_zero(h, b, b->g1);
    b->run(h, b->ctx, b->g1, 0);
    for (int i = 0; i < 3; i++)
        got[i] = oph_download(h, b->g1[i], dt[i], b->n[i]);
    for (int i = 0; i < 3; i++) {
        snprintf(what, sizeof what, "bwd %s%s", b->names[i], i == 0 ? " (acc=0)" : "");
        oph_check_close(h, what, got[i], b->ref[i], b->n[i], b->tol, NULL);
    }
    for (int i = 0; b->obj && i < 3; i++) {
        snprintf(what, sizeof what, "bwd %s", b->names[i]);
        oph_check_fd(h, what, b->obj, b->obj_ctx, b->x[i], b->n[i], got[i], b->ref[i], b->tol);
    }
    for (int i = 0; i < 3; i++)
        oph_digest_dev(h, b->g1[i], b->n[i] * oph_dt_size(dt[i]));
    double *prior[3];
    for (int i = 0; i < 3; i++)
        prior[i] = oph_prefill(h, b->g2[i], dt[i], b->n[i]);
    b->run(h, b->ctx, b->g2, 1);
    for (int i = 0; i < 3; i++) {
        snprintf(what, sizeof what, "bwd %s%s", b->names[i], i == 0 ? " (acc=1 adds)" : " accumulates (+=)");
        oph_check_close(h, what, oph_download(h, b->g2[i], dt[i], b->n[i]),
                        oph_add_arrays(h, prior[i], b->ref[i], b->n[i]), b->n[i], b->tol, b->ref[i]);
    }
    bwd3_zero(h, b, b->g2);
    b->run(h, b->ctx, b->g2, 0);
    for (int i = 0; i < 3; i++) {
        const size_t bytes = b->n[i] * oph_dt_size(dt[i]);
        snprintf(what, sizeof what, "bwd repeat %s", b->names[i]);
        oph_check_dev_bits(h, what, b->g2[i], b->g1[i], bytes);
    }
}
