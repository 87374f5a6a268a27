/* mpiio.c — the MPI-IO entry points HDF5 writes and reads a checkpoint with, interposed while a save runs
 * (exported from the executable, see CMakeLists.txt): write failures kept away from HDF5 (ckpt_io_t),
 * progress counted for the watchdog, and the skip of HDF5's fill of datasets the direct chunk writer
 * writes whole. save.c drives them through ckpt_impl.h's ckpt_io_* and ckpt_tl_* state.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "ckpt_impl.h"

/* ---------------- write failures that HDF5 never sees ----------------
 * A write that fails inside HDF5 (ENOSPC from below MPI-IO, EIO) sends HDF5 down an error path on the
 * failing rank only: its collective metadata flush then skips a barrier the others wait in, and H5Fclose
 * deadlocks (or, at one rank, fails and leaves a half-closed file that crashes MPI_Finalize). So while a
 * save runs, this file's MPI-IO entry points (below, exported from the executable like
 * MPI_File_write_at_all for the fill skip) report success to HDF5 whatever happened, and keep the truth
 * here: a failed write sets `failed` on its rank; every collective write, and every agreement of the
 * save, then agrees on it, and from there on every rank skips all further writes (`failed_all`), so HDF5
 * runs its ordinary, symmetric path through the close of a file that is then thrown away. The save
 * reports the first failure it recorded. (The state is declared in ckpt_impl.h.) */
__thread ckpt_io_t *ckpt_tl_io; /* the save running on this thread (HDF5 is called from it only) */

void ckpt_io_fail(ckpt_io_t *io, int nospace, const char *fmt, ...) {
    if (nospace) io->nospace = 1;
    if (io->failed) return;
    io->failed = 1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(io->msg, sizeof io->msg, fmt, ap);
    va_end(ap);
}

void ckpt_io_fail_mpi(ckpt_io_t *io, int rc, const char *call, MPI_Offset off) {
    char es[MPI_MAX_ERROR_STRING] = "";
    int len = 0, cls = MPI_ERR_OTHER;
    PMPI_Error_string(rc, es, &len);
    PMPI_Error_class(rc, &cls);
    ckpt_io_fail(io, cls == MPI_ERR_NO_SPACE || cls == MPI_ERR_QUOTA, "%.300s: %s at offset %lld failed: %s",
                 io->path ? io->path : "?", call, (long long)off, es);
}

void ckpt_io_throttle(const ckpt_io_t *io) {
    if (io->throttle_ms > 0) {
        struct timespec ts = {io->throttle_ms / 1000, (long)(io->throttle_ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
    }
}

/* The local failure flag as a status, for the save's agreement points. */
dg_status_t ckpt_io_status(const ckpt_io_t *io) {
    if (!io->failed) return DG_OK;
    return DG_ERR(DG_ERR_RUNTIME, "%s", io->msg);
}

/* ---------------- skipping HDF5's fill of wholly direct datasets ----------------
 * Parallel HDF5 1.10 allocates every chunk of a filtered dataset at H5Dcreate and writes the filtered
 * fill value into all of them (H5D__chunk_allocate sets "should fill" whenever a filter is present;
 * H5D__chunk_collective_fill then issues one MPI_File_write_at_all per dataset, the fill buffer repeated
 * by a memory type that is an hvector of stride 0 over MPI_BYTE), whatever the fill time says. When the
 * direct chunk writer is going to write every chunk of the dataset itself, those zeros are a second
 * page-cache copy of the whole checkpoint for nothing.
 *
 * So this file defines MPI_File_write_at_all (exported from the executable, see CMakeLists.txt: the
 * dynamic linker binds libhdf5's calls to it; every other call goes straight to PMPI_File_write_at_all).
 * Only while a thread creates a dataset that every rank agreed is wholly direct (fill_skip_ok: every
 * owned piece a dim-0 cut made of whole chunks, on every rank) does it act, and then without any
 * collective call, so no rank can be left waiting in one:
 *   - nothing to write on this rank (count 0): return;
 *   - the fill's signature (hvector, stride 0, of MPI_BYTE): skip it, report the bytes as written;
 *   - anything else (e.g. a collective metadata flush that fell inside H5Dcreate): write the same bytes
 *     through the same file view with the independent PMPI_File_write_at.
 * The skipped chunks are holes (or past the end of the file) until the direct writer fills them. A hole
 * reads as zeros, which is exactly the fill HDF5 would have written (fill value 0, and HDF5's Fletcher32
 * of zeros is 0), but HDF5 may also place a chunk in file space it freed earlier in the same file, which
 * holds stale bytes; hence only datasets whose every chunk the direct writer overwrites skip the fill,
 * and HDF5's collective write, which reads a chunk back before updating it, never sees a skipped one.
 * direct_plan checks after creation that the chunk index is exactly what the direct writer expects; if
 * it is not after a skipped fill, the save is redone without skipping (and never skipped again in this
 * process). DG_CKPT_SKIP_FILL=0 turns the skip off. */
__thread int ckpt_tl_fill_skip;              /* set around H5Dcreate2 of a wholly direct dataset */
__thread int64_t ckpt_tl_fill_skipped_bytes; /* bytes of fill this thread did not write */
atomic_int ckpt_fill_skip_off;               /* a redone save turned it off for this process */

static int is_fill_type(MPI_Datatype t) {
    int ni = 0, na = 0, nd = 0, comb = 0;
    if (PMPI_Type_get_envelope(t, &ni, &na, &nd, &comb) != MPI_SUCCESS || comb != MPI_COMBINER_HVECTOR ||
        ni != 2 || na != 1 || nd != 1)
        return 0;
    int ints[2];
    MPI_Aint aints[1];
    MPI_Datatype old[1];
    if (PMPI_Type_get_contents(t, 2, 1, 1, ints, aints, old) != MPI_SUCCESS) return 0;
    int oni, ona, ond, ocomb;
    if (PMPI_Type_get_envelope(old[0], &oni, &ona, &ond, &ocomb) == MPI_SUCCESS &&
        ocomb != MPI_COMBINER_NAMED)
        PMPI_Type_free(&old[0]); /* get_contents hands back a copy of a derived old type */
    return aints[0] == 0 && old[0] == MPI_BYTE;
}

/* What the fill skip does (see above) with one collective write, or the write itself. */
static int write_at_all_or_skip(MPI_File fh, MPI_Offset offset, const void *buf, int count,
                                MPI_Datatype datatype, MPI_Status *status, int tsz) {
    if (!ckpt_tl_fill_skip) return PMPI_File_write_at_all(fh, offset, buf, count, datatype, status);
    if (count == 0 || tsz == 0) {
        if (status != MPI_STATUS_IGNORE) PMPI_Status_set_elements_x(status, datatype, 0);
        return MPI_SUCCESS;
    }
    if (tsz > 0 && is_fill_type(datatype)) {
        ckpt_tl_fill_skipped_bytes += (int64_t)tsz * count;
        if (status != MPI_STATUS_IGNORE) PMPI_Status_set_elements_x(status, datatype, (MPI_Count)tsz * count);
        return MPI_SUCCESS;
    }
    return PMPI_File_write_at(fh, offset, buf, count, datatype, status);
}

/* A write MPI called a success may still have written less: Open MPI 4.1's ompio returns MPI_SUCCESS
 * for a collective write whose pwritev failed with ENOSPC (it prints "mca_fbtl_posix_pwritev: error in
 * (p)write(v)" and sets a short count in the status), and HDF5 1.10 does not look at the count. Left
 * alone, that is a checkpoint with missing data that commits. The count decides. */
static void check_written(ckpt_io_t *io, MPI_Status *st, int count, int tsz, const char *call,
                          MPI_Offset off) {
    if (count <= 0 || tsz <= 0) return;
    MPI_Count want = (MPI_Count)tsz * count, got = 0;
    if (PMPI_Get_elements_x(st, MPI_BYTE, &got) != MPI_SUCCESS || got == MPI_UNDEFINED) got = want;
    if (got > 0) ckpt_progress_add((uint64_t)got);
    if (got < want)
        ckpt_io_fail(
            io, 0,
            "%.300s: %s (offset %lld in its file view) wrote %lld of %lld bytes and reported no error (a "
            "full or failing file system)",
            io->path ? io->path : "?", call, (long long)off, (long long)got, (long long)want);
}

static int report_written(MPI_Status *status, MPI_Datatype datatype, int count, int tsz) {
    if (status != MPI_STATUS_IGNORE)
        PMPI_Status_set_elements_x(status, datatype, (MPI_Count)(tsz > 0 ? tsz : 0) * count);
    return MPI_SUCCESS;
}

int MPI_File_write_at_all(MPI_File fh, MPI_Offset offset, const void *buf, int count, MPI_Datatype datatype,
                          MPI_Status *status) {
    ckpt_io_t *io = ckpt_tl_io;
    int tsz = 0;
    if (PMPI_Type_size(datatype, &tsz) != MPI_SUCCESS) tsz = -1;
    if (!io) return write_at_all_or_skip(fh, offset, buf, count, datatype, status, tsz);
    if (io->failed_all) return report_written(status, datatype, count, tsz); /* every rank skips it */
    if (count > 0 && tsz > 0) ckpt_io_throttle(io);
    MPI_Status st;
    ckpt_waiting(1);
    int rc = write_at_all_or_skip(fh, offset, buf, count, datatype, &st, tsz);
    ckpt_waiting(-1);
    if (rc != MPI_SUCCESS)
        ckpt_io_fail_mpi(io, rc, "MPI_File_write_at_all", offset);
    else
        check_written(io, &st, count, tsz, "MPI_File_write_at_all", offset);
    /* every rank of the file is in this call: agree on whether any write of this save has failed */
    int mine = io->failed, any = 0;
    ckpt_waiting(1);
    if (PMPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, io->comm) != MPI_SUCCESS) any = 1;
    ckpt_waiting(-1);
    if (any) io->failed_all = 1;
    return report_written(status, datatype, count, tsz);
}

int MPI_File_write_at(MPI_File fh, MPI_Offset offset, const void *buf, int count, MPI_Datatype datatype,
                      MPI_Status *status) {
    ckpt_io_t *io = ckpt_tl_io;
    if (!io) return PMPI_File_write_at(fh, offset, buf, count, datatype, status);
    int tsz = 0;
    if (PMPI_Type_size(datatype, &tsz) != MPI_SUCCESS) tsz = -1;
    /* independent: this rank alone skips after its own failure (nothing waits for it) */
    if (io->failed || io->failed_all) return report_written(status, datatype, count, tsz);
    if (count > 0 && tsz > 0) ckpt_io_throttle(io);
    MPI_Status st;
    int rc = PMPI_File_write_at(fh, offset, buf, count, datatype, &st);
    if (rc != MPI_SUCCESS)
        ckpt_io_fail_mpi(io, rc, "MPI_File_write_at", offset);
    else
        check_written(io, &st, count, tsz, "MPI_File_write_at", offset);
    return report_written(status, datatype, count, tsz);
}

int MPI_File_set_size(MPI_File fh, MPI_Offset size) {
    ckpt_io_t *io = ckpt_tl_io;
    if (!io) return PMPI_File_set_size(fh, size);
    if (io->failed_all) return MPI_SUCCESS;
    ckpt_waiting(1);
    int rc = PMPI_File_set_size(fh, size); /* collective: agreed like a collective write */
    if (rc != MPI_SUCCESS) ckpt_io_fail_mpi(io, rc, "MPI_File_set_size", size);
    int mine = io->failed, any = 0;
    if (PMPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, io->comm) != MPI_SUCCESS) any = 1;
    ckpt_waiting(-1);
    if (any) io->failed_all = 1;
    return MPI_SUCCESS;
}

int MPI_File_close(MPI_File *fh) {
    /* collective (a barrier in Open MPI's ompio): a rank waiting here waits for the others */
    ckpt_waiting(1);
    int rc = PMPI_File_close(fh);
    ckpt_waiting(-1);
    ckpt_progress_add(1);
    return rc;
}

/* Reads (loads, and HDF5's reads during a save) only count as progress. */
static void count_read(int rc, MPI_Status *status, MPI_Datatype datatype, int count) {
    if (rc != MPI_SUCCESS || count <= 0) return;
    int tsz = 0;
    if (PMPI_Type_size(datatype, &tsz) == MPI_SUCCESS && tsz > 0)
        ckpt_progress_add((uint64_t)tsz * (uint64_t)count);
    (void)status;
}

int MPI_File_read_at(MPI_File fh, MPI_Offset offset, void *buf, int count, MPI_Datatype datatype,
                     MPI_Status *status) {
    int rc = PMPI_File_read_at(fh, offset, buf, count, datatype, status);
    count_read(rc, status, datatype, count);
    return rc;
}

int MPI_File_read_at_all(MPI_File fh, MPI_Offset offset, void *buf, int count, MPI_Datatype datatype,
                         MPI_Status *status) {
    ckpt_waiting(1);
    int rc = PMPI_File_read_at_all(fh, offset, buf, count, datatype, status);
    ckpt_waiting(-1);
    count_read(rc, status, datatype, count);
    return rc;
}
