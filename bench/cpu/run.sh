#!/usr/bin/env bash
# CPU backend benchmark (issue 3): training tokens/s of dgtrain's CPU backend against PyTorch eager on the
# CPU, for the same model, batch and thread count, measured in the same run. Prints one line per round and
# the median ratio per model.
#   bench/cpu/run.sh [BUILD_DIR]          (default: build; needs python3 with torch: apt-get install python3-torch)
# Environment:
#   THREADS  threads for both (default: all cores)
#   STEPS    timed steps per run (default 20; 3 warm-up steps come first)
#   REPEAT   rounds per model (default 3): each round runs dgtrain and then PyTorch, so both see about the
#            same machine load; the ratio reported is the median of the rounds' ratios
#   MODELS   which models (default "tiny 6x384x256")
#   PYTHON   (default /usr/bin/python3)
#   OMP_WAIT_POLICY  defaults to passive here: OpenMP threads that spin between parallel regions take cores
#            from everything else on a shared machine (PyTorch's OpenMP; dgtrain honours it in its pool)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
dgtrain=$build/src/cli/dgtrain
[ -x "$dgtrain" ] || { echo "bench/cpu: $dgtrain not found: build first (cmake --build $build)" >&2; exit 1; }
py=${PYTHON:-/usr/bin/python3}
"$py" -c 'import torch' 2>/dev/null || { echo "bench/cpu: $py has no torch (apt-get install python3-torch)" >&2; exit 1; }
threads=${THREADS:-$(nproc)}
steps=${STEPS:-20}
repeat=${REPEAT:-3}
models=${MODELS:-"tiny 6x384x256"}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
warm=3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# name -> layers heads d_model seq_len batch
declare -A shape=([tiny]="4 4 128 128 8" [6x384x256]="6 6 384 256 8")

median() { "$py" -c 'import statistics, sys; print(f"{statistics.median(float(x) for x in sys.argv[1:]):.2f}")' "$@"; }

echo "bench/cpu: $(date -u +%FT%TZ), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)," \
     "THREADS=$threads STEPS=$steps REPEAT=$repeat OMP_WAIT_POLICY=$OMP_WAIT_POLICY"
printf '%-12s %5s %8s %14s %14s %8s %6s\n' model round threads "dgtrain tok/s" "torch tok/s" ratio load
for name in $models; do
  [ -n "${shape[$name]:-}" ] || { echo "bench/cpu: unknown model '$name' (tiny, 6x384x256)" >&2; exit 1; }
  read -r L H C T B <<<"${shape[$name]}"
  ratios=()
  for r in $(seq "$repeat"); do
    rd=$work/$name-$r
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
    # PyTorch's BLAS (OpenBLAS, pthreads) takes its thread count from OPENBLAS_NUM_THREADS, not from
    # torch.set_num_threads: pin it to the same count.
    ref=$(OPENBLAS_NUM_THREADS=$threads "$py" "$root/bench/cpu/torch_ref.py" --layers "$L" --heads "$H" \
          --d-model "$C" --seq-len "$T" --batch "$B" --threads "$threads" --steps "$steps" --warmup "$warm" |
          "$py" -c 'import json,sys; print(json.loads(sys.stdin.read())["tok_per_s"])')
    ratio=$("$py" -c "print(f'{$ours / $ref:.2f}')")
    ratios+=("$ratio")
    printf '%-12s %5s %8s %14.0f %14.0f %8s %6s\n' "$name" "$r" "$threads" "$ours" "$ref" "${ratio}x" \
      "$(cut -d' ' -f1 /proc/loadavg)"
  done
  echo "$name: median ratio $(median "${ratios[@]}")x over $repeat rounds (${ratios[*]})"
done
echo "torch: $("$py" -c 'import torch; print(torch.__version__)'), dgtrain: $("$dgtrain" --version | head -1)"
