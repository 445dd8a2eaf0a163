// A data file mapped read-only, shared by the token and prepared-data readers.
#pragma once

#include <cstddef>
#include <string>
#include <utility>

namespace strata::data {

// Owns a read-only MAP_PRIVATE mapping of a whole file; unmapped when
// destroyed. Move-only: a move keeps the address, so pointers into the bytes
// stay valid in the object moved to.
class MappedFile {
 public:
  MappedFile() = default;
  // Maps `path`. `what` names the file in messages ("token file").
  // Error(kIo) with the errno text when it cannot be opened, stat'ed or
  // mapped; Error(kBadArgument) when it is not a regular file.
  static MappedFile open(const std::string& path, const char* what);
  MappedFile(MappedFile&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), nbytes_(std::exchange(other.nbytes_, 0)) {}
  MappedFile& operator=(MappedFile&& other) noexcept {
    if (this != &other) {
      unmap();
      data_ = std::exchange(other.data_, nullptr);
      nbytes_ = std::exchange(other.nbytes_, 0);
    }
    return *this;
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() { unmap(); }

  // The bytes; nullptr for an empty file.
  const unsigned char* bytes() const { return static_cast<const unsigned char*>(data_); }
  size_t size() const { return nbytes_; }

 private:
  void unmap();
  void* data_ = nullptr;
  size_t nbytes_ = 0;
};

}  // namespace strata::data
