// `strata run -n N [--nnodes --node-rank --master-addr --master-port] -- CMD ARGS`.
#include "runtime/cli/commands.h"
#include "runtime/launcher/launcher.h"

namespace strata::cli {

void add_run_command(CLI::App& app) {
  auto options = std::make_shared<launcher::LaunchOptions>();
  CLI::App* run = app.add_subcommand(
      "run", "Start N local ranks of a data-parallel job (like torchrun): sets RANK, WORLD_SIZE, LOCAL_RANK, "
             "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; prefixes output with the rank; stops all ranks when "
             "one fails");
  run->add_option("-n,--nproc-per-node", options->nproc_per_node, "Ranks to start on this node")
      ->required()
      ->check(CLI::PositiveNumber);
  run->add_option("--nnodes", options->nnodes, "Number of nodes")->check(CLI::PositiveNumber);
  run->add_option("--node-rank", options->node_rank, "This node's index in [0, nnodes)")->check(CLI::NonNegativeNumber);
  run->add_option("--master-addr", options->master_addr, "Address of rank 0 (serves the rendezvous store)");
  run->add_option("--master-port", options->master_port,
                  "Port of the rendezvous store (default: a free port with one node, else 29500)")
      ->check(CLI::Range(0, 65535));
  run->add_option("--failure-grace", options->failure_grace_s,
                  "Seconds the other ranks get to finish on their own after one fails, before SIGTERM")
      ->check(CLI::NonNegativeNumber);
  run->add_option("--kill-delay", options->kill_delay_s, "Seconds between SIGTERM and SIGKILL")
      ->check(CLI::NonNegativeNumber);
  run->add_flag("!--no-prefix", options->prefix_output, "Do not prefix output lines with [rank N]");
  run->add_option("command", options->command, "Program and its arguments (after --)")->required();
  run->prefix_command(false);
  on_selected(run, [options] { return launcher::launch(*options); });
}

}  // namespace strata::cli
