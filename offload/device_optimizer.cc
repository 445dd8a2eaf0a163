#include "offload/device_optimizer.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/trace_recorder.h"

namespace strata::offload {

namespace {

// Elements [first, first + count) of a 1-D tensor, as a 1-D view.
TensorView range(const Tensor& t, size_t first, size_t count) {
  const size_t element_nbytes = dtype_nbytes(t.view().desc.dtype);
  return TensorView{TensorDesc{t.view().desc.dtype, {static_cast<int64_t>(count)}, Tier::kDevice},
                    static_cast<char*>(t.data()) + first * element_nbytes};
}

// numel elements of `dtype` at `data` (accelerator memory) as a 1-D view.
TensorView flat(const void* data, DType dtype, size_t numel) {
  return TensorView{TensorDesc{dtype, {static_cast<int64_t>(numel)}, Tier::kDevice}, const_cast<void*>(data)};
}

}  // namespace

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
  const Shape shape{static_cast<int64_t>(numel_)};
  master_ = accelerator_.allocate_tensor(DType::kF32, shape);
  exp_avg_ = accelerator_.allocate_tensor(DType::kF32, shape);
  exp_avg_sq_ = accelerator_.allocate_tensor(DType::kF32, shape);
  sums_ = accelerator_.allocate_tensor(DType::kF64, {static_cast<int64_t>(sub_group_count_)});
}

DeviceOptimizer::~DeviceOptimizer() {
  try {
    stream_.synchronize();  // queued updates write the state freed with the members
  } catch (...) {
    // Reported on the caller's path (or never to be); the memory may go now.
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

void DeviceOptimizer::initialize(const void* params, DType dtype) {
  ops_.cast(*ctx_, flat(params, dtype, numel_), master_.view());
  accelerator_.memset_async(exp_avg_.data(), 0, exp_avg_.nbytes(), stream_);
  accelerator_.memset_async(exp_avg_sq_.data(), 0, exp_avg_sq_.nbytes(), stream_);
  stream_.synchronize();
  step_count_ = 0;
}

std::vector<kernels::GradStats> DeviceOptimizer::grad_stats(const float* grad) {
  trace::Span span("optimizer", "gradient statistics on the accelerator");
  span.bytes(numel_ * sizeof(float)).value("sub_groups", static_cast<int64_t>(sub_group_count_));
  std::vector<double> sums(sub_group_count_, 0.0);
  for (size_t k = 0; k < sub_group_count_; ++k) {
    const auto [first, count] = sub_group_range(k);
    ops_.grad_sum_sq(*ctx_, flat(grad + first, DType::kF32, count), 1.0f, range(sums_, k, 1));
  }
  accelerator_.copy_async(sums.data(), sums_.data(), sums_.nbytes(), CopyKind::kDeviceToHost, stream_);
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
  ops_.adam_step(*ctx_, coeffs, master_.view(), exp_avg_.view(), exp_avg_sq_.view(), flat(grad, DType::kF32, numel_),
                 flat(params, dtype, numel_));
  stream_.synchronize();
  ++step_count_;
}

void DeviceOptimizer::save(const StateSinkFn& sink) {
  std::vector<float> master, exp_avg, exp_avg_sq;
  for (size_t first = 0; first < numel_; first += kStateChunkNumel) {
    const size_t count = std::min(kStateChunkNumel, numel_ - first);
    const size_t nbytes = count * sizeof(float);
    master.resize(count), exp_avg.resize(count), exp_avg_sq.resize(count);
    accelerator_.copy_async(master.data(), range(master_, first, count).data, nbytes, CopyKind::kDeviceToHost,
                            stream_);
    accelerator_.copy_async(exp_avg.data(), range(exp_avg_, first, count).data, nbytes, CopyKind::kDeviceToHost,
                            stream_);
    accelerator_.copy_async(exp_avg_sq.data(), range(exp_avg_sq_, first, count).data, nbytes,
                            CopyKind::kDeviceToHost, stream_);
    stream_.synchronize();
    sink(first, count, master.data(), exp_avg.data(), exp_avg_sq.data());
  }
}

void DeviceOptimizer::restore(const StateFillFn& fill, int64_t step_count) {
  STRATA_CHECK(step_count >= 0, kBadArgument, "step count {} < 0", step_count);
  std::vector<float> master, exp_avg, exp_avg_sq;
  for (size_t first = 0; first < numel_; first += kStateChunkNumel) {
    const size_t count = std::min(kStateChunkNumel, numel_ - first);
    const size_t nbytes = count * sizeof(float);
    master.resize(count), exp_avg.resize(count), exp_avg_sq.resize(count);
    fill(first, count, master.data(), exp_avg.data(), exp_avg_sq.data());
    accelerator_.copy_async(range(master_, first, count).data, master.data(), nbytes, CopyKind::kHostToDevice,
                            stream_);
    accelerator_.copy_async(range(exp_avg_, first, count).data, exp_avg.data(), nbytes, CopyKind::kHostToDevice,
                            stream_);
    accelerator_.copy_async(range(exp_avg_sq_, first, count).data, exp_avg_sq.data(), nbytes,
                            CopyKind::kHostToDevice, stream_);
    stream_.synchronize();  // before the host buffers take the next chunk
  }
  step_count_ = step_count;
}

}  // namespace strata::offload
