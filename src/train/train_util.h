/* train_util.h — the small pieces of the training loop that need no model: metrics.jsonl (a JSON
 * line writer with proper escaping), the learning-rate schedule, FLOPs/MFU accounting, and the
 * progress display. Library dg_train_util; the loop itself lives beside it in src/train/.
 *
 * metrics.jsonl (docs/design.md §1): one JSON object per line, written by rank 0 only, appended to
 * <run.dir>/metrics.jsonl and flushed after every line. Every line starts with "event" and ends
 * with the run context (dg_metrics_set_context: "run_id", "attempt", "slurm_job_id" where there is one;
 * "step", the current one, on lines without their own) and then "time" (unix seconds, millisecond
 * resolution). Numbers are written in the shortest form that
 * reads back to the same double; NaN and ±Inf, which JSON cannot express, are written as null.
 * Strings are escaped per RFC 8259; bytes that are not valid UTF-8 are written as \u00XX (read as
 * Latin-1), so every line is valid UTF-8 JSON whatever a path or message contains.
 */
#ifndef DG_TRAIN_UTIL_H
#define DG_TRAIN_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "dg_common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------- JSON fields ---------------- */

typedef enum {
    DG_JSON_INT,
    DG_JSON_NUM,
    DG_JSON_STR,
    DG_JSON_BOOL,
    DG_JSON_NULL,
    DG_JSON_RAW
} dg_json_type_t;

/* One "key": value pair. Build with the DG_J* macros below. */
typedef struct dg_json_field {
    const char *key;
    dg_json_type_t type;
    int64_t i;     /* INT, BOOL */
    double d;      /* NUM: non-finite becomes null */
    const char *s; /* STR (escaped; NULL becomes null), RAW (inserted verbatim: a JSON value you built) */
} dg_json_field_t;

#define DG_JI(k, v) ((dg_json_field_t){.key = (k), .type = DG_JSON_INT, .i = (int64_t)(v)})
#define DG_JF(k, v) ((dg_json_field_t){.key = (k), .type = DG_JSON_NUM, .d = (double)(v)})
#define DG_JS(k, v) ((dg_json_field_t){.key = (k), .type = DG_JSON_STR, .s = (v)})
#define DG_JB(k, v) ((dg_json_field_t){.key = (k), .type = DG_JSON_BOOL, .i = !!(v)})
#define DG_JNULL(k) ((dg_json_field_t){.key = (k), .type = DG_JSON_NULL})
#define DG_JRAW(k, json) ((dg_json_field_t){.key = (k), .type = DG_JSON_RAW, .s = (json)})

/* A growable string. */
typedef struct dg_strbuf {
    char *p;
    size_t len, cap;
} dg_strbuf_t;
void dg_strbuf_free(dg_strbuf_t *b);
void dg_strbuf_append(dg_strbuf_t *b, const char *s, size_t n);

/* Append `s` as a quoted, escaped JSON string. */
void dg_json_append_string(dg_strbuf_t *b, const char *s);
/* Append `v` as a JSON number (shortest round-trip form), or null when it is not finite. */
void dg_json_append_number(dg_strbuf_t *b, double v);
/* The metrics line (without the newline) for `event` and `fields`, then "time": time_s (a negative
 * time_s omits it). Malloc'd; the caller frees. Keys are escaped too. */
char *dg_json_line(const char *event, const dg_json_field_t *fields, int n, double time_s);

/* ---------------- metrics.jsonl ---------------- */

typedef struct dg_metrics dg_metrics_t;

/* Rank 0: create run_dir if needed and open run_dir/metrics.jsonl for appending (a resumed run adds to
 * the same file). Other ranks get a handle whose calls do nothing, so callers need not branch. */
dg_status_t dg_metrics_open(const char *run_dir, int rank, dg_metrics_t **out);
void dg_metrics_close(dg_metrics_t *m);
const char *dg_metrics_path(const dg_metrics_t *m); /* "" on ranks other than 0 */

/* Write one line {"event":event, fields..., "time":now}. Thread-safe (the health thread writes too).
 * DG_ERR_RUNTIME when the line cannot be written (disk full): training can go on, the caller decides.
 * Events used by dgtrain: start, step, val, checkpoint, resume, fallback, health, done. */
dg_status_t dg_metrics_event(dg_metrics_t *m, const char *event, const dg_json_field_t *fields, int n);
#define DG_METRICS_EVENT(m, event, ...)                                                                      \
    dg_metrics_event((m), (event), (const dg_json_field_t[]){__VA_ARGS__},                                   \
                     (int)(sizeof((const dg_json_field_t[]){__VA_ARGS__}) / sizeof(dg_json_field_t)))
/* Same, with the fields given as ready JSON member text ("\"a\":1,\"b\":\"x\"", may be "" or NULL):
 * for callers that format their own fields (health's event sink). */
dg_status_t dg_metrics_event_raw(dg_metrics_t *m, const char *event, const char *json_fields);
/* The context every later line carries (docs/design.md §1, "Run identity"): run_id, attempt, and the
 * Slurm job id when not NULL or "". Thread-safe. */
void dg_metrics_set_context(dg_metrics_t *m, const char *run_id, int64_t attempt, const char *slurm_job_id);
/* The step lines without a "step" field are stamped with (optimizer steps completed). Thread-safe. */
void dg_metrics_set_step(dg_metrics_t *m, int64_t step);

/* The step line, with exactly these keys in this order (then "time"):
 * {"event":"step","step":N,"loss":..,"lr":..,"grad_norm":..,"tokens":<global tokens so far>,
 *  "tok_per_s":..,"step_ms":..,"mfu":..,"overflow_rate":..,"overflow_rate_mean":..,
 *  "grad_sync_ms":..} */
typedef struct dg_step_metrics {
    int64_t step;     /* optimizer steps completed, 1-based */
    double loss;      /* mean training loss of the step's global batch */
    double lr;        /* learning rate used by this step */
    double grad_norm; /* global gradient norm before clipping */
    int64_t tokens;   /* global tokens consumed so far, this step included */
    double tok_per_s; /* global tokens per second of this step */
    double step_ms;   /* wall time of this step */
    double mfu;       /* model FLOPs utilisation in [0,1]; NaN when the peak is unknown (written as null) */
    double overflow_rate;      /* fraction of parameter tensors whose gradients held an inf/NaN */
    double overflow_rate_mean; /* its mean over the last train.overflow_window steps */
    double grad_sync_ms; /* this rank's gradient-sync latency in the step (dg_model_comm_stats grad_sync_s) */
} dg_step_metrics_t;
dg_status_t dg_metrics_step(dg_metrics_t *m, const dg_step_metrics_t *s);

/* ---------------- learning rate ---------------- */

/* LR for 0-based optimizer step `step` of `steps` (W = warmup, m = min_ratio * base_lr):
 *   step < W:            base_lr * (step + 1) / W                       (linear warmup, ends at base_lr)
 *   W <= step < steps:   m + (base_lr - m) * (1 + cos(pi * p)) / 2,  p = (step - W) / max(1, steps - 1 - W)
 *   step >= steps:       m
 * so the first decay step uses base_lr and the last step (steps - 1) uses exactly m. */
double dg_lr_at(int64_t step, int64_t steps, double base_lr, int64_t warmup, double min_ratio);

/* ---------------- FLOPs and MFU ---------------- */

/* Training FLOPs per token of a GPT: 6N for the matmuls against the N parameters (forward 2N,
 * backward 4N) plus 12·L·C·T for attention scores and their weighted sum (T = seq_len). Pass N as
 * the model counts it (dgtrain: all parameters, embeddings included). */
double dg_flops_per_token(int64_t n_params, int n_layer, int d_model, int seq_len);
/* tokens_per_s * flops_per_token / peak_flops; NaN when peak_flops <= 0 (unknown). */
double dg_mfu(double tokens_per_s, double flops_per_token, double peak_flops);
/* Dense peak FLOP/s of one NVIDIA GPU from its name (as cudaGetDeviceProperties gives it) for
 * precision "bf16"/"fp16" (tensor cores) or "fp32" (plain FP32 units); 0 when the GPU is not in the
 * table. The table is in metrics.c. */
double dg_peak_flops_gpu(const char *device_name, const char *precision);
/* Nominal fp32 peak FLOP/s of `cores` cores of this CPU: cores x max clock x FLOPs/cycle (64 with
 * AVX-512, 32 with AVX2+FMA, 8 otherwise), from /proc/cpuinfo and cpufreq; 0 when unknown. An upper
 * bound: real GEMM throughput is typically 50-80% of it. */
double dg_peak_flops_cpu(int cores);

/* ---------------- progress display (rank 0) ---------------- */

typedef enum {
    DG_PROGRESS_AUTO = 0, /* TTY mode if `out` is a terminal, else PLAIN */
    DG_PROGRESS_TTY,      /* one line redrawn in place with \r */
    DG_PROGRESS_PLAIN,    /* one line every log_every steps (and the first and last) */
    DG_PROGRESS_OFF
} dg_progress_mode_t;

typedef struct dg_progress dg_progress_t;

/* rank != 0 gets a handle that prints nothing. total_steps: the step count of the run; log_every >= 1. */
dg_progress_t *dg_progress_create(FILE *out, int rank, int64_t total_steps, int64_t log_every,
                                  dg_progress_mode_t mode);
void dg_progress_free(dg_progress_t *p);
/* After optimizer step `step` (1-based) completed:
 *   "step 120/300 | loss 2.913 | 41.2k tok/s | ETA 0:51"
 * ETA = remaining steps x mean wall time per step since the first call (which may be a resumed
 * step); on the first call, step_s (that step's own time) stands in. */
void dg_progress_step(dg_progress_t *p, int64_t step, double loss, double tok_per_s, double step_s);
/* Print a whole line (a validation result, a checkpoint) without tearing the live TTY line. */
void dg_progress_note(dg_progress_t *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* End the live line (newline) before other output or at the end of training. */
void dg_progress_finish(dg_progress_t *p);

/* "0:51", "12:03", "1:02:03" (h:mm:ss), "--:--" for negative or non-finite seconds. */
void dg_format_eta(double seconds, char *buf, size_t cap);
/* Compact quantity: "950", "41.2k", "1.23M", "4.56G". */
void dg_format_si(double v, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* DG_TRAIN_UTIL_H */
