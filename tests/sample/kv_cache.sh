#!/bin/bash
# kv_cache.sh — the KV-cache decoder against full recomputation on a really trained checkpoint (issue 22.4):
# dgtrain trains the tiny model 6 steps, then test_kv_cache compares, at every position of a prompt and 64
# greedy tokens, the cache's logits with the training graph's full forward (1e-5), and checks greedy =
# argmax of recompute. With --cuda (label gpu): the CUDA attention_kv_fwd vs the CPU one, and cache vs
# recompute on CUDA in bf16.
# Usage: kv_cache.sh DGTRAIN TEST_KV_CACHE [--cuda] -- MPIEXEC [MPIEXEC FLAGS...]
set -u
DGTRAIN=$1
TESTBIN=$2
shift 2
EXTRA=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do EXTRA+=("$1"); shift; done
shift
MPI=("$@")
DG_TEST_NAME=sample_kv_cache
source "$(dirname "$0")/lib.sh"
[ -x "$DGTRAIN" ] && [ -x "$TESTBIN" ] || dg_skip "dgtrain or test_kv_cache is not built"
WORK=$(mktemp -d /tmp/dgt-sample-kv-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
train_tiny 6
"$TESTBIN" "$CKPT" "${EXTRA[@]}"
