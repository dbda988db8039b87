list(APPEND FSDP_MUON_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/failure_injection.cpp
  ${CMAKE_CURRENT_LIST_DIR}/file_io.cpp
  ${CMAKE_CURRENT_LIST_DIR}/framing.cpp
  ${CMAKE_CURRENT_LIST_DIR}/model_index.cpp
  ${CMAKE_CURRENT_LIST_DIR}/optimizer_state.cpp
  ${CMAKE_CURRENT_LIST_DIR}/metadata.cpp
  ${CMAKE_CURRENT_LIST_DIR}/rank_file.cpp
  ${CMAKE_CURRENT_LIST_DIR}/folder.cpp
  ${CMAKE_CURRENT_LIST_DIR}/compatibility.cpp
  ${CMAKE_CURRENT_LIST_DIR}/load_plan.cpp
  ${CMAKE_CURRENT_LIST_DIR}/staged_restore.cpp
  ${CMAKE_CURRENT_LIST_DIR}/save_load.cpp
  ${CMAKE_CURRENT_LIST_DIR}/full_export.cpp
  ${CMAKE_CURRENT_LIST_DIR}/full_import.cpp)
