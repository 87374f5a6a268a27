#!/bin/bash
# scripts/test.sh — the whole test suite, from a fresh machine: install what is missing
# (scripts/setup.sh), build with warnings as errors (CUDA parts too when nvcc is there: they must
# compile and link even without a GPU) and run ctest; then the same under AddressSanitizer and
# UndefinedBehaviorSanitizer. Benchmarks (label `bench`) are not run. Exit status 0 only when both
# builds and every test run pass. README.md's test command; .ci/run calls it.
#
#   scripts/test.sh                       everything
#   DG_TEST_JOBS=4 scripts/test.sh        ctest parallelism (default 2)
#   DG_SKIP_ASAN=1 scripts/test.sh        only the normal build (for a quick local check)
#   DG_SOAK_BUDGET_S=600 scripts/test.sh  the time budget of the soak tests (default 300 s)
#
# The phases (docs/reliability.md, "The test suite itself", gives the measured times):
#   release        build (build/), then ctest -LE 'bench|soak'. Both builds use -DDGT_TEST_HOOKS=ON: the
#                  fault tests need the DG_TEST_* hooks (README.md, "Environment variables")
#   release soak   ctest -L soak: the long runs with random kills of real processes, once, under a
#                  budget: ctest --stop-time ends (and fails) any still running DG_SOAK_BUDGET_S seconds
#                  after the phase starts
#   asan+ubsan     build (build-asan/, no CUDA), then ctest -LE 'bench|soak|nosan': `nosan` tests run
#                  in the release build only, because under the sanitizer they would repeat code a
#                  sibling test already runs there, or check shell logic, file modes or an external
#                  reader; soak tests kill the very processes the sanitizer would check
# ctest starts the costliest tests first (tests/lib/ctest_costs.cmake: one table per build, rewritten from
# a run's measurements by tests/lib/ctest_costs.sh), so -j2 leaves no core idle at the end; a multi-rank
# test that keeps about one core busy is paired with another (PROCESSORS 1: tests/lib/ctest_cores.cmake,
# from the cores each was measured to use alone, tests/lib/ctest_cores.sh).
#
# CI: with CI set (to anything but "", 0, false or no), a test whose real component (Slurm, MPI, HDF5
# tools, dgtrain itself) does not start FAILS instead of skipping (tests/lib/skip.sh); only gpu tests on
# a machine without the GPUs they need still skip. This script says at the start which it is.
#
# Leak checking under ASan: Open MPI keeps memory from MPI_Init until exit by design. Rather than
# turning leak detection off, scripts/lsan.supp suppresses only leaks whose allocation stack passes
# through an Open MPI library (and hwloc's discovery plugins), so leaks in dgtrain's own code are still
# reported. That needs the slower DWARF unwinder (fast_unwind_on_malloc=0): Open MPI is built without
# frame pointers, and the fast unwinder stops before reaching its frames (its MCA plugins are unloaded
# by exit, so the frame right above malloc names no module). It is most of the sanitizer build's cost:
# about 1.3 s per process started (MPI_Init's allocations, the leak check at exit), and every
# allocation after that is unwound the slow way too: a 30-step run saving a checkpoint at every step
# took 16.3 s with it, 4.0 s with the fast unwinder and no leak check (the release build: 2.0 s). A
# shallower malloc_context_size saves nothing measurable (20 frames: the same 8.8 s and 32 s for
# train_e2e_spike_resume and ckpt_damage as 30) and 15 no longer reaches Open MPI's frames (test_comm_mpi
# then reports two leaks), so the default stays. The fast unwinder with Open MPI's plugins kept loaded
# (OMPI_MCA_mca_base_component_disable_dlclose=1) still leaves ~30 unsuppressible stacks per process
# (glibc's vasprintf, hwloc, statically linked code without frame pointers).
# So the slow unwinder and the leak check run on rank 0 of each mpiexec job (and in every process started
# without mpiexec) only: Open MPI starts each rank through tests/lib/asan_rank.sh (its fork agent,
# OMPI_MCA_orte_fork_agent), which gives ranks 1.. the fast unwinder and no leak check, keeping ASan's
# and UBSan's checks on every rank. The ranks run the same code, so rank 0 sees the same allocation
# sites; ckpt_direct (up to 4 ranks) fell from 102 to 54 CPU-s (282 -> 153 s on a loaded machine).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
jobs=${DG_TEST_JOBS:-2}
soak_budget=${DG_SOAK_BUDGET_S:-300}
# Idle OpenMP threads sleep instead of spinning: tests run several ranks and test programs on few cores,
# where spinning threads are ~5x slower. The runtime reads it at start-up, so it is set here.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
status=0
summary=()
t_start=$(date +%s)

source "$root/tests/lib/skip.sh"
if dg_in_ci; then
    echo "=== CI=$CI: a test whose component (Slurm, MPI, HDF5 tools, a GPU that is present) does not start FAILS"
else
    echo "=== CI is not set: a test whose component does not start is SKIPPED (exit 77); CI=true makes it fail"
fi

phase_start=0
phase_begin() { phase_start=$(date +%s); }
phase_took() { echo $(($(date +%s) - phase_start)); }

./scripts/setup.sh || exit 1

build() { # name builddir cmake-args...
    local name=$1 dir=$2
    shift 2
    echo "=== $name: configure and build ($dir)"
    phase_begin
    if ! cmake -S . -B "$dir" -G Ninja -DDGT_WERROR=ON "$@"; then
        summary+=("$name: configure FAILED")
        status=1
        return 1
    fi
    if ! cmake --build "$dir"; then
        summary+=("$name: build FAILED")
        status=1
        return 1
    fi
    summary+=("$name: build $(phase_took) s")
}

run_ctest() { # name builddir ctest-args...
    local name=$1 dir=$2
    shift 2
    echo "=== $name: ctest $*"
    phase_begin
    local log="$dir/ctest-${name//[^a-z]/_}.log"
    ctest --test-dir "$dir" -j "$jobs" --output-on-failure "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]} took line slow
    took=$(phase_took)
    line=$(grep -E "tests passed, [0-9]+ tests failed out of|No tests were found" "$log" | tail -1)
    summary+=("$name: ${line:-no ctest summary} (ctest exit $rc) in $took s")
    # the slowest tests, for the budget (docs/reliability.md) and tests/lib/ctest_costs.cmake
    slow=$(sed -nE 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) .* ([0-9]+\.[0-9]+) sec$/\2 \1/p' "$log" |
        sort -rn | head -n 6 | awk '{ printf "%s%s %.0f s", (NR > 1 ? ", " : ""), $2, $1 }')
    [ -n "$slow" ] && summary+=("    slowest: $slow")
    [ "$rc" -eq 0 ] || status=1
}

if build "release" build -DDGT_CUDA=AUTO -DDGT_TEST_HOOKS=ON; then
    run_ctest "release" build -LE 'bench|soak'
    # a time of day (ctest takes one past midnight as tomorrow's)
    run_ctest "release soak" build -L soak --stop-time "$(date -d "@$(($(date +%s) + soak_budget))" +%H:%M:%S)"
fi

if [ "${DG_SKIP_ASAN:-0}" != 1 ]; then
    source "$root/scripts/sanitizer_env.sh"
    if build "asan+ubsan" build-asan -DDGT_CUDA=OFF -DDGT_SANITIZE=ON -DDGT_TEST_HOOKS=ON; then
        run_ctest "asan+ubsan" build-asan -LE 'bench|soak|nosan'
    fi
    unset ASAN_OPTIONS LSAN_OPTIONS UBSAN_OPTIONS OMPI_MCA_orte_fork_agent
fi

echo "=== summary ($(($(date +%s) - t_start)) s in all; CI=${CI:-<not set>})"
for s in "${summary[@]}"; do echo "$s"; done
[ "$status" -eq 0 ] && echo "ALL PASSED" || echo "FAILED"
exit "$status"
