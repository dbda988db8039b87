list(APPEND FSDP_MUON_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/owner_plan.cpp
  ${CMAKE_CURRENT_LIST_DIR}/exchange_layout.cpp
  ${CMAKE_CURRENT_LIST_DIR}/phase_timer.cpp
  ${CMAKE_CURRENT_LIST_DIR}/fsdp_muon.cpp)
