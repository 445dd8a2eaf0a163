// The device abstraction (DESIGN.md §4): device memory under a budget, streams,
// events, asynchronous copies and pinned host memory. Two implementations:
// cpu (host memory, one thread per stream) and cuda. Layers above program
// against this interface only; which one is used is chosen in make_accelerator.
// Every contract stated here holds on both backends (tests/runtime/accelerator_contract.h).
//
// Thread-safety: every method of Accelerator, Stream, Event and HostEvent may be
// called from any thread. Work submitted to one stream runs in submission
// order; when several threads submit to one stream at once, the order among
// their concurrent calls is unspecified, so such callers order them themselves.
// Ownership: objects created by an Accelerator (streams, events, host events,
// memory) must be destroyed or freed before it. Destroying a stream waits for
// its queued work.
// Errors: strata::Error. Work that fails on a stream (a host function that
// throws, a copy the device rejects, a collective a communicator declares
// failed, a wait on a failed event) is that stream's error from that point on:
// see Stream.
#pragma once

#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace strata {

enum class Backend { kCpu, kCuda };
std::string_view backend_name(Backend backend);

enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice, kHostToHost };

// A point in a stream's work, or (HostEvent) a completion a host thread reports.
// A recorded Event is reusable: each Stream::record moves the point; a wait or
// a stream-ordered free made earlier keeps the point it saw.
class Event {
 public:
  virtual ~Event() = default;
  // Blocks until the work before the point has finished. Throws the first error
  // of that work (the stream's error if it was raised before the point, or one
  // that reached the stream through a wait before the point); an error raised
  // on the stream after the point does not make it throw. An event never
  // recorded is complete.
  virtual void synchronize() = 0;
  // True when complete (successfully or not; synchronize tells which). Never
  // throws for stream errors and never blocks.
  virtual bool query() = 0;
};

// An event completed by a host thread (an I/O completion, a watchdog) instead
// of by stream work: streams can wait on it, so that a transfer a host thread
// completes is ordered before device work without a thread blocked on it.
// Single-use: it completes once, by the first signal() or fail(); later calls
// have no effect. It cannot be recorded on a stream (Stream::record throws
// Error(kBadArgument)). Destroying it before it completes fails it (waiting
// streams are released and get an Error(kInternal) naming the mistake).
// A signal() must not depend on device work of this accelerator queued behind
// a wait on it (on cuda a waiting stream may hold up other streams that share
// its hardware queue, and on the fallback path the driver's callback thread).
class HostEvent : public Event {
 public:
  // Completes the event: synchronize() returns, waiting streams go on.
  // Callable from any thread, including ones that hold no CUDA context.
  virtual void signal() = 0;
  // Completes the event with `error`: synchronize() rethrows it, and every
  // stream that waited on this event gets it as its error (see Stream).
  virtual void fail(std::exception_ptr error) = 0;
};

// An ordered queue of work.
//
// Errors: the first failure among a stream's work (a host function that threw,
// a wait on an event whose work failed) is the stream's error. It is reported
// by every event recorded on the stream after the failure, by synchronize(),
// and, through Stream::wait, by every stream that waits on such an event (and
// by those streams' later events), on both backends. After it, the stream's
// host functions are skipped. Other work submitted after the failure (copies,
// memsets, kernels, waits) is skipped on cpu but still runs on cuda, so its
// results are undefined: the events after it report the error. An error is
// never reported by an event recorded before it. A CUDA error of the device
// itself (an illegal address) is reported by later calls as Error(kCuda).
class Stream {
 public:
  virtual ~Stream() = default;
  // Records `event` (an Event from create_event of the same accelerator) at the
  // current end of this stream. Error(kBadArgument) for a HostEvent or an event
  // of another backend.
  virtual void record(Event& event) = 0;
  // Work submitted to this stream after the call waits until `event` completes
  // (as recorded at the time of the call; a later record does not move this
  // wait). Accepts every Event this accelerator's objects hand out: its own
  // events, host events, and events returned by a communicator built on it.
  // If the work before `event` failed, its error becomes this stream's error.
  // Never blocks the caller. Error(kBadArgument) for an event of another backend.
  virtual void wait(Event& event) = 0;
  // Runs `fn` on a host thread after all earlier work of this stream. An
  // exception thrown by fn becomes the stream's error. On cuda fn runs on the
  // driver's callback thread: it must not call CUDA. fn must be quick and must
  // never block — no file or network I/O, no waiting for other work, events
  // or locks held for long: on cuda the host functions of every stream of the
  // process run one after another on that one thread, so one that blocks holds
  // up all of them (the optimizer's arming, the reducer's notices). Blocking
  // work belongs on a thread of its own that a HostEvent reports back from
  // (offload/grad_shard.cc). AcceleratorOptions::cpu_shared_host_thread makes
  // the cpu backend behave the same way, for tests.
  virtual void launch_host_func(std::function<void()> fn) = 0;
  // Blocks until all submitted work finished; rethrows the stream's error.
  virtual void synchronize() = 0;
  // cudaStream_t for cuda, nullptr for cpu.
  virtual void* native_handle() = 0;
};

struct MemoryStats {
  size_t capacity_nbytes = 0;  // the budget
  // Handed out and not yet freed, including blocks freed with deallocate_after
  // whose event has not been seen complete yet (pending_free_nbytes).
  size_t in_use_nbytes = 0;
  size_t peak_nbytes = 0;      // highest in_use seen
  size_t cached_nbytes = 0;    // held by a caching allocator but free (cuda; cpu: blocks >= 128 KiB, within the peak)
  size_t pending_free_nbytes = 0;  // part of in_use: freed after an event not yet complete
};

struct AcceleratorOptions {
  // Device memory budget; 0 means: cpu — half of physical memory; cuda — the
  // device's free memory at creation.
  size_t memory_budget_nbytes = 0;
  // cpu only: every stream's host functions run one at a time on one thread
  // shared by the accelerator's streams, as CUDA runs them on the driver's one
  // callback thread — so a host function that blocks is seen delaying other
  // streams' host functions here too (the contract tests use it). Default: on
  // each stream's own thread. Copies, memsets and waits stay on the stream's thread.
  bool cpu_shared_host_thread = false;
};

class Accelerator {
 public:
  virtual ~Accelerator() = default;

  virtual Backend backend() const = 0;
  // "cpu" or e.g. "cuda:0 (NVIDIA H100 80GB HBM3)".
  virtual std::string name() const = 0;
  // Device memory is host memory (the cpu backend): the host may read and
  // write what allocate() returns in place, and kernels and collectives may
  // read pinned host memory directly, with no copy to the device.
  bool host_addressable() const { return backend() == Backend::kCpu; }

  // Device memory, one budget per accelerator (op scratch comes from it too).
  // The budget counts in-use, pending and cached bytes: an allocation that fits
  // only after the allocator drops cached blocks drops them; one that does not
  // fit throws Error(kOutOfMemory) naming requested, in use (and pending),
  // cached and capacity bytes. allocate never waits for stream work: a block
  // whose stream-ordered free is pending is not available until its event is
  // seen complete. Nor does it wait for the device: on cuda the blocks come
  // from CUDA's stream-ordered allocator on a stream of the allocator's own,
  // so dropping cached blocks is no cudaFree (which waits for the whole
  // device, a stream parked on a host event the caller is yet to signal
  // included: a deadlock).
  // Pointers are aligned to at least 256 bytes.
  virtual void* allocate(size_t nbytes) = 0;
  // Frees ptr now. The caller guarantees that no queued work on any stream
  // still uses ptr (e.g. it synchronized the streams that used it); otherwise
  // use deallocate_after. deallocate(nullptr) is a no-op; an unknown pointer
  // is Error(kInternal).
  virtual void deallocate(void* ptr) = 0;
  // Stream-ordered free: ptr is freed once `event` (as recorded now; any Event
  // of this accelerator, a HostEvent included) has completed, successfully or
  // not. Never blocks the caller. Until then the block counts as in use and is
  // not handed to another allocation. Completion is observed by later
  // allocate, deallocate, deallocate_after and memory_stats calls.
  // deallocate_after(nullptr, e) is a no-op; an unknown pointer is Error(kInternal).
  virtual void deallocate_after(void* ptr, Event& event) = 0;
  virtual MemoryStats memory_stats() const = 0;
  // A device tensor that frees itself through this accelerator (which must
  // outlive it) with deallocate: drop it only once no queued work uses it.
  Tensor allocate_tensor(DType dtype, Shape shape);

  // Page-locked host memory for async copies and NVMe I/O, aligned to 4096.
  virtual void* allocate_pinned(size_t nbytes) = 0;
  virtual void deallocate_pinned(void* ptr) = 0;

  virtual std::unique_ptr<Stream> create_stream() = 0;
  // A Stream over `native`, a stream another library owns (a cudaStream_t:
  // torch's current stream), so that its work and this accelerator's streams
  // can be ordered by events (record, wait) without the host waiting. The
  // Stream does not own it: destroying the Stream neither synchronizes nor
  // destroys `native`, which must outlive it. Its synchronize() waits for all
  // of `native`'s work. Error(kBadArgument) for a null handle, and on cpu,
  // whose streams are strata's own threads (there is no native stream).
  virtual std::unique_ptr<Stream> borrow_stream(void* native);
  // An event to record on this accelerator's streams.
  virtual std::unique_ptr<Event> create_event() = 0;
  // An event a host thread completes (see HostEvent).
  virtual std::unique_ptr<HostEvent> create_host_event() = 0;

  // Copies nbytes in stream order; src and dst stay valid until the copy has run.
  // Host memory should be pinned (allocate_pinned): on cuda a copy to or from
  // pageable memory may block the caller until the stream has reached it.
  virtual void copy_async(void* dst, const void* src, size_t nbytes, CopyKind kind,
                          Stream& stream) = 0;
  virtual void memset_async(void* dst, int value, size_t nbytes, Stream& stream) = 0;
};

// The cpu backend; never fails to construct.
std::unique_ptr<Accelerator> make_cpu_accelerator(const AcceleratorOptions& options = {});

// The cuda backend on device `device_index`. Throws Error(kCuda) when strata was
// built without CUDA or the device is not present.
std::unique_ptr<Accelerator> make_cuda_accelerator(int device_index,
                                                   const AcceleratorOptions& options = {});

// Whether this build contains the CUDA backend.
bool cuda_built();
// Number of usable CUDA devices; 0 without CUDA, driver or device (never throws).
int cuda_device_count();

struct CudaDeviceInfo {
  int index = 0;
  std::string name;
  int compute_major = 0, compute_minor = 0;
  size_t total_nbytes = 0, free_nbytes = 0;
  std::string pci_bus_id;
};

// What the CUDA stack offers on this machine (for `strata doctor`). Never throws;
// `error` says why devices could not be listed. Versions are 0 when unknown.
struct CudaInfo {
  bool built = false;
  int driver_version = 0;   // e.g. 13000 for 13.0
  int runtime_version = 0;
  int cublas_version = 0;
  int nccl_version = 0;     // e.g. 22805 for 2.28.5
  std::vector<CudaDeviceInfo> devices;
  std::string error;
};
CudaInfo cuda_info();

// "cpu", "cuda" (device LOCAL_RANK, else 0) or "auto" (cuda when a device is
// present, else cpu). One rank per GPU: with cuda or auto on a machine with
// GPUs, LOCAL_WORLD_SIZE local ranks (mpirun's OMPI_COMM_WORLD_LOCAL_SIZE; a
// process alone is one) need as many GPUs — two ranks
// on one GPU would meet only NCCL's "invalid usage" at the first collective —
// so fewer GPUs than local ranks is Error(kBadArgument) naming the GPU count
// and the two ways out (-n <gpus>, or strata.accelerator: cpu), raised in
// every rank before it touches a GPU or its peers (see rank_device) — except
// where CUDA_VISIBLE_DEVICES leaves a process exactly one GPU: a launcher that
// gives each rank its own GPU that way (SLURM's --gpus-per-task=1) is trusted.
// STRATA_TEST_CUDA_DEVICE_COUNT, for tests only, replaces the device count
// this rule and auto's choice read (tests/runtime/launcher_test.cc fakes a
// one-GPU machine with it); creating the accelerator still needs real devices.
std::unique_ptr<Accelerator> make_accelerator(std::string_view kind,
                                              const AcceleratorOptions& options = {});

// The GPU of local rank `local_rank` among `local_world_size` on a machine with
// `device_count` GPUs (> 0): local_rank itself. Error(kBadArgument) when
// local_world_size > device_count (the message above), or for a rank outside
// [0, local_world_size).
int rank_device(int local_rank, int local_world_size, int device_count);

}  // namespace strata
