// A Hugging Face model directory as strata reads it: config.json and the
// weights in model.safetensors, or sharded with model.safetensors.index.json
// (its weight_map names the file of each tensor). Loading streams file by
// file and tensor by tensor into each rank's owned ranges
// (Engine::for_each_owned_range): no rank holds a whole model.
//
// A quantized checkpoint (config.json's quantization_config: FP8 blocks,
// MXFP4) holds each quantized weight as its stored form and scales
// (nn/checkpoint_quant.h); the check and the load see it dequantized under
// its own name.
//
// The checkpoint must hold exactly the tensors the architecture uses
// (nn::hf_tensors): a tensor the model would not use means the checkpoint is
// another model than config.json says (a Qwen2 checkpoint labelled llama
// would lose its q/k/v biases), so it is refused, naming the tensor, before
// any work. So is a directory with a PEFT adapter (adapter_config.json),
// which transformers would apply on top. The only tensors let through are derived buffers that
// transformers itself ignores (rotary_emb.inv_freq) and, with
// tie_word_embeddings, an lm_head.weight identical to the embedding; the
// MTP modules and a gemma3 checkpoint's vision tower and projector are
// carried to the export untrained, with a notice naming how many.
// Errors: Error(kBadArgument/kIo) naming the directory or file and what is
// missing or wrong (no weights file, a tensor the index does not map, a shape
// that disagrees with config.json, an unused tensor).
#pragma once

#include <filesystem>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <vector>

#include "runtime/engine/engine.h"
#include "runtime/nn/decoder_config.h"

namespace strata::train {

// config.json of `dir`, after checking that the directory's safetensors hold
// exactly the tensors (names and shapes) that configuration uses. Reads the
// safetensors headers only (and, when tied, compares lm_head with the embedding).
nn::DecoderConfig load_hf_config(const std::filesystem::path& dir);
// The same check for a configuration already read.
void check_hf_checkpoint(const nn::DecoderConfig& config, const std::filesystem::path& dir);
// The tensors of the directory a model carries without training them: the
// MTP modules' and a gemma3 checkpoint's vision tower and projector
// (nn::is_carried_tensor), by name, with the file holding each.
std::map<std::string, std::filesystem::path> carried_hf_tensors(const nn::DecoderConfig& config,
                                                                const std::filesystem::path& dir);
// Asks the engine to keep block-quantized (Engine::store_blocks) each frozen
// parameter of `params` that is a whole tensor (not a tile or a tp shard)
// which the directory's checkpoint stores quantized under `quant` (FP8
// blocks, MXFP4), before finalize; load_hf_weights then writes their stored
// form and scales. Returns how many were asked (0 without quantization).
int64_t keep_quantized_frozen(engine::Engine& engine, const std::vector<engine::ParamId>& params,
                              const std::filesystem::path& dir, const nn::CheckpointQuant& quant);
// Every parameter in `params` from the directory's safetensors; a tensor no
// parameter claims (other than those above) is refused.
// `carried`: tensors the files may hold without a parameter (carried_hf_tensors').
// `quant`: config.json's quantization_config; its quantized weights are
// dequantized exactly into the parameters' dtype, range by range from the
// mapped files (nn/checkpoint_quant.h) -- or, for a parameter the engine keeps
// block-quantized (ParamInfo::blocks), written in its stored form (Engine::write_blocks).
// `names`: where the model's tensors sit in the files (nn::checkpoint_names).
void load_hf_weights(engine::Engine& engine, const std::vector<engine::ParamId>& params,
                     const std::filesystem::path& dir, const std::set<std::string>& carried = {},
                     const nn::CheckpointQuant& quant = {}, const nn::CheckpointNames& names = {});
// The identity of the directory's weights: each weights file (and the index
// when sharded) with its size and CRC-32, [{"file", "bytes", "crc32"}, ...]
// in name order. With checksums it reads every byte once; without, crc32 is
// 0 (for ranks that receive rank 0's instead of reading the files again).
nlohmann::json hf_weights_identity(const std::filesystem::path& dir, bool checksums = true);

}  // namespace strata::train
