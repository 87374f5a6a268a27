#!/bin/bash
# scripts/run-default.sh — README command (1): install what is missing, build, and run the main job on
# the embedded default configuration with 2 MPI ranks. Until the training loop is wired in, the main
# job is the dry run (boot, topology and binding tables, config hash, model and parallel plan).
#
#   scripts/run-default.sh [--set section.key=value ...]     extra arguments go to dgtrain
#   DG_RANKS=4 scripts/run-default.sh                         another rank count (1, 2 or 4 for the default)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
./scripts/setup.sh
cmake -S . -B build -G Ninja
cmake --build build
exec mpirun --allow-run-as-root --oversubscribe -n "${DG_RANKS:-2}" build/src/cli/dgtrain configs/default.ini --dry-run "$@"
