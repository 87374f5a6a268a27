"""dgskip.py — the skip policy of the Python tests, in one place (the same as tests/lib/skip.sh; see
docs/reliability.md, "The test suite itself").

A test that cannot bring up a real component it needs returns skip(reason) as its exit status:
  - outside CI: prints "SKIP: reason", returns 77 (ctest's SKIP_RETURN_CODE);
  - under CI (CI set to anything but "", 0, false or no): prints "FAIL: reason (...)", returns 1, because a
    component that does not start on a CI machine is a broken bring-up, and a skip would hide it.
skip(reason, gpus=N): the component is N GPUs; a machine that has fewer (as the NVIDIA driver lists them,
so a present GPU that CUDA cannot use still fails in CI) skips in CI too.

Use:  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
      import dgskip
      return dgskip.skip("compute-sanitizer not found")
"""
import glob
import os

SKIP = 77


def in_ci():
    return os.environ.get("CI", "") not in ("", "0", "false", "FALSE", "False", "no", "NO")


def gpus_present():
    """NVIDIA GPUs on this machine whether or not CUDA can use them, limited by CUDA_VISIBLE_DEVICES."""
    n = len(glob.glob("/proc/driver/nvidia/gpus/*")) or len(glob.glob("/dev/nvidia[0-9]*"))
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        n = min(n, len([v for v in vis.split(",") if v.strip() and not v.strip().startswith("-")]))
    return n


def skip(reason, gpus=0):
    """Print the verdict for a component that did not start; return the exit status (77 or 1)."""
    if not in_ci():
        print("SKIP: %s" % reason, flush=True)
        return SKIP
    if gpus > 0 and gpus_present() < gpus:
        print("SKIP: %s (CI=%s, but this machine has fewer than %d GPU(s))" % (reason, os.environ["CI"], gpus),
              flush=True)
        return SKIP
    print("FAIL: %s (CI=%s: a component that does not start fails the test instead of skipping it; "
          "see docs/reliability.md)" % (reason, os.environ["CI"]), flush=True)
    return 1
