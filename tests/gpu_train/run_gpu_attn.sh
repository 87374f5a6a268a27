#!/usr/bin/env bash
# run_gpu_attn.sh — the attention choice on a GPU machine in one call: cuDNN's fused attention (the
# default, DG_CUDA_ATTN_CUDNN=1) against the built-in kernels (0), and those against the generic reference
# kernels, for correctness and speed; the op harness's attention cases, bench_step at both settings, a
# CUPTI kernel profile of dgtrain GPT-2 124M (B=32) with the default, and the bf16 / determinism / graph
# end-to-end cases.
#
#   tests/gpu_train/run_gpu_attn.sh BUILD_DIR
# BUILD_DIR holds the binaries (carried from a build machine; see run_gpu_all.sh) and
# bench/gpu/libdg_cupti_trace.so (or libdg_cupti_trace.so at its top). Logs and summary.log go to $OUT
# (default ./gpu-attn-out). BUDGET_S (default 420) skips phases that would start too late.
set -uo pipefail
t_start=$(date +%s)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bdir=${1:?usage: run_gpu_attn.sh BUILD_DIR}
out=${OUT:-$PWD/gpu-attn-out}
mkdir -p "$out"
budget=${BUDGET_S:-420}
left() { echo $((budget - ($(date +%s) - t_start))); }
log() { echo "== [$(($(date +%s) - t_start))s] $*" | tee -a "$out/summary.log"; }
mpi=(mpirun --oversubscribe --allow-run-as-root --bind-to none)
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
tbc=$bdir/tests/backend_cuda/test_backend_cuda dgtrain=$bdir/src/cli/dgtrain dgckpt=$bdir/src/checkpoint_hdf5/dgckpt
cupti=$bdir/bench/gpu/libdg_cupti_trace.so
[ -f "$cupti" ] || cupti=$bdir/libdg_cupti_trace.so

log "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1); cuDNN: $(ls /usr/lib/x86_64-linux-gnu/libcudnn.so.9* /usr/local/cuda/lib64/libcudnn.so.9* 2>/dev/null | head -2 | tr '\n' ' ')"
for dt in bf16 f16; do
  small=""
  [ $dt = f16 ] && small=--small
  timeout 150 "$tbc" --mode attn-cudnn --dtype $dt $small >"$out/attn_cudnn_$dt.log" 2>&1
  log "attn-cudnn $dt rc=$?: $(grep -hE '^(FAIL|attn-cudnn)' "$out/attn_cudnn_$dt.log" | head -8 | cut -c1-600 | tr '\n' ' ')"
  grep -h 'INFO' "$out/attn_cudnn_$dt.log" | sort | uniq -c | head -8 | cut -c1-400 | tee -a "$out/summary.log"
done
for dt in bf16 f16; do
  timeout 60 "$tbc" --mode harness --dtype $dt --only attention >"$out/harness_attn_$dt.log" 2>&1
  log "harness attention $dt rc=$?: $(tail -1 "$out/harness_attn_$dt.log") $(grep -h '^FAIL' "$out/harness_attn_$dt.log" | head -3 | cut -c1-300 | tr '\n' ' ')"
done
timeout 150 "$tbc" --mode attn-builtin --dtype bf16 >"$out/attn_builtin.log" 2>&1
log "attn-builtin bf16 rc=$?: $(grep -hE '^(FAIL|attn-builtin)' "$out/attn_builtin.log" | head -8 | cut -c1-600 | tr '\n' ' ')"
timeout 60 "$tbc" --mode cpu --dtype bf16 --only attention >"$out/attn_vs_cpu.log" 2>&1
log "attention vs CPU bf16 rc=$?: $(grep -h 'cuda vs cpu' "$out/attn_vs_cpu.log")"

for m in 0 1; do
  [ "$(left)" -gt 60 ] || break
  DG_CUDA_ATTN_CUDNN=$m timeout 90 "$bdir/bench/gpu/bench_step" --B 32 --precision bf16 --steps 5 --warmup 2 \
    >"$out/bench_step_cudnn$m.log" 2>&1
  log "bench_step DG_CUDA_ATTN_CUDNN=$m rc=$?: $(grep -hE 'api|CUDA Graph replay|peak allocated' "$out/bench_step_cudnn$m.log" | tr -s ' ' | tr '\n' ' ')"
done

tmp=$(mktemp -d)
if [ "$(left)" -gt 70 ] && [ -f "$cupti" ]; then
  python3 "$root/bench/gpu/make_shards.py" "$tmp/data" --tokens $((16 * 32 * 1025 + 1)) >/dev/null
  CUDA_INJECTION64_PATH=$cupti DG_CUPTI_OUT=$tmp/trace_%r.csv timeout 120 "${mpi[@]}" -n 1 "$dgtrain" \
    "$root/configs/gpt2-124m.ini" --set run.dir="$tmp/prof" \
    --set data.train="$tmp/data/bench_train_*.bin" --set data.val="$tmp/data/bench_val_*.bin" --set data.val_every=0 \
    --set train.steps=12 --set train.global_batch=32 --set train.micro_batch=32 --set train.log_every=4 \
    --set parallel.backend=cuda --set checkpoint.every=0 --set checkpoint.resume=never >"$out/prof_dgtrain.log" 2>&1
  log "dgtrain under CUPTI rc=$?: $(grep -h '"done"' "$tmp/prof/metrics.jsonl" | cut -c1-200)"
  python3 "$root/bench/gpu/timeline_steps.py" --csv "$tmp/trace_0.csv" --skip 5 --top 30 >"$out/profile.txt" 2>&1
  cat "$out/profile.txt" >>"$out/summary.log"
fi

pids=()
for c in bf16 determinism graph; do
  [ "$(left)" -gt 60 ] || break
  timeout $(($(left) - 10)) python3 "$root/tests/gpu_train/gpu_e2e.py" "$c" "$dgtrain" "$dgckpt" "${mpi[@]}" \
    >"$out/gpu_train_$c.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for c in bf16 determinism graph; do
  [ -f "$out/gpu_train_$c.log" ] && log "gpu_train_$c: $(grep -hE '^(PASS|FAIL|SKIP)' "$out/gpu_train_$c.log" | cut -c1-700 | tr '\n' ' ')"
done
rm -rf "$tmp"
log "done"
