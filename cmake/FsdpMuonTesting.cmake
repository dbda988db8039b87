# Test helpers. Single-process tests are GoogleTest binaries; distributed tests are GoogleTest
# binaries that run either in-process (every rank a thread, worlds of several sizes in one
# process: tests/common/distributed_main.h) or as one rank each under the real launchers
# (torchrun, mpirun).
#
# Naming, for tests/<concern>/ (concern = the src/ folder under test):
#   file        <thing>_test.cpp, thing = what is tested (usually the source file's stem);
#               <thing>_distributed_test.cpp when the same thing also has a single-rank test
#   CTest       <concern>_<thing> for fsdp_muon_add_gtest, the concern written once when the
#               thing starts with it (tests/muon/muon_options_test.cpp -> muon_options,
#               tests/newton_schulz/newton_schulz_test.cpp -> newton_schulz);
#               <concern>_<thing>_in_process for fsdp_muon_add_in_process_test;
#               <concern>_<thing>_<launcher>_w<n> for fsdp_muon_add_distributed_test
#               (NAME <concern>_<thing>)
#   executable  the CTest name for fsdp_muon_add_gtest; <concern>_<thing>_distributed for a
#               distributed test executable
#
# Labels: every test carries `full` (scripts/test runs them all); the single-process and
# in-process tests also carry `quick`, the edit loop's set (scripts/test --quick). PROCESSORS is
# the number of ranks a test runs at once, so `ctest -j` never oversubscribes the cores.

# GoogleTest: Debian's packaged libraries, or a source tree (the GPU machine has no package).
set(FSDP_MUON_GTEST_SOURCE_DIR "" CACHE PATH "Build GoogleTest from this source tree instead")
if(FSDP_MUON_GTEST_SOURCE_DIR)
  set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
  add_subdirectory(${FSDP_MUON_GTEST_SOURCE_DIR} ${PROJECT_BINARY_DIR}/_googletest EXCLUDE_FROM_ALL)
  if(NOT TARGET GTest::gtest_main)  # googletest >= 1.11 defines it itself
    add_library(GTest::gtest_main ALIAS gtest_main)
  endif()
else()
  find_package(GTest REQUIRED)
endif()

# The Python environment that provides LibTorch also provides torchrun and torch.optim.Muon.
set(FSDP_MUON_PYTHON "$ENV{FSDP_MUON_PYTHON}" CACHE FILEPATH "Python with torch (parity tests, torchrun)")
if(NOT FSDP_MUON_PYTHON)
  find_program(FSDP_MUON_PYTHON NAMES python3 python REQUIRED)
endif()
get_filename_component(_fsdp_muon_python_bin "${FSDP_MUON_PYTHON}" DIRECTORY)
find_program(FSDP_MUON_TORCHRUN torchrun HINTS "${_fsdp_muon_python_bin}" NO_DEFAULT_PATH)
find_program(FSDP_MUON_TORCHRUN torchrun)
find_program(FSDP_MUON_MPIRUN NAMES mpirun mpiexec)

# fsdp_muon_add_gtest(NAME <name> SOURCES <src...> [LIBS <lib...>] [LABELS <label...>]
#                     [TIMEOUT <s>] [ENVIRONMENT <k=v...>])
# Builds a GoogleTest executable and registers it as one CTest test.
function(fsdp_muon_add_gtest)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS;ENVIRONMENT" ${ARGN})
  fsdp_muon_add_test_executable(${T_NAME} SOURCES ${T_SOURCES} LIBS ${T_LIBS})
  add_test(NAME ${T_NAME} COMMAND ${T_NAME})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set_tests_properties(${T_NAME} PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "quick;${T_LABELS}"
    ENVIRONMENT "OMP_NUM_THREADS=1;FSDP_MUON_PYTHON=${FSDP_MUON_PYTHON};${T_ENVIRONMENT}")
endfunction()

# The distributed tests' main() and in-process worlds (tests/common/distributed_main.h), and in
# a CUDA build the in-process CUDA world (tests/common/in_process_cuda_communicator.h), compiled
# once for every distributed test executable.
add_library(fsdp_muon_distributed_main OBJECT
            ${PROJECT_SOURCE_DIR}/tests/common/distributed_main.cpp)
if(FSDP_MUON_WITH_CUDA)
  target_sources(fsdp_muon_distributed_main PRIVATE
                 ${PROJECT_SOURCE_DIR}/tests/common/in_process_cuda_communicator.cpp)
endif()
target_link_libraries(fsdp_muon_distributed_main PRIVATE fsdp_muon_internal GTest::gtest)
target_include_directories(fsdp_muon_distributed_main PRIVATE ${PROJECT_SOURCE_DIR}/tests)
target_compile_options(fsdp_muon_distributed_main PRIVATE -Wall -Wextra)
fsdp_muon_test_compile(fsdp_muon_distributed_main)

# fsdp_muon_add_test_executable(<name> SOURCES <src...> [LIBS <lib...>] [DISTRIBUTED])
# DISTRIBUTED: main() is the distributed one (in-process worlds or a launcher's rank).
function(fsdp_muon_add_test_executable name)
  cmake_parse_arguments(T "DISTRIBUTED" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  if(T_DISTRIBUTED)
    target_link_libraries(${name} PRIVATE fsdp_muon_distributed_main fsdp_muon_internal
                                          GTest::gtest ${T_LIBS})
  else()
    target_link_libraries(${name} PRIVATE fsdp_muon_internal GTest::gtest_main ${T_LIBS})
  endif()
  # Internals (src/) come with fsdp_muon_internal, the statically linked library with every
  # symbol reachable; the shared library exports only the public API.
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
  target_compile_options(${name} PRIVATE -Wall -Wextra)
  fsdp_muon_test_compile(${name})
endfunction()

# fsdp_muon_add_in_process_test(NAME <base> TARGET <exe> WORLD_SIZES <n...> [ARGS <arg...>]
#     [TIMEOUT <s>] [LABELS <label...>] [ENVIRONMENT <k=v...>])
# Registers <base>_in_process: the distributed executable with no launcher, playing every rank
# of each world size in turn as threads of one process (--world-sizes).
function(fsdp_muon_add_in_process_test)
  cmake_parse_arguments(T "" "NAME;TARGET;TIMEOUT" "WORLD_SIZES;ARGS;LABELS;ENVIRONMENT" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  list(JOIN T_WORLD_SIZES "," sizes)
  set(largest 1)
  foreach(n IN LISTS T_WORLD_SIZES)
    if(n GREATER largest)
      set(largest ${n})
    endif()
  endforeach()
  set(test_name ${T_NAME}_in_process)
  add_test(NAME ${test_name} COMMAND ${T_TARGET} --world-sizes=${sizes} ${T_ARGS})
  set_tests_properties(${test_name} PROPERTIES TIMEOUT ${T_TIMEOUT} PROCESSORS ${largest}
    LABELS "quick;in_process;${T_LABELS}"
    ENVIRONMENT "OMP_NUM_THREADS=1;FSDP_MUON_PYTHON=${FSDP_MUON_PYTHON};${T_ENVIRONMENT}")
endfunction()

# fsdp_muon_add_distributed_test(NAME <base> TARGET <exe> WORLD_SIZES <n...>
#     [LAUNCHERS torchrun mpirun] [ARGS <arg...>] [TIMEOUT <s>] [LABELS <label...>]
#     [WILL_FAIL] [PASS_REGULAR_EXPRESSION <re>] [ENVIRONMENT <k=v...>])
# Registers <base>_<launcher>_w<n> for each launcher and world size. torchrun runs in
# --standalone mode, which takes free ports from the OS, so parallel CTest runs never collide;
# mpirun gives no address, and the library rendezvouses through a FileStore keyed by the job.
function(fsdp_muon_add_distributed_test)
  cmake_parse_arguments(T "WILL_FAIL" "NAME;TARGET;TIMEOUT;PASS_REGULAR_EXPRESSION"
                        "WORLD_SIZES;LAUNCHERS;ARGS;LABELS;ENVIRONMENT" ${ARGN})
  if(NOT T_LAUNCHERS)
    set(T_LAUNCHERS torchrun mpirun)
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  foreach(launcher IN LISTS T_LAUNCHERS)
    foreach(n IN LISTS T_WORLD_SIZES)
      set(test_name ${T_NAME}_${launcher}_w${n})
      if(launcher STREQUAL "torchrun")
        if(NOT FSDP_MUON_TORCHRUN)
          message(FATAL_ERROR "torchrun not found next to ${FSDP_MUON_PYTHON}")
        endif()
        set(cmd ${FSDP_MUON_TORCHRUN} --standalone --nnodes=1 --nproc_per_node=${n} --no-python
                $<TARGET_FILE:${T_TARGET}> ${T_ARGS})
      elseif(launcher STREQUAL "mpirun")
        if(NOT FSDP_MUON_MPIRUN)
          message(FATAL_ERROR "mpirun not found: install openmpi-bin (scripts/setup does)")
        endif()
        set(cmd ${FSDP_MUON_MPIRUN} --oversubscribe -np ${n} --bind-to none
                $<TARGET_FILE:${T_TARGET}> ${T_ARGS})
      else()
        message(FATAL_ERROR "unknown launcher ${launcher}")
      endif()
      add_test(NAME ${test_name} COMMAND ${cmd})
      set_tests_properties(${test_name} PROPERTIES TIMEOUT ${T_TIMEOUT}
        LABELS "distributed;${launcher};${T_LABELS}" PROCESSORS ${n}
        ENVIRONMENT "OMP_NUM_THREADS=1;OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;OMPI_MCA_rmaps_base_oversubscribe=1;FSDP_MUON_PYTHON=${FSDP_MUON_PYTHON};${T_ENVIRONMENT}")
      if(T_WILL_FAIL)
        set_tests_properties(${test_name} PROPERTIES WILL_FAIL TRUE)
      endif()
      if(T_PASS_REGULAR_EXPRESSION)
        set_tests_properties(${test_name} PROPERTIES PASS_REGULAR_EXPRESSION "${T_PASS_REGULAR_EXPRESSION}")
      endif()
    endforeach()
  endforeach()
endfunction()

# fsdp_muon_label_full(): adds the label `full` to every test of the current directory. Each
# folder that registers tests defers a call to it (CMake 3.25 sets test properties only in the
# directory that added the test): cmake_language(DEFER CALL fsdp_muon_label_full).
function(fsdp_muon_label_full)
  get_property(tests DIRECTORY PROPERTY TESTS)
  foreach(t IN LISTS tests)
    set_property(TEST ${t} APPEND PROPERTY LABELS full)
    # Sanitized code runs several times slower (TSan most): the timeouts, which bound a hang,
    # grow with it so that they still only catch hangs.
    if(FSDP_MUON_SANITIZE)
      get_test_property(${t} TIMEOUT timeout)
      if(NOT timeout)
        set(timeout 1500)  # CTest's default
      endif()
      math(EXPR timeout "${timeout} * 6")
      set_tests_properties(${t} PROPERTIES TIMEOUT ${timeout})
    endif()
  endforeach()
endfunction()
