/* validate_gpu.h — private to src/validate: the GPU side of the checks (gpu.cu, compiled only with
 * DG_HAVE_CUDA): device lookup, versions, the cuBLASLt bf16 GEMM and device-memory triad benchmarks,
 * and device buffers for the NCCL collectives. Plain C types only, so nvcc never sees mpi.h.
 */
#ifndef DG_VALIDATE_GPU_H
#define DG_VALIDATE_GPU_H

#include <stddef.h>
#include <stdint.h>

#include "dg_common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* CUDA devices this process sees; 0 with the reason in err when none (no driver, no device). */
int dg_vgpu_count(char *err, size_t cap);
/* The CUDA device of a PCI bus id ("0000:07:00.0"), else `fallback` when it is a valid index; -1. */
int dg_vgpu_device(const char *pci_busid, int fallback);
/* The device's name as CUDA reports it ("NVIDIA H200"); "" when unavailable. */
void dg_vgpu_name(int dev, char *buf, size_t cap);
/* "cuda_driver=12040;cuda_runtime=13000;nccl=22703" (0 where unavailable). */
void dg_vgpu_versions(char *buf, size_t cap);
/* bf16 GEMM n x n x n through cuBLASLt (fp32 accumulation, bf16 output): one warm-up, then `reps` timed
 * launches (times[r] seconds each, CUDA events); *work = 2n^3 FLOP per launch. *wrong counts the 64
 * sampled elements of C that differ from a host reference by more than bf16 rounding. */
dg_status_t dg_vgpu_gemm_bf16(int dev, int n, int reps, double *times, double *work, int64_t *wrong);
/* STREAM triad a = b + 3c on fp32 device arrays of `bytes` in total; *work = bytes moved per launch;
 * *wrong counts wrong elements in a checked sample. */
dg_status_t dg_vgpu_stream(int dev, size_t bytes, int reps, double *times, double *work, int64_t *wrong);
/* Device buffers for the NCCL collectives check. */
dg_status_t dg_vgpu_alloc(int dev, size_t bytes, void **p);
void dg_vgpu_free(void *p);
dg_status_t dg_vgpu_copy(void *dst, const void *src, size_t bytes, int to_device);

#ifdef __cplusplus
}
#endif
#endif
