// strata-io measuring core: sequential passes with kSlots requests of one chunk
// each in flight, the checkable data pattern, and fio runs for the ratio.
#include "bench/strata-io/io_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/host_memory.h"

namespace strata::bench {
namespace {

constexpr size_t kBlock = 4096;

uint64_t stamp_value(uint64_t offset, uint64_t seed) {
  // splitmix64 of the offset: a block copied to the wrong place fails the check.
  uint64_t z = offset + seed + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double percentile(std::vector<uint64_t>& values, double q) {
  if (values.empty()) return 0;
  size_t k = static_cast<size_t>(q * static_cast<double>(values.size() - 1) + 0.5);
  std::nth_element(values.begin(), values.begin() + static_cast<long>(k), values.end());
  return static_cast<double>(values[k]);
}

}  // namespace

Pattern::Pattern(uint64_t seed) : seed_(seed), base_(kPeriod) {
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < kPeriod; i += 8) {
    uint64_t v = rng();
    std::memcpy(base_.data() + i, &v, 8);
  }
}

void Pattern::fill(char* buf, uint64_t offset, size_t nbytes) const {
  for (size_t done = 0; done < nbytes;) {
    size_t at = (offset + done) % kPeriod;
    size_t n = std::min(nbytes - done, kPeriod - at);
    std::memcpy(buf + done, base_.data() + at, n);
    done += n;
  }
  stamp(buf, offset, nbytes);
}

void Pattern::stamp(char* buf, uint64_t offset, size_t nbytes) const {
  for (size_t b = 0; b < nbytes; b += kBlock) {
    uint64_t words[2] = {offset + b, stamp_value(offset + b, seed_)};
    std::memcpy(buf + b, words, sizeof(words));
  }
}

uint64_t Pattern::count_wrong(const char* buf, uint64_t offset, size_t nbytes) const {
  uint64_t wrong = 0;
  for (size_t b = 0; b < nbytes; b += kBlock) {
    uint64_t words[2] = {offset + b, stamp_value(offset + b, seed_)};
    size_t at = (offset + b) % kPeriod;
    size_t n = std::min(kBlock, nbytes - b);
    bool ok = std::memcmp(buf + b, words, std::min(n, sizeof(words))) == 0 &&
              (n <= sizeof(words) ||
               std::memcmp(buf + b + sizeof(words), base_.data() + at + sizeof(words),
                           n - sizeof(words)) == 0);
    wrong += ok ? 0 : 1;
  }
  return wrong;
}

IoRunner::IoRunner(std::string path, uint64_t size_nbytes, bool buffered)
    : path_(std::move(path)), size_nbytes_(size_nbytes), pattern_(std::make_unique<Pattern>()) {
  file_ = nvme::File::open(path_, nvme::OpenMode::kReadWrite, !buffered);
  file_.allocate(size_nbytes_);
  device_ = nvme::BlockDevice::of(path_, &device_why_);
}

std::optional<nvme::BlockCounters> IoRunner::counters() const {
  if (!device_) return std::nullopt;
  try {
    return device_->counters();
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::optional<double> IoRunner::request_kib(const std::optional<nvme::BlockCounters>& before,
                                            const std::optional<nvme::BlockCounters>& after,
                                            nvme::IoOp rw) {
  if (!before || !after) return std::nullopt;
  const nvme::BlockCounters d = *after - *before;
  const double nbytes = rw == nvme::IoOp::kRead ? d.read_request_nbytes() : d.write_request_nbytes();
  if (nbytes <= 0) return std::nullopt;
  return nbytes / 1024;
}

IoRunner::~IoRunner() {
  if (slots_) free_locked_host(slots_, kSlots * chunk_nbytes_);
}

void IoRunner::ensure_buffers(size_t chunk_nbytes, nvme::AioHandle& handle) {
  if (chunk_nbytes != chunk_nbytes_) {
    if (slots_) free_locked_host(slots_, kSlots * chunk_nbytes_);
    chunk_nbytes_ = chunk_nbytes;
    slots_ = static_cast<char*>(allocate_locked_host(kSlots * chunk_nbytes_));
    // Base content once; each pass then only stamps offsets (cheap, inside the timing).
    for (int s = 0; s < kSlots; ++s) pattern_->fill(slots_ + s * chunk_nbytes_, 0, chunk_nbytes_);
  }
  std::vector<iovec> regions;
  for (int s = 0; s < kSlots; ++s) regions.push_back({slots_ + s * chunk_nbytes_, chunk_nbytes_});
  handle.register_buffers(regions);
}

std::optional<double> IoRunner::huge_share() const {
  if (!slots_) return std::nullopt;
  const HostBacking backing = host_backing(slots_, kSlots * chunk_nbytes_);
  if (!backing.known || backing.nbytes == 0) return std::nullopt;
  return static_cast<double>(backing.huge_nbytes) / static_cast<double>(backing.nbytes);
}

double IoRunner::pass(nvme::AioHandle& handle, nvme::IoOp rw, uint64_t* wrong) {
  const size_t chunk = chunk_nbytes_;
  nvme::Ticket tickets[kSlots] = {};
  uint64_t offsets[kSlots] = {};
  size_t lengths[kSlots] = {};
  auto retire = [&](int slot) {
    handle.wait(tickets[slot]);
    tickets[slot] = 0;
    if (wrong && rw == nvme::IoOp::kRead) {
      *wrong += pattern_->count_wrong(slots_ + slot * chunk, offsets[slot], lengths[slot]);
    }
  };
  auto t0 = std::chrono::steady_clock::now();
  uint64_t offset = 0;
  for (uint64_t c = 0; offset < size_nbytes_; ++c) {
    int slot = static_cast<int>(c % kSlots);
    if (tickets[slot]) retire(slot);
    size_t len = static_cast<size_t>(std::min<uint64_t>(chunk, size_nbytes_ - offset));
    char* buf = slots_ + slot * chunk;
    offsets[slot] = offset;
    lengths[slot] = len;
    if (rw == nvme::IoOp::kWrite) {
      pattern_->stamp(buf, offset, len);
      tickets[slot] = handle.submit_write(file_, buf, len, offset);
    } else {
      tickets[slot] = handle.submit_read(file_, buf, len, offset);
    }
    offset += len;
  }
  // Retire in submission order so the check sees each slot before reuse.
  uint64_t chunks = (size_nbytes_ + chunk - 1) / chunk;
  for (uint64_t c = chunks > kSlots ? chunks - kSlots : 0; c < chunks; ++c) {
    int slot = static_cast<int>(c % kSlots);
    if (tickets[slot]) retire(slot);
  }
  auto t1 = std::chrono::steady_clock::now();
  if (rw == nvme::IoOp::kWrite) has_pattern_ = true;
  return std::chrono::duration<double>(t1 - t0).count();
}

void IoRunner::prepare(nvme::AioHandle& handle) {
  if (has_pattern_) return;
  pass(handle, nvme::IoOp::kWrite, nullptr);
  // Durable before any timed read: a drive (or virtual disk) still flushing
  // this write from its cache would slow whichever tool's pass came next.
  file_.sync();
}

IoResult IoRunner::run(const IoCase& c, int iters, int warmup, bool check,
                       const std::function<void(int)>& before_pass) {
  STRATA_CHECK(c.bs > 0 && size_nbytes_ % c.bs == 0, kBadArgument,
               "--size {} must be a multiple of --bs {}", size_nbytes_, c.bs);
  nvme::AioOptions options;
  options.engine = c.engine;
  options.block_size = c.bs;
  options.queue_depth = c.qd;
  options.thread_count = c.threads;
  options.auto_tune = c.auto_tune;
  options.auto_tune_nbytes = c.auto_tune_nbytes;
  nvme::AioHandle handle(options);
  // A chunk per request: enough pieces to fill every worker's queue, a multiple
  // of bs and of the pattern period, at most 256 MiB so registration stays small.
  // With auto_tune: enough for the candidate with the most bytes in flight, so
  // the tool's own request pipeline does not cap what the tuner measures.
  size_t unit = std::lcm(c.bs, Pattern::kPeriod);
  size_t in_flight_nbytes = 0;
  for (const nvme::IoSetting& s : options.tune_candidates()) {
    unit = std::lcm(unit, s.block_size);
    in_flight_nbytes = std::max(in_flight_nbytes, s.block_size * static_cast<size_t>(s.queue_depth));
  }
  size_t want = std::clamp<size_t>(in_flight_nbytes * static_cast<size_t>(c.threads), 16u << 20,
                                   256u << 20);
  size_t chunk = std::max(unit, (want + unit - 1) / unit * unit);
  ensure_buffers(chunk, handle);
  if (c.rw == nvme::IoOp::kRead) prepare(handle);

  IoResult result;
  result.c = c;
  result.size_nbytes = size_nbytes_;
  result.huge_share = huge_share();
  for (int i = 0; i < warmup; ++i) pass(handle, c.rw, nullptr);
  if (c.auto_tune) {
    // The tuner needs auto_tune_nbytes of this direction's traffic (and the
    // last of its pieces back); the cap only guards against a tuner that
    // never settles, which would be a bug worth an error.
    const uint64_t cap = options.auto_tune_nbytes / size_nbytes_ + 4;
    while (!handle.auto_tune_report(c.rw).settled) {
      STRATA_CHECK(result.tuning_gbps.size() < cap, kInternal,
                   "aio.auto_tune did not settle after {} passes of {} bytes", cap, size_nbytes_);
      result.tuning_gbps.push_back(static_cast<double>(size_nbytes_) / pass(handle, c.rw, nullptr) / 1e9);
    }
    result.tune = handle.auto_tune_report(c.rw);
  }
  handle.take_latencies_ns();
  handle.set_record_latency(true);
  for (int i = 0; i < iters; ++i) {
    if (before_pass) before_pass(i);
    // fio may have overwritten the file: a read pass needs the pattern back.
    if (c.rw == nvme::IoOp::kRead && !has_pattern_) {
      handle.set_record_latency(false);
      prepare(handle);
      handle.take_latencies_ns();
      handle.set_record_latency(true);
    }
    const auto before = counters();
    double seconds = pass(handle, c.rw, nullptr);
    result.gbps.push_back(static_cast<double>(size_nbytes_) / seconds / 1e9);
    if (auto kib = request_kib(before, counters(), c.rw)) result.req_kib.push_back(*kib);
  }
  handle.set_record_latency(false);
  std::vector<uint64_t> lat = handle.take_latencies_ns();
  result.lat_p50_us = percentile(lat, 0.50) / 1e3;
  result.lat_p99_us = percentile(lat, 0.99) / 1e3;
  result.gbps_median = median(result.gbps);
  // IOPS in the pieces the timed passes used (auto_tune's choice, if on).
  const size_t piece_nbytes = result.tune ? result.tune->chosen.block_size : c.bs;
  result.iops = result.gbps_median * 1e9 / static_cast<double>(piece_nbytes);
  if (check) {
    uint64_t wrong = 0;
    pass(handle, nvme::IoOp::kRead, &wrong);
    result.wrong = wrong;
  }
  return result;
}

double run_fio(const IoCase& c, const std::string& engine, const std::string& path,
               uint64_t size_nbytes, bool buffered) {
  // Each of the `threads` jobs covers its own 1/threads of the file, as our workers do together.
  uint64_t per_job = size_nbytes / static_cast<uint64_t>(c.threads) / c.bs * c.bs;
  std::string command = fmt::format(
      "fio --name=strata-io --filename='{}' --rw={} --bs={} --iodepth={} --numjobs={} "
      "--size={} --offset_increment={} --ioengine={} --direct={} --group_reporting "
      "--output-format=json 2>&1",
      path, c.rw == nvme::IoOp::kRead ? "read" : "write", c.bs, c.qd, c.threads, per_job, per_job,
      engine, buffered ? 0 : 1);
  FILE* pipe = ::popen(command.c_str(), "r");
  STRATA_CHECK(pipe != nullptr, kIo, "cannot start fio: {}", command);
  std::string output;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) output.append(buf, n);
  int status = ::pclose(pipe);
  STRATA_CHECK(status == 0, kIo, "fio failed (status {}): {}\n{}", status, command, output);
  // fio may print notes before the JSON document.
  size_t start = output.find('{');
  STRATA_CHECK(start != std::string::npos, kIo, "no JSON in fio output: {}", output);
  nlohmann::json doc = nlohmann::json::parse(output.substr(start), nullptr, false);
  STRATA_CHECK(!doc.is_discarded() && doc.contains("jobs") && !doc["jobs"].empty(), kIo,
               "cannot parse fio JSON output: {}", output);
  const auto& job = doc["jobs"][0][c.rw == nvme::IoOp::kRead ? "read" : "write"];
  double runtime_ms = doc["jobs"][0].value("job_runtime", 0.0);
  STRATA_CHECK(runtime_ms > 0, kIo, "fio reported no runtime: {}", output);
  // job_runtime is summed over jobs under group_reporting; bw_bytes is the aggregate.
  return job.value("bw_bytes", 0.0) / 1e9;
}

}  // namespace strata::bench
