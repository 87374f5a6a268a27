/* boot.c — MPI start-up (thread level, world and node communicators, gathered hosts / node ids /
 * local ranks), this rank's topology, GPU and binding, the rank-agreed failure protocol, and shutdown.
 */
#define _GNU_SOURCE
#include "mpi_boot_impl.h"

#include "dg_env.h"
#include "dg_json.h"

#include <limits.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

const char *dg_boot_thread_level_name(int level) {
    /* MPI fixes the order of the levels, not their values: a table searched, not indexed */
    static const struct {
        int level;
        const char *name;
    } levels[] = {{MPI_THREAD_SINGLE, "MPI_THREAD_SINGLE"},
                  {MPI_THREAD_FUNNELED, "MPI_THREAD_FUNNELED"},
                  {MPI_THREAD_SERIALIZED, "MPI_THREAD_SERIALIZED"},
                  {MPI_THREAD_MULTIPLE, "MPI_THREAD_MULTIPLE"}};
    for (size_t i = 0; i < sizeof levels / sizeof *levels; i++)
        if (levels[i].level == level) return levels[i].name;
    return "unknown";
}

/* The tree's one JSON escaper (dg_json.h): valid JSON and UTF-8 whatever bytes a host, path or
 * config value holds. */
void dg_boot_json_string(FILE *out, const char *s) {
    dg_json_fputs(out, s);
}

int dg_boot_launcher_rank(void) {
    static const char *vars[] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"};
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return atoi(v);
    }
    return 0;
}

dg_status_t dg_boot_start(const char *prog, int *argc, char ***argv, dg_boot_t **out) {
    *out = NULL;
    dg_status_t s = dg_env_check(dg_boot_launcher_rank() == 0 ? stderr : NULL);
    if (s != DG_OK) {
        fprintf(stderr, "%s: error on rank %d: %s\n", prog, dg_boot_launcher_rank(), dg_last_error());
        return s;
    }
    dg_boot_t *b = NULL;
    s = dg_boot_init(argc, argv, &b);
    if (s != DG_OK) {
        fprintf(stderr, "%s: error on rank %d (%s): %s\n", prog, b ? b->world_rank : -1, b ? b->host : "?",
                dg_last_error());
        dg_boot_finalize(b);
        return s;
    }
    *out = b;
    return DG_OK;
}

static int env_ranks_per_node(int64_t *raw) {
    *raw = dg_env_int("DG_BOOT_RANKS_PER_NODE"); /* 0 (default): the MPI shared-memory split */
    return (*raw < 0 || *raw > INT_MAX) ? -1 : (int)*raw;
}

static dg_status_t init_comms(dg_boot_t *b) {
    DG_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    DG_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &b->world));
    DG_MPI_CHECK(MPI_Comm_set_errhandler(b->world, MPI_ERRORS_RETURN));
    DG_MPI_CHECK(MPI_Comm_rank(b->world, &b->world_rank));
    DG_MPI_CHECK(MPI_Comm_size(b->world, &b->world_size));
    if (gethostname(b->host, sizeof b->host - 1) != 0) snprintf(b->host, sizeof b->host, "unknown");
    b->host[sizeof b->host - 1] = 0;

    int64_t raw = 0;
    int rpn = env_ranks_per_node(&raw);
    if (rpn < 0) /* same on every rank (one environment), so every rank returns it */
        return DG_ERR(DG_ERR_USAGE, "DG_BOOT_RANKS_PER_NODE='%lld': expected a positive integer",
                      (long long)raw);
    if (rpn > 0)
        DG_MPI_CHECK(MPI_Comm_split(b->world, b->world_rank / rpn, b->world_rank, &b->node));
    else
        DG_MPI_CHECK(
            MPI_Comm_split_type(b->world, MPI_COMM_TYPE_SHARED, b->world_rank, MPI_INFO_NULL, &b->node));
    DG_MPI_CHECK(MPI_Comm_set_errhandler(b->node, MPI_ERRORS_RETURN));
    DG_MPI_CHECK(MPI_Comm_rank(b->node, &b->local_rank));
    DG_MPI_CHECK(MPI_Comm_size(b->node, &b->local_size));

    /* node ids: the node leaders (local rank 0, the lowest world rank of the node) in world order */
    MPI_Comm leaders = MPI_COMM_NULL;
    DG_MPI_CHECK(MPI_Comm_split(b->world, b->local_rank == 0 ? 0 : MPI_UNDEFINED, b->world_rank, &leaders));
    int ids[2] = {0, 0};
    if (leaders != MPI_COMM_NULL) {
        int rc1 = MPI_Comm_rank(leaders, &ids[0]), rc2 = MPI_Comm_size(leaders, &ids[1]);
        MPI_Comm_free(&leaders);
        DG_MPI_CHECK(rc1);
        DG_MPI_CHECK(rc2);
    }
    DG_MPI_CHECK(MPI_Bcast(ids, 2, MPI_INT, 0, b->node));
    b->node_id = ids[0];
    b->n_nodes = ids[1];

    int n = b->world_size;
    b->hosts = dg_xcalloc((size_t)n, sizeof *b->hosts);
    b->node_ids = dg_xcalloc((size_t)n, sizeof *b->node_ids);
    b->local_ranks = dg_xcalloc((size_t)n, sizeof *b->local_ranks);
    DG_MPI_CHECK(MPI_Allgather(b->host, DG_HOST_MAX, MPI_CHAR, b->hosts, DG_HOST_MAX, MPI_CHAR, b->world));
    DG_MPI_CHECK(MPI_Allgather(&b->node_id, 1, MPI_INT, b->node_ids, 1, MPI_INT, b->world));
    DG_MPI_CHECK(MPI_Allgather(&b->local_rank, 1, MPI_INT, b->local_ranks, 1, MPI_INT, b->world));

    char ver[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    DG_MPI_CHECK(MPI_Get_library_version(ver, &len));
    ver[len < MPI_MAX_LIBRARY_VERSION_STRING ? len : MPI_MAX_LIBRARY_VERSION_STRING - 1] = 0;
    char *nl = strchr(ver, '\n');
    if (nl) *nl = 0;
    snprintf(b->mpi_version, sizeof b->mpi_version, "%s", ver);
    return DG_OK;
}

dg_status_t dg_boot_init(int *argc, char ***argv, dg_boot_t **out) {
    dg_boot_t *b = dg_xcalloc(1, sizeof *b);
    *out = b;
    b->world = MPI_COMM_NULL;
    b->node = MPI_COMM_NULL;
    b->gpu = -1;
    b->numa = -1;
    snprintf(b->bound_cpuset, sizeof b->bound_cpuset, "-");
    snprintf(b->bind_status, sizeof b->bind_status, "not set up");
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) {
        /* dgtrain's communication threads wait inside blocking MPI calls; with Open MPI's default
         * busy polling they take whole cores from the compute threads when ranks share cores
         * (measured: a 2-rank step on 2 cores 13 s instead of 0.1 s). Yielding costs nothing on
         * dedicated cores. Read by Open MPI at MPI_Init; a value set by the user or launcher wins. */
        setenv("OMPI_MCA_mpi_yield_when_idle", "1", 0);
        int rc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &b->provided_thread_level);
        if (rc != MPI_SUCCESS) return DG_ERR(DG_ERR_RUNTIME, "MPI_Init_thread failed (code %d)", rc);
        b->owns_mpi = 1;
    } else {
        MPI_Query_thread(&b->provided_thread_level);
    }
    if (b->provided_thread_level < MPI_THREAD_MULTIPLE)
        return DG_ERR(
            DG_ERR_RUNTIME,
            "the MPI library provides only %s; dgtrain needs MPI_THREAD_MULTIPLE (background checkpoint "
            "and health threads call MPI); hint: use an MPI built with thread support (Debian's Open MPI is)",
            dg_boot_thread_level_name(b->provided_thread_level));
    return init_comms(b);
}

dg_status_t dg_boot_topology(dg_boot_t *b, const dg_config_t *cfg) {
    if (b->have_topo) {
        dg_topo_free(&b->topo);
        hwloc_topology_destroy(b->hwtopo);
        b->hwtopo = NULL;
        b->have_topo = 0;
    }
    const char *xml = cfg && cfg->topology.xml[0] ? cfg->topology.xml : NULL;
    DG_TRY(dg_topo_load(xml, &b->topo, &b->hwtopo));
    b->have_topo = 1;
    const char *env = getenv("HWLOC_XMLFILE");
    snprintf(b->topo_source, sizeof b->topo_source, "%s", xml ? xml : env && *env ? env : "live");
    int live = hwloc_topology_is_thissystem(b->hwtopo);
    int bind_auto = !cfg || strcmp(cfg->topology.bind, "auto") == 0;

    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    dg_status_t s =
        dg_topo_choose(b->hwtopo, &b->topo, b->local_rank, b->local_size, bind_auto, &b->gpu, set, &b->numa);
    if (s == DG_OK) {
        char want[256];
        dg_boot_bitmap_list(want, sizeof want, set);
        if (bind_auto && live) {
            errno = 0;
            if (hwloc_set_cpubind(b->hwtopo, set, HWLOC_CPUBIND_PROCESS) == 0) {
                snprintf(b->bind_status, sizeof b->bind_status, "applied");
            } else {
                /* a restricted container may refuse: run unbound rather than not at all */
                snprintf(b->bind_status, sizeof b->bind_status, "failed: %s", strerror(errno));
                DG_LOG_WARN("could not bind to cpuset %s: %s; running unbound", want, strerror(errno));
            }
        } else if (bind_auto) {
            snprintf(b->bind_status, sizeof b->bind_status, "computed, not applied (XML)");
        } else if (live && hwloc_get_cpubind(b->hwtopo, set, HWLOC_CPUBIND_PROCESS) == 0) {
            snprintf(b->bind_status, sizeof b->bind_status, "none (as launched)");
            hwloc_nodeset_t ns = hwloc_bitmap_alloc();
            hwloc_cpuset_to_nodeset(b->hwtopo, set, ns);
            b->numa = hwloc_bitmap_weight(ns) == 1 ? hwloc_bitmap_first(ns) : -1;
            hwloc_bitmap_free(ns);
        } else {
            snprintf(b->bind_status, sizeof b->bind_status, "none");
        }
        dg_boot_bitmap_list(b->bound_cpuset, sizeof b->bound_cpuset, set);
    }
    hwloc_bitmap_free(set);
    if (s == DG_OK && b->gpu >= 0 && b->local_size > 1) {
        int nvis = 0;
        for (int g = 0; g < b->topo.n_gpus; g++)
            nvis += b->topo.gpus[g].cuda_index >= 0;
        if (b->local_size > nvis && b->local_rank == 0)
            DG_LOG_WARN(
                "%d ranks share %d GPU(s) on %s: fine with comm=mpi, NCCL refuses two ranks on one GPU",
                b->local_size, nvis, b->host);
    }
    return s;
}

/* ---- failure agreement ---- */

static int severity(dg_status_t s) {
    switch (s) {
    case DG_OK:
        return 0;
    case DG_ERR_SIGNAL:
    case DG_ERR_PAUSE: /* a deliberate stop after a complete checkpoint, like a signal */
        return 1;
    case DG_ERR_PEER:
        return 2;
    case DG_ERR_STORAGE: /* above a peer failure: requeueing into storage that cannot take checkpoints is
                            futile; below the errors a user must read first */
        return 3;
    case DG_ERR_USAGE:
        return 4;
    default:
        return 5; /* DG_ERR_RUNTIME and anything unexpected */
    }
}

/* Complete a request, or abort the job when peers do not show up in time: a rank that never reaches
 * the agreement point must not leave the others waiting forever. */
static dg_status_t wait_or_abort(dg_boot_t *b, MPI_Request *req, const char *what) {
    if (b->agree_timeout_s <= 0) {
        DG_MPI_CHECK(MPI_Wait(req, MPI_STATUS_IGNORE));
        return DG_OK;
    }
    double deadline = dg_now_s() + b->agree_timeout_s;
    for (;;) {
        int done = 0;
        DG_MPI_CHECK(MPI_Test(req, &done, MPI_STATUS_IGNORE));
        if (done) return DG_OK;
        if (dg_now_s() > deadline) {
            fprintf(stderr,
                    "dgtrain: error on rank %d (%s): not every rank reached the %s within %g s "
                    "(health.timeout_s); aborting the job\n",
                    b->world_rank, b->host, what, b->agree_timeout_s);
            fflush(stderr);
            MPI_Abort(b->world, DG_ERR_PEER);
            return DG_ERR(DG_ERR_PEER, "aborted: peers did not reach the %s", what);
        }
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
}

typedef struct {
    int code;
    char msg[1800];
} agree_msg_t;

dg_status_t dg_boot_agree(dg_boot_t *b, dg_status_t local) {
    DG_ASSERT(b && b->world != MPI_COMM_NULL);
    struct {
        int sev, rank;
    } mine = {severity(local), b->world_rank}, top;
    /* a failure this function already settled, handed back up by a nested caller */
    int settled = local != DG_OK && local == b->agreed_code && strcmp(dg_last_error(), b->agreed_msg) == 0;
    MPI_Request req;
    /* MAXLOC picks the highest severity and, among equals, the lowest rank */
    DG_MPI_CHECK(MPI_Iallreduce(&mine, &top, 1, MPI_2INT, MPI_MAXLOC, b->world, &req));
    DG_TRY(wait_or_abort(b, &req, "failure-agreement point"));
    if (top.sev == 0) return DG_OK;
    int counts[2] = {local != DG_OK, local != DG_OK && !settled}, sums[2] = {0, 0};
    DG_MPI_CHECK(MPI_Iallreduce(counts, sums, 2, MPI_INT, MPI_SUM, b->world, &req));
    DG_TRY(wait_or_abort(b, &req, "failure-agreement point"));
    int nfail = sums[0];
    if (sums[1] == 0 && b->agreed_code != DG_OK) /* every failing rank carries the settled failure */
        return dg_error_at(b->agreed_code, __FILE__, __LINE__, "%s", b->agreed_msg);

    agree_msg_t m;
    memset(&m, 0, sizeof m);
    if (b->world_rank == top.rank) {
        m.code = local;
        const char *e = dg_last_error();
        if (!*e) e = "failed (no message recorded)";
        if (local == DG_ERR_USAGE || !*dg_last_error_where())
            snprintf(m.msg, sizeof m.msg, "%s", e);
        else
            snprintf(m.msg, sizeof m.msg, "%s (at %s)", e, dg_last_error_where());
    }
    DG_MPI_CHECK(MPI_Ibcast(&m, (int)sizeof m, MPI_BYTE, top.rank, b->world, &req));
    DG_TRY(wait_or_abort(b, &req, "failure-agreement point"));

    char others[64] = "";
    if (nfail > 1) snprintf(others, sizeof others, " and %d other rank%s", nfail - 1, nfail > 2 ? "s" : "");
    const char *host = b->hosts ? b->hosts[top.rank] : "?";
    if (b->world_rank == 0 && m.code != DG_ERR_SIGNAL) {
        fprintf(stderr, "dgtrain: error on rank %d (%s)%s: %s\n", top.rank, host, others, m.msg);
        fflush(stderr);
    }
    DG_LOG_DEBUG("agreed status %d: rank %d (%s)%s: %s", m.code, top.rank, host, others, m.msg);
    dg_error_at(m.code, __FILE__, __LINE__, "rank %d (%s)%s: %s", top.rank, host, others, m.msg);
    b->agreed_code = m.code;
    snprintf(b->agreed_msg, sizeof b->agreed_msg, "%s", dg_last_error());
    return m.code;
}

void dg_boot_finalize(dg_boot_t *b) {
    if (!b) return;
    if (b->have_topo) {
        dg_topo_free(&b->topo);
        hwloc_topology_destroy(b->hwtopo);
    }
    free(b->hosts);
    free(b->node_ids);
    free(b->local_ranks);
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) {
        if (b->node != MPI_COMM_NULL) MPI_Comm_free(&b->node);
        if (b->world != MPI_COMM_NULL) MPI_Comm_free(&b->world);
        if (b->owns_mpi) MPI_Finalize();
    }
    free(b);
}
