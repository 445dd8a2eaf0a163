// Learning-rate schedules with DeepSpeed's `scheduler` semantics, as a pure
// function of the number of optimizer steps completed (skipped fp16 overflow
// steps do not count, as in DeepSpeed, which steps its scheduler only after a
// successful update). DeepSpeed's schedulers set the first update's rate at
// construction (iteration -1) and step after each update, so update k (0-based)
// uses the formula at iteration k - 1; `lr(k)` reproduces that exactly:
//   WarmupLR        min + (max - min) * gamma(i), gamma = log(i + 1) / log(W)
//                   (linear: i / W) while i < W, else 1; i = -1 gives min.
//   WarmupDecayLR   as WarmupLR in warmup, then gamma = max(0, (T - i) / max(1, T - W)).
//   WarmupCosineLR  base_lr * ratio: warmup_min_ratio + (1 - warmup_min_ratio) *
//                   gamma(i) in warmup; then cos_min_ratio + (1 - cos_min_ratio) *
//                   (1 + cos(pi * min(1, (i - W + 1) / max(1, T - W)))) / 2; i = -1 gives 0.
// with W = max(2, warmup_num_steps) and T = total_num_steps. kConstant is base_lr.
// Thread-safety: a value type. Errors: from_json throws Error(kBadArgument)
// naming the key for an unknown type, an unknown key or an out-of-range value.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace strata::engine {

struct LrSchedule {
  enum class Kind : uint8_t { kConstant, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR };
  Kind kind = Kind::kConstant;
  double base_lr = 1e-3;        // the optimizer's lr (constant, and cosine's scale)
  double warmup_min_lr = 0;     // WarmupLR / WarmupDecayLR
  double warmup_max_lr = -1;    // < 0: base_lr; from_json: WarmupLR's default is the
                                // optimizer's lr, WarmupDecayLR's 0.001 (DeepSpeed's)
  int64_t warmup_num_steps = 1000;
  bool linear_warmup = false;   // warmup_type "linear"; default "log"
  int64_t total_num_steps = 0;  // WarmupDecayLR / WarmupCosineLR
  double warmup_min_ratio = 0;  // WarmupCosineLR
  double cos_min_ratio = 1e-4;  // WarmupCosineLR

  // The rate of optimizer update number `completed_steps` (0 for the first).
  double lr(int64_t completed_steps) const;
  // From a DeepSpeed "scheduler" block ({"type": ..., "params": {...}}; null or
  // absent: constant) and the optimizer's lr. `where` prefixes messages.
  static LrSchedule from_json(const nlohmann::json& scheduler, double optimizer_lr,
                              const std::string& where = "scheduler");
  std::string describe() const;  // one line for logs
};

}  // namespace strata::engine
