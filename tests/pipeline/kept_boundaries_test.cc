// Layer-major's kept boundaries (runtime/pipeline/kept_boundaries.h) on each
// home, with a real swap file and the real I/O engine for nvme: every
// boundary comes back bit for bit whatever the order of keeps, prefetches
// and restores, and the staging stays within its 2m + 2 buffers when the
// prefetch names what comes next.
#include "runtime/pipeline/kept_boundaries.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "core/accelerator.h"
#include "nvme/aio_handle.h"
#include "tests/support/temp_dir.h"

using strata::pipeline::BoundaryHome;
using strata::pipeline::BoundaryKey;
using strata::pipeline::BoundaryNvme;
using strata::pipeline::KeptBoundaries;

namespace {

constexpr int kChunks = 5, kMicroBatches = 3;
// Not a multiple of the 4096-byte direct-I/O alignment: the staging rounds it up.
constexpr size_t kNbytes = 3 * 1000 * sizeof(float);

// The bytes of boundary `key` in version `version` (a new step writes new values).
std::vector<float> values(const BoundaryKey& key, int version) {
  std::vector<float> v(kNbytes / sizeof(float));
  std::mt19937 rng(static_cast<uint32_t>(key.chunk * 1000 + key.micro_batch * 10 + key.gradient + version * 100000));
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  for (float& x : v) x = d(rng);
  return v;
}

// One layer-major step's hand-overs as the executor makes them: forwards
// chunk by chunk (chunk k keeps the input of k + 1 for each micro-batch and
// restores its own), then backwards from the top (each restores its input
// and the gradient from above, keeps the gradient for below), with the
// prefetch naming the next m + 1 restores.
void run_step(strata::Stream& stream, KeptBoundaries& kept, int version) {
  std::vector<float> slot(kNbytes / sizeof(float));
  struct Use {
    BoundaryKey key;
    bool keep;
  };
  std::vector<Use> uses;
  for (int k = 0; k < kChunks; ++k) {
    for (int i = 0; i < kMicroBatches; ++i) {
      if (k > 0) uses.push_back({{k, i, false}, false});
      if (k + 1 < kChunks) uses.push_back({{k + 1, i, false}, true});
    }
  }
  for (int k = kChunks - 1; k >= 0; --k) {
    for (int i = kMicroBatches - 1; i >= 0; --i) {
      // A gradient is named by the chunk that kept it (the store keeps one per micro-batch).
      if (k > 0) uses.push_back({{k, i, false}, false});
      if (k + 1 < kChunks) uses.push_back({{k + 1, i, true}, false});
      if (k > 0) uses.push_back({{k, i, true}, true});
    }
  }
  for (size_t u = 0; u < uses.size(); ++u) {
    std::vector<KeptBoundaries::Upcoming> upcoming;
    std::vector<BoundaryKey> kept_first;
    for (size_t n = u; n < uses.size() && upcoming.size() <= kMicroBatches; ++n) {
      if (uses[n].keep) {
        kept_first.push_back(uses[n].key);
      } else if (!uses[n].key.gradient) {
        const bool read = std::find(kept_first.begin(), kept_first.end(), uses[n].key) == kept_first.end();
        upcoming.push_back({uses[n].key, read});
      }
    }
    kept.prefetch(upcoming);
    const Use& use = uses[u];
    if (use.keep) {
      const std::vector<float> v = values(use.key, version);
      std::memcpy(slot.data(), v.data(), kNbytes);
      kept.keep(use.key, slot.data(), kNbytes, stream);
      // The slot is written again by the next forward: the copy must have taken the bytes it had.
      stream.synchronize();
      std::fill(slot.begin(), slot.end(), 0.0f);
    } else {
      kept.restore(use.key, slot.data(), kNbytes, stream);
      stream.synchronize();
      CAPTURE(use.key.chunk, use.key.micro_batch, use.key.gradient, version);
      REQUIRE(std::memcmp(slot.data(), values(use.key, version).data(), kNbytes) == 0);
    }
  }
}

}  // namespace

TEST_CASE("kept boundaries come back bit for bit from device, pinned host and nvme, steps reusing the file",
          "[pipeline][layer-major]") {
  auto acc = strata::make_cpu_accelerator();
  strata::test::TempDir dir;
  strata::nvme::AioHandle io(strata::nvme::AioOptions{});
  for (const BoundaryHome home : {BoundaryHome::kDevice, BoundaryHome::kPinnedHost, BoundaryHome::kNvme}) {
    SECTION(strata::pipeline::boundary_home_name(home)) {
      BoundaryNvme nvme;
      if (home == BoundaryHome::kNvme) nvme = {&io, dir.file("swap"), 0, false, kNbytes, kMicroBatches};
      std::filesystem::create_directories(dir.file("swap"));
      KeptBoundaries kept(*acc, kChunks, home, nvme);
      const auto stream = acc->create_stream();
      for (int version = 0; version < 3; ++version) run_step(*stream, kept, version);
      if (home == BoundaryHome::kNvme) {
        // A place per (chunk, micro-batch), each 12000 bytes rounded up to 12288.
        CHECK(kept.file_nbytes() == uint64_t{kChunks} * kMicroBatches * 12288);
        CHECK(std::filesystem::file_size(dir.file("swap") + "/layer_major/rank0/boundaries.swp") ==
              kept.file_nbytes());
        // The backwards read back what the staging no longer held; the forwards read nothing.
        CHECK(kept.read_nbytes() > 0);
        CHECK(kept.read_nbytes() <= uint64_t{3} * (kChunks - 1) * kMicroBatches * 12288);
        // The staging (2m + 2 inputs) and the m gradients, whatever the chunk count.
        CHECK(kept.memory_nbytes() == (2 * kMicroBatches + 2) * 12288 + kMicroBatches * kNbytes);
      } else {
        CHECK(kept.file_nbytes() == 0);
        CHECK(kept.memory_nbytes() == ((kChunks - 1) * kMicroBatches + kMicroBatches) * kNbytes);
      }
      // What finetune budgets before step 1 (strata.pinned_pool_size) and strata plan predicts is what the store holds.
      const strata::pipeline::KeptBoundariesSize size =
          strata::pipeline::kept_boundaries_size(home, kChunks, kMicroBatches, kNbytes);
      CHECK(size.memory_nbytes == kept.memory_nbytes());
      CHECK(size.file_nbytes == kept.file_nbytes());
    }
  }
}

TEST_CASE("kept boundaries on nvme: a boundary larger than the file's places is refused, and the swap file goes "
          "with the store",
          "[pipeline][layer-major]") {
  auto acc = strata::make_cpu_accelerator();
  strata::test::TempDir dir;
  strata::nvme::AioHandle io(strata::nvme::AioOptions{});
  std::filesystem::create_directories(dir.file("swap"));
  const std::string file = dir.file("swap") + "/layer_major/rank0/boundaries.swp";
  {
    KeptBoundaries kept(*acc, 2, BoundaryHome::kNvme, {&io, dir.file("swap"), 0, false, 4096, 2});
    std::vector<char> big(8192, 1);
    const auto stream = acc->create_stream();
    CHECK_THROWS_WITH(kept.keep({1, 0, false}, big.data(), big.size(), *stream),
                      Catch::Contains("8192 bytes, more than the 4096 the nvme file was made for"));
    CHECK(std::filesystem::exists(file));
  }
  CHECK(!std::filesystem::exists(file));
  CHECK_THROWS_WITH(KeptBoundaries(*acc, 2, BoundaryHome::kNvme, {}),
                    Catch::Contains("strata.layer_major_boundaries nvme: the boundaries' files need the run's "
                                    "nvme_path"));
}
