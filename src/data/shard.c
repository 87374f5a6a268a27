/* shard.c — opening a data set: glob the llm.c token shards, open each one and validate it completely
 * before anything reads a token (header, exact size, token range), so that a damaged or foreign file is
 * refused with its name and offset instead of being read out of bounds.
 *
 * Shards are read with pread, never memory-mapped: a mapped file truncated under the run (a re-run of
 * dgprep, a full disk, a user's `cp` over it) makes the next access fault with SIGBUS, which no error
 * path can catch. A read instead comes back short and becomes a one-line error naming the file and the
 * offset; every read also re-checks the shard's size and header, so a file rewritten in place is
 * refused before its bytes are used. The cost is one pread of seq_len+1 tokens per sample from the page
 * cache, plus an fstat and a 12-byte pread per shard per micro-batch. */
#define _GNU_SOURCE
#include "data.h"
#include "data_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#define XXH_STATIC_LINKING_ONLY /* XXH64_state_t on the stack */
#include <xxhash.h>

typedef struct shard {
    char *path;
    int fd;          /* kept open: reads go to the file that was validated, even if it is renamed over */
    long long size;  /* validated file size */
    uint8_t hdr[28]; /* validated magic, version, token count; the tokenizer tag, kind, fingerprint */
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

static uint16_t tok_at(const uint8_t *b, int64_t i) {
    return (uint16_t)(b[2 * i] | b[2 * i + 1] << 8);
}

/* Reads exactly n bytes at off. Returns the bytes read (< n at end of file) or -1 with errno set. */
static ssize_t pread_full(int fd, void *buf, size_t n, off_t off) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, (char *)buf + got, n - got, off + (off_t)got);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (r == 0) break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

/* The shard's current size, for messages about a file that changed under the run. */
static long long size_now(const shard_t *s) {
    struct stat st;
    return fstat(s->fd, &st) == 0 ? (long long)st.st_size : -1;
}

/* A read that came back short: the file shrank after it was validated. */
static dg_status_t short_read(const shard_t *s, long long off, size_t want, ssize_t got) {
    if (got < 0)
        return DG_ERR(DG_ERR_RUNTIME, "data shard %s: read error at byte offset %lld: %s", s->path, off,
                      strerror(errno));
    return DG_ERR(DG_ERR_RUNTIME,
                  "data shard %s: file truncated while training: reading %zu bytes at byte offset %lld got "
                  "%zd; the file is now %lld bytes (it was %lld when opened)",
                  s->path, want, off, got, size_now(s), s->size);
}

/* First token >= vocab in the nbytes/2 tokens of b, or -1. Chunked max so the common (clean) case is one
 * vectorisable pass. */
static int64_t first_bad_token(const uint8_t *b, int64_t n, int vocab) {
    if (vocab >= DG_SHARD_MAX_VOCAB) return -1;
    const int64_t chunk = 1 << 14;
    for (int64_t base = 0; base < n; base += chunk) {
        int64_t end = base + chunk < n ? base + chunk : n;
        uint16_t mx = 0;
        for (int64_t i = base; i < end; i++) {
            uint16_t t = tok_at(b, i);
            mx = t > mx ? t : mx;
        }
        if (mx < vocab) continue;
        for (int64_t i = base; i < end; i++)
            if (tok_at(b, i) >= vocab) return i;
    }
    return -1;
}

/* The validating scan at open: every token < vocab, read with pread in 1 MiB blocks (never mapped: a
 * file truncated under a mapping faults with SIGBUS on the next access). */
static dg_status_t scan_tokens(const shard_t *s, int vocab) {
    if (vocab >= DG_SHARD_MAX_VOCAB || s->ntok == 0) return DG_OK;
    const size_t block = (size_t)1 << 20;
    uint8_t *buf = dg_xmalloc(block);
    dg_status_t st = DG_OK;
    for (int64_t t0 = 0; t0 < s->ntok && st == DG_OK; t0 += (int64_t)(block / 2)) {
        int64_t n = s->ntok - t0 < (int64_t)(block / 2) ? s->ntok - t0 : (int64_t)(block / 2);
        long long off = DG_SHARD_HEADER_BYTES + 2LL * t0;
        ssize_t got = pread_full(s->fd, buf, (size_t)(2 * n), (off_t)off);
        if (got != (ssize_t)(2 * n)) {
            st = short_read(s, off, (size_t)(2 * n), got);
            break;
        }
        int64_t bad = first_bad_token(buf, n, vocab);
        if (bad >= 0)
            st = DG_ERR(
                DG_ERR_USAGE,
                "data shard %s: token id %u at token offset %lld (byte offset %lld) is >= vocab_size %d",
                s->path, (unsigned)tok_at(buf, bad), (long long)(t0 + bad),
                (long long)(DG_SHARD_HEADER_BYTES + 2 * (t0 + bad)), vocab);
    }
    free(buf);
    return st;
}

static void shard_close(shard_t *s) {
    if (s->fd >= 0) close(s->fd);
    s->fd = -1;
    free(s->path);
    s->path = NULL;
}

/* open(2) that raises the soft limit on open files once when a data set has more shards than it allows
 * (each shard keeps its descriptor for the whole run). */
static int open_shard_fd(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 && errno == EMFILE) {
        struct rlimit rl;
        if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
            rl.rlim_cur = rl.rlim_max;
            if (setrlimit(RLIMIT_NOFILE, &rl) == 0) fd = open(path, O_RDONLY | O_CLOEXEC);
        }
        if (fd < 0) errno = EMFILE;
    }
    return fd;
}

/* Opens and validates one shard: header and exact size always, the token range when scan is set. */
static dg_status_t shard_open(shard_t *s, const char *path, int seq_len, int vocab, int scan) {
    memset(s, 0, sizeof *s);
    s->fd = -1;
    s->path = dg_xstrdup(path);
    int fd = open_shard_fd(path);
    if (fd < 0)
        return DG_ERR(DG_ERR_USAGE, "data shard %s: cannot open: %s%s", path, strerror(errno),
                      errno == EMFILE ? " (every shard stays open while training: raise `ulimit -n`)" : "");
    s->fd = fd;
    struct stat st;
    if (fstat(fd, &st) != 0)
        return DG_ERR(DG_ERR_RUNTIME, "data shard %s: cannot stat: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return DG_ERR(DG_ERR_USAGE, "data shard %s: not a regular file", path);
    long long size = (long long)st.st_size;
    if (size == 0)
        return DG_ERR(DG_ERR_USAGE,
                      "data shard %s: file is empty (expected a 1024-byte llm.c header, then uint16 tokens)",
                      path);
    if (size < DG_SHARD_HEADER_BYTES)
        return DG_ERR(DG_ERR_USAGE,
                      "data shard %s: file is %lld bytes, too short for the 1024-byte llm.c header", path,
                      size);
    s->size = size;
    ssize_t got = pread_full(fd, s->hdr, sizeof s->hdr, 0);
    if (got != (ssize_t)sizeof s->hdr) return short_read(s, 0, sizeof s->hdr, got);

    int32_t magic = read_i32le(s->hdr), version = read_i32le(s->hdr + 4), ntok = read_i32le(s->hdr + 8);
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
    s->ntok = ntok;
    if (read_i32le(s->hdr + 12) != DG_SHARD_TOK_TAG) memset(s->hdr + 12, 0, 16); /* no tokenizer recorded */
    if (scan) DG_TRY(scan_tokens(s, vocab));
    s->nsamp = s->ntok >= 1 ? (s->ntok - 1) / seq_len : 0;
    return DG_OK;
}

/* Is the shard still the file that was validated? Its size and its header must not have changed: a
 * shard rewritten or truncated in place under a run is refused, naming the file and the offset. */
dg_status_t dg_dataset__check_shard(const dg_dataset_t *ds, int i) {
    const shard_t *s = &ds->shards[i];
    long long now = size_now(s);
    if (now < 0) return DG_ERR(DG_ERR_RUNTIME, "data shard %s: cannot stat: %s", s->path, strerror(errno));
    if (now != s->size)
        return DG_ERR(DG_ERR_RUNTIME,
                      "data shard %s: file %s while training: it is now %lld bytes (byte offset %lld is its "
                      "new end) but was %lld bytes when opened; the run stops rather than read a file "
                      "that changed under it",
                      s->path, now < s->size ? "truncated" : "grew", now, now, s->size);
    uint8_t h[sizeof s->hdr];
    ssize_t got = pread_full(s->fd, h, sizeof h, 0);
    if (got != (ssize_t)sizeof h) return short_read(s, 0, sizeof h, got);
    static const char *const field[3] = {"magic", "version", "token count"};
    for (int k = 0; k < 3; k++)
        if (memcmp(h + 4 * k, s->hdr + 4 * k, 4) != 0)
            return DG_ERR(DG_ERR_RUNTIME,
                          "data shard %s: header rewritten while training: the %s at byte offset %d is now "
                          "%d (it was %d when opened); the run stops rather than read a file that changed "
                          "under it",
                          s->path, field[k], 4 * k, read_i32le(h + 4 * k), read_i32le(s->hdr + 4 * k));
    return DG_OK;
}

/* Reads sample `sample` with pread (no mapping, so nothing can fault) and checks its tokens; *shard_out
 * is the shard it came from, for dg_dataset__check_shard. */
dg_status_t dg_dataset__read_sample(const dg_dataset_t *ds, int64_t sample, int32_t *tokens, int32_t *targets,
                                    int *shard_out) {
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
    if (shard_out) *shard_out = lo;
    const int T = ds->seq_len;
    int64_t start = (sample - s->first_sample) * T;
    DG_ASSERT(sample - s->first_sample < s->nsamp && start + T <= s->ntok - 1);
    /* T+1 tokens, in blocks so that any seq_len works with a small stack buffer */
    enum { BLOCK = 4096 };
    uint8_t buf[2 * BLOCK];
    for (int64_t done = 0; done < T + 1;) {
        int64_t n = T + 1 - done < BLOCK ? T + 1 - done : BLOCK;
        long long off = DG_SHARD_HEADER_BYTES + 2LL * (start + done);
        ssize_t got = pread_full(s->fd, buf, (size_t)(2 * n), (off_t)off);
        if (got != (ssize_t)(2 * n)) return short_read(s, off, (size_t)(2 * n), got);
        int64_t bad = first_bad_token(buf, n, ds->vocab_size);
        if (bad >= 0)
            return DG_ERR(
                DG_ERR_RUNTIME,
                "data shard %s: token id %u at token offset %lld (byte offset %lld) is >= vocab_size "
                "%d: the file changed while training (it was checked when opened)",
                s->path, (unsigned)tok_at(buf, bad), (long long)(start + done + bad), off + 2 * bad,
                ds->vocab_size);
        for (int64_t i = 0; i < n; i++) {
            int64_t pos = done + i; /* position in the window of T+1 tokens */
            int32_t t = tok_at(buf, i);
            if (tokens && pos < T) tokens[pos] = t;
            if (targets && pos >= 1) targets[pos - 1] = t;
        }
        done += n;
    }
    return DG_OK;
}

static int has_glob_chars(const char *s) {
    return strpbrk(s, "*?[") != NULL;
}

static dg_status_t dataset_open(const char *pattern, int seq_len, int vocab_size, int scan,
                                dg_dataset_t **out) {
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
    qsort(g.gl_pathv, g.gl_pathc, sizeof(char *), dg_data_cmp_str);

    dg_dataset_t *ds = dg_xcalloc(1, sizeof *ds);
    ds->seq_len = seq_len;
    ds->vocab_size = vocab_size;
    ds->shards = dg_xcalloc(g.gl_pathc, sizeof(shard_t));
    for (size_t i = 0; i < g.gl_pathc; i++) {
        dg_status_t s = shard_open(&ds->shards[i], g.gl_pathv[i], seq_len, vocab_size, scan);
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

dg_status_t dg_dataset_open(const char *pattern, int seq_len, int vocab_size, dg_dataset_t **out) {
    return dataset_open(pattern, seq_len, vocab_size, 1, out);
}

dg_status_t dg_dataset_probe(const char *pattern, int seq_len, int64_t *n_samples) {
    *n_samples = 0;
    dg_dataset_t *ds = NULL;
    DG_TRY(dataset_open(pattern, seq_len, DG_SHARD_MAX_VOCAB, 0, &ds));
    *n_samples = ds->n_samples;
    dg_dataset_free(ds);
    return DG_OK;
}

void dg_dataset_free(dg_dataset_t *ds) {
    if (!ds) return;
    for (int i = 0; i < ds->n_shards; i++)
        shard_close(&ds->shards[i]);
    DG_FREE_ALL(ds->shards, ds);
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

static int shard_tokenizer(const shard_t *s, uint64_t *fp) {
    *fp = 0;
    if (read_i32le(s->hdr + 12) != DG_SHARD_TOK_TAG) return DG_SHARD_TOK_UNKNOWN;
    int kind = read_i32le(s->hdr + 16);
    *fp = (uint64_t)(uint32_t)read_i32le(s->hdr + 20) | (uint64_t)(uint32_t)read_i32le(s->hdr + 24) << 32;
    if (kind != DG_SHARD_TOK_BYTES && kind != DG_SHARD_TOK_BPE) *fp = 0, kind = DG_SHARD_TOK_UNKNOWN;
    return kind;
}

int dg_dataset_tokenizer(const dg_dataset_t *ds, uint64_t *fp) {
    uint64_t f0 = 0, f = 0;
    int kind = ds->n_shards > 0 ? shard_tokenizer(&ds->shards[0], &f0) : DG_SHARD_TOK_UNKNOWN;
    for (int i = 1; i < ds->n_shards && kind != DG_SHARD_TOK_UNKNOWN; i++)
        if (shard_tokenizer(&ds->shards[i], &f) != kind || f != f0) kind = DG_SHARD_TOK_UNKNOWN, f0 = 0;
    if (fp) *fp = f0;
    return kind;
}

void dg_dataset_tokenizer_str(const dg_dataset_t *ds, char *buf, size_t cap) {
    uint64_t fp = 0;
    int kind = dg_dataset_tokenizer(ds, &fp);
    if (kind == DG_SHARD_TOK_BYTES)
        snprintf(buf, cap, "bytes");
    else if (kind == DG_SHARD_TOK_BPE)
        snprintf(buf, cap, "bpe:%016llx", (unsigned long long)fp);
    else if (cap)
        buf[0] = 0;
}

uint64_t dg_dataset_fingerprint(const dg_dataset_t *ds) {
    /* Base names, not full paths: the same shards moved to another directory are the same data. */
    XXH64_state_t st;
    XXH64_reset(&st, 0);
    XXH64_update(&st, &(int64_t){ds->seq_len}, sizeof(int64_t));
    for (int i = 0; i < ds->n_shards; i++) {
        const char *base = strrchr(ds->shards[i].path, '/');
        base = base ? base + 1 : ds->shards[i].path;
        XXH64_update(&st, base, strlen(base) + 1);
        XXH64_update(&st, &(int64_t){ds->shards[i].ntok}, sizeof(int64_t));
    }
    return XXH64_digest(&st);
}

dg_status_t dg_dataset_get_sample(const dg_dataset_t *ds, int64_t sample, int32_t *tokens, int32_t *targets) {
    int shard = 0;
    DG_TRY(dg_dataset__read_sample(ds, sample, tokens, targets, &shard));
    return dg_dataset__check_shard(ds, shard);
}
