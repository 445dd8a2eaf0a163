// strata-io's measuring core: timed sequential passes over one file through an
// AioHandle, the data pattern that makes every 4 KiB block checkable, and fio runs.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "bench/common/stats.h"
#include "nvme/aio_handle.h"

namespace strata::bench {

struct IoCase {
  nvme::EngineKind engine = nvme::EngineKind::kUring;
  nvme::IoOp rw = nvme::IoOp::kRead;
  size_t bs = 1 << 20;
  int qd = 32;
  int threads = 1;
};

struct IoResult {
  IoCase c;
  uint64_t size_nbytes = 0;
  std::vector<double> gbps;  // one per timed iteration
  double gbps_median = 0;
  double iops = 0;           // pieces of bs bytes per second, from the median
  double lat_p50_us = 0;     // per piece, over every timed iteration
  double lat_p99_us = 0;
  std::optional<uint64_t> wrong;  // 4 KiB blocks that did not hold what was written
  std::vector<double> fio_gbps;   // with --vs-fio
  double fio_gbps_median = 0;
};

// Content of the test file: a random base block sequence, with every 4 KiB
// block stamped with its file offset so misplaced data is caught too.
class Pattern {
 public:
  // The base content repeats every kPeriod bytes of the file.
  static constexpr size_t kPeriod = size_t{1} << 20;
  explicit Pattern(uint64_t seed = 0x5eed);
  // Writes the content of file range [offset, offset + nbytes) into buf.
  void fill(char* buf, uint64_t offset, size_t nbytes) const;
  // Stamps only (buf already holds the base content, at a kPeriod-aligned start).
  void stamp(char* buf, uint64_t offset, size_t nbytes) const;
  // Number of 4 KiB blocks in buf that differ from the content of the range.
  uint64_t count_wrong(const char* buf, uint64_t offset, size_t nbytes) const;

 private:
  uint64_t seed_;
  std::vector<char> base_;
};

// Runs passes over one file with one handle configuration.
class IoRunner {
 public:
  // Opens (creating) `path` with O_DIRECT unless buffered.
  IoRunner(std::string path, uint64_t size_nbytes, bool buffered);
  ~IoRunner();

  // Warmup passes, timed passes and (with check) one verifying read pass.
  // `before_pass(i)`, when set, runs before timed pass i (strata-io runs fio
  // there, so the two alternate and see the same drive state).
  IoResult run(const IoCase& c, int iters, int warmup, bool check,
               const std::function<void(int)>& before_pass = {});
  // One pass; returns seconds. `wrong` (when not null) gets the count of bad blocks.
  double pass(nvme::AioHandle& handle, nvme::IoOp rw, uint64_t* wrong);
  // Makes sure the file holds the pattern (after fio overwrote it, or at start).
  void prepare(nvme::AioHandle& handle);
  void invalidate_pattern() { has_pattern_ = false; }
  const std::string& path() const { return path_; }
  uint64_t size_nbytes() const { return size_nbytes_; }

 private:
  void ensure_buffers(size_t chunk_nbytes, nvme::AioHandle& handle);

  std::string path_;
  uint64_t size_nbytes_;
  nvme::File file_;
  bool has_pattern_ = false;
  size_t chunk_nbytes_ = 0;
  static constexpr int kSlots = 4;
  char* slots_ = nullptr;  // kSlots * chunk_nbytes_, page-aligned, locked
  std::unique_ptr<Pattern> pattern_;
};

// Runs fio once on the same file and parameters; returns GB/s (1e9 B/s).
// Throws Error(kIo) when fio is missing or fails (its output is in the message).
double run_fio(const IoCase& c, const std::string& path, uint64_t size_nbytes, bool buffered);

}  // namespace strata::bench
