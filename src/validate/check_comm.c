/* check_comm.c — collectives through the comm layer (comm.h), in the manner of nccl-tests: for each
 * backend (mpi; nccl when built and every rank has its own GPU), group (intra = the ranks of one node,
 * all nodes at once; inter = one rank per node; world) and operation (allreduce, allgather,
 * reduce_scatter, broadcast, sendrecv), a sweep over message sizes reporting nccl-tests' algbw and
 * busbw, plus a data check that counts wrong elements (which must be 0).
 *
 * Sizes are nccl-tests' "size": the bytes of the full buffer (allreduce/broadcast/sendrecv: the
 * buffer; allgather: the gathered result; reduce_scatter: the input). Timing pipelines as nccl-tests
 * does: after one blocking, verified call, comm_warmup and then comm_iters iterations are each posted
 * back to back with the non-blocking calls (sendrecv: an irecv and an isend per iteration), and only
 * then waited for, in posting order, plus a flush; so the nccl backend keeps its stream busy instead of
 * paying a host round trip per call, and the mpi backend's communication thread runs its FIFO without
 * gaps. (nccl holds posted sends and receives back and enqueues them as one NCCL group at the first
 * wait: the timed sendrecv loop is one group.) time = the mean over the group of each rank's time for the
 * timed loop divided by comm_iters; algbw = size / time; busbw = algbw * factor with factor 2(n-1)/n
 * (allreduce), (n-1)/n (allgather, reduce_scatter), 1 (broadcast, sendrecv). The reference of a check applies
 * to busbw at the largest size.
 *
 * Data: rank r's input element i is ((i + 3r) mod 11) + 1, small integers whose sums are exact in fp32
 * for any realistic rank count, and whose sum over ranks has a closed form (period 11 in r), so the
 * expected result costs O(1) per element at any world size.
 *
 * A failing collective (a timeout, a dead peer) leaves the comm unusable and peers possibly stuck in
 * it: the job ends through dg_comm_abort (exit 3) with the comm layer's message naming the group and
 * the ranks that did not arrive.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "validate_impl.h"

enum { OP_ALLREDUCE, OP_ALLGATHER, OP_REDUCE_SCATTER, OP_BROADCAST, OP_SENDRECV, N_OPS };
static const char *const k_ops[N_OPS] = {"allreduce", "allgather", "reduce_scatter", "broadcast", "sendrecv"};
enum { G_INTRA, G_INTER, G_WORLD, N_GROUPS };
static const char *const k_groups[N_GROUPS] = {"intra", "inter", "world"};

#define MAX_SIZES 32

double dg_validate_bus_factor(const char *op, int n) {
    if (n < 1) return -1;
    if (strcmp(op, "allreduce") == 0) return 2.0 * (n - 1) / n;
    if (strcmp(op, "allgather") == 0 || strcmp(op, "reduce_scatter") == 0) return (double)(n - 1) / n;
    if (strcmp(op, "broadcast") == 0 || strcmp(op, "sendrecv") == 0) return 1.0;
    return -1;
}

/* ---------------------------------------------------------------- data pattern */

static inline float pat(int r, size_t i) {
    return (float)((i + 3 * (size_t)r) % 11 + 1);
}

/* sum over r = 0..n-1 of pat(r, i): 66 per full period of 11 ranks plus the partial period */
typedef struct {
    int n;
    double full;
    float partial[11]; /* by i % 11 */
} sum_table_t;

static void sum_table(sum_table_t *t, int n) {
    t->n = n;
    t->full = 66.0 * (n / 11);
    int m = n % 11;
    for (int i = 0; i < 11; i++) {
        double s = t->full;
        for (int r = 0; r < m; r++)
            s += (double)pat(r, (size_t)i);
        t->partial[i] = (float)s;
    }
}

/* ---------------------------------------------------------------- one group, one op, one size */

typedef struct {
    dg_comm_t *comm;
    MPI_Comm mpi; /* the same group, for the timing reduction */
    int rank, size;
    int nccl;
    void *dsend, *drecv; /* device buffers (nccl) */
    float *send, *recv;  /* host buffers */
    size_t cap_elems;
} group_t;

typedef struct {
    double bytes, time, algbw, busbw;
    long long wrong; /* this rank's wrong elements */
} point_t;

/* element counts for a size; 0 when the size is too small for the group (reduce_scatter/allgather
 * need at least one element per rank) */
static size_t op_count(int op, double size_bytes, int n) {
    size_t elems = (size_t)(size_bytes / sizeof(float));
    if (op == OP_ALLGATHER || op == OP_REDUCE_SCATTER) return elems / (size_t)n;
    return elems;
}

static dg_status_t run_op(group_t *g, int op, size_t cnt) {
    dg_comm_t *c = g->comm;
    void *s = g->nccl ? g->dsend : (void *)g->send, *r = g->nccl ? g->drecv : (void *)g->recv;
    switch (op) {
    case OP_ALLREDUCE:
        return dg_comm_allreduce(c, s, r, cnt, DG_F32, DG_RED_SUM);
    case OP_ALLGATHER:
        return dg_comm_allgather(c, s, r, cnt, DG_F32);
    case OP_REDUCE_SCATTER:
        return dg_comm_reduce_scatter(c, s, r, cnt, DG_F32, DG_RED_SUM);
    case OP_BROADCAST:
        /* broadcast is in place: the root's buffer is its input, the others' their output; the root
         * re-broadcasts the same data every iteration, so it stays valid */
        return dg_comm_broadcast(c, g->rank == 0 ? s : r, cnt, DG_F32, 0);
    case OP_SENDRECV:
        break; /* two requests: run_sendrecv */
    }
    return DG_ERR(DG_ERR_RUNTIME, "unknown op %d", op);
}

/* sendrecv as a pair of non-blocking operations completed together */
static dg_status_t run_sendrecv(group_t *g, size_t cnt) {
    dg_comm_t *c = g->comm;
    void *s = g->nccl ? g->dsend : (void *)g->send, *r = g->nccl ? g->drecv : (void *)g->recv;
    int next = (g->rank + 1) % g->size, prev = (g->rank - 1 + g->size) % g->size;
    dg_comm_req_t *rq = NULL, *sq = NULL;
    DG_TRY(dg_comm_irecv(c, r, cnt, DG_F32, prev, 11, &rq));
    dg_status_t st = dg_comm_isend(c, s, cnt, DG_F32, next, 11, &sq);
    if (st != DG_OK) {
        (void)dg_comm_wait(c, rq);
        return st;
    }
    st = dg_comm_wait(c, sq);
    dg_status_t st2 = dg_comm_wait(c, rq);
    return st ? st : st2;
}

static dg_status_t do_op(group_t *g, int op, size_t cnt) {
    return op == OP_SENDRECV ? run_sendrecv(g, cnt) : run_op(g, op, cnt);
}

/* Posts one iteration with the non-blocking calls and appends its requests to reqs[*nreq..]: one, or
 * two for sendrecv (irecv, then isend). *nreq counts every request posted, also on failure. */
static dg_status_t post_op(group_t *g, int op, size_t cnt, dg_comm_req_t **reqs, int *nreq) {
    dg_comm_t *c = g->comm;
    void *s = g->nccl ? g->dsend : (void *)g->send, *r = g->nccl ? g->drecv : (void *)g->recv;
    dg_status_t st;
    switch (op) {
    case OP_ALLREDUCE:
        st = dg_comm_iallreduce(c, s, r, cnt, DG_F32, DG_RED_SUM, &reqs[*nreq]);
        break;
    case OP_ALLGATHER:
        st = dg_comm_iallgather(c, s, r, cnt, DG_F32, &reqs[*nreq]);
        break;
    case OP_REDUCE_SCATTER:
        st = dg_comm_ireduce_scatter(c, s, r, cnt, DG_F32, DG_RED_SUM, &reqs[*nreq]);
        break;
    case OP_BROADCAST:
        st = dg_comm_ibroadcast(c, g->rank == 0 ? s : r, cnt, DG_F32, 0, &reqs[*nreq]);
        break;
    case OP_SENDRECV: {
        int next = (g->rank + 1) % g->size, prev = (g->rank - 1 + g->size) % g->size;
        DG_TRY(dg_comm_irecv(c, r, cnt, DG_F32, prev, 11, &reqs[*nreq]));
        (*nreq)++;
        st = dg_comm_isend(c, s, cnt, DG_F32, next, 11, &reqs[*nreq]);
        break;
    }
    default:
        return DG_ERR(DG_ERR_RUNTIME, "unknown op %d", op);
    }
    if (st == DG_OK) (*nreq)++;
    return st;
}

/* nccl-tests' loop: `iters` iterations posted back to back, then waited for in posting order and
 * flushed. reqs has room for 2 * iters requests. */
static dg_status_t run_pipelined(group_t *g, int op, size_t cnt, int iters, dg_comm_req_t **reqs) {
    int nreq = 0;
    dg_status_t s = DG_OK;
    for (int i = 0; i < iters && s == DG_OK; i++)
        s = post_op(g, op, cnt, reqs, &nreq);
    /* after a failed post, still complete what was posted (its buffers are in use) */
    for (int i = 0; i < nreq; i++) {
        dg_status_t w = dg_comm_wait(g->comm, reqs[i]);
        if (w != DG_OK) return w; /* the comm failed: the caller ends the job */
    }
    if (s == DG_OK) s = dg_comm_flush(g->comm);
    return s;
}

static long long verify(group_t *g, int op, size_t cnt, const sum_table_t *st) {
    const float *r = g->recv;
    int n = g->size, me = g->rank;
    long long wrong = 0;
    switch (op) {
    case OP_ALLREDUCE:
        for (size_t i = 0; i < cnt; i++)
            wrong += r[i] != st->partial[i % 11];
        break;
    case OP_ALLGATHER:
        for (int s = 0; s < n; s++)
            for (size_t j = 0; j < cnt; j++)
                wrong += r[(size_t)s * cnt + j] != pat(s, j);
        break;
    case OP_REDUCE_SCATTER:
        for (size_t j = 0; j < cnt; j++)
            wrong += r[j] != st->partial[((size_t)me * cnt + j) % 11];
        break;
    case OP_BROADCAST:
        if (me == 0) break; /* the root's buffer is its input */
        for (size_t i = 0; i < cnt; i++)
            wrong += r[i] != pat(0, i);
        break;
    case OP_SENDRECV: {
        int prev = (me - 1 + n) % n;
        for (size_t i = 0; i < cnt; i++)
            wrong += r[i] != pat(prev, i);
        break;
    }
    }
    return wrong;
}

static size_t recv_elems(int op, size_t cnt, int n) {
    return op == OP_ALLGATHER ? cnt * (size_t)n : cnt;
}

static size_t send_elems(int op, size_t cnt, int n) {
    return op == OP_REDUCE_SCATTER ? cnt * (size_t)n : cnt;
}

static dg_status_t sync_to_device(group_t *g, size_t send_n, size_t recv_n) {
#ifdef DG_HAVE_CUDA
    if (g->nccl) {
        DG_TRY(dg_vgpu_copy(g->dsend, g->send, send_n * sizeof(float), 1));
        DG_TRY(dg_vgpu_copy(g->drecv, g->recv, recv_n * sizeof(float), 1));
    }
#else
    (void)g;
    (void)send_n;
    (void)recv_n;
#endif
    return DG_OK;
}

static dg_status_t sync_from_device(group_t *g, size_t recv_n) {
#ifdef DG_HAVE_CUDA
    if (g->nccl) DG_TRY(dg_vgpu_copy(g->recv, g->drecv, recv_n * sizeof(float), 0));
#else
    (void)g;
    (void)recv_n;
#endif
    return DG_OK;
}

/* A comm-layer failure leaves peers inside a collective: end the job (exit 3) with its message. */
static void comm_fatal(group_t *g, const char *check, dg_status_t s) {
    fprintf(stderr, "dgvalidate: %s failed: %s; aborting the job (exit 3)\n", check, dg_last_error());
    fflush(stderr);
    DG_LOG_ERROR("%s failed (status %d): %s", check, s, dg_last_error());
    dg_comm_abort(g->comm, DG_ERR_PEER);
}

static void measure_point(vctx_t *c, group_t *g, int op, double size, const sum_table_t *st,
                          const char *check, point_t *pt) {
    const dg_sla_settings_t *set = c->set;
    int n = g->size;
    size_t cnt = op_count(op, size, n);
    memset(pt, 0, sizeof *pt);
    if (cnt == 0) {
        pt->bytes = 0;
        return;
    }
    size_t sn = send_elems(op, cnt, n), rn = recv_elems(op, cnt, n);
    pt->bytes = (double)(op == OP_ALLGATHER ? rn : sn) * sizeof(float);
    for (size_t i = 0; i < sn; i++)
        g->send[i] = pat(g->rank, i);
    /* poison the output: a collective that writes nothing must not pass the data check */
    memset(g->recv, 0xff, rn * sizeof(float));
    if (op == OP_BROADCAST && g->rank == 0) memcpy(g->recv, g->send, cnt * sizeof(float));
    dg_status_t s = sync_to_device(g, sn, rn);
    if (s == DG_OK) s = do_op(g, op, cnt);
    if (s == DG_OK) s = dg_comm_flush(g->comm);
    if (s == DG_OK) s = sync_from_device(g, rn);
    if (s != DG_OK) comm_fatal(g, check, s);
    pt->wrong = verify(g, op, cnt, st);

    int most = set->comm_iters > set->comm_warmup ? set->comm_iters : set->comm_warmup;
    dg_comm_req_t **reqs = dg_xmalloc(2 * (size_t)(most > 0 ? most : 1) * sizeof *reqs);
    if (set->comm_warmup > 0) s = run_pipelined(g, op, cnt, set->comm_warmup, reqs);
    if (s == DG_OK) s = dg_comm_barrier(g->comm);
    if (s != DG_OK) comm_fatal(g, check, s);
    double t0 = dg_now_s();
    s = run_pipelined(g, op, cnt, set->comm_iters, reqs);
    double dt = (dg_now_s() - t0) / set->comm_iters;
    free(reqs);
    if (s != DG_OK) comm_fatal(g, check, s);
    double sum = 0;
    if (MPI_Allreduce(&dt, &sum, 1, MPI_DOUBLE, MPI_SUM, g->mpi) != MPI_SUCCESS) {
        fprintf(stderr, "dgvalidate: %s: timing all-reduce failed; aborting the job (exit 3)\n", check);
        dg_comm_abort(g->comm, DG_ERR_PEER);
    }
    pt->time = sum / n;
    pt->algbw = pt->time > 0 ? pt->bytes / pt->time : 0;
    pt->busbw = pt->algbw * dg_validate_bus_factor(k_ops[op], n);
}

/* ---------------------------------------------------------------- gathering and judging */

typedef struct {
    int member, root; /* in the group / group rank 0 */
    int group_id;     /* node id for intra, else 0 */
    int gsize, npts;
    point_t pts[MAX_SIZES]; /* root: the group's numbers (wrong = this rank's) */
    long long wrong;        /* this rank's wrong elements over the sweep */
    long long group_wrong;  /* root: the group's total */
} rec_t;

static void judge(vctx_t *c, const char *name, int op, int grp, const rec_t *all, double seconds,
                  const char *backend) {
    dg_vcheck_t *k = vc_add(c, name);
    if (!k) return;
    k->seconds = seconds;
    int nroots = 0, root0 = -1;
    long long wrong = 0;
    int *bad_ranks = dg_xmalloc((size_t)c->size * sizeof(int)), nbad_ranks = 0;
    for (int r = 0; r < c->size; r++) {
        if (all[r].root) {
            nroots++;
            if (root0 < 0) root0 = r;
        }
        if (all[r].wrong) bad_ranks[nbad_ranks++] = r;
        wrong += all[r].wrong;
    }
    DG_ASSERT(root0 >= 0);
    const rec_t *R = &all[root0];
    int npts = R->npts;
    vbuf_t det = {0}, why = {0};
    vbuf_printf(&det,
                "{\"backend\": \"%s\", \"op\": \"%s\", \"group\": \"%s\", \"bus_factor_formula\": \"%s\", "
                "\"groups\": [",
                backend, k_ops[op], k_groups[grp],
                op == OP_ALLREDUCE                                ? "2(n-1)/n"
                : (op == OP_ALLGATHER || op == OP_REDUCE_SCATTER) ? "(n-1)/n"
                                                                  : "1");
    /* per group: busbw at the largest size against the reference of the group's node types */
    double worst_bw = INFINITY;
    int worst_root = root0, n_below = 0, n_ref = 0, one_rank_groups = 0, too_small = 0;
    int *below = dg_xmalloc((size_t)c->size * sizeof(int));
    const dg_sla_ref_t *shown = NULL;
    char metric[96];
    snprintf(metric, sizeof metric, "comm.%s.%s.%s", backend, k_ops[op], k_groups[grp]);
    int *types = dg_xmalloc((size_t)c->size * sizeof(int));
    for (int r = 0; r < c->size; r++) {
        if (!all[r].root) continue;
        const rec_t *g = &all[r];
        int nt = 0;
        for (int q = 0; q < c->size; q++)
            if (all[q].member && all[q].group_id == g->group_id) types[nt++] = c->type_of_rank[q];
        const dg_sla_ref_t *ref = vc_group_ref(c, metric, types, nt);
        /* the largest size the group could run */
        int last = -1;
        for (int p = 0; p < g->npts; p++)
            if (g->pts[p].bytes > 0) last = p;
        double bw = last >= 0 ? g->pts[last].busbw : 0;
        int measured = last >= 0;
        vbuf_printf(&det, "%s{\"group_id\": %d, \"host\": ", r == root0 ? "" : ", ", g->group_id);
        vbuf_json_str(&det, c->b->hosts[r]);
        vbuf_printf(&det, ", \"ranks\": %d, \"wrong\": %lld, \"sweep\": [", g->gsize, g->group_wrong);
        for (int p = 0; p < g->npts; p++) {
            const point_t *pt = &g->pts[p];
            vbuf_printf(&det, "%s{\"bytes\": %.0f, \"time_us\": ", p ? ", " : "", pt->bytes);
            vbuf_json_num(&det, pt->time * 1e6);
            vbuf_printf(&det, ", \"algbw_GBps\": ");
            vbuf_json_num(&det, pt->algbw / 1e9);
            vbuf_printf(&det, ", \"busbw_GBps\": ");
            vbuf_json_num(&det, pt->busbw / 1e9);
            vbuf_printf(&det, "}");
        }
        vbuf_printf(&det, "]}");
        if (g->gsize == 1) {
            one_rank_groups++;
            continue; /* no bus traffic in a group of one: data check only */
        }
        if (!measured) {
            too_small++;
            continue; /* every size of the sweep is below one element per rank */
        }
        if (bw < worst_bw) worst_bw = bw, worst_root = r;
        if (ref) {
            n_ref++;
            if (!shown) shown = ref;
            if (!dg_sla_ref_ok(ref, bw)) {
                below[n_below++] = r;
                if (n_below <= 4) {
                    char v[32], lim[200];
                    vc_fmt_value(v, sizeof v, bw, DG_DIM_BANDWIDTH);
                    dg_sla_ref_format(ref, lim, sizeof lim);
                    vbuf_printf(&why, "%sbusbw %s on the %s group of %d ranks from rank %d (%s), want %s",
                                why.n ? "; " : "", v, k_groups[grp], g->gsize, r, c->b->hosts[r], lim);
                }
            }
        }
    }
    vbuf_printf(&det, "]}");
    if (n_below > 4) vbuf_printf(&why, " and %d more groups", n_below - 4);
    vc_why_wrong(c, &why, wrong, "wrong elements in the results of", bad_ranks, nbad_ranks);
    int last = -1;
    for (int p = 0; p < npts; p++)
        if (R->pts[p].bytes > 0) last = p;
    if (isfinite(worst_bw)) {
        const rec_t *W = &all[worst_root];
        char v[32], a[32];
        vc_fmt_value(v, sizeof v, worst_bw, DG_DIM_BANDWIDTH);
        int wl = -1;
        for (int p = 0; p < W->npts; p++)
            if (W->pts[p].bytes > 0) wl = p;
        vc_fmt_value(a, sizeof a, wl >= 0 ? W->pts[wl].algbw : 0, DG_DIM_BANDWIDTH);
        snprintf(k->measured, sizeof k->measured, "busbw %s (algbw %s) @ %.0f B, n=%d%s, %lld wrong", v, a,
                 wl >= 0 ? W->pts[wl].bytes : 0, W->gsize, nroots > 1 ? " (slowest group)" : "", wrong);
        k->has_value = 1;
        k->value = worst_bw;
        snprintf(k->unit, sizeof k->unit, "B/s");
    } else {
        snprintf(k->measured, sizeof k->measured, "%d point%s up to %.0f B, %lld wrong", npts,
                 npts == 1 ? "" : "s", last >= 0 ? R->pts[last].bytes : 0, wrong);
    }
    if (shown)
        dg_sla_ref_format(shown, k->reference, sizeof k->reference);
    else
        snprintf(k->reference, sizeof k->reference, "0 wrong");
    if (why.n) {
        k->verdict = DG_VERDICT_FAIL;
        snprintf(k->message, sizeof k->message, "%s", why.s);
    } else if (too_small && !isfinite(worst_bw)) {
        snprintf(
            k->message, sizeof k->message,
            "every size of validate.comm_sizes is below one fp32 element per rank for %s: data check only",
            k_ops[op]);
    } else if (one_rank_groups && !isfinite(worst_bw)) {
        snprintf(k->message, sizeof k->message, "groups of 1 rank: no bus traffic, data check only");
    } else if (!n_ref) {
        snprintf(k->message, sizeof k->message, "no reference ref.%s in the SLA: bandwidth measured only",
                 metric);
    }
    dg_vcheck_set_details(k, det.s);
    vbuf_free(&det);
    vbuf_free(&why);
    free(below);
    free(types);
    free(bad_ranks);
}

/* ---------------------------------------------------------------- driver */

static dg_status_t run_group(vctx_t *c, const char *backend, int grp, MPI_Comm mpi, int group_id) {
    const dg_sla_settings_t *set = c->set;
    int nccl = strcmp(backend, "nccl") == 0;
    int member = mpi != MPI_COMM_NULL;
    group_t g = {0};
    g.mpi = mpi;
    g.nccl = nccl;
    double maxb = (double)set->comm_sizes[set->n_comm_sizes - 1];
    dg_status_t s = DG_OK;
    if (member) {
        MPI_Comm_rank(mpi, &g.rank);
        MPI_Comm_size(mpi, &g.size);
        dg_comm_opts_t o;
        dg_comm_opts_default(&o);
        o.name = k_groups[grp];
        o.timeout_s = set->comm_timeout_s;
        o.nccl_nonblocking = c->cfg ? c->cfg->parallel.nccl_nonblocking : 0;
        g.cap_elems = (size_t)(maxb / sizeof(float)) + 1;
        g.send = dg_xmalloc(g.cap_elems * sizeof(float));
        g.recv = dg_xmalloc(g.cap_elems * sizeof(float));
#ifdef DG_HAVE_CUDA
        if (nccl) {
            int dev =
                dg_vgpu_device(c->b->topo.gpus[c->b->gpu].pci_busid, c->b->topo.gpus[c->b->gpu].cuda_index);
            s = dev < 0 ? DG_ERR(DG_ERR_RUNTIME, "no CUDA device for GPU %s",
                                 c->b->topo.gpus[c->b->gpu].pci_busid)
                        : DG_OK;
            if (s == DG_OK) s = dg_vgpu_alloc(dev, g.cap_elems * sizeof(float), &g.dsend);
            if (s == DG_OK) s = dg_vgpu_alloc(dev, g.cap_elems * sizeof(float), &g.drecv);
            if (s == DG_OK) s = dg_comm_create_nccl(mpi, dev, NULL, &o, &g.comm);
        } else
#endif
            s = dg_comm_create_mpi(mpi, &o, &g.comm);
    }
    /* creation is collective within the group only; agree over the world before measuring */
    char msg[2048];
    dg_status_t ag = vc_agree(c, s, msg, sizeof msg);
    if (ag != DG_OK) {
        for (int op = 0; op < N_OPS; op++) {
            char name[96];
            snprintf(name, sizeof name, "comm.%s.%s.%s", backend, k_ops[op], k_groups[grp]);
            if (!vc_selected(c, name)) continue;
            dg_vcheck_t *k = vc_add(c, name);
            if (k) {
                k->verdict = DG_VERDICT_ERROR;
                snprintf(k->message, sizeof k->message, "could not create the %s comm: %.1900s", backend,
                         msg);
            }
        }
        /* a half-created group cannot be freed collectively: leak it (the suite continues) */
        free(g.send);
        free(g.recv);
        return DG_OK;
    }
    for (int op = 0; op < N_OPS; op++) {
        char name[96];
        snprintf(name, sizeof name, "comm.%s.%s.%s", backend, k_ops[op], k_groups[grp]);
        if (!vc_selected(c, name)) continue;
        double t0 = dg_now_s();
        rec_t rec;
        memset(&rec, 0, sizeof rec);
        rec.member = member;
        rec.group_id = group_id;
        if (member) {
            rec.root = g.rank == 0;
            rec.gsize = g.size;
            if (!(op == OP_SENDRECV && g.size == 1)) {
                sum_table_t st;
                sum_table(&st, g.size);
                rec.npts = set->n_comm_sizes;
                for (int p = 0; p < set->n_comm_sizes; p++) {
                    point_t pt;
                    measure_point(c, &g, op, (double)set->comm_sizes[p], &st, name, &pt);
                    rec.pts[p] = pt;
                    rec.wrong += pt.wrong;
                }
                long long gw = 0;
                MPI_Reduce(&rec.wrong, &gw, 1, MPI_LONG_LONG, MPI_SUM, 0, mpi);
                rec.group_wrong = gw;
            }
        }
        DG_TRY(vc_quiet_barrier(c, c->b->world, name));
        /* sendrecv in groups of one rank: nothing to send to */
        int any_pairs = 0, mine = member && !(op == OP_SENDRECV && g.size == 1);
        MPI_Allreduce(&mine, &any_pairs, 1, MPI_INT, MPI_MAX, c->b->world);
        if (!any_pairs) {
            vc_skip(c, name, "every %s group has 1 rank: no peer to send to", k_groups[grp]);
            continue;
        }
        rec_t *all = c->rank == 0 ? dg_xmalloc((size_t)c->size * sizeof *all) : NULL;
        DG_MPI_CHECK(
            MPI_Gather(&rec, (int)sizeof rec, MPI_BYTE, all, (int)sizeof rec, MPI_BYTE, 0, c->b->world));
        if (c->rank == 0) {
            /* a sendrecv group of 1 rank takes no part: drop it from the judging */
            if (op == OP_SENDRECV)
                for (int r = 0; r < c->size; r++)
                    if (all[r].gsize == 1) all[r].member = all[r].root = 0;
            judge(c, name, op, grp, all, dg_now_s() - t0, backend);
        }
        free(all);
        if (c->rank == 0) vc_write_reports(c);
    }
    if (member) dg_comm_free(g.comm);
#ifdef DG_HAVE_CUDA
    if (g.dsend) dg_vgpu_free(g.dsend);
    if (g.drecv) dg_vgpu_free(g.drecv);
#endif
    free(g.send);
    free(g.recv);
    return DG_OK;
}

static int group_selected(vctx_t *c, const char *backend, int grp) {
    for (int op = 0; op < N_OPS; op++) {
        char name[96];
        snprintf(name, sizeof name, "comm.%s.%s.%s", backend, k_ops[op], k_groups[grp]);
        if (vc_selected(c, name)) return 1;
    }
    return 0;
}

static void skip_group(vctx_t *c, const char *backend, int grp, const char *why) {
    for (int op = 0; op < N_OPS; op++) {
        char name[96];
        snprintf(name, sizeof name, "comm.%s.%s.%s", backend, k_ops[op], k_groups[grp]);
        if (vc_selected(c, name)) vc_skip(c, name, "%s", why);
    }
}

/* Can this job run NCCL? Every rank needs a GPU of its own that CUDA can open. */
static int nccl_possible(vctx_t *c, char *why, size_t cap) {
#ifdef DG_HAVE_CUDA
    int ok = 1;
    char err[256] = "";
    if (c->b->gpu < 0) {
        ok = 0;
        snprintf(err, sizeof err, "no GPU");
    } else if (dg_vgpu_count(err, sizeof err) <= 0) {
        ok = 0;
    }
    /* ranks sharing a GPU: NCCL refuses two ranks on one device */
    char bus[32] = "";
    if (c->b->gpu >= 0) snprintf(bus, sizeof bus, "%s", c->b->topo.gpus[c->b->gpu].pci_busid);
    char *all = dg_xmalloc((size_t)c->b->local_size * sizeof bus);
    MPI_Allgather(bus, sizeof bus, MPI_CHAR, all, sizeof bus, MPI_CHAR, c->b->node);
    for (int q = 0; q < c->b->local_size && ok; q++)
        if (q != c->b->local_rank && bus[0] && strcmp(all + q * sizeof bus, bus) == 0) {
            ok = 0;
            snprintf(err, sizeof err, "GPU %s is shared with local rank %d (NCCL needs one rank per GPU)",
                     bus, q);
        }
    free(all);
    int all_ok = 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, c->b->world);
    if (!all_ok) {
        /* name the first rank that cannot */
        int me = ok ? c->size : c->rank, first = 0;
        MPI_Allreduce(&me, &first, 1, MPI_INT, MPI_MIN, c->b->world);
        MPI_Bcast(err, sizeof err, MPI_CHAR, first, c->b->world);
        snprintf(why, cap, "NCCL cannot run: rank %d (%s): %s", first, c->b->hosts[first], err);
    }
    return all_ok;
#else
    (void)c;
    snprintf(why, cap,
             "built without CUDA: the NCCL collectives are not measured (rebuild with -DDGT_CUDA=ON on a GPU "
             "cluster)");
    return 0;
#endif
}

dg_status_t vc_check_comm(vctx_t *c) {
    const char *want = c->set->comm_backends;
    int use_mpi = strcmp(want, "auto") == 0 || strstr(want, "mpi") != NULL;
    int ask_nccl = strcmp(want, "auto") == 0 || strstr(want, "nccl") != NULL;
    dg_boot_t *b = c->b;
    for (int be = 0; be < 2; be++) {
        const char *backend = be ? "nccl" : "mpi";
        if (be == 0 && !use_mpi) continue;
        if (be == 1 && !ask_nccl) continue;
        int any = 0;
        for (int grp = 0; grp < N_GROUPS; grp++)
            any |= group_selected(c, backend, grp);
        if (!any) continue;
        if (be == 1) {
            char why[512] = "";
            if (!nccl_possible(c, why, sizeof why)) {
                /* auto: silently mpi-only on CPU builds would hide the note the admin needs; say it once per
                 * check */
                for (int grp = 0; grp < N_GROUPS; grp++)
                    skip_group(c, backend, grp, why);
                continue;
            }
        }
        for (int grp = 0; grp < N_GROUPS; grp++) {
            if (!group_selected(c, backend, grp)) continue;
            if (grp == G_INTER && b->n_nodes == 1) {
                skip_group(c, backend, grp, "one node: there is no inter-node link to measure");
                continue;
            }
            if (grp == G_WORLD && b->n_nodes == 1) {
                char why[160];
                snprintf(why, sizeof why, "one node: the world is the intra-node group (see comm.%s.*.intra)",
                         backend);
                skip_group(c, backend, grp, why);
                continue;
            }
            MPI_Comm mpi = grp == G_INTRA ? b->node : grp == G_INTER ? c->leaders : b->world;
            DG_TRY(run_group(c, backend, grp, mpi, grp == G_INTRA ? b->node_id : 0));
        }
    }
    return DG_OK;
}
