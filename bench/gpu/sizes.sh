#!/usr/bin/env bash
# sizes.sh — dgtrain against torch.compile at other model sizes and micro-batches than bench/gpu/run.sh's
# gpt2-124m x 32 (issue: the lead must hold at every size), one device call: for each "PRESET:B" in SIZES
# (default "gpt2-124m:8 gpt2-350m:16 gpt2-774m:8") dgtrain bf16 (median step of steps > 5, peak GPU
# memory from the done event) and then torch_gpt2.py --mode compile on the identical model, batch and
# optimizer; prints one line per size with both tokens/s, both peaks and the ratio. COMPARE=fp8 (or another
# train.precision) puts dgtrain at that precision in torch.compile's place: the ratio is then its tokens/s
# over dgtrain bf16's. Reuses BUILD_DIR's
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
run_dg() { # tag precision -> $out/dgtrain_TAG.jsonl
  "$mpirun" --allow-run-as-root --bind-to none -n 1 "$dgtrain" --set model.preset="$p" --set model.seq_len=1024 \
    --set run.dir="$work/run_$1" --set data.train="$work/data/bench_train_*.bin" \
    --set data.val="$work/data/bench_val_*.bin" --set data.val_every=0 --set train.steps="$steps" \
    --set train.global_batch="$b" --set train.micro_batch="$b" --set train.precision="$2" --set train.lr=6e-4 \
    --set train.log_every=100 --set parallel.backend=cuda --set checkpoint.every=0 --set checkpoint.async=false \
    --set checkpoint.resume=never >"$out/dgtrain_$1.log" 2>&1
  echo "dgtrain $1 ($2) rc=$?"
  cp "$work/run_$1/metrics.jsonl" "$out/dgtrain_$1.jsonl" 2>/dev/null
}
for s in $sizes; do
  p=${s%:*}
  b=${s#*:}
  tag=${p}_b$b
  run_dg "$tag" bf16
  if [ -n "${COMPARE:-}" ]; then # dgtrain at another precision as the reference's place
    run_dg "${tag}_$COMPARE" "$COMPARE"
    ref="dgtrain:$out/dgtrain_${tag}_$COMPARE.jsonl"
  else
    PYTHONUNBUFFERED=1 timeout 300 "$py" "$here/torch_gpt2.py" --mode compile --batch "$b" --steps "$tsteps" \
      $(shape "$p") >"$out/torch_$tag.json" 2>"$out/torch_$tag.log"
    echo "torch $tag rc=$?"
    ref="torch:$out/torch_$tag.json"
  fi
  "$py" - "$out/dgtrain_$tag.jsonl" "$ref" "$tag" "${COMPARE:-torch.compile}" <<'PY'
import json, sys
mine, ref, tag, name = sys.argv[1:5]

def dg(path):  # median tok/s and step ms of steps > 5, peak GiB
    try:
        rows = [json.loads(l) for l in open(path) if l.strip()]
    except OSError:
        rows = []
    st = [r for r in rows if r.get("event") == "step" and r["step"] > 5]
    done = [r for r in rows if r.get("event") == "done"]
    ms = sorted(r["step_ms"] for r in st)
    tps = sorted(r["tok_per_s"] for r in st)
    peak = (done[-1].get("gpu_peak_alloc_bytes") or 0) / 2**30 if done else 0
    return (tps[len(tps) // 2] if tps else 0), (ms[len(ms) // 2] if ms else 0), peak

d_tps, d_ms, d_peak = dg(mine)
kind, path = ref.split(":", 1)
if kind == "dgtrain":
    r_tps, _, r_peak = dg(path)
else:
    try:
        t = json.loads(open(path).read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        t = {}
    r_tps, r_peak = t.get("tok_per_s") or 0, (t.get("peak_alloc_bytes") or 0) / 2**30
if kind == "dgtrain":  # the other precision against dgtrain's bf16
    print("SIZE %s: dgtrain bf16 %.0f tok/s (%.2f ms, peak %.2f GiB) | dgtrain %s %.0f tok/s (peak %.2f GiB) | "
          "ratio %s/bf16 %.3f" % (tag, d_tps, d_ms, d_peak, name, r_tps, r_peak, name, r_tps / d_tps if d_tps else 0))
else:
    print("SIZE %s: dgtrain %.0f tok/s (%.2f ms, peak %.2f GiB) | %s %.0f tok/s (peak %.2f GiB) | ratio %.3f"
          % (tag, d_tps, d_ms, d_peak, name, r_tps, r_peak, d_tps / r_tps if r_tps else 0))
PY
done
