# lib.sh — helpers shared by the Slurm tests (sourced): start a private cluster for this test, wait for
# job states and files, report failures with the job's output; probe and drive the real dgtrain.
# shellcheck shell=bash
# Expects: SLURM_TEST_NAME set by the caller.

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
TRAIN_SH=$REPO/slurm/train.sh
# the skip policy: SKIP (77) outside CI, FAIL under CI=true (tests/lib/skip.sh)
source "$REPO/tests/lib/skip.sh"
DG_TEST_NAME=$SLURM_TEST_NAME

source "$REPO/tests/lib/clock.sh" # now, elapsed, le
tlog() { echo "[$SLURM_TEST_NAME $(date +%T)] $*"; }

FAILED=0
fail() {
    echo "FAIL [$SLURM_TEST_NAME]: $*"
    FAILED=1
    return 1
}

# Start the cluster and stop it on exit. When Slurm cannot start here (cluster.sh exits 77 with the
# reason), dg_skip: a skip outside CI, a failure under CI.
start_cluster() {
    local env rc
    env=$(bash "$HERE/cluster.sh" start)
    rc=$?
    [ $rc = 77 ] && dg_skip "slurmctld/slurmd cannot start on this machine (cluster.sh's reason above)"
    [ $rc = 0 ] || {
        echo "FAIL [$SLURM_TEST_NAME]: cluster.sh start failed with $rc"
        exit 1
    }
    eval "$env"
    trap 'on_exit' EXIT
}
on_exit() {
    local rc=$?
    if { [ "$FAILED" != 0 ] || [ "$rc" != 0 ]; } && [ -n "${DGT_SLURM_DIR:-}" ]; then
        echo "----- slurmctld log (tail)"
        tail -n 30 "$DGT_SLURM_DIR/log/slurmctld.log" 2>/dev/null
        echo "----- slurmd log (tail)"
        tail -n 30 "$DGT_SLURM_DIR/log/slurmd.log" 2>/dev/null
    fi
    if [ "${KEEP_WORK:-0}" = 1 ]; then
        echo "KEEP_WORK=1: leaving the cluster running in $DGT_SLURM_DIR (stop: tests/slurm/cluster.sh stop $DGT_SLURM_DIR) and $WORK"
        exit $rc
    fi
    bash "$HERE/cluster.sh" stop >/dev/null 2>&1
    clean_shm
    [ -n "${WORK:-}" ] && [ "${KEEP_WORK:-0}" != 1 ] && rm -rf "$WORK"
    exit $rc
}

# job_field JOBID FIELD -> value from `scontrol show job` (e.g. JobState, Restarts, ExitCode, NumTasks)
job_field() {
    scontrol show job -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -n 1
}

# wait_job_state JOBID SECONDS STATE... : until JobState is one of STATE (returns 1 on timeout)
wait_job_state() {
    local jid=$1 limit=$2 t0 st s
    shift 2
    t0=$(now)
    while le "$(elapsed "$t0")" "$limit"; do
        st=$(job_field "$jid" JobState)
        for s in "$@"; do [ "$st" = "$s" ] && return 0; done
        sleep 0.2
    done
    fail "job $jid not in state $* after ${limit}s (state: ${st:-unknown})"
}

# wait_until SECONDS DESCRIPTION CMD... : poll CMD every 0.2 s
wait_until() {
    local limit=$1 what=$2 t0
    shift 2
    t0=$(now)
    while le "$(elapsed "$t0")" "$limit"; do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    fail "timed out after ${limit}s waiting for: $what"
}

# Open MPI's shared-memory segments (/dev/shm/vader_segment.*) outlive ranks that are killed. The tests
# that kill ranks note the segments of their ranks while they run (record_shm PID...) and remove, at
# the end, those that no live process maps any more (clean_shm).
record_shm() {
    local p
    for p in "$@"; do grep -o '/dev/shm/vader_segment[^ ]*' "/proc/$p/maps" 2>/dev/null; done >>"$WORK/shm.list"
}
clean_shm() {
    local f
    [ -s "${WORK:-}/shm.list" ] || return 0
    sort -u "$WORK/shm.list" | while read -r f; do
        [ -e "$f" ] || continue
        grep -qsF "$f" /proc/[0-9]*/maps || rm -f "$f"
    done
}

show_output() { # show_output FILE
    echo "----- $1"
    cat "$1" 2>/dev/null
}

need() { # need FILE ERE DESCRIPTION
    grep -qE -- "$2" "$1" || fail "$3 (no /$2/ in $1)"
}

# ---------------------------------------------------------------- the real dgtrain
# write_tiny_config FILE STEPS (tests/lib/tiny.sh)
source "$REPO/tests/lib/tiny.sh"

# dgtrain_args DGTRAIN DGCKPT MPIEXEC [MPIEXEC FLAGS...]: a dgtrain test's arguments into DGTRAIN, DGCKPT
# and the array MPI
dgtrain_args() {
    DGTRAIN=${1:-}
    DGCKPT=${2:-}
    shift 2
    MPI=("$@")
}

# probe_dgtrain WORK DGTRAIN DGCKPT MPIEXEC...: dg_skip with the reason (a skip outside CI, a failure
# under CI) unless dgtrain can train and checkpoint (2 steps at 1 rank) and dgckpt exists.
probe_dgtrain() {
    local work=$1 dgtrain=$2 dgckpt=$3 out rc
    shift 3
    if [ -z "$dgtrain" ] || [ ! -x "$dgtrain" ]; then
        dg_skip "dgtrain is not built (no executable '$dgtrain')"
    fi
    if ! out=$("$dgtrain" --version 2>&1); then
        dg_skip "'dgtrain --version' fails: $(echo "$out" | tail -n 1)"
    fi
    if [ -z "$dgckpt" ] || [ ! -x "$dgckpt" ]; then
        dg_skip "dgckpt is not built (no executable '$dgckpt')"
    fi
    write_tiny_config "$work/probe.ini" 2
    out=$(cd "$work" && timeout 300 "$@" -n 1 "$dgtrain" "$work/probe.ini" --set run.dir="$work/probe" 2>&1)
    rc=$?
    if [ $rc != 0 ] || [ ! -s "$work/probe/checkpoints/LATEST" ]; then
        local why
        why=$(printf '%s\n' "$out" | grep -m1 -E 'dgtrain: |error' ||
            printf '%s\n' "$out" | grep -v -E '^[[:space:]]*$|^-+$' | tail -n 1)
        dg_skip "dgtrain cannot train (2-step probe at 1 rank: exit $rc, checkpoint $( [ -s "$work/probe/checkpoints/LATEST" ] && echo written || echo missing)): $why"
    fi
    rm -rf "$work/probe"
}

# metrics_last_step FILE: the highest "step" of the step events (-1 if none yet)
metrics_last_step() {
    local n
    n=$(grep -o '"event":"step","step":[0-9]*' "$1" 2>/dev/null | sed 's/.*://' | sort -n | tail -n 1)
    echo "${n:--1}"
}
step_reached() { [ "$(metrics_last_step "$1")" -ge "$2" ]; }
# metrics_loss_at FILE STEP: the loss of the last step event for STEP
metrics_loss_at() {
    grep "\"event\":\"step\",\"step\":$2," "$1" 2>/dev/null | tail -n 1 | sed -E 's/.*"loss":([^,}]*).*/\1/'
}
# latest_ckpt RUN_DIR: the checkpoint file that RUN_DIR/checkpoints/LATEST names
latest_ckpt() {
    local l
    l=$(head -n 1 "$1/checkpoints/LATEST" 2>/dev/null)
    case "$l" in
    /*) echo "$l" ;;
    *) echo "$1/checkpoints/$l" ;;
    esac
}
