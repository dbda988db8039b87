list(APPEND FSDP_MUON_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/rate_calibration.cpp
  ${CMAKE_CURRENT_LIST_DIR}/exchange_layout.cpp
  ${CMAKE_CURRENT_LIST_DIR}/phase_timer.cpp
  ${CMAKE_CURRENT_LIST_DIR}/fsdp_muon.cpp
  ${CMAKE_CURRENT_LIST_DIR}/fsdp_muon_step.cpp
  ${CMAKE_CURRENT_LIST_DIR}/step_views.cpp
  ${CMAKE_CURRENT_LIST_DIR}/replica_check.cpp)
