#!/usr/bin/env python3
"""test_observe.py — the run identity and the Prometheus textfile of the real dgtrain (observe.c,
docs/design.md §1 "Run identity", README "Monitoring"), at 2 ranks on the CPU.

  test_observe.py DGTRAIN MPIEXEC [MPIEXEC FLAGS...]

1. A fresh run: RUN_DIR/run.json names a run id and attempt 1; every metrics line carries run_id,
   attempt 1 and a step, before "time"; every line of both ranks' log files carries "[run ID attempt 1
   step S]"; metrics.prom is node-exporter text format (HELP/TYPE, one sample per metric, labels) with the
   last step.
2. The same run directory again (a requeue), under SLURM_JOB_ID=4711: the same run id, attempt 2, the job
   id in metrics lines, log lines and metrics.prom's labels; the resume event carries attempt 2.
3. Its checkpoint resumed into a new run directory: the checkpoint's run id is adopted, attempt 3.
"""
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import dgrun  # noqa: E402
from dgrun import check  # noqa: E402

PROM_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'
                       r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*")*)\} (\S+)$')


def run(env, exe, mpi, cfg, run_dir, sets=(), extra_env=None):
    cmd = list(mpi) + ["-n", "2", exe, cfg, "--set", "run.dir=" + run_dir] + [a for s in sets for a in ("--set", s)]
    e = dict(os.environ)
    e.pop("SLURM_JOB_ID", None)
    e.update(extra_env or {})
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240, env=e)
    check(p.returncode == 0, "dgtrain exited %d: %s" % (p.returncode, p.stdout[-1500:]))


def lines(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f if l.strip()]


def check_metrics(rows, run_id, attempt, job):
    check(rows, "no metrics lines")
    for r in rows:
        keys = list(r)
        check(keys[0] == "event" and keys[-1] == "time", "line not event...time: %s" % keys)
        check(r.get("run_id") == run_id and r.get("attempt") == attempt and isinstance(r.get("step"), int),
              "line without run %s attempt %d and a step: %s" % (run_id, attempt, r))
        check(r.get("slurm_job_id") == job if job else "slurm_job_id" not in r, "slurm_job_id of %s" % r)


def check_logs(run_dir, run_id, attempt, job):
    want = "[run %s attempt %d%s step " % (run_id, attempt, " job " + job if job else "")
    for rank in (0, 1):
        path = os.path.join(run_dir, "logs", "rank-%d.log" % rank)
        with open(path) as f:
            mine = [l for l in f if want in l]
        check(len(mine) >= 3, "%s: fewer than 3 lines carry %r" % (path, want))


def check_prom(run_dir, run_id, job, step):
    text = open(os.path.join(run_dir, "metrics.prom")).read()
    check(text.endswith("\n"), "metrics.prom does not end with a newline")
    seen, typed = {}, set()
    for l in text.splitlines():
        if l.startswith("# HELP ") or l.startswith("# TYPE "):
            if l.startswith("# TYPE "):
                name, kind = l.split()[2:4]
                check(kind in ("gauge", "counter"), "type %s" % l)
                typed.add(name)
            continue
        m = PROM_LINE.match(l)
        check(m, "not a textfile sample: %r" % l)
        check(m.group(1) in typed, "sample before its TYPE: %r" % l)
        check(m.group(1) not in seen, "metric twice: %s" % m.group(1))
        labels = dict(kv.split("=", 1) for kv in m.group(2).split(","))
        check(labels["run_id"] == '"%s"' % run_id and labels["slurm_job_id"] == '"%s"' % job, "labels %s" % labels)
        v = m.group(3)
        check(v in ("NaN", "+Inf", "-Inf") or float(v) == float(v), "value %r" % v)
        seen[m.group(1)] = float(v) if v not in ("NaN",) else None
    for name in ("dgtrain_step", "dgtrain_loss", "dgtrain_tokens_per_second", "dgtrain_tokens_total",
                 "dgtrain_attempt", "dgtrain_step_seconds", "dgtrain_last_update_timestamp_seconds"):
        check(name in seen, "metrics.prom lacks %s" % name)
    check(seen["dgtrain_step"] == step, "metrics.prom step %s, expected %d" % (seen["dgtrain_step"], step))
    return seen


def main():
    exe, mpi = sys.argv[1], sys.argv[2:]

    def body(work):
        cfg = dgrun.write_file(work, "cfg.ini", dgrun.small_gpt(
            "written by tests/train/test_observe.py", run={"name": "obs", "seed": 3},
            train={"steps": 4, "global_batch": 4, "micro_batch": 2, "warmup_steps": 1, "log_every": 1},
            checkpoint={"every": 2}))
        a = os.path.join(work, "a")
        run(None, exe, mpi, cfg, a)
        ident = json.load(open(os.path.join(a, "run.json")))
        rid = ident["run_id"]
        check(re.fullmatch(r"[0-9a-f]{16}", rid) and ident["attempt"] == 1, "run.json %s" % ident)
        check_metrics(lines(a), rid, 1, None)
        check_logs(a, rid, 1, None)
        check_prom(a, rid, "", 4)
        print("  fresh run %s: attempt 1 on every metrics and log line; metrics.prom at step 4" % rid)

        run(None, exe, mpi, cfg, a, ("train.steps=6",), {"SLURM_JOB_ID": "4711"})
        rows = lines(a)
        second = rows[[i for i, r in enumerate(rows) if r["event"] == "done"][0] + 1:]  # the resume precedes start
        check_metrics(second, rid, 2, "4711")
        res = [r for r in second if r["event"] == "resume"]
        check(res and res[0]["step"] == 4, "no resume at step 4 in the second attempt")
        check_logs(a, rid, 2, "4711")
        p = check_prom(a, rid, "4711", 6)
        check(p["dgtrain_attempt"] == 2, "metrics.prom attempt %s" % p["dgtrain_attempt"])
        print("  requeue: same run id, attempt 2, job 4711 in metrics, logs and metrics.prom")

        b = os.path.join(work, "b")
        ck = os.path.join(a, "checkpoints", "step_00000006.h5")
        run(None, exe, mpi, cfg, b, ("train.steps=8", "checkpoint.resume=" + ck))
        rows = lines(b)
        after = rows
        check(json.load(open(os.path.join(b, "run.json")))["run_id"] == rid, "new run dir did not adopt %s" % rid)
        res = [r for r in rows if r["event"] == "resume"]
        check(res and res[0]["run_id"] == rid and res[0]["attempt"] == 3, "resume line %s" % res)
        check_metrics(after[after.index(res[0]):], rid, 3, None)
        print("  checkpoint resumed into a new run dir: run %s adopted, attempt 3" % rid)

    return dgrun.in_workdir("dgt-observe-", body)


if __name__ == "__main__":
    sys.exit(main())
