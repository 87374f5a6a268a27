#!/usr/bin/env bash
# fp8_quality.sh — train.precision=fp8 against bf16 on real text (docs/cuda.md, "FP8"): GPT-2 124M,
# micro-batch 32 x 1024, STEPS (default 2000) steps from the same seed, once per precision, on text found
# on the GPU machine (the Python standard library's sources and the license texts) tokenized with the
# GPT-2 tokenizer (dgprep --tokenizer gpt2; VOCAB = a gpt2.tiktoken ranks file). Validation every
# VAL_EVERY steps on held-out text. Prints both validation curves, the last validation losses and their
# difference (the target: |fp8 - bf16| <= 0.02), and the median tokens/s of each; CSV under OUT.
#   fp8_quality.sh BUILD_DIR     (env: VOCAB, STEPS, VAL_EVERY, OUT, TEXT_GLOB)
set -uo pipefail
build=${1:?usage: fp8_quality.sh BUILD_DIR}
out=${OUT:-$PWD/fp8-quality}
steps=${STEPS:-2000}
val_every=${VAL_EVERY:-100}
vocab=${VOCAB:?set VOCAB to a gpt2.tiktoken file}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# the text: every .py file of the newest Python standard library here plus the license texts, in name order
lib=$(ls -d /usr/lib/python3.[0-9]* 2>/dev/null | sort -V | tail -1)
find "$lib" -name '*.py' -size +0 -size -400k -not -path '*/test/*' -type f | sort >"$work/files.txt"
ls /usr/share/common-licenses/* 2>/dev/null | sort >>"$work/files.txt"
echo "text: $(wc -l <"$work/files.txt") files, $(cat $(cat "$work/files.txt") | wc -c) bytes from $lib"
"$build/src/data/dgprep" --out "$work/text" --tokenizer gpt2 --vocab "$vocab" --val-fraction 0.05 \
  --name text --quiet $(cat "$work/files.txt") || { echo "dgprep failed"; exit 1; }
ls -la "$work/text" | tail -4
mpirun=$(command -v mpirun || command -v mpiexec)
for prec in bf16 fp8; do
  "$mpirun" --allow-run-as-root --bind-to none -n 1 "$build/src/cli/dgtrain" --set model.preset=gpt2-124m \
    --set model.seq_len=1024 --set run.dir="$work/run_$prec" --set run.seed=1337 \
    --set data.train="$work/text/text_train_*.bin" --set data.val="$work/text/text_val_*.bin" \
    --set data.val_every="$val_every" --set data.val_batches=4 --set train.steps="$steps" \
    --set train.global_batch=32 --set train.micro_batch=32 --set train.precision=$prec --set train.lr=6e-4 \
    --set train.warmup_steps=100 --set train.log_every=50 --set parallel.backend=cuda \
    --set checkpoint.every=0 --set checkpoint.async=false --set checkpoint.resume=never \
    >"$out/dgtrain_$prec.log" 2>&1
  echo "dgtrain $prec rc=$?"
  cp "$work/run_$prec/metrics.jsonl" "$out/metrics_$prec.jsonl" 2>/dev/null
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def load(p):
    try:
        return [json.loads(l) for l in open("%s/metrics_%s.jsonl" % (out, p)) if l.strip()]
    except OSError:
        return []
runs = {p: load(p) for p in ("bf16", "fp8")}
val = {p: {r["step"]: r["loss"] for r in rs if r.get("event") == "val"} for p, rs in runs.items()}
tps = {}
for p, rs in runs.items():
    t = sorted(r["tok_per_s"] for r in rs if r.get("event") == "step" and r.get("step", 0) > 5)
    tps[p] = t[len(t) // 2] if t else 0
with open("%s/val_curves.csv" % out, "w") as f:
    f.write("step,val_bf16,val_fp8\n")
    for s in sorted(set(val["bf16"]) | set(val["fp8"])):
        f.write("%d,%s,%s\n" % (s, val["bf16"].get(s, ""), val["fp8"].get(s, "")))
        print("VAL step %5d  bf16 %s  fp8 %s" % (s, val["bf16"].get(s, "-"), val["fp8"].get(s, "-")))
common = sorted(set(val["bf16"]) & set(val["fp8"]))
if common:
    s = common[-1]
    d = val["fp8"][s] - val["bf16"][s]
    print("QUALITY step %d: val bf16 %.4f fp8 %.4f diff %+.4f (target |diff| <= 0.02: %s); tok/s bf16 %.0f fp8 %.0f ratio %.3f"
          % (s, val["bf16"][s], val["fp8"][s], d, "met" if abs(d) <= 0.02 else "MISSED", tps["bf16"], tps["fp8"],
             tps["fp8"] / tps["bf16"] if tps["bf16"] else 0))
else:
    print("QUALITY: no validation losses (see the logs)")
PY
