/* json_tree.c — a small JSON (RFC 8259) reader into a tree, for safetensors headers and Hugging Face
 * config.json (nested objects and arrays, which dg_json_read.h's flat line reader does not take). */
#include <stdlib.h>
#include <string.h>

#include "model_io_impl.h"

typedef struct {
    const char *p, *end;
    int depth;
} jp_t;

static void ws(jp_t *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
}

static int lit(jp_t *j, const char *s) {
    size_t n = strlen(s);
    if ((size_t)(j->end - j->p) < n || memcmp(j->p, s, n) != 0) return -1;
    j->p += n;
    return 0;
}

/* Appends the UTF-8 form of code point c. */
static void put_utf8(char *o, size_t *k, unsigned c) {
    if (c < 0x80) {
        o[(*k)++] = (char)c;
    } else if (c < 0x800) {
        o[(*k)++] = (char)(0xC0 | (c >> 6));
        o[(*k)++] = (char)(0x80 | (c & 0x3F));
    } else {
        o[(*k)++] = (char)(0xE0 | (c >> 12));
        o[(*k)++] = (char)(0x80 | ((c >> 6) & 0x3F));
        o[(*k)++] = (char)(0x80 | (c & 0x3F));
    }
}

static int parse_string(jp_t *j, char **out) {
    if (j->p >= j->end || *j->p != '"') return -1;
    j->p++;
    const char *s = j->p;
    while (j->p < j->end && *j->p != '"') {
        if (*j->p == '\\') j->p++;
        j->p++;
    }
    if (j->p >= j->end) return -1;
    size_t n = (size_t)(j->p - s);
    char *o = dg_xmalloc(n + 1);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '\\') {
            o[k++] = s[i];
            continue;
        }
        char c = s[++i];
        const char *esc = "\"\\/bfnrt", *val = "\"\\/\b\f\n\r\t";
        const char *e = strchr(esc, c);
        if (c && e) {
            o[k++] = val[e - esc];
        } else if (c == 'u' && i + 4 < n) {
            char hex[5] = {s[i + 1], s[i + 2], s[i + 3], s[i + 4], 0};
            char *endp;
            unsigned cp = (unsigned)strtoul(hex, &endp, 16);
            if (*endp) {
                free(o);
                return -1;
            }
            put_utf8(o, &k, cp); /* surrogate pairs stay two 3-byte sequences: names here are ASCII */
            i += 4;
        } else {
            free(o);
            return -1;
        }
    }
    o[k] = 0;
    j->p++;
    *out = o;
    return 0;
}

static int parse_value(jp_t *j, dg_jt_t *v);

static void add_item(dg_jt_t *v, char *key, const dg_jt_t *item) {
    v->items = realloc(v->items, (size_t)(v->n + 1) * sizeof *v->items);
    v->keys = realloc(v->keys, (size_t)(v->n + 1) * sizeof *v->keys);
    DG_ASSERTF(v->items && v->keys, "out of memory");
    v->items[v->n] = *item;
    v->keys[v->n] = key;
    v->n++;
}

static int parse_container(jp_t *j, dg_jt_t *v, int is_obj) {
    v->type = is_obj ? DG_JT_OBJ : DG_JT_ARR;
    j->p++;
    ws(j);
    if (j->p < j->end && *j->p == (is_obj ? '}' : ']')) {
        j->p++;
        return 0;
    }
    for (;;) {
        char *key = NULL;
        ws(j);
        if (is_obj) {
            if (parse_string(j, &key)) return -1;
            ws(j);
            if (j->p >= j->end || *j->p != ':') {
                free(key);
                return -1;
            }
            j->p++;
        }
        dg_jt_t item = {0};
        if (parse_value(j, &item)) {
            free(key);
            dg_jt_free(&item);
            return -1;
        }
        add_item(v, key, &item);
        ws(j);
        if (j->p < j->end && *j->p == ',') {
            j->p++;
            continue;
        }
        if (j->p < j->end && *j->p == (is_obj ? '}' : ']')) {
            j->p++;
            return 0;
        }
        return -1;
    }
}

static int parse_value(jp_t *j, dg_jt_t *v) {
    ws(j);
    if (j->p >= j->end || ++j->depth > 64) return -1;
    int r = 0;
    char c = *j->p;
    if (c == '{' || c == '[') {
        r = parse_container(j, v, c == '{');
    } else if (c == '"') {
        v->type = DG_JT_STR;
        r = parse_string(j, &v->str);
    } else if (c == 't' || c == 'f') {
        v->type = DG_JT_BOOL;
        v->num = c == 't';
        r = lit(j, c == 't' ? "true" : "false");
    } else if (c == 'n') {
        v->type = DG_JT_NULL;
        r = lit(j, "null");
    } else {
        char buf[64];
        size_t n = 0;
        while (j->p + n < j->end && n < sizeof buf - 1 && strchr("+-0123456789.eE", j->p[n]))
            n++;
        memcpy(buf, j->p, n);
        buf[n] = 0;
        char *endp;
        v->type = DG_JT_NUM;
        v->num = strtod(buf, &endp);
        r = (n == 0 || *endp) ? -1 : 0;
        j->p += n;
    }
    j->depth--;
    return r;
}

int dg_jt_parse(const char *text, size_t len, dg_jt_t *out) {
    memset(out, 0, sizeof *out);
    jp_t j = {text, text + len, 0};
    if (parse_value(&j, out)) {
        dg_jt_free(out);
        return -1;
    }
    ws(&j);
    if (j.p != j.end) {
        dg_jt_free(out);
        return -1;
    }
    return 0;
}

void dg_jt_free(dg_jt_t *v) {
    for (int i = 0; i < v->n; i++) {
        dg_jt_free(&v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
    free(v->str);
    memset(v, 0, sizeof *v);
}

const dg_jt_t *dg_jt_get(const dg_jt_t *obj, const char *key) {
    if (!obj || obj->type != DG_JT_OBJ) return NULL;
    for (int i = 0; i < obj->n; i++)
        if (!strcmp(obj->keys[i], key)) return &obj->items[i];
    return NULL;
}
