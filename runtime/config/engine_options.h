// The ZeroEngine's options from a ds_config: the one mapping from DeepSpeed's
// keys (zero_optimization, optimizer, gradient_clipping, fp16, aio) to
// engine::ZeroEngineOptions. parse_config runs it on every configuration it
// accepts and lists what the engine would refuse as problems of the
// configuration, so `strata config check`, finetune, the C API and `strata
// plan` accept exactly the same files, with the same messages.
//
// Errors: Error(kBadArgument) naming `source` (the config's file name, or
// what it came from) with ZeroEngineOptions::validate's message — for a
// Config that did not come from parse_config.
#pragma once

#include <optional>
#include <string>

#include "runtime/config/config.h"
#include "runtime/engine/zero_engine.h"

namespace strata {

engine::ZeroEngineOptions zero_engine_options(const Config& config, const std::string& source);
// What the engine would refuse in `config` (ZeroEngineOptions::validate's
// message), or nothing. parse_config lists it as a problem.
std::optional<std::string> engine_refusal(const Config& config);

}  // namespace strata
