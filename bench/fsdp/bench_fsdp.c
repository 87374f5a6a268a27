/* bench_fsdp.c — FSDP step time with the collectives overlapped with compute and without, and the
 * exposed communication per step (docs/fsdp.md, "Benchmark").
 *
 * Every rank trains the same GPT (default: 6 layers, d_model 384, 6 heads, seq 256) sharded over the
 * mesh (default dp_shard = world) on synthetic tokens, in three modes, each after warm-up steps:
 *   overlap      parallel.overlap = true (collectives on the comm thread, prefetch, waits where needed)
 *   no-overlap   parallel.overlap = false (every collective waited for right after it is issued)
 *   compute-only the reference measured in the same run: every rank trains an unsharded replica on its
 *                micro-batches at the same time (same CPU contention, no communication at all)
 * The modes run interleaved (one step of each in turn), so that the load of a shared machine changes
 * all of them alike. Reported per mode, as medians over the steps: step time (slowest rank), exposed
 * communication (time a rank was blocked in collective waits and blocking collectives, max over ranks)
 * and its share of the step, and the step time relative to compute-only. The target (docs/fsdp.md): with
 * overlap, exposed communication < 10% of the step at 2 ranks for the 6-layer, 384-wide model. Output: a
 * table on stdout, and with --json FILE one JSON object per mode (one per line); --profile 1 adds rank 0's
 * time per op kind in the overlap mode (waits counted in the op that waits). --reduce-scatter ring|mpi picks
 * the comm layer's reduce-scatter (parallel.reduce_scatter; default ring).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../lib/bench_mpi.h"
#include "../lib/bench_train.h"
#include "fsdp.h"

typedef struct {
    BENCH_GPT_FIELDS;
    int accum, threads, profile, rs_mpi;
    char mesh[128];
    char json[512];
    double bucket_mb, prefetch_mb;
} opts_t;

static int rank, world;

typedef struct {
    const char *mode;
    double step_s, exposed_s, exposed_frac;
    uint64_t collectives;
    double exposed_min_s, exposed_min_frac;
    double *steps, *exposed, *exposed_min; /* per timed step: slowest rank / most / least exposed rank */
    int n;
} result_t;

/* Runs `count` optimizer steps of m; records each step's time on the slowest rank and the exposed
 * communication of the most exposed rank when `rec` is given. */
static void run(dg_model_t *m, const opts_t *o, const dg_model_desc_t *d, int count, int64_t *t,
                result_t *rec) {
    size_t n = (size_t)o->micro * d->seq_len;
    int32_t *tok = malloc(n * sizeof *tok), *tgt = malloc(n * sizeof *tgt);
    uint64_t seed = 12345 + (uint64_t)rank * 7919 + (uint64_t)*t;
    dg_optim_hparams_t h = bench_adamw(1e-3f, 0);
    for (int s = 0; s < count; s++) {
        MPI_Barrier(MPI_COMM_WORLD);
        dg_model_comm_stats_t cs;
        dg_model_comm_stats(m, &cs, 1);
        double t0 = MPI_Wtime();
        RANK_MUST(dg_model_zero_grad(m));
        for (int a = 0; a < o->accum; a++) {
            for (size_t i = 0; i < n; i++) {
                tok[i] = (int32_t)((bench_lcg(&seed) >> 33) % (uint64_t)d->vocab_size);
                tgt[i] = (int32_t)((bench_lcg(&seed) >> 33) % (uint64_t)d->vocab_size);
            }
            RANK_MUST(dg_model_forward_backward(m, tok, tgt,
                                                1.0f / (float)(n * (size_t)o->accum * (size_t)world), NULL));
        }
        h.t = ++*t;
        float norm;
        RANK_MUST(dg_model_optimizer_step(m, &h, &norm));
        double dt = MPI_Wtime() - t0;
        dg_model_comm_stats(m, &cs, 1);
        double loc[2] = {dt, cs.wait_s + cs.blocking_s}, mx[2], mn = 0;
        MPI_Allreduce(loc, mx, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        MPI_Allreduce(&loc[1], &mn, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
        if (rec) {
            rec->steps[rec->n] = mx[0];
            rec->exposed[rec->n] = mx[1];
            rec->exposed_min[rec->n] = mn;
            rec->n++;
            rec->collectives = cs.collectives;
        }
    }
    free(tok);
    free(tgt);
}

/* The options: pairs of name and value; a lone last argument is ignored. */
static void parse(int argc, char **argv, opts_t *o) {
    /* BENCH_GPT_FIELDS (layers, d_model, heads, seq, micro, steps, warmup), accum, threads, profile, rs_mpi,
     * mesh, json, bucket_mb, prefetch_mb */
    *o = (opts_t){6, 384, 6, 256, 2, 9, 1, 1, 1, 0, 0, "", "", 25, 256};
    snprintf(o->mesh, sizeof o->mesh, "dp_shard=%d", world);
    const char *mesh_s = NULL, *json_s = NULL;
    void *const dst[] = {BENCH_GPT_DST(o), &o->accum, &o->threads,   &o->profile,
                         &mesh_s,          &json_s,   &o->bucket_mb, &o->prefetch_mb};
    const char *spec = BENCH_GPT_SPEC " --accum=int --threads=int --profile=int --mesh=str --json=str "
                                      "--bucket-mb=real --prefetch-mb=real";
    for (int i = 1; (i = bench_args(argc, argv, i, spec, dst)) + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--reduce-scatter") && (!strcmp(v, "ring") || !strcmp(v, "mpi"))) {
            o->rs_mpi = !strcmp(v, "mpi");
        } else {
            if (rank == 0) fprintf(stderr, "bench_fsdp: unknown option %s\n", k);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
    }
    if (mesh_s) snprintf(o->mesh, sizeof o->mesh, "%s", mesh_s);
    if (json_s) snprintf(o->json, sizeof o->json, "%s", json_s);
}

int main(int argc, char **argv) {
    bench_mpi_init(&argc, &argv, &rank, &world);
    opts_t o;
    parse(argc, argv, &o);
    dg_mesh_shape_t mesh;
    int is_auto = 0;
    RANK_MUST(dg_mesh_parse(o.mesh, world, &mesh, &is_auto));
    dg_model_desc_t d = bench_gpt_desc(&o);
    RANK_MUST(dg_model_desc_validate(&d));
    dg_backend_config_t bc = {.act_dtype = DG_F32, .threads = o.threads};
    dg_backend_t *be = NULL;
    RANK_MUST(dg_backend_cpu_create(&bc, &be));

    /* the three modes run interleaved, `steps` rounds of one step each, so that a change of the
     * machine's load hits all of them alike; medians over the rounds */
    result_t res[3] = {{.mode = "overlap"}, {.mode = "no-overlap"}, {.mode = "compute-only"}};
    size_t state_bytes[3] = {0};
    dg_model_t *models[3] = {NULL};
    dg_fsdp_t *fs[2] = {NULL};
    int64_t t[3] = {0};
    for (int mode = 0; mode < 3; mode++) {
        if (mode < 2) {
            dg_fsdp_opts_t fo;
            dg_fsdp_opts_default(&fo);
            fo.overlap = mode == 0;
            fo.bucket_mb = o.bucket_mb;
            fo.prefetch_budget_mb = o.prefetch_mb;
            fo.rs_mpi = o.rs_mpi;
            RANK_MUST(dg_fsdp_create(MPI_COMM_WORLD, &mesh, &fo, &fs[mode]));
            RANK_MUST(dg_fsdp_model_create(fs[mode], &d, be, o.micro, 1, 0, &models[mode]));
        } else {
            RANK_MUST(dg_model_create(&d, be, o.micro, 1, &models[mode]));
        }
        RANK_MUST(dg_model_set_grad_accum(models[mode], o.accum));
        state_bytes[mode] = dg_model_state_bytes(models[mode]);
        res[mode].steps = calloc((size_t)o.steps, sizeof(double));
        res[mode].exposed = calloc((size_t)o.steps, sizeof(double));
        res[mode].exposed_min = calloc((size_t)o.steps, sizeof(double));
        run(models[mode], &o, &d, o.warmup, &t[mode], NULL);
    }
    for (int r = 0; r < o.steps; r++)
        for (int mode = 0; mode < 3; mode++)
            run(models[mode], &o, &d, 1, &t[mode], &res[mode]);
    for (int mode = 0; mode < 3; mode++) {
        res[mode].step_s = bench_median(res[mode].steps, res[mode].n);
        res[mode].exposed_s = bench_median(res[mode].exposed, res[mode].n);
        res[mode].exposed_frac = res[mode].exposed_s / res[mode].step_s;
        res[mode].exposed_min_s = bench_median(res[mode].exposed_min, res[mode].n);
        res[mode].exposed_min_frac = res[mode].exposed_min_s / res[mode].step_s;
    }
    if (o.profile) { /* per op kind, waits included in the op that waits (syncs after every op) */
        dg_model_set_profiling(models[0], 1);
        run(models[0], &o, &d, 2, &t[0], NULL);
        if (rank == 0) {
            printf("profile of the overlap mode, rank 0, 2 steps (an op's time includes its waits):\n");
            dg_model_print_profile(models[0], stdout);
        }
        dg_model_set_profiling(models[0], 0);
    }
    for (int mode = 0; mode < 3; mode++) {
        dg_model_free(models[mode]);
        if (mode < 2) dg_fsdp_free(fs[mode]);
    }
    if (rank == 0) {
        char mstr[128];
        dg_mesh_format(&mesh, mstr, sizeof mstr);
        printf("bench_fsdp: %d ranks, mesh %s; model %d layers x d_model %d (%d heads), seq %d, micro-batch "
               "%d x %d; %s reduce-scatter; "
               "medians of %d interleaved steps per mode after %d warm-up\n",
               world, mstr, o.layers, o.d_model, o.heads, o.seq, o.micro, o.accum,
               o.rs_mpi ? "MPI's" : "ring", o.steps, o.warmup);
        printf("%-13s %10s %12s %9s %12s %9s %11s %11s %14s\n", "mode", "step_ms", "exposed_ms", "exposed",
               "exp_min_ms", "exp_min", "vs_compute", "colls/step", "state_MB/rank");
        for (int i = 0; i < 3; i++)
            printf("%-13s %10.1f %12.2f %8.1f%% %12.2f %8.1f%% %10.2fx %11llu %14.1f\n", res[i].mode,
                   res[i].step_s * 1e3, res[i].exposed_s * 1e3, 100 * res[i].exposed_frac,
                   res[i].exposed_min_s * 1e3, 100 * res[i].exposed_min_frac, res[i].step_s / res[2].step_s,
                   (unsigned long long)res[i].collectives, state_bytes[i] / 1e6);
        printf("exposed = time blocked on collectives on the most exposed rank (includes waiting for a "
               "slower peer); "
               "exp_min = on the least exposed rank\n");
        printf("overlap speed-up: %.2fx (no-overlap step / overlap step); exposed communication with overlap "
               "%.1f%% of "
               "the step (least exposed rank %.1f%%; target < 10%% at 2 ranks)\n",
               res[1].step_s / res[0].step_s, 100 * res[0].exposed_frac, 100 * res[0].exposed_min_frac);
        if (o.json[0]) {
            FILE *js = fopen(o.json, "a");
            if (!js) {
                fprintf(stderr, "bench_fsdp: cannot open %s\n", o.json);
            } else {
                for (int i = 0; i < 3; i++)
                    fprintf(js,
                            "{\"bench\":\"fsdp\",\"ranks\":%d,\"mesh\":\"%s\",\"layers\":%d,\"d_model\":%d,"
                            "\"seq\":%d,"
                            "\"micro\":%d,\"mode\":\"%s\",\"step_ms\":%.3f,\"exposed_ms\":%.3f,\"exposed_"
                            "frac\":%.4f,"
                            "\"exposed_min_ms\":%.3f,"
                            "\"vs_compute_only\":%.4f,\"collectives_per_step\":%llu,\"state_bytes_per_rank\":"
                            "%zu}\n",
                            world, mstr, o.layers, o.d_model, o.seq, o.micro, res[i].mode,
                            res[i].step_s * 1e3, res[i].exposed_s * 1e3, res[i].exposed_frac,
                            res[i].exposed_min_s * 1e3, res[i].step_s / res[2].step_s,
                            (unsigned long long)res[i].collectives, state_bytes[i]);
                fclose(js);
            }
        }
    }
    for (int mode = 0; mode < 3; mode++) {
        free(res[mode].steps);
        free(res[mode].exposed);
        free(res[mode].exposed_min);
    }
    dg_backend_free(be);
    MPI_Finalize();
    return 0;
}
