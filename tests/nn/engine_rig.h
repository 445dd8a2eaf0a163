// Test helpers for runtime/nn on Engine v2: an accelerator with a resident
// engine, and host <-> accelerator copies of parameters, gradients and
// activations (all through the engine's compute stream, so they are ordered
// after the model's work).
#pragma once

#include <memory>
#include <vector>

#include "core/accelerator.h"
#include "runtime/engine/resident_engine.h"
#include "runtime/nn/decoder_model.h"

namespace strata::test {

struct Rig {
  std::unique_ptr<Accelerator> accelerator;
  std::unique_ptr<engine::ResidentEngine> engine;

  explicit Rig(Backend backend = Backend::kCpu)
      : accelerator(backend == Backend::kCpu ? make_cpu_accelerator()
                                             : make_cuda_accelerator(0)),
        engine(std::make_unique<engine::ResidentEngine>(*accelerator)) {}

  // An accelerator tensor holding `values` converted to `dtype`.
  Tensor upload(const std::vector<float>& values, DType dtype, Shape shape) {
    Tensor host = Tensor::host(dtype, shape);
    convert(values.data(), DType::kF32, host.data(), dtype, values.size());
    Tensor device = accelerator->allocate_tensor(dtype, std::move(shape));
    accelerator->copy_async(device.data(), host.data(), host.nbytes(), CopyKind::kHostToDevice,
                            engine->compute_stream());
    engine->compute_stream().synchronize();
    return device;
  }
  Tensor upload_ints(const std::vector<int32_t>& values) {
    Tensor device = accelerator->allocate_tensor(DType::kI32, {static_cast<int64_t>(values.size())});
    accelerator->copy_async(device.data(), values.data(), values.size() * sizeof(int32_t),
                            CopyKind::kHostToDevice, engine->compute_stream());
    engine->compute_stream().synchronize();
    return device;
  }
  Tensor zeros(DType dtype, Shape shape) {
    Tensor device = accelerator->allocate_tensor(dtype, std::move(shape));
    accelerator->memset_async(device.data(), 0, device.nbytes(), engine->compute_stream());
    return device;
  }
  // Waits for the compute stream, then copies `view` (accelerator memory) to the host as floats.
  std::vector<float> download(const TensorView& view) {
    std::vector<char> bytes(view.nbytes());
    accelerator->copy_async(bytes.data(), view.data, view.nbytes(), CopyKind::kDeviceToHost,
                            engine->compute_stream());
    engine->compute_stream().synchronize();
    std::vector<float> out(static_cast<size_t>(view.numel()));
    for (size_t i = 0; i < out.size(); ++i) out[i] = load_as_float(bytes.data(), view.desc.dtype, i);
    return out;
  }

  void set_param(engine::ParamId id, const std::vector<float>& values) {
    engine->for_each_owned_range(id, engine::Engine::Access::kWrite,
                                 [&](int64_t first, const TensorView& host) {
                                   convert(values.data() + first, DType::kF32, host.data,
                                           host.desc.dtype, static_cast<size_t>(host.numel()));
                                 });
  }
  std::vector<float> param_values(engine::ParamId id) {
    std::vector<float> out(static_cast<size_t>(engine->param_info(id).numel()));
    engine->for_each_owned_range(id, engine::Engine::Access::kRead,
                                 [&](int64_t first, const TensorView& host) {
                                   convert(host.data, host.desc.dtype, out.data() + first,
                                           DType::kF32, static_cast<size_t>(host.numel()));
                                 });
    return out;
  }
  std::vector<float> grad_values(engine::ParamId id) {
    return download(engine->grad_storage(id));
  }
};

}  // namespace strata::test
