/* train.h — the training loop: the one place where boot, config, model graph, data, optimizer schedule,
 * metrics, health, signals and checkpoints meet. `dgtrain CONFIG` ends up in dg_train_run.
 *
 * Step anatomy (every rank, same order): agree on stop signals -> zero grads -> k micro-batches of
 * forward+backward (k = global_batch / (micro_batch * dp)) -> loss agreed over dp -> spike / non-finite
 * check -> clip + AdamW -> loader advance -> metrics, progress -> validation -> checkpoint.
 */
#ifndef DG_TRAIN_H
#define DG_TRAIN_H

#include <stdio.h>

#include "config.h"
#include "dg_common.h"
#include "model_desc.h"
#include "mpi_boot.h"
#include "train_util.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Train as configured; collective over boot->world. Returns the agreed exit status: DG_OK when the
 * run finished, DG_ERR_SIGNAL after a signal-driven checkpoint, DG_ERR_USAGE for bad input (config,
 * data, checkpoint), DG_ERR_RUNTIME for failures during training. */
dg_status_t dg_train_run(dg_boot_t *boot, const dg_config_t *cfg);

/* --plan-only: build the graph and memory plan (no weights) and print each rank's schedule; rank 0
 * prints, in rank order. Collective. */
dg_status_t dg_train_plan_only(dg_boot_t *boot, const dg_config_t *cfg, int json, FILE *out);

/* Extra --dry-run section: model size, parameter/gradient/optimizer bytes per rank, activation arena,
 * global batch arithmetic. Collective; rank 0 prints. */
dg_status_t dg_train_dry_run_report(dg_boot_t *boot, const dg_config_t *cfg, int json, FILE *out);

/* --dry-run's check of the data against the batch, before anything is printed: the shards' headers
 * and sizes (no token scan; the default data is built if needed) must yield at least one global batch
 * of training and of validation samples, as training requires. Rank 0 checks; the caller agrees. */
dg_status_t dg_train_dry_run_check(dg_boot_t *boot, const dg_config_t *cfg);

#ifdef __cplusplus
}
#endif
#endif
