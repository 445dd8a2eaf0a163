// Hugging Face Trainer-style configs: a ds_config written for the Trainer
// holds "auto" for the values the Trainer fills from its own arguments.
// strata finetune fills them from its flags of the same meaning, or refuses
// the key naming the flag that fills it — never a silent default:
//
//   key                                        filled from
//   train_micro_batch_size_per_gpu             --micro-batch
//   gradient_accumulation_steps                --grad-accum
//   train_batch_size                           micro-batch x grad-accum x world size (removed: derived)
//   optimizer.params.lr                        --lr
//   optimizer.params.weight_decay              --weight-decay
//   scheduler.params.warmup_max_lr             --lr
//   scheduler.params.warmup_min_lr             0 (as the Trainer)
//   scheduler.params.warmup_num_steps          --warmup-steps
//   scheduler.params.total_num_steps           --steps
//   bf16.enabled / fp16.enabled                --bf16 / --fp16 (absent: false)
//   zero_optimization.reduce_bucket_size       hidden_size^2 (as the Trainer, from the model)
//   zero_optimization.stage3_prefetch_bucket_size   0.9 x hidden_size^2
//   zero_optimization.stage3_param_persistence_threshold  10 x hidden_size
// Any other "auto" is refused, naming the key. A flag given beside an
// explicit value that differs is refused too (which one would the run use?);
// a flag whose key is absent sets it.
//
// Errors: ConfigError naming the source and every key that cannot be filled.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace strata {

struct TrainerFlags {
  std::optional<double> lr, weight_decay;
  std::optional<int64_t> micro_batch, grad_accum, warmup_steps;
  bool bf16 = false, fp16 = false;
  int64_t steps = 0;        // --steps (scheduler.params.total_num_steps)
  int64_t hidden_size = 0;  // the model's (the bucket sizes)
  bool override_values = false;  // a given flag replaces an explicit value (finetune's built-in defaults)
};

// The finetune flag that fills "auto" at `key` (a canonical config path), or
// nullptr when none does. parse_config (strata config check, plan, the C API,
// which have no such flags) refuses "auto" at those keys naming the flag,
// reads it as the default at the sizes the Trainer derives from the model or
// the batch (train_batch_size, the bucket sizes, warmup_min_lr), and refuses
// it anywhere else.
const char* trainer_flag_of(std::string_view key);
// Whether "auto" at `key` is a size the Trainer derives (read as the default by parse_config).
bool trainer_derived(std::string_view key);

// `document` with every "auto" filled and the flags applied.
nlohmann::json apply_trainer_flags(nlohmann::json document, const TrainerFlags& flags, const std::string& source);

}  // namespace strata
