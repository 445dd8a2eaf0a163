// DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR as functions of the step.
#include "runtime/engine/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace strata::engine {
namespace {

double warmup_gamma(double i, double w, bool linear) {
  return linear ? i / w : std::log(i + 1) / std::log(w);
}

}  // namespace

double LrSchedule::lr(int64_t completed_steps) const {
  const double i = static_cast<double>(completed_steps - 1);  // DeepSpeed's last_batch_iteration
  const double w = static_cast<double>(std::max<int64_t>(2, warmup_num_steps));
  const double t = static_cast<double>(total_num_steps);
  switch (kind) {
    case Kind::kConstant: return base_lr;
    case Kind::kWarmupLR:
    case Kind::kWarmupDecayLR: {
      const double max_lr = warmup_max_lr < 0 ? base_lr : warmup_max_lr;
      if (i < 0) return warmup_min_lr;
      double gamma = 1.0;
      if (i < w) {
        gamma = warmup_gamma(i, w, linear_warmup);
      } else if (kind == Kind::kWarmupDecayLR) {
        gamma = std::max(0.0, (t - i) / std::max(1.0, t - w));
      }
      return warmup_min_lr + (max_lr - warmup_min_lr) * gamma;
    }
    case Kind::kWarmupCosineLR: {
      if (i < 0) return 0.0;
      double ratio = 0;
      if (i < w) {
        ratio = warmup_min_ratio + warmup_gamma(i, w, linear_warmup) * (1.0 - warmup_min_ratio);
      } else {
        const double progress = std::min(1.0, (i - w + 1) / std::max(1.0, t - w));
        ratio = std::max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) *
                                                  (1 + std::cos(std::numbers::pi * progress)) / 2);
      }
      return base_lr * ratio;
    }
  }
  return base_lr;
}

namespace {
// A configuration problem: the message is for the user, without the source
// location STRATA_CHECK adds for programming errors.
template <typename... Args>
void require(bool ok, fmt::format_string<Args...> format, Args&&... args) {
  if (!ok) raise(ErrorCategory::kBadArgument, format, std::forward<Args>(args)...);
}
}  // namespace

LrSchedule LrSchedule::from_json(const nlohmann::json& scheduler, double optimizer_lr,
                                 const std::string& where) {
  LrSchedule s;
  s.base_lr = optimizer_lr;
  if (scheduler.is_null()) return s;
  require(scheduler.is_object(), "{}: must be an object", where);
  const std::string type = scheduler.value("type", std::string());
  if (type == "WarmupLR") s.kind = Kind::kWarmupLR;
  else if (type == "WarmupDecayLR") s.kind = Kind::kWarmupDecayLR;
  else if (type == "WarmupCosineLR") s.kind = Kind::kWarmupCosineLR;
  else if (type == "Constant" || type.empty()) s.kind = Kind::kConstant;
  else {
    raise(ErrorCategory::kBadArgument,
          "{}.type: \"{}\" is not supported (WarmupLR, WarmupDecayLR, WarmupCosineLR)", where,
          type.size() > 64 ? type.substr(0, 64) + "..." : type);
  }
  const nlohmann::json params = scheduler.value("params", nlohmann::json::object());
  require(params.is_object(), "{}.params: must be an object", where);
  auto number = [&](const char* key, double& out, double lo, double hi) {
    if (!params.contains(key)) return;
    const auto& v = params.at(key);
    require(v.is_number() && v.get<double>() >= lo && v.get<double>() <= hi,
                 "{}.params.{}: must be a number in [{}, {}]", where, key, lo, hi);
    out = v.get<double>();
  };
  auto integer = [&](const char* key, int64_t& out, int64_t lo) {
    if (!params.contains(key)) return;
    const auto& v = params.at(key);
    require(v.is_number_integer() && v.get<int64_t>() >= lo,
                 "{}.params.{}: must be an integer >= {}", where, key, lo);
    out = v.get<int64_t>();
  };
  for (const auto& item : params.items()) {
    const std::string& key = item.key();
    static const char* const kKnown[] = {"warmup_min_lr",  "warmup_max_lr",    "warmup_num_steps",
                                         "warmup_type",    "total_num_steps",  "warmup_min_ratio",
                                         "cos_min_ratio",  "last_batch_iteration"};
    require(std::any_of(std::begin(kKnown), std::end(kKnown),
                             [&](const char* k) { return key == k; }),
                 "{}.params: unknown key \"{}\"", where,
                 key.size() > 64 ? key.substr(0, 64) + "..." : key);
  }
  // DeepSpeed's defaults differ: WarmupLR warms up to the optimizer's lr,
  // WarmupDecayLR to 0.001.
  if (s.kind == Kind::kWarmupDecayLR) s.warmup_max_lr = 1e-3;
  number("warmup_min_lr", s.warmup_min_lr, 0, 1e300);
  number("warmup_max_lr", s.warmup_max_lr, 0, 1e300);
  integer("warmup_num_steps", s.warmup_num_steps, 1);
  integer("total_num_steps", s.total_num_steps, 0);  // 0: not set (the schema's default)
  number("warmup_min_ratio", s.warmup_min_ratio, 0, 1);
  number("cos_min_ratio", s.cos_min_ratio, 0, 1);
  if (params.contains("warmup_type")) {
    const auto& v = params.at("warmup_type");
    require(v.is_string() && (v == "log" || v == "linear"),
                 "{}.params.warmup_type: must be \"log\" or \"linear\"", where);
    s.linear_warmup = v == "linear";
  }
  if (s.kind == Kind::kWarmupDecayLR || s.kind == Kind::kWarmupCosineLR) {
    require(params.contains("total_num_steps") && s.total_num_steps >= 1,
                 "{}.params.total_num_steps: required by {} (an integer >= 1)", where, type);
  }
  return s;
}

std::string LrSchedule::describe() const {
  switch (kind) {
    case Kind::kConstant: return fmt::format("constant lr {}", base_lr);
    case Kind::kWarmupLR:
      return fmt::format("WarmupLR {} -> {} over {} steps ({})", warmup_min_lr,
                         warmup_max_lr < 0 ? base_lr : warmup_max_lr, warmup_num_steps,
                         linear_warmup ? "linear" : "log");
    case Kind::kWarmupDecayLR:
      return fmt::format("WarmupDecayLR {} -> {} over {} steps ({}), linear decay to step {}",
                         warmup_min_lr, warmup_max_lr < 0 ? base_lr : warmup_max_lr,
                         warmup_num_steps, linear_warmup ? "linear" : "log", total_num_steps);
    case Kind::kWarmupCosineLR:
      return fmt::format("WarmupCosineLR lr {} x (warmup {} steps from {}, cosine to {} at step {})",
                         base_lr, warmup_num_steps, warmup_min_ratio, cos_min_ratio,
                         total_num_steps);
  }
  return "?";
}

}  // namespace strata::engine
