// An open file for the I/O engine: RAII descriptor, its path (for error
// messages) and whether it is opened with O_DIRECT.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace strata::nvme {

enum class OpenMode {
  kRead,       // must exist
  kReadWrite,  // created if missing, never truncated
  kTruncate,   // created if missing, truncated to 0
};

// Owns one file descriptor; movable, not copyable. A File may be used by many
// concurrent requests (pread/pwrite-style I/O does not use the file position).
// Requests that use it must finish before it is destroyed.
class File {
 public:
  // Opens `path`. With direct=true asks for O_DIRECT; a filesystem that refuses
  // O_DIRECT (tmpfs) gets buffered I/O and one warning per process.
  // Throws Error(kIo) with the path and errno text when open fails.
  static File open(const std::string& path, OpenMode mode, bool direct = true);

  File() = default;
  ~File();
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  bool is_open() const { return fd_ >= 0; }
  // True when opened with O_DIRECT (buffer, offset and length must be aligned).
  bool direct() const { return direct_; }
  // kDirectIoAlignment for O_DIRECT files, 1 otherwise.
  size_t alignment() const;

  // Current size in bytes (fstat). Throws Error(kIo).
  uint64_t size_nbytes() const;
  // Preallocates [0, nbytes) with fallocate (keeps existing data; extends the
  // size). Falls back to ftruncate with one warning where fallocate is not
  // supported. Throws Error(kIo) — ENOSPC names the file and the size.
  void allocate(uint64_t nbytes);
  // ftruncate. Throws Error(kIo).
  void truncate(uint64_t nbytes);
  // fdatasync. Throws Error(kIo).
  void sync();
  void close();

 private:
  File(int fd, std::string path, bool direct) : fd_(fd), path_(std::move(path)), direct_(direct) {}
  int fd_ = -1;
  std::string path_;
  bool direct_ = false;
};

}  // namespace strata::nvme
