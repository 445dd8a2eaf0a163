# strata_add_library(NAME folder SOURCES ... [CUDA_SOURCES ...]): one library
# per folder, exported as strata::<NAME>, headers included as "<folder>/x.h".
set(STRATA_LIBRARY_TARGETS "" CACHE INTERNAL "")

function(strata_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wno-unused-parameter>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${STRATA_WERROR}>>:-Werror>
    $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${STRATA_WERROR}>>:-Werror=all-warnings>)
endfunction()

function(strata_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;CUDA_SOURCES" ${ARGN})
  set(sources ${ARG_SOURCES})
  if(STRATA_HAVE_CUDA)
    list(APPEND sources ${ARG_CUDA_SOURCES})
  endif()
  add_library(strata_${name} ${sources})
  add_library(strata::${name} ALIAS strata_${name})
  # INSTALL_RPATH $ORIGIN: an installed library finds the strata libraries it
  # depends on (e.g. runtime -> kernels) beside itself, without LD_LIBRARY_PATH.
  set_target_properties(strata_${name} PROPERTIES OUTPUT_NAME strata_${name} EXPORT_NAME ${name}
                        INSTALL_RPATH "$ORIGIN")
  target_include_directories(strata_${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}/strata>)
  strata_warnings(strata_${name})
  install(TARGETS strata_${name} EXPORT strataTargets
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  file(RELATIVE_PATH folder ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR})
  install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/strata/${folder}
          FILES_MATCHING PATTERN "*.h")
  set(STRATA_LIBRARY_TARGETS ${STRATA_LIBRARY_TARGETS} strata_${name} CACHE INTERNAL "")
endfunction()

# strata_add_tool(NAME SOURCES ...): an installed command-line program.
function(strata_add_tool name)
  add_executable(${name} ${ARGN})
  strata_warnings(${name})
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin
                        INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}")
  install(TARGETS ${name} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endfunction()
