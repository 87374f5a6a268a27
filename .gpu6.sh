B=$PWD/build-carry; T=$B/tests/backend_cuda/test_backend_cuda
s() { echo "== $*"; }
for dt in bf16 f32; do timeout 90 $T --mode harness --dtype $dt --only crossentropy > $OUT/hce_$dt.log 2>&1; s "harness crossentropy $dt rc=$?: $(tail -1 $OUT/hce_$dt.log)"; grep '^FAIL' $OUT/hce_$dt.log | head -4 | cut -c1-300; done
timeout 60 $T --mode cpu --dtype bf16 --only crossentropy > $OUT/cce.log 2>&1; s "vs cpu crossentropy rc=$?: $(tail -1 $OUT/cce.log)"
DG_CUDA_CE_SMEM=0 timeout 60 $T --mode cpu --dtype bf16 --only crossentropy > $OUT/cce0.log 2>&1; s "vs cpu crossentropy CE_SMEM=0 rc=$?: $(tail -1 $OUT/cce0.log)"
timeout 30 $T --mode errors > $OUT/err.log 2>&1; s "errors rc=$?: $(tail -1 $OUT/err.log)"
timeout 60 $B/tests/backend_cuda/bench_backend_cuda --B 32 --dtype bf16 > $OUT/bbc.log 2>&1; s "bench_backend_cuda rc=$?"; grep -i 'crossentropy' $OUT/bbc.log | head -6
DG_CUDA_CE_SMEM=0 timeout 60 $B/tests/backend_cuda/bench_backend_cuda --B 32 --dtype bf16 > $OUT/bbc0.log 2>&1; s "bench_backend_cuda CE_SMEM=0 rc=$?"; grep -i 'crossentropy' $OUT/bbc0.log | head -6
for m in 0 1; do DG_TEST_UNFUSED_CE=$m timeout 60 $B/bench/gpu/bench_step --B 32 --precision bf16 --steps 5 --warmup 2 > $OUT/bs_ce$m.log 2>&1; s "bench_step UNFUSED_CE=$m rc=$?: $(grep -hE 'api|CUDA Graph replay|ops/step' $OUT/bs_ce$m.log | tr -s ' ' | tr '\n' ' ')"; done
OUT=$OUT/all BUDGET_S=235 bash tests/gpu_train/run_gpu_all.sh $B > $OUT/all.txt 2>&1
grep -v '^   ' $OUT/all/summary.log | cut -c1-600
