# mpi_ranks.sh — sourced by bench/comm/run.sh and bench/fsdp/run.sh: build a benchmark if missing, run it
# at 2 and 4 ranks. Sets `root` (the repository root).
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

# bench_args [BUILD_DIR] [-- OPTIONS...]: a run.sh's arguments: sets `build` (default ROOT/build) and the
# array `args` (the options for the benchmark).
bench_args() {
  build="${1:-$root/build}"
  [ $# -gt 0 ] && shift
  [ "${1:-}" = "--" ] && shift
  args=("$@")
}

# bench_build BUILD_DIR DIR/NAME: build bench/DIR/NAME in BUILD_DIR (configured first if it is not) unless
# it is there already.
bench_build() {
  if [ ! -x "$1/bench/$2" ]; then
    [ -f "$1/CMakeCache.txt" ] || cmake -S "$root" -B "$1" -G Ninja
    cmake --build "$1" --target "${2##*/}"
  fi
}

# bench_ranks NAME OUT_PREFIX COMMAND...: COMMAND under $MPIEXEC (default mpiexec) at 2, then 4 ranks,
# oversubscribed and unbound; each run's output to stdout and to OUT_PREFIX-<N>ranks.txt. Returns the
# last failing run's status (0: all passed); every rank count runs either way.
bench_ranks() {
  local name=$1 out=$2 n status=0
  shift 2
  local mpiexec="${MPIEXEC:-mpiexec}" flags=(--oversubscribe --bind-to none)
  [ "$(id -u)" = 0 ] && flags+=(--allow-run-as-root)
  for n in 2 4; do
    echo "== $name, $n ranks ($(nproc --all) cores, load: $(cut -d' ' -f1-3 /proc/loadavg))"
    "$mpiexec" "${flags[@]}" -n "$n" "$@" | tee "$out-${n}ranks.txt" || status=$?
  done
  return $status
}
