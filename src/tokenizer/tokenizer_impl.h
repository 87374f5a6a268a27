/* tokenizer_impl.h — what the tokenizer's files share, and the internals its unit test checks
 * directly (the two merge loops, the UTF-8 repair). Not part of the public interface. */
#ifndef DG_TOKENIZER_IMPL_H
#define DG_TOKENIZER_IMPL_H

#include "tokenizer.h"

#include <pthread.h>

#define TOK_NO_RANK UINT32_MAX
/* Pieces longer than this take the heap-based merge (O(n log n)) instead of the quadratic scan. */
#define TOK_LINEAR_MAX 128

struct tok_state;

struct dg_tokenizer {
    char *source;
    int n_ranks;    /* ordinary tokens 0..n_ranks-1; n_ranks is <|endoftext|> */
    uint8_t *blob;  /* bytes of every token, rank order, then "<|endoftext|>" */
    uint32_t *off;  /* token r is blob[off[r] .. off[r+1]); n_ranks + 2 entries */
    uint32_t *slot; /* open-addressing hash of token bytes -> rank + 1 (0 = empty) */
    size_t mask;
    uint32_t byte_rank[256];
    uint32_t *pair_rank; /* [a * 256 + b]: rank of the two-byte token ab, or TOK_NO_RANK */
    void *re;            /* pcre2_code_8 * (void: this header does not need pcre2.h) */
    int jit;
    pthread_mutex_t mu;
    struct tok_state *pool; /* idle per-call scratch states */
};

/* Build a tokenizer from n tokens: bytes of token r at bytes[start[r] .. start[r+1]) (start has n+1
 * entries). Takes ownership of bytes and start (malloc'ed; start is resized). `what` names the source
 * in errors. Checks: every single byte is a token, no token twice, none empty. */
dg_status_t tok_build(const char *source, uint8_t *bytes, uint32_t *start, int n, dg_tokenizer_t **out);

/* Rank of the token with these bytes, or TOK_NO_RANK. */
uint32_t tok_rank(const dg_tokenizer_t *t, const uint8_t *p, size_t n);

/* Byte-pair merge of one piece (n >= 1 bytes), appending the ranks of the parts to out (room for n).
 * Returns the number of parts. Same result, two algorithms; tok_bpe picks by length. */
size_t tok_bpe_linear(const dg_tokenizer_t *t, const uint8_t *p, size_t n, int32_t *out);
size_t tok_bpe_heap(const dg_tokenizer_t *t, const uint8_t *p, size_t n, int32_t *out);

/* Python's bytes.decode("utf-8", errors="replace") as bytes: out (room for 3 * n) receives the input
 * with each maximal invalid subsequence replaced by EF BF BD. Returns the output length; *n_bad is the
 * number of replacements and *first_bad the input offset of the first (-1 if none). */
size_t tok_utf8_repair(const uint8_t *in, size_t n, uint8_t *out, int64_t *n_bad, int64_t *first_bad);
/* 1 when the n bytes are valid UTF-8 (the repair would change nothing). */
int tok_utf8_valid(const uint8_t *in, size_t n);

#endif /* DG_TOKENIZER_IMPL_H */
