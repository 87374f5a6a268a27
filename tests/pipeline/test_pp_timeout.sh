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
dgtrain=$1 config=$2
shift 2
work=$(mktemp -d /tmp/dgt-pp-timeout-XXXXXX)
trap 'rm -rf "$work"' EXIT
hs_timeout=6 kill_after=60 errors=()
# need TEXT PATTERN WHAT: TEXT must match the shell PATTERN
need() { [[ $1 == $2 ]] || errors+=("$3: ${1:-<none>}"); }

t0=$(date +%s)
DG_TEST_STALL_COLLECTIVE_RANK=1 DG_TEST_STALL_COLLECTIVE_STEP=3 timeout -s KILL $kill_after "$@" -n 2 \
    "$dgtrain" "$config" --set parallel.mesh=pp=2 --set train.steps=8 --set train.global_batch=4 \
    --set train.micro_batch=1 --set model.preset=custom --set model.n_layer=2 --set model.n_head=2 \
    --set model.d_model=64 --set model.seq_len=32 --set model.vocab_size=256 --set run.dir="$work/run" \
    --set checkpoint.every=0 --set data.val_every=0 --set health.heartbeat_s=1 \
    --set health.timeout_s=$hs_timeout >"$work/out" 2>&1
rc=$?
took=$(($(date +%s) - t0))
echo "dgtrain exit code $rc after ${took} s (health.timeout_s = $hs_timeout)"
line=$(grep -m1 "timed out after" "$work/out")
echo "$line"
need "$rc" 3 "exit code (expected 3: a peer failed / a message timed out)"
need "$(grep -c 'step 2/8' "$work/out")" "[1-9]*" "steps before the stall (step 2 reached)"
need "$line" "*pp.[ag][cr][ta]*" "the line names the channel (pp.act or pp.grad)"
need "$line" "*rank 1 (world 1)*" "the line names the silent peer, rank 1"
need "$line" "*at step 3*" "the line names the step, 3"
((took < kill_after - 5)) || errors+=("the job took $took s to end")
if ((${#errors[@]})); then
    printf 'FAIL: %s\n' "${errors[@]}"
    grep -v '^\[vm:' "$work/out" | tail -40
    exit 1
fi
echo "ok: the stalled stage ended every rank with exit code 3 in ${took} s"
