/* env.c — the registry of DG_* environment switches and its strict typed accessors (dg_env.h). */
#include "dg_env.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dg_json.h"

#define U DG_ENV_USER
#define T DG_ENV_TEST

/* Keep README.md "Environment variables" in sync: the ctest env_registry_check compares them. */
/* one switch a row: name, type, default and kind on one line, the doc on the next */
/* clang-format off */
static const dg_env_var_t g_vars[] = {
    /* ---- user and site switches ---- */
    {"DG_BOOT_RANKS_PER_NODE", DG_ENV_INT, "0", U,
     "ranks per node group (consecutive ranks); 0: the MPI shared-memory split"},
    {"DG_GPT2_TIKTOKEN", DG_ENV_PATH, "", U,
     "GPT-2 ranks file, overrides the installed gpt2.tiktoken"},
    {"DG_DEFAULT_TEXT_DIR", DG_ENV_PATH, "", U,
     "source directory of the built-in default text corpus (default: the installed one)"},
    {"DG_CKPT_MPIIO_HINTS", DG_ENV_STRING, "", U,
     "extra MPI-IO hints for checkpoint files: key=value,..."},
    {"DG_CKPT_NO_MALLOPT", DG_ENV_BOOL, "0", U,
     "1: keep glibc's malloc thresholds (no mallopt for large buffers)"},
    {"DG_CKPT_DIRECT_CHUNKS", DG_ENV_BOOL, "1", U,
     "0: leave all checkpoint chunk writes to HDF5"},
    {"DG_CKPT_SKIP_FILL", DG_ENV_BOOL, "1", U,
     "0: keep parallel HDF5's zero fill of directly written datasets"},
    {"DG_CKPT_HDF5_FLETCHER32", DG_ENV_BOOL, "0", U,
     "1: use HDF5's own Fletcher-32 instead of the fast one"},
    {"DG_COMM_RING_SEG_KB", DG_ENV_INT, "512", U,
     "segment size (KiB) of the MPI ring collectives (benchmarks)"},
    {"DG_CUDA_FUSED_EPILOGUES", DG_ENV_BOOL, "1", U,
     "0: CUDA GEMMs without fused bias/GELU epilogues (A/B)"},
    {"DG_CUDA_FUSED_DGELU", DG_ENV_BOOL, "1", U,
     "0: CUDA GELU backward as a separate kernel (A/B)"},
    {"DG_CUDA_LN_REG", DG_ENV_BOOL, "1", U,
     "0: CUDA layer norm without the register-resident kernel (A/B)"},
    {"DG_CUDA_GEMM_TUNE", DG_ENV_BOOL, "1", U,
     "0: no GEMM algorithm tuning (cuBLASLt heuristic only)"},
    {"DG_CUDA_FAST_ATTENTION", DG_ENV_BOOL, "1", U,
     "0: CUDA attention by the reference kernels (A/B)"},
    {"DG_CUDA_ATTN_CUDNN", DG_ENV_BOOL, "1", U,
     "0: CUDA attention without cuDNN (own kernels)"},
    {"DG_CUDA_GEMM_TUNE_FILE", DG_ENV_PATH, "", U,
     "GEMM tuning cache file; none or empty: no file (default: $XDG_CACHE_HOME/dgtrain/gemm_tune.txt)"},
    {"DG_CPU_NO_AVX512", DG_ENV_BOOL, "0", U,
     "1: cpu backend attention without AVX-512 kernels"},
    {"DG_SYNC_HOST_READS", DG_ENV_BOOL, "0", U,
     "1: read step results to the host synchronously (A/B of async reads)"},
    /* ---- test hooks (compiled in only with -DDGT_TEST_HOOKS=ON) ---- */
    {"DG_TEST_CKPT_FAIL", DG_ENV_STRING, "", T,
     "fail checkpoint phase: <phase>[@rank][:N]"},
    {"DG_TEST_CKPT_KILL", DG_ENV_STRING, "", T,
     "SIGKILL self at checkpoint phase: <phase>[@rank][:N]"},
    {"DG_TEST_CKPT_STALL", DG_ENV_STRING, "", T,
     "stall at checkpoint phase: <phase>[@rank][:N]"},
    {"DG_TEST_CKPT_THROTTLE_MS", DG_ENV_STRING, "", T,
     "slow checkpoint writes by <ms>[@rank] per chunk"},
    {"DG_TEST_COMM_PROBE_DELAY_S", DG_ENV_DOUBLE, "0", T,
     "delay (s) before answering a comm liveness probe"},
    {"DG_TEST_P2P_LATENCY_US", DG_ENV_DOUBLE, "0", T,
     "mpi comm: a point-to-point send leaves this many us after its post (a slow link)"},
    {"DG_TEST_FS_NO_LOCKS", DG_ENV_BOOL, "0", T,
     "1: file locks fail with ENOLCK (file systems without locks)"},
    {"DG_TEST_VALIDATE_SLOW_RANK", DG_ENV_INT, "-1", T,
     "dgvalidate: this rank's timed compute runs slower"},
    {"DG_TEST_VALIDATE_SLOW_FACTOR", DG_ENV_DOUBLE, "10", T,
     "dgvalidate: the slow rank's factor (>1)"},
    {"DG_TEST_STALL_RANK", DG_ENV_INT, "-1", T,
     "this rank stalls (health heartbeat test) at DG_TEST_STALL_STEP"},
    {"DG_TEST_STALL_STEP", DG_ENV_INT, "-1", T,
     "the step DG_TEST_STALL_RANK stalls at"},
    {"DG_TEST_PROBE_KILL_RANK", DG_ENV_INT, "-1", T,
     "this rank's health thread exits silently (a dead probe) at DG_TEST_PROBE_KILL_STEP"},
    {"DG_TEST_PROBE_KILL_STEP", DG_ENV_INT, "-1", T,
     "the step DG_TEST_PROBE_KILL_RANK's probe dies at"},
    {"DG_TEST_COMM_FAIL_RANK", DG_ENV_INT, "-1", T,
     "this rank's communicators fail (marked failed, ncclCommAbort) at DG_TEST_COMM_FAIL_STEP"},
    {"DG_TEST_COMM_FAIL_STEP", DG_ENV_INT, "-1", T,
     "the step DG_TEST_COMM_FAIL_RANK's comms fail at"},
    {"DG_TEST_SLOW_RANK", DG_ENV_INT, "-1", T,
     "this rank sleeps DG_TEST_SLOW_MS in every training step (SLA test)"},
    {"DG_TEST_SLOW_STEP", DG_ENV_INT, "-1", T,
     "the first step (1-based) DG_TEST_SLOW_RANK is slow in"},
    {"DG_TEST_SLOW_MS", DG_ENV_DOUBLE, "0", T,
     "milliseconds DG_TEST_SLOW_RANK sleeps per step"},
    {"DG_TEST_MEM_LEAK_MB", DG_ENV_DOUBLE, "0", T,
     "MB of backend memory kept per step from DG_TEST_MEM_LEAK_STEP (memory_plan test)"},
    {"DG_TEST_MEM_LEAK_STEP", DG_ENV_INT, "-1", T,
     "the first step (1-based) of DG_TEST_MEM_LEAK_MB"},
    {"DG_TEST_STALL_COLLECTIVE_RANK", DG_ENV_INT, "-1", T,
     "this rank stalls inside a collective at DG_TEST_STALL_COLLECTIVE_STEP"},
    {"DG_TEST_STALL_COLLECTIVE_STEP", DG_ENV_INT, "-1", T,
     "the step DG_TEST_STALL_COLLECTIVE_RANK stalls at"},
    {"DG_TEST_SPIKE_STEP", DG_ENV_INT, "-1", T,
     "the training loss of this step is multiplied by DG_TEST_SPIKE_LOSS_MULT (a loss spike), once"},
    {"DG_TEST_SPIKE_LOSS_MULT", DG_ENV_INT, "10", T,
     "the factor of the DG_TEST_SPIKE_STEP loss"},
    {"DG_TEST_SPIKE_VAL_MULT", DG_ENV_INT, "10", T,
     "the factor of the validation loss that checks the DG_TEST_SPIKE_STEP spike (1: it holds)"},
    {"DG_TEST_SPIKE_REPEAT", DG_ENV_BOOL, "0", T,
     "1: DG_TEST_SPIKE_STEP fires every time the step is taken again (after each rollback)"},
    {"DG_TEST_GRAD_NAN_STEP", DG_ENV_INT, "-1", T,
     "from this step on, rank 0 puts a NaN into its piece of parameter 0's gradient (an overflow)"},
    {"DG_TEST_GRAD_NAN_COUNT", DG_ENV_INT, "1", T,
     "how many steps DG_TEST_GRAD_NAN_STEP corrupts"},
    {"DG_TEST_RESUME_SKIP_BATCHES", DG_ENV_INT, "0", T,
     "after a resume the loader moves past this many global batches (a rollback's data skip)"},
    {"DG_TEST_ADAMW_PER_PARAM", DG_ENV_BOOL, "0", T,
     "1: AdamW per parameter instead of the fused update"},
    {"DG_TEST_UNFUSED_CE", DG_ENV_BOOL, "0", T,
     "1: cross-entropy as separate ops instead of the fused one"},
    {"DG_TEST_UNFUSED_RESID", DG_ENV_BOOL, "0", T,
     "1: residual add apart from the linear layer before it"},
    {"DG_TEST_NO_KERNEL", DG_ENV_STRING, "", T,
     "op kinds the backend must treat as missing: kind,kind,..."},
    {"DG_TEST_ARENA_FAIL", DG_ENV_BOOL, "0", T,
     "1: the executor's arena allocation fails"},
    {"DG_TEST_SLOW_BUILD_MS", DG_ENV_INT, "0", T,
     "milliseconds of sleep before each graph pass of the model build (circuit breaker timeout test)"},
    {"DG_TEST_FORCE_STAGING", DG_ENV_BOOL, "0", T,
     "1: host staging of comm buffers on the cpu backend too"},
    {"DG_TEST_STREAM_WAITS", DG_ENV_BOOL, "0", T,
     "1: stream waits instead of host waits on the cpu backend"},
    {"DG_TEST_CUDA_GRAPH_FAIL", DG_ENV_BOOL, "0", T,
     "1: every CUDA Graph recording fails"},
};
/* clang-format on */

#undef U
#undef T

/* Switches that became config keys (README "Environment variables": a setting of the run is a key, so
 * that RUN_DIR/config.ini and the checkpoints store it). They are no longer read; dg_env_check names the
 * key when one is still set, so that a script that sets it learns why it has no effect. */
static const struct {
    const char *name, *key;
} g_moved[] = {
    {"DG_CKPT_THREADS", "checkpoint.threads"},
    {"DG_CKPT_SPACE_CHECK", "checkpoint.space_check"},
    {"DG_NCCL_NONBLOCKING", "parallel.nccl_nonblocking"},
};

int dg_env_count(void) {
    return (int)(sizeof g_vars / sizeof *g_vars);
}

const dg_env_var_t *dg_env_at(int i) {
    DG_ASSERT(i >= 0 && i < dg_env_count());
    return &g_vars[i];
}

const dg_env_var_t *dg_env_find(const char *name) {
    for (int i = 0; i < dg_env_count(); i++)
        if (strcmp(g_vars[i].name, name) == 0) return &g_vars[i];
    return NULL;
}

int dg_env_hooks_compiled(void) {
#ifdef DG_TEST_HOOKS
    return 1;
#else
    return 0;
#endif
}

const char *dg_env_type_name(dg_env_type_t t) {
    static const char *const names[] = {[DG_ENV_BOOL] = "bool",
                                        [DG_ENV_INT] = "int",
                                        [DG_ENV_DOUBLE] = "double",
                                        [DG_ENV_STRING] = "string",
                                        [DG_ENV_PATH] = "path"};
    return DG_ENUM_NAME(names, t, "?");
}

static const char *expected(dg_env_type_t t) {
    switch (t) {
    case DG_ENV_BOOL:
        return "a bool (0, 1, true, false, on, off, yes, no)";
    case DG_ENV_INT:
        return "a whole decimal number";
    case DG_ENV_DOUBLE:
        return "a finite number";
    default:
        return "a string";
    }
}

static int parse_bool(const char *s, int *b) {
    static const char *on[] = {"1", "true", "on", "yes"}, *off[] = {"0", "false", "off", "no"};
    for (int k = 0; k < 4; k++) {
        if (strcasecmp(s, on[k]) == 0) return *b = 1, 1;
        if (strcasecmp(s, off[k]) == 0) return *b = 0, 1;
    }
    return 0;
}

dg_status_t dg_env_parse(const dg_env_var_t *v, const char *text, int *b, int64_t *i, double *d) {
    DG_ASSERT(v && text);
    char *end = NULL;
    int ok = 1;
    errno = 0;
    switch (v->type) {
    case DG_ENV_BOOL:
        ok = b && parse_bool(text, b);
        break;
    case DG_ENV_INT: {
        long long x = strtoll(text, &end, 10);
        ok = i && *text && end != text && *end == '\0' && errno == 0;
        if (ok) *i = (int64_t)x;
        break;
    }
    case DG_ENV_DOUBLE: {
        double x = strtod(text, &end);
        ok = d && *text && end != text && *end == '\0' && errno == 0 && isfinite(x);
        if (ok) *d = x;
        break;
    }
    case DG_ENV_STRING:
    case DG_ENV_PATH:
        break;
    }
    if (!ok) return DG_ERR(DG_ERR_USAGE, "environment: %s='%s' is not %s", v->name, text, expected(v->type));
    return DG_OK;
}

/* The row for `name` (asserts it is registered and of a type `want` accepts), and its value: NULL when
 * unset, compiled out, or (numeric/bool) empty. */
static const char *lookup(const char *name, int str, dg_env_type_t want, const dg_env_var_t **vp) {
    const dg_env_var_t *v = dg_env_find(name);
    DG_ASSERTF(v, "environment switch %s is not registered in src/common/env.c", name);
    DG_ASSERTF(str ? (v->type == DG_ENV_STRING || v->type == DG_ENV_PATH) : v->type == want,
               "environment switch %s is a %s, read with another accessor", name, dg_env_type_name(v->type));
    *vp = v;
    if (v->kind == DG_ENV_TEST && !dg_env_hooks_compiled()) return NULL;
    const char *s = getenv(name);
    if (s && !*s && !str) return NULL;
    return s;
}

static void parse_or_assert(const dg_env_var_t *v, const char *s, int *b, int64_t *i, double *d) {
    DG_ASSERTF(dg_env_parse(v, s, b, i, d) == DG_OK, "%s (the program did not call dg_env_check at start)",
               dg_last_error());
}

/* Parses name's value, else its default, into b, i or d; a numeric switch with neither keeps *i or *d. */
static void read_typed(const char *name, dg_env_type_t t, int *b, int64_t *i, double *d) {
    const dg_env_var_t *v;
    const char *s = lookup(name, 0, t, &v);
    if (!s) s = v->dflt;
    if (*s || t == DG_ENV_BOOL) parse_or_assert(v, s, b, i, d);
}

int dg_env_bool(const char *name) {
    int b = 0;
    read_typed(name, DG_ENV_BOOL, &b, NULL, NULL);
    return b;
}

int64_t dg_env_int(const char *name) {
    int64_t x = 0;
    read_typed(name, DG_ENV_INT, NULL, &x, NULL);
    return x;
}

double dg_env_double(const char *name) {
    double x = 0;
    read_typed(name, DG_ENV_DOUBLE, NULL, NULL, &x);
    return x;
}

const char *dg_env_str(const char *name) {
    const dg_env_var_t *v;
    return lookup(name, 1, DG_ENV_STRING, &v);
}

dg_status_t dg_env_check(FILE *warn) {
    for (size_t k = 0; k < sizeof g_moved / sizeof *g_moved; k++)
        if (warn && getenv(g_moved[k].name))
            fprintf(warn, "warning: %s is no longer read: it is the config key %s now (--set %s=VALUE)\n",
                    g_moved[k].name, g_moved[k].key, g_moved[k].key);
    for (int k = 0; k < dg_env_count(); k++) {
        const dg_env_var_t *v = &g_vars[k];
        const char *s = getenv(v->name);
        if (!s) continue;
        if (v->kind == DG_ENV_TEST && !dg_env_hooks_compiled()) {
            if (warn)
                fprintf(warn,
                        "warning: %s is set but ignored: test hooks are not compiled into this build "
                        "(-DDGT_TEST_HOOKS=ON)\n",
                        v->name);
            continue;
        }
        if (!*s) continue;
        int b;
        int64_t i;
        double d;
        DG_TRY(dg_env_parse(v, s, &b, &i, &d));
    }
    return DG_OK;
}

static const char *current(const dg_env_var_t *v) {
    if (v->kind == DG_ENV_TEST && !dg_env_hooks_compiled()) return NULL;
    return getenv(v->name);
}

void dg_env_print(FILE *out, int json) {
    int hooks = dg_env_hooks_compiled();
    if (json) fprintf(out, "{\"test_hooks_compiled\":%s,\"vars\":[", hooks ? "true" : "false");
    for (int k = 0; k < dg_env_count(); k++) {
        const dg_env_var_t *v = &g_vars[k];
        const char *cur = current(v);
        int off = v->kind == DG_ENV_TEST && !hooks;
        if (json) {
            fprintf(out, "%s{\"name\":\"%s\",\"type\":\"%s\",\"kind\":\"%s\",\"default\":", k ? "," : "",
                    v->name, dg_env_type_name(v->type), v->kind == DG_ENV_TEST ? "test-hook" : "user");
            dg_json_fputs(out, v->dflt);
            fprintf(out, ",\"compiled_in\":%s,\"value\":", off ? "false" : "true");
            if (cur)
                dg_json_fputs(out, cur);
            else
                fputs("null", out);
            fputs(",\"doc\":", out);
            dg_json_fputs(out, v->doc);
            fputc('}', out);
        } else {
            fprintf(out, "%-30s %-6s default=%-6s %-24s %s\n", v->name, dg_env_type_name(v->type),
                    *v->dflt ? v->dflt : "-",
                    off   ? "not compiled in"
                    : cur ? cur
                          : "unset",
                    v->doc);
        }
    }
    if (json) fputs("]}\n", out);
}
