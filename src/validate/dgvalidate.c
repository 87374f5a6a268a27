/* dgvalidate.c — the `dgvalidate` executable: qualify a cluster (or a repaired node) for dgtrain.
 *
 *   mpirun -n N dgvalidate [SLA.ini] [--run-dir DIR] [--checks LIST] [--set key=value ...]
 *   sbatch slurm/validate.sh [SLA.ini]
 *
 * Parses the command line, boots MPI the way dgtrain does, and hands over to dg_validate_run, whose
 * agreed exit code it returns (validate.h lists them).
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "mpi_boot.h"
#include "validate.h"
#include "dg_env.h"

#define DEFAULT_SLA "validation/sla.ini"

static void usage(FILE *out) {
    fprintf(
        out,
        "usage: mpirun -n N dgvalidate [SLA.ini] [options]     (default SLA: " DEFAULT_SLA ")\n"
        "       sbatch slurm/validate.sh [SLA.ini] [options]\n"
        "\n"
        "Qualifies a cluster or a repaired node for dgtrain: topology and binding, collectives (mpi, and\n"
        "nccl when built with CUDA), GEMM and memory bandwidth with stragglers, checkpoint storage, a short\n"
        "distributed training run against a 1-rank reference with checkpoint + resume, and heartbeats.\n"
        "Thresholds come from the SLA file (docs/validation.md).\n"
        "\n"
        "options:\n"
        "  --run-dir DIR           where the reports go (default runs/validate-<UTC time>);\n"
        "                          --set run.dir=DIR means the same\n"
        "  --checks LIST           comma-separated check names or prefixes (e.g. topology,comm.mpi,\n"
        "                          compute.cpu_gemm.stragglers); default: the SLA's validate.checks\n"
        "  --set validate.KEY=VAL  override a [validate] setting of the SLA file (repeatable)\n"
        "  --set SECTION.KEY=VAL   a dgtrain config key, e.g. topology.bind=none or topology.xml=FILE\n"
        "  --check                 only check the SLA file and the options (no MPI, nothing runs); exit 0\n"
        "                          or 1 with the first problem\n"
        "  --list                  list the checks' reference metrics and exit\n"
        "  --help, --version\n"
        "\n"
        "outputs: a table on stdout, DIR/validation.json, DIR/validation-junit.xml\n"
        "exit codes: 0 every check passed or was skipped; 1 bad input; 2 a check harness failed (ERROR);\n"
        "            3 aborted (a peer failed or timed out); 4 at least one check FAILED\n");
}

typedef struct {
    dg_validate_opts_t o;
    const char **sets;
    int help, version, list, check;
    char err[512];
} cli_t;

static int run_dir_from_sets(cli_t *c);

static int parse(int argc, char **argv, cli_t *c) {
    memset(c, 0, sizeof *c);
    c->sets = calloc((size_t)argc + 1, sizeof *c->sets);
    if (!c->sets) return -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = NULL;
#define OPT(name)                                                                                            \
    ((strcmp(a, name) == 0 && i + 1 < argc && (val = argv[++i], 1)) ||                                       \
     (strncmp(a, name "=", strlen(name) + 1) == 0 && (val = a + strlen(name) + 1, 1)))
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            c->help = 1;
        } else if (strcmp(a, "--version") == 0) {
            c->version = 1;
        } else if (strcmp(a, "--list") == 0) {
            c->list = 1;
        } else if (strcmp(a, "--check") == 0) {
            c->check = 1;
        } else if (OPT("--run-dir")) {
            c->o.run_dir = val;
        } else if (OPT("--checks")) {
            c->o.checks = val;
        } else if (OPT("--set")) {
            c->sets[c->o.nsets++] = val;
        } else if (strcmp(a, "--run-dir") == 0 || strcmp(a, "--checks") == 0 || strcmp(a, "--set") == 0) {
            snprintf(c->err, sizeof c->err, "%s: expected a value after it", a);
            return -1;
        } else if (a[0] == '-' && a[1]) {
            snprintf(c->err, sizeof c->err, "unknown option '%s' (dgvalidate --help lists the options)", a);
            return -1;
        } else if (c->o.sla_path) {
            snprintf(c->err, sizeof c->err, "more than one SLA file given ('%s' and '%s')", c->o.sla_path, a);
            return -1;
        } else {
            c->o.sla_path = a;
        }
#undef OPT
    }
    for (int i = 0; i < c->o.nsets; i++)
        if (!strchr(c->sets[i], '=') || c->sets[i][0] == '=') {
            snprintf(c->err, sizeof c->err, "--set '%s': expected section.key=value", c->sets[i]);
            return -1;
        }
    if (!c->o.sla_path) c->o.sla_path = DEFAULT_SLA;
    c->o.sets = c->sets;
    return run_dir_from_sets(c);
}

/* --set run.dir=DIR means what --run-dir DIR means (the reports go to DIR): the last one given wins
 * among the --set's; with --run-dir as well, both must name the same directory. */
static int run_dir_from_sets(cli_t *c) {
    const char *set_dir = NULL;
    for (int i = 0; i < c->o.nsets; i++)
        if (strncmp(c->sets[i], "run.dir=", 8) == 0) set_dir = c->sets[i] + 8;
    if (!set_dir) return 0;
    if (c->o.run_dir && strcmp(c->o.run_dir, set_dir) != 0) {
        snprintf(c->err, sizeof c->err,
                 "--run-dir '%.200s' and --set run.dir='%.200s' name different run directories; give one",
                 c->o.run_dir, set_dir);
        return -1;
    }
    c->o.run_dir = set_dir;
    return 0;
    return 0;
}

/* --check: what dg_validate_run would reject as bad input, without MPI (slurm/validate.sh runs it on
 * the batch host before launching anything). The dgtrain keys of --set are checked by the config
 * schema the same way. */
static int check_only(const cli_t *c) {
    dg_sla_t *sla = NULL;
    dg_status_t s = dg_sla_load(c->o.sla_path, &sla);
    const char **cfg_sets = calloc((size_t)c->o.nsets + 1, sizeof *cfg_sets);
    int n = 0;
    for (int i = 0; s == DG_OK && i < c->o.nsets; i++) {
        if (strncmp(c->o.sets[i], "validate.", 9) == 0)
            s = dg_sla_set(sla, c->o.sets[i]);
        else
            cfg_sets[n++] = c->o.sets[i];
    }
    if (s == DG_OK && c->o.checks) {
        char kv[600];
        snprintf(kv, sizeof kv, "validate.checks=%.500s", c->o.checks);
        s = dg_sla_set(sla, kv);
    }
    if (s == DG_OK) {
        dg_config_t *cfg = calloc(1, sizeof *cfg);
        s = cfg ? dg_config_load(cfg, NULL, n, cfg_sets) : DG_ERR(DG_ERR_RUNTIME, "out of memory");
        free(cfg);
    }
    free(cfg_sets);
    if (s != DG_OK) {
        fprintf(stderr, "dgvalidate: error: %s\n", dg_last_error());
        dg_sla_free(sla);
        return DG_ERR_USAGE;
    }
    printf("dgvalidate: %s is valid: %d node type%s, checks '%s'\n", c->o.sla_path, dg_sla_n_types(sla),
           dg_sla_n_types(sla) == 1 ? "" : "s", dg_sla_settings(sla)->checks);
    dg_sla_free(sla);
    return 0;
}

int main(int argc, char **argv) {
    cli_t cli;
    int bad = parse(argc, argv, &cli);
    if (!bad && cli.check) {
        int rc = dg_boot_launcher_rank() == 0 ? check_only(&cli) : 0;
        free(cli.sets);
        return rc;
    }
    if (!bad && (cli.help || cli.version || cli.list)) {
        if (dg_boot_launcher_rank() == 0) {
            if (cli.version) {
                printf("dgvalidate %s\n", DG_VERSION_STRING);
            } else if (cli.list) {
                static const char *dims[] = {"bandwidth", "flops", "time"};
                for (const dg_validate_metric_t *m = dg_validate_metrics(); m->name; m++)
                    printf("ref.%-36s %-9s %s\n", m->name, dims[m->dim], m->doc);
            } else {
                usage(stdout);
            }
        }
        free(cli.sets);
        return 0;
    }
    dg_boot_t *b = NULL;
    dg_status_t s = dg_boot_start("dgvalidate", &argc, &argv, &b);
    if (s != DG_OK) {
        free(cli.sets);
        return s;
    }
    int code;
    if (bad) {
        /* every rank parsed the same command line; rank 0 says it once */
        if (b->world_rank == 0)
            fprintf(stderr, "dgvalidate: error: %s\n", cli.err[0] ? cli.err : "out of memory");
        code = DG_ERR_USAGE;
    } else {
        code = dg_validate_run(b, &cli.o);
    }
    dg_log_close();
    dg_boot_finalize(b);
    free(cli.sets);
    return code;
}
