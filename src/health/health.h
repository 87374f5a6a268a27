/* health.h — keeping a multi-rank job honest: signal-driven stops, a per-rank watchdog and heartbeats.
 *
 * Three things live here (docs/design.md §1 exit codes 3 and 75, docs/reliability.md):
 *
 * 1. Signals. dg_signals_install() makes SIGUSR1, SIGTERM and SIGINT set a flag instead of killing the
 *    process; the training loop calls dg_health_agree_stop() at each step boundary (one small MPI
 *    all-reduce), and when any rank saw a signal all ranks write a checkpoint and exit 75. A second
 *    SIGINT exits at once (exit 130) with a one-line message, for the impatient human at a terminal.
 *
 * 2. Watchdog. dg_health_create() starts one background thread per rank, on its own MPI_Comm_dup of the
 *    world. The loop calls dg_health_set_activity() whenever it starts something (a step phase, a
 *    collective); if a rank's activity has not changed for timeout_s the watchdog aborts the whole job.
 *    I/O activities (checkpoints: dg_health_set_io_activity) are judged by progress instead: bytes moved
 *    and collectives reached reset the timer, and a rank waiting for a peer that still progresses is not
 *    stalled; a job in which no rank progressed for timeout_s is.
 *
 * 3. Heartbeats (docs/health.md). Each rank probes its tree neighbours (a binary tree: parent (r-1)/2,
 *    children 2r+1, 2r+2): one tiny message to each per probe period, so O(1) messages per rank per
 *    period at any world size. The period adapts: opts.start_s at start, opts.steady_s after
 *    opts.good_probes good probes in a row, opts.alert_s after an anomaly (a late heartbeat, or a round
 *    trip above max(rtt_alert_factor x the measured mean, rtt_alert_min_s) plus the polling slack), which
 *    also raises one SLA Level-1 event (objective heartbeat_rtt) through the SLA sink, at most once per
 *    second per rank. Every heartbeat echoes the last send time it had from its destination, so each rank
 *    measures the round trip to each neighbour. A neighbour silent for longer than its liveness timeout,
 *    min(timeout_s, max(liveness_floor_s, liveness_mult x (period + highest recent round trip))), is
 *    stopped, hung or dead: the job is aborted naming it. Heartbeats carry the sender's step, activity
 *    and how long it has been in it; upwards with the summary of the sender's subtree, downwards with the
 *    job's summary made by rank 0 (who has made no progress for the longest, who has been silent for the
 *    longest). That lets a rank that is merely waiting in a collective blame the rank it waits for.
 *
 * Abort protocol (what happens when the watchdog fires): the detecting rank prints one line naming the
 * culprit rank, its host, what it was doing and for how long; calls the event sink (if any); sends an
 * abort notice to every other rank; then calls MPI_Abort(world, 3) after at most ~1 s. A rank that
 * receives the notice logs it (rank 0 also prints it and calls the sink) and _exit(3)s at once, so every
 * live rank exits 3 by itself. Under Open MPI's mpirun the job's exit status is 3 (measured: the
 * MPI_Abort errorcode or the first non-zero exit); ranks that cannot run (SIGSTOPped) are killed by the
 * launcher as part of MPI_Abort.
 *
 * Threading: requires MPI_THREAD_MULTIPLE (checked by dg_health_create). dg_health_set_activity is
 * lock-free for readers and cheap for the one thread that normally calls it (the training loop); it may
 * be called from several threads (they serialise on a spin flag). The event sink and poll hooks are
 * called from the health thread.
 *
 * Test hook (tests only, never set in production): with DG_TEST_STALL_RANK=R and DG_TEST_STALL_STEP=S in
 * the environment, rank R hangs forever (as a wedged kernel would) right after recording the first
 * activity of step S, with its health thread still running.
 */
#ifndef DG_HEALTH_H
#define DG_HEALTH_H

#include <mpi.h>
#include <stddef.h>
#include <stdint.h>

#include "dg_common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dg_health dg_health_t;

/* ---- signals (process-wide) ---- */

/* Install the handlers for SIGUSR1, SIGTERM and SIGINT (SA_RESTART). Idempotent. A handled signal only
 * records its number (the first one wins); a second SIGINT writes "dgtrain: second interrupt ..." to
 * stderr and _exit(130)s. */
void dg_signals_install(void);
/* The signal number recorded so far (SIGUSR1, SIGTERM or SIGINT), 0 if none. Async-signal-safe. */
int dg_signals_pending(void);
/* Forget a recorded signal (tests; a loop that chose to ignore it). */
void dg_signals_clear(void);
/* "SIGUSR1", "SIGTERM", "SIGINT", "signal N" (static storage for known ones; "none" for 0). */
const char *dg_signal_name(int sig);

/* ---- watchdog + heartbeats ---- */

/* The heartbeat figures ([health] keys; docs/health.md). Periods and times in seconds. */
typedef struct {
    double start_s, steady_s,
        alert_s;             /* probe periods: at start, after good_probes good ones, after an anomaly */
    int good_probes;         /* good probes in a row before the steady period (>= 1) */
    double rtt_alert_factor; /* a round trip above factor x the measured mean is an anomaly ... */
    double rtt_alert_min_s;  /* ... and above this (noise floor) */
    double liveness_floor_s; /* a silent neighbour is dead after max(floor, ...) */
    double liveness_mult;    /* ... mult x (its period + the highest recent round trip) */
    double timeout_s;        /* stall timeout, and the ceiling of the liveness timeout */
} dg_health_opts_t;

/* The defaults: 50/200/10 ms, 3 good probes, factor 8 above 250 ms, floor 5 s, multiplier 10, 120 s. */
void dg_health_opts_default(dg_health_opts_t *o);

/* Counters of this rank's heartbeat (for tests and the step metrics). */
typedef struct {
    uint64_t probes;    /* probe periods elapsed (rounds of heartbeats sent) */
    uint64_t msgs_sent; /* heartbeats sent (at most neighbours x probes, plus the byes) */
    uint64_t msgs_recv;
    uint64_t alerts;   /* anomalies seen (late heartbeats, round trips far above the measured ones) */
    double period_s;   /* the probe period now */
    double rtt_s;      /* the last neighbour's mean round trip */
    double liveness_s; /* the longest liveness timeout of a neighbour now */
    int neighbours;    /* tree neighbours (<= 3) */
} dg_health_stats_t;

/* Start the health monitor with the given figures (checked: DG_ERR_USAGE naming the key for a bad one;
 * timeout_s must be at least 3 x the longest period). Otherwise as dg_health_create. */
dg_status_t dg_health_create_opts(MPI_Comm world, int rank, const char *host, const dg_health_opts_t *opts,
                                  dg_health_t **out);

/* Start the health monitor. Collective over `world` (it duplicates it and gathers host names).
 * `rank` must be this process's rank in `world`, `host` its host name (used in messages).
 * heartbeat_s > 0 is the steady probe period (start and alert periods: the defaults, at most heartbeat_s;
 * liveness floor: min(5 s, 0.75 x timeout_s)); timeout_s >= 3 * heartbeat_s is how long a rank may make no
 * progress, or a peer may stay silent, before the job is aborted. Returns DG_ERR_USAGE for bad
 * periods and DG_ERR_RUNTIME when MPI is not at MPI_THREAD_MULTIPLE or a call fails. The stall timer
 * starts at creation with the activity (step 0, "startup"): whatever the caller does next (resume,
 * data setup) must set an activity or finish within timeout_s. */
dg_status_t dg_health_create(MPI_Comm world, int rank, const char *host, double heartbeat_s, double timeout_s,
                             dg_health_t **out);

/* Stop the monitor cleanly. Collective over the world communicator: it returns once every rank has
 * called it (each rank sends a final "bye" to rank 0, rank 0 answers after hearing from all), so no
 * heartbeat is left in flight and MPI_Finalize cannot hang on one. While it waits, silent peers are still
 * watched (a rank that never arrives because it died or hung still aborts the job after timeout_s);
 * this rank's own progress timer is off. Must be called from the thread that created the monitor,
 * before MPI_Finalize. NULL is a no-op. */
void dg_health_free(dg_health_t *h);

/* Record what this rank is doing now: `step` and a short label such as "forward" or
 * "all-reduce grad_norm" (truncated to 63 bytes). Every call resets this rank's stall timer, even if
 * step and label repeat. Cheap enough to call many times per step. NULL h is a no-op. */
void dg_health_set_activity(dg_health_t *h, int64_t step, const char *what);

/* The current activity (the last dg_health_set_activity) may legitimately take up to `seconds`, e.g. a
 * synchronous checkpoint write of a big model on a slow file system: this rank's stall limit becomes
 * max(timeout_s, seconds) until the next dg_health_set_activity. Heartbeats go on meanwhile, so a rank
 * that dies or is stopped is still noticed within timeout_s. Every rank that takes part in the long
 * activity should call it (a rank waiting for it in a collective is judged by timeout_s). */
void dg_health_expect(dg_health_t *h, double seconds);

/* Record an I/O activity (a checkpoint save or load), judged by progress rather than by the clock: the
 * stall timer of this rank is reset by the activity change and by every change of the progress source
 * (dg_health_set_progress_source: bytes written or read, collectives reached), and the rank counts as
 * stalled only when neither it nor any other rank of the job made progress for timeout_s (as rank 0's
 * heartbeat summary tells). So a rank waiting in a checkpoint collective for a peer that is still
 * writing is not stuck, however long the write takes, while a rank stuck in one (and every rank waiting
 * for it) is found within timeout_s. Cleared, like dg_health_expect, by the next set_activity. */
void dg_health_set_io_activity(dg_health_t *h, int64_t step, const char *what);

/* Record an activity in which this rank waits in a collective for its peers (an all-reduce, a step
 * agreement). Judged like dg_health_set_activity, but the waiting travels with the heartbeats: when the
 * job stalls, a rank that is not waiting (stuck in its own compute or host code) is blamed before the
 * ranks that wait for it, whichever stopped first by the clock (on a loaded node the waiter may have
 * arrived before the stuck rank's last activity change). Cleared by the next set_activity. */
void dg_health_set_wait_activity(dg_health_t *h, int64_t step, const char *what);

/* The progress source for I/O activities: fn(ctx, &waiting) returns a counter that grows while I/O moves
 * forward (e.g. dg_ckpt_progress) and sets *waiting to 1 while this rank waits in one of the I/O's
 * collectives. The waiting flag travels with the heartbeats: when the job is stuck in an I/O activity,
 * a rank that is not waiting is blamed before the ranks that wait for it. Called from the health thread
 * every poll tick; must be cheap and thread-safe. NULL removes it. */
void dg_health_set_progress_source(dg_health_t *h, uint64_t (*fn)(void *ctx, int *waiting), void *ctx);

/* Called once on the health thread when this rank takes part in a watchdog abort (it detected the stall
 * or was told by the rank that did), before the process exits: e.g. to remove the half-written file of
 * a checkpoint in flight. Must be quick; must not call MPI. NULL removes it. */
void dg_health_set_abort_hook(dg_health_t *h, void (*fn)(void *ctx), void *ctx);

/* Where `health` events go: fn(ctx, fields) with `fields` a comma-separated list of JSON members without
 * braces, e.g. "kind":"watchdog","culprit_rank":2,... ; the caller wraps it as {"event":"health",...}.
 * Called from the health thread (or the thread calling dg_health_agree_stop / dg_health_abort), right
 * before an abort, so fn must be thread-safe, quick, and flush what it writes. NULL fn removes it. */
void dg_health_set_event_sink(dg_health_t *h, void (*fn)(void *ctx, const char *json_fields), void *ctx);

/* Where SLA events go (objective heartbeat_rtt, Level 1): fn(ctx, fields) with fields the members of
 * {"event":"sla",...} without braces ("objective","level","value","target","action","step", then
 * "rank","peer_rank","reason"); values in ms. Called from the health thread; same rules as the event
 * sink. NULL fn removes it. */
void dg_health_set_sla_sink(dg_health_t *h, void (*fn)(void *ctx, const char *json_fields), void *ctx);

/* A snapshot of this rank's heartbeat counters (thread-safe; zeros for NULL h). */
void dg_health_get_stats(const dg_health_t *h, dg_health_stats_t *st);

/* A check the watchdog runs every poll tick (a quarter of the probe period, 2 ms to 0.1 s) on the health
 * thread, e.g. NCCL's asynchronous error query. Return 0 if all is well; otherwise write a one-line reason
 * into msg[cap] and return nonzero: the watchdog then aborts the job (exit 3) with that reason. At most 8
 * hooks. Returns DG_ERR_RUNTIME if there is no room. */
dg_status_t dg_health_add_poll(dg_health_t *h, int (*poll)(void *ctx, char *msg, size_t cap), void *ctx);

/* At a step boundary: one MPI_Allreduce (MAX) over `comm` of dg_signals_pending(). *stop_out becomes the
 * signal number if any rank recorded one (all ranks get the same value), else 0. When a stop is agreed,
 * an event "kind":"signal_stop" goes to the sink. `h` may be NULL (no activity/event bookkeeping).
 * Returns DG_ERR_RUNTIME if the all-reduce fails. */
dg_status_t dg_health_agree_stop(dg_health_t *h, MPI_Comm comm, int *stop_out);

/* Abort the whole job from this rank with exit code 3, through the same path as the watchdog: print
 * `reason` (one line), call the sink, notify every rank, MPI_Abort. For fatal conditions found outside
 * the watchdog (e.g. a peer-failure error from a collective). Never returns. */
void dg_health_abort(dg_health_t *h, const char *reason) __attribute__((noreturn));

#ifdef __cplusplus
}
#endif
#endif /* DG_HEALTH_H */
