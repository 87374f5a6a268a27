/* json.c — the one JSON string escaper (rules in dg_json.h). Kept byte-oriented and allocation-free so
 * that every writer (FILE streams, fixed buffers in the health monitor, growable buffers) can share it. */
#include "dg_json.h"

#include <stdlib.h>
#include <string.h>

#include "dg_common.h"

/* Length of the well-formed UTF-8 sequence at s (2-4), or 0 when the bytes there are not one
 * (overlong forms, surrogates, code points above U+10FFFF, a truncated sequence). s[0] >= 0x80. */
static int utf8_len(const unsigned char *s) {
    unsigned c = s[0], cp;
    int n;
    if (c >= 0xC2 && c <= 0xDF) {
        n = 2;
        cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        cp = c & 0x07;
    } else {
        return 0;
    }
    for (int i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0; /* also stops at the terminating NUL */
        cp = cp << 6 | (s[i] & 0x3F);
    }
    if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF))) return 0;
    if (cp >= 0xD800 && cp <= 0xDFFF) return 0;
    return n;
}

/* The next output unit for the input at s: writes it to unit[8] and returns its length; *adv is how
 * many input bytes it stands for. */
static size_t next_unit(const unsigned char *s, char unit[8], size_t *adv) {
    static const char hex[] = "0123456789abcdef";
    unsigned c = s[0];
    *adv = 1;
    if (c == '"' || c == '\\') {
        unit[0] = '\\';
        unit[1] = (char)c;
        return 2;
    }
    const char *named = c == '\n'   ? "\\n"
                        : c == '\t' ? "\\t"
                        : c == '\r' ? "\\r"
                        : c == '\b' ? "\\b"
                        : c == '\f' ? "\\f"
                                    : NULL;
    if (named) {
        memcpy(unit, named, 2);
        return 2;
    }
    if (c >= 0x20 && c < 0x7F) {
        unit[0] = (char)c;
        return 1;
    }
    if (c >= 0x80) {
        int n = utf8_len(s);
        if (n > 0) {
            memcpy(unit, s, (size_t)n);
            *adv = (size_t)n;
            return (size_t)n;
        }
    }
    /* control byte, DEL, or a byte that is not part of valid UTF-8 (taken as Latin-1) */
    memcpy(unit, "\\u00", 4);
    unit[4] = hex[c >> 4];
    unit[5] = hex[c & 15];
    return 6;
}

size_t dg_json_quote(char *out, size_t cap, const char *str) {
    const unsigned char *s = (const unsigned char *)(str ? str : "");
    size_t need = 1, len = 0;   /* need: the full quoted length; len: bytes written so far */
    int room = out && cap >= 3; /* the opening quote, the closing quote and the NUL */
    if (room) out[len++] = '"';
    while (*s) {
        char unit[8];
        size_t adv, n = next_unit(s, unit, &adv);
        s += adv;
        need += n;
        /* keep space for the closing quote and the NUL; once a unit does not fit, stop writing */
        if (room && len + n + 2 <= cap) {
            memcpy(out + len, unit, n);
            len += n;
        } else {
            room = 0;
        }
    }
    need += 1;
    if (out && cap >= 3) {
        out[len++] = '"';
        out[len] = 0;
    } else if (out && cap > 0) {
        out[0] = 0;
    }
    return need;
}

char *dg_json_quote_dup(const char *s) {
    size_t n = dg_json_quote(NULL, 0, s);
    char *p = dg_xmalloc(n + 1);
    dg_json_quote(p, n + 1, s);
    return p;
}

void dg_json_fputs(FILE *f, const char *str) {
    const unsigned char *s = (const unsigned char *)(str ? str : "");
    fputc('"', f);
    while (*s) {
        char unit[8];
        size_t adv, n = next_unit(s, unit, &adv);
        s += adv;
        fwrite(unit, 1, n, f);
    }
    fputc('"', f);
}
