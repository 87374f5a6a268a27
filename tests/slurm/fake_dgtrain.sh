#!/bin/bash
# fake_dgtrain.sh — stands in for dgtrain in the Slurm harness test (test_harness.sh), so that
# slurm/train.sh's launch, signal forwarding, requeue and resize logic is tested with real Slurm and
# real MPI ranks even before dgtrain trains. It speaks dgtrain's interface where train.sh relies on it:
#   fake_dgtrain.sh CONFIG [--set section.key=value ...] [--print-config]
# --print-config prints `run.dir = "..."  # source` lines like dgtrain; otherwise it execs the health
# test driver (real health.h: heartbeats, watchdog, signal agreement, exit 75/3) with a "checkpoint"
# file in run.dir so that a requeued run resumes where the last one stopped.
# Config: [run] dir, [fake] steps, step_ms; [checkpoint] resume. FAKE_DRIVER names health_driver.
# FAKE_STALL_FIRST=1 makes rank 1 hang (test hook) at step 5 of the first run only, so the watchdog
# ends it with exit 3.
set -u
CFG=
PRINT=0
SETS=()
while [ $# -gt 0 ]; do
    case "$1" in
    --print-config) PRINT=1 ;;
    --set)
        SETS+=("$2")
        shift
        ;;
    -*)
        echo "dgtrain: unknown option '$1'" >&2
        exit 1
        ;;
    *) CFG=$1 ;;
    esac
    shift
done
[ -r "$CFG" ] || {
    echo "dgtrain: cannot read config file '$CFG'" >&2
    exit 1
}
get() { # get SECTION KEY DEFAULT -> value; sets SRC to where it came from
    local sec=$1 key=$2 v line cur='' n=0 s
    SRC=default
    v=$3
    while IFS= read -r line || [ -n "$line" ]; do
        n=$((n + 1))
        case "$line" in
        \[*\]) cur=${line#[} cur=${cur%]} ;;
        *=*)
            local k=${line%%=*} val=${line#*=}
            k=${k//[[:space:]]/}
            val=${val#"${val%%[![:space:]]*}"}
            val=${val%"${val##*[![:space:]]}"}
            if [ "$cur" = "$sec" ] && [ "$k" = "$key" ]; then
                v=$val
                SRC="$CFG:$n"
            fi
            ;;
        esac
    done <"$CFG"
    for s in "${SETS[@]}"; do
        case "$s" in "$sec.$key="*)
            v=${s#*=}
            SRC=--set
            ;;
        esac
    done
    VAL=$v
}
get run dir runs/default
RUN_DIR=$VAL
RUN_SRC=$SRC
get checkpoint resume auto
RESUME=$VAL
RESUME_SRC=$SRC
get fake steps 100
STEPS=$VAL
get fake step_ms 50
STEP_MS=$VAL
case "$STEPS$STEP_MS" in *[!0-9]*)
    echo "dgtrain: $CFG: fake.steps and fake.step_ms must be integers" >&2
    exit 1
    ;;
esac

if [ "$PRINT" = 1 ]; then
    printf 'run.dir = "%s"  # %s\n' "$RUN_DIR" "$RUN_SRC"
    printf 'checkpoint.resume = "%s"  # %s\n' "$RESUME" "$RESUME_SRC"
    printf 'fake.steps = %s  # fake\n' "$STEPS"
    exit 0
fi

[ -x "${FAKE_DRIVER:-}" ] || {
    echo "dgtrain(fake): FAKE_DRIVER is not set to the health_driver binary" >&2
    exit 2
}
mkdir -p -- "$RUN_DIR/fake"
if [ "${FAKE_STALL_FIRST:-0}" = 1 ] && [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then
    export DG_TEST_STALL_RANK=1 DG_TEST_STALL_STEP=5
fi
exec "$FAKE_DRIVER" --dir "$RUN_DIR/fake" --resume-file "$RUN_DIR/fake/checkpoint" --steps "$STEPS" \
    --step-ms "$STEP_MS" --heartbeat 0.2 --timeout 3 --ckpt-ms 300
