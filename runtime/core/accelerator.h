// The device abstraction (DESIGN.md §4): device memory under a budget, streams,
// events, asynchronous copies and pinned host memory. Two implementations:
// cpu (host memory, one thread per stream) and cuda. Layers above program
// against this interface only; which one is used is chosen in make_accelerator.
//
// Thread-safety: an Accelerator may be used from several threads. A Stream or
// Event may be used from several threads, but callers must order their own
// submissions to one stream. Objects created by an Accelerator must be destroyed
// before it.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/core/tensor.h"

namespace strata {

enum class Backend { kCpu, kCuda };
std::string_view backend_name(Backend backend);

enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice, kHostToHost };

// Marks a point in a stream. Reusable: each record() moves the point.
class Event {
 public:
  virtual ~Event() = default;
  // Blocks until the work recorded before this event has finished. Rethrows the
  // error of the stream it was recorded on, if that work failed. An event never
  // recorded is complete.
  virtual void synchronize() = 0;
  // True when complete. Does not throw for stream errors (synchronize does).
  virtual bool query() = 0;
};

// An ordered queue of work. Errors raised by work on a stream are sticky: later
// work on it is skipped and synchronize() (and events recorded on it) rethrow.
class Stream {
 public:
  virtual ~Stream() = default;
  // Records `event` at the current end of this stream.
  virtual void record(Event& event) = 0;
  // Work submitted to this stream after the call waits until `event` completes.
  virtual void wait(Event& event) = 0;
  // Runs `fn` on a host thread after all earlier work of this stream. An
  // exception thrown by fn becomes the stream's error.
  virtual void launch_host_func(std::function<void()> fn) = 0;
  // Blocks until all submitted work finished; rethrows the stream's error.
  virtual void synchronize() = 0;
  // cudaStream_t for cuda, nullptr for cpu.
  virtual void* native_handle() = 0;
};

struct MemoryStats {
  size_t capacity_nbytes = 0;  // the budget
  size_t in_use_nbytes = 0;    // handed out and not yet freed
  size_t peak_nbytes = 0;      // highest in_use seen
  size_t cached_nbytes = 0;    // held by a caching allocator but free (cuda)
};

struct AcceleratorOptions {
  // Device memory budget; 0 means: cpu — half of physical memory; cuda — the
  // device's free memory at creation.
  size_t memory_budget_nbytes = 0;
};

class Accelerator {
 public:
  virtual ~Accelerator() = default;

  virtual Backend backend() const = 0;
  // "cpu" or e.g. "cuda:0 (NVIDIA H100 80GB HBM3)".
  virtual std::string name() const = 0;

  // Device memory. allocate throws Error(kOutOfMemory) naming requested, in use
  // and capacity when the budget cannot hold the request. Pointers are aligned
  // to at least 256 bytes. deallocate(nullptr) is a no-op.
  virtual void* allocate(size_t nbytes) = 0;
  virtual void deallocate(void* ptr) = 0;
  virtual MemoryStats memory_stats() const = 0;
  // A device tensor that frees itself through this accelerator (which must outlive it).
  Tensor allocate_tensor(DType dtype, Shape shape);

  // Page-locked host memory for async copies and NVMe I/O, aligned to 4096.
  virtual void* allocate_pinned(size_t nbytes) = 0;
  virtual void deallocate_pinned(void* ptr) = 0;

  virtual std::unique_ptr<Stream> create_stream() = 0;
  virtual std::unique_ptr<Event> create_event() = 0;

  // Copies nbytes in stream order; src and dst stay valid until the copy has run.
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

// "cpu", "cuda" (device from LOCAL_RANK, else 0) or "auto" (cuda when a device is present).
std::unique_ptr<Accelerator> make_accelerator(std::string_view kind,
                                              const AcceleratorOptions& options = {});

}  // namespace strata
