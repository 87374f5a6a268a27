/* sla.h — the training SLA governor (docs/sla.md): per-run objectives from the [sla] config section, each
 * judged over windows of samples with hysteresis, and graded actions.
 *
 * The trainer (and the heartbeat and stability code) feed samples: dg_gov_sample(gov, objective, step,
 * value), or dg_gov_step_time for the adaptive step-time budget. Samples collect into tumbling windows of
 * `window` samples; a full window is reduced to one value (median for step_time, mean otherwise) and judged
 * against the objective's reference (dg_sla_ref.h). Hysteresis: a "per-step" objective (step_time,
 * tokens_per_s, exposed_comm, grad_sync_latency, overflow_rate, heartbeat_rtt) fires Level-1 after
 * fire_after violating windows in a row and clears after clear_after clean windows in a row; an "event"
 * objective (loss_spike, checkpoint_stall, checkpoint_success, recovery_time) fires on its first violating
 * window and clears on its first clean one. Level-2 (the objective's action, if not none) comes after
 * level2_after violating windows in a row (event objectives: with the Level-1), then the count restarts.
 *
 * Level-1: one event (dg_gov_event_t, level 1, action "warn") when an objective starts firing, and one
 * WARN log line, at most one per objective per warn_interval_s. Level-2: one event (level 2, the action)
 * and one WARN log line, every time. A clear: one event (level 0, action "clear"). The governor writes no
 * file: the event callback turns events into metrics lines (the trainer's: {"event":"sla",...}).
 *
 * Contracts: no MPI, no threads (one owner thread; the trainer feeds it from the training thread). The
 * returned action is this process's own verdict: the trainer agrees it across ranks (max) before acting.
 */
#ifndef DG_SLA_H
#define DG_SLA_H

#include <stdint.h>

#include "dg_common.h"
#include "dg_sla_ref.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    DG_SLA_STEP_TIME = 0,
    DG_SLA_TOKENS_PER_S,
    DG_SLA_EXPOSED_COMM,
    DG_SLA_GRAD_SYNC_LATENCY,
    DG_SLA_OVERFLOW_RATE,
    DG_SLA_LOSS_SPIKE,
    DG_SLA_HEARTBEAT_RTT,
    DG_SLA_CHECKPOINT_STALL,
    DG_SLA_CHECKPOINT_SUCCESS,
    DG_SLA_RECOVERY_TIME,
    DG_SLA_MEMORY_PLAN,
    DG_SLA_N
} dg_sla_obj_t;

/* Level-2 actions, ordered by severity: the ranks agree on the max. */
typedef enum {
    DG_SLA_ACT_NONE = 0,
    DG_SLA_ACT_CHECKPOINT = 1, /* checkpoint now, go on */
    DG_SLA_ACT_ROLLBACK = 2,   /* reload the last stable checkpoint (trn_rollback) */
    DG_SLA_ACT_REQUEUE = 3,    /* checkpoint, exit 75 (Slurm requeues) */
    DG_SLA_ACT_PAUSE = 4       /* checkpoint, exit 5 (DG_ERR_PAUSE: an operator looks) */
} dg_sla_action_t;

/* The objective's name ("step_time"), or NULL out of range; the index of a name, or -1. */
const char *dg_sla_obj_name(dg_sla_obj_t o);
int dg_sla_obj_find(const char *name);
/* The dimension an objective's reference must use (step_time: a ratio to the budget). */
dg_dim_t dg_sla_obj_dim(dg_sla_obj_t o);
/* 1 for the event objectives (hysteresis 1/1), 0 for the per-step ones. */
int dg_sla_obj_is_event(dg_sla_obj_t o);
/* "none", "checkpoint", "rollback", "requeue", "pause"; dg_sla_action_parse returns -1 when unknown. */
const char *dg_sla_action_name(dg_sla_action_t a);
int dg_sla_action_parse(const char *text);

typedef struct {
    int enabled;        /* 0: "off", no samples judged */
    dg_sla_ref_t ref;   /* the target */
    int window;         /* samples per window, >= 1 */
    dg_sla_action_t l2; /* Level-2 action */
} dg_sla_obj_cfg_t;

typedef struct {
    int enabled; /* sla.enabled: 0 = nothing judged */
    dg_sla_obj_cfg_t obj[DG_SLA_N];
    int fire_after, clear_after, level2_after; /* per-step objectives' hysteresis, in windows */
    double warn_interval_s;                    /* Level-1 log lines per objective at most this often */
    int warmup_steps;                          /* step_time: first steps of an attempt not judged */
    int budget_steps;                          /* step_time: recent steps the budget is the median of */
    double budget_floor_s;                     /* step_time: the budget judged is never below this */
} dg_sla_cfg_t;

/* The built-in defaults (docs/sla.md): what a run gets with an empty [sla] section. */
void dg_sla_cfg_defaults(dg_sla_cfg_t *c);
/* Set one objective from config text: ref "target, lower, upper, unit" or "off"; action one of the
 * action names. `where` names the source in errors (DG_ERR_USAGE). */
dg_status_t dg_sla_cfg_set(dg_sla_cfg_t *c, dg_sla_obj_t o, const char *where, const char *ref_text,
                           int window, const char *action_text);

typedef struct {
    dg_sla_obj_t objective;
    int level;              /* 1 warn, 2 act, 0 cleared */
    double value, target;   /* the window's value and the bound it crossed, canonical units */
    dg_sla_action_t action; /* level 2: the action; else NONE */
    int64_t step;
} dg_gov_event_t;
typedef void (*dg_gov_event_fn)(void *ctx, const dg_gov_event_t *ev);

typedef struct dg_gov dg_gov_t;

/* A governor for cfg (copied). `fn` (may be NULL) receives every event. */
dg_gov_t *dg_gov_create(const dg_sla_cfg_t *cfg, dg_gov_event_fn fn, void *ctx);
void dg_gov_free(dg_gov_t *g);
/* Replace the clock of the log rate limit (tests); NULL: dg_now_s. */
void dg_gov_set_clock(dg_gov_t *g, double (*now)(void));

/* Feed one sample (canonical units) of objective o at step. Returns the Level-2 action this sample
 * triggered (DG_SLA_ACT_NONE mostly). A disabled objective or a NaN sample is ignored. */
dg_sla_action_t dg_gov_sample(dg_gov_t *g, dg_sla_obj_t o, int64_t step, double value);
/* step_time: `seconds` of step `step`; `excluded` (a checkpoint or validation came just before, or
 * recovery) keeps it out of both the budget and the judgement, as are the first warmup_steps steps this
 * governor sees. The sample judged is seconds / budget, the budget being the median of the last
 * budget_steps accepted steps (steps not themselves over the bound), raised to budget_floor_s (a step of
 * milliseconds that doubles is noise, not a slow node); none is judged until 5 (or budget_steps if fewer)
 * steps are in the budget. */
dg_sla_action_t dg_gov_step_time(dg_gov_t *g, int64_t step, double seconds, int excluded);
/* The step-time budget now (s), NAN before it is learned. */
double dg_gov_budget(const dg_gov_t *g);

typedef struct {
    int64_t samples, windows, violating_windows, level1, level2;
    int firing;
} dg_gov_stats_t;
void dg_gov_stats(const dg_gov_t *g, dg_sla_obj_t o, dg_gov_stats_t *out);

#ifdef __cplusplus
}
#endif
#endif /* DG_SLA_H */
