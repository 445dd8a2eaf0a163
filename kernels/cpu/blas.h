// OpenBLAS (its OpenMP build), loaded by strata at first use rather than linked,
// so that strata can choose its kernels for the CPU first.
//
// Why: OpenBLAS picks its kernel set ("core") once, when the library is
// loaded, from OPENBLAS_CORETYPE or its own CPU detection — and Debian's
// 0.3.21 does not know recent CPUs: on the AVX-512 Xeons these machines run,
// it falls back to its Prescott (SSE3) kernels, ~5x slower than its SkylakeX
// ones for sgemm. A library linked as a dependency is initialised before any
// of our code runs, so instead strata dlopen()s it: when OPENBLAS_CORETYPE is
// unset, it first sets it from cpu_features() (AVX-512 F/BW/DQ/VL: SkylakeX,
// plus AVX512_BF16: Cooperlake; AVX2 + FMA: Haswell); a value the user set is
// always kept. `strata doctor` and the bench tools print the core in use.
//
// Thread-safety: api() loads once (thread-safe) and is then read-only.
// Errors: api() throws Error(kInternal) naming the library path and dlerror()
// when OpenBLAS cannot be loaded (scripts/setup installs libopenblas-openmp-dev).
#pragma once

#include <cblas.h>

#include <string>

namespace strata::blas {

struct Api {
  decltype(&cblas_sgemm) sgemm = nullptr;
  decltype(&cblas_dgemm) dgemm = nullptr;
  std::string core;         // OpenBLAS's core name in use, e.g. "SkylakeX"
  std::string config;       // openblas_get_config()
  std::string core_source;  // "OPENBLAS_CORETYPE (set by the user)", "strata (cpu features)", ...
};

const Api& api();

}  // namespace strata::blas
