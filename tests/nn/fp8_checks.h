// The FP8 dequantization op against transformers on either backend: every
// FP8 weight of the DeepSeek-V3 fixture (tests/data/golden/fp8_deepseek_v3,
// ragged blocks, two shards) through Ops::dequantize_fp8_blocks, fp32 and
// bf16, bit for bit the values scripts/make-golden-quant wrote. Used by
// nn_quant_test (cpu) and nn_golden_cuda_test (cuda).
#pragma once

#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

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

}  // namespace strata::test
