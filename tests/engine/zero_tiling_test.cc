// TiledLinear under the stage-3 coordinator (issue 11 item 4): each tile is
// its own operator, so the coordinator gathers one tile at a time and the
// largest operator's working memory (its gathered parameters) shrinks by the
// tile count; the results do not change. Measured with prefetch off, so the
// peak is the largest operator's own parameters, and with prefetch on.
#include <catch2/catch.hpp>

#include <mutex>
#include <vector>

#include "kernels/ops.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/nn/decoder_model.h"
#include "tests/engine/zero_rig.h"
#include "tests/nn/test_models.h"

using namespace strata;

namespace {

struct Run {
  size_t peak_gathered_nbytes = 0;
  std::vector<double> losses;
};

// One decoder layer whose MLP dominates (hidden 32, intermediate 4096): its
// gate/up/down weights are 131072 elements each, the rest a few thousand.
Run train_tiles(int64_t splits, int64_t prefetch_bucket_numel) {
  Run run;
  std::mutex mutex;
  test::run_zero_ranks(2, [&](int rank, Accelerator& accelerator, engine::ZeroComms comms) {
    engine::ZeroEngineOptions o;
    o.stage = 3;
    o.adam.lr = 1e-2f;
    o.persistence_threshold_numel = 0;
    o.prefetch_bucket_numel = prefetch_bucket_numel;
    o.max_reuse_distance_numel = 0;  // nothing kept for a later use: the peak is what an operator needs
    o.optimizer_threads = 1;
    engine::ZeroEngine eng(accelerator, comms, o);
    nn::DecoderConfig config = nn::tiny_llama(40, 32, 4096, 1, 4, 2);
    config.max_position_embeddings = 32;
    nn::DecoderModelOptions model_options = nn::model_options(DType::kF32, 16);
    model_options.mlp_tiling = {splits, splits};
    nn::DecoderModel model(eng, config, model_options);
    eng.finalize();
    nn::initialize_parameters(eng, model.parameters(), 3);
    std::vector<double> losses;
    for (int step = 0; step < 2; ++step) {
      std::vector<int32_t> ids(2 * 8), targets(2 * 8);
      for (size_t i = 0; i < ids.size(); ++i) {
        ids[i] = static_cast<int32_t>((i * 7 + static_cast<size_t>(rank) * 3 + static_cast<size_t>(step)) % 40);
        targets[i] = static_cast<int32_t>((ids[i] * 5 + 1) % 40);
      }
      nn::ForwardOptions forward;
      forward.normalizer = eng.global_sum(static_cast<double>(targets.size()));
      model.forward(ids, targets, 2, 8, forward);
      model.backward();
      losses.push_back(eng.global_sum(model.loss_stats().sum) / forward.normalizer);
      eng.step(1e-2f);
    }
    std::lock_guard lock(mutex);
    if (rank == 0) {
      run.peak_gathered_nbytes = eng.peak_gathered_nbytes();
      run.losses = losses;
    }
  });
  return run;
}

}  // namespace

TEST_CASE("TiledLinear under the coordinator: working memory cut by the tile count, same results",
          "[engine][zero][tiling]") {
  ops::set_cpu_threads(1);
  const Run whole = train_tiles(1, 0), tiled = train_tiles(4, 0);
  // Largest operator without tiling: one MLP projection, 131072 fp32 elements
  // (gate and up are separate operators); tiled 4 x 4: 8192 per tile. Measured:
  // 524288 B untiled, 32768 B tiled (16x less).
  WARN("peak gathered without prefetch: " << whole.peak_gathered_nbytes << " B untiled, "
                                          << tiled.peak_gathered_nbytes << " B with 4 x 4 tiles ("
                                          << static_cast<double>(whole.peak_gathered_nbytes) /
                                                 static_cast<double>(tiled.peak_gathered_nbytes)
                                          << "x less)");
  CHECK(whole.peak_gathered_nbytes >= 131072 * 4);
  CHECK(tiled.peak_gathered_nbytes * 16 <= whole.peak_gathered_nbytes);  // 4 x 4 = 16 tiles per projection
  // Tiling changes the summation order of the projections' partial products,
  // so the losses agree to rounding, not bit for bit.
  REQUIRE(tiled.losses.size() == whole.losses.size());
  for (size_t s = 0; s < whole.losses.size(); ++s) CHECK(tiled.losses[s] == Approx(whole.losses[s]).epsilon(1e-5));

  // With prefetch on, the next tile is gathered while this one computes; the
  // peak stays bounded by the prefetch bucket, not by the whole layer.
  const Run prefetched = train_tiles(4, 3 * 8192);
  WARN("peak gathered with a 24576-element prefetch bucket: " << prefetched.peak_gathered_nbytes << " B");
  CHECK(prefetched.peak_gathered_nbytes < whole.peak_gathered_nbytes);
  CHECK(prefetched.losses == tiled.losses);  // prefetch never changes a result
}
