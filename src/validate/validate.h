/* validate.h — the site-admin validation suite (docs/validation.md): qualify a cluster, or a repaired node,
 * for dgtrain. `mpirun -n N dgvalidate validation/sla.ini` (or `sbatch slurm/validate.sh`) runs every check
 * with what this build has, compares each measurement with the reference of the node type it ran on,
 * and writes a table (stdout), <run dir>/validation.json and <run dir>/validation-junit.xml.
 *
 * Checks (docs/validation.md explains each and how its thresholds were chosen):
 *   topology.{devices,binding,gpu_sharing,versions}    what hwloc sees vs the node type; binding; versions
 *   comm.<mpi|nccl>.<op>.<intra|inter|world>           nccl-tests algbw/busbw sweep + data check
 *   compute.{cpu_gemm,cpu_stream,gpu_gemm,gpu_stream}[.stragglers]
 *   storage.{write,read,metadata}                      parallel-HDF5 checkpoint I/O; create/rename latency
 *   train.{match,resume}                               K-rank run vs 1-rank reference; checkpoint + resume
 *   health.{rtt,monitor}                               heartbeat round trips; the heartbeat monitor
 *
 * The SLA file (validation/sla.ini) holds the suite settings ([validate]) and one section per node type
 * ([node:TYPE], plus [node:*] inherited by all): which hosts it matches, what hardware it must have, and
 * ReFrame-style references `ref.<metric> = target, lower, upper, unit` (lower/upper are fractions of the
 * target, e.g. -0.2 = "at least 80% of target"; `none` = unbounded).
 *
 * Exit codes (agreed by every rank): 0 every check passed or was skipped; 1 bad input (command line,
 * SLA file); 2 a check harness failed at run time (an ERROR verdict: internal, MPI, CUDA); 3 the job
 * was aborted because a peer failed or a collective timed out; 4 at least one check FAILED.
 */
#ifndef DG_VALIDATE_H
#define DG_VALIDATE_H

#include <stddef.h>
#include <stdio.h>

#include "dg_common.h"
#include "dg_sla_ref.h"
#include "mpi_boot.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { DG_VALIDATE_EXIT_FAILED = 4 }; /* at least one check FAILED (no ERROR) */

/* ---------------------------------------------------------------- the SLA file */

/* Units, dimensions and the ReFrame-style reference (dg_sla_ref_t: target, lower, upper, unit) with its
 * bounds, check and text are src/sla/dg_sla_ref.h, shared with the training objectives ([sla]). */

/* The factor that converts a value in `unit` to its canonical unit (dg_sla_unit_factor). */
double dg_validate_unit_factor(const char *unit, dg_dim_t *dim);

/* Expected count: "any", "N" or ">=N". */
typedef struct dg_sla_count {
    int any;
    int at_least; /* 1: value >= n; 0: value == n */
    int n;
} dg_sla_count_t;
int dg_sla_count_ok(const dg_sla_count_t *c, int value);
void dg_sla_count_format(const dg_sla_count_t *c, char *buf, size_t cap);

typedef struct dg_sla dg_sla_t;

/* Parse SLA text (`name` is what error messages call it). Bad input: DG_ERR_USAGE with a one-line
 * message "NAME:LINE: ..." naming the key and what was expected (unknown keys get a suggestion). */
dg_status_t dg_sla_parse(const char *name, const char *text, size_t len, dg_sla_t **out);
/* Read and parse a file (DG_ERR_USAGE when it cannot be read). */
dg_status_t dg_sla_load(const char *path, dg_sla_t **out);
void dg_sla_free(dg_sla_t *s);

/* Node types: index 0 is "*" (the defaults, matching every host no other type matches); the others in
 * file order. dg_sla_node_type returns the first type whose `match` globs match `host`, else 0. */
int dg_sla_n_types(const dg_sla_t *s);
const char *dg_sla_type_name(const dg_sla_t *s, int type);
int dg_sla_node_type(const dg_sla_t *s, const char *host);

/* The reference for `metric` for node type `type` (inherited from [node:*] when the type has none),
 * or NULL when there is none. */
const dg_sla_ref_t *dg_sla_ref(const dg_sla_t *s, int type, const char *metric);

/* The metrics a reference can name (ref.<metric>), with their dimension: NULL-terminated. */
typedef struct dg_validate_metric {
    const char *name;
    dg_dim_t dim;
    const char *doc;
} dg_validate_metric_t;
const dg_validate_metric_t *dg_validate_metrics(void);

/* Hardware expectations of a node type (inherited from [node:*] key by key). */
typedef struct dg_sla_node {
    dg_sla_count_t gpus, numa_nodes, cores, nics, ib_nics;
    char gpu_model[128]; /* fnmatch glob on the GPU name; "" or "*" = any */
    int ranks_per_gpu;   /* most ranks allowed on one GPU */
    int bind_near_gpu;   /* a rank with a GPU must be bound to cores near it */
} dg_sla_node_t;
const dg_sla_node_t *dg_sla_node(const dg_sla_t *s, int type);

/* Suite settings ([validate]). */
typedef struct dg_sla_settings {
    char checks[512];          /* "all" or comma-separated check-name prefixes */
    double straggler_fraction; /* a rank below this fraction of its node type's median is named */
    char comm_backends[32];    /* auto | mpi | nccl | mpi,nccl */
    long long comm_sizes[32];  /* bytes (nccl-tests "size") */
    int n_comm_sizes;
    int comm_iters, comm_warmup;
    double comm_timeout_s;
    int cpu_gemm_n, cpu_gemm_reps;
    double cpu_stream_mb;
    int cpu_stream_reps;
    int gpu_gemm_n, gpu_gemm_reps;
    double gpu_stream_mb;
    int gpu_stream_reps;
    char storage_dir[1024]; /* "" = <run dir>/storage */
    double storage_mb;      /* total over all ranks */
    int storage_meta_files; /* per rank */
    int rtt_reps;
    double heartbeat_s;
    int train_steps, train_micro_batch, train_global_batch; /* global_batch 0 = micro_batch x world */
    double train_loss_rtol, train_resume_rtol;
    char train_config[1024]; /* optional dgtrain INI the training check starts from */
} dg_sla_settings_t;
const dg_sla_settings_t *dg_sla_settings(const dg_sla_t *s);
const char *dg_sla_name(const dg_sla_t *s);

/* Apply "validate.key=value" overrides (the --set of dgvalidate). */
dg_status_t dg_sla_set(dg_sla_t *s, const char *key_eq_value);

/* ---------------------------------------------------------------- results and reports */

typedef enum {
    DG_VERDICT_PASS = 0,
    DG_VERDICT_SKIP = 1,
    DG_VERDICT_FAIL = 2,
    DG_VERDICT_ERROR = 3
} dg_verdict_t;
const char *dg_verdict_name(dg_verdict_t v); /* "PASS" ... */

typedef struct dg_vcheck {
    char name[96];  /* e.g. "comm.mpi.allreduce.intra" */
    char group[32]; /* the first component: "comm" */
    dg_verdict_t verdict;
    int has_value;
    double value;        /* canonical units (B/s, FLOP/s, s) or a plain number */
    char unit[16];       /* canonical unit of value, "" for a plain number */
    char measured[192];  /* table text */
    char reference[192]; /* table text ("-" when none) */
    char message[2048];  /* why it failed / was skipped / errored; names ranks and hosts */
    double seconds;
    char *details; /* JSON object text (owned) or NULL */
} dg_vcheck_t;

typedef struct dg_vreport {
    dg_vcheck_t *checks;
    int n, cap;
    /* run description for the reports */
    char sla[1024], run_dir[1024], started[32], hosts[4096];
    int world_size, n_nodes;
    double seconds;
    int complete;     /* 0 while the suite is still running (reports written between checks) */
    int aborted_exit; /* nonzero: the suite stopped early with this exit code */
    char aborted_msg[1024];
} dg_vreport_t;

void dg_vreport_init(dg_vreport_t *r);
void dg_vreport_destroy(dg_vreport_t *r);
/* Append a check (zeroed, name and group set, verdict PASS); the pointer is valid until the next add. */
dg_vcheck_t *dg_vreport_add(dg_vreport_t *r, const char *name);
/* Set a check's details to a copy of `json_object`. */
void dg_vcheck_set_details(dg_vcheck_t *c, const char *json_object);

/* The exit code the report implies (see the header comment). */
int dg_vreport_exit_code(const dg_vreport_t *r);
/* The table (check, measured, reference, verdict), then one "FAIL name: message" line per failed or
 * errored check and a summary line. */
void dg_vreport_print_table(const dg_vreport_t *r, FILE *out);
/* Write the JSON report / the JUnit XML (one testcase per check) atomically. DG_ERR_RUNTIME naming the
 * path on I/O failure. */
dg_status_t dg_vreport_write_json(const dg_vreport_t *r, const char *path);
dg_status_t dg_vreport_write_junit(const dg_vreport_t *r, const char *path);

/* ---------------------------------------------------------------- the suite */

/* nccl-tests' bus-bandwidth factor for `op` ("allreduce", "allgather", "reduce_scatter", "broadcast",
 * "sendrecv") on n ranks: busbw = algbw * factor. -1 for an unknown op. */
double dg_validate_bus_factor(const char *op, int n);

typedef struct dg_validate_opts {
    const char *sla_path; /* the SLA file (required) */
    const char *run_dir;  /* NULL or "": runs/validate-<UTC time> */
    const char *checks;   /* NULL: the SLA's [validate] checks */
    int nsets;            /* --set overrides: "validate.key=value" or dgtrain "section.key=value" */
    const char *const *sets;
    const char *topology_xml; /* NULL: config/topology from the dgtrain defaults */
} dg_validate_opts_t;

/* Run the suite: collective over boot->world. Rank 0 prints the table and writes the reports. Returns
 * the exit code every rank agrees on (0, 1, 2, 3 or 4, see above); bad input is reported on stderr by
 * rank 0 as one line "dgvalidate: error: ...". */
int dg_validate_run(dg_boot_t *boot, const dg_validate_opts_t *opts);

#ifdef __cplusplus
}
#endif
#endif /* DG_VALIDATE_H */
