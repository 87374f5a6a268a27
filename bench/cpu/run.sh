#!/usr/bin/env bash
# CPU backend benchmark (issue 3): training tokens/s of dgtrain's CPU backend against PyTorch eager on the
# CPU, for the same model, batch and thread count, measured in the same run. Prints one line per round and
# the median ratio per model.
#   bench/cpu/run.sh [BUILD_DIR]          (default: build; needs python3 with torch: apt-get install python3-torch)
# Environment:
#   MODE     same-threads (default): both programs get THREADS threads (dgtrain parallel.threads and
#            OMP_NUM_THREADS; PyTorch torch.set_num_threads and OPENBLAS_NUM_THREADS), OMP_WAIT_POLICY
#            defaults to passive. defaults: each program as it starts with nothing set: dgtrain without
#            parallel.threads or any thread variable, PyTorch with its own default thread count (Debian's
#            1.13 picks 1 intra-op thread on the 2-core VM; its OpenBLAS starts one thread per core) and
#            OMP_WAIT_POLICY left as the caller's environment has it. THREADS is ignored.
#   THREADS  threads for both in same-threads mode (default: all cores)
#   STEPS    timed steps per run (default 20; 3 warm-up steps come first)
#   REPEAT   rounds per model (default 3): each round runs dgtrain and then PyTorch, so both see about the
#            same machine load; the ratio reported is the median of the rounds' ratios
#   MODELS   which models (default "tiny 6x384x256"): tiny, or LxCxT = L layers, width C, C/64 heads,
#            T tokens (e.g. 6x384x256, 6x512x256, 6x384x512); batch 8 (BATCH), vocabulary 256
#   BATCH    sequences per step, micro-batch = global batch (default 8)
#   PYTHON   (default /usr/bin/python3)
# Per round: the ratio of the two median step rates, and ("best") the ratio of the two fastest steps,
# which on a machine shared with other work is the figure least disturbed by it.
#   OMP_WAIT_POLICY  defaults to passive here: OpenMP threads that spin between parallel regions take cores
#            from everything else on a shared machine (PyTorch's OpenMP; dgtrain honours it in its pool)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
dgtrain=$build/src/cli/dgtrain
[ -x "$dgtrain" ] || { echo "bench/cpu: $dgtrain not found: build first (cmake --build $build)" >&2; exit 1; }
py=${PYTHON:-/usr/bin/python3}
"$py" -c 'import torch' 2>/dev/null || { echo "bench/cpu: $py has no torch (apt-get install python3-torch)" >&2; exit 1; }
mode=${MODE:-same-threads}
case $mode in same-threads | defaults) ;; *) echo "bench/cpu: MODE is same-threads or defaults" >&2; exit 1 ;; esac
threads=${THREADS:-$(nproc)}
batch=${BATCH:-8}
steps=${STEPS:-20}
repeat=${REPEAT:-3}
models=${MODELS:-"tiny 6x384x256"}
[ "$mode" = defaults ] || export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
warm=3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# name -> layers heads d_model seq_len batch
shape_of() {
  if [ "$1" = tiny ]; then echo "4 4 128 128 $batch"
  elif [[ $1 =~ ^([0-9]+)x([0-9]+)x([0-9]+)$ ]] && ((BASH_REMATCH[2] % 64 == 0)); then
    echo "${BASH_REMATCH[1]} $((BASH_REMATCH[2] / 64)) ${BASH_REMATCH[2]} ${BASH_REMATCH[3]} $batch"
  fi
}

median() { "$py" -c 'import statistics, sys; print(f"{statistics.median(float(x) for x in sys.argv[1:]):.2f}")' "$@"; }

echo "bench/cpu: $(date -u +%FT%TZ), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)," \
     "MODE=$mode THREADS=$threads BATCH=$batch STEPS=$steps REPEAT=$repeat OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-unset}"
printf '%-12s %5s %8s %14s %14s %8s %6s %6s\n' model round threads "dgtrain tok/s" "torch tok/s" ratio load best
# threads: dgtrain's (dflt: its default, the cores it may run on) / PyTorch's intra-op thread count
for name in $models; do
  [ -n "$(shape_of "$name")" ] || { echo "bench/cpu: unknown model '$name' (tiny, or LxCxT with C a multiple of 64)" >&2; exit 1; }
  read -r L H C T B <<<"$(shape_of "$name")"
  ratios=() bests=()
  for r in $(seq "$repeat"); do
    rd=$work/$name-$r
    if [ "$mode" = defaults ]; then
      dgenv=(env -u OMP_NUM_THREADS -u OPENBLAS_NUM_THREADS) dgthr=()
    else
      dgenv=(env OMP_NUM_THREADS="$threads") dgthr=(--set parallel.threads="$threads")
    fi
    "${dgenv[@]}" "$dgtrain" "$root/configs/default.ini" \
      --set run.dir="$rd" --set model.preset=custom --set model.n_layer="$L" --set model.n_head="$H" \
      --set model.d_model="$C" --set model.seq_len="$T" --set model.vocab_size=256 \
      --set train.micro_batch="$B" --set train.global_batch="$B" --set train.steps=$((steps + warm)) \
      --set data.val_every=0 "${dgthr[@]}" --set parallel.backend=cpu \
      --set checkpoint.resume=never >"$work/$name.log" 2>&1 || { cat "$work/$name.log" >&2; exit 2; }
    read -r ours ours_best < <("$py" - "$rd/metrics.jsonl" "$warm" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tps = sorted(r["tok_per_s"] for r in rows if r["event"] == "step" and r["step"] > int(sys.argv[2]))
print(tps[len(tps) // 2], tps[-1])
PY
)
    # PyTorch's BLAS (OpenBLAS, pthreads) takes its thread count from OPENBLAS_NUM_THREADS, not from
    # torch.set_num_threads: pin it to the same count (same-threads mode only).
    if [ "$mode" = defaults ]; then
      tenv=(env -u OMP_NUM_THREADS -u OPENBLAS_NUM_THREADS) tthr=0
    else
      tenv=(env OPENBLAS_NUM_THREADS="$threads") tthr=$threads
    fi
    refj=$("${tenv[@]}" "$py" "$root/bench/cpu/torch_ref.py" --layers "$L" --heads "$H" --d-model "$C" \
           --seq-len "$T" --batch "$B" --threads "$tthr" --steps "$steps" --warmup "$warm")
    read -r ref ref_best < <("$py" -c 'import json,sys; j = json.loads(sys.argv[1]); print(j["tok_per_s"], j["best_tok_per_s"])' "$refj")
    tthr_used=$("$py" -c 'import json,sys; print(json.loads(sys.argv[1])["threads"])' "$refj")
    ratio=$("$py" -c "print(f'{$ours / $ref:.2f}')")
    best=$("$py" -c "print(f'{$ours_best / $ref_best:.2f}')")
    ratios+=("$ratio") bests+=("$best")
    printf '%-12s %5s %8s %14.0f %14.0f %8s %6s %6s\n' "$name" "$r" "${dgthr[0]:+$threads}${dgthr[0]:-dflt}/$tthr_used" "$ours" "$ref" "${ratio}x" \
      "$(cut -d' ' -f1 /proc/loadavg)" "${best}x"
  done
  echo "$name: fastest-step ratio (each program's fastest timed step: the least disturbed by other load)" \
       "median $(median "${bests[@]}")x (${bests[*]})"
  echo "$name: median ratio $(median "${ratios[@]}")x over $repeat rounds (${ratios[*]}; min $(printf '%s\n' "${ratios[@]}" | sort -n | head -1), max $(printf '%s\n' "${ratios[@]}" | sort -n | tail -1))"
done
echo "torch: $("$py" -c 'import torch; print(torch.__version__)'), dgtrain: $("$dgtrain" --version | head -1)"
