/* host.c — the memory a host process really has: min(MemAvailable, cgroup limit - usage). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dg_memory.h"

double dg_mem_parse_meminfo(const char *text) {
    const char *p = strstr(text, "MemAvailable:");
    if (!p) return -1;
    double kb = strtod(p + strlen("MemAvailable:"), NULL);
    return kb * 1024.0;
}

/* Reads one number from a file; -1 when absent or "max". */
static double read_num(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char buf[64] = {0};
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    if (n == 0 || strncmp(buf, "max", 3) == 0) return -1;
    return strtod(buf, NULL);
}

static double cgroup_free(void) {
    double lim = read_num("/sys/fs/cgroup/memory.max");
    if (lim > 0) {
        double cur = read_num("/sys/fs/cgroup/memory.current");
        return cur >= 0 ? lim - cur : lim;
    }
    lim = read_num("/sys/fs/cgroup/memory/memory.limit_in_bytes");
    if (lim > 0 && lim < 1e18) {
        double cur = read_num("/sys/fs/cgroup/memory/memory.usage_in_bytes");
        return cur >= 0 ? lim - cur : lim;
    }
    return -1;
}

dg_status_t dg_mem_host_available(dg_mem_avail_t *out) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return DG_ERR(DG_ERR_RUNTIME, "cannot open /proc/meminfo");
    char text[8192];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    double avail = dg_mem_parse_meminfo(text);
    if (avail < 0) return DG_ERR(DG_ERR_RUNTIME, "/proc/meminfo has no MemAvailable line");
    out->bytes = avail;
    snprintf(out->source, sizeof out->source, "MemAvailable");
    double cg = cgroup_free();
    if (cg >= 0 && cg < avail) {
        out->bytes = cg;
        snprintf(out->source, sizeof out->source, "cgroup");
    }
    return DG_OK;
}

/* "Key:   N kB" of /proc/self/status, in bytes; 0 when absent. */
static double status_kb(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    double v = 0;
    size_t n = strlen(key);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, key, n) == 0 && line[n] == ':') {
            v = strtod(line + n + 1, NULL) * 1024.0;
            break;
        }
    fclose(f);
    return v;
}

double dg_mem_rss_mark(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (f) {
        fputs("5", f); /* reset the peak resident set size to the current one (Linux >= 4.0) */
        fclose(f);
    }
    return status_kb("VmRSS");
}

double dg_mem_rss_peak(void) {
    return status_kb("VmHWM");
}
