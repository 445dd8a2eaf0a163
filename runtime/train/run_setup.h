// What `strata finetune` settles about its resources before step 1, beside
// the job itself (finetune.cc): the directories the run owns, the pinned host
// memory it will hold against strata.pinned_pool_size, and what a quantized
// LoRA base keeps in its stored form.
//
// Thread-safety: one caller (a rank's training thread). Errors: Error
// (kBadArgument / kIo) naming the key or flag, as each function says.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/directory_lock.h"
#include "runtime/config/config.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/zero_options.h"
#include "runtime/nn/decoder_config.h"
#include "runtime/plan/runtime_memory.h"
#include "runtime/train/finetune.h"

namespace strata::train {

// Each rank's lock on the swap directory (when a tier is on NVMe) and on the
// checkpoint directory (--save, created if missing); the engine's swap spaces
// and the checkpoints share them. Error(kBadArgument) when another live run
// holds one, Error(kIo) when --save cannot be created.
std::vector<std::shared_ptr<DirectoryLock>> own_run_directories(const engine::ZeroEngineOptions& zero,
                                                                const FinetuneOptions& options, int rank);

// strata.pinned_pool_size: an upper bound of the page-locked host memory a
// rank holds, checked before any is allocated against what this runtime pins
// for `inputs` (runtime/plan/runtime_memory.h, item by item; layer-major's
// boundaries among them where they are pinned). Error(kBadArgument) naming
// `source`, the budget and every pinned item, and what would lower them.
void check_pinned_budget(const Config& config, const std::string& source, const plan::RuntimeInputs& inputs);

// Logs what LoRA's frozen base takes at home when a quantized checkpoint's
// weights stay in their stored form (ParamInfo::blocks: FP8 e4m3, MXFP4),
// against what they would take dequantized to the run's dtype.
void log_quantized_base(const engine::Engine& engine, const nn::DecoderConfig& config,
                        const engine::ZeroEngineOptions& zero);

}  // namespace strata::train
