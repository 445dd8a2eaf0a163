// The files beside the weights that make a Hugging Face directory a model
// people can use: the tokenizer (tokenizer.json and the slow tokenizers'
// files), its configuration and special tokens, the chat template and the
// generation config. finetune reads them from --model and carries them into
// the export and into each checkpoint's manifest (so `strata export` of a
// checkpoint writes them too); they are copied byte for byte, never edited.
//
// generation_config.json: the source's own; when it has none but config.json
// names bos/eos/pad token ids, one made from them as transformers makes it
// (GenerationConfig.from_model_config), so generate() stops at the model's
// end-of-sequence token.
//
// Errors: Error(kIo) naming the file when one that exists cannot be read.
#pragma once

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

namespace strata::train {

using ModelFiles = std::map<std::string, std::string>;  // file name -> contents

// The names carried, in the order they are looked for.
inline constexpr const char* kModelFileNames[] = {
    "tokenizer.json",     "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json",   "tokenizer.model",         "vocab.json",
    "merges.txt",         "generation_config.json"};

// Those of `dir` that exist; `config` is the source's config.json (for a generated generation_config.json).
ModelFiles read_model_files(const std::filesystem::path& dir, const nlohmann::json& config);

}  // namespace strata::train
