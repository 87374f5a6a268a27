#!/usr/bin/env python3
"""plot_test.py — `dgtrain plot` and the end-of-run plots (src/plot/plot.h), on real runs and real
files: every SVG must parse as XML, carry the expected series, legend names and axis titles, and be
accepted by rsvg-convert (installed by scripts/setup.sh: under CI its absence fails).

Usage: plot_test.py --dgtrain PATH --work-dir DIR CASE
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import dgskip  # noqa: E402
from dgrun import Fail, check  # noqa: E402

NS = "{http://www.w3.org/2000/svg}"
CHARTS = {
    "loss.svg": "loss (nats/token)",
    "lr.svg": "learning rate (dimensionless)",
    "tokens_per_s.svg": "throughput (tokens/s)",
    "step_time.svg": "step time (ms)",
    "grad_norm.svg": "grad norm (L2, all parameters)",
    "mfu.svg": "MFU (% of peak)",
}
A = None


def run(args, **kw):
    p = subprocess.run([A.dgtrain] + args, capture_output=True, text=True, timeout=300, **kw)
    return p.returncode, p.stdout, p.stderr


def train(run_dir, steps=6, extra=()):
    args = ["--set", "run.dir=" + run_dir, "--set", "train.steps=%d" % steps, "--set", "data.val_every=3",
            "--set", "checkpoint.every=0"] + list(extra)
    rc, out, err = run(args)
    check(rc == 0, "training %s exited %d: %s" % (run_dir, rc, err[-2000:]))
    return out + err


def fresh(name):
    d = os.path.join(A.work_dir, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    return d


def texts(root):
    return [("".join(t.itertext())).strip() for t in root.iter(NS + "text")]


def parse(path):
    check(os.path.isfile(path), "%s was not written" % path)
    try:
        return ET.parse(path).getroot()
    except ET.ParseError as e:
        raise Fail("%s is not well-formed XML: %s" % (path, e))


def polylines(root):
    out = []
    for p in root.iter(NS + "polyline"):
        pts = [tuple(float(c) for c in xy.split(",")) for xy in p.get("points").split()]
        out.append((p.get("stroke"), p.get("stroke-dasharray") is not None, pts))
    return out


def rsvg_ok(paths):
    """0 when rsvg-convert renders each SVG to a non-empty PNG; else the skip/fail status."""
    exe = shutil.which("rsvg-convert")
    if not exe:
        return dgskip.skip("rsvg-convert not found (apt-get install librsvg2-bin; scripts/setup.sh)")
    for p in paths:
        png = p[:-4] + ".png"
        r = subprocess.run([exe, "-o", png, p], capture_output=True, text=True, timeout=60)
        check(r.returncode == 0 and os.path.getsize(png) > 1000, "rsvg-convert rejected %s: %s" % (p, r.stderr))
    return 0


def check_chart(path, ytitle, legend):
    root = parse(path)
    t = texts(root)
    check("step" in t, "%s: no x axis title 'step' (texts %s)" % (path, t))
    check(ytitle in t, "%s: no y axis title %r (texts %s)" % (path, ytitle, t))
    for name in legend:
        check(any(x == name or x.startswith(name + " (") for x in t), "%s: no legend entry %r (texts %s)" % (path, name, t))
    return root


def write_metrics(d, lines):
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.write("".join(lines))


def step_line(step, loss, lr=1e-3, mfu="null"):
    return ('{"event":"step","step":%d,"loss":%r,"lr":%r,"grad_norm":1.5,"tokens":%d,"tok_per_s":1000,'
            '"step_ms":12.5,"mfu":%s,"time":1.0}\n' % (step, loss, lr, step * 64, mfu))


# ---------------------------------------------------------------------------------------------- cases


def case_real_run():
    """A real short CPU run writes RUN_DIR/plots/ at its end; `dgtrain plot RUN_DIR` rewrites it."""
    d = os.path.join(fresh("real"), "tiny_run")
    log = train(d)
    check("plots written to" in log, "the run did not report its plots: %s" % log[-1500:])
    paths = []
    for name, ytitle in CHARTS.items():
        p = os.path.join(d, "plots", name)
        root = check_chart(p, ytitle, ["tiny_run"])
        lines = polylines(root)
        want = 2 if name == "loss.svg" else 1  # train + val on the loss chart
        check(len(lines) == want, "%s: %d series, expected %d" % (name, len(lines), want))
        check(len(lines[0][2]) == 6, "%s: %d points for 6 steps" % (name, len(lines[0][2])))
        paths.append(p)
    for p in paths:
        os.remove(p)
    rc, _, err = run(["plot", d])
    check(rc == 0, "dgtrain plot exited %d: %s" % (rc, err))
    check("wrote 6 charts" in err, "no summary line: %s" % err)
    return rsvg_ok(paths)


def case_overlay():
    """Two runs overlaid: each chart has one series per run in distinct colours, both in the legend."""
    w = fresh("overlay")
    a, b = os.path.join(w, "run_a"), os.path.join(w, "run_b")
    train(a)
    train(b, extra=["--set", "train.lr=1e-3"])
    out = os.path.join(w, "cmp")
    rc, _, err = run(["plot", a, b + "/", "--out", out])
    check(rc == 0, "dgtrain plot A B exited %d: %s" % (rc, err))
    paths = []
    for name, ytitle in CHARTS.items():
        p = os.path.join(out, name)
        root = check_chart(p, ytitle, ["run_a", "run_b"])
        lines = polylines(root)
        check(len(lines) == (4 if name == "loss.svg" else 2), "%s: %d series for 2 runs" % (name, len(lines)))
        check(len({c for c, _, _ in lines}) == 2, "%s: the two runs share a colour" % name)
        paths.append(p)
    check(not os.path.exists(os.path.join(a, "plots", "cmp")), "--out ignored")
    return rsvg_ok(paths)


def case_rollback():
    """Repeated steps (a rollback re-ran 4..6) take the LAST value of each step."""
    d = os.path.join(fresh("rollback"), "rb")
    os.makedirs(d)
    first = [step_line(1, 2.0), step_line(2, 1.9), step_line(3, 1.8)]
    bad = [step_line(4, 50.0), step_line(5, 60.0), step_line(6, 70.0)]
    redo = ['{"event":"health","kind":"rollback","step":3,"time":1.0}\n',
            step_line(4, 1.7), step_line(5, 1.6), step_line(6, 1.5)]
    write_metrics(d, first + bad + redo)
    rc, _, err = run(["plot", d])
    check(rc == 0, "plot exited %d: %s" % (rc, err))
    root = parse(os.path.join(d, "plots", "loss.svg"))
    (_, _, pts), = polylines(root)
    check(len(pts) == 6, "%d points for 6 distinct steps (repeats not collapsed)" % len(pts))
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    check(xs == sorted(xs) and len(set(xs)) == 6, "points not in step order: %s" % xs)
    check(ys == sorted(ys), "loss should fall 2.0 -> 1.5 after the rollback (first values kept?): %s" % ys)
    labels = [float(t) for t in texts(root) if re.fullmatch(r"[0-9.]+", t)]
    check(max(labels) < 10, "the y axis still spans the discarded values: %s" % labels)
    check(not any("log scale" in t for t in texts(root)), "log scale chosen for 1.5..2.0")
    return rsvg_ok([os.path.join(d, "plots", "loss.svg")])


def case_logscale():
    """Log y when the loss spans more than a decade; linear otherwise (lr is always linear)."""
    d = os.path.join(fresh("logscale"), "lg")
    os.makedirs(d)
    write_metrics(d, [step_line(s, 10.0 * 0.5 ** s) for s in range(1, 9)] +
                  ['{"event":"val","step":8,"loss":0.05,"batches":2,"time":1.0}\n'])
    rc, _, err = run(["plot", d])
    check(rc == 0, "plot exited %d: %s" % (rc, err))
    root = parse(os.path.join(d, "plots", "loss.svg"))
    t = texts(root)
    check("Loss (log scale)" in t, "loss 5 .. 0.04 is not on a log scale: %s" % t)
    for decade in ("0.01", "0.1", "1", "10"):
        check(decade in t, "log axis lacks the decade tick %s: %s" % (decade, t))
    lr = texts(parse(os.path.join(d, "plots", "lr.svg")))
    check("Learning rate" in lr, "lr chart should stay linear: %s" % lr)
    return rsvg_ok([os.path.join(d, "plots", n) for n in ("loss.svg", "lr.svg")])


def case_partial():
    """A truncated last line is skipped and counted; a metric absent from every run (mfu null) gets no
    chart and one line saying so."""
    d = os.path.join(fresh("partial"), "pt")
    os.makedirs(d)
    write_metrics(d, ['{"event":"start","world_size":1,"time":1.0}\n', step_line(1, 3.0), step_line(2, 2.5),
                      "garbage that is not json\n", '{"event":"step","step":3,"loss":2.'])
    rc, _, err = run(["plot", d])
    check(rc == 0, "plot exited %d: %s" % (rc, err))
    check("skipped 2 malformed or truncated lines" in err, "bad lines not reported: %s" % err)
    check(re.search(r"no MFU .* mfu\.svg not written", err), "absent mfu not reported: %s" % err)
    check(not os.path.exists(os.path.join(d, "plots", "mfu.svg")), "mfu.svg written without data")
    check(not os.path.exists(os.path.join(d, "plots", "val_loss.svg")), "unexpected file")
    (_, _, pts), = polylines(parse(os.path.join(d, "plots", "loss.svg")))
    check(len(pts) == 2, "the truncated step 3 was plotted: %d points" % len(pts))
    return 0


def case_errors():
    """Bad input: usage errors exit 1, a bad or metrics-less run dir and an unwritable plots dir exit 2,
    each with one line naming the path."""
    w = fresh("errors")
    rc, _, err = run(["plot"])
    check(rc == 1 and "expected at least one RUN_DIR" in err, "no args: rc %d %s" % (rc, err))
    rc, _, err = run(["plot", w, "--bogus"])
    check(rc == 1 and "unknown option --bogus" in err, "bad option: rc %d %s" % (rc, err))
    missing = os.path.join(w, "nope")
    rc, _, err = run(["plot", missing])
    check(rc == 2 and missing in err and len(err.strip().splitlines()) == 1, "missing dir: rc %d %s" % (rc, err))
    empty = os.path.join(w, "empty")
    os.makedirs(empty)
    rc, _, err = run(["plot", empty])
    check(rc == 2 and "metrics.jsonl" in err and len(err.strip().splitlines()) == 1,
          "no metrics file: rc %d %s" % (rc, err))
    ok = os.path.join(w, "ok")
    os.makedirs(ok)
    write_metrics(ok, [step_line(1, 3.0)])
    blocker = os.path.join(w, "afile")
    open(blocker, "w").close()
    rc, _, err = run(["plot", ok, "--out", os.path.join(blocker, "plots")])
    check(rc == 2 and "plots directory" in err, "unwritable out dir: rc %d %s" % (rc, err))
    return 0


def case_train_unwritable():
    """A run whose plots/ or config.ini cannot be written still finishes with exit 0 and a warning."""
    d = os.path.join(fresh("train_unwritable"), "run")
    os.makedirs(d)
    open(os.path.join(d, "plots"), "w").close()  # a file where the directory should go
    os.makedirs(os.path.join(d, "config.ini", "x"))  # a non-empty directory: rename cannot replace it
    log = train(d, steps=3)
    check("plots not written" in log, "no warning for the unwritable plots dir: %s" % log[-1500:])
    check(re.search(r"WARN.*config\.ini", log), "no warning for the unwritable config.ini: %s" % log[-1500:])
    return 0


def case_signal_stop():
    """A run stopped on SIGUSR1 after its checkpoint (exit 75) still writes RUN_DIR/plots/."""
    d = os.path.join(fresh("signal_stop"), "run")
    logf = open(os.path.join(os.path.dirname(d), "out.log"), "w+")  # a file: a full pipe would stall the run
    p = subprocess.Popen([A.dgtrain, "--set", "run.dir=" + d, "--set", "train.steps=100000", "--set",
                          "checkpoint.every=0"], stdout=logf, stderr=subprocess.STDOUT, text=True)

    def output():
        logf.seek(0)
        return logf.read()

    metrics, deadline = os.path.join(d, "metrics.jsonl"), time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if os.path.exists(metrics) and open(metrics).read().count('"event":"step"') >= 3:
            break
        time.sleep(0.2)
    if p.poll() is not None:
        raise Fail("the run ended before the signal: %s" % output()[-1500:])
    p.send_signal(signal.SIGUSR1)
    try:
        p.wait(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        raise Fail("no exit within 120 s of SIGUSR1: %s" % output()[-1500:])
    out = output()
    logf.close()
    check(p.returncode == 75, "stopped run exited %d, expected 75: %s" % (p.returncode, out[-1500:]))
    check("plots written to" in out, "no plots after the stop: %s" % out[-1500:])
    (_, _, pts), = [l for l in polylines(parse(os.path.join(d, "plots", "loss.svg")))]
    check(len(pts) >= 3, "the stopped run's loss chart has %d points" % len(pts))
    return 0


def case_long_run():
    """A long series is thinned to what the pixels show, keeping a one-step spike."""
    d = os.path.join(fresh("long_run"), "long")
    os.makedirs(d)
    write_metrics(d, [step_line(s, 100.0 if s == 12345 else 3.0 + 1.0 / s) for s in range(1, 30001)])
    rc, _, err = run(["plot", d])
    check(rc == 0, "plot exited %d: %s" % (rc, err))
    root = parse(os.path.join(d, "plots", "loss.svg"))
    (_, _, pts), = polylines(root)
    check(len(pts) < 3000, "30000 steps drawn as %d points" % len(pts))
    check(os.path.getsize(os.path.join(d, "plots", "loss.svg")) < 200000, "loss.svg is too large")
    ys = [y for _, y in pts]
    labels = [float(t) for t in texts(root) if re.fullmatch(r"[0-9.]+", t)]
    check(max(labels) >= 100, "the y axis does not reach the spike: %s" % labels)
    top = min(ys)
    check(sum(1 for y in ys if y == top) == 1 and ys.index(top) not in (0, len(ys) - 1),
          "the spike at step 12345 was lost in thinning")
    return rsvg_ok([os.path.join(d, "plots", "loss.svg")])


def config_hash(args):
    rc, out, err = run(args + ["--dry-run", "--json"])
    check(rc == 0, "dgtrain %s --dry-run --json exited %d: %s" % (" ".join(args), rc, err[-1500:]))
    return json.loads(out)["run"]["config_hash"]


def effective(args):
    rc, out, err = run(args + ["--print-config"])
    check(rc == 0, "dgtrain %s --print-config exited %d: %s" % (" ".join(args), rc, err[-1500:]))
    vals = {}
    for line in out.splitlines():
        if line.startswith("#"):
            continue
        key, rest = line.split(" = ", 1)
        vals[key] = rest.split("  #")[0].strip()
    return vals


def case_config_roundtrip():
    """RUN_DIR/config.ini holds every key with its value and source, and loading it reproduces the run's
    effective config (same hash as the run's start line, same value for every key)."""
    w = fresh("config_rt")
    d = os.path.join(w, "run")
    cfg = os.path.join(w, "base.ini")
    with open(cfg, "w") as f:
        f.write("[train]\nlr = 0.002\n")
    sets = [cfg, "--set", "model.n_layer=2", "--set", "data.val_every=2"]
    train(d, steps=2, extra=sets)
    ini = os.path.join(d, "config.ini")
    check(os.path.isfile(ini), "config.ini not written")
    text = open(ini).read()
    check(not os.path.exists(ini + ".tmp"), "temporary config file left behind")
    check(re.search(r"^train\.lr = 0\.002 +# %s:2$" % re.escape(cfg), text, re.M),
          "train.lr or its source FILE:LINE missing:\n" + text)
    check(re.search(r"^model\.n_layer = 2 +# --set$", text, re.M), "model.n_layer missing:\n" + text)
    check(re.search(r"^model\.d_model = 128 +# preset tiny$", text, re.M), "preset size not resolved:\n" + text)
    check(re.search(r"^run\.seed = 1337 +# default$", text, re.M), "default source missing:\n" + text)
    start = [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl")) if '"start"' in l][0]
    orig = effective(["--set", "run.dir=" + d, "--set", "train.steps=2", "--set", "checkpoint.every=0"] + sets)
    again = effective([ini])
    check(orig == again, "reloaded config differs: %s" % {k: (orig.get(k), again.get(k)) for k in orig
                                                          if orig.get(k) != again.get(k)})
    h = config_hash([ini])
    check(h == start["config_hash"], "config.ini loads with hash %s, the run had %s" % (h, start["config_hash"]))
    return 0


def case_print_config_loadable():
    """--print-config output loads as a config file and gives the same effective config; the model
    sizes show the preset's values, not 0."""
    w = fresh("print_cfg")
    args = ["--set", "model.preset=gpt2-124m", "--set", "train.steps=9", "--set", "run.name=p.q", "--set", "data.train=/tmp/x y/*.bin"]
    rc, out, err = run(args + ["--print-config"])
    check(rc == 0, "--print-config exited %d: %s" % (rc, err))
    for key, want in (("n_layer", "12"), ("n_head", "12"), ("d_model", "768"), ("seq_len", "1024"),
                      ("vocab_size", "50257")):
        check(re.search(r"^model\.%s = %s +# preset gpt2-124m$" % (key, want), out, re.M),
              "model.%s is not %s from the preset:\n%s" % (key, want, out))
    path = os.path.join(w, "printed.ini")
    with open(path, "w") as f:
        f.write(out)
    check(effective(args) == effective([path]), "the printed config does not load back to the same values")
    hashes = [re.search(r"\(hash ([0-9a-f]{16})\)", run(a + ["--print-config"])[1]).group(1) for a in (args, [path])]
    check(hashes[0] == hashes[1], "the printed config loads with another hash: %s" % hashes)
    return 0


def main():
    global A
    ap = argparse.ArgumentParser()
    ap.add_argument("--dgtrain", required=True)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("case")
    A = ap.parse_args()
    os.makedirs(A.work_dir, exist_ok=True)
    try:
        rc = globals()["case_" + A.case]()
    except Fail as e:
        print("FAIL: %s" % e, flush=True)
        return 1
    if rc == 0:
        print("PASS: %s" % A.case)
    return rc


if __name__ == "__main__":
    sys.exit(main())
