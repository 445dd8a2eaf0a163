// Tensor descriptors: what a tensor is (dtype, shape, tier) separated from who
// owns its memory. A TensorView never owns; a Tensor owns its bytes through a
// deleter chosen by whoever allocated them (an Accelerator, the pinned pool, ...).
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"

namespace strata {

// Where bytes live. kNvme tensors have no addressable data pointer.
enum class Tier : uint8_t { kDevice, kCpu, kNvme };
std::string_view tier_name(Tier tier);  // "device", "cpu", "nvme"

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& shape);     // product of dims; 1 for a scalar
std::string shape_string(const Shape& shape);  // "[4, 1024]"

struct TensorDesc {
  DType dtype = DType::kF32;
  Shape shape;
  Tier tier = Tier::kCpu;

  int64_t numel() const { return shape_numel(shape); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_nbytes(dtype); }
};

// A non-owning view: descriptor plus data pointer. Copyable; valid only while
// the owner of `data` keeps it alive.
struct TensorView {
  TensorDesc desc;
  void* data = nullptr;

  int64_t numel() const { return desc.numel(); }
  size_t nbytes() const { return desc.nbytes(); }
  template <typename T>
  T* as() const { return static_cast<T*>(data); }
};

// An owning tensor: frees its bytes with `deleter` on destruction. Move-only.
class Tensor {
 public:
  using Deleter = std::function<void(void*)>;

  Tensor() = default;
  Tensor(TensorDesc desc, void* data, Deleter deleter)
      : view_{std::move(desc), data}, deleter_(std::move(deleter)) {}
  Tensor(Tensor&& other) noexcept { *this = std::move(other); }
  Tensor& operator=(Tensor&& other) noexcept {
    if (this != &other) {
      reset();
      view_ = std::exchange(other.view_, TensorView{});
      deleter_ = std::exchange(other.deleter_, nullptr);
    }
    return *this;
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  ~Tensor() { reset(); }

  // An fp32/fp16/bf16 tensor in ordinary host memory (Tier::kCpu), zero-filled.
  static Tensor host(DType dtype, Shape shape);

  const TensorDesc& desc() const { return view_.desc; }
  const TensorView& view() const { return view_; }
  void* data() const { return view_.data; }
  template <typename T>
  T* as() const { return static_cast<T*>(view_.data); }
  int64_t numel() const { return view_.numel(); }
  size_t nbytes() const { return view_.nbytes(); }
  bool defined() const { return view_.data != nullptr; }

  void reset() {
    if (view_.data != nullptr && deleter_) deleter_(view_.data);
    view_ = TensorView{};
    deleter_ = nullptr;
  }

 private:
  TensorView view_;
  Deleter deleter_;
};

}  // namespace strata
