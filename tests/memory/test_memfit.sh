#!/bin/bash
# test_memfit.sh DGTRAIN MPIEXEC [MPIFLAGS...] — the trainer's memory-fit check with the real dgtrain:
# parallel.memory_limit_mb below the estimate refuses (exit 1, within seconds, the numbers and a fitting
# setting) on 1 and 2 ranks with the same line on every rank; --dry-run of gpt2-1558m reports does-not-fit
# without allocating; --dry-run --json carries the memory fields.
set -u
D=$1; shift; MPI=("$@")
. "$(dirname "$0")/../lib/skip.sh"
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

start=$SECONDS
"$D" --set run.dir="$W/a" --set train.steps=2 --set parallel.memory_limit_mb=50 >"$W/a.out" 2>&1
rc=$?
[ $rc -eq 1 ] || { cat "$W/a.out"; fail "1 rank: exit $rc, want 1"; }
grep -q "memory: needs .* GiB per rank (state .*does not fit: 0.05 GiB available on rank 0 (parallel.memory_limit_mb=50).*mesh dp_replicate=1,dp_shard=1,tp=1, micro_batch 8.*would fit: train.micro_batch=" "$W/a.out" \
    || { cat "$W/a.out"; fail "1 rank: message lacks the numbers or the fitting setting"; }
[ $((SECONDS - start)) -lt 30 ] || fail "1 rank: refusal took $((SECONDS - start)) s"

"${MPI[@]}" -n 2 "$D" --set run.dir="$W/b" --set train.steps=2 --set parallel.memory_limit_mb=50 >"$W/b.out" 2>&1
rc=$?
[ $rc -eq 1 ] || { cat "$W/b.out"; fail "2 ranks: exit $rc, want 1"; }
lines=$(grep -o "memory: needs.*" "$W/b.out" | sort -u | wc -l)
count=$(grep -c "memory: needs" "$W/b.out")
[ "$count" -ge 1 ] && [ "$lines" -eq 1 ] || { cat "$W/b.out"; fail "2 ranks: want one identical line, got $lines distinct"; }
grep -q "1 other rank: memory: needs .*; mesh dp_replicate=[0-9],dp_shard=[0-9],tp=1, micro_batch 8" "$W/b.out" || { cat "$W/b.out"; fail "2 ranks: mesh not named"; }

start=$SECONDS
"$D" --set run.dir="$W/c" --set model.preset=gpt2-1558m --dry-run >"$W/c.out" 2>&1
grep -q "memory: needs .* does not fit: .* GiB available on rank 0 (\(MemAvailable\|cgroup\) / 1 ranks on the node).*would fit:" "$W/c.out" \
    || { cat "$W/c.out"; fail "dry-run gpt2-1558m: no does-not-fit verdict"; }
[ $((SECONDS - start)) -lt 30 ] || fail "dry-run took $((SECONDS - start)) s"

"$D" --set run.dir="$W/d" --dry-run --json >"$W/d.out" 2>/dev/null
grep -q '"memory":{"fits":true,"estimate_bytes":[0-9]*,"state":' "$W/d.out" || { cat "$W/d.out"; fail "--dry-run --json: no memory fields"; }
echo "PASS"
