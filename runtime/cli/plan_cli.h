// `strata plan`'s flags, shared by its two modes: planning a job
// (plan_cmd.cc, with plan_parallelism.cc and plan_micro_batch_order.cc;
// plan_resolved.h) and checking a finished run against its plan
// (plan_check_cmd.cc). Internal to runtime/cli.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace strata::cli::plan_cli {

// Every option is read as text and parsed here, so that each error names its
// flag and the text given (and a negative number is an error, not an option).
struct PlanOptions {
  std::string model, params, layers, hidden, heads, intermediate, vocab;
  std::string seq, batch, grad_accum, checkpoint_every, tiling;
  bool no_checkpointing = false;
  std::string config;
  std::string gpus, nodes, dp, gpu_mem, host_mem, nvme_path, nvme_capacity;
  std::string bw_gpu_cpu, bw_nvme, bw_nvme_write, bw_host_mem, bw_interconnect, peak_tflops;
  std::string target_efficiency;
  // LoRA (`strata finetune --lora-rank`): empty when not given.
  std::string lora_rank, lora_targets;
  // Tensor parallelism (`strata finetune --tp`, --sequence-parallel): empty / false when not given.
  std::string tp;
  bool sequence_parallel = false;
  // Pipeline parallelism (`strata finetune --pp`, --pp-schedule, --virtual-stages): empty when not given.
  std::string pp, pp_schedule, virtual_stages;
  // Context parallelism (`strata finetune --cp`, --cp-method): empty when not given.
  std::string cp, cp_method;
  // The micro-batch order (`strata finetune --micro-batch-order`): empty when not given.
  std::string micro_batch_order;
  std::string units = "GB";
  bool json = false;
  // --check RUN: the run directory (or its metrics.jsonl) to compare with.
  std::string check, tolerance = "15%", baseline_rss;
  bool checkpoint_activations = false;
};

// Error(kBadArgument): "FLAG: 'TEXT' is not EXPECTED".
[[noreturn]] void bad(const std::string& flag, const std::string& text, const std::string& expected);
// A finite number filling the whole text, or nothing.
std::optional<double> parse_number(std::string_view text);
// An integer >= min, else bad().
int64_t parse_integer(const std::string& flag, const std::string& text, int64_t min);
// A memory size: a bare number is GB (1e9 bytes); else a size with its unit
// (80GB, 80GiB, 512M; as in configs, K/M/G/T alone are binary).
double parse_memory(const std::string& flag, const std::string& text);

// `strata plan --check RUN` (plan_check_cmd.cc): the exit status.
int run_plan_check(const PlanOptions& options);

}  // namespace strata::cli::plan_cli
