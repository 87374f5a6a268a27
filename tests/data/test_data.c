/* test_data.c — tests of the data module: shard validation (each damage case with its exact message),
 * sample layout, reproducible shuffling, mid-epoch resume, the data-parallel split, epoch wrap, the
 * text-to-shard builder and the default data. One binary; argv[1] names the case (one ctest each). */
#define _GNU_SOURCE
#include "data.h"
#include "dg_check.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char g_tmp[256];

static void put32(uint8_t *p, int32_t v) {
    memcpy(p, &v, 4); /* x86: little-endian */
}

/* Write a shard with the given header fields, `n` tokens, and `extra` trailing junk bytes. */
static void write_shard(const char *path, int32_t magic, int32_t version, int32_t hdr_ntok,
                        const uint16_t *tok, int64_t n, int extra) {
    FILE *f = fopen(path, "wb");
    DG_ASSERT(f != NULL);
    uint8_t hdr[1024] = {0};
    put32(hdr, magic);
    put32(hdr + 4, version);
    put32(hdr + 8, hdr_ntok);
    DG_ASSERT(fwrite(hdr, 1, sizeof hdr, f) == sizeof hdr);
    if (n) DG_ASSERT(fwrite(tok, 2, (size_t)n, f) == (size_t)n);
    for (int i = 0; i < extra; i++)
        fputc(0x55, f);
    fclose(f);
}

/* tokens t[i] = (i * 7 + salt) % mod */
static uint16_t *pattern(int64_t n, int salt, int mod) {
    uint16_t *t = malloc((size_t)n * 2 + 2);
    for (int64_t i = 0; i < n; i++)
        t[i] = (uint16_t)((i * 7 + salt) % mod);
    return t;
}

static void path_in_tmp(char *buf, size_t cap, const char *name) {
    dg_fmt(buf, cap, "%s/%s", g_tmp, name);
}

/* Expect dg_dataset_open(glob) to fail with exactly `want` (after substituting the tmp dir for @). */
static void expect_open_error(const char *glob, int seq_len, int vocab, const char *want_fmt) {
    char want[2048], g[1024];
    dg_fmt(g, sizeof g, "%s", glob);
    /* want_fmt uses %s for the tmp dir, possibly several times */
    dg_fmt(want, sizeof want, want_fmt, g_tmp, g_tmp, g_tmp);
    dg_dataset_t *ds = (dg_dataset_t *)0x1;
    dg_status_t s = dg_dataset_open(g, seq_len, vocab, &ds);
    CHECK(s == DG_ERR_USAGE, "status %d for %s (msg: %s)", s, g, dg_last_error());
    CHECK(ds == NULL, "out not cleared on error");
    CHECK(strcmp(dg_last_error(), want) == 0, "\n  got:  %s\n  want: %s", dg_last_error(), want);
}

/* ---------------- cases ---------------- */

static void case_shard_valid(void) {
    char p0[512], p1[512], p2[512], g[512];
    path_in_tmp(p0, sizeof p0, "a_000.bin");
    path_in_tmp(p1, sizeof p1, "a_001.bin");
    path_in_tmp(p2, sizeof p2, "a_002.bin");
    uint16_t *t0 = pattern(101, 0, 50), *t1 = pattern(5, 3, 50), *t2 = pattern(41, 9, 50);
    /* Written out of name order: the data set must still be sorted by name. */
    write_shard(p2, DG_SHARD_MAGIC, 1, 41, t2, 41, 0);
    write_shard(p0, DG_SHARD_MAGIC, 1, 101, t0, 101, 0);
    write_shard(p1, DG_SHARD_MAGIC, 1, 5, t1, 5, 0); /* too short for a sample at seq_len 10 */
    path_in_tmp(g, sizeof g, "a_*.bin");
    dg_dataset_t *ds = NULL;
    dg_status_t s = dg_dataset_open(g, 10, 50, &ds);
    CHECK(s == DG_OK, "open: %s", dg_last_error());
    if (!ds) return;
    /* (101-1)/10 = 10, (5-1)/10 = 0, (41-1)/10 = 4 */
    CHECK(dg_dataset_n_samples(ds) == 14, "n_samples %lld", (long long)dg_dataset_n_samples(ds));
    CHECK(dg_dataset_n_tokens(ds) == 147, "n_tokens %lld", (long long)dg_dataset_n_tokens(ds));
    CHECK(dg_dataset_n_shards(ds) == 3, "n_shards %d", dg_dataset_n_shards(ds));
    CHECK(strcmp(dg_dataset_shard_path(ds, 0), p0) == 0 && strcmp(dg_dataset_shard_path(ds, 2), p2) == 0,
          "shard order %s, %s", dg_dataset_shard_path(ds, 0), dg_dataset_shard_path(ds, 2));
    int32_t x[10], y[10];
    for (int64_t smp = 0; smp < 14; smp++) {
        dg_dataset_get_sample(ds, smp, x, y);
        const uint16_t *src = smp < 10 ? t0 + smp * 10 : t2 + (smp - 10) * 10;
        for (int i = 0; i < 10; i++) {
            CHECK(x[i] == src[i] && y[i] == src[i + 1], "sample %lld pos %d: %d/%d vs %d/%d", (long long)smp,
                  i, x[i], y[i], src[i], src[i + 1]);
        }
    }
    /* Last sample of shard 0 ends exactly at its last token (100 = 9*10 + 10). */
    dg_dataset_get_sample(ds, 9, NULL, y);
    CHECK(y[9] == t0[100], "last target %d vs %d", y[9], t0[100]);
    uint64_t fp = dg_dataset_fingerprint(ds);
    dg_dataset_free(ds);
    /* Same shards: same fingerprint; another seq_len: another one. */
    CHECK(dg_dataset_open(g, 10, 50, &ds) == DG_OK && dg_dataset_fingerprint(ds) == fp, "fingerprint stable");
    dg_dataset_free(ds);
    CHECK(dg_dataset_open(g, 8, 50, &ds) == DG_OK && dg_dataset_fingerprint(ds) != fp, "fingerprint seq_len");
    dg_dataset_free(ds);
    /* A single literal path works as a glob too; vocab 65536 skips the range scan. */
    CHECK(dg_dataset_open(p0, 10, 65536, &ds) == DG_OK && dg_dataset_n_samples(ds) == 10, "literal path");
    dg_dataset_free(ds);
    free(t0);
    free(t1);
    free(t2);
}

static void case_shard_errors(void) {
    char p[512];
    uint16_t *t = pattern(300, 1, 200);
    /* one bad shard each (a damaged header, or too few tokens): file name, magic, version, token count,
     * tokens written, trailing bytes */
    static const struct {
        const char *name;
        int32_t magic, version, count;
        int64_t written;
        int extra;
        const char *want;
    } bad[] = {
        /* wrong magic */
        {"magic.bin", 20240521, 1, 300, 300, 0,
         "data shard %s/magic.bin: bad magic 20240521 at byte offset 0 (expected 20240520: not an "
         "llm.c token shard)"},
        /* wrong version (llm.c's version 2 holds uint32 tokens) */
        {"version.bin", DG_SHARD_MAGIC, 2, 300, 300, 0,
         "data shard %s/version.bin: unsupported version 2 at byte offset 4 (expected 1: uint16 tokens)"},
        /* size too short: header promises more tokens than the file has */
        {"short.bin", DG_SHARD_MAGIC, 1, 300, 299, 0,
         "data shard %s/short.bin: file is 1622 bytes but the header says 300 tokens (byte offset 8), "
         "which needs exactly 1624 bytes (1024 + 2*300): truncated?"},
        /* size too long: trailing bytes */
        {"long.bin", DG_SHARD_MAGIC, 1, 300, 300, 3,
         "data shard %s/long.bin: file is 1627 bytes but the header says 300 tokens (byte offset 8), "
         "which needs exactly 1624 bytes (1024 + 2*300): trailing bytes?"},
        /* negative count */
        {"neg.bin", DG_SHARD_MAGIC, 1, -5, 0, 0,
         "data shard %s/neg.bin: negative token count -5 at byte offset 8"},
        /* a valid header, but too few tokens for one sample */
        {"few.bin", DG_SHARD_MAGIC, 1, 16, 16, 0,
         "data %s/few.bin: 16 tokens in 1 shard(s) give no sample of seq_len+1 = 17 tokens (a shard "
         "needs at least 17 tokens; use more data or a smaller model.seq_len)"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        path_in_tmp(p, sizeof p, bad[i].name);
        write_shard(p, bad[i].magic, bad[i].version, bad[i].count, t, bad[i].written, bad[i].extra);
        expect_open_error(p, 16, 256, bad[i].want);
    }
    /* token >= vocab: token 200 at offset 123 with vocab 200 (all others < 200) */
    path_in_tmp(p, sizeof p, "vocab.bin");
    t[123] = 200;
    write_shard(p, DG_SHARD_MAGIC, 1, 300, t, 300, 0);
    expect_open_error(p, 16, 200,
                      "data shard %s/vocab.bin: token id 200 at token offset 123 (byte offset 1270) is >= "
                      "vocab_size 200");
    /* the same file is fine with a larger vocabulary */
    dg_dataset_t *ds = NULL;
    CHECK(dg_dataset_open(p, 16, 201, &ds) == DG_OK, "vocab 201: %s", dg_last_error());
    dg_dataset_free(ds);
    /* a bad token far into a large shard (beyond the first scan chunk), and 65535 */
    uint16_t *big = pattern(200000, 0, 256);
    big[150001] = 65535;
    path_in_tmp(p, sizeof p, "big.bin");
    write_shard(p, DG_SHARD_MAGIC, 1, 200000, big, 200000, 0);
    expect_open_error(
        p, 16, 256,
        "data shard %s/big.bin: token id 65535 at token offset 150001 (byte offset 301026) is >= "
        "vocab_size 256");
    free(big);
    /* empty file */
    path_in_tmp(p, sizeof p, "empty.bin");
    FILE *f = fopen(p, "wb");
    fclose(f);
    expect_open_error(
        p, 16, 256,
        "data shard %s/empty.bin: file is empty (expected a 1024-byte llm.c header, then uint16 tokens)");
    /* shorter than the header */
    path_in_tmp(p, sizeof p, "tiny.bin");
    f = fopen(p, "wb");
    fputs("hello", f);
    fclose(f);
    expect_open_error(p, 16, 256,
                      "data shard %s/tiny.bin: file is 5 bytes, too short for the 1024-byte llm.c header");
    /* missing file */
    path_in_tmp(p, sizeof p, "missing.bin");
    expect_open_error(p, 16, 256, "data shard %s/missing.bin: cannot open: No such file or directory");
    /* glob without a match */
    path_in_tmp(p, sizeof p, "nothing_*.bin");
    expect_open_error(
        p, 16, 256,
        "data: no file matches '%s/nothing_*.bin' (expected llm.c .bin token shards; dgprep makes them)");
    /* a directory */
    path_in_tmp(p, sizeof p, "adir");
    mkdir(p, 0755);
    expect_open_error(p, 16, 256, "data shard %s/adir: not a regular file");
    /* one bad shard among good ones fails the whole set, naming the bad one */
    char g[512];
    path_in_tmp(p, sizeof p, "set_000.bin");
    write_shard(p, DG_SHARD_MAGIC, 1, 300, t, 300, 0);
    path_in_tmp(p, sizeof p, "set_001.bin");
    write_shard(p, 1234, 1, 300, t, 300, 0);
    path_in_tmp(g, sizeof g, "set_*.bin");
    expect_open_error(
        g, 16, 256,
        "data shard %s/set_001.bin: bad magic 1234 at byte offset 0 (expected 20240520: not an llm.c "
        "token shard)");
    /* bad arguments */
    CHECK(dg_dataset_open("", 16, 256, &ds) == DG_ERR_USAGE, "empty glob");
    CHECK(dg_dataset_open(g, 0, 256, &ds) == DG_ERR_USAGE, "seq_len 0");
    CHECK(dg_dataset_open(g, 16, 70000, &ds) == DG_ERR_USAGE, "vocab 70000");
    free(t);
}

/* A shard that changes under an open data set (what a run sees when a shard is truncated or rewritten
 * while it trains): every read afterwards fails with DG_ERR_RUNTIME naming the file and the byte offset,
 * never a signal (shards are read with pread, not mapped), and the unchanged shard stays readable. */
static void case_shard_change(void) {
    char p0[512], p1[512], g[512];
    path_in_tmp(p0, sizeof p0, "c_000.bin");
    path_in_tmp(p1, sizeof p1, "c_001.bin");
    uint16_t *t = pattern(4001, 5, 200);
    write_shard(p0, DG_SHARD_MAGIC, 1, 4001, t, 4001, 0);
    write_shard(p1, DG_SHARD_MAGIC, 1, 4001, t, 4001, 0);
    path_in_tmp(g, sizeof g, "c_*.bin");
    int64_t n = 0;
    CHECK(dg_dataset_probe(g, 16, &n) == DG_OK && n == 500, "probe: %lld %s", (long long)n, dg_last_error());
    dg_dataset_t *ds = NULL;
    dg_loader_t *ld = NULL;
    CHECK(dg_dataset_open(g, 16, 256, &ds) == DG_OK, "open: %s", dg_last_error());
    if (!ds) return;
    CHECK(dg_loader_create(ds, 1, 0, &ld) == DG_OK, "loader");
    int32_t x[16 * 4], y[16 * 4];
    CHECK(dg_dataset_get_sample(ds, 249, x, y) == DG_OK, "%s", dg_last_error());
    CHECK(dg_loader_fill(ld, 0, 0, 1, 4, x, y) == DG_OK, "%s", dg_last_error());
    /* truncated to 3000 bytes: a sample beyond the new end is a short read */
    DG_ASSERT(truncate(p0, 3000) == 0);
    dg_status_t s = dg_dataset_get_sample(ds, 240, x, y);
    CHECK(s == DG_ERR_RUNTIME && strstr(dg_last_error(), p0) && strstr(dg_last_error(), "truncated") &&
              strstr(dg_last_error(), "byte offset 8704") && strstr(dg_last_error(), "now 3000 bytes"),
          "short read: %d %s", s, dg_last_error());
    /* a sample still inside the remaining bytes: refused too (the size check), naming the new end */
    s = dg_dataset_get_sample(ds, 0, x, y);
    CHECK(s == DG_ERR_RUNTIME && strstr(dg_last_error(), p0) && strstr(dg_last_error(), "byte offset 3000"),
          "size check: %d %s", s, dg_last_error());
    s = dg_loader_fill(ld, 0, 0, 1, 4, x, y);
    CHECK(s == DG_ERR_RUNTIME && strstr(dg_last_error(), p0), "loader fill: %d %s", s, dg_last_error());
    /* the other shard is still fine */
    CHECK(dg_dataset_get_sample(ds, 250, x, y) == DG_OK, "%s", dg_last_error());
    /* header rewritten in place (same size): the token count at byte offset 8 */
    int fd = open(p1, O_WRONLY);
    DG_ASSERT(fd >= 0);
    uint8_t four[4];
    put32(four, 123);
    DG_ASSERT(pwrite(fd, four, 4, 8) == 4);
    s = dg_dataset_get_sample(ds, 250, x, y);
    CHECK(s == DG_ERR_RUNTIME && strstr(dg_last_error(), p1) && strstr(dg_last_error(), "header rewritten") &&
              strstr(dg_last_error(), "byte offset 8 is now 123 (it was 4001"),
          "header: %d %s", s, dg_last_error());
    put32(four, 4001);
    DG_ASSERT(pwrite(fd, four, 4, 8) == 4);
    CHECK(dg_dataset_get_sample(ds, 250, x, y) == DG_OK, "restored header: %s", dg_last_error());
    /* magic rewritten */
    put32(four, 777);
    DG_ASSERT(pwrite(fd, four, 4, 0) == 4);
    s = dg_dataset_get_sample(ds, 251, x, y);
    CHECK(s == DG_ERR_RUNTIME && strstr(dg_last_error(), "magic at byte offset 0 is now 777"), "magic: %s",
          dg_last_error());
    put32(four, DG_SHARD_MAGIC);
    DG_ASSERT(pwrite(fd, four, 4, 0) == 4);
    /* a token rewritten out of range: token offset 16*260 + 3 of shard 1 (sample 260, position 3) */
    uint8_t bad[2] = {0x10, 0x27}; /* 10000 */
    DG_ASSERT(pwrite(fd, bad, 2, 1024 + 2 * (16 * 10 + 3)) == 2);
    s = dg_dataset_get_sample(ds, 260, x, y);
    CHECK(s == DG_ERR_RUNTIME &&
              strstr(dg_last_error(), "token id 10000 at token offset 163 (byte offset 1350)"),
          "token: %d %s", s, dg_last_error());
    close(fd);
    dg_loader_free(ld);
    dg_dataset_free(ds);
    free(t);
}

/* Bounded random damage (deterministic seed): flipped header bytes, truncation, appended junk, random
 * token values. open must either succeed, after which every sample is readable (ASan/UBSan builds check
 * the reads), or fail with DG_ERR_USAGE and a message naming the file — never crash. */
static void case_shard_fuzz(void) {
    char p[512];
    path_in_tmp(p, sizeof p, "fuzz.bin");
    uint64_t rng = 0x1234567;
    int ok = 0, refused = 0;
    for (int it = 0; it < 300; it++) {
        int64_t n = 50 + (int64_t)(rng % 400);
        uint16_t *t = pattern(n, it, 256);
        FILE *f = fopen(p, "wb");
        uint8_t hdr[1024] = {0};
        put32(hdr, DG_SHARD_MAGIC);
        put32(hdr + 4, 1);
        put32(hdr + 8, (int32_t)n);
        for (int k = 0; k < 3; k++) {
            rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
            int what = (int)(rng >> 60) % 4;
            if (what == 0) hdr[(rng >> 20) % 12] ^= (uint8_t)(1u << ((rng >> 8) % 8));
            if (what == 1) t[(rng >> 16) % (uint64_t)n] = (uint16_t)(rng >> 32);
        }
        fwrite(hdr, 1, sizeof hdr, f);
        fwrite(t, 2, (size_t)n, f);
        fclose(f);
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        if ((rng >> 61) == 0) DG_ASSERT(truncate(p, (off_t)((rng >> 10) % (1024 + 2 * (uint64_t)n))) == 0);
        if ((rng >> 61) == 1) {
            f = fopen(p, "ab");
            fputs("junk", f);
            fclose(f);
        }
        dg_dataset_t *ds = NULL;
        dg_status_t s = dg_dataset_open(p, 8, 256, &ds);
        if (s == DG_OK) {
            int32_t x[8], y[8];
            for (int64_t i = 0; i < dg_dataset_n_samples(ds); i++) {
                dg_dataset_get_sample(ds, i, x, y);
                for (int j = 0; j < 8; j++)
                    CHECK(x[j] < 256 && y[j] < 256, "token out of range");
            }
            dg_dataset_free(ds);
            ok++;
        } else {
            CHECK(s == DG_ERR_USAGE && strstr(dg_last_error(), p), "iteration %d: %d %s", it, s,
                  dg_last_error());
            refused++;
        }
        free(t);
    }
    printf("fuzz: %d opened, %d refused\n", ok, refused);
    CHECK(ok > 20 && refused > 20, "fuzz did not exercise both outcomes (%d ok, %d refused)", ok, refused);
}

/* A data set of `n` samples of seq_len 4 whose sample s has tokens starting at 4s: sample ids can be
 * read back from the tokens (token[0] / 4 ... within one shard of 4n+1 tokens, values mod 65536). */
static dg_dataset_t *id_dataset(int64_t n, const char *name) {
    char p[512];
    path_in_tmp(p, sizeof p, name);
    int64_t ntok = 4 * n + 1;
    uint16_t *t = malloc((size_t)ntok * 2);
    for (int64_t i = 0; i < ntok; i++)
        t[i] = (uint16_t)(i / 4);
    write_shard(p, DG_SHARD_MAGIC, 1, (int32_t)ntok, t, ntok, 0);
    free(t);
    dg_dataset_t *ds = NULL;
    dg_status_t s = dg_dataset_open(p, 4, 65536, &ds);
    DG_ASSERTF(s == DG_OK, "%s", dg_last_error());
    return ds;
}

/* Sample ids of one step for (dp_rank, dp_size, micro_batch, k micro-steps), read back from tokens. */
static void step_ids(const dg_loader_t *ld, int dp_rank, int dp_size, int mb, int k, int64_t *ids) {
    int32_t *x = malloc(sizeof(int32_t) * 4 * (size_t)mb);
    for (int j = 0; j < k; j++) {
        dg_status_t s = dg_loader_fill(ld, j, dp_rank, dp_size, mb, x, NULL);
        DG_ASSERTF(s == DG_OK, "%s", dg_last_error());
        for (int i = 0; i < mb; i++)
            ids[j * mb + i] = x[i * 4];
    }
    free(x);
}

static void case_permutation(void) {
    /* Bijection for many sizes, seeds and epochs. */
    for (int64_t n = 1; n <= 300; n++) {
        char *seen = calloc((size_t)n, 1);
        for (int64_t e = 0; e < 3; e++) {
            memset(seen, 0, (size_t)n);
            for (int64_t i = 0; i < n; i++) {
                int64_t v = dg_data_permute(i, n, 1337 + (uint64_t)n, e);
                CHECK(v >= 0 && v < n && !seen[v], "n %lld e %lld: %lld -> %lld", (long long)n, (long long)e,
                      (long long)i, (long long)v);
                if (v >= 0 && v < n) seen[v] = 1;
            }
        }
        free(seen);
    }
    int64_t big = 1000003;
    char *seen = calloc((size_t)big, 1);
    int64_t fixed = 0;
    for (int64_t i = 0; i < big; i++) {
        int64_t v = dg_data_permute(i, big, 42, 7);
        CHECK(v >= 0 && v < big && !seen[v], "big %lld -> %lld", (long long)i, (long long)v);
        if (v >= 0 && v < big) seen[v] = 1;
        fixed += v == i;
    }
    free(seen);
    /* A random permutation has ~1 fixed point on average; a broken one (identity-ish) has many. */
    CHECK(fixed < 20, "fixed points %lld", (long long)fixed);
    /* Pinned values (also computed by an independent Python model of docs/data.md's algorithm): the
     * order must not change between versions or machines, since resume depends on it. */
    int64_t a = dg_data_permute(0, 1000, 1337, 0), b = dg_data_permute(999, 1000, 1337, 0),
            c = dg_data_permute(5, 1000, 1337, 1);
    printf("pinned permutation values: %lld %lld %lld\n", (long long)a, (long long)b, (long long)c);
    CHECK(a == 865 && b == 538 && c == 422, "pinned %lld %lld %lld", (long long)a, (long long)b,
          (long long)c);
}

static void case_order(void) {
    dg_dataset_t *ds = id_dataset(1000, "ids.bin");
    dg_loader_t *a, *b, *c, *u;
    CHECK(dg_loader_create(ds, 1337, 1, &a) == DG_OK, "create");
    CHECK(dg_loader_create(ds, 1337, 1, &b) == DG_OK, "create");
    CHECK(dg_loader_create(ds, 1338, 1, &c) == DG_OK, "create");
    CHECK(dg_loader_create(ds, 1337, 0, &u) == DG_OK, "create");
    int64_t ia[16], ib[16], ic[16], iu[16];
    int same_ab = 1, same_ac = 1, moved = 0;
    for (int step = 0; step < 40; step++) {
        step_ids(a, 0, 1, 8, 2, ia);
        step_ids(b, 0, 1, 8, 2, ib);
        step_ids(c, 0, 1, 8, 2, ic);
        step_ids(u, 0, 1, 8, 2, iu);
        for (int i = 0; i < 16; i++) {
            same_ab &= ia[i] == ib[i];
            same_ac &= ia[i] == ic[i];
            moved += ia[i] != step * 16 + i;
            CHECK(iu[i] == step * 16 + i, "unshuffled step %d row %d: id %lld", step, i, (long long)iu[i]);
        }
        dg_loader_advance(a, 16);
        dg_loader_advance(b, 16);
        dg_loader_advance(c, 16);
        dg_loader_advance(u, 16);
    }
    CHECK(same_ab, "same seed gave different orders");
    CHECK(!same_ac, "different seeds gave the same order");
    CHECK(moved > 600, "shuffled order too close to identity (%d of 640 moved)", moved);
    /* the shuffled order matches dg_data_permute directly */
    dg_loader_reset(a);
    step_ids(a, 0, 1, 4, 1, ia);
    for (int i = 0; i < 4; i++)
        CHECK(ia[i] == dg_data_permute(i, 1000, 1337, 0), "row %d: %lld", i, (long long)ia[i]);
    dg_loader_free(a);
    dg_loader_free(b);
    dg_loader_free(c);
    dg_loader_free(u);
    dg_dataset_free(ds);
}

static void case_resume(void) {
    dg_dataset_t *ds = id_dataset(100, "ids.bin");
    dg_loader_t *a, *b;
    dg_loader_create(ds, 7, 1, &a);
    /* Run 9 steps of 12 (one epoch is 100 samples, so this is mid-epoch 1), save, run 10 more. */
    int64_t ids[12], ref[10][12];
    for (int s = 0; s < 9; s++) {
        step_ids(a, 0, 1, 4, 3, ids);
        dg_loader_advance(a, 12);
    }
    dg_loader_state_t st;
    dg_loader_get_state(a, &st);
    CHECK(st.epoch == 1 && st.cursor == 8 && st.samples_seen == 108, "state %lld %lld %llu",
          (long long)st.epoch, (long long)st.cursor, (unsigned long long)st.samples_seen);
    for (int s = 0; s < 10; s++) {
        step_ids(a, 0, 1, 4, 3, ref[s]);
        dg_loader_advance(a, 12);
    }
    /* A fresh loader (another process, another world size) restored from the state continues the
     * identical sequence: here read by 2 ranks with micro_batch 2 and 3 micro-steps. */
    dg_loader_create(ds, 7, 1, &b);
    CHECK(dg_loader_set_state(b, &st) == DG_OK, "set_state: %s", dg_last_error());
    for (int s = 0; s < 10; s++) {
        int64_t r0[6], r1[6];
        step_ids(b, 0, 2, 2, 3, r0);
        step_ids(b, 1, 2, 2, 3, r1);
        /* micro-step j: rank 0 takes positions 4j..4j+1, rank 1 takes 4j+2..4j+3 */
        for (int j = 0; j < 3; j++)
            for (int i = 0; i < 2; i++) {
                CHECK(r0[j * 2 + i] == ref[s][j * 4 + i], "resume step %d", s);
                CHECK(r1[j * 2 + i] == ref[s][j * 4 + 2 + i], "resume step %d", s);
            }
        dg_loader_advance(b, 12);
    }
    dg_loader_state_t sa, sb;
    dg_loader_get_state(a, &sa);
    dg_loader_get_state(b, &sb);
    CHECK(sa.epoch == sb.epoch && sa.cursor == sb.cursor && sa.samples_seen == sb.samples_seen,
          "final states");
    /* states that cannot belong to this data set */
    dg_loader_state_t bad = {0, 100, 0};
    CHECK(dg_loader_set_state(b, &bad) == DG_ERR_USAGE, "cursor == n accepted");
    CHECK(strstr(dg_last_error(), "cursor 100 outside this data set's 100 samples") != NULL, "msg: %s",
          dg_last_error());
    bad = (dg_loader_state_t){-1, 0, 0};
    CHECK(dg_loader_set_state(b, &bad) == DG_ERR_USAGE, "negative epoch accepted");
    dg_loader_free(a);
    dg_loader_free(b);
    dg_dataset_free(ds);
}

static void case_dp_split(void) {
    /* global batch 16 as (D, micro_batch, k) = (1,16,1) (1,4,4) (2,8,1) (2,2,4) (4,4,1) (4,1,4) (8,2,1):
     * every layout reads exactly the same 16 samples in the same global positions. */
    dg_dataset_t *ds = id_dataset(37, "ids.bin"); /* 37: batches straddle epochs */
    static const int lay[][3] = {{1, 16, 1}, {1, 4, 4}, {2, 8, 1}, {2, 2, 4},
                                 {4, 4, 1},  {4, 1, 4}, {8, 2, 1}};
    int nl = (int)(sizeof lay / sizeof lay[0]);
    dg_loader_t *ld[8];
    for (int l = 0; l < nl; l++)
        dg_loader_create(ds, 99, 1, &ld[l]);
    for (int step = 0; step < 12; step++) {
        int64_t ref[16];
        for (int l = 0; l < nl; l++) {
            int D = lay[l][0], m = lay[l][1], k = lay[l][2];
            int64_t got[16];
            for (int r = 0; r < D; r++) {
                int64_t ids[16];
                step_ids(ld[l], r, D, m, k, ids);
                for (int j = 0; j < k; j++)
                    for (int i = 0; i < m; i++)
                        got[(j * D + r) * m + i] = ids[j * m + i];
            }
            if (l == 0) memcpy(ref, got, sizeof ref);
            for (int i = 0; i < 16; i++)
                CHECK(got[i] == ref[i], "step %d layout D=%d m=%d k=%d pos %d: %lld vs %lld", step, D, m, k,
                      i, (long long)got[i], (long long)ref[i]);
            for (int i = 0; i < 16; i++)
                CHECK(ref[i] == dg_loader_sample_at(ld[l], i, NULL), "sample_at pos %d", i);
            dg_loader_advance(ld[l], 16);
        }
    }
    for (int l = 0; l < nl; l++)
        dg_loader_free(ld[l]);
    /* bad slots are refused, not read out of bounds */
    dg_loader_t *x;
    dg_loader_create(ds, 1, 1, &x);
    int32_t buf[64];
    CHECK(dg_loader_fill(x, 0, 2, 2, 1, buf, buf) == DG_ERR_USAGE, "rank >= size");
    CHECK(dg_loader_fill(x, -1, 0, 1, 1, buf, buf) == DG_ERR_USAGE, "negative micro_step");
    CHECK(dg_loader_fill(x, 0, 0, 1, 0, buf, buf) == DG_ERR_USAGE, "micro_batch 0");
    dg_loader_free(x);
    dg_dataset_free(ds);
}

static void case_epoch_wrap(void) {
    dg_dataset_t *ds = id_dataset(10, "ids.bin");
    dg_loader_t *ld;
    dg_loader_create(ds, 5, 1, &ld);
    /* 10 samples, global batch 4: step 2 straddles epochs 0 and 1 (positions 8,9 | 0,1). Over 5
     * steps (20 samples) every sample appears once per epoch, epoch 1 in another order. */
    int64_t seq[20];
    for (int s = 0; s < 5; s++) {
        int64_t ep_first, ep_last;
        dg_loader_sample_at(ld, 0, &ep_first);
        dg_loader_sample_at(ld, 3, &ep_last);
        if (s == 2)
            CHECK(ep_first == 0 && ep_last == 1, "step 2 epochs %lld..%lld", (long long)ep_first,
                  (long long)ep_last);
        step_ids(ld, 0, 1, 4, 1, seq + 4 * s);
        dg_loader_advance(ld, 4);
    }
    for (int e = 0; e < 2; e++) {
        int seen[10] = {0};
        for (int i = 0; i < 10; i++)
            seen[seq[e * 10 + i]]++;
        for (int i = 0; i < 10; i++)
            CHECK(seen[i] == 1, "epoch %d sample %d seen %d times", e, i, seen[i]);
        for (int i = 0; i < 10; i++)
            CHECK(seq[e * 10 + i] == dg_data_permute(i, 10, 5, e), "epoch %d pos %d", e, i);
    }
    int differs = 0;
    for (int i = 0; i < 10; i++)
        differs += seq[i] != seq[10 + i];
    CHECK(differs > 0, "epoch 1 repeats epoch 0's order");
    dg_loader_state_t st;
    dg_loader_get_state(ld, &st);
    CHECK(st.epoch == 2 && st.cursor == 0 && st.samples_seen == 20, "state after 2 epochs: %lld %lld",
          (long long)st.epoch, (long long)st.cursor);
    /* a global batch larger than the data set spans several epochs */
    dg_loader_advance(ld, 25);
    dg_loader_get_state(ld, &st);
    CHECK(st.epoch == 4 && st.cursor == 5 && st.samples_seen == 45, "after 25: %lld %lld",
          (long long)st.epoch, (long long)st.cursor);
    int64_t ep;
    dg_loader_sample_at(ld, 24, &ep);
    CHECK(ep == 6, "position 24 from cursor 5 is in epoch %lld", (long long)ep);
    dg_loader_free(ld);
    dg_dataset_free(ds);
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    DG_ASSERT(f != NULL);
    fputs(text, f);
    fclose(f);
}

/* Read all tokens of a glob (as bytes) back into one malloc'd string. */
static char *read_back(const char *glob, int64_t *n_out) {
    dg_dataset_t *ds = NULL;
    dg_status_t s = dg_dataset_open(glob, 1, 256, &ds);
    if (s != DG_OK) {
        fprintf(stderr, "read_back %s: %s\n", glob, dg_last_error());
        *n_out = -1;
        return NULL;
    }
    int64_t n = dg_dataset_n_tokens(ds);
    char *out = malloc((size_t)n + 1);
    int64_t k = 0;
    /* seq_len 1: sample s of a shard is tokens s, s+1; walk shards via samples */
    int32_t x, y;
    int64_t ns = dg_dataset_n_samples(ds);
    int64_t smp = 0;
    for (int sh = 0; sh < dg_dataset_n_shards(ds); sh++) {
        /* each shard of m tokens has m-1 samples: emit x of each, then the last y */
        char p[4096];
        dg_fmt(p, sizeof p, "%s", dg_dataset_shard_path(ds, sh));
        struct stat st;
        stat(p, &st);
        int64_t m = ((int64_t)st.st_size - 1024) / 2;
        for (int64_t i = 0; i < m - 1; i++, smp++) {
            dg_dataset_get_sample(ds, smp, &x, &y);
            out[k++] = (char)x;
            if (i == m - 2) out[k++] = (char)y;
        }
    }
    DG_ASSERT(smp == ns && k == n);
    out[k] = 0;
    *n_out = n;
    dg_dataset_free(ds);
    return out;
}

static void case_prep(void) {
    char in[256], a[512], b[512], c[512], out[256];
    path_in_tmp(in, sizeof in, "text");
    mkdir(in, 0755);
    dg_fmt(a, sizeof a, "%s/a.txt", in);
    dg_fmt(b, sizeof b, "%s/b.txt", in);
    dg_fmt(c, sizeof c, "%s/c.txt", in);
    /* a: 10 lines of 10 bytes; cut0 = 100 - 20 = 80, a line start: val = last 2 lines */
    write_text(a, "line 0 aa\nline 1 aa\nline 2 aa\nline 3 aa\nline 4 aa\nline 5 aa\nline 6 aa\nline 7 aa\n"
                  "line 8 aa\nline 9 aa\n");
    /* b: no final newline; cut0 = 24 - 5 = 19 is mid-line, moves to the next line start (21) */
    write_text(b, "bbbbbbbbb\nbbbbbbbbbb\nxyz");
    /* c: one line, no newline after cut0: the cut stays at cut0 = 8 */
    write_text(c, "cccccccccc");
    path_in_tmp(out, sizeof out, "out");
    const char *inputs[] = {in};
    dg_prep_opts_t o = {.inputs = inputs,
                        .n_inputs = 1,
                        .out_dir = out,
                        .name = "t",
                        .val_fraction = 0.2,
                        .shard_tokens = 50,
                        .quiet = 1};
    dg_prep_result_t r;
    dg_status_t s = dg_data_prep(&o, &r);
    CHECK(s == DG_OK, "prep: %s", dg_last_error());
    const char *want_tr =
        "line 0 aa\nline 1 aa\nline 2 aa\nline 3 aa\nline 4 aa\nline 5 aa\nline 6 aa\nline 7 aa\n"
        "bbbbbbbbb\nbbbbbbbbbb\ncccccccc";
    const char *want_va = "line 8 aa\nline 9 aa\nxyz\ncc\n";
    CHECK(r.n_files == 3 && r.in_bytes == 134, "files %d bytes %lld", r.n_files, (long long)r.in_bytes);
    CHECK(r.train_tokens == (int64_t)strlen(want_tr) && r.val_tokens == (int64_t)strlen(want_va),
          "tokens %lld %lld", (long long)r.train_tokens, (long long)r.val_tokens);
    CHECK(r.train_shards == 3 && r.val_shards == 1, "shards %d %d", r.train_shards, r.val_shards);
    char g[1024];
    dg_fmt(g, sizeof g, "%s/t_train_*.bin", out);
    CHECK(strcmp(r.train_glob, g) == 0, "train glob %s", r.train_glob);
    int64_t n;
    char *tr = read_back(r.train_glob, &n);
    CHECK(tr && strcmp(tr, want_tr) == 0, "train bytes:\n%s", tr ? tr : "(null)");
    free(tr);
    char *va = read_back(r.val_glob, &n);
    CHECK(va && strcmp(va, want_va) == 0, "val bytes:\n%s", va ? va : "(null)");
    free(va);
    /* dgprep's shards record their tokenizer (bytes); an llm.c shard without the tag records none, and a
     * set mixing the two is unknown */
    dg_dataset_t *ds = NULL;
    CHECK(dg_dataset_open(r.train_glob, 4, 256, &ds) == DG_OK, "open: %s", dg_last_error());
    uint64_t fp = 1;
    char name[64];
    dg_dataset_tokenizer_str(ds, name, sizeof name);
    CHECK(dg_dataset_tokenizer(ds, &fp) == DG_SHARD_TOK_BYTES && fp == 0 && strcmp(name, "bytes") == 0,
          "tokenizer of dgprep's shards: %s", name);
    dg_dataset_free(ds);
    char llmc[512];
    dg_fmt(llmc, sizeof llmc, "%s/t_train_000009.bin", out);
    uint16_t *t = pattern(40, 1, 256);
    write_shard(llmc, DG_SHARD_MAGIC, 1, 40, t, 40, 0);
    CHECK(dg_dataset_open(r.train_glob, 4, 256, &ds) == DG_OK, "open mixed: %s", dg_last_error());
    dg_dataset_tokenizer_str(ds, name, sizeof name);
    CHECK(dg_dataset_tokenizer(ds, &fp) == DG_SHARD_TOK_UNKNOWN && fp == 0 && name[0] == 0, "mixed set: %s",
          name);
    dg_dataset_free(ds);
    unlink(llmc);
    free(t);
    /* Re-run with bigger shards: the stale t_train_000001/2.bin must disappear. */
    o.shard_tokens = 0;
    CHECK(dg_data_prep(&o, &r) == DG_OK && r.train_shards == 1, "rerun: %s", dg_last_error());
    char stale[1024];
    dg_fmt(stale, sizeof stale, "%s/t_train_000001.bin", out);
    CHECK(access(stale, F_OK) != 0, "stale shard left behind");
    /* Directory rules: binary, empty, symlink, hidden and duplicate files inside a directory are skipped. */
    char p[600];
    dg_fmt(p, sizeof p, "%s/d.bin", in);
    FILE *f = fopen(p, "wb");
    fwrite("ab\0cd", 1, 5, f);
    fclose(f);
    dg_fmt(p, sizeof p, "%s/e.txt", in);
    write_text(p, "");
    dg_fmt(p, sizeof p, "%s/f.txt", in);
    CHECK(symlink("a.txt", p) == 0, "symlink");
    dg_fmt(p, sizeof p, "%s/.hidden", in);
    write_text(p, "hidden text\n");
    dg_fmt(p, sizeof p, "%s/g.txt", in);
    write_text(p, "cccccccccc");
    o.shard_tokens = 0;
    CHECK(dg_data_prep(&o, &r) == DG_OK, "dir rules: %s", dg_last_error());
    CHECK(r.n_files == 3 && r.n_skipped == 4 && r.train_tokens == (int64_t)strlen(want_tr),
          "dir rules: files %d skipped %d train %lld", r.n_files, r.n_skipped, (long long)r.train_tokens);
    /* Explicit files: binary and empty are errors with exact messages. */
    const char *one[1];
    one[0] = p; /* g.txt: fine */
    dg_prep_opts_t e = {
        .inputs = one, .n_inputs = 1, .out_dir = out, .name = "t", .val_fraction = 0.1, .quiet = 1};
    dg_fmt(p, sizeof p, "%s/d.bin", in);
    CHECK(dg_data_prep(&e, &r) == DG_ERR_USAGE, "binary accepted");
    char want[1200];
    dg_fmt(want, sizeof want, "dgprep: %s/d.bin is not text: NUL byte at offset 2", in);
    CHECK(strcmp(dg_last_error(), want) == 0, "got %s", dg_last_error());
    dg_fmt(p, sizeof p, "%s/ctl.txt", in);
    write_text(p, "text with \x01\x02 two control bytes among 50 bytes of text!!\n");
    CHECK(dg_data_prep(&e, &r) == DG_ERR_USAGE, "control-heavy accepted");
    dg_fmt(
        want, sizeof want,
        "dgprep: %s/ctl.txt is not text: 2 of 56 bytes (3.6%%) are control characters (at most 1%% allowed)",
        in);
    CHECK(strcmp(dg_last_error(), want) == 0, "got %s", dg_last_error());
    dg_fmt(p, sizeof p, "%s/e.txt", in);
    CHECK(dg_data_prep(&e, &r) == DG_ERR_USAGE, "empty accepted");
    dg_fmt(want, sizeof want, "dgprep: %s/e.txt is empty", in);
    CHECK(strcmp(dg_last_error(), want) == 0, "got %s", dg_last_error());
    /* A failed run leaves the earlier output intact and no temporaries behind. */
    int64_t before;
    char *keep = read_back(r.train_glob[0] ? r.train_glob : g, &before);
    CHECK(keep && before == (int64_t)strlen(want_tr), "earlier output damaged (%lld)", (long long)before);
    free(keep);
    char cmd[1200];
    dg_fmt(cmd, sizeof cmd, "test -z \"$(ls -A '%s' | grep tmp)\"", out);
    CHECK(system(cmd) == 0, "temporary files left in %s", out);
}

static void case_default_data(void) {
    char src[256], dir[256], tg[4096], vg[4096];
    path_in_tmp(src, sizeof src, "licenses");
    mkdir(src, 0755);
    char p[600];
    /* Enough text for the default val fraction to yield a val split, plus the things to skip. */
    for (int i = 0; i < 3; i++) {
        dg_fmt(p, sizeof p, "%s/LICENSE-%d", src, i);
        FILE *f = fopen(p, "wb");
        for (int l = 0; l < 40; l++)
            fprintf(f, "License %d, line %d: permission is hereby granted.\n", i, l);
        fclose(f);
    }
    dg_fmt(p, sizeof p, "%s/LICENSE", src);
    CHECK(symlink("LICENSE-2", p) == 0, "symlink");
    setenv("DG_DEFAULT_TEXT_DIR", src, 1);
    path_in_tmp(dir, sizeof dir, "cache/default");

    /* Four processes race to build it; all must succeed and agree. */
    pid_t kids[4];
    for (int k = 0; k < 4; k++) {
        kids[k] = fork();
        if (kids[k] == 0) {
            char t[4096], v[4096];
            dg_status_t s = dg_data_default_paths(dir, t, v, sizeof t);
            if (s != DG_OK) fprintf(stderr, "child %d: %s\n", k, dg_last_error());
            _exit(s == DG_OK ? 0 : 1);
        }
    }
    for (int k = 0; k < 4; k++) {
        int st = 0;
        waitpid(kids[k], &st, 0);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child %d failed", k);
    }
    dg_status_t s = dg_data_default_paths(dir, tg, vg, sizeof tg);
    CHECK(s == DG_OK, "default: %s", dg_last_error());
    char want[1024];
    dg_fmt(want, sizeof want, "%s/default_train_*.bin", dir);
    CHECK(strcmp(tg, want) == 0, "train glob %s", tg);
    dg_dataset_t *tr = NULL, *va = NULL;
    CHECK(dg_dataset_open(tg, 16, 256, &tr) == DG_OK, "open train: %s", dg_last_error());
    CHECK(dg_dataset_open(vg, 16, 256, &va) == DG_OK, "open val: %s", dg_last_error());
    int64_t total = tr && va ? dg_dataset_n_tokens(tr) + dg_dataset_n_tokens(va) : 0;
    /* 3 files x (10 lines of 49 bytes + 30 of 50); the symlink is not counted twice. */
    CHECK(total == 3 * (10 * 49 + 30 * 50), "default tokens %lld", (long long)total);
    dg_dataset_free(tr);
    dg_dataset_free(va);
    /* A second call reuses the build (same inode), a changed source rebuilds it. */
    char shard[1100];
    dg_fmt(shard, sizeof shard, "%s/default_train_000000.bin", dir);
    struct stat s1, s2;
    stat(shard, &s1);
    CHECK(dg_data_default_paths(dir, tg, vg, sizeof tg) == DG_OK, "again");
    stat(shard, &s2);
    CHECK(s1.st_ino == s2.st_ino, "rebuilt although nothing changed");
    /* A new mtime alone (same text installed at another time) does not rebuild either. */
    dg_fmt(p, sizeof p, "%s/LICENSE-0", src);
    struct timespec ts[2] = {{.tv_sec = 1000000000}, {.tv_sec = 1000000000}};
    CHECK(utimensat(AT_FDCWD, p, ts, 0) == 0, "utimensat");
    CHECK(dg_data_default_paths(dir, tg, vg, sizeof tg) == DG_OK, "after touch");
    stat(shard, &s2);
    CHECK(s1.st_ino == s2.st_ino, "rebuilt after an mtime-only change");
    dg_fmt(p, sizeof p, "%s/LICENSE-3", src);
    write_text(p, "One more license text, long enough to matter.\nAnd a second line.\n");
    CHECK(dg_data_default_paths(dir, tg, vg, sizeof tg) == DG_OK, "after change: %s", dg_last_error());
    stat(shard, &s2);
    CHECK(s1.st_ino != s2.st_ino, "not rebuilt after the texts changed");
    /* Missing texts: a clear error that says what to do. */
    path_in_tmp(p, sizeof p, "no-such-dir");
    setenv("DG_DEFAULT_TEXT_DIR", p, 1);
    s = dg_data_default_paths(dir, tg, vg, sizeof tg);
    CHECK(s == DG_ERR_USAGE, "missing texts: status %d", s);
    CHECK(strstr(dg_last_error(), "no-such-dir (No such file or directory)") &&
              strstr(dg_last_error(), "dgprep"),
          "msg: %s", dg_last_error());
    unsetenv("DG_DEFAULT_TEXT_DIR");

    /* The real thing, where this system has it: report its size (docs/data.md quotes it). */
    struct stat st;
    if (stat(DG_DEFAULT_TEXT_DIR, &st) == 0) {
        path_in_tmp(dir, sizeof dir, "real");
        double t0 = dg_now_s();
        s = dg_data_default_paths(dir, tg, vg, sizeof tg);
        CHECK(s == DG_OK, "real default data: %s", dg_last_error());
        if (s == DG_OK && dg_dataset_open(tg, 128, 256, &tr) == DG_OK &&
            dg_dataset_open(vg, 128, 256, &va) == DG_OK) {
            printf("default data from %s: %lld train tokens (%lld samples at T=128), %lld val tokens (%lld "
                   "samples) "
                   "in %.3f s\n",
                   DG_DEFAULT_TEXT_DIR, (long long)dg_dataset_n_tokens(tr),
                   (long long)dg_dataset_n_samples(tr), (long long)dg_dataset_n_tokens(va),
                   (long long)dg_dataset_n_samples(va), dg_now_s() - t0);
            CHECK(dg_dataset_n_tokens(tr) > 100000, "real default data too small");
            dg_dataset_free(tr);
            dg_dataset_free(va);
        }
    } else {
        printf("note: %s not present here; real default data not checked\n", DG_DEFAULT_TEXT_DIR);
    }
}

int main(int argc, char **argv) {
    static const dg_check_case_t cases[] = {DG_CASE(shard_valid),  DG_CASE(shard_errors), DG_CASE(shard_fuzz),
                                            DG_CASE(shard_change), DG_CASE(permutation),  DG_CASE(order),
                                            DG_CASE(resume),       DG_CASE(dp_split),     DG_CASE(epoch_wrap),
                                            DG_CASE(prep),         DG_CASE(default_data)};
    return DG_CHECK_CASES(argc, argv, cases, "CASE|all", g_tmp, sizeof g_tmp, "dg_test_data");
}
