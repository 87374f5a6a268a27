/* common.c — status messages, asserts, logging and small file helpers shared by every module. */
#define _GNU_SOURCE
#include "dg_common.h"
#include "dg_fs.h"

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- errors ---- */
static _Thread_local char tl_msg[2048];
static _Thread_local char tl_where[256];
static _Thread_local dg_status_t tl_code;

dg_status_t dg_error_at(dg_status_t code, const char *src_file, int src_line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tl_msg, sizeof tl_msg, fmt, ap);
    va_end(ap);
    const char *base = strrchr(src_file, '/');
    snprintf(tl_where, sizeof tl_where, "%s:%d", base ? base + 1 : src_file, src_line);
    tl_code = code;
    return code;
}

const char *dg_last_error(void) {
    return tl_msg;
}
const char *dg_last_error_where(void) {
    return tl_where;
}
dg_status_t dg_last_error_code(void) {
    return tl_code;
}
void dg_clear_error(void) {
    tl_msg[0] = 0;
    tl_where[0] = 0;
    tl_code = DG_OK;
}

void dg_assert_fail(const char *cond, const char *file, int line, const char *fmt, ...) {
    char extra[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(extra, sizeof extra, fmt, ap);
    va_end(ap);
    fprintf(stderr, "dgtrain: internal error: assertion `%s` failed at %s:%d %s\n", cond, file, line, extra);
    fflush(stderr);
    abort();
}

/* ---- logging ---- */
static struct {
    pthread_mutex_t mu;
    int rank;
    char host[64];
    dg_log_level_t level;
    FILE *file;
    int all_ranks;
    char ctx[160]; /* "run ID attempt N job J" (dg_log_set_context), "" before */
} g_log = {PTHREAD_MUTEX_INITIALIZER, 0, "", DG_LOG_INFO, NULL, 0, ""};
static _Atomic long long g_log_step = -1;

void dg_log_set_context(const char *ctx) {
    pthread_mutex_lock(&g_log.mu);
    snprintf(g_log.ctx, sizeof g_log.ctx, "%s", ctx ? ctx : "");
    pthread_mutex_unlock(&g_log.mu);
}
void dg_log_set_step(long long step) {
    g_log_step = step;
}

dg_status_t dg_log_init(int rank, const char *host, dg_log_level_t level, const char *log_dir) {
    pthread_mutex_lock(&g_log.mu);
    g_log.rank = rank;
    snprintf(g_log.host, sizeof g_log.host, "%s", host ? host : "");
    g_log.level = level;
    if (g_log.file) {
        fclose(g_log.file);
        g_log.file = NULL;
    }
    pthread_mutex_unlock(&g_log.mu);
    if (log_dir && *log_dir) {
        dg_status_t s = dg_mkdir_p(log_dir);
        if (s) return s;
        char path[4096];
        if (snprintf(path, sizeof path, "%s/rank-%d.log", log_dir, rank) >= (int)sizeof path)
            return DG_ERR(DG_ERR_RUNTIME, "log directory path too long: %s", log_dir);
        FILE *f = NULL;
        /* never through a link planted at logs/rank-N.log (dg_fs.h) */
        s = dg_fs_fopen_append(path, &f);
        if (s) return s;
        pthread_mutex_lock(&g_log.mu);
        g_log.file = f;
        pthread_mutex_unlock(&g_log.mu);
    }
    return DG_OK;
}

void dg_log_set_level(dg_log_level_t level) {
    g_log.level = level;
}
void dg_log_set_stderr_all_ranks(int on) {
    g_log.all_ranks = on;
}

void dg_log_close(void) {
    pthread_mutex_lock(&g_log.mu);
    if (g_log.file) fclose(g_log.file);
    g_log.file = NULL;
    pthread_mutex_unlock(&g_log.mu);
}

void dg_log(dg_log_level_t level, const char *fmt, ...) {
    static const char *names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
    if (level > g_log.level && !g_log.file) return;
    char msg[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    localtime_r(&ts.tv_sec, &tm);
    char stamp[32];
    strftime(stamp, sizeof stamp, "%H:%M:%S", &tm);
    pthread_mutex_lock(&g_log.mu);
    long long step = g_log_step;
    if (g_log.file && g_log.ctx[0])
        fprintf(g_log.file, "%s.%03ld %-5s [rank %d %s] [%s step %lld] %s\n", stamp, ts.tv_nsec / 1000000,
                names[level], g_log.rank, g_log.host, g_log.ctx, step, msg);
    else if (g_log.file)
        fprintf(g_log.file, "%s.%03ld %-5s [rank %d %s] %s\n", stamp, ts.tv_nsec / 1000000, names[level],
                g_log.rank, g_log.host, msg);
    int echo = level <= g_log.level && (level <= DG_LOG_WARN || g_log.rank == 0 || g_log.all_ranks);
    if (echo) fprintf(stderr, "[rank %d %s] %s: %s\n", g_log.rank, g_log.host, names[level], msg);
    pthread_mutex_unlock(&g_log.mu);
}

/* ---- dtypes ---- */
static const struct {
    size_t size;
    const char *name;
} k_dtypes[] = {
    [DG_F32] = {4, "f32"}, [DG_BF16] = {2, "bf16"}, [DG_F16] = {2, "f16"},
    [DG_I32] = {4, "i32"}, [DG_U16] = {2, "u16"},   [DG_F64] = {8, "f64"},
};

size_t dg_dtype_size(dg_dtype_t t) {
    DG_ASSERTF((unsigned)t < sizeof k_dtypes / sizeof *k_dtypes, "bad dtype %d", (int)t);
    return k_dtypes[t].size;
}

const char *dg_dtype_name(dg_dtype_t t) {
    return (unsigned)t < sizeof k_dtypes / sizeof *k_dtypes ? k_dtypes[t].name : "?";
}

float dg_half_to_f32(uint16_t h, int bf16) {
    uint32_t u;
    if (bf16) {
        u = (uint32_t)h << 16;
    } else {
        uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
        if (e == 31)
            u = sign | 0x7F800000u | (m << 13);
        else if (e)
            u = sign | ((e + 112) << 23) | (m << 13);
        else if (!m)
            u = sign;
        else { /* subnormal: normalise */
            int k = 0;
            while (!(m & 1024))
                m <<= 1, k++;
            u = sign | ((uint32_t)(113 - k) << 23) | ((m & 1023) << 13);
        }
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

int dg_read_stream(FILE *f, size_t max_bytes, char **out, size_t *len) {
    size_t cap = 4096, n = 0;
    char *b = dg_xmalloc(cap + 1);
    errno = 0;
    for (;;) {
        if (n == cap) {
            char *nb = realloc(b, (cap *= 2) + 1);
            DG_ASSERTF(nb != NULL, "out of memory reading a %zu-byte file", n);
            b = nb;
        }
        size_t r = fread(b + n, 1, cap - n, f);
        if (r == 0) break;
        n += r;
        if (n > max_bytes) {
            free(b);
            return EFBIG;
        }
    }
    if (ferror(f)) {
        int e = errno ? errno : EIO;
        free(b);
        return e;
    }
    b[n] = 0;
    *out = b;
    *len = n;
    return 0;
}

char *dg_list_next(char *list, char **save) {
    char *t = strtok_r(list, ",", save);
    if (!t) return NULL;
    while (*t == ' ')
        t++;
    size_t n = strlen(t);
    while (n && t[n - 1] == ' ')
        t[--n] = 0;
    return t;
}

size_t dg_text_line(const char *text, size_t len, size_t *pos, const char **line) {
    const char *l = text + *pos;
    const char *nl = memchr(l, '\n', len - *pos);
    size_t n = nl ? (size_t)(nl - l) : len - *pos;
    *pos += n + (nl ? 1 : 0);
    while (n && (*l == ' ' || *l == '\t'))
        l++, n--;
    while (n && (l[n - 1] == '\r' || l[n - 1] == ' ' || l[n - 1] == '\t'))
        n--;
    *line = l;
    return n;
}

const char *dg_enum_name(const char *const *names, size_t n, int v, const char *fallback) {
    return v >= 0 && (size_t)v < n && names[v] ? names[v] : fallback;
}

/* ---- helpers ---- */
double dg_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* dg_mkdir_p and dg_write_file_atomic live in fs.c, beside the other file-creation rules. */

void *dg_xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    DG_ASSERTF(p != NULL, "out of memory allocating %zu bytes", n);
    return p;
}
void *dg_xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    DG_ASSERTF(p != NULL, "out of memory allocating %zu x %zu bytes", n, size);
    return p;
}
void dg_free_n(void *const *ptrs, size_t n) {
    for (size_t i = 0; i < n; i++)
        free(ptrs[i]);
}
char *dg_xstrdup(const char *s) {
    char *p = strdup(s ? s : "");
    DG_ASSERTF(p != NULL, "out of memory");
    return p;
}
void dg_fmt(char *buf, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, cap, fmt, ap);
    va_end(ap);
    DG_ASSERTF(n >= 0 && (size_t)n < cap, "formatted string truncated (%d >= %zu)", n, cap);
}

int dg_edit_distance(const char *a, const char *b) {
    size_t n = strlen(a), m = strlen(b);
    if (n > 64 || m > 64) return 1000;
    int d[65][65];
    for (size_t i = 0; i <= n; i++)
        d[i][0] = (int)i;
    for (size_t j = 0; j <= m; j++)
        d[0][j] = (int)j;
    for (size_t i = 1; i <= n; i++)
        for (size_t j = 1; j <= m; j++) {
            int cost = tolower((unsigned char)a[i - 1]) != tolower((unsigned char)b[j - 1]);
            int v = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < v) v = d[i][j - 1] + 1;
            if (d[i - 1][j - 1] + cost < v) v = d[i - 1][j - 1] + cost;
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] && d[i - 2][j - 2] + 1 < v)
                v = d[i - 2][j - 2] + 1;
            d[i][j] = v;
        }
    return d[n][m];
}

int dg_closest(const char *word, const char *const *cands, int n, int *dist) {
    int best = -1, bd = 1000;
    for (int i = 0; i < n; i++) {
        int d = dg_edit_distance(word, cands[i]);
        if (d < bd) bd = d, best = i;
    }
    if (dist) *dist = bd;
    return best;
}
