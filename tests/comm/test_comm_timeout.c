/* test_comm_timeout.c — the failure path: one rank stalls (sleeps far longer than the timeout) before a
 * collective, the others' wait must fail after timeout_s with DG_ERR_PEER and a one-line message that
 * names the collective, the group, the step and the rank that did not arrive; each of them then ends
 * the job with dg_comm_abort(c, 3). The ctest driver (expect_exit.cmake) checks that mpiexec exits 3,
 * promptly (long before the stalled rank would wake up), and that the message was printed.
 *
 * usage: test_comm_timeout KIND TIMEOUT_S STALL_RANK [thread|nonblocking]
 *   KIND: allreduce | reduce_scatter | reduce_scatter_ring | allgather | mismatch | recv
 *   reduce_scatter_ring: 64 Ki floats per rank, so that the comm layer's ring runs at any group size
 *   mismatch: the stalled rank posts a broadcast where the others post an all-reduce (then stalls)
 *   recv: every rank but STALL_RANK waits for a message that STALL_RANK never sends
 *   blocking: the others call the BLOCKING all-reduce, which runs inline inside MPI and cannot return;
 *     the comm thread must report the timeout and end the job with exit 3 by itself
 *   late: STALL_RANK posts the all-reduce 0.3 s after the others' deadline, while they probe who is
 *     missing: it must be named as late, not counted as arrived ("did not arrive: none")
 * Exit: 3 via MPI_Abort when the failure was detected and reported as expected; 2 when the message was
 * not what it should be; 0 must never happen.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm.h"
#include "comm_test_util.h"
#include "dg_test_mpi.h"

int main(int argc, char **argv) {
    int wsize = 0;
    dg_test_mpi_init(&argc, &argv, &g_wrank, &wsize);
    dg_log_init(g_wrank, "", DG_LOG_INFO, NULL);
    dg_log_set_stderr_all_ranks(1);
    if (argc < 4) {
        fprintf(stderr, "usage: %s KIND TIMEOUT_S STALL_RANK [thread|nonblocking]\n", argv[0]);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    const char *kind = argv[1];
    double timeout = atof(argv[2]);
    int stall = atoi(argv[3]);
    int nb = argc > 4 && strcmp(argv[4], "nonblocking") == 0;

    dg_comm_opts_t o;
    dg_comm_opts_default(&o);
    o.name = "stalltest";
    o.timeout_s = timeout;
    o.progress = nb ? DG_COMM_PROGRESS_NONBLOCKING : DG_COMM_PROGRESS_THREAD;
    dg_comm_t *c = NULL;
    if (dg_comm_create_mpi(MPI_COMM_WORLD, &o, &c) != DG_OK) {
        fprintf(stderr, "create: %s\n", dg_last_error());
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    /* collective #1 succeeds everywhere */
    float one = 1, sum = 0;
    if (dg_comm_allreduce(c, &one, &sum, 1, DG_F32, DG_RED_SUM) != DG_OK || sum != (float)wsize) {
        fprintf(stderr, "warm-up allreduce: %s\n", dg_last_error());
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    dg_comm_set_step(c, 7);

    size_t n = strcmp(kind, "reduce_scatter_ring") == 0 ? 65536 : 1000;
    float *send = calloc(n * (size_t)wsize, sizeof(float)), *recv = calloc(n * (size_t)wsize, sizeof(float));
    int late = strcmp(kind, "late") == 0;
    if (g_wrank == stall) {
        if (late) { /* arrive after the others' deadline, during their probe, then wait to be killed */
            usleep((useconds_t)((timeout + 0.3) * 1e6));
            dg_comm_req_t *r = NULL;
            dg_comm_iallreduce(c, send, recv, n, DG_F32, DG_RED_SUM, &r);
        }
        if (strcmp(kind, "mismatch") == 0) {
            dg_comm_req_t *r = NULL;
            dg_comm_ibroadcast(c, send, 5, DG_F32, 0, &r);
        }
        /* the stalled rank: asleep far longer than the test may take; the job abort must kill it */
        sleep(600);
        fprintf(stderr, "rank %d woke up: the job was not aborted\n", g_wrank);
        return 0;
    }
    if (strcmp(kind, "blocking") == 0) {
        dg_status_t sb = dg_comm_allreduce(c, send, recv, n, DG_F32, DG_RED_SUM);
        fprintf(stderr, "rank %d: BAD: the blocking allreduce returned %d (%s) instead of ending the job\n",
                g_wrank, sb, dg_last_error());
        dg_comm_abort(c, 2);
    }
    dg_comm_req_t *r = NULL;
    dg_status_t s;
    const char *opname = kind;
    if (strncmp(kind, "reduce_scatter", 14) == 0) {
        opname = "reduce_scatter";
        s = dg_comm_ireduce_scatter(c, send, recv, n, DG_F32, DG_RED_SUM, &r);
    } else if (strcmp(kind, "allgather") == 0)
        s = dg_comm_iallgather(c, send, recv, n, DG_F32, &r);
    else if (strcmp(kind, "recv") == 0)
        s = dg_comm_irecv(c, recv, n, DG_F32, stall, 9, &r);
    else {
        opname = "allreduce";
        s = dg_comm_iallreduce(c, send, recv, n, DG_F32, DG_RED_SUM, &r);
    }
    double t0 = dg_now_s();
    if (s == DG_OK) s = dg_comm_wait(c, r);
    double el = dg_now_s() - t0;
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", dg_last_error());
    int ok = s == DG_ERR_PEER;
    CHECK(s == DG_ERR_PEER, "wait returned %d, expected DG_ERR_PEER (3): %s", s, msg);
    CHECK(strchr(msg, '\n') == NULL, "message is not one line");
    CHECK(strstr(msg, opname) != NULL, "message does not name the operation %s: %s", opname, msg);
    CHECK(strstr(msg, "stalltest") != NULL, "message does not name the group: %s", msg);
    CHECK(strstr(msg, "at step 7") != NULL, "message does not name the step: %s", msg);
    CHECK(el >= timeout * 0.95 && el < timeout + 8.0, "failed after %.2f s with timeout %.2f s", el, timeout);
    char want[128];
    if (strcmp(kind, "recv") == 0) {
        snprintf(want, sizeof want, "peer %d (world %d) is idle after collective #1", stall, stall);
    } else if (late) {
        snprintf(want, sizeof want, "ranks that did not arrive: %d (world %d, arrived ", stall, stall);
    } else if (strcmp(kind, "mismatch") == 0) {
        snprintf(want, sizeof want,
                 "MISMATCHED collective #2 (schedules differ): rank %d (world %d) posted broadcast", stall,
                 stall);
    } else {
        snprintf(want, sizeof want, "ranks that did not arrive: %d (world %d, at collective #1, step 7)",
                 stall, stall);
    }
    CHECK(strstr(msg, want) != NULL, "message lacks '%s': %s", want, msg);
    /* the comm is now unusable, and says so at once */
    float x = 0;
    double t1 = dg_now_s();
    dg_status_t s2 = dg_comm_allreduce(c, &x, &x, 1, DG_F32, DG_RED_SUM);
    CHECK(s2 == DG_ERR_PEER && dg_now_s() - t1 < 1.0 &&
              strstr(dg_last_error(), "unusable after an earlier failure"),
          "post after failure: %d %s", s2, dg_last_error());
    CHECK(dg_comm_poll(c) == DG_ERR_PEER, "poll after failure");
    char st[512];
    dg_comm_state(c, st, sizeof st);
    CHECK(strstr(st, "failed") != NULL, "state after failure: %s", st);
    DG_LOG_ERROR("%s", msg);
    if (g_fail || !ok) {
        fprintf(stderr, "rank %d: BAD TIMEOUT REPORT (%d failed checks)\n", g_wrank, g_fail);
        dg_comm_abort(c, 2);
    }
    fprintf(stderr, "rank %d: timeout detected after %.2f s as expected; aborting the job with exit 3\n",
            g_wrank, el);
    dg_comm_abort(c, DG_ERR_PEER);
}
