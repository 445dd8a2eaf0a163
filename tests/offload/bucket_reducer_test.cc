// BucketReducer (offload/bucket_reducer.h) on real Gloo over loopback, ranks
// as threads: buckets of whole parameters reduce-scattered into the gradient
// shard — a padded parameter, several in one bucket, and one parameter
// without padding alone in its bucket, which is sent from its gradient
// without the bucket's copy; in a world of one, each gradient is added in
// place.
#include "offload/bucket_reducer.h"

#include <catch2/catch.hpp>

#include <atomic>
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

// Reduces every parameter's gradient of each rank (ranks as threads sharing
// one accelerator) through a reducer of `bucket_numel` and checks each rank's
// shard holds the sum over ranks of its slices (zero in the padding). Returns
// how far the accelerator's peak rose above what was in use once every rank
// held its gradients and shard.
size_t reduce_and_check(int world, const std::vector<partition::ParamSpec>& specs, int64_t bucket_numel) {
  std::atomic<size_t> before{0}, peak{0};
  test::run_thread_ranks(world, [&](int rank, partition::Communicator& comm, Accelerator& acc, Stream& stream) {
    partition::LayoutOptions options;
    options.world_size = world;
    const partition::PartitionLayout layout(specs, options);
    auto ops = ops::make_ops(acc);
    offload::GradShard shard(acc, *ops, layout);
    offload::BucketReducer reducer(acc, *ops, comm, layout, bucket_numel, shard);
    std::vector<float*> grads;
    for (size_t p = 0; p < layout.params().size(); ++p) {
      const size_t numel = static_cast<size_t>(layout.param(p).numel);
      grads.push_back(static_cast<float*>(acc.allocate(numel * sizeof(float))));
      for (size_t i = 0; i < numel; ++i) grads.back()[i] = grad_value(rank, p, i);
    }
    auto ready = acc.create_event();
    stream.record(*ready);
    comm.barrier(stream)->synchronize();  // every rank's gradients and shard in use
    if (rank == 0) before = acc.memory_stats().in_use_nbytes;
    comm.barrier(stream)->synchronize();
    for (size_t p = 0; p < layout.params().size(); ++p) reducer.add(p, grads[p], *ready);
    reducer.synchronize();
    comm.barrier(stream)->synchronize();
    if (rank == 0) peak = acc.memory_stats().peak_nbytes;
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
  return peak - before;
}

}  // namespace

TEST_CASE("bucket reducer: each rank's shard is the sum of every rank's slices, padded or not, one parameter per "
          "bucket or several",
          "[bucket_reducer]") {
  // "embed" has no padding over 2 ranks (8192 = 2 x 4096); "odd" has.
  const std::vector<partition::ParamSpec> specs = {
      {"embed", {16, 512}, DType::kF32}, {"odd", {1000}, DType::kF32}, {"w", {64, 64}, DType::kF32}};
  const int64_t bucket = GENERATE(int64_t{1}, int64_t{1'000'000});  // every parameter alone, or all in one
  // A world of one adds its unpadded gradients in place ("embed", "w") and
  // copies the padded one alone.
  const int world = GENERATE(1, 2);
  CAPTURE(bucket, world);
  reduce_and_check(world, specs, bucket);
}

TEST_CASE("bucket reducer: a parameter without padding alone in its bucket is sent from its gradient, not copied "
          "into a bucket",
          "[bucket_reducer]") {
  // Two ranks: each receives its half (kNumel / 2 floats); a bucket's send
  // buffer would add another whole copy of each rank's gradient.
  constexpr size_t kNumel = 1 << 20;
  const size_t rise = reduce_and_check(2, {{"embed", {1024, 1024}, DType::kF32}}, 1);
  INFO("peak rose " << rise << " bytes");
  CHECK(rise <= kNumel * sizeof(float));  // 2 ranks x half a gradient received
}

TEST_CASE("bucket reducer: a world of one adds its gradients to the shard in place: no bucket, no received block, "
          "only a padded slice copied",
          "[bucket_reducer]") {
  // Several parameters in one bucket: the pack and the collective's received
  // block would each be their sum again; "norm" is padded to the alignment.
  const std::vector<partition::ParamSpec> specs = {
      {"embed", {1024, 1024}, DType::kF32}, {"norm", {1000}, DType::kF32}, {"w", {512, 512}, DType::kF32}};
  partition::LayoutOptions options;
  options.world_size = 1;
  const int64_t norm_slice = partition::PartitionLayout(specs, options).param(1).slice_numel;
  REQUIRE(norm_slice > 1000);
  const size_t rise = reduce_and_check(1, specs, 1'000'000'000);
  INFO("peak rose " << rise << " bytes");
  CHECK(rise == static_cast<size_t>(norm_slice) * sizeof(float));
}
