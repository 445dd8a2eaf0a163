// `strata export CKPT DIR`: a finetune checkpoint as a Hugging Face directory.
// Run with the checkpoint's world size (`strata run -n N -- strata export`):
// each rank loads its own shards (checked against the manifest's sizes and
// CRC-32s, as --resume does) into a ZeroEngine of the model the manifest
// names, and the export streams tensor by tensor to rank 0
// (runtime/train/hf_export.h). No rank holds the whole model.
// Errors: Error naming the checkpoint for a missing or damaged one, or a world
// size that differs from the checkpoint's (with the command to use).
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include "runtime/train/hf_export.h"

namespace strata::train {

struct ExportCheckpointOptions {
  std::filesystem::path checkpoint;  // a --save directory (its newest checkpoint) or one step_<N> directory
  std::filesystem::path out;         // the Hugging Face directory to write
  std::string dtype;                 // fp32 | fp16 | bf16 | fp8 (hf_export.h); empty: the training dtype
  uint64_t shard_nbytes = 5'000'000'000;
  std::FILE* progress = stderr;      // rank 0's summary line; nullptr: none
};

ExportResult export_checkpoint(const ExportCheckpointOptions& options);

}  // namespace strata::train
