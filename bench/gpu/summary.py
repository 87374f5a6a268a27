#!/usr/bin/env python3
"""summary.py — the table of bench/gpu/run.sh: dgtrain (cold and warm launches) against PyTorch eager and
torch.compile measured in the same call, plus bench_step's split of one step. Writes OUT/summary.json.

  summary.py OUT_DIR BATCH
"""
import json
import os
import sys

TARGET = 1.15  # docs/cuda.md: dgtrain >= 1.15 x torch.compile tokens/s


def load_json(path):
    try:
        with open(path) as f:
            txt = f.read().strip()
        return json.loads(txt.splitlines()[-1]) if txt else None
    except (OSError, ValueError):
        return None


def dgtrain_events(out, run):
    """(the rows of OUT/dgtrain_RUN_metrics.jsonl by event, {"step": [...], "done": [...], ...}, the launch time
    from OUT/dgtrain_RUN_launch.txt), as run.sh and ttfs.sh leave them; ({}, None) when either is missing or
    unreadable. ttfs.sh imports it."""
    try:
        rows = [json.loads(l) for l in open(os.path.join(out, "dgtrain_%s_metrics.jsonl" % run)) if l.strip()]
        launch = float(open(os.path.join(out, "dgtrain_%s_launch.txt" % run)).read())
    except (OSError, ValueError):
        return {}, None
    ev = {}
    for r in rows:
        ev.setdefault(r.get("event"), []).append(r)
    return ev, launch


def dgtrain_run(out, run):
    ev, launch = dgtrain_events(out, run)
    if not ev.get("step"):
        return None
    steps, done = ev["step"], ev.get("done", [])
    steady = [r for r in steps if r["step"] > 5] or steps
    tps = sorted(r["tok_per_s"] for r in steady)
    mfu = sorted(r["mfu"] for r in steady if r.get("mfu") is not None)
    ms = sorted(r["step_ms"] for r in steady)
    d = done[-1] if done else {}
    return {"tok_per_s": tps[len(tps) // 2], "step_ms": ms[len(ms) // 2], "step_ms_min": ms[0],
            "mfu": mfu[len(mfu) // 2] if mfu else None, "first_step_s": steps[0]["time"] - launch,
            "first_step_ms": steps[0]["step_ms"], "peak_alloc_bytes": d.get("gpu_peak_alloc_bytes"),
            "gpu_used_bytes": d.get("gpu_used_bytes"), "steps": len(steps), "loss_last": steps[-1]["loss"]}


def gib(b):
    return "%.1f GiB" % (b / 2**30) if isinstance(b, (int, float)) else "-"


def main():
    out, B = sys.argv[1], int(sys.argv[2])
    bs = load_json(os.path.join(out, "bench_step.json"))
    fpt = bs["flops_per_token"] if bs else None
    peak = bs["peak_flops"] if bs and bs.get("peak_flops") else None
    res = {"dgtrain_cold": dgtrain_run(out, "cold"), "dgtrain_warm": dgtrain_run(out, "warm"),
           "torch_eager": load_json(os.path.join(out, "torch_eager.json")),
           "torch_compile": load_json(os.path.join(out, "torch_compile.json")), "bench_step": bs}
    for k in ("torch_eager", "torch_compile"):
        r = res[k]
        if r and fpt and peak:
            r["mfu"] = r["tok_per_s"] * fpt / peak
    print("GPT-2 124M, batch %d x 1024, bf16; peak %s TFLOP/s for MFU" % (B, "%.0f" % (peak / 1e12) if peak else "?"))
    print("%-22s %12s %10s %7s %14s %14s" % ("run", "tok/s", "step ms", "MFU", "peak memory", "first step s"))
    for k in ("dgtrain_cold", "dgtrain_warm", "torch_eager", "torch_compile"):
        r = res[k]
        if not r:
            print("%-22s %12s" % (k, "missing"))
            continue
        mem = r.get("peak_alloc_bytes")
        extra = " (reserved %s)" % gib(r["peak_reserved_bytes"]) if r.get("peak_reserved_bytes") else ""
        print("%-22s %12.0f %10.2f %7s %14s %14.1f%s" % (k, r["tok_per_s"], r["step_ms"],
                                                          "%.3f" % r["mfu"] if r.get("mfu") else "-", gib(mem),
                                                          r["first_step_s"], extra))
    ours = res["dgtrain_warm"] or res["dgtrain_cold"]
    ratios = {}
    if ours:
        for k in ("torch_eager", "torch_compile"):
            if res[k]:
                ratios[k] = ours["tok_per_s"] / res[k]["tok_per_s"]
                print("dgtrain / %-13s %.3f x" % (k, ratios[k]))
        if "torch_compile" in ratios:
            print("target >= %.2f x torch.compile: %s (%.0f tok/s needed, %.0f measured)" %
                  (TARGET, "MET" if ratios["torch_compile"] >= TARGET else "NOT MET",
                   TARGET * res["torch_compile"]["tok_per_s"], ours["tok_per_s"]))
    if bs:
        n = bs["tokens_per_step"]
        print("bench_step (one step, %d ops, %d graph nodes): dgtrain loop %.2f ms; eager without host syncs %.2f ms; "
              "CUDA Graph replay %.2f ms (%.0f tok/s) -> host syncs %.2f ms, launch gaps %.2f ms per step" %
              (bs["ops"], bs["graph_nodes"], bs["api_ms"], bs["eager_ms"], bs["graph_ms"], n / bs["graph_ms"] * 1e3,
               bs["api_ms"] - bs["eager_ms"], bs["eager_ms"] - bs["graph_ms"]))
        if res["torch_compile"]:
            print("CUDA Graph replay / torch.compile: %.3f x" % (n / bs["graph_ms"] * 1e3 / res["torch_compile"]["tok_per_s"]))
    res["ratios"] = ratios
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
