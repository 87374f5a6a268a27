/* bench_comm.c — bus bandwidth of the comm layer's all-reduce, all-gather and reduce-scatter against the
 * raw library calls of the same sizes in the same run.
 *
 * --backend mpi (default): the mpi backend on host memory against MPI_Allreduce, MPI_Allgather and
 * MPI_Reduce_scatter_block on a duplicate of the same group. Three variants per size: raw MPI, the
 * blocking dg_comm call (which runs inline when nothing else is outstanding), and dg_comm_i* +
 * dg_comm_wait (through the communication thread, the overlapped path). The three are measured call by
 * call, interleaved in rotating order (so that the changing load of a shared machine hits all alike);
 * each variant's time is its median call on the slowest rank. Ratios are dg_comm busbw / raw busbw
 * (target >= 0.95); --check applies to the blocking variant.
 *
 * --backend nccl (builds with CUDA and NCCL only): one GPU per rank (local rank % device count; exit 77
 * when some rank has no GPU of its own), cudaMalloc'd buffers, the dg_comm nccl backend (on a stream of
 * its own) against a separate raw NCCL communicator (blocking config, its own stream). As nccl-tests
 * times it, one measurement is `iters` operations launched back to back and then completed once:
 *   raw NCCL   iters x ncclAllReduce/AllGather/ReduceScatter, then cudaStreamSynchronize;
 *   raw + ev   the same with a CUDA event recorded after each operation (a diagnostic: the part of the
 *              comm layer's cost that any per-operation completion tracking has);
 *   async      iters x dg_comm_i*, then dg_comm_wait on each in order;
 *   blocking   iters x the blocking dg_comm call (a host wait per operation).
 * Measurements of the four are interleaved in rotating order; each variant's time is its median (or
 * fastest) measurement / iters on the slowest rank. --check applies to the async variant, the path the
 * executor and dgvalidate use.
 *
 * Bandwidth as nccl-tests computes it: size S is the larger buffer (all-reduce: count x type; all-gather:
 * the gathered output; reduce-scatter: the full input), algbw = S / t, and
 *   all-reduce      busbw = algbw * 2(n-1)/n
 *   all-gather      busbw = algbw * (n-1)/n
 *   reduce-scatter  busbw = algbw * (n-1)/n
 * Each size's result is checked once (small integers: every algorithm's sum is exact).
 *
 * usage: bench_comm [--backend mpi|nccl] [--min BYTES] [--max BYTES] [--factor F] [--seconds S]
 *                   [--min-calls N] [--iters N] [--stat median|min] [--dtype f32|bf16]
 *                   [--progress thread|nonblocking] [--spin-us US] [--check RATIO]
 *   sizes: mpi 4 KiB .. 64 MiB, nccl 1 MiB .. 256 MiB, by x4; --iters: operations per nccl measurement
 *   (default 20); --min-calls: least calls (mpi) or measurements (nccl) per variant
 *   --check RATIO: exit 1 if any geometric-mean-per-op ratio is below RATIO (default: report only)
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../lib/bench_args.h"
#include "../lib/bench_mpi.h"
#include "comm.h"

#ifdef DG_HAVE_CUDA
#include <cuda_runtime.h>
#include <nccl.h>
#endif

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

/* One dg_comm call of `op`: the non-blocking form when req is given (the request lands there), else
 * the blocking form (which runs inline when nothing is outstanding). Both benches go through here. */
static dg_status_t dg_op(dg_comm_t *c, int op, const void *send, void *recv, size_t count, dg_dtype_t dt,
                         dg_comm_req_t **req) {
    switch (op) {
    case OP_ALLREDUCE:
        return req ? dg_comm_iallreduce(c, send, recv, count, dt, DG_RED_SUM, req)
                   : dg_comm_allreduce(c, send, recv, count, dt, DG_RED_SUM);
    case OP_ALLGATHER:
        return req ? dg_comm_iallgather(c, send, recv, count, dt, req)
                   : dg_comm_allgather(c, send, recv, count, dt);
    default:
        return req ? dg_comm_ireduce_scatter(c, send, recv, count, dt, DG_RED_SUM, req)
                   : dg_comm_reduce_scatter(c, send, recv, count, dt, DG_RED_SUM);
    }
}

/* async = 0: the blocking form; 1: the non-blocking form and a wait, which goes through the
 * communication thread (the path overlapped collectives take) */
static dg_status_t run_dg(bench_t *b, int op, size_t count, int async) {
    if (!async) return dg_op(b->c, op, b->send, b->recv, count, b->dt, NULL);
    dg_comm_req_t *r = NULL;
    DG_TRY(dg_op(b->c, op, b->send, b->recv, count, b->dt, &r));
    return dg_comm_wait(b->c, r);
}

/* One call of a variant: 0 = raw MPI, 1 = dg blocking, 2 = dg non-blocking; a failure ends the job. */
static void run_variant(bench_t *b, int variant, int op, size_t count) {
    if (variant && run_dg(b, op, count, variant == 2) != DG_OK)
        bench_die("dg_comm %s failed: %s\n", k_names[op], dg_last_error());
    if (!variant && run_raw(b, op, count) != MPI_SUCCESS) bench_die("MPI %s failed\n", k_names[op]);
}

/* slowest rank's time for `iters` calls of a variant (run_variant's numbering) */
static double timed(bench_t *b, int variant, int op, size_t count, int iters) {
    MPI_Barrier(b->raw);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; i++)
        run_variant(b, variant, op, count);
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
            run_variant(b, v, op, count);
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

static float elem(dg_dtype_t dt, const void *p, size_t i) {
    if (dt == DG_F32) return ((const float *)p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* elements of the send buffer for `count` per rank (allreduce: total) */
static size_t send_total(int op, size_t count, int n) {
    return op == OP_ALLREDUCE ? count : count * (size_t)n;
}

/* rank me's input: small integers, so every algorithm's sum is exact */
static void fill_input(void *send, dg_dtype_t dt, int op, size_t count, int n, int me) {
    size_t total = send_total(op, count, n);
    for (size_t i = 0; i < total; i++) {
        float v = (float)((me + i) % 5);
        if (dt == DG_F32)
            ((float *)send)[i] = v;
        else {
            uint32_t u;
            memcpy(&u, &v, 4);
            ((uint16_t *)send)[i] = (uint16_t)(u >> 16);
        }
    }
}

/* 1 when recv holds the exact result of `op` over fill_input's data */
static int output_ok(const void *recv, dg_dtype_t dt, int op, size_t count, int n, int me) {
    size_t outn = op == OP_ALLGATHER ? count * (size_t)n : count;
    for (size_t i = 0; i < outn; i++) {
        float want;
        if (op == OP_ALLGATHER)
            want = (float)((i / count + i % count) % 5);
        else {
            size_t gi = op == OP_REDUCE_SCATTER ? (size_t)me * count + i : i;
            want = 0;
            for (int r = 0; r < n; r++)
                want += (float)((r + gi) % 5);
        }
        if (elem(dt, recv, i) != want) return 0;
    }
    return 1;
}

/* the blocking dg_comm call's result, compared with the expectation */
static int check_result(bench_t *b, int op, size_t count) {
    fill_input(b->send, b->dt, op, count, b->n, b->me);
    memset(b->recv, 0xff, send_total(op, count, b->n) * b->esz);
    if (run_dg(b, op, count, 0) != DG_OK) return 0;
    return output_ok(b->recv, b->dt, op, count, b->n, b->me);
}

/* The ratios of the sizes measured so far, both benches: per op the sum of log(ratio) of the checked
 * variant (the one --check applies to) and of the other dg_comm variant and the sizes counted; the worst
 * single ratio of the checked variant; whether every result was right. */
typedef struct {
    double log_chk[NOPS], log_oth[NOPS], worst;
    int n[NOPS], all_ok;
} tally_t;

static void tally_add(tally_t *t, int op, double chk, double oth) {
    t->log_chk[op] += log(chk);
    t->log_oth[op] += log(oth);
    t->n[op]++;
    if (chk < t->worst) t->worst = chk;
}

/* Rank 0 of comm prints the summary line: the geometric means of the checked variant (named chk) and of
 * the other one (oth) over the raw library (lib; tag follows the rank count). Returns, on every rank, 1
 * when a checked mean is below `check` (> 0). */
static int tally_print(const tally_t *t, MPI_Comm comm, const char *tag, const char *lib, const char *chk,
                       const char *oth, double check) {
    int me = 0, n = 0, below = 0;
    MPI_Comm_rank(comm, &me);
    MPI_Comm_size(comm, &n);
    if (me == 0) {
        printf("# summary (%d ranks%s): geometric-mean busbw ratio over raw %s, %s dg_comm:", n, tag, lib,
               chk);
        for (int op = 0; op < NOPS; op++) {
            double g = t->n[op] ? exp(t->log_chk[op] / t->n[op]) : 0;
            printf(" %s %.3f", k_names[op], g);
            if (check > 0 && g < check) below = 1;
        }
        printf("; %s:", oth);
        for (int op = 0; op < NOPS; op++)
            printf(" %s %.3f", k_names[op], t->n[op] ? exp(t->log_oth[op] / t->n[op]) : 0);
        printf("; worst single size (%s) %.3f; results %s\n", chk, t->worst, t->all_ok ? "correct" : "WRONG");
    }
    MPI_Bcast(&below, 1, MPI_INT, 0, comm);
    return below;
}

typedef struct {
    size_t min_b, max_b;
    int min_set, max_set; /* given on the command line (else the backend's default range) */
    int factor, min_calls, use_min, iters;
    double budget, check, spin_us;
    dg_dtype_t dt;
    dg_comm_progress_t prog;
} args_t;

static int bench_mpi(const args_t *A);
#ifdef DG_HAVE_CUDA
static int bench_nccl(const args_t *A);
#endif

int main(int argc, char **argv) {
    int prov = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &prov);
    args_t A = {.min_b = 4096,
                .max_b = (size_t)64 << 20,
                .factor = 4,
                .min_calls = 9,
                .iters = 20,
                .budget = 0.6,
                .spin_us = -1,
                .dt = DG_F32,
                .prog = DG_COMM_PROGRESS_AUTO};
    int nccl = 0;
    const char *stat = NULL, *dtype = NULL, *progress = NULL;
    void *const dst[] = {&A.factor, &A.spin_us, &A.min_calls, &A.iters, &A.budget,
                         &A.check,  &stat,      &dtype,       &progress};
    const char *spec = "--factor=int --spin-us=real --min-calls=int --iters=int --seconds=real --check=real "
                       "--stat=str --dtype=str --progress=str";
    for (int i = 1; (i = bench_args(argc, argv, i, spec, dst)) < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "bench_comm: %s needs a value\n", a);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        if (!strcmp(a, "--min"))
            A.min_b = strtoull(v, NULL, 0), A.min_set = 1;
        else if (!strcmp(a, "--max"))
            A.max_b = strtoull(v, NULL, 0), A.max_set = 1;
        else if (!strcmp(a, "--backend") && (!strcmp(v, "mpi") || !strcmp(v, "nccl")))
            nccl = !strcmp(v, "nccl");
        else {
            if (!strcmp(a, "--backend"))
                fprintf(stderr, "bench_comm: --backend must be mpi or nccl, not '%s'\n", v);
            else
                fprintf(stderr, "bench_comm: unknown option %s\n", a);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
    }
    if (stat) A.use_min = strcmp(stat, "min") == 0;
    if (dtype) A.dt = !strcmp(dtype, "bf16") ? DG_BF16 : DG_F32;
    if (progress)
        A.prog = !strcmp(progress, "nonblocking") ? DG_COMM_PROGRESS_NONBLOCKING : DG_COMM_PROGRESS_THREAD;
    if (nccl) {
        if (!A.min_set) A.min_b = (size_t)1 << 20;
        if (!A.max_set) A.max_b = (size_t)256 << 20;
    }
    if (A.factor < 2 || A.min_calls < 1 || A.iters < 1 || !(A.budget > 0) || A.min_b < 4 ||
        A.max_b < A.min_b) {
        fprintf(stderr, "bench_comm: bad option values\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    int rc;
    if (nccl) {
#ifdef DG_HAVE_CUDA
        rc = bench_nccl(&A);
#else
        int me = 0;
        MPI_Comm_rank(MPI_COMM_WORLD, &me);
        if (me == 0)
            fprintf(stderr,
                    "bench_comm: --backend nccl needs a build with CUDA and NCCL (this one has neither; "
                    "configure with -DDGT_CUDA=ON on a machine with the CUDA toolkit and NCCL)\n");
        rc = 1;
#endif
    } else {
        rc = bench_mpi(&A);
    }
    MPI_Finalize();
    return rc;
}

/* ---------------------------------------------------------------------------------------------- */
/* --backend mpi                                                                                    */

static int bench_mpi(const args_t *A) {
    size_t min_b = A->min_b, max_b = A->max_b;
    int factor = A->factor, min_calls = A->min_calls, use_min = A->use_min;
    double budget = A->budget, check = A->check, spin_us = A->spin_us;
    dg_dtype_t dt = A->dt;
    dg_comm_progress_t prog = A->prog;
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
    tally_t tl = {.worst = 1e9, .all_ok = 1};
    for (int op = 0; op < NOPS; op++) {
        for (size_t bytes = min_b; bytes <= max_b; bytes *= (size_t)factor) {
            /* count per rank (allgather/reduce_scatter) or total (allreduce); size as nccl-tests */
            size_t count = op == OP_ALLREDUCE ? bytes / b.esz : bytes / b.esz / (size_t)b.n;
            if (!count) continue;
            size_t size = op == OP_ALLREDUCE ? count * b.esz : count * b.esz * (size_t)b.n;
            int ok = check_result(&b, op, count), okall = 0;
            MPI_Allreduce(&ok, &okall, 1, MPI_INT, MPI_MIN, b.raw);
            tl.all_ok &= okall;
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
            tally_add(&tl, op, ratio, ratio_a);
            if (b.me == 0)
                printf("  %-14s %10zu %10zu | %10.1f %8.3f %8.3f | %10.1f %8.3f %6.3f | %10.1f %8.3f %6.3f | "
                       "%s\n",
                       k_names[op], size, count, med[0] * 1e6, alg_r, alg_r * f, med[1] * 1e6,
                       size / med[1] / 1e9 * f, ratio, med[2] * 1e6, size / med[2] / 1e9 * f, ratio_a,
                       okall ? "ok" : "WRONG");
        }
    }
    int below = tally_print(&tl, b.raw, "", "MPI", "blocking", "non-blocking+wait", check);
    dg_comm_free(b.c);
    free(b.send);
    free(b.recv);
    MPI_Op_free(&b.raw_bf16);
    MPI_Comm_free(&b.raw);
    return (!tl.all_ok || below) ? 1 : 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* --backend nccl                                                                                   */

#ifdef DG_HAVE_CUDA

/* BN_CUDA(call), BN_NCCL(call): a CUDA runtime or NCCL call; a failure names the call and its line and
 * ends the job */
static void bn_cuda(cudaError_t e, const char *call, int line) {
    if (e != cudaSuccess)
        bench_die("bench_comm: %s:%d: CUDA call `%s` failed: %s\n", __FILE__, line, call,
                  cudaGetErrorString(e));
}
static void bn_nccl(ncclResult_t r, const char *call, int line) {
    if (r != ncclSuccess)
        bench_die("bench_comm: %s:%d: NCCL call `%s` failed: %s (NCCL_DEBUG=WARN says more)\n", __FILE__,
                  line, call, ncclGetErrorString(r));
}
#define BN_CUDA(call) bn_cuda((call), #call, __LINE__)
#define BN_NCCL(call) bn_nccl((call), #call, __LINE__)

enum { NV_RAW = 0, NV_ASYNC = 1, NV_BLOCKING = 2, NV_RAWEV = 3, NV_N = 4 };

typedef struct {
    dg_comm_t *c;    /* dg_comm's nccl backend, on a stream it owns */
    ncclComm_t raw;  /* a separate NCCL communicator: the reference */
    cudaStream_t rs; /* the raw communicator's stream */
    MPI_Comm mpi;    /* timing and agreement */
    int n, me, iters;
    dg_dtype_t dt;
    size_t esz;
    void *send, *recv;    /* device */
    dg_comm_req_t **reqs; /* iters requests of the async variant */
    cudaEvent_t *evs;     /* iters events of the raw + event variant */
} nbench_t;

static void bn_fail(const char *what, int op) {
    bench_die("bench_comm: dg_comm %s (%s) failed: %s\n", k_names[op], what, dg_last_error());
}

static void bn_raw(nbench_t *b, int op, size_t count) {
    ncclDataType_t T = b->dt == DG_F32 ? ncclFloat32 : ncclBfloat16;
    switch (op) {
    case OP_ALLREDUCE:
        BN_NCCL(ncclAllReduce(b->send, b->recv, count, T, ncclSum, b->raw, b->rs));
        break;
    case OP_ALLGATHER:
        BN_NCCL(ncclAllGather(b->send, b->recv, count, T, b->raw, b->rs));
        break;
    default:
        BN_NCCL(ncclReduceScatter(b->send, b->recv, count, T, ncclSum, b->raw, b->rs));
        break;
    }
}

static dg_status_t bn_post(nbench_t *b, int op, size_t count, dg_comm_req_t **r) {
    return dg_op(b->c, op, b->send, b->recv, count, b->dt, r);
}

static dg_status_t bn_blocking(nbench_t *b, int op, size_t count) {
    return dg_op(b->c, op, b->send, b->recv, count, b->dt, NULL);
}

/* This rank's seconds for one measurement of variant v: b->iters operations, completed once. */
static double bn_measure(nbench_t *b, int v, int op, size_t count) {
    MPI_Barrier(b->mpi);
    double t0 = MPI_Wtime();
    if (v == NV_RAW) {
        for (int i = 0; i < b->iters; i++)
            bn_raw(b, op, count);
        BN_CUDA(cudaStreamSynchronize(b->rs));
    } else if (v == NV_RAWEV) {
        /* raw NCCL plus what any comm layer that tracks completion per operation adds on the stream:
         * one event recorded after each (torch.distributed's work objects do the same) */
        for (int i = 0; i < b->iters; i++) {
            bn_raw(b, op, count);
            BN_CUDA(cudaEventRecord(b->evs[i], b->rs));
        }
        BN_CUDA(cudaStreamSynchronize(b->rs));
    } else if (v == NV_ASYNC) {
        for (int i = 0; i < b->iters; i++)
            if (bn_post(b, op, count, &b->reqs[i]) != DG_OK) bn_fail("post", op);
        for (int i = 0; i < b->iters; i++)
            if (dg_comm_wait(b->c, b->reqs[i]) != DG_OK) bn_fail("wait", op);
    } else {
        for (int i = 0; i < b->iters; i++)
            if (bn_blocking(b, op, count) != DG_OK) bn_fail("blocking", op);
    }
    return MPI_Wtime() - t0;
}

/* Measurements of the four variants interleaved in rotating order; out[v] = the median (or fastest)
 * measurement / iters, on the slowest rank. */
static void bn_rounds(nbench_t *b, int op, size_t count, int rounds, int use_min, double out[NV_N]) {
    double *d[NV_N];
    for (int v = 0; v < NV_N; v++)
        d[v] = malloc((size_t)rounds * sizeof(double));
    for (int i = 0; i < rounds; i++)
        for (int k = 0; k < NV_N; k++) {
            int v = (k + i) % NV_N;
            d[v][i] = bn_measure(b, v, op, count) / b->iters;
        }
    double local[NV_N];
    for (int v = 0; v < NV_N; v++) {
        qsort(d[v], (size_t)rounds, sizeof(double), cmp_double);
        local[v] = use_min ? d[v][0] : d[v][rounds / 2];
        free(d[v]);
    }
    MPI_Allreduce(local, out, NV_N, MPI_DOUBLE, MPI_MAX, b->mpi);
}

/* One async dg_comm call on fill_input's data, copied back and compared with the expectation. */
static int bn_check(nbench_t *b, int op, size_t count, void *h_send, void *h_recv) {
    size_t in_n = send_total(op, count, b->n), out_n = op == OP_ALLGATHER ? count * (size_t)b->n : count;
    fill_input(h_send, b->dt, op, count, b->n, b->me);
    BN_CUDA(cudaMemcpy(b->send, h_send, in_n * b->esz, cudaMemcpyHostToDevice));
    BN_CUDA(cudaMemset(b->recv, 0xff, out_n * b->esz)); /* poison: an op that writes nothing fails */
    dg_comm_req_t *r = NULL;
    if (bn_post(b, op, count, &r) != DG_OK || dg_comm_wait(b->c, r) != DG_OK) bn_fail("check", op);
    BN_CUDA(cudaMemcpy(h_recv, b->recv, out_n * b->esz, cudaMemcpyDeviceToHost));
    return output_ok(h_recv, b->dt, op, count, b->n, b->me);
}

static int bench_nccl(const args_t *A) {
    nbench_t b = {0};
    b.dt = A->dt;
    b.esz = dg_dtype_size(A->dt);
    b.iters = A->iters;
    MPI_Comm_dup(MPI_COMM_WORLD, &b.mpi);
    MPI_Comm_size(b.mpi, &b.n);
    MPI_Comm_rank(b.mpi, &b.me);
    dg_log_init(b.me, "", DG_LOG_WARN, NULL);

    /* one GPU per rank: local rank % device count, and every rank of a node needs its own */
    MPI_Comm node;
    MPI_Comm_split_type(b.mpi, MPI_COMM_TYPE_SHARED, b.me, MPI_INFO_NULL, &node);
    int lrank = 0, lsize = 1, ndev = 0;
    MPI_Comm_rank(node, &lrank);
    MPI_Comm_size(node, &lsize);
    MPI_Comm_free(&node);
    cudaError_t ce = cudaGetDeviceCount(&ndev);
    if (ce != cudaSuccess) ndev = 0;
    int have = ndev >= 1 && ndev >= lsize, all_have = 0;
    MPI_Allreduce(&have, &all_have, 1, MPI_INT, MPI_MIN, b.mpi);
    if (!all_have) {
        if (!have)
            printf("SKIP: bench_comm --backend nccl needs one GPU per rank: rank %d sees %d (%s) for %d "
                   "ranks on "
                   "its node\n",
                   b.me, ndev, ce == cudaSuccess ? "ok" : cudaGetErrorString(ce), lsize);
        fflush(stdout);
        MPI_Comm_free(&b.mpi);
        return 77;
    }
    int dev = lrank % ndev;
    BN_CUDA(cudaSetDevice(dev));

    dg_comm_opts_t o;
    dg_comm_opts_default(&o);
    o.name = "bench";
    o.timeout_s = 300;
    if (A->spin_us >= 0) o.spin_us = A->spin_us;
    if (dg_comm_create_nccl(b.mpi, dev, NULL, &o, &b.c) != DG_OK) {
        fprintf(stderr, "bench_comm: %s\n", dg_last_error());
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    if (b.me == 0) BN_NCCL(ncclGetUniqueId(&id));
    MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, b.mpi);
    BN_CUDA(cudaStreamCreateWithFlags(&b.rs, cudaStreamNonBlocking));
    BN_NCCL(ncclCommInitRank(&b.raw, b.n, id, b.me));

    size_t maxbuf = A->max_b + (size_t)b.n * b.esz;
    BN_CUDA(cudaMalloc(&b.send, maxbuf));
    BN_CUDA(cudaMalloc(&b.recv, maxbuf));
    BN_CUDA(cudaMemset(b.send, 0, maxbuf));
    BN_CUDA(cudaMemset(b.recv, 0, maxbuf));
    void *h_send = malloc(maxbuf), *h_recv = malloc(maxbuf);
    b.reqs = malloc((size_t)b.iters * sizeof *b.reqs);
    b.evs = malloc((size_t)b.iters * sizeof *b.evs);
    if (!h_send || !h_recv || !b.reqs || !b.evs) {
        fprintf(stderr, "bench_comm: out of host memory for %zu-byte buffers\n", maxbuf);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    for (int i = 0; i < b.iters; i++)
        BN_CUDA(cudaEventCreateWithFlags(&b.evs[i], cudaEventDisableTiming));
    int nv = 0;
    ncclGetVersion(&nv);
    if (b.me == 0) {
        printf(
            "# bench_comm --backend nccl: %d ranks, dtype %s, NCCL %d, %d ops per measurement, about %.2f s "
            "per size, >= %d measurements per variant (%s)\n",
            b.n, dg_dtype_name(b.dt), nv, b.iters, A->budget, A->min_calls,
            A->use_min ? "fastest" : "median");
        printf(
            "# busbw in GB/s; 'raw' = ncclX x iters + cudaStreamSynchronize on a separate communicator; "
            "'raw+ev' = the same with a CUDA event recorded after each op (what per-op completion tracking "
            "costs); 'async' = dg_comm_i* x iters, then wait each; 'block' = blocking dg_comm calls; ratios "
            "are busbw over raw NCCL's\n");
        printf("# %-14s %10s %10s | %9s %8s %8s | %9s %6s | %9s %8s %6s | %9s %8s %6s | %s\n", "op",
               "size(B)", "count", "raw us", "algbw", "busbw", "raw+ev us", "ratio", "async us", "busbw",
               "ratio", "block us", "busbw", "ratio", "check");
    }
    tally_t tl = {.worst = 1e9, .all_ok = 1};
    for (int op = 0; op < NOPS; op++) {
        for (size_t bytes = A->min_b; bytes <= A->max_b; bytes *= (size_t)A->factor) {
            size_t count = op == OP_ALLREDUCE ? bytes / b.esz : bytes / b.esz / (size_t)b.n;
            if (!count) continue;
            size_t size = op == OP_ALLREDUCE ? count * b.esz : count * b.esz * (size_t)b.n;
            int ok = bn_check(&b, op, count, h_send, h_recv), okall = 0;
            MPI_Allreduce(&ok, &okall, 1, MPI_INT, MPI_MIN, b.mpi);
            tl.all_ok &= okall;
            /* warm up every variant, then size the rounds to about `budget` seconds */
            for (int v = 0; v < NV_N; v++)
                bn_measure(&b, v, op, count);
            double t1 = bn_measure(&b, NV_RAW, op, count), t1max = 0;
            MPI_Allreduce(&t1, &t1max, 1, MPI_DOUBLE, MPI_MAX, b.mpi);
            int rounds = (int)(A->budget / (NV_N * (t1max > 1e-6 ? t1max : 1e-6)));
            if (rounds < A->min_calls) rounds = A->min_calls;
            if (rounds > 1000) rounds = 1000;
            double t[NV_N];
            bn_rounds(&b, op, count, rounds, A->use_min, t);
            double f = op == OP_ALLREDUCE ? 2.0 * (b.n - 1) / b.n : (double)(b.n - 1) / b.n;
            double alg_r = size / t[NV_RAW] / 1e9;
            double ra = t[NV_RAW] / t[NV_ASYNC], rb = t[NV_RAW] / t[NV_BLOCKING]; /* busbw_dg / busbw_raw */
            tally_add(&tl, op, ra, rb);
            if (b.me == 0)
                printf("  %-14s %10zu %10zu | %9.1f %8.3f %8.3f | %9.1f %6.3f | %9.1f %8.3f %6.3f | %9.1f "
                       "%8.3f %6.3f | "
                       "%s\n",
                       k_names[op], size, count, t[NV_RAW] * 1e6, alg_r, alg_r * f, t[NV_RAWEV] * 1e6,
                       t[NV_RAW] / t[NV_RAWEV], t[NV_ASYNC] * 1e6, size / t[NV_ASYNC] / 1e9 * f, ra,
                       t[NV_BLOCKING] * 1e6, size / t[NV_BLOCKING] / 1e9 * f, rb, okall ? "ok" : "WRONG");
            fflush(stdout);
        }
    }
    int below = tally_print(&tl, b.mpi, ", nccl", "NCCL", "async", "blocking", A->check);
    dg_comm_free(b.c);
    for (int i = 0; i < b.iters; i++)
        BN_CUDA(cudaEventDestroy(b.evs[i]));
    free(b.evs);
    BN_NCCL(ncclCommDestroy(b.raw));
    BN_CUDA(cudaStreamDestroy(b.rs));
    BN_CUDA(cudaFree(b.send));
    BN_CUDA(cudaFree(b.recv));
    free(h_send);
    free(h_recv);
    free(b.reqs);
    MPI_Comm_free(&b.mpi);
    return (!tl.all_ok || below) ? 1 : 0;
}
#endif /* DG_HAVE_CUDA */
