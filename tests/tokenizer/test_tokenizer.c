/* test_tokenizer.c — unit tests of src/tokenizer (one subcommand per ctest entry), and the encode /
 * decode helper that test_tiktoken.py drives to compare the C API with tiktoken.
 *
 *   test_tokenizer utf8 | toy | errors          need nothing installed
 *   test_tokenizer roundtrip | special | bpe | split | threads | hf RANKS_OR_-
 *       need GPT-2's ranks ("-": the installed file, dg_tokenizer_find_gpt2); missing: exit 77 (skip),
 *       or 1 under CI=true
 *   test_tokenizer encode-docs (--tiktoken FILE | --hf DIR) IN OUT
 *   test_tokenizer decode-docs (--tiktoken FILE | --hf DIR) IN OUT
 *       IN/OUT are framed records: uint32 count, then count bytes (texts) or count int32 (ids), all
 *       little-endian; encode-docs prints one line per record with invalid UTF-8: "invalid K N FIRST".
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tokenizer.h"
#include "tokenizer_impl.h"
#include "dg_check.h"

static int skip_or_fail(const char *why) {
    const char *ci = getenv("CI");
    if (ci && !strcmp(ci, "true")) {
        fprintf(stderr, "FAIL (CI=true): %s\n", why);
        return 1;
    }
    fprintf(stderr, "SKIP: %s\n", why);
    return 77;
}

static dg_tokenizer_t *load_gpt2(const char *arg, int *rc) {
    char path[4096];
    if (dg_tokenizer_find_gpt2(strcmp(arg, "-") ? arg : NULL, path, sizeof path) != DG_OK) {
        *rc = skip_or_fail(dg_last_error());
        return NULL;
    }
    dg_tokenizer_t *t;
    if (dg_tokenizer_load_tiktoken(path, &t) != DG_OK) {
        fprintf(stderr, "FAIL: %s\n", dg_last_error());
        *rc = 1;
        return NULL;
    }
    if (!dg_tokenizer_can_encode()) {
        *rc = skip_or_fail("built without PCRE2: no encoder");
        dg_tokenizer_free(t);
        return NULL;
    }
    return t;
}

static size_t encode(const dg_tokenizer_t *t, const char *s, size_t n, int32_t *out, size_t cap) {
    dg_tok_ids_t ids = {0};
    dg_status_t st = dg_tokenizer_encode(t, s, n, &ids, NULL);
    DG_ASSERTF(st == DG_OK, "%s", dg_last_error());
    DG_ASSERT(ids.n <= cap);
    memcpy(out, ids.v, ids.n * sizeof *out);
    size_t k = ids.n;
    dg_tok_ids_free(&ids);
    return k;
}

static int roundtrips(const dg_tokenizer_t *t, const char *s, size_t n) {
    dg_tok_ids_t ids = {0};
    DG_ASSERTF(dg_tokenizer_encode(t, s, n, &ids, NULL) == DG_OK, "%s", dg_last_error());
    uint8_t *back;
    size_t bl;
    DG_ASSERTF(dg_tokenizer_decode(t, ids.v, ids.n, &back, &bl) == DG_OK, "%s", dg_last_error());
    int ok = bl == n && memcmp(back, s, n) == 0;
    free(back);
    dg_tok_ids_free(&ids);
    return ok;
}

/* ---------------- framed record helpers (for the Python test) ---------------- */

static uint8_t *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    DG_ASSERTF(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = dg_xmalloc((size_t)sz + 1);
    DG_ASSERT(fread(b, 1, (size_t)sz, f) == (size_t)sz);
    fclose(f);
    *n = (size_t)sz;
    return b;
}

static uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put_u32(FILE *f, uint32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    fwrite(b, 1, 4, f);
}

static int load_from_args(const char *kind, const char *src, dg_tokenizer_t **t) {
    dg_status_t s = !strcmp(kind, "--hf") ? dg_tokenizer_load_hf(src, t) : dg_tokenizer_load_tiktoken(src, t);
    if (s != DG_OK) fprintf(stderr, "%s\n", dg_last_error());
    return s;
}

/* One record of a documents command, at rec (the k-th, starting with its uint32 count), written to f in
 * the command's output form; returns the record's size in bytes, or 0 after an error (printed). */
typedef size_t (*doc_fn)(dg_tokenizer_t *t, const uint8_t *rec, size_t k, FILE *f, void *ctx);

/* A documents command: loads the tokenizer (kind, src; the error printed when it does not), reads the
 * records of `in` and runs one(t, record, k, out file, ctx) over them in order until one fails. Returns 0,
 * or 1 when the tokenizer does not load or a record failed. */
static int docs_run(const char *kind, const char *src, const char *in, const char *out, doc_fn one,
                    void *ctx) {
    dg_tokenizer_t *t;
    if (load_from_args(kind, src, &t)) return 1;
    size_t n;
    uint8_t *b = slurp(in, &n);
    FILE *f = fopen(out, "wb");
    DG_ASSERT(f);
    int rc = 0;
    for (size_t i = 0, k = 0; i + 4 <= n; k++) {
        size_t used = one(t, b + i, k, f, ctx);
        if (!used) {
            rc = 1;
            break;
        }
        i += used;
    }
    fclose(f);
    free(b);
    dg_tokenizer_free(t);
    return rc;
}

/* encode-docs: a record is a uint32 byte length and the text; out gets the id count and the ids, and
 * stdout "invalid K COUNT FIRST" for a text with invalid UTF-8. ctx: the dg_tok_ids_t reused. */
static size_t encode_doc(dg_tokenizer_t *t, const uint8_t *rec, size_t k, FILE *f, void *ctx) {
    dg_tok_ids_t *ids = ctx;
    uint32_t len = get_u32(rec);
    ids->n = 0;
    dg_tok_stats_t st;
    if (dg_tokenizer_encode(t, rec + 4, len, ids, &st) != DG_OK) {
        fprintf(stderr, "%s\n", dg_last_error());
        return 0;
    }
    if (st.invalid_utf8)
        printf("invalid %zu %lld %lld\n", k, (long long)st.invalid_utf8, (long long)st.first_invalid);
    put_u32(f, (uint32_t)ids->n);
    for (size_t j = 0; j < ids->n; j++)
        put_u32(f, (uint32_t)ids->v[j]);
    return 4 + (size_t)len;
}

static int cmd_encode_docs(const char *kind, const char *src, const char *in, const char *out) {
    dg_tok_ids_t ids = {0};
    int rc = docs_run(kind, src, in, out, encode_doc, &ids);
    dg_tok_ids_free(&ids);
    return rc;
}

/* decode-docs: a record is a uint32 id count and the ids (uint32 each); out gets the text's byte length
 * and the text. */
static size_t decode_doc(dg_tokenizer_t *t, const uint8_t *rec, size_t k, FILE *f, void *ctx) {
    (void)k, (void)ctx;
    uint32_t cnt = get_u32(rec);
    int32_t *ids = dg_xmalloc((cnt + 1) * sizeof *ids);
    for (uint32_t j = 0; j < cnt; j++)
        ids[j] = (int32_t)get_u32(rec + 4 + 4 * j);
    uint8_t *txt;
    size_t tl;
    dg_status_t s = dg_tokenizer_decode(t, ids, cnt, &txt, &tl);
    free(ids);
    if (s != DG_OK) {
        fprintf(stderr, "%s\n", dg_last_error());
        return 0;
    }
    put_u32(f, (uint32_t)tl);
    fwrite(txt, 1, tl, f);
    free(txt);
    return 4 + 4 * (size_t)cnt;
}

static int cmd_decode_docs(const char *kind, const char *src, const char *in, const char *out) {
    return docs_run(kind, src, in, out, decode_doc, NULL);
}

/* ---------------- utf8: the repair rule, byte for byte against Python's decode(errors="replace")
 * ---------------- */

static int test_utf8(void) {
    static const struct {
        const char *in, *out;
        int bad, first;
    } c[] = {
        {"abc", "abc", 0, -1},
        {"\xff", "\xef\xbf\xbd", 1, 0},
        {"a\xc3", "a\xef\xbf\xbd", 1, 1},
        {"\xe2\x82", "\xef\xbf\xbd", 1, 0}, /* truncated: one U+FFFD for the maximal subpart */
        {"\xe2\x82"
         "A",
         "\xef\xbf\xbd"
         "A",
         1, 0},
        {"\xc0\x80", "\xef\xbf\xbd\xef\xbf\xbd", 2, 0},                 /* overlong lead: never valid */
        {"\xed\xa0\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd", 3, 0}, /* surrogate */
        {"\xf4\x90\x80\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd", 4, 0}, /* > U+10FFFF */
        {"\xf0\x9f\x98x", "\xef\xbf\xbdx", 1, 0},
        {"\xf0\x80\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd", 3, 0},
        {"\xe0\x80\xaf", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd", 3, 0},
        {"\xf8\x88\x80\x80\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd", 5, 0},
        {"\xf0\x9f\x98\x80", "\xf0\x9f\x98\x80", 0, -1},
        {"\xef\xbf\xbd", "\xef\xbf\xbd", 0, -1}, /* a real U+FFFD is not a replacement */
        {"\x80\x80", "\xef\xbf\xbd\xef\xbf\xbd", 2, 0},
        {"\xf4\x8f\xbf\xbf\xc2", "\xf4\x8f\xbf\xbf\xef\xbf\xbd", 1, 4},
        {"\xc2\xa0\xe1\x80", "\xc2\xa0\xef\xbf\xbd", 1, 2},
        {"0123456789abcdef\xfe", "0123456789abcdef\xef\xbf\xbd", 1, 16}, /* after the 8-byte ASCII scan */
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        size_t n = strlen(c[i].in);
        uint8_t out[64];
        int64_t bad, first;
        size_t o = tok_utf8_repair((const uint8_t *)c[i].in, n, out, &bad, &first);
        CHECK(o == strlen(c[i].out) && memcmp(out, c[i].out, o) == 0, "case %zu: wrong repair", i);
        CHECK(bad == c[i].bad && first == c[i].first, "case %zu: %lld bad at %lld, want %d at %d", i,
              (long long)bad, (long long)first, c[i].bad, c[i].first);
        CHECK(tok_utf8_valid((const uint8_t *)c[i].in, n) == (c[i].bad == 0), "case %zu: validity", i);
    }
    return dg_fails ? 1 : 0;
}

/* ---------------- toy: both readers on a small hand-made vocabulary ---------------- */

/* GPT-2's byte -> unicode alphabet (the inverse of what tok_load.c decodes), written out as UTF-8. */
static size_t byte_to_utf8(uint8_t b, char *o) {
    uint32_t cp = b;
    int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    if (!printable) cp = 256 + (b <= 0x20 ? b : b <= 0xA0 ? 33 + (b - 0x7F) : 67);
    if (cp < 0x80) return o[0] = (char)cp, 1;
    o[0] = (char)(0xC0 | cp >> 6);
    o[1] = (char)(0x80 | (cp & 63));
    return 2;
}

/* DIR/NAME, created (truncated) for writing; asserts it opened */
static FILE *create_in(const char *dir, const char *name) {
    char path[512];
    dg_fmt(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    DG_ASSERT(f);
    return f;
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    DG_ASSERT(f);
    fputs(text, f);
    fclose(f);
}

static const char *b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
static void b64_encode(const uint8_t *p, size_t n, char *o) {
    size_t k = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t w =
            (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0) | (i + 2 < n ? p[i + 2] : 0);
        o[k++] = b64[w >> 18 & 63];
        o[k++] = b64[w >> 12 & 63];
        o[k++] = i + 1 < n ? b64[w >> 6 & 63] : '=';
        o[k++] = i + 2 < n ? b64[w & 63] : '=';
    }
    o[k] = 0;
}

/* Toy vocabulary: the 256 bytes (ids in reverse byte order, so id != byte), then 5 merges. */
static const char *toy_merges[][2] = {{"a", "b"}, {"ab", "c"}, {" ", "t"}, {" t", "h"}, {"c", "c"}};
#define TOY_N (256 + 5)

static void toy_files(const char *dir) {
    char line[256];
    FILE *f = create_in(dir, "toy.tiktoken");
    for (int b = 0; b < 256; b++) {
        uint8_t c = (uint8_t)b;
        b64_encode(&c, 1, line);
        fprintf(f, "%s %d\n", line, 255 - b);
    }
    for (int k = 0; k < 5; k++) {
        char tok[16];
        dg_fmt(tok, sizeof tok, "%s%s", toy_merges[k][0], toy_merges[k][1]);
        b64_encode((const uint8_t *)tok, strlen(tok), line);
        fprintf(f, "%s %d\n", line, 256 + k);
    }
    fclose(f);
    /* The same as vocab.json + merges.txt, tokens in the byte-to-unicode alphabet. */
    f = create_in(dir, "vocab.json");
    fputs("{", f);
    for (int b = 0; b < 256; b++) {
        char u[4];
        size_t l = byte_to_utf8((uint8_t)b, u);
        fprintf(f, "\"%s%.*s\": %d, ", b == '"' || b == '\\' ? "\\" : "", (int)l, u, 255 - b);
        if (b % 16 == 15) fputc('\n', f);
    }
    for (int k = 0; k < 5; k++) {
        char tok[32];
        size_t l = 0;
        for (int h = 0; h < 2; h++)
            for (const char *c = toy_merges[k][h]; *c; c++)
                l += byte_to_utf8((uint8_t)*c, tok + l);
        fprintf(f, "\"%.*s\": %d, ", (int)l, tok, 256 + k);
    }
    fprintf(f, "\"<|endoftext|>\": %d}\n", TOY_N);
    fclose(f);
    f = create_in(dir, "merges.txt");
    fputs("#version: 0.2\n", f);
    for (int k = 0; k < 5; k++) {
        for (int h = 0; h < 2; h++) {
            for (const char *c = toy_merges[k][h]; *c; c++) {
                char u[4];
                size_t l = byte_to_utf8((uint8_t)*c, u);
                fwrite(u, 1, l, f);
            }
            fputc(h ? '\n' : ' ', f);
        }
    }
    fclose(f);
}

static char tmpdir[64];

static int test_toy(void) {
    DG_ASSERT(dg_test_mkdtemp(tmpdir, sizeof tmpdir, "dg_test_tok") == 0);
    toy_files(tmpdir);
    char path[512];
    dg_tokenizer_t *a, *b;
    dg_fmt(path, sizeof path, "%s/toy.tiktoken", tmpdir);
    DG_ASSERTF(dg_tokenizer_load_tiktoken(path, &a) == DG_OK, "%s", dg_last_error());
    DG_ASSERTF(dg_tokenizer_load_hf(tmpdir, &b) == DG_OK, "%s", dg_last_error());
    CHECK(dg_tokenizer_vocab_size(a) == TOY_N + 1 && dg_tokenizer_vocab_size(b) == TOY_N + 1,
          "vocab sizes %d %d", dg_tokenizer_vocab_size(a), dg_tokenizer_vocab_size(b));
    CHECK(dg_tokenizer_eot(a) == TOY_N && dg_tokenizer_eot(b) == TOY_N, "eot");
    /* Each token's bytes agree between the readers. */
    for (int id = 0; id <= TOY_N; id++) {
        size_t la, lb;
        const uint8_t *pa = dg_tokenizer_token_bytes(a, id, &la), *pb = dg_tokenizer_token_bytes(b, id, &lb);
        CHECK(pa && pb && la == lb && memcmp(pa, pb, la) == 0, "token %d differs between the readers", id);
    }
    if (dg_tokenizer_can_encode()) {
        /* "abcc": ab (256) < cc (260) -> [ab][c][c]; abc (257) < cc -> [abc][c]; "abcc" is no token. */
        int32_t ids[64], idb[64];
        size_t n = encode(a, "abcc", 4, ids, 64);
        CHECK(n == 2 && ids[0] == 257 && ids[1] == 255 - 'c', "abcc -> %zu ids [%d %d]", n, ids[0], ids[1]);
        n = encode(a, " the", 4, ids, 64);
        CHECK(n == 2 && ids[0] == 259 && ids[1] == 255 - 'e', " the -> %zu ids [%d %d]", n, ids[0], ids[1]);
        const char *texts[] = {"abc abcc the cat", "ccc cab\tabab\n\n  thththe", "x", "   ", "'s 'S ab'll"};
        for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
            size_t na = encode(a, texts[i], strlen(texts[i]), ids, 64);
            size_t nb = encode(b, texts[i], strlen(texts[i]), idb, 64);
            CHECK(na == nb && memcmp(ids, idb, na * sizeof *ids) == 0, "readers disagree on '%s'", texts[i]);
            CHECK(roundtrips(a, texts[i], strlen(texts[i])), "round trip of '%s'", texts[i]);
        }
    }
    dg_tokenizer_free(a);
    dg_tokenizer_free(b);
    dg_test_rmtree(tmpdir);
    return dg_fails ? 1 : 0;
}

/* ---------------- errors: every reader defect is one line naming the file and line ---------------- */

static void expect_load_error(int hf, const char *file, const char *text, const char *want) {
    char path[512];
    dg_fmt(path, sizeof path, "%s/%s", tmpdir, file);
    if (text) write_text(path, text);
    dg_tokenizer_t *t = NULL;
    dg_status_t s = hf ? dg_tokenizer_load_hf(tmpdir, &t) : dg_tokenizer_load_tiktoken(path, &t);
    char w[1024];
    dg_fmt(w, sizeof w, want, tmpdir, tmpdir);
    CHECK(s == DG_ERR_USAGE && t == NULL && strcmp(dg_last_error(), w) == 0, "\n  got:  %s\n  want: %s",
          dg_last_error(), w);
    dg_tokenizer_free(t);
}

/* A reader defect: the file written (text NULL: none), the whole error line (%s: the temporary directory) */
typedef struct {
    const char *file, *text, *want;
} load_case_t;

/* tiktoken: a missing file, an empty one, and each line defect */
static const load_case_t tiktoken_bad[] = {
    {"none.tiktoken", NULL, "tokenizer: cannot read %s/none.tiktoken: No such file or directory"},
    {"e.tiktoken", "", "tokenizer %s/e.tiktoken: expected 1 to 16777216 lines 'BASE64 RANK', found 0"},
    {"e.tiktoken", "IQ== 0\nIg==1\n",
     "tokenizer %s/e.tiktoken:2: expected 'BASE64 RANK' (a token in base64, one space, a decimal rank)"},
    {"e.tiktoken", "IQ== 0\nI!== 1\n",
     "tokenizer %s/e.tiktoken:2: expected 'BASE64 RANK' (a token in base64, one space, a decimal rank)"},
    {"e.tiktoken", "IQ== 0\nIg== x\n",
     "tokenizer %s/e.tiktoken:2: expected 'BASE64 RANK' (a token in base64, one space, a decimal rank)"},
    {"e.tiktoken", "IQ== 0\nIg== 2\n",
     "tokenizer %s/e.tiktoken:2: rank 2 out of range (the file has 2 tokens: ranks 0..1)"},
    {"e.tiktoken", "IQ== 1\nIg== 1\n", "tokenizer %s/e.tiktoken:2: rank 1 already given at line 1"},
    {"e.tiktoken", "IQ== 0\nIQ== 1\n", "tokenizer %s/e.tiktoken: tokens 0 and 1 have the same bytes"},
    {"e.tiktoken", "IQ== 0\nIg== 1\n",
     "tokenizer %s/e.tiktoken: byte 0x00 is not a token (a byte-level BPE has all 256)"},
};

/* Hugging Face: the toy files with one thing broken at a time */
static const load_case_t hf_bad[] = {
    {"merges.txt", "#version: 0.2\na b\nab c\nĠ t\nĠt h\nc  c\n",
     "tokenizer %s/merges.txt:6: expected 'LEFT RIGHT' (two tokens, one space)"},
    {"merges.txt", "#version: 0.2\nb a\n",
     "tokenizer %s/merges.txt:2: merge 0 does not make the token with id 256 in %s/vocab.json "
     "(line 17): the rank-based merge needs ids in merge order, as GPT-2's files have them"},
    {"merges.txt", "a b\nab c\n x\n",
     "tokenizer %s/merges.txt:3: a merge token is not UTF-8 in GPT-2's byte-to-unicode alphabet"},
    {"merges.txt", "a b\nab c\nĠ t\nĠt h\n",
     "tokenizer %s/vocab.json: 262 tokens but 256 bytes + 4 merges = 260; the only other token may "
     "be <|endoftext|>, with id 260"},
    {"vocab.json", "{\"a\": 0, \"a\": 0}", "tokenizer %s/vocab.json:1: id 0 given twice (first at line 1)"},
    {"vocab.json", "{\"a\": 0, \"b\": 2, \"c\": 3}",
     "tokenizer %s/vocab.json: no token has id 1 (ids must be 0..2, each once)"},
    {"vocab.json", "{\"a b\": 0}",
     "tokenizer %s/vocab.json:1: character U+0020 is not in GPT-2's byte-to-unicode alphabet"},
    {"vocab.json", "{\"a\": 0,\n \"b\" 1}", "tokenizer %s/vocab.json:2: expected ':' after a token"},
    {"vocab.json", "[1]", "tokenizer %s/vocab.json:1: expected a JSON object {\"token\": id, ...}"},
    {"vocab.json", "{\"\\ud800\": 0}", "tokenizer %s/vocab.json:1: unpaired surrogate in a \\u escape"},
};

static int test_errors(void) {
    DG_ASSERT(dg_test_mkdtemp(tmpdir, sizeof tmpdir, "dg_test_tok") == 0);
    for (size_t i = 0; i < sizeof tiktoken_bad / sizeof tiktoken_bad[0]; i++)
        expect_load_error(0, tiktoken_bad[i].file, tiktoken_bad[i].text, tiktoken_bad[i].want);
    /* Hugging Face: start from the toy files, break one thing at a time. */
    toy_files(tmpdir);
    char path[512];
    dg_fmt(path, sizeof path, "%s/merges.txt", tmpdir);
    for (size_t i = 0; i < sizeof hf_bad / sizeof hf_bad[0]; i++)
        expect_load_error(1, hf_bad[i].file, hf_bad[i].text, hf_bad[i].want);
    dg_test_rmtree(tmpdir);
    return dg_fails ? 1 : 0;
}

/* ---------------- GPT-2: known ids, the special token, round trips ---------------- */

static int test_special(dg_tokenizer_t *t) {
    CHECK(dg_tokenizer_vocab_size(t) == DG_TOKENIZER_GPT2_VOCAB, "vocab %d", dg_tokenizer_vocab_size(t));
    CHECK(dg_tokenizer_eot(t) == DG_TOKENIZER_GPT2_EOT, "eot %d", dg_tokenizer_eot(t));
    size_t l;
    const uint8_t *p = dg_tokenizer_token_bytes(t, 50256, &l);
    CHECK(p && l == 13 && !memcmp(p, "<|endoftext|>", 13), "bytes of 50256");
    CHECK(dg_tokenizer_token_bytes(t, 50257, &l) == NULL && dg_tokenizer_token_bytes(t, -1, &l) == NULL,
          "range");
    int32_t bad[] = {15496, 50257};
    uint8_t *out;
    size_t ol;
    CHECK(dg_tokenizer_decode(t, bad, 2, &out, &ol) == DG_ERR_USAGE &&
              !strcmp(dg_last_error(), "tokenizer: token id 50257 at position 1 is not in [0, 50257)"),
          "decode error: %s", dg_last_error());
    int32_t e[] = {50256, 15496, 995};
    CHECK(dg_tokenizer_decode(t, e, 3, &out, &ol) == DG_OK && ol == 24 &&
              !memcmp(out, "<|endoftext|>Hello world", 24),
          "decode with the special token");
    free(out);
    /* Known GPT-2 ids (tiktoken's encode_ordinary): the special token's text is ordinary text. */
    static const struct {
        const char *text;
        int n;
        int32_t ids[24];
    } k[] = {
        {"Hello world", 2, {15496, 995}},
        {"<|endoftext|>", 7, {27, 91, 437, 1659, 5239, 91, 29}},
        {"He's HE'S 1234567 \xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c "
         "\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x92\xbb",
         24,
         {1544, 338,   11179, 6,     50,  17031, 2231, 3134, 220, 19526, 254, 25001,
          121,  10310, 244,   45911, 234, 50169, 102,  447,  235, 8582,  240, 119}},
        /* U+180E is not White_Space (PCRE2's own \s would take it); U+0085 is */
        {" \xe1\xa0\x8e\xe1\xa0\x8ex", 7, {28053, 254, 236, 157, 254, 236, 87}},
        {"\xc2\x85\xc2\x85x", 5, {126, 227, 126, 227, 87}},
        {"a   \xe1\xa0\x8e", 6, {64, 220, 220, 28053, 254, 236}},
        {"a\t\xe1\xa0\x8e\xe1\xa0\x8e", 8, {64, 197, 157, 254, 236, 157, 254, 236}},
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        int32_t ids[64];
        size_t n = encode(t, k[i].text, strlen(k[i].text), ids, 64);
        CHECK(n == (size_t)k[i].n && !memcmp(ids, k[i].ids, n * sizeof *ids), "ids of case %zu (%zu ids)", i,
              n);
    }
    /* Invalid UTF-8: the ids of the repaired text, and the count. */
    dg_tok_ids_t a = {0}, b = {0};
    dg_tok_stats_t st;
    const char *raw = "caf\xc3 \xff\xfe ok \xe2\x82";
    CHECK(dg_tokenizer_encode(t, raw, strlen(raw), &a, &st) == DG_OK, "encode");
    CHECK(st.invalid_utf8 == 4 && st.first_invalid == 3, "stats %lld at %lld", (long long)st.invalid_utf8,
          (long long)st.first_invalid);
    const char *fixed = "caf\xef\xbf\xbd \xef\xbf\xbd\xef\xbf\xbd ok \xef\xbf\xbd";
    CHECK(dg_tokenizer_encode(t, fixed, strlen(fixed), &b, &st) == DG_OK && st.invalid_utf8 == 0, "encode");
    CHECK(a.n == b.n && !memcmp(a.v, b.v, a.n * sizeof *a.v), "invalid input != its repair");
    dg_tok_ids_free(&a);
    dg_tok_ids_free(&b);
    return dg_fails ? 1 : 0;
}

/* Deterministic pseudo-random text: a mix of scripts, numbers, whitespace runs and punctuation. */
static uint64_t rng = 0x9e3779b97f4a7c15ULL;
static uint32_t rnd(uint32_t n) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng % n);
}

static size_t gen_text(char *o, size_t cap) {
    static const char *parts[] = {"the",
                                  " quick",
                                  " brown",
                                  "Fox",
                                  "'s",
                                  "'S",
                                  "'ll",
                                  " don't",
                                  "123",
                                  "4567890",
                                  " 42",
                                  "\n",
                                  "\n\n",
                                  "\r\n",
                                  "\t",
                                  "  ",
                                  "    ",
                                  " ",
                                  ".",
                                  ",",
                                  "!?",
                                  "{}",
                                  "();",
                                  "\xe4\xbd\xa0\xe5\xa5\xbd",
                                  " \xd8\xa7\xd9\x84\xd8\xb9\xd8\xb1\xd8\xa8\xd9\x8a\xd8\xa9",
                                  "\xd7\xa9\xd7\x9c\xd7\x95\xd7\x9d",
                                  "\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd",
                                  "\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x92\xbb",
                                  "e\xcc\x81",
                                  "\xc2\xa0",
                                  "\xe3\x80\x80",
                                  "Ωmega",
                                  "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
                                  "x=1;",
                                  "    return"};
    size_t n = 0, np = sizeof parts / sizeof parts[0];
    while (n + 64 < cap) {
        const char *s = parts[rnd((uint32_t)np)];
        size_t l = strlen(s);
        memcpy(o + n, s, l);
        n += l;
        if (rnd(40) == 0) break;
    }
    return n;
}

static int test_roundtrip(dg_tokenizer_t *t) {
    char buf[8192];
    for (int i = 0; i < 2000; i++) {
        size_t n = gen_text(buf, sizeof buf);
        CHECK(roundtrips(t, buf, n), "round trip %d", i);
    }
    /* Every code point class once: all of U+0000..U+FFFF (no surrogates) in one text, in pieces. */
    char *all = dg_xmalloc(4 * 0x10000);
    size_t n = 0;
    for (uint32_t cp = 1; cp < 0x10000; cp++) {
        if (cp >= 0xD800 && cp < 0xE000) continue;
        if (cp < 0x80)
            all[n++] = (char)cp;
        else if (cp < 0x800)
            all[n++] = (char)(0xC0 | cp >> 6), all[n++] = (char)(0x80 | (cp & 63));
        else
            all[n++] = (char)(0xE0 | cp >> 12), all[n++] = (char)(0x80 | (cp >> 6 & 63)),
            all[n++] = (char)(0x80 | (cp & 63));
    }
    CHECK(roundtrips(t, all, n), "round trip of the BMP");
    CHECK(roundtrips(t, "", 0), "empty");
    free(all);
    return dg_fails ? 1 : 0;
}

/* ---------------- bpe: the two merge loops agree ---------------- */

static int test_bpe(dg_tokenizer_t *t) {
    int32_t a[TOK_LINEAR_MAX], b[TOK_LINEAR_MAX];
    char buf[TOK_LINEAR_MAX + 1];
    static const char alpha[] = "aeiouthnrsl  ..,!xyzq\xc3\xa9";
    for (int i = 0; i < 20000; i++) {
        size_t n = 1 + rnd(TOK_LINEAR_MAX);
        for (size_t j = 0; j < n; j++)
            buf[j] = i % 3 == 0 ? (char)(1 + rnd(255)) : alpha[rnd(sizeof alpha - 1)];
        size_t na = tok_bpe_linear(t, (const uint8_t *)buf, n, a),
               nb = tok_bpe_heap(t, (const uint8_t *)buf, n, b);
        CHECK(na == nb && !memcmp(a, b, na * sizeof *a), "merge loops disagree on a %zu-byte piece", n);
        if (dg_fails) break;
    }
    /* Repetitions, where equal ranks compete: the leftmost must win in both. */
    for (size_t n = 1; n <= TOK_LINEAR_MAX; n++) {
        memset(buf, 'a' + (int)(n % 3), n);
        size_t na = tok_bpe_linear(t, (const uint8_t *)buf, n, a),
               nb = tok_bpe_heap(t, (const uint8_t *)buf, n, b);
        CHECK(na == nb && !memcmp(a, b, na * sizeof *a), "merge loops disagree on %zu repeated bytes", n);
    }
    return dg_fails ? 1 : 0;
}

/* ---------------- split: cutting at dg_tokenizer_next_split never changes the ids ---------------- */

static int test_split(dg_tokenizer_t *t) {
    char buf[8192];
    dg_tok_ids_t whole = {0}, parts = {0};
    int cuts = 0;
    for (int i = 0; i < 3000; i++) {
        size_t n = gen_text(buf, sizeof buf);
        whole.n = parts.n = 0;
        DG_ASSERT(dg_tokenizer_encode(t, buf, n, &whole, NULL) == DG_OK);
        size_t at = 0;
        for (size_t from = 2 + rnd(16);;) {
            size_t sp = dg_tokenizer_next_split(buf, n, from);
            if (sp == n) break;
            CHECK(sp >= from && buf[sp - 1] == '\n', "split %zu from %zu", sp, from);
            DG_ASSERT(dg_tokenizer_encode(t, buf + at, sp - at, &parts, NULL) == DG_OK);
            at = sp;
            from = sp + 1 + rnd(8);
            cuts++;
        }
        DG_ASSERT(dg_tokenizer_encode(t, buf + at, n - at, &parts, NULL) == DG_OK);
        CHECK(whole.n == parts.n && !memcmp(whole.v, parts.v, whole.n * sizeof *whole.v),
              "text %d: cutting at the safe points changed the ids", i);
        if (dg_fails) break;
    }
    CHECK(cuts > 1000, "only %d cuts made: the generator gives too few safe points", cuts);
    /* The rule itself. */
    CHECK(dg_tokenizer_next_split("ab\ncd", 5, 0) == 3, "a\\nb");
    CHECK(dg_tokenizer_next_split("ab\n cd", 6, 0) == 3, "a\\n b");
    CHECK(dg_tokenizer_next_split("ab\n  cd", 7, 0) == 7, "a\\n  b (the run after the newline would change)");
    CHECK(dg_tokenizer_next_split("ab \ncd", 6, 0) == 6, "a \\nb");
    CHECK(dg_tokenizer_next_split("ab\n\ncd", 6, 0) == 6, "a\\n\\nb");
    CHECK(dg_tokenizer_next_split("ab\n", 3, 0) == 3, "nothing after");
    CHECK(dg_tokenizer_next_split("ab\n ", 4, 0) == 4, "a space, then the end");
    dg_tok_ids_free(&whole);
    dg_tok_ids_free(&parts);
    return dg_fails ? 1 : 0;
}

/* ---------------- threads: one shared tokenizer, many encoders at once ---------------- */

#define THR_DOCS 300
typedef struct thr_arg {
    dg_tokenizer_t *t;
    char **docs;
    size_t *lens;
    dg_tok_ids_t *want;
    int bad;
} thr_arg_t;

static void *thr_main(void *p) {
    thr_arg_t *a = p;
    dg_tok_ids_t ids = {0};
    for (int rep = 0; rep < 3; rep++)
        for (int d = 0; d < THR_DOCS; d++) {
            ids.n = 0;
            if (dg_tokenizer_encode(a->t, a->docs[d], a->lens[d], &ids, NULL) != DG_OK ||
                ids.n != a->want[d].n || memcmp(ids.v, a->want[d].v, ids.n * sizeof *ids.v))
                a->bad++;
        }
    dg_tok_ids_free(&ids);
    return NULL;
}

static int test_threads(dg_tokenizer_t *t) {
    char *docs[THR_DOCS];
    size_t lens[THR_DOCS];
    dg_tok_ids_t want[THR_DOCS];
    for (int d = 0; d < THR_DOCS; d++) {
        docs[d] = dg_xmalloc(8192);
        lens[d] = gen_text(docs[d], 8192);
        if (d % 7 == 0) docs[d][lens[d] / 2] = (char)0xff; /* some invalid UTF-8 too */
        want[d] = (dg_tok_ids_t){0};
        DG_ASSERT(dg_tokenizer_encode(t, docs[d], lens[d], &want[d], NULL) == DG_OK);
    }
    pthread_t th[6];
    thr_arg_t args[6];
    for (int i = 0; i < 6; i++) {
        args[i] = (thr_arg_t){t, docs, lens, want, 0};
        DG_ASSERT(pthread_create(&th[i], NULL, thr_main, &args[i]) == 0);
    }
    for (int i = 0; i < 6; i++) {
        pthread_join(th[i], NULL);
        CHECK(args[i].bad == 0, "thread %d: %d documents encoded differently", i, args[i].bad);
    }
    for (int d = 0; d < THR_DOCS; d++) {
        free(docs[d]);
        dg_tok_ids_free(&want[d]);
    }
    return dg_fails ? 1 : 0;
}

/* The cases argv[1] names: those that need no tokenizer, then those on the GPT-2 one (argv[2], "-": found) */
static const struct {
    const char *name;
    int (*fn)(void);
} k_plain[] = {{"utf8", test_utf8}, {"toy", test_toy}, {"errors", test_errors}};
static const struct {
    const char *name;
    int (*fn)(dg_tokenizer_t *);
} k_gpt2[] = {{"special", test_special},
              {"roundtrip", test_roundtrip},
              {"bpe", test_bpe},
              {"split", test_split},
              {"threads", test_threads}};
#define N_PLAIN (sizeof k_plain / sizeof k_plain[0])
#define N_GPT2 (sizeof k_gpt2 / sizeof k_gpt2[0])

int main(int argc, char **argv) {
    if (argc >= 6 && !strcmp(argv[1], "encode-docs"))
        return cmd_encode_docs(argv[2], argv[3], argv[4], argv[5]);
    if (argc >= 6 && !strcmp(argv[1], "decode-docs"))
        return cmd_decode_docs(argv[2], argv[3], argv[4], argv[5]);
    if (argc < 2) {
        fprintf(stderr, "usage: see the header of test_tokenizer.c\n");
        return 2;
    }
    const char *c = argv[1];
    int rc = 0;
    dg_tokenizer_t *t = NULL;
    size_t i = 0, j = 0;
    while (i < N_PLAIN && strcmp(c, k_plain[i].name))
        i++;
    while (j < N_GPT2 && strcmp(c, k_gpt2[j].name))
        j++;
    if (i < N_PLAIN)
        rc = k_plain[i].fn();
    else if (!(t = load_gpt2(argc > 2 ? argv[2] : "-", &rc)))
        return rc;
    else if (j < N_GPT2)
        rc = k_gpt2[j].fn(t);
    else {
        fprintf(stderr, "unknown test '%s'\n", c);
        rc = 2;
    }
    dg_tokenizer_free(t);
    if (rc == 0) printf("ok\n");
    return rc;
}
