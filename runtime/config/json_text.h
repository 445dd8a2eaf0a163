// Parsing JSON text that comes from a file a user or a download supplied (a
// training config, a safetensors header, a Hugging Face config.json), with the
// checks nlohmann's parser lacks: a key given twice is reported (not "the last
// one silently wins"), nesting is bounded (a hostile file of '[' must not cost
// gigabytes), and every failure — including a number beyond double's range,
// which nlohmann throws as out_of_range rather than parse_error — comes back
// as a value with line:column, never as an exception. Messages quote the input
// through printable_excerpt(), so they are bounded and free of raw bytes.
// Thread-safety: free functions, no shared state. Throws only std::bad_alloc.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

// Nesting depth allowed by default: strata's own documents are 4 levels deep.
constexpr size_t kDefaultMaxJsonDepth = 64;
// Duplicate keys recorded before the rest are only counted.
constexpr size_t kMaxReportedDuplicateKeys = 20;

struct JsonTextResult {
  nlohmann::json document;  // the parsed value (on a duplicate key: the last value)
  bool ok = false;          // false: `error` says why; `document` is unusable
  std::string error;  // "3:2: JSON syntax error while parsing ..." (line:column first when known)
  // Keys that appeared twice in one object, as paths ("aio.queue_depth",
  // "w", "layers[2].name"); only the first kMaxReportedDuplicateKeys.
  std::vector<std::string> duplicate_keys;
  size_t duplicate_key_count = 0;
};

// Parses `text`. Never throws for bad input (see the header comment).
JsonTextResult parse_json_text(std::string_view text, size_t max_depth = kDefaultMaxJsonDepth);

// `text` made safe to quote in a message: valid UTF-8 is kept, control
// characters and invalid bytes become escapes (\n, \x89), and anything past
// `max_bytes` is cut with "... (N bytes)" appended.
std::string printable_excerpt(std::string_view text, size_t max_bytes = 80);

}  // namespace strata
