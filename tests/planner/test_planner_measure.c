/* test_planner_measure.c — the planner's alpha-beta estimates against collectives measured through dgtrain's
 * comm layer (the mpi backend: what training uses) on this machine's MPI (CPU ranks, shared memory). Run
 * under mpiexec with 2 (or more) ranks on one node. Raw MPI times are printed beside them.
 *
 * Two verdicts, neither of which the load on a shared machine can trip (docs/reliability.md, "The test
 * suite itself"):
 *   - the model: the planner's formula (dg_plan_collective_s) fed with link parameters measured in the
 *     same loop — an 8-byte and a one-ring-step MPI_Sendrecv between ring neighbours, interleaved with
 *     the collective — must be within a factor of 10 of the fastest collective, either way. Load slows
 *     the calibration and the collective alike, so the ratio stays what it is; an estimate wrong in kind
 *     (units, a missing factor of n, a latency term that dominates when it should not) leaves it;
 *   - the defaults table (a dedicated socket): its estimate must not exceed 10x the fastest measured run.
 *     Load only ever makes runs slower, so this side holds on any machine; the other side (a table too
 *     optimistic for this machine) is printed, not judged: a busy CI machine has measured raw MPI 30x
 *     slower than usual, which says nothing about the table.
 * The fastest of 40 runs counts (up to 3 rounds of 40 while the model is out of bounds). */
#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "planner.h"
#include "dg_test_mpi.h"

#define FACTOR 10.0

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    int rank, n;
    dg_test_mpi_init(&argc, &argv, &rank, &n);
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
    const size_t sizes[] = {1 << 16, 1 << 20, 1 << 22};
    int fails = 0;
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        size_t bytes = sizes[si], count = bytes / 4;
        float *a = malloc(bytes), *b = malloc(bytes);
        for (size_t i = 0; i < count; i++)
            a[i] = (float)(i % 97) * 0.5f + rank;
        for (int kind = 0; kind < 3; kind++) {
            enum { ITERS = 40, ROUNDS = 3, N_OPS = 4 };
            /* op 0: dg_comm, 1: raw MPI, 2: one ring step (Sendrecv of bytes/n), 3: an 8-byte Sendrecv */
            double t[N_OPS][ITERS], best[N_OPS];
            for (int o = 0; o < N_OPS; o++)
                best[o] = INFINITY;
            size_t per = count / n;
            int right = (rank + 1) % n, left = (rank + n - 1) % n;
            double est =
                dg_plan_collective_s(kind, (double)(count / n) * n * 4, n, links[DG_LINK_SAME_SOCKET]);
            double est_cal = 0;
            dg_link_param_t cal = {0, 0};
            int ok_model = 0;
            /* up to ROUNDS rounds of ITERS runs while the model is out of bounds (every rank's decision is
             * the same: the times are MPI_MAX'd) */
            for (int round = 0; round < ROUNDS && !ok_model; round++) {
                for (int it = -2; it < ITERS; it++) {
                    for (int op = 0; op < N_OPS; op++) {
                        MPI_Barrier(MPI_COMM_WORLD);
                        double t0 = MPI_Wtime();
                        dg_status_t s = DG_OK;
                        if (op == 1) {
                            if (kind == 0)
                                MPI_Allreduce(a, b, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                            else if (kind == 1)
                                MPI_Allgather(a, (int)per, MPI_FLOAT, b, (int)per, MPI_FLOAT, MPI_COMM_WORLD);
                            else
                                MPI_Reduce_scatter_block(a, b, (int)per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                        } else if (op >= 2) {
                            int cnt = op == 2 ? (int)per : 2; /* 2 floats: 8 bytes */
                            MPI_Sendrecv(a, cnt, MPI_FLOAT, right, 11, b, cnt, MPI_FLOAT, left, 11,
                                         MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                        } else if (kind == 0) {
                            s = dg_comm_allreduce(comm, a, b, count, DG_F32, DG_RED_SUM);
                        } else if (kind == 1) {
                            s = dg_comm_allgather(comm, a, b, per, DG_F32);
                        } else {
                            s = dg_comm_reduce_scatter(comm, a, b, per, DG_F32, DG_RED_SUM);
                        }
                        if (s != DG_OK) {
                            fprintf(stderr, "collective failed: %s\n", dg_last_error());
                            MPI_Abort(MPI_COMM_WORLD, 2);
                        }
                        double dt = MPI_Wtime() - t0, mx;
                        MPI_Allreduce(&dt, &mx, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
                        if (it >= 0) t[op][it] = mx;
                    }
                }
                for (int o = 0; o < N_OPS; o++) {
                    qsort(t[o], ITERS, sizeof t[o][0], cmp_d);
                    best[o] = fmin(best[o], t[o][0]); /* the fastest run: other load only adds time */
                }
                /* the link as measured now: alpha from the 8-byte exchange, beta from one ring step */
                double step_bytes = (double)per * 4, beta_s = best[2] - best[3];
                if (beta_s < 1e-9) beta_s = 1e-9;
                cal.lat_us = best[3] * 1e6;
                cal.bw_GBps = step_bytes / beta_s / 1e9;
                est_cal = dg_plan_collective_s(kind, (double)(count / n) * n * 4, n, cal);
                double r = best[0] / est_cal;
                ok_model = r <= FACTOR && r >= 1.0 / FACTOR;
            }
            double meas = best[0], ratio_model = meas / est_cal, ratio_table = meas / est;
            /* All three are judged: the comm layer's reduce-scatter is its own ring (the planner's model);
             * the raw column shows Open MPI 4.1's MPI_Reduce_scatter_block, several times slower here. */
            int ok_table = ratio_table >= 1.0 / FACTOR;
            if (rank == 0)
                printf("%-14s %9zu bytes, %d ranks: dg_comm %9.1f us (raw MPI %9.1f us); model on the "
                       "measured link "
                       "(%.2f us, %.2f GB/s) %9.1f us, ratio %6.2f %s; defaults table %9.1f us, ratio %6.2f "
                       "%s\n",
                       kind == 0   ? "all-reduce"
                       : kind == 1 ? "all-gather"
                                   : "reduce-scatter",
                       bytes, n, meas * 1e6, best[1] * 1e6, cal.lat_us, cal.bw_GBps, est_cal * 1e6,
                       ratio_model, ok_model ? "ok" : "OUT OF BOUNDS", est * 1e6, ratio_table,
                       !ok_table              ? "TABLE TOO PESSIMISTIC"
                       : ratio_table > FACTOR ? "(slower than the table: this machine or its load)"
                                              : "ok");
            fails += !ok_model + !ok_table;
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
