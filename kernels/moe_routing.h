// How a mixture-of-experts router turns one token's scores into its experts
// and their weights, and the backward of those weights, as transformers'
// routers compute them; one formula for the cpu and cuda moe_route kernels.
//
//   kSoftmax (MixtralTopKRouter, Qwen3Moe/Qwen2Moe's): probs = softmax of
//     the logits; the k largest, ties to the lower expert (torch.topk's
//     order); weights = their probs, divided by their sum when renormalize.
//   kSigmoid (DeepseekV3TopkRouter, Glm4MoeTopkRouter: deepseek_v3, kimi_k2,
//     glm4_moe): probs = sigmoid of each logit; the choice by probs +
//     correction bias (the bias selects, it never weights), among the
//     topk_groups of `groups` equal groups of experts whose two best biased
//     scores sum highest (the others are -inf, as transformers masks them);
//     weights = the unbiased probs of the chosen, divided by their sum +
//     1e-20 when renormalize, times `scaling` (routed_scaling_factor).
//
// Header-only and usable in device code (nvcc, C++17). Thread-safety: a value type.
#pragma once

#include <cstdint>

#include "kernels/attention_mask.h"  // STRATA_HOST_DEVICE

namespace strata::ops {

enum class MoeScores : int32_t { kSoftmax = 0, kSigmoid = 1 };

struct MoeRouter {
  MoeScores scores = MoeScores::kSoftmax;
  bool renormalize = false;
  int64_t groups = 1, topk_groups = 1;  // kSigmoid: the group-limited choice (1, 1: none)
  float scaling = 1.0f;                 // kSigmoid: the weights' factor (routed_scaling_factor)
};

// The most groups a cuda kernel's per-thread scratch holds (64 each word;
// DeepSeek-V3 has 8): the cuda backend refuses more.
inline constexpr int64_t kMaxMoeGroupWords = 4;

// The renormalisation's guard: transformers adds it to the sigmoid router's
// sum only (the softmax routers divide by the plain sum).
inline constexpr float kMoeSigmoidSumEpsilon = 1e-20f;

// Whether expert e of `experts` is in one of the groups `allowed` (a bit per
// group) marks; every expert when there is one group.
STRATA_HOST_DEVICE inline bool moe_group_allowed(const uint64_t* allowed, int64_t e, int64_t experts,
                                                 int64_t groups) {
  const int64_t g = e / (experts / groups);
  return (allowed[g / 64] >> (g % 64) & 1u) != 0;
}

// One token's choice from its probs [experts] (and the correction bias
// [experts] for kSigmoid, null: none): indices [k] in descending order of the
// choice score (ties to the lower expert) and their weights [k]. `allowed`:
// scratch of (groups + 63) / 64 words.
STRATA_HOST_DEVICE inline void moe_choose(const MoeRouter& router, const float* probs, const float* bias,
                                          int64_t experts, int64_t k, uint64_t* allowed, int32_t* indices,
                                          float* weights) {
  const bool sigmoid = router.scores == MoeScores::kSigmoid;
  auto score = [&](int64_t e) { return sigmoid && bias != nullptr ? probs[e] + bias[e] : probs[e]; };
  const int64_t groups = sigmoid ? router.groups : 1;
  for (int64_t w = 0; w < (groups + 63) / 64; ++w) allowed[w] = 0;
  if (groups <= 1 || router.topk_groups >= groups) {
    for (int64_t g = 0; g < groups; ++g) allowed[g / 64] |= uint64_t{1} << (g % 64);
  } else {
    // Each group's score: the sum of its two best biased scores (one, if the
    // group has a single expert); keep the topk_groups best (ties to the lower).
    const int64_t size = experts / groups;
    for (int64_t pick = 0; pick < router.topk_groups; ++pick) {
      int64_t best = -1;
      float best_score = 0;
      for (int64_t g = 0; g < groups; ++g) {
        if ((allowed[g / 64] >> (g % 64) & 1u) != 0) continue;
        float first = 0, second = 0;
        int64_t seen = 0;
        for (int64_t e = g * size; e < (g + 1) * size; ++e) {
          const float s = score(e);
          if (seen == 0 || s > first) {
            second = first;
            first = s;
            seen = seen + 1;
          } else if (seen == 1 || s > second) {
            second = s;
            seen = seen + 1;
          }
        }
        const float group_score = size >= 2 ? first + second : first;
        if (best < 0 || group_score > best_score) {
          best = g;
          best_score = group_score;
        }
      }
      allowed[best / 64] |= uint64_t{1} << (best % 64);
    }
  }
  // Top-k by repeated selection: the largest allowed not yet taken, the lower index on ties.
  float total = 0;
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < experts; ++e) {
      if (!moe_group_allowed(allowed, e, experts, groups)) continue;
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || indices[i] == e;
      if (!taken && (best < 0 || score(e) > score(best))) best = e;
    }
    indices[j] = static_cast<int32_t>(best);
    weights[j] = probs[best];
    total += probs[best];
  }
  if (sigmoid) {
    const float sum = total + kMoeSigmoidSumEpsilon;
    for (int64_t j = 0; j < k; ++j) {
      weights[j] = (router.renormalize ? weights[j] / sum : weights[j]) * router.scaling;
    }
  } else if (router.renormalize) {
    for (int64_t j = 0; j < k; ++j) weights[j] /= total;
  }
}

// d loss / d probs[e] of one token through its weights (dweights [k]), plus
// aux_grad[e] (null: none): w_j = c p_j / S (S the chosen probs' sum, + 1e-20
// for kSigmoid; c = scaling, 1 for kSoftmax) gives dp_j = (c dw_j - sum_i dw_i
// w_i) / S, without renormalisation dp_j = c dw_j.
STRATA_HOST_DEVICE inline float moe_dprob(const MoeRouter& router, const float* probs, const int32_t* indices,
                                          const float* weights, const float* dweights, int64_t k,
                                          const float* aux_grad, int64_t e) {
  const bool sigmoid = router.scores == MoeScores::kSigmoid;
  const float c = sigmoid ? router.scaling : 1.0f;
  float dot = 0, total = 0;
  for (int64_t j = 0; j < k; ++j) {
    dot += dweights[j] * weights[j];
    total += probs[indices[j]];
  }
  if (sigmoid) total += kMoeSigmoidSumEpsilon;
  float g = aux_grad == nullptr ? 0.0f : aux_grad[e];
  for (int64_t j = 0; j < k; ++j) {
    if (indices[j] == e) {
      g += router.renormalize ? (sigmoid ? (c * dweights[j] - dot) / total : (dweights[j] - dot) / total)
                              : c * dweights[j];
    }
  }
  return g;
}

}  // namespace strata::ops
