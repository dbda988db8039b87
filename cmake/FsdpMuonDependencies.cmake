# CUDA, cuBLAS and NCCL are switched on by what LibTorch provides: a CUDA build of LibTorch
# defines the torch_cuda target, and then the GPU paths are compiled and linked (even on a
# machine without a GPU, so a broken GPU path is a broken build).
if(TARGET torch_cuda)
  set(FSDP_MUON_WITH_CUDA ON)
else()
  set(FSDP_MUON_WITH_CUDA OFF)
endif()

# Where LibTorch lives: .../site-packages/torch/share/cmake/Torch for the PyPI wheel.
get_filename_component(FSDP_MUON_TORCH_ROOT "${Torch_DIR}/../../.." ABSOLUTE)
set(FSDP_MUON_TORCH_LIB_DIR "${FSDP_MUON_TORCH_ROOT}/lib")
get_filename_component(_fsdp_muon_site_packages "${FSDP_MUON_TORCH_ROOT}/.." ABSOLUTE)

if(FSDP_MUON_WITH_CUDA)
  find_package(CUDAToolkit REQUIRED)
  # The NCCL we link must be the one torch loads (one libnccl.so.2 per process): prefer the
  # nvidia-nccl wheel that sits beside torch, then the system's.
  find_path(NCCL_INCLUDE_DIR nccl.h
    HINTS "${_fsdp_muon_site_packages}/nvidia/nccl/include" ENV NCCL_HOME
    PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY NAMES libnccl.so.2 nccl NAMES_PER_DIR
    HINTS "${_fsdp_muon_site_packages}/nvidia/nccl/lib" ENV NCCL_HOME
    PATH_SUFFIXES lib lib64)
  if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
    message(FATAL_ERROR "LibTorch has CUDA but NCCL was not found: install the nvidia-nccl wheel "
                        "torch depends on, or set NCCL_HOME")
  endif()
  get_filename_component(FSDP_MUON_NCCL_LIB_DIR "${NCCL_LIBRARY}" DIRECTORY)
  message(STATUS "fsdp_muon: CUDA on (CUDA ${CUDAToolkit_VERSION}), NCCL ${NCCL_LIBRARY}")
else()
  message(STATUS "fsdp_muon: LibTorch has no CUDA; building the CPU paths only")
endif()

if(FSDP_MUON_WITH_GLOO)
  # The torch wheel ships c10d's ProcessGroupGloo.hpp but not the gloo headers it includes;
  # Debian's libgloo-dev provides them (only declarations are used; code comes from torch).
  find_path(GLOO_INCLUDE_DIR gloo/context.h HINTS ENV GLOO_HOME PATH_SUFFIXES include)
  if(NOT GLOO_INCLUDE_DIR)
    message(FATAL_ERROR "gloo headers not found (gloo/context.h): install libgloo-dev "
                        "(scripts/setup does) or configure with -DFSDP_MUON_WITH_GLOO=OFF")
  endif()
endif()
