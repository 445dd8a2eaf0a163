// Which decoder layers each pipeline stage holds (docs/DESIGN.md §5.4): the
// model's layers split over the p × v virtual stages in order, equal by
// default (the first stages taking one more when they do not divide) or as a
// list says; the embedding on virtual stage 0, the final norm and lm_head
// (the loss) on the last. Virtual stage k·p + r is chunk k of rank r
// (Megatron's placement), so a rank holds every p-th slice of the model.
//
// Thread-safety: pure functions. Errors: Error(kBadArgument) naming the
// config key (pipeline_parallel.layers) and the sizes.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace strata::pipeline {

// The part of the model one virtual stage holds (nn::DecoderModelOptions::stage).
struct StagePart {
  int64_t first_layer = 0;
  int64_t layers = 0;
  bool embedding = false;  // the token embedding (virtual stage 0)
  bool head = false;       // the final norm and lm_head with the loss (the last virtual stage)
};

// Layers per virtual stage: `given` (one entry per virtual stage, each at
// least 1, summing to `layers`) or, when empty, as equal as possible.
std::vector<int64_t> split_layers(int64_t layers, int stages, int virtual_stages, std::span<const int64_t> given = {});

// Chunk `chunk` of pp rank `rank`: virtual stage chunk * stages + rank of `split`.
StagePart stage_part(const std::vector<int64_t>& split, int stages, int rank, int chunk);

}  // namespace strata::pipeline
