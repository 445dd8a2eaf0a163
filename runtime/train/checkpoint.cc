// Checkpoint directories: per-rank engine state, a manifest written last.
#include "runtime/train/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/directory_lock.h"
#include "core/durable_file.h"
#include "core/error.h"
#include "core/log.h"
#include "runtime/engine/state_file.h"

namespace strata::train {
namespace fs = std::filesystem;
namespace {

// /2: the manifest carries the parallel layout and a CRC-32 of itself.
constexpr const char* kFormat = "strata-checkpoint/2";
constexpr const char* kManifest = "manifest.json";
constexpr const char* kRankFiles = "files.json";
constexpr const char* kChecksumKey = "manifest_crc32";

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

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in.good()) raise(ErrorCategory::kIo, "cannot read {}", path.string());
  nlohmann::json value = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) raise(ErrorCategory::kIo, "{} is not valid JSON (truncated or corrupt)", path.string());
  return value;
}

// The CRC-32 of a manifest's canonical text without its own checksum field.
std::string manifest_checksum(nlohmann::json manifest) {
  manifest.erase(kChecksumKey);
  const std::string text = manifest.dump();
  return fmt::format("{:08x}", engine::crc32_of(text.data(), text.size()));
}

// The parallel layout a checkpoint's files are cut for.
nlohmann::json parallel_layout(const engine::ZeroEngine& engine) {
  // With context parallelism ZeRO's ranks are dp x cp (recorded with it only,
  // so checkpoints from before it still match).
  const int context = engine.context_group().size;
  nlohmann::json layout = {{"data_parallel_size", engine.world_size() / context},
                           {"tensor_parallel_size", engine.tensor_group().size},
                           {"expert_parallel_size", 1}};
  if (context > 1) layout["context_parallel_size"] = context;
  // Recorded with a pipeline only, so checkpoints from before it still match.
  const int pipeline = engine.job_size() / (engine.world_size() * engine.tensor_group().size);
  if (pipeline > 1) layout["pipeline_parallel_size"] = pipeline;
  return layout;
}

// A manifest read and checked: its format, its checksum, the type and range
// of every field a resume uses. Error(kIo) naming the file and what is wrong
// when it is damaged or edited (the checkpoint is then skipped like one with
// a damaged shard).
nlohmann::json read_manifest(const fs::path& path) {
  nlohmann::json manifest = read_json(path);
  if (!manifest.is_object()) raise(ErrorCategory::kIo, "{}: not a strata checkpoint manifest", path.string());
  const std::string format = manifest.value("format", "");
  if (format == "strata-checkpoint/1") {
    raise(ErrorCategory::kIo,
          "{} was written by an older strata (format strata-checkpoint/1, without a checksum or the parallel layout); "
          "this strata reads {}: resume it with the strata that wrote it, or start from its export",
          path.string(), kFormat);
  }
  if (format != kFormat) raise(ErrorCategory::kIo, "{}: not a strata checkpoint manifest", path.string());
  const auto checksum = manifest.find(kChecksumKey);
  if (checksum == manifest.end() || !checksum->is_string() || *checksum != manifest_checksum(manifest)) {
    raise(ErrorCategory::kIo, "{}: its {} does not match its contents (the manifest was edited or is corrupt)",
          path.string(), kChecksumKey);
  }
  const auto unsigned_field = [&](const char* key) {
    const auto it = manifest.find(key);
    if (it == manifest.end() || !it->is_number_unsigned()) {
      raise(ErrorCategory::kIo, "{}: \"{}\" is {}, not an integer >= 0", path.string(), key,
            it == manifest.end() ? "missing" : it->dump());
    }
  };
  unsigned_field("step");
  unsigned_field("engine_steps");
  unsigned_field("data_cursor");
  unsigned_field("world_size");
  if (manifest["world_size"].get<uint64_t>() < 1 || manifest["world_size"].get<uint64_t>() > (1u << 30)) {
    raise(ErrorCategory::kIo, "{}: world_size {} is not a number of ranks", path.string(),
          manifest["world_size"].dump());
  }
  if (manifest["step"].get<uint64_t>() > (uint64_t{1} << 62)) {
    raise(ErrorCategory::kIo, "{}: step {} is out of range", path.string(), manifest["step"].dump());
  }
  if (!manifest.contains("ranks") || !manifest["ranks"].is_array() || !manifest.contains("layout") ||
      !manifest["layout"].is_object()) {
    raise(ErrorCategory::kIo, "{}: \"ranks\" or \"layout\" is missing", path.string());
  }
  return manifest;
}

TrainerState trainer_state_of(const nlohmann::json& manifest) {
  TrainerState state;
  state.step = static_cast<int64_t>(manifest.at("step").get<uint64_t>());
  state.data_cursor = manifest.at("data_cursor").get<uint64_t>();
  state.model = manifest.value("model", nlohmann::json());
  if (manifest.contains("model_files")) {
    state.model_files = manifest.at("model_files").get<std::map<std::string, std::string>>();
  }
  return state;
}

// "the model's num_attention_heads", "the parameter dtype (...)": a key of
// TrainerState::model in the user's terms.
std::string describe_model_key(const std::string& path) {
  if (path.rfind("config.", 0) == 0) return fmt::format("the model's {} (config.json)", path.substr(7));
  if (path == "dtype") return "the parameter dtype (bf16 / fp16 of the ds_config)";
  if (path == "expert_parallel_size") return "moe.expert_parallel_size (absent: 1)";
  return path;
}

void collect_differences(const nlohmann::json& saved, const nlohmann::json& wanted, const std::string& path,
                         std::vector<std::string>& out) {
  if (saved.is_object() && wanted.is_object()) {
    std::vector<std::string> keys;
    for (const auto& [key, value] : saved.items()) keys.push_back(key);
    for (const auto& [key, value] : wanted.items()) {
      if (!saved.contains(key)) keys.push_back(key);
    }
    for (const std::string& key : keys) {
      const std::string child = path.empty() ? key : path + "." + key;
      const nlohmann::json absent;
      collect_differences(saved.contains(key) ? saved[key] : absent, wanted.contains(key) ? wanted[key] : absent,
                          child, out);
    }
    return;
  }
  if (saved == wanted) return;
  out.push_back(fmt::format("{} is {} in the checkpoint, {} in this run", describe_model_key(path),
                            saved.is_null() ? "absent" : saved.dump(), wanted.is_null() ? "absent" : wanted.dump()));
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

// A barrier over every rank of the job (the tp groups too).
void barrier(engine::ZeroEngine& engine) { engine.job_sum(0); }

}  // namespace

Checkpoints::Checkpoints(fs::path root, int keep) : root_(std::move(root)), keep_(keep) {
  STRATA_CHECK(keep >= 1, kBadArgument, "--keep-checkpoints must be >= 1, got {}", keep);
}

std::vector<std::string> model_differences(const nlohmann::json& saved, const nlohmann::json& wanted) {
  std::vector<std::string> out;
  collect_differences(saved, wanted, "", out);
  return out;
}

fs::path Checkpoints::save(engine::ZeroEngine& engine, const TrainerState& trainer) {
  const int rank = engine.job_rank(), world = engine.job_size();
  const fs::path dir = root_ / fmt::format("step_{:08}", trainer.step);
  // Each rank's hold on the root for the save (a run may hold it already:
  // shared); any rank that cannot take it fails the save on every rank.
  std::shared_ptr<DirectoryLock> lock;
  std::string problem;
  try {
    std::error_code ec;
    fs::create_directories(root_, ec);
    if (ec) raise(ErrorCategory::kIo, "cannot create the checkpoint directory {}: {}", root_.string(), ec.message());
    lock = DirectoryLock::acquire(root_, rank_lock_file_name(rank), "checkpoint directory");
  } catch (const Error& e) {
    problem = e.message();
  }
  if (engine.job_sum(problem.empty() ? 0.0 : 1.0) > 0) {
    raise(ErrorCategory::kBadArgument, "{}",
          problem.empty() ? fmt::format("another rank cannot use the checkpoint directory {} (its log says why)",
                                        root_.string())
                          : problem);
  }
  if (rank == 0) {
    std::error_code ec;
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
  write_file_durably(rank_dir / kRankFiles, files_json(engine.save_state(rank_dir, frozen_)).dump(1) + "\n");
  sync_directory(rank_dir);
  barrier(engine);  // every rank's files are durable
  if (rank == 0) {
    nlohmann::json ranks = nlohmann::json::array();
    for (int r = 0; r < world; ++r) {
      ranks.push_back({{"dir", rank_dir_name(r)}, {"files", read_json(dir / rank_dir_name(r) / kRankFiles)}});
    }
    nlohmann::json manifest = {{"format", kFormat},
                               {"step", static_cast<uint64_t>(trainer.step)},
                               {"engine_steps", static_cast<uint64_t>(engine.step_count())},
                               {"data_cursor", trainer.data_cursor},
                               {"world_size", static_cast<uint64_t>(world)},
                               {"layout", parallel_layout(engine)},
                               {"model", trainer.model},
                               {"ranks", ranks}};
    if (!trainer.model_files.empty()) manifest["model_files"] = trainer.model_files;
    manifest[kChecksumKey] = manifest_checksum(manifest);
    // Written last and atomically: until its rename the checkpoint does not exist.
    write_file_durably(dir / kManifest, manifest.dump(1) + "\n");
    sync_directory(root_);
    // Keep the newest `keep_` checkpoints; remove older ones and leftovers without a manifest.
    int complete = 0;
    for (const auto& [step, path] : step_dirs(root_)) {
      const bool has_manifest = fs::exists(path / kManifest);
      if (has_manifest && ++complete <= keep_) continue;
      if (step == trainer.step || (has_manifest && kept_step_ == step)) continue;
      fs::remove_all(path, ec);
      if (ec) logger().warn("could not remove the old checkpoint {}: {}", path.string(), ec.message());
    }
  }
  // Released before the last barrier: once save returns on any rank, no
  // rank's lock file is left in the root (a copy of it taken then is clean).
  lock.reset();
  barrier(engine);
  return dir;
}

std::optional<TrainerState> Checkpoints::find_and_load(engine::ZeroEngine& engine,
                                                       std::optional<int64_t> only_step,
                                                       std::vector<std::string>* rejected) {
  const int rank = engine.job_rank(), world = engine.job_size();
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
      manifest = read_manifest(manifest_path);
      const int saved_world = manifest.at("world_size").get<int>();
      if (saved_world != world) {
        raise(ErrorCategory::kBadArgument,
              "{} was written by a run of {} ranks; this run has {} (resharding a checkpoint is not supported: "
              "resume with -n {})",
              manifest_path.string(), saved_world, world, saved_world);
      }
      const std::vector<std::string> layout = model_differences(manifest.at("layout"), parallel_layout(engine));
      if (!layout.empty()) {
        std::string all;
        for (const std::string& line : layout) all += (all.empty() ? "" : "; ") + line;
        raise(ErrorCategory::kBadArgument, "{} is cut for another parallel layout: {}", manifest_path.string(), all);
      }
      if (!expected_model_.is_null()) {
        const std::vector<std::string> model = model_differences(manifest.value("model", nlohmann::json()),
                                                                 expected_model_);
        if (!model.empty()) {
          std::string all;
          for (const std::string& line : model) all += (all.empty() ? "" : "; ") + line;
          raise(ErrorCategory::kBadArgument,
                "{} is a checkpoint of another model: {}. Resume with the model and ds_config it was trained with",
                manifest_path.string(), all);
        }
      }
    } catch (const Error& e) {
      if (e.category() == ErrorCategory::kBadArgument) throw;
      why = e.message();
    } catch (const std::exception& e) {
      why = fmt::format("{}: {}", manifest_path.string(), e.what());
    }
    if (why.empty()) why = check_rank_files(dir, manifest, rank);
    // Every rank must take the same checkpoint: any rank's problem rejects it for all.
    const double bad = engine.job_sum(why.empty() ? 0.0 : 1.0);
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
    const TrainerState state = trainer_state_of(manifest);
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
    nlohmann::json manifest;
    try {
      manifest = read_manifest(dir / kManifest);
    } catch (const Error& e) {
      raise(ErrorCategory::kBadArgument, "{}", e.message());
    }
    CheckpointInfo info;
    info.dir = dir;
    info.world_size = manifest.at("world_size").get<int>();
    info.state = trainer_state_of(manifest);
    return info;
  }
  raise(ErrorCategory::kBadArgument, "{}: no checkpoint (no step_<N>/manifest.json)", root.string());
}

}  // namespace strata::train
