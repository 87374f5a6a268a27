/* metrics.c — metrics.jsonl: a minimal JSON object writer (RFC 8259 escaping, shortest round-trip
 * numbers, null for non-finite values) and the rank-0 line writer, plus the FLOPs/MFU accounting that
 * the step line reports. Each line is formatted completely in memory and written with one fwrite and
 * a flush, so a reader tailing the file never sees half a line from us. */
#define _GNU_SOURCE
#include "train_util.h"

#include "dg_fs.h"
#include "dg_json.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---------------- string buffer ---------------- */

void dg_strbuf_free(dg_strbuf_t *b) {
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

void dg_strbuf_append(dg_strbuf_t *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *np = realloc(b->p, cap);
        DG_ASSERTF(np != NULL, "out of memory (%zu bytes)", cap);
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void sb_puts(dg_strbuf_t *b, const char *s) {
    dg_strbuf_append(b, s, strlen(s));
}

/* ---------------- JSON ---------------- */

/* The one escaper of the tree (src/common/dg_json.h): its rule is the one documented for
 * metrics.jsonl. */
void dg_json_append_string(dg_strbuf_t *b, const char *str) {
    char small[256];
    size_t n = dg_json_quote(small, sizeof small, str);
    if (n < sizeof small) {
        dg_strbuf_append(b, small, n);
        return;
    }
    char *q = dg_json_quote_dup(str);
    dg_strbuf_append(b, q, n);
    free(q);
}

void dg_json_append_number(dg_strbuf_t *b, double v) {
    if (!isfinite(v)) {
        sb_puts(b, "null");
        return;
    }
    char buf[40];
    /* Shortest of %.15g/%.16g/%.17g that reads back bit-exactly: readable, and lossless so two runs'
     * losses can be compared exactly from the files. */
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) break;
    }
    sb_puts(b, buf);
}

static void append_field(dg_strbuf_t *b, const dg_json_field_t *f) {
    char num[32];
    sb_puts(b, ",");
    dg_json_append_string(b, f->key ? f->key : "");
    sb_puts(b, ":");
    switch (f->type) {
    case DG_JSON_INT:
        snprintf(num, sizeof num, "%lld", (long long)f->i);
        sb_puts(b, num);
        break;
    case DG_JSON_NUM:
        dg_json_append_number(b, f->d);
        break;
    case DG_JSON_STR:
        if (f->s)
            dg_json_append_string(b, f->s);
        else
            sb_puts(b, "null");
        break;
    case DG_JSON_BOOL:
        sb_puts(b, f->i ? "true" : "false");
        break;
    case DG_JSON_NULL:
        sb_puts(b, "null");
        break;
    case DG_JSON_RAW:
        sb_puts(b, f->s && *f->s ? f->s : "null");
        break;
    default:
        DG_ASSERTF(0, "bad JSON field type %d for key %s", (int)f->type, f->key ? f->key : "?");
    }
}

static void append_time(dg_strbuf_t *b, double time_s) {
    if (time_s < 0) return;
    char buf[48];
    snprintf(buf, sizeof buf, ",\"time\":%.3f", time_s);
    sb_puts(b, buf);
}

static void line_start(dg_strbuf_t *b, const char *event, const dg_json_field_t *fields, int n) {
    sb_puts(b, "{\"event\":");
    dg_json_append_string(b, event ? event : "");
    for (int i = 0; i < n; i++)
        append_field(b, &fields[i]);
}

char *dg_json_line(const char *event, const dg_json_field_t *fields, int n, double time_s) {
    dg_strbuf_t b = {0};
    line_start(&b, event, fields, n);
    append_time(&b, time_s);
    sb_puts(&b, "}");
    return b.p;
}

/* ---------------- metrics.jsonl ---------------- */

struct dg_metrics {
    FILE *f; /* NULL on ranks other than 0 */
    char path[4096];
    pthread_mutex_t mu;
    char ctx[256]; /* ,"run_id":..,"attempt":..[,"slurm_job_id":..] or "" before dg_metrics_set_context */
    _Atomic int64_t step; /* the step lines without a "step" of their own are stamped with */
    int64_t lost;         /* lines dropped since the last one written (a full or failing file system) */
    int64_t lost_total;
};

void dg_metrics_set_context(dg_metrics_t *m, const char *run_id, int64_t attempt, const char *slurm_job_id) {
    if (!m) return;
    dg_strbuf_t b = {0};
    sb_puts(&b, ",\"run_id\":");
    dg_json_append_string(&b, run_id ? run_id : "");
    char num[48];
    snprintf(num, sizeof num, ",\"attempt\":%lld", (long long)attempt);
    sb_puts(&b, num);
    if (slurm_job_id && *slurm_job_id) {
        sb_puts(&b, ",\"slurm_job_id\":");
        dg_json_append_string(&b, slurm_job_id);
    }
    pthread_mutex_lock(&m->mu);
    snprintf(m->ctx, sizeof m->ctx, "%s", b.p ? b.p : "");
    pthread_mutex_unlock(&m->mu);
    dg_strbuf_free(&b);
}

void dg_metrics_set_step(dg_metrics_t *m, int64_t step) {
    if (m) m->step = step;
}

/* The run context and, for lines that carry no "step" of their own, the current step, before "time". */
static void append_context(dg_metrics_t *m, dg_strbuf_t *b, int has_step) {
    pthread_mutex_lock(&m->mu);
    int on = m->ctx[0] != 0; /* nothing before dg_metrics_set_context (tools and tests writing lines) */
    if (on) sb_puts(b, m->ctx);
    pthread_mutex_unlock(&m->mu);
    if (on && !has_step) {
        char num[48];
        snprintf(num, sizeof num, ",\"step\":%lld", (long long)m->step);
        sb_puts(b, num);
    }
}

static double unix_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

dg_status_t dg_metrics_open(const char *run_dir, int rank, dg_metrics_t **out) {
    *out = NULL;
    dg_metrics_t *m = dg_xcalloc(1, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
    if (rank == 0) {
        if (!run_dir || !*run_dir) {
            dg_metrics_close(m);
            return DG_ERR(DG_ERR_USAGE, "metrics: run.dir is empty");
        }
        if (snprintf(m->path, sizeof m->path, "%s/metrics.jsonl", run_dir) >= (int)sizeof m->path) {
            dg_metrics_close(m);
            return DG_ERR(DG_ERR_USAGE, "metrics: run.dir path too long: %s", run_dir);
        }
        dg_status_t s = dg_mkdir_p(run_dir);
        if (s != DG_OK) {
            dg_metrics_close(m);
            return s;
        }
        /* never through a link planted at run.dir/metrics.jsonl (dg_fs.h) */
        s = dg_fs_fopen_append(m->path, &m->f);
        if (s != DG_OK) {
            char why[2048];
            snprintf(why, sizeof why, "%s", dg_last_error());
            dg_status_t code = dg_last_error_code();
            dg_metrics_close(m);
            return DG_ERR(code, "metrics: %s", why);
        }
        setvbuf(m->f, NULL, _IONBF, 0); /* a line the file system refused leaves nothing buffered behind */
    }
    *out = m;
    return DG_OK;
}

void dg_metrics_close(dg_metrics_t *m) {
    if (!m) return;
    if (m->f) fclose(m->f);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

const char *dg_metrics_path(const dg_metrics_t *m) {
    return m->path;
}

/* Appends p[0, n) (whole lines) under m->mu; 0 and *err on failure, with the file cut back to the end of
 * its last complete line (a short write on a full file system leaves no half line for a reader). */
static int append_lines(dg_metrics_t *m, const char *p, size_t n, int *err) {
    struct stat st;
    int fd = fileno(m->f);
    if (fstat(fd, &st) != 0) {
        *err = errno;
        return 0;
    }
    if (fwrite(p, 1, n, m->f) == n && fflush(m->f) == 0) return 1;
    *err = errno;
    clearerr(m->f);
    if (ftruncate(fd, st.st_size) != 0) { /* nothing more to do: the next successful line follows it */
    }
    return 0;
}

/* Write one finished line (malloc'd; freed here) plus its newline with a single fwrite. A line the file
 * system refuses (ENOSPC, EIO, a quota) is dropped, not half-written: training goes on (checkpoints are
 * the state; metrics.jsonl is its record), the first drop of a run of drops logs one WARN line, and the
 * first line written again is preceded by {"event":"metrics_gap","lines_lost":N,...} and a WARN line. */
static dg_status_t write_line(dg_metrics_t *m, char *line) {
    size_t n = strlen(line);
    char *p = dg_xmalloc(n + 1);
    memcpy(p, line, n);
    p[n] = '\n';
    free(line);
    int e = 0;
    pthread_mutex_lock(&m->mu);
    int64_t lost = m->lost;
    int ok = 1;
    if (lost > 0) {    /* the gap first, so that a reader sees it where the lines are missing */
        char gap[512]; /* with the run identity (m->ctx, read under m->mu) like every line */
        int gn = snprintf(gap, sizeof gap,
                          "{\"event\":\"metrics_gap\",\"lines_lost\":%lld,\"step\":%lld%s,\"time\":%.3f}\n",
                          (long long)lost, (long long)m->step, m->ctx, unix_now());
        ok = append_lines(m, gap, (size_t)gn, &e);
    }
    if (ok) ok = append_lines(m, p, n + 1, &e);
    if (ok) {
        m->lost = 0;
    } else {
        m->lost++;
        m->lost_total++;
    }
    pthread_mutex_unlock(&m->mu);
    free(p);
    if (ok && lost > 0)
        DG_LOG_WARN("metrics: %s is written again; %lld line(s) were lost while it could not be (a "
                    "metrics_gap event marks the place)",
                    m->path, (long long)lost);
    if (!ok && lost == 0)
        DG_LOG_WARN("metrics: cannot write %s: %s; training goes on, its metrics lines are dropped (never "
                    "half-written) until the file can be written again",
                    m->path, strerror(e));
    if (!ok) return DG_ERR(DG_ERR_RUNTIME, "metrics: cannot write %s: %s", m->path, strerror(e));
    return DG_OK;
}

dg_status_t dg_metrics_event(dg_metrics_t *m, const char *event, const dg_json_field_t *fields, int n) {
    if (!m || !m->f) return DG_OK;
    int has_step = 0;
    for (int i = 0; i < n && !has_step; i++)
        has_step = fields[i].key && strcmp(fields[i].key, "step") == 0;
    dg_strbuf_t b = {0};
    line_start(&b, event, fields, n);
    append_context(m, &b, has_step);
    append_time(&b, unix_now());
    sb_puts(&b, "}");
    return write_line(m, b.p);
}

dg_status_t dg_metrics_event_raw(dg_metrics_t *m, const char *event, const char *json_fields) {
    if (!m || !m->f) return DG_OK;
    dg_strbuf_t b = {0};
    sb_puts(&b, "{\"event\":");
    dg_json_append_string(&b, event ? event : "");
    if (json_fields && *json_fields) {
        sb_puts(&b, ",");
        sb_puts(&b, json_fields);
    }
    append_context(m, &b,
                   json_fields &&
                       (strncmp(json_fields, "\"step\":", 7) == 0 || strstr(json_fields, ",\"step\":")));
    append_time(&b, unix_now());
    sb_puts(&b, "}");
    return write_line(m, b.p);
}

dg_status_t dg_metrics_step(dg_metrics_t *m, const dg_step_metrics_t *s) {
    return DG_METRICS_EVENT(
        m, "step", DG_JI("step", s->step), DG_JF("loss", s->loss), DG_JF("lr", s->lr),
        DG_JF("grad_norm", s->grad_norm), DG_JI("tokens", s->tokens), DG_JF("tok_per_s", s->tok_per_s),
        DG_JF("step_ms", s->step_ms), DG_JF("mfu", s->mfu), DG_JF("overflow_rate", s->overflow_rate),
        DG_JF("overflow_rate_mean", s->overflow_rate_mean), DG_JF("grad_sync_ms", s->grad_sync_ms));
}

/* ---------------- FLOPs and MFU ---------------- */

double dg_flops_per_token(int64_t n_params, int n_layer, int d_model, int seq_len) {
    return 6.0 * (double)n_params + 12.0 * (double)n_layer * (double)d_model * (double)seq_len;
}

double dg_mfu(double tokens_per_s, double flops_per_token, double peak_flops) {
    if (!(peak_flops > 0)) return NAN;
    return tokens_per_s * flops_per_token / peak_flops;
}

/* Vendor datasheet dense peaks (no sparsity), FLOP/s. Order matters: more specific names first. */
static const struct {
    const char *name;
    double half, fp32;
} k_gpus[] = {
    {"H200", 989e12, 67e12},       {"H100 PCIe", 756e12, 51e12}, {"H100", 989e12, 67e12},
    {"GH200", 989e12, 67e12},      {"B200", 2250e12, 80e12},     {"A100", 312e12, 19.5e12},
    {"A800", 312e12, 19.5e12},     {"L40S", 362e12, 91.6e12},    {"L40", 181e12, 90.5e12},
    {"L4", 121e12, 30.3e12},       {"A10", 125e12, 31.2e12},     {"V100", 125e12, 15.7e12},
    {"RTX 4090", 165e12, 82.6e12}, {"RTX 3090", 71e12, 35.6e12},
};

double dg_peak_flops_gpu(const char *device_name, const char *precision) {
    if (!device_name || !precision) return 0;
    /* fp8: against the dense bf16 peak too (only the linear layers' GEMMs run in FP8) */
    int half = !strcmp(precision, "bf16") || !strcmp(precision, "fp16") || !strcmp(precision, "fp8");
    for (size_t i = 0; i < sizeof k_gpus / sizeof k_gpus[0]; i++)
        if (strstr(device_name, k_gpus[i].name)) return half ? k_gpus[i].half : k_gpus[i].fp32;
    return 0;
}

double dg_peak_flops_cpu(int cores) {
    if (cores < 1) return 0;
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return 0;
    char line[8192];
    double mhz = 0;
    int flops_per_cycle = 0;
    while (fgets(line, sizeof line, f)) {
        if (!mhz && !strncmp(line, "cpu MHz", 7)) {
            const char *c = strchr(line, ':');
            if (c) mhz = atof(c + 1);
        }
        if (!flops_per_cycle && !strncmp(line, "flags", 5)) {
            /* Two FMA pipes x vector lanes x 2 FLOPs per FMA. */
            if (strstr(line, " avx512f"))
                flops_per_cycle = 64;
            else if (strstr(line, " avx2") && strstr(line, " fma"))
                flops_per_cycle = 32;
            else
                flops_per_cycle = 8;
        }
    }
    fclose(f);
    /* The maximum clock, where cpufreq reports it, is a truer peak than the current "cpu MHz". */
    f = fopen("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq", "r");
    if (f) {
        long khz = 0;
        if (fscanf(f, "%ld", &khz) == 1 && khz > 0) mhz = khz / 1000.0;
        fclose(f);
    }
    if (!(mhz > 0) || !flops_per_cycle) return 0;
    return (double)cores * mhz * 1e6 * flops_per_cycle;
}
