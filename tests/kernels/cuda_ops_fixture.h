// The cuda Ops tests' fixture (ops_cuda_test.cc, ops_cuda_optimizer_test.cc):
// one device, stream, Ops and context, tensors uploaded from host values and
// read back. Needs a GPU: construct it only after checking for one.
#pragma once

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/ops.h"
#include "core/accelerator.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace strata::test {

using Vec = std::vector<double>;

// The value an element of `dtype` holds for x.
inline double rounded(double x, DType dtype) {
  const auto f = static_cast<float>(x);
  if (dtype == DType::kF32) return f;
  uint64_t bits = 0;  // as wide as any dtype, so no access looks out of bounds
  store_from_float(&bits, dtype, 0, f);
  return load_as_float(&bits, dtype, 0);
}
inline Vec rounded(Vec v, DType dtype) {
  for (double& x : v) x = rounded(x, dtype);
  return v;
}

struct Fixture {
  std::unique_ptr<Accelerator> acc = make_cuda_accelerator(0);
  std::unique_ptr<Stream> stream = acc->create_stream();
  std::unique_ptr<ops::Ops> ops = ops::make_cuda_ops(*acc);
  std::unique_ptr<ops::ComputeContext> ctx = ops->make_context(*stream);
  std::vector<Tensor> keep;

  ~Fixture() {
    try {
      stream->synchronize();  // before keep's tensors are freed
    } catch (...) {
    }
  }

  TensorView upload(const void* bytes, DType dtype, Shape shape) {
    Tensor t = acc->allocate_tensor(dtype, std::move(shape));
    acc->copy_async(t.data(), bytes, t.nbytes(), CopyKind::kHostToDevice, *stream);
    stream->synchronize();
    keep.push_back(std::move(t));
    return keep.back().view();
  }
  // A device tensor holding v rounded to dtype; v becomes the rounded values
  // (what the device reads, and what the reference must see).
  TensorView tensor(Vec& v, DType dtype, Shape shape) {
    REQUIRE(static_cast<int64_t>(v.size()) == shape_numel(shape));
    std::vector<unsigned char> bytes(v.size() * dtype_nbytes(dtype));
    for (size_t i = 0; i < v.size(); ++i) {
      if (dtype == DType::kF64) {
        std::memcpy(bytes.data() + 8 * i, &v[i], 8);
      } else {
        v[i] = rounded(v[i], dtype);
        store_from_float(bytes.data(), dtype, i, static_cast<float>(v[i]));
      }
    }
    return upload(bytes.data(), dtype, std::move(shape));
  }
  TensorView ints(const std::vector<int32_t>& v) {
    return upload(v.data(), DType::kI32, {static_cast<int64_t>(v.size())});
  }
  TensorView zeros(DType dtype, Shape shape) {
    Tensor t = acc->allocate_tensor(dtype, std::move(shape));
    acc->memset_async(t.data(), 0, t.nbytes(), *stream);
    keep.push_back(std::move(t));
    return keep.back().view();
  }
  Vec read(const void* data, DType dtype, int64_t numel) {
    stream->synchronize();
    std::vector<unsigned char> bytes(static_cast<size_t>(numel) * dtype_nbytes(dtype));
    acc->copy_async(bytes.data(), data, bytes.size(), CopyKind::kDeviceToHost, *stream);
    stream->synchronize();
    Vec out(static_cast<size_t>(numel));
    for (size_t i = 0; i < out.size(); ++i) {
      if (dtype == DType::kF64) {
        std::memcpy(&out[i], bytes.data() + 8 * i, 8);
      } else {
        out[i] = load_as_float(bytes.data(), dtype, i);
      }
    }
    return out;
  }
  Vec read(const TensorView& t) { return read(t.data, t.desc.dtype, t.numel()); }
  // The raw bytes, for bitwise comparisons.
  std::vector<unsigned char> bytes(const TensorView& t) {
    stream->synchronize();
    std::vector<unsigned char> out(t.nbytes());
    acc->copy_async(out.data(), t.data, out.size(), CopyKind::kDeviceToHost, *stream);
    stream->synchronize();
    return out;
  }
};

}  // namespace strata::test
