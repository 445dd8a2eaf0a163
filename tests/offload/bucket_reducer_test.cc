// BucketReducer (offload/bucket_reducer.h) on real Gloo over loopback, ranks
// as threads: buckets of whole parameters reduce-scattered into the gradient
// shard — a padded parameter, several in one bucket, and one parameter
// without padding alone in its bucket, which is sent from its gradient
// without the bucket's copy.
#include "offload/bucket_reducer.h"

#include <catch2/catch.hpp>

#include <vector>

#include "core/error.h"
#include "kernels/ops.h"
#include "offload/grad_shard.h"
#include "partition/layout.h"
#include "tests/partition/thread_ranks.h"

using namespace strata;

namespace {

// Element i of rank r's gradient of parameter p: small integers (exact sums).
float grad_value(int rank, size_t p, size_t i) {
  return static_cast<float>((rank + 1) * 10 + static_cast<int>(p) * 3 + static_cast<int>(i % 5));
}

// Reduces every parameter's gradient of each rank through a reducer of
// `bucket_numel` and checks each rank's shard holds the sum over ranks of its
// slices (zero in the padding).
void reduce_and_check(int world, const std::vector<partition::ParamSpec>& specs, int64_t bucket_numel) {
  test::run_thread_ranks(world, [&](int rank, partition::Communicator& comm, Accelerator& acc, Stream& stream) {
    partition::LayoutOptions options;
    options.world_size = world;
    const partition::PartitionLayout layout(specs, options);
    auto ops = ops::make_ops(acc);
    offload::GradShard shard(acc, *ops, layout);
    offload::BucketReducer reducer(acc, *ops, comm, layout, bucket_numel, shard);
    std::vector<float*> grads;
    auto ready = acc.create_event();
    stream.record(*ready);
    for (size_t p = 0; p < layout.params().size(); ++p) {
      const size_t numel = static_cast<size_t>(layout.param(p).numel);
      grads.push_back(static_cast<float*>(acc.allocate(numel * sizeof(float))));
      for (size_t i = 0; i < numel; ++i) grads.back()[i] = grad_value(rank, p, i);
      reducer.add(p, grads.back(), *ready);
    }
    reducer.synchronize();
    for (size_t p = 0; p < layout.params().size(); ++p) {
      const partition::ParamSlot& slot = layout.param(p);
      const float* got = shard.read(static_cast<size_t>(slot.shard_offset_numel),
                                    static_cast<size_t>(slot.slice_numel), stream);
      for (int64_t i = 0; i < slot.slice_numel; ++i) {
        const int64_t element = slot.owned_begin(rank) + i;
        float want = 0;
        if (i < slot.owned_numel(rank)) {
          for (int r = 0; r < world; ++r) want += grad_value(r, p, static_cast<size_t>(element));
        }
        STRATA_CHECK(got[i] == want, kInternal, "rank {} parameter {} element {}: {} != {}", rank, p, i, got[i], want);
      }
    }
    for (float* g : grads) acc.deallocate(g);
  });
}

}  // namespace

TEST_CASE("bucket reducer: each rank's shard is the sum of every rank's slices, padded or not, one parameter per "
          "bucket or several",
          "[bucket_reducer]") {
  // "embed" has no padding over 2 ranks (8192 = 2 x 4096); "odd" has.
  const std::vector<partition::ParamSpec> specs = {
      {"embed", {16, 512}, DType::kF32}, {"odd", {1000}, DType::kF32}, {"w", {64, 64}, DType::kF32}};
  const int64_t bucket = GENERATE(int64_t{1}, int64_t{1'000'000});  // every parameter alone, or all in one
  CAPTURE(bucket);
  reduce_and_check(2, specs, bucket);
}

TEST_CASE("bucket reducer: a parameter without padding alone in its bucket is sent from its gradient, not copied "
          "into a bucket",
          "[bucket_reducer]") {
  // One rank, so the accelerator's peak memory is this reducer's alone: the
  // bucket's send buffer would be another copy of the gradient.
  constexpr size_t kNumel = 1 << 20;
  test::run_thread_ranks(1, [&](int, partition::Communicator& comm, Accelerator& acc, Stream& stream) {
    partition::LayoutOptions options;
    options.world_size = 1;
    const partition::PartitionLayout layout({{"embed", {1024, 1024}, DType::kF32}}, options);
    REQUIRE(layout.param(0).slice_numel == static_cast<int64_t>(kNumel));
    auto ops = ops::make_ops(acc);
    offload::GradShard shard(acc, *ops, layout);
    offload::BucketReducer reducer(acc, *ops, comm, layout, 1, shard);
    auto* grad = static_cast<float*>(acc.allocate(kNumel * sizeof(float)));
    for (size_t i = 0; i < kNumel; ++i) grad[i] = grad_value(0, 0, i);
    auto ready = acc.create_event();
    stream.record(*ready);
    const size_t before = acc.memory_stats().in_use_nbytes;
    reducer.add(0, grad, *ready);
    reducer.synchronize();
    const size_t peak = acc.memory_stats().peak_nbytes;
    INFO("in use before the bucket " << before << " bytes, peak after " << peak);
    CHECK(peak - before < 2 * kNumel * sizeof(float));  // the received block only, not the gradient again
    const float* got = shard.read(0, kNumel, stream);
    bool same = true;
    for (size_t i = 0; i < kNumel; ++i) same = same && got[i] == grad_value(0, 0, i);
    CHECK(same);
    acc.deallocate(grad);
  });
}
