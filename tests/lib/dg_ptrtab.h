/* dg_ptrtab.h — a table of the blocks a test's wrapping backend has handed out and not yet taken back
 * (tests/graph: the executor's fallbacks count device allocations, the async reads check pinned host
 * memory): add on allocation, remove on free, then look up, sum or count what is outstanding. */
#ifndef DG_PTRTAB_H
#define DG_PTRTAB_H
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct {
    struct {
        char *p;
        size_t bytes;
    } e[4096];
    int n;
} dg_ptrtab_t;

/* Notes [p, p + bytes); a full table ends the test (exit 1) naming `what`. */
static inline void dg_ptrtab_add(dg_ptrtab_t *t, void *p, size_t bytes, const char *what) {
    if (t->n >= (int)(sizeof t->e / sizeof t->e[0])) {
        fprintf(stderr, "FAIL: the test's %s table is full\n", what);
        exit(1);
    }
    t->e[t->n].p = p;
    t->e[t->n].bytes = bytes;
    t->n++;
}

/* 1 when p was in the table (now removed), 0 when it was not. */
static inline int dg_ptrtab_remove(dg_ptrtab_t *t, const void *p) {
    for (int i = 0; i < t->n; i++)
        if (t->e[i].p == p) {
            t->e[i] = t->e[--t->n];
            return 1;
        }
    return 0;
}

/* 1 when [p, p + bytes) lies inside one block of the table. */
static inline int dg_ptrtab_holds(const dg_ptrtab_t *t, const void *p, size_t bytes) {
    const char *c = p;
    for (int i = 0; i < t->n; i++)
        if (c >= t->e[i].p && c + bytes <= t->e[i].p + t->e[i].bytes) return 1;
    return 0;
}

/* The bytes of every block still in the table. */
static inline size_t dg_ptrtab_bytes(const dg_ptrtab_t *t) {
    size_t s = 0;
    for (int i = 0; i < t->n; i++)
        s += t->e[i].bytes;
    return s;
}
#endif
