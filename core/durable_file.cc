// DurableFile: temporary beside the target, fsync, rename, fsync of the directory.
#include "core/durable_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "core/error.h"

namespace strata {
namespace fs = std::filesystem;
namespace {

std::mutex& faults_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::shared_ptr<FileFaults>& installed_faults() {
  static auto* faults = new std::shared_ptr<FileFaults>();  // never destroyed: writers may run at exit
  return *faults;
}
std::atomic<bool> faults_installed{false};

// 0, or the errno an installed FileFaults chose for this operation.
int injected(FileOp op, const fs::path& path, size_t& nbytes) {
  if (!faults_installed.load(std::memory_order_acquire)) return 0;
  std::shared_ptr<FileFaults> faults;
  {
    std::lock_guard<std::mutex> lock(faults_mutex());
    faults = installed_faults();
  }
  return faults ? faults->before(op, path, nbytes) : 0;
}
int injected(FileOp op, const fs::path& path) {
  size_t nbytes = 0;
  return injected(op, path, nbytes);
}

[[noreturn]] void fail(int err, const std::string& what) {
  char buffer[256];
  const char* text = strerror_r(err, buffer, sizeof(buffer));
  throw Error(ErrorCategory::kIo, fmt::format("{}: {} (errno {})", what, text, err));
}

fs::path directory_of(const fs::path& path) {
  const fs::path parent = path.parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

}  // namespace

std::shared_ptr<FileFaults> set_file_faults(std::shared_ptr<FileFaults> faults) {
  std::lock_guard<std::mutex> lock(faults_mutex());
  faults_installed.store(faults != nullptr, std::memory_order_release);
  std::swap(installed_faults(), faults);
  return faults;
}

DurableFile::DurableFile(fs::path path) : path_(std::move(path)) {
  std::string tmp = path_.string() + ".tmp.XXXXXX";
  fd_ = ::mkostemp(tmp.data(), O_CLOEXEC);
  if (fd_ < 0) fail(errno, fmt::format("cannot create a temporary file beside {}", path_.string()));
  tmp_ = tmp;
}

DurableFile::~DurableFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!renamed_ && !tmp_.empty()) ::unlink(tmp_.c_str());
}

void DurableFile::write_at(uint64_t offset, const void* data, size_t nbytes) {
  STRATA_CHECK(fd_ >= 0, kInternal, "{}: write after commit", path_.string());
  const char* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < nbytes) {
    size_t chunk = nbytes - done;
    ssize_t n = 0;
    if (const int err = injected(FileOp::kWrite, path_, chunk); err != 0) {
      n = -1;
      errno = err;
    } else {
      n = ::pwrite(fd_, p + done, chunk, static_cast<off_t>(offset + done));
    }
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;  // no progress: a full disk that says nothing
      fail(err, fmt::format("writing {} failed at byte {}", path_.string(), offset + done));
    }
    done += static_cast<size_t>(n);
  }
}

void DurableFile::append(const void* data, size_t nbytes) {
  write_at(appended_, data, nbytes);
  appended_ += nbytes;
}

void DurableFile::reserve(uint64_t nbytes) {
  if (nbytes == 0) return;
  const int rc = ::posix_fallocate(fd_, 0, static_cast<off_t>(nbytes));
  if (rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) {
    fail(rc, fmt::format("reserving {} bytes for {}", nbytes, path_.string()));
  }
}

void DurableFile::commit() {
  STRATA_CHECK(fd_ >= 0 && !renamed_, kInternal, "{}: committed twice", path_.string());
  if (::fchmod(fd_, 0644) != 0) fail(errno, fmt::format("chmod {}", path_.string()));  // mkstemp makes 0600
  int err = injected(FileOp::kSync, path_);
  if (err == 0 && ::fsync(fd_) != 0) err = errno;
  if (err != 0) fail(err, fmt::format("fsync of {} failed", path_.string()));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail(errno, fmt::format("closing {} failed", path_.string()));
  err = injected(FileOp::kRename, path_);
  if (err == 0 && std::rename(tmp_.c_str(), path_.c_str()) != 0) err = errno;
  if (err != 0) fail(err, fmt::format("renaming {} to {} failed", tmp_.string(), path_.string()));
  renamed_ = true;
  sync_directory(directory_of(path_));
}

void write_file_durably(const fs::path& path, std::string_view contents) {
  DurableFile file(path);
  file.append(contents);
  file.commit();
}

void rename_durably(const fs::path& from, const fs::path& to) {
  int err = injected(FileOp::kRename, to);
  if (err == 0 && std::rename(from.c_str(), to.c_str()) != 0) err = errno;
  if (err != 0) fail(err, fmt::format("renaming {} to {} failed", from.string(), to.string()));
  sync_directory(directory_of(to));
  std::error_code ec;
  if (!fs::equivalent(directory_of(from), directory_of(to), ec)) sync_directory(directory_of(from));
}

void sync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail(errno, fmt::format("cannot open the directory {} to make its names durable", dir.string()));
  int err = injected(FileOp::kSync, dir);
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  ::close(fd);
  if (err != 0) fail(err, fmt::format("fsync of the directory {} failed", dir.string()));
}

}  // namespace strata
