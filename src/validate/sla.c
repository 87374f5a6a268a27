/* sla.c — the validation SLA file (validation/sla.ini): suite settings, node types with their hardware
 * expectations, and ReFrame-style references (target, lower, upper, unit) per metric and node type.
 *
 * libinih does the INI syntax. Debian builds it without INI_HANDLER_LINENO, so (as config.c does) we
 * feed it through ini_parse_stream() with a reader called once per physical line: that gives every
 * error message its FILE:LINE. Everything unknown is an error: a typo in a threshold must never turn
 * into a silently unchecked metric.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fnmatch.h>
#include <ini.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "validate_impl.h"

#define SLA_MAX_TYPES 64
#define SLA_MAX_REFS 512
#define SLA_MAX_MATCH 16

/* ---------------------------------------------------------------- metrics */

static const char *const k_comm_backends[] = {"mpi", "nccl"};
static const char *const k_comm_ops[] = {"allreduce", "allgather", "reduce_scatter", "broadcast", "sendrecv"};
static const char *const k_comm_groups[] = {"intra", "inter", "world"};

static char g_comm_names[2 * 5 * 3][64];
static dg_validate_metric_t g_metrics[2 * 5 * 3 + 16];

static const dg_validate_metric_t k_fixed_metrics[] = {
    {"compute.cpu_gemm", DG_DIM_FLOPS, "fp32 GEMM (OpenBLAS) of all ranks of a node together, per node"},
    {"compute.cpu_stream", DG_DIM_BANDWIDTH, "STREAM triad of all ranks of a node together, per node"},
    {"compute.gpu_gemm", DG_DIM_FLOPS, "bf16 GEMM (cuBLASLt) per GPU"},
    {"compute.gpu_stream", DG_DIM_BANDWIDTH, "STREAM triad per GPU (device memory)"},
    {"storage.write", DG_DIM_BANDWIDTH, "parallel-HDF5 checkpoint write incl. fsync and commit, all ranks"},
    {"storage.read", DG_DIM_BANDWIDTH, "parallel-HDF5 checkpoint read, all ranks"},
    {"storage.create", DG_DIM_TIME, "create + 4 KiB write + fsync + close of a file (worst rank's median)"},
    {"storage.rename", DG_DIM_TIME, "rename + directory fsync (worst rank's median)"},
    {"health.rtt", DG_DIM_TIME, "heartbeat round trip rank 0 <-> rank r (worst rank's median)"},
    {"train.recovery", DG_DIM_TIME,
     "the training check's resumed run: process start to its first step (boot, checkpoint read, plan build)"},
};

const dg_validate_metric_t *dg_validate_metrics(void) {
    /* built once; the table is immutable afterwards (threads may read it concurrently) */
    static int built = 0;
    if (!built) {
        int k = 0;
        for (int b = 0; b < 2; b++)
            for (int o = 0; o < 5; o++)
                for (int g = 0; g < 3; g++) {
                    snprintf(g_comm_names[k], sizeof g_comm_names[k], "comm.%s.%s.%s", k_comm_backends[b],
                             k_comm_ops[o], k_comm_groups[g]);
                    g_metrics[k].name = g_comm_names[k];
                    g_metrics[k].dim = DG_DIM_BANDWIDTH;
                    g_metrics[k].doc = "nccl-tests bus bandwidth at the largest size of the sweep";
                    k++;
                }
        for (size_t i = 0; i < sizeof k_fixed_metrics / sizeof *k_fixed_metrics; i++)
            g_metrics[k++] = k_fixed_metrics[i];
        g_metrics[k].name = NULL;
        built = 1;
    }
    return g_metrics;
}

static const dg_validate_metric_t *find_metric(const char *name) {
    for (const dg_validate_metric_t *m = dg_validate_metrics(); m->name; m++)
        if (strcmp(m->name, name) == 0) return m;
    return NULL;
}

/* ---------------------------------------------------------------- units and references */

/* The units and the reference helpers are src/sla/dg_sla_ref.h (one parser for validation/sla.ini and
 * the training [sla] section); dg_validate_unit_factor stays as this suite's name for the lookup. */
double dg_validate_unit_factor(const char *unit, dg_dim_t *dim) {
    return dg_sla_unit_factor(unit, dim);
}

int dg_sla_count_ok(const dg_sla_count_t *c, int v) {
    if (c->any) return 1;
    return c->at_least ? v >= c->n : v == c->n;
}

void dg_sla_count_format(const dg_sla_count_t *c, char *buf, size_t cap) {
    if (c->any)
        snprintf(buf, cap, "any");
    else
        snprintf(buf, cap, "%s%d", c->at_least ? ">=" : "", c->n);
}

/* ---------------------------------------------------------------- the SLA object */

enum {
    NK_MATCH,
    NK_GPUS,
    NK_GPU_MODEL,
    NK_NUMA,
    NK_CORES,
    NK_NICS,
    NK_IB_NICS,
    NK_RANKS_PER_GPU,
    NK_BIND,
    NK_N
};
static const char *const k_node_keys[NK_N] = {"match", "gpus",    "gpu_model",     "numa_nodes",   "cores",
                                              "nics",  "ib_nics", "ranks_per_gpu", "bind_near_gpu"};

typedef struct {
    char name[64];
    char match[SLA_MAX_MATCH][128];
    int n_match;
    dg_sla_node_t node;
    int set[NK_N];   /* line that set each key (0 = inherited) */
    int header_line; /* line of the [node:TYPE] header */
} node_type_t;

typedef struct {
    int type;
    char metric[64];
    dg_sla_ref_t ref;
    int line;
} ref_entry_t;

struct dg_sla {
    char name[1024];
    dg_sla_settings_t set;
    node_type_t types[SLA_MAX_TYPES];
    int n_types;
    ref_entry_t refs[SLA_MAX_REFS];
    int n_refs;
    int setting_line[64]; /* duplicate detection for [validate] keys */
};

static void node_defaults(dg_sla_node_t *n) {
    memset(n, 0, sizeof *n);
    n->gpus.any = n->numa_nodes.any = n->cores.any = n->nics.any = n->ib_nics.any = 1;
    snprintf(n->gpu_model, sizeof n->gpu_model, "*");
    n->ranks_per_gpu = 1;
    n->bind_near_gpu = 1;
}

/* Production defaults; validation/sla.ini restates them with the reasons. */
static void settings_defaults(dg_sla_settings_t *s) {
    memset(s, 0, sizeof *s);
    snprintf(s->checks, sizeof s->checks, "all");
    s->straggler_fraction = 0.8;
    snprintf(s->comm_backends, sizeof s->comm_backends, "auto");
    const long long sizes[] = {8, 1024, 65536, 1 << 20, 16 << 20, 128 << 20};
    s->n_comm_sizes = 6;
    for (int i = 0; i < 6; i++)
        s->comm_sizes[i] = sizes[i];
    s->comm_iters = 20;
    s->comm_warmup = 5;
    s->comm_timeout_s = 300;
    s->cpu_gemm_n = 2048;
    s->cpu_gemm_reps = 5;
    s->cpu_stream_mb = 384;
    s->cpu_stream_reps = 5;
    s->gpu_gemm_n = 8192;
    s->gpu_gemm_reps = 20;
    s->gpu_stream_mb = 3072;
    s->gpu_stream_reps = 20;
    s->storage_mb = 4096;
    s->storage_meta_files = 100;
    s->rtt_reps = 100;
    s->heartbeat_s = 0.2;
    s->train_steps = 10;
    s->train_micro_batch = 2;
    s->train_global_batch = 0;
    s->train_loss_rtol = 1e-5;
    s->train_resume_rtol = 0;
}

void dg_sla_free(dg_sla_t *s) {
    free(s);
}

int dg_sla_n_types(const dg_sla_t *s) {
    return s->n_types;
}

const char *dg_sla_type_name(const dg_sla_t *s, int type) {
    DG_ASSERT(type >= 0 && type < s->n_types);
    return s->types[type].name;
}

const char *dg_sla_name(const dg_sla_t *s) {
    return s->name;
}

const dg_sla_settings_t *dg_sla_settings(const dg_sla_t *s) {
    return &s->set;
}

const dg_sla_node_t *dg_sla_node(const dg_sla_t *s, int type) {
    DG_ASSERT(type >= 0 && type < s->n_types);
    return &s->types[type].node;
}

int dg_sla_node_type(const dg_sla_t *s, const char *host) {
    for (int t = 1; t < s->n_types; t++)
        for (int m = 0; m < s->types[t].n_match; m++)
            if (fnmatch(s->types[t].match[m], host, 0) == 0) return t;
    return 0;
}

const dg_sla_ref_t *dg_sla_ref(const dg_sla_t *s, int type, const char *metric) {
    const dg_sla_ref_t *fallback = NULL;
    for (int i = 0; i < s->n_refs; i++) {
        if (strcmp(s->refs[i].metric, metric) != 0) continue;
        if (s->refs[i].type == type) return &s->refs[i].ref;
        if (s->refs[i].type == 0) fallback = &s->refs[i].ref;
    }
    return fallback;
}

/* ---------------------------------------------------------------- value parsers */

static int parse_int(const char *v, long long lo, long long hi, int *out) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (end == v || *dg_sla_trim(end) || errno == ERANGE || x < lo || x > hi) return -1;
    *out = (int)x;
    return 0;
}

static int parse_bool(const char *v, int *out) {
    static const char *t[] = {"yes", "true", "on", "1"}, *f[] = {"no", "false", "off", "0"};
    for (int i = 0; i < 4; i++) {
        if (strcasecmp(v, t[i]) == 0) return *out = 1, 0;
        if (strcasecmp(v, f[i]) == 0) return *out = 0, 0;
    }
    return -1;
}

static int parse_count(const char *v, dg_sla_count_t *c) {
    memset(c, 0, sizeof *c);
    if (strcasecmp(v, "any") == 0) return c->any = 1, 0;
    if (v[0] == '>' && v[1] == '=') {
        c->at_least = 1;
        v += 2;
        while (isspace((unsigned char)*v))
            v++;
    }
    return parse_int(v, 0, 1 << 20, &c->n);
}

/* "64K" -> 65536 (binary multiples K, M, G; optional trailing B) */
static int parse_size(const char *v, long long *out) {
    char *end;
    errno = 0;
    double d = strtod(v, &end);
    if (end == v || errno || !(d > 0)) return -1;
    double mul = 1;
    switch (toupper((unsigned char)*end)) {
    case 'K':
        mul = 1024.0, end++;
        break;
    case 'M':
        mul = 1048576.0, end++;
        break;
    case 'G':
        mul = 1073741824.0, end++;
        break;
    default:
        break;
    }
    if (toupper((unsigned char)*end) == 'B') end++;
    if (*dg_sla_trim(end)) return -1;
    double b = d * mul;
    if (b < 1 || b > 64.0 * 1073741824.0 || b != floor(b)) return -1;
    *out = (long long)b;
    return 0;
}

/* ---------------------------------------------------------------- suggestions */

static void suggest(const char *word, const char *const *cands, int n, const char *prefix, char *buf,
                    size_t cap) {
    int bd = 1000, best = dg_closest(word, cands, n, &bd);
    int limit = (int)strlen(word) / 3 + 1;
    if (limit < 2) limit = 2;
    if (best >= 0 && bd <= limit)
        snprintf(buf, cap, "; did you mean '%s%s'?", prefix, cands[best]);
    else
        buf[0] = 0;
}

/* ---------------------------------------------------------------- [validate] settings */

typedef enum {
    ST_STR,
    ST_INT,
    ST_POS_INT,
    ST_FRAC,
    ST_POS_DBL,
    ST_NONNEG_DBL,
    ST_SIZES,
    ST_CHECKS,
    ST_BACKENDS
} st_kind_t;

typedef struct {
    const char *key;
    st_kind_t kind;
    size_t off;
    size_t cap; /* strings */
} setting_t;

/* A setting named as its field of dg_sla_settings_t; BUF: a string field, with its capacity. */
#define SET(f, kind)                                                                                         \
    { #f, kind, offsetof(dg_sla_settings_t, f), 0 }
#define BUF(f, kind)                                                                                         \
    { #f, kind, offsetof(dg_sla_settings_t, f), sizeof(((dg_sla_settings_t *)0)->f) }
static const setting_t k_settings[] = {
    BUF(checks, ST_CHECKS),
    SET(straggler_fraction, ST_FRAC),
    BUF(comm_backends, ST_BACKENDS),
    SET(comm_sizes, ST_SIZES),
    SET(comm_iters, ST_POS_INT),
    SET(comm_warmup, ST_INT),
    SET(comm_timeout_s, ST_POS_DBL),
    SET(cpu_gemm_n, ST_POS_INT),
    SET(cpu_gemm_reps, ST_POS_INT),
    SET(cpu_stream_mb, ST_POS_DBL),
    SET(cpu_stream_reps, ST_POS_INT),
    SET(gpu_gemm_n, ST_POS_INT),
    SET(gpu_gemm_reps, ST_POS_INT),
    SET(gpu_stream_mb, ST_POS_DBL),
    SET(gpu_stream_reps, ST_POS_INT),
    BUF(storage_dir, ST_STR),
    SET(storage_mb, ST_POS_DBL),
    SET(storage_meta_files, ST_POS_INT),
    SET(rtt_reps, ST_POS_INT),
    SET(heartbeat_s, ST_POS_DBL),
    SET(train_steps, ST_POS_INT),
    SET(train_micro_batch, ST_POS_INT),
    SET(train_global_batch, ST_INT),
    SET(train_loss_rtol, ST_NONNEG_DBL),
    SET(train_resume_rtol, ST_NONNEG_DBL),
    BUF(train_config, ST_STR),
};
#define N_SETTINGS ((int)(sizeof k_settings / sizeof *k_settings))

static const char *const k_groups[] = {"topology", "comm", "compute", "storage", "train", "health"};

/* Every setting error names where (FILE:LINE or --set 'x'), the key and what was expected. */
static dg_status_t set_setting(dg_sla_t *s, const char *where, const char *key, char *v) {
    int i;
    for (i = 0; i < N_SETTINGS; i++)
        if (strcmp(k_settings[i].key, key) == 0) break;
    if (i == N_SETTINGS) {
        const char *names[N_SETTINGS];
        for (int j = 0; j < N_SETTINGS; j++)
            names[j] = k_settings[j].key;
        char sg[128];
        suggest(key, names, N_SETTINGS, "validate.", sg, sizeof sg);
        return DG_ERR(DG_ERR_USAGE, "%s: unknown key validate.%s%s", where, key, sg);
    }
    const setting_t *st = &k_settings[i];
    void *p = (char *)&s->set + st->off;
    switch (st->kind) {
    case ST_STR:
        if (strlen(v) >= st->cap)
            return DG_ERR(DG_ERR_USAGE, "%s: validate.%s: value longer than %zu characters", where, key,
                          st->cap - 1);
        snprintf(p, st->cap, "%s", v);
        return DG_OK;
    case ST_INT:
        if (parse_int(v, 0, 1 << 30, p))
            return DG_ERR(DG_ERR_USAGE, "%s: validate.%s = '%s': expected an integer >= 0", where, key, v);
        return DG_OK;
    case ST_POS_INT:
        if (parse_int(v, 1, 1 << 30, p))
            return DG_ERR(DG_ERR_USAGE, "%s: validate.%s = '%s': expected an integer >= 1", where, key, v);
        return DG_OK;
    case ST_FRAC: {
        double d;
        if (dg_sla_parse_double(v, &d) || d <= 0 || d > 1)
            return DG_ERR(DG_ERR_USAGE, "%s: validate.%s = '%s': expected a fraction in (0, 1]", where, key,
                          v);
        *(double *)p = d;
        return DG_OK;
    }
    case ST_POS_DBL:
    case ST_NONNEG_DBL: {
        double d;
        int pos = st->kind == ST_POS_DBL;
        if (dg_sla_parse_double(v, &d) || (pos ? d <= 0 : d < 0))
            return DG_ERR(DG_ERR_USAGE, "%s: validate.%s = '%s': expected a number %s 0", where, key, v,
                          pos ? ">" : ">=");
        *(double *)p = d;
        return DG_OK;
    }
    case ST_SIZES: {
        char *items[40];
        int n = dg_sla_split_list(v, items, 40);
        if (n <= 0 || n > 32)
            return DG_ERR(DG_ERR_USAGE,
                          "%s: validate.%s: expected 1 to 32 comma-separated sizes (e.g. 8, 64K, 1M)", where,
                          key);
        for (int k = 0; k < n; k++) {
            long long b;
            if (parse_size(items[k], &b))
                return DG_ERR(
                    DG_ERR_USAGE,
                    "%s: validate.%s: '%s' is not a size: expected bytes with an optional K, M or G "
                    "(binary), 1 byte to 64G",
                    where, key, items[k]);
            if (k && b <= s->set.comm_sizes[k - 1])
                return DG_ERR(DG_ERR_USAGE, "%s: validate.%s: sizes must increase ('%s' after %lld bytes)",
                              where, key, items[k], s->set.comm_sizes[k - 1]);
            s->set.comm_sizes[k] = b;
        }
        s->set.n_comm_sizes = n;
        return DG_OK;
    }
    case ST_CHECKS: {
        if (strlen(v) >= st->cap) return DG_ERR(DG_ERR_USAGE, "%s: validate.%s: value too long", where, key);
        char copy[512];
        snprintf(copy, sizeof copy, "%s", v);
        char *items[64];
        int n = dg_sla_split_list(copy, items, 64);
        if (n <= 0)
            return DG_ERR(DG_ERR_USAGE, "%s: validate.%s: expected 'all' or a list of checks", where, key);
        for (int k = 0; k < n; k++) {
            if (strcmp(items[k], "all") == 0) continue;
            char grp[64];
            snprintf(grp, sizeof grp, "%.*s", (int)strcspn(items[k], "."), items[k]);
            int ok = 0;
            for (int g = 0; g < 6; g++)
                ok |= strcmp(grp, k_groups[g]) == 0;
            if (!ok) {
                char sg[128];
                suggest(grp, k_groups, 6, "", sg, sizeof sg);
                return DG_ERR(
                    DG_ERR_USAGE,
                    "%s: validate.%s: unknown check '%s': expected 'all' or names starting with topology, "
                    "comm, compute, storage, train or health%s",
                    where, key, items[k], sg);
            }
        }
        snprintf(p, st->cap, "%s", v);
        return DG_OK;
    }
    case ST_BACKENDS: {
        char copy[64];
        snprintf(copy, sizeof copy, "%s", v);
        char *items[4];
        int n = dg_sla_split_list(copy, items, 4);
        int ok = n > 0;
        for (int k = 0; k < n && ok; k++)
            ok = strcmp(items[k], "auto") == 0
                     ? n == 1
                     : (strcmp(items[k], "mpi") == 0 || strcmp(items[k], "nccl") == 0);
        if (!ok || strlen(v) >= st->cap)
            return DG_ERR(DG_ERR_USAGE, "%s: validate.%s = '%s': expected auto, mpi, nccl or mpi,nccl", where,
                          key, v);
        snprintf(p, st->cap, "%s", v);
        return DG_OK;
    }
    }
    return DG_ERR(DG_ERR_RUNTIME, "unreachable setting kind");
}

/* ---------------------------------------------------------------- [node:TYPE] keys */

static dg_status_t parse_ref(const char *where, const char *key, char *v, dg_sla_ref_t *r, dg_dim_t want) {
    return dg_sla_ref_parse(where, key, v, want, r);
}

static dg_status_t set_node_key(dg_sla_t *s, int t, const char *where, int line, const char *key, char *v) {
    node_type_t *nt = &s->types[t];
    if (strncmp(key, "ref.", 4) == 0) {
        const char *metric = key + 4;
        const dg_validate_metric_t *m = find_metric(metric);
        if (!m) {
            const char *names[64];
            int n = 0;
            for (const dg_validate_metric_t *mm = dg_validate_metrics(); mm->name && n < 64; mm++)
                names[n++] = mm->name;
            char sg[160];
            suggest(metric, names, n, "ref.", sg, sizeof sg);
            return DG_ERR(DG_ERR_USAGE, "%s: unknown metric '%s'%s (docs/validation.md lists the metrics)",
                          where, key, sg);
        }
        for (int i = 0; i < s->n_refs; i++)
            if (s->refs[i].type == t && strcmp(s->refs[i].metric, metric) == 0)
                return DG_ERR(DG_ERR_USAGE, "%s: duplicate key %s in [node:%s] (first set at line %d)", where,
                              key, nt->name, s->refs[i].line);
        if (s->n_refs == SLA_MAX_REFS)
            return DG_ERR(DG_ERR_USAGE, "%s: more than %d references", where, SLA_MAX_REFS);
        ref_entry_t *e = &s->refs[s->n_refs];
        DG_TRY(parse_ref(where, key, v, &e->ref, m->dim));
        e->type = t;
        e->line = line;
        snprintf(e->metric, sizeof e->metric, "%s", metric);
        snprintf(e->ref.source, sizeof e->ref.source, "%.80s", where);
        memcpy(e->ref.node_type, nt->name, sizeof e->ref.node_type); /* both 64 bytes, NUL-terminated */
        s->n_refs++;
        return DG_OK;
    }
    int k;
    for (k = 0; k < NK_N; k++)
        if (strcmp(k_node_keys[k], key) == 0) break;
    if (k == NK_N) {
        char sg[128];
        suggest(key, k_node_keys, NK_N, "", sg, sizeof sg);
        return DG_ERR(
            DG_ERR_USAGE, "%s: unknown key '%s' in [node:%s]%s (expected %s, or ref.<metric>)", where, key,
            nt->name, sg,
            "match, gpus, gpu_model, numa_nodes, cores, nics, ib_nics, ranks_per_gpu, bind_near_gpu");
    }
    if (nt->set[k])
        return DG_ERR(DG_ERR_USAGE, "%s: duplicate key %s in [node:%s] (first set at line %d)", where, key,
                      nt->name, nt->set[k]);
    nt->set[k] = line;
    dg_sla_node_t *n = &nt->node;
    /* the count keys (their value parsed after the switch); the other keys are handled in it */
    dg_sla_count_t *const counts[NK_N] = {[NK_GPUS] = &n->gpus,
                                          [NK_NUMA] = &n->numa_nodes,
                                          [NK_CORES] = &n->cores,
                                          [NK_NICS] = &n->nics,
                                          [NK_IB_NICS] = &n->ib_nics};
    dg_sla_count_t *cnt = counts[k];
    switch (k) {
    case NK_MATCH: {
        if (t == 0)
            return DG_ERR(DG_ERR_USAGE,
                          "%s: [node:*] matches every host not matched by another type; 'match' is only "
                          "for named types",
                          where);
        char copy[1024];
        snprintf(copy, sizeof copy, "%s", v);
        char *items[SLA_MAX_MATCH + 1];
        int m = dg_sla_split_list(copy, items, SLA_MAX_MATCH);
        if (m <= 0)
            return DG_ERR(DG_ERR_USAGE,
                          "%s: match: expected 1 to %d comma-separated host globs (e.g. gpu-h200-*)", where,
                          SLA_MAX_MATCH);
        for (int j = 0; j < m; j++) {
            if (!*items[j] || strlen(items[j]) >= sizeof nt->match[0])
                return DG_ERR(DG_ERR_USAGE, "%s: match: empty or too long host glob", where);
            snprintf(nt->match[j], sizeof nt->match[j], "%s", items[j]);
        }
        nt->n_match = m;
        return DG_OK;
    }
    case NK_GPU_MODEL:
        if (!*v || strlen(v) >= sizeof n->gpu_model)
            return DG_ERR(DG_ERR_USAGE,
                          "%s: gpu_model: expected a glob on the GPU name (e.g. '*H200*') or 'any'", where);
        snprintf(n->gpu_model, sizeof n->gpu_model, "%s", strcasecmp(v, "any") == 0 ? "*" : v);
        return DG_OK;
    case NK_RANKS_PER_GPU:
        if (parse_int(v, 1, 1024, &n->ranks_per_gpu))
            return DG_ERR(DG_ERR_USAGE, "%s: ranks_per_gpu = '%s': expected an integer 1..1024", where, v);
        return DG_OK;
    case NK_BIND:
        if (parse_bool(v, &n->bind_near_gpu))
            return DG_ERR(DG_ERR_USAGE, "%s: bind_near_gpu = '%s': expected yes or no", where, v);
        return DG_OK;
    }
    if (parse_count(v, cnt))
        return DG_ERR(DG_ERR_USAGE, "%s: %s = '%s': expected 'any', a count N or '>=N'", where, key, v);
    return DG_OK;
}

/* ---------------------------------------------------------------- the parser */

typedef struct {
    dg_sla_t *s;
    const char *text;
    size_t len, pos;
    int lineno;
    dg_status_t err;
    int cur_type; /* -1 = [validate] */
    int in_section;
} parse_t;

static void fail(parse_t *p, dg_status_t s) {
    if (!p->err) p->err = s;
}

/* Sections are checked when their header is read, so an unknown or duplicate empty section is
 * reported too; the handler then only sees keys of known sections. */
static dg_status_t open_section(parse_t *p, const char *where, char *sec) {
    dg_sla_t *s = p->s;
    if (strcmp(sec, "validate") == 0) {
        p->cur_type = -1;
        return DG_OK;
    }
    if (strncmp(sec, "node:", 5) == 0) {
        char *name = dg_sla_trim(sec + 5);
        if (!*name || strlen(name) >= sizeof s->types[0].name)
            return DG_ERR(DG_ERR_USAGE, "%s: [node:%s]: expected a node type name of 1 to 63 characters",
                          where, name);
        for (const char *c = name; *c; c++)
            if (!(isalnum((unsigned char)*c) || *c == '-' || *c == '_' || *c == '.' ||
                  (*c == '*' && !c[1] && c == name)))
                return DG_ERR(DG_ERR_USAGE,
                              "%s: [node:%s]: node type names use letters, digits, '-', '_' and '.'", where,
                              name);
        for (int t = 0; t < s->n_types; t++)
            if (strcmp(s->types[t].name, name) == 0) {
                if (t == 0 && s->types[0].header_line == 0) { /* first explicit [node:*] */
                    s->types[0].header_line = p->lineno;
                    p->cur_type = 0;
                    return DG_OK;
                }
                return DG_ERR(DG_ERR_USAGE, "%s: duplicate section [node:%s] (first at line %d)", where, name,
                              s->types[t].header_line);
            }
        if (s->n_types == SLA_MAX_TYPES)
            return DG_ERR(DG_ERR_USAGE, "%s: more than %d node types", where, SLA_MAX_TYPES - 1);
        node_type_t *nt = &s->types[s->n_types];
        memset(nt, 0, sizeof *nt);
        snprintf(nt->name, sizeof nt->name, "%s", name);
        nt->header_line = p->lineno;
        p->cur_type = s->n_types++;
        return DG_OK;
    }
    static const char *const secs[] = {"validate", "node:"};
    char sg[128];
    suggest(sec, secs, 2, "", sg, sizeof sg);
    return DG_ERR(DG_ERR_USAGE, "%s: unknown section [%s]: expected [validate] or [node:TYPE]%s", where, sec,
                  sg);
}

static char *reader(char *str, int num, void *stream) {
    parse_t *p = stream;
    if (p->err || p->pos >= p->len) return NULL;
    const char *line;
    size_t n = dg_text_line(p->text, p->len, &p->pos, &line);
    p->lineno++;
    char where[1200];
    snprintf(where, sizeof where, "%s:%d", p->s->name, p->lineno);
    if (n + 2 > (size_t)num) {
        if (line[0] == ';' || line[0] == '#') {
            snprintf(str, (size_t)num, "#\n");
            return str;
        }
        fail(p, DG_ERR(DG_ERR_USAGE, "%s: line longer than %d characters", where, num - 2));
        return NULL;
    }
    if (n && line[0] == '[') {
        const char *close = memchr(line, ']', n);
        if (!close) {
            fail(p, DG_ERR(DG_ERR_USAGE,
                           "%s: malformed section header: expected '[validate]' or '[node:TYPE]'", where));
            return NULL;
        }
        char sec[256];
        size_t sl = (size_t)(close - line - 1);
        if (sl >= sizeof sec) sl = sizeof sec - 1;
        memcpy(sec, line + 1, sl);
        sec[sl] = 0;
        dg_status_t s = open_section(p, where, dg_sla_trim(sec));
        if (s) {
            fail(p, s);
            return NULL;
        }
        p->in_section = 1;
    }
    memcpy(str, line, n);
    str[n] = '\n';
    str[n + 1] = 0;
    return str;
}

static int on_key(void *user, const char *section, const char *name, const char *value) {
    parse_t *p = user;
    if (p->err) return 0;
    char where[1200];
    snprintf(where, sizeof where, "%s:%d", p->s->name, p->lineno);
    char key[256], val[1024];
    snprintf(key, sizeof key, "%s", name);
    snprintf(val, sizeof val, "%s", value);
    char *k = dg_sla_trim(key), *v = dg_sla_trim(val);
    size_t vl = strlen(v);
    if (vl >= 2 && ((v[0] == '"' && v[vl - 1] == '"') || (v[0] == '\'' && v[vl - 1] == '\''))) {
        v[vl - 1] = 0;
        v++;
    }
    if (!*section || !p->in_section) {
        fail(p, DG_ERR(DG_ERR_USAGE,
                       "%s: key '%s' is outside any section; expected [validate] or [node:TYPE] first", where,
                       k));
        return 0;
    }
    if (!*k) {
        fail(p, DG_ERR(DG_ERR_USAGE, "%s: malformed line: expected 'key = value'", where));
        return 0;
    }
    dg_status_t s;
    if (p->cur_type < 0) {
        int idx = -1;
        for (int i = 0; i < N_SETTINGS; i++)
            if (strcmp(k_settings[i].key, k) == 0) idx = i;
        if (idx >= 0 && p->s->setting_line[idx]) {
            fail(p, DG_ERR(DG_ERR_USAGE, "%s: duplicate key validate.%s (first set at line %d)", where, k,
                           p->s->setting_line[idx]));
            return 0;
        }
        s = set_setting(p->s, where, k, v);
        if (s == DG_OK && idx >= 0) p->s->setting_line[idx] = p->lineno;
    } else {
        s = set_node_key(p->s, p->cur_type, where, p->lineno, k, v);
    }
    if (s) {
        fail(p, s);
        return 0;
    }
    return 1;
}

dg_status_t dg_sla_parse(const char *name, const char *text, size_t len, dg_sla_t **out) {
    *out = NULL;
    dg_sla_t *s = dg_xcalloc(1, sizeof *s);
    snprintf(s->name, sizeof s->name, "%s", name);
    settings_defaults(&s->set);
    s->n_types = 1;
    snprintf(s->types[0].name, sizeof s->types[0].name, "*");
    node_defaults(&s->types[0].node);

    const char *nul = memchr(text, 0, len);
    if (nul) {
        int line = 1;
        for (const char *c = text; c < nul; c++)
            line += *c == '\n';
        free(s);
        return DG_ERR(DG_ERR_USAGE, "%s:%d: contains a NUL byte: expected a text (INI) file", name, line);
    }
    parse_t p = {.s = s, .text = text, .len = len, .cur_type = -1};
    int rc = ini_parse_stream(reader, &p, on_key, &p);
    if (p.err) {
        free(s);
        return p.err;
    }
    if (rc > 0) {
        free(s);
        return DG_ERR(DG_ERR_USAGE, "%s:%d: malformed line: expected '[section]' or 'key = value'", name, rc);
    }
    if (rc < 0) {
        free(s);
        return DG_ERR(DG_ERR_RUNTIME, "%s: libinih failed (%d)", name, rc);
    }
    /* named types inherit every key they do not set from [node:*], and need a match */
    for (int t = 1; t < s->n_types; t++) {
        node_type_t *nt = &s->types[t];
        if (nt->n_match == 0) {
            dg_status_t e =
                DG_ERR(DG_ERR_USAGE, "%s:%d: [node:%s] has no 'match' (host globs, e.g. match = gpu-*)", name,
                       nt->header_line, nt->name);
            free(s);
            return e;
        }
        dg_sla_node_t d = s->types[0].node, *n = &nt->node;
        if (!nt->set[NK_GPUS]) n->gpus = d.gpus;
        if (!nt->set[NK_NUMA]) n->numa_nodes = d.numa_nodes;
        if (!nt->set[NK_CORES]) n->cores = d.cores;
        if (!nt->set[NK_NICS]) n->nics = d.nics;
        if (!nt->set[NK_IB_NICS]) n->ib_nics = d.ib_nics;
        if (!nt->set[NK_GPU_MODEL]) snprintf(n->gpu_model, sizeof n->gpu_model, "%s", d.gpu_model);
        if (!nt->set[NK_RANKS_PER_GPU]) n->ranks_per_gpu = d.ranks_per_gpu;
        if (!nt->set[NK_BIND]) n->bind_near_gpu = d.bind_near_gpu;
    }
    *out = s;
    return DG_OK;
}

dg_status_t dg_sla_load(const char *path, dg_sla_t **out) {
    char *text = NULL;
    size_t len = 0;
    DG_TRY(dg_validate_read_file(path, &text, &len, 1 << 20));
    dg_status_t s = dg_sla_parse(path, text, len, out);
    free(text);
    return s;
}

dg_status_t dg_sla_set(dg_sla_t *s, const char *kv) {
    char where[320];
    snprintf(where, sizeof where, "--set '%.280s'", kv);
    const char *eq = strchr(kv, '=');
    if (!eq || strncmp(kv, "validate.", 9) != 0 || eq == kv + 9)
        return DG_ERR(DG_ERR_USAGE, "%s: expected validate.key=value", where);
    char key[128], val[1024];
    snprintf(key, sizeof key, "%.*s", (int)(eq - kv - 9), kv + 9);
    snprintf(val, sizeof val, "%s", eq + 1);
    return set_setting(s, where, dg_sla_trim(key), dg_sla_trim(val));
}
