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
  # The toolkit compiles our CUDA code against its headers; torch runs on the CUDA of its wheel.
  # A toolkit of another major version would compile against an ABI torch does not load.
  # torch.version.cuda, read from the wheel's torch/version.py (no Python needed).
  set(FSDP_MUON_TORCH_CUDA_VERSION "")
  if(EXISTS "${FSDP_MUON_TORCH_ROOT}/version.py")
    file(STRINGS "${FSDP_MUON_TORCH_ROOT}/version.py" _fsdp_muon_torch_cuda REGEX "^cuda")
    string(REGEX MATCH "[0-9]+[.][0-9]+" FSDP_MUON_TORCH_CUDA_VERSION "${_fsdp_muon_torch_cuda}")
  endif()
  if(FSDP_MUON_TORCH_CUDA_VERSION)
    string(REGEX MATCH "^[0-9]+" _fsdp_muon_torch_cuda_major "${FSDP_MUON_TORCH_CUDA_VERSION}")
    if(NOT _fsdp_muon_torch_cuda_major STREQUAL CUDAToolkit_VERSION_MAJOR)
      message(FATAL_ERROR "fsdp_muon: the CUDA toolkit found (${CUDAToolkit_VERSION} at "
        "${CUDAToolkit_BIN_DIR}) is CUDA ${CUDAToolkit_VERSION_MAJOR}, but torch was built with "
        "CUDA ${FSDP_MUON_TORCH_CUDA_VERSION}. Point CMake at a CUDA "
        "${_fsdp_muon_torch_cuda_major}.x toolkit (-DCUDAToolkit_ROOT=/usr/local/cuda-"
        "${_fsdp_muon_torch_cuda_major}.x, or nvcc of that version first on PATH), or install the "
        "torch wheel built for CUDA ${CUDAToolkit_VERSION_MAJOR}")
    endif()
  else()
    message(STATUS "fsdp_muon: no torch/version.py beside LibTorch: the toolkit's CUDA major is "
                   "not checked against torch's")
  endif()
  # cudart and cuBLAS: the copies torch loads (the nvidia wheels beside it) before the
  # toolkit's, so one process never mixes two builds of a library. CUDA 13 wheels put every
  # library in nvidia/cu<major>/lib; CUDA 12 wheels one package per library.
  set(_fsdp_muon_wheel_cuda_dirs
    "${_fsdp_muon_site_packages}/nvidia/cu${CUDAToolkit_VERSION_MAJOR}/lib"
    "${_fsdp_muon_site_packages}/nvidia/cuda_runtime/lib"
    "${_fsdp_muon_site_packages}/nvidia/cublas/lib")
  find_library(FSDP_MUON_CUDART_LIBRARY NAMES libcudart.so.${CUDAToolkit_VERSION_MAJOR} cudart
    NAMES_PER_DIR HINTS ${_fsdp_muon_wheel_cuda_dirs} ${CUDAToolkit_LIBRARY_DIR} NO_DEFAULT_PATH)
  find_library(FSDP_MUON_CUBLAS_LIBRARY NAMES libcublas.so.${CUDAToolkit_VERSION_MAJOR} cublas
    NAMES_PER_DIR HINTS ${_fsdp_muon_wheel_cuda_dirs} ${CUDAToolkit_LIBRARY_DIR} NO_DEFAULT_PATH)
  if(NOT FSDP_MUON_CUDART_LIBRARY OR NOT FSDP_MUON_CUBLAS_LIBRARY)
    message(FATAL_ERROR "fsdp_muon: cudart or cuBLAS not found beside torch "
                        "(${_fsdp_muon_wheel_cuda_dirs}) nor in ${CUDAToolkit_LIBRARY_DIR}")
  endif()
  # LibTorch's config links every consumer with the toolkit's cudart (torch::cudart); point it
  # at the copy torch loads, so the link line names one cudart and the search path is one order.
  if(TARGET torch::cudart)
    set_property(TARGET torch::cudart PROPERTY INTERFACE_LINK_LIBRARIES
                 "${FSDP_MUON_CUDART_LIBRARY}")
  endif()
  get_filename_component(FSDP_MUON_CUDA_LIB_DIR "${FSDP_MUON_CUBLAS_LIBRARY}" DIRECTORY)
  get_filename_component(_fsdp_muon_cudart_dir "${FSDP_MUON_CUDART_LIBRARY}" DIRECTORY)
  list(APPEND FSDP_MUON_CUDA_LIB_DIR "${_fsdp_muon_cudart_dir}")
  list(REMOVE_DUPLICATES FSDP_MUON_CUDA_LIB_DIR)
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
  message(STATUS "fsdp_muon: CUDA on (CUDA ${CUDAToolkit_VERSION}), cuBLAS "
                 "${FSDP_MUON_CUBLAS_LIBRARY}, cudart ${FSDP_MUON_CUDART_LIBRARY}, NCCL ${NCCL_LIBRARY}")
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

# CRC-32 of checkpoint files (checkpoint/file_io.cpp): zlib's, linked privately into the shared
# library, so consumers need nothing of it.
find_package(ZLIB REQUIRED)
