#!/usr/bin/env python3
"""dgtrain with a pipeline mesh (docs/parallelism.md): training with pp=2 on one rank is refused (exit 1,
the mesh needs 2 ranks); --plan-only on the 8 x 8 H100 description with gpt2-1558m chooses a pipeline, prints the
stage split and writes the timeline SVG (one box per forward / backward); on one NVLink node gpt2-124m the
planner rejects pp and says why; --pp-timeline goes with --plan-only only.
Usage: pp_cli_test.py SOURCE_DIR DGTRAIN WORKDIR"""
import os
import subprocess
import sys

src, dgtrain, work = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(work, exist_ok=True)
env = dict(os.environ, OMP_NUM_THREADS="1")
data = os.path.join(src, "tests", "planner", "data")
fails = 0


def run(*args):
    p = subprocess.run([dgtrain] + list(args), cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=120, env=env)
    return p.returncode, p.stdout


def check(cond, what, out=""):
    global fails
    if not cond:
        fails += 1
        print("FAIL: %s\n%s" % (what, out[-2000:]))
    else:
        print("ok   %s" % what)


rc, out = run("--set", "parallel.mesh=pp=2", "--set", "run.dir=%s/train" % work)
check(rc == 1 and "has 2 ranks but the world size is 1" in out, "training with pp=2 on one rank refused (exit %d)" % rc, out)

svg = os.path.join(work, "t.svg")
rc, out = run("--plan-only", "--set", "topology.cluster=%s/dgx-h100-8x8.ini" % data, "--set", "model.preset=gpt2-1558m",
              "--set", "train.global_batch=512", "--set", "train.micro_batch=1", "--set", "train.precision=bf16",
              "--set", "parallel.mesh=dp_replicate=4,dp_shard=4,pp=4", "--set", "run.dir=%s/plan" % work,
              "--pp-timeline", svg)
check(rc == 0 and "pipeline chosen" in out and "bubble" in out, "--plan-only 1558m on 8x8 H100 chooses pp", out)
if os.path.exists(svg):
    text = open(svg).read()
    boxes = text.count("<rect x=")
    # 4 ranks x 32 micro-batches x (forward + backward)
    check(boxes == 4 * 32 * 2 and text.rstrip().endswith("</svg>"), "timeline SVG has %d boxes" % boxes)
else:
    check(False, "timeline SVG written", out)

rc, out = run("--plan-only", "--set", "topology.cluster=%s/nvlink-1x8.ini" % data, "--set", "model.preset=gpt2-124m",
              "--set", "train.global_batch=64", "--set", "train.micro_batch=8", "--set", "train.precision=bf16",
              "--set", "parallel.mesh=dp_shard=4,pp=2", "--set", "run.dir=%s/plan2" % work)
check(rc == 0 and "pipeline rejected" in out, "--plan-only 124m on one NVLink node rejects pp", out)

rc, out = run("--dry-run", "--pp-timeline", svg, "--set", "run.dir=%s/plan3" % work)
check(rc == 1 and "goes with --plan-only" in out, "--pp-timeline without --plan-only refused", out)

print("FAILED: %d" % fails if fails else "PASS")
sys.exit(1 if fails else 0)
