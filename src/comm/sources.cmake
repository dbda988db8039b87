list(APPEND FSDP_MUON_SOURCES ${CMAKE_CURRENT_LIST_DIR}/communicator.cpp)
list(APPEND FSDP_MUON_SOURCES ${CMAKE_CURRENT_LIST_DIR}/agreement.cpp)
list(APPEND FSDP_MUON_GLOO_SOURCES ${CMAKE_CURRENT_LIST_DIR}/gloo_communicator.cpp)
list(APPEND FSDP_MUON_CUDA_SOURCES ${CMAKE_CURRENT_LIST_DIR}/nccl_communicator.cpp)
list(APPEND FSDP_MUON_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/launch_environment.cpp
  ${CMAKE_CURRENT_LIST_DIR}/rendezvous_store.cpp
  ${CMAKE_CURRENT_LIST_DIR}/job_identity.cpp
  ${CMAKE_CURRENT_LIST_DIR}/bootstrap.cpp)
