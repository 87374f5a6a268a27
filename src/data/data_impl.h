/* data_impl.h — helpers shared by the data module's own files; not part of its public API. */
#ifndef DG_DATA_IMPL_H
#define DG_DATA_IMPL_H
#include <dirent.h>
#include <stddef.h>
#include <stdint.h>

#include "data.h"

/* Copy `in` to `out` with the glob metacharacters * ? [ ] \ backslash-escaped, so a glob built on a
 * directory name matches that directory literally. */
void dg_data_glob_escape(const char *in, char *out, size_t cap);

/* dg_dataset_get_sample in two halves, so that dg_loader_fill checks each shard it touched once per
 * micro-batch rather than once per sample: read one sample (pread, token range checked; *shard_out is
 * its shard), then check that shard's size and header against what was validated at open. */
dg_status_t dg_dataset__read_sample(const dg_dataset_t *ds, int64_t sample, int32_t *tokens, int32_t *targets,
                                    int *shard_out);
dg_status_t dg_dataset__check_shard(const dg_dataset_t *ds, int shard);

/* qsort comparator of C strings (an array of char *), by strcmp */
int dg_data_cmp_str(const void *a, const void *b);

/* The names in directory d (closed here) but those starting with '.' (., .., hidden files), sorted by
 * strcmp, into *names (NULL when there are none); returns how many. The caller frees each and the array. */
int dg_data_dir_names(DIR *d, char ***names);

#endif
