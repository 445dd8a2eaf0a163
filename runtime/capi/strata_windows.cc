// The C API's hook windows (strata.h): strata_fetch / strata_release and
// their *_on_stream forms, the pointers a window hands out, and gradients
// added into it (from the host, or in accelerator memory with a cast). A
// window's memory is the engine's; the caller's work on it is ordered either
// by the host (no stream: strata_fetch waits, the caller has finished before
// strata_release) or by events on the caller's stream (cuda), which strata
// borrows for the call (Accelerator::borrow_stream) and never keeps.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "core/accelerator.h"
#include "core/dtype.h"
#include "core/trace_recorder.h"
#include "runtime/capi/capi_internal.h"
#include "runtime/capi/strata.h"

namespace strata::capi {
namespace {

// Whether an open window (a backward one when `backward`) lists `id`.
bool in_window(const strata_engine* e, int32_t id, bool backward) {
  for (const auto& w : e->windows) {
    if (backward && w.phase != STRATA_PHASE_BACKWARD) continue;
    const auto& listed = e->ops[static_cast<size_t>(w.op)];
    if (std::find(listed.begin(), listed.end(), id) != listed.end()) return true;
  }
  return false;
}

void require_window_args(strata_engine* e, int32_t op, strata_phase phase, void* stream) {
  require_engine(e);
  require_op(e, op);
  require(valid_phase(phase), STRATA_ERROR_INVALID_ARGUMENT, "phase {} is not a strata_phase",
          static_cast<int>(phase));
  require(stream == nullptr || !e->accelerator->host_addressable(), STRATA_ERROR_INVALID_ARGUMENT,
          "a stream was given, but the {} accelerator has no streams of the caller's to order by (pass NULL)",
          e->accelerator->name());
  require_finalized(e);
}

// The caller's stream, borrowed for this call (null: the host orders).
std::unique_ptr<Stream> borrow(strata_engine* e, void* stream) {
  return stream == nullptr ? nullptr : e->accelerator->borrow_stream(stream);
}

// Work enqueued on `to` from now on runs after the work enqueued on `from` so far.
void order_after(strata_engine* e, Stream& from, Stream& to) {
  std::unique_ptr<Event> point = e->accelerator->create_event();
  from.record(*point);
  to.wait(*point);
}

void fetch(strata_engine* e, int32_t op, strata_phase phase, void* stream) {
  require_window_args(e, op, phase, stream);
  for (const auto& w : e->windows) {
    require(w.op != op, STRATA_ERROR_INVALID_STATE, "operator '{}' is already fetched ({})",
            e->zero->op_info(op).name, phase_name(w.phase));
  }
  require(!e->norm_taken, STRATA_ERROR_INVALID_STATE,
          "operator '{}' fetched between strata_clip_grad_norm and strata_step: the gradients are final there "
          "(strata_step or strata_zero_grad first)",
          e->zero->op_info(op).name);
  require(!(e->zero->evaluating() && phase != STRATA_PHASE_FORWARD), STRATA_ERROR_INVALID_STATE,
          "operator '{}' fetched for {} during an evaluation (strata_begin_evaluation): forward windows only; "
          "strata_end_evaluation first",
          e->zero->op_info(op).name, phase_name(phase));
  std::unique_ptr<Stream> caller = borrow(e, stream);
  e->windows.push_back({op, phase});
  trace::Span span("capi", "strata_fetch");
  if (span.recording()) span.detail("op", e->zero->op_info(op).name).value("phase", phase);
  e->zero->pre_op(op, phase_of(phase));
  // The caller's code runs on the host or on its own stream, not strata's:
  // the values must be in place for it (the host waits, or its stream does).
  if (caller) {
    order_after(e, e->zero->compute_stream(), *caller);
  } else {
    e->zero->compute_stream().synchronize();
  }
}

void release(strata_engine* e, int32_t op, strata_phase phase, void* stream) {
  require_window_args(e, op, phase, stream);
  require(!e->windows.empty(), STRATA_ERROR_INVALID_STATE, "operator '{}' ({}) is not fetched; no window is open",
          e->zero->op_info(op).name, phase_name(phase));
  const auto open = std::find_if(e->windows.begin(), e->windows.end(), [&](const strata_engine::Window& w) {
    return w.op == op && w.phase == phase;
  });
  require(open != e->windows.end(), STRATA_ERROR_INVALID_STATE,
          "releasing operator '{}' ({}), which is not open (open: {})", e->zero->op_info(op).name, phase_name(phase),
          [&] {
            std::string list;
            for (const auto& w : e->windows) {
              list += fmt::format("{}'{}' ({})", list.empty() ? "" : ", ", e->zero->op_info(w.op).name,
                                  phase_name(w.phase));
            }
            return list;
          }());
  std::unique_ptr<Stream> caller = borrow(e, stream);
  e->windows.erase(open);
  trace::Span span("capi", "strata_release");
  if (span.recording()) span.detail("op", e->zero->op_info(op).name).value("phase", phase);
  // The window's memory is freed, and its gradients reduced, after the caller's work on it.
  if (caller) order_after(e, *caller, e->zero->compute_stream());
  e->zero->post_op(op, phase_of(phase));
  if (phase == STRATA_PHASE_BACKWARD) {
    for (int32_t p : e->ops[static_cast<size_t>(op)]) {
      if (e->zero->param_info(p).frozen) continue;  // no gradient: a pass never waits for its uses
      int32_t& seen = e->backward_seen[static_cast<size_t>(p)];
      if (++seen == e->zero->uses_of(p)) seen = 0;
    }
  }
}

void require_grad(strata_engine* e, int32_t id) {
  require_param(e, id);
  require_finalized(e);
  require(in_window(e, id, true), STRATA_ERROR_INVALID_STATE,
          "the gradient of '{}' is not available: no operator fetched for backward lists it",
          e->zero->param_info(id).name);
  require(!e->zero->param_info(id).frozen, STRATA_ERROR_INVALID_STATE,
          "'{}' is frozen (strata_freeze_param): it has no gradient", e->zero->param_info(id).name);
}

// Parameter id's fp32 gradient buffer in an open backward window (a first
// use zero-fills it on the compute stream: not waited for here).
TensorView grad_view(strata_engine* e, int32_t id) {
  require_grad(e, id);
  return e->zero->grad(id);
}

// The same buffer for this thread to add into now (host memory: the cpu
// accelerator), with no hand-off to the compute stream's thread when it has
// nothing queued (ZeroEngine::host_grad).
float* host_grad(strata_engine* e, int32_t id) {
  require_grad(e, id);
  return e->zero->host_grad(id).as<float>();
}

// sum[i] += src[i] for n values of `dtype` in host memory, 16-bit ones widened
// exactly first (strata::convert), so the fp32 sums are those of an fp32 add.
void add_on_host(float* sum, const void* src, strata::DType dtype, size_t n) {
  if (dtype == strata::DType::kF32) {
    const float* values = static_cast<const float*>(src);
    for (size_t i = 0; i < n; ++i) sum[i] += values[i];
    return;
  }
  constexpr size_t kChunk = 4096;
  float wide[kChunk];
  const auto* bytes = static_cast<const char*>(src);
  for (size_t first = 0; first < n; first += kChunk) {
    const size_t count = std::min(kChunk, n - first);
    strata::convert(bytes + first * strata::dtype_nbytes(dtype), dtype, wide, strata::DType::kF32, count);
    for (size_t i = 0; i < count; ++i) sum[first + i] += wide[i];
  }
}

}  // namespace
}  // namespace strata::capi

using namespace strata::capi;

extern "C" {

strata_status strata_fetch(strata_engine* e, int32_t op, strata_phase phase) {
  return guarded("strata_fetch", e, /*poison=*/true, [&] { fetch(e, op, phase, nullptr); });
}

strata_status strata_fetch_on_stream(strata_engine* e, int32_t op, strata_phase phase, void* stream) {
  return guarded("strata_fetch_on_stream", e, /*poison=*/true, [&] { fetch(e, op, phase, stream); });
}

strata_status strata_release(strata_engine* e, int32_t op, strata_phase phase) {
  return guarded("strata_release", e, /*poison=*/true, [&] { release(e, op, phase, nullptr); });
}

strata_status strata_release_on_stream(strata_engine* e, int32_t op, strata_phase phase, void* stream) {
  return guarded("strata_release_on_stream", e, /*poison=*/true, [&] { release(e, op, phase, stream); });
}

strata_status strata_param_ptr(strata_engine* e, int32_t id, void** ptr) {
  return guarded("strata_param_ptr", e, /*poison=*/true, [&] {
    require_engine(e);
    require_not_null(ptr, "ptr");
    require_param(e, id);
    require_finalized(e);
    require(in_window(e, id, false), STRATA_ERROR_INVALID_STATE,
            "parameter '{}' is not available: no fetched operator lists it", e->zero->param_info(id).name);
    *ptr = e->zero->param(id).data;
  });
}

strata_status strata_grad_ptr(strata_engine* e, int32_t id, float** ptr) {
  return guarded("strata_grad_ptr", e, /*poison=*/true, [&] {
    require_engine(e);
    require_not_null(ptr, "ptr");
    if (e->accelerator->host_addressable()) {
      *ptr = host_grad(e, id);  // zeroed by this thread when new: no round trip through the compute stream
      return;
    }
    float* grad = grad_view(e, id).as<float>();
    e->zero->compute_stream().synchronize();  // the caller writes it from elsewhere
    *ptr = grad;
  });
}

strata_status strata_add_grad(strata_engine* e, int32_t id, const float* host_grad) {
  return guarded("strata_add_grad", e, /*poison=*/true, [&] {
    require_engine(e);
    require_not_null(host_grad, "host_grad");
    const size_t numel = static_cast<size_t>(e->zero->param_info(id).numel());
    if (e->accelerator->host_addressable()) {
      add_on_host(strata::capi::host_grad(e, id), host_grad, strata::DType::kF32, numel);
      return;
    }
    float* grad = grad_view(e, id).as<float>();
    strata::Stream& stream = e->zero->compute_stream();
    stream.synchronize();
    std::vector<float> sum(numel);
    e->accelerator->copy_async(sum.data(), grad, numel * sizeof(float), strata::CopyKind::kDeviceToHost, stream);
    stream.synchronize();
    for (size_t i = 0; i < numel; ++i) sum[i] += host_grad[i];
    e->accelerator->copy_async(grad, sum.data(), numel * sizeof(float), strata::CopyKind::kHostToDevice, stream);
    stream.synchronize();
  });
}

strata_status strata_add_grad_device(strata_engine* e, int32_t id, const void* grad, strata_dtype dtype,
                                     void* stream) {
  return guarded("strata_add_grad_device", e, /*poison=*/true, [&] {
    require_engine(e);
    require_not_null(grad, "grad");
    require(valid_dtype(dtype), STRATA_ERROR_INVALID_ARGUMENT,
            "dtype {} is not a strata_dtype (STRATA_DTYPE_F32 = 0, F16 = 1, BF16 = 2)", static_cast<int>(dtype));
    require(stream == nullptr || !e->accelerator->host_addressable(), STRATA_ERROR_INVALID_ARGUMENT,
            "a stream was given, but the {} accelerator has no streams of the caller's to order by (pass NULL)",
            e->accelerator->name());
    if (e->accelerator->host_addressable()) {
      // The cpu accelerator: added by this thread, in place (the gradient
      // is host memory), finished on return as the contract says, and no
      // round trip through the compute stream's thread.
      add_on_host(host_grad(e, id), grad, dtype_of(dtype),
                  static_cast<size_t>(e->zero->param_info(id).numel()));
      return;
    }
    const strata::TensorView sum = grad_view(e, id);
    std::unique_ptr<strata::Stream> caller = borrow(e, stream);
    strata::Accelerator& acc = *e->accelerator;
    strata::Stream& compute = e->zero->compute_stream();
    strata::ops::Ops& ops = e->zero->ops();
    strata::ops::ComputeContext& ctx = e->zero->compute();
    strata::TensorView src{{dtype_of(dtype), sum.desc.shape, sum.desc.tier}, const_cast<void*>(grad)};
    if (caller) order_after(e, *caller, compute);  // after the caller's writes of `grad`
    if (src.desc.dtype == strata::DType::kF32) {
      ops.add(ctx, sum, src, sum);
    } else {
      // Widened exactly into scratch, then added: fp32 sums as the caller's own adds would make them.
      strata::TensorView wide{{strata::DType::kF32, sum.desc.shape, sum.desc.tier}, acc.allocate(sum.nbytes())};
      try {
        ops.cast(ctx, src, wide);
        ops.add(ctx, sum, wide, sum);
      } catch (...) {
        compute.synchronize();
        acc.deallocate(wide.data);
        throw;
      }
      std::unique_ptr<strata::Event> done = acc.create_event();
      compute.record(*done);
      acc.deallocate_after(wide.data, *done);
    }
    if (caller) {
      order_after(e, compute, *caller);  // the caller's later work (freeing `grad`) after the add
    } else {
      compute.synchronize();
    }
  });
}

}  // extern "C"
