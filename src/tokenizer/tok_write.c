/* tok_write.c — a loaded byte-level BPE tokenizer written back as a Hugging Face GPT-2 tokenizer
 * (vocab.json, merges.txt, tokenizer_config.json) and its fingerprint (tokenizer.h).
 *
 * The merges are not stored in a ranks file; they follow from the ranks. The token of rank r >= 256 is
 * made by exactly one merge: run the byte-pair merge on its own bytes with only the ranks below r
 * allowed (the lowest-ranked adjacent pair first, as encoding does); what is left are two parts, and
 * "a b" (both in the byte-to-unicode alphabet) is merge line r - 256. Anything else (a rank below 256
 * that is not one byte, a token that does not come out in two parts) means the ranks are not a merge
 * sequence, and no files are written. */
#include "tokenizer_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "dg_json.h"

uint64_t dg_tokenizer_fingerprint(const dg_tokenizer_t *t) {
    XXH64_state_t st;
    XXH64_reset(&st, 0);
    const int64_t n = t->n_ranks;
    XXH64_update(&st, &n, sizeof n);
    for (int r = 0; r < t->n_ranks; r++) { /* length then bytes: the rank list, unambiguously */
        uint32_t len = t->off[r + 1] - t->off[r];
        XXH64_update(&st, &len, sizeof len);
        XXH64_update(&st, t->blob + t->off[r], len);
    }
    return XXH64_digest(&st);
}

/* GPT-2's byte-to-unicode alphabet, the inverse of tok_load.c's unicode_to_byte: the code point byte b
 * is written as, UTF-8 encoded into out (room for 2). Returns the length. */
static size_t byte_to_utf8(uint8_t b, char *out) {
    uint32_t cp = b;
    if (!((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE))
        cp = 256 + (b <= 0x20 ? b : b <= 0xA0 ? 33u + (b - 0x7Fu) : 67u); /* 0x00..0x20, 0x7F..0xA0, 0xAD */
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    out[0] = (char)(0xC0 | cp >> 6);
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

typedef struct {
    char *p;
    size_t n, cap;
} buf_t;

static void put(buf_t *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = (b->n + n + 1) * 2;
        b->p = realloc(b->p, b->cap);
        DG_ASSERTF(b->p, "out of memory");
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void put_alphabet(buf_t *b, const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        char u[2];
        put(b, u, byte_to_utf8(p[i], u));
    }
}

/* The merge that makes token r: *split is where its bytes divide into the two parts. */
static dg_status_t merge_of(const dg_tokenizer_t *t, int r, size_t *split) {
    const uint8_t *p = t->blob + t->off[r];
    size_t n = t->off[r + 1] - t->off[r];
    size_t *start = dg_xmalloc((n + 1) * sizeof *start), k = n; /* parts: [start[i], start[i+1]) */
    for (size_t i = 0; i <= n; i++)
        start[i] = i;
    for (;;) {
        uint32_t best = TOK_NO_RANK;
        size_t at = 0;
        for (size_t i = 0; i + 1 < k; i++) {
            uint32_t rk = tok_rank(t, p + start[i], start[i + 2] - start[i]);
            if (rk < (uint32_t)r && (best == TOK_NO_RANK || rk < best)) best = rk, at = i;
        }
        if (best == TOK_NO_RANK) break;
        memmove(start + at + 1, start + at + 2, (k - at - 1) * sizeof *start);
        k--;
    }
    *split = k == 2 ? start[1] : 0;
    free(start);
    if (k != 2)
        return DG_ERR(
            DG_ERR_USAGE,
            "tokenizer %s: token %d is not one merge of two lower-ranked tokens (%zu parts), so the "
            "ranks cannot be written as merges.txt",
            t->source, r, k);
    return DG_OK;
}

static dg_status_t write_buf(const char *dir, const char *name, const buf_t *b) {
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return dg_write_file_atomic(path, b->p ? b->p : "", b->n);
}

dg_status_t dg_tokenizer_write_hf(const dg_tokenizer_t *t, const char *dir, int model_max_length) {
    for (int r = 0; r < t->n_ranks && r < 256; r++)
        if (t->off[r + 1] - t->off[r] != 1)
            return DG_ERR(DG_ERR_USAGE,
                          "tokenizer %s: rank %d is not a single byte, so it has no GPT-2 merges.txt form",
                          t->source, r);
    buf_t vocab = {0}, merges = {0}, cfg = {0}, tok = {0};
    dg_status_t s = DG_OK;
    put(&vocab, "{", 1);
    put(&merges, "#version: 0.2\n", 14);
    for (int r = 0; r <= t->n_ranks && !s; r++) {
        const uint8_t *p = t->blob + t->off[r];
        size_t n = t->off[r + 1] - t->off[r];
        tok.n = 0;
        if (r == t->n_ranks)
            put(&tok, "<|endoftext|>", 13);
        else
            put_alphabet(&tok, p, n);
        char *q = dg_json_quote_dup(tok.p), num[32];
        put(&vocab, q, strlen(q));
        free(q);
        int l = snprintf(num, sizeof num, ": %d%s", r, r == t->n_ranks ? "}" : ", ");
        put(&vocab, num, (size_t)l);
        if (r < 256 || r == t->n_ranks) continue;
        size_t split = 0;
        s = merge_of(t, r, &split);
        if (s) break;
        put_alphabet(&merges, p, split);
        put(&merges, " ", 1);
        put_alphabet(&merges, p + split, n - split);
        put(&merges, "\n", 1);
    }
    char text[512];
    int l =
        snprintf(text, sizeof text,
                 "{\"tokenizer_class\": \"GPT2Tokenizer\", \"model_max_length\": %d, \"add_prefix_space\": "
                 "false, \"bos_token\": \"<|endoftext|>\", \"eos_token\": \"<|endoftext|>\", "
                 "\"unk_token\": \"<|endoftext|>\", \"errors\": \"replace\"}\n",
                 model_max_length);
    put(&cfg, text, (size_t)l);
    if (!s) s = write_buf(dir, "vocab.json", &vocab);
    if (!s) s = write_buf(dir, "merges.txt", &merges);
    if (!s) s = write_buf(dir, "tokenizer_config.json", &cfg);
    free(vocab.p);
    free(merges.p);
    free(cfg.p);
    free(tok.p);
    return s;
}
