// What the CPU running this process supports (CPUID + OS state via XGETBV), for
// run-time kernel dispatch and `strata doctor`. One binary runs on any x86-64.
#pragma once

#include <string>

namespace strata {

struct CpuFeatures {
  std::string model;        // "AMD EPYC 7763 64-Core Processor"
  bool avx2 = false;        // AVX2 + FMA, with OS-enabled YMM state
  bool avx512f = false;     // AVX-512 F/DQ/BW/VL with OS-enabled ZMM state
  bool avx512_bf16 = false; // AVX512_BF16 (vcvtne2ps2bf16)
  bool f16c = false;        // vcvtph2ps / vcvtps2ph
  int logical_cores = 0;    // online logical CPUs
};

// Detected once, cached. Thread-safe.
const CpuFeatures& cpu_features();

}  // namespace strata
