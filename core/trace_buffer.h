// Internal to the trace recorder (trace_recorder.cc, trace_writer.cc): the
// event record and the per-thread buffer. Not an API; use trace_recorder.h.
//
// Publication protocol (no lock on the recording path): only the owning
// thread writes its buffer. It fills an event's begin fields and its name,
// then publishes the slot with count.store(release); the end fields and args
// are written before done.store(release). The writer (stop()) reads
// count/done with acquire and only what they publish. A buffer is reset by
// its owner, never by the writer, when the owner first records in a new
// session; sessions change only between two stop()/start() calls, both under
// the recorder's mutex, so a writer never reads a buffer being reset.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

namespace strata::trace {

enum class EventKind : uint8_t { kComplete, kInstant, kCounter };

struct Event {
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
  const char* category = nullptr;
  const char* detail_key = nullptr;
  const char* value_key = nullptr;
  uint64_t bytes = ~uint64_t{0};
  int64_t offset = -1;
  int64_t value = 0;
  uint32_t name_at = 0, detail_at = 0;  // positions in the thread's string arena
  uint16_t name_len = 0, detail_len = 0;
  uint32_t track = 0;  // 0: the owning thread's track
  EventKind kind = EventKind::kComplete;
  std::atomic<uint8_t> done{0};
};

// Chunked storage, allocated as it fills, never moved: a Span keeps a pointer
// to its event. Chunk pointers are published by the count that covers them.
class ThreadBuffer {
 public:
  static constexpr size_t kEventsPerChunk = 4096;
  static constexpr size_t kStringChunk = 64 * 1024;
  static constexpr size_t kMaxString = 1024;  // longer names are truncated

  ThreadBuffer(int64_t tid, size_t max_events, size_t max_string_bytes);

  // Owner only. The next event slot, or nullptr (dropped) when the bound is
  // reached or memory runs out. The slot's done flag is cleared.
  Event* reserve() noexcept;
  // Owner only, after filling the slot from reserve(): makes it visible.
  void publish() noexcept { count.store(reserved_, std::memory_order_release); }
  // Owner only. Copies text into the arena; false when the arena is full.
  bool store(std::string_view text, uint32_t& at, uint16_t& len) noexcept;
  // Owner only: empties the buffer for `session`, with new bounds.
  void reset(uint32_t session, size_t max_events, size_t max_string_bytes) noexcept;

  // Writer, after acquiring count: the event at index i and a stored text.
  const Event& at(size_t i) const { return chunks_[i / kEventsPerChunk][i % kEventsPerChunk]; }
  std::string_view text(uint32_t at, uint16_t len) const {
    return {strings_[at / kStringChunk].get() + at % kStringChunk, len};
  }

  const int64_t tid;
  std::atomic<uint32_t> session{0};
  std::atomic<size_t> count{0};
  std::atomic<uint64_t> dropped{0};
  std::atomic<bool> alive{true};  // false once the owning thread has exited

  std::string name() const;
  void set_name(std::string_view name, bool replace);

 private:
  size_t max_events_ = 0, max_string_bytes_ = 0;
  size_t reserved_ = 0;    // owner's count, ahead of `count` while a slot is filled
  size_t string_pos_ = 0;  // owner's arena fill
  std::unique_ptr<std::unique_ptr<Event[]>[]> chunks_;
  size_t chunk_slots_ = 0;
  std::unique_ptr<std::unique_ptr<char[]>[]> strings_;
  size_t string_slots_ = 0;
  mutable std::mutex name_mutex_;
  std::string name_;  // guarded by name_mutex_
};

}  // namespace strata::trace
