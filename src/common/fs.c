/* fs.c — symlink-safe file creation, the umask rule, atomic small-file writes, and the run-directory
 * lock (rules in dg_fs.h). Everything is done under a handle of the parent directory (openat, renameat,
 * unlinkat), so the last component of a path is looked at exactly once and never followed. */
#define _GNU_SOURCE
#include "dg_fs.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "dg_env.h"

mode_t dg_fs_secure_umask(void) {
    mode_t old = umask(0);
    umask(old | S_IWOTH);
    return old;
}

/* Splits path into its directory (followed when opened: the user's choice) and its last component. */
static dg_status_t split_path(const char *path, char *dir, size_t dcap, const char **base) {
    if (!path || !*path) return DG_ERR(DG_ERR_RUNTIME, "empty file path");
    size_t n = strlen(path);
    if (n >= dcap) return DG_ERR(DG_ERR_RUNTIME, "path too long (%zu bytes): %.200s...", n, path);
    if (path[n - 1] == '/') return DG_ERR(DG_ERR_RUNTIME, "%s: expected a file name, not a directory", path);
    const char *slash = strrchr(path, '/');
    if (!slash) {
        snprintf(dir, dcap, ".");
        *base = path;
    } else if (slash == path) {
        snprintf(dir, dcap, "/");
        *base = slash + 1;
    } else {
        memcpy(dir, path, (size_t)(slash - path));
        dir[slash - path] = 0;
        *base = slash + 1;
    }
    if (strcmp(*base, ".") == 0 || strcmp(*base, "..") == 0)
        return DG_ERR(DG_ERR_RUNTIME, "%s: expected a file name, not a directory", path);
    return DG_OK;
}

static dg_status_t open_dir(const char *dir, const char *for_path, int *dfd) {
    *dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (*dfd < 0)
        return DG_ERR(DG_ERR_RUNTIME, "cannot open directory %s (for %s): %s", dir, for_path,
                      strerror(errno));
    return DG_OK;
}

/* The error for a name that is a symlink: names its target so the user sees where it would have led. */
static dg_status_t link_error(int dfd, const char *base, const char *path) {
    char target[1024];
    ssize_t n = readlinkat(dfd, base, target, sizeof target - 1);
    if (n < 0) n = 0;
    target[n] = 0;
    return DG_ERR(DG_ERR_USAGE,
                  "refusing to write %s: it is a symbolic link%s%s%s (dgtrain never writes through a link "
                  "planted in the run directory; remove it)",
                  path, n ? " (to " : "", target, n ? ")" : "");
}

static const char *kind_name(mode_t m) {
    return S_ISDIR(m)    ? "a directory"
           : S_ISFIFO(m) ? "a FIFO"
           : S_ISCHR(m)  ? "a character device"
           : S_ISBLK(m)  ? "a block device"
           : S_ISSOCK(m) ? "a socket"
                         : "not a regular file";
}

/* openat with O_NOFOLLOW; regular files only; world-write dropped from a file opened for writing. */
static dg_status_t open_at(int dfd, const char *base, const char *path, int flags, int *fd_out) {
    *fd_out = -1;
    /* O_NONBLOCK: opening a planted FIFO must not block; it is refused right after by fstat */
    int fd = openat(dfd, base, flags | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, DG_FS_FILE_MODE);
    if (fd < 0) {
        int e = errno;
        if (e == ELOOP) return link_error(dfd, base, path);
        struct stat st;
        if ((e == EISDIR || e == ENXIO || e == EWOULDBLOCK) &&
            fstatat(dfd, base, &st, AT_SYMLINK_NOFOLLOW) == 0)
            return DG_ERR(DG_ERR_USAGE, "refusing to write %s: it is %s, expected a regular file", path,
                          kind_name(st.st_mode));
        return DG_ERR(DG_ERR_RUNTIME, "cannot open %s: %s", path, strerror(e));
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return DG_ERR(DG_ERR_RUNTIME, "cannot stat %s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return DG_ERR(DG_ERR_USAGE, "refusing to write %s: it is %s, expected a regular file", path,
                      kind_name(st.st_mode));
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    if ((flags & O_ACCMODE) != O_RDONLY && (st.st_mode & S_IWOTH) && st.st_uid == geteuid())
        (void)fchmod(fd, st.st_mode & 07775);
    *fd_out = fd;
    return DG_OK;
}

dg_status_t dg_fs_open_nofollow(const char *path, int flags, int *fd_out) {
    *fd_out = -1;
    char dir[4096];
    const char *base = NULL;
    DG_TRY(split_path(path, dir, sizeof dir, &base));
    int dfd;
    DG_TRY(open_dir(dir, path, &dfd));
    dg_status_t s = open_at(dfd, base, path, flags, fd_out);
    close(dfd);
    return s;
}

dg_status_t dg_fs_fopen_append(const char *path, FILE **out) {
    *out = NULL;
    int fd;
    DG_TRY(dg_fs_open_nofollow(path, O_WRONLY | O_APPEND | O_CREAT, &fd));
    FILE *f = fdopen(fd, "a");
    if (!f) {
        int e = errno;
        close(fd);
        return DG_ERR(DG_ERR_RUNTIME, "cannot open %s for appending: %s", path, strerror(e));
    }
    setvbuf(f, NULL, _IOLBF, 0);
    *out = f;
    return DG_OK;
}

dg_status_t dg_mkdir_p(const char *path) {
    char buf[4096];
    if (strlen(path) >= sizeof buf) return DG_ERR(DG_ERR_RUNTIME, "path too long: %s", path);
    strcpy(buf, path);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, DG_FS_DIR_MODE) != 0 && errno != EEXIST)
            return DG_ERR(DG_ERR_RUNTIME, "cannot create directory %s: %s", buf, strerror(errno));
        *p = '/';
    }
    if (mkdir(buf, DG_FS_DIR_MODE) != 0 && errno != EEXIST)
        return DG_ERR(DG_ERR_RUNTIME, "cannot create directory %s: %s", buf, strerror(errno));
    struct stat st;
    if (stat(buf, &st) != 0 || !S_ISDIR(st.st_mode))
        return DG_ERR(DG_ERR_RUNTIME, "%s exists and is not a directory", buf);
    return DG_OK;
}

dg_status_t dg_fs_write_all(int fd, const void *data, size_t len, const char *what) {
    const char *p = data;
    while (len) {
        ssize_t w = write(fd, p, len);
        if (w < 0) {
            if (errno == EINTR) continue;
            return DG_ERR(DG_ERR_RUNTIME, "cannot write %s: %s", what, strerror(errno));
        }
        p += w;
        len -= (size_t)w;
    }
    return DG_OK;
}

dg_status_t dg_write_file_atomic(const char *path, const void *data, size_t len) {
    char dir[4096], tmp[512], tmp_path[4700];
    const char *base = NULL;
    DG_TRY(split_path(path, dir, sizeof dir, &base));
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%d", base, (int)getpid()) >= (int)sizeof tmp)
        return DG_ERR(DG_ERR_RUNTIME, "file name too long: %s", path);
    snprintf(tmp_path, sizeof tmp_path, "%s/%s", dir, tmp);
    int dfd;
    DG_TRY(open_dir(dir, path, &dfd));
    /* O_EXCL|O_NOFOLLOW: a leftover of a crashed writer with our pid, or a link planted at the
     * temporary name, is removed (the link itself, not its target) and the file created anew */
    int fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, DG_FS_FILE_MODE);
    if (fd < 0 && errno == EEXIST && unlinkat(dfd, tmp, 0) == 0)
        fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, DG_FS_FILE_MODE);
    if (fd < 0) {
        int e = errno;
        close(dfd);
        return DG_ERR(DG_ERR_RUNTIME, "cannot create %s: %s", tmp_path, strerror(e));
    }
    dg_status_t s = dg_fs_write_all(fd, data, len, tmp_path);
    if (s == DG_OK && fsync(fd) != 0) s = DG_ERR(DG_ERR_RUNTIME, "fsync %s: %s", tmp_path, strerror(errno));
    close(fd);
    if (s == DG_OK && renameat(dfd, tmp, dfd, base) != 0)
        s = DG_ERR(DG_ERR_RUNTIME, "cannot rename %s to %s: %s", tmp_path, path, strerror(errno));
    if (s != DG_OK)
        unlinkat(dfd, tmp, 0);
    else
        fsync(dfd); /* some file systems cannot fsync a directory; the rename is done either way */
    close(dfd);
    return s;
}

/* ---------------------------------------------------------------- the run-directory lock */

struct dg_fs_lock {
    int fd;
};

/* Why fcntl failed for a reason other than a holder: the file system cannot lock. */
static int no_lock_support(int e) {
    return e == ENOLCK || e == EOPNOTSUPP || e == ENOTSUP || e == ENOSYS;
}

static void holder_record(char *buf, size_t cap) {
    char host[256] = "";
    if (gethostname(host, sizeof host - 1) != 0 || !host[0]) snprintf(host, sizeof host, "unknown");
    for (char *c = host; *c; c++)
        if (*c == ' ' || *c == '\n') *c = '_';
    const char *job = getenv("SLURM_JOB_ID");
    const char *restart = getenv("SLURM_RESTART_COUNT");
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    char stamp[64];
    strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &tm);
    snprintf(buf, cap,
             "dgtrain-run-lock host=%s pid=%d slurm_job=%s slurm_restart=%s start=%s start_unix=%lld\n", host,
             (int)getpid(), job && *job ? job : "-", restart && *restart ? restart : "-", stamp,
             (long long)now);
}

/* A field of the holder record ("" when absent). */
static void record_field(const char *rec, const char *key, char *out, size_t cap) {
    out[0] = 0;
    char pat[32];
    snprintf(pat, sizeof pat, " %s=", key);
    const char *p = strstr(rec, pat);
    if (!p) return;
    p += strlen(pat);
    size_t n = strcspn(p, " \n");
    if (n >= cap) n = cap - 1;
    memcpy(out, p, n);
    out[n] = 0;
}

/* "host H, pid P, Slurm job J, started T" from the record, or what is known. */
static void describe_holder(const char *rec, char *out, size_t cap) {
    char host[256], pid[32], job[64], restart[32], start[64];
    record_field(rec, "host", host, sizeof host);
    record_field(rec, "pid", pid, sizeof pid);
    record_field(rec, "slurm_job", job, sizeof job);
    record_field(rec, "slurm_restart", restart, sizeof restart);
    record_field(rec, "start", start, sizeof start);
    if (!host[0] && !pid[0]) {
        snprintf(out, cap, "holder not recorded yet (it is starting, or is not a dgtrain of this version)");
        return;
    }
    char jobtxt[128] = "no Slurm job";
    if (job[0] && strcmp(job, "-") != 0)
        snprintf(jobtxt, sizeof jobtxt, "Slurm job %s%s%s", job,
                 restart[0] && strcmp(restart, "-") != 0 ? " restart " : "",
                 restart[0] && strcmp(restart, "-") != 0 ? restart : "");
    char when[80] = "?";
    if (strlen(start) == 20) /* 2026-12-02T18:41:21Z -> 2026-12-02 18:41:21 UTC */
        snprintf(when, sizeof when, "%.10s %.8s UTC", start, start + 11);
    else if (start[0])
        snprintf(when, sizeof when, "%s", start);
    snprintf(out, cap, "host %s, pid %s, %s, started %s", host[0] ? host : "?", pid[0] ? pid : "?", jobtxt,
             when);
}

static void read_record(int fd, char *buf, size_t cap) {
    ssize_t n = pread(fd, buf, cap - 1, 0);
    if (n < 0) n = 0;
    buf[n] = 0;
    if (strncmp(buf, "dgtrain-run-lock ", 17) != 0) buf[0] = 0;
}

static dg_status_t write_record(int fd, const char *path) {
    char rec[512];
    holder_record(rec, sizeof rec);
    size_t n = strlen(rec);
    if (ftruncate(fd, 0) != 0 || pwrite(fd, rec, n, 0) != (ssize_t)n)
        return DG_ERR(DG_ERR_RUNTIME, "cannot write the lock file %s: %s", path, strerror(errno));
    fsync(fd); /* so that a run starting on another node reads who holds it */
    return DG_OK;
}

/* The fallback where locks are unsupported: is the recorded holder a live dgtrain on this host? */
static int holder_alive_here(const char *rec) {
    char host[256], pid_s[32], me[256] = "";
    record_field(rec, "host", host, sizeof host);
    record_field(rec, "pid", pid_s, sizeof pid_s);
    gethostname(me, sizeof me - 1);
    for (char *c = me; *c; c++)
        if (*c == ' ' || *c == '\n') *c = '_';
    long pid = atol(pid_s);
    if (!host[0] || strcmp(host, me) != 0 || pid <= 0 || pid == (long)getpid()) return 0;
    if (kill((pid_t)pid, 0) != 0 && errno != EPERM) return 0;
    char p[64], comm[64] = "";
    snprintf(p, sizeof p, "/proc/%ld/comm", pid);
    FILE *f = fopen(p, "r");
    if (!f) return 1; /* alive, and nothing says it is something else */
    int ok = fgets(comm, sizeof comm, f) != NULL;
    fclose(f);
    return !ok || strncmp(comm, "dgtrain", 7) == 0;
}

/* Is the recorded holder an earlier incarnation of this Slurm job (the same job id, another restart)?
 * Slurm ended it before starting us, but a lock of a lost node is only released when the file server's
 * lease expires (NFSv4: 90 s by default). */
static int holder_is_earlier_incarnation(const char *rec) {
    const char *job = getenv("SLURM_JOB_ID"), *restart = getenv("SLURM_RESTART_COUNT");
    char hjob[64], hrestart[32];
    record_field(rec, "slurm_job", hjob, sizeof hjob);
    record_field(rec, "slurm_restart", hrestart, sizeof hrestart);
    if (!job || !*job || strcmp(job, hjob) != 0) return 0;
    return strcmp(restart && *restart ? restart : "-", hrestart) != 0;
}

static int try_lock(int fd) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    int rc;
    while ((rc = fcntl(fd, F_SETLK, &fl)) != 0 && errno == EINTR) {
    }
    /* test hook: a file system without locks (the fallback), without needing one */
    if (rc == 0 && dg_env_bool("DG_TEST_FS_NO_LOCKS")) {
        fl.l_type = F_UNLCK;
        fcntl(fd, F_SETLK, &fl);
        errno = ENOLCK;
        return -1;
    }
    return rc;
}

/* The refusal when another run holds run_dir (closes fd); `unlocked`: its record was found without a lock,
 * on a file system that has none. */
static dg_status_t in_use(int fd, const char *rec, const char *run_dir, const char *path, int unlocked) {
    char who[512];
    close(fd);
    describe_holder(rec, who, sizeof who);
    return DG_ERR(
        DG_ERR_USAGE,
        "run.dir %s is in use by another dgtrain run (%s; lock file %s%s)%s; wait for it to end, stop "
        "it, or choose another run.dir",
        run_dir, who, path,
        unlocked ? ", recorded without a lock: this file system does not support fcntl locks" : "",
        unlocked ? "" : ": two runs would interleave metrics.jsonl and overwrite each other's checkpoints");
}

dg_status_t dg_fs_lock_rundir(const char *run_dir, const char *mode, double same_job_wait_s,
                              dg_fs_lock_t **out) {
    *out = NULL;
    if (strcmp(mode, "none") == 0) return DG_OK;
    int strict = strcmp(mode, "fcntl") == 0;
    if (!strict && strcmp(mode, "auto") != 0)
        return DG_ERR(DG_ERR_USAGE, "run.lock = '%s': expected auto, fcntl or none", mode);
    char path[4200];
    if (snprintf(path, sizeof path, "%s/%s", run_dir, DG_RUNDIR_LOCK_NAME) >= (int)sizeof path)
        return DG_ERR(DG_ERR_USAGE, "run.dir path too long: %s", run_dir);
    int fd;
    DG_TRY(dg_fs_open_nofollow(path, O_RDWR | O_CREAT, &fd));
    char rec[1024], who[512];
    int rc = try_lock(fd);
    double t0 = dg_now_s();
    int waited = 0;
    while (rc != 0 && (errno == EAGAIN || errno == EACCES)) {
        /* held: the holder writes its record right after locking; give a just-started one a moment */
        for (int i = 0; i < 20; i++) {
            read_record(fd, rec, sizeof rec);
            if (rec[0]) break;
            struct timespec ts = {0, 100000000L};
            nanosleep(&ts, NULL);
        }
        /* a requeued job waits (a while) for the lock of its own earlier incarnation to be dropped */
        if (holder_is_earlier_incarnation(rec) && dg_now_s() - t0 < same_job_wait_s) {
            if (!waited++) {
                describe_holder(rec, who, sizeof who);
                DG_LOG_WARN("run.dir %s is still locked by this job's earlier run (%s); waiting up to %.0f s "
                            "for the lock to be released",
                            run_dir, who, same_job_wait_s);
            }
            struct timespec ts = {1, 0};
            nanosleep(&ts, NULL);
            rc = try_lock(fd);
            continue;
        }
        return in_use(fd, rec, run_dir, path, 0);
    }
    if (rc != 0) {
        int e = errno;
        if (strict || !no_lock_support(e)) {
            close(fd);
            return DG_ERR(no_lock_support(e) ? DG_ERR_USAGE : DG_ERR_RUNTIME, "cannot lock %s: %s%s", path,
                          strerror(e),
                          no_lock_support(e) ? " (the file system of run.dir does not support fcntl locks; "
                                               "run.lock = auto falls back to a same-host check, "
                                               "run.lock = none disables the lock)"
                                             : "");
        }
        read_record(fd, rec, sizeof rec);
        if (rec[0] && holder_alive_here(rec)) return in_use(fd, rec, run_dir, path, 1);
        DG_LOG_WARN("run.lock = auto: the file system of %s does not support fcntl locks (%s); only a run "
                    "on this host is detected (docs/reliability.md, \"Run directory\")",
                    run_dir, strerror(e));
    }
    dg_status_t s = write_record(fd, path);
    if (s != DG_OK) {
        close(fd);
        return s;
    }
    dg_fs_lock_t *l = dg_xcalloc(1, sizeof *l);
    l->fd = fd;
    *out = l;
    return DG_OK;
}

void dg_fs_lock_release(dg_fs_lock_t *l) {
    if (!l) return;
    close(l->fd); /* drops the fcntl lock; the record stays as "who ran here last" */
    free(l);
}
