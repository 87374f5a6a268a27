/* cpu_pool.c — the CPU backend's worker threads: a small fork-join pool in which the calling thread
 * never waits for a worker that has not started.
 *
 * Why not OpenMP parallel regions: at the end of a region every team thread must reach the barrier,
 * so a worker that the kernel scheduler has not run yet (a loaded node, a thread woken from sleep)
 * holds the whole region up even when the caller has done all the work itself. A training step of a
 * small model is a few hundred short kernels, and on a busy machine those waits cost more than the
 * kernels. Here a job is a list of independent tasks that threads claim one at a time from a shared
 * counter; the caller claims too, and waits only for tasks that another thread has actually claimed.
 * A worker that wakes late finds nothing left and goes back to sleep.
 *
 * Determinism: which thread runs a task never matters, because every task writes its own outputs
 * and the task list depends only on the problem shape (README.md).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "backend_cpu_impl.h"

/* Idle polls of the job counter before a worker sleeps, and of the completion counter before the
 * caller sleeps. Kernels of one step follow each other within microseconds, so a short poll saves
 * the sleep/wake system calls between them; it is kept short (each poll is one `pause`, 10 ns on the
 * development machine and up to ~45 ns on other Xeons: 20-90 us for a worker) so that idle workers do
 * not take cores from other processes on a shared node. */
#define DG_POOL_WORKER_SPINS 2000
#define DG_POOL_CALLER_SPINS 4000

/* Test builds only (tests/backend/test_cpu_pool.c compiles this file with DG_CPU_POOL_TEST_DELAY=N):
 * widen the windows between publishing a job and opening its claims, and between a worker reading the
 * claim word and the job word, where a mix-up of two jobs would happen if the protocol allowed it. */
#ifdef DG_CPU_POOL_TEST_DELAY
#define DG_POOL_TEST_PAUSE()                                                                                 \
    do {                                                                                                     \
        for (volatile int z_ = 0; z_ < DG_CPU_POOL_TEST_DELAY; z_++)                                         \
            ;                                                                                                \
    } while (0)
#else
#define DG_POOL_TEST_PAUSE() ((void)0)
#endif

struct dg_cpu_pool {
    int nthreads; /* including the calling thread */
    int nstarted; /* worker threads running (nthreads - 1 once created) */
    pthread_t *threads;
    uint32_t gen; /* caller-private: generation of the last job */
    int worker_spins;

    /* The current job. `claim` holds (generation << 32) | the tasks claimed so far (from the front and
     * from the back, see DG_POOL_TWO_ENDED_MAX) and `job` holds
     * (generation << 32) | number of tasks; fn/arg are read by a worker only after it has claimed a task
     * of the generation it read them for (see claim_and_run). */
    _Alignas(64) _Atomic uint64_t claim;
    _Atomic uint64_t job;
    _Atomic(dg_cpu_task_fn) fn;
    _Atomic(void *) arg;

    _Alignas(64) _Atomic uint32_t done; /* tasks of the current job finished; futex word of the caller */
    _Atomic uint32_t caller_sleeping;

    _Alignas(64) _Atomic uint32_t ticket; /* bumped once per job; futex word of idle workers */
    _Atomic uint32_t sleepers;
    _Atomic uint32_t stop;
};

typedef struct {
    dg_cpu_pool_t *pool;
    int id;
} worker_arg_t;

static void futex_wait(_Atomic uint32_t *word, uint32_t expect) {
    /* Returns at once if *word != expect; spurious returns are fine, every caller re-checks. */
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, expect, NULL, NULL, 0);
}
static void futex_wake(_Atomic uint32_t *word, int n) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
}
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Which end of the task list a thread claims from. The calling thread takes tasks from the back, the
 * workers from the front, until the two meet: a job laid out as two groups of equal cost (matmul_bwd: the
 * weight-gradient tiles, then the input-gradient tiles, which are the same number of FLOPs) is then split
 * between two threads at the group boundary whatever the sizes of the tiles inside each group, where
 * claiming in one order can leave one thread with a large tile while the other idles. Any thread still
 * takes any task, so a thread that is late (or never comes) only means the others take more.
 * Jobs of at most DG_POOL_TWO_ENDED_MAX tasks encode both counts in the claim word (front in bits
 * 0-15, back in bits 16-31); larger ones are claimed from the front only, by everyone. */
#ifndef DG_POOL_TWO_ENDED_MAX
#define DG_POOL_TWO_ENDED_MAX 0xFFFF
#endif

/* Claim and run tasks of the current job until none is left (`back`: claim from the back end).
 * Why this is safe against a worker that reads a job just as the caller replaces it: the task count used
 * to validate a claim is read together with its generation (`job`), and a claim is a CAS of `claim` from
 * the (generation, front, back) value that was validated, so it succeeds only while that job is current
 * and that task unclaimed (both ends of a two-ended job live in the one word, so a front and a back
 * claim cannot both take the last task). A job cannot finish while one of its tasks is claimed and
 * unfinished, so the caller cannot overwrite fn/arg before the claimant has read them; and the acquire
 * that produced the claimed value (directly, or through the release sequence of the caller's store)
 * makes them visible. */
static void claim_and_run(dg_cpu_pool_t *p, int worker, int back) {
    uint64_t s = atomic_load_explicit(&p->claim, memory_order_acquire);
    for (;;) {
        DG_POOL_TEST_PAUSE();
        const uint64_t j = atomic_load_explicit(&p->job, memory_order_acquire);
        if ((uint32_t)(j >> 32) != (uint32_t)(s >> 32)) {
            /* the job descriptor belongs to another generation than the claim word we read: the caller
             * is publishing a new job (or has finished ours); read both again */
            uint64_t s2 = atomic_load_explicit(&p->claim, memory_order_acquire);
            if (s2 == s) return; /* a newer descriptor ahead of its claim word: not ours to run yet */
            s = s2;
            continue;
        }
        const uint32_t n = (uint32_t)j, low = (uint32_t)s;
        uint32_t i;
        uint64_t next;
        if (n <= DG_POOL_TWO_ENDED_MAX) {
            const uint32_t f = low & 0xFFFFu, b = low >> 16;
            if (f + b >= n) return;
            i = back ? n - 1 - b : f;
            next = back ? s + (1u << 16) : s + 1;
        } else {
            if (low >= n) return;
            i = low;
            next = s + 1;
        }
        if (!atomic_compare_exchange_weak_explicit(&p->claim, &s, next, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* s now holds the current value */
        dg_cpu_task_fn fn = atomic_load_explicit(&p->fn, memory_order_relaxed);
        void *arg = atomic_load_explicit(&p->arg, memory_order_relaxed);
        fn(arg, (int)i, worker);
        /* seq_cst pairs with the caller's store to caller_sleeping: one of the two sees the other */
        uint32_t d = atomic_fetch_add(&p->done, 1) + 1;
        if (d == n && atomic_load(&p->caller_sleeping)) futex_wake(&p->done, 1);
        s = atomic_load_explicit(&p->claim, memory_order_acquire);
    }
}

static void *worker_main(void *argp) {
    worker_arg_t wa = *(worker_arg_t *)argp;
    free(argp);
    dg_cpu_pool_t *p = wa.pool;
    uint32_t seen = 0; /* the pool is created with ticket 0 and no job */
    for (;;) {
        uint32_t t = atomic_load_explicit(&p->ticket, memory_order_acquire);
        for (int s = 0; t == seen && s < p->worker_spins; s++) {
            cpu_relax();
            t = atomic_load_explicit(&p->ticket, memory_order_acquire);
        }
        while (t == seen) {
            /* Announce, then re-check (both seq_cst), so a caller that bumps the ticket either sees a
             * sleeper and wakes it, or is seen here. */
            atomic_fetch_add(&p->sleepers, 1);
            t = atomic_load(&p->ticket);
            if (t == seen) futex_wait(&p->ticket, seen);
            atomic_fetch_sub(&p->sleepers, 1);
            t = atomic_load(&p->ticket);
        }
        seen = t;
        if (atomic_load(&p->stop)) break;
        claim_and_run(p, wa.id, 0);
    }
    return NULL;
}

dg_status_t dg_cpu_pool_create(int nthreads, dg_cpu_pool_t **out) {
    *out = NULL;
    if (nthreads < 1) nthreads = 1;
    dg_cpu_pool_t *p = calloc(1, sizeof *p);
    if (!p) return DG_ERR(DG_ERR_RUNTIME, "cpu backend: out of host memory creating the thread pool");
    p->nthreads = nthreads;
    p->worker_spins = DG_POOL_WORKER_SPINS;
    /* OMP_WAIT_POLICY is the knob users already set for OpenMP programs: honour its intent. */
    const char *wp = getenv("OMP_WAIT_POLICY");
    if (wp && !strcasecmp(wp, "passive")) p->worker_spins = 0;
    if (wp && !strcasecmp(wp, "active")) p->worker_spins = 100 * DG_POOL_WORKER_SPINS;
    atomic_init(&p->claim, 0);
    atomic_init(&p->job, 0);
    atomic_init(&p->fn, NULL);
    atomic_init(&p->arg, NULL);
    atomic_init(&p->done, 0);
    atomic_init(&p->caller_sleeping, 0);
    atomic_init(&p->ticket, 0);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->stop, 0);
    if (nthreads > 1) {
        p->threads = calloc((size_t)nthreads - 1, sizeof *p->threads);
        if (!p->threads) {
            free(p);
            return DG_ERR(DG_ERR_RUNTIME, "cpu backend: out of host memory creating the thread pool");
        }
    }
    for (int k = 1; k < nthreads; k++) {
        worker_arg_t *wa = malloc(sizeof *wa);
        int rc = ENOMEM;
        if (wa) {
            wa->pool = p;
            wa->id = k;
            rc = pthread_create(&p->threads[k - 1], NULL, worker_main, wa);
        }
        if (rc != 0) {
            free(wa);
            dg_cpu_pool_free(p);
            return DG_ERR(DG_ERR_RUNTIME,
                          "cpu backend: cannot start worker thread %d of %d (%s); hint: lower "
                          "parallel.threads or OMP_NUM_THREADS",
                          k, nthreads - 1, strerror(rc));
        }
        p->nstarted++;
    }
    *out = p;
    return DG_OK;
}

void dg_cpu_pool_free(dg_cpu_pool_t *p) {
    if (!p) return;
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->ticket, 1);
    futex_wake(&p->ticket, p->nthreads);
    for (int k = 0; k < p->nstarted; k++)
        pthread_join(p->threads[k], NULL);
    free(p->threads);
    free(p);
}

int dg_cpu_pool_threads(const dg_cpu_pool_t *p) {
    return p ? p->nthreads : 1;
}

void dg_cpu_pool_run(dg_cpu_pool_t *p, int ntasks, dg_cpu_task_fn fn, void *arg) {
    if (ntasks <= 0) return;
    if (!p || p->nthreads == 1 || ntasks == 1) {
        for (int i = 0; i < ntasks; i++)
            fn(arg, i, 0);
        return;
    }
    /* Order matters (claim_and_run): descriptor, then the job word, then the claim word that opens it. */
    atomic_store_explicit(&p->fn, fn, memory_order_relaxed);
    atomic_store_explicit(&p->arg, arg, memory_order_relaxed);
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    p->gen++;
    atomic_store_explicit(&p->job, ((uint64_t)p->gen << 32) | (uint32_t)ntasks, memory_order_release);
    DG_POOL_TEST_PAUSE();
    atomic_store_explicit(&p->claim, (uint64_t)p->gen << 32, memory_order_release);
    atomic_fetch_add(&p->ticket, 1);
    if (atomic_load(&p->sleepers) > 0) {
        int want = ntasks - 1 < p->nthreads - 1 ? ntasks - 1 : p->nthreads - 1;
        futex_wake(&p->ticket, want);
    }
    claim_and_run(p, 0, 1);
    /* Every task is claimed; wait only for those still running on workers. */
    const uint32_t n = (uint32_t)ntasks;
    for (int s = 0; s < DG_POOL_CALLER_SPINS; s++) {
        if (atomic_load_explicit(&p->done, memory_order_acquire) == n) return;
        cpu_relax();
    }
    atomic_store(&p->caller_sleeping, 1);
    uint32_t d;
    while ((d = atomic_load(&p->done)) != n)
        futex_wait(&p->done, d);
    atomic_store(&p->caller_sleeping, 0);
}

void dg_cpu_run(dg_cpu_t *cpu, int ntasks, dg_cpu_task_fn fn, void *arg) {
    if (ntasks > 1 && cpu->nt > 1 && !cpu->pool && !cpu->pool_failed) {
        if (dg_cpu_pool_create(cpu->nt, &cpu->pool) != DG_OK) {
            DG_LOG_WARN("%s; the CPU backend runs on 1 thread instead of %d (same results, slower)",
                        dg_last_error(), cpu->nt);
            dg_clear_error();
            cpu->pool_failed = 1;
        }
    }
    dg_cpu_pool_run(cpu->pool, ntasks, fn, arg);
}

/* A range or column job: the parts of [0, n) that part_task hands to fn. */
typedef struct {
    dg_cpu_range_fn fn;
    const void *arg;
    size_t n;
    int parts, cols; /* cols: dg_cpu_split's cut of whole 16-column groups, else dg_cpu_range's */
} part_job_t;

static void part_task(void *argp, int task, int worker) {
    (void)worker;
    const part_job_t *j = argp;
    size_t lo, hi;
    if (j->cols) {
        int c0, c1;
        dg_cpu_split((int)j->n, j->parts, task, 16, &c0, &c1);
        lo = (size_t)c0, hi = (size_t)c1;
    } else {
        dg_cpu_range(j->n, j->parts, task, &lo, &hi);
    }
    j->fn(j->arg, lo, hi);
}

void dg_cpu_run_range(dg_cpu_t *cpu, size_t n, int tasks, dg_cpu_range_fn fn, const void *arg) {
    part_job_t j = {fn, arg, n, tasks, 0};
    dg_cpu_run(cpu, tasks, part_task, &j);
}

void dg_cpu_run_cols(dg_cpu_t *cpu, int C, size_t work, dg_cpu_range_fn fn, const void *arg) {
    int groups = (C + 15) / 16, parts = work < DG_CPU_PAR_MIN ? 1 : cpu->nt < groups ? cpu->nt : groups;
    part_job_t j = {fn, arg, (size_t)C, parts, 1};
    dg_cpu_run(cpu, parts, part_task, &j);
}
