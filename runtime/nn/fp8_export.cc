// Which weights an FP8 export quantizes (runtime/nn/fp8_export.h).
#include "runtime/nn/fp8_export.h"

namespace strata::nn {

bool fp8_export_weight(const std::string& name, const Shape& shape, const CheckpointQuant& source) {
  constexpr std::string_view kLayers = "model.layers.", kWeight = ".weight";
  if (shape.size() != 2 || !name.starts_with(kLayers) || !name.ends_with(kWeight)) return false;
  const std::string module = name.substr(0, name.size() - kWeight.size());
  const std::string leaf = module.substr(module.rfind('.') + 1);
  if (leaf == "gate" || leaf == "router" || leaf == "shared_expert_gate" || leaf.find("norm") != std::string::npos) {
    return false;
  }
  return !source.not_converted(module);
}

}  // namespace strata::nn
