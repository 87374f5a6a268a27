/* dgprep.c — the `dgprep` command: turn text files (or directories of them) into byte-level
 * (vocabulary 256) llm.c train and val shards for dgtrain. All the work is in dg_data_prep (prep.c);
 * this file is argument parsing and the report. Every failure is one line on stderr and exit 1. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data.h"

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: dgprep --out DIR [--val-fraction F] [--name NAME] [--shard-tokens N] [--quiet] FILE|DIR...\n"
        "\n"
        "Turn text into byte-level (vocabulary 256) llm.c token shards for dgtrain:\n"
        "  DIR/NAME_train_000000.bin ...  and  DIR/NAME_val_000000.bin ...\n"
        "Each file's bytes are one token each, files joined in the order given (a directory's regular\n"
        "files in name order; symlinks, hidden files, binary files and duplicates inside a directory\n"
        "are skipped). The last F of each file, from a line start, goes to the val split.\n"
        "\n"
        "  --out DIR          output directory (created if missing)\n"
        "  --val-fraction F   fraction of each file for validation, 0 <= F < 1 (default 0.1)\n"
        "  --name NAME        output file prefix (default 'default')\n"
        "  --shard-tokens N   at most N tokens per shard (default 100000000)\n"
        "  --quiet            no notes or progress on stderr\n"
        "  --help, --version\n"
        "\n"
        "A file is refused as binary when it has a NUL byte or more than %d%% control characters.\n"
        "Then set model.vocab_size = 256 and data.train / data.val to the globs printed at the end.\n",
        DG_PREP_MAX_CONTROL_PERCENT);
}

static int fail(const char *msg) {
    fprintf(stderr, "%s\n", msg);
    return 1;
}

/* "--opt value" or "--opt=value": the value, or NULL (with *err set) when it is missing. */
static const char *opt_value(int argc, char **argv, int *i, const char *name, int *err) {
    const char *a = argv[*i];
    size_t n = strlen(name);
    if (strncmp(a, name, n) != 0) return NULL;
    if (a[n] == '=') return a + n + 1;
    if (a[n] != 0) return NULL;
    if (*i + 1 >= argc) {
        fprintf(stderr, "dgprep: %s needs a value (see dgprep --help)\n", name);
        *err = 1;
        return NULL;
    }
    return argv[++*i];
}

int main(int argc, char **argv) {
    const char *out = NULL, *name = "default";
    double frac = 0.1;
    long long shard_tokens = 100000000LL;
    int quiet = 0, err = 0;
    const char **inputs = calloc((size_t)argc, sizeof *inputs);
    if (!inputs) return fail("dgprep: out of memory");
    int n_in = 0, only_files = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (only_files || a[0] != '-' || a[1] == 0) {
            inputs[n_in++] = a;
        } else if (!strcmp(a, "--")) {
            only_files = 1;
        } else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            free(inputs);
            return 0;
        } else if (!strcmp(a, "--version")) {
            printf("dgprep (dgtrain) %s\n", DG_VERSION_STRING);
            free(inputs);
            return 0;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            quiet = 1;
        } else if ((v = opt_value(argc, argv, &i, "--out", &err)) != NULL) {
            out = v;
        } else if ((v = opt_value(argc, argv, &i, "--name", &err)) != NULL) {
            name = v;
        } else if ((v = opt_value(argc, argv, &i, "--val-fraction", &err)) != NULL) {
            char *end;
            errno = 0;
            frac = strtod(v, &end);
            if (errno || end == v || *end || !(frac >= 0 && frac < 1)) {
                fprintf(stderr, "dgprep: --val-fraction expects a number with 0 <= F < 1, got '%s'\n", v);
                err = 1;
            }
        } else if ((v = opt_value(argc, argv, &i, "--shard-tokens", &err)) != NULL) {
            char *end;
            errno = 0;
            shard_tokens = strtoll(v, &end, 10);
            if (errno || end == v || *end || shard_tokens < 1 || shard_tokens > 2147483647LL) {
                fprintf(stderr, "dgprep: --shard-tokens expects an integer in [1, 2147483647], got '%s'\n",
                        v);
                err = 1;
            }
        } else if (!err) {
            fprintf(stderr, "dgprep: unknown option '%s' (see dgprep --help)\n", a);
            err = 1;
        }
        if (err) {
            free(inputs);
            return 1;
        }
    }
    if (!out) {
        free(inputs);
        return fail("dgprep: --out DIR is required (see dgprep --help)");
    }
    if (n_in == 0) {
        free(inputs);
        return fail("dgprep: no input files given (see dgprep --help)");
    }

    dg_prep_opts_t o = {.inputs = inputs,
                        .n_inputs = n_in,
                        .out_dir = out,
                        .name = name,
                        .val_fraction = frac,
                        .shard_tokens = shard_tokens,
                        .quiet = quiet,
                        .who = "dgprep"};
    dg_prep_result_t r;
    dg_status_t s = dg_data_prep(&o, &r);
    free(inputs);
    if (s != DG_OK) return fail(dg_last_error());
    printf("dgprep: %d file%s (%lld bytes%s) -> %lld train tokens in %d shard%s, %lld val tokens in %d "
           "shard%s\n",
           r.n_files, r.n_files == 1 ? "" : "s", (long long)r.in_bytes, r.n_skipped ? ", some skipped" : "",
           (long long)r.train_tokens, r.train_shards, r.train_shards == 1 ? "" : "s", (long long)r.val_tokens,
           r.val_shards, r.val_shards == 1 ? "" : "s");
    printf("  model.vocab_size = 256\n  data.train = %s\n", r.train_glob);
    if (r.val_glob[0])
        printf("  data.val = %s\n", r.val_glob);
    else
        printf("  (no val split: --val-fraction is 0 or the input too small)\n");
    return 0;
}
