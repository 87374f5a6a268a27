/* ref.c — units and the "target, lower, upper, unit" reference parser (dg_sla_ref.h), shared by the
 * validation suite and the training objectives. Moved here from src/validate/sla.c unchanged in
 * behaviour; the ratio, tok/s and z-score dimensions are the training objectives' additions. */
#define _GNU_SOURCE
#include "dg_sla_ref.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

typedef struct {
    const char *name;
    double factor; /* to the dimension's base unit, its first */
} unit_t;

/* Each dimension: the list of its units that messages show, and the units (up to the first without a
 * name). */
static const struct {
    dg_dim_t dim;
    const char *shown;
    unit_t units[10];
} k_dims[] = {
    {DG_DIM_BANDWIDTH,
     "B/s, KB/s, MB/s, GB/s, TB/s, KiB/s .. TiB/s, Gbit/s",
     {{"B/s", 1},
      {"KB/s", 1e3},
      {"MB/s", 1e6},
      {"GB/s", 1e9},
      {"TB/s", 1e12},
      {"KiB/s", 1024.0},
      {"MiB/s", 1048576.0},
      {"GiB/s", 1073741824.0},
      {"TiB/s", 1099511627776.0},
      {"Gbit/s", 1e9 / 8}}},
    {DG_DIM_FLOPS,
     "FLOP/s, KFLOP/s, MFLOP/s, GFLOP/s, TFLOP/s, PFLOP/s",
     {{"FLOP/s", 1},
      {"KFLOP/s", 1e3},
      {"MFLOP/s", 1e6},
      {"GFLOP/s", 1e9},
      {"TFLOP/s", 1e12},
      {"PFLOP/s", 1e15}}},
    {DG_DIM_TIME, "s, ms, us, ns", {{"s", 1}, {"ms", 1e-3}, {"us", 1e-6}, {"ns", 1e-9}}},
    {DG_DIM_RATIO, "x, frac, %", {{"x", 1}, {"frac", 1}, {"%", 0.01}}},
    {DG_DIM_TOKRATE, "tok/s, Ktok/s, Mtok/s", {{"tok/s", 1}, {"Ktok/s", 1e3}, {"Mtok/s", 1e6}}},
    {DG_DIM_ZSCORE, "z", {{"z", 1}}},
};
#define N_DIMS (sizeof k_dims / sizeof *k_dims)
#define N_UNITS (sizeof k_dims[0].units / sizeof k_dims[0].units[0])

double dg_sla_unit_factor(const char *unit, dg_dim_t *dim) {
    for (size_t d = 0; d < N_DIMS; d++)
        for (size_t i = 0; i < N_UNITS && k_dims[d].units[i].name; i++)
            if (strcmp(k_dims[d].units[i].name, unit) == 0) {
                if (dim) *dim = k_dims[d].dim;
                return k_dims[d].units[i].factor;
            }
    return 0;
}

const char *dg_sla_dim_units(dg_dim_t d) {
    for (size_t k = 0; k < N_DIMS; k++)
        if (k_dims[k].dim == d) return k_dims[k].shown;
    return "?";
}

void dg_sla_ref_bounds(const dg_sla_ref_t *r, double *lo, double *hi) {
    double t = r->target * r->factor;
    *lo = r->has_lower ? t * (1 + r->lower) : -INFINITY;
    *hi = r->has_upper ? t * (1 + r->upper) : INFINITY;
}

int dg_sla_ref_ok(const dg_sla_ref_t *r, double value) {
    double lo, hi;
    dg_sla_ref_bounds(r, &lo, &hi);
    if (isnan(value)) return 0;
    /* a hair of slack so that a value printed equal to its bound is not failed by rounding */
    double eps = 1e-12 * fabs(r->target * r->factor);
    return value >= lo - eps && value <= hi + eps;
}

double dg_sla_ref_limit(const dg_sla_ref_t *r) {
    double lo, hi;
    dg_sla_ref_bounds(r, &lo, &hi);
    return r->has_upper ? hi : r->has_lower ? lo : r->target * r->factor;
}

static void fmt_num(char *buf, size_t cap, double v) {
    if (v != 0 && (fabs(v) >= 1e6 || fabs(v) < 1e-3))
        snprintf(buf, cap, "%.3g", v);
    else if (fabs(v) >= 100)
        snprintf(buf, cap, "%.0f", v);
    else
        snprintf(buf, cap, "%.3g", v);
}

void dg_sla_ref_format(const dg_sla_ref_t *r, char *buf, size_t cap) {
    char lo[32], hi[32], t[32];
    fmt_num(t, sizeof t, r->target);
    fmt_num(lo, sizeof lo, r->target * (1 + r->lower));
    fmt_num(hi, sizeof hi, r->target * (1 + r->upper));
    if (r->has_lower && r->has_upper)
        snprintf(buf, cap, "%s..%s %s (target %s)", lo, hi, r->unit, t);
    else if (r->has_lower)
        snprintf(buf, cap, ">= %s %s (target %s, %+.0f%%)", lo, r->unit, t, r->lower * 100);
    else if (r->has_upper)
        snprintf(buf, cap, "<= %s %s (target %s, %+.0f%%)", hi, r->unit, t, r->upper * 100);
    else
        snprintf(buf, cap, "any (target %s %s)", t, r->unit);
}

char *dg_sla_trim(char *s) {
    while (isspace((unsigned char)*s))
        s++;
    size_t n = strlen(s);
    while (n && isspace((unsigned char)s[n - 1]))
        s[--n] = 0;
    return s;
}

int dg_sla_parse_double(const char *v, double *out) {
    char *end;
    errno = 0;
    double d = strtod(v, &end);
    if (end == v || *dg_sla_trim(end) || errno == ERANGE || !isfinite(d)) return -1;
    *out = d;
    return 0;
}

/* Split a comma-separated list in place; returns the number of items (trimmed), -1 when > max. */
int dg_sla_split_list(char *v, char **items, int max) {
    int n = 0;
    char *save = NULL;
    for (char *tok = strtok_r(v, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (n == max) return -1;
        items[n++] = dg_sla_trim(tok);
    }
    return n;
}

dg_status_t dg_sla_ref_parse(const char *where, const char *key, const char *v, dg_dim_t want,
                             dg_sla_ref_t *r) {
    char copy[256];
    snprintf(copy, sizeof copy, "%s", v);
    char *f[8];
    int n = dg_sla_split_list(copy, f, 8);
    if (n != 4)
        return DG_ERR(
            DG_ERR_USAGE,
            "%s: %s = '%s': expected 'target, lower, upper, unit' (e.g. '10, -0.2, none, GB/s'), got %d "
            "field(s)",
            where, key, v, n < 0 ? 9 : n);
    memset(r, 0, sizeof *r);
    if (dg_sla_parse_double(f[0], &r->target) || r->target <= 0)
        return DG_ERR(DG_ERR_USAGE, "%s: %s: target '%s' must be a number > 0", where, key, f[0]);
    for (int b = 0; b < 2; b++) {
        const char *t = f[1 + b];
        int *has = b ? &r->has_upper : &r->has_lower;
        double *val = b ? &r->upper : &r->lower;
        if (strcasecmp(t, "none") == 0 || strcasecmp(t, "null") == 0) {
            *has = 0;
            continue;
        }
        if (dg_sla_parse_double(t, val))
            return DG_ERR(DG_ERR_USAGE,
                          "%s: %s: %s threshold '%s' must be a fraction of the target or 'none'", where, key,
                          b ? "upper" : "lower", t);
        if (b == 0 && (*val > 0 || *val < -1))
            return DG_ERR(
                DG_ERR_USAGE,
                "%s: %s: lower threshold %s must be in [-1, 0] (a fraction below the target, e.g. -0.2)",
                where, key, t);
        if (b == 1 && *val < 0)
            return DG_ERR(DG_ERR_USAGE,
                          "%s: %s: upper threshold %s must be >= 0 (a fraction above the target)", where, key,
                          t);
        *has = 1;
    }
    if (strlen(f[3]) >= sizeof r->unit)
        return DG_ERR(DG_ERR_USAGE, "%s: %s: unit '%s' is too long", where, key, f[3]);
    snprintf(r->unit, sizeof r->unit, "%s", f[3]);
    dg_dim_t d;
    r->factor = dg_sla_unit_factor(r->unit, &d);
    if (r->factor == 0 || d != want)
        return DG_ERR(DG_ERR_USAGE, "%s: %s: unit '%s' %s: expected one of %s", where, key, r->unit,
                      r->factor == 0 ? "is unknown" : "measures something else", dg_sla_dim_units(want));
    r->dim = d;
    return DG_OK;
}
