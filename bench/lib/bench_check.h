/* bench_check.h — the C benchmarks' fail-fast checks (bench/gpu/bench_step.c, bench/gpu/bench_fp8.c,
 * bench/kernels/bench_backend_cuda.c): MUST(call) for a dg_status_t call, CU(call) for a CUDA runtime call
 * (include cuda_runtime_api.h first). A failure prints "BENCH_WHO: CALL failed: why" and exits 1; the
 * includer defines BENCH_WHO, its name as a string literal. */
#ifndef DG_BENCH_CHECK_H
#define DG_BENCH_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#define MUST(call)                                                                                           \
    do {                                                                                                     \
        dg_status_t must_s_ = (call);                                                                        \
        if (must_s_ != DG_OK) {                                                                              \
            fprintf(stderr, BENCH_WHO ": %s failed: %s (%s)\n", #call, dg_last_error(),                      \
                    dg_last_error_where());                                                                  \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

#define CU(call)                                                                                             \
    do {                                                                                                     \
        cudaError_t cu_e_ = (call);                                                                          \
        if (cu_e_ != cudaSuccess) {                                                                          \
            fprintf(stderr, BENCH_WHO ": %s failed: %s\n", #call, cudaGetErrorString(cu_e_));                \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

#endif
