#!/bin/bash
# one device call: build, comm_nccl_np1, time-to-first-step breakdown, bench_step
set -u
source .devdeps/setup.sh
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDGT_CUDA=ON -DDGT_TEST_HOOKS=ON -DCMAKE_CUDA_ARCHITECTURES=90 >$OUT/b.log 2>&1 && cmake --build build-gpu -j 16 >>$OUT/b.log 2>&1; echo build_rc=$? "$(el)s"; tail -3 $OUT/b.log
(cd build-gpu && NCCL_DEBUG=${NCCL_DEBUG:-WARN} ctest -R 'comm_nccl_np1' --output-on-failure --timeout 120 > $OUT/nccl.log 2>&1; echo nccl_rc=$?; grep -E 'NCCL WARN|CHECK failed' $OUT/nccl.log | sort | uniq -c | sort -rn | head -12)
work=$(mktemp -d)
python3 bench/gpu/make_shards.py $work/data --tokens $((6*32*1025+1)) >/dev/null 2>&1
export DG_CUDA_GEMM_TUNE_FILE=$work/tune.txt
for run in cold warm; do
  t_launch=$(date +%s.%N)
  mpirun --allow-run-as-root --bind-to none -n 1 build-gpu/src/cli/dgtrain configs/gpt2-124m.ini \
    --set run.dir=$work/r_$run --set data.train="$work/data/bench_train_*.bin" --set data.val="$work/data/bench_val_*.bin" \
    --set data.val_every=0 --set train.steps=4 --set train.global_batch=32 --set train.micro_batch=32 \
    --set train.precision=bf16 --set train.log_every=1 --set parallel.backend=cuda --set checkpoint.every=0 \
    --set checkpoint.async=false --set checkpoint.resume=never --set run.log_level=debug 2>&1 | \
    perl -MTime::HiRes=time -ne "printf('%7.3f %s', time() - $t_launch, \$_)" > $OUT/ttfs_$run.log
  echo "== $run"; grep -E "setup:|model build|step [0-9]|dgtrain 0|attention|peak|training" $OUT/ttfs_$run.log | cut -c1-200 | head -40
done
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 200 > $OUT/clocks.csv 2>&1 &
smi=$!
cd build-gpu && timeout 120 bench/gpu/bench_step --preset gpt2-124m --B 32 --precision bf16 --steps 30 --warmup 3 > $OUT/bench_step.log 2>&1; tail -30 $OUT/bench_step.log
kill $smi; sort -t, -k2 -n $OUT/clocks.csv | awk -F, 'NR>1{print $2,$4,$6}' | uniq -c | sort -rn | head -8
echo "total $(el)s"
