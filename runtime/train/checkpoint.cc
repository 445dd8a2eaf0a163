// Checkpoint directories: per-rank engine state, a manifest written last.
#include "runtime/train/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "runtime/engine/state_file.h"

namespace strata::train {
namespace fs = std::filesystem;
namespace {

constexpr const char* kFormat = "strata-checkpoint/1";
constexpr const char* kManifest = "manifest.json";
constexpr const char* kRankFiles = "files.json";

std::string rank_dir_name(int rank) { return "rank" + std::to_string(rank); }

// step_<N> directories under root, newest first.
std::vector<std::pair<int64_t, fs::path>> step_dirs(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> dirs;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return dirs;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || name.rfind("step_", 0) != 0) continue;
    try {
      size_t used = 0;
      const int64_t step = std::stoll(name.substr(5), &used);
      if (used == name.size() - 5 && step >= 0) dirs.emplace_back(step, entry.path());
    } catch (const std::exception&) {
      // Not ours: leave it alone.
    }
  }
  std::sort(dirs.begin(), dirs.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return dirs;
}

nlohmann::json files_json(const std::vector<engine::StateFile>& files) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& f : files) list.push_back({{"name", f.name}, {"nbytes", f.nbytes}, {"crc32", f.crc32}});
  return list;
}

void write_json_durably(const fs::path& dir, const std::string& name, const nlohmann::json& value) {
  const std::string text = value.dump(1) + "\n";
  engine::StateFileWriter out(dir, name);
  out.append(text.data(), text.size());
  out.finish();
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  STRATA_CHECK(in.good(), kIo, "cannot read {}", path.string());
  nlohmann::json value = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  STRATA_CHECK(!value.is_discarded(), kIo, "{} is not valid JSON (truncated or corrupt)", path.string());
  return value;
}

// Why this rank cannot use checkpoint `dir` (empty: it can), given its manifest.
std::string check_rank_files(const fs::path& dir, const nlohmann::json& manifest, int rank) {
  try {
    const auto& files = manifest.at("ranks").at(static_cast<size_t>(rank)).at("files");
    const fs::path rank_dir = dir / rank_dir_name(rank);
    for (const auto& f : files) {
      const std::string name = f.at("name").get<std::string>();
      const engine::StateFile actual = engine::checksum_file(rank_dir, name);
      if (actual.nbytes != f.at("nbytes").get<uint64_t>()) {
        return fmt::format("{} has {} bytes, the manifest says {}", (rank_dir / name).string(), actual.nbytes,
                           f.at("nbytes").get<uint64_t>());
      }
      if (actual.crc32 != f.at("crc32").get<uint32_t>()) {
        return fmt::format("{} has CRC-32 {:08x}, the manifest says {:08x} (corrupt)", (rank_dir / name).string(),
                           actual.crc32, f.at("crc32").get<uint32_t>());
      }
    }
  } catch (const Error& e) {
    return e.message();
  } catch (const std::exception& e) {
    return fmt::format("{}: {}", (dir / kManifest).string(), e.what());
  }
  return {};
}

// A barrier over every rank (the engine's control communicator).
void barrier(engine::ZeroEngine& engine) { engine.global_sum(0); }

}  // namespace

Checkpoints::Checkpoints(fs::path root, int keep) : root_(std::move(root)), keep_(keep) {
  STRATA_CHECK(keep >= 1, kBadArgument, "--keep-checkpoints must be >= 1, got {}", keep);
}

fs::path Checkpoints::save(engine::ZeroEngine& engine, const TrainerState& trainer) {
  const int rank = engine.rank(), world = engine.world_size();
  const fs::path dir = root_ / fmt::format("step_{:08}", trainer.step);
  if (rank == 0) {
    std::error_code ec;
    fs::create_directories(root_, ec);
    STRATA_CHECK(!ec, kIo, "cannot create the checkpoint directory {}: {}", root_.string(), ec.message());
    // A directory of this step is left from a run that did not finish it (a
    // complete one would have been resumed from): replace it.
    fs::remove_all(dir, ec);
    STRATA_CHECK(!ec, kIo, "cannot remove the incomplete checkpoint {}: {}", dir.string(), ec.message());
    fs::create_directory(dir, ec);
    STRATA_CHECK(!ec, kIo, "cannot create {}: {}", dir.string(), ec.message());
  }
  barrier(engine);
  const fs::path rank_dir = dir / rank_dir_name(rank);
  std::error_code ec;
  fs::create_directory(rank_dir, ec);
  STRATA_CHECK(!ec, kIo, "cannot create {}: {}", rank_dir.string(), ec.message());
  write_json_durably(rank_dir, kRankFiles, files_json(engine.save_state(rank_dir)));
  engine::sync_directory(rank_dir);
  barrier(engine);  // every rank's files are durable
  if (rank == 0) {
    nlohmann::json ranks = nlohmann::json::array();
    for (int r = 0; r < world; ++r) {
      ranks.push_back({{"dir", rank_dir_name(r)}, {"files", read_json(dir / rank_dir_name(r) / kRankFiles)}});
    }
    const nlohmann::json manifest = {{"format", kFormat},
                                     {"step", trainer.step},
                                     {"engine_steps", engine.step_count()},
                                     {"data_cursor", trainer.data_cursor},
                                     {"world_size", world},
                                     {"model", trainer.model},
                                     {"ranks", ranks}};
    // Written last and atomically: until the rename the checkpoint does not exist.
    const std::string tmp = std::string(kManifest) + ".tmp";
    write_json_durably(dir, tmp, manifest);
    fs::rename(dir / tmp, dir / kManifest, ec);
    STRATA_CHECK(!ec, kIo, "cannot rename {} to {}: {}", (dir / tmp).string(), kManifest, ec.message());
    engine::sync_directory(dir);
    engine::sync_directory(root_);
    // Keep the newest `keep_` checkpoints; remove older ones and leftovers without a manifest.
    int complete = 0;
    for (const auto& [step, path] : step_dirs(root_)) {
      const bool has_manifest = fs::exists(path / kManifest);
      if (has_manifest && ++complete <= keep_) continue;
      if (step == trainer.step) continue;
      fs::remove_all(path, ec);
      if (ec) logger().warn("could not remove the old checkpoint {}: {}", path.string(), ec.message());
    }
  }
  barrier(engine);
  return dir;
}

std::optional<TrainerState> Checkpoints::find_and_load(engine::ZeroEngine& engine,
                                                       std::optional<int64_t> only_step,
                                                       std::vector<std::string>* rejected) {
  const int rank = engine.rank(), world = engine.world_size();
  for (const auto& [step, dir] : step_dirs(root_)) {
    if (only_step && step != *only_step) continue;
    const fs::path manifest_path = dir / kManifest;
    if (!fs::exists(manifest_path)) {
      if (rank == 0) logger().info("{}: no manifest (a save that did not finish); skipped", dir.string());
      continue;
    }
    std::string why;
    nlohmann::json manifest;
    try {
      manifest = read_json(manifest_path);
      STRATA_CHECK(manifest.value("format", "") == kFormat, kIo, "{}: not a strata checkpoint manifest",
                   manifest_path.string());
      const int saved_world = manifest.at("world_size").get<int>();
      STRATA_CHECK(saved_world == world, kBadArgument,
                   "{} was written by a run of {} ranks; this run has {} (resharding a checkpoint is not supported: "
                   "resume with -n {})",
                   manifest_path.string(), saved_world, world, saved_world);
    } catch (const Error& e) {
      if (e.category() == ErrorCategory::kBadArgument) throw;
      why = e.message();
    } catch (const std::exception& e) {
      why = fmt::format("{}: {}", manifest_path.string(), e.what());
    }
    if (why.empty()) why = check_rank_files(dir, manifest, rank);
    // Every rank must take the same checkpoint: any rank's problem rejects it for all.
    const double bad = engine.global_sum(why.empty() ? 0.0 : 1.0);
    if (bad > 0) {
      if (!why.empty()) {
        logger().warn("checkpoint {} cannot be used: {}{}", dir.string(), why,
                      only_step ? "" : "; trying the previous one");
      }
      if (rejected != nullptr) {
        rejected->push_back(!why.empty() ? why
                                         : fmt::format("{}: another rank found it damaged (its log names the file)",
                                                       dir.string()));
      }
      continue;
    }
    engine.load_state(dir / rank_dir_name(rank));
    TrainerState state;
    state.step = manifest.at("step").get<int64_t>();
    state.data_cursor = manifest.at("data_cursor").get<uint64_t>();
    state.model = manifest.value("model", nlohmann::json());
    if (rank == 0) logger().info("loaded checkpoint {} (step {})", dir.string(), state.step);
    return state;
  }
  return std::nullopt;
}

CheckpointInfo newest_checkpoint(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> candidates;
  if (fs::exists(root / kManifest)) {
    candidates.emplace_back(0, root);
  } else {
    candidates = step_dirs(root);
  }
  for (const auto& [step, dir] : candidates) {
    if (!fs::exists(dir / kManifest)) continue;
    const nlohmann::json manifest = read_json(dir / kManifest);
    STRATA_CHECK(manifest.value("format", "") == kFormat, kBadArgument, "{}: not a strata checkpoint manifest",
                 (dir / kManifest).string());
    CheckpointInfo info;
    info.dir = dir;
    try {
      info.world_size = manifest.at("world_size").get<int>();
      info.state.step = manifest.at("step").get<int64_t>();
      info.state.data_cursor = manifest.at("data_cursor").get<uint64_t>();
      info.state.model = manifest.value("model", nlohmann::json());
    } catch (const nlohmann::json::exception& e) {
      raise(ErrorCategory::kBadArgument, "{}: {}", (dir / kManifest).string(), e.what());
    }
    return info;
  }
  raise(ErrorCategory::kBadArgument, "{}: no checkpoint (no step_<N>/manifest.json)", root.string());
}

}  // namespace strata::train
