#!/usr/bin/env bash
# ab.sh — the same GPU training benchmark on two source trees in one call: proves that a change which
# should not move speed (a restructuring, a pruning of kernel variants) did not, by interleaving runs of
# the OLD and the NEW build on one GPU (A B A B ...), so that clock, thermal and co-tenant drift hit both
# alike. Each run trains GPT-2 124M (configs/gpt2-124m.ini) for STEPS steps at micro-batch B x 1024 in PREC
# on synthetic shards; the figure per run is the median step time over the steps after the fifth, and the
# verdict is the ratio of the medians of the runs (NEW / OLD tokens/s) against 1 +- TOL.
#
#   bench/gpu/ab.sh OLD_SRC NEW_SRC        (source trees; each is built in OLD_SRC/build-ab, NEW_SRC/build-ab
#                                           unless that already holds a working dgtrain)
# Environment: OUT (default ./gpu-ab-out), STEPS (30), B (32), PREC (bf16), ROUNDS (3 runs of each),
# TOL (0.01), CUDA_ARCH (90), JOBS (nproc). Exit 0 when within TOL, 1 when not, 2 on a build/run failure.
source "$(dirname "$0")/lib.sh" && bench_start gpu-ab-out ab_summary.log
old_src=$(cd "${1:?usage: ab.sh OLD_SRC NEW_SRC}" && pwd)
new_src=$(cd "${2:?usage: ab.sh OLD_SRC NEW_SRC}" && pwd)
steps=${STEPS:-30} B=${B:-32} prec=${PREC:-bf16} rounds=${ROUNDS:-3} tol=${TOL:-0.01}

build() { # build() SRC LOGNAME: dgtrain only, in SRC/build-ab
    local src=$1 b=$1/build-ab
    usable "$b/src/cli/dgtrain" && return 0
    bench_cmake "$src" "$b" "$out/build_$2.log" dgtrain
}
t0=$(date +%s)
build "$old_src" old || { log "OLD build failed"; tail -20 "$out/build_old.log"; exit 2; }
build "$new_src" new || { log "NEW build failed"; tail -20 "$out/build_new.log"; exit 2; }
log "builds ready in $(($(date +%s) - t0)) s; $(nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader 2>&1 | head -1)"

bench_shards $(((steps + 2) * B * 1025 + 1)) "$out/shards.log" || exit 2
export DG_CUDA_GEMM_TUNE_FILE=$work/gemm_tune.txt # both builds read the same tuning choices

one() { # one() TAG SRC ROUND: prints the median step_ms of one run
    local rd=$work/run_$1_$3
    "$mpirun" --allow-run-as-root --bind-to none -n 1 "$2/build-ab/src/cli/dgtrain" "$2/configs/gpt2-124m.ini" \
        --set run.dir="$rd" --set data.train="$work/data/bench_train_*.bin" \
        --set data.val="$work/data/bench_val_*.bin" --set data.val_every=0 --set train.steps="$steps" \
        --set train.global_batch="$B" --set train.micro_batch="$B" --set train.precision="$prec" \
        --set train.log_every=1 --set parallel.backend=cuda --set checkpoint.every=0 \
        --set checkpoint.async=false --set checkpoint.resume=never >"$out/run_$1_$3.log" 2>&1 || return 1
    python3 - "$rd/metrics.jsonl" <<'EOF'
import json, statistics, sys
ms = [e["step_ms"] for e in map(json.loads, open(sys.argv[1])) if "step_ms" in e and e.get("step", 0) > 5]
print(f"{statistics.median(ms):.3f}")
EOF
}
# a warm-up run of each (GEMM tuning, module load, page cache) that is not counted
one old "$old_src" 0 >/dev/null && one new "$new_src" 0 >/dev/null || { log "warm-up run failed"; exit 2; }
old_ms=() new_ms=()
for r in $(seq 1 "$rounds"); do
    a=$(one old "$old_src" "$r") || { log "OLD run $r failed"; tail -5 "$out/run_old_$r.log"; exit 2; }
    b=$(one new "$new_src" "$r") || { log "NEW run $r failed"; tail -5 "$out/run_new_$r.log"; exit 2; }
    old_ms+=("$a") new_ms+=("$b")
    log "round $r: old $a ms/step, new $b ms/step"
done
python3 - "$tol" "$B" "${old_ms[*]}" "${new_ms[*]}" <<'EOF' | tee -a "$out/ab_summary.log"
import statistics, sys
tol, B = float(sys.argv[1]), int(sys.argv[2])
old = statistics.median(map(float, sys.argv[3].split()))
new = statistics.median(map(float, sys.argv[4].split()))
r = old / new  # tokens/s ratio new/old
tok = lambda ms: B * 1024 / (ms / 1e3)
print(f"old {old:.3f} ms/step ({tok(old):,.0f} tok/s)  new {new:.3f} ms/step ({tok(new):,.0f} tok/s)  "
      f"new/old tokens/s = {r:.4f}  verdict: {'within' if abs(r - 1) <= tol else 'OUTSIDE'} {tol:.0%}")
sys.exit(0 if abs(r - 1) <= tol else 1)
EOF
