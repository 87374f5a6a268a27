#!/usr/bin/env bash
# run_gpu_all.sh — the GPU training work on a GPU machine in one call, within a wall-clock budget: the
# end-to-end GPU training tests (tests/gpu_train, including dgtrain vs PyTorch on gpt2-124m), the built-in
# and cuDNN attention checks, the two default.ini dgtrain commands of README, then the benchmark
# (bench_step, dgtrain GPT-2 124M, PyTorch eager and, if time is left, torch.compile), then
# compute-sanitizer memcheck and the checkpoint benchmark (bench/checkpoint/run.sh) if time is left.
# Logs go to $OUT.
#
#   tests/gpu_train/run_gpu_all.sh [BUILD_DIR]
# BUILD_DIR (default build-gpu) is used as it is when its binaries run here (e.g. carried from a build
# machine), else built. Environment: OUT (default ./gpu-out), BUDGET_S (default 540: phases that would
# start later are skipped, so everything already written comes back), CUDA_ARCH (90), PACK_TO (a folder:
# on exit, OUT is packed into PACK_TO/gpu_logs.tgz and summary.log copied beside it, for transports that
# bring back only a few files).
set -uo pipefail
t_start=$(date +%s)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bdir=${1:-$root/build-gpu}
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
budget=${BUDGET_S:-540}
left() { echo $((budget - ($(date +%s) - t_start))); }
log() { echo "== [$(($(date +%s) - t_start))s] $*" | tee -a "$out/summary.log"; }
pack() {
  [ -n "${PACK_TO:-}" ] || return 0
  mkdir -p "$PACK_TO" && tar -czf "$PACK_TO/gpu_logs.tgz" -C "$(dirname "$out")" "$(basename "$out")" &&
    cp "$out/summary.log" "$PACK_TO/summary.log"
}
trap pack EXIT
mpi=(mpirun --oversubscribe --allow-run-as-root --bind-to none)
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export DGT_TEST_ARTIFACTS=$out # gpu_e2e.py torch: both curves with sample ids, torch_curves.txt

log "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1); $(nvcc --version 2>/dev/null | tail -1)"
usable() { [ -x "$1" ] && ! ldd "$1" 2>/dev/null | grep -q 'not found'; }
bins=(src/cli/dgtrain src/checkpoint_hdf5/dgckpt tests/backend_cuda/test_backend_cuda bench/gpu/bench_step
  bench/checkpoint/bench_ckpt)
ok=1
for b in "${bins[@]}"; do usable "$bdir/$b" || ok=0; done
if [ $ok = 1 ]; then
  log "using the binaries in $bdir"
else
  ldd "$bdir/src/cli/dgtrain" 2>&1 | grep 'not found' | head -5 | tee -a "$out/summary.log"
  t0=$(date +%s)
  bdir=$root/build-gpu
  cmake -S "$root" -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDGT_CUDA=ON -DDGT_TEST_HOOKS=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" >"$out/build.log" 2>&1 &&
    cmake --build "$bdir" -j "$(nproc)" --target dgtrain dgckpt test_backend_cuda bench_step bench_ckpt >>"$out/build.log" 2>&1
  rc=$?
  log "build rc=$rc in $(($(date +%s) - t0)) s"
  [ $rc -eq 0 ] || { tail -30 "$out/build.log"; exit 1; }
fi
dgtrain=$bdir/src/cli/dgtrain dgckpt=$bdir/src/checkpoint_hdf5/dgckpt tbc=$bdir/tests/backend_cuda/test_backend_cuda

# ---- the built-in attention: tensor-core kernels vs the generic reference (checks, then timed alone) ----
"$tbc" --mode attn-builtin --dtype bf16 >"$out/attn_builtin.log" 2>&1
log "attn-builtin bf16 rc=$?: $(grep -h 'attn-builtin' "$out/attn_builtin.log" | grep -v '^ok' | cut -c1-600 | tr '\n' ' ')"
# cuDNN's fused attention (the default for bf16/f16 where it plans the shape) against the built-in kernels
"$tbc" --mode attn-cudnn --dtype bf16 >"$out/attn_cudnn.log" 2>&1
log "attn-cudnn bf16 rc=$?: $(grep -hE '^(FAIL|attn-cudnn)' "$out/attn_cudnn.log" | head -6 | cut -c1-600 | tr '\n' ' ')"
for dt in bf16 f16; do # every op against float64, attention through cuDNN
  "$tbc" --mode harness --dtype $dt >"$out/harness_$dt.log" 2>&1
  log "harness $dt rc=$?: $(tail -1 "$out/harness_$dt.log") $(grep -h '^FAIL' "$out/harness_$dt.log" | head -3 | cut -c1-300 | tr '\n' ' ')"
done
for dt in bf16 f16 f32; do # the fused MLP backward op against float64
  "$tbc" --mode harness --dtype $dt --only dgelu >"$out/harness_dgelu_$dt.log" 2>&1
  log "harness dgelu $dt rc=$?: $(tail -1 "$out/harness_dgelu_$dt.log") $(grep -h '^FAIL' "$out/harness_dgelu_$dt.log" | head -3 | cut -c1-300 | tr '\n' ' ')"
done

# ---- phase A: correctness, all at once (the GPU is shared; nothing here is timed) ----
pids=()
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ -x "$san" ]; then
  (timeout 240 "$san" --tool racecheck --error-exitcode 3 "$tbc" --mode attn-builtin --dtype bf16 --small \
     >"$out/racecheck_attn_builtin.log" 2>&1; echo "rc=$?" >>"$out/racecheck_attn_builtin.log") &
  pid_race=$!
fi
for c in fp32 bf16 determinism multirank graph fallback torch; do
  python3 "$root/tests/gpu_train/gpu_e2e.py" "$c" "$dgtrain" "$dgckpt" "${mpi[@]}" >"$out/gpu_train_$c.log" 2>&1 &
  pids+=($!)
done
(DG_CUDA_ATTN_CUDNN=0 "$tbc" --mode cpu --dtype bf16 --only attention \
   >"$out/attn_vs_cpu.log" 2>&1; "$tbc" --mode cpu --dtype bf16 --only attention >"$out/attn_vs_cpu_cudnn.log" 2>&1) &
pid_vs=$!
"$tbc" --mode attn-builtin --dtype f16 --small >"$out/attn_builtin_f16.log" 2>&1 &
pid_builtin=$!
tmp=$(mktemp -d)
for p in fp32 bf16; do
  (cd "$tmp" && "${mpi[@]}" -n 1 "$dgtrain" "$root/configs/default.ini" --set parallel.backend=cuda \
    --set train.precision=$p --set run.dir="$tmp/default_$p" >"$out/default_ini_$p.log" 2>&1
   echo "rc=$?" >>"$out/default_ini_$p.log"; cp "$tmp/default_$p/metrics.jsonl" "$out/default_ini_${p}_metrics.jsonl") &
  pids+=($!)
done
wait $pid_builtin
log "attn-builtin f16 rc=$?: $(grep -h 'attn-builtin \[' "$out/attn_builtin_f16.log" | tr '\n' ' ')"
wait $pid_vs
log "attention vs CPU, built-in / cuDNN, rc=$?: $(grep -h 'cuda vs cpu' "$out/attn_vs_cpu.log" "$out/attn_vs_cpu_cudnn.log" | tr '\n' ' ')"
for p in "${pids[@]}"; do wait "$p"; done
[ -n "${pid_race:-}" ] && wait $pid_race &&
  log "racecheck attn-builtin: $(grep -hE 'RACECHECK SUMMARY|^rc=' "$out/racecheck_attn_builtin.log" | tr '\n' ' ')"
for c in fp32 bf16 determinism multirank graph fallback torch; do
  log "gpu_train_$c: $(grep -hE '^(PASS|FAIL|SKIP)' "$out/gpu_train_$c.log" | cut -c1-1500 | tr '
' ' ')"
done
# both curves of the torch case, into summary.log too (it travels even when the packed logs do not)
[ -f "$out/torch_curves.txt" ] && sed 's/^/   /' "$out/torch_curves.txt" >>"$out/summary.log"
for p in fp32 bf16; do
  log "default.ini cuda $p: $(tail -1 "$out/default_ini_$p.log"); last step: $(grep '"step"' "$out/default_ini_${p}_metrics.jsonl" | tail -1 | cut -c1-200); val: $(grep '"val"' "$out/default_ini_${p}_metrics.jsonl" | tail -1 | cut -c1-120)"
done

# ---- phase B: the benchmark, alone on the GPU ----
if [ "$(left)" -gt 40 ]; then
  "$bdir/bench/gpu/bench_step" --B 32 --precision bf16 --steps 5 --warmup 2 \
    --json "$out/bench_step.json" >"$out/bench_step.log" 2>&1
  log "bench_step rc=$?"
  tee -a "$out/summary.log" <"$out/bench_step.log"
fi
if [ "$(left)" -gt 45 ]; then
  python3 "$root/bench/gpu/make_shards.py" "$tmp/data" --tokens $((24 * 32 * 1025 + 1)) >/dev/null
  # cold: a fresh GEMM tuning file (the run times its GEMM shapes); warm reads what cold wrote
  export DG_CUDA_GEMM_TUNE_FILE=$tmp/gemm_tune_bench.txt
  for run in cold warm; do # warm: the same launch again (page cache, driver and loader state warm)
    [ "$run" = warm ] && [ "$(left)" -lt 60 ] && break
    rd=$tmp/gpt2_$run
    t_launch=$(date +%s.%N)
    "${mpi[@]}" -n 1 "$dgtrain" "$root/configs/gpt2-124m.ini" --set run.dir="$rd" \
      --set data.train="$tmp/data/bench_train_*.bin" --set data.val="$tmp/data/bench_val_*.bin" --set data.val_every=0 \
      --set train.steps=20 --set train.global_batch=32 --set train.micro_batch=32 --set train.log_every=5 \
      --set parallel.backend=cuda --set checkpoint.every=0 --set checkpoint.async=false --set checkpoint.resume=never \
      >"$out/dgtrain_$run.log" 2>&1
    log "dgtrain gpt2-124m bf16 B=32 ($run launch) rc=$?"
    echo "$t_launch" >"$out/dgtrain_${run}_launch.txt"
    cp "$rd/metrics.jsonl" "$out/dgtrain_${run}_metrics.jsonl" 2>/dev/null
    tail -3 "$out/dgtrain_$run.log" | tee -a "$out/summary.log"
  done
fi
unset DG_CUDA_GEMM_TUNE_FILE
for mode in eager compile; do
  l=$(left)
  [ "$l" -gt 25 ] || { log "skip torch $mode: budget"; continue; }
  DG_LAUNCH_T=$(date +%s.%N) timeout $((l - 5)) python3 "$root/bench/gpu/torch_gpt2.py" --mode $mode --batch 32 \
    --steps 10 --warmup 3 >"$out/torch_$mode.json" 2>"$out/torch_$mode.log"
  log "torch $mode rc=$?"
done
python3 "$root/bench/gpu/summary.py" "$out" 32 2>&1 | tee -a "$out/summary.log"

# ---- phase C: compute-sanitizer, if time is left ----
l=$(left)
if [ "$l" -gt 30 ]; then
  timeout $((l - 5)) python3 "$root/tests/gpu_train/gpu_e2e.py" memcheck "$dgtrain" "$dgckpt" "${mpi[@]}" \
    >"$out/gpu_train_memcheck.log" 2>&1
  log "gpu_train_memcheck rc=$?: $(grep -hE '^(PASS|FAIL|SKIP)' "$out/gpu_train_memcheck.log" | tr '\n' ' ')"
else
  log "skip memcheck: budget"
fi

# ---- phase D: the checkpoint benchmark (docs/checkpoints.md: save vs dd on this host's disk), if time is left ----
l=$(left)
if [ "$l" -gt 100 ]; then
  timeout $((l - 5)) bash "$root/bench/checkpoint/run.sh" "$bdir" "$tmp/bck" >"$out/bench_ckpt.log" 2>&1
  log "bench/checkpoint rc=$?"
  grep '^|' "$out/bench_ckpt.log" | tee -a "$out/summary.log"
else
  log "skip checkpoint bench: budget"
fi
rm -rf "$tmp"
log "done"
