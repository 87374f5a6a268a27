/* test_env.c — the DG_* environment registry (src/common/env.c): the table's own rules (unique names,
 * DG_TEST_ prefix exactly for hooks, defaults of their type, one-line docs), strict parsing of every type,
 * the accessors (unset, empty, set, hooks compiled in or out), dg_env_check refusing a malformed value with
 * one line naming it, and an unregistered name or a wrong accessor asserting (in a forked child).
 *
 *   test_env CASE     CASE: table | parse | access | check | assert
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dg_common.h"
#include "dg_check.h"
#include "dg_env.h"

static void case_table(void) {
    CHECK(dg_env_count() >= 30, "only %d switches registered", dg_env_count());
    for (int i = 0; i < dg_env_count(); i++) {
        const dg_env_var_t *v = dg_env_at(i);
        CHECK(strncmp(v->name, "DG_", 3) == 0, "%s: not a DG_ name", v->name);
        int hookname = strncmp(v->name, "DG_TEST_", 8) == 0;
        CHECK(hookname == (v->kind == DG_ENV_TEST), "%s: DG_TEST_ prefix iff test hook", v->name);
        CHECK(dg_env_find(v->name) == v, "%s: registered twice", v->name);
        CHECK(v->doc && *v->doc && !strchr(v->doc, '\n') && strlen(v->doc) < 110, "%s: doc not one line",
              v->name);
        int b;
        int64_t x;
        double d;
        if (*v->dflt)
            CHECK(dg_env_parse(v, v->dflt, &b, &x, &d) == DG_OK, "%s: default '%s' is not its type: %s",
                  v->name, v->dflt, dg_last_error());
    }
    CHECK(dg_env_find("DG_NO_SUCH_SWITCH") == NULL, "unregistered name found");
}

static void expect_bad(const char *name, const char *text, const char *type_words) {
    const dg_env_var_t *v = dg_env_find(name);
    DG_ASSERT(v);
    int b;
    int64_t x;
    double d;
    dg_status_t s = dg_env_parse(v, text, &b, &x, &d);
    char want[256];
    snprintf(want, sizeof want, "environment: %s='%s' is not %s", name, text, type_words);
    CHECK(s == DG_ERR_USAGE && strcmp(dg_last_error(), want) == 0, "%s=%s: status %d, '%s' (want '%s')", name,
          text, s, dg_last_error(), want);
}

static void case_parse(void) {
    const dg_env_var_t *bv = dg_env_find("DG_SYNC_HOST_READS"), *iv = dg_env_find("DG_BOOT_RANKS_PER_NODE"),
                       *dv = dg_env_find("DG_TEST_COMM_PROBE_DELAY_S");
    DG_ASSERT(bv && iv && dv);
    static const char *on[] = {"1", "true", "on", "yes", "TRUE", "Yes"},
                      *off[] = {"0", "false", "off", "no", "OFF"};
    for (size_t i = 0; i < sizeof on / sizeof *on; i++) {
        int b = -1;
        CHECK(dg_env_parse(bv, on[i], &b, NULL, NULL) == DG_OK && b == 1, "bool '%s' -> %d", on[i], b);
    }
    for (size_t i = 0; i < sizeof off / sizeof *off; i++) {
        int b = -1;
        CHECK(dg_env_parse(bv, off[i], &b, NULL, NULL) == DG_OK && b == 0, "bool '%s' -> %d", off[i], b);
    }
    const char *bools = "a bool (0, 1, true, false, on, off, yes, no)";
    expect_bad("DG_SYNC_HOST_READS", "2", bools);
    expect_bad("DG_SYNC_HOST_READS", "y", bools);
    expect_bad("DG_SYNC_HOST_READS", " 1", bools);
    int64_t x = 0;
    CHECK(dg_env_parse(iv, "-17", NULL, &x, NULL) == DG_OK && x == -17, "int -17 -> %lld", (long long)x);
    CHECK(dg_env_parse(iv, "9007199254740993", NULL, &x, NULL) == DG_OK && x == 9007199254740993LL,
          "int 2^53+1");
    const char *ints = "a whole decimal number";
    expect_bad("DG_BOOT_RANKS_PER_NODE", "12x", ints);
    expect_bad("DG_BOOT_RANKS_PER_NODE", "1.5", ints);
    expect_bad("DG_BOOT_RANKS_PER_NODE", "99999999999999999999", ints);
    expect_bad("DG_BOOT_RANKS_PER_NODE", "four", ints);
    double d = 0;
    CHECK(dg_env_parse(dv, "1e-3", NULL, NULL, &d) == DG_OK && d == 1e-3, "double 1e-3 -> %g", d);
    const char *dbls = "a finite number";
    expect_bad("DG_TEST_COMM_PROBE_DELAY_S", "nan", dbls);
    expect_bad("DG_TEST_COMM_PROBE_DELAY_S", "1e999", dbls);
    expect_bad("DG_TEST_COMM_PROBE_DELAY_S", "0.8s", dbls);
}

static void case_access(void) {
    unsetenv("DG_CKPT_DIRECT_CHUNKS");
    CHECK(dg_env_bool("DG_CKPT_DIRECT_CHUNKS") == 1, "unset bool reads its default 1");
    setenv("DG_CKPT_DIRECT_CHUNKS", "", 1);
    CHECK(dg_env_bool("DG_CKPT_DIRECT_CHUNKS") == 1, "empty bool reads its default 1");
    setenv("DG_CKPT_DIRECT_CHUNKS", "off", 1);
    CHECK(dg_env_bool("DG_CKPT_DIRECT_CHUNKS") == 0, "off reads 0");
    setenv("DG_COMM_RING_SEG_KB", "64", 1);
    CHECK(dg_env_int("DG_COMM_RING_SEG_KB") == 64, "int 64");
    unsetenv("DG_COMM_RING_SEG_KB");
    CHECK(dg_env_int("DG_COMM_RING_SEG_KB") == 512, "int default 512");
    unsetenv("DG_CUDA_GEMM_TUNE_FILE");
    CHECK(dg_env_str("DG_CUDA_GEMM_TUNE_FILE") == NULL, "unset path is NULL");
    setenv("DG_CUDA_GEMM_TUNE_FILE", "", 1);
    const char *e = dg_env_str("DG_CUDA_GEMM_TUNE_FILE");
    CHECK(e && *e == 0, "a path set to '' reads '' (means: no file), not unset");
    unsetenv("DG_CUDA_GEMM_TUNE_FILE");
    /* hooks: their value only when compiled in, the default otherwise */
    setenv("DG_TEST_STALL_RANK", "3", 1);
    setenv("DG_TEST_CKPT_FAIL", "write@1", 1);
    setenv("DG_TEST_FS_NO_LOCKS", "1", 1);
    if (dg_env_hooks_compiled()) {
        CHECK(dg_env_int("DG_TEST_STALL_RANK") == 3, "hook int set");
        CHECK(dg_env_str("DG_TEST_CKPT_FAIL") && !strcmp(dg_env_str("DG_TEST_CKPT_FAIL"), "write@1"),
              "hook str");
        CHECK(dg_env_bool("DG_TEST_FS_NO_LOCKS") == 1, "hook bool");
    } else {
        CHECK(dg_env_int("DG_TEST_STALL_RANK") == -1, "compiled-out hook reads its default -1");
        CHECK(dg_env_str("DG_TEST_CKPT_FAIL") == NULL, "compiled-out string hook reads NULL");
        CHECK(dg_env_bool("DG_TEST_FS_NO_LOCKS") == 0, "compiled-out bool hook reads 0");
    }
    printf("hooks compiled in: %d\n", dg_env_hooks_compiled());
}

static void case_check(void) {
    char *buf = NULL;
    size_t len = 0;
    FILE *w = open_memstream(&buf, &len);
    DG_ASSERT(w);
    setenv("DG_BOOT_RANKS_PER_NODE", "8", 1);
    setenv("DG_TEST_STALL_STEP", "5", 1);
    CHECK(dg_env_check(w) == DG_OK, "valid values: %s", dg_last_error());
    fflush(w);
    if (dg_env_hooks_compiled())
        CHECK(len == 0, "no warning with hooks compiled in: %s", buf);
    else
        CHECK(strstr(buf,
                     "warning: DG_TEST_STALL_STEP is set but ignored: test hooks are not compiled into this "
                     "build") &&
                  !strchr(strchr(buf, '\n') + 1, '\n'),
              "one warning line for the compiled-out hook: '%s'", buf);
    setenv("DG_BOOT_RANKS_PER_NODE", "eight", 1);
    CHECK(dg_env_check(NULL) == DG_ERR_USAGE &&
              !strcmp(dg_last_error(),
                      "environment: DG_BOOT_RANKS_PER_NODE='eight' is not a whole decimal number"),
          "malformed value refused: %s", dg_last_error());
    unsetenv("DG_BOOT_RANKS_PER_NODE");
    unsetenv("DG_TEST_STALL_STEP");
    /* a former switch that is a config key now: not registered, not read, one line naming the key */
    CHECK(dg_env_find("DG_CKPT_THREADS") == NULL && dg_env_find("DG_CKPT_SPACE_CHECK") == NULL,
          "moved switches are not in the registry");
    char *mbuf = NULL;
    size_t mlen = 0;
    FILE *mw = open_memstream(&mbuf, &mlen);
    DG_ASSERT(mw);
    setenv("DG_CKPT_THREADS", "four", 1);
    CHECK(dg_env_check(mw) == DG_OK, "a moved switch is never refused: %s", dg_last_error());
    fclose(mw);
    CHECK(mbuf && !strcmp(mbuf, "warning: DG_CKPT_THREADS is no longer read: it is the config key "
                                "checkpoint.threads now (--set checkpoint.threads=VALUE)\n"),
          "one line naming the key: '%s'", mbuf ? mbuf : "");
    free(mbuf);
    unsetenv("DG_CKPT_THREADS");
    /* a malformed hook is refused when the hooks are compiled in, only warned about otherwise */
    setenv("DG_TEST_STALL_STEP", "soon", 1);
    dg_status_t s = dg_env_check(NULL);
    CHECK(s == (dg_env_hooks_compiled() ? DG_ERR_USAGE : DG_OK), "malformed hook: status %d", s);
    unsetenv("DG_TEST_STALL_STEP");
    fclose(w);
    free(buf);
}

/* The child's termination signal when it runs fn (0 = it returned). */
static int child_signal(void (*fn)(void)) {
    fflush(NULL);
    pid_t p = fork();
    DG_ASSERT(p >= 0);
    if (p == 0) {
        fn();
        _exit(0);
    }
    int st = 0;
    DG_ASSERT(waitpid(p, &st, 0) == p);
    return WIFSIGNALED(st) ? WTERMSIG(st) : 0;
}
static void read_unregistered(void) {
    (void)dg_env_bool("DG_NO_SUCH_SWITCH");
}
static void read_wrong_type(void) {
    (void)dg_env_int("DG_SYNC_HOST_READS");
}
static void read_malformed(void) {
    setenv("DG_CKPT_THREADS", "x", 1);
    (void)dg_env_int("DG_CKPT_THREADS");
}

static void case_assert(void) {
    CHECK(child_signal(read_unregistered) == SIGABRT, "an unregistered name asserts");
    CHECK(child_signal(read_wrong_type) == SIGABRT, "a wrong accessor asserts");
    CHECK(child_signal(read_malformed) == SIGABRT, "a malformed value past dg_env_check asserts");
}

int main(int argc, char **argv) {
    static const dg_check_case_t cases[] = {DG_CASE(table), DG_CASE(parse), DG_CASE(access), DG_CASE(check),
                                            DG_CASE(assert)};
    return DG_CHECK_CASES(argc, argv, cases, "CASE", NULL, 0, NULL);
}
