// Byte sizes written by people: 4096, 1e9, "1GB", "512MiB", "4 KiB".
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace strata {

// Parses a size. Decimal units (KB, MB, GB, TB = 10^3..) and binary units
// (KiB, MiB, GiB, TiB = 2^10..); "K"/"M"/"G"/"T" alone are binary, as in fio.
// Returns nullopt when `text` is not a size.
std::optional<uint64_t> parse_size(std::string_view text);
// Like parse_size, but throws Error(kBadArgument) naming `what` and the text.
uint64_t parse_size_or_throw(std::string_view text, std::string_view what);
// "1.5 GiB", "4 KiB", "512 B".
std::string format_size(uint64_t nbytes);

}  // namespace strata
