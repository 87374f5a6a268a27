/* plot.h — SVG charts of one or more runs' metrics.jsonl (docs/design.md §1, README.md "Plots").
 *
 * Contract:
 *   - dg_plot_read reads RUN_DIR/metrics.jsonl: "step" lines give loss, lr, tok_per_s, step_ms,
 *     grad_norm and mfu; "val" lines give the val loss. Other events are skipped. A step that appears
 *     more than once (a rollback re-ran it) keeps its LAST value. A malformed or truncated line (e.g.
 *     the last line of a killed run) is counted and skipped, never fatal; null (non-finite) values are
 *     left out of the series. A missing or unreadable metrics file is DG_ERR_RUNTIME naming the path.
 *   - dg_plot_write writes one SVG per chart into out_dir (created if needed), each file written to a
 *     temporary name and renamed into place: loss.svg (train + val; log y when max/min > 10),
 *     lr.svg, tokens_per_s.svg, step_time.svg, grad_norm.svg, mfu.svg (percent). Several runs are
 *     overlaid in distinct colours with a legend naming each run (its directory's basename). A chart
 *     whose metric is absent from every run is not written; `note` (may be NULL) gets one line saying
 *     so. More than 2000 points in a series: per pixel column its first, lowest, highest and last point.
 *     DG_ERR_RUNTIME when out_dir cannot be created or a file cannot be written; DG_ERR_RUNTIME
 *     when no chart at all has data.
 *   - Pure C and stdio: no plotting stack.
 */
#ifndef DG_PLOT_H
#define DG_PLOT_H

#include <stdint.h>
#include <stdio.h>

#include "dg_common.h"

/* The series of one run, in this order. */
enum {
    DG_PLOT_LOSS,
    DG_PLOT_VAL_LOSS,
    DG_PLOT_LR,
    DG_PLOT_TOK_S,
    DG_PLOT_STEP_MS,
    DG_PLOT_GRAD_NORM,
    DG_PLOT_MFU,
    DG_PLOT_NSERIES
};

typedef struct {
    int64_t *step;
    double *v;
    int n, cap;
} dg_plot_series_t;

typedef struct {
    char name[128]; /* the run directory's basename: the legend entry */
    dg_plot_series_t s[DG_PLOT_NSERIES];
    int bad_lines; /* malformed or truncated lines skipped */
} dg_plot_run_t;

/* Reads run_dir/metrics.jsonl into *run (zeroed first). */
dg_status_t dg_plot_read(const char *run_dir, dg_plot_run_t *run);
void dg_plot_run_free(dg_plot_run_t *run);

/* Writes the charts of runs[0..nruns) into out_dir. *written (may be NULL) gets the chart count. */
dg_status_t dg_plot_write(const dg_plot_run_t *runs, int nruns, const char *out_dir, FILE *note,
                          int *written);

/* Reads each run directory and writes the charts: what the trainer calls at the end of a run. */
dg_status_t dg_plot_dirs(int ndirs, const char *const *dirs, const char *out_dir, FILE *note);

/* `dgtrain plot RUN_DIR [RUN_DIR...] [--out DIR]`; argv[0] is "plot". Returns the exit code
 * (0 written; 1 usage; 2 a run directory or its metrics unreadable, nothing to plot, or out dir
 * unwritable), printing one line on stderr for an error. */
int dg_plot_main(int argc, char **argv);

#endif
