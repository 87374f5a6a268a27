# comm_driver.cmake — runs an MPI test program for ctest where a plain exit status is not enough.
#   -DMODE=expect_exit  -DCMD=a|b|c -DEXPECT_RC=3 -DEXPECT_REGEX=... -DMAX_SECONDS=N
#       the command must exit with EXPECT_RC within MAX_SECONDS and print a line matching EXPECT_REGEX
#       (the timeout tests: a stalled rank must bring the whole job down with exit 3, promptly).
#   -DMODE=same_digest  -DCMD=a|b|c
#       runs the command twice; both runs must succeed and print the same "DIGEST <hex>" line
#       (bitwise determinism from one run to the next).
# CMD uses '|' between arguments because ctest would split ';'.
string(REPLACE "|" ";" cmd "${CMD}")

function(run_once out_var rc_var secs_var)
  string(TIMESTAMP t0 "%s")
  execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out TIMEOUT 300)
  string(TIMESTAMP t1 "%s")
  math(EXPR secs "${t1} - ${t0}")
  set(${out_var} "${out}" PARENT_SCOPE)
  set(${rc_var} "${rc}" PARENT_SCOPE)
  set(${secs_var} "${secs}" PARENT_SCOPE)
endfunction()

if(MODE STREQUAL "expect_exit")
  run_once(out rc secs)
  message("${out}")
  message(STATUS "exit status ${rc} after about ${secs} s")
  if(NOT rc STREQUAL "${EXPECT_RC}")
    message(FATAL_ERROR "expected exit status ${EXPECT_RC}, got '${rc}'")
  endif()
  if(secs GREATER MAX_SECONDS)
    message(FATAL_ERROR "took ${secs} s, more than ${MAX_SECONDS} s: the abort was not prompt")
  endif()
  if(NOT out MATCHES "${EXPECT_REGEX}")
    message(FATAL_ERROR "output does not match '${EXPECT_REGEX}'")
  endif()
elseif(MODE STREQUAL "same_digest")
  foreach(i 1 2)
    run_once(out rc secs)
    message("${out}")
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "run ${i} failed with status '${rc}'")
    endif()
    if(NOT out MATCHES "DIGEST ([0-9a-f]+)")
      message(FATAL_ERROR "run ${i} printed no DIGEST line")
    endif()
    set(d${i} "${CMAKE_MATCH_1}")
  endforeach()
  if(NOT d1 STREQUAL d2)
    message(FATAL_ERROR "results differ between runs: ${d1} vs ${d2}")
  endif()
  message(STATUS "both runs gave DIGEST ${d1}")
else()
  message(FATAL_ERROR "comm_driver.cmake: unknown MODE '${MODE}'")
endif()
