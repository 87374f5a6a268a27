/* gpu.c — free device memory (cudaMemGetInfo), only with DG_HAVE_CUDA. */
#include "dg_memory.h"

#ifdef DG_HAVE_CUDA
#include <cuda_runtime_api.h>

dg_status_t dg_mem_gpu_free(double *free_bytes) {
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) != cudaSuccess) return DG_ERR(DG_ERR_RUNTIME, "cudaMemGetInfo failed");
    *free_bytes = (double)fr;
    return DG_OK;
}
#else
dg_status_t dg_mem_gpu_free(double *free_bytes) {
    *free_bytes = 0;
    return DG_ERR(DG_ERR_RUNTIME, "built without CUDA: no GPU free-memory figure");
}
#endif
