// The backend interface under the async handle: a per-worker queue that moves
// pieces (one buffer, one file range) through io_uring, libaio or pread/pwrite,
// and a fault-injecting wrapper for errors the kernel cannot be made to produce.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <vector>

#include "nvme/io_options.h"

#include "core/durable_file.h"

namespace strata::nvme {

enum class IoOp { kRead, kWrite };

// One transfer: the unit a backend submits.
struct IoPiece {
  IoOp op = IoOp::kRead;
  int fd = -1;
  void* buf = nullptr;
  size_t nbytes = 0;
  uint64_t offset = 0;
  int fixed_index = -1;  // index of a registered buffer containing buf, or -1
  uint64_t user_data = 0;
};

// A finished piece: result is bytes transferred (may be short) or -errno.
struct IoCompletion {
  uint64_t user_data = 0;
  long result = 0;
};

// One worker's submission queue. Not thread-safe: one thread uses it.
// At most capacity() pieces may be prepared-or-in-flight at any time.
class IoQueue {
 public:
  virtual ~IoQueue() = default;
  virtual size_t capacity() const = 0;
  // Queues a piece; it is handed to the kernel at the next submit().
  virtual void prepare(const IoPiece& piece) = 0;
  // Hands every prepared piece to the kernel. A piece the kernel refuses on
  // its own (bad fd, bad alignment) completes with -errno through wait().
  // Throws Error(kIo) when the submission syscall fails for the whole queue;
  // take_unsubmitted() then says which pieces never reached the kernel.
  virtual void submit() = 0;
  // Blocks until at least min_count pieces (≤ the number in flight) have
  // finished; appends them (and any others already finished) to `out`.
  // Throws Error(kIo) when waiting itself fails.
  virtual void wait(std::vector<IoCompletion>& out, size_t min_count) = 0;
  // After submit() or submit_and_wait() threw: appends the user_data of every
  // prepared piece that was never handed to the kernel (it will never
  // complete) and forgets them. Pieces handed over still complete through
  // wait(), so their buffers stay in use until then.
  virtual void take_unsubmitted(std::vector<uint64_t>& user_data) {}
  // submit() then wait(); io_uring does both in one system call.
  virtual void submit_and_wait(std::vector<IoCompletion>& out, size_t min_count) {
    submit();
    wait(out, min_count);
  }
  // Registers buffers for fixed-buffer I/O (io_uring only). Returns false when
  // this backend or the kernel limits do not allow it; nothing is registered then.
  // Must be called with nothing in flight.
  virtual bool register_buffers(const std::vector<iovec>& buffers) { return false; }
  virtual void unregister_buffers() {}
};

// Creates queues. Thread-safe.
class IoBackend {
 public:
  virtual ~IoBackend() = default;
  virtual std::string_view name() const = 0;
  // Throws Error(kIo) when the kernel refuses (io_uring disabled, aio-max-nr reached).
  virtual std::unique_ptr<IoQueue> create_queue(size_t depth) = 0;
};

std::unique_ptr<IoBackend> make_backend(EngineKind kind);

// What the fault wrapper does to a chosen piece.
struct IoFault {
  enum class Kind {
    kError,  // complete with -error without touching the file
    kShort,  // really transfer only short_nbytes (≥ 0) and report that
    kBrokenQueue,  // the queue's next submit() throws Error(kIo), as if the ring died
    kSlow,   // transfer it in full, but only after `delay` (a slow or busy disk)
  };
  uint64_t nth = 1;                 // 1-based count of matching pieces submitted so far
  Kind kind = Kind::kError;
  int error = 5;                    // errno for kError (default EIO)
  size_t short_nbytes = 0;          // bytes actually transferred for kShort
  std::optional<IoOp> op;           // count only reads or only writes; nullopt: both
  bool repeat = false;              // also hit every later matching piece
  std::chrono::milliseconds delay{0};  // for kSlow: held this long before it is handed to the disk
};

// Counts pieces across every queue of the wrapper; thread-safe.
class FaultPlan {
 public:
  explicit FaultPlan(std::vector<IoFault> faults) : faults_(std::move(faults)) {}
  // Decides the fate of one piece being prepared; nullopt = pass through.
  std::optional<IoFault> next(IoOp op);
  // How many faults have fired so far.
  uint64_t fired() const { return fired_.load(); }

 private:
  std::mutex mutex_;
  std::vector<IoFault> faults_;
  uint64_t reads_ = 0, writes_ = 0, all_ = 0;
  std::atomic<uint64_t> fired_{0};
};

// Wraps `inner`: pieces chosen by `plan` fail or complete short; the rest pass
// through unchanged. The plan is shared so a test can read fired().
std::unique_ptr<IoBackend> make_fault_backend(std::unique_ptr<IoBackend> inner,
                                              std::shared_ptr<FaultPlan> plan);

// The same plan for the durable files of checkpoints, manifests, exports and
// run files (core/durable_file.h), installed with strata::set_file_faults:
// each write(2) of one of them is a write piece of the plan (kError fails it
// with the fault's errno, kShort writes short_nbytes and the writer resumes,
// kBrokenQueue fails it with EIO); fsync and rename pass through.
std::shared_ptr<FileFaults> file_faults(std::shared_ptr<FaultPlan> plan);

}  // namespace strata::nvme
