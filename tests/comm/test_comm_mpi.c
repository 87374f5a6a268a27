/* test_comm_mpi.c — correctness of the mpi comm backend at any rank count: every collective in blocking
 * and non-blocking form, f32 / bf16 (and f64 / i32 where they apply), SUM and AVG, odd and zero counts,
 * in-place forms, point-to-point exchanges, many outstanding operations completed out of order, split
 * and mesh communicators, and the one-line errors for bad arguments. Each result is checked against a
 * reference computed locally from the same deterministic inputs; unwritten outputs are caught by
 * poisoning. Runs once per progress mode (thread, nonblocking).
 *
 * usage: test_comm_mpi            (under mpiexec -n K)
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "comm_test_util.h"
#include "dg_test_mpi.h"

static const size_t k_counts[] = {0, 1, 7, 1023, 70001};
#define NCOUNTS (sizeof k_counts / sizeof k_counts[0])

static void poison(void *p, size_t bytes) {
    memset(p, 0xA5, bytes);
}

/* input element i of `rank` as the given dtype */
static void make_input(void *buf, size_t n, dg_dtype_t dt, int rank, size_t offset, int exact,
                       uint64_t seed) {
    for (size_t i = 0; i < n; i++) {
        float v = exact ? tu_exact(rank, offset + i, seed) : tu_rand(rank, offset + i, seed);
        switch (dt) {
        case DG_F32:
            ((float *)buf)[i] = v;
            break;
        case DG_BF16:
            ((uint16_t *)buf)[i] = dg_bits_f32_to_bf16(v);
            break;
        case DG_F64:
            ((double *)buf)[i] = (double)v;
            break;
        case DG_I32:
            ((int32_t *)buf)[i] = (int32_t)tu_exact(rank, offset + i, seed);
            break;
        default:
            abort();
        }
    }
}

static double elem_as_double(const void *buf, size_t i, dg_dtype_t dt) {
    switch (dt) {
    case DG_F32:
        return ((const float *)buf)[i];
    case DG_BF16:
        return dg_bits_bf16_to_f32(((const uint16_t *)buf)[i]);
    case DG_F64:
        return ((const double *)buf)[i];
    case DG_I32:
        return ((const int32_t *)buf)[i];
    default:
        abort();
    }
}

/* Checks got[i] == reduction over ranks of input(rank, offset + i). Exact inputs must match the
 * reference bit for bit (sums of small integers are exact in every order); random inputs within an
 * order-of-summation bound (one rounding per combining step). */
static int check_reduced(const void *got, size_t n, dg_dtype_t dt, dg_redop_t red, int nranks, size_t offset,
                         int exact, uint64_t seed, const char *what) {
    int bad = 0;
    void *one = malloc(dg_dtype_size(dt) * (n ? n : 1));
    double *sum = calloc(n ? n : 1, sizeof(double)), *mag = calloc(n ? n : 1, sizeof(double));
    for (int r = 0; r < nranks; r++) {
        make_input(one, n, dt, r, offset, exact, seed);
        for (size_t i = 0; i < n; i++) {
            double v = elem_as_double(one, i, dt);
            sum[i] += v;
            mag[i] += fabs(v);
        }
    }
    for (size_t i = 0; i < n && bad < 5; i++) {
        double g = elem_as_double(got, i, dt);
        if (exact) {
            /* the expected bits: the exact sum, then one division for AVG, as the backend does */
            int ok;
            if (dt == DG_F32) {
                float e = (float)sum[i];
                if (red == DG_RED_AVG) e = e / (float)nranks;
                ok = memcmp(&e, (const float *)got + i, 4) == 0;
            } else if (dt == DG_BF16) {
                float e = (float)sum[i];
                if (red == DG_RED_AVG) e = e / (float)nranks;
                ok = dg_bits_f32_to_bf16(e) == ((const uint16_t *)got)[i];
            } else if (dt == DG_F64) {
                double e = sum[i];
                if (red == DG_RED_AVG) e = e / (double)nranks;
                ok = memcmp(&e, (const double *)got + i, 8) == 0;
            } else {
                ok = (int32_t)sum[i] == ((const int32_t *)got)[i];
            }
            if (!ok) {
                bad++;
                CHECK(0, "%s: element %zu = %.9g, expected exactly %.9g%s", what, i, g, sum[i],
                      red == DG_RED_AVG ? " / n" : "");
            }
        } else {
            double e = sum[i], tol;
            if (dt == DG_BF16)
                tol = (nranks + 1) * mag[i] / 256.0 + 1e-30;
            else if (dt == DG_F32)
                tol = (nranks + 1) * mag[i] * 1.2e-7 + 1e-30;
            else
                tol = (nranks + 1) * mag[i] * 2.3e-16 + 1e-300;
            if (red == DG_RED_AVG) {
                e /= nranks;
                tol /= nranks;
            }
            if (!(fabs(g - e) <= tol)) {
                bad++;
                CHECK(0, "%s: element %zu = %.9g, expected %.9g (tolerance %.3g)", what, i, g, e, tol);
            }
        }
    }
    free(one);
    free(sum);
    free(mag);
    return bad;
}

static const char *mode_name(dg_comm_progress_t p) {
    return p == DG_COMM_PROGRESS_NONBLOCKING ? "nonblocking" : "thread";
}

/* ---------------------------------------------------------------------------------------------- */

/* s, the status of a non-blocking call that gave *r; then the wait for *r: the first failure */
static dg_status_t waited(dg_comm_t *c, dg_status_t s, dg_comm_req_t *const *r) {
    return s == DG_OK ? dg_comm_wait(c, *r) : s;
}

/* One reduction case: dtype (esz bytes an element), count, SUM or AVG, non-blocking or not, in place or
 * not, exact (integer-valued) or random inputs, the inputs' seed */
typedef struct {
    dg_dtype_t dt;
    size_t cnt, esz;
    dg_redop_t red;
    int nonblocking, inplace, exact;
    uint64_t seed;
} red_case_t;

typedef void (*red_body_t)(dg_comm_t *c, dg_comm_progress_t mode, const red_case_t *k);

/* body over dts[0..ndt) x k_counts x {SUM, AVG} x {blocking, non-blocking} x {out of place, in place},
 * without AVG of i32; exact inputs for i32 and for every other case; seeds seed, seed + 1, ... */
static void for_red_cases(dg_comm_t *c, dg_comm_progress_t mode, const dg_dtype_t *dts, size_t ndt,
                          uint64_t seed, red_body_t body) {
    for (size_t di = 0; di < ndt; di++)
        for (size_t ci = 0; ci < NCOUNTS; ci++)
            for (int red = 0; red < 2; red++)
                for (int variant = 0; variant < 4; variant++) {
                    dg_dtype_t dt = dts[di];
                    if (dt == DG_I32 && red == DG_RED_AVG) continue;
                    red_case_t k = {dt,
                                    k_counts[ci],
                                    dg_dtype_size(dt),
                                    (dg_redop_t)red,
                                    variant & 1,
                                    (variant >> 1) & 1,
                                    dt == DG_I32 || ((ci + (size_t)red + (size_t)variant) % 2 == 0),
                                    seed++};
                    body(c, mode, &k);
                }
}

/* "HEAD DT SUM|AVG n=CNT[PER] blocking|nonblocking[ in-place] exact|random": what k's checks name */
static void red_what(char *buf, size_t cap, const char *head, const red_case_t *k, const char *per) {
    snprintf(buf, cap, "%s %s %s n=%zu%s %s%s%s", head, dg_dtype_name(k->dt), k->red ? "AVG" : "SUM", k->cnt,
             per, k->nonblocking ? "nonblocking" : "blocking", k->inplace ? " in-place" : "",
             k->exact ? " exact" : " random");
}

static void allreduce_case(dg_comm_t *c, dg_comm_progress_t mode, const red_case_t *k) {
    int n = dg_comm_size(c), me = dg_comm_rank(c);
    void *send = malloc(k->cnt * k->esz + 8), *recv = malloc(k->cnt * k->esz + 8);
    make_input(send, k->cnt, k->dt, me, 0, k->exact, k->seed);
    poison(recv, k->cnt * k->esz);
    if (k->inplace) memcpy(recv, send, k->cnt * k->esz);
    const void *src = k->inplace ? recv : send;
    dg_comm_req_t *r = NULL;
    dg_status_t s = k->nonblocking
                        ? waited(c, dg_comm_iallreduce(c, src, recv, k->cnt, k->dt, k->red, &r), &r)
                        : dg_comm_allreduce(c, src, recv, k->cnt, k->dt, k->red);
    char head[64], what[160];
    snprintf(head, sizeof head, "[%s] allreduce", mode_name(mode));
    red_what(what, sizeof what, head, k, "");
    CHECK(s == DG_OK, "%s: %s", what, dg_last_error());
    if (s == DG_OK) check_reduced(recv, k->cnt, k->dt, k->red, n, 0, k->exact, k->seed, what);
    free(send);
    free(recv);
}

static void test_allreduce(dg_comm_t *c, dg_comm_progress_t mode) {
    static const dg_dtype_t dts[] = {DG_F32, DG_BF16, DG_F64, DG_I32};
    for_red_cases(c, mode, dts, 4, 11, allreduce_case);
}

static void reduce_scatter_case(dg_comm_t *c, dg_comm_progress_t mode, const red_case_t *k) {
    int n = dg_comm_size(c), me = dg_comm_rank(c);
    const size_t bytes = k->cnt * k->esz;
    unsigned char *send = malloc((size_t)n * bytes + 8), *recv = malloc(bytes + 8);
    make_input(send, (size_t)n * k->cnt, k->dt, me, 0, k->exact, k->seed);
    poison(recv, bytes);
    void *out = k->inplace ? send + (size_t)me * bytes : recv;
    dg_comm_req_t *r = NULL;
    dg_status_t s = k->nonblocking
                        ? waited(c, dg_comm_ireduce_scatter(c, send, out, k->cnt, k->dt, k->red, &r), &r)
                        : dg_comm_reduce_scatter(c, send, out, k->cnt, k->dt, k->red);
    char head[64], what[160];
    snprintf(head, sizeof head, "[%s %s] reduce_scatter", mode_name(mode), dg_comm_name(c));
    red_what(what, sizeof what, head, k, "/rank");
    CHECK(s == DG_OK, "%s: %s", what, dg_last_error());
    if (s == DG_OK)
        check_reduced(out, k->cnt, k->dt, k->red, n, (size_t)me * k->cnt, k->exact, k->seed, what);
    free(send);
    free(recv);
}

static void test_reduce_scatter(dg_comm_t *c, dg_comm_progress_t mode) {
    static const dg_dtype_t dts[] = {DG_F32, DG_BF16, DG_F64};
    for_red_cases(c, mode, dts, 3, 101, reduce_scatter_case);
}

static void test_allgather(dg_comm_t *c, dg_comm_progress_t mode) {
    const dg_dtype_t dts[] = {DG_F32, DG_BF16, DG_F64, DG_I32};
    int n = dg_comm_size(c), me = dg_comm_rank(c);
    uint64_t seed = 201;
    for (size_t di = 0; di < 4; di++)
        for (size_t ci = 0; ci < NCOUNTS; ci++)
            for (int variant = 0; variant < 4; variant++) {
                dg_dtype_t dt = dts[di];
                int nonblocking = variant & 1, inplace = (variant >> 1) & 1;
                size_t cnt = k_counts[ci], esz = dg_dtype_size(dt);
                unsigned char *send = malloc(cnt * esz + 8), *recv = malloc((size_t)n * cnt * esz + 8),
                              *want = malloc((size_t)n * cnt * esz + 8);
                make_input(send, cnt, dt, me, 0, 0, seed);
                for (int r = 0; r < n; r++)
                    make_input(want + (size_t)r * cnt * esz, cnt, dt, r, 0, 0, seed);
                poison(recv, (size_t)n * cnt * esz);
                const void *src = send;
                if (inplace) {
                    memcpy(recv + (size_t)me * cnt * esz, send, cnt * esz);
                    src = recv + (size_t)me * cnt * esz;
                }
                dg_comm_req_t *r = NULL;
                dg_status_t s = nonblocking ? waited(c, dg_comm_iallgather(c, src, recv, cnt, dt, &r), &r)
                                            : dg_comm_allgather(c, src, recv, cnt, dt);
                CHECK(s == DG_OK, "[%s] allgather %s n=%zu: %s", mode_name(mode), dg_dtype_name(dt), cnt,
                      dg_last_error());
                CHECK(memcmp(recv, want, (size_t)n * cnt * esz) == 0,
                      "[%s] allgather %s n=%zu/rank %s%s: result differs from the concatenation",
                      mode_name(mode), dg_dtype_name(dt), cnt, nonblocking ? "nonblocking" : "blocking",
                      inplace ? " in-place" : "");
                free(send);
                free(recv);
                free(want);
                seed++;
            }
}

static void test_broadcast(dg_comm_t *c, dg_comm_progress_t mode) {
    int n = dg_comm_size(c), me = dg_comm_rank(c);
    const dg_dtype_t dts[] = {DG_F32, DG_BF16};
    for (int root = 0; root < n; root++)
        for (size_t di = 0; di < 2; di++)
            for (size_t ci = 0; ci < NCOUNTS; ci++) {
                dg_dtype_t dt = dts[di];
                size_t cnt = k_counts[ci], esz = dg_dtype_size(dt);
                unsigned char *buf = malloc(cnt * esz + 8), *want = malloc(cnt * esz + 8);
                make_input(want, cnt, dt, root, 0, 0, 300 + (uint64_t)root);
                if (me == root)
                    memcpy(buf, want, cnt * esz);
                else
                    poison(buf, cnt * esz);
                dg_comm_req_t *r = NULL;
                dg_status_t s = ci % 2 ? waited(c, dg_comm_ibroadcast(c, buf, cnt, dt, root, &r), &r)
                                       : dg_comm_broadcast(c, buf, cnt, dt, root);
                CHECK(s == DG_OK, "[%s] broadcast root %d: %s", mode_name(mode), root, dg_last_error());
                CHECK(memcmp(buf, want, cnt * esz) == 0, "[%s] broadcast %s n=%zu from root %d: wrong data",
                      mode_name(mode), dg_dtype_name(dt), cnt, root);
                free(buf);
                free(want);
            }
    CHECK_OK(dg_comm_barrier(c));
}

static void test_p2p(dg_comm_t *c, dg_comm_progress_t mode) {
    int n = dg_comm_size(c), me = dg_comm_rank(c);
    if (n < 2) return;
    int next = (me + 1) % n, prev = (me + n - 1) % n;
    for (size_t ci = 0; ci < NCOUNTS; ci++) {
        size_t cnt = k_counts[ci];
        float *out = malloc(cnt * 4 + 8), *in = malloc(cnt * 4 + 8), *want = malloc(cnt * 4 + 8);
        make_input(out, cnt, DG_F32, me, 0, 0, 400);
        make_input(want, cnt, DG_F32, prev, 0, 0, 400);
        /* non-blocking ring, sends posted before receives: must not deadlock behind the FIFO */
        poison(in, cnt * 4);
        dg_comm_req_t *rs = NULL, *rr = NULL;
        CHECK_OK(dg_comm_isend(c, out, cnt, DG_F32, next, 5, &rs));
        CHECK_OK(dg_comm_irecv(c, in, cnt, DG_F32, prev, 5, &rr));
        if (rr) CHECK_OK(dg_comm_wait(c, rr));
        if (rs) CHECK_OK(dg_comm_wait(c, rs));
        CHECK(memcmp(in, want, cnt * 4) == 0, "[%s] isend/irecv ring n=%zu: wrong data", mode_name(mode),
              cnt);
        /* blocking ring: rank 0 sends first, everyone else receives first */
        poison(in, cnt * 4);
        if (me == 0) {
            CHECK_OK(dg_comm_send(c, out, cnt, DG_F32, next, 6));
            CHECK_OK(dg_comm_recv(c, in, cnt, DG_F32, prev, 6));
        } else {
            CHECK_OK(dg_comm_recv(c, in, cnt, DG_F32, prev, 6));
            CHECK_OK(dg_comm_send(c, out, cnt, DG_F32, next, 6));
        }
        CHECK(memcmp(in, want, cnt * 4) == 0, "[%s] send/recv ring n=%zu: wrong data", mode_name(mode), cnt);
        free(out);
        free(in);
        free(want);
    }
    /* tags keep two messages to the same peer apart even when received in the other order */
    float a = 1.0f + me, b = 100.0f + me, ga = 0, gb = 0;
    dg_comm_req_t *r1 = NULL, *r2 = NULL, *r3 = NULL, *r4 = NULL;
    CHECK_OK(dg_comm_isend(c, &a, 1, DG_F32, next, 1, &r1));
    CHECK_OK(dg_comm_isend(c, &b, 1, DG_F32, next, 2, &r2));
    CHECK_OK(dg_comm_irecv(c, &gb, 1, DG_F32, prev, 2, &r3));
    CHECK_OK(dg_comm_irecv(c, &ga, 1, DG_F32, prev, 1, &r4));
    dg_comm_req_t *all[4] = {r4, r3, r2, r1};
    for (int i = 0; i < 4; i++)
        if (all[i]) CHECK_OK(dg_comm_wait(c, all[i]));
    CHECK(ga == 1.0f + prev && gb == 100.0f + prev, "[%s] tagged p2p: got %g %g", mode_name(mode), ga, gb);
}

/* Many operations in flight at once, completed in reverse order; results must match FIFO execution. */
static void test_fifo(dg_comm_t *c, dg_comm_progress_t mode) {
    enum { NOPS = 48 };
    int n = dg_comm_size(c), me = dg_comm_rank(c);
    dg_comm_req_t *req[NOPS];
    float *bufs[NOPS];
    size_t cnts[NOPS];
    for (int k = 0; k < NOPS; k++) {
        cnts[k] = (size_t)(1 + (k * 977) % 5000);
        size_t total = k % 3 == 2 ? cnts[k] * (size_t)n : cnts[k];
        bufs[k] = malloc(total * 4 + 8);
        if (k % 3 == 2) {
            poison(bufs[k], total * 4);
            float *mine = bufs[k] + (size_t)me * cnts[k];
            make_input(mine, cnts[k], DG_F32, me, 0, 1, 500 + (uint64_t)k);
            CHECK_OK(dg_comm_iallgather(c, mine, bufs[k], cnts[k], DG_F32, &req[k]));
        } else {
            make_input(bufs[k], cnts[k], DG_F32, me, 0, 1, 500 + (uint64_t)k);
            CHECK_OK(dg_comm_iallreduce(c, bufs[k], bufs[k], cnts[k], DG_F32, DG_RED_SUM, &req[k]));
        }
    }
    /* a test() right away must not disturb anything, done or not */
    int done = 0;
    if (req[NOPS - 1]) CHECK_OK(dg_comm_test(c, req[NOPS - 1], &done));
    if (done) req[NOPS - 1] = NULL;
    for (int k = NOPS - 1; k >= 0; k--)
        if (req[k]) CHECK_OK(dg_comm_wait(c, req[k]));
    for (int k = 0; k < NOPS; k++) {
        char what[96];
        snprintf(what, sizeof what, "[%s] fifo op %d", mode_name(mode), k);
        if (k % 3 == 2) {
            float *want = malloc(cnts[k] * (size_t)n * 4);
            for (int r = 0; r < n; r++)
                make_input(want + (size_t)r * cnts[k], cnts[k], DG_F32, r, 0, 1, 500 + (uint64_t)k);
            CHECK(memcmp(want, bufs[k], cnts[k] * (size_t)n * 4) == 0, "%s: allgather data wrong", what);
            free(want);
        } else {
            check_reduced(bufs[k], cnts[k], DG_F32, DG_RED_SUM, n, 0, 1, 500 + (uint64_t)k, what);
        }
        free(bufs[k]);
    }
    /* flush waits for everything still queued, and leaves the requests valid */
    float x = (float)me, y = 0, z = (float)me;
    dg_comm_req_t *r1 = NULL, *r2 = NULL;
    CHECK_OK(dg_comm_iallreduce(c, &x, &y, 1, DG_F32, DG_RED_SUM, &r1));
    CHECK_OK(dg_comm_ibroadcast(c, &z, 1, DG_F32, 0, &r2));
    CHECK_OK(dg_comm_flush(c));
    done = 0;
    if (r1) CHECK_OK(dg_comm_test(c, r1, &done));
    CHECK(done == 1, "[%s] request not complete after flush", mode_name(mode));
    if (r2) CHECK_OK(dg_comm_wait(c, r2));
    CHECK(y == (float)(n * (n - 1) / 2) && z == 0.0f, "[%s] after flush: y=%g z=%g", mode_name(mode), y, z);
}

static void test_split_and_mesh(dg_comm_t *c, dg_comm_progress_t mode) {
    int n = dg_comm_size(c), me = dg_comm_rank(c);
    dg_comm_opts_t o;
    dg_comm_opts_default(&o);
    o.progress = mode;
    o.timeout_s = 60;
    /* even / odd ranks, reversed order inside each group */
    o.name = "parity";
    dg_comm_t *sub = NULL;
    CHECK_OK(dg_comm_split(c, me % 2, -me, &o, &sub));
    if (sub) {
        int expect_size = (n + 1 - me % 2) / 2;
        CHECK(dg_comm_size(sub) == expect_size, "split size %d, expected %d", dg_comm_size(sub), expect_size);
        CHECK(strcmp(dg_comm_name(sub), "parity") == 0, "split name '%s'", dg_comm_name(sub));
        CHECK(dg_comm_world_rank_of(sub, dg_comm_rank(sub)) == g_wrank, "world rank mapping");
        int v = me, sum = 0;
        CHECK_OK(dg_comm_allreduce(sub, &v, &sum, 1, DG_I32, DG_RED_SUM));
        int want = 0;
        for (int r = me % 2; r < n; r += 2)
            want += r;
        CHECK(sum == want, "sum over parity group %d, expected %d", sum, want);
        /* highest parent rank first (key = -rank) */
        int first = 0;
        int mine = dg_comm_rank(sub) == 0 ? me : -1;
        CHECK_OK(dg_comm_broadcast(sub, &mine, 1, DG_I32, 0));
        first = mine;
        int highest = (n - 1) - ((n - 1) % 2 != me % 2);
        CHECK(first == highest, "group rank 0 is parent rank %d, expected %d", first, highest);
        dg_comm_free(sub);
    } else {
        CHECK(0, "split returned no comm for color %d", me % 2);
    }
    /* color < 0 opts out */
    CHECK_OK(dg_comm_split(c, me == 0 ? -1 : 1, 0, &o, &sub));
    CHECK((me == 0) == (sub == NULL), "rank %d: split with color -1 gave %p", me, (void *)sub);
    if (sub) {
        CHECK(dg_comm_size(sub) == n - 1, "opt-out split size %d", dg_comm_size(sub));
        CHECK_OK(dg_comm_barrier(sub));
        dg_comm_free(sub);
    }

    /* mesh: every dimension's group has the ranks along that line, group rank = coordinate */
    dg_mesh_shape_t sh = {{1, n, 1}, {DG_MESH_DP_REPLICATE, DG_MESH_DP_SHARD, DG_MESH_TP}};
    if (n == 4) sh.size[DG_MESH_DP_SHARD] = 2, sh.size[DG_MESH_TP] = 2;
    if (n == 8) sh.size[0] = 2, sh.size[1] = 2, sh.size[2] = 2;
    dg_comm_mesh_t *mesh = NULL;
    o.name = NULL;
    CHECK_OK(dg_comm_mesh_create(MPI_COMM_WORLD, &sh, DG_COMM_MPI, -1, NULL, &o, &mesh));
    if (mesh) {
        int coord[DG_MESH_NDIM];
        dg_mesh_coords(&sh, g_wrank, coord);
        for (int d = 0; d < DG_MESH_NDIM; d++) {
            dg_comm_t *dc = mesh->dim[d];
            CHECK(dg_comm_size(dc) == sh.size[d], "mesh dim %s size %d", dg_mesh_dim_name(d),
                  dg_comm_size(dc));
            CHECK(dg_comm_rank(dc) == coord[d], "mesh dim %s rank %d, coord %d", dg_mesh_dim_name(d),
                  dg_comm_rank(dc), coord[d]);
            CHECK(strcmp(dg_comm_name(dc), dg_mesh_dim_name(d)) == 0, "mesh dim name %s", dg_comm_name(dc));
            /* gather world ranks along the line and compare with the mesh arithmetic */
            int *got = calloc((size_t)sh.size[d], sizeof(int));
            CHECK_OK(dg_comm_allgather(dc, &g_wrank, got, 1, DG_I32));
            for (int k = 0; k < sh.size[d]; k++) {
                int cc[DG_MESH_NDIM];
                memcpy(cc, coord, sizeof cc);
                cc[d] = k;
                CHECK(got[k] == dg_mesh_rank(&sh, cc), "mesh dim %s member %d is world %d, expected %d",
                      dg_mesh_dim_name(d), k, got[k], dg_mesh_rank(&sh, cc));
                CHECK(dg_comm_world_rank_of(dc, k) == got[k], "world_rank_of");
            }
            free(got);
        }
        CHECK(dg_comm_size(mesh->dp) == sh.size[0] * sh.size[1], "dp size %d", dg_comm_size(mesh->dp));
        CHECK(dg_comm_size(mesh->world) == n, "mesh world size");
        dg_comm_mesh_free(mesh);
    }
    dg_mesh_shape_t badsh = {{1, n + 1, 1}, {0, 1, 2}};
    mesh = NULL;
    dg_status_t s = dg_comm_mesh_create(MPI_COMM_WORLD, &badsh, DG_COMM_MPI, -1, NULL, &o, &mesh);
    CHECK(s == DG_ERR_USAGE && mesh == NULL && strstr(dg_last_error(), "ranks but the job has"),
          "mesh size mismatch: %d %s", s, dg_last_error());
}

/* Bad arguments fail locally with a one-line DG_ERR_USAGE and do not disturb the group. */
static void test_bad_input(dg_comm_t *c) {
    int n = dg_comm_size(c), me = dg_comm_rank(c);
    float buf[16] = {0};
    uint16_t h[4] = {0};
    dg_comm_req_t *r = NULL;
#define BAD(expr, needle)                                                                                    \
    do {                                                                                                     \
        dg_status_t s_ = (expr);                                                                             \
        CHECK(s_ == DG_ERR_USAGE && strstr(dg_last_error(), needle) && !strchr(dg_last_error(), '\n'),       \
              "%s -> %d '%s' (expected '%s')", #expr, s_, dg_last_error(), needle);                          \
    } while (0)
    BAD(dg_comm_allreduce(c, h, h, 4, DG_F16, DG_RED_SUM), "reductions support f32, bf16, f64 and i32");
    BAD(dg_comm_allreduce(c, buf, buf, 4, DG_I32, DG_RED_AVG), "AVG of i32");
    BAD(dg_comm_allreduce(c, buf, buf + 1, 4, DG_F32, DG_RED_SUM), "partly overlap");
    BAD(dg_comm_allreduce(c, buf, buf, (size_t)INT_MAX + 1, DG_F32, DG_RED_SUM), "exceeds");
    BAD(dg_comm_broadcast(c, buf, 4, DG_F32, n), "is not a rank");
    BAD(dg_comm_send(c, buf, 4, DG_F32, me, 0), "must be another rank");
    BAD(dg_comm_reduce_scatter(c, buf, (char *)buf + 2, 1, DG_F32, DG_RED_SUM), "recv overlaps send");
    BAD(dg_comm_allreduce(c, buf, buf, 4, DG_F32, (dg_redop_t)7), "unknown reduction");
    BAD(dg_comm_allreduce(c, buf, buf, 4, (dg_dtype_t)42, DG_RED_SUM), "unknown dtype");
    BAD(dg_comm_allreduce(c, NULL, buf, 4, DG_F32, DG_RED_SUM), "send buffer is NULL");
    BAD(dg_comm_iallreduce(c, buf, buf, 4, DG_F32, DG_RED_SUM, NULL), "req is NULL");
    BAD(dg_comm_broadcast(c, buf, 4, DG_F32, -1), "is not a rank");
    BAD(dg_comm_irecv(c, buf, 4, DG_F32, n + 3, 0, &r), "must be another rank");
    if (n > 1) {
        BAD(dg_comm_send(c, buf, 4, DG_F32, (me + 1) % n, -3), "tag -3");
        BAD(dg_comm_allgather(c, buf + 1, buf, 2, DG_F32), "send overlaps recv");
    }
    dg_comm_opts_t o;
    dg_comm_opts_default(&o);
    o.timeout_s = 0;
    dg_comm_t *x = NULL;
    BAD(dg_comm_create_mpi(MPI_COMM_WORLD, &o, &x), "timeout_s must be > 0");
    BAD(dg_comm_create_mpi(MPI_COMM_NULL, NULL, &x), "MPI_COMM_NULL");
#ifndef DG_HAVE_CUDA
    BAD(dg_comm_create_nccl(MPI_COMM_WORLD, 0, NULL, NULL, &x), "built without CUDA");
#endif
    /* the group still works and its collective numbering was not disturbed by the rejected calls */
    int v = 1, sum = 0;
    CHECK_OK(dg_comm_allreduce(c, &v, &sum, 1, DG_I32, DG_RED_SUM));
    CHECK(sum == n, "allreduce after bad input: %d", sum);
    char st[256];
    dg_comm_state(c, st, sizeof st);
    CHECK(strstr(st, dg_comm_name(c)) != NULL, "state line '%s'", st);
    CHECK_OK(dg_comm_poll(c));
}

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    dg_test_mpi_init(&argc, &argv, &g_wrank, NULL);
    dg_log_init(g_wrank, "", DG_LOG_WARN, NULL);
    const dg_comm_progress_t modes[] = {DG_COMM_PROGRESS_AUTO, DG_COMM_PROGRESS_NONBLOCKING};
    for (int mi = 0; mi < 2; mi++) {
        dg_comm_opts_t o;
        dg_comm_opts_default(&o);
        o.name = "test";
        o.timeout_s = 60;
        o.progress = modes[mi];
        dg_comm_t *c = NULL;
        dg_status_t s = dg_comm_create_mpi(MPI_COMM_WORLD, &o, &c);
        CHECK(s == DG_OK, "create (%s): %s", mode_name(modes[mi]), dg_last_error());
        if (s != DG_OK) break;
        CHECK(strcmp(dg_comm_backend_name(c), "mpi") == 0 && dg_comm_kind(c) == DG_COMM_MPI, "backend name");
        dg_comm_set_step(c, 3);
        double t0 = MPI_Wtime();
        test_allreduce(c, modes[mi]);
        test_reduce_scatter(c, modes[mi]);
        test_allgather(c, modes[mi]);
        test_broadcast(c, modes[mi]);
        test_p2p(c, modes[mi]);
        test_fifo(c, modes[mi]);
        test_bad_input(c);
        test_split_and_mesh(c, modes[mi]);
        if (g_wrank == 0) printf("mode %s: %.2f s\n", mode_name(modes[mi]), MPI_Wtime() - t0);
        dg_comm_free(c);
    }
    /* the reduce-scatter's two algorithms in thread mode: MPI's, and the ring in 1 KiB segments (so that
     * every count above 256 f32 crosses segment boundaries) */
    for (int variant = 0; variant < 2; variant++) {
        dg_comm_opts_t o;
        dg_comm_opts_default(&o);
        o.name = variant ? "ring1k" : "rsmpi";
        o.timeout_s = 60;
        o.rs_mpi = variant == 0;
        if (variant) setenv("DG_COMM_RING_SEG_KB", "1", 1);
        dg_comm_t *c = NULL;
        dg_status_t s = dg_comm_create_mpi(MPI_COMM_WORLD, &o, &c);
        if (variant) unsetenv("DG_COMM_RING_SEG_KB");
        CHECK(s == DG_OK, "create (%s): %s", o.name, dg_last_error());
        if (s != DG_OK) break;
        dg_comm_set_step(c, 3);
        test_reduce_scatter(c, DG_COMM_PROGRESS_AUTO);
        test_fifo(c, DG_COMM_PROGRESS_AUTO);
        dg_comm_free(c);
    }
    int rc = tu_finish("test_comm_mpi");
    MPI_Finalize();
    return rc;
}
