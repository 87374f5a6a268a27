/* health_driver.c — a fake training loop for the health tests: each step "computes" (sleeps), all-reduces
 * a small vector (checked), and agrees on signals at the step boundary, exactly as the real loop uses
 * health.h. The test scripts (run_case.sh) stop, kill, hang and signal its ranks from outside.
 *
 * Usage: health_driver --dir DIR [--steps N] [--step-ms M] [--heartbeat S] [--timeout S]
 *                      [--slow-rank R --slow-step K --slow-ms M [--hang-after-slow 1]] [--ckpt-ms M]
 *                      [--resume-file F]
 *                      [--long-step K --long-ms M --expect S]
 *                      [--probe-ms START,STEADY,ALERT --floor S --mult X --rtt-min-ms M]
 * With --probe-ms/--floor/--mult/--rtt-min-ms the monitor starts through dg_health_create_opts (the
 * [health] figures) instead of dg_health_create(--heartbeat, --timeout).
 * --hang-after-slow 1: after its slow compute the slow rank enters "host code" and hangs there for good
 * (its peers have been waiting in the all-reduce for --slow-ms by then, so the stuck rank's last
 * activity change is younger than theirs).
 * At the end each rank logs "health stats: probes P sent S recv R alerts A period_ms X neighbours N".
 * With --resume-file, the "checkpoint" is the number of completed steps written to F (by rank 0, on a
 * signal stop and at the end) and a run starts from the number found there: enough to stand in for
 * dgtrain in the Slurm requeue tests.
 * Writes DIR/rank-R.pid at start, DIR/progress (last finished step, rank 0), DIR/logs/rank-R.log and
 * DIR/events.jsonl (rank 0's health events). Exit codes as dgtrain: 0 done, 75 stopped on a signal
 * after the (simulated) checkpoint, 1 bad arguments, 2 runtime failure; 3 comes from the watchdog.
 */
#define _GNU_SOURCE
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dg_common.h"
#include "dg_test_args.h"
#include "health.h"
#include "dg_test_mpi.h"

static void sleep_ms(double ms) {
    struct timespec ts = {(time_t)(ms / 1000), (long)((ms - 1000.0 * (double)(time_t)(ms / 1000)) * 1e6)};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static void write_small(const char *dir, const char *name, long long v) {
    char path[4096], tmp[4200];
    if (dir)
        snprintf(path, sizeof path, "%s/%s", dir, name);
    else
        snprintf(path, sizeof path, "%s", name);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fprintf(f, "%lld\n", v);
    fclose(f);
    rename(tmp, path);
}

static void event_sink(void *ctx, const char *fields) {
    FILE *f = ctx;
    fprintf(f, "{\"event\":\"health\",%s}\n", fields);
    fflush(f);
}

static void sla_sink(void *ctx, const char *fields) {
    FILE *f = ctx;
    fprintf(f, "{\"event\":\"sla\",%s}\n", fields);
    fflush(f);
}

static void log_stats(const dg_health_t *h) {
    dg_health_stats_t st;
    dg_health_get_stats(h, &st);
    DG_LOG_INFO("health stats: probes %llu sent %llu recv %llu alerts %llu period_ms %.1f neighbours %d "
                "rtt_ms %.3f liveness_s %.2f",
                (unsigned long long)st.probes, (unsigned long long)st.msgs_sent,
                (unsigned long long)st.msgs_recv, (unsigned long long)st.alerts, 1e3 * st.period_s,
                st.neighbours, 1e3 * st.rtt_s, st.liveness_s);
}

int main(int argc, char **argv) {
    const char *dir = NULL, *resume_file = NULL;
    long long steps = 50;
    double step_ms = 50, hb = 0.2, timeout = 3, ckpt_ms = 300, slow_ms = 0, long_ms = 0, expect_s = 0;
    long long long_step = -1;
    const char *probe_ms = NULL;
    double floor_s = -1, mult = -1, rtt_min_ms = -1;
    int slow_rank = -1, hang_after_slow = 0;
    long long slow_step = -1;
    const dg_arg_t opts[] = {{"--dir", DG_ARG_STR, &dir},
                             {"--steps", DG_ARG_LL, &steps},
                             {"--step-ms", DG_ARG_F64, &step_ms},
                             {"--heartbeat", DG_ARG_F64, &hb},
                             {"--timeout", DG_ARG_F64, &timeout},
                             {"--ckpt-ms", DG_ARG_F64, &ckpt_ms},
                             {"--slow-rank", DG_ARG_INT, &slow_rank},
                             {"--slow-step", DG_ARG_LL, &slow_step},
                             {"--slow-ms", DG_ARG_F64, &slow_ms},
                             {"--hang-after-slow", DG_ARG_INT, &hang_after_slow},
                             {"--resume-file", DG_ARG_STR, &resume_file},
                             {"--long-step", DG_ARG_LL, &long_step},
                             {"--long-ms", DG_ARG_F64, &long_ms},
                             {"--expect", DG_ARG_F64, &expect_s},
                             {"--probe-ms", DG_ARG_STR, &probe_ms},
                             {"--floor", DG_ARG_F64, &floor_s},
                             {"--mult", DG_ARG_F64, &mult},
                             {"--rtt-min-ms", DG_ARG_F64, &rtt_min_ms}};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "health_driver: option %s needs a value\n", a);
            return 1;
        }
        i++;
        const dg_arg_t *o = dg_arg_find(opts, sizeof opts / sizeof opts[0], a);
        if (!o) {
            fprintf(stderr, "health_driver: unknown option %s\n", a);
            return 1;
        }
        dg_arg_store(o, v);
    }
    if (!dir) {
        fprintf(stderr, "health_driver: --dir is required\n");
        return 1;
    }

    int rank = 0, size = 1;
    dg_test_mpi_init(&argc, &argv, &rank, &size);
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    char logdir[4096];
    snprintf(logdir, sizeof logdir, "%s/logs", dir);
    if (dg_log_init(rank, host, DG_LOG_INFO, logdir) != DG_OK) {
        fprintf(stderr, "health_driver: %s\n", dg_last_error());
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    dg_signals_install();
    char name[64];
    snprintf(name, sizeof name, "rank-%d.pid", rank);
    write_small(dir, name, (long long)getpid());

    dg_health_t *h = NULL;
    dg_status_t s;
    if (probe_ms || floor_s >= 0 || mult >= 0 || rtt_min_ms >= 0) {
        dg_health_opts_t o;
        dg_health_opts_default(&o);
        o.timeout_s = timeout;
        double a = 0, b = 0, c = 0;
        if (probe_ms && sscanf(probe_ms, "%lf,%lf,%lf", &a, &b, &c) == 3) {
            o.start_s = a / 1e3;
            o.steady_s = b / 1e3;
            o.alert_s = c / 1e3;
        }
        if (floor_s >= 0) o.liveness_floor_s = floor_s;
        if (mult >= 0) o.liveness_mult = mult;
        if (rtt_min_ms >= 0) o.rtt_alert_min_s = rtt_min_ms / 1e3;
        s = dg_health_create_opts(MPI_COMM_WORLD, rank, host, &o, &h);
    } else {
        s = dg_health_create(MPI_COMM_WORLD, rank, host, hb, timeout, &h);
    }
    /* Every rank gets the same answer for bad arguments, so they can all leave the same way. */
    if (s != DG_OK) {
        if (rank == 0) fprintf(stderr, "health_driver: %s\n", dg_last_error());
        MPI_Finalize();
        return s;
    }
    FILE *events = NULL;
    if (rank == 0) {
        char path[4096];
        snprintf(path, sizeof path, "%s/events.jsonl", dir);
        events = fopen(path, "a");
        if (events) {
            dg_health_set_event_sink(h, event_sink, events);
            dg_health_set_sla_sink(h, sla_sink, events);
        }
    }

    long long start = 0;
    if (resume_file) {
        if (rank == 0) {
            FILE *f = fopen(resume_file, "r");
            if (f) {
                if (fscanf(f, "%lld", &start) != 1) start = 0;
                fclose(f);
            }
        }
        MPI_Bcast(&start, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
        if (rank == 0)
            printf("health_driver: %s at step %lld of %lld with %d rank(s)\n",
                   start ? "resuming" : "starting", start, steps, size);
        fflush(stdout);
    }

    double buf[4];
    for (long long step = start; step < steps; step++) {
        dg_health_set_activity(h, step, "compute");
        sleep_ms(step_ms);
        if (rank == slow_rank && step == slow_step) {
            dg_health_set_activity(h, step, "slow compute");
            sleep_ms(slow_ms);
            if (hang_after_slow) {
                dg_health_set_activity(h, step, "host code");
                for (;;)
                    sleep_ms(1000);
            }
        }
        if (step == long_step) {
            /* every rank: one long phase without progress reports, announced with dg_health_expect */
            dg_health_set_activity(h, step, "long write");
            dg_health_expect(h, expect_s);
            sleep_ms(long_ms);
        }
        dg_health_set_wait_activity(h, step, "all-reduce grads");
        for (int k = 0; k < 4; k++)
            buf[k] = (double)(rank + 1) * (double)(k + 1) + (double)step;
        if (MPI_Allreduce(MPI_IN_PLACE, buf, 4, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD) != MPI_SUCCESS) {
            DG_LOG_ERROR("all-reduce failed at step %lld", step);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        for (int k = 0; k < 4; k++) {
            double want = (double)size * (size + 1) / 2 * (k + 1) + (double)size * (double)step;
            if (buf[k] != want) {
                DG_LOG_ERROR("all-reduce gave %g, expected %g at step %lld", buf[k], want, step);
                MPI_Abort(MPI_COMM_WORLD, 2);
            }
        }
        int sig = 0;
        dg_health_set_wait_activity(h, step, "agree stop");
        if (dg_health_agree_stop(h, MPI_COMM_WORLD, &sig) != DG_OK) {
            DG_LOG_ERROR("%s", dg_last_error());
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        if (rank == 0) write_small(dir, "progress", step);
        if (sig) {
            /* A chunked checkpoint writer reports progress as it goes. */
            for (double t = 0; t < ckpt_ms; t += 100) {
                dg_health_set_activity(h, step, "checkpoint write");
                sleep_ms(100);
            }
            if (rank == 0 && resume_file) write_small(NULL, resume_file, step + 1);
            DG_LOG_WARN("stopping on %s after step %lld with a checkpoint (exit 75)", dg_signal_name(sig),
                        step);
            dg_health_free(h);
            if (events) fclose(events);
            MPI_Finalize();
            return DG_ERR_SIGNAL;
        }
    }
    if (rank == 0 && resume_file) write_small(NULL, resume_file, steps);
    dg_health_set_activity(h, steps, "shutdown");
    log_stats(h);
    dg_health_free(h);
    DG_LOG_INFO("finished %lld steps", steps);
    if (events) fclose(events);
    MPI_Finalize();
    return 0;
}
