/* dg_json_read.h — a small reader for one flat JSON object per line (metrics.jsonl). Only what the
 * event fields need: string and number values (true/false/null read as numbers 1/0/NaN); nested
 * objects/arrays make the line malformed. Contract: dg_jl_parse returns 0 and fills `o` on success,
 * -1 on a malformed or truncated line (the caller counts and skips it; it is never fatal). */
#ifndef DG_JSON_READ_H
#define DG_JSON_READ_H
#include <stddef.h>
#define DG_JL_MAX_FIELDS 48
#define DG_JL_KEY 48
#define DG_JL_STR 256
typedef struct {
    char key[DG_JL_KEY];
    int is_str;
    double num;
    char str[DG_JL_STR];
} dg_jl_field;
typedef struct {
    int n;
    dg_jl_field f[DG_JL_MAX_FIELDS];
} dg_jl_obj;
int dg_jl_parse(const char *line, dg_jl_obj *o);
/* Field lookup: NULL when absent. */
const dg_jl_field *dg_jl_get(const dg_jl_obj *o, const char *key);
#endif
