list(APPEND FSDP_MUON_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/owner_assignment.cpp
  ${CMAKE_CURRENT_LIST_DIR}/round_packing.cpp
  ${CMAKE_CURRENT_LIST_DIR}/owner_plan.cpp
  ${CMAKE_CURRENT_LIST_DIR}/owner_plan_metrics.cpp)
