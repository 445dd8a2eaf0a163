// The configuration schema: every key strata reads, its type, accepted values,
// default and one-line documentation. This table is the single place a default
// is written; docs/config.md is generated from it (`strata config docs`).
#pragma once

#include <nlohmann/json.hpp>

#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

enum class FieldKind {
  kBool,
  kInt,        // integral JSON number within [min, max]
  kNumber,     // any finite number within [min, max]
  kSize,       // integer count, or a size string ("1GB", "512KiB"); see `unit`
  kString,
  kEnum,       // string out of `choices` (case-sensitive)
  kNumberPair, // [a, b], each within [min, max]
  kIntList,    // [a, b, ...], integers each within [min, max] (empty allowed)
};

// A range's open end: any finite number passes.
inline constexpr double kUnbounded = std::numeric_limits<double>::infinity();

struct ConfigField {
  std::string path;       // dotted: "zero_optimization.offload_param.device"
  FieldKind kind;
  nlohmann::json default_value;
  std::string doc;
  std::vector<std::string> choices;  // kEnum
  double min = -kUnbounded;  // kNumber, kInt, kSize, kNumberPair: the accepted range
  double max = kUnbounded;
  std::string unit;        // kSize: "bytes" or "elements"
  bool no_effect = false;  // DeepSpeed key accepted for compatibility; strata ignores it (and says so)
};

// Every field, in documentation order.
const std::vector<ConfigField>& config_fields();
// The field at `path`, or nullptr.
const ConfigField* find_config_field(std::string_view path);
// Old or alternative key → canonical path ("aio.intra_op_parallelism" → "aio.thread_count").
std::string_view canonical_config_path(std::string_view path);
// True when `path` names an object that contains fields ("zero_optimization").
bool is_config_section(std::string_view path);
// Human description of what a field accepts: "an integer 0..3", "one of none, cpu, nvme".
std::string describe_accepted(const ConfigField& field);
// Whether "auto" is one of the field's own values (a choice, or a string),
// rather than a Hugging Face Trainer placeholder for a value to fill.
bool accepts_auto(const ConfigField& field);
// Markdown reference of every key (the content of docs/config.md).
std::string config_reference_markdown();

}  // namespace strata
