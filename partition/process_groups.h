// Process groups (DESIGN.md §5): the job's ranks arranged as world = pp × dp
// × cp × tp, Megatron's layout (tp fastest, then cp, then dp, then pp:
// Megatron-Core's default order tp-cp-ep-dp-pp), with expert parallelism
// inside the data-parallel dimension, DeepSpeed's; and communicators over one
// group each, connected through the job's rendezvous store.
//
// Layout (ParallelLayout: a pure function of world, tp, ep, pp and cp). Job
// rank r = s*(dp*cp*tp) + d*(cp*tp) + c*tp + t: pipeline stage s,
// data-parallel rank d, context-parallel rank c, tp rank t.
//   pp stage s        ranks s*dp*cp*tp .. (s+1)*dp*cp*tp - 1: the ranks holding
//                     stage s's layers (pipeline parallelism);
//   tp group g        ranks g*tp .. g*tp + tp-1: consecutive, so on one node,
//                     they hold the shards of one layer (tensor parallelism);
//   cp group          the ranks with the same s, d and t (stride tp): each
//                     holds two chunks of every sequence (context
//                     parallelism: ring attention passes keys and values
//                     around it, next to tp so that it stays on a node);
//   dp group          within a stage, the ranks that hold the same tp shard
//                     and the same chunks (stride cp*tp), over which ZeRO
//                     partitions (with cp > 1 the gradients are also summed
//                     over the cp group, by whoever trains with it);
//   dp-cp group       within a stage, the ranks with the same tp rank (the
//                     dp group's members times the cp group's, stride tp:
//                     member d*cp + c): they hold the same parameters, so
//                     ZeRO partitions and reduces over it with cp > 1
//                     (Megatron's data-parallel group with context
//                     parallelism); with cp 1 it is the dp group;
//   pp group          the ranks with the same d, c and t in every stage
//                     (stride dp*cp*tp): one pipeline, whose member s is
//                     stage s; they pass activations and gradients point to point;
//   ep group          within a dp group, ep consecutive members (dp positions
//                     m*ep .. m*ep + ep-1): they split the experts between them;
//   expert-dp group   within a dp group, the members that hold the same experts
//                     (every ep-th): they average those experts' gradients.
// Groups of a kind are numbered in the order of their lowest rank; every rank
// is in exactly one group of each kind. Errors and logs name a group as
// "tp group 1 (ranks 2,3)", a stage as "pp stage 1 (ranks 2,3)".
//
// Thread-safety: ParallelLayout is immutable after construction.
// Throws: Error(kBadArgument) for sizes that do not divide (naming them);
// communicators throw as make_communicator's do, naming the group.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "partition/communicator.h"

namespace strata::partition {

enum class GroupKind { kTensor, kData, kExpert, kExpertData, kPipeline, kContext, kDataContext };
inline constexpr size_t kGroupKinds = 7;
// "tp", "dp", "ep", "expert-dp", "pp", "cp", "dp-cp": the words errors and store keys use.
std::string_view group_kind_name(GroupKind kind);

struct ProcessGroup {
  GroupKind kind = GroupKind::kTensor;
  int index = 0;
  std::vector<int> ranks;  // job ranks, ascending; member i of the group is ranks[i]
  // What errors call each member as a point-to-point peer (a pp group's:
  // its stages, "pp stage 1 (ranks 2,3)"); empty: "rank <r>".
  std::vector<std::string> member_names;

  // "tp group 1 (ranks 2,3)"; past 8 ranks the list is shortened: "dp group 0 (16 ranks: 0,8,16,...,120)".
  std::string name() const;
  // This job rank's position in the group, or -1 when it is not a member.
  int member(int job_rank) const;
};

class ParallelLayout {
 public:
  // world = pp × dp × cp × tp, and ep divides dp. Refused otherwise, naming the sizes.
  ParallelLayout(int world_size, int tp_size, int ep_size = 1, int pp_size = 1, int cp_size = 1);

  int world_size() const { return world_size_; }
  int tp_size() const { return tp_size_; }
  int dp_size() const { return world_size_ / (tp_size_ * cp_size_ * pp_size_); }
  int ep_size() const { return ep_size_; }
  int pp_size() const { return pp_size_; }
  int cp_size() const { return cp_size_; }
  // A rank's position in its tp group, its cp group, its dp group and its pp group (its stage).
  int tp_rank(int rank) const { return rank % tp_size_; }
  int cp_rank(int rank) const { return rank / tp_size_ % cp_size_; }
  int dp_rank(int rank) const { return rank / (tp_size_ * cp_size_) % dp_size(); }
  int pp_rank(int rank) const { return rank / (tp_size_ * cp_size_ * dp_size()); }
  // The job ranks of pipeline stage `stage`, ascending, and what errors call
  // it: "pp stage 1 (ranks 2,3)".
  std::vector<int> stage_ranks(int stage) const;
  std::string stage_name(int stage) const;

  // Every group of `kind`, by index.
  const std::vector<ProcessGroup>& groups(GroupKind kind) const;
  // The group of `kind` that holds job rank `rank` (Error(kBadArgument) outside the world).
  const ProcessGroup& group_of(GroupKind kind, int rank) const;

 private:
  int world_size_, tp_size_, ep_size_, pp_size_, cp_size_;
  std::vector<ProcessGroup> groups_[kGroupKinds];  // by GroupKind
};

// A communicator over `group`, as make_communicator makes one (NCCL for cuda,
// Gloo for cpu). `job_options` describe this process in the whole job (rank,
// world_size: the job's), and give the timeout, hostname and key prefix; the
// group's store keys are under "<prefix>/groups/<kind>/<index>", which no
// other group and no communicator's own keys use. Every rank of the group must
// make it (connecting waits for them, within the timeout). Refused when this
// rank is not in the group or the group names a rank outside the job.
std::unique_ptr<Communicator> make_group_communicator(Accelerator& accelerator, StoreClient& store,
                                                      const CommunicatorOptions& job_options,
                                                      const ProcessGroup& group);

// This rank's communicator in each group of `layout` (groups of one rank
// included, so that callers need no special case).
struct ProcessGroups {
  std::unique_ptr<Communicator> tp, dp, ep, expert_dp, pp, cp, dp_cp;
  Communicator& of(GroupKind kind) const;
};
// Every rank makes them in the same order (tp, dp, ep, expert-dp, pp, cp, dp-cp), so that
// connecting one group never waits on a rank busy connecting another.
// job_options.world_size must be layout.world_size().
ProcessGroups make_process_groups(Accelerator& accelerator, StoreClient& store, const CommunicatorOptions& job_options,
                                  const ParallelLayout& layout);

}  // namespace strata::partition
