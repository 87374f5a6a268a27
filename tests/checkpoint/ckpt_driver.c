/* ckpt_driver.c — test driver for the checkpoint module, on synthetic distributed state.
 *
 * The state is a small "model" (tensors of awkward shapes: uneven splits, several hash tiles per row,
 * 1-D, 3-D) plus AdamW moments, spread over the ranks by one of several layouts (dim-0 shards, column
 * shards, replicas with one owner, several pieces per rank, a 2-D grid). Subcommands:
 *   save DIR --step N --seed S --layout L [--keep K] [--incremental] [--freeze PATS] [--async]
 *        values are a formula of (seed, tensor, element): any rank count can check them after a load
 *   load FILE --seed S --layout L [--freeze PATS] [--bump-shape NAME]   load and check every element
 *   sim --dir D --steps N --every E --layout L [--stop-after K] [--resume MODE] [--out F] [--async]
 *       [--incremental --freeze PATS] [--pids DIR]   a deterministic "training" loop (AdamW-like update
 *       fed by a data cursor and an RNG) that checkpoints and resumes; rank 0 appends one line per step
 *   async-stress --dir D --rounds R        background writes beside main-thread all-reduces, plus an
 *                                          injected failure that must be reported and leave LATEST alone
 *   (save and sim take --chunk-bytes N: the target chunk size, to get many chunks from small tensors)
 *   corrupt FILE DSET [--chunk K]          flip one byte in the middle of chunk K of DSET (no MPI)
 *   delete FILE DSET | reshape FILE DSET | link FILE DSET TARGET_FILE     tamper with a file (no MPI)
 *   compare A B [--tol REL]                compare two sim outputs (bitwise, or losses within REL)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fnmatch.h>
#include <hdf5.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint.h"
#include "dg_test_args.h"
#include "dg_test_mpi.h"

static int g_rank, g_size;

#define DIE(...)                                                                                             \
    do {                                                                                                     \
        fprintf(stderr, "ckpt_driver[rank %d]: ", g_rank);                                                   \
        fprintf(stderr, __VA_ARGS__);                                                                        \
        fprintf(stderr, "\n");                                                                               \
        MPI_Abort(MPI_COMM_WORLD, 3);                                                                        \
    } while (0)

/* ---------------- the synthetic model ---------------- */

typedef struct {
    char name[64];
    int ndim;
    int64_t g[4];
} param_t;

static param_t g_params[64];
static int g_np;

static void add_param(const char *name, int nd, int64_t a, int64_t b, int64_t c) {
    param_t *p = &g_params[g_np++];
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = nd;
    p->g[0] = a, p->g[1] = b, p->g[2] = c, p->g[3] = 0;
}

static void build_model(void) {
    g_np = 0;
    add_param("wte", 2, 97, 24, 0);
    add_param("wpe", 2, 16, 24, 0);
    for (int l = 0; l < 3; l++) {
        char n[64];
        snprintf(n, sizeof n, "h.%d.attn.w", l), add_param(n, 2, 24, 72, 0);
        snprintf(n, sizeof n, "h.%d.attn.b", l), add_param(n, 1, 72, 0, 0);
        snprintf(n, sizeof n, "h.%d.mlp.w", l), add_param(n, 2, 24, 96, 0);
        snprintf(n, sizeof n, "h.%d.ln.w", l), add_param(n, 1, 24, 0, 0);
    }
    add_param("big", 2, 7, 2500, 0);
    add_param("vec", 1, 5000, 0, 0);
    add_param("cube", 3, 3, 5, 70);
    add_param("lnf.w", 1, 24, 0, 0);
}

static uint32_t fnv1a(const char *s) {
    uint32_t h = 2166136261u;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 16777619u;
    return h;
}

/* The value of element idx of tensor `path` for `seed` (reproduced in test_h5py.py). */
static float value_of(const char *path, uint64_t idx, uint32_t seed) {
    uint32_t u = (uint32_t)(idx * 2654435761u + fnv1a(path) + seed * 97u);
    return (float)((double)u / 4294967296.0 - 0.5);
}

/* ---------------- layouts: pieces of each tensor on this rank ---------------- */

typedef struct {
    int64_t start[4], count[4];
    int owner;
} box_t;

static void split(int64_t n, int parts, int k, int64_t *st, int64_t *cnt) {
    *st = n * k / parts;
    *cnt = n * (k + 1) / parts - *st;
}

/* Boxes of parameter i for `layout`; returns how many (0..2). */
static int layout_boxes(const char *layout, int i, const param_t *p, int rank, int size, box_t *out) {
    box_t b;
    memset(&b, 0, sizeof b);
    for (int d = 0; d < p->ndim; d++)
        b.count[d] = p->g[d];
    b.owner = 1;
    char kind[16];
    if (!strcmp(layout, "mixed"))
        snprintf(kind, sizeof kind, "%s", (const char *[]){"fsdp", "cols", "rep", "two"}[i % 4]);
    else
        snprintf(kind, sizeof kind, "%s", layout);
    if (!strcmp(kind, "fsdp")) {
        split(p->g[0], size, rank, &b.start[0], &b.count[0]);
    } else if (!strcmp(kind, "cols")) {
        int d = p->ndim - 1;
        split(p->g[d], size, rank, &b.start[d], &b.count[d]);
    } else if (!strcmp(kind, "rep")) {
        b.owner = i % size == rank;
    } else if (!strcmp(kind, "two")) {
        box_t c = b;
        split(p->g[0], 2 * size, rank, &b.start[0], &b.count[0]);
        split(p->g[0], 2 * size, rank + size, &c.start[0], &c.count[0]);
        out[0] = b;
        out[1] = c;
        return 2;
    } else if (!strcmp(kind, "grid")) {
        int a = 1;
        for (int k = 1; k * k <= size; k++)
            if (size % k == 0) a = k;
        int bb = size / a;
        if (p->ndim >= 2) {
            split(p->g[0], a, rank / bb, &b.start[0], &b.count[0]);
            split(p->g[1], bb, rank % bb, &b.start[1], &b.count[1]);
        } else {
            split(p->g[0], size, rank, &b.start[0], &b.count[0]);
        }
    } else {
        DIE("unknown layout '%s' (fsdp, cols, rep, mixed, grid)", layout);
    }
    out[0] = b;
    return 1;
}

/* All pieces: param, optim/<p>/m, optim/<p>/v, each with the same boxes. */
typedef struct {
    dg_ckpt_tensor_t *t;
    int n;
    char (*paths)[96];
    int *param; /* which param a piece belongs to */
    int *kind;  /* 0 param, 1 m, 2 v */
} state_t;

static int64_t numel(int nd, const int64_t *c) {
    int64_t n = 1;
    for (int d = 0; d < nd; d++)
        n *= c[d];
    return n;
}

static void state_build(state_t *s, const char *layout, int with_optim) {
    memset(s, 0, sizeof *s);
    int cap = g_np * 6;
    s->t = calloc((size_t)cap, sizeof *s->t);
    s->paths = calloc((size_t)cap, sizeof *s->paths);
    s->param = calloc((size_t)cap, sizeof(int));
    s->kind = calloc((size_t)cap, sizeof(int));
    for (int k = 0; k < (with_optim ? 3 : 1); k++)
        for (int i = 0; i < g_np; i++) {
            box_t bx[2];
            int nb = layout_boxes(layout, i, &g_params[i], g_rank, g_size, bx);
            for (int j = 0; j < nb; j++) {
                dg_ckpt_tensor_t *t = &s->t[s->n];
                if (k == 0)
                    snprintf(s->paths[s->n], 96, "model/%s", g_params[i].name);
                else
                    snprintf(s->paths[s->n], 96, "optim/%s/%s", g_params[i].name, k == 1 ? "m" : "v");
                t->path = s->paths[s->n];
                t->ndim = g_params[i].ndim;
                memcpy(t->gshape, g_params[i].g, sizeof t->gshape);
                memcpy(t->start, bx[j].start, sizeof t->start);
                memcpy(t->count, bx[j].count, sizeof t->count);
                t->owner = bx[j].owner;
                t->data = calloc((size_t)numel(t->ndim, t->count) + 1, sizeof(float));
                s->param[s->n] = i;
                s->kind[s->n] = k;
                s->n++;
            }
        }
}

static void state_free(state_t *s) {
    for (int i = 0; i < s->n; i++)
        free(s->t[i].data);
    free(s->t), free(s->paths), free(s->param), free(s->kind);
}

/* Call fn(piece, local index, global flat index) for every element of every piece. */
#define FOR_EACH_ELEMENT(t, li, gi, BODY)                                                                    \
    do {                                                                                                     \
        int64_t idx_[4] = {0, 0, 0, 0};                                                                      \
        int64_t n_ = numel((t)->ndim, (t)->count);                                                           \
        for (int64_t li = 0; li < n_; li++) {                                                                \
            int64_t gi = 0;                                                                                  \
            for (int d_ = 0; d_ < (t)->ndim; d_++)                                                           \
                gi = gi * (t)->gshape[d_] + (t)->start[d_] + idx_[d_];                                       \
            BODY;                                                                                            \
            for (int d_ = (t)->ndim - 1; d_ >= 0; d_--) {                                                    \
                if (++idx_[d_] < (t)->count[d_]) break;                                                      \
                idx_[d_] = 0;                                                                                \
            }                                                                                                \
        }                                                                                                    \
    } while (0)

static int frozen(const char *name, const char *pats) {
    if (!pats || !*pats) return 0;
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", pats);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
        if (fnmatch(tok, name, 0) == 0) return 1;
    return 0;
}

static void fill_values(state_t *s, uint32_t seed, const char *freeze) {
    for (int i = 0; i < s->n; i++) {
        dg_ckpt_tensor_t *t = &s->t[i];
        uint32_t sd = frozen(g_params[s->param[i]].name, freeze) ? 0 : seed;
        FOR_EACH_ELEMENT(t, li, gi, t->data[li] = value_of(t->path, (uint64_t)gi, sd));
    }
}

/* ---------------- options ---------------- */

typedef struct {
    const char *dir, *layout, *freeze, *resume, *out, *pids, *bump;
    int64_t step, steps, every, stop_after, rounds;
    uint32_t seed;
    int keep, incremental, async;
    int64_t chunk_bytes; /* 0 = the library's default */
} opts_t;

static const char *need_value(const char *opt) {
    DIE("%s needs a value", opt);
    return "";
}

static void parse_opts(int argc, char **argv, int first, opts_t *o) {
    memset(o, 0, sizeof *o);
    o->layout = "fsdp";
    o->freeze = "";
    o->resume = "never";
    o->keep = 0;
    o->every = 1;
    o->rounds = 4;
    const dg_arg_t tab[] = {{"--dir", DG_ARG_STR, &o->dir},
                            {"--layout", DG_ARG_STR, &o->layout},
                            {"--freeze", DG_ARG_STR, &o->freeze},
                            {"--resume", DG_ARG_STR, &o->resume},
                            {"--out", DG_ARG_STR, &o->out},
                            {"--pids", DG_ARG_STR, &o->pids},
                            {"--bump-shape", DG_ARG_STR, &o->bump},
                            {"--step", DG_ARG_I64, &o->step},
                            {"--steps", DG_ARG_I64, &o->steps},
                            {"--every", DG_ARG_I64, &o->every},
                            {"--stop-after", DG_ARG_I64, &o->stop_after},
                            {"--rounds", DG_ARG_I64, &o->rounds},
                            {"--seed", DG_ARG_U32, &o->seed},
                            {"--keep", DG_ARG_INT, &o->keep},
                            {"--incremental", DG_ARG_FLAG, &o->incremental},
                            {"--async", DG_ARG_FLAG, &o->async},
                            {"--chunk-bytes", DG_ARG_I64, &o->chunk_bytes}};
    for (int i = first; i < argc; i++) {
        const dg_arg_t *t = dg_arg_find(tab, sizeof tab / sizeof tab[0], argv[i]);
        if (!t) DIE("unknown option %s", argv[i]);
        dg_arg_store(t, t->kind == DG_ARG_FLAG ? NULL : i + 1 < argc ? argv[++i] : need_value(argv[i]));
    }
}

/* ---------------- save / load ---------------- */

static void fill_meta(dg_ckpt_meta_t *m, int64_t step, uint32_t seed) {
    dg_ckpt_meta_init(m);
    m->step = step;
    m->tokens = step * 128;
    snprintf(m->mesh, sizeof m->mesh, "dp_replicate=1,dp_shard=%d,tp=1", g_size);
    char cfg[256];
    snprintf(cfg, sizeof cfg, "[run]\nname = synthetic\nseed = %u\n[checkpoint]\nkeep = 3\n", seed);
    dg_ckpt_meta_set_config(m, cfg);
    m->loader.epoch = 2;
    m->loader.cursor = step * 8 % 1000;
    m->loader.samples_seen = (uint64_t)step * 8;
    m->scaler.scale = 1024.0;
    m->scaler.good_steps = step % 7;
    m->n_rng = 3;
    m->rng[0] = 0x0123456789abcdefULL ^ seed;
    m->rng[1] = (uint64_t)step;
    m->rng[2] = UINT64_MAX;
    dg_ckpt_meta_set_kv(m, "note", "synthetic state");
}

static int cmd_save(opts_t *o) {
    if (!o->dir) DIE("save needs --dir");
    state_t s;
    state_build(&s, o->layout, 1);
    fill_values(&s, o->seed, o->freeze);
    dg_ckpt_meta_t m;
    fill_meta(&m, o->step, o->seed);
    dg_ckpt_save_opts_t so;
    dg_ckpt_save_opts_default(&so);
    so.keep = o->keep;
    so.incremental = o->incremental;
    if (o->chunk_bytes) so.chunk_bytes = o->chunk_bytes;
    dg_ckpt_save_result_t res;
    dg_status_t st;
    if (o->async) {
        dg_ckpt_writer_t *w = NULL;
        st = dg_ckpt_writer_create(MPI_COMM_WORLD, o->dir, &so, &w);
        double stall = 0;
        if (!st) st = dg_ckpt_writer_submit(w, &m, s.t, s.n, &stall, NULL);
        /* the snapshot is ours to change now: scribble over the live state */
        for (int i = 0; i < s.n; i++)
            memset(s.t[i].data, 0xff, (size_t)numel(s.t[i].ndim, s.t[i].count) * 4);
        dg_ckpt_async_result_t ar;
        if (!st) st = dg_ckpt_writer_wait(w, &ar);
        if (!st) res = ar.res;
        dg_ckpt_writer_free(w);
    } else {
        st = dg_ckpt_save(MPI_COMM_WORLD, o->dir, &m, s.t, s.n, &so, &res);
    }
    if (st) {
        if (g_rank == 0) fprintf(stderr, "save failed: %s\n", dg_last_error());
        dg_ckpt_meta_destroy(&m);
        state_free(&s);
        return 1;
    }
    long long mine[2] = {(long long)res.phases.direct_bytes, (long long)res.phases.fill_skipped_bytes},
              sum[2] = {0, 0};
    MPI_Allreduce(mine, sum, 2, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (g_rank == 0)
        printf("saved %s bytes=%lld logical=%lld linked=%lld n_linked=%d base=%s seconds=%.3f "
               "direct_bytes=%lld fill_skipped_bytes=%lld\n",
               res.path, (long long)res.bytes, (long long)res.logical_bytes, (long long)res.linked_bytes,
               res.n_linked, res.base[0] ? res.base : "-", res.seconds, sum[0], sum[1]);
    dg_ckpt_meta_destroy(&m);
    state_free(&s);
    return 0;
}

static int cmd_load(const char *file, opts_t *o) {
    if (o->bump) /* the model changed shape since the checkpoint (e.g. another d_model) */
        for (int i = 0; i < g_np; i++)
            if (!strcmp(g_params[i].name, o->bump)) g_params[i].g[g_params[i].ndim - 1]++;
    state_t s;
    state_build(&s, o->layout, 1);
    for (int i = 0; i < s.n; i++)
        memset(s.t[i].data, 0xa5, (size_t)numel(s.t[i].ndim, s.t[i].count) * 4);
    dg_ckpt_meta_t m;
    dg_status_t st = dg_ckpt_load(MPI_COMM_WORLD, file, &m, s.t, s.n);
    if (st) {
        if (g_rank == 0) fprintf(stderr, "load failed: %s\n", dg_last_error());
        state_free(&s);
        return 1;
    }
    int64_t bad = 0, total = 0;
    for (int i = 0; i < s.n; i++) {
        dg_ckpt_tensor_t *t = &s.t[i];
        uint32_t sd = frozen(g_params[s.param[i]].name, o->freeze) ? 0 : o->seed;
        FOR_EACH_ELEMENT(t, li, gi, {
            float want = value_of(t->path, (uint64_t)gi, sd);
            total++;
            if (memcmp(&want, &t->data[li], 4) != 0) {
                if (bad < 5)
                    fprintf(stderr, "rank %d: %s[%lld] = %.9g, expected %.9g\n", g_rank, t->path,
                            (long long)gi, t->data[li], want);
                bad++;
            }
        });
    }
    dg_ckpt_meta_t ref;
    fill_meta(&ref, m.step, o->seed);
    int meta_ok = m.step == ref.step && m.tokens == ref.tokens && m.loader.epoch == ref.loader.epoch &&
                  m.loader.cursor == ref.loader.cursor && m.loader.samples_seen == ref.loader.samples_seen &&
                  m.scaler.scale == ref.scaler.scale && m.scaler.good_steps == ref.scaler.good_steps &&
                  m.n_rng == ref.n_rng && !memcmp(m.rng, ref.rng, sizeof(uint64_t) * 3) && m.config_text &&
                  !strcmp(m.config_text, ref.config_text) && dg_ckpt_meta_get_kv(&m, "note") &&
                  !strcmp(dg_ckpt_meta_get_kv(&m, "note"), "synthetic state") &&
                  !strcmp(m.version, DG_VERSION_STRING);
    int64_t badall = 0, totall = 0;
    int meta_all = 0;
    MPI_Allreduce(&bad, &badall, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&total, &totall, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&meta_ok, &meta_all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (g_rank == 0)
        printf("loaded %s step=%lld written_by=%d read_by=%d elements=%lld mismatched=%lld meta=%s\n", file,
               (long long)m.step, m.world_size, g_size, (long long)totall, (long long)badall,
               meta_all ? "ok" : "WRONG");
    dg_ckpt_meta_destroy(&ref);
    dg_ckpt_meta_destroy(&m);
    state_free(&s);
    return badall == 0 && meta_all ? 0 : 1;
}

/* ---------------- sim: a deterministic training loop ---------------- */

enum { GB = 8, EPOCH = 1000, SEQ = 16 };

static uint64_t xorshift(uint64_t x) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
}

static int64_t sample_at(int64_t epoch, int64_t pos) {
    return (pos * 7 + epoch * 13) % EPOCH;
}

static float data_of(int64_t sample) {
    return value_of("data", (uint64_t)sample, 7);
}

typedef struct {
    int64_t step, epoch, cursor;
    uint64_t samples_seen, rng;
    double scale;
    int64_t good;
} simstate_t;

static void sim_step(state_t *s, simstate_t *ss, const char *freeze, int64_t samples[GB]) {
    float d[GB];
    for (int j = 0; j < GB; j++) {
        int64_t pos = ss->cursor + j, ep = ss->epoch + pos / EPOCH;
        samples[j] = sample_at(ep, pos % EPOCH);
        d[j] = data_of(samples[j]);
    }
    ss->rng = xorshift(ss->rng);
    float sc = 1.0f + 1e-3f * (float)log2(ss->scale);
    for (int i = 0; i < s->n; i++) {
        if (s->kind[i] != 0 || frozen(g_params[s->param[i]].name, freeze)) continue;
        dg_ckpt_tensor_t *p = &s->t[i], *m = NULL, *v = NULL;
        for (int k = 0; k < s->n; k++) /* the moments with the same box */
            if (s->param[k] == s->param[i] && s->kind[k] &&
                !memcmp(s->t[k].start, p->start, sizeof p->start)) {
                if (s->kind[k] == 1)
                    m = &s->t[k];
                else
                    v = &s->t[k];
            }
        FOR_EACH_ELEMENT(p, li, gi, {
            float g = 0;
            for (int j = 0; j < GB; j++)
                g += d[j] * (float)((gi * 31 + j * 17) % 13 - 6) * 0.01f;
            uint64_t h = xorshift(ss->rng ^ (uint64_t)gi);
            g = g * sc + (float)((int64_t)(h % 1000) - 500) * 1e-6f;
            m->data[li] = 0.9f * m->data[li] + 0.1f * g;
            v->data[li] = 0.99f * v->data[li] + 0.01f * g * g;
            p->data[li] -= 1e-3f * (m->data[li] / (sqrtf(v->data[li]) + 1e-8f) + 0.01f * p->data[li]);
        });
    }
    ss->step++;
    ss->cursor += GB;
    ss->epoch += ss->cursor / EPOCH;
    ss->cursor %= EPOCH;
    ss->samples_seen += GB;
    if (ss->step % 7 == 0)
        ss->scale /= 2, ss->good = 0;
    else if (++ss->good >= 3)
        ss->scale *= 2, ss->good = 0;
}

static double sim_loss(state_t *s) {
    double l = 0, tot = 0;
    for (int i = 0; i < s->n; i++) {
        if (s->kind[i] != 0 || !s->t[i].owner) continue;
        int64_t n = numel(s->t[i].ndim, s->t[i].count);
        for (int64_t k = 0; k < n; k++)
            l += (double)s->t[i].data[k] * s->t[i].data[k];
    }
    MPI_Allreduce(&l, &tot, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    return tot;
}

static void sim_meta(dg_ckpt_meta_t *m, const simstate_t *ss) {
    dg_ckpt_meta_init(m);
    m->step = ss->step;
    m->tokens = (int64_t)ss->samples_seen * SEQ;
    snprintf(m->mesh, sizeof m->mesh, "dp_replicate=1,dp_shard=%d,tp=1", g_size);
    dg_ckpt_meta_set_config(m, "[run]\nname = sim\n");
    m->loader.epoch = ss->epoch;
    m->loader.cursor = ss->cursor;
    m->loader.samples_seen = ss->samples_seen;
    m->scaler.scale = ss->scale;
    m->scaler.good_steps = ss->good;
    m->n_rng = 1;
    m->rng[0] = ss->rng;
}

static int cmd_sim(opts_t *o) {
    if (!o->dir || o->steps <= 0) DIE("sim needs --dir and --steps");
    if (o->pids) {
        mkdir(o->pids, 0777);
        char p[512];
        snprintf(p, sizeof p, "%s/rank-%d.pid", o->pids, g_rank);
        FILE *f = fopen(p, "w");
        if (f) fprintf(f, "%d\n", (int)getpid()), fclose(f);
    }
    state_t s;
    state_build(&s, o->layout, 1);
    for (int i = 0; i < s.n; i++) {
        dg_ckpt_tensor_t *t = &s.t[i];
        if (s.kind[i] == 0)
            FOR_EACH_ELEMENT(t, li, gi, t->data[li] = value_of(t->path, (uint64_t)gi, 1));
        else
            memset(t->data, 0, (size_t)numel(t->ndim, t->count) * 4);
    }
    simstate_t ss = {0, 0, 0, 0, 0x9E3779B97F4A7C15ULL, 65536.0, 0};
    FILE *out = NULL;
    if (g_rank == 0 && o->out) {
        out = fopen(o->out, "a");
        if (!out) DIE("cannot open %s", o->out);
        setvbuf(out, NULL, _IOLBF, 0);
    }
    dg_ckpt_meta_t m;
    char from[4096] = "";
    dg_status_t st = dg_ckpt_resume(MPI_COMM_WORLD, o->dir, o->resume, &m, s.t, s.n, from, sizeof from);
    if (st) {
        if (g_rank == 0) fprintf(stderr, "resume failed: %s\n", dg_last_error());
        return 1;
    }
    if (from[0]) {
        ss.step = m.step;
        ss.epoch = m.loader.epoch;
        ss.cursor = m.loader.cursor;
        ss.samples_seen = m.loader.samples_seen;
        ss.scale = m.scaler.scale;
        ss.good = m.scaler.good_steps;
        ss.rng = m.rng[0];
        if (m.n_rng != 1 || m.tokens != (int64_t)ss.samples_seen * SEQ) DIE("resumed meta is inconsistent");
        if (out)
            fprintf(out, "resume step %lld from_world %d to_world %d %s\n", (long long)m.step, m.world_size,
                    g_size, from);
        if (g_rank == 0)
            printf("resumed from %s at step %lld (written by %d ranks)\n", from, (long long)m.step,
                   m.world_size);
        dg_ckpt_meta_destroy(&m);
    }
    dg_ckpt_save_opts_t so;
    dg_ckpt_save_opts_default(&so);
    so.keep = o->keep;
    so.incremental = o->incremental;
    if (o->chunk_bytes) so.chunk_bytes = o->chunk_bytes;
    dg_ckpt_writer_t *w = NULL;
    if (o->async && dg_ckpt_writer_create(MPI_COMM_WORLD, o->dir, &so, &w))
        DIE("writer: %s", dg_last_error());
    int rc = 0;
    while (ss.step < o->steps) {
        int64_t samples[GB];
        sim_step(&s, &ss, o->freeze, samples);
        double loss = sim_loss(&s);
        /* which samples each rank "read": gathered so the test can check coverage */
        int64_t lo, cnt;
        split(GB, g_size, g_rank, &lo, &cnt);
        int64_t mine[GB], all[GB * 64];
        int counts[64], displs[64], c = (int)cnt;
        for (int j = 0; j < cnt; j++)
            mine[j] = samples[lo + j];
        MPI_Gather(&c, 1, MPI_INT, counts, 1, MPI_INT, 0, MPI_COMM_WORLD);
        for (int r = 0, acc = 0; g_rank == 0 && r < g_size; r++)
            displs[r] = acc, acc += counts[r];
        MPI_Gatherv(mine, c, MPI_INT64_T, all, counts, displs, MPI_INT64_T, 0, MPI_COMM_WORLD);
        if (out) {
            fprintf(out, "step %lld loss %a %.17g tokens %lld samples", (long long)ss.step, loss, loss,
                    (long long)(ss.samples_seen * SEQ));
            for (int j = 0; j < GB; j++)
                fprintf(out, " %lld", (long long)all[j]);
            fprintf(out, "\n");
        }
        if (ss.step % o->every == 0 || ss.step == o->steps) {
            dg_ckpt_meta_t mm;
            sim_meta(&mm, &ss);
            if (w) {
                double stall = 0;
                dg_ckpt_async_result_t prev;
                st = dg_ckpt_writer_submit(w, &mm, s.t, s.n, &stall, &prev);
                if (!st && prev.valid && prev.status) st = prev.status;
            } else {
                st = dg_ckpt_save(MPI_COMM_WORLD, o->dir, &mm, s.t, s.n, &so, NULL);
            }
            dg_ckpt_meta_destroy(&mm);
            if (st) {
                if (g_rank == 0) fprintf(stderr, "checkpoint failed: %s\n", dg_last_error());
                rc = 1;
                break;
            }
        }
        if (o->stop_after && ss.step >= o->stop_after) break;
    }
    if (w) {
        if (dg_ckpt_writer_wait(w, NULL) != DG_OK) {
            if (g_rank == 0) fprintf(stderr, "checkpoint failed: %s\n", dg_last_error());
            rc = 1;
        }
        dg_ckpt_writer_free(w);
    }
    if (out) fclose(out);
    state_free(&s);
    return rc;
}

/* ---------------- async stress ---------------- */

static int cmd_async_stress(opts_t *o) {
    if (!o->dir) DIE("async-stress needs --dir");
    state_t s;
    state_build(&s, "mixed", 1);
    dg_ckpt_save_opts_t so;
    dg_ckpt_save_opts_default(&so);
    so.keep = 2;
    dg_ckpt_writer_t *w = NULL;
    if (dg_ckpt_writer_create(MPI_COMM_WORLD, o->dir, &so, &w)) DIE("writer: %s", dg_last_error());
    int fails = 0;
    double max_stall = 0;
    int64_t reductions = 0;
    for (int64_t r = 1; r <= o->rounds; r++) {
        fill_values(&s, (uint32_t)r, "");
        dg_ckpt_meta_t m;
        fill_meta(&m, r, (uint32_t)r);
        double stall = 0;
        dg_ckpt_async_result_t prev;
        if (dg_ckpt_writer_submit(w, &m, s.t, s.n, &stall, &prev)) DIE("submit: %s", dg_last_error());
        if (stall > max_stall) max_stall = stall;
        if (prev.valid && prev.status) fails++;
        dg_ckpt_meta_destroy(&m);
        /* "training" continues on the main thread: all-reduces while the write is in flight */
        for (int k = 0; k < 200; k++) {
            double x = g_rank + k, y = 0;
            MPI_Allreduce(&x, &y, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
            double want = (double)g_size * k + (double)g_size * (g_size - 1) / 2;
            if (y != want) DIE("all-reduce beside the writer gave %g, expected %g", y, want);
            reductions++;
        }
        for (int i = 0; i < s.n; i++)
            memset(s.t[i].data, 0x7f, (size_t)numel(s.t[i].ndim, s.t[i].count) * 4);
    }
    dg_ckpt_async_result_t res;
    if (dg_ckpt_writer_wait(w, &res)) DIE("last write: %s", dg_last_error());
    if (fails) DIE("%d background writes failed", fails);
    /* the newest checkpoint holds round R's values */
    char latest[4096];
    if (dg_ckpt_resolve_resume(MPI_COMM_WORLD, o->dir, "auto", 1, latest, sizeof latest))
        DIE("%s", dg_last_error());
    opts_t lo = *o;
    lo.layout = "fsdp";
    lo.seed = (uint32_t)o->rounds;
    if (cmd_load(latest, &lo)) DIE("the last async checkpoint does not load back");

    /* injected failure: step R+1's partial name is taken by a directory -> the write fails everywhere */
    char before[4096] = "", after[4096] = "", p[4400];
    FILE *f;
    snprintf(p, sizeof p, "%s/LATEST", o->dir);
    if ((f = fopen(p, "r"))) fgets(before, sizeof before, f), fclose(f);
    snprintf(p, sizeof p, "%s/step_%08lld.h5.partial", o->dir, (long long)o->rounds + 1);
    if (g_rank == 0) mkdir(p, 0755);
    MPI_Barrier(MPI_COMM_WORLD);
    dg_ckpt_meta_t m;
    fill_meta(&m, o->rounds + 1, 99);
    double stall = 0;
    if (dg_ckpt_writer_submit(w, &m, s.t, s.n, &stall, NULL)) DIE("submit: %s", dg_last_error());
    dg_ckpt_meta_destroy(&m);
    dg_status_t st = dg_ckpt_writer_wait(w, &res);
    int failed = st != DG_OK && res.valid && res.status != DG_OK, allfailed = 0;
    MPI_Allreduce(&failed, &allfailed, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!allfailed) DIE("the injected failure was not reported on every rank");
    if (g_rank == 0) printf("injected failure reported: %s\n", res.error);
    struct stat sb;
    if (stat(p, &sb) != 0 || !S_ISDIR(sb.st_mode)) DIE("%s was replaced by the failed write", p);
    snprintf(p, sizeof p, "%s/LATEST", o->dir);
    if ((f = fopen(p, "r"))) fgets(after, sizeof after, f), fclose(f);
    if (strcmp(before, after) != 0) DIE("LATEST changed after a failed write: '%s' -> '%s'", before, after);
    /* and the writer still works afterwards */
    snprintf(p, sizeof p, "%s/step_%08lld.h5.partial", o->dir, (long long)o->rounds + 1);
    MPI_Barrier(MPI_COMM_WORLD);
    if (g_rank == 0) rmdir(p);
    MPI_Barrier(MPI_COMM_WORLD);
    fill_values(&s, 77, "");
    fill_meta(&m, o->rounds + 2, 77);
    if (dg_ckpt_writer_submit(w, &m, s.t, s.n, &stall, NULL)) DIE("submit: %s", dg_last_error());
    dg_ckpt_meta_destroy(&m);
    if (dg_ckpt_writer_wait(w, &res)) DIE("write after a failure: %s", dg_last_error());
    dg_ckpt_writer_free(w);
    if (g_rank == 0)
        printf("async ok: %lld rounds, %lld all-reduces beside the writer, max stall %.2f ms, last %s\n",
               (long long)o->rounds, (long long)reductions, max_stall, res.res.path);
    state_free(&s);
    return 0;
}

/* ---------------- compare two sim outputs ---------------- */

static int cmd_compare(const char *a, const char *b, double tol) {
    FILE *fa = fopen(a, "r"), *fb = fopen(b, "r");
    if (!fa || !fb) {
        fprintf(stderr, "compare: cannot open %s or %s\n", a, b);
        return 2;
    }
    char la[2048], lb[2048];
    int n = 0, bad = 0;
    double worst = 0;
    for (;;) {
        char *ra, *rb;
        while ((ra = fgets(la, sizeof la, fa)) && strncmp(la, "step ", 5)) {
        }
        while ((rb = fgets(lb, sizeof lb, fb)) && strncmp(lb, "step ", 5)) {
        }
        if (!ra || !rb) {
            if (ra || rb) {
                fprintf(stderr, "compare: %s has more steps\n", ra ? a : b);
                bad++;
            }
            break;
        }
        n++;
        long long sa, sb, ta, tb;
        char ha[64], hb[64];
        double va, vb;
        char *sma = strstr(la, "samples"), *smb = strstr(lb, "samples");
        if (sscanf(la, "step %lld loss %63s %lg tokens %lld", &sa, ha, &va, &ta) != 4 ||
            sscanf(lb, "step %lld loss %63s %lg tokens %lld", &sb, hb, &vb, &tb) != 4 || !sma || !smb) {
            fprintf(stderr, "compare: malformed line %d\n", n);
            return 2;
        }
        if (sa != sb || ta != tb || strcmp(sma, smb) != 0) {
            fprintf(stderr, "compare: step %lld/%lld: tokens %lld/%lld or samples differ:\n  %s  %s", sa, sb,
                    ta, tb, la, lb);
            bad++;
            continue;
        }
        double rel = fabs(va - vb) / (fabs(va) > 1e-30 ? fabs(va) : 1e-30);
        if (rel > worst) worst = rel;
        if (tol == 0 ? strcmp(ha, hb) != 0 : rel > tol) {
            fprintf(stderr, "compare: step %lld loss %s vs %s (rel %.3g)\n", sa, ha, hb, rel);
            bad++;
        }
    }
    fclose(fa), fclose(fb);
    printf("compare: %d steps, %d differ, worst relative loss difference %.3g (%s)\n", n, bad, worst,
           tol == 0 ? "bitwise" : "tolerance");
    return bad || n == 0 ? 1 : 0;
}

/* ---------------- tampering (serial HDF5, no MPI) ---------------- */

static int cmd_corrupt(const char *file, const char *dset, int chunk) {
    hid_t f = H5Fopen(file, H5F_ACC_RDONLY, H5P_DEFAULT);
    if (f < 0) return fprintf(stderr, "corrupt: cannot open %s\n", file), 2;
    hid_t d = H5Dopen2(f, dset, H5P_DEFAULT);
    if (d < 0) return fprintf(stderr, "corrupt: no dataset %s\n", dset), 2;
    hsize_t nchunks = 0;
    hid_t fsp = H5Dget_space(d);
    H5Dget_num_chunks(d, fsp, &nchunks);
    if ((hsize_t)chunk >= nchunks)
        return fprintf(stderr, "corrupt: %s has %llu chunks\n", dset, (unsigned long long)nchunks), 2;
    hsize_t off[4];
    unsigned mask;
    haddr_t addr;
    hsize_t size;
    if (H5Dget_chunk_info(d, fsp, (hsize_t)chunk, off, &mask, &addr, &size) < 0)
        return fprintf(stderr, "corrupt: no chunk info\n"), 2;
    H5Sclose(fsp);
    H5Dclose(d);
    H5Fclose(f);
    FILE *fp = fopen(file, "r+b");
    if (!fp) return fprintf(stderr, "corrupt: cannot write %s\n", file), 2;
    long pos = (long)(addr + size / 2);
    fseek(fp, pos, SEEK_SET);
    int c = fgetc(fp);
    fseek(fp, pos, SEEK_SET);
    fputc(c ^ 0x10, fp);
    fclose(fp);
    printf("flipped bit 4 of byte %ld (chunk %d of %s at %llu, %llu bytes)\n", pos, chunk, dset,
           (unsigned long long)addr, (unsigned long long)size);
    return 0;
}

static int cmd_tamper(const char *what, const char *file, const char *dset, const char *target) {
    hid_t f = H5Fopen(file, H5F_ACC_RDWR, H5P_DEFAULT);
    if (f < 0) return fprintf(stderr, "%s: cannot open %s\n", what, file), 2;
    int rc = 0;
    if (H5Ldelete(f, dset, H5P_DEFAULT) < 0) rc = 2;
    if (!rc && !strcmp(what, "reshape")) {
        hsize_t dims[2] = {3, 3};
        hid_t sp = H5Screate_simple(2, dims, NULL);
        hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
        H5Pset_create_intermediate_group(lcpl, 1);
        hid_t d = H5Dcreate2(f, dset, H5T_IEEE_F32LE, sp, lcpl, H5P_DEFAULT, H5P_DEFAULT);
        float z[9] = {0};
        if (d < 0 || H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, z) < 0) rc = 2;
        if (d >= 0) H5Dclose(d);
        H5Sclose(sp);
        H5Pclose(lcpl);
    } else if (!rc && !strcmp(what, "link")) {
        if (H5Lcreate_external(target, dset, f, dset, H5P_DEFAULT, H5P_DEFAULT) < 0) rc = 2;
    }
    H5Fclose(f);
    if (rc) fprintf(stderr, "%s %s %s failed\n", what, file, dset);
    return rc;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr,
                "usage: ckpt_driver save|load|sim|async-stress|corrupt|delete|reshape|link|compare ...\n");
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "corrupt") && argc >= 4)
        return cmd_corrupt(argv[2], argv[3], argc >= 6 ? atoi(argv[5]) : 0);
    if ((!strcmp(cmd, "delete") || !strcmp(cmd, "reshape")) && argc == 4)
        return cmd_tamper(cmd, argv[2], argv[3], NULL);
    if (!strcmp(cmd, "link") && argc == 5) return cmd_tamper(cmd, argv[2], argv[3], argv[4]);
    if (!strcmp(cmd, "compare") && argc >= 4)
        return cmd_compare(argv[2], argv[3], argc >= 6 ? atof(argv[5]) : 0);
    dg_test_mpi_init(&argc, &argv, &g_rank, &g_size);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    if (g_size > 64) DIE("at most 64 ranks");
    dg_log_init(g_rank, "", DG_LOG_WARN, NULL);
    build_model();
    opts_t o;
    int rc = 2;
    if (!strcmp(cmd, "save")) {
        parse_opts(argc, argv, 2, &o);
        rc = cmd_save(&o);
    } else if (!strcmp(cmd, "load") && argc >= 3) {
        parse_opts(argc, argv, 3, &o);
        rc = cmd_load(argv[2], &o);
    } else if (!strcmp(cmd, "sim")) {
        parse_opts(argc, argv, 2, &o);
        rc = cmd_sim(&o);
    } else if (!strcmp(cmd, "async-stress")) {
        parse_opts(argc, argv, 2, &o);
        rc = cmd_async_stress(&o);
    } else {
        DIE("unknown command %s", cmd);
    }
    MPI_Finalize();
    return rc;
}
