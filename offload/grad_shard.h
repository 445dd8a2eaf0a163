// GradShard: this rank's fp32 gradient shard of one dtype group (docs/DESIGN.md §5.2)
// — where BucketReducer adds the reduced blocks of backward and where the
// optimizer reads the final gradient, sub-group by sub-group.
//
// Two homes:
//   memory: one fp32 array of layout.shard_numel() elements in accelerator
//           memory; accumulation is Ops::add on the reducer's stream.
//   nvme:   a flat fp32 file in the engine's swap space (ZeRO-Infinity swaps
//           gradients with the optimizer state), so host memory does not grow
//           with the model. A parameter's first block since zero() is written
//           straight to its slice; later blocks (gradient accumulation) are
//           read, added and written back. Slices not written since zero() read
//           as zeros, so zero() costs no I/O. The I/O runs on a thread of
//           this shard's own (never in a host function: on cuda every
//           stream's host functions share the driver's one callback thread,
//           and a disk write there would hold all of them up), through one
//           pinned scratch of the largest slice. The reducer's stream copies a
//           block into the scratch, a host function tells the thread it
//           landed (a notice, no I/O), and the stream waits on a HostEvent
//           the thread signals once the block is on disk: the stream, not the
//           caller, is held until then, and the next block's copy into the
//           scratch is ordered after it. The block landed last stays in the
//           scratch until the next one's copy: a read of its slice copies it
//           from there (the last block of backward, the embedding's, is read
//           by the optimizer right away — not behind its own write). The next
//           block's copy waits while such a read copies (on cuda its stream's
//           host function does, on the driver's one callback thread: a
//           memcpy of one slice at most).
// Held blocks (nvme, hold_blocks(n): layer-major, whose n backwards of a
// parameter come in a row): a parameter's first n - 1 blocks since zero() are
// summed in host memory on the I/O thread, and the n-th is added to that sum
// and written once: one write per parameter and step instead of a write and
// n - 1 read-add-writes. The same fp32 additions in the same order (each
// block added to the sum of the earlier ones), so the same bits. A read of a
// slice still held (fewer blocks came than announced) writes its sum first.
// read() gives a host view of an aligned range for the optimizer: the array
// itself when the accelerator's memory is host memory, else a pinned window
// filled by a copy (memory) or a read (nvme).
//
// Ownership: borrows the accelerator, the Ops, the layout and (nvme) the I/O
// handle and swap space, which must outlive it. Owns its array, file, scratch
// and window.
// Thread-safety: one thread drives it; accumulate()'s work runs on the given
// stream (and, nvme, on the I/O thread). zero() requires that stream to be
// idle (the reducer synchronized); so does read(), except of a range whose
// every slice has landed, which the optimizer's thread reads during backward
// while other slices still accumulate.
// Errors: Error(kIo) from a failed gradient read or write — from the stream
// (the reducer's synchronize) for accumulate, directly for read().
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels/ops.h"
#include "partition/layout.h"
#include "core/accelerator.h"

namespace strata::nvme {
class AioHandle;
class File;
class SwapSpace;
}  // namespace strata::nvme

namespace strata::offload {

class GradShard {
 public:
  // Memory home.
  GradShard(Accelerator& accelerator, ops::Ops& ops, const partition::PartitionLayout& layout);
  // NVMe home: creates the file `key` (fp32, shard_numel elements) in `swap`.
  GradShard(Accelerator& accelerator, ops::Ops& ops, const partition::PartitionLayout& layout,
            nvme::AioHandle& aio, nvme::SwapSpace& swap, const std::string& key);
  ~GradShard();
  GradShard(const GradShard&) = delete;
  GradShard& operator=(const GradShard&) = delete;

  bool on_nvme() const { return file_ != nullptr; }

  // Adds `block` (layout.param(p).slice_numel fp32 elements of accelerator
  // memory) into parameter p's slice, on `stream` after its queued work;
  // `block` is read before the stream's next queued operation starts.
  void accumulate(size_t p, const float* block, Stream& stream, ops::ComputeContext& ctx);
  // Every element zero again (held sums dropped). `stream` must be idle.
  void zero(Stream& stream);
  // nvme: of each parameter's blocks since zero(), the first `blocks` (>= 1)
  // are summed in host memory and written once, with the last (see above);
  // 1 (the default) writes each. Applies to the blocks accumulate() queues
  // from now on: set it before a step's first block (layer-major's
  // prepare_step), and keep it for the step.
  void hold_blocks(int blocks);
  // A host view of shard elements [first, first + numel) — both multiples of
  // the layout's alignment in elements of the group's dtype (slice and
  // sub-group boundaries are) — valid until the next read() or zero().
  // `stream` (idle) carries the copy when the array is not host memory.
  const float* read(size_t first, size_t numel, Stream& stream);
  // nvme home: read() into the caller's `dst` (pinned, O_DIRECT-aligned,
  // numel floats) without waiting: starts the read (once the range's own
  // writes are done) and returns what completes it — waits for the read and
  // zeroes what read() zeroes; call it exactly once, before dst is reused.
  // The same conditions on the range as read().
  std::function<void()> read_async(size_t first, size_t numel, float* dst);
  // The memory home's array (shard_numel fp32 in accelerator memory, read in
  // place by the DeviceOptimizer once the stream is idle); nullptr on nvme.
  const float* memory() const { return memory_; }

 private:
  class IoThread;  // nvme: the thread that reads, adds and writes the blocks
  struct Tail;      // nvme: which parameter's final block the scratch holds

  void ensure_window(size_t numel);
  // nvme, the I/O thread or a caller past drain_range: writes the sum held for
  // each parameter of [first, end) that has one (fewer blocks than held).
  void write_held(size_t first, size_t end);

  Accelerator& accelerator_;
  ops::Ops& ops_;
  const partition::PartitionLayout& layout_;
  float* memory_ = nullptr;        // memory home
  // nvme: zeroes the slices of [first, first + numel) no block reached since zero() (dst holds the range).
  void zero_unwritten(size_t first, size_t numel, float* dst) const;
  nvme::AioHandle* aio_ = nullptr;  // nvme home
  nvme::File* file_ = nullptr;
  std::vector<uint8_t> written_;   // nvme: per parameter, written since zero() (touched by the I/O thread)
  // nvme, held blocks: blocks per parameter and step (1: none held), each
  // parameter's blocks since zero() and its held sum (null: none), and
  // released sums' buffers for the next (one layer's at a time, layer-major).
  struct HeldSum;  // an O_DIRECT-aligned host buffer
  int hold_ = 1;
  std::vector<int> blocks_;
  std::vector<std::unique_ptr<HeldSum>> held_;   // [param]: null when none held
  std::mutex spare_mutex_;                        // spare_ is shared by the I/O thread and readers
  std::vector<std::unique_ptr<HeldSum>> spare_;
  std::unique_ptr<HeldSum> take_spare(size_t numel);
  void give_back(std::unique_ptr<HeldSum> sum);
  float* scratch_ = nullptr;       // nvme: pinned, largest slice x 2 (incoming | on disk)
  size_t scratch_numel_ = 0;
  std::shared_ptr<Tail> tail_;     // nvme (shared with the streams' host functions)
  std::unique_ptr<IoThread> io_;   // nvme; declared after what its jobs touch, so it stops first
  float* window_ = nullptr;        // pinned host view for read()
  size_t window_numel_ = 0;
};

}  // namespace strata::offload
