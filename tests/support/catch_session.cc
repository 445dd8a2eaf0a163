// Catch2's implementation (v2 is one header: this is the one translation unit
// that compiles its runner), built once into strata_catch_session and linked
// by every test binary. Each binary's main() is its own small file
// (catch_main.cc, or a binary's own gate) calling run_catch_session():
// compiling the implementation into each of them cost ~26 s of CPU per binary.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "tests/support/catch_session.h"

namespace strata::test {

int run_catch_session(int argc, char** argv) { return Catch::Session().run(argc, argv); }

}  // namespace strata::test
