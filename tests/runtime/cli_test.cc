// The `strata` command as a user runs it: doctor's report, config check's exit
// codes and messages, help text.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_paths.h"

using strata::test::run_command;
using strata::test::strata_binary;

TEST_CASE("strata doctor --json reports every section", "[cli]") {
  strata::test::TempDir dir;
  const auto result = run_command(strata_binary() + " doctor --json --dir " + dir.path().string());
  REQUIRE(result.exit_code == 0);
  const auto report = nlohmann::json::parse(result.output);
  REQUIRE(report["cpu"]["logical_cores"].get<int>() >= 1);
  REQUIRE(report["cpu"].contains("avx512_bf16"));
  REQUIRE(report["memory"]["total_bytes"].get<uint64_t>() > 0);
  REQUIRE(report["memory"].contains("memlock_limit_bytes"));
  REQUIRE(report["cuda"].contains("devices"));
  REQUIRE(report["io_uring"].contains("supported"));
  REQUIRE(report["directory"]["path"] == dir.path().string());
  REQUIRE(report["directory"]["free_bytes"].get<uint64_t>() > 0);
  REQUIRE(report["directory"].contains("o_direct"));
  // The readable report names the same things.
  const auto text = run_command(strata_binary() + " doctor --dir " + dir.path().string());
  REQUIRE(text.exit_code == 0);
  REQUIRE_THAT(text.output, Catch::Contains("RLIMIT_MEMLOCK") && Catch::Contains("O_DIRECT") &&
                                Catch::Contains("io_uring") && Catch::Contains("CUDA"));
}

TEST_CASE("strata doctor rejects a missing directory", "[cli]") {
  const auto result = run_command(strata_binary() + " doctor --dir /nonexistent/strata 2>&1");
  REQUIRE(result.exit_code != 0);
  REQUIRE_THAT(result.output, Catch::Contains("/nonexistent/strata"));
}

TEST_CASE("strata config check: exit codes and messages", "[cli]") {
  strata::test::TempDir dir;
  const auto good = run_command(strata_binary() + " config check " + strata::test::source_dir() +
                                "/tests/runtime/configs/ds_zero3_nvme.json 2>/dev/null");
  REQUIRE(good.exit_code == 0);
  REQUIRE(nlohmann::json::parse(good.output)["zero_optimization"]["stage"] == 3);

  const std::string bad = dir.file("bad.json");
  REQUIRE(run_command("printf '%s' '{\"zero_optimization\": {\"offload_param\": {\"device\": \"ssd\"}}, "
                      "\"aio\": {\"thread_cont\": 2}}' > " + bad).exit_code == 0);
  const auto result = run_command(strata_binary() + " config check " + bad + " 2>&1");
  REQUIRE(result.exit_code == 1);
  REQUIRE_THAT(result.output,
               Catch::Contains("2 problems") &&
                   Catch::Contains("zero_optimization.offload_param.device: \"ssd\" is not one of none, cpu, nvme") &&
                   Catch::Contains("did you mean \"aio.thread_count\""));
}

TEST_CASE("strata --help lists the subcommands", "[cli]") {
  const auto result = run_command(strata_binary() + " --help");
  REQUIRE(result.exit_code == 0);
  REQUIRE_THAT(result.output, Catch::Contains("doctor") && Catch::Contains("config"));
  REQUIRE(run_command(strata_binary() + " no-such-command 2>&1").exit_code != 0);
}

// --- Bad input as a hostile user gives it (issue 16) -------------------------

TEST_CASE("strata config check: a number out of range, a directory, a binary file", "[cli][issue16]") {
  strata::test::TempDir dir;
  const std::string file = dir.file("overflow.json");
  REQUIRE(run_command("printf '%s' '{\"fp16\":{\"initial_scale_power\":1e30016}}' > " + file).exit_code == 0);
  // Was std::terminate (exit 134) on nlohmann::out_of_range.
  auto result = run_command(strata_binary() + " config check " + file + " 2>&1");
  REQUIRE(result.exit_code == 1);
  REQUIRE_THAT(result.output, Catch::Contains("1:") && Catch::Contains("JSON number 1e30016 is out of range"));

  result = run_command(strata_binary() + " config check " + dir.path().string() + " 2>&1");
  REQUIRE(result.exit_code == 1);
  REQUIRE_THAT(result.output, Catch::Contains("Is a directory") && !Catch::Contains("JSON"));

  const std::string binary = dir.file("binary.json");
  REQUIRE(run_command("printf '\\211PNG\\r\\n' > " + binary).exit_code == 0);
  result = run_command(strata_binary() + " config check " + binary + " 2>&1");
  REQUIRE(result.exit_code == 1);
  REQUIRE_THAT(result.output, Catch::Contains("\\x89"));
  REQUIRE(result.output.find('\x89') == std::string::npos);
}

TEST_CASE("strata run: flag values out of range say the range", "[cli][issue16]") {
  // Was "Value 0 not in range 0.000000 to 1797...368.000000".
  auto result = run_command(strata_binary() + " run -n 0 -- true 2>&1");
  REQUIRE(result.exit_code != 0);
  REQUIRE_THAT(result.output, Catch::Contains("must be an integer in [1, 1024], got '0'") && !Catch::Contains("1797"));
  result = run_command(strata_binary() + " run -n 2 --master-port 70000 -- true 2>&1");
  REQUIRE(result.exit_code != 0);
  REQUIRE_THAT(result.output, Catch::Contains("must be an integer in [0, 65535], got '70000'"));
  result = run_command(strata_binary() + " run -n 2 --failure-grace nan -- true 2>&1");
  REQUIRE(result.exit_code != 0);
  REQUIRE_THAT(result.output, Catch::Contains("seconds >= 0"));
}

TEST_CASE("the bench tools refuse bad flags with a message and an exit code in 1..127, never abort or loop",
          "[cli][tools]") {
  strata::test::TempDir dir;
  const std::string bin = strata::test::build_dir() + "/bin/";
  struct Case {
    std::string command, expect;
  };
  const std::vector<Case> cases = {
      {"strata-train --zero 3 --offload-param nvme --offload-optimizer nvme --nvme-dir /dev/null --layers 1 "
       "--hidden 64 --heads 2 --vocab 64 --seq 8 --batch 1",
       "--nvme-dir /dev/null is not a directory"},
      {"strata-train --zero 3 --ranks 64 --layers 1 --hidden 64 --heads 2 --vocab 64 --seq 8 --batch 1",
       "would oversubscribe them"},
      {"strata-train --layers 1 --hidden 64 --heads 2 --vocab 64 --seq 8 --batch 1 --json /proc/no-such-dir/x.json",
       "--json /proc/no-such-dir/x.json"},
      {"strata-train --zero 3 --sub-group 1e6x", "--sub-group: not a count of elements: 1e6x"},
      // Counts as a ds_config writes them are accepted (1e6): the refusal is the next flag's.
      {"strata-train --zero 3 --sub-group 1e6 --reduce-bucket 2e6 --ep 2 --layers 1 --hidden 64 --heads 2 --vocab 64 "
       "--seq 8 --batch 1",
       "--ep 2 splits experts between ranks: give --experts too"},
      {"strata-bw --ranks 100000", "--ranks 100000 must be in [1, 64]"},
      {"strata-bw --min-bytes 0 --max-bytes 4KiB", "--min-bytes must be at least 1 byte"},
      {"strata-bw --factor nan", "--factor nan must be a number in [1.01, 1024]"},
      {"strata-bw --min-bytes 1MiB --max-bytes 4KiB", "the sweep would be empty"},
      {"strata-bw --json /proc/no-such-dir/x.json", "--json /proc/no-such-dir/x.json"},
      {"strata-io --dir " + dir.path().string() + " --size 1MiB --json /proc/no-such-dir/x.json",
       "--json /proc/no-such-dir/x.json"},
      {"strata-adam --numel 1K --json /proc/no-such-dir/x.json", "--json /proc/no-such-dir/x.json"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.command);
    const auto r = strata::test::run_with_limit(bin + c.command, 60);
    INFO(r.output);
    CHECK(r.exit_code >= 1);
    CHECK(r.exit_code <= 127);
    CHECK(r.seconds < 30);
    CHECK_THAT(r.output, Catch::Contains(c.expect));
    CHECK_THAT(r.output, !Catch::Contains("terminate called") && !Catch::Contains("check `"));
  }
}
