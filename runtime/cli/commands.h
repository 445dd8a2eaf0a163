// Registration of the `strata` subcommands. Each add_*_command adds one
// subcommand to the app; when it is selected, its handler runs after parsing
// and its return value becomes the process exit code.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace strata::cli {

// Adds `handler` as what runs when `command` is selected.
void on_selected(CLI::App* command, std::function<int()> handler);
// Runs the handler of the selected subcommand; returns its exit code.
int run_selected(CLI::App& app);

void add_doctor_command(CLI::App& app);
void add_config_command(CLI::App& app);
void add_run_command(CLI::App& app);
void add_finetune_command(CLI::App& app);
void add_export_command(CLI::App& app);
void add_plan_command(CLI::App& app);

}  // namespace strata::cli
