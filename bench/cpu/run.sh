#!/usr/bin/env bash
# CPU backend benchmark (issue 3): training tokens/s of dgtrain's CPU backend against PyTorch eager on the
# CPU, for the same model, batch and thread count, measured in the same run. Prints a table with the ratio.
#   bench/cpu/run.sh [BUILD_DIR]          (default: build; needs python3 with torch: apt-get install python3-torch)
# Environment: THREADS (default: all cores), STEPS (timed steps, default 20), PYTHON (default /usr/bin/python3).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
dgtrain=$build/src/cli/dgtrain
[ -x "$dgtrain" ] || { echo "bench/cpu: $dgtrain not found: build first (cmake --build $build)" >&2; exit 1; }
py=${PYTHON:-/usr/bin/python3}
"$py" -c 'import torch' 2>/dev/null || { echo "bench/cpu: $py has no torch (apt-get install python3-torch)" >&2; exit 1; }
threads=${THREADS:-$(nproc)}
steps=${STEPS:-20}
warm=3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# name layers heads d_model seq_len batch
cases=("tiny 4 4 128 128 8" "6x384x256 6 6 384 256 8")
printf '%-12s %8s %14s %14s %8s\n' model threads "dgtrain tok/s" "torch tok/s" ratio
for c in "${cases[@]}"; do
  read -r name L H C T B <<<"$c"
  rd=$work/$name
  OMP_NUM_THREADS=$threads "$dgtrain" "$root/configs/default.ini" \
    --set run.dir="$rd" --set model.preset=custom --set model.n_layer="$L" --set model.n_head="$H" \
    --set model.d_model="$C" --set model.seq_len="$T" --set model.vocab_size=256 \
    --set train.micro_batch="$B" --set train.global_batch="$B" --set train.steps=$((steps + warm)) \
    --set data.val_every=0 --set parallel.threads="$threads" --set parallel.backend=cpu \
    --set checkpoint.resume=never >"$work/$name.log" 2>&1 || { cat "$work/$name.log" >&2; exit 2; }
  ours=$("$py" - "$rd/metrics.jsonl" "$warm" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tps = sorted(r["tok_per_s"] for r in rows if r["event"] == "step" and r["step"] > int(sys.argv[2]))
print(tps[len(tps) // 2])
PY
)
  ref=$("$py" "$root/bench/cpu/torch_ref.py" --layers "$L" --heads "$H" --d-model "$C" --seq-len "$T" \
        --batch "$B" --threads "$threads" --steps "$steps" --warmup "$warm" | "$py" -c 'import json,sys; print(json.loads(sys.stdin.read())["tok_per_s"])')
  ratio=$("$py" -c "print(f'{$ours / $ref:.2f}')")
  printf '%-12s %8s %14.0f %14.0f %8s\n' "$name" "$threads" "$ours" "$ref" "${ratio}x"
done
echo "torch: $("$py" -c 'import torch; print(torch.__version__)'), dgtrain: $("$dgtrain" --version | head -1)"
