// ZeRO stage 1/2/3 rules over real Gloo collectives (ranks as threads): each
// rank's averaged gradient shard must equal (a) the allreduce reference and (b)
// the gradient one rank computes over the combined batch; stage 3 gathers
// parameters on demand and releases them.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstring>

#include "partition/stages.h"
#include "runtime/core/error.h"
#include "tests/partition/thread_ranks.h"

using namespace strata;
using namespace strata::partition;

namespace {
constexpr int kMicroBatch = 4;  // samples per micro-step; the loss is their mean

std::vector<ParamSpec> model_params() {
  return {{"w1", {37, 5}, DType::kF32}, {"b1", {5}, DType::kF32}, {"w2", {300}, DType::kF32},
          {"emb", {20, 100}, DType::kF32}};
}

float weight(size_t p, int64_t i) { return static_cast<float>((i + static_cast<int64_t>(p)) % 5 - 2); }

// Per-sample gradient of 0.5 (x.w - y)^2 for parameter p, sample id s: (x.w - y) x,
// all integers. Added into `out` (int64, exact).
void add_sample_grad(size_t p, int64_t numel, int64_t s, std::vector<int64_t>& out) {
  auto x = [&](int64_t i) { return (i * 7 + s * 13 + static_cast<int64_t>(p) * 3) % 9 - 4; };
  int64_t residual = -(s % 5 - 2);
  for (int64_t i = 0; i < numel; ++i) residual += x(i) * static_cast<int64_t>(weight(p, i));
  for (int64_t i = 0; i < numel; ++i) out[static_cast<size_t>(i)] += residual * x(i);
}

int64_t sample_id(int rank, int micro, int b, int world) { return (static_cast<int64_t>(micro) * world + rank) * kMicroBatch + b; }

// This rank's micro-step gradient of parameter p (mean over its micro-batch).
std::vector<float> micro_grad(size_t p, int64_t numel, int rank, int micro, int world) {
  std::vector<int64_t> sum(static_cast<size_t>(numel), 0);
  for (int b = 0; b < kMicroBatch; ++b) add_sample_grad(p, numel, sample_id(rank, micro, b, world), sum);
  std::vector<float> grad(sum.size());
  for (size_t i = 0; i < sum.size(); ++i) grad[i] = static_cast<float>(sum[i]) / kMicroBatch;
  return grad;
}

// Returns how many gradient elements were compared (over all ranks).
int64_t check_stage(ZeroStage stage, int world, int micro_steps, int64_t bucket_numel) {
  std::atomic<int64_t> compared{0};
  LayoutOptions options;
  options.world_size = world;
  options.alignment_nbytes = 64;
  PartitionLayout layout(model_params(), options);
  test::run_thread_ranks(world, [&](int rank, Communicator& comm, Accelerator& accelerator, Stream& stream) {
    GradientReducer reducer(comm, accelerator, stream, layout, stage, bucket_numel);
    std::vector<std::vector<float>> reference(layout.params().size());
    for (size_t p = 0; p < layout.params().size(); ++p) reference[p].assign(static_cast<size_t>(layout.param(p).numel), 0.0f);
    for (int micro = 0; micro < micro_steps; ++micro) {
      // Backward produces gradients last layer first.
      for (size_t p = layout.params().size(); p-- > 0;) {
        auto grad = micro_grad(p, layout.param(p).numel, rank, micro, world);
        reducer.add(p, grad.data());
        // Reference (a): a plain allreduce of the full gradient.
        std::vector<float> summed(grad.size());
        comm.allreduce(grad.data(), summed.data(), grad.size(), DType::kF32, ReduceOp::kSum, stream)->synchronize();
        for (size_t i = 0; i < summed.size(); ++i) reference[p][i] += summed[i];
      }
    }
    reducer.finish(micro_steps);
    const auto& shard = reducer.gradient_shard();
    STRATA_CHECK(shard.size() == static_cast<size_t>(layout.shard_numel()), kInternal, "shard size {}", shard.size());
    if (stage != ZeroStage::kStage1) {
      STRATA_CHECK(reducer.collectives_issued() > 1, kInternal, "expected several buckets, got {}",
                   reducer.collectives_issued());
    }
    float divisor = static_cast<float>(world * micro_steps);
    for (size_t p = 0; p < layout.params().size(); ++p) {
      const ParamSlot& slot = layout.param(p);
      // Reference (b): one rank, the combined batch of world * micro_steps * kMicroBatch samples.
      std::vector<int64_t> combined(static_cast<size_t>(slot.numel), 0);
      for (int r = 0; r < world; ++r) {
        for (int m = 0; m < micro_steps; ++m) {
          for (int b = 0; b < kMicroBatch; ++b) add_sample_grad(p, slot.numel, sample_id(r, m, b, world), combined);
        }
      }
      for (int64_t j = 0; j < slot.slice_numel; ++j) {
        float got = shard[static_cast<size_t>(slot.shard_offset_numel + j)];
        int64_t i = slot.owned_begin(rank) + j;
        if (j >= slot.owned_numel(rank)) {
          STRATA_CHECK(got == 0.0f, kInternal, "padding of {} on rank {} is {}", slot.name, rank, got);
          continue;
        }
        float want_allreduce = reference[p][static_cast<size_t>(i)] / divisor;
        float want_combined = static_cast<float>(combined[static_cast<size_t>(i)]) /
                              static_cast<float>(world * micro_steps * kMicroBatch);
        STRATA_CHECK(got == want_allreduce && got == want_combined, kInternal,
                     "stage {} rank {}: {}[{}] = {}, allreduce reference {}, combined batch {}",
                     static_cast<int>(stage), rank, slot.name, i, got, want_allreduce, want_combined);
        ++compared;
      }
    }
  });
  return compared.load();
}

// Every real element of every parameter is compared exactly once over the ranks.
constexpr int64_t kModelNumel = 37 * 5 + 5 + 300 + 20 * 100;
}  // namespace

TEST_CASE("stage 1: allreduced gradient shards equal the allreduce and combined-batch references") {
  for (int world : {2, 3, 4}) REQUIRE(check_stage(ZeroStage::kStage1, world, 2, 700) == kModelNumel);
}

TEST_CASE("stage 2: bucketed reduce-scatter gradient shards equal the references") {
  for (int world : {2, 3, 4}) {
    REQUIRE(check_stage(ZeroStage::kStage2, world, 2, 700) == kModelNumel);
    REQUIRE(check_stage(ZeroStage::kStage2, world, 1, 1) == kModelNumel);  // every parameter its own bucket
  }
}

TEST_CASE("stage 3: gradients as stage 2, parameters gathered on demand and released") {
  for (int world : {2, 3, 4}) REQUIRE(check_stage(ZeroStage::kStage3, world, 3, 2000) == kModelNumel);
  LayoutOptions options;
  options.world_size = 3;
  options.alignment_nbytes = 64;
  PartitionLayout layout(model_params(), options);
  test::run_thread_ranks(3, [&](int rank, Communicator& comm, Accelerator& accelerator, Stream& stream) {
    std::vector<char> shard(layout.shard_nbytes());
    std::vector<std::vector<float>> whole(layout.params().size());
    for (size_t p = 0; p < whole.size(); ++p) {
      whole[p].resize(static_cast<size_t>(layout.param(p).numel));
      for (size_t i = 0; i < whole[p].size(); ++i) whole[p][i] = weight(p, static_cast<int64_t>(i)) + static_cast<float>(i);
      layout.shard_param(p, whole[p].data(), rank, shard.data());
    }
    ParameterGatherer gatherer(comm, accelerator, stream, layout);
    for (size_t p = 0; p < whole.size(); ++p) {
      const auto* full = static_cast<const float*>(gatherer.fetch(p, shard.data()));
      STRATA_CHECK(gatherer.fetch(p, shard.data()) == full, kInternal, "second fetch gathered again");
      STRATA_CHECK(std::memcmp(full, whole[p].data(), whole[p].size() * sizeof(float)) == 0, kInternal,
                   "gathered {} differs on rank {}", layout.param(p).name, rank);
      gatherer.release(p);
      STRATA_CHECK(gatherer.live_nbytes() == 0, kInternal, "{} bytes still live after release", gatherer.live_nbytes());
    }
    // Stage 1/2 after the optimizer step: every updated parameter allgathered.
    std::vector<std::vector<float>> out(whole.size());
    std::vector<void*> outputs;
    for (size_t p = 0; p < whole.size(); ++p) {
      out[p].assign(whole[p].size(), -1.0f);
      outputs.push_back(out[p].data());
    }
    gatherer.gather_all(shard.data(), outputs);
    STRATA_CHECK(out == whole, kInternal, "gather_all differs on rank {}", rank);
  });
}

TEST_CASE("stage 2: 16-bit gradients are summed across ranks in fp32", "[partition][stages]") {
  // Rank 0 contributes 1.0, every other rank 2^-8 (each exact in bf16 and fp16).
  // In fp32 the sum is 1 + 3 * 2^-8 = 1.01171875; a ring summing in 16 bits
  // would round 1 + 2^-8 back to 1 at every hop (bf16) and return 1.0.
  constexpr int kWorld = 4;
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    LayoutOptions options;
    options.world_size = kWorld;
    options.alignment_nbytes = 64;
    PartitionLayout layout({{"w", {64}, dtype}}, options);
    test::run_thread_ranks(kWorld, [&](int rank, Communicator& comm, Accelerator& accelerator, Stream& stream) {
      GradientReducer reducer(comm, accelerator, stream, layout, ZeroStage::kStage2, 1 << 20);
      const float value = rank == 0 ? 1.0f : 1.0f / 256.0f;
      std::vector<uint16_t> grad(64);
      std::vector<float> widened(64, value);
      convert(widened.data(), DType::kF32, grad.data(), dtype, grad.size());
      reducer.add(0, grad.data());
      reducer.finish(1);
      const ParamSlot& slot = layout.param(0);
      for (int64_t i = 0; i < slot.owned_numel(rank); ++i) {
        const float got = reducer.gradient_shard()[static_cast<size_t>(slot.shard_offset_numel + i)];
        const float expect = (1.0f + 3.0f / 256.0f) / kWorld;  // finish() averages over ranks
        STRATA_CHECK(got == expect, kInternal, "{} rank {} element {}: {} != {}", dtype_name(dtype), rank, i, got,
                     expect);
      }
    });
  }
}
