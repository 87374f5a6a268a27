/* schema.c — the one table of every dgtrain config key: section, key, type, default, allowed range or
 * values, extra rule and a one-line doc. Parsing, validation, `--help`, `--print-config`, the config
 * hash and the INI text stored in checkpoints are all driven from it.
 *
 * Ranges are deliberately generous (they catch typos and nonsense, not unusual but valid runs); rules
 * that involve two keys live in dg_config_validate (config.c).
 */
#include "config_impl.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "dg_mesh.h"
#include "dg_sla_ref.h"

/* ---- extra per-key rules ---- */

static int check_nonempty(const char *v, char *why, size_t cap) {
    if (*v) return 0;
    snprintf(why, cap, "expected a non-empty value");
    return 1;
}

/* run.trace: "" or "A:B", 1 <= A <= B (optimizer steps, 1-based, inclusive). */
static int check_trace(const char *v, char *why, size_t cap) {
    if (!*v) return 0;
    long long a = 0, b = 0;
    int n = 0;
    if (sscanf(v, "%lld:%lld%n", &a, &b, &n) == 2 && v[n] == 0 && a >= 1 && b >= a && b - a < 100000)
        return 0;
    snprintf(why, cap,
             "expected A:B with 1 <= A <= B (steps, inclusive; at most 100000 of them), e.g. 10:12");
    return 1;
}

/* run.name ends up in file names and metrics: keep it to a portable set. */
static int check_name(const char *v, char *why, size_t cap) {
    if (!*v) {
        snprintf(why, cap, "expected a non-empty name");
        return 1;
    }
    for (const char *p = v; *p; p++) {
        char c = *p;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
              c == '_' || c == '-')) {
            snprintf(why, cap, "expected a name of letters, digits, '.', '_' and '-'");
            return 1;
        }
    }
    return 0;
}

/* model.init: "", hf:DIR or llmc:FILE (the files are read, and the shape checked, when the run starts) */
static int check_init(const char *v, char *why, size_t cap) {
    const char *path = !strncmp(v, "hf:", 3) ? v + 3 : !strncmp(v, "llmc:", 5) ? v + 5 : NULL;
    if (!*v) return 0;
    if (!path) {
        snprintf(why, cap,
                 "expected \"\" (random init), hf:DIR (a Hugging Face GPT-2 directory) or llmc:FILE "
                 "(an llm.c checkpoint)");
        return 1;
    }
    if (!*path) {
        snprintf(why, cap, "expected a path after '%.*s'", (int)(path - v), v);
        return 1;
    }
    return 0;
}

static int check_mesh(const char *v, char *why, size_t cap) {
    dg_mesh_shape_t shape;
    int is_auto = 0;
    if (dg_mesh_parse(v, 0, &shape, &is_auto) != DG_OK) {
        const char *m = dg_last_error();
        const char *pfx = "parallel.mesh: ";
        if (strncmp(m, pfx, strlen(pfx)) == 0) m += strlen(pfx);
        snprintf(why, cap, "%s", m);
        dg_clear_error();
        return 1;
    }
    if (!is_auto) {
        int64_t n = (int64_t)shape.size[0] * shape.size[1] * shape.size[2];
        if (n > (int64_t)1 << 24) {
            snprintf(why, cap, "expected a mesh of at most 16777216 ranks (this one has %lld)", (long long)n);
            return 1;
        }
    }
    return 0;
}

/* 0 disables spike handling; anything in (0, 1] would flag ordinary steps as spikes. */
static int check_spike(const char *v, char *why, size_t cap) {
    double f = 0;
    if (sscanf(v, "%lf", &f) == 1 && (f == 0.0 || f > 1.0)) return 0;
    snprintf(why, cap, "out of range: expected 0 (off) or a number > 1");
    return 1;
}

/* [sla] references: the validation suite's "target, lower, upper, unit" (src/sla/dg_sla_ref.h) or "off" */
static int check_sla_ref(const char *v, dg_dim_t dim, char *why, size_t cap) {
    dg_sla_ref_t r;
    if (strcasecmp(v, "off") == 0) return 0;
    if (dg_sla_ref_parse("sla", "value", v, dim, &r) == DG_OK) return 0;
    const char *m = dg_last_error(), *pfx = "sla: value";
    if (strncmp(m, pfx, strlen(pfx)) == 0) m += strlen(pfx);
    while (*m == ':' || *m == ' ' || *m == '=')
        m++;
    snprintf(why, cap, "expected 'off' or 'target, lower, upper, unit': %s", m);
    dg_clear_error();
    return 1;
}
static int check_sla_ratio(const char *v, char *why, size_t cap) {
    return check_sla_ref(v, DG_DIM_RATIO, why, cap);
}
static int check_sla_time(const char *v, char *why, size_t cap) {
    return check_sla_ref(v, DG_DIM_TIME, why, cap);
}
static int check_sla_tokrate(const char *v, char *why, size_t cap) {
    return check_sla_ref(v, DG_DIM_TOKRATE, why, cap);
}
static int check_sla_zscore(const char *v, char *why, size_t cap) {
    return check_sla_ref(v, DG_DIM_ZSCORE, why, cap);
}
#define SLA_ACTIONS "none|checkpoint|rollback|requeue|pause"

/* ---- the table ---- */

/* A row names its key by section and key as bare words; its field is dg_config_t's section.key. */
#define OFF(sec, k) offsetof(dg_config_t, sec.k), sizeof(((dg_config_t *)0)->sec.k)
#define KEY(sec, k, type) #sec, #k, type, OFF(sec, k)
#define I64MAX INT64_MAX
#define INT(sec, k, def, lo, hi, doc)                                                                        \
    { KEY(sec, k, DG_CFGT_INT), def, lo, hi, 0, 0, 0, NULL, NULL, doc, 0, 0 }
#define FLT(sec, k, def, lo, hi, doc)                                                                        \
    { KEY(sec, k, DG_CFGT_FLOAT), def, 0, 0, lo, hi, 0, NULL, NULL, doc, 0, 0 }
#define FLTX(sec, k, def, lo, hi, doc)                                                                       \
    { KEY(sec, k, DG_CFGT_FLOAT), def, 0, 0, lo, hi, 1, NULL, NULL, doc, 0, 0 }
#define FLTC(sec, k, def, lo, hi, chk, doc)                                                                  \
    { KEY(sec, k, DG_CFGT_FLOAT), def, 0, 0, lo, hi, 0, NULL, chk, doc, 0, 0 }
#define BOOL(sec, k, def, doc)                                                                               \
    { KEY(sec, k, DG_CFGT_BOOL), def, 0, 1, 0, 0, 0, NULL, NULL, doc, 0, 0 }
#define STR(sec, k, def, chk, doc)                                                                           \
    { KEY(sec, k, DG_CFGT_STR), def, 0, 0, 0, 0, 0, NULL, chk, doc, 0, 0 }
#define ENUM(sec, k, def, choices, doc)                                                                      \
    { KEY(sec, k, DG_CFGT_ENUM), def, 0, 0, 0, 0, 0, choices, NULL, doc, 0, 0 }
/* An enumerated key whose choice index is also stored, as an enum, in field section.key_id (config.h) */
#define IDX(sec, k) offsetof(dg_config_t, sec.k##_id), 1
#define ENUMI(sec, k, def, choices, doc)                                                                     \
    { KEY(sec, k, DG_CFGT_ENUM), def, 0, 0, 0, 0, 0, choices, NULL, doc, IDX(sec, k) }

/* One SLA objective (docs/sla.md): its reference, the samples per window and its Level-2 action. */
#define SLA_OBJ(name, def, check, window, doc)                                                               \
    STR(sla, name, def, check, doc),                                                                         \
        INT(sla, name##_window, window, 1, 1024, "samples per " #name " window"),                            \
        ENUM(sla, name##_action, "none", SLA_ACTIONS, #name " Level-2 action")

const dg_cfg_key_t dg_cfg_schema[] = {
    /* [run] */
    STR(run, name, "dgtrain", check_name, "run name, used in logs and metrics"),
    STR(run, dir, "runs/default", check_nonempty,
        "directory that holds everything the run writes (metrics.jsonl, checkpoints/, logs/)"),
    INT(run, seed, "1337", 0, I64MAX, "seed of every random choice (init, data order)"),
    ENUM(run, log_level, "info", "error|warn|info|debug", "least severe log level shown"),
    ENUM(run, lock, "auto", "auto|fcntl|none",
         "one run per run.dir: auto = an fcntl lock on run.dir/dgtrain.lock (where the file system has no "
         "locks: a same-host check), fcntl = the lock or an error, none = no lock"),
    STR(run, trace, "", check_trace,
        "A:B writes a Chrome/Perfetto trace of steps A..B to run.dir/trace.json (--trace A:B); \"\" = none"),
    STR(run, plan_cache, "auto", check_nonempty,
        "compiled-plan cache: auto = run.dir/plan_cache on the CUDA backend and off on the CPU backend "
        "(docs/sla.md: there its verification probe costs far more than the build it saves), off = none, or "
        "a directory (relative: to run.dir); "
        "a verified hit skips the graph passes and the memory plan"),
    FLT(run, compile_timeout_s, "30", 0, 1e9,
        "circuit breaker: a plan build past this many seconds falls back to the conservative plan "
        "(FALLBACK_COMPILE_TIMEOUT); 0 = no limit"),
    FLT(run, compile_mem_budget_mb, "0", -1, 1e12,
        "circuit breaker: a plan whose peak (arena + model state) is over this many MiB per rank falls back "
        "to the conservative plan (FALLBACK_COMPILE_OOM); 0 = parallel.memory_limit_mb, else the GPU's free "
        "or the host's available memory per rank; -1 = off"),

    /* [model] */
    ENUM(model, preset, "tiny", "tiny|gpt2-124m|gpt2-350m|gpt2-774m|gpt2-1558m|custom",
         "model size preset; custom needs all five sizes below"),
    INT(model, n_layer, "0", 0, 1024, "transformer blocks (0 = the preset's)"),
    INT(model, n_head, "0", 0, 1024, "attention heads (0 = the preset's)"),
    INT(model, d_model, "0", 0, 65536, "embedding width (0 = the preset's)"),
    INT(model, seq_len, "0", 0, 1048576, "context length in tokens (0 = the preset's)"),
    INT(model, vocab_size, "0", 0, 65536, "vocabulary size; tokens are uint16 (0 = the preset's)"),
    STR(model, init, "", check_init,
        "start a fresh run from existing weights: hf:DIR (Hugging Face GPT-2 config.json + "
        "model.safetensors) "
        "or llmc:FILE (llm.c checkpoint); \"\" = random init; a checkpoint to resume from wins"),

    /* [data] */
    STR(data, train, "", NULL, "glob of llm.c .bin token shards (\"\" = embedded default data)"),
    STR(data, val, "", NULL, "glob of validation shards (\"\" = embedded default data)"),
    INT(data, val_every, "50", 0, I64MAX, "steps between validations (0 = never)"),
    INT(data, val_batches, "4", 1, 1000000, "global batches per validation"),
    BOOL(data, shuffle, "true", "shuffle samples each epoch (seeded by run.seed)"),

    /* [train] */
    INT(train, steps, "300", 1, I64MAX, "optimizer steps to run"),
    INT(train, global_batch, "16", 1, 1 << 30, "sequences per optimizer step, all ranks together"),
    INT(train, micro_batch, "8", 1, 1 << 20,
        "sequences per rank per micro-step (gradient accumulation fills the rest)"),
    FLTX(train, lr, "3e-3", 0, 10, "peak learning rate"),
    INT(train, warmup_steps, "20", 0, I64MAX, "linear warmup steps"),
    FLT(train, min_lr_ratio, "0.1", 0, 1, "final LR of the cosine decay, as a fraction of lr"),
    FLT(train, weight_decay, "0.1", 0, 10, "AdamW decoupled weight decay"),
    FLT(train, grad_clip, "1.0", 0, 1e9, "global gradient-norm clip (0 = off)"),
    FLT(train, beta1, "0.9", 0, 0.999999, "AdamW beta1"),
    FLT(train, beta2, "0.95", 0, 0.999999999, "AdamW beta2"),
    FLTX(train, eps, "1e-8", 0, 1, "AdamW epsilon"),
    ENUMI(train, precision, "fp32", "fp32|bf16|fp16|fp8",
          "compute dtype of activations (fp8: bf16 activations, the linear layers' GEMMs on E4M3 operands; "
          "GPUs with FP8 tensor cores only)"),
    ENUMI(train, reduce_dtype, "fp32", "fp32|bf16", "dtype of gradient reductions"),
    ENUMI(train, recompute, "none", "none|gelu|selective|full",
          "activations recomputed in the backward instead of kept (gelu: the MLP's GELU output; selective: "
          "also the layer norms and the attention core; full: the whole layer from its input)"),
    STR(train, freeze, "", NULL, "comma-separated parameter-name patterns (fnmatch) that are not trained"),
    INT(train, log_every, "1", 1, I64MAX, "steps between progress lines"),
    FLT(train, loss_scale_init, "65536", 1, 4294967296.0, "initial dynamic loss scale (fp16 only)"),
    INT(train, loss_scale_growth_interval, "1000", 1, I64MAX,
        "overflow-free steps before the loss scale doubles (fp16, train.loss_scale_growth = fixed)"),
    FLTC(train, spike_factor, "2", 0, 1e9, check_spike,
         "loss > spike_factor x moving average is a loss spike: the update is skipped (0 = off, else > 1)"),
    ENUMI(train, spike_mode, "ratio", "ratio|zscore",
          "spike test: ratio = loss > spike_factor x moving average; zscore = (loss - mean) / sd > "
          "spike_zscore"),
    FLT(train, spike_zscore, "6", 1, 1e9, "z-score above which a loss is a spike (zscore mode)"),
    FLT(train, spike_val_factor, "1.05", 1, 1e9,
        "a spike is confirmed when the validation loss measured at it exceeds this x the last one"),
    INT(train, spike_pause_steps, "5", 0, 1000000,
        "steps after a confirmed spike that skip the update (losses logged) before the rollback"),
    INT(train, rollback_max, "3", 0, 1000000,
        "this many rollbacks within train.rollback_window steps checkpoint and exit 5 (0 = never)"),
    INT(train, rollback_window, "1000", 1, I64MAX,
        "steps (loop iterations) over which train.rollback_max counts rollbacks"),
    ENUMI(train, loss_scale_growth, "adaptive", "adaptive|fixed",
          "fp16 loss-scale growth: adaptive window from the gradient-norm variation, or fixed interval"),
    INT(train, loss_scale_window_min, "20", 1, I64MAX,
        "shortest adaptive growth window, steps (noisy gradient norms)"),
    INT(train, loss_scale_window_max, "500", 1, I64MAX,
        "longest adaptive growth window, steps (stable gradient norms)"),
    FLT(train, overflow_threshold, "0.008", 0, 1,
        "overflow rate (fraction of tensors with inf/NaN gradients) above which a step overflows"),
    INT(train, overflow_steps, "3", 1, 1000000,
        "consecutive overflowing steps that halve the fp16 loss scale and emit the overflow_rate event"),
    INT(train, overflow_window, "100", 1, 1000000, "steps of the windowed mean overflow rate"),
    INT(train, spike_window, "50", 1, 1000000, "moving-average window of the loss, steps"),
    INT(train, spike_max_consecutive, "3", 1, 1000000,
        "spikes in a row that confirm a spike without validation"),

    /* [parallel] */
    ENUMI(parallel, backend, "auto", "auto|cpu|cuda",
          "compute backend (auto = cuda when a GPU is bound, else cpu)"),
    ENUMI(parallel, comm, "auto", "auto|mpi|nccl",
          "communication backend (auto = nccl when every rank has a GPU of its own on the cuda backend, "
          "else mpi)"),
    ENUM(parallel, reduce_scatter, "ring", "ring|mpi",
         "mpi comm backend's reduce-scatter: dg_comm's ring, or MPI_Reduce_scatter_block"),
    STR(parallel, mesh, "auto", check_mesh,
        "device mesh: auto, or e.g. dp_replicate=2,dp_shard=4,tp=2,pp=2 (pp: pipeline stages, outermost; "
        "planned by --plan-only / --dry-run, not trained yet)"),
    INT(parallel, pp_microbatches, "0", 0, 1 << 20,
        "micro-batches per step through the pipeline (pp > 1; >= pp); train.global_batch must equal "
        "train.micro_batch x data-parallel ranks x this (0 = that quotient)"),
    ENUMI(parallel, pp_schedule, "1f1b", "1f1b|interleaved",
          "pipeline schedule: 1f1b (one stage per rank) or interleaved 1F1B (parallel.pp_virtual chunks "
          "per rank: a smaller bubble for more point-to-point traffic)"),
    INT(parallel, pp_virtual, "1", 1, 64,
        "virtual stages (model chunks) per rank: 1 with pp_schedule = 1f1b, >= 2 with interleaved (n_layer "
        "divisible by pp x pp_virtual)"),
    BOOL(parallel, reshard_after_forward, "true",
         "free gathered parameters after forward and gather them again for backward"),
    FLT(parallel, bucket_mb, "25", 0, 1048576,
        "MiB of gradients fused into one collective (0 = one collective per parameter)"),
    FLT(parallel, memory_limit_mb, "0", 0, 1e12,
        "cap (MiB per rank) on the memory the fit check counts as available: the smaller of it and the real "
        "figure (0 = no cap)"),
    FLT(parallel, prefetch_budget_mb, "256", 0, 16777216, "MiB that early (hoisted) all-gathers may hold"),
    BOOL(parallel, overlap, "true", "overlap collectives with compute"),
    BOOL(parallel, cuda_graph, "true",
         "record the step once as CUDA Graphs and replay them (cuda backend; falls back to op by op with a "
         "fallback event when it cannot)"),
    BOOL(parallel, nccl_nonblocking, "false",
         "create NCCL communicators non-blocking: every NCCL call settled by polling (about 60 us more per "
         "enqueue; the mode before 2026-11-29, for set-ups where blocking creation misbehaves)"),
    INT(parallel, threads, "0", 0, 4096, "CPU threads per rank (0 = the cores it is bound to)"),

    /* [checkpoint] */
    STR(checkpoint, dir, "", NULL,
        "checkpoint directory (\"\" = <run.dir>/checkpoints; a relative path is relative to run.dir)"),
    INT(checkpoint, every, "0", 0, I64MAX, "steps between checkpoints (0 = only at the end and on signals)"),
    INT(checkpoint, keep, "3", 0, 1000000, "complete checkpoints kept (0 = all)"),
    BOOL(checkpoint, async, "false", "write checkpoints from a snapshot in the background"),
    STR(checkpoint, resume, "auto", check_nonempty,
        "auto (newest complete checkpoint, if any) | never | PATH of a checkpoint file"),
    BOOL(checkpoint, incremental, "false",
         "link unchanged datasets to the previous checkpoint instead of rewriting them"),
    INT(checkpoint, max_failures, "3", 1, 1000000,
        "checkpoint saves that may fail in a row (full or failing storage; training goes on and the next "
        "one retries) before the run stops with exit code 4"),
    INT(checkpoint, threads, "0", 0, 16,
        "worker threads per rank for checkpoint hashing, direct chunk writes and the async snapshot copy "
        "(0 = this rank's share of the node's cores, at most 16)"),
    BOOL(checkpoint, space_check, "true",
         "before a save, compare its estimated size with the free space and refuse it (nothing written) "
         "when it cannot fit; false: write anyway (file systems whose free-space figure is wrong)"),

    /* [health] */
    FLTX(health, heartbeat_s, "5", 0, 3600,
         "deprecated (the probe period adapts, see probe_*_ms): when set, used as probe_steady_ms, with a "
         "warning"),
    FLTX(health, timeout_s, "120", 0, 604800,
         "seconds without progress before the watchdog aborts the job (exit 3); also the ceiling of the "
         "liveness timeout"),
    FLTX(health, probe_start_ms, "50", 0, 3600000,
         "heartbeat probe period at start, until probe_good good probes in a row"),
    FLTX(health, probe_steady_ms, "200", 0, 3600000,
         "heartbeat probe period after probe_good good probes in a row"),
    FLTX(health, probe_alert_ms, "10", 0, 3600000,
         "heartbeat probe period after an anomaly (a late heartbeat, a round trip far above the measured "
         "ones), which also raises an SLA Level-1 event heartbeat_rtt"),
    INT(health, probe_good, "3", 1, 1000000, "good probes in a row before the steady period"),
    FLTX(health, rtt_alert_factor, "8", 0, 1e6,
         "a round trip above this many times the measured mean (and above rtt_alert_min_ms) is an anomaly"),
    FLT(health, rtt_alert_min_ms, "250", 0, 3600000,
        "noise floor of the heartbeat anomalies: round trips and lateness below it are never one"),
    FLTX(health, liveness_floor_s, "5", 0, 604800,
         "a silent tree neighbour is dead after max(liveness_floor_s, liveness_mult x (its period + the "
         "highest recent round trip)), at most timeout_s"),
    FLTX(health, liveness_mult, "10", 0, 1e6, "multiplier of (period + round trip) in the liveness timeout"),

    /* [sla] (docs/sla.md): one reference "target, lower, upper, unit" (the validation suite's syntax) or
     * "off" per objective, its window in samples and its Level-2 action */
    BOOL(sla, enabled, "true", "judge the SLA objectives (false: none is judged, no sla events)"),
    INT(sla, fire_after, "2", 1, 1000000,
        "violating windows in a row before a per-step objective raises Level-1 (event objectives: 1)"),
    INT(sla, clear_after, "2", 1, 1000000,
        "clean windows in a row before a firing per-step objective clears (event objectives: 1)"),
    INT(sla, level2_after, "4", 1, 1000000,
        "violating windows in a row before a per-step objective takes its Level-2 action (event objectives: "
        "1)"),
    FLT(sla, warn_interval_s, "60", 0, 1e9,
        "at most one Level-1 log line per objective per this many seconds"),
    INT(sla, warmup_steps, "5", 0, I64MAX,
        "first steps of each attempt that step_time does not judge (start-up, warm caches)"),
    INT(sla, budget_steps, "20", 1, 1024, "recent steps whose median step time is the step_time budget"),
    FLT(sla, budget_floor_s, "0.1", 0, 1e6,
        "step_time budget never below this (s): a step faster than 1.3x it is never slow"),
    SLA_OBJ(step_time, "1, none, 0.3, x", check_sla_ratio, "5",
            "step time over the adaptive budget (median of recent steps): '1, none, 0.3, x' = violated above "
            "1.3x"),
    SLA_OBJ(tokens_per_s, "off", check_sla_tokrate, "10",
            "tokens/s floor of all ranks together, e.g. '50000, -0.2, none, tok/s' (off until set)"),
    SLA_OBJ(exposed_comm, "0.5, none, 0, frac", check_sla_ratio, "10",
            "fraction of the step spent in communication not hidden by compute (fed by the comm timers)"),
    SLA_OBJ(grad_sync_latency, "2, none, 0, s", check_sla_time, "10",
            "latency of the gradient all-reduce/reduce-scatter (fed by the heartbeat/comm timers)"),
    SLA_OBJ(overflow_rate, "0.008, none, 0, frac", check_sla_ratio, "10",
            "fraction of parameter tensors whose gradients hold inf/NaN (fed by the stability code)"),
    SLA_OBJ(loss_spike, "6, none, 0, z", check_sla_zscore, "1",
            "loss z-score against its moving average (fed by the stability code)"),
    SLA_OBJ(heartbeat_rtt, "1, none, 0, s", check_sla_time, "10",
            "heartbeat round trip (fed by the heartbeat)"),
    SLA_OBJ(checkpoint_stall, "120, none, 0, s", check_sla_time, "1",
            "seconds the step loop was blocked by one checkpoint save"),
    SLA_OBJ(checkpoint_success, "1, -0.5, none, frac", check_sla_ratio, "2",
            "fraction of checkpoint saves that completed, per window of saves"),
    SLA_OBJ(recovery_time, "600, none, 0, s", check_sla_time, "1",
            "job start to the first step completed after a resume"),
    SLA_OBJ(memory_plan, "1, -0.05, 0.05, x", check_sla_ratio, "1",
            "a step's peak of the backend's device memory over the plan's bytes (activations, model state, "
            "ids): '1, -0.05, 0.05, x' = within 5%"),

    /* [topology] */
    STR(topology, xml, "", NULL,
        "hwloc XML to use instead of the live machine (\"\" = live, or $HWLOC_XMLFILE)"),
    ENUM(topology, bind, "auto", "auto|none",
         "auto: bind each rank to the cores near its GPU (or an even share of the node); none: leave as "
         "launched"),
    STR(topology, cluster, "", NULL, "cluster description file for planning clusters that are not here"),
    INT(topology, world, "0", 0, 1 << 24,
        "world size to plan for with topology.cluster (0 = the real world size)"),
};

const int dg_cfg_nkeys = (int)(sizeof dg_cfg_schema / sizeof dg_cfg_schema[0]);
_Static_assert(sizeof dg_cfg_schema / sizeof dg_cfg_schema[0] <= DG_CFG_MAX_KEYS, "raise DG_CFG_MAX_KEYS");

const char *const dg_cfg_sections[] = {"run",        "model",  "data", "train",   "parallel",
                                       "checkpoint", "health", "sla",  "topology"};
const int dg_cfg_nsections = (int)(sizeof dg_cfg_sections / sizeof dg_cfg_sections[0]);

int dg_cfg_find(const char *section, const char *key) {
    for (int i = 0; i < dg_cfg_nkeys; i++)
        if (strcmp(dg_cfg_schema[i].section, section) == 0 && strcmp(dg_cfg_schema[i].key, key) == 0)
            return i;
    return -1;
}

int dg_cfg_find_dotted(const char *name) {
    const char *dot = strchr(name, '.');
    if (!dot) return -1;
    size_t sl = (size_t)(dot - name);
    for (int i = 0; i < dg_cfg_nkeys; i++)
        if (strlen(dg_cfg_schema[i].section) == sl && strncmp(dg_cfg_schema[i].section, name, sl) == 0 &&
            strcmp(dg_cfg_schema[i].key, dot + 1) == 0)
            return i;
    return -1;
}
