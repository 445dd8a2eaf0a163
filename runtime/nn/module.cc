// Module base: parameter registration, fp32 widening of 16-bit storage, hooks.
#include "runtime/nn/module.h"

#include "runtime/core/error.h"

namespace strata::nn {

std::vector<Parameter*> Module::parameters() const {
  std::vector<Parameter*> out;
  for (const auto& p : own_) out.push_back(p.get());
  for (const Module* c : children_) {
    auto sub = c->parameters();
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

Parameter& Module::add_parameter(const std::string& local, DType dtype, Shape shape,
                                 std::optional<ParameterSlice> slice) {
  auto p = std::make_unique<Parameter>();
  p->name = child_name(local);
  p->desc.dtype = dtype;
  p->desc.shape = std::move(shape);
  p->slice = std::move(slice);
  engine_.register_parameter(*p);
  own_.push_back(std::move(p));
  return *own_.back();
}

const float* Module::load(const Parameter& p, std::vector<float>& scratch) {
  const TensorView v = engine_.data(p);
  STRATA_CHECK(v.data != nullptr && v.desc.tier != Tier::kNvme, kInternal,
               "parameter '{}' has no host-addressable data inside its hook window", p.name);
  if (v.desc.dtype == DType::kF32) return v.as<const float>();
  scratch.resize(static_cast<size_t>(v.numel()));
  convert(v.data, v.desc.dtype, scratch.data(), DType::kF32, scratch.size());
  return scratch.data();
}

float* Module::grad(const Parameter& p) {
  const TensorView g = engine_.grad(p);
  STRATA_CHECK(g.desc.dtype == DType::kF32 && g.data != nullptr, kInternal,
               "gradient of '{}' must be an fp32 host buffer", p.name);
  return g.as<float>();
}

void Module::pre(std::span<Parameter* const> params, bool backward) {
  if (backward) {
    engine_.pre_backward(name_, params);
  } else {
    engine_.pre_forward(name_, params);
  }
}

void Module::post(std::span<Parameter* const> params, bool backward) {
  if (backward) {
    engine_.post_backward(name_, params);
  } else {
    engine_.post_forward(name_, params);
  }
}

void check_numel(const std::string& module, const char* what, size_t got, size_t want) {
  STRATA_CHECK(got == want, kBadArgument, "{}: {} has {} elements, expected {}", module, what, got,
               want);
}

}  // namespace strata::nn
