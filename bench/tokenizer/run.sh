#!/usr/bin/env bash
# run.sh — GPT-2 tokenizer benchmark: dgprep --tokenizer gpt2 against tiktoken (the test venv's, built
# from the same local ranks file) on the same documents, both measured in this run. Prints MB/s per
# core (input bytes / CPU seconds, so a loaded machine does not flatter or hurt either side), the wall
# time at 1 and N threads, and the ratio; checks that both gave the same ids.
#
# usage: bench/tokenizer/run.sh [DGPREP] [WORK_DIR]
#   DGPREP default build/src/data/dgprep; WORK_DIR default build/bench-tokenizer
# env: BENCH_MB (input size, default 64), BENCH_THREADS (thread counts, default "1 <CPUs available>"),
#      DG_TEST_VENV (default /opt/dgtrain/test-venv), DG_GPT2_TIKTOKEN (the ranks file)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
DGPREP=${1:-build/src/data/dgprep}
WORK=${2:-build/bench-tokenizer}
venv=${DG_TEST_VENV:-/opt/dgtrain/test-venv}
[ -x "$DGPREP" ] || { echo "run.sh: $DGPREP not built" >&2; exit 2; }
[ -x "$venv/bin/python" ] || { echo "run.sh: no test venv at $venv (scripts/setup.sh)" >&2; exit 2; }
mkdir -p "$WORK"
exec "$venv/bin/python" "$here/bench_tokenizer.py" "$DGPREP" "$WORK"
