// The build's two paths, defined for this file only (tests/CMakeLists.txt).
#include "tests/support/test_paths.h"

#if !defined(STRATA_TEST_BUILD_DIR) || !defined(STRATA_TEST_SOURCE_DIR)
#error "tests/CMakeLists.txt defines STRATA_TEST_BUILD_DIR and STRATA_TEST_SOURCE_DIR for this file"
#endif

namespace strata::test {

const std::string& build_dir() {
  static const std::string dir = STRATA_TEST_BUILD_DIR;
  return dir;
}

const std::string& source_dir() {
  static const std::string dir = STRATA_TEST_SOURCE_DIR;
  return dir;
}

}  // namespace strata::test
