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

StateFileWriter::StateFileWriter(const std::filesystem::path& dir, std::string name) : file_(dir / name) {
  state_.name = std::move(name);
  state_.crc32 = static_cast<uint32_t>(::crc32(0L, Z_NULL, 0));
}

void StateFileWriter::append(const void* data, size_t nbytes) {
  file_.append(data, nbytes);
  state_.crc32 = crc_update(state_.crc32, data, nbytes);
  state_.nbytes += nbytes;
}

StateFile StateFileWriter::finish() {
  file_.commit();
  return state_;
}

uint32_t crc32_of(const void* data, size_t nbytes) {
  return crc_update(static_cast<uint32_t>(::crc32(0L, Z_NULL, 0)), data, nbytes);
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

}  // namespace strata::engine
