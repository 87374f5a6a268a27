"""clitest.py — what the scripts of tests/cli share (cli_test.py, faults_test.py): the list of failed
checks, check(), and the command line and case runner of their main.

  check(cond, what)              a failed check is printed and appended to FAILS; returns cond
  parse_args(cases, *required)   --dgtrain (made absolute), --mpiexec, --mpiflags, --work-dir, the
                                 `required` options, and the case (one of `cases`); work_dir becomes the
                                 case's own empty directory WORK_DIR/CASE (":" -> "_")
  run_case(a, cases)             runs cases[a.case](), prints "CASE: passed|FAILED (N) in S s"; exit code
                                 1 when a check failed, else 0 with the work directory removed (kept with
                                 DGT_TEST_KEEP set)
"""
import argparse
import os
import shutil
import sys
import time

FAILS = []


def check(cond, what):
    if not cond:
        FAILS.append(what)
        print("FAIL:", what, file=sys.stderr)
    return cond


def parse_args(cases, *required):
    ap = argparse.ArgumentParser()
    ap.add_argument("--dgtrain", required=True)
    ap.add_argument("--mpiexec", required=True)
    ap.add_argument("--mpiflags", default="")
    ap.add_argument("--work-dir", required=True)
    for opt in required:
        ap.add_argument(opt, required=True)
    ap.add_argument("case", choices=sorted(cases))
    a = ap.parse_args()
    a.dgtrain = os.path.abspath(a.dgtrain)
    a.work_dir = os.path.join(os.path.abspath(a.work_dir), a.case.replace(":", "_"))
    shutil.rmtree(a.work_dir, ignore_errors=True)
    os.makedirs(a.work_dir)
    return a


def run_case(a, cases):
    t0 = time.time()
    cases[a.case]()
    print("%s: %s in %.1f s" % (a.case, "FAILED (%d)" % len(FAILS) if FAILS else "passed", time.time() - t0))
    if FAILS:
        return 1
    if not os.environ.get("DGT_TEST_KEEP"):
        shutil.rmtree(a.work_dir, ignore_errors=True)
    return 0
