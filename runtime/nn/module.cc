// Module base: declarations through the engine.
#include "runtime/nn/module.h"

#include "core/error.h"

namespace strata::nn {

std::vector<ParamId> Module::parameters() const {
  std::vector<ParamId> out = own_;
  for (const Module* c : children_) {
    auto sub = c->parameters();
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

ParamId Module::add_parameter(const std::string& local, DType dtype, Shape shape,
                              std::optional<engine::ParameterSlice> slice) {
  const ParamId id =
      engine_.declare_parameter(engine::ParamInfo{child_name(local), dtype, std::move(shape),
                                                  std::move(slice)});
  own_.push_back(id);
  return id;
}

ParamId Module::add_tp_shard(const std::string& local, DType dtype, const Shape& full, size_t dim, int64_t blocks,
                             int64_t block, int copies) {
  const engine::Engine::TensorGroup& tp = engine_.tensor_group();
  if (blocks == 0) {
    blocks = tp.size;
    block = tp.rank;
  }
  STRATA_CHECK(dim < full.size() && blocks >= 1 && full[dim] % blocks == 0 && block >= 0 && block < blocks,
               kInternal, "{}.{}: dimension {} of {} does not split into {} tp blocks", name_, local, dim,
               shape_string(full), blocks);
  Shape shape = full;
  shape[dim] = full[dim] / blocks;
  std::vector<int64_t> offset(full.size(), 0);
  offset[dim] = shape[dim] * block;
  engine::ParamInfo info{child_name(local), dtype, shape,
                         engine::ParameterSlice{child_name(local), full, std::move(offset), {}, 0}};
  info.tp_split = true;
  info.tp_copies = copies;
  const ParamId id = engine_.declare_parameter(std::move(info));
  own_.push_back(id);
  return id;
}

OpId Module::add_operator(std::vector<ParamId> params, const std::string& suffix) {
  return engine_.declare_operator(suffix.empty() ? name_ : child_name(suffix), std::move(params));
}

void check_shape(const std::string& module, const char* what, const TensorView& view,
                 const Shape& want) {
  STRATA_CHECK(view.desc.shape == want, kBadArgument, "{}: {} has shape {}, expected {}", module,
               what, shape_string(view.desc.shape), shape_string(want));
}

}  // namespace strata::nn
