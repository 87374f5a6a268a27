/* comm_test_util.h — small helpers shared by the comm tests: deterministic test data that is a pure
 * function of (rank, index, seed) so every rank can compute every other rank's input (bf16: dg_bits.h),
 * a failure counter that all ranks agree on at the end, and an FNV hash for bitwise comparisons.
 */
#ifndef DG_COMM_TEST_UTIL_H
#define DG_COMM_TEST_UTIL_H

#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "dg_bits.h" /* bf16 conversions */

static int g_fail = 0;
static int g_wrank = 0;

#define CHECK(cond, ...)                                                                                     \
    do {                                                                                                     \
        if (!(cond)) {                                                                                       \
            g_fail++;                                                                                        \
            fprintf(stderr, "[rank %d] CHECK failed at %s:%d: %s: ", g_wrank, __FILE__, __LINE__, #cond);    \
            fprintf(stderr, __VA_ARGS__);                                                                    \
            fprintf(stderr, "\n");                                                                           \
        }                                                                                                    \
    } while (0)

#define CHECK_OK(expr)                                                                                       \
    do {                                                                                                     \
        dg_status_t s_ = (expr);                                                                             \
        CHECK(s_ == DG_OK, "%s -> %d: %s", #expr, s_, dg_last_error());                                      \
    } while (0)

static inline uint64_t tu_mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* small integers in [-8, 8]: sums over <= 16 ranks are exact in f32 and bf16 */
static inline float tu_exact(int rank, size_t i, uint64_t seed) {
    return (float)((int)(tu_mix(seed * 1000003u + (uint64_t)rank * 7919u + i) % 17u) - 8);
}

/* uniform in [-1, 1) with full mantissas: sums depend on the order of additions */
static inline float tu_rand(int rank, size_t i, uint64_t seed) {
    uint64_t h = tu_mix(seed * 0x9e3779b97f4a7c15ULL + (uint64_t)rank * 0x632be59bd9b4e019ULL + i);
    return (float)((double)(h >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static inline uint64_t tu_hash(const void *p, size_t n, uint64_t h) {
    const unsigned char *b = p;
    if (!h) h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 1099511628211ULL;
    }
    return h;
}

/* Every rank learns the total failure count; returns the process exit code (0 or 1). */
static inline int tu_finish(const char *name) {
    int total = 0;
    MPI_Allreduce(&g_fail, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (g_wrank == 0) {
        if (total)
            fprintf(stderr, "%s: %d check(s) FAILED\n", name, total);
        else
            printf("%s: all checks passed\n", name);
    }
    return total ? 1 : 0;
}

#endif
