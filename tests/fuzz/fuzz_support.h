// Helpers shared by the libFuzzer harnesses: an input as a file (the readers
// under test take paths), and the properties every error message must keep
// whatever the input: bounded, and free of raw control bytes.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

namespace strata::fuzz {

// Stops the run with a message; libFuzzer saves the input that got here.
[[noreturn]] inline void fail(const char* what, std::string_view detail) {
  std::fprintf(stderr, "fuzz property violated: %s\n%.*s\n", what,
               static_cast<int>(std::min<size_t>(detail.size(), 4000)), detail.data());
  std::abort();
}

// The input as a file in memory (memfd), opened again through /proc/self/fd,
// so each run costs no disk I/O and leaves nothing behind.
class MemoryFile {
 public:
  MemoryFile(const uint8_t* data, size_t size) {
    fd_ = memfd_create("strata-fuzz", MFD_CLOEXEC);
    if (fd_ < 0) fail("memfd_create", "");
    size_t done = 0;
    while (done < size) {
      const ssize_t n = ::write(fd_, data + done, size - done);
      if (n <= 0) fail("write to memfd", "");
      done += static_cast<size_t>(n);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemoryFile() { ::close(fd_); }
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

// An error message quotes its input bounded (a few lines of text, not the
// file) and escaped (no raw control bytes to corrupt a terminal or a log).
inline void check_message(std::string_view message, size_t max_bytes = 8192) {
  if (message.size() > max_bytes) fail("error message longer than its bound", message);
  for (char c : message) {
    const auto byte = static_cast<unsigned char>(c);
    if ((byte < 0x20 && c != '\n') || byte == 0x7f)
      fail("raw control byte in an error message", message);
  }
}

}  // namespace strata::fuzz
