#!/usr/bin/env python3
"""recompute.py RANKS DGTRAIN MPIEXEC [MPIFLAGS...] — train.recompute=none|gelu|selective|full with the real
dgtrain (docs/planning.md, "Activation recompute"): every level trains with bitwise the same loss and
grad_norm as none (fp32, CPU), and the planned activation arena (the start event's arena_bytes) shrinks at
each level: none > gelu > selective > full.

RANKS 1: one rank, all four levels, and --dry-run --json's activation_arena_by_recompute equal to the
arenas the runs planned. RANKS 2: two ranks, FSDP (dp_shard=2) and tensor parallelism (tp=2), levels none,
selective and full (the pass interacts with both: the sharded parameters are gathered again for the
recomputed ops, and tensor parallelism's collectives are kept, not re-run).

On the GPU (ctest gpu_recompute_*, label gpu): RECOMPUTE_BACKEND=cuda adds parallel.backend=cuda (two ranks
share the one GPU over the MPI comm backend); RECOMPUTE_PRECISION=bf16 trains in bf16, where the levels
must agree within RECOMPUTE_RTOL (relative, loss and grad_norm) instead of bitwise: the recomputed GELU
and layer norms round as their own kernels do. Without a GPU these exit 77 (tests/lib/dgskip.py)."""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import dgskip  # noqa: E402

LEVELS = ["none", "gelu", "selective", "full"]
COMMON = ["train.steps=2", "model.n_layer=3", "train.log_every=1", "data.val_every=0"]
BACKEND = os.environ.get("RECOMPUTE_BACKEND", "")
PRECISION = os.environ.get("RECOMPUTE_PRECISION", "")
RTOL = float(os.environ.get("RECOMPUTE_RTOL", "0"))
if BACKEND:
    COMMON += ["parallel.backend=" + BACKEND]
if PRECISION:
    COMMON += ["train.precision=" + PRECISION]


class Fail(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Fail(msg)


def run(cmd, run_dir, sets, env):
    args = cmd + ["--set", "run.dir=" + run_dir]
    for s in COMMON + sets:
        args += ["--set", s]
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120, env=env)
    check(p.returncode == 0, "%s: exit %d: %s" % (" ".join(sets), p.returncode, p.stdout[-2000:]))
    ev = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl"))]
    start = [e for e in ev if e["event"] == "start"]
    steps = [(e["step"], e["loss"], e["grad_norm"]) for e in ev if e["event"] == "step"]
    check(len(start) == 1 and len(steps) == 2, "%s: want one start and 2 step events, got %d and %d" %
          (" ".join(sets), len(start), len(steps)))
    return start[0]["arena_bytes"], steps


def compare(work, cmd, mesh, levels, env):
    sets = ["parallel.mesh=" + mesh] if mesh else []
    rtol = RTOL
    ref_arena, ref = None, None
    arenas = []
    for lv in levels:
        arena, steps = run(cmd, os.path.join(work, "%s-%s" % (mesh or "1", lv)), sets + ["train.recompute=" + lv],
                           env)
        if ref is None:
            ref_arena, ref = arena, steps
        same = steps == ref if rtol == 0 else len(steps) == len(ref) and all(
            a[0] == b[0] and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a[1:], b[1:])) for a, b in zip(steps, ref))
        check(same, "%s recompute=%s: loss/grad_norm differ from none%s: %s vs %s" %
              (mesh or "1 rank", lv, " by more than %g relative" % rtol if rtol else "",
               [(n, float.hex(l), float.hex(g)) for n, l, g in steps], [(n, float.hex(l), float.hex(g)) for n, l, g in ref]))
        check(not arenas or arena < arenas[-1], "%s recompute=%s: arena %d not below the previous level's %d" %
              (mesh or "1 rank", lv, arena, arenas[-1] if arenas else 0))
        arenas.append(arena)
    print("PASS %s%s: %s %s over 2 steps; arena %s bytes" %
          (mesh or "1 rank", " " + BACKEND + " " + (PRECISION or "fp32") if BACKEND else "", "/".join(levels),
           "bitwise equal" if rtol == 0 else "within %g" % rtol, " > ".join(str(a) for a in arenas)))
    return arenas


def main():
    ranks, dgtrain, mpi = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if BACKEND == "cuda" and dgskip.gpus_present() < 1:
        return dgskip.skip("no GPU: the CUDA recompute cases need one", gpus=1)
    with tempfile.TemporaryDirectory() as work:
        if ranks == 1 and BACKEND:
            compare(work, [dgtrain], None, LEVELS, env)
        elif ranks == 1:
            arenas = compare(work, [dgtrain], None, LEVELS, env)
            p = subprocess.run([dgtrain, "--set", "run.dir=" + os.path.join(work, "dry")] +
                               sum((["--set", s] for s in COMMON), []) + ["--dry-run", "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=60, env=env)
            check(p.returncode == 0, "--dry-run --json: exit %d" % p.returncode)
            by = json.loads(p.stdout)["plan"]["activation_arena_by_recompute"]
            check([by[lv] for lv in LEVELS] == arenas, "--dry-run's arena by level %s, the runs planned %s" %
                  (by, arenas))
            print("PASS --dry-run --json: activation_arena_by_recompute %s = the runs' arenas" % by)
        else:
            cmd = mpi + ["-n", str(ranks), dgtrain]
            for mesh in ("dp_replicate=1,dp_shard=2,tp=1", "dp_replicate=1,dp_shard=1,tp=2"):
                compare(work, cmd, mesh, ["none", "selective", "full"], env)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Fail as e:
        print("FAIL: %s" % e)
        sys.exit(1)
