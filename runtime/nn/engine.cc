// ResidentEngine: every parameter and its fp32 gradient live in host memory.
#include "runtime/nn/engine.h"

#include <cstring>

#include "runtime/core/error.h"

namespace strata::nn {

void ResidentEngine::register_parameter(Parameter& p) {
  STRATA_CHECK(p.id < 0, kBadArgument, "parameter '{}' is already registered (id {})", p.name,
               p.id);
  STRATA_CHECK(!by_name_.contains(p.name), kBadArgument, "parameter name '{}' registered twice",
               p.name);
  STRATA_CHECK(p.desc.numel() > 0, kBadArgument, "parameter '{}' has empty shape {}", p.name,
               shape_string(p.desc.shape));
  p.id = static_cast<int64_t>(params_.size());
  p.desc.tier = Tier::kCpu;
  data_.push_back(Tensor::host(p.desc.dtype, p.desc.shape));
  grads_.push_back(Tensor::host(DType::kF32, p.desc.shape));
  params_.push_back(&p);
  by_name_[p.name] = p.id;
}

const Parameter& ResidentEngine::checked(const Parameter& p) const {
  STRATA_CHECK(p.id >= 0 && p.id < static_cast<int64_t>(params_.size()) && params_[p.id] == &p,
               kBadArgument, "parameter '{}' is not registered with this engine", p.name);
  return p;
}

void ResidentEngine::notify(HookPhase phase, const std::string& module,
                            std::span<Parameter* const> params) {
  for (Parameter* p : params) checked(*p);
  if (observer_) observer_(phase, module, params);
}

void ResidentEngine::pre_forward(const std::string& module, std::span<Parameter* const> params) {
  notify(HookPhase::kPreForward, module, params);
}
void ResidentEngine::post_forward(const std::string& module, std::span<Parameter* const> params) {
  notify(HookPhase::kPostForward, module, params);
}
void ResidentEngine::pre_backward(const std::string& module, std::span<Parameter* const> params) {
  notify(HookPhase::kPreBackward, module, params);
}
void ResidentEngine::post_backward(const std::string& module, std::span<Parameter* const> params) {
  notify(HookPhase::kPostBackward, module, params);
}

TensorView ResidentEngine::data(const Parameter& p) {
  return data_[checked(p).id].view();
}
TensorView ResidentEngine::grad(const Parameter& p) {
  return grads_[checked(p).id].view();
}

void ResidentEngine::zero_grad() {
  for (Tensor& g : grads_) std::memset(g.data(), 0, g.nbytes());
}

Parameter& ResidentEngine::find(const std::string& name) const {
  auto it = by_name_.find(name);
  STRATA_CHECK(it != by_name_.end(), kBadArgument, "no parameter named '{}'", name);
  return *params_[it->second];
}

}  // namespace strata::nn
