// Reading metrics.jsonl and comparing it with the prediction (plan_check.h).
#include "runtime/plan/plan_check.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "runtime/config/json_text.h"
#include "core/error.h"

namespace strata::plan {
namespace {

// A memory field of one record: a non-negative integer, or an error naming the line.
uint64_t memory_field(const nlohmann::json& record, const char* key, const std::string& where) {
  const auto memory = record.find("memory");
  STRATA_CHECK(
      memory != record.end() && memory->is_object(), kBadArgument,
      "{}: the record has no \"memory\" object (written by a strata older than peak memory "
      "reporting?)",
      where);
  const auto field = memory->find(key);
  STRATA_CHECK(field != memory->end() && field->is_number_unsigned(), kBadArgument,
               "{}: \"memory.{}\" is missing or not a byte count", where, key);
  return field->get<uint64_t>();
}

}  // namespace

RunMeasurement parse_metrics(const std::string& text, const std::string& source) {
  RunMeasurement m;
  m.metrics_path = source;
  std::istringstream in(text);
  std::string line;
  int64_t line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("{}:{}", source, line_number);
    const auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_discarded() || !record.is_object()) {
      // The writer ends every record with a newline and flushes it, so a last
      // line without one is a record cut short (a crash, a full disk).
      const bool last = in.peek() == std::char_traits<char>::eof();
      const bool cut = last && !text.empty() && text.back() != '\n';
      raise(ErrorCategory::kBadArgument, "{}: {} ({} bytes: '{}')", where,
            cut ? "the last record is truncated (no newline; the run stopped while writing it?)"
                : "not a JSON object",
            line.size(), printable_excerpt(line, 60));
    }
    const auto step = record.find("step");
    STRATA_CHECK(step != record.end() && step->is_number_integer() && step->get<int64_t>() >= 1,
                 kBadArgument, "{}: \"step\" is missing or not a step number >= 1", where);
    m.device_peak_nbytes =
        std::max(m.device_peak_nbytes, memory_field(record, "device_peak_bytes", where));
    m.host_peak_rss_nbytes =
        std::max(m.host_peak_rss_nbytes, memory_field(record, "host_peak_rss_bytes", where));
    // A pipeline's (or layer-major) step: its arenas, when the record has them.
    const auto memory = record.find("memory");
    const auto activations = memory->find("activation_bytes");
    if (activations != memory->end()) {
      STRATA_CHECK(activations->is_number_unsigned(), kBadArgument,
                   "{}: \"memory.activation_bytes\" is not a byte count", where);
      m.activation_nbytes = std::max(m.activation_nbytes.value_or(0), activations->get<uint64_t>());
    }
    ++m.steps;
  }
  STRATA_CHECK(
      m.steps > 0, kBadArgument,
      "{}: no step records (the run has not finished a step yet, or stopped before its first)",
      source);
  return m;
}

RunMeasurement read_metrics(const std::filesystem::path& path) {
  std::error_code ec;
  STRATA_CHECK(std::filesystem::is_regular_file(path, ec), kBadArgument,
               "{} does not exist or is not a file (give a run directory holding metrics.jsonl, or "
               "the file)",
               path.string());
  std::ifstream file(path, std::ios::binary);
  STRATA_CHECK(file.good(), kBadArgument, "cannot open {}", path.string());
  std::ostringstream text;
  text << file.rdbuf();
  return parse_metrics(text.str(), path.string());
}

bool CheckRow::within(double tolerance) const {
  return measured_nbytes.has_value() && predicted_nbytes > 0 && std::abs(ratio() - 1) <= tolerance;
}

bool CheckResult::ok() const {
  for (const CheckRow& row : rows) {
    if (row.measured_nbytes && !row.within(tolerance)) return false;
  }
  return true;
}

std::string check_text(const CheckResult& r) {
  // The tier column as wide as its longest name ("activations (layer-major)").
  size_t width = 15;
  for (const CheckRow& row : r.rows) width = std::max(width, row.tier.size());
  std::string out =
      fmt::format("{:<{}} {:>12} {:>12} {:>9}  {:<10} {}\n", "tier", width, "predicted", "measured",
                  "ratio", fmt::format("±{:.0f}%", 100 * r.tolerance), "measured from");
  for (const CheckRow& row : r.rows) {
    const auto mb = [](double nbytes) { return fmt::format("{:.1f} MB", nbytes / 1e6); };
    out +=
        fmt::format("{:<{}} {:>12} {:>12} {:>9}  {:<10} {}\n", row.tier, width, mb(row.predicted_nbytes),
                    row.measured_nbytes ? mb(*row.measured_nbytes) : "-",
                    row.measured_nbytes ? fmt::format("{:.3f}", row.ratio()) : "-",
                    !row.measured_nbytes      ? "n/a"
                    : row.within(r.tolerance) ? "yes"
                                              : "NO",
                    row.measured_from);
  }
  return out;
}

nlohmann::json check_json(const CheckResult& r) {
  nlohmann::json rows = nlohmann::json::array();
  for (const CheckRow& row : r.rows) {
    rows.push_back(
        {{"tier", row.tier},
         {"predicted_bytes", static_cast<uint64_t>(std::llround(row.predicted_nbytes))},
         {"measured_bytes", row.measured_nbytes ? nlohmann::json(static_cast<uint64_t>(
                                                      std::llround(*row.measured_nbytes)))
                                                : nlohmann::json(nullptr)},
         {"measured_from", row.measured_from},
         {"ratio", row.measured_nbytes ? nlohmann::json(row.ratio()) : nlohmann::json(nullptr)},
         {"within_tolerance", row.measured_nbytes ? nlohmann::json(row.within(r.tolerance))
                                                  : nlohmann::json(nullptr)}});
  }
  return {{"tolerance", r.tolerance}, {"ok", r.ok()}, {"tiers", rows}};
}

}  // namespace strata::plan
