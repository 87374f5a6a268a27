/* fuzz_config.c — bounded random-mutation fuzzing of the config parser (libinih + our reader, value
 * parsing, --set handling). Every file of the corpus directory is parsed as is, then mutated N times
 * with a fixed-seed PRNG (byte flips, INI-significant characters, deletions, duplicated and swapped
 * lines, very long runs, splices from other corpus files, random --set arguments). Run under
 * ASan/UBSan in the sanitizer build, so any out-of-bounds access or UB is a failure.
 *
 * Invariants checked on every input: the status is 0 or 1; a failure has a non-empty one-line message
 * (no control characters) naming the input ("fuzz.ini:LINE" or "--set ...") or the keys of a cross-key rule;
 * a success round-trips: its INI text loads back to the same INI text and hash.
 *
 *   fuzz_config CORPUS_DIR [ITERATIONS_PER_FILE] [SEED]
 *
 * libFuzzer: the same checks as a coverage-guided fuzzer (not part of ctest), from the repository root:
 *   clang -g -O1 -fsanitize=fuzzer,address,undefined -DDG_LIBFUZZER -Isrc/config -Isrc/common \
 *     tests/config/fuzz_config.c src/config/schema.c src/config/config.c src/common/common.c \
 *     src/common/mesh.c -linih -lxxhash -lpthread -lm -o libfuzz_config
 *   ./libfuzz_config -max_len=4096 CORPUS_COPY_DIR
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"

static dg_config_t g_cfg, g_cfg2;
static long g_fail, g_ok, g_err;

static void report(const char *why, const char *in, size_t len, const char *msg) {
    g_fail++;
    if (g_fail > 5) return;
    fprintf(stderr, "FAIL: %s\n  message: %s\n  input (%zu bytes): ", why, msg, len);
    for (size_t i = 0; i < len && i < 300; i++) {
        unsigned char c = (unsigned char)in[i];
        if (c == '\n')
            fputs("\\n", stderr);
        else if (c < 0x20 || c >= 0x7f)
            fprintf(stderr, "\\x%02x", c);
        else
            fputc(c, stderr);
    }
    fputc('\n', stderr);
}

static int known_prefix(const char *m) {
    static const char *prefixes[] = {"fuzz.ini:", "--set '", "train.", "model.", "health.", "parallel."};
    for (size_t i = 0; i < sizeof prefixes / sizeof *prefixes; i++)
        if (strncmp(m, prefixes[i], strlen(prefixes[i])) == 0) return 1;
    return 0;
}

static void check_one(const char *buf, size_t len, int nsets, const char *const *sets) {
    dg_clear_error();
    dg_status_t s = dg_config_load_buffer(&g_cfg, "fuzz.ini", buf, len, nsets, sets);
    const char *m = dg_last_error();
    if (s != DG_OK && s != DG_ERR_USAGE) {
        report("status is neither 0 nor 1", buf, len, m);
        return;
    }
    if (s != DG_OK) {
        g_err++;
        int ctrl = 0;
        for (const char *p = m; *p; p++)
            ctrl |= (unsigned char)*p < 0x20;
        if (!*m || ctrl || !known_prefix(m))
            report("bad error message (empty, control characters or no location)", buf, len, m);
        return;
    }
    g_ok++;
    char *ini = dg_config_to_ini(&g_cfg);
    uint64_t h = dg_config_hash(&g_cfg);
    if (dg_config_load_buffer(&g_cfg2, "roundtrip", ini, strlen(ini), 0, NULL) != DG_OK) {
        report("effective config does not load back", ini, strlen(ini), dg_last_error());
    } else {
        char *ini2 = dg_config_to_ini(&g_cfg2);
        if (strcmp(ini, ini2) != 0 || dg_config_hash(&g_cfg2) != h)
            report("round trip changed the config", buf, len, ini2);
        free(ini2);
    }
    free(ini);
}

#ifdef DG_LIBFUZZER
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    check_one((const char *)data, size, 0, NULL);
    if (g_fail) abort();
    return 0;
}
#else

static uint64_t g_rng;
static uint64_t rnd(void) { /* xorshift64*: fixed seed, same inputs every run */
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return g_rng * 2685821657736338717ULL;
}
static size_t rndn(size_t n) {
    return n ? (size_t)(rnd() % n) : 0;
}

typedef struct {
    char *data;
    size_t len;
} blob_t;

static const char k_special[] = "[]=:;#\"\n\r\t .,-_0123456789eE+\\\x01\xff\xef\xbb\xbf";
static const char *k_words[] = {"[train]",
                                "[run]",
                                "[parallel]",
                                "[topology]",
                                "steps",
                                "lr",
                                "mesh",
                                "=",
                                "dp_shard=2,tp=2",
                                "order=tp,dp_shard,dp_replicate",
                                "true",
                                "1e308",
                                "-0",
                                "0x10",
                                "\"",
                                "\"\"",
                                " ; c",
                                " # c",
                                "nan",
                                "inf",
                                "99999999999999999999",
                                "global_batch = 24",
                                "micro_batch = 8",
                                "preset = custom",
                                "\xc3\xa9"};

/* move b[at..n) up by k bytes (caller checked n + k < cap); a plain loop, because GCC's object-size
 * warnings cannot see the `at <= n` bound through memmove here */
static void open_gap(char *b, size_t n, size_t at, size_t k) {
    for (size_t i = n; i > at; i--)
        b[i - 1 + k] = b[i - 1];
}

/* one random edit of b (len may grow up to cap) */
static void mutate(char *b, size_t *len, size_t cap, const blob_t *corpus, int ncorpus) {
    size_t n = *len;
    switch (rndn(9)) {
    case 0: /* flip bits */
        if (n) b[rndn(n)] ^= (char)(1u << rndn(8));
        break;
    case 1: /* insert an INI-significant character */
        if (n + 1 < cap) {
            size_t at = rndn(n + 1);
            open_gap(b, n, at, 1);
            b[at] = k_special[rndn(sizeof k_special - 1)];
            n++;
        }
        break;
    case 2: { /* delete a range */
        if (!n) break;
        size_t at = rndn(n), k = 1 + rndn(16);
        if (at + k > n) k = n - at;
        memmove(b + at, b + at + k, n - at - k);
        n -= k;
        break;
    }
    case 3: { /* insert a word */
        const char *w = k_words[rndn(sizeof k_words / sizeof *k_words)];
        size_t wl = strlen(w), at = rndn(n + 1);
        if (n + wl < cap) {
            open_gap(b, n, at, wl);
            memcpy(b + at, w, wl);
            n += wl;
        }
        break;
    }
    case 4: { /* a long run of one character (inih's 200-byte line buffer, field capacities) */
        size_t k = 150 + rndn(1500), at = rndn(n + 1);
        if (n + k < cap) {
            open_gap(b, n, at, k);
            memset(b + at, "a/=;# \"["[rndn(8)], k);
            n += k;
        }
        break;
    }
    case 5: { /* duplicate a line */
        if (!n) break;
        size_t s = rndn(n);
        while (s && b[s - 1] != '\n')
            s--;
        size_t e = s;
        while (e < n && b[e] != '\n')
            e++;
        if (e < n) e++;
        size_t k = e - s;
        if (k && n + k < cap) {
            size_t at = rndn(n + 1);
            open_gap(b, n, at, k);
            memmove(b + at, b + (s >= at ? s + k : s), k);
            n += k;
        }
        break;
    }
    case 6: { /* splice in part of another corpus file */
        const blob_t *o = &corpus[rndn((size_t)ncorpus)];
        if (!o->len) break;
        size_t s = rndn(o->len), k = 1 + rndn(o->len - s);
        size_t at = rndn(n + 1);
        if (n + k < cap) {
            open_gap(b, n, at, k);
            memcpy(b + at, o->data + s, k);
            n += k;
        }
        break;
    }
    case 7: /* truncate */
        n = rndn(n + 1);
        break;
    default: /* random byte anywhere */
        if (n) b[rndn(n)] = (char)rnd();
        break;
    }
    *len = n;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: fuzz_config CORPUS_DIR [ITERATIONS_PER_FILE] [SEED]\n");
        return 2;
    }
    long iters = argc > 2 ? atol(argv[2]) : 2000;
    g_rng = argc > 3 ? strtoull(argv[3], NULL, 10) : 0x9E3779B97F4A7C15ULL;
    if (!g_rng) g_rng = 1;
    DIR *d = opendir(argv[1]);
    if (!d) {
        perror(argv[1]);
        return 2;
    }
    char *names[256];
    int nn = 0;
    for (struct dirent *e; (e = readdir(d)) && nn < 256;)
        if (e->d_name[0] != '.') names[nn++] = strdup(e->d_name);
    closedir(d);
    qsort(names, (size_t)nn, sizeof *names, cmp_str); /* readdir order is not stable */
    blob_t corpus[256];
    for (int i = 0; i < nn; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", argv[1], names[i]);
        FILE *f = fopen(path, "rb");
        if (!f) {
            perror(path);
            return 2;
        }
        corpus[i].data = malloc(1 << 16);
        corpus[i].len = fread(corpus[i].data, 1, 1 << 16, f);
        fclose(f);
    }
    if (nn == 0) {
        fprintf(stderr, "empty corpus %s\n", argv[1]);
        return 2;
    }
    size_t cap = 1 << 16;
    char *buf = malloc(cap);
    char setbuf[4][256];
    const char *sets[4];
    for (int i = 0; i < nn; i++) {
        check_one(corpus[i].data, corpus[i].len, 0, NULL); /* the corpus itself, as is */
        for (long it = 0; it < iters; it++) {
            size_t len = corpus[i].len;
            memcpy(buf, corpus[i].data, len);
            int edits = 1 + (int)rndn(6);
            for (int k = 0; k < edits; k++)
                mutate(buf, &len, cap, corpus, nn);
            int nsets = 0;
            if (rndn(4) == 0) { /* random --set arguments, mutated the same way */
                nsets = 1 + (int)rndn(3);
                for (int k = 0; k < nsets; k++) {
                    const char *base[] = {"train.steps=10",    "run.dir=runs/x",   "parallel.mesh=tp=2",
                                          "train.lr=1e-3",     "data.shuffle=yes", "steps=4",
                                          "topology.bind=none"};
                    const char *pick = base[rndn(7)];
                    char tmp[256];
                    size_t sl = strlen(pick);
                    memcpy(tmp, pick, sl + 1);
                    int e2 = (int)rndn(3);
                    for (int q = 0; q < e2; q++)
                        mutate(tmp, &sl, 200, corpus, nn);
                    tmp[sl] = 0;
                    memcpy(setbuf[k], tmp, sl + 1);
                    sets[k] = setbuf[k];
                }
            }
            check_one(buf, len, nsets, sets);
        }
    }
    printf("fuzz_config: %d corpus files, %ld inputs: %ld accepted, %ld rejected, %ld invariant failures\n",
           nn, g_ok + g_err, g_ok, g_err, g_fail);
    for (int i = 0; i < nn; i++) {
        free(corpus[i].data);
        free(names[i]);
    }
    free(buf);
    return g_fail ? 1 : 0;
}
#endif
