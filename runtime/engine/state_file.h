// Files of a checkpoint (docs/DESIGN.md §5.3): written sequentially
// with a running CRC-32 (zlib's) through a DurableFile (core/durable_file.h:
// a temporary name, fsync, rename, fsync of the directory), so a manifest
// written afterwards can name each file's size and checksum, a reader can tell
// a complete file from a truncated or corrupt one, and a test can fail any of
// the writes (set_file_faults).
//
// Thread-safety: a writer is used by one thread. Errors: Error(kIo) naming the
// file, the operation and the errno (full disk included: a write that makes no
// progress is an error).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "core/durable_file.h"

namespace strata::engine {

// A written file, named relative to its directory.
struct StateFile {
  std::string name;
  uint64_t nbytes = 0;
  uint32_t crc32 = 0;
};

class StateFileWriter {
 public:
  // Starts dir/name (it appears, replacing any earlier file, at finish()).
  StateFileWriter(const std::filesystem::path& dir, std::string name);
  StateFileWriter(const StateFileWriter&) = delete;
  StateFileWriter& operator=(const StateFileWriter&) = delete;

  void append(const void* data, size_t nbytes);
  // Commits the file durably; it is complete under its name.
  StateFile finish();

 private:
  DurableFile file_;
  StateFile state_;
};

// CRC-32 (zlib's) of nbytes at data.
uint32_t crc32_of(const void* data, size_t nbytes);

// Reads the whole file: its size and CRC-32 (Error(kIo) naming it if unreadable).
StateFile checksum_file(const std::filesystem::path& dir, const std::string& name);
// Reads exactly nbytes at offset of dir/name into out (Error(kIo) naming the
// file when it is shorter).
void read_state_range(const std::filesystem::path& path, uint64_t offset, void* out, size_t nbytes);
// (fsync of a directory: strata::sync_directory, core/durable_file.h.)

}  // namespace strata::engine
