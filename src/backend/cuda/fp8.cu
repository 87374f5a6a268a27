/* fp8.cu — E4M3 quantization of GEMM operands for train.precision=fp8 (docs/cuda.md, "FP8").
 *
 * Scaling is current per-tensor scaling: each call measures amax = max |x| over the whole operand and
 * quantizes q = e4m3_satfinite(x · 448 / amax), so the largest element lands on E4M3's largest finite
 * value; the GEMM dequantizes with the inverse scale (cuBLASLt's A/B scale pointers). Unlike delayed
 * scaling (an amax history from earlier steps) it needs no state across steps and cannot overflow on a
 * sudden jump; it costs one extra read of the operand. amax = 0 gives scale 1. A non-finite amax (an
 * inf or NaN in the operand) gives scale 0: the infinite and NaN elements become NaN (inf · 0) and reach
 * the output, where the overflow check of the norm pass sees them, instead of being saturated into a
 * finite 448.
 *
 * amax is an integer atomicMax on the float's bit pattern (non-negative floats order like their bits):
 * order-independent, so the result is reproducible, like every other reduction in this backend.
 * Three launches per operand: a memset of the amax word, the amax kernel, the cast (plain: 8 elements per
 * thread, one 16-byte load and one 8-byte store; with a transposed copy: 32 x 32 tiles through shared
 * memory). The cast kernel also stores the scale and its inverse (block 0, thread 0); every block derives
 * the scale from amax itself, so no kernel in between is needed.
 */
#include <cuda_fp8.h>

#include "cuda_impl.cuh"
#include "cuda_vec.cuh"

#define FP8_E4M3_MAX 448.f
#define AMAX_THREADS 256
#define CAST_VEC 8
#define TILE 32

/* slot layout: [0] the inverse scale (the GEMM's scale pointer: at the slot's aligned start), [1] the
 * scale, [2] amax's bits */
static __device__ __forceinline__ float fp8_scale_of(const float *slot) {
    const float amax = __uint_as_float(((const unsigned *)slot)[2]);
    if (!(amax <= 3.0e38f)) return 0.f; /* inf or NaN: see the header comment */
    return amax > 0.f ? FP8_E4M3_MAX / amax : 1.f;
}

static __device__ __forceinline__ uint8_t fp8_of(float v) {
    return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

template <typename T> __global__ void fp8_amax_kernel(const T *x, size_t n, int vec, unsigned *amax_bits) {
    float m = 0.f;
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    if (vec) {
        for (size_t i = tid * CAST_VEC; i < n; i += stride * CAST_VEC) {
            float f[CAST_VEC];
            dg_ldv<CAST_VEC>(f, x + i);
#pragma unroll
            for (int j = 0; j < CAST_VEC; j++)
                m = fmaxf(m, fabsf(f[j]) != fabsf(f[j]) ? INFINITY : fabsf(f[j]));
        }
    } else {
        for (size_t i = tid; i < n; i += stride) {
            const float a = fabsf(dg_to_f(x[i]));
            m = fmaxf(m, a != a ? INFINITY : a);
        }
    }
    for (int o = 16; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    __shared__ float wm[AMAX_THREADS / 32];
    if ((threadIdx.x & 31) == 0) wm[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++)
            m = fmaxf(m, wm[w]);
        atomicMax(amax_bits, __float_as_uint(m));
    }
}

static __device__ __forceinline__ void fp8_store_scales(float *slot, float s) {
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
        slot[0] = s > 0.f ? 1.f / s : 1.f;
        slot[1] = s;
    }
}

template <typename T> __global__ void fp8_cast_kernel(uint8_t *q, const T *x, size_t n, float *slot) {
    const float s = fp8_scale_of(slot);
    fp8_store_scales(slot, s);
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * CAST_VEC;
    if (i >= n) return;
    if (i + CAST_VEC <= n) {
        float f[CAST_VEC];
        dg_ldv<CAST_VEC>(f, x + i);
        uint2 u;
        uint8_t *b = reinterpret_cast<uint8_t *>(&u);
#pragma unroll
        for (int j = 0; j < CAST_VEC; j++)
            b[j] = fp8_of(f[j] * s);
        *reinterpret_cast<uint2 *>(q + i) = u;
    } else {
        for (size_t j = i; j < n; j++)
            q[j] = fp8_of(dg_to_f(x[j]) * s);
    }
}

/* 32 x 32 tiles, 32 x 8 threads: each thread casts 4 elements of the tile, writes them to q (if any) and
 * through shared memory the transposed tile to qt. */
template <typename T>
__global__ void fp8_cast_t_kernel(uint8_t *q, uint8_t *qt, const T *x, int rows, int cols, float *slot) {
    __shared__ uint8_t tile[TILE][TILE + 4];
    const float s = fp8_scale_of(slot);
    fp8_store_scales(slot, s);
    const int c0 = blockIdx.x * TILE, r0 = blockIdx.y * TILE;
    for (int dy = threadIdx.y; dy < TILE; dy += blockDim.y) {
        const int r = r0 + dy, cc = c0 + (int)threadIdx.x;
        if (r < rows && cc < cols) {
            const uint8_t v = fp8_of(dg_to_f(x[(size_t)r * cols + cc]) * s);
            tile[dy][threadIdx.x] = v;
            if (q) q[(size_t)r * cols + cc] = v;
        }
    }
    __syncthreads();
    if (!qt) return;
    for (int dy = threadIdx.y; dy < TILE; dy += blockDim.y) {
        const int cc = c0 + dy, r = r0 + (int)threadIdx.x;
        if (cc < cols && r < rows) qt[(size_t)cc * rows + r] = tile[threadIdx.x][dy];
    }
}

template <typename T>
static dg_status_t quantize_t(dg_cuda_t *c, uint8_t *q, uint8_t *qt, const T *x, int rows, int cols,
                              float *slot) {
    const size_t n = (size_t)rows * (size_t)cols;
    const int vec = (n % CAST_VEC) == 0 && ((uintptr_t)x % 16) == 0 && ((uintptr_t)q % 8) == 0;
    DG_CUDA_CHECK(cudaMemsetAsync(slot + 2, 0, sizeof(unsigned), c->stream));
    const size_t work = vec ? n / CAST_VEC : n;
    size_t blocks = (work + AMAX_THREADS - 1) / AMAX_THREADS;
    const size_t cap = (size_t)c->sm_count * 8;
    if (blocks > cap) blocks = cap;
    if (blocks < 1) blocks = 1;
    fp8_amax_kernel<T><<<(unsigned)blocks, AMAX_THREADS, 0, c->stream>>>(x, n, vec, (unsigned *)(slot + 2));
    DG_CUDA_LAUNCH_CHECK();
    if (!qt) {
        const size_t th = (n + CAST_VEC - 1) / CAST_VEC;
        const unsigned nb = (unsigned)((th + 255) / 256);
        if (vec) {
            fp8_cast_kernel<T><<<nb, 256, 0, c->stream>>>(q, x, n, slot);
            DG_CUDA_LAUNCH_CHECK();
            return DG_OK;
        }
    }
    dim3 grid((unsigned)((cols + TILE - 1) / TILE), (unsigned)((rows + TILE - 1) / TILE)), block(TILE, 8);
    /* with a transpose, or unaligned / ragged without one (then the tiled kernel writes q alone) */
    fp8_cast_t_kernel<T><<<grid, block, 0, c->stream>>>(q, qt, x, rows, cols, slot);
    DG_CUDA_LAUNCH_CHECK();
    return DG_OK;
}

dg_status_t dg_cuda_fp8_quantize(dg_cuda_t *c, uint8_t *q, uint8_t *qt, const void *x, int rows, int cols,
                                 float *slot) {
    if (!x || !slot || (!q && !qt) || rows <= 0 || cols <= 0)
        return DG_ERR(DG_ERR_USAGE, "cuda backend fp8_quantize: bad arguments (rows %d, cols %d)", rows,
                      cols);
    if (c->act == DG_BF16) return quantize_t<dg_bf16>(c, q, qt, (const dg_bf16 *)x, rows, cols, slot);
    if (c->act == DG_F16) return quantize_t<dg_f16>(c, q, qt, (const dg_f16 *)x, rows, cols, slot);
    return quantize_t<float>(c, q, qt, (const float *)x, rows, cols, slot);
}
