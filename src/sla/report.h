/* report.h — `dgtrain report RUN_DIR [--json]` (docs/sla.md "The report"): one page on a run's SLA
 * objectives from RUN_DIR/metrics.jsonl and RUN_DIR/config.ini: each objective with its target, the
 * measured value (mean and p95 where it is a per-step series) and a verdict; every Level-1/Level-2 sla
 * event, agreed action and clear with its step; recovery times; checkpoint outcomes; how each attempt
 * ended. Reads only; no MPI. Exit 0, 1 usage, 2 missing or unreadable run directory. */
#ifndef DG_SLA_REPORT_H
#define DG_SLA_REPORT_H

int dg_sla_report_main(int argc, char **argv);

#endif
