// Files of a checkpoint (docs/DESIGN.md §5.3): written sequentially with a running
// CRC-32 (zlib's) and made durable (fsync) before they count, so a manifest
// written afterwards can name each file's size and checksum, and a reader can
// tell a complete file from a truncated or corrupt one.
//
// Thread-safety: a writer is used by one thread. Errors: Error(kIo) naming the
// file and the operation (full disk included: a short write is an error).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

namespace strata::engine {

// A written file, named relative to its directory.
struct StateFile {
  std::string name;
  uint64_t nbytes = 0;
  uint32_t crc32 = 0;
};

class StateFileWriter {
 public:
  // Creates (truncates) dir/name.
  StateFileWriter(const std::filesystem::path& dir, std::string name);
  ~StateFileWriter();  // an unfinished file is removed
  StateFileWriter(const StateFileWriter&) = delete;
  StateFileWriter& operator=(const StateFileWriter&) = delete;

  void append(const void* data, size_t nbytes);
  // fsyncs and closes; the file is complete.
  StateFile finish();

 private:
  std::filesystem::path path_;
  StateFile file_;
  int fd_ = -1;
};

// Reads the whole file: its size and CRC-32 (Error(kIo) naming it if unreadable).
StateFile checksum_file(const std::filesystem::path& dir, const std::string& name);
// Reads exactly nbytes at offset of dir/name into out (Error(kIo) naming the
// file when it is shorter).
void read_state_range(const std::filesystem::path& path, uint64_t offset, void* out, size_t nbytes);
// fsync of a directory, so the names in it are durable.
void sync_directory(const std::filesystem::path& dir);

}  // namespace strata::engine
