// SafetensorsStreamWriter: header first, pieces with pwrite, atomic commit.
#include "runtime/nn/safetensors_stream.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "runtime/nn/safetensors.h"

namespace strata::nn {

SafetensorsStreamWriter::SafetensorsStreamWriter(std::string path,
                                                 const std::vector<SafetensorsDecl>& tensors,
                                                 const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)) {
  // Wider elements first (then by name), as the reference writer orders them.
  std::vector<const SafetensorsDecl*> order;
  for (const SafetensorsDecl& t : tensors) {
    STRATA_CHECK(!t.name.empty() && t.name != "__metadata__", kBadArgument,
                 "safetensors: invalid tensor name '{}'", t.name);
    // Float storage, and the bytes of quantized checkpoints (carried or written by tests).
    STRATA_CHECK(is_float_storage(t.dtype) || t.dtype == DType::kF8E4M3 || t.dtype == DType::kU8, kBadArgument,
                 "safetensors: '{}' has dtype {}", t.name, dtype_name(t.dtype));
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

  file_ = std::make_unique<DurableFile>(path_);
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  file_->write_at(0, len, 8);
  file_->write_at(8, text.data(), text.size());
  // Reserve the whole file now: a full disk fails here, before any data work.
  file_->reserve(data_start + offset);
}

SafetensorsStreamWriter::~SafetensorsStreamWriter() = default;  // not committed: the DurableFile removes it

void SafetensorsStreamWriter::write(const std::string& name, size_t offset, const void* data,
                                    size_t nbytes) {
  size_t file_offset = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    STRATA_CHECK(!committed_, kBadArgument, "safetensors {}: write after commit", path_);
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
  file_->write_at(file_offset, data, nbytes);
}

void SafetensorsStreamWriter::commit() {
  STRATA_CHECK(!committed_, kBadArgument, "safetensors {}: committed twice", path_);
  for (const auto& [name, slot] : slots_) {
    STRATA_CHECK(slot.written == slot.nbytes, kBadArgument,
                 "safetensors {}: tensor '{}' has {} of its {} bytes written", path_, name,
                 slot.written, slot.nbytes);
  }
  file_->commit();  // fsync, rename, fsync of the directory
  committed_ = true;
}

}  // namespace strata::nn
