/* cli_hooks.c — training and --plan-only entry points of `dgtrain`. They are not built yet: this file
 * is replaced when the training loop and the planner land (the lead owns that change). Until then
 * both refuse with a usage error, which every rank reports identically. */
#include "cli_hooks.h"

dg_status_t dg_cli_train(dg_boot_t *boot, const dg_config_t *cfg) {
    (void)boot;
    (void)cfg;
    return DG_ERR(DG_ERR_USAGE, "training is not built yet (use --dry-run, --topology or --print-config)");
}

dg_status_t dg_cli_plan_only(dg_boot_t *boot, const dg_config_t *cfg, int json) {
    (void)boot;
    (void)cfg;
    (void)json;
    return DG_ERR(DG_ERR_USAGE, "training is not built yet: --plan-only has no planner to ask");
}
