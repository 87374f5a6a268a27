/* test_boot.c — MPI boot at any world size (ctest runs it at 1, 2 and 4 ranks): thread level, world
 * and node communicators, gathered hosts / node ids / local ranks (also with simulated nodes via
 * DG_BOOT_RANKS_PER_NODE), live binding (applied to the OS, disjoint shares of the cores), the
 * report, and the failure-agreement rules.
 *
 *   mpiexec -n K test_boot K [fakenodes]     boot, split, gather, binding, report, agreement
 *   mpiexec -n K test_boot K hang            rank 1 never reaches the agreement point: the others must
 *                                            abort the job after agree_timeout_s (exit code 3)
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "dg_check.h"
#include "mpi_boot.h"

static int g_rank;

static void test_boot(dg_boot_t *b, int want_size, int rpn) {
    CHECK(b->world_size == want_size);
    CHECK(b->provided_thread_level == MPI_THREAD_MULTIPLE);
    CHECK(strlen(b->mpi_version) > 0 && strchr(b->mpi_version, '\n') == NULL);
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    CHECK(strcmp(b->host, host) == 0);
    int n = b->world_size;
    if (rpn == 0) { /* one real node */
        CHECK(b->n_nodes == 1 && b->node_id == 0);
        CHECK(b->local_size == n && b->local_rank == b->world_rank);
    } else {
        CHECK(b->n_nodes == (n + rpn - 1) / rpn);
        CHECK(b->node_id == b->world_rank / rpn);
        CHECK(b->local_rank == b->world_rank % rpn);
        CHECK(b->local_size == (b->node_id == b->n_nodes - 1 && n % rpn ? n % rpn : rpn));
    }
    for (int r = 0; r < n; r++) {
        CHECK(strcmp(b->hosts[r], host) == 0);
        CHECK(b->node_ids[r] == (rpn ? r / rpn : 0));
        CHECK(b->local_ranks[r] == (rpn ? r % rpn : r));
    }
    /* the communicators work and return errors instead of aborting */
    int sum = 0, one = 1, lsum = 0;
    CHECK(MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, b->world) == MPI_SUCCESS && sum == n);
    CHECK(MPI_Allreduce(&one, &lsum, 1, MPI_INT, MPI_SUM, b->node) == MPI_SUCCESS && lsum == b->local_size);
    int eh_bad = MPI_Bcast(&one, 1, MPI_INT, n + 5, b->world); /* invalid root: an error code, not an abort */
    CHECK(eh_bad != MPI_SUCCESS);
}

/* live binding: applied to the OS, inside the allowed set, and the local ranks' shares are disjoint
 * and cover the cores (one rank per core at most when there are enough cores) */
static void test_binding(dg_boot_t *b) {
    dg_config_t cfg;
    CHECK(dg_config_load(&cfg, NULL, 0, NULL) == DG_OK);
    CHECK(dg_boot_topology(b, &cfg) == DG_OK);
    CHECK(strcmp(b->topo_source, "live") == 0);
    CHECK(b->topo.n_gpus == 0 ? b->gpu == -1 : b->gpu >= 0);
    CHECK(strcmp(b->bind_status, "applied") == 0);
    hwloc_bitmap_t mine = hwloc_bitmap_alloc(), os = hwloc_bitmap_alloc();
    CHECK(hwloc_bitmap_list_sscanf(mine, b->bound_cpuset) == 0);
    CHECK(!hwloc_bitmap_iszero(mine));
    CHECK(hwloc_bitmap_isincluded(mine, hwloc_topology_get_allowed_cpuset(b->hwtopo)));
    cpu_set_t cs;
    CPU_ZERO(&cs);
    CHECK(sched_getaffinity(0, sizeof cs, &cs) == 0);
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &cs)) hwloc_bitmap_set(os, (unsigned)c);
    CHECK(hwloc_bitmap_isequal(mine, os)); /* the kernel has the binding we report */

    char all[64][256];
    int ls = b->local_size > 64 ? 64 : b->local_size;
    CHECK(MPI_Allgather(b->bound_cpuset, 256, MPI_CHAR, all, 256, MPI_CHAR, b->node) == MPI_SUCCESS);
    int ncores = hwloc_get_nbobjs_inside_cpuset_by_type(
        b->hwtopo, hwloc_topology_get_allowed_cpuset(b->hwtopo), HWLOC_OBJ_CORE);
    hwloc_bitmap_t uni = hwloc_bitmap_alloc(), other = hwloc_bitmap_alloc();
    for (int q = 0; q < ls; q++) {
        hwloc_bitmap_list_sscanf(other, all[q]);
        if (ls <= ncores)
            for (int p = 0; p < q; p++) {
                hwloc_bitmap_t prev = hwloc_bitmap_alloc();
                hwloc_bitmap_list_sscanf(prev, all[p]);
                CHECK(!hwloc_bitmap_intersects(prev, other));
                hwloc_bitmap_free(prev);
            }
        else /* oversubscribed: exactly one core each */
            CHECK(hwloc_get_nbobjs_inside_cpuset_by_type(b->hwtopo, other, HWLOC_OBJ_CORE) == 1);
        hwloc_bitmap_or(uni, uni, other);
    }
    if (b->n_nodes == 1 && ls == b->local_size) /* every core of the node is used by someone */
        CHECK(hwloc_get_nbobjs_inside_cpuset_by_type(b->hwtopo, uni, HWLOC_OBJ_CORE) == ncores);
    hwloc_bitmap_free(uni);
    hwloc_bitmap_free(other);

    /* bind = none reports the binding as it is (here: the one just applied) */
    const char *none[] = {"topology.bind=none"};
    CHECK(dg_config_load(&cfg, NULL, 1, none) == DG_OK);
    CHECK(dg_boot_topology(b, &cfg) == DG_OK);
    CHECK(strcmp(b->bind_status, "none (as launched)") == 0);
    hwloc_bitmap_list_sscanf(os, b->bound_cpuset);
    CHECK(hwloc_bitmap_isequal(mine, os));
    hwloc_bitmap_free(mine);
    hwloc_bitmap_free(os);

    /* the report: rank 0 prints one line per rank and a line per node */
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    CHECK(dg_boot_report(b, 0, f) == DG_OK);
    fclose(f);
    if (b->world_rank == 0) {
        int lines = 0;
        for (char *p = buf; *p; p++)
            lines += *p == '\n';
        CHECK(strncmp(buf, "world: ", 7) == 0);
        CHECK(lines >= 2 + b->world_size + b->n_nodes);
        CHECK(strstr(buf, "MPI_THREAD_MULTIPLE") != NULL);
    } else {
        CHECK(len == 0);
    }
    free(buf);
}

/* every rank passes codes[rank]; all must get `want` and the message must name rank `who` */
static void agree_case(dg_boot_t *b, const int *codes, int ncodes, dg_status_t want, int who, int nother) {
    int r = b->world_rank;
    dg_status_t local = r < ncodes ? codes[r] : DG_OK;
    if (local != DG_OK)
        DG_ERR(local, "local failure %d on rank %d", local, r);
    else
        dg_clear_error();
    dg_status_t got = dg_boot_agree(b, local);
    CHECK(got == want);
    if (want == DG_OK) return;
    char prefix[512];
    if (nother)
        snprintf(prefix, sizeof prefix, "rank %d (%s) and %d other rank%s: local failure %d on rank %d", who,
                 b->hosts[who], nother, nother > 1 ? "s" : "", want, who);
    else
        snprintf(prefix, sizeof prefix, "rank %d (%s): local failure %d on rank %d", who, b->hosts[who], want,
                 who);
    CHECK(strncmp(dg_last_error(), prefix, strlen(prefix)) == 0);
    if (strncmp(dg_last_error(), prefix, strlen(prefix)) != 0)
        fprintf(stderr, "  rank %d got '%s'\n  want prefix '%s'\n", r, dg_last_error(), prefix);
    /* a runtime failure names its source location; a usage error does not */
    CHECK((want == DG_ERR_USAGE) == (strstr(dg_last_error(), "(at test_boot.c:") == NULL));
    /* handing the agreed failure back up and agreeing again changes nothing */
    char copy[2048];
    snprintf(copy, sizeof copy, "%s", dg_last_error());
    CHECK(dg_boot_agree(b, got) == want);
    CHECK(strcmp(dg_last_error(), copy) == 0);
}

static void test_agree(dg_boot_t *b) {
    int n = b->world_size;
    int ok[1] = {0};
    agree_case(b, ok, 1, DG_OK, 0, 0);
    int only0[1] = {DG_ERR_USAGE};
    agree_case(b, only0, 1, DG_ERR_USAGE, 0, 0);
    int all1[64];
    for (int i = 0; i < 64; i++)
        all1[i] = DG_ERR_USAGE;
    agree_case(b, all1, 64, DG_ERR_USAGE, 0, n - 1);
    if (n >= 2) {
        int one[2] = {0, DG_ERR_USAGE};
        agree_case(b, one, 2, DG_ERR_USAGE, 1, 0);
        int sig[2] = {DG_ERR_SIGNAL, DG_ERR_PEER};
        agree_case(b, sig, 2, DG_ERR_PEER, 1, 1);
        int sig_only[2] = {0, DG_ERR_SIGNAL};
        agree_case(b, sig_only, 2, DG_ERR_SIGNAL, 1, 0);
    }
    if (n >= 4) {
        int mixed[4] = {0, DG_ERR_PEER, DG_ERR_RUNTIME, DG_ERR_USAGE};
        agree_case(b, mixed, 4, DG_ERR_RUNTIME, 2, 2);
        int peer_usage[4] = {DG_ERR_PEER, DG_ERR_SIGNAL, 0, DG_ERR_USAGE};
        agree_case(b, peer_usage, 4, DG_ERR_USAGE, 3, 2);
    }
    /* a fresh failure after an agreed one is reported again, with its own message */
    int again[1] = {DG_ERR_USAGE};
    agree_case(b, again, 1, DG_ERR_USAGE, 0, 0);
}

int main(int argc, char **argv) {
    dg_boot_t *b = NULL;
    if (argc < 2) {
        fprintf(stderr, "usage: test_boot WORLD_SIZE [fakenodes|hang]\n");
        return 2;
    }
    int want = atoi(argv[1]);
    const char *mode = argc > 2 ? argv[2] : "";
    int rpn = 0;
    if (strcmp(mode, "fakenodes") == 0) {
        setenv("DG_BOOT_RANKS_PER_NODE", "2", 1);
        rpn = 2;
    }
    dg_status_t s = dg_boot_init(&argc, &argv, &b);
    if (s != DG_OK) {
        fprintf(stderr, "boot failed: %s\n", dg_last_error());
        dg_boot_finalize(b);
        return 1;
    }
    g_rank = b->world_rank;
    dg_check_rank = g_rank;
    if (strcmp(mode, "hang") == 0) {
        b->agree_timeout_s = 1.5;
        if (b->world_rank == 1) sleep(60); /* never arrives in time */
        dg_boot_agree(b, DG_OK);
        fprintf(stderr, "rank %d: agreement returned although rank 1 never came\n", b->world_rank);
        dg_boot_finalize(b);
        return 0; /* the test expects exit code 3 from the abort */
    }
    test_boot(b, want, rpn);
    if (rpn == 0) test_binding(b);
    test_agree(b);
    int fails = dg_fails, total = 0;
    MPI_Allreduce(&fails, &total, 1, MPI_INT, MPI_SUM, b->world);
    if (b->world_rank == 0)
        printf("boot tests at %d ranks%s: %d checks on rank 0, %d failed on all ranks\n", b->world_size,
               rpn ? " (2 ranks per simulated node)" : "", dg_checks, total);
    dg_boot_finalize(b);
    return total ? 1 : 0;
}
