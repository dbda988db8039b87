# cmake -DTORCHRUN=... -DEXE=... -DDIR=... [-DSHARDING=optim_grads_params] -P resume_matches.cmake
# char_gpt stopped at step 20 with a checkpoint and resumed to step 40 must end with the same
# validation loss (printed to 6 digits) as an uninterrupted 40-step run. In between, saves that
# crash at each of their renames (rank files, manifest, `latest`; the library's failure
# injection) must leave that resume working, and so must a first save that crashed after its
# manifest, before any `latest` existed. Resuming from a root and saving into the same root (at
# step 30) is the pattern, and resuming from there ends the same; a --checkpoint that names one
# checkpoint folder is refused before training.
set(args --steps 40 --batch 8 --d-model 32 --layers 1 --heads 2 --eval-every 0 --warmup 5)
if(SHARDING)
  list(APPEND args --sharding ${SHARDING})  # the same under another sharding strategy
endif()
set(launch ${TORCHRUN} --standalone --nnodes=1 --nproc_per_node=2 --no-python ${EXE})
file(REMOVE_RECURSE ${DIR})

function(run_char_gpt out_var)
  execute_process(COMMAND ${launch} ${args} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "char_gpt ${ARGN} failed (${rc}):\n${out}\n${err}")
  endif()
  if(SHARDING AND NOT "${out}${err}" MATCHES "sharding ${SHARDING}\\)")
    message(FATAL_ERROR "char_gpt ${ARGN} did not run under --sharding ${SHARDING}:\n${err}")
  endif()
  if(NOT out MATCHES "muon: val loss [0-9.]+ -> ([0-9.]+) nats/char")
    message(FATAL_ERROR "char_gpt ${ARGN}: no final validation loss in:\n${out}")
  endif()
  set(${out_var} ${CMAKE_MATCH_1} PARENT_SCOPE)
  message(STATUS "char_gpt ${ARGN}: final val loss ${CMAKE_MATCH_1}")
endfunction()

# char_gpt whose save crashes after `files` checkpoint file writes of its process must fail
# saying so.
function(run_char_gpt_crashing files)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env FSDP_MUON_CHECKPOINT_FAIL_AFTER_FILES=${files}
                          ${launch} ${args} ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "injected failure while writing")
    message(FATAL_ERROR "char_gpt ${ARGN} with a save crashing after ${files} file(s) should "
                        "fail with the injected failure (${rc}):\n${out}\n${err}")
  endif()
endfunction()

run_char_gpt(straight)
run_char_gpt(first_half --stop-at 20 --checkpoint ${DIR})
# Rank files (each process' first write), the manifest and `latest` (rank 0's second and third).
foreach(files 0 1 2)
  run_char_gpt_crashing(${files} --resume ${DIR} --stop-at 30 --checkpoint ${DIR})
endforeach()
execute_process(COMMAND ${launch} ${args} --resume ${DIR} --checkpoint ${DIR}/ckpt-000001
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "is one checkpoint folder \\(it holds manifest.pt\\)"
   OR "${out}${err}" MATCHES "val loss")
  message(FATAL_ERROR "char_gpt --checkpoint <a checkpoint folder> should fail before training "
                      "(${rc}):\n${out}\n${err}")
endif()
run_char_gpt(resumed_at_30 --resume ${DIR} --stop-at 30 --checkpoint ${DIR})
run_char_gpt(resumed --resume ${DIR})
if(NOT resumed STREQUAL straight)
  message(FATAL_ERROR "resumed run ended at ${resumed}, uninterrupted run at ${straight}")
endif()
if(NOT first_half GREATER straight)
  message(FATAL_ERROR "the first half (${first_half}) should not already match the full run")
endif()
message(STATUS "resume matches the uninterrupted run: ${resumed}")

# The first save crashes after its manifest: no `latest` yet, but a complete checkpoint.
file(REMOVE_RECURSE ${DIR}_first)
run_char_gpt_crashing(2 --stop-at 20 --checkpoint ${DIR}_first)
run_char_gpt(resumed_first --resume ${DIR}_first)
if(NOT resumed_first STREQUAL straight)
  message(FATAL_ERROR "resumed after a first save that crashed before `latest`: ${resumed_first}, "
                      "uninterrupted run: ${straight}")
endif()
