// The C API's step breakdown and checkpoints (strata.h): what strata_step
// measured, and strata_save_checkpoint / strata_load_checkpoint over
// runtime/train/checkpoint's crash-safe directory protocol. Checks that
// depend on files (a directory that cannot be written, a damaged or
// mismatched checkpoint) are agreed on by every rank before anything
// changes, so they are INVALID_ARGUMENT with the engine usable.
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "runtime/capi/capi_internal.h"
#include "runtime/capi/strata.h"
#include "core/dtype.h"
#include "core/trace_recorder.h"
#include "runtime/engine/zero_engine.h"
#include "runtime/train/checkpoint.h"

namespace strata::capi {
namespace fs = std::filesystem;

namespace {

strata_phase phase_code(engine::Phase phase) {
  switch (phase) {
    case engine::Phase::kForward: return STRATA_PHASE_FORWARD;
    case engine::Phase::kBackward: return STRATA_PHASE_BACKWARD;
    case engine::Phase::kRecompute: return STRATA_PHASE_RECOMPUTE;
  }
  return STRATA_PHASE_FORWARD;
}

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

}  // namespace

void record_breakdown(strata_engine* e, const engine::StepResult& r, Clock::time_point step_start) {
  const Clock::time_point end = Clock::now();
  const engine::PrefetchStats p = e->zero->last_step_prefetch();
  strata_step_breakdown& b = e->last_breakdown;
  b = strata_step_breakdown{};
  b.step = e->zero->step_count() + e->steps_skipped;
  b.applied = r.applied ? 1 : 0;
  b.trace_followed = p.trace_followed ? 1 : 0;
  b.trace_dropped = p.trace_dropped ? 1 : 0;
  b.stalled_windows = static_cast<int32_t>(p.stalled_windows());
  b.seconds = seconds_between(e->interval_start, end);
  b.param_stall_seconds = p.param_stall_seconds();
  // Time between the steps is the caller's (forward, backward, data) and the
  // windows'; the compute stream's waits for parameters are the stall.
  b.compute_seconds = std::max(0.0, seconds_between(e->interval_start, step_start) - b.param_stall_seconds);
  b.grad_wait_seconds = r.grad_wait_seconds;
  b.optimizer_seconds = r.optimizer_seconds;
  b.other_seconds = std::max(0.0, seconds_between(step_start, end) - r.grad_wait_seconds - r.optimizer_seconds);
  b.windows = p.windows;
  b.fetches = p.fetches();
  b.prefetched = p.prefetched();
  b.gathers = p.gathers;
  b.gathered_bytes = p.gather_nbytes;
  b.nvme_read_bytes = e->zero->nvme_bytes_read() - e->nvme_read_at_start;
  b.nvme_written_bytes = e->zero->nvme_bytes_written() - e->nvme_written_at_start;
  b.param_read_bytes = p.read_nbytes;
  e->last_op_stalls = p.op_stalls();
  e->start_interval();
}

namespace {

// ---- checkpoints -------------------------------------------------------------------------

constexpr const char* kCheckpointWriter = "strata_save_checkpoint";

// What a C API checkpoint is of: every parameter's name, dtype and shape, in
// registration order (the manifest's "model"), so a load can say which
// parameter differs rather than only that the sizes do.
nlohmann::json declarations_json(const engine::ZeroEngine& z) {
  nlohmann::json params = nlohmann::json::array();
  for (int32_t p = 0; p < z.parameter_count(); ++p) {
    const engine::ParamInfo& info = z.param_info(p);
    params.push_back({info.name, std::string(strata::dtype_name(info.dtype)), info.shape});
  }
  return {{"writer", kCheckpointWriter}, {"params", params}};
}

std::string describe_param(const nlohmann::json& entry) {
  return fmt::format("'{}' {} {}", entry.at(0).get<std::string>(), entry.at(1).get<std::string>(),
                     entry.at(2).dump());
}

// Why the checkpoint `manifest` describes cannot be loaded into `z` (empty: it can).
std::string checkpoint_mismatch(const engine::ZeroEngine& z, const fs::path& manifest,
                                const strata::train::CheckpointInfo& info) {
  if (info.world_size != z.world_size()) {
    return fmt::format("{} was written by {} rank(s); this engine has {} (resharding a checkpoint is not supported: "
                       "load it with {} ranks)",
                       manifest.string(), info.world_size, z.world_size(), info.world_size);
  }
  const nlohmann::json& model = info.state.model;
  if (!model.is_object() || model.value("writer", "") != kCheckpointWriter || !model.contains("params")) {
    return fmt::format("{} was not written by strata_save_checkpoint (a strata finetune checkpoint?): it does not "
                       "list its parameters",
                       manifest.string());
  }
  const nlohmann::json mine = declarations_json(z).at("params");
  try {
    const nlohmann::json& saved = model.at("params");
    for (size_t p = 0; p < std::min(saved.size(), mine.size()); ++p) {
      if (saved.at(p) != mine.at(p)) {
        return fmt::format("{} is of other parameters: parameter {} is {} there, {} in this engine", manifest.string(),
                           p, describe_param(saved.at(p)), describe_param(mine.at(p)));
      }
    }
    if (saved.size() != mine.size()) {
      return fmt::format("{} holds {} parameters, this engine has {}", manifest.string(), saved.size(), mine.size());
    }
  } catch (const nlohmann::json::exception& error) {
    return fmt::format("{}: its parameter list is malformed ({})", manifest.string(), error.what());
  }
  return {};
}

// `dir` as given, without a trailing separator (so a step directory's parent is its root).
fs::path directory_path(const char* dir) {
  fs::path path = fs::path(dir).lexically_normal();
  if (!path.has_filename() && path.has_parent_path() && path != path.root_path()) path = path.parent_path();
  return path;
}

// Every rank's verdict on a check made before anything changes: each rank
// passes its own problem (empty: none); if any rank has one, every rank
// fails with INVALID_ARGUMENT (this rank's problem, or a pointer to the
// other's), so the ranks stay in step and the engine stays usable.
void agree(strata_engine* e, const std::string& problem, const std::string& what) {
  const double problems = e->zero->global_sum(problem.empty() ? 0.0 : 1.0);
  if (problems == 0) return;
  throw ApiError{STRATA_ERROR_INVALID_ARGUMENT,
                 !problem.empty() ? problem
                                  : fmt::format("another rank cannot {} (its strata_last_error says why)", what)};
}

}  // namespace
}  // namespace strata::capi

using namespace strata::capi;
namespace engine = strata::engine;
namespace fs = std::filesystem;

extern "C" {

strata_status strata_get_step_breakdown(strata_engine* e, strata_step_breakdown* breakdown) {
  return guarded("strata_get_step_breakdown", nullptr, false, [&] {
    require_engine(e);
    require_not_null(breakdown, "breakdown");
    *breakdown = e->last_breakdown;  // plain values: valid on a failed engine as well
  });
}

strata_status strata_get_op_stalls(strata_engine* e, strata_op_stall* stalls, int32_t capacity, int32_t* count) {
  return guarded("strata_get_op_stalls", nullptr, false, [&] {
    require_engine(e);
    require_not_null(count, "count");
    require(capacity >= 0, STRATA_ERROR_INVALID_ARGUMENT, "capacity is {}; it must be >= 0", capacity);
    require(capacity == 0 || stalls != nullptr, STRATA_ERROR_INVALID_ARGUMENT, "stalls is NULL with capacity {}",
            capacity);
    const std::vector<engine::OpStall>& all = e->last_op_stalls;
    *count = static_cast<int32_t>(all.size());
    for (size_t i = 0; i < std::min(all.size(), static_cast<size_t>(capacity)); ++i) {
      stalls[i].op = all[i].op;
      stalls[i].phase = static_cast<int32_t>(phase_code(all[i].phase));
      stalls[i].windows = all[i].windows;
      stalls[i].seconds = all[i].seconds;
    }
  });
}

// What saving and loading both need: an engine between steps, a directory named.
static void require_checkpoint_call(strata_engine* e, const char* dir, const char* function) {
  require_engine(e);
  require_not_null(dir, "dir");
  require(*dir != '\0', STRATA_ERROR_INVALID_ARGUMENT, "dir is empty");
  require_finalized(e);
  require_no_window(e);
  require_backward_done(e);
  require_not_prepared(e, function);
}

strata_status strata_save_checkpoint(strata_engine* e, const char* dir) {
  return guarded("strata_save_checkpoint", e, /*poison=*/true, [&] {
    require_checkpoint_call(e, dir, "strata_save_checkpoint");
    strata::trace::Span span("capi", "strata_save_checkpoint");
    engine::ZeroEngine& z = *e->zero;
    const fs::path root = directory_path(dir);
    // Counted in strata_step calls (skipped ones too), so each call names a new directory.
    const int64_t step = z.step_count() + e->steps_skipped;
    // Checked (and agreed on) first: a directory strata cannot write, or one
    // whose newest checkpoint is not older, is bad input, not a failed save.
    std::string problem;
    std::error_code ec;
    fs::create_directories(root, ec);
    if (ec) {
      problem = fmt::format("cannot create the checkpoint directory {}: {}", root.string(), ec.message());
    } else if (!fs::is_directory(root, ec)) {
      problem = fmt::format("{} is not a directory", root.string());
    } else if (::access(root.c_str(), W_OK | X_OK) != 0) {
      problem = fmt::format("cannot write into {}: {}", root.string(), std::strerror(errno));
    } else {
      std::optional<strata::train::CheckpointInfo> newest;
      try {
        newest = strata::train::newest_checkpoint(root);
      } catch (const strata::Error&) {
        // None, or none readable: nothing a new checkpoint could be confused with.
      }
      if (newest && newest->state.step >= step) {
        problem = fmt::format(
            "{} already holds a checkpoint of step {} ({}); this engine is at step {} (strata_step calls, skipped "
            "ones included): save after the next strata_step, or into another directory",
            root.string(), newest->state.step, newest->dir.string(), step);
      }
    }
    agree(e, problem, fmt::format("save into {}", root.string()));
    strata::train::TrainerState state;
    state.step = step;
    state.model = declarations_json(z);
    strata::train::Checkpoints(root, /*keep=*/1).save(z, state);
  });
}

strata_status strata_load_checkpoint(strata_engine* e, const char* dir) {
  return guarded("strata_load_checkpoint", e, /*poison=*/true, [&] {
    require_checkpoint_call(e, dir, "strata_load_checkpoint");
    strata::trace::Span span("capi", "strata_load_checkpoint");
    engine::ZeroEngine& z = *e->zero;
    const fs::path path = directory_path(dir);
    // The newest complete checkpoint under `dir` (or `dir` itself, a step
    // directory), checked against this engine before anything is loaded.
    std::string problem;
    std::optional<strata::train::CheckpointInfo> info;
    std::error_code ec;
    if (!fs::exists(path, ec)) {
      problem = fmt::format("the checkpoint directory {} does not exist", path.string());
    } else if (!fs::is_directory(path, ec)) {
      problem = fmt::format("{} is not a directory", path.string());
    } else {
      try {
        info = strata::train::newest_checkpoint(path);
        problem = checkpoint_mismatch(z, info->dir / "manifest.json", *info);
      } catch (const strata::Error& error) {
        problem = error.message();  // no manifest, or one that does not parse: it names the file
      }
    }
    agree(e, problem, fmt::format("load {}", path.string()));
    // The files' sizes and CRC-32s are checked on every rank before any is loaded.
    const bool is_step_dir = info->dir == path;
    strata::train::Checkpoints checkpoints(is_step_dir ? path.parent_path() : path, /*keep=*/1);
    std::vector<std::string> rejected;
    const std::optional<strata::train::TrainerState> loaded =
        checkpoints.find_and_load(z, info->state.step, &rejected);
    if (!loaded) {
      std::string why;
      for (const std::string& line : rejected) why += (why.empty() ? "" : "; ") + line;
      throw ApiError{STRATA_ERROR_INVALID_ARGUMENT,
                     fmt::format("the checkpoint {} cannot be loaded: {}", info->dir.string(),
                                 why.empty() ? fmt::format("it is not a step_<N> directory of {}",
                                                           checkpoints.root().string())
                                             : why)};
    }
    e->steps_skipped = loaded->step - z.step_count();
    e->last_breakdown = strata_step_breakdown{};
    e->last_op_stalls.clear();
    e->start_interval();
  });
}

}  // extern "C"
