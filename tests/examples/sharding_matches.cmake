# cmake -DTORCHRUN=... -DEXE=... -P sharding_matches.cmake
# char_gpt trained under each sharding strategy (every part through its group's forward(), one
# micro-batch per step) must end with the same validation loss, printed to 6 digits: the
# strategies change what stays unsharded and when gradients are reduce-scattered, not the
# training (the library tests check the bits; this checks a whole training run end to end).
set(args --steps 40 --batch 8 --d-model 32 --layers 2 --heads 2 --eval-every 0 --warmup 5)
set(launch ${TORCHRUN} --standalone --nnodes=1 --nproc_per_node=2 --no-python ${EXE})

set(losses "")
foreach(strategy optim optim_grads optim_grads_params)
  execute_process(COMMAND ${launch} ${args} --sharding ${strategy}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "char_gpt --sharding ${strategy} failed (${rc}):\n${out}\n${err}")
  endif()
  if(NOT "${out}${err}" MATCHES "sharding ${strategy}\\)")
    message(FATAL_ERROR "char_gpt --sharding ${strategy} did not say it ran under it:\n${out}")
  endif()
  if(NOT out MATCHES "muon: val loss [0-9.]+ -> ([0-9.]+) nats/char")
    message(FATAL_ERROR "char_gpt --sharding ${strategy}: no final validation loss in:\n${out}")
  endif()
  message(STATUS "char_gpt --sharding ${strategy}: final val loss ${CMAKE_MATCH_1}")
  list(APPEND losses ${CMAKE_MATCH_1})
endforeach()
list(GET losses 0 optim)
foreach(loss IN LISTS losses)
  if(NOT loss STREQUAL optim)
    message(FATAL_ERROR "final validation losses differ across strategies (optim, optim_grads, "
                        "optim_grads_params): ${losses}")
  endif()
endforeach()

# A strategy that does not exist is refused, naming the choices.
execute_process(COMMAND ${EXE} --sharding zero3 RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "--sharding: zero3 not in {optim,optim_grads,optim_grads_params}")
  message(FATAL_ERROR "char_gpt --sharding zero3 should fail naming the choices (${rc}):\n${err}")
endif()
message(STATUS "every strategy ends at ${optim}")
