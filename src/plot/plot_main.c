/* plot_main.c — `dgtrain plot RUN_DIR [RUN_DIR...] [--out DIR]` and the trainer's end-of-run call. */
#define _GNU_SOURCE
#include "plot.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

dg_status_t dg_plot_dirs(int ndirs, const char *const *dirs, const char *out_dir, FILE *note) {
    dg_plot_run_t *runs = dg_xcalloc((size_t)ndirs, sizeof *runs);
    dg_status_t s = DG_OK;
    int nread = 0;
    for (; nread < ndirs && s == DG_OK; nread++) {
        s = dg_plot_read(dirs[nread], &runs[nread]);
        if (s == DG_OK && runs[nread].bad_lines && note)
            fprintf(note, "plot: %s/metrics.jsonl: skipped %d malformed or truncated line%s\n", dirs[nread],
                    runs[nread].bad_lines, runs[nread].bad_lines == 1 ? "" : "s");
    }
    int written = 0;
    if (s == DG_OK) s = dg_plot_write(runs, ndirs, out_dir, note, &written);
    if (s == DG_OK && note)
        fprintf(note, "plot: wrote %d chart%s to %s\n", written, written == 1 ? "" : "s", out_dir);
    for (int i = 0; i < nread; i++)
        dg_plot_run_free(&runs[i]);
    free(runs);
    return s;
}

static int usage_error(const char *msg, const char *arg) {
    fprintf(stderr, "dgtrain plot: error: %s%s%s (usage: dgtrain plot RUN_DIR [RUN_DIR...] [--out DIR])\n",
            msg, arg ? " " : "", arg ? arg : "");
    return DG_ERR_USAGE;
}

int dg_plot_main(int argc, char **argv) {
    const char *out = NULL;
    const char **dirs = dg_xcalloc((size_t)argc + 1, sizeof *dirs);
    int n = 0, rc = 0;
    for (int i = 1; i < argc && rc == 0; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            printf(
                "usage: dgtrain plot RUN_DIR [RUN_DIR...] [--out DIR]\n"
                "Writes SVG charts of each run's metrics.jsonl (loss, lr, tokens/s, step time, grad norm,\n"
                "MFU against step; several runs overlaid) into DIR (default: the first RUN_DIR/plots).\n");
            free(dirs);
            return 0;
        } else if (strcmp(a, "--out") == 0) {
            if (i + 1 >= argc || !*argv[i + 1])
                rc = usage_error("--out: expected a DIR after it", NULL);
            else
                out = argv[++i];
        } else if (strncmp(a, "--out=", 6) == 0) {
            if (!a[6])
                rc = usage_error("--out=: expected a DIR after '='", NULL);
            else
                out = a + 6;
        } else if (a[0] == '-' && a[1]) {
            rc = usage_error("unknown option", a);
        } else {
            dirs[n++] = a;
        }
    }
    if (rc == 0 && n == 0) rc = usage_error("expected at least one RUN_DIR", NULL);
    for (int i = 0; rc == 0 && i < n; i++) {
        struct stat st;
        if (stat(dirs[i], &st) != 0 || !S_ISDIR(st.st_mode)) {
            fprintf(stderr, "dgtrain plot: error: '%s' is not a run directory (no such directory)\n",
                    dirs[i]);
            rc = DG_ERR_RUNTIME;
        }
    }
    char def[4200];
    if (rc == 0 && !out) {
        snprintf(def, sizeof def, "%s/plots", dirs[0]);
        out = def;
    }
    if (rc == 0) {
        dg_status_t s = dg_plot_dirs(n, dirs, out, stderr);
        if (s) {
            fprintf(stderr, "dgtrain plot: error: %s\n", dg_last_error());
            rc = s;
        }
    }
    free(dirs);
    return rc;
}
