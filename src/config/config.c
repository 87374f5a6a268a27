/* config.c — loading the dgtrain configuration: schema defaults, then an INI file parsed by libinih,
 * then `--set section.key=value` overrides; per-key type/range checks from the schema table, cross-key
 * checks, and the printers (--print-config, --help, INI text, hash).
 *
 * libinih does the INI syntax. Debian builds it without INI_HANDLER_LINENO, so we feed it through
 * ini_parse_stream() with our own reader: the reader is called once per physical line, which gives us
 * the line number for messages. The reader also
 *   - strips leading whitespace, so an indented line is never glued to the previous value (inih's
 *     multi-line continuation would otherwise turn a stray indent into a silent value change);
 *   - checks "[section]" headers when it sees them, so an unknown section is reported even with no keys;
 *   - hands over lines longer than inih's fixed buffer (200 bytes in Debian's build) as "name=<mark>" and
 *     keeps the real value aside, so long paths work and nothing is silently truncated.
 * Value syntax on top of inih: surrounding double quotes are removed; an unquoted value ends at
 * whitespace followed by '#' or ';' (inih itself cuts at whitespace + ';', even inside quotes).
 */
#define _GNU_SOURCE
#include "config_impl.h"
#include "dg_mesh.h"
#include "dg_fs.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <ini.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#define LONG_MARK "\x01"
#define MAX_FILE_BYTES (16u << 20)

/* ---------------------------------------------------------------- small text helpers */

static void *field_ptr(dg_config_t *cfg, int i) {
    return (char *)cfg + dg_cfg_schema[i].offset;
}
static const void *field_cptr(const dg_config_t *cfg, int i) {
    return (const char *)cfg + dg_cfg_schema[i].offset;
}

/* A value or line as it may appear inside a one-line message: control bytes shown as '?', long text
 * shortened with "...". */
static void show(char *out, size_t cap, const char *s, size_t max) {
    size_t n = 0, i = 0;
    for (; s[i] && n + 1 < cap && i < max; i++)
        out[n++] = (unsigned char)s[i] < 0x20 || s[i] == 0x7f ? '?' : s[i];
    if (s[i] && cap > 4) {
        if (n > cap - 4) n = cap - 4;
        memcpy(out + n, "...", 3);
        n += 3;
    }
    out[n] = 0;
}

static char *trim(char *s) {
    while (*s && isspace((unsigned char)*s))
        s++;
    size_t n = strlen(s);
    while (n && isspace((unsigned char)s[n - 1]))
        s[--n] = 0;
    return s;
}

static int close_enough(int dist, const char *typed) {
    return dist <= 1 + (int)strlen(typed) / 4;
}

/* Best schema key for a mistyped key in `section` (which may itself be unknown): same-section keys win
 * ties. Returns the schema index or -1. */
static int suggest_key(const char *section, const char *key) {
    int best = -1, best_score = 1000;
    for (int i = 0; i < dg_cfg_nkeys; i++) {
        int score = dg_edit_distance(key, dg_cfg_schema[i].key) * 2 +
                    (strcmp(dg_cfg_schema[i].section, section) != 0);
        if (score < best_score) {
            best_score = score;
            best = i;
        }
    }
    if (best < 0 || !close_enough(best_score / 2, key)) return -1;
    return best;
}

static int suggest_section(const char *section) {
    int best = -1, best_d = 1000;
    for (int i = 0; i < dg_cfg_nsections; i++) {
        int d = dg_edit_distance(section, dg_cfg_sections[i]);
        if (d < best_d) {
            best_d = d;
            best = i;
        }
    }
    return best >= 0 && close_enough(best_d, section) ? best : -1;
}

static int known_section(const char *s) {
    for (int i = 0; i < dg_cfg_nsections; i++)
        if (strcmp(dg_cfg_sections[i], s) == 0) return 1;
    return 0;
}

static dg_status_t err_unknown_section(const char *where, const char *section) {
    char sh[80];
    show(sh, sizeof sh, section, 60);
    int s = suggest_section(section);
    if (s >= 0)
        return DG_ERR(DG_ERR_USAGE, "%s: unknown section [%s]; did you mean [%s]?", where, sh,
                      dg_cfg_sections[s]);
    return DG_ERR(DG_ERR_USAGE,
                  "%s: unknown section [%s]; expected one of [run] [model] [data] [train] [parallel] "
                  "[checkpoint] [health] [topology]",
                  where, sh);
}

static dg_status_t err_unknown_key(const char *where, const char *section, const char *key) {
    char sk[80], ss[80];
    show(sk, sizeof sk, key, 60);
    show(ss, sizeof ss, section, 60);
    int k = suggest_key(section, key);
    if (k >= 0)
        return DG_ERR(DG_ERR_USAGE, "%s: unknown key '%s.%s'; did you mean '%s.%s'?", where, ss, sk,
                      dg_cfg_schema[k].section, dg_cfg_schema[k].key);
    return DG_ERR(DG_ERR_USAGE, "%s: unknown key '%s.%s' (dgtrain --help lists the keys)", where, ss, sk);
}

/* ---------------------------------------------------------------- values */

static void fmt_double(char *buf, size_t cap, double v) {
    /* whole numbers as integers; otherwise the shortest text that reads back to the same double:
     * stable, readable, and hash-friendly */
    DG_ASSERT(buf && cap > 0); /* also tells GCC's format checker, which otherwise sees a NULL path */
    if (v == floor(v) && fabs(v) < 1e15) {
        snprintf(buf, cap, "%.0f", v);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) return;
    }
}

/* What values a key takes, for messages and --help ("an integer >= 1", "one of fp32|bf16|fp16"). */
static void expectation(int i, char *buf, size_t cap) {
    const dg_cfg_key_t *k = &dg_cfg_schema[i];
    char lo[40], hi[40];
    switch (k->type) {
    case DG_CFGT_INT:
        if (k->imax == INT64_MAX)
            snprintf(buf, cap, "an integer >= %lld", (long long)k->imin);
        else
            snprintf(buf, cap, "an integer in %lld..%lld", (long long)k->imin, (long long)k->imax);
        return;
    case DG_CFGT_FLOAT:
        fmt_double(lo, sizeof lo, k->fmin);
        fmt_double(hi, sizeof hi, k->fmax);
        if (k->fmin_excl)
            snprintf(buf, cap, "a number > %s and <= %s", lo, hi);
        else
            snprintf(buf, cap, "a number in %s..%s", lo, hi);
        return;
    case DG_CFGT_BOOL:
        snprintf(buf, cap, "a boolean (true|false|yes|no|on|off|1|0)");
        return;
    case DG_CFGT_ENUM:
        snprintf(buf, cap, "one of %s", k->choices);
        return;
    case DG_CFGT_STR:
        snprintf(buf, cap, "text of at most %zu characters", k->size - 1);
        return;
    }
}

/* Index of v among the "a|b|c" choices, or -1. */
static int enum_index(const char *choices, const char *v) {
    size_t n = strlen(v);
    int idx = 0;
    for (const char *p = choices; *p; idx++) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && strncmp(p, v, n) == 0) return idx;
        if (!bar) break;
        p = bar + 1;
    }
    return -1;
}

/* Parse `v` for key i into `dst` (the field, or scratch of the same size). On failure writes the
 * problem (without key or location) into why. */
static int parse_value(int i, const char *v, void *dst, char *why, size_t cap) {
    const dg_cfg_key_t *k = &dg_cfg_schema[i];
    char exp[128], sh[80];
    expectation(i, exp, sizeof exp);
    show(sh, sizeof sh, v, 60);
    switch (k->type) {
    case DG_CFGT_INT: {
        char *end = NULL;
        errno = 0;
        long long x = strtoll(v, &end, 10);
        if (!*v || *end || isspace((unsigned char)*v)) {
            snprintf(why, cap, "expected an integer, got '%s'", sh);
            return 1;
        }
        if (errno == ERANGE || x < k->imin || x > k->imax) {
            snprintf(why, cap, "out of range: expected %s, got '%s'", exp, sh);
            return 1;
        }
        *(int64_t *)dst = (int64_t)x;
        break;
    }
    case DG_CFGT_FLOAT: {
        char *end = NULL;
        errno = 0;
        double x = strtod(v, &end);
        if (!*v || *end || isspace((unsigned char)*v) || isnan(x)) {
            snprintf(why, cap, "expected a number, got '%s'", sh);
            return 1;
        }
        if (isinf(x) || x < k->fmin || x > k->fmax || (k->fmin_excl && x == k->fmin)) {
            snprintf(why, cap, "out of range: expected %s, got '%s'", exp, sh);
            return 1;
        }
        *(double *)dst = x;
        break;
    }
    case DG_CFGT_BOOL: {
        static const char *yes[] = {"true", "yes", "on", "1"}, *no[] = {"false", "no", "off", "0"};
        int b = -1;
        for (int j = 0; j < 4; j++) {
            if (strcasecmp(v, yes[j]) == 0) b = 1;
            if (strcasecmp(v, no[j]) == 0) b = 0;
        }
        if (b < 0) {
            snprintf(why, cap, "expected %s, got '%s'", exp, sh);
            return 1;
        }
        *(int *)dst = b;
        break;
    }
    case DG_CFGT_ENUM:
        int idx = enum_index(k->choices, v);
        if (idx < 0) {
            snprintf(why, cap, "expected %s, got '%s'", exp, sh);
            return 1;
        }
        strcpy(dst, v); /* choices are shorter than the field (checked by the schema test) */
        break;
    case DG_CFGT_STR: {
        size_t n = strlen(v);
        if (n >= k->size) {
            snprintf(why, cap, "too long: expected at most %zu characters, got %zu", k->size - 1, n);
            return 1;
        }
        for (size_t j = 0; j < n; j++) {
            unsigned char c = (unsigned char)v[j];
            /* keep every value writable back as one INI line that reads the same */
            if (c < 0x20 || c == 0x7f || c == '"' ||
                (c == ';' && j > 0 && isspace((unsigned char)v[j - 1]))) {
                snprintf(why, cap, "expected text without control characters, '\"' or ' ;', got '%s'", sh);
                return 1;
            }
        }
        memcpy(dst, v, n + 1);
        break;
    }
    }
    if (k->check && k->check(v, why, cap)) return 1;
    return 0;
}

/* Set key i from its (already unquoted) text; on failure the message names where, the key, the value
 * and what was expected. */
static dg_status_t set_key(dg_config_t *cfg, int i, const char *v, const char *where, const char *source) {
    char why[512];
    /* parse into scratch first: a failed set leaves the field as it was */
    union {
        int64_t i;
        double d;
        int b;
        char s[DG_CFG_STR + 8];
    } scratch;
    DG_ASSERT(dg_cfg_schema[i].size <= sizeof scratch.s);
    if (parse_value(i, v, &scratch, why, sizeof why))
        return DG_ERR(DG_ERR_USAGE, "%s: %s.%s: %s", where, dg_cfg_schema[i].section, dg_cfg_schema[i].key,
                      why);
    int is_text = dg_cfg_schema[i].type == DG_CFGT_STR || dg_cfg_schema[i].type == DG_CFGT_ENUM;
    memset(field_ptr(cfg, i), 0, dg_cfg_schema[i].size);
    memcpy(field_ptr(cfg, i), &scratch, is_text ? strlen(scratch.s) + 1 : dg_cfg_schema[i].size);
    snprintf(cfg->source[i], sizeof cfg->source[i], "%s", source);
    return DG_OK;
}

/* Remove surrounding quotes. Returns 0, or 1 with why filled for an unterminated quote. For file
 * values an unquoted value also ends at whitespace + '#' (a comment); after a closing quote only a
 * comment may follow. */
static int unquote(char *v, int file_syntax, char **out, char *why, size_t cap) {
    v = trim(v);
    if (*v == '"') {
        char *close = strchr(v + 1, '"');
        if (!close) {
            snprintf(why, cap, "expected a closing '\"'");
            return 1;
        }
        char *rest = close + 1;
        while (*rest && isspace((unsigned char)*rest))
            rest++;
        if (*rest && !(file_syntax && rest > close + 1 && *rest == '#')) {
            char sh[80];
            show(sh, sizeof sh, rest, 40);
            snprintf(why, cap, "expected nothing after the closing '\"', got '%s'", sh);
            return 1;
        }
        *close = 0;
        *out = v + 1;
        return 0;
    }
    if (file_syntax && *v)
        for (char *p = v + 1; *p; p++)
            if ((*p == '#' || *p == ';') && isspace((unsigned char)p[-1])) {
                *p = 0;
                v = trim(v);
                break;
            }
    *out = v;
    return 0;
}

/* ---------------------------------------------------------------- INI parsing through libinih */

typedef struct {
    dg_config_t *cfg;
    const char *name; /* what messages call the file */
    const char *text;
    size_t len, pos;
    int lineno;
    dg_status_t err; /* first error; parsing stops there */
    int err_line;
    int set_line[DG_CFG_MAX_KEYS]; /* line that set each key (duplicate detection) */
    char *long_value;              /* value of an over-long line, handed to inih as LONG_MARK */
} parse_state_t;

static void nth_line(const char *text, size_t len, int line, char *out, size_t cap);

static void where_line(char *buf, size_t cap, const char *name, int line) {
    snprintf(buf, cap, "%s:%d", name, line);
}

static void source_line(char *buf, size_t cap, const char *name, int line) {
    char num[24];
    snprintf(num, sizeof num, ":%d", line);
    size_t nl = strlen(name), ml = strlen(num);
    DG_ASSERT(cap > ml + 8);
    size_t keep = nl + ml + 1 <= cap ? nl : cap - 4 - ml; /* a long path keeps its informative end */
    size_t o = 0;
    if (keep < nl) {
        memcpy(buf, "...", 3);
        o = 3;
    }
    memcpy(buf + o, name + nl - keep, keep);
    memcpy(buf + o + keep, num, ml + 1);
}

static void fail(parse_state_t *st, dg_status_t s) {
    if (!st->err) {
        st->err = s;
        st->err_line = st->lineno;
    }
}

static char *reader(char *str, int num, void *stream) {
    parse_state_t *st = stream;
    free(st->long_value); /* a mark only ever refers to the line just handed over */
    st->long_value = NULL;
    if (st->err || st->pos >= st->len || num < 16) return NULL;
    const char *line;
    size_t n = dg_text_line(st->text, st->len, &st->pos, &line);
    st->lineno++;
    char where[DG_CFG_STR + 32];
    where_line(where, sizeof where, st->name, st->lineno);

    if (n && line[0] == '[') {
        const char *close = memchr(line, ']', n);
        if (close) {
            char sec[256];
            size_t sl = (size_t)(close - line - 1);
            if (sl >= sizeof sec) sl = sizeof sec - 1;
            memcpy(sec, line + 1, sl);
            sec[sl] = 0;
            char *t = trim(sec);
            if (!known_section(t)) {
                fail(st, err_unknown_section(where, t));
                return NULL;
            }
        }
    }
    if (n + 2 <= (size_t)num) {
        memcpy(str, line, n);
        str[n] = '\n';
        str[n + 1] = 0;
        return str;
    }
    /* longer than inih's buffer */
    if (line[0] == ';' || line[0] == '#') {
        strcpy(str, "#\n");
        return str;
    }
    const char *sep = NULL;
    for (size_t j = 0; j < n; j++)
        if (line[j] == '=' || line[j] == ':') {
            sep = line + j;
            break;
        }
    if (line[0] != '[' && sep && (size_t)(sep - line) + 4 <= (size_t)num) {
        size_t kl = (size_t)(sep - line);
        memcpy(str, line, kl);
        memcpy(str + kl, "=" LONG_MARK "\n", 4);
        st->long_value = dg_xmalloc(n - kl);
        memcpy(st->long_value, sep + 1, n - kl - 1);
        st->long_value[n - kl - 1] = 0;
        return str;
    }
    char sh[80], lt[DG_CFG_STR + 32];
    snprintf(lt, sizeof lt, "%.*s", (int)(n < 60 ? n : 60), line);
    show(sh, sizeof sh, lt, 50);
    fail(st,
         DG_ERR(DG_ERR_USAGE, "%s: malformed line '%s': expected '[section]' or 'key = value'", where, sh));
    return NULL;
}

static int on_key(void *user, const char *section_raw, const char *name, const char *value_raw) {
    parse_state_t *st = user;
    if (st->err) return 0;
    char where[DG_CFG_STR + 32];
    where_line(where, sizeof where, st->name, st->lineno);
    char section[256], key[256];
    snprintf(section, sizeof section, "%s", section_raw);
    snprintf(key, sizeof key, "%s", name);
    char *sec = trim(section), *k = trim(key);
    char *dot = !*sec ? strchr(k, '.') : NULL;
    if (dot && dot != k && dot[1]) { /* "section.key = value" outside a section: the --print-config form */
        *dot = 0;
        sec = k;
        k = dot + 1;
    }
    if (!*sec) {
        char sk[80];
        show(sk, sizeof sk, k, 60);
        fail(st, DG_ERR(DG_ERR_USAGE,
                        "%s: key '%s' is outside any [section]; expected a [section] line first", where, sk));
        return 0;
    }
    if (!known_section(sec)) { /* normally caught on the header line by the reader */
        fail(st, err_unknown_section(where, sec));
        return 0;
    }
    if (!*k) {
        char sh[96];
        nth_line(st->text, st->len, st->lineno, sh, sizeof sh);
        fail(st, DG_ERR(DG_ERR_USAGE, "%s: malformed line '%s': expected '[section]' or 'key = value'", where,
                        sh));
        return 0;
    }
    int i = dg_cfg_find(sec, k);
    if (i < 0) {
        fail(st, err_unknown_key(where, sec, k));
        return 0;
    }
    if (st->set_line[i]) {
        fail(st, DG_ERR(DG_ERR_USAGE, "%s: duplicate key %s.%s (first set at line %d)", where, sec, k,
                        st->set_line[i]));
        return 0;
    }
    st->set_line[i] = st->lineno;

    char *vbuf;
    if (strcmp(value_raw, LONG_MARK) == 0 && st->long_value) {
        vbuf = st->long_value;
        st->long_value = NULL;
        /* inih cuts short values at whitespace + ';'; do the same for a long one */
        for (char *p = vbuf; *p && p[1]; p++)
            if (p[1] == ';' && isspace((unsigned char)p[0])) {
                p[1] = 0;
                break;
            }
    } else {
        vbuf = dg_xstrdup(value_raw);
    }
    char why[256], *v = NULL;
    if (unquote(vbuf, 1, &v, why, sizeof why)) {
        fail(st, DG_ERR(DG_ERR_USAGE, "%s: %s.%s: %s", where, sec, k, why));
        free(vbuf);
        return 0;
    }
    char src[96];
    source_line(src, sizeof src, st->name, st->lineno);
    dg_status_t s = set_key(st->cfg, i, v, where, src);
    free(vbuf);
    if (s) {
        fail(st, s);
        return 0;
    }
    return 1;
}

/* The text of line `line` (1-based) of the buffer, for the malformed-line message. */
static void nth_line(const char *text, size_t len, int line, char *out, size_t cap) {
    size_t pos = 0;
    for (int l = 1; l < line && pos < len; l++) {
        const char *nl = memchr(text + pos, '\n', len - pos);
        if (!nl) {
            pos = len;
            break;
        }
        pos = (size_t)(nl - text) + 1;
    }
    const char *nl = pos < len ? memchr(text + pos, '\n', len - pos) : NULL;
    size_t n = pos < len ? (nl ? (size_t)(nl - text) - pos : len - pos) : 0;
    char tmp[256];
    if (n >= sizeof tmp) n = sizeof tmp - 1;
    memcpy(tmp, text + pos, n);
    tmp[n] = 0;
    show(out, cap, trim(tmp), 60);
}

static dg_status_t parse_text(dg_config_t *cfg, const char *name, const char *text, size_t len) {
    parse_state_t st = {.cfg = cfg, .name = name, .text = text, .len = len};
    const char *nul = memchr(text, 0, len);
    if (nul) {
        int line = 1;
        for (const char *p = text; p < nul; p++)
            line += *p == '\n';
        return DG_ERR(DG_ERR_USAGE, "%s:%d: contains a NUL byte: expected a text (INI) file", name, line);
    }
    int rc = ini_parse_stream(reader, &st, on_key, &st);
    free(st.long_value);
    /* inih reports the first line it rejected; ours may be a later one (it keeps going after a
     * malformed line), so the earlier of the two is the first error in the file */
    if (rc > 0 && (!st.err || rc < st.err_line)) {
        char sh[96];
        nth_line(text, len, rc, sh, sizeof sh);
        return DG_ERR(DG_ERR_USAGE, "%s:%d: malformed line '%s': expected '[section]' or 'key = value'", name,
                      rc, sh);
    }
    if (st.err) return st.err;
    if (rc < 0) return DG_ERR(DG_ERR_RUNTIME, "%s: libinih failed (%d)", name, rc);
    return DG_OK;
}

/* ---------------------------------------------------------------- public API */

/* The enum id of every enumerated key that has one, from its (already checked) text. */
static void set_ids(dg_config_t *cfg) {
    for (int i = 0; i < dg_cfg_nkeys; i++) {
        const dg_cfg_key_t *k = &dg_cfg_schema[i];
        if (k->type != DG_CFGT_ENUM || !k->has_id) continue;
        int idx = enum_index(k->choices, (const char *)cfg + k->offset);
        DG_ASSERT(idx >= 0);
        *(int *)((char *)cfg + k->id_offset) = idx;
    }
}

void dg_config_defaults(dg_config_t *cfg) {
    memset(cfg, 0, sizeof *cfg);
    for (int i = 0; i < dg_cfg_nkeys; i++) {
        char why[256];
        int bad = parse_value(i, dg_cfg_schema[i].def, field_ptr(cfg, i), why, sizeof why);
        DG_ASSERTF(!bad, "schema default of %s.%s is invalid: %s", dg_cfg_schema[i].section,
                   dg_cfg_schema[i].key, why);
        snprintf(cfg->source[i], sizeof cfg->source[i], "default");
    }
    set_ids(cfg);
}

dg_status_t dg_config_set(dg_config_t *cfg, const char *name, const char *value, const char *source) {
    int i = dg_cfg_find_dotted(name);
    if (i < 0) {
        const char *dot = strchr(name, '.');
        char sec[256];
        snprintf(sec, sizeof sec, "%.*s", dot ? (int)(dot - name) : 0, name);
        char sn[80];
        show(sn, sizeof sn, name, 60);
        if (!dot) return DG_ERR(DG_ERR_USAGE, "%s: expected section.key, got '%s'", source, sn);
        if (!known_section(sec)) return err_unknown_section(source, sec);
        return err_unknown_key(source, sec, dot + 1);
    }
    char *buf = dg_xstrdup(value), *v = NULL, why[256];
    dg_status_t s = DG_OK;
    if (unquote(buf, 0, &v, why, sizeof why))
        s = DG_ERR(DG_ERR_USAGE, "%s: %s: %s", source, name, why);
    else
        s = set_key(cfg, i, v, source, source);
    free(buf);
    if (s == DG_OK) set_ids(cfg);
    return s;
}

static dg_status_t apply_set(dg_config_t *cfg, const char *arg) {
    char where[160], sh[120];
    show(sh, sizeof sh, arg, 100);
    snprintf(where, sizeof where, "--set '%s'", sh);
    const char *eq = strchr(arg, '=');
    const char *dot = strchr(arg, '.');
    if (!eq || !dot || dot > eq || dot == arg || dot + 1 == eq) {
        /* `--set steps=10`: suggest the full name when the key alone is unambiguous */
        if (eq && !dot) {
            char key[128];
            snprintf(key, sizeof key, "%.*s", (int)(eq - arg < 127 ? eq - arg : 127), arg);
            int hit = -1, n = 0;
            for (int i = 0; i < dg_cfg_nkeys; i++)
                if (strcmp(dg_cfg_schema[i].key, trim(key)) == 0) hit = i, n++;
            char sv[80];
            show(sv, sizeof sv, eq, 60);
            if (n == 1)
                return DG_ERR(DG_ERR_USAGE, "%s: expected section.key=value; did you mean '%s.%s%s'?", where,
                              dg_cfg_schema[hit].section, dg_cfg_schema[hit].key, sv);
        }
        return DG_ERR(DG_ERR_USAGE, "%s: expected section.key=value", where);
    }
    char name[256];
    size_t nl = (size_t)(eq - arg);
    if (nl >= sizeof name) nl = sizeof name - 1;
    memcpy(name, arg, nl);
    name[nl] = 0;
    char *d = strchr(name, '.');
    if (!d) return DG_ERR(DG_ERR_USAGE, "%s: expected section.key=value", where);
    *d = 0;
    char *sec = trim(name), *key = trim(d + 1);
    int i = dg_cfg_find(sec, key);
    if (i < 0) {
        if (!known_section(sec)) return err_unknown_section(where, sec);
        return err_unknown_key(where, sec, key);
    }
    char *buf = dg_xstrdup(eq + 1), *v = NULL, why[256];
    dg_status_t s = DG_OK;
    if (unquote(buf, 0, &v, why, sizeof why))
        s = DG_ERR(DG_ERR_USAGE, "%s: %s.%s: %s", where, dg_cfg_schema[i].section, dg_cfg_schema[i].key, why);
    else
        s = set_key(cfg, i, v, where, "--set");
    free(buf);
    return s;
}

dg_status_t dg_config_load_buffer(dg_config_t *cfg, const char *name, const char *text, size_t len, int nsets,
                                  const char *const *sets) {
    dg_config_defaults(cfg);
    if (text) {
        snprintf(cfg->path, sizeof cfg->path, "%s", name ? name : "<config>");
        DG_TRY(parse_text(cfg, name ? name : "<config>", text, len));
    }
    for (int j = 0; j < nsets; j++)
        DG_TRY(apply_set(cfg, sets[j]));
    set_ids(cfg);
    return dg_config_validate(cfg);
}

dg_status_t dg_config_load(dg_config_t *cfg, const char *path, int nsets, const char *const *sets) {
    if (!path) return dg_config_load_buffer(cfg, NULL, NULL, 0, nsets, sets);
    char sp[DG_CFG_STR];
    show(sp, sizeof sp, path, 900);
    FILE *f = fopen(path, "rb");
    if (!f) return DG_ERR(DG_ERR_USAGE, "cannot open config file '%s': %s", sp, strerror(errno));
    struct stat stt;
    int e = fstat(fileno(f), &stt) != 0 ? errno : S_ISDIR(stt.st_mode) ? EISDIR : 0;
    if (e) {
        fclose(f);
        return DG_ERR(DG_ERR_USAGE, "cannot read config file '%s': %s", sp, strerror(e));
    }
    char *buf = NULL;
    size_t len = 0;
    e = dg_read_stream(f, MAX_FILE_BYTES - 1, &buf, &len);
    fclose(f);
    if (e == EFBIG)
        return DG_ERR(DG_ERR_USAGE,
                      "cannot read config file '%s': larger than %u MiB, expected a small INI file", sp,
                      MAX_FILE_BYTES >> 20);
    if (e) return DG_ERR(DG_ERR_USAGE, "cannot read config file '%s': %s", sp, strerror(e));
    dg_status_t s = dg_config_load_buffer(cfg, path, buf, len, nsets, sets);
    free(buf);
    if (s == DG_OK) snprintf(cfg->path, sizeof cfg->path, "%s", path);
    return s;
}

/* The pipeline keys against each other and an explicit mesh (docs/parallelism.md). What needs the
 * model's depth (pp <= n_layer, n_layer divisible by pp x pp_virtual) is checked here when n_layer is
 * given, else by the pipeline split when the preset is resolved (--plan-only, --dry-run). */
static dg_status_t validate_pipeline(const dg_config_t *cfg) {
#define SRC(k) dg_config_source(cfg, k)
    const int interleaved = cfg->parallel.pp_schedule_id == 1;
    const long long v = (long long)cfg->parallel.pp_virtual;
    if (interleaved && v < 2)
        return DG_ERR(
            DG_ERR_USAGE,
            "parallel.pp_schedule = interleaved (%s) needs parallel.pp_virtual >= 2 (it is %lld, %s): "
            "with one chunk per rank the schedule is 1f1b",
            SRC("parallel.pp_schedule"), v, SRC("parallel.pp_virtual"));
    if (!interleaved && v != 1)
        return DG_ERR(
            DG_ERR_USAGE,
            "parallel.pp_virtual = %lld (%s) needs parallel.pp_schedule = interleaved (it is %s, %s): "
            "1f1b has one stage per rank",
            v, SRC("parallel.pp_virtual"), cfg->parallel.pp_schedule, SRC("parallel.pp_schedule"));
    dg_mesh_shape_t m;
    int is_auto = 0;
    if (dg_mesh_parse(cfg->parallel.mesh, 0, &m, &is_auto) != DG_OK || is_auto) {
        dg_clear_error();
        return DG_OK; /* auto: the planner picks pp and derives the micro-batches */
    }
    const int pp = dg_mesh_pp(&m);
    if (pp == 1) {
        if (interleaved)
            return DG_ERR(
                DG_ERR_USAGE,
                "parallel.pp_schedule = interleaved (%s) needs pipeline stages: parallel.mesh = %s (%s) "
                "has pp=1",
                SRC("parallel.pp_schedule"), cfg->parallel.mesh, SRC("parallel.mesh"));
        if (cfg->parallel.pp_microbatches > 0)
            return DG_ERR(
                DG_ERR_USAGE,
                "parallel.pp_microbatches = %lld (%s) needs pipeline stages: parallel.mesh = %s (%s) "
                "has pp=1",
                (long long)cfg->parallel.pp_microbatches, SRC("parallel.pp_microbatches"), cfg->parallel.mesh,
                SRC("parallel.mesh"));
        return DG_OK;
    }
    const long long dp = (long long)m.size[0] * m.size[1], mb = (long long)cfg->train.micro_batch;
    const long long gb = (long long)cfg->train.global_batch;
    if (gb % (mb * dp) != 0)
        return DG_ERR(DG_ERR_USAGE,
                      "train.global_batch = %lld (%s) is not a multiple of train.micro_batch (%lld) x "
                      "data-parallel ranks of parallel.mesh = %s (%lld)",
                      gb, SRC("train.global_batch"), mb, cfg->parallel.mesh, dp);
    long long q = gb / (mb * dp), want = cfg->parallel.pp_microbatches;
    if (want > 0 && want != q)
        return DG_ERR(
            DG_ERR_USAGE,
            "parallel.pp_microbatches = %lld (%s) but train.global_batch / (train.micro_batch x "
            "data-parallel ranks) = %lld / (%lld x %lld) = %lld: expected global_batch = micro_batch x "
            "dp x pp_microbatches",
            want, SRC("parallel.pp_microbatches"), gb, mb, dp, q);
    if (q < pp)
        return DG_ERR(
            DG_ERR_USAGE,
            "parallel.mesh = %s (%s) has pp=%d stages but a step has only %lld micro-batches per "
            "pipeline (train.global_batch %lld / (micro_batch %lld x dp %lld)): expected at least pp "
            "micro-batches (raise train.global_batch or lower train.micro_batch)",
            cfg->parallel.mesh, SRC("parallel.mesh"), pp, q, gb, mb, dp);
    const long long L = (long long)cfg->model.n_layer;
    if (L > 0 && L < pp)
        return DG_ERR(
            DG_ERR_USAGE,
            "parallel.mesh = %s (%s) has pp=%d stages but model.n_layer = %lld (%s): every stage needs "
            "at least one block",
            cfg->parallel.mesh, SRC("parallel.mesh"), pp, L, SRC("model.n_layer"));
    if (L > 0 && interleaved && L % (pp * v) != 0)
        return DG_ERR(DG_ERR_USAGE,
                      "parallel.pp_schedule = interleaved needs model.n_layer = %lld (%s) divisible by pp x "
                      "pp_virtual = %d x %lld = %lld",
                      L, SRC("model.n_layer"), pp, v, pp * v);
#undef SRC
    return DG_OK;
}

/* cross-key checks: each message names both keys with their values and sources */
dg_status_t dg_config_validate(const dg_config_t *cfg) {
#define SRC(k) dg_config_source(cfg, k)
    if (cfg->train.global_batch % cfg->train.micro_batch != 0)
        return DG_ERR(
            DG_ERR_USAGE,
            "train.global_batch = %lld (%s) is not a multiple of train.micro_batch = %lld (%s): expected "
            "global_batch = micro_batch x data-parallel ranks x accumulation steps",
            (long long)cfg->train.global_batch, SRC("train.global_batch"), (long long)cfg->train.micro_batch,
            SRC("train.micro_batch"));
    if (cfg->model.n_head > 0 && cfg->model.d_model > 0 && cfg->model.d_model % cfg->model.n_head != 0)
        return DG_ERR(DG_ERR_USAGE, "model.d_model = %lld (%s) is not divisible by model.n_head = %lld (%s)",
                      (long long)cfg->model.d_model, SRC("model.d_model"), (long long)cfg->model.n_head,
                      SRC("model.n_head"));
    if (strcmp(cfg->model.preset, "custom") == 0) {
        static const char *sizes[] = {"model.n_layer", "model.n_head", "model.d_model", "model.seq_len",
                                      "model.vocab_size"};
        const int64_t vals[] = {cfg->model.n_layer, cfg->model.n_head, cfg->model.d_model, cfg->model.seq_len,
                                cfg->model.vocab_size};
        for (int j = 0; j < 5; j++)
            if (vals[j] <= 0)
                return DG_ERR(DG_ERR_USAGE, "model.preset = custom (%s) needs %s > 0 (it is %lld)",
                              SRC("model.preset"), sizes[j], (long long)vals[j]);
    }
    if (!(cfg->health.timeout_s > cfg->health.heartbeat_s)) {
        char a[40], b[40];
        fmt_double(a, sizeof a, cfg->health.timeout_s);
        fmt_double(b, sizeof b, cfg->health.heartbeat_s);
        return DG_ERR(DG_ERR_USAGE,
                      "health.timeout_s = %s (%s) must be larger than health.heartbeat_s = %s (%s)", a,
                      SRC("health.timeout_s"), b, SRC("health.heartbeat_s"));
    }
    if (cfg->train.loss_scale_window_min > cfg->train.loss_scale_window_max)
        return DG_ERR(DG_ERR_USAGE,
                      "train.loss_scale_window_min = %lld (%s) is larger than train.loss_scale_window_max = "
                      "%lld (%s): expected min <= max",
                      (long long)cfg->train.loss_scale_window_min, SRC("train.loss_scale_window_min"),
                      (long long)cfg->train.loss_scale_window_max, SRC("train.loss_scale_window_max"));
    if (strcmp(cfg->parallel.comm, "nccl") == 0 && strcmp(cfg->parallel.backend, "cpu") == 0)
        return DG_ERR(
            DG_ERR_USAGE,
            "parallel.comm = nccl (%s) needs GPU memory but parallel.backend = cpu (%s): expected comm = "
            "mpi or auto with the cpu backend",
            SRC("parallel.comm"), SRC("parallel.backend"));
    DG_TRY(validate_pipeline(cfg));
#undef SRC
    return DG_OK;
}

int dg_config_get(const dg_config_t *cfg, const char *name, char *buf, size_t cap) {
    int i = dg_cfg_find_dotted(name);
    if (i < 0) return -1;
    const void *p = field_cptr(cfg, i);
    switch (dg_cfg_schema[i].type) {
    case DG_CFGT_INT:
        snprintf(buf, cap, "%lld", (long long)*(const int64_t *)p);
        break;
    case DG_CFGT_FLOAT:
        fmt_double(buf, cap, *(const double *)p);
        break;
    case DG_CFGT_BOOL:
        snprintf(buf, cap, "%s", *(const int *)p ? "true" : "false");
        break;
    case DG_CFGT_STR:
    case DG_CFGT_ENUM:
        snprintf(buf, cap, "%s", (const char *)p);
        break;
    }
    return 0;
}

const char *dg_config_source(const dg_config_t *cfg, const char *name) {
    int i = dg_cfg_find_dotted(name);
    return i < 0 ? NULL : cfg->source[i];
}

/* "value" as written in INI text and --print-config: strings quoted so "" and spaces are visible. */
static void ini_value(const dg_config_t *cfg, int i, char *buf, size_t cap) {
    char name[128], v[DG_CFG_STR];
    snprintf(name, sizeof name, "%s.%s", dg_cfg_schema[i].section, dg_cfg_schema[i].key);
    dg_config_get(cfg, name, v, sizeof v);
    DG_ASSERT(cap >= sizeof v + 2);
    size_t n = strlen(v), q = dg_cfg_schema[i].type == DG_CFGT_STR;
    if (q) buf[0] = '"';
    memcpy(buf + q, v, n);
    if (q) buf[n + 1] = '"';
    buf[n + 2 * q] = 0;
}

void dg_config_print(const dg_config_t *cfg, FILE *out) {
    int width = 0;
    char v[DG_CFG_STR + 8], line[2 * DG_CFG_STR];
    for (int i = 0; i < dg_cfg_nkeys; i++) {
        ini_value(cfg, i, v, sizeof v);
        int w = snprintf(line, sizeof line, "%s.%s = %s", dg_cfg_schema[i].section, dg_cfg_schema[i].key, v);
        if (w > width && w <= 72) width = w;
    }
    for (int i = 0; i < dg_cfg_nkeys; i++) {
        ini_value(cfg, i, v, sizeof v);
        snprintf(line, sizeof line, "%s.%s = %s", dg_cfg_schema[i].section, dg_cfg_schema[i].key, v);
        fprintf(out, "%-*s  # %s\n", width, line, cfg->source[i]);
    }
}

dg_status_t dg_config_write_file(const dg_config_t *cfg, const char *path) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return DG_ERR(DG_ERR_RUNTIME, "config: cannot format %s: %s", path, strerror(errno));
    fprintf(f,
            "# dgtrain %s effective configuration (hash %016" PRIx64 "); every key with its final value and\n"
            "# its source. Reproduce the run with: dgtrain %s\n",
            DG_VERSION_STRING, dg_config_hash(cfg), path);
    dg_config_print(cfg, f);
    fclose(f);
    dg_status_t st = dg_write_file_atomic(path, text, len); /* temp + fsync + rename, no link followed */
    free(text);
    return st;
}

void dg_config_print_help(FILE *out) {
    const char *sec = "";
    char name[96], exp[160], def[DG_CFG_STR + 8];
    for (int i = 0; i < dg_cfg_nkeys; i++) {
        const dg_cfg_key_t *k = &dg_cfg_schema[i];
        if (strcmp(sec, k->section) != 0) {
            sec = k->section;
            fprintf(out, "\n[%s]\n", sec);
        }
        snprintf(name, sizeof name, "%s.%s", k->section, k->key);
        expectation(i, exp, sizeof exp);
        if (k->type == DG_CFGT_STR)
            snprintf(def, sizeof def, "\"%s\"", k->def);
        else
            snprintf(def, sizeof def, "%s", k->def);
        fprintf(out, "  %-40s %s\n      %s; default %s\n", name, k->doc, exp, def);
    }
}

char *dg_config_to_ini(const dg_config_t *cfg) {
    size_t cap = 16384, len = 0;
    char *buf = dg_xmalloc(cap), v[DG_CFG_STR + 8];
    const char *sec = "";
    for (int i = 0; i < dg_cfg_nkeys; i++) {
        const dg_cfg_key_t *k = &dg_cfg_schema[i];
        char line[DG_CFG_STR + 300];
        int n = 0;
        ini_value(cfg, i, v, sizeof v);
        if (strcmp(sec, k->section) != 0) {
            n += snprintf(line + n, sizeof line - (size_t)n, "%s[%s]\n", *sec ? "\n" : "", k->section);
            sec = k->section;
        }
        n += snprintf(line + n, sizeof line - (size_t)n, "%s = %s\n", k->key, v);
        while (len + (size_t)n + 1 > cap) {
            cap *= 2;
            char *nb = realloc(buf, cap);
            DG_ASSERTF(nb, "out of memory");
            buf = nb;
        }
        memcpy(buf + len, line, (size_t)n);
        len += (size_t)n;
    }
    buf[len] = 0;
    return buf;
}

uint64_t dg_config_hash(const dg_config_t *cfg) {
    char *ini = dg_config_to_ini(cfg);
    uint64_t h = XXH3_64bits(ini, strlen(ini));
    free(ini);
    return h;
}
