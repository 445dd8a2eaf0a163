// Parameters <-> safetensors by Hugging Face name; tiles (Parameter::slice)
// are cut from, and reassembled into, their untiled tensors.
#include "runtime/nn/llama_weights.h"

#include <cstring>
#include <map>
#include <set>

#include "runtime/core/error.h"
#include "runtime/nn/safetensors.h"

namespace strata::nn {
namespace {

// A block's geometry as rows x cols inside a [full_rows, full_cols] matrix
// (1-D tensors are one row).
struct Block {
  int64_t rows, cols, full_cols, row0, col0;
};

Block block_of(const Parameter& p) {
  const ParameterSlice& s = *p.slice;
  STRATA_CHECK(s.tensor_shape.size() == p.desc.shape.size() &&
                   s.offset.size() == p.desc.shape.size() &&
                   (p.desc.shape.size() == 1 || p.desc.shape.size() == 2),
               kInternal, "parameter '{}': slice of '{}' must be 1-D or 2-D with matching rank",
               p.name, s.tensor);
  if (p.desc.shape.size() == 1) return {1, p.desc.shape[0], s.tensor_shape[0], 0, s.offset[0]};
  return {p.desc.shape[0], p.desc.shape[1], s.tensor_shape[1], s.offset[0], s.offset[1]};
}

}  // namespace

void load_parameters(Engine& engine, const std::vector<Parameter*>& params, const std::string& path,
                     bool allow_unused) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  std::set<std::string> claimed;
  for (Parameter* p : params) {
    if (!p->slice) {
      file.read(p->name, engine.data(*p), /*allow_convert=*/true);
      claimed.insert(p->name);
      continue;
    }
    const ParameterSlice& s = *p->slice;
    const SafetensorsEntry& e = file.entry(s.tensor);
    STRATA_CHECK(e.shape == s.tensor_shape, kBadArgument,
                 "{}: tensor '{}' has shape {}, expected {} (tiled as '{}')", path, s.tensor,
                 shape_string(e.shape), shape_string(s.tensor_shape), p->name);
    const Block b = block_of(*p);
    const TensorView src = file.view(s.tensor);
    const TensorView dst = engine.data(*p);
    const size_t src_elem = dtype_nbytes(e.dtype), dst_elem = dtype_nbytes(dst.desc.dtype);
    for (int64_t r = 0; r < b.rows; ++r) {
      convert(static_cast<const char*>(src.data) + ((b.row0 + r) * b.full_cols + b.col0) * src_elem,
              e.dtype, static_cast<char*>(dst.data) + r * b.cols * dst_elem, dst.desc.dtype,
              static_cast<size_t>(b.cols));
    }
    claimed.insert(s.tensor);
  }
  // A tied model (no lm_head parameter) must not drop a distinct lm_head from
  // the file, even with allow_unused: that would silently load other weights.
  constexpr const char* kHead = "lm_head.weight";
  constexpr const char* kEmbed = "model.embed_tokens.weight";
  if (!claimed.contains(kHead) && claimed.contains(kEmbed) && file.contains(kHead)) {
    const SafetensorsEntry& head = file.entry(kHead);
    const SafetensorsEntry& embed = file.entry(kEmbed);
    const TensorView h = file.view(kHead), e = file.view(kEmbed);
    STRATA_CHECK(head.dtype == embed.dtype && head.shape == embed.shape &&
                     std::memcmp(h.data, e.data, h.nbytes()) == 0,
                 kBadArgument,
                 "{}: the model ties lm_head to embed_tokens (tie_word_embeddings), but the file's "
                 "'{}' differs from '{}'; load it into a model with tie_word_embeddings = false",
                 path, kHead, kEmbed);
    claimed.insert(kHead);
  }
  if (allow_unused) return;
  for (const std::string& name : file.names()) {
    STRATA_CHECK(claimed.contains(name), kBadArgument,
                 "{}: tensor '{}' matches no parameter of the model", path, name);
  }
}

void save_parameters(Engine& engine, const std::vector<Parameter*>& params,
                     const std::string& path) {
  SafetensorsWriter writer;
  writer.set_metadata("format", "pt");
  // Tiles are assembled into their full tensor (in the tiles' storage dtype).
  std::map<std::string, Tensor> assembled;
  std::map<std::string, int64_t> covered;  // elements written, to catch missing tiles
  for (Parameter* p : params) {
    if (!p->slice) {
      writer.add(p->name, engine.data(*p));
      continue;
    }
    const ParameterSlice& s = *p->slice;
    auto it = assembled.find(s.tensor);
    if (it == assembled.end()) {
      it = assembled.emplace(s.tensor, Tensor::host(p->desc.dtype, s.tensor_shape)).first;
    }
    Tensor& full = it->second;
    STRATA_CHECK(full.desc().dtype == p->desc.dtype, kBadArgument,
                 "tiles of '{}' have different dtypes ({} has {})", s.tensor, p->name,
                 dtype_name(p->desc.dtype));
    const Block b = block_of(*p);
    const TensorView src = engine.data(*p);
    const size_t elem = dtype_nbytes(p->desc.dtype);
    for (int64_t r = 0; r < b.rows; ++r) {
      std::memcpy(static_cast<char*>(full.data()) + ((b.row0 + r) * b.full_cols + b.col0) * elem,
                  static_cast<const char*>(src.data) + r * b.cols * elem,
                  static_cast<size_t>(b.cols) * elem);
    }
    covered[s.tensor] += p->desc.numel();
  }
  for (const auto& [name, full] : assembled) {
    STRATA_CHECK(covered[name] == full.numel(), kBadArgument,
                 "tiles of '{}' cover {} of its {} elements", name, covered[name], full.numel());
    writer.add(name, full.view());
  }
  writer.write(path);
}

}  // namespace strata::nn
