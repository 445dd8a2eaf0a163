// Chrome trace-event JSON from the threads' published events, streamed to the
// file in 1 MiB pieces so that a large trace never exists twice in memory.
#include "core/trace_writer.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "core/error.h"

namespace strata::trace {
namespace {

constexpr size_t kFlushAt = size_t{1} << 20;

// Microseconds with nanosecond digits: Chrome's unit, Perfetto keeps the ns.
void append_us(std::string& out, int64_t ns) {
  if (ns < 0) {
    out += '-';
    ns = -ns;
  }
  fmt::format_to(std::back_inserter(out), "{}.{:03}", ns / 1000, ns % 1000);
}

// Length of the valid UTF-8 sequence at s[i], or 0.
size_t utf8_length(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xc0) != 0x80) return 0;
  }
  // Overlong forms and surrogates are invalid too (JSON parsers reject them).
  if (n == 2 && c < 0xc2) return 0;
  if (n == 3 && ((c == 0xe0 && b(i + 1) < 0xa0) || (c == 0xed && b(i + 1) >= 0xa0))) return 0;
  if (n == 4 && ((c == 0xf0 && b(i + 1) < 0x90) || c > 0xf4 || (c == 0xf4 && b(i + 1) >= 0x90))) return 0;
  return n;
}

class JsonOut {
 public:
  JsonOut(std::FILE* file, const std::string& path) : file_(file), path_(path) { buf_.reserve(kFlushAt * 2); }
  std::string& buf() { return buf_; }
  void maybe_flush() {
    if (buf_.size() >= kFlushAt) flush();
  }
  void flush() {
    if (!buf_.empty() && std::fwrite(buf_.data(), 1, buf_.size(), file_) != buf_.size()) {
      raise(ErrorCategory::kIo, "writing the trace {} failed: {}", path_, std::strerror(errno));
    }
    buf_.clear();
  }

 private:
  std::FILE* file_;
  const std::string& path_;
  std::string buf_;
};

void append_metadata(std::string& out, const char* what, int pid, int64_t tid, std::string_view name) {
  fmt::format_to(std::back_inserter(out), "{{\"name\":\"{}\",\"ph\":\"M\",\"ts\":0,\"pid\":{},\"tid\":{},\"args\":{{\"name\":",
                 what, pid, tid);
  append_json_string(out, name);
  out += "}}";
}

void append_event(std::string& out, const ThreadBuffer& buffer, const Event& e, bool done, int pid) {
  const int64_t tid = e.track == 0 ? buffer.tid : kVirtualTrackBase + e.track;
  out += "{\"name\":";
  append_json_string(out, buffer.text(e.name_at, e.name_len));
  if (e.category != nullptr) {
    out += ",\"cat\":";
    append_json_string(out, e.category);
  }
  const char* ph = e.kind == EventKind::kCounter ? "C" : e.kind == EventKind::kInstant ? "i" : done ? "X" : "B";
  fmt::format_to(std::back_inserter(out), ",\"ph\":\"{}\",\"ts\":", ph);
  append_us(out, e.begin_ns);
  // end_ns and the args are published only once done (trace_buffer.h).
  const int64_t dur_ns = done ? std::max<int64_t>(0, e.end_ns - e.begin_ns) : 0;
  if (e.kind == EventKind::kComplete && done) {
    out += ",\"dur\":";
    append_us(out, dur_ns);
  }
  if (e.kind == EventKind::kInstant) out += ",\"s\":\"t\"";
  fmt::format_to(std::back_inserter(out), ",\"pid\":{},\"tid\":{}", pid, tid);
  if (e.kind == EventKind::kCounter) {
    fmt::format_to(std::back_inserter(out), ",\"args\":{{\"value\":{}}}}}", e.value);
    return;
  }
  if (!done) {  // only the begin fields are published for a span still open
    out += ",\"args\":{\"unfinished\":true}}";
    return;
  }
  std::string_view sep = "";
  const auto key = [&](std::string_view k) {
    out += sep;
    append_json_string(out, k);
    out += ':';
    sep = ",";
  };
  out += ",\"args\":{";
  if (e.bytes != Args::kNoBytes) {
    key("bytes");
    fmt::format_to(std::back_inserter(out), "{}", e.bytes);
    if (e.kind == EventKind::kComplete && dur_ns > 0) {
      key("GB/s");  // bytes per nanosecond
      fmt::format_to(std::back_inserter(out), "{:.3f}", static_cast<double>(e.bytes) / static_cast<double>(dur_ns));
    }
  }
  if (e.offset >= 0) {
    key("offset");
    fmt::format_to(std::back_inserter(out), "{}", e.offset);
  }
  if (e.detail_key != nullptr) {
    key(e.detail_key);
    append_json_string(out, buffer.text(e.detail_at, e.detail_len));
  }
  if (e.value_key != nullptr) {
    key(e.value_key);
    fmt::format_to(std::back_inserter(out), "{}", e.value);
    // An op's arithmetic: the viewer shows its rate beside its time.
    if (std::string_view(e.value_key) == "flops" && e.kind == EventKind::kComplete && dur_ns > 0) {
      key("GFLOP/s");  // flops per nanosecond
      fmt::format_to(std::back_inserter(out), "{:.3f}", static_cast<double>(e.value) / static_cast<double>(dur_ns));
    }
  }
  out += "}}";
}

}  // namespace

void append_json_string(std::string& out, std::string_view text) {
  out += '"';
  for (size_t i = 0; i < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
      ++i;
    } else if (c < 0x20) {
      fmt::format_to(std::back_inserter(out), "\\u{:04x}", c);
      ++i;
    } else if (c < 0x80) {
      out += static_cast<char>(c);
      ++i;
    } else if (const size_t n = utf8_length(text, i); n > 0) {
      out.append(text.substr(i, n));
      i += n;
    } else {
      out += "\xef\xbf\xbd";  // U+FFFD
      ++i;
    }
  }
  out += '"';
}

Summary write_chrome_json(std::FILE* file, const std::string& path, const WriteInput& input) {
  JsonOut json(file, path);
  std::string& out = json.buf();
  Summary summary;
  const int pid = input.rank;
  out += "{\"traceEvents\":[\n";
  // Every element but the first (the process name) is preceded by ",\n".
  const auto next = [&] { out += ",\n"; };
  append_metadata(out, "process_name", pid, 0,
                  input.process_name.empty() ? fmt::format("strata rank {}", input.rank) : input.process_name);
  std::set<uint32_t> tracks_used;
  for (const WriteInput::Thread& thread : input.threads) {
    summary.dropped += thread.dropped;
    if (thread.count == 0) continue;
    ++summary.threads;
    next();
    append_metadata(out, "thread_name", pid, thread.buffer->tid,
                    thread.name.empty() ? fmt::format("thread {}", thread.buffer->tid) : thread.name);
    for (size_t i = 0; i < thread.count; ++i) {
      const Event& e = thread.buffer->at(i);
      const bool done = e.done.load(std::memory_order_acquire) != 0;
      if (e.track != 0) tracks_used.insert(e.track);
      next();
      append_event(out, *thread.buffer, e, done, pid);
      ++summary.events;
      json.maybe_flush();
    }
  }
  for (uint32_t track : tracks_used) {
    const std::string& name = track <= input.tracks.size() ? input.tracks[track - 1] : std::string();
    next();
    append_metadata(out, "thread_name", pid, kVirtualTrackBase + track,
                    name.empty() ? fmt::format("track {}", track) : name);
    ++summary.threads;
  }
  out += "\n],\n\"displayTimeUnit\":\"ms\",\n";
  fmt::format_to(std::back_inserter(out),
                 "\"otherData\":{{\"producer\":\"strata\",\"rank\":{},\"world_size\":{},"
                 "\"clock\":\"CLOCK_MONOTONIC\",\"events\":{},\"dropped_events\":{},"
                 "\"max_events_per_thread\":{}}}}}\n",
                 input.rank, input.world_size, summary.events, summary.dropped, input.max_events_per_thread);
  json.flush();
  return summary;
}

}  // namespace strata::trace
