// Files the tests of `strata finetune` hand it, written into a TempDir: any
// text (a ds_config, a data file, a script), and the small model config.
#pragma once

#include <cstdint>
#include <fstream>
#include <stdexcept>
#include <string>

#include "tests/support/temp_dir.h"
#include "tests/support/test_paths.h"

namespace strata::test {

// The example's folder: its data/ holds the text the finetune tests train on.
inline const std::string kFinetuneExamples = strata::test::source_dir() + "/examples/finetune";

// Writes `text` to dir/name and returns the file's path.
inline std::string write_file(const TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = dir.file(name);
  std::ofstream out(path);
  out << text;
  if (!out.flush()) throw std::runtime_error("cannot write " + path);
  return path;
}

// A ds_config for small models in real runs: ZeRO-3 with 1000-element
// sub-groups and buckets (so a tiny model has several), parameters on NVMe
// in `swap`, the optimizer state there too unless `optimizer_on_nvme` is
// false (then on the accelerator), AdamW at 0.01 without weight decay, 2
// micro-batches per step, fp32 or bf16. Written to dir/name; returns its path.
inline std::string zero3_nvme_config(const TempDir& dir, const std::string& name, const std::string& swap,
                                     bool bf16 = false, bool optimizer_on_nvme = true) {
  return write_file(dir, name, std::string(R"({
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,)") +
                                   (bf16 ? R"( "bf16": {"enabled": true},)" : "") + R"(
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 3, "sub_group_size": 1000, "reduce_bucket_size": 1000,
      "offload_param": {"device": "nvme", "nvme_path": ")" + swap + "\"}" +
                                   (optimizer_on_nvme ? R"(,
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap + "\"}"
                                                      : std::string()) +
                                   "}}");
}

// A small version of the example model (2 layers of 64), so a run takes
// seconds: dir/small.json, returned.
inline std::string small_model(const TempDir& dir) {
  return write_file(dir, "small.json", R"({"vocab_size": 256, "hidden_size": 64, "intermediate_size": 176,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": false})");
}

// seq + 1 tokens as raw uint16 (token i = (7 i + 3) mod vocab) in
// dir/tokens.u16, returned: one window, so every step trains on the same
// batch and a later run's step can be compared with an earlier run's.
inline std::string one_window(const TempDir& dir, int vocab, int seq) {
  const std::string path = dir.file("tokens.u16");
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i <= seq; ++i) {
    const auto t = static_cast<uint16_t>((i * 7 + 3) % vocab);
    out.write(reinterpret_cast<const char*>(&t), sizeof t);
  }
  if (!out.good()) throw std::runtime_error("cannot write " + path);
  return path;
}

}  // namespace strata::test
