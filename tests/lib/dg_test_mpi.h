/* dg_test_mpi.h — the start of an MPI test driver (header-only, on every test target's include path):
 * dg_test_mpi_init(&argc, &argv, &rank, &world) is MPI_Init_thread with MPI_THREAD_MULTIPLE (the comm
 * thread and the health thread call MPI beside the main thread), then this rank and the size of
 * MPI_COMM_WORLD (world may be NULL). */
#ifndef DG_TEST_MPI_H
#define DG_TEST_MPI_H

#include <mpi.h>

static inline void dg_test_mpi_init(int *argc, char ***argv, int *rank, int *world) {
    int provided = 0;
    MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, rank);
    if (world) MPI_Comm_size(MPI_COMM_WORLD, world);
}

#endif
