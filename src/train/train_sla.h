/* train_sla.h — private to src/train/: the trainer's side of the SLA governor (src/sla/sla.h,
 * docs/sla.md): [sla] config -> governor, sla events into metrics.jsonl, the samples the loop measures
 * (step time, tokens/s, checkpoint stall and outcome, recovery time), the agreed Level-2 action and the
 * recovery-time accounting of a resume.
 *
 * Contracts: every rank runs its own governor on its own samples; only rank 0's events reach
 * metrics.jsonl. The Level-2 verdict of a rank is kept in `pending` and agreed (MPI max) in the step
 * agreement, so every rank takes the same branch at the same step.
 */
#ifndef DG_TRAIN_SLA_H
#define DG_TRAIN_SLA_H

#include <stdint.h>

#include "sla.h"

struct trainer;

typedef struct {
    dg_gov_t *gov;
    int pending; /* this rank's most severe Level-2 verdict since the last agreement: action*16+objective */
    int agreed;  /* the same code agreed (max) by the ranks at the last step agreement (0: none) */
    int stop;    /* DG_SLA_ACT_REQUEUE / _PAUSE: the loop ends with a checkpoint and that exit */
    int exclude_next; /* the next step follows a checkpoint, validation or resume: not a step_time sample */
    double t_entry;   /* monotonic time dg_train_run was entered */
    double boot_s;    /* process start -> dg_train_run (MPI init, topology, binding); 0 for a later run in the
                         same process (dgvalidate's training check) */
    double plan_s;    /* setup: backend, mesh/plan, model, data */
    double read_s;    /* checkpoint read (resume) */
    int resumed, recovery_done;
    int64_t lost_steps, lost_tokens; /* work lost by the resume: -1 unknown */
    int64_t prev_step;               /* the step the previous attempt reached (metrics.jsonl), -1 unknown */
    double mem_planned;   /* dg_model_planned_bytes + the backend's reservations at creation: memory_plan's
                             reference */
    double mem_ratio_max; /* the highest step peak / plan so far (the done event) */
    void **leak;          /* test hook DG_TEST_MEM_LEAK_MB: the blocks kept to the end */
    int n_leak;
} trn_sla_t;

/* Seconds since this process started (/proc/self/stat), NAN when unknown. */
double trn_sla_process_age_s(void);
/* The governor for cfg's [sla] (DG_ERR_USAGE on a bad key: the schema checked them already). */
dg_status_t trn_sla_setup(struct trainer *tr);
void trn_sla_free(struct trainer *tr);
/* After a completed step: step_time (dt seconds) and tokens_per_s samples; the recovery event after the
 * first step of a resumed attempt. */
void trn_sla_after_step(struct trainer *tr, double dt, double tok_per_s);
/* A checkpoint save of the step loop: seconds it blocked the loop and whether it completed. */
void trn_sla_note_save(struct trainer *tr, double blocked_s, int ok);
/* Any objective's sample (the heartbeat and stability code feed theirs through this). */
void trn_sla_feed(struct trainer *tr, dg_sla_obj_t o, double value);
/* After a step: the overflow rate of its gradients (NaN: the update did not run), the loss z-score the
 * stability code judged (tr->stab.loss_z; not when `spike`: the stability code took the step as a spike
 * and its validation, rollback and Level-2 event answer it) and the heartbeat's last round trip. */
void trn_sla_feed_step_health(struct trainer *tr, double overflow_rate, int spike);
/* The action agreed at the step agreement: checkpoint or roll back now (*st gets the outcome), or
 * (requeue/pause) set `stop` and return 1: the loop ends, finish_loop checkpoints and exits 75 / 5. */
int trn_sla_act(struct trainer *tr, int *st);
/* After trn_maybe_resume (read_s: its seconds): a resumed attempt records the read time and (rank 0) the
 * work lost: the previous attempt's last step line in RUN_DIR/metrics.jsonl minus the checkpoint's step
 * and tokens (-1 when metrics.jsonl holds no step line: unknown). */
void trn_sla_resumed(struct trainer *tr, double read_s);
/* The memory_plan objective around a step: begin restarts the backend's peak window; end feeds the step's
 * peak of device memory over the plan (the test hook DG_TEST_MEM_LEAK_MB allocates inside the window). */
void trn_sla_mem_begin(struct trainer *tr);
void trn_sla_mem_end(struct trainer *tr);
/* Test hook: DG_TEST_SLOW_RANK sleeps DG_TEST_SLOW_MS in every step from DG_TEST_SLOW_STEP (1-based). */
void trn_sla_test_slow(struct trainer *tr, int64_t step);
/* The previous attempt's last step and tokens from RUN_DIR/metrics.jsonl (rank 0; -1 when unknown). */
void trn_sla_prev_attempt(const char *run_dir, int64_t *step, int64_t *tokens);

#endif
