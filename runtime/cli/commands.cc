// Dispatch from a parsed CLI11 app to the selected subcommand's handler.
#include "runtime/cli/commands.h"

#include <fmt/format.h>

#include <charconv>
#include <map>
#include <string>

namespace strata::cli {
namespace {
std::map<const CLI::App*, std::function<int()>>& handlers() {
  static std::map<const CLI::App*, std::function<int()>> instance;
  return instance;
}
// The whole text as a number of type T, or nullopt.
template <typename T>
bool parse_whole(const std::string& text, T& value) {
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  return ec == std::errc() && ptr == end && !text.empty();
}

}  // namespace

CLI::Validator whole_number(int64_t min, int64_t max) {
  const std::string range = max == std::numeric_limits<int64_t>::max() ? fmt::format(">= {}", min)
                                                                          : fmt::format("from {} to {}", min, max);
  return CLI::Validator(
      [min, max, range](std::string& text) -> std::string {
        int64_t value = 0;
        if (!parse_whole(text, value) || value < min || value > max) {
          return fmt::format("must be a whole number {}, got \"{}\"", range, text);
        }
        return {};
      },
      "INT " + range);
}

CLI::Validator whole_unsigned() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        uint64_t value = 0;
        if (!parse_whole(text, value)) {
          return fmt::format("must be a whole number from 0 to 18446744073709551615 (2^64 - 1), got \"{}\"", text);
        }
        return {};
      },
      "UINT");
}

void on_selected(CLI::App* command, std::function<int()> handler) {
  handlers()[command] = std::move(handler);
}

int run_selected(CLI::App& app) {
  // Walk down to the deepest selected subcommand ("config check").
  const CLI::App* selected = &app;
  for (;;) {
    auto subs = selected->get_subcommands();
    if (subs.empty()) break;
    selected = subs.front();
  }
  auto it = handlers().find(selected);
  if (it == handlers().end()) {
    std::fprintf(stderr, "%s\n", selected->help().c_str());
    return 2;
  }
  return it->second();
}

}  // namespace strata::cli
