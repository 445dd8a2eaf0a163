// strata-adam internals: host arrays and the memory passes the rows are timed
// against or built from — the Adam-shaped triad (the kernel rows' anchor), the
// gradient landings and the separate 16-bit copy of DeepSpeed's way. Every pass
// splits its range across OpenMP threads exactly as adam_step does, so each
// thread touches the same pages as in the kernel it is compared with.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/optimizer.h"

namespace strata::bench {

// Page-aligned host array; the caller first-touches it (fill_pseudo) with the
// threads that will use it.
class HostArray {
 public:
  explicit HostArray(size_t nbytes);
  ~HostArray();
  HostArray(const HostArray&) = delete;
  HostArray& operator=(const HostArray&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t nbytes() const { return nbytes_; }

 private:
  void* ptr_ = nullptr;
  size_t nbytes_ = 0;
};

// dst[i] = pseudo(i, salt) (0 for salt 0), split like adam_step.
void fill_pseudo(float* dst, size_t numel, uint64_t salt, int threads);

// The kernel row's memory traffic with no arithmetic: reads p, m, v and the
// gradient and writes p, m, v and the 16-bit copy of `b`, in one pass, with
// the same threads and split as adam_step and the copy stored non-temporally
// exactly when the kernel stores it so. p, m and v keep their bits (each is
// OR-ed with the gradient AND-ed with a zero the compiler cannot see); the
// copy gets the top half of p. Returns seconds.
double adam_shaped_triad(const kernels::AdamBuffers& b, int threads);
// Whether the last adam_shaped_triad over b kept p, m, v and wrote the copy as
// documented, on `samples` indices.
bool adam_shaped_triad_check(const kernels::AdamBuffers& b, const size_t* samples, size_t count,
                             const float* p_before, const float* m_before, const float* v_before);

// Landing a gradient that arrives from the device (a DMA writes it on a GPU
// machine): element i gets block[i % block_numel] — a block small enough to stay
// in cache, so the pass reads no memory — stored non-temporally when dst is
// 32-byte aligned, as a DMA writes whole lines without reading them first. What
// the pass costs host memory is then what the transfer does: its writes.
// block_numel must be a multiple of 64. Returns seconds.
double land16(const uint16_t* block, size_t block_numel, uint16_t* dst16, size_t numel, int threads);
// The same landing of bf16 values into an fp32 buffer (DeepSpeed's). Returns seconds.
double land_bf16_to_f32(const uint16_t* block, size_t block_numel, float* dst32, size_t numel,
                        int threads);
// DeepSpeed's separate copy: dst16[i] = bf16 round-to-nearest-even of p[i]
// (float_to_bf16). Returns seconds.
double copy_f32_to_bf16(const float* p, uint16_t* dst16, size_t numel, int threads);

}  // namespace strata::bench
