# tests/sample/lib.sh — shared by the sample tests (sourced): train the tiny model a few steps with the real
# dgtrain (1 rank, CPU; checkpoints every 3 steps) into $WORK/run and set CKPT to its newest checkpoint. Needs DGTRAIN, MPI (array), WORK.
# shellcheck shell=bash
source "$(dirname "${BASH_SOURCE[0]}")/../lib/skip.sh"
source "$(dirname "${BASH_SOURCE[0]}")/../lib/tiny.sh"

train_tiny() {
    write_tiny_config "$WORK/cfg.ini" "${1:-6}"
    if ! OMP_NUM_THREADS=1 timeout 300 "${MPI[@]}" -n 1 "$DGTRAIN" "$WORK/cfg.ini" --set run.dir="$WORK/run" \
        --set run.name=sample --set checkpoint.every=3 --set checkpoint.keep=0 \
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
