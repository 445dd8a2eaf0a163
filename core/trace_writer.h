// Internal to the trace recorder: writes what the threads' buffers published
// as Chrome trace-event JSON. Not an API; use trace_recorder.h.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/trace_buffer.h"
#include "core/trace_recorder.h"

namespace strata::trace {

struct WriteInput {
  struct Thread {
    const ThreadBuffer* buffer = nullptr;
    size_t count = 0;     // events published (acquired) at stop
    std::string name;     // the track's name; empty: "thread <tid>"
    uint64_t dropped = 0;
  };
  std::vector<Thread> threads;
  std::vector<std::string> tracks;  // virtual tracks' names, id = index + 1
  int rank = 0, world_size = 1;
  std::string process_name;
  size_t max_events_per_thread = 0;
};

// The virtual track id's tid in the file (above any Linux thread id).
constexpr int64_t kVirtualTrackBase = int64_t{1} << 30;

// Writes the whole file to `out`. Returns the counts (path left empty).
// Throws Error(kIo) when a write fails (`path` names the file in the message).
Summary write_chrome_json(std::FILE* out, const std::string& path, const WriteInput& input);

// Appends `text` as a JSON string literal (quotes included): control
// characters escaped, bytes that are not valid UTF-8 replaced by U+FFFD.
void append_json_string(std::string& out, std::string_view text);

}  // namespace strata::trace
