// SafetensorsStreamWriter: header first, pieces with pwrite, atomic commit.
#include "runtime/nn/safetensors_stream.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "runtime/nn/safetensors.h"

namespace strata::nn {
namespace {

void pwrite_all(int fd, const void* data, size_t nbytes, size_t offset, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (nbytes > 0) {
    const ssize_t n = ::pwrite(fd, p, nbytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) raise_errno(n < 0 ? errno : EIO, fmt::format("write {} at offset {}", path, offset));
    p += n;
    offset += static_cast<size_t>(n);
    nbytes -= static_cast<size_t>(n);
  }
}

}  // namespace

SafetensorsStreamWriter::SafetensorsStreamWriter(std::string path,
                                                 const std::vector<SafetensorsDecl>& tensors,
                                                 const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)) {
  // Wider elements first (then by name), as the reference writer orders them.
  std::vector<const SafetensorsDecl*> order;
  for (const SafetensorsDecl& t : tensors) {
    STRATA_CHECK(!t.name.empty() && t.name != "__metadata__", kBadArgument,
                 "safetensors: invalid tensor name '{}'", t.name);
    STRATA_CHECK(is_float_storage(t.dtype), kBadArgument, "safetensors: '{}' has dtype {}", t.name,
                 dtype_name(t.dtype));
    order.push_back(&t);
  }
  std::stable_sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    if (dtype_nbytes(a->dtype) != dtype_nbytes(b->dtype))
      return dtype_nbytes(a->dtype) > dtype_nbytes(b->dtype);
    return a->name < b->name;
  });
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const SafetensorsDecl* t : order) {
    const size_t nbytes = static_cast<size_t>(shape_numel(t->shape)) * dtype_nbytes(t->dtype);
    STRATA_CHECK(slots_.emplace(t->name, Slot{offset, nbytes, 0}).second, kBadArgument,
                 "safetensors: tensor '{}' declared twice", t->name);
    header[t->name] = {{"dtype", safetensors_dtype_name(t->dtype)},
                       {"shape", t->shape},
                       {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  const size_t data_start = 8 + text.size();
  for (auto& [name, slot] : slots_) slot.begin += data_start;

  tmp_ = path_ + ".tmp.XXXXXX";
  fd_ = ::mkstemp(tmp_.data());
  if (fd_ < 0) raise_errno(errno, "create a temporary file beside " + path_);
  try {
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
    pwrite_all(fd_, len, 8, 0, tmp_);
    pwrite_all(fd_, text.data(), text.size(), 8, tmp_);
    // Reserve the whole file now: a full disk fails here, before any data work.
    if (offset > 0) {
      const int rc = ::posix_fallocate(fd_, static_cast<off_t>(data_start), static_cast<off_t>(offset));
      if (rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) raise_errno(rc, "reserve space for " + tmp_);
    }
  } catch (...) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
    fd_ = -1;
    throw;
  }
}

SafetensorsStreamWriter::~SafetensorsStreamWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !tmp_.empty()) ::unlink(tmp_.c_str());
}

void SafetensorsStreamWriter::write(const std::string& name, size_t offset, const void* data,
                                    size_t nbytes) {
  size_t file_offset = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    STRATA_CHECK(!committed_ && fd_ >= 0, kBadArgument, "safetensors {}: write after commit", path_);
    auto it = slots_.find(name);
    STRATA_CHECK(it != slots_.end(), kBadArgument, "safetensors {}: tensor '{}' was not declared",
                 path_, name);
    Slot& s = it->second;
    STRATA_CHECK(offset <= s.nbytes && nbytes <= s.nbytes - offset, kBadArgument,
                 "safetensors {}: bytes [{}, {}) of '{}' are outside its {} bytes", path_, offset,
                 offset + nbytes, name, s.nbytes);
    STRATA_CHECK(s.written + nbytes <= s.nbytes, kBadArgument,
                 "safetensors {}: more bytes written to '{}' than it has (overlapping pieces)",
                 path_, name);
    s.written += nbytes;
    file_offset = s.begin + offset;
  }
  pwrite_all(fd_, data, nbytes, file_offset, tmp_);
}

void SafetensorsStreamWriter::commit() {
  STRATA_CHECK(!committed_ && fd_ >= 0, kBadArgument, "safetensors {}: committed twice", path_);
  for (const auto& [name, slot] : slots_) {
    STRATA_CHECK(slot.written == slot.nbytes, kBadArgument,
                 "safetensors {}: tensor '{}' has {} of its {} bytes written", path_, name,
                 slot.written, slot.nbytes);
  }
  if (::fchmod(fd_, 0644) != 0) raise_errno(errno, "chmod " + tmp_);  // mkstemp creates 0600
  if (::fsync(fd_) != 0) raise_errno(errno, "fsync " + tmp_);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) raise_errno(errno, "close " + tmp_);
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) raise_errno(errno, "rename " + tmp_ + " to " + path_);
  committed_ = true;
  const auto parent = std::filesystem::path(path_).parent_path();
  const std::string dir = parent.empty() ? std::string(".") : parent.string();
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0) raise_errno(errno, "open directory " + dir + " to make the rename durable");
  const int rc = ::fsync(dir_fd);
  const int err = errno;
  ::close(dir_fd);
  if (rc != 0) raise_errno(err, "fsync directory " + dir);
}

}  // namespace strata::nn
