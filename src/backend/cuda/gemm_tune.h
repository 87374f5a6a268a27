/* gemm_tune.h — the table of measured GEMM algorithm choices (DG_CUDA_GEMM_TUNE, matmul.cu), kept for
 * the process and in a text file shared by later runs, so that a shape tuned once runs the same algorithm
 * in every later run (bitwise-reproducible runs and resumes on one machine). Plain C, no CUDA: the CPU
 * test suite exercises it (tests/backend_cuda/test_gemm_tune.c).
 *
 * An entry: a device tag (GPU name, SM count, library version: whatever makes the candidate list
 * identical), the GEMM's key (DG_GEMM_TUNE_KEY_N integers: shape, types, epilogue, alignment), the
 * chosen candidate's index in cuBLASLt's heuristic list, the list's length, a hash of the chosen
 * algorithm's opaque bytes (a changed list is detected, not trusted), and the two measured times.
 *
 * File format, one entry per line (lines starting with '#' and malformed lines are skipped):
 *   v1 TAG K0 K1 ... K18 PICK FOUND ALGOHASH MS_FIRST MS_PICK
 * The file is rewritten whole (merged with what other processes wrote meanwhile) through a temporary
 * file and a rename, so concurrent writers never leave a torn file; the last writer's entry of a key
 * wins, and every writer measured the same shape on the same device. */
#ifndef DG_GEMM_TUNE_H
#define DG_GEMM_TUNE_H

#include <stdint.h>

#include "dg_common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DG_GEMM_TUNE_KEY_N 19
#define DG_GEMM_TUNE_TAG_MAX 128

typedef struct dg_gemm_tune_entry {
    char tag[DG_GEMM_TUNE_TAG_MAX];
    int key[DG_GEMM_TUNE_KEY_N];
    int pick, found;
    uint64_t algo_hash;
    float ms_first, ms_pick;
} dg_gemm_tune_entry_t;

/* The file the table is kept in: DG_CUDA_GEMM_TUNE_FILE when set ("none" or empty: no file, the table
 * lives only as long as the process), else $XDG_CACHE_HOME/dgtrain/gemm_tune.txt, else
 * $HOME/.cache/dgtrain/gemm_tune.txt; NULL when there is none. The string is static. */
const char *dg_gemm_tune_path(void);

/* Looks `key` up for `tag` (loading the file on first use). Returns 1 and fills *out on a hit. */
int dg_gemm_tune_lookup(const char *tag, const int *key, dg_gemm_tune_entry_t *out);

/* Adds (or replaces) an entry and writes the file (when there is one). A failure to write the file is
 * a warning, not an error: the choice still holds for this process. */
void dg_gemm_tune_record(const dg_gemm_tune_entry_t *e);

/* FNV-1a over `n` bytes (the algorithm's opaque data) */
uint64_t dg_gemm_tune_hash(const void *p, size_t n);

/* Parses one line into *e; returns 1 when it is a valid entry. */
int dg_gemm_tune_parse(const char *line, dg_gemm_tune_entry_t *e);

/* Forgets the process table and the resolved path (tests: a new DG_CUDA_GEMM_TUNE_FILE takes effect). */
void dg_gemm_tune_reset(void);

#ifdef __cplusplus
}
#endif

#endif
