# Exported package: find_package(strata) from an install prefix gives strata::strata
# and the per-folder targets strata::core, strata::nvme, ...
include(CMakePackageConfigHelpers)
set(STRATA_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/strata)
install(EXPORT strataTargets NAMESPACE strata:: DESTINATION ${STRATA_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/strataConfig.cmake.in
  ${PROJECT_BINARY_DIR}/strataConfig.cmake INSTALL_DESTINATION ${STRATA_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/strataConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/strataConfig.cmake ${PROJECT_BINARY_DIR}/strataConfigVersion.cmake
  DESTINATION ${STRATA_CMAKE_DIR})
