#!/bin/bash
# slurm/validate.sh — qualify a cluster, or a repaired node, for dgtrain: runs the dgvalidate suite as a
# Slurm batch job (docs/validation.md explains every check and threshold).
#
#   sbatch [sbatch options] slurm/validate.sh [SLA.ini] [dgvalidate options]
#   slurm/validate.sh --check [SLA.ini] [dgvalidate options]   # outside Slurm: check only, launch nothing
#
#   SLA.ini             thresholds and node types (default: validation/sla.ini)
#   dgvalidate options  --checks LIST, --set validate.KEY=VALUE, --set SECTION.KEY=VALUE, --run-dir DIR
#                       (default run dir: runs/validate-<job id>; --set run.dir=DIR = --run-dir DIR)
#
# Examples (from the repository root, after building):
#   sbatch --nodes=4 --ntasks-per-node=8 --gpus-per-task=1 slurm/validate.sh
#   sbatch --nodes=1 -w node042 --ntasks-per-node=8 --gpus-per-task=1 slurm/validate.sh   # a repaired node
#   sbatch slurm/validate.sh validation/sla.ini --checks topology,comm.mpi
#
# Defaults below are ordinary #SBATCH lines; override any of them on the sbatch command line. The job
# asks for whole nodes (--exclusive): bandwidth and throughput measured next to another job are
# meaningless. Two nodes are the least that measures the inter-node network, so the default asks for
# 1-2 nodes: a fixed --nodes=2 stayed PENDING forever on a one-node cluster (Slurm accepts a job larger
# than the partition and waits for a node that never comes). On one node the script says the inter-node
# network is not measured; pass --nodes=2 (or more) to insist on it. One GPU per task via GRES
# (e.g. --gpus-per-task=1) on GPU partitions — the default asks for none so that it also runs on CPU
# partitions, where the GPU checks are skipped with a note.
#
#SBATCH --job-name=dgvalidate
#SBATCH --nodes=1-2
#SBATCH --ntasks-per-node=2
#SBATCH --exclusive
#SBATCH --time=00:30:00
#SBATCH --no-requeue
#SBATCH --output=dgvalidate-%j.out
#
# Environment (all optional):
#   DGVALIDATE_BIN     the dgvalidate binary (default: $DGT_BUILD_DIR/src/validate/dgvalidate, then
#                      $SLURM_SUBMIT_DIR/build/src/validate/dgvalidate, then build/src/validate/dgvalidate
#                      of this script's checkout (slurm/..), then ./build/..., then dgvalidate on PATH)
#   DGT_LAUNCHER       auto (srun --mpi=pmix when Slurm has PMIx, else mpirun) | srun | mpirun
#   DGT_SRUN_ARGS      extra srun arguments (split on whitespace)
#   DGT_MPIRUN_ARGS    extra mpirun arguments (split on whitespace)
#
# Exit codes: those of dgvalidate — 0 every check passed (or was skipped), 1 bad input, 2 a check harness
# failed, 3 the job was aborted (a peer failed or timed out), 4 at least one check FAILED. This script's
# own usage errors exit 1 before anything is launched. A validation job is never requeued: its verdict
# is about the nodes it ran on.
ME=validate.sh
# slurm/lib.sh (strict mode, log, die, the launcher) beside this script; a batch job runs a spooled copy:
# then beside the script sbatch was given
LIB=$(dirname "$0")/lib.sh
[ -f "$LIB" ] || LIB=$(dirname "$(scontrol show job "${SLURM_JOB_ID:-none}" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')")/lib.sh
# shellcheck source=slurm/lib.sh
source "$LIB" 2>/dev/null || { echo "$ME: error: cannot find slurm/lib.sh beside $0 or the submitted script: run this script from its checkout" >&2 && exit 1; }
USAGE="usage: sbatch slurm/validate.sh [SLA.ini] [--checks LIST] [--set key=value ...] [--run-dir DIR]"

# ---------------------------------------------------------------- arguments
SLA=
RUN_DIR=
PASS=() # options handed to dgvalidate unchanged (it checks them itself)
while [ $# -gt 0 ]; do
    case "$1" in
    --set)
        [ $# -ge 2 ] || die "$1 needs an argument ($USAGE)"
        # --set run.dir=DIR is --run-dir DIR (as in dgvalidate itself)
        case "$2" in run.dir=*) RUN_DIR=${2#run.dir=} ;; *) PASS+=("$1" "$2") ;; esac
        shift
        ;;
    --set=run.dir=*) RUN_DIR=${1#--set=run.dir=} ;;
    --checks)
        [ $# -ge 2 ] || die "$1 needs an argument ($USAGE)"
        PASS+=("$1" "$2")
        shift
        ;;
    --checks=* | --set=*) PASS+=("$1") ;;
    --run-dir)
        [ $# -ge 2 ] || die "--run-dir needs a directory ($USAGE)"
        RUN_DIR=$2
        shift
        ;;
    --run-dir=*) RUN_DIR=${1#--run-dir=} ;;
    *) script_arg SLA "SLA file" "$1" ;;
    esac
    shift
done
[ -n "$SLA" ] || SLA=validation/sla.ini
input_file "SLA file" "$SLA"

DGV=$(find_exe DGVALIDATE_BIN src/validate/dgvalidate dgvalidate) || exit 1

# dgvalidate parses the SLA file and the options itself (no MPI needed): the one source of truth, and
# a bad threshold file stops here instead of after the job waited in the queue.
if ! out=$("$DGV" --check "$SLA" "${PASS[@]}" 2>&1); then
    die "dgvalidate rejected the input: $(printf '%s\n' "$out" | grep -v '^[[:space:]]*$' | head -n 1)"
fi

if [ -z "$RUN_DIR" ]; then RUN_DIR=runs/validate-${SLURM_JOB_ID:-$(date -u +%Y%m%d-%H%M%S)}; fi
if [ "$CHECK_ONLY" = 1 ]; then
    # nothing is created: the nearest existing parent of the run dir must be writable
    p=$RUN_DIR
    while [ ! -e "$p" ]; do p=$(dirname -- "$p"); done
    [ -d "$p" ] && [ -w "$p" ] || die "cannot create the run directory '$RUN_DIR': '$p' is not a writable directory"
    log "checks passed: SLA '$SLA', run dir '$RUN_DIR', dgvalidate $DGV ($out)"
    exit 0
fi
mkdir -p -- "$RUN_DIR" 2>/dev/null || die "cannot create the run directory '$RUN_DIR'"
[ -w "$RUN_DIR" ] || die "the run directory '$RUN_DIR' is not writable"
[ -n "${SLURM_JOB_ID:-}" ] || die "not inside a Slurm job (no SLURM_JOB_ID): submit with 'sbatch slurm/validate.sh ...', or use --check to validate only"

# ---------------------------------------------------------------- launcher (slurm/lib.sh)
NTASKS=$(allocation_ntasks)
launch_cmd "$NTASKS" "$DGV" "$SLA" --run-dir "$RUN_DIR" "${PASS[@]}"

if [ "${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-0}}" = 1 ]; then
    log "note: one node allocated: the inter-node network is not measured (sbatch --nodes=2 or more to measure it)"
fi
log "job $SLURM_JOB_ID: validating nodes ${SLURM_JOB_NODELIST:-?} (${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-?}} node(s), $NTASKS task(s)) against '$SLA', run dir '$RUN_DIR', launcher $LAUNCHER"
log "command: ${CMD[*]}"
"${CMD[@]}"
RC=$?
# A launcher can return 0 without having run anything (srun does when a step fails to launch): only a
# complete report with exit code 0 counts as a pass.
if [ "$RC" = 0 ] && ! grep -q '"complete": true' "$RUN_DIR/validation.json" 2>/dev/null; then
    log "the launcher returned 0 but dgvalidate left no complete report in $RUN_DIR: the step did not run (see the launcher's messages above)"
    RC=2
fi
case "$RC" in
0) verdict="PASS: every check passed or was skipped" ;;
1) verdict="bad input (see the error above)" ;;
2) verdict="ERROR: a check harness failed (see the ERROR lines)" ;;
3) verdict="ABORTED: a rank failed or a collective timed out" ;;
4) verdict="FAIL: at least one check failed (see the FAIL lines: they name the ranks and hosts)" ;;
*) verdict="the launcher ended with status $RC" ;;
esac
log "dgvalidate exit $RC: $verdict; reports: $RUN_DIR/validation.json, $RUN_DIR/validation-junit.xml"
exit "$RC"
