/* bench_mpi.h — the start and the checks of the MPI benches (header-only; bench/fsdp, bench/pipeline,
 * bench/checkpoint, bench/comm): bench_check.h with a failure ending the whole job (MPI_Abort, code 2),
 * and
 *   bench_mpi_init(&argc, &argv, &rank, &world)  MPI_Init_thread (MPI_THREAD_MULTIPLE), this rank and the
 *                                                size of MPI_COMM_WORLD
 *   RANK_MUST(call)  a dg_status_t call; on failure "rank R: CALL failed: why" (R: MPI_COMM_WORLD's rank) */
#ifndef DG_BENCH_MPI_H
#define DG_BENCH_MPI_H

#include <mpi.h>

#define BENCH_DIE() MPI_Abort(MPI_COMM_WORLD, 2)
#include "bench_check.h"

static inline void bench_mpi_init(int *argc, char ***argv, int *rank, int *world) {
    int provided = 0;
    MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, rank);
    MPI_Comm_size(MPI_COMM_WORLD, world);
}

static inline void bench_rank_must(dg_status_t s, const char *call) {
    if (s == DG_OK) return;
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    bench_die("rank %d: %s failed: %s\n", rank, call, dg_last_error());
}
#define RANK_MUST(call) bench_rank_must((call), #call)

#endif
