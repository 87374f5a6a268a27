/* config_impl.h — private to the config module (and its tests): the schema table that drives parsing,
 * validation, --help and --print-config. One row per key; rows point into dg_config_t by offsetof, so
 * adding a key is one field in config.h plus one row in schema.c.
 */
#ifndef DG_CONFIG_IMPL_H
#define DG_CONFIG_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"

typedef enum {
    DG_CFGT_INT = 0,   /* int64_t field, inclusive range [imin, imax] */
    DG_CFGT_FLOAT = 1, /* double field, range [fmin, fmax] (fmin exclusive when fmin_excl) */
    DG_CFGT_BOOL = 2,  /* int field, 0 or 1 */
    DG_CFGT_STR = 3,   /* char[size] field, free text (checked by `check` when set) */
    DG_CFGT_ENUM = 4   /* char[size] field, one of `choices` ("a|b|c") */
} dg_cfg_type_t;

/* Extra per-key rule on the already type-checked text value. Returns 0 when fine, otherwise writes
 * what was expected into `why` (one line, no key name: the caller prefixes it) and returns nonzero. */
typedef int (*dg_cfg_check_fn)(const char *value, char *why, size_t cap);

typedef struct dg_cfg_key {
    const char *section;
    const char *key;
    dg_cfg_type_t type;
    size_t offset;   /* offsetof(dg_config_t, ...) */
    size_t size;     /* sizeof the field (capacity for strings) */
    const char *def; /* default, as text: parsed through the same path as file values */
    int64_t imin, imax;
    double fmin, fmax;
    int fmin_excl;
    const char *choices;
    dg_cfg_check_fn check;
    const char *doc;
    size_t
        id_offset; /* DG_CFGT_ENUM with has_id: offsetof the int (enum) field that gets the choice's index */
    int has_id;
} dg_cfg_key_t;

extern const dg_cfg_key_t dg_cfg_schema[];
extern const int dg_cfg_nkeys;
extern const char *const dg_cfg_sections[];
extern const int dg_cfg_nsections;

/* Index of "section.key" / of (section, key) in the schema, or -1. */
int dg_cfg_find(const char *section, const char *key);
int dg_cfg_find_dotted(const char *section_dot_key);

#endif
