// The trace recorder (core/trace_recorder.h): the file it writes is
// Chrome trace-event JSON with one named track per thread, bounded per
// thread, written atomically; bad paths fail at start. And the I/O workers'
// and the Gloo communicator's spans, recorded by the real code paths.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "nvme/aio_handle.h"
#include "core/error.h"
#include "core/trace_recorder.h"
#include "tests/nvme/test_util.h"
#include "tests/partition/thread_ranks.h"
#include "tests/runtime/trace_checks.h"
#include "tests/support/temp_dir.h"

namespace trace = strata::trace;
using strata::test::read_trace;

namespace {

trace::Options options_for(const std::string& path, int rank = 0) {
  trace::Options o;
  o.path = path;
  o.rank = rank;
  return o;
}

}  // namespace

TEST_CASE("trace: expand_path substitutes {rank} or adds .rank<N> with several ranks", "[trace]") {
  CHECK(trace::expand_path("t.json", 0, 1) == "t.json");
  CHECK(trace::expand_path("t.json", 1, 2) == "t.rank1.json");
  CHECK(trace::expand_path("out/trace", 3, 4) == "out/trace.rank3");
  CHECK(trace::expand_path("t-{rank}.json", 2, 4) == "t-2.json");
  CHECK(trace::expand_path("{rank}/t{rank}.json", 5, 1) == "5/t5.json");
  CHECK(trace::expand_path(".json", 1, 2) == ".json.rank1");
}

TEST_CASE("trace: spans on several threads become named tracks with bytes and GB/s", "[trace]") {
  strata::test::TempDir dir("trace");
  const std::string path = dir.file("t.json");
  {
    trace::Span off("phase", "before start");  // recording is off: nothing
    CHECK_FALSE(off.recording());
  }
  CHECK(trace::stop().path.empty());  // nothing to stop

  trace::Options o = options_for(path, 3);
  trace::start(o);
  CHECK(trace::enabled());
  trace::name_this_thread("main loop");
  const trace::Track gpu = trace::make_track("gpu stream compute");
  {
    trace::Span outer("phase", "step");
    outer.value("step", 7);
    {
      trace::Span inner("io", "read");
      CHECK(inner.recording());
      inner.bytes(1 << 20).offset(4096).detail("file", "/swap/\"quoted\"\\ \x01 \xff name");
    }
    trace::instant("phase", "marker");
    trace::counter("pinned bytes", 12345);
    const int64_t t0 = trace::now_ns();
    trace::Args args;
    args.bytes = 5000;
    trace::complete(gpu, "engine", "matmul", t0, t0 + 5000, args);
  }
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([i] {
      trace::name_this_thread("worker " + std::to_string(i));
      trace::name_this_thread("ignored", /*replace=*/false);
      for (int k = 0; k < 10; ++k) {
        trace::Span span("comm", "allgather");
        span.bytes(1000).detail("comm", "test");
      }
    });
  }
  for (auto& t : threads) t.join();  // exited threads' events are still written
  const trace::Summary summary = trace::stop();
  CHECK_FALSE(trace::enabled());
  CHECK(summary.path == path);
  CHECK(summary.dropped == 0);
  CHECK(summary.threads == 5);  // main, 3 workers, the virtual track
  CHECK(summary.events == 5 + 30);
  CHECK_FALSE(std::filesystem::exists(path + ".tmp" + std::to_string(::getpid())));

  const auto t = read_trace(path, 3);
  CHECK(t.process_name == "strata rank 3");
  CHECK(t.json["otherData"]["rank"] == 3);
  CHECK(t.events.size() == summary.events);
  CHECK(t.tids_named("main loop").size() == 1);
  CHECK(t.tids_named("gpu stream compute").size() == 1);
  CHECK(*t.tids_named("gpu stream compute").begin() >= (int64_t{1} << 30));
  std::set<int64_t> worker_tids = t.tids_named("worker ");
  CHECK(worker_tids.size() == 3);  // distinct tids, named by each thread itself
  for (const auto& [tid, name] : t.thread_names) CHECK(name != "ignored");
  const auto gathers = t.of("comm", "allgather");
  REQUIRE(gathers.size() == 30);
  for (const auto& e : gathers) {
    CHECK(worker_tids.count(e["tid"].get<int64_t>()) == 1);
    CHECK(e["args"]["bytes"] == 1000);
    CHECK(e["args"]["comm"] == "test");
  }
  const auto reads = t.of("io", "read");
  REQUIRE(reads.size() == 1);
  CHECK(reads[0]["args"]["bytes"] == 1 << 20);
  CHECK(reads[0]["args"]["offset"] == 4096);
  CHECK(reads[0]["args"]["file"] == "/swap/\"quoted\"\\ \x01 \xef\xbf\xbd name");  // invalid byte replaced
  const auto steps = t.of("phase", "step");
  REQUIRE(steps.size() == 1);
  CHECK(steps[0]["args"]["step"] == 7);
  // The read nests inside the step on the same track.
  CHECK(steps[0]["tid"] == reads[0]["tid"]);
  CHECK(steps[0]["ts"].get<double>() <= reads[0]["ts"].get<double>());
  CHECK(steps[0]["ts"].get<double>() + steps[0]["dur"].get<double>() >=
        reads[0]["ts"].get<double>() + reads[0]["dur"].get<double>());
  const auto matmul = t.of("engine", "matmul");
  REQUIRE(matmul.size() == 1);
  CHECK(matmul[0]["dur"].get<double>() == Approx(5.0));
  CHECK(matmul[0]["args"]["GB/s"].get<double>() == Approx(1.0));  // 5000 bytes in 5 us
  CHECK(t.of("phase", "marker").at(0)["ph"] == "i");
  const auto counters = t.of("counter", "pinned bytes");
  REQUIRE(counters.size() == 1);
  CHECK(counters[0]["ph"] == "C");
  CHECK(counters[0]["args"]["value"] == 12345);
}

TEST_CASE("trace: per-thread bounds drop later events and count them", "[trace]") {
  strata::test::TempDir dir("trace");
  trace::Options o = options_for(dir.file("bounded.json"));
  o.max_events_per_thread = 10;
  trace::start(o);
  for (int i = 0; i < 25; ++i) trace::Span span("phase", "tick");
  std::thread([] {
    for (int i = 0; i < 4; ++i) trace::instant("phase", "other thread");
  }).join();
  const trace::Summary summary = trace::stop();
  CHECK(summary.events == 14);
  CHECK(summary.dropped == 15);
  const auto t = read_trace(dir.file("bounded.json"), 0);
  CHECK(t.json["otherData"]["dropped_events"] == 15);
  CHECK(t.of("phase", "tick").size() == 10);  // the first ten are kept

  // The next session has the default bounds again and none of these events.
  trace::start(options_for(dir.file("second.json")));
  for (int i = 0; i < 25; ++i) trace::Span span("phase", "tock");
  CHECK(trace::stop().dropped == 0);
  const auto second = read_trace(dir.file("second.json"), 0);
  CHECK(second.of("phase", "tock").size() == 25);
  CHECK(second.of("phase", "tick").empty());
}

TEST_CASE("trace: a span open at stop is written unfinished, ending it later harms nothing", "[trace]") {
  strata::test::TempDir dir("trace");
  trace::start(options_for(dir.file("a.json")));
  auto open = std::make_unique<trace::Span>("phase", "hung collective");
  trace::stop();
  const auto a = read_trace(dir.file("a.json"), 0);
  REQUIRE(a.events.size() == 1);
  CHECK(a.events[0]["ph"] == "B");
  CHECK(a.events[0]["args"]["unfinished"] == true);

  // A new session reuses this thread's buffer; the old span must not write into it.
  trace::start(options_for(dir.file("b.json")));
  {
    trace::Span fresh("phase", "fresh");
    open->bytes(99).detail("op", "stale");
    open.reset();
  }
  trace::stop();
  const auto b = read_trace(dir.file("b.json"), 0);
  REQUIRE(b.events.size() == 1);
  CHECK(b.events[0]["name"] == "fresh");
  CHECK(b.events[0]["ph"] == "X");
  CHECK_FALSE((b.events[0].contains("args") && b.events[0]["args"].contains("bytes")));
}

TEST_CASE("trace: threads keep recording while sessions start and stop", "[trace]") {
  // The lock-free publication between recording threads and the writer
  // (trace_buffer.h); under ThreadSanitizer (scripts/test --tsan) this is the race check.
  strata::test::TempDir dir("trace");
  std::atomic<bool> quit{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      trace::name_this_thread("spinner " + std::to_string(i));
      while (!quit.load()) {
        trace::Span outer("phase", "outer");
        outer.value("thread", i);
        trace::Span inner("io", "inner");
        inner.bytes(64).detail("file", "f");
        trace::counter("spins", i);
      }
    });
  }
  for (int session = 0; session < 5; ++session) {
    const std::string path = dir.file("s" + std::to_string(session) + ".json");
    trace::Options o = options_for(path);
    o.max_events_per_thread = 5000;  // also exercises dropping under load
    trace::start(o);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    trace::stop();
    const auto t = read_trace(path, 0);
    for (const auto& e : t.events) CHECK((e["ph"] == "X" || e["ph"] == "B" || e["ph"] == "C"));
  }
  quit = true;
  for (auto& t : threads) t.join();
}

TEST_CASE("trace: bad paths fail at start with the path named, a second start is refused", "[trace]") {
  strata::test::TempDir dir("trace");
  const std::string missing = dir.file("no/such/dir/t.json");
  CHECK_THROWS_WITH(trace::start(options_for(missing)),
                    Catch::Contains("cannot create the trace file " + missing) &&
                        Catch::Contains("No such file or directory"));
  CHECK_FALSE(trace::enabled());
  CHECK_THROWS_WITH(trace::start(options_for(dir.path().string())), Catch::Contains("is a directory"));
  CHECK_THROWS_WITH(trace::start(options_for("")), Catch::Contains("path is empty"));
  trace::Options zero = options_for(dir.file("z.json"));
  zero.max_events_per_thread = 0;
  CHECK_THROWS_WITH(trace::start(zero), Catch::Contains("bounds must be positive"));

  trace::start(options_for(dir.file("one.json")));
  try {
    trace::start(options_for(dir.file("two.json")));
    FAIL("a second start while recording must throw");
  } catch (const strata::Error& e) {
    CHECK(e.category() == strata::ErrorCategory::kBadArgument);
    CHECK_THAT(e.message(), Catch::Contains("already being recorded") && Catch::Contains("one.json"));
  }
  trace::stop();
  CHECK(std::filesystem::exists(dir.file("one.json")));
  CHECK_FALSE(std::filesystem::exists(dir.file("two.json")));
}

TEST_CASE("trace: I/O workers record a span per request run with bytes, file and offset", "[trace]") {
  using namespace strata::nvme;
  strata::test::TempDir dir("trace-io");
  AioOptions options = strata::nvme::test::options_for(EngineKind::kPsync, 2);
  options.block_size = 64 << 10;
  const size_t kBytes = 1 << 20;  // 16 pieces, 8 per worker
  auto buffer = strata::nvme::test::aligned_buffer(kBytes);
  strata::nvme::test::fill_random(buffer.get(), kBytes, 1);
  File file = File::open(dir.file("data.bin"), OpenMode::kTruncate, /*direct=*/false);
  {
    AioHandle untraced(options);  // before any session: workers are named anyway
    untraced.write(file, buffer.get(), kBytes, 0);
  }
  AioHandle handle(options);
  trace::start(options_for(dir.file("io.json")));
  handle.write(file, buffer.get(), kBytes, 4096);
  handle.read(file, buffer.get(), kBytes, 4096);
  const trace::Summary summary = trace::stop();
  CHECK(summary.dropped == 0);

  const auto t = read_trace(dir.file("io.json"), 0);
  const std::set<int64_t> workers = t.tids_named("io worker ");
  for (const std::string op : {"write", "read"}) {
    INFO(op);
    const auto spans = t.of("io", op);
    REQUIRE_FALSE(spans.empty());
    uint64_t bytes = 0;
    std::set<int64_t> tids;
    for (const auto& e : spans) {
      bytes += e["args"]["bytes"].get<uint64_t>();
      tids.insert(e["tid"].get<int64_t>());
      CHECK(e["args"]["file"] == file.path());
      CHECK(e["args"]["offset"].get<uint64_t>() >= 4096);
      CHECK(e["args"]["pieces"].get<int64_t>() >= 1);
      CHECK(workers.count(e["tid"].get<int64_t>()) == 1);
    }
    CHECK(bytes == kBytes);
    CHECK(tids.size() == 2);  // each worker took its run of the request
  }
  // Spans on one worker's track never overlap (each starts after the previous ends).
  std::map<int64_t, std::vector<std::pair<double, double>>> by_tid;
  for (const auto& e : t.of("io")) {
    by_tid[e["tid"]].push_back({e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>()});
  }
  for (auto& [tid, spans] : by_tid) {
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i) CHECK(spans[i].first >= spans[i - 1].second - 1e-3);
  }
}

TEST_CASE("trace: Gloo collectives are spans on the stream thread that runs them, with algbw bytes", "[trace]") {
  strata::test::TempDir dir("trace-comm");
  trace::start(options_for(dir.file("comm.json")));
  constexpr size_t kNumel = 1000;
  strata::test::run_thread_ranks(2, [&](int rank, strata::partition::Communicator& comm, strata::Accelerator&,
                                        strata::Stream& stream) {
    std::vector<float> send(kNumel, static_cast<float>(rank)), gathered(2 * kNumel), reduced(kNumel);
    comm.allgather(send.data(), gathered.data(), kNumel, strata::DType::kF32, stream);
    comm.reduce_scatter(gathered.data(), reduced.data(), kNumel, strata::DType::kF32,
                        strata::partition::ReduceOp::kSum, stream);
    comm.allreduce(reduced.data(), reduced.data(), kNumel, strata::DType::kF32, strata::partition::ReduceOp::kSum,
                   stream);
    stream.synchronize();
  });
  trace::stop();
  const auto t = read_trace(dir.file("comm.json"), 0);
  const std::set<int64_t> comm_tids = t.tids_named("comm ");
  CHECK(comm_tids.size() == 2);  // the two ranks' stream threads
  const std::pair<const char*, uint64_t> expected[] = {
      {"allgather", 2 * kNumel * 4}, {"reduce_scatter", 2 * kNumel * 4}, {"allreduce", kNumel * 4}};
  for (const auto& [name, bytes] : expected) {
    INFO(name);
    const auto spans = t.of("comm", name);
    REQUIRE(spans.size() == 2);
    for (const auto& e : spans) {
      CHECK(e["args"]["bytes"] == bytes);
      CHECK(e["args"]["comm"] == "strata/comm");
      CHECK(comm_tids.count(e["tid"].get<int64_t>()) == 1);
    }
    CHECK(spans[0]["tid"] != spans[1]["tid"]);
  }
}

// Not run by default (hidden tag): what one span costs, on and off. For
// bench/PERFORMANCE.md; prints, asserts nothing about time.
TEST_CASE("trace: cost of a span", "[.][trace-cost]") {
  strata::test::TempDir dir("trace-cost");
  constexpr int kSpans = 200000;
  const auto time_spans = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kSpans; ++i) {
      trace::Span span("engine", "op");
      span.bytes(static_cast<uint64_t>(i)).detail("op", "layers.0.self_attn.q_proj");
    }
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / kSpans;
  };
  const double off = time_spans();
  trace::Options o = options_for(dir.file("cost.json"));
  o.max_events_per_thread = kSpans;
  // The first session allocates and first touches this thread's chunks; the
  // second reuses them (what a long run sees is in between).
  double on[2] = {0, 0};
  for (double& cost : on) {
    trace::start(o);
    cost = time_spans();
    const auto write0 = std::chrono::steady_clock::now();
    const trace::Summary s = trace::stop();
    const double write_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - write0).count();
    std::printf("writing %llu events: %.3f s (%.0f MB)\n", static_cast<unsigned long long>(s.events), write_s,
                static_cast<double>(std::filesystem::file_size(dir.file("cost.json"))) / 1e6);
    CHECK(s.events == kSpans);
  }
  const int64_t t0 = trace::now_ns();
  for (int i = 0; i < kSpans; ++i) (void)trace::now_ns();
  std::printf("span (with bytes and an op name) off: %.1f ns, on: %.1f ns (new chunks), %.1f ns (reused); "
              "one clock read %.1f ns\n",
              off, on[0], on[1], static_cast<double>(trace::now_ns() - t0) / kSpans);
}
