#!/bin/sh
# cubin_diff.sh — the CUDA backend's device code of a git revision against the work tree's, kernel by
# kernel (cubin_diff.py): proof, without a GPU, that a change of src/backend/cuda left the machine code of
# the kernels it kept unchanged. Compiles each src/backend/cuda/*.cu of both to sm_80 and sm_90 cubins
# with the build's device flags (-O2 -lineinfo --expt-relaxed-constexpr).
#
#   tests/backend_cuda/cubin_diff.sh REV ['REGEX=>REPL' ...]
# REV: a git revision (e.g. main, HEAD~3). The REGEX=>REPL rules map old kernel names to new ones (see
# cubin_diff.py). Environment: NVCC (default /usr/local/cuda/bin/nvcc), ARCHS (default "80 90"), FILES
# (default: every .cu in src/backend/cuda of the work tree). Exit 1 when a kept kernel differs.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
rev=${1:?usage: cubin_diff.sh REV ['REGEX=>REPL' ...]}
shift
nvcc=${NVCC:-/usr/local/cuda/bin/nvcc}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/old" "$work/cub"
git -C "$root" archive "$rev" src | tar -x -C "$work/old"
files=${FILES:-$(cd "$root/src/backend/cuda" && ls *.cu)}
rc=0
for f in $files; do
  for a in ${ARCHS:-80 90}; do
    for side in old new; do
      src=$root
      [ $side = old ] && src=$work/old
      if [ ! -f "$src/src/backend/cuda/$f" ]; then
        continue 2
      fi
      "$nvcc" -DDG_HAVE_CUDA=1 -I"$src/src/backend" -I"$src/src/backend/cuda" -I"$src/src/common" \
        -isystem=/usr/lib/x86_64-linux-gnu/openmpi/include -O2 -DNDEBUG -arch=sm_$a -cubin \
        --expt-relaxed-constexpr -lineinfo -o "$work/cub/$side.$f.sm$a.cubin" "$src/src/backend/cuda/$f"
    done
    echo "== $f sm_$a"
    python3 "$here/cubin_diff.py" "$work/cub/old.$f.sm$a.cubin" "$work/cub/new.$f.sm$a.cubin" "$@" \
      >"$work/out.txt" || rc=1
    grep -E '^(DIFF|NEW)' "$work/out.txt" || true
    tail -1 "$work/out.txt"
  done
done
exit $rc
