// aio.auto_tune: choosing block size and queue depth on the live traffic.
//
// The handle asks the tuner how to cut each piece (cut()) and tells it when a
// piece went to the kernel (started()) and when it finished (finished()). For
// the first AioOptions::auto_tune_nbytes of reads, and separately of writes
// (the two often prefer different settings and come in different phases of a
// step), the tuner hands out the candidate settings in turn, in slices of
// auto_tune_nbytes / (candidates x rounds) bytes, round 2 in reverse order.
// Each piece carries its setting: its length is the candidate's block size and
// the worker keeps at most the candidate's queue depth in flight while that
// piece is next in line. Once every slice's pieces have finished, the tuner
// picks the candidate with the highest throughput, logs one line, and from then
// on cut() hands out that setting without taking a lock.
//
// Throughput of a candidate = bytes its pieces moved / its busy time: the time
// during which at least one of its pieces (of that direction) was in flight,
// so the time the application left the queue empty is not counted. For the
// candidates not to share that time, a worker starts a piece of one candidate
// only once its pieces of the previous candidate (same direction) have all
// finished (a short drain at each of the few slice changes), and the handle
// spreads each slice's pieces over all workers, so they switch together.
//
// Thread-safety: every method may be called from any thread. Until a direction
// settles, its calls take one mutex (held briefly, nothing called under it).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "nvme/io_backend.h"
#include "nvme/io_options.h"

namespace strata::nvme {

// One candidate's measurement so far.
struct TuneMeasurement {
  IoSetting setting;
  uint64_t nbytes = 0;  // bytes its pieces moved
  double busy_s = 0;    // busy time charged to them
  double gbps() const { return busy_s > 0 ? static_cast<double>(nbytes) / busy_s / 1e9 : 0; }
};

// What the tuner has done for one direction.
struct TuneReport {
  bool enabled = false;   // auto_tune on
  bool settled = false;   // a choice was made; `chosen` is final
  IoSetting chosen;       // the setting in force (the configured one until settled)
  std::vector<TuneMeasurement> candidates;  // in AioOptions::tune_candidates() order
  std::string summary;    // the logged line (empty until settled)
};

class OnlineTuner {
 public:
  // A piece's tag: the index of the candidate it measures (>= 0), or this.
  static constexpr int kUntracked = -1;  // auto_tune off or settled: not measured

  // How to cut the next piece of a request.
  struct Cut {
    size_t nbytes = 0;    // the piece's length
    int queue_depth = 0;  // pieces in flight its worker allows while it is next
    int tag = kUntracked;
    // Cut past the last slice, while its pieces are still in flight: it runs
    // and is measured as the last slice's candidate, but settling does not
    // wait for it (under steady traffic there is always such a piece).
    bool overtime = false;
  };

  // `options` must have passed validate(). `label` names the handle in the log line.
  OnlineTuner(const AioOptions& options, std::string label);

  // The next piece of a request with remaining_nbytes (> 0) left to cut.
  Cut cut(IoOp op, size_t remaining_nbytes);
  // The piece with `tag` was handed to the kernel. A worker hands a piece with
  // a candidate tag (>= 0) over only when none of its in-flight pieces of the
  // same direction has another candidate tag (see above).
  void started(IoOp op, int tag);
  // The piece with `tag` finished (ok: all its bytes moved). `was_started`:
  // started() was called for it (a piece failed before submission was not).
  // `overtime`: as its Cut said.
  void finished(IoOp op, int tag, size_t nbytes, bool ok, bool was_started, bool overtime);

  TuneReport report(IoOp op) const;

 private:
  struct Clock {
    int64_t running = 0;   // the candidate's pieces in flight
    int64_t since_ns = 0;  // when `running` last went from 0 to 1
  };
  struct Direction {
    std::vector<TuneMeasurement> measured;  // one per candidate
    std::vector<Clock> clocks;              // one per candidate
    uint64_t cut_nbytes = 0;     // tuning bytes handed out so far
    int64_t timed_pending = 0;   // pieces cut within the slices, not yet finished
    std::atomic<bool> settled{false};
    IoSetting chosen;            // written before `settled` is set; constant after
    std::string summary;
  };

  Direction& direction(IoOp op) { return op == IoOp::kRead ? reads_ : writes_; }
  const Direction& direction(IoOp op) const { return op == IoOp::kRead ? reads_ : writes_; }
  void settle(IoOp op, Direction& d);  // mutex_ held; fills chosen and summary, sets settled

  const std::vector<IoSetting> candidates_;
  const IoSetting configured_;
  const std::string label_;
  std::vector<int> schedule_;  // candidate index of each slice
  uint64_t slice_nbytes_ = 0;
  uint64_t total_nbytes_ = 0;  // slice_nbytes_ x schedule_.size()
  mutable std::mutex mutex_;   // guards both Directions (except settled/chosen once settled)
  Direction reads_, writes_;
};

}  // namespace strata::nvme
