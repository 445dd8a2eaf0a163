#include "kernels/op_totals.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string_view>

namespace strata::ops {
namespace {

std::mutex g_mutex;
std::map<std::string, OpTotal, std::less<>>& totals() {
  static auto* t = new std::map<std::string, OpTotal, std::less<>>();  // never destroyed: stream threads may outlive statics
  return *t;
}

}  // namespace

void add_op_total(const char* name, int64_t ns, int64_t flops, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& map = totals();
  auto it = map.find(std::string_view(name));
  if (it == map.end()) it = map.emplace(name, OpTotal{name}).first;
  OpTotal& t = it->second;
  t.calls += 1;
  t.seconds += static_cast<double>(ns) * 1e-9;
  t.flops += static_cast<double>(flops);
  if (bytes != ~uint64_t{0}) t.bytes += static_cast<double>(bytes);
}

std::vector<OpTotal> op_totals() {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<OpTotal> out;
  for (const auto& [name, t] : totals()) out.push_back(t);
  std::sort(out.begin(), out.end(), [](const OpTotal& a, const OpTotal& b) { return a.seconds > b.seconds; });
  return out;
}

void reset_op_totals() {
  std::lock_guard<std::mutex> lock(g_mutex);
  totals().clear();
}

std::string op_totals_table(const std::vector<OpTotal>& totals, const std::string& indent) {
  if (totals.empty()) return "";
  double all = 0;
  for (const OpTotal& t : totals) all += t.seconds;
  std::string out = fmt::format("{}{:<20} {:>7} {:>10} {:>6} {:>12}\n", indent, "op", "calls", "seconds", "share", "rate");
  for (const OpTotal& t : totals) {
    std::string rate = "-";
    if (t.seconds > 0 && t.flops > 0) {
      rate = fmt::format("{:.1f} GFLOP/s", t.flops / t.seconds / 1e9);
    } else if (t.seconds > 0 && t.bytes > 0) {
      rate = fmt::format("{:.2f} GB/s", t.bytes / t.seconds / 1e9);
    }
    out += fmt::format("{}{:<20} {:>7} {:>10.4f} {:>5.1f}% {:>12}\n", indent, t.name, t.calls, t.seconds,
                       all > 0 ? 100 * t.seconds / all : 0.0, rate);
  }
  return out;
}

}  // namespace strata::ops
