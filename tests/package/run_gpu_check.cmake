# cmake -DROOT=<repo> -DBUILD_DIR=<build> -DWORK_DIR=<scratch> -P run_gpu_check.cmake
# Packs the gpu-check bundle from BUILD_DIR, runs it on this (GPU-less) machine with OUT set as
# the device tool sets it, and checks the summary (the environment and library stages pass,
# every other stage is skipped with a reason), what lands under OUT (at most the 8 files the
# device tool returns: the summary and the logs' archive), and the libstdc++ fallback's test of
# ldd's output.
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${ROOT}/scripts/gpu-check --prepare --no-build --build-dir ${BUILD_DIR}
                        --bundle ${WORK_DIR}/bundle
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "gpu-check --prepare failed (${rc}):\n${out}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env OUT=${WORK_DIR}/out
                        ${ROOT}/scripts/gpu-check --bundle ${WORK_DIR}/bundle
                        --log-dir ${WORK_DIR}/logs
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message("${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "gpu-check exited ${rc} on a machine without a GPU")
endif()
file(STRINGS ${WORK_DIR}/bundle/stages.tsv stages)
list(LENGTH stages stage_count)
string(REGEX MATCHALL "\n[^ \n]+ +skipped +- +[^\n]*(no GPU|not a CUDA build)" skipped "${out}")
list(LENGTH skipped skipped_count)
if(NOT out MATCHES "\nenvironment +ok" OR NOT out MATCHES "\nlibraries +ok")
  message(FATAL_ERROR "the environment or library stage did not pass")
endif()
if(NOT skipped_count EQUAL stage_count)
  message(FATAL_ERROR "${skipped_count} of ${stage_count} GPU stages were skipped with a reason")
endif()

# What comes back: at most 8 files, no deeper than OUT/a/b/file, the summary and the archive
# among them (nothing failed, so no single logs).
file(GLOB_RECURSE returned LIST_DIRECTORIES false RELATIVE ${WORK_DIR}/out ${WORK_DIR}/out/*)
list(LENGTH returned returned_count)
if(returned_count GREATER 8)
  message(FATAL_ERROR "${returned_count} files under OUT, the device tool returns 8: ${returned}")
endif()
list(SORT returned)
if(NOT returned STREQUAL "gpu-check/logs.tar.gz;gpu-check/summary.txt")
  message(FATAL_ERROR "expected gpu-check/summary.txt and gpu-check/logs.tar.gz under OUT, got: ${returned}")
endif()
file(READ ${WORK_DIR}/out/gpu-check/summary.txt summary)
if(NOT summary MATCHES "\nlibraries +ok")
  message(FATAL_ERROR "OUT/gpu-check/summary.txt is not the summary:\n${summary}")
endif()
execute_process(COMMAND tar -tzf ${WORK_DIR}/out/gpu-check/logs.tar.gz
  RESULT_VARIABLE rc OUTPUT_VARIABLE archived)
if(NOT rc EQUAL 0 OR NOT archived MATCHES "environment[.]log" OR NOT archived MATCHES "ldd-")
  message(FATAL_ERROR "logs.tar.gz lacks the logs (${rc}):\n${archived}")
endif()

# The libstdc++ fallback: ldd's own wording of a libstdc++ too old, and of one that is fine.
file(WRITE ${WORK_DIR}/ldd-old.txt
  "\t/lib/x86_64-linux-gnu/libstdc++.so.6: version `GLIBCXX_3.4.32' not found (required by bin/x)\n"
  "\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n")
file(WRITE ${WORK_DIR}/ldd-abi.txt
  "\t/lib/x86_64-linux-gnu/libstdc++.so.6: version `CXXABI_1.3.15' not found (required by bin/x)\n")
file(WRITE ${WORK_DIR}/ldd-fine.txt
  "\tlibstdc++.so.6 => /lib/x86_64-linux-gnu/libstdc++.so.6 (0x00007f)\n"
  "\tlibtorch.so => not found\n")
foreach(case old:0 abi:0 fine:1)
  string(REPLACE ":" ";" pair ${case})
  list(GET pair 0 name)
  list(GET pair 1 expected)
  execute_process(COMMAND ${ROOT}/scripts/gpu-check --ldd-needs-compat ${WORK_DIR}/ldd-${name}.txt
    RESULT_VARIABLE rc)
  if(NOT rc EQUAL expected)
    message(FATAL_ERROR "gpu-check --ldd-needs-compat on ldd-${name}.txt exited ${rc}, expected ${expected}")
  endif()
endforeach()
