/* bench_ckpt.c — checkpoint save/load throughput and async stall on the full training state of a
 * GPT-2-shaped model (fp32 master weights + AdamW m and v, FSDP-sharded on dim 0 as the trainer does).
 * Prints one "RESULT key=value ..." line per measurement for run.sh, which compares them with dd on the
 * same file system in the same run.
 *
 * usage: bench_ckpt --dir DIR [--layers 12] [--d 768] [--vocab 50257] [--ctx 1024] [--reps 2]
 *                   [--chunk-mb 4] [--align-kb 64] [--tokens-per-step 16384]
 * The defaults are the gpt2-124m preset (124.4M parameters, 1.49 GB of state). */
#define _GNU_SOURCE
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../lib/bench_args.h"
#include "../lib/bench_mpi.h"
#include "checkpoint.h"

static int g_rank, g_size;

typedef struct {
    char name[64];
    int ndim;
    int64_t g[2];
} param_t;

static int build(param_t *p, int layers, int64_t d, int64_t vocab, int64_t ctx) {
    int n = 0;
#define P2(nm, a, b) (snprintf(p[n].name, 64, "%s", nm), p[n].ndim = 2, p[n].g[0] = a, p[n].g[1] = b, n++)
#define P1(nm, a) (snprintf(p[n].name, 64, "%s", nm), p[n].ndim = 1, p[n].g[0] = a, p[n].g[1] = 1, n++)
    P2("wte", vocab, d);
    P2("wpe", ctx, d);
    char b[64];
    for (int l = 0; l < layers; l++) {
        snprintf(b, 64, "h.%d.ln_1.w", l), P1(b, d);
        snprintf(b, 64, "h.%d.ln_1.b", l), P1(b, d);
        snprintf(b, 64, "h.%d.attn.c_attn.w", l), P2(b, d, 3 * d);
        snprintf(b, 64, "h.%d.attn.c_attn.b", l), P1(b, 3 * d);
        snprintf(b, 64, "h.%d.attn.c_proj.w", l), P2(b, d, d);
        snprintf(b, 64, "h.%d.attn.c_proj.b", l), P1(b, d);
        snprintf(b, 64, "h.%d.ln_2.w", l), P1(b, d);
        snprintf(b, 64, "h.%d.ln_2.b", l), P1(b, d);
        snprintf(b, 64, "h.%d.mlp.c_fc.w", l), P2(b, d, 4 * d);
        snprintf(b, 64, "h.%d.mlp.c_fc.b", l), P1(b, 4 * d);
        snprintf(b, 64, "h.%d.mlp.c_proj.w", l), P2(b, 4 * d, d);
        snprintf(b, 64, "h.%d.mlp.c_proj.b", l), P1(b, d);
    }
    P1("ln_f.w", d);
    P1("ln_f.b", d);
    return n;
}

/* Measured sgemm rate of this rank (GFLOP/s), for the training-step estimate. */
static double sgemm_gflops(void) {
    int n = 1024;
    float *a = malloc((size_t)n * n * 4), *b = malloc((size_t)n * n * 4), *c = malloc((size_t)n * n * 4);
    for (int i = 0; i < n * n; i++)
        a[i] = (float)(i % 7) * 0.1f, b[i] = (float)(i % 5) * 0.1f;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1, a, n, b, n, 0, c, n);
    double t = MPI_Wtime();
    int reps = 4;
    for (int r = 0; r < reps; r++)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1, a, n, b, n, 0, c, n);
    t = MPI_Wtime() - t;
    free(a), free(b), free(c);
    return 2.0 * n * n * n * reps / t / 1e9;
}

int main(int argc, char **argv) {
    bench_mpi_init(&argc, &argv, &g_rank, &g_size);
    dg_log_init(g_rank, "", getenv("BENCH_DEBUG") ? DG_LOG_DEBUG : DG_LOG_WARN, NULL);
    dg_log_set_stderr_all_ranks(getenv("BENCH_DEBUG") != NULL);
    const char *dir = NULL;
    int layers = 12, reps = 2, save_only = 0;
    int64_t d = 768, vocab = 50257, ctx = 1024, chunk_mb = 4, align_kb = 64, tokens_per_step = 16384;
    void *const dst[] = {&save_only, &dir,  &layers,   &d,        &vocab,
                         &ctx,       &reps, &chunk_mb, &align_kb, &tokens_per_step};
    const char *spec = "--save-only=flag --dir=str --layers=int --d=i64 --vocab=i64 --ctx=i64 --reps=int "
                       "--chunk-mb=i64 --align-kb=i64 --tokens-per-step=i64";
    const int bad = bench_args(argc, argv, 1, spec, dst); /* a lone last argument ends the options */
    if (bad + 1 < argc) {
        if (!g_rank) fprintf(stderr, "bench_ckpt: unknown option %s\n", argv[bad]);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    if (!dir || layers < 0 || reps < 1) {
        if (!g_rank)
            fprintf(stderr, "usage: bench_ckpt --dir DIR [--layers N] [--d D] [--vocab V] [--reps R]\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    param_t *p = calloc((size_t)(layers * 12 + 8), sizeof *p);
    int np = build(p, layers, d, vocab, ctx);
    int nt = np * 3;
    dg_ckpt_tensor_t *t = calloc((size_t)nt, sizeof *t);
    char(*paths)[96] = calloc((size_t)nt, 96);
    int64_t nparams = 0, local = 0;
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < np; i++) {
            dg_ckpt_tensor_t *x = &t[k * np + i];
            if (k == 0)
                snprintf(paths[k * np + i], 96, "model/%s", p[i].name);
            else
                snprintf(paths[k * np + i], 96, "optim/%s/%s", p[i].name, k == 1 ? "m" : "v");
            x->path = paths[k * np + i];
            x->ndim = p[i].ndim;
            x->gshape[0] = p[i].g[0], x->gshape[1] = p[i].g[1];
            x->start[0] = p[i].g[0] * g_rank / g_size;
            x->count[0] = p[i].g[0] * (g_rank + 1) / g_size - x->start[0];
            x->count[1] = p[i].g[1];
            x->owner = 1;
            int64_t ne = x->count[0] * (x->ndim == 2 ? x->count[1] : 1);
            x->data = malloc((size_t)(ne > 0 ? ne : 1) * 4);
            for (int64_t e = 0; e < ne; e++)
                x->data[e] = (float)((e * 2654435761u + (uint64_t)i * 97u) % 100003) * 1e-5f;
            local += ne;
            if (k == 0) nparams += p[i].g[0] * (p[i].ndim == 2 ? p[i].g[1] : 1);
        }
    double state_bytes = (double)nparams * 3 * 4;
    double gf = sgemm_gflops(), gfall = 0;
    MPI_Allreduce(&gf, &gfall, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    /* a lower bound on one training step of this model on these ranks: 6 flops per parameter per token
     * at the measured sgemm rate of all ranks together (a real step also has attention and overheads) */
    double step_s = 6.0 * (double)nparams * (double)tokens_per_step / (gfall * 1e9);
    if (!g_rank)
        printf("RESULT kind=setup ranks=%d params=%lld state_bytes=%.0f tensors=%d sgemm_gflops_all=%.1f "
               "step_estimate_s=%.3f tokens_per_step=%lld\n",
               g_size, (long long)nparams, state_bytes, nt, gfall, step_s, (long long)tokens_per_step);
    dg_ckpt_meta_t m;
    dg_ckpt_meta_init(&m);
    snprintf(m.mesh, sizeof m.mesh, "dp_replicate=1,dp_shard=%d,tp=1", g_size);
    dg_ckpt_meta_set_config(&m, "[model]\npreset = gpt2-124m\n");
    dg_ckpt_save_opts_t o;
    dg_ckpt_save_opts_default(&o);
    o.keep = 0; /* no retention: measure the write itself (run.sh cleans up) */
    o.chunk_bytes = chunk_mb << 20;
    o.align_bytes = align_kb > 0 ? align_kb << 10 : -1;
    for (int r = 0; r < reps; r++) {
        m.step = r + 1;
        dg_ckpt_save_result_t res;
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        if (dg_ckpt_save(MPI_COMM_WORLD, dir, &m, t, nt, &o, &res)) {
            if (!g_rank) fprintf(stderr, "save failed: %s\n", dg_last_error());
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        double s = MPI_Wtime() - t0;
        /* the phases on the slowest rank; CPU time summed over ranks */
        const dg_ckpt_phases_t *ph = &res.phases;
        double mine[10] = {ph->validate, ph->hash,  ph->plan,   ph->create,    ph->write,
                           ph->close,    ph->fsync, ph->commit, ph->retention, ph->direct},
               mx[10], cpu = 0;
        MPI_Reduce(mine, mx, 10, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        double dbytes[2] = {(double)ph->direct_bytes, (double)ph->fill_skipped_bytes}, dall[2] = {0, 0};
        MPI_Reduce(dbytes, dall, 2, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
        MPI_Reduce(&ph->cpu, &cpu, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
        if (!g_rank) {
            printf("RESULT kind=save rep=%d seconds=%.3f bytes=%lld gbps=%.3f cpu_s=%.3f cpu_s_per_gb=%.3f\n",
                   r, s, (long long)res.bytes, state_bytes / s / 1e9, cpu, cpu / (state_bytes / 1e9));
            printf("RESULT kind=phases rep=%d validate=%.3f hash=%.3f threads=%d plan=%.3f create=%.3f "
                   "write=%.3f direct=%.3f direct_share=%.2f fill_skipped=%.2f close=%.3f fsync=%.3f "
                   "commit=%.3f "
                   "retention=%.3f\n",
                   r, mx[0], mx[1], ph->threads, mx[2], mx[3], mx[4], mx[9],
                   res.bytes > 0 ? dall[0] / (double)res.bytes : 0,
                   res.bytes > 0 ? dall[1] / (double)res.bytes : 0, mx[5], mx[6], mx[7], mx[8]);
        }
        fflush(stdout);
        if (save_only) continue;
        if (getenv("BENCH_DROP_CACHES") && !g_rank) { /* cold read: flush, then drop the page cache */
            sync();
            FILE *f = fopen("/proc/sys/vm/drop_caches", "w");
            if (f) fputs("1\n", f), fclose(f);
        }
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        dg_ckpt_meta_t got;
        if (dg_ckpt_load(MPI_COMM_WORLD, res.path, &got, t, nt)) {
            if (!g_rank) fprintf(stderr, "load failed: %s\n", dg_last_error());
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        s = MPI_Wtime() - t0;
        dg_ckpt_meta_destroy(&got);
        if (!g_rank) printf("RESULT kind=load rep=%d seconds=%.3f gbps=%.3f\n", r, s, state_bytes / s / 1e9);
        fflush(stdout);
    }
    if (save_only) reps = 0;
    /* async: the stall is the snapshot copy; the write then overlaps with "training" */
    dg_ckpt_writer_t *w = NULL;
    if (dg_ckpt_writer_create(MPI_COMM_WORLD, dir, &o, &w)) {
        if (!g_rank) fprintf(stderr, "writer: %s\n", dg_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    /* what a trainer does once after creating the writer: allocate and fault in the snapshot buffer */
    double t_res = MPI_Wtime();
    if (dg_ckpt_writer_reserve(w, (size_t)local * 4)) {
        fprintf(stderr, "writer reserve: %s\n", dg_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    t_res = MPI_Wtime() - t_res;
    for (int r = 0; r < reps; r++) {
        m.step = 100 + r;
        double stall = 0, t0 = MPI_Wtime();
        if (dg_ckpt_writer_submit(w, &m, t, nt, &stall, NULL)) MPI_Abort(MPI_COMM_WORLD, 1);
        dg_ckpt_async_result_t ar;
        if (dg_ckpt_writer_wait(w, &ar)) {
            if (!g_rank) fprintf(stderr, "async save failed: %s\n", dg_last_error());
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        double total = MPI_Wtime() - t0, in[3] = {stall, ar.res.snapshot_ms, t_res * 1e3}, mx[3];
        MPI_Allreduce(in, mx, 3, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        double snap_bytes = (double)local * 4, snap_all = 0;
        MPI_Allreduce(&snap_bytes, &snap_all, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
        if (!g_rank)
            printf(
                "RESULT kind=async rep=%d stall_ms=%.1f snapshot_ms=%.1f snapshot_gbps=%.2f reserve_ms=%.1f "
                "write_seconds=%.3f step_estimate_s=%.3f\n",
                r, mx[0], mx[1], mx[1] > 0 ? snap_all / (mx[1] * 1e-3) / 1e9 : 0, mx[2], total, step_s);
        fflush(stdout);
    }
    dg_ckpt_writer_free(w);
    dg_ckpt_meta_destroy(&m);
    for (int i = 0; i < nt; i++)
        free(t[i].data);
    free(t), free(paths), free(p);
    MPI_Finalize();
    return 0;
}
