#!/bin/sh
# tests/lib/asan_rank.sh — Open MPI's fork agent in scripts/test.sh's sanitizer phase
# (OMPI_MCA_orte_fork_agent): mpiexec starts every rank as `asan_rank.sh PROGRAM ARGS...`, and this execs
# the program (same pid) with leak checking left to rank 0. Ranks other than 0 keep AddressSanitizer and
# UndefinedBehaviorSanitizer but take the fast frame-pointer unwinder and no leak check at exit: the slow
# DWARF unwinder that the Open MPI leak suppressions need (scripts/test.sh's header) costs ~3x on every
# allocation. Ranks run the same code (SPMD), so rank 0's leak check at exit sees the same allocation
# sites; processes started without mpiexec (singletons, the tools) are not touched.
case "${OMPI_COMM_WORLD_RANK:-0}" in
0) ;;
*)
    ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}fast_unwind_on_malloc=1:detect_leaks=0"
    export ASAN_OPTIONS
    ;;
esac
exec "$@"
