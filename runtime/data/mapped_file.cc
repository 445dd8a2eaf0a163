#include "runtime/data/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "core/error.h"

namespace strata::data {

MappedFile MappedFile::open(const std::string& path, const char* what) {
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
  MappedFile m;
  const auto nbytes = static_cast<size_t>(st.st_size);
  if (nbytes > 0) {
    void* data = ::mmap(nullptr, nbytes, PROT_READ, MAP_PRIVATE, fd, 0);
    if (data == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      raise_errno(err, fmt::format("mmap {} {}", what, path));
    }
    m.data_ = data;
    m.nbytes_ = nbytes;
  }
  ::close(fd);
  return m;
}

void MappedFile::unmap() {
  if (data_ != nullptr) ::munmap(data_, nbytes_);
  data_ = nullptr;
  nbytes_ = 0;
}

}  // namespace strata::data
