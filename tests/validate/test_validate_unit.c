/* test_validate_unit.c — unit tests of the validation suite's pure parts: the SLA parser (settings, node
 * types and their inheritance, references, every kind of bad input with its FILE:LINE message), the
 * reference bounds (ReFrame semantics) and unit conversions, nccl-tests' bus factors, and the report
 * writers. It leaves a synthetic report with awkward characters in argv[1] for check_reports.py to parse.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "validate.h"
#include "dg_check.h"

static dg_sla_t *parse_ok(const char *text) {
    dg_sla_t *s = NULL;
    dg_status_t st = dg_sla_parse("t.ini", text, strlen(text), &s);
    if (st != DG_OK) {
        fprintf(stderr, "FAIL: unexpected parse error: %s\n", dg_last_error());
        dg_fails++;
        return NULL;
    }
    return s;
}

/* The parse must fail with DG_ERR_USAGE and a message containing `want`. */
static void parse_bad(const char *text, const char *want) {
    dg_sla_t *s = NULL;
    dg_status_t st = dg_sla_parse("t.ini", text, strlen(text), &s);
    if (st != DG_ERR_USAGE || !strstr(dg_last_error(), want) || s != NULL || strchr(dg_last_error(), '\n')) {
        fprintf(stderr, "FAIL: input %s\n  status %d, message '%s'\n  expected '%s'\n", text, st,
                dg_last_error(), want);
        dg_fails++;
    }
    dg_sla_free(s);
}

static void test_units_and_refs(void) {
    dg_dim_t d;
    CHECK(dg_validate_unit_factor("GB/s", &d) == 1e9 && d == DG_DIM_BANDWIDTH);
    CHECK(dg_validate_unit_factor("GiB/s", &d) == 1073741824.0);
    CHECK(dg_validate_unit_factor("Gbit/s", &d) == 1.25e8);
    CHECK(dg_validate_unit_factor("TFLOP/s", &d) == 1e12 && d == DG_DIM_FLOPS);
    CHECK(dg_validate_unit_factor("us", &d) == 1e-6 && d == DG_DIM_TIME);
    CHECK(dg_validate_unit_factor("furlongs", &d) == 0);

    dg_sla_t *s = parse_ok("[node:*]\n"
                           "ref.storage.write = 10, -0.2, none, GB/s\n"
                           "ref.health.rtt = 20, none, 0.5, us\n"
                           "ref.compute.cpu_gemm = 100, -0.1, 0.1, GFLOP/s\n"
                           "ref.storage.read = 1, none, none, GB/s\n");
    if (!s) return;
    const dg_sla_ref_t *w = dg_sla_ref(s, 0, "storage.write");
    CHECK(w && w->target == 10 && w->has_lower && !w->has_upper && w->factor == 1e9);
    double lo, hi;
    dg_sla_ref_bounds(w, &lo, &hi);
    CHECK(fabs(lo - 8e9) < 1 && isinf(hi));
    CHECK(dg_sla_ref_ok(w, 8.0e9) && dg_sla_ref_ok(w, 1e12) && !dg_sla_ref_ok(w, 7.99e9) &&
          !dg_sla_ref_ok(w, NAN));
    const dg_sla_ref_t *r = dg_sla_ref(s, 0, "health.rtt");
    CHECK(r && dg_sla_ref_ok(r, 30e-6) && !dg_sla_ref_ok(r, 31e-6) && dg_sla_ref_ok(r, 0));
    const dg_sla_ref_t *g = dg_sla_ref(s, 0, "compute.cpu_gemm");
    CHECK(g && dg_sla_ref_ok(g, 95e9) && !dg_sla_ref_ok(g, 111e9) && !dg_sla_ref_ok(g, 89e9));
    const dg_sla_ref_t *any = dg_sla_ref(s, 0, "storage.read");
    CHECK(any && dg_sla_ref_ok(any, 0) && dg_sla_ref_ok(any, 1e15));
    CHECK(dg_sla_ref(s, 0, "storage.rename") == NULL);
    char buf[200];
    dg_sla_ref_format(w, buf, sizeof buf);
    CHECK(strstr(buf, ">= 8 GB/s") != NULL);
    dg_sla_ref_format(r, buf, sizeof buf);
    CHECK(strstr(buf, "<= 30 us") != NULL);
    dg_sla_free(s);
}

static void test_types_and_settings(void) {
    dg_sla_t *s = parse_ok("# full example\n"
                           "[validate]\n"
                           "checks = topology, comm.mpi\n"
                           "straggler_fraction = 0.75\n"
                           "comm_sizes = 8, 64K, 1M, 2G\n"
                           "storage_dir = \"/lus/ckpt\"   ; quoted\n"
                           "train_loss_rtol = 1e-6\n"
                           "\n"
                           "[node:*]\n"
                           "numa_nodes = >=1\n"
                           "ref.compute.cpu_stream = 50, -0.3, none, GB/s\n"
                           "ref.health.rtt = 50, none, 1, us\n"
                           "[node:h200]\n"
                           "match = gpu-h200-*, h200n*\n"
                           "gpus = 8\n"
                           "gpu_model = *H200*\n"
                           "ranks_per_gpu = 2\n"
                           "ref.compute.cpu_stream = 400, -0.2, none, GB/s\n"
                           "[node:cpu]\n"
                           "match = cpu-*\n"
                           "bind_near_gpu = no\n");
    if (!s) return;
    const dg_sla_settings_t *st = dg_sla_settings(s);
    CHECK(strcmp(st->checks, "topology, comm.mpi") == 0);
    CHECK(st->straggler_fraction == 0.75);
    CHECK(st->n_comm_sizes == 4 && st->comm_sizes[1] == 65536 && st->comm_sizes[2] == 1048576 &&
          st->comm_sizes[3] == 2147483648LL);
    CHECK(strcmp(st->storage_dir, "/lus/ckpt") == 0);
    CHECK(st->train_loss_rtol == 1e-6);
    CHECK(st->comm_iters == 20); /* default kept */
    CHECK(dg_sla_n_types(s) == 3);
    int h = dg_sla_node_type(s, "gpu-h200-017"), h2 = dg_sla_node_type(s, "h200n3"),
        c = dg_sla_node_type(s, "cpu-1");
    CHECK(h == 1 && h2 == 1 && c == 2 && dg_sla_node_type(s, "login1") == 0);
    CHECK(strcmp(dg_sla_type_name(s, h), "h200") == 0 && strcmp(dg_sla_type_name(s, 0), "*") == 0);
    const dg_sla_node_t *nh = dg_sla_node(s, h), *nc = dg_sla_node(s, c);
    CHECK(!nh->gpus.any && nh->gpus.n == 8 && !nh->gpus.at_least);
    CHECK(nh->numa_nodes.at_least && nh->numa_nodes.n == 1); /* inherited from [node:*] */
    CHECK(nh->ranks_per_gpu == 2 && nc->ranks_per_gpu == 1);
    CHECK(nh->bind_near_gpu == 1 && nc->bind_near_gpu == 0);
    CHECK(strcmp(nh->gpu_model, "*H200*") == 0 && strcmp(nc->gpu_model, "*") == 0);
    CHECK(dg_sla_count_ok(&nh->gpus, 8) && !dg_sla_count_ok(&nh->gpus, 7) && dg_sla_count_ok(&nc->gpus, 0));
    /* a type's own reference wins; others inherit [node:*]'s */
    CHECK(dg_sla_ref(s, h, "compute.cpu_stream")->target == 400);
    CHECK(dg_sla_ref(s, c, "compute.cpu_stream")->target == 50);
    CHECK(dg_sla_ref(s, h, "health.rtt")->target == 50);
    CHECK(strcmp(dg_sla_ref(s, h, "compute.cpu_stream")->node_type, "h200") == 0);
    CHECK(strstr(dg_sla_ref(s, h, "compute.cpu_stream")->source, "t.ini:18") != NULL);
    /* overrides */
    CHECK(dg_sla_set(s, "validate.comm_iters=7") == DG_OK && dg_sla_settings(s)->comm_iters == 7);
    CHECK(dg_sla_set(s, "validate.comm_iters=0") == DG_ERR_USAGE &&
          strstr(dg_last_error(), "--set 'validate.comm_iters=0'"));
    CHECK(dg_sla_set(s, "comm_iters=3") == DG_ERR_USAGE);
    CHECK(dg_sla_set(s, "validate.stragler_fraction=0.5") == DG_ERR_USAGE &&
          strstr(dg_last_error(), "did you mean 'validate.straggler_fraction'"));
    dg_sla_free(s);

    /* an empty file is valid: every default */
    s = parse_ok("");
    if (s) {
        CHECK(dg_sla_n_types(s) == 1 && dg_sla_settings(s)->n_comm_sizes == 6);
        dg_sla_free(s);
    }
}

static void test_bad_input(void) {
    parse_bad("[validate]\ncomm_iter = 5\n",
              "t.ini:2: unknown key validate.comm_iter; did you mean 'validate.comm_iters'?");
    parse_bad("comm_iters = 5\n", "t.ini:1: key 'comm_iters' is outside any section");
    parse_bad("[validate]\ncomm_iters = -1\n",
              "t.ini:2: validate.comm_iters = '-1': expected an integer >= 1");
    parse_bad("[validate]\ncomm_iters = 5x\n", "expected an integer >= 1");
    parse_bad("[validate]\nstraggler_fraction = 1.5\n",
              "t.ini:2: validate.straggler_fraction = '1.5': expected a fraction");
    parse_bad("[validate]\ncomm_sizes = 8, 1K, 1K\n", "sizes must increase");
    parse_bad("[validate]\ncomm_sizes = 8, lots\n", "'lots' is not a size");
    parse_bad("[validate]\ncomm_backends = gloo\n", "expected auto, mpi, nccl or mpi,nccl");
    parse_bad("[validate]\nchecks = topology, comms\n", "unknown check 'comms'");
    parse_bad(
        "[validate]\n\n[validat]\n",
        "t.ini:3: unknown section [validat]: expected [validate] or [node:TYPE]; did you mean 'validate'?");
    parse_bad("[node:*]\nref.compute.gpu_gem = 1, -0.1, none, TFLOP/s\n",
              "did you mean 'ref.compute.gpu_gemm'?");
    parse_bad("[node:*]\nref.compute.gpu_gemm = 1, -0.1, none, TB/s\n",
              "unit 'TB/s' measures something else");
    parse_bad("[node:*]\nref.compute.gpu_gemm = 1, -0.1, none, parsecs\n", "unit 'parsecs' is unknown");
    parse_bad("[node:*]\nref.compute.gpu_gemm = 0, -0.1, none, TFLOP/s\n", "target '0' must be a number > 0");
    parse_bad("[node:*]\nref.compute.gpu_gemm = 1, -1.5, none, TFLOP/s\n",
              "lower threshold -1.5 must be in [-1, 0]");
    parse_bad("[node:*]\nref.health.rtt = 1, none, -0.5, us\n", "upper threshold -0.5 must be >= 0");
    parse_bad("[node:*]\nref.health.rtt = 1, none, us\n", "got 3 field(s)");
    parse_bad("[node:*]\nref.health.rtt = 1, none, lots, us\n", "upper threshold 'lots' must be a fraction");
    parse_bad("[node:*]\nref.health.rtt = 1, none, 1, us\nref.health.rtt = 2, none, 1, us\n",
              "t.ini:3: duplicate key ref.health.rtt in [node:*] (first set at line 2)");
    parse_bad("[node:*]\nmatch = *\n", "t.ini:2: [node:*] matches every host");
    parse_bad("[node:a]\ngpus = 1\n", "t.ini:1: [node:a] has no 'match'");
    parse_bad("[node:a]\nmatch=x\n[node:a]\nmatch=y\n",
              "t.ini:3: duplicate section [node:a] (first at line 1)");
    parse_bad("[node:a b]\nmatch=x\n", "node type names use letters");
    parse_bad("[node:a]\nmatch=x\ngpus = >=x\n", "t.ini:3: gpus = '>=x': expected 'any', a count N or '>=N'");
    parse_bad("[node:a]\nmatch=x\nbind_near_gpu = maybe\n", "bind_near_gpu = 'maybe': expected yes or no");
    parse_bad("[node:a]\nmatch=x\ngpu = 8\n", "unknown key 'gpu' in [node:a]; did you mean 'gpus'?");
    parse_bad("[validate]\nthis is not a key value line\n", "t.ini:2: malformed line");
    parse_bad("[validate\n", "t.ini:1: malformed section header");
    char longline[400];
    memset(longline, 'x', sizeof longline);
    memcpy(longline, "[validate]\nchecks = ", 20);
    longline[sizeof longline - 1] = 0;
    parse_bad(longline, "t.ini:2: line longer than");
    const char nul[] = "[validate]\ncomm_iters = 3\0\n";
    dg_sla_t *s = NULL;
    CHECK(dg_sla_parse("t.ini", nul, sizeof nul - 1, &s) == DG_ERR_USAGE &&
          strstr(dg_last_error(), "t.ini:2: contains a NUL"));
    CHECK(dg_sla_load("/nonexistent/x.ini", &s) == DG_ERR_USAGE &&
          strstr(dg_last_error(), "/nonexistent/x.ini"));
}

static void test_bus_factors(void) {
    CHECK(dg_validate_bus_factor("allreduce", 8) == 2.0 * 7 / 8);
    CHECK(dg_validate_bus_factor("allreduce", 1) == 0);
    CHECK(dg_validate_bus_factor("allgather", 4) == 0.75);
    CHECK(dg_validate_bus_factor("reduce_scatter", 2) == 0.5);
    CHECK(dg_validate_bus_factor("broadcast", 16) == 1);
    CHECK(dg_validate_bus_factor("sendrecv", 2) == 1);
    CHECK(dg_validate_bus_factor("alltoall", 2) == -1);
    int n = 0;
    for (const dg_validate_metric_t *m = dg_validate_metrics(); m->name; m++)
        n++;
    CHECK(n == 30 + 10);
}

static void test_reports(const char *dir) {
    dg_vreport_t r;
    dg_vreport_init(&r);
    snprintf(r.sla, sizeof r.sla, "sla \"quoted\".ini");
    snprintf(r.run_dir, sizeof r.run_dir, "%s", dir);
    snprintf(r.started, sizeof r.started, "2026-11-29T10:00:00Z");
    snprintf(r.hosts, sizeof r.hosts, "node-a node-b");
    r.world_size = 3;
    r.n_nodes = 2;
    r.complete = 1;
    r.seconds = 1.5;
    dg_vcheck_t *k = dg_vreport_add(&r, "demo.pass");
    CHECK(strcmp(k->group, "demo") == 0 && k->verdict == DG_VERDICT_PASS);
    snprintf(k->measured, sizeof k->measured, "1.5 GB/s");
    k->has_value = 1;
    k->value = 1.5e9;
    snprintf(k->unit, sizeof k->unit, "B/s");
    dg_vcheck_set_details(k, "{\"sweep\": [1, 2]}");
    CHECK(dg_vreport_exit_code(&r) == 0);
    k = dg_vreport_add(&r, "demo.skip");
    k->verdict = DG_VERDICT_SKIP;
    snprintf(k->message, sizeof k->message, "no GPU\tat all");
    CHECK(dg_vreport_exit_code(&r) == 0);
    k = dg_vreport_add(&r, "demo.fail");
    k->verdict = DG_VERDICT_FAIL;
    snprintf(k->measured, sizeof k->measured, "x < y & 'z'");
    snprintf(k->message, sizeof k->message, "rank 1 (node-b): <&\"quoted\"> \\ back\nslash \x01");
    CHECK(dg_vreport_exit_code(&r) == DG_VALIDATE_EXIT_FAILED);
    mkdir(dir, 0755);
    char p[4200];
    snprintf(p, sizeof p, "%s/validation.json", dir);
    CHECK(dg_vreport_write_json(&r, p) == DG_OK);
    snprintf(p, sizeof p, "%s/validation-junit.xml", dir);
    CHECK(dg_vreport_write_junit(&r, p) == DG_OK);
    CHECK(dg_vreport_write_json(&r, "/nonexistent/dir/v.json") == DG_ERR_RUNTIME &&
          strstr(dg_last_error(), "/nonexistent/dir/v.json"));
    FILE *t = tmpfile();
    dg_vreport_print_table(&r, t);
    rewind(t);
    char text[8192] = {0};
    size_t n = fread(text, 1, sizeof text - 1, t);
    fclose(t);
    CHECK(n > 0 && strstr(text, "CHECK") && strstr(text, "VERDICT"));
    CHECK(strstr(text, "\nFAIL demo.fail: rank 1 (node-b): <&\"quoted\">") != NULL);
    CHECK(strstr(text, "SKIP demo.skip: no GPU") != NULL);
    CHECK(strstr(text, "-> FAIL (exit 4)") != NULL);
    k = dg_vreport_add(&r, "demo.error");
    k->verdict = DG_VERDICT_ERROR;
    CHECK(dg_vreport_exit_code(&r) == DG_ERR_RUNTIME);
    dg_vreport_destroy(&r);
}

int main(int argc, char **argv) {
    test_units_and_refs();
    test_types_and_settings();
    test_bad_input();
    test_bus_factors();
    test_reports(argc > 1 ? argv[1] : "unit-reports");
    if (dg_fails) {
        fprintf(stderr, "%d failure(s)\n", dg_fails);
        return 1;
    }
    printf("validate unit tests: all passed\n");
    return 0;
}
