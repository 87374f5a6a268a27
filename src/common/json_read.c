/* json_read.c — see dg_json_read.h. */
#include "dg_json_read.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *ws(const char *p) {
    while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')
        p++;
    return p;
}

/* Reads a JSON string at p (on the opening quote) into out[cap] (cut when too long, \u escapes
 * above 0x7F kept as '?'); returns the byte after the closing quote or NULL when malformed. */
static const char *rd_str(const char *p, char *out, size_t cap) {
    size_t n = 0;
    if (*p++ != '"') return NULL;
    while (*p && *p != '"') {
        char c = *p++;
        if (c == '\\') {
            char e = *p++;
            switch (e) {
            case '"':
            case '\\':
            case '/':
                c = e;
                break;
            case 'b':
                c = '\b';
                break;
            case 'f':
                c = '\f';
                break;
            case 'n':
                c = '\n';
                break;
            case 'r':
                c = '\r';
                break;
            case 't':
                c = '\t';
                break;
            case 'u': {
                char h[5] = {0};
                for (int i = 0; i < 4; i++) {
                    if (!p[i]) return NULL;
                    h[i] = p[i];
                }
                char *end;
                long v = strtol(h, &end, 16);
                if (*end) return NULL;
                c = v < 0x80 ? (char)v : '?';
                p += 4;
                break;
            }
            default:
                return NULL;
            }
        }
        if (n + 1 < cap) out[n++] = c;
    }
    if (*p != '"') return NULL;
    out[n] = '\0';
    return p + 1;
}

static const char *rd_val(const char *p, dg_jl_field *f) {
    f->is_str = 0;
    f->str[0] = '\0';
    if (*p == '"') {
        f->is_str = 1;
        return rd_str(p, f->str, sizeof f->str);
    }
    if (!strncmp(p, "true", 4)) {
        f->num = 1;
        return p + 4;
    }
    if (!strncmp(p, "false", 5)) {
        f->num = 0;
        return p + 5;
    }
    if (!strncmp(p, "null", 4)) {
        f->num = NAN;
        return p + 4;
    }
    char *end;
    f->num = strtod(p, &end);
    return end == p ? NULL : end;
}

int dg_jl_parse(const char *line, dg_jl_obj *o) {
    const char *p = ws(line);
    o->n = 0;
    if (*p++ != '{') return -1;
    p = ws(p);
    if (*p == '}') return *ws(p + 1) ? -1 : 0;
    for (;;) {
        dg_jl_field tmp, *f = o->n < DG_JL_MAX_FIELDS ? &o->f[o->n] : &tmp;
        p = rd_str(ws(p), f->key, sizeof f->key);
        if (!p) return -1;
        p = ws(p);
        if (*p++ != ':') return -1;
        p = rd_val(ws(p), f);
        if (!p) return -1;
        if (f != &tmp) o->n++;
        p = ws(p);
        if (*p == ',') {
            p++;
            continue;
        }
        if (*p == '}') return *ws(p + 1) ? -1 : 0;
        return -1;
    }
}

const dg_jl_field *dg_jl_get(const dg_jl_obj *o, const char *key) {
    for (int i = 0; i < o->n; i++)
        if (!strcmp(o->f[i].key, key)) return &o->f[i];
    return NULL;
}
