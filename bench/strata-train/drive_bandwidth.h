// The drive's sequential read bandwidth as the ZeRO engine's I/O sees it: a
// temporary file on the parameter swap directory, written with real data
// (fallocated but unwritten extents read back as zeros without touching the
// drive) and read back whole with O_DIRECT through an nvme::AioHandle at the
// engine's aio settings. The bound of an NVMe-offloaded step
// (PERFORMANCE.md) divides the parameter bytes it reads by this.
#pragma once

#include <cstddef>
#include <filesystem>

#include "nvme/io_options.h"
#include "core/accelerator.h"

namespace strata::bench::train {

struct DriveBandwidth {
  double read_bytes_per_s = 0;  // median over passes
  size_t file_nbytes = 0;
  int passes = 0;
  bool direct = false;  // O_DIRECT was granted (tmpfs refuses it: then the page cache is measured)
};

// Writes `nbytes` (rounded up to 4 MiB) to a file under `dir`, reads it
// `passes` times, removes it. Throws Error(kIo) naming the file when the I/O
// fails (no space, no such directory).
DriveBandwidth measure_read_bandwidth(Accelerator& accelerator, const std::filesystem::path& dir,
                                      const nvme::AioOptions& aio, size_t nbytes, int passes = 3);

}  // namespace strata::bench::train
