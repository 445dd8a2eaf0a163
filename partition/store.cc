// The rendezvous store over Boost.Asio. Wire format, both directions, is a
// 9-byte header (op or status, key length, value length; little-endian u32)
// followed by the key and value bytes.
#include "partition/store.h"

#include <utility>  // boost 1.74 asio uses std::exchange without including it

#include <boost/asio.hpp>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <map>
#include <set>
#include <thread>

#include "core/error.h"
#include "core/log.h"

namespace strata::partition {
namespace asio = boost::asio;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {
enum Op : uint8_t { kSet = 1, kGet = 2, kCheck = 3, kHello = 4, kBye = 5, kDead = 6, kAdd = 7 };
enum Status : uint8_t { kOk = 0, kMissing = 1, kBadRequest = 2 };
constexpr uint32_t kMaxKeyNbytes = 1 << 16;
constexpr uint32_t kMaxValueNbytes = 64u << 20;
constexpr size_t kHeaderNbytes = 9;

void put_u32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint32_t get_u32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

// The state shared by all sessions; touched only from the server's I/O thread.
struct ServerState {
  std::map<std::string, std::vector<char>> data;
  std::set<int> dead;
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, ServerState& state) : socket_(std::move(socket)), state_(state) {}
  void start() { read_header(); }

 private:
  void read_header() {
    auto self = shared_from_this();
    asio::async_read(socket_, asio::buffer(header_), [this, self](boost::system::error_code ec, size_t) {
      if (ec) return closed();
      uint32_t key_nbytes = get_u32(header_ + 1), value_nbytes = get_u32(header_ + 5);
      if (key_nbytes > kMaxKeyNbytes || value_nbytes > kMaxValueNbytes) return closed();
      body_.resize(key_nbytes + value_nbytes);
      asio::async_read(socket_, asio::buffer(body_), [this, self, key_nbytes](boost::system::error_code ec2, size_t) {
        if (ec2) return closed();
        handle(static_cast<uint8_t>(header_[0]), std::string(body_.data(), key_nbytes),
               std::vector<char>(body_.begin() + key_nbytes, body_.end()));
      });
    });
  }

  void handle(uint8_t op, const std::string& key, std::vector<char> value) {
    uint8_t status = kOk;
    std::vector<char> reply;
    switch (op) {
      case kSet: state_.data[key] = std::move(value); break;
      case kGet: {
        auto it = state_.data.find(key);
        if (it == state_.data.end()) status = kMissing; else reply = it->second;
        break;
      }
      case kCheck: {  // value: keys separated by '\0'
        size_t begin = 0;
        while (begin < value.size()) {
          size_t end = std::find(value.begin() + begin, value.end(), '\0') - value.begin();
          if (!state_.data.count(std::string(value.data() + begin, end - begin))) status = kMissing;
          begin = end + 1;
        }
        break;
      }
      case kHello: {
        int rank = -1;
        auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), rank);
        if (ec != std::errc() || end != key.data() + key.size() || rank < 0) status = kBadRequest; else rank_ = rank;
        break;
      }
      case kBye: said_bye_ = true; break;
      case kDead: {
        std::string text;
        for (int r : state_.dead) text += std::to_string(r) + ",";
        reply.assign(text.begin(), text.end());
        break;
      }
      case kAdd: {
        int64_t delta = 0, current = 0;
        if (value.size() == sizeof(delta)) std::memcpy(&delta, value.data(), sizeof(delta));
        auto& stored = state_.data[key];
        if (stored.size() == sizeof(current)) std::memcpy(&current, stored.data(), sizeof(current));
        current += delta;
        stored.resize(sizeof(current));
        std::memcpy(stored.data(), &current, sizeof(current));
        reply = stored;
        break;
      }
      default: status = kBadRequest;
    }
    out_.resize(kHeaderNbytes + reply.size());
    out_[0] = static_cast<char>(status);
    put_u32(out_.data() + 1, 0);
    put_u32(out_.data() + 5, static_cast<uint32_t>(reply.size()));
    std::copy(reply.begin(), reply.end(), out_.begin() + kHeaderNbytes);
    auto self = shared_from_this();
    asio::async_write(socket_, asio::buffer(out_), [this, self](boost::system::error_code ec, size_t) {
      if (ec) return closed();
      read_header();
    });
  }

  void closed() {
    if (rank_ >= 0 && !said_bye_) state_.dead.insert(rank_);
  }

  tcp::socket socket_;
  ServerState& state_;
  char header_[kHeaderNbytes] = {};
  std::vector<char> body_, out_;
  int rank_ = -1;
  bool said_bye_ = false;
};

tcp::endpoint resolve(asio::io_context& io, const std::string& host, int port) {
  boost::system::error_code ec;
  tcp::resolver resolver(io);
  auto results = resolver.resolve(host, std::to_string(port), ec);
  STRATA_CHECK(!ec && !results.empty(), kBadArgument, "cannot resolve rendezvous address {}:{}: {}", host,
               port, ec.message());
  return *results.begin();
}
}  // namespace

struct StoreServer::Impl {
  asio::io_context io;
  tcp::acceptor acceptor{io};
  ServerState state;
  std::thread thread;

  void accept() {
    acceptor.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
      if (ec) return;  // acceptor closed
      socket.set_option(tcp::no_delay(true));
      std::make_shared<Session>(std::move(socket), state)->start();
      accept();
    });
  }
};

StoreServer::StoreServer(const std::string& host, int port) : impl_(std::make_unique<Impl>()) {
  tcp::endpoint endpoint = resolve(impl_->io, host, port);
  boost::system::error_code ec;
  impl_->acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl_->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) impl_->acceptor.bind(endpoint, ec);
  if (!ec) impl_->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  STRATA_CHECK(!ec, kCommunication, "rendezvous store cannot listen on {}:{}: {}", host, port, ec.message());
  impl_->accept();
  impl_->thread = std::thread([impl = impl_.get()] { impl->io.run(); });
}

StoreServer::~StoreServer() {
  impl_->io.stop();
  impl_->thread.join();
}

int StoreServer::port() const { return impl_->acceptor.local_endpoint().port(); }

struct StoreClient::Impl {
  asio::io_context io;
  tcp::socket socket{io};
  std::string host;
  int port = 0;
  bool broken = false;

  // Runs the queued asynchronous operations until they finish or `deadline`
  // passes; on timeout the socket is closed so the client fails fast afterwards.
  bool run_until(Clock::time_point deadline) {
    io.restart();
    io.run_until(deadline);
    if (!io.stopped()) {
      boost::system::error_code ignored;
      socket.close(ignored);
      io.run();  // drain the cancelled handlers
      return false;
    }
    return true;
  }
};

StoreClient::StoreClient(const std::string& host, int port, int rank, std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>()), timeout_(timeout) {
  impl_->host = host;
  impl_->port = port;
  tcp::endpoint endpoint = resolve(impl_->io, host, port);
  auto deadline = Clock::now() + timeout;
  boost::system::error_code ec;
  for (;;) {
    ec = asio::error::timed_out;
    impl_->socket.async_connect(endpoint, [&](boost::system::error_code result) { ec = result; });
    impl_->run_until(deadline);
    if (!ec) break;
    boost::system::error_code ignored;
    impl_->socket.close(ignored);
    if (Clock::now() + std::chrono::milliseconds(20) >= deadline) {
      raise(ErrorCategory::kCommunication, "rank {} cannot reach the rendezvous store at {}:{} within {} ms: {}",
            rank, host, port, timeout.count(), ec.message());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  impl_->socket.set_option(tcp::no_delay(true));
  if (rank >= 0) {
    uint8_t status = 0;
    request(kHello, std::to_string(rank), {}, &status);
  }
}

StoreClient::~StoreClient() {
  try {
    uint8_t status = 0;
    if (!impl_->broken) request(kBye, "", {}, &status);
  } catch (const std::exception&) {
    // The server is gone; nobody is left to tell.
  }
}

std::string StoreClient::address() const { return fmt::format("{}:{}", impl_->host, impl_->port); }

std::vector<char> StoreClient::request(uint8_t op, const std::string& key, const std::vector<char>& value,
                                       uint8_t* status) {
  std::lock_guard<std::mutex> lock(mutex_);
  STRATA_CHECK(!impl_->broken, kCommunication,
               "rendezvous store at {} is unreachable after an earlier failure (rank 0 hosts it and may have died)",
               address());
  // The server closes the connection on oversized requests, which would look
  // like a dead store; refuse them here with the reason instead.
  STRATA_CHECK(key.size() <= kMaxKeyNbytes && value.size() <= kMaxValueNbytes, kBadArgument,
               "rendezvous store request for key '{}...' too large: key {} bytes (max {}), value {} bytes (max {})",
               key.substr(0, 64), key.size(), kMaxKeyNbytes, value.size(), kMaxValueNbytes);
  std::vector<char> out(kHeaderNbytes + key.size() + value.size());
  out[0] = static_cast<char>(op);
  put_u32(out.data() + 1, static_cast<uint32_t>(key.size()));
  put_u32(out.data() + 5, static_cast<uint32_t>(value.size()));
  std::memcpy(out.data() + kHeaderNbytes, key.data(), key.size());
  if (!value.empty()) std::memcpy(out.data() + kHeaderNbytes + key.size(), value.data(), value.size());

  char header[kHeaderNbytes];
  std::vector<char> reply;
  boost::system::error_code ec = asio::error::timed_out;
  asio::async_write(impl_->socket, asio::buffer(out), [&](boost::system::error_code wec, size_t) {
    if (wec) { ec = wec; return; }
    asio::async_read(impl_->socket, asio::buffer(header), [&](boost::system::error_code hec, size_t) {
      if (hec) { ec = hec; return; }
      // A length off the wire is bounded before it sizes an allocation: a peer
      // that is not a strata store (another service on MASTER_PORT) fails cleanly.
      const uint32_t reply_nbytes = get_u32(header + 5);
      if (reply_nbytes > kMaxValueNbytes) {
        ec = asio::error::message_size;
        return;
      }
      reply.resize(reply_nbytes);
      asio::async_read(impl_->socket, asio::buffer(reply), [&](boost::system::error_code bec, size_t) { ec = bec; });
    });
  });
  bool finished = impl_->run_until(Clock::now() + timeout_);
  if (!finished || ec) {
    impl_->broken = true;
    raise(ErrorCategory::kCommunication,
          "rendezvous store request for key '{}' to {} failed: {} (rank 0 hosts the store and may have died; "
          "or MASTER_ADDR:MASTER_PORT is another service)", key,
          address(), finished ? ec.message() : fmt::format("no reply within {} ms", timeout_.count()));
  }
  *status = static_cast<uint8_t>(header[0]);
  STRATA_CHECK(*status != kBadRequest, kInternal, "rendezvous store rejected request op {} key '{}'", op, key);
  return reply;
}

void StoreClient::set(const std::string& key, const std::vector<char>& data) {
  uint8_t status = 0;
  request(kSet, key, data, &status);
}

bool StoreClient::try_get(const std::string& key, std::vector<char>& value) {
  uint8_t status = 0;
  auto reply = request(kGet, key, {}, &status);
  if (status != kOk) return false;
  value = std::move(reply);
  return true;
}

std::vector<char> StoreClient::get(const std::string& key) {
  wait({key}, timeout_);
  std::vector<char> value;
  STRATA_CHECK(try_get(key, value), kInternal, "rendezvous key '{}' vanished", key);
  return value;
}

void StoreClient::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void StoreClient::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  std::vector<char> joined;
  for (const auto& key : keys) {
    joined.insert(joined.end(), key.begin(), key.end());
    joined.push_back('\0');
  }
  auto deadline = Clock::now() + timeout;
  auto pause = std::chrono::milliseconds(1);
  for (;;) {
    uint8_t status = 0;
    request(kCheck, "", joined, &status);
    if (status == kOk) return;
    if (Clock::now() >= deadline) {
      std::string names;
      for (const auto& key : keys) names += (names.empty() ? "" : ", ") + key;
      raise(ErrorCategory::kCommunication, "timed out after {} ms waiting for rendezvous keys [{}] at {}; {}",
            timeout.count(), names, address(), describe_dead_ranks(*this));
    }
    // Polling keeps the server stateless; the back-off bounds its load.
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
}

int64_t StoreClient::add(const std::string& key, int64_t delta) {
  std::vector<char> value(sizeof(delta));
  std::memcpy(value.data(), &delta, sizeof(delta));
  uint8_t status = 0;
  auto reply = request(kAdd, key, value, &status);
  int64_t result = 0;
  STRATA_CHECK(reply.size() == sizeof(result), kInternal, "bad reply size {} for add '{}'", reply.size(), key);
  std::memcpy(&result, reply.data(), sizeof(result));
  return result;
}

std::vector<int> StoreClient::dead_ranks() {
  uint8_t status = 0;
  auto reply = request(kDead, "", {}, &status);
  std::vector<int> ranks;
  std::string text(reply.begin(), reply.end());
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find(',', begin);
    ranks.push_back(std::stoi(text.substr(begin, end - begin)));
    begin = end + 1;
  }
  return ranks;
}

std::string describe_dead_ranks(StoreClient& store) {
  try {
    auto ranks = store.dead_ranks();
    if (ranks.empty()) return "no rank reported dead to the rendezvous store";
    std::string list;
    for (int r : ranks) list += (list.empty() ? "" : ", ") + std::to_string(r);
    return fmt::format("rank{} {} died (connection to the rendezvous store lost)", ranks.size() > 1 ? "s" : "",
                       list);
  } catch (const std::exception&) {
    return fmt::format("rendezvous store at {} unreachable (rank 0 hosts it and may have died)", store.address());
  }
}

}  // namespace strata::partition
