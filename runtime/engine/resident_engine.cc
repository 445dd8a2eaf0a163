// ResidentEngine: flat parameter and gradient buffers on the accelerator.
#include "runtime/engine/resident_engine.h"

#include <algorithm>

#include "core/error.h"

namespace strata::engine {
namespace {

// Each parameter starts on a 256-byte boundary (the accelerator's allocation
// alignment), so vector loads and cuBLAS see aligned tensors.
constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

ResidentEngine::ResidentEngine(Accelerator& accelerator)
    : Engine(accelerator), backward_done_(accelerator.create_event()) {}

ResidentEngine::~ResidentEngine() {
  // Queued work may still read the flat buffers, which die before the base
  // class's destructor gets to wait for the stream.
  try {
    compute_stream().synchronize();
  } catch (...) {
    // A failed step was (or will never be) reported to the caller; the
    // buffers may go once the stream has drained, which synchronize ensured.
  }
}

void ResidentEngine::on_finalize() {
  size_t param_total = 0, grad_total = 0;
  for (ParamId id = 0; id < parameter_count(); ++id) {
    const ParamInfo& p = param_info(id);
    param_offset_.push_back(param_total);
    grad_offset_.push_back(grad_total);
    param_total += align_up(p.nbytes());
    grad_total += align_up(static_cast<size_t>(p.numel()) * sizeof(float));
  }
  // Bytes as int8-sized "fp16 pairs" would mislead; describe them as fp32 words.
  param_flat_ = accelerator().allocate_tensor(DType::kF32, {static_cast<int64_t>(param_total / 4)});
  grad_flat_ = accelerator().allocate_tensor(DType::kF32, {static_cast<int64_t>(grad_total / 4)});
  accelerator().memset_async(param_flat_.data(), 0, param_flat_.nbytes(), compute_stream());
  accelerator().memset_async(grad_flat_.data(), 0, grad_flat_.nbytes(), compute_stream());
  compute_stream().synchronize();
}

void ResidentEngine::pre_op(OpId op, Phase phase) {
  open_window(op, phase);
  if (observer_) observer_(op, phase, true);
}

void ResidentEngine::post_op(OpId op, Phase phase) {
  close_window(op, phase);
  if (observer_) observer_(op, phase, false);
  if (phase == Phase::kBackward) {
    compute_stream().record(*backward_done_);
    note_backward_done(op, *backward_done_);
  }
}

TensorView ResidentEngine::param_storage(ParamId id) const {
  const ParamInfo& p = param_info(id);
  STRATA_CHECK(finalized(), kBadArgument, "parameter '{}' has no storage before finalize()",
               p.name);
  return TensorView{TensorDesc{p.dtype, p.shape, Tier::kDevice},
                    static_cast<char*>(param_flat_.data()) + param_offset_[id]};
}

TensorView ResidentEngine::grad_storage(ParamId id) const {
  const ParamInfo& p = param_info(id);
  STRATA_CHECK(finalized(), kBadArgument, "gradient of '{}' has no storage before finalize()",
               p.name);
  return TensorView{TensorDesc{DType::kF32, p.shape, Tier::kDevice},
                    static_cast<char*>(grad_flat_.data()) + grad_offset_[id]};
}

TensorView ResidentEngine::param(ParamId id) {
  STRATA_CHECK(in_window(id, false), kBadArgument,
               "parameter '{}' used outside a hook window of an operator that lists it",
               param_info(id).name);
  return param_storage(id);
}

TensorView ResidentEngine::grad(ParamId id) {
  STRATA_CHECK(in_window(id, true), kBadArgument,
               "gradient of '{}' used outside a backward window of an operator that lists it",
               param_info(id).name);
  if (param_info(id).frozen) return TensorView{};  // not trained: no gradient
  return grad_storage(id);
}

void ResidentEngine::zero_grad() {
  STRATA_CHECK(finalized(), kBadArgument, "zero_grad() before finalize()");
  accelerator().memset_async(grad_flat_.data(), 0, grad_flat_.nbytes(), compute_stream());
}

void ResidentEngine::for_each_owned_range(ParamId id, Access access, const RangeFn& fn) {
  STRATA_CHECK(finalized(), kBadArgument, "for_each_owned_range before finalize()");
  const ParamInfo& p = param_info(id);
  // Host staging; the transfer is stream-ordered after earlier compute work.
  Tensor host = Tensor::host(p.dtype, p.shape);
  void* device = param_storage(id).data;
  if (access == Access::kRead) {
    accelerator().copy_async(host.data(), device, p.nbytes(), CopyKind::kDeviceToHost,
                             compute_stream());
    compute_stream().synchronize();
    fn(0, host.view());
    return;
  }
  fn(0, host.view());
  accelerator().copy_async(device, host.data(), p.nbytes(), CopyKind::kHostToDevice,
                           compute_stream());
  compute_stream().synchronize();  // `host` dies with this call
}

}  // namespace strata::engine
