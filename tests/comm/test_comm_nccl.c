/* test_comm_nccl.c — the nccl comm backend on a real GPU: all-reduce (f32/bf16, SUM/AVG, in place),
 * all-gather (in place too), reduce-scatter (in place too), broadcast, barrier, blocking and
 * non-blocking forms, the stream wait edges (dg_comm_begin_after / dg_comm_stream_wait with a user
 * stream), split, and a mesh built on NCCL. One rank per GPU (NCCL refuses two ranks on one GPU).
 * Exits 77 (ctest: skipped) with a message when there is no GPU, or fewer GPUs than ranks.
 *
 * usage: test_comm_nccl      (under mpiexec -n K, K <= number of GPUs)
 */
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "comm_test_util.h"
#include "dg_test_skip.h"
#include "dg_test_mpi.h"

#define CUDA_OK(call)                                                                                        \
    do {                                                                                                     \
        cudaError_t e_ = (call);                                                                             \
        CHECK(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                                   \
    } while (0)

static int g_n, g_me;

static void fill(void *host, size_t n, dg_dtype_t dt, int rank, size_t off, uint64_t seed) {
    for (size_t i = 0; i < n; i++) {
        float v = tu_exact(rank, off + i, seed);
        if (dt == DG_F32)
            ((float *)host)[i] = v;
        else
            ((uint16_t *)host)[i] = dg_bits_f32_to_bf16(v);
    }
}

/* A device buffer filled before anything else touches it: cudaMemset runs on the legacy stream, which the
 * non-blocking comm stream does not wait for, and returns before it is done for device memory. */
static void dev_fill(void *p, int v, size_t bytes) {
    CUDA_OK(cudaMemset(p, v, bytes));
    CUDA_OK(cudaDeviceSynchronize());
}

static float get(const void *host, size_t i, dg_dtype_t dt) {
    return dt == DG_F32 ? ((const float *)host)[i] : dg_bits_bf16_to_f32(((const uint16_t *)host)[i]);
}

/* expected value of a reduction of exact inputs (sums of small integers are exact in any order;
 * AVG may be computed by NCCL as a pre-scaled sum, so it is compared with a 1-ulp-of-bf16 margin) */
static int close_to(float got, double want, dg_dtype_t dt, dg_redop_t red) {
    if (red == DG_RED_SUM) return got == (float)want;
    double tol = dt == DG_BF16 ? fabs(want) / 128.0 + 1e-6 : fabs(want) * 1e-6 + 1e-7;
    return fabs(got - want) <= tol;
}

static void test_allreduce(dg_comm_t *c, cudaStream_t user) {
    const size_t counts[] = {1, 7, 1000, 65537};
    for (int di = 0; di < 2; di++)
        for (size_t ci = 0; ci < 4; ci++)
            for (int red = 0; red < 2; red++)
                for (int variant = 0; variant < 3; variant++) {
                    dg_dtype_t dt = di ? DG_BF16 : DG_F32;
                    size_t n = counts[ci], esz = dg_dtype_size(dt);
                    void *h = malloc(n * esz), *d_in = NULL, *d_out = NULL;
                    fill(h, n, dt, g_me, 0, 10 + ci);
                    CUDA_OK(cudaMalloc(&d_in, n * esz));
                    CUDA_OK(cudaMalloc(&d_out, n * esz));
                    /* the output's poison and the input are written on the user stream; begin_after orders
                     * the collective after them (a cudaMemset on the legacy stream is not ordered with the
                     * non-blocking streams: it could land after NCCL's result, as seen on an H100) */
                    CUDA_OK(cudaMemsetAsync(d_out, 0xff, n * esz, user));
                    CUDA_OK(cudaMemcpyAsync(d_in, h, n * esz, cudaMemcpyHostToDevice, user));
                    CHECK_OK(dg_comm_begin_after(c, user));
                    void *out = variant == 2 ? d_in : d_out;
                    if (variant == 0) {
                        CHECK_OK(dg_comm_allreduce(c, d_in, out, n, dt, (dg_redop_t)red));
                    } else {
                        dg_comm_req_t *r = NULL;
                        CHECK_OK(dg_comm_iallreduce(c, d_in, out, n, dt, (dg_redop_t)red, &r));
                        /* the copy back waits for the collective on the device, not on the host */
                        if (r) CHECK_OK(dg_comm_stream_wait(c, r, user));
                    }
                    CUDA_OK(cudaMemcpyAsync(h, out, n * esz, cudaMemcpyDeviceToHost, user));
                    CUDA_OK(cudaStreamSynchronize(user));
                    int bad = 0;
                    for (size_t i = 0; i < n && bad < 3; i++) {
                        double want = 0;
                        for (int r = 0; r < g_n; r++)
                            want += tu_exact(r, i, 10 + ci);
                        if (red == DG_RED_AVG) want /= g_n;
                        if (!close_to(get(h, i, dt), want, dt, (dg_redop_t)red)) {
                            bad++;
                            CHECK(0, "allreduce %s %s n=%zu variant %d: [%zu] = %g, expected %g",
                                  dg_dtype_name(dt), red ? "AVG" : "SUM", n, variant, i, get(h, i, dt), want);
                        }
                    }
                    cudaFree(d_in);
                    cudaFree(d_out);
                    free(h);
                }
}

static void test_gather_scatter(dg_comm_t *c) {
    /* group ranks (a split may order them differently from the world): each rank's data is keyed by its
     * rank in c */
    const int me = dg_comm_rank(c), nr = dg_comm_size(c);
    const size_t counts[] = {1, 333, 40000};
    for (size_t ci = 0; ci < 3; ci++)
        for (int inplace = 0; inplace < 2; inplace++) {
            size_t n = counts[ci], all = n * (size_t)nr;
            float *h = malloc(all * 4), *want = malloc(all * 4);
            float *d_send = NULL, *d_recv = NULL;
            CUDA_OK(cudaMalloc((void **)&d_send, all * 4));
            CUDA_OK(cudaMalloc((void **)&d_recv, all * 4));
            /* all-gather */
            fill(h, n, DG_F32, me, 0, 50 + ci);
            for (int r = 0; r < nr; r++)
                fill(want + (size_t)r * n, n, DG_F32, r, 0, 50 + ci);
            dev_fill(d_recv, 0xff, all * 4);
            float *src = inplace ? d_recv + (size_t)me * n : d_send;
            CUDA_OK(cudaMemcpy(src, h, n * 4, cudaMemcpyHostToDevice));
            dg_comm_req_t *r = NULL;
            CHECK_OK(dg_comm_iallgather(c, src, d_recv, n, DG_F32, &r));
            if (r) CHECK_OK(dg_comm_wait(c, r));
            float *got = malloc(all * 4);
            CUDA_OK(cudaMemcpy(got, d_recv, all * 4, cudaMemcpyDeviceToHost));
            CHECK(memcmp(got, want, all * 4) == 0, "allgather n=%zu inplace=%d wrong", n, inplace);
            /* reduce-scatter (SUM and AVG) */
            for (int red = 0; red < 2; red++) {
                fill(h, all, DG_F32, me, 0, 60 + ci);
                CUDA_OK(cudaMemcpy(d_send, h, all * 4, cudaMemcpyHostToDevice));
                float *out = inplace ? d_send + (size_t)me * n : d_recv;
                CHECK_OK(dg_comm_reduce_scatter(c, d_send, out, n, DG_F32, (dg_redop_t)red));
                CUDA_OK(cudaMemcpy(got, out, n * 4, cudaMemcpyDeviceToHost));
                int bad = 0;
                for (size_t i = 0; i < n && bad < 3; i++) {
                    double w = 0;
                    for (int q = 0; q < nr; q++)
                        w += tu_exact(q, (size_t)me * n + i, 60 + ci);
                    if (red) w /= nr;
                    if (!close_to(got[i], w, DG_F32, (dg_redop_t)red)) {
                        bad++;
                        CHECK(0, "reduce_scatter n=%zu inplace=%d red=%d: [%zu] = %g, expected %g", n,
                              inplace, red, i, got[i], w);
                    }
                }
            }
            /* broadcast from the last rank */
            int root = nr - 1;
            fill(want, n, DG_F32, root, 0, 70 + ci);
            if (me == root)
                CUDA_OK(cudaMemcpy(d_recv, want, n * 4, cudaMemcpyHostToDevice));
            else
                dev_fill(d_recv, 0, n * 4);
            CHECK_OK(dg_comm_broadcast(c, d_recv, n, DG_F32, root));
            CUDA_OK(cudaMemcpy(got, d_recv, n * 4, cudaMemcpyDeviceToHost));
            CHECK(memcmp(got, want, n * 4) == 0, "broadcast n=%zu wrong", n);
            free(got);
            free(h);
            free(want);
            cudaFree(d_send);
            cudaFree(d_recv);
        }
    CHECK_OK(dg_comm_barrier(c));
    CHECK_OK(dg_comm_flush(c));
    CHECK_OK(dg_comm_poll(c));
}

static void test_p2p(dg_comm_t *c) {
    if (g_n < 2) return;
    size_t n = 1000;
    float *h = malloc(n * 4), *d_out = NULL, *d_in = NULL;
    CUDA_OK(cudaMalloc((void **)&d_out, n * 4));
    CUDA_OK(cudaMalloc((void **)&d_in, n * 4));
    fill(h, n, DG_F32, g_me, 0, 80);
    CUDA_OK(cudaMemcpy(d_out, h, n * 4, cudaMemcpyHostToDevice));
    int next = (g_me + 1) % g_n, prev = (g_me + g_n - 1) % g_n;
    dg_comm_req_t *rs = NULL, *rr = NULL;
    /* even ranks send first, odd receive first: NCCL matches in order per peer */
    if (g_me % 2 == 0) {
        CHECK_OK(dg_comm_isend(c, d_out, n, DG_F32, next, 0, &rs));
        CHECK_OK(dg_comm_irecv(c, d_in, n, DG_F32, prev, 0, &rr));
    } else {
        CHECK_OK(dg_comm_irecv(c, d_in, n, DG_F32, prev, 0, &rr));
        CHECK_OK(dg_comm_isend(c, d_out, n, DG_F32, next, 0, &rs));
    }
    if (rs) CHECK_OK(dg_comm_wait(c, rs));
    if (rr) CHECK_OK(dg_comm_wait(c, rr));
    float *want = malloc(n * 4);
    fill(want, n, DG_F32, prev, 0, 80);
    CUDA_OK(cudaMemcpy(h, d_in, n * 4, cudaMemcpyDeviceToHost));
    CHECK(memcmp(h, want, n * 4) == 0, "send/recv ring wrong");
    free(h);
    free(want);
    cudaFree(d_out);
    cudaFree(d_in);
}

/* Every rank posts irecv before isend, several exchanges deep, then an all-reduce before waiting for
 * any of them: enqueued one by one this deadlocks (each stream's receive waits for a send queued behind
 * the peer's receive); the backend groups the batch (ncclGroupStart/End) before the collective. Then a
 * blocking send/recv pair ordered by rank parity (each a group of one). */
static void test_p2p_batch(dg_comm_t *c) {
    if (g_n < 2) return;
    enum { K = 3 };
    size_t n = 4096;
    float *h = malloc(n * 4), *want = malloc(n * 4), *d_out = NULL, *d_in[K], *d_sum = NULL;
    CUDA_OK(cudaMalloc((void **)&d_out, n * 4));
    CUDA_OK(cudaMalloc((void **)&d_sum, 4));
    for (int k = 0; k < K; k++) {
        CUDA_OK(cudaMalloc((void **)&d_in[k], n * 4));
        dev_fill(d_in[k], 0xff, n * 4);
    }
    float one = 1.0f;
    CUDA_OK(cudaMemcpy(d_sum, &one, 4, cudaMemcpyHostToDevice));
    fill(h, n, DG_F32, g_me, 0, 81);
    CUDA_OK(cudaMemcpy(d_out, h, n * 4, cudaMemcpyHostToDevice));
    int next = (g_me + 1) % g_n, prev = (g_me + g_n - 1) % g_n;
    dg_comm_req_t *rr[K] = {0}, *rs[K] = {0}, *ra = NULL;
    for (int k = 0; k < K; k++) {
        CHECK_OK(dg_comm_irecv(c, d_in[k], n, DG_F32, prev, 0, &rr[k]));
        CHECK_OK(dg_comm_isend(c, d_out, n, DG_F32, next, 0, &rs[k]));
    }
    char st[256];
    dg_comm_state(c, st, sizeof st);
    CHECK(strstr(st, "batched") != NULL, "state does not show the pending batch: %s", st);
    CHECK_OK(dg_comm_iallreduce(c, d_sum, d_sum, 1, DG_F32, DG_RED_SUM, &ra));
    for (int k = 0; k < K; k++) {
        if (rr[k]) CHECK_OK(dg_comm_wait(c, rr[k]));
        if (rs[k]) CHECK_OK(dg_comm_wait(c, rs[k]));
    }
    if (ra) CHECK_OK(dg_comm_wait(c, ra));
    fill(want, n, DG_F32, prev, 0, 81);
    for (int k = 0; k < K; k++) {
        CUDA_OK(cudaMemcpy(h, d_in[k], n * 4, cudaMemcpyDeviceToHost));
        CHECK(memcmp(h, want, n * 4) == 0, "batched send/recv exchange %d wrong", k);
    }
    float sum = 0;
    CUDA_OK(cudaMemcpy(&sum, d_sum, 4, cudaMemcpyDeviceToHost));
    CHECK(sum == (float)g_n, "all-reduce after the batch: %g, want %d", sum, g_n);
    /* blocking forms: a one-op group each */
    dev_fill(d_in[0], 0xff, n * 4);
    if (g_me % 2 == 0) {
        CHECK_OK(dg_comm_send(c, d_out, n, DG_F32, next, 0));
        CHECK_OK(dg_comm_recv(c, d_in[0], n, DG_F32, prev, 0));
    } else {
        CHECK_OK(dg_comm_recv(c, d_in[0], n, DG_F32, prev, 0));
        CHECK_OK(dg_comm_send(c, d_out, n, DG_F32, next, 0));
    }
    CUDA_OK(cudaMemcpy(h, d_in[0], n * 4, cudaMemcpyDeviceToHost));
    CHECK(memcmp(h, want, n * 4) == 0, "blocking send/recv wrong");
    CHECK_OK(dg_comm_flush(c));
    free(h);
    free(want);
    cudaFree(d_out);
    cudaFree(d_sum);
    for (int k = 0; k < K; k++)
        cudaFree(d_in[k]);
}

int main(int argc, char **argv) {
    dg_test_mpi_init(&argc, &argv, &g_wrank, &g_n);
    g_me = g_wrank;
    dg_log_init(g_wrank, "", DG_LOG_WARN, NULL);
    int ngpu = 0;
    cudaError_t e = cudaGetDeviceCount(&ngpu);
    int have = e == cudaSuccess && ngpu >= g_n, all_have = 0;
    MPI_Allreduce(&have, &all_have, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!all_have) {
        /* a skip without enough GPUs; under CI=true a failure where the GPUs are there (dg_test_skip.h) */
        int rc = dg_test_skip_rc(g_n);
        if (g_wrank == 0)
            rc = dg_test_skip(g_n,
                              "test_comm_nccl needs one GPU per rank (%d ranks; cudaGetDeviceCount: %d, %s)",
                              g_n, ngpu, e == cudaSuccess ? "ok" : cudaGetErrorString(e));
        MPI_Finalize();
        return rc;
    }
    int dev = g_wrank % ngpu;
    CUDA_OK(cudaSetDevice(dev));
    cudaStream_t user;
    CUDA_OK(cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking));
    dg_comm_opts_t o;
    dg_comm_opts_default(&o);
    o.name = "nccltest";
    o.timeout_s = 60;
    dg_comm_t *c = NULL;
    dg_status_t s = dg_comm_create_nccl(MPI_COMM_WORLD, dev, NULL, &o, &c);
    CHECK(s == DG_OK, "create nccl comm: %s", dg_last_error());
    if (c) {
        CHECK(strcmp(dg_comm_backend_name(c), "nccl") == 0 && dg_comm_size(c) == g_n &&
                  dg_comm_rank(c) == g_me,
              "identity");
        dg_comm_set_step(c, 1);
        test_allreduce(c, user);
        test_gather_scatter(c);
        test_p2p(c);
        test_p2p_batch(c);
        /* split: everyone in one group, reversed order */
        dg_comm_t *sub = NULL;
        o.name = "reversed";
        CHECK_OK(dg_comm_split(c, 0, g_n - 1 - g_me, &o, &sub));
        if (sub) {
            CHECK(dg_comm_rank(sub) == g_n - 1 - g_me, "split rank %d", dg_comm_rank(sub));
            test_gather_scatter(sub);
            dg_comm_free(sub);
        }
        char st[256];
        dg_comm_state(c, st, sizeof st);
        printf("[rank %d] %s\n", g_wrank, st);
        dg_comm_free(c);
    }
    /* non-blocking communicators (opts.nccl_nonblocking; dgtrain: parallel.nccl_nonblocking): the same
     * results, every call settled by polling; the state line says the mode, and a split keeps it */
    o.name = "nonblocking";
    o.nccl_nonblocking = 1;
    c = NULL;
    s = dg_comm_create_nccl(MPI_COMM_WORLD, dev, NULL, &o, &c);
    CHECK(s == DG_OK, "create non-blocking nccl comm: %s", dg_last_error());
    if (c) {
        char st[256];
        dg_comm_state(c, st, sizeof st);
        CHECK(strstr(st, "(nccl, non-blocking)") != NULL, "non-blocking state: %s", st);
        dg_comm_set_step(c, 1);
        test_allreduce(c, user);
        test_gather_scatter(c);
        test_p2p_batch(c);
        dg_comm_t *sub = NULL;
        o.name = "nonblocking_split";
        o.nccl_nonblocking = 0; /* a split takes its parent's mode */
        CHECK_OK(dg_comm_split(c, 0, g_n - 1 - g_me, &o, &sub));
        if (sub) {
            dg_comm_state(sub, st, sizeof st);
            CHECK(strstr(st, "(nccl, non-blocking)") != NULL, "split of a non-blocking comm: %s", st);
            test_gather_scatter(sub);
            dg_comm_free(sub);
        }
        dg_comm_free(c);
    }
    o.nccl_nonblocking = 0;
    /* a mesh on NCCL: dp_shard over all ranks */
    dg_mesh_shape_t sh = {{1, g_n, 1}, {DG_MESH_DP_REPLICATE, DG_MESH_DP_SHARD, DG_MESH_TP}};
    dg_comm_mesh_t *mesh = NULL;
    o.name = NULL;
    CHECK_OK(dg_comm_mesh_create(MPI_COMM_WORLD, &sh, DG_COMM_NCCL, dev, NULL, &o, &mesh));
    if (mesh) {
        CHECK(dg_comm_size(mesh->dim[DG_MESH_DP_SHARD]) == g_n && dg_comm_size(mesh->dim[DG_MESH_TP]) == 1,
              "mesh sizes");
        test_gather_scatter(mesh->dim[DG_MESH_DP_SHARD]);
        test_gather_scatter(mesh->dim[DG_MESH_TP]);
        dg_comm_mesh_free(mesh);
    }
    cudaStreamDestroy(user);
    int rc = tu_finish("test_comm_nccl");
    MPI_Finalize();
    return rc;
}
