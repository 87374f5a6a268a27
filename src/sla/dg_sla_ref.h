/* dg_sla_ref.h — the one threshold/reference syntax of dgtrain, shared by the validation suite
 * (validation/sla.ini, src/validate) and the training objectives ([sla], src/sla/sla.h).
 *
 * A reference is ReFrame style text "target, lower, upper, unit": the value must lie in
 * [target*(1+lower), target*(1+upper)], a bound of "none" (or "null") being unbounded. lower is in
 * [-1, 0], upper >= 0, target > 0. Units belong to one physical dimension each (below); a reference must
 * use a unit of the dimension its metric measures.
 *
 * Contracts: every function here is pure (no global state); the parser leaves a one-line DG_ERR_USAGE
 * message naming `where`, `key`, the bad field and what is allowed.
 */
#ifndef DG_SLA_REF_H
#define DG_SLA_REF_H

#include <stddef.h>

#include "dg_common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Physical dimension of a metric. Canonical units: B/s, FLOP/s, s, a plain ratio (x, frac, %),
 * tokens per second, a z-score. */
typedef enum {
    DG_DIM_BANDWIDTH = 0,
    DG_DIM_FLOPS = 1,
    DG_DIM_TIME = 2,
    DG_DIM_RATIO = 3,
    DG_DIM_TOKRATE = 4,
    DG_DIM_ZSCORE = 5
} dg_dim_t;

/* The factor that converts a value in `unit` to the canonical unit of its dimension (e.g. "GB/s" -> 1e9,
 * "us" -> 1e-6, "%" -> 0.01) and sets *dim (may be NULL), or 0 when the unit is unknown. Decimal prefixes
 * (K M G T P) for bandwidth, flops and tok/s; GiB/s etc. are binary. */
double dg_sla_unit_factor(const char *unit, dg_dim_t *dim);
/* The units of a dimension, as a human list for error messages. */
const char *dg_sla_dim_units(dg_dim_t d);

typedef struct dg_sla_ref {
    double target, lower, upper;
    int has_lower, has_upper;
    char unit[16];
    dg_dim_t dim;
    double factor;   /* unit -> canonical */
    char source[96]; /* "FILE:LINE" (validation file) or the config key's source */
    char node_type[64];
} dg_sla_ref_t;

/* Parse "target, lower, upper, unit" into *r (zeroed first), requiring a unit of dimension `want`.
 * `where` and `key` name the text in the error message ("FILE:LINE", "sla.step_time"). */
dg_status_t dg_sla_ref_parse(const char *where, const char *key, const char *text, dg_dim_t want,
                             dg_sla_ref_t *r);
/* Bounds in canonical units; lo = -inf / hi = +inf when unbounded. */
void dg_sla_ref_bounds(const dg_sla_ref_t *r, double *lo, double *hi);
/* 1 when `value` (canonical units) is within the bounds (a NaN never is). */
int dg_sla_ref_ok(const dg_sla_ref_t *r, double value);
/* The bound a violation crossed, canonical units: the upper bound when there is one, else the lower. */
double dg_sla_ref_limit(const dg_sla_ref_t *r);
/* Human text: ">= 8.00 GB/s (target 10 GB/s, -20%)" or "8.00 .. 12.00 GB/s" etc. */
void dg_sla_ref_format(const dg_sla_ref_t *r, char *buf, size_t cap);

/* The value parsing both INI readers share: trim white space in place (returns the first non-space);
 * a finite double with nothing but spaces after it (0, else -1); split a comma-separated list in place
 * into at most max trimmed items (their count, -1 when there are more). */
char *dg_sla_trim(char *s);
int dg_sla_parse_double(const char *v, double *out);
int dg_sla_split_list(char *v, char **items, int max);

#ifdef __cplusplus
}
#endif
#endif /* DG_SLA_REF_H */
