// The pipeline executor: a rank's action list over its chunks' models.
#include "runtime/pipeline/executor.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <tuple>
#include <utility>

#include "core/error.h"
#include "core/trace_recorder.h"
#include "runtime/pipeline/deferred_weights.h"

namespace strata::pipeline {

// A micro-batch slot of one chunk's model: which micro-batch holds it, what
// its last send was (the next micro-batch waits for it before writing), and
// its deferred weight gradients (split schedules).
struct PipelineExecutor::Slot {
  int micro_batch = -1;
  std::unique_ptr<Event> sent;
  std::unique_ptr<DeferredWeightGrads> deferred;
};

struct PipelineExecutor::Chunk {
  nn::DecoderModel* model = nullptr;
  int virtual_stage = 0;
  std::vector<Slot> slots;
  std::map<int, int> slot_of;  // micro-batch -> slot
  // Per micro-batch: the index of the last action of the step's list that
  // uses its slot (after it, the slot is given back).
  std::map<int, size_t> last_use;
};

namespace {
using Clock = std::chrono::steady_clock;

// What a transfer carries, for its tag and errors.
enum class Carries : uint64_t { kActivation = 1, kGradient = 2 };
}  // namespace

PipelineExecutor::PipelineExecutor(engine::Engine& engine, partition::Communicator& pp, const ScheduleSpec& spec,
                                   std::vector<nn::DecoderModel*> chunks)
    : PipelineExecutor(engine, &pp, spec, std::move(chunks), BoundaryHome::kDevice, BoundaryNvme{},
                       LayerActivations::kRecompute) {}

PipelineExecutor::PipelineExecutor(engine::Engine& engine, const ScheduleSpec& spec,
                                   std::vector<nn::DecoderModel*> chunks, BoundaryHome home,
                                   const BoundaryNvme& nvme, LayerActivations activations)
    : PipelineExecutor(engine, nullptr, spec, std::move(chunks), home, nvme, activations) {}

PipelineExecutor::PipelineExecutor(engine::Engine& engine, partition::Communicator* pp, const ScheduleSpec& spec,
                                   std::vector<nn::DecoderModel*> chunks, BoundaryHome home,
                                   const BoundaryNvme& nvme, LayerActivations activations)
    : engine_(engine), pp_(pp), schedule_(make_schedule(spec)), stage_(pp != nullptr ? pp->rank() : 0),
      busy_ns_(std::make_shared<std::array<std::atomic<int64_t>, 3>>()),
      last_end_ns_(std::make_shared<std::atomic<int64_t>>(0)),
      action_ns_(std::make_shared<std::vector<int64_t>>()) {
  if (pp != nullptr) {
    STRATA_CHECK(pp->world_size() == spec.stages, kBadArgument,
                 "pipeline schedule {} for {} stages, but the pipeline group has {} ranks", schedule_name(spec.kind),
                 spec.stages, pp->world_size());
  } else {
    STRATA_CHECK(spec.local_handoff(), kBadArgument,
                 "pipeline schedule {} passes boundaries between ranks: it needs the pipeline group's communicator",
                 schedule_name(spec.kind));
  }
  STRATA_CHECK(static_cast<int>(chunks.size()) == spec.virtual_stages, kBadArgument,
               "pipeline stage {}: {} models given for {} virtual stages per rank", stage_, chunks.size(),
               spec.virtual_stages);
  const int last = spec.stages * spec.virtual_stages - 1;
  for (size_t k = 0; k < chunks.size(); ++k) {
    nn::DecoderModel* model = chunks[k];
    STRATA_CHECK(model != nullptr, kBadArgument, "pipeline stage {}: no model for chunk {}", stage_, k);
    auto chunk = std::make_unique<Chunk>();
    chunk->model = model;
    chunk->virtual_stage = static_cast<int>(k) * spec.stages + stage_;
    const nn::DecoderModelOptions::Stage& part = model->stage();
    STRATA_CHECK(part.embedding == (chunk->virtual_stage == 0) && part.head == (chunk->virtual_stage == last),
                 kBadArgument,
                 "pipeline stage {}: the model of virtual stage {} {} the embedding and {} the head; virtual stage 0 "
                 "holds the embedding and {} the head",
                 stage_, chunk->virtual_stage, part.embedding ? "holds" : "lacks", part.head ? "holds" : "lacks", last);
    chunks_.push_back(std::move(chunk));
  }
  if (spec.local_handoff()) {
    keep_activations_ = activations == LayerActivations::kKeep;
    kept_ = std::make_unique<KeptBoundaries>(engine.accelerator(), static_cast<int>(chunks_.size()), home, nvme);
  }
  send_stream_ = engine.accelerator().create_stream();
  track_ = trace::make_track(fmt::format("pipeline stage {}", stage_));
  send_track_ = trace::make_track(fmt::format("pipeline stage {} send", stage_));
}

PipelineExecutor::~PipelineExecutor() {
  try {
    send_stream_->synchronize();
    engine_.compute_stream().synchronize();
  } catch (...) {
    // The step's error was reported by run(); the memory goes either way.
  }
  if (losses_ != nullptr) engine_.accelerator().deallocate_pinned(losses_);
}

template <typename Body>
void PipelineExecutor::timed(Stream& stream, uint32_t track, std::string name, int busy, Body&& body,
                             size_t action) {
  auto begin = std::make_shared<int64_t>(0);
  stream.launch_host_func([begin] { *begin = trace::now_ns(); });
  body();
  stream.launch_host_func([begin, track, name = std::move(name), busy, busy_ns = busy_ns_, last = last_end_ns_,
                           actions = action_ns_, action] {
    const int64_t end = trace::now_ns();
    if (busy >= 0) {
      (*busy_ns)[static_cast<size_t>(busy)] += end - *begin;
      (*actions)[action] = end - *begin;
    }
    int64_t seen = last->load();
    while (end > seen && !last->compare_exchange_weak(seen, end)) {
    }
    if (trace::enabled()) trace::complete(track, "pp", name, *begin, end);
  });
}

PipelineExecutor::Slot& PipelineExecutor::slot_of(int chunk_index, int micro_batch, const MicroBatch& mb) {
  Chunk& chunk = *chunks_[static_cast<size_t>(chunk_index)];
  const auto found = chunk.slot_of.find(micro_batch);
  int index = 0;
  if (found != chunk.slot_of.end()) {
    index = found->second;
  } else {
    const auto free = std::find_if(chunk.slots.begin(), chunk.slots.end(), [](const Slot& s) { return s.micro_batch < 0; });
    if (free == chunk.slots.end()) {
      chunk.slots.emplace_back();
      index = static_cast<int>(chunk.slots.size()) - 1;
    } else {
      index = static_cast<int>(free - chunk.slots.begin());
    }
    Slot& slot = chunk.slots[static_cast<size_t>(index)];
    slot.micro_batch = micro_batch;
    chunk.slot_of[micro_batch] = index;
    // What the slot's last micro-batch sent from it has left before anything writes it.
    if (slot.sent) engine_.compute_stream().wait(*slot.sent);
  }
  chunk.model->boundary(index, mb.batch, mb.seq);  // the slot's arena, for these rows
  return chunk.slots[static_cast<size_t>(index)];
}

void PipelineExecutor::release(int chunk_index, int micro_batch) {
  Chunk& chunk = *chunks_[static_cast<size_t>(chunk_index)];
  const auto found = chunk.slot_of.find(micro_batch);
  if (found == chunk.slot_of.end()) return;
  chunk.slots[static_cast<size_t>(found->second)].micro_batch = -1;
  chunk.slot_of.erase(found);
}

partition::P2POp PipelineExecutor::transfer(const Action& a, const nn::DecoderModel::Boundary& boundary) const {
  const int p = schedule_.spec.stages;
  const bool activation = a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kRecvActivation;
  const int mine = a.chunk * p + stage_;
  // Both sides name the receiver's virtual stage.
  const int receiver = a.sends() ? (activation ? mine + 1 : mine - 1) : mine;
  const uint64_t tag = static_cast<uint64_t>(activation ? Carries::kActivation : Carries::kGradient) << 56 |
                       static_cast<uint64_t>(receiver) << 32 | static_cast<uint32_t>(a.micro_batch);
  const std::string what = fmt::format("{} of micro-batch {} for {}stage {}", activation ? "activation" : "gradient",
                                       a.micro_batch, schedule_.spec.virtual_stages > 1 ? "virtual " : "", receiver);
  const TensorView& view = activation ? (a.sends() ? boundary.output : boundary.input)
                                      : (a.sends() ? boundary.input_grad : boundary.output_grad);
  if (a.sends()) return partition::P2POp::send(a.peer, view.data, view.desc.dtype, view.desc.shape, tag, what);
  return partition::P2POp::recv(a.peer, view.data, view.desc.dtype, view.desc.shape, tag, what);
}

void PipelineExecutor::receive(std::span<const Action> actions, const std::function<MicroBatch(int)>& micro_batch) {
  std::vector<partition::P2POp> ops;
  std::string name = "recv";
  for (const Action& a : actions) {
    const MicroBatch mb = micro_batch(a.micro_batch);
    slot_of(a.chunk, a.micro_batch, mb);
    const int index = chunks_[static_cast<size_t>(a.chunk)]->slot_of.at(a.micro_batch);
    ops.push_back(transfer(a, chunks_[static_cast<size_t>(a.chunk)]->model->boundary(index, 0, 0)));
    name += " " + a.describe();
  }
  timed(engine_.compute_stream(), track_, std::move(name), -1, [&] { pp_->exchange(ops, engine_.compute_stream()); });
}

void PipelineExecutor::send(const Action& a) {
  Chunk& chunk = *chunks_[static_cast<size_t>(a.chunk)];
  const int index = chunk.slot_of.at(a.micro_batch);
  Slot& slot = chunk.slots[static_cast<size_t>(index)];
  const nn::DecoderModel::Boundary boundary = chunk.model->boundary(index, 0, 0);
  // After the compute that wrote it; the compute stream goes on.
  auto written = engine_.accelerator().create_event();
  engine_.compute_stream().record(*written);
  send_stream_->wait(*written);
  const partition::P2POp op = transfer(a, boundary);
  timed(*send_stream_, send_track_, a.describe(), -1,
        [&] { slot.sent = pp_->exchange(std::span<const partition::P2POp>(&op, 1), *send_stream_); });
}

// Layer-major's boundaries (docs/DESIGN.md §5.5): what a micro-batch carries
// from one chunk to the next, kept per micro-batch so that each chunk computes
// in ONE slot of its model (its activation arena reused by every micro-batch)
// instead of holding m: forward copies chunk k's output to the input of chunk
// k + 1; backward runs chunk k's forward again from its kept input when the
// slot holds another micro-batch (the recompute of activation checkpointing:
// the same kernels on the same input, so the same bits), then its backward,
// the gradient flowing down handed over through one buffer per micro-batch
// (chunk k + 1's backwards of the step all run before chunk k's). The head
// chunk is never recomputed (its forward adds the loss's gradient): the
// schedule runs its backward right after its forward.
void PipelineExecutor::hand_over(int chunk, int micro_batch, int slot, bool gradient, bool into_slot) {
  const int chunks = static_cast<int>(chunks_.size());
  // The input comes from the chunk below and the output's gradient from the one above.
  const bool from_above = gradient == into_slot;  // the output's gradient in, or the output out
  if (from_above ? chunk + 1 >= chunks : chunk == 0) return;
  const nn::DecoderModel::Boundary mine = chunks_[static_cast<size_t>(chunk)]->model->boundary(slot, 0, 0);
  const TensorView& view = gradient ? (into_slot ? mine.output_grad : mine.input_grad)
                                    : (into_slot ? mine.input : mine.output);
  const BoundaryKey key{into_slot ? chunk : chunk + 1, micro_batch, gradient};
  if (into_slot) {
    kept_->restore(key, view.data, view.nbytes(), engine_.compute_stream());
  } else {
    kept_->keep(key, view.data, view.nbytes(), engine_.compute_stream());
  }
}

void PipelineExecutor::prefetch_boundaries(const std::vector<Action>& list, size_t position, bool training) {
  if (kept_->home() != BoundaryHome::kNvme) return;
  // The restores of the compute actions after `position`, as compute() will
  // make them (the slots' residents followed), up to one per micro-batch
  // and one more: the rest of the chunk in hand and the start of the next.
  const int micro_batches = schedule_.spec.micro_batches;
  const int chunks = static_cast<int>(chunks_.size());
  std::vector<int> resident = resident_;
  std::vector<KeptBoundaries::Upcoming> upcoming;
  std::vector<BoundaryKey> kept;  // kept by an action of the window, before any restore of it
  for (size_t i = position + 1; i < list.size() && static_cast<int>(upcoming.size()) <= micro_batches; ++i) {
    const Action& a = list[i];
    if (!a.compute()) continue;
    const int mb = training ? a.micro_batch : 0;
    const auto restores = [&](const BoundaryKey& key) {
      const bool read = std::find(kept.begin(), kept.end(), key) == kept.end();
      upcoming.push_back({key, read});
    };
    if (a.kind == ActionKind::kForward) {
      if (a.chunk > 0) restores({a.chunk, mb, false});
      if (a.chunk + 1 < chunks) kept.push_back({a.chunk + 1, mb, false});
      resident[static_cast<size_t>(a.chunk)] = a.micro_batch;
    } else if (a.kind == ActionKind::kBackward) {
      if (!keep_activations_ && resident[static_cast<size_t>(a.chunk)] != a.micro_batch) {
        restores({a.chunk, mb, false});
      }
      resident[static_cast<size_t>(a.chunk)] = -1;
    }
  }
  kept_->prefetch(upcoming);
}

void PipelineExecutor::compute(const Action& a, const std::function<MicroBatch(int)>& micro_batch,
                               const nn::ForwardOptions& options, size_t position) {
  Chunk& chunk = *chunks_[static_cast<size_t>(a.chunk)];
  nn::DecoderModel& model = *chunk.model;
  const MicroBatch mb = micro_batch(a.micro_batch);
  Slot& slot = slot_of(a.chunk, a.micro_batch, mb);
  const int index = chunk.slot_of.at(a.micro_batch);
  const int kind = a.kind == ActionKind::kForward ? 0 : a.kind == ActionKind::kBackward ? 1 : 2;
  timed(engine_.compute_stream(), track_, a.describe(), kind, [&] {
    nn::ForwardOptions forward = options;
    forward.slot = index;
    forward.positions = mb.positions;
    forward.dropout_seed = mb.dropout_seed;  // a recompute drops what its forward dropped
    // An evaluation takes each micro-batch through every chunk in turn: one set of boundaries serves them all.
    const int kept = options.backward ? a.micro_batch : 0;
    switch (a.kind) {
      case ActionKind::kForward: {
        if (kept_) hand_over(a.chunk, kept, index, false, true);
        model.forward(mb.ids, mb.targets, mb.batch, mb.seq, forward);
        if (model.stage().head) model.loss_stats_async(index, losses_ + 2 * static_cast<size_t>(a.micro_batch));
        if (kept_) {
          hand_over(a.chunk, kept, index, false, false);
          resident_[static_cast<size_t>(a.chunk)] = a.micro_batch;
        }
        break;
      }
      case ActionKind::kBackward:
        if (kept_) {
          int& resident = resident_[static_cast<size_t>(a.chunk)];
          // kKeep: the slot has held this micro-batch's activations since its forward.
          if (!keep_activations_ && resident != a.micro_batch) {
            STRATA_CHECK(!model.stage().head, kInternal,
                         "{}: the head chunk's slot holds micro-batch {}, and its forward cannot run again (it adds "
                         "the loss's gradient)",
                         a.describe(), resident);
            hand_over(a.chunk, kept, index, false, true);  // the kept input back into the slot
            model.forward(mb.ids, mb.targets, mb.batch, mb.seq, forward);
            ++recomputed_forwards_;
            resident = a.micro_batch;
          }
          hand_over(a.chunk, kept, index, true, true);  // the gradient from the chunk above
        }
        if (schedule_.spec.split_backward()) {
          if (!slot.deferred) slot.deferred = std::make_unique<DeferredWeightGrads>(engine_);
          // The slot is held until W: its saved activations are read there in place.
          slot.deferred->keep(model.kept_activations(index));
          engine_.set_weight_grad_sink(slot.deferred.get());
          try {
            model.backward(index);
          } catch (...) {
            engine_.set_weight_grad_sink(nullptr);
            throw;
          }
          engine_.set_weight_grad_sink(nullptr);
        } else {
          model.backward(index);
        }
        if (kept_) {
          hand_over(a.chunk, kept, index, true, false);  // the gradient for the chunk below
          resident_[static_cast<size_t>(a.chunk)] = -1;
        }
        break;
      case ActionKind::kWeight:
        if (slot.deferred) slot.deferred->run();
        break;
      default: raise(ErrorCategory::kInternal, "{} is not a compute action", a.describe());
    }
  }, position);
}

void PipelineExecutor::run_list(const std::vector<Action>& list, const std::function<MicroBatch(int)>& micro_batch,
                                const nn::ForwardOptions& options) {
  for (auto& chunk : chunks_) chunk->last_use.clear();
  for (size_t i = 0; i < list.size(); ++i) {
    chunks_[static_cast<size_t>(list[i].chunk)]->last_use[list[i].micro_batch] = i;
  }
  if (kept_) resident_.assign(chunks_.size(), -1);
  action_ns_->assign(list.size(), 0);
  for (size_t i = 0; i < list.size();) {
    const Action& a = list[i];
    size_t next = i + 1;
    if (a.compute()) {
      if (kept_) prefetch_boundaries(list, i, options.backward);
      compute(a, micro_batch, options, i);
      // The host waits for each compute action before it enqueues the next,
      // as the step-major loop waits for each micro-batch's loss: what an
      // action frees stream-ordered (its weight gradients once reduced,
      // zb-h1's deferred copies, gathered parameters) is held by the
      // allocator until the stream passes it, so a host running a step
      // ahead held every micro-batch's at once -- 1.16-1.51x the device
      // memory the schedule needs (strata plan --check, docs/DESIGN.md §5.4).
      engine_.compute_stream().synchronize();
    } else if (a.sends()) {
      send(a);
    } else {
      while (next < list.size() && !list[next].compute() && !list[next].sends()) ++next;
      receive(std::span<const Action>(list).subspan(i, next - i), micro_batch);
    }
    for (size_t j = i; j < next; ++j) {
      // Boundaries handed over in memory are kept aside: each chunk computes in one slot
      // (kRecompute), or holds each micro-batch's until its last use as a pipeline does (kKeep).
      const int c = list[j].chunk;
      if ((kept_ && !keep_activations_) || chunks_[static_cast<size_t>(c)]->last_use.at(list[j].micro_batch) == j) {
        release(c, list[j].micro_batch);
      }
    }
    i = next;
  }
  send_stream_->synchronize();
  engine_.compute_stream().synchronize();
}

std::pair<double, double> PipelineExecutor::pipeline_loss(int micro_batches) {
  double loss[2] = {0, 0};
  for (int i = 0; i < micro_batches; ++i) {
    loss[0] += losses_[2 * i];
    loss[1] += losses_[2 * i + 1];
  }
  // Every stage reports the last stage's loss.
  if (pp_ != nullptr) {
    pp_->allreduce(loss, loss, 2, DType::kF64, partition::ReduceOp::kSum, engine_.compute_stream())->synchronize();
  }
  return {loss[0], loss[1]};
}

void PipelineExecutor::reserve_losses(int micro_batches) {
  if (losses_capacity_ < static_cast<size_t>(micro_batches)) {
    if (losses_ != nullptr) engine_.accelerator().deallocate_pinned(losses_);
    losses_ = static_cast<double*>(
        engine_.accelerator().allocate_pinned(2 * static_cast<size_t>(micro_batches) * sizeof(double)));
    losses_capacity_ = static_cast<size_t>(micro_batches);
  }
  std::fill(losses_, losses_ + 2 * micro_batches, 0.0);
}

StepStats PipelineExecutor::run(const std::function<MicroBatch(int)>& micro_batch, const nn::ForwardOptions& options) {
  STRATA_CHECK(options.backward, kBadArgument, "PipelineExecutor::run is a training step; evaluate() runs forward only");
  const int64_t start_ns = trace::now_ns();
  for (auto& ns : *busy_ns_) ns.store(0);
  last_end_ns_->store(start_ns);
  reserve_losses(schedule_.spec.micro_batches);
  const auto deferred_inputs = [&] {
    std::pair<int64_t, int64_t> n{0, 0};
    for (const auto& chunk : chunks_) {
      for (const Slot& slot : chunk->slots) {
        if (!slot.deferred) continue;
        n.first += slot.deferred->inputs_in_place();
        n.second += slot.deferred->inputs_copied();
      }
    }
    return n;
  };
  const auto inputs_before = deferred_inputs();
  recomputed_forwards_ = 0;
  run_list(schedule_.ranks[static_cast<size_t>(stage_)], micro_batch, options);
  StepStats stats;
  stats.recomputed_forwards = recomputed_forwards_;
  stats.forward_seconds = static_cast<double>((*busy_ns_)[0].load()) * 1e-9;
  stats.backward_seconds = static_cast<double>((*busy_ns_)[1].load()) * 1e-9;
  stats.weight_seconds = static_cast<double>((*busy_ns_)[2].load()) * 1e-9;
  stats.busy_seconds = stats.forward_seconds + stats.backward_seconds + stats.weight_seconds;
  for (int64_t ns : *action_ns_) stats.action_seconds.push_back(static_cast<double>(ns) * 1e-9);
  stats.step_seconds = static_cast<double>(last_end_ns_->load() - start_ns) * 1e-9;
  const auto inputs_after = deferred_inputs();
  stats.weight_inputs_in_place = inputs_after.first - inputs_before.first;
  stats.weight_inputs_copied = inputs_after.second - inputs_before.second;
  std::tie(stats.loss_sum, stats.loss_count) = pipeline_loss(schedule_.spec.micro_batches);
  // A tied embedding's two halves of the gradient are summed.
  engine_.sum_stage_gradients();
  for (const auto& chunk : chunks_) {
    stats.slots.push_back(static_cast<int>(chunk->slots.size()));
    stats.activation_nbytes += chunk->model->arena_nbytes();
  }
  if (kept_) {
    stats.boundary_nbytes = kept_->memory_nbytes();
    stats.boundaries_pinned = kept_->home() != BoundaryHome::kDevice;
  }
  if (!stats.boundaries_pinned) stats.activation_nbytes += stats.boundary_nbytes;
  return stats;
}

std::pair<double, double> PipelineExecutor::evaluate(const std::function<MicroBatch(int)>& micro_batch, int count) {
  if (count <= 0) return pipeline_loss(0);
  // Forward only: each micro-batch through every virtual stage in turn.
  std::vector<Action> list;
  const int p = schedule_.spec.stages, v = schedule_.spec.virtual_stages, last = p * v - 1;
  for (int i = 0; i < count; ++i) {
    for (int k = 0; k < v; ++k) {
      const int s = k * p + stage_;
      const bool sent = !schedule_.spec.local_handoff();  // else handed over in memory
      if (sent && s > 0) list.push_back({ActionKind::kRecvActivation, i, k, (s - 1) % p});
      list.push_back({ActionKind::kForward, i, k, -1});
      if (sent && s < last) list.push_back({ActionKind::kSendActivation, i, k, (s + 1) % p});
    }
  }
  reserve_losses(count);
  nn::ForwardOptions options;
  options.backward = false;
  run_list(list, micro_batch, options);
  return pipeline_loss(count);
}

std::vector<std::unique_ptr<nn::DecoderModel>> make_stage_models(engine::Engine& engine, const nn::DecoderConfig& config,
                                                                 const nn::DecoderModelOptions& options,
                                                                 const ScheduleSpec& spec, partition::Communicator& pp,
                                                                 std::span<const int64_t> layers) {
  spec.check();
  STRATA_CHECK(pp.world_size() == spec.stages, kBadArgument,
               "pipeline of {} stages, but the pipeline group has {} ranks", spec.stages, pp.world_size());
  const std::vector<int64_t> split = split_layers(config.num_hidden_layers, spec.stages, spec.virtual_stages, layers);
  std::vector<std::unique_ptr<nn::DecoderModel>> models;
  for (int k = 0; k < spec.virtual_stages; ++k) {
    const StagePart part = stage_part(split, spec.stages, pp.rank(), k);
    nn::DecoderModelOptions o = options;
    o.stage = {part.first_layer, part.layers, part.embedding, part.head};
    models.push_back(std::make_unique<nn::DecoderModel>(engine, config, o));
    // The first and the last stage both hold a tied embedding: one sums the other's gradient.
    const nn::DecoderModel& model = *models.back();
    if (config.tie_word_embeddings && spec.stages > 1 && model.embedding_weight() >= 0) {
      engine.share_with_stage(model.embedding_weight(), pp, part.embedding ? spec.stages - 1 : 0);
    }
  }
  return models;
}

std::vector<std::unique_ptr<nn::DecoderModel>> make_layer_models(engine::Engine& engine, const nn::DecoderConfig& config,
                                                                 const nn::DecoderModelOptions& options) {
  STRATA_CHECK(!config.tie_word_embeddings, kBadArgument,
               "micro_batch_order layer-major with tie_word_embeddings true: not implemented yet (the embedding's "
               "lookup and lm_head halves of the gradient would add in another order than step-major's); use "
               "step-major");
  const int64_t layers = config.num_hidden_layers;
  std::vector<std::unique_ptr<nn::DecoderModel>> models;
  const auto add = [&](int64_t first_layer, int64_t count, bool embedding, bool head) {
    nn::DecoderModelOptions o = options;
    o.stage = {first_layer, count, embedding, head};
    models.push_back(std::make_unique<nn::DecoderModel>(engine, config, o));
  };
  // The embedding and the head are chunks of their own: a layer's next use
  // (the next micro-batch's) is then one layer's parameters away, never one
  // layer plus the embedding or lm_head.
  add(0, 0, true, false);
  for (int64_t l = 0; l < layers; ++l) add(l, 1, false, false);
  add(layers, 0, false, true);
  return models;
}

}  // namespace strata::pipeline
