#!/bin/bash
# scripts/same_losses.sh — proof that a change did not alter behaviour: builds two source trees (CPU,
# Release) and runs the embedded default job on each (same ranks, same steps), then compares every
# step's loss, learning rate and gradient norm in metrics.jsonl as written (the metrics writer prints the
# shortest decimal that reads back bit-exactly, so equal strings are equal bits).
#
#   scripts/same_losses.sh OLD_TREE [NEW_TREE]     NEW_TREE defaults to this checkout
#   DG_RANKS=2 DG_STEPS=60 scripts/same_losses.sh ../old
#
# OLD_TREE is any source tree, e.g. `mkdir /tmp/old && git archive REV | tar -x -C /tmp/old`.
# Exit 0: identical; 1: a value differs (the first difference is printed); 2: bad use or a failed build/run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 1 ] && [ $# -le 2 ] || { sed -n 2,12p "$0" >&2; exit 2; }
old=$(cd "$1" && pwd) || exit 2
new=$(cd "${2:-$root}" && pwd) || exit 2
ranks=${DG_RANKS:-2}
steps=${DG_STEPS:-60}
work=$(mktemp -d "${TMPDIR:-/tmp}/same_losses.XXXXXX")
trap 'rm -rf "$work"' EXIT
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}

run_tree() { # $1 tree, $2 name
    local b=$work/build-$2
    if ! { cmake -S "$1" -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDGT_CUDA=OFF &&
        cmake --build "$b" --target dgtrain; } >"$work/$2.build.log" 2>&1; then
        echo "same_losses: building $1 failed (log: $work/$2.build.log)" >&2
        tail -20 "$work/$2.build.log" >&2
        exit 2
    fi
    if ! mpirun --allow-run-as-root --oversubscribe -x OMP_WAIT_POLICY -n "$ranks" "$b/src/cli/dgtrain" \
        "$1/configs/default.ini" --set "run.dir=$work/run-$2" --set "train.steps=$steps" \
        >"$work/$2.run.log" 2>&1; then
        echo "same_losses: the default run of $1 failed" >&2
        tail -20 "$work/$2.run.log" >&2
        exit 2
    fi
    # step, loss, lr, grad_norm of every step line, as written
    python3 - "$work/run-$2/metrics.jsonl" >"$work/$2.losses" <<'PY'
import json, re, sys
for line in open(sys.argv[1]):
    if '"event":"step"' not in line.replace(' ', ''):
        continue
    ev = json.loads(line)
    raw = {k: re.search(r'"%s":\s*([^,}]+)' % k, line) for k in ("loss", "lr", "grad_norm")}
    print(ev["step"], *[(m.group(1) if m else "-") for m in raw.values()])
PY
}

run_tree "$old" old
run_tree "$new" new
n=$(wc -l <"$work/new.losses")
if [ "$n" -lt "$steps" ]; then
    echo "same_losses: only $n step lines in the new run (expected $steps)" >&2
    exit 2
fi
if ! diff -q "$work/old.losses" "$work/new.losses" >/dev/null; then
    echo "same_losses: DIFFERENT (step loss lr grad_norm; < old, > new):"
    diff "$work/old.losses" "$work/new.losses" | head -6
    exit 1
fi
echo "same_losses: identical: $n steps at $ranks ranks (loss, lr, grad_norm bitwise); last: $(tail -1 "$work/new.losses")"
