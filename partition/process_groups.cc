// Process groups: the pp × dp × cp × tp (× ep) layout and communicators over one group.
#include "partition/process_groups.h"

#include <algorithm>

#include "core/error.h"
#include "core/log.h"

namespace strata::partition {
namespace {
constexpr size_t kNamedRanks = 8;  // a group's name lists at most this many ranks in full

size_t kind_index(GroupKind kind) { return static_cast<size_t>(kind); }

// "ranks 2,3", "rank 5", "16 ranks: 0,8,16,...,120".
std::string describe_ranks(const std::vector<int>& ranks) {
  std::string list;
  auto append = [&](const std::string& item) { list += (list.empty() ? "" : ",") + item; };
  if (ranks.size() <= kNamedRanks) {
    for (int r : ranks) append(std::to_string(r));
    return fmt::format("rank{} {}", ranks.size() == 1 ? "" : "s", list);
  }
  for (size_t i = 0; i < 3; ++i) append(std::to_string(ranks[i]));
  append("...");
  append(std::to_string(ranks.back()));
  return fmt::format("{} ranks: {}", ranks.size(), list);
}
}  // namespace

std::string_view group_kind_name(GroupKind kind) {
  switch (kind) {
    case GroupKind::kTensor: return "tp";
    case GroupKind::kData: return "dp";
    case GroupKind::kExpert: return "ep";
    case GroupKind::kExpertData: return "expert-dp";
    case GroupKind::kPipeline: return "pp";
    case GroupKind::kContext: return "cp";
    case GroupKind::kDataContext: return "dp-cp";
  }
  raise(ErrorCategory::kInternal, "unknown process group kind");
}

std::string ProcessGroup::name() const {
  return fmt::format("{} group {} ({})", group_kind_name(kind), index, describe_ranks(ranks));
}

int ProcessGroup::member(int job_rank) const {
  const auto at = std::find(ranks.begin(), ranks.end(), job_rank);
  return at == ranks.end() ? -1 : static_cast<int>(at - ranks.begin());
}

ParallelLayout::ParallelLayout(int world_size, int tp_size, int ep_size, int pp_size, int cp_size)
    : world_size_(world_size), tp_size_(tp_size), ep_size_(ep_size), pp_size_(pp_size), cp_size_(cp_size) {
  STRATA_CHECK(world_size >= 1, kBadArgument, "a world of {} ranks: at least 1 is needed", world_size);
  STRATA_CHECK(tp_size >= 1, kBadArgument, "tensor-parallel size {}: at least 1 is needed", tp_size);
  STRATA_CHECK(pp_size >= 1, kBadArgument, "pipeline-parallel size {}: at least 1 is needed", pp_size);
  STRATA_CHECK(world_size % tp_size == 0, kBadArgument,
               "a world of {} ranks is not divisible by the tensor-parallel size {}: the ranks are laid out as "
               "world = {}tp × dp",
               world_size, tp_size, pp_size > 1 ? "pp × " : "");
  STRATA_CHECK(world_size % (tp_size * pp_size) == 0, kBadArgument,
               "a world of {} ranks is not divisible by the pipeline-parallel size {} x the tensor-parallel size {}: "
               "the ranks are laid out as world = pp × dp × tp",
               world_size, pp_size, tp_size);
  STRATA_CHECK(cp_size >= 1, kBadArgument, "context-parallel size {}: at least 1 is needed", cp_size);
  STRATA_CHECK(world_size % (tp_size * pp_size * cp_size) == 0, kBadArgument,
               "a world of {} ranks is not divisible by the context-parallel size {} x the pipeline-parallel size {} "
               "x the tensor-parallel size {}: the ranks are laid out as world = pp × dp × cp × tp",
               world_size, cp_size, pp_size, tp_size);
  const int dp = world_size / (tp_size * pp_size * cp_size);
  STRATA_CHECK(ep_size >= 1, kBadArgument, "expert-parallel size {}: at least 1 is needed", ep_size);
  STRATA_CHECK(dp % ep_size == 0, kBadArgument,
               "the expert-parallel size {} does not divide the data-parallel size {} (a world of {} ranks / "
               "tensor-parallel size {}{}): expert-parallel groups are made inside the data-parallel ones",
               ep_size, dp, world_size, tp_size,
               pp_size > 1 ? fmt::format(" / pipeline-parallel size {}", pp_size) : std::string());
  auto add = [&](GroupKind kind, std::vector<int> ranks) {
    std::sort(ranks.begin(), ranks.end());
    groups_[kind_index(kind)].push_back(ProcessGroup{kind, 0, std::move(ranks), {}});
  };
  const int inner = cp_size * tp_size;  // the ranks of one dp position in a stage
  const int stage_size = dp * inner;
  for (int g = 0; g < world_size / tp_size; ++g) {
    std::vector<int> ranks;
    for (int t = 0; t < tp_size; ++t) ranks.push_back(g * tp_size + t);
    add(GroupKind::kTensor, std::move(ranks));
  }
  for (int g = 0; g < world_size / cp_size; ++g) {
    // The cp group of stage s, dp rank d and tp rank t (g = (s * dp + d) * tp + t).
    const int first = g / tp_size * inner + g % tp_size;
    std::vector<int> ranks;
    for (int c = 0; c < cp_size; ++c) ranks.push_back(first + c * tp_size);
    add(GroupKind::kContext, std::move(ranks));
  }
  for (int j = 0; j < stage_size; ++j) {
    std::vector<int> ranks;
    for (int s = 0; s < pp_size; ++s) ranks.push_back(s * stage_size + j);
    add(GroupKind::kPipeline, std::move(ranks));
  }
  for (int j = 0; j < pp_size * tp_size; ++j) {
    // The dp-cp group of stage s and tp rank t (j = s * tp + t): member
    // d * cp + c is job rank s * stage_size + (d * cp + c) * tp + t.
    std::vector<int> ranks;
    for (int m = 0; m < dp * cp_size; ++m) ranks.push_back(j / tp_size * stage_size + m * tp_size + j % tp_size);
    add(GroupKind::kDataContext, std::move(ranks));
  }
  for (int j = 0; j < inner * pp_size; ++j) {
    // Member k of the dp group of stage s, cp rank c and tp rank t (j = s *
    // inner + c * tp + t) is job rank s * stage_size + k * inner + c * tp + t.
    const int first = j / inner * stage_size + j % inner;
    auto dp_member = [&](int k) { return first + k * inner; };
    std::vector<int> data;
    for (int k = 0; k < dp; ++k) data.push_back(dp_member(k));
    add(GroupKind::kData, std::move(data));
    for (int m = 0; m < dp / ep_size; ++m) {
      std::vector<int> experts;
      for (int e = 0; e < ep_size; ++e) experts.push_back(dp_member(m * ep_size + e));
      add(GroupKind::kExpert, std::move(experts));
    }
    for (int e = 0; e < ep_size; ++e) {
      std::vector<int> replicas;
      for (int m = 0; m < dp / ep_size; ++m) replicas.push_back(dp_member(m * ep_size + e));
      add(GroupKind::kExpertData, std::move(replicas));
    }
  }
  for (auto& groups : groups_) {
    std::sort(groups.begin(), groups.end(),
              [](const ProcessGroup& a, const ProcessGroup& b) { return a.ranks.front() < b.ranks.front(); });
    for (size_t i = 0; i < groups.size(); ++i) groups[i].index = static_cast<int>(i);
  }
  for (ProcessGroup& pipeline : groups_[kind_index(GroupKind::kPipeline)]) {
    for (int s = 0; s < pp_size; ++s) pipeline.member_names.push_back(stage_name(s));
  }
}

std::vector<int> ParallelLayout::stage_ranks(int stage) const {
  STRATA_CHECK(stage >= 0 && stage < pp_size_, kBadArgument, "pipeline stage {} is outside the {} stages", stage,
               pp_size_);
  const int stage_size = world_size_ / pp_size_;
  std::vector<int> ranks;
  for (int r = 0; r < stage_size; ++r) ranks.push_back(stage * stage_size + r);
  return ranks;
}

std::string ParallelLayout::stage_name(int stage) const {
  return fmt::format("pp stage {} ({})", stage, describe_ranks(stage_ranks(stage)));
}

const std::vector<ProcessGroup>& ParallelLayout::groups(GroupKind kind) const { return groups_[kind_index(kind)]; }

const ProcessGroup& ParallelLayout::group_of(GroupKind kind, int rank) const {
  STRATA_CHECK(rank >= 0 && rank < world_size_, kBadArgument, "rank {} is outside a world of {} ranks", rank,
               world_size_);
  for (const ProcessGroup& group : groups(kind)) {
    if (group.member(rank) >= 0) return group;
  }
  raise(ErrorCategory::kInternal, "rank {} is in no {} group", rank, group_kind_name(kind));
}

std::unique_ptr<Communicator> make_group_communicator(Accelerator& accelerator, StoreClient& store,
                                                      const CommunicatorOptions& job_options,
                                                      const ProcessGroup& group) {
  const std::string name = group.name();
  const int member = group.member(job_options.rank);
  STRATA_CHECK(member >= 0, kBadArgument, "rank {} is not in {}, so it cannot make its communicator",
               job_options.rank, name);
  for (int r : group.ranks) {
    STRATA_CHECK(r >= 0 && r < job_options.world_size, kBadArgument, "{} names rank {}, outside a world of {} ranks",
                 name, r, job_options.world_size);
  }
  CommunicatorOptions options = job_options;
  options.rank = member;
  options.world_size = static_cast<int>(group.ranks.size());
  options.prefix = fmt::format("{}/groups/{}/{}", job_options.prefix, group_kind_name(group.kind), group.index);
  options.group = name;
  options.members = group.ranks;
  options.member_names = group.member_names;
  auto communicator = make_communicator(accelerator, store, options);
  logger().debug("rank {}: connected {} ({})", job_options.rank, name, communicator->backend());
  return communicator;
}

Communicator& ProcessGroups::of(GroupKind kind) const {
  const std::unique_ptr<Communicator>* held[] = {&tp, &dp, &ep, &expert_dp, &pp, &cp, &dp_cp};
  const auto& communicator = *held[kind_index(kind)];
  STRATA_CHECK(communicator != nullptr, kBadArgument, "no {} group communicator was made", group_kind_name(kind));
  return *communicator;
}

ProcessGroups make_process_groups(Accelerator& accelerator, StoreClient& store, const CommunicatorOptions& job_options,
                                  const ParallelLayout& layout) {
  STRATA_CHECK(job_options.world_size == layout.world_size(), kBadArgument,
               "process groups laid out for a world of {} ranks, but this job has {}", layout.world_size(),
               job_options.world_size);
  auto make = [&](GroupKind kind) {
    return make_group_communicator(accelerator, store, job_options, layout.group_of(kind, job_options.rank));
  };
  ProcessGroups groups;
  groups.tp = make(GroupKind::kTensor);
  groups.dp = make(GroupKind::kData);
  groups.ep = make(GroupKind::kExpert);
  groups.expert_dp = make(GroupKind::kExpertData);
  groups.pp = make(GroupKind::kPipeline);
  groups.cp = make(GroupKind::kContext);
  groups.dp_cp = make(GroupKind::kDataContext);
  return groups;
}

}  // namespace strata::partition
