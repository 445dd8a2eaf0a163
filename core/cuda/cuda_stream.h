// Internals of the cuda backend shared with the NCCL communicator (CUDA builds
// only; not part of the public API).
//
// Error histories: every cuda stream keeps, on the host, the positions of its
// host functions and waits and what each depends on. An error raised by a host
// function, or found in something the stream waited on (an event of another
// stream, a host event, a collective a watchdog declared failed), is stored at
// its position; an event recorded at position p reports the first error at or
// before p once the device has reached it. Dependencies are resolved lazily on
// the host (when an event, stream or host function needs the answer), so error
// propagation costs the device nothing: no host function or extra wait is
// queued per Stream::wait.
#pragma once

#include <exception>
#include <memory>
#include <mutex>

#include "core/accelerator.h"

namespace strata::cuda_internal {

// Something whose outcome a stream's history depends on.
// Thread-safety: implementations are safe to call from any thread.
class ErrorSource {
 public:
  virtual ~ErrorSource() = default;
  // The error of the work this source stands for, or nullptr. Called only once
  // that work has completed on the device (the caller saw an event ordered
  // after it complete, or runs in a host function ordered after it). Must
  // neither block nor call CUDA: it runs inside host functions.
  virtual std::exception_ptr error() = 0;
  // Whether that work has completed. May call CUDA (never from a host
  // function); never blocks.
  virtual bool completed() = 0;
  // The error if the outcome is already known to be a failure, else nullptr;
  // decides nothing, so it may be asked before the work completed (to name
  // the cause when the device reports an error instead of completing). Never
  // blocks, never calls CUDA.
  virtual std::exception_ptr decided_error() = 0;
};

// Device work (an NCCL collective) whose outcome a watcher on the host may
// decide before the device finishes it: the watcher fails it on a timeout or
// an asynchronous error, then makes the device work end (ncclCommAbort). Work
// that completes before the watcher fails it has succeeded.
class WatchedWork final : public ErrorSource {
 public:
  // `done`: an event of the stream, recorded right after the work.
  explicit WatchedWork(std::unique_ptr<Event> done);
  ~WatchedWork() override;
  // For the watcher: true once the outcome is fixed (completed, or failed).
  bool decided();
  // For the watcher: fails the work with `error` unless it has already
  // completed or been decided. Returns whether it failed it.
  bool fail(std::exception_ptr error);

  std::exception_ptr error() override;
  bool completed() override;
  std::exception_ptr decided_error() override;

 private:
  enum class State { kPending, kSucceeded, kFailed };
  std::mutex mutex_;
  State state_ = State::kPending;
  std::exception_ptr error_;
  std::unique_ptr<Event> done_;
};

// Adds `source` to the history of `stream` (a stream of a cuda accelerator) at
// its current end, without making the device wait for it: events recorded on
// the stream afterwards, the stream's synchronize(), its later host functions
// and streams that wait on those events report the source's error. The caller
// orders this call with its other submissions to the stream. Throws
// Error(kBadArgument) for a stream of another backend.
void attach_error_source(Stream& stream, std::shared_ptr<ErrorSource> source);

// The CUDA device of a cuda accelerator; Error(kBadArgument) for another backend.
int device_index(const Accelerator& accelerator);

}  // namespace strata::cuda_internal
