#!/bin/bash
# run.sh — the pipeline benchmark at 2 and 4 ranks: the 1F1B bubble measured against theory for
# m = p, 2p, 4p, 8p micro-batches, and pp = world against dp_replicate = world (ratio), in one run.
#   bench/pipeline/run.sh [BUILD_DIR] [-- extra bench_pp options, e.g. --steps 9 --d-model 256]
# Output to stdout and BUILD_DIR/bench-pp-<N>ranks.txt. One OpenMP thread per rank, passive waiting.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/mpi_ranks.sh"
bench_args "$@"
bench_build "$build" pipeline/bench_pp
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive OMPI_MCA_mpi_yield_when_idle=1
bench_ranks bench_pp "$build/bench-pp" "$build/bench/pipeline/bench_pp" "${args[@]}"
