/* dg_test_args.h — a test driver's "--name value" options as one table instead of an if-chain. Header-only
 * (static inline), on every test target's include path (tests/lib).
 *
 * A table row names an option, how its value is read and where it goes:
 *   DG_ARG_STR  const char *  the argument itself        DG_ARG_LL   long long  atoll
 *   DG_ARG_INT  int           atoi                       DG_ARG_I64  int64_t    atoll
 *   DG_ARG_F64  double        atof                       DG_ARG_U32  uint32_t   (uint32_t)atoll
 *   DG_ARG_FLAG int           set to 1, takes no value
 * dg_arg_find looks a name up (NULL: not in the table); dg_arg_store stores a value (NULL for a flag).
 * The driver's loop keeps its own messages and exit codes for an unknown option or a missing value. */
#ifndef DG_TEST_ARGS_H
#define DG_TEST_ARGS_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef enum {
    DG_ARG_STR,
    DG_ARG_INT,
    DG_ARG_LL,
    DG_ARG_I64,
    DG_ARG_U32,
    DG_ARG_F64,
    DG_ARG_FLAG
} dg_arg_kind_t;

typedef struct {
    const char *name; /* "--dir" */
    dg_arg_kind_t kind;
    void *dst; /* the variable of the kind's type */
} dg_arg_t;

/* The row of tab[0..n) named `name`, or NULL */
static inline const dg_arg_t *dg_arg_find(const dg_arg_t *tab, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(tab[i].name, name)) return &tab[i];
    return NULL;
}

/* Stores v, read as a's kind says, into a->dst (v is not read for a flag) */
static inline void dg_arg_store(const dg_arg_t *a, const char *v) {
    switch (a->kind) {
    case DG_ARG_STR:
        *(const char **)a->dst = v;
        break;
    case DG_ARG_INT:
        *(int *)a->dst = atoi(v);
        break;
    case DG_ARG_LL:
        *(long long *)a->dst = atoll(v);
        break;
    case DG_ARG_I64:
        *(int64_t *)a->dst = atoll(v);
        break;
    case DG_ARG_U32:
        *(uint32_t *)a->dst = (uint32_t)atoll(v);
        break;
    case DG_ARG_F64:
        *(double *)a->dst = atof(v);
        break;
    case DG_ARG_FLAG:
        *(int *)a->dst = 1;
        break;
    }
}

#endif
