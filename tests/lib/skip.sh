# tests/lib/skip.sh — the skip policy of the shell tests, in one place (sourced; docs/reliability.md,
# "The test suite itself").
#
# A test that cannot bring up a real component it needs (a Slurm cluster, a tool, a GPU, dgtrain itself)
# reports that through dg_skip instead of deciding on its own:
#   - outside CI it says SKIP with the reason and exits 77 (ctest's SKIP_RETURN_CODE);
#   - under CI (CI set to anything but "", 0, false or no) it says FAIL with the same reason and exits 1:
#     on a CI machine every dependency is installed by scripts/setup.sh, so a component that does not
#     start is a broken bring-up, and a skip would hide it.
# The one exception: a test that needs GPUs on a machine that has fewer (dg_skip --gpus N REASON) skips in
# CI too. "Has" means GPUs the NVIDIA driver lists (/proc/driver/nvidia/gpus, /dev/nvidiaN), so a GPU
# that is there but will not initialise still fails in CI.
# shellcheck shell=bash

# dg_in_ci: true when the CI environment variable says so
dg_in_ci() {
    case "${CI:-}" in
    '' | 0 | false | FALSE | False | no | NO) return 1 ;;
    *) return 0 ;;
    esac
}

# dg_gpus_present: how many NVIDIA GPUs this machine has (whether or not CUDA can use them), limited by
# CUDA_VISIBLE_DEVICES when it is set
dg_gpus_present() {
    local n=0 d vis
    if [ -d /proc/driver/nvidia/gpus ]; then
        for d in /proc/driver/nvidia/gpus/*; do [ -e "$d" ] && n=$((n + 1)); done
    fi
    if [ "$n" = 0 ]; then
        for d in /dev/nvidia[0-9]*; do [ -e "$d" ] && n=$((n + 1)); done
    fi
    if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
        vis=$(printf '%s' "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -cvE '^[[:space:]]*(-[0-9]+)?[[:space:]]*$')
        [ "$vis" -lt "$n" ] && n=$vis
    fi
    echo "$n"
}

# dg_skip [--gpus N] REASON...: exit 77 (SKIP) outside CI, exit 1 (FAIL) under CI; with --gpus N, a
# machine with fewer than N GPUs skips in CI too. The line names the test when DG_TEST_NAME is set.
dg_skip() {
    local need=0 who=${DG_TEST_NAME:+ [$DG_TEST_NAME]}
    if [ "${1:-}" = --gpus ]; then
        need=$2
        shift 2
    fi
    if ! dg_in_ci; then
        echo "SKIP$who: $*"
        exit 77
    fi
    if [ "$need" -gt 0 ] && [ "$(dg_gpus_present)" -lt "$need" ]; then
        echo "SKIP$who: $* (CI=$CI, but this machine has fewer than $need GPU(s))"
        exit 77
    fi
    echo "FAIL$who: $* (CI=$CI: a component that does not start fails the test instead of skipping it; see docs/reliability.md)"
    exit 1
}
