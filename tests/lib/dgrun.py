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

Use:  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
      from dgrun import Fail, check  # noqa: E402
"""
import re
import subprocess


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
