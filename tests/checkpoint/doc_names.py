#!/usr/bin/env python3
"""doc_names.py SOURCE_DIR DGTRAIN — docs/checkpoint-format.md names only what dgtrain really writes.

Trains a tiny model for one step with a checkpoint (the real dgtrain, its save.c), lists the file with
h5ls -r (HDF5's own tool, no dgtrain code) and checks: every concrete object path the doc names
(`/model/...`, `/optim/...`, `/state...`, `/manifest`, and `f["..."]` in its h5py example) exists in
the file, and every top-level object of the file has its line in the doc's Layout block."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

CONFIG = """[model]
preset = custom
n_layer = 1
n_head = 2
d_model = 32
seq_len = 32
vocab_size = 256
[data]
val_every = 0
[train]
steps = 1
global_batch = 2
micro_batch = 1
[parallel]
backend = cpu
threads = 1
[checkpoint]
every = 1
"""


def doc_paths(text):
    paths = set(re.findall(r"(?<![A-Za-z0-9_.])(/(?:model|optim|state)(?:/[A-Za-z0-9._-]+)+|/manifest)\b", text))
    paths |= {"/" + p for p in re.findall(r'f\["([A-Za-z0-9._/-]+)"\]', text)}
    return sorted(p for p in paths if ".." not in p)


def layout_top_level(text):
    m = re.search(r"## Layout\s*\n```\n(.*?)\n```", text, re.S)
    if not m:
        raise SystemExit("FAIL: docs/checkpoint-format.md has no ## Layout code block")
    return {re.match(r"/([A-Za-z0-9._-]*)", l).group(1) for l in m.group(1).splitlines() if l.startswith("/")}


def main():
    src, dgtrain = sys.argv[1], os.path.abspath(sys.argv[2])
    h5ls = shutil.which("h5ls")
    if not h5ls:
        print("FAIL: h5ls not found (apt-get install hdf5-tools)")
        return 1
    with open(os.path.join(src, "docs", "checkpoint-format.md")) as f:
        text = f.read()
    work = tempfile.mkdtemp(prefix="dgt-ckdoc-")
    try:
        cfg = os.path.join(work, "cfg.ini")
        with open(cfg, "w") as f:
            f.write(CONFIG)
        run = os.path.join(work, "run")
        p = subprocess.run([dgtrain, cfg, "--set", "run.dir=" + run], cwd=work, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=180,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        ck = os.path.join(run, "checkpoints", "step_00000001.h5")
        if p.returncode != 0 or not os.path.isfile(ck):
            print("FAIL: dgtrain exited %d without %s: %s" % (p.returncode, ck, p.stdout[-800:]))
            return 1
        ls = subprocess.run([h5ls, "-r", ck], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=60)
        if ls.returncode != 0:
            print("FAIL: h5ls -r %s exited %d: %s" % (ck, ls.returncode, ls.stdout[-400:]))
            return 1
        have = {l.split()[0] for l in ls.stdout.splitlines() if l.startswith("/")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    failed = 0
    named = doc_paths(text)
    if not named:
        print("FAIL: found no object path in docs/checkpoint-format.md (the extraction is broken)")
        return 1
    for path in named:
        if path not in have:
            print("FAIL: docs/checkpoint-format.md names %s, which the checkpoint does not contain" % path)
            failed += 1
    top = {h.split("/")[1] for h in have if h != "/"}
    listed = layout_top_level(text)
    for t in sorted(top - listed):
        print("FAIL: the checkpoint has top-level /%s, which the doc's Layout block does not list" % t)
        failed += 1
    if failed:
        return 1
    print("PASS: all %d object paths the doc names exist (%s); top level %s all in the Layout block"
          % (len(named), ", ".join(named), sorted(top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
