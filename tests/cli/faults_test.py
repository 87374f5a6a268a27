#!/usr/bin/env python3
"""faults_test.py — the training-data, configuration and run-directory faults of docs/reliability.md,
provoked for real on a real dgtrain under mpiexec, judged as a user sees them: the exit code, the one
error line on stderr, each rank's log, metrics.jsonl, and the files in the run directory.

    faults_test.py --dgtrain PATH --dgprep PATH --mpiexec PATH --mpiflags "FLAGS" --work-dir DIR CASE

Cases (one ctest each, see CMakeLists.txt):
  shard_truncate:K  a shard truncated while K ranks train on it: exit 2 on every rank within
                    health.timeout_s + 10 s, one line naming the file and the byte offset, no signal
  shard_truncate_one:2  the same where only one rank reads the truncated shard at the failing step: the
                    other must not be left waiting in a model collective
  shard_header:K    the same for a shard whose header is rewritten in place
  lock              a second dgtrain on a run directory in use is refused (exit 1) naming the holder
                    (host, pid, Slurm job, start time) and writes nothing there; after the holder is
                    SIGKILLed a new run takes the lock and resumes from its checkpoint; run.lock=none
                    and the fallback for file systems without locks
  symlinks          links planted at metrics.jsonl, logs/rank-0.log, dgtrain.lock, data/.default.lock are
                    refused and their targets untouched; one at checkpoints/LATEST is replaced; a run.dir
                    and a checkpoint.dir that are themselves symlinks work
  umask             under umask 000 nothing in the run directory is world-writable
  ckpt_dir          a relative checkpoint.dir is relative to run.dir, not to the working directory
  config_edges      global batch larger than the training or validation data (training and --dry-run),
                    val_batches cut to the validation set, empty mesh entries, a config from a FIFO
  json_bytes        a run.dir holding 0xff and a config path holding control characters and 0xff:
                    --dry-run/--topology/--plan-only --json and metrics.jsonl parse as strict JSON
"""
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import dgrun  # noqa: E402
import clitest  # noqa: E402  (tests/cli/clitest.py)
from clitest import check  # noqa: E402

A = None

CONFIG = dgrun.small_gpt(
    "written by tests/cli/faults_test.py: a small custom GPT, fp32 on the CPU, one thread per rank",
    run={"name": "faults"},
    train={"steps": 3000, "global_batch": 4, "micro_batch": 1, "warmup_steps": 2, "log_every": 1000},
    extra={"health": {"heartbeat_s": 1, "timeout_s": 30}},
)
TIMEOUT_S = 30  # health.timeout_s above


def w(*parts):
    return os.path.join(A.work_dir, *parts)


def fresh(name):
    d = w(name)
    shutil.rmtree(d, ignore_errors=True)
    return d


def config_file():
    p = w("faults.ini")
    with open(p, "w") as f:
        f.write(CONFIG)
    return p


def cmd(ranks, args):
    c = [A.dgtrain, config_file()] + args
    if ranks:
        c = [A.mpiexec] + shlex.split(A.mpiflags) + ["-n", str(ranks)] + c
    return c


def run(ranks, args, timeout=120, env=None, cwd=None, umask=None):
    """Runs dgtrain to its end: (rc, stdout, stderr, seconds)."""
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e.update(env or {})
    pre = (lambda: os.umask(umask)) if umask is not None else None
    t0 = time.time()
    p = subprocess.run(cmd(ranks, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout, env=e,
                       cwd=cwd or A.work_dir, preexec_fn=pre)
    return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace"), time.time() - t0


def start(ranks, args, out_path, env=None):
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e.update(env or {})
    f = open(out_path, "wb")
    return subprocess.Popen(cmd(ranks, args), stdout=f, stderr=subprocess.STDOUT, env=e, cwd=A.work_dir,
                            start_new_session=True), f


def error_lines(text):
    return [l for l in text.splitlines() if l.startswith("dgtrain: error")]


def steps_in(run_dir):
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return sum(1 for l in f if '"event":"step"' in l)
    except OSError:
        return 0


def wait_for(pred, what, timeout=120, proc=None):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if pred():
            return True
        if proc is not None and proc.poll() is not None:
            check(False, "%s: dgtrain ended (exit %s) first" % (what, proc.returncode))
            return False
        time.sleep(0.05)
    check(False, "%s: not within %d s" % (what, timeout))
    return False


def stop(proc, f):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    f.close()


def metrics(run_dir):
    """Every metrics.jsonl line, parsed strictly (raises on an invalid one)."""
    out = []
    with open(os.path.join(run_dir, "metrics.jsonl"), "rb") as f:
        for raw in f:
            out.append(json.loads(raw.decode("utf-8")))
    return out


def make_shards(name):
    d = fresh(name)
    os.makedirs(d)
    subprocess.run([A.dgprep, "--out", d, "--quiet", "/usr/share/common-licenses"], check=True,
                   stdout=subprocess.DEVNULL, timeout=120)
    return os.path.join(d, "default_train_000000.bin")


# ---------------------------------------------------------------- training data

def write_shard(path, n_samples):
    """An llm.c shard of exactly n_samples windows of 33 tokens (seq_len 32) of byte text."""
    words = [b"the", b"of", b"data", b"rank", b"model", b"step", b"and", b"loss", b"a", b"check", b"point"]
    n_tok, out, x = n_samples * 32 + 1, bytearray(), 12345
    while len(out) < n_tok:
        x = (1103515245 * x + 12345) % 2**31
        out += words[(x >> 16) % len(words)] + b" "
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, n_tok, *([0] * 253)) + struct.pack("<%dH" % n_tok, *out[:n_tok]))


def case_shard(kind, ranks):
    sets = []
    if kind == "truncate_one":
        # Unshuffled, 2 ranks, 4 samples a step (rank 0 reads positions 4s and 4s+2, rank 1 4s+1 and 4s+3):
        # shard 0 holds 4*2000+3 samples, so at step 2000 only rank 1 reads from shard 1 (truncated
        # right after the first step, while the run is still far from it). That rank alone fails; the other must not be left waiting in
        # a model collective: both stop at the step agreement with the same line and exit 2.
        sd = fresh("shards_one")
        os.makedirs(sd)
        write_shard(os.path.join(sd, "x_000.bin"), 8003)
        shard = os.path.join(sd, "x_001.bin")
        write_shard(shard, 300)
        sets = ["--set", "data.train=" + os.path.join(sd, "x_*.bin"), "--set", "data.shuffle=false"]
    else:
        shard = make_shards("shards_%s_%d" % (kind, ranks))
        sets = ["--set", "data.train=" + shard]
    d = fresh("shard_%s_%d" % (kind, ranks))
    out = d + ".out"
    os.makedirs(d)
    # far more steps than the run can take before the change: at about 1 ms a step the configured 3000 could
    # end (exit 0) between the third step line and the change on a loaded machine, as CI once saw
    sets += ["--set", "train.steps=1000000"]
    proc, f = start(ranks, ["--set", "run.dir=" + d] + sets, out)
    if not wait_for(lambda: steps_in(d) >= (1 if kind == "truncate_one" else 3), "training steps", proc=proc):
        stop(proc, f)
        return
    size = os.path.getsize(shard)
    if kind.startswith("truncate"):
        os.truncate(shard, size // 3)
    else:
        with open(shard, "r+b") as sf:  # the token count at byte offset 8, file size unchanged
            sf.seek(8)
            sf.write(struct.pack("<i", 12345))
    t0 = time.time()
    try:
        rc = proc.wait(timeout=TIMEOUT_S + 10)
    except subprocess.TimeoutExpired:
        check(False, "%s at %d ranks: dgtrain still running %d s after the change" % (kind, ranks, TIMEOUT_S + 10))
        stop(proc, f)
        return
    dt = time.time() - t0
    f.close()
    with open(out, errors="replace") as fo:
        text = fo.read()
    lines = error_lines(text)
    print("  %s at %d rank(s): exit %d after %.1f s: %s" % (kind, ranks, rc, dt, lines[:1]))
    check(rc == 2, "%s at %d ranks: exit code 2 (got %d)" % (kind, ranks, rc))
    check(len(lines) == 1, "%s at %d ranks: exactly one error line (got %r)" % (kind, ranks, lines))
    want = "header rewritten while training" if kind == "header" else "file truncated while training"
    if lines:
        check(shard in lines[0] and "byte offset" in lines[0] and want in lines[0],
              "%s: the line names the file, the offset and what happened: %s" % (kind, lines[0]))
    for bad in ("Bus error", "SIGBUS", "signal 7", "exited on signal", "core dumped"):
        check(bad not in text, "%s at %d ranks: %r in the output (a signal)" % (kind, ranks, bad))
    # every rank says the same in its own log
    for r in range(ranks):
        with open(os.path.join(d, "logs", "rank-%d.log" % r), errors="replace") as lf:
            log = lf.read()
        check(want in log and shard in log, "%s: rank %d's log names the fault" % (kind, r))
    done = [m for m in metrics(d) if m["event"] == "done"]
    check(done and done[-1]["exit_code"] == 2 and want in done[-1]["error"], "done event: %r" % done[-1:])
    if kind == "truncate_one":
        check(done and done[-1]["step"] == 2000 and lines and "error on rank 1 " in lines[0],
              "rank 1 alone failed, at step 2001 (%r)" % done[-1:])


# ---------------------------------------------------------------- one run per run directory

def lock_record(d):
    with open(os.path.join(d, "dgtrain.lock")) as f:
        rec = f.read()
    return dict(kv.split("=", 1) for kv in rec.split()[1:])


def case_lock():
    host = socket.gethostname()
    d = fresh("lock")
    os.makedirs(d)
    out = d + ".first.out"
    first, f = start(2, ["--set", "run.dir=" + d, "--set", "checkpoint.every=5"], out)
    latest = os.path.join(d, "checkpoints", "LATEST")
    if not wait_for(lambda: os.path.exists(latest) and steps_in(d) >= 6, "a checkpoint of the first run",
                    proc=first):
        stop(first, f)
        return
    rec = lock_record(d)
    with open(os.path.join(d, "logs", "rank-0.log"), "rb") as lf:
        log_before = lf.read().count(b"dgtrain 0.1.0:")
    # the second run on the same directory: refused at once, naming the holder, writing nothing there
    for action in ([], ["--dry-run"]):
        rc, so, se, dt = run(2, ["--set", "run.dir=" + d] + action, timeout=60)
        lines = error_lines(se)
        check(rc == 1, "second run %s: exit 1 (got %d: %s)" % (action, rc, se[-400:]))
        check(len(lines) == 1, "second run: one error line (got %r)" % lines)
        if lines:
            want = ("run.dir %s is in use by another dgtrain run (host %s, pid %s, no Slurm job, started "
                    % (d, host, rec["pid"]))
            check(want in lines[0] and " UTC; lock file " in lines[0], "the holder is named: %s" % lines[0])
        check(dt < 30, "refused promptly (%.1f s)" % dt)
    with open(os.path.join(d, "logs", "rank-0.log"), "rb") as lf:
        check(lf.read().count(b"dgtrain 0.1.0:") == log_before, "the refused runs wrote into logs/rank-0.log")
    check(first.poll() is None, "the first run is still training")
    # a Slurm job id is named when there is one (the refused run's own environment does not matter)
    # the lock dies with its holder: SIGKILL rank 0 (the holder), the launcher ends the rest
    os.kill(int(rec["pid"]), signal.SIGKILL)
    try:
        first.wait(timeout=60)
    except subprocess.TimeoutExpired:
        check(False, "the first run did not end after its rank 0 was SIGKILLed")
    stop(first, f)
    with open(latest) as lf:
        ck = lf.read().strip()
    ck_step = int(re.search(r"step_(\d+)", ck).group(1))
    rc, so, se, dt = run(2, ["--set", "run.dir=" + d, "--set", "train.steps=%d" % (ck_step + 3)], timeout=120)
    check(rc == 0, "the run after the SIGKILL takes the lock and finishes (exit %d: %s)" % (rc, se[-400:]))
    ev = metrics(d)
    res = [m for m in ev if m["event"] == "resume"]
    check(res and res[-1]["step"] == ck_step, "it resumed from step %d: %r" % (ck_step, res[-1:]))
    check(lock_record(d)["pid"] != rec["pid"], "the lock file names the new holder")
    # run.lock = none: no lock taken (a --topology beside a holder)
    holder, hf = start(1, ["--set", "run.dir=" + d, "--set", "train.steps=3000"], d + ".holder.out")
    if wait_for(lambda: steps_in(d) > len([m for m in ev if m["event"] == "step"]) + 2, "the holder trains",
                proc=holder):
        rc, so, se, dt = run(1, ["--set", "run.dir=" + d, "--topology"], timeout=60)
        check(rc == 1 and "is in use by another dgtrain run" in se, "--topology beside a holder: refused (%d)" % rc)
        rc, so, se, dt = run(1, ["--set", "run.dir=" + d, "--topology", "--set", "run.lock=none"], timeout=60)
        check(rc == 0, "run.lock=none: not refused (%d: %s)" % (rc, se[-300:]))
    stop(holder, hf)
    # a file system without locks (test hook DG_TEST_FS_NO_LOCKS: fcntl answers ENOLCK): the fallback
    # still refuses a second run on this host, naming the holder; run.lock=fcntl refuses to run at all
    d2 = fresh("lock_nolocks")
    os.makedirs(d2)
    env = {"DG_TEST_FS_NO_LOCKS": "1"}
    holder, hf = start(1, ["--set", "run.dir=" + d2], d2 + ".out", env=env)
    if wait_for(lambda: steps_in(d2) >= 2, "the holder without locks trains", proc=holder):
        rc, so, se, dt = run(1, ["--set", "run.dir=" + d2, "--topology"], env=env, timeout=60)
        pid = lock_record(d2)["pid"]
        check(rc == 1 and "recorded without a lock" in se and "pid %s," % pid in se,
              "fallback: refused naming the holder (%d: %s)" % (rc, se[-400:]))
        with open(d2 + ".out", errors="replace") as ho:
            check("does not support fcntl locks" in ho.read(), "the holder warned about the fallback")
    stop(holder, hf)
    rc, so, se, dt = run(1, ["--set", "run.dir=" + d2, "--topology", "--set", "run.lock=fcntl"], env=env, timeout=60)
    check(rc == 1 and "does not support fcntl locks" in se, "run.lock=fcntl without locks: refused (%d: %s)"
          % (rc, se[-300:]))
    rc, so, se, dt = run(1, ["--set", "run.dir=" + d2, "--topology"], env=env, timeout=60)
    check(rc == 0, "fallback: the holder is dead, the next run starts (%d: %s)" % (rc, se[-300:]))


# ---------------------------------------------------------------- files in the run directory

def case_symlinks():
    outside = w("outside.txt")

    def plant(d, name):
        with open(outside, "w") as f:
            f.write("precious\n")
        p = os.path.join(d, name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        os.symlink(outside, p)
        return p

    for name in ("metrics.jsonl", "logs/rank-0.log", "dgtrain.lock", "data/.default.lock"):
        d = fresh("link_" + name.replace("/", "_"))
        p = plant(d, name)
        rc, so, se, dt = run(1, ["--set", "run.dir=" + d, "--set", "train.steps=2"], timeout=120)
        lines = error_lines(se)
        check(rc == 1, "link at %s: exit 1 (got %d: %s)" % (name, rc, se[-300:]))
        check(len(lines) == 1 and p in lines[0] and "symbolic link" in lines[0] and outside in lines[0],
              "link at %s: one line naming it and its target: %r" % (name, lines))
        with open(outside) as f:
            check(f.read() == "precious\n", "link at %s: its target was written" % name)
    # LATEST is written by rename: a link there is replaced, its target untouched
    # (and the partial file HDF5 creates the checkpoint in is unlinked first)
    d = fresh("link_latest")
    p = plant(d, "checkpoints/LATEST")
    os.symlink(outside, os.path.join(d, "checkpoints", "step_00000002.h5.partial"))
    rc, so, se, dt = run(1, ["--set", "run.dir=" + d, "--set", "train.steps=2"], timeout=120)
    check(rc == 0, "link at LATEST: the run finishes (%d: %s)" % (rc, se[-300:]))
    check(not os.path.islink(p) and open(p).read().startswith("step_"), "LATEST is a regular file now")
    check(os.path.isfile(os.path.join(d, "checkpoints", "step_00000002.h5")), "the checkpoint was written")
    with open(outside) as f:
        check(f.read() == "precious\n", "LATEST's or the partial file's link target was written")
    # a run.dir and a checkpoint.dir that are themselves symlinks chosen by the user work
    real, alias = fresh("real_run"), fresh("alias_run")
    os.makedirs(real)
    os.symlink(real, alias)
    ckreal, ckalias = fresh("real_ck"), fresh("alias_ck")
    os.makedirs(ckreal)
    os.symlink(ckreal, ckalias)
    rc, so, se, dt = run(1, ["--set", "run.dir=" + alias, "--set", "train.steps=2", "--set",
                             "checkpoint.dir=" + ckalias], timeout=120)
    check(rc == 0, "symlinked run.dir and checkpoint.dir: the run finishes (%d: %s)" % (rc, se[-300:]))
    check(os.path.isfile(os.path.join(real, "metrics.jsonl")) and os.path.isfile(os.path.join(real, "logs",
                                                                                              "rank-0.log")),
          "metrics and logs are in the link's target")
    check(os.path.isfile(os.path.join(ckreal, "LATEST")), "the checkpoint is in checkpoint.dir's target")


def case_umask():
    d = fresh("umask")
    rc, so, se, dt = run(2, ["--set", "run.dir=" + d, "--set", "train.steps=2", "--set", "checkpoint.every=1",
                             "--set", "data.val_every=1"], timeout=120, umask=0)
    check(rc == 0, "run under umask 000 (%d: %s)" % (rc, se[-300:]))
    n = 0
    for root, dirs, files in os.walk(d):
        for x in dirs + files + ([""] if root == d else []):
            p = os.path.join(root, x)
            m = os.lstat(p).st_mode
            n += 1
            check(not (m & stat.S_IWOTH), "world-writable under umask 000: %s (%o)" % (p, m & 0o777))
    check(n >= 8, "the run wrote its files (%d)" % n)


def case_ckpt_dir():
    d = fresh("ckrel")
    other = fresh("elsewhere")
    os.makedirs(other)
    rc, so, se, dt = run(1, ["--set", "run.dir=" + d, "--set", "train.steps=2", "--set", "checkpoint.dir=ck"],
                         timeout=120, cwd=other)
    check(rc == 0, "relative checkpoint.dir (%d: %s)" % (rc, se[-300:]))
    check(os.path.isfile(os.path.join(d, "ck", "LATEST")), "the checkpoint is in run.dir/ck")
    check(not os.path.exists(os.path.join(other, "ck")), "nothing in the working directory")
    ev = [m for m in metrics(d) if m["event"] == "checkpoint"]
    check(ev and ev[-1]["path"].startswith(os.path.join(d, "ck") + "/"), "the event names it: %r" % ev[-1:])
    # and the resume reads from there, whatever the working directory
    rc, so, se, dt = run(1, ["--set", "run.dir=" + d, "--set", "train.steps=3", "--set", "checkpoint.dir=ck"],
                         timeout=120, cwd=A.work_dir)
    res = [m for m in metrics(d) if m["event"] == "resume"]
    check(rc == 0 and res and res[-1]["step"] == 2, "resumed from run.dir/ck: %r" % res[-1:])


# ---------------------------------------------------------------- configuration and command line

def one_error(args, want, ranks=1, **kw):
    # an error every rank agrees on and reports before MPI_Finalize (whose fence no rank leaves early):
    # mpiexec's grace between SIGTERM and SIGKILL for the other ranks (odls_base_sigkill_timeout, 1 s) is
    # waited twice even when every rank has exited, ~2 s of idle wall time per case
    kw["env"] = dict(kw.get("env") or {}, OMPI_MCA_odls_base_sigkill_timeout="0")
    rc, so, se, dt = run(ranks, args, **kw)
    lines = error_lines(se)
    check(rc == 1, "%s: exit 1 (got %d: %s)" % (args, rc, se[-300:]))
    check(len(lines) == 1 and want in lines[0], "%s: one line with %r: %r" % (args, want, lines))
    return so, se


def case_config_edges():
    d = fresh("edges")
    # the default data at seq_len 32: 214180 train tokens -> 6693 samples of 33 tokens, 23140 val -> 723
    gb = ["--set", "train.global_batch=1000000000", "--set", "train.micro_batch=1"]
    want = ("train.global_batch = 1000000000 is larger than the training data: data.train (the embedded "
            "default data) yields 6693 samples of seq_len+1 = 33 tokens")
    one_error(["--set", "run.dir=" + d] + gb, want, ranks=2, timeout=120)
    so, se = one_error(["--set", "run.dir=" + d, "--dry-run", "--json"] + gb, want, ranks=2, timeout=120)
    check(so == "", "--dry-run refuses before printing anything (%r)" % so[:100])
    one_error(["--set", "run.dir=" + d, "--set", "train.global_batch=6694", "--dry-run"],
              "train.global_batch = 6694 is larger than the training data", timeout=120)
    rc, so, se, dt = run(1, ["--set", "run.dir=" + d, "--set", "train.global_batch=6693", "--dry-run"], timeout=120)
    check(rc == 0, "global batch = the training set: accepted (%d: %s)" % (rc, se[-300:]))
    one_error(["--set", "run.dir=" + d, "--set", "train.global_batch=724", "--set", "data.val_every=1", "--dry-run"],
              "train.global_batch = 724 is larger than the validation data: data.val (the embedded default data) "
              "yields 723 samples", timeout=120)
    rc, so, se, dt = run(1, ["--set", "run.dir=" + d, "--set", "train.global_batch=724", "--dry-run"], timeout=120)
    check(rc == 0, "no validation (val_every = 0): the val set does not limit the batch (%d)" % rc)
    # val_batches x global_batch beyond the validation set: cut to what it holds, with a warning
    dv = fresh("edges_val")
    rc, so, se, dt = run(2, ["--set", "run.dir=" + dv, "--set", "train.steps=1", "--set", "data.val_every=1",
                             "--set", "train.global_batch=300", "--set", "train.micro_batch=150",
                             "--set", "data.val_batches=5"], timeout=180)
    check(rc == 0, "val_batches cut: the run finishes (%d: %s)" % (rc, se[-300:]))
    check("each evaluation reads 2 batches" in se and se.count("each evaluation reads") == 1,
          "one warning naming the batches: %s" % se[-500:])
    val = [m for m in metrics(dv) if m["event"] == "val"]
    check(val and val[-1]["batches"] == 2, "the val event says 2 batches: %r" % val[-1:])
    # empty or malformed mesh entries
    for m in (",,,", "dp_shard=2,", ",dp_shard=2", "dp_shard=1,,tp=2"):
        one_error(["--print-config", "--set", "parallel.mesh=" + m], "is empty (expected 'auto' or name=value")
    # a config passed through a FIFO (bash process substitution) keeps working
    p = subprocess.run(["bash", "-c", 'exec "$0" <(printf "[train]\\nsteps = 77\\n") --print-config', A.dgtrain],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60, cwd=A.work_dir)
    check(p.returncode == 0 and re.search(rb"^train.steps = 77 ", p.stdout, re.M), "config from a FIFO: %d %r"
          % (p.returncode, p.stderr[-300:]))


def case_json_bytes():
    # every byte here is ASCII or not part of valid UTF-8, so the documented rule reads them as Latin-1
    d = os.fsencode(w("")) + b"run\xff\\dir"
    shutil.rmtree(d, ignore_errors=True)
    cfg = os.fsencode(w("")) + b"cfg\x01\t\xfe\xc3(.ini"
    with open(cfg, "wb") as f:
        f.write(CONFIG.encode())
    base = [A.mpiexec] + shlex.split(A.mpiflags)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for action in (["--dry-run", "--json"], ["--topology", "--json"], ["--plan-only", "--json"]):
        c = [os.fsencode(x) for x in base + ["-n", "2", A.dgtrain]] + [cfg, b"--set", b"run.dir=" + d] + \
            [a.encode() for a in action]
        p = subprocess.run(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120, env=env, cwd=A.work_dir)
        check(p.returncode == 0, "%s: exit 0 (%d: %r)" % (action, p.returncode, p.stderr[-300:]))
        try:
            doc = json.loads(p.stdout.decode("utf-8"))  # strict: valid UTF-8, no raw control characters
        except (UnicodeDecodeError, ValueError) as e:
            check(False, "%s: stdout is strict JSON (%s): %r" % (action, e, p.stdout[:300]))
            continue
        if action[0] == "--dry-run":
            check(doc["run"]["dir"] == d.decode("latin-1") and doc["run"]["config"] == cfg.decode("latin-1"),
                  "the strings read back by the documented rule: %r" % doc["run"])
    # metrics.jsonl of a training run in that directory (the checkpoint event holds the path)
    c = [os.fsencode(x) for x in base + ["-n", "1", A.dgtrain]] + [cfg, b"--set", b"run.dir=" + d, b"--set",
                                                                    b"train.steps=2"]
    p = subprocess.run(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120, env=env, cwd=A.work_dir)
    check(p.returncode == 0, "training in a 0xff run.dir (%d: %r)" % (p.returncode, p.stderr[-300:]))
    with open(os.path.join(d, b"metrics.jsonl"), "rb") as f:
        lines = f.read().splitlines()
    ok = 0
    for raw in lines:
        try:
            m = json.loads(raw.decode("utf-8"))
            ok += 1
            if m["event"] == "checkpoint":
                check("run\xff\\dir" in m["path"], "the checkpoint path reads back: %r" % m["path"])
        except (UnicodeDecodeError, ValueError) as e:
            check(False, "metrics line is not strict JSON (%s): %r" % (e, raw[:200]))
    check(ok == len(lines) and ok >= 4, "every metrics line parses (%d of %d)" % (ok, len(lines)))


CASES = {
    "shard_truncate:1": lambda: case_shard("truncate", 1),
    "shard_truncate:2": lambda: case_shard("truncate", 2),
    "shard_truncate_one:2": lambda: case_shard("truncate_one", 2),
    "shard_header:1": lambda: case_shard("header", 1),
    "shard_header:2": lambda: case_shard("header", 2),
    "lock": case_lock,
    "symlinks": case_symlinks,
    "umask": case_umask,
    "ckpt_dir": case_ckpt_dir,
    "config_edges": case_config_edges,
    "json_bytes": case_json_bytes,
}


def main():
    global A
    A = clitest.parse_args(CASES, "--dgprep")
    A.dgprep = os.path.abspath(A.dgprep)
    return clitest.run_case(A, CASES)

if __name__ == "__main__":
    sys.exit(main())
