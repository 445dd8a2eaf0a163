#include "runtime/data/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "core/error.h"

namespace strata::data {

Mapping map_read_only(const std::string& path, const char* what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) raise_errno(errno, fmt::format("open {} {}", what, path));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    raise_errno(err, fmt::format("stat {} {}", what, path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    raise(ErrorCategory::kBadArgument, "{} {} is not a regular file", what, path);
  }
  Mapping m;
  m.nbytes = static_cast<size_t>(st.st_size);
  if (m.nbytes > 0) {
    m.data = ::mmap(nullptr, m.nbytes, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m.data == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      raise_errno(err, fmt::format("mmap {} {}", what, path));
    }
  }
  ::close(fd);
  return m;
}

}  // namespace strata::data
