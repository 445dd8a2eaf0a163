// File: open with O_DIRECT (buffered fallback), size, preallocation, sync.
#include "nvme/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "nvme/io_options.h"
#include "core/error.h"
#include "core/log.h"

namespace strata::nvme {

File File::open(const std::string& path, OpenMode mode, bool direct) {
  int flags = O_CLOEXEC;
  switch (mode) {
    case OpenMode::kRead: flags |= O_RDONLY; break;
    case OpenMode::kReadWrite: flags |= O_RDWR | O_CREAT; break;
    case OpenMode::kTruncate: flags |= O_RDWR | O_CREAT | O_TRUNC; break;
  }
  if (direct) {
    int fd = ::open(path.c_str(), flags | O_DIRECT, 0644);
    if (fd >= 0) return File(fd, path, true);
    // EINVAL: the filesystem does not support O_DIRECT (tmpfs before 6.6, some
    // FUSE mounts). Anything else is a real error, reported below.
    if (errno != EINVAL) raise_errno(errno, fmt::format("open {} with O_DIRECT", path));
    warn_once("nvme-odirect-fallback",
              fmt::format("the filesystem of {} refuses O_DIRECT; using buffered I/O (page "
                          "cache) for such files",
                          path));
  }
  int fd = ::open(path.c_str(), flags, 0644);
  if (fd < 0) raise_errno(errno, fmt::format("open {}", path));
  return File(fd, path, false);
}

File::~File() { close(); }

File::File(File&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)), direct_(other.direct_) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    direct_ = other.direct_;
  }
  return *this;
}

size_t File::alignment() const { return direct_ ? kDirectIoAlignment : 1; }

uint64_t File::size_nbytes() const {
  struct stat st {};
  check_errno(::fstat(fd_, &st), fmt::format("fstat {}", path_));
  return static_cast<uint64_t>(st.st_size);
}

void File::allocate(uint64_t nbytes) {
  if (nbytes == 0) return;
  int rc;
  do {
    rc = ::fallocate(fd_, 0, 0, static_cast<off_t>(nbytes));
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return;
  if (errno == EOPNOTSUPP) {
    warn_once("nvme-fallocate-fallback",
              fmt::format("fallocate is not supported for {}; extending with ftruncate "
                          "(space is not reserved up front)",
                          path_));
    if (size_nbytes() < nbytes) truncate(nbytes);
    return;
  }
  raise_errno(errno, fmt::format("fallocate {} to {} bytes", path_, nbytes));
}

void File::truncate(uint64_t nbytes) {
  check_errno(::ftruncate(fd_, static_cast<off_t>(nbytes)),
              fmt::format("ftruncate {} to {} bytes", path_, nbytes));
}

void File::sync() { check_errno(::fdatasync(fd_), fmt::format("fdatasync {}", path_)); }

void File::close() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

}  // namespace strata::nvme
