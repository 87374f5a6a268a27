# Run the op harness with the AVX-512 kernels (the default where the CPU has them) and with the portable
# ones (DG_CPU_NO_AVX512=1), and require identical per-case output digests: the CPU backend's own
# kernels are written so that both give the same bits (src/backend/cpu/README.md).
# Invoked by ctest: cmake -DEXE=... -DWORK=... -P isa_compare.cmake
foreach(mode default portable)
  if(mode STREQUAL "portable")
    set(ENV{DG_CPU_NO_AVX512} 1)
  else()
    unset(ENV{DG_CPU_NO_AVX512})
  endif()
  execute_process(COMMAND ${EXE} --no-fd --digests ${WORK}/isa_digests_${mode}.txt
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "harness failed with the ${mode} kernels (exit ${rc}):\n${out}${err}")
  endif()
  string(REGEX MATCH "op harness[^\n]*" summary "${out}")
  message(STATUS "${mode} kernels: ${summary}")
endforeach()
file(READ ${WORK}/isa_digests_default.txt d1)
file(READ ${WORK}/isa_digests_portable.txt d2)
if(NOT d1 STREQUAL d2)
  message(FATAL_ERROR "outputs differ between the AVX-512 and the portable kernels; compare "
                      "${WORK}/isa_digests_default.txt and ${WORK}/isa_digests_portable.txt")
endif()
string(REGEX MATCHALL "\n" lines "${d1}")
list(LENGTH lines nlines)
message(STATUS "default and portable kernels: all ${nlines} case digests bit-identical")
