// Base class of runtime/nn modules: a named node that DECLARES its parameters
// and operators with an Engine (engine/engine.h) and runs its kernels, through
// Ops, between the engine's hooks. Modules hold descriptors only — parameter
// and operator ids, shapes, hyper-parameters — never activations and never a
// copy of a weight: the caller (the model runner) passes every activation in
// as a view of its activation arena, and weights are read through
// engine.param() inside a hook window. So the same module code runs on the cpu
// and the cuda accelerator, resident or offloaded.
//
// Ownership: a module owns its children (unique_ptr members) and borrows the
// Engine, which must outlive it. Thread-safety: none; one thread drives a model.
// Errors: strata::Error (kBadArgument for shapes, naming the module); errors of
// enqueued work surface from the engine's compute stream.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/engine/engine.h"

namespace strata::nn {

using engine::OpId;
using engine::ParamId;
using engine::Phase;
using ops::MatView;

class Module {
 public:
  Module(engine::Engine& engine, std::string name) : engine_(engine), name_(std::move(name)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  const std::string& name() const { return name_; }
  // This module's parameters, then its children's, in declaration order.
  std::vector<ParamId> parameters() const;

 protected:
  // Declares "<name>.<local>".
  ParamId add_parameter(const std::string& local, DType dtype, Shape shape,
                        std::optional<engine::ParameterSlice> slice = std::nullopt);
  // Declares this tp rank's shard of "<name>.<local>" (full shape `full`),
  // split along dimension `dim` into equal blocks (ParamInfo::tp_split, with
  // the slice that places it): by default Engine::tensor_group().size blocks,
  // this rank's own; with `blocks` and `block` given, block `block` of
  // `blocks`, which `copies` consecutive tp ranks share (ParamInfo::tp_copies).
  // The caller checks that the count divides full[dim].
  ParamId add_tp_shard(const std::string& local, DType dtype, const Shape& full, size_t dim, int64_t blocks = 0,
                       int64_t block = 0, int copies = 1);
  // Declares an operator (one hook window) reading `params`; named after this
  // module unless `suffix` is given ("<name>.<suffix>").
  OpId add_operator(std::vector<ParamId> params, const std::string& suffix = "");
  void add_child(Module& child) { children_.push_back(&child); }
  std::string child_name(const std::string& local) const { return name_ + "." + local; }

  // Runs `body` (which enqueues kernels) inside op's hook window. If body
  // throws, the window is not closed and the error propagates: the step is
  // lost and the engine must not be used for another step.
  template <typename Body>
  void run(OpId op, Phase phase, Body&& body) {
    engine_.pre_op(op, phase);
    body();
    engine_.post_op(op, phase);
  }
  ops::Ops& ops() const { return engine_.ops(); }
  ops::ComputeContext& ctx() const { return engine_.compute(); }
  TensorView param(ParamId id) const { return engine_.param(id); }
  TensorView grad(ParamId id) const { return engine_.grad(id); }

  engine::Engine& engine_;
  std::string name_;

 private:
  std::vector<ParamId> own_;
  std::vector<Module*> children_;
};

// Throws Error(kBadArgument) naming `module` unless view's shape equals `want`.
void check_shape(const std::string& module, const char* what, const TensorView& view,
                 const Shape& want);

}  // namespace strata::nn
