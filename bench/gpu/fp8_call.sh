#!/bin/bash
# fp8_call.sh — the FP8 verification in ONE device call (docs/cuda.md "FP8"): builds dgtrain, dgprep and the
# FP8 test and benchmark with CUDA, runs tests/backend_cuda/test_fp8 (quantization and GEMMs against host
# references), bench/gpu/bench_fp8 (GEMMs, fp8 vs bf16), COMPARE=fp8 bench/gpu/sizes.sh (whole training
# steps, fp8 vs bf16, at SIZES), then bench/gpu/fp8_quality.sh (real text, STEPS steps each) with the
# time left. Logs under $OUT.   device run: bash bench/gpu/fp8_call.sh     carry: [".devdeps"]
set -u
source .devdeps/setup.sh
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDGT_CUDA=ON -DDGT_TEST_HOOKS=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 >$OUT/build.log 2>&1 &&
  cmake --build build-gpu -j 16 --target dgtrain dgprep test_fp8 bench_fp8 >>$OUT/build.log 2>&1
echo "build rc=$? $(el)s"; grep -E "error|PCRE" $OUT/build.log | head -5
timeout 120 build-gpu/tests/backend_cuda/test_fp8 >$OUT/test_fp8.log 2>&1; echo "test_fp8 rc=$? $(el)s"
grep -E "FAIL|checks" $OUT/test_fp8.log | head -30
timeout 120 build-gpu/bench/gpu/bench_fp8 >$OUT/bench_fp8.log 2>&1; echo "bench_fp8 rc=$? $(el)s"; grep BENCH $OUT/bench_fp8.log
OUT=$OUT/sizes COMPARE=fp8 STEPS=${SIZE_STEPS:-14} SIZES="${SIZES:-gpt2-124m:32 gpt2-774m:16}" timeout 200 bench/gpu/sizes.sh build-gpu 2>&1 | grep -E "SIZE|rc=" ; echo "sizes $(el)s"
left=$(( 585 - $(el) ))
# about 60 s of start-up and text preparation, then two runs at ~60 ms a step
steps=$(( (left - 70) * 1000 / 130 )); [ $steps -gt ${STEPS:-2000} ] && steps=${STEPS:-2000}
echo "quality: $left s left, $steps steps each"
if [ $steps -ge 200 ]; then
  OUT=$OUT/quality STEPS=$steps VAL_EVERY=$(( steps / 10 )) VOCAB=.devdeps/gpt2.tiktoken timeout $(( left - 5 )) \
    bench/gpu/fp8_quality.sh build-gpu 2>&1 | grep -vE "^VAL" | tail -12
  grep -E "^VAL" $OUT/quality/*.log 2>/dev/null | head -0
fi
echo "total $(el)s"
