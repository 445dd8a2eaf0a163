// The Hugging Face Llama model configuration (config.json) as strata reads it.
// Thread-safety: plain value type. Errors: parse/load throw strata::Error —
// kIo for an unreadable file, kBadArgument naming the key for a missing key,
// a wrong type, a value out of range or an unsupported feature.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace strata::nn {

struct LlamaConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // defaults to num_attention_heads when absent
  int64_t head_dim = 0;             // defaults to hidden_size / num_attention_heads
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  bool mlp_bias = false;

  // Parameters of the whole model (embedding, layers, final norm, lm_head).
  int64_t parameter_count() const;
  // Checks consistency (divisibility, positivity); throws kBadArgument naming the key.
  void validate() const;
  nlohmann::json to_json() const;
};

LlamaConfig parse_llama_config(const nlohmann::json& json,
                               const std::string& source = "config.json");
LlamaConfig load_llama_config(const std::string& path);
void save_llama_config(const LlamaConfig& config, const std::string& path);

}  // namespace strata::nn
