#!/bin/bash
# test_slurm.sh — slurm/validate.sh on a real one-node Slurm cluster (tests/slurm/cluster.sh, through
# tests/slurm/lib.sh), with the real dgvalidate:
#   badargs   bad use is refused with one line before anything is queued or launched
#   pass      the whole suite (test SLA) as a batch job: COMPLETED, exit 0, reports parsed
#   fail      impossible references: the job FAILS with exit 4 and FAIL lines naming the host
#   mpirun    the mpirun fallback launcher (DGT_LAUNCHER=mpirun)
# Skips (77) with the reason when Slurm cannot start here; under CI=true that fails (tests/lib/skip.sh).
# Usage: test_slurm.sh DGVALIDATE
set -u
SLURM_TEST_NAME=validate_slurm
source "$(dirname "$0")/../slurm/lib.sh"
VHERE=$REPO/tests/validate
VALIDATE_SH=$REPO/slurm/validate.sh
export DGVALIDATE_BIN=$(readlink -f "${1:?usage: test_slurm.sh DGVALIDATE}")
[ -x "$DGVALIDATE_BIN" ] || {
    echo "FAIL: $DGVALIDATE_BIN is not executable"
    exit 1
}
WORK=$(mktemp -d /tmp/dgv-slurm-XXXXXX)
trap 'rm -rf "$WORK"' EXIT # start_cluster replaces this with a trap that also stops the cluster

# ------------------------------------------------------------ bad use, outside Slurm
printf '[validate]\ncomm_iter = 5\n' >"$WORK/bad.ini"
for args in "--check $WORK/bad.ini" "--check $WORK/missing.ini" "--check --bogus" "$VHERE/test_sla.ini"; do
    out=$(cd "$WORK" && env -u SLURM_JOB_ID bash "$VALIDATE_SH" $args 2>&1)
    rc=$?
    if [ "$rc" != 1 ] || [ "$(printf '%s\n' "$out" | wc -l)" != 1 ] || ! printf '%s\n' "$out" | grep -q '^validate.sh: error: '; then
        fail "validate.sh $args: exit $rc, output: $out"
    else
        echo "ok: validate.sh $args -> $out"
    fi
done
out=$(cd "$WORK" && env -u SLURM_JOB_ID bash "$VALIDATE_SH" --check "$VHERE/test_sla.ini" --checks topology 2>&1) ||
    fail "--check on the test SLA: $out"
[ "$FAILED" = 0 ] || exit 1

start_cluster
# Every private test cluster numbers its jobs from 1, and files named after the job id live outside the
# cluster's directory: Slurm's PMIx plugin keeps per-step files in TmpFS (default /tmp), and Open MPI
# names its session and shared-memory files after the PMIx namespace (the job and step ids). Two
# clusters at once (other Slurm tests) then collide: steps failed to launch, or both ranks crashed.
# This cluster gets its own TmpFS and job ids from a random start.
mkdir -p "$DGT_SLURM_DIR/tmp" &&
    printf 'TmpFS=%s\nFirstJobId=%d\n' "$DGT_SLURM_DIR/tmp" $((100000 + RANDOM * 100 + RANDOM % 100)) >>"$SLURM_CONF" &&
    scontrol reconfigure || fail "could not give the test cluster its own TmpFS and job ids"
tlog "cluster up: $SLURM_CONF"

submit() { # submit NAME ENV... -- ARGS... -> prints the job id
    local d=$WORK/$1 envs=()
    shift
    while [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    mkdir -p "$d"
    (cd "$WORK" && env "${envs[@]}" sbatch --parsable --nodes=1 --ntasks-per-node=2 -o "$d/job.out" "$VALIDATE_SH" "$@")
}
JP=$(submit pass -- "$VHERE/test_sla.ini" --run-dir "$WORK/pass/run") || fail "sbatch pass"
JF=$(submit fail -- "$VHERE/sla_impossible.ini" --checks compute.cpu_gemm --run-dir "$WORK/fail/run") || fail "sbatch fail"
JM=$(submit mpirun DGT_LAUNCHER=mpirun "DGT_MPIRUN_ARGS=--oversubscribe --bind-to none" -- "$VHERE/test_sla.ini" \
    --checks topology,health,comm.mpi.allreduce --run-dir "$WORK/mpirun/run") || fail "sbatch mpirun"
[ "$FAILED" = 0 ] || exit 1
tlog "jobs: pass $JP, fail $JF, mpirun $JM"

for j in "pass:$JP" "fail:$JF" "mpirun:$JM"; do
    name=${j%%:*} jid=${j#*:} d=$WORK/${j%%:*}
    wait_job_state "$jid" 240 COMPLETED FAILED CANCELLED TIMEOUT || {
        show_output "$d/job.out"
        continue
    }
    st=$(job_field "$jid" JobState) ec=$(job_field "$jid" ExitCode)
    case $name in
    pass)
        [ "$st:$ec" = COMPLETED:0:0 ] || fail "pass: job $jid ended $st $ec"
        need "$d/job.out" "validate.sh: .* job $jid: validating nodes [^ ]+ \(1 node\(s\), 2 task\(s\)\) against '.*test_sla.ini'" "pass: no start line"
        need "$d/job.out" "^dgvalidate: [0-9]+ checks: .* -> PASS \(exit 0\)$" "pass: no PASS summary"
        need "$d/job.out" "dgvalidate exit 0: PASS" "pass: no verdict line"
        python3 "$VHERE/check_reports.py" "$d/run" --ranks 2 --nodes 1 --exit 0 --expect 'compute.gpu_*=SKIP|PASS' \
            --expect 'comm.nccl.*=SKIP|PASS' --expect 'topology.gpu_sharing=SKIP|PASS' --expect 'comm.mpi.*.inter=SKIP' \
            --expect 'comm.mpi.*.world=SKIP' --expect 'train.*=PASS|SKIP' --require 'storage.write' \
            --require 'comm.mpi.sendrecv.intra' --require 'health.rtt' || fail "pass: reports"
        ;;
    fail)
        [ "$st:$ec" = FAILED:4:0 ] || fail "fail: job $jid ended $st $ec, expected FAILED 4:0"
        need "$d/job.out" "^FAIL compute\.cpu_gemm: node 0 \([^,]+, ranks from 0\): .* want >= 0\.9 PFLOP/s" "fail: no FAIL line"
        need "$d/job.out" "dgvalidate exit 4: FAIL" "fail: no verdict line"
        python3 "$VHERE/check_reports.py" "$d/run" --ranks 2 --nodes 1 --exit 4 --expect 'compute.cpu_gemm=FAIL' || fail "fail: reports"
        ;;
    mpirun)
        [ "$st:$ec" = COMPLETED:0:0 ] || fail "mpirun: job $jid ended $st $ec"
        need "$d/job.out" "launcher mpirun" "mpirun: not launched with mpirun"
        need "$d/job.out" "^comm\.mpi\.allreduce\.intra .*PASS$" "mpirun: no allreduce row"
        ;;
    esac
    if [ "$FAILED" = 0 ]; then
        echo "PASS $name job $jid: $st $ec ($(grep -m1 -o 'launcher [a-z]*' "$d/job.out"))"
    else
        show_output "$d/job.out"
    fi
done
[ "$FAILED" = 0 ] || exit 1
echo "validate slurm: passed"
