/* dryrun.c — `dgtrain --dry-run`: a list of report sections printed in order by rank 0 (text), or as
 * the members of one JSON object (--json). Each section is collective (every rank calls it), so a
 * section may gather from all ranks. To add a section (the parallel plan, the memory estimate), add
 * a function and one row to k_sections.
 */
#include <inttypes.h>
#include <string.h>

#include "cli_hooks.h"
#include "train.h"

typedef dg_status_t (*section_fn)(dg_boot_t *b, const dg_config_t *cfg, int json, FILE *out);

typedef struct {
    const char *name; /* the JSON member name */
    section_fn fn;
} section_t;

static dg_status_t sec_run(dg_boot_t *b, const dg_config_t *cfg, int json, FILE *out) {
    if (b->world_rank != 0) return DG_OK;
    char hash[32];
    snprintf(hash, sizeof hash, "%016" PRIx64, dg_config_hash(cfg));
    const char *path = cfg->path[0] ? cfg->path : "(embedded defaults)";
    if (!json) {
        fprintf(out, "dgtrain %s dry run: config %s (hash %s), run %s in %s, world size %d\n",
                DG_VERSION_STRING, path, hash, cfg->run.name, cfg->run.dir, b->world_size);
        fprintf(out,
                "model %s, backend %s, comm %s, mesh %s, precision %s; %lld steps of %lld sequences "
                "(micro-batch %lld)\n",
                cfg->model.preset, cfg->parallel.backend, cfg->parallel.comm, cfg->parallel.mesh,
                cfg->train.precision, (long long)cfg->train.steps, (long long)cfg->train.global_batch,
                (long long)cfg->train.micro_batch);
        return DG_OK;
    }
    fprintf(out, "{\"version\":");
    dg_boot_json_string(out, DG_VERSION_STRING);
    fprintf(out, ",\"config\":");
    dg_boot_json_string(out, path);
    fprintf(out, ",\"config_hash\":");
    dg_boot_json_string(out, hash);
    fprintf(out, ",\"name\":");
    dg_boot_json_string(out, cfg->run.name);
    fprintf(out, ",\"dir\":");
    dg_boot_json_string(out, cfg->run.dir);
    fprintf(out, ",\"world_size\":%d}", b->world_size);
    return DG_OK;
}

static dg_status_t sec_topology(dg_boot_t *b, const dg_config_t *cfg, int json, FILE *out) {
    (void)cfg;
    if (!json && b->world_rank == 0) fprintf(out, "\n");
    return dg_boot_report(b, json, out);
}

/* model size, per-rank memory and the planner's view (src/train) */
static dg_status_t sec_plan(dg_boot_t *b, const dg_config_t *cfg, int json, FILE *out) {
    if (dg_cli_mesh_pp(cfg) > 1) return dg_cli_pipeline_report(b, cfg, json, NULL, out); /* no executor yet */
    return dg_train_dry_run_report(b, cfg, json, out);
}

static const section_t k_sections[] = {
    {"run", sec_run},
    {"topology", sec_topology},
    {"plan", sec_plan},
};

dg_status_t dg_cli_dry_run(dg_boot_t *b, const dg_config_t *cfg, int json, FILE *out) {
    int root = b->world_rank == 0;
    /* what training would refuse (a global batch larger than the data) is refused before any output */
    dg_status_t cs = dg_boot_agree(b, dg_train_dry_run_check(b, cfg));
    if (cs != DG_OK) return cs;
    if (json && root) fprintf(out, "{");
    for (size_t i = 0; i < sizeof k_sections / sizeof k_sections[0]; i++) {
        if (json && root) fprintf(out, "%s\"%s\":", i ? "," : "", k_sections[i].name);
        /* a failing section stops the report on every rank alike: sections are collective */
        dg_status_t s = dg_boot_agree(b, k_sections[i].fn(b, cfg, json, out));
        if (s != DG_OK) return s;
    }
    if (root) {
        fprintf(out, json ? "}\n" : "");
        fflush(out);
    }
    return DG_OK;
}
