// DeepSpeed's dynamic loss scaling rule, step for step.
#include "runtime/engine/loss_scaler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace strata::engine {
namespace {
constexpr double kScaleFactor = 2.0;  // DeepSpeed's, fixed
}

LossScaler::LossScaler(const LossScalerOptions& options) : options_(options) {
  if (!options.dynamic) {
    STRATA_CHECK(options.static_scale > 0 && std::isfinite(options.static_scale), kBadArgument,
                 "fp16.loss_scale must be > 0 for a static scale, got {}", options.static_scale);
    scale_ = options.static_scale;
    return;
  }
  STRATA_CHECK(options.initial_scale_power >= 0 && options.initial_scale_power <= 64, kBadArgument,
               "fp16.initial_scale_power must be in [0, 64], got {}", options.initial_scale_power);
  STRATA_CHECK(options.window >= 1, kBadArgument, "fp16.loss_scale_window must be >= 1, got {}", options.window);
  STRATA_CHECK(options.hysteresis >= 1, kBadArgument, "fp16.hysteresis must be >= 1, got {}", options.hysteresis);
  STRATA_CHECK(options.min_scale > 0 && std::isfinite(options.min_scale), kBadArgument,
               "fp16.min_loss_scale must be > 0, got {}", options.min_scale);
  scale_ = std::ldexp(1.0, options.initial_scale_power);
  hysteresis_left_ = options.hysteresis;
}

void LossScaler::update(bool overflow) {
  if (!options_.dynamic) {
    ++iteration_;
    return;
  }
  if (overflow) {
    if (options_.hysteresis == 1 || hysteresis_left_ == 1) {
      if (scale_ == options_.min_scale) {
        raise(ErrorCategory::kBadArgument,
              "fp16: the gradients overflow at the minimum loss scale {} (step {}): training cannot make "
              "progress; lower the learning rate, use bf16, or lower fp16.min_loss_scale",
              options_.min_scale, iteration_ + 1);
      }
      scale_ = std::max(scale_ / kScaleFactor, options_.min_scale);
    } else {
      --hysteresis_left_;
    }
    last_overflow_ = iteration_;
  } else {
    if (options_.consecutive_hysteresis) hysteresis_left_ = options_.hysteresis;
    const int64_t stable = iteration_ - last_overflow_ - 1;
    if (stable > 0 && stable % options_.window == 0) {
      if (!options_.consecutive_hysteresis) hysteresis_left_ = options_.hysteresis;
      scale_ *= kScaleFactor;
    }
  }
  ++iteration_;
}

void LossScaler::restore(const State& state) {
  STRATA_CHECK(state.scale > 0 && std::isfinite(state.scale) && state.iteration >= 0 &&
                   state.last_overflow_iteration >= -1 && state.last_overflow_iteration < state.iteration + 1 &&
                   state.hysteresis_left >= 0,
               kBadArgument, "loss scaler state out of range (scale {}, iteration {}, last overflow {})",
               state.scale, state.iteration, state.last_overflow_iteration);
  scale_ = state.scale;
  iteration_ = state.iteration;
  last_overflow_ = state.last_overflow_iteration;
  hysteresis_left_ = state.hysteresis_left;
}

std::string LossScaler::describe() const {
  if (!options_.dynamic) return fmt::format("static loss scale {}", scale_);
  return fmt::format("dynamic loss scale from 2^{} (window {}, hysteresis {}, min {})", options_.initial_scale_power,
                     options_.window, options_.hysteresis, options_.min_scale);
}

}  // namespace strata::engine
