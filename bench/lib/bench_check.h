/* bench_check.h — the C benchmarks' fail-fast checks (header-only):
 *   MUST(call)  a dg_status_t call; on failure "BENCH_WHO: CALL failed: why (where)"
 *   CU(call)    a CUDA runtime call (include cuda_runtime_api.h first); on failure "BENCH_WHO: CALL failed:
 *               the CUDA error string"
 *   bench_die(fmt, ...)  prints the message on stderr and ends the bench
 * The includer may define BENCH_WHO, its name as a string literal (default "bench"), and BENCH_DIE(), how a
 * failure ends the bench (default exit(1); bench_mpi.h makes it MPI_Abort). */
#ifndef DG_BENCH_CHECK_H
#define DG_BENCH_CHECK_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "dg_common.h"

#ifndef BENCH_WHO
#define BENCH_WHO "bench"
#endif
#ifndef BENCH_DIE
#define BENCH_DIE() exit(1)
#endif

__attribute__((format(printf, 1, 2))) static inline void bench_die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    BENCH_DIE();
}

static inline void bench_must(dg_status_t s, const char *call) {
    if (s != DG_OK)
        bench_die(BENCH_WHO ": %s failed: %s (%s)\n", call, dg_last_error(), dg_last_error_where());
}
#define MUST(call) bench_must((call), #call)

#ifdef CUDART_VERSION
static inline void bench_cu(cudaError_t e, const char *call) {
    if (e != cudaSuccess) bench_die(BENCH_WHO ": %s failed: %s\n", call, cudaGetErrorString(e));
}
#define CU(call) bench_cu((call), #call)
#endif

#endif
