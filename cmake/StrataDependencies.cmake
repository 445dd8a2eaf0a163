# Every third-party dependency comes from a Debian package installed by scripts/setup.
find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(nlohmann_json 3 REQUIRED)
find_package(CLI11 REQUIRED)
find_package(Boost 1.74 REQUIRED)
find_package(Gloo REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(ZLIB REQUIRED)  # CRC-32 of checkpoint files
# OpenBLAS's OpenMP build (libopenblas-openmp-dev), linked by path: its GEMMs run
# on the same libgomp thread team as our OpenMP loops, so the cpu ops have one
# thread pool instead of two spinning against each other. Debian's default
# libopenblas.so.0 is the pthreads build (an alternatives link), so the
# directory goes into the build and install RUNPATH (see kernels/).
set(STRATA_OPENBLAS_DIR /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp)
find_library(STRATA_OPENBLAS_LIBRARY openblas PATHS ${STRATA_OPENBLAS_DIR} NO_DEFAULT_PATH)
find_path(STRATA_OPENBLAS_INCLUDE_DIR cblas.h
          PATHS /usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp NO_DEFAULT_PATH)
if(NOT STRATA_OPENBLAS_LIBRARY OR NOT STRATA_OPENBLAS_INCLUDE_DIR)
  message(FATAL_ERROR "OpenBLAS (OpenMP build) not found in ${STRATA_OPENBLAS_DIR}: "
                      "install libopenblas-openmp-dev (scripts/setup does)")
endif()
find_package(PkgConfig REQUIRED)
pkg_check_modules(LIBURING REQUIRED IMPORTED_TARGET liburing)
find_library(STRATA_AIO_LIBRARY aio REQUIRED)
find_path(STRATA_AIO_INCLUDE_DIR libaio.h REQUIRED)
add_library(strata_aio INTERFACE)
target_link_libraries(strata_aio INTERFACE ${STRATA_AIO_LIBRARY})
target_include_directories(strata_aio INTERFACE ${STRATA_AIO_INCLUDE_DIR})
