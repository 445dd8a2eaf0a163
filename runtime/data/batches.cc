// The two batch sources: token streams (StreamBatches) and prepared documents
// (DocumentBatches, with packing), and open_batches, which picks one.
#include "runtime/data/batches.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"
#include "kernels/ops.h"
#include "runtime/data/prepared_file.h"
#include "runtime/data/sample_order.h"

namespace strata::data {

int64_t Batches::eval_batches() const {
  const int64_t per_batch = options_.micro_batch * options_.world;
  return (windows_ + per_batch - 1) / per_batch;
}

int64_t Batches::eval_targets(int64_t batches) const {
  const int64_t end = std::min(windows_, batches * options_.micro_batch * options_.world);
  int64_t n = 0;
  for (int64_t w = 0; w < end; ++w) n += targets_of_window(w);
  return n;
}

int64_t Batches::training_window(uint64_t g) const { return window_of_sample(g, windows_, options_.seed); }

namespace {

void check_options(const BatchOptions& o) {
  STRATA_CHECK(o.seq > 0 && o.micro_batch > 0 && o.world > 0 && o.rank >= 0 && o.rank < o.world, kBadArgument,
               "batches: bad options seq={} micro_batch={} rank={} world={}", o.seq, o.micro_batch, o.rank, o.world);
}

// Rows of sample g of a step: rank r holds samples [first, first + micro_batch).
uint64_t first_sample_of_rank(uint64_t base, const BatchOptions& o) {
  return base + static_cast<uint64_t>(o.rank * o.micro_batch);
}

void resize(Batch& b, const BatchOptions& o, bool packed) {
  const auto rows = static_cast<size_t>(o.micro_batch * o.seq);
  b.ids.assign(rows, 0);
  b.targets.assign(rows, ops::kIgnoreIndex);
  if (packed) {
    b.positions.resize(rows);
    for (size_t r = 0; r < rows; ++r) b.positions[r] = static_cast<int32_t>(r % static_cast<size_t>(o.seq));
  } else {
    b.positions.clear();
  }
}

}  // namespace

void Batches::next(Batch& b) {
  resize(b, options_, packed_);
  const uint64_t first = first_sample_of_rank(cursor_, options_);
  for (int64_t s = 0; s < options_.micro_batch; ++s) fill(b, s, training_window(first + static_cast<uint64_t>(s)));
  cursor_ += static_cast<uint64_t>(options_.micro_batch * options_.world);
}

void Batches::eval_batch(int64_t k, Batch& b) const {
  resize(b, options_, packed_);
  const uint64_t first = first_sample_of_rank(static_cast<uint64_t>(k * options_.micro_batch * options_.world),
                                              options_);
  for (int64_t s = 0; s < options_.micro_batch; ++s) {
    const int64_t w = static_cast<int64_t>(first) + s;
    if (w < windows_) fill(b, s, w);
  }
}

void Batches::refuse_id(int64_t token, const std::string& where, const RefusedIds& refused) const {
  std::string key;
  for (const auto& r : refused) {
    if (r.second == token) key += (key.empty() ? "" : ", ") + r.first;
  }
  raise(ErrorCategory::kBadArgument,
        "{}: token {} {} is the model's image placeholder ({} of config.json): strata trains the text model of a "
        "gemma3 checkpoint and cannot fill images; prepare the data without them. Checked before step 1",
        path_, token, where, key);
}

namespace {

// ---- token streams ----------------------------------------------------------------------
class StreamBatches final : public Batches {
 public:
  StreamBatches(TokenFile file, BatchOptions options) : Batches(file.path(), options, /*packed=*/false), file_(std::move(file)) {
    STRATA_CHECK(file_.size() >= options.seq + 1, kBadArgument,
                 "{}: {} tokens is shorter than one sample of --seq {} + 1 (ids and the next token)", file_.path(),
                 file_.size(), options.seq);
    windows_ = (file_.size() - 1) / options.seq;
  }

  void check_ids_in(int64_t vocab, const RefusedIds& refused) const override {
    const int64_t largest = file_.format() == TokenFormat::kText  ? 255
                            : file_.format() == TokenFormat::kU32 ? int64_t{0xffffffff}
                                                                  : int64_t{0xffff};
    bool possible = largest >= vocab;  // else the format cannot hold an id >= vocab
    for (const auto& r : refused) possible = possible || r.second <= largest;
    if (!possible) return;
    const int64_t n = file_.size(), begin = n * options_.rank / options_.world,
                  end = n * (options_.rank + 1) / options_.world;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t token = file_.token(i);
      for (const auto& r : refused) {
        if (token == r.second) refuse_id(token, fmt::format("at position {}", i), refused);
      }
      if (token >= vocab) {
        raise(ErrorCategory::kBadArgument,
              "{}: token {} at position {} is outside the model's vocabulary [0, {}) (vocab_size of the model "
              "config); checked before step 1",
              file_.path(), token, i, vocab);
      }
    }
  }

  int64_t targets_of_window(int64_t) const override { return options_.seq; }

  std::string describe() const override {
    return fmt::format("{} ({} tokens, {}, {} samples per epoch)", file_.path(), file_.size(),
                       token_format_name(file_.format()), windows_);
  }

 private:
  void fill(Batch& b, int64_t s, int64_t window) const override {
    const int64_t seq = options_.seq, start = window * seq;
    for (int64_t t = 0; t <= seq; ++t) {
      const auto tok = static_cast<int32_t>(file_.token(start + t));
      if (t < seq) b.ids[static_cast<size_t>(s * seq + t)] = tok;
      if (t > 0) b.targets[static_cast<size_t>(s * seq + t - 1)] = tok;
    }
  }

  TokenFile file_;
};

// ---- prepared documents -----------------------------------------------------------------
class DocumentBatches final : public Batches {
 public:
  DocumentBatches(PreparedFile file, BatchOptions options)
      : Batches(file.path(), options, /*packed=*/true), file_(std::move(file)) {
    // Windows: [first document, end document), next-fit in file order.
    const int64_t seq = options.seq;
    int64_t d = 0;
    const int64_t docs = file_.documents();
    while (d < docs) {
      const int64_t first = d;
      int64_t used = 0, trained = 0;
      do {
        const int64_t n = length(d);
        if (used + n > seq) break;
        used += n;
        trained += trained_targets(d);
        ++d;
      } while (options.packing && d < docs);
      if (trained > 0) {
        starts_.push_back(first);
        ends_.push_back(d);
      } else {
        dropped_ += d - first;
      }
    }
    for (int64_t i = 0; i < docs; ++i) cut_ += file_.document_end(i) - file_.document_begin(i) > seq;
    windows_ = static_cast<int64_t>(starts_.size());
    STRATA_CHECK(windows_ > 0, kBadArgument, "{}: no document has a trained token within --seq {} tokens",
                 file_.path(), seq);
  }

  void check_ids_in(int64_t vocab, const RefusedIds& refused) const override {
    const int64_t n = file_.tokens(), begin = n * options_.rank / options_.world,
                  end = n * (options_.rank + 1) / options_.world;
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t token = file_.token(i);
      for (const auto& r : refused) {
        if (static_cast<int64_t>(token) != r.second) continue;
        // Its document: the line of the JSONL it was prepared from, blank lines aside.
        int64_t d = 0;
        while (d + 1 < file_.documents() && file_.document_end(d) <= i) ++d;
        refuse_id(token,
                  fmt::format("(token {} of the file) in document {}, line {} of the JSONL it was prepared from "
                              "(blank lines not counted)",
                              i, d, d + 1),
                  refused);
      }
      if (static_cast<int64_t>(token) >= vocab) {
        raise(ErrorCategory::kBadArgument,
              "{}: token {} (token {} of the file) is outside the model's vocabulary [0, {}) (vocab_size of the "
              "model config): was it prepared with another model's tokenizer? Checked before step 1",
              file_.path(), token, i, vocab);
      }
    }
  }

  int64_t targets_of_window(int64_t w) const override {
    int64_t n = 0;
    for (int64_t d = starts_[static_cast<size_t>(w)]; d < ends_[static_cast<size_t>(w)]; ++d) n += trained_targets(d);
    return n;
  }

  std::string describe() const override {
    int64_t trained = 0;
    for (int64_t d = 0; d < file_.documents(); ++d) trained += trained_targets(d);
    return fmt::format("{} (prepared: {} documents, {} tokens, {} trained; {} windows of {} tokens{}{}{})",
                       file_.path(), file_.documents(), file_.tokens(), trained, windows_, options_.seq,
                       options_.packing ? ", packed" : ", one document each",
                       cut_ > 0 ? fmt::format("; {} documents longer than --seq cut to it", cut_) : "",
                       dropped_ > 0 ? fmt::format("; {} documents with nothing to train within --seq dropped",
                                                  dropped_)
                                    : "");
  }

 private:
  int64_t length(int64_t d) const {
    return std::min(file_.document_end(d) - file_.document_begin(d), options_.seq);
  }
  // Targets document d trains within its first `length` tokens (its first token predicts nothing).
  int64_t trained_targets(int64_t d) const {
    const int64_t begin = file_.document_begin(d), n = length(d);
    int64_t count = 0;
    for (int64_t t = 1; t < n; ++t) count += file_.trained(begin + t);
    return count;
  }

  void fill(Batch& b, int64_t s, int64_t window) const override {
    const int64_t seq = options_.seq;
    int64_t at = s * seq;
    for (int64_t d = starts_[static_cast<size_t>(window)]; d < ends_[static_cast<size_t>(window)]; ++d) {
      const int64_t begin = file_.document_begin(d), n = length(d);
      for (int64_t t = 0; t < n; ++t) {
        const auto r = static_cast<size_t>(at + t);
        b.ids[r] = static_cast<int32_t>(file_.token(begin + t));
        b.positions[r] = static_cast<int32_t>(t);
        b.targets[r] = t + 1 < n && file_.trained(begin + t + 1) ? static_cast<int32_t>(file_.token(begin + t + 1))
                                                                 : ops::kIgnoreIndex;
      }
      at += n;
    }
    // Padding: one more "document" of ignored targets, positions from 0.
    for (int64_t r = at; r < (s + 1) * seq; ++r) b.positions[static_cast<size_t>(r)] = static_cast<int32_t>(r - at);
  }

  PreparedFile file_;
  std::vector<int64_t> starts_, ends_;  // each window's documents
  int64_t cut_ = 0, dropped_ = 0;
};

// The first bytes of a file (fewer when it is shorter).
std::vector<unsigned char> head_of(const std::string& path) {
  std::vector<unsigned char> head(8);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) raise_errno(errno, "open data file " + path);
  const ssize_t n = ::read(fd, head.data(), head.size());
  ::close(fd);
  head.resize(n > 0 ? static_cast<size_t>(n) : 0);
  return head;
}

}  // namespace

std::unique_ptr<Batches> open_batches(const std::string& path, const std::string& format, BatchOptions options) {
  check_options(options);
  bool prepared = format == "prepared";
  if (format == "auto") {
    const std::vector<unsigned char> head = head_of(path);
    prepared = is_prepared_data(head.data(), head.size());
  }
  if (prepared) return std::make_unique<DocumentBatches>(PreparedFile::open(path), options);
  STRATA_CHECK(options.packing, kBadArgument,
               "--no-packing applies to prepared data (documents); {} is a token stream", path);
  return std::make_unique<StreamBatches>(TokenFile::open(path, parse_token_format(format)), options);
}

}  // namespace strata::data
