// The one device guard of the CUDA code: makes a device current on the calling
// thread for a scope and restores the device that was current before. Only
// compiled into CUDA builds.
//
// Errors: the constructor throws Error(kCuda) when the device cannot be made
// current; the destructor restores without reporting (it cannot throw), which
// at worst leaves a thread on this device.
#pragma once

#include <cuda_runtime_api.h>

#include "core/cuda/cuda_check.h"

namespace strata {

class DeviceGuard {
 public:
  enum class Bind {
    kIfOther,  // cudaSetDevice only when another device is current
    kAlways,   // always: binds the device's primary context for driver calls even when already current
  };
  explicit DeviceGuard(int device, Bind bind = Bind::kIfOther) {
    STRATA_CUDA_CHECK(cudaGetDevice(&previous_));
    if (bind == Bind::kAlways || previous_ != device) {
      STRATA_CUDA_CHECK(cudaSetDevice(device));
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace strata
