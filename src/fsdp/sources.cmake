list(APPEND FSDP_MUON_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/backward_hooks.cpp
  ${CMAKE_CURRENT_LIST_DIR}/clip_grad_norm.cpp
  ${CMAKE_CURRENT_LIST_DIR}/flat_layout.cpp
  ${CMAKE_CURRENT_LIST_DIR}/group_agreement.cpp
  ${CMAKE_CURRENT_LIST_DIR}/group_storage.cpp
  ${CMAKE_CURRENT_LIST_DIR}/parameter_group.cpp
  ${CMAKE_CURRENT_LIST_DIR}/qk_clip.cpp
  ${CMAKE_CURRENT_LIST_DIR}/sharded_parameter_registry.cpp
  ${CMAKE_CURRENT_LIST_DIR}/shard_module.cpp
  ${CMAKE_CURRENT_LIST_DIR}/sharded_model.cpp
  ${CMAKE_CURRENT_LIST_DIR}/sharding_schedule.cpp
  ${CMAKE_CURRENT_LIST_DIR}/sharding_state_machine.cpp
  ${CMAKE_CURRENT_LIST_DIR}/sharding_strategy.cpp
  ${CMAKE_CURRENT_LIST_DIR}/storage_bytes.cpp)
