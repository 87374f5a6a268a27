/* tokenizer.h — GPT-2's byte-level BPE tokenizer: load the ranks, encode text to token ids, decode ids
 * to bytes. Used by `dgprep --tokenizer gpt2` and by anything else that needs GPT-2 ids.
 *
 * Encoding is the one OpenAI's tiktoken ("gpt2" / "r50k_base") and GPT-2's encoder.py define:
 *   1. invalid UTF-8 is replaced first: each maximal invalid subsequence becomes U+FFFD (EF BF BD),
 *      exactly as Python's bytes.decode("utf-8", errors="replace") does (counted in dg_tok_stats_t);
 *   2. pre-tokenization by the GPT-2 pattern
 *        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 *      (PCRE2 in UTF + UCP mode; \s spelled out as Unicode White_Space, the set tiktoken's regex
 *      engine uses — PCRE2's own \s also takes U+180E);
 *   3. each piece becomes one token if its bytes are a token, else the rank-based byte-pair merge:
 *      start from single bytes, repeatedly join the adjacent pair whose joined bytes have the lowest
 *      rank (the leftmost of equal ones) until no joined pair is a token.
 * Text that looks like a special token ("<|endoftext|>") is encoded as ordinary text, as tiktoken's
 * encode_ordinary does; callers insert dg_tokenizer_eot() themselves.
 *
 * Ranks come from a .tiktoken file (base64 of each token's bytes and its rank, one per line: GPT-2's
 * is shipped as whisper/assets/gpt2.tiktoken, which scripts/setup.sh installs) or from a Hugging Face
 * GPT-2 tokenizer's vocab.json + merges.txt. Token id = rank; the special <|endoftext|> is the id after
 * the last rank (50256 for GPT-2, vocabulary 50257).
 *
 * Without PCRE2 at build time (dg_tokenizer_can_encode() == 0) loading and decoding work and encoding
 * returns DG_ERR_USAGE saying so. A loaded tokenizer is read-only: encode and decode may be called from
 * any number of threads at once on one shared tokenizer.
 */
#ifndef DG_TOKENIZER_H
#define DG_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "dg_common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DG_TOKENIZER_GPT2_EOT 50256   /* <|endoftext|> */
#define DG_TOKENIZER_GPT2_VOCAB 50257 /* 50256 ranks + <|endoftext|> */
#define DG_TOKENIZER_GPT2_FILE "gpt2.tiktoken"
#define DG_TOKENIZER_ENV "DG_GPT2_TIKTOKEN" /* overrides the installed ranks file */
#define DG_TOKENIZER_SHARE_DIR "/usr/local/share/dgtrain"

typedef struct dg_tokenizer dg_tokenizer_t;

/* 1 when built with PCRE2 (encoding available), 0 otherwise. */
int dg_tokenizer_can_encode(void);

/* Load a .tiktoken ranks file: lines "BASE64 RANK"; ranks must be 0..n-1, each once, with every single
 * byte among the tokens. DG_ERR_USAGE naming the file and line on any defect. */
dg_status_t dg_tokenizer_load_tiktoken(const char *path, dg_tokenizer_t **out);

/* Load DIR/vocab.json + DIR/merges.txt (a Hugging Face GPT-2 tokenizer; GPT-2's encoder.json +
 * vocab.bpe renamed are the same files). Tokens are strings in GPT-2's byte-to-unicode alphabet. The
 * rank-based merge needs ids in merge order, so this checks what GPT-2's files satisfy: the 256 single
 * bytes have ids 0..255, merge line k (from 0) makes the token with id 256+k, and any id beyond the
 * merges is <|endoftext|>. DG_ERR_USAGE naming the file (and line) otherwise. */
dg_status_t dg_tokenizer_load_hf(const char *dir, dg_tokenizer_t **out);

/* Find GPT-2's ranks file (the first that exists): `explicit_path` if not NULL (must exist),
 * $DG_GPT2_TIKTOKEN, <dir of the running executable>/../share/dgtrain/gpt2.tiktoken,
 * /usr/local/share/dgtrain/gpt2.tiktoken, /usr/share/dgtrain/gpt2.tiktoken. On success copies the
 * path to out (cap bytes). DG_ERR_USAGE listing what was tried when none exists. */
dg_status_t dg_tokenizer_find_gpt2(const char *explicit_path, char *out, size_t cap);

void dg_tokenizer_free(dg_tokenizer_t *tok);

int dg_tokenizer_vocab_size(const dg_tokenizer_t *tok);     /* ranks + 1 (the special token) */
int dg_tokenizer_eot(const dg_tokenizer_t *tok);            /* id of <|endoftext|> */
const char *dg_tokenizer_source(const dg_tokenizer_t *tok); /* the file or directory it came from */

/* Growable id array: start zeroed; dg_tokenizer_encode appends. */
typedef struct dg_tok_ids {
    int32_t *v;
    size_t n, cap;
} dg_tok_ids_t;
void dg_tok_ids_free(dg_tok_ids_t *ids);

typedef struct dg_tok_stats {
    int64_t invalid_utf8;  /* maximal invalid UTF-8 subsequences replaced by U+FFFD */
    int64_t first_invalid; /* byte offset of the first in the input, -1 if none */
} dg_tok_stats_t;

/* Encode n bytes of text (any bytes; see the rules above), appending the ids to *ids. `stats` may be
 * NULL; otherwise it is overwritten. Thread-safe. DG_ERR_USAGE without PCRE2, DG_ERR_RUNTIME if the
 * regex engine fails (e.g. its JIT stack limit). */
dg_status_t dg_tokenizer_encode(const dg_tokenizer_t *tok, const void *text, size_t n, dg_tok_ids_t *ids,
                                dg_tok_stats_t *stats);

/* The bytes of token `id` (the special token's are "<|endoftext|>"), or NULL when id is out of range. */
const uint8_t *dg_tokenizer_token_bytes(const dg_tokenizer_t *tok, int32_t id, size_t *len);

/* Concatenate the bytes of n ids into a malloc'ed buffer (*out, *out_len; free() it; NUL-terminated
 * for convenience, the NUL not counted). decode(encode(x)) == x for valid UTF-8 x. DG_ERR_USAGE naming
 * the position when an id is out of range. */
dg_status_t dg_tokenizer_decode(const dg_tokenizer_t *tok, const int32_t *ids, size_t n, uint8_t **out,
                                size_t *out_len);

/* Where text may be cut so that encoding the two parts separately gives exactly the ids of the whole
 * (for splitting one big document over threads): the smallest p with from <= p < n that is safe, or n
 * if there is none. Safe: text[p-1] is '\n', text[p-2] a printable ASCII non-space, and text[p] a
 * printable ASCII non-space or a space followed by one; then a pre-token ends at p whatever follows and
 * none before p depends on what follows. Needs from >= 2 to find anything. */
size_t dg_tokenizer_next_split(const void *text, size_t n, size_t from);

/* A 64-bit fingerprint of the ranks (every token's bytes in rank order): equal for two loads of the same
 * tokenizer, whether from a .tiktoken file or from vocab.json + merges.txt. dgprep records it in each
 * shard's header (data.h), so a checkpoint knows the tokenizer its run was trained on. */
uint64_t dg_tokenizer_fingerprint(const dg_tokenizer_t *tok);

/* Write DIR/vocab.json, DIR/merges.txt and DIR/tokenizer_config.json, the Hugging Face GPT-2 form of the
 * ranks (GPT2Tokenizer(Fast) loads them and encodes as this tokenizer does; dg_tokenizer_load_hf reads
 * them back to the same fingerprint). merges.txt is derived from the ranks (tok_write.c).
 * DG_ERR_USAGE when the ranks are not a merge sequence (ranks 0..255 single bytes, each later token one
 * merge of two earlier ones), DG_ERR_RUNTIME when a file cannot be written. */
dg_status_t dg_tokenizer_write_hf(const dg_tokenizer_t *tok, const char *dir, int model_max_length);

#ifdef __cplusplus
}
#endif
#endif /* DG_TOKENIZER_H */
