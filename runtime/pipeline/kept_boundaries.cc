// Layer-major's kept boundaries: device, pinned host or NVMe through staging.
#include "runtime/pipeline/kept_boundaries.h"

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "core/log.h"
#include "nvme/aio_handle.h"
#include "nvme/io_options.h"
#include "nvme/swap_space.h"

namespace strata::pipeline {

const char* boundary_home_name(BoundaryHome home) {
  switch (home) {
    case BoundaryHome::kDevice: return "device";
    case BoundaryHome::kPinnedHost: return "cpu";
    case BoundaryHome::kNvme: return "nvme";
  }
  return "?";
}

BoundaryHome parse_boundary_home(std::string_view name, std::string_view what) {
  for (const BoundaryHome home : {BoundaryHome::kDevice, BoundaryHome::kPinnedHost, BoundaryHome::kNvme}) {
    if (name == boundary_home_name(home)) return home;
  }
  raise(ErrorCategory::kBadArgument, "{} {}: not where boundaries can be kept; one of device, cpu, nvme", what, name);
}

// A pinned staging buffer of kNvme and the input it holds. Its life:
// keep() copies a boundary in on the stream (`copied` recorded after it),
// and once that copy has run the write to the boundary's place in the file
// starts (`write`); prefetch() or restore() of a boundary not staged reads it
// in (`read`); restore() copies it out on the stream (`used` recorded after).
// Before the buffer takes another boundary all of these have finished, so a
// boundary no longer staged is whole in the file.
struct KeptBoundaries::Staged {
  void* data = nullptr;
  std::optional<BoundaryKey> key;  // the boundary held (or being read / written)
  std::unique_ptr<Event> copied;   // keep()'s copy in: the write starts after it
  bool write_pending = false;      // copied in, its write not started yet
  std::optional<nvme::Ticket> write, read;
  std::unique_ptr<Event> used;  // restore()'s copy out
  uint64_t last_use = 0;
};

namespace {

// kNvme's staging: two chunks' worth of inputs and two more (the inputs the
// chunk in hand reads and those it writes for the next, plus read-ahead
// across a chunk's end), each a direct-I/O-aligned place of the file.
int staging_buffers(int micro_batches) { return 2 * micro_batches + 2; }
size_t staging_stride(size_t nbytes) {
  return (nbytes + nvme::kDirectIoAlignment - 1) / nvme::kDirectIoAlignment * nvme::kDirectIoAlignment;
}

}  // namespace

KeptBoundariesSize kept_boundaries_size(BoundaryHome home, int chunks, int micro_batches, size_t nbytes) {
  const size_t m = static_cast<size_t>(std::max(micro_batches, 0)), k = static_cast<size_t>(std::max(chunks, 0));
  if (home != BoundaryHome::kNvme) return {(k > 0 ? k - 1 : 0) * m * nbytes + m * nbytes, 0};
  return {static_cast<size_t>(staging_buffers(micro_batches)) * staging_stride(nbytes) + m * nbytes,
          static_cast<uint64_t>(k) * m * staging_stride(nbytes)};
}

KeptBoundaries::KeptBoundaries(Accelerator& accelerator, int chunks, BoundaryHome home, const BoundaryNvme& nvme)
    : acc_(accelerator), home_(home), nvme_(nvme), inputs_(static_cast<size_t>(std::max(chunks, 0))) {
  if (home_ != BoundaryHome::kNvme) return;
  STRATA_CHECK(nvme_.io != nullptr && !nvme_.root.empty(), kBadArgument,
               "strata.layer_major_boundaries nvme: the boundaries' files need the run's nvme_path and its I/O "
               "(a tier on nvme: offload_param or offload_optimizer device nvme)");
  STRATA_CHECK(nvme_.capacity_nbytes > 0 && nvme_.micro_batches > 0, kBadArgument,
               "strata.layer_major_boundaries nvme: no boundary size or micro-batch count given");
  stride_ = staging_stride(nvme_.capacity_nbytes);
  for (int i = 0; i < staging_buffers(nvme_.micro_batches); ++i) {
    auto s = std::make_unique<Staged>();
    s->data = acc_.allocate_pinned(stride_);
    staging_.push_back(std::move(s));
  }
  create_file();
}

KeptBoundaries::~KeptBoundaries() {
  for (auto& s : staging_) {
    try {
      settle(*s);
    } catch (const std::exception& e) {
      logger().warn("layer-major boundaries: {}", e.what());
    }
    acc_.deallocate_pinned(s->data);
  }
  for (auto& chunk : inputs_) {
    for (Buffer& b : chunk) free(b);
  }
  for (Buffer& b : grads_) free(b);
}

void KeptBoundaries::create_file() {
  nvme::SwapSpaceOptions options;
  options.root = nvme_.root;
  options.group = "layer_major";
  options.rank = nvme_.rank;
  options.keep_files = nvme_.keep_files;
  swap_ = std::make_unique<nvme::SwapSpace>(options);
  const uint64_t nbytes = static_cast<uint64_t>(inputs_.size()) * static_cast<uint64_t>(nvme_.micro_batches) * stride_;
  file_ = &swap_->create(nvme::SwapFileSpec{"boundaries", nbytes});
}

void KeptBoundaries::free(Buffer& b) {
  if (b.data != nullptr) pinned() ? acc_.deallocate_pinned(b.data) : acc_.deallocate(b.data);
  b = Buffer{};
}

void* KeptBoundaries::hold(Buffer& b, size_t nbytes, Stream& stream) {
  if (b.capacity < nbytes) {
    if (b.data != nullptr) {
      stream.synchronize();  // what the stream still reads of the old one is done
      free(b);
    }
    b.data = pinned() ? acc_.allocate_pinned(nbytes) : acc_.allocate(nbytes);
    b.capacity = nbytes;
  }
  b.nbytes = nbytes;
  return b.data;
}

KeptBoundaries::Buffer& KeptBoundaries::direct(const BoundaryKey& key) {
  const auto at = [](std::vector<Buffer>& v, int i) -> Buffer& {
    if (v.size() <= static_cast<size_t>(i)) v.resize(static_cast<size_t>(i) + 1);
    return v[static_cast<size_t>(i)];
  };
  return key.gradient ? at(grads_, key.micro_batch) : at(inputs_.at(static_cast<size_t>(key.chunk)), key.micro_batch);
}

void KeptBoundaries::keep(const BoundaryKey& key, const void* from, size_t nbytes, Stream& stream) {
  if (home_ != BoundaryHome::kNvme || key.gradient) {
    void* to = hold(direct(key), nbytes, stream);
    acc_.copy_async(to, from, nbytes, pinned() ? CopyKind::kDeviceToHost : CopyKind::kDeviceToDevice, stream);
    return;
  }
  STRATA_CHECK(nbytes <= nvme_.capacity_nbytes, kBadArgument,
               "layer-major boundary of chunk {} micro-batch {}: {} bytes, more than the {} the nvme file was made for",
               key.chunk, key.micro_batch, nbytes, nvme_.capacity_nbytes);
  submit_ready_writes();
  Staged* s = staged(key);
  if (s == nullptr) {
    s = &take(protected_);
  } else {
    settle(*s);  // its earlier contents' I/O and copies are done before it is written again
  }
  s->key = key;
  acc_.copy_async(s->data, from, nbytes, CopyKind::kDeviceToHost, stream);
  if (!s->copied) s->copied = acc_.create_event();
  stream.record(*s->copied);
  s->write_pending = true;
  s->last_use = ++clock_;
}

void KeptBoundaries::restore(const BoundaryKey& key, void* to, size_t nbytes, Stream& stream) {
  if (home_ != BoundaryHome::kNvme || key.gradient) {
    Buffer& b = direct(key);
    STRATA_CHECK(b.data != nullptr && b.nbytes == nbytes, kInternal,
                 "micro-batch {} at chunk {}: the kept {} holds {} bytes, the slot's {}", key.micro_batch, key.chunk,
                 key.gradient ? "gradient" : "input", b.nbytes, nbytes);
    acc_.copy_async(to, b.data, nbytes, pinned() ? CopyKind::kHostToDevice : CopyKind::kDeviceToDevice, stream);
    return;
  }
  submit_ready_writes();
  Staged* s = staged(key);
  if (s == nullptr) {
    // Not staged (nor prefetched): read now, ahead of the background traffic.
    s = &take(protected_);
    s->key = key;
    s->read = nvme_.io->submit_read(*file_, s->data, stride_, offset_of(key), nvme::IoPriority::kUrgent);
    read_nbytes_ += stride_;
  }
  if (s->read) {
    const nvme::Ticket ticket = *s->read;
    s->read.reset();
    nvme_.io->wait(ticket);
  }
  // A copy in whose write has not started is still in the buffer: the copy out follows it on the stream.
  acc_.copy_async(to, s->data, nbytes, CopyKind::kHostToDevice, stream);
  if (!s->used) s->used = acc_.create_event();
  stream.record(*s->used);
  s->last_use = ++clock_;
}

void KeptBoundaries::prefetch(std::span<const Upcoming> upcoming) {
  if (home_ != BoundaryHome::kNvme) return;
  protected_.clear();
  for (const Upcoming& u : upcoming) protected_.push_back(u.key);
  submit_ready_writes();
  for (const Upcoming& u : upcoming) {
    const BoundaryKey& key = u.key;
    if (!u.read || key.gradient || staged(key) != nullptr) continue;
    // Only a buffer no upcoming boundary needs is taken; none: the rest is read when restored.
    const bool spare = std::any_of(staging_.begin(), staging_.end(), [&](const std::unique_ptr<Staged>& s) {
      return !s->key || std::find(protected_.begin(), protected_.end(), *s->key) == protected_.end();
    });
    if (!spare) return;
    Staged& s = take(protected_);
    s.key = key;
    s.read = nvme_.io->submit_read(*file_, s.data, stride_, offset_of(key));
    read_nbytes_ += stride_;
  }
}

uint64_t KeptBoundaries::offset_of(const BoundaryKey& key) const {
  STRATA_CHECK(key.chunk >= 0 && static_cast<size_t>(key.chunk) < inputs_.size() && key.micro_batch >= 0 &&
                   key.micro_batch < nvme_.micro_batches,
               kInternal, "layer-major boundary of chunk {} micro-batch {}: outside the {} x {} the file holds",
               key.chunk, key.micro_batch, inputs_.size(), nvme_.micro_batches);
  return (static_cast<uint64_t>(key.chunk) * static_cast<uint64_t>(nvme_.micro_batches) +
          static_cast<uint64_t>(key.micro_batch)) *
         stride_;
}

KeptBoundaries::Staged* KeptBoundaries::staged(const BoundaryKey& key) {
  for (auto& s : staging_) {
    if (s->key && *s->key == key) return s.get();
  }
  return nullptr;
}

KeptBoundaries::Staged& KeptBoundaries::take(std::span<const BoundaryKey> spare) {
  // The least recently used buffer that no upcoming boundary needs; all needed: one more buffer.
  Staged* best = nullptr;
  for (auto& s : staging_) {
    if (s->key && std::find(spare.begin(), spare.end(), *s->key) != spare.end()) continue;
    if (!s->key) {
      best = s.get();
      break;
    }
    if (best == nullptr || s->last_use < best->last_use) best = s.get();
  }
  if (best == nullptr) {
    auto s = std::make_unique<Staged>();
    s->data = acc_.allocate_pinned(stride_);
    staging_.push_back(std::move(s));
    best = staging_.back().get();
  }
  settle(*best);
  best->key.reset();
  return *best;
}

void KeptBoundaries::settle(Staged& s) {
  if (s.write_pending) {
    s.copied->synchronize();
    s.write_pending = false;
    s.write = nvme_.io->submit_write(*file_, s.data, stride_, offset_of(*s.key));
  }
  if (s.write) {
    const nvme::Ticket ticket = *s.write;
    s.write.reset();
    nvme_.io->wait(ticket);
  }
  if (s.read) {
    const nvme::Ticket ticket = *s.read;
    s.read.reset();
    nvme_.io->wait(ticket);
  }
  if (s.used) s.used->synchronize();
}

void KeptBoundaries::submit_ready_writes() {
  for (auto& s : staging_) {
    if (!s->write_pending || !s->copied->query()) continue;
    s->write_pending = false;
    s->write = nvme_.io->submit_write(*file_, s->data, stride_, offset_of(*s->key));
  }
}

size_t KeptBoundaries::memory_nbytes() const {
  size_t n = staging_.size() * stride_;
  for (const auto& chunk : inputs_) {
    for (const Buffer& b : chunk) n += b.capacity;
  }
  for (const Buffer& b : grads_) n += b.capacity;
  return n;
}

uint64_t KeptBoundaries::file_nbytes() const { return swap_ ? swap_->total_nbytes() : 0; }

}  // namespace strata::pipeline
