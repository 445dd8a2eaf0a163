// An export directory written whole or not at all, so it never holds weights
// of two exports (a re-export as shards beside an older model.safetensors, or
// the reverse, would otherwise leave a stale file that a loader picks up).
//
// The export's files are written into a staging directory beside the target
// (.<name>.strata-export-<pid>); commit() carries over the target's files that
// are not model weights and that the export does not write (a README, a
// tokenizer: hard links, so nothing is copied), then swaps the staging
// directory and the target in one atomic rename (renameat2 RENAME_EXCHANGE),
// fsyncs the parent directory and removes the old contents. A crash before the
// swap leaves the old export untouched (and a staging directory, removed by
// the next export into the same target); after it, the new export whole. A
// target that cannot be renamed (a mount point, a filesystem without
// RENAME_EXCHANGE) is updated in place instead: the old weight files are
// removed and the new ones moved in, each durably.
//
// Ownership: owns the staging directory, removed unless committed.
// Thread-safety: one thread. Errors: Error(kBadArgument) when the target
// exists and is not a directory; Error(kIo) naming the path and the errno.
#pragma once

#include <filesystem>
#include <string>

namespace strata::train {

class ExportStaging {
 public:
  explicit ExportStaging(std::filesystem::path target);
  ~ExportStaging();
  ExportStaging(const ExportStaging&) = delete;
  ExportStaging& operator=(const ExportStaging&) = delete;

  // Where the export writes its files.
  const std::filesystem::path& dir() const { return staging_; }
  const std::filesystem::path& target() const { return target_; }
  // Makes the staged files the target's contents (see above).
  void commit();

 private:
  std::filesystem::path target_, staging_;
  bool committed_ = false;
};

// Whether `name` is a file of a model's weights or their index (any
// *.safetensors, a safetensors or PyTorch index, pytorch_model*.bin): what an
// export replaces rather than carries over.
bool is_weight_file_name(const std::string& name);

}  // namespace strata::train
