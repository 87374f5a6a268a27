/* default_data.c — the embedded default data set: byte-level shards built on first use from the
 * license texts in /usr/share/common-licenses (shipped by base-files on every Debian and Ubuntu
 * system, ~240 KB of real English prose), so `dgtrain configs/default.ini` trains on real text with
 * nothing downloaded. Built once per directory; a stamp records which source files it came from. */
#define _GNU_SOURCE
#include "data.h"
#include "data_impl.h"
#include "dg_fs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>
#include "dg_env.h"

#define DEFAULT_NAME "default"
#define DEFAULT_VAL_FRACTION 0.1
/* Bump when the build rule changes, so existing builds are redone. */
#define DEFAULT_FORMAT "dgtrain-default-data v2"

/* The stamp key: the build rule plus name, size and content hash of every candidate source file.
 * Content, not mtime: nodes whose images installed the same texts at different times must agree, or
 * they would rebuild the shards under each other (reading ~240 KB per call costs nothing). */
static dg_status_t source_key(const char *src, char *key, size_t cap, int *n_files) {
    DIR *d = opendir(src);
    if (!d)
        return DG_ERR(
            DG_ERR_USAGE,
            "default data: cannot read %s (%s), where Debian and Ubuntu keep the license texts the "
            "default data is built from; make shards from any text with `dgprep --out DIR FILE...` and "
            "set data.train and data.val to DIR/default_train_*.bin and DIR/default_val_*.bin",
            src, strerror(errno));
    char **names;
    int n = dg_data_dir_names(d, &names);
    XXH64_state_t *h = XXH64_createState();
    DG_ASSERT(h != NULL);
    XXH64_reset(h, 0);
    XXH64_update(h, DEFAULT_FORMAT, sizeof DEFAULT_FORMAT);
    int regular = 0;
    for (int i = 0; i < n; i++) {
        char path[4096];
        struct stat st;
        if (snprintf(path, sizeof path, "%s/%s", src, names[i]) < (int)sizeof path && lstat(path, &st) == 0 &&
            S_ISREG(st.st_mode)) {
            FILE *f = fopen(path, "rb");
            if (!f) {
                dg_status_t s =
                    DG_ERR(DG_ERR_USAGE, "default data: cannot read %s: %s", path, strerror(errno));
                for (int k = i; k < n; k++)
                    free(names[k]);
                free(names);
                XXH64_freeState(h);
                return s;
            }
            int64_t size = (int64_t)st.st_size;
            XXH64_update(h, names[i], strlen(names[i]) + 1);
            XXH64_update(h, &size, sizeof size);
            char buf[65536];
            size_t r;
            while ((r = fread(buf, 1, sizeof buf, f)) > 0)
                XXH64_update(h, buf, r);
            fclose(f);
            regular++;
        }
        free(names[i]);
    }
    free(names);
    uint64_t x = XXH64_digest(h);
    XXH64_freeState(h);
    *n_files = regular;
    if (regular == 0)
        return DG_ERR(
            DG_ERR_USAGE,
            "default data: %s holds no text files to build the default data from; make shards from any "
            "text with `dgprep --out DIR FILE...` and set data.train and data.val to them",
            src);
    dg_fmt(key, cap, "%s source=%s files=%d key=%016llx", DEFAULT_FORMAT, src, regular,
           (unsigned long long)x);
    return DG_OK;
}

static int stamp_matches(const char *stamp_path, const char *key) {
    FILE *f = fopen(stamp_path, "r");
    if (!f) return 0;
    char line[8192];
    int ok = fgets(line, sizeof line, f) != NULL;
    fclose(f);
    if (!ok) return 0;
    line[strcspn(line, "\n")] = 0;
    return strcmp(line, key) == 0;
}

static int file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static dg_status_t build_locked(const char *dir, const char *src, const char *key) {
    char stamp[4096], tr0[4096], va0[4096];
    dg_fmt(stamp, sizeof stamp, "%s/%s.stamp", dir, DEFAULT_NAME);
    dg_fmt(tr0, sizeof tr0, "%s/%s_train_000000.bin", dir, DEFAULT_NAME);
    dg_fmt(va0, sizeof va0, "%s/%s_val_000000.bin", dir, DEFAULT_NAME);
    if (stamp_matches(stamp, key) && file_exists(tr0) && file_exists(va0)) return DG_OK;

    double t0 = dg_now_s();
    const char *inputs[1] = {src};
    dg_prep_opts_t o = {.inputs = inputs,
                        .n_inputs = 1,
                        .out_dir = dir,
                        .name = DEFAULT_NAME,
                        .val_fraction = DEFAULT_VAL_FRACTION,
                        .quiet = 1,
                        .who = "default data"};
    dg_prep_result_t r;
    DG_TRY(dg_data_prep(&o, &r));
    if (r.val_tokens == 0)
        return DG_ERR(DG_ERR_USAGE, "default data: the texts in %s are too small for a val split", src);
    char text[8192];
    int n = snprintf(text, sizeof text,
                     "%s\nfiles_used %d\nfiles_skipped %d\nbytes %lld\ntrain_tokens %lld\nval_tokens %lld\n"
                     "content_xxh64 %016llx\n",
                     key, r.n_files, r.n_skipped, (long long)r.in_bytes, (long long)r.train_tokens,
                     (long long)r.val_tokens, (unsigned long long)r.content_hash);
    DG_ASSERT(n > 0 && n < (int)sizeof text);
    DG_TRY(dg_write_file_atomic(stamp, text, (size_t)n));
    DG_LOG_INFO(
        "default data: %d text files from %s (%lld bytes) -> %lld train + %lld val tokens in %s (%.2f s)",
        r.n_files, src, (long long)r.in_bytes, (long long)r.train_tokens, (long long)r.val_tokens, dir,
        dg_now_s() - t0);
    return DG_OK;
}

dg_status_t dg_data_default_paths(const char *dir, char *train_glob, char *val_glob, size_t cap) {
    if (!dir || !*dir) return DG_ERR(DG_ERR_USAGE, "default data: no directory given");
    if (strlen(dir) > 2000) return DG_ERR(DG_ERR_USAGE, "default data: directory path too long: %s", dir);
    const char *src = dg_env_str("DG_DEFAULT_TEXT_DIR");
    if (!src || !*src) src = DG_DEFAULT_TEXT_DIR;
    char key[4200];
    int n_files = 0;
    DG_TRY(source_key(src, key, sizeof key, &n_files));

    dg_status_t s = dg_mkdir_p(dir);
    if (s != DG_OK) {
        char why[2048];
        dg_fmt(why, sizeof why, "%s", dg_last_error());
        return DG_ERR(DG_ERR_RUNTIME, "default data: %s", why);
    }
    char lock_path[4096];
    dg_fmt(lock_path, sizeof lock_path, "%s/.%s.lock", dir, DEFAULT_NAME);
    int fd = -1;
    s = dg_fs_open_nofollow(lock_path, O_RDWR | O_CREAT, &fd); /* never through a planted link */
    if (s != DG_OK) {
        char why[2048];
        dg_fmt(why, sizeof why, "%s", dg_last_error());
        return DG_ERR(dg_last_error_code(), "default data: lock file: %s", why);
    }
    /* Serialise builders on this machine. Where flock is unsupported (some network file systems) we
     * go on without it: the build is deterministic and every file appears by rename, so concurrent
     * builders only duplicate work. */
    while (flock(fd, LOCK_EX) != 0 && errno == EINTR) {
    }
    s = build_locked(dir, src, key);
    close(fd); /* releases the lock */
    if (s != DG_OK) return s;

    char esc[4200];
    dg_data_glob_escape(dir, esc, sizeof esc);
    if (snprintf(train_glob, cap, "%s/%s_train_*.bin", esc, DEFAULT_NAME) >= (int)cap ||
        snprintf(val_glob, cap, "%s/%s_val_*.bin", esc, DEFAULT_NAME) >= (int)cap)
        return DG_ERR(DG_ERR_USAGE, "default data: glob buffer too small (%zu bytes) for %s", cap, dir);
    return DG_OK;
}
