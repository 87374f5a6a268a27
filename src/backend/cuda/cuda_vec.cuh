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

#endif
