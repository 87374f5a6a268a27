# ctest_cores.cmake — PROCESSORS from measurement, read by ctest after ctest_costs.cmake (TEST_INCLUDE_FILES
# of tests/lib). A test's CMakeLists claims PROCESSORS for its ranks; under ctest -j2 such a test runs
# alone, and most multi-rank tests keep only about one core busy (MPI start-up, rank 0's slow sanitizer
# unwinder while the other ranks wait, a hang they must detect). tests/lib/ctest_cores.sh measures each
# one alone on an idle machine (busy CPU time / wall time) into ctest_cores_<build>.txt; a test measured
# below 1.5 cores gets PROCESSORS 1 (two such tests side by side ask for at most 3
# cores of 2: slower each, sooner both), so ctest pairs it with another test. Kept as their CMakeLists say:
# tests that judge a deadline in wall time with more than one rank at work (a watchdog, a stall or slow
# storage, an SLA timing objective), where a neighbour's load could move the verdict.
# Tests missing from a table (new ones) keep their CMakeLists' PROCESSORS until the next measurement.
set(_dg_cores_keep ckpt_storage_sigstop ckpt_storage_stall ckpt_storage_slow train_sla_slow train_sla_requeue
                   fsdp_timeout pipeline_timeout mpi_boot_agree_timeout_n4)
if(DG_COST_SANITIZE)
  set(_dg_cores_file ${CMAKE_CURRENT_LIST_DIR}/ctest_cores_sanitize.txt)
else()
  set(_dg_cores_file ${CMAKE_CURRENT_LIST_DIR}/ctest_cores_release.txt)
endif()
if(EXISTS ${_dg_cores_file})
  file(STRINGS ${_dg_cores_file} _dg_cores_lines REGEX "^[A-Za-z0-9_]+ [0-9.]+ ")
  foreach(_l IN LISTS _dg_cores_lines)
    string(REPLACE " " ";" _f "${_l}")
    list(GET _f 0 _name)
    list(GET _f 1 _cores)
    list(FIND _dg_cores_keep ${_name} _keep) # (no IN_LIST: ctest reads this file without policy CMP0057)
    if(_keep EQUAL -1 AND _cores LESS 1.5)
      set_tests_properties(${_name} PROPERTIES PROCESSORS 1)
    endif()
  endforeach()
endif()
