#!/bin/bash
# test_fsdp_timeout.sh — a collective that times out ends the whole job (docs/fsdp.md): dgtrain on 2 ranks,
# FSDP over dp_shard = 2, with rank 1 made to hang before the forward of step 3 (test hook
# DG_TEST_STALL_COLLECTIVE_RANK/_STEP). Rank 0 waits in the step's first all-gather; after
# 0.9 x health.timeout_s the wait fails and every rank must exit with code 3, with a message naming the
# collective, the group, the step and the rank that did not arrive, well before the job is killed.
# Usage: test_fsdp_timeout.sh DGTRAIN CONFIG MPIEXEC [MPIEXEC FLAGS...]
set -u
DGTRAIN=$1
CONFIG=$2
shift 2
WORK=$(mktemp -d /tmp/dgt-fsdp-timeout-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
TIMEOUT=6
LIMIT=60
fails=0
fail() {
    echo "FAIL: $*"
    fails=$((fails + 1))
}

SECONDS=0
DG_TEST_STALL_COLLECTIVE_RANK=1 DG_TEST_STALL_COLLECTIVE_STEP=3 timeout -s KILL $LIMIT "$@" -n 2 "$DGTRAIN" "$CONFIG" \
    --set parallel.mesh=dp_shard=2 --set train.steps=8 --set run.dir="$WORK/run" --set checkpoint.every=0 \
    --set data.val_every=0 --set health.heartbeat_s=1 --set health.timeout_s=$TIMEOUT >"$WORK/out" 2>&1
rc=$?
dt=$SECONDS
echo "dgtrain exit code $rc after ${dt} s (health.timeout_s = $TIMEOUT)"
grep -E "timed out|ERROR" "$WORK/out" | head -5

[ "$rc" = 3 ] || fail "exit code $rc, expected 3 (a peer failed / collective timed out)"
grep -q "step 2/8" "$WORK/out" || fail "training did not reach step 2 before the stall (see the output below)"
line=$(grep -m1 "timed out after" "$WORK/out")
[ -n "$line" ] || fail "no 'timed out after' message"
case "$line" in *allgather*) ;; *) fail "the message does not name the collective (allgather): $line" ;; esac
case "$line" in *dp_shard*) ;; *) fail "the message does not name the group (dp_shard): $line" ;; esac
case "$line" in *"at step 3"*) ;; *) fail "the message does not name the step (3): $line" ;; esac
case "$line" in *"did not arrive: 1"*) ;; *) fail "the message does not name the stalled rank 1: $line" ;; esac
case "$line" in *"ag.fwd"*) ;; *) fail "the message does not name the graph op: $line" ;; esac
[ "$dt" -lt $((LIMIT - 5)) ] || fail "the job took $dt s to end"
if [ $fails -ne 0 ]; then
    echo "---- dgtrain output ----"
    grep -v '^\[vm:' "$WORK/out" | tail -40
    exit 1
fi
echo "ok: the stalled collective ended every rank with exit code 3 in ${dt} s"
