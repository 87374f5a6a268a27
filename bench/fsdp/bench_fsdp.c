/* bench_fsdp.c — FSDP step time with the collectives overlapped with compute and without, and the
 * exposed communication per step (issue 4, "Benchmark").
 *
 * Every rank trains the same GPT (default: 6 layers, d_model 384, 6 heads, seq 256) sharded over the
 * mesh (default dp_shard = world) on synthetic tokens, in three modes, each after warm-up steps:
 *   overlap      parallel.overlap = true (collectives on the comm thread, prefetch, waits where needed)
 *   no-overlap   parallel.overlap = false (every collective waited for right after it is issued)
 *   compute-only the reference measured in the same run: every rank trains an unsharded replica on its
 *                micro-batches at the same time (same CPU contention, no communication at all)
 * Reported per mode: step time (slowest rank, mean over the timed steps), exposed communication (time a
 * rank was blocked in collective waits and blocking collectives, max over ranks) and its share of the
 * step, and the step time relative to compute-only. The target (issue 4): with overlap, exposed
 * communication < 10% of the step at 2 ranks for the 6-layer, 384-wide model.
 * Output: a table on stdout, and with --json FILE one JSON object per mode (one per line).
 */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp.h"

typedef struct {
    int layers, d_model, heads, seq, micro, accum, steps, warmup, threads;
    char mesh[128];
    char json[512];
    double bucket_mb, prefetch_mb;
} opts_t;

static int rank, world;

#define CHECK(expr)                                                                                          \
    do {                                                                                                     \
        dg_status_t s_ = (expr);                                                                             \
        if (s_ != DG_OK) {                                                                                   \
            fprintf(stderr, "rank %d: %s failed: %s\n", rank, #expr, dg_last_error());                       \
            MPI_Abort(MPI_COMM_WORLD, 2);                                                                    \
        }                                                                                                    \
    } while (0)

typedef struct {
    const char *mode;
    double step_s, exposed_s, exposed_frac;
    uint64_t collectives;
} result_t;

static uint64_t rng(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return *s >> 33;
}

/* Runs warmup + steps optimizer steps; returns the mean step time of the slowest rank and the mean
 * exposed communication of the most exposed rank. */
static void run(dg_model_t *m, const opts_t *o, const dg_model_desc_t *d, result_t *r) {
    size_t n = (size_t)o->micro * d->seq_len;
    int32_t *tok = malloc(n * sizeof *tok), *tgt = malloc(n * sizeof *tgt);
    uint64_t seed = 12345 + (uint64_t)rank;
    dg_optim_hparams_t h = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f,
                            .grad_clip = 1.0f};
    double sum_step = 0, sum_exp = 0;
    uint64_t coll = 0;
    for (int s = 0; s < o->warmup + o->steps; s++) {
        MPI_Barrier(MPI_COMM_WORLD);
        dg_model_comm_stats_t cs;
        dg_model_comm_stats(m, &cs, 1);
        double t0 = MPI_Wtime();
        CHECK(dg_model_zero_grad(m));
        for (int a = 0; a < o->accum; a++) {
            for (size_t i = 0; i < n; i++) {
                tok[i] = (int32_t)(rng(&seed) % (uint64_t)d->vocab_size);
                tgt[i] = (int32_t)(rng(&seed) % (uint64_t)d->vocab_size);
            }
            CHECK(dg_model_forward_backward(m, tok, tgt, 1.0f / (float)(n * (size_t)o->accum * (size_t)world), NULL));
        }
        h.t = s + 1;
        float norm;
        CHECK(dg_model_optimizer_step(m, &h, &norm));
        double dt = MPI_Wtime() - t0;
        dg_model_comm_stats(m, &cs, 1);
        double loc[2] = {dt, cs.wait_s + cs.blocking_s}, mx[2];
        MPI_Allreduce(loc, mx, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (s >= o->warmup) {
            sum_step += mx[0];
            sum_exp += mx[1];
            coll += cs.collectives;
        }
    }
    r->step_s = sum_step / o->steps;
    r->exposed_s = sum_exp / o->steps;
    r->exposed_frac = r->step_s > 0 ? r->exposed_s / r->step_s : 0;
    r->collectives = coll / (uint64_t)o->steps;
    free(tok);
    free(tgt);
}

static void parse(int argc, char **argv, opts_t *o) {
    *o = (opts_t){6, 384, 6, 256, 2, 1, 5, 2, 1, "", "", 25, 256};
    snprintf(o->mesh, sizeof o->mesh, "dp_shard=%d", world);
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--layers")) o->layers = atoi(v);
        else if (!strcmp(k, "--d-model")) o->d_model = atoi(v);
        else if (!strcmp(k, "--heads")) o->heads = atoi(v);
        else if (!strcmp(k, "--seq")) o->seq = atoi(v);
        else if (!strcmp(k, "--micro")) o->micro = atoi(v);
        else if (!strcmp(k, "--accum")) o->accum = atoi(v);
        else if (!strcmp(k, "--steps")) o->steps = atoi(v);
        else if (!strcmp(k, "--warmup")) o->warmup = atoi(v);
        else if (!strcmp(k, "--threads")) o->threads = atoi(v);
        else if (!strcmp(k, "--mesh")) snprintf(o->mesh, sizeof o->mesh, "%s", v);
        else if (!strcmp(k, "--json")) snprintf(o->json, sizeof o->json, "%s", v);
        else if (!strcmp(k, "--bucket-mb")) o->bucket_mb = atof(v);
        else if (!strcmp(k, "--prefetch-mb")) o->prefetch_mb = atof(v);
        else {
            if (rank == 0) fprintf(stderr, "bench_fsdp: unknown option %s\n", k);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
    }
}

int main(int argc, char **argv) {
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    opts_t o;
    parse(argc, argv, &o);
    dg_mesh_shape_t mesh;
    int is_auto = 0;
    CHECK(dg_mesh_parse(o.mesh, world, &mesh, &is_auto));
    dg_model_desc_t d = {o.layers, o.heads, o.d_model, o.seq, 256, 256};
    CHECK(dg_model_desc_validate(&d));
    dg_backend_config_t bc = {.act_dtype = DG_F32, .threads = o.threads};
    dg_backend_t *be = NULL;
    CHECK(dg_backend_cpu_create(&bc, &be));

    result_t res[3] = {{"overlap", 0, 0, 0, 0}, {"no-overlap", 0, 0, 0, 0}, {"compute-only", 0, 0, 0, 0}};
    size_t state_bytes[3] = {0};
    for (int mode = 0; mode < 3; mode++) {
        dg_model_t *m = NULL;
        dg_fsdp_t *f = NULL;
        if (mode < 2) {
            dg_fsdp_opts_t fo;
            dg_fsdp_opts_default(&fo);
            fo.overlap = mode == 0;
            fo.bucket_mb = o.bucket_mb;
            fo.prefetch_budget_mb = o.prefetch_mb;
            CHECK(dg_fsdp_create(MPI_COMM_WORLD, &mesh, &fo, &f));
            CHECK(dg_fsdp_model_create(f, &d, be, o.micro, 1, 0, &m));
        } else {
            CHECK(dg_model_create(&d, be, o.micro, 1, &m));
        }
        state_bytes[mode] = dg_model_state_bytes(m);
        run(m, &o, &d, &res[mode]);
        dg_model_free(m);
        dg_fsdp_free(f);
    }
    if (rank == 0) {
        char mstr[128];
        dg_mesh_format(&mesh, mstr, sizeof mstr);
        printf("bench_fsdp: %d ranks, mesh %s; model %d layers x d_model %d (%d heads), seq %d, micro-batch %d x %d; "
               "%d timed steps after %d warm-up\n",
               world, mstr, o.layers, o.d_model, o.heads, o.seq, o.micro, o.accum, o.steps, o.warmup);
        printf("%-13s %10s %12s %9s %14s %12s %14s\n", "mode", "step_ms", "exposed_ms", "exposed", "vs_compute", "colls/step",
               "state_MB/rank");
        for (int i = 0; i < 3; i++)
            printf("%-13s %10.1f %12.2f %8.1f%% %13.2fx %12llu %14.1f\n", res[i].mode, res[i].step_s * 1e3,
                   res[i].exposed_s * 1e3, 100 * res[i].exposed_frac, res[i].step_s / res[2].step_s,
                   (unsigned long long)res[i].collectives, state_bytes[i] / 1e6);
        printf("overlap speed-up: %.2fx (no-overlap step / overlap step); exposed communication with overlap %.1f%% of "
               "the step (target < 10%% at 2 ranks)\n",
               res[1].step_s / res[0].step_s, 100 * res[0].exposed_frac);
        if (o.json[0]) {
            FILE *js = fopen(o.json, "a");
            if (!js) {
                fprintf(stderr, "bench_fsdp: cannot open %s\n", o.json);
            } else {
                for (int i = 0; i < 3; i++)
                    fprintf(js,
                            "{\"bench\":\"fsdp\",\"ranks\":%d,\"mesh\":\"%s\",\"layers\":%d,\"d_model\":%d,\"seq\":%d,"
                            "\"micro\":%d,\"mode\":\"%s\",\"step_ms\":%.3f,\"exposed_ms\":%.3f,\"exposed_frac\":%.4f,"
                            "\"vs_compute_only\":%.4f,\"collectives_per_step\":%llu,\"state_bytes_per_rank\":%zu}\n",
                            world, mstr, o.layers, o.d_model, o.seq, o.micro, res[i].mode, res[i].step_s * 1e3,
                            res[i].exposed_s * 1e3, res[i].exposed_frac, res[i].step_s / res[2].step_s,
                            (unsigned long long)res[i].collectives, state_bytes[i]);
                fclose(js);
            }
        }
    }
    dg_backend_free(be);
    MPI_Finalize();
    return 0;
}
