// A frozen MXFP4 expert weight kept in its 4-bit form (ParamInfo::blocks,
// kernels/mxfp4_blocks.h, docs/DESIGN.md §4.2.2): on two ranks with the
// parameters on NVMe its home holds the kept form (the codes two per byte,
// then an e8m0 scale per 32: 17/64 of bf16's bytes), partitioned as bytes,
// rank 1's slice starting inside a row; every gather
// (Ops::dequantize_mxfp4_blocks on the gather stream) and every owned range
// read gives the loader's bits (kernels::dequantize_mxfp4_columns, which
// tests/nn/nn_quant_test.cc checks against transformers'
// convert_moe_packed_tensors).
#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "kernels/mxfp4_blocks.h"
#include "kernels/quant_blocks.h"
#include "runtime/engine/zero_engine.h"
#include "tests/engine/zero_rig.h"
#include "tests/support/temp_dir.h"

using namespace strata;
namespace fs = std::filesystem;

TEST_CASE("mxfp4 base: a frozen MXFP4 tensor stays in its 4-bit form on two NVMe ranks, 17/64 of bf16's bytes, "
          "and gathers and reads to the reader's values bit for bit",
          "[engine][zero][quant][nvme]") {
  ops::set_cpu_threads(1);
  // A stacked checkpoint tensor [1, 16384, 16] and the expert weight [16,
  // 16384] of all its columns: 262144 elements, a kept form of 139264 bytes,
  // two 4-KiB-aligned slices of 69632 (17/64 of bf16's), rank 1's starting
  // at element 139264, mid-row.
  const kernels::Mxfp4Stacked stacked{1, 16384, 16};
  const kernels::Mxfp4Blocks shape{16, 16384};
  const int64_t numel = shape.numel();
  std::vector<uint8_t> blocks(static_cast<size_t>(numel / 2)), scales(static_cast<size_t>(numel / 32));
  std::mt19937 rng(11);
  for (uint8_t& b : blocks) b = static_cast<uint8_t>(rng());
  for (uint8_t& s : scales) s = static_cast<uint8_t>(118 + rng() % 16);
  scales[3] = 0;    // 2^-127: subnormal values
  scales[9] = 255;  // 2^128: infinities (and NaN for code 0)
  std::vector<uint8_t> grid(static_cast<size_t>(shape.scale_numel()));
  kernels::pack_mxfp4_columns(blocks.data(), scales.data(), stacked, 0, 1, shape.rows, shape.packed_nbytes(),
                              shape.scale_numel(), grid.data());
  for (const DType dtype : {DType::kBF16, DType::kF32}) {
    INFO(dtype_name(dtype));
    const size_t esize = dtype_nbytes(dtype);
    std::vector<char> want(static_cast<size_t>(numel) * esize);
    kernels::dequantize_mxfp4_columns(blocks.data(), scales.data(), stacked, 0, 1, 0, numel, want.data(), dtype);
    test::TempDir tmp("strata-zero-mxfp4");
    std::mutex mutex;
    std::vector<char> owned(want.size(), 0);
    int64_t owned_numel = 0, split_first = -1, gathers_right = 0, gathers = 0;
    std::vector<std::string> refusals, wrong_dtype;
    test::run_zero_ranks(2, [&](int rank, Accelerator& accelerator, engine::ZeroComms comms) {
      engine::ZeroEngine eng(accelerator, comms, test::nvme_stage3_options(tmp.path() / "swap"));
      const engine::ParamId id =
          eng.declare_parameter({"mlp.experts.down_proj", dtype, {shape.rows, shape.cols}, std::nullopt});
      const engine::OpId op = eng.declare_operator("mlp.experts", {id});
      eng.freeze(id);
      eng.store_blocks(id, kernels::QuantBlocks::of(shape));
      eng.finalize();
      const TensorView grid_view{TensorDesc{DType::kU8, {shape.rows, shape.cols / 32}, Tier::kCpu}, grid.data()};
      eng.write_blocks(id, grid_view, [&](int64_t first, const TensorView& host) {
        kernels::pack_mxfp4_columns(blocks.data(), scales.data(), stacked, 0, 1, shape.rows, first, host.numel(),
                                    host.as<uint8_t>());
      });
      std::string refusal = "(not refused)";
      try {
        eng.for_each_owned_range(id, engine::Engine::Access::kWrite, [](int64_t, const TensorView&) {});
      } catch (const std::exception& e) {
        refusal = e.what();
      }
      eng.for_each_owned_range(id, engine::Engine::Access::kRead, [&](int64_t first, const TensorView& host) {
        const std::lock_guard lock(mutex);
        if (host.desc.dtype != dtype) {
          wrong_dtype.push_back(std::to_string(rank));
          return;
        }
        std::memcpy(owned.data() + static_cast<size_t>(first) * esize, host.data, host.nbytes());
        owned_numel += host.numel();
        if (rank == 1) split_first = first;
      });
      eng.pre_op(op, engine::Phase::kForward);
      const TensorView v = eng.param(id);
      std::vector<char> got(v.nbytes());
      accelerator.copy_async(got.data(), v.data, v.nbytes(), CopyKind::kDeviceToHost, eng.compute_stream());
      eng.compute_stream().synchronize();
      eng.post_op(op, engine::Phase::kForward);
      eng.compute_stream().synchronize();
      const std::lock_guard lock(mutex);
      refusals.push_back(refusal);
      ++gathers;
      gathers_right += got == want;
    });
    CHECK(wrong_dtype.empty());
    REQUIRE(refusals.size() == 2);
    for (const std::string& r : refusals) CHECK_THAT(r, Catch::Contains("down_proj") && Catch::Contains("kept in MXFP4"));
    CHECK(gathers == 2);
    CHECK(gathers_right == 2);  // each rank's gather, every bit the reader's
    CHECK(owned_numel == numel);
    CHECK(owned == want);
    // Rank 1's slice starts mid-row (at a block: slices start on 4 KiB, 8192 elements).
    CHECK(split_first == 139264);
    CHECK(split_first % shape.cols != 0);
    // Each rank's swap file: its half of the kept form's 17/32 bytes per
    // element, 69632 bytes where bf16 would take 262144: 17/64.
    REQUIRE(shape.stored_nbytes() == 139264);
    for (const char* rank : {"rank0", "rank1"}) {
      const fs::path file = tmp.path() / "swap" / "param" / rank / "mxfp4_frozen.swp";
      REQUIRE(fs::exists(file));
      CHECK(static_cast<int64_t>(fs::file_size(file)) * 64 == 17 * numel);  // bf16: numel bytes a rank
    }
  }
}
