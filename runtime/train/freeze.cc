#include "runtime/train/freeze.h"

#include <fnmatch.h>

#include "core/error.h"

namespace strata::train {

Frozen freeze_parameters(engine::Engine& engine, const std::vector<std::string>& patterns) {
  Frozen frozen;
  frozen.total_tensors = static_cast<int>(engine.parameter_count());
  if (patterns.empty()) return frozen;
  std::vector<bool> used(patterns.size(), false);
  for (engine::ParamId id = 0; id < engine.parameter_count(); ++id) {
    const engine::ParamInfo& info = engine.param_info(id);
    bool match = false;
    for (size_t k = 0; k < patterns.size(); ++k) {
      if (fnmatch(patterns[k].c_str(), info.name.c_str(), 0) == 0) match = used[k] = true;
    }
    if (!match) continue;
    engine.freeze(id);
    frozen.tensors += 1;
    frozen.elements += info.numel();
  }
  for (size_t k = 0; k < patterns.size(); ++k) {
    STRATA_CHECK(used[k], kBadArgument,
                 "--freeze '{}' matches no parameter of this model (its names are Hugging Face's, e.g. '{}'; a "
                 "pattern is a shell glob: '*' matches dots too)",
                 patterns[k], engine.parameter_count() > 0 ? engine.param_info(0).name : "");
  }
  STRATA_CHECK(frozen.tensors < frozen.total_tensors, kBadArgument,
               "--freeze freezes all {} parameters of the model: nothing would be trained", frozen.total_tensors);
  return frozen;
}

}  // namespace strata::train
