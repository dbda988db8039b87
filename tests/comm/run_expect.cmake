# Runs a command and checks both its exit code and its output, which CTest alone cannot do
# (PASS_REGULAR_EXPRESSION ignores the exit code, WILL_FAIL ignores the text).
#   cmake -DEXPECT_EXIT=nonzero|zero -DEXPECT_REGEX=<regex> [-DEXPECT_REGEX_ALSO_1=<regex> ...]
#         [-DPYTHON=<python>] [-DSCRATCH=<dir>] -P run_expect.cmake -- <command> <args...>
# In the arguments, @FREE_PORT@ becomes a TCP port that was free a moment ago, @SCRATCH@ an
# emptied directory (removed afterwards), and @SILENT_PORT@ the port of a listener on 127.0.0.1
# that accepts connections and never answers (launch_helper.py silent-listener runs the command).
# The output must match EXPECT_REGEX and every EXPECT_REGEX_ALSO_<i> given (i = 1, 2, ...), in
# any order.
cmake_policy(VERSION 3.25)
set(cmd "")
set(seen_separator FALSE)
foreach(i RANGE 1 ${CMAKE_ARGC})
  if(i EQUAL CMAKE_ARGC)
    break()
  endif()
  if(seen_separator)
    list(APPEND cmd "${CMAKE_ARGV${i}}")
  elseif(CMAKE_ARGV${i} STREQUAL "--")
    set(seen_separator TRUE)
  endif()
endforeach()
if(NOT cmd)
  message(FATAL_ERROR "run_expect.cmake: no command after --")
endif()

string(FIND "${cmd}" "@FREE_PORT@" has_port)
if(NOT has_port EQUAL -1)
  execute_process(COMMAND "${PYTHON}" -c
    "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
    OUTPUT_VARIABLE port OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE port_rc)
  if(NOT port_rc EQUAL 0)
    message(FATAL_ERROR "run_expect.cmake: could not find a free port with ${PYTHON}")
  endif()
  string(REPLACE "@FREE_PORT@" "${port}" cmd "${cmd}")
endif()
string(FIND "${cmd}" "@SILENT_PORT@" has_silent)
if(NOT has_silent EQUAL -1)
  list(PREPEND cmd "${PYTHON}" "${CMAKE_CURRENT_LIST_DIR}/launch_helper.py" silent-listener)
endif()
string(FIND "${cmd}" "@SCRATCH@" has_scratch)
if(NOT has_scratch EQUAL -1)
  file(REMOVE_RECURSE "${SCRATCH}")
  file(MAKE_DIRECTORY "${SCRATCH}")
  string(REPLACE "@SCRATCH@" "${SCRATCH}" cmd "${cmd}")
endif()

execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                TIMEOUT 120)
if(SCRATCH)
  file(REMOVE_RECURSE "${SCRATCH}")
endif()
message("command: ${cmd}\nexit: ${rc}\nstdout:\n${out}\nstderr:\n${err}")
if(EXPECT_EXIT STREQUAL "zero" AND NOT rc STREQUAL "0")
  message(FATAL_ERROR "expected exit code 0, got ${rc}")
elseif(EXPECT_EXIT STREQUAL "nonzero" AND (rc STREQUAL "0" OR NOT rc MATCHES "^[0-9]+$"))
  message(FATAL_ERROR "expected a non-zero exit code, got ${rc}")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT_REGEX}")
  message(FATAL_ERROR "output does not match: ${EXPECT_REGEX}")
endif()
set(i 1)
while(DEFINED EXPECT_REGEX_ALSO_${i})
  if(NOT "${out}${err}" MATCHES "${EXPECT_REGEX_ALSO_${i}}")
    message(FATAL_ERROR "output does not match: ${EXPECT_REGEX_ALSO_${i}}")
  endif()
  math(EXPR i "${i} + 1")
endwhile()
