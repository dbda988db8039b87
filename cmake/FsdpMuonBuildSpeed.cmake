# What makes our own build fast (docs/DESIGN.md §10, Build speed); none of it reaches an installed
# package or a find_package(FsdpMuon) consumer.
#
# - ccache, when found, caches every compile (FSDP_MUON_CCACHE=OFF turns it off), with paths
#   taken relative to the project (CCACHE_BASEDIR) so that another clone hits the cache. The
#   sloppiness settings are the ones ccache documents for precompiled headers.
# - Precompiled LibTorch headers: one PCH per compile configuration, built once and reused by
#   every target of that configuration. GCC accepts a PCH only where -fPIC / -fPIE and the
#   optimization level match, so there are three: the library's objects (PIC), the benchmarks
#   and examples (PIE, FSDP_MUON_EXECUTABLE_CXX_FLAGS), the tests (PIE,
#   FSDP_MUON_TEST_CXX_FLAGS). FSDP_MUON_PCH=OFF builds without them.
# - The tests compile with FSDP_MUON_TEST_CXX_FLAGS (-O0): test code only builds inputs, calls
#   the library and compares what comes back, so its own optimization buys nothing at run time
#   while -O3 on GoogleTest's macros costs most of a test's compile time. The benchmarks and
#   examples compile with FSDP_MUON_EXECUTABLE_CXX_FLAGS (-O1): their time is spent inside
#   libfsdp_muon and LibTorch, and -O3 made single files take 40 s (gpu_newton_schulz.cpp: 41 s
#   at -O3, 6 s at -O1). The library keeps the build type's flags.
# - A change inside libfsdp_muon.so does not relink the tests and benchmarks that load it
#   (LINK_DEPENDS_NO_SHARED): they bind to it at run time.

option(FSDP_MUON_PCH "Precompile the LibTorch headers for our own targets" ON)
option(FSDP_MUON_CCACHE "Compile through ccache when it is installed" ON)
set(FSDP_MUON_TEST_CXX_FLAGS "-O0" CACHE STRING
    "Flags appended to the tests' compile lines (not the library's)")
set(FSDP_MUON_EXECUTABLE_CXX_FLAGS "-O1" CACHE STRING
    "Flags appended to the benchmarks' and examples' compile lines (not the library's)")
separate_arguments(_fsdp_muon_test_cxx_flags UNIX_COMMAND "${FSDP_MUON_TEST_CXX_FLAGS}")
separate_arguments(_fsdp_muon_executable_cxx_flags UNIX_COMMAND
                   "${FSDP_MUON_EXECUTABLE_CXX_FLAGS}")

if(FSDP_MUON_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  find_program(FSDP_MUON_CCACHE_PROGRAM ccache)
  if(FSDP_MUON_CCACHE_PROGRAM)
    set(CMAKE_CXX_COMPILER_LAUNCHER
        ${CMAKE_COMMAND} -E env
        "CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime"
        "CCACHE_BASEDIR=${PROJECT_SOURCE_DIR}"
        ${FSDP_MUON_CCACHE_PROGRAM})
    message(STATUS "fsdp_muon: compiling through ${FSDP_MUON_CCACHE_PROGRAM}")
  endif()
endif()

set(CMAKE_LINK_DEPENDS_NO_SHARED ON)

set(_fsdp_muon_pch_dir ${CMAKE_CURRENT_LIST_DIR}/pch)
# What the PCHs hold: the LibTorch and standard headers most of src/ includes (sources still
# include what they use; this only saves parsing it again in every translation unit), and for
# the executables LibTorch's C++ frontend, which nearly every one includes.
set(_fsdp_muon_std_headers <algorithm> <chrono> <cstdint> <functional> <map> <memory> <mutex>
    <optional> <sstream> <string> <thread> <unordered_map> <utility> <vector>)
set(FSDP_MUON_LIBRARY_PCH_HEADERS ${_fsdp_muon_std_headers} <ATen/ATen.h>
    <c10/util/Exception.h> <torch/csrc/distributed/c10d/Store.hpp> <torch/nn/module.h>
    <torch/optim/optimizer.h> <torch/serialize.h>)
set(FSDP_MUON_EXECUTABLE_PCH_HEADERS ${_fsdp_muon_std_headers} <ATen/ATen.h>
    <torch/csrc/distributed/c10d/HashStore.hpp> <torch/torch.h>)

# fsdp_muon_use_pch(<target>...): the library's objects (PIC) with their precompiled headers.
function(fsdp_muon_use_pch)
  _fsdp_muon_compile_as(fsdp_muon_pch_pic "" ${ARGN})
endfunction()

# fsdp_muon_executable_compile(<target>...): the benchmarks' and examples' flags and their
# precompiled headers.
function(fsdp_muon_executable_compile)
  _fsdp_muon_compile_as(fsdp_muon_pch_exe "${_fsdp_muon_executable_cxx_flags}" ${ARGN})
endfunction()

# fsdp_muon_test_compile(<target>...): the tests' flags and their precompiled headers.
function(fsdp_muon_test_compile)
  _fsdp_muon_compile_as(fsdp_muon_pch_test "${_fsdp_muon_test_cxx_flags}" ${ARGN})
endfunction()

# Each target after <pch> and <flags>: compiled with <flags> and the PCH of <pch>.
function(_fsdp_muon_compile_as pch flags)
  foreach(target IN LISTS ARGN)
    target_compile_options(${target} PRIVATE ${flags})
    _fsdp_muon_reuse_pch(${target} ${pch} "${flags}")
  endforeach()
endfunction()

# The PCH target <pch> (made on first use: the tests' one once GoogleTest has been found),
# compiled with <flags>, reused by <target>.
function(_fsdp_muon_reuse_pch target pch flags)
  if(NOT FSDP_MUON_PCH)
    return()
  endif()
  if(NOT TARGET ${pch})
    add_library(${pch} OBJECT ${_fsdp_muon_pch_dir}/empty.cpp)
    target_link_libraries(${pch} PRIVATE torch)
    target_compile_features(${pch} PRIVATE cxx_std_17)
    target_compile_options(${pch} PRIVATE ${flags})
    # Headers named in angle brackets: the generated cmake_pch.hxx then holds no path of this
    # checkout, so another clone's PCH is the same bytes and ccache hits through it.
    if(pch STREQUAL "fsdp_muon_pch_pic")
      # The library's objects: position independent, symbols hidden unless FSDP_MUON_API.
      set_target_properties(${pch} PROPERTIES POSITION_INDEPENDENT_CODE ON
                                              CXX_VISIBILITY_PRESET hidden
                                              VISIBILITY_INLINES_HIDDEN ON)
      target_precompile_headers(${pch} PRIVATE ${FSDP_MUON_LIBRARY_PCH_HEADERS})
    elseif(pch STREQUAL "fsdp_muon_pch_test")
      # GoogleTest's definitions (GTEST_HAS_PTHREAD) must match its users': tests only.
      target_link_libraries(${pch} PRIVATE GTest::gtest)
      target_precompile_headers(${pch} PRIVATE ${FSDP_MUON_EXECUTABLE_PCH_HEADERS}
                                               <gtest/gtest.h>)
    else()
      target_precompile_headers(${pch} PRIVATE ${FSDP_MUON_EXECUTABLE_PCH_HEADERS})
    endif()
  endif()
  target_precompile_headers(${target} REUSE_FROM ${pch})
endfunction()
