# tests/sample/lib.sh — shared by the sample tests (sourced): train the tiny model a few steps with the real
# dgtrain (1 rank, CPU; checkpoints every 3 steps) into $WORK/run and set CKPT to its newest checkpoint. Needs DGTRAIN, MPI (array), WORK.
# shellcheck shell=bash
source "$(dirname "${BASH_SOURCE[0]}")/../lib/skip.sh"

train_tiny() {
    cat >"$WORK/cfg.ini" <<INI
[run]
name = sample
seed = 4242
[model]
preset = tiny
[data]
val_every = 0
[train]
steps = ${1:-6}
global_batch = 8
micro_batch = 2
[parallel]
backend = cpu
threads = 1
[checkpoint]
every = 3
keep = 0
[health]
timeout_s = 300
INI
    if ! OMP_NUM_THREADS=1 timeout 300 "${MPI[@]}" -n 1 "$DGTRAIN" "$WORK/cfg.ini" --set run.dir="$WORK/run" \
        >"$WORK/train.out" 2>&1; then
        echo "FAIL: training the tiny model failed: $(tail -n 5 "$WORK/train.out")"
        exit 1
    fi
    CKPT=$(ls "$WORK"/run/checkpoints/step_*.h5 2>/dev/null | tail -n 1)
    [ -n "$CKPT" ] || {
        echo "FAIL: the run wrote no checkpoint"
        exit 1
    }
}
