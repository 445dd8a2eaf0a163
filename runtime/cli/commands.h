// Registration of the `strata` subcommands. Each add_*_command adds one
// subcommand to the app; when it is selected, its handler runs after parsing
// and its return value becomes the process exit code.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <limits>

namespace strata::cli {

// A check for a flag that takes a whole number in [min, max]: "0", "1.5",
// "1e23" and "-1" are refused with what the flag takes ("must be a whole number
// >= 1, got \"1.5\""), instead of CLI11's conversion messages.
CLI::Validator whole_number(int64_t min, int64_t max = std::numeric_limits<int64_t>::max());
// The same for an unsigned 64-bit value (a seed: 0 to 2^64 - 1).
CLI::Validator whole_unsigned();

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
void add_data_command(CLI::App& app);

}  // namespace strata::cli
