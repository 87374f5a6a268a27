#!/usr/bin/env python3
"""check_metrics.py — run `test_train_util metrics DIR` and parse the metrics.jsonl it writes with
Python's json module: every line must be one valid JSON object with "event" first and "time" last,
step lines must have exactly docs/design.md's keys in order, non-finite numbers must be null, strings must
round-trip, and concurrent writers must never interleave within a line.
Usage: check_metrics.py PATH/TO/test_train_util"""
import json
import math
import os
import subprocess
import sys
import tempfile

fails = []


def check(cond, msg):
    if not cond:
        fails.append(msg)


def main():
    prog = sys.argv[1]
    with tempfile.TemporaryDirectory(prefix="dg_test_metrics_") as d:
        run = os.path.join(d, "run")
        r = subprocess.run([prog, "metrics", run], capture_output=True, text=True)
        if r.returncode != 0:
            print("metrics writer failed (%d):\n%s%s" % (r.returncode, r.stdout, r.stderr))
            return 1
        raw = open(os.path.join(run, "metrics.jsonl"), "rb").read()
    check(raw.endswith(b"\n"), "file does not end with a newline")
    text = raw.decode("utf-8")  # must be valid UTF-8
    lines = text.split("\n")[:-1]
    objs = []
    for i, line in enumerate(lines):
        try:
            pairs = json.loads(line, object_pairs_hook=lambda p: p)
        except ValueError as e:
            fails.append("line %d is not JSON (%s): %r" % (i + 1, e, line[:200]))
            continue
        keys = [k for k, _ in pairs]  # top-level key order
        check(keys[0] == "event", "line %d does not start with event: %s" % (i + 1, keys))
        check(keys[-1] == "time", "line %d does not end with time: %s" % (i + 1, keys))
        check(len(set(keys)) == len(keys), "line %d repeats a key: %s" % (i + 1, keys))
        objs.append(json.loads(line))
        objs[-1]["_keys"] = keys

    events = [o["event"] for o in objs]
    check(len(objs) == 1 + 5 + 1 + 1 + 1 + 1 + 800 + 1 + 1, "line count %d" % len(objs))

    start = objs[0]
    check(start["event"] == "start" and start["world_size"] == 4, "start line %r" % start)
    check(start["note"] == "quote \" backslash \\ newline \n tab \t bell \x07 caf\u00e9 bad \u00ff end",
          "string round trip: %r" % start.get("note"))
    check(start["raw"] == {"nested": [1, 2, {"x": None}]}, "raw JSON value %r" % start.get("raw"))

    steps = [o for o in objs if o["event"] == "step"]
    check(len(steps) == 5, "%d step lines" % len(steps))
    want_keys = ["event", "step", "loss", "lr", "grad_norm", "tokens", "tok_per_s", "step_ms", "mfu", "overflow_rate",
                 "overflow_rate_mean", "grad_sync_ms", "time"]
    for s in steps:
        check(s["_keys"] == want_keys, "step keys %s" % s["_keys"])
        n = s["step"]
        check(isinstance(n, int) and isinstance(s["tokens"], int) and s["tokens"] == 2048 * n, "step %r" % s)
        if n == 3:
            check(s["loss"] is None, "NaN loss must be null: %r" % s["loss"])
        else:
            check(s["loss"] == 5.545177444479562 - 0.5 * n, "loss not exact: %r" % s["loss"])
        if n == 4:
            check(s["grad_norm"] is None, "Inf grad_norm must be null")
        else:
            check(s["grad_norm"] == 1.0 / n, "grad_norm %r" % s["grad_norm"])
        check((s["mfu"] is None) == (n == 5), "mfu %r at step %d" % (s["mfu"], n))
        check(s["tok_per_s"] == 41234.5 and s["step_ms"] == 49.67, "rates %r" % s)
        check(isinstance(s["time"], float) and abs(s["time"] - __import__("time").time()) < 600, "time %r" % s["time"])
    # LR schedule as written: warmup 2 of 5 steps, base 3e-3, min ratio 0.1
    lrs = [s["lr"] for s in steps]
    want = [1.5e-3, 3e-3, 3e-3, 3e-4 + 2.7e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)), 3e-4]
    check(all(abs(a - b) < 1e-15 for a, b in zip(lrs, want)), "lr values %r vs %r" % (lrs, want))

    i = events.index("checkpoint")
    check(objs[i]["bytes"] == 123456789 and objs[i]["path"].endswith("step_00000005.h5"), "checkpoint %r" % objs[i])
    i = events.index("fallback")
    check(objs[i]["reason"] == "over memory budget", "fallback raw fields %r" % objs[i])
    check(objs[events.index("empty")]["_keys"] == ["event", "time"], "empty raw event")
    health = [o for o in objs if o["event"] == "health"]
    seen = {(o["thread"], o["i"]) for o in health}
    check(len(health) == 800 and len(seen) == 800, "concurrent lines: %d (%d distinct)" % (len(health), len(seen)))
    check(events[-2:] == ["resume", "done"], "appended events %s" % events[-2:])

    for f in fails:
        print("FAIL:", f)
    if fails:
        return 1
    print("ok: %d lines parsed, step line keys %s" % (len(objs), ",".join(want_keys)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
