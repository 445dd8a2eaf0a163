// Base class of runtime/nn modules: a named node that owns parameter
// descriptors (registered with an Engine) and children, and brackets each
// kernel with the engine's hooks. Activations are fp32 host vectors; parameters
// may be stored as fp32, fp16 or bf16 and are widened to fp32 for compute.
//
// Ownership: a module owns its Parameter descriptors and never their storage
// (the Engine does); children are owned by their parent (unique_ptr members).
// A module saves what its backward needs during forward, so forward and
// backward alternate: one forward, then at most one backward.
// Thread-safety: none; one thread drives a model.
// Errors: strata::Error (kBadArgument for shape mismatches, naming the module).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "runtime/nn/engine.h"

namespace strata::nn {

using Activations = std::vector<float>;

class Module {
 public:
  Module(Engine& engine, std::string name) : engine_(engine), name_(std::move(name)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  const std::string& name() const { return name_; }
  // This module's parameters, then its children's, in construction order.
  std::vector<Parameter*> parameters() const;

 protected:
  // Creates and registers "<name>.<local>".
  Parameter& add_parameter(const std::string& local, DType dtype, Shape shape,
                           std::optional<ParameterSlice> slice = std::nullopt);
  void add_child(Module& child) { children_.push_back(&child); }
  // fp32 pointer to a parameter's values (between hooks): the storage itself
  // when it is fp32, else a widened copy in `scratch`.
  const float* load(const Parameter& p, std::vector<float>& scratch);
  float* grad(const Parameter& p);  // fp32 accumulator
  std::string child_name(const std::string& local) const { return name_ + "." + local; }

  // The engine hooks, named after this module. A kernel runs between pre and
  // post; if it throws, post is not called (the error propagates instead).
  void pre(std::span<Parameter* const> params, bool backward);
  void post(std::span<Parameter* const> params, bool backward);

  Engine& engine_;
  std::string name_;

 private:
  std::vector<std::unique_ptr<Parameter>> own_;
  std::vector<Module*> children_;
};

// Throws Error(kBadArgument) naming `module` unless got == want.
void check_numel(const std::string& module, const char* what, size_t got, size_t want);

}  // namespace strata::nn
