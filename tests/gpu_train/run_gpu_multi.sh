#!/usr/bin/env bash
# run_gpu_multi.sh — NCCL inside the executor (issue 10 prerequisite) on a machine with 2 GPUs, in one
# call, within a wall-clock budget: build (unless BUILD_DIR's binaries run here), the op harness
# (add_f32 and the rest on the GPU), gpu_e2e.py nccl (2 ranks x 1 GPU with parallel.comm=nccl against
# 1 rank: dp_shard=2, dp_replicate=2, tp=2 in fp32 and bf16, graph replay, nccl vs mpi, a 2-rank
# checkpoint resumed at 1 rank), the comm layer's NCCL and MPI bus bandwidth (dgvalidate comm checks;
# torch.distributed's NCCL all-reduce as the reference when PyTorch is there), a weak-scaling run of
# gpt2-124m on 1 and 2 GPUs (nccl, dp_shard=2 and dp_replicate=2; mpi for comparison) and a gpt2-124m
# checkpoint written by 2 ranks resumed on 1. Logs go to $OUT; summary.log has one line per phase.
#
#   source .devdeps/setup.sh; OUT=$OUT BUDGET_S=560 bash tests/gpu_train/run_gpu_multi.sh [BUILD_DIR]
#
# BUILD_DIR (default build-gpu) is used as it is when its binaries run here, else built. Environment:
# OUT (default ./gpu-multi-out), BUDGET_S (default 560: phases that would start later are skipped),
# CUDA_ARCH (90), B (gpt2-124m micro-batch per GPU, default 16), STEPS (weak-scaling steps, default 30),
# CTAS (NCCL_MAX_CTAS values for extra 2-GPU mesh=auto runs, default "8 16"; empty: none).
set -uo pipefail
t_start=$(date +%s)
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bdir=${1:-$root/build-gpu}
out=${OUT:-$PWD/gpu-multi-out}
mkdir -p "$out"
budget=${BUDGET_S:-560}
left() { echo $((budget - ($(date +%s) - t_start))); }
log() { echo "== [$(($(date +%s) - t_start))s] $*" | tee -a "$out/summary.log"; }
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} # NVLink multicast stays off on these hosts
mpi=(mpirun --oversubscribe --allow-run-as-root --bind-to none)

log "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tr '\n' ';'); $(nvcc --version 2>/dev/null | tail -1)"
nvidia-smi topo -m >"$out/topo.txt" 2>&1
usable() { [ -x "$1" ] && ! ldd "$1" 2>/dev/null | grep -q 'not found'; }
bins=(src/cli/dgtrain src/checkpoint_hdf5/dgckpt src/validate/dgvalidate tests/backend_cuda/test_backend_cuda
  bench/comm/bench_comm tests/comm/test_comm_nccl)
ok=1
for b in "${bins[@]}"; do usable "$bdir/$b" || ok=0; done
if [ $ok = 1 ]; then
  log "using the binaries in $bdir"
else
  t0=$(date +%s)
  bdir=$root/build-gpu
  cmake -S "$root" -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDGT_CUDA=ON -DDGT_WERROR=OFF \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" >"$out/build.log" 2>&1 &&
    cmake --build "$bdir" -j "$(nproc)" --target dgtrain dgckpt dgvalidate test_backend_cuda bench_comm test_comm_nccl >>"$out/build.log" 2>&1
  rc=$?
  log "build rc=$rc in $(($(date +%s) - t0)) s"
  [ $rc -eq 0 ] || { tail -30 "$out/build.log" | tee -a "$out/summary.log"; exit 1; }
fi
dgtrain=$bdir/src/cli/dgtrain dgckpt=$bdir/src/checkpoint_hdf5/dgckpt dgvalidate=$bdir/src/validate/dgvalidate

# ---- the op harness on the GPU (backend contract v1.5: add_f32) ----
for dt in f32 bf16 f16; do
  timeout 60 "$bdir/tests/backend_cuda/test_backend_cuda" --mode harness --dtype $dt --only add --verbose \
    >"$out/op_harness_$dt.log" 2>&1
  log "op harness ($dt, elementwise case incl. add_f32) rc=$?: $(grep -h 'add_f32' "$out/op_harness_$dt.log" | head -2 | cut -c1-120 | tr '\n' ' ') $(grep -hiE 'fail' "$out/op_harness_$dt.log" | head -3 | tr '\n' ' ')"
done

# ---- 2 ranks x 1 GPU with NCCL against 1 rank (the correctness test) ----
if [ "$(left)" -gt 200 ]; then
  DGT_TEST_KEEP=0 timeout $(($(left) - 150)) python3 "$here/gpu_e2e.py" nccl "$dgtrain" "$dgckpt" "${mpi[@]}" \
    >"$out/gpu_train_nccl.log" 2>&1
  rc=$?
  log "gpu_e2e.py nccl rc=$rc: $(grep -E '^(PASS|FAIL|SKIP)' "$out/gpu_train_nccl.log" | cut -c1-1500)"
  [ $rc -eq 0 ] || [ $rc -eq 77 ] || tail -25 "$out/gpu_train_nccl.log" >>"$out/summary.log"
else
  log "skipped gpu_e2e.py nccl (budget)"
fi

# ---- the nccl comm backend's own test at 2 ranks (collectives, point-to-point batches, failures) ----
timeout 120 "${mpi[@]}" -n 2 "$bdir/tests/comm/test_comm_nccl" >"$out/test_comm_nccl.log" 2>&1
log "test_comm_nccl (2 ranks, 2 GPUs) rc=$?: $(tail -2 "$out/test_comm_nccl.log" | tr '\n' ' ' | cut -c1-300)"

# ---- issue 10's bandwidth check: dg_comm (nccl) against a raw NCCL communicator in the same run ----
if [ "$(left)" -gt 240 ]; then
  timeout 150 "${mpi[@]}" -n 2 "$bdir/bench/comm/bench_comm" --backend nccl --seconds 0.5 >"$out/bench_comm_nccl.log" 2>&1
  log "bench_comm --backend nccl (2 GPUs) rc=$?"
  cat "$out/bench_comm_nccl.log" >>"$out/summary.log"
fi

# ---- bus bandwidth through the comm layer (nccl and mpi), and a raw NCCL reference ----
if [ "$(left)" -gt 170 ]; then
  timeout 120 "${mpi[@]}" -n 2 "$dgvalidate" "$root/validation/sla.ini" --checks comm --run-dir "$out/validate_comm" \
    --set validate.comm_backends=nccl --set validate.comm_sizes=1M,16M,128M >"$out/comm.log" 2>&1
  log "dgvalidate comm rc=$?: $(grep -E 'comm\.(nccl|mpi)\.(allreduce|allgather|reduce_scatter|broadcast|sendrecv)' "$out/comm.log" | head -10 | cut -c1-160 | tr '\n' '|')"
  if python3 -c 'import torch, torch.distributed; assert torch.cuda.device_count() >= 2' 2>/dev/null &&
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
    timeout 100 torchrun --standalone --nproc_per_node 2 "$out/torch_nccl_ref.py" >"$out/torch_nccl_ref.log" 2>&1
    log "torch.distributed NCCL reference rc=$?: $(grep torch-nccl "$out/torch_nccl_ref.log" | tr '\n' '|')"
  else
    log "no PyTorch with 2 GPUs: no raw NCCL reference"
  fi
else
  log "skipped the comm bandwidth (budget)"
fi

# ---- weak scaling of gpt2-124m: B x 1024 tokens per GPU on 1 and 2 GPUs ----
B=${B:-16}
steps=${STEPS:-30}
work=$out/work
mkdir -p "$work"
if [ "$(left)" -gt 90 ] && python3 "$root/bench/gpu/make_shards.py" "$work/data" --tokens $(((steps + 2) * 2 * B * 1025 + 1)) \
  >"$out/make_shards.log" 2>&1; then
  run124() { # name ranks global_batch [--set ...]
    local name=$1 n=$2 gb=$3
    shift 3
    local rd=$work/$name
    timeout $(($(left) > 30 ? $(left) - 20 : 10)) "${mpi[@]}" -n "$n" "$dgtrain" "$root/configs/gpt2-124m.ini" \
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
print("   %-22s rc=%s comm=%s mesh=%s median tok/s %.0f step_ms %.1f loss %s graphs %d fallback %s" % (
    sys.argv[2], sys.argv[3], start.get("comm"), start.get("mesh"), tps,
    statistics.median([e["step_ms"] for e in st]) if st else 0, st[-1]["loss"] if st else None, len(gr), fb or "-"))
open(sys.argv[1] + ".tps", "w").write("%f\n" % tps)
PY
  }
  log "weak scaling bf16, micro-batch $B x 1024 per GPU, $steps steps: gpt2-124m, then gpt2-350m"
  run124 g1 1 "$B" --set checkpoint.every=0
  [ "$(left)" -gt 60 ] && run124 g2_shard_nccl 2 $((2 * B)) --set parallel.mesh=dp_shard=2 --set parallel.comm=nccl \
    --set checkpoint.every=10
  [ "$(left)" -gt 60 ] && run124 g2_repl_nccl 2 $((2 * B)) --set parallel.mesh=dp_replicate=2 --set parallel.comm=nccl \
    --set checkpoint.every=0
  # the mpi comm (host staging, no graphs) for comparison: MPI_ONE=1
  [ "${MPI_ONE:-0}" = 1 ] && [ "$(left)" -gt 60 ] && run124 g2_shard_mpi 2 $((2 * B)) --set parallel.mesh=dp_shard=2 \
    --set parallel.comm=mpi --set checkpoint.every=0
  [ "$(left)" -gt 60 ] && run124 g2_auto_nccl 2 $((2 * B)) --set parallel.mesh=auto --set parallel.comm=nccl \
    --set checkpoint.every=0
  # fewer NCCL blocks beside the backward's kernels (NCCL_MAX_CTAS, NCCL >= 2.17): less slowdown of the
  # compute the all-reduces overlap, at a lower all-reduce bandwidth; CTAS="8 16" by default
  for ctas in ${CTAS-8 16}; do
    [ "$(left)" -gt 60 ] && NCCL_MAX_CTAS=$ctas run124 g2_auto_nccl_ctas$ctas 2 $((2 * B)) --set parallel.mesh=auto \
      --set parallel.comm=nccl --set checkpoint.every=0
  done
  [ "$(left)" -gt 60 ] && run124 g2_repl_nccl_accum2 2 $((4 * B)) --set parallel.mesh=dp_replicate=2 \
    --set parallel.comm=nccl --set checkpoint.every=0
  [ "$(left)" -gt 60 ] && run124 m350_g1 1 "$B" --set model.preset=gpt2-350m --set checkpoint.every=0
  [ "$(left)" -gt 60 ] && run124 m350_g2_shard_nccl 2 $((2 * B)) --set model.preset=gpt2-350m \
    --set parallel.mesh=dp_shard=2 --set parallel.comm=nccl --set checkpoint.every=0
  [ "$(left)" -gt 60 ] && run124 m350_g2_repl_nccl 2 $((2 * B)) --set model.preset=gpt2-350m \
    --set parallel.mesh=dp_replicate=2 --set parallel.comm=nccl --set checkpoint.every=0
  python3 - "$work" <<'PY' | tee -a "$out/summary.log"
import os, sys
def t(n):
    try:
        return float(open(os.path.join(sys.argv[1], n, "metrics.jsonl.tps")).read())
    except (OSError, ValueError):
        return 0.0
for base, runs in (("g1", ("g2_shard_nccl", "g2_repl_nccl", "g2_auto_nccl", "g2_auto_nccl_ctas8", "g2_auto_nccl_ctas16",
                           "g2_repl_nccl_accum2", "g2_shard_mpi")),
                   ("m350_g1", ("m350_g2_shard_nccl", "m350_g2_repl_nccl"))):
    g1 = t(base)
    for n in runs:
        print("   weak-scaling efficiency %-20s %s" % (n, "%.3f (tok/s %.0f vs 2 x %.0f)" % (t(n) / (2 * g1), t(n), g1) if g1 and t(n) else "n/a"))
PY
  # ---- a gpt2-124m checkpoint written by 2 ranks (dp_shard=2, nccl) at step 10, resumed on 1 rank ----
  ck=$work/g2_shard_nccl/checkpoints/step_00000010.h5
  if [ -f "$ck" ] && [ "$(left)" -gt 40 ]; then
    rd=$work/resume1
    timeout $(($(left) - 10)) "${mpi[@]}" -n 1 "$dgtrain" "$root/configs/gpt2-124m.ini" --set run.dir="$rd" \
      --set data.train="$work/data/bench_train_*.bin" --set data.val="$work/data/bench_val_*.bin" --set data.val_every=0 \
      --set train.steps=14 --set train.global_batch=$((2 * B)) --set train.micro_batch="$B" --set parallel.backend=cuda \
      --set checkpoint.every=0 --set checkpoint.async=false --set checkpoint.resume="$ck" >"$out/resume1.log" 2>&1
    rc=$?
    log "resume of the 2-rank step-10 checkpoint on 1 rank rc=$rc: $(grep -h '"event":"resume"' "$rd/metrics.jsonl" 2>/dev/null | cut -c1-300); steps 11-14 losses $(grep -h '"event":"step"' "$rd/metrics.jsonl" 2>/dev/null | sed 's/.*"loss":\([^,]*\).*/\1/' | tr '\n' ' ') vs 2 ranks $(grep -h '"event":"step"' "$work/g2_shard_nccl/metrics.jsonl" 2>/dev/null | sed -n '11,14p' | sed 's/.*"loss":\([^,]*\).*/\1/' | tr '\n' ' ')"
  else
    log "no 2-rank gpt2-124m checkpoint to resume (or no budget left)"
  fi
else
  log "skipped the weak-scaling runs (budget or make_shards.py failed)"
fi
# ---- issue 7: 2 and 4 ranks sharing GPU 0 over the mpi comm (gpu_e2e.py multirank) ----
if [ "$(left)" -gt 100 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout $(($(left) - 10)) python3 "$here/gpu_e2e.py" multirank "$dgtrain" "$dgckpt" "${mpi[@]}" \
    >"$out/gpu_train_multirank.log" 2>&1
  rc=$?
  log "gpu_e2e.py multirank (GPU 0 shared) rc=$rc: $(grep -E '^(PASS|FAIL|SKIP)' "$out/gpu_train_multirank.log" | cut -c1-600)"
  [ $rc -eq 0 ] || tail -25 "$out/gpu_train_multirank.log" >>"$out/summary.log"
else
  log "skipped gpu_e2e.py multirank (budget)"
fi
log "done in $(($(date +%s) - t_start)) s"
