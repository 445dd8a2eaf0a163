// Tensor parallelism composed with ZeRO data parallelism (issue 29; docs/DESIGN.md
// §5): world = tp x dp ranks, each tp rank holding its heads' q/k/v rows and
// o columns, its share of the MLP's features (Megatron's column- and
// row-parallel projections, their partial outputs summed over the tp group)
// and its rows of the vocabulary (the vocabulary-parallel embedding and loss),
// each tp shard ZeRO-partitioned over its dp group; with and without
// sequence parallelism. The same losses and
// parameters as ONE resident rank on the combined batch, to rounding (the
// sums run in another order), across stages, offload tiers, micro-steps and
// checkpointed activations, for the llama (with every bias), mistral (a
// window), qwen2 (q/k/v biases) and qwen3 (per-head q/k norms, whose weight
// gradient each rank's heads add to) layers; the replicated tensors' tp copies
// stay bit-identical.
#include <catch2/catch.hpp>

#include <map>
#include <string>
#include <vector>

#include "runtime/nn/decoder_config.h"
#include "runtime/plan/runtime_memory.h"
#include "tests/engine/zero_training.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace strata::test::zero;

namespace {

// model_config's shape (4 heads, 2 kv heads, intermediate 64) as a family.
nn::DecoderConfig family(const std::string& name, bool tied = false) {
  nn::DecoderConfig c = model_config(tied);
  c.model_type = name;
  if (name == "llama") {
    c.attention_qkv_bias = c.attention_o_bias = c.mlp_bias = true;  // a row-parallel bias too
  } else if (name == "mistral") {
    c.sliding_window = 5;
  } else if (name == "qwen2") {
    c.attention_qkv_bias = true;
  } else if (name == "qwen3") {
    c.qk_norm = true;  // per-head norms: each tp rank's heads add to one weight's gradient
  } else if (name == "gemma3_text") {
    // Gemma 3's pieces: the sandwich norms split nothing (they normalise
    // whole rows, after each block's sum over tp), the scores' scale and
    // each layer's RoPE are per head.
    c.qk_norm = true;
    c.hidden_act = ops::GluActivation::kGeluTanh;
    c.norm_weight_offset = 1;
    c.scale_embedding = true;
    c.sandwich_norms = true;
    c.query_pre_attn_scalar = 12;
    c.sliding_window = 5;
    c.sliding_layers = {true, false};
    c.sliding_rope = c.rope;
    c.sliding_rope->theta = 100;
  }
  return c;
}

const TrainResult& reference(const std::string& name, bool tied) {
  static std::map<std::pair<std::string, bool>, TrainResult> cache;
  auto it = cache.find({name, tied});
  if (it == cache.end()) {
    ResidentSpec resident;
    resident.config = family(name, tied);
    resident.adam = options_for(3).adam;
    resident.adam.eps = 1.0f;  // rounding-size differences stay rounding-size
    it = cache.emplace(std::pair{name, tied}, train_resident(resident)).first;
  }
  return it->second;
}

struct Case;
int64_t sequences_rows(const Case& c);

struct Case {
  std::string family;
  int world, tp, stage;
  Tier param, optimizer;
  int micro_steps = 1;
  bool checkpoint = false;
  bool tied = false;
  bool sp = false;  // sequence parallelism
};

// Rows of one micro-step on one rank: its dp rank's share of the batch.
int64_t sequences_rows(const Case& c) { return kSequences / (c.world / c.tp) / c.micro_steps * kSeq; }

}  // namespace

TEST_CASE("tensor parallelism equals one resident rank on the combined batch", "[engine][zero][tp]") {
  ops::set_cpu_threads(1);
  test::TempDir dir("strata-zero-tp");
  const std::vector<Case> cases = {
      {"llama", 2, 2, 1, Tier::kDevice, Tier::kCpu},
      {"llama", 2, 2, 2, Tier::kDevice, Tier::kCpu, 2},
      {"llama", 2, 2, 3, Tier::kNvme, Tier::kNvme},
      {"llama", 2, 2, 3, Tier::kCpu, Tier::kCpu, 1, true, true},
      {"llama", 4, 2, 1, Tier::kDevice, Tier::kDevice},
      {"llama", 4, 2, 2, Tier::kDevice, Tier::kNvme},
      {"llama", 4, 2, 3, Tier::kNvme, Tier::kNvme, 1, true},
      {"mistral", 2, 2, 3, Tier::kDevice, Tier::kCpu},
      {"mistral", 4, 2, 2, Tier::kDevice, Tier::kCpu},
      {"qwen2", 2, 2, 2, Tier::kDevice, Tier::kCpu},
      {"qwen2", 4, 2, 3, Tier::kNvme, Tier::kNvme, 1, false, true},
      {"qwen3", 2, 2, 2, Tier::kDevice, Tier::kCpu, 2},
      {"qwen3", 4, 2, 3, Tier::kNvme, Tier::kNvme, 1, true},
      // tp 4 with 2 kv heads: ranks 0,1 share kv head 0, ranks 2,3 kv head 1.
      {"llama", 4, 4, 3, Tier::kNvme, Tier::kNvme},
      {"qwen2", 4, 4, 1, Tier::kDevice, Tier::kCpu},
      {"qwen3", 4, 4, 2, Tier::kDevice, Tier::kCpu, 2, true},
      // Sequence parallelism: norms and residual on each rank's rows.
      {"llama", 2, 2, 1, Tier::kDevice, Tier::kCpu, 1, false, false, true},
      {"llama", 4, 2, 3, Tier::kNvme, Tier::kNvme, 2, true, false, true},
      {"mistral", 4, 2, 2, Tier::kDevice, Tier::kCpu, 1, false, false, true},
      {"qwen2", 2, 2, 3, Tier::kNvme, Tier::kNvme, 1, false, true, true},
      {"qwen3", 4, 2, 1, Tier::kDevice, Tier::kDevice, 1, true, false, true},
      {"llama", 4, 4, 2, Tier::kDevice, Tier::kCpu, 2, false, true, true},
      {"gemma3_text", 2, 2, 3, Tier::kNvme, Tier::kNvme, 1, true, true},
      {"gemma3_text", 4, 2, 2, Tier::kDevice, Tier::kCpu, 1, false, false, true},
  };
  for (const Case& c : cases) {
    const std::string name = c.family + ", tp " + std::to_string(c.tp) + " x dp " + std::to_string(c.world / c.tp) +
                             ", stage " + std::to_string(c.stage) + ", params " + std::string(tier_name(c.param)) +
                             ", optimizer " + std::string(tier_name(c.optimizer)) +
                             (c.micro_steps > 1 ? ", 2 micro-steps" : "") + (c.checkpoint ? ", checkpointed" : "") +
                             (c.tied ? ", tied" : "") + (c.sp ? ", sequence parallel" : "");
    SECTION(name) {
      TrainSpec spec;
      spec.config = family(c.family, c.tied);
      spec.world = c.world;
      spec.tp = c.tp;
      spec.sequence_parallel = c.sp;
      spec.micro_steps = c.micro_steps;
      spec.checkpoint_activations = c.checkpoint;
      spec.options = options_on(c.stage, c.param, c.optimizer, dir.path() / "swap");
      const TrainResult r = train_zero(spec);
      const TrainResult& ref = reference(c.family, c.tied);
      const Diff d = compare(r, ref);
      INFO(name << ": max |tp - 1 resident rank| = " << d.max_abs);
      CHECK(d.max_abs <= 2e-6);
      REQUIRE(r.losses.size() == ref.losses.size());
      for (size_t i = 0; i < r.losses.size(); ++i) CHECK(r.losses[i] == Approx(ref.losses[i]).epsilon(1e-6));
      for (size_t i = 0; i < r.grad_norms.size(); ++i) {
        CHECK(r.grad_norms[i] == Approx(ref.grad_norms[i]).epsilon(1e-6));
      }
      if (c.stage == 3) CHECK(r.trace_drops == 0);
      CHECK(r.tp_replica_mismatches == 0);
      // Split for real: rank 0 holds half of each projection of the 2 layers
      // (q, k, v, o, gate, up, down, and the column-parallel biases), with
      // fewer kv heads than ranks one kv head each, and its vocabulary rows.
      const nn::DecoderConfig m = family(c.family, c.tied);
      const int64_t q = m.num_attention_heads * m.head_dim / c.tp, inter = m.intermediate_size / c.tp;
      const int64_t kv = (m.num_key_value_heads >= c.tp ? m.num_key_value_heads / c.tp : 1) * m.head_dim;
      int64_t per_layer = m.hidden_size * (q + 2 * kv) + q * m.hidden_size + 3 * m.hidden_size * inter;
      if (m.attention_qkv_bias) per_layer += q + 2 * kv;
      if (m.mlp_bias) per_layer += 2 * inter;
      CHECK(r.tensor_group_size == c.tp);
      // Megatron's traffic, no more. Without sequence parallelism, per layer
      // and micro-step two allreduces of [rows, hidden] in forward (after o
      // and down), two in backward (the inputs of q/k/v and of gate/up), two
      // more when a checkpointed layer is recomputed (every layer but the
      // last, whose activations backward finds in place); qwen3 adds its two
      // norms' [head_dim] gradients. With it, each forward allreduce becomes
      // an allgather before the block and a reduce-scatter after it; backward
      // gathers each block's output gradient and input (saved as this rank's
      // rows only) and reduce-scatters its input gradient; the final norm's
      // output is gathered for the loss and the embedding's gradient in
      // backward; the three norms' [hidden] weight gradients per layer plus
      // the final one's are summed over tp. Either way the vocabulary-parallel
      // embedding's output and the loss's dh are summed over tp (2 more
      // allreduces, or reduce-scatters), and each loss chunk (16 rows) gathers
      // its rows' 2 parts from every rank.
      const int64_t micro_steps = static_cast<int64_t>(spec.steps) * c.micro_steps;
      const int64_t rows = sequences_rows(c), layers = m.num_hidden_layers;
      const int64_t recomputed = c.checkpoint ? layers - 1 : 0;
      const int64_t small = m.qk_norm ? micro_steps * m.num_hidden_layers * 2 : 0;
      // Shared kv heads: k's and v's gradients summed over tp in backward.
      const bool shared = c.tp > m.num_key_value_heads;
      const int64_t kv_sums = shared ? micro_steps * m.num_hidden_layers * 2 : 0;
      const int64_t kv_sum_numel =
          m.num_key_value_heads * m.head_dim * (m.hidden_size + (m.attention_qkv_bias ? 1 : 0));
      const auto big_bytes = [&](int64_t n) { return static_cast<uint64_t>(n * rows * m.hidden_size * 4); };
      const uint64_t small_bytes =
          static_cast<uint64_t>(small * m.head_dim * 4 + kv_sums * kv_sum_numel * 4);
      const int64_t chunks = micro_steps * ((rows + 15) / 16);
      const auto parts_bytes = static_cast<uint64_t>(micro_steps * c.tp * 2 * rows * 4);
      if (!c.sp) {
        const int64_t big = micro_steps * (4 * layers + 2 * recomputed + 2);
        CHECK(r.tensor_traffic.allreduces == big + small + kv_sums);
        CHECK(r.tensor_traffic.allgathers == chunks);
        CHECK(r.tensor_traffic.reduce_scatters == 0);
        CHECK(r.tensor_traffic.bytes == big_bytes(big) + small_bytes + parts_bytes);
      } else {
        const int64_t gathers = micro_steps * (2 * layers + 4 * layers + 2 * recomputed + 2);
        const int64_t scatters = micro_steps * (2 * layers + 2 * layers + 2 * recomputed + 2);
        const int64_t norms = micro_steps * ((m.sandwich_norms ? 4 : 2) * layers + 1);  // Gemma: 4 per layer
        CHECK(r.tensor_traffic.allgathers == gathers + chunks);
        CHECK(r.tensor_traffic.reduce_scatters == scatters);
        CHECK(r.tensor_traffic.allreduces == norms + small + kv_sums);
        CHECK(r.tensor_traffic.bytes == big_bytes(gathers + scatters) + static_cast<uint64_t>(norms * m.hidden_size * 4) +
                                            small_bytes + parts_bytes);
      }
      // strata plan's arena is a tp rank's (its heads and features), the q/k norms' scratch included.
      const int64_t sequences = kSequences / (c.world / c.tp) / c.micro_steps;
      CHECK(plan::decoder_arena_nbytes(m, DType::kF32, sequences, kSeq, c.checkpoint, false, {}, 1, c.tp, c.sp) ==
            r.arena_nbytes);
      // And its vocabulary rows of the embedding and (untied) lm_head.
      const int64_t vocab_rows = m.vocab_size / c.tp * m.hidden_size * (c.tied ? 1 : 2);
      CHECK(r.tp_split_elements == m.num_hidden_layers * per_layer + vocab_rows);
      // strata plan's view of rank 0's tensors is the one it declares.
      const std::vector<plan::RankParam> planned = plan::decoder_rank_params(m, DType::kF32, c.tp);
      REQUIRE(planned.size() == r.rank0_params.size());
      for (size_t i = 0; i < planned.size(); ++i) {
        INFO(planned[i].spec.name);
        CHECK(planned[i].spec.shape == r.rank0_params[i].first);
        CHECK(planned[i].split == r.rank0_params[i].second);
      }
    }
  }
}

TEST_CASE("tensor parallelism refuses a model it cannot split, naming the sizes", "[engine][tp]") {
  nn::DecoderConfig c = model_config(false);  // 4 heads, 2 kv heads, intermediate 64
  CHECK(nn::tensor_parallel_share(c, 2).num_attention_heads == 2);
  CHECK(nn::tensor_parallel_share(c, 2).num_key_value_heads == 1);
  CHECK(nn::tensor_parallel_share(c, 2).intermediate_size == 32);
  CHECK(nn::tensor_parallel_share(c, 4).num_key_value_heads == 1);  // two ranks share each kv head
  CHECK_THROWS_WITH(nn::tensor_parallel_share(c, 3), Catch::Contains("does not divide num_attention_heads 4"));
  nn::DecoderConfig six = c;  // 12 heads, 4 kv heads at tp 6: neither divides the other
  six.num_attention_heads = 12;
  six.num_key_value_heads = 4;
  six.head_dim = 8;
  six.intermediate_size = 60;
  CHECK_THROWS_WITH(nn::tensor_parallel_share(six, 6), Catch::Contains("num_key_value_heads 4: one must divide"));
  CHECK_THROWS_WITH(nn::tensor_parallel_share(mixtral_config(4, 16, false), 2),
                    Catch::Contains("mixture-of-experts"));
}

TEST_CASE("a tensor-parallel rank's activations per layer follow Korthikanti et al.'s formula", "[engine][tp][memory]") {
  // Llama-2-7B at s = 4096, b = 1 in bf16, no checkpointing: the bytes one
  // decoder layer adds to a rank's activation arena (what the model
  // allocates: the test above holds decoder_arena_nbytes equal to its arena)
  // against "Reducing Activation Recomputation in Large Transformer Models"
  // (arXiv 2205.05198) with tensor parallelism t and no sequence
  // parallelism: s b h (10 + 24 / t) + 5 a s^2 b / t. The attention scores'
  // 5 a s^2 b / t is left out: the attention kernel keeps its log-sum-exp
  // (b a s / t floats), never the s x s scores. The rest differs by design:
  // no dropout masks (2 s b h replicated), and SwiGLU's three [s b, 11008]
  // against GeLU's [s b, 4h] two — together 8 + 24.1 / t. With sequence
  // parallelism the formula is s b h 34 / t (+ the scores' term): every
  // saved activation divided by t, the norms' and residual's included.
  nn::DecoderConfig c;
  c.vocab_size = 32000;
  c.hidden_size = 4096;
  c.intermediate_size = 11008;
  c.num_attention_heads = c.num_key_value_heads = 32;
  c.head_dim = 128;
  c.max_position_embeddings = 4096;
  const int64_t s = 4096, b = 1, h = c.hidden_size;
  const double sbh = static_cast<double>(s * b * h);
  for (int t : {1, 2, 4}) {
    CAPTURE(t);
    c.num_hidden_layers = 2;
    const size_t two = plan::decoder_arena_nbytes(c, DType::kBF16, b, s, false, false, {}, 1, t);
    c.num_hidden_layers = 1;
    const size_t one = plan::decoder_arena_nbytes(c, DType::kBF16, b, s, false, false, {}, 1, t);
    const double layer = static_cast<double>(two - one), formula = sbh * (10 + 24.0 / t);
    WARN("tp " << t << ": " << layer / 1e6 << " MB per layer = " << layer / sbh << " s b h; the formula without the "
               "scores " << formula / sbh << " s b h; ratio " << layer / formula);
    CHECK(layer / formula == Approx(1.0).epsilon(0.15));
    if (t == 1) continue;
    c.num_hidden_layers = 2;
    const size_t two_sp = plan::decoder_arena_nbytes(c, DType::kBF16, b, s, false, false, {}, 1, t, true);
    c.num_hidden_layers = 1;
    const size_t one_sp = plan::decoder_arena_nbytes(c, DType::kBF16, b, s, false, false, {}, 1, t, true);
    const double layer_sp = static_cast<double>(two_sp - one_sp), formula_sp = sbh * 34.0 / t;
    WARN("tp " << t << " with sequence parallelism: " << layer_sp / 1e6 << " MB per layer = " << layer_sp / sbh
               << " s b h; the formula without the scores " << formula_sp / sbh << " s b h; ratio "
               << layer_sp / formula_sp);
    CHECK(layer_sp / formula_sp == Approx(1.0).epsilon(0.15));
  }
}
