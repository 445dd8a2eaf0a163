// Swap space: preallocated files under one directory per (group, rank) with
// stable names, so a checkpoint can refer to them across runs.
//
// A run owns its swap directories: each SwapSpace holds the rank's lock on the
// root (core/directory_lock.h: <root>/strata-rank<rank>.lock, shared by the
// spaces of one rank in one process), so a second run given the same nvme_path
// is refused naming the run that holds it, instead of both writing the same
// files. A missing root is created only when its parent exists.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/directory_lock.h"
#include "nvme/file.h"

namespace strata::nvme {

struct SwapSpaceOptions {
  std::filesystem::path root;  // e.g. the nvme_path of offload_optimizer
  std::string group;           // parameter group / purpose ("optimizer", "param")
  int rank = 0;
  bool direct = true;          // open files with O_DIRECT (falls back on tmpfs)
  bool keep_files = false;     // keep() from the start (strata.keep_swap_files)
};

struct SwapFileSpec {
  std::string key;  // letters, digits, '.', '_', '-'
  uint64_t nbytes = 0;
};

// Owns the directory <root>/<group>/rank<rank>/ and its files <key>.swp.
// Not thread-safe for creation; the Files it returns may be used concurrently
// by I/O requests. Destruction removes the files and the directory unless
// keep() was called (for a checkpoint, or strata.keep_swap_files). Throws
// Error(kIo)/Error(kBadArgument); Error(kBadArgument) naming the holder when
// another run holds the root.
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

  // Leave the files on disk at destruction (they belong to a checkpoint, or
  // strata.keep_swap_files asked for them), and after an interrupt.
  void keep();
  // Closes and removes every file and the rank directory now.
  void remove_all();

  // For a process stopped by a signal (Ctrl-C, SIGTERM), which exits without
  // running destructors: removes every file in the directory of every live
  // SwapSpace of this process that was not kept (the directory is the
  // space's own: its swap files and what its user wrote beside them, such as
  // the optimizer's manifest), then the directory if empty. Files open in
  // other threads are unlinked under them; the process must exit right after.
  // Returns the bytes removed. Thread-safe; never throws.
  static uint64_t remove_live_files_for_exit();

 private:
  SwapSpaceOptions options_;
  std::shared_ptr<DirectoryLock> lock_;  // this rank's hold on options_.root
  std::filesystem::path dir_;
  std::map<std::string, File> files_;
  std::map<std::string, uint64_t> sizes_;
  bool keep_ = false;  // written under the registry's mutex (read by remove_live_files_for_exit)
};

// Bytes available to an unprivileged writer on the filesystem holding `path`.
uint64_t free_space_nbytes(const std::filesystem::path& path);

}  // namespace strata::nvme
