/* report.c — the results of a validation run and their three renderings: the table on stdout (check,
 * measured, reference, verdict, then one line per failure), validation.json (everything, including
 * each check's sweep or per-rank details) and validation-junit.xml (one testcase per check, for CI
 * dashboards and ReFrame-style pipelines). Files are replaced atomically, so a dashboard never reads a
 * half-written report, even when the suite rewrites them after every check.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "validate_impl.h"

const char *dg_verdict_name(dg_verdict_t v) {
    static const char *const names[] = {[DG_VERDICT_PASS] = "PASS",
                                        [DG_VERDICT_SKIP] = "SKIP",
                                        [DG_VERDICT_FAIL] = "FAIL",
                                        [DG_VERDICT_ERROR] = "ERROR"};
    return DG_ENUM_NAME(names, v, "?");
}

void dg_vreport_init(dg_vreport_t *r) {
    memset(r, 0, sizeof *r);
}

void dg_vreport_destroy(dg_vreport_t *r) {
    for (int i = 0; i < r->n; i++)
        free(r->checks[i].details);
    free(r->checks);
    memset(r, 0, sizeof *r);
}

dg_vcheck_t *dg_vreport_add(dg_vreport_t *r, const char *name) {
    if (r->n == r->cap) {
        int cap = r->cap ? 2 * r->cap : 32;
        dg_vcheck_t *c = realloc(r->checks, (size_t)cap * sizeof *c);
        DG_ASSERT(c != NULL);
        r->checks = c;
        r->cap = cap;
    }
    dg_vcheck_t *c = &r->checks[r->n++];
    memset(c, 0, sizeof *c);
    snprintf(c->name, sizeof c->name, "%s", name);
    snprintf(c->group, sizeof c->group, "%.*s", (int)strcspn(name, "."), name);
    c->verdict = DG_VERDICT_PASS;
    snprintf(c->measured, sizeof c->measured, "-");
    snprintf(c->reference, sizeof c->reference, "-");
    return c;
}

void dg_vcheck_set_details(dg_vcheck_t *c, const char *json) {
    free(c->details);
    c->details = json ? dg_xstrdup(json) : NULL;
}

static void counts(const dg_vreport_t *r, int n[4]) {
    n[0] = n[1] = n[2] = n[3] = 0;
    for (int i = 0; i < r->n; i++)
        n[r->checks[i].verdict]++;
}

int dg_vreport_exit_code(const dg_vreport_t *r) {
    if (r->aborted_exit) return r->aborted_exit;
    int n[4];
    counts(r, n);
    if (n[DG_VERDICT_ERROR]) return DG_ERR_RUNTIME;
    if (n[DG_VERDICT_FAIL]) return DG_VALIDATE_EXIT_FAILED;
    return 0;
}

/* ---------------------------------------------------------------- table */

static void cell(FILE *out, const char *s, int w) {
    int len = (int)strlen(s);
    if (len <= w)
        fprintf(out, "%-*s", w, s);
    else
        fprintf(out, "%.*s~", w - 1, s);
}

void dg_vreport_print_table(const dg_vreport_t *r, FILE *out) {
    int wn = 5, wm = 8, wr = 9;
    for (int i = 0; i < r->n; i++) {
        const dg_vcheck_t *c = &r->checks[i];
        int a = (int)strlen(c->name), b = (int)strlen(c->measured), d = (int)strlen(c->reference);
        if (a > wn) wn = a;
        if (b > wm) wm = b;
        if (d > wr) wr = d;
    }
    if (wm > 56) wm = 56;
    if (wr > 48) wr = 48;
    fprintf(out, "%-*s  %-*s  %-*s  %s\n", wn, "CHECK", wm, "MEASURED", wr, "REFERENCE", "VERDICT");
    for (int i = 0; i < r->n; i++) {
        const dg_vcheck_t *c = &r->checks[i];
        cell(out, c->name, wn);
        fputs("  ", out);
        cell(out, c->measured, wm);
        fputs("  ", out);
        cell(out, c->reference, wr);
        fprintf(out, "  %s\n", dg_verdict_name(c->verdict));
    }
    int n[4];
    counts(r, n);
    if (n[DG_VERDICT_FAIL] + n[DG_VERDICT_ERROR] + n[DG_VERDICT_SKIP]) fputc('\n', out);
    /* skips often share their reason (a CPU-only build skips 15 NCCL checks): one line per reason */
    int *done = r->n > 0 ? calloc((size_t)(unsigned)r->n, sizeof(int)) : NULL;
    for (int i = 0; i < r->n && done; i++) {
        const dg_vcheck_t *c = &r->checks[i];
        if (c->verdict != DG_VERDICT_SKIP || done[i]) continue;
        int n = 0, last = i;
        for (int j = i; j < r->n; j++)
            if (r->checks[j].verdict == DG_VERDICT_SKIP && strcmp(r->checks[j].message, c->message) == 0) {
                done[j] = 1;
                n++;
                last = j;
            }
        if (n == 1)
            fprintf(out, "SKIP %s: %s\n", c->name, c->message);
        else if (n == 2)
            fprintf(out, "SKIP %s, %s: %s\n", c->name, r->checks[last].name, c->message);
        else
            fprintf(out, "SKIP %d checks (%s ... %s): %s\n", n, c->name, r->checks[last].name, c->message);
    }
    free(done);
    for (int i = 0; i < r->n; i++) {
        const dg_vcheck_t *c = &r->checks[i];
        if (c->verdict == DG_VERDICT_FAIL || c->verdict == DG_VERDICT_ERROR)
            fprintf(out, "%s %s: %s\n", dg_verdict_name(c->verdict), c->name, c->message);
    }
    int code = dg_vreport_exit_code(r);
    if (r->aborted_exit) fprintf(out, "ABORTED: %s\n", r->aborted_msg);
    fprintf(
        out,
        "\ndgvalidate: %d checks: %d passed, %d failed, %d errors, %d skipped in %.1f s -> %s (exit %d)\n",
        r->n, n[DG_VERDICT_PASS], n[DG_VERDICT_FAIL], n[DG_VERDICT_ERROR], n[DG_VERDICT_SKIP], r->seconds,
        code == 0 ? "PASS" : "FAIL", code);
    fflush(out);
}

/* ---------------------------------------------------------------- JSON */

/* `pre` (separator and "key": ) then v as a JSON string, or as a JSON number */
static void json_str_after(vbuf_t *b, const char *pre, const char *v) {
    vbuf_printf(b, "%s", pre);
    vbuf_json_str(b, v);
}
static void json_num_after(vbuf_t *b, const char *pre, double v) {
    vbuf_printf(b, "%s", pre);
    vbuf_json_num(b, v);
}

dg_status_t dg_vreport_write_json(const dg_vreport_t *r, const char *path) {
    vbuf_t b = {0};
    int n[4];
    counts(r, n);
    int code = dg_vreport_exit_code(r);
    json_str_after(&b, "{\n  \"suite\": \"dgvalidate\",\n  \"version\": ", DG_VERSION_STRING);
    json_str_after(&b, ",\n  \"started\": ", r->started);
    json_num_after(&b, ",\n  \"seconds\": ", r->seconds);
    json_str_after(&b, ",\n  \"sla\": ", r->sla);
    json_str_after(&b, ",\n  \"run_dir\": ", r->run_dir);
    vbuf_printf(&b, ",\n  \"world_size\": %d,\n  \"n_nodes\": %d,\n  \"hosts\": [", r->world_size,
                r->n_nodes);
    /* r->hosts is a space-separated list */
    char hosts[sizeof r->hosts];
    snprintf(hosts, sizeof hosts, "%s", r->hosts);
    char *save = NULL;
    int first = 1;
    for (char *h = strtok_r(hosts, " ", &save); h; h = strtok_r(NULL, " ", &save)) {
        vbuf_printf(&b, "%s", first ? "" : ", ");
        vbuf_json_str(&b, h);
        first = 0;
    }
    vbuf_printf(&b, "],\n  \"complete\": %s,\n", r->complete ? "true" : "false");
    vbuf_printf(&b, "  \"result\": \"%s\",\n  \"exit_code\": %d,\n",
                !r->complete ? "INCOMPLETE"
                : code       ? "FAIL"
                             : "PASS",
                code);
    vbuf_printf(&b, "  \"counts\": {\"pass\": %d, \"fail\": %d, \"error\": %d, \"skip\": %d},\n",
                n[DG_VERDICT_PASS], n[DG_VERDICT_FAIL], n[DG_VERDICT_ERROR], n[DG_VERDICT_SKIP]);
    if (r->aborted_exit) {
        json_str_after(&b, "  \"aborted\": ", r->aborted_msg);
        vbuf_printf(&b, ",\n");
    }
    vbuf_printf(&b, "  \"checks\": [");
    for (int i = 0; i < r->n; i++) {
        const dg_vcheck_t *c = &r->checks[i];
        vbuf_printf(&b, "%s\n    {\"name\": ", i ? "," : "");
        vbuf_json_str(&b, c->name);
        json_str_after(&b, ", \"group\": ", c->group);
        vbuf_printf(&b, ", \"verdict\": \"%s\", \"value\": ", dg_verdict_name(c->verdict));
        if (c->has_value)
            vbuf_json_num(&b, c->value);
        else
            vbuf_printf(&b, "null");
        json_str_after(&b, ", \"unit\": ", c->unit);
        json_str_after(&b, ", \"measured\": ", c->measured);
        json_str_after(&b, ", \"reference\": ", c->reference);
        json_str_after(&b, ", \"message\": ", c->message);
        json_num_after(&b, ", \"seconds\": ", c->seconds);
        vbuf_printf(&b, ", \"details\": %s}", c->details ? c->details : "{}");
    }
    vbuf_printf(&b, "\n  ]\n}\n");
    dg_status_t s = dg_write_file_atomic(path, b.s, b.n);
    vbuf_free(&b);
    return s;
}

/* ---------------------------------------------------------------- JUnit XML */

static void xml_str(vbuf_t *b, const char *s) {
    static const char *const entity[256] = {
        ['&'] = "&amp;",   ['<'] = "&lt;",   ['>'] = "&gt;",  ['"'] = "&quot;",
        ['\''] = "&apos;", ['\n'] = "&#10;", ['\t'] = "&#9;", ['\r'] = "&#13;"};
    for (const unsigned char *p = (const unsigned char *)(s ? s : ""); *p; p++) {
        if (entity[*p])
            vbuf_printf(b, "%s", entity[*p]);
        else if (*p >= 0x20)
            vbuf_printf(b, "%c", *p); /* other control characters are not allowed in XML 1.0 */
    }
}

dg_status_t dg_vreport_write_junit(const dg_vreport_t *r, const char *path) {
    vbuf_t b = {0};
    int n[4];
    counts(r, n);
    vbuf_printf(&b, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    vbuf_printf(&b,
                "<testsuites name=\"dgvalidate\" tests=\"%d\" failures=\"%d\" errors=\"%d\" skipped=\"%d\" "
                "time=\"%.3f\">\n",
                r->n + (r->aborted_exit ? 1 : 0), n[DG_VERDICT_FAIL],
                n[DG_VERDICT_ERROR] + (r->aborted_exit ? 1 : 0), n[DG_VERDICT_SKIP], r->seconds);
    vbuf_printf(&b,
                "  <testsuite name=\"dgvalidate\" tests=\"%d\" failures=\"%d\" errors=\"%d\" skipped=\"%d\" "
                "time=\"%.3f\" timestamp=\"",
                r->n + (r->aborted_exit ? 1 : 0), n[DG_VERDICT_FAIL],
                n[DG_VERDICT_ERROR] + (r->aborted_exit ? 1 : 0), n[DG_VERDICT_SKIP], r->seconds);
    xml_str(&b, r->started);
    vbuf_printf(&b, "\">\n    <properties>\n");
    const char *pk[] = {"sla", "run_dir", "hosts", "version"};
    const char *pv[] = {r->sla, r->run_dir, r->hosts, DG_VERSION_STRING};
    for (int i = 0; i < 4; i++) {
        vbuf_printf(&b, "      <property name=\"%s\" value=\"", pk[i]);
        xml_str(&b, pv[i]);
        vbuf_printf(&b, "\"/>\n");
    }
    vbuf_printf(&b, "      <property name=\"world_size\" value=\"%d\"/>\n", r->world_size);
    vbuf_printf(&b, "      <property name=\"n_nodes\" value=\"%d\"/>\n", r->n_nodes);
    vbuf_printf(&b, "      <property name=\"complete\" value=\"%s\"/>\n", r->complete ? "true" : "false");
    vbuf_printf(&b, "    </properties>\n");
    for (int i = 0; i < r->n; i++) {
        const dg_vcheck_t *c = &r->checks[i];
        vbuf_printf(&b, "    <testcase classname=\"dgvalidate.");
        xml_str(&b, c->group);
        vbuf_printf(&b, "\" name=\"");
        xml_str(&b, c->name);
        vbuf_printf(&b, "\" time=\"%.3f\">\n", isfinite(c->seconds) ? c->seconds : 0.0);
        if (c->verdict == DG_VERDICT_FAIL || c->verdict == DG_VERDICT_ERROR) {
            const char *tag = c->verdict == DG_VERDICT_FAIL ? "failure" : "error";
            vbuf_printf(&b, "      <%s message=\"", tag);
            xml_str(&b, c->message);
            vbuf_printf(&b, "\" type=\"%s\">", c->verdict == DG_VERDICT_FAIL ? "threshold" : "harness");
            vbuf_printf(&b, "measured: ");
            xml_str(&b, c->measured);
            vbuf_printf(&b, "; reference: ");
            xml_str(&b, c->reference);
            vbuf_printf(&b, "</%s>\n", tag);
        } else if (c->verdict == DG_VERDICT_SKIP) {
            vbuf_printf(&b, "      <skipped message=\"");
            xml_str(&b, c->message);
            vbuf_printf(&b, "\"/>\n");
        }
        vbuf_printf(&b, "      <system-out>measured: ");
        xml_str(&b, c->measured);
        vbuf_printf(&b, "; reference: ");
        xml_str(&b, c->reference);
        if (c->message[0] && c->verdict == DG_VERDICT_PASS) {
            vbuf_printf(&b, "; note: ");
            xml_str(&b, c->message);
        }
        vbuf_printf(&b, "</system-out>\n    </testcase>\n");
    }
    if (r->aborted_exit) {
        vbuf_printf(&b, "    <testcase classname=\"dgvalidate.suite\" name=\"suite\" time=\"0\">\n      "
                        "<error message=\"");
        xml_str(&b, r->aborted_msg);
        vbuf_printf(&b, "\" type=\"aborted\"/>\n    </testcase>\n");
    }
    vbuf_printf(&b, "  </testsuite>\n</testsuites>\n");
    dg_status_t s = dg_write_file_atomic(path, b.s, b.n);
    vbuf_free(&b);
    return s;
}
