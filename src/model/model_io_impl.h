/* model_io_impl.h — private to src/model's weight I/O (hf.c, llmc.c, init.c, json_tree.c): the JSON tree
 * reader and the shared helpers. */
#ifndef DG_MODEL_IO_IMPL_H
#define DG_MODEL_IO_IMPL_H

#include <stddef.h>

#include "dg_hf.h"

/* A parsed JSON value. Objects keep their keys in order (keys[i] names items[i]); arrays have keys NULL
 * entries. Numbers are doubles (exact for the integers of shapes and offsets below 2^53). */
enum { DG_JT_NULL = 0, DG_JT_BOOL, DG_JT_NUM, DG_JT_STR, DG_JT_ARR, DG_JT_OBJ };
typedef struct dg_jt {
    int type;
    double num; /* NUM, BOOL (1 / 0) */
    char *str;  /* STR */
    int n;
    char **keys;
    struct dg_jt *items;
} dg_jt_t;
/* Parses one JSON document (surrounding whitespace allowed); 0, or -1 for malformed text (out zeroed). */
int dg_jt_parse(const char *text, size_t len, dg_jt_t *out);
void dg_jt_free(dg_jt_t *v);
const dg_jt_t *dg_jt_get(const dg_jt_t *obj, const char *key); /* NULL when absent or obj not an object */

/* Maps a whole regular file read-only; DG_ERR_USAGE naming it (and `what` it should be) when missing. */
dg_status_t dg_mio_map(const char *path, const char *what, void **map, size_t *len);
void dg_mio_unmap(void *map, size_t len);

/* llm.c: floats of each of its 16 tensors into sz (llm.c's order), and their total. */
uint64_t dg_llmc_sizes(const dg_llmc_file_t *f, uint64_t sz[16]);

#endif
