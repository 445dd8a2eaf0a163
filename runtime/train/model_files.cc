// read_model_files: the tokenizer, template and generation files of a model directory.
#include "runtime/train/model_files.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace strata::train {

ModelFiles read_model_files(const std::filesystem::path& dir, const nlohmann::json& config) {
  ModelFiles files;
  for (const char* name : kModelFileNames) {
    const std::filesystem::path path = dir / name;
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) continue;
    std::ifstream in(path, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    STRATA_CHECK(in.good() || in.eof(), kIo, "cannot read {}: {}", path.string(), std::strerror(errno));
    files[name] = text.str();
  }
  if (files.count("generation_config.json") == 0) {
    nlohmann::json generation = {{"_from_model_config", true}};
    for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"}) {
      if (config.contains(key) && !config[key].is_null()) generation[key] = config[key];
    }
    if (generation.size() > 1) files["generation_config.json"] = generation.dump(2) + "\n";
  }
  return files;
}

}  // namespace strata::train
