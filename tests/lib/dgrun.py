"""dgrun.py — what the Python end-to-end tests of the real dgtrain share: the check primitive and the
config (INI) text they write.

  Fail, check(cond, msg)   a failed check raises Fail(msg); the test's case runner reports it
  ini(comment, sections)   dgtrain config text: "; comment", then each [section] and its "key = value"
                           lines in the order given (sections: {name: {key: value}})
  tail(path, n)            the last n non-blank lines of a log, joined by " | " ("(no output)" if none)
  dgckpt(exe, *args)       runs dgckpt: (exit code, its output); dgckpt_diff(exe, a, b): dgckpt diff A B
                           as (exit code, {dataset: max|a-b|}), failing when it errs or prints no dataset
  small_gpt(comment, ...)  the small custom GPT the tests train (2 layers, 2 heads, d_model 64, vocab
                           256, fp32 on the CPU, one thread per rank, no validation, no periodic
                           checkpoints, resume auto); keyword arguments set keys per section
  write_file(work, name, text)
                           writes WORK/name, returns its path (a test's cfg.ini)
  TrainEnv(case, dgtrain, dgckpt, mpi, prefix)
                           a case's work directory (WORK/cfg.ini once write_cfg wrote it) and its runs:
                           train(ranks, name, ...) runs dgtrain under MPI into WORK/name (its output
                           WORK/name.out, kept in .outputs), ckpt/diff run dgckpt
  run_case(env, case, body, errors, tail_lines)
                           the case runner of the end-to-end scripts: body() (its return value the exit
                           code, None = 0); a Fail (or another of `errors`) prints "FAIL [case]: ..." and
                           the last outputs' tails, exit 1; the work directory is removed after a pass
                           (kept with DGT_TEST_KEEP=1 or after a failure); the case's time is printed

Use:  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
      from dgrun import Fail, check  # noqa: E402
"""
import os
import re
import shutil
import subprocess
import tempfile
import time


class Fail(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Fail(msg)


def tail(path, n=8):
    try:
        with open(path, errors="replace") as f:
            lines = [l.rstrip() for l in f if l.strip()]
        return " | ".join(lines[-n:])
    except OSError:
        return "(no output)"


def dgckpt(exe, *args):
    p = subprocess.run([exe] + list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=120)
    return p.returncode, p.stdout


def dgckpt_diff(exe, a, b):
    rc, out = dgckpt(exe, "diff", a, b)
    check(rc in (0, 1), "dgckpt diff %s %s failed (exit %d): %s" % (a, b, rc, out.strip()[-500:]))
    per = {}
    for line in out.splitlines():
        m = re.match(r"^/(\S+)\s+max\|a-b\| = (\S+)", line)
        if m:
            per[m.group(1)] = float(m.group(2))
    check(per, "dgckpt diff %s %s printed no dataset lines: %s" % (a, b, out[:500]))
    return rc, per


def ini(comment, sections):
    lines = ["; " + comment] if comment else []
    for name, keys in sections.items():
        lines.append("[%s]" % name)
        lines += ["%s = %s" % (k, v) for k, v in keys.items() if v is not None]
    return "\n".join(lines) + "\n"


def small_gpt(comment, run, train, model=None, data=None, parallel=None, checkpoint=None, extra=None):
    """run, train: that section's keys; model, data, parallel, checkpoint: values over the defaults, in
    the defaults' order (a key left None is not written); extra: further sections after [checkpoint]."""

    def merged(base, over):
        out = dict(base)
        out.update(over or {})
        return out

    model_keys = {"preset": "custom", "n_layer": 2, "n_head": 2, "d_model": 64, "seq_len": 32, "vocab_size": 256}
    sections = {
        "run": run,
        "model": merged(model_keys, model),
        "data": merged({"train": None, "val": None, "val_every": 0, "shuffle": None}, data),
        "train": train,
        "parallel": merged({"backend": "cpu", "threads": 1}, parallel),
        "checkpoint": merged({"every": 0, "keep": None, "resume": "auto"}, checkpoint),
    }
    sections.update(extra or {})
    return ini(comment, sections)


def write_file(work, name, text):
    path = os.path.join(work, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def in_workdir(prefix, body):
    """Runs body(work) in a fresh temporary directory: PASS (exit 0, the directory removed) or, on a Fail,
    "FAIL: ... (work dir kept)" and exit 1 — the case runner of the single-case test scripts."""
    import shutil
    import tempfile
    work = tempfile.mkdtemp(prefix=prefix)
    try:
        body(work)
    except Fail as e:
        print("FAIL: %s (work dir %s kept)" % (e, work))
        return 1
    shutil.rmtree(work, ignore_errors=True)
    print("PASS")
    return 0


class TrainEnv:
    train_timeout = 240  # seconds one dgtrain run may take unless train() is told otherwise

    def __init__(self, case, dgtrain, dgckpt, mpi, prefix):
        self.case, self.dgtrain, self.dgckpt, self.mpi = case, dgtrain, dgckpt, mpi
        self.work = tempfile.mkdtemp(prefix="%s%s-" % (prefix, re.sub(r"[^A-Za-z0-9]", "_", case)))
        self.cfg = os.path.join(self.work, "cfg.ini")
        self.outputs = []

    def write_cfg(self, text):
        with open(self.cfg, "w") as f:
            f.write(text)

    def d(self, name):
        return os.path.join(self.work, name)

    def cmd(self, ranks, run_dir, sets, cfg=None):
        c = list(self.mpi) + ["-n", str(ranks), self.dgtrain, cfg or self.cfg, "--set", "run.dir=" + run_dir]
        for s in sets:
            c += ["--set", s]
        return c

    def train(self, ranks, name, sets=(), expect_rc=0, timeout=None, hooks=None, prefix=(), cfg=None):
        """Runs dgtrain to the end in run dir WORK/name; returns the run dir. hooks: {DG_TEST_*: value},
        exported to the ranks; prefix: a command line the launcher runs under (a wrapper)."""
        run_dir = self.d(name)
        out = run_dir + ".out"
        self.outputs.append(out)
        timeout = timeout or self.train_timeout
        t0 = time.time()
        c = self.cmd(ranks, run_dir, sets, cfg)
        for k in sorted(hooks or {}):
            c[len(self.mpi):len(self.mpi)] = ["-x", k]
        with open(out, "w") as f:
            try:
                rc = subprocess.run(list(prefix) + c, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                    env=dict(os.environ, **(hooks or {}))).returncode
            except subprocess.TimeoutExpired:
                raise Fail("%s: dgtrain at %d rank(s) did not finish within %d s" % (name, ranks, timeout))
        check(rc == expect_rc, "%s: dgtrain at %d rank(s) exited %d (expected %d): %s" %
              (name, ranks, rc, expect_rc, tail(out)))
        print("  ran %-14s %d rank(s) %5.1f s  %s" % (name, ranks, time.time() - t0, " ".join(sets)))
        return run_dir

    def ckpt(self, *args):
        return dgckpt(self.dgckpt, *args)

    def diff(self, a, b):
        """dgckpt diff A B -> (exit code, {dataset: max|a-b|})."""
        return dgckpt_diff(self.dgckpt, a, b)


def run_case(env, case, body, errors=(Fail,), tail_lines=8):
    t0 = time.time()
    ok, rc = False, 1
    try:
        rc = body() or 0
        ok = True
    except errors as e:
        print("FAIL [%s]: %s%s" % (case, "" if isinstance(e, Fail) else type(e).__name__ + ": ", e))
        for o in env.outputs[-3:]:
            print("  --- %s: %s" % (os.path.basename(o), tail(o, tail_lines)))
    finally:
        if ok and os.environ.get("DGT_TEST_KEEP") != "1":
            shutil.rmtree(env.work, ignore_errors=True)
        else:
            print("  work directory kept: %s" % env.work)
    print("  %s: %.1f s" % (case, time.time() - t0))
    return rc if ok else 1
