list(APPEND FSDP_MUON_SOURCES ${CMAKE_CURRENT_LIST_DIR} / newton_schulz.cpp)
    list(APPEND FSDP_MUON_CUDA_SOURCES ${CMAKE_CURRENT_LIST_DIR} / newton_schulz_cuda.cpp)
