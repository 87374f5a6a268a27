#!/bin/bash
# test_pp_timeout.sh — a pipeline stage peer that stops answering mid-step ends the whole job
# (docs/parallelism.md "Faults", docs/reliability.md): dgtrain on 2 ranks with parallel.mesh = pp=2, rank 1
# (stage 1) made to hang before its first forward of step 3 (test hook DG_TEST_STALL_COLLECTIVE_RANK/_STEP).
# Stage 0 waits in the step's first group of stage-to-stage messages; after 0.9 x health.timeout_s the wait
# fails (the health thread's poll of the channel, or the executor's own wait, whichever sees it first) and
# every rank must exit 3 with one line naming the channel, the send or receive, the peer that did not
# answer and the step, well before the job is killed.
# Usage: test_pp_timeout.sh DGTRAIN CONFIG MPIEXEC [MPIEXEC FLAGS...]
set -u
DGTRAIN=$1
CONFIG=$2
shift 2
WORK=$(mktemp -d /tmp/dgt-pp-timeout-XXXXXX)
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
    --set parallel.mesh=pp=2 --set train.steps=8 --set train.global_batch=4 --set train.micro_batch=1 \
    --set model.preset=custom --set model.n_layer=2 --set model.n_head=2 --set model.d_model=64 \
    --set model.seq_len=32 --set model.vocab_size=256 --set run.dir="$WORK/run" --set checkpoint.every=0 \
    --set data.val_every=0 --set health.heartbeat_s=1 --set health.timeout_s=$TIMEOUT >"$WORK/out" 2>&1
rc=$?
dt=$SECONDS
echo "dgtrain exit code $rc after ${dt} s (health.timeout_s = $TIMEOUT)"
grep -E "timed out|ERROR" "$WORK/out" | head -5

[ "$rc" = 3 ] || fail "exit code $rc, expected 3 (a peer failed / a message timed out)"
grep -q "step 2/8" "$WORK/out" || fail "training did not reach step 2 before the stall (see the output below)"
line=$(grep -m1 "timed out after" "$WORK/out")
[ -n "$line" ] || fail "no 'timed out after' message"
case "$line" in *"to rank 1 (world 1)"* | *"from rank 1 (world 1)"*) ;; *) fail "the message does not name the silent peer (rank 1): $line" ;; esac
case "$line" in *pp.act* | *pp.grad*) ;; *) fail "the message does not name the channel (pp.act / pp.grad): $line" ;; esac
case "$line" in *"at step 3"*) ;; *) fail "the message does not name the step (3): $line" ;; esac
[ "$dt" -lt $((LIMIT - 5)) ] || fail "the job took $dt s to end"
if [ $fails -ne 0 ]; then
    echo "---- dgtrain output ----"
    grep -v '^\[vm:' "$WORK/out" | tail -40
    exit 1
fi
echo "ok: the stalled stage ended every rank with exit code 3 in ${dt} s"
