// ZeroEngine checkpoints: this rank's shards and optimizer state to files and back.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <vector>

#include "core/error.h"
#include "runtime/engine/zero_engine.h"

namespace strata::engine {
namespace fs = std::filesystem;
namespace {

constexpr const char* kStateFormat = "strata-zero-state/1";
constexpr const char* kStateFile = "engine.json";

// A frozen group's parameters have their own file beside the trainable group
// of the same dtype (and no optimizer files); so have the experts this rank
// holds under expert parallelism (params_fp32_experts.bin, master_fp32_experts.bin, ...),
// and the parameters of their own weight decay (params_fp32_wd0.bin, master_fp32_wd0.bin, ...) or lr scale
// (params_fp32_lr10.bin, ...).
template <typename G>
std::string params_file(const G& g) {
  return fmt::format("params_{}.bin", g.key);
}
template <typename G>
std::string optimizer_file(const char* what, const G& g) {
  return fmt::format("{}_{}{}{}{}{}.bin", what, dtype_name(g.dtype), g.expert ? "_experts" : "", g.suffix,
                     g.decay_suffix, g.lr_suffix);
}

// The exact size a state file must have, or an error naming it.
void expect_size(const fs::path& path, uint64_t nbytes) {
  std::error_code ec;
  const uint64_t actual = fs::file_size(path, ec);
  STRATA_CHECK(!ec, kIo, "checkpoint file {} is missing or unreadable: {}", path.string(), ec.message());
  STRATA_CHECK(actual == nbytes, kIo, "checkpoint file {} has {} bytes, expected {} (truncated or from another model)",
               path.string(), actual, nbytes);
}

}  // namespace

std::vector<StateFile> ZeroEngine::save_state(const fs::path& dir, FrozenState frozen) {
  STRATA_CHECK(finalized(), kBadArgument, "save_state() before finalize()");
  check_not_prepared("save_state");
  finish_update();
  check_no_backward("save_state");
  compute_stream().synchronize();
  gather_stream_->synchronize();
  std::vector<StateFile> files;
  nlohmann::json groups = nlohmann::json::array();
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = *groups_[gi];
    const bool params_saved = !g.frozen || frozen == FrozenState::kSaved;
    if (params_saved) {
      StateFileWriter out(dir, params_file(g));
      g.home->for_each_chunk([&](size_t first, size_t numel) {
        out.append(g.home->host_range(first, numel, /*load=*/true), numel * dtype_nbytes(g.dtype));
      });
      files.push_back(out.finish());
    }
    groups.push_back({{"dtype", dtype_name(g.dtype)},
                      {"frozen", g.frozen},
                      {"experts", g.expert},
                      {"tp_split", g.tp_split},
                      {"tp_counted", g.tp_counted},
                      {"params_saved", params_saved},
                      {"params", g.params.size()},
                      {"shard_numel", g.layout->shard_numel()},
                      {"first_param", param_info(g.params.front()).name}});
    if (g.frozen) continue;  // no optimizer state
    // One pass over the sub-groups (each read once from NVMe), three files.
    // Never stepped (or loaded since): the master weights are the parameters.
    StateFileWriter master(dir, optimizer_file("master", g)), exp_avg(dir, optimizer_file("exp_avg", g)),
        exp_avg_sq(dir, optimizer_file("exp_avg_sq", g));
    optimizer_->save(static_cast<size_t>(g.shard),
                     [&](size_t, size_t numel, const float* p, const float* m, const float* v) {
                       master.append(p, numel * sizeof(float));
                       exp_avg.append(m, numel * sizeof(float));
                       exp_avg_sq.append(v, numel * sizeof(float));
                     });
    files.push_back(master.finish());
    files.push_back(exp_avg.finish());
    files.push_back(exp_avg_sq.finish());
  }
  const LossScaler::State scaler = loss_scaler_.state();
  const nlohmann::json state = {{"format", kStateFormat},
                                {"rank", rank()},
                                {"world_size", world_size()},
                                {"expert_parallel_size", options_.expert_parallel_size},
                                {"tensor_parallel_size", tensor_group().size},
                                {"tensor_rank", tensor_group().rank},
                                {"stage", options_.stage},
                                {"steps", steps_},
                                {"loss_scaler",
                                 {{"scale", scaler.scale},
                                  {"iteration", scaler.iteration},
                                  {"last_overflow_iteration", scaler.last_overflow_iteration},
                                  {"hysteresis_left", scaler.hysteresis_left}}},
                                {"groups", groups}};
  StateFileWriter out(dir, kStateFile);
  const std::string text = state.dump(2) + "\n";
  out.append(text.data(), text.size());
  files.push_back(out.finish());
  sync_directory(dir);
  return files;
}

template <typename Fn>
void ZeroEngine::for_each_param_in(const Group& g, size_t first, size_t numel, Fn&& fn) const {
  const int member = g.gather_comm->rank();
  for (size_t i = 0; i < g.params.size(); ++i) {
    const partition::ParamSlot& slot = g.layout->param(i);
    const size_t begin = static_cast<size_t>(slot.shard_offset_numel);
    const size_t end = begin + static_cast<size_t>(std::max<int64_t>(slot.owned_numel(member), 0));
    const size_t lo = std::max(begin, first), hi = std::min(end, first + numel);
    if (lo >= hi) continue;
    fn(g.params[i], slot.owned_begin(member) + static_cast<int64_t>(lo - begin), lo - first, hi - lo);
  }
}

void ZeroEngine::read_moments(const MomentSinkFn& sink) {
  STRATA_CHECK(finalized(), kBadArgument, "read_moments() before finalize()");
  check_not_prepared("read_moments");
  finish_update();
  check_no_backward("read_moments");
  for (const auto& gp : groups_) {
    const Group& g = *gp;
    if (g.frozen) continue;
    optimizer_->save(static_cast<size_t>(g.shard),
                     [&](size_t first, size_t numel, const float*, const float* m, const float* v) {
                       for_each_param_in(g, first, numel, [&](ParamId id, int64_t from, size_t at, size_t count) {
                         sink(id, from, count, m + at, v + at);
                       });
                     });
  }
}

void ZeroEngine::write_moments(const MomentFillFn& fill, int64_t step_count) {
  STRATA_CHECK(finalized(), kBadArgument, "write_moments() before finalize()");
  STRATA_CHECK(step_count >= 0, kBadArgument, "write_moments: step count {} < 0", step_count);
  check_not_prepared("write_moments");
  finish_update();
  check_no_backward("write_moments");
  for (const auto& gp : groups_) {
    const Group& g = *gp;
    if (g.frozen) continue;
    // The master weights stay: read first (one pass), then the state is
    // rewritten whole, as a checkpoint's load does.
    std::vector<float> master(static_cast<size_t>(g.layout->shard_numel()));
    optimizer_->save(static_cast<size_t>(g.shard), [&](size_t first, size_t numel, const float* p, const float*,
                                                       const float*) { std::copy_n(p, numel, master.data() + first); });
    optimizer_->restore(
        static_cast<size_t>(g.shard),
        [&](size_t first, size_t numel, float* p, float* m, float* v) {
          std::copy_n(master.data() + first, numel, p);
          std::fill_n(m, numel, 0.0f);
          std::fill_n(v, numel, 0.0f);
          for_each_param_in(g, first, numel, [&](ParamId id, int64_t from, size_t at, size_t count) {
            fill(id, from, count, m + at, v + at);
          });
        },
        step_count);
  }
  steps_ = step_count;
}

void ZeroEngine::load_state(const fs::path& dir) {
  STRATA_CHECK(finalized(), kBadArgument, "load_state() before finalize()");
  check_not_prepared("load_state");
  finish_update();
  const fs::path state_path = dir / kStateFile;
  nlohmann::json state;
  {
    std::ifstream in(state_path);
    STRATA_CHECK(in.good(), kIo, "cannot read {}", state_path.string());
    state = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  }
  STRATA_CHECK(state.is_object() && state.value("format", "") == kStateFormat, kBadArgument,
               "{}: not a strata engine state (format \"{}\" expected)", state_path.string(), kStateFormat);
  try {
    STRATA_CHECK(state.at("world_size").get<int>() == world_size(), kBadArgument,
                 "{} was written by a run of {} ranks; this run has {} (resharding a checkpoint is not supported)",
                 state_path.string(), state.at("world_size").get<int>(), world_size());
    STRATA_CHECK(state.at("rank").get<int>() == rank(), kBadArgument, "{} is rank {}'s state, not rank {}'s",
                 state_path.string(), state.at("rank").get<int>(), rank());
    const int saved_ep = state.value("expert_parallel_size", 1);
    STRATA_CHECK(saved_ep == options_.expert_parallel_size, kBadArgument,
                 "{} was written with moe.expert_parallel_size {}; this run has {} (resharding experts is not "
                 "supported)",
                 state_path.string(), saved_ep, options_.expert_parallel_size);
    const int saved_tp = state.value("tensor_parallel_size", 1), saved_tp_rank = state.value("tensor_rank", 0);
    STRATA_CHECK(saved_tp == tensor_group().size && saved_tp_rank == tensor_group().rank, kBadArgument,
                 "{} was written by tp rank {} of {}; this is tp rank {} of {} (resharding tensor parallelism is not "
                 "supported)",
                 state_path.string(), saved_tp_rank, saved_tp, tensor_group().rank, tensor_group().size);
    const auto& groups = state.at("groups");
    // Frozen parameters form groups of their own: a run that freezes others
    // has other groups, which is worth saying.
    bool any_frozen = std::any_of(groups_.begin(), groups_.end(), [](const auto& g) { return g->frozen; });
    for (const auto& saved : groups) any_frozen = any_frozen || saved.value("frozen", false);
    const char* hint = any_frozen ? " (or the run freezes other parameters than the one that saved it: --freeze)" : "";
    STRATA_CHECK(groups.size() == groups_.size(), kBadArgument, "{}: {} parameter groups, this model has {}{}",
                 state_path.string(), groups.size(), groups_.size(), hint);
    for (size_t i = 0; i < groups_.size(); ++i) {
      const Group& g = *groups_[i];
      const auto& saved = groups[i];
      STRATA_CHECK(saved.at("dtype").get<std::string>() == dtype_name(g.dtype) &&
                       saved.value("experts", false) == g.expert && saved.value("tp_split", false) == g.tp_split &&
                       saved.value("tp_counted", true) == g.tp_counted &&
                       saved.at("params").get<size_t>() == g.params.size() &&
                       saved.at("shard_numel").get<int64_t>() == g.layout->shard_numel(),
                   kBadArgument,
                   "{}: group {} is {} parameters of {} ({} elements per rank); this model's is {} of {} ({}): "
                   "the checkpoint is of another model{}",
                   state_path.string(), i, saved.at("params").get<size_t>(), saved.at("dtype").get<std::string>(),
                   saved.at("shard_numel").get<int64_t>(), g.params.size(), dtype_name(g.dtype),
                   g.layout->shard_numel(), hint);
      const bool frozen = saved.value("frozen", false);
      STRATA_CHECK(frozen == g.frozen, kBadArgument,
                   "{}: group {} ({} parameters from '{}') is {} in the checkpoint and {} in this run: the run "
                   "freezes other parameters than the one that saved it (--freeze)",
                   state_path.string(), i, g.params.size(), param_info(g.params.front()).name,
                   frozen ? "frozen" : "trained", g.frozen ? "frozen" : "trained");
      STRATA_CHECK(frozen || saved.value("params_saved", true), kBadArgument,
                   "{}: group {} is trained but its parameters were not saved", state_path.string(), i);
    }
  } catch (const nlohmann::json::exception& e) {
    raise(ErrorCategory::kBadArgument, "{}: a field is missing or of the wrong type ({})", state_path.string(),
          e.what());
  }
  const int64_t steps = state["steps"].get<int64_t>();
  LossScaler::State scaler;
  scaler.scale = state["loss_scaler"]["scale"].get<double>();
  scaler.iteration = state["loss_scaler"]["iteration"].get<int64_t>();
  scaler.last_overflow_iteration = state["loss_scaler"]["last_overflow_iteration"].get<int64_t>();
  scaler.hysteresis_left = state["loss_scaler"]["hysteresis_left"].get<int>();

  compute_stream().synchronize();
  gather_stream_->synchronize();
  if (coordinator_) coordinator_->quiesce();  // no read of a home stays in flight or staged
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = *groups_[gi];
    // A frozen group the state omitted keeps what the caller loaded.
    if (!state["groups"][gi].value("params_saved", true)) continue;
    const size_t shard_numel = static_cast<size_t>(g.layout->shard_numel());
    const fs::path params = dir / params_file(g);
    const fs::path master = dir / optimizer_file("master", g), exp_avg = dir / optimizer_file("exp_avg", g),
                   exp_avg_sq = dir / optimizer_file("exp_avg_sq", g);
    expect_size(params, g.layout->shard_nbytes());
    if (!g.frozen) {
      for (const auto& f : {master, exp_avg, exp_avg_sq}) expect_size(f, shard_numel * sizeof(float));
    }
    g.home->for_each_chunk([&](size_t first, size_t numel) {
      const size_t element_nbytes = dtype_nbytes(g.dtype);
      read_state_range(params, first * element_nbytes, g.home->host_range(first, numel, /*load=*/false),
                       numel * element_nbytes);
      g.home->store_host_range(first, numel);
    });
    const auto fill = [&](size_t first, size_t numel, float* p, float* m, float* v) {
      read_state_range(master, first * sizeof(float), p, numel * sizeof(float));
      read_state_range(exp_avg, first * sizeof(float), m, numel * sizeof(float));
      read_state_range(exp_avg_sq, first * sizeof(float), v, numel * sizeof(float));
    };
    if (!g.frozen) optimizer_->restore(static_cast<size_t>(g.shard), fill, steps);
  }
  steps_ = steps;
  loss_scaler_.restore(scaler);
  // Copies of the old values are stale (stages 1/2 re-gather at the next pre_op).
  if (coordinator_) {
    coordinator_->release_all();
  } else {
    full_params_stale_ = true;
  }
  zero_grad();
}

}  // namespace strata::engine
