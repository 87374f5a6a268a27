#!/usr/bin/env bash
# run_gpu_multi.sh — the multi-GPU run on a machine with N = 2, 4 or 8 GPUs (NGPU: the largest power of two
# <= the GPUs, at most 8), in one call, within a wall-clock budget: build (unless BUILD_DIR's binaries run
# here), the op harness (add_f32 and the rest on the GPU), gpu_e2e.py nccl (N ranks x 1 GPU with
# parallel.comm=nccl against 1 rank: FSDP, DDP, TP=2 and HSDP 2 x N/2 in fp32 and bf16, graph replay, nccl
# vs mpi, an N-rank checkpoint resumed at N/2 and 1), test_comm_nccl at N ranks, the comm layer's bus
# bandwidth against a raw NCCL communicator (bench_comm --backend nccl; dgvalidate comm checks;
# torch.distributed's NCCL as a further reference), weak scaling of gpt2-124m and gpt2-350m from 1 to N
# GPUs (nccl: dp_shard, dp_replicate, auto, HSDP) and a gpt2-124m checkpoint written by N ranks resumed on
# N/2. Logs go to $OUT; summary.log has one line per phase.
#
#   source .devdeps/setup.sh; OUT=$OUT BUDGET_S=560 bash tests/gpu_train/run_gpu_multi.sh [BUILD_DIR]
#
# BUILD_DIR (default build-gpu) is used as it is when its binaries run here, else built. Environment:
# OUT (default ./gpu-multi-out), BUDGET_S (default 560: phases that would start later are skipped),
# CUDA_ARCH (90), B (gpt2-124m micro-batch per GPU, default 16), STEPS (weak-scaling steps, default 30),
# CTAS (NCCL_MAX_CTAS values for extra mesh=auto runs on N GPUs, default "8"; empty: none), NGPU,
# PHASES (a comma list of harness, e2e, commtest, bench, validate, weak, multirank; default all),
# WEAK_SET (full: the meshes above; rbf16: mesh=auto, FSDP and HSDP with train.reduce_dtype=bf16 against
# fp32 gradient reductions).
set -uo pipefail
t_start=$(date +%s)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bdir=${1:-$root/build-gpu}
out=${OUT:-$PWD/gpu-multi-out}
mkdir -p "$out"
budget=${BUDGET_S:-560}
left() { echo $((budget - ($(date +%s) - t_start))); }
# PHASES: a comma list of harness,e2e,commtest,bench,validate,weak,multirank (default: all of them)
want() { [ -z "${PHASES:-}" ] || [[ ",$PHASES," == *",$1,"* ]]; }
log() { echo "== [$(($(date +%s) - t_start))s] $*" | tee -a "$out/summary.log"; }
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} # NVLink multicast stays off on these hosts
mpi=(mpirun --oversubscribe --allow-run-as-root --bind-to none)
ng_have=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ -z "${NGPU:-}" ]; then
  NGPU=1
  while [ $((NGPU * 2)) -le "$ng_have" ] && [ $((NGPU * 2)) -le 8 ]; do NGPU=$((NGPU * 2)); done
fi
NG=$NGPU
export DGT_NCCL_RANKS=$NG

log "$ng_have GPUs (using $NG): $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1); $(nvcc --version 2>/dev/null | tail -1)"
nvidia-smi topo -m >"$out/topo.txt" 2>&1
usable() { [ -x "$1" ] && ! ldd "$1" 2>/dev/null | grep -q 'not found'; }
bins=(src/cli/dgtrain src/checkpoint_hdf5/dgckpt src/validate/dgvalidate tests/backend_cuda/test_backend_cuda
  bench/comm/bench_comm tests/comm/test_comm_nccl)
ok=1
for b in "${bins[@]}"; do usable "$bdir/$b" || ok=0; done
# carried binaries (built on another machine) must also run a kernel here, else they are rebuilt
if [ $ok = 1 ] && ! timeout 60 "$bdir/tests/backend_cuda/test_backend_cuda" --mode harness --dtype f32 --only add \
  >"$out/carried_smoke.log" 2>&1; then
  log "the binaries in $bdir do not run a kernel here: $(tail -3 "$out/carried_smoke.log" | tr '\n' ' ' | cut -c1-300); building"
  ok=0
fi
if [ $ok = 1 ]; then
  log "using the binaries in $bdir"
else
  t0=$(date +%s)
  bdir=$root/build-gpu
  cmake -S "$root" -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDGT_CUDA=ON -DDGT_WERROR=OFF -DDGT_TEST_HOOKS=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" >"$out/build.log" 2>&1 &&
    cmake --build "$bdir" -j "$(nproc)" --target dgtrain dgckpt dgvalidate test_backend_cuda bench_comm test_comm_nccl >>"$out/build.log" 2>&1
  rc=$?
  log "build rc=$rc in $(($(date +%s) - t0)) s"
  [ $rc -eq 0 ] || { tail -30 "$out/build.log" | tee -a "$out/summary.log"; exit 1; }
fi
dgtrain=$bdir/src/cli/dgtrain dgckpt=$bdir/src/checkpoint_hdf5/dgckpt dgvalidate=$bdir/src/validate/dgvalidate

# ---- the op harness on the GPU (backend contract v1.5: add_f32) ----
want harness && for dt in f32 bf16 f16; do
  timeout 60 "$bdir/tests/backend_cuda/test_backend_cuda" --mode harness --dtype $dt --only add --verbose \
    >"$out/op_harness_$dt.log" 2>&1
  log "op harness ($dt, elementwise case incl. add_f32) rc=$?: $(grep -h 'add_f32' "$out/op_harness_$dt.log" | head -2 | cut -c1-120 | tr '\n' ' ') $(grep -hiE 'fail' "$out/op_harness_$dt.log" | head -3 | tr '\n' ' ')"
done

NB=() # becomes --set parallel.nccl_nonblocking=true when blocking NCCL creation fails below
# ---- N ranks x 1 GPU with NCCL against 1 rank (the correctness test) ----
if want e2e && [ "$(left)" -gt 250 ]; then
  DGT_TEST_KEEP=0 timeout $(($(left) - 150)) python3 "$here/gpu_e2e.py" nccl "$dgtrain" "$dgckpt" "${mpi[@]}" \
    >"$out/gpu_train_nccl.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ] && [ $rc -ne 77 ] && [ ${#NB[@]} = 0 ] &&
    grep -qE 'ncclCommInitRankConfig|ncclCommSplit|ncclCommFinalize|did not finish' "$out/gpu_train_nccl.log"; then
    log "gpu_e2e.py nccl failed in NCCL creation with blocking communicators: the rest runs with parallel.nccl_nonblocking=true"
    tail -25 "$out/gpu_train_nccl.log" >>"$out/summary.log"
    NB=(--set parallel.nccl_nonblocking=true) # the dgvalidate and dgtrain runs below
  fi
  log "gpu_e2e.py nccl rc=$rc: $(grep -E '^(PASS|FAIL|SKIP)' "$out/gpu_train_nccl.log" | cut -c1-1500)"
  [ $rc -eq 0 ] || [ $rc -eq 77 ] || tail -25 "$out/gpu_train_nccl.log" >>"$out/summary.log"
else
  log "skipped gpu_e2e.py nccl (budget)"
fi

# ---- the nccl comm backend's own test at N ranks (collectives, point-to-point batches, failures) ----
if want commtest; then
  timeout 120 "${mpi[@]}" -n $NG "$bdir/tests/comm/test_comm_nccl" >"$out/test_comm_nccl.log" 2>&1
  log "test_comm_nccl ($NG ranks, $NG GPUs) rc=$?: $(tail -2 "$out/test_comm_nccl.log" | tr '\n' ' ' | cut -c1-300)"
fi

# ---- the multi-GPU bandwidth check: dg_comm (nccl) against a raw NCCL communicator in the same run ----
if want bench && [ "$(left)" -gt 240 ]; then
  timeout 150 "${mpi[@]}" -n $NG "$bdir/bench/comm/bench_comm" --backend nccl --seconds 0.5 >"$out/bench_comm_nccl.log" 2>&1
  log "bench_comm --backend nccl ($NG GPUs) rc=$?"
  cat "$out/bench_comm_nccl.log" >>"$out/summary.log"
fi

# ---- bus bandwidth through the comm layer (nccl and mpi), and a raw NCCL reference ----
if want validate && [ "$(left)" -gt 170 ]; then
  timeout 120 "${mpi[@]}" -n $NG "$dgvalidate" "$root/validation/sla.ini" --checks comm --run-dir "$out/validate_comm" "${NB[@]}" \
    --set validate.comm_backends=nccl --set validate.comm_sizes=1M,16M,128M >"$out/comm.log" 2>&1
  log "dgvalidate comm rc=$?: $(grep -E 'comm\.(nccl|mpi)\.(allreduce|allgather|reduce_scatter|broadcast|sendrecv)' "$out/comm.log" | head -10 | cut -c1-160 | tr '\n' '|')"
  if python3 -c "import torch, torch.distributed; assert torch.cuda.device_count() >= $NG" 2>/dev/null &&
    command -v torchrun >/dev/null; then
    cat >"$out/torch_nccl_ref.py" <<'PY'
# raw NCCL all-reduce / all-gather / reduce-scatter bus bandwidth through torch.distributed (the reference)
import os, time, torch, torch.distributed as dist
dist.init_process_group("nccl")
r, n = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(r)
for size in (1 << 20, 16 << 20, 128 << 20):
    x = torch.ones(size // 4, device="cuda")
    outs = {}
    for name in ("allreduce", "allgather", "reduce_scatter"):
        if name == "allreduce":
            f, fac = (lambda: dist.all_reduce(x)), 2 * (n - 1) / n
        elif name == "allgather":
            part = x[: x.numel() // n]
            f, fac = (lambda: dist.all_gather_into_tensor(x, part)), (n - 1) / n
        else:
            part = torch.empty(x.numel() // n, device="cuda")
            f, fac = (lambda: dist.reduce_scatter_tensor(part, x)), (n - 1) / n
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        t0, it = time.perf_counter(), 20
        for _ in range(it):
            f()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / it
        outs[name] = size / dt * fac / 1e9
    if r == 0:
        print("torch-nccl size %d MiB busbw GB/s: %s" % (size >> 20, " ".join("%s %.1f" % kv for kv in outs.items())))
dist.destroy_process_group()
PY
    timeout 100 torchrun --standalone --nproc_per_node $NG "$out/torch_nccl_ref.py" >"$out/torch_nccl_ref.log" 2>&1
    log "torch.distributed NCCL reference rc=$?: $(grep torch-nccl "$out/torch_nccl_ref.log" | tr '\n' '|')"
  else
    log "no PyTorch with $NG GPUs: no raw NCCL reference"
  fi
else
  log "skipped the comm bandwidth (budget)"
fi

# ---- weak scaling of gpt2-124m and gpt2-350m: B x 1024 tokens per GPU on 1, 2, .. N GPUs ----
B=${B:-16}
steps=${STEPS:-30}
work=$out/work
mkdir -p "$work"
if want weak && [ "$(left)" -gt 90 ] && python3 "$root/bench/gpu/make_shards.py" "$work/data" --tokens $(((steps + 2) * NG * B * 1025 + 1)) \
  >"$out/make_shards.log" 2>&1; then
  run124() { # name ranks global_batch [--set ...]
    local name=$1 n=$2 gb=$3
    shift 3
    local rd=$work/$name
    [ "$(left)" -gt 60 ] || { echo "   $name skipped (budget)" | tee -a "$out/summary.log"; return 0; }
    timeout $(($(left) > 30 ? $(left) - 20 : 10)) "${mpi[@]}" -n "$n" "$dgtrain" "$root/configs/gpt2-124m.ini" "${NB[@]}" \
      --set run.dir="$rd" --set data.train="$work/data/bench_train_*.bin" --set data.val="$work/data/bench_val_*.bin" \
      --set data.val_every=0 --set train.steps="$steps" --set train.global_batch="$gb" --set train.micro_batch="$B" \
      --set train.log_every=10 --set parallel.backend=cuda --set checkpoint.async=false \
      --set checkpoint.resume=never "$@" >"$out/w_$name.log" 2>&1
    local rc=$?
    cp "$rd/metrics.jsonl" "$out/w_${name}_metrics.jsonl" 2>/dev/null
    python3 - "$rd/metrics.jsonl" "$name" "$rc" <<'PY' | tee -a "$out/summary.log"
import json, statistics, sys
try:
    ev = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
except OSError:
    ev = []
st = [e for e in ev if e.get("event") == "step"][3:]
start = next((e for e in ev if e.get("event") == "start"), {})
fb = [e.get("reason") for e in ev if e.get("event") == "fallback"]
gr = [e.get("graph") for e in ev if e.get("event") == "cuda_graph"]
tps = statistics.median([e["tok_per_s"] for e in st]) if st else 0
print("   %-24s rc=%s comm=%s mesh=%s median tok/s %.0f step_ms %.1f loss %s graphs %d fallback %s" % (
    sys.argv[2], sys.argv[3], start.get("comm"), start.get("mesh"), tps,
    statistics.median([e["step_ms"] for e in st]) if st else 0, st[-1]["loss"] if st else None, len(gr), fb or "-"))
open(sys.argv[1] + ".tps", "w").write("%f\n" % tps)
PY
  }
  nccl=(--set parallel.comm=nccl --set checkpoint.every=0)
  log "weak scaling bf16, micro-batch $B x 1024 per GPU, $steps steps, 1..$NG GPUs: gpt2-124m, then gpt2-350m"
  # names: g<N>_<mesh>; m350_ for gpt2-350m. The N-GPU dp_shard run writes checkpoints (resumed below).
  run124 g1 1 "$B" --set checkpoint.every=0
  if [ "${WEAK_SET:-full}" = rbf16 ]; then
    # gradient reductions in bf16 (train.reduce_dtype = bf16) against fp32, at 2 .. N GPUs
    rb=(--set train.reduce_dtype=bf16)
    n=2
    while [ $n -le "$NG" ]; do
      run124 g${n}_auto $n $((n * B)) --set parallel.mesh=auto "${nccl[@]}"
      run124 g${n}_auto_rbf16 $n $((n * B)) --set parallel.mesh=auto "${nccl[@]}" "${rb[@]}"
      n=$((n * 2))
    done
    run124 g${NG}_shard_rbf16 $NG $((NG * B)) --set parallel.mesh=dp_shard=$NG "${nccl[@]}" "${rb[@]}"
    [ "$NG" -gt 2 ] && run124 g${NG}_hsdp_rbf16 $NG $((NG * B)) --set parallel.mesh=dp_replicate=2,dp_shard=$((NG / 2)) \
      "${nccl[@]}" "${rb[@]}"
    run124 m350_g1 1 "$B" --set model.preset=gpt2-350m --set checkpoint.every=0
    run124 m350_g${NG}_auto $NG $((NG * B)) --set model.preset=gpt2-350m --set parallel.mesh=auto "${nccl[@]}"
    run124 m350_g${NG}_auto_rbf16 $NG $((NG * B)) --set model.preset=gpt2-350m --set parallel.mesh=auto "${nccl[@]}" \
      "${rb[@]}"
  else
    n=2
    while [ $n -le "$NG" ]; do
      if [ $n -eq "$NG" ]; then
        run124 g${n}_shard $n $((n * B)) --set parallel.mesh=dp_shard=$n --set parallel.comm=nccl --set checkpoint.every=10
      else
        run124 g${n}_shard $n $((n * B)) --set parallel.mesh=dp_shard=$n "${nccl[@]}"
      fi
      run124 g${n}_repl $n $((n * B)) --set parallel.mesh=dp_replicate=$n "${nccl[@]}"
      run124 g${n}_auto $n $((n * B)) --set parallel.mesh=auto "${nccl[@]}"
      [ $n -gt 2 ] && run124 g${n}_hsdp $n $((n * B)) --set parallel.mesh=dp_replicate=2,dp_shard=$((n / 2)) "${nccl[@]}"
      n=$((n * 2))
    done
    # fewer NCCL blocks beside the backward's kernels (NCCL_MAX_CTAS, NCCL >= 2.17): less slowdown of the
    # compute the all-reduces overlap, at a lower all-reduce bandwidth
    for ctas in ${CTAS-8}; do
      NCCL_MAX_CTAS=$ctas run124 g${NG}_auto_ctas$ctas $NG $((NG * B)) --set parallel.mesh=auto "${nccl[@]}"
    done
    run124 g${NG}_repl_accum2 $NG $((2 * NG * B)) --set parallel.mesh=dp_replicate=$NG "${nccl[@]}"
    # the mpi comm (host staging, no graphs) for comparison: MPI_ONE=1
    [ "${MPI_ONE:-0}" = 1 ] && run124 g${NG}_shard_mpi $NG $((NG * B)) --set parallel.mesh=dp_shard=$NG \
      --set parallel.comm=mpi --set checkpoint.every=0
    run124 m350_g1 1 "$B" --set model.preset=gpt2-350m --set checkpoint.every=0
    n=2
    while [ $n -le "$NG" ]; do
      [ $n -eq "$NG" ] && run124 m350_g${n}_shard $n $((n * B)) --set model.preset=gpt2-350m \
        --set parallel.mesh=dp_shard=$n "${nccl[@]}"
      run124 m350_g${n}_auto $n $((n * B)) --set model.preset=gpt2-350m --set parallel.mesh=auto "${nccl[@]}"
      n=$((n * 2))
    done
  fi
  python3 - "$work" <<'PY' | tee -a "$out/summary.log"
import os, re, sys
def t(n):
    try:
        return float(open(os.path.join(sys.argv[1], n, "metrics.jsonl.tps")).read())
    except (OSError, ValueError):
        return 0.0
for model, base in (("gpt2-124m", "g1"), ("gpt2-350m", "m350_g1")):
    g1 = t(base)
    pre = "" if base == "g1" else "m350_"
    runs = sorted((d for d in os.listdir(sys.argv[1]) if re.match(pre + r"g(\d+)_", d) and
                   (pre or not d.startswith("m350_"))), key=lambda d: (int(re.match(pre + r"g(\d+)_", d).group(1)), d))
    for n in runs:
        k = int(re.match(pre + r"g(\d+)_", n).group(1))
        print("   weak-scaling efficiency %-9s %-22s %s" % (model, n, "%.3f (tok/s %.0f vs %d x %.0f)" % (
            t(n) / (k * g1), t(n), k, g1) if g1 and t(n) else "n/a"))
PY
  # ---- a gpt2-124m checkpoint written by N ranks (dp_shard=N, nccl) at step 10, resumed on N/2 ranks ----
  ck=$work/g${NG}_shard/checkpoints/step_00000010.h5
  half=$((NG / 2))
  if [ -f "$ck" ] && [ "$(left)" -gt 40 ]; then
    rd=$work/resume_half
    hm=()
    [ $half -gt 1 ] && hm=(--set parallel.mesh=dp_shard=$half --set parallel.comm=nccl)
    timeout $(($(left) - 10)) "${mpi[@]}" -n $half "$dgtrain" "$root/configs/gpt2-124m.ini" "${NB[@]}" --set run.dir="$rd" \
      --set data.train="$work/data/bench_train_*.bin" --set data.val="$work/data/bench_val_*.bin" --set data.val_every=0 \
      --set train.steps=14 --set train.global_batch=$((NG * B)) --set train.micro_batch="$B" --set parallel.backend=cuda \
      --set checkpoint.every=0 --set checkpoint.async=false --set checkpoint.resume="$ck" "${hm[@]}" >"$out/resume_half.log" 2>&1
    rc=$?
    log "resume of the $NG-rank step-10 checkpoint on $half rank(s) rc=$rc: $(grep -h '"event":"resume"' "$rd/metrics.jsonl" 2>/dev/null | cut -c1-300); steps 11-14 losses $(grep -h '"event":"step"' "$rd/metrics.jsonl" 2>/dev/null | sed 's/.*"loss":\([^,]*\).*/\1/' | tr '\n' ' ') vs $NG ranks $(grep -h '"event":"step"' "$work/g${NG}_shard/metrics.jsonl" 2>/dev/null | sed -n '11,14p' | sed 's/.*"loss":\([^,]*\).*/\1/' | tr '\n' ' ')"
  else
    log "no $NG-rank gpt2-124m checkpoint to resume (or no budget left)"
  fi
else
  log "skipped the weak-scaling runs (budget or make_shards.py failed)"
fi
# ---- docs/cuda.md: 2 and 4 ranks sharing GPU 0 over the mpi comm (gpu_e2e.py multirank) ----
if want multirank && [ "$(left)" -gt 100 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout $(($(left) - 10)) python3 "$here/gpu_e2e.py" multirank "$dgtrain" "$dgckpt" "${mpi[@]}" \
    >"$out/gpu_train_multirank.log" 2>&1
  rc=$?
  log "gpu_e2e.py multirank (GPU 0 shared) rc=$rc: $(grep -E '^(PASS|FAIL|SKIP)' "$out/gpu_train_multirank.log" | cut -c1-600)"
  [ $rc -eq 0 ] || tail -25 "$out/gpu_train_multirank.log" >>"$out/summary.log"
else
  log "skipped gpu_e2e.py multirank (budget)"
fi
log "done in $(($(date +%s) - t_start)) s"
