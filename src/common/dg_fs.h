/* dg_fs.h — how dgtrain creates files in directories it does not fully control (the run directory, the
 * checkpoint directory, the default-data directory): never through a symbolic link planted in the last
 * component of a path, never world-writable, and at most one run per run directory.
 *
 * Rules (docs/reliability.md, "Run directory"):
 *   - A file is opened with openat(O_NOFOLLOW) under a handle of its directory. The directory path
 *     itself is followed, so a run.dir or checkpoint.dir that is a symlink chosen by the user works;
 *     a symlink (or a FIFO, device, directory...) at the file's own name is refused, never followed.
 *   - Temporary files are created with O_EXCL|O_NOFOLLOW (a stale one or a planted link at that name is
 *     removed first, not followed) and renamed into place; rename replaces a link, never follows it.
 *   - dg_fs_secure_umask() adds world-write to the process umask at start, and every file or directory
 *     created here asks for no world-write (0664 / 0775 at most), so neither a umask of 000 nor a library
 *     creating files with 0666 yields world-writable output.
 */
#ifndef DG_FS_H
#define DG_FS_H

#include <stdio.h>
#include <sys/types.h>

#include "dg_common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Most permissive modes dgtrain asks for (the umask may remove more). */
#define DG_FS_FILE_MODE 0664
#define DG_FS_DIR_MODE 0775

/* umask |= S_IWOTH for the whole process: call first thing in main(). Returns the previous umask. */
mode_t dg_fs_secure_umask(void);

/* Opens `path` with `flags` (O_RDONLY/O_WRONLY/O_RDWR plus O_CREAT, O_APPEND, O_TRUNC, O_EXCL...) and
 * mode DG_FS_FILE_MODE, without following a symbolic link in its last component, and only if it is (or
 * becomes) a regular file; a file dgtrain opens for writing that is world-writable loses that bit.
 * Errors: DG_ERR_USAGE for a symlink or a non-regular file at that name (naming it and, for a link,
 * its target), DG_ERR_RUNTIME for other failures (naming the path and the system's reason). */
dg_status_t dg_fs_open_nofollow(const char *path, int flags, int *fd_out);

/* write(2) all `len` bytes, again after EINTR or a short write; DG_ERR_RUNTIME "cannot write WHAT: reason".
 */
dg_status_t dg_fs_write_all(int fd, const void *data, size_t len, const char *what);

/* The same as dg_fs_open_nofollow, as a line-buffered stdio stream for appending (creating the file if
 * needed). */
dg_status_t dg_fs_fopen_append(const char *path, FILE **out);

/* ---- one run per run directory ---- */

typedef struct dg_fs_lock dg_fs_lock_t;

/* The lock file inside a run directory. */
#define DG_RUNDIR_LOCK_NAME "dgtrain.lock"

/* Takes the run directory's lock (run.lock = `mode`):
 *   "auto"  an exclusive fcntl lock on RUN_DIR/dgtrain.lock, held until dg_fs_lock_release or process
 *           exit (the kernel / the file server drops it when the holder dies, even by SIGKILL). The file
 *           records the holder: host, pid, Slurm job id, start time. Where the file system refuses locks
 *           (ENOLCK, EOPNOTSUPP, ENOSYS), a warning, and the fallback: refused only when the recorded
 *           holder is a live dgtrain process on this host.
 *   "fcntl" the same lock, but a file system without locks is an error instead of the fallback.
 *   "none"  no lock at all (the user guarantees one run per directory).
 * When another run holds it: DG_ERR_USAGE with one line naming the run directory and the holder; but
 * when the holder is an earlier run of this same Slurm job (same SLURM_JOB_ID, another
 * SLURM_RESTART_COUNT: Slurm ended it before requeueing, only a lost node's lock may outlive it until
 * the file server's lease expires), it waits up to same_job_wait_s for the lock first.
 * Test hook: DG_TEST_FS_NO_LOCKS=1 makes fcntl act as on a file system without locks (ENOLCK).
 * run_dir must exist. *out is NULL for "none". */
dg_status_t dg_fs_lock_rundir(const char *run_dir, const char *mode, double same_job_wait_s,
                              dg_fs_lock_t **out);
void dg_fs_lock_release(dg_fs_lock_t *l);

#ifdef __cplusplus
}
#endif
#endif /* DG_FS_H */
