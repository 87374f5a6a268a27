/* test_planner_measure.c — the planner's alpha-beta estimates against collectives measured through dgtrain's
 * comm layer (the mpi backend: what training uses) on this machine's MPI (CPU ranks, shared memory). Run
 * under mpiexec with 2 (or more) ranks on one node. Raw MPI times are printed beside them.
 *
 * Documented tolerance: the estimate must be within a factor of 10 of the measured minimum over 40 runs
 * (up to 3 rounds of 40 while it is not: a busy shared machine can slow a whole round down),
 * either way. The defaults table describes a dedicated socket; a CI machine with 2 cores shared by other work
 * can be several times slower or faster than that, so the check only catches estimates that are wrong in kind
 * (units, a missing factor of n, a latency term that dominates when it should not). The measured and
 * estimated figures are printed so the ratio can be read in the test log. */
#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "planner.h"

#define FACTOR 10.0

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    dg_link_param_t links[DG_LINK_NCLASS];
    dg_cluster_default_links(links, 0);
    dg_comm_opts_t co;
    dg_comm_opts_default(&co);
    co.name = "planner-measure";
    co.timeout_s = 60;
    dg_comm_t *comm = NULL;
    if (dg_comm_create_mpi(MPI_COMM_WORLD, &co, &comm) != DG_OK) {
        fprintf(stderr, "dg_comm_create_mpi: %s\n", dg_last_error());
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    /* A machine so busy that MPI's own 8-byte all-reduce takes tens of microseconds (its processes
     * are being descheduled) measures the load, not MPI: say so and skip (exit 77) rather than judge. */
    {
        double floor = 1e9, x = 1, y;
        for (int it = 0; it < 300; it++) {
            double t0 = MPI_Wtime();
            MPI_Allreduce(&x, &y, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
            double dt = MPI_Wtime() - t0, mx;
            MPI_Allreduce(&dt, &mx, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (mx < floor) floor = mx;
        }
        if (floor > 50e-6) {
            if (rank == 0)
                printf(
                    "SKIP: the fastest 8-byte all-reduce took %.1f us (> 50 us): the machine is too loaded "
                    "to compare estimates with measurements\n",
                    floor * 1e6);
            dg_comm_free(comm);
            MPI_Finalize();
            return 77;
        }
    }
    const size_t sizes[] = {1 << 16, 1 << 20, 1 << 22};
    int fails = 0;
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        size_t bytes = sizes[si], count = bytes / 4;
        float *a = malloc(bytes), *b = malloc(bytes);
        for (size_t i = 0; i < count; i++)
            a[i] = (float)(i % 97) * 0.5f + rank;
        for (int kind = 0; kind < 3; kind++) {
            enum { ITERS = 40, ROUNDS = 3 };
            double t[ITERS], traw[ITERS], best = INFINITY, best_raw = INFINITY;
            size_t per = count / n;
            double est =
                dg_plan_collective_s(kind, (double)(count / n) * n * 4, n, links[DG_LINK_SAME_SOCKET]);
            /* up to ROUNDS rounds of ITERS runs while the fastest is out of bounds: a busy shared machine
             * can slow a whole round down (every rank's decision is the same: the times are MPI_MAX'd) */
            for (int round = 0; round < ROUNDS; round++) {
                for (int it = -2; it < ITERS; it++) {
                    for (int raw = 0; raw < 2; raw++) {
                        MPI_Barrier(MPI_COMM_WORLD);
                        double t0 = MPI_Wtime();
                        dg_status_t s = DG_OK;
                        if (raw) {
                            if (kind == 0)
                                MPI_Allreduce(a, b, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                            else if (kind == 1)
                                MPI_Allgather(a, (int)per, MPI_FLOAT, b, (int)per, MPI_FLOAT, MPI_COMM_WORLD);
                            else
                                MPI_Reduce_scatter_block(a, b, (int)per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                        } else {
                            if (kind == 0)
                                s = dg_comm_allreduce(comm, a, b, count, DG_F32, DG_RED_SUM);
                            else if (kind == 1)
                                s = dg_comm_allgather(comm, a, b, per, DG_F32);
                            else
                                s = dg_comm_reduce_scatter(comm, a, b, per, DG_F32, DG_RED_SUM);
                        }
                        if (s != DG_OK) {
                            fprintf(stderr, "collective failed: %s\n", dg_last_error());
                            MPI_Abort(MPI_COMM_WORLD, 2);
                        }
                        double dt = MPI_Wtime() - t0, mx;
                        MPI_Allreduce(&dt, &mx, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
                        if (it >= 0) (raw ? traw : t)[it] = mx;
                    }
                }
                qsort(t, ITERS, sizeof t[0], cmp_d);
                qsort(traw, ITERS, sizeof traw[0], cmp_d);
                best = fmin(best, t[0]); /* the fastest run: other load on a shared machine only adds time */
                best_raw = fmin(best_raw, traw[0]);
                if (best / est <= FACTOR && best / est >= 1.0 / FACTOR) break;
            }
            double meas = best;
            traw[0] = best_raw;
            double ratio = meas / est;
            /* All three are judged: the comm layer's reduce-scatter is its own ring (the planner's model);
             * the raw column shows Open MPI 4.1's MPI_Reduce_scatter_block, several times slower here. */
            int ok = ratio <= FACTOR && ratio >= 1.0 / FACTOR;
            if (rank == 0)
                printf("%-14s %9zu bytes, %d ranks: dg_comm %9.1f us (raw MPI %9.1f us), estimated %9.1f us, "
                       "ratio %6.2f %s\n",
                       kind == 0   ? "all-reduce"
                       : kind == 1 ? "all-gather"
                                   : "reduce-scatter",
                       bytes, n, meas * 1e6, traw[0] * 1e6, est * 1e6, ratio, ok ? "ok" : "OUT OF BOUNDS");
            fails += !ok;
        }
        free(a);
        free(b);
    }
    if (rank == 0)
        printf("%s: %d estimate(s) outside a factor of %.0f\n", fails ? "FAILED" : "OK", fails, FACTOR);
    dg_comm_free(comm);
    MPI_Finalize();
    return fails ? 1 : 0;
}
