#!/bin/bash
# device_call.sh — everything a GPU verification needs in ONE device call (<= 600 s): builds an OLD source
# tree (.old/, e.g. `git archive REV | tar -x -C .old`, named in the device tool's carry list with
# .devdeps from ../shared/device/prep-debs.sh) and this tree with CUDA in parallel, runs bench/gpu/ab.sh
# (OLD vs NEW tokens/s within 1%), then this tree's gpu-labelled ctest. Logs under $OUT.
#   device run: [FIRST=REGEX] bash bench/gpu/device_call.sh      carry: [".devdeps", ".old"]
set -u
source .devdeps/setup.sh
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
mkdir -p $OUT/ab
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
# builds in parallel: old dgtrain, new full tree
(cmake -S .old -B .old/build-ab -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDGT_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 >$OUT/b_old.log 2>&1 && cmake --build .old/build-ab -j 6 --target dgtrain >>$OUT/b_old.log 2>&1; echo old_rc=$? >>$OUT/b_old.log) &
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDGT_CUDA=ON -DDGT_TEST_HOOKS=ON -DCMAKE_CUDA_ARCHITECTURES=90 >$OUT/b_new.log 2>&1 && cmake --build build-gpu -j 12 >>$OUT/b_new.log 2>&1; echo new_rc=$?; tail -3 $OUT/b_new.log
wait; tail -2 $OUT/b_old.log; echo "builds done $(el)s"
mkdir -p build-ab/src/cli && ln -sf ../../../build-gpu/src/cli/dgtrain build-ab/src/cli/dgtrain
OUT=$OUT/ab ROUNDS=3 timeout 200 bench/gpu/ab.sh .old . ; echo ab_rc=$? "$(el)s"
# FIRST (a ctest -R regex, e.g. the tests a change added) runs before the rest of the gpu label
cd build-gpu
if [ -n "${FIRST:-}" ]; then
    timeout $(( 570 - $(date +%s) + t0 )) ctest -R "$FIRST" -j 2 --output-on-failure --timeout 240 > $OUT/ctest_first.log 2>&1
    echo first_rc=$?; grep -E "tests passed|Failed|\*\*\*|Passed|PASS" $OUT/ctest_first.log | tail -30
fi
timeout $(( 570 - $(date +%s) + t0 )) ctest -L gpu -E "${FIRST:-^$}" -j 2 --output-on-failure --timeout 240 > $OUT/ctest_gpu.log 2>&1; echo ctest_rc=$?
grep -E "tests passed|Failed|\*\*\*|Passed" $OUT/ctest_gpu.log | tail -40
echo "total $(el)s"
