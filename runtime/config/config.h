// Training configuration (DESIGN.md §7): a DeepSpeed-style JSON file checked
// against the schema (schema.h) and turned into typed structs with every
// default filled in. Loading either returns a complete, consistent Config or
// throws one ConfigError listing every problem found.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace strata {

enum class OffloadDevice { kNone, kCpu, kNvme };

// DeepSpeed's reduce_bucket_size default: what "auto" reads where the
// Trainer's hidden_size^2 cannot be known (no model: config check, the C API).
inline constexpr uint64_t kDeepSpeedReduceBucketNumel = 500'000'000;

struct AioConfig {
  std::string engine;       // uring | aio | psync
  uint64_t block_size = 0;  // bytes
  int queue_depth = 0;
  int thread_count = 0;
  bool single_submit = false;
  bool overlap_events = false;
  bool auto_tune = false;   // choose block_size and queue_depth online (nvme/online_tuner.h)
};

struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  bool pin_memory = false;
  int buffer_count = 0;
  uint64_t buffer_numel = 0;      // "buffer_size" (elements)
  uint64_t max_in_cpu_numel = 0;  // "max_in_cpu" (elements)
};

struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  bool pin_memory = false;
  int buffer_count = 0;
};

struct ZeroConfig {
  int stage = 0;
  OffloadParamConfig offload_param;
  OffloadOptimizerConfig offload_optimizer;
  // 0: the key was left out; the engine chooses it from the model's layers
  // at finalize (runtime/engine/zero_sizes.h).
  uint64_t sub_group_numel = 0;
  uint64_t reduce_bucket_numel = 0;
  bool overlap_comm = false;
  bool contiguous_gradients = false;
  uint64_t prefetch_bucket_numel = 0;
  uint64_t param_persistence_threshold_numel = 0;
  uint64_t max_live_parameters_numel = 0;
  uint64_t max_reuse_distance_numel = 0;
};

struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0;  // 0: dynamic
  int initial_scale_power = 0;
  int loss_scale_window = 0;
  int hysteresis = 0;
  double min_loss_scale = 0;
};

struct OptimizerConfig {
  std::string type;  // "Adam" or "AdamW"
  double lr = 0;
  std::array<double, 2> betas{};
  double eps = 0;
  double weight_decay = 0;
};

// DeepSpeed's csv_monitor and tensorboard sections: what rank 0 writes each step
// (runtime/train/monitors.h) under output_path/job_name/.
struct MonitorConfig {
  bool enabled = false;
  std::string output_path, job_name;
};

struct StrataOptions {
  std::string accelerator;  // auto | cpu | cuda
  uint64_t seed = 0;
  std::string log_level;
  double collective_timeout_s = 0;
  uint64_t pinned_pool_nbytes = 0;
  std::string trace_path;
  bool keep_swap_files = false;
  bool overlap_optimizer = true;
  // strata.micro_batch_order: step-major | layer-major | auto (docs/DESIGN.md §5.5).
  std::string micro_batch_order = "step-major";
  // strata.layer_major_boundaries: device | cpu (pinned host memory, within strata.pinned_pool_size) |
  // nvme (a file under the nvme tier's nvme_path, staged through pinned memory).
  std::string layer_major_boundaries = "device";
  // strata.layer_major_activations: recompute (each layer's forward again
  // before its backwards) | keep (every micro-batch's, no recompute) | auto
  // (keep where they fit: train::choose_layer_activations).
  std::string layer_major_activations = "auto";
  // Given as keep (auto's choice is the run's: train::choose_layer_activations).
  bool keeps_layer_activations() const { return layer_major_activations == "keep"; }
};

struct Config {
  int micro_batch_size = 0;             // train_micro_batch_size_per_gpu
  int gradient_accumulation_steps = 0;
  int64_t train_batch_size = 0;         // 0: derived
  double gradient_clipping = 0;
  int64_t steps_per_print = 0;
  bool bf16 = false;
  MonitorConfig csv_monitor, tensorboard;
  bool wandb_enabled = false;  // refused (no network): check_combinations
  Fp16Config fp16;
  OptimizerConfig optimizer;
  ZeroConfig zero;
  AioConfig aio;
  bool cpu_checkpointing = false;
  StrataOptions strata;
  // moe.expert_parallel_size; 0: not given — chosen with the model and the
  // world (train::choose_expert_parallel_size).
  int expert_parallel_size = 0;
  // moe.router_bias_update_rate: DeepSeek-V3's auxiliary-loss-free balancing
  // rate (nn::DecoderModel::update_correction_biases); 0: off.
  double router_bias_update_rate = 0;
  // tensor_parallel.autotp_size (1: none); sequence_parallel (Megatron's,
  // over the tensor-parallel ranks: the runner refuses it without them).
  int tensor_parallel_size = 1;
  bool sequence_parallel = false;
  // context_parallel.size (1: none) and .method ("ring" or "ulysses",
  // nn::parse_context_method).
  int context_parallel_size = 1;
  std::string context_parallel_method = "ring";
  // pipeline_parallel (runtime/pipeline): stages, schedule name, chunks per
  // rank, and layers per (virtual) stage (empty: as equal as possible).
  int pipeline_parallel_size = 1;
  std::string pipeline_schedule = "1f1b";
  int virtual_stages = 1;
  std::vector<int64_t> pipeline_layers;

  // The "scheduler" block as given (null when absent); turn it into a schedule
  // with engine::LrSchedule::from_json(scheduler, optimizer.lr), which applies
  // the defaults that depend on the type.
  nlohmann::json scheduler;
  // The complete configuration as JSON, every default filled in.
  nlohmann::json effective;
  // Keys given that strata accepts for compatibility but does not use.
  std::vector<std::string> no_effect_keys;
};

// Thrown when a configuration is invalid; what() lists every problem, one per line.
class ConfigError : public Error {
 public:
  ConfigError(std::string source, std::vector<std::string> problems);
  const std::vector<std::string>& problems() const { return problems_; }
  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::vector<std::string> problems_;
};

// Reads and checks a config file. Throws Error(kIo) if unreadable, ConfigError
// if invalid (JSON syntax errors name line and column).
// `filter`: applied to the parsed document before it is checked (finetune's
// "auto" values, runtime/config/trainer_flags.h).
using DocumentFilter = std::function<nlohmann::json(nlohmann::json)>;
// `frozen_parameters`: the run freezes parameters (LoRA, --freeze), so
// offload_param without offload_optimizer is a placement it can take (the
// trainable parameters stay on the accelerator with their optimizer; only the
// frozen ones are offloaded), and is not refused.
Config load_config_file(const std::string& path, const DocumentFilter& filter = {}, bool frozen_parameters = false);
// Checks a parsed document; `source` names it in messages.
Config parse_config(const nlohmann::json& document, std::string_view source = "config");
// Parses JSON text; syntax errors become ConfigError with line:column.
Config parse_config_text(std::string_view text, std::string_view source = "config",
                         const DocumentFilter& filter = {}, bool frozen_parameters = false);
// The configuration with every default (what an empty file gives).
Config default_config();

std::string_view offload_device_name(OffloadDevice device);

// One line per key of config.no_effect_keys: "KEY is a DeepSpeed key strata
// accepts but does not use: WHY" (the schema's reason). `strata config check`
// prints them; every run that builds an engine from the config logs them.
std::vector<std::string> no_effect_notes(const Config& config);

}  // namespace strata
