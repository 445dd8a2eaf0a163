// The weight gradients a split backward defers (Zero Bubble's W; docs/DESIGN.md
// §5.4): while a DeferredWeightGrads is the engine's WeightGradSink, each
// Linear's backward computes only its input gradient and hands over its
// output gradient dy and input x, which are copied here on the compute
// stream (the model's backward scratch is reused by the next layer), and x
// too unless the inputs stay put until W (a model that keeps every layer's
// activations in the micro-batch's arena: not with activation
// checkpointing, whose layers share one set, nor sequence parallelism,
// whose inputs are gathered into scratch the layers share); run()
// later opens each projection's backward window and adds dy^T x (and the
// bias's sum of dy) into its gradients, in the order they came, and frees
// the copies.
//
// Ownership: borrows the engine; owns the copies (accelerator memory, freed
// stream-ordered). Thread-safety: the training thread. Errors: allocation
// failures (kOutOfMemory) at defer().
#pragma once

#include <cstddef>
#include <vector>

#include "runtime/engine/engine.h"

namespace strata::pipeline {

class DeferredWeightGrads final : public engine::Engine::WeightGradSink {
 public:
  // copy_inputs: x is copied too (see above).
  DeferredWeightGrads(engine::Engine& engine, bool copy_inputs) : engine_(engine), copy_inputs_(copy_inputs) {}
  ~DeferredWeightGrads() override;
  DeferredWeightGrads(const DeferredWeightGrads&) = delete;
  DeferredWeightGrads& operator=(const DeferredWeightGrads&) = delete;

  void defer(const ops::MatView& dy, const ops::MatView& x, engine::Engine::WeightGradFn weight_grads) override;
  // The deferred weight gradients, in order; then nothing is held.
  void run();
  bool empty() const { return held_.empty(); }
  // Bytes of copies held now, and at most since construction.
  size_t nbytes() const { return nbytes_; }
  size_t peak_nbytes() const { return peak_nbytes_; }

 private:
  struct Held {
    void* memory = nullptr;  // dy, then x
    size_t nbytes = 0;
    ops::MatView dy, x;
    engine::Engine::WeightGradFn weight_grads;
  };
  engine::Engine& engine_;
  bool copy_inputs_;
  std::vector<Held> held_;
  size_t nbytes_ = 0, peak_nbytes_ = 0;
};

}  // namespace strata::pipeline
