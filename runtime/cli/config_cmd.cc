// `strata config check|docs|defaults`: validate a configuration and show the
// effective one, print the key reference, or print every default.
#include <fmt/format.h>

#include <iostream>

#include "runtime/cli/commands.h"
#include "runtime/config/config.h"
#include "runtime/config/schema.h"

namespace strata::cli {

void add_config_command(CLI::App& app) {
  CLI::App* config = app.add_subcommand("config", "Validate configuration files and document their keys");
  config->require_subcommand(1);

  auto path = std::make_shared<std::string>();
  auto quiet = std::make_shared<bool>(false);
  CLI::App* check = config->add_subcommand(
      "check",
      "Validate a DeepSpeed-style JSON config. Prints the effective config (every default filled in) "
      "and exits 0 when valid; lists every problem and exits 1 otherwise.");
  check->add_option("FILE", *path, "Configuration file (JSON)")->required();
  check->add_flag("-q,--quiet", *quiet, "Print nothing when the file is valid");
  on_selected(check, [path, quiet] {
    try {
      const Config config = load_config_file(*path);
      if (!*quiet) {
        std::cout << config.effective.dump(2) << "\n";
        for (const auto& note : no_effect_notes(config)) std::cerr << "note: " << note << "\n";
        std::cerr << fmt::format("{}: valid\n", *path);
      }
      return 0;
    } catch (const ConfigError& e) {
      std::cerr << e.message() << "\n";
      return 1;
    }
  });

  CLI::App* docs = config->add_subcommand("docs", "Print the reference of every key (Markdown; docs/config.md)");
  on_selected(docs, [] {
    std::cout << config_reference_markdown();
    return 0;
  });

  CLI::App* defaults = config->add_subcommand("defaults", "Print the complete default configuration (JSON)");
  on_selected(defaults, [] {
    std::cout << default_config().effective.dump(2) << "\n";
    return 0;
  });
}

}  // namespace strata::cli
