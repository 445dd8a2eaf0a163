// Ownership of a directory by one run: an exclusive flock(2) on a lock file
// inside it, the file holding who holds it (pid, host, start time, command),
// so a second run that would share the directory (NVMe swap files, a
// checkpoint directory) is refused at start with a message naming the holder
// instead of silently corrupting the first run's files.
//
// The lock lives as long as the holding process: flock is released by the
// kernel when the process dies however it dies (kill -9 included). A lock file
// left by a dead process is therefore not locked, and is taken over with a
// warning naming the process that left it. A clean release removes the file.
//
// Within one process a lock is shared: acquiring a file this process already
// holds returns the same lock (several swap spaces of one rank share the
// rank's lock; thread ranks use different files). The lock file is removed
// when the last holder releases it.
//
// Ownership: a DirectoryLock is owned through shared_ptr by whoever needs the
// directory (the run, a SwapSpace); the file is removed when the last owner
// drops it.
// Thread-safety: acquire() and the destructor may be called from any thread.
// Errors: Error(kBadArgument) when another process holds the lock (the
// message names the directory, what it is for, and the holder); Error(kIo)
// when the lock file cannot be created or locked for another reason.
#pragma once

#include <filesystem>
#include <memory>
#include <string>

namespace strata {

class DirectoryLock {
 public:
  // Takes the exclusive lock `dir/file_name`. `what` names the directory in
  // messages, in the user's terms ("nvme_path", "--save"). `dir` must exist.
  static std::shared_ptr<DirectoryLock> acquire(const std::filesystem::path& dir, const std::string& file_name,
                                                const std::string& what);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

  const std::filesystem::path& path() const { return path_; }

 private:
  DirectoryLock(std::filesystem::path path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::filesystem::path path_;
  int fd_ = -1;
};

// For a process stopped by a signal, which exits without running destructors:
// removes the files of every lock this process holds (still holding them, so
// no other run can take a lock before this process is gone). Thread-safe;
// never throws.
void remove_lock_files_for_exit();

// The lock file of rank `rank` in a directory shared by the ranks of one run
// (each rank locks its own file, so a run of N ranks holds N files; every run
// has a rank 0, so two runs always meet on strata-rank0.lock).
std::string rank_lock_file_name(int rank);

// Makes sure `dir` is a directory a run may use: an existing directory is
// taken as it is; a missing one is created (and a line says so) only when its
// parent exists, so a typo in a path cannot create a tree on another disk.
// `what` names the directory in messages ("zero_optimization.offload_param.nvme_path").
// Error(kBadArgument) naming `what` and the path when the parent is missing
// or the path is not a directory; Error(kIo) when creating it fails.
void ensure_run_directory(const std::filesystem::path& dir, const std::string& what);

}  // namespace strata
