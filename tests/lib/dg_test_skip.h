/* dg_test_skip.h — the skip policy of the C tests, in one place (the same as tests/lib/skip.sh and
 * tests/lib/dgskip.py; docs/reliability.md, "The test suite itself"). Header-only: tests include it
 * (tests/CMakeLists.txt puts tests/lib on every test target's include path) and return its value.
 *
 *   return dg_test_skip(gpus, "no CUDA device: %s", why);
 *
 * Outside CI it prints "SKIP: ..." and returns 77 (ctest's SKIP_RETURN_CODE). Under CI (CI set to anything
 * but "", 0, false or no) it prints "FAIL: ..." and returns 1: a component that does not start on a CI
 * machine is a broken bring-up, and a skip would hide it. gpus > 0: the missing component is that many
 * GPUs, and a machine that has fewer (as the NVIDIA driver lists them, so a present GPU that CUDA cannot
 * use still fails in CI) skips in CI too. */
#ifndef DG_TEST_SKIP_H
#define DG_TEST_SKIP_H

#include <glob.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static inline int dg_test_in_ci(void) {
    const char *ci = getenv("CI");
    if (!ci || !*ci) return 0;
    static const char *const no[] = {"0", "false", "FALSE", "False", "no", "NO"};
    for (size_t i = 0; i < sizeof no / sizeof no[0]; i++)
        if (!strcmp(ci, no[i])) return 0;
    return 1;
}

/* NVIDIA GPUs on this machine whether or not CUDA can use them, limited by CUDA_VISIBLE_DEVICES */
static inline int dg_test_gpus_present(void) {
    int n = 0;
    static const char *const pats[] = {"/proc/driver/nvidia/gpus/*", "/dev/nvidia[0-9]*"};
    for (int i = 0; i < 2 && n == 0; i++) {
        glob_t g;
        memset(&g, 0, sizeof g);
        if (glob(pats[i], 0, NULL, &g) == 0) n = (int)g.gl_pathc;
        globfree(&g);
    }
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    if (vis) {
        int v = 0;
        for (const char *p = vis; *p;) {
            while (*p == ' ' || *p == ',')
                p++;
            if (!*p) break;
            if (*p != '-') v++;
            while (*p && *p != ',')
                p++;
        }
        if (v < n) n = v;
    }
    return n;
}

/* The exit status for a component that did not start (77 or 1), without printing: for the ranks of an MPI
 * test other than the one that prints. */
static inline int dg_test_skip_rc(int gpus) {
    if (!dg_test_in_ci()) return 77;
    return gpus > 0 && dg_test_gpus_present() < gpus ? 77 : 1;
}

__attribute__((format(printf, 2, 3))) static inline int dg_test_skip(int gpus, const char *fmt, ...) {
    char why[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    int rc = dg_test_skip_rc(gpus);
    if (!dg_test_in_ci())
        printf("SKIP: %s\n", why);
    else if (rc == 77)
        printf("SKIP: %s (CI=%s, but this machine has fewer than %d GPU(s))\n", why, getenv("CI"), gpus);
    else
        printf("FAIL: %s (CI=%s: a component that does not start fails the test instead of skipping it; see "
               "docs/reliability.md)\n",
               why, getenv("CI"));
    fflush(stdout);
    return rc;
}

#endif
