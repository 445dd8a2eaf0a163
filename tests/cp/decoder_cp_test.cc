// Context parallelism in the decoder (issue 46; docs/DESIGN.md §5): cp ranks
// (real Gloo ranks as threads) each holding chunks c and 2cp−1−c of every
// sequence, RoPE at global positions, the attention through ring attention or
// Ulysses, the loss and its normaliser summed over the ranks, ZeRO over dp x
// cp — the same losses, gradient norms and parameters as ONE resident rank
// on the combined batch, to rounding (the blocks' log-sum-exp merge runs in
// another order). The matrices start at std 0.2, so that a piece of the math
// left out moves the loss visibly; and what is not implemented is refused by
// name.
#include <catch2/catch.hpp>

#include <random>
#include <string>
#include <vector>

#include "runtime/nn/context_attention.h"
#include "runtime/nn/decoder_config.h"
#include "runtime/plan/runtime_memory.h"
#include "tests/engine/zero_training.h"
#include "tests/support/temp_dir.h"

using namespace strata;
using namespace strata::test::zero;

namespace {

constexpr double kInitStd = 0.2;

nn::DecoderConfig family(const std::string& name) {
  nn::DecoderConfig c = model_config(false);  // 4 heads, 2 kv heads, 2 layers
  c.model_type = name == "llama-mha" ? "llama" : name;
  if (name == "llama") {
    c.attention_qkv_bias = c.attention_o_bias = c.mlp_bias = true;
  } else if (name == "llama-mha") {
    // As many kv heads as heads: Ulysses at cp 2 x tp 2 splits a tp rank's 2 kv heads.
    c.attention_qkv_bias = c.attention_o_bias = true;
    c.num_key_value_heads = c.num_attention_heads;
  } else if (name == "qwen3") {
    c.qk_norm = true;
    c.sliding_window = 2;  // narrower than a chunk (12 / 4 = 3 tokens at cp 2)
  } else if (name == "gemma2") {
    // Gemma's pieces: the scores' scale and soft cap in every block, the
    // logits' soft cap, sandwich norms, a sliding layer with its own RoPE.
    c.hidden_act = ops::GluActivation::kGeluTanh;
    c.norm_weight_offset = 1;
    c.scale_embedding = true;
    c.sandwich_norms = true;
    c.query_pre_attn_scalar = 12;
    c.attn_logit_softcapping = 2;
    c.final_logit_softcapping = 3;
    c.sliding_window = 5;
    c.sliding_layers = {true, false};
    c.sliding_rope = c.rope;
    c.sliding_rope->theta = 100;
  }
  return c;
}

// Packed documents: each sequence of kSeq tokens a run of documents whose
// lengths change with the sequence, so that documents cross the chunks'
// edges (chunks of 3 tokens at cp 2).
Batch packed(int step, int64_t vocab) {
  Batch b = corpus(step, vocab);
  const std::vector<std::vector<int>> lengths = {{5, 4, 3}, {2, 10}, {7, 5}, {1, 6, 5}};
  for (int64_t s = 0; s < kSequences; ++s) {
    for (int n : lengths[static_cast<size_t>(s)]) {
      for (int i = 0; i < n; ++i) b.positions.push_back(i);
    }
  }
  return b;
}

const TrainResult& reference(const std::string& name, bool documents) {
  static std::map<std::pair<std::string, bool>, TrainResult> cache;
  auto it = cache.find({name, documents});
  if (it == cache.end()) {
    ResidentSpec resident;
    resident.config = family(name);
    resident.adam = options_for(3).adam;
    resident.adam.eps = 1.0f;  // rounding-size differences stay rounding-size
    resident.init_std = kInitStd;
    if (documents) resident.batches = packed;
    it = cache.emplace(std::pair{name, documents}, train_resident(resident)).first;
  }
  return it->second;
}

struct Case {
  std::string family;
  int world, cp;
  nn::ContextMethod method;
  int stage;
  bool documents = false;
  bool checkpoint = false;
  int tp = 1;  // world = dp x cp x tp: the cp groups stride tp, each on its tp rank's heads
  bool sequence_parallel = false;
};

}  // namespace

TEST_CASE("context parallelism equals one resident rank on the combined batch", "[cp][engine]") {
  ops::set_cpu_threads(1);
  test::TempDir dir("strata-cp");
  using nn::ContextMethod;
  const std::vector<Case> cases = {
      {"llama", 2, 2, ContextMethod::kRing, 2},
      {"llama", 2, 2, ContextMethod::kUlysses, 3},
      {"llama", 2, 2, ContextMethod::kRing, 3, true, true},
      {"qwen3", 2, 2, ContextMethod::kRing, 1, true},
      {"qwen3", 2, 2, ContextMethod::kUlysses, 2, true},
      {"llama", 4, 2, ContextMethod::kRing, 3, true},  // dp 2 x cp 2
      {"gemma2", 2, 2, ContextMethod::kRing, 2, true},
      {"gemma2", 2, 2, ContextMethod::kUlysses, 3},
      // cp 2 x tp 2: ring on a tp rank's 2 heads and 1 kv head; Ulysses on
      // its 2 heads and 2 kv heads; sequence parallelism's shards inside
      // each cp rank's two chunks.
      {"llama", 4, 2, ContextMethod::kRing, 3, true, false, 2, true},
      {"llama", 4, 2, ContextMethod::kRing, 2, false, true, 2},
      {"llama-mha", 4, 2, ContextMethod::kUlysses, 3, true, false, 2, true},
      {"qwen3", 4, 2, ContextMethod::kRing, 1, true, false, 2, true},
  };
  for (const Case& c : cases) {
    const std::string name = c.family + ", cp " + std::to_string(c.cp) + " x dp " +
                             std::to_string(c.world / (c.cp * c.tp)) +
                             (c.tp > 1 ? " x tp " + std::to_string(c.tp) : "") + (c.sequence_parallel ? " with SP" : "") +
                             " " + std::string(nn::context_method_name(c.method)) + ", stage " +
                             std::to_string(c.stage) + (c.documents ? ", packed documents" : "") +
                             (c.checkpoint ? ", checkpointed" : "");
    SECTION(name) {
      TrainSpec spec;
      spec.config = family(c.family);
      spec.world = c.world;
      spec.cp = c.cp;
      spec.cp_method = c.method;
      spec.tp = c.tp;
      spec.sequence_parallel = c.sequence_parallel;
      spec.init_std = kInitStd;
      spec.checkpoint_activations = c.checkpoint;
      spec.options = options_on(c.stage, Tier::kDevice, Tier::kCpu, dir.path() / "swap");
      if (c.documents) spec.batches = packed;
      const TrainResult r = train_zero(spec);
      const TrainResult& ref = reference(c.family, c.documents);
      const Diff d = compare(r, ref);
      WARN(name << ": max |cp - 1 resident rank| = " << d.max_abs << " (largest parameter " << d.max_ref << ")");
      CHECK(d.max_abs <= 1e-6);
      CHECK(r.tensor_group_size == c.tp);
      // What strata plan counts for a cp rank, exactly: its arena (s/cp rows,
      // the documents over the whole sequences) and beside it the ring's or
      // Ulysses' buffers on its tp rank's heads.
      const nn::DecoderConfig share = nn::tensor_parallel_share(*spec.config, c.tp);
      const int64_t batch = kSequences / (c.world / (c.cp * c.tp));
      CHECK(r.arena_nbytes == plan::decoder_arena_nbytes(*spec.config, DType::kF32, batch, kSeq, c.checkpoint, false,
                                                         {}, 1, c.tp, c.sequence_parallel, c.cp));
      CHECK(r.context_buffer_nbytes == nn::context_buffer_nbytes(c.method, c.cp, batch, kSeq,
                                                                 share.num_attention_heads,
                                                                 share.num_key_value_heads, spec.config->head_dim,
                                                                 DType::kF32));
      CHECK(r.tp_replica_mismatches == 0);  // every tp rank's copy of a replicated tensor, bit for bit
      REQUIRE(r.losses.size() == ref.losses.size());
      for (size_t i = 0; i < r.losses.size(); ++i) CHECK(r.losses[i] == Approx(ref.losses[i]).epsilon(1e-6));
      REQUIRE(r.grad_norms.size() == ref.grad_norms.size());
      for (size_t i = 0; i < r.grad_norms.size(); ++i) {
        CHECK(r.grad_norms[i] == Approx(ref.grad_norms[i]).epsilon(1e-6));
      }
    }
  }
}

TEST_CASE("context parallelism with LoRA adapters equals one resident rank: the adapters summed over cp as over dp",
          "[cp][engine]") {
  ops::set_cpu_threads(1);
  test::TempDir dir("strata-cp-lora");
  nn::LoraSpec lora;
  lora.rank = 2;
  lora.alpha = 4;
  lora.targets = {"q_proj", "v_proj", "down_proj"};
  ResidentSpec resident;
  resident.config = family("llama");
  resident.model.lora = lora;
  resident.adam = options_for(3).adam;
  resident.adam.eps = 1.0f;
  resident.init_std = kInitStd;
  resident.batches = packed;
  const TrainResult ref = train_resident(resident);
  for (const nn::ContextMethod method : {nn::ContextMethod::kRing, nn::ContextMethod::kUlysses}) {
    TrainSpec spec;
    spec.config = family("llama");
    spec.world = 2;
    spec.cp = 2;
    spec.cp_method = method;
    spec.lora = lora;
    spec.init_std = kInitStd;
    spec.options = options_on(2, Tier::kDevice, Tier::kCpu, dir.path() / "swap");
    spec.batches = packed;
    const TrainResult r = train_zero(spec);
    const Diff d = compare(r, ref);
    INFO(nn::context_method_name(method) << ": max |cp - 1 resident rank| = " << d.max_abs);
    CHECK(d.max_abs <= 1e-6);
    // strata plan's arena for it (the adapters' scratch at s/cp rows), exactly.
    CHECK(r.arena_nbytes == plan::decoder_arena_nbytes(*spec.config, DType::kF32, kSequences, kSeq, false, false, lora,
                                                       1, 1, false, 2));
    REQUIRE(r.losses.size() == ref.losses.size());
    for (size_t i = 0; i < r.losses.size(); ++i) CHECK(r.losses[i] == Approx(ref.losses[i]).epsilon(1e-6));
    // The adapters learn (B starts at 0): the loss moves between the steps.
    CHECK(std::abs(ref.losses.back() - ref.losses.front()) > 1e-4);
  }
}

TEST_CASE("the cp reference is sensitive: positions, documents and the window move the loss", "[cp][engine]") {
  // What the equivalence above rests on: at std 0.2 the model's loss moves
  // visibly when a piece of the math the ranks must agree on changes —
  // the documents' mask and the rotary positions (packed: positions restart
  // per document) and the window.
  ops::set_cpu_threads(1);
  const TrainResult& whole = reference("llama", false);
  const TrainResult& documents = reference("llama", true);
  const TrainResult& qwen3 = reference("qwen3", true);
  ResidentSpec no_window;
  no_window.config = family("qwen3");
  no_window.config->sliding_window = 0;
  no_window.adam = options_for(3).adam;
  no_window.adam.eps = 1.0f;
  no_window.init_std = kInitStd;
  no_window.batches = packed;
  const TrainResult wide = train_resident(no_window);
  WARN("first loss: whole sequences " << whole.losses[0] << ", packed documents " << documents.losses[0]
                                      << "; qwen3 window 2 " << qwen3.losses[0] << ", no window " << wide.losses[0]);
  CHECK(std::abs(whole.losses[0] - documents.losses[0]) > 1e-3);
  CHECK(std::abs(qwen3.losses[0] - wide.losses[0]) > 1e-3);
}

TEST_CASE("context parallelism refuses by name what it does not implement", "[cp][engine]") {
  ops::set_cpu_threads(1);
  // With tensor parallelism Ulysses splits a tp rank's heads: 2 kv heads over tp 2 leave one per rank.
  CHECK_THROWS_WITH(nn::check_context_parallel(4, 2, 2, nn::ContextMethod::kUlysses, 2),
                    Catch::Contains("with tensor parallelism 2 a rank holds 2 of the num_attention_heads 4 and 1 of "
                                    "the num_key_value_heads 2, which do not both divide by 2"));
  CHECK_NOTHROW(nn::check_context_parallel(4, 4, 2, nn::ContextMethod::kUlysses, 2));
  CHECK_NOTHROW(nn::check_context_parallel(4, 2, 2, nn::ContextMethod::kRing, 2));
  std::vector<std::string> errors(2);
  test::run_zero_ranks(
      2,
      [&](int rank, Accelerator& accelerator, engine::ZeroComms comms) {
        engine::ZeroEngine eng(accelerator, comms, options_for(2));
        REQUIRE(eng.context_group().size == 2);
        REQUIRE(eng.context_group().rank == rank);
        REQUIRE(eng.world_size() == 2);  // ZeRO over dp 1 x cp 2
        CHECK_THROWS_WITH(nn::DecoderModel(eng, mixtral_config(4, 16, false), nn::model_options(DType::kF32, 16)),
                          Catch::Contains("with mixture-of-experts layers (model_type mixtral)"));
        nn::DecoderConfig three = model_config(false);  // 3 kv heads do not split 2 ways
        three.num_attention_heads = 6;
        three.num_key_value_heads = 3;
        three.head_dim = 8;
        nn::DecoderModelOptions ulysses = nn::model_options(DType::kF32, 16);
        ulysses.context_method = nn::ContextMethod::kUlysses;
        CHECK_THROWS_WITH(nn::DecoderModel(eng, three, ulysses),
                          Catch::Contains("num_key_value_heads 3 do not both divide by 2 (use \"method\": \"ring\")"));
        // Ring attention takes them; a sequence that does not cut into 4 chunks is refused before anything runs.
        nn::DecoderModel model(eng, model_config(false), nn::model_options(DType::kF32, 16));
        eng.finalize();
        const std::vector<int32_t> ids(10, 1);
        try {
          model.forward(ids, ids, 1, 10);
        } catch (const Error& e) {
          errors[static_cast<size_t>(rank)] = e.message();
        }
      },
      std::chrono::milliseconds(30000), 1, 1, 2);
  for (const std::string& e : errors) {
    CHECK_THAT(e, Catch::Contains("cuts each sequence into 2 x 2 = 4 chunks (two per rank), but the sequence length "
                                  "10 does not divide by 4"));
  }
}
