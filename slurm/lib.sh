# slurm/lib.sh — what slurm/train.sh and slurm/validate.sh share (sourced first thing; they set ME):
#   set -u, set -o pipefail; CHECK_ONLY=0
#   log MSG...              "$ME: [date time] MSG" on stdout
#   die MSG...              "$ME: error: MSG" on stderr, exit 1 (usage: never requeued)
#   find_exe VAR REL NAME   the binary to launch: $VAR when set (it must be executable), else the first
#                           executable of $DGT_BUILD_DIR/REL, $SLURM_SUBMIT_DIR/build/REL, build/REL of this
#                           checkout (slurm/..), ./build/REL, then NAME on PATH; dies naming them all
#   allocation_ntasks       prints the task count of THIS allocation (see below)
#   launch_cmd NTASKS PROG [ARG...]
#                           sets CMD (an array) to the launcher line that runs PROG ARG... on NTASKS tasks:
#                           DGT_LAUNCHER=auto|srun|mpirun (auto: srun when it has PMIx, else mpirun),
#                           DGT_SRUN_ARGS / DGT_MPIRUN_ARGS appended to the launcher's options; sets
#                           LAUNCHER to the one chosen
#   script_arg VAR WHAT ARG the arguments both scripts take alike, and the one positional argument:
#                           --check sets CHECK_ONLY=1, -h/--help prints the script's header comment and
#                           exits 0, another -option dies; anything else becomes $VAR (WHAT names it when
#                           a second one comes); the usage line is $USAGE
#   input_file WHAT PATH    dies unless PATH is a readable regular file
# shellcheck shell=bash
# shellcheck disable=SC2034 # CMD, LAUNCHER and CHECK_ONLY are for the sourcing script
set -u
set -o pipefail
CHECK_ONLY=0
log() { echo "$ME: [$(date '+%F %T')] $*"; }
die() {
    echo "$ME: error: $*" >&2
    exit 1
}

script_arg() {
    case "$3" in
    --check) CHECK_ONLY=1 ;;
    -h | --help)
        sed -n '2,/^[^#]/p' "$0" | sed -e '/^[^#]/d' -e 's/^# \{0,1\}//' # the header comment
        exit 0
        ;;
    -*) die "unknown option '$3' ($USAGE)" ;;
    *)
        [ -z "${!1}" ] || die "unexpected argument '$3': only one $2 ($USAGE)"
        printf -v "$1" '%s' "$3"
        ;;
    esac
}

input_file() {
    [ -e "$2" ] || die "$1 '$2' does not exist (relative paths are from $(pwd))"
    [ -f "$2" ] || die "$1 '$2' is not a regular file"
    [ -r "$2" ] || die "$1 '$2' is not readable"
}

find_exe() {
    local var=$1 rel=$2 name=$3 c here
    if [ -n "${!var:-}" ]; then
        [ -x "${!var}" ] || die "$var='${!var}' is not an executable file"
        echo "${!var}"
        return
    fi
    # this script's own checkout (slurm/..): right for --check and direct runs; in a batch job Slurm
    # runs a spooled copy, hence SLURM_SUBMIT_DIR first, then the current directory
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." 2>/dev/null && pwd)
    for c in "${DGT_BUILD_DIR:+$DGT_BUILD_DIR/$rel}" "${SLURM_SUBMIT_DIR:+$SLURM_SUBMIT_DIR/build/$rel}" \
        "${here:+$here/build/$rel}" "$PWD/build/$rel"; do
        [ -n "$c" ] && [ -x "$c" ] && {
            echo "$c"
            return
        }
    done
    c=$(command -v "$name" 2>/dev/null) && {
        echo "$c"
        return
    }
    die "cannot find $name: tried \$DGT_BUILD_DIR, \$SLURM_SUBMIT_DIR, ${here:-slurm/..} and $PWD (each + /build/$rel) and PATH; set $var=/path/to/$name or build it"
}

# The task count of THIS allocation. After a requeue the job may have been resized (more or fewer nodes
# with --nodes=MIN-MAX, or `scontrol update JobId=.. NumTasks=.. TasksPerNode=..` while it was pending),
# but SLURM_NTASKS/SLURM_NTASKS_PER_NODE still hold what sbatch saw at submission. SLURM_TASKS_PER_NODE
# ("2(x3),1") is recomputed by Slurm for every start.
tasks_from_layout() {
    local total=0 item items
    IFS=, read -r -a items <<<"$1"
    for item in "${items[@]}"; do
        if [[ $item =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
            total=$((total + BASH_REMATCH[1] * BASH_REMATCH[2]))
        elif [[ $item =~ ^[0-9]+$ ]]; then
            total=$((total + item))
        else
            return 1
        fi
    done
    echo "$total"
}
allocation_ntasks() {
    local n=
    [ -n "${SLURM_TASKS_PER_NODE:-}" ] && n=$(tasks_from_layout "$SLURM_TASKS_PER_NODE")
    [ -n "$n" ] && [ "$n" -gt 0 ] || n=${SLURM_NTASKS:-${SLURM_NPROCS:-1}}
    echo "$n"
}

launch_cmd() {
    local ntasks=$1 extra cpt asroot
    shift
    LAUNCHER=${DGT_LAUNCHER:-auto}
    if [ "$LAUNCHER" = auto ]; then
        if srun --mpi=list 2>&1 | grep -qw pmix; then LAUNCHER=srun; else LAUNCHER=mpirun; fi
    fi
    case "$LAUNCHER" in
    srun)
        read -r -a extra <<<"${DGT_SRUN_ARGS:-}"
        # Slurm 22.05's srun does not take --cpus-per-task from the allocation: pass it on explicitly.
        cpt=()
        [ -n "${SLURM_CPUS_PER_TASK:-}" ] && cpt=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
        CMD=(srun --mpi=pmix --ntasks="$ntasks" "${cpt[@]}" "${extra[@]}" "$@")
        ;;
    mpirun)
        command -v mpirun >/dev/null 2>&1 || die "DGT_LAUNCHER=mpirun but no mpirun on PATH"
        read -r -a extra <<<"${DGT_MPIRUN_ARGS:-}"
        asroot=()
        [ "$(id -u)" = 0 ] && asroot=(--allow-run-as-root)
        CMD=(mpirun "${asroot[@]}" -n "$ntasks" "${extra[@]}" "$@")
        ;;
    *) die "DGT_LAUNCHER='$LAUNCHER': expected auto, srun or mpirun" ;;
    esac
}
