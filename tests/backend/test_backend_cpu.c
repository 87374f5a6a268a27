/* test_backend_cpu.c — runs the op harness on the CPU backend, plus what is specific to the CPU backend:
 * bad input gives an error (never a crash), results do not depend on the thread count, and matmul_fwd_res
 * is bitwise matmul_fwd followed by add (contract v1.11: what makes the fused graph's training bitwise the
 * unfused one's on CPU).
 *
 *   test_backend_cpu [--threads N] [--only SUBSTR] [--verbose] [--no-fd] [--digests FILE]
 *   test_backend_cpu --errors            only the bad-input checks
 *   test_backend_cpu --threads-compare 1,2,3
 *                                        run the harness once per thread count (backend config
 *                                        `threads`) and require bit-identical outputs for every case
 * Exit status: 0 when every check passed, 1 otherwise.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dg_check.h"
#include "op_harness.h"

static dg_backend_t *make(int threads) {
    dg_backend_config_t cfg = {.act_dtype = DG_F32, .device = 0, .threads = threads, .seed = 1};
    dg_backend_t *be = NULL;
    dg_status_t s = dg_backend_cpu_create(&cfg, &be);
    if (s != DG_OK) {
        fprintf(stderr, "cannot create the cpu backend: %s\n", dg_last_error());
        exit(1);
    }
    return be;
}

/* A failing call must return a non-OK status with a message that names the problem. */
static void expect_err(dg_status_t s, const char *needle, const char *what) {
    EXPECT(s != DG_OK, "%s: expected an error, got DG_OK", what);
    if (s != DG_OK) {
        EXPECT(strstr(dg_last_error(), needle) != NULL, "%s: message \"%s\" does not mention \"%s\"", what,
               dg_last_error(), needle);
        printf("ok   errors: %s -> \"%s\"\n", what, dg_last_error());
    }
    dg_clear_error();
}

/* Configurations the CPU backend refuses to create, with what the message names */
static const struct {
    dg_backend_config_t cfg;
    const char *needle, *what;
} k_bad_create[] = {
    {{.act_dtype = DG_BF16, .threads = 0}, "fp32", "create with bf16 activations"},
    {{.act_dtype = DG_F32, .threads = -2}, "threads", "create with threads=-2"},
};

static void error_checks(void) {
    for (size_t i = 0; i < sizeof k_bad_create / sizeof k_bad_create[0]; i++) {
        dg_backend_t *be = NULL;
        expect_err(dg_backend_cpu_create(&k_bad_create[i].cfg, &be), k_bad_create[i].needle,
                   k_bad_create[i].what);
        EXPECT(be == NULL, "%s failed but returned a backend", k_bad_create[i].what);
    }

    dg_backend_t *be = make(2);
    const dg_backend_ops_t *op = be->ops;
    float *buf = NULL;
    DG_ASSERT(op->alloc(be, 4096 * sizeof(float), (void **)&buf) == DG_OK);
    for (int i = 0; i < 4096; i++)
        buf[i] = 0.5f + (float)i * 1e-3f;
    int32_t tok[8] = {1, 2, 3, 4, 5, 6, 7, 8};

    expect_err(op->attention_fwd(be, buf, buf, buf, 1, 2, 10, 3), "not divisible", "attention C % NH != 0");
    expect_err(op->attention_bwd(be, buf, buf, buf, buf, buf, 1, 0, 12, 3), "positive", "attention T = 0");
    int32_t bad_tg[2] = {3, 9};
    expect_err(op->crossentropy_fwd(be, buf, buf, buf, bad_tg, 2, 9, 10), "outside the vocabulary",
               "crossentropy target == V");
    expect_err(op->crossentropy_bwd(be, buf, buf, buf, tok, 2, 9, 8, 1.0f), "smaller than V",
               "crossentropy Vp < V");
    /* the fused op checks like the pair, before writing anything */
    float before = buf[100];
    expect_err(op->crossentropy_fused(be, buf, buf + 8, buf + 100, buf + 100, bad_tg, 2, 9, 10, 1.0f),
               "outside the vocabulary", "crossentropy_fused target == V");
    EXPECT(buf[100] == before, "crossentropy_fused with a bad target wrote the logits");
    expect_err(op->crossentropy_fused(be, buf, buf, buf, buf, tok, 2, 9, 8, 1.0f), "smaller than V",
               "crossentropy_fused Vp < V");
    expect_err(op->crossentropy_fused(be, buf, buf, NULL, buf, tok, 2, 9, 10, 1.0f), "`dlogits` is NULL",
               "crossentropy_fused dlogits NULL");
    int32_t neg[4] = {0, 1, -5, 2};
    expect_err(op->encoder_fwd(be, buf, neg, buf, buf, 2, 2, 4), "negative", "encoder_fwd negative token");
    expect_err(op->encoder_bwd(be, buf, buf, buf, neg, 2, 2, 4), "negative", "encoder_bwd negative token");
    expect_err(op->matmul_fwd(be, buf, NULL, buf, NULL, NULL, 4, 4, 4, DG_EPI_NONE), "NULL",
               "matmul_fwd w = NULL");
    expect_err(op->matmul_fwd(be, buf, NULL, buf, buf, NULL, 4, 4, 4, DG_EPI_GELU), "pre",
               "matmul_fwd GELU without pre");
    expect_err(op->matmul_fwd(be, buf, buf, buf, buf, NULL, 4, 4, 4, DG_EPI_GELU), "different",
               "matmul_fwd GELU with pre == out");
    expect_err(op->matmul_bwd(be, buf, buf, NULL, buf, buf, buf, -1, 4, 4, 0), "positive",
               "matmul_bwd N = -1");
    /* v1.11: out may alias res exactly, nothing else */
    expect_err(op->matmul_fwd_res(be, buf, buf + 100, buf + 200, NULL, NULL, 4, 4, 4), "`res` is NULL",
               "matmul_fwd_res res = NULL");
    expect_err(op->matmul_fwd_res(be, buf, buf + 100, NULL, NULL, buf, 4, 4, 4), "`w` is NULL",
               "matmul_fwd_res w = NULL");
    expect_err(op->matmul_fwd_res(be, buf, buf + 100, buf + 200, NULL, buf, 4, 0, 4), "positive",
               "matmul_fwd_res C = 0");
    expect_err(op->matmul_fwd_res(be, buf, buf + 100, buf + 200, NULL, buf + 8, 4, 4, 4), "partially",
               "matmul_fwd_res out over half of res");
    expect_err(op->matmul_fwd_res(be, buf, buf + 8, buf + 200, NULL, buf + 300, 4, 4, 4), "inp, w or bias",
               "matmul_fwd_res out over inp");
    expect_err(op->matmul_fwd_res(be, buf, buf + 100, buf + 200, buf + 12, buf + 300, 4, 4, 4),
               "inp, w or bias", "matmul_fwd_res out over bias");
    EXPECT(op->matmul_fwd_res(be, buf, buf + 100, buf + 200, buf + 16, buf, 4, 4, 4) == DG_OK,
           "matmul_fwd_res in place next to its operands: %s", dg_last_error());
    expect_err(op->matmul_bwd_dgelu(be, buf, buf, NULL, buf, buf, buf, NULL, 4, 4, 4, 0), "pre",
               "matmul_bwd_dgelu pre = NULL");
    expect_err(op->matmul_bwd_dgelu(be, buf, buf, NULL, buf, buf, buf, buf, 4, 4, 4, 0), "overlap",
               "matmul_bwd_dgelu dpre == pre");
    expect_err(op->layernorm_fwd(be, buf, NULL, buf, buf, buf, buf, 4, 4), "mean",
               "layernorm_fwd mean = NULL");
    expect_err(op->cast(be, buf, DG_I32, buf, DG_F32, 4), "cast", "cast to i32");
    expect_err(op->adamw(be, buf, NULL, buf, buf, buf, 4, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.f, 0, buf),
               "t must be", "adamw t = 0");
    expect_err(op->adamw(be, buf, NULL, buf, buf, buf, 4, 1e-3f, 1.5f, 0.95f, 1e-8f, 0.f, 1, buf), "betas",
               "adamw beta1 = 1.5");
    expect_err(op->to_host(be, NULL, buf, 16), "NULL", "to_host to NULL");
    /* v1.8: read-backs and fences */
    expect_err(op->download_async(be, NULL, buf, 16), "NULL", "download_async to NULL");
    expect_err(op->fence_record(be, NULL), "NULL", "fence_record of NULL");
    expect_err(op->fence_wait(be, NULL), "NULL", "fence_wait on NULL");
    expect_err(op->fence_create(be, NULL), "NULL", "fence_create into NULL");
    /* adamw_multi_dev's table rules (v1.6): sorted, not overlapping, offsets multiples of 4, inside span */
    dg_adamw_seg_t overlap[2] = {{0, 8, 0}, {4, 4, 0}}, odd[1] = {{2, 4, 0}}, beyond[1] = {{8, 4, 0}};
    expect_err(
        op->adamw_multi_dev(be, overlap, 2, 64, buf, NULL, buf, buf, buf, 0.9f, 0.95f, 1e-8f, 0.f, buf),
        "table rules", "adamw_multi_dev overlapping segments");
    expect_err(op->adamw_multi_dev(be, odd, 1, 64, buf, NULL, buf, buf, buf, 0.9f, 0.95f, 1e-8f, 0.f, buf),
               "multiple of 4", "adamw_multi_dev offset 2");
    expect_err(op->adamw_multi_dev(be, beyond, 1, 10, buf, NULL, buf, buf, buf, 0.9f, 0.95f, 1e-8f, 0.f, buf),
               "inside the 10-element", "adamw_multi_dev segment beyond span");
    /* sumsq_multi's table rules (v1.7): count >= 1, inside span, the device table holding the host one's
     * geometry; any order and overlaps are fine */
    dg_sumsq_seg_t empty[1] = {{0, 0, 0}}, past[1] = {{60, 8, 0}}, ok2[2] = {{8, 4, 0}, {0, 12, 0}},
                   other[2] = {{8, 4, 0}, {0, 13, 0}};
    expect_err(op->sumsq_multi(be, buf, buf + 1, 64, empty, empty, 1), "table rules", "sumsq_multi count 0");
    expect_err(op->sumsq_multi(be, buf, buf + 1, 64, past, past, 1), "inside the 64-element",
               "sumsq_multi segment beyond span");
    expect_err(op->sumsq_multi(be, buf, buf + 1, 64, ok2, other, 2), "device table",
               "sumsq_multi device table with another geometry");
    expect_err(op->sumsq_multi(be, buf, buf + 1, 64, ok2, ok2, -1), "nseg", "sumsq_multi nseg = -1");
    expect_err(op->sumsq_multi(be, NULL, buf + 1, 64, ok2, ok2, 2), "NULL", "sumsq_multi out = NULL");
    buf[0] = 0.0f;
    EXPECT(op->sumsq_multi(be, buf, buf + 1, 64, ok2, ok2, 2) == DG_OK,
           "sumsq_multi unsorted overlapping: %s", dg_last_error());
    float seq = 0.0f;
    EXPECT(op->sumsq_f32(be, &seq, buf + 1 + 8, 4) == DG_OK && op->sumsq_f32(be, &seq, buf + 1, 12) == DG_OK,
           "sumsq_f32");
    EXPECT(memcmp(&seq, buf, sizeof seq) == 0,
           "sumsq_multi over unsorted overlapping segments gave %.9g, the calls %.9g", (double)buf[0],
           (double)seq);

    /* CPU layout promise: aux holds the full probability matrix. */
    EXPECT(op->attention_aux_bytes(be, 2, 13, 72, 3) == (size_t)2 * 3 * 13 * 13 * 4, "attention_aux_bytes");
    /* A NaN gradient norm must not be hidden by clipping: the scale becomes NaN. */
    buf[0] = NAN;
    EXPECT(op->clip_scale(be, buf + 1, buf + 2, buf, 1.0f, 1.0f) == DG_OK, "clip_scale NaN");
    EXPECT(isnan(buf[1]) && isnan(buf[2]), "clip_scale of a NaN sumsq gave scale %g, norm %g", buf[1],
           buf[2]);
    op->free(be, buf);
    dg_backend_free(be);
    printf("cpu backend error checks: %s\n", dg_fails ? "FAILED" : "passed");
}

/* matmul_fwd_res against matmul_fwd + add on the same backend, bit for bit: out of place and in place
 * (out == res), with and without bias, shapes of one tile and of many (rows and columns split), at 1 and 3
 * threads. Runs with --errors (ctest backend_cpu_errors). */
static void res_pair_checks(void) {
    const int shapes[][4] = {
        {26, 72, 72, 1}, {13, 37, 19, 0}, {300, 576, 160, 1}, {1100, 64, 2600, 1}, {520, 96, 300, 0}};
    const int threads[2] = {1, 3};
    for (int t = 0; t < 2; t++) {
        dg_backend_t *be = make(threads[t]);
        const dg_backend_ops_t *op = be->ops;
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
            const int N = shapes[k][0], C = shapes[k][1], OC = shapes[k][2], hb = shapes[k][3];
            const size_t nx = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
            float *x, *w, *b, *r, *o1, *o2, *tmp;
            DG_ASSERT(
                op->alloc(be, nx * 4, (void **)&x) == DG_OK && op->alloc(be, nw * 4, (void **)&w) == DG_OK &&
                op->alloc(be, (size_t)OC * 4, (void **)&b) == DG_OK &&
                op->alloc(be, no * 4, (void **)&r) == DG_OK && op->alloc(be, no * 4, (void **)&o1) == DG_OK &&
                op->alloc(be, no * 4, (void **)&o2) == DG_OK &&
                op->alloc(be, no * 4, (void **)&tmp) == DG_OK);
            uint64_t s = 0x9E3779B97F4A7C15ull * (k + 1);
            float *all[4] = {x, w, b, r};
            size_t cnt[4] = {nx, nw, (size_t)OC, no};
            for (int a = 0; a < 4; a++)
                for (size_t i = 0; i < cnt[a]; i++) {
                    s = s * 6364136223846793005ull + 1442695040888963407ull;
                    all[a][i] = (float)((double)(s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
                }
            const float *bias = hb ? b : NULL;
            EXPECT(op->matmul_fwd(be, tmp, NULL, x, w, bias, N, C, OC, DG_EPI_NONE) == DG_OK &&
                       op->add(be, o1, tmp, r, no) == DG_OK,
                   "matmul_fwd + add: %s", dg_last_error());
            EXPECT(op->matmul_fwd_res(be, o2, x, w, bias, r, N, C, OC) == DG_OK, "matmul_fwd_res: %s",
                   dg_last_error());
            EXPECT(memcmp(o1, o2, no * 4) == 0,
                   "matmul_fwd_res [N=%d,C=%d,OC=%d%s] (%d threads) is not bitwise matmul_fwd + add", N, C,
                   OC, hb ? ",bias" : "", threads[t]);
            /* in place: the graph's add order is (residual, product); float addition commutes */
            EXPECT(op->add(be, o1, r, tmp, no) == DG_OK, "add");
            EXPECT(op->matmul_fwd_res(be, r, x, w, bias, r, N, C, OC) == DG_OK, "matmul_fwd_res in place: %s",
                   dg_last_error());
            EXPECT(
                memcmp(o1, r, no * 4) == 0,
                "matmul_fwd_res in place [N=%d,C=%d,OC=%d%s] (%d threads) is not bitwise add(res, product)",
                N, C, OC, hb ? ",bias" : "", threads[t]);
            float *bufs[7] = {x, w, b, r, o1, o2, tmp};
            for (int a = 0; a < 7; a++)
                op->free(be, bufs[a]);
        }
        dg_backend_free(be);
    }
    printf("cpu backend matmul_fwd_res == matmul_fwd + add: %s\n", dg_fails ? "FAILED" : "passed");
}

static int threads_compare(const char *list, const dg_harness_opts_t *base) {
    char *texts[16] = {0};
    int counts[16], n = 0, fails = 0;
    char *dup = strdup(list), *save = NULL;
    for (char *t = strtok_r(dup, ",", &save); t && n < 16; t = strtok_r(NULL, ",", &save)) {
        counts[n] = atoi(t);
        if (counts[n] < 1) {
            fprintf(stderr, "--threads-compare: bad thread count '%s'\n", t);
            free(dup);
            return 1;
        }
        size_t len = 0;
        FILE *mem = open_memstream(&texts[n], &len);
        dg_harness_opts_t o = *base;
        o.digests = mem;
        o.skip_fd = 1; /* the finite differences only exercise the float64 reference */
        dg_backend_t *be = make(counts[n]);
        printf("-- threads=%d\n", counts[n]);
        fails += dg_op_harness_run(be, &o) != 0;
        dg_backend_free(be);
        fclose(mem);
        n++;
    }
    free(dup);
    for (int i = 1; i < n; i++) {
        if (strcmp(texts[0], texts[i]) == 0) {
            printf("threads=%d vs threads=%d: every case bit-identical\n", counts[0], counts[i]);
            continue;
        }
        fails++;
        /* name the cases that differ */
        char *sa = NULL, *sb = NULL;
        char *a = strdup(texts[0]), *b = strdup(texts[i]);
        char *la = strtok_r(a, "\n", &sa), *lb = strtok_r(b, "\n", &sb);
        for (; la && lb; la = strtok_r(NULL, "\n", &sa), lb = strtok_r(NULL, "\n", &sb))
            if (strcmp(la, lb) != 0)
                printf("FAIL threads=%d vs %d differ: %s | %s\n", counts[0], counts[i], la, lb);
        free(a);
        free(b);
    }
    for (int i = 0; i < n; i++)
        free(texts[i]);
    return fails ? 1 : 0;
}

int main(int argc, char **argv) {
    dg_harness_opts_t o;
    dg_harness_opts_init(&o);
    int threads = 0, errors_only = 0;
    const char *digests = NULL, *compare = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(a, "--only") && i + 1 < argc)
            o.only = argv[++i];
        else if (!strcmp(a, "--verbose"))
            o.verbose = 1;
        else if (!strcmp(a, "--no-fd"))
            o.skip_fd = 1;
        else if (!strcmp(a, "--digests") && i + 1 < argc)
            digests = argv[++i];
        else if (!strcmp(a, "--threads-compare") && i + 1 < argc)
            compare = argv[++i];
        else if (!strcmp(a, "--errors"))
            errors_only = 1;
        else {
            fprintf(
                stderr,
                "usage: %s [--threads N] [--only SUBSTR] [--verbose] [--no-fd] [--digests FILE] | --errors | "
                "--threads-compare 1,2,3\n",
                argv[0]);
            return 1;
        }
    }
    if (errors_only) {
        error_checks();
        res_pair_checks();
        return dg_fails ? 1 : 0;
    }
    if (compare) return threads_compare(compare, &o);

    FILE *df = NULL;
    if (digests) {
        df = fopen(digests, "w");
        if (!df) {
            fprintf(stderr, "cannot write %s\n", digests);
            return 1;
        }
        o.digests = df;
    }
    dg_backend_t *be = make(threads);
    int failures = dg_op_harness_run(be, &o);
    dg_backend_free(be);
    if (df) fclose(df);
    return failures ? 1 : 0;
}
