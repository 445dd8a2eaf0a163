// choose_zero_sizes (runtime/engine/zero_sizes.h): sub_group_size and
// reduce_bucket_size chosen from the decoder layers when left out, kept when
// given; and a ZeroEngine left to choose them updates sub-groups during
// backward and trains exactly as the resident reference.
#include <catch2/catch.hpp>

#include "partition/layout.h"
#include "runtime/engine/zero_sizes.h"
#include "tests/engine/zero_training.h"

using namespace strata;
using engine::choose_zero_sizes;
using engine::kChooseFromModel;
using engine::layer_of;
using engine::SizedParam;
using Catch::Matchers::Contains;

namespace {

constexpr size_t kAlign = partition::kDefaultAlignmentNbytes;  // 4096 bytes: 1024 fp32 elements

// Two layers of a 4096-element projection and a 64-element norm, between an
// embedding and an lm_head of 10000, all fp32. Over 2 ranks each slice is
// padded to a multiple of 1024 elements: a projection 2048 per rank (4096
// full), a norm 1024 (2048 full), so a layer is 6144 full, 3072 per rank.
std::vector<SizedParam> two_layers(bool trained = true) {
  return {{"model.embed_tokens.weight", 10000, DType::kF32, trained},
          {"model.layers.0.self_attn.q_proj.weight", 4096, DType::kF32, trained},
          {"model.layers.0.input_layernorm.weight", 64, DType::kF32, trained},
          {"model.layers.1.self_attn.q_proj.weight", 4096, DType::kF32, trained},
          {"model.layers.1.input_layernorm.weight", 64, DType::kF32, trained},
          {"model.norm.weight", 64, DType::kF32, trained},
          {"lm_head.weight", 10000, DType::kF32, trained}};
}

}  // namespace

TEST_CASE("layer_of: a name up to its first all-digit component", "[engine][zero_sizes]") {
  CHECK(layer_of("model.layers.3.mlp.up_proj.weight") == "model.layers.3");
  CHECK(layer_of("model.layers.3.mlp.experts.7.down_proj.weight") == "model.layers.3");
  CHECK(layer_of("transformer.h.12.attn.c_attn.weight") == "transformer.h.12");
  CHECK(layer_of("layers.0") == "layers.0");
  CHECK(layer_of("model.embed_tokens.weight").empty());
  CHECK(layer_of("lm_head.weight").empty());
  CHECK(layer_of("block1.w").empty());  // digits inside a component are not a layer index
  CHECK(layer_of("").empty());
}

TEST_CASE("left out: a sub-group is one layer's share of the shard, a bucket one layer's gradients and a norm's",
          "[engine][zero_sizes]") {
  const auto s = choose_zero_sizes(two_layers(), 2, kChooseFromModel, kChooseFromModel, kAlign);
  CHECK(s.layers == 2);
  CHECK(s.layer_numel == 6144);
  CHECK(s.layer_shard_numel == 3072);
  CHECK(s.sub_group_numel == 3072);
  CHECK(s.reduce_bucket_numel == 6144 + 2048);
  CHECK(s.sub_group_chosen);
  CHECK(s.reduce_bucket_chosen);
  CHECK(s.sub_group_pieces == 1);
  CHECK(s.bucket_pieces == 1);
  CHECK_THAT(s.describe(), Contains("sub_group_size 3072") && Contains("reduce_bucket_size 8192") &&
                               Contains("2 decoder layers") && Contains("over 2 rank(s)"));
  const auto j = s.to_json();
  CHECK(j["sub_group_size"] == 3072);
  CHECK(j["reduce_bucket_size"] == 8192);
  CHECK(j["sub_group_size_chosen"] == true);
  CHECK(j["why"] == s.describe());

  // One rank: the same layer is 4096 + 1024 elements, all of it this rank's.
  const auto one = choose_zero_sizes(two_layers(), 1, kChooseFromModel, kChooseFromModel, kAlign);
  CHECK(one.sub_group_numel == 5120);
  CHECK(one.reduce_bucket_numel == 5120 + 1024);
}

TEST_CASE("an explicit size keeps its DeepSpeed meaning, each on its own", "[engine][zero_sizes]") {
  const auto both = choose_zero_sizes(two_layers(), 2, 1000000, 2000000, kAlign);
  CHECK(both.sub_group_numel == 1000000);
  CHECK(both.reduce_bucket_numel == 2000000);
  CHECK_FALSE(both.sub_group_chosen);
  CHECK_FALSE(both.reduce_bucket_chosen);
  CHECK(both.describe() == "sub_group_size 1000000 (as given), reduce_bucket_size 2000000 (as given)");
  // DeepSpeed's own defaults, written out, are kept too.
  const auto deepspeed = choose_zero_sizes(two_layers(), 2, 1000000000, 500000000, kAlign);
  CHECK(deepspeed.sub_group_numel == 1000000000);
  CHECK(deepspeed.reduce_bucket_numel == 500000000);

  const auto sub_only = choose_zero_sizes(two_layers(), 2, 1000, kChooseFromModel, kAlign);
  CHECK(sub_only.sub_group_numel == 1000);
  CHECK_FALSE(sub_only.sub_group_chosen);
  CHECK(sub_only.reduce_bucket_numel == 8192);
  CHECK(sub_only.reduce_bucket_chosen);
  CHECK_THROWS_WITH(choose_zero_sizes(two_layers(), 2, -1, 0, kAlign), Contains("sub_group_size"));
  CHECK_THROWS_WITH(choose_zero_sizes(two_layers(), 0, 0, 0, kAlign), Contains("world size"));
}

TEST_CASE("only trained parameters count: LoRA adapters on a frozen base", "[engine][zero_sizes]") {
  auto params = two_layers(false);
  // A 4 x 64 adapter pair per layer: each padded to 1024 elements per rank.
  for (int l = 0; l < 2; ++l) {
    const std::string m = "model.layers." + std::to_string(l) + ".self_attn.q_proj.";
    params.push_back({m + "lora_A.weight", 256, DType::kF32, true});
    params.push_back({m + "lora_B.weight", 256, DType::kF32, true});
  }
  const auto s = choose_zero_sizes(params, 2, kChooseFromModel, kChooseFromModel, kAlign);
  CHECK(s.layers == 2);
  CHECK(s.sub_group_numel == 2048);
  CHECK(s.reduce_bucket_numel == 4096 + 2048);
}

TEST_CASE("no named layers: the whole trained model is one piece, and says so", "[engine][zero_sizes]") {
  const std::vector<SizedParam> params = {{"w0", 5000, DType::kF32, true}, {"w1", 3000, DType::kBF16, true}};
  const auto s = choose_zero_sizes(params, 1, kChooseFromModel, kChooseFromModel, kAlign);
  CHECK(s.layers == 0);
  CHECK(s.sub_group_numel == 5120 + 4096);  // bf16 slices pad to 2048 elements
  CHECK(s.reduce_bucket_numel == 5120 + 4096);
  CHECK_THAT(s.describe(), Contains("no decoder layers named"));
}

TEST_CASE("a layer beyond the memory bounds is split into equal pieces", "[engine][zero_sizes]") {
  const std::vector<SizedParam> params = {{"model.layers.0.mlp.w", 100'000'000, DType::kF32, true},
                                          {"model.layers.0.norm", 8192, DType::kF32, true}};
  const auto s = choose_zero_sizes(params, 1, kChooseFromModel, kChooseFromModel, kAlign);
  const int64_t shard = 100'000'768 + 8192;  // the projection padded to 1024 elements, and the norm
  CHECK(s.layer_shard_numel == shard);
  CHECK(s.sub_group_numel * engine::kOptimizerRecordBytesPerElement <= engine::kMaxChosenSubGroupNbytes);
  CHECK(s.sub_group_pieces == 5);
  CHECK(s.sub_group_numel * s.sub_group_pieces >= shard);
  CHECK(s.reduce_bucket_numel * 4 <= engine::kMaxChosenBucketNbytes);
  CHECK(s.bucket_pieces == 2);
  CHECK(s.reduce_bucket_numel * s.bucket_pieces >= shard);
  CHECK_THAT(s.describe(), Contains("in 5 pieces") && Contains("in 2 pieces"));
}

TEST_CASE("a ZeroEngine left to choose the sizes updates sub-groups during backward and trains as the resident "
          "engine, bit for bit",
          "[engine][zero][zero_sizes]") {
  using namespace strata::test::zero;
  ops::set_cpu_threads(1);
  // Twelve steps: whether the thread reaches a sub-group before step() is
  // timing, and on a loaded 2-core machine three (once even six) steps gave it none.
  test::zero::ResidentSpec resident;
  resident.steps = 12;
  resident.adam = options_for(2).adam;
  const TrainResult reference = train_resident(resident);
  TrainSpec spec;
  spec.steps = 12;
  spec.options = options_for(2);
  spec.options.sub_group_numel = kChooseFromModel;
  spec.options.reduce_bucket_numel = kChooseFromModel;
  const TrainResult zero = train_zero(spec);
  CHECK(compare(zero, reference).identical);
  CHECK(zero.losses == reference.losses);
  REQUIRE(!zero.steps.empty());
  // DeepSpeed's 1e9 would give this model one sub-group, updated after backward.
  int64_t overlapped = 0;
  for (const auto& step : zero.steps) {
    CHECK(step.sub_groups > 1);
    overlapped += step.sub_groups_overlapped;
  }
  // Which sub-groups the optimizer thread reaches before step() is timing;
  // over the steps, some (as engine_overlap_tests count them).
  CHECK(overlapped > 0);
}

TEST_CASE("a layer that is a sliver of the shard: at most kMaxChosenSubGroups sub-groups", "[engine][zero_sizes]") {
  // A vocabulary of 10^12 beside two small layers (a finetune test's model
  // that must fail with a message naming vocab_size, not build a layout of
  // billions of sub-groups first).
  const std::vector<SizedParam> params = {{"model.embed_tokens.weight", 64'000'000'000'000, DType::kF32, true},
                                          {"model.layers.0.mlp.w", 40000, DType::kF32, true},
                                          {"model.layers.1.mlp.w", 40000, DType::kF32, true}};
  const auto s = choose_zero_sizes(params, 1, kChooseFromModel, kChooseFromModel, kAlign);
  CHECK(s.sub_group_count_bound);
  CHECK(s.sub_group_numel * engine::kMaxChosenSubGroups >= 64'000'000'000'000);
  CHECK(s.sub_group_numel < 64'000'000'000'000 / (engine::kMaxChosenSubGroups / 2));
  CHECK_THAT(s.describe(), Contains("1/65536 of this rank's shard"));
  // Frozen parameters count too: every layout is cut by the same size.
  auto frozen = params;
  frozen[0].trained = false;
  CHECK(choose_zero_sizes(frozen, 1, kChooseFromModel, kChooseFromModel, kAlign).sub_group_count_bound);
  // A model of normal proportions never meets the bound.
  CHECK_FALSE(choose_zero_sizes(two_layers(), 2, kChooseFromModel, kChooseFromModel, kAlign).sub_group_count_bound);
}
