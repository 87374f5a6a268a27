/* cli_hooks.h — what the `dgtrain` executable (main.c) calls beyond boot and config: the training run,
 * the --plan-only report, and the --dry-run report. Every function is collective over boot->world and
 * returns a local status that main.c passes through dg_boot_agree, so a failure on one rank ends all.
 */
#ifndef DG_CLI_HOOKS_H
#define DG_CLI_HOOKS_H

#include <stdio.h>

#include "config.h"
#include "mpi_boot.h"

/* The model sizes left 0 (= take the preset's) set to the preset's values, source "preset NAME", so the
 * effective config, --print-config and RUN_DIR/config.ini show them. A model config that does not
 * resolve is left as it is (the action reports it). */
void dg_cli_resolve_model(dg_config_t *cfg);

/* Run training as configured (the default action). Rank 0 first writes RUN_DIR/config.ini (a failure
 * is a warning). */
dg_status_t dg_cli_train(dg_boot_t *boot, const dg_config_t *cfg);

/* --plan-only: print the parallel plan and graph schedule per rank (json = one JSON document). With pp > 1
 * in parallel.mesh (or a pp_timeline path): the pipeline report instead (pipeline_report.c), and the
 * simulated timeline as SVG into pp_timeline when not NULL. */
dg_status_t dg_cli_plan_only(dg_boot_t *boot, const dg_config_t *cfg, int json, const char *pp_timeline);

/* The pp of an explicit parallel.mesh (1 for auto or no pipeline). */
int dg_cli_mesh_pp(const dg_config_t *cfg);
/* The pipeline report of --plan-only / --dry-run for pp > 1: split, simulated schedule, per-stage memory,
 * the planner's verdict (rank 0 prints; json: one object); svg_path: the timeline picture. */
dg_status_t dg_cli_pipeline_report(dg_boot_t *boot, const dg_config_t *cfg, int json, const char *svg_path,
                                   FILE *out);

/* --dry-run: boot and topology report, config hash, and the further sections registered in dryrun.c
 * (plan, memory estimate...). Rank 0 writes to `out`; json = one JSON object with one member per
 * section. */
dg_status_t dg_cli_dry_run(dg_boot_t *boot, const dg_config_t *cfg, int json, FILE *out);

#endif
