// Checkpoints of the finetune job (docs/DESIGN.md §5.3): a directory per step,
//   ROOT/step_<N>/rank<r>/   each rank's engine state (ZeroEngine::save_state)
//   ROOT/step_<N>/manifest.json   written last, by rank 0
// The manifest names the step, the world size, the data cursor, what the
// checkpoint is of (the model: for finetune every key of its config.json and
// the parameter dtype, i.e. bf16/fp16 of the ds_config; the parallel layout:
// data-, tensor- and expert-parallel sizes) and every rank's files with their
// sizes and CRC-32s, and carries a CRC-32 of itself, so an edited or corrupt
// manifest is detected like a damaged file. It is written durably
// (core/durable_file.h), and the rank directories are fsynced before it, so
// a crash at any instant leaves either no manifest (the directory is ignored
// and removed later) or a complete checkpoint. Resume takes the newest
// checkpoint whose manifest is intact and whose files every rank finds whole;
// a newer one that is damaged is named in a warning and skipped. A checkpoint
// of another model or layout is refused (not skipped), naming the key and
// both values.
//
// A run owns its checkpoint directory: save() holds each rank's lock on the
// root (core/directory_lock.h), so a second run saving into the same
// directory is refused naming the holder (finetune holds it for the whole run).
//
// Collective: every rank calls save() and find_and_load() in the same order
// (they synchronise through the engine's control communicator). The root must
// be on a filesystem every rank sees (one node, or a shared filesystem).
// Errors: Error(kIo) naming the file for a failed write (a full disk
// included: the partial checkpoint has no manifest and never counts);
// Error(kBadArgument) when --resume finds no checkpoint to load, for a
// checkpoint of another model, layout or world size, and when another run
// holds the directory.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "runtime/engine/zero_engine.h"

namespace strata::train {

// What a checkpoint restores beyond the engine's own state.
struct TrainerState {
  int64_t step = 0;          // loop iterations done (attempted optimizer steps)
  uint64_t data_cursor = 0;  // data::Batches::cursor() after them
  nlohmann::json model;      // what the checkpoint is of: {"config": HF config.json, "dtype": "bf16"}
  // The source's tokenizer, template and generation files (model_files.h),
  // kept in the manifest for `strata export`; not compared on resume.
  std::map<std::string, std::string> model_files{};
};

// The newest checkpoint with a manifest under `root` (or `root` itself when it
// is a step directory), read without checking its files: what it is of, for a
// tool that must build the model before it can load (strata export). Error
// naming the directory when there is none.
struct CheckpointInfo {
  std::filesystem::path dir;
  int world_size = 0;
  TrainerState state;
};
CheckpointInfo newest_checkpoint(const std::filesystem::path& root);

class Checkpoints {
 public:
  // `keep`: complete checkpoints kept (older ones removed after a save), >= 1.
  Checkpoints(std::filesystem::path root, int keep);

  const std::filesystem::path& root() const { return root_; }
  // What the run is of (TrainerState::model): find_and_load then refuses a
  // checkpoint whose model differs in any key, naming it and both values.
  // Unset: not compared (the C API compares its own declarations).
  void expect_model(nlohmann::json model) { expected_model_ = std::move(model); }
  // Frozen parameters are left out of every checkpoint saved from now on
  // (ZeroEngine::FrozenState::kOmitted): a LoRA run's base, which the run
  // loads again before resuming, its identity in the model (expect_model).
  void omit_frozen() { frozen_ = engine::ZeroEngine::FrozenState::kOmitted; }
  // Saves the engine's state and `trainer` as step trainer.step; collective.
  // Returns the checkpoint's directory.
  std::filesystem::path save(engine::ZeroEngine& engine, const TrainerState& trainer);
  // Loads the newest complete checkpoint into `engine`; collective. nullopt
  // when the root holds none (the caller decides whether that is an error).
  // only_step: consider that step's checkpoint only. rejected: when not null,
  // receives one line per checkpoint this rank found unusable (each also
  // logged as a warning), naming the file and what is wrong with it, for a
  // caller that reports nullopt as an error (the C API); a checkpoint another
  // rank rejected adds a line saying so. Nothing is loaded into `engine`
  // before a checkpoint has passed every rank's checks.
  // A checkpoint save() never removes, whatever `keep` says (--keep-best's);
  // nullopt: none.
  void keep_also(std::optional<int64_t> step) { kept_step_ = step; }
  std::optional<TrainerState> find_and_load(engine::ZeroEngine& engine,
                                            std::optional<int64_t> only_step = std::nullopt,
                                            std::vector<std::string>* rejected = nullptr);

 private:
  std::filesystem::path root_;
  int keep_;
  nlohmann::json expected_model_;  // null: not compared
  engine::ZeroEngine::FrozenState frozen_ = engine::ZeroEngine::FrozenState::kSaved;
  std::optional<int64_t> kept_step_;
};

// Why a checkpoint of `saved` cannot continue a run of `wanted` (both
// TrainerState::model objects): "num_attention_heads is 4 in the checkpoint,
// 2 in this run", one line per differing key; empty when they are the same.
std::vector<std::string> model_differences(const nlohmann::json& saved, const nlohmann::json& wanted);

}  // namespace strata::train
