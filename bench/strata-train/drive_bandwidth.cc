#include "bench/strata-train/drive_bandwidth.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "bench/common/stats.h"
#include "nvme/aio_handle.h"
#include "nvme/file.h"

namespace strata::bench::train {

DriveBandwidth measure_read_bandwidth(Accelerator& accelerator, const std::filesystem::path& dir,
                                      const nvme::AioOptions& aio, size_t nbytes, int passes) {
  constexpr size_t kChunk = size_t{4} << 20;  // requests of 4 MiB: the handle splits them into block_size pieces
  constexpr size_t kInFlight = 8;             // requests kept queued, so the workers never run dry
  nbytes = std::max(kChunk, (nbytes + kChunk - 1) / kChunk * kChunk);
  const std::filesystem::path path = dir / ("strata-train-drive-" + std::to_string(::getpid()) + ".bin");
  DriveBandwidth result;
  result.file_nbytes = nbytes;
  result.passes = passes;
  void* buffer = accelerator.allocate_pinned(kChunk * kInFlight);
  std::memset(buffer, 0x5a, kChunk * kInFlight);
  try {
    nvme::AioHandle handle(aio);
    nvme::File file = nvme::File::open(path.string(), nvme::OpenMode::kTruncate, /*direct=*/true);
    result.direct = file.direct();
    file.allocate(nbytes);
    // Submits one request per chunk over the whole file, at most kInFlight queued.
    const auto sweep = [&](bool write) {
      std::deque<nvme::Ticket> queued;
      for (size_t offset = 0, k = 0; offset < nbytes; offset += kChunk, ++k) {
        if (queued.size() == kInFlight) {
          handle.wait(queued.front());
          queued.pop_front();
        }
        char* slot = static_cast<char*>(buffer) + (k % kInFlight) * kChunk;
        queued.push_back(write ? handle.submit_write(file, slot, kChunk, offset)
                               : handle.submit_read(file, slot, kChunk, offset));
      }
      for (nvme::Ticket t : queued) handle.wait(t);
    };
    sweep(/*write=*/true);
    file.sync();
    std::vector<double> rates;
    for (int p = 0; p < passes; ++p) {
      const auto start = std::chrono::steady_clock::now();
      sweep(/*write=*/false);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      rates.push_back(static_cast<double>(nbytes) / seconds);
    }
    result.read_bytes_per_s = median(rates);
  } catch (...) {
    accelerator.deallocate_pinned(buffer);
    std::error_code ignored;
    std::filesystem::remove(path, ignored);
    throw;
  }
  accelerator.deallocate_pinned(buffer);
  std::error_code ignored;
  std::filesystem::remove(path, ignored);
  return result;
}

}  // namespace strata::bench::train
