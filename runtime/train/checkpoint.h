// Checkpoints of the finetune job (docs/DESIGN.md §5.3): a directory per step,
//   ROOT/step_<N>/rank<r>/   each rank's engine state (ZeroEngine::save_state)
//   ROOT/step_<N>/manifest.json   written last, by rank 0
// The manifest names the step, the world size, the data cursor and every
// rank's files with their sizes and CRC-32s. It is written to a temporary
// name, fsynced and renamed, and the directories are fsynced, so a crash at
// any instant leaves either no manifest (the directory is ignored and removed
// later) or a complete checkpoint. Resume takes the newest checkpoint whose
// manifest parses and whose files every rank finds whole; a newer one that is
// damaged is named in a warning and skipped.
//
// Collective: every rank calls save() and find_and_load() in the same order
// (they synchronise through the engine's control communicator). The root must
// be on a filesystem every rank sees (one node, or a shared filesystem).
// Errors: Error(kIo) naming the file for a failed write (a full disk
// included: the partial checkpoint has no manifest and never counts);
// Error(kBadArgument) when --resume finds no checkpoint to load.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "runtime/engine/zero_engine.h"

namespace strata::train {

// What a checkpoint restores beyond the engine's own state.
struct TrainerState {
  int64_t step = 0;          // loop iterations done (attempted optimizer steps)
  uint64_t data_cursor = 0;  // TokenLoader::cursor() after them
  nlohmann::json model;      // what the checkpoint is of: {"config": HF config.json, "dtype": "bf16"}
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
  std::optional<TrainerState> find_and_load(engine::ZeroEngine& engine,
                                            std::optional<int64_t> only_step = std::nullopt,
                                            std::vector<std::string>* rejected = nullptr);

 private:
  std::filesystem::path root_;
  int keep_;
};

}  // namespace strata::train
