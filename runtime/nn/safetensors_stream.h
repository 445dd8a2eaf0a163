// A safetensors writer that streams: the tensors (name, dtype, shape) are
// declared up front, which fixes the header and every tensor's offset; then
// their bytes arrive in any order and any pieces (range by range, shard by
// shard) and are written in place. Nothing is assembled in memory, so a model
// larger than host memory can be saved. commit() makes the file durable and
// visible atomically.
//
// Layout: as SafetensorsWriter (safetensors.h) — widest dtype first, header
// padded to 8 bytes, so each tensor starts element-aligned.
// Ownership: owns its temporary file (a DurableFile, core/durable_file.h:
// removed unless committed).
// Thread-safety: write() may be called from several threads for disjoint
// ranges; commit() once, after every write returned.
// Errors: Error(kIo) with the path and errno text; kBadArgument for unknown
// names, out-of-range or overlapping pieces, and a commit with bytes missing.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/durable_file.h"
#include "core/tensor.h"

namespace strata::nn {

struct SafetensorsDecl {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
};

class SafetensorsStreamWriter {
 public:
  // Creates a unique temporary file beside `path` and writes the header.
  SafetensorsStreamWriter(std::string path, const std::vector<SafetensorsDecl>& tensors,
                          const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsStreamWriter();
  SafetensorsStreamWriter(const SafetensorsStreamWriter&) = delete;
  SafetensorsStreamWriter& operator=(const SafetensorsStreamWriter&) = delete;

  // Writes nbytes of tensor `name`'s data at byte offset `offset` within it.
  void write(const std::string& name, size_t offset, const void* data, size_t nbytes);
  // Checks every byte of every tensor was written, fsyncs, renames the
  // temporary to `path` and fsyncs the directory: a crash (process or OS)
  // leaves the old file or the whole new one under `path`, never a partial one.
  void commit();

 private:
  struct Slot {
    size_t begin = 0, nbytes = 0;  // file offset of the data and its length
    size_t written = 0;            // bytes written so far (pieces must not overlap)
  };
  std::string path_;
  std::unique_ptr<DurableFile> file_;  // the temporary, renamed to path_ at commit
  std::map<std::string, Slot> slots_;
  std::mutex mutex_;
  bool committed_ = false;
};

}  // namespace strata::nn
