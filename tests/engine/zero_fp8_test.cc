// A frozen weight of an FP8 checkpoint kept in FP8 (ParamInfo::blocks,
// docs/DESIGN.md §4.2.2): on two ranks with the parameters on NVMe its home
// holds its e4m3 bytes (one per element: the swap file half of bf16's), its
// slices split blocks anywhere (the scale grid is whole on every rank), and
// every gather and every owned range read gives the values the dequantizing
// reader gives -- transformers' _dequantize_fp8_weight, bit for bit.
#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/nn/decoder_model.h"
#include "runtime/nn/safetensors.h"
#include "runtime/train/hf_model.h"
#include "tests/engine/zero_rig.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_paths.h"

using namespace strata;
namespace fs = std::filesystem;

TEST_CASE("fp8 base: frozen FP8 weights stay FP8 on two NVMe ranks, their swap file half of bf16's, and gather to "
          "the dequantized values bit for bit",
          "[engine][zero][quant][nvme]") {
  ops::set_cpu_threads(1);
  const fs::path dir = fs::path(strata::test::source_dir()) / "tests/data/golden/fp8_deepseek_v3";
  const nn::DecoderConfig config = train::load_hf_config(dir);
  const nn::SafetensorsFile want = nn::SafetensorsFile::open((dir / "dequantized.safetensors").string());
  for (const DType dtype : {DType::kBF16, DType::kF32}) {
    INFO(dtype_name(dtype));
    const std::string suffix = dtype == DType::kF32 ? ".f32" : ".bf16";
    test::TempDir tmp("strata-zero-fp8");
    std::mutex mutex;
    std::map<std::string, std::vector<char>> owned;  // name -> every rank's owned range, assembled
    int gathered = 0, kept_total = 0;
    int64_t fp8_numel = 0, split_blocks = 0;
    // What the rank threads saw, checked on this thread (Catch2's assertions
    // are not thread-safe): each FP8 weight's refusal to be written, ranges
    // read back in another dtype, gathers that differ from transformers'.
    std::vector<std::pair<std::string, std::string>> write_refusals;
    std::vector<std::string> wrong_dtype, wrong_gather;
    test::run_zero_ranks(2, [&](int rank, Accelerator& accelerator, engine::ZeroComms comms) {
      engine::ZeroEngine eng(accelerator, comms, test::nvme_stage3_options(tmp.path() / "swap"));
      nn::DecoderModelOptions mo;
      mo.dtype = dtype;
      nn::DecoderModel model(eng, config, mo);
      for (engine::ParamId id : model.parameters()) eng.freeze(id);
      const int64_t kept = train::keep_quantized_frozen(eng, model.parameters(), dir, config.quant);
      eng.finalize();
      train::load_hf_weights(eng, model.parameters(), dir, {}, config.quant);
      int64_t numel = 0;
      for (engine::ParamId id : model.parameters()) {
        const engine::ParamInfo& info = eng.param_info(id);
        if (!info.blocks) continue;
        numel += info.numel();
        // Held as its bytes: writing values is refused by name.
        std::string refusal = "(not refused)";
        try {
          eng.for_each_owned_range(id, engine::Engine::Access::kWrite, [](int64_t, const TensorView&) {});
        } catch (const std::exception& e) {
          refusal = e.what();
        }
        {
          const std::lock_guard lock(mutex);
          write_refusals.emplace_back(info.name, refusal);
        }
        eng.for_each_owned_range(id, engine::Engine::Access::kRead, [&](int64_t first, const TensorView& host) {
          const std::lock_guard lock(mutex);
          if (host.desc.dtype != dtype) {
            wrong_dtype.push_back(info.name);
            return;
          }
          std::vector<char>& all = owned[info.name];
          all.resize(info.nbytes());
          std::memcpy(all.data() + first * static_cast<int64_t>(dtype_nbytes(dtype)), host.data, host.nbytes());
          // A rank's range that starts inside a 128-column block of a row: the grid is whole on every rank.
          if (rank == 1 && first % info.blocks->fp8.cols % 128 != 0) ++split_blocks;
        });
      }
      // Every operator's parameters through the hooks: gathered as e4m3, dequantized per gather.
      int checks = 0;
      for (engine::OpId op = 0; op < eng.operator_count(); ++op) {
        eng.pre_op(op, engine::Phase::kForward);
        for (engine::ParamId p : eng.op_info(op).params) {
          const engine::ParamInfo& info = eng.param_info(p);
          if (!info.blocks) continue;
          const TensorView v = eng.param(p);
          std::vector<uint8_t> bytes(v.nbytes());
          accelerator.copy_async(bytes.data(), v.data, v.nbytes(), CopyKind::kDeviceToHost, eng.compute_stream());
          eng.compute_stream().synchronize();
          const TensorView golden = want.view(info.name + suffix);
          const auto* g = static_cast<const uint8_t*>(golden.data);
          if (bytes != std::vector<uint8_t>(g, g + golden.nbytes())) {
            const std::lock_guard lock(mutex);
            wrong_gather.push_back(info.name);
          }
          ++checks;
        }
        eng.post_op(op, engine::Phase::kForward);
      }
      eng.compute_stream().synchronize();
      const std::lock_guard lock(mutex);
      if (rank == 0) {
        gathered = checks;
        kept_total = static_cast<int>(kept);
        fp8_numel = numel;
      }
    });
    CHECK(write_refusals.size() == 2 * 22);  // each rank, each FP8 weight
    for (const auto& [name, message] : write_refusals) {
      INFO(name);
      CHECK_THAT(message, Catch::Contains(name) && Catch::Contains("kept in FP8"));
    }
    CHECK(wrong_dtype.empty());
    INFO("gathers that differ from transformers' dequantization: " << wrong_gather.size());
    CHECK(wrong_gather.empty());
    CHECK(kept_total == 22);  // every FP8 weight of the fixture (the MTP-free model's)
    CHECK(gathered >= 22);
    CHECK(split_blocks > 0);
    REQUIRE(owned.size() == 22);
    for (const auto& [name, bytes] : owned) {
      INFO(name);
      const TensorView golden = want.view(name + suffix);
      CHECK(std::memcmp(bytes.data(), golden.data, golden.nbytes()) == 0);
    }
    // Rank 0's swap files: the FP8 weights' home holds a byte per element
    // (its half of the elements, each slice padded to 4 KiB pages), where
    // bf16 would hold two.
    const fs::path files = tmp.path() / "swap" / "param" / "rank0";
    const auto fp8_file = files / "fp8_e4m3_frozen.swp";
    REQUIRE(fs::exists(fp8_file));
    const auto on_disk = static_cast<int64_t>(fs::file_size(fp8_file));
    INFO("fp8 swap file " << on_disk << " bytes for " << fp8_numel << " elements over 2 ranks");
    CHECK(on_disk >= fp8_numel / 2);
    CHECK(on_disk <= fp8_numel / 2 + 22 * 4096);  // at most a page of padding per weight
  }
}
