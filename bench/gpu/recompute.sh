#!/usr/bin/env bash
# recompute.sh — what train.recompute costs and buys on the GPU, one device call (docs/planning.md,
# "Activation recompute"): gpt2-124m bf16 micro-batch B (32) x 1024 at every level (tokens/s: median of
# steps > 5; peak GPU memory from the done event; the ratio to `none`), then gpt2-1558m at micro-batch
# BIG_B (96: its activations do not fit one H200 without recompute): --plan-only without recompute (expected: refused by the memory-fit check) and a few steps
# with train.recompute=full. Uses BUILD_DIR's dgtrain (default build-gpu). OUT for logs.
source "$(dirname "$0")/lib.sh" && bench_start recompute-out
build=${1:-$root/build-gpu}
B=${B:-32}
BIG_B=${BIG_B:-96}
steps=${STEPS:-16}
dgtrain=$build/src/cli/dgtrain
[ -x "$dgtrain" ] || { echo "no $dgtrain"; exit 1; }
bench_shards $(((steps + 2) * B * 1025 + 1)) "$out/shards.log" || exit 1
export DG_CUDA_GEMM_TUNE_FILE=$work/gemm_tune.txt
common=(--set data.train="$work/data/bench_train_*.bin" --set data.val="$work/data/bench_val_*.bin"
  --set data.val_every=0 --set train.precision=bf16 --set parallel.backend=cuda --set checkpoint.every=0
  --set checkpoint.async=false --set checkpoint.resume=never --set train.log_every=100 --set model.seq_len=1024)
summ() { # tag -> one line
  "$py" - "$out/$1.jsonl" "$1" <<'PY'
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
except OSError:
    rows = []
st = [r for r in rows if r.get("event") == "step" and r["step"] > 5] or [r for r in rows if r.get("event") == "step"]
d = [r for r in rows if r.get("event") == "done"]
s = [r for r in rows if r.get("event") == "start"]
t = sorted(r["tok_per_s"] for r in st)
print("RUN %s: tok/s %.0f, peak %.2f GiB, arena %.2f GiB, loss(last) %s" % (
    sys.argv[2], t[len(t) // 2] if t else 0, ((d[-1].get("gpu_peak_alloc_bytes") or 0) if d else 0) / 2**30,
    ((s[0].get("arena_bytes") or 0) if s else 0) / 2**30, st[-1]["loss"] if st else None))
PY
}
for lvl in none gelu selective full; do
  tag=124m_b${B}_$lvl
  "$mpirun" --allow-run-as-root --bind-to none -n 1 "$dgtrain" "${common[@]}" --set model.preset=gpt2-124m \
    --set run.dir="$work/$tag" --set train.steps="$steps" --set train.global_batch="$B" --set train.micro_batch="$B" \
    --set train.recompute=$lvl >"$out/$tag.log" 2>&1
  echo "$tag rc=$?"
  cp "$work/$tag/metrics.jsonl" "$out/$tag.jsonl" 2>/dev/null
  summ "$tag"
done
big=(--set model.preset=gpt2-1558m --set train.global_batch="$BIG_B" --set train.micro_batch="$BIG_B")
"$mpirun" --allow-run-as-root --bind-to none -n 1 "$dgtrain" "${common[@]}" "${big[@]}" --set run.dir="$work/p" \
  --set train.recompute=none --plan-only >"$out/1558m_plan_none.log" 2>&1
echo "1558m plan-only none rc=$? (1 = refused by the memory-fit check)"
grep -iE "fit|GiB" "$out/1558m_plan_none.log" | head -5
tag=1558m_b${BIG_B}_full
"$mpirun" --allow-run-as-root --bind-to none -n 1 "$dgtrain" "${common[@]}" "${big[@]}" --set run.dir="$work/$tag" \
  --set train.steps=${BIG_STEPS:-4} --set train.recompute=full >"$out/$tag.log" 2>&1
echo "$tag rc=$?"
cp "$work/$tag/metrics.jsonl" "$out/$tag.jsonl" 2>/dev/null
summ "$tag"
tail -3 "$out/$tag.log"
