// A PEFT LoRA adapter directory read back (`strata finetune --lora-init DIR`):
// what adapter_config.json says the adapter computes, as a LoraSpec, and where
// its weights are. Only plain LoRA is understood — r, lora_alpha, use_rslora,
// lora_dropout, target_modules over the decoder's projections, bias "none" —
// and every key that would make PEFT compute something else (DoRA, per-module
// rank or alpha patterns, modules_to_save, layer selection, LoRA biases,
// quantisation, any newer variant) is refused naming it unless it holds its
// neutral value (null, false, empty); keys that only describe the adapter
// (peft_version, task_type, base_model_name_or_path, its initialisation,
// settings of variants that are off) are not read.
// Errors: Error(kBadArgument / kIo) naming the file and the key.
#pragma once

#include <filesystem>

#include "runtime/nn/lora.h"

namespace strata::train {

struct PeftAdapter {
  nn::LoraSpec spec;
  std::filesystem::path weights;  // DIR/adapter_model.safetensors
};

PeftAdapter read_peft_adapter(const std::filesystem::path& dir);

}  // namespace strata::train
