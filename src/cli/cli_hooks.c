/* cli_hooks.c — the training, --plan-only and --dry-run model sections of `dgtrain`, delegated to the
 * training loop module (src/train/train.h), which owns everything that needs the model graph. */
#include "cli_hooks.h"
#include "train.h"

void dg_cli_resolve_model(dg_config_t *cfg) {
    dg_model_desc_t d;
    if (dg_train_model_desc(cfg, &d) != DG_OK) return;
    const struct {
        const char *key;
        int64_t cur;
        int val;
    } k[] = {{"model.n_layer", cfg->model.n_layer, d.n_layer},
             {"model.n_head", cfg->model.n_head, d.n_head},
             {"model.d_model", cfg->model.d_model, d.d_model},
             {"model.seq_len", cfg->model.seq_len, d.seq_len},
             {"model.vocab_size", cfg->model.vocab_size, d.vocab_size}};
    char src[64], v[24];
    snprintf(src, sizeof src, "preset %s", cfg->model.preset);
    for (size_t i = 0; i < sizeof k / sizeof *k; i++) {
        if (k[i].cur != 0) continue;
        snprintf(v, sizeof v, "%d", k[i].val);
        if (dg_config_set(cfg, k[i].key, v, src) != DG_OK) return;
    }
}

dg_status_t dg_cli_train(dg_boot_t *boot, const dg_config_t *cfg) {
    if (boot->world_rank == 0) {
        char path[DG_CFG_STR + 16];
        snprintf(path, sizeof path, "%s/config.ini", cfg->run.dir);
        if (dg_config_write_file(cfg, path) != DG_OK) DG_LOG_WARN("%s", dg_last_error());
    }
    return dg_train_run(boot, cfg);
}

dg_status_t dg_cli_plan_only(dg_boot_t *boot, const dg_config_t *cfg, int json, const char *pp_timeline) {
    if (pp_timeline || dg_cli_mesh_pp(cfg) > 1)
        return dg_cli_pipeline_report(boot, cfg, json, pp_timeline, stdout);
    return dg_train_plan_only(boot, cfg, json, stdout);
}
