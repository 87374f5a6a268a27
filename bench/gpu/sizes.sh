#!/usr/bin/env bash
# sizes.sh — dgtrain against torch.compile at other model sizes and micro-batches than bench/gpu/run.sh's
# gpt2-124m x 32 (issue: the lead must hold at every size), one device call: for each "PRESET:B" in SIZES
# (default "gpt2-124m:8 gpt2-350m:16 gpt2-774m:8") dgtrain bf16 (median step of steps > 5, peak GPU
# memory from the done event) and then torch_gpt2.py --mode compile on the identical model, batch and
# optimizer; prints one line per size with both tokens/s, both peaks and the ratio. Reuses BUILD_DIR's
# dgtrain (default build-gpu; built with run.sh's flags when missing). OUT for logs (default ./sizes-out).
source "$(dirname "$0")/lib.sh" && bench_start sizes-out
build=${1:-$root/build-gpu}
sizes=${SIZES:-"gpt2-124m:8 gpt2-350m:16 gpt2-774m:8"}
steps=${STEPS:-16}
tsteps=${TORCH_STEPS:-12}
dgtrain=$build/src/cli/dgtrain
if ! [ -x "$dgtrain" ]; then
  bench_cmake "$root" "$build" "$out/build.log" dgtrain || { tail -30 "$out/build.log"; exit 1; }
fi
maxb=0
for s in $sizes; do b=${s#*:}; [ "$b" -gt "$maxb" ] && maxb=$b; done
bench_shards $(((steps + 2) * maxb * 1025 + 1)) "$out/shards.log" || exit 1
export DG_CUDA_GEMM_TUNE_FILE=$work/gemm_tune.txt
shape() { # preset -> torch_gpt2.py flags
  case $1 in
    gpt2-124m) echo "--layers 12 --heads 12 --d-model 768" ;;
    gpt2-350m) echo "--layers 24 --heads 16 --d-model 1024" ;;
    gpt2-774m) echo "--layers 36 --heads 20 --d-model 1280" ;;
    gpt2-1558m) echo "--layers 48 --heads 25 --d-model 1600" ;;
  esac
}
for s in $sizes; do
  p=${s%:*}
  b=${s#*:}
  tag=${p}_b$b
  "$mpirun" --allow-run-as-root --bind-to none -n 1 "$dgtrain" --set model.preset="$p" --set model.seq_len=1024 \
    --set run.dir="$work/run_$tag" --set data.train="$work/data/bench_train_*.bin" \
    --set data.val="$work/data/bench_val_*.bin" --set data.val_every=0 --set train.steps="$steps" \
    --set train.global_batch="$b" --set train.micro_batch="$b" --set train.precision=bf16 --set train.lr=6e-4 \
    --set train.log_every=100 --set parallel.backend=cuda --set checkpoint.every=0 --set checkpoint.async=false \
    --set checkpoint.resume=never >"$out/dgtrain_$tag.log" 2>&1
  echo "dgtrain $tag rc=$?"
  cp "$work/run_$tag/metrics.jsonl" "$out/dgtrain_$tag.jsonl" 2>/dev/null
  PYTHONUNBUFFERED=1 timeout 300 "$py" "$here/torch_gpt2.py" --mode compile --batch "$b" --steps "$tsteps" \
    $(shape "$p") >"$out/torch_$tag.json" 2>"$out/torch_$tag.log"
  echo "torch $tag rc=$?"
  "$py" - "$out" "$tag" <<'PY'
import json, sys
out, tag = sys.argv[1], sys.argv[2]
try:
    rows = [json.loads(l) for l in open("%s/dgtrain_%s.jsonl" % (out, tag)) if l.strip()]
except OSError:
    rows = []
st = [r for r in rows if r.get("event") == "step" and r["step"] > 5]
done = [r for r in rows if r.get("event") == "done"]
ms = sorted(r["step_ms"] for r in st)
tps = sorted(r["tok_per_s"] for r in st)
try:
    t = json.loads(open("%s/torch_%s.json" % (out, tag)).read().strip().splitlines()[-1])
except (OSError, ValueError, IndexError):
    t = {}
d_tps = tps[len(tps) // 2] if tps else 0
d_peak = (done[-1].get("gpu_peak_alloc_bytes") or 0) / 2**30 if done else 0
t_tps = t.get("tok_per_s") or 0
t_peak = (t.get("peak_alloc_bytes") or 0) / 2**30
print("SIZE %s: dgtrain %.0f tok/s (%.2f ms, peak %.2f GiB) | torch.compile %.0f tok/s (peak %.2f GiB) | ratio %.3f"
      % (tag, d_tps, ms[len(ms) // 2] if ms else 0, d_peak, t_tps, t_peak, d_tps / t_tps if t_tps else 0))
PY
done
