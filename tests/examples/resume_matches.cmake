# cmake -DTORCHRUN=... -DEXE=... -DDIR=... -P resume_matches.cmake
# char_gpt stopped at step 20 with a checkpoint and resumed to step 40 must end with the same
# validation loss (printed to 6 digits) as an uninterrupted 40-step run.
set(args --steps 40 --batch 8 --d-model 32 --layers 1 --heads 2 --eval-every 0 --warmup 5)
set(launch ${TORCHRUN} --standalone --nnodes=1 --nproc_per_node=2 --no-python ${EXE})
file(REMOVE_RECURSE ${DIR})

function(run_char_gpt out_var)
  execute_process(COMMAND ${launch} ${args} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "char_gpt ${ARGN} failed (${rc}):\n${out}\n${err}")
  endif()
  if(NOT out MATCHES "muon: val loss [0-9.]+ -> ([0-9.]+) nats/char")
    message(FATAL_ERROR "char_gpt ${ARGN}: no final validation loss in:\n${out}")
  endif()
  set(${out_var} ${CMAKE_MATCH_1} PARENT_SCOPE)
  message(STATUS "char_gpt ${ARGN}: final val loss ${CMAKE_MATCH_1}")
endfunction()

run_char_gpt(straight)
run_char_gpt(first_half --stop-at 20 --checkpoint ${DIR})
run_char_gpt(resumed --resume ${DIR})
if(NOT resumed STREQUAL straight)
  message(FATAL_ERROR "resumed run ended at ${resumed}, uninterrupted run at ${straight}")
endif()
if(NOT first_half GREATER straight)
  message(FATAL_ERROR "the first half (${first_half}) should not already match the full run")
endif()
message(STATUS "resume matches the uninterrupted run: ${resumed}")
