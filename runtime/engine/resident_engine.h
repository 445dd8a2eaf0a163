// ResidentEngine: Engine v2 with every parameter and its fp32 gradient resident
// in accelerator memory (one flat buffer for the parameters, one for the
// gradients, as in llm.c), on cpu or cuda alike. Hooks only check and record;
// nothing moves. The reference the ZeRO engines are compared against.
//
// It also checks hook discipline: param(id) and grad(id) outside a window of an
// op that lists the parameter throw Error(kBadArgument) (a module that touched
// weights outside its hooks would break an offloading engine).
// Ownership, thread-safety, errors: see engine.h.
#pragma once

#include <functional>
#include <vector>

#include "runtime/engine/engine.h"

namespace strata::engine {

class ResidentEngine final : public Engine {
 public:
  explicit ResidentEngine(Accelerator& accelerator);
  ~ResidentEngine() override;

  void pre_op(OpId op, Phase phase) override;
  void post_op(OpId op, Phase phase) override;
  void sum_over_ranks(double* /*values*/, size_t /*count*/) override {}  // one rank
  TensorView param(ParamId id) override;
  TensorView grad(ParamId id) override;
  void zero_grad() override;
  void for_each_owned_range(ParamId id, Access access, const RangeFn& fn) override;

  // A parameter's storage and its gradient accumulator WITHOUT the hook-window
  // check, for an optimizer or a test that runs between steps: work that uses
  // them must be ordered after the compute stream's (synchronize it, or enqueue
  // on it). Accelerator memory (host-addressable only on the cpu accelerator).
  TensorView param_storage(ParamId id) const;
  TensorView grad_storage(ParamId id) const;

  // Sees every hook (pre = true for pre_op); for tests and tools.
  using HookObserver = std::function<void(OpId op, Phase phase, bool pre)>;
  void set_hook_observer(HookObserver observer) { observer_ = std::move(observer); }

  // Bytes of parameter and gradient storage.
  size_t param_nbytes() const { return param_flat_.nbytes(); }
  size_t grad_nbytes() const { return grad_flat_.nbytes(); }

 private:
  void on_finalize() override;
  TensorView stage_shared_grad(ParamId id) override { return grad_storage(id); }

  Tensor param_flat_, grad_flat_;  // bytes, accelerator memory
  std::vector<size_t> param_offset_, grad_offset_;
  std::unique_ptr<Event> backward_done_;
  HookObserver observer_;
};

}  // namespace strata::engine
