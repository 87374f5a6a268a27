#!/bin/bash
# run_gpu_suite.sh — on a GPU machine: build the CUDA backend's tests and benchmark, run the gpu-labelled
# backend_cuda tests (compute-sanitizer memcheck/racecheck included) verbosely, the CUDA-vs-CPU
# comparisons with every error figure, and the kernel benchmark against PyTorch; logs go to $OUT
# (default ./gpu-out).
#
#   tests/backend_cuda/run_gpu_suite.sh [CMAKE_SOURCE_DIR]      (default: the repository root)
#
# Environment: JOBS (build parallelism, default nproc), CTEST_JOBS (default 4), BENCH_BS (batch sizes
# to time, default "8 32"), BENCH_T (default 1024), BENCH_TORCH_B (the one PyTorch times, default 32),
# CUDA_ARCH (default 90).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
src=${1:-$root}
out=${OUT:-$root/gpu-out}
mkdir -p "$out"
jobs=${JOBS:-$(nproc)}
bdir=$root/build-gpu
log() { echo "== $*" | tee -a "$out/summary.log"; }

log "$(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
log "nvcc: $(nvcc --version | tail -1); compute-sanitizer: $(compute-sanitizer --version 2>/dev/null | head -1)"
t0=$(date +%s)
cmake -S "$src" -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDGT_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" >"$out/build.log" 2>&1 &&
  cmake --build "$bdir" -j "$jobs" --target test_backend_cuda bench_backend_cuda >>"$out/build.log" 2>&1
rc=$?
log "build rc=$rc in $(($(date +%s) - t0)) s"
[ $rc -eq 0 ] || { tail -40 "$out/build.log"; exit 1; }
exe=$bdir/tests/backend_cuda/test_backend_cuda
bench=$bdir/bench/kernels/bench_backend_cuda

t0=$(date +%s)
(cd "$bdir" && ctest -R '^backend_cuda_' -LE bench -j "${CTEST_JOBS:-4}" --timeout 150 -V) >"$out/ctest.log" 2>&1
log "ctest rc=$? in $(($(date +%s) - t0)) s: $(grep -E 'tests passed|tests failed' "$out/ctest.log")"
grep -E '^ *[0-9]+/[0-9]+ Test' "$out/ctest.log" | tee -a "$out/summary.log"
grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|op harness \[|cuda vs cpu \[|attn-builtin|attn-cudnn|^[0-9]+: determinism \[' "$out/ctest.log" |
  sort | uniq -c | tee -a "$out/summary.log"

# The figures behind the pass/fail: every comparison with its error, per dtype.
t0=$(date +%s)
for dt in f32 bf16 f16; do
  "$exe" --mode cpu --dtype $dt --verbose >>"$out/errors.log" 2>&1
  log "verbose cuda vs cpu [$dt] rc=$?"
done
log "verbose comparisons in $(($(date +%s) - t0)) s"

for B in ${BENCH_BS:-8 32}; do
  "$bench" --B "$B" --T "${BENCH_T:-1024}" --json "$out/bench_b$B.json" >>"$out/bench.log" 2>&1
  log "bench B=$B rc=$?: $(grep 'sum of one step' "$out/bench.log" | tail -1)"
done
grep -E 'attention|layernorm' "$out/bench.log" | tee -a "$out/summary.log"
# layernorm register vs generic kernels, matmul_bwd with and without its bias gradient (the column sums)
"$bench" --mode lnbgrad --B 32 --T "${BENCH_T:-1024}" >"$out/lnbgrad.log" 2>&1
log "lnbgrad rc=$?: $(grep LNBGRAD_SUMMARY "$out/lnbgrad.log")"
PYTHONUNBUFFERED=1 timeout 200 python3 "$here/torch_kernels.py" --ours "$out/bench_b${BENCH_TORCH_B:-32}.json" \
  >>"$out/bench.log" 2>&1
log "torch reference rc=$?"
tail -28 "$out/bench.log"
