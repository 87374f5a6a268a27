/* bench_pp.c — the pipeline executor on CPU ranks (docs/parallelism.md "The executor", "Benchmark"):
 *   1. the bubble measured against theory: pp = world stages, 1F1B, m micro-batches per step for m in
 *      {p, 2p, 4p, 8p}; measured bubble = 1 - sum over ranks of forward + backward seconds / (p x the
 *      slowest rank's replay of the schedule, dg_pp_exec_step), theory (p - 1) / (m + p - 1) (uniform
 *      costs; here a backward costs about 2 forwards and the stages differ by the head); printed with
 *      their ratio;
 *   2. step time pp = world against dp_replicate = world (plain data parallelism) on the same global batch
 *      (8 x world sequences), measured in the same invocation, one step of each in turn; the ratio
 *      pp / dp printed;
 *   3. stage-to-stage messages overlapped with compute (the executor's default on the mpi comm) against
 *      each group completed before the next compute (opts.no_overlap), m = 4p, one step of each in turn;
 *      the ratio printed. On one node messages are cheap; DG_TEST_P2P_LATENCY_US (a test hook, builds
 *      with -DDGT_TEST_HOOKS=ON) makes every send leave that much later, as over a slow link.
 * Each rank one OpenMP thread (OMP_NUM_THREADS=1). Options: --layers L --d-model C --heads H --seq T
 * --micro B --steps N --warmup W. Medians over the timed steps.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../lib/bench_mpi.h"
#include "../lib/bench_train.h"
#include "fsdp.h"
#include "pp_exec.h"

static int rank, world;

typedef struct {
    BENCH_GPT_FIELDS;
} opts_t;

/* One pipeline step; *wall: the slowest rank's step (zero_grad, schedule, optimizer), *bubble: 1 - the sum of
 * every rank's compute seconds / (p x the slowest rank's schedule replay). */
static void pp_step(dg_pp_exec_t *e, const int32_t *tok, const int32_t *tgt, float dloss, double *wall,
                    double *bubble) {
    const dg_optim_hparams_t k_h = bench_adamw(1e-3f, 1);
    MPI_Barrier(MPI_COMM_WORLD);
    double loss = 0, t0 = MPI_Wtime();
    RANK_MUST(dg_pp_exec_zero_grad(e));
    RANK_MUST(dg_pp_exec_step(e, tok, tgt, dloss, &loss));
    float gn = 0;
    RANK_MUST(dg_pp_exec_optimizer(e, &k_h, &gn));
    double dt = MPI_Wtime() - t0, c = 0, r = 0, busy = 0, replay = 0;
    dg_pp_exec_times(e, &c, &r);
    MPI_Allreduce(&dt, wall, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(&c, &busy, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&r, &replay, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    *bubble = 1.0 - busy / ((double)world * replay);
}

static void dp_step(dg_model_t *m, const int32_t *tok, const int32_t *tgt, int accum, size_t per, float dloss,
                    double *wall) {
    const dg_optim_hparams_t k_h = bench_adamw(1e-3f, 1);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    RANK_MUST(dg_model_zero_grad(m));
    for (int a = 0; a < accum; a++)
        RANK_MUST(dg_model_forward_backward(m, tok + (size_t)a * per, tgt + (size_t)a * per, dloss, NULL));
    float gn = 0;
    RANK_MUST(dg_model_optimizer_step(m, &k_h, &gn));
    double dt = MPI_Wtime() - t0;
    MPI_Allreduce(&dt, wall, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
}

static dg_pp_exec_t *make_pp(dg_fsdp_t *f, const dg_model_desc_t *d, dg_backend_t *be, const opts_t *o, int m,
                             int no_overlap) {
    dg_pp_exec_opts_t po =
        dg_pp_exec_opts_for(d, be, o->micro, 7, &f->par, f->comms->pp_act, f->comms->pp_grad, MPI_COMM_WORLD);
    po.m = m;
    po.no_overlap = no_overlap;
    dg_pp_exec_t *e = NULL;
    RANK_MUST(dg_pp_exec_create(&po, &e));
    return e;
}

int main(int argc, char **argv) {
    bench_mpi_init(&argc, &argv, &rank, &world);
    opts_t o = {.layers = 8, .d_model = 128, .heads = 4, .seq = 128, .micro = 2, .steps = 5, .warmup = 1};
    void *const dst[] = {BENCH_GPT_DST(&o)};
    int i = 1; /* pairs of name and value; an unknown pair and a lone last argument are ignored */
    while ((i = bench_args(argc, argv, i, BENCH_GPT_SPEC, dst)) + 1 < argc)
        i += 2;
    if (world < 2) {
        fprintf(stderr, "bench_pp: needs >= 2 ranks (pipeline stages)\n");
        MPI_Finalize();
        return 2;
    }
    dg_model_desc_t d = bench_gpt_desc(&o);
    dg_backend_config_t bc = {0};
    bc.act_dtype = DG_F32;
    bc.threads = 1;
    dg_backend_t *be = NULL;
    RANK_MUST(dg_backend_cpu_create(&bc, &be));
    dg_fsdp_opts_t fo;
    dg_fsdp_opts_default(&fo);
    snprintf(fo.comm, sizeof fo.comm, "mpi");
    dg_mesh_shape_t pmesh = {{1, 1, 1, world}, {DG_MESH_DP_REPLICATE, DG_MESH_DP_SHARD, DG_MESH_TP}};
    dg_mesh_shape_t dmesh = {{world, 1, 1, 1}, {DG_MESH_DP_REPLICATE, DG_MESH_DP_SHARD, DG_MESH_TP}};
    dg_fsdp_t *fp = NULL, *fd = NULL;
    RANK_MUST(dg_fsdp_create(MPI_COMM_WORLD, &pmesh, &fo, &fp));
    RANK_MUST(dg_fsdp_create(MPI_COMM_WORLD, &dmesh, &fo, &fd));
    const size_t per = (size_t)o.micro * (size_t)o.seq;
    const int mmax = 8 * world;
    int32_t *tok = malloc((size_t)mmax * per * sizeof *tok), *tgt = malloc((size_t)mmax * per * sizeof *tgt);
    bench_fill_tokens(tok, (size_t)mmax * per, 256, 1 + (uint64_t)rank);
    bench_fill_tokens(tgt, (size_t)mmax * per, 256, 99 + (uint64_t)rank);
    double *w = calloc((size_t)o.steps, sizeof *w), *b = calloc((size_t)o.steps, sizeof *b);
    if (rank == 0)
        printf("bench_pp: %d layers, d_model %d, %d heads, seq %d, micro-batch %d, fp32 CPU, %d ranks, "
               "%d timed steps (median) after %d warm-up\n\n  pp  m   step ms  bubble measured  theory  "
               "measured/theory  simulated  measured/simulated\n",
               o.layers, o.d_model, o.heads, o.seq, o.micro, world, o.steps, o.warmup);
    /* 1. bubble against theory */
    for (int m = world; m <= mmax; m *= 2) {
        dg_pp_exec_t *e = make_pp(fp, &d, be, &o, m, 0);
        float dloss = 1.0f / (float)((size_t)m * per);
        double wall, busy;
        for (int s = 0; s < o.warmup; s++)
            pp_step(e, tok, tgt, dloss, &wall, &busy);
        for (int s = 0; s < o.steps; s++) {
            pp_step(e, tok, tgt, dloss, &wall, &busy);
            w[s] = wall;
            b[s] = busy;
        }
        double th = dg_pp_bubble_theory(DG_PP_1F1B, world, 1, m), mw = bench_median(w, o.steps),
               mb = bench_median(b, o.steps);
        /* the simulator's bubble for this split (each chunk's FLOPs; messages free): the schedule's own
         * imbalance (a backward costs ~2 forwards, the head on the last stage), which theory leaves out */
        dg_pp_costs_t pc;
        dg_pp_costs_from_split(dg_pp_exec_split(e), 1e9, &pc);
        dg_pp_sim_t sim;
        RANK_MUST(dg_pp_simulate(dg_pp_exec_schedule(e), &pc, 0, &sim));
        if (rank == 0)
            printf("  %2d %3d  %8.1f  %15.3f  %6.3f  %15.2f  %9.3f  %18.2f\n", world, m, 1e3 * mw, mb, th,
                   mb / th, sim.bubble, mb / sim.bubble);
        dg_pp_sim_free(&sim);
        dg_pp_exec_free(e);
    }
    /* 2. pp = world against dp_replicate = world, global batch 8 x world micro-batches, interleaved steps */
    int m = 4 * world, accum = m / world;
    dg_pp_exec_t *e = make_pp(fp, &d, be, &o, m, 0);
    dg_model_t *dm = NULL;
    RANK_MUST(dg_fsdp_model_create(fd, &d, be, o.micro, 7, 0, &dm));
    RANK_MUST(dg_model_set_grad_accum(dm, accum));
    double *wd = calloc((size_t)o.steps, sizeof *wd);
    float dloss = 1.0f / (float)((size_t)m * per);
    double wall, busy;
    for (int s = 0; s < o.warmup + o.steps; s++) {
        pp_step(e, tok, tgt, dloss, &wall, &busy);
        if (s >= o.warmup) w[s - o.warmup] = wall;
        dp_step(dm, tok, tgt, accum, per, dloss, &wall);
        if (s >= o.warmup) wd[s - o.warmup] = wall;
    }
    double mp = bench_median(w, o.steps), md = bench_median(wd, o.steps);
    if (rank == 0)
        printf(
            "\n  global batch %d sequences: pp=%d %.1f ms/step, dp_replicate=%d %.1f ms/step, pp/dp = %.2f\n",
            m * o.micro, world, 1e3 * mp, world, 1e3 * md, mp / md);
    dg_model_free(dm);
    /* 3. overlap against no overlap, same m, interleaved steps */
    dg_pp_exec_t *en = make_pp(fp, &d, be, &o, m, 1);
    for (int s = 0; s < o.warmup + o.steps; s++) {
        pp_step(e, tok, tgt, dloss, &wall, &busy);
        if (s >= o.warmup) w[s - o.warmup] = wall, b[s - o.warmup] = busy;
        pp_step(en, tok, tgt, dloss, &wall, &busy);
        if (s >= o.warmup) wd[s - o.warmup] = wall;
    }
    double mo = bench_median(w, o.steps), mn = bench_median(wd, o.steps), bo = bench_median(b, o.steps);
    const char *lat = getenv("DG_TEST_P2P_LATENCY_US");
    if (rank == 0)
        printf("  m = %d, p2p latency %s us: overlap %.1f ms/step (bubble %.3f), no overlap %.1f ms/step, "
               "overlap / no overlap = %.2f\n",
               m, lat && *lat ? lat : "0", 1e3 * mo, bo, 1e3 * mn, mo / mn);
    dg_pp_exec_free(en);
    dg_pp_exec_free(e);
    free(w);
    free(b);
    free(wd);
    free(tok);
    free(tgt);
    dg_fsdp_free(fp);
    dg_fsdp_free(fd);
    dg_backend_free(be);
    MPI_Finalize();
    return 0;
}
