// A DOM-building SAX handler for nlohmann's parser that reports duplicate keys,
// bounds nesting and turns every parse failure into a message with line:column.
#include "runtime/config/json_text.h"

#include <fmt/format.h>

#include <utility>

namespace strata {
namespace {

using nlohmann::json;

// Length of the valid UTF-8 sequence at text[i], or 0 if the byte there does not start one.
size_t utf8_sequence_length(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  size_t length = 0;
  if (lead >= 0xC2 && lead <= 0xDF)
    length = 2;
  else if (lead >= 0xE0 && lead <= 0xEF)
    length = 3;
  else if (lead >= 0xF0 && lead <= 0xF4)
    length = 4;
  else
    return 0;
  if (i + length > text.size()) return 0;
  for (size_t k = 1; k < length; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
  }
  // Overlong forms, surrogates and code points above U+10FFFF.
  if (lead == 0xE0 && byte(i + 1) < 0xA0) return 0;
  if (lead == 0xED && byte(i + 1) > 0x9F) return 0;
  if (lead == 0xF0 && byte(i + 1) < 0x90) return 0;
  if (lead == 0xF4 && byte(i + 1) > 0x8F) return 0;
  return length;
}

class StrictDomBuilder {
 public:
  StrictDomBuilder(JsonTextResult& result, size_t max_depth)
      : result_(result), max_depth_(max_depth) {}

  bool null() { return add(json(nullptr)); }
  bool boolean(bool value) { return add(json(value)); }
  bool number_integer(json::number_integer_t value) { return add(json(value)); }
  bool number_unsigned(json::number_unsigned_t value) { return add(json(value)); }
  bool number_float(json::number_float_t value, const json::string_t& /*text*/) {
    return add(json(value));
  }
  bool string(json::string_t& value) { return add(json(std::move(value))); }
  bool binary(json::binary_t& value) { return add(json::binary(std::move(value))); }

  bool start_object(std::size_t /*size*/) { return open(json::object()); }
  bool start_array(std::size_t /*size*/) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(json::string_t& name) {
    json& object = *stack_.back().value;
    if (object.contains(name)) {
      if (result_.duplicate_keys.size() < kMaxReportedDuplicateKeys) {
        result_.duplicate_keys.push_back(child_path(name));
      }
      ++result_.duplicate_key_count;
    }
    stack_.back().key = name;
    pending_ = &object[name];
    return true;
  }

  // Called by the parser for syntax errors (parse_error) and for numbers out
  // of double's range (out_of_range 406); `position` is the byte offset.
  template <typename Exception>
  bool parse_error(std::size_t position, const std::string& last_token, const Exception& error) {
    byte_ = position;
    std::string detail = error.what();
    if (error.id == 406) {
      // The position is the number's last character; point at its first.
      if (!last_token.empty() && last_token.size() <= position)
        byte_ = position - last_token.size() + 1;
      detail =
          fmt::format("number {} is out of range (a JSON number must be within about ±1.8e308)",
                      printable_excerpt(last_token, 40));
    } else if (const auto at = detail.find("syntax error"); at != std::string::npos) {
      detail = detail.substr(at);
    } else if (const auto colon = detail.find(": "); colon != std::string::npos) {
      detail = detail.substr(colon + 2);
    }
    message_ = printable_excerpt(detail, 240);
    return false;
  }

  size_t byte() const { return byte_; }
  const std::string& message() const { return message_; }
  bool depth_exceeded() const { return depth_exceeded_; }
  void set_message(std::string message) { message_ = std::move(message); }

 private:
  struct Open {
    json* value;
    std::string key;  // the key whose value is being read (objects)
  };

  std::string child_path(const std::string& name) const {
    std::string path;
    for (const auto& open : stack_) {
      if (&open == &stack_.back()) break;
      if (open.value->is_object()) {
        path += (path.empty() ? "" : ".") + printable_excerpt(open.key, 60);
      } else {
        path += fmt::format("[{}]", open.value->size() - 1);
      }
    }
    path += (path.empty() ? "" : ".") + printable_excerpt(name, 60);
    if (path.size() > 240)
      path = path.substr(0, 200) + "... (a path " + std::to_string(stack_.size()) + " levels deep)";
    return path;
  }

  // Places `value` where the parser is: the root, the next array element, or
  // the value of the last key.
  json* place(json&& value) {
    if (stack_.empty()) {
      result_.document = std::move(value);
      return &result_.document;
    }
    json& parent = *stack_.back().value;
    if (parent.is_array()) {
      parent.push_back(std::move(value));
      return &parent.back();
    }
    *pending_ = std::move(value);
    return pending_;
  }

  bool add(json&& value) {
    place(std::move(value));
    return true;
  }

  bool open(json&& container) {
    if (stack_.size() >= max_depth_) {
      message_ = fmt::format("JSON nested deeper than {} levels", max_depth_);
      depth_exceeded_ = true;
      return false;
    }
    json* placed = place(std::move(container));
    stack_.push_back({placed, {}});
    return true;
  }

  bool close() {
    stack_.pop_back();
    return true;
  }

  JsonTextResult& result_;
  size_t max_depth_;
  std::vector<Open> stack_;
  json* pending_ = nullptr;
  size_t byte_ = 0;
  std::string message_;
  bool depth_exceeded_ = false;
};

}  // namespace

std::string printable_excerpt(std::string_view text, size_t max_bytes) {
  std::string out;
  size_t i = 0;
  while (i < text.size()) {
    if (out.size() >= max_bytes) {
      out += fmt::format("... ({} bytes)", text.size());
      return out;
    }
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7F) {
      out += static_cast<char>(c);
      ++i;
    } else if (c == '\n') {
      out += "\\n", ++i;
    } else if (c == '\t') {
      out += "\\t", ++i;
    } else if (c == '\r') {
      out += "\\r", ++i;
    } else if (const size_t length = c >= 0x80 ? utf8_sequence_length(text, i) : 0; length > 0) {
      out.append(text.substr(i, length));
      i += length;
    } else {
      out += fmt::format("\\x{:02x}", c);
      ++i;
    }
  }
  return out;
}

JsonTextResult parse_json_text(std::string_view text, size_t max_depth) {
  JsonTextResult result;
  StrictDomBuilder builder(result, max_depth);
  bool parsed = false;
  try {
    parsed = json::sax_parse(text.begin(), text.end(), &builder);
  } catch (const json::exception& e) {
    // sax_parse reports through parse_error(); this is a safety net for any
    // exception a future nlohmann raises outside it.
    builder.set_message(printable_excerpt(e.what(), 240));
  }
  if (parsed) {
    result.ok = true;
    return result;
  }
  result.document = nullptr;
  if (builder.depth_exceeded()) {
    result.error = builder.message();
    return result;
  }
  // The byte offset as line:column (1-based), the way editors count.
  size_t line = 1, column = 1;
  for (size_t i = 0; i + 1 < builder.byte() && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line, column = 1;
    } else {
      ++column;
    }
  }
  std::string message = builder.message();
  if (message.rfind("syntax error", 0) == 0 || message.rfind("number ", 0) == 0)
    message = "JSON " + message;
  result.error = fmt::format("{}:{}: {}", line, column, message);
  return result;
}

}  // namespace strata
