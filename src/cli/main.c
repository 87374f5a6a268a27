/* main.c — the `dgtrain` executable: command line, MPI boot, config, logging, topology and binding,
 * then one action (--print-config, --topology, --dry-run, --plan-only, --export-topology, or training), or
 * a subcommand (`dgtrain NAME ...`). The actions and subcommands are the tables of commands.c.
 *
 * Every step that can fail on one rank only is followed by dg_boot_agree, so all ranks leave with the
 * same exit code (docs/design.md §1) and rank 0 prints the failing rank's one-line message.
 */
#define _GNU_SOURCE
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "cli_hooks.h"
#include "commands.h"
#include "config.h"
#include "dg_env.h"
#include "dg_fs.h"
#include "mpi_boot.h"

/* The run directory's lock (run.lock), held by rank 0 from before the first file is written into
 * run.dir until the process ends; the kernel drops it when the process dies, however it dies. */
static dg_fs_lock_t *g_rundir_lock;

typedef struct {
    const char *config;
    int nsets;
    const char **sets;
    int help, version, json, n_actions;
    dg_cli_action_t action; /* commands.c's action table; DG_ACT_TRAIN when no action flag is given */
    const char *export_topology;
    const char *pp_timeline; /* --pp-timeline FILE (with --plan-only) */
} cli_opts_t;

/* The options that are not actions (commands.c lists those). */
static const char *const k_options[] = {"--set",   "--help",       "--version", "--json", "--export-topology",
                                        "--trace", "--pp-timeline"};

static void usage(FILE *out) {
    fprintf(out,
            "usage: dgtrain [CONFIG.ini] [--set section.key=value ...] [ACTION] [--json]\n"
            "       mpirun -n N dgtrain CONFIG.ini ...   |   srun dgtrain CONFIG.ini ...\n"
            "       dgtrain COMMAND ARGS...\n"
            "\n"
            "Trains a decoder-only transformer across MPI ranks. With no CONFIG, the embedded defaults are "
            "used.\n"
            "Values come from the defaults, then CONFIG, then each --set in order (a later one wins).\n"
            "\n");
    dg_cli_print_commands(out);
    dg_cli_print_actions(out);
    fprintf(
        out,
        "  --export-topology FILE  write this node's hwloc topology as XML (one file per node:\n"
        "                          FILE, or FILE.<node id> when there are several nodes)\n"
        "options:\n"
        "  --set section.key=value override one key (repeatable; also --set=section.key=value)\n"
        "  --trace A:B             Chrome/Perfetto trace of steps A..B into run.dir/trace.json\n"
        "                          (= --set run.trace=A:B)\n"
        "  --pp-timeline FILE.svg  with --plan-only and pp > 1 in parallel.mesh: the simulated pipeline\n"
        "                          schedule as an SVG timeline (docs/parallelism.md)\n"
        "  --json                  with --print-env, --dry-run, --topology or --plan-only: one JSON\n"
        "                          document on stdout\n"
        "  --help, --version\n"
        "\n"
        "exit codes: 0 finished; 1 usage or config error; 2 runtime failure; 3 aborted because a peer\n"
        "failed or the watchdog fired; 4 checkpoints could not be saved (checkpoint.max_failures in a row,\n"
        "or the final or signal checkpoint: full or failing storage; do not requeue); 75 stopped on a\n"
        "signal after a complete checkpoint. All ranks agree.\n"
        "\n"
        "config keys ([section] in the INI file, section.key with --set):\n");
    dg_config_print_help(out);
}

static dg_status_t unknown_option(const char *a) {
    char name[64];
    snprintf(name, sizeof name, "%.*s", (int)strcspn(a, "="), a);
    const char *cands[32];
    int n = 0;
    for (size_t i = 0; i < sizeof k_options / sizeof *k_options; i++)
        cands[n++] = k_options[i];
    for (int i = 0; i < dg_cli_n_actions && n < 32; i++)
        cands[n++] = dg_cli_actions[i].flag;
    int bd = 1000, best = dg_closest(name, cands, n, &bd);
    if (best >= 0 && bd <= 3)
        return DG_ERR(DG_ERR_USAGE,
                      "unknown option '%s'; did you mean '%s'? (dgtrain --help lists the options)", name,
                      cands[best]);
    return DG_ERR(DG_ERR_USAGE, "unknown option '%s' (dgtrain --help lists the options)", name);
}

static const dg_cli_action_def_t *action_def(dg_cli_action_t a) {
    for (int i = 0; i < dg_cli_n_actions; i++)
        if (dg_cli_actions[i].act == a) return &dg_cli_actions[i];
    return NULL;
}

static dg_status_t parse_args(int argc, char **argv, cli_opts_t *o) {
    memset(o, 0, sizeof *o);
    o->sets = dg_xcalloc((size_t)argc + 1, sizeof *o->sets);
    int positional_only = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (positional_only || a[0] != '-' || strcmp(a, "-") == 0) {
            if (o->config)
                return DG_ERR(DG_ERR_USAGE,
                              "more than one config file given ('%s' and '%s'); expected at most one",
                              o->config, a);
            o->config = a;
        } else if (strcmp(a, "--") == 0) {
            positional_only = 1;
        } else if (strcmp(a, "--set") == 0) {
            if (i + 1 >= argc) return DG_ERR(DG_ERR_USAGE, "--set: expected section.key=value after it");
            o->sets[o->nsets++] = argv[++i];
        } else if (strncmp(a, "--set=", 6) == 0) {
            o->sets[o->nsets++] = a + 6;
        } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            o->help = 1;
        } else if (strcmp(a, "--version") == 0) {
            o->version = 1;
        } else if (dg_cli_find_action(a)) {
            o->action = dg_cli_find_action(a)->act;
            o->n_actions++;
        } else if (strcmp(a, "--trace") == 0 || strncmp(a, "--trace=", 8) == 0) {
            /* --trace A:B is --set run.trace=A:B (checked with the config); one of them, the last wins */
            static char set[96];
            const char *v = a[7] == '=' ? a + 8 : i + 1 < argc ? argv[++i] : NULL;
            if (!v || !*v) return DG_ERR(DG_ERR_USAGE, "--trace: expected A:B (steps A..B) after it");
            if (snprintf(set, sizeof set, "run.trace=%s", v) >= (int)sizeof set)
                return DG_ERR(DG_ERR_USAGE, "--trace '%s': expected A:B, e.g. 10:12", v);
            o->sets[o->nsets++] = set;
        } else if (strcmp(a, "--json") == 0) {
            o->json = 1;
        } else if (strcmp(a, "--pp-timeline") == 0 || strncmp(a, "--pp-timeline=", 14) == 0) {
            const char *v = a[13] == '=' ? a + 14 : i + 1 < argc ? argv[++i] : NULL;
            if (!v || !*v) return DG_ERR(DG_ERR_USAGE, "--pp-timeline: expected a FILE.svg after it");
            o->pp_timeline = v;
        } else if (strcmp(a, "--export-topology") == 0) {
            if (i + 1 >= argc || !*argv[i + 1])
                return DG_ERR(DG_ERR_USAGE, "--export-topology: expected a FILE after it");
            o->export_topology = argv[++i];
        } else if (strncmp(a, "--export-topology=", 18) == 0) {
            if (!a[18]) return DG_ERR(DG_ERR_USAGE, "--export-topology=: expected a FILE after '='");
            o->export_topology = a + 18;
        } else {
            return unknown_option(a);
        }
    }
    char flags[256] = "";
    const char *json_flags[16];
    int nj = 0;
    for (int i = 0; i < dg_cli_n_actions; i++) {
        size_t l = strlen(flags);
        snprintf(flags + l, sizeof flags - l, "%s%s",
                 i == 0                      ? ""
                 : i + 1 == dg_cli_n_actions ? " and "
                                             : ", ",
                 dg_cli_actions[i].flag);
        if (dg_cli_actions[i].json_ok && nj < 16) json_flags[nj++] = dg_cli_actions[i].flag;
    }
    if (o->n_actions > 1) return DG_ERR(DG_ERR_USAGE, "choose one of %s", flags);
    if (o->pp_timeline && o->action != DG_ACT_PLAN_ONLY)
        return DG_ERR(DG_ERR_USAGE, "--pp-timeline FILE goes with --plan-only");
    if (o->json && (o->action == DG_ACT_TRAIN || !action_def(o->action)->json_ok)) {
        char jl[256] = "";
        for (int i = 0; i < nj; i++) {
            size_t l = strlen(jl);
            snprintf(jl + l, sizeof jl - l, "%s%s", i == 0 ? "" : i + 1 == nj ? " or " : ", ", json_flags[i]);
        }
        return DG_ERR(DG_ERR_USAGE, "--json goes with %s", jl);
    }
    return DG_OK;
}

static dg_log_level_t log_level(const char *s) {
    if (strcmp(s, "error") == 0) return DG_LOG_ERROR;
    if (strcmp(s, "warn") == 0) return DG_LOG_WARN;
    if (strcmp(s, "debug") == 0) return DG_LOG_DEBUG;
    return DG_LOG_INFO;
}

/* Node leaders write the node's topology; several nodes get FILE.<node id>. */
static dg_status_t export_topology(dg_boot_t *b, const char *file) {
    if (b->local_rank != 0) return DG_OK;
    char path[4096];
    if (b->n_nodes > 1)
        snprintf(path, sizeof path, "%s.%d", file, b->node_id);
    else
        snprintf(path, sizeof path, "%s", file);
    const char *xml = strcmp(b->topo_source, "live") == 0 ? NULL : b->topo_source;
    DG_TRY(dg_topo_export_xml(xml, path));
    DG_LOG_INFO("wrote the topology of node %d (%s) to %s", b->node_id, b->host, path);
    return DG_OK;
}

static dg_status_t run(dg_boot_t *b, const cli_opts_t *o, dg_config_t *cfg) {
    DG_TRY(dg_boot_agree(b, dg_config_load(cfg, o->config, o->nsets, o->sets)));
    dg_cli_resolve_model(cfg);
    if (cfg->health.timeout_s > 0) b->agree_timeout_s = cfg->health.timeout_s;
    if (o->action == DG_ACT_PRINT_CONFIG) {
        if (b->world_rank == 0) {
            printf("# dgtrain %s effective configuration (hash %016" PRIx64 ")\n", DG_VERSION_STRING,
                   dg_config_hash(cfg));
            dg_config_print(cfg, stdout);
            fflush(stdout);
        }
        return DG_OK;
    }

    /* One run per run directory: rank 0 takes the lock before anything is written into run.dir (logs
     * included), and every rank leaves with its refusal (exit 1, naming the holder). Rank 0 alone: the
     * lock file sits on the run directory's file system, which every node sees. */
    dg_status_t s = DG_OK;
    if (b->world_rank == 0) {
        s = dg_mkdir_p(cfg->run.dir);
        /* a requeued job may wait for its earlier incarnation's lock, but not past the other ranks'
         * patience at the agreement below (health.timeout_s) */
        if (s == DG_OK)
            s = dg_fs_lock_rundir(cfg->run.dir, cfg->run.lock, 0.75 * b->agree_timeout_s, &g_rundir_lock);
    }
    DG_TRY(dg_boot_agree(b, s));
    s = dg_mkdir_p(cfg->run.dir);
    char logdir[DG_CFG_STR + 16];
    snprintf(logdir, sizeof logdir, "%s/logs", cfg->run.dir);
    if (s == DG_OK) s = dg_log_init(b->world_rank, b->host, log_level(cfg->run.log_level), logdir);
    DG_TRY(dg_boot_agree(b, s));
    DG_LOG_INFO("dgtrain %s: %d rank%s on %d node%s, config %s (hash %016" PRIx64 "), run dir %s",
                DG_VERSION_STRING, b->world_size, b->world_size == 1 ? "" : "s", b->n_nodes,
                b->n_nodes == 1 ? "" : "s", cfg->path[0] ? cfg->path : "(embedded defaults)",
                dg_config_hash(cfg), cfg->run.dir);

    DG_TRY(dg_boot_agree(b, dg_boot_topology(b, cfg)));
    DG_LOG_DEBUG("rank %d: node %d local rank %d/%d, gpu %s, numa %d, cpuset %s (%s), topology %s",
                 b->world_rank, b->node_id, b->local_rank, b->local_size,
                 b->gpu >= 0 ? b->topo.gpus[b->gpu].pci_busid : "none", b->numa, b->bound_cpuset,
                 b->bind_status, b->topo_source);

    if (o->export_topology) DG_TRY(dg_boot_agree(b, export_topology(b, o->export_topology)));
    if (o->action == DG_ACT_TOPOLOGY) {
        s = dg_boot_report(b, o->json, stdout);
        if (o->json && b->world_rank == 0) {
            printf("\n");
            fflush(stdout);
        }
        return dg_boot_agree(b, s);
    }
    if (o->action == DG_ACT_DRY_RUN) return dg_boot_agree(b, dg_cli_dry_run(b, cfg, o->json, stdout));
    if (o->action == DG_ACT_PLAN_ONLY)
        return dg_boot_agree(b, dg_cli_plan_only(b, cfg, o->json, o->pp_timeline));
    if (o->export_topology) return DG_OK; /* exporting alone is an action of its own */
    return dg_boot_agree(b, dg_cli_train(b, cfg));
}

int main(int argc, char **argv) {
    /* nothing dgtrain (or a library it calls: HDF5, hwloc) creates is world-writable, whatever the
     * umask it was started with (docs/reliability.md, "Run directory") */
    dg_fs_secure_umask();
    /* a subcommand (commands.c) is a tool of its own: its flags, its exit code */
    if (argc > 1) {
        const dg_cli_command_t *cmd = dg_cli_find_command(argv[1]);
        if (cmd) return cmd->main(argc - 1, argv + 1);
    }
    cli_opts_t o;
    dg_status_t ps = parse_args(argc, argv, &o);
    if (ps == DG_OK && (o.help || o.version)) {
        if (dg_boot_launcher_rank() == 0) {
            if (o.version)
                printf("dgtrain %s\n", DG_VERSION_STRING);
            else
                usage(stdout);
        }
        free(o.sets);
        return 0;
    }

    if (ps == DG_OK &&
        o.action == DG_ACT_PRINT_ENV) { /* no MPI, like --help: rank 0 lists, malformed values included */
        if (dg_boot_launcher_rank() == 0) {
            dg_env_print(stdout, o.json);
            fflush(stdout);
        }
        dg_status_t es = dg_env_check(NULL);
        if (es != DG_OK && dg_boot_launcher_rank() == 0)
            fprintf(stderr, "dgtrain: error: %s\n", dg_last_error());
        free(o.sets);
        return es;
    }
    dg_boot_t *b = NULL;
    dg_status_t s = dg_boot_start("dgtrain", &argc, &argv, &b);
    if (s != DG_OK) {
        free(o.sets);
        return s;
    }
    s = dg_boot_agree(b, ps);
    if (s == DG_OK) {
        dg_config_t *cfg = dg_xcalloc(1, sizeof *cfg);
        s = run(b, &o, cfg);
        free(cfg);
    }
    dg_log_close();
    dg_boot_finalize(b);
    dg_fs_lock_release(g_rundir_lock); /* last: every file of the run is closed */
    free(o.sets);
    return s;
}
