/* dg_mpi.h — the one MPI check macro (docs/design.md §4) and MPI helpers every module may use. */
#ifndef DG_MPI_H
#define DG_MPI_H
#include <mpi.h>
#include "dg_common.h"

/* Evaluate an MPI call; on failure return DG_ERR(DG_ERR_RUNTIME, ...) with MPI's error string.
 * Communicators used with it must have MPI_ERRORS_RETURN set (dg_boot does this for the ones it makes). */
#define DG_MPI_CHECK(call)                                                                                 \
    do {                                                                                                   \
        int dg_mpi_rc_ = (call);                                                                           \
        if (dg_mpi_rc_ != MPI_SUCCESS) {                                                                   \
            char dg_mpi_s_[MPI_MAX_ERROR_STRING];                                                          \
            int dg_mpi_n_ = 0;                                                                             \
            MPI_Error_string(dg_mpi_rc_, dg_mpi_s_, &dg_mpi_n_);                                           \
            return DG_ERR(DG_ERR_RUNTIME, "MPI call `%s` failed: %s; hint: a peer may have died",          \
                          #call, dg_mpi_s_);                                                               \
        }                                                                                                  \
    } while (0)

#endif
