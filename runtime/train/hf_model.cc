// Reading a Hugging Face model directory (single or sharded safetensors).
#include "runtime/train/hf_model.h"

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "runtime/nn/llama_weights.h"

namespace strata::train {
namespace fs = std::filesystem;

nn::LlamaConfig load_hf_config(const fs::path& dir) {
  STRATA_CHECK(fs::is_directory(dir), kBadArgument, "--model {}: not a directory (expected a Hugging Face model "
               "directory with config.json and model.safetensors)", dir.string());
  const fs::path config = dir / "config.json";
  STRATA_CHECK(fs::exists(config), kBadArgument, "--model {}: no config.json", dir.string());
  return nn::load_llama_config(config.string());
}

void load_hf_weights(engine::Engine& engine, const std::vector<engine::ParamId>& params, const fs::path& dir) {
  const fs::path single = dir / "model.safetensors", index = dir / "model.safetensors.index.json";
  if (fs::exists(index) && fs::exists(single)) {
    // Two saves' weights (a re-export into the same directory by another
    // tool): loading either could be the stale one.
    raise(ErrorCategory::kBadArgument,
          "--model {}: holds both {} and {}, weights of two different saves; loaders pick one of them, so remove the "
          "stale one (or export again into an empty directory)",
          dir.string(), single.string(), index.string());
  }
  if (!fs::exists(index)) {
    STRATA_CHECK(fs::exists(single), kBadArgument, "--model {}: neither model.safetensors nor "
                 "model.safetensors.index.json is there", dir.string());
    nn::load_parameters(engine, params, single.string(), /*allow_unused=*/true);
    return;
  }
  nlohmann::json doc;
  {
    std::ifstream in(index);
    STRATA_CHECK(in.good(), kIo, "cannot read {}", index.string());
    doc = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  }
  STRATA_CHECK(doc.is_object() && doc.contains("weight_map") && doc["weight_map"].is_object(), kBadArgument,
               "{}: not a safetensors index (no \"weight_map\" object)", index.string());
  const auto& weight_map = doc["weight_map"];
  // Each parameter goes with the file its (untiled) tensor lives in.
  std::map<std::string, std::vector<engine::ParamId>> by_file;
  for (engine::ParamId id : params) {
    const auto& info = engine.param_info(id);
    const std::string& tensor = info.slice ? info.slice->tensor : info.name;
    auto it = weight_map.find(tensor);
    STRATA_CHECK(it != weight_map.end() && it->is_string(), kBadArgument,
                 "{}: the weight_map has no file for tensor '{}'", index.string(), tensor);
    const std::string file = it->get<std::string>();
    STRATA_CHECK(file.find('/') == std::string::npos && file != ".." && !file.empty(), kBadArgument,
                 "{}: tensor '{}' maps to '{}', which is not a file name in the directory", index.string(), tensor,
                 file);
    by_file[file].push_back(id);
  }
  for (const auto& [file, ids] : by_file) {
    nn::load_parameters(engine, ids, (dir / file).string(), /*allow_unused=*/true);
  }
}

}  // namespace strata::train
