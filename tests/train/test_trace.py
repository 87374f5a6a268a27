#!/usr/bin/env python3
"""test_trace.py — `dgtrain --trace A:B` (run.trace, src/train/trace.c) with the real dgtrain at 2 ranks
(FSDP: all-gathers and reduce-scatters on the communication track).

  test_trace.py DGTRAIN MPIEXEC [MPIEXEC FLAGS...]

1. --trace 2:3 of a 5-step run: RUN_DIR/trace.json is a Chrome trace (traceEvents; metadata naming each
   rank's process and its compute / communication / steps tracks); each rank has step spans 2 and 3 only,
   compute ops and collectives of steps 2 and 3 only, every op inside its step's span, every duration >= 0.
2. --trace 4:9 of a 5-step run: the trace ends with the run (steps 4 and 5).
3. --trace 3:2 and --trace x: exit 1 with one line naming run.trace.
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import dgrun  # noqa: E402
from dgrun import check  # noqa: E402


def run(exe, mpi, cfg, run_dir, trace, rc=0):
    cmd = list(mpi) + ["-n", "2", exe, cfg, "--set", "run.dir=" + run_dir, "--trace", trace]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    check(p.returncode == rc, "--trace %s: exit %d (expected %d): %s" % (trace, p.returncode, rc, p.stdout[-1500:]))
    return p.stdout


def check_trace(run_dir, steps):
    d = json.load(open(os.path.join(run_dir, "trace.json")))
    ev = d["traceEvents"]
    for rank in (0, 1):
        mine = [e for e in ev if e.get("pid") == rank]
        names = {(e.get("tid"), e["args"]["name"]) for e in mine if e["ph"] == "M" and e["name"] == "thread_name"}
        check({t for t, _ in names} == {0, 1, 2} and any(n.startswith("compute") for _, n in names),
              "rank %d: track names %s" % (rank, names))
        spans = {e["args"]["step"]: (e["ts"], e["ts"] + e["dur"]) for e in mine if e.get("cat") == "step"}
        check(sorted(spans) == steps, "rank %d: step spans %s, expected %s" % (rank, sorted(spans), steps))
        ops = [e for e in mine if e.get("cat") in ("compute", "comm")]
        comp = [e for e in ops if e["cat"] == "compute" and e["tid"] == 0]
        comm = [e for e in ops if e["cat"] == "comm" and e["tid"] == 1]
        check(comp and comm and len(comp) + len(comm) == len(ops), "rank %d: %d compute, %d comm of %d ops" %
              (rank, len(comp), len(comm), len(ops)))
        check({"all_gather", "reduce_scatter"} <= {e["name"].split()[0] for e in comm},
              "rank %d: collectives %s" % (rank, sorted({e["name"].split()[0] for e in comm})))
        for e in ops:
            s = e["args"]["step"]
            check(s in spans and e["dur"] >= 0, "op of step %s outside the traced steps: %s" % (s, e))
            lo, hi = spans[s]
            check(lo - 1 <= e["ts"] and e["ts"] + e["dur"] <= hi + 1, "op outside step %d's span %s: %s" % (s, spans[s], e))
        per = {s: sum(1 for e in comp if e["args"]["step"] == s) for s in steps}
        check(len(set(per.values())) == 1, "rank %d: compute ops per step differ: %s" % (rank, per))
    return len(ev)


def main():
    exe, mpi = sys.argv[1], sys.argv[2:]

    def body(work):
        cfg = dgrun.write_file(work, "cfg.ini", dgrun.small_gpt(
            "written by tests/train/test_trace.py", run={"name": "trace", "seed": 5},
            train={"steps": 5, "global_batch": 4, "micro_batch": 2, "warmup_steps": 1},
            parallel={"mesh": "dp_replicate=1,dp_shard=2,tp=1"}))
        a = os.path.join(work, "a")
        out = run(exe, mpi, cfg, a, "2:3")
        check("trace: steps 2..3 of 2 rank(s) written" in out, "no 'written' line: %s" % out[-600:])
        n = check_trace(a, [2, 3])
        print("  --trace 2:3: %d events, steps 2 and 3 on both ranks, every op inside its step" % n)
        b = os.path.join(work, "b")
        run(exe, mpi, cfg, b, "4:9")
        check_trace(b, [4, 5])
        print("  --trace 4:9 of a 5-step run: steps 4 and 5")
        for bad in ("3:2", "x"):
            out = run(exe, mpi, cfg, os.path.join(work, "bad"), bad, rc=1)
            check("run.trace" in out and "A:B" in out, "--trace %s: %s" % (bad, out[-400:]))
        print("  --trace 3:2 and x: exit 1 naming run.trace")

    return dgrun.in_workdir("dgt-trace-", body)


if __name__ == "__main__":
    sys.exit(main())
