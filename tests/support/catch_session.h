// Runs the Catch2 session of a test binary: what a main() returns after its
// own checks. Catch2 (v2, one header) declares its Session only where it
// compiles its implementation, in catch_session.cc, once for every binary.
#pragma once

namespace strata::test {

// Catch::Session().run(argc, argv): runs the binary's test cases as the
// command line selects them; returns the number of failed cases (at most 255).
int run_catch_session(int argc, char** argv);

}  // namespace strata::test
