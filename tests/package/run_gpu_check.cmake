# cmake -DROOT=<repo> -DBUILD_DIR=<build> -DWORK_DIR=<scratch> -P run_gpu_check.cmake
# Packs the gpu-check bundle from BUILD_DIR, runs it on this (GPU-less) machine, and checks the
# summary: the environment and library stages pass, every other stage is skipped with a reason.
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${ROOT}/scripts/gpu-check --prepare --no-build --build-dir ${BUILD_DIR}
                        --bundle ${WORK_DIR}/bundle
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "gpu-check --prepare failed (${rc}):\n${out}")
endif()
execute_process(COMMAND ${ROOT}/scripts/gpu-check --bundle ${WORK_DIR}/bundle
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
