#!/bin/bash
# ctest_cores.sh — measures the cores each multi-core test (PROCESSORS > 1 in its CMakeLists) keeps busy,
# and writes tests/lib/ctest_cores_<build>.txt ("name cores wall-s"), which tests/lib/ctest_cores.cmake
# turns into PROCESSORS: ctest -j2 runs a PROCESSORS 2 test alone, so a 4-rank test that mostly waits
# (MPI start-up, one busy rank, a hang it must detect) left a core idle for its whole run. Each test is
# run alone on an otherwise idle machine; cores = (busy CPU time of the whole machine, /proc/stat) / wall
# time. The sanitizer build runs under scripts/sanitizer_env.sh, as scripts/test.sh runs it.
#   tests/lib/ctest_cores.sh release  [BUILD_DIR]    (default build/)
#   tests/lib/ctest_cores.sh sanitize [BUILD_DIR]    (default build-asan/)
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
kind=${1:?usage: ctest_cores.sh release|sanitize [BUILD_DIR]}
case "$kind" in
release) dir=${2:-$root/build} exclude='bench|soak' ;;
sanitize)
    dir=${2:-$root/build-asan} exclude='bench|soak|nosan'
    source "$root/scripts/sanitizer_env.sh"
    ;;
*) echo "ctest_cores.sh: release or sanitize, not '$kind'" >&2; exit 2 ;;
esac
export CI=${CI:-true} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
load=$(cut -d' ' -f1 /proc/loadavg)
awk -v l="$load" 'BEGIN { exit !(l > 0.5) }' && echo "ctest_cores.sh: WARNING: load average $load: the figures need an idle machine" >&2
tests=$(ctest --test-dir "$dir" --show-only=json-v1 -LE "$exclude" | python3 -c '
import json, sys
for t in json.load(sys.stdin)["tests"]:
    p = {q["name"]: q["value"] for q in t.get("properties", [])}
    if p.get("PROCESSORS", 1) > 1: print(t["name"])')
busy() { awk '/^cpu /{ print $2 + $3 + $4 + $7 + $8 }' /proc/stat; }
hz=$(getconf CLK_TCK)
out=$root/tests/lib/ctest_cores_$kind.txt
tmp=$out.tmp
{
    echo "# name cores wall_s — written by tests/lib/ctest_cores.sh $kind on $(date -u +%F) ($(nproc) cores, load $load)"
    for t in $tests; do
        b0=$(busy) s0=$(date +%s.%N)
        ctest --test-dir "$dir" -R "^$t\$" >/dev/null 2>&1 || echo "ctest_cores.sh: $t FAILED (measured anyway)" >&2
        b1=$(busy) s1=$(date +%s.%N)
        awk -v n="$t" -v c=$((b1 - b0)) -v hz="$hz" -v a="$s0" -v b="$s1" 'BEGIN { printf "%s %.2f %.1f\n", n, c / hz / (b - a), b - a }'
    done
} >"$tmp" && mv "$tmp" "$out"
echo "wrote $out ($(($(wc -l <"$out") - 1)) tests)"
