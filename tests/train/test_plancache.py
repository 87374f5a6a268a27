#!/usr/bin/env python3
"""test_plancache.py CASE DGTRAIN MPIEXEC [MPIEXEC FLAGS...] — the plan cache and the circuit breaker of the
model build (src/model/plancache.c, model.c; docs/cuda.md "Plan cache") with the real dgtrain on the CPU.

  cache     2 ranks (dp_shard=2), one shared run.plan_cache: the first run misses and writes one entry per
            rank; a second run (another run.dir) hits on both ranks with bitwise the same losses; a keyed
            option changed (train.recompute=gelu) is "stale" naming the key field, and rewrites the entry;
            a stored probe checksum damaged (the file's checksum made right again) is "stale" with the
            probe check; a truncated entry is "corrupt" with a warning, the run still trains, the entry is
            rewritten and the next run hits; `dgtrain report` shows the outcomes
  timeout   1 rank, DG_TEST_SLOW_BUILD_MS=150 and run.compile_timeout_s=0.3: FALLBACK_COMPILE_TIMEOUT in a
            fallback event and in the log, and the run trains to the losses of the planned path (1e-5)
  oom       1 rank, run.compile_mem_budget_mb=0.5: FALLBACK_COMPILE_OOM, same losses
"""
import glob
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import dgrun  # noqa: E402
from dgrun import check  # noqa: E402


def run(exe, mpi, n, cfg, run_dir, sets=(), env=None):
    cmd = list(mpi) + ["-n", str(n), exe, cfg, "--set", "run.dir=" + run_dir]
    cmd += [a for s in sets for a in ("--set", s)]
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240, env=e)
    check(p.returncode == 0, "exit %d: %s" % (p.returncode, p.stdout[-2000:]))
    return p.stdout


def events(run_dir, kind):
    rows = [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if l.strip()]
    return [r for r in rows if r["event"] == kind]


def start(run_dir):
    s = events(run_dir, "start")
    check(len(s) == 1, "%d start events in %s" % (len(s), run_dir))
    for k in ("plan_cache", "plan_cache_reason", "graph_freeze_s", "plan_build_s"):
        check(k in s[0], "start event without %s: %s" % (k, s[0]))
    check(s[0]["graph_freeze_s"] >= 0, "graph_freeze_s %s" % s[0]["graph_freeze_s"])
    return s[0]


def losses(run_dir):
    return [e["loss"] for e in events(run_dir, "step")]


def fnv1a(data):
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def damage_probe(path):
    """Changes the stored probe loss and writes the header checksum that matches the changed bytes."""
    raw = open(path, "rb").read()
    nl = raw.index(b"\n")
    rest = raw[nl + 1:]
    i = rest.index(b"probe.loss=")
    j = rest.index(b"\n", i)
    rest = rest[:i] + b"probe.loss=0x1.8p+2" + rest[j:]  # 6.0: not this model's loss
    with open(path, "wb") as f:
        f.write(b"DGPLAN 1 %d %016x\n" % (len(rest), fnv1a(rest)) + rest)


def close(a, b, tol=1e-5):
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


def main():
    case, exe, mpi = sys.argv[1], sys.argv[2], sys.argv[3:]

    def body(work):
        cfg = os.path.join(work, "cfg.ini")
        with open(cfg, "w") as f:
            f.write(dgrun.small_gpt("written by tests/train/test_plancache.py", run={"name": "pc", "seed": 9},
                                    train={"steps": 4, "global_batch": 4, "micro_batch": 2, "warmup_steps": 1}))
        cache = os.path.join(work, "cache")
        pc = "run.plan_cache=" + cache
        if case == "cache":
            two = ("parallel.mesh=dp_shard=2", pc)
            d1, d2 = os.path.join(work, "r1"), os.path.join(work, "r2")
            run(exe, mpi, 2, cfg, d1, two)
            s = start(d1)
            check(s["plan_cache"] == "miss", "first run: %s" % s)
            entries = sorted(glob.glob(os.path.join(cache, "plan-*.bin")))
            check(len(entries) == 2, "entries after the first 2-rank run: %s" % entries)
            # the binary and each library by its GNU build ID (read from memory), else by a hash of the
            # file remembered in libhash.txt, so that a second run hashes nothing again
            with open(entries[0], "rb") as f:
                head = f.read(65536).split(b"\nend\n")[0].decode("utf-8", "replace")
            keys = dict(l.split("=", 1) for l in head.splitlines() if l.startswith("key.") and "=" in l)
            libs = [k for k in keys if k.startswith("key.lib.")]
            check("key.binary" in keys and libs, "entry lacks key.binary / key.lib.*: %r" % head[:500])
            check(any(k.startswith("key.lib.libmpi") for k in libs), "libmpi not identified: %r" % libs)
            side = os.path.join(cache, "libhash.txt")
            hashed = [k for k in ["key.binary"] + libs if not keys.get(k, "").startswith("bid:")]
            if hashed:
                check(os.path.exists(side), "objects without a build ID (%s) but no libhash.txt sidecar" % hashed)
            if "key.binary" in hashed:
                check("dgtrain" in open(side).read(), "libhash.txt does not name the binary")
            side_mtime = os.stat(side).st_mtime_ns if os.path.exists(side) else None
            run(exe, mpi, 2, cfg, d2, two)
            check((os.stat(side).st_mtime_ns if os.path.exists(side) else None) == side_mtime,
                  "libhash.txt rewritten: the libraries were hashed again")
            s = start(d2)
            check(s["plan_cache"] == "hit", "second run: %s" % s)
            check(losses(d1) == losses(d2) and len(losses(d1)) == 4,
                  "losses differ after a hit: %s vs %s" % (losses(d1), losses(d2)))
            print("  2 ranks: miss (%d entries), then hit with bitwise the same losses %s" % (len(entries), losses(d2)))
            ref = losses(d1)
            d3 = os.path.join(work, "r3")
            run(exe, mpi, 2, cfg, d3, two + ("train.recompute=gelu",))
            s = start(d3)
            check(s["plan_cache"] == "stale" and "flags" in s["plan_cache_reason"], "recompute changed: %s" % s)
            print("  keyed option changed: stale (%s)" % s["plan_cache_reason"])
            d4 = os.path.join(work, "r4")
            run(exe, mpi, 2, cfg, d4, two + ("train.recompute=gelu",))
            check(start(d4)["plan_cache"] == "hit", "after the rewrite: %s" % start(d4))
            for e in sorted(glob.glob(os.path.join(cache, "plan-*.bin")))[:1]:
                damage_probe(e)
            d5 = os.path.join(work, "r5")
            out = run(exe, mpi, 2, cfg, d5, two + ("train.recompute=gelu",))
            s = start(d5)
            check(s["plan_cache"] == "stale" and "probe check failed" in s["plan_cache_reason"],
                  "damaged probe checksum: %s" % s)
            check(losses(d5) == losses(d4), "losses after the probe rebuild differ")
            print("  damaged probe checksum: stale (%s)" % s["plan_cache_reason"])
            for e in glob.glob(os.path.join(cache, "plan-*.bin")):
                size = os.path.getsize(e)
                with open(e, "r+b") as f:
                    f.truncate(size // 2)
            d6 = os.path.join(work, "r6")
            out = run(exe, mpi, 2, cfg, d6, two + ("train.recompute=gelu",))
            s = start(d6)
            check(s["plan_cache"] == "corrupt" and "truncated" in s["plan_cache_reason"], "truncated: %s" % s)
            check("corrupt entry" in out and "WARN" in out, "no warning for the corrupt entry: %s" % out[-1500:])
            check(losses(d6) == losses(d4), "losses after the corrupt rebuild differ")
            d7 = os.path.join(work, "r7")
            run(exe, mpi, 2, cfg, d7, two + ("train.recompute=gelu",))
            check(start(d7)["plan_cache"] == "hit", "after the corrupt entry was rewritten: %s" % start(d7))
            print("  truncated entry: corrupt with a warning, the run trains, rewritten (the next run hits)")
            check(close(losses(d4), ref), "recompute=gelu losses %s vs %s" % (losses(d4), ref))
            p = subprocess.run([exe, "report", d6], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=60)
            check(p.returncode == 0 and "plan cache" in p.stdout and "corrupt" in p.stdout,
                  "report: exit %d: %s" % (p.returncode, p.stdout))
            p = subprocess.run([exe, "report", d6, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, timeout=60)
            check(p.returncode == 0 and json.loads(p.stdout).get("plan_cache", {}).get("outcome") == "corrupt",
                  "report --json: %s" % p.stdout[-800:])
            print("  dgtrain report (text, --json) shows the cache outcome")
        elif case in ("timeout", "oom"):
            d0 = os.path.join(work, "planned")
            run(exe, mpi, 1, cfg, d0, ("run.plan_cache=off",))
            check(start(d0)["plan_cache"] == "off" and not events(d0, "fallback"), "planned run: %s" % start(d0))
            d = os.path.join(work, case)
            if case == "timeout":
                out = run(exe, mpi, 1, cfg, d, (pc, "run.compile_timeout_s=0.3"), {"DG_TEST_SLOW_BUILD_MS": "150"})
                want = "FALLBACK_COMPILE_TIMEOUT"
            else:
                out = run(exe, mpi, 1, cfg, d, (pc, "run.compile_mem_budget_mb=0.5"))
                want = "FALLBACK_COMPILE_OOM"
            fb = [e for e in events(d, "fallback") if e.get("id") == want]
            check(len(fb) == 1 and fb[0]["reason"], "fallback events: %s" % events(d, "fallback"))
            check(want in out, "no %s log line: %s" % (want, out[-1500:]))
            s = start(d)
            check(s["plan_fallback"] == want, "start event: %s" % s)
            check(not glob.glob(os.path.join(cache, "plan-*.bin")), "the conservative plan was cached")
            check(close(losses(d), losses(d0)), "conservative losses %s vs planned %s" % (losses(d), losses(d0)))
            print("  %s (%s); losses %s match the planned run's" % (want, fb[0]["reason"][:100], losses(d)))
        else:
            raise SystemExit("unknown case " + case)

    return dgrun.in_workdir("dgt-pc-", body)


if __name__ == "__main__":
    sys.exit(main())
