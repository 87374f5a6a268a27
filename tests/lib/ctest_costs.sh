#!/bin/bash
# ctest_costs.sh — writes tests/lib/ctest_costs.cmake from ctest's own measurements after a run of each
# phase of scripts/test.sh: build/Testing/Temporary/CTestCostData.txt (release and soak) and
# build-asan/Testing/Temporary/CTestCostData.txt (sanitizer). Tests that took at least 2 s are listed.
#   tests/lib/ctest_costs.sh [RELEASE_BUILD_DIR [ASAN_BUILD_DIR]]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
rel=${1:-$root/build}/Testing/Temporary/CTestCostData.txt
san=${2:-$root/build-asan}/Testing/Temporary/CTestCostData.txt
for f in "$rel" "$san"; do
    [ -r "$f" ] || { echo "ctest_costs.sh: no $f (run that phase's ctest first)" >&2; exit 1; }
done
table() { # lines "name runs cost" up to the "---" that starts the failed-test list; costliest first
    awk '$0 == "---" { exit } NF == 3 && $3 >= 2 { printf "  set_tests_properties(%s PROPERTIES COST %d)\n", $1, $3 + 0.5 }' "$1" |
        sort -t' ' -k6,6nr -k3,3
}
# soak tests that this data lacks (the soak phase was not run) keep their cost from the current table
kept() {
    local t c
    for t in $(ctest --test-dir "$(dirname "$(dirname "$(dirname "$rel")")")" -N -L soak | sed -nE 's/^ *Test +#[0-9]+: //p'); do
        grep -q "^$t " "$rel" && continue
        c=$(sed -nE "s/.*set_tests_properties\($t PROPERTIES COST ([0-9]+)\).*/\1/p" "$out" | tail -n 1)
        [ -n "$c" ] && printf '  set_tests_properties(%s PROPERTIES COST %s)\n' "$t" "$c"
    done
    return 0
}
out=$root/tests/lib/ctest_costs.cmake
soak=$(kept)
{
    cat <<'HEAD'
# ctest_costs.cmake — COST of the long tests, read by ctest (TEST_INCLUDE_FILES of tests/lib, the last
# test directory, so every test exists by then): ctest -j starts the costliest first, so that a long test
# does not start last and leave a core idle. ctest replaces these with its own measurements
# (Testing/Temporary/CTestCostData.txt) after a run; they matter from a clean clone. Seconds measured on
# 2 shared cores, one table per build (DG_COST_SANITIZE: tests/lib/CMakeLists.txt), since the sanitizer
# does not slow every test alike (a checkpoint-heavy test 10x, a Python-heavy one 2x); names that do not
# exist in a build are ignored. Regenerate after a run of each phase: tests/lib/ctest_costs.sh.
if(DG_COST_SANITIZE)
HEAD
    table "$san"
    echo "else()"
    table "$rel"
    [ -n "$soak" ] && printf '%s\n' "$soak"
    echo "endif()"
} >"$out"
echo "wrote $out ($(grep -c COST "$out") entries)"
