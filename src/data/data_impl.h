/* data_impl.h — helpers shared by the data module's own files; not part of its public API. */
#ifndef DG_DATA_IMPL_H
#define DG_DATA_IMPL_H
#include <stddef.h>

/* Copy `in` to `out` with the glob metacharacters * ? [ ] \ backslash-escaped, so a glob built on a
 * directory name matches that directory literally. */
void dg_data_glob_escape(const char *in, char *out, size_t cap);

#endif
