/* cli_hooks.c — the training, --plan-only and --dry-run model sections of `dgtrain`, delegated to the
 * training loop module (src/train/train.h), which owns everything that needs the model graph. */
#include "cli_hooks.h"
#include "train.h"

dg_status_t dg_cli_train(dg_boot_t *boot, const dg_config_t *cfg) {
    return dg_train_run(boot, cfg);
}

dg_status_t dg_cli_plan_only(dg_boot_t *boot, const dg_config_t *cfg, int json) {
    return dg_train_plan_only(boot, cfg, json, stdout);
}
