/* test_train_util.c — tests of dg_train_util: LR schedule values, JSON escaping and number format,
 * FLOPs/MFU, the progress display in each mode, and (case "metrics DIR") a metrics.jsonl writer run
 * whose output check_metrics.py parses with Python's json module. argv[1] names the case. */
#define _GNU_SOURCE
#include "train_util.h"
#include "dg_check.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int close_to(double a, double b) {
    return fabs(a - b) <= 1e-12 * fmax(1.0, fabs(b));
}

static void case_lr(void) {
    /* The default config: 300 steps, warmup 20, lr 3e-3, min_lr_ratio 0.1. */
    const double lr = 3e-3;
    CHECK(close_to(dg_lr_at(0, 300, lr, 20, 0.1), 1.5e-4), "step 0: %g", dg_lr_at(0, 300, lr, 20, 0.1));
    CHECK(close_to(dg_lr_at(9, 300, lr, 20, 0.1), 1.5e-3), "step 9: %g", dg_lr_at(9, 300, lr, 20, 0.1));
    CHECK(close_to(dg_lr_at(19, 300, lr, 20, 0.1), lr), "step 19: %g", dg_lr_at(19, 300, lr, 20, 0.1));
    CHECK(close_to(dg_lr_at(20, 300, lr, 20, 0.1), lr), "step 20: %g", dg_lr_at(20, 300, lr, 20, 0.1));
    CHECK(close_to(dg_lr_at(299, 300, lr, 20, 0.1), 3e-4), "last step: %g", dg_lr_at(299, 300, lr, 20, 0.1));
    CHECK(close_to(dg_lr_at(300, 300, lr, 20, 0.1), 3e-4), "past the end: %g",
          dg_lr_at(300, 300, lr, 20, 0.1));
    CHECK(close_to(dg_lr_at(5000, 300, lr, 20, 0.1), 3e-4), "far past the end");
    /* Decay span 279 steps: step 20 + 279/3 = 113 is p = 1/3, cos = 0.5: lr = m + (b-m) * 0.75. */
    CHECK(close_to(dg_lr_at(113, 300, lr, 20, 0.1), 3e-4 + 2.7e-3 * 0.75), "p=1/3: %.17g",
          dg_lr_at(113, 300, lr, 20, 0.1));
    /* No warmup, min 0, 101 steps: step 50 is the midpoint, half the base lr. */
    CHECK(close_to(dg_lr_at(0, 101, 1.0, 0, 0.0), 1.0), "no warmup step 0");
    CHECK(close_to(dg_lr_at(50, 101, 1.0, 0, 0.0), 0.5), "midpoint %.17g", dg_lr_at(50, 101, 1.0, 0, 0.0));
    CHECK(dg_lr_at(100, 101, 1.0, 0, 0.0) == 0.0, "last %.17g", dg_lr_at(100, 101, 1.0, 0, 0.0));
    /* Monotone: rising through warmup, never rising after. */
    for (int s = 1; s < 300; s++) {
        double a = dg_lr_at(s - 1, 300, lr, 20, 0.1), b = dg_lr_at(s, 300, lr, 20, 0.1);
        if (s < 20)
            CHECK(b > a, "warmup not rising at %d", s);
        else
            CHECK(b <= a, "decay rising at %d", s);
        CHECK(b >= 3e-4 - 1e-18 && b <= lr + 1e-18, "out of range at %d: %g", s, b);
    }
    /* Warmup longer than the run: all warmup. One-step run: the base lr. */
    CHECK(close_to(dg_lr_at(4, 10, 1.0, 20, 0.1), 0.25), "long warmup %g", dg_lr_at(4, 10, 1.0, 20, 0.1));
    CHECK(close_to(dg_lr_at(0, 1, 2.0, 0, 0.1), 2.0), "one step %g", dg_lr_at(0, 1, 2.0, 0, 0.1));
    /* min_ratio 1: constant after warmup. */
    CHECK(close_to(dg_lr_at(150, 300, lr, 20, 1.0), lr), "min_ratio 1");
}

static void expect_line(const char *got, const char *want) {
    CHECK(strcmp(got, want) == 0, "\n  got:  %s\n  want: %s", got, want);
}

static void case_json(void) {
    /* Escapes: quote, backslash, named controls, other controls as \u00XX, DEL, valid UTF-8 kept,
     * invalid bytes as \u00XX (Latin-1), overlong and surrogate encodings refused. */
    dg_json_field_t f[] = {
        DG_JS("s", "a\"b\\c/d\n\t\r\b\f\x01\x1f\x7f"),
        DG_JS("utf8", "h\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"),
        DG_JS("bad", "\xff\xc3(\xc0\xaf\xed\xa0\x80"),
        DG_JS("ke\"y", NULL),
        DG_JI("i", INT64_MIN),
        DG_JF("third", 1.0 / 3.0),
        DG_JF("tenth", 0.1),
        DG_JF("big", 1e300),
        DG_JF("nan", NAN),
        DG_JF("inf", -INFINITY),
        DG_JF("negzero", -0.0),
        DG_JF("two", 2.0),
        DG_JB("t", 1),
        DG_JNULL("n"),
        DG_JRAW("raw", "{\"a\":[1,2]}"),
    };
    char *line = dg_json_line("ev\n", f, (int)(sizeof f / sizeof f[0]), 12.5);
    expect_line(line,
                "{\"event\":\"ev\\n\",\"s\":\"a\\\"b\\\\c/d\\n\\t\\r\\b\\f\\u0001\\u001f\\u007f\","
                "\"utf8\":\"h\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\","
                "\"bad\":\"\\u00ff\\u00c3(\\u00c0\\u00af\\u00ed\\u00a0\\u0080\","
                "\"ke\\\"y\":null,\"i\":-9223372036854775808,\"third\":0.3333333333333333,\"tenth\":0.1,"
                "\"big\":1e+300,\"nan\":null,\"inf\":null,\"negzero\":-0,\"two\":2,\"t\":true,\"n\":null,"
                "\"raw\":{\"a\":[1,2]},\"time\":12.500}");
    free(line);
    line = dg_json_line("done", NULL, 0, -1);
    expect_line(line, "{\"event\":\"done\"}");
    free(line);
    /* Round trip of awkward doubles through the shortest form. */
    double vals[] = {5.545177444479562, 2.5e-8, 123456789.123, 1.0 / 7.0, 4.9e-324, 1.7976931348623157e308};
    for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
        dg_strbuf_t b = {0};
        dg_json_append_number(&b, vals[i]);
        CHECK(strtod(b.p, NULL) == vals[i], "%s does not read back as %.17g", b.p, vals[i]);
        dg_strbuf_free(&b);
    }
}

static void case_flops(void) {
    /* GPT-2 124M at T=1024: 6 * 124e6 + 12 * 12 * 768 * 1024. */
    CHECK(dg_flops_per_token(124000000, 12, 768, 1024) == 744e6 + 113246208.0, "flops %.0f",
          dg_flops_per_token(124000000, 12, 768, 1024));
    CHECK(close_to(dg_mfu(1000, 1e9, 2e12), 0.5), "mfu %g", dg_mfu(1000, 1e9, 2e12));
    CHECK(isnan(dg_mfu(1000, 1e9, 0)), "unknown peak must give NaN");
    CHECK(dg_peak_flops_gpu("NVIDIA H100 80GB HBM3", "bf16") == 989e12, "H100 bf16");
    CHECK(dg_peak_flops_gpu("NVIDIA H100 PCIe", "bf16") == 756e12, "H100 PCIe");
    CHECK(dg_peak_flops_gpu("NVIDIA H200", "fp32") == 67e12, "H200 fp32");
    CHECK(dg_peak_flops_gpu("NVIDIA A100-SXM4-80GB", "fp16") == 312e12, "A100");
    CHECK(dg_peak_flops_gpu("Some Future GPU", "bf16") == 0, "unknown GPU");
    double cpu = dg_peak_flops_cpu(2);
    printf("CPU fp32 peak estimate for 2 cores here: %.1f GFLOP/s\n", cpu / 1e9);
    CHECK(cpu == 0 || (cpu > 1e9 && cpu < 1e13), "implausible CPU peak %g", cpu);
    CHECK(dg_peak_flops_cpu(0) == 0, "0 cores");
}

static void case_format(void) {
    char b[32];
    struct {
        double v;
        const char *want;
    } eta[] = {{0, "0:00"},       {51.4, "0:51"}, {59.6, "1:00"}, {725, "12:05"},
               {3723, "1:02:03"}, {-1, "--:--"},  {NAN, "--:--"}, {INFINITY, "--:--"}};
    for (size_t i = 0; i < sizeof eta / sizeof eta[0]; i++) {
        dg_format_eta(eta[i].v, b, sizeof b);
        CHECK(strcmp(b, eta[i].want) == 0, "eta %g: %s (want %s)", eta[i].v, b, eta[i].want);
    }
    struct {
        double v;
        const char *want;
    } si[] = {{0, "0"},         {950, "950"},       {999.96, "1.00k"}, {41234, "41.2k"},
              {123456, "123k"}, {1234567, "1.23M"}, {4.56e9, "4.56G"}};
    for (size_t i = 0; i < sizeof si / sizeof si[0]; i++) {
        dg_format_si(si[i].v, b, sizeof b);
        CHECK(strcmp(b, si[i].want) == 0, "si %g: %s (want %s)", si[i].v, b, si[i].want);
    }
}

static char *slurp(FILE *f) {
    fflush(f);
    long n = ftell(f);
    rewind(f);
    char *s = calloc(1, (size_t)n + 1);
    if (n > 0 && fread(s, 1, (size_t)n, f) != (size_t)n) s[0] = 0;
    return s;
}

static int matches_line(const char *line, long step, long total) {
    /* "step S/T | loss X.XXX | R tok/s | ETA M:SS" */
    char head[64];
    snprintf(head, sizeof head, "step %ld/%ld | loss ", step, total);
    if (strncmp(line, head, strlen(head)) != 0) return 0;
    const char *p = line + strlen(head);
    char *end;
    strtod(p, &end);
    if (end == p || strncmp(end, " | ", 3) != 0) return 0;
    p = strstr(end, " tok/s | ETA ");
    if (!p) return 0;
    p += strlen(" tok/s | ETA ");
    return (p[0] >= '0' && p[0] <= '9') || p[0] == '-';
}

static void case_progress(void) {
    /* PLAIN: lines at the first step, every log_every, and the last; no \r or escapes. */
    FILE *f = tmpfile();
    dg_progress_t *p = dg_progress_create(f, 0, 10, 3, DG_PROGRESS_PLAIN);
    for (int s = 1; s <= 10; s++)
        dg_progress_step(p, s, 5.5 - 0.3 * s, 41234.0, 0.01);
    dg_progress_note(p, "val loss 2.345");
    dg_progress_finish(p);
    dg_progress_free(p);
    char *out = slurp(f);
    fclose(f);
    CHECK(!strchr(out, '\r') && !strchr(out, '\033'), "plain output has control characters");
    long want_steps[] = {1, 3, 6, 9, 10};
    char *save, *line = strtok_r(out, "\n", &save);
    for (int i = 0; i < 5; i++, line = strtok_r(NULL, "\n", &save)) {
        CHECK(line && matches_line(line, want_steps[i], 10), "plain line %d: %s", i, line ? line : "(none)");
        if (line && i == 1)
            CHECK(strstr(line, "loss 4.600 | 41.2k tok/s | ETA ") != NULL, "fields: %s", line);
    }
    CHECK(line && strcmp(line, "val loss 2.345") == 0, "note line: %s", line ? line : "(none)");
    CHECK(strtok_r(NULL, "\n", &save) == NULL, "extra plain output");
    free(out);

    /* TTY: one line redrawn with \r ... \033[K; a note goes above it; the last step ends the line. */
    f = tmpfile();
    p = dg_progress_create(f, 0, 3, 1, DG_PROGRESS_TTY);
    dg_progress_step(p, 1, 5.0, 1000, 0.5);
    dg_progress_note(p, "checkpoint saved");
    usleep(120000); /* past the redraw throttle */
    dg_progress_step(p, 2, 4.0, 1000, 0.5);
    dg_progress_step(p, 3, 3.0, 1000, 0.5); /* the last step is always drawn */
    dg_progress_finish(p);                  /* nothing more: the last step already ended the line */
    dg_progress_free(p);
    out = slurp(f);
    fclose(f);
    const char *want = "\rstep 1/3 | loss 5.000 | 1.00k tok/s | ETA 0:01\033[K"
                       "\rcheckpoint saved\033[K\nstep 1/3 | loss 5.000 | 1.00k tok/s | ETA 0:01";
    CHECK(strncmp(out, want, strlen(want)) == 0, "tty start:\n%s", out);
    const char *l2 = strstr(out, "\rstep 2/3 | loss 4.000 | 1.00k tok/s | ETA 0:0");
    const char *l3 = strstr(out, "\rstep 3/3 | loss 3.000 | 1.00k tok/s | ETA 0:00\033[K\n");
    CHECK(l2 && l3 && l3 > l2, "tty redraws missing:\n%s", out);
    CHECK(out[strlen(out) - 1] == '\n' && (!l3 || l3[strlen(l3) - 1] == '\n'), "tty end");
    int newlines = 0;
    for (char *c = out; *c; c++)
        newlines += *c == '\n';
    CHECK(newlines == 2, "tty newlines %d (want 2: after the note, at the end)", newlines);
    free(out);

    /* Other ranks and OFF print nothing. */
    f = tmpfile();
    p = dg_progress_create(f, 1, 3, 1, DG_PROGRESS_TTY);
    dg_progress_step(p, 3, 1.0, 1.0, 1.0);
    dg_progress_note(p, "x");
    dg_progress_finish(p);
    dg_progress_free(p);
    p = dg_progress_create(f, 0, 3, 1, DG_PROGRESS_OFF);
    dg_progress_step(p, 3, 1.0, 1.0, 1.0);
    dg_progress_free(p);
    out = slurp(f);
    fclose(f);
    CHECK(out[0] == 0, "rank 1 / OFF printed: %s", out);
    free(out);
    /* AUTO on a file is PLAIN. */
    f = tmpfile();
    p = dg_progress_create(f, 0, 2, 1, DG_PROGRESS_AUTO);
    dg_progress_step(p, 1, 1.0, 1.0, 1.0);
    dg_progress_free(p);
    out = slurp(f);
    fclose(f);
    CHECK(strncmp(out, "step 1/2 | ", 11) == 0 && out[strlen(out) - 1] == '\n', "auto on a file: %s", out);
    free(out);
}

/* ---- metrics writer run for check_metrics.py ---- */

static dg_metrics_t *g_m;

static void *writer_thread(void *arg) {
    long t = (long)arg;
    for (int i = 0; i < 200; i++) {
        dg_status_t s =
            DG_METRICS_EVENT(g_m, "health", DG_JI("thread", t), DG_JI("i", i),
                             DG_JS("msg", "a fairly long message so that lines are not tiny ........"));
        if (s != DG_OK) fprintf(stderr, "health write: %s\n", dg_last_error());
    }
    return NULL;
}

static int run_metrics(const char *dir) {
    dg_metrics_t *m;
    if (dg_metrics_open(dir, 0, &m) != DG_OK) {
        fprintf(stderr, "open: %s\n", dg_last_error());
        return 1;
    }
    DG_METRICS_EVENT(
        m, "start", DG_JI("world_size", 4), DG_JS("mesh", "dp_replicate=1,dp_shard=4,tp=1"),
        DG_JS("backend", "cpu"), DG_JS("config_hash", "00ff00ff00ff00ff"),
        DG_JS("note", "quote \" backslash \\ newline \n tab \t bell \x07 caf\xc3\xa9 bad \xff end"),
        DG_JRAW("raw", "{\"nested\":[1,2,{\"x\":null}]}"));
    for (int s = 1; s <= 5; s++) {
        dg_step_metrics_t st = {.step = s,
                                .loss = s == 3 ? NAN : 5.545177444479562 - 0.5 * s,
                                .lr = dg_lr_at(s - 1, 5, 3e-3, 2, 0.1),
                                .grad_norm = s == 4 ? INFINITY : 1.0 / s,
                                .tokens = (int64_t)s * 2048,
                                .tok_per_s = 41234.5,
                                .step_ms = 49.67,
                                .mfu = s == 5 ? NAN : 0.125};
        dg_metrics_step(m, &st);
    }
    DG_METRICS_EVENT(m, "val", DG_JI("step", 5), DG_JF("val_loss", 2.25));
    DG_METRICS_EVENT(m, "checkpoint", DG_JI("step", 5), DG_JS("path", "run/checkpoints/step_00000005.h5"),
                     DG_JI("bytes", 123456789), DG_JF("seconds", 0.5), DG_JF("stall_ms", 12.0));
    dg_metrics_event_raw(m, "fallback", "\"reason\":\"over memory budget\",\"rank\":0");
    dg_metrics_event_raw(m, "empty", "");
    pthread_t th[4];
    g_m = m;
    for (long t = 0; t < 4; t++)
        pthread_create(&th[t], NULL, writer_thread, (void *)t);
    for (int t = 0; t < 4; t++)
        pthread_join(th[t], NULL);
    dg_metrics_close(m);
    /* Reopen: a resumed run appends. */
    dg_metrics_open(dir, 0, &m);
    DG_METRICS_EVENT(m, "resume", DG_JI("step", 5), DG_JS("path", "x.h5"), DG_JI("from_world", 4),
                     DG_JI("to_world", 2));
    dg_metrics_event(m, "done", NULL, 0);
    dg_metrics_close(m);
    /* A rank other than 0 writes nothing anywhere. */
    char other[4096];
    snprintf(other, sizeof other, "%s/rank1", dir);
    dg_metrics_open(other, 1, &m);
    DG_METRICS_EVENT(m, "step", DG_JI("step", 1));
    CHECK(strcmp(dg_metrics_path(m), "") == 0, "rank 1 path");
    dg_metrics_close(m);
    struct stat st;
    CHECK(stat(other, &st) != 0, "rank 1 created %s", other);
    /* An unwritable run dir is a clear error. */
    dg_status_t s = dg_metrics_open("/proc/no/such/dir", 0, &m);
    CHECK(s != DG_OK && strstr(dg_last_error(), "/proc/no"), "bad dir: %d %s", s, dg_last_error());
    return dg_fails ? 1 : 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "metrics")) return run_metrics(argv[2]);
    static const dg_check_case_t cases[] = {DG_CASE(lr), DG_CASE(json), DG_CASE(flops), DG_CASE(format),
                                            DG_CASE(progress)};
    return DG_CHECK_CASES(argc, argv, cases, "CASE | metrics DIR", NULL, 0, NULL);
}
