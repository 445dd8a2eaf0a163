// The C API (strata.h) over engine::ZeroEngine: engines, declarations, steps
// and the timeline (hook windows are in strata_windows.cc, the step breakdown
// and checkpoints in strata_state.cc). Each entry point checks its arguments and the call order
// itself, before touching the engine, so that bad input is a status that
// leaves the engine usable; whatever the engine then throws is caught
// (guarded, capi_internal.h), converted to a status and a thread-local
// message, and (except for declarations, which change nothing when they
// throw) marks the engine failed, because the throw may have come half way
// through a collective or a transfer.
#include "runtime/capi/strata.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "partition/communicator.h"
#include "partition/rendezvous.h"
#include "runtime/capi/capi_internal.h"
#include "runtime/config/config.h"
#include "core/accelerator.h"
#include "core/error.h"
#include "core/log.h"
#include "core/trace_recorder.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/launcher/launcher.h"
#include "runtime/train/zero_config.h"

std::string& strata::capi::last_error_message() {
  thread_local std::string message;
  return message;
}

using namespace strata::capi;

namespace {

namespace engine = strata::engine;
namespace partition = strata::partition;
using strata::DType;

int32_t tier_of(strata::Tier tier) {
  switch (tier) {
    case strata::Tier::kDevice: return STRATA_TIER_DEVICE;
    case strata::Tier::kCpu: return STRATA_TIER_CPU;
    case strata::Tier::kNvme: return STRATA_TIER_NVME;
  }
  return STRATA_TIER_DEVICE;
}

// 64-bit FNV-1a, to compare the ranks' declarations.
struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void bytes(const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
  }
  template <typename T>
  void value(const T& v) { bytes(&v, sizeof v); }
  void text(const std::string& s) {
    value(s.size());
    bytes(s.data(), s.size());
  }
};

// The process's rendezvous, shared by its engines: made by the first
// strata_engine_create and destroyed at exit, where rank 0 waits for every
// rank's goodbye (Rendezvous's destructor). One per process because
// MASTER_PORT names one store: a second server on it while a peer still talks
// to the first would race. Engines differ by their communicators' key prefix,
// numbered in creation order (the same on every rank).
struct SharedRendezvous {
  std::mutex mutex;
  std::unique_ptr<partition::Rendezvous> rendezvous;
  int64_t engines = 0;
};

SharedRendezvous& shared_rendezvous() {
  static SharedRendezvous shared;
  return shared;
}

// Sum of int32 `words` over ranks on the C layer's own communicator, through
// accelerator memory (NCCL needs device buffers). Blocks.
void allreduce_i32(strata_engine* e, int32_t* words, size_t count) {
  if (e->zero->world_size() == 1 || count == 0) return;
  strata::Accelerator& acc = *e->accelerator;
  const size_t nbytes = count * sizeof(int32_t);
  void* device = acc.allocate(nbytes);
  try {
    acc.copy_async(device, words, nbytes, strata::CopyKind::kHostToDevice, *e->host_stream);
    e->host->allreduce(device, device, count, DType::kI32, partition::ReduceOp::kSum, *e->host_stream);
    acc.copy_async(words, device, nbytes, strata::CopyKind::kDeviceToHost, *e->host_stream);
    e->host_stream->synchronize();
  } catch (...) {
    try {  // the buffer is free only once the stream is done with it; its error is the one thrown
      e->host_stream->synchronize();
    } catch (...) {
    }
    acc.deallocate(device);
    throw;
  }
  acc.deallocate(device);
}

// Whether every rank declared the same parameters and operators: the
// declarations' hash in 16-bit lanes, summed over ranks, must be world x own.
void check_same_declarations(strata_engine* e) {
  const int world = e->zero->world_size();
  if (world == 1 || world > 32767) return;  // a lane sum must fit in int32
  Fnv fnv;
  for (int32_t p = 0; p < e->zero->parameter_count(); ++p) {
    const engine::ParamInfo& info = e->zero->param_info(p);
    fnv.text(info.name);
    fnv.value(info.dtype);
    for (int64_t d : info.shape) fnv.value(d);
    fnv.value(int64_t{-1});
  }
  for (const auto& op : e->ops) {
    fnv.value(op.size());
    for (int32_t p : op) fnv.value(p);
  }
  int32_t lanes[4], sums[4];
  for (int i = 0; i < 4; ++i) sums[i] = lanes[i] = static_cast<int32_t>((fnv.h >> (16 * i)) & 0xffff);
  allreduce_i32(e, sums, 4);
  for (int i = 0; i < 4; ++i) {
    require(sums[i] == lanes[i] * world, STRATA_ERROR_INVALID_ARGUMENT,
            "the ranks registered different parameters or operators (names, dtypes, shapes or order); every "
            "rank must register the same ones in the same order");
  }
}

}  // namespace

extern "C" {

int strata_version(void) { return STRATA_VERSION; }

const char* strata_version_string(void) {
#define STRATA_STR2(x) #x
#define STRATA_STR(x) STRATA_STR2(x)
  return STRATA_STR(STRATA_VERSION_MAJOR) "." STRATA_STR(STRATA_VERSION_MINOR) "." STRATA_STR(STRATA_VERSION_PATCH);
#undef STRATA_STR
#undef STRATA_STR2
}

const char* strata_status_string(strata_status status) {
  switch (status) {
    case STRATA_OK: return "ok";
    case STRATA_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case STRATA_ERROR_INVALID_STATE: return "invalid state";
    case STRATA_ERROR_IO: return "I/O error";
    case STRATA_ERROR_OUT_OF_MEMORY: return "out of memory";
    case STRATA_ERROR_COMMUNICATION: return "communication error";
    case STRATA_ERROR_CUDA: return "CUDA error";
    case STRATA_ERROR_INTERNAL: return "internal error";
    case STRATA_ERROR_ENGINE_FAILED: return "engine failed";
    case STRATA_ERROR_CALLBACK: return "init callback failed";
  }
  return "unknown status";
}

const char* strata_last_error(void) { return strata::capi::last_error_message().c_str(); }

strata_status strata_engine_create(const char* config_json, strata_engine** out) {
  if (out != nullptr) *out = nullptr;
  return guarded("strata_engine_create", nullptr, false, [&] {
    require_not_null(config_json, "config_json");
    require_not_null(out, "out");
    const std::string source = "config";
    const strata::Config config = strata::parse_config_text(config_json, source);
    const engine::ZeroEngineOptions options = strata::train::zero_engine_options(config, source);
    // The C API's parameters are not marked as experts: nothing would be split.
    STRATA_CHECK(config.expert_parallel_size <= 1, kBadArgument,
                 "{}: moe.expert_parallel_size {} is for strata finetune's mixture-of-experts models; the C API "
                 "declares no experts (leave it out or set 1)",
                 source, config.expert_parallel_size);
    STRATA_CHECK(config.router_bias_update_rate == 0, kBadArgument,
                 "{}: moe.router_bias_update_rate {} is for strata finetune's DeepSeek-style models; the C API "
                 "declares no router (leave it out or set 0)",
                 source, config.router_bias_update_rate);
    // Nor split across tensor-parallel ranks: the caller's model computes whole layers.
    STRATA_CHECK(config.tensor_parallel_size <= 1, kBadArgument,
                 "{}: tensor_parallel.autotp_size {} is for strata finetune's models; the C API's parameters are "
                 "whole tensors (leave it out or set 1)",
                 source, config.tensor_parallel_size);
    STRATA_CHECK(!config.sequence_parallel, kBadArgument,
                 "{}: sequence_parallel is true: sequence parallelism splits strata finetune's decoder layers over "
                 "tensor-parallel ranks; the C API's model is the caller's (leave it out or set false)",
                 source);
    STRATA_CHECK(config.context_parallel_size <= 1, kBadArgument,
                 "{}: context_parallel.size {} is for strata finetune's models: context parallelism splits their "
                 "sequences and attention over ranks; the C API's model is the caller's (leave it out or set 1)",
                 source, config.context_parallel_size);
    partition::RankInfo rank = strata::launcher::rank_info_from_env();
    strata::set_log_rank(rank.rank, rank.world_size);
    strata::set_log_level(config.strata.log_level);

    auto e = std::make_unique<strata_engine>();
    e->accelerator = strata::make_accelerator(config.strata.accelerator);
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(config.strata.collective_timeout_s * 1000));
    partition::Rendezvous* rendezvous = nullptr;
    int64_t generation = 0;
    {
      SharedRendezvous& shared = shared_rendezvous();
      std::lock_guard<std::mutex> lock(shared.mutex);
      if (shared.rendezvous == nullptr) shared.rendezvous = std::make_unique<partition::Rendezvous>(rank, timeout);
      rendezvous = shared.rendezvous.get();
      rank = rendezvous->info();  // the process's ranks, fixed by its first engine
      generation = shared.engines++;
    }
    auto communicator = [&](const char* traffic) {
      partition::CommunicatorOptions o;
      o.rank = rank.rank;
      o.world_size = rank.world_size;
      o.timeout = timeout;
      o.prefix = fmt::format("strata/capi/{}/{}", generation, traffic);
      return partition::make_communicator(*e->accelerator, rendezvous->store(), o);
    };
    e->comms = strata::train::make_zero_communicators(*e->accelerator, rendezvous->store(), rank.rank,
                                                       rank.world_size, timeout,
                                                       fmt::format("strata/capi/{}", generation));
    e->host = communicator("host");
    e->host_stream = e->accelerator->create_stream();
    e->zero = std::make_unique<engine::ZeroEngine>(*e->accelerator,
                                                   e->comms.comms(),
                                                   options);
    strata::logger().info("strata_engine_create: rank {} of {}, {} accelerator, ZeRO stage {}, params on {}, "
                          "optimizer state on {}",
                          rank.rank, rank.world_size, e->accelerator->name(), options.stage,
                          strata::tier_name(options.param_tier), strata::tier_name(options.optimizer_tier));
    *out = e.release();
  });
}

strata_status strata_engine_destroy(strata_engine* engine) {
  if (engine == nullptr) return STRATA_OK;
  try {
    delete engine;
  } catch (...) {
    // Destructors do not throw; nothing to report if one did.
  }
  return STRATA_OK;
}

strata_status strata_register_param(strata_engine* e, const char* name, strata_dtype dtype, int32_t ndim,
                                    const int64_t* shape, const void* initial_values, strata_init_fn init,
                                    void* user, int32_t* id_out) {
  return guarded("strata_register_param", e, /*poison=*/false, [&] {
    require_engine(e);
    require_not_null(name, "name");
    require_not_null(id_out, "id_out");
    require(*name != '\0', STRATA_ERROR_INVALID_ARGUMENT, "name is empty");
    require(!e->finalized, STRATA_ERROR_INVALID_STATE, "parameter '{}' registered after strata_finalize", name);
    require(valid_dtype(dtype), STRATA_ERROR_INVALID_ARGUMENT,
            "parameter '{}': dtype {} is not a strata_dtype (STRATA_DTYPE_F32 = 0, F16 = 1, BF16 = 2)", name,
            static_cast<int>(dtype));
    require(ndim >= 1 && ndim <= STRATA_MAX_NDIM, STRATA_ERROR_INVALID_ARGUMENT,
            "parameter '{}': ndim {} must be in [1, {}]", name, ndim, STRATA_MAX_NDIM);
    require_not_null(shape, "shape");
    require(initial_values == nullptr || init == nullptr, STRATA_ERROR_INVALID_ARGUMENT,
            "parameter '{}': give initial_values or an init callback, not both", name);
    engine::ParamInfo info;
    info.name = name;
    info.dtype = dtype_of(dtype);
    int64_t numel = 1;
    for (int32_t d = 0; d < ndim; ++d) {
      require(shape[d] >= 1, STRATA_ERROR_INVALID_ARGUMENT,
              "parameter '{}': shape[{}] is {}; every dimension must be >= 1", name, d, shape[d]);
      require(numel <= (int64_t{1} << 62) / shape[d], STRATA_ERROR_INVALID_ARGUMENT,
              "parameter '{}': the shape's element count overflows", name);
      numel *= shape[d];
      info.shape.push_back(shape[d]);
    }
    bool taken = true;
    try {
      (void)e->zero->find_parameter(info.name);
    } catch (const strata::Error&) {
      taken = false;
    }
    require(!taken, STRATA_ERROR_INVALID_ARGUMENT, "parameter name '{}' is already registered", name);
    strata_engine::Param param;
    if (initial_values != nullptr) {
      const auto* bytes = static_cast<const char*>(initial_values);
      param.initial.assign(bytes, bytes + info.nbytes());
    }
    param.init = init;
    param.user = user;
    e->params.reserve(e->params.size() + 1);  // nothing below may throw after the engine declared it
    const int32_t id = e->zero->declare_parameter(std::move(info));
    e->params.push_back(std::move(param));
    *id_out = id;
  });
}

strata_status strata_register_op(strata_engine* e, const char* name, int32_t n, const int32_t* params,
                                 int32_t* op_out) {
  return guarded("strata_register_op", e, /*poison=*/false, [&] {
    require_engine(e);
    require_not_null(name, "name");
    require_not_null(op_out, "op_out");
    require(*name != '\0', STRATA_ERROR_INVALID_ARGUMENT, "name is empty");
    require(!e->finalized, STRATA_ERROR_INVALID_STATE, "operator '{}' registered after strata_finalize", name);
    require(n >= 0, STRATA_ERROR_INVALID_ARGUMENT, "operator '{}': n is {}", name, n);
    require(n == 0 || params != nullptr, STRATA_ERROR_INVALID_ARGUMENT, "operator '{}': params is NULL with n = {}",
            name, n);
    std::vector<int32_t> listed(params, params + n);
    for (int32_t i = 0; i < n; ++i) {
      require(listed[i] >= 0 && static_cast<size_t>(listed[i]) < e->params.size(), STRATA_ERROR_INVALID_ARGUMENT,
              "operator '{}': params[{}] = {} is not a registered parameter id (ids are 0..{})", name, i, listed[i],
              static_cast<int64_t>(e->params.size()) - 1);
      require(std::find(listed.begin(), listed.begin() + i, listed[i]) == listed.begin() + i,
              STRATA_ERROR_INVALID_ARGUMENT, "operator '{}': parameter id {} is listed twice", name, listed[i]);
    }
    e->ops.reserve(e->ops.size() + 1);
    const int32_t op = e->zero->declare_operator(name, listed);
    e->ops.push_back(std::move(listed));
    *op_out = op;
  });
}

strata_status strata_find_param(strata_engine* e, const char* name, int32_t* id_out) {
  return guarded("strata_find_param", e, /*poison=*/false, [&] {
    require_engine(e);
    require_not_null(name, "name");
    require_not_null(id_out, "id_out");
    for (int32_t p = 0; p < e->zero->parameter_count(); ++p) {
      if (e->zero->param_info(p).name == name) {
        *id_out = p;
        return;
      }
    }
    require(false, STRATA_ERROR_INVALID_ARGUMENT, "no parameter is called '{}'", name);
  });
}

strata_status strata_freeze_param(strata_engine* e, int32_t id) {
  return guarded("strata_freeze_param", e, /*poison=*/false, [&] {
    require_engine(e);
    require_param(e, id);
    require(!e->finalized, STRATA_ERROR_INVALID_STATE, "parameter '{}' frozen after strata_finalize",
            e->zero->param_info(id).name);
    e->zero->freeze(id);
  });
}

strata_status strata_set_weight_decay(strata_engine* e, int32_t id, float weight_decay) {
  return guarded("strata_set_weight_decay", e, /*poison=*/false, [&] {
    require_engine(e);
    require_param(e, id);
    require(std::isfinite(weight_decay) && weight_decay >= 0, STRATA_ERROR_INVALID_ARGUMENT,
            "parameter '{}': weight decay {} must be finite and >= 0", e->zero->param_info(id).name, weight_decay);
    require(!e->finalized, STRATA_ERROR_INVALID_STATE, "parameter '{}' given a weight decay after strata_finalize",
            e->zero->param_info(id).name);
    e->zero->set_weight_decay(id, weight_decay);
  });
}

strata_status strata_set_lr_scale(strata_engine* e, int32_t id, float lr_scale) {
  return guarded("strata_set_lr_scale", e, /*poison=*/false, [&] {
    require_engine(e);
    require_param(e, id);
    require(std::isfinite(lr_scale) && lr_scale >= 0, STRATA_ERROR_INVALID_ARGUMENT,
            "parameter '{}': lr scale {} must be finite and >= 0", e->zero->param_info(id).name, lr_scale);
    require(!e->finalized, STRATA_ERROR_INVALID_STATE, "parameter '{}' given an lr scale after strata_finalize",
            e->zero->param_info(id).name);
    e->zero->set_lr_scale(id, lr_scale);
  });
}

strata_status strata_finalize(strata_engine* e) {
  return guarded("strata_finalize", e, /*poison=*/true, [&] {
    require_engine(e);
    require(!e->finalized, STRATA_ERROR_INVALID_STATE, "strata_finalize called twice");
    require(!e->params.empty(), STRATA_ERROR_INVALID_STATE, "no parameter is registered");
    check_same_declarations(e);
    e->zero->finalize();
    for (int32_t p = 0; p < e->zero->parameter_count(); ++p) {
      strata_engine::Param& param = e->params[static_cast<size_t>(p)];
      const size_t element_nbytes = e->zero->param_info(p).nbytes() / static_cast<size_t>(e->zero->param_info(p).numel());
      if (!param.initial.empty()) {
        e->zero->for_each_owned_range(p, engine::Engine::Access::kWrite, [&](int64_t first, const strata::TensorView& host) {
          std::memcpy(host.data, param.initial.data() + static_cast<size_t>(first) * element_nbytes, host.nbytes());
        });
        std::vector<char>().swap(param.initial);
      } else if (param.init != nullptr) {
        e->zero->for_each_owned_range(p, engine::Engine::Access::kWrite, [&](int64_t first, const strata::TensorView& host) {
          const int rc = param.init(param.user, p, first, host.numel(), host.data);
          if (rc != 0) {
            throw CallbackError{fmt::format("the init callback of parameter '{}' returned {} for elements [{}, {})",
                                            e->zero->param_info(p).name, rc, first, first + host.numel())};
          }
        });
      }
    }
    e->backward_seen.assign(e->params.size(), 0);
    e->finalized = true;
    e->start_interval();
  });
}

strata_status strata_global_sum(strata_engine* e, double value, double* sum) {
  return guarded("strata_global_sum", e, /*poison=*/true, [&] {
    require_engine(e);
    require_not_null(sum, "sum");
    require_finalized(e);
    *sum = e->zero->global_sum(value);
  });
}

strata_status strata_step(strata_engine* e, float lr, strata_step_result* result) {
  return guarded("strata_step", e, /*poison=*/true, [&] {
    require_engine(e);
    require(std::isfinite(lr) && lr >= 0, STRATA_ERROR_INVALID_ARGUMENT, "lr is {}; it must be finite and >= 0", lr);
    require_finalized(e);
    require_no_window(e);
    require_backward_done(e);
    require_not_evaluating(e, "strata_step");
    strata::trace::Span span("capi", "strata_step");
    const Clock::time_point start = Clock::now();
    e->norm_taken = false;  // step() takes the boundary, or fails and leaves the engine unusable
    const engine::StepResult r = e->zero->step(lr);
    e->steps_skipped += !r.applied;
    record_breakdown(e, r, start);
    if (result != nullptr) {
      result->applied = r.applied ? 1 : 0;
      result->grad_scale = r.grad_scale;
      result->grad_norm = r.grad_norm;
      result->loss_scale = r.loss_scale;
      result->step = r.step;
    }
  });
}

strata_status strata_prepare_step(strata_engine* e, float lr) {
  return guarded("strata_prepare_step", e, /*poison=*/true, [&] {
    require_engine(e);
    require(std::isfinite(lr) && lr >= 0, STRATA_ERROR_INVALID_ARGUMENT, "lr is {}; it must be finite and >= 0", lr);
    require_finalized(e);
    require_no_window(e);
    require_backward_done(e);
    require(!e->zero->step_prepared(), STRATA_ERROR_INVALID_STATE,
            "strata_prepare_step called twice without a strata_step (or strata_zero_grad) between");
    require_not_evaluating(e, "strata_prepare_step");
    e->zero->prepare_step(lr);
  });
}

strata_status strata_clip_grad_norm(strata_engine* e, double max_norm, double* norm) {
  return guarded("strata_clip_grad_norm", e, /*poison=*/true, [&] {
    require_engine(e);
    require(!std::isnan(max_norm), STRATA_ERROR_INVALID_ARGUMENT, "max_norm is NaN");
    require_finalized(e);
    require_no_window(e);
    require_backward_done(e);
    require_not_evaluating(e, "strata_clip_grad_norm");
    const double value = e->zero->clip_grad_norm(max_norm);
    e->norm_taken = true;
    if (norm != nullptr) *norm = value;
  });
}

strata_status strata_begin_evaluation(strata_engine* e) {
  return guarded("strata_begin_evaluation", e, /*poison=*/true, [&] {
    require_engine(e);
    require_finalized(e);
    require_no_window(e);
    require_backward_done(e);
    require_not_prepared(e, "strata_begin_evaluation");
    require(!e->zero->evaluating(), STRATA_ERROR_INVALID_STATE, "an evaluation has begun already");
    require(!e->norm_taken, STRATA_ERROR_INVALID_STATE,
            "called between strata_clip_grad_norm and strata_step (strata_step or strata_zero_grad first)");
    e->zero->begin_evaluation();
  });
}

strata_status strata_end_evaluation(strata_engine* e) {
  return guarded("strata_end_evaluation", e, /*poison=*/true, [&] {
    require_engine(e);
    require_finalized(e);
    require_no_window(e);
    require(e->zero->evaluating(), STRATA_ERROR_INVALID_STATE, "no evaluation has begun (strata_begin_evaluation)");
    e->zero->end_evaluation();
  });
}

strata_status strata_loss_scale(strata_engine* e, double* scale) {
  return guarded("strata_loss_scale", e, /*poison=*/true, [&] {
    require_engine(e);
    require_not_null(scale, "scale");
    *scale = e->zero->loss_scale();
  });
}

strata_status strata_zero_grad(strata_engine* e) {
  return guarded("strata_zero_grad", e, /*poison=*/true, [&] {
    require_engine(e);
    require_finalized(e);
    require_no_window(e);
    require_backward_done(e);
    e->zero->zero_grad();
    e->norm_taken = false;
  });
}

strata_status strata_read_param(strata_engine* e, int32_t id, void* host_full) {
  return guarded("strata_read_param", e, /*poison=*/true, [&] {
    require_engine(e);
    require_not_null(host_full, "host_full");
    require_param(e, id);
    require_finalized(e);
    require_no_window(e);
    require_not_prepared(e, "strata_read_param");
    const engine::ParamInfo& info = e->zero->param_info(id);
    const size_t element_nbytes = strata::dtype_nbytes(info.dtype), nbytes = info.nbytes();
    // Each element is owned by one rank and is zero elsewhere, so an integer
    // sum of the words is a bitwise OR of the owners' bits: exact for every
    // dtype, NaN payloads included, whatever the layout's alignment (even if
    // two ranks owned the halves of one word, they could not carry).
    std::vector<int32_t> words((nbytes + sizeof(int32_t) - 1) / sizeof(int32_t), 0);
    e->zero->for_each_owned_range(id, engine::Engine::Access::kRead, [&](int64_t first, const strata::TensorView& host) {
      std::memcpy(reinterpret_cast<char*>(words.data()) + static_cast<size_t>(first) * element_nbytes, host.data,
                  host.nbytes());
    });
    allreduce_i32(e, words.data(), words.size());
    std::memcpy(host_full, words.data(), nbytes);
  });
}

strata_status strata_write_param(strata_engine* e, int32_t id, const void* host_full) {
  return guarded("strata_write_param", e, /*poison=*/true, [&] {
    require_engine(e);
    require_not_null(host_full, "host_full");
    require_param(e, id);
    require_finalized(e);
    require_no_window(e);
    require_not_prepared(e, "strata_write_param");
    const size_t element_nbytes = strata::dtype_nbytes(e->zero->param_info(id).dtype);
    const char* src = static_cast<const char*>(host_full);
    e->zero->for_each_owned_range(id, engine::Engine::Access::kWrite, [&](int64_t first, const strata::TensorView& host) {
      std::memcpy(host.data, src + static_cast<size_t>(first) * element_nbytes, host.nbytes());
    });
  });
}

namespace {

// The moments' calls between steps, and their ids: known, trained, each once.
// Returns each parameter's position in `ids` (-1: not listed).
std::vector<int32_t> optimizer_state_ids(strata_engine* e, int32_t count, const int32_t* ids, const char* function) {
  require_finalized(e);
  require_no_window(e);
  require_backward_done(e);
  require_not_prepared(e, function);
  require(count >= 0, STRATA_ERROR_INVALID_ARGUMENT, "count {} < 0", count);
  if (count > 0) require_not_null(ids, "ids");
  std::vector<int32_t> position(e->params.size(), -1);
  for (int32_t i = 0; i < count; ++i) {
    require_param(e, ids[i]);
    const engine::ParamInfo& info = e->zero->param_info(ids[i]);
    require(!info.frozen, STRATA_ERROR_INVALID_ARGUMENT, "'{}' is frozen (strata_freeze_param): it has no moments",
            info.name);
    require(position[static_cast<size_t>(ids[i])] < 0, STRATA_ERROR_INVALID_ARGUMENT, "'{}' is listed twice",
            info.name);
    position[static_cast<size_t>(ids[i])] = i;
  }
  return position;
}

}  // namespace

strata_status strata_read_optimizer_state(strata_engine* e, int32_t count, const int32_t* ids,
                                          float* const* exp_avg, float* const* exp_avg_sq, int64_t* step) {
  return guarded("strata_read_optimizer_state", e, /*poison=*/true, [&] {
    require_engine(e);
    const std::vector<int32_t> position = optimizer_state_ids(e, count, ids, "strata_read_optimizer_state");
    if (count > 0 && exp_avg != nullptr) {
      for (int32_t i = 0; i < count; ++i) require_not_null(exp_avg[i], "exp_avg[i]");
    }
    if (count > 0 && exp_avg_sq != nullptr) {
      for (int32_t i = 0; i < count; ++i) require_not_null(exp_avg_sq[i], "exp_avg_sq[i]");
    }
    // Each element is owned by one rank and zero elsewhere: the integer sum
    // of the words is the owner's bits (as strata_read_param).
    for (int32_t i = 0; i < count; ++i) {
      const size_t numel = static_cast<size_t>(e->zero->param_info(ids[i]).numel());
      if (exp_avg != nullptr) std::memset(exp_avg[i], 0, numel * sizeof(float));
      if (exp_avg_sq != nullptr) std::memset(exp_avg_sq[i], 0, numel * sizeof(float));
    }
    e->zero->read_moments([&](int32_t id, int64_t first, size_t n, const float* m, const float* v) {
      const int32_t i = position[static_cast<size_t>(id)];
      if (i < 0) return;
      if (exp_avg != nullptr) std::memcpy(exp_avg[i] + first, m, n * sizeof(float));
      if (exp_avg_sq != nullptr) std::memcpy(exp_avg_sq[i] + first, v, n * sizeof(float));
    });
    static_assert(sizeof(float) == sizeof(int32_t));
    for (int32_t i = 0; i < count; ++i) {
      const size_t numel = static_cast<size_t>(e->zero->param_info(ids[i]).numel());
      for (float* const* moment : {exp_avg, exp_avg_sq}) {
        if (moment != nullptr) allreduce_i32(e, reinterpret_cast<int32_t*>(moment[i]), numel);
      }
    }
    if (step != nullptr) *step = e->zero->step_count();
  });
}

strata_status strata_write_optimizer_state(strata_engine* e, int32_t count, const int32_t* ids,
                                           const float* const* exp_avg, const float* const* exp_avg_sq,
                                           int64_t step) {
  return guarded("strata_write_optimizer_state", e, /*poison=*/true, [&] {
    require_engine(e);
    const std::vector<int32_t> position = optimizer_state_ids(e, count, ids, "strata_write_optimizer_state");
    require(step >= 0, STRATA_ERROR_INVALID_ARGUMENT, "step {} < 0", step);
    if (count > 0) {
      require_not_null(exp_avg, "exp_avg");
      require_not_null(exp_avg_sq, "exp_avg_sq");
      for (int32_t i = 0; i < count; ++i) {
        require_not_null(exp_avg[i], "exp_avg[i]");
        require_not_null(exp_avg_sq[i], "exp_avg_sq[i]");
      }
    }
    for (size_t p = 0; p < position.size(); ++p) {
      const engine::ParamInfo& info = e->zero->param_info(static_cast<int32_t>(p));
      require(info.frozen || position[p] >= 0, STRATA_ERROR_INVALID_ARGUMENT,
              "trained parameter '{}' is not listed (every trained parameter's moments are set together)",
              info.name);
    }
    e->zero->write_moments(
        [&](int32_t id, int64_t first, size_t n, float* m, float* v) {
          const int32_t i = position[static_cast<size_t>(id)];
          std::memcpy(m, exp_avg[i] + first, n * sizeof(float));
          std::memcpy(v, exp_avg_sq[i] + first, n * sizeof(float));
        },
        step);
  });
}

strata_status strata_get_stats(strata_engine* e, strata_stats* stats) {
  if (e == nullptr || stats == nullptr) {
    return guarded("strata_get_stats", nullptr, false, [&] {
      require_engine(e);
      require_not_null(stats, "stats");
    });
  }
  // Reads plain counters only: valid on a failed engine as well.
  const engine::ZeroEngine& z = *e->zero;
  *stats = strata_stats{};
  stats->rank = z.rank();
  stats->world_size = z.world_size();
  stats->zero_stage = z.options().stage;
  stats->param_tier = tier_of(z.options().param_tier);
  stats->optimizer_tier = tier_of(z.options().optimizer_tier);
  stats->param_count = z.parameter_count();
  stats->op_count = z.operator_count();
  stats->host_memory = e->accelerator->host_addressable() ? 1 : 0;
  stats->finalized = e->finalized ? 1 : 0;
  stats->failed = e->failure.empty() ? 0 : 1;
  for (int32_t p = 0; p < z.parameter_count(); ++p) stats->param_numel += z.param_info(p).numel();
  stats->steps = z.step_count();
  stats->steps_skipped = e->steps_skipped;
  stats->gathered_bytes = z.gathered_nbytes();
  stats->peak_gathered_bytes = z.peak_gathered_nbytes();
  stats->gathers = z.gathers_issued();
  return STRATA_OK;
}

strata_status strata_trace_start(const char* path) {
  return guarded("strata_trace_start", nullptr, false, [&] {
    require_not_null(path, "path");
    require(*path != '\0', STRATA_ERROR_INVALID_ARGUMENT, "path is empty");
    require(!strata::trace::enabled(), STRATA_ERROR_INVALID_STATE,
            "a trace is already being recorded; call strata_trace_stop first");
    const partition::RankInfo rank = partition::RankInfo::from_env();
    strata::trace::Options options;
    options.path = path;
    options.rank = rank.rank;
    options.world_size = rank.world_size;
    options.process_name = fmt::format("strata rank {}", rank.rank);
    strata::trace::start(options);
    // The trainer's thread, which runs the hook windows: a named track.
    strata::trace::name_this_thread("caller", /*replace=*/false);
  });
}

strata_status strata_trace_stop(void) {
  return guarded("strata_trace_stop", nullptr, false, [&] {
    require(strata::trace::enabled(), STRATA_ERROR_INVALID_STATE,
            "no trace is being recorded (strata_trace_start was not called, or strata_trace_stop was)");
    const strata::trace::Summary summary = strata::trace::stop();
    strata::logger().info("trace written to {} ({} events{})", summary.path, summary.events,
                          summary.dropped > 0 ? fmt::format(", {} dropped", summary.dropped) : "");
  });
}

}  // extern "C"
