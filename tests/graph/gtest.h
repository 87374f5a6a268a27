/* gtest.h — the check macros the graph tests share: EXPECT counts a failure and goes on, OK stops the
 * test at the first error status (with dg_last_error()). Each test returns failures != 0. */
#ifndef DG_TESTS_GRAPH_GTEST_H
#define DG_TESTS_GRAPH_GTEST_H
#include <stdio.h>
#include <stdlib.h>

#include "dg_common.h"

static int failures;
#define EXPECT(cond, ...)                                                                                    \
    do {                                                                                                     \
        if (!(cond)) {                                                                                       \
            failures++;                                                                                      \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                                             \
            fprintf(stderr, __VA_ARGS__);                                                                    \
            fputc('\n', stderr);                                                                             \
        }                                                                                                    \
    } while (0)
#define OK(expr)                                                                                             \
    do {                                                                                                     \
        dg_status_t s_ = (expr);                                                                             \
        if (s_ != DG_OK) {                                                                                   \
            fprintf(stderr, "FAIL %s:%d: %s -> %d: %s\n", __FILE__, __LINE__, #expr, s_, dg_last_error());   \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)
#endif
