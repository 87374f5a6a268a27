/* test_common.c — tests of src/common's file rules and JSON escaper on the real file system: files are
 * never created or written through a planted symlink (the link is refused, or replaced for the atomic
 * write, and its target stays untouched), FIFOs and directories at a file's name are refused without
 * blocking, nothing created is world-writable under umask 000, the run-directory lock refuses a second
 * holder (another process) naming it and dies with its holder (SIGKILL), and dg_json_quote's rule.
 * `json-dump N SEED` prints N random byte strings and their quoted forms for json_check.py, which
 * parses them with Python's strict json module. One binary; argv[1] names the case (one ctest each). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "dg_common.h"
#include "dg_check.h"
#include "dg_fs.h"
#include "dg_json.h"
#include "dg_mesh.h"

static char g_tmp[256];

static void path(char *buf, size_t cap, const char *name) {
    dg_fmt(buf, cap, "%s/%s", g_tmp, name);
}

static void write_text(const char *p, const char *text) {
    FILE *f = fopen(p, "w");
    DG_ASSERT(f != NULL);
    fputs(text, f);
    fclose(f);
}

static int file_is(const char *p, const char *text) {
    char buf[256] = "";
    FILE *f = fopen(p, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    return strcmp(buf, text) == 0;
}

static mode_t mode_of(const char *p) {
    struct stat st;
    DG_ASSERT(lstat(p, &st) == 0);
    return st.st_mode;
}

/* ---------------------------------------------------------------- symlinks, FIFOs, directories */

/* outside.txt holding "precious\n" (its path in target) and a symbolic link NAME to it (in link); both
 * buffers of cap bytes */
static void plant_link(char *target, char *link, size_t cap, const char *name) {
    path(target, cap, "outside.txt");
    write_text(target, "precious\n");
    path(link, cap, name);
    DG_ASSERT(symlink(target, link) == 0);
}

static void case_nofollow(void) {
    char target[512], link[512], p[512];
    plant_link(target, link, sizeof target, "metrics.jsonl");
    /* append (metrics.jsonl, logs/rank-N.log): refused, naming the link and its target */
    FILE *f = NULL;
    dg_status_t s = dg_fs_fopen_append(link, &f);
    CHECK(s == DG_ERR_USAGE && f == NULL, "append through a link: %d", s);
    CHECK(strstr(dg_last_error(), link) && strstr(dg_last_error(), "symbolic link") &&
              strstr(dg_last_error(), target),
          "message: %s", dg_last_error());
    CHECK(file_is(target, "precious\n"), "the link's target was written");
    /* a dangling link is not followed either (it would create the target) */
    char dang[512], dang_target[512];
    path(dang, sizeof dang, "dangling");
    path(dang_target, sizeof dang_target, "created-through-link");
    DG_ASSERT(symlink(dang_target, dang) == 0);
    int fd = -1;
    s = dg_fs_open_nofollow(dang, O_RDWR | O_CREAT, &fd);
    CHECK(s == DG_ERR_USAGE && fd < 0, "dangling link: %d", s);
    CHECK(access(dang_target, F_OK) != 0, "a file was created through a dangling link");
    /* a FIFO: refused at once (opening it for writing must not block) */
    path(p, sizeof p, "fifo");
    DG_ASSERT(mkfifo(p, 0644) == 0);
    double t0 = dg_now_s();
    s = dg_fs_open_nofollow(p, O_WRONLY | O_APPEND | O_CREAT, &fd);
    CHECK(s == DG_ERR_USAGE && strstr(dg_last_error(), "a FIFO") && dg_now_s() - t0 < 5, "fifo: %d %s", s,
          dg_last_error());
    s = dg_fs_open_nofollow(p, O_RDWR | O_CREAT, &fd);
    CHECK(s == DG_ERR_USAGE, "fifo rdwr: %d %s", s, dg_last_error());
    /* a directory at the name */
    path(p, sizeof p, "adir");
    DG_ASSERT(mkdir(p, 0755) == 0);
    s = dg_fs_open_nofollow(p, O_WRONLY | O_APPEND | O_CREAT, &fd);
    CHECK(s == DG_ERR_USAGE && strstr(dg_last_error(), "directory"), "dir: %d %s", s, dg_last_error());
    /* a directory that is itself a symlink (the user's run.dir) is followed */
    char real[512], alias[512];
    path(real, sizeof real, "realdir");
    path(alias, sizeof alias, "aliasdir");
    DG_ASSERT(mkdir(real, 0755) == 0 && symlink(real, alias) == 0);
    dg_fmt(p, sizeof p, "%s/log.txt", alias);
    s = dg_fs_fopen_append(p, &f);
    CHECK(s == DG_OK && f, "file under a symlinked directory: %s", dg_last_error());
    if (f) {
        fputs("ok\n", f);
        fclose(f);
    }
    dg_fmt(p, sizeof p, "%s/log.txt", real);
    CHECK(file_is(p, "ok\n"), "written under the symlinked directory");
    /* the logger: logs/rank-N.log through a planted link is refused */
    char logs[512];
    path(logs, sizeof logs, "logs");
    DG_ASSERT(mkdir(logs, 0755) == 0);
    dg_fmt(p, sizeof p, "%s/rank-3.log", logs);
    DG_ASSERT(symlink(target, p) == 0);
    s = dg_log_init(3, "host", DG_LOG_INFO, logs);
    CHECK(s == DG_ERR_USAGE && strstr(dg_last_error(), "rank-3.log"), "log through a link: %d %s", s,
          dg_last_error());
    CHECK(file_is(target, "precious\n"), "the log's link target was written");
    dg_log_close();
}

static void case_atomic(void) {
    char target[512], p[512], tmp[600];
    /* a link at the destination is replaced, not followed */
    plant_link(target, p, sizeof target, "LATEST");
    CHECK(dg_write_file_atomic(p, "step_1\n", 7) == DG_OK, "%s", dg_last_error());
    CHECK(S_ISREG(mode_of(p)) && file_is(p, "step_1\n"), "LATEST is now a regular file with the new text");
    CHECK(file_is(target, "precious\n"), "the link's target was written");
    /* a link planted at the temporary name is removed, not followed */
    dg_fmt(tmp, sizeof tmp, "%s.tmp.%d", p, (int)getpid());
    DG_ASSERT(symlink(target, tmp) == 0);
    CHECK(dg_write_file_atomic(p, "step_2\n", 7) == DG_OK, "%s", dg_last_error());
    CHECK(file_is(p, "step_2\n") && file_is(target, "precious\n"), "temporary link followed");
    CHECK(access(tmp, F_OK) != 0 && errno == ENOENT, "the temporary name is gone");
    /* a directory at the destination: a clear error, nothing left behind */
    path(p, sizeof p, "isdir");
    DG_ASSERT(mkdir(p, 0755) == 0);
    CHECK(dg_write_file_atomic(p, "x", 1) == DG_ERR_RUNTIME && strstr(dg_last_error(), p), "%s",
          dg_last_error());
    dg_fmt(tmp, sizeof tmp, "%s.tmp.%d", p, (int)getpid());
    CHECK(access(tmp, F_OK) != 0, "temporary file left behind");
}

/* ---------------------------------------------------------------- umask */

static void case_umask(void) {
    umask(0);
    mode_t old = dg_fs_secure_umask();
    CHECK(old == 0, "previous umask %o", (unsigned)old);
    mode_t now = umask(0);
    umask(now);
    CHECK(now == 02, "umask after dg_fs_secure_umask from 000: %03o", (unsigned)now);
    umask(0); /* the helpers alone, without the process umask, must not create world-writable files */
    char p[512];
    path(p, sizeof p, "a/b/c");
    CHECK(dg_mkdir_p(p) == DG_OK, "%s", dg_last_error());
    path(p, sizeof p, "a");
    CHECK(!(mode_of(p) & S_IWOTH), "dir a mode %o", (unsigned)mode_of(p));
    path(p, sizeof p, "a/b/c");
    CHECK(!(mode_of(p) & S_IWOTH), "dir c mode %o", (unsigned)mode_of(p));
    path(p, sizeof p, "a/metrics.jsonl");
    FILE *f = NULL;
    CHECK(dg_fs_fopen_append(p, &f) == DG_OK, "%s", dg_last_error());
    if (f) fclose(f);
    CHECK(!(mode_of(p) & S_IWOTH), "file mode %o", (unsigned)mode_of(p));
    path(p, sizeof p, "a/LATEST");
    CHECK(dg_write_file_atomic(p, "x\n", 2) == DG_OK, "%s", dg_last_error());
    CHECK(!(mode_of(p) & S_IWOTH), "atomic file mode %o", (unsigned)mode_of(p));
    /* an existing world-writable file opened for writing loses that bit */
    path(p, sizeof p, "a/old.log");
    write_text(p, "");
    chmod(p, 0666);
    int fd = -1;
    CHECK(dg_fs_open_nofollow(p, O_WRONLY | O_APPEND, &fd) == DG_OK, "%s", dg_last_error());
    if (fd >= 0) close(fd);
    CHECK(!(mode_of(p) & S_IWOTH), "old file mode %o", (unsigned)mode_of(p));
    umask(022);
}

/* ---------------------------------------------------------------- the run-directory lock */

static void case_lock(void) {
    int pipefd[2];
    DG_ASSERT(pipe(pipefd) == 0);
    pid_t child = fork();
    DG_ASSERT(child >= 0);
    if (child == 0) { /* the holder: takes the lock, says so, sleeps until killed */
        close(pipefd[0]);
        dg_fs_lock_t *l = NULL;
        char ok = dg_fs_lock_rundir(g_tmp, "auto", 0, &l) == DG_OK ? 'y' : 'n';
        if (write(pipefd[1], &ok, 1) != 1) _exit(3);
        for (;;)
            pause();
    }
    close(pipefd[1]);
    char ok = 0;
    CHECK(read(pipefd[0], &ok, 1) == 1 && ok == 'y', "the child could not take the lock");
    close(pipefd[0]);
    dg_fs_lock_t *l = NULL;
    dg_status_t s = dg_fs_lock_rundir(g_tmp, "auto", 0, &l);
    char pid[32];
    dg_fmt(pid, sizeof pid, "pid %d,", (int)child);
    CHECK(s == DG_ERR_USAGE && l == NULL, "a second holder was let in: %d", s);
    CHECK(strstr(dg_last_error(), "is in use by another dgtrain run") && strstr(dg_last_error(), pid) &&
              strstr(dg_last_error(), "started ") && strstr(dg_last_error(), "no Slurm job"),
          "holder not named: %s", dg_last_error());
    s = dg_fs_lock_rundir(g_tmp, "fcntl", 0, &l);
    CHECK(s == DG_ERR_USAGE && strstr(dg_last_error(), pid), "fcntl mode: %d %s", s, dg_last_error());
    s = dg_fs_lock_rundir(g_tmp, "none", 0, &l);
    CHECK(s == DG_OK && l == NULL, "none mode: %d", s);
    /* the lock dies with its holder, however it dies */
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    s = dg_fs_lock_rundir(g_tmp, "auto", 0, &l);
    CHECK(s == DG_OK && l != NULL, "after SIGKILL of the holder: %d %s", s, dg_last_error());
    dg_fs_lock_release(l);
    CHECK(dg_fs_lock_rundir(g_tmp, "sometimes", 0, &l) == DG_ERR_USAGE, "bad mode accepted");
    /* a link planted at the lock file's name is refused */
    char target[512], lp[512];
    path(target, sizeof target, "outside.txt");
    write_text(target, "precious\n");
    char sub[512];
    path(sub, sizeof sub, "run2");
    DG_ASSERT(mkdir(sub, 0755) == 0);
    dg_fmt(lp, sizeof lp, "%s/%s", sub, DG_RUNDIR_LOCK_NAME);
    DG_ASSERT(symlink(target, lp) == 0);
    s = dg_fs_lock_rundir(sub, "auto", 0, &l);
    CHECK(s == DG_ERR_USAGE && strstr(dg_last_error(), "symbolic link"), "lock link: %d %s", s,
          dg_last_error());
    CHECK(file_is(target, "precious\n"), "the lock link's target was written");
}

/* ---------------------------------------------------------------- mesh entries */

static void case_mesh(void) {
    static const char *bad[] = {",,,", ",",      "dp_shard=2,", ",dp_shard=2", "dp_shard=2,,tp=1",
                                " , ", "tp=1, ,"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        dg_mesh_shape_t m;
        int is_auto = 0;
        dg_status_t s = dg_mesh_parse(bad[i], 0, &m, &is_auto);
        CHECK(s == DG_ERR_USAGE && strstr(dg_last_error(), "is empty"), "'%s' accepted (%d: %s)", bad[i], s,
              dg_last_error());
    }
    dg_mesh_shape_t m;
    int is_auto = 0;
    CHECK(dg_mesh_parse(" dp_shard=2 , tp=1 ", 2, &m, &is_auto) == DG_OK && m.size[1] == 2, "spaces: %s",
          dg_last_error());
    CHECK(dg_mesh_parse("dp_replicate=1,dp_shard=2,tp=2,order=tp,dp_shard,dp_replicate", 4, &m, &is_auto) ==
              DG_OK,
          "order list: %s", dg_last_error());
}

/* ---------------------------------------------------------------- JSON */

static void expect_quote(const char *in, const char *want) {
    char buf[256];
    size_t n = dg_json_quote(buf, sizeof buf, in);
    CHECK(strcmp(buf, want) == 0 && n == strlen(want), "quote: got %s want %s", buf, want);
    char *d = dg_json_quote_dup(in);
    CHECK(strcmp(d, want) == 0, "dup: %s", d);
    free(d);
}

static void case_json(void) {
    expect_quote("", "\"\"");
    expect_quote(NULL, "\"\"");
    expect_quote("a\"b\\c/d", "\"a\\\"b\\\\c/d\"");
    expect_quote("\n\t\r\b\f\x01\x1f\x7f", "\"\\n\\t\\r\\b\\f\\u0001\\u001f\\u007f\"");
    expect_quote("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80",
                 "\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\"");
    /* not UTF-8: a lone 0xff, a truncated sequence, an overlong '/', a surrogate, beyond U+10FFFF */
    expect_quote("\xff", "\"\\u00ff\"");
    expect_quote("\xc3(", "\"\\u00c3(\"");
    expect_quote("\xc0\xaf", "\"\\u00c0\\u00af\"");
    expect_quote("\xed\xa0\x80", "\"\\u00ed\\u00a0\\u0080\"");
    expect_quote("\xf4\x90\x80\x80", "\"\\u00f4\\u0090\\u0080\\u0080\"");
    expect_quote("\xe2\x82", "\"\\u00e2\\u0082\"");
    /* truncation: never inside an escape or a UTF-8 sequence, always closed */
    char small[9];
    size_t n = dg_json_quote(small, sizeof small, "ab\xff\xff");
    CHECK(n == strlen("\"ab\\u00ff\\u00ff\"") && strcmp(small, "\"ab\"") == 0, "truncated: %s (%zu)", small,
          n);
    n = dg_json_quote(small, sizeof small, "\xe2\x82\xac\xe2\x82\xac\xe2\x82\xac");
    CHECK(strcmp(small, "\"\xe2\x82\xac\xe2\x82\xac\"") == 0, "utf-8 truncated: %s", small);
    CHECK(dg_json_quote(NULL, 0, "abc") == 5, "length only");
    /* the stream writer says the same */
    char *buf = NULL;
    size_t cap = 0;
    FILE *m = open_memstream(&buf, &cap);
    dg_json_fputs(m, "x\xff\n\"");
    fclose(m);
    CHECK(strcmp(buf, "\"x\\u00ff\\n\\\"\"") == 0, "fputs: %s", buf);
    free(buf);
}

/* Random byte strings (every byte value, biased towards UTF-8 lead and continuation bytes) and their
 * quoted forms, one "HEX QUOTED" line each, for json_check.py. */
static int json_dump(int n, unsigned seed) {
    srand(seed);
    for (int i = 0; i < n; i++) {
        unsigned char s[64];
        int len = rand() % 40;
        for (int k = 0; k < len; k++) {
            int r = rand() % 8;
            s[k] = (unsigned char)(r < 3   ? 0x80 + rand() % 0x80
                                   : r < 5 ? 0xc0 + rand() % 0x40
                                           : 1 + rand() % 255);
        }
        s[len] = 0;
        for (int k = 0; k < len; k++)
            printf("%02x", s[k]);
        printf(" ");
        dg_json_fputs(stdout, (const char *)s);
        printf("\n");
    }
    return 0;
}

int main(int argc, char **argv) {
    static const dg_check_case_t cases[] = {DG_CASE(nofollow), DG_CASE(atomic), DG_CASE(umask),
                                            DG_CASE(lock),     DG_CASE(mesh),   DG_CASE(json)};
    if (argc == 4 && strcmp(argv[1], "json-dump") == 0)
        return json_dump(atoi(argv[2]), (unsigned)atoi(argv[3]));
    return DG_CHECK_CASES(argc, argv, cases, "CASE | json-dump N SEED", g_tmp, sizeof g_tmp,
                          "dg_test_common");
}
