# Run the op harness with OMP_NUM_THREADS=1 and =2 (backend threads = 0: OpenMP's default) and require
# identical per-case output digests. Invoked by ctest: cmake -DEXE=... -DWORK=... -P omp_env_compare.cmake
foreach(n 1 2)
  set(ENV{OMP_NUM_THREADS} ${n})
  execute_process(COMMAND ${EXE} --no-fd --digests ${WORK}/omp_env_digests_${n}.txt
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "harness failed with OMP_NUM_THREADS=${n} (exit ${rc}):\n${out}${err}")
  endif()
  string(REGEX MATCH "op harness[^\n]*" summary "${out}")
  message(STATUS "OMP_NUM_THREADS=${n}: ${summary}")
endforeach()
file(READ ${WORK}/omp_env_digests_1.txt d1)
file(READ ${WORK}/omp_env_digests_2.txt d2)
if(NOT d1 STREQUAL d2)
  message(FATAL_ERROR "outputs differ between OMP_NUM_THREADS=1 and 2; compare "
                      "${WORK}/omp_env_digests_1.txt and ${WORK}/omp_env_digests_2.txt")
endif()
string(REGEX MATCHALL "\n" lines "${d1}")
list(LENGTH lines nlines)
message(STATUS "OMP_NUM_THREADS=1 and 2: all ${nlines} case digests bit-identical")
