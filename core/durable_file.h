// Files that appear whole or not at all (LevelDB's contract for its MANIFEST
// and table files): the bytes go to a unique temporary file beside the target
// (<name>.tmp.XXXXXX); commit() fsyncs it, renames it over the target and
// fsyncs the directory. A crash of the process or of the machine at any moment
// leaves under the target's name either what was there before (or nothing) or
// the complete new file, never a mix. Every writer of checkpoints, manifests,
// exports and run files goes through here, so a test can fail any of their
// writes (set_file_faults; nvme::file_faults drives it from the I/O fault
// backend's plan).
//
// Ownership: a DurableFile owns its temporary file and removes it unless
// committed. Thread-safety: write_at() may be called from several threads for
// disjoint ranges; everything else from one thread. Errors: Error(kIo) naming
// the target file, the operation, the errno text and number (a full disk is
// "No space left on device (errno 28)"); a short write that makes no progress
// is an error, not a loop.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string_view>

namespace strata {

class DurableFile {
 public:
  // Creates the temporary file beside `path` (mode 0644 once committed).
  explicit DurableFile(std::filesystem::path path);
  ~DurableFile();  // not committed: the temporary file is removed
  DurableFile(const DurableFile&) = delete;
  DurableFile& operator=(const DurableFile&) = delete;

  // Writes at the end of what append() wrote so far.
  void append(const void* data, size_t nbytes);
  void append(std::string_view text) { append(text.data(), text.size()); }
  // Writes at `offset` (pieces in any order; see thread-safety above).
  void write_at(uint64_t offset, const void* data, size_t nbytes);
  // Reserves nbytes of disk (posix_fallocate) so a full disk fails now,
  // before the data work; a filesystem without fallocate is not an error.
  void reserve(uint64_t nbytes);
  // fsync, close, rename over the target, fsync of the directory. After an
  // error, renamed() says whether the new file is already visible under the
  // target's name (the directory's fsync failed), for a caller that must
  // know which version the disk may hold.
  void commit();
  bool renamed() const { return renamed_; }

  const std::filesystem::path& path() const { return path_; }
  uint64_t appended_nbytes() const { return appended_; }

 private:
  std::filesystem::path path_, tmp_;
  int fd_ = -1;
  uint64_t appended_ = 0;
  bool renamed_ = false;
};

// `contents` as `path`, durably (a DurableFile written and committed).
void write_file_durably(const std::filesystem::path& path, std::string_view contents);
// rename(2), then fsync of the target's directory (and the source's, when it
// differs), so the new name survives a crash. Error(kIo) naming both paths.
void rename_durably(const std::filesystem::path& from, const std::filesystem::path& to);
// fsync of a directory, so the names in it (created, renamed, removed) are durable.
void sync_directory(const std::filesystem::path& dir);

// Fault injection, for tests: before each write, fsync and rename of a durable
// file the installed FileFaults decides its fate. Process-wide.
enum class FileOp { kWrite, kSync, kRename };
class FileFaults {
 public:
  virtual ~FileFaults() = default;
  // Returns 0 to let the operation run, or the errno it fails with (as if the
  // kernel had returned it). For kWrite it may lower `nbytes` instead: a short
  // write of that many bytes (0: no progress), which the writer must resume.
  virtual int before(FileOp op, const std::filesystem::path& path, size_t& nbytes) = 0;
};
// Installs `faults` (nullptr: none) and returns the previous one.
std::shared_ptr<FileFaults> set_file_faults(std::shared_ptr<FileFaults> faults);

}  // namespace strata
