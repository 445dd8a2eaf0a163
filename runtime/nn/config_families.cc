// Reading config.json for each supported family, key by key, with the
// defaults transformers' configuration classes give an absent key (they
// differ: num_key_value_heads is 8 in Mistral and 32 in Qwen, head_dim 128 in
// Qwen3, sliding_window 4096 in Mistral). Every key of the file is either
// read here, or harmless, or refused: a Reader records what was read and
// sorts the rest at the end. Harmless are generic keys no model computation
// reads (dtype, generation settings, tool stamps), underscore-prefixed
// bookkeeping, special-token ids other than padding, and any key transformers'
// own code for the model_type never reads (transformers_config_keys.inc,
// generated from its configuration classes and modeling files by
// scripts/make-config-keys): those are logged once and kept in the export.
// A key transformers can compute with that strata does not read is refused
// by name.
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <string_view>

#include "core/error.h"
#include "core/log.h"
#include "runtime/config/json_describe.h"
#include "runtime/config/json_text.h"
#include "runtime/nn/decoder_config.h"

namespace strata::nn {
namespace {

using nlohmann::json;

std::string key_text(std::string_view key) {
  return printable_excerpt(key, 80);
}

// The config.json keys transformers' code for `model_type` can read
// (scripts/make-config-keys); null for a model_type the table does not hold.
const std::set<std::string_view>* transformers_keys(std::string_view model_type) {
  static const std::map<std::string_view, std::set<std::string_view>> kKeys = {
#include "runtime/nn/transformers_config_keys.inc"
  };
  // Kimi K2 ships model_type kimi_k2 with DeepseekV3ForCausalLM: transformers
  // computes it as deepseek_v3.
  const auto it = kKeys.find(model_type == "kimi_k2" ? std::string_view("deepseek_v3") : model_type);
  return it == kKeys.end() ? nullptr : &it->second;
}

// The keys of one config.json object, with what was read of them.
class Reader {
 public:
  // `model_type`: the family whose transformers key table decides what an
  // unread key is (empty: a nested object such as rope_parameters, where
  // every key must be read).
  Reader(const json& j, std::string where, std::string_view model_type = {})
      : j_(j), where_(std::move(where)), transformers_(transformers_keys(model_type)) {}
  const std::string& where() const { return where_; }
  bool present(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }
  bool contains(const char* key) const { return j_.contains(key); }
  // The value (null when absent), marked as read.
  const json& read(const char* key) {
    read_.insert(key);
    static const json kNull;
    return j_.contains(key) ? j_[key] : kNull;
  }
  // Marks a key as understood without using its value.
  void accept(const std::string& key) { read_.insert(key); }
  // Decides unread keys by the family's transformers key table from now on.
  void use_transformers_keys(std::string_view model_type) { transformers_ = transformers_keys(model_type); }

  int64_t integer(const char* key, std::optional<int64_t> fallback) {
    const json& v = read(key);
    if (v.is_null()) {
      STRATA_CHECK(fallback.has_value(), kBadArgument, "{}: required key '{}' is missing", where_, key);
      return *fallback;
    }
    STRATA_CHECK(v.is_number_integer(), kBadArgument, "{}: key '{}' must be an integer, got {}", where_,
                         key, describe_json(v));
    // Above 2^63 - 1, get<int64_t>() would wrap to a negative number.
    STRATA_CHECK(!v.is_number_unsigned() || v.get<uint64_t>() <= uint64_t{INT64_MAX}, kBadArgument,
                         "{}: key '{}' is {}, larger than any model dimension (at most 2^63 - 1)",
                         where_, key, describe_json(v));
    return v.get<int64_t>();
  }
  double number(const char* key, std::optional<double> fallback) {
    const json& v = read(key);
    if (v.is_null()) {
      STRATA_CHECK(fallback.has_value(), kBadArgument, "{}: required key '{}' is missing", where_, key);
      return *fallback;
    }
    STRATA_CHECK(v.is_number(), kBadArgument, "{}: key '{}' must be a number, got {}", where_, key,
                         describe_json(v));
    const double d = v.get<double>();
    STRATA_CHECK(std::isfinite(d), kBadArgument, "{}: key '{}' must be finite, got {}", where_, key,
                         describe_json(v));
    return d;
  }
  bool boolean(const char* key, bool fallback) {
    const json& v = read(key);
    if (v.is_null()) return fallback;
    STRATA_CHECK(v.is_boolean(), kBadArgument, "{}: key '{}' must be true or false, got {}", where_, key,
                         describe_json(v));
    return v.get<bool>();
  }
  // Whether transformers' code for the family can read `key` (true when
  // there is no table: a nested object is read whole).
  bool transformers_reads(std::string_view key) const {
    return transformers_ == nullptr || transformers_->contains(key);
  }
  // A key whose only supported value is `want` (or absent/null). A key
  // transformers never reads for this family is left to refuse_unread, which
  // lets it pass (transformers computes the same model whatever its value).
  void require(const char* key, const json& want, const std::string& why) {
    if (!transformers_reads(key)) return;
    const json& v = read(key);
    if (v.is_null() || v == want) return;
    // 0 and 0.0 are the same dropout.
    if (v.is_number() && want.is_number() && v.get<double>() == want.get<double>()) return;
    raise(ErrorCategory::kBadArgument, "{}: key '{}' is {}; {}", where_, key, describe_json(v),
          why);
  }
  // Every key not read: harmless ones pass (those transformers ignores are
  // logged once), the rest are refused by name; `reader` is the transformers
  // code that would read them.
  void refuse_unread(const std::string& model_type, const std::string& reader);

 private:
  const json& j_;
  std::string where_;
  const std::set<std::string_view>* transformers_;
  std::set<std::string, std::less<>> read_;
};

// Generic Hugging Face keys (PretrainedConfig's, generation settings, tool
// stamps) that no computation of these models reads: a training step is the
// same whatever their value.
bool harmless_key(std::string_view key) {
  static const std::set<std::string_view> kKeys = {
      // PretrainedConfig bookkeeping and outputs.
      "transformers_version", "torch_dtype", "dtype", "_name_or_path", "name_or_path",
      "_commit_hash", "use_cache", "initializer_range", "output_hidden_states", "output_attentions",
      "return_dict", "use_return_dict", "torchscript", "use_bfloat16", "tf_legacy_loss",
      "_attn_implementation", "attn_implementation", "_attn_implementation_autoset",
      "_experts_implementation", "is_decoder", "chunk_size_feed_forward", "problem_type",
      "finetuning_task", "id2label", "label2id", "num_labels", "tokenizer_class", "prefix",
      "task_specific_params", "cross_attention_hidden_size",
      // Special tokens (pad_token_id is read: it changes the embedding's gradient).
      "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id",
      // Generation settings of older configs.
      "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
      "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
      "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
      "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
      "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
      "suppress_tokens", "begin_suppress_tokens",
      // Llama's pretraining_tp splits a GEMM into slices (the same product);
      // nanotron and transformers.js stamps; fine-tuning tools' stamps.
      "pretraining_tp", "is_llama_config", "transformers.js_config", "unsloth_version",
      "unsloth_fixed"};
  return kKeys.contains(key);
}

// Keys no computation reads by construction: underscore-prefixed bookkeeping
// (_name_or_path, _model_name_or_path, ...) and special-token ids other than
// padding (unk_token_id, ...; pad_token_id is read: it changes the
// embedding's gradient).
bool bookkeeping_key(std::string_view key) {
  return key.starts_with('_') || (key.ends_with("_token_id") && key != "pad_token_id");
}

// Logs, once per process and key, that a config.json key passes unread.
void note_ignored(const std::string& where, const std::string& key, const std::string& why) {
  static std::mutex mutex;
  static std::set<std::string, std::less<>> noted;
  {
    const std::lock_guard lock(mutex);
    if (!noted.insert(key).second) return;
  }
  logger().info("{}: key '{}' {}; it passes unread and stays in the export", where, key_text(key), why);
}

void Reader::refuse_unread(const std::string& model_type, const std::string& reader) {
  for (auto it = j_.begin(); it != j_.end(); ++it) {
    const std::string& key = it.key();
    if (read_.contains(key) || harmless_key(key)) continue;
    if (transformers_ != nullptr && bookkeeping_key(key)) {
      note_ignored(where_, key, "is bookkeeping no model computation reads");
      continue;
    }
    if (!transformers_reads(key) && key != "auto_map") {
      note_ignored(where_, key, fmt::format("is not read by transformers' {}", reader));
      continue;
    }
    const json& v = it.value();
    if (key == "auto_map") {
      raise(ErrorCategory::kBadArgument,
            "{}: key 'auto_map' names custom modeling code, which transformers would run instead "
            "of its {}; "
            "strata computes {} only (remove auto_map if the model really is one)",
            where_, reader, reader);
    }
    if ((key == "is_encoder_decoder" || key == "add_cross_attention" ||
         key == "tie_encoder_decoder") &&
        v == false) {
      continue;
    }
    if (key == "pruned_heads" && (v.is_null() || v.empty())) continue;
    raise(ErrorCategory::kBadArgument,
          "{}: key '{}' is {}: transformers' {} can compute with it and strata does not read it "
          "for model_type \"{}\", so it refuses to train what might be another model",
          where_, key_text(key), describe_json(v), reader, model_type);
  }
}

// Model types people ask for that strata does not compute, with what they need.
std::string unsupported_reason(std::string_view model_type) {
  static const std::map<std::string_view, std::string_view> kReasons = {
      {"gemma", "Gemma needs GeGLU with gelu-tanh, (1 + w) RMSNorm and a scaled embedding"},
      {"phi3",
       "Phi-3 has fused qkv_proj and gate_up_proj weights and its own RoPE scaling (longrope)"},
      {"phi",
       "Phi has LayerNorm, GELU, a parallel attention/MLP block and partial rotary embedding"},
      {"olmo2",
       "OLMo 2 normalises after attention and MLP (post-norm) and has q/k norms over all heads"},
      {"olmo", "OLMo has non-parametric LayerNorm"},
      {"deepseek_v2", "DeepSeek-V2 is a mixture of experts with multi-head latent attention"},
      {"falcon", "Falcon has LayerNorm, GELU and a parallel attention/MLP block"},
      {"gpt2", "GPT-2 has learned positions, LayerNorm and GELU"},
      {"gpt_neox", "GPT-NeoX has LayerNorm, GELU, partial rotary embedding and a parallel block"},
      {"starcoder2", "StarCoder2 has LayerNorm, GELU and biases everywhere"},
      {"cohere", "Command-R has LayerNorm, a parallel block and logit scaling"},
      {"stablelm", "StableLM has LayerNorm and partial rotary embedding"},
      {"qwen2_vl", "Qwen2-VL has a vision tower and multimodal RoPE"},
      {"qwen2_5_vl", "Qwen2.5-VL has a vision tower and multimodal RoPE"},
      {"mllama", "Llama 3.2 Vision has a vision tower and cross-attention layers"},
  };
  const auto it = kReasons.find(model_type);
  return it == kReasons.end() ? std::string() : fmt::format(" ({})", it->second);
}

struct Family {
  const char* model_type;
  const char* architecture;  // the one architectures entry transformers builds it from
  std::optional<int64_t>
      kv_heads_default;  // absent num_key_value_heads; nullopt: num_attention_heads
  std::optional<int64_t> head_dim_default;  // nullopt: hidden_size / num_attention_heads
  int64_t max_positions_default;
};

constexpr Family kFamilies[] = {
    {"llama", "LlamaForCausalLM", std::nullopt, std::nullopt, 2048},
    {"mistral", "MistralForCausalLM", 8, std::nullopt, 4096 * 32},
    {"qwen2", "Qwen2ForCausalLM", 32, std::nullopt, 32768},
    {"qwen3", "Qwen3ForCausalLM", 32, 128, 32768},
    {"mixtral", "MixtralForCausalLM", 8, std::nullopt, 4096 * 32},
    {"qwen3_moe", "Qwen3MoeForCausalLM", 4, std::nullopt, 32768},
    {"qwen2_moe", "Qwen2MoeForCausalLM", 16, std::nullopt, 32768},
    {"deepseek_v3", "DeepseekV3ForCausalLM", std::nullopt, std::nullopt, 4096},
    {"kimi_k2", "DeepseekV3ForCausalLM", std::nullopt, std::nullopt, 4096},
    {"glm4_moe", "Glm4MoeForCausalLM", 8, std::nullopt, 131072},
    {"gemma2", "Gemma2ForCausalLM", 4, 256, 8192},
    {"gemma3_text", "Gemma3ForCausalLM", 4, 256, 131072},
    {"gpt_oss", "GptOssForCausalLM", 8, 64, 131072},
};

const Family& family_of(Reader& r) {
  const json& type = r.read("model_type");
  const json& archs = r.read("architectures");
  if (type.is_null()) {
    // strata's own sizes-only configs have neither; an HF config always has model_type.
    STRATA_CHECK(
        archs.is_null() || archs == json::array({"LlamaForCausalLM"}), kBadArgument,
        "{}: no model_type, but architectures is {}: give model_type (supported: {})", r.where(),
        describe_json(archs), supported_model_types());
    return kFamilies[0];
  }
  STRATA_CHECK(type.is_string(), kBadArgument, "{}: key 'model_type' must be a string, got {}", r.where(),
                       describe_json(type));
  const std::string name = type.get<std::string>();
  const Family* family = nullptr;
  for (const Family& f : kFamilies) {
    if (name == f.model_type) family = &f;
  }
  STRATA_CHECK(family != nullptr, kBadArgument,
                       "{}: model_type \"{}\" is not supported{}; strata fine-tunes model_type {}",
                       r.where(), key_text(name), unsupported_reason(name),
                       supported_model_types());
  if (!archs.is_null()) {
    STRATA_CHECK(
        archs == json::array({family->architecture}), kBadArgument,
        "{}: architectures is {} with model_type \"{}\"; strata trains [\"{}\"] (a causal language "
        "model with its lm_head) only",
        r.where(),
        archs.is_array() && archs.size() == 1 ? describe_json(archs[0]) : describe_json(archs),
        name, family->architecture);
  }
  return *family;
}

// The pre-training context of llama3 and yarn RoPE as transformers reads it:
// a top-level original_max_position_embeddings wins, then the rope's own,
// then max_position_embeddings.
double original_context(Reader& r, Reader& p, const DecoderConfig& c) {
  const double own = p.number("original_max_position_embeddings", static_cast<double>(c.max_position_embeddings));
  return r.number("original_max_position_embeddings", own);
}

// partial: as read_rope's (below).
ops::Rope read_rope_params(Reader& r, const json& params, const std::string& where, const DecoderConfig& c,
                           double theta, double* partial = nullptr);

// RoPE: transformers 5's rope_parameters, or rope_theta with the older
// rope_scaling (which wins when both are set; strata refuses the ambiguity).
// default_theta: the family's rope_theta when absent. partial: the
// families with partial rotary embedding (glm4_moe): in, the default
// partial_rotary_factor; out, the one the config gives (in rope_parameters,
// or at the top level as older configs write it). Null: the whole head
// rotates (a factor other than 1.0 is refused).
ops::Rope read_rope(Reader& r, const DecoderConfig& c, double default_theta = 10000.0, double* partial = nullptr) {
  ops::Rope rope;
  rope.theta = r.number("rope_theta", default_theta);
  const bool nested = r.present("rope_parameters"), legacy = r.present("rope_scaling");
  r.read("rope_parameters");
  r.read("rope_scaling");
  STRATA_CHECK(
      !(nested && legacy), kBadArgument,
      "{}: both 'rope_parameters' and 'rope_scaling' are set; give one (transformers would use "
      "rope_scaling)",
      r.where());
  const json* params = nested   ? &r.read("rope_parameters")
                       : legacy ? &r.read("rope_scaling")
                                : nullptr;
  const std::string where = r.where() + (nested ? ": rope_parameters" : ": rope_scaling");
  if (params != nullptr) rope = read_rope_params(r, *params, where, c, rope.theta, partial);
  if (partial != nullptr) {
    // A top-level factor (older configs) when rope_parameters gives none.
    const bool nested_factor = params != nullptr && params->contains("partial_rotary_factor");
    if (!nested_factor && r.present("partial_rotary_factor")) *partial = r.number("partial_rotary_factor", std::nullopt);
    r.accept("partial_rotary_factor");
  } else {
    r.require("partial_rotary_factor", 1.0, "strata rotates the whole head (1.0)");
  }
  return rope;  // its values are checked by DecoderConfig::validate
}

// One RoPE parameters object (rope_parameters, rope_scaling, or one layer
// type's entry of Gemma 3's); theta: rope_theta when the object has none.
ops::Rope read_rope_params(Reader& r, const json& params, const std::string& where, const DecoderConfig& c,
                           double theta, double* partial) {
  ops::Rope rope;
  rope.theta = theta;
  {
    STRATA_CHECK(params.is_object(), kBadArgument, "{} must be an object, got {}", where,
                         describe_json(params));
    Reader p(params, where);
    const json& type = p.present("rope_type") ? p.read("rope_type") : p.read("type");
    p.accept("type");
    const std::string name = type.is_null()     ? "default"
                             : type.is_string() ? type.get<std::string>()
                                                : "";
    STRATA_CHECK(
        name == "default" || name == "linear" || name == "llama3" || name == "yarn", kBadArgument,
        "{}: rope_type {} is not supported: strata computes \"default\", \"linear\", \"llama3\" and "
        "\"yarn\" RoPE (dynamic, longrope and the others change the frequencies with the sequence length or "
        "per dimension)",
        where, describe_json(type));
    rope.theta = p.number("rope_theta", rope.theta);
    if (partial != nullptr) {
      if (p.present("partial_rotary_factor")) *partial = p.number("partial_rotary_factor", std::nullopt);
      p.accept("partial_rotary_factor");
    } else {
      p.require("partial_rotary_factor", 1.0, "strata rotates the whole head (1.0)");
    }
    if (name == "linear") {
      rope.type = ops::RopeType::kLinear;
      rope.factor = p.number("factor", std::nullopt);
    } else if (name == "llama3") {
      rope.type = ops::RopeType::kLlama3;
      rope.factor = p.number("factor", std::nullopt);
      rope.low_freq_factor = p.number("low_freq_factor", std::nullopt);
      rope.high_freq_factor = p.number("high_freq_factor", std::nullopt);
      rope.original_max_position_embeddings = original_context(r, p, c);
    } else if (name == "yarn") {
      // transformers' _compute_yarn_parameters: factor is required (null: the
      // ratio of max_position_embeddings to the original context), the rest
      // optional; beta_fast/beta_slow 0 or null mean 32 and 1, mscale and
      // mscale_all_dim give the attention factor only when both are nonzero,
      // an explicit attention_factor overrides them.
      rope.type = ops::RopeType::kYarn;
      rope.original_max_position_embeddings = original_context(r, p, c);
      STRATA_CHECK(p.contains("factor"), kBadArgument, "{}: yarn needs key 'factor'", where);
      rope.factor = p.present("factor") ? p.number("factor", std::nullopt)
                                        : static_cast<double>(c.max_position_embeddings) /
                                              rope.original_max_position_embeddings;
      p.accept("factor");
      rope.beta_fast = p.number("beta_fast", 0.0);
      rope.beta_slow = p.number("beta_slow", 0.0);
      rope.mscale = p.number("mscale", 0.0);
      rope.mscale_all_dim = p.number("mscale_all_dim", 0.0);
      if (p.present("attention_factor")) {
        rope.attention_factor = p.number("attention_factor", std::nullopt);
        STRATA_CHECK(rope.attention_factor > 0, kBadArgument,
                     "{}: key 'attention_factor' is {}; it scales the rotary embedding and must be positive",
                     where, rope.attention_factor);
      }
      p.accept("attention_factor");
      rope.truncate = p.boolean("truncate", true);
    }
    p.refuse_unread(c.model_type, "RoPE (rope_type " + name + ")");
  }
  return rope;
}

// Mistral: sliding_window on every layer (default 4096 when absent, none when null).
void read_mistral_window(Reader& r, DecoderConfig& c) {
  if (!r.contains("sliding_window")) {
    c.sliding_window = 4096;  // MistralConfig's default
    r.accept("sliding_window");
  } else if (r.present("sliding_window")) {
    c.sliding_window = r.integer("sliding_window", std::nullopt);
    STRATA_CHECK(
        c.sliding_window > 0, kBadArgument,
        "{}: key 'sliding_window' is {}; a window holds at least one token (null: none)", r.where(),
        c.sliding_window);
  } else {
    r.accept("sliding_window");  // null: no window
  }
  if (r.present("layer_types")) {
    raise(ErrorCategory::kBadArgument,
          "{}: key 'layer_types' is set on a mistral model, which transformers' MistralForCausalLM "
          "does not read "
          "(it is a Ministral-style model with alternating layers); strata refuses it",
          r.where());
  }
  // use_sliding_window and max_window_layers (Qwen's) are not MistralConfig's:
  // transformers ignores them, and so do we (refuse_unread).
}

// Qwen2/Qwen3/Qwen2-MoE: use_sliding_window gates sliding_window; layer_types
// say which layers use it, or when absent the configuration class's rule:
// Qwen2Config and Qwen3Config slide the layers from max_window_layers on,
// Qwen2MoeConfig the even layers below max_window_layers.
void read_qwen_window(Reader& r, DecoderConfig& c, bool moe_layer_rule) {
  const bool use = r.boolean("use_sliding_window", false);
  const int64_t window =
      r.contains("sliding_window") ? r.integer("sliding_window", int64_t{0}) : 4096;
  const int64_t max_window_layers = r.integer("max_window_layers", int64_t{28});
  std::vector<bool> sliding;
  const json& types = r.read("layer_types");
  if (!types.is_null()) {
    STRATA_CHECK(
        types.is_array() && static_cast<int64_t>(types.size()) == c.num_hidden_layers, kBadArgument,
        "{}: key 'layer_types' must list one type per layer ({}), got {}", r.where(),
        c.num_hidden_layers, describe_json(types));
    for (const json& t : types) {
      STRATA_CHECK(
          t == "full_attention" || t == "sliding_attention", kBadArgument,
          "{}: layer_types holds {}; strata computes \"full_attention\" and \"sliding_attention\"",
          r.where(), describe_json(t));
      sliding.push_back(t == "sliding_attention");
    }
  } else {
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      sliding.push_back(use && window > 0 &&
                        (moe_layer_rule ? l % 2 == 0 && l < max_window_layers : l >= max_window_layers));
    }
  }
  bool any = false;
  for (bool s : sliding) any = any || s;
  if (!use) {
    STRATA_CHECK(!any, kBadArgument,
                         "{}: layer_types has sliding_attention layers but use_sliding_window is "
                         "false (transformers then "
                         "has no sliding_window to apply); strata refuses the contradiction",
                         r.where());
    return;
  }
  STRATA_CHECK(window > 0, kBadArgument, "{}: use_sliding_window is true but sliding_window is {}",
                       r.where(), window);
  if (!any) return;  // the window applies to no layer
  c.sliding_window = window;
  c.sliding_layers = std::move(sliding);
}

// The mixture of experts of mixtral, qwen3_moe and qwen2_moe, with their
// configuration classes' defaults. transformers maps num_experts to
// num_local_experts for mixtral and qwen3_moe (attribute_map), and
// save_pretrained writes num_local_experts; a file with both must agree.
// Qwen2MoeConfig has num_experts only (num_local_experts is an unknown key).
// num_local_experts, or num_experts (the alias transformers' attribute_map gives it).
int64_t read_local_experts(Reader& r, int64_t fallback) {
  const bool local = r.present("num_local_experts"), plain = r.present("num_experts");
  const int64_t a = r.integer("num_local_experts", fallback), b = r.integer("num_experts", fallback);
  STRATA_CHECK(!(local && plain) || a == b, kBadArgument,
               "{}: keys 'num_local_experts' ({}) and 'num_experts' ({}) disagree; transformers "
               "reads them as one", r.where(), a, b);
  return local ? a : b;
}

void read_moe(Reader& r, DecoderConfig& c, bool mixtral) {
  const bool qwen2_moe = c.model_type == "qwen2_moe";
  if (qwen2_moe) {
    c.num_experts = r.integer("num_experts", int64_t{60});
  } else {
    c.num_experts = read_local_experts(r, mixtral ? 8 : 128);
  }
  STRATA_CHECK(c.num_experts > 0, kBadArgument,
               "{}: the number of experts is {}; strata computes the sparse layers (a dense "
               "{} has no experts)", r.where(), c.num_experts, c.model_type);
  c.num_experts_per_tok = r.integer("num_experts_per_tok", mixtral ? 2 : qwen2_moe ? 4 : 8);
  c.router_aux_loss_coef = r.number("router_aux_loss_coef", 0.001);
  c.output_router_logits = r.boolean("output_router_logits", false);
  if (mixtral) {
    c.moe_intermediate_size = c.intermediate_size;
    c.norm_topk_prob = true;  // MixtralTopKRouter always divides by the top-k sum
    r.require("router_jitter_noise", json(0.0),
              "strata applies no router jitter (transformers multiplies the MoE input by noise in "
              "training when it is set)");
    return;
  }
  c.moe_intermediate_size = r.integer("moe_intermediate_size", qwen2_moe ? int64_t{1408} : int64_t{768});
  c.norm_topk_prob = r.boolean("norm_topk_prob", false);
  if (qwen2_moe) {
    c.shared_expert_intermediate_size = r.integer("shared_expert_intermediate_size", int64_t{5632});
    STRATA_CHECK(c.shared_expert_intermediate_size > 0, kBadArgument,
                 "{}: key 'shared_expert_intermediate_size' is {}; the shared expert has at least "
                 "one unit (strata computes Qwen2-MoE with its shared expert)",
                 r.where(), c.shared_expert_intermediate_size);
  }
  r.require("decoder_sparse_step", json(1),
            "strata computes every layer as a mixture of experts (1); dense layers in between are "
            "not implemented");
  const json& dense = r.read("mlp_only_layers");
  STRATA_CHECK(dense.is_null() || (dense.is_array() && dense.empty()), kBadArgument,
               "{}: key 'mlp_only_layers' is {}; strata computes every layer as a mixture of "
               "experts (dense layers in between are not implemented)",
               r.where(), describe_json(dense));
}

// The DeepSeek mixture of experts as DeepseekV3Config and Glm4MoeConfig
// read it (their defaults differ, `d`): the sigmoid router, shared experts,
// dense first layers, the MTP modules' count.
struct SigmoidMoeDefaults {
  int64_t experts, moe_intermediate, n_group, topk_group;
  double scaling;
  int64_t first_k_dense;
};

void read_sigmoid_moe(Reader& r, DecoderConfig& c, const SigmoidMoeDefaults& d) {
  // The experts (num_local_experts is DeepseekV3Config's alias of n_routed_experts).
  const bool routed = r.present("n_routed_experts"), local = r.present("num_local_experts");
  const int64_t a = r.integer("n_routed_experts", d.experts), b = r.integer("num_local_experts", d.experts);
  STRATA_CHECK(!(routed && local) || a == b, kBadArgument,
               "{}: keys 'n_routed_experts' ({}) and 'num_local_experts' ({}) disagree; transformers reads them as one",
               r.where(), a, b);
  c.num_experts = local && !routed ? b : a;
  STRATA_CHECK(c.num_experts > 0, kBadArgument, "{}: key 'n_routed_experts' is {}; strata computes the sparse layers",
               r.where(), c.num_experts);
  c.num_experts_per_tok = r.integer("num_experts_per_tok", int64_t{8});
  c.moe_intermediate_size = r.integer("moe_intermediate_size", d.moe_intermediate);
  const int64_t shared = r.integer("n_shared_experts", int64_t{1});
  STRATA_CHECK(shared >= 0, kBadArgument, "{}: key 'n_shared_experts' is {}", r.where(), shared);
  c.shared_expert_intermediate_size = shared * c.moe_intermediate_size;
  c.sigmoid_router = true;
  c.n_group = r.integer("n_group", d.n_group);
  c.topk_group = r.integer("topk_group", d.topk_group);
  c.routed_scaling_factor = r.number("routed_scaling_factor", d.scaling);
  c.norm_topk_prob = r.boolean("norm_topk_prob", true);
  c.first_k_dense_replace = r.integer("first_k_dense_replace", d.first_k_dense);
  // transformers' DeepseekV3 and Glm4Moe models add no load-balancing loss, whatever output_router_logits says.
  r.boolean("output_router_logits", false);
  r.accept("router_aux_loss_coef");
  const bool nextn = r.present("num_nextn_predict_layers"), mtp = r.present("num_mtp_layers");
  const int64_t n1 = r.integer("num_nextn_predict_layers", int64_t{1}), n2 = r.integer("num_mtp_layers", int64_t{1});
  c.mtp_layers = nextn ? n1 : mtp ? n2 : 1;
}

// DeepSeek-V3 and Kimi K2 (DeepseekV3Config's keys and defaults): multi-head
// latent attention and the DeepSeek mixture of experts (decoder_config.h).
// The file's head_dim is not read (DeepseekV3Config sets it to
// qk_rope_head_dim); scoring_func, topk_method, ep_size, moe_layer_freq of
// DeepSeek's own config are not DeepseekV3Config's keys (transformers
// ignores them: refuse_unread lets them pass).
void read_deepseek(Reader& r, DecoderConfig& c) {
  c.attention = AttentionKind::kMla;
  c.q_lora_rank = r.contains("q_lora_rank") ? r.integer("q_lora_rank", int64_t{0}) : 1536;
  STRATA_CHECK(c.q_lora_rank != 0 || !r.present("q_lora_rank"), kBadArgument,
               "{}: key 'q_lora_rank' is 0; null means q_proj (no low-rank query)", r.where());
  c.kv_lora_rank = r.integer("kv_lora_rank", int64_t{512});
  c.qk_nope_head_dim = r.integer("qk_nope_head_dim", int64_t{128});
  c.qk_rope_head_dim = r.integer("qk_rope_head_dim", int64_t{64});
  c.v_head_dim = r.contains("v_head_dim") ? r.integer("v_head_dim", int64_t{128}) : 128;
  r.accept("head_dim");  // DeepseekV3Config overwrites it with qk_rope_head_dim
  c.head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim;
  c.rope_interleave = r.boolean("rope_interleave", true);
  c.attention_qkv_bias = c.attention_o_bias = r.boolean("attention_bias", false);
  read_sigmoid_moe(r, c, {256, 2048, 8, 4, 2.5, 3});
  r.require("sliding_window", json(nullptr), "transformers' DeepseekV3ForCausalLM attends fully in every layer");
  // RoPE rotates the last qk_rope_head_dim dims of each q/k head (read_rope read the frequencies).
  c.rope.rotary_offset = c.qk_nope_head_dim;
  c.rope.rotary_dim = c.qk_rope_head_dim;
  c.rope.interleaved = c.rope_interleave;
}

// GLM-4.5 (Glm4MoeConfig's keys and defaults): grouped-query attention with
// q/k/v biases (attention_bias; o_proj never has one), optional per-head q/k
// norms (use_qk_norm), rotate_half RoPE on the first partial_rotary_factor
// of each head (default 0.5), and the DeepSeek mixture of experts.
void read_glm4_moe(Reader& r, DecoderConfig& c, double partial) {
  c.attention_qkv_bias = r.boolean("attention_bias", false);
  c.qk_norm = r.boolean("use_qk_norm", false);
  read_sigmoid_moe(r, c, {128, 1408, 1, 1, 1.0, 1});
  r.require("sliding_window", json(nullptr), "transformers' Glm4MoeForCausalLM attends fully in every layer");
  const double rotary = static_cast<double>(c.head_dim) * partial;
  STRATA_CHECK(partial > 0 && partial <= 1 && std::floor(rotary) == rotary && static_cast<int64_t>(rotary) % 2 == 0,
               kBadArgument,
               "{}: key 'partial_rotary_factor' is {}: head_dim {} x it must be an even number of dims (transformers "
               "takes int(head_dim x factor))",
               r.where(), partial, c.head_dim);
  c.rope.rotary_dim = static_cast<int64_t>(rotary);
}

// Gemma 3's RoPE: one per layer type. transformers 5 writes rope_parameters
// {"full_attention": {...}, "sliding_attention": {...}}; older configs give
// rope_theta (default 1e6) and rope_scaling for the full layers and
// rope_local_base_freq (default 1e4) for the sliding ones
// (Gemma3TextConfig.convert_rope_params_to_dict: the top-level keys fill in
// a theta the per-type entry lacks, rope_scaling updates the full layers').
void read_gemma3_rope(Reader& r, DecoderConfig& c) {
  const double full_theta = r.number("rope_theta", 1000000.0);
  const double local_theta = r.number("rope_local_base_freq", 10000.0);
  const json& nested = r.read("rope_parameters");
  if (nested.is_null()) {
    c.rope = read_rope(r, c, 1000000.0);  // rope_theta and rope_scaling
    c.sliding_rope = ops::Rope{};
    c.sliding_rope->theta = local_theta;
    return;
  }
  STRATA_CHECK(nested.is_object() && (nested.contains("full_attention") || nested.contains("sliding_attention")),
               kBadArgument,
               "{}: key 'rope_parameters' is {}; Gemma 3 takes one entry per layer type (\"full_attention\", "
               "\"sliding_attention\")",
               r.where(), describe_json(nested));
  STRATA_CHECK(!r.present("rope_scaling"), kBadArgument,
               "{}: both 'rope_parameters' and 'rope_scaling' are set; give one", r.where());
  r.accept("rope_scaling");
  for (auto it = nested.begin(); it != nested.end(); ++it) {
    STRATA_CHECK(it.key() == "full_attention" || it.key() == "sliding_attention", kBadArgument,
                 "{}: rope_parameters has an entry for '{}'; Gemma 3's layers are full_attention and "
                 "sliding_attention",
                 r.where(), key_text(it.key()));
  }
  const auto entry = [&](const char* type, double theta) {
    const json& e = nested.contains(type) && !nested[type].is_null() ? nested[type] : json::object();
    return read_rope_params(r, e, r.where() + ": rope_parameters." + type, c, theta);
  };
  c.rope = entry("full_attention", full_theta);
  c.sliding_rope = entry("sliding_attention", local_theta);
  r.require("partial_rotary_factor", 1.0, "strata rotates the whole head (1.0)");
}

// A soft cap: its value, 0 for null (none), the family's default when absent.
double read_softcap(Reader& r, const char* key, double fallback) {
  if (r.contains(key) && !r.present(key)) {
    r.accept(key);
    return 0;
  }
  const double cap = r.number(key, fallback);
  STRATA_CHECK(cap > 0 || (!r.present(key) && cap == 0), kBadArgument,
               "{}: key '{}' is {}; a soft cap is positive (null: none)", r.where(), key, cap);
  return cap;
}

// Which layers slide (Gemma 2 and 3, gpt-oss): layer_types, else all but
// every pattern-th layer (pattern 2: the even layers), with the window they use.
void read_layer_types(Reader& r, DecoderConfig& c, int64_t window, int64_t pattern) {
  std::vector<bool> sliding;
  const json& types = r.read("layer_types");
  if (!types.is_null()) {
    STRATA_CHECK(types.is_array() && static_cast<int64_t>(types.size()) == c.num_hidden_layers, kBadArgument,
                 "{}: key 'layer_types' must list one type per layer ({}), got {}", r.where(), c.num_hidden_layers,
                 describe_json(types));
    for (const json& t : types) {
      STRATA_CHECK(t == "full_attention" || t == "sliding_attention", kBadArgument,
                   "{}: layer_types holds {}; strata computes \"full_attention\" and \"sliding_attention\"",
                   r.where(), describe_json(t));
      sliding.push_back(t == "sliding_attention");
    }
  } else {
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) sliding.push_back((l + 1) % pattern != 0);
  }
  bool any = false;
  for (bool s : sliding) any = any || s;
  if (!any) return;
  STRATA_CHECK(window > 0, kBadArgument,
               "{}: layer_types has sliding_attention layers but sliding_window is {} (give the window)", r.where(),
               window);
  c.sliding_window = window;
  c.sliding_layers = std::move(sliding);
}

// Gemma 2 and Gemma 3 (gemma2, gemma3_text): everything their configuration
// classes and modeling code read besides the shared sizes, with their defaults.
void read_gemma(Reader& r, DecoderConfig& c) {
  const bool gemma3 = c.model_type == "gemma3_text";
  const json& act = r.read("hidden_activation");
  STRATA_CHECK(act.is_null() || act == "gelu_pytorch_tanh", kBadArgument,
               "{}: key 'hidden_activation' is {}; strata computes Gemma's GeGLU with gelu's tanh approximation "
               "(\"gelu_pytorch_tanh\")",
               r.where(), describe_json(act));
  c.hidden_act = ops::GluActivation::kGeluTanh;
  c.norm_weight_offset = 1;
  c.scale_embedding = true;
  c.sandwich_norms = true;
  c.qk_norm = gemma3;
  c.attention_qkv_bias = c.attention_o_bias = r.boolean("attention_bias", false);
  c.query_pre_attn_scalar = r.number("query_pre_attn_scalar", 256.0);
  STRATA_CHECK(c.query_pre_attn_scalar > 0, kBadArgument,
               "{}: key 'query_pre_attn_scalar' is {}; the scores are scaled by its inverse square root",
               r.where(), c.query_pre_attn_scalar);
  c.final_logit_softcapping = read_softcap(r, "final_logit_softcapping", gemma3 ? 0.0 : 30.0);
  if (gemma3) {
    // transformers' Gemma3Attention never passes attn_logit_softcapping to
    // its attention: whatever its value, the scores are not capped.
    r.accept("attn_logit_softcapping");
  } else {
    c.attn_logit_softcapping = read_softcap(r, "attn_logit_softcapping", 50.0);
  }
  r.require("use_bidirectional_attention", json(false),
            "strata trains causal language models (Gemma's bidirectional attention is for embeddings)");
  if (gemma3) {
    read_gemma3_rope(r, c);
  } else {
    c.rope = read_rope(r, c);
  }
  // The window and which layers slide: layer_types, else every other layer
  // (Gemma 2) or all but every sliding_window_pattern-th (Gemma 3, default 6).
  const int64_t window = r.contains("sliding_window") ? r.integer("sliding_window", int64_t{0}) : 4096;
  r.accept("sliding_window");
  const int64_t pattern = gemma3 ? r.integer("sliding_window_pattern", int64_t{6}) : 2;
  STRATA_CHECK(pattern > 0, kBadArgument, "{}: key 'sliding_window_pattern' is {}; it must be positive", r.where(),
               pattern);
  read_layer_types(r, c, window, pattern);
}

// gpt-oss (gpt_oss) as GptOssConfig reads it: attention biases and sinks, the
// stacked experts with their biases and clamped SwiGLU behind a biased
// router (softmax over the top k), sliding and full layers, and YaRN RoPE
// when the config gives none (GptOssConfig's __post_init__).
void read_gpt_oss(Reader& r, DecoderConfig& c) {
  c.attention_qkv_bias = c.attention_o_bias = r.boolean("attention_bias", true);
  c.attention_sinks = true;
  c.num_experts = read_local_experts(r, 128);
  STRATA_CHECK(c.num_experts > 0, kBadArgument, "{}: the number of experts is {}; gpt-oss has at least one",
               r.where(), c.num_experts);
  c.num_experts_per_tok = r.integer("num_experts_per_tok", int64_t{4});
  c.router_aux_loss_coef = r.number("router_aux_loss_coef", 0.001);
  c.output_router_logits = r.boolean("output_router_logits", false);
  c.moe_intermediate_size = c.intermediate_size;  // GptOssExperts: intermediate_size per expert
  c.norm_topk_prob = true;  // GptOssTopKRouter: softmax over the top-k logits
  c.router_bias = true;
  c.stacked_experts = true;
  c.expert_act = ops::GluActivation::kClampedSwiglu;
  // The kernels compute in float: a value beyond float's range is refused, not cast (undefined).
  const auto single = [&](const char* key, double fallback) {
    const double v = r.number(key, fallback);
    STRATA_CHECK(std::abs(v) <= std::numeric_limits<float>::max(), kBadArgument,
                 "{}: key '{}' is {}, beyond a float's range", r.where(), key, v);
    return static_cast<float>(v);
  };
  c.glu_clamp.alpha = single("swiglu_alpha", 1.702);
  c.glu_clamp.limit = single("swiglu_limit", 7.0);
  const bool own_rope = r.present("rope_parameters") || r.present("rope_scaling");
  c.rope = read_rope(r, c, 150000.0);
  if (!own_rope) {
    // GptOssConfig's default rope_parameters (rope_theta as given, else 150000).
    c.rope.type = ops::RopeType::kYarn;
    c.rope.factor = 32.0;
    c.rope.beta_fast = 32.0;
    c.rope.beta_slow = 1.0;
    c.rope.truncate = false;
    c.rope.original_max_position_embeddings = 4096;
  }
  const int64_t window = r.contains("sliding_window") ? r.integer("sliding_window", int64_t{0}) : 128;
  r.accept("sliding_window");
  read_layer_types(r, c, window, 2);
}

}  // namespace

namespace {

// The parameters of a gemma3 checkpoint's vision tower (transformers'
// SiglipVisionModel from vision_config, with SiglipVisionConfig's defaults)
// and multi-modal projector (mm_input_projection_weight [vision hidden, text
// hidden] and the soft embedding norm): strata carries them untrained and
// counts them for the checkpoint's size.
int64_t vision_parameter_count(const json& v, int64_t text_hidden, const std::string& source) {
  const std::string where = source + ": vision_config";
  const json& object = v.is_null() ? json::object() : v;
  STRATA_CHECK(object.is_object(), kBadArgument, "{} must be an object, got {}", where, describe_json(v));
  STRATA_CHECK(!object.contains("model_type") || object["model_type"] == "siglip_vision_model", kBadArgument,
               "{}: model_type is {}; Gemma 3's vision tower is \"siglip_vision_model\"", where,
               describe_json(object["model_type"]));
  const auto size = [&](const char* key, int64_t fallback) {
    const json& x = object.contains(key) ? object[key] : json(fallback);
    STRATA_CHECK(x.is_number_integer() && x.get<int64_t>() > 0 && x.get<int64_t>() < (int64_t{1} << 31), kBadArgument,
                 "{}: key '{}' must be a positive integer, got {}", where, key, describe_json(x));
    return x.get<int64_t>();
  };
  const int64_t h = size("hidden_size", 768), inner = size("intermediate_size", 3072),
                layers = size("num_hidden_layers", 12), channels = size("num_channels", 3),
                image = size("image_size", 224), patch = size("patch_size", 16);
  const json& head = object.contains("vision_use_head") ? object["vision_use_head"] : json(true);
  STRATA_CHECK(head.is_boolean(), kBadArgument, "{}: key 'vision_use_head' must be true or false, got {}", where,
               describe_json(head));
  // In 128-bit integers (each size below 2^31, no term overflows), checked against int64's range.
  __extension__ typedef __int128 Wide;  // a GCC/Clang extension (-Wpedantic)
  const Wide H = h, side = image / patch, mlp = H * inner + inner + Wide{inner} * h + h;
  Wide n = H * channels * patch * patch + h  // patch_embedding (a convolution with a bias)
           + side * side * h                  // position_embedding
           + Wide{layers} * (2 * 2 * H + 4 * (H * h + h) + mlp)  // two LayerNorms, q/k/v/out, fc1/fc2
           + 2 * H;                                               // post_layernorm
  if (head.get<bool>()) n += H + 3 * H * h + 3 * H + H * h + h + 2 * H + mlp;  // the pooling head
  n += H * text_hidden + h;  // the projector
  STRATA_CHECK(n <= INT64_MAX, kBadArgument, "{}: the vision tower's sizes give more than 2^63 parameters", where);
  return static_cast<int64_t>(n);
}

// A gemma3 config.json (Gemma3ForConditionalGeneration): its text model is
// text_config read as gemma3_text (Gemma3Config builds a Gemma3TextConfig
// from it whatever its model_type says), tied by the top level's
// tie_word_embeddings (default true: transformers ties by the top level's);
// the vision tower's config passes unread (strata never runs it, its weights
// are carried to the export), and so do the keys only images use.
DecoderConfig parse_gemma3(const json& j, const std::string& source) {
  Reader r(j, source);
  r.read("model_type");
  const json& archs = r.read("architectures");
  STRATA_CHECK(archs.is_null() || archs == json::array({"Gemma3ForConditionalGeneration"}), kBadArgument,
               "{}: architectures is {} with model_type \"gemma3\"; strata trains the text model of "
               "[\"Gemma3ForConditionalGeneration\"] only",
               source, describe_json(archs));
  const json& text = r.read("text_config");
  STRATA_CHECK(text.is_null() || text.is_object(), kBadArgument, "{}: key 'text_config' must be an object, got {}",
               source, describe_json(text));
  json t = text.is_null() ? json::object() : text;
  STRATA_CHECK(!t.contains("model_type") || t["model_type"] == "gemma3_text", kBadArgument,
               "{}: text_config's model_type is {}; a gemma3 checkpoint's text model is \"gemma3_text\"", source,
               describe_json(t["model_type"]));
  STRATA_CHECK(!t.contains("architectures"), kBadArgument,
               "{}: text_config names architectures {}; Gemma3ForConditionalGeneration builds its own text model",
               source, describe_json(t["architectures"]));
  const bool own_type = t.contains("model_type");
  t["model_type"] = "gemma3_text";
  DecoderConfig c = parse_decoder_config(t, source + ": text_config");
  if (!own_type) c.source.erase("model_type");
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", true);
  Multimodal m;
  m.config = j;
  // The placeholders of images (Gemma3Config's defaults when absent).
  for (const auto& [key, fallback] : {std::pair<const char*, int64_t>{"image_token_index", 262144},
                                      {"boi_token_index", 255999},
                                      {"eoi_token_index", 256000}}) {
    m.image_tokens.emplace_back(key, r.integer(key, fallback));
  }
  // The vision tower's and the projector's sizes: strata never runs them,
  // only counts their parameters (the checkpoint's count, strata plan).
  m.vision_parameters = vision_parameter_count(r.read("vision_config"), c.hidden_size, source);
  STRATA_CHECK(m.vision_parameters <= INT64_MAX - c.parameter_count(), kBadArgument,
               "{}: the text model and the vision tower together have more than 2^63 parameters", source);
  if (r.contains("mm_tokens_per_image")) {
    note_ignored(source, "mm_tokens_per_image", "sizes the images, which text-only training never sees");
  }
  r.accept("mm_tokens_per_image");
  // What is left is generic (dtype, token ids, bookkeeping), or not Gemma3Config's: a text model's
  // key at the top level, which transformers leaves unread there, is most likely misplaced.
  r.accept("initializer_range");  // the vision tower's and projector's initialisation
  static const std::set<std::string_view> kOwn = {"model_type",        "architectures",   "text_config",
                                                  "vision_config",     "mm_tokens_per_image", "tie_word_embeddings",
                                                  "image_token_index", "boi_token_index", "eoi_token_index",
                                                  "initializer_range", "quantization_config"};
  const std::set<std::string_view>* text_keys = transformers_keys("gemma3_text");
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    if (bookkeeping_key(key)) r.accept(key);
    if (kOwn.contains(key) || harmless_key(key) || bookkeeping_key(key)) continue;
    STRATA_CHECK(text_keys == nullptr || !text_keys->contains(key), kBadArgument,
                 "{}: key '{}' is at the top level of a gemma3 config, where Gemma3ForConditionalGeneration does not "
                 "read it: the text model's keys go in text_config",
                 source, key_text(key));
  }
  r.refuse_unread("gemma3", "Gemma3ForConditionalGeneration");
  c.multimodal = std::move(m);
  return c;
}

}  // namespace

DecoderConfig parse_decoder_config(const json& j, const std::string& source) {
  STRATA_CHECK(j.is_object(), kBadArgument, "{}: expected a JSON object", source);
  if (j.contains("model_type") && j["model_type"] == "gemma3") return parse_gemma3(j, source);
  Reader r(j, source);
  const Family& family = family_of(r);
  r.use_transformers_keys(family.model_type);
  DecoderConfig c;
  c.model_type = family.model_type;
  c.source = j;
  const std::string mt = c.model_type;
  const bool llama = mt == "llama", mistral = mt == "mistral", qwen2 = mt == "qwen2",
             qwen3 = mt == "qwen3", mixtral = mt == "mixtral", qwen3_moe = mt == "qwen3_moe",
             qwen2_moe = mt == "qwen2_moe", deepseek = mt == "deepseek_v3" || mt == "kimi_k2",
             glm = mt == "glm4_moe", gemma = mt == "gemma2" || mt == "gemma3_text", oss = mt == "gpt_oss";
  r.require("hidden_act", json("silu"), "strata computes SwiGLU with silu (\"silu\")");
  r.require("attention_dropout", json(0.0), "strata applies no dropout (0.0)");
  // Sizes are required, but Gemma 3's published multimodal configs give their
  // text_config without vocab_size: Gemma3TextConfig's default, 262208, is what transformers builds.
  // Gemma3TextConfig gives every size a default (a gemma3 config's
  // text_config may leave any out); the other families' are required.
  const bool g3 = mt == "gemma3_text";
  const auto size = [&](const char* key, int64_t gemma3_default) {
    return r.integer(key, g3 ? std::optional<int64_t>(gemma3_default) : std::nullopt);
  };
  c.vocab_size = size("vocab_size", 262208);
  c.hidden_size = size("hidden_size", 2304);
  c.intermediate_size = size("intermediate_size", 9216);
  c.num_hidden_layers = size("num_hidden_layers", 26);
  c.num_attention_heads = size("num_attention_heads", 8);
  c.num_key_value_heads = r.contains("num_key_value_heads")
                              ? r.integer("num_key_value_heads", c.num_attention_heads)
                              : family.kv_heads_default.value_or(c.num_attention_heads);
  const int64_t derived_head_dim =
      c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;
  c.head_dim = r.integer("head_dim", family.head_dim_default.value_or(derived_head_dim));
  if (mistral && c.head_dim == 0)
    c.head_dim = derived_head_dim;  // Mistral: "head_dim or hidden // heads"
  c.max_position_embeddings = r.integer("max_position_embeddings", family.max_positions_default);
  c.rms_norm_eps = r.number("rms_norm_eps", oss ? 1e-5 : 1e-6);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", gemma);  // Gemma's configuration classes tie
  c.pad_token_id = r.integer("pad_token_id", gemma ? int64_t{0} : int64_t{-1});
  STRATA_CHECK(c.pad_token_id >= -1, kBadArgument,
                       "{}: key 'pad_token_id' is {}; expected a token id or null", source,
                       c.pad_token_id);
  double partial = 0.5;  // Glm4MoeConfig's default partial_rotary_factor
  if (gemma) {
    read_gemma(r, c);
  } else if (oss) {
    read_gpt_oss(r, c);
  } else {
    c.rope = read_rope(r, c, 10000.0, glm ? &partial : nullptr);
  }
  if (deepseek) read_deepseek(r, c);
  if (glm) read_glm4_moe(r, c, partial);
  // Mistral's and Mixtral's attention has no biases and Qwen2's always q/k/v
  // (never o) biases: their configuration classes take no attention_bias or
  // mlp_bias, so transformers ignores those keys (refuse_unread lets them
  // pass; a bias tensor in the checkpoint is still refused by name).
  if (llama) {
    c.attention_qkv_bias = c.attention_o_bias = r.boolean("attention_bias", false);
    c.mlp_bias = r.boolean("mlp_bias", false);
  } else if (qwen3 || qwen3_moe) {
    c.attention_qkv_bias = c.attention_o_bias = r.boolean("attention_bias", false);
  } else if (qwen2_moe) {
    // Qwen2MoeConfig's qkv_bias switches the q/k/v biases (o_proj never has one).
    c.attention_qkv_bias = r.boolean("qkv_bias", true);
  } else if (!deepseek && !glm && !gemma && !oss) {  // read_deepseek, read_glm4_moe, read_gemma, read_gpt_oss read theirs
    c.attention_qkv_bias = qwen2;
  }
  c.qk_norm = c.qk_norm || qwen3 || qwen3_moe;  // glm4_moe: use_qk_norm (read_glm4_moe); gemma3: read_gemma
  if (mixtral || qwen3_moe || qwen2_moe) read_moe(r, c, mixtral);
  if (mistral) {
    read_mistral_window(r, c);
  } else if (qwen2 || qwen3 || qwen2_moe) {
    read_qwen_window(r, c, qwen2_moe);
  } else if (mixtral) {
    // MixtralConfig: no window unless sliding_window is set; then every layer.
    if (r.present("sliding_window")) {
      c.sliding_window = r.integer("sliding_window", std::nullopt);
      STRATA_CHECK(c.sliding_window > 0, kBadArgument,
                   "{}: key 'sliding_window' is {}; a window holds at least one token (null: none)",
                   source, c.sliding_window);
    }
    r.accept("sliding_window");
  } else if (deepseek || glm || gemma || oss) {
    // read_deepseek, read_glm4_moe, read_gemma, read_gpt_oss
  } else if (qwen3_moe) {
    r.require("use_sliding_window", json(false),
              "strata does not apply qwen3_moe's sliding window (every layer attends fully)");
    r.accept("sliding_window");  // unused without use_sliding_window (Qwen3MoeConfig)
  } else {
    // The shared masking code reads sliding_window: Llama has none.
    r.require("sliding_window", json(nullptr),
              "transformers' LlamaForCausalLM has no sliding window");
    if (r.present("layer_types")) {
      for (const json& t : r.read("layer_types")) {
        STRATA_CHECK(
            t == "full_attention", kBadArgument,
            "{}: layer_types holds {}; transformers' LlamaForCausalLM attends fully in every layer",
            source, describe_json(t));
      }
    }
  }
  // Quantized weights: FP8 blocks and MXFP4 are read and dequantized exactly,
  // any other quantization is refused naming its quant_method.
  if (r.present("quantization_config")) c.quant = parse_checkpoint_quant(r.read("quantization_config"), source, mt);
  r.accept("quantization_config");
  r.refuse_unread(mt, family.architecture);
  try {
    c.validate();
  } catch (const Error& e) {
    raise(ErrorCategory::kBadArgument, "{}: {}", source, e.message());
  }
  return c;
}

}  // namespace strata::nn
