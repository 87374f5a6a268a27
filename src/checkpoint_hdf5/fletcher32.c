/* fletcher32.c — a faster H5_checksum_fletcher32, bit-identical to HDF5's, for its Fletcher32 filter.
 *
 * Every chunk of a checkpoint passes HDF5's Fletcher32 filter (docs/checkpoint-format.md), which calls
 * the library's exported H5_checksum_fletcher32 through its PLT. HDF5 1.10's version adds one 16-bit
 * word at a time (about 1.7 GB/s), which was the largest single cost of a save (bench/RESULTS.md,
 * Checkpoint). Defining the same symbol here, exported from the executable
 * (--export-dynamic-symbol, see CMakeLists.txt), makes the dynamic linker bind the library's calls to
 * this one: the filter, its read-side verification and h5dump/h5py see the same checksums, because the
 * function computes exactly what HDF5's does.
 *
 * What HDF5 computes (its documented Fletcher-32 variant): the data as big-endian 16-bit words (an odd
 * last byte is the high byte of a last word), sum1 += word and sum2 += sum1 in 32-bit unsigned
 * arithmetic, both folded as (s & 0xffff) + (s >> 16) after every block of 360 words and after the odd
 * byte, folded once more at the end, result (sum2 << 16) | sum1. Within a block of n words w_0..w_{n-1}
 * the two sums advance by
 *     sum1 += sum_i w_i,        sum2 += n * sum1_before + sum_i (n - i) * w_i     (mod 2^32),
 * which is the same value the word-by-word loop reaches (modular arithmetic does not care about the
 * order), so the folding schedule, and with it every bit of the result, is kept. Both sums of a block
 * are independent per word: with AVX2 (checked at run time) 16 words are added per step.
 *
 * A self-test on first use compares this function with the library's own (found with dlsym RTLD_NEXT) on
 * a few buffers; on any difference every later call goes to the library's version and a warning says so.
 * DG_CKPT_HDF5_FLETCHER32=1 in the environment sends every call to the library's version (for A/B runs).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_impl.h"
#include "dg_env.h"

#define BLOCK 360

uint32_t H5_checksum_fletcher32(const void *data, size_t len);

static void block_sums(const uint8_t *d, uint32_t n, uint32_t *a_out, uint32_t *b_out) {
    uint32_t a = 0, b = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t w = ((uint32_t)d[2 * i] << 8) | (uint32_t)d[2 * i + 1];
        a += w;
        b += (n - i) * w;
    }
    *a_out = a;
    *b_out = b;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* 16 words per step, byte-swapped to little-endian 16-bit words and widened to two vectors of eight
 * 32-bit lanes (lane k holds word k of the step). With m steps of 16 words and lane sums vs, plus vps
 * accumulating vs after every step:
 *     sum_i (16m - i) w_i = 16 * sum(vps) - sum_k k * vs[k],      sum_i w_i = sum(vs),
 * then weights n - i = (16m - i) + (n - 16m) and the last n - 16m words are added one by one. Only
 * additions in the loop; all sums mod 2^32, as the definition needs. */
__attribute__((target("avx2"))) static uint32_t hsum_avx2(__m256i v) {
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4e));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xb1));
    return (uint32_t)_mm_cvtsi128_si32(x);
}

__attribute__((target("avx2"))) static void block_sums_avx2(const uint8_t *d, uint32_t n, uint32_t *a_out,
                                                            uint32_t *b_out) {
    const __m256i swap = _mm256_setr_epi8(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14, 1, 0, 3, 2, 5,
                                          4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    __m256i s_lo = _mm256_setzero_si256(), s_hi = s_lo, p_lo = s_lo, p_hi = s_lo;
    uint32_t m = n / 16;
    for (uint32_t j = 0; j < m; j++) {
        __m256i x = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(d + 32 * (size_t)j)), swap);
        s_lo = _mm256_add_epi32(s_lo, _mm256_cvtepu16_epi32(_mm256_castsi256_si128(x)));
        s_hi = _mm256_add_epi32(s_hi, _mm256_cvtepu16_epi32(_mm256_extracti128_si256(x, 1)));
        p_lo = _mm256_add_epi32(p_lo, s_lo);
        p_hi = _mm256_add_epi32(p_hi, s_hi);
    }
    const __m256i k_lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                  k_hi = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
    uint32_t a = hsum_avx2(_mm256_add_epi32(s_lo, s_hi));
    uint32_t ks = hsum_avx2(_mm256_add_epi32(_mm256_mullo_epi32(s_lo, k_lo), _mm256_mullo_epi32(s_hi, k_hi)));
    uint32_t b = 16u * hsum_avx2(_mm256_add_epi32(p_lo, p_hi)) - ks + (n - 16 * m) * a;
    for (uint32_t i = 16 * m; i < n; i++) {
        uint32_t w = ((uint32_t)d[2 * i] << 8) | (uint32_t)d[2 * i + 1];
        a += w;
        b += (n - i) * w;
    }
    *a_out = a;
    *b_out = b;
}
#endif

typedef void (*block_fn)(const uint8_t *, uint32_t, uint32_t *, uint32_t *);

static uint32_t fold(uint32_t s) {
    return (s & 0xffff) + (s >> 16);
}

static uint32_t checksum(const void *data, size_t len, block_fn fn) {
    const uint8_t *d = data;
    size_t words = len / 2;
    uint32_t s1 = 0, s2 = 0;
    while (words) {
        uint32_t n = words > BLOCK ? BLOCK : (uint32_t)words;
        uint32_t a, b;
        fn(d, n, &a, &b);
        s2 += n * s1 + b;
        s1 += a;
        s1 = fold(s1);
        s2 = fold(s2);
        d += 2 * (size_t)n;
        words -= n;
    }
    if (len % 2) {
        s1 += (uint32_t)d[0] << 8;
        s2 += s1;
        s1 = fold(s1);
        s2 = fold(s2);
    }
    s1 = fold(s1);
    s2 = fold(s2);
    return (s2 << 16) | s1;
}

typedef uint32_t (*lib_fn)(const void *, size_t);

/* set once (pthread_once): 1 = ours (checked equal to the library's), 2 = the library's (they differed) */
static int g_state;
static lib_fn g_lib;
static block_fn g_block = block_sums;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static _Atomic uint64_t g_calls; /* calls answered by this implementation */

static int self_test(void) {
    g_lib = (lib_fn)dlsym(RTLD_NEXT, "H5_checksum_fletcher32");
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) g_block = block_sums_avx2;
#endif
    if (!g_lib) return 1; /* HDF5 not loaded after us: nothing calls this through the library */
    if (dg_env_bool("DG_CKPT_HDF5_FLETCHER32")) return 2; /* 1: HDF5's own (for comparisons) */
    static uint8_t buf[4 * BLOCK * 2 + 7];
    uint64_t x = 0x9e3779b97f4a7c15ULL;
    for (size_t i = 0; i < sizeof buf; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        buf[i] = (uint8_t)(i % 97 == 0 ? 0xff : x >> 24);
    }
    const size_t lens[] = {0, 1, 2, 3, 719, 720, 721, 1441, sizeof buf};
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++)
        for (size_t off = 0; off < 3; off++) {
            size_t n = lens[k] > sizeof buf - off ? sizeof buf - off : lens[k];
            if (checksum(buf + off, n, g_block) != g_lib(buf + off, n)) {
                DG_LOG_WARN("checkpoint: the fast Fletcher32 differs from HDF5's on a %zu-byte test buffer; "
                            "using HDF5's own",
                            n);
                return 2;
            }
        }
    return 1;
}

static void init_once(void) {
    g_state = self_test();
}

uint32_t H5_checksum_fletcher32(const void *data, size_t len) {
    pthread_once(&g_once, init_once);
    if (g_state == 2) return g_lib(data, len);
    atomic_fetch_add_explicit(&g_calls, 1, memory_order_relaxed);
    return checksum(data, len, g_block);
}

uint64_t dg_ckpt_fletcher32_calls(void) {
    return atomic_load_explicit(&g_calls, memory_order_relaxed);
}

int dg_ckpt_fletcher32_interposed(void) {
    pthread_once(&g_once, init_once);
    void *p = dlsym(RTLD_DEFAULT, "H5_checksum_fletcher32");
    return p != NULL && p == (void *)H5_checksum_fletcher32 && g_state == 1 && g_lib != NULL;
}

uint32_t dg_ckpt_fletcher32_portable(const void *data, size_t len) {
    return checksum(data, len, block_sums);
}
