// Linear and TiledLinear modules over Ops::linear_forward / linear_backward.
#include "runtime/nn/linear.h"

#include <optional>

#include "core/error.h"

namespace strata::nn {

void LinearBase::check_rows(const MatView& a, int64_t a_cols, const MatView& b,
                            int64_t b_cols) const {
  STRATA_CHECK(a.cols == a_cols && b.cols == b_cols && a.rows == b.rows, kBadArgument,
               "{}: got {} x {} and {} x {}, expected [rows, {}] and [rows, {}]", name_, a.rows,
               a.cols, b.rows, b.cols, a_cols, b_cols);
}

Linear::Linear(engine::Engine& engine, std::string name, int64_t in, int64_t out, bool bias,
               DType dtype, const LoraSpec* lora, TensorSplit split, TpBlock block, const LinearSlices* slices)
    : LinearBase(engine, std::move(name), in, out), block_(block) {
  STRATA_CHECK(in > 0 && out > 0, kBadArgument, "{}: bad Linear shape in={} out={}", name_, in,
               out);
  const int tp = engine.tensor_group().size;
  if (slices != nullptr) {
    STRATA_CHECK(split == TensorSplit::kNone && (lora == nullptr || !lora->targets_module(name_)), kBadArgument,
                 "{}: a projection stored as a view of a larger tensor takes no tensor-parallel split or adapter",
                 name_);
    weight_ = add_parameter("weight", dtype, {out, in}, slices->weight);
    if (bias) bias_ = add_parameter("bias", dtype, {out}, slices->bias);
  } else if (split == TensorSplit::kNone || tp == 1) {
    weight_ = add_parameter("weight", dtype, {out, in});
    if (bias) bias_ = add_parameter("bias", dtype, {out});
  } else if (split == TensorSplit::kColumn) {
    weight_ = add_tp_shard("weight", dtype, {out, in}, 0, block.blocks, block.block, block.copies);
    if (bias) bias_ = add_tp_shard("bias", dtype, {out}, 0, block.blocks, block.block, block.copies);
    out_ = out / (block.blocks > 0 ? block.blocks : tp);
  } else {
    weight_ = add_tp_shard("weight", dtype, {out, in}, 1);
    if (bias) bias_ = add_parameter("bias", dtype, {out});
    bias_in_forward_ = engine.tensor_group().rank == 0;
    in_ = in / tp;
  }
  STRATA_CHECK(lora == nullptr || !lora->targets_module(name_) || tp == 1 || split == TensorSplit::kNone,
               kBadArgument, "{}: LoRA adapters are not implemented with tensor parallelism yet", name_);
  std::vector<ParamId> reads{weight_};
  if (bias_ >= 0) reads.push_back(bias_);
  if (lora != nullptr && lora->targets_module(name_)) {
    rank_ = lora->rank;
    scaling_ = static_cast<float>(lora->scaling());
    for (char ch : name_) name_key_ = (name_key_ ^ static_cast<unsigned char>(ch)) * 0x100000001b3ull;
    reads.push_back(lora_a_ = add_parameter("lora_A.weight", DType::kF32, {rank_, in}));
    reads.push_back(lora_b_ = add_parameter("lora_B.weight", DType::kF32, {out, rank_}));
  }
  op_ = add_operator(reads);
}

std::pair<MatView, MatView> Linear::scratch(const LoraScratch& lora, int64_t rows) const {
  STRATA_CHECK(lora.h.data != nullptr && lora.dh.data != nullptr, kBadArgument,
               "{}: its LoRA adapter needs scratch and none was given", name_);
  check_shape(name_, "LoRA scratch h", lora.h, {rows, rank_});
  check_shape(name_, "LoRA scratch dh", lora.dh, {rows, rank_});
  return {MatView::of(lora.h), MatView::of(lora.dh)};
}

std::pair<MatView, MatView> Linear::dropout_scratch(const LoraScratch& lora, int64_t rows) const {
  STRATA_CHECK(lora.xd.data != nullptr && lora.dxd.data != nullptr && lora.xd.numel() >= rows * in_ &&
                   lora.dxd.numel() >= rows * in_ && lora.xd.desc.dtype == lora.h.desc.dtype,
               kBadArgument, "{}: LoRA dropout needs [rows, {}] scratch", name_, in_);
  return {MatView{lora.xd.data, lora.xd.desc.dtype, rows, in_, in_},
          MatView{lora.dxd.data, lora.dxd.desc.dtype, rows, in_, in_}};
}

void Linear::forward(const MatView& x, const MatView& y, Phase phase, const LoraScratch& lora) {
  check_rows(x, in_, y, out_);
  run(op_, phase, [&] {
    ops().linear_forward(ctx(), x, param(weight_), bias_ >= 0 && bias_in_forward_ ? param(bias_) : TensorView{},
                         y, /*accumulate=*/false);
    if (!adapted()) return;
    // y += s * (dropout(x) A^T) B^T: two thin GEMMs, s inside the second.
    const MatView h = scratch(lora, x.rows).first;
    MatView in = x;
    if (lora.dropout > 0) {
      in = dropout_scratch(lora, x.rows).first;
      ops().dropout(ctx(), x, in, lora.dropout, mask_seed(lora.seed), /*accumulate=*/false);
    }
    ops().linear_forward(ctx(), in, param(lora_a_), TensorView{}, h, /*accumulate=*/false);
    ops().linear_forward(ctx(), h, param(lora_b_), TensorView{}, y, /*accumulate=*/true, scaling_);
  });
}

int64_t Linear::shared_scratch_numel() const {
  return block_.blocks * (out_ * in_ + (bias_ >= 0 ? out_ : 0));
}

void Linear::backward_shared(const MatView& dy, const MatView& x, const MatView& dx, bool accumulate_dx,
                             const TensorView& scratch) {
  check_rows(dy, out_, x, in_);
  STRATA_CHECK(shared() && !adapted(), kInternal, "{}: backward_shared of a projection no other rank shares", name_);
  check_shape(name_, "shared-block gradient scratch", scratch, {shared_scratch_numel()});
  STRATA_CHECK(scratch.desc.dtype == DType::kF32, kInternal, "{}: the gradient scratch must be fp32", name_);
  run(op_, Phase::kBackward, [&] {
    const TensorView dw = grad(weight_), db = bias_ >= 0 ? grad(bias_) : TensorView{};
    const int64_t per_block = out_ * in_ + (bias_ >= 0 ? out_ : 0);
    char* mine = static_cast<char*>(scratch.data) + block_.block * per_block * static_cast<int64_t>(sizeof(float));
    const TensorView dw_part{TensorDesc{DType::kF32, {out_, in_}, scratch.desc.tier}, mine};
    TensorView db_part;
    if (bias_ >= 0) {
      db_part = TensorView{TensorDesc{DType::kF32, {out_}, scratch.desc.tier},
                           mine + out_ * in_ * static_cast<int64_t>(sizeof(float))};
    }
    engine_.accelerator().memset_async(scratch.data, 0, scratch.nbytes(), engine_.compute_stream());
    ops().linear_backward(ctx(), dy, x, param(weight_), dx, accumulate_dx, dw.data != nullptr ? dw_part : TensorView{},
                          db.data != nullptr ? db_part : TensorView{});
    engine_.tp_allreduce(scratch);
    if (dw.data != nullptr) ops().add(ctx(), dw, dw_part, dw);
    if (db.data != nullptr) ops().add(ctx(), db, db_part, db);
  });
}

void Linear::backward(const MatView& dy, const MatView& x, const MatView& dx, bool accumulate_dx,
                      const LoraScratch& lora) {
  check_rows(dy, out_, x, in_);
  STRATA_CHECK(!shared(), kInternal, "{}: a block shared by tp ranks goes through backward_shared", name_);
  engine::Engine::WeightGradSink* sink = engine_.weight_grad_sink();
  const bool trained = !engine_.param_info(weight_).frozen || (bias_ >= 0 && !engine_.param_info(bias_).frozen);
  if (sink != nullptr && trained && !adapted() && dy.ld == dy.cols && x.ld == x.cols) {
    // A split backward's B: the input gradient now, reading the weight in a
    // window that adds to no gradient; the weight's and bias's later (W).
    run(op_, Phase::kRecompute, [&] {
      ops().linear_backward(ctx(), dy, x, param(weight_), dx, accumulate_dx, TensorView{}, TensorView{});
    });
    sink->defer(dy, x, [this](const MatView& dy_copy, const MatView& x_copy) { weight_backward(dy_copy, x_copy); });
    return;
  }
  run(op_, Phase::kBackward, [&] {
    ops().linear_backward(ctx(), dy, x, param(weight_), dx, accumulate_dx, grad(weight_),
                          bias_ >= 0 ? grad(bias_) : TensorView{});
    if (!adapted()) return;
    // h = x A^T again (not kept from forward); dB += s dy^T h and dh = s dy B;
    // dA += dh^T x and dx += dh A. With dropout x is the dropped input (its
    // mask regenerated from the seed) and dx gets dh A through the same mask.
    const auto [h, dh] = scratch(lora, x.rows);
    MatView in = x;
    std::optional<MatView> din;
    if (lora.dropout > 0) {
      const auto [xd, dxd] = dropout_scratch(lora, x.rows);
      ops().dropout(ctx(), x, xd, lora.dropout, mask_seed(lora.seed), /*accumulate=*/false);
      in = xd;
      din = dxd;
    }
    ops().linear_forward(ctx(), in, param(lora_a_), TensorView{}, h, /*accumulate=*/false);
    ops().linear_backward(ctx(), dy, h, param(lora_b_), dh, /*accumulate_dx=*/false, grad(lora_b_),
                          TensorView{}, scaling_);
    if (!din) {
      ops().linear_backward(ctx(), dh, x, param(lora_a_), dx, /*accumulate_dx=*/true, grad(lora_a_),
                            TensorView{});
      return;
    }
    const bool want_dx = dx.data != nullptr;
    ops().linear_backward(ctx(), dh, in, param(lora_a_), want_dx ? *din : MatView{}, /*accumulate_dx=*/false,
                          grad(lora_a_), TensorView{});
    if (want_dx) ops().dropout(ctx(), *din, dx, lora.dropout, mask_seed(lora.seed), /*accumulate=*/true);
  });
}

void Linear::weight_backward(const MatView& dy, const MatView& x) {
  check_rows(dy, out_, x, in_);
  run(op_, Phase::kBackward, [&] {
    ops().linear_backward(ctx(), dy, x, param(weight_), MatView{}, false, grad(weight_),
                          bias_ >= 0 ? grad(bias_) : TensorView{});
  });
}

std::vector<int64_t> split_boundaries(int64_t n, int64_t parts) {
  STRATA_CHECK(parts >= 1 && parts <= n, kBadArgument, "cannot split {} features into {} parts", n,
               parts);
  std::vector<int64_t> b{0};
  for (int64_t p = 0; p < parts; ++p) b.push_back(b.back() + n / parts + (p < n % parts ? 1 : 0));
  return b;
}

TiledLinear::TiledLinear(engine::Engine& engine, std::string name, int64_t in, int64_t out,
                         int64_t in_splits, int64_t out_splits, bool bias, DType dtype)
    : LinearBase(engine, std::move(name), in, out),
      in_parts_(split_boundaries(in, in_splits)),
      out_parts_(split_boundaries(out, out_splits)) {
  for (int64_t o = 0; o < out_splits; ++o) {
    ParamId b = -1;
    if (bias) {
      b = add_parameter("bias.tile_" + std::to_string(o), dtype,
                        {out_parts_[o + 1] - out_parts_[o]},
                        engine::ParameterSlice{child_name("bias"), {out}, {out_parts_[o]}, {}, 0});
    }
    for (int64_t i = 0; i < in_splits; ++i) {
      const std::string suffix = "tile_" + std::to_string(o) + "_" + std::to_string(i);
      const ParamId w = add_parameter(
          "weight." + suffix, dtype,
          {out_parts_[o + 1] - out_parts_[o], in_parts_[i + 1] - in_parts_[i]},
          engine::ParameterSlice{child_name("weight"), {out, in}, {out_parts_[o], in_parts_[i]}, {}, 0});
      // The bias of an out part is added once, with its first input tile.
      const ParamId tile_bias = i == 0 ? b : -1;
      const OpId op = tile_bias >= 0 ? add_operator({w, tile_bias}, suffix) : add_operator({w}, suffix);
      tiles_.push_back(Tile{w, tile_bias, op});
    }
  }
}

void TiledLinear::forward(const MatView& x, const MatView& y, Phase phase, const LoraScratch&) {
  check_rows(x, in_, y, out_);
  for (int64_t o = 0; o < out_splits(); ++o) {
    for (int64_t i = 0; i < in_splits(); ++i) {
      const Tile& t = tile(o, i);
      run(t.op, phase, [&] {  // one tile's weight in memory at a time
        ops().linear_forward(ctx(), x.columns(in_parts_[i], in_parts_[i + 1]), param(t.weight),
                             t.bias >= 0 ? param(t.bias) : TensorView{},
                             y.columns(out_parts_[o], out_parts_[o + 1]),
                             /*accumulate=*/i > 0);
      });
    }
  }
}

void TiledLinear::backward(const MatView& dy, const MatView& x, const MatView& dx,
                           bool accumulate_dx, const LoraScratch&) {
  check_rows(dy, out_, x, in_);
  for (int64_t o = 0; o < out_splits(); ++o) {
    for (int64_t i = 0; i < in_splits(); ++i) {
      const Tile& t = tile(o, i);
      const MatView dx_part =
          dx.data == nullptr ? MatView{} : dx.columns(in_parts_[i], in_parts_[i + 1]);
      run(t.op, Phase::kBackward, [&] {
        ops().linear_backward(ctx(), dy.columns(out_parts_[o], out_parts_[o + 1]),
                              x.columns(in_parts_[i], in_parts_[i + 1]), param(t.weight), dx_part,
                              /*accumulate_dx=*/accumulate_dx || o > 0, grad(t.weight),
                              t.bias >= 0 ? grad(t.bias) : TensorView{});
      });
    }
  }
}

}  // namespace strata::nn
