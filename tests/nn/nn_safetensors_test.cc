// safetensors reader/writer: round trips, model weights by HF name, and
// corrupt files that must fail with errors naming the tensor.
#include <catch2/catch.hpp>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/core/error.h"
#include "runtime/nn/llama_model.h"
#include "tests/nn/test_models.h"
#include "runtime/nn/llama_weights.h"
#include "runtime/nn/safetensors.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace strata::nn;

namespace {

// Writes a file from a raw header string and data bytes (header length as given
// unless overridden), for building corrupt files.
// A file with `header` (padded with spaces to 8 bytes, as conforming writers
// do, unless pad is false) and data_nbytes bytes of data.
void write_raw(const std::string& path, std::string header, size_t data_nbytes,
               int64_t header_len_override = -1, bool pad = true) {
  if (pad) header.append((8 - header.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary);
  uint64_t len =
      header_len_override >= 0 ? static_cast<uint64_t>(header_len_override) : header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((len >> (8 * i)) & 0xff));
  out << header;
  out << std::string(data_nbytes, '\x01');
}

void expect_open_error(const std::string& path, const std::string& needle) {
  try {
    SafetensorsFile::open(path);
    FAIL("expected an error mentioning '" << needle << "'");
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.category() == ErrorCategory::kBadArgument);
    CHECK(std::string(e.what()).find(needle) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("safetensors round trip of fp32, fp16 and bf16 tensors with metadata",
          "[nn][safetensors]") {
  test::TempDir dir("nn-st");
  Tensor a = Tensor::host(DType::kF32, {3, 4});
  Tensor b = Tensor::host(DType::kBF16, {5});
  Tensor c = Tensor::host(DType::kF16, {2, 1, 3});
  for (int i = 0; i < 12; ++i) a.as<float>()[i] = 0.5f * static_cast<float>(i) - 2.0f;
  for (int i = 0; i < 5; ++i) b.as<BFloat16>()[i] = float_to_bf16(1.0f + static_cast<float>(i));
  for (int i = 0; i < 6; ++i) c.as<Half>()[i] = float_to_half(-3.0f * static_cast<float>(i));
  SafetensorsWriter w;
  w.add("a.weight", a.view());
  w.add("b", b.view());
  w.add("c.bias", c.view());
  w.set_metadata("format", "pt");
  REQUIRE_THROWS_AS(w.add("b", b.view()), Error);
  w.write(dir.file("x.safetensors"));

  const SafetensorsFile f = SafetensorsFile::open(dir.file("x.safetensors"));
  CHECK(f.names() == std::vector<std::string>{"a.weight", "b", "c.bias"});
  CHECK(f.metadata().at("format") == "pt");
  CHECK(f.entry("c.bias").shape == Shape{2, 1, 3});
  CHECK(f.entry("b").dtype == DType::kBF16);
  CHECK(std::memcmp(f.view("a.weight").data, a.data(), a.nbytes()) == 0);
  CHECK(std::memcmp(f.view("b").data, b.data(), b.nbytes()) == 0);
  CHECK(std::memcmp(f.view("c.bias").data, c.data(), c.nbytes()) == 0);
  // The data section starts 8-byte aligned.
  CHECK(reinterpret_cast<uintptr_t>(f.view("a.weight").data) % 8 == 0);

  Tensor back = Tensor::host(DType::kF32, {5});
  REQUIRE_THROWS_WITH(f.read("b", back.view()), Catch::Contains("'b'") && Catch::Contains("dtype"));
  f.read("b", back.view(), /*allow_convert=*/true);
  CHECK(back.as<float>()[4] == 5.0f);
  Tensor wrong_shape = Tensor::host(DType::kF32, {4, 3});
  REQUIRE_THROWS_WITH(f.read("a.weight", wrong_shape.view()),
                      Catch::Contains("'a.weight'") && Catch::Contains("shape"));
  REQUIRE_THROWS_WITH(f.entry("missing"), Catch::Contains("'missing'"));
}

TEST_CASE("model weights round trip through safetensors by HF name", "[nn][safetensors]") {
  test::TempDir dir("nn-st-model");
  const LlamaConfig c = tiny_llama(16, 16, 24, 1, 2, 1);
  std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6, 7, 8}, targets = {2, 3, 4, 5, 6, 7, 8, 9};

  ResidentEngine ea, eb;
  LlamaModel a(ea, c, model_options(DType::kBF16));
  LlamaModel b(eb, c, model_options(DType::kF32));
  initialize_parameters(ea, a.parameters(), 1);
  initialize_parameters(eb, b.parameters(), 2);
  save_parameters(ea, a.parameters(), dir.file("model.safetensors"));
  const SafetensorsFile f = SafetensorsFile::open(dir.file("model.safetensors"));
  CHECK(f.contains("model.layers.0.self_attn.q_proj.weight"));
  CHECK(f.contains("lm_head.weight"));
  CHECK(f.entry("model.embed_tokens.weight").dtype == DType::kBF16);
  CHECK(f.entry("model.layers.0.mlp.down_proj.weight").shape == Shape{16, 24});

  load_parameters(eb, b.parameters(), dir.file("model.safetensors"));  // bf16 -> fp32
  CHECK(a.forward(ids, targets, 1, 8) == Approx(b.forward(ids, targets, 1, 8)).epsilon(1e-6));

  // A model that lacks lm_head (tied) finds an unclaimed tensor in the file.
  LlamaConfig tied = c;
  tied.tie_word_embeddings = true;
  ResidentEngine et;
  LlamaModel t(et, tied);
  // A tied model refuses a file whose lm_head differs from its embeddings,
  // even when unused tensors are allowed: it would silently compute otherwise.
  REQUIRE_THROWS_WITH(load_parameters(et, t.parameters(), dir.file("model.safetensors")),
                      Catch::Contains("lm_head.weight") && Catch::Contains("tie_word_embeddings"));
  REQUIRE_THROWS_WITH(load_parameters(et, t.parameters(), dir.file("model.safetensors"), /*allow_unused=*/true),
                      Catch::Contains("tie_word_embeddings"));
  // A model with a bigger layer finds a shape mismatch naming the tensor.
  LlamaConfig wider = c;
  wider.intermediate_size = 32;
  ResidentEngine ew;
  LlamaModel m(ew, wider);
  REQUIRE_THROWS_WITH(
      load_parameters(ew, m.parameters(), dir.file("model.safetensors")),
      Catch::Contains("model.layers.0.mlp.gate_proj.weight") && Catch::Contains("shape"));
}

TEST_CASE("a model with tiled MLP loads and saves untiled HF tensors and computes the same",
          "[nn][safetensors][tiled]") {
  test::TempDir dir("nn-st-tiled");
  LlamaConfig c = tiny_llama(16, 16, 40, 2, 2, 2);
  c.mlp_bias = true;
  std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10},
                       targets = {2, 3, 4, 5, 6, 7, 8, 9, 10, 11};

  ResidentEngine ep, et;
  LlamaModel plain(ep, c);
  LlamaModelOptions tiled_options;
  tiled_options.mlp_tiling = {3, 2};
  LlamaModel tiled(et, c, tiled_options);
  CHECK(tiled.parameters().size() > plain.parameters().size());
  initialize_parameters(ep, plain.parameters(), 9, 0.2);
  save_parameters(ep, plain.parameters(), dir.file("plain.safetensors"));
  load_parameters(et, tiled.parameters(), dir.file("plain.safetensors"));
  const double lp = plain.forward(ids, targets, 2, 5), lt = tiled.forward(ids, targets, 2, 5);
  CHECK(lt == Approx(lp).epsilon(1e-6));
  plain.backward();
  tiled.backward();
  const float* gp = ep.grad(ep.find("model.layers.1.mlp.up_proj.bias")).as<float>();
  const float* gt = et.grad(et.find("model.layers.1.mlp.up_proj.bias.tile_1")).as<float>();
  for (int i = 0; i < 20; ++i) CHECK(gt[i] == Approx(gp[20 + i]).margin(1e-6));

  // Saved from tiles: the same HF names and bytes as the untiled model's file.
  save_parameters(et, tiled.parameters(), dir.file("tiled.safetensors"));
  const SafetensorsFile a = SafetensorsFile::open(dir.file("plain.safetensors"));
  const SafetensorsFile b = SafetensorsFile::open(dir.file("tiled.safetensors"));
  REQUIRE(a.names() == b.names());
  CHECK(b.contains("model.layers.0.mlp.down_proj.weight"));
  for (const std::string& name : a.names()) {
    INFO(name);
    REQUIRE(a.view(name).nbytes() == b.view(name).nbytes());
    CHECK(std::memcmp(a.view(name).data, b.view(name).data, a.view(name).nbytes()) == 0);
  }
}

TEST_CASE("corrupt safetensors files fail with clear errors", "[nn][safetensors]") {
  test::TempDir dir("nn-st-bad");
  const std::string p = dir.file("bad.safetensors");
  const std::string good = R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";

  write_raw(p, "", 0);
  expect_open_error(p, "not valid JSON");
  { std::ofstream(p, std::ios::binary) << "abc"; }
  expect_open_error(p, "too short");
  write_raw(p, good, 16, /*header_len_override=*/1 << 20);
  expect_open_error(p, "header length");
  write_raw(p, "{\"w\": [", 16);
  expect_open_error(p, "not valid JSON");
  write_raw(p, "[1, 2]", 0);
  expect_open_error(p, "JSON object");
  write_raw(p, good, 8);  // data section too short
  expect_open_error(p, "'w' data_offsets [0, 16] out of range");
  write_raw(p, R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,16]}})", 16);
  expect_open_error(p, "'w' has 16 bytes but shape [2, 3]");
  write_raw(p, R"({"w":{"dtype":"I64","shape":[2],"data_offsets":[0,16]}})", 16);
  expect_open_error(p, "'w' has dtype 'I64'");
  write_raw(p, R"({"w":{"dtype":"F32","shape":[2,-2],"data_offsets":[0,16]}})", 16);
  expect_open_error(p, "'w' has a shape entry");
  write_raw(p, R"({"w":{"dtype":"F32","shape":[2,2]}})", 16);
  expect_open_error(p, "'w' needs");
  write_raw(p, R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[8,4]}})", 16);
  expect_open_error(p, "'w' data_offsets");
  write_raw(
      p,
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
      16);
  expect_open_error(p, "overlap");
  write_raw(
      p, R"({"__metadata__":{"k":1},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})", 16);
  expect_open_error(p, "__metadata__");

  // A deeply nested value is reported by its kind, never echoed (dump() of it
  // would recurse off the stack).
  write_raw(p, "{\"w\":" + std::string(200000, '[') + std::string(200000, ']') + "}", 0);
  expect_open_error(p, "got a list of 1");
  // An element-misaligned tensor is refused (header not padded to 8 bytes).
  write_raw(p, R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}} )", 16, -1, /*pad=*/false);
  expect_open_error(p, "not a multiple of its 4-byte elements");
  // A zero-sized tensor may share its offset with the next one (the reference
  // writer produces this); it is not an overlap.
  write_raw(p, R"({"b":{"dtype":"BF16","shape":[8],"data_offsets":[0,16]},"z":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})",
            16);
  CHECK(SafetensorsFile::open(p).entry("z").shape == Shape{0});

  write_raw(p, good, 16);  // and the well-formed one opens
  CHECK(SafetensorsFile::open(p).entry("w").shape == Shape{2, 2});
  try {
    SafetensorsFile::open(dir.file("absent.safetensors"));
    FAIL("expected kIo");
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::kIo);
    CHECK(std::string(e.what()).find("absent.safetensors") != std::string::npos);
  }
}
