// `strata run` given values a hostile or careless user gives: limits on the
// rank count, rank arithmetic that must not overflow, and grace periods too
// long for the clock, each checked against the behaviour that was wrong.
#include "runtime/launcher/launcher.h"

#include <catch2/catch.hpp>
#include <string>

#include "core/error.h"
#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"

using strata::test::run_command;
using strata::test::strata_binary;

namespace {
std::string strata_run(const std::string& args) {
  return "timeout -k 5 60 " + strata_binary() + " run " + args + " 2>&1";
}
}  // namespace

TEST_CASE("launch: the rank count is bounded before anything is started", "[launcher][issue16]") {
  // -n had no upper bound: it forked until pipe2 hit EMFILE.
  strata::launcher::LaunchOptions options;
  options.command = {"true"};
  options.nproc_per_node = strata::launcher::kMaxLocalRanks + 1;
  REQUIRE_THROWS_WITH(strata::launcher::launch(options),
                      Catch::Contains("-n (ranks on this node) must be in [1, 1024]"));
  options.nproc_per_node = 0;
  REQUIRE_THROWS_WITH(strata::launcher::launch(options), Catch::Contains("got 0"));

  auto result = run_command(strata_run("-n 1025 -- true"));
  REQUIRE(result.exit_code != 0);
  REQUIRE_THAT(result.output, Catch::Contains("[1, 1024]"));
}

TEST_CASE("launch: an open-file limit too low for -n is said up front", "[launcher][issue16]") {
  // It failed halfway with "pipe for rank output: Too many open files".
  const auto result =
      run_command("sh -c 'ulimit -n 64 && exec " + strata_run("-n 100 -- true") + "'");
  REQUIRE(result.exit_code == 1);
  REQUIRE_THAT(result.output, Catch::Contains("-n 100 needs about 232 open files") &&
                                  Catch::Contains("ulimit -n"));
}

TEST_CASE("launch: nnodes x nproc and global ranks do not overflow int", "[launcher][issue16]") {
  // 1.5e9 nodes x 2 ranks: WORLD_SIZE used to wrap to -1294967296.
  strata::launcher::LaunchOptions options;
  options.command = {"true"};
  options.nproc_per_node = 2;
  options.nnodes = 1500000000;
  REQUIRE_THROWS_WITH(strata::launcher::launch(options),
                      Catch::Contains("3000000000 ranks") && Catch::Contains("32-bit int"));
  auto result = run_command(strata_run("--nnodes 1500000000 -n 2 -- sh -c 'echo W=$WORLD_SIZE'"));
  REQUIRE(result.exit_code == 1);
  REQUIRE_THAT(result.output, Catch::Contains("32-bit int") && !Catch::Contains("W="));
  // The largest job that fits: the last node's ranks are exact.
  result = run_command(strata_run(
      "--nnodes 1073741823 -n 2 --node-rank 1073741822 -- sh -c 'echo R=$RANK W=$WORLD_SIZE'"));
  INFO(result.output);
  REQUIRE(result.exit_code == 0);
  REQUIRE_THAT(result.output, Catch::Contains("R=2147483644 W=2147483646") &&
                                  Catch::Contains("R=2147483645 W=2147483646"));
}

TEST_CASE("strata run: a failure grace too long for the clock means wait, not kill at once",
          "[launcher][issue16]") {
  // 1e10 s overflowed the nanosecond cast: the survivor was killed after ~0.1 s.
  for (const char* grace : {"1e10", "inf"}) {
    INFO("--failure-grace " << grace);
    const auto result = run_command(
        strata_run(std::string("-n 2 --failure-grace ") + grace +
                   " -- sh -c 'if [ $RANK = 0 ]; then exit 5; fi; sleep 1; echo survived'"));
    INFO(result.output);
    REQUIRE(result.exit_code == 5);
    REQUIRE_THAT(result.output,
                 Catch::Contains("[rank 1] survived") && !Catch::Contains("stopped by strata run"));
    // It says what it will do: for inf, not "stopping the other ranks".
    if (std::string(grace) == "inf") {
      REQUIRE_THAT(result.output, Catch::Contains("may finish on their own") && !Catch::Contains("stopping"));
    } else {
      REQUIRE_THAT(result.output, Catch::Contains("stopping the other ranks in 1e+10 s unless they end first"));
    }
  }
}

TEST_CASE("strata run: a kill delay too long for the clock means no SIGKILL",
          "[launcher][issue16]") {
  // Rank 1 handles SIGTERM slowly; with --kill-delay 1e10 it must get to
  // finish (it was SIGKILLed at once). Rank 0 fails only after rank 1 has
  // installed its handler (the file handshake), so no timing is assumed.
  strata::test::TempDir dir("launcher-kill-delay");
  const std::string ready = dir.file("ready");
  const auto result = run_command(strata_run(
      "-n 2 --failure-grace 0 --kill-delay 1e10 -- sh -c 'if [ $RANK = 0 ]; then while [ ! -e " +
      ready +
      " ]; do sleep 0.05; done; exit 5; fi; trap \"sleep 1; echo after-term; exit 0\" TERM; "
      "touch " +
      ready + "; while :; do sleep 0.1; done'"));
  INFO(result.output);
  REQUIRE(result.exit_code == 5);
  REQUIRE_THAT(result.output, Catch::Contains("[rank 1] after-term"));
}
