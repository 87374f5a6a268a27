/* shard.c — opening a data set: glob the llm.c token shards, memory-map each one read-only and
 * validate it completely before anything reads a token (header, exact size, token range), so that a
 * damaged or foreign file is refused with its name and offset instead of being read out of bounds. */
#define _GNU_SOURCE
#include "data.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

typedef struct shard {
    char *path;
    const uint8_t *map; /* whole file, read-only */
    size_t map_len;
    const uint16_t *tok; /* map + 1024: 2-byte aligned because mmap is page aligned */
    int64_t ntok;
    int64_t nsamp;
    int64_t first_sample; /* global id of this shard's sample 0 */
} shard_t;

struct dg_dataset {
    shard_t *shards;
    int n_shards;
    int seq_len;
    int vocab_size;
    int64_t n_samples, n_tokens;
};

static int32_t read_i32le(const uint8_t *p) {
    /* The format is little-endian; memcpy keeps this free of alignment and aliasing traps. */
    uint32_t v = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    int32_t r;
    memcpy(&r, &v, sizeof r);
    return r;
}

/* First token >= vocab, or -1. Chunked max so the common (clean) case is one vectorisable pass. */
static int64_t first_bad_token(const uint16_t *tok, int64_t n, int vocab) {
    if (vocab >= DG_SHARD_MAX_VOCAB) return -1;
    const int64_t chunk = 1 << 16;
    for (int64_t base = 0; base < n; base += chunk) {
        int64_t end = base + chunk < n ? base + chunk : n;
        uint16_t mx = 0;
        for (int64_t i = base; i < end; i++)
            mx = tok[i] > mx ? tok[i] : mx;
        if (mx < vocab) continue;
        for (int64_t i = base; i < end; i++)
            if (tok[i] >= vocab) return i;
    }
    return -1;
}

static void shard_unmap(shard_t *s) {
    if (s->map) munmap((void *)s->map, s->map_len);
    s->map = NULL;
    free(s->path);
    s->path = NULL;
}

static dg_status_t shard_open(shard_t *s, const char *path, int seq_len, int vocab) {
    memset(s, 0, sizeof *s);
    s->path = dg_xstrdup(path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return DG_ERR(DG_ERR_USAGE, "data shard %s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return DG_ERR(DG_ERR_RUNTIME, "data shard %s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return DG_ERR(DG_ERR_USAGE, "data shard %s: not a regular file", path);
    }
    long long size = (long long)st.st_size;
    if (size == 0) {
        close(fd);
        return DG_ERR(DG_ERR_USAGE,
                      "data shard %s: file is empty (expected a 1024-byte llm.c header, then uint16 tokens)",
                      path);
    }
    if (size < DG_SHARD_HEADER_BYTES) {
        close(fd);
        return DG_ERR(DG_ERR_USAGE,
                      "data shard %s: file is %lld bytes, too short for the 1024-byte llm.c header", path,
                      size);
    }
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd); /* the mapping keeps the file alive */
    if (map == MAP_FAILED) return DG_ERR(DG_ERR_RUNTIME, "data shard %s: mmap failed: %s", path, strerror(e));
    s->map = map;
    s->map_len = (size_t)size;

    int32_t magic = read_i32le(s->map), version = read_i32le(s->map + 4), ntok = read_i32le(s->map + 8);
    if (magic != DG_SHARD_MAGIC)
        return DG_ERR(DG_ERR_USAGE,
                      "data shard %s: bad magic %d at byte offset 0 (expected %d: not an llm.c token shard)",
                      path, magic, DG_SHARD_MAGIC);
    if (version != DG_SHARD_VERSION)
        return DG_ERR(DG_ERR_USAGE,
                      "data shard %s: unsupported version %d at byte offset 4 (expected %d: uint16 tokens)",
                      path, version, DG_SHARD_VERSION);
    if (ntok < 0)
        return DG_ERR(DG_ERR_USAGE, "data shard %s: negative token count %d at byte offset 8", path, ntok);
    long long want = DG_SHARD_HEADER_BYTES + 2LL * ntok;
    if (size != want)
        return DG_ERR(
            DG_ERR_USAGE,
            "data shard %s: file is %lld bytes but the header says %d tokens (byte offset 8), which needs "
            "exactly %lld bytes (1024 + 2*%d): %s",
            path, size, ntok, want, ntok, size < want ? "truncated?" : "trailing bytes?");
    s->tok = (const uint16_t *)(s->map + DG_SHARD_HEADER_BYTES);
    s->ntok = ntok;
    int64_t bad = first_bad_token(s->tok, s->ntok, vocab);
    if (bad >= 0)
        return DG_ERR(
            DG_ERR_USAGE,
            "data shard %s: token id %u at token offset %lld (byte offset %lld) is >= vocab_size %d", path,
            (unsigned)s->tok[bad], (long long)bad, (long long)(DG_SHARD_HEADER_BYTES + 2 * bad), vocab);
    s->nsamp = s->ntok >= 1 ? (s->ntok - 1) / seq_len : 0;
    return DG_OK;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int has_glob_chars(const char *s) {
    return strpbrk(s, "*?[") != NULL;
}

dg_status_t dg_dataset_open(const char *pattern, int seq_len, int vocab_size, dg_dataset_t **out) {
    *out = NULL;
    if (!pattern || !*pattern)
        return DG_ERR(DG_ERR_USAGE, "data: empty shard glob (expected e.g. data/x_train_*.bin)");
    if (seq_len < 1) return DG_ERR(DG_ERR_USAGE, "data %s: seq_len must be >= 1 (got %d)", pattern, seq_len);
    if (vocab_size < 1 || vocab_size > DG_SHARD_MAX_VOCAB)
        return DG_ERR(DG_ERR_USAGE, "data %s: vocab_size must be in [1, %d] for uint16 shards (got %d)",
                      pattern, DG_SHARD_MAX_VOCAB, vocab_size);

    glob_t g;
    memset(&g, 0, sizeof g);
    /* Sort ourselves with strcmp: glob's own order follows the locale's collation. */
    int rc = glob(pattern, GLOB_NOSORT, NULL, &g);
    if (rc == GLOB_NOMATCH || (rc == 0 && g.gl_pathc == 0)) {
        globfree(&g);
        if (!has_glob_chars(pattern)) {
            struct stat st;
            if (stat(pattern, &st) != 0)
                return DG_ERR(DG_ERR_USAGE, "data shard %s: cannot open: %s", pattern, strerror(errno));
        }
        return DG_ERR(DG_ERR_USAGE,
                      "data: no file matches '%s' (expected llm.c .bin token shards; dgprep makes them)",
                      pattern);
    }
    if (rc != 0) {
        globfree(&g);
        return DG_ERR(DG_ERR_RUNTIME, "data: cannot expand glob '%s' (%s)", pattern,
                      rc == GLOB_NOSPACE ? "out of memory" : "read error");
    }
    qsort(g.gl_pathv, g.gl_pathc, sizeof(char *), cmp_str);

    dg_dataset_t *ds = dg_xcalloc(1, sizeof *ds);
    ds->seq_len = seq_len;
    ds->vocab_size = vocab_size;
    ds->shards = dg_xcalloc(g.gl_pathc, sizeof(shard_t));
    for (size_t i = 0; i < g.gl_pathc; i++) {
        dg_status_t s = shard_open(&ds->shards[i], g.gl_pathv[i], seq_len, vocab_size);
        ds->n_shards = (int)i + 1; /* so dg_dataset_free releases this one too */
        if (s != DG_OK) {
            globfree(&g);
            dg_dataset_free(ds);
            return s;
        }
        ds->shards[i].first_sample = ds->n_samples;
        ds->n_samples += ds->shards[i].nsamp;
        ds->n_tokens += ds->shards[i].ntok;
    }
    globfree(&g);
    if (ds->n_samples == 0) {
        dg_status_t s =
            DG_ERR(DG_ERR_USAGE,
                   "data %s: %lld tokens in %d shard(s) give no sample of seq_len+1 = %d tokens (a shard "
                   "needs at least %d tokens; use more data or a smaller model.seq_len)",
                   pattern, (long long)ds->n_tokens, ds->n_shards, seq_len + 1, seq_len + 1);
        dg_dataset_free(ds);
        return s;
    }
    *out = ds;
    return DG_OK;
}

void dg_dataset_free(dg_dataset_t *ds) {
    if (!ds) return;
    for (int i = 0; i < ds->n_shards; i++)
        shard_unmap(&ds->shards[i]);
    free(ds->shards);
    free(ds);
}

int64_t dg_dataset_n_samples(const dg_dataset_t *ds) {
    return ds->n_samples;
}
int64_t dg_dataset_n_tokens(const dg_dataset_t *ds) {
    return ds->n_tokens;
}
int dg_dataset_n_shards(const dg_dataset_t *ds) {
    return ds->n_shards;
}
const char *dg_dataset_shard_path(const dg_dataset_t *ds, int i) {
    DG_ASSERT(i >= 0 && i < ds->n_shards);
    return ds->shards[i].path;
}
int dg_dataset_seq_len(const dg_dataset_t *ds) {
    return ds->seq_len;
}

uint64_t dg_dataset_fingerprint(const dg_dataset_t *ds) {
    /* Base names, not full paths: the same shards moved to another directory are the same data. */
    XXH64_state_t *st = XXH64_createState();
    DG_ASSERT(st != NULL);
    XXH64_reset(st, 0);
    int64_t sl = ds->seq_len;
    XXH64_update(st, &sl, sizeof sl);
    for (int i = 0; i < ds->n_shards; i++) {
        const char *base = strrchr(ds->shards[i].path, '/');
        base = base ? base + 1 : ds->shards[i].path;
        XXH64_update(st, base, strlen(base) + 1);
        int64_t n = ds->shards[i].ntok;
        XXH64_update(st, &n, sizeof n);
    }
    uint64_t h = XXH64_digest(st);
    XXH64_freeState(st);
    return h;
}

void dg_dataset_get_sample(const dg_dataset_t *ds, int64_t sample, int32_t *tokens, int32_t *targets) {
    DG_ASSERTF(sample >= 0 && sample < ds->n_samples, "sample %lld of %lld", (long long)sample,
               (long long)ds->n_samples);
    /* Binary search for the shard: the last one whose first_sample <= sample (with samples). */
    int lo = 0, hi = ds->n_shards - 1;
    while (lo < hi) {
        int mid = lo + (hi - lo + 1) / 2;
        if (ds->shards[mid].first_sample <= sample)
            lo = mid;
        else
            hi = mid - 1;
    }
    /* Empty shards share first_sample with their successor, so "the last" is never an empty one. */
    const shard_t *s = &ds->shards[lo];
    int64_t start = (sample - s->first_sample) * ds->seq_len;
    DG_ASSERT(sample - s->first_sample < s->nsamp && start + ds->seq_len <= s->ntok - 1);
    const uint16_t *t = s->tok + start;
    int T = ds->seq_len;
    if (tokens)
        for (int i = 0; i < T; i++)
            tokens[i] = t[i];
    if (targets)
        for (int i = 0; i < T; i++)
            targets[i] = t[i + 1];
}
