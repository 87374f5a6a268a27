/* dg_bits.h — float bit casts and bf16 conversions for the tests' host-side reference code, in one place.
 * Header-only (static inline), on every test target's include path (tests/lib).
 *
 *   dg_bits_f2u(f) / dg_bits_u2f(u)   the bits of an f32 and back (through a union, defined in C)
 *   dg_bits_bf16_to_f32(h)            bf16 -> f32, exact
 *   dg_bits_f32_to_bf16(f)            f32 -> bf16 rounded to nearest even; finite inputs only (a NaN may
 *                                     come out as inf): for test data, not for the code under test */
#ifndef DG_BITS_H
#define DG_BITS_H

#include <stdint.h>

/* the one f32 / u32 view (a union: the tests' code reads bits without memcpy temporaries) */
typedef union {
    float f;
    uint32_t u;
} dg_bits_t;

static inline uint32_t dg_bits_f2u(float f) {
    return ((dg_bits_t){.f = f}).u;
}

static inline float dg_bits_u2f(uint32_t u) {
    return ((dg_bits_t){.u = u}).f;
}

static inline float dg_bits_bf16_to_f32(uint16_t h) {
    return dg_bits_u2f((uint32_t)h << 16);
}

static inline uint16_t dg_bits_f32_to_bf16(float f) {
    uint32_t u = dg_bits_f2u(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#endif
