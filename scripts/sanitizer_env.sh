# scripts/sanitizer_env.sh — sourced by scripts/test.sh (its sanitizer phase) and tests/lib/ctest_cores.sh:
# the ASan/LSan/UBSan settings and the fork agent under which the sanitizer build's tests run. Why each
# setting: scripts/test.sh's header. Expects $root (the repository root).
# intercept_tls_get_addr=0: GCC 12's LeakSanitizer crashes ("Tracer caught signal 11") scanning the
# dynamic TLS of plugins hwloc has already unloaded (seen with singleton MPI runs); without the
# interception that TLS is simply not scanned as a root.
export ASAN_OPTIONS="fast_unwind_on_malloc=0:detect_leaks=1:check_initialization_order=1:intercept_tls_get_addr=0"
export LSAN_OPTIONS="suppressions=$root/scripts/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export OMPI_MCA_orte_fork_agent="$root/tests/lib/asan_rank.sh"
