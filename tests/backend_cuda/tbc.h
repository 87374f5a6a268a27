/* tbc.h — what the files of test_backend_cuda share (test_backend_cuda.c: the common helpers, determinism,
 * errors and main; tbc_cmp.c: CUDA vs CPU; tbc_attn.c: the attention kernels against each other). */
#ifndef DG_TESTS_TBC_H
#define DG_TESTS_TBC_H
#include <stddef.h>

#include "backend.h"

#define SKIP 77

/* checks made, checks failed; --verbose; --only S (NULL: every case) */
extern int g_checks, g_fails, g_verbose;
extern const char *g_only;

/* Count a check; print it when it fails (or always under --verbose). */
void check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* NULL and *skip = 1 when there is no GPU; exits on any other failure, and under CI=true also when the
 * machine has a GPU that CUDA cannot use (tests/lib/dg_test_skip.h). */
dg_backend_t *make_cuda(dg_dtype_t act, int *skip);

#define MUST(call)                                                                                           \
    do {                                                                                                     \
        dg_status_t must_s_ = (call);                                                                        \
        if (must_s_ != DG_OK) {                                                                              \
            fprintf(stderr, "FAIL %s:%d: %s: %s (%s)\n", __FILE__, __LINE__, #call, dg_last_error(),         \
                    dg_last_error_where());                                                                  \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

/* tbc_cmp.c */
/* Elementwise |g - r| / (|r| + rms(r)) <= tol; NaN/inf fail. */
void compare(const char *cname, const char *what, const float *g, const float *r, size_t n, double tol);
/* The harness's bound against float64 for `op` at `act`, doubled (CUDA and CPU each within it). */
double tol(const char *op, dg_dtype_t act);
/* Whether the case `name` runs under --only. */
int want(const char *name);
/* --mode cpu: every op against the CPU backend, then a short training run on both; 0 = passed. */
int run_cpu_compare(dg_backend_t *g, int small);

/* tbc_attn.c: --mode attn-builtin and --mode attn-cudnn; 0 passed, 1 failed, 77 skipped */
int run_attn_builtin(dg_dtype_t act, int small);
int run_attn_cudnn(dg_dtype_t act, int small);
#endif
