/* config.h — the effective dgtrain configuration: a typed struct filled from the embedded defaults,
 * an INI file (parsed by libinih) and `--set section.key=value` overrides, in that order.
 *
 * One schema table (schema.c) lists every key with its type, default, allowed range or values and a
 * one-line doc; it drives parsing, validation, `--help`, `--print-config` and the config text stored
 * in checkpoints. To add a key: add the field here and ONE row to the table in schema.c.
 *
 * Units and meanings that are not obvious from the name are documented in the schema rows.
 *
 * INI syntax (README.md): `key = value` (or `key: value`) under `[section]`; `;`/`#` comments at line
 * start or after whitespace; optional double quotes around a value; booleans true/false/yes/no/on/off/1/0;
 * indentation is ignored (no continuation lines); no line-length limit below the field sizes.
 */
#ifndef DG_CONFIG_H
#define DG_CONFIG_H

#include <stdint.h>
#include <stdio.h>

#include "dg_common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DG_CFG_STR 1024
#define DG_CFG_MAX_KEYS 192

/* The choices of the enumerated keys that the run branches on, parsed once at load (the id fields
 * beside their text): each enum's order is its key's choices in src/config/schema.c, checked by
 * tests/config. */
typedef enum {
    DG_PREC_FP32 = 0,
    DG_PREC_BF16,
    DG_PREC_FP16,
    DG_PREC_FP8
} dg_precision_t;                                                      /* train.precision */
typedef enum { DG_REDUCE_FP32 = 0, DG_REDUCE_BF16 } dg_reduce_dtype_t; /* train.reduce_dtype */
typedef enum {
    DG_RECOMPUTE_NONE = 0,
    DG_RECOMPUTE_GELU,
    DG_RECOMPUTE_SELECTIVE,
    DG_RECOMPUTE_FULL
} dg_recompute_t; /* train.recompute */
typedef enum {
    DG_CFG_BACKEND_AUTO = 0,
    DG_CFG_BACKEND_CPU,
    DG_CFG_BACKEND_CUDA
} dg_cfg_backend_t;                                                                     /* parallel.backend */
typedef enum { DG_CFG_COMM_AUTO = 0, DG_CFG_COMM_MPI, DG_CFG_COMM_NCCL } dg_cfg_comm_t; /* parallel.comm */

typedef struct dg_config {
    struct {
        char name[128];
        char dir[DG_CFG_STR];
        int64_t seed;
        char log_level[16]; /* error | warn | info | debug */
        char lock[8];       /* auto | fcntl | none: one run per run.dir (dg_fs.h) */
        char trace[48];     /* "" | "A:B": steps A..B into RUN_DIR/trace.json (README "Monitoring") */
        char plan_cache[DG_CFG_STR];  /* auto (RUN_DIR/plan_cache) | off | DIR (relative: to run.dir) */
        double compile_timeout_s;     /* circuit breaker: build-time limit; 0 = none */
        double compile_mem_budget_mb; /* circuit breaker: plan peak budget per rank; 0 = auto, -1 = off */
    } run;
    struct {
        char preset[32]; /* tiny | gpt2-124m | gpt2-350m | gpt2-774m | gpt2-1558m | custom */
        int64_t n_layer, n_head, d_model, seq_len, vocab_size; /* 0 = take the preset's value */
        char init[DG_CFG_STR]; /* "" = random init | hf:DIR | llmc:FILE (fresh runs; dg_hf.h) */
    } model;
    struct {
        char train[DG_CFG_STR]; /* glob of llm.c .bin shards; "" = the embedded default data */
        char val[DG_CFG_STR];
        int64_t val_every, val_batches;
        int shuffle;
    } data;
    struct {
        int64_t steps;
        int64_t global_batch; /* sequences per optimizer step, all ranks together */
        int64_t micro_batch;  /* sequences per rank per micro-step (gradient accumulation fills the rest) */
        double lr;
        int64_t warmup_steps;
        double min_lr_ratio, weight_decay, grad_clip, beta1, beta2, eps;
        char precision[8];    /* fp32 | bf16 | fp16 */
        char reduce_dtype[8]; /* fp32 | bf16 */
        char recompute[12];   /* none | gelu | selective | full: activations recomputed in the backward */
        dg_precision_t precision_id;
        dg_reduce_dtype_t reduce_dtype_id;
        dg_recompute_t recompute_id;
        char freeze[DG_CFG_STR]; /* comma-separated parameter-name patterns (fnmatch) */
        int64_t log_every;
        double loss_scale_init;
        int64_t loss_scale_growth_interval;
        double spike_factor;           /* loss > spike_factor * moving average => skip the update; 0 = off */
        int64_t spike_window;          /* moving-average window (steps) */
        int64_t spike_max_consecutive; /* that many spikes in a row confirm a spike without validation */
        char spike_mode[8];            /* ratio | zscore */
        int spike_mode_id;             /* dg_spike_mode_t (stability.h) */
        double spike_zscore;           /* zscore mode: (loss - mean) / sd above it is a spike */
        double spike_val_factor;       /* val loss > factor x last val loss confirms a spike */
        int64_t spike_pause_steps;     /* paused steps (no update, losses logged) before the rollback */
        int64_t rollback_max;          /* K rollbacks within rollback_window loop steps: pause (exit 5) */
        int64_t rollback_window;
        char loss_scale_growth[12];                           /* adaptive | fixed */
        int loss_scale_growth_id;                             /* 0 adaptive, 1 fixed */
        int64_t loss_scale_window_min, loss_scale_window_max; /* adaptive growth window bounds (steps) */
        double overflow_threshold; /* fraction of tensors with inf/NaN gradients: above it, overflow */
        int64_t overflow_steps;    /* consecutive overflowing steps that halve the fp16 loss scale */
        int64_t overflow_window;   /* steps of the windowed mean overflow rate */
    } train;
    struct {
        char backend[8]; /* auto | cpu | cuda */
        char comm[8];    /* auto | mpi | nccl */
        dg_cfg_backend_t backend_id;
        dg_cfg_comm_t comm_id;
        char reduce_scatter[8];  /* ring | mpi: the mpi comm backend's reduce-scatter algorithm */
        char mesh[128];          /* auto | e.g. dp_replicate=2,dp_shard=4,tp=2,pp=2 */
        int64_t pp_microbatches; /* micro-batches per step through the pipeline; 0 = global / (micro x dp) */
        char pp_schedule[16];    /* 1f1b | interleaved */
        int pp_schedule_id;      /* dg_pp_kind_t (src/pipeline/pipeline.h): 0 1f1b, 1 interleaved */
        int64_t pp_virtual;      /* virtual stages (model chunks) per rank: 1 for 1f1b, >= 2 interleaved */
        int reshard_after_forward;
        double bucket_mb;
        double prefetch_budget_mb;
        int overlap;
        int cuda_graph;
        int nccl_nonblocking;   /* NCCL communicators created non-blocking (settled by polling) */
        int64_t threads;        /* CPU threads per rank; 0 = the cores this rank is bound to */
        double memory_limit_mb; /* cap on the memory-fit check's available figure per rank; 0 = none */
    } parallel;
    struct {
        char dir[DG_CFG_STR]; /* "" = <run.dir>/checkpoints */
        int64_t every;        /* steps between checkpoints; 0 = only at the end and on signals */
        int64_t keep;
        int async;
        char resume[DG_CFG_STR]; /* auto | never | PATH */
        int incremental;
        int64_t max_failures; /* failed saves in a row that stop the run (exit 4) */
        int64_t threads;      /* worker threads per rank (hashing, direct writes, async copy); 0 = auto */
        int space_check;      /* refuse a save the free space cannot hold, before writing */
    } checkpoint;
    struct {
        double heartbeat_s, timeout_s; /* heartbeat_s: deprecated, the steady period when set */
        double probe_start_ms, probe_steady_ms, probe_alert_ms; /* adaptive probe periods */
        int64_t probe_good;                                     /* good probes before the steady period */
        double rtt_alert_factor, rtt_alert_min_ms;              /* round-trip anomaly: factor x mean, floor */
        double liveness_floor_s, liveness_mult; /* dead neighbour: max(floor, mult x (p+rtt)) */
    } health;
    struct {
        int enabled;
        int64_t fire_after, clear_after, level2_after, warmup_steps, budget_steps;
        double warn_interval_s, budget_floor_s;
        char step_time[96];
        int64_t step_time_window;
        char step_time_action[16];
        char tokens_per_s[96];
        int64_t tokens_per_s_window;
        char tokens_per_s_action[16];
        char exposed_comm[96];
        int64_t exposed_comm_window;
        char exposed_comm_action[16];
        char grad_sync_latency[96];
        int64_t grad_sync_latency_window;
        char grad_sync_latency_action[16];
        char overflow_rate[96];
        int64_t overflow_rate_window;
        char overflow_rate_action[16];
        char loss_spike[96];
        int64_t loss_spike_window;
        char loss_spike_action[16];
        char heartbeat_rtt[96];
        int64_t heartbeat_rtt_window;
        char heartbeat_rtt_action[16];
        char checkpoint_stall[96];
        int64_t checkpoint_stall_window;
        char checkpoint_stall_action[16];
        char checkpoint_success[96];
        int64_t checkpoint_success_window;
        char checkpoint_success_action[16];
        char recovery_time[96];
        int64_t recovery_time_window;
        char recovery_time_action[16];
        char memory_plan[96];
        int64_t memory_plan_window;
        char memory_plan_action[16];
    } sla; /* the training SLA objectives (src/sla/sla.h, docs/sla.md) */
    struct {
        char
            xml[DG_CFG_STR]; /* hwloc XML to use instead of the live machine ("" = live, or $HWLOC_XMLFILE) */
        char bind[8];        /* auto | none */
        char cluster[DG_CFG_STR]; /* cluster description file for planning clusters that are not here */
        int64_t world;            /* world size to plan for with `cluster` (0 = the real world size) */
    } topology;

    /* Where each value came from, indexed like the schema table: "default", "FILE:LINE" or
     * "--set". Filled by dg_config_load. */
    char source[DG_CFG_MAX_KEYS][96];
    char path[DG_CFG_STR]; /* the config file loaded ("" if none) */
} dg_config_t;

/* Fill `cfg` with defaults, then the INI file at `path` (NULL = none), then each "section.key=value"
 * of `sets` in order (a later one wins). On bad input returns DG_ERR_USAGE with a one-line message
 * naming the file and line (or the --set argument), the key and what was expected. */
dg_status_t dg_config_load(dg_config_t *cfg, const char *path, int nsets, const char *const *sets);

/* Same as dg_config_load, but the INI text comes from memory (`text`, `len` bytes; NULL = no file).
 * `name` is what error messages and sources call it (e.g. the checkpoint that stored the text). */
dg_status_t dg_config_load_buffer(dg_config_t *cfg, const char *name, const char *text, size_t len, int nsets,
                                  const char *const *sets);

/* Fill every key with its schema default (source "default"). */
void dg_config_defaults(dg_config_t *cfg);

/* Set one key from text, as a file or --set would: `value` is parsed and checked against the schema;
 * `source` is recorded as the value's source and names it in the error message. Does not run the
 * cross-key checks (call dg_config_validate after a batch of sets). */
dg_status_t dg_config_set(dg_config_t *cfg, const char *section_dot_key, const char *value,
                          const char *source);

/* The current value of one key as canonical text (what --print-config shows, strings unquoted).
 * Returns 0, or -1 for an unknown key. */
int dg_config_get(const dg_config_t *cfg, const char *section_dot_key, char *buf, size_t cap);

/* Cross-key checks that need several values (e.g. global_batch divisible by micro_batch * dp).
 * Called by dg_config_load; exposed for modules that fill in derived values later. */
dg_status_t dg_config_validate(const dg_config_t *cfg);

/* Print every key as "section.key = value    # source" (the --print-config format). The output loads
 * back as a config file: a "section.key = value" line outside any [section] sets that key. */
void dg_config_print(const dg_config_t *cfg, FILE *out);
/* RUN_DIR/config.ini: a header comment and dg_config_print's lines, written to a temporary file and
 * renamed into place. DG_ERR_RUNTIME naming the path when it cannot be written. */
dg_status_t dg_config_write_file(const dg_config_t *cfg, const char *path);
/* Print the schema as help text: each key with type, default, allowed values and doc. */
void dg_config_print_help(FILE *out);
/* The effective config as INI text (malloc'd; caller frees). Deterministic: used for the config hash
 * and stored in checkpoints. */
char *dg_config_to_ini(const dg_config_t *cfg);
/* 64-bit xxh3 hash of dg_config_to_ini(). */
uint64_t dg_config_hash(const dg_config_t *cfg);
/* The source string of one key ("default", "FILE:LINE", "--set"), or NULL for an unknown key. */
const char *dg_config_source(const dg_config_t *cfg, const char *section_dot_key);

#ifdef __cplusplus
}
#endif
#endif
