/* dg_memory.h — the one per-rank memory estimator (used by the planner and the trainer's fit check) and the
 * reader of the memory a rank really has. docs/planning.md §Memory documents the formula; keep them in step.
 *
 * Contract: dg_mem_estimate is pure (no allocation, no I/O); every field of *out is set. Figures are bytes
 * per rank. dg_mem_host_available reads /proc/meminfo and the process's cgroup (v2 memory.max -
 * memory.current, or v1 memory.limit_in_bytes - usage) and returns the smaller, or DG_ERR when meminfo
 * cannot be read. */
#ifndef DG_MEMORY_H
#define DG_MEMORY_H

#include <stdint.h>

#include "dg_common.h"

typedef struct {
    double n_params, n_layer, d_model, seq_len, vocab, n_head;
    double param_bytes; /* compute dtype bytes (4 f32, 2 bf16/fp16) */
    int dp_shard, tp;   /* dp_replicate does not change per-rank memory */
    double micro_batch;
    int recompute;       /* train.recompute: 0 none, 1 gelu, 2 selective, 3 full (DG_RECOMPUTE_*) */
    int gpu;             /* GPU mode: attention probabilities are not kept; host terms not in total */
    double bucket_bytes; /* gradient bucket (parallel.bucket_mb); <= 0: one block, uncapped */
    double inflight;     /* pipeline stage: micro-batches whose activations are held at the peak (1F1B
                          * stage s: pp - s; n_params / n_layer are then the stage's); <= 0: 1 */
} dg_mem_in_t;

/* Device terms (state .. buckets) live on the GPU in GPU mode, in host memory on CPU ranks; the host
 * terms (checkpoint, runtime) are always host memory. total = device terms + host terms on CPU ranks,
 * device terms only in GPU mode (then `host` is the separate host figure). */
typedef struct {
    double state;       /* f32 master, grad, m, v (+ compute copy), sharded over dp_shard x tp */
    double gathered;    /* FSDP: current + prefetched block and the embedding */
    double activations; /* the activation arena without the classifier rows */
    double logits;      /* logits (dlogits in place) + per-row loss, logsumexp and ln_f statistics */
    double buckets;     /* FSDP: the unsharded f32 gradient of the bucket being reduce-scattered */
    double checkpoint;  /* host: params + m + v staging (f32, local shard; the async writer borrows it) */
    double runtime;     /* host: fixed MPI / HDF5 / thread / pool overhead + HDF5 metadata per dataset */
    double host;        /* checkpoint + runtime */
    double total;
} dg_mem_est_t;

void dg_mem_estimate(const dg_mem_in_t *in, dg_mem_est_t *out);

typedef struct {
    double bytes;    /* available to the whole node / process */
    char source[32]; /* MemAvailable | cgroup */
} dg_mem_avail_t;

/* Parses a meminfo text for MemAvailable (bytes); -1 when absent. */
double dg_mem_parse_meminfo(const char *text);
dg_status_t dg_mem_host_available(dg_mem_avail_t *out);
/* This process's resident memory (/proc/self/status): dg_mem_rss_mark returns VmRSS now and restarts the
 * peak (VmHWM) from it (writes 5 to /proc/self/clear_refs), so that a later dg_mem_rss_peak is the peak
 * since the mark, not a transient of start-up (library loading, a failed CUDA initialisation). Both
 * return 0 when the figure cannot be read (then the caller reports none). */
double dg_mem_rss_mark(void);
double dg_mem_rss_peak(void);
/* GPU free bytes (cudaMemGetInfo); DG_ERR without CUDA or without a device. */
dg_status_t dg_mem_gpu_free(double *free_bytes);

#endif
