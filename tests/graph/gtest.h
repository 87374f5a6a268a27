/* gtest.h — the check macros the graph tests share: those of tests/lib/dg_check.h (EXPECT counts a failure
 * and goes on, OK stops the test at the first error status, with dg_last_error()). Each test returns
 * dg_fails != 0. */
#ifndef DG_TESTS_GRAPH_GTEST_H
#define DG_TESTS_GRAPH_GTEST_H
#include <stdio.h>
#include <stdlib.h>

#include "dg_check.h"
#include "dg_common.h"
#endif
