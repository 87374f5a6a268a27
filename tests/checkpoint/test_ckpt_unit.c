/* test_ckpt_unit.c — unit tests of the checkpoint internals on one process: the content hash is the same
 * for every decomposition and changes with the data, tensor-table validation gives clear messages,
 * name parsing, meta key/values, and a save/load round trip on MPI_COMM_SELF that covers every meta
 * field (including a config text too large for a compact HDF5 attribute) and an empty tensor list. */
#define _GNU_SOURCE
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt_impl.h"
#include "dg_check.h"

static uint64_t rng_state = 12345;
static uint64_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* Hash of a tensor cut into a grid of boxes: cuts[d] random split points on each dim. */
static uint64_t hash_boxes(int nd, const int64_t *g, const float *full, int maxcuts, int *nboxes) {
    int64_t cut[4][8];
    int nc[4];
    for (int d = 0; d < nd; d++) {
        nc[d] = 1 + (int)(rnd() % (uint64_t)maxcuts);
        if (nc[d] > g[d]) nc[d] = (int)g[d];
        cut[d][0] = 0;
        for (int k = 1; k < nc[d]; k++)
            cut[d][k] = 1 + (int64_t)(rnd() % (uint64_t)(g[d] - 1 > 0 ? g[d] - 1 : 1));
        /* sort the cut points */
        for (int a = 1; a < nc[d]; a++)
            for (int b = a; b > 0 && cut[d][b] < cut[d][b - 1]; b--) {
                int64_t x = cut[d][b];
                cut[d][b] = cut[d][b - 1], cut[d][b - 1] = x;
            }
        cut[d][nc[d]] = g[d];
    }
    ckpt_tdesc_t td;
    memset(&td, 0, sizeof td);
    td.path = "t";
    td.ndim = nd;
    memcpy(td.gshape, g, sizeof(int64_t) * (size_t)nd);
    ckpt_table_t tab = {1, &td, NULL};
    ckh_t h;
    ckh_init(&h, 1);
    int idx[4] = {0, 0, 0, 0}, n = 0;
    for (;;) {
        int64_t st[4], cn[4];
        for (int d = 0; d < nd; d++)
            st[d] = cut[d][idx[d]], cn[d] = cut[d][idx[d] + 1] - st[d];
        int64_t cnt = ckpt_numel(nd, cn);
        float *piece = malloc((size_t)(cnt > 0 ? cnt : 1) * 4);
        /* gather the box out of the full row-major tensor */
        int64_t li = 0, p[4] = {0, 0, 0, 0};
        for (li = 0; li < cnt; li++) {
            int64_t gi = 0;
            for (int d = 0; d < nd; d++)
                gi = gi * g[d] + st[d] + p[d];
            piece[li] = full[gi];
            for (int d = nd - 1; d >= 0; d--) {
                if (++p[d] < cn[d]) break;
                p[d] = 0;
            }
        }
        ckh_add(&h, 0, nd, g, st, cn, piece);
        free(piece);
        n++;
        int d = nd - 1;
        for (; d >= 0; d--) {
            if (++idx[d] < nc[d]) break;
            idx[d] = 0;
        }
        if (d < 0) break;
    }
    uint64_t out = 0;
    dg_status_t s = ckh_finish(&h, MPI_COMM_NULL, &tab, &out);
    CHECK(s == DG_OK, "ckh_finish: %s", dg_last_error());
    ckh_free(&h);
    *nboxes = n;
    return out;
}

static void test_hash(void) {
    struct {
        int nd;
        int64_t g[4];
    } shapes[] = {{1, {1}},       {1, {1024}},  {1, {4097}},       {2, {3, 1024}},      {2, {2, 1025}},
                  {2, {5, 3000}}, {2, {64, 7}}, {3, {2, 3, 2100}}, {4, {2, 2, 3, 1500}}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int nd = shapes[si].nd;
        const int64_t *g = shapes[si].g;
        int64_t n = ckpt_numel(nd, g);
        float *a = malloc((size_t)n * 4);
        for (int64_t i = 0; i < n; i++)
            a[i] = (float)((int64_t)(rnd() % 2000001) - 1000000) * 1e-3f;
        int nb = 0;
        uint64_t ref = hash_boxes(nd, g, a, 1, &nb);
        for (int trial = 0; trial < 12; trial++) {
            uint64_t h = hash_boxes(nd, g, a, 7, &nb);
            CHECK(h == ref, "shape #%zu: %d boxes give %016llx, one box %016llx", si, nb,
                  (unsigned long long)h, (unsigned long long)ref);
        }
        /* any change of one element changes the hash */
        int64_t k = (int64_t)(rnd() % (uint64_t)n);
        float keep = a[k];
        a[k] = keep + 1.0f;
        CHECK(hash_boxes(nd, g, a, 5, &nb) != ref, "shape #%zu: changed element %lld, same hash", si,
              (long long)k);
        a[k] = keep;
        if (n > 1) { /* so does swapping two different elements (position matters) */
            int64_t j = (k + 1) % n;
            if (a[j] != a[k]) {
                float t = a[j];
                a[j] = a[k], a[k] = t;
                CHECK(hash_boxes(nd, g, a, 5, &nb) != ref, "shape #%zu: swap, same hash", si);
                a[k] = a[j], a[j] = t;
            }
        }
        /* the shape is part of the hash: same bytes, different shape */
        CHECK(ckh_final(12345, nd, g) != ckh_final(12345, 1, &n) || nd == 1, "shape not hashed");
        free(a);
    }
    /* two pieces claiming the same part of a split tile are refused */
    int64_t g[1] = {3000}, st1[1] = {0}, c1[1] = {1500}, st2[1] = {1400}, c2[1] = {1600};
    float *z = calloc(3000, 4);
    ckpt_tdesc_t td;
    memset(&td, 0, sizeof td);
    td.path = "model/overlap";
    td.ndim = 1;
    td.gshape[0] = 3000;
    ckpt_table_t tab = {1, &td, NULL};
    ckh_t h;
    ckh_init(&h, 1);
    ckh_add(&h, 0, 1, g, st1, c1, z);
    ckh_add(&h, 0, 1, g, st2, c2, z);
    uint64_t out;
    dg_status_t s = ckh_finish(&h, MPI_COMM_NULL, &tab, &out);
    CHECK(s == DG_ERR_USAGE && strstr(dg_last_error(), "model/overlap") && strstr(dg_last_error(), "overlap"),
          "overlap not caught: %s", dg_last_error());
    ckh_free(&h);
    ckh_init(&h, 1);
    int64_t c3[1] = {1000}, st4[1] = {1100}, c4[1] = {1900};
    ckh_add(&h, 0, 1, g, st1, c3, z);
    ckh_add(&h, 0, 1, g, st4, c4, z);
    s = ckh_finish(&h, MPI_COMM_NULL, &tab, &out);
    CHECK(s == DG_ERR_USAGE && strstr(dg_last_error(), "gap"), "gap not caught: %s", dg_last_error());
    ckh_free(&h);
    free(z);
}

static dg_ckpt_tensor_t mk(const char *path, int nd, int64_t g0, int64_t g1, int64_t s0, int64_t c0,
                           float *data, int owner) {
    dg_ckpt_tensor_t t;
    memset(&t, 0, sizeof t);
    t.path = path;
    t.ndim = nd;
    t.gshape[0] = g0, t.gshape[1] = g1;
    t.start[0] = s0, t.count[0] = c0;
    t.count[1] = g1;
    t.data = data;
    t.owner = owner;
    return t;
}

/* The local hash work is split into items and spread over threads (table.c): any thread count must give
 * the serial result, for pieces of 1, 2 and 3 dimensions large enough to be split into several items,
 * with fragments (tiles split between pieces) among them. */
static void test_hash_threads(void) {
    const int64_t R = 1500, C = 1100, V = 2500000; /* 1.65 M and 2.5 M floats: several 1 Mi-element items */
    float *a = malloc((size_t)(R * C) * 4), *v = malloc((size_t)V * 4),
          *q = malloc((size_t)(12 * 300 * 700) * 4);
    for (int64_t i = 0; i < R * C; i++)
        a[i] = (float)(rnd() % 100000) * 1e-3f;
    for (int64_t i = 0; i < V; i++)
        v[i] = (float)(rnd() % 100000) * 1e-3f;
    for (int64_t i = 0; i < 12 * 300 * 700; i++)
        q[i] = (float)(rnd() % 100000) * 1e-3f;
    /* a: rows split 0..700 / 700..1500; v: 1-D split at 1,234,567 (not a tile boundary: fragments);
     * q: [12, 300, 700] as one piece */
    dg_ckpt_tensor_t t[5];
    t[0] = mk("a", 2, R, C, 0, 700, a, 1);
    t[1] = mk("a", 2, R, C, 700, R - 700, a + 700 * C, 1);
    t[2] = mk("v", 1, V, 0, 0, 1234567, v, 1);
    t[3] = mk("v", 1, V, 0, 1234567, V - 1234567, v + 1234567, 1);
    memset(&t[4], 0, sizeof t[4]);
    t[4].path = "q", t[4].ndim = 3, t[4].owner = 1, t[4].data = q;
    t[4].gshape[0] = t[4].count[0] = 12, t[4].gshape[1] = t[4].count[1] = 300,
    t[4].gshape[2] = t[4].count[2] = 700;
    uint64_t ref[3] = {0};
    for (int threads = 1; threads <= 8; threads *= 2) {
        ckpt_table_t tab;
        CHECK(ckpt_table_build(t, 5, 0, &tab) == DG_OK, "table: %s", dg_last_error());
        CHECK(ckpt_table_agree(MPI_COMM_SELF, t, &tab) == DG_OK, "agree: %s", dg_last_error());
        CHECK(ckpt_table_hash(MPI_COMM_SELF, t, &tab, threads) == DG_OK, "hash: %s", dg_last_error());
        for (int i = 0; i < 3; i++) {
            if (threads == 1)
                ref[i] = tab.t[i].hash;
            else
                CHECK(tab.t[i].hash == ref[i], "tensor %d: %d threads give %016llx, 1 thread %016llx", i,
                      threads, (unsigned long long)tab.t[i].hash, (unsigned long long)ref[i]);
        }
        ckpt_table_free(&tab);
    }
    /* and the serial definition (ckh_add over whole pieces, no items) agrees */
    ckpt_tdesc_t td[3];
    memset(td, 0, sizeof td);
    td[0].path = "a", td[0].ndim = 2, td[0].gshape[0] = R, td[0].gshape[1] = C;
    td[1].path = "v", td[1].ndim = 1, td[1].gshape[0] = V;
    td[2].path = "q", td[2].ndim = 3, td[2].gshape[0] = 12, td[2].gshape[1] = 300, td[2].gshape[2] = 700;
    ckpt_table_t tab = {3, td, NULL};
    ckh_t h;
    ckh_init(&h, 3);
    for (int k = 0; k < 5; k++)
        ckh_add(&h, k < 2 ? 0 : k < 4 ? 1 : 2, t[k].ndim, t[k].gshape, t[k].start, t[k].count, t[k].data);
    uint64_t out[3];
    CHECK(ckh_finish(&h, MPI_COMM_NULL, &tab, out) == DG_OK, "finish: %s", dg_last_error());
    for (int i = 0; i < 3; i++)
        CHECK(out[i] == ref[i], "tensor %d: serial %016llx, table %016llx", i, (unsigned long long)out[i],
              (unsigned long long)ref[i]);
    ckh_free(&h);
    free(a), free(v), free(q);
}

static void expect_table_error(dg_ckpt_tensor_t *t, int n, const char *needle, const char *what) {
    ckpt_table_t tab;
    dg_status_t s = ckpt_table_build(t, n, 0, &tab);
    CHECK(s == DG_ERR_USAGE && strstr(dg_last_error(), needle),
          "%s: expected an error containing '%s', got %d '%s'", what, needle, s, dg_last_error());
    if (s == DG_OK) ckpt_table_free(&tab);
}

static void test_table(void) {
    float buf[64] = {0};
    dg_ckpt_tensor_t t[4];
    /* one bad tensor each: name, ndim, global dims, slab start and count on dim 0, data NULL, owner */
    static const struct {
        const char *name;
        int nd, g0, g1, off, cnt, no_data, owner;
        const char *needle, *what;
    } bad[] = {
        {"model/a b", 2, 4, 4, 0, 4, 0, 1, "not allowed", "space in path"},
        {"model/../x", 2, 4, 4, 0, 4, 0, 1, "'..'", "dot-dot"},
        {"/model/x", 2, 4, 4, 0, 4, 0, 1, "empty", "leading slash"},
        {"state/x", 2, 4, 4, 0, 4, 0, 1, "reserved", "reserved name"},
        {"model/x", 0, 4, 4, 0, 4, 0, 1, "ndim", "ndim 0"},
        {"model/x", 2, 4, 4, 2, 3, 0, 1, "outside the global size", "slab past the end"},
        {"model/x", 2, 4, 4, 0, 4, 1, 1, "data is NULL", "null data"},
        {"model/x", 2, 4, 4, 0, 4, 0, 7, "owner", "owner 7"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        t[0] = mk(bad[i].name, bad[i].nd, bad[i].g0, bad[i].g1, bad[i].off, bad[i].cnt,
                  bad[i].no_data ? NULL : buf, bad[i].owner);
        expect_table_error(t, 1, bad[i].needle, bad[i].what);
    }
    t[0] = mk("model/x", 2, 4, 4, 0, 2, buf, 1);
    t[1] = mk("model/x", 2, 5, 4, 2, 2, buf, 1);
    expect_table_error(t, 2, "disagree on the global shape", "shape disagreement");
    t[0] = mk("model/x", 2, 4, 4, 0, 4, buf, 1);
    t[1] = mk("model/x.y", 1, 4, 1, 0, 4, buf, 1);
    t[2] = mk("model/x/m", 1, 4, 1, 0, 4, buf, 1);
    expect_table_error(t, 3, "one is a group of the other", "dataset vs group");

    /* grouping keeps first-appearance order and collects pieces */
    t[0] = mk("model/b", 2, 4, 4, 0, 2, buf, 1);
    t[1] = mk("model/a", 1, 8, 1, 0, 8, buf, 1);
    t[2] = mk("model/b", 2, 4, 4, 2, 2, buf + 8, 1);
    t[0].count[1] = t[2].count[1] = 4;
    t[1].count[1] = 0;
    t[1].gshape[1] = 0;
    ckpt_table_t tab;
    dg_status_t s = ckpt_table_build(t, 3, 0, &tab);
    CHECK(s == DG_OK, "build: %s", dg_last_error());
    if (!s) {
        CHECK(tab.n == 2 && !strcmp(tab.t[0].path, "model/b") && tab.t[0].npieces == 2 &&
                  tab.t[1].npieces == 1,
              "grouping wrong");
        s = ckpt_table_agree(MPI_COMM_SELF, t, &tab);
        CHECK(s == DG_OK, "agree: %s", dg_last_error());
        ckpt_table_free(&tab);
    }
    /* owned pieces that overlap: the element count gives it away */
    t[2].start[0] = 1;
    t[2].count[0] = 3;
    s = ckpt_table_build(t, 3, 0, &tab);
    if (!s) {
        s = ckpt_table_agree(MPI_COMM_SELF, t, &tab);
        CHECK(s == DG_ERR_USAGE && strstr(dg_last_error(), "model/b") && strstr(dg_last_error(), "cover 20"),
              "overlap by count: %s", dg_last_error());
        ckpt_table_free(&tab);
    }
}

static void test_names(void) {
    int partial = -1;
    CHECK(ckpt_parse_name("step_00000012.h5", &partial) == 12 && partial == 0, "final name");
    CHECK(ckpt_parse_name("step_7.h5.partial", &partial) == 7 && partial == 1, "partial name");
    CHECK(ckpt_parse_name("step_.h5", &partial) == -1, "no digits");
    CHECK(ckpt_parse_name("step_12.h5.tmp", &partial) == -1, "other suffix");
    CHECK(ckpt_parse_name("LATEST", &partial) == -1, "LATEST");
    CHECK(ckpt_parse_name("step_99999999999999999999999.h5", &partial) == -1, "overflow");
    char b[64];
    ckpt_step_name(42, b, sizeof b);
    CHECK(!strcmp(b, "step_00000042.h5"), "step name %s", b);
    dg_ckpt_meta_t m;
    dg_ckpt_meta_init(&m);
    CHECK(dg_ckpt_meta_set_kv(&m, "a.b-c_d", "v1") == DG_OK, "kv");
    CHECK(dg_ckpt_meta_set_kv(&m, "a.b-c_d", "v2") == DG_OK && m.n_kv == 1, "kv replace");
    CHECK(!strcmp(dg_ckpt_meta_get_kv(&m, "a.b-c_d"), "v2"), "kv get");
    CHECK(dg_ckpt_meta_set_kv(&m, "bad key", "x") == DG_ERR_USAGE, "bad key accepted");
    CHECK(dg_ckpt_meta_get_kv(&m, "missing") == NULL, "missing key");
    dg_ckpt_meta_destroy(&m);
}

static void test_roundtrip(void) {
    char dir[] = "/tmp/dgckpt_unit_XXXXXX";
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    dg_ckpt_meta_t m;
    dg_ckpt_meta_init(&m);
    m.step = 123456789;
    m.tokens = 987654321012LL;
    snprintf(m.mesh, sizeof m.mesh, "dp_replicate=1,dp_shard=1,tp=1");
    size_t big = 100000; /* more than a compact attribute can hold (64 KiB) */
    char *cfg = malloc(big + 1);
    for (size_t i = 0; i < big; i++)
        cfg[i] = (char)('a' + i % 26);
    cfg[big] = 0;
    dg_ckpt_meta_set_config(&m, cfg);
    m.loader.epoch = 3, m.loader.cursor = 77, m.loader.samples_seen = 1ULL << 40;
    m.scaler.scale = 0.5, m.scaler.good_steps = 9;
    m.n_rng = 2, m.rng[0] = 1, m.rng[1] = UINT64_MAX;
    dg_ckpt_meta_set_kv(&m, "k1", "hello world");
    float a[6] = {1, 2, 3, 4, 5, 6}, r[6] = {0};
    dg_ckpt_tensor_t t = mk("model/w", 2, 2, 3, 0, 2, a, 1);
    dg_ckpt_save_result_t res;
    dg_status_t s = dg_ckpt_save(MPI_COMM_SELF, dir, &m, &t, 1, NULL, &res);
    CHECK(s == DG_OK, "save: %s", dg_last_error());
    CHECK(res.logical_bytes == 24 && res.n_tensors == 1 && res.bytes > 0, "result");
    dg_ckpt_meta_t got;
    t.data = r;
    s = dg_ckpt_load(MPI_COMM_SELF, res.path, &got, &t, 1);
    CHECK(s == DG_OK, "load: %s", dg_last_error());
    if (!s) {
        CHECK(!memcmp(a, r, sizeof a), "data");
        CHECK(got.step == m.step && got.tokens == m.tokens && !strcmp(got.mesh, m.mesh), "step/tokens/mesh");
        CHECK(got.config_text && !strcmp(got.config_text, cfg), "config text (100 kB)");
        CHECK(got.loader.epoch == 3 && got.loader.cursor == 77 && got.loader.samples_seen == 1ULL << 40,
              "loader");
        CHECK(got.scaler.scale == 0.5 && got.scaler.good_steps == 9, "scaler");
        CHECK(got.n_rng == 2 && got.rng[0] == 1 && got.rng[1] == UINT64_MAX, "rng");
        CHECK(got.n_kv == 1 && !strcmp(dg_ckpt_meta_get_kv(&got, "k1"), "hello world"), "kv");
        CHECK(got.world_size == 1 && !strcmp(got.version, DG_VERSION_STRING) &&
                  got.created_unix > 1600000000 && strlen(got.created) == 20 &&
                  got.format_version == DG_CKPT_FORMAT_VERSION,
              "stamped fields: world %d version %s created %s", got.world_size, got.version, got.created);
        dg_ckpt_meta_destroy(&got);
    }
    /* meta only: no tensors at all */
    m.step = 5;
    s = dg_ckpt_save(MPI_COMM_SELF, dir, &m, NULL, 0, NULL, &res);
    CHECK(s == DG_OK, "empty save: %s", dg_last_error());
    s = dg_ckpt_load(MPI_COMM_SELF, res.path, &got, NULL, 0);
    CHECK(s == DG_OK && got.step == 5, "empty load: %s", dg_last_error());
    if (!s) dg_ckpt_meta_destroy(&got);
    CHECK(dg_ckpt_verify(res.path, NULL, NULL) == DG_OK, "verify empty: %s", dg_last_error());
    /* asking for a tensor the file lacks */
    t.path = "model/absent";
    s = dg_ckpt_load(MPI_COMM_SELF, res.path, &got, &t, 1);
    CHECK(s == DG_ERR_USAGE && strstr(dg_last_error(), "model/absent") && strstr(dg_last_error(), "missing"),
          "absent: %s", dg_last_error());
    free(cfg);
    dg_ckpt_meta_destroy(&m);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0, "cleanup");
}

int main(int argc, char **argv) {
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    dg_log_set_level(DG_LOG_WARN);
    test_hash();
    test_hash_threads();
    test_table();
    test_names();
    test_roundtrip();
    printf("%d checks, %d failed\n", dg_checks, dg_fails);
    MPI_Finalize();
    return dg_fails ? 1 : 0;
}
