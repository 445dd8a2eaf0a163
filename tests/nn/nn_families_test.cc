// config.json of each supported family read as transformers reads it (its
// defaults, its keys), the tensor list the model declares, to_json keeping the
// source's keys, and every refusal: another model_type, a math-changing key or
// value strata does not compute, a key it does not know.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "core/error.h"
#include "runtime/nn/decoder_config.h"
#include "tests/nn/config_checks.h"
#include "runtime/nn/decoder_model.h"
#include "runtime/nn/safetensors.h"
#include "runtime/plan/runtime_memory.h"
#include "tests/nn/engine_rig.h"
#include "tests/support/test_paths.h"

using namespace strata;
using namespace strata::nn;
using nlohmann::json;
using strata::test::expect_refused;

namespace {

std::string fixture(const std::string& name) {
  return strata::test::source_dir() + "/tests/data/golden/" + name;
}

json fixture_config(const std::string& name) {
  std::ifstream in(fixture(name) + "/config.json");
  REQUIRE(in.good());
  return json::parse(in);
}

const char* const kCases[] = {"llama_untied_f32", "llama_tied_bf16", "llama3_untied_f32", "llama3_tied_bf16",
                              "llama_yarn_untied_f32", "qwen2_yarn_tied_bf16",
                              "mistral_untied_f32", "mistral_tied_bf16", "qwen2_untied_f32", "qwen2_tied_bf16",
                              "qwen3_untied_f32", "qwen3_tied_bf16", "mixtral_untied_f32", "mixtral_untied_bf16",
                              "qwen3_moe_untied_f32", "qwen3_moe_tied_bf16", "qwen3_moe_nonorm_f32",
                              "qwen2_moe_untied_f32", "qwen2_moe_tied_bf16"};

}  // namespace

TEST_CASE("families: each fixture's config.json reads as its family", "[nn][config][families]") {
  const DecoderConfig llama3 = parse_decoder_config(fixture_config("llama3_untied_f32"));
  CHECK(llama3.model_type == "llama");
  CHECK(llama3.rope.type == ops::RopeType::kLlama3);
  CHECK(llama3.rope.theta == 10.0);
  CHECK(llama3.rope.factor == 8.0);
  CHECK(llama3.rope.high_freq_factor == 2.0);
  CHECK(llama3.rope.original_max_position_embeddings == 16.0);
  CHECK(!llama3.attention_qkv_bias);

  const DecoderConfig mistral = parse_decoder_config(fixture_config("mistral_untied_f32"));
  CHECK(mistral.model_type == "mistral");
  CHECK(mistral.attention_mask(0).window == 3);
  CHECK(mistral.attention_mask(1).window == 3);

  const DecoderConfig qwen2 = parse_decoder_config(fixture_config("qwen2_untied_f32"));
  CHECK(qwen2.attention_qkv_bias);
  CHECK(!qwen2.attention_o_bias);
  CHECK(qwen2.attention_mask(0).window == 0);  // layer_types: full, then sliding
  CHECK(qwen2.attention_mask(1).window == 4);
  CHECK(qwen2.pad_token_id == 5);

  const DecoderConfig qwen3 = parse_decoder_config(fixture_config("qwen3_tied_bf16"));
  CHECK(qwen3.qk_norm);
  CHECK(qwen3.tie_word_embeddings);
  CHECK(qwen3.attention_mask(1).window == 0);
}

TEST_CASE("families: absent keys take the family's transformers default", "[nn][config][families]") {
  const json sizes = {{"vocab_size", 32}, {"hidden_size", 64}, {"intermediate_size", 96},
                      {"num_hidden_layers", 2}, {"num_attention_heads", 4}};
  json j = sizes;
  j["model_type"] = "llama";
  CHECK(parse_decoder_config(j).num_key_value_heads == 4);
  CHECK(parse_decoder_config(j).head_dim == 16);
  CHECK(parse_decoder_config(j).max_position_embeddings == 2048);
  j["model_type"] = "mistral";  // MistralConfig: 8 kv heads, a 4096-token window
  j["num_attention_heads"] = 8;
  CHECK(parse_decoder_config(j).num_key_value_heads == 8);
  CHECK(parse_decoder_config(j).sliding_window == 4096);
  j["sliding_window"] = nullptr;
  CHECK(parse_decoder_config(j).sliding_window == 0);
  j = sizes;
  j["model_type"] = "qwen3";  // Qwen3Config: head_dim 128, 32 kv heads
  j["num_attention_heads"] = 32;
  j["hidden_size"] = 256;
  CHECK(parse_decoder_config(j).head_dim == 128);
  CHECK(parse_decoder_config(j).num_key_value_heads == 32);
  CHECK(parse_decoder_config(j).qk_norm);
  // Qwen2: the window from max_window_layers on, only with use_sliding_window.
  j = sizes;
  j["model_type"] = "qwen2";
  j["num_hidden_layers"] = 4;
  j["num_key_value_heads"] = 2;
  j["sliding_window"] = 5;
  j["max_window_layers"] = 2;
  CHECK(parse_decoder_config(j).sliding_window == 0);
  j["use_sliding_window"] = true;
  const DecoderConfig q = parse_decoder_config(j);
  CHECK(q.attention_mask(1).window == 0);
  CHECK(q.attention_mask(2).window == 5);
  CHECK(q.attention_mask(3).window == 5);
  // Llama 3.1 in the older style: rope_theta beside rope_scaling; the
  // original context defaults to max_position_embeddings.
  j = sizes;
  j["rope_theta"] = 500000.0;
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 32.0}, {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0}};
  j["max_position_embeddings"] = 8192;
  const DecoderConfig l = parse_decoder_config(j);
  CHECK(l.rope.theta == 500000.0);
  CHECK(l.rope.original_max_position_embeddings == 8192.0);
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  CHECK(parse_decoder_config(j).rope.type == ops::RopeType::kLinear);
}

TEST_CASE("families: anything else is refused before any work, naming it", "[nn][config][families]") {
  const json base = fixture_config("llama_untied_f32");
  // Other architectures, with what they would need.
  for (const char* type : {"gemma", "phi3", "olmo2", "deepseek_v2", "falcon"}) {
    json j = base;
    j["model_type"] = type;
    expect_refused(j, {std::string("model_type \"") + type + "\" is not supported", "llama", "mistral", "qwen2",
                       "qwen3"});
  }
  json j = base;
  j["model_type"] = "deepseek_v2";
  expect_refused(j, {"mixture of experts with multi-head latent attention"});
  j = base;
  j["architectures"] = {"LlamaForSequenceClassification"};
  expect_refused(j, {"LlamaForSequenceClassification", "LlamaForCausalLM"});
  j = base;
  j["architectures"] = {"Qwen2ForCausalLM"};
  expect_refused(j, {"Qwen2ForCausalLM", "model_type \"llama\""});
  j = base;
  j.erase("model_type");
  j["architectures"] = {"MistralForCausalLM"};
  expect_refused(j, {"no model_type"});
  // Math-changing values strata does not compute.
  j = base;
  j["rope_parameters"] = {{"rope_type", "dynamic"}, {"rope_theta", 1e4}, {"factor", 4.0}};
  expect_refused(j, {"rope_type \"dynamic\"", "\"default\", \"linear\", \"llama3\" and \"yarn\""});
  j = base;
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e4}, {"original_max_position_embeddings", 32}};
  expect_refused(j, {"yarn needs key 'factor'"});
  j["rope_parameters"]["factor"] = 4.0;
  j["rope_parameters"]["attention_factor"] = 0.0;
  expect_refused(j, {"'attention_factor'", "must be positive"});
  j["rope_parameters"].erase("attention_factor");
  j["rope_parameters"]["beta"] = 2;  // not one of yarn's keys
  expect_refused(j, {"'beta'", "rope_type yarn"});
  j = base;
  j["rope_parameters"]["partial_rotary_factor"] = 0.5;
  expect_refused(j, {"partial_rotary_factor", "0.5"});
  j = base;
  j["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 1e4}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                          {"high_freq_factor", 4.0}, {"mscale", 1.0}};
  expect_refused(j, {"'mscale'"});
  j = base;
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  expect_refused(j, {"both 'rope_parameters' and 'rope_scaling'"});
  j = base;
  j["hidden_act"] = "gelu_pytorch_tanh";
  expect_refused(j, {"hidden_act", "gelu_pytorch_tanh", "silu"});
  j = base;
  j["attention_dropout"] = 0.1;
  expect_refused(j, {"attention_dropout", "no dropout"});
  j = base;
  j["sliding_window"] = 16;
  expect_refused(j, {"sliding_window", "LlamaForCausalLM has no sliding window"});
  j = base;
  j["quantization_config"] = {{"quant_method", "bitsandbytes"}};
  expect_refused(j, {"quantization_config", "quantized"});
  j = base;
  j["auto_map"] = {{"AutoModelForCausalLM", "modeling_x.XForCausalLM"}};
  expect_refused(j, {"auto_map", "custom modeling code"});
  // A key transformers' shared masking code computes with (chunked attention), which strata does not read.
  j = base;
  j["attention_chunk_size"] = 16;
  expect_refused(j, {"key 'attention_chunk_size'", "LlamaForCausalLM can compute with it",
                     "model_type \"llama\""});

  j = fixture_config("mistral_untied_f32");
  j["sliding_window"] = 0;
  expect_refused(j, {"sliding_window", "at least one token"});
  j = fixture_config("qwen2_untied_f32");
  j["use_sliding_window"] = false;
  expect_refused(j, {"layer_types has sliding_attention layers but use_sliding_window is false"});
  j = fixture_config("qwen3_untied_f32");
  j["layer_types"] = {"full_attention", "chunked_attention"};
  expect_refused(j, {"chunked_attention"});
}

TEST_CASE("families: harmless generic keys pass, and to_json keeps the source's keys", "[nn][config][families]") {
  for (const char* name : kCases) {
    INFO(name);
    const json source = fixture_config(name);
    const DecoderConfig c = parse_decoder_config(source);
    const json out = c.to_json();
    // Every key of the source is still there, with model_type never relabelled.
    for (const auto& [key, value] : source.items()) {
      INFO(key);
      CHECK(out.contains(key));
    }
    CHECK(out["model_type"] == source["model_type"]);
    CHECK(out["rope_parameters"] == source["rope_parameters"]);
    if (source.contains("layer_types")) CHECK(out["layer_types"] == source["layer_types"]);
    // It reads back as the same model.
    CHECK(parse_decoder_config(out).to_json() == out);
    const json hf = c.to_hf_json(DType::kBF16);
    CHECK(hf["torch_dtype"] == "bfloat16");
    CHECK(hf["dtype"] == "bfloat16");
  }
  json j = fixture_config("llama_untied_f32");
  j["transformers.js_config"] = {{"dtype", "q4"}};
  j["is_llama_config"] = true;
  j["rope_interleaved"] = false;
  j["temperature"] = 0.7;
  CHECK_NOTHROW(parse_decoder_config(j));
}

TEST_CASE("families: keys transformers' code for the family never reads pass, logged and kept, and the ones it "
          "reads are refused unless strata reads them",
          "[nn][config][families]") {
  // Bookkeeping (a transformers 5.24 GGUF conversion's _model_name_or_path),
  // special-token ids other than padding, and keys the family's configuration
  // class does not take (Gemma's hidden_activation on a llama, nanotron's
  // rope_interleaved, Qwen2-VL's use_mrope on a qwen2, attention_bias on
  // mistral and qwen2, whose attention transformers builds without reading it).
  const std::vector<std::pair<std::string, json>> ignored = {
      {"llama_untied_f32", {{"_model_name_or_path", "x.gguf"}, {"unk_token_id", 0}, {"hidden_activation", "gelu"},
                            {"rope_interleaved", true}, {"use_sliding_window", true}}},
      {"mistral_untied_f32", {{"attention_bias", true}, {"mlp_bias", true}, {"use_sliding_window", true}}},
      {"qwen2_untied_f32", {{"attention_bias", true}, {"mlp_bias", true}, {"use_mrope", true}}},
      {"qwen3_moe_untied_f32", {{"max_window_layers", 3}}},
      {"mixtral_untied_f32", {{"norm_topk_prob", false}}},
      {"qwen2_moe_untied_f32", {{"num_local_experts", 4}, {"attention_bias", true}, {"moe_layer_freq", 2}}}};
  for (const auto& [name, keys] : ignored) {
    json j = fixture_config(name);
    const DecoderConfig plain = parse_decoder_config(j);
    j.update(keys);
    INFO(name << " with " << keys.dump());
    const DecoderConfig c = parse_decoder_config(j);
    CHECK(c.parameter_count() == plain.parameter_count());
    CHECK(c.attention_qkv_bias == plain.attention_qkv_bias);
    CHECK(c.num_experts == plain.num_experts);
    CHECK(c.norm_topk_prob == plain.norm_topk_prob);
    for (const auto& [key, value] : keys.items()) CHECK(c.to_json().at(key) == value);  // kept in the export
  }
  // Keys transformers' code for the family reads and strata does not compute are refused by name.
  json j = fixture_config("llama_untied_f32");
  j["per_layer_config"] = json::array();
  expect_refused(j, {"key 'per_layer_config'", "model_type \"llama\""});
  j = fixture_config("mixtral_untied_f32");
  j["router_jitter_noise"] = 0.1;
  expect_refused(j, {"router_jitter_noise"});
  j = fixture_config("qwen3_untied_f32");
  j["is_causal"] = false;
  expect_refused(j, {"key 'is_causal'"});
}

TEST_CASE("families: the model declares exactly hf_tensors, and the count includes biases and norms",
          "[nn][config][families]") {
  for (const char* name : kCases) {
    INFO(name);
    const DecoderConfig c = load_decoder_config(fixture(name) + "/config.json");
    test::Rig rig;
    DecoderModel model(*rig.engine, c);
    const std::vector<HfTensor> tensors = hf_tensors(c);
    const std::vector<ParamId> params = model.parameters();
    REQUIRE(params.size() == tensors.size());
    for (size_t i = 0; i < params.size(); ++i) {
      CHECK(rig.engine->param_info(params[i]).name == tensors[i].name);
      CHECK(rig.engine->param_info(params[i]).shape == tensors[i].shape);
    }
    // The checkpoint transformers wrote holds the same tensors: the count is the file's.
    const SafetensorsFile file = SafetensorsFile::open(fixture(name) + "/model.safetensors");
    int64_t in_file = 0;
    for (const std::string& t : file.names()) in_file += shape_numel(file.entry(t).shape);
    CHECK(c.parameter_count() == in_file);
  }
}

TEST_CASE("families: the README's example configs and real checkpoints' key sets are read", "[nn][config][families]") {
  // The four examples of README.md "Models".
  const char* const examples[] = {
      R"({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
 "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
 "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "tie_word_embeddings": true,
 "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})",
      R"({"model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": 32768, "hidden_size": 4096,
 "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
 "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": null})",
      R"({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896,
 "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
 "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
 "tie_word_embeddings": true, "use_sliding_window": false, "sliding_window": 32768, "max_window_layers": 21})",
      R"({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
 "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
 "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
 "tie_word_embeddings": true, "attention_bias": false, "use_sliding_window": false})"};
  const int64_t counts[] = {1235814400, 7248023552, 494032768, 596049920};  // as transformers counts them
  for (size_t i = 0; i < 4; ++i) {
    const DecoderConfig c = parse_decoder_config(json::parse(examples[i]));
    INFO(c.model_type);
    CHECK(c.parameter_count() == counts[i]);
    CHECK(c.sliding_window == 0);
  }
  // A SmolLM2-style config: nanotron and transformers.js stamps, a padding token.
  const json smol = json::parse(R"({"architectures": ["LlamaForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 576,
    "initializer_range": 0.041666666666666664, "intermediate_size": 1536, "is_llama_config": true,
    "max_position_embeddings": 8192, "mlp_bias": false, "model_type": "llama", "num_attention_heads": 9,
    "num_hidden_layers": 30, "num_key_value_heads": 3, "pad_token_id": 2, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_interleaved": false, "rope_scaling": null, "rope_theta": 100000,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.42.3",
    "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}},
    "use_cache": true, "vocab_size": 49152})");
  const DecoderConfig c = parse_decoder_config(smol);
  CHECK(c.pad_token_id == 2);
  CHECK(c.parameter_count() == 134515008);
}

TEST_CASE("families: YaRN RoPE is read as transformers reads it, in both styles, for every family", "[nn][config][families]") {
  // The fixture's: transformers 5's rope_parameters.
  const DecoderConfig llama = parse_decoder_config(fixture_config("llama_yarn_untied_f32"));
  CHECK(llama.rope.type == ops::RopeType::kYarn);
  CHECK(llama.rope.factor == 8.0);
  CHECK(llama.rope.original_max_position_embeddings == 16.0);
  CHECK(llama.rope.mscale == 1.0);
  CHECK(llama.rope.mscale_all_dim == 0.5);
  CHECK(!llama.rope.truncate);
  CHECK(llama.rope.beta_fast == 0.0);  // absent: transformers' default (32)
  CHECK(ops::rope_attention_scale(llama.rope) == Approx((0.1 * std::log(8.0) + 1) / (0.05 * std::log(8.0) + 1)));
  const DecoderConfig qwen = parse_decoder_config(fixture_config("qwen2_yarn_untied_f32"));
  CHECK(qwen.rope.attention_factor == 1.3);
  CHECK(ops::rope_attention_scale(qwen.rope) == 1.3);
  CHECK(qwen.rope.beta_fast == 8.0);
  CHECK(qwen.rope.beta_slow == 2.0);
  // DeepSeek's style: rope_scaling with "type", a top-level original context that wins over the rope's.
  json j = fixture_config("qwen3_untied_f32");
  j.erase("rope_parameters");
  j["rope_theta"] = 10000;
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 40}, {"beta_fast", 32}, {"beta_slow", 1}, {"mscale", 1.0},
                       {"mscale_all_dim", 1.0}, {"original_max_position_embeddings", 16}};
  j["original_max_position_embeddings"] = 8;
  const DecoderConfig deepseek_style = parse_decoder_config(j);
  CHECK(deepseek_style.rope.type == ops::RopeType::kYarn);
  CHECK(deepseek_style.rope.original_max_position_embeddings == 8.0);
  CHECK(ops::rope_attention_scale(deepseek_style.rope) == 1.0);  // mscale / mscale_all_dim
  // factor null: max_position_embeddings over the original context, as transformers computes it.
  j["rope_scaling"]["factor"] = nullptr;
  CHECK(parse_decoder_config(j).rope.factor == 64.0 / 8.0);
  // Every family reads it (the MoE ones too), and the export reads back as the same RoPE.
  for (const char* name : {"mistral_untied_f32", "qwen3_untied_f32", "mixtral_untied_f32", "qwen3_moe_untied_f32",
                           "qwen2_moe_untied_f32", "llama_yarn_tied_bf16", "qwen2_yarn_tied_bf16"}) {
    INFO(name);
    json f = fixture_config(name);
    f["rope_parameters"] = fixture_config("qwen2_yarn_untied_f32").at("rope_parameters");
    const DecoderConfig c = parse_decoder_config(f);
    CHECK(c.rope.type == ops::RopeType::kYarn);
    const DecoderConfig back = parse_decoder_config(c.to_json());
    CHECK(back.to_json() == c.to_json());
    for (int64_t i = 0; i < c.head_dim / 2; ++i) {
      CHECK(ops::rope_inv_freq(back.rope, i, c.head_dim) == ops::rope_inv_freq(c.rope, i, c.head_dim));
    }
    CHECK(ops::rope_attention_scale(back.rope) == ops::rope_attention_scale(c.rope));
  }
}

TEST_CASE("families: strata plan's arena is the model's, Qwen3's q/k norm activations and experts included",
          "[nn][config][families]") {
  for (const char* name : {"qwen3_untied_f32", "qwen2_untied_f32", "mistral_untied_f32", "mixtral_untied_f32",
                           "qwen3_moe_untied_f32", "qwen2_moe_untied_f32", "deepseek_v3_qlora_f32", "deepseek_v3_qproj_f32",
                           "glm4_moe_f32"}) {
    const DecoderConfig c = load_decoder_config(fixture(name) + "/config.json");
    for (const bool checkpointing : {false, true}) {
      INFO(name << " checkpointing " << checkpointing);
      test::Rig rig;
      DecoderModelOptions options;
      options.checkpoint_activations = checkpointing;
      DecoderModel model(*rig.engine, c, options);
      rig.engine->finalize();
      initialize_parameters(*rig.engine, model.parameters(), 7);
      const int64_t batch = 2, seq = 9;
      std::vector<int32_t> ids(batch * seq, 5), targets(batch * seq, 6);
      model.forward(ids, targets, batch, seq);
      model.backward();
      CHECK(std::isfinite(model.loss()));
      CHECK(plan::decoder_arena_nbytes(c, DType::kF32, batch, seq, checkpointing, false) == model.arena_nbytes());
    }
  }
}

TEST_CASE("families: mixtral and qwen3_moe read their experts, and refuse what strata does not compute",
          "[nn][config][families][moe]") {
  const DecoderConfig mixtral = parse_decoder_config(fixture_config("mixtral_untied_f32"));
  CHECK(mixtral.model_type == "mixtral");
  CHECK(mixtral.num_experts == 8);
  CHECK(mixtral.num_experts_per_tok == 2);
  CHECK(mixtral.moe_intermediate_size == mixtral.intermediate_size);
  CHECK(mixtral.norm_topk_prob);  // Mixtral always renormalises
  CHECK(mixtral.output_router_logits);
  CHECK(mixtral.router_aux_loss_coef == 0.02);
  CHECK(!mixtral.qk_norm);
  const DecoderConfig qwen = parse_decoder_config(fixture_config("qwen3_moe_untied_f32"));
  CHECK(qwen.qk_norm);
  CHECK(qwen.norm_topk_prob);
  CHECK(qwen.moe_intermediate_size == 8);
  CHECK(!parse_decoder_config(fixture_config("qwen3_moe_nonorm_f32")).norm_topk_prob);
  // Published configs say num_experts (save_pretrained writes num_local_experts); both must agree.
  json j = fixture_config("qwen3_moe_untied_f32");
  j.erase("num_local_experts");
  j["num_experts"] = 8;
  CHECK(parse_decoder_config(j).num_experts == 8);
  j["num_local_experts"] = 4;
  expect_refused(j, {"'num_local_experts' (4)", "'num_experts' (8)", "disagree"});
  // Absent keys take the configuration class's defaults.
  j = fixture_config("qwen3_moe_untied_f32");
  for (const char* key : {"norm_topk_prob", "router_aux_loss_coef", "output_router_logits"}) j.erase(key);
  const DecoderConfig d = parse_decoder_config(j);
  CHECK(!d.norm_topk_prob);
  CHECK(d.router_aux_loss_coef == 0.001);
  CHECK(!d.output_router_logits);
  // What would be another model.
  j = fixture_config("qwen3_moe_untied_f32");
  j["decoder_sparse_step"] = 2;
  expect_refused(j, {"decoder_sparse_step", "every layer as a mixture of experts"});
  j = fixture_config("qwen3_moe_untied_f32");
  j["mlp_only_layers"] = {0};
  expect_refused(j, {"mlp_only_layers", "[0]"});
  j = fixture_config("qwen3_moe_untied_f32");
  j["use_sliding_window"] = true;
  expect_refused(j, {"use_sliding_window", "qwen3_moe's sliding window"});
  j = fixture_config("qwen3_moe_untied_f32");
  j["num_local_experts"] = 0;
  expect_refused(j, {"number of experts is 0"});
  j = fixture_config("qwen3_moe_untied_f32");
  j["num_experts_per_tok"] = 9;
  expect_refused(j, {"num_experts_per_tok", "9"});
  j = fixture_config("mixtral_untied_f32");
  j["router_jitter_noise"] = 0.1;
  expect_refused(j, {"router_jitter_noise", "no router jitter"});
  // Published checkpoints' config.json key sets (Mixtral-8x7B-v0.1, Qwen3-30B-A3B) are read.
  const json mixtral_8x7b = json::parse(R"({"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "output_router_logits": false, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "router_jitter_noise": 0.0, "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": true, "vocab_size": 32000})");
  const DecoderConfig m8 = parse_decoder_config(mixtral_8x7b);
  CHECK(m8.parameter_count() == 46702792704);  // Mixtral 8x7B's 46.7B
  const json qwen3_30b = json::parse(R"({"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": false,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})");
  const DecoderConfig q30 = parse_decoder_config(qwen3_30b);
  CHECK(q30.num_experts == 128);
  CHECK(q30.parameter_count() == 30532122624);  // Qwen3-30B-A3B's 30.5B
  // The tensors: router and per-expert projections, in published checkpoints' names.
  const std::vector<HfTensor> tensors = hf_tensors(mixtral);
  std::set<std::string> names;
  for (const HfTensor& t : tensors) names.insert(t.name);
  CHECK(names.contains("model.layers.1.block_sparse_moe.gate.weight"));
  CHECK(names.contains("model.layers.1.block_sparse_moe.experts.7.w2.weight"));
  CHECK(hf_tensors(qwen).size() == tensors.size() + 4);  // q/k norms in 2 layers
}

TEST_CASE("families: qwen2_moe reads its experts, shared expert, biases and windowed layers, and refuses what "
          "strata does not compute",
          "[nn][config][families][moe]") {
  const DecoderConfig c = parse_decoder_config(fixture_config("qwen2_moe_untied_f32"));
  CHECK(c.model_type == "qwen2_moe");
  CHECK(c.num_experts == 8);
  CHECK(c.num_experts_per_tok == 2);
  CHECK(c.moe_intermediate_size == 8);
  CHECK(c.shared_expert_intermediate_size == 16);
  CHECK(c.shared_expert());
  CHECK(!c.norm_topk_prob);  // Qwen2MoeConfig's default, as the fixture has it
  CHECK(c.output_router_logits);
  CHECK(c.router_aux_loss_coef == 0.02);
  CHECK(c.attention_qkv_bias);  // qkv_bias (default true)
  CHECK(!c.attention_o_bias);
  CHECK(!c.qk_norm);
  CHECK(c.attention_mask(0).window == 3);  // layer_types: layer 0 slides
  CHECK(c.attention_mask(1).window == 0);
  const DecoderConfig bf16 = parse_decoder_config(fixture_config("qwen2_moe_tied_bf16"));
  CHECK(bf16.norm_topk_prob);
  CHECK(bf16.sliding_window == 0);  // use_sliding_window false (Qwen2MoeConfig writes sliding_window 0)
  // The tensors: the routed experts as qwen3_moe, then the shared expert and its gate.
  std::map<std::string, Shape> shapes;
  for (const HfTensor& t : hf_tensors(c)) shapes[t.name] = t.shape;
  CHECK(shapes.at("model.layers.1.mlp.experts.7.down_proj.weight") == Shape{32, 8});
  CHECK(shapes.at("model.layers.1.mlp.shared_expert.gate_proj.weight") == Shape{16, 32});
  CHECK(shapes.at("model.layers.1.mlp.shared_expert.down_proj.weight") == Shape{32, 16});
  CHECK(shapes.at("model.layers.1.mlp.shared_expert_gate.weight") == Shape{1, 32});
  CHECK(shapes.at("model.layers.0.self_attn.v_proj.bias") == Shape{8});
  CHECK(!shapes.contains("model.layers.0.self_attn.o_proj.bias"));
  // Absent keys take Qwen2MoeConfig's defaults.
  json j = fixture_config("qwen2_moe_untied_f32");
  for (const char* key : {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                          "shared_expert_intermediate_size", "qkv_bias", "router_aux_loss_coef"}) {
    j.erase(key);
  }
  const DecoderConfig d = parse_decoder_config(j);
  CHECK(d.num_experts == 60);
  CHECK(d.num_experts_per_tok == 4);
  CHECK(d.moe_intermediate_size == 1408);
  CHECK(d.shared_expert_intermediate_size == 5632);
  CHECK(!d.norm_topk_prob);
  CHECK(d.attention_qkv_bias);
  CHECK(d.router_aux_loss_coef == 0.001);
  j = fixture_config("qwen2_moe_untied_f32");
  j["qkv_bias"] = false;
  const DecoderConfig no_bias = parse_decoder_config(j);
  CHECK(!no_bias.attention_qkv_bias);
  CHECK(hf_tensors(no_bias).size() == hf_tensors(c).size() - 6);  // q/k/v biases in 2 layers
  // Without layer_types, Qwen2MoeConfig's own rule: the even layers below
  // max_window_layers slide (qwen2's rule would slide layers 3 and up).
  j = fixture_config("qwen2_moe_untied_f32");
  j.erase("layer_types");
  j["num_hidden_layers"] = 6;
  j["max_window_layers"] = 3;
  const DecoderConfig rule = parse_decoder_config(j);
  CHECK(rule.sliding_layers == std::vector<bool>{true, false, true, false, false, false});
  j["use_sliding_window"] = false;
  CHECK(parse_decoder_config(j).sliding_window == 0);
  // What would be another model, or a key strata does not know.
  j = fixture_config("qwen2_moe_untied_f32");
  j["decoder_sparse_step"] = 2;
  expect_refused(j, {"decoder_sparse_step", "every layer as a mixture of experts"});
  j = fixture_config("qwen2_moe_untied_f32");
  j["mlp_only_layers"] = {1};
  expect_refused(j, {"mlp_only_layers", "[1]"});
  j = fixture_config("qwen2_moe_untied_f32");
  j["shared_expert_intermediate_size"] = 0;
  expect_refused(j, {"shared_expert_intermediate_size", "is 0"});
  j = fixture_config("qwen2_moe_untied_f32");
  j["num_experts"] = 0;
  expect_refused(j, {"number of experts is 0"});
  j = fixture_config("qwen2_moe_untied_f32");
  j["layer_types"] = {"sliding_attention", "full_attention"};
  j["use_sliding_window"] = false;
  expect_refused(j, {"use_sliding_window is false"});
  // to_hf_json writes what Qwen2MoeConfig reads, and reads back as the same model.
  const json hf = c.to_hf_json(DType::kF32);
  CHECK(hf["architectures"] == json::array({"Qwen2MoeForCausalLM"}));
  CHECK(hf["num_experts"] == 8);
  CHECK(!hf.contains("num_local_experts"));
  CHECK(hf["shared_expert_intermediate_size"] == 16);
  CHECK(hf["qkv_bias"] == true);
  CHECK(hf["norm_topk_prob"] == false);
  CHECK(hf["use_sliding_window"] == true);
  CHECK(hf["layer_types"] == json::array({"sliding_attention", "full_attention"}));
  const DecoderConfig back = parse_decoder_config(hf);
  CHECK(back.to_hf_json(DType::kF32) == hf);
  CHECK(back.shared_expert_intermediate_size == 16);
  CHECK(back.sliding_layers == c.sliding_layers);
  CHECK(back.parameter_count() == c.parameter_count());
  // A config built in code (no source) writes num_experts, Qwen2MoeConfig's key.
  DecoderConfig built = c;
  built.source = nullptr;
  CHECK(built.to_json().contains("num_experts"));
  CHECK(parse_decoder_config(built.to_json()).parameter_count() == c.parameter_count());
  // Qwen1.5-MoE-A2.7B's published config.json: 14.3B parameters, 2.7B active.
  const json a27b = json::parse(R"({"architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
    "model_type": "qwen2_moe", "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16", "transformers_version": "4.39.0.dev0", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 151936, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
    "norm_topk_prob": false, "output_router_logits": false, "router_aux_loss_coef": 0.001})");
  const DecoderConfig q = parse_decoder_config(a27b);
  CHECK(q.sliding_window == 0);
  CHECK(q.parameter_count() == 14315784192);
}

TEST_CASE("families: Gemma 2 and Gemma 3 configs, with their defaults and both RoPE forms", "[nn][config][families][gemma]") {
  const DecoderConfig g2 = parse_decoder_config(fixture_config("gemma2_untied_f32"));
  CHECK(g2.hidden_act == ops::GluActivation::kGeluTanh);
  CHECK(g2.norm_weight_offset == 1.0f);
  CHECK(g2.scale_embedding);
  CHECK(g2.sandwich_norms);
  CHECK_FALSE(g2.qk_norm);
  CHECK(g2.query_pre_attn_scalar == 12);
  CHECK(g2.attn_logit_softcapping == 1.0);
  CHECK(g2.final_logit_softcapping == 1.5);
  CHECK(g2.sliding_window == 3);
  CHECK(g2.sliding_layers == std::vector<bool>{true, false});
  CHECK(g2.attention_mask(0).window == 3);
  CHECK(g2.attention_mask(1).window == 0);
  CHECK(g2.attention_mask(1).softcap == 1.0f);
  CHECK(std::abs(g2.attention_mask(1).scale - 1.0 / std::sqrt(12.0)) < 1e-7);
  CHECK(g2.pad_token_id == 0);
  // hf_tensors: the sandwich norms and the MLP's input norm under Gemma's names.
  std::vector<std::string> names;
  for (const HfTensor& t : hf_tensors(g2)) names.push_back(t.name);
  for (const char* want : {"model.layers.0.post_attention_layernorm.weight", "model.layers.0.pre_feedforward_layernorm.weight",
                           "model.layers.1.post_feedforward_layernorm.weight"}) {
    CHECK(std::find(names.begin(), names.end(), want) != names.end());
  }

  const DecoderConfig g3 = parse_decoder_config(fixture_config("gemma3_untied_f32"));
  CHECK(g3.qk_norm);
  CHECK(g3.attn_logit_softcapping == 0);  // transformers' Gemma 3 never caps the scores
  CHECK(g3.final_logit_softcapping == 0);
  CHECK(g3.sliding_layers == std::vector<bool>{true, true, false});
  REQUIRE(g3.sliding_rope.has_value());
  CHECK(g3.rope_of(0).theta == 10.0);
  CHECK(g3.rope_of(0).type == ops::RopeType::kDefault);
  CHECK(g3.rope_of(2).theta == 100.0);
  CHECK(g3.rope_of(2).type == ops::RopeType::kLinear);
  CHECK(g3.rope_of(2).factor == 2.0);
  // The round trip keeps every piece.
  const DecoderConfig again = parse_decoder_config(g3.to_json());
  CHECK(again.sliding_layers == g3.sliding_layers);
  CHECK(again.rope_of(0).theta == 10.0);
  CHECK(again.rope_of(2).factor == 2.0);
  CHECK(again.query_pre_attn_scalar == 12);
  // transformers' strict Gemma config classes take an int there, not 12.0.
  CHECK(g3.to_json().at("query_pre_attn_scalar").is_number_integer());

  // Gemma 3's older form (the published 27B text config): rope_theta and
  // rope_scaling for the full layers, rope_local_base_freq for the sliding
  // ones, sliding_window_pattern for the layers.
  json legacy = fixture_config("gemma3_untied_f32");
  for (const char* k : {"rope_parameters", "layer_types"}) legacy.erase(k);
  legacy["num_hidden_layers"] = 7;
  legacy["sliding_window_pattern"] = 6;
  legacy["rope_theta"] = 1000000.0;
  legacy["rope_local_base_freq"] = 10000.0;
  legacy["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  const DecoderConfig l = parse_decoder_config(legacy);
  CHECK(l.sliding_layers == std::vector<bool>{true, true, true, true, true, false, true});
  CHECK(l.rope_of(5).theta == 1000000.0);
  CHECK(l.rope_of(5).factor == 8.0);
  CHECK(l.rope_of(0).theta == 10000.0);
  CHECK(l.rope_of(0).type == ops::RopeType::kDefault);

  // What strata does not compute is refused, naming the key.
  json j = fixture_config("gemma2_untied_f32");
  j["hidden_activation"] = "gelu";
  expect_refused(j, {"hidden_activation", "gelu_pytorch_tanh"});
  j = fixture_config("gemma3_untied_f32");
  j["use_bidirectional_attention"] = true;
  expect_refused(j, {"use_bidirectional_attention"});
  j = fixture_config("gemma3_untied_f32");
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10.0}};
  expect_refused(j, {"rope_parameters", "full_attention"});
  j = fixture_config("gemma2_untied_f32");
  j["model_type"] = "gemma3";
  expect_refused(j, {"text_config"});
}

TEST_CASE("families: a gemma3 config (Gemma3ForConditionalGeneration) is its text_config's text model, the vision "
          "tower counted and carried",
          "[nn][config][families][gemma]") {
  const json mm = fixture_config("gemma3mm_tied_f32");
  const DecoderConfig c = parse_decoder_config(mm);
  REQUIRE(c.multimodal);
  CHECK(c.model_type == "gemma3_text");
  CHECK(c.tie_word_embeddings);  // the top level's (Gemma3Config ties by default)
  CHECK(c.num_hidden_layers == 3);
  CHECK(c.qk_norm);
  CHECK(c.sliding_rope.has_value());
  CHECK(c.multimodal->image_tokens ==
        std::vector<std::pair<std::string, int64_t>>{{"image_token_index", 36}, {"boi_token_index", 34}, {"eoi_token_index", 35}});
  // The checkpoint's names: the text model under language_model.model., its head under language_model.
  const CheckpointNames& names = checkpoint_names(c);
  CHECK(names.file_name("model.layers.0.self_attn.q_proj.weight") == "language_model.model.layers.0.self_attn.q_proj.weight");
  CHECK(names.file_name("lm_head.weight") == "language_model.lm_head.weight");
  CHECK(names.model_name("language_model.model.norm.weight") == std::optional<std::string>("model.norm.weight"));
  CHECK_FALSE(names.model_name("model.norm.weight").has_value());
  CHECK(names.adapter_name("model.layers.1.self_attn.o_proj.lora_A.weight") ==
        "base_model.model.model.language_model.layers.1.self_attn.o_proj.lora_A.weight");
  CHECK(is_carried_tensor(c, "vision_tower.encoder.layers.0.mlp.fc1.weight"));
  CHECK(is_carried_tensor(c, "model.multi_modal_projector.mm_soft_emb_norm.weight"));
  CHECK_FALSE(is_carried_tensor(c, "language_model.model.norm.weight"));
  // transformers 5.24's counts (scripts/count-hf-params on the fixture's config.json):
  // Gemma3ForConditionalGeneration 18,360, its Gemma3ForCausalLM text model 6,608.
  CHECK(c.parameter_count() == 6608);
  CHECK(c.checkpoint_parameter_count() == 18360);
  // to_json: the gemma3 config with the text model as its text_config, which parses back.
  const json out = c.to_json();
  CHECK(out["model_type"] == "gemma3");
  CHECK(out["vision_config"] == mm["vision_config"]);
  for (const auto& [key, value] : mm["text_config"].items()) {
    INFO("text_config key " << key);
    CHECK(out["text_config"][key] == value);
  }
  CHECK_FALSE(out["text_config"].contains("architectures"));
  CHECK(parse_decoder_config(out).parameter_count() == c.parameter_count());
  CHECK(c.to_hf_json(DType::kBF16)["torch_dtype"] == "bfloat16");
  // Gemma3TextConfig's defaults fill an empty text_config, tied by the top level.
  const DecoderConfig d = parse_decoder_config(json{{"model_type", "gemma3"}, {"text_config", json::object()}});
  CHECK(d.hidden_size == 2304);
  CHECK(d.num_hidden_layers == 26);
  CHECK(d.vocab_size == 262208);
  CHECK(d.num_key_value_heads == 4);
  CHECK(d.head_dim == 256);
  CHECK(d.tie_word_embeddings);
  CHECK_FALSE(parse_decoder_config(json{{"model_type", "gemma3"}, {"tie_word_embeddings", false}}).tie_word_embeddings);
  // Refused by name: another class, another text model or vision tower, a text key at the top level.
  json j = mm;
  j["architectures"] = {"Gemma3ForCausalLM"};
  expect_refused(j, {"architectures", "Gemma3ForConditionalGeneration"});
  j = mm;
  j["text_config"]["model_type"] = "gemma2";
  expect_refused(j, {"text_config", "gemma3_text"});
  j = mm;
  j["vision_config"]["model_type"] = "clip_vision_model";
  expect_refused(j, {"vision_config", "siglip_vision_model"});
  j = mm;
  j["text_config"]["use_bidirectional_attention"] = true;
  expect_refused(j, {"text_config", "use_bidirectional_attention"});
  j = mm;
  j["quantization_config"] = {{"quant_method", "bitsandbytes"}};
  expect_refused(j, {"quantization_config"});
}

TEST_CASE("families: gpt-oss configs, with GptOssConfig's defaults, and what strata refuses", "[nn][config][families][gpt_oss]") {
  const DecoderConfig c = parse_decoder_config(fixture_config("gpt_oss_untied_f32"));
  CHECK(c.gpt_oss());
  CHECK(c.attention_sinks);
  CHECK(c.router_bias);
  CHECK(c.stacked_experts);
  CHECK(c.norm_topk_prob);
  CHECK(c.expert_act == ops::GluActivation::kClampedSwiglu);
  CHECK(c.glu_clamp.limit == 0.8f);
  CHECK(c.glu_clamp.alpha == 1.3f);
  CHECK(c.num_experts == 8);
  CHECK(c.moe_intermediate_size == 12);
  CHECK(c.sliding_layers == std::vector<bool>{true, false});
  CHECK(c.attention_mask(0).window == 3);
  CHECK(c.attention_mask(1).window == 0);
  CHECK(c.rope.type == ops::RopeType::kYarn);
  CHECK(c.rope.factor == 4.0);
  CHECK_FALSE(c.rope.truncate);
  // hf_tensors: the sinks, the router with its bias, the stacked experts as transformers saves them.
  std::map<std::string, Shape> shapes;
  for (const HfTensor& t : hf_tensors(c)) shapes[t.name] = t.shape;
  CHECK(shapes.at("model.layers.0.self_attn.sinks") == Shape{2});
  CHECK(shapes.at("model.layers.1.mlp.router.weight") == Shape{8, 16});
  CHECK(shapes.at("model.layers.1.mlp.router.bias") == Shape{8});
  CHECK(shapes.at("model.layers.0.mlp.experts.gate_up_proj") == Shape{8, 16, 24});
  CHECK(shapes.at("model.layers.0.mlp.experts.gate_up_proj_bias") == Shape{8, 24});
  CHECK(shapes.at("model.layers.0.mlp.experts.down_proj") == Shape{8, 12, 16});
  CHECK(shapes.at("model.layers.0.mlp.experts.down_proj_bias") == Shape{8, 16});
  CHECK(shapes.size() == 3 + 2 * 17);  // per layer: 2 norms, the sinks, 4 projections and their biases, router, experts
  const nn::SafetensorsFile weights =
      nn::SafetensorsFile::open(strata::test::source_dir() + "/tests/data/golden/gpt_oss_untied_f32/model.safetensors");
  CHECK(weights.names().size() == shapes.size());
  for (const auto& [name, shape] : shapes) CHECK(weights.entry(name).shape == shape);
  // The round trip keeps every piece.
  const json hf = c.to_hf_json(DType::kF32);
  CHECK(hf.at("architectures") == json::array({"GptOssForCausalLM"}));
  const DecoderConfig back = parse_decoder_config(hf);
  CHECK(back.to_hf_json(DType::kF32) == hf);
  CHECK(back.glu_clamp.alpha == 1.3f);
  CHECK(back.sliding_layers == c.sliding_layers);
  CHECK(back.parameter_count() == c.parameter_count());

  // GptOssConfig's defaults: YaRN (factor 32 over 4096, truncate false,
  // theta 150000), window 128 on the even layers, alpha 1.702, limit 7, biases.
  json d = fixture_config("gpt_oss_untied_f32");
  for (const char* k : {"rope_parameters", "layer_types", "sliding_window", "swiglu_alpha", "swiglu_limit",
                        "attention_bias", "num_local_experts", "num_experts_per_tok"}) {
    d.erase(k);
  }
  d["num_hidden_layers"] = 3;
  d["num_experts"] = 8;  // GptOssConfig's alias of num_local_experts
  const DecoderConfig def = parse_decoder_config(d);
  CHECK(def.rope.type == ops::RopeType::kYarn);
  CHECK(def.rope.theta == 150000.0);
  CHECK(def.rope.factor == 32.0);
  CHECK(def.rope.beta_fast == 32.0);
  CHECK(def.rope.beta_slow == 1.0);
  CHECK_FALSE(def.rope.truncate);
  CHECK(def.rope.original_max_position_embeddings == 4096.0);
  CHECK(def.sliding_window == 128);
  CHECK(def.sliding_layers == std::vector<bool>{true, false, true});
  CHECK(def.glu_clamp.alpha == 1.702f);
  CHECK(def.glu_clamp.limit == 7.0f);
  CHECK(def.attention_qkv_bias);
  CHECK(def.attention_o_bias);
  CHECK(def.num_experts == 8);
  CHECK(def.num_experts_per_tok == 4);

  // What strata does not compute is refused, naming the key.
  // gpt-oss's MXFP4 experts are read and dequantized (tests/train families "[quant]"); another method is refused.
  json j = fixture_config("gpt_oss_untied_f32");
  j["quantization_config"] = {{"quant_method", "mxfp4"}};
  CHECK(parse_decoder_config(j).quant.method == nn::QuantMethod::kMxfp4);
  j["quantization_config"] = {{"quant_method", "gptq"}};
  expect_refused(j, {"quantization_config", "gptq"});
  j = fixture_config("gpt_oss_untied_f32");
  j["rope_parameters"]["rope_type"] = "longrope";
  expect_refused(j, {"rope_type", "longrope"});
  j = fixture_config("gpt_oss_untied_f32");
  j["sliding_window"] = nullptr;
  expect_refused(j, {"sliding_window"});
  j = fixture_config("gpt_oss_untied_f32");
  j["layer_types"] = json::array({"sliding_attention", "chunked_attention"});
  expect_refused(j, {"layer_types", "chunked_attention"});
  j = fixture_config("gpt_oss_untied_f32");
  j["swiglu_limit"] = 0.0;
  expect_refused(j, {"swiglu_limit"});
  j = fixture_config("gpt_oss_untied_f32");
  j["swiglu_alpha"] = 1e300;  // the kernels' float: refused, never cast out of range
  expect_refused(j, {"swiglu_alpha", "float's range"});
  j = fixture_config("gpt_oss_untied_f32");
  j["num_local_experts"] = 8;
  j["num_experts"] = 4;
  expect_refused(j, {"num_local_experts", "num_experts"});
  j = fixture_config("gpt_oss_untied_f32");
  j["attention_dropout"] = 0.1;
  expect_refused(j, {"attention_dropout"});
  // Tensor parallelism: not with experts (expert parallelism instead).
  CHECK_THROWS_WITH(tensor_parallel_share(c, 2), Catch::Contains("mixture-of-experts"));
}
