/* tok_load.c — the two ranks-file readers: tiktoken's .tiktoken (base64 token, space, rank per line)
 * and a Hugging Face GPT-2 tokenizer's vocab.json + merges.txt (tokens written in GPT-2's
 * byte-to-unicode alphabet). Both end in tok_build with the tokens in rank order. Every file is
 * untrusted: each defect is a one-line DG_ERR_USAGE naming the file and line. */
#include "tokenizer_impl.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static dg_status_t read_file(const char *path, uint8_t **out, size_t *len) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return DG_ERR(DG_ERR_USAGE, "tokenizer: cannot read %s: %s", path, strerror(errno));
    char *text = NULL;
    int e = dg_read_stream(f, SIZE_MAX, &text, len);
    fclose(f);
    if (e) return DG_ERR(DG_ERR_USAGE, "tokenizer: cannot read %s: read error", path);
    *out = (uint8_t *)text;
    return DG_OK;
}

/* ---------------- .tiktoken ---------------- */

/* The line of text that starts at offset i: *le is its end before any '\r'; returns the offset past its
 * '\n' (the next line's start) */
static size_t line_at(const uint8_t *text, size_t len, size_t i, size_t *le) {
    size_t e = i;
    while (e < len && text[e] != '\n')
        e++;
    *le = e > i && text[e - 1] == '\r' ? e - 1 : e;
    return e + 1;
}

static int b64_val(uint8_t c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Standard base64 with '=' padding (the length a multiple of 4). Returns the decoded length, or -1. */
static long b64_decode(const uint8_t *s, size_t n, uint8_t *out) {
    if (n == 0 || n % 4) return -1;
    long o = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4], pad = 0;
        for (int k = 0; k < 4; k++) {
            if (s[i + k] == '=' && i + 4 == n && k >= 2) {
                v[k] = 0;
                pad++;
            } else {
                if (pad) return -1; /* '=' only at the very end */
                v[k] = b64_val(s[i + k]);
                if (v[k] < 0) return -1;
            }
        }
        uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        out[o++] = (uint8_t)(w >> 16);
        if (pad < 2) out[o++] = (uint8_t)(w >> 8);
        if (pad < 1) out[o++] = (uint8_t)w;
    }
    return o;
}

dg_status_t dg_tokenizer_load_tiktoken(const char *path, dg_tokenizer_t **out) {
    *out = NULL;
    uint8_t *text;
    size_t len;
    DG_TRY(read_file(path, &text, &len));
    /* One token per line; count lines to size the arrays. */
    size_t lines = 0;
    for (size_t i = 0; i < len; i++)
        lines += text[i] == '\n';
    lines += len && text[len - 1] != '\n';
    if (lines == 0 || lines > (1u << 24)) {
        free(text);
        return DG_ERR(DG_ERR_USAGE, "tokenizer %s: expected 1 to 16777216 lines 'BASE64 RANK', found %zu",
                      path, lines);
    }
    uint32_t *tok_off = dg_xmalloc((lines + 1) * sizeof *tok_off); /* by line, into `raw` */
    int64_t *rank_line = dg_xmalloc(lines * sizeof *rank_line);    /* rank -> line, -1 = unseen */
    for (size_t i = 0; i < lines; i++)
        rank_line[i] = -1;
    uint8_t *raw = dg_xmalloc(len + 1);
    size_t used = 0, n = 0, line_no = 0;
    dg_status_t s = DG_OK;
    for (size_t i = 0; i < len && s == DG_OK;) {
        size_t le, next = line_at(text, len, i, &le);
        line_no++;
        const uint8_t *sp = memchr(text + i, ' ', le - i);
        char *endp;
        long b = -1;
        unsigned long r = 0;
        if (sp) {
            b = b64_decode(text + i, (size_t)(sp - (text + i)), raw + used);
            errno = 0;
            r = sp + 1 < text + le && sp[1] >= '0' && sp[1] <= '9' ? strtoul((const char *)sp + 1, &endp, 10)
                                                                   : 0;
            if (!(sp + 1 < text + le && sp[1] >= '0' && sp[1] <= '9') || errno || endp != (char *)text + le)
                sp = NULL;
        }
        if (!sp || b <= 0) {
            s = DG_ERR(DG_ERR_USAGE,
                       "tokenizer %s:%zu: expected 'BASE64 RANK' (a token in base64, one space, a "
                       "decimal rank)",
                       path, line_no);
        } else if (r >= lines) {
            s = DG_ERR(DG_ERR_USAGE,
                       "tokenizer %s:%zu: rank %lu out of range (the file has %zu tokens: ranks 0..%zu)",
                       path, line_no, r, lines, lines - 1);
        } else if (rank_line[r] >= 0) {
            s = DG_ERR(DG_ERR_USAGE, "tokenizer %s:%zu: rank %lu already given at line %lld", path, line_no,
                       r, (long long)rank_line[r] + 1);
        } else {
            rank_line[r] = (int64_t)n;
            tok_off[n++] = (uint32_t)used;
            used += (size_t)b;
        }
        i = next;
    }
    tok_off[n] = (uint32_t)used;
    free(text);
    if (s == DG_OK && n != lines) /* blank lines */
        s = DG_ERR(DG_ERR_USAGE, "tokenizer %s: %zu blank or malformed lines", path, lines - n);
    if (s != DG_OK) {
        free(tok_off);
        free(rank_line);
        free(raw);
        return s;
    }
    /* Every rank 0..n-1 was seen once (n lines, n distinct ranks < n): reorder by rank. */
    uint8_t *bytes = dg_xmalloc(used ? used : 1);
    uint32_t *start = dg_xmalloc((n + 1) * sizeof *start);
    size_t o = 0;
    for (size_t r = 0; r < n; r++) {
        size_t l = (size_t)rank_line[r];
        start[r] = (uint32_t)o;
        memcpy(bytes + o, raw + tok_off[l], tok_off[l + 1] - tok_off[l]);
        o += tok_off[l + 1] - tok_off[l];
    }
    start[n] = (uint32_t)o;
    free(tok_off);
    free(rank_line);
    free(raw);
    return tok_build(path, bytes, start, (int)n, out);
}

/* ---------------- Hugging Face vocab.json + merges.txt ---------------- */

/* GPT-2's byte-to-unicode alphabet (encoder.py's bytes_to_unicode): the printable Latin-1 bytes
 * '!'..'~', 0xA1..0xAC, 0xAE..0xFF stand for themselves; the other 68 bytes, in increasing order, are
 * U+0100, U+0101, ... Returns the byte a code point stands for, or -1. */
static int unicode_to_byte(uint32_t cp) {
    if ((cp >= '!' && cp <= '~') || (cp >= 0xA1 && cp <= 0xAC) || (cp >= 0xAE && cp <= 0xFF)) return (int)cp;
    if (cp < 256 || cp >= 256 + 68) return -1;
    uint32_t k = cp - 256; /* the k-th of the other bytes: 0x00..0x20, 0x7F..0xA0, 0xAD */
    return k <= 32 ? (int)k : k <= 66 ? (int)(0x7F + k - 33) : 0xAD;
}

typedef struct json {
    const char *path;
    const uint8_t *s;
    size_t n, i;
    size_t line; /* of s[i]: newlines only occur between tokens (strings may not hold raw ones) */
} json_t;

static dg_status_t json_err(const json_t *j, const char *what) {
    return DG_ERR(DG_ERR_USAGE, "tokenizer %s:%zu: %s", j->path, j->line, what);
}

static void json_ws(json_t *j) {
    while (j->i < j->n &&
           (j->s[j->i] == ' ' || j->s[j->i] == '\t' || j->s[j->i] == '\n' || j->s[j->i] == '\r'))
        j->line += j->s[j->i++] == '\n';
}

static int hex4(const uint8_t *p, uint32_t *v) {
    *v = 0;
    for (int k = 0; k < 4; k++) {
        uint8_t c = p[k];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0) return 0;
        *v = *v << 4 | (uint32_t)d;
    }
    return 1;
}

/* One UTF-8 code point at p (n bytes left): its length, or 0 when ill-formed. */
static int utf8_next(const uint8_t *p, size_t n, uint32_t *cp) {
    uint8_t c = p[0];
    if (c < 0x80) return *cp = c, 1;
    int len = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (!len || (size_t)len > n) return 0;
    uint32_t v = c & (0x7F >> len);
    for (int k = 1; k < len; k++) {
        if ((p[k] & 0xC0) != 0x80) return 0;
        v = v << 6 | (p[k] & 0x3F);
    }
    static const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < min[len] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;
    *cp = v;
    return len;
}

/* A JSON string of GPT-2 alphabet characters -> the bytes they stand for (appended to out). */
static dg_status_t json_token(json_t *j, uint8_t *out, size_t *olen) {
    *olen = 0;
    if (j->i >= j->n || j->s[j->i] != '"') return json_err(j, "expected a string");
    j->i++;
    for (;;) {
        if (j->i >= j->n) return json_err(j, "unterminated string");
        uint8_t c = j->s[j->i];
        uint32_t cp;
        if (c == '"') {
            j->i++;
            return DG_OK;
        }
        if (c < 0x20) return json_err(j, "control character in a string");
        if (c == '\\') {
            if (j->i + 1 >= j->n) return json_err(j, "unterminated string");
            uint8_t e = j->s[j->i + 1];
            j->i += 2;
            switch (e) {
            case '"':
                cp = '"';
                break;
            case '\\':
                cp = '\\';
                break;
            case '/':
                cp = '/';
                break;
            case 'b':
                cp = 8;
                break;
            case 'f':
                cp = 12;
                break;
            case 'n':
                cp = 10;
                break;
            case 'r':
                cp = 13;
                break;
            case 't':
                cp = 9;
                break;
            case 'u':
                if (j->i + 4 > j->n || !hex4(j->s + j->i, &cp)) return json_err(j, "bad \\u escape");
                j->i += 4;
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    uint32_t lo;
                    if (j->i + 6 > j->n || j->s[j->i] != '\\' || j->s[j->i + 1] != 'u' ||
                        !hex4(j->s + j->i + 2, &lo) || lo < 0xDC00 || lo > 0xDFFF)
                        return json_err(j, "unpaired surrogate in a \\u escape");
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    j->i += 6;
                } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                    return json_err(j, "unpaired surrogate in a \\u escape");
                }
                break;
            default:
                return json_err(j, "bad escape in a string");
            }
        } else {
            int l = utf8_next(j->s + j->i, j->n - j->i, &cp);
            if (!l) return json_err(j, "invalid UTF-8");
            j->i += (size_t)l;
        }
        int b = unicode_to_byte(cp);
        if (b < 0) {
            char msg[160];
            dg_fmt(msg, sizeof msg, "character U+%04X is not in GPT-2's byte-to-unicode alphabet",
                   (unsigned)cp);
            return json_err(j, msg);
        }
        out[(*olen)++] = (uint8_t)b;
    }
}

/* UTF-8 text in GPT-2's alphabet -> the bytes it stands for; 0 when a character is not in it. */
static int alphabet_decode(const uint8_t *p, size_t n, uint8_t *out, size_t *olen) {
    *olen = 0;
    if (n == 0) return 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int l = utf8_next(p + i, n - i, &cp), b = l ? unicode_to_byte(cp) : -1;
        if (b < 0) return 0;
        out[(*olen)++] = (uint8_t)b;
        i += (size_t)l;
    }
    return 1;
}

typedef struct hf_vocab {
    uint8_t *bytes; /* all tokens' bytes, in file order */
    size_t *at;     /* by id: offset into bytes, or SIZE_MAX */
    uint32_t *len;  /* by id */
    size_t *line;   /* by id: line in vocab.json */
    size_t n_ids;   /* max id + 1 */
} hf_vocab_t;

static void hf_vocab_free(hf_vocab_t *v) {
    free(v->bytes);
    free(v->at);
    free(v->len);
    free(v->line);
}

static dg_status_t parse_vocab(const char *path, hf_vocab_t *v) {
    memset(v, 0, sizeof *v);
    uint8_t *text;
    size_t len;
    DG_TRY(read_file(path, &text, &len));
    json_t j = {.path = path, .s = text, .n = len, .line = 1};
    /* Tokens are no longer than their JSON text; ids are < the number of entries. */
    v->bytes = dg_xmalloc(len + 1);
    size_t cap = len / 4 + 16, used = 0, entries = 0;
    v->at = dg_xmalloc(cap * sizeof *v->at);
    v->len = dg_xmalloc(cap * sizeof *v->len);
    v->line = dg_xmalloc(cap * sizeof *v->line);
    for (size_t i = 0; i < cap; i++)
        v->at[i] = SIZE_MAX;
    dg_status_t s = DG_OK;
    json_ws(&j);
    if (j.i >= j.n || j.s[j.i] != '{') s = json_err(&j, "expected a JSON object {\"token\": id, ...}");
    j.i++;
    json_ws(&j);
    if (s == DG_OK && j.i < j.n && j.s[j.i] == '}') j.i++, s = json_err(&j, "empty vocabulary");
    while (s == DG_OK) {
        json_ws(&j);
        size_t tl, line = j.line;
        s = json_token(&j, v->bytes + used, &tl);
        if (s != DG_OK) break;
        json_ws(&j);
        if (j.i >= j.n || j.s[j.i] != ':') {
            s = json_err(&j, "expected ':' after a token");
            break;
        }
        j.i++;
        json_ws(&j);
        size_t d0 = j.i;
        unsigned long long id = 0;
        while (j.i < j.n && j.s[j.i] >= '0' && j.s[j.i] <= '9' && j.i - d0 < 10)
            id = id * 10 + (j.s[j.i++] - '0');
        if (j.i == d0 || (j.i < j.n && j.s[j.i] >= '0' && j.s[j.i] <= '9')) {
            s = json_err(&j, "expected a token id (a non-negative integer below 2^32)");
            break;
        }
        entries++;
        if (id >= cap) {
            s = json_err(&j, "token id larger than the number of tokens (ids must be 0..n-1)");
            break;
        }
        if (v->at[id] != SIZE_MAX) {
            char msg[160];
            dg_fmt(msg, sizeof msg, "id %llu given twice (first at line %zu)", id, v->line[id]);
            s = json_err(&j, msg);
            break;
        }
        v->at[id] = used;
        v->len[id] = (uint32_t)tl;
        v->line[id] = line;
        used += tl;
        if (id + 1 > v->n_ids) v->n_ids = id + 1;
        json_ws(&j);
        if (j.i < j.n && j.s[j.i] == ',') {
            j.i++;
            continue;
        }
        if (j.i < j.n && j.s[j.i] == '}') {
            j.i++;
            json_ws(&j);
            if (j.i != j.n) s = json_err(&j, "text after the JSON object");
            break;
        }
        s = json_err(&j, "expected ',' or '}'");
    }
    if (s == DG_OK && entries != v->n_ids) {
        for (size_t id = 0; id < v->n_ids; id++)
            if (v->at[id] == SIZE_MAX) {
                s = DG_ERR(DG_ERR_USAGE, "tokenizer %s: no token has id %zu (ids must be 0..%zu, each once)",
                           path, id, entries - 1);
                break;
            }
    }
    free(text);
    if (s != DG_OK) hf_vocab_free(v);
    return s;
}

dg_status_t dg_tokenizer_load_hf(const char *dir, dg_tokenizer_t **out) {
    *out = NULL;
    char vpath[4096], mpath[4096];
    if (snprintf(vpath, sizeof vpath, "%s/vocab.json", dir) >= (int)sizeof vpath ||
        snprintf(mpath, sizeof mpath, "%s/merges.txt", dir) >= (int)sizeof mpath)
        return DG_ERR(DG_ERR_USAGE, "tokenizer: path too long: %s", dir);
    hf_vocab_t v;
    DG_TRY(parse_vocab(vpath, &v));
    uint8_t *text;
    size_t len;
    dg_status_t s = read_file(mpath, &text, &len);
    if (s != DG_OK) {
        hf_vocab_free(&v);
        return s;
    }
    static const char eot[] = "<|endoftext|>";
    size_t n_merges = 0, line_no = 0;
    uint8_t *buf = dg_xmalloc(len + 1);
    for (size_t i = 0; i < len && s == DG_OK;) {
        size_t le, li = i;
        i = line_at(text, len, li, &le);
        line_no++;
        if (le == li || (line_no == 1 && le - li >= 9 && memcmp(text + li, "#version:", 9) == 0)) continue;
        const uint8_t *sp = memchr(text + li, ' ', le - li);
        if (!sp || memchr(sp + 1, ' ', (size_t)(text + le - sp - 1))) {
            s = DG_ERR(DG_ERR_USAGE, "tokenizer %s:%zu: expected 'LEFT RIGHT' (two tokens, one space)", mpath,
                       line_no);
            break;
        }
        size_t al = 0, bl = 0;
        if (!alphabet_decode(text + li, (size_t)(sp - (text + li)), buf, &al) ||
            !alphabet_decode(sp + 1, (size_t)(text + le - sp - 1), buf + al, &bl)) {
            s = DG_ERR(DG_ERR_USAGE,
                       "tokenizer %s:%zu: a merge token is not UTF-8 in GPT-2's byte-to-unicode alphabet",
                       mpath, line_no);
            break;
        }
        size_t id = 256 + n_merges;
        if (id >= v.n_ids) {
            s = DG_ERR(DG_ERR_USAGE,
                       "tokenizer %s:%zu: merge %zu makes token id %zu, but %s has only %zu tokens", mpath,
                       line_no, n_merges, id, vpath, v.n_ids);
            break;
        }
        if (v.len[id] != al + bl || memcmp(v.bytes + v.at[id], buf, al + bl) != 0) {
            s = DG_ERR(
                DG_ERR_USAGE,
                "tokenizer %s:%zu: merge %zu does not make the token with id %zu in %s (line %zu): the "
                "rank-based merge needs ids in merge order, as GPT-2's files have them",
                mpath, line_no, n_merges, id, vpath, v.line[id]);
            break;
        }
        n_merges++;
    }
    free(buf);
    free(text);
    size_t n_ranks = 256 + n_merges;
    for (size_t id = 0; s == DG_OK && id < 256 && id < v.n_ids; id++)
        if (v.len[id] != 1)
            s = DG_ERR(DG_ERR_USAGE,
                       "tokenizer %s:%zu: id %zu is not a single byte (ids 0..255 must be the 256 bytes)",
                       vpath, v.line[id], id);
    if (s == DG_OK && v.n_ids < 256)
        s = DG_ERR(DG_ERR_USAGE, "tokenizer %s: %zu tokens; a byte-level BPE has at least the 256 bytes",
                   vpath, v.n_ids);
    if (s == DG_OK && !(v.n_ids == n_ranks || (v.n_ids == n_ranks + 1 && v.len[n_ranks] == sizeof eot - 1 &&
                                               memcmp(v.bytes + v.at[n_ranks], eot, sizeof eot - 1) == 0)))
        s = DG_ERR(DG_ERR_USAGE,
                   "tokenizer %s: %zu tokens but 256 bytes + %zu merges = %zu; the only other token may be "
                   "<|endoftext|>, with id %zu",
                   vpath, v.n_ids, n_merges, n_ranks, n_ranks);
    if (s != DG_OK) {
        hf_vocab_free(&v);
        return s;
    }
    size_t total = 0;
    for (size_t id = 0; id < n_ranks; id++)
        total += v.len[id];
    uint8_t *bytes = dg_xmalloc(total ? total : 1);
    uint32_t *start = dg_xmalloc((n_ranks + 1) * sizeof *start);
    size_t o = 0;
    for (size_t id = 0; id < n_ranks; id++) {
        start[id] = (uint32_t)o;
        memcpy(bytes + o, v.bytes + v.at[id], v.len[id]);
        o += v.len[id];
    }
    start[n_ranks] = (uint32_t)o;
    hf_vocab_free(&v);
    return tok_build(dir, bytes, start, (int)n_ranks, out);
}
