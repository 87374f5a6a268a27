#!/bin/bash
# docs/reliability.md: `sbatch slurm/validate.sh` on a one-node cluster must run, not stay PENDING forever (its
# default used to be a fixed --nodes=2, which Slurm accepts and never schedules on one node). Runs the
# real dgvalidate (topology check) through the private one-node cluster (cluster.sh), bounded by a
# timeout; a job still PENDING after it is the bug. Usage: test_validate_one_node.sh DGVALIDATE
set -u
SLURM_TEST_NAME=slurm_validate_one_node
source "$(dirname "$0")/lib.sh"
DGV=${1:-}
[ -x "$DGV" ] || { echo "FAIL [$SLURM_TEST_NAME]: dgvalidate '$DGV' is not executable"; exit 1; }
FAILED=0
WORK=$(mktemp -d /tmp/dgt-slurm-val1-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
export DGVALIDATE_BIN=$DGV DGT_LAUNCHER=mpirun DGT_MPIRUN_ARGS="--oversubscribe"
[ -n "${ASAN_OPTIONS:-}" ] && export ASAN_OPTIONS="$ASAN_OPTIONS:detect_leaks=0"
start_cluster
tlog "cluster up: $SLURM_CONF"

jid=$(cd "$WORK" && sbatch --parsable -o "$WORK/job.out" "$REPO/slurm/validate.sh" "$REPO/validation/sla.ini" --checks topology \
    --run-dir "$WORK/val") || { fail "sbatch slurm/validate.sh was refused"; exit 1; }
tlog "job $jid submitted"
if ! wait_job_state "$jid" 120 COMPLETED FAILED CANCELLED TIMEOUT NODE_FAIL; then
    fail "slurm/validate.sh on one node did not finish within 120 s: state $(job_field "$jid" JobState), reason $(job_field "$jid" Reason)"
    scancel "$jid" 2>/dev/null
    show_output "$WORK/job.out"
    exit 1
fi
st=$(job_field "$jid" JobState)
grep -q "one node allocated: the inter-node network is not measured" "$WORK/job.out" ||
    fail "no note that one node does not measure the inter-node network"
[ "$st" = COMPLETED ] || fail "job $jid ended $st (exit $(job_field "$jid" ExitCode))"
ls "$WORK/val" 2>/dev/null | grep -q . || fail "dgvalidate wrote nothing under the run dir $WORK/val"
[ "$FAILED" = 0 ] || { show_output "$WORK/job.out"; exit 1; }
echo "PASS [$SLURM_TEST_NAME]: validate.sh ran to the end on a one-node cluster ($st) and noted the missing inter-node check"
exit 0
