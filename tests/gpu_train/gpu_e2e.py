#!/usr/bin/env python3
"""gpu_e2e.py — end-to-end training of the real dgtrain on a GPU through the graph executor (issue 7).

Each case trains a small custom GPT (2 layers, d_model 128, head size 64, seq_len 256: the tensor-core
attention path with several key tiles) on synthetic token shards this script writes, and judges what a
user sees: the step lines of metrics.jsonl and the final checkpoint through `dgckpt diff`.

Usage: gpu_e2e.py CASE DGTRAIN DGCKPT MPIEXEC [MPIEXEC FLAGS...]
Cases:
  fp32        CUDA fp32 vs the CPU backend, 20 steps: losses within 1e-5 relative, grad norms 1e-4,
              final weights max|diff| <= 1e-3
  bf16        CUDA bf16 vs the CPU backend (fp32), 20 steps: losses within bf16 tolerance (see BF16_RTOL)
  determinism two CUDA runs each in fp32 and bf16: step lines and final checkpoints bitwise equal
  multirank   2 ranks sharing the GPU (gradients all-reduced over MPI with host staging) vs 1 rank at
              the same global batch: losses within 1e-5 relative, final weights within 1e-4
  graph       CUDA Graph replay vs op-by-op (bf16; fp16 with a growing loss scale, which records again): step
              lines and final checkpoints bitwise equal; a forced recording failure falls back with one
              `fallback` event and the same numbers
  memcheck    compute-sanitizer memcheck over a short bf16 and fp32 dgtrain run: 0 errors
Exit 77 (ctest: skipped) when no CUDA device is usable (or, for memcheck, no compute-sanitizer).
Environment: DGT_TEST_KEEP=1 keeps the work directory.
"""
import ctypes
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

SKIP = 77
STEPS = 20
GLOBAL_BATCH = 8
SEQ_LEN = 256
VOCAB = 256

# fp32: cuBLAS (CUBLAS_COMPUTE_32F, no TF32) and OpenBLAS sum in different orders, so the two backends
# differ by float rounding only (the backend's 3-step check measured <= 1.5e-7 relative); DESIGN.md §4
# asks 1e-5 over 20 steps. Weights: Adam divides by sqrt(v), which amplifies rounding differences of
# small gradients, hence a looser absolute bound on the final weights (lr 3e-3 x 20 steps = 6e-2 would
# be a wrong update; rounding stays orders of magnitude below 1e-3).
FP32_LOSS_RTOL = 1e-5
FP32_GNORM_RTOL = 1e-4
FP32_WEIGHT_ATOL = 1e-3
# bf16 activations and compute weights (unit roundoff 2^-9 = 2e-3) against the fp32 CPU reference: each
# step's mean loss over 2048 tokens moves by a few 1e-3 relative at most; a wrong kernel (a missing
# scale, a dropped tile) moves it by > 5e-2. Bound per step, plus a tighter bound on the mean.
BF16_RTOL = 2e-2
BF16_MEAN_RTOL = 1e-2
# two ranks vs one: the gradient sum over ranks rounds differently; same bounds as the CPU rule
DIST_LOSS_RTOL = 1e-5
DIST_WEIGHT_ATOL = 1e-4

CONFIG = """; written by tests/gpu_train/gpu_e2e.py: a small custom GPT with head size 64
[run]
name = gpu-e2e
seed = 4242
[model]
preset = custom
n_layer = 2
n_head = 2
d_model = 128
seq_len = {seq_len}
vocab_size = {vocab}
[data]
train = {data}/train_*.bin
val = {data}/val_*.bin
val_every = 0
shuffle = true
[train]
steps = {steps}
global_batch = {global_batch}
micro_batch = 4
lr = 3e-3
warmup_steps = 5
log_every = 1000
[parallel]
backend = cuda
threads = 1
[checkpoint]
every = 0
keep = 2
resume = never
"""


class Fail(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Fail(msg)


def cuda_devices():
    """Number of CUDA devices the driver reports (0 without a driver), without any CUDA toolkit."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    if cu.cuInit(0) != 0:
        return 0
    n = ctypes.c_int(0)
    if cu.cuDeviceGetCount(ctypes.byref(n)) != 0:
        return 0
    return n.value


def write_shard(path, tokens):
    """llm.c format: 256 int32 header (magic 20240520, version 1, count), then uint16 tokens."""
    import array
    head = array.array("i", [0] * 256)
    head[0], head[1], head[2] = 20240520, 1, len(tokens)
    body = array.array("H", tokens)
    with open(path, "wb") as f:
        f.write(head.tobytes())
        f.write(body.tobytes())


def synthetic_tokens(n, seed):
    """A learnable stream: an order-1 Markov chain where each token has 4 likely successors."""
    rng = random.Random(seed)
    succ = [[rng.randrange(VOCAB) for _ in range(4)] for _ in range(VOCAB)]
    t, out = rng.randrange(VOCAB), []
    for _ in range(n):
        out.append(t)
        t = succ[t][rng.randrange(4)] if rng.random() < 0.9 else rng.randrange(VOCAB)
    return out


class Env:
    def __init__(self, case, dgtrain, dgckpt, mpi):
        self.dgtrain, self.dgckpt, self.mpi = dgtrain, dgckpt, mpi
        self.work = tempfile.mkdtemp(prefix="dgt-gpu-%s-" % case)
        data = os.path.join(self.work, "data")
        os.makedirs(data)
        write_shard(os.path.join(data, "train_000.bin"), synthetic_tokens(96 * 1024, 1))
        write_shard(os.path.join(data, "val_000.bin"), synthetic_tokens(8 * 1024, 2))
        self.cfg = os.path.join(self.work, "cfg.ini")
        with open(self.cfg, "w") as f:
            f.write(CONFIG.format(seq_len=SEQ_LEN, vocab=VOCAB, data=data, steps=STEPS, global_batch=GLOBAL_BATCH))
        self.outputs = []

    def cmd(self, ranks, run_dir, sets):
        c = list(self.mpi) + ["-n", str(ranks), self.dgtrain, self.cfg, "--set", "run.dir=" + run_dir]
        for s in sets:
            c += ["--set", s]
        return c

    def train(self, ranks, name, sets=(), prefix=(), timeout=300):
        run_dir = os.path.join(self.work, name)
        out = run_dir + ".out"
        self.outputs.append(out)
        t0 = time.time()
        with open(out, "w") as f:
            try:
                rc = subprocess.run(list(prefix) + self.cmd(ranks, run_dir, sets), stdout=f, stderr=subprocess.STDOUT,
                                    timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                raise Fail("%s: dgtrain did not finish within %d s" % (name, timeout))
        check(rc == 0, "%s: dgtrain at %d rank(s) exited %d: %s" % (name, ranks, rc, tail(out)))
        print("  ran %-12s %d rank(s) %5.1f s  %s" % (name, ranks, time.time() - t0, " ".join(sets)))
        return run_dir

    def ckpt(self, *args):
        p = subprocess.run([self.dgckpt] + list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=120)
        return p.returncode, p.stdout

    def diff(self, a, b):
        rc, out = self.ckpt("diff", a, b)
        check(rc in (0, 1), "dgckpt diff %s %s failed (exit %d): %s" % (a, b, rc, out.strip()[-500:]))
        per = {}
        for line in out.splitlines():
            m = re.match(r"^/(\S+)\s+max\|a-b\| = (\S+)", line)
            if m:
                per[m.group(1)] = float(m.group(2))
        check(per, "dgckpt diff %s %s printed no dataset lines: %s" % (a, b, out[:500]))
        return rc, per


def tail(path, n=8):
    try:
        with open(path, errors="replace") as f:
            lines = [l.rstrip() for l in f if l.strip()]
        return " | ".join(lines[-n:])
    except OSError:
        return "(no output)"


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [(json.loads(raw), raw) for raw in f if raw.strip()]


def step_lines(run_dir):
    """step -> (parsed line, {field: number text as written})."""
    out = {}
    for j, raw in metrics(run_dir):
        if j.get("event") == "step":
            nums = dict(re.findall(r'"(loss|lr|grad_norm|tokens)":([-+0-9.eE]+|null)', raw))
            out[j["step"]] = (j, nums)
    check(sorted(out) == list(range(1, STEPS + 1)), "%s: step lines %s, expected 1..%d" % (run_dir, sorted(out), STEPS))
    return out


def start_event(run_dir):
    ev = [j for j, _ in metrics(run_dir) if j.get("event") == "start"]
    check(len(ev) == 1, "%s: %d start events" % (run_dir, len(ev)))
    return ev[0]


def final_ckpt(run_dir):
    p = os.path.join(run_dir, "checkpoints", "step_%08d.h5" % STEPS)
    check(os.path.exists(p), "final checkpoint %s missing" % p)
    return p


def rel_losses(ref, run):
    r, d = step_lines(ref), step_lines(run)
    rels = [abs(d[s][0]["loss"] - r[s][0]["loss"]) / abs(r[s][0]["loss"]) for s in range(1, STEPS + 1)]
    return r, d, rels


def check_backend(run_dir, backend, precision):
    st = start_event(run_dir)
    check(st.get("backend") == backend and st.get("precision") == precision,
          "%s: start event backend %s precision %s, expected %s %s" %
          (run_dir, st.get("backend"), st.get("precision"), backend, precision))


def check_learns(steps, what):
    first, last = steps[1][0]["loss"], steps[STEPS][0]["loss"]
    check(last < first - 1.0, "%s: the loss did not fall (%.4f -> %.4f)" % (what, first, last))
    return first, last


def max_model_diff(env, a, b):
    _, per = env.diff(final_ckpt(a), final_ckpt(b))
    model = {k: v for k, v in per.items() if k.startswith("model/")}
    check(model, "no model/ datasets in dgckpt diff")
    worst = max(model, key=model.get)
    return worst, model[worst]


# ------------------------------------------------------------------------------------------------


def case_fp32(env):
    cpu = env.train(1, "cpu", ["parallel.backend=cpu"])
    gpu = env.train(1, "cuda_fp32", ["train.precision=fp32"])
    check_backend(cpu, "cpu", "fp32")
    check_backend(gpu, "cuda", "fp32")
    r, d, rels = rel_losses(cpu, gpu)
    worst = max(rels)
    s_bad = rels.index(worst) + 1
    check(worst <= FP32_LOSS_RTOL, "step %d: CUDA fp32 loss %.9g vs CPU %.9g: relative %.3g > %g" %
          (s_bad, d[s_bad][0]["loss"], r[s_bad][0]["loss"], worst, FP32_LOSS_RTOL))
    gn = max(abs(d[s][0]["grad_norm"] - r[s][0]["grad_norm"]) / r[s][0]["grad_norm"] for s in range(1, STEPS + 1))
    check(gn <= FP32_GNORM_RTOL, "grad norms differ by %.3g relative (bound %g)" % (gn, FP32_GNORM_RTOL))
    check(all(r[s][1]["lr"] == d[s][1]["lr"] and r[s][1]["tokens"] == d[s][1]["tokens"] for s in r),
          "lr or tokens differ between the backends")
    first, last = check_learns(r, "CPU run")
    wd, wv = max_model_diff(env, cpu, gpu)
    check(wv <= FP32_WEIGHT_ATOL, "final weights: %s differs by %.3g (bound %g)" % (wd, wv, FP32_WEIGHT_ATOL))
    mfu = [d[s][0].get("mfu") for s in range(2, STEPS + 1)]
    check(all(isinstance(x, (int, float)) and x > 0 for x in mfu) or all(x is None for x in mfu),
          "CUDA step lines: mfu %s is neither all positive nor all null (unknown GPU)" % mfu[:3])
    print("PASS CUDA fp32 vs CPU over %d steps: losses within %.3g relative (bound %g; per step: %s), grad norms "
          "%.3g, final weights max|diff| %.3g (%s); loss %.4f -> %.4f; CUDA mfu %s" %
          (STEPS, worst, FP32_LOSS_RTOL, " ".join("%.1e" % x for x in rels), gn, wv, wd, first, last,
           "null (GPU not in the peak table)" if mfu[0] is None else "%.3g" % mfu[-1]))


def case_bf16(env):
    cpu = env.train(1, "cpu", ["parallel.backend=cpu"])
    gpu = env.train(1, "cuda_bf16", ["train.precision=bf16"])
    check_backend(gpu, "cuda", "bf16")
    r, d, rels = rel_losses(cpu, gpu)
    worst, mean = max(rels), sum(rels) / len(rels)
    s_bad = rels.index(worst) + 1
    check(worst <= BF16_RTOL, "step %d: CUDA bf16 loss %.6g vs CPU fp32 %.6g: relative %.3g > %g" %
          (s_bad, d[s_bad][0]["loss"], r[s_bad][0]["loss"], worst, BF16_RTOL))
    check(mean <= BF16_MEAN_RTOL, "mean relative loss difference %.3g > %g" % (mean, BF16_MEAN_RTOL))
    first, last = check_learns(d, "CUDA bf16 run")
    wd, wv = max_model_diff(env, cpu, gpu)
    print("PASS CUDA bf16 vs CPU fp32 over %d steps: losses within %.3g relative (bound %g), mean %.3g (bound %g); "
          "per step: %s; loss %.4f -> %.4f; final weights max|diff| %.3g (%s, reported only)" %
          (STEPS, worst, BF16_RTOL, mean, BF16_MEAN_RTOL, " ".join("%.1e" % x for x in rels), first, last, wv, wd))


def case_determinism(env):
    for prec in ("fp32", "bf16"):
        a = env.train(1, "%s_a" % prec, ["train.precision=" + prec])
        b = env.train(1, "%s_b" % prec, ["train.precision=" + prec])
        sa, sb = step_lines(a), step_lines(b)
        for s in range(1, STEPS + 1):
            for k in ("loss", "grad_norm", "lr", "tokens"):
                check(sa[s][1].get(k) == sb[s][1].get(k), "%s: step %d %s differs between two runs: %s vs %s" %
                      (prec, s, k, sa[s][1].get(k), sb[s][1].get(k)))
        rc, per = env.diff(final_ckpt(a), final_ckpt(b))
        bad = {k: v for k, v in per.items() if v != 0}
        check(rc == 0 and not bad, "%s: final checkpoints differ (dgckpt diff exit %d): %s" %
              (prec, rc, ", ".join("%s %.3g" % kv for kv in sorted(bad.items())[:6])))
        check_learns(sa, "%s run" % prec)
        print("PASS determinism %s: two CUDA runs, %d step lines bitwise equal (loss, grad_norm, lr, tokens); final "
              "checkpoints identical (%d datasets, dgckpt diff exit 0); last loss %s" %
              (prec, STEPS, len(per), sa[STEPS][1]["loss"]))


def case_multirank(env):
    one = env.train(1, "one", ["train.precision=fp32"])
    two = env.train(2, "two", ["train.precision=fp32"])
    st = start_event(two)
    check(st.get("world_size") == 2 and st.get("backend") == "cuda",
          "2-rank run: start event world_size %s backend %s" % (st.get("world_size"), st.get("backend")))
    r, d, rels = rel_losses(one, two)
    worst = max(rels)
    check(worst <= DIST_LOSS_RTOL, "2 ranks vs 1 rank: losses differ by %.3g relative (bound %g) at step %d" %
          (worst, DIST_LOSS_RTOL, rels.index(worst) + 1))
    check(all(r[s][1]["tokens"] == d[s][1]["tokens"] for s in r), "tokens differ between 1 and 2 ranks")
    gn = max(abs(d[s][0]["grad_norm"] - r[s][0]["grad_norm"]) / r[s][0]["grad_norm"] for s in range(1, STEPS + 1))
    check(gn <= 1e-4, "grad norms differ by %.3g relative (bound 1e-4)" % gn)
    first, last = check_learns(r, "1-rank run")
    wd, wv = max_model_diff(env, one, two)
    check(wv <= DIST_WEIGHT_ATOL, "final weights: %s differs by %.3g (bound %g)" % (wd, wv, DIST_WEIGHT_ATOL))
    print("PASS 2 ranks on one GPU (mesh %s) vs 1 rank, global batch %d, %d steps: losses within %.3g relative "
          "(bound %g), grad norms %.3g, final weights max|diff| %.3g (%s); loss %.4f -> %.4f" %
          (st.get("mesh"), GLOBAL_BATCH, STEPS, worst, DIST_LOSS_RTOL, gn, wv, wd, first, last))


def events(run_dir, name):
    return [j for j, _ in metrics(run_dir) if j.get("event") == name]


def check_same_run(env, a, b, what):
    """Step lines (loss, grad_norm, lr, tokens) as written and the final checkpoints bitwise equal."""
    sa, sb = step_lines(a), step_lines(b)
    for s in range(1, STEPS + 1):
        for k in ("loss", "grad_norm", "lr", "tokens"):
            check(sa[s][1].get(k) == sb[s][1].get(k), "%s: step %d %s differs: %s vs %s" %
                  (what, s, k, sa[s][1].get(k), sb[s][1].get(k)))
    rc, per = env.diff(final_ckpt(a), final_ckpt(b))
    bad = {k: v for k, v in per.items() if v != 0}
    check(rc == 0 and not bad, "%s: final checkpoints differ (dgckpt diff exit %d): %s" %
          (what, rc, ", ".join("%s %.3g" % kv for kv in sorted(bad.items())[:6])))
    return sa, len(per)


GRAPHS = ("zero_grad", "forward_backward", "optimizer")


def case_graph(env):
    """CUDA Graph replay (parallel.cuda_graph) against op-by-op execution, and the forced fallback."""
    notes = []
    # bf16, and fp16 whose loss scale grows every 4 steps (dloss and the scale inverse are baked into the
    # recordings, so each change must record again); global batch 8 = 2 micro-batches of 4 (the
    # forward/backward graph replays twice per step)
    for prec, extra in (("bf16", []), ("fp16", ["train.loss_scale_init=1024", "train.loss_scale_growth_interval=4"])):
        on = env.train(1, prec + "_graph", ["train.precision=" + prec] + extra)
        off = env.train(1, prec + "_eager", ["train.precision=" + prec, "parallel.cuda_graph=false"] + extra)
        rec = events(on, "cuda_graph")
        check(not events(on, "fallback"), "%s: graph replay fell back: %s" % (prec, events(on, "fallback")))
        kinds = {e.get("graph", "").split(" ")[0] for e in rec}
        check(set(GRAPHS) <= kinds, "%s: recordings %s, expected all of %s" % (prec, sorted(kinds), GRAPHS))
        check(all(e.get("step", 0) >= 2 for e in rec), "%s: a recording before the first eager step finished" % prec)
        check(not events(off, "cuda_graph") and not events(off, "fallback"),
              "%s: parallel.cuda_graph=false still recorded or fell back" % prec)
        again = [e for e in rec if "again" in e.get("graph", "")]
        if prec == "fp16":
            check(again, "fp16: the loss scale changed (growth interval 4) but nothing was recorded again")
        sa, nd = check_same_run(env, on, off, "%s graph replay vs op by op" % prec)
        check_learns(sa, "%s graph run" % prec)
        notes.append("%s: %d recordings (%d again after a baked value changed), step lines and %d datasets bitwise "
                     "equal to op-by-op, last loss %s" % (prec, len(rec), len(again), nd, sa[STEPS][1]["loss"]))
    # a recording that fails: the run falls back to op-by-op with a fallback event and the same numbers
    forced = env.train(1, "bf16_forced", ["train.precision=bf16"], prefix=["env", "DG_TEST_CUDA_GRAPH_FAIL=1"])
    fb = events(forced, "fallback")
    check(len(fb) == 1 and fb[0].get("kind") == "cuda_graph" and "test hook" in fb[0].get("reason", ""),
          "forced failure: fallback events %s, expected one of kind cuda_graph naming the test hook" % fb)
    check(not events(forced, "cuda_graph"), "forced failure: recordings reported although every recording fails")
    check_same_run(env, forced, os.path.join(env.work, "bf16_eager"), "forced fallback vs op by op")
    notes.append("forced failure: one fallback event (step %s, reason '%s'), numbers bitwise equal to op-by-op" %
                 (fb[0].get("step"), fb[0].get("reason")))
    print("PASS CUDA Graph replay: " + "; ".join(notes))


def case_memcheck(env):
    san = shutil.which("compute-sanitizer") or (
        "/usr/local/cuda/bin/compute-sanitizer" if os.path.exists("/usr/local/cuda/bin/compute-sanitizer") else None)
    if not san:
        print("SKIP: compute-sanitizer not found")
        return SKIP
    for prec in ("bf16", "fp32"):
        name = "memcheck_" + prec
        prefix = [san, "--tool", "memcheck", "--target-processes", "all", "--error-exitcode", "3"]
        run = env.train(1, name, ["train.precision=" + prec, "train.steps=2", "train.global_batch=4"], prefix=prefix,
                        timeout=600)
        out = open(run + ".out", errors="replace").read()
        sums = re.findall(r"ERROR SUMMARY: (\d+) error", out)
        check(sums and all(s == "0" for s in sums), "%s: compute-sanitizer summaries %s" % (name, sums or "missing"))
        done = [j for j, _ in metrics(run) if j.get("event") == "done"]
        check(done and done[-1].get("reason") == "finished", "%s: no finished done event" % name)
        print("PASS compute-sanitizer memcheck, dgtrain %s 2 steps: ERROR SUMMARY 0 errors (%d process(es))" %
              (prec, len(sums)))
    return 0


def main():
    if len(sys.argv) < 5:
        print(__doc__, file=sys.stderr)
        return 2
    case, dgtrain, dgckpt, mpi = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    cases = {"fp32": case_fp32, "bf16": case_bf16, "determinism": case_determinism, "multirank": case_multirank,
             "graph": case_graph, "memcheck": case_memcheck}
    if case not in cases:
        print("gpu_e2e.py: unknown case '%s' (expected %s)" % (case, ", ".join(cases)), file=sys.stderr)
        return 2
    n = cuda_devices()
    if n == 0:
        print("SKIP: no CUDA device (libcuda.so.1 missing or the driver reports none); these tests need a GPU")
        return SKIP
    env = Env(case, dgtrain, dgckpt, mpi)
    t0 = time.time()
    ok, rc = False, 1
    try:
        rc = cases[case](env) or 0
        ok = True
    except Fail as e:
        print("FAIL [%s]: %s" % (case, e))
        for o in env.outputs[-3:]:
            print("  --- %s: %s" % (os.path.basename(o), tail(o, 10)))
    finally:
        if ok and os.environ.get("DGT_TEST_KEEP") != "1":
            shutil.rmtree(env.work, ignore_errors=True)
        else:
            print("  work directory kept: %s" % env.work)
    print("  %s: %.1f s" % (case, time.time() - t0))
    return rc if ok else 1


if __name__ == "__main__":
    sys.exit(main())
