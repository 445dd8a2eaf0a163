// FP8 block quantization as the export writes it (kernels/fp8_quantize.h,
// --export-dtype fp8) against torch (scripts/make-golden-fp8-export): codes
// and scale grids bit for bit, float and ue8m0 scales, ragged edge blocks,
// a zero block, an underflowing scale; every FP8 weight of the two FP8
// fixtures, dequantized (fp32 and bf16) and quantized again, gives back its
// stored bytes and scales (they were made with the same formula); and which
// weights an FP8 export quantizes.
#include <catch2/catch.hpp>

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/fp8_quantize.h"
#include "runtime/nn/checkpoint_quant.h"
#include "runtime/nn/fp8_export.h"
#include "runtime/nn/safetensors.h"
#include "tests/support/test_paths.h"

using namespace strata;

namespace {

std::string golden(const std::string& name) { return strata::test::source_dir() + "/tests/data/golden/" + name; }

std::vector<uint8_t> bytes_of(const TensorView& view) {
  const auto* p = static_cast<const uint8_t*>(view.data);
  return {p, p + view.nbytes()};
}

std::vector<uint8_t> bytes_of(const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * sizeof(float));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

struct Quantized {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};

Quantized quantize(const std::vector<float>& x, int64_t rows, int64_t cols, bool ue8m0) {
  const kernels::Fp8Blocks shape{rows, cols, 128, 128};
  Quantized q{std::vector<uint8_t>(static_cast<size_t>(rows * cols)),
              std::vector<float>(static_cast<size_t>(shape.grid_numel()))};
  kernels::quantize_fp8_blocks(x.data(), shape, ue8m0, q.codes.data(), q.scales.data());
  return q;
}

}  // namespace

TEST_CASE("fp8 export: the quantizer gives torch's codes and scales, float and ue8m0, ragged and zero blocks",
          "[nn][quant][fp8_export]") {
  const nn::SafetensorsFile t = nn::SafetensorsFile::open(golden("quant/fp8_export.safetensors"));
  int cases = 0;
  for (const char* name : {"ragged", "bf16", "column"}) {
    const TensorView x = t.view(name);
    REQUIRE(x.desc.dtype == (std::string(name) == "bf16" ? DType::kBF16 : DType::kF32));
    REQUIRE(x.desc.shape.size() == 2);
    std::vector<float> values(static_cast<size_t>(x.numel()));
    convert(x.data, x.desc.dtype, values.data(), DType::kF32, values.size());
    for (const bool ue8m0 : {false, true}) {
      const std::string prefix = std::string(name) + (ue8m0 ? ".ue8m0" : "");
      INFO(prefix);
      const Quantized q = quantize(values, x.desc.shape[0], x.desc.shape[1], ue8m0);
      CHECK(q.codes == bytes_of(t.view(prefix + ".q")));
      CHECK(bytes_of(q.scales) == bytes_of(t.view(prefix + ".scale_inv")));
      ++cases;
    }
  }
  CHECK(cases == 6);
  // The cases' edges, as the fixture holds them: the zero block's scale is
  // 1 and its codes the zeros' signs; the underflowing block's the smallest
  // subnormal (ue8m0: 2^-126).
  const auto* s = static_cast<const float*>(t.view("ragged.scale_inv").data);
  CHECK(s[3] == 1.0f);
  CHECK(s[2] == std::numeric_limits<float>::denorm_min());
  CHECK(static_cast<const float*>(t.view("ragged.ue8m0.scale_inv").data)[2] == std::numeric_limits<float>::min());
  CHECK(static_cast<const uint8_t*>(t.view("ragged.q").data)[129 * 136 + 135] == 0x80);
  CHECK(kernels::fp8_block_scale_inv(0.0f, true) == 1.0f);
  CHECK(kernels::fp8_block_scale_inv(448.0f, false) == 1.0f);
  CHECK(kernels::fp8_block_scale_inv(449.0f, true) == 2.0f);  // rounded up to a power of two
}

TEST_CASE("fp8 export: every FP8 weight of the FP8 fixtures, dequantized and quantized again, gives back its bytes "
          "and scales",
          "[nn][quant][fp8_export]") {
  int checked = 0;
  for (const std::vector<std::string>& files :
       {std::vector<std::string>{"fp8_deepseek_v3/model-00001-of-00002.safetensors",
                                 "fp8_deepseek_v3/model-00002-of-00002.safetensors"},
        std::vector<std::string>{"fp8_llama/model.safetensors"}}) {
    std::vector<nn::SafetensorsFile> shards;
    for (const std::string& f : files) shards.push_back(nn::SafetensorsFile::open(golden(f)));
    std::map<std::string, TensorView> views;
    for (const auto& shard : shards) {
      for (const std::string& name : shard.names()) views.emplace(name, shard.view(name));
    }
    for (const auto& [name, w] : views) {
      if (w.desc.dtype != DType::kF8E4M3) continue;
      const TensorView& scale = views.at(name + "_scale_inv");
      const int64_t rows = w.desc.shape[0], cols = w.desc.shape[1];
      // The run's values: dequantized into fp32, or into bf16 (a bf16 run's).
      for (const DType dtype : {DType::kF32, DType::kBF16}) {
        INFO(name << " via " << dtype_name(dtype));
        std::vector<char> deq(static_cast<size_t>(w.numel()) * dtype_nbytes(dtype));
        nn::dequantize_fp8_block(w, scale, 128, 128, 0, w.numel(), deq.data(), dtype);
        std::vector<float> x(static_cast<size_t>(w.numel()));
        convert(deq.data(), dtype, x.data(), DType::kF32, x.size());
        const Quantized q = quantize(x, rows, cols, false);
        CHECK(q.codes == bytes_of(w));
        CHECK(bytes_of(q.scales) == bytes_of(scale));
      }
      ++checked;
    }
  }
  CHECK(checked == 22 + 14);
}

TEST_CASE("fp8 export: the decoder layers' linear projections are quantized, never embeddings, lm_head, norms, "
          "routers, gates or biases",
          "[nn][quant][fp8_export]") {
  const nn::CheckpointQuant none;
  const Shape m{256, 128};
  for (const char* name : {"model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
                           "model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight",
                           "model.layers.2.block_sparse_moe.experts.0.w1.weight", "model.layers.0.mlp.shared_expert.gate_proj.weight"}) {
    INFO(name);
    CHECK(nn::fp8_export_weight(name, m, none));
  }
  for (const char* name : {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                           "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_a_layernorm.weight",
                           "model.layers.1.mlp.gate.weight", "model.layers.1.block_sparse_moe.gate.weight",
                           "model.layers.1.mlp.shared_expert_gate.weight", "model.layers.1.mlp.router.weight",
                           "model.layers.0.self_attn.q_proj.bias"}) {
    INFO(name);
    CHECK_FALSE(nn::fp8_export_weight(name, m, none));
  }
  CHECK_FALSE(nn::fp8_export_weight("model.layers.1.mlp.gate.e_score_correction_bias", {8}, none));
  CHECK_FALSE(nn::fp8_export_weight("model.layers.0.self_attn.q_proj.weight", {256}, none));
  // What the source's modules_to_not_convert leaves unquantized stays so.
  const nn::CheckpointQuant source = nn::parse_checkpoint_quant(
      {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}, {"modules_to_not_convert", {"model.layers.*.self_attn"}}},
      "config.json", "deepseek_v3");
  CHECK_FALSE(nn::fp8_export_weight("model.layers.4.self_attn.o_proj.weight", m, source));
  CHECK(nn::fp8_export_weight("model.layers.4.mlp.down_proj.weight", m, source));
}
