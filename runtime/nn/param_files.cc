// Parameters <-> safetensors by Hugging Face name, range by range; tiles
// (ParameterSlice) map their elements into their untiled tensor row by row.
#include "runtime/nn/param_files.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "core/error.h"
#include "runtime/nn/safetensors.h"
#include "runtime/nn/safetensors_stream.h"

namespace strata::nn {
namespace {

using engine::Engine;
using engine::ParamId;
using engine::ParamInfo;

const std::string& tensor_of(const ParamInfo& p) { return p.slice ? p.slice->tensor : p.name; }
const Shape& tensor_shape_of(const ParamInfo& p) { return p.slice ? p.slice->tensor_shape : p.shape; }

}  // namespace

void for_each_tensor_run(const ParamInfo& p, int64_t first, int64_t n, const TensorRunFn& fn) {
  if (!p.slice) {
    fn(first, first, n);
    return;
  }
  const auto& s = *p.slice;
  if (!s.strides.empty()) {
    // A strided view: runs where the last dimension's stride is 1, else one element each.
    STRATA_CHECK(s.strides.size() == p.shape.size() && (p.shape.size() == 1 || p.shape.size() == 2), kInternal,
                 "parameter '{}': strided view of '{}' must be 1-D or 2-D with a stride per dimension", p.name,
                 s.tensor);
    const int64_t cols = p.shape.back(), col_stride = s.strides.back();
    const int64_t row_stride = p.shape.size() == 2 ? s.strides[0] : 0;
    for (int64_t e = first; e < first + n;) {
      const int64_t r = e / cols, c = e % cols;
      const int64_t at = s.base + r * row_stride + c * col_stride;
      const int64_t len = col_stride == 1 ? std::min(cols - c, first + n - e) : 1;
      fn(at, e, len);
      e += len;
    }
    return;
  }
  STRATA_CHECK(s.tensor_shape.size() == p.shape.size() && s.offset.size() == p.shape.size() &&
                   (p.shape.size() == 1 || p.shape.size() == 2),
               kInternal, "parameter '{}': slice of '{}' must be 1-D or 2-D with matching rank",
               p.name, s.tensor);
  if (p.shape.size() == 1) {
    fn(s.offset[0] + first, first, n);
    return;
  }
  const int64_t cols = p.shape[1], full_cols = s.tensor_shape[1];
  for (int64_t e = first; e < first + n;) {
    const int64_t r = e / cols, c = e % cols;
    const int64_t len = std::min(cols - c, first + n - e);
    fn((s.offset[0] + r) * full_cols + s.offset[1] + c, e, len);
    e += len;
  }
}

void load_parameters(Engine& engine, const std::vector<ParamId>& params, const std::string& path,
                     bool allow_unused, const std::string& prefix) {
  load_parameters(engine, params, path, allow_unused, [&](const std::string& name) { return prefix + name; });
}

void load_parameters(Engine& engine, const std::vector<ParamId>& params, const std::string& path,
                     bool allow_unused, const std::function<std::string(const std::string&)>& file_name) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  std::set<std::string> claimed;
  for (ParamId id : params) {
    const ParamInfo& p = engine.param_info(id);
    const std::string name = file_name(tensor_of(p));
    const SafetensorsEntry& e = file.entry(name);
    STRATA_CHECK(e.shape == tensor_shape_of(p), kBadArgument,
                 "{}: tensor '{}' has shape {}, but the model's '{}' needs {}", path, name,
                 shape_string(e.shape), p.name, shape_string(tensor_shape_of(p)));
    STRATA_CHECK(is_float_storage(e.dtype), kBadArgument,
                 "{}: tensor '{}' is {}, the bytes of a quantized checkpoint; they are read with the model's "
                 "quantization_config (config.json), not as '{}' itself",
                 path, name, dtype_name(e.dtype), p.name);
    const TensorView src = file.view(name);
    const size_t src_elem = dtype_nbytes(e.dtype);
    load_parameter(engine, id, [&](int64_t at, int64_t n, void* dst, DType dst_dtype) {
      convert(static_cast<const char*>(src.data) + at * static_cast<int64_t>(src_elem), e.dtype, dst, dst_dtype,
              static_cast<size_t>(n));
    });
    claimed.insert(name);
  }
  // A tied model (no lm_head parameter) must not drop a distinct lm_head from
  // the file, even with allow_unused: that would silently load other weights.
  const std::string kHead = file_name("lm_head.weight");
  const std::string kEmbed = file_name("model.embed_tokens.weight");
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

void load_parameter(Engine& engine, ParamId id, const TensorSource& source) {
  const ParamInfo& p = engine.param_info(id);
  engine.for_each_owned_range(id, Engine::Access::kWrite, [&](int64_t first, const TensorView& host) {
    const size_t dst_elem = dtype_nbytes(host.desc.dtype);
    for_each_tensor_run(p, first, host.numel(), [&](int64_t at, int64_t into, int64_t n) {
      source(at, n, static_cast<char*>(host.data) + (into - first) * static_cast<int64_t>(dst_elem),
             host.desc.dtype);
    });
  });
}

void save_parameters(Engine& engine, const std::vector<ParamId>& params, const std::string& path,
                     const std::string& prefix) {
  std::vector<SafetensorsDecl> decls;
  std::map<std::string, DType> declared;
  for (ParamId id : params) {
    const ParamInfo& p = engine.param_info(id);
    const std::string name = prefix + tensor_of(p);
    auto [it, fresh] = declared.emplace(name, p.dtype);
    STRATA_CHECK(it->second == p.dtype, kBadArgument,
                 "tiles of '{}' have different dtypes ({} has {})", name, p.name,
                 dtype_name(p.dtype));
    if (fresh) decls.push_back(SafetensorsDecl{name, p.dtype, tensor_shape_of(p)});
  }
  SafetensorsStreamWriter writer(path, decls, {{"format", "pt"}});
  for (ParamId id : params) {
    const ParamInfo& p = engine.param_info(id);
    const size_t elem = dtype_nbytes(p.dtype);
    engine.for_each_owned_range(
        id, Engine::Access::kRead, [&](int64_t first, const TensorView& host) {
          for_each_tensor_run(p, first, host.numel(), [&](int64_t at, int64_t from, int64_t n) {
            writer.write(prefix + tensor_of(p), static_cast<size_t>(at) * elem,
                         static_cast<const char*>(host.data) +
                             static_cast<size_t>(from - first) * elem,
                         static_cast<size_t>(n) * elem);
          });
        });
  }
  // commit() refuses unless every byte of every tensor arrived (a missing tile
  // or a rank that owns only a shard).
  writer.commit();
}

}  // namespace strata::nn
