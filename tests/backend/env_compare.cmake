# Run the op harness twice with one environment variable set two ways and require identical per-case
# output digests. An empty value unsets the variable.
# Invoked by ctest: cmake -DEXE=... -DWORK=... -DVAR=NAME -DVALUE_A=... -DVALUE_B=... -P env_compare.cmake
#   OMP_NUM_THREADS 1 / 2 (backend threads = 0: OpenMP's default): the same bits at any thread count;
#   DG_CPU_NO_AVX512 "" / 1: the AVX-512 kernels (the default where the CPU has them) and the portable
#   ones give the same bits (src/backend/cpu/README.md).
foreach(which A B)
  set(value "${VALUE_${which}}")
  if(value STREQUAL "")
    unset(ENV{${VAR}})
    set(desc "${VAR} unset")
  else()
    set(ENV{${VAR}} "${value}")
    set(desc "${VAR}=${value}")
  endif()
  set(digests_${which} ${WORK}/env_compare_${VAR}_${which}.txt)
  execute_process(COMMAND ${EXE} --no-fd --digests ${digests_${which}}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "harness failed with ${desc} (exit ${rc}):\n${out}${err}")
  endif()
  string(REGEX MATCH "op harness[^\n]*" summary "${out}")
  message(STATUS "${desc}: ${summary}")
  set(desc_${which} "${desc}")
endforeach()
file(READ ${digests_A} d1)
file(READ ${digests_B} d2)
if(NOT d1 STREQUAL d2)
  message(FATAL_ERROR "outputs differ between ${desc_A} and ${desc_B}; compare ${digests_A} and ${digests_B}")
endif()
string(REGEX MATCHALL "\n" lines "${d1}")
list(LENGTH lines nlines)
message(STATUS "${desc_A} and ${desc_B}: all ${nlines} case digests bit-identical")
