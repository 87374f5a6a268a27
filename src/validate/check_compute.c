/* check_compute.c — compute throughput and memory bandwidth, and stragglers:
 *   compute.cpu_gemm    fp32 GEMM through OpenBLAS (cblas_sgemm) with the rank's bound cores; the node's
 *                       figure is the sum over its ranks running together of each rank's median rate
 *   compute.cpu_stream  STREAM triad a = b + s*c (OpenMP over the bound cores), 24 bytes per element
 *   compute.gpu_gemm    bf16 GEMM through cuBLASLt per GPU (DG_HAVE_CUDA and a GPU at run time)
 *   compute.gpu_stream  triad in device memory per GPU
 *   *.stragglers        a rank below validate.straggler_fraction of the median of its node type is
 *                       named. CPU figures for this come from each rank measured alone (the ranks of a
 *                       node take turns, the others sleep), so a slow core or a badly bound rank shows
 *                       up instead of drowning in contention; GPUs are measured all at once (each its own
 *                       device), which is also how training loads them.
 * A rank's own figure is the best of validate.*_reps timed repetitions (after one warm-up): the best is
 * what the hardware can do, interference only ever makes a repetition slower. Node and GPU figures
 * compared with references use the median repetition, which is what a job gets.
 *
 * Test hook (tests only): DG_TEST_VALIDATE_SLOW_RANK=R makes world rank R slow in these checks: each of its
 * timed repetitions counts DG_TEST_VALIDATE_SLOW_FACTOR (default 10) times as long as it took, like a core
 * running at a tenth of its clock, and the rank busy-waits for the difference (at most SLOW_WAIT_MAX_S
 * per repetition) so that it really is late. The recorded figure is injected rather than waited for, so
 * a test can use a factor (10^6) far beyond anything a loaded machine does to a healthy rank.
 */
#define _GNU_SOURCE
#include <cblas.h>
#include <hwloc.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "validate_impl.h"
#include "dg_env.h"

enum { K_CPU_GEMM, K_CPU_STREAM, K_GPU_GEMM, K_GPU_STREAM, N_KINDS };
static const char *const k_names[N_KINDS] = {"compute.cpu_gemm", "compute.cpu_stream", "compute.gpu_gemm",
                                             "compute.gpu_stream"};
static const dg_dim_t k_dims[N_KINDS] = {DG_DIM_FLOPS, DG_DIM_BANDWIDTH, DG_DIM_FLOPS, DG_DIM_BANDWIDTH};

#define MAX_REPS 256

/* ---------------------------------------------------------------- the slow-rank hook */

static double slow_factor(const vctx_t *c) {
    if (dg_env_int("DG_TEST_VALIDATE_SLOW_RANK") != c->rank) return 1;
    double x = dg_env_double("DG_TEST_VALIDATE_SLOW_FACTOR");
    return x > 1 ? x : 10;
}

#define SLOW_WAIT_MAX_S 0.02

static void busy_wait(double seconds) {
    if (seconds > SLOW_WAIT_MAX_S) seconds = SLOW_WAIT_MAX_S;
    double end = dg_now_s() + seconds;
    volatile double sink = 0;
    while (dg_now_s() < end)
        for (int i = 0; i < 1000; i++)
            sink += i * 1e-9;
}

/* ---------------------------------------------------------------- CPU kernels */

static int bound_threads(const vctx_t *c) {
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    int n = 0;
    if (hwloc_bitmap_list_sscanf(set, c->b->bound_cpuset) == 0) n = hwloc_bitmap_weight(set);
    hwloc_bitmap_free(set);
    if (n <= 0) n = c->b->topo.n_pus / (c->b->local_size > 0 ? c->b->local_size : 1);
    return n > 0 ? n : 1;
}

/* A and B hold small integers so that every element of C is an exact fp32 integer (|c| <= 2n < 2^24):
 * a sampled check compares exactly. */
static dg_status_t cpu_gemm(const vctx_t *c, int reps, double *times, double *work, long long *wrong) {
    int n = c->set->cpu_gemm_n, th = bound_threads(c);
    size_t nn = (size_t)n * n;
    float *A = malloc(nn * sizeof(float)), *B = malloc(nn * sizeof(float)), *C = malloc(nn * sizeof(float));
    if (!A || !B || !C) {
        free(A), free(B), free(C);
        return DG_ERR(DG_ERR_RUNTIME,
                      "compute.cpu_gemm: cannot allocate 3 x %d x %d floats (validate.cpu_gemm_n)", n, n);
    }
    for (int i = 0; i < n; i++)
        for (int k = 0; k < n; k++) {
            A[(size_t)i * n + k] = (float)((i + 2 * k) % 5 - 2);
            B[(size_t)i * n + k] = (float)((3 * i + k) % 3 - 1);
        }
    openblas_set_num_threads(th);
    for (int r = -1; r < reps; r++) {
        double t0 = dg_now_s();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, A, n, B, n, 0.0f, C, n);
        if (r >= 0) times[r] = dg_now_s() - t0;
    }
    *work = 2.0 * n * (double)n * n;
    long long bad = 0;
    for (int s = 0; s < 64; s++) {
        int i = (int)((s * 7919u) % (unsigned)n), j = (int)((s * 104729u + 17) % (unsigned)n);
        double ref = 0;
        for (int k = 0; k < n; k++)
            ref += (double)A[(size_t)i * n + k] * B[(size_t)k * n + j];
        bad += C[(size_t)i * n + j] != (float)ref;
    }
    *wrong = bad;
    openblas_set_num_threads(1);
    free(A), free(B), free(C);
    return DG_OK;
}

static dg_status_t cpu_stream(const vctx_t *c, int reps, double *times, double *work, long long *wrong) {
    size_t n = (size_t)(c->set->cpu_stream_mb * 1e6 / (3 * sizeof(double)));
    if (n < 1024) n = 1024;
    int th = bound_threads(c);
    double *a = malloc(n * sizeof(double)), *b = malloc(n * sizeof(double)), *cc = malloc(n * sizeof(double));
    if (!a || !b || !cc) {
        free(a), free(b), free(cc);
        return DG_ERR(DG_ERR_RUNTIME, "compute.cpu_stream: cannot allocate %.0f MB (validate.cpu_stream_mb)",
                      c->set->cpu_stream_mb);
    }
    /* first touch by the threads that will use the pages (NUMA placement as in STREAM) */
#pragma omp parallel for num_threads(th) schedule(static)
    for (size_t i = 0; i < n; i++) {
        a[i] = 0;
        b[i] = (double)(i % 1000);
        cc[i] = (double)(i % 7);
    }
    const double s = 3.0;
    for (int r = -1; r < reps; r++) {
        double t0 = dg_now_s();
#pragma omp parallel for num_threads(th) schedule(static)
        for (size_t i = 0; i < n; i++)
            a[i] = b[i] + s * cc[i];
        if (r >= 0) times[r] = dg_now_s() - t0;
    }
    *work = 3.0 * sizeof(double) * (double)n;
    long long bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += a[i] != (double)(i % 1000) + s * (double)(i % 7);
    *wrong = bad;
    free(a), free(b), free(cc);
    return DG_OK;
}

/* ---------------------------------------------------------------- GPU */

/* This rank's CUDA device, or -1 with the reason. */
static int my_gpu(const vctx_t *c, char *why, size_t cap) {
#ifdef DG_HAVE_CUDA
    if (c->b->gpu < 0) {
        snprintf(why, cap, "no GPU in this node's topology");
        return -1;
    }
    char err[256];
    if (dg_vgpu_count(err, sizeof err) <= 0) {
        snprintf(why, cap, "%.150s", err);
        return -1;
    }
    const dg_gpu_info_t *g = &c->b->topo.gpus[c->b->gpu];
    int dev = dg_vgpu_device(g->pci_busid, g->cuda_index);
    if (dev < 0) snprintf(why, cap, "CUDA cannot open GPU %s", g->pci_busid);
    return dev;
#else
    (void)c;
    snprintf(why, cap, "built without CUDA");
    return -1;
#endif
}

static dg_status_t run_kind(const vctx_t *c, int kind, int dev, int reps, double *times, double *work,
                            long long *wrong) {
    switch (kind) {
    case K_CPU_GEMM:
        return cpu_gemm(c, reps, times, work, wrong);
    case K_CPU_STREAM:
        return cpu_stream(c, reps, times, work, wrong);
#ifdef DG_HAVE_CUDA
    case K_GPU_GEMM: {
        int64_t w = 0;
        dg_status_t s = dg_vgpu_gemm_bf16(dev, c->set->gpu_gemm_n, reps, times, work, &w);
        *wrong = w;
        return s;
    }
    case K_GPU_STREAM: {
        int64_t w = 0;
        dg_status_t s = dg_vgpu_stream(dev, (size_t)(c->set->gpu_stream_mb * 1e6), reps, times, work, &w);
        *wrong = w;
        return s;
    }
#endif
    default:
        (void)dev;
        return DG_ERR(DG_ERR_RUNTIME, "%s is not available in this build",
                      kind >= 0 && kind < N_KINDS ? k_names[kind] : "this check");
    }
}

static int reps_of(const vctx_t *c, int kind) {
    int r = kind == K_CPU_GEMM     ? c->set->cpu_gemm_reps
            : kind == K_CPU_STREAM ? c->set->cpu_stream_reps
            : kind == K_GPU_GEMM   ? c->set->gpu_gemm_reps
                                   : c->set->gpu_stream_reps;
    return r > MAX_REPS ? MAX_REPS : r;
}

/* One measurement: the kernel's reps, with the slow-rank hook applied inside each timed repetition. */
typedef struct {
    double best_rate;   /* work / fastest rep */
    double median_rate; /* work / median rep */
    long long wrong;
} meas_t;

static dg_status_t measure(const vctx_t *c, int kind, int dev, meas_t *m) {
    int reps = reps_of(c, kind);
    double times[MAX_REPS], work = 0;
    long long wrong = 0;
    memset(m, 0, sizeof *m);
    DG_TRY(run_kind(c, kind, dev, reps, times, &work, &wrong));
    double f = slow_factor(c), best = INFINITY;
    for (int r = 0; r < reps; r++) {
        if (f > 1) {
            busy_wait((f - 1) * times[r]);
            times[r] *= f;
        }
        if (times[r] < best) best = times[r];
    }
    double med = vc_median(times, reps);
    m->best_rate = best > 0 ? work / best : 0;
    m->median_rate = med > 0 ? work / med : 0;
    m->wrong = wrong;
    return DG_OK;
}

/* The ranks of each node take turns (in local-rank order); the others sleep in a receive. A rank that
 * does not take part (no GPU) only passes the turn on. The wait allows every earlier rank of the node
 * its share of the timeout. */
static dg_status_t measure_alone(vctx_t *c, int kind, int dev, int run, meas_t *m, dg_status_t *local) {
    dg_boot_t *b = c->b;
    int token = 0;
    memset(m, 0, sizeof *m);
    *local = DG_OK;
    if (b->local_rank > 0) {
        MPI_Request req;
        DG_MPI_CHECK(MPI_Irecv(&token, 1, MPI_INT, b->local_rank - 1, 7401, b->node, &req));
        double t = c->timeout_s;
        c->timeout_s = t * b->local_rank;
        dg_status_t s = vc_quiet_wait(c, &req, k_names[kind]);
        c->timeout_s = t;
        DG_TRY(s);
    }
    if (run) *local = measure(c, kind, dev, m);
    if (b->local_rank + 1 < b->local_size)
        DG_MPI_CHECK(MPI_Send(&token, 1, MPI_INT, b->local_rank + 1, 7401, b->node));
    return DG_OK;
}

/* 1 on every rank of a node when two of its ranks chose the same GPU. */
static dg_status_t gpu_shared_on_node(vctx_t *c, int *shared) {
    dg_boot_t *b = c->b;
    char bus[32] = "";
    if (b->gpu >= 0) snprintf(bus, sizeof bus, "%s", b->topo.gpus[b->gpu].pci_busid);
    char *all = dg_xmalloc((size_t)b->local_size * sizeof bus);
    int mpi_rc = MPI_Allgather(bus, sizeof bus, MPI_CHAR, all, sizeof bus, MPI_CHAR, b->node);
    int mine = 0;
    for (int q = 0; q < b->local_size && mpi_rc == MPI_SUCCESS; q++)
        if (q != b->local_rank && bus[0] && strcmp(all + (size_t)q * sizeof bus, bus) == 0) mine = 1;
    free(all);
    if (mpi_rc != MPI_SUCCESS) return DG_ERR(DG_ERR_RUNTIME, "compute: all-gather of the GPU choices failed");
    DG_MPI_CHECK(MPI_Allreduce(&mine, shared, 1, MPI_INT, MPI_MAX, b->node));
    return DG_OK;
}

/* ---------------------------------------------------------------- judging */

typedef struct {
    int has;         /* took part (a GPU for the GPU kinds) */
    int expected;    /* its node type expects GPUs (GPU kinds) */
    double alone;    /* best rate measured alone (CPU) or with the others (GPU) */
    double together; /* median rate while all ranks of the node run (CPU) */
    long long wrong;
    char why[160]; /* why it did not take part */
} rec_t;

static void judge_throughput(vctx_t *c, int kind, const rec_t *all, double seconds) {
    dg_vcheck_t *k = vc_add(c, k_names[kind]);
    if (!k) return;
    dg_boot_t *b = c->b;
    int gpu = kind >= K_GPU_GEMM;
    const char *metric = k_names[kind];
    vbuf_t why = {0}, det = {0};
    k->seconds = seconds;
    /* entities: nodes (CPU, all its ranks together) or ranks (GPU, each its device) */
    int nent = gpu ? c->size : b->n_nodes;
    double worst = INFINITY;
    int worst_e = -1, n_ref = 0, nbad = 0;
    const dg_sla_ref_t *shown = NULL;
    long long wrong = 0;
    int *wrong_ranks = dg_xmalloc((size_t)c->size * sizeof(int)), nwr = 0;
    for (int r = 0; r < c->size; r++)
        if (all[r].has && all[r].wrong) wrong_ranks[nwr++] = r, wrong += all[r].wrong;
    vbuf_printf(&det, "{\"%s\": [", gpu ? "gpus" : "nodes");
    int first = 1;
    for (int e = 0; e < nent; e++) {
        double v;
        int rank_of_e;
        if (gpu) {
            if (!all[e].has) continue;
            v = all[e].together;
            rank_of_e = e;
        } else {
            v = 0;
            for (int r = 0; r < c->size; r++)
                if (b->node_ids[r] == e) v += all[r].together;
            rank_of_e = c->leader_of_node[e];
        }
        vbuf_printf(&det, "%s{\"%s\": %d, \"host\": ", first ? "" : ", ", gpu ? "rank" : "node", e);
        first = 0;
        vbuf_json_str(&det, b->hosts[rank_of_e]);
        vbuf_printf(&det, ", \"value\": %.6g}", v);
        if (v < worst) worst = v, worst_e = e;
        const dg_sla_ref_t *ref = dg_sla_ref(c->sla, c->type_of_rank[rank_of_e], metric);
        if (!ref) continue;
        n_ref++;
        if (!shown) shown = ref;
        if (!dg_sla_ref_ok(ref, v)) {
            if (nbad++ < 4) {
                char vs[32], lim[200];
                vc_fmt_value(vs, sizeof vs, v, k_dims[kind]);
                dg_sla_ref_format(ref, lim, sizeof lim);
                if (gpu)
                    vbuf_printf(&why, "%srank %d (%s) GPU: %s, want %s", why.n ? "; " : "", e, b->hosts[e],
                                vs, lim);
                else
                    vbuf_printf(&why, "%snode %d (%s, ranks from %d): %s, want %s", why.n ? "; " : "", e,
                                b->hosts[rank_of_e], rank_of_e, vs, lim);
            }
        }
    }
    vbuf_printf(&det, "]}");
    if (nbad > 4) vbuf_printf(&why, " and %d more", nbad - 4);
    vc_why_wrong(c, &why, wrong, "wrong result elements on", wrong_ranks, nwr);
    char vs[32];
    vc_fmt_value(vs, sizeof vs, worst, k_dims[kind]);
    if (gpu)
        snprintf(k->measured, sizeof k->measured, "%s (slowest GPU: rank %d, %s)%s", vs, worst_e,
                 b->hosts[worst_e], wrong ? ", wrong results" : "");
    else
        snprintf(k->measured, sizeof k->measured, "%s per node (slowest: node %d, %s)%s", vs, worst_e,
                 b->hosts[c->leader_of_node[worst_e]], wrong ? ", wrong results" : "");
    k->has_value = 1;
    k->value = worst;
    snprintf(k->unit, sizeof k->unit, "%s", k_dims[kind] == DG_DIM_FLOPS ? "FLOP/s" : "B/s");
    if (shown) dg_sla_ref_format(shown, k->reference, sizeof k->reference);
    if (why.n) {
        k->verdict = DG_VERDICT_FAIL;
        snprintf(k->message, sizeof k->message, "%s", why.s);
    } else if (!n_ref) {
        snprintf(k->message, sizeof k->message, "no reference ref.%s in the SLA: measured only", metric);
    }
    dg_vcheck_set_details(k, det.s);
    vbuf_free(&why);
    vbuf_free(&det);
    free(wrong_ranks);
}

static void judge_stragglers(vctx_t *c, int kind, const rec_t *all, double seconds) {
    char name[96];
    snprintf(name, sizeof name, "%s.stragglers", k_names[kind]);
    dg_vcheck_t *k = vc_add(c, name);
    if (!k) return;
    k->seconds = seconds;
    double frac = c->set->straggler_fraction;
    int ntypes = dg_sla_n_types(c->sla);
    double *med = dg_xmalloc((size_t)ntypes * sizeof(double)),
           *v = dg_xmalloc((size_t)c->size * sizeof(double));
    for (int t = 0; t < ntypes; t++) {
        int n = 0;
        for (int r = 0; r < c->size; r++)
            if (all[r].has && c->type_of_rank[r] == t) v[n++] = all[r].alone;
        med[t] = n ? vc_median(v, n) : NAN;
    }
    int *slow = dg_xmalloc((size_t)c->size * sizeof(int)), nslow = 0;
    double worst_ratio = INFINITY;
    int worst_r = -1;
    vbuf_t det = {0}, why = {0};
    vbuf_printf(&det, "{\"fraction\": %.6g, \"measured_alone\": %s, \"ranks\": [", frac,
                kind < K_GPU_GEMM ? "true" : "false");
    int first = 1;
    for (int r = 0; r < c->size; r++) {
        if (!all[r].has) continue;
        double m = med[c->type_of_rank[r]], ratio = m > 0 ? all[r].alone / m : NAN;
        vbuf_printf(&det, "%s{\"rank\": %d, \"host\": ", first ? "" : ", ", r);
        first = 0;
        vbuf_json_str(&det, c->b->hosts[r]);
        vbuf_printf(&det, ", \"value\": %.6g, \"of_median\": ", all[r].alone);
        vbuf_json_num(&det, ratio);
        vbuf_printf(&det, "}");
        if (ratio < worst_ratio) worst_ratio = ratio, worst_r = r;
        if (ratio < frac) slow[nslow++] = r;
    }
    vbuf_printf(&det, "]}");
    char vs[32], ms[32];
    if (worst_r >= 0) {
        vc_fmt_value(vs, sizeof vs, all[worst_r].alone, k_dims[kind]);
        snprintf(k->measured, sizeof k->measured, "slowest rank %d (%s): %.2g of median (%s)", worst_r,
                 c->b->hosts[worst_r], worst_ratio, vs);
        k->has_value = 1;
        k->value = worst_ratio;
    }
    snprintf(k->reference, sizeof k->reference, ">= %.3g of its node type's median", frac);
    if (nslow) {
        for (int i = 0; i < nslow && i < 8; i++) {
            int r = slow[i];
            vc_fmt_value(vs, sizeof vs, all[r].alone, k_dims[kind]);
            vc_fmt_value(ms, sizeof ms, med[c->type_of_rank[r]], k_dims[kind]);
            vbuf_printf(&why, "%srank %d (%s) at %s = %.2g of the median %s", why.n ? "; " : "", r,
                        c->b->hosts[r], vs, all[r].alone / med[c->type_of_rank[r]], ms);
        }
        if (nslow > 8) vbuf_printf(&why, " and %d more ranks", nslow - 8);
        vbuf_printf(&why, " (straggler_fraction %.3g)", frac);
        k->verdict = DG_VERDICT_FAIL;
        snprintf(k->message, sizeof k->message, "straggler%s: %s", nslow == 1 ? "" : "s", why.s);
    }
    dg_vcheck_set_details(k, det.s);
    vbuf_free(&det);
    vbuf_free(&why);
    free(med);
    free(v);
    free(slow);
}

/* ---------------------------------------------------------------- driver */

static int expects_gpus(const vctx_t *c, int rank) {
    const dg_sla_node_t *e = dg_sla_node(c->sla, c->type_of_rank[rank]);
    return !e->gpus.any && e->gpus.n > 0;
}

static dg_status_t run_one(vctx_t *c, int kind) {
    char sname[96];
    snprintf(sname, sizeof sname, "%s.stragglers", k_names[kind]);
    /* "compute.cpu_gemm.stragglers" alone selects the straggler check, not the throughput one */
    int want_tp = vc_selected_leaf(c, k_names[kind]);
    int want_st = vc_selected_leaf(c, sname);
    if (!want_tp && !want_st) return DG_OK;
    double t0 = dg_now_s();
    int gpu = kind >= K_GPU_GEMM;
    rec_t rec;
    memset(&rec, 0, sizeof rec);
    int dev = -1;
    if (gpu) {
        dev = my_gpu(c, rec.why, sizeof rec.why);
        rec.has = dev >= 0;
        rec.expected = expects_gpus(c, c->rank);
    } else {
        rec.has = 1;
    }
    int any = 0;
    DG_MPI_CHECK(MPI_Allreduce(&rec.has, &any, 1, MPI_INT, MPI_MAX, c->b->world));
    dg_status_t local = DG_OK;
    if (any) {
        meas_t alone = {0}, together = {0};
        if (!gpu) {
            DG_TRY(measure_alone(c, kind, dev, 1, &alone, &local));
            DG_TRY(vc_quiet_barrier(c, c->b->node, k_names[kind]));
            if (c->b->local_size > 1 && local == DG_OK)
                local = measure(c, kind, dev, &together);
            else
                together = alone;
        } else {
            /* each GPU on its own, all at once; ranks that share a GPU take turns instead, or each would
             * measure a fraction of it */
            int shared = 0;
            DG_TRY(gpu_shared_on_node(c, &shared));
            if (shared)
                DG_TRY(measure_alone(c, kind, dev, rec.has, &together, &local));
            else if (rec.has)
                local = measure(c, kind, dev, &together);
            alone = together;
        }
        rec.alone = alone.best_rate;
        rec.together = together.median_rate;
        rec.wrong = alone.wrong + together.wrong;
    }
    DG_TRY(vc_quiet_barrier(c, c->b->world, k_names[kind]));
    char msg[2048];
    dg_status_t ag = vc_agree(c, local, msg, sizeof msg);
    rec_t *all = c->rank == 0 ? dg_xmalloc((size_t)c->size * sizeof *all) : NULL;
    DG_MPI_CHECK(MPI_Gather(&rec, (int)sizeof rec, MPI_BYTE, all, (int)sizeof rec, MPI_BYTE, 0, c->b->world));
    if (c->rank == 0) {
        double dt = dg_now_s() - t0;
        if (ag != DG_OK) {
            if (want_tp) {
                dg_vcheck_t *k = vc_add(c, k_names[kind]);
                k->verdict = DG_VERDICT_ERROR;
                snprintf(k->message, sizeof k->message, "%s", msg);
                k->seconds = dt;
            }
            if (want_st) {
                dg_vcheck_t *k = vc_add(c, sname);
                k->verdict = DG_VERDICT_ERROR;
                snprintf(k->message, sizeof k->message, "%s", msg);
            }
        } else if (!any) {
            /* nobody could run it: a note, unless the SLA says these nodes have GPUs */
            int *exp = dg_xmalloc((size_t)c->size * sizeof(int)), ne = 0;
            for (int r = 0; r < c->size; r++)
                if (all[r].expected) exp[ne++] = r;
            for (int w = 0; w < 2; w++) {
                if (!(w ? want_st : want_tp)) continue;
                if (ne) {
                    char who[1024];
                    vc_fmt_ranks(c, exp, ne, who, sizeof who);
                    dg_vcheck_t *k = vc_add(c, w ? sname : k_names[kind]);
                    k->verdict = DG_VERDICT_FAIL;
                    snprintf(k->message, sizeof k->message,
                             "the SLA expects GPUs on %s, but no GPU could be used: %s", who,
                             all[exp[0]].why);
                } else {
                    vc_skip(c, w ? sname : k_names[kind], "no GPU to measure (%s)", all[0].why);
                }
            }
            free(exp);
        } else {
            /* ranks whose node type expects a GPU they could not use */
            int *miss = dg_xmalloc((size_t)c->size * sizeof(int)), nm = 0;
            for (int r = 0; r < c->size; r++)
                if (gpu && !all[r].has && all[r].expected) miss[nm++] = r;
            if (want_tp) judge_throughput(c, kind, all, dt);
            if (want_tp && nm) {
                dg_vcheck_t *k = &c->rep->checks[c->rep->n - 1];
                char who[1024];
                vc_fmt_ranks(c, miss, nm, who, sizeof who);
                size_t o = strlen(k->message);
                snprintf(k->message + o, sizeof k->message - o, "%sno usable GPU on %s (%s)", o ? "; " : "",
                         who, all[miss[0]].why);
                k->verdict = DG_VERDICT_FAIL;
            }
            if (want_st) judge_stragglers(c, kind, all, dt);
            free(miss);
        }
    }
    free(all);
    return DG_OK;
}

dg_status_t vc_check_compute(vctx_t *c) {
    for (int kind = 0; kind < N_KINDS; kind++) {
        DG_TRY(run_one(c, kind));
        vc_write_reports(c);
    }
    return DG_OK;
}
