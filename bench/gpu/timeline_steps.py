#!/usr/bin/env python3
"""timeline_steps.py — per-step GPU timeline summary of one dgtrain rank from an Nsight Systems SQLite export.

    nsys profile --trace=cuda --cuda-graph-trace=node -o prof dgtrain ...
    nsys export --type sqlite -o prof.sqlite prof.nsys-rep
    python3 bench/gpu/timeline_steps.py prof.sqlite [--skip 5] [--top 12]

or, without Nsight Systems, from the CSV of the CUPTI recorder (bench/gpu/cupti_trace.c):

    CUDA_INJECTION64_PATH=build/bench/gpu/libdg_cupti_trace.so DG_CUPTI_OUT=trace_%r.csv dgtrain ...
    python3 bench/gpu/timeline_steps.py --csv trace_0.csv

Steps are delimited by the optimizer's clip-scale kernel (one launch per step, between the gradient
norm and AdamW); the first --skip steps (warm-up, CUDA Graph recording) are left out. Per step it
prints: the wall time, the time the compute stream is busy (kernels, memsets and copies on the stream
with the most non-NCCL kernel time), NCCL kernel time (union over streams), the part of NCCL time that
overlaps compute, the compute stream's idle time, and the kernels with the most time per step (so that
two runs, e.g. 1 GPU and 2 GPUs, can be compared kernel by kernel: a compute kernel that is slower
beside NCCL shows up there).
"""
import argparse
import collections
import csv
import shutil
import sqlite3
import subprocess
import sys


def demangle(names):
    """Mangled C++ names -> readable ones through c++filt when it is there (else unchanged)."""
    names = sorted(set(names))
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return {n: (out[i] if i < len(out) and out[i] else n) for i, n in enumerate(names)}


def load_csv(path):
    rows = list(csv.DictReader(open(path)))
    dm = demangle(r["name"] for r in rows if r["kind"] == "k")
    kern, other = [], []
    for r in rows:
        s, e, st = int(r["start_ns"]), int(r["end_ns"]), int(r["stream"])
        if r["kind"] == "k":
            kern.append((s, e, st, dm.get(r["name"], r["name"])))
        else:
            other.append((s, e, st, r["name"]))
    return kern, other


def load_sqlite(path):
    db = sqlite3.connect(path)
    names = dict(db.execute("SELECT id, value FROM StringIds"))
    kern = [(s, e, st, names.get(n, "?")) for s, e, st, n in
            db.execute("SELECT start, end, streamId, demangledName FROM CUPTI_ACTIVITY_KIND_KERNEL")]
    other = []
    for tab in ("CUPTI_ACTIVITY_KIND_MEMSET", "CUPTI_ACTIVITY_KIND_MEMCPY"):
        try:
            other += [(s, e, st, tab.split("_")[-1].lower()) for s, e, st in
                      db.execute("SELECT start, end, streamId FROM %s" % tab)]
        except sqlite3.OperationalError:
            pass
    return kern, other


def union(iv):
    """Total length of the union of [s, e) intervals, and the merged list."""
    iv = sorted(iv)
    out = []
    for s, e in iv:
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([s, e])
    return sum(e - s for s, e in out), out


def intersect(a, b):
    """Length of the intersection of two merged interval lists."""
    i = j = 0
    t = 0
    while i < len(a) and j < len(b):
        s = max(a[i][0], b[j][0])
        e = min(a[i][1], b[j][1])
        if e > s:
            t += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return t


def clip(iv, lo, hi):
    return [(max(s, lo), min(e, hi)) for s, e in iv if e > lo and s < hi]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path", help="an nsys SQLite export, or with --csv the CUPTI recorder's CSV")
    ap.add_argument("--csv", action="store_true")
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    kern, other = load_csv(a.path) if a.csv else load_sqlite(a.path)
    if not kern:
        print("%s: no kernels in %s" % (a.label, a.path))
        return 1
    is_nccl = lambda nm: nm.startswith("nccl")
    ends = sorted(e for s, e, st, nm in kern if "clip_scale" in nm)
    if len(ends) < a.skip + 2:
        print("%s: only %d clip_scale launches (steps); need more than --skip %d + 1" % (a.label, len(ends), a.skip))
        return 1
    lo, hi = ends[a.skip - 1] if a.skip else ends[0], ends[-1]
    nsteps = len(ends) - max(a.skip, 1)
    # streams are not a useful split: a CUDA Graph's branches run on streams of the driver's choosing
    comp = [(s, e) for s, e, st, nm in kern + other if not is_nccl(nm)]
    nccl = [(s, e) for s, e, st, nm in kern if is_nccl(nm)]
    cb, cm = union(clip(comp, lo, hi))
    nb, nm_ = union(clip(nccl, lo, hi))
    ab, _ = union(clip(comp + nccl, lo, hi))
    ov = intersect(cm, nm_)
    wall = hi - lo
    ms = lambda x: x / nsteps / 1e6
    print("%s: %d steps, per step: wall %.2f ms, GPU busy %.2f ms (idle %.2f); compute (non-NCCL work) %.2f ms; "
          "NCCL kernels %.2f ms, of which %.2f beside compute and %.2f alone" %
          (a.label, nsteps, ms(wall), ms(ab), ms(wall - ab), ms(cb), ms(nb), ms(ov), ms(nb - ov)))
    tot = collections.Counter()
    cnt = collections.Counter()
    for s, e, st, nm in kern + other:
        if e > lo and s < hi:
            key = ("[nccl] " if is_nccl(nm) else "") + nm
            tot[key] += min(e, hi) - max(s, lo)
            cnt[key] += 1
    for nm, t in tot.most_common(a.top):
        print("   %8.3f ms/step  %5.1f launches/step  %s" % (ms(t), cnt[nm] / nsteps, nm[:90]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
