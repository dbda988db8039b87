list(APPEND FSDP_MUON_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/failure_injection.cpp
  ${CMAKE_CURRENT_LIST_DIR}/file_io.cpp
  ${CMAKE_CURRENT_LIST_DIR}/model_index.cpp
  ${CMAKE_CURRENT_LIST_DIR}/metadata.cpp
  ${CMAKE_CURRENT_LIST_DIR}/checkpoint.cpp
  ${CMAKE_CURRENT_LIST_DIR}/export.cpp)
