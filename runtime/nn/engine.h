// The hook interface between runtime/nn modules and whatever manages parameter
// memory (DESIGN.md §3), plus ResidentEngine, which keeps every parameter and
// gradient in host memory. A module owns parameter *descriptors*; it asks the
// engine for the bytes only between a pre_* and the matching post_* hook, so an
// offloading engine can fetch before, and release or reduce after.
//
// Ownership: an Engine owns the storage of every parameter registered with it;
// Parameter objects belong to their modules and must outlive their registration.
// Thread-safety: not thread-safe; one training thread drives modules and hooks.
// Errors: strata::Error(kBadArgument) for unregistered parameters or data/grad
// requested outside a hook window; kOutOfMemory if storage cannot be allocated.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "runtime/core/tensor.h"

namespace strata::nn {

// Where a parameter sits when it is a block of a larger logical tensor (a
// TiledLinear tile of a Hugging Face weight): that tensor's name and shape,
// and the block's offset in each dimension. Used to load and save by HF name.
struct ParameterSlice {
  std::string tensor;
  Shape tensor_shape;
  std::vector<int64_t> offset;
};

// What a parameter is; no storage. `name` is the Hugging Face tensor name (or,
// for a tile, "<HF name>.tile_<o>_<i>" with `slice` saying where it belongs).
struct Parameter {
  std::string name;
  TensorDesc desc;  // storage dtype and shape
  int64_t id = -1;  // assigned by Engine::register_parameter
  std::optional<ParameterSlice> slice;
};

enum class HookPhase : uint8_t { kPreForward, kPostForward, kPreBackward, kPostBackward };

class Engine {
 public:
  virtual ~Engine() = default;

  // Takes note of a new parameter (assigns p.id) and creates its storage.
  virtual void register_parameter(Parameter& p) = 0;

  // Called by a module around each of its kernels with the parameters the
  // kernel reads. `module` is the module's full name ("model.layers.0.mlp.up_proj").
  // pre_forward/pre_backward: after it returns, data() is valid for `params`;
  // pre_backward also makes grad() valid. post_backward: the gradients of
  // `params` for this micro-batch are complete (an engine may reduce them).
  virtual void pre_forward(const std::string& module, std::span<Parameter* const> params) = 0;
  virtual void post_forward(const std::string& module, std::span<Parameter* const> params) = 0;
  virtual void pre_backward(const std::string& module, std::span<Parameter* const> params) = 0;
  virtual void post_backward(const std::string& module, std::span<Parameter* const> params) = 0;

  // The parameter's values (storage dtype, host-addressable for the cpu path).
  virtual TensorView data(const Parameter& p) = 0;
  // The parameter's fp32 gradient accumulator (same shape); kernels add into it.
  virtual TensorView grad(const Parameter& p) = 0;
};

// Keeps everything resident in host memory, zero-initialised. data() and grad()
// are valid at any time (the hooks only record what happened, which tests and
// tools read through set_hook_observer).
class ResidentEngine final : public Engine {
 public:
  using HookObserver =
      std::function<void(HookPhase, const std::string& module, std::span<Parameter* const> params)>;

  void register_parameter(Parameter& p) override;
  void pre_forward(const std::string& module, std::span<Parameter* const> params) override;
  void post_forward(const std::string& module, std::span<Parameter* const> params) override;
  void pre_backward(const std::string& module, std::span<Parameter* const> params) override;
  void post_backward(const std::string& module, std::span<Parameter* const> params) override;
  TensorView data(const Parameter& p) override;
  TensorView grad(const Parameter& p) override;

  // Sets every gradient to zero.
  void zero_grad();
  // Registered parameters in registration order.
  const std::vector<Parameter*>& parameters() const { return params_; }
  Parameter& find(const std::string& name) const;  // throws kBadArgument if unknown
  void set_hook_observer(HookObserver observer) { observer_ = std::move(observer); }

 private:
  void notify(HookPhase phase, const std::string& module, std::span<Parameter* const> params);
  const Parameter& checked(const Parameter& p) const;

  std::vector<Parameter*> params_;
  std::vector<Tensor> data_;   // by id
  std::vector<Tensor> grads_;  // by id, fp32
  std::map<std::string, int64_t> by_name_;
  HookObserver observer_;
};

}  // namespace strata::nn
