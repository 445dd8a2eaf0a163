// A Hugging Face model directory as strata reads it: config.json and the
// weights in model.safetensors, or sharded with model.safetensors.index.json
// (its weight_map names the file of each tensor). Loading streams file by
// file and tensor by tensor into each rank's owned ranges
// (Engine::for_each_owned_range): no rank holds a whole model.
// Errors: Error(kBadArgument/kIo) naming the directory or file and what is
// missing or wrong (no weights file, a tensor the index does not map, a shape
// that disagrees with config.json).
#pragma once

#include <filesystem>
#include <vector>

#include "runtime/engine/engine.h"
#include "runtime/nn/llama_config.h"

namespace strata::train {

// config.json of `dir`.
nn::LlamaConfig load_hf_config(const std::filesystem::path& dir);
// Every parameter in `params` from the directory's safetensors.
void load_hf_weights(engine::Engine& engine, const std::vector<engine::ParamId>& params,
                     const std::filesystem::path& dir);

}  // namespace strata::train
