// Describes a JSON value for an error message without echoing it whole: the
// value may come from an untrusted file (a safetensors header, a downloaded
// config.json), where dump() of a deeply nested array recurses off the stack
// and a huge string floods the message.
#pragma once

#include <algorithm>

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <cstdint>
#include <string>
#include <string_view>

#include "runtime/config/json_text.h"

namespace strata {

// `"silu" (a string)`, `3.5 (a number)`, `true (a boolean)`, `null`,
// `[0.9,1.0]` (a list of at most 8 numbers, booleans or nulls), `a list of 3`,
// `an object of 2 keys`. Strings are cut at 80 bytes, and
// control characters and invalid UTF-8 in them are escaped (printable_excerpt).
inline std::string describe_json(const nlohmann::json& value) {
  if (value.is_string()) {
    const std::string_view text = value.get_ref<const std::string&>();
    return text.size() <= 80
               ? fmt::format("\"{}\" (a string)", printable_excerpt(text, SIZE_MAX))
               : fmt::format("\"{}...\" (a string of {} characters)",
                             printable_excerpt(text.substr(0, 80), SIZE_MAX), text.size());
  }
  if (value.is_boolean()) return fmt::format("{} (a boolean)", value.dump());
  if (value.is_number()) return fmt::format("{} (a number)", value.dump());
  if (value.is_null()) return "null";
  if (value.is_array()) {
    // A short list of plain values is shown ([1.0,0.999] says more than "a list of 2").
    const bool plain = value.size() <= 8 && std::all_of(value.begin(), value.end(), [](const nlohmann::json& v) {
                         return v.is_number() || v.is_boolean() || v.is_null();
                       });
    return plain ? value.dump() : fmt::format("a list of {}", value.size());
  }
  return fmt::format("an object of {} keys", value.size());
}

}  // namespace strata
