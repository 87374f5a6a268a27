/* cuda_vec.cuh — private to the CUDA backend: load/store V consecutive elements of any activation dtype
 * as floats, as one 16-, 8- or 4-byte access (two 16-byte ones for 32 bytes) when V elements fill it
 * (the caller guarantees alignment for the vector form), else element by element. */
#ifndef DG_CUDA_VEC_CUH
#define DG_CUDA_VEC_CUH

#include "cuda_impl.cuh"

template <int V, typename T> static __device__ __forceinline__ void dg_ldv(float (&f)[V], const T *p) {
    constexpr int bytes = V * (int)sizeof(T);
    if constexpr (bytes == 16) {
        uint4 u = *reinterpret_cast<const uint4 *>(p);
        const T *t = reinterpret_cast<const T *>(&u);
#pragma unroll
        for (int j = 0; j < V; j++)
            f[j] = dg_to_f(t[j]);
    } else if constexpr (bytes == 32) { /* two 16-byte accesses, both issued before any use */
        const uint4 u0 = reinterpret_cast<const uint4 *>(p)[0], u1 = reinterpret_cast<const uint4 *>(p)[1];
        const T *t0 = reinterpret_cast<const T *>(&u0), *t1 = reinterpret_cast<const T *>(&u1);
#pragma unroll
        for (int j = 0; j < V / 2; j++) {
            f[j] = dg_to_f(t0[j]);
            f[V / 2 + j] = dg_to_f(t1[j]);
        }
    } else if constexpr (bytes == 8) {
        uint2 u = *reinterpret_cast<const uint2 *>(p);
        const T *t = reinterpret_cast<const T *>(&u);
#pragma unroll
        for (int j = 0; j < V; j++)
            f[j] = dg_to_f(t[j]);
    } else {
#pragma unroll
        for (int j = 0; j < V; j++)
            f[j] = dg_to_f(p[j]);
    }
}

template <int V, typename T> static __device__ __forceinline__ void dg_stv(T *p, const float (&f)[V]) {
    constexpr int bytes = V * (int)sizeof(T);
    if constexpr (bytes == 16) {
        uint4 u;
        T *t = reinterpret_cast<T *>(&u);
#pragma unroll
        for (int j = 0; j < V; j++)
            t[j] = dg_from_f<T>(f[j]);
        *reinterpret_cast<uint4 *>(p) = u;
    } else if constexpr (bytes == 32) {
        uint4 u0, u1;
        T *t0 = reinterpret_cast<T *>(&u0), *t1 = reinterpret_cast<T *>(&u1);
#pragma unroll
        for (int j = 0; j < V / 2; j++) {
            t0[j] = dg_from_f<T>(f[j]);
            t1[j] = dg_from_f<T>(f[V / 2 + j]);
        }
        reinterpret_cast<uint4 *>(p)[0] = u0;
        reinterpret_cast<uint4 *>(p)[1] = u1;
    } else if constexpr (bytes == 8) {
        uint2 u;
        T *t = reinterpret_cast<T *>(&u);
#pragma unroll
        for (int j = 0; j < V; j++)
            t[j] = dg_from_f<T>(f[j]);
        *reinterpret_cast<uint2 *>(p) = u;
    } else {
#pragma unroll
        for (int j = 0; j < V; j++)
            p[j] = dg_from_f<T>(f[j]);
    }
}

/* 16-byte vectors kept raw: a kernel that holds whole rows in registers loads them as uint4 (4 registers for
 * 8 bf16/f16 or 4 f32 elements) and converts element j where it is used, instead of holding V floats. */
template <typename T> static __device__ __forceinline__ uint4 dg_ld16(const T *p) {
    return *reinterpret_cast<const uint4 *>(p);
}
template <typename T> static __device__ __forceinline__ float dg_elem16(const uint4 &u, int j) {
    return dg_to_f(reinterpret_cast<const T *>(&u)[j]);
}
/* bf16 -> f32 is a shift or a mask of the 32-bit word: plain integer operations, which the compiler may
 * redo where a value is used instead of keeping both the packed word and the float live (the intrinsic is
 * inline assembly it will not rematerialise). */
template <> __device__ __forceinline__ float dg_elem16<dg_bf16>(const uint4 &u, int j) {
    const unsigned w = j < 2 ? u.x : j < 4 ? u.y : j < 6 ? u.z : u.w;
    return __uint_as_float(j & 1 ? (w & 0xffff0000u) : (w << 16));
}

/* Two floats rounded to nearest even into one 32-bit word of bf16 or f16, `lo` in the low half (the tag
 * pointer picks the type; it is never read). */
static __device__ __forceinline__ uint32_t dg_pack2(float lo, float hi, dg_bf16 *) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
static __device__ __forceinline__ uint32_t dg_pack2(float lo, float hi, dg_f16 *) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

#endif
