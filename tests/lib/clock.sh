# tests/lib/clock.sh — the shell tests' wall clock (sourced): tests/slurm/lib.sh and tests/health/run_case.sh.
#   now            seconds since the epoch, with nanoseconds
#   elapsed T0     seconds since T0 (a `now`), one decimal
#   le A B         true when the number A <= B
# shellcheck shell=bash
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
le() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a <= b) }'; }
