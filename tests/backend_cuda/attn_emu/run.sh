#!/bin/sh
# Builds and runs the host emulator of the tensor-core attention kernels (see emu.cpp). Needs g++ >= 12
# (C++20 <barrier>, _Float16). usage: tests/backend_cuda/attn_emu/run.sh [N_SHAPES (1..6, default 6)]
set -e
here=$(cd "$(dirname "$0")" && pwd)
work=${TMPDIR:-/tmp}/dg_attn_emu.$$
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
python3 "$here/extract.py" "$here/../../../src/backend/cuda/attention.cu" "$work/mma_extracted.inc"
${CXX:-g++} -std=c++20 -O1 -pthread -w -I"$work" -o "$work/emu" "$here/emu.cpp"
"$work/emu" "${1:-6}" all
