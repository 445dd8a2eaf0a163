# Exported package: find_package(strata) from an install prefix gives strata::strata
# and the per-folder targets strata::core, strata::nvme, ...
include(CMakePackageConfigHelpers)
set(STRATA_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/strata)
install(EXPORT strataTargets NAMESPACE strata:: DESTINATION ${STRATA_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/strataConfig.cmake.in
  ${PROJECT_BINARY_DIR}/strataConfig.cmake INSTALL_DESTINATION ${STRATA_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/strataConfigVersion.cmake
  COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/strataConfig.cmake ${PROJECT_BINARY_DIR}/strataConfigVersion.cmake
  DESTINATION ${STRATA_CMAKE_DIR})

# The C API's version macros (runtime/capi/strata.h) are the package's version.
file(STRINGS ${PROJECT_SOURCE_DIR}/runtime/capi/strata.h capi_version_lines
     REGEX "^#define STRATA_VERSION_(MAJOR|MINOR|PATCH) [0-9]+$")
set(capi_version "")
foreach(part MAJOR MINOR PATCH)
  string(REGEX MATCH "STRATA_VERSION_${part} ([0-9]+)" _ "${capi_version_lines}")
  list(APPEND capi_version ${CMAKE_MATCH_1})
endforeach()
list(JOIN capi_version "." capi_version)
if(NOT capi_version VERSION_EQUAL PROJECT_VERSION)
  message(FATAL_ERROR "runtime/capi/strata.h says version ${capi_version}, project() says ${PROJECT_VERSION}: "
                      "change both together")
endif()

# pkg-config for C consumers of the C API: strata.pc in <libdir>/pkgconfig.
# With shared libraries (the default) -lstrata_runtime is all a program links:
# the library finds the other strata libraries beside itself ($ORIGIN). A
# static build's third-party dependencies are not listed: use find_package.
file(RELATIVE_PATH STRATA_PC_PREFIX_FROM_PCDIR /prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig /prefix)
string(REGEX REPLACE "/$" "" STRATA_PC_PREFIX_FROM_PCDIR "${STRATA_PC_PREFIX_FROM_PCDIR}")
# Each library is declared after those it depends on: reversed, a static link order.
set(pc_targets ${STRATA_LIBRARY_TARGETS})
list(REVERSE pc_targets)
set(STRATA_PC_LIBS_PRIVATE "")
foreach(target IN LISTS pc_targets)
  if(NOT target STREQUAL "strata_runtime")
    string(APPEND STRATA_PC_LIBS_PRIVATE " -l${target}")
  endif()
endforeach()
string(APPEND STRATA_PC_LIBS_PRIVATE " -lstdc++ -lm -lpthread")
string(STRIP "${STRATA_PC_LIBS_PRIVATE}" STRATA_PC_LIBS_PRIVATE)
configure_file(${PROJECT_SOURCE_DIR}/cmake/strata.pc.in ${PROJECT_BINARY_DIR}/strata.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/strata.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# The Python binding (ctypes over the C API, no build step): <libdir>/strata/python/strata,
# which finds libstrata_runtime.so two folders up. PYTHONPATH=<prefix>/<libdir>/strata/python.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/python/strata DESTINATION ${CMAKE_INSTALL_LIBDIR}/strata/python
        PATTERN "__pycache__" EXCLUDE)
# `strata data prepare`'s tool (python/strata_data, run by the strata command).
install(DIRECTORY ${PROJECT_SOURCE_DIR}/python/strata_data DESTINATION ${CMAKE_INSTALL_LIBDIR}/strata/python
        PATTERN "__pycache__" EXCLUDE)
