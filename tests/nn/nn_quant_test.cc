// Quantized checkpoints (runtime/nn/checkpoint_quant.h) against transformers
// and torch (scripts/make-golden-quant): torch's float8_e4m3fn codes both
// ways, MXFP4 as convert_moe_packed_tensors gives it, and a tiny DeepSeek-V3
// checkpoint quantized as DeepSeek's are (ragged edge blocks, two shards)
// loaded into fp32 and bf16 masters bit for bit equal to transformers'
// dequantization; and every malformed checkpoint or config refused by name.
#include <catch2/catch.hpp>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/mxfp4_blocks.h"
#include "runtime/nn/checkpoint_quant.h"
#include "runtime/nn/decoder_model.h"
#include "runtime/nn/safetensors.h"
#include "runtime/train/hf_model.h"
#include "tests/nn/config_checks.h"
#include "tests/nn/engine_rig.h"
#include "tests/nn/quant_checks.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_paths.h"

using namespace strata;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string golden(const std::string& name) {
  return strata::test::source_dir() + "/tests/data/golden/" + name;
}

// Runs `call` and checks it is refused (kBadArgument) naming op `op` and `says`.
void expect_op_refused(const std::function<void()>& call, const std::string& op, const std::string& says) {
  try {
    call();
    FAIL("accepted; expected: " << says);
  } catch (const Error& e) {
    CHECK(e.category() == ErrorCategory::kBadArgument);
    CHECK_THAT(e.what(), Catch::Contains(op) && Catch::Contains(says));
  }
}

// The bytes of `view`, for bit-for-bit comparisons.
std::vector<uint8_t> bytes_of(const TensorView& view) {
  const auto* p = static_cast<const uint8_t*>(view.data);
  return {p, p + view.nbytes()};
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

// A copy of the FP8 fixture, config.json edited by `edit` and each shard's
// tensors by `tensors` (name -> view; erase or replace entries).
using Tensors = std::map<std::string, TensorView>;
fs::path fp8_copy(const test::TempDir& dir, const std::string& sub, const std::function<void(json&)>& edit,
                  const std::function<void(const std::string& file, Tensors&)>& tensors = {}) {
  const fs::path src = golden("fp8_deepseek_v3"), out = dir.path() / sub;
  fs::create_directories(out);
  json config = read_json(src / "config.json");
  if (edit) edit(config);
  write_json(out / "config.json", config);
  json index = read_json(src / "model.safetensors.index.json");
  for (const char* file : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}) {
    const nn::SafetensorsFile f = nn::SafetensorsFile::open((src / file).string());
    Tensors views;
    for (const std::string& name : f.names()) views[name] = f.view(name);
    if (tensors) tensors(file, views);
    nn::SafetensorsWriter w;
    for (const auto& [name, view] : views) {
      w.add(name, view);
      index["weight_map"][name] = file;
    }
    w.write((out / file).string());
  }
  for (auto it = index["weight_map"].begin(); it != index["weight_map"].end();) {
    bool held = false;
    for (const char* file : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"})
      held = held || nn::SafetensorsFile::open((out / file).string()).contains(it.key());
    it = held ? std::next(it) : index["weight_map"].erase(it);
  }
  write_json(out / "model.safetensors.index.json", index);
  return out;
}

void expect_config_refused(const json& qc, std::initializer_list<std::string> needles,
                           const std::string& model_type = "deepseek_v3") {
  try {
    nn::parse_checkpoint_quant(qc, "config.json", model_type);
    FAIL("accepted " << qc.dump());
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.category() == ErrorCategory::kBadArgument);
    for (const std::string& n : needles) CHECK_THAT(e.what(), Catch::Contains(n));
  }
}

constexpr const char* kKvA = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight";

}  // namespace

TEST_CASE("quant: fp8 e4m3 codes widen and round as torch's float8_e4m3fn", "[nn][quant]") {
  const nn::SafetensorsFile t = nn::SafetensorsFile::open(golden("quant/tables.safetensors"));
  const TensorView values = t.view("e4m3_values");
  REQUIRE(values.numel() == 256);
  for (int code = 0; code < 256; ++code) {
    INFO("code " << code);
    const float want = static_cast<const float*>(values.data)[code];
    const float got = fp8_e4m3_to_float(static_cast<uint8_t>(code));
    if (std::isnan(want)) {
      CHECK(std::isnan(got));
      continue;
    }
    CHECK(std::bit_cast<uint32_t>(got) == std::bit_cast<uint32_t>(want));
    CHECK(float_to_fp8_e4m3(got) == code);  // every value round-trips to its own code
  }
  const TensorView probe = t.view("probe_f32"), codes = t.view("probe_e4m3");
  REQUIRE(probe.desc.dtype == DType::kF32);
  REQUIRE(codes.desc.dtype == DType::kU8);
  for (int64_t i = 0; i < probe.numel(); ++i) {
    const float x = static_cast<const float*>(probe.data)[i];
    INFO("value " << x);
    CHECK(int{float_to_fp8_e4m3(x)} == int{static_cast<const uint8_t*>(codes.data)[i]});
  }
}

TEST_CASE("quant: MXFP4 dequantizes as transformers' convert_moe_packed_tensors, fp32 bf16 fp16", "[nn][quant]") {
  const nn::SafetensorsFile t = nn::SafetensorsFile::open(golden("quant/tables.safetensors"));
  const TensorView blocks = t.view("blocks"), scales = t.view("scales");
  for (const auto& [name, dtype] : {std::pair{"mxfp4_f32", DType::kF32}, std::pair{"mxfp4_bf16", DType::kBF16},
                                    std::pair{"mxfp4_f16", DType::kF16}}) {
    INFO(name);
    const TensorView want = t.view(name);
    REQUIRE(want.desc.shape == Shape({2, 64, 6}));
    Tensor got = Tensor::host(dtype, want.desc.shape);
    nn::dequantize_mxfp4(blocks, scales, 0, got.numel(), got.data(), dtype);
    CHECK(bytes_of(got.view()) == bytes_of(want));
    // Any range reads the same elements (the loader reads owned ranges).
    Tensor part = Tensor::host(dtype, {100});
    nn::dequantize_mxfp4(blocks, scales, 333, 100, part.data(), dtype);
    CHECK(std::memcmp(part.data(), static_cast<const char*>(want.data) + 333 * dtype_nbytes(dtype),
                      100 * dtype_nbytes(dtype)) == 0);
  }
}

TEST_CASE("quant: an MXFP4 expert's weight reads, packs to its kept form (4.25 bits) by any range, and "
          "Ops::dequantize_mxfp4_blocks gives transformers' values bit for bit",
          "[nn][quant][ops]") {
  const nn::SafetensorsFile t = nn::SafetensorsFile::open(golden("quant/tables.safetensors"));
  const TensorView blocks = t.view("blocks"), scales = t.view("scales");
  REQUIRE(blocks.desc.shape == Shape({2, 6, 2, 16}));
  const auto* b = blocks.as<uint8_t>();
  const auto* s = scales.as<uint8_t>();
  // The stacked [2, 64, 6]; expert 1's weight of columns 1, 3, 5 (gpt-oss's
  // up_proj: step 2) is [3, 64], element (o, i) the stacked (1, i, 1 + 2 o).
  const kernels::Mxfp4Stacked stacked{2, 64, 6};
  const int64_t first_column = 1 * 6 + 1, step = 2, rows = 3;
  const kernels::Mxfp4Blocks shape{rows, 64};
  std::vector<uint8_t> kept(static_cast<size_t>(shape.stored_nbytes()));
  REQUIRE(kept.size() * 32 == static_cast<size_t>(shape.numel()) * 17);
  kernels::pack_mxfp4_columns(b, s, stacked, first_column, step, rows, 0, shape.stored_nbytes(), kept.data());
  // Any byte range packs to the whole's bytes (the loader writes each rank's slice).
  for (const auto& [first, n] : {std::pair<int64_t, int64_t>{0, 1}, {5, 90}, {95, 2}, {96, 6}, {31, 71}}) {
    INFO("bytes [" << first << ", " << first + n << ")");
    std::vector<uint8_t> part(static_cast<size_t>(n));
    kernels::pack_mxfp4_columns(b, s, stacked, first_column, step, rows, first, n, part.data());
    CHECK(std::equal(part.begin(), part.end(), kept.begin() + first));
  }
  test::Rig rig;
  ops::Ops& ops = rig.engine->ops();
  ops::ComputeContext& ctx = rig.engine->compute();
  const TensorView packed{TensorDesc{DType::kU8, {shape.packed_nbytes()}, Tier::kCpu}, kept.data()};
  const TensorView grid{TensorDesc{DType::kU8, {rows, 2}, Tier::kCpu}, kept.data() + shape.packed_nbytes()};
  for (const auto& [name, dtype] : {std::pair{"mxfp4_f32", DType::kF32}, std::pair{"mxfp4_bf16", DType::kBF16},
                                    std::pair{"mxfp4_f16", DType::kF16}}) {
    INFO(name);
    const size_t esize = dtype_nbytes(dtype);
    const std::vector<uint8_t> want = test::mxfp4_expert_golden(t, name, dtype);
    // The loader's reading of the weight, whole and from an odd element.
    std::vector<uint8_t> got(want.size());
    kernels::dequantize_mxfp4_columns(b, s, stacked, first_column, step, 0, shape.numel(), got.data(), dtype);
    CHECK(got == want);
    kernels::dequantize_mxfp4_columns(b, s, stacked, first_column, step, 37, 101, got.data(), dtype);
    CHECK(std::memcmp(got.data(), want.data() + 37 * esize, 101 * esize) == 0);
    // A host range of the kept form from an odd element.
    kernels::dequantize_mxfp4(kept.data() + 37 / 2, kept.data() + shape.packed_nbytes(), 37, 101, got.data(), dtype);
    CHECK(std::memcmp(got.data(), want.data() + 37 * esize, 101 * esize) == 0);
  }
  // The kept form through the op (the same weight; nn_golden_cuda_test runs it on cuda).
  CHECK(test::check_mxfp4_dequantize_golden(rig) == 3);
  // Refused before anything is enqueued, naming the argument.
  const Tensor p = test::upload(rig, packed), g = test::upload(rig, grid);
  const auto refused = [&](const std::function<void()>& call, const std::string& says) {
    expect_op_refused(call, "dequantize_mxfp4_blocks", says);
  };
  Tensor cols48 = rig.accelerator->allocate_tensor(DType::kBF16, {4, 48});
  refused([&] { ops.dequantize_mxfp4_blocks(ctx, p.view(), g.view(), cols48.view()); }, "a multiple of 32");
  Tensor more = rig.accelerator->allocate_tensor(DType::kBF16, {6, 64});
  refused([&] { ops.dequantize_mxfp4_blocks(ctx, p.view(), g.view(), more.view()); }, "packed has shape");
  Tensor out = rig.accelerator->allocate_tensor(DType::kBF16, {rows, 64});
  refused([&] { ops.dequantize_mxfp4_blocks(ctx, g.view(), g.view(), out.view()); }, "packed has shape");
  refused([&] { ops.dequantize_mxfp4_blocks(ctx, p.view(), p.view(), out.view()); }, "scales has shape");
}

TEST_CASE("quant: a DeepSeek-V3 FP8 checkpoint loads to transformers' dequantized values bit for bit", "[nn][quant]") {
  const fs::path dir = golden("fp8_deepseek_v3");
  const nn::DecoderConfig config = train::load_hf_config(dir);
  REQUIRE(config.quant.method == nn::QuantMethod::kFp8Block);
  const nn::SafetensorsFile want = nn::SafetensorsFile::open((dir / "dequantized.safetensors").string());
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    INFO(dtype_name(dtype));
    test::Rig rig;
    nn::DecoderModelOptions options;
    options.dtype = dtype;
    nn::DecoderModel model(*rig.engine, config, options);
    rig.engine->finalize();
    train::load_hf_weights(*rig.engine, model.parameters(), dir, {}, config.quant);
    int quantized = 0;
    bool ragged_both = false;
    for (engine::ParamId id : model.parameters()) {
      const engine::ParamInfo& info = rig.engine->param_info(id);
      INFO(info.name);
      std::vector<uint8_t> got;
      rig.engine->for_each_owned_range(id, engine::Engine::Access::kRead, [&](int64_t, const TensorView& host) {
        const std::vector<uint8_t> b = bytes_of(host);
        got.insert(got.end(), b.begin(), b.end());
      });
      const std::string golden_name = info.name + (dtype == DType::kF32 ? ".f32" : ".bf16");
      if (want.contains(golden_name)) {
        CHECK(got == bytes_of(want.view(golden_name)));
        ++quantized;
        ragged_both = ragged_both || (info.shape == Shape({144, 136}));
      }
    }
    CHECK(quantized == 22);  // every FP8 weight of the fixture
    CHECK(ragged_both);      // kv_a_proj_with_mqa: ragged rows and columns
  }
}

TEST_CASE("quant: quantization configs strata does not compute are refused by name", "[nn][quant]") {
  const json v3 = {{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"},
                   {"weight_block_size", {128, 128}}};
  nn::CheckpointQuant q = nn::parse_checkpoint_quant(v3, "config.json", "deepseek_v3");
  CHECK(q.method == nn::QuantMethod::kFp8Block);
  json v31 = v3;
  v31["scale_fmt"] = "ue8m0";  // DeepSeek-V3.1: power-of-two scales, the same arithmetic
  CHECK(nn::parse_checkpoint_quant(v31, "config.json", "deepseek_v3").ue8m0);
  expect_config_refused({{"quant_method", "bitsandbytes"}, {"load_in_4bit", true}}, {"quant_method", "bitsandbytes"});
  expect_config_refused({{"quant_method", "gptq"}}, {"quant_method", "gptq"});
  json j = v3;
  j["fmt"] = "e5m2";
  expect_config_refused(j, {"fmt", "e5m2", "e4m3"});
  j = v3;
  j["weight_block_size"] = nullptr;
  expect_config_refused(j, {"weight_block_size", "per-tensor"});
  j["weight_block_size"] = {128};
  expect_config_refused(j, {"weight_block_size"});
  j["weight_block_size"] = {0, 128};
  expect_config_refused(j, {"weight_block_size"});
  j = v3;
  j["activation_scheme"] = "static";
  expect_config_refused(j, {"activation_scheme", "static"});
  j = v3;
  j["scale_fmt"] = "e8m0x";
  expect_config_refused(j, {"scale_fmt"});
  j = v3;
  j["modules_to_convert"] = {"model.embed_tokens"};
  expect_config_refused(j, {"modules_to_convert", "embeddings"});
  j = v3;
  j["expert_dtype"] = "fp4";
  expect_config_refused(j, {"expert_dtype", "fp4"});
  j = v3;
  j["modules_to_not_convert"] = {"layers.(["};
  expect_config_refused(j, {"modules_to_not_convert", "layers.(["});
  // MXFP4 is gpt-oss's experts only (transformers' Mxfp4 quantizer).
  expect_config_refused({{"quant_method", "mxfp4"}}, {"mxfp4", "gpt_oss"}, "llama");
  CHECK(nn::parse_checkpoint_quant({{"quant_method", "mxfp4"},
                                    {"modules_to_not_convert", {"model.layers.*.self_attn", "lm_head"}}},
                                   "config.json", "gpt_oss")
            .method == nn::QuantMethod::kMxfp4);
  // The whole config.json: a bitsandbytes checkpoint is refused naming its method.
  json config = read_json(golden("fp8_deepseek_v3/config.json"));
  config["quantization_config"] = {{"quant_method", "awq"}};
  CHECK_THROWS_WITH(nn::parse_decoder_config(config, "config.json"),
                    Catch::Contains("quant_method") && Catch::Contains("awq"));
}

TEST_CASE("quant: modules_to_not_convert matches as transformers' should_convert_module", "[nn][quant]") {
  nn::CheckpointQuant q;
  q.modules_to_not_convert = {"lm_head", "model.layers.1", "model.layers.*.mlp.gate", "q_a_proj"};
  CHECK(q.not_converted("lm_head"));
  CHECK(q.not_converted("model.layers.1.self_attn.o_proj"));       // a prefix up to a module boundary
  CHECK_FALSE(q.not_converted("model.layers.11.self_attn.o_proj"));  // not layer 11
  CHECK(q.not_converted("model.layers.7.mlp.gate"));                // a regex
  CHECK_FALSE(q.not_converted("model.layers.7.mlp.gate_proj"));     // ... with the same boundary
  CHECK(q.not_converted("model.layers.3.self_attn.q_a_proj"));      // a suffix
  CHECK_FALSE(q.not_converted("model.layers.3.self_attn.q_b_proj"));
}

TEST_CASE("quant: a malformed FP8 checkpoint is refused naming the tensor and its file", "[nn][quant]") {
  test::TempDir dir("quant");
  const std::string scale = std::string(kKvA) + "_scale_inv";
  // The scale grid lives in the first shard, its weight in the second.
  test::expect_checkpoint_refused(fp8_copy(dir, "no_scale", {}, [&](const std::string&, Tensors& t) { t.erase(scale); }),
                 {kKvA, "model-00002-of-00002.safetensors", "_scale_inv", "cannot be scaled"});
  // A grid of the wrong shape (truncated to one row of blocks).
  test::expect_checkpoint_refused(fp8_copy(dir, "short_grid", {},
                          [&](const std::string&, Tensors& t) {
                            if (!t.contains(scale)) return;
                            TensorView v = t.at(scale);
                            v.desc.shape = {1, 2};
                            t[scale] = v;
                          }),
                 {scale, "model-00001-of-00002.safetensors", "[1, 2]", "[2, 2]", "corrupt or truncated"});
  // Without quantization_config the FP8 bytes have no meaning.
  test::expect_checkpoint_refused(fp8_copy(dir, "no_config", [](json& c) { c.erase("quantization_config"); }),
                 {"F8_E4M3", "quantization_config", "model-0000"});
  // A module the config leaves unquantized but the checkpoint stores in FP8.
  test::expect_checkpoint_refused(fp8_copy(dir, "not_converted",
                          [](json& c) { c["quantization_config"]["modules_to_not_convert"] = {"kv_a_proj_with_mqa"}; }),
                 {"kv_a_proj_with_mqa", "modules_to_not_convert", "disagree"});
  // A scale beside a weight that is not FP8 (it would be dropped, the weight read unscaled).
  test::expect_checkpoint_refused(fp8_copy(dir, "bf16_scaled", {},
                          [&](const std::string&, Tensors& t) {
                            if (t.contains("model.norm.weight"))
                              t["model.norm.weight_scale_inv"] = t.at("model.norm.weight");
                          }),
                 {"model.norm.weight_scale_inv", "not FP8"});
  // A shard cut short: the safetensors reader names the file and the tensor out of range.
  const fs::path cut = fp8_copy(dir, "truncated", {});
  const fs::path shard = cut / "model-00002-of-00002.safetensors";
  fs::resize_file(shard, fs::file_size(shard) - 1000);
  try {
    train::load_hf_config(cut);
    FAIL("accepted a truncated shard");
  } catch (const Error& e) {
    INFO(e.what());
    CHECK_THAT(e.what(), Catch::Contains("model-00002-of-00002.safetensors") && Catch::Contains("out of range"));
  }
  // scale_fmt ue8m0 reads the same file the same way.
  CHECK_NOTHROW(train::load_hf_config(
      fp8_copy(dir, "ue8m0", [](json& c) { c["quantization_config"]["scale_fmt"] = "ue8m0"; })));
}

TEST_CASE("quant: FP8 blocks of any size dequantize the same whatever range is read", "[nn][quant]") {
  // [5, 7] in [2, 3] blocks: a [3, 3] grid, ragged in both directions.
  std::vector<uint8_t> codes(35);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>((i * 29 + 5) % 126);
  std::vector<float> scales(9);
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = 0.125f * static_cast<float>(i + 1);
  const TensorView w{TensorDesc{DType::kF8E4M3, {5, 7}, Tier::kCpu}, codes.data()};
  const TensorView s{TensorDesc{DType::kF32, {3, 3}, Tier::kCpu}, scales.data()};
  std::vector<float> whole(35);
  nn::dequantize_fp8_block(w, s, 2, 3, 0, 35, whole.data(), DType::kF32);
  for (int64_t i = 0; i < 35; ++i) {
    INFO("element " << i);
    const auto block = static_cast<size_t>((i / 7) / 2 * 3 + (i % 7) / 3);  // row block x 3 + column block
    const float want = fp8_e4m3_to_float(codes[static_cast<size_t>(i)]) * scales[block];
    CHECK(std::bit_cast<uint32_t>(whole[static_cast<size_t>(i)]) == std::bit_cast<uint32_t>(want));
  }
  // Every range (the loader reads owned ranges, split anywhere) gives the same elements.
  for (int64_t first = 0; first < 35; ++first) {
    for (int64_t n = 0; first + n <= 35; n += 3) {
      std::vector<float> part(static_cast<size_t>(n));
      nn::dequantize_fp8_block(w, s, 2, 3, first, n, part.data(), DType::kF32);
      CHECK(std::equal(part.begin(), part.end(), whole.begin() + first));
    }
  }
}

TEST_CASE("quant: Ops::dequantize_fp8_blocks gives transformers' dequantized bits for every FP8 weight of the "
          "fixture, and its front end refuses what is not an FP8 weight with its grid",
          "[nn][quant][ops]") {
  const test::Fp8Fixture fixture;
  const auto find = [&](const std::string& name) { return fixture.find(name); };
  test::Rig rig;
  ops::Ops& ops = rig.engine->ops();
  ops::ComputeContext& ctx = rig.engine->compute();
  const auto on_device = [&](const TensorView& host) { return test::upload(rig, host); };
  CHECK(test::check_fp8_dequantize_golden(rig, fixture) == 22);
  // Refused before anything is enqueued, naming the argument.
  const Tensor w = on_device(find("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"));  // [144, 136]
  const Tensor s = on_device(find("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"));
  Tensor out = rig.accelerator->allocate_tensor(DType::kBF16, {144, 136});
  const auto refused = [&](const std::function<void()>& call, const std::string& says) {
    expect_op_refused(call, "dequantize_fp8_blocks", says);
  };
  refused([&] { ops.dequantize_fp8_blocks(ctx, w.view(), s.view(), 64, 128, out.view()); }, "scale_inv has shape [2, 2]");
  refused([&] { ops.dequantize_fp8_blocks(ctx, s.view(), s.view(), 128, 128, out.view()); }, "weight has dtype fp32");
  refused([&] { ops.dequantize_fp8_blocks(ctx, w.view(), s.view(), 0, 128, out.view()); }, "blocks of 0 x 128");
  Tensor wrong = rig.accelerator->allocate_tensor(DType::kBF16, {136, 144});
  refused([&] { ops.dequantize_fp8_blocks(ctx, w.view(), s.view(), 128, 128, wrong.view()); }, "out has shape");
}

TEST_CASE("quant: an F8_E8M0 scale grid (transformers' ue8m0 saves) reads as its exponents and dequantizes to "
          "transformers' values bit for bit, and a plain uint8 grid is refused",
          "[nn][quant]") {
  const nn::SafetensorsFile t = nn::SafetensorsFile::open(golden("quant/tables.safetensors"));
  const nn::SafetensorsEntry& grid = t.entry("e8m0_weight_scale_inv");
  CHECK(grid.e8m0);
  CHECK(grid.dtype == DType::kU8);
  CHECK_FALSE(t.entry("scales").e8m0);  // MXFP4's exponents are stored U8
  const TensorView w = t.view("e8m0_weight"), s = t.view("e8m0_weight_scale_inv");
  const std::vector<float> values = nn::fp32_scale_grid(s);
  CHECK(values == std::vector<float>{std::ldexp(1.0f, -127), std::ldexp(1.0f, -10), 1.0f, std::ldexp(1.0f, 127)});
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    INFO(dtype_name(dtype));
    std::vector<uint8_t> got(static_cast<size_t>(w.numel()) * dtype_nbytes(dtype));
    nn::dequantize_fp8_block(w, s, 128, 128, 0, w.numel(), got.data(), dtype);
    CHECK(got == bytes_of(t.view(dtype == DType::kF32 ? "e8m0_f32" : "e8m0_bf16")));
  }
  // A checkpoint's catalogue: an F8_E8M0 grid scales its FP8 weight; uint8 bytes do not.
  const nn::CheckpointQuant q = nn::parse_checkpoint_quant(
      {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {128, 128}}, {"scale_fmt", "ue8m0"}},
      "config.json", "llama");
  nn::CheckpointTensors tensors;
  tensors["model.layers.0.mlp.up_proj.weight"] = {"model.safetensors", DType::kF8E4M3, {130, 136}};
  tensors["model.layers.0.mlp.up_proj.weight_scale_inv"] = {"model.safetensors", DType::kU8, {2, 2}, true};
  CHECK(nn::dequantized_view(q, tensors, "dir").quantized.size() == 1);
  tensors["model.layers.0.mlp.up_proj.weight_scale_inv"].e8m0 = false;
  CHECK_THROWS_WITH(nn::dequantized_view(q, tensors, "dir"),
                    Catch::Contains("up_proj.weight_scale_inv") && Catch::Contains("F8_E8M0"));
}
