// `strata run -n N [--nnodes --node-rank --master-addr --master-port] -- CMD ARGS`.
#include <fmt/format.h>

#include <charconv>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "runtime/cli/commands.h"
#include "runtime/config/json_text.h"
#include "runtime/launcher/launcher.h"

namespace strata::cli {
namespace {

// An integer option in [lo, hi], with a message that says so (CLI11's own
// range checks print both bounds as doubles: "0.000000 to 1797...368.000000").
CLI::Validator integer_in(int64_t lo, int64_t hi) {
  const std::string range = hi == INT_MAX ? fmt::format(">= {}", lo) : fmt::format("in [{}, {}]", lo, hi);
  return CLI::Validator(
      [lo, hi, range](std::string& input) -> std::string {
        int64_t value = 0;
        const char* end = input.data() + input.size();
        const auto [stop, ec] = std::from_chars(input.data(), end, value);
        if (ec == std::errc() && stop == end && value >= lo && value <= hi) return "";
        return fmt::format("must be an integer {}, got '{}'", range, printable_excerpt(input, 40));
      },
      fmt::format("INT {}", range));
}

// Seconds >= 0; "inf" is accepted and means never.
CLI::Validator seconds() {
  return CLI::Validator(
      [](std::string& input) -> std::string {
        char* end = nullptr;
        const double value = std::strtod(input.c_str(), &end);
        if (!input.empty() && end == input.c_str() + input.size() && !std::isnan(value) && value >= 0) return "";
        return fmt::format("must be a number of seconds >= 0 (or inf), got '{}'", printable_excerpt(input, 40));
      },
      "SECONDS >= 0");
}

}  // namespace

void add_run_command(CLI::App& app) {
  auto options = std::make_shared<launcher::LaunchOptions>();
  CLI::App* run = app.add_subcommand(
      "run", "Start N local ranks of a data-parallel job (like torchrun): sets RANK, WORLD_SIZE, LOCAL_RANK, "
             "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; prefixes output with the rank; stops all ranks when "
             "one fails");
  run->add_option("-n,--nproc-per-node", options->nproc_per_node,
                  fmt::format("Ranks to start on this node (1 to {})", launcher::kMaxLocalRanks))
      ->required()
      ->check(integer_in(1, launcher::kMaxLocalRanks));
  run->add_option("--nnodes", options->nnodes, "Number of nodes (nnodes x N must stay below 2^31)")
      ->check(integer_in(1, INT_MAX));
  run->add_option("--node-rank", options->node_rank, "This node's index in [0, nnodes)")->check(integer_in(0, INT_MAX));
  run->add_option("--master-addr", options->master_addr, "Address of rank 0 (serves the rendezvous store)");
  run->add_option("--master-port", options->master_port,
                  "Port of the rendezvous store (default: a free port with one node, else 29500)")
      ->check(integer_in(0, 65535));
  run->add_option("--failure-grace", options->failure_grace_s,
                  "Seconds the other ranks get to finish on their own after one fails, before SIGTERM (inf: never)")
      ->check(seconds());
  run->add_option("--kill-delay", options->kill_delay_s, "Seconds between SIGTERM and SIGKILL (inf: never)")
      ->check(seconds());
  run->add_flag("!--no-prefix", options->prefix_output, "Do not prefix output lines with [rank N]");
  run->add_option("command", options->command, "Program and its arguments (after --)")->required();
  run->prefix_command(false);
  on_selected(run, [options] { return launcher::launch(*options); });
}

}  // namespace strata::cli
