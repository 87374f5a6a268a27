#!/bin/bash
# contents.sh — impossible values in dgtrain checkpoints whose checksums all pass (issue 19, item 2).
# A real run of the tiny model writes checkpoints at steps 2, 4 and 6; copies of the run get one scalar
# of the newest checkpoint edited with h5py (attributes carry no checksum, docs/checkpoint-format.md):
#   step -5 | tokens past the samples | loader_samples_seen past the data | loader_cursor past the data
#   | a negative samples_seen (written as int64, as h5py does) | a loss scale of 0 in an fp32 run
# For each: `dgckpt verify` exits 1 and names the field, its value and the allowed range, and a resume
# (2 ranks) falls back to step 4 with a warning naming the field, then finishes. With every checkpoint
# impossible, resume=auto refuses with one line and exit 1; an explicit resume=PATH to one refuses too.
# Usage: contents.sh DGTRAIN DGCKPT MPIEXEC [MPIEXEC FLAGS...]
set -u
SLURM_TEST_NAME=ckpt_contents
source "$(dirname "$0")/../slurm/lib.sh" # also the skip policy (tests/lib/skip.sh)
dgtrain_args "$@"
skip_or_fail() { dg_skip "$@"; } # docs/reliability.md, "The test suite itself"
[ -x "$DGTRAIN" ] && [ -x "$DGCKPT" ] || skip_or_fail "dgtrain or dgckpt is not built ('$DGTRAIN', '$DGCKPT')"
PY=
for p in "${PYTHON_H5PY:-}" python3 /usr/bin/python3; do
    [ -n "$p" ] && command -v "$p" >/dev/null 2>&1 && "$p" -c 'import h5py, numpy' 2>/dev/null && {
        PY=$p
        break
    }
done
[ -n "$PY" ] || skip_or_fail "no python3 with h5py and numpy (Debian: apt-get install python3-h5py; scripts/setup.sh does it)"

WORK=$(mktemp -d /tmp/dgt-contents-XXXXXX)
trap '[ "$FAILED" != 0 ] && [ "${KEEP_WORK:-0}" = 1 ] && echo "kept $WORK" || rm -rf "$WORK"' EXIT
write_tiny_config "$WORK/cfg.ini" 6
SETS=(--set checkpoint.every=2 --set checkpoint.keep=0 --set health.heartbeat_s=1 --set health.timeout_s=120)

base=$WORK/base
if ! "${MPI[@]}" -n 1 "$DGTRAIN" "$WORK/cfg.ini" "${SETS[@]}" --set run.dir="$base" >"$WORK/base.out" 2>&1; then
    echo "FAIL: the reference run failed: $(tail -n 5 "$WORK/base.out")"
    exit 1
fi
"$DGCKPT" verify -q "$base/checkpoints/step_00000006.h5" >/dev/null || fail "the untouched checkpoint does not verify"

# edit NAME WHERE ATTR TYPE VALUE: a copy of the run whose step-6 file has one attribute replaced
edit() {
    local name=$1 where=$2 attr=$3 type=$4 value=$5
    cp -a "$base" "$WORK/$name"
    "$PY" - "$WORK/$name/checkpoints/step_00000006.h5" "$where" "$attr" "$type" "$value" <<'EOF' || fail "$name: h5py edit failed"
import sys
import h5py
import numpy as np
path, where, attr, typ, value = sys.argv[1:]
with h5py.File(path, "r+") as f:
    obj = f if where == "/" else f[where]
    obj.attrs[attr] = getattr(np, typ)(value)
EOF
}

# case NAME WHERE ATTR TYPE VALUE FIELD ALLOWED_ERE: verify names it, a resume falls back past it
check_case() {
    local name=$1 field=$6 allowed=$7
    edit "$1" "$2" "$3" "$4" "$5"
    local f=$WORK/$name/checkpoints/step_00000006.h5 out rc
    out=$("$DGCKPT" verify "$f" 2>&1)
    rc=$?
    [ $rc = 1 ] || fail "$name: dgckpt verify exited $rc, expected 1"
    printf '%s\n' "$out" | grep -qE "^BAD   .*: state: $field = .*\(allowed: $allowed" ||
        fail "$name: dgckpt verify does not report $field with its allowed range: $(printf '%s\n' "$out" | grep -v '^ok' | head -n 5)"
    # the checksums still pass: every dataset line is ok
    printf '%s\n' "$out" | grep -q "datasets checked, 0 bad\|datasets checked, [0-9]* bad" || true
    "${MPI[@]}" -n 2 "$DGTRAIN" "$WORK/cfg.ini" "${SETS[@]}" --set train.steps=8 --set run.dir="$WORK/$name" \
        >"$WORK/$name.out" 2>&1
    rc=$?
    [ $rc = 0 ] || fail "$name: the resume exited $rc, expected 0: $(grep -m1 'dgtrain: error' "$WORK/$name.out")"
    grep -qE "cannot resume from .*step_00000006.h5: .*impossible training state.*$field = " "$WORK/$name.out" ||
        fail "$name: no warning naming $field: $(grep -m2 WARN "$WORK/$name.out")"
    grep -q '"event":"resume","step":4,' "$WORK/$name/metrics.jsonl" || fail "$name: did not fall back to step 4"
    grep -qE "Assertion|assert|Segmentation|backtrace" "$WORK/$name.out" && fail "$name: a crash in the output"
    echo "ok: $name -> $(printf '%s\n' "$out" | grep -m1 "state: $field" | cut -c1-260)"
}

check_case negstep / step int64 -5 step ">= 0"
check_case tokens / tokens int64 1000000000000 tokens "loader_samples_seen x seq_len"
check_case samples state loader_samples_seen uint64 1000000000 loader_samples_seen "0 \+ \(step 6 - 0\) x train.global_batch 8 = 48"
check_case cursor state loader_cursor int64 10000000 loader_cursor "0 \.\. [0-9]+ \(.*has [0-9]+ samples"
check_case negsamples state loader_samples_seen int64 -3 loader_samples_seen "0 \.\. 2\^63-1"
check_case scale state scaler_scale float64 0 scaler_scale "a finite number > 0"

# the cursor past the data, checked against the data the checkpoint names (and against --data): the
# message is the field's, not a garbled loader error
out=$("$DGCKPT" verify "$WORK/cursor/checkpoints/step_00000004.h5" --data "$base/data/default_train_*.bin" 2>&1) ||
    fail "an intact checkpoint fails verify --data: $(printf '%s\n' "$out" | tail -n 3)"

# every checkpoint impossible: resume=auto refuses with one line, exit 1 (no fresh start, no crash)
all=$WORK/all
cp -a "$base" "$all"
for s in 2 4 6; do
    "$PY" -c "import h5py, numpy as np, sys; f = h5py.File(sys.argv[1], 'r+'); f.attrs['step'] = np.int64(-1); f.close()" \
        "$all/checkpoints/step_0000000$s.h5" || fail "edit step $s"
done
"${MPI[@]}" -n 2 "$DGTRAIN" "$WORK/cfg.ini" "${SETS[@]}" --set run.dir="$all" >"$WORK/all.out" 2>&1
rc=$?
[ $rc = 1 ] || fail "all impossible: exit $rc, expected 1"
lines=$(grep -c '^dgtrain: error on rank' "$WORK/all.out")
[ "$lines" = 1 ] || fail "all impossible: expected one error line, got $lines"
grep -q "^dgtrain: error on rank .*no usable checkpoint in .*: all 3 rejected (newest: .*step = -1 (allowed: >= 0)" "$WORK/all.out" ||
    fail "all impossible: unclear error: $(grep -m1 'dgtrain: error' "$WORK/all.out")"
echo "ok: every checkpoint impossible -> exit 1: $(grep -m1 'dgtrain: error' "$WORK/all.out" | cut -c1-240)"
# an explicit file is taken or refused, never replaced
"${MPI[@]}" -n 1 "$DGTRAIN" "$WORK/cfg.ini" "${SETS[@]}" --set run.dir="$WORK/explicit" \
    --set checkpoint.resume="$all/checkpoints/step_00000006.h5" >"$WORK/explicit.out" 2>&1
rc=$?
[ $rc = 1 ] && grep -q "^dgtrain: error on rank .*step_00000006.h5: impossible training state" "$WORK/explicit.out" ||
    fail "resume=PATH to an impossible file: exit $rc: $(grep -m1 'dgtrain: error' "$WORK/explicit.out")"

[ "$FAILED" = 0 ] || exit 1
echo "PASS contents: impossible step, tokens, samples_seen, cursor and scale are reported by dgckpt verify and skipped by resume"
