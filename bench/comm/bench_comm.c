/* bench_comm.c — bus bandwidth of the comm layer's all-reduce, all-gather and reduce-scatter (mpi
 * backend) against raw MPI calls of the same sizes in the same run: MPI_Allreduce, MPI_Allgather and
 * MPI_Reduce_scatter_block on a duplicate of the same group.
 *
 * Bandwidth as nccl-tests computes it: size S is the larger buffer (all-reduce: count x type; all-gather:
 * the gathered output; reduce-scatter: the full input), algbw = S / t, and
 *   all-reduce      busbw = algbw * 2(n-1)/n
 *   all-gather      busbw = algbw * (n-1)/n
 *   reduce-scatter  busbw = algbw * (n-1)/n
 * Three variants per size: raw MPI, the blocking dg_comm call (which runs inline when nothing else is
 * outstanding), and dg_comm_i* + dg_comm_wait (through the communication thread, the overlapped path).
 * The three are measured call by call, interleaved in rotating order (so that the changing load of a
 * shared machine hits all alike); each variant's time is its median call on the slowest rank.
 * Ratios are dg_comm busbw / raw busbw (target >= 0.95). Each size's result is checked once.
 *
 * usage: bench_comm [--min BYTES] [--max BYTES] [--factor F] [--seconds S] [--min-calls N]
 *                   [--stat median|min] [--dtype f32|bf16] [--progress thread|nonblocking] [--spin-us US]
 *                   [--check RATIO]
 *   --check RATIO: exit 1 if any geometric-mean-per-op ratio is below RATIO (default: report only)
 */
#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"

enum { OP_ALLREDUCE = 0, OP_ALLGATHER = 1, OP_REDUCE_SCATTER = 2, NOPS = 3 };
static const char *k_names[NOPS] = {"allreduce", "allgather", "reduce_scatter"};

typedef struct {
    dg_comm_t *c;
    MPI_Comm raw;
    MPI_Op raw_bf16;
    int n, me;
    dg_dtype_t dt;
    size_t esz;
    void *send, *recv;
} bench_t;

static void bf16_sum(void *in, void *inout, int *len, MPI_Datatype *t) {
    (void)t;
    uint16_t *a = in, *b = inout;
    for (int i = 0; i < *len; i++) {
        uint32_t ua = (uint32_t)a[i] << 16, ub = (uint32_t)b[i] << 16;
        float fa, fb;
        memcpy(&fa, &ua, 4);
        memcpy(&fb, &ub, 4);
        float s = fa + fb;
        uint32_t u;
        memcpy(&u, &s, 4);
        u += 0x7fffu + ((u >> 16) & 1u);
        b[i] = (uint16_t)(u >> 16);
    }
}

/* one call of `op` with `count` elements per rank (allreduce: total) */
static int run_raw(bench_t *b, int op, size_t count) {
    MPI_Datatype T = b->dt == DG_F32 ? MPI_FLOAT : MPI_UINT16_T;
    MPI_Op O = b->dt == DG_F32 ? MPI_SUM : b->raw_bf16;
    int n = (int)count;
    switch (op) {
    case OP_ALLREDUCE:
        return MPI_Allreduce(b->send, b->recv, n, T, O, b->raw);
    case OP_ALLGATHER:
        return MPI_Allgather(b->send, n, T, b->recv, n, T, b->raw);
    default:
        return MPI_Reduce_scatter_block(b->send, b->recv, n, T, O, b->raw);
    }
}

/* async = 0: the blocking form (runs inline when nothing is outstanding); 1: the non-blocking form and
 * a wait, which goes through the communication thread (the path overlapped collectives take) */
static dg_status_t run_dg(bench_t *b, int op, size_t count, int async) {
    if (!async) {
        switch (op) {
        case OP_ALLREDUCE:
            return dg_comm_allreduce(b->c, b->send, b->recv, count, b->dt, DG_RED_SUM);
        case OP_ALLGATHER:
            return dg_comm_allgather(b->c, b->send, b->recv, count, b->dt);
        default:
            return dg_comm_reduce_scatter(b->c, b->send, b->recv, count, b->dt, DG_RED_SUM);
        }
    }
    dg_comm_req_t *r = NULL;
    dg_status_t s;
    switch (op) {
    case OP_ALLREDUCE:
        s = dg_comm_iallreduce(b->c, b->send, b->recv, count, b->dt, DG_RED_SUM, &r);
        break;
    case OP_ALLGATHER:
        s = dg_comm_iallgather(b->c, b->send, b->recv, count, b->dt, &r);
        break;
    default:
        s = dg_comm_ireduce_scatter(b->c, b->send, b->recv, count, b->dt, DG_RED_SUM, &r);
        break;
    }
    if (s != DG_OK) return s;
    return dg_comm_wait(b->c, r);
}

/* slowest rank's time for `iters` calls; variant 0 = raw MPI, 1 = dg blocking, 2 = dg non-blocking */
static double timed(bench_t *b, int variant, int op, size_t count, int iters) {
    MPI_Barrier(b->raw);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; i++) {
        if (variant) {
            if (run_dg(b, op, count, variant == 2) != DG_OK) {
                fprintf(stderr, "dg_comm %s failed: %s\n", k_names[op], dg_last_error());
                MPI_Abort(MPI_COMM_WORLD, 2);
            }
        } else if (run_raw(b, op, count) != MPI_SUCCESS) {
            fprintf(stderr, "MPI %s failed\n", k_names[op]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
    double t = MPI_Wtime() - t0, tmax = 0;
    MPI_Allreduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, b->raw);
    return tmax;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Per-call durations of the three variants, interleaved call by call in rotating order, so that
 * changes in the load of a shared machine hit all three alike. Each variant's time is its median (or
 * fastest) call, taken on the slowest rank. */
static void paired(bench_t *b, int op, size_t count, int ncalls, int use_min, double out[3]) {
    double *d[3];
    for (int v = 0; v < 3; v++)
        d[v] = malloc((size_t)ncalls * sizeof(double));
    MPI_Barrier(b->raw);
    for (int i = 0; i < ncalls; i++)
        for (int k = 0; k < 3; k++) {
            int v = (k + i) % 3;
            double t0 = MPI_Wtime();
            if (v) {
                if (run_dg(b, op, count, v == 2) != DG_OK) {
                    fprintf(stderr, "dg_comm %s failed: %s\n", k_names[op], dg_last_error());
                    MPI_Abort(MPI_COMM_WORLD, 2);
                }
            } else if (run_raw(b, op, count) != MPI_SUCCESS) {
                fprintf(stderr, "MPI %s failed\n", k_names[op]);
                MPI_Abort(MPI_COMM_WORLD, 2);
            }
            d[v][i] = MPI_Wtime() - t0;
        }
    double local[3];
    for (int v = 0; v < 3; v++) {
        qsort(d[v], (size_t)ncalls, sizeof(double), cmp_double);
        local[v] = use_min ? d[v][0] : d[v][ncalls / 2];
        free(d[v]);
    }
    MPI_Allreduce(local, out, 3, MPI_DOUBLE, MPI_MAX, b->raw);
}

static float elem(bench_t *b, const void *p, size_t i) {
    if (b->dt == DG_F32) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* inputs are small integers, so every algorithm's sum is exact: compare dg_comm with the expectation */
static int check_result(bench_t *b, int op, size_t count) {
    size_t total = op == OP_ALLREDUCE ? count : count * (size_t)b->n;
    for (size_t i = 0; i < total; i++) {
        float v = (float)((b->me + i) % 5);
        if (b->dt == DG_F32)
            ((float *)b->send)[i] = v;
        else {
            uint32_t u;
            memcpy(&u, &v, 4);
            ((uint16_t *)b->send)[i] = (uint16_t)(u >> 16);
        }
    }
    memset(b->recv, 0xff, total * b->esz);
    if (run_dg(b, op, count, 0) != DG_OK) return 0;
    size_t outn = op == OP_REDUCE_SCATTER ? count : total;
    for (size_t i = 0; i < outn; i++) {
        float want;
        if (op == OP_ALLGATHER)
            want = (float)((i / count + i % count) % 5);
        else {
            size_t gi = op == OP_REDUCE_SCATTER ? (size_t)b->me * count + i : i;
            want = 0;
            for (int r = 0; r < b->n; r++)
                want += (float)((r + gi) % 5);
        }
        if (elem(b, b->recv, i) != want) return 0;
    }
    return 1;
}

int main(int argc, char **argv) {
    int prov = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &prov);
    size_t min_b = 4096, max_b = (size_t)64 << 20;
    int factor = 4, min_calls = 9, use_min = 0;
    double budget = 0.6, check = 0, spin_us = -1;
    dg_dtype_t dt = DG_F32;
    dg_comm_progress_t prog = DG_COMM_PROGRESS_AUTO;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "bench_comm: %s needs a value\n", a);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        if (!strcmp(a, "--min"))
            min_b = strtoull(v, NULL, 0);
        else if (!strcmp(a, "--max"))
            max_b = strtoull(v, NULL, 0);
        else if (!strcmp(a, "--factor"))
            factor = atoi(v);
        else if (!strcmp(a, "--spin-us"))
            spin_us = atof(v);
        else if (!strcmp(a, "--min-calls"))
            min_calls = atoi(v);
        else if (!strcmp(a, "--seconds"))
            budget = atof(v);
        else if (!strcmp(a, "--check"))
            check = atof(v);
        else if (!strcmp(a, "--stat"))
            use_min = strcmp(v, "min") == 0;
        else if (!strcmp(a, "--dtype"))
            dt = !strcmp(v, "bf16") ? DG_BF16 : DG_F32;
        else if (!strcmp(a, "--progress"))
            prog = !strcmp(v, "nonblocking") ? DG_COMM_PROGRESS_NONBLOCKING : DG_COMM_PROGRESS_THREAD;
        else {
            fprintf(stderr, "bench_comm: unknown option %s\n", a);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        i++;
    }
    if (factor < 2 || min_calls < 1 || !(budget > 0) || min_b < 4 || max_b < min_b) {
        fprintf(stderr, "bench_comm: bad option values\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    bench_t b = {0};
    b.dt = dt;
    b.esz = dg_dtype_size(dt);
    MPI_Comm_dup(MPI_COMM_WORLD, &b.raw);
    MPI_Comm_size(b.raw, &b.n);
    MPI_Comm_rank(b.raw, &b.me);
    MPI_Op_create(bf16_sum, 1, &b.raw_bf16);
    dg_log_init(b.me, "", DG_LOG_WARN, NULL);
    dg_comm_opts_t o;
    dg_comm_opts_default(&o);
    o.name = "bench";
    o.timeout_s = 300;
    o.progress = prog;
    if (spin_us >= 0) o.spin_us = spin_us;
    if (dg_comm_create_mpi(MPI_COMM_WORLD, &o, &b.c) != DG_OK) {
        fprintf(stderr, "bench_comm: %s\n", dg_last_error());
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    size_t maxbuf = max_b + (size_t)b.n * b.esz;
    b.send = malloc(maxbuf);
    b.recv = malloc(maxbuf);
    memset(b.send, 0, maxbuf);
    memset(b.recv, 0, maxbuf);
    char st[256];
    dg_comm_state(b.c, st, sizeof st);
    if (b.me == 0) {
        printf("# bench_comm: %d ranks, dtype %s, about %.2f s per size, >= %d calls per variant (%s call); "
               "comm "
               "%s\n",
               b.n, dg_dtype_name(dt), budget, min_calls, use_min ? "fastest" : "median", st);
        printf(
            "# busbw in GB/s; 'dg' = blocking dg_comm call, 'async' = dg_comm_i* + dg_comm_wait (through the "
            "communication thread); ratios are busbw over raw MPI's\n");
        printf("# %-14s %10s %10s | %10s %8s %8s | %10s %8s %6s | %10s %8s %6s | %s\n", "op", "size(B)",
               "count", "raw us", "algbw", "busbw", "dg us", "busbw", "ratio", "async us", "busbw", "ratio",
               "check");
    }
    double logsum[NOPS] = {0}, logsum_a[NOPS] = {0};
    int nsz[NOPS] = {0};
    double minratio = 1e9;
    int all_ok = 1;
    for (int op = 0; op < NOPS; op++) {
        for (size_t bytes = min_b; bytes <= max_b; bytes *= (size_t)factor) {
            /* count per rank (allgather/reduce_scatter) or total (allreduce); size as nccl-tests */
            size_t count = op == OP_ALLREDUCE ? bytes / b.esz : bytes / b.esz / (size_t)b.n;
            if (!count) continue;
            size_t size = op == OP_ALLREDUCE ? count * b.esz : count * b.esz * (size_t)b.n;
            int ok = check_result(&b, op, count), okall = 0;
            MPI_Allreduce(&ok, &okall, 1, MPI_INT, MPI_MIN, b.raw);
            all_ok &= okall;
            /* warm up, then size the measurement to about `budget` seconds for the three variants */
            for (int v = 0; v < 3; v++)
                timed(&b, v, op, count, 2);
            double t1 = timed(&b, 0, op, count, 3) / 3;
            int ncalls = (int)(budget / (3 * (t1 > 1e-7 ? t1 : 1e-7)));
            if (ncalls < min_calls) ncalls = min_calls;
            if (ncalls > 4000) ncalls = 4000;
            double med[3];
            paired(&b, op, count, ncalls, use_min, med);
            double f = op == OP_ALLREDUCE ? 2.0 * (b.n - 1) / b.n : (double)(b.n - 1) / b.n;
            double alg_r = size / med[0] / 1e9;
            double ratio = med[0] / med[1], ratio_a = med[0] / med[2]; /* busbw_dg / busbw_raw */
            logsum[op] += log(ratio);
            logsum_a[op] += log(ratio_a);
            nsz[op]++;
            if (ratio < minratio) minratio = ratio;
            if (b.me == 0)
                printf("  %-14s %10zu %10zu | %10.1f %8.3f %8.3f | %10.1f %8.3f %6.3f | %10.1f %8.3f %6.3f | "
                       "%s\n",
                       k_names[op], size, count, med[0] * 1e6, alg_r, alg_r * f, med[1] * 1e6,
                       size / med[1] / 1e9 * f, ratio, med[2] * 1e6, size / med[2] / 1e9 * f, ratio_a,
                       okall ? "ok" : "WRONG");
        }
    }
    int below = 0;
    if (b.me == 0) {
        printf("# summary (%d ranks): geometric-mean busbw ratio over raw MPI, blocking dg_comm:", b.n);
        for (int op = 0; op < NOPS; op++) {
            double g = nsz[op] ? exp(logsum[op] / nsz[op]) : 0;
            printf(" %s %.3f", k_names[op], g);
            if (check > 0 && g < check) below = 1;
        }
        printf("; non-blocking+wait:");
        for (int op = 0; op < NOPS; op++)
            printf(" %s %.3f", k_names[op], nsz[op] ? exp(logsum_a[op] / nsz[op]) : 0);
        printf("; worst single size (blocking) %.3f; results %s\n", minratio, all_ok ? "correct" : "WRONG");
    }
    MPI_Bcast(&below, 1, MPI_INT, 0, b.raw);
    dg_comm_free(b.c);
    free(b.send);
    free(b.recv);
    MPI_Op_free(&b.raw_bf16);
    MPI_Comm_free(&b.raw);
    MPI_Finalize();
    return (!all_ok || below) ? 1 : 0;
}
