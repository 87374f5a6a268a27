#!/bin/bash
# run.sh — the comm benchmark at 2 and 4 ranks: dg_comm (mpi backend) against raw MPI in the same run.
#   bench/comm/run.sh [BUILD_DIR] [-- extra bench_comm options, e.g. --min-calls 15 --dtype bf16]
# BUILD_DIR defaults to ./build (configured with the top-level CMakeLists.txt); bench_comm is built if
# missing. Tables go to stdout and to BUILD_DIR/bench-comm-<N>ranks.txt. Oversubscribed runs (more
# ranks than cores) measure scheduling as much as the network: read the ratio columns, which compare
# both sides in the same run, rather than the absolute numbers.
# The nccl backend against raw NCCL (a CUDA build, one GPU per rank; 4 ranks need 4 GPUs):
#   bench/comm/run.sh build-cuda -- --backend nccl
# or: mpiexec -n 2 build-cuda/bench/comm/bench_comm --backend nccl (ctest: comm_bench_nccl_np2).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/mpi_ranks.sh"
bench_args "$@"
bench_build "$build" comm/bench_comm
bench_ranks bench_comm "$build/bench-comm" "$build/bench/comm/bench_comm" "${args[@]}"
