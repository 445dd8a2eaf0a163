// The cuda backend: a caching device allocator over cudaMalloc under a budget,
// CUDA streams and events, cudaHostAlloc pinned memory, async copies.
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <unordered_map>

#include "runtime/core/accelerator.h"
#include "runtime/core/error.h"
#include "runtime/core/log.h"
#include "runtime/cuda/cuda_check.h"

#include <cublas_v2.h>
#include <nccl.h>

namespace strata {
namespace {

// Restores the calling thread's current device on scope exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    STRATA_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) STRATA_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int device) : device_(device) {
    DeviceGuard guard(device_);
    STRATA_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~CudaEvent() override { cudaEventDestroy(event_); }
  void synchronize() override { STRATA_CUDA_CHECK(cudaEventSynchronize(event_)); }
  bool query() override { return cudaEventQuery(event_) == cudaSuccess; }
  cudaEvent_t handle() const { return event_; }

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
};

// Host functions run on a CUDA driver thread where exceptions must not escape,
// so their errors are stored here and rethrown by synchronize().
struct HostFuncCall {
  std::function<void()> fn;
  ErrorSlot* error;
};

void CUDART_CB run_host_func(void* user_data) {
  std::unique_ptr<HostFuncCall> call(static_cast<HostFuncCall*>(user_data));
  if (call->error->has_error()) return;
  try {
    call->fn();
  } catch (...) {
    call->error->set(std::current_exception());
  }
}

class CudaStream final : public Stream {
 public:
  explicit CudaStream(int device) : device_(device) {
    DeviceGuard guard(device_);
    STRATA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~CudaStream() override {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  void record(Event& event) override {
    STRATA_CUDA_CHECK(cudaEventRecord(static_cast<CudaEvent&>(event).handle(), stream_));
  }
  void wait(Event& event) override {
    STRATA_CUDA_CHECK(cudaStreamWaitEvent(stream_, static_cast<CudaEvent&>(event).handle(), 0));
  }
  void launch_host_func(std::function<void()> fn) override {
    auto* call = new HostFuncCall{std::move(fn), &error_};
    const cudaError_t result = cudaLaunchHostFunc(stream_, run_host_func, call);
    if (result != cudaSuccess) delete call;
    check_cuda(result, "cudaLaunchHostFunc");
  }
  void synchronize() override {
    STRATA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    error_.rethrow_if_set();
  }
  void* native_handle() override { return stream_; }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  ErrorSlot error_;
};

// Rounds requests up so freed blocks can be reused by similar sizes.
size_t round_block(size_t nbytes) {
  constexpr size_t kSmall = 1 << 20;
  if (nbytes <= kSmall) return (std::max<size_t>(nbytes, 1) + 511) / 512 * 512;
  return (nbytes + kSmall - 1) / kSmall * kSmall;
}

class CudaAccelerator final : public Accelerator {
 public:
  CudaAccelerator(int device, const AcceleratorOptions& options) : device_(device) {
    int count = 0;
    STRATA_CUDA_CHECK(cudaGetDeviceCount(&count));
    STRATA_CHECK(device >= 0 && device < count, kCuda, "cuda:{} requested but {} device(s) present",
                 device, count);
    DeviceGuard guard(device_);
    cudaDeviceProp prop{};
    STRATA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    device_name_ = prop.name;
    size_t free_nbytes = 0, total_nbytes = 0;
    STRATA_CUDA_CHECK(cudaMemGetInfo(&free_nbytes, &total_nbytes));
    capacity_ = options.memory_budget_nbytes ? options.memory_budget_nbytes : free_nbytes;
  }

  ~CudaAccelerator() override {
    DeviceGuard guard(device_);
    for (auto& [nbytes, ptr] : free_blocks_) cudaFree(ptr);
    for (auto& [ptr, nbytes] : live_blocks_) cudaFree(ptr);
    for (auto& [ptr, nbytes] : pinned_) cudaFreeHost(ptr);
  }

  Backend backend() const override { return Backend::kCuda; }
  std::string name() const override { return fmt::format("cuda:{} ({})", device_, device_name_); }

  void* allocate(size_t nbytes) override {
    const size_t block = round_block(nbytes);
    std::lock_guard<std::mutex> lock(mutex_);
    if (block > capacity_ - in_use_) {
      raise(ErrorCategory::kOutOfMemory,
            "{} device memory: requested {} bytes, {} in use, capacity {} ({} free)", name(), nbytes,
            in_use_, capacity_, capacity_ - in_use_);
    }
    void* ptr = take_cached(block);
    if (ptr == nullptr) ptr = cuda_malloc(block, nbytes);
    live_blocks_.emplace(ptr, block);
    in_use_ += block;
    peak_ = std::max(peak_, in_use_);
    return ptr;
  }

  void deallocate(void* ptr) override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_blocks_.find(ptr);
    STRATA_CHECK(it != live_blocks_.end(), kInternal, "cuda deallocate of unknown pointer {}", ptr);
    // Cached blocks may still be read by queued kernels; reuse is safe because
    // every stream that later gets this block orders after the freeing stream
    // by the caller's events (the same contract as PyTorch's caching allocator).
    free_blocks_.emplace(it->second, ptr);
    cached_ += it->second;
    in_use_ -= it->second;
    live_blocks_.erase(it);
  }

  MemoryStats memory_stats() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return MemoryStats{capacity_, in_use_, peak_, cached_};
  }

  void* allocate_pinned(size_t nbytes) override {
    DeviceGuard guard(device_);
    void* ptr = nullptr;
    const cudaError_t result = cudaHostAlloc(&ptr, std::max<size_t>(nbytes, 1), cudaHostAllocPortable);
    if (result != cudaSuccess) {
      raise(ErrorCategory::kOutOfMemory, "cudaHostAlloc of {} pinned bytes: {}", nbytes,
            cudaGetErrorString(result));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    pinned_.emplace(ptr, nbytes);
    return ptr;
  }

  void deallocate_pinned(void* ptr) override {
    if (ptr == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      STRATA_CHECK(pinned_.erase(ptr) == 1, kInternal, "deallocate_pinned of unknown pointer {}", ptr);
    }
    STRATA_CUDA_CHECK(cudaFreeHost(ptr));
  }

  std::unique_ptr<Stream> create_stream() override { return std::make_unique<CudaStream>(device_); }
  std::unique_ptr<Event> create_event() override { return std::make_unique<CudaEvent>(device_); }

  void copy_async(void* dst, const void* src, size_t nbytes, CopyKind kind, Stream& stream) override {
    static constexpr cudaMemcpyKind kKinds[] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                                                cudaMemcpyDeviceToDevice, cudaMemcpyHostToHost};
    STRATA_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, kKinds[static_cast<int>(kind)],
                                      static_cast<cudaStream_t>(stream.native_handle())));
  }

  void memset_async(void* dst, int value, size_t nbytes, Stream& stream) override {
    STRATA_CUDA_CHECK(
        cudaMemsetAsync(dst, value, nbytes, static_cast<cudaStream_t>(stream.native_handle())));
  }

 private:
  void* take_cached(size_t block) {
    auto it = free_blocks_.lower_bound(block);
    // Reuse only blocks of the same size class: avoids holding a huge block for a tiny request.
    if (it == free_blocks_.end() || it->first != block) return nullptr;
    void* ptr = it->second;
    cached_ -= it->first;
    free_blocks_.erase(it);
    return ptr;
  }

  void* cuda_malloc(size_t block, size_t requested) {
    DeviceGuard guard(device_);
    void* ptr = nullptr;
    cudaError_t result = cudaMalloc(&ptr, block);
    if (result == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear the sticky allocation error, release the cache, retry once
      STRATA_CUDA_CHECK(cudaDeviceSynchronize());
      for (auto& [nbytes, cached] : free_blocks_) cudaFree(cached);
      free_blocks_.clear();
      cached_ = 0;
      result = cudaMalloc(&ptr, block);
    }
    if (result != cudaSuccess) {
      cudaGetLastError();
      raise(ErrorCategory::kOutOfMemory, "{}: cudaMalloc of {} bytes (requested {}) failed: {}",
            name(), block, requested, cudaGetErrorString(result));
    }
    return ptr;
  }

  const int device_;
  std::string device_name_;
  mutable std::mutex mutex_;
  size_t capacity_ = 0;
  size_t in_use_ = 0;
  size_t peak_ = 0;
  size_t cached_ = 0;
  std::multimap<size_t, void*> free_blocks_;
  std::unordered_map<void*, size_t> live_blocks_;
  std::unordered_map<void*, size_t> pinned_;
};

}  // namespace

bool cuda_built() { return true; }

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

CudaInfo cuda_info() {
  CudaInfo info;
  info.built = true;
  cudaDriverGetVersion(&info.driver_version);
  cudaRuntimeGetVersion(&info.runtime_version);
  ncclGetVersion(&info.nccl_version);
  int cublas_version = 0;
  cublasHandle_t handle = nullptr;
  int count = 0;
  const cudaError_t result = cudaGetDeviceCount(&count);
  if (result != cudaSuccess) {
    info.error = cudaGetErrorString(result);
    cudaGetLastError();
    return info;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    CudaDeviceInfo device;
    device.index = i;
    device.name = prop.name;
    device.compute_major = prop.major;
    device.compute_minor = prop.minor;
    device.total_nbytes = prop.totalGlobalMem;
    char bus[32] = {};
    cudaDeviceGetPCIBusId(bus, sizeof(bus), i);
    device.pci_bus_id = bus;
    cudaSetDevice(i);
    size_t free_nbytes = 0, total = 0;
    if (cudaMemGetInfo(&free_nbytes, &total) == cudaSuccess) device.free_nbytes = free_nbytes;
    info.devices.push_back(device);
  }
  if (count > 0 && cublasCreate(&handle) == CUBLAS_STATUS_SUCCESS) {
    cublasGetVersion(handle, &cublas_version);
    cublasDestroy(handle);
  }
  info.cublas_version = cublas_version;
  return info;
}

std::unique_ptr<Accelerator> make_cuda_accelerator(int device_index,
                                                   const AcceleratorOptions& options) {
  return std::make_unique<CudaAccelerator>(device_index, options);
}

}  // namespace strata
