// A Hugging Face directory must hold exactly the tensors its config.json's
// architecture uses: the fixtures transformers wrote load, single and
// sharded; a checkpoint of another family under a relabelled config.json, a
// missing tensor, a stray one or an untied lm_head under a tied config is
// refused before any work, naming the tensor.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "core/accelerator.h"
#include "core/error.h"
#include "runtime/nn/decoder_model.h"
#include "runtime/nn/safetensors.h"
#include "runtime/train/hf_model.h"
#include "tests/nn/config_checks.h"
#include "tests/nn/engine_rig.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_paths.h"

using namespace strata;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string fixture(const std::string& name) {
  return strata::test::source_dir() + "/tests/data/golden/" + name;
}

json read_json(const fs::path& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  return json::parse(in);
}

void write_json(const fs::path& path, const json& j) {
  std::ofstream out(path);
  out << j.dump(2);
  REQUIRE(out.good());
}

// A copy of fixture `name` in dir/sub: its config.json (edited by `edit`) and weights.
fs::path copy_fixture(const test::TempDir& dir, const std::string& name, const std::string& sub,
                      const std::function<void(json&)>& edit = {}) {
  const fs::path out = dir.path() / sub;
  fs::create_directories(out);
  json config = read_json(fixture(name) + "/config.json");
  if (edit) edit(config);
  write_json(out / "config.json", config);
  fs::copy_file(fixture(name) + "/model.safetensors", out / "model.safetensors");
  return out;
}

// The checkpoint of `name` rewritten as two shards and an index, with `extra`
// tensors added to the second shard.
fs::path shard_fixture(const test::TempDir& dir, const std::string& name, const std::string& sub,
                       const std::vector<std::string>& extra = {}) {
  const fs::path out = dir.path() / sub;
  fs::create_directories(out);
  fs::copy_file(fixture(name) + "/config.json", out / "config.json");
  const nn::SafetensorsFile file = nn::SafetensorsFile::open(fixture(name) + "/model.safetensors");
  nn::SafetensorsWriter first, second;
  json weight_map = json::object();
  const std::vector<std::string> names = file.names();
  for (size_t i = 0; i < names.size(); ++i) {
    const bool in_first = i < names.size() / 2;
    (in_first ? first : second).add(names[i], file.view(names[i]));
    weight_map[names[i]] = in_first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  for (const std::string& e : extra) {
    second.add(e, file.view("model.norm.weight"));
    weight_map[e] = "model-00002-of-00002.safetensors";
  }
  first.write((out / "model-00001-of-00002.safetensors").string());
  second.write((out / "model-00002-of-00002.safetensors").string());
  write_json(out / "model.safetensors.index.json", {{"metadata", json::object()}, {"weight_map", weight_map}});
  return out;
}

}  // namespace

TEST_CASE("hf model: every family's checkpoint loads, single and sharded", "[train][hf]") {
  test::TempDir dir("hf-model");
  for (const char* name : {"llama3_untied_f32", "mistral_tied_bf16", "qwen2_untied_f32", "qwen3_tied_bf16",
                           "mixtral_untied_bf16", "qwen3_moe_untied_f32", "qwen2_moe_tied_bf16"}) {
    INFO(name);
    CHECK_NOTHROW(train::load_hf_config(fixture(name)));
    const fs::path sharded = shard_fixture(dir, name, std::string(name) + "_sharded");
    const nn::DecoderConfig c = train::load_hf_config(sharded);
    // The weights land where the single file's do.
    test::Rig a, b;
    nn::DecoderModel ma(*a.engine, c), mb(*b.engine, c);
    a.engine->finalize();
    b.engine->finalize();
    train::load_hf_weights(*a.engine, ma.parameters(), fixture(name));
    train::load_hf_weights(*b.engine, mb.parameters(), sharded);
    for (size_t i = 0; i < ma.parameters().size(); ++i) {
      CHECK(a.param_values(ma.parameters()[i]) == b.param_values(mb.parameters()[i]));
    }
  }
  // Derived rotary buffers of old checkpoints are not weights: let through.
  CHECK_NOTHROW(train::load_hf_config(
      shard_fixture(dir, "qwen2_untied_f32", "inv_freq", {"model.layers.0.self_attn.rotary_emb.inv_freq"})));
}

TEST_CASE("hf model: a checkpoint that is not the architecture config.json names is refused", "[train][hf]") {
  test::TempDir dir("hf-model");
  // A Qwen2 checkpoint labelled llama: its q/k/v biases would be dropped.
  test::expect_checkpoint_refused(copy_fixture(dir, "qwen2_untied_f32", "qwen2_as_llama",
                              [](json& c) {
                                c["model_type"] = "llama";
                                for (const char* k : {"use_sliding_window", "sliding_window", "max_window_layers",
                                                      "layer_types"}) {
                                  c.erase(k);
                                }
                              }),
                 {"'model.layers.0.self_attn.k_proj.bias'", "model_type \"llama\"", "Qwen2", "5 more tensors",
                  "refuses"});
  // A Qwen3 checkpoint labelled qwen2: the q/k norms would be dropped.
  test::expect_checkpoint_refused(copy_fixture(dir, "qwen3_untied_f32", "qwen3_as_qwen2",
                              [](json& c) {
                                c["model_type"] = "qwen2";
                                c.erase("attention_bias");
                              }),
                 {"k_norm.weight'", "Qwen3"});
  // A Llama labelled qwen2 lacks the biases qwen2 has.
  test::expect_checkpoint_refused(copy_fixture(dir, "llama_untied_f32", "llama_as_qwen2",
                              [](json& c) {
                                c["model_type"] = "qwen2";
                                for (const char* k : {"attention_bias", "mlp_bias", "pretraining_tp"}) c.erase(k);
                              }),
                 {"has no tensor 'model.layers.0.self_attn.k_proj.bias'"});
  // Tied in config.json, but the checkpoint's lm_head is its own matrix.
  const fs::path untied = shard_fixture(dir, "llama3_untied_f32", "untied_as_tied");
  {
    json c = read_json(untied / "config.json");
    c["tie_word_embeddings"] = true;
    write_json(untied / "config.json", c);
  }
  test::expect_checkpoint_refused(untied, {"lm_head.weight", "differs", "tie_word_embeddings"});
  // A stray tensor in a shard, and an index that maps a tensor to a file without it.
  test::expect_checkpoint_refused(shard_fixture(dir, "mistral_untied_f32", "stray", {"model.layers.2.input_layernorm.weight"}),
                 {"'model.layers.2.input_layernorm.weight'", "model-00002-of-00002.safetensors"});
  const fs::path bad_index = shard_fixture(dir, "mistral_untied_f32", "bad_index");
  {
    json index = read_json(bad_index / "model.safetensors.index.json");
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors";
    write_json(bad_index / "model.safetensors.index.json", index);
  }
  test::expect_checkpoint_refused(bad_index, {"model.norm.weight"});
}

TEST_CASE("hf model: MoE experts are read one tensor per expert, and transformers 5's fused in-memory layout is refused",
          "[train][hf][moe]") {
  test::TempDir dir("hf-model");
  test::expect_checkpoint_refused(shard_fixture(dir, "qwen3_moe_untied_f32", "fused", {"model.layers.0.mlp.experts.gate_up_proj"}),
                 {"'model.layers.0.mlp.experts.gate_up_proj'", "fused", "save_pretrained"});
  // A Mixtral checkpoint labelled qwen3_moe: its experts have other names.
  test::expect_checkpoint_refused(copy_fixture(dir, "mixtral_untied_f32", "mixtral_as_qwen3_moe",
                              [](json& c) {
                                c["model_type"] = "qwen3_moe";
                                c["architectures"] = {"Qwen3MoeForCausalLM"};
                                c.erase("router_jitter_noise");
                              }),
                 {"block_sparse_moe", "model_type \"qwen3_moe\""});
  // A shared expert in a qwen3_moe checkpoint: Qwen2-MoE's, which qwen3_moe does not have.
  test::expect_checkpoint_refused(shard_fixture(dir, "qwen3_moe_untied_f32", "shared", {"model.layers.0.mlp.shared_expert_gate.weight"}),
                 {"'model.layers.0.mlp.shared_expert_gate.weight'", "model_type qwen2_moe"});
}

TEST_CASE("hf model: load_hf_weights itself refuses a tensor no parameter claims", "[train][hf]") {
  // Even without load_hf_config's check (a caller that reads config.json itself).
  const nn::DecoderConfig qwen2 = nn::load_decoder_config(fixture("qwen2_untied_f32") + "/config.json");
  nn::DecoderConfig as_llama = qwen2;
  as_llama.model_type = "llama";
  as_llama.attention_qkv_bias = false;
  as_llama.sliding_window = 0;
  as_llama.sliding_layers.clear();
  test::Rig rig;
  nn::DecoderModel model(*rig.engine, as_llama);
  rig.engine->finalize();
  REQUIRE_THROWS_WITH(train::load_hf_weights(*rig.engine, model.parameters(), fixture("qwen2_untied_f32")),
                      Catch::Contains("q_proj.bias' matches no parameter") ||
                          Catch::Contains("k_proj.bias' matches no parameter"));
}
