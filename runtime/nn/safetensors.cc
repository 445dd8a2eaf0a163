// safetensors reader (mmap, full header validation) and writer.
#include "runtime/nn/safetensors.h"

#include "runtime/nn/safetensors_stream.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>

#include "runtime/config/json_describe.h"
#include "runtime/config/json_text.h"
#include "core/error.h"

namespace strata::nn {
namespace {

// Headers larger than this are rejected before parsing (the reference
// implementation uses the same order of magnitude).
constexpr uint64_t kMaxHeaderNbytes = 100ull << 20;

// Header strings (tensor names, dtypes) quoted in messages: bounded and
// without raw bytes, however long or odd the file makes them.
std::string quoted(const std::string& text) { return printable_excerpt(text, 200); }

DType parse_st_dtype(const std::string& path, const std::string& name, const std::string& s) {
  if (s == "F32") return DType::kF32;
  if (s == "F16") return DType::kF16;
  if (s == "BF16") return DType::kBF16;
  // The bytes of quantized checkpoints (runtime/nn/checkpoint_quant.h): FP8
  // weights, MXFP4 blocks and scales. Only the quantized reader computes with them.
  if (s == "F8_E4M3") return DType::kF8E4M3;
  if (s == "U8" || s == "F8_E8M0") return DType::kU8;  // F8_E8M0: exponent bytes (SafetensorsEntry::e8m0)
  raise(ErrorCategory::kBadArgument,
        "{}: tensor '{}' has dtype '{}'; supported: F32, F16, BF16, F8_E4M3, F8_E8M0, U8",
        path, quoted(name), quoted(s));
}

uint64_t read_le64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

}  // namespace

std::string_view safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kI32:
      return "I32";
    case DType::kF64:
      return "F64";
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kU8:
      return "U8";
  }
  return "?";
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) raise_errno(errno, "open safetensors file " + path);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    raise_errno(err, "stat " + path);
  }
  const auto file_nbytes = static_cast<size_t>(st.st_size);
  if (file_nbytes < 8) {
    ::close(fd);
    raise(ErrorCategory::kBadArgument, "{}: {} bytes is too short for a safetensors header", path,
          file_nbytes);
  }
  void* map = ::mmap(nullptr, file_nbytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file referenced
  if (map == MAP_FAILED) raise_errno(map_err, "mmap " + path);
  f.map_ = map;
  f.map_nbytes_ = file_nbytes;  // from here on, f's destructor unmaps on error

  const auto* base = static_cast<const std::byte*>(map);
  const uint64_t header_nbytes = read_le64(base);
  STRATA_CHECK(header_nbytes <= kMaxHeaderNbytes && header_nbytes <= file_nbytes - 8, kBadArgument,
               "{}: header length {} at offset 0 exceeds the file ({} bytes) or the {} byte limit",
               path, header_nbytes, file_nbytes, kMaxHeaderNbytes);
  const char* header = reinterpret_cast<const char*>(base + 8);
  // The format nests 3 levels (header, tensor, shape); the strict parser
  // bounds nesting and reports keys given twice instead of keeping the last.
  JsonTextResult parsed = parse_json_text(std::string_view(header, header_nbytes));
  if (!parsed.ok)
    raise(ErrorCategory::kBadArgument, "{}: header is not valid JSON: {}", path, parsed.error);
  if (!parsed.duplicate_keys.empty()) {
    // A tensor named twice: which data is meant is ambiguous (others' readers keep the last).
    raise(ErrorCategory::kBadArgument,
          "{}: header key '{}' appears more than once ({} repeated key{})", path,
          parsed.duplicate_keys.front(), parsed.duplicate_key_count,
          parsed.duplicate_key_count == 1 ? "" : "s");
  }
  const nlohmann::json& j = parsed.document;
  STRATA_CHECK(j.is_object(), kBadArgument, "{}: header must be a JSON object", path);
  f.data_ = base + 8 + header_nbytes;
  const size_t data_nbytes = file_nbytes - 8 - header_nbytes;

  for (const auto& [name, value] : j.items()) {
    if (name == "__metadata__") {
      STRATA_CHECK(value.is_object(), kBadArgument, "{}: __metadata__ must be an object", path);
      for (const auto& [k, v] : value.items()) {
        STRATA_CHECK(v.is_string(), kBadArgument, "{}: __metadata__ key '{}' must be a string",
                     path, quoted(k));
        f.metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    STRATA_CHECK(value.is_object() && value.contains("dtype") && value["dtype"].is_string() &&
                     value.contains("shape") && value["shape"].is_array() &&
                     value.contains("data_offsets") && value["data_offsets"].is_array() &&
                     value["data_offsets"].size() == 2,
                 kBadArgument,
                 "{}: tensor '{}' needs \"dtype\" (string), \"shape\" (array) and \"data_offsets\" "
                 "([begin, end]); got {}",
                 path, quoted(name), describe_json(value));
    SafetensorsEntry e;
    e.name = name;
    e.dtype = parse_st_dtype(path, name, value["dtype"].get<std::string>());
    e.e8m0 = value["dtype"] == "F8_E8M0";
    // Shapes are int64 (Shape): every dimension, and the product of the
    // non-zero ones (a 0 elsewhere must not hide [0, 2^63] or [0, 2^40, 2^40]),
    // must fit with room for 8-byte elements, so no later product overflows.
    constexpr uint64_t kMaxNumel = static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / 8;
    uint64_t nonzero_product = 1;
    bool has_zero = false;
    for (const auto& d : value["shape"]) {
      STRATA_CHECK(d.is_number_unsigned(), kBadArgument,
                   "{}: tensor '{}' has a shape entry {} that is not a non-negative integer", path,
                   quoted(name), describe_json(d));
      const uint64_t dim = d.get<uint64_t>();
      STRATA_CHECK(
          dim <= kMaxNumel && (dim == 0 || nonzero_product <= kMaxNumel / dim), kBadArgument,
          "{}: tensor '{}' has shape dimension {}, which with the others exceeds {} elements", path,
          quoted(name), dim, kMaxNumel);
      if (dim == 0) {
        has_zero = true;
      } else {
        nonzero_product *= dim;
      }
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    const uint64_t numel = has_zero ? 0 : nonzero_product;
    const auto& offs = value["data_offsets"];
    STRATA_CHECK(offs[0].is_number_unsigned() && offs[1].is_number_unsigned(), kBadArgument,
                 "{}: tensor '{}' data_offsets {} must be non-negative integers", path,
                 quoted(name), describe_json(offs));
    e.begin = offs[0].get<uint64_t>();
    e.end = offs[1].get<uint64_t>();
    STRATA_CHECK(e.begin <= e.end && e.end <= data_nbytes, kBadArgument,
                 "{}: tensor '{}' data_offsets [{}, {}] out of range (data section is {} bytes)",
                 path, quoted(name), e.begin, e.end, data_nbytes);
    STRATA_CHECK(e.end - e.begin == numel * dtype_nbytes(e.dtype), kBadArgument,
                 "{}: tensor '{}' has {} bytes but shape {} of {} needs {}", path, quoted(name),
                 e.end - e.begin, shape_string(e.shape), dtype_name(e.dtype),
                 numel * dtype_nbytes(e.dtype));
    // Views and conversions read elements through typed pointers; conforming
    // writers pad the header to 8 bytes and order tensors so this holds.
    STRATA_CHECK((8 + header_nbytes + e.begin) % dtype_nbytes(e.dtype) == 0, kBadArgument,
                 "{}: tensor '{}' starts at file offset {}, not a multiple of its {}-byte elements "
                 "(the file was not written by a conforming safetensors writer)",
                 path, quoted(name), 8 + header_nbytes + e.begin, dtype_nbytes(e.dtype));
    f.entries_[name] = std::move(e);
  }
  // Tensors must not overlap (the format also requires no gaps; we only
  // reject what would make two tensors alias).
  std::vector<const SafetensorsEntry*> sorted;
  for (const auto& [n, e] : f.entries_) sorted.push_back(&e);
  // By (begin, end): a zero-sized tensor may share its offset with the next one.
  std::sort(sorted.begin(), sorted.end(), [](const auto* a, const auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  for (size_t i = 1; i < sorted.size(); ++i) {
    STRATA_CHECK(sorted[i]->begin >= sorted[i - 1]->end, kBadArgument,
                 "{}: tensors '{}' [{}, {}] and '{}' [{}, {}] overlap", path,
                 quoted(sorted[i - 1]->name), sorted[i - 1]->begin, sorted[i - 1]->end,
                 quoted(sorted[i]->name), sorted[i]->begin, sorted[i]->end);
  }
  return f;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept {
  *this = std::move(other);
}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_nbytes_ = std::exchange(other.map_nbytes_, 0);
    data_ = std::exchange(other.data_, nullptr);
    entries_ = std::move(other.entries_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  release();
}

void SafetensorsFile::release() {
  if (map_ != nullptr) ::munmap(map_, map_nbytes_);
  map_ = nullptr;
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  STRATA_CHECK(it != entries_.end(), kBadArgument, "{}: no tensor named '{}'", path_, name);
  return it->second;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& [n, e] : entries_) out.push_back(n);
  return out;
}

TensorView SafetensorsFile::view(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  TensorView v;
  v.desc = TensorDesc{e.dtype, e.shape, Tier::kCpu};
  v.data = const_cast<std::byte*>(data_ + e.begin);  // PROT_READ: writes would fault
  return v;
}

void SafetensorsFile::read(const std::string& name, const TensorView& dst,
                           bool allow_convert) const {
  const SafetensorsEntry& e = entry(name);
  STRATA_CHECK(e.shape == dst.desc.shape, kBadArgument, "{}: tensor '{}' has shape {}, expected {}",
               path_, name, shape_string(e.shape), shape_string(dst.desc.shape));
  STRATA_CHECK(allow_convert || e.dtype == dst.desc.dtype, kBadArgument,
               "{}: tensor '{}' has dtype {}, expected {}", path_, name, dtype_name(e.dtype),
               dtype_name(dst.desc.dtype));
  STRATA_CHECK(e.dtype == dst.desc.dtype || is_float_storage(e.dtype), kBadArgument,
               "{}: tensor '{}' is {}, the bytes of a quantized checkpoint (read with its quantization_config, "
               "not converted)",
               path_, name, dtype_name(e.dtype));
  convert(data_ + e.begin, e.dtype, dst.data, dst.desc.dtype, static_cast<size_t>(dst.numel()));
}

void SafetensorsWriter::add(const std::string& name, const TensorView& tensor) {
  STRATA_CHECK(!name.empty() && name != "__metadata__", kBadArgument,
               "safetensors: invalid tensor name '{}'", name);
  STRATA_CHECK(!tensors_.contains(name), kBadArgument, "safetensors: tensor '{}' added twice",
               name);
  Pending p{tensor.desc.dtype, tensor.desc.shape, std::vector<std::byte>(tensor.nbytes())};
  if (tensor.nbytes() > 0) std::memcpy(p.bytes.data(), tensor.data, tensor.nbytes());
  tensors_.emplace(name, std::move(p));
}

void SafetensorsWriter::write(const std::string& path) const {
  // The streaming writer owns the layout (widest dtype first, 8-byte aligned
  // header) and the durable commit (temporary, fsync, rename, fsync of the dir).
  std::vector<SafetensorsDecl> decls;
  for (const auto& [name, t] : tensors_) decls.push_back(SafetensorsDecl{name, t.dtype, t.shape});
  SafetensorsStreamWriter writer(path, decls, metadata_);
  for (const auto& [name, t] : tensors_) writer.write(name, 0, t.bytes.data(), t.bytes.size());
  writer.commit();
}

}  // namespace strata::nn
