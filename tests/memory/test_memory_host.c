/* test_memory_host.c — dg_memory's readers against this machine's real /proc/meminfo and cgroup files,
 * and the estimator's sharding (halves of state with dp_shard 2, no FSDP buffers at dp_shard 1). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dg_memory.h"
#include "dg_check.h"

/* the number a cgroup file holds; -1 when it is missing, empty or "max" (no limit). Read with fscanf, not
 * the way src/memory/host.c reads it: an independent figure. */
static double file_num(const char *path) {
    double v = -1;
    FILE *f = fopen(path, "r");
    if (f && fscanf(f, "%lf", &v) != 1) v = -1;
    if (f) fclose(f);
    return v;
}

int main(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    CHECK(f != NULL);
    if (!f) return 1;
    char text[8192];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    double kb = -1;
    char *p = strstr(text, "MemAvailable:");
    CHECK(p != NULL);
    if (p) sscanf(p, "MemAvailable: %lf kB", &kb);
    double parsed = dg_mem_parse_meminfo(text);
    CHECK(parsed == kb * 1024.0);
    CHECK(dg_mem_parse_meminfo("MemTotal: 100 kB\n") == -1);

    dg_mem_avail_t a;
    CHECK(dg_mem_host_available(&a) == DG_OK);
    CHECK(a.bytes > 0);
    /* memory moves between the reads: allow 10% either way of the independent figure */
    double expect = parsed, lim = file_num("/sys/fs/cgroup/memory.max");
    if (lim > 0) {
        double cur = file_num("/sys/fs/cgroup/memory.current");
        if (lim - cur < expect) expect = lim - cur;
    }
    printf("available %.0f bytes (%s), independent figure %.0f (cgroup v2 max %.0f)\n", a.bytes, a.source,
           expect, lim);
    CHECK(a.bytes <= expect * 1.1 && a.bytes >= expect * 0.9);
    CHECK(strcmp(a.source, expect < parsed ? "cgroup" : "MemAvailable") == 0 || a.bytes < parsed);

    dg_mem_in_t in = {.n_params = 1e6,
                      .n_layer = 4,
                      .d_model = 128,
                      .seq_len = 128,
                      .vocab = 256,
                      .n_head = 4,
                      .param_bytes = 4,
                      .dp_shard = 1,
                      .tp = 1,
                      .micro_batch = 8};
    dg_mem_est_t e1, e2, eg;
    dg_mem_estimate(&in, &e1);
    in.dp_shard = 2;
    dg_mem_estimate(&in, &e2);
    CHECK(e1.gathered == 0 && e2.gathered > 0);
    CHECK(e2.state * 2 == e1.state);
    in.recompute = 1;
    dg_mem_estimate(&in, &eg);
    CHECK(eg.activations < e2.activations);
    for (int r = 2; r <= 3; r++) { /* train.recompute=selective, full: fewer activations each */
        double prev = eg.activations;
        in.recompute = r;
        dg_mem_estimate(&in, &eg);
        CHECK(eg.activations < prev);
    }
    in.recompute = 1;
    dg_mem_estimate(&in, &eg);
    double dev = e1.state + e1.gathered + e1.activations + e1.logits + e1.buckets;
    CHECK(e1.host == e1.checkpoint + e1.runtime && e1.checkpoint == 12.0 * in.n_params && e1.runtime > 0);
    CHECK(e1.total == dev + e1.host); /* CPU ranks: the host terms are the same memory */
    CHECK(e2.checkpoint * 2 == e1.checkpoint && e2.buckets > 0 && e1.buckets == 0);
    in.dp_shard = 1;
    in.recompute = 0;
    in.gpu = 1;
    dg_mem_est_t eu;
    dg_mem_estimate(&in, &eu);
    /* GPU mode: device terms only (the host terms are reported apart); no attention probabilities */
    CHECK(eu.total == eu.state + eu.gathered + eu.activations + eu.logits + eu.buckets);
    CHECK(eu.host == e1.host && eu.activations < e1.activations);
    double g = 0;
#ifndef DG_HAVE_CUDA
    CHECK(dg_mem_gpu_free(&g) != DG_OK);
#endif
    (void)g;
    return dg_fails ? 1 : 0;
}
