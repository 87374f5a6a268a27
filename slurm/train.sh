#!/bin/bash
# slurm/train.sh — run dgtrain as a Slurm batch job that survives time limits and preemption.
#
#   sbatch [sbatch options] slurm/train.sh CONFIG.ini [--set section.key=value ...]
#   slurm/train.sh --check CONFIG.ini [--set ...]     # outside Slurm: validate only, launch nothing
#
# Before the time limit (or on preemption / scancel --signal) Slurm signals this script; it forwards
# the signal to dgtrain, which checkpoints at the next step boundary and exits 75. This script then
# requeues the job (scontrol requeue), up to DGT_MAX_RESTARTS times, and the next run resumes from the
# checkpoint (checkpoint.resume=auto, same run.dir) — at whatever node and task count it gets. dgtrain
# exit 3 (a peer failed or the watchdog fired) and a rank killed by SIGKILL (launcher exit 137) are
# requeued the same way. Exit 4 (checkpoints could not be saved: full or failing storage) is not: the
# requeued job would meet the same storage. See slurm/README.md.
#
# Defaults below are ordinary #SBATCH lines: override any of them on the sbatch command line, e.g.
#   sbatch --nodes=4 --ntasks-per-node=8 --gpus-per-task=1 --time=24:00:00 slurm/train.sh cfg.ini
# The signal lead time (seconds before the time limit) must cover one step plus a checkpoint write:
#   sbatch --signal=B:USR1@600 slurm/train.sh cfg.ini
# GPUs: one GPU per task via GRES, e.g. --gpus-per-task=1 (or --gres=gpu:8 with --ntasks-per-node=8);
# the default asks for none so that the script also runs on CPU partitions.
#
#SBATCH --job-name=dgtrain
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=01:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#
# Environment (all optional):
#   DGTRAIN_BIN        the dgtrain binary (default: $DGT_BUILD_DIR/src/cli/dgtrain, then
#                      $SLURM_SUBMIT_DIR/build/src/cli/dgtrain, then build/src/cli/dgtrain of this
#                      script's checkout (slurm/..), then ./build/src/cli/dgtrain, then dgtrain on PATH)
#   DGT_MAX_RESTARTS   how many times the job may requeue itself (default 10)
#   DGT_LAUNCHER       auto (srun --mpi=pmix when Slurm has PMIx, else mpirun) | srun | mpirun
#   DGT_SRUN_ARGS      extra srun arguments (split on whitespace)
#   DGT_MPIRUN_ARGS    extra mpirun arguments (split on whitespace)
#
# Exit codes: those of dgtrain (0 done, 1 usage/config, 2 runtime, 3 peer failure, 4 checkpoints could
# not be saved, 5 paused for an operator after a checkpoint, 75 stopped on a signal after a checkpoint),
# or the launcher's (137: a rank was SIGKILLed); 3, 75 and 137 requeue the job, 4 and 5 never do. This
# script's own usage errors exit 1 before anything is launched.
ME=train.sh
# slurm/lib.sh (strict mode, log, die, the launcher) beside this script; a batch job runs a spooled copy:
# then beside the script sbatch was given
LIB=$(dirname "$0")/lib.sh
[ -f "$LIB" ] || LIB=$(dirname "$(scontrol show job "${SLURM_JOB_ID:-none}" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')")/lib.sh
# shellcheck source=slurm/lib.sh
source "$LIB" 2>/dev/null || { echo "$ME: error: cannot find slurm/lib.sh beside $0 or the submitted script: run this script from its checkout" >&2 && exit 1; }
USAGE="usage: sbatch slurm/train.sh CONFIG.ini [--set section.key=value ...]"

# ---------------------------------------------------------------- arguments
SETS=()
CONFIG=
while [ $# -gt 0 ]; do
    case "$1" in
    --set)
        [ $# -ge 2 ] || die "--set needs an argument section.key=value"
        SETS+=(--set "$2")
        shift
        ;;
    --set=*) SETS+=(--set "${1#--set=}") ;;
    *) script_arg CONFIG CONFIG.ini "$1" ;;
    esac
    shift
done
[ -n "$CONFIG" ] || die "no config file ($USAGE)"
for s in "${SETS[@]}"; do
    [ "$s" = --set ] && continue
    case "$s" in
    [a-z]*.*=*) ;;
    *) die "bad --set '$s': expected section.key=value" ;;
    esac
done
input_file "config file" "$CONFIG"

MAX_RESTARTS=${DGT_MAX_RESTARTS:-10}
case "$MAX_RESTARTS" in
'' | *[!0-9]*) die "DGT_MAX_RESTARTS='$MAX_RESTARTS' is not a non-negative integer" ;;
esac

# ---------------------------------------------------------------- dgtrain and the effective config
DGTRAIN=$(find_exe DGTRAIN_BIN src/cli/dgtrain dgtrain) || exit 1

# dgtrain itself parses and validates the config (defaults, file, --set): the one source of truth.
# Values are only ever read into variables and used quoted; nothing from the config is evaluated.
if ! EFFECTIVE=$("$DGTRAIN" "$CONFIG" "${SETS[@]}" --print-config 2>"${TMPDIR:-/tmp}/dgt-train-sh.$$.err"); then
    msg=$(grep -v '^[[:space:]]*$' "${TMPDIR:-/tmp}/dgt-train-sh.$$.err" | head -n 1)
    rm -f "${TMPDIR:-/tmp}/dgt-train-sh.$$.err"
    die "dgtrain rejected the configuration: ${msg:-exit status $? from $DGTRAIN --print-config}"
fi
rm -f "${TMPDIR:-/tmp}/dgt-train-sh.$$.err"
# a line looks like:  run.dir = "runs/x"   # configs/x.ini:3
config_value() {
    local line rest
    line=$(printf '%s\n' "$EFFECTIVE" | grep -m1 "^$1 = ") || return 1
    rest=${line#"$1 = "}
    rest=${rest%  # *}
    rest=${rest%"${rest##*[![:space:]]}"}
    case "$rest" in \"*\") rest=${rest#\"} rest=${rest%\"} ;; esac
    printf '%s' "$rest"
}
RUN_DIR=$(config_value run.dir) || die "dgtrain --print-config printed no run.dir"
[ -n "$RUN_DIR" ] || die "run.dir is empty in the effective configuration"
RESUME=$(config_value checkpoint.resume) || RESUME=auto
mkdir -p -- "$RUN_DIR" 2>/dev/null || die "cannot create run.dir '$RUN_DIR': $(mkdir -p -- "$RUN_DIR" 2>&1 | head -n 1)"
mkdir -p -- "$RUN_DIR/logs" 2>/dev/null || die "cannot create '$RUN_DIR/logs'"
[ -w "$RUN_DIR" ] || die "run.dir '$RUN_DIR' is not writable"
[ "$RESUME" = auto ] || log "warning: checkpoint.resume=$RESUME: a requeued job will not pick up its own checkpoints"

if [ "$CHECK_ONLY" = 1 ]; then
    log "checks passed: config '$CONFIG', run.dir '$RUN_DIR', dgtrain $DGTRAIN"
    exit 0
fi
[ -n "${SLURM_JOB_ID:-}" ] || die "not inside a Slurm job (no SLURM_JOB_ID): submit with 'sbatch slurm/train.sh $CONFIG ...', or use --check to validate only"

# ---------------------------------------------------------------- launcher
RESTART=${SLURM_RESTART_COUNT:-0}
NTASKS=$(allocation_ntasks) # the task count of this allocation, which a requeue may have resized
if [ "${SLURM_NTASKS:-$NTASKS}" != "$NTASKS" ]; then
    log "this allocation has $NTASKS task(s) (tasks per node: $SLURM_TASKS_PER_NODE); the job was submitted with ${SLURM_NTASKS}"
    export SLURM_NTASKS=$NTASKS SLURM_NPROCS=$NTASKS
    unset SLURM_NTASKS_PER_NODE
fi
launch_cmd "$NTASKS" "$DGTRAIN" "$CONFIG" "${SETS[@]}"

SLURM_LOG=$RUN_DIR/logs/slurm.log
note() { # to the job output and to run.dir/logs/slurm.log, so the history survives requeues
    log "$*"
    echo "$ME: [$(date '+%F %T')] job $SLURM_JOB_ID: $*" >>"$SLURM_LOG" 2>/dev/null
}
note "start: restart $RESTART of max $MAX_RESTARTS, nodes ${SLURM_JOB_NODELIST:-?} (${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-?}} node(s), $NTASKS task(s)), run.dir '$RUN_DIR', launcher $LAUNCHER"
log "command: ${CMD[*]}"

# ---------------------------------------------------------------- run, forwarding signals
# The launcher runs in the background so that bash can run the trap while we `wait`.
CHILD=
CANCELLING=
forward() {
    local decision=
    if [ "$1" != USR1 ]; then
        CANCELLING=$1
        # Said now, not after dgtrain exits: Slurm SIGKILLs this script KillWait seconds after the
        # SIGTERM, which can come before dgtrain has finished its checkpoint.
        decision="; after SIG$1 (scancel, the end of the time limit or preemption) this job will not requeue itself"
    fi
    if [ -n "$CHILD" ] && kill -0 "$CHILD" 2>/dev/null; then
        note "got SIG$1: asking dgtrain to checkpoint and stop (SIGUSR1 to the launcher, pid $CHILD)$decision"
        # USR1 for every cause: mpirun forwards USR1 to the ranks but turns TERM into a kill, and
        # dgtrain treats USR1, TERM and INT alike.
        kill -USR1 "$CHILD" 2>/dev/null
    else
        note "got SIG$1 before dgtrain started$decision"
    fi
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
trap 'forward INT' INT

"${CMD[@]}" &
CHILD=$!
while :; do
    wait "$CHILD"
    RC=$?
    # a trapped signal interrupts `wait` (status > 128) while the launcher is still running
    if [ "$RC" -gt 128 ] && kill -0 "$CHILD" 2>/dev/null; then continue; fi
    break
done

case "$RC" in
0)
    note "dgtrain finished (exit 0)"
    exit 0
    ;;
75 | 3 | 137)
    why="stopped on a signal after a checkpoint"
    [ "$RC" = 3 ] && why="a peer failed or the watchdog fired"
    # srun (PMIx) and mpirun end the whole step themselves when a rank dies: 137 means a rank was
    # SIGKILLed (out-of-memory killer, lost node) before dgtrain could say 3. Same remedy.
    [ "$RC" = 137 ] && why="a rank was killed (SIGKILL: out of memory or a lost node?); treated as a peer failure"
    if [ -n "$CANCELLING" ]; then
        # SIGTERM to the batch shell means scancel, the hard end of the time limit or preemption: the
        # job is being cancelled (or Slurm requeues it itself, PreemptMode=REQUEUE). Requeueing here
        # would make a plain `scancel` impossible.
        note "dgtrain exit $RC ($why) after SIG$CANCELLING: the job is being cancelled or preempted; not requeueing"
        exit "$RC"
    fi
    if [ "$RESTART" -ge "$MAX_RESTARTS" ]; then
        note "dgtrain exit $RC ($why); restart count $RESTART reached DGT_MAX_RESTARTS=$MAX_RESTARTS: not requeueing"
        exit "$RC"
    fi
    note "dgtrain exit $RC ($why): requeueing job $SLURM_JOB_ID (restart $((RESTART + 1)) of max $MAX_RESTARTS)"
    if ! out=$(scontrol requeue "$SLURM_JOB_ID" 2>&1); then
        note "scontrol requeue failed: $out"
    fi
    exit "$RC"
    ;;
5)
    note "dgtrain exit 5: paused for an operator after a complete checkpoint (train.rollback_max loss-spike rollbacks within train.rollback_window steps, or an SLA Level-2 pause; see the sla events in metrics.jsonl): not requeueing; inspect the run, then submit again to resume from LATEST"
    exit 5
    ;;
4)
    note "dgtrain exit 4: checkpoints could not be saved (full or failing storage; see the error above): not requeueing into the same storage; free space, then submit again to resume from LATEST"
    exit 4
    ;;
*)
    note "dgtrain exit $RC: not requeueing (1: usage/config, 2: runtime failure; see run.dir logs)"
    exit "$RC"
    ;;
esac
