// Model weights <-> Hugging Face safetensors by name, range by range: round
// trips across dtypes, tied/untied mismatches, shape errors, and a tiled MLP
// that loads and saves the untiled tensors.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/nn/decoder_model.h"
#include "runtime/nn/param_files.h"
#include "runtime/nn/safetensors.h"
#include "tests/nn/engine_rig.h"
#include "tests/nn/test_models.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace strata::nn;

namespace {

double eval_loss(DecoderModel& model, const std::vector<int32_t>& ids,
                 const std::vector<int32_t>& targets, int64_t batch, int64_t seq) {
  ForwardOptions eval;
  eval.backward = false;
  model.forward(ids, targets, batch, seq, eval);
  return model.loss();
}

}  // namespace

TEST_CASE("model weights round trip through safetensors by HF name", "[nn][safetensors]") {
  test::TempDir dir("nn-st-model");
  const DecoderConfig c = tiny_llama(16, 16, 24, 1, 2, 1);
  std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6, 7, 8}, targets = {2, 3, 4, 5, 6, 7, 8, 9};

  test::Rig ra, rb;
  DecoderModel a(*ra.engine, c, model_options(DType::kBF16));
  DecoderModel b(*rb.engine, c, model_options(DType::kF32));
  ra.engine->finalize();
  rb.engine->finalize();
  initialize_parameters(*ra.engine, a.parameters(), 1);
  initialize_parameters(*rb.engine, b.parameters(), 2);
  save_parameters(*ra.engine, a.parameters(), dir.file("model.safetensors"));
  const SafetensorsFile f = SafetensorsFile::open(dir.file("model.safetensors"));
  CHECK(f.contains("model.layers.0.self_attn.q_proj.weight"));
  CHECK(f.contains("lm_head.weight"));
  CHECK(f.entry("model.embed_tokens.weight").dtype == DType::kBF16);
  CHECK(f.entry("model.layers.0.mlp.down_proj.weight").shape == Shape{16, 24});
  CHECK(f.metadata().at("format") == "pt");

  load_parameters(*rb.engine, b.parameters(), dir.file("model.safetensors"));  // bf16 -> fp32
  CHECK(eval_loss(a, ids, targets, 1, 8) == Approx(eval_loss(b, ids, targets, 1, 8)).epsilon(1e-6));

  // A tied model refuses a file whose lm_head differs from its embeddings,
  // even when unused tensors are allowed: it would silently compute otherwise.
  DecoderConfig tied = c;
  tied.tie_word_embeddings = true;
  test::Rig rt;
  DecoderModel t(*rt.engine, tied);
  rt.engine->finalize();
  REQUIRE_THROWS_WITH(load_parameters(*rt.engine, t.parameters(), dir.file("model.safetensors")),
                      Catch::Contains("lm_head.weight") && Catch::Contains("tie_word_embeddings"));
  REQUIRE_THROWS_WITH(load_parameters(*rt.engine, t.parameters(), dir.file("model.safetensors"),
                                      /*allow_unused=*/true),
                      Catch::Contains("tie_word_embeddings"));
  // A model with a bigger layer finds a shape mismatch naming the tensor.
  DecoderConfig wider = c;
  wider.intermediate_size = 32;
  test::Rig rw;
  DecoderModel m(*rw.engine, wider);
  rw.engine->finalize();
  REQUIRE_THROWS_WITH(
      load_parameters(*rw.engine, m.parameters(), dir.file("model.safetensors")),
      Catch::Contains("model.layers.0.mlp.gate_proj.weight") && Catch::Contains("shape"));
}

TEST_CASE("a model with tiled MLP loads and saves untiled HF tensors and computes the same",
          "[nn][safetensors][tiled]") {
  test::TempDir dir("nn-st-tiled");
  DecoderConfig c = tiny_llama(16, 16, 40, 2, 2, 2);
  c.mlp_bias = true;
  std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10},
                       targets = {2, 3, 4, 5, 6, 7, 8, 9, 10, 11};

  test::Rig rp, rt;
  DecoderModel plain(*rp.engine, c);
  DecoderModelOptions tiled_options;
  tiled_options.mlp_tiling = {3, 2};
  DecoderModel tiled(*rt.engine, c, tiled_options);
  CHECK(tiled.parameters().size() > plain.parameters().size());
  rp.engine->finalize();
  rt.engine->finalize();
  initialize_parameters(*rp.engine, plain.parameters(), 9, 0.2);
  save_parameters(*rp.engine, plain.parameters(), dir.file("plain.safetensors"));
  load_parameters(*rt.engine, tiled.parameters(), dir.file("plain.safetensors"));
  rp.engine->zero_grad();
  rt.engine->zero_grad();
  plain.forward(ids, targets, 2, 5);
  tiled.forward(ids, targets, 2, 5);
  CHECK(tiled.loss() == Approx(plain.loss()).epsilon(1e-6));
  plain.backward();
  tiled.backward();
  const auto gp = rp.grad_values(rp.engine->find_parameter("model.layers.1.mlp.up_proj.bias"));
  const auto gt = rt.grad_values(rt.engine->find_parameter("model.layers.1.mlp.up_proj.bias.tile_1"));
  REQUIRE(gt.size() == 20);
  for (int i = 0; i < 20; ++i) CHECK(gt[i] == Approx(gp[20 + i]).margin(1e-6));

  // Saved from tiles: the same HF names and bytes as the untiled model's file.
  save_parameters(*rt.engine, tiled.parameters(), dir.file("tiled.safetensors"));
  const SafetensorsFile a = SafetensorsFile::open(dir.file("plain.safetensors"));
  const SafetensorsFile b = SafetensorsFile::open(dir.file("tiled.safetensors"));
  REQUIRE(a.names() == b.names());
  CHECK(b.contains("model.layers.0.mlp.down_proj.weight"));
  for (const std::string& name : a.names()) {
    INFO(name);
    REQUIRE(a.view(name).nbytes() == b.view(name).nbytes());
    CHECK(std::memcmp(a.view(name).data, b.view(name).data, a.view(name).nbytes()) == 0);
  }
  // Saving only some tiles of a tensor leaves it incomplete: refused, no file.
  auto some = tiled.parameters();
  some.erase(std::find_if(some.begin(), some.end(), [&](ParamId id) {
    return rt.engine->param_info(id).name == "model.layers.0.mlp.up_proj.weight.tile_1_2";
  }));
  REQUIRE_THROWS_WITH(save_parameters(*rt.engine, some, dir.file("partial.safetensors")),
                      Catch::Contains("bytes written"));
  CHECK_FALSE(std::filesystem::exists(dir.file("partial.safetensors")));
}
