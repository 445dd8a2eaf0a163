// measure_bf16_gemm_tflops (kernels/cuda_peak.h): times a cuBLAS bf16 GEMM
// on its own stream with CUDA timing events. A benchmark, so unlike the Ops
// it synchronises.
#include "kernels/cuda_peak.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/device_guard.h"

namespace strata::ops {
namespace {

// Frees accelerator memory, cuBLAS and CUDA objects on every exit path (the
// stream is synchronised before anything is freed).
struct Resources {
  Accelerator* accelerator = nullptr;
  Stream* stream = nullptr;
  std::vector<void*> blocks;
  cublasHandle_t handle = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;

  ~Resources() {
    if (stream != nullptr)
      cudaStreamSynchronize(static_cast<cudaStream_t>(stream->native_handle()));
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
    if (handle != nullptr) cublasDestroy(handle);
    for (void* p : blocks) accelerator->deallocate(p);
  }
  void* allocate(size_t nbytes) {
    blocks.push_back(accelerator->allocate(nbytes));
    return blocks.back();
  }
};

// Fills `numel` bf16 elements of device memory with values uniform in
// [-1, 1) from a fixed seed (made on the host, copied once: outside the timing).
void fill_random_bf16(void* device, size_t numel, uint64_t seed, cudaStream_t stream) {
  std::vector<uint16_t> host(numel);
  uint64_t state = 0x9e3779b97f4a7c15ULL * (seed + 1);
  for (uint16_t& value : host) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    const float uniform = static_cast<float>(state >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
    uint32_t bits = 0;
    std::memcpy(&bits, &uniform, sizeof(bits));
    value = static_cast<uint16_t>(bits >> 16);  // truncation: still uniform enough, and finite
  }
  STRATA_CUDA_CHECK(cudaMemcpyAsync(device, host.data(), numel * sizeof(uint16_t), cudaMemcpyHostToDevice, stream));
  STRATA_CUDA_CHECK(cudaStreamSynchronize(stream));  // before `host` goes
}

}  // namespace

double measure_bf16_gemm_tflops(Accelerator& accelerator, int64_t m, int64_t n, int64_t k,
                                int iters) {
  STRATA_CHECK(accelerator.backend() == Backend::kCuda, kCuda,
               "measure_bf16_gemm_tflops needs a cuda accelerator, got {}", accelerator.name());
  STRATA_CHECK(m > 0 && n > 0 && k > 0 && iters > 0 && m <= INT_MAX && n <= INT_MAX && k <= INT_MAX,
               kBadArgument, "measure_bf16_gemm_tflops: bad sizes m={} n={} k={} iters={}", m, n, k,
               iters);
  std::unique_ptr<Stream> owned_stream = accelerator.create_stream();
  const auto stream = static_cast<cudaStream_t>(owned_stream->native_handle());
  int device = 0;
  STRATA_CUDA_CHECK(cudaStreamGetDevice(stream, &device));
  DeviceGuard guard(device, DeviceGuard::Bind::kAlways);

  Resources r;
  r.accelerator = &accelerator;
  r.stream = owned_stream.get();
  const size_t a_bytes = static_cast<size_t>(m * k) * 2, b_bytes = static_cast<size_t>(k * n) * 2;
  const size_t c_bytes = static_cast<size_t>(m * n) * 2;
  void* a = r.allocate(a_bytes);
  void* b = r.allocate(b_bytes);
  void* c = r.allocate(c_bytes);
  constexpr size_t kWorkspace = size_t{32} << 20;
  void* workspace = r.allocate(kWorkspace);
  // Random operands: a GEMM on constant data (it was a memset of 0x3c) toggles
  // fewer bits and draws less power, so it can hold higher clocks and
  // overstate the peak, which understates MFU (an H200 here ran a bf16 GEMM
  // 13% faster on zeros than on random data). Uniform in [-1, 1): finite
  // products, no overflow in the fp32 accumulation.
  fill_random_bf16(a, static_cast<size_t>(m * k), 1, stream);
  fill_random_bf16(b, static_cast<size_t>(k * n), 2, stream);
  STRATA_CUBLAS_CHECK(cublasCreate(&r.handle));
  STRATA_CUBLAS_CHECK(cublasSetStream(r.handle, stream));
  STRATA_CUBLAS_CHECK(cublasSetWorkspace(r.handle, workspace, kWorkspace));
  STRATA_CUDA_CHECK(cudaEventCreate(&r.start));
  STRATA_CUDA_CHECK(cudaEventCreate(&r.stop));

  // Row-major C = A B is column-major C^T = B^T A^T.
  const float alpha = 1.0f, beta = 0.0f;
  auto run_once = [&] {
    STRATA_CUBLAS_CHECK(cublasGemmEx(r.handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n),
                                     static_cast<int>(m), static_cast<int>(k), &alpha, b,
                                     CUDA_R_16BF, static_cast<int>(n), a, CUDA_R_16BF,
                                     static_cast<int>(k), &beta, c, CUDA_R_16BF,
                                     static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  run_once();
  run_once();
  std::vector<float> ms(static_cast<size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    STRATA_CUDA_CHECK(cudaEventRecord(r.start, stream));
    run_once();
    STRATA_CUDA_CHECK(cudaEventRecord(r.stop, stream));
    STRATA_CUDA_CHECK(cudaEventSynchronize(r.stop));
    STRATA_CUDA_CHECK(cudaEventElapsedTime(&ms[static_cast<size_t>(i)], r.start, r.stop));
  }
  std::sort(ms.begin(), ms.end());
  const double median_ms = ms[ms.size() / 2];
  const double flops =
      2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  return flops / (median_ms * 1e-3) / 1e12;
}

}  // namespace strata::ops
