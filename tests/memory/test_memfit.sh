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
# recompute: 8 layers at micro-batch 16 under 110 MB need ~0.22 GiB at recompute=none, ~0.09 GiB at full:
# refused, naming every level's need and the one that fits; the same run with that level trains; --dry-run
# lists the planned arena of every level, shrinking level by level
R=(--set model.n_layer=8 --set train.micro_batch=16 --set train.global_batch=16 --set data.val_every=0
    --set train.steps=2 --set parallel.memory_limit_mb=110)
"$D" --set run.dir="$W/e" "${R[@]}" >"$W/e.out" 2>&1
rc=$?
[ $rc -eq 1 ] || { cat "$W/e.out"; fail "recompute=none under 110 MB: exit $rc, want 1"; }
grep -q "does not fit: 0.11 GiB available .*recompute none; would fit: .*; with train.recompute=gelu [0-9.]* GiB, selective [0-9.]* GiB, full [0-9.]* GiB: train.recompute=full fits" "$W/e.out" \
    || { cat "$W/e.out"; fail "recompute=none under 110 MB: message does not name the recompute level that fits"; }
"$D" --set run.dir="$W/f" "${R[@]}" --set train.recompute=full >"$W/f.out" 2>&1 \
    || { cat "$W/f.out"; fail "recompute=full under 110 MB: did not train"; }
[ "$(grep -c '"event":"step"' "$W/f/metrics.jsonl")" -eq 2 ] || fail "recompute=full under 110 MB: want 2 steps"
"$D" --set run.dir="$W/g" "${R[@]}" --dry-run >"$W/g.out" 2>&1
a=$(grep -o "activation arena by train.recompute (this is none): none [0-9.]* MB, gelu [0-9.]* MB, selective [0-9.]* MB, full [0-9.]* MB" "$W/g.out") \
    || { cat "$W/g.out"; fail "--dry-run: no activation arena per recompute level"; }
echo "$a" | awk '{ if (!($9 > $12 && $12 > $15 && $15 > $18)) exit 1 }' \
    || fail "--dry-run: arena does not shrink none > gelu > selective > full: $a"
echo "PASS"
