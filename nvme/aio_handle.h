// The async I/O handle: splits large read/write requests into block_size
// pieces across thread_count workers (each with its own ring or io_context,
// queue_depth pieces in flight), checks every completion, resumes short
// transfers and reports errors from wait() on the caller's thread. With
// options.auto_tune, block size and queue depth are chosen on the first
// traffic (nvme/online_tuner.h) and the choice is logged.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "nvme/file.h"
#include "nvme/io_backend.h"
#include "nvme/io_options.h"
#include "nvme/online_tuner.h"

namespace strata::nvme {

using Ticket = uint64_t;

// Where a request joins its workers' queues. kUrgent: ahead of every kNormal
// piece not yet handed to the kernel (behind urgent ones queued before it),
// so a request the caller is about to wait for — a parameter the next
// operator needs — does not queue behind background traffic such as the
// optimizer's state streaming; pieces already in flight are not preempted,
// so it waits at most a queue depth of them.
enum class IoPriority { kNormal, kUrgent };

// Per-handle counters (bytes and pieces finished, resumptions, retries).
struct AioStats {
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t pieces = 0;
  uint64_t short_resumed = 0;  // short completions resumed
  uint64_t retried = 0;        // EINTR/EAGAIN resubmissions
  uint64_t fixed_pieces = 0;   // pieces that used a registered (fixed) buffer
};

// Thread-safety: every public method may be called from any thread; a ticket
// may be waited on once (by one thread). Ownership: the handle owns its worker
// threads and queues; buffers and Files belong to the caller and must stay
// valid until the request's wait() (or wait_all()) returns.
// Destruction waits for everything in flight (errors are then only logged;
// completion callbacks are still called).
class AioHandle {
 public:
  // Starts the workers. `backend` overrides options.engine (the fault wrapper
  // in tests). Throws Error(kBadArgument) for invalid options, Error(kIo) when
  // a ring / io_context cannot be created.
  explicit AioHandle(const AioOptions& options, std::unique_ptr<IoBackend> backend = nullptr);
  ~AioHandle();
  AioHandle(const AioHandle&) = delete;
  AioHandle& operator=(const AioHandle&) = delete;

  // Starts reading nbytes at `offset` of `file` into `buf`. For an O_DIRECT file
  // buf, offset and nbytes must be multiples of kDirectIoAlignment; otherwise
  // throws Error(kBadArgument) stating the requirement. nbytes == 0 is allowed.
  Ticket submit_read(const File& file, void* buf, size_t nbytes, uint64_t offset,
                     IoPriority priority = IoPriority::kNormal);
  Ticket submit_write(const File& file, const void* buf, size_t nbytes, uint64_t offset,
                      IoPriority priority = IoPriority::kNormal);

  // Completion callbacks, for callers that keep many requests in flight with
  // no thread blocked per request (the ZeRO engine's prefetch signals a
  // HostEvent from here). Starts the request like the ticketed forms (same
  // argument checks and exceptions, thrown before anything is queued) and
  // calls on_done(error) exactly once when its last piece has finished:
  // error is nullptr on success, else the Error(kIo) that wait() would throw
  // for it. on_done runs on an I/O worker thread — or on the calling thread
  // before submit returns when nbytes == 0 — and holds up that worker's
  // completions while it runs: it must be quick, must not wait for I/O of this
  // handle, and should not throw (an exception it throws is logged and
  // dropped). Such a request has no ticket: wait_all() waits for it, on_done
  // included, but neither consumes it nor rethrows its error (on_done got it).
  // The buffer must stay valid until on_done has been called.
  using DoneFn = std::function<void(std::exception_ptr error)>;
  void submit_read(const File& file, void* buf, size_t nbytes, uint64_t offset, DoneFn on_done,
                   IoPriority priority = IoPriority::kNormal);
  void submit_write(const File& file, const void* buf, size_t nbytes, uint64_t offset, DoneFn on_done,
                    IoPriority priority = IoPriority::kNormal);

  // Blocks until the request finished. Throws Error(kIo) naming file, offset,
  // length and errno text if any piece failed (EIO, ENOSPC, EFBIG, read past
  // end of file, ...); Error(kBadArgument) for an unknown or already-waited ticket.
  void wait(Ticket ticket);
  // True when the request finished (wait() will not block).
  bool done(Ticket ticket) const;
  // Waits for each of `tickets` (the caller's own) and consumes them; once all
  // have finished, rethrows the error of the first one that failed.
  void wait(std::span<const Ticket> tickets);
  // Blocks until no request is in flight (callback requests until their
  // on_done has returned). Consumes nothing and reports nothing: a ticket is
  // still waited on, and its error reported, by whoever holds it — so one user
  // of a shared handle never takes another's completions or errors.
  void wait_all();

  // Synchronous helpers: submit + wait.
  void read(const File& file, void* buf, size_t nbytes, uint64_t offset,
            IoPriority priority = IoPriority::kNormal);
  void write(const File& file, const void* buf, size_t nbytes, uint64_t offset,
             IoPriority priority = IoPriority::kNormal);

  // Registers memory (e.g. the pinned pool's buffers) as io_uring fixed
  // buffers; pieces inside a registered range then use READ_FIXED/WRITE_FIXED.
  // Replaces any earlier registration. Requires no request in flight (throws
  // Error(kBadArgument) otherwise). Returns false — and I/O still works, unfixed —
  // when the backend is not io_uring or the kernel refuses (memlock limit).
  bool register_buffers(const std::vector<iovec>& buffers);
  void unregister_buffers();

  // While on, each piece's latency (first submission to final completion,
  // resumptions included) is recorded; take_latencies_ns() returns and clears
  // what was recorded so far. For measuring tools; costs one clock read per piece.
  void set_record_latency(bool on) { record_latency_.store(on); }
  std::vector<uint64_t> take_latencies_ns();

  // The options given at construction (with auto_tune, block_size and
  // queue_depth are where tuning starts; auto_tune_report() has the choice).
  const AioOptions& options() const { return options_; }
  // aio.auto_tune's measurements and choice for reads or writes; enabled is
  // false when auto_tune is off. Thread-safe.
  TuneReport auto_tune_report(IoOp op) const { return tuner_->report(op); }
  std::string_view backend_name() const;
  AioStats stats() const;

 private:
  struct Request;
  struct Piece;
  struct Worker;

  Ticket submit(IoOp op, const File& file, void* buf, size_t nbytes, uint64_t offset, DoneFn on_done,
                IoPriority priority);
  void worker_loop(Worker& worker);
  void finish_piece(Piece& piece, std::exception_ptr error);
  int find_fixed_index(const void* buf, size_t nbytes) const;

  AioOptions options_;
  std::unique_ptr<IoBackend> backend_;
  std::vector<std::unique_ptr<Worker>> workers_;
  // Cuts every request into pieces: the configured setting when auto_tune is
  // off (lock-free then), candidates and then the choice when it is on.
  std::unique_ptr<OnlineTuner> tuner_;

  mutable std::mutex mutex_;  // guards requests_, next_ticket_, stats_, fixed_
  std::condition_variable done_cv_;
  std::unordered_map<Ticket, std::shared_ptr<Request>> requests_;
  Ticket next_ticket_ = 1;
  size_t next_worker_ = 0;
  AioStats stats_;
  std::vector<iovec> fixed_;
  bool fixed_active_ = false;
  std::atomic<bool> record_latency_{false};
};

}  // namespace strata::nvme
