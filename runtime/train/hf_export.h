// Export to a Hugging Face directory (docs/DESIGN.md §5.3): config.json (the
// source's model_type, architectures and every key it had, token ids included,
// never relabelled: DecoderConfig::to_hf_json), the source's tokenizer, chat
// template and generation config (ExportOptions::files) and the weights as safetensors in the dtype asked
// for, one file or, past `max_shard_nbytes`, sharded model-0000k-of-0000n.safetensors files with
// model.safetensors.index.json. Streams tensor by tensor: each tensor is
// gathered from the ranks' owned ranges (Engine::for_each_owned_range) to
// rank 0, converted and written in place (SafetensorsStreamWriter), so rank 0
// holds one tensor at a time and no rank holds the model. The directory is
// replaced whole (runtime/train/export_dir.h): the files are written durably
// into a staging directory that is swapped with `dir` in one rename at the
// end, so `dir` never holds weights of two exports (a stale model.safetensors
// beside new shards, or the reverse), and a failed export leaves the previous
// one as it was.
//
// Collective: every rank calls it with the same arguments, with no hook
// window open; `comm` must be idle (nothing else runs collectives on it).
// Errors: Error(kIo) naming the file; kBadArgument for a dtype that is not a
// float storage type; kCommunication from the gathers.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "partition/communicator.h"
#include "runtime/engine/engine.h"
#include "runtime/nn/decoder_config.h"
#include "runtime/nn/lora.h"
#include "runtime/train/model_files.h"

namespace strata::train {

// A LoRA run's adapters to merge into the weights they adapt.
struct LoraMerge {
  nn::LoraSpec spec;
  std::vector<engine::ParamId> adapters;  // every lora_A / lora_B parameter
};

struct ExportOptions {
  DType dtype = DType::kBF16;
  uint64_t max_shard_nbytes = 5'000'000'000;  // transformers' default max_shard_size, "5GB"
  // The source's tokenizer, chat template and generation config (model_files.h), written as they are.
  ModelFiles files;
  // Set: each weight W with an adapter is written as W + s B A (summed in
  // fp32, then converted to dtype once), what PEFT's merge_and_unload gives.
  std::optional<LoraMerge> merge;
  // Tensors copied byte for byte (their dtype and shape) from the safetensors
  // file named beside each, untrained (the MTP modules: hf_model.h's
  // carried_hf_tensors), into the last shard, a file of their own, which the
  // index (always written then) maps them to.
  std::map<std::string, std::filesystem::path> carried;
  // The source's quantization (config.json's quantization_config): a carried
  // FP8 weight is written dequantized in `dtype` and its scale grid dropped,
  // as the export's config.json has no quantization_config (unless fp8).
  nn::CheckpointQuant quant;
  // FP8 on request (--export-dtype fp8, docs/DESIGN.md §5.3): each weight
  // nn::fp8_export_weight names (what the source held in FP8; for another
  // source the decoder layers' linear projections, experts included) is
  // written e4m3 with its fp32 "<name>_scale_inv" grid, re-quantized from the
  // run's values per block of quant's weight_block_size (128 x 128 for a
  // source that was not FP8) by kernels/fp8_quantize.h, its scale_fmt's
  // rounding; the rest in `dtype` (bf16); carried tensors byte for byte,
  // scales included; config.json's quantization_config the source's (or
  // transformers' FineGrainedFP8 form naming what stays unquantized).
  bool fp8 = false;
  // Where the adapters go in adapter_model.safetensors (nn::checkpoint_names
  // of the model: PEFT's names on a gemma3 checkpoint's text model).
  nn::CheckpointNames names;
};

// Sets options.dtype (and options.fp8) from an export dtype as the flags
// spell it: fp32, fp16, bf16, or fp8 (the FP8 weights and bf16 for the rest);
// empty: `train_dtype`. `flag` names the flag in messages. Refused by name:
// other formats (int8, nf4, mxfp4, ...: strata writes no other quantization).
void set_export_dtype(ExportOptions& options, const std::string& name, DType train_dtype, const std::string& flag);
// What the export writes, for progress lines: "bf16", or "fp8 and bf16".
std::string export_dtype_label(const ExportOptions& options);

// What was written (rank 0; other ranks get the same file list).
struct ExportResult {
  std::vector<std::filesystem::path> files;  // safetensors files (and the index when sharded)
  uint64_t tensor_nbytes = 0;
};

// `tensor_comm`: with tensor parallelism, the tp group's communicator (`comm` is
// then the dp group's): each tp shard is gathered over dp, then over the tp
// group of dp rank 0, and written whole by job rank 0. `pipeline_comm`: with
// pipeline parallelism, the pp group's (`params` are this stage's): the
// stages' tensor lists are exchanged first, each tensor is assembled whole by
// its stage's first rank (dp rank 0, tp rank 0; a tied embedding by the first
// stage) and sent to job rank 0, which writes them all in stage order. A
// stage's other ranks wait in their next gather meanwhile (within the
// collective timeout).
ExportResult export_hf_model(engine::Engine& engine, partition::Communicator& comm, const nn::DecoderConfig& config,
                             const std::vector<engine::ParamId>& params, const std::filesystem::path& dir,
                             const ExportOptions& options, partition::Communicator* tensor_comm = nullptr,
                             partition::Communicator* pipeline_comm = nullptr);

// A LoRA adapter in PEFT's format, which PeftModel.from_pretrained loads onto
// the base: adapter_config.json (peft_type LORA, r, lora_alpha, use_rslora,
// target_modules, base_model_name_or_path = `base_model`, or null when
// empty) and adapter_model.safetensors (every adapter in fp32, named
// "base_model.model.<name>", options.names.adapter_name), plus options.files. The directory is replaced
// whole, as by export_hf_model. Collective, like export_hf_model;
// `pipeline_comm` as there (`adapters` are this stage's): every stage's
// adapters are written, in stage order.
ExportResult export_lora_adapter(engine::Engine& engine, partition::Communicator& comm, const nn::LoraSpec& spec,
                                 const std::vector<engine::ParamId>& adapters, const std::string& base_model,
                                 const std::filesystem::path& dir, const ExportOptions& options,
                                 partition::Communicator* pipeline_comm = nullptr);

}  // namespace strata::train
