// What the block layer did for a file's device: request counts and sectors
// from /sys/dev/block/MAJ:MIN/stat (the same numbers as /proc/diskstats), and
// the device's request limits. For measuring tools and tests: the size of the
// requests that reach the device says whether pieces were split or merged.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace strata::nvme {

// Cumulative counters of one block device (see the kernel's
// Documentation/block/stat.rst). Sectors are 512 bytes.
struct BlockCounters {
  uint64_t reads = 0;  // read requests completed
  uint64_t read_sectors = 0;
  uint64_t writes = 0;  // write requests completed
  uint64_t write_sectors = 0;

  BlockCounters operator-(const BlockCounters& earlier) const;
  // Average bytes per request (0 when there were none).
  double read_request_nbytes() const;
  double write_request_nbytes() const;
};

// The block device holding a file (a partition where the file system is on one).
// Thread-safe (reads sysfs on each call).
class BlockDevice {
 public:
  // The device of `path` (an existing file or directory). nullopt, with
  // `why` set, when its statistics cannot be read: a file system without a
  // block device (tmpfs, overlay, NFS), or no /sys.
  static std::optional<BlockDevice> of(const std::string& path, std::string* why = nullptr);

  const std::string& name() const { return name_; }  // "vda", "nvme0n1p2", or "MAJ:MIN"
  // Current counters. Throws Error(kIo) when the stat file stops being readable.
  BlockCounters counters() const;
  // Request limits of the device's queue (of the whole disk for a partition):
  // largest request (max_sectors_kb) and scatter-gather segments per request;
  // 0 when unknown.
  uint64_t max_request_nbytes() const { return max_request_nbytes_; }
  uint64_t max_segments() const { return max_segments_; }

 private:
  std::string name_;
  std::string stat_path_;
  uint64_t max_request_nbytes_ = 0;
  uint64_t max_segments_ = 0;
};

}  // namespace strata::nvme
