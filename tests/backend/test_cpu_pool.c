/* test_cpu_pool.c — stress test of the CPU backend's worker pool (src/backend/cpu/cpu_pool.c): every
 * task of every job runs exactly once, with the right job's function and argument, and the call returns
 * only after all of them have finished, for any thread count, with job sizes that grow and shrink from
 * one job to the next (the case where a late worker could mistake a new job for the old one).
 *
 *   test_cpu_pool [--threads N[,N...]] [--jobs J]     exit 0 when every check passed
 *
 * The ctest builds cpu_pool.c with DG_CPU_POOL_TEST_DELAY, which widens the windows where two jobs could
 * be mixed up; a protocol error then shows as a task run twice or never, or as a hang, which the alarm
 * below turns into a failure.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend_cpu_impl.h"

#define MAX_TASKS 97

typedef struct {
    int id;                         /* which job this argument belongs to */
    int ntasks;                     /* its task count */
    int runs[MAX_TASKS];            /* runs of each task: written only by the thread running that task */
    int workers;                    /* threads in the pool */
    int bad_worker;                 /* a task saw a worker index outside [0, workers) */
    volatile float sink[MAX_TASKS]; /* keeps the busy work; one slot per task, like `runs` */
} job_t;

static void task(void *argp, int i, int worker) {
    job_t *j = argp;
    if (i < 0 || i >= j->ntasks) {
        j->bad_worker = 1000 + i; /* recorded as a failure below */
        return;
    }
    if (worker < 0 || worker >= j->workers) j->bad_worker = 1;
    /* a little work, more for some tasks, so that threads overlap and finish out of order */
    float s = 0.0f;
    for (int k = 0; k < 40 * (1 + (i * 7 + j->id) % 5); k++)
        s += (float)k * 0.5f;
    j->sink[i] = s;
    j->runs[i]++;
}

static void on_alarm(int sig) {
    (void)sig;
    static const char msg[] = "FAIL pool: a job did not finish within 60 s (lost task or wake-up)\n";
    if (write(1, msg, sizeof msg - 1) < 0) _exit(1);
    _exit(1);
}

static long stress(int threads, int jobs) {
    dg_cpu_pool_t *pool = NULL;
    if (dg_cpu_pool_create(threads, &pool) != DG_OK) {
        printf("FAIL pool: %s\n", dg_last_error());
        return 1;
    }
    if (dg_cpu_pool_threads(pool) != threads) {
        printf("FAIL pool: %d threads asked, %d reported\n", threads, dg_cpu_pool_threads(pool));
        dg_cpu_pool_free(pool);
        return 1;
    }
    /* Two argument blocks used alternately: a task of job k run with job k+1's argument (or twice, or
     * never) shows up as a wrong count in one of them. */
    job_t *a = calloc(2, sizeof *a);
    long failures = 0;
    unsigned rng = 12345;
    for (int k = 0; k < jobs; k++) {
        job_t *j = &a[k % 2];
        memset(j->runs, 0, sizeof j->runs);
        j->id = k;
        j->workers = threads;
        j->bad_worker = 0;
        /* sizes: mostly small, sometimes large, alternating up and down */
        rng = rng * 1103515245u + 12345u;
        j->ntasks = (k % 2) ? 1 + (int)((rng >> 16) % MAX_TASKS) : 1 + (int)((rng >> 16) % 4);
        dg_cpu_pool_run(pool, j->ntasks, task, j);
        /* the call has returned: every task must have run exactly once already */
        for (int i = 0; i < MAX_TASKS; i++) {
            int want = i < j->ntasks ? 1 : 0;
            if (j->runs[i] != want) {
                if (failures < 10)
                    printf("FAIL pool: job %d (%d tasks): task %d ran %d times\n", k, j->ntasks, i,
                           j->runs[i]);
                failures++;
            }
        }
        if (j->bad_worker) {
            if (failures < 10) printf("FAIL pool: job %d: bad task or worker index (%d)\n", k, j->bad_worker);
            failures++;
        }
    }
    dg_cpu_pool_free(pool);
    free(a);
    if (failures)
        printf("pool stress [%d threads, %d jobs]: %ld failures\n", threads, jobs, failures);
    else
        printf("pool stress [%d threads, %d jobs]: every task ran exactly once\n", threads, jobs);
    return failures;
}

int main(int argc, char **argv) {
    const char *list = "4";
    int jobs = 20000;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--threads"))
            list = argv[i + 1];
        else if (!strcmp(argv[i], "--jobs"))
            jobs = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: %s [--threads N[,N...]] [--jobs J]\n", argv[0]);
            return 2;
        }
    }
    signal(SIGALRM, on_alarm);
    alarm(60);
    long failures = 0;
    for (const char *p = list; *p;) {
        char *end;
        long t = strtol(p, &end, 10);
        if (end == p || t < 1 || t > 64) {
            fprintf(stderr, "test_cpu_pool: bad thread count list '%s'\n", list);
            return 2;
        }
        failures += stress((int)t, jobs);
        p = *end == ',' ? end + 1 : end;
    }
    return failures ? 1 : 0;
}
