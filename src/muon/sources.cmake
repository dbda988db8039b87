list(APPEND FSDP_MUON_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/matrix_layout.cpp
  ${CMAKE_CURRENT_LIST_DIR}/muon_options.cpp
  ${CMAKE_CURRENT_LIST_DIR}/muon_math.cpp
  ${CMAKE_CURRENT_LIST_DIR}/update_rule.cpp
  ${CMAKE_CURRENT_LIST_DIR}/muon.cpp)
