// The split of the decoder's layers over pipeline stages.
#include "runtime/pipeline/stages.h"

#include <numeric>

#include "core/error.h"

namespace strata::pipeline {

std::vector<int64_t> split_layers(int64_t layers, int stages, int virtual_stages, std::span<const int64_t> given) {
  STRATA_CHECK(stages >= 1 && virtual_stages >= 1, kBadArgument,
               "pipeline_parallel: size {} and virtual_stages {} must be at least 1", stages, virtual_stages);
  const int64_t count = static_cast<int64_t>(stages) * virtual_stages;
  const std::string where =
      virtual_stages > 1 ? fmt::format("pp {} x virtual_stages {} = {}", stages, virtual_stages, count)
                         : fmt::format("pp {}", stages);
  if (!given.empty()) {
    STRATA_CHECK(static_cast<int64_t>(given.size()) == count, kBadArgument,
                 "pipeline_parallel.layers has {} entries; one per virtual stage ({}) is needed", given.size(), where);
    for (size_t s = 0; s < given.size(); ++s) {
      STRATA_CHECK(given[s] >= 1, kBadArgument,
                   "pipeline_parallel.layers[{}] is {}: every stage needs at least one decoder layer", s, given[s]);
    }
    const int64_t total = std::accumulate(given.begin(), given.end(), int64_t{0});
    STRATA_CHECK(total == layers, kBadArgument,
                 "pipeline_parallel.layers sums to {} layers, but the model has {} (num_hidden_layers)", total, layers);
    return {given.begin(), given.end()};
  }
  STRATA_CHECK(layers >= count, kBadArgument,
               "the model's {} decoder layers (num_hidden_layers) cannot fill {} pipeline stages ({}): each stage "
               "needs at least one",
               layers, count, where);
  std::vector<int64_t> split(static_cast<size_t>(count), layers / count);
  for (int64_t s = 0; s < layers % count; ++s) ++split[static_cast<size_t>(s)];
  return split;
}

StagePart stage_part(const std::vector<int64_t>& split, int stages, int rank, int chunk) {
  const int64_t s = static_cast<int64_t>(chunk) * stages + rank;
  STRATA_CHECK(rank >= 0 && rank < stages && chunk >= 0 && s < static_cast<int64_t>(split.size()), kBadArgument,
               "pipeline stage: chunk {} of rank {} is not one of the {} virtual stages", chunk, rank, split.size());
  StagePart part;
  part.first_layer = std::accumulate(split.begin(), split.begin() + s, int64_t{0});
  part.layers = split[static_cast<size_t>(s)];
  part.embedding = s == 0;
  part.head = s + 1 == static_cast<int64_t>(split.size());
  return part;
}

}  // namespace strata::pipeline
