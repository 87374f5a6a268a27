#!/usr/bin/env bash
# run.sh — checkpoint benchmark: save and load throughput of the gpt2-124m training state (weights + AdamW
# m and v, 1.49 GB) at 1, 2 and 4 ranks, each as a ratio to `dd` writing (conv=fdatasync) and reading
# the same number of bytes on the same file system in the same run, plus the async stall against the
# synchronous save and against an estimate of one training step.
#
# usage: bench/checkpoint/run.sh [BUILD_DIR] [WORK_DIR] [bench_ckpt options...]
#   BUILD_DIR  default: build          WORK_DIR  default: BUILD_DIR/bench-ckpt (the file system measured)
#   options    e.g. --layers 4 for a smaller state on a slow disk; --chunk-mb, --align-kb to tune
# Also prints the save's CPU seconds per GB (all ranks, all threads) and where the fastest save's time went.
# env: RANKS="1 2 4", MPIEXEC, BENCH_DROP_CACHES=1 (root: drop the page cache before every read, so
#      both dd and the load read from the device; without it both read from the page cache)
set -euo pipefail
BUILD=${1:-build}
WORK=${2:-$BUILD/bench-ckpt}
shift $(($# >= 2 ? 2 : $#))
BIN=$BUILD/bench/checkpoint/bench_ckpt
[ -x "$BIN" ] || { echo "run.sh: $BIN not built (cmake --build $BUILD --target bench_ckpt)" >&2; exit 2; }
MPIEXEC=${MPIEXEC:-mpiexec --oversubscribe --allow-run-as-root --bind-to none}
mkdir -p "$WORK"
drop() { if [ -n "${BENCH_DROP_CACHES:-}" ]; then sync; echo 1 >/proc/sys/vm/drop_caches; fi; }
dd_secs() { sed -n 's/.* copied, \([0-9.]*\) s.*/\1/p'; }

printf '| ranks | state GB | save s | save GB/s | dd write GB/s | save/dd | save CPU s/GB | load s | load GB/s | dd read GB/s | load/dd | async stall ms | snapshot GB/s | sync save ms | stall/step |\n'
printf '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n'
phases=
for n in ${RANKS:-1 2 4}; do
    rm -rf "$WORK/ck" "$WORK/dd.bin"
    log=$WORK/bench_np$n.log
    $MPIEXEC -n "$n" "$BIN" --dir "$WORK/ck" "$@" >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
    get() { grep "kind=$1 " "$log" | sed -n "s/.* $2=\([^ ]*\).*/\1/p"; }
    bytes=$(get save bytes | head -1)
    state=$(get setup state_bytes)
    save=$(get save seconds | sort -g | head -1)
    # the fastest rep's CPU time and phase breakdown
    best=$(grep "kind=save " "$log" | sed 's/.* rep=\([0-9]*\) seconds=\([^ ]*\).*/\2 \1/' | sort -g | head -1 | cut -d' ' -f2)
    cpugb=$(grep "kind=save rep=$best " "$log" | sed -n 's/.* cpu_s_per_gb=\([^ ]*\).*/\1/p')
    phases+="| $n | $(grep "kind=phases rep=$best " "$log" | sed 's/.*rep=[0-9]* //; s/ / | /g; s/[a-z_]*=//g') |"$'\n'
    snapgb=$(get async snapshot_gbps | sort -g | tail -1)
    load=$(get load seconds | sort -g | head -1)
    stall=$(get async stall_ms | sort -g | head -1)
    step=$(get setup step_estimate_s)
    # dd of the same byte count (the checkpoint file's size), same file system, right after
    mib=$(((bytes + 1048575) / 1048576))
    ddw=$(dd if=/dev/zero of="$WORK/dd.bin" bs=1M count="$mib" conv=fdatasync 2>&1 | dd_secs)
    drop
    ddr=$(dd if="$WORK/dd.bin" of=/dev/null bs=1M 2>&1 | dd_secs)
    rm -f "$WORK/dd.bin"
    awk -v n="$n" -v st="$state" -v b="$bytes" -v s="$save" -v l="$load" -v w="$ddw" -v r="$ddr" -v a="$stall" -v step="$step" -v cg="$cpugb" -v sg="$snapgb" 'BEGIN {
        ddb = b / 1e9;
        printf "| %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f | %.1f | %.0f | %.3f |\n",
            n, st / 1e9, s, st / s / 1e9, ddb / w, (st / s) / (b / w), cg, l, st / l / 1e9, ddb / r, (st / l) / (b / r),
            a, sg, s * 1000, a / 1000 / step }'
done
rm -rf "$WORK/ck"
echo
echo "Where the fastest save's time went (seconds, slowest rank per phase; threads per rank; write includes"
echo "direct = the chunks ranks checksummed and wrote themselves, direct share = their part of the file,"
echo "fill skipped = the part of the file whose HDF5 creation fill was not written):"
echo "| ranks | validate | hash | threads | plan | create | write | direct | direct share | fill skipped | close | fsync | commit | retention |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
printf '%s' "$phases"
echo
echo "step estimate (lower bound of one gpt2-124m training step on these ranks, 6*N*tokens at the measured sgemm rate): $(grep kind=setup "$WORK"/bench_np*.log | sed 's/.*step_estimate_s=\([^ ]*\).*/\1/' | tr '\n' ' ')s"
echo "logs: $WORK/bench_np*.log"
