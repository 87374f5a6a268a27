/* mpi_boot_impl.h — private to src/mpi_boot: the hwloc check macro (docs/design.md §4: one per library)
 * and helpers shared by boot.c, topo.c and report.c. */
#ifndef DG_MPI_BOOT_IMPL_H
#define DG_MPI_BOOT_IMPL_H

#include <errno.h>
#include <string.h>

#include "mpi_boot.h"

/* hwloc calls return -1 (or NULL) and set errno. Evaluate `call` once; on a negative result return
 * DG_ERR(DG_ERR_RUNTIME, ...) naming the call, errno's text and `hint`. */
#define DG_HWLOC_CHECK(call, hint)                                                                           \
    do {                                                                                                     \
        errno = 0;                                                                                           \
        int dg_hw_rc_ = (call);                                                                              \
        if (dg_hw_rc_ < 0) {                                                                                 \
            int dg_hw_e_ = errno;                                                                            \
            return DG_ERR(DG_ERR_RUNTIME, "hwloc call `%s` failed: %s; hint: %s", #call,                     \
                          dg_hw_e_ ? strerror(dg_hw_e_) : "unknown error", (hint));                          \
        }                                                                                                    \
    } while (0)

/* "0-3,8" list text of a bitmap into a fixed buffer (truncated safely). */
void dg_boot_bitmap_list(char *buf, size_t cap, hwloc_const_bitmap_t set);

#endif
