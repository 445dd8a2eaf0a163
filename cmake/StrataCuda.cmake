# Decides whether the CUDA backend is built (STRATA_CUDA=AUTO|ON|OFF) and sets
# STRATA_HAVE_CUDA. AUTO builds it where it can run: nvcc found and an NVIDIA GPU
# present. ON builds it wherever nvcc is, GPU or not (CI and scripts/gpu-bundle
# do, to compile the CUDA path on machines without one); OFF never. Compiling
# the kernels for a machine without a GPU was about a fifth of a fresh build's
# CPU time on 2 cores, for code that cannot run there (bench/PERFORMANCE.md,
# "Build time"). CUDA sources compile for the GPUs present (AUTO) or for sm_80
# and sm_90 (ON), unless CMAKE_CUDA_ARCHITECTURES says otherwise, and link
# cuBLAS and NCCL.

# strata_nvidia_gpus(OUT_VAR): the compute capabilities of the NVIDIA GPUs this
# machine has, as CMake architectures ("90;90"), "unknown" for a GPU whose
# capability nvidia-smi cannot say, or empty for none. A GPU is present when
# the driver shows one: a device node /dev/nvidia<N>, /proc/driver/nvidia/gpus,
# or `nvidia-smi -L` (also where neither exists, e.g. under WSL).
function(strata_nvidia_gpus out_var)
  file(GLOB device_nodes /dev/nvidia[0-9]*)
  file(GLOB driver_gpus /proc/driver/nvidia/gpus/*)
  find_program(STRATA_NVIDIA_SMI nvidia-smi)
  set(listed "")
  if(STRATA_NVIDIA_SMI)
    execute_process(COMMAND ${STRATA_NVIDIA_SMI} -L OUTPUT_VARIABLE listed
                    RESULT_VARIABLE rc ERROR_QUIET TIMEOUT 30)
    if(NOT rc EQUAL 0 OR NOT listed MATCHES "GPU [0-9]")
      set(listed "")
    endif()
  endif()
  if(NOT device_nodes AND NOT driver_gpus AND NOT listed)
    set(${out_var} "" PARENT_SCOPE)
    return()
  endif()
  set(archs "")
  if(STRATA_NVIDIA_SMI)
    execute_process(COMMAND ${STRATA_NVIDIA_SMI} --query-gpu=compute_cap --format=csv,noheader
                    OUTPUT_VARIABLE caps RESULT_VARIABLE rc ERROR_QUIET TIMEOUT 30)
    if(rc EQUAL 0)
      string(REGEX MATCHALL "[0-9]+\\.[0-9]+" caps "${caps}")
      foreach(cap IN LISTS caps)
        string(REPLACE "." "" arch "${cap}")
        list(APPEND archs ${arch})
      endforeach()
    endif()
  endif()
  if(NOT archs)
    set(archs unknown)
  endif()
  set(${out_var} "${archs}" PARENT_SCOPE)
endfunction()

set(STRATA_HAVE_CUDA OFF)
if(NOT STRATA_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "STRATA_CUDA must be AUTO, ON or OFF (got '${STRATA_CUDA}')")
endif()
set(strata_cuda_off_reason "STRATA_CUDA=OFF")
if(NOT STRATA_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  set(strata_gpu_archs "")
  if(STRATA_CUDA STREQUAL "AUTO")
    strata_nvidia_gpus(strata_gpu_archs)
  endif()
  if(NOT CMAKE_CUDA_COMPILER)
    set(strata_cuda_off_reason "nvcc not found (looked in /usr/local/cuda/bin)")
    if(STRATA_CUDA STREQUAL "ON")
      message(FATAL_ERROR "STRATA_CUDA=ON but nvcc was not found (looked in /usr/local/cuda/bin)")
    endif()
  elseif(STRATA_CUDA STREQUAL "AUTO" AND NOT strata_gpu_archs)
    set(strata_cuda_off_reason "nvcc found but no NVIDIA GPU here; STRATA_CUDA=ON builds it anyway")
  else()
    # CMake's CUDAARCHS environment variable, like -DCMAKE_CUDA_ARCHITECTURES,
    # chooses for the caller (CI compiles sm_90 only: .ci/run).
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
      # The GPUs present, where nvcc knows them all; else sm_80 and sm_90 (each
      # with its PTX, which newer GPUs compile at load).
      set(default_archs 80 90)
      if(strata_gpu_archs AND NOT strata_gpu_archs STREQUAL "unknown")
        execute_process(COMMAND ${CMAKE_CUDA_COMPILER} --list-gpu-code OUTPUT_VARIABLE known
                        RESULT_VARIABLE rc ERROR_QUIET)
        list(REMOVE_DUPLICATES strata_gpu_archs)
        set(all_known ON)
        foreach(arch IN LISTS strata_gpu_archs)
          if(NOT rc EQUAL 0 OR NOT known MATCHES "sm_${arch}([^0-9]|$)")
            set(all_known OFF)
          endif()
        endforeach()
        if(all_known)
          set(default_archs ${strata_gpu_archs})
        endif()
      endif()
      set(CMAKE_CUDA_ARCHITECTURES ${default_archs})
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    find_library(STRATA_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
    find_path(STRATA_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
    if(STRATA_NCCL_LIBRARY AND STRATA_NCCL_INCLUDE_DIR)
      set(STRATA_HAVE_CUDA ON)
    elseif(STRATA_CUDA STREQUAL "ON")
      message(FATAL_ERROR "STRATA_CUDA=ON but NCCL was not found next to the CUDA toolkit")
    else()
      set(strata_cuda_off_reason "NCCL not found next to the CUDA toolkit")
    endif()
  endif()
endif()
if(STRATA_HAVE_CUDA)
  message(STATUS "strata: CUDA backend ON (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, archs ${CMAKE_CUDA_ARCHITECTURES})")
else()
  message(STATUS "strata: CUDA backend OFF (${strata_cuda_off_reason})")
endif()
