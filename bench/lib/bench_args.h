/* bench_args.h — a bench's command-line options from one spec string (header-only; every bench in bench/).
 *
 * spec lists the options, separated by spaces, each as NAME=KIND ("--steps=int"); dst[k] is where the k-th
 * option's value goes. KIND says how:
 *   flag  no value: the int is set to 1
 *   int   the next argument through atoi, into an int;    intf  through atof, truncated, into an int
 *   i64   through atoll, into an int64_t;                  real  through atof, into a double
 *   str   the next argument itself, into a const char *
 * bench_args(argc, argv, i, spec, dst) reads argv from index i on and returns the index of the first
 * argument it cannot take: a name not in spec, or an option that needs a value as the last argument; argc
 * when it took them all. What such an argument means (an option of the bench's own, an error, the end of
 * the options) is the caller's to say; it resumes after it with another call. */
#ifndef DG_BENCH_ARGS_H
#define DG_BENCH_ARGS_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 1 when the word at s (up to a space or the end) is w */
static inline int bench_word_is(const char *s, const char *w) {
    size_t n = strlen(w);
    return !strncmp(s, w, n) && (s[n] == ' ' || s[n] == '\0');
}

/* The index of option `name` in spec and, in *kind, where its KIND starts; -1 when spec has no such option.
 */
static inline int bench_spec_find(const char *spec, const char *name, const char **kind) {
    const size_t n = strlen(name);
    if (strpbrk(name, " =")) return -1; /* no option's name */
    for (int k = 0; *spec; k++) {
        if (!strncmp(spec, name, n) && spec[n] == '=') {
            *kind = spec + n + 1;
            return k;
        }
        spec += strcspn(spec, " ");
        spec += strspn(spec, " ");
    }
    return -1;
}

/* Stores v at dst as the KIND at kind says (any but flag). */
static inline void bench_arg_set(const char *kind, void *dst, const char *v) {
    if (bench_word_is(kind, "int"))
        *(int *)dst = atoi(v);
    else if (bench_word_is(kind, "intf"))
        *(int *)dst = (int)atof(v);
    else if (bench_word_is(kind, "i64"))
        *(int64_t *)dst = atoll(v);
    else if (bench_word_is(kind, "real"))
        *(double *)dst = atof(v);
    else
        *(const char **)dst = v;
}

static inline int bench_args(int argc, char **argv, int i, const char *spec, void *const *dst) {
    for (; i < argc; i++) {
        const char *kind = NULL;
        const int k = bench_spec_find(spec, argv[i], &kind);
        if (k < 0) return i;
        if (bench_word_is(kind, "flag")) {
            *(int *)dst[k] = 1;
            continue;
        }
        if (i + 1 >= argc) return i;
        bench_arg_set(kind, dst[k], argv[++i]);
    }
    return argc;
}

#endif
