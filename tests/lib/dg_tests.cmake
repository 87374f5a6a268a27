# dg_tests.cmake — helpers for the tests/<module>/CMakeLists.txt files (included by tests/CMakeLists.txt).
#
# dg_test(NAME <name> COMMAND <arg>... [NEEDS <target>...] [LABELS <label>...] [TIMEOUT <s>]
#         [PROCESSORS <n>] [SKIP_RETURN_CODE <rc>] [ENVIRONMENT <VAR=value>...])
#   add_test(NAME <name> COMMAND <arg>...) and set_tests_properties of each property given. The arguments
#   reach the test as given, empty ones included ("${DG_TEST_DGTRAIN}" where dgtrain is not built). With
#   NEEDS, no test is added unless every target named exists.
function(dg_test)
  cmake_parse_arguments(PARSE_ARGV 0 T "" "NAME;TIMEOUT;PROCESSORS;SKIP_RETURN_CODE"
                        "COMMAND;NEEDS;LABELS;ENVIRONMENT")
  foreach(target IN LISTS T_NEEDS)
    if(NOT TARGET ${target})
      return()
    endif()
  endforeach()
  # an unquoted ${T_COMMAND} would drop the empty arguments: each one goes in as a bracket argument
  set(cmd "")
  foreach(arg IN LISTS T_COMMAND)
    string(APPEND cmd " [==[${arg}]==]")
  endforeach()
  cmake_language(EVAL CODE "add_test(NAME [==[${T_NAME}]==] COMMAND${cmd})")
  foreach(prop LABELS TIMEOUT PROCESSORS SKIP_RETURN_CODE ENVIRONMENT)
    if(DEFINED T_${prop})
      set_tests_properties(${T_NAME} PROPERTIES ${prop} "${T_${prop}}")
    endif()
  endforeach()
endfunction()

# dg_dgtrain_cases(PREFIX SCRIPT HOOKS_ONLY ENTRY...): the table-driven runs of the real dgtrain. One test
#   PREFIX_<name> per ENTRY "name|case|labels" (labels comma-separated):
#     python3 SCRIPT <case> dgtrain dgckpt MPIEXEC MPIFLAGS
#   with those labels, TIMEOUT 300, OMP_NUM_THREADS=1, and PROCESSORS 2 when labelled mpi (several ranks:
#   keeps ctest -j from stacking another job on the same cores). A case matching the regular expression
#   HOOKS_ONLY ("" for none) is left out unless -DDGT_TEST_HOOKS=ON (it needs a test hook).
function(dg_dgtrain_cases prefix script hooks_only)
  foreach(entry ${ARGN})
    string(REPLACE "|" ";" parts "${entry}")
    list(GET parts 0 name)
    list(GET parts 1 case)
    list(GET parts 2 labels)
    if(NOT DGT_TEST_HOOKS AND NOT hooks_only STREQUAL "" AND case MATCHES "${hooks_only}")
      continue()
    endif()
    string(REPLACE "," ";" labels "${labels}")
    set(procs "")
    if("mpi" IN_LIST labels)
      set(procs PROCESSORS 2)
    endif()
    dg_test(NAME ${prefix}_${name}
            COMMAND ${Python3_EXECUTABLE} ${script} ${case} $<TARGET_FILE:dgtrain> $<TARGET_FILE:dgckpt>
                    ${DG_TEST_MPIEXEC} ${DG_TEST_MPIFLAGS}
            LABELS ${labels} TIMEOUT 300 ENVIRONMENT OMP_NUM_THREADS=1 ${procs})
  endforeach()
endfunction()
