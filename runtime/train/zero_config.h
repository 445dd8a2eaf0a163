// The ZeroEngine's options from a checked ds_config: the one mapping from
// DeepSpeed's keys (zero_optimization, optimizer, gradient_clipping, fp16, aio) to
// engine::ZeroEngineOptions, shared by `strata finetune` and the C API
// (runtime/capi) so that the same config file means the same engine in both.
//
// Errors: Error(kBadArgument) naming `source` (the config's file name, or what
// it came from) and the key, for a config the engine cannot run: stage 0,
// two different NVMe paths, or options
// ZeroEngineOptions::validate rejects.
#pragma once

#include <string>

#include "runtime/config/config.h"
#include "runtime/engine/zero_engine.h"

namespace strata::train {

engine::ZeroEngineOptions zero_engine_options(const Config& config, const std::string& source);

}  // namespace strata::train
