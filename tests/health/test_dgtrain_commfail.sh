#!/bin/bash
# test_dgtrain_commfail.sh — a communicator that fails on one rank (DG_TEST_COMM_FAIL_RANK=1 at step 3:
# the comm is marked failed and, on nccl, really aborted with ncclCommAbort, as a lost peer or a NCCL
# async error would leave it) while the other rank waits in a collective on it: the health thread's
# comm poll hook (dg_comm_health_poll: ncclCommGetAsyncError / the comm's failure state) or the
# training thread's next collective must end the job on every rank with exit 3, with a line naming rank
# 1 and the reason, instead of a hang.
# Usage: test_dgtrain_commfail.sh cpu|gpu DGTRAIN DGCKPT MPIEXEC [MPIEXEC FLAGS...]
#   cpu: parallel.backend=cpu, parallel.comm=mpi (ctest health_dgtrain_commfail)
#   gpu: parallel.backend=cuda, parallel.comm=nccl, 2 ranks on 2 GPUs (ctest gpu_health_nccl_fail; exit
#        77 with fewer than 2 GPUs)
set -u
MODE=$1
shift
SLURM_TEST_NAME=health_dgtrain_commfail
source "$(dirname "$0")/../slurm/lib.sh"
source "$(dirname "$0")/../lib/mpijob.sh"
dgtrain_args "$@"
TIMEOUT=20
job_workdir commfail

SETS=(--set checkpoint.every=0 --set "health.timeout_s=$TIMEOUT" --set health.liveness_floor_s=5)
if [ "$MODE" = gpu ]; then
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    [ "${n:-0}" -ge 2 ] || dg_skip --gpus 2 "the nccl communicator failure test needs 2 GPUs, the driver reports ${n:-0}"
    SETS+=(--set parallel.backend=cuda --set parallel.comm=nccl --set parallel.mesh=dp_shard=2)
    export NCCL_NVLS_ENABLE=0
else
    SETS+=(--set parallel.comm=mpi --set parallel.mesh=dp_shard=2)
fi
probe_dgtrain "$WORK" "$DGTRAIN" "$DGCKPT" "${MPI[@]}"
write_tiny_config "$WORK/cfg.ini" 100000

run=$WORK/run
T0=$(now)
DG_TEST_COMM_FAIL_RANK=1 DG_TEST_COMM_FAIL_STEP=3 \
    "${MPI[@]}" -n 2 "$DGTRAIN" "$WORK/cfg.ini" "${SETS[@]}" --set run.dir="$run" >"$WORK/out" 2>&1 &
JOB=$!
wait_job $((TIMEOUT + 120)) || exit 1
[ "$RC" = 3 ] || fail "exit code $RC, expected 3"
grep -qE "rank 1 \(host [^)]*\): communicator [a-z_]+ \((mpi|nccl)\) failed: test hook DG_TEST_COMM_FAIL_RANK=1|test hook DG_TEST_COMM_FAIL_RANK=1: communicator [a-z_]+ failed at step [0-9]+; ending the job on every rank \(exit 3\)" "$WORK/out" ||
    fail "no line naming rank 1's failed communicator and the reason"
grep -qE "hangs|still running" "$WORK/out" && fail "a rank reports a hang"
[ "$FAILED" = 0 ] || {
    cat "$WORK/out"
    exit 1
}
echo "PASS commfail ($MODE): rank 1's communicator failed at step 3 -> exit 3 on every rank in ${DT}s:"
grep -m1 -E "communicator [a-z_]+ .*failed" "$WORK/out"
