// One forward step over one or more sequences (docs/architecture.md, "The
// step batch"): what every backend op and the forward pass take instead of a
// single sequence's (pos, n).
//
// A sequence's tokens are consecutive rows of the step, in position order
// (one kv::QueryRun per sequence); every token has its own position and its
// slot in the KV store (kv/page.hpp: page * page_tokens + entry), found
// through its sequence's block table. The block tables are borrowed: they
// must not change while the step runs.
#pragma once

#include <cstdint>
#include <vector>

#include "kv/cache.hpp"

namespace kvq {

struct StepBatch {
  std::vector<int32_t> token;       // [n_tok] token ids
  std::vector<int32_t> pos;         // [n_tok] position in its sequence
  std::vector<int32_t> seq;         // [n_tok] index into runs
  std::vector<int32_t> slot;        // [n_tok] where its K/V row is written
  std::vector<kv::QueryRun> runs;   // [n_seq] each sequence's rows and block table
  std::vector<int32_t> logit_rows;  // rows whose logits are wanted, ascending

  int n_tok() const { return int(token.size()); }
  int n_seq() const { return int(runs.size()); }

  // Appends n tokens of one sequence at positions pos .. pos + n - 1 over
  // the block table pages[0..n_pages) of a store with page_tokens rows per
  // page. logits: none, the last token's, or every token's.
  enum class Logits { none, last, all };
  void add_sequence(const int32_t* ids, int n, int pos, const int32_t* pages, int n_pages, int page_tokens,
                    Logits logits);
  void clear();

  // The one-sequence case: tokens [pos, pos + n) of a store held in page
  // order (Session's identity table, `pages` = kv::identity_pages(...)).
  static StepBatch one_sequence(const int32_t* ids, int n, int pos, const std::vector<int32_t>& pages,
                                int page_tokens, Logits logits);
  // True when this is one sequence whose slots are its positions (an
  // identity table): the CUDA backend's fused single-token ops and
  // recorded steps run this case; other batches take its paged path.
  bool is_one_contiguous_sequence() const;
};

}  // namespace kvq
