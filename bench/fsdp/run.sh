#!/bin/bash
# run.sh — the FSDP benchmark at 2 and 4 ranks: step time with overlap on and off against a compute-only
# reference measured in the same run, and the exposed communication per step.
#   bench/fsdp/run.sh [BUILD_DIR] [-- extra bench_fsdp options, e.g. --steps 15 --profile 1]
# BUILD_DIR defaults to ./build; bench_fsdp is built if missing. Tables go to stdout and to
# BUILD_DIR/bench-fsdp-<N>ranks.txt, JSON lines to BUILD_DIR/bench-fsdp.jsonl. One OpenMP thread per
# rank, passive waiting, and Open MPI yielding while idle (each rank also runs a comm thread inside
# blocking MPI calls, which otherwise busy-polls a core). On a shared or oversubscribed machine read the
# ratio columns and the least-exposed rank rather than absolute times.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="${1:-$root/build}"
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
if [ ! -x "$build/bench/fsdp/bench_fsdp" ]; then
  [ -f "$build/CMakeCache.txt" ] || cmake -S "$root" -B "$build" -G Ninja
  cmake --build "$build" --target bench_fsdp
fi
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive OMPI_MCA_mpi_yield_when_idle=1
mpiexec="${MPIEXEC:-mpiexec}"
flags=(--oversubscribe --bind-to none)
[ "$(id -u)" = 0 ] && flags+=(--allow-run-as-root)
status=0
for n in 2 4; do
  echo "== bench_fsdp, $n ranks ($(nproc --all) cores, load: $(cut -d' ' -f1-3 /proc/loadavg))"
  "$mpiexec" "${flags[@]}" -n "$n" "$build/bench/fsdp/bench_fsdp" --json "$build/bench-fsdp.jsonl" "$@" |
    tee "$build/bench-fsdp-${n}ranks.txt" || status=$?
done
exit $status
