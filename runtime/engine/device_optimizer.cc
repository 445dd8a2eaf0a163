#include "runtime/engine/device_optimizer.h"

#include <algorithm>
#include <cmath>

#include "runtime/core/error.h"
#include "runtime/core/trace_recorder.h"

namespace strata::engine {

DeviceOptimizer::DeviceOptimizer(Accelerator& accelerator, ops::Ops& ops, Stream& stream, size_t numel,
                                 size_t sub_group_numel, kernels::AdamConfig adam)
    : accelerator_(accelerator),
      ops_(ops),
      stream_(stream),
      ctx_(ops.make_context(stream)),
      numel_(numel),
      // As the OptimizerSwapper splits the shard, so the statistics are merged alike.
      sub_group_numel_(std::clamp<size_t>(sub_group_numel, 1, std::max<size_t>(numel, 1))),
      sub_group_count_((numel + sub_group_numel_ - 1) / sub_group_numel_),
      adam_(adam) {
  STRATA_CHECK(numel > 0, kBadArgument, "device optimizer: shard numel must be > 0");
  adam_.validate();
  const size_t nbytes = std::max<size_t>(numel_, 1) * sizeof(float);
  try {
    master_ = static_cast<float*>(accelerator_.allocate(nbytes));
    exp_avg_ = static_cast<float*>(accelerator_.allocate(nbytes));
    exp_avg_sq_ = static_cast<float*>(accelerator_.allocate(nbytes));
    sums_ = static_cast<double*>(accelerator_.allocate(std::max<size_t>(sub_group_count_, 1) * sizeof(double)));
  } catch (...) {
    for (void* p : {static_cast<void*>(master_), static_cast<void*>(exp_avg_), static_cast<void*>(exp_avg_sq_)}) {
      if (p != nullptr) accelerator_.deallocate(p);
    }
    throw;
  }
}

DeviceOptimizer::~DeviceOptimizer() {
  try {
    stream_.synchronize();  // queued updates write the state freed below
  } catch (...) {
    // Reported on the caller's path (or never to be); the memory may go now.
  }
  for (void* p : {static_cast<void*>(master_), static_cast<void*>(exp_avg_), static_cast<void*>(exp_avg_sq_),
                  static_cast<void*>(sums_)}) {
    accelerator_.deallocate(p);
  }
}

std::pair<size_t, size_t> DeviceOptimizer::sub_group_range(size_t k) const {
  STRATA_CHECK(k < sub_group_count_, kBadArgument, "sub-group {} of {}", k, sub_group_count_);
  const size_t first = k * sub_group_numel_;
  return {first, std::min(sub_group_numel_, numel_ - first)};
}

void DeviceOptimizer::set_lr(float lr) {
  kernels::AdamConfig adam = adam_;
  adam.lr = lr;
  adam.validate();
  adam_ = adam;
}

void DeviceOptimizer::check_range(size_t first, size_t count) const {
  STRATA_CHECK(first <= numel_ && count <= numel_ - first, kBadArgument,
               "optimizer state range [{}, {}) outside the shard ({} elements)", first, first + count, numel_);
}

TensorView DeviceOptimizer::view(float* base, size_t first, size_t count) const {
  return TensorView{TensorDesc{DType::kF32, {static_cast<int64_t>(count)}, Tier::kDevice}, base + first};
}

void DeviceOptimizer::initialize(const void* params, DType dtype) {
  if (numel_ > 0) {
    const TensorView source{TensorDesc{dtype, {static_cast<int64_t>(numel_)}, Tier::kDevice},
                            const_cast<void*>(params)};
    ops_.cast(*ctx_, source, view(master_, 0, numel_));
    accelerator_.memset_async(exp_avg_, 0, numel_ * sizeof(float), stream_);
    accelerator_.memset_async(exp_avg_sq_, 0, numel_ * sizeof(float), stream_);
  }
  stream_.synchronize();
  step_count_ = 0;
}

std::vector<kernels::GradStats> DeviceOptimizer::grad_stats(const float* grad) {
  trace::Span span("optimizer", "gradient statistics on the accelerator");
  span.bytes(numel_ * sizeof(float)).value("sub_groups", static_cast<int64_t>(sub_group_count_));
  std::vector<double> sums(sub_group_count_, 0.0);
  for (size_t k = 0; k < sub_group_count_; ++k) {
    const auto [first, count] = sub_group_range(k);
    ops_.grad_sum_sq(*ctx_, view(const_cast<float*>(grad), first, count), 1.0f, TensorView{TensorDesc{DType::kF64, {1}, Tier::kDevice}, sums_ + k});
  }
  if (!sums.empty()) {
    accelerator_.copy_async(sums.data(), sums_, sums.size() * sizeof(double), CopyKind::kDeviceToHost, stream_);
  }
  stream_.synchronize();
  std::vector<kernels::GradStats> stats(sub_group_count_);
  for (size_t k = 0; k < sub_group_count_; ++k) stats[k] = kernels::GradStats{sums[k], std::isfinite(sums[k])};
  return stats;
}

void DeviceOptimizer::step(const float* grad, float grad_scale, void* params, DType dtype) {
  // On the timeline: the whole update, as the host waits for it.
  trace::Span span("optimizer", "adam on the accelerator");
  span.bytes(numel_ * (7 * sizeof(float) + dtype_nbytes(dtype))).value("numel", static_cast<int64_t>(numel_));
  const kernels::AdamCoefficients coeffs = kernels::adam_coefficients(adam_, step_count_ + 1, grad_scale);
  if (numel_ > 0) {
    const TensorView copy{TensorDesc{dtype, {static_cast<int64_t>(numel_)}, Tier::kDevice}, params};
    ops_.adam_step(*ctx_, coeffs, view(master_, 0, numel_), view(exp_avg_, 0, numel_), view(exp_avg_sq_, 0, numel_),
                   view(const_cast<float*>(grad), 0, numel_), copy);
  }
  stream_.synchronize();
  ++step_count_;
}

void DeviceOptimizer::read_state(size_t first, size_t count, float* master, float* exp_avg, float* exp_avg_sq) {
  check_range(first, count);
  const size_t nbytes = count * sizeof(float);
  accelerator_.copy_async(master, master_ + first, nbytes, CopyKind::kDeviceToHost, stream_);
  accelerator_.copy_async(exp_avg, exp_avg_ + first, nbytes, CopyKind::kDeviceToHost, stream_);
  accelerator_.copy_async(exp_avg_sq, exp_avg_sq_ + first, nbytes, CopyKind::kDeviceToHost, stream_);
  stream_.synchronize();
}

void DeviceOptimizer::write_state(size_t first, size_t count, const float* master, const float* exp_avg,
                                  const float* exp_avg_sq) {
  check_range(first, count);
  const size_t nbytes = count * sizeof(float);
  accelerator_.copy_async(master_ + first, master, nbytes, CopyKind::kHostToDevice, stream_);
  accelerator_.copy_async(exp_avg_ + first, exp_avg, nbytes, CopyKind::kHostToDevice, stream_);
  accelerator_.copy_async(exp_avg_sq_ + first, exp_avg_sq, nbytes, CopyKind::kHostToDevice, stream_);
  stream_.synchronize();
}

void DeviceOptimizer::set_step_count(int64_t step_count) {
  STRATA_CHECK(step_count >= 0, kBadArgument, "step count {} < 0", step_count);
  step_count_ = step_count;
}

}  // namespace strata::engine
