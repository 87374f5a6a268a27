# bench/gpu/lib.sh — the start the bench/gpu scripts share (sourced; docs/cuda.md, "Benchmark"):
#   bench_start NAME [SUMMARY]  strict mode (set -uo pipefail) and: here (bench/gpu), root (the checkout),
#                               t_start (seconds), out (${OUT:-$PWD/NAME}, created, absolute), py
#                               (${PYTHON:-python3}), mpirun (mpirun, else mpiexec, on PATH), work (a
#                               temporary folder removed at exit), the summary $out/SUMMARY (default
#                               summary.log)
#   log MSG...                  "== [seconds since start] MSG" on stdout and appended to the summary
#   left                        seconds left of ${BUDGET_S} (the caller sets budget=${BUDGET_S:-N})
#   usable BIN                  BIN is executable and ldd finds every library it needs
#   bench_cmake SRC BUILD LOG TARGET...  configure (RelWithDebInfo, CUDA, CUDA_ARCH default 90) and build
#   bench_shards TOKENS LOG     make_shards.py's synthetic shards of TOKENS tokens in $work/data (its
#                               output to LOG); on failure logs it and returns 1
# shellcheck shell=bash
# shellcheck disable=SC2034 # the variables are for the sourcing script

bench_start() {
    set -uo pipefail
    t_start=$(date +%s)
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    root=$(cd "$here/../.." && pwd)
    mkdir -p "${OUT:-$PWD/$1}" || exit 1
    out=$(cd "${OUT:-$PWD/$1}" && pwd)
    summary=$out/${2:-summary.log}
    py=${PYTHON:-python3}
    mpirun=$(command -v mpirun || command -v mpiexec)
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
}
log() { echo "== [$(($(date +%s) - t_start))s] $*" | tee -a "$summary"; }
left() { echo $((budget - ($(date +%s) - t_start))); }
usable() { [ -x "$1" ] && ! ldd "$1" 2>/dev/null | grep -q 'not found'; }
bench_shards() {
    "$py" "$here/make_shards.py" "$work/data" --tokens "$1" >"$2" 2>&1 || {
        log "make_shards.py failed (see $2)"
        return 1
    }
}
# bench_cmake SRC BUILD LOG TARGET...: configures SRC in BUILD (RelWithDebInfo, CUDA on, CUDA_ARCH
# default 90) and builds the targets (JOBS default nproc), output to LOG; the build's status
bench_cmake() {
    local src=$1 b=$2 logf=$3
    shift 3
    cmake -S "$src" -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDGT_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" >"$logf" 2>&1 &&
        cmake --build "$b" -j "${JOBS:-$(nproc)}" --target "$@" >>"$logf" 2>&1
}
