// LoraSpec's rules and the --lora-targets list.
#include "runtime/nn/lora.h"

#include <algorithm>
#include <cmath>
#include <iterator>

#include "core/error.h"

namespace strata::nn {
namespace {

bool known_projection(std::string_view name) {
  return std::find(std::begin(kLoraProjections), std::end(kLoraProjections), name) !=
         std::end(kLoraProjections);
}

std::string known_list() {
  std::string s;
  for (const char* p : kLoraProjections) s += (s.empty() ? "" : ",") + std::string(p);
  return s;
}

}  // namespace

double LoraSpec::scaling() const {
  return rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

bool LoraSpec::targets_module(std::string_view name) const {
  const size_t dot = name.rfind('.');
  const std::string_view last = dot == std::string_view::npos ? name : name.substr(dot + 1);
  return enabled() && std::find(targets.begin(), targets.end(), last) != targets.end();
}

void LoraSpec::validate() const {
  STRATA_CHECK(rank > 0, kBadArgument, "--lora-rank must be a positive whole number, got {}", rank);
  STRATA_CHECK(std::isfinite(alpha) && alpha > 0, kBadArgument,
               "--lora-alpha must be a positive number, got {}", alpha);
  STRATA_CHECK(dropout >= 0 && dropout < 1, kBadArgument, "--lora-dropout must be in [0, 1), got {}", dropout);
  STRATA_CHECK(!targets.empty(), kBadArgument, "--lora-targets names no projection (known: {})",
               known_list());
  for (size_t i = 0; i < targets.size(); ++i) {
    STRATA_CHECK(known_projection(targets[i]), kBadArgument,
                 "--lora-targets: '{}' is not a projection of the model (known: {}, or all-linear)",
                 targets[i], known_list());
    STRATA_CHECK(std::find(targets.begin(), targets.begin() + static_cast<std::ptrdiff_t>(i),
                           targets[i]) == targets.begin() + static_cast<std::ptrdiff_t>(i),
                 kBadArgument, "--lora-targets names '{}' twice", targets[i]);
  }
}

std::vector<std::string> parse_lora_targets(std::string_view list) {
  if (list == "all-linear") return {std::begin(kLoraProjections), std::end(kLoraProjections)};
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    std::string_view item = list.substr(start, comma - start);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    STRATA_CHECK(!item.empty(), kBadArgument,
                 "--lora-targets '{}' has an empty name (a comma-separated list such as q_proj,v_proj)",
                 list);
    out.emplace_back(item);
    start = comma + 1;
  }
  return out;
}

bool is_lora_parameter(std::string_view name) {
  return name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight");
}

}  // namespace strata::nn
