#!/usr/bin/env bash
# run_prof.sh — where one GPT-2 124M training step (bf16, micro-batch 32 x 1024) spends its time, on a GPU
# machine in one call: dgtrain with CUDA Graph replay on and off (step times, medians of steps 6-20), then
# a CUPTI kernel profile of each (bench/gpu/cupti_trace.c + timeline_steps.py), so the two can be compared
# kernel by kernel. Extra environment for both runs: DGTRAIN_ENV (e.g. "DG_CUDA_ATTN_CUDNN=0").
#
#   bench/gpu/run_prof.sh BUILD_DIR
# BUILD_DIR holds src/cli/dgtrain and bench/gpu/libdg_cupti_trace.so (or libdg_cupti_trace.so at its
# top). Logs and summary.log go to $OUT (default ./gpu-prof-out); BUDGET_S (default 240) skips what
# would start too late.
source "$(dirname "$0")/lib.sh" && bench_start gpu-prof-out
bdir=${1:?usage: run_prof.sh BUILD_DIR}
budget=${BUDGET_S:-240}
mpi=(mpirun --oversubscribe --allow-run-as-root --bind-to none)
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
dgtrain=$bdir/src/cli/dgtrain
cupti=$bdir/bench/gpu/libdg_cupti_trace.so
[ -f "$cupti" ] || cupti=$bdir/libdg_cupti_trace.so
tmp=$work
bench_shards $((24 * 32 * 1025 + 1)) "$out/shards.log" || exit 1

train() { # name, cuda_graph, steps, extra env...
  local name=$1 graph=$2 steps=$3
  shift 3
  env ${DGTRAIN_ENV:-} "$@" "${mpi[@]}" -n 1 "$dgtrain" "$root/configs/gpt2-124m.ini" --set run.dir="$tmp/$name" \
    --set data.train="$tmp/data/bench_train_*.bin" --set data.val="$tmp/data/bench_val_*.bin" --set data.val_every=0 \
    --set train.steps=$steps --set train.global_batch=32 --set train.micro_batch=32 --set train.log_every=1 \
    --set parallel.backend=cuda --set parallel.cuda_graph=$graph --set checkpoint.every=0 \
    --set checkpoint.resume=never >"$out/$name.log" 2>&1
}
median_ms() {
  python3 -c "
import json,sys
r=[json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ms=sorted(x['step_ms'] for x in r if x.get('event')=='step' and x['step']>5)
print('%.2f ms (min %.2f, %d steps)'%(ms[len(ms)//2],ms[0],len(ms)) if ms else 'no steps')" "$1"
}
for g in true false true false; do
  [ "$(left)" -gt 60 ] || break
  name=graph_$g
  train $name $g 20
  log "dgtrain cuda_graph=$g rc=$?: step $(median_ms "$tmp/$name/metrics.jsonl")"
done
for g in true false; do
  [ "$(left)" -gt 50 ] && [ -f "$cupti" ] || break
  name=prof_$g
  train $name $g 12 CUDA_INJECTION64_PATH="$cupti" DG_CUPTI_OUT="$tmp/trace_${g}_%r.csv"
  python3 "$root/bench/gpu/timeline_steps.py" --csv "$tmp/trace_${g}_0.csv" --skip 5 --top 40 >"$out/profile_$g.txt" 2>&1
  log "CUPTI profile, cuda_graph=$g:"
  cat "$out/profile_$g.txt" >>"$out/summary.log"
done
log "done"
