/* gemm_tune.c — the process table and file of measured GEMM algorithm choices (see gemm_tune.h). */
#define _GNU_SOURCE
#include "gemm_tune.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "dg_env.h"

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static dg_gemm_tune_entry_t *g_tab;
static int g_n, g_cap;
static int g_loaded;        /* the file was read (or there is none) */
static int g_path_resolved; /* g_path holds the answer of dg_gemm_tune_path */
static char g_path[4096];
static int g_warned;

uint64_t dg_gemm_tune_hash(const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 1099511628211ull;
    }
    return h;
}

const char *dg_gemm_tune_path(void) {
    pthread_mutex_lock(&g_mu);
    if (!g_path_resolved) {
        g_path_resolved = 1;
        g_path[0] = 0;
        const char *f = dg_env_str("DG_CUDA_GEMM_TUNE_FILE");
        if (f) {
            if (*f && strcmp(f, "none") != 0) snprintf(g_path, sizeof g_path, "%s", f);
        } else {
            const char *x = getenv("XDG_CACHE_HOME"), *h = getenv("HOME");
            if (x && *x)
                snprintf(g_path, sizeof g_path, "%s/dgtrain/gemm_tune.txt", x);
            else if (h && *h)
                snprintf(g_path, sizeof g_path, "%s/.cache/dgtrain/gemm_tune.txt", h);
        }
    }
    const char *r = g_path[0] ? g_path : NULL;
    pthread_mutex_unlock(&g_mu);
    return r;
}

int dg_gemm_tune_parse(const char *line, dg_gemm_tune_entry_t *e) {
    memset(e, 0, sizeof *e);
    const char *s = line;
    while (*s == ' ' || *s == '\t')
        s++;
    if (strncmp(s, "v1 ", 3) != 0) return 0;
    s += 3;
    int len = 0;
    while (s[len] && s[len] != ' ' && s[len] != '\t' && s[len] != '\n')
        len++;
    if (len == 0 || len >= DG_GEMM_TUNE_TAG_MAX) return 0;
    memcpy(e->tag, s, (size_t)len);
    e->tag[len] = 0;
    s += len;
    char *end = NULL;
    for (int i = 0; i < DG_GEMM_TUNE_KEY_N; i++) {
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || v < -2147483647L || v > 2147483647L) return 0;
        e->key[i] = (int)v;
        s = end;
    }
    errno = 0;
    long pick = strtol(s, &end, 10);
    if (end == s || errno) return 0;
    s = end;
    long found = strtol(s, &end, 10);
    if (end == s || errno) return 0;
    s = end;
    unsigned long long h = strtoull(s, &end, 16);
    if (end == s || errno) return 0;
    s = end;
    float m0 = strtof(s, &end);
    if (end == s) return 0;
    s = end;
    float m1 = strtof(s, &end);
    if (end == s) return 0;
    s = end;
    while (*s == ' ' || *s == '\t' || *s == '\r' || *s == '\n')
        s++;
    if (*s) return 0; /* trailing garbage: a torn or foreign line */
    if (pick < 0 || found <= 0 || pick >= found || found > 4096) return 0;
    if (!(m0 > 0.f) || !(m1 > 0.f)) return 0;
    e->pick = (int)pick;
    e->found = (int)found;
    e->algo_hash = (uint64_t)h;
    e->ms_first = m0;
    e->ms_pick = m1;
    return 1;
}

static int same_key(const dg_gemm_tune_entry_t *a, const char *tag, const int *key) {
    return strcmp(a->tag, tag) == 0 && memcmp(a->key, key, sizeof a->key) == 0;
}

/* g_mu held */
static void tab_put(const dg_gemm_tune_entry_t *e, int replace) {
    for (int i = 0; i < g_n; i++)
        if (same_key(&g_tab[i], e->tag, e->key)) {
            if (replace) g_tab[i] = *e;
            return;
        }
    if (g_n == g_cap) {
        int cap = g_cap ? 2 * g_cap : 64;
        dg_gemm_tune_entry_t *nt = (dg_gemm_tune_entry_t *)realloc(g_tab, (size_t)cap * sizeof *nt);
        if (!nt) return; /* out of memory: the entry is simply not kept */
        g_tab = nt;
        g_cap = cap;
    }
    g_tab[g_n++] = *e;
}

/* g_mu held. Entries of the file not yet in the table are added (the table's own win). */
static void file_merge(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[1024];
    dg_gemm_tune_entry_t e;
    while (fgets(line, sizeof line, f))
        if (dg_gemm_tune_parse(line, &e)) tab_put(&e, 0);
    fclose(f);
}

static void ensure_loaded(void) {
    if (g_loaded) return;
    g_loaded = 1;
    pthread_mutex_unlock(&g_mu);
    const char *p = dg_gemm_tune_path();
    pthread_mutex_lock(&g_mu);
    if (p) file_merge(p);
}

int dg_gemm_tune_lookup(const char *tag, const int *key, dg_gemm_tune_entry_t *out) {
    pthread_mutex_lock(&g_mu);
    ensure_loaded();
    int hit = 0;
    for (int i = 0; i < g_n && !hit; i++)
        if (same_key(&g_tab[i], tag, key)) {
            *out = g_tab[i];
            hit = 1;
        }
    pthread_mutex_unlock(&g_mu);
    return hit;
}

static int mkdir_p(const char *dir) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", dir);
    for (char *q = buf + 1; *q; q++)
        if (*q == '/') {
            *q = 0;
            if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
            *q = '/';
        }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
    return 0;
}

/* g_mu held */
static int file_write(const char *path) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = 0;
        if (mkdir_p(dir) != 0) return -1;
    }
    file_merge(path); /* what other processes recorded since this one read the file */
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return -1;
    int ok = fprintf(f,
                     "# dgtrain GEMM algorithm choices (DG_CUDA_GEMM_TUNE): v1 tag key[%d] pick found "
                     "algo_hash ms_first ms_pick\n",
                     DG_GEMM_TUNE_KEY_N) > 0;
    for (int i = 0; i < g_n && ok; i++) {
        const dg_gemm_tune_entry_t *e = &g_tab[i];
        ok = fprintf(f, "v1 %s", e->tag) > 0;
        for (int j = 0; j < DG_GEMM_TUNE_KEY_N && ok; j++)
            ok = fprintf(f, " %d", e->key[j]) > 0;
        if (ok)
            ok = fprintf(f, " %d %d %016llx %.6g %.6g\n", e->pick, e->found, (unsigned long long)e->algo_hash,
                         (double)e->ms_first, (double)e->ms_pick) > 0;
    }
    if (fflush(f) != 0) ok = 0;
    if (fclose(f) != 0) ok = 0;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

void dg_gemm_tune_record(const dg_gemm_tune_entry_t *e) {
    pthread_mutex_lock(&g_mu);
    ensure_loaded();
    tab_put(e, 1);
    pthread_mutex_unlock(&g_mu);
    const char *p = dg_gemm_tune_path();
    if (!p) return;
    pthread_mutex_lock(&g_mu);
    int rc = file_write(p);
    const int err = errno;
    int warn = rc != 0 && !g_warned;
    if (warn) g_warned = 1;
    pthread_mutex_unlock(&g_mu);
    if (warn)
        DG_LOG_WARN(
            "cuda backend: could not write the GEMM tuning file %s (%s); the choices hold for this run "
            "only (DG_CUDA_GEMM_TUNE_FILE sets another path, =none keeps none)",
            p, strerror(err));
}

void dg_gemm_tune_reset(void) {
    pthread_mutex_lock(&g_mu);
    free(g_tab);
    g_tab = NULL;
    g_n = g_cap = 0;
    g_loaded = 0;
    g_path_resolved = 0;
    g_warned = 0;
    pthread_mutex_unlock(&g_mu);
}
