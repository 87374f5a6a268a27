/* test_config.c — unit tests of the config module: the schema table, defaults, every bad-input class
 * with its exact one-line message, override order (defaults < file < --set, later --set wins), value
 * sources, INI syntax details (quotes, comments, indentation, long lines, CRLF, BOM), cross-key
 * checks, and the INI round trip behind the config hash.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config.h"
#include "config_impl.h"
#include "dg_check.h"

static char g_dir[256];

/* write a file in the temp dir; returns its path (static buffer rotation) */
static const char *write_file(const char *name, const char *text, size_t len) {
    static char paths[8][512];
    static int k;
    char *p = paths[k++ % 8];
    snprintf(p, 512, "%s/%s", g_dir, name);
    FILE *f = fopen(p, "wb");
    if (!f) {
        perror(p);
        exit(2);
    }
    fwrite(text, 1, len, f);
    fclose(f);
    return p;
}
static const char *wfile(const char *name, const char *text) {
    return write_file(name, text, strlen(text));
}

static dg_config_t g_cfg;

/* load `text` as file `name` plus --set args; return status, message in dg_last_error() */
static dg_status_t load(const char *name, const char *text, int nsets, const char *const *sets) {
    dg_clear_error();
    return dg_config_load(&g_cfg, text ? wfile(name, text) : NULL, nsets, sets);
}

/* expect a usage error whose message equals `want` with "@" replaced by the temp file path */
static void expect_err(const char *name, const char *text, int nsets, const char *const *sets,
                       const char *want, int line) {
    dg_status_t s = load(name, text, nsets, sets);
    char full[2048];
    char path[600];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    size_t o = 0;
    for (const char *w = want; *w && o + strlen(path) + 2 < sizeof full; w++) {
        if (*w == '@') {
            memcpy(full + o, path, strlen(path));
            o += strlen(path);
        } else {
            full[o++] = *w;
        }
    }
    full[o] = 0;
    dg_checks++;
    if (s != DG_ERR_USAGE) {
        dg_fails++;
        fprintf(stderr, "FAIL test_config.c:%d: status %d, want 1 (message: %s)\n", line, s, dg_last_error());
        return;
    }
    dg_check_str(dg_last_error(), full, __FILE__, line);
    dg_checks++;
    if (strchr(dg_last_error(), '\n')) {
        dg_fails++;
        fprintf(stderr, "FAIL test_config.c:%d: message has a newline\n", line);
    }
}
#define EXPECT_ERR(name, text, want) expect_err(name, text, 0, NULL, want, __LINE__)
#define EXPECT_SET_ERR(sets, n, want) expect_err("x", NULL, n, sets, want, __LINE__)

static void test_schema(void) {
    /* every section known, no duplicate key, docs present, defaults valid for their own rules */
    for (int i = 0; i < dg_cfg_nkeys; i++) {
        const dg_cfg_key_t *k = &dg_cfg_schema[i];
        int sec = 0;
        for (int j = 0; j < dg_cfg_nsections; j++)
            sec |= strcmp(dg_cfg_sections[j], k->section) == 0;
        CHECK(sec);
        CHECK(k->doc && strlen(k->doc) > 8);
        for (int j = 0; j < i; j++)
            CHECK(!(strcmp(dg_cfg_schema[j].section, k->section) == 0 &&
                    strcmp(dg_cfg_schema[j].key, k->key) == 0));
        for (int j = 0; j < i; j++)
            CHECK(dg_cfg_schema[j].offset != k->offset);
        switch (k->type) {
        case DG_CFGT_INT:
            CHECK(k->size == sizeof(int64_t) && k->imin <= k->imax);
            break;
        case DG_CFGT_FLOAT:
            CHECK(k->size == sizeof(double) && k->fmin <= k->fmax);
            break;
        case DG_CFGT_BOOL:
            CHECK(k->size == sizeof(int));
            break;
        case DG_CFGT_ENUM: {
            CHECK(k->choices != NULL);
            char buf[256];
            snprintf(buf, sizeof buf, "%s", k->choices);
            for (char *save = NULL, *t = strtok_r(buf, "|", &save); t; t = strtok_r(NULL, "|", &save))
                CHECK(strlen(t) < k->size);
            break;
        }
        case DG_CFGT_STR:
            CHECK(k->size >= 8);
            break;
        }
        CHECK(dg_cfg_find(k->section, k->key) == i);
    }
    /* every field of dg_config_t before `source` is covered by a row (or is the enum id of one): sort the
     * fields by offset and allow only alignment padding between them */
    struct {
        size_t off, size, align;
        const char *sec, *key, *what;
    } f[2 * DG_CFG_MAX_KEYS];
    int nf = 0;
    for (int i = 0; i < dg_cfg_nkeys; i++) {
        const dg_cfg_key_t *k = &dg_cfg_schema[i];
        size_t align = k->type == DG_CFGT_STR || k->type == DG_CFGT_ENUM ? 1 : k->size;
        f[nf++] = (__typeof__(f[0])){k->offset, k->size, align, k->section, k->key, ""};
        if (k->has_id) {
            CHECK(k->type == DG_CFGT_ENUM);
            f[nf++] =
                (__typeof__(f[0])){k->id_offset, sizeof(int), sizeof(int), k->section, k->key, " (its id)"};
        }
    }
    for (int i = 1; i < nf; i++)
        for (int j = i; j > 0 && f[j].off < f[j - 1].off; j--) {
            __typeof__(f[0]) t = f[j];
            f[j] = f[j - 1];
            f[j - 1] = t;
        }
    size_t end = 0;
    for (int i = 0; i < nf; i++) {
        dg_checks++;
        if (f[i].off < end || f[i].off - end >= f[i].align) {
            dg_fails++;
            fprintf(stderr, "FAIL schema: gap or overlap before %s.%s%s (offset %zu, previous end %zu)\n",
                    f[i].sec, f[i].key, f[i].what, f[i].off, end);
        }
        end = f[i].off + f[i].size;
    }
    CHECK(offsetof(dg_config_t, source) - end < 8);
    CHECK(dg_cfg_nkeys >= 56); /* the keys of config.h at the time of writing */
}

static void test_defaults(void) {
    CHECK(load(NULL, NULL, 0, NULL) == DG_OK);
    dg_config_t *c = &g_cfg;
    CHECK_STR(c->run.name, "dgtrain");
    CHECK_STR(c->run.dir, "runs/default");
    CHECK(c->run.seed == 1337);
    CHECK_STR(c->run.log_level, "info");
    CHECK_STR(c->model.preset, "tiny");
    CHECK(c->model.n_layer == 0 && c->model.n_head == 0 && c->model.d_model == 0 && c->model.seq_len == 0 &&
          c->model.vocab_size == 0);
    CHECK_STR(c->data.train, "");
    CHECK(c->data.val_every == 50 && c->data.val_batches == 4 && c->data.shuffle == 1);
    CHECK(c->train.steps == 300 && c->train.global_batch == 16 && c->train.micro_batch == 8);
    CHECK(c->train.lr == 3e-3 && c->train.warmup_steps == 20 && c->train.min_lr_ratio == 0.1);
    CHECK(c->train.weight_decay == 0.1 && c->train.grad_clip == 1.0 && c->train.beta1 == 0.9 &&
          c->train.beta2 == 0.95 && c->train.eps == 1e-8);
    CHECK_STR(c->train.precision, "fp32");
    CHECK_STR(c->train.reduce_dtype, "fp32");
    CHECK_STR(c->train.recompute, "none");
    CHECK(c->train.log_every == 1 && c->train.loss_scale_init == 65536 &&
          c->train.loss_scale_growth_interval == 1000);
    CHECK(c->train.spike_factor == 2 && c->train.spike_window == 50 && c->train.spike_max_consecutive == 3);
    CHECK(c->train.spike_mode_id == 0 && c->train.spike_zscore == 6 && c->train.spike_val_factor == 1.05 &&
          c->train.spike_pause_steps == 5 && c->train.rollback_max == 3 && c->train.rollback_window == 1000);
    CHECK(c->train.loss_scale_growth_id == 0 && c->train.loss_scale_window_min == 20 &&
          c->train.loss_scale_window_max == 500 && c->train.overflow_threshold == 0.008 &&
          c->train.overflow_steps == 3 && c->train.overflow_window == 100);
    CHECK_STR(c->parallel.backend, "auto");
    CHECK_STR(c->parallel.comm, "auto");
    CHECK_STR(c->parallel.reduce_scatter, "ring");
    CHECK_STR(c->parallel.mesh, "auto");
    CHECK(c->parallel.reshard_after_forward == 1 && c->parallel.bucket_mb == 25 &&
          c->parallel.prefetch_budget_mb == 256);
    CHECK(c->parallel.overlap == 1 && c->parallel.cuda_graph == 1 && c->parallel.threads == 0);
    CHECK(c->parallel.nccl_nonblocking == 0);
    CHECK_STR(c->checkpoint.dir, "");
    CHECK(c->checkpoint.every == 0 && c->checkpoint.keep == 3 && c->checkpoint.async == 0 &&
          c->checkpoint.incremental == 0);
    CHECK(c->checkpoint.threads == 0 && c->checkpoint.space_check == 1);
    CHECK_STR(c->checkpoint.resume, "auto");
    CHECK(c->health.heartbeat_s == 5 && c->health.timeout_s == 120);
    CHECK_STR(c->topology.xml, "");
    CHECK_STR(c->topology.bind, "auto");
    CHECK(c->topology.world == 0);
    for (int i = 0; i < dg_cfg_nkeys; i++)
        CHECK_STR(c->source[i], "default");
    CHECK_STR(c->path, "");
}

static void test_errors(void) {
    EXPECT_ERR("a.ini", "[trian]\nsteps = 10\n", "@:1: unknown section [trian]; did you mean [train]?");
    EXPECT_ERR("a.ini", "# c\n[zzzzzzzz]\n",
               "@:2: unknown section [zzzzzzzz]; expected one of [run] [model] [data] [train] [parallel] "
               "[checkpoint] "
               "[health] [topology]");
    EXPECT_ERR("b.ini", "[train]\nsteps = 10\nstpes = 3\n",
               "@:3: unknown key 'train.stpes'; did you mean 'train.steps'?");
    EXPECT_ERR("b.ini", "[train]\nseed = 3\n", "@:2: unknown key 'train.seed'; did you mean 'run.seed'?");
    EXPECT_ERR("b.ini", "[train]\nwibble = 3\n",
               "@:2: unknown key 'train.wibble' (dgtrain --help lists the keys)");
    EXPECT_ERR("c.ini", "[train]\nsteps = abc\n", "@:2: train.steps: expected an integer, got 'abc'");
    EXPECT_ERR("c.ini", "[train]\nsteps = 1.5\n", "@:2: train.steps: expected an integer, got '1.5'");
    EXPECT_ERR("c.ini", "[train]\nlr = fast\n", "@:2: train.lr: expected a number, got 'fast'");
    EXPECT_ERR("c.ini", "[train]\nlr = nan\n", "@:2: train.lr: expected a number, got 'nan'");
    EXPECT_ERR("c.ini", "[data]\nshuffle = maybe\n",
               "@:2: data.shuffle: expected a boolean (true|false|yes|no|on|off|1|0), got 'maybe'");
    EXPECT_ERR("c.ini", "[train]\nprecision = fp64\n",
               "@:2: train.precision: expected one of fp32|bf16|fp16|fp8, got 'fp64'");
    EXPECT_ERR("d.ini", "[train]\nsteps = 0\n",
               "@:2: train.steps: out of range: expected an integer >= 1, got '0'");
    EXPECT_ERR("d.ini", "[train]\nsteps = 99999999999999999999\n",
               "@:2: train.steps: out of range: expected an integer >= 1, got '99999999999999999999'");
    EXPECT_ERR("d.ini", "[train]\nlr = 0\n",
               "@:2: train.lr: out of range: expected a number > 0 and <= 10, got '0'");
    EXPECT_ERR("d.ini", "[train]\nmin_lr_ratio = 1.5\n",
               "@:2: train.min_lr_ratio: out of range: expected a number in 0..1, got '1.5'");
    EXPECT_ERR("d.ini", "[train]\nlr = inf\n",
               "@:2: train.lr: out of range: expected a number > 0 and <= 10, got 'inf'");
    EXPECT_ERR("d.ini", "[model]\nn_head = -1\n",
               "@:2: model.n_head: out of range: expected an integer in 0..1024, got '-1'");
    EXPECT_ERR("d.ini", "[checkpoint]\nthreads = 17\n",
               "@:2: checkpoint.threads: out of range: expected an integer in 0..16, got '17'");
    EXPECT_ERR("d.ini", "[checkpoint]\nthreads = -1\n",
               "@:2: checkpoint.threads: out of range: expected an integer in 0..16, got '-1'");
    EXPECT_ERR("c.ini", "[checkpoint]\nspace_check = sometimes\n",
               "@:2: checkpoint.space_check: expected a boolean (true|false|yes|no|on|off|1|0), got "
               "'sometimes'");
    EXPECT_ERR("d.ini", "[train]\nspike_factor = 0.5\n",
               "@:2: train.spike_factor: out of range: expected 0 (off) or a number > 1");
    EXPECT_ERR("d.ini", "[train]\nloss_scale_window_min = 600\n",
               "train.loss_scale_window_min = 600 (@:2) is larger than train.loss_scale_window_max = 500 "
               "(default): expected min <= max");
    EXPECT_ERR("d.ini", "[run]\nname = my run\n",
               "@:2: run.name: expected a name of letters, digits, '.', '_' and '-'");
    EXPECT_ERR(
        "d.ini", "[parallel]\nmesh = dp=2\n",
        "@:2: parallel.mesh: unknown dimension 'dp' in 'dp=2' (expected dp_replicate, dp_shard, tp, pp)");
    /* pipeline keys (docs/parallelism.md) */
    EXPECT_ERR("d.ini", "[parallel]\nmesh = dp_shard=2,order=pp,tp,dp_shard\n",
               "@:2: parallel.mesh: pp cannot be placed by order= (pipeline stages are always the outermost "
               "dimension); order= lists dp_replicate, dp_shard and tp");
    EXPECT_ERR("d.ini", "[parallel]\nmesh = pp=0\n",
               "@:2: parallel.mesh: pp must be a positive integer, got '0'");
    EXPECT_ERR("d.ini", "[parallel]\nmesh = pp=2,pp=2\n",
               "@:2: parallel.mesh: pp given twice in 'pp=2,pp=2'");
    EXPECT_ERR("d.ini", "[parallel]\npp_schedule = gpipe\n",
               "@:2: parallel.pp_schedule: expected one of 1f1b|interleaved, got 'gpipe'");
    EXPECT_ERR(
        "d.ini", "[parallel]\npp_schedule = interleaved\n",
        "parallel.pp_schedule = interleaved (@:2) needs parallel.pp_virtual >= 2 (it is 1, default): with "
        "one chunk per rank the schedule is 1f1b");
    EXPECT_ERR(
        "d.ini", "[parallel]\npp_virtual = 2\n",
        "parallel.pp_virtual = 2 (@:2) needs parallel.pp_schedule = interleaved (it is 1f1b, default): "
        "1f1b has one stage per rank");
    EXPECT_ERR(
        "d.ini", "[parallel]\nmesh = dp_shard=2\npp_schedule = interleaved\npp_virtual = 2\n",
        "parallel.pp_schedule = interleaved (@:3) needs pipeline stages: parallel.mesh = dp_shard=2 (@:2) "
        "has pp=1");
    /* the defaults: global_batch 16, micro_batch 8: 2 micro-batches for one data-parallel rank */
    EXPECT_ERR("d.ini", "[parallel]\nmesh = pp=4\n",
               "parallel.mesh = pp=4 (@:2) has pp=4 stages but a step has only 2 micro-batches per pipeline "
               "(train.global_batch 16 / (micro_batch 8 x dp 1)): expected at least pp micro-batches (raise "
               "train.global_batch or lower train.micro_batch)");
    EXPECT_ERR(
        "d.ini", "[parallel]\nmesh = pp=2\npp_microbatches = 4\n",
        "parallel.pp_microbatches = 4 (@:3) but train.global_batch / (train.micro_batch x data-parallel "
        "ranks) = 16 / (8 x 1) = 2: expected global_batch = micro_batch x dp x pp_microbatches");
    EXPECT_ERR("d.ini", "[parallel]\nmesh = pp=2,dp_shard=3\n",
               "train.global_batch = 16 (default) is not a multiple of train.micro_batch (8) x data-parallel "
               "ranks of parallel.mesh = pp=2,dp_shard=3 (3)");
    EXPECT_ERR("d.ini", "[model]\nn_layer = 2\n[train]\nmicro_batch = 1\n[parallel]\nmesh = pp=4\n",
               "parallel.mesh = pp=4 (@:6) has pp=4 stages but model.n_layer = 2 (@:2): every stage needs at "
               "least one block");
    EXPECT_ERR(
        "d.ini",
        "[model]\nn_layer = 6\n[train]\nmicro_batch = 1\n[parallel]\nmesh = pp=2\npp_schedule = "
        "interleaved\npp_virtual = 2\n",
        "parallel.pp_schedule = interleaved needs model.n_layer = 6 (@:2) divisible by pp x pp_virtual = 2 "
        "x 2 = 4");
    EXPECT_ERR("e.ini", "[train]\nsteps = 10\n\n[run]\nseed=1\n[train]\nsteps = 20\n",
               "@:7: duplicate key train.steps (first set at line 2)");
    EXPECT_ERR("f.ini", "[train]\ngarbage line\n",
               "@:2: malformed line 'garbage line': expected '[section]' or 'key = value'");
    EXPECT_ERR("f.ini", "[train\nsteps = 1\n",
               "@:1: malformed line '[train': expected '[section]' or 'key = value'");
    EXPECT_ERR("f.ini", "[train]\n= 5\n", "@:2: malformed line '= 5': expected '[section]' or 'key = value'");
    /* the first error in the file wins, whichever of inih or us found it */
    EXPECT_ERR("f.ini", "[train]\nno equals here\nsteps = x\n",
               "@:2: malformed line 'no equals here': expected '[section]' or 'key = value'");
    EXPECT_ERR("g.ini", "steps = 1\n",
               "@:1: key 'steps' is outside any [section]; expected a [section] line first");
    EXPECT_ERR("h.ini", "[run]\ndir = \"runs/x\n", "@:2: run.dir: expected a closing '\"'");
    EXPECT_ERR("h.ini", "[run]\ndir = \"runs/x\" tail\n",
               "@:2: run.dir: expected nothing after the closing '\"', got 'tail'");
    write_file("nul.ini", "[train]\nsteps=1\n\0\n", 18);
    dg_clear_error();
    CHECK(dg_config_load(&g_cfg, write_file("nul.ini", "[train]\nsteps=1\n\0\n", 18), 0, NULL) ==
          DG_ERR_USAGE);
    char want[1024];
    snprintf(want, sizeof want, "%s/nul.ini:3: contains a NUL byte: expected a text (INI) file", g_dir);
    CHECK_STR(dg_last_error(), want);

    /* missing and unreadable files */
    snprintf(want, sizeof want, "%s/does-not-exist.ini", g_dir);
    CHECK(dg_config_load(&g_cfg, want, 0, NULL) == DG_ERR_USAGE);
    char msg[1200];
    snprintf(msg, sizeof msg, "cannot open config file '%s': No such file or directory", want);
    CHECK_STR(dg_last_error(), msg);
    CHECK(dg_config_load(&g_cfg, g_dir, 0, NULL) == DG_ERR_USAGE);
    snprintf(msg, sizeof msg, "cannot read config file '%s': Is a directory", g_dir);
    CHECK_STR(dg_last_error(), msg);
    if (geteuid() != 0) { /* root reads anything: only testable as a normal user */
        const char *p = wfile("noperm.ini", "[train]\nsteps=1\n");
        chmod(p, 0);
        CHECK(dg_config_load(&g_cfg, p, 0, NULL) == DG_ERR_USAGE);
        snprintf(msg, sizeof msg, "cannot open config file '%s': Permission denied", p);
        CHECK_STR(dg_last_error(), msg);
    }

    /* too long for the field */
    char big[1400];
    memset(big, 'a', sizeof big);
    snprintf(big, sizeof big, "[data]\ntrain = /%01100d\n", 0);
    EXPECT_ERR("i.ini", big, "@:2: data.train: too long: expected at most 1023 characters, got 1101");
}

static void test_set_errors(void) {
    const char *s1[] = {"train.steps"};
    EXPECT_SET_ERR(s1, 1, "--set 'train.steps': expected section.key=value");
    const char *s2[] = {"steps=10"};
    EXPECT_SET_ERR(s2, 1, "--set 'steps=10': expected section.key=value; did you mean 'train.steps=10'?");
    const char *s3[] = {"train.stpes=3"};
    EXPECT_SET_ERR(s3, 1, "--set 'train.stpes=3': unknown key 'train.stpes'; did you mean 'train.steps'?");
    const char *s4[] = {"trian.steps=3"};
    EXPECT_SET_ERR(s4, 1, "--set 'trian.steps=3': unknown section [trian]; did you mean [train]?");
    const char *s5[] = {"train.steps=ten"};
    EXPECT_SET_ERR(s5, 1, "--set 'train.steps=ten': train.steps: expected an integer, got 'ten'");
    const char *s6[] = {"train.steps=10", "train.micro_batch=0"};
    EXPECT_SET_ERR(s6, 2,
                   "--set 'train.micro_batch=0': train.micro_batch: out of range: expected an integer in "
                   "1..1048576, got '0'");
    const char *sck[] = {"checkpoint.threads=64"};
    EXPECT_SET_ERR(sck, 1,
                   "--set 'checkpoint.threads=64': checkpoint.threads: out of range: expected an integer in "
                   "0..16, got '64'");
    const char *s7[] = {"train.freeze=a ;b"};
    EXPECT_SET_ERR(s7, 1,
                   "--set 'train.freeze=a ;b': train.freeze: expected text without control characters, '\"' "
                   "or ' ;', got 'a ;b'");
    const char *s8[] = {"run.dir="};
    EXPECT_SET_ERR(s8, 1, "--set 'run.dir=': run.dir: expected a non-empty value");
}

static void test_cross_key(void) {
    const char *a[] = {"train.global_batch=12", "train.micro_batch=5"};
    EXPECT_SET_ERR(
        a, 2,
        "train.global_batch = 12 (--set) is not a multiple of train.micro_batch = 5 (--set): expected "
        "global_batch = micro_batch x data-parallel ranks x accumulation steps");
    EXPECT_ERR("x.ini", "[model]\nd_model = 100\nn_head = 3\n",
               "model.d_model = 100 (@:2) is not divisible by model.n_head = 3 (@:3)");
    const char *c[] = {"model.preset=custom", "model.n_layer=2", "model.n_head=2", "model.d_model=64",
                       "model.seq_len=32"};
    EXPECT_SET_ERR(c, 5, "model.preset = custom (--set) needs model.vocab_size > 0 (it is 0)");
    const char *d[] = {"health.timeout_s=4"};
    EXPECT_SET_ERR(d, 1, "health.timeout_s = 4 (--set) must be larger than health.heartbeat_s = 5 (default)");
    const char *e[] = {"parallel.comm=nccl", "parallel.backend=cpu"};
    EXPECT_SET_ERR(
        e, 2,
        "parallel.comm = nccl (--set) needs GPU memory but parallel.backend = cpu (--set): expected "
        "comm = mpi or auto with the cpu backend");
    const char *ok[] = {"model.preset=custom", "model.n_layer=2",  "model.n_head=2",
                        "model.d_model=64",    "model.seq_len=32", "model.vocab_size=256"};
    CHECK(load(NULL, NULL, 6, ok) == DG_OK);
}

static void test_override_order_and_sources(void) {
    const char *text = "# test\n[train]\nsteps = 10\nlr = 0.001\n[run]\ndir = runs/t\n";
    const char *sets[] = {"train.steps=20", "train.warmup_steps=5", "train.steps=30"};
    CHECK(load("o.ini", text, 3, sets) == DG_OK);
    CHECK(g_cfg.train.steps == 30);
    CHECK(g_cfg.train.warmup_steps == 5);
    CHECK(g_cfg.train.lr == 0.001);
    CHECK_STR(g_cfg.run.dir, "runs/t");
    char want[600];
    CHECK_STR(dg_config_source(&g_cfg, "train.steps"), "--set");
    snprintf(want, sizeof want, "%s/o.ini:4", g_dir);
    CHECK_STR(dg_config_source(&g_cfg, "train.lr"), want);
    snprintf(want, sizeof want, "%s/o.ini:6", g_dir);
    CHECK_STR(dg_config_source(&g_cfg, "run.dir"), want);
    CHECK_STR(dg_config_source(&g_cfg, "run.seed"), "default");
    CHECK(dg_config_source(&g_cfg, "run.nope") == NULL);
    snprintf(want, sizeof want, "%s/o.ini", g_dir);
    CHECK_STR(g_cfg.path, want);

    /* --print-config shows value and source on one line per key, every key */
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    dg_config_print(&g_cfg, f);
    fclose(f);
    int lines = 0;
    for (char *p = buf; *p; p++)
        lines += *p == '\n';
    CHECK(lines == dg_cfg_nkeys);
    CHECK(strstr(buf, "train.steps = 30") != NULL);
    char line[700];
    snprintf(line, sizeof line, "# %s/o.ini:4\n", g_dir);
    char *lr = strstr(buf, "train.lr = 0.001 ");
    CHECK(lr && strncmp(strchr(lr, '#') - 0, line, strlen(line)) == 0);
    char *st = strstr(buf, "train.steps = 30 ");
    CHECK(st && strncmp(strchr(st, '#'), "# --set\n", 8) == 0);
    char *sd = strstr(buf, "run.seed = 1337 ");
    CHECK(sd && strncmp(strchr(sd, '#'), "# default\n", 10) == 0);
    CHECK(strstr(buf, "data.train = \"\" ") != NULL);
    free(buf);

    /* dg_config_set / dg_config_get: the generic path other modules use */
    CHECK(dg_config_set(&g_cfg, "train.steps", "77", "checkpoint") == DG_OK);
    char v[64];
    CHECK(dg_config_get(&g_cfg, "train.steps", v, sizeof v) == 0);
    CHECK_STR(v, "77");
    CHECK_STR(dg_config_source(&g_cfg, "train.steps"), "checkpoint");
    CHECK(dg_config_set(&g_cfg, "train.steps", "-1", "checkpoint") == DG_ERR_USAGE);
    CHECK_STR(dg_last_error(), "checkpoint: train.steps: out of range: expected an integer >= 1, got '-1'");
    CHECK(g_cfg.train.steps == 77); /* a failed set leaves the value */
    CHECK(dg_config_get(&g_cfg, "nope.nope", v, sizeof v) == -1);
}

static void test_syntax(void) {
    const char *text = "\xEF\xBB\xBF; leading comment\r\n"
                       "[run]\r\n"
                       "dir = \"runs/with space\"   # trailing comment\r\n"
                       "name = x-1 # comment\r\n"
                       "   seed = 5\r\n"
                       "log_level : debug\r\n"
                       "[ train ]\r\n"
                       "lr = 0.002 ; inih comment\r\n"
                       "precision=bf16\r\n"
                       "[data]\r\n"
                       "shuffle = OFF\r\n"
                       "train = data/a#b.bin\r\n"
                       "val = \"\"\r\n"
                       "[parallel]\n"
                       "overlap = No\n"
                       "cuda_graph = 1\n"
                       "mesh = dp_shard=4,tp=2\n";
    CHECK(load("s.ini", text, 0, NULL) == DG_OK);
    if (dg_last_error()[0]) fprintf(stderr, "  (message: %s)\n", dg_last_error());
    CHECK_STR(g_cfg.run.dir, "runs/with space");
    CHECK_STR(g_cfg.run.name, "x-1");
    CHECK(g_cfg.run.seed == 5);
    CHECK_STR(g_cfg.run.log_level, "debug");
    CHECK(g_cfg.train.lr == 0.002);
    CHECK_STR(g_cfg.train.precision, "bf16");
    CHECK(g_cfg.data.shuffle == 0);
    CHECK_STR(g_cfg.data.train, "data/a#b.bin");
    CHECK_STR(g_cfg.data.val, "");
    CHECK(g_cfg.parallel.overlap == 0 && g_cfg.parallel.cuda_graph == 1);
    CHECK_STR(g_cfg.parallel.mesh, "dp_shard=4,tp=2");

    /* a line longer than libinih's 200-byte buffer still works, and its comment is still cut */
    char big[1200];
    snprintf(big, sizeof big,
             "[data]\ntrain = /data/%0600d/*.bin ; comment\nval = \"/v/%0400d\" # c\n[train]\nsteps=3\n", 0,
             0);
    CHECK(load("l.ini", big, 0, NULL) == DG_OK);
    CHECK(strlen(g_cfg.data.train) == 6 + 600 + 6);
    CHECK(strncmp(g_cfg.data.train, "/data/000", 9) == 0 && strcmp(g_cfg.data.train + 606, "/*.bin") == 0);
    CHECK(strlen(g_cfg.data.val) == 3 + 400);
    CHECK(g_cfg.train.steps == 3);
    char want[600];
    snprintf(want, sizeof want, "%s/l.ini:5", g_dir);
    CHECK_STR(dg_config_source(&g_cfg, "train.steps"), want);
    /* a long comment line is skipped, a long garbage line is malformed */
    snprintf(big, sizeof big, "# %0500d\n[train]\nsteps=4\n", 0);
    CHECK(load("l2.ini", big, 0, NULL) == DG_OK && g_cfg.train.steps == 4);
    snprintf(big, sizeof big, "[train]\n%0300d\n", 0);
    CHECK(load("l3.ini", big, 0, NULL) == DG_ERR_USAGE);
    snprintf(want, sizeof want,
             "%s/l3.ini:2: malformed line '%050d...': expected '[section]' or 'key = value'", g_dir, 0);
    CHECK_STR(dg_last_error(), want);
    /* an empty file is the defaults */
    CHECK(load("empty.ini", "", 0, NULL) == DG_OK && g_cfg.train.steps == 300);
}

static void test_round_trip_and_hash(void) {
    const char *sets[] = {"run.dir=runs/with space", "train.lr=0.0001234", "data.train=a#b",
                          "train.eps=1e-10", "parallel.mesh=dp_replicate=2,dp_shard=2"};
    CHECK(load(NULL, NULL, 5, sets) == DG_OK);
    uint64_t h = dg_config_hash(&g_cfg);
    char *ini = dg_config_to_ini(&g_cfg);
    dg_config_t *c2 = calloc(1, sizeof *c2);
    CHECK(dg_config_load_buffer(c2, "ckpt", ini, strlen(ini), 0, NULL) == DG_OK);
    char *ini2 = dg_config_to_ini(c2);
    CHECK_STR(ini2, ini);
    CHECK(dg_config_hash(c2) == h);
    CHECK(c2->train.lr == 0.0001234 && c2->train.eps == 1e-10);
    CHECK_STR(c2->run.dir, "runs/with space");
    CHECK_STR(c2->data.train, "a#b");
    CHECK_STR(
        dg_config_source(c2, "train.lr"),
        "ckpt:32"); /* line of lr in the INI text: [run] 1-10, [model] 12-19, [data] 21-26, [train] 28- */
    /* a source is where the value came from, not part of the config: the hash ignores it */
    const char *one[] = {"train.lr=0.0001234"};
    dg_config_t *c3 = calloc(1, sizeof *c3);
    CHECK(dg_config_load(c3, NULL, 1, one) == DG_OK);
    CHECK(dg_config_hash(c3) != h);
    CHECK(dg_config_hash(c3) == dg_config_hash(c3));
    /* the --print-config text (dotted keys, no sections, '# source' comments) loads back to the same
     * config (RUN_DIR/config.ini is that text) */
    char *printed = NULL;
    size_t plen = 0;
    FILE *pf = open_memstream(&printed, &plen);
    dg_config_print(&g_cfg, pf);
    fclose(pf);
    dg_config_t *c4 = calloc(1, sizeof *c4);
    CHECK(dg_config_load_buffer(c4, "printed", printed, plen, 0, NULL) == DG_OK);
    CHECK(dg_config_hash(c4) == h);
    CHECK_STR(c4->data.train, "a#b");
    CHECK_STR(dg_config_source(c4, "run.dir"), "printed:2");
    /* a dotted key outside a section is still checked like any other */
    EXPECT_ERR("p.ini", "train.stpes = 1\n", "@:1: unknown key 'train.stpes'; did you mean 'train.steps'?");
    EXPECT_ERR("p.ini", ".steps = 1\n",
               "@:1: key '.steps' is outside any [section]; expected a [section] line first");
    free(printed);
    free(c4);
    free(ini);
    free(ini2);
    free(c2);
    free(c3);
}

static void test_help(void) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    dg_config_print_help(f);
    fclose(f);
    for (int i = 0; i < dg_cfg_nkeys; i++) {
        char name[128];
        snprintf(name, sizeof name, "  %s.%s ", dg_cfg_schema[i].section, dg_cfg_schema[i].key);
        CHECK(strstr(buf, name) != NULL);
        CHECK(strstr(buf, dg_cfg_schema[i].doc) != NULL);
    }
    CHECK(strstr(buf, "one of fp32|bf16|fp16|fp8; default fp32") != NULL);
    CHECK(strstr(buf, "a number > 0 and <= 10; default 3e-3") != NULL);
    free(buf);
}

/* the shipped configs/ files load as they are */
static void test_shipped(const char *path) {
    dg_clear_error();
    dg_status_t s = dg_config_load(&g_cfg, path, 0, NULL);
    CHECK(s == DG_OK);
    if (s != DG_OK) fprintf(stderr, "  %s: %s\n", path, dg_last_error());
}

/* The enum ids beside the enumerated keys' text (config.h): every choice, from a file and from --set, and
 * the defaults; the enums' order must be the schema's choice order. */
static void test_enum_ids(void) {
    CHECK(load(NULL, NULL, 0, NULL) == DG_OK);
    CHECK(g_cfg.train.precision_id == DG_PREC_FP32 && g_cfg.train.reduce_dtype_id == DG_REDUCE_FP32 &&
          g_cfg.train.recompute_id == DG_RECOMPUTE_NONE && g_cfg.parallel.backend_id == DG_CFG_BACKEND_AUTO &&
          g_cfg.parallel.comm_id == DG_CFG_COMM_AUTO);
    /* each enumerated key with an id field: its choices and the ids they must give, in the same order */
    static const struct {
        const char *key;
        size_t off;
        const char *choice[3];
        int id[3];
    } keys[] = {
        {"train.precision",
         offsetof(dg_config_t, train.precision_id),
         {"fp32", "bf16", "fp16"},
         {DG_PREC_FP32, DG_PREC_BF16, DG_PREC_FP16}},
        {"train.reduce_dtype",
         offsetof(dg_config_t, train.reduce_dtype_id),
         {"fp32", "bf16"},
         {DG_REDUCE_FP32, DG_REDUCE_BF16}},
        {"train.recompute",
         offsetof(dg_config_t, train.recompute_id),
         {"none", "gelu"},
         {DG_RECOMPUTE_NONE, DG_RECOMPUTE_GELU}},
        {"parallel.backend",
         offsetof(dg_config_t, parallel.backend_id),
         {"auto", "cpu", "cuda"},
         {DG_CFG_BACKEND_AUTO, DG_CFG_BACKEND_CPU, DG_CFG_BACKEND_CUDA}},
        {"parallel.comm",
         offsetof(dg_config_t, parallel.comm_id),
         {"auto", "mpi", "nccl"},
         {DG_CFG_COMM_AUTO, DG_CFG_COMM_MPI, DG_CFG_COMM_NCCL}},
    };
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        for (int c = 0; c < 3 && keys[i].choice[c]; c++) {
            char set[64], text[128];
            snprintf(set, sizeof set, "%s=%s", keys[i].key, keys[i].choice[c]);
            const char *sets[1] = {set};
            CHECK(load(NULL, NULL, 1, sets) == DG_OK);
            int got = *(const int *)((const char *)&g_cfg + keys[i].off);
            if (got != keys[i].id[c]) {
                fprintf(stderr, "FAIL: --set %s gives id %d, want %d\n", set, got, keys[i].id[c]);
                dg_fails++;
            }
            /* the same from a file: section and key */
            const char *dot = strchr(keys[i].key, '.');
            snprintf(text, sizeof text, "[%.*s]\n%s = %s\n", (int)(dot - keys[i].key), keys[i].key, dot + 1,
                     keys[i].choice[c]);
            CHECK(load("ids.ini", text, 0, NULL) == DG_OK);
            CHECK(*(const int *)((const char *)&g_cfg + keys[i].off) == keys[i].id[c]);
        }
}

int main(int argc, char **argv) {
    if (dg_test_mkdtemp(g_dir, sizeof g_dir, "dg_config_test") != 0) return 2;
    test_schema();
    test_defaults();
    test_errors();
    test_set_errors();
    test_cross_key();
    test_override_order_and_sources();
    test_syntax();
    test_round_trip_and_hash();
    test_help();
    test_enum_ids();
    for (int i = 1; i < argc; i++)
        test_shipped(argv[i]);
    dg_test_rmtree(g_dir);
    printf("config tests: %d checks, %d failed\n", dg_checks, dg_fails);
    return dg_fails ? 1 : 0;
}
