// Human-readable byte sizes.
#include "runtime/config/size.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <string>

#include "core/error.h"

namespace strata {

std::optional<uint64_t> parse_size(std::string_view text) {
  size_t begin = 0;
  while (begin < text.size() && std::isspace(static_cast<unsigned char>(text[begin]))) ++begin;
  text.remove_prefix(begin);
  double number = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), number);
  if (ec != std::errc() || number < 0 || !std::isfinite(number)) return std::nullopt;
  std::string unit(end, text.data() + text.size());
  std::erase_if(unit, [](char c) { return std::isspace(static_cast<unsigned char>(c)); });
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double scale = 1;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "KB") scale = 1e3;
  else if (unit == "MB") scale = 1e6;
  else if (unit == "GB") scale = 1e9;
  else if (unit == "TB") scale = 1e12;
  else if (unit == "K" || unit == "KIB") scale = 0x1p10;
  else if (unit == "M" || unit == "MIB") scale = 0x1p20;
  else if (unit == "G" || unit == "GIB") scale = 0x1p30;
  else if (unit == "T" || unit == "TIB") scale = 0x1p40;
  else return std::nullopt;
  const double nbytes = number * scale;
  if (nbytes > 1.8e19 || nbytes != std::floor(nbytes)) return std::nullopt;  // fractional bytes
  return static_cast<uint64_t>(nbytes);
}

uint64_t parse_size_or_throw(std::string_view text, std::string_view what) {
  if (auto size = parse_size(text)) return *size;
  raise(ErrorCategory::kBadArgument,
        "{}: \"{}\" is not a size (examples: 4096, 1e9, \"512KiB\", \"1GB\", \"4M\")", what, text);
}

std::string format_size(uint64_t nbytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(nbytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) value /= 1024, ++unit;
  if (unit == 0) return fmt::format("{} B", nbytes);
  return value == std::floor(value) ? fmt::format("{:.0f} {}", value, units[unit])
                                    : fmt::format("{:.2f} {}", value, units[unit]);
}

}  // namespace strata
