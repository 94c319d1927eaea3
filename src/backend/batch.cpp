#include "backend/batch.hpp"

#include "core/error.hpp"

namespace kvq {

void StepBatch::add_sequence(const int32_t* ids, int n, int p, const int32_t* pages, int n_pages, int page_tokens,
                             Logits logits) {
  KVQ_CHECK(n > 0, Errc::invalid_argument, "a sequence in a step needs at least one token");
  KVQ_CHECK(p >= 0 && page_tokens > 0, Errc::invalid_argument, "step batch: position ", p, ", page size ",
            page_tokens);
  KVQ_CHECK(kv::pages_for(p + n, page_tokens) <= n_pages, Errc::out_of_range, "tokens [", p, ", ", p + n,
            ") do not fit the sequence's ", n_pages, " KV pages of ", page_tokens, " tokens");
  const int first = n_tok();
  const int s = n_seq();
  const kv::PageGeometry geo{1, page_tokens};
  for (int i = 0; i < n; ++i) {
    token.push_back(ids[i]);
    pos.push_back(p + i);
    seq.push_back(s);
    slot.push_back(geo.slot_of(pages, p + i));
  }
  runs.push_back({pages, n_pages, first, n, p});
  if (logits == Logits::last) logit_rows.push_back(first + n - 1);
  if (logits == Logits::all)
    for (int i = 0; i < n; ++i) logit_rows.push_back(first + i);
}

void StepBatch::clear() {
  token.clear();
  pos.clear();
  seq.clear();
  slot.clear();
  runs.clear();
  logit_rows.clear();
}

StepBatch StepBatch::one_sequence(const int32_t* ids, int n, int p, const std::vector<int32_t>& pages,
                                  int page_tokens, Logits logits) {
  StepBatch b;
  b.add_sequence(ids, n, p, pages.data(), int(pages.size()), page_tokens, logits);
  return b;
}

bool StepBatch::is_one_contiguous_sequence() const {
  if (runs.size() != 1 || runs[0].first != 0) return false;
  for (int i = 0; i < n_tok(); ++i)
    if (slot[size_t(i)] != pos[size_t(i)]) return false;
  return true;
}

}  // namespace kvq
