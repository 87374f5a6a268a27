/* tokenizer.c — GPT-2 byte-level BPE: the rank table, UTF-8 repair, pre-tokenization (PCRE2), the
 * byte-pair merge, decoding, and the search for the installed ranks file. The file readers are in
 * tok_load.c. Rules in tokenizer.h and docs/data.md.
 *
 * Speed: most pieces are whole tokens (" the", "ing"), found by one hash probe; the merge runs only
 * for the rest, over two-byte pairs from a direct table and longer ones from the hash. Per-call
 * scratch (PCRE2 match data, the repaired-text buffer) lives in states kept in a small pool, so
 * concurrent callers of one tokenizer never share mutable memory and single callers never allocate. */
#define _GNU_SOURCE
#include "tokenizer_impl.h"
#include "dg_env.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#ifdef DG_HAVE_PCRE2
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#endif

static const char EOT_TEXT[] = "<|endoftext|>";

/* ---------------- rank table ---------------- */

static uint64_t tok_hash(const uint8_t *p, size_t n) {
    return XXH3_64bits(p, n);
}

uint32_t tok_rank(const dg_tokenizer_t *t, const uint8_t *p, size_t n) {
    if (n == 1) return t->byte_rank[p[0]];
    if (n == 2) return t->pair_rank[(size_t)p[0] << 8 | p[1]];
    size_t i = (size_t)tok_hash(p, n) & t->mask;
    for (;;) {
        uint32_t s = t->slot[i];
        if (!s) return TOK_NO_RANK;
        uint32_t r = s - 1;
        if (t->off[r + 1] - t->off[r] == n && memcmp(t->blob + t->off[r], p, n) == 0) return r;
        i = (i + 1) & t->mask;
    }
}

dg_status_t tok_build(const char *source, uint8_t *bytes, uint32_t *start, int n, dg_tokenizer_t **out) {
    *out = NULL;
    dg_tokenizer_t *t = dg_xcalloc(1, sizeof *t);
    t->source = dg_xstrdup(source);
    t->n_ranks = n;
    /* Append the special token's bytes so decode needs no special case. */
    size_t used = start[n];
    uint8_t *nb = realloc(bytes, used + sizeof EOT_TEXT);
    uint32_t *ns = realloc(start, (size_t)(n + 2) * sizeof *ns);
    DG_ASSERTF(nb && ns, "out of memory");
    memcpy(nb + used, EOT_TEXT, sizeof EOT_TEXT - 1);
    ns[n + 1] = (uint32_t)(used + sizeof EOT_TEXT - 1);
    t->blob = nb;
    t->off = ns;
    pthread_mutex_init(&t->mu, NULL);

    size_t cap = 1024;
    while (cap < 4 * (size_t)n)
        cap *= 2;
    t->slot = dg_xcalloc(cap, sizeof *t->slot);
    t->mask = cap - 1;
    for (int b = 0; b < 256; b++)
        t->byte_rank[b] = TOK_NO_RANK;
    t->pair_rank = dg_xmalloc(65536 * sizeof *t->pair_rank);
    for (int i = 0; i < 65536; i++)
        t->pair_rank[i] = TOK_NO_RANK;
    for (int r = 0; r < n; r++) {
        const uint8_t *p = t->blob + t->off[r];
        size_t len = t->off[r + 1] - t->off[r];
        if (len == 0) {
            dg_status_t s = DG_ERR(DG_ERR_USAGE, "tokenizer %s: token %d is empty", source, r);
            dg_tokenizer_free(t);
            return s;
        }
        uint32_t prev = len == 1 ? t->byte_rank[p[0]] : len == 2 ? t->pair_rank[(size_t)p[0] << 8 | p[1]] : 0;
        if (len > 2) {
            size_t i = (size_t)tok_hash(p, len) & t->mask;
            prev = TOK_NO_RANK;
            while (t->slot[i]) {
                uint32_t q = t->slot[i] - 1;
                if (t->off[q + 1] - t->off[q] == len && memcmp(t->blob + t->off[q], p, len) == 0) {
                    prev = q;
                    break;
                }
                i = (i + 1) & t->mask;
            }
            if (prev == TOK_NO_RANK) t->slot[i] = (uint32_t)r + 1;
        }
        if (prev != TOK_NO_RANK) {
            dg_status_t s = DG_ERR(DG_ERR_USAGE, "tokenizer %s: tokens %u and %d have the same bytes", source,
                                   (unsigned)prev, r);
            dg_tokenizer_free(t);
            return s;
        }
        if (len == 1) t->byte_rank[p[0]] = (uint32_t)r;
        if (len == 2) t->pair_rank[(size_t)p[0] << 8 | p[1]] = (uint32_t)r;
    }
    for (int b = 0; b < 256; b++) {
        if (t->byte_rank[b] == TOK_NO_RANK) {
            dg_status_t s =
                DG_ERR(DG_ERR_USAGE,
                       "tokenizer %s: byte 0x%02x is not a token (a byte-level BPE has all 256)", source, b);
            dg_tokenizer_free(t);
            return s;
        }
    }
#ifdef DG_HAVE_PCRE2
    /* The GPT-2 pattern with \s spelled out as Unicode White_Space: tiktoken's engine uses that set;
     * PCRE2's \s (UCP) would also take U+180E. Anchored: each match must start where the last ended. */
#define WS                                                                                                   \
    "\\t\\n\\x{0B}\\f\\r "                                                                                   \
    "\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"
    static const char pat[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" WS "\\p{L}\\p{N}]+|[" WS
                              "]+(?![^" WS "])|[" WS "]+";
#undef WS
    int ec;
    PCRE2_SIZE eo;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_ANCHORED, &ec, &eo, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof msg);
        dg_status_t s = DG_ERR(DG_ERR_RUNTIME, "tokenizer: PCRE2 refused the GPT-2 pattern at %zu: %s",
                               (size_t)eo, (const char *)msg);
        dg_tokenizer_free(t);
        return s;
    }
    t->re = re;
    t->jit = pcre2_jit_compile(re, PCRE2_JIT_COMPLETE) == 0; /* the interpreter gives the same matches */
#endif
    *out = t;
    return DG_OK;
}

/* ---------------- per-call scratch ---------------- */

typedef struct tok_state {
    struct tok_state *next;
#ifdef DG_HAVE_PCRE2
    pcre2_match_data *md;
    pcre2_match_context *mc;
    pcre2_jit_stack *js;
#endif
    uint8_t *buf; /* repaired text */
    size_t cap;
} tok_state_t;

#ifdef DG_HAVE_PCRE2
static tok_state_t *state_get(dg_tokenizer_t *t) {
    pthread_mutex_lock(&t->mu);
    tok_state_t *s = t->pool;
    if (s) t->pool = s->next;
    pthread_mutex_unlock(&t->mu);
    if (s) return s;
    s = dg_xcalloc(1, sizeof *s);
#ifdef DG_HAVE_PCRE2
    s->md = pcre2_match_data_create(1, NULL);
    s->mc = pcre2_match_context_create(NULL);
    DG_ASSERTF(s->md && s->mc, "out of memory");
    if (t->jit) {
        /* Long whitespace runs backtrack one character at a time; give the JIT room for them. */
        s->js = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, NULL);
        DG_ASSERTF(s->js, "out of memory");
        pcre2_jit_stack_assign(s->mc, NULL, s->js);
    }
#endif
    return s;
}

static void state_put(dg_tokenizer_t *t, tok_state_t *s) {
    pthread_mutex_lock(&t->mu);
    s->next = t->pool;
    t->pool = s;
    pthread_mutex_unlock(&t->mu);
}

#endif

static void state_free(tok_state_t *s) {
#ifdef DG_HAVE_PCRE2
    pcre2_match_data_free(s->md);
    pcre2_match_context_free(s->mc);
    if (s->js) pcre2_jit_stack_free(s->js);
#endif
    free(s->buf);
    free(s);
}

void dg_tokenizer_free(dg_tokenizer_t *t) {
    if (!t) return;
    while (t->pool) {
        tok_state_t *s = t->pool;
        t->pool = s->next;
        state_free(s);
    }
#ifdef DG_HAVE_PCRE2
    pcre2_code_free(t->re);
#endif
    pthread_mutex_destroy(&t->mu);
    DG_FREE_ALL(t->slot, t->pair_rank, t->blob, t->off, t->source, t);
}

int dg_tokenizer_can_encode(void) {
#ifdef DG_HAVE_PCRE2
    return 1;
#else
    return 0;
#endif
}

int dg_tokenizer_vocab_size(const dg_tokenizer_t *t) {
    return t->n_ranks + 1;
}
int dg_tokenizer_eot(const dg_tokenizer_t *t) {
    return t->n_ranks;
}
const char *dg_tokenizer_source(const dg_tokenizer_t *t) {
    return t->source;
}

void dg_tok_ids_free(dg_tok_ids_t *ids) {
    free(ids->v);
    *ids = (dg_tok_ids_t){0};
}

#ifdef DG_HAVE_PCRE2
static void ids_reserve(dg_tok_ids_t *ids, size_t more) {
    if (ids->n + more <= ids->cap) return;
    size_t cap = ids->cap ? ids->cap : 256;
    while (cap < ids->n + more)
        cap *= 2;
    int32_t *v = realloc(ids->v, cap * sizeof *v);
    DG_ASSERTF(v != NULL, "out of memory (%zu token ids)", cap);
    ids->v = v;
    ids->cap = cap;
}
#endif

/* ---------------- UTF-8 repair ---------------- */

/* Length (1..4) of the well-formed sequence at p (Unicode Table 3-7), or 0 with *sub set to the
 * length of the maximal subpart of the ill-formed one (>= 1): the bytes one U+FFFD replaces. */
static int utf8_seq(const uint8_t *p, size_t avail, int *sub) {
    uint8_t c = p[0];
    if (c < 0x80) return 1;
    int need;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
        need = 1;
    } else if (c == 0xE0) {
        need = 2, lo = 0xA0;
    } else if (c >= 0xE1 && c <= 0xEF) {
        need = 2;
        if (c == 0xED) hi = 0x9F; /* no surrogates */
    } else if (c == 0xF0) {
        need = 3, lo = 0x90;
    } else if (c >= 0xF1 && c <= 0xF4) {
        need = 3;
        if (c == 0xF4) hi = 0x8F; /* nothing above U+10FFFF */
    } else {
        *sub = 1; /* 80..C1, F5..FF never start a sequence */
        return 0;
    }
    for (int k = 1; k <= need; k++) {
        if ((size_t)k >= avail || p[k] < lo || p[k] > hi) {
            *sub = k;
            return 0;
        }
        lo = 0x80, hi = 0xBF;
    }
    return need + 1;
}

static size_t ascii_run(const uint8_t *p, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        if (w & 0x8080808080808080ULL) break;
    }
    while (i < n && p[i] < 0x80)
        i++;
    return i;
}

int tok_utf8_valid(const uint8_t *p, size_t n) {
    size_t i = 0;
    while (i < n) {
        i += ascii_run(p + i, n - i);
        if (i >= n) break;
        int sub, k = utf8_seq(p + i, n - i, &sub);
        if (!k) return 0;
        i += (size_t)k;
    }
    return 1;
}

size_t tok_utf8_repair(const uint8_t *p, size_t n, uint8_t *out, int64_t *n_bad, int64_t *first_bad) {
    size_t i = 0, o = 0;
    *n_bad = 0;
    *first_bad = -1;
    while (i < n) {
        size_t a = ascii_run(p + i, n - i);
        memcpy(out + o, p + i, a);
        i += a, o += a;
        if (i >= n) break;
        int sub, k = utf8_seq(p + i, n - i, &sub);
        if (k) {
            memcpy(out + o, p + i, (size_t)k);
            i += (size_t)k, o += (size_t)k;
            continue;
        }
        if (*first_bad < 0) *first_bad = (int64_t)i;
        ++*n_bad;
        out[o++] = 0xEF, out[o++] = 0xBF, out[o++] = 0xBD;
        i += (size_t)sub;
    }
    return o;
}

/* ---------------- byte-pair merge ---------------- */

size_t tok_bpe_linear(const dg_tokenizer_t *t, const uint8_t *p, size_t n, int32_t *out) {
    DG_ASSERT(n >= 1 && n <= TOK_LINEAR_MAX);
    /* Part i is p[pos[i] .. pos[i+1]) with rank prk[i]; rk[i] is the rank of parts i and i+1 joined. */
    uint32_t pos[TOK_LINEAR_MAX + 1], prk[TOK_LINEAR_MAX], rk[TOK_LINEAR_MAX];
    size_t m = n;
    for (size_t i = 0; i < n; i++) {
        pos[i] = (uint32_t)i;
        prk[i] = t->byte_rank[p[i]];
        rk[i] = i + 1 < n ? t->pair_rank[(size_t)p[i] << 8 | p[i + 1]] : TOK_NO_RANK;
    }
    pos[n] = (uint32_t)n;
    for (;;) {
        uint32_t best = TOK_NO_RANK;
        size_t bi = 0;
        for (size_t i = 0; i + 1 < m; i++)
            if (rk[i] < best) best = rk[i], bi = i;
        if (best == TOK_NO_RANK) break;
        prk[bi] = best;
        m--;
        memmove(pos + bi + 1, pos + bi + 2, (m - bi) * sizeof *pos);
        memmove(prk + bi + 1, prk + bi + 2, (m - bi - 1) * sizeof *prk);
        memmove(rk + bi + 1, rk + bi + 2, (m - bi - 1) * sizeof *rk);
        rk[bi] = bi + 1 < m ? tok_rank(t, p + pos[bi], pos[bi + 2] - pos[bi]) : TOK_NO_RANK;
        if (bi > 0) rk[bi - 1] = tok_rank(t, p + pos[bi - 1], pos[bi + 1] - pos[bi - 1]);
    }
    for (size_t i = 0; i < m; i++)
        out[i] = (int32_t)prk[i];
    return m;
}

/* The same merge for long pieces: parts in a linked list, candidate pairs in a min-heap keyed by
 * (rank, position) — the leftmost lowest rank, as the scan above picks. An entry is acted on only if
 * the pair at its position still has its rank; otherwise it is stale and skipped (a pair's bytes only
 * grow, and distinct byte strings have distinct ranks, so a consumed entry never matches again).
 * Memory: about 40 bytes per byte of the piece. */
static void heap_push(uint64_t *h, size_t *hn, uint64_t e) {
    size_t i = (*hn)++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (h[up] <= e) break;
        h[i] = h[up];
        i = up;
    }
    h[i] = e;
}

static uint64_t heap_pop(uint64_t *h, size_t *hn) {
    uint64_t top = h[0], last = h[--*hn];
    size_t i = 0, n = *hn;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && h[c + 1] < h[c]) c++;
        if (last <= h[c]) break;
        h[i] = h[c];
        i = c;
    }
    if (n) h[i] = last;
    return top;
}

size_t tok_bpe_heap(const dg_tokenizer_t *t, const uint8_t *p, size_t n, int32_t *out) {
    DG_ASSERT(n >= 1 && n < UINT32_MAX);
    /* Parts are named by their first byte; next[i] is the next part's first byte (n: none); prk[i] is
     * part i's rank (TOK_NO_RANK: absorbed by its left neighbour); cur[i] the rank of i joined with next. */
    uint32_t *next = dg_xmalloc(n * sizeof *next), *prev = dg_xmalloc(n * sizeof *prev);
    uint32_t *prk = dg_xmalloc(n * sizeof *prk), *cur = dg_xmalloc(n * sizeof *cur);
    uint64_t *h = dg_xmalloc(3 * n * sizeof *h); /* n initial entries, at most 2 per merge */
    size_t hn = 0;
    for (size_t i = 0; i < n; i++) {
        next[i] = (uint32_t)(i + 1);
        prev[i] = i ? (uint32_t)(i - 1) : UINT32_MAX;
        prk[i] = t->byte_rank[p[i]];
        cur[i] = i + 1 < n ? t->pair_rank[(size_t)p[i] << 8 | p[i + 1]] : TOK_NO_RANK;
        if (cur[i] != TOK_NO_RANK) heap_push(h, &hn, (uint64_t)cur[i] << 32 | i);
    }
    while (hn) {
        uint64_t e = heap_pop(h, &hn);
        uint32_t i = (uint32_t)e, r = (uint32_t)(e >> 32);
        if (prk[i] == TOK_NO_RANK || cur[i] != r) continue; /* stale */
        uint32_t j = next[i];
        prk[i] = r;
        prk[j] = TOK_NO_RANK;
        next[i] = next[j];
        if (next[j] < n) prev[next[j]] = i;
        cur[i] = next[i] < n ? tok_rank(t, p + i, next[next[i]] - i) : TOK_NO_RANK;
        if (cur[i] != TOK_NO_RANK) heap_push(h, &hn, (uint64_t)cur[i] << 32 | i);
        if (prev[i] != UINT32_MAX) {
            uint32_t q = prev[i];
            cur[q] = tok_rank(t, p + q, next[i] - q);
            if (cur[q] != TOK_NO_RANK) heap_push(h, &hn, (uint64_t)cur[q] << 32 | q);
        }
    }
    size_t m = 0;
    for (uint32_t i = 0; i < n; i = next[i])
        out[m++] = (int32_t)prk[i];
    free(next);
    free(prev);
    free(prk);
    free(cur);
    free(h);
    return m;
}

#ifdef DG_HAVE_PCRE2
static void encode_piece(const dg_tokenizer_t *t, const uint8_t *p, size_t n, dg_tok_ids_t *ids) {
    uint32_t r = tok_rank(t, p, n);
    ids_reserve(ids, r != TOK_NO_RANK ? 1 : n);
    if (r != TOK_NO_RANK) {
        ids->v[ids->n++] = (int32_t)r;
        return;
    }
    ids->n += n <= TOK_LINEAR_MAX ? tok_bpe_linear(t, p, n, ids->v + ids->n)
                                  : tok_bpe_heap(t, p, n, ids->v + ids->n);
}
#endif

/* ---------------- encode / decode ---------------- */

dg_status_t dg_tokenizer_encode(const dg_tokenizer_t *tok, const void *text, size_t n, dg_tok_ids_t *ids,
                                dg_tok_stats_t *stats) {
    if (stats) *stats = (dg_tok_stats_t){.invalid_utf8 = 0, .first_invalid = -1};
#ifndef DG_HAVE_PCRE2
    (void)tok, (void)text, (void)n, (void)ids;
    return DG_ERR(DG_ERR_USAGE, "tokenizer: this build has no GPT-2 encoder: it was built without PCRE2 "
                                "(install libpcre2-dev, e.g. with scripts/setup.sh, and rebuild)");
#else
    if (n == 0) return DG_OK;
    dg_tokenizer_t *t = (dg_tokenizer_t *)tok; /* only the pool changes, under its mutex */
    tok_state_t *st = state_get(t);
    const uint8_t *s = text;
    size_t len = n;
    if (!tok_utf8_valid(s, n)) {
        if (st->cap < 3 * n) {
            free(st->buf);
            st->cap = 3 * n;
            st->buf = dg_xmalloc(st->cap);
        }
        int64_t bad, first;
        len = tok_utf8_repair(s, n, st->buf, &bad, &first);
        s = st->buf;
        if (stats) stats->invalid_utf8 = bad, stats->first_invalid = first;
    }
    ids_reserve(ids, len / 4 + 16);
    dg_status_t rc = DG_OK;
    size_t pos = 0;
    while (pos < len) {
        int m = t->jit ? pcre2_jit_match(t->re, s, len, pos, PCRE2_NO_UTF_CHECK, st->md, st->mc)
                       : pcre2_match(t->re, s, len, pos, PCRE2_NO_UTF_CHECK, st->md, st->mc);
        if (m < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(m, msg, sizeof msg);
            rc = DG_ERR(DG_ERR_RUNTIME, "tokenizer: pre-tokenization failed at byte %zu of %zu: %s", pos, len,
                        (const char *)msg);
            break;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(st->md);
        /* Anchored, and every character is in one of the classes: a non-empty match at pos. */
        DG_ASSERTF(ov[0] == pos && ov[1] > pos, "GPT-2 pattern matched [%zu, %zu) at %zu", (size_t)ov[0],
                   (size_t)ov[1], pos);
        encode_piece(t, s + pos, ov[1] - pos, ids);
        pos = ov[1];
    }
    state_put(t, st);
    return rc;
#endif
}

const uint8_t *dg_tokenizer_token_bytes(const dg_tokenizer_t *t, int32_t id, size_t *len) {
    if (id < 0 || id > t->n_ranks) return NULL;
    *len = t->off[id + 1] - t->off[id];
    return t->blob + t->off[id];
}

dg_status_t dg_tokenizer_decode(const dg_tokenizer_t *t, const int32_t *ids, size_t n, uint8_t **out,
                                size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] > t->n_ranks)
            return DG_ERR(DG_ERR_USAGE, "tokenizer: token id %d at position %zu is not in [0, %d)",
                          (int)ids[i], i, t->n_ranks + 1);
        total += t->off[ids[i] + 1] - t->off[ids[i]];
    }
    uint8_t *b = dg_xmalloc(total + 1), *o = b;
    for (size_t i = 0; i < n; i++) {
        size_t l = t->off[ids[i] + 1] - t->off[ids[i]];
        memcpy(o, t->blob + t->off[ids[i]], l);
        o += l;
    }
    *o = 0;
    *out = b;
    *out_len = total;
    return DG_OK;
}

/* ---------------- safe split points ---------------- */

static int ascii_graph(uint8_t c) {
    return c > 0x20 && c < 0x7f;
}

size_t dg_tokenizer_next_split(const void *text, size_t n, size_t from) {
    const uint8_t *p = text;
    size_t i = from < 2 ? 2 : from; /* candidate cut: p[i-1] must be '\n' */
    while (i < n) {
        const uint8_t *nl = memchr(p + i - 1, '\n', n - i);
        if (!nl) return n;
        size_t q = (size_t)(nl - p) + 1; /* i <= q < n */
        if (ascii_graph(p[q - 2]) &&
            (ascii_graph(p[q]) || (p[q] == ' ' && q + 1 < n && ascii_graph(p[q + 1]))))
            return q;
        i = q + 1;
    }
    return n;
}

/* ---------------- where the GPT-2 ranks are installed ---------------- */

static int readable(const char *path) {
    return access(path, R_OK) == 0;
}

dg_status_t dg_tokenizer_find_gpt2(const char *explicit_path, char *out, size_t cap) {
    if (explicit_path) {
        if (!readable(explicit_path))
            return DG_ERR(DG_ERR_USAGE, "tokenizer: cannot read ranks file %s: %s", explicit_path,
                          strerror(errno));
        dg_fmt(out, cap, "%s", explicit_path);
        return DG_OK;
    }
    const char *env = dg_env_str(DG_TOKENIZER_ENV);
    if (env && *env) {
        if (!readable(env))
            return DG_ERR(DG_ERR_USAGE, "tokenizer: cannot read ranks file %s (from $%s): %s", env,
                          DG_TOKENIZER_ENV, strerror(errno));
        dg_fmt(out, cap, "%s", env);
        return DG_OK;
    }
    char tried[3][PATH_MAX + 64];
    int nt = 0;
    char exe[PATH_MAX];
    ssize_t l = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (l > 0) {
        exe[l] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) {
            *slash = 0;
            dg_fmt(tried[nt++], sizeof tried[0], "%s/../share/dgtrain/%s", exe, DG_TOKENIZER_GPT2_FILE);
        }
    }
    dg_fmt(tried[nt++], sizeof tried[0], "%s/%s", DG_TOKENIZER_SHARE_DIR, DG_TOKENIZER_GPT2_FILE);
    dg_fmt(tried[nt++], sizeof tried[0], "/usr/share/dgtrain/%s", DG_TOKENIZER_GPT2_FILE);
    for (int i = 0; i < nt; i++) {
        if (readable(tried[i])) {
            dg_fmt(out, cap, "%s", tried[i]);
            return DG_OK;
        }
    }
    return DG_ERR(
        DG_ERR_USAGE,
        "tokenizer: no GPT-2 ranks file (%s): tried $%s, %s%s%s%s%s; run scripts/setup.sh (it installs "
        "it from the openai-whisper package) or give one with --vocab FILE",
        DG_TOKENIZER_GPT2_FILE, DG_TOKENIZER_ENV, tried[0], nt > 1 ? ", " : "", nt > 1 ? tried[1] : "",
        nt > 2 ? ", " : "", nt > 2 ? tried[2] : "");
}
