// The vocabulary the engine (runtime/engine) and the parameter coordinator
// (offload/) share: dense integer ids of parameters and operators, and the
// phase of a hook window. Names are for logs and files only; below runtime/
// a parameter is an id with a shape and bytes, never a model type.
#pragma once

#include <cstdint>
#include <string_view>

namespace strata::offload {

using ParamId = int32_t;
using OpId = int32_t;

// kRecompute: the forward of a checkpointed segment run again inside backward,
// fetched like forward.
enum class Phase : uint8_t { kForward, kBackward, kRecompute };
// "forward", "backward" or "recompute".
std::string_view phase_name(Phase phase);

}  // namespace strata::offload
