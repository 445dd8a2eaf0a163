// Reading and writing Hugging Face Llama config.json.
#include "runtime/nn/llama_config.h"

#include <cstdint>
#include <fstream>

#include "runtime/config/json_describe.h"
#include "runtime/config/json_text.h"
#include "core/error.h"

namespace strata::nn {
namespace {

int64_t get_int(const nlohmann::json& j, const std::string& source, const char* key, bool required,
                int64_t fallback) {
  if (!j.contains(key) || j[key].is_null()) {
    STRATA_CHECK(!required, kBadArgument, "{}: required key '{}' is missing", source, key);
    return fallback;
  }
  STRATA_CHECK(j[key].is_number_integer(), kBadArgument, "{}: key '{}' must be an integer, got {}",
               source, key, describe_json(j[key]));
  // Above 2^63 - 1, get<int64_t>() would wrap to a negative number.
  STRATA_CHECK(!j[key].is_number_unsigned() || j[key].get<uint64_t>() <= uint64_t{INT64_MAX}, kBadArgument,
               "{}: key '{}' is {}, larger than any model dimension (at most 2^63 - 1)", source, key,
               describe_json(j[key]));
  return j[key].get<int64_t>();
}

double get_double(const nlohmann::json& j, const std::string& source, const char* key,
                  double fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  STRATA_CHECK(j[key].is_number(), kBadArgument, "{}: key '{}' must be a number, got {}", source,
               key, describe_json(j[key]));
  return j[key].get<double>();
}

bool get_bool(const nlohmann::json& j, const std::string& source, const char* key, bool fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  STRATA_CHECK(j[key].is_boolean(), kBadArgument, "{}: key '{}' must be true or false, got {}",
               source, key, describe_json(j[key]));
  return j[key].get<bool>();
}

}  // namespace

LlamaConfig parse_llama_config(const nlohmann::json& j, const std::string& source) {
  STRATA_CHECK(j.is_object(), kBadArgument, "{}: expected a JSON object", source);
  if (j.contains("hidden_act") && !j["hidden_act"].is_null()) {
    STRATA_CHECK(j["hidden_act"] == "silu", kBadArgument,
                 "{}: key 'hidden_act' is {}; only \"silu\" (SwiGLU) is supported", source,
                 describe_json(j["hidden_act"]));
  }
  if (j.contains("rope_scaling")) {
    STRATA_CHECK(j["rope_scaling"].is_null(), kBadArgument,
                 "{}: key 'rope_scaling' is {}; rope scaling is not supported (use null)", source,
                 describe_json(j["rope_scaling"]));
  }
  LlamaConfig c;
  c.vocab_size = get_int(j, source, "vocab_size", true, 0);
  c.hidden_size = get_int(j, source, "hidden_size", true, 0);
  c.intermediate_size = get_int(j, source, "intermediate_size", true, 0);
  c.num_hidden_layers = get_int(j, source, "num_hidden_layers", true, 0);
  c.num_attention_heads = get_int(j, source, "num_attention_heads", true, 0);
  c.num_key_value_heads = get_int(j, source, "num_key_value_heads", false, c.num_attention_heads);
  c.head_dim = get_int(j, source, "head_dim", false,
                       c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0);
  c.max_position_embeddings = get_int(j, source, "max_position_embeddings", false, 2048);
  c.rms_norm_eps = get_double(j, source, "rms_norm_eps", 1e-6);
  c.rope_theta = get_double(j, source, "rope_theta", 10000.0);
  // Newer transformers releases nest RoPE settings: {"rope_parameters":
  // {"rope_type": "default", "rope_theta": 500000.0}}. Read theta from there,
  // and refuse the scaled variants (llama3, yarn, ...) this model lacks.
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    const auto& rope = j["rope_parameters"];
    const std::string where = source + ": rope_parameters";
    STRATA_CHECK(rope.is_object(), kBadArgument, "{} must be an object, got {}", where, describe_json(rope));
    if (rope.contains("rope_type") && !rope["rope_type"].is_null()) {
      STRATA_CHECK(rope["rope_type"] == "default", kBadArgument,
                   "{}: rope_type {} is not supported (only \"default\": unscaled RoPE)", where,
                   describe_json(rope["rope_type"]));
    }
    c.rope_theta = get_double(rope, where, "rope_theta", c.rope_theta);
  }
  c.tie_word_embeddings = get_bool(j, source, "tie_word_embeddings", false);
  c.attention_bias = get_bool(j, source, "attention_bias", false);
  c.mlp_bias = get_bool(j, source, "mlp_bias", false);
  try {
    c.validate();
  } catch (const Error& e) {
    raise(ErrorCategory::kBadArgument, "{}: {}", source, e.message());
  }
  return c;
}

void LlamaConfig::validate() const {
  auto positive = [](const char* key, int64_t v) {
    STRATA_CHECK(v > 0, kBadArgument, "key '{}' must be positive, got {}", key, v);
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("intermediate_size", intermediate_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("num_key_value_heads", num_key_value_heads);
  positive("head_dim", head_dim);
  positive("max_position_embeddings", max_position_embeddings);
  STRATA_CHECK(num_attention_heads % num_key_value_heads == 0, kBadArgument,
               "key 'num_attention_heads' ({}) must be a multiple of 'num_key_value_heads' ({})",
               num_attention_heads, num_key_value_heads);
  STRATA_CHECK(head_dim % 2 == 0, kBadArgument,
               "key 'head_dim' ({}) must be even for rotary embedding", head_dim);
  STRATA_CHECK(rms_norm_eps > 0, kBadArgument, "key 'rms_norm_eps' must be positive, got {}",
               rms_norm_eps);
  STRATA_CHECK(rope_theta > 0, kBadArgument, "key 'rope_theta' must be positive, got {}",
               rope_theta);
  // parameter_count() and the model's shapes multiply these in int64; every
  // such product is at most the parameter count (or the RoPE table), so
  // bounding those two, estimated in double, keeps all of them exact.
  const double h = static_cast<double>(hidden_size), q = static_cast<double>(num_attention_heads) * head_dim,
               kv = static_cast<double>(num_key_value_heads) * head_dim, ff = static_cast<double>(intermediate_size);
  const double layer = 2 * h * q + 2 * h * kv + 3 * h * ff + 2 * ff + q + 2 * kv + 4 * h;
  const double parameters = static_cast<double>(vocab_size) * h * 2 + static_cast<double>(num_hidden_layers) * layer + h;
  constexpr double kMaxCount = 0x1p62;
  STRATA_CHECK(parameters < kMaxCount, kBadArgument,
               "the sizes give about {:.3g} parameters, beyond what strata counts (2^62): check vocab_size, "
               "hidden_size, intermediate_size, num_hidden_layers and the head counts",
               parameters);
  STRATA_CHECK(static_cast<double>(max_position_embeddings) * static_cast<double>(head_dim) < kMaxCount,
               kBadArgument, "key 'max_position_embeddings' ({}) x head_dim ({}) is beyond 2^62", max_position_embeddings,
               head_dim);
}

int64_t LlamaConfig::parameter_count() const {
  const int64_t h = hidden_size, q = num_attention_heads * head_dim,
                kv = num_key_value_heads * head_dim;
  int64_t attn = h * q + 2 * h * kv + q * h;
  if (attention_bias) attn += q + 2 * kv + h;
  int64_t mlp = 3 * h * intermediate_size;
  if (mlp_bias) mlp += 2 * intermediate_size + h;
  const int64_t layer = attn + mlp + 2 * h;
  return vocab_size * h * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * layer + h;
}

nlohmann::json LlamaConfig::to_json() const {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_act", "silu"},
          {"vocab_size", vocab_size},
          {"hidden_size", hidden_size},
          {"intermediate_size", intermediate_size},
          {"num_hidden_layers", num_hidden_layers},
          {"num_attention_heads", num_attention_heads},
          {"num_key_value_heads", num_key_value_heads},
          {"head_dim", head_dim},
          {"max_position_embeddings", max_position_embeddings},
          {"rms_norm_eps", rms_norm_eps},
          {"rope_theta", rope_theta},
          {"tie_word_embeddings", tie_word_embeddings},
          {"attention_bias", attention_bias},
          {"mlp_bias", mlp_bias}};
}

LlamaConfig load_llama_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) raise_errno(errno, "open model config " + path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    // The message quotes the input (a 1 MB token, raw bytes): bound and escape it.
    raise(ErrorCategory::kBadArgument, "{}: not valid JSON: {}", path, printable_excerpt(e.what(), 240));
  }
  return parse_llama_config(j, path);
}

void save_llama_config(const LlamaConfig& config, const std::string& path) {
  std::ofstream out(path);
  if (!out) raise_errno(errno, "create model config " + path);
  out << config.to_json().dump(2) << "\n";
  out.close();
  STRATA_CHECK(out.good(), kIo, "writing model config {} failed", path);
}

}  // namespace strata::nn
