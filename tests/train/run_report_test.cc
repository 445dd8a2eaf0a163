// The run report: metrics.jsonl lines survive as written, skipped steps are
// marked, the loss curve is a well-formed SVG even for edge cases.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "runtime/train/run_report.h"
#include "tests/support/temp_dir.h"

using strata::train::RunReport;
using strata::train::StepRecord;

TEST_CASE("metrics.jsonl has one object per step, flushed as written, skipped steps are marked", "[train]") {
  strata::test::TempDir dir;
  RunReport report(dir.path() / "out", 3, nullptr);
  StepRecord a;
  a.step = 1, a.loss = 5.5, a.lr = 1e-3, a.grad_norm = 2.0, a.tokens = 100, a.seconds = 0.5;
  report.record(a);
  // Readable before the run ends (a crash keeps every finished step).
  {
    std::ifstream in(report.metrics_path());
    std::string line;
    REQUIRE(std::getline(in, line));
    const auto j = nlohmann::json::parse(line);
    CHECK(j["step"] == 1);
    CHECK(j["loss"] == 5.5);
    CHECK(j["tokens_per_s"] == 200.0);
  }
  StepRecord b = a;
  b.step = 2, b.applied = false, b.grad_norm = INFINITY;
  report.record(b);
  report.finish();
  std::ifstream in(report.metrics_path());
  std::string line;
  std::getline(in, line);
  REQUIRE(std::getline(in, line));
  const auto j = nlohmann::json::parse(line);  // an infinite norm must not break the JSON
  CHECK(j["applied"] == false);
  CHECK(j["grad_norm"].is_null());
  std::ifstream svg(report.curve_path());
  std::string text((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  CHECK_THAT(text, Catch::StartsWith("<svg") && Catch::Contains("step 2 skipped") && Catch::EndsWith("</svg>\n"));
}

TEST_CASE("the loss curve of no steps, one step or a flat loss is still a valid picture", "[train]") {
  CHECK_THAT(strata::train::loss_curve_svg({}), Catch::StartsWith("<svg") && Catch::EndsWith("</svg>\n"));
  StepRecord s;
  s.step = 1, s.loss = 3.0;
  const std::string one = strata::train::loss_curve_svg({s, s});
  CHECK(one.find("nan") == std::string::npos);
  CHECK(one.find("inf") == std::string::npos);
}
