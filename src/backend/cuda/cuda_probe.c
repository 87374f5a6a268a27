/* cuda_probe.c — the CUDA context liveness probe the health thread runs (backend.h, docs/health.md).
 *
 * Each poll, if the previous probe has completed, the health thread queues a new one: a 4-byte
 * cudaMemsetAsync into a device buffer of its own (cudaMalloc, never managed memory) on a private
 * non-blocking stream, followed by an event (timing disabled). The probe never waits: it only asks
 * cudaEventQuery. The stream is cudaStreamNonBlocking and shares nothing with the training stream, so
 * the probe neither serialises with training kernels nor disturbs a CUDA Graph capture (the backend
 * captures in cudaStreamCaptureModeThreadLocal). Verdicts:
 *   - cudaErrorNotReady for longer than timeout_s: the context no longer makes progress (a wedged
 *     kernel hogging the device, a hung driver) -> failure;
 *   - any other error (a sticky error: illegal address, ECC, device lost) -> failure with its text.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "dg_common.h"
#include "backend.h"

struct dg_cuda_probe {
    int device;
    double timeout_s;
    cudaStream_t stream;
    cudaEvent_t ev;
    void *buf;
    int pending;      /* a probe is queued and not yet seen complete */
    double queued_at; /* when it was queued */
    unsigned long long probes;
};

dg_status_t dg_cuda_probe_create(double timeout_s, dg_cuda_probe_t **out) {
    *out = NULL;
    dg_cuda_probe_t *p = dg_xcalloc(1, sizeof *p);
    p->timeout_s = timeout_s > 0 ? timeout_s : 120;
    cudaError_t e = cudaGetDevice(&p->device);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&p->stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&p->ev, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaMalloc(&p->buf, 4);
    if (e != cudaSuccess) {
        dg_cuda_probe_free(p);
        return DG_ERR(DG_ERR_RUNTIME, "CUDA context probe: setup failed: %s", cudaGetErrorString(e));
    }
    *out = p;
    return DG_OK;
}

void dg_cuda_probe_free(dg_cuda_probe_t *p) {
    if (!p) return;
    if (p->pending) (void)cudaEventSynchronize(p->ev);
    if (p->buf) cudaFree(p->buf);
    if (p->ev) cudaEventDestroy(p->ev);
    if (p->stream) cudaStreamDestroy(p->stream);
    free(p);
}

int dg_cuda_probe_poll(void *ctx, char *msg, size_t cap) {
    dg_cuda_probe_t *p = ctx;
    /* the health thread's current device (per-thread state: cheap when already set) */
    cudaError_t e = cudaSetDevice(p->device);
    double now = dg_now_s();
    if (e == cudaSuccess && p->pending) {
        e = cudaEventQuery(p->ev);
        if (e == cudaErrorNotReady) {
            if (now - p->queued_at <= p->timeout_s) return 0;
            snprintf(msg, cap,
                     "CUDA context probe: a 4-byte memset on a private stream of device %d has not completed "
                     "after %.1f s (health.timeout_s=%g): the context makes no progress",
                     p->device, now - p->queued_at, p->timeout_s);
            return 1;
        }
        if (e == cudaSuccess) p->pending = 0;
    }
    if (e == cudaSuccess && !p->pending) {
        e = cudaMemsetAsync(p->buf, (int)(p->probes & 0xff), 4, p->stream);
        if (e == cudaSuccess) e = cudaEventRecord(p->ev, p->stream);
        if (e == cudaSuccess) {
            p->pending = 1;
            p->queued_at = now;
            p->probes++;
        }
    }
    if (e == cudaSuccess) return 0;
    snprintf(msg, cap, "CUDA context probe on device %d failed: %s (%s)", p->device, cudaGetErrorName(e),
             cudaGetErrorString(e));
    return 1;
}
