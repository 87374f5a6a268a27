/* dg_json.h — the one JSON string writer of dgtrain. Every JSON document or line the programs write
 * (metrics.jsonl, --dry-run/--topology/--plan-only --json, health events, dgvalidate's report, the
 * graph dump) quotes its strings through it, so every output is valid JSON (RFC 8259) encoded as valid
 * UTF-8 whatever bytes a path, host name or message holds.
 *
 * The rule (docs/reliability.md, "Configuration and command line"):
 *   - `"` and `\` are escaped as \" and \\;
 *   - \b \f \n \r \t use their short escapes, every other control byte (0x00-0x1F) and DEL (0x7F) is
 *     written as \u00XX;
 *   - a well-formed UTF-8 sequence (no overlong forms, no surrogates, nothing above U+10FFFF) is copied
 *     unchanged;
 *   - any other byte B >= 0x80 (not part of valid UTF-8) is written as \u00XX: the byte read as
 *     Latin-1, so a reader gets a valid string and can still recover the original byte value.
 */
#ifndef DG_JSON_H
#define DG_JSON_H

#include <stddef.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Writes the quoted, escaped JSON form of the NUL-terminated `s` (NULL counts as "") into out[cap]
 * like snprintf: always NUL-terminated when cap > 0, never cut inside an escape or a UTF-8 sequence
 * (a truncated result still ends with the closing quote when cap allows at least 2 bytes), and returns
 * the full length the quoted form needs (excluding the NUL), so a caller can size a buffer with
 * dg_json_quote(NULL, 0, s) + 1. */
size_t dg_json_quote(char *out, size_t cap, const char *s);

/* The quoted form, malloc'd (never NULL; asserts on out-of-memory). */
char *dg_json_quote_dup(const char *s);

/* Writes the quoted form to `f`. */
void dg_json_fputs(FILE *f, const char *s);

#ifdef __cplusplus
}
#endif
#endif /* DG_JSON_H */
