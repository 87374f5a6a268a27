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
. "$(dirname "${BASH_SOURCE[0]}")/../lib/mpi_ranks.sh"
bench_args "$@"
bench_build "$build" fsdp/bench_fsdp
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive OMPI_MCA_mpi_yield_when_idle=1
bench_ranks bench_fsdp "$build/bench-fsdp" "$build/bench/fsdp/bench_fsdp" --json "$build/bench-fsdp.jsonl" "${args[@]}"
