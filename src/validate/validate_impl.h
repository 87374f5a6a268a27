/* validate_impl.h — private to src/validate: the suite context every check receives, the helpers the
 * checks share (agreement, gathers, quiet waits, rank/host naming, JSON text), the check entry points,
 * and the GPU helpers implemented in gpu.cu (built only with DG_HAVE_CUDA).
 */
#ifndef DG_VALIDATE_IMPL_H
#define DG_VALIDATE_IMPL_H

#include <mpi.h>
#include <stdarg.h>
#include <stdint.h>

#include "config.h"
#include "validate.h"

/* The suite context: the same on every rank except `rep` (rank 0 only). */
typedef struct vctx {
    dg_boot_t *b;
    dg_sla_t *sla;
    const dg_sla_settings_t *set;
    const dg_config_t *cfg; /* dgtrain config: topology source, binding, and the base of the training check */
    char run_dir[1024];
    char checks[512];  /* the selection ("all" or a list of name prefixes) */
    dg_vreport_t *rep; /* rank 0: the report being built; NULL elsewhere */
    int rank, size;
    int *type_of_rank;   /* [size] SLA node type of every world rank (by its host) */
    int *leader_of_node; /* [n_nodes] world rank of each node's local rank 0 */
    MPI_Comm leaders;    /* the local-rank-0 ranks, one per node (MPI_COMM_NULL on the others) */
    double timeout_s;    /* quiet waits give up (and abort the job, exit 3) after this long */
} vctx_t;

/* ---- growable text buffer (JSON details, messages) ---- */
typedef struct vbuf {
    char *s;
    size_t n, cap;
} vbuf_t;
void vbuf_printf(vbuf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void vbuf_json_str(vbuf_t *b, const char *s); /* quoted, escaped */
void vbuf_json_num(vbuf_t *b, double v);      /* null for NaN/inf */
void vbuf_free(vbuf_t *b);
/* The end of a check from the texts it gathered: a non-empty why fails it and is its message; otherwise a
 * non-empty note (NULL: none) is the message. det (a JSON object) becomes its details. All three are freed.
 */
void vc_conclude(dg_vcheck_t *k, vbuf_t *why, vbuf_t *note, vbuf_t *det);

/* ---- helpers (util.c) ---- */

/* Read a whole (text) file, at most max_bytes; DG_ERR_USAGE naming the path when it cannot be read. */
dg_status_t dg_validate_read_file(const char *path, char **text, size_t *len, size_t max_bytes);

/* 1 when check `name` is selected by ctx->checks (prefixes on '.' boundaries; "all"). */
int vc_selected(const vctx_t *c, const char *name);
/* 1 when the check `name` itself is selected (a selection of something below it does not count). */
int vc_selected_leaf(const vctx_t *c, const char *name);

/* Rank 0: add a check to the report (NULL on other ranks). */
dg_vcheck_t *vc_add(vctx_t *c, const char *name);
/* Rank 0: add a SKIP check with a message (no-op elsewhere). */
void vc_skip(vctx_t *c, const char *name, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* Barrier that sleeps instead of spinning (idle ranks must not steal the cores a measurement runs
 * on). Aborts the job (exit 3) with a message when not everyone arrives within ctx->timeout_s. */
dg_status_t vc_quiet_barrier(vctx_t *c, MPI_Comm comm, const char *what);
/* Wait for a request the same way. */
dg_status_t vc_quiet_wait(vctx_t *c, MPI_Request *req, const char *what);

/* Collective over the world: agree on the worst local status (DG_OK / failure) of a check's local
 * work. Returns the agreed status on every rank; on rank 0 `msg` gets "rank R (HOST)[, ...]: message"
 * for the failing ranks (identical messages grouped). */
dg_status_t vc_agree(vctx_t *c, dg_status_t local, char *msg, size_t cap);

/* "rank 3 (node2), rank 7 (node4)" for a list of world ranks (long lists shortened). */
void vc_fmt_ranks(const vctx_t *c, const int *ranks, int n, char *buf, size_t cap);
/* When wrong > 0, the reason "N <what> <ranks>" appended to why (after "; " when it holds one already). */
void vc_why_wrong(const vctx_t *c, vbuf_t *why, long long wrong, const char *what, const int *ranks, int n);
/* "node 1 (node2, ranks from 4)" for nodes, by node id. */
void vc_fmt_nodes(const vctx_t *c, const int *nodes, int n, char *buf, size_t cap);
/* Every node of the job, as vc_fmt_nodes (for checks whose result belongs to the whole allocation). */
void vc_fmt_all_nodes(const vctx_t *c, char *buf, size_t cap);

/* Gather `n` doubles from every world rank to rank 0 (all[size * n], rank-major; NULL on others). */
dg_status_t vc_gather_doubles(vctx_t *c, const double *local, int n, double *all);

/* The reference that applies to a measurement made by ranks of several node types: the loosest one
 * (lowest lower bound) among those types that have one. types[n] are SLA type indices. */
const dg_sla_ref_t *vc_group_ref(const vctx_t *c, const char *metric, const int *types, int n);

/* Median of v[n] (v is reordered). */
double vc_median(double *v, int n);

/* Human value with a unit: "1.23 GB/s", "456 us". */
void vc_fmt_value(char *buf, size_t cap, double canonical, dg_dim_t dim);

/* Rank 0: write the JSON and JUnit reports of what has run so far. */
void vc_write_reports(vctx_t *c);

/* ---- checks (each collective over the world; DG_OK unless the suite cannot go on) ---- */
dg_status_t vc_check_topology(vctx_t *c);
dg_status_t vc_check_comm(vctx_t *c);
dg_status_t vc_check_compute(vctx_t *c);
dg_status_t vc_check_storage(vctx_t *c);
dg_status_t vc_check_train(vctx_t *c);
dg_status_t vc_check_health(vctx_t *c);

#ifdef DG_HAVE_CUDA
#include "validate_gpu.h"
#endif

#endif /* DG_VALIDATE_IMPL_H */
