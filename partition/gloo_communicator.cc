// The Gloo (TCP) communicator for the cpu accelerator: each collective runs on
// the stream's host thread with Gloo's blocking algorithms; reduce-scatter is
// our own ring over Gloo's unbound buffers (this Gloo has no options-style one),
// and all_to_all our own pairwise exchange over them (Gloo's alltoallv places
// the blocks at the prefix sums of the counts, so it cannot take displacements),
// as are the point-to-point exchanges of pipeline parallelism.
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "partition/communicator.h"
#include "partition/communicator_support.h"
#include "core/error.h"
#include "core/log.h"
#include "core/trace_recorder.h"

namespace strata::partition {
namespace {
using Clock = std::chrono::steady_clock;
using ReduceFn = void (*)(void* out, const void* a, const void* b, size_t numel);

// Slots of our reduce-scatter ring and all_to_all; Gloo's own algorithms use prefixes 0x01-0x08.
constexpr uint64_t kReduceScatterSlotPrefix = uint64_t{0x7e} << 56;
constexpr uint64_t kAllToAllSlotPrefix = uint64_t{0x7d} << 56;
constexpr uint64_t kAllToAllCountsSlotPrefix = uint64_t{0x7c} << 56;
// Point-to-point: the n-th transfer from one rank to another (per ordered pair)
// uses slot prefix | n for its sender's description, its receiver's, and its data.
constexpr uint64_t kSenderSlotPrefix = uint64_t{0x7b} << 56;
constexpr uint64_t kReceiverSlotPrefix = uint64_t{0x7a} << 56;
constexpr uint64_t kDataSlotPrefix = uint64_t{0x79} << 56;
constexpr uint64_t kSequenceMask = (uint64_t{1} << 56) - 1;
constexpr size_t kMaxP2PDims = 8;

// What one side of a point-to-point transfer says it sends or expects, sent to
// the other side before the data (GlooCommunicator::point_to_point).
struct P2PHeader {
  uint64_t tag = 0;
  uint32_t dtype = 0;
  uint32_t ndims = 0;
  int64_t dims[kMaxP2PDims] = {};
  char what[96] = {};

  static P2PHeader of(const P2POp& op) {
    P2PHeader h;
    h.tag = op.tag;
    h.dtype = static_cast<uint32_t>(op.dtype);
    h.ndims = static_cast<uint32_t>(op.shape.size());
    std::copy(op.shape.begin(), op.shape.end(), h.dims);
    std::memcpy(h.what, op.what.data(), std::min(op.what.size(), sizeof(h.what) - 1));
    return h;
  }
  bool agrees(const P2PHeader& o) const {
    return tag == o.tag && dtype == o.dtype && ndims == o.ndims && std::equal(dims, dims + ndims, o.dims);
  }
  std::string describe() const {
    const auto type = static_cast<DType>(dtype);
    const bool known = type == DType::kF32 || type == DType::kF16 || type == DType::kBF16 || type == DType::kI32 ||
                       type == DType::kF64 || type == DType::kF8E4M3 || type == DType::kU8;
    Shape shape(dims, dims + std::min<size_t>(ndims, kMaxP2PDims));
    std::string text(what, strnlen(what, sizeof(what)));
    if (!known) return fmt::format("elements of unknown dtype {} (tag {:#x}): {}", dtype, tag, text);
    return detail::describe_p2p(type, shape, tag, text);
  }
};

// What one side of a pair of ranks expects of an all_to_all, sent to the other
// before the blocks (GlooCommunicator::agree_counts).
struct PairCounts {
  uint64_t to_peer = 0;    // elements this rank sends the peer
  uint64_t from_peer = 0;  // elements it expects from the peer
  uint64_t element_nbytes = 0;
};

template <typename T, float (*ToFloat)(T), T (*FromFloat)(float)>
void sum_converted(void* out, const void* a, const void* b, size_t numel) {
  auto* o = static_cast<T*>(out);
  auto* x = static_cast<const T*>(a);
  auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < numel; ++i) o[i] = FromFloat(ToFloat(x[i]) + ToFloat(y[i]));
}

template <typename T>
void sum_same(void* out, const void* a, const void* b, size_t numel) {
  auto* o = static_cast<T*>(out);
  auto* x = static_cast<const T*>(a);
  auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < numel; ++i) o[i] = x[i] + y[i];
}

ReduceFn sum_fn(DType dtype) {
  switch (dtype) {
    case DType::kF32: return sum_same<float>;
    case DType::kF16: return sum_converted<Half, half_to_float, float_to_half>;
    case DType::kBF16: return sum_converted<BFloat16, bf16_to_float, float_to_bf16>;
    case DType::kI32: return sum_same<int32_t>;
    case DType::kF64: return sum_same<double>;
    case DType::kF8E4M3:
    case DType::kU8: break;  // checkpoint bytes: moved, never summed
  }
  raise(ErrorCategory::kBadArgument, "gloo: a reduction of {} elements (checkpoint bytes only move)",
        dtype_name(dtype));
}

// Divides (not multiplies by the reciprocal) so an average rounds like sum / n.
// An int32 average truncates toward zero.
void divide(void* data, size_t numel, DType dtype, float divisor) {
  STRATA_CHECK(is_float_storage(dtype) || dtype == DType::kF64 || dtype == DType::kI32, kBadArgument,
               "gloo: an average of {} elements (checkpoint bytes only move)", dtype_name(dtype));
  if (dtype == DType::kF64) {
    auto* p = static_cast<double*>(data);
    for (size_t i = 0; i < numel; ++i) p[i] /= static_cast<double>(divisor);
  } else if (dtype == DType::kI32) {
    auto* p = static_cast<int32_t*>(data);
    for (size_t i = 0; i < numel; ++i) p[i] = static_cast<int32_t>(p[i] / static_cast<int64_t>(divisor));
  } else if (dtype == DType::kF32) {
    auto* p = static_cast<float*>(data);
    for (size_t i = 0; i < numel; ++i) p[i] /= divisor;
  } else if (dtype == DType::kF16) {
    auto* p = static_cast<Half*>(data);
    for (size_t i = 0; i < numel; ++i) p[i] = float_to_half(half_to_float(p[i]) / divisor);
  } else {
    auto* p = static_cast<BFloat16*>(data);
    for (size_t i = 0; i < numel; ++i) p[i] = float_to_bf16(bf16_to_float(p[i]) / divisor);
  }
}

// Gloo's templated setters want a typed pointer; every collective here moves
// raw elements of dtype_nbytes, so 2-, 4- and 8-byte integer stand-ins suffice.
template <typename Fn>
void with_element_type(DType dtype, Fn&& fn) {
  switch (dtype_nbytes(dtype)) {
    case 8: fn(uint64_t{}); break;
    case 4: fn(uint32_t{}); break;
    case 1: fn(uint8_t{}); break;
    default: fn(uint16_t{}); break;
  }
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(Accelerator& accelerator, StoreClient& store, const CommunicatorOptions& options)
      : accelerator_(accelerator), store_(store), options_(options) {
    STRATA_CHECK(accelerator.host_addressable(), kBadArgument,
                 "the Gloo communicator needs host memory (cpu accelerator), got {}", accelerator.name());
    detail::check_options(options);
    sent_to_.assign(static_cast<size_t>(options.world_size), 0);
    received_from_.assign(static_cast<size_t>(options.world_size), 0);
    // A peer that dies leaves a socket that raises SIGPIPE on our next write; the
    // error must come back as an exception naming the rank, not kill this process.
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) std::signal(SIGPIPE, SIG_IGN);

    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname.empty() ? default_hostname(store.address()) : options.hostname;
    attr.ai_family = AF_INET;
    try {
      device_ = gloo::transport::tcp::CreateDevice(attr);
      context_ = std::make_shared<gloo::rendezvous::Context>(options.rank, options.world_size);
      context_->setTimeout(options.timeout);
      gloo::rendezvous::PrefixStore prefixed(options.prefix, store);
      context_->connectFullMesh(prefixed, device_);
    } catch (const Error& e) {
      raise(ErrorCategory::kCommunication, "{}: Gloo connection through the rendezvous store failed: {}",
            detail::describe_rank(options), e.message());
    } catch (const std::exception& e) {
      raise(ErrorCategory::kCommunication, "{}: Gloo connection failed ({}); {}", detail::describe_rank(options),
            e.what(), describe_dead_ranks(store));
    }
  }

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  std::string_view backend() const override { return "gloo"; }

  std::unique_ptr<Event> allgather(const void* send, void* recv, size_t numel, DType dtype,
                                   Stream& stream) override {
    return submit("allgather", numel, dtype, numel * world_size() * dtype_nbytes(dtype), stream,
                  [=, this](uint32_t tag) {
      size_t nbytes = numel * dtype_nbytes(dtype);
      if (world_size() == 1 || numel == 0) {
        if (nbytes > 0 && send != recv) std::memmove(recv, send, nbytes);
        return;
      }
      with_element_type(dtype, [&](auto element) {
        using T = decltype(element);
        gloo::AllgatherOptions opts(context_);
        opts.setInput(static_cast<T*>(const_cast<void*>(send)), numel);
        opts.setOutput(static_cast<T*>(recv), numel * world_size());
        opts.setTag(tag);
        opts.setTimeout(options_.timeout);
        gloo::allgather(opts);
      });
    });
  }

  std::unique_ptr<Event> reduce_scatter(const void* send, void* recv, size_t numel, DType dtype, ReduceOp op,
                                        Stream& stream) override {
    return submit("reduce_scatter", numel, dtype, numel * world_size() * dtype_nbytes(dtype), stream,
                  [=, this](uint32_t tag) {
      ring_reduce_scatter(send, recv, numel, dtype, tag);
      if (op == ReduceOp::kAverage) divide(recv, numel, dtype, static_cast<float>(world_size()));
    });
  }

  std::unique_ptr<Event> allreduce(const void* send, void* recv, size_t numel, DType dtype, ReduceOp op,
                                   Stream& stream) override {
    return submit("allreduce", numel, dtype, numel * dtype_nbytes(dtype), stream, [=, this](uint32_t tag) {
      size_t nbytes = numel * dtype_nbytes(dtype);
      if (nbytes > 0 && send != recv) std::memmove(recv, send, nbytes);
      if (world_size() > 1 && numel > 0) {
        with_element_type(dtype, [&](auto element) {
          using T = decltype(element);
          gloo::AllreduceOptions opts(context_);
          opts.setOutput(static_cast<T*>(recv), numel);
          opts.setReduceFunction(sum_fn(dtype));
          opts.setTag(tag);
          opts.setTimeout(options_.timeout);
          gloo::allreduce(opts);
        });
      }
      if (op == ReduceOp::kAverage) divide(recv, numel, dtype, static_cast<float>(world_size()));
    });
  }

  std::unique_ptr<Event> broadcast(void* data, size_t numel, DType dtype, int root, Stream& stream) override {
    STRATA_CHECK(root >= 0 && root < world_size(), kBadArgument, "broadcast root {} outside world size {}", root,
                 world_size());
    return submit("broadcast", numel, dtype, numel * dtype_nbytes(dtype), stream, [=, this](uint32_t tag) {
      if (world_size() == 1 || numel == 0) return;
      with_element_type(dtype, [&](auto element) {
        using T = decltype(element);
        gloo::BroadcastOptions opts(context_);
        opts.setOutput(static_cast<T*>(data), numel);
        opts.setRoot(root);
        opts.setTag(tag);
        opts.setTimeout(options_.timeout);
        gloo::broadcast(opts);
      });
    });
  }

  std::unique_ptr<Event> barrier(Stream& stream) override {
    return submit("barrier", 0, DType::kF32, 0, stream, [this](uint32_t tag) {
      if (world_size() == 1) return;
      gloo::BarrierOptions opts(context_);
      opts.setTag(tag);
      opts.setTimeout(options_.timeout);
      gloo::barrier(opts);
    });
  }

  std::unique_ptr<Event> all_to_all(const void* send, void* recv, const AllToAllSplits& splits, DType dtype,
                                    Stream& stream) override {
    detail::check_all_to_all(options_, send, recv, splits, dtype);
    const size_t sent = splits.send_total();
    return submit("all_to_all", sent, dtype, sent * dtype_nbytes(dtype), stream,
                  [=, this](uint32_t tag) { exchange(send, recv, splits, dtype, tag); });
  }

  std::unique_ptr<Event> exchange(std::span<const P2POp> ops, Stream& stream) override {
    detail::check_exchange(options_, ops);
    for (const P2POp& op : ops) {
      STRATA_CHECK(op.shape.size() <= kMaxP2PDims, kBadArgument, "exchange on {}: {} has more than {} dimensions",
                   detail::describe_rank(options_), detail::describe_p2p(op.dtype, op.shape, op.tag, op.what),
                   kMaxP2PDims);
    }
    std::vector<Transfer> transfers;
    size_t nbytes = 0;
    for (const P2POp& op : ops) {
      // Sequence numbers pair the sides: assigned here, in submission order.
      const auto peer = static_cast<size_t>(op.peer);
      const uint64_t sequence = op.kind == P2POp::Kind::kSend ? sent_to_[peer]++ : received_from_[peer]++;
      transfers.push_back(Transfer{op, sequence & kSequenceMask});
      if (op.kind == P2POp::Kind::kSend) nbytes += op.numel() * dtype_nbytes(op.dtype);
    }
    const uint32_t number = next_exchange_++;
    stream.launch_host_func([this, transfers = std::move(transfers), number, nbytes] {
      trace::Span span("comm", "exchange");
      if (span.recording()) {
        name_thread_for_trace();
        span.bytes(nbytes).detail("comm", options_.prefix).value("exchange", number);
      }
      const auto start = Clock::now();
      try {
        point_to_point(transfers);
      } catch (const Error&) {
        throw;
      } catch (const std::exception& e) {
        fail_exchange(number, transfers, start, e.what());
      }
    });
    auto event = accelerator_.create_event();
    stream.record(*event);
    return event;
  }

 private:
  // The address this rank's Gloo device binds and advertises: the local
  // address of the route to the rendezvous store (the master), which every
  // peer reaches the master through too. Not gethostname(): Debian maps the
  // host name to 127.0.1.1, which no other node can reach.
  static std::string default_hostname(const std::string& store_address) {
    if (store_address.rfind("127.", 0) == 0 || store_address.rfind("localhost", 0) == 0) return "127.0.0.1";
    const size_t colon = store_address.rfind(':');
    const std::string host = store_address.substr(0, colon);
    const std::string port = colon == std::string::npos ? "9" : store_address.substr(colon + 1);
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_DGRAM;
    addrinfo* found = nullptr;
    if (getaddrinfo(host.c_str(), port.c_str(), &hints, &found) == 0 && found != nullptr) {
      std::string local;
      const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
      sockaddr_in self{};
      socklen_t self_len = sizeof(self);
      char text[INET_ADDRSTRLEN] = {};
      // A UDP connect only picks the route and source address; nothing is sent.
      if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
          ::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &self_len) == 0 &&
          inet_ntop(AF_INET, &self.sin_addr, text, sizeof(text)) != nullptr) {
        local = text;
      }
      if (fd >= 0) ::close(fd);
      freeaddrinfo(found);
      if (!local.empty()) return local;
    }
    char name[256] = {};
    if (gethostname(name, sizeof(name) - 1) != 0) return "127.0.0.1";
    return name;
  }

  // Ring reduce-scatter: in step s, rank r sends its partial sum of block
  // (r-1-s) to r+1 and adds its own contribution to the block (r-2-s) received
  // from r-1; after world_size-1 steps block r holds every rank's contribution.
  // Only one block of running sum and one incoming block are needed (reused
  // across calls, so a large collective does not page-fault fresh memory); the
  // first send comes straight from the input and the last sum goes straight to recv.
  void ring_reduce_scatter(const void* send, void* recv, size_t numel, DType dtype, uint32_t tag) {
    int world = world_size(), me = rank();
    size_t block_nbytes = numel * dtype_nbytes(dtype);
    if (world == 1 || numel == 0) {
      if (block_nbytes > 0 && send != recv) std::memmove(recv, send, block_nbytes);
      return;
    }
    std::lock_guard lock(scratch_mutex_);
    if (acc_.size() < block_nbytes) acc_.resize(block_nbytes);
    if (incoming_.size() < block_nbytes) incoming_.resize(block_nbytes);
    const char* input = static_cast<const char*>(send);
    // Gloo's buffers take void*; the input is only ever sent from.
    auto input_buffer = context_->createUnboundBuffer(const_cast<char*>(input), block_nbytes * world);
    auto acc_buffer = context_->createUnboundBuffer(acc_.data(), block_nbytes);
    auto incoming_buffer = context_->createUnboundBuffer(incoming_.data(), block_nbytes);
    ReduceFn sum = sum_fn(dtype);
    int right = (me + 1) % world, left = (me + world - 1) % world;
    for (int step = 0; step < world - 1; ++step) {
      size_t send_block = static_cast<size_t>(((me - 1 - step) % world + world) % world);
      size_t recv_block = static_cast<size_t>(((me - 2 - step) % world + world) % world);
      uint64_t slot = kReduceScatterSlotPrefix | (uint64_t{tag} << 16) | static_cast<uint64_t>(step);
      if (step == 0) {
        input_buffer->send(right, slot, send_block * block_nbytes, block_nbytes);
      } else {
        acc_buffer->send(right, slot, 0, block_nbytes);  // the sum made in the previous step
      }
      incoming_buffer->recv(left, slot, 0, block_nbytes);
      incoming_buffer->waitRecv(options_.timeout);
      (step == 0 ? input_buffer : acc_buffer)->waitSend(options_.timeout);
      // The last step's block is this rank's own (recv_block == me).
      void* target = step == world - 2 ? recv : static_cast<void*>(acc_.data());
      sum(target, input + recv_block * block_nbytes, incoming_.data(), numel);
    }
  }

  // First the counts are checked with every peer (agree_counts); then every
  // rank posts a receive from and a send to each peer it exchanges a non-empty
  // block with (both sides skip empty ones: the counts agree), and waits for all
  // of them; one timeout bounds it all. The own block is a copy.
  void exchange(const void* send, void* recv, const AllToAllSplits& splits, DType dtype, uint32_t tag) {
    const size_t element = dtype_nbytes(dtype);
    const int world = world_size(), me = rank();
    const auto deadline = Clock::now() + options_.timeout;
    auto remaining = [&] {
      return std::max(std::chrono::milliseconds(1),
                      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    };
    if (world > 1) agree_counts(splits, element, tag, remaining);
    const auto mine = static_cast<size_t>(me);
    const char* input = static_cast<const char*>(send);
    char* output = static_cast<char*>(recv);
    if (splits.send_counts[mine] > 0) {
      std::memcpy(output + splits.recv_displs[mine] * element, input + splits.send_displs[mine] * element,
                  splits.send_counts[mine] * element);
    }
    auto end_of = [&](const std::vector<size_t>& counts, const std::vector<size_t>& displs) {
      size_t end = 0;
      for (size_t p = 0; p < counts.size(); ++p) {
        if (p != mine && counts[p] > 0) end = std::max(end, displs[p] + counts[p]);
      }
      return end * element;
    };
    const size_t send_nbytes = end_of(splits.send_counts, splits.send_displs);
    const size_t recv_nbytes = end_of(splits.recv_counts, splits.recv_displs);
    // Gloo's buffers take void*; the input is only ever sent from.
    std::unique_ptr<gloo::transport::UnboundBuffer> input_buffer, output_buffer;
    if (send_nbytes > 0) input_buffer = context_->createUnboundBuffer(const_cast<char*>(input), send_nbytes);
    if (recv_nbytes > 0) output_buffer = context_->createUnboundBuffer(output, recv_nbytes);
    const uint64_t slot = kAllToAllSlotPrefix | uint64_t{tag};
    int sends = 0, recvs = 0;
    // Peers in the order me+1, me+2, ...: not every rank sending to rank 0 first.
    for (int step = 1; step < world; ++step) {
      const auto to = static_cast<size_t>((me + step) % world), from = static_cast<size_t>((me + world - step) % world);
      if (splits.recv_counts[from] > 0) {
        output_buffer->recv(static_cast<int>(from), slot, splits.recv_displs[from] * element,
                            splits.recv_counts[from] * element);
        ++recvs;
      }
      if (splits.send_counts[to] > 0) {
        input_buffer->send(static_cast<int>(to), slot, splits.send_displs[to] * element,
                           splits.send_counts[to] * element);
        ++sends;
      }
    }
    for (int i = 0; i < recvs; ++i) output_buffer->waitRecv(remaining());
    for (int i = 0; i < sends; ++i) input_buffer->waitSend(remaining());
  }

  // Gloo aborts the process when a message is longer than the receive posted
  // for it, and takes a shorter one silently; so before any block moves, each
  // pair of ranks swaps what it expects of the other (PairCounts) and a
  // disagreement fails the collective on both ranks of the pair, naming the
  // counts (their other peers then time out waiting for them).
  template <typename Remaining>
  void agree_counts(const AllToAllSplits& splits, size_t element, uint32_t tag, Remaining remaining) {
    const int world = world_size(), me = rank();
    std::vector<PairCounts> mine(static_cast<size_t>(world)), theirs(static_cast<size_t>(world));
    for (size_t p = 0; p < mine.size(); ++p) mine[p] = {splits.send_counts[p], splits.recv_counts[p], element};
    auto mine_buffer = context_->createUnboundBuffer(mine.data(), mine.size() * sizeof(PairCounts));
    auto theirs_buffer = context_->createUnboundBuffer(theirs.data(), theirs.size() * sizeof(PairCounts));
    const uint64_t slot = kAllToAllCountsSlotPrefix | uint64_t{tag};
    for (int step = 1; step < world; ++step) {
      const int to = (me + step) % world, from = (me + world - step) % world;
      theirs_buffer->recv(from, slot, static_cast<size_t>(from) * sizeof(PairCounts), sizeof(PairCounts));
      mine_buffer->send(to, slot, static_cast<size_t>(to) * sizeof(PairCounts), sizeof(PairCounts));
    }
    for (int i = 1; i < world; ++i) theirs_buffer->waitRecv(remaining());
    for (int i = 1; i < world; ++i) mine_buffer->waitSend(remaining());
    std::string disagreements;
    for (size_t p = 0; p < theirs.size(); ++p) {
      if (p == static_cast<size_t>(me)) continue;
      const PairCounts& peer = theirs[p];
      const int peer_rank = detail::job_rank(options_, static_cast<int>(p));
      if (peer.element_nbytes != element) {
        disagreements += fmt::format("; rank {} moves elements of {} bytes, this rank of {}", peer_rank,
                                     peer.element_nbytes, element);
      } else if (peer.to_peer != splits.recv_counts[p] || peer.from_peer != splits.send_counts[p]) {
        disagreements += fmt::format(
            "; rank {} sends {} elements to this rank, which expects {} (recv_counts[{}]), and expects {} from it, "
            "which sends {} (send_counts[{}])",
            peer_rank, peer.to_peer, splits.recv_counts[p], p, peer.from_peer, splits.send_counts[p], p);
      }
    }
    if (!disagreements.empty()) {
      throw std::runtime_error("the counts of the two sides must agree (exchange them first)" + disagreements);
    }
  }

  // One side of a point-to-point transfer and its number among the transfers
  // between this rank and its peer in its direction.
  struct Transfer {
    P2POp op;
    uint64_t sequence = 0;
    bool sends() const { return op.kind == P2POp::Kind::kSend; }
  };

  // Each transfer's two sides first swap their descriptions (P2PHeader): a
  // sender sends data only once its receiver's description agrees (Gloo
  // aborts the process on a message longer than the receive posted for it,
  // and takes a shorter one silently); a disagreement fails the exchange on
  // both sides, naming both. Receives are posted at once, with their
  // descriptions; the sends of one exchange then move in order, each once its
  // receiver has posted (its description arrived). One timeout bounds it all.
  void point_to_point(const std::vector<Transfer>& transfers) {
    const auto deadline = Clock::now() + options_.timeout;
    auto remaining = [&] {
      return std::max(std::chrono::milliseconds(1),
                      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
    };
    const size_t n = transfers.size();
    std::vector<P2PHeader> mine(n), theirs(n);
    using Buffer = std::unique_ptr<gloo::transport::UnboundBuffer>;
    std::vector<Buffer> mine_buffers(n), theirs_buffers(n), data(n);
    for (size_t i = 0; i < n; ++i) {
      const Transfer& t = transfers[i];
      mine[i] = P2PHeader::of(t.op);
      const uint64_t own = (t.sends() ? kSenderSlotPrefix : kReceiverSlotPrefix) | t.sequence;
      const uint64_t other = (t.sends() ? kReceiverSlotPrefix : kSenderSlotPrefix) | t.sequence;
      theirs_buffers[i] = context_->createUnboundBuffer(&theirs[i], sizeof(P2PHeader));
      mine_buffers[i] = context_->createUnboundBuffer(&mine[i], sizeof(P2PHeader));
      theirs_buffers[i]->recv(t.op.peer, other, 0, sizeof(P2PHeader));
      mine_buffers[i]->send(t.op.peer, own, 0, sizeof(P2PHeader));
      const size_t bytes = t.op.numel() * dtype_nbytes(t.op.dtype);
      if (bytes > 0) data[i] = context_->createUnboundBuffer(t.op.data, bytes);
      // A receive of the size this side expects: the sender sends only that size.
      if (!t.sends() && bytes > 0) data[i]->recv(t.op.peer, kDataSlotPrefix | t.sequence, 0, bytes);
    }
    for (size_t i = 0; i < n; ++i) {
      const Transfer& t = transfers[i];
      theirs_buffers[i]->waitRecv(remaining());
      if (!mine[i].agrees(theirs[i])) {
        // The peer has posted the receive of this side's description (it sent
        // its own with it): let it land before the buffers go.
        for (size_t j = 0; j <= i; ++j) {
          try {
            mine_buffers[j]->waitSend(remaining());
          } catch (const std::exception&) {
            // The disagreement below is what is reported.
          }
        }
        const std::string peer = detail::describe_peer(options_, t.op.peer);
        throw std::runtime_error(
            "the two sides of a transfer must agree; " +
            (t.sends() ? fmt::format("this rank sends {} to {}, which expects {}", mine[i].describe(), peer,
                                     theirs[i].describe())
                       : fmt::format("{} sends {} to this rank, which expects {}", peer, theirs[i].describe(),
                                     mine[i].describe())));
      }
      if (t.sends() && data[i] != nullptr) data[i]->send(t.op.peer, kDataSlotPrefix | t.sequence, 0, data[i]->size);
    }
    for (size_t i = 0; i < n; ++i) {
      mine_buffers[i]->waitSend(remaining());
      if (data[i] == nullptr) continue;
      if (transfers[i].sends()) {
        data[i]->waitSend(remaining());
      } else {
        data[i]->waitRecv(remaining());
      }
    }
  }

  [[noreturn]] void fail_exchange(uint32_t number, const std::vector<Transfer>& transfers, Clock::time_point start,
                                  const std::string& what) {
    const auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
    std::string list;
    for (const Transfer& t : transfers) {
      list += fmt::format("{}{} {} {} {}", list.empty() ? "" : ", ", t.sends() ? "send of" : "receive of",
                          detail::describe_p2p(t.op.dtype, t.op.shape, t.op.tag, t.op.what), t.sends() ? "to" : "from",
                          detail::describe_peer(options_, t.op.peer));
    }
    raise(ErrorCategory::kCommunication, "exchange #{} ({}) failed on {} after {} ms (timeout {} ms): {}; {}", number,
          list, detail::describe_rank(options_), elapsed, options_.timeout.count(), what, describe_dead_ranks(store_));
  }

  // `nbytes`: nccl-tests' size of the collective (allgather: the gathered
  // output, reduce-scatter: the input, allreduce/broadcast: the buffer,
  // all_to_all: what this rank sends), so the trace's GB/s is algbw.
  template <typename Body>
  std::unique_ptr<Event> submit(const char* name, size_t numel, DType dtype, size_t nbytes, Stream& stream,
                                Body body) {
    uint32_t tag = next_tag_++;
    stream.launch_host_func([this, name, numel, dtype, nbytes, tag, body] {
      // On the thread that runs it (the stream's): a span per collective.
      trace::Span span("comm", name);
      if (span.recording()) {
        name_thread_for_trace();
        span.bytes(nbytes).detail("comm", options_.prefix).value("tag", tag);
      }
      auto start = Clock::now();
      try {
        body(tag);
      } catch (const Error&) {
        throw;
      } catch (const std::exception& e) {
        fail(name, tag, numel, dtype, start, e.what());
      }
    });
    auto event = accelerator_.create_event();
    stream.record(*event);
    return event;
  }

  // The stream's thread gets a track named after the first communicator that
  // runs on it, unless the engine named it (the trace's "comm gather" track).
  void name_thread_for_trace() const {
    thread_local bool named = false;
    if (named) return;
    named = true;
    const size_t slash = options_.prefix.rfind('/');
    trace::name_this_thread("comm " + options_.prefix.substr(slash == std::string::npos ? 0 : slash + 1),
                            /*replace=*/false);
  }

  [[noreturn]] void fail(const char* name, uint32_t tag, size_t numel, DType dtype, Clock::time_point start,
                         const std::string& what) {
    auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
    // The rank next to a dead peer sees its socket close at once; give the store
    // a moment to notice the same closed connection before asking it.
    std::string dead = describe_dead_ranks(store_);
    for (int i = 0; i < 20 && dead.rfind("no rank", 0) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
      dead = describe_dead_ranks(store_);
    }
    raise(ErrorCategory::kCommunication, "{} #{} ({} x {}) failed on {} after {} ms (timeout {} ms): {}; {}{}", name,
          tag, numel, dtype_name(dtype), detail::describe_rank(options_), elapsed, options_.timeout.count(), what,
          dead, silent_ranks(tag));
  }

  // A hung (not dead) peer keeps its sockets open, so only the timeout fires.
  // Every failing rank reports the failed operation to the store; the ranks
  // that stay silent for a moment are the likely culprits (hung, or dead),
  // named by their job ranks.
  std::string silent_ranks(uint32_t tag) {
    try {
      std::string base = fmt::format("{}/failed/{}/", options_.prefix, tag);
      store_.set(base + std::to_string(rank()), {'1'});
      auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(options_.timeout, std::chrono::seconds(1));
      std::vector<int> silent;
      for (;;) {
        silent.clear();
        std::vector<char> ignored;
        for (int r = 0; r < world_size(); ++r) {
          if (!store_.try_get(base + std::to_string(r), ignored)) silent.push_back(r);
        }
        if (silent.empty() || Clock::now() >= deadline) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      if (silent.empty()) return "";
      std::string list;
      for (int r : silent) list += (list.empty() ? "" : ", ") + std::to_string(detail::job_rank(options_, r));
      return fmt::format("; rank{} {} did not report this failure (dead, hung or slow)", silent.size() > 1 ? "s" : "",
                         list);
    } catch (const std::exception&) {
      return "";  // the store is gone; describe_dead_ranks already said so
    }
  }

  Accelerator& accelerator_;
  StoreClient& store_;
  CommunicatorOptions options_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  uint32_t next_tag_ = 1;
  // Point-to-point: exchanges submitted (for errors), and transfers to and from
  // each peer so far (what pairs the sides; exchange()).
  uint32_t next_exchange_ = 1;
  std::vector<uint64_t> sent_to_, received_from_;
  std::mutex scratch_mutex_;           // guards acc_, incoming_
  std::vector<char> acc_, incoming_;   // reduce-scatter scratch, one block each
};
}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(Accelerator& accelerator, StoreClient& store,
                                                     const CommunicatorOptions& options) {
  return std::make_unique<GlooCommunicator>(accelerator, store, options);
}

std::unique_ptr<Communicator> make_communicator(Accelerator& accelerator, StoreClient& store,
                                                const CommunicatorOptions& options) {
  if (accelerator.backend() == Backend::kCuda) return make_nccl_communicator(accelerator, store, options);
  return make_gloo_communicator(accelerator, store, options);
}

}  // namespace strata::partition
