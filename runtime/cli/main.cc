// The `strata` command: one binary, subcommands registered by the files beside this one.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "runtime/cli/commands.h"
#include "runtime/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"strata: ZeRO-Infinity-style offloaded training runtime", "strata"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "strata 0.1.0");
  strata::cli::add_doctor_command(app);
  strata::cli::add_config_command(app);
  strata::cli::add_run_command(app);
  try {
    app.parse(argc, argv);
    return strata::cli::run_selected(app);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const strata::Error& e) {
    std::fprintf(stderr, "strata: %s\n", e.what());
    return 1;
  }
}
