/* test_pp_overlap.c — the pipeline executor's overlap of stage-to-stage messages with compute
 * (src/pipeline/executor.c "overlap", docs/parallelism.md "The executor"), on CPU ranks over the mpi comm.
 *
 * For each schedule (1F1B; interleaved with 2 chunks per rank) two executors are made from the same seed,
 * one with overlap (the default) and one with opts.no_overlap (each group completed before the next
 * compute); they train the same micro-batches for STEPS steps, one step of each in turn. Checked on every
 * rank and step: the loss sum and the gradient norm are the same bits; the overlapping executor began
 * some of its forwards / backwards with a message still in flight and the other never did; after the
 * last step every parameter and Adam moment of every chunk is the same bits in both. Run with 2 ranks
 * (mpiexec -n 2). */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <string.h>

#include "dg_check.h"
#include "fsdp.h"
#include "pp_exec.h"
#include "dg_test_mpi.h"

#define STEPS 4
#define M 6 /* micro-batches per step (>= pp; with 2 ranks not a multiple of pp x chunks' group) */

static int rank, world;

static const dg_optim_hparams_t k_h = {.lr = 3e-3f,
                                       .beta1 = 0.9f,
                                       .beta2 = 0.95f,
                                       .eps = 1e-8f,
                                       .weight_decay = 0.1f,
                                       .grad_clip = 1.0f,
                                       .t = 1};

static dg_pp_exec_t *make(dg_fsdp_t *f, const dg_model_desc_t *d, dg_backend_t *be, int kind, int virt,
                          int no_overlap) {
    dg_pp_exec_opts_t po =
        dg_pp_exec_opts_for(d, be, 1, 11, &f->par, f->comms->pp_act, f->comms->pp_grad, MPI_COMM_WORLD);
    po.kind = kind;
    po.virt = virt;
    po.m = M;
    po.no_overlap = no_overlap;
    dg_pp_exec_t *e = NULL;
    OK(dg_pp_exec_create(&po, &e));
    return e;
}

static void one_step(dg_pp_exec_t *e, const int32_t *tok, const int32_t *tgt, int64_t step, float dloss,
                     double *loss, float *norm) {
    dg_optim_hparams_t h = k_h;
    h.t = (int)step;
    dg_pp_exec_set_step(e, step);
    OK(dg_pp_exec_zero_grad(e));
    OK(dg_pp_exec_step(e, tok, tgt, dloss, loss));
    OK(dg_pp_exec_optimizer(e, &h, norm));
}

/* Every local chunk's parameters (and Adam moments) of a and b are the same bits. */
static void same_state(dg_pp_exec_t *a, dg_pp_exec_t *b, const char *what) {
    static const int which[] = {DG_STATE_PARAM, DG_STATE_ADAM_M, DG_STATE_ADAM_V};
    static const char *names[] = {"parameters", "Adam m", "Adam v"};
    for (int k = 0; k < dg_pp_exec_n_models(a); k++) {
        dg_model_t *ma = dg_pp_exec_model(a, k), *mb = dg_pp_exec_model(b, k);
        size_t n = dg_model_flat_numel(ma);
        CHECK(n > 0 && n == dg_model_flat_numel(mb));
        float *pa = malloc(n * sizeof *pa), *pb = malloc(n * sizeof *pb);
        for (int w = 0; w < 3; w++) {
            OK(dg_model_get_flat(ma, which[w], pa));
            OK(dg_model_get_flat(mb, which[w], pb));
            CHECK(memcmp(pa, pb, n * sizeof *pa) == 0, "%s: chunk %d's %s differ after %d steps", what, k,
                  names[w], STEPS);
        }
        free(pa);
        free(pb);
    }
}

static void run(dg_fsdp_t *f, dg_backend_t *be, int kind, int virt, const char *what) {
    const dg_model_desc_t d = {8, 2, 32, 16, 256, 256}; /* layers, heads, d_model, seq, vocab, padded */
    const size_t per = (size_t)d.seq_len;
    int32_t tok[M * 16], tgt[M * 16];
    dg_pp_exec_t *ov = make(f, &d, be, kind, virt, 0), *no = make(f, &d, be, kind, virt, 1);
    int overlapped = 0;
    for (int64_t s = 1; s <= STEPS; s++) {
        uint64_t x = 0x9e3779b97f4a7c15ULL * (uint64_t)s;
        for (size_t i = 0; i < M * per; i++) {
            x = x * 6364136223846793005ULL + 1442695040888963407ULL;
            tok[i] = (int32_t)((x >> 33) % 256);
            tgt[i] = (int32_t)((x >> 41) % 256);
        }
        double la = 0, lb = 0;
        float na = 0, nb = 0;
        float dloss = 1.0f / (float)(M * per);
        one_step(ov, tok, tgt, s, dloss, &la, &na);
        overlapped += dg_pp_exec_overlapped(ov);
        one_step(no, tok, tgt, s, dloss, &lb, &nb);
        CHECK(dg_pp_exec_overlapped(no) == 0, "%s: no_overlap began %d computes with a message in flight",
              what, dg_pp_exec_overlapped(no));
        CHECK(memcmp(&la, &lb, sizeof la) == 0, "%s step %lld: loss sum %.17g with overlap, %.17g without",
              what, (long long)s, la, lb);
        CHECK(memcmp(&na, &nb, sizeof na) == 0 && isfinite(na), "%s step %lld: grad norm %.9g vs %.9g", what,
              (long long)s, (double)na, (double)nb);
    }
    int total = 0;
    MPI_Allreduce(&overlapped, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    CHECK(total > 0, "%s: no forward or backward began with a message in flight (overlap not engaged)", what);
    same_state(ov, no, what);
    if (rank == 0)
        printf(
            "%s: %d steps of %d micro-batches, same bits with and without overlap; %d computes (all ranks) "
            "began with a message in flight\n",
            what, STEPS, M, total);
    dg_pp_exec_free(ov);
    dg_pp_exec_free(no);
}

int main(int argc, char **argv) {
    dg_test_mpi_init(&argc, &argv, &rank, &world);
    dg_check_rank = rank;
    if (world != 2) {
        if (rank == 0) fprintf(stderr, "test_pp_overlap: run with 2 ranks\n");
        MPI_Finalize();
        return 2;
    }
    dg_fsdp_opts_t fo; /* the stages over the mpi comm, one rank per stage */
    dg_fsdp_opts_default(&fo);
    snprintf(fo.comm, sizeof fo.comm, "mpi");
    dg_mesh_shape_t mesh = {{1, 1, 1, world}, {DG_MESH_DP_REPLICATE, DG_MESH_DP_SHARD, DG_MESH_TP}};
    dg_fsdp_t *f = NULL;
    OK(dg_fsdp_create(MPI_COMM_WORLD, &mesh, &fo, &f));
    const dg_backend_config_t bc = {.act_dtype = DG_F32, .threads = 1};
    dg_backend_t *be = NULL;
    OK(dg_backend_cpu_create(&bc, &be));
    run(f, be, DG_PP_1F1B, 1, "1f1b");
    run(f, be, DG_PP_INTERLEAVED, 2, "interleaved x2");
    dg_fsdp_free(f);
    be->ops->destroy(be);
    int fails = 0;
    MPI_Allreduce(&dg_fails, &fails, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) printf("%s: %d check(s) failed\n", fails ? "FAIL" : "PASS", fails);
    MPI_Finalize();
    return fails != 0;
}
