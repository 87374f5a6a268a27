/* commands.c — the tables of the `dgtrain` command line (commands.h). */
#include "commands.h"

#include <string.h>

#include "plot.h"
#include "report.h"
#ifdef DG_HAVE_SAMPLE
#include "dg_sample.h"
#endif

/* Subcommands: `dgtrain NAME ...`. Each module that brings one adds a line here. */
const dg_cli_command_t dg_cli_commands[] = {
    {"plot", "RUN_DIR [RUN_DIR...] [--out DIR]",
     "SVG charts of the runs' metrics.jsonl (default --out: the first RUN_DIR/plots)", dg_plot_main},
    {"report", "RUN_DIR [--json]",
     "the run's SLA objectives: targets, measured values, verdicts, sla events, recovery times (docs/sla.md)",
     dg_sla_report_main},
#ifdef DG_HAVE_SAMPLE
    {"sample", "CKPT_OR_RUN_DIR --prompt TEXT ...", "generate text from a checkpoint (docs/sampling.md)",
     dg_sample_main},
#endif
    {NULL, NULL, NULL, NULL}, /* end (keeps the array non-empty) */
};
const int dg_cli_n_commands = (int)(sizeof dg_cli_commands / sizeof dg_cli_commands[0]) - 1;

const dg_cli_action_def_t dg_cli_actions[] = {
    {DG_ACT_PRINT_CONFIG, "--print-config", 0, 0,
     "print the effective config, each value with its source\n(default, FILE:LINE or --set), and exit"},
    {DG_ACT_PRINT_ENV, "--print-env", 1, 1,
     "list every DG_* environment switch: name, type, default, current\nvalue (or unset), doc; test hooks of "
     "a build without them show\n'not compiled in' (no MPI; with --json one JSON document)"},
    {DG_ACT_DRY_RUN, "--dry-run", 1, 0,
     "boot, topology, binding, config hash, plan and memory fit; no training"},
    {DG_ACT_TOPOLOGY, "--topology", 1, 0,
     "the rank table and each node's sockets, cores, NUMA nodes, GPUs and NICs"},
    {DG_ACT_PLAN_ONLY, "--plan-only", 1, 0, "print the parallel plan and graph schedule per rank and exit"},
};
const int dg_cli_n_actions = (int)(sizeof dg_cli_actions / sizeof dg_cli_actions[0]);

const dg_cli_command_t *dg_cli_find_command(const char *name) {
    for (int i = 0; i < dg_cli_n_commands; i++)
        if (strcmp(dg_cli_commands[i].name, name) == 0) return &dg_cli_commands[i];
    return NULL;
}

const dg_cli_action_def_t *dg_cli_find_action(const char *flag) {
    for (int i = 0; i < dg_cli_n_actions; i++)
        if (strcmp(dg_cli_actions[i].flag, flag) == 0) return &dg_cli_actions[i];
    return NULL;
}

/* "  NAME  text" with the text's later lines indented under its first. */
static void print_item(FILE *out, const char *name, const char *text) {
    fprintf(out, "  %-22s  ", name);
    for (const char *p = text; *p; p++) {
        fputc(*p, out);
        if (*p == '\n') fprintf(out, "  %-22s  ", "");
    }
    fputc('\n', out);
}

void dg_cli_print_commands(FILE *out) {
    if (dg_cli_n_commands == 0) return;
    fprintf(out, "commands (dgtrain NAME --help for each):\n");
    for (int i = 0; i < dg_cli_n_commands; i++) {
        char head[64];
        snprintf(head, sizeof head, "%s %s", dg_cli_commands[i].name, dg_cli_commands[i].args);
        print_item(out, head, dg_cli_commands[i].summary);
    }
}

void dg_cli_print_actions(FILE *out) {
    fprintf(out, "actions (default: train):\n");
    for (int i = 0; i < dg_cli_n_actions; i++)
        print_item(out, dg_cli_actions[i].flag, dg_cli_actions[i].help);
}
