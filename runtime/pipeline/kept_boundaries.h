// Layer-major's kept boundaries (docs/DESIGN.md §5.5): what a micro-batch
// carries from one chunk to the next, kept per micro-batch between the
// chunk's forward and its backward, so that each chunk computes in one slot
// of its model. Two kinds:
//   the input of chunk k for micro-batch i (written by chunk k - 1's forward,
//     read by chunk k's forward and again before its backward's recompute):
//     chunks x m of them, the bulk;
//   the gradient flowing down for micro-batch i (written by chunk k + 1's
//     backward, read by chunk k's): m of them, reused by every chunk.
//
// Where they live (BoundaryHome):
//   kDevice      accelerator memory, one buffer per boundary.
//   kPinnedHost  pinned host memory, one buffer per boundary.
//   kNvme        the inputs in one file of a swap space under the run's
//                nvme_path, at a fixed place per (chunk, micro-batch),
//                written through a small set of pinned staging buffers with
//                the engine's I/O handle (each input written once, read back
//                where its staging buffer was taken by another); the
//                gradients in pinned host memory (m of them). prefetch()
//                starts the reads the next actions need, so the I/O runs
//                beside the compute; a staging buffer a prefetch or an
//                upcoming use holds is never taken.
//
// Copies run on the caller's stream, in its order: restore() after keep()
// of the same boundary on the same stream reads what was kept. Bytes are
// moved, never converted: a boundary comes back bit for bit.
//
// Ownership: owns its buffers, staging and swap space (removed at
// destruction); borrows the accelerator and the I/O handle, which must
// outlive it. Thread-safety: one thread (the training thread). Errors: I/O
// errors (Error(kIo), naming the file) surface on the calling thread from
// keep/restore/prefetch or wait(); Error(kBadArgument) for a boundary larger
// than the capacity given (kNvme).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "core/accelerator.h"

namespace strata::nvme {
class AioHandle;
class File;
class SwapSpace;
}  // namespace strata::nvme

namespace strata::pipeline {

// Where a local-handoff schedule (layer-major) keeps each micro-batch's
// boundaries (above).
enum class BoundaryHome : uint8_t { kDevice, kPinnedHost, kNvme };

// "device" | "cpu" | "nvme" (strata.layer_major_boundaries's spelling).
const char* boundary_home_name(BoundaryHome home);
// The home so spelled; Error(kBadArgument) naming `what` (the key) for another spelling.
BoundaryHome parse_boundary_home(std::string_view name, std::string_view what);

// What a store of `home` holds for `chunks` chunks of `micro_batches`
// boundaries of `nbytes` each, once every boundary has been kept (what
// memory_nbytes() and file_nbytes() then say): its memory, accelerator memory
// for kDevice and pinned host memory for the others -- every input of chunks
// 1.. and the m gradients (kDevice, kPinnedHost), or kNvme's 2m + 2 staging
// buffers (each `nbytes` rounded up to the direct-I/O alignment) and the m
// gradients; and kNvme's file, a place per (chunk, micro-batch).
struct KeptBoundariesSize {
  size_t memory_nbytes = 0;
  uint64_t file_nbytes = 0;
};
KeptBoundariesSize kept_boundaries_size(BoundaryHome home, int chunks, int micro_batches, size_t nbytes);

// What kNvme needs.
struct BoundaryNvme {
  nvme::AioHandle* io = nullptr;  // the engine's I/O handle (borrowed)
  std::filesystem::path root;     // the run's nvme_path: files under <root>/layer_major/rank<rank>/
  int rank = 0;                   // the job rank (the swap space's directory)
  bool keep_files = false;        // strata.keep_swap_files
  size_t capacity_nbytes = 0;     // the largest boundary: micro-batch rows x hidden x activation bytes
  int micro_batches = 0;          // m: inputs per chunk
};

// One boundary: the input of `chunk` for `micro_batch`, or (gradient) the
// gradient flowing down for `micro_batch` (chunk ignored).
struct BoundaryKey {
  int chunk = 0;
  int micro_batch = 0;
  bool gradient = false;
  bool operator==(const BoundaryKey&) const = default;
};

class KeptBoundaries {
 public:
  // `nvme` is required for kNvme (its io and capacity_nbytes set), ignored otherwise.
  KeptBoundaries(Accelerator& accelerator, int chunks, BoundaryHome home, const BoundaryNvme& nvme = {});
  ~KeptBoundaries();
  KeptBoundaries(const KeptBoundaries&) = delete;
  KeptBoundaries& operator=(const KeptBoundaries&) = delete;

  // Copies `nbytes` at `from` (accelerator memory) into the boundary `key` on `stream`.
  void keep(const BoundaryKey& key, const void* from, size_t nbytes, Stream& stream);
  // Copies the boundary `key` (kept with the same nbytes) to `to` on `stream`.
  void restore(const BoundaryKey& key, void* to, size_t nbytes, Stream& stream);
  // kNvme: the boundaries the next actions restore, in order: their staging
  // buffers are kept, and those not staged whose `read` is set start reading
  // (a boundary an earlier one of those actions keeps is not read). Nothing
  // elsewhere.
  struct Upcoming {
    BoundaryKey key;
    bool read = true;
  };
  void prefetch(std::span<const Upcoming> upcoming);

  BoundaryHome home() const { return home_; }
  // Bytes held in accelerator memory (kDevice) or pinned host memory (the others).
  size_t memory_nbytes() const;
  // Bytes of the swap file (kNvme; 0 elsewhere) and the boundary bytes read back from it so far.
  uint64_t file_nbytes() const;
  uint64_t read_nbytes() const { return read_nbytes_; }

 private:
  struct Buffer {
    void* data = nullptr;
    size_t nbytes = 0, capacity = 0;
  };
  struct Staged;
  void free(Buffer& b);
  void* hold(Buffer& b, size_t nbytes, Stream& stream);
  Buffer& direct(const BoundaryKey& key);  // kDevice / kPinnedHost, and kNvme's gradients
  bool pinned() const { return home_ != BoundaryHome::kDevice; }
  // kNvme.
  uint64_t offset_of(const BoundaryKey& key) const;
  Staged* staged(const BoundaryKey& key);
  Staged& take(std::span<const BoundaryKey> spare);  // a staging buffer for a new boundary
  void settle(Staged& s);                            // its I/O and copies finished
  void submit_ready_writes();                        // writes whose copy out has run
  void create_file();

  Accelerator& acc_;
  BoundaryHome home_;
  BoundaryNvme nvme_;
  std::vector<std::vector<Buffer>> inputs_;  // [chunk][micro-batch] (kDevice / kPinnedHost)
  std::vector<Buffer> grads_;                // [micro-batch]
  // kNvme.
  size_t stride_ = 0;  // capacity_nbytes rounded up to the direct-I/O alignment
  std::unique_ptr<nvme::SwapSpace> swap_;
  nvme::File* file_ = nullptr;
  std::vector<std::unique_ptr<Staged>> staging_;
  std::vector<BoundaryKey> protected_;  // the upcoming boundaries of the last prefetch
  uint64_t clock_ = 0;
  uint64_t read_nbytes_ = 0;
};

}  // namespace strata::pipeline
