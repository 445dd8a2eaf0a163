// The C API's internals, shared by its source files: strata.cc (engines,
// declarations, hook windows, steps, the timeline) and strata_state.cc (the
// step breakdown and checkpoints). Not part of the C API: C callers include
// strata.h only.
//
// Every entry point runs its body through guarded(), which checks arguments
// and call order first (ApiError: nothing has changed, the engine stays
// usable) and turns whatever the engine throws into a status and this
// thread's message (strata_last_error), marking the engine failed when the
// throw may have come half way through a collective or a transfer.
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "partition/communicator.h"
#include "runtime/capi/strata.h"
#include "core/accelerator.h"
#include "core/error.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/train/zero_config.h"

namespace strata::capi {

using Clock = std::chrono::steady_clock;

inline const char* phase_name(strata_phase phase) {
  switch (phase) {
    case STRATA_PHASE_FORWARD: return "forward";
    case STRATA_PHASE_BACKWARD: return "backward";
    case STRATA_PHASE_RECOMPUTE: return "recompute";
  }
  return "?";
}

inline DType dtype_of(strata_dtype dtype) {
  switch (dtype) {
    case STRATA_DTYPE_F32: return DType::kF32;
    case STRATA_DTYPE_F16: return DType::kF16;
    case STRATA_DTYPE_BF16: return DType::kBF16;
  }
  return DType::kF32;  // unreachable: checked by the caller
}

inline bool valid_dtype(int dtype) { return dtype >= STRATA_DTYPE_F32 && dtype <= STRATA_DTYPE_BF16; }
inline bool valid_phase(int phase) { return phase >= STRATA_PHASE_FORWARD && phase <= STRATA_PHASE_RECOMPUTE; }

inline engine::Phase phase_of(strata_phase phase) {
  switch (phase) {
    case STRATA_PHASE_FORWARD: return engine::Phase::kForward;
    case STRATA_PHASE_BACKWARD: return engine::Phase::kBackward;
    case STRATA_PHASE_RECOMPUTE: return engine::Phase::kRecompute;
  }
  return engine::Phase::kForward;
}

// This thread's last failure message (strata_last_error); strata.cc.
std::string& last_error_message();

// A failure found by the C layer's own checks: nothing has changed yet.
struct ApiError {
  strata_status status;
  std::string message;
};

template <typename... Args>
void require(bool ok, strata_status status, fmt::format_string<Args...> format, Args&&... args) {
  if (!ok) [[unlikely]] {
    throw ApiError{status, fmt::format(format, std::forward<Args>(args)...)};
  }
}

template <typename T>
void require_not_null(const T* p, const char* name) {
  require(p != nullptr, STRATA_ERROR_INVALID_ARGUMENT, "{} is NULL", name);
}

inline strata_status status_of(ErrorCategory category) {
  switch (category) {
    case ErrorCategory::kBadArgument: return STRATA_ERROR_INVALID_ARGUMENT;
    case ErrorCategory::kIo: return STRATA_ERROR_IO;
    case ErrorCategory::kOutOfMemory: return STRATA_ERROR_OUT_OF_MEMORY;
    case ErrorCategory::kCommunication: return STRATA_ERROR_COMMUNICATION;
    case ErrorCategory::kCuda: return STRATA_ERROR_CUDA;
    case ErrorCategory::kInternal: return STRATA_ERROR_INTERNAL;
  }
  return STRATA_ERROR_INTERNAL;
}

// An init callback's failure, raised inside for_each_owned_range.
struct CallbackError {
  std::string message;
};

}  // namespace strata::capi

struct strata_engine {
  struct Param {
    std::vector<char> initial;  // the full tensor given at registration (until finalize)
    strata_init_fn init = nullptr;
    void* user = nullptr;
  };
  struct Window {
    int32_t op;
    strata_phase phase;
  };

  // Declaration order is destruction order reversed: the engine goes first,
  // then the streams and communicators, and the accelerator they all borrow.
  // The rendezvous is the process's (shared_rendezvous), alive until exit.
  std::unique_ptr<strata::Accelerator> accelerator;
  strata::train::ZeroCommunicators comms;  // the engine's gather, reduce and control traffic
  std::unique_ptr<strata::partition::Communicator> host;
  std::unique_ptr<strata::Stream> host_stream;  // the C layer's own collectives (read_param, finalize check)
  std::unique_ptr<strata::engine::ZeroEngine> zero;

  std::vector<Param> params;
  std::vector<std::vector<int32_t>> ops;  // the parameters each operator lists
  std::vector<Window> windows;            // open, innermost last
  std::vector<int32_t> backward_seen;     // per parameter: its operators released in this backward pass
  bool finalized = false;
  bool norm_taken = false;  // strata_clip_grad_norm reached the step boundary: no window until the step
  std::string failure;  // the error that left the engine unusable; empty while usable
  int64_t steps_skipped = 0;

  // The step breakdown: the last strata_step's, and where the interval it
  // covers began (finalize, the previous step's end, or a checkpoint load).
  strata_step_breakdown last_breakdown{};
  std::vector<strata::engine::OpStall> last_op_stalls;  // most seconds first
  strata::capi::Clock::time_point interval_start{};
  uint64_t nvme_read_at_start = 0, nvme_written_at_start = 0;
  void start_interval() {
    interval_start = strata::capi::Clock::now();
    nvme_read_at_start = zero->nvme_bytes_read();
    nvme_written_at_start = zero->nvme_bytes_written();
  }
};

namespace strata::capi {

// Runs `body` for the C function `function`; converts everything it throws.
// `poison`: whether an error from the engine (not from the C layer's checks)
// leaves `e` unusable.
template <typename Body>
strata_status guarded(const char* function, strata_engine* e, bool poison, Body&& body) {
  strata_status status = STRATA_OK;
  std::string message;
  try {
    if (e != nullptr && !e->failure.empty()) {
      throw ApiError{STRATA_ERROR_ENGINE_FAILED,
                     fmt::format("the engine is unusable after an earlier error ({}); destroy it", e->failure)};
    }
    body();
    return STRATA_OK;
  } catch (const ApiError& error) {
    status = error.status;
    message = error.message;
    poison = false;  // found before anything changed
  } catch (const CallbackError& error) {
    status = STRATA_ERROR_CALLBACK;
    message = error.message;
  } catch (const strata::Error& error) {
    status = status_of(error.category());
    // The C layer checks every argument and the call order first; an engine
    // that still says "bad argument" mid-operation has changed state.
    if (poison && status == STRATA_ERROR_INVALID_ARGUMENT) status = STRATA_ERROR_INTERNAL;
    message = error.message();  // the status carries the category
  } catch (const std::bad_alloc&) {
    status = STRATA_ERROR_OUT_OF_MEMORY;
    message = "out of host memory (std::bad_alloc)";
  } catch (const std::exception& error) {
    status = STRATA_ERROR_INTERNAL;
    message = error.what();
  } catch (...) {
    status = STRATA_ERROR_INTERNAL;
    message = "unknown exception";
  }
  try {
    last_error_message() = fmt::format("{}: {}", function, message);
    if (e != nullptr && poison && e->failure.empty()) e->failure = last_error_message();
  } catch (...) {
    // Out of memory for the message itself: the status still says what happened.
  }
  return status;
}

inline void require_engine(const strata_engine* e) { require_not_null(e, "engine"); }

inline void require_param(const strata_engine* e, int32_t id) {
  require(id >= 0 && static_cast<size_t>(id) < e->params.size(), STRATA_ERROR_INVALID_ARGUMENT,
          "parameter id {} is not registered (ids are 0..{})", id, static_cast<int64_t>(e->params.size()) - 1);
}

inline void require_op(const strata_engine* e, int32_t op) {
  require(op >= 0 && static_cast<size_t>(op) < e->ops.size(), STRATA_ERROR_INVALID_ARGUMENT,
          "operator id {} is not registered (ids are 0..{})", op, static_cast<int64_t>(e->ops.size()) - 1);
}

inline void require_finalized(const strata_engine* e) {
  require(e->finalized, STRATA_ERROR_INVALID_STATE, "called before strata_finalize");
}

inline void require_no_window(const strata_engine* e) {
  require(e->windows.empty(), STRATA_ERROR_INVALID_STATE,
          "called with operator '{}' ({}) still fetched; strata_release every window first",
          e->windows.empty() ? "" : e->zero->op_info(e->windows.back().op).name,
          e->windows.empty() ? "" : phase_name(e->windows.back().phase));
}

// Between strata_prepare_step and strata_step the optimizer may be updating
// the parameters: reading, writing or saving them then is a call-order error.
inline void require_not_prepared(const strata_engine* e, const char* function) {
  require(!e->zero->step_prepared(), STRATA_ERROR_INVALID_STATE,
          "{} between strata_prepare_step and strata_step (the optimizer may be updating the parameters); call it "
          "between steps, or strata_zero_grad to abandon the prepared step",
          function);
}

// Between strata_begin_evaluation and strata_end_evaluation only forward windows run.
inline void require_not_evaluating(const strata_engine* e, const char* function) {
  require(!e->zero->evaluating(), STRATA_ERROR_INVALID_STATE,
          "{} during an evaluation (strata_begin_evaluation); strata_end_evaluation first", function);
}

// Every backward pass begun has been finished (the engine reduces a gradient
// only at its last use; a half-done pass would be completed by the next one).
inline void require_backward_done(const strata_engine* e) {
  for (size_t p = 0; p < e->backward_seen.size(); ++p) {
    require(e->backward_seen[p] == 0, STRATA_ERROR_INVALID_STATE,
            "a backward pass is half done: parameter '{}' has had {} of its {} operators released in "
            "backward; release the rest first",
            e->zero->param_info(static_cast<int32_t>(p)).name, e->backward_seen[p],
            e->zero->uses_of(static_cast<int32_t>(p)));
  }
}

// Records the step breakdown of strata_step `r`, begun at `step_start`, and
// starts the next interval (strata_state.cc).
void record_breakdown(strata_engine* e, const engine::StepResult& r, Clock::time_point step_start);

}  // namespace strata::capi
