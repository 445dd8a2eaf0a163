// Files the tests of `strata finetune` hand it, written into a TempDir: any
// text (a ds_config, a data file, a script), and the small model config.
#pragma once

#include <fstream>
#include <stdexcept>
#include <string>

#include "tests/support/temp_dir.h"

namespace strata::test {

// The example's folder: its data/ holds the text the finetune tests train on.
inline const std::string kFinetuneExamples = STRATA_SOURCE_DIR "/examples/finetune";

// Writes `text` to dir/name and returns the file's path.
inline std::string write_file(const TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = dir.file(name);
  std::ofstream out(path);
  out << text;
  if (!out.flush()) throw std::runtime_error("cannot write " + path);
  return path;
}

// A small version of the example model (2 layers of 64), so a run takes
// seconds: dir/small.json, returned.
inline std::string small_model(const TempDir& dir) {
  return write_file(dir, "small.json", R"({"vocab_size": 256, "hidden_size": 64, "intermediate_size": 176,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": false})");
}

}  // namespace strata::test
