/* cupti_trace.c — a minimal GPU timeline recorder for machines without Nsight Systems: a CUDA injection
 * library (loaded by the driver through CUDA_INJECTION64_PATH) that records every kernel, memcpy and
 * memset with CUPTI's activity API (kernels inside CUDA Graphs included, one record per node) and
 * writes them as CSV at exit:
 *
 *     start_ns,end_ns,device,stream,kind,name
 *
 *   CUDA_INJECTION64_PATH=build/bench/gpu/libdg_cupti_trace.so DG_CUPTI_OUT=/tmp/trace_%r.csv dgtrain ...
 *
 * %r in DG_CUPTI_OUT is replaced by the MPI rank (OMPI_COMM_WORLD_RANK / PMI_RANK / SLURM_PROCID, else
 * the pid). Kernel names are as the driver reports them (mangled for C++); bench/gpu/timeline_steps.py
 * --csv reads the file and demangles. Records are buffered in memory (about 60 bytes each plus the
 * name) and written once, so the tracing itself does not touch the file system during the run.
 */
#define _GNU_SOURCE
#include <cupti.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BUF_BYTES (8u << 20)

typedef struct {
    uint64_t start, end;
    uint32_t device, stream;
    char kind; /* k, c (memcpy), s (memset) */
    const char *name;
} rec_t;

static rec_t *g_rec;
static size_t g_n, g_cap;
static int g_failed;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* CUPTI completes buffers on its own thread */

static void keep(uint64_t s, uint64_t e, uint32_t dev, uint32_t st, char kind, const char *name) {
    if (g_n == g_cap) {
        size_t cap = g_cap ? 2 * g_cap : 1u << 16;
        rec_t *p = realloc(g_rec, cap * sizeof *p);
        if (!p) {
            g_failed = 1;
            return;
        }
        g_rec = p;
        g_cap = cap;
    }
    /* the name's storage belongs to CUPTI and stays valid for the life of the process */
    g_rec[g_n++] = (rec_t){s, e, dev, st, kind, name};
}

static void CUPTIAPI buf_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(8, BUF_BYTES);
    *size = *buffer ? BUF_BYTES : 0;
    *max_records = 0;
}

static void CUPTIAPI buf_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                   size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity *r = NULL;
    pthread_mutex_lock(&g_mu);
    while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
        switch (r->kind) {
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
        case CUPTI_ACTIVITY_KIND_KERNEL: {
            const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
            keep(k->start, k->end, k->deviceId, k->streamId, 'k', k->name);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)r;
            keep(m->start, m->end, m->deviceId, m->streamId, 'c', "memcpy");
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
            const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)r;
            keep(m->start, m->end, m->deviceId, m->streamId, 's', "memset");
            break;
        }
        default:
            break;
        }
    }
    pthread_mutex_unlock(&g_mu);
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped)
        fprintf(stderr, "cupti_trace: %zu records dropped\n", dropped);
    free(buffer);
}

static void out_path(char *buf, size_t cap) {
    const char *tmpl = getenv("DG_CUPTI_OUT");
    if (!tmpl || !*tmpl) tmpl = "cupti_trace_%r.csv";
    const char *rank = getenv("OMPI_COMM_WORLD_RANK");
    if (!rank) rank = getenv("PMI_RANK");
    if (!rank) rank = getenv("SLURM_PROCID");
    char pid[32];
    if (!rank) {
        snprintf(pid, sizeof pid, "pid%d", (int)getpid());
        rank = pid;
    }
    size_t o = 0;
    for (const char *p = tmpl; *p && o + 1 < cap; p++) {
        if (p[0] == '%' && p[1] == 'r') {
            o += (size_t)snprintf(buf + o, cap - o, "%s", rank);
            if (o >= cap) o = cap - 1;
            p++;
        } else {
            buf[o++] = *p;
        }
    }
    buf[o] = 0;
}

static void at_exit(void) {
    cuptiActivityFlushAll(1);
    pthread_mutex_lock(&g_mu);
    char path[4096];
    out_path(path, sizeof path);
    FILE *f = fopen(path, "w");
    if (!f) {
        perror(path);
        pthread_mutex_unlock(&g_mu);
        return;
    }
    fprintf(f, "start_ns,end_ns,device,stream,kind,name\n");
    for (size_t i = 0; i < g_n; i++)
        fprintf(f, "%llu,%llu,%u,%u,%c,%s\n", (unsigned long long)g_rec[i].start,
                (unsigned long long)g_rec[i].end, g_rec[i].device, g_rec[i].stream, g_rec[i].kind,
                g_rec[i].name ? g_rec[i].name : "?");
    fclose(f);
    fprintf(stderr, "cupti_trace: %zu records%s -> %s\n", g_n, g_failed ? " (out of memory: incomplete)" : "",
            path);
    pthread_mutex_unlock(&g_mu);
}

/* called by the CUDA driver when CUDA_INJECTION64_PATH names this library */
int InitializeInjection(void);
int InitializeInjection(void) {
    if (cuptiActivityRegisterCallbacks(buf_requested, buf_completed) != CUPTI_SUCCESS) {
        fprintf(stderr, "cupti_trace: cuptiActivityRegisterCallbacks failed\n");
        return 0;
    }
    CUpti_ActivityKind kinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                  CUPTI_ACTIVITY_KIND_MEMSET};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (cuptiActivityEnable(kinds[i]) != CUPTI_SUCCESS)
            fprintf(stderr, "cupti_trace: cuptiActivityEnable(%d) failed\n", (int)kinds[i]);
    atexit(at_exit);
    return 1;
}
