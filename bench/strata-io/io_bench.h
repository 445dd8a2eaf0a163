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
#include "nvme/block_stats.h"

namespace strata::bench {

struct IoCase {
  nvme::EngineKind engine = nvme::EngineKind::kUring;
  nvme::IoOp rw = nvme::IoOp::kRead;
  size_t bs = 1 << 20;
  int qd = 32;
  int threads = 1;
  // aio.auto_tune: bs and qd are where tuning starts; untimed passes run until
  // the tuner has settled, and the timed passes run with its choice.
  bool auto_tune = false;
  uint64_t auto_tune_nbytes = nvme::AioOptions{}.auto_tune_nbytes;  // per direction
};

// Another tool timed on the same file, parameters and rounds (fio, DeepSpeed).
struct AnchorResult {
  std::string name;             // "fio-io_uring", "fio-libaio", "deepspeed"
  std::vector<double> gbps;     // one per round
  std::vector<double> req_kib;  // mean request size at the block layer per round, KiB (empty: unknown)
  double gbps_median = 0;
  std::string error;            // why it was not (fully) measured; empty when it was
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
  // Mean size of the requests that reached the file's block device during each
  // timed pass, KiB (/sys/dev/block/M:m/stat; other I/O on the device counts
  // too). Empty when the device's statistics are not readable.
  std::vector<double> req_kib;
  // Share of the I/O buffers backed by 2 MiB huge pages (nullopt: unknown).
  std::optional<double> huge_share;
  std::vector<AnchorResult> anchors;  // --vs-fio, --vs-deepspeed
  // --auto-tune: GB/s of the untimed passes after --warmup that the tuner
  // still needed (none when the warmup carried its traffic), and the tuner's
  // report for this row's direction.
  std::vector<double> tuning_gbps;
  std::optional<nvme::TuneReport> tune;
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
  // Opens (creating) `path` with O_DIRECT unless buffered, and preallocates
  // size_nbytes. Callers validate their parameters before (no file is made for
  // a run that cannot start).
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
  // The file's block device, when its statistics are readable.
  const std::optional<nvme::BlockDevice>& device() const { return device_; }
  // Why device() is empty.
  const std::string& device_why() const { return device_why_; }
  // Mean request size (KiB) in direction `rw` between two readings; nullopt
  // without a readable device or when no request completed.
  static std::optional<double> request_kib(const std::optional<nvme::BlockCounters>& before,
                                           const std::optional<nvme::BlockCounters>& after,
                                           nvme::IoOp rw);
  std::optional<nvme::BlockCounters> counters() const;
  // Share of the I/O buffers in 2 MiB huge pages (nullopt before the first run).
  std::optional<double> huge_share() const;

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
  std::optional<nvme::BlockDevice> device_;
  std::string device_why_;
};

// Runs fio once on the same file and parameters with fio's `ioengine`
// (io_uring, libaio, psync); returns GB/s (1e9 B/s). Throws Error(kIo) when
// fio is missing or fails (its output is in the message).
double run_fio(const IoCase& c, const std::string& ioengine, const std::string& path,
               uint64_t size_nbytes, bool buffered);

}  // namespace strata::bench
