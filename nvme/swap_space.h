// Swap space: preallocated files under one directory per (group, rank) with
// stable names, so a checkpoint can refer to them across runs.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "nvme/file.h"

namespace strata::nvme {

struct SwapSpaceOptions {
  std::filesystem::path root;  // e.g. the nvme_path of offload_optimizer
  std::string group;           // parameter group / purpose ("optimizer", "param")
  int rank = 0;
  bool direct = true;          // open files with O_DIRECT (falls back on tmpfs)
};

struct SwapFileSpec {
  std::string key;  // letters, digits, '.', '_', '-'
  uint64_t nbytes = 0;
};

// Owns the directory <root>/<group>/rank<rank>/ and its files <key>.swp.
// Not thread-safe for creation; the Files it returns may be used concurrently
// by I/O requests. Destruction removes the files and the directory unless
// keep() was called (for a checkpoint). Throws Error(kIo)/Error(kBadArgument).
class SwapSpace {
 public:
  explicit SwapSpace(SwapSpaceOptions options);
  ~SwapSpace();
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  // Checks that the filesystem has room for every file (beyond what existing
  // files already hold), then creates and preallocates them all. Existing
  // files keep their contents. Throws Error(kIo) stating the directory, bytes
  // needed and bytes free when the filesystem is too small.
  void create(const std::vector<SwapFileSpec>& files);
  // Same for one file; returns it.
  File& create(const SwapFileSpec& file);

  // The open file for `key`. Throws Error(kBadArgument) for an unknown key.
  File& file(const std::string& key);
  bool contains(const std::string& key) const { return files_.count(key) != 0; }
  // The stable path of `key`, whether or not it exists.
  std::filesystem::path path_for(const std::string& key) const;
  const std::filesystem::path& directory() const { return dir_; }
  uint64_t total_nbytes() const;

  // Leave the files on disk at destruction (they belong to a checkpoint).
  void keep() { keep_ = true; }
  // Closes and removes every file and the rank directory now.
  void remove_all();

 private:
  SwapSpaceOptions options_;
  std::filesystem::path dir_;
  std::map<std::string, File> files_;
  std::map<std::string, uint64_t> sizes_;
  bool keep_ = false;
};

// Bytes available to an unprivileged writer on the filesystem holding `path`.
uint64_t free_space_nbytes(const std::filesystem::path& path);

}  // namespace strata::nvme
