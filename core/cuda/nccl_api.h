// NCCL, loaded when strata first uses it rather than linked: libstrata does
// not depend on libnccl.so.2, so importing strata into a process never puts
// an NCCL there under that soname ahead of the one another library needs
// (torch's libtorch_cuda.so: an older libnccl.so.2 loaded first shadows its
// own and its import fails on a missing symbol). The first NCCL
// communicator (or cuda_info) loads, in order:
//   1. an NCCL the process has loaded already (torch imported first): used
//      as it is, so the process has one NCCL;
//   2. $STRATA_NCCL_LIBRARY (a path);
//   3. libnccl.so.2 from the dynamic linker's search path (libstrata's own
//      run path first: the CUDA toolkit's directory it was built against);
//   4. the NCCL strata was built against (its path at build time).
// So a process that imports torch and strata in either order and creates
// strata's cuda engine after importing torch shares torch's NCCL; one that
// creates it before importing torch puts strata's NCCL there first (import
// torch first then). Only compiled into CUDA builds.
//
// Thread-safety: api() loads once (a function-local static); the table is
// read-only afterwards. Errors: api() throws Error(kCuda) naming what it
// tried when no NCCL loads or one lacks a function strata calls.
#pragma once

#include <nccl.h>

#include <string>

namespace strata::nccl {

struct Api {
  decltype(&::ncclGetVersion) GetVersion;
  decltype(&::ncclGetErrorString) GetErrorString;
  decltype(&::ncclGetUniqueId) GetUniqueId;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig;
  decltype(&::ncclCommFinalize) CommFinalize;
  decltype(&::ncclCommDestroy) CommDestroy;
  decltype(&::ncclCommAbort) CommAbort;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&::ncclAllGather) AllGather;
  decltype(&::ncclReduceScatter) ReduceScatter;
  decltype(&::ncclAllReduce) AllReduce;
  decltype(&::ncclBroadcast) Broadcast;
  decltype(&::ncclSend) Send;
  decltype(&::ncclRecv) Recv;
  decltype(&::ncclGroupStart) GroupStart;
  decltype(&::ncclGroupEnd) GroupEnd;
  std::string path;  // where it came from: "already loaded (<path>)", or the file dlopen took
};

// The process's NCCL (see above).
const Api& api();

}  // namespace strata::nccl
