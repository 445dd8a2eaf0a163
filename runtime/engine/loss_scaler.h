// Loss scaling for fp16 training with DeepSpeed's semantics (its
// DynamicLossScaler; tests/data/golden/loss_scale.json holds trajectories of
// the real thing): the loss is multiplied by scale() before backward, the
// gradients are divided by it in the optimizer. A step whose gradients
// overflow is skipped and reported with update(true): the scale halves (not
// below min_scale) once `hysteresis` overflows have been absorbed; after
// `window` steps without overflow since the last one, it doubles. An overflow
// at the minimum scale is an error (DeepSpeed's raise_error_at_min_scale): the
// run cannot make progress and says so instead of skipping forever.
// A static scale (fp16.loss_scale > 0) never changes; bf16 and fp32 use 1.
//
// Thread-safety: a value type, one thread. Errors: the constructor throws
// Error(kBadArgument) naming the fp16 key for an invalid option; update()
// throws Error(kBadArgument) on an overflow at the minimum scale.
#pragma once

#include <cstdint>
#include <string>

namespace strata::engine {

struct LossScalerOptions {
  bool dynamic = true;          // false: static_scale, always
  double static_scale = 1.0;    // fp16.loss_scale when > 0
  int initial_scale_power = 16; // fp16.initial_scale_power: the first scale is 2^this
  int64_t window = 1000;        // fp16.loss_scale_window
  int hysteresis = 2;           // fp16.hysteresis: overflows absorbed before the scale drops
  double min_scale = 1.0;       // fp16.min_loss_scale
  bool consecutive_hysteresis = false;  // refill the hysteresis after every good step
};

class LossScaler {
 public:
  LossScaler() : LossScaler(LossScalerOptions{false, 1.0}) {}
  explicit LossScaler(const LossScalerOptions& options);

  double scale() const { return scale_; }
  // After a step: `overflow` is whether any rank's gradient was not finite.
  void update(bool overflow);

  // Everything update() depends on, for checkpoints.
  struct State {
    double scale = 1;
    int64_t iteration = 0, last_overflow_iteration = -1;
    int hysteresis_left = 0;
  };
  State state() const { return {scale_, iteration_, last_overflow_, hysteresis_left_}; }
  void restore(const State& state);
  std::string describe() const;  // one line for logs

 private:
  LossScalerOptions options_;
  double scale_ = 1;
  int64_t iteration_ = 0, last_overflow_ = -1;
  int hysteresis_left_ = 0;
};

}  // namespace strata::engine
