// Deferred weight gradients (Zero Bubble's W).
#include "runtime/pipeline/deferred_weights.h"

#include <algorithm>

#include "core/error.h"

namespace strata::pipeline {

DeferredWeightGrads::~DeferredWeightGrads() {
  if (held_.empty()) return;
  // An abandoned step: the copies go once the compute stream is past them.
  auto done = engine_.accelerator().create_event();
  engine_.compute_stream().record(*done);
  for (Held& h : held_) engine_.accelerator().deallocate_after(h.memory, *done);
}

void DeferredWeightGrads::defer(const ops::MatView& dy, const ops::MatView& x,
                                engine::Engine::WeightGradFn weight_grads) {
  STRATA_CHECK(dy.ld == dy.cols && x.ld == x.cols && dy.rows == x.rows, kInternal,
               "deferred weight gradient: dy [{} x {}, ld {}] and x [{} x {}, ld {}] must be whole matrices of equal "
               "rows",
               dy.rows, dy.cols, dy.ld, x.rows, x.cols, x.ld);
  Accelerator& accelerator = engine_.accelerator();
  const size_t dy_nbytes = static_cast<size_t>(dy.rows * dy.cols) * dtype_nbytes(dy.dtype);
  const size_t x_offset = (dy_nbytes + 255) / 256 * 256;
  // x read in place when it lies wholly in the kept memory.
  const size_t x_whole = static_cast<size_t>(x.rows * x.cols) * dtype_nbytes(x.dtype);
  const auto* x_begin = static_cast<const std::byte*>(x.data);
  const bool in_place = !kept_.empty() && x_begin >= kept_.data() && x_begin + x_whole <= kept_.data() + kept_.size();
  const size_t x_nbytes = in_place ? 0 : x_whole;
  Held h;
  h.nbytes = x_offset + x_nbytes;
  h.memory = accelerator.allocate(h.nbytes);
  Stream& stream = engine_.compute_stream();
  accelerator.copy_async(h.memory, dy.data, dy_nbytes, CopyKind::kDeviceToDevice, stream);
  h.dy = ops::MatView{h.memory, dy.dtype, dy.rows, dy.cols, dy.cols};
  h.x = x;
  ++(in_place ? in_place_ : copied_);
  if (!in_place) {
    void* x_copy = static_cast<char*>(h.memory) + x_offset;
    accelerator.copy_async(x_copy, x.data, x_nbytes, CopyKind::kDeviceToDevice, stream);
    h.x.data = x_copy;
  }
  h.weight_grads = std::move(weight_grads);
  nbytes_ += h.nbytes;
  peak_nbytes_ = std::max(peak_nbytes_, nbytes_);
  held_.push_back(std::move(h));
}

void DeferredWeightGrads::run() {
  std::vector<Held> held = std::move(held_);
  held_.clear();
  for (Held& h : held) h.weight_grads(h.dy, h.x);
  auto done = engine_.accelerator().create_event();
  engine_.compute_stream().record(*done);
  for (Held& h : held) engine_.accelerator().deallocate_after(h.memory, *done);
  nbytes_ = 0;
}

}  // namespace strata::pipeline
