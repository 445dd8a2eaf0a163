// `strata plan --check`: a finished (or running) run's measured memory set
// beside what the plan predicts for exactly that run, tier by tier, with a
// tolerance. The prediction comes from runtime_memory.h (what this runtime
// holds) plus the process baseline; the measurement from the run's
// metrics.jsonl (runtime/train/run_report.h: memory.device_peak_bytes and
// memory.host_peak_rss_bytes of rank 0, per step).
//
// Thread-safety: pure functions except read_metrics (reads one file).
// Errors: read_metrics throws Error(kBadArgument) naming the file and, for a
// bad record, its line: a missing or empty file, a line that is not JSON
// (the last one: "truncated"), a record without the memory fields.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace strata::plan {

struct RunMeasurement {
  std::filesystem::path metrics_path;
  int64_t steps = 0;                  // step records read
  uint64_t device_peak_nbytes = 0;    // highest memory.device_peak_bytes over the steps
  uint64_t host_peak_rss_nbytes = 0;  // highest memory.host_peak_rss_bytes over the steps
  // Highest memory.activation_bytes (the arenas of a pipeline's micro-batch
  // slots), when the records have it.
  std::optional<uint64_t> activation_nbytes;
};

// Parses metrics.jsonl text; `source` names the file in errors.
RunMeasurement parse_metrics(const std::string& text, const std::string& source);
RunMeasurement read_metrics(const std::filesystem::path& metrics_jsonl);

// One tier of the comparison.
struct CheckRow {
  std::string tier;  // "device", "host resident", "nvme"
  double predicted_nbytes = 0;
  std::optional<double> measured_nbytes;  // absent: the run does not measure it
  std::string measured_from;              // where the measurement came from, or why there is none
  // measured / predicted; within: |ratio - 1| <= tolerance (false without a measurement).
  double ratio() const {
    return measured_nbytes && predicted_nbytes > 0 ? *measured_nbytes / predicted_nbytes : 0;
  }
  bool within(double tolerance) const;
};

struct CheckResult {
  double tolerance = 0.15;
  std::vector<CheckRow> rows;
  // Every measured tier within the tolerance (tiers without a measurement do not count).
  bool ok() const;
};

std::string check_text(const CheckResult& result);
nlohmann::json check_json(const CheckResult& result);

}  // namespace strata::plan
