# Sanitizer and fuzzer builds (docs/RELIABILITY.md), off by default:
#   STRATA_SANITIZE=address  AddressSanitizer + UndefinedBehaviorSanitizer (any UB report is fatal)
#   STRATA_SANITIZE=thread   ThreadSanitizer
#   STRATA_FUZZ=ON           the libFuzzer harnesses in tests/fuzz (clang only; use with address)
# Every target of the build is instrumented, so a report names project code
# wherever it runs. scripts/test --sanitize / --tsan / --fuzz configure these.
set(STRATA_SANITIZE "" CACHE STRING "Build with sanitizers: empty, address (ASan+UBSan) or thread (TSan)")
set_property(CACHE STRATA_SANITIZE PROPERTY STRINGS "" address thread)
option(STRATA_FUZZ "Build the libFuzzer harnesses in tests/fuzz (needs clang)" OFF)

if(STRATA_SANITIZE STREQUAL "address")
  set(strata_sanitizer_flags -fsanitize=address,undefined -fno-sanitize-recover=undefined)
elseif(STRATA_SANITIZE STREQUAL "thread")
  set(strata_sanitizer_flags -fsanitize=thread)
elseif(NOT STRATA_SANITIZE STREQUAL "")
  message(FATAL_ERROR "STRATA_SANITIZE must be empty, address or thread (got '${STRATA_SANITIZE}')")
endif()

if(STRATA_SANITIZE)
  if(STRATA_HAVE_CUDA)
    message(FATAL_ERROR "STRATA_SANITIZE covers the CPU path: configure with STRATA_CUDA=OFF")
  endif()
  # C and C++ only (nvcc would not understand the flags); frame pointers for
  # whole stacks in reports.
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${strata_sanitizer_flags};-fno-omit-frame-pointer>")
  add_link_options(${strata_sanitizer_flags})
  message(STATUS "strata: sanitizers ${STRATA_SANITIZE} (${strata_sanitizer_flags})")
endif()

if(STRATA_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "STRATA_FUZZ needs clang (libFuzzer): configure with CC=clang CXX=clang++")
  endif()
  if(NOT STRATA_SANITIZE STREQUAL "address")
    message(FATAL_ERROR "STRATA_FUZZ needs STRATA_SANITIZE=address (a fuzzer without ASan misses what it finds)")
  endif()
endif()
