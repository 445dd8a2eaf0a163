// What finetune trains and evaluates on: micro-batches of `seq` tokens cut
// from a data file, for one rank.
//
// Two sources, picked by open_batches from --data-format (auto: the file's
// magic number):
//  - a token stream (token_file.h: llm.c, raw u16/u32, text): windows of
//    seq + 1 consecutive tokens (TokenLoader's windows), every target trained;
//  - prepared data (prepared_file.h): whole documents with their loss masks.
//    A document predicts only its own tokens: the target of its position t is
//    its token t + 1 when that token's mask bit is set, else ignored; its last
//    position predicts nothing. Documents longer than seq are cut to seq
//    tokens (counted; the summary says how many). With packing (the default)
//    consecutive documents fill a window of seq positions, next-fit in file
//    order, each with positions 0, 1, 2, ... (Batch::positions): the model
//    then attends within each document only, so a packed window computes
//    what each document alone would. Without packing a window holds one
//    document. The rest of a window is padding: id 0, targets ignored, its
//    own positions. Windows with no trained target are dropped (counted).
//
// Order: training visits every window once per epoch in the keyed
// permutation of sample_order.h; global sample g of a step goes to rank
// (g / micro_batch) % world, so ranks read disjoint samples and the world
// size does not change what a step trains on. The cursor (samples consumed)
// is the whole state to checkpoint. Evaluation reads the windows in file
// order, the same split over ranks; windows past the end are empty rows.
//
// Ownership: owns its file. Thread-safety: none. Errors: Error(kBadArgument)
// naming the file and what is wrong (format, too short, an id >= vocab).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/data/token_file.h"

namespace strata::data {

struct Batch {
  std::vector<int32_t> ids, targets;  // [micro_batch * seq]; targets may be ops' ignore index (-100)
  std::vector<int32_t> positions;     // packed documents' positions; empty: 0..seq-1 per row
};

struct BatchOptions {
  int64_t seq = 0;
  int64_t micro_batch = 1;
  int rank = 0, world = 1;
  uint64_t seed = 0;
  bool packing = true;  // prepared data: several documents per window
};

class Batches {
 public:
  virtual ~Batches() = default;
  // This rank's next training micro-batch; advances past the whole world's.
  void next(Batch& batch);
  // This rank's part of evaluation micro-batch k (file order).
  void eval_batch(int64_t k, Batch& batch) const;
  // Evaluation micro-batches that cover every window once.
  int64_t eval_batches() const;
  // Trained targets of the first `batches` evaluation micro-batches of every
  // rank together: each rank knows the global count without a reduction.
  int64_t eval_targets(int64_t batches) const;
  uint64_t cursor() const { return cursor_; }
  void set_cursor(uint64_t cursor) { cursor_ = cursor; }
  int64_t windows() const { return windows_; }  // samples per epoch
  // Ids a model has but the data must not hold, each with its config.json
  // key (a gemma3 checkpoint's image placeholders: strata cannot fill them).
  using RefusedIds = std::vector<std::pair<std::string, int64_t>>;
  // Every token id below `vocab` and none of `refused`; each rank checks
  // 1/world of the file (before step 1). Refused naming the file and the
  // token's position (and document, prepared data).
  void check_ids(int64_t vocab, const RefusedIds& refused = {}) const { check_ids_in(vocab, refused); }
  // One line for the log: the file, its format, tokens, windows (and documents, cut, dropped).
  virtual std::string describe() const = 0;
  const std::string& path() const { return path_; }

 protected:
  // packed: the batches carry document positions (prepared data).
  Batches(std::string path, BatchOptions options, bool packed)
      : path_(std::move(path)), options_(options), packed_(packed) {}
  virtual void check_ids_in(int64_t vocab, const RefusedIds& refused) const = 0;
  // The error for token `token`, which is refused[k]'s id, at `where` in the file.
  [[noreturn]] void refuse_id(int64_t token, const std::string& where, const RefusedIds& refused) const;
  // Writes window w into sample s of a batch next() or eval_batch() sized.
  virtual void fill(Batch& batch, int64_t s, int64_t w) const = 0;
  // Global sample g of the training order (over epochs) -> window.
  int64_t training_window(uint64_t g) const;
  virtual int64_t targets_of_window(int64_t w) const = 0;

  std::string path_;
  BatchOptions options_;
  bool packed_ = false;
  int64_t windows_ = 0;
  uint64_t cursor_ = 0;
};

// `format`: "auto", "prepared", "llmc", "u16", "u32" or "text" (--data-format).
std::unique_ptr<Batches> open_batches(const std::string& path, const std::string& format, BatchOptions options);

}  // namespace strata::data
