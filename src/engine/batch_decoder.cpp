#include "engine/batch_decoder.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"

namespace kvq {

TokenId sample_row(Sampler& sampler, const float* logits, int vocab, int pos) {
  for (int i = 0; i < vocab; ++i)
    KVQ_CHECK(std::isfinite(logits[i]), Errc::format, "the model produced a non-finite logit (", logits[i],
              " for token id ", i, ") at position ", pos, "; the model's weights or activations hold NaN/inf");
  const TokenId id = sampler.sample(logits, vocab);
  sampler.accept(id);
  return id;
}

void forward_and_sample(Model& model, kv::Cache& store, RunState& run, const StepBatch& batch,
                        Sampler* const* samplers, int vocab, bool backend_greedy, StepSample& out) {
  const size_t rows = batch.logit_rows.size();
  const int row_floats = model.config().vocab_size;
  KVQ_CHECK(vocab > 0 && vocab <= row_floats, Errc::invalid_argument, "sampling over ", vocab,
            " token ids of a model with ", row_floats);
  bool greedy = backend_greedy;
  for (size_t r = 0; r < rows && greedy; ++r) {
    const SamplingParams& p = samplers[r]->params();
    greedy = p.plain_greedy();
  }
  out.chosen.resize(rows);
  if (greedy) {
    // The backend picks each row's token (NaN never wins; the Sampler's
    // greedy rule).
    out.logits.clear();
    model.forward_argmax(batch, store, vocab, out.chosen.data(), run);
    for (size_t r = 0; r < rows; ++r) samplers[r]->accept(out.chosen[r]);
  } else {
    out.logits.resize(rows * size_t(row_floats));
    model.forward(batch, store, out.logits.data(), run);
    for (size_t r = 0; r < rows; ++r)
      out.chosen[r] = sample_row(*samplers[r], out.logits.data() + r * size_t(row_floats), vocab,
                                 batch.pos[size_t(batch.logit_rows[r])]);
  }
}

BatchDecoder::BatchDecoder(Model& model, std::unique_ptr<kv::Cache> store, int prefill_chunk)
    : model_(model),
      store_(std::move(store)),
      pool_(store_ ? store_->shape().n_pages() : 1),
      run_(model.new_run_state()),
      prefill_chunk_(prefill_chunk),
      vocab_(model.config().vocab_size) {
  KVQ_CHECK(store_, Errc::internal, "BatchDecoder needs a KV store");
  KVQ_CHECK(prefill_chunk > 0, Errc::invalid_argument, "--prefill-chunk must be positive");
  const kv::CacheShape& s = store_->shape();
  KVQ_CHECK(s.max_tokens == s.n_pages() * s.page_tokens, Errc::internal, "a KV pool of ", s.max_tokens,
            " tokens is not a whole number of ", s.page_tokens, "-token pages");
  if (s.window_pages > 0) exact_pool_ = std::make_unique<kv::PagePool>(s.exact_pages);
}

kv::BlockTable BatchDecoder::new_table() {
  const kv::CacheShape& s = store_->shape();
  if (!exact_pool_) return kv::BlockTable(pool_, s.page_tokens);
  return kv::BlockTable(pool_, s.page_tokens, *exact_pool_, s.n_pages(), s.window_pages);
}

void BatchDecoder::prefill(Sequence& s, int from, int to, float* logits) {
  const int P = store_->shape().page_tokens;
  for (int done = from; done < to;) {
    const int n = std::min(prefill_chunk_, to - done);
    StepBatch b;
    b.add_sequence(s.tokens.data() + done, n, done, s.table.pages().data(), int(s.table.pages().size()), P,
                   logits && done + n == to ? StepBatch::Logits::last : StepBatch::Logits::none);
    model_.forward(b, *store_, logits, *run_);
    done += n;
    s.cached = done;
  }
}

BatchDecoder::Sequence& BatchDecoder::get(int seq) {
  KVQ_CHECK(seq >= 0 && seq < int(seqs_.size()) && seqs_[size_t(seq)]->live, Errc::invalid_argument,
            "no live sequence ", seq);
  return *seqs_[size_t(seq)];
}
const BatchDecoder::Sequence& BatchDecoder::get(int seq) const {
  KVQ_CHECK(seq >= 0 && seq < int(seqs_.size()) && seqs_[size_t(seq)]->live, Errc::invalid_argument,
            "no live sequence ", seq);
  return *seqs_[size_t(seq)];
}

int BatchDecoder::add(const std::vector<TokenId>& prompt, const SamplingParams& sampling) {
  KVQ_CHECK(!prompt.empty(), Errc::invalid_argument, "the prompt is empty (it tokenized to no tokens)");
  sampling.validate();
  auto s = std::make_unique<Sequence>(Sequence{new_table(), prompt, 0, Sampler(sampling), {}, true});
  // A new table's pages: packed before the prompt's window, exact in it (no
  // moves); throws (and keeps nothing) when a pool is full.
  std::vector<kv::PageMove> none;
  s->table.reserve(int(prompt.size()), &none);
  for (TokenId id : prompt) s->sampler.accept(id);
  std::vector<float> logits(static_cast<size_t>(vocab_));
  const int total = int(prompt.size());
  prefill(*s, 0, total, logits.data());
  s->tokens.push_back(sample_row(s->sampler, logits.data(), vocab_, total - 1));
  s->logits = std::move(logits);
  seqs_.push_back(std::move(s));
  return int(seqs_.size()) - 1;
}

int BatchDecoder::add_copy(int seq, const SamplingParams& sampling) {
  sampling.validate();
  const Sequence& from = get(seq);
  auto s = std::make_unique<Sequence>(Sequence{new_table(), from.tokens, from.cached, Sampler(sampling),
                                               from.logits, true});
  s->table.reserve_like(from.table, from.cached);  // throws (and keeps nothing) when a pool is full
  const std::vector<int32_t>& src = from.table.pages();
  const std::vector<int32_t>& dst = s->table.pages();
  store_->copy_pages(src.data(), dst.data(), int(dst.size()));
  for (TokenId id : s->tokens) s->sampler.accept(id);
  seqs_.push_back(std::move(s));
  return int(seqs_.size()) - 1;
}

void BatchDecoder::step() {
  const std::vector<int> ids = live_sequences();
  if (ids.empty()) return;
  const int P = store_->shape().page_tokens;
  // Room for one more token of every sequence, all or none: a full pool
  // leaves every table as it was (pages past a sequence's tokens go back at
  // its next rewind or removal; moves are undone by packing them, which
  // changes nothing its next step reads).
  try {
    for (int i : ids) {
      Sequence& s = *seqs_[size_t(i)];
      s.table.reserve(s.cached + 1, &moves_);
    }
  } catch (...) {
    kv::pack_moved_pages(*store_, moves_);
    throw;
  }
  kv::pack_moved_pages(*store_, moves_);
  batch_.clear();
  for (int i : ids) {
    Sequence& s = *seqs_[size_t(i)];
    batch_.add_sequence(&s.tokens.back(), 1, s.cached, s.table.pages().data(), int(s.table.pages().size()), P,
                        StepBatch::Logits::last);
  }
  samplers_.clear();
  for (int i : ids) samplers_.push_back(&seqs_[size_t(i)]->sampler);
  forward_and_sample(model_, *store_, *run_, batch_, samplers_.data(), vocab_, !keep_logits_, sampled_);
  for (size_t r = 0; r < ids.size(); ++r) {
    Sequence& s = *seqs_[size_t(ids[r])];
    ++s.cached;
    s.tokens.push_back(sampled_.chosen[r]);
    if (sampled_.logits.empty())
      s.logits.clear();
    else
      s.logits.assign(sampled_.logits.begin() + ptrdiff_t(r * size_t(vocab_)),
                      sampled_.logits.begin() + ptrdiff_t((r + 1) * size_t(vocab_)));
  }
  ++steps_;
}

void BatchDecoder::remove(int seq) {
  Sequence& s = get(seq);
  s.table.clear();
  s.live = false;
  s.logits = {};
}

void BatchDecoder::rewind(int seq, int n) {
  Sequence& s = get(seq);
  KVQ_CHECK(n >= 1 && n <= s.cached, Errc::invalid_argument, "rewind of sequence ", seq, " to ", n, " tokens (",
            s.cached, " cached)");
  s.tokens.resize(size_t(n) + 1);
  s.cached = n;
  s.table.shrink(n + 1);  // keeps the page the next token is written to
  s.sampler.reset();
  for (TokenId id : s.tokens) s.sampler.accept(id);
  if (!exact_pool_) return;
  // The window of the next step starts at page `first`; pages of it that were
  // packed since are dropped and their tokens before n prefilled again.
  const int P = store_->shape().page_tokens;
  const int first = kv::window_first_page(n + 1, P, store_->shape().window_pages);
  if (s.table.exact_from() <= first) return;
  const int from = first * P;
  s.table.shrink(from);
  std::vector<kv::PageMove> none;
  s.table.reserve(n + 1, &none);  // pages from `first` on are exact again; nothing leaves
  s.cached = from;
  prefill(s, from, n, nullptr);
}

int BatchDecoder::live() const { return int(live_sequences().size()); }

std::vector<int> BatchDecoder::live_sequences() const {
  std::vector<int> r;
  for (size_t i = 0; i < seqs_.size(); ++i)
    if (seqs_[i]->live) r.push_back(int(i));
  return r;
}

const std::vector<TokenId>& BatchDecoder::tokens(int seq) const { return get(seq).tokens; }
const std::vector<float>& BatchDecoder::last_logits(int seq) const { return get(seq).logits; }
int BatchDecoder::cached(int seq) const { return get(seq).cached; }

}  // namespace kvq
