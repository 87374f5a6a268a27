#!/bin/bash
# threads_key.sh — checkpoint.threads takes effect in the real dgtrain (issue 20): two runs of the tiny
# model at 2 ranks, the same seed and data, that differ only in checkpoint.threads (1 and 4; the second
# also with checkpoint.async = true, whose snapshot copy runs on those threads). Each run's checkpoint
# events in metrics.jsonl say the thread count it asked for, RUN_DIR/config.ini records the key, and the
# checkpoints of the same step hold the same tensors (`dgckpt diff` exits 0: the thread count changes how
# the work is split, never what is written), and both verify.
# Usage: threads_key.sh DGTRAIN DGCKPT MPIEXEC [MPIEXEC FLAGS...]
set -u
SLURM_TEST_NAME=ckpt_threads_key
source "$(dirname "$0")/../slurm/lib.sh" # also the skip policy (tests/lib/skip.sh)
dgtrain_args "$@"
[ -x "$DGTRAIN" ] && [ -x "$DGCKPT" ] || dg_skip "dgtrain or dgckpt is not built ('$DGTRAIN', '$DGCKPT')"

WORK=$(mktemp -d /tmp/dgt-ckthreads-XXXXXX)
trap '[ "$FAILED" != 0 ] && [ "${KEEP_WORK:-0}" = 1 ] && echo "kept $WORK" || rm -rf "$WORK"' EXIT
write_tiny_config "$WORK/cfg.ini" 4
SETS=(--set checkpoint.every=2 --set checkpoint.keep=0)

run_with() { # run_with NAME THREADS [SETS...]
    local name=$1 n=$2
    shift 2
    if ! timeout 300 "${MPI[@]}" -n 2 "$DGTRAIN" "$WORK/cfg.ini" "${SETS[@]}" --set checkpoint.threads="$n" "$@" \
        --set run.dir="$WORK/$name" >"$WORK/$name.out" 2>&1; then
        echo "FAIL: the run with checkpoint.threads=$n failed: $(tail -n 5 "$WORK/$name.out")"
        exit 1
    fi
    local ev
    ev=$(grep '"event":"checkpoint"' "$WORK/$name/metrics.jsonl")
    [ "$(printf '%s\n' "$ev" | grep -c '"path"')" = 2 ] || fail "$name: expected 2 checkpoint events, got: $ev"
    [ "$(printf '%s\n' "$ev" | grep -c "\"threads\":$n[,}]")" = 2 ] ||
        fail "$name: the checkpoint events do not say threads $n: $ev"
    grep -qE "^checkpoint\.threads = $n( |$)" "$WORK/$name/config.ini" ||
        fail "$name: RUN_DIR/config.ini does not record checkpoint.threads = $n: $(grep 'checkpoint.threads' "$WORK/$name/config.ini")"
}
run_with one 1
run_with four 4 --set checkpoint.async=true

for s in 00000002 00000004; do
    a=$WORK/one/checkpoints/step_$s.h5 b=$WORK/four/checkpoints/step_$s.h5
    "$DGCKPT" verify -q "$a" >/dev/null || fail "step $s of the 1-thread run does not verify"
    "$DGCKPT" verify -q "$b" >/dev/null || fail "step $s of the 4-thread run does not verify"
    out=$("$DGCKPT" diff "$a" "$b" 2>&1) || fail "step $s: 1 and 4 checkpoint threads wrote different tensors: $(printf '%s\n' "$out" | tail -n 5)"
done
[ "$FAILED" = 0 ] || exit 1
echo "PASS: checkpoint.threads=1 and =4 (async): the events and config.ini say so, the checkpoints of steps 2 and 4 verify and hold the same tensors"
