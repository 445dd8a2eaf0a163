// The weight gradients a split backward defers (Zero Bubble's W; docs/DESIGN.md
// §5.4): while a DeferredWeightGrads is the engine's WeightGradSink, each
// Linear's backward computes only its input gradient and hands over its
// output gradient dy and input x. dy is copied here on the compute stream
// (the model's backward scratch is reused by the next layer); x is read in
// place when it lies in the memory the caller says stays untouched until W
// (keep(): the micro-batch's saved activations,
// DecoderModel::kept_activations) and copied otherwise (activation
// checkpointing's one shared set, sequence parallelism's gathered input,
// any scratch). run() later opens each projection's backward window and adds
// dy^T x (and the bias's sum of dy) into its gradients, in the order they
// came, and frees the copies.
//
// Ownership: borrows the engine; owns the copies (accelerator memory, freed
// stream-ordered). Thread-safety: the training thread. Errors: allocation
// failures (kOutOfMemory) at defer().
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "runtime/engine/engine.h"

namespace strata::pipeline {

class DeferredWeightGrads final : public engine::Engine::WeightGradSink {
 public:
  explicit DeferredWeightGrads(engine::Engine& engine) : engine_(engine) {}
  ~DeferredWeightGrads() override;
  DeferredWeightGrads(const DeferredWeightGrads&) = delete;
  DeferredWeightGrads& operator=(const DeferredWeightGrads&) = delete;

  // The memory that stays as it is until run() (empty: none; x is always copied).
  void keep(std::span<const std::byte> kept) { kept_ = kept; }
  void defer(const ops::MatView& dy, const ops::MatView& x, engine::Engine::WeightGradFn weight_grads) override;
  // The deferred weight gradients, in order; then nothing is held.
  void run();
  bool empty() const { return held_.empty(); }
  // Bytes of copies held now, and at most since construction; the inputs
  // read in place and copied since construction.
  size_t nbytes() const { return nbytes_; }
  size_t peak_nbytes() const { return peak_nbytes_; }
  int64_t inputs_in_place() const { return in_place_; }
  int64_t inputs_copied() const { return copied_; }

 private:
  struct Held {
    void* memory = nullptr;  // dy, then x
    size_t nbytes = 0;
    ops::MatView dy, x;
    engine::Engine::WeightGradFn weight_grads;
  };
  engine::Engine& engine_;
  std::span<const std::byte> kept_;
  int64_t in_place_ = 0, copied_ = 0;
  std::vector<Held> held_;
  size_t nbytes_ = 0, peak_nbytes_ = 0;
};

}  // namespace strata::pipeline
