// strata-train --zero N --cp 2 (bench/strata-train): ranks as threads in one
// cp group, the run's first loss checked by the benchmark against its
// resident model on the whole sequences (exit status 1 otherwise), its losses
// those of the same run without cp, and the result JSON recording cp.
#include <catch2/catch.hpp>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/support/run_command.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_paths.h"

using strata::test::run_command;

TEST_CASE("strata-train --cp 2: the losses of the run without cp, and the JSON records cp", "[cp][strata-train]") {
  strata::test::TempDir dir;
  const std::string train = strata::test::build_dir() + "/bin/strata-train";
  const std::string model = " --layers 1 --hidden 64 --heads 4 --kv-heads 2 --vocab 64 --seq 8 --batch 1 --steps 2 "
                            "--warmup 1 --rounds 1 --zero 2";
  std::vector<nlohmann::json> runs;
  for (const std::string cp : {" --ranks 1", " --ranks 2 --cp 2", " --ranks 2 --cp 2 --cp-method ulysses"}) {
    const std::string json = dir.file("run" + std::to_string(runs.size()) + ".json");
    const auto r = run_command(train + model + cp + " --json " + json + " 2>&1");
    INFO(cp << ": " << r.output);
    REQUIRE(r.exit_code == 0);  // 1 when the first loss is not the resident model's
    std::ifstream in(json);
    runs.push_back(nlohmann::json::parse(in));
  }
  CHECK(runs[0]["zero"]["context_parallel"] == 1);
  CHECK(runs[0]["zero"]["context_parallel_method"].is_null());
  CHECK(runs[1]["zero"]["context_parallel"] == 2);
  CHECK(runs[1]["zero"]["context_parallel_method"] == "ring");
  CHECK(runs[1]["zero"]["context_buffer_bytes"].get<double>() > 0);
  CHECK(runs[2]["zero"]["context_parallel_method"] == "ulysses");
  // dp 1 either way: the same sequence, its chunks on two ranks.
  const auto want = runs[0]["rounds"][0]["losses"].get<std::vector<double>>();
  REQUIRE(want.size() == 3);
  for (size_t k = 1; k < runs.size(); ++k) {
    const auto got = runs[k]["rounds"][0]["losses"].get<std::vector<double>>();
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < want.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-5));
  }
  const auto resident = run_command(train + model + " --cp 2 --ranks 2 --pp 2 2>&1");
  CHECK(resident.exit_code != 0);
  CHECK_THAT(resident.output, Catch::Contains("--cp 2 runs through a ZeroEngine"));
  const auto odd = run_command(train + " --zero 2 --ranks 2 --cp 2 --seq 6 2>&1");
  CHECK(odd.exit_code != 0);
  CHECK_THAT(odd.output, Catch::Contains("--seq 6 does not divide by 2 x --cp 2 = 4"));
}
