/* commands.h — the tables of the `dgtrain` command line (commands.c), the one place a new command or
 * action is added:
 *   - subcommands: `dgtrain NAME ARGS...` where NAME is the first argument (plot, sample, report...): a
 *     tool of its own with its own flags, run without the training's MPI boot unless it boots itself;
 *     its main returns the process exit code (docs/design.md §1);
 *   - actions: the flags that replace training in a normal invocation (--print-config, --dry-run...),
 *     each with whether it takes --json and whether it needs MPI and the config.
 */
#ifndef DG_CLI_COMMANDS_H
#define DG_CLI_COMMANDS_H

#include <stdio.h>

typedef struct dg_cli_command {
    const char *name;                   /* first argument */
    const char *args;                   /* for --help: the arguments after the name */
    const char *summary;                /* for --help: one line */
    int (*main)(int argc, char **argv); /* argv[0] is the name */
} dg_cli_command_t;

typedef enum {
    DG_ACT_TRAIN = 0, /* no action flag */
    DG_ACT_PRINT_CONFIG,
    DG_ACT_PRINT_ENV,
    DG_ACT_DRY_RUN,
    DG_ACT_TOPOLOGY,
    DG_ACT_PLAN_ONLY,
    DG_ACT_COUNT
} dg_cli_action_t;

typedef struct dg_cli_action_def {
    dg_cli_action_t act;
    const char *flag;
    int json_ok;      /* --json goes with it */
    int no_mpi;       /* runs before (and without) MPI, like --help */
    const char *help; /* for --help, may hold newlines (continuation lines are indented) */
} dg_cli_action_def_t;

extern const dg_cli_command_t dg_cli_commands[];
extern const int dg_cli_n_commands;
extern const dg_cli_action_def_t dg_cli_actions[];
extern const int dg_cli_n_actions;

/* The subcommand named name, or NULL. */
const dg_cli_command_t *dg_cli_find_command(const char *name);
/* The action whose flag is `flag`, or NULL. */
const dg_cli_action_def_t *dg_cli_find_action(const char *flag);
/* --help's lists of subcommands and actions. */
void dg_cli_print_commands(FILE *out);
void dg_cli_print_actions(FILE *out);

#endif /* DG_CLI_COMMANDS_H */
