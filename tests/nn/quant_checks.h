// The block dequantization ops against transformers on either backend.
//
// FP8: every
// FP8 weight of the DeepSeek-V3 fixture (tests/data/golden/fp8_deepseek_v3,
// ragged blocks, two shards) through Ops::dequantize_fp8_blocks, fp32 and
// bf16, bit for bit the values scripts/make-golden-quant wrote. Used by
// nn_quant_test (cpu) and nn_golden_cuda_test (cuda).
#pragma once

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kernels/mxfp4_blocks.h"
#include "runtime/nn/safetensors.h"
#include "tests/nn/engine_rig.h"
#include "tests/support/test_paths.h"

namespace strata::test {

// The fixture's stored tensors (FP8 bytes and scale grids) and transformers'
// dequantized values (`<name>.f32`, `<name>.bf16`).
struct Fp8Fixture {
  nn::SafetensorsFile want;
  std::vector<nn::SafetensorsFile> shards;

  Fp8Fixture() : want(nn::SafetensorsFile::open(dir() + "dequantized.safetensors")) {
    for (const char* f : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}) {
      shards.push_back(nn::SafetensorsFile::open(dir() + f));
    }
  }
  static std::string dir() { return source_dir() + "/tests/data/golden/fp8_deepseek_v3/"; }
  // A stored tensor, from whichever shard holds it.
  TensorView find(const std::string& name) const {
    for (const auto& s : shards) {
      if (s.contains(name)) return s.view(name);
    }
    FAIL("no tensor " << name);
    return TensorView{};
  }
};

// `host` copied into memory of `rig`'s accelerator.
inline Tensor upload(Rig& rig, const TensorView& host) {
  Tensor t = rig.accelerator->allocate_tensor(host.desc.dtype, host.desc.shape);
  Stream& stream = rig.engine->compute_stream();
  rig.accelerator->copy_async(t.data(), host.data, host.nbytes(), CopyKind::kHostToDevice, stream);
  stream.synchronize();
  return t;
}

// Checks every FP8 weight on `rig`'s backend; returns how many it checked (22).
inline int check_fp8_dequantize_golden(Rig& rig, const Fp8Fixture& fixture) {
  Stream& stream = rig.engine->compute_stream();
  int checked = 0;
  for (const std::string& name : fixture.want.names()) {
    if (!name.ends_with(".f32")) continue;
    const std::string weight = name.substr(0, name.size() - 4);
    INFO(weight);
    const Tensor w = upload(rig, fixture.find(weight)), s = upload(rig, fixture.find(weight + "_scale_inv"));
    for (const DType dtype : {DType::kF32, DType::kBF16}) {
      Tensor out = rig.accelerator->allocate_tensor(dtype, w.view().desc.shape);
      rig.engine->ops().dequantize_fp8_blocks(rig.engine->compute(), w.view(), s.view(), 128, 128, out.view());
      std::vector<uint8_t> got(out.view().nbytes());
      rig.accelerator->copy_async(got.data(), out.data(), got.size(), CopyKind::kDeviceToHost, stream);
      stream.synchronize();
      const TensorView golden = fixture.want.view(weight + (dtype == DType::kF32 ? ".f32" : ".bf16"));
      const auto* g = static_cast<const uint8_t*>(golden.data);
      CHECK(got == std::vector<uint8_t>(g, g + golden.nbytes()));
    }
    ++checked;
  }
  return checked;
}

// The MXFP4 dequantization op against transformers on either backend: one
// expert's weight of the quant tables' stacked [2, 64, 6] (gpt-oss's up_proj
// columns: expert 1, columns 1, 3, 5, so [3, 64]) packed to its kept form,
// then Ops::dequantize_mxfp4_blocks on `rig`'s backend in fp32, bf16 and fp16,
// bit for bit the values scripts/make-golden-quant wrote
// (tests/data/golden/quant/tables.safetensors). Returns how many dtypes it
// checked (3). Used by nn_quant_test (cpu) and nn_golden_cuda_test (cuda).
// transformers' values of that weight ([3, 64]: element (o, i) the stacked
// (1, i, 1 + 2 o)) as the tables' `name` (mxfp4_f32, mxfp4_bf16, mxfp4_f16) holds them in `dtype`.
inline std::vector<uint8_t> mxfp4_expert_golden(const nn::SafetensorsFile& tables, const std::string& name,
                                                DType dtype) {
  const size_t esize = dtype_nbytes(dtype);
  const auto* golden_bytes = static_cast<const uint8_t*>(tables.view(name).data);
  std::vector<uint8_t> want(3 * 64 * esize);
  for (int64_t o = 0; o < 3; ++o) {
    for (int64_t i = 0; i < 64; ++i) {
      std::memcpy(want.data() + static_cast<size_t>(o * 64 + i) * esize,
                  golden_bytes + static_cast<size_t>((1 * 64 + i) * 6 + 1 + 2 * o) * esize, esize);
    }
  }
  return want;
}

inline int check_mxfp4_dequantize_golden(Rig& rig) {
  const nn::SafetensorsFile t =
      nn::SafetensorsFile::open(source_dir() + "/tests/data/golden/quant/tables.safetensors");
  const TensorView blocks = t.view("blocks"), scales = t.view("scales");
  REQUIRE(blocks.desc.shape == Shape({2, 6, 2, 16}));
  const kernels::Mxfp4Stacked stacked{2, 64, 6};
  const int64_t first_column = 1 * 6 + 1, step = 2, rows = 3;
  const kernels::Mxfp4Blocks shape{rows, 64};
  std::vector<uint8_t> kept(static_cast<size_t>(shape.stored_nbytes()));
  kernels::pack_mxfp4_columns(blocks.as<uint8_t>(), scales.as<uint8_t>(), stacked, first_column, step, rows, 0,
                              shape.stored_nbytes(), kept.data());
  const Tensor packed = upload(rig, TensorView{TensorDesc{DType::kU8, {shape.packed_nbytes()}, Tier::kCpu}, kept.data()});
  const Tensor grid =
      upload(rig, TensorView{TensorDesc{DType::kU8, {rows, 2}, Tier::kCpu}, kept.data() + shape.packed_nbytes()});
  Stream& stream = rig.engine->compute_stream();
  int checked = 0;
  for (const auto& [name, dtype] : {std::pair{"mxfp4_f32", DType::kF32}, std::pair{"mxfp4_bf16", DType::kBF16},
                                    std::pair{"mxfp4_f16", DType::kF16}}) {
    INFO(name);
    const std::vector<uint8_t> want = mxfp4_expert_golden(t, name, dtype);
    Tensor out = rig.accelerator->allocate_tensor(dtype, {rows, 64});
    rig.engine->ops().dequantize_mxfp4_blocks(rig.engine->compute(), packed.view(), grid.view(), out.view());
    std::vector<uint8_t> got(out.view().nbytes());
    rig.accelerator->copy_async(got.data(), out.data(), got.size(), CopyKind::kDeviceToHost, stream);
    stream.synchronize();
    CHECK(got == want);
    ++checked;
  }
  return checked;
}

}  // namespace strata::test
