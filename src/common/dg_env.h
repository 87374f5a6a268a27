/* dg_env.h — the one registry of dgtrain's DG_* environment switches (docs/design.md §2).
 *
 * Every DG_* variable any dgtrain program reads is a row of the table in env.c: name, type, default,
 * kind and a one-line doc. Code reads them only through the accessors below, never getenv (the ctest
 * check env_registry_check greps for that).
 *
 * Contracts:
 * - The name passed to an accessor must be registered (an unregistered name is a programming error:
 *   DG_ASSERT), and the accessor's type must be the row's type (bool for dg_env_bool...; str for string
 *   and path rows).
 * - An unset variable, or (bool/int/double) one set to the empty string, reads as the default.
 * - Values are parsed strictly: bool 0|1|true|false|on|off|yes|no, int a whole decimal number in the
 *   int64 range, double a finite number. Entry points (dgtrain, dgvalidate, dgckpt, dgprep) call
 *   dg_env_check() first and exit 1 on its error, so a malformed value never reaches an accessor; an
 *   accessor that still meets one asserts (the entry point forgot the check).
 * - Test hooks (kind DG_ENV_TEST, every name DG_TEST_*) are compiled in only when the build defines
 *   DG_TEST_HOOKS (CMake -DDGT_TEST_HOOKS=ON). Without it their accessors return the default whatever the
 *   environment holds, and dg_env_check() warns once per set hook that it is ignored.
 */
#ifndef DG_ENV_H
#define DG_ENV_H

#include <stdint.h>
#include <stdio.h>

#include "dg_common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { DG_ENV_BOOL, DG_ENV_INT, DG_ENV_DOUBLE, DG_ENV_STRING, DG_ENV_PATH } dg_env_type_t;
typedef enum { DG_ENV_USER, DG_ENV_TEST } dg_env_kind_t;

typedef struct {
    const char *name;
    dg_env_type_t type;
    const char *dflt; /* default as text ("" = none / built-in behaviour described in doc) */
    dg_env_kind_t kind;
    const char *doc; /* one line */
} dg_env_var_t;

/* The registry: n rows (dg_env_count()), in the order printed by --print-env. */
int dg_env_count(void);
const dg_env_var_t *dg_env_at(int i);
const dg_env_var_t *dg_env_find(const char *name); /* NULL if not registered */

/* 1 when the test hooks are compiled into this build. */
int dg_env_hooks_compiled(void);

/* "bool", "int", "double", "string", "path". */
const char *dg_env_type_name(dg_env_type_t t);

/* Parse `text` as a value of `v`'s type into *b / *i / *d (the one matching the type; others may be
 * NULL). DG_ERR_USAGE with one line naming the variable, the value and the expected type. */
dg_status_t dg_env_parse(const dg_env_var_t *v, const char *text, int *b, int64_t *i, double *d);

/* Check every registered variable that is set: DG_ERR_USAGE on the first malformed one. With the hooks
 * compiled out, a set DG_TEST_* variable prints one warning line to `warn` (if not NULL) that it is
 * ignored. A set former switch that is a config key now (DG_CKPT_THREADS, DG_CKPT_SPACE_CHECK,
 * DG_NCCL_NONBLOCKING) prints one warning line naming the key; its value is not read. */
dg_status_t dg_env_check(FILE *warn);

/* Typed accessors (see the contracts above). dg_env_str returns NULL when unset, else the raw value
 * (possibly ""), and NULL for a hook compiled out. */
int dg_env_bool(const char *name);
int64_t dg_env_int(const char *name);
double dg_env_double(const char *name);
const char *dg_env_str(const char *name);

/* One line per variable: name, type, default, current value (or "unset", or "not compiled in" for a
 * hook of a build without them), doc. json: one JSON document {"test_hooks_compiled":..,"vars":[...]}. */
void dg_env_print(FILE *out, int json);

#ifdef __cplusplus
}
#endif

#endif
