// The `strata` command: one binary, subcommands registered by the files beside this one.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <new>

#include "runtime/cli/commands.h"
#include "runtime/config/json_text.h"
#include "core/error.h"
#include "runtime/launcher/launcher.h"

int main(int argc, char** argv) {
  CLI::App app{"strata: ZeRO-Infinity-style offloaded training runtime", "strata"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "strata 0.1.0");
  strata::cli::add_doctor_command(app);
  strata::cli::add_config_command(app);
  strata::cli::add_run_command(app);
  strata::cli::add_finetune_command(app);
  strata::cli::add_export_command(app);
  strata::cli::add_plan_command(app);
  strata::cli::add_data_command(app);
  try {
    app.parse(argc, argv);
    return strata::cli::run_selected(app);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const strata::Error& e) {
    std::fprintf(stderr, "strata: %s\n", e.what());
    // A broken collective is most often a peer's failure: strata run names the rank that failed on its own.
    return e.category() == strata::ErrorCategory::kCommunication ? strata::launcher::kPeerFailedExitCode : 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "strata: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    // Not a strata::Error: a bug (every bad input should have been named), but
    // a message and exit code 1 rather than std::terminate and a core dump.
    std::fprintf(stderr, "strata: internal error: %s\n", strata::printable_excerpt(e.what(), 1000).c_str());
    return 1;
  }
}
