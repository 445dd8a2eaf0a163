// `strata finetune --freeze PATTERN`: which parameters are not trained.
#pragma once

#include <string>
#include <vector>

#include "runtime/engine/engine.h"

namespace strata::train {

// What freeze_parameters froze.
struct Frozen {
  int tensors = 0;       // parameter tensors frozen
  int64_t elements = 0;  // their elements
  int total_tensors = 0;
};

// Freezes (Engine::freeze) every declared parameter whose Hugging Face name
// matches one of `patterns` (shell globs, fnmatch(3): "model.embed_tokens.*",
// "*norm*", "model.layers.[0-9].*"). Call before Engine::finalize.
// Error(kBadArgument) naming the flag and the pattern when a pattern matches
// no parameter (with an example name), or when nothing would be left to train.
Frozen freeze_parameters(engine::Engine& engine, const std::vector<std::string>& patterns);

}  // namespace strata::train
