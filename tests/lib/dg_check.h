/* dg_check.h — the check macros and helpers every C test shares, in one place. Header-only: tests include
 * it (tests/CMakeLists.txt puts tests/lib on every test target's include path).
 *
 *   CHECK(cond)               counts a check; when cond is false counts a failure, prints
 *   CHECK(cond, fmt, ...)     "FAIL file:line: cond" (": message" after it when given) and goes on
 *   EXPECT(cond, fmt, ...)    the same, but the line names only the message, not the condition
 *   CHECK_STR(got, want)      strcmp(got, want) == 0, printing both strings when they differ
 *   OK(expr)                  expr is a dg_status_t; not DG_OK: prints it with dg_last_error() and exit(1)
 *
 * dg_fails counts the failed checks, dg_checks every CHECK/EXPECT/CHECK_STR made; a test returns
 * dg_fails != 0. An MPI test sets dg_check_rank to its rank, and failure lines then start "FAIL rank N ".
 * dg_check_cases runs the case a test binary's argv[1] names (a table of name and function; DG_CASE
 * makes an entry, DG_CHECK_CASES runs a whole table).
 * dg_check_done(what) ends a test with its summary line and exit code.
 * dg_test_mkdtemp / dg_test_rmtree make and remove a test's temporary directory.
 * A test made of several .c files defines DG_CHECK_SHARED for all of them (see below). */
#ifndef DG_CHECK_H
#define DG_CHECK_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef DG_CHECK_SHARED
/* A test executable built from several .c files compiles them all with DG_CHECK_SHARED: the counters are
 * then one set for the whole executable, defined in the file that defines DG_CHECK_SHARED_OWNER before
 * including this header (the one with main). Without DG_CHECK_SHARED each file has its own (static). */
extern int dg_fails;
extern int dg_checks;
extern int dg_check_rank;
#ifdef DG_CHECK_SHARED_OWNER
int dg_fails;
int dg_checks;
int dg_check_rank = -1;
#endif
#else
static int dg_fails;           /* failed checks */
static int dg_checks;          /* checks made */
static int dg_check_rank = -1; /* >= 0: the rank failure lines name */
#endif

/* One failure line: "FAIL [rank N ]file:line: [expr][: message]". fmt is " " (no message) or " message"
 * (the macros put a space before the caller's format, so a check without a message has a non-empty
 * format too). */
__attribute__((format(printf, 4, 5))) static inline void
dg_check_failed(const char *file, int line, const char *expr, const char *fmt, ...) {
    dg_fails++;
    fprintf(stderr, "FAIL ");
    if (dg_check_rank >= 0) fprintf(stderr, "rank %d ", dg_check_rank);
    fprintf(stderr, "%s:%d:", file, line);
    if (expr) fprintf(stderr, " %s", expr);
    if (fmt[1]) {
        if (expr) fputc(':', stderr);
        va_list ap;
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
    }
    fputc('\n', stderr);
}

#define CHECK(cond, ...)                                                                                     \
    do {                                                                                                     \
        dg_checks++;                                                                                         \
        if (!(cond)) dg_check_failed(__FILE__, __LINE__, #cond, " " __VA_ARGS__);                            \
    } while (0)

#define EXPECT(cond, ...)                                                                                    \
    do {                                                                                                     \
        dg_checks++;                                                                                         \
        if (!(cond)) dg_check_failed(__FILE__, __LINE__, NULL, " " __VA_ARGS__);                             \
    } while (0)

static inline void dg_check_str(const char *got, const char *want, const char *file, int line) {
    dg_checks++;
    if (strcmp(got, want) != 0) dg_check_failed(file, line, NULL, "\n  got:  %s\n  want: %s", got, want);
}
#define CHECK_STR(got, want) dg_check_str((got), (want), __FILE__, __LINE__)

#define OK(expr)                                                                                             \
    do {                                                                                                     \
        dg_status_t s_ = (expr);                                                                             \
        if (s_ != DG_OK) {                                                                                   \
            fprintf(stderr, "FAIL %s:%d: %s -> %d: %s\n", __FILE__, __LINE__, #expr, s_, dg_last_error());   \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

/* The end of a test: "N failure(s)" on stderr and 1, or "all WHAT tests passed" and 0 */
static inline int dg_check_done(const char *what) {
    if (dg_fails) {
        fprintf(stderr, "%d failure(s)\n", dg_fails);
        return 1;
    }
    printf("all %s tests passed\n", what);
    return 0;
}

/* A fresh directory /tmp/PREFIX_XXXXXX into buf (cap bytes); 0, or -1 with the reason printed. */
static inline int dg_test_mkdtemp(char *buf, size_t cap, const char *prefix) {
    if (snprintf(buf, cap, "/tmp/%s_XXXXXX", prefix) >= (int)cap || !mkdtemp(buf)) {
        perror("mkdtemp");
        return -1;
    }
    return 0;
}

/* rm -rf DIR; a warning (not a failure) when it does not go */
static inline void dg_test_rmtree(const char *dir) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", dir);
}

/* One case of a test binary that runs the case argv[1] names */
typedef struct {
    const char *name;
    void (*fn)(void);
} dg_check_case_t;

/* Runs cases[i] where argv[1] names it, or every case in order for "all"; argc must be 2 (usage: the
 * arguments the usage line names). tmp != NULL: each case runs with a fresh directory
 * /tmp/PREFIX_XXXXXX in tmp (cap bytes), removed after it. Returns 0 ("CASE: ok"), 1 when a check failed
 * ("CASE: N check(s) failed"), 2 for a bad command line. */
static inline int dg_check_cases(int argc, char **argv, const dg_check_case_t *cases, size_t n,
                                 const char *usage, char *tmp, size_t cap, const char *prefix) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s %s\n", argv[0], usage);
        return 2;
    }
    int ran = 0;
    for (size_t i = 0; i < n; i++) {
        if (strcmp(argv[1], "all") && strcmp(argv[1], cases[i].name)) continue;
        if (tmp && dg_test_mkdtemp(tmp, cap, prefix) != 0) return 1;
        cases[i].fn();
        if (tmp) dg_test_rmtree(tmp);
        ran++;
    }
    if (!ran) {
        fprintf(stderr, "unknown case %s\n", argv[1]);
        return 2;
    }
    if (dg_fails) {
        fprintf(stderr, "%s: %d check(s) failed\n", argv[1], dg_fails);
        return 1;
    }
    printf("%s: ok\n", argv[1]);
    return 0;
}

/* The case table entry {"NAME", case_NAME}: a test's cases are functions named case_NAME */
#define DG_CASE(name)                                                                                        \
    { #name, case_##name }

/* dg_check_cases over the array `cases` (its length taken from its type): DG_CHECK_CASES(argc, argv,
 * cases, usage, tmp, cap, prefix) */
#define DG_CHECK_CASES(argc, argv, cases, ...)                                                               \
    dg_check_cases((argc), (argv), (cases), sizeof(cases) / sizeof((cases)[0]), __VA_ARGS__)

#endif
