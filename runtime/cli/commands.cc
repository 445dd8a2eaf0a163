// Dispatch from a parsed CLI11 app to the selected subcommand's handler.
#include "runtime/cli/commands.h"

#include <map>

namespace strata::cli {
namespace {
std::map<const CLI::App*, std::function<int()>>& handlers() {
  static std::map<const CLI::App*, std::function<int()>> instance;
  return instance;
}
}  // namespace

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
