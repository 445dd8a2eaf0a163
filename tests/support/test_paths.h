// Where a test finds what the build made (bin/strata, the bench tools) and the
// source tree's fixtures (tests/data, examples, docs).
//
// The two paths are compiled into one file of each build (test_paths.cc, in
// strata_catch_session, which every test binary links) rather than defined on
// every test file's command line: a test file's object then does not depend on
// the directory it is built in, so ccache (base_dir) shares it between
// checkouts and worktrees. Safe to call from static initialisers.
#pragma once

#include <string>

namespace strata::test {

// The CMake build directory (PROJECT_BINARY_DIR), without a trailing '/'.
const std::string& build_dir();
// The source tree (PROJECT_SOURCE_DIR), without a trailing '/'.
const std::string& source_dir();

}  // namespace strata::test
