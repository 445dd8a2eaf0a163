// Our own reader and writer of the safetensors format: 8-byte little-endian
// header length N, N bytes of JSON {name: {"dtype", "shape", "data_offsets":
// [begin, end]}, optional "__metadata__": {string: string}}, then the data
// (offsets relative to the end of the header). The reader maps the file
// read-only and validates the whole header on open.
//
// Ownership: SafetensorsFile owns its mapping; views it returns point into it
// and are valid while it lives. Thread-safety: a SafetensorsFile is immutable
// after open and may be read from several threads; SafetensorsWriter is not
// thread-safe. Errors: strata::Error — kIo (open/mmap/write failed, with the
// path and errno text), kBadArgument (a malformed header, offsets out of
// range or overlapping, an unsupported dtype, a shape or dtype mismatch on
// read), always naming the file and, where there is one, the tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace strata::nn {

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  size_t begin = 0, end = 0;  // byte offsets into the data section
  // Stored F8_E8M0 (torch's float8_e8m0fnu: 2^(byte - 127), 0xff NaN; the
  // scale grids transformers' ue8m0 FP8 saves write): read as its exponent
  // bytes, dtype kU8 -- only the quantized reader computes with them.
  bool e8m0 = false;
};

class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  bool contains(const std::string& name) const { return entries_.contains(name); }
  // Throws kBadArgument naming the tensor and the file when absent.
  const SafetensorsEntry& entry(const std::string& name) const;
  std::vector<std::string> names() const;  // sorted
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // A read-only view of the mapped bytes (Tier::kCpu; do not write through it).
  // The file is mapped, not copied: if another process truncates it while it is
  // open, touching a view (or read()) raises SIGBUS; edits in place show through.
  TensorView view(const std::string& name) const;
  // Copies tensor `name` into dst. The shape must equal dst's; the dtype must
  // too unless allow_convert, in which case values are converted.
  void read(const std::string& name, const TensorView& dst, bool allow_convert = false) const;

 private:
  SafetensorsFile() = default;
  void release();

  std::string path_;
  void* map_ = nullptr;
  size_t map_nbytes_ = 0;
  const std::byte* data_ = nullptr;  // start of the data section
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

class SafetensorsWriter {
 public:
  // Records a tensor to write; the bytes are copied now. Throws on a duplicate name.
  void add(const std::string& name, const TensorView& tensor);
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  // Writes `path`: a unique temporary file beside it, fsynced, renamed into
  // place, then the directory fsynced, so a crash (process or OS) never leaves
  // a partial file under the final name. Tensors are laid out widest dtype
  // first, so each starts aligned to its element size. Throws Error(kIo).
  void write(const std::string& path) const;

 private:
  struct Pending {
    DType dtype;
    Shape shape;
    std::vector<std::byte> bytes;
  };
  std::map<std::string, Pending> tensors_;
  std::map<std::string, std::string> metadata_;
};

// "F32", "F16", "BF16", and the quantized checkpoints' "F8_E4M3", "U8" <-> DType
// ("F8_E8M0" is read as kU8 with SafetensorsEntry::e8m0);
// other safetensors dtypes raise kBadArgument.
std::string_view safetensors_dtype_name(DType dtype);

}  // namespace strata::nn
