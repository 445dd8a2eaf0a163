// Checkpoint files: sequential writes with a CRC-32, fsync, checked reads.
#include "runtime/engine/state_file.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace strata::engine {
namespace {

uint32_t crc_update(uint32_t crc, const void* data, size_t nbytes) {
  const auto* bytes = static_cast<const Bytef*>(data);
  while (nbytes > 0) {  // zlib takes a uInt length
    const uInt chunk = static_cast<uInt>(std::min<size_t>(nbytes, size_t{1} << 30));
    crc = static_cast<uint32_t>(::crc32(crc, bytes, chunk));
    bytes += chunk;
    nbytes -= chunk;
  }
  return crc;
}

}  // namespace

StateFileWriter::StateFileWriter(const std::filesystem::path& dir, std::string name) : path_(dir / name) {
  file_.name = std::move(name);
  file_.crc32 = static_cast<uint32_t>(::crc32(0L, Z_NULL, 0));
  fd_ = ::open(path_.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
  STRATA_CHECK(fd_ >= 0, kIo, "cannot create {}: {}", path_.string(), std::strerror(errno));
}

StateFileWriter::~StateFileWriter() {
  if (fd_ < 0) return;
  ::close(fd_);
  std::error_code ec;
  std::filesystem::remove(path_, ec);  // unfinished: never leave a file that looks whole
}

void StateFileWriter::append(const void* data, size_t nbytes) {
  const char* p = static_cast<const char*>(data);
  size_t left = nbytes;
  while (left > 0) {
    const ssize_t n = ::write(fd_, p, left);
    if (n < 0 && errno == EINTR) continue;
    STRATA_CHECK(n > 0, kIo, "writing {} failed after {} bytes: {}", path_.string(), file_.nbytes + (nbytes - left),
                 n < 0 ? std::strerror(errno) : "no space written (disk full?)");
    p += n;
    left -= static_cast<size_t>(n);
  }
  file_.crc32 = crc_update(file_.crc32, data, nbytes);
  file_.nbytes += nbytes;
}

StateFile StateFileWriter::finish() {
  STRATA_CHECK(::fsync(fd_) == 0, kIo, "fsync of {} failed: {}", path_.string(), std::strerror(errno));
  const int fd = fd_;
  fd_ = -1;
  STRATA_CHECK(::close(fd) == 0, kIo, "closing {} failed: {}", path_.string(), std::strerror(errno));
  return file_;
}

StateFile checksum_file(const std::filesystem::path& dir, const std::string& name) {
  const std::filesystem::path path = dir / name;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  STRATA_CHECK(fd >= 0, kIo, "cannot open {}: {}", path.string(), std::strerror(errno));
  StateFile file{name, 0, static_cast<uint32_t>(::crc32(0L, Z_NULL, 0))};
  std::vector<char> buffer(size_t{8} << 20);
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      raise(ErrorCategory::kIo, "reading {} failed: {}", path.string(), std::strerror(err));
    }
    if (n == 0) break;
    file.crc32 = crc_update(file.crc32, buffer.data(), static_cast<size_t>(n));
    file.nbytes += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return file;
}

void read_state_range(const std::filesystem::path& path, uint64_t offset, void* out, size_t nbytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  STRATA_CHECK(fd >= 0, kIo, "cannot open {}: {}", path.string(), std::strerror(errno));
  char* p = static_cast<char*>(out);
  size_t done = 0;
  while (done < nbytes) {
    const ssize_t n = ::pread(fd, p + done, nbytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      raise(ErrorCategory::kIo, "{}: {} at byte {} ({} of {} bytes read)", path.string(),
            n < 0 ? std::strerror(err) : "the file is shorter than expected", offset + done, done, nbytes);
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

void sync_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  STRATA_CHECK(fd >= 0, kIo, "cannot open directory {}: {}", dir.string(), std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  STRATA_CHECK(rc == 0, kIo, "fsync of directory {} failed: {}", dir.string(), std::strerror(err));
}

}  // namespace strata::engine
